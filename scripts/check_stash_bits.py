"""Bit-level check of the replay stash (SPECDEC_GDN_REPLAY_STASH) at the Qwen3.5-9B shape, step by step.

Three chains run side by side from one prefilled state, each compiled on its own: the exact-path verification +
replay commit with the stash off (the full replay from stacked inputs), the same with it on (the pseudo-value replay
from the keys, gates and pseudo-values the verification's kernels stored), and (while one token is kept per step, as with rejected
n-gram drafts) AR's exact decode step at the same row count. Every step compares, bit for bit, row 0's logits and
the committed GDN recurrent and conv states (per layer where they differ), and reruns the stash-on step on the
same inputs (determinism). A generation-level mismatch (`bench_exact.py`) says that outputs differ; this says
which chain departs first and where.

    python scripts/check_stash_bits.py --steps 48 --out benchmarks/results
    python scripts/check_stash_bits.py --tiny-shape --steps 4 --out /tmp/x     # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.gated_delta import REPLAY_STASH_ENV  # noqa: E402
from scripts.bench_spec import random_9b_model  # noqa: E402
from specdec_jax.decoding import compiled  # noqa: E402
from specdec_jax.decoding.autoregressive import ar_ops  # noqa: E402
from specdec_jax.decoding.decode_shape import choose_decode_rows  # noqa: E402
from specdec_jax.decoding.speculative import verify_forward  # noqa: E402
from specdec_jax.harness import result_header, write_results  # noqa: E402
from specdec_jax.models import qwen35  # noqa: E402
from specdec_jax.models.family import QWEN35  # noqa: E402


def compile_with_stash(fn, flag: str, args):
    """fn compiled while SPECDEC_GDN_REPLAY_STASH=flag (the switch is read when the function is traced)."""
    old = os.environ.get(REPLAY_STASH_ENV)
    os.environ[REPLAY_STASH_ENV] = flag
    try:
        lowered = jax.jit(lambda *a: fn(*a)).lower(*args)  # a new function: traced anew, not from a trace cache
        return lowered.compile(compiler_options=compiled.compiler_options("qwen3_5") or None)
    finally:
        if old is None:
            os.environ.pop(REPLAY_STASH_ENV)
        else:
            os.environ[REPLAY_STASH_ENV] = old


def differing_layers(a, b) -> list[int]:
    """Layer indices (leading axis) where two stacked arrays differ in any bit."""
    a, b = np.asarray(a), np.asarray(b)
    return [i for i in range(a.shape[0]) if not np.array_equal(a[i], b[i])]


def compare(name_a, a, name_b, b) -> dict | None:
    """None when row 0's logits and the committed states are bit-identical, else where they differ."""
    (la, sa), (lb, sb) = a, b
    out = {}
    if not np.array_equal(np.asarray(la), np.asarray(lb)):
        out["logits_max_abs"] = float(np.max(np.abs(np.asarray(la, np.float32) - np.asarray(lb, np.float32))))
    for field in ("recurrent", "conv"):
        layers = differing_layers(getattr(sa, field), getattr(sb, field))
        if layers:
            out[field] = layers
    return {"pair": f"{name_a} vs {name_b}", **out} if out else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--ar-steps", type=int, default=None, help="steps that keep one token (default: steps / 2)")
    ap.add_argument("--gamma", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--damp", type=float, default=0.02)
    ap.add_argument("--tiny-shape", action="store_true", help="a tiny shape (CPU smoke run)")
    ap.add_argument("--impl", default="auto", help="GDN implementation (CPU smoke run: pallas, interpret mode)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.steps < 1 or not 1 <= args.gamma < 64:
        ap.error("--steps must be >= 1 and --gamma in [1, 63]")
    ar_steps = args.steps // 2 if args.ar_steps is None else args.ar_steps
    header = result_header("check_stash_bits")
    model = random_9b_model(args.tiny_shape, damp=args.damp)
    cfg, params = model.config, model.params
    rows = choose_decode_rows(args.gamma, None, "qwen3_5")
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, args.prompt_len)), jnp.int32)
    max_len = args.prompt_len + args.steps * rows + rows

    def prefill(params, prompt):
        state = qwen35.init_state(cfg, 1, max_len, model.dtype)
        logits, state, _ = qwen35.forward(params, cfg, state, prompt, logits_for="last")
        return logits[:, 0], state

    traced_stash = []  # per compiled spec step: whether its commit replayed from the stash

    def spec(params, state, ids, n):  # ids [1, gamma + 1]; n [1] kept positions
        logits, verified, extras = verify_forward(params, cfg, state, ids, rollback="replay", impl=args.impl,
                                                  decode_rows=rows)
        traced_stash.append("replay_inputs" in extras)
        return logits, qwen35.commit(state, verified, extras, n, impl=args.impl)

    ar_decode = ar_ops(QWEN35, rows).decode

    def ar(params, state, ids):
        return ar_decode(params, cfg, state, ids)

    first_logits, state0 = jax.jit(prefill)(params, prompt)
    ids0 = jnp.zeros((1, args.gamma + 1), jnp.int32)
    n0 = jnp.ones((1,), jnp.int32)
    t0 = time.perf_counter()
    spec_off = compile_with_stash(spec, "0", (params, state0, ids0, n0))
    spec_on = compile_with_stash(spec, "1", (params, state0, ids0, n0))
    ar_step = compile_with_stash(ar, "0", (params, state0, ids0[:, :1]))
    compile_s = time.perf_counter() - t0
    if args.impl != "reference" and traced_stash != [False, True]:
        raise SystemExit(f"the stash switch did not take effect (traced: {traced_stash}; impl {args.impl!r})")
    print(f"compiled in {compile_s:.0f} s", flush=True)

    chains = {"off": state0, "on": state0, "ar": state0}
    anchor = int(jnp.argmax(first_logits[0]))
    events, steps_run = [], 0
    for step in range(args.steps):
        n = 1 if step < ar_steps else int(rng.integers(1, args.gamma + 2))
        ids = jnp.asarray([[anchor] + list(rng.integers(0, cfg.vocab_size, args.gamma))], jnp.int32)
        nk = jnp.asarray([n], jnp.int32)
        lo, so = spec_off(params, chains["off"], ids, nk)
        ln, sn = spec_on(params, chains["on"], ids, nk)
        ln2, sn2 = spec_on(params, chains["on"], ids, nk)
        found = [compare("off", (lo[:, n - 1], so), "on", (ln[:, n - 1], sn)),
                 compare("on", (ln[:, n - 1], sn), "on again", (ln2[:, n - 1], sn2))]
        if step < ar_steps:
            la, sa = ar_step(params, chains["ar"], ids[:, :1])
            found.append(compare("off", (lo[:, 0], so), "ar", (la, sa)))
            chains["ar"] = sa
        for f in found:
            if f:
                events.append({"step": step, "kept": n, **f})
                print(json.dumps(events[-1]), flush=True)
        chains.update(off=so, on=sn)
        anchor = int(jnp.argmax(lo[0, n - 1]))
        steps_run += 1
    out = {**header, "model": "qwen35_9b_random" + ("_tiny_shape" if args.tiny_shape else ""), "damp": args.damp,
           "gamma": args.gamma, "decode_rows": rows, "steps": steps_run, "ar_steps": ar_steps,
           "compile_seconds": compile_s, "events": events}
    lines = [f"# Replay-input stash, bit by bit ({out['model']})", "",
             f"{header['device']} · jax {header['jax']} · commit {header['git_commit']}", "",
             f"`{header['command']}`", "",
             f"Random weights (bfloat16, residual writes x{args.damp}), gamma {args.gamma}, decode rows {rows}. "
             f"{steps_run} steps of random drafts from one prefilled state: the first {ar_steps} keep one token "
             f"(AR's exact decode step beside them), the rest a random count. Compared every step, bit for bit: "
             f"the kept row's logits and the committed GDN recurrent and conv states (stash off, on, on again).", ""]
    if not events:
        lines.append("**No difference**: every step's logits and states were bit-identical across the chains.")
    else:
        lines += ["| step | kept | pair | logits max abs diff | recurrent layers | conv layers |", "|---|---|---|---|---|---|"]
        lines += [f"| {e['step']} | {e['kept']} | {e['pair']} | {e.get('logits_max_abs', 0):.3g} | "
                  f"{e.get('recurrent', '')} | {e.get('conv', '')} |" for e in events[:40]]
    write_results(args.out, f"stash_bits_{out['model']}{args.tag}", out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
