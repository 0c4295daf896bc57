"""Self-speculative decoding for looped models, paired with full-depth AR (one process).

1. End to end (--model, default checkpoints/tiny-huginn-code; --tiny: a tiny random model for a CPU
   smoke run). Prompts: held-out stdlib code, each cut to its last --prompt-len tokens (one compile
   per configuration). For every configuration and prompt, full-depth AR (R = --num-steps, 32) and
   the method alternate (--repeats pairs, median), greedy, no EOS: decode tok/s (first token, which
   comes from the prefill, excluded; compile excluded), accepted drafts per verification, speedup =
   method / AR decode tok/s of the same prompt, mean over prompts with a bootstrap 95% interval
   (resampling prompts) and the median; outputs compared with AR. AR runs at the method's decode
   shape: on the exact path (the default) the padded rows of exact AR, so lossless methods must agree
   bit for bit in any dtype; with exact=False AR runs one row and bf16 may flip a near-tie. The parallel sampler (not lossless) reports
   its token agreement with AR and the agreeing prefix length beside its speed.
   Grids (--grid full): self-spec and mature-spec (Deep K/V) d in {2,4,8} x gamma in {8,16,32};
   das-wave (Deep K/V, carry) gamma in {8,16,32} x k in {1,2,4}; the component study (sequential
   d = 4, gamma = 8 and das-wave gamma = 16, k = 2 with aligned / Deep V / Deep K/V reads, das-wave
   with and without carry); the parallel sampler (r' = 4, eps = 0.03, EMA 0.1, wavefront 16 and 32).
   Results are rewritten after every configuration, so a run stopped by --time-budget-s (or killed)
   still leaves its finished rows.
2. Per-round costs (--costs; Huginn-0125 shape with random bf16 weights, --tiny: a tiny shape):
   median time of one AR token (R steps), one verification (gamma + 1 tokens), a block of gamma
   sequential drafts at depth d, one das-wave block of rounds (per round = block / rounds), one
   parallel-sampler round, on a cache prefilled with --cost-prompt-len tokens; and the speedup those
   times predict: tokens per block x AR token / (drafting + verification), with the tokens per block
   measured in part 1 for the same configuration (when run) and at full acceptance.

    python benchmarks/bench_looped_spec.py --out benchmarks/results                      # trained tiny, full grid
    python benchmarks/bench_looped_spec.py --grid small --methods das-wave,component     # a subset
    python benchmarks/bench_looped_spec.py --costs --skip-e2e --out benchmarks/results   # Huginn-0125 round costs
    python benchmarks/bench_looped_spec.py --tiny --costs --out /tmp/bench               # CPU smoke run

A GPU command that must end within a time limit: split the work with --methods / --grid (end to end)
and --cost-gammas / --cost-ds / --cost-ks (costs; each configuration compiles once), and set
--time-budget-s somewhat below the limit (no new configuration starts after it; rows already finished
are in the results files).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specdec_jax.bench.harness import (alternate, bootstrap_ci, cut_prompts, median_time,  # noqa: E402
                                  result_header, write_results)
from specdec_jax.decoding import looped_spec as ls  # noqa: E402
from specdec_jax.decoding.sampling import SamplingConfig  # noqa: E402
from specdec_jax.results import Model  # noqa: E402
from specdec_jax.decoding import looped_ar  # noqa: E402
from specdec_jax.models.looped import model as looped  # noqa: E402

GROUPS = ("self-spec", "mature-spec", "das-wave", "component", "parallel-sampler")


# ------------------------------------------------------------------------------------ configs

def grid_configs(grid: str, groups: set[str]) -> list[tuple[tuple[str, ...], str, dict]]:
    """[(groups, method, options)] in run order; a configuration in several groups runs once."""
    if grid == "full":
        ds, gammas, ks, sampler_w = (2, 4, 8), (8, 16, 32), (1, 2, 4), (16, 32)
    elif grid == "small":
        ds, gammas, ks, sampler_w = (4,), (8, 16), (1, 2), (16,)
    else:  # smoke
        ds, gammas, ks, sampler_w = (2,), (4,), (1, 2), (4,)
    seq_d, seq_g = (4, 8) if grid != "smoke" else (2, 4)
    wave_g, wave_k = (16, 2) if grid != "smoke" else (4, 2)
    out = []
    if "self-spec" in groups:
        out += [("self-spec", "self-spec", dict(draft_steps=d, gamma=g)) for d in ds for g in gammas]
    if "mature-spec" in groups:
        out += [("mature-spec", "mature-spec", dict(draft_steps=d, gamma=g)) for d in ds for g in gammas]
    if "das-wave" in groups:
        out += [("das-wave", "das-wave", dict(gamma=g, k=k)) for g in gammas for k in ks]
    if "component" in groups:
        for rk, rv in (("aligned", "aligned"), ("aligned", "deep"), ("deep", "deep")):
            out.append(("component", "mature-spec", dict(draft_steps=seq_d, gamma=seq_g, read_k=rk, read_v=rv)))
        for carry in (False, True):
            for rk, rv in (("aligned", "aligned"), ("aligned", "deep"), ("deep", "deep")):
                out.append(("component", "das-wave", dict(gamma=wave_g, k=wave_k, read_k=rk, read_v=rv, carry=carry)))
    if "parallel-sampler" in groups:
        out += [("parallel-sampler", "parallel-sampler", dict(gamma=w)) for w in sampler_w]
    unique: dict[str, list] = {}
    for group, method, opts in out:
        key = config_key(method, opts)
        if key in unique:
            unique[key][0] += (group,)
        else:
            unique[key] = [(group,), method, opts]
    return [tuple(v) for v in unique.values()]


def config_key(method: str, opts: dict) -> str:
    plan = ls.make_plan(method, 32, **opts)  # normalise defaults (the depth does not enter the key)
    d = plan.describe()
    d.pop("num_steps")
    return method + "(" + ", ".join(f"{k}={v}" for k, v in d.items()) + ")"


# ------------------------------------------------------------------------------------- models

def tiny_config() -> looped.LoopedConfig:
    from benchmarks.bench_looped import bench_config
    return bench_config(True)


def huginn_config() -> looped.LoopedConfig:
    from benchmarks.bench_looped import bench_config
    return bench_config(False)


def random_model(cfg: looped.LoopedConfig, dtype, seed: int = 0) -> Model:
    params = looped.init_random_params(cfg, jax.random.PRNGKey(seed), dtype, std=0.02)
    return Model(config=cfg, params=jax.block_until_ready(params), dtype=dtype)


def load_prompts(args, model) -> tuple[np.ndarray, str]:
    """[P, prompt_len] held-out code prompts (last prompt_len tokens of each), or random ids for --tiny."""
    rng = np.random.default_rng(args.seed)
    if args.tiny:
        return rng.integers(1, model.vocab_size, (args.num_prompts, args.prompt_len)).astype(np.int32), "random ids"
    from tokenizers import Tokenizer
    from specdec_jax.training.corpus import heldout_prompts
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    try:
        texts = heldout_prompts(max_prompts=max(64, 4 * args.num_prompts))
    except OSError:
        texts = []
    ids = [tok.encode(t).ids for t in texts]
    ids = cut_prompts(ids, args.prompt_len, args.num_prompts)
    if len(ids) < args.num_prompts:
        print(f"warning: only {len(ids)} held-out prompts have >= {args.prompt_len} tokens", flush=True)
    if not ids:
        raise SystemExit("no prompts: lower --prompt-len or check the stdlib is present (corpus.stdlib_root)")
    return np.asarray(ids, np.int32), f"held-out stdlib code, last {args.prompt_len} tokens"


# ------------------------------------------------------------------------------------ end to end

def prefix_agreement(a: np.ndarray, b: np.ndarray) -> int:
    diff = np.nonzero(a != b)[0]
    return int(diff[0]) if len(diff) else int(len(a))


def run_config(model, prompts, method, opts, args) -> dict:
    """Paired AR / method runs over every prompt; returns per-prompt rows and the summary."""
    R, N = args.num_steps, args.max_new_tokens
    plan = ls.make_plan(method, R, **opts)
    max_len = prompts.shape[1] + N + max(plan.gamma, plan.decode_rows or 0, 1)  # the exact path pads each forward to decode_rows
    gen = functools.partial(ls.generate_looped_spec, model, num_steps=R, eos_ids=(), max_len=max_len, **opts)
    # AR at the method's decode shape: on the exact path (the default) that is the AR a user's generate() runs,
    # and the output the method must equal bit for bit.
    ar_gen = functools.partial(looped_ar.generate, model, max_new_tokens=N, num_steps=R, eos_ids=(), max_len=max_len,
                               decode_rows=plan.decode_rows or 0)
    warm = gen(prompts[:1], N, method)  # compile (cached for the rest)
    ar_gen(prompts[:1])
    rows = []
    for p in prompts:
        ids = p[None]
        paired = alternate({"ar": lambda: ar_gen(ids), "method": lambda: gen(ids, N, method)}, args.repeats)
        ar, sp = paired["ar"][-1], paired["method"][-1]
        a = float(np.median([r.stats["decode_tokens_per_second"] for r in paired["ar"]]))
        s = float(np.median([r.stats["decode_tokens_per_second"] for r in paired["method"]]))
        rows.append({"ar_tps": a, "tps": s, "speedup": s / a, "tokens_per_step": sp.stats["tokens_per_step"],
                     "mean_accepted": sp.stats["mean_accepted"], "verify_steps": sp.stats["verify_steps"],
                     "core_applications_per_token": sp.stats["core_applications_per_token"],
                     "equal_to_ar": bool((sp.tokens == ar.tokens).all()),
                     "agreement": float((sp.tokens == ar.tokens).mean()),
                     "agree_prefix": prefix_agreement(sp.tokens[0], ar.tokens[0])})
    sp_ = [r["speedup"] for r in rows]
    lo, hi = bootstrap_ci(sp_, np.mean, resamples=args.bootstrap, seed=args.seed)
    summary = {
        "method": method, "options": plan.describe(), "key": config_key(method, opts),
        "compile_seconds": warm.stats["compile_seconds"],
        "ar_tps": float(np.median([r["ar_tps"] for r in rows])), "tps": float(np.median([r["tps"] for r in rows])),
        "speedup_mean": float(np.mean(sp_)), "speedup_ci95": [lo, hi], "speedup_median": float(np.median(sp_)),
        "tokens_per_step": float(np.mean([r["tokens_per_step"] for r in rows])),
        "mean_accepted": float(np.mean([r["mean_accepted"] for r in rows])),
        "core_applications_per_token": float(np.mean([r["core_applications_per_token"] for r in rows])),
        "equal_to_ar": float(np.mean([r["equal_to_ar"] for r in rows])),
        "agreement": float(np.mean([r["agreement"] for r in rows])),
        "agree_prefix": float(np.mean([r["agree_prefix"] for r in rows])),
    }
    return {"summary": summary, "prompts": rows}


# ------------------------------------------------------------------------------- per-round costs

def round_costs(args, deadline: float | None = None, save=None) -> dict:
    """Median times (s) of the pieces of one block at the Huginn-0125 (or tiny) shape, random bf16.

    Gammas are timed in order; after each, `save(partial)` runs; none is started past `deadline`.
    """
    cfg = tiny_config() if args.tiny else huginn_config()
    R = args.num_steps
    model = random_model(cfg, jnp.bfloat16, args.seed)
    params = model.params
    P = args.cost_prompt_len
    gammas = [int(g) for g in args.cost_gammas.split(",")]
    ks = [int(k) for k in args.cost_ks.split(",")]
    ds = [int(d) for d in args.cost_ds.split(",")]
    G_max = max(gammas)
    max_len = P + G_max + 2
    prompt = jax.random.randint(jax.random.PRNGKey(args.seed + 1), (1, P), 0, cfg.vocab_size)
    cache = looped.init_cache(cfg, 1, max_len, R, "full", jnp.bfloat16)
    _, cache, _ = looped.forward_jit(params, cfg, cache, prompt, R, logits_for="last")
    cache = jax.block_until_ready(cache)
    reps = args.cost_repeats
    greedy = SamplingConfig()
    key = jax.random.PRNGKey(0)
    out = {"shape": "tiny" if args.tiny else "Huginn-0125", "num_steps": R, "prompt_len": P, "repeats": reps}

    # Parameters are jit arguments everywhere (closed over, XLA would fold 7 GB of constants for minutes).
    fwd = jax.jit(lambda p, c, ids: looped.forward(p, cfg, c, ids, num_steps=R, logits_for="last")[0])
    verify = jax.jit(lambda p, c, ids: looped.forward(p, cfg, c, ids, num_steps=R)[0])
    out["ar_token_s"] = median_time(lambda: fwd(params, cache, prompt[:, :1]), reps)
    print(f"AR token (R={R}): {out['ar_token_s'] * 1e3:.3f} ms", flush=True)
    out["verify_s"], out["das_wave_block_s"], out["sequential_block_s"], out["sampler_round_s"] = {}, {}, {}, {}
    for g in gammas:
        if deadline is not None and time.perf_counter() > deadline:
            print(f"time budget reached; per-round costs for gamma={g} and later skipped", flush=True)
            out.setdefault("skipped_gammas", []).append(g)
            continue
        ids = jnp.ones((1, g + 1), jnp.int32)
        out["verify_s"][g] = median_time(lambda: verify(params, cache, ids), reps)
        for k in ks:
            plan = ls.make_plan("das-wave", R, gamma=g, k=k)
            state = ls._prefill(params, prompt, key, cfg=cfg, plan=plan, max_len=max_len, sampling=greedy, eos_ids=(),
                                max_new_tokens=2, state_dtype=jnp.bfloat16)
            propose = jax.jit(lambda p, s, kk, plan=plan: ls.das_wave_propose(p, cfg, s, kk, plan=plan,
                                                                              sampling=greedy))
            t = median_time(lambda: propose(params, state, key)[0], reps)
            out["das_wave_block_s"][f"{g},{k}"] = {"block": t, "rounds": plan.gamma - plan.window_init + 1,
                                                   "per_round": t / (plan.gamma - plan.window_init + 1)}
        for d in ds:
            for read in ("aligned", "deep"):
                plan = ls.make_plan("mature-spec", R, gamma=g, draft_steps=min(d, R), read_k=read, read_v=read)
                # The drafts write the cache: donate it (as the decode loop does), so no copy is timed.
                propose = jax.jit(lambda p, c, a, kk, plan=plan: ls.sequential_propose(p, cfg, c, a, kk, plan,
                                                                                       greedy)[2], donate_argnums=1)
                holder = [jax.tree.map(jnp.copy, cache)]

                def call(propose=propose, holder=holder):
                    holder[0] = propose(params, holder[0], prompt[:, 0], key)
                    return holder[0].length

                out["sequential_block_s"][f"{g},{d},{read}"] = median_time(call, max(3, reps // 4))
                del holder[0]
        plan = ls.make_plan("parallel-sampler", R, gamma=g)
        state = ls._prefill(params, prompt, key, cfg=cfg, plan=plan, max_len=max_len, sampling=greedy, eos_ids=(),
                            max_new_tokens=2, state_dtype=jnp.bfloat16)
        step = jax.jit(lambda p, s, kk, plan=plan: ls.sampler_step(p, cfg, s, kk, plan=plan, sampling=greedy,
                                                                   max_new_tokens=2, eos_ids=()))
        out["sampler_round_s"][g] = median_time(lambda: step(params, state, key).anchor, reps)
        print(f"gamma={g}: verify {out['verify_s'][g] * 1e3:.3f} ms, das-wave per round "
              + ", ".join(f"k={k} {out['das_wave_block_s'][f'{g},{k}']['per_round'] * 1e3:.3f} ms" for k in ks)
              + f", sampler round {out['sampler_round_s'][g] * 1e3:.3f} ms", flush=True)
        if save is not None:
            save(out)
    return out


def predicted_speedups(costs: dict, e2e: list[dict]) -> list[dict]:
    """Tokens per block x AR token time / (drafting + verification time), per das-wave / sequential config."""
    measured = {row["summary"]["key"]: row["summary"]["tokens_per_step"] for row in e2e}
    t_ar = costs["ar_token_s"]
    rows = []
    for gk, c in costs["das_wave_block_s"].items():
        g, k = map(int, gk.split(","))
        block = c["block"] + costs["verify_s"][g]
        tps = measured.get(config_key("das-wave", dict(gamma=g, k=k)))
        rows.append({"method": "das-wave", "gamma": g, "k": k, "block_s": block,
                     "full_acceptance": (g + 1) * t_ar / block,
                     "measured_acceptance": None if tps is None else tps * t_ar / block, "tokens_per_step": tps})
    for key, t in costs["sequential_block_s"].items():
        g, d, read = key.split(",")
        g, d = int(g), int(d)
        block = t + costs["verify_s"][g]
        method = "self-spec" if read == "aligned" else "mature-spec"
        tps = measured.get(config_key(method, dict(draft_steps=d, gamma=g)))
        rows.append({"method": method, "gamma": g, "d": d, "block_s": block, "full_acceptance": (g + 1) * t_ar / block,
                     "measured_acceptance": None if tps is None else tps * t_ar / block, "tokens_per_step": tps})
    return rows


# ------------------------------------------------------------------------------------ markdown

def fmt_opts(summary: dict) -> tuple[str, str, str, str, str]:
    o = summary["options"]
    d = str(o.get("draft_steps", ""))
    k = str(o.get("k", o.get("inner_steps", "")))
    reads = f"{o['read_k']}/{o['read_v']}" if "read_k" in o else ("deep/deep" if summary["method"] ==
                                                                    "parallel-sampler" else "")
    carry = str(o.get("carry", "")) if "carry" in o else ""
    return d, str(o["gamma"]), k, reads, carry


def markdown(result: dict) -> str:
    lines = [f"# Looped self-speculative decoding ({result.get('model', '')})", "",
             f"device {result['device']} · jax {result['jax']} / jaxlib {result['jaxlib']} · commit "
             f"`{result['git_commit']}` · {result['date']}", "", f"`{result['command']}`", ""]
    e2e = result.get("e2e", [])
    if e2e:
        lines += [f"R = {result['num_steps']}, {result['num_prompts']} prompts ({result['prompts']}), "
                  f"{result['max_new_tokens']} new tokens, batch 1, greedy, {result['dtype']}, no EOS; "
                  f"each configuration alternates with full-depth AR at its decode shape (the exact path's padded "
                  f"rows when the method runs exact, as generate() does by default) on the same prompts ({result['repeats']} "
                  f"pair(s) per prompt, median); decode tok/s (first token and compile excluded); speedup = "
                  f"mean over prompts of method / AR, 95% bootstrap interval over prompts.", "",
                  "| group | method | d | gamma | k / r' | reads K/V | carry | accepted / verify | tokens / step | "
                  "core apps / token | AR tok/s | tok/s | speedup [95% CI] | median | equal to AR |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in e2e:
            s = row["summary"]
            d, g, k, reads, carry = fmt_opts(s)
            lo, hi = s["speedup_ci95"]
            sampler = s["method"] == "parallel-sampler"
            lines.append(f"| {', '.join(row['groups'])} | {s['method']} | {d} | {g} | {k} | {reads} | {carry} | "
                         f"{'—' if sampler else format(s['mean_accepted'], '.2f')} | {s['tokens_per_step']:.2f} | "
                         f"{s['core_applications_per_token']:.2f} | {s['ar_tps']:.1f} | {s['tps']:.1f} | "
                         f"{s['speedup_mean']:.2f}× [{lo:.2f}, {hi:.2f}] | {s['speedup_median']:.2f}× | "
                         f"{'(not lossless)' if sampler else format(s['equal_to_ar'], '.0%')} |")
        order = ("aligned/aligned", "aligned/deep", "deep/deep")
        comp = sorted((r for r in e2e if "component" in r["groups"]),
                      key=lambda r: (r["summary"]["method"] == "das-wave", fmt_opts(r["summary"])[4],
                                     order.index(fmt_opts(r["summary"])[3])))
        if comp:
            lines += ["", "Component study (prefix read depth for K and V; das-wave with and without carry):", "",
                      "| drafter | reads K/V | carry | accepted / verify | speedup [95% CI] |", "|---|---|---|---|---|"]
            for row in comp:
                s = row["summary"]
                _, _, _, reads, carry = fmt_opts(s)
                name = {"aligned/aligned": "aligned", "aligned/deep": "Deep V (Mature-V)",
                        "deep/deep": "Deep K/V"}[reads]
                drafter = ("sequential d={draft_steps}, gamma={gamma}" if s["method"] == "mature-spec"
                           else "DAS-Wave gamma={gamma}, k={k}").format(**s["options"])
                lo, hi = s["speedup_ci95"]
                lines.append(f"| {drafter} | {name} | {carry or '—'} | {s['mean_accepted']:.2f} | "
                             f"{s['speedup_mean']:.2f}× [{lo:.2f}, {hi:.2f}] |")
        samp = [r for r in e2e if r["summary"]["method"] == "parallel-sampler"]
        if samp:
            lines += ["", "Parallel sampler (not lossless): agreement with AR next to its speed:", "",
                      "| wavefront | r' | eps | EMA | token agreement | agreeing prefix (tokens) | tokens / round | "
                      "speedup [95% CI] |", "|---|---|---|---|---|---|---|---|"]
            for row in samp:
                s, o = row["summary"], row["summary"]["options"]
                lo, hi = s["speedup_ci95"]
                lines.append(f"| {o['gamma']} | {o['inner_steps']} | {o['epsilon']} | {o['ema']} | "
                             f"{s['agreement']:.1%} | {s['agree_prefix']:.1f} | {s['tokens_per_step']:.2f} | "
                             f"{s['speedup_mean']:.2f}× [{lo:.2f}, {hi:.2f}] |")
    costs = result.get("costs")
    if costs:
        lines += ["", f"Per-round costs, {costs['shape']} shape, random bf16 weights, R = {costs['num_steps']}, "
                      f"cache prefilled with {costs['prompt_len']} tokens, median of {costs['repeats']} "
                      f"(AR token {costs['ar_token_s'] * 1e3:.3f} ms):", "",
                  "| gamma | verify (gamma+1 tokens) ms | verify / AR token | das-wave round ms (k = ...) | "
                  "sampler round ms |", "|---|---|---|---|---|"]
        for g, t in costs["verify_s"].items():
            per = ", ".join(f"k={gk.split(',')[1]}: {c['per_round'] * 1e3:.3f}"
                            for gk, c in costs["das_wave_block_s"].items() if int(gk.split(",")[0]) == int(g))
            lines.append(f"| {g} | {t * 1e3:.3f} | {t / costs['ar_token_s']:.2f} | {per} | "
                         f"{costs['sampler_round_s'][g] * 1e3:.3f} |")
        pred = result.get("predicted", [])
        if pred:
            lines += ["", "Predicted speedup over AR from these costs (tokens per block x AR token / block time):",
                      "", "| method | gamma | d / k | block ms | at full acceptance | at measured acceptance "
                          "(tokens / step) |", "|---|---|---|---|---|---|"]
            for p in pred:
                meas = ("—" if p["measured_acceptance"] is None
                        else f"{p['measured_acceptance']:.2f}× ({p['tokens_per_step']:.2f})")
                lines.append(f"| {p['method']} | {p['gamma']} | {p.get('d', p.get('k'))} | {p['block_s'] * 1e3:.2f} | "
                             f"{p['full_acceptance']:.2f}× | {meas} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    """The command line, with the size defaults of --tiny or the full shape filled in."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="checkpoints/tiny-huginn-code", help="looped checkpoint folder (end to end)")
    ap.add_argument("--tiny", action="store_true", help="tiny random model / shape and small sizes (CPU smoke run)")
    ap.add_argument("--num-steps", type=int, default=None, help="full depth R (default 32, tiny 4)")
    ap.add_argument("--dtype", default="bfloat16",
                    help="end-to-end dtype; float32 also sets full-precision matmuls (token-exact comparisons)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 12 (tiny 2)")
    ap.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (default 48, tiny 8)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (tiny 8)")
    ap.add_argument("--grid", choices=("full", "small", "smoke"), default=None, help="default full (tiny: smoke)")
    ap.add_argument("--methods", default=",".join(GROUPS), help=f"comma list of groups: {', '.join(GROUPS)}")
    ap.add_argument("--repeats", type=int, default=1, help="AR / method pairs per prompt (median)")
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--time-budget-s", type=float, default=None, help="stop starting new configurations after this")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--costs", action="store_true", help="also time the per-round costs (random weights)")
    ap.add_argument("--cost-gammas", default=None, help="default 8,16,32 (tiny 4)")
    ap.add_argument("--cost-ks", default="1,2,4")
    ap.add_argument("--cost-ds", default=None, help="default 2,4,8 (tiny 2)")
    ap.add_argument("--cost-prompt-len", type=int, default=None, help="default 256 (tiny 16)")
    ap.add_argument("--cost-repeats", type=int, default=None, help="default 20 (tiny 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    tiny = args.tiny
    args.num_steps = args.num_steps or (4 if tiny else 32)
    args.num_prompts = args.num_prompts or (2 if tiny else 12)
    args.prompt_len = args.prompt_len or (8 if tiny else 48)
    args.max_new_tokens = args.max_new_tokens or (8 if tiny else 128)
    args.grid = args.grid or ("smoke" if tiny else "full")
    args.cost_gammas = args.cost_gammas or ("4" if tiny else "8,16,32")
    args.cost_ds = args.cost_ds or ("2" if tiny else "2,4,8")
    args.cost_prompt_len = args.cost_prompt_len or (16 if tiny else 256)
    args.cost_repeats = args.cost_repeats or (3 if tiny else 20)
    if tiny:
        args.cost_ks = ",".join(k for k in args.cost_ks.split(",") if int(k) <= args.num_steps)
    groups = {g.strip() for g in args.methods.split(",") if g.strip()}
    unknown = groups - set(GROUPS)
    if unknown:
        raise SystemExit(f"unknown --methods {sorted(unknown)}; choose from {GROUPS}")
    args.groups = groups
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    tiny, groups = args.tiny, args.groups

    if args.dtype == "float32" or tiny:
        # Full-precision matmuls (no TF32 on the GPU), so lossless methods can match AR token for token.
        jax.config.update("jax_default_matmul_precision", "highest")
    name = "tiny_random" if tiny else os.path.basename(os.path.normpath(args.model))
    result = result_header("looped_spec")
    result.update(model=name, num_steps=args.num_steps, dtype="float32" if tiny else args.dtype,
                  max_new_tokens=args.max_new_tokens,
                  repeats=args.repeats, grid=args.grid, e2e=[])
    stem = f"looped_spec_{name}_r{args.num_steps}_{time.strftime('%Y%m%d_%H%M%S')}"
    t_start = time.perf_counter()

    if not args.skip_e2e:
        if tiny:
            model = random_model(tiny_config(), jnp.float32, args.seed)
        else:
            model = looped.load_looped(args.model, args.dtype)
        prompts, source = load_prompts(args, model)
        result.update(num_prompts=int(prompts.shape[0]), prompts=source, prompt_len=int(prompts.shape[1]))
        for group, method, opts in grid_configs(args.grid, groups):  # group: a tuple of group names
            if args.time_budget_s and time.perf_counter() - t_start > args.time_budget_s:
                print(f"time budget reached; skipping {method} {opts} and later configurations", flush=True)
                result.setdefault("skipped", []).append(config_key(method, opts))
                continue
            t0 = time.perf_counter()
            row = run_config(model, prompts, method, opts, args)
            row["groups"] = list(group)
            s = row["summary"]
            print(f"[{time.perf_counter() - t0:6.1f} s] {s['key']}: speedup {s['speedup_mean']:.2f}x "
                  f"[{s['speedup_ci95'][0]:.2f}, {s['speedup_ci95'][1]:.2f}], tokens/step {s['tokens_per_step']:.2f}, "
                  f"equal to AR {s['equal_to_ar']:.0%}", flush=True)
            result["e2e"].append(row)
            write_results(args.out, stem, result, markdown(result), echo=False)  # partial results survive
    if args.costs:
        def save(partial):
            result["costs"] = partial
            result["predicted"] = predicted_speedups(partial, result["e2e"])
            write_results(args.out, stem, result, markdown(result), echo=False)  # partial results survive

        deadline = t_start + args.time_budget_s if args.time_budget_s else None
        save(round_costs(args, deadline, save))
    write_results(args.out, stem, result, markdown(result))
    return result


if __name__ == "__main__":
    main()
