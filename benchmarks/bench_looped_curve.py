r"""Forced-acceptance cost curve of looped self-speculation (Huginn-0125 shape, random bf16 weights).

The looped counterpart of `bench_spec.py --forced-acceptance`: the drafts and the real acceptance still
run, but the accepted count follows a seeded schedule (each draft kept with probability p, stopping at the
first rejection: `speculative.forced_acceptance` through `looped_spec.spec_step(accept_p=...)`), so time
per token can be measured against tokens per verification independently of the (random) weights.

Configurations: das-wave (gamma --das-gamma, k in --ks), self-spec and mature-spec (their default gamma,
draft depth d in --ds), each at every p in --ps. Every prefill and loop is compiled once (p is a traced
argument; parameters are jit arguments, never closed over), all on a thread pool at once. Full-depth AR
(R = --num-steps, the exact decode-row count generate() uses) alternates with the speculative runs
(median of --repeats). Rows: tokens_per_verify (accepted + 1 per verification), core_apps_per_token
(core-block applications per emitted token), speedup (AR s/token / spec s per emitted token) and
ideal = R / core_apps_per_token (the speedup if a core application were all a token cost). With
--tiny-acceptance (a bench_looped_spec.py result JSON of the trained tiny checkpoint), each measured
configuration's speedup is also interpolated at that checkpoint's measured tokens per verification.

    python benchmarks/bench_looped_curve.py --out benchmarks/results                 # Huginn-0125 shape, GPU
    python benchmarks/bench_looped_curve.py --tiny --out /tmp/curve                  # CPU smoke run

Within about 200 s on one H200 (13 compiles at once, then 45 rows of one spec / AR pair each; no new row
starts after the budget, so a slow compile costs the last mature-spec rows, not the run):

    python benchmarks/bench_looped_curve.py --max-new-tokens 48 --repeats 1 --time-budget-s 165 \
        --tiny-acceptance benchmarks/results/looped_spec_tiny-huginn-code_r32_20261203_202040.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_looped_spec import huginn_config, random_model, tiny_config  # noqa: E402
from specdec_jax.bench.harness import alternate, compile_timed, finish_plot, result_header, write_results  # noqa: E402
from specdec_jax.decoding import autoregressive as ar_mod  # noqa: E402
from specdec_jax.decoding.compiled import compiler_options  # noqa: E402
from specdec_jax.decoding import looped_spec as ls  # noqa: E402
from specdec_jax.decoding.decode_shape import exact_rows  # noqa: E402
from specdec_jax.decoding.sampling import SamplingConfig  # noqa: E402
from specdec_jax.models.family import looped_family  # noqa: E402

CURVE_METHODS = ("das-wave", "self-spec", "mature-spec")  # the sampler has no acceptance step to force
MATCH_OPTIONS = ("gamma", "k", "draft_steps", "read_k", "read_v", "carry", "window_init")


def configs(args) -> list[tuple[str, ls.LoopedSpecPlan]]:
    """[(name, plan)] in run order (a --time-budget-s cut drops the last ones)."""
    out = []
    for m in args.methods:
        opts = ([dict(gamma=args.das_gamma, k=k) for k in args.ks] if m == "das-wave"
                else [dict(draft_steps=d) for d in args.ds])
        for o in opts:
            out.append((m + "(" + ", ".join(f"{k}={v}" for k, v in o.items()) + ")",
                        ls.make_plan(m, args.num_steps, **o)))
    return out


def lower_all(model, plans: dict, prompt, key, R: int, N: int, ar_rows: int) -> tuple[dict, int]:
    """{job: lowered} for AR (prefill + decode loop) and every plan's prefill and loop; and max_len.
    One cache length for all, so AR and speculation attend over the same preallocated length."""
    cfg, params, dtype = model.config, model.params, model.params["wte"].dtype
    greedy = SamplingConfig()
    max_len = prompt.shape[1] + N + max([ar_rows] + [max(p.decode_rows, p.gamma) for p in plans.values()])
    static_ap = dict(ops=ar_mod.ar_ops(looped_family(R), ar_rows), cfg=cfg, max_len=max_len, state_dtype=dtype)
    logits_s, state_s = jax.eval_shape(functools.partial(ar_mod._prefill, **static_ap), params, prompt)
    jobs = {"ar_prefill": functools.partial(ar_mod._prefill.lower, params, prompt, **static_ap),
            "ar_loop": functools.partial(ar_mod._decode_loop.lower, params, state_s, logits_s, key,
                                         ops=static_ap["ops"], cfg=cfg, max_new_tokens=N, sampling=greedy, eos_ids=())}
    for name, plan in plans.items():
        static_p = dict(cfg=cfg, plan=plan, max_len=max_len, sampling=greedy, eos_ids=(), max_new_tokens=N,
                        state_dtype=dtype)
        # The prefill's result depends on the plan only through gamma and the window width: configs share it.
        pk = ("prefill", plan.gamma, plan.window)
        if pk not in jobs:
            jobs[pk] = functools.partial(ls._prefill.lower, params, prompt, key, **static_p)
        state_s = jax.eval_shape(functools.partial(ls._prefill, **static_p), params, prompt, key)
        jobs["loop", name] = functools.partial(ls._loop.lower, params, state_s, key, jnp.float32(0.5), cfg=cfg,
                                               plan=plan, sampling=greedy, eos_ids=(), max_new_tokens=N)
    return {k: make() for k, make in jobs.items()}, max_len


def interpolate(rows: list[dict], tpv: float) -> dict:
    """Speedup and ideal of one configuration's rows, linearly interpolated at tokens_per_verify = tpv."""
    pts = sorted((r["tokens_per_verify"], r["speedup"], r["ideal"]) for r in rows)
    x = [a for a, _, _ in pts]
    return {"speedup": float(np.interp(tpv, x, [b for _, b, _ in pts])),
            "ideal": float(np.interp(tpv, x, [c for _, _, c in pts])), "in_range": x[0] <= tpv <= x[-1]}


def projection(rows: list[dict], plans: dict, path: str) -> list[dict]:
    """Per measured configuration found in a bench_looped_spec.py result (its `e2e` summaries, matched on
    method and the plan's options), the speedup at that run's tokens per verification."""
    with open(path) as f:
        data = json.load(f)
    summaries = [r.get("summary", r) for r in (data.get("e2e", []) if isinstance(data, dict) else data)]
    out = []
    for name, plan in plans.items():
        mine = [r for r in rows if r["config"] == name]
        want = {k: v for k, v in plan.describe().items() if k in MATCH_OPTIONS}
        hit = next((s for s in summaries if s.get("method") == plan.method
                    and all(s.get("options", {}).get(k, v) == v for k, v in want.items())), None)
        if mine and hit:
            out.append({"config": name, "method": plan.method, "measured_tokens_per_verify": hit["tokens_per_step"],
                        **interpolate(mine, hit["tokens_per_step"])})
    return out


def run_curve(args, model, on_row=None, t_start: float | None = None) -> dict:
    """The curve's rows; t_start: what --time-budget-s counts from (default now)."""
    cfg, params = model.config, model.params
    t_start = time.perf_counter() if t_start is None else t_start
    R, N = args.num_steps, args.max_new_tokens
    prompt = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (1, args.prompt_len)), jnp.int32)
    key = jax.random.PRNGKey(0)
    plans = dict(configs(args))
    ar_rows = exact_rows({}, 0, "looped", None)  # what generate(method="ar") runs at by default
    lowered, max_len = lower_all(model, plans, prompt, key, R, N, ar_rows)
    print(f"lowered {len(lowered)} functions in {time.perf_counter() - t_start:.0f} s", flush=True)
    # the looped family's XLA options, as generate() compiles them (compiled.EXACT_GPU_OPTIONS on the GPU)
    exe, compile_s = compile_timed(lowered, args.workers, options=compiler_options("looped"))
    print(f"compiled in {time.perf_counter() - t_start:.0f} s since start (pool of {args.workers})", flush=True)

    def ar_run() -> float:
        logits, state = jax.block_until_ready(exe["ar_prefill"](params, prompt))
        t0 = time.perf_counter()
        jax.block_until_ready(exe["ar_loop"](params, state, logits, key))
        return (time.perf_counter() - t0) / (N - 1)  # the first token comes from the prefill

    def spec_run(name, p) -> tuple[float, float, float, int]:
        plan = plans[name]
        state = jax.block_until_ready(exe["prefill", plan.gamma, plan.window](params, prompt, key))
        accept_p = jax.block_until_ready(jnp.float32(p))  # on the device before the clock starts
        t0 = time.perf_counter()
        _, state, _ = jax.block_until_ready(exe["loop", name](params, state, key, accept_p))
        sec = time.perf_counter() - t0
        steps = int(state.steps)
        emitted = int(state.n_out[0]) - 1  # every token the verifications made (the last may overshoot N)
        acc = np.asarray(state.accepted)[:steps, 0]
        core = plan.core_applications_per_token(int(state.draft_rounds[0]), steps, emitted)
        return sec / emitted, float((acc + 1).mean()), core, steps

    ar_all = [ar_run() for _ in range(2)][1:]  # the first run warms up
    result = {"num_steps": R, "prompt_len": args.prompt_len, "max_new_tokens": N, "max_len": max_len,
              "ar_decode_rows": ar_rows, "repeats": args.repeats, "ps": args.ps, "compile_seconds": compile_s,
              "das_ps": args.das_ps, "rows": [], "skipped": []}
    over_budget = lambda: time.perf_counter() - t_start > args.time_budget_s  # noqa: E731
    for name, plan in plans.items():
        if not over_budget():
            spec_run(name, 1.0)  # warm-up
        for p in (args.das_ps if plan.method == "das-wave" else args.ps):
            if over_budget():
                result["skipped"].append(f"{name} p={p}")
                continue
            paired = alternate({"spec": lambda: spec_run(name, p), "ar": ar_run}, args.repeats)
            runs, ar_times = paired["spec"], paired["ar"]
            ar_all += ar_times
            sec, core = float(np.median([r[0] for r in runs])), float(np.median([r[2] for r in runs]))
            ar_sec = float(np.median(ar_times))
            row = {"config": name, "method": plan.method, "gamma": plan.gamma,
                   "k": plan.k if plan.method == "das-wave" else None,
                   "draft_steps": plan.draft_steps if plan.method != "das-wave" else None,
                   "decode_rows": plan.decode_rows, "p": p, "tokens_per_verify": float(np.mean([r[1] for r in runs])),
                   "core_apps_per_token": core, "speedup": ar_sec / sec, "ideal": R / core,
                   "seconds_per_token": sec, "ar_seconds_per_token": ar_sec,
                   "verify_steps": int(np.median([r[3] for r in runs])),
                   "compile_seconds": compile_s[str(("loop", name))]}
            result["rows"].append(row)
            result["ar_seconds_per_token"] = float(np.median(ar_all))
            print(json.dumps(row), flush=True)
            if on_row:
                on_row(result)
    if result["skipped"]:
        print(f"time budget reached; skipped {len(result['skipped'])} rows", flush=True)
    result["ar_seconds_per_token"] = float(np.median(ar_all))
    if args.tiny_acceptance:
        result["projection"] = projection(result["rows"], plans, args.tiny_acceptance)
    return result


def markdown(res: dict) -> str:
    md = [f"# Looped self-speculation, forced-acceptance cost curve ({res['model']})", "",
          f"{res['device']} · jax {res['jax']} · commit `{res['git_commit']}` · {res['date']}", "",
          f"`{res['command']}`", "",
          "Each draft is kept with probability p, stopping at the first rejection (a seeded schedule that replaces "
          "the acceptance outcome while the drafting, the verification and the real acceptance still run), so the "
          "rows measure time per token against tokens per verification; the outputs are meaningless.", "",
          f"R = {res['num_steps']}, random {res['dtype']} weights, batch 1, greedy, prompt {res['prompt_len']} random "
          f"tokens, {res['max_new_tokens']} new tokens, exact path (every decode forward at {res['ar_decode_rows']}+ "
          f"rows), median of {res['repeats']} run(s) alternating with full-depth AR "
          f"({res.get('ar_seconds_per_token', float('nan')) * 1e3:.2f} ms per token). speedup = AR s/token ÷ "
          "speculative s per emitted token; ideal = R ÷ core-block applications per emitted token.", "",
          "| method | gamma | k | d | p | tokens / verify | core apps / token | speedup | ideal | ms / token | "
          "compile s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        md.append(f"| {r['method']} | {r['gamma']} | {r['k'] or '—'} | {r['draft_steps'] or '—'} | {r['p']:.2f} | "
                  f"{r['tokens_per_verify']:.2f} | {r['core_apps_per_token']:.2f} | {r['speedup']:.2f}× | "
                  f"{r['ideal']:.2f}× | {r['seconds_per_token'] * 1e3:.2f} | {r['compile_seconds']:.0f} |")
    if res.get("projection"):
        md += ["", "Projection at the trained tiny checkpoint's measured acceptance (linear interpolation of the "
                   "rows above; * = outside the measured range, clamped):", "",
               "| config | measured tokens / verify | speedup | ideal |", "|---|---|---|---|"]
        for p in res["projection"]:
            md.append(f"| {p['config']} | {p['measured_tokens_per_verify']:.2f} | {p['speedup']:.2f}×"
                      f"{'' if p['in_range'] else '*'} | {p['ideal']:.2f}× |")
    if res.get("skipped"):
        md += ["", f"Not run (time budget): {', '.join(res['skipped'])}."]
    md += ["", f"![speedup against tokens per verification]({res['stem']}.png)"]
    return "\n".join(md) + "\n"


def plot(res: dict, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name in dict.fromkeys(r["config"] for r in res["rows"]):
        mine = sorted((r for r in res["rows"] if r["config"] == name), key=lambda r: r["p"])  # tokens grow with p
        pts = [(r["tokens_per_verify"], r["speedup"], r["ideal"]) for r in mine]
        line, = ax.plot([a for a, _, _ in pts], [b for _, b, _ in pts], "o-", ms=3, label=name)
        ax.plot([a for a, _, _ in pts], [c for _, _, c in pts], ":", color=line.get_color(), lw=1)
    ax.axhline(1.0, color="k", lw=0.8)
    finish_plot(fig, ax, path, "tokens per verification", "speedup over full-depth AR (dotted: ideal)",
                f"{res['model']}: forced-acceptance cost curve, R = {res['num_steps']}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny random model and sizes (CPU smoke run)")
    ap.add_argument("--methods", default=",".join(CURVE_METHODS), help=f"comma list of {CURVE_METHODS}")
    ap.add_argument("--ps", default="0.5,0.7,0.8,0.9,1.0", help="forced acceptance probabilities in [0, 1]")
    ap.add_argument("--das-ps", default=None,
                    help="das-wave's own probabilities (default --ps); at gamma 16 the tokens per verification "
                         "grow steeply past p = 0.9 (0.95: 11.6, 0.97: 13.4, 0.98: 14.9, 1: 17), where the "
                         "trained tiny checkpoint's acceptance lies")
    ap.add_argument("--ks", default=None, help="das-wave updates per round (default 1,2,4; tiny 1,2)")
    ap.add_argument("--ds", default=None, help="self/mature-spec draft depths (default 2,4,8; tiny 2)")
    ap.add_argument("--das-gamma", type=int, default=None, help="das-wave gamma (default 16, tiny 4)")
    ap.add_argument("--num-steps", type=int, default=None, help="full depth R (default 32, tiny 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="random prompt tokens (default 64, tiny 8)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (tiny 12)")
    ap.add_argument("--repeats", type=int, default=None, help="spec / AR pairs per row, median (default 3, tiny 1)")
    ap.add_argument("--time-budget-s", type=float, default=1e9,
                    help="no new row starts this many seconds after the script started (compiles included)")
    ap.add_argument("--workers", type=int, default=16, help="compile thread pool (all 13 default jobs at once)")
    ap.add_argument("--tiny-acceptance", default=None,
                    help="a bench_looped_spec.py result JSON (trained tiny checkpoint): project its acceptance")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    t = args.tiny
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.methods or set(args.methods) - set(CURVE_METHODS):
        ap.error(f"--methods: choose from {CURVE_METHODS} (the parallel sampler has no acceptance step)")
    try:
        args.ps = [float(p) for p in args.ps.split(",")]
        args.das_ps = [float(p) for p in args.das_ps.split(",")] if args.das_ps else args.ps
        args.ks = [int(k) for k in (args.ks or ("1,2" if t else "1,2,4")).split(",")]
        args.ds = [int(d) for d in (args.ds or ("2" if t else "2,4,8")).split(",")]
    except ValueError as e:
        ap.error(f"--ps / --ks / --ds: comma lists of numbers ({e})")
    for flag, ps in (("--ps", args.ps), ("--das-ps", args.das_ps)):
        if not ps or not all(0.0 <= p <= 1.0 for p in ps):
            ap.error(f"{flag}: every probability must lie in [0, 1]; got {ps}")
    args.das_gamma = args.das_gamma or (4 if t else 16)
    args.num_steps = args.num_steps or (4 if t else 32)
    args.prompt_len = args.prompt_len or (8 if t else 64)
    args.max_new_tokens = args.max_new_tokens or (12 if t else 64)
    args.repeats = max(1, args.repeats or (1 if t else 3))
    return args


def main(argv=None) -> dict:
    t_start = time.perf_counter()  # the budget covers making the model, lowering and compiling too
    args = parse_args(argv)
    header = result_header("looped_cost_curve")
    if argv is not None:  # called from Python (tests): record the arguments actually used
        header["command"] = "python benchmarks/bench_looped_curve.py " + " ".join(argv)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    model = random_model(tiny_config() if args.tiny else huginn_config(), dtype)
    stem = "looped_cost_curve_tiny" if args.tiny else "looped_cost_curve_huginn0125"
    head = {**header, "model": "tiny random" if args.tiny else "Huginn-0125 shape", "dtype": jnp.dtype(dtype).name,
            "stem": stem}

    def save(res):
        full = {**head, **res}
        write_results(args.out, stem, full, markdown(full), echo=False)  # rows are printed as they come
        if full["rows"]:
            plot(full, os.path.join(args.out, stem + ".png"))
        return full

    return save(run_curve(args, model, on_row=save, t_start=t_start))


if __name__ == "__main__":
    main()
