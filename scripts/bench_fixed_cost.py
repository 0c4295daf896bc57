"""What one decode call costs beyond its steps: AR and speculative loops timed at several generation lengths.

    python scripts/bench_fixed_cost.py --random-9b --gamma 8 --tokens 24,48,96,192 --out DIR          (H200)
    python scripts/bench_fixed_cost.py --random-9b --tiny --gamma 2 --tokens 8,16 --repeats 1 --out /tmp/x  (CPU smoke)

Every loop call is timed alone (prefill excluded: from the dispatch of the loop to its tokens being ready), at each
of --tokens new tokens; one cache length for all, so every step has the same shapes. A least-squares line
seconds = fixed + per_step * steps, per loop (AR and speculative, forced acceptance --p, exact path, replay
rollback), says what a call costs beyond its steps. Per-step cost figures that divide a call's time by its step
count carry fixed / steps: a short speculative call (few steps) pays it on few steps.
--donate off also runs both loops compiled without donating their state (the loop then starts from copies in
its own buffers), to see whether the fixed cost follows the state's buffers. --trace also traces one call of each
loop at the shortest length (jax.profiler): kernel by kernel, and what the host did from the call to its first
kernel and from its last kernel to the return (profiling.call_edges), where a fixed cost shows. --hlo also writes
each loop's optimized module (hlo_ar.txt, hlo_spec.txt) and lists its while loops, their known trip counts and
what their bodies launch (profiling.while_loops): without a known trip count XLA's GPU runtime drives a loop from
the host, reading its predicate back before every step. --loop-option KEY=VALUE (repeatable) adds a variant of
both loops compiled with those XLA options, timed beside the default.
The outputs are those of forced acceptance: meaningless.
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
from specdec_jax.profiling import (device_kernel_profile, kernel_profile_markdown,  # noqa: E402
                                   while_loops)

AR_STATIC = ("ops", "cfg", "max_new_tokens", "sampling", "eos_ids")
SPEC_STATIC = ("cfg", "sampling", "eos_ids", "gamma", "max_new_tokens", "drafter", "rollback", "impl", "decode_rows",
               "defer")


class WithOptions:
    """A lowering compiled with XLA compiler options (`compile_timed` calls .compile())."""

    def __init__(self, lower, options: dict):
        self.lowered, self.options = lower(), options

    def compile(self, compiler_options=None):  # compile_timed's options, this lowering's on top
        return self.lowered.compile(compiler_options={**(compiler_options or {}), **self.options} or None)


def qwen_options() -> dict:
    from specdec_jax.decoding.compiled import compiler_options
    return compiler_options("qwen3_5")


def prefill_into(prefill, n_args: int, static: dict):
    """`prefill` with one more positional argument after its first n_args: the previous call's final state, donated
    and never read, so XLA writes the new state (the same shapes) over its buffers."""
    def run(*args, **kw):
        return prefill(*args[:n_args], **kw)
    return jax.jit(run, static_argnames=tuple(static), donate_argnums=(n_args,), keep_unused=True)


def fit_line(steps, seconds):
    """Least squares seconds = fixed + per_step * steps -> (fixed s, per_step s, max residual s)."""
    a = np.stack([np.ones(len(steps)), np.asarray(steps, float)], axis=1)
    coef, *_ = np.linalg.lstsq(a, np.asarray(seconds, float), rcond=None)
    resid = np.asarray(seconds) - a @ coef
    return float(coef[0]), float(coef[1]), float(np.abs(resid).max())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_spec.add_model_source(ap)
    ap.add_argument("--method", default="ngram", help="the drafter (bench_spec.py's curve methods)")
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--p", type=float, default=1.0, help="forced acceptance probability")
    ap.add_argument("--tokens", default="24,48,96,192", help="new-token counts, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--donate", default="on", help="'on', or 'on,off': also the loops compiled without donation")
    ap.add_argument("--loop-option", action="append", default=[], metavar="KEY=VALUE[;KEY=VALUE]",
                    help="XLA compiler options for both loops (repeatable): each adds a variant compiled with them, "
                         "timed beside the default (e.g. xla_gpu_enable_command_buffer=FUSION,...,WHILE,CONDITIONAL)")
    ap.add_argument("--trace", action="store_true", help="also trace one call of each loop at the shortest length")
    ap.add_argument("--hlo", action="store_true", help="also write the loops' optimized HLO and list their while "
                    "loops (trip count, what the body launches)")
    ap.add_argument("--hlo-only", action="store_true", help="with --hlo: compile and write the HLO, time nothing")
    ap.add_argument("--recycle", action="store_true",
                    help="also a variant whose prefill writes its state over the previous call's final state (donated, "
                         "unread): every call of a loop then gets the same state buffers")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not 0.0 <= args.p <= 1.0:
        raise SystemExit(f"bench_fixed_cost.py: --p must lie in [0, 1]; got {args.p}")
    tokens = sorted({int(t) for t in args.tokens.split(",")})
    if len(tokens) < 2 or tokens[0] < 2:
        raise SystemExit(f"bench_fixed_cost.py: --tokens needs at least two counts >= 2; got {args.tokens!r}")
    if not set(args.donate.replace(" ", "").split(",")) <= {"on", "off"}:
        raise SystemExit(f"bench_fixed_cost.py: --donate takes 'on' and/or 'off'; got {args.donate!r}")
    bad = [o for o in args.loop_option if not all("=" in kv for kv in o.split(";"))]
    if bad:
        raise SystemExit(f"bench_fixed_cost.py: --loop-option takes KEY=VALUE[;KEY=VALUE]; got {bad[0]!r}")
    # (label, donate the state, compiler options of both loops): what each loop is compiled as
    # the library's own options (compiled.compiler_options) under each, a --loop-option's on top
    variants = [("donated" if d.strip() == "on" else "not donated", d.strip() == "on", qwen_options())
                for d in args.donate.split(",")]
    for opt in args.loop_option:
        variants.append(("options: " + opt, True, {**qwen_options(), **dict(kv.split("=", 1) for kv in opt.split(";"))}))

    if args.recycle:
        variants.append(("recycled", True, qwen_options()))

    from specdec_jax.decoding import autoregressive as ar_mod
    from specdec_jax.decoding import speculative as sp
    from specdec_jax.decoding.decode_shape import choose_decode_rows
    from specdec_jax.decoding.sampling import SamplingConfig
    from specdec_jax.models.family import QWEN35

    model, name = bench_spec.model_from_args(args)
    cfg, params = model.config, model.params
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.prompt_len)), jnp.int32)
    key = jax.random.PRNGKey(0)
    sampling = SamplingConfig()
    drafter = bench_spec.curve_drafter(model, args.method)
    g = args.gamma
    rows, ar_rows = choose_decode_rows(g, None, "qwen3_5"), choose_decode_rows(0, None, "qwen3_5")
    max_len = args.prompt_len + max(tokens) + max(g + 1, rows, ar_rows)  # one cache length: same step shapes
    p = jnp.float32(args.p)

    def loop_fn(jitted, static, donate):
        if donate:
            return jitted
        return jax.jit(jitted.__wrapped__, static_argnames=static)  # the same function, nothing donated

    static_ap = dict(ops=ar_mod.ar_ops(QWEN35), cfg=cfg, max_len=max_len, state_dtype=model.dtype)
    logits_s, state_s = jax.eval_shape(functools.partial(ar_mod._prefill, **static_ap), params, prompt)
    jobs = {"ar_prefill": (functools.partial(ar_mod._prefill.lower, params, prompt, **static_ap), qwen_options())}
    if args.recycle:
        jobs["ar_prefill_into"] = (functools.partial(prefill_into(ar_mod._prefill, 2, static_ap).lower, params, prompt,
                                                     state_s, **static_ap), qwen_options())
    for n in tokens:
        static_ad = dict(ops=ar_mod.ar_ops(QWEN35, ar_rows), cfg=cfg, max_new_tokens=n, sampling=sampling, eos_ids=())
        static_p = dict(cfg=cfg, max_len=max_len, sampling=sampling, eos_ids=(), state_dtype=model.dtype, gamma=g,
                        max_new_tokens=n, drafter=drafter, impl="auto")
        static_l = dict(cfg=cfg, sampling=sampling, eos_ids=(), gamma=g, max_new_tokens=n, drafter=drafter,
                        rollback="replay", impl="auto", decode_rows=rows, defer=sp.defer_commit("replay"))
        shapes = jax.eval_shape(functools.partial(sp._spec_prefill, **static_p), params, prompt, key)
        jobs["prefill", n] = (functools.partial(sp._spec_prefill.lower, params, prompt, key, **static_p), qwen_options())
        if args.recycle:
            jobs["prefill_into", n] = (functools.partial(prefill_into(sp._spec_prefill, 3, static_p).lower, params,
                                                         prompt, key, shapes, **static_p), qwen_options())
        for label, donate, options in variants:
            ar_loop, spec_loop = (loop_fn(ar_mod._decode_loop, AR_STATIC, donate),
                                  loop_fn(sp._spec_loop, SPEC_STATIC, donate))
            jobs["ar", n, label] = (functools.partial(ar_loop.lower, params, state_s, logits_s, key, **static_ad),
                                    options)
            jobs["spec", n, label] = (functools.partial(spec_loop.lower, params, shapes[0], shapes[1], key, p,
                                                        **static_l), options)
    t0 = time.perf_counter()
    exe, compile_s = compile_timed({k: WithOptions(*job) for k, job in jobs.items()}, workers=12)
    print(f"compiled {len(exe)} functions in {time.perf_counter() - t0:.0f} s", flush=True)

    steps_of = {}
    addresses = {}  # (loop, new tokens): every state buffer address a "recycled" call got
    recycled = {}  # (loop, new tokens): the last "recycled" call's final state, for the next one's prefill

    def prepared(kind, n, d):  # a fresh prefill, then the loop call as a thunk
        old = recycled.pop((kind, n), None) if d == "recycled" else None
        if kind == "ar":
            logits, state = jax.block_until_ready(exe["ar_prefill"](params, prompt) if old is None else
                                                  exe["ar_prefill_into"](params, prompt, old))
            if d == "recycled":
                addresses.setdefault((kind, n), set()).update(x.unsafe_buffer_pointer() for x in jax.tree.leaves(state))
            return lambda: exe["ar", n, d](params, state, logits, key)
        state, dstate = jax.block_until_ready(exe["prefill", n](params, prompt, key) if old is None else
                                              exe["prefill_into", n](params, prompt, key, old))
        if d == "recycled":  # the buffers a recycled call gets (the same every call when the state is recycled)
            addresses.setdefault((kind, n), set()).update(
                x.unsafe_buffer_pointer() for x in jax.tree.leaves((state, dstate)))
        return lambda: exe["spec", n, d](params, state, dstate, key, p)

    def run(kind, n, d):
        call = prepared(kind, n, d)
        t0 = time.perf_counter()
        out = jax.block_until_ready(call())
        seconds = time.perf_counter() - t0  # before reading the step count back (a transfer of its own)
        steps_of[kind, n] = n - 1 if kind == "ar" else int(out[1].steps)
        if d == "recycled":
            recycled[kind, n] = out[1] if kind == "ar" else (out[1], out[2])
        return seconds

    header = result_header(name, " ".join(["python", *sys.argv]))
    result = {**header, "model": name, "method": args.method, "gamma": g, "p": args.p, "prompt_len": args.prompt_len,
              "max_len": max_len, "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "compile_seconds": compile_s, "calls": [], "fits": []}
    if args.hlo:
        result["hlo"] = {}
        os.makedirs(args.out, exist_ok=True)
        for kind in ("ar", "spec"):
            text = exe[kind, tokens[0], variants[0][0]].as_text()
            with open(os.path.join(args.out, f"hlo_{kind}{args.tag}.txt"), "w") as f:
                f.write(text)
            result["hlo"][kind] = while_loops(text)
        save(result, args)
        if args.hlo_only:
            return
    settings = [(kind, n, v[0]) for v in variants for kind in ("ar", "spec") for n in tokens]
    for s in settings:
        run(*s)  # warm-up (autotuning, the step counts)
    times = alternate({s: functools.partial(run, *s) for s in settings}, args.repeats)
    for (kind, n, d), secs in times.items():
        result["calls"].append({"loop": kind, "new_tokens": n, "variant": d, "steps": steps_of[kind, n],
                                "seconds": float(np.median(secs)), "seconds_all": secs})
    for d, donate, options in variants:
        for kind in ("ar", "spec"):
            calls = [c for c in result["calls"] if c["loop"] == kind and c["variant"] == d]
            fixed, per_step, resid = fit_line([c["steps"] for c in calls], [c["seconds"] for c in calls])
            result["fits"].append({"loop": kind, "variant": d, "donate": donate, "options": options, "fixed_ms": 1e3 * fixed, "per_step_ms": 1e3 * per_step,
                                   "max_residual_ms": 1e3 * resid})
    if args.recycle:
        leaves = {"ar": len(jax.tree.leaves(state_s)), "spec": len(jax.tree.leaves(shapes))}
        result["recycled_addresses"] = {f"{k} {n}": {"distinct": len(a), "state_buffers": leaves[k]}
                                        for (k, n), a in addresses.items()}
        print("recycled calls' distinct state buffer addresses:", result["recycled_addresses"], flush=True)
    save(result, args)
    if args.trace:
        result["traces"] = {}
        for kind in ("ar", "spec"):
            n, d = tokens[0], variants[0][0]
            label = f"{kind}, {n} new tokens, {steps_of[kind, n]} steps, per step"
            result["traces"][label] = device_kernel_profile(prepared(kind, n, d), steps_of[kind, n])
            save(result, args)


def save(result, args):
    md = [f"# What a decode call costs beyond its steps ({result['model']})", "",
          f"{result['device']} · jax {result['jax']} · commit {result['git_commit']} · {result['date']}", "",
          f"`{result['command']}`", "",
          f"AR (exact path) and {result['method']} speculation (gamma {result['gamma']}, forced acceptance p = "
          f"{result['p']:g}: outputs meaningless, exact path, replay rollback), each loop call timed alone from its "
          f"dispatch to its tokens (prefill excluded), median of the repeats, all calls alternated in one run; one "
          f"cache length ({result['max_len']}) for every call, so every step has the same shapes. Fit: seconds = "
          f"fixed + per step × steps (least squares over the generation lengths). "
          f"XLA_FLAGS={result['xla_flags']!r}.", "",
          "| loop | variant | fixed ms per call | ms per step | largest residual ms |", "|---|---|---|---|---|"]
    md += [f"| {f['loop']} | {f['variant']} | {f['fixed_ms']:.3f} | {f['per_step_ms']:.4f} | "
           f"{f['max_residual_ms']:.3f} |" for f in result["fits"]]
    md += ["", "| loop | variant | new tokens | steps | ms per call | ms per step (call ÷ steps) |",
           "|---|---|---|---|---|---|"]
    md += [f"| {c['loop']} | {c['variant']} | {c['new_tokens']} | {c['steps']} | "
           f"{1e3 * c['seconds']:.3f} | {1e3 * c['seconds'] / c['steps']:.4f} |" for c in result["calls"]]
    for kind, loops in result.get("hlo", {}).items():
        md += ["", f"**{kind}: its while loops** (hlo_{kind}{args.tag}.txt)", ""]
        md += [f"- {loop}: known trip count {info['known_trip_count']}; the body launches "
               + (", ".join(f"{what} × {n}" for what, n in sorted(info["body"].items())) or "nothing")
               for loop, info in loops.items()] or ["- no while loop"]
    if result.get("traces"):
        md += ["", "## Traced (one call each; tracing slows the host)", ""] + kernel_profile_markdown(result["traces"])
    write_results(args.out, f"fixed_cost_{result['model']}{args.tag}", result, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
