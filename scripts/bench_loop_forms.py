"""Where a speculative step's host time goes: the same jitted step driven three ways, each paired with AR.

    python scripts/bench_loop_forms.py --random-9b --gammas 2,8 --out DIR     (H200)
    python scripts/bench_loop_forms.py --model checkpoints/tiny-qwen35-code --methods ngram,mtp --gammas 4 --out DIR
    python scripts/bench_loop_forms.py --random-9b --tiny --gammas 2 --new-tokens 16 --out /tmp/x   (CPU smoke)

Forms (each --methods drafter, forced acceptance p, exact path, replay rollback: the default step):
  while       `speculative._spec_loop`: the step inside `lax.while_loop` (what `generate` runs): the host reads
              the loop predicate back after every step before it launches the next one;
  host-async  the step as one jitted call (`spec_step_jit`) dispatched from Python as many times as the while
              loop took steps, nothing read back until the end: the host enqueues ahead of the device;
  host-sync   the same, reading the done flag back after every step (a host loop with the while loop's sync).
The outputs are those of forced acceptance: meaningless. With --kernel-profile each form's run is also traced and
the result keeps, kernel by kernel, the device time, its idle stretches and what the host did during them.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_spec  # noqa: E402

from specdec_jax.harness import alternate, compile_timed, result_header, write_results  # noqa: E402
from specdec_jax.profiling import device_kernel_profile, kernel_profile_markdown  # noqa: E402
from specdec_jax.decoding.compiled import compiler_options  # noqa: E402

FORMS = ("while", "host-async", "host-sync")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_spec.add_model_source(ap)
    ap.add_argument("--methods", default="ngram", help="drafters, comma-separated (bench_spec.py's curve methods)")
    ap.add_argument("--gammas", default="2,8")
    ap.add_argument("--p", type=float, default=1.0, help="forced acceptance probability")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kernel-profile", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not 0.0 <= args.p <= 1.0:
        raise SystemExit(f"bench_loop_forms.py: --p must lie in [0, 1]; got {args.p}")
    gammas = [int(g) for g in args.gammas.split(",")]

    from specdec_jax.decoding import autoregressive as ar_mod
    from specdec_jax.decoding import speculative as sp
    from specdec_jax.decoding.decode_shape import choose_decode_rows
    from specdec_jax.decoding.sampling import SamplingConfig
    from specdec_jax.models.family import QWEN35

    model, name = bench_spec.model_from_args(args)
    methods = args.methods.split(",")
    cfg, params = model.config, model.params
    n_new = args.new_tokens
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.prompt_len)), jnp.int32)
    key = jax.random.PRNGKey(0)
    sampling = SamplingConfig()
    drafters = {m: bench_spec.curve_drafter(model, m) for m in methods}
    rows = {g: choose_decode_rows(g, None, "qwen3_5") for g in gammas}
    ar_rows = choose_decode_rows(0, None, "qwen3_5")
    max_len = args.prompt_len + n_new + max(max(gammas) + 1, *rows.values())
    p = jnp.float32(args.p)

    static_ap = dict(ops=ar_mod.ar_ops(QWEN35), cfg=cfg, max_len=max_len, state_dtype=model.dtype)
    logits_s, state_s = jax.eval_shape(functools.partial(ar_mod._prefill, **static_ap), params, prompt)
    static_ad = dict(ops=ar_mod.ar_ops(QWEN35, ar_rows), cfg=cfg, max_new_tokens=n_new, sampling=sampling, eos_ids=())
    jobs = {"ar_prefill": lambda: ar_mod._prefill.lower(params, prompt, **static_ap),
            "ar_loop": lambda: ar_mod._decode_loop.lower(params, state_s, logits_s, key, **static_ad)}
    settings = [(m, g) for m in methods for g in gammas]
    for m, g in settings:
        static_p = dict(cfg=cfg, max_len=max_len, sampling=sampling, eos_ids=(), state_dtype=model.dtype, gamma=g,
                        max_new_tokens=n_new, drafter=drafters[m], impl="auto")
        shapes = jax.eval_shape(functools.partial(sp._spec_prefill, **static_p), params, prompt, key)
        static_l = dict(cfg=cfg, sampling=sampling, eos_ids=(), gamma=g, max_new_tokens=n_new, drafter=drafters[m],
                        rollback="replay", impl="auto", decode_rows=rows[g])
        static_step = dict(drafter=drafters[m], gamma=g, sampling=sampling, rollback="replay", max_new_tokens=n_new,
                           eos_ids=(), impl="auto", decode_rows=rows[g])
        jobs["prefill", (m, g)] = functools.partial(sp._spec_prefill.lower, params, prompt, key, **static_p)
        jobs["while", (m, g)] = functools.partial(sp._spec_loop.lower, params, shapes[0], shapes[1], key, p,
                                                  **static_l)
        jobs["step", (m, g)] = functools.partial(sp.spec_step_jit.lower, params, cfg, shapes[0], shapes[1], key,
                                                 accept_p=p, **static_step)
    t0 = time.perf_counter()
    exe, compile_s = compile_timed({k: make() for k, make in jobs.items()}, workers=12,
                                   options=compiler_options("qwen3_5"))
    print(f"compiled {len(exe)} functions in {time.perf_counter() - t0:.0f} s", flush=True)

    def ar_run():
        logits, state = exe["ar_prefill"](params, prompt)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        jax.block_until_ready(exe["ar_loop"](params, state, logits, key)[0])
        return (time.perf_counter() - t0) / (n_new - 1)

    def fresh(g):
        state, dstate = exe["prefill", g](params, prompt, key)
        return jax.block_until_ready((state, dstate))

    def while_loop(g, state, dstate):
        return lambda: exe["while", g](params, state, dstate, key, p)

    def host_loop(g, state, dstate, steps, sync):
        keys = list(jax.random.split(key, steps))  # made before the clock starts

        def run():
            s, d = state, dstate
            for i in range(steps):
                s, d, _, _ = exe["step", g](params, s, d, keys[i], accept_p=p)
                if sync:
                    bool(s.done[0])
            return s
        return run

    steps_of = {}

    def timed(form, g):
        state, dstate = fresh(g)
        if form == "while":
            run = while_loop(g, state, dstate)
        else:
            run = host_loop(g, state, dstate, steps_of[g], sync=form == "host-sync")
        t0 = time.perf_counter()
        out = jax.block_until_ready(run())
        sec = time.perf_counter() - t0
        if form == "while":
            steps_of[g] = int(out[1].steps)
        return sec / steps_of[g]

    header = result_header(name, " ".join(["python", *sys.argv]))
    result = {**header, "model": name, "p": args.p, "new_tokens": n_new, "prompt_len": args.prompt_len,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "compile_seconds": compile_s, "rows": []}
    ar_run()
    ar_times = [ar_run() for _ in range(args.repeats)]
    for g in settings:
        for form in FORMS:
            timed(form, g)  # warm-up (and the while loop's step count)
        runs = alternate({form: functools.partial(timed, form, g) for form in FORMS} | {"ar": ar_run}, args.repeats)
        ar_times += runs.pop("ar")
        ar_sec = float(np.median(ar_times))
        for form, secs in runs.items():
            row = {"method": g[0], "gamma": g[1], "form": form, "steps": steps_of[g], "ms_per_step": 1e3 * float(np.median(secs)),
                   "ms_per_step_all": [1e3 * s for s in secs], "ar_ms_per_token": 1e3 * ar_sec,
                   "step_over_ar": float(np.median(secs)) / ar_sec}
            result["rows"].append(row)
            print(row, flush=True)
        result["ar_ms_per_token"] = 1e3 * float(np.median(ar_times))
        save(result, args)
    if args.kernel_profile:
        profiles = result["kernel_profiles"] = {}
        for g in settings:
            for form in FORMS:
                state, dstate = fresh(g)
                run = (while_loop(g, state, dstate) if form == "while"
                       else host_loop(g, state, dstate, steps_of[g], sync=form == "host-sync"))
                profiles[f"{g[0]} gamma {g[1]}, {form}, per step"] = device_kernel_profile(run, steps_of[g])
                save(result, args)
    save(result, args, echo=True)


def save(result, args, echo=False):
    md = [f"# One speculative step, three ways to drive it ({result['model']})", "",
          f"{result['device']} · jax {result['jax']} · commit {result['git_commit']} · {result['date']}", "",
          f"`{result['command']}`", "",
          f"drafts of each method, forced acceptance p = {result['p']:g} (outputs meaningless), exact path, replay rollback; "
          f"{result['new_tokens']} new tokens after a {result['prompt_len']}-token prompt; medians, each form "
          f"alternated with the others and with AR in one run. `while`: the step in `lax.while_loop` (generate's "
          f"loop; the host reads the predicate back after each step); `host-async`: the jitted step dispatched from "
          f"Python as many times, nothing read back until the end; `host-sync`: the same, reading the done flag "
          f"after each step.", "",
          f"AR: {result.get('ar_ms_per_token', float('nan')):.3f} ms per token.", "",
          "| method | gamma | form | steps | ms / step | step / AR token |", "|---|---|---|---|---|---|"]
    md += [f"| {r['method']} | {r['gamma']} | {r['form']} | {r['steps']} | {r['ms_per_step']:.3f} | {r['step_over_ar']:.3f} |"
           for r in result["rows"]]
    if result.get("kernel_profiles"):
        md += ["", "## Traced (one run each)", ""] + kernel_profile_markdown(result["kernel_profiles"])
    write_results(args.out, f"loop_forms_{result['model']}{args.tag}", result, "\n".join(md) + "\n", echo=echo)


if __name__ == "__main__":
    main()
