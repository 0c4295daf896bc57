"""Where one speculative step's time goes on a checkpoint (GPU; --tiny shapes on CPU for a smoke run).

Times, each inside one jitted fori_loop of --chain dependent calls (no dispatch overhead, as the
on-device generation loop runs them): one AR step (T = 1 forward + argmax), the drafter's proposal,
the verification forward (gamma + 1 tokens) in both rollback modes, greedy acceptance, the commit in
both modes, and the whole `spec_step` (draft -> verify -> accept -> commit -> bookkeeping) in both
modes. State: a --prefix token committed prefix with random recurrent states (not zeros).
Writes profile_spec_step_<model>.json / .md.

    python scripts/profile_spec_step.py --model checkpoints/tiny-qwen35-code --out "$OUT"
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from scripts.bench_common import chain_seconds, median_time, result_header, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="checkpoints/tiny-qwen35-code")
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    import specdec_jax as sj
    from specdec_jax.decoding import speculative as sp
    from specdec_jax.decoding.acceptance import greedy_accept
    from specdec_jax.decoding.sampling import SamplingConfig
    from specdec_jax.drafters.ngram import NgramDrafter
    from specdec_jax.models import qwen35

    model = sj.load(args.model, dtype="bfloat16")
    cfg, params, g = model.config, model.params, args.gamma
    name = os.path.basename(os.path.normpath(args.model))
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, args.prefix)), jnp.int32)
    drafter = NgramDrafter()
    static = dict(cfg=cfg, max_len=args.prefix + 4 * args.chain * (g + 1), sampling=SamplingConfig(), eos_ids=(),
                  state_dtype=jnp.float32, gamma=g, max_new_tokens=2 * args.chain * (g + 1), drafter=drafter,
                  impl="auto")
    state, dstate = sp._spec_prefill(params, prompt, jax.random.PRNGKey(0), **static)
    model_state = state.model.replace(recurrent=tuple(
        jax.random.normal(jax.random.PRNGKey(i), r.shape, jnp.float32) * 0.1 for i, r in enumerate(state.model.recurrent)))
    state = state.replace(model=model_state)
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, g + 1)), jnp.int32)
    rows = []

    def record(piece, sec):
        rows.append({"piece": piece, "us": sec * 1e6})
        print(f"{piece:40s} {sec * 1e6:9.1f} us", flush=True)

    def ar_step(tok, params, st):
        logits = qwen35.forward(params, cfg, st, tok, logits_for="last")[0]
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
    record("AR step (forward T=1 + argmax)", chain_seconds(ar_step, (toks[:, :1], params, model_state), 0,
                                                           args.chain, args.repeats))

    def propose(hist, st):
        return drafter.propose(params, cfg, (), hist, st.hist_len, g, jax.random.PRNGKey(0))[0]
    record(f"n-gram proposal (gamma {g})", chain_seconds(propose, (state.history, state), 0, args.chain,
                                                          args.repeats))
    for rb in ("pseudo", "snapshot"):
        def verify(t, params, st, rb=rb):
            return qwen35.forward(params, cfg, st, t, collect=rb)[0]
        record(f"verify forward T={g + 1} ({rb})", chain_seconds(verify, (toks, params, model_state), 0, args.chain,
                                                                  args.repeats))
    logits, verified, extras = jax.jit(lambda p, s, t: qwen35.forward(p, cfg, s, t, collect="pseudo"))(
        params, model_state, toks)
    record("greedy acceptance", chain_seconds(lambda d, lg: greedy_accept(d, lg)[0], (toks[:, 1:], logits), 0,
                                              args.chain, args.repeats))
    for rb in ("pseudo", "snapshot"):
        _, verified, extras = jax.jit(lambda p, s, t, rb=rb: qwen35.forward(p, cfg, s, t, collect=rb))(
            params, model_state, toks)
        n_keep = jnp.full((1,), (g + 2) // 2, jnp.int32)

        def commit(n, st, ver, ex):
            return qwen35.commit(st, ver, ex, n).recurrent[0]
        record(f"commit ({rb})", chain_seconds(commit, (n_keep, model_state, verified, extras), 0, args.chain,
                                               args.repeats))
    for rb in ("pseudo", "snapshot"):
        def run(p, s, d, rb=rb):
            def body(i, carry):
                s, d = carry
                s, d, _, _ = sp.spec_step(p, cfg, s, d, jax.random.PRNGKey(i), drafter=drafter, gamma=g,
                                          sampling=SamplingConfig(), rollback=rb,
                                          max_new_tokens=static["max_new_tokens"], eos_ids=())
                return s, d
            return jax.lax.fori_loop(0, args.chain, body, (s, d))  # the whole state: nothing is dead code

        looped = jax.jit(run)
        record(f"whole spec_step ({rb})", median_time(lambda: looped(params, state, dstate), args.repeats) / args.chain)

    header = result_header("profile_spec_step")
    md = [f"# One speculative step, piece by piece ({name}, n-gram, gamma {g})", "",
          f"{header['device']} · jax {header['jax']} · commit {header['git_commit']} · {header['date']}", "",
          f"`{header['command']}`", "",
          f"Each piece in a jitted loop of {args.chain} dependent calls (median of {args.repeats}), per call; "
          f"bf16 weights, {args.prefix}-token committed prefix.", "", "| piece | µs | × AR step |", "|---|---|---|"]
    ar = rows[0]["us"]
    md += [f"| {r['piece']} | {r['us']:.1f} | {r['us'] / ar:.2f} |" for r in rows]
    write_results(args.out, f"profile_spec_step_{name}", {**header, "model": name, "gamma": g, "rows": rows},
                  "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
