"""The packed step kernel's launch settings (value columns per program, warps) at one GDN layer's shape: time per call
in a jitted loop of dependent calls, for a decode step (1 row, its layer of a 24-layer state stack written in place)
and a verification (T rows, no state out, its keys, gates and pseudo-values stored into the replay's stacks), and for
each setting the exactness it must keep: the verification's outputs equal to T decode steps' outputs and the
pseudo-value replay of its stash equal to the decode steps' states, bit for bit (decode and verification run one
setting, so any setting that keeps these is exact; the replay is elementwise, so it takes any block).

    python scripts/tune_packed_step.py --out "$OUT"                        # GPU (Qwen3.5-9B layer shape)
    python scripts/tune_packed_step.py --small --out /tmp/t                # CPU smoke run (interpret mode)
    ncu ... python scripts/tune_packed_step.py --profile-calls 5 --settings 8:1   # launches only, for a profiler
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specdec_jax.harness import median_time, result_header, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--lengths", default="1,3,9,17", help="row counts: 1 is the decode step, more a verification")
    ap.add_argument("--settings", default="8:1,4:1,2:1,16:1,8:2,16:2", help="BLOCK_V:WARPS, comma-separated")
    ap.add_argument("--chain", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--profile-calls", type=int, default=0,
                    help="only launch each setting's kernels this many times per length (no checks, no timing): "
                         "for a kernel profiler such as ncu")
    args = ap.parse_args()
    from pallas_kernels.gated_delta import PackedLayout, pallas_ops

    interpret = jax.default_backend() != "gpu"
    b, h, hv, kd, vd, n_layers = (1, 2, 4, 16, 16, 3) if args.small else (1, 16, 32, 128, 128, 24)
    chain = 2 if args.small else args.chain
    repeats = 1 if args.small else args.repeats
    settings = [tuple(int(x) for x in s.split(":")) for s in args.settings.split(",")]
    t_max = max(int(x) for x in args.lengths.split(","))
    layout = PackedLayout(h, hv, kd, vd, b_column=0, a_column=hv)
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    conv = jax.nn.silu(jax.random.normal(next(keys), (b, max(t_max, 8), layout.channels), jnp.float32)).astype(
        jnp.bfloat16)
    gates = jax.random.normal(next(keys), (b, max(t_max, 8), 2 * hv), jnp.bfloat16)
    a_log = jnp.log(jax.random.uniform(next(keys), (hv,), jnp.float32, 1.0, 16.0))
    dt_bias = jax.random.normal(next(keys), (hv,), jnp.float32)
    stack = jax.random.normal(next(keys), (n_layers, b, hv, kd, vd), jnp.float32) * 0.1
    one = jnp.ones((b,), jnp.int32)
    rows, checks = [], []
    for block_v, warps in settings:
        kw = dict(layout=layout, use_qk_l2norm=True, interpret=interpret, block_v=block_v, num_warps=warps)

        def decode(st, c, gt, layer, kw=kw):  # one row, counted, its layer of the stack written in place
            res = pallas_ops.packed_recurrent_gated_delta_rule(c, gt, a_log, dt_bias, n_steps=1, initial_state=st,
                                                               state_steps=one, state_layer=layer, **kw)
            return res.final_state, res.o

        def verify(st, c, gt, layer, stash, t, kw=kw):
            res = pallas_ops.packed_recurrent_gated_delta_rule(c, gt, a_log, dt_bias, n_steps=t, initial_state=st,
                                                               output_final_state=False, state_layer=layer,
                                                               replay_inputs=stash, **kw)
            return res.replay_inputs, res.o

        if args.profile_calls:
            for t in [int(x) for x in args.lengths.split(",")]:
                fn = jax.jit(decode if t == 1 else functools.partial(verify, stash="new", t=t))
                for _ in range(args.profile_calls):
                    jax.block_until_ready(fn(stack, conv[:, :t], gates[:, :t], 0))
            continue
        # Exactness of this setting: T decode steps against one verification of T rows and the replay of its stash.
        dec = jax.jit(decode)
        st, outs, states = stack, [], []
        for t in range(t_max):
            st, o = dec(st, conv[:, t:t + 1], gates[:, t:t + 1], 0)
            outs.append(np.asarray(o[:, 0]))
            states.append(np.asarray(st[0]))
        stash, o_ver = jax.jit(functools.partial(verify, stash="new", t=t_max))(stack, conv[:, :t_max],
                                                                                 gates[:, :t_max], 0)
        n_half = max(1, (t_max + 1) // 2)
        ok_o = bool(np.array_equal(np.asarray(o_ver), np.stack(outs, 1)))
        ok_states = []
        for n in (n_half, t_max):
            rep = pallas_ops.replay_pseudo_values(stack[0], stash[0][0], stash[1][0], stash[2][0],
                                                  jnp.full((b,), n, jnp.int32), interpret=interpret)
            ok_states.append(bool(np.array_equal(np.asarray(rep), states[n - 1])))
        checks.append({"block_v": block_v, "num_warps": warps, "T": t_max, "outputs_equal": ok_o,
                       f"replay_states_equal_at_{n_half}_and_{t_max}": all(ok_states)})
        print(checks[-1], flush=True)
        for t in [int(x) for x in args.lengths.split(",")]:
            if t == 1:
                loop = jax.jit(lambda st: jax.lax.fori_loop(
                    0, chain, lambda i, s: decode(s, conv[:, :1], gates[:, :1], i % n_layers)[0], st))
                us = median_time(lambda: loop(stack), repeats) / chain * 1e6
            else:
                first = jax.jit(functools.partial(verify, stash="new", t=t))(stack, conv[:, :t], gates[:, :t], 0)[0]
                loop = jax.jit(lambda sh, t=t: jax.lax.fori_loop(
                    0, chain, lambda i, s: verify(stack, conv[:, :t], gates[:, :t], i % n_layers, s, t)[0], sh))
                us = median_time(lambda: loop(first), repeats) / chain * 1e6
            rows.append({"T": t, "op": "decode (state in place)" if t == 1 else "verification (stash)",
                         "block_v": block_v, "num_warps": warps, "us": us})
            print(rows[-1], flush=True)
        header = result_header("tune_packed_step")
        md = [f"# The packed step kernel's launch settings, one GDN layer (B={b}, H={h}, HV={hv}, K={kd}, V={vd}, bf16; "
              f"{n_layers}-layer state stack)", "",
              f"{header['device']} · jax {header['jax']} · commit {header['git_commit']} · {header['date']}", "",
              f"`{header['command']}`", "", f"Per call, in a jitted loop of {chain} dependent calls (median of {repeats}).",
              "", "| T | op | block_v | warps | µs |", "|---|---|---|---|---|"]
        md += [f"| {r['T']} | {r['op']} | {r['block_v']} | {r['num_warps']} | {r['us']:.2f} |" for r in rows]
        md += ["", "Exactness of each setting (its own decode steps against its verification, bit for bit):", ""]
        md += [f"- {c}" for c in checks]
        write_results(args.out, "tune_packed_step" + ("_small" if args.small else ""),
                      {**header, "rows": rows, "checks": checks}, "\n".join(md) + "\n", echo=False)
    if not args.profile_calls:
        print("\n".join(md))


if __name__ == "__main__":
    main()
