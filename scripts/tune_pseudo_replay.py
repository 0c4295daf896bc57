"""The pseudo-value replay (the commit of the replay rollback) at the Qwen3.5-9B shape, every GDN layer in one
launch: time per call for each block width and warp count, and bit-for-bit checks that every setting commits the
state the verification's own recurrence reached (the replay is elementwise, so the block shape is free; this says
so on the GPU and picks the fastest).

The keys, gates and pseudo-values come from real verification calls (the recurrent kernel with `replay_inputs`, one
call per layer of the stack, as the model runs them), which also return the state after every position: each
setting's committed state must equal the state after n positions, for every n.

    python scripts/tune_pseudo_replay.py --out "$OUT"                 # GPU
    python scripts/tune_pseudo_replay.py --small --out /tmp/t         # CPU smoke run (interpret mode)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specdec_jax.harness import median_time, result_header, write_results  # noqa: E402


def parse_settings(text: str) -> list[tuple[int, int]]:
    """"8:1,32:4" -> [(8, 1), (32, 4)]: (block_v, num_warps) pairs. Raises ValueError naming the bad item."""
    settings = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--settings: each item is BLOCK_V:WARPS (positive integers); got {item!r}")
        settings.append((int(parts[0]), int(parts[1])))
    return settings


def stash_and_states(layers: int, t: int, shape, key, interpret: bool):
    """Every layer's verification (bf16 inputs, one recurrent call per layer on the stack of states): the stacks
    (k, g, u) [L, B, T, ...], the initial states [L, B, HV, K, V] and the states after each position
    [L, B, T, HV, K, V]."""
    from pallas_kernels import gated_delta as gd
    b, h, hv, kd, vd = shape
    keys = iter(jax.random.split(key, 8))
    q = jax.random.normal(next(keys), (layers, b, t, h, kd), jnp.bfloat16)
    k = jax.random.normal(next(keys), (layers, b, t, h, kd), jnp.bfloat16)
    v = jax.random.normal(next(keys), (layers, b, t, hv, vd), jnp.bfloat16)
    g = -jax.random.uniform(next(keys), (layers, b, t, hv), jnp.float32, 0.01, 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(next(keys), (layers, b, t, hv), jnp.float32)).astype(jnp.bfloat16)
    s0 = jax.random.normal(next(keys), (layers, b, hv, kd, vd), jnp.float32) * 0.1

    def layer_call(states, stash, i):
        out = gd.fused_recurrent_gated_delta_rule(
            q[i], k[i], v[i], g[i], beta[i], initial_state=states, state_layer=i, use_qk_l2norm=True,
            output_final_state=False, return_all_states=True, replay_inputs=stash, implementation="pallas",
            interpret=interpret)
        return out.replay_inputs, out.all_states

    first = jax.jit(lambda s: layer_call(s, "new", 0))
    later = jax.jit(lambda s, st, i: layer_call(s, st, i))
    stash, states0 = first(s0)
    all_states = [states0]
    for i in range(1, layers):
        stash, st = later(s0, stash, jnp.int32(i))
        all_states.append(st)
    return stash, s0, jnp.stack(all_states)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--lengths", default="3,9,17")
    ap.add_argument("--settings", default="8:1,16:1,16:2,32:1,32:2,32:4,64:2,64:4,128:4,128:8",
                    help="BLOCK_V:WARPS pairs, comma-separated; the first is the reference (the verification's own)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    try:
        settings = parse_settings(args.settings)
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError as e:
        ap.error(str(e) if "--settings" in str(e) else f"--lengths: comma-separated integers; got {args.lengths!r}")
    if min(lengths) < 1:
        ap.error(f"--lengths: each length must be >= 1; got {args.lengths!r}")
    from pallas_kernels.gated_delta import pallas_ops

    interpret = jax.default_backend() != "gpu"
    shape = (1, 2, 4, 32, 32) if args.small else (1, 16, 32, 128, 128)
    layers = 2 if args.small else args.layers
    chain = 2 if args.small else args.chain
    repeats = 1 if args.small else args.repeats
    settings = settings[:2] if args.small else settings
    rows, checks = [], []
    header = result_header("tune_pseudo_replay")
    for t in lengths:
        stash, s0, states = stash_and_states(layers, t, shape, jax.random.PRNGKey(t), interpret)
        flat = lambda x: x.reshape((-1,) + x.shape[2:])  # [L, B, ...] -> [L * B, ...]: the commit's form
        ks, gs, us = (flat(x) for x in stash)
        s0_flat = flat(s0)
        after = jnp.concatenate([s0[:, :, None], states], axis=2)  # [L, B, T + 1, HV, K, V]
        for block_v, warps in settings:
            replay = jax.jit(lambda s, n, bv=block_v, w=warps: pallas_ops.replay_pseudo_values(
                s, ks, gs, us, n, interpret=interpret, block_v=bv, num_warps=w))
            equal = True
            for n_keep in range(t + 1):  # every count, each layer against its own recurrence
                n = jnp.full((s0_flat.shape[0],), n_keep, jnp.int32)
                got = np.asarray(replay(s0_flat, n)).reshape(s0.shape)
                equal &= bool(np.array_equal(got, np.asarray(after[:, :, n_keep])))
            checks.append({"T": t, "block_v": block_v, "num_warps": warps, "equal_to_the_recurrence": equal})
            n_full = jnp.full((s0_flat.shape[0],), t, jnp.int32)
            loop = jax.jit(lambda s, r=replay: jax.lax.fori_loop(0, chain, lambda _, x: r(x, n_full) * 0.5, s))
            us_per = median_time(lambda: loop(s0_flat), repeats) / chain * 1e6
            rows.append({"T": t, "block_v": block_v, "num_warps": warps, "us": us_per, "equal": equal})
            print(rows[-1], flush=True)
        md = [f"# Pseudo-value replay, {layers} GDN layers in one launch (B={shape[0]}, H={shape[1]}, HV={shape[2]}, "
              f"K={shape[3]}, V={shape[4]})", "",
              f"{header['device']} · jax {header['jax']} · commit {header['git_commit']} · {header['date']}", "",
              f"`{header['command']}`", "",
              f"Per call, every position kept, in a jitted loop of {chain} dependent calls (median of {repeats}). "
              "`equal`: for every kept count n, every layer's committed state equals the state its verification "
              "(the recurrent kernel, block 8, 1 warp) reached after n positions, bit for bit.", "",
              "| T | block_v | warps | µs | equal |", "|---|---|---|---|---|"]
        md += [f"| {r['T']} | {r['block_v']} | {r['num_warps']} | {r['us']:.1f} | {r['equal']} |" for r in rows]
        write_results(args.out, "tune_pseudo_replay" + ("_small" if args.small else ""),
                      {**header, "layers": layers, "shape": shape, "rows": rows, "checks": checks},
                      "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
