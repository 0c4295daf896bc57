"""Where a speculative step's time goes, and which GPU path is fastest for each piece (the measurement
behind the defaults of `pallas_kernels.gated_delta.default_implementation` and of the verify form).

Every piece runs inside one jitted fori_loop of --chain dependent calls (no dispatch overhead, as the
on-device generation loop runs it); the arrays are jit arguments. Variants of one piece are traced under
different SPECDEC_GDN_IMPLEMENTATION settings, compiled together on a thread pool, then timed:

  - AR step (T = 1 forward + argmax): recurrent op as Pallas kernel / as XLA loop;
  - verification forward of gamma + 1 tokens: recurrent Pallas kernel, chunk Pallas kernels (the old
    default), recurrent XLA loop; and with snapshots;
  - commit: replay (Pallas, XLA), pseudo-values (Pallas, XLA), snapshot selection;
  - the whole `spec_step` (n-gram drafts, greedy): the defaults in each rollback mode, and the old
    default (chunk verify + XLA pseudo-value commit).

State: a --prefix-token committed prefix with random K/V and recurrent states (never zeros).
Writes profile_spec_step_<model>.json / .md as it goes (a killed run keeps what it measured).

    python scripts/profile_spec_step.py --random-9b --out "$OUT"            # GPU
    python scripts/profile_spec_step.py --model checkpoints/tiny-qwen35-code --out "$OUT"
    python scripts/profile_spec_step.py --random-9b --tiny --chain 2 --repeats 1 --out /tmp/p   # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specdec_jax.harness import (carried_lowered, chain_lowered, compile_all, env_setting,  # noqa: E402
                                  result_header, time_chain, write_results)

ENV = "SPECDEC_GDN_IMPLEMENTATION"
PALLAS = "chunk=pallas,recurrent=pallas,replay=pallas,commit=pallas"
OLD_DEFAULT = "chunk=pallas,recurrent=reference,replay=reference,commit=reference"
XLA_LOOPS = "chunk=pallas,recurrent=reference,replay=reference,commit=reference"


def committed_state(cfg, dtype, prefix: int, max_len: int, seed: int = 0):
    """A state as after a `prefix`-token prompt: random K/V in the prefix slots, random GDN and conv states."""
    from specdec_jax.models import qwen35
    base = qwen35.init_state(cfg, 1, max_len, dtype)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))
    rand = lambda x, s: (jax.random.normal(next(keys), x.shape, jnp.float32) * s).astype(x.dtype)
    return base.replace(length=jnp.full((1,), prefix, jnp.int32),
                        keys=tuple(rand(x, 1.0) for x in base.keys), values=tuple(rand(x, 1.0) for x in base.values),
                        conv=rand(base.conv, 0.5), recurrent=rand(base.recurrent, 0.1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--random-9b", action="store_true", help="Qwen3.5-9B shape, random weights")
    ap.add_argument("--tiny", action="store_true", help="with --random-9b: a tiny shape (CPU smoke run)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--precision", default=None, choices=(None, "highest"),
                    help="jax_default_matmul_precision for the whole run")
    ap.add_argument("--gammas", default="4,8,16")
    ap.add_argument("--step-gammas", default="8", help="gammas of the whole-step rows")
    ap.add_argument("--pieces", default="ar,verify,commit,step")
    ap.add_argument("--matvec-modes", default="auto", help="SPECDEC_MATVEC settings to compare for AR and verify "
                    "(comma list of auto, dot, reduce)")
    ap.add_argument("--ar-rows", type=int, default=0, help="also time the exact path's AR step at this row count")
    ap.add_argument("--variants", default="pallas,xla loop,chunk",
                    help="AR / verify GDN variants: pallas, xla loop, chunk (verify only)")
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--time-budget-s", type=float, default=1e9, help="stop timing new rows after this long")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.precision:
        jax.config.update("jax_default_matmul_precision", args.precision)
    import specdec_jax as sj
    from specdec_jax.decoding import speculative as sp
    from specdec_jax.decoding.sampling import SamplingConfig
    from specdec_jax.drafters.ngram import NgramDrafter
    from specdec_jax.models import qwen35

    t_start = time.perf_counter()
    if args.random_9b:
        from scripts.bench_spec import random_9b_model
        model = random_9b_model(args.tiny, dtype=args.dtype)
        name = "qwen35_tiny_random" if args.tiny else "qwen35_9b_random"
    else:
        model = sj.load(args.model, dtype=args.dtype)
        name = os.path.basename(os.path.normpath(args.model))
    name += "" if args.dtype == "bfloat16" else f"_{args.dtype}" + (f"_{args.precision}" if args.precision else "")
    cfg, params = model.config, model.params
    gammas = [int(g) for g in args.gammas.split(",")]
    step_gammas = [int(g) for g in args.step_gammas.split(",")]
    wanted = set(args.pieces.split(","))
    max_len = args.prefix + 4 * args.chain * (max(gammas + step_gammas) + 1) + 64
    base = committed_state(cfg, model.dtype, args.prefix, max_len)
    rng = np.random.default_rng(0)
    toks = {g: jnp.asarray(rng.integers(0, cfg.vocab_size, (1, g + 1)), jnp.int32) for g in gammas + step_gammas}

    lowered, inputs = {}, {}

    matvec_modes = args.matvec_modes.split(",")
    matvec = {"mode": matvec_modes[0]}  # SPECDEC_MATVEC while lowering (read at trace time)

    def labelled(key):  # with several matvec modes, each AR / verify row names its own
        return key if len(matvec_modes) == 1 else (key[0], f"{key[1]}, matvec {matvec['mode']}", key[2])

    def add(key, env, fn, fargs, feed):
        key = labelled(key)
        with env_setting(**{ENV: env, "SPECDEC_MATVEC": matvec["mode"]}):
            lowered[key] = chain_lowered(fn, fargs, feed, args.chain)
        inputs[key] = fargs

    def add_carried(key, env, fn, carry, consts):
        key = labelled(key)
        with env_setting(**{ENV: env, "SPECDEC_MATVEC": matvec["mode"]}):
            lowered[key] = carried_lowered(fn, carry, consts, args.chain)
        inputs[key] = (carry, tuple(consts))

    def ar_step(carry, params):  # the state is carried: its update (GDN states, K/V write) is real work
        tok, st = carry
        logits, st, _ = qwen35.forward(params, cfg, st, tok, logits_for="last")
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], st

    def ar_step_rows(carry, params):  # the exact path's AR step: one valid row in a forward of decode rows
        tok, st = carry
        padded = jnp.repeat(tok, args.ar_rows, axis=1)
        logits, st, _ = qwen35.forward(params, cfg, st, padded, n_valid=jnp.ones((1,), jnp.int32))
        return jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)[:, None], st

    variants = args.variants.split(",")
    for mode in matvec_modes:
        matvec["mode"] = mode
        if "ar" in wanted:
            for label, env in (("pallas", PALLAS), ("xla loop", XLA_LOOPS)):
                if label in variants:
                    add_carried(("AR step", label, 0), env, ar_step, (toks[gammas[0]][:, :1], base), (params,))
            if args.ar_rows:
                add_carried((f"AR step, {args.ar_rows} rows (exact path)", "pallas", 0), PALLAS, ar_step_rows,
                            (toks[gammas[0]][:, :1], base), (params,))
        for g in gammas:
            if "verify" in wanted:
                for label, env, collect in (("recurrent pallas", PALLAS, "replay"),
                                            ("chunk pallas", OLD_DEFAULT, "pseudo"),
                                            ("recurrent xla loop", XLA_LOOPS, "replay"),
                                            ("recurrent pallas, snapshots", PALLAS, "snapshot")):
                    if (collect == "snapshot" and g + 1 > qwen35.MAX_RECURRENT_VERIFY) or label.split(",")[0] \
                            .replace("recurrent pallas", "pallas").replace("recurrent xla loop", "xla loop") \
                            .replace("chunk pallas", "chunk") not in variants:
                        continue
                    fn = lambda p, s, t, c=collect: qwen35.forward(p, cfg, s, t, collect=c)[0]
                    add(("verify", label, g), env, fn, (params, base, toks[g]), 2)
        if "commit" in wanted:
            for label, env, collect in (("replay pallas", PALLAS, "replay"), ("replay xla loop", XLA_LOOPS, "replay"),
                                        ("pseudo pallas", PALLAS, "pseudo"), ("pseudo xla", XLA_LOOPS, "pseudo"),
                                        ("snapshot", PALLAS, "snapshot")):
                if collect == "snapshot" and g + 1 > qwen35.MAX_RECURRENT_VERIFY:
                    continue
                with env_setting(**{ENV: env}):
                    _, verified, extras = jax.jit(lambda p, s, t, c=collect: qwen35.forward(p, cfg, s, t, collect=c))(
                        params, base, toks[g])
                n_keep = jnp.full((1,), (g + 2) // 2, jnp.int32)
                # The committed state is carried into the next commit: nothing of it is dead code.
                fn = lambda st, v, e, n: qwen35.commit(st, v, e, n).replace(length=st.length)
                add_carried(("commit", label, g), env, fn, base, (verified, extras, n_keep))
    spec_states = {}
    if "step" in wanted:
        drafter = NgramDrafter()
        for g in step_gammas:
            static = dict(cfg=cfg, max_len=max_len, sampling=SamplingConfig(), eos_ids=(), state_dtype=model.dtype,
                          gamma=g, max_new_tokens=2 * args.chain * (g + 1), drafter=drafter, impl="auto")
            prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 16)), jnp.int32)
            state, dstate = sp._spec_prefill(params, prompt, jax.random.PRNGKey(0), **static)
            state = state.replace(model=base.replace(length=state.model.length))
            spec_states[g] = (state, dstate)
            for label, env, rb in (("default, replay", PALLAS, "replay"), ("pallas, pseudo", PALLAS, "pseudo"),
                                   ("pallas, snapshot", PALLAS, "snapshot"), ("old default (chunk, xla pseudo)",
                                                                             OLD_DEFAULT, "pseudo")):
                if rb in ("snapshot", "replay") and g + 1 > qwen35.MAX_RECURRENT_VERIFY:
                    continue

                def steps(arrays, rb=rb, g=g, mnt=static["max_new_tokens"]):
                    p, s, d = arrays

                    def body(i, carry):  # the whole state is carried: nothing of a step is dead code
                        s, d = carry
                        s, d, _, _ = sp.spec_step(p, cfg, s, d, jax.random.PRNGKey(i), drafter=drafter, gamma=g,
                                                  sampling=SamplingConfig(), rollback=rb, max_new_tokens=mnt,
                                                  eos_ids=())
                        return s, d
                    return jax.lax.fori_loop(0, args.chain, body, (s, d))

                key = ("whole spec_step", label, g)
                with env_setting(**{ENV: env}):
                    lowered[key] = jax.jit(steps).lower((params, state, dstate))
                inputs[key] = (params, state, dstate)
    print(f"lowered {len(lowered)} loops in {time.perf_counter() - t_start:.0f} s", flush=True)
    t0 = time.perf_counter()
    compiled = compile_all(lowered)
    print(f"compiled them in {time.perf_counter() - t0:.0f} s", flush=True)

    header = result_header("profile_spec_step")
    rows = []
    ar_us = None

    def save():
        md = [f"# One speculative step, piece by piece ({name})", "",
              f"{header['device']} · jax {header['jax']} · commit {header['git_commit']} · {header['date']}", "",
              f"`{header['command']}`", "",
              f"Each piece in a jitted loop of {args.chain} dependent calls (median of {args.repeats}), per call; "
              f"{args.dtype} weights, {args.prefix}-token committed prefix with random K/V and states; n-gram "
              "drafts for whole steps.", "", "| piece | variant | gamma | µs | × AR step (pallas) |", "|---|---|---|---|---|"]
        md += [f"| {r['piece']} | {r['variant']} | {r['gamma'] or '-'} | {r['us']:.1f} | "
               f"{r['us'] / ar_us:.3f} |" if ar_us else
               f"| {r['piece']} | {r['variant']} | {r['gamma'] or '-'} | {r['us']:.1f} | - |" for r in rows]
        write_results(args.out, f"profile_spec_step_{name}{args.tag}",
                      {**header, "model": name, "dtype": args.dtype, "precision": args.precision,
                       "chain": args.chain, "prefix": args.prefix, "rows": rows}, "\n".join(md) + "\n")

    for key, exe in compiled.items():
        if time.perf_counter() - t_start > args.time_budget_s:
            print("time budget reached", flush=True)
            break
        us = time_chain(exe, inputs[key], args.chain, args.repeats) * 1e6
        piece, variant, g = key
        rows.append({"piece": piece, "variant": variant, "gamma": g, "us": us})
        if piece == "AR step" and variant.split(",")[0] == "pallas" and ar_us is None:
            ar_us = us  # the first 1-row AR step with the Pallas GDN op: the ratios' unit
        print(f"{piece:18s} {variant:34s} {g:3d} {us:10.1f} us", flush=True)
    save()


if __name__ == "__main__":
    main()
