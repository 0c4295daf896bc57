"""Where the looped model's core-block time goes at the Huginn-0125 shape (GPU).

Times, at batch 1 and one new token (decode), on random bf16 weights:
  - every matrix of an adapter + core application as a lone matrix-vector product, three ways:
    the matrix product on the stored [out, in] weight, the same with `in` zero-padded to a multiple
    of 256 (n_embd 5280 is not a multiple of 128), and a broadcast-multiply + float32 row
    reduction (layers.linear's "reduce" form); achieved bandwidth = weight bytes / time;
  - the attention of one core layer over a --prompt-len token prefix, one whole block, and one
    whole core application (adapter + 4 blocks), as the model runs them;
and writes the optimised HLO of one core application to --out (core_step_hlo<tag>.txt) for reading.
The model's own ops follow SPECDEC_MATVEC (layers.matvec_mode); run under XLA_FLAGS to compare
XLA's GEMM back-ends.
Times: median over --repeats of a jitted chain of --chain dependent calls, per call.

    python scripts/profile_looped_core.py --out "$OUT"
    python scripts/profile_looped_core.py --tiny --out /tmp/prof     # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from scripts.bench_looped import bench_config, tree_bytes  # noqa: E402
from specdec_jax.harness import chain_seconds, result_header, write_results  # noqa: E402
from specdec_jax.models import looped  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=320)
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.3)
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    cfg = bench_config(args.tiny)
    params = looped.init_random_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16, std=0.02)
    core = {"adapter": params["adapter"], "core_block": params["core_block"]}
    del params
    D = cfg.n_embd
    bw = args.bandwidth_tbs * 1e12
    rows = []

    def record(name, sec, nbytes):
        rows.append(dict(op=name, ms=sec * 1e3, bytes=int(nbytes), TBps=nbytes / sec / 1e12,
                         roofline_fraction=nbytes / bw / sec))
        print(f"{name:48s} {sec * 1e3:8.4f} ms  {nbytes / sec / 1e12:6.2f} TB/s", flush=True)

    key = jax.random.PRNGKey(1)
    lp = core["core_block"][0]
    mats = {"adapter": core["adapter"], "attn.Wqkv": lp["attn"]["Wqkv"], "attn.proj": lp["attn"]["proj"],
            "mlp.fc": lp["mlp"]["fc"], "mlp.proj": lp["mlp"]["proj"]}
    def dot(x, w):  # the matrix product, whatever SPECDEC_MATVEC says
        return lax.dot_general(x, w, (((2,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(x.dtype)

    def reduce(x, w):  # broadcast-multiply + float32 row reduction
        return jnp.sum(x[0].astype(jnp.float32) * w.astype(jnp.float32), axis=-1)[None].astype(x.dtype)

    for name, w in mats.items():
        n_out, n_in = w.shape
        x = jax.random.normal(key, (1, 1, n_in), jnp.float32).astype(w.dtype)
        nbytes = w.size * w.dtype.itemsize
        record(f"{name} [{n_out},{n_in}] dot", chain_seconds(dot, (x, w), 0, args.chain, args.repeats), nbytes)
        record(f"{name} [{n_out},{n_in}] reduce", chain_seconds(reduce, (x, w), 0, args.chain, args.repeats), nbytes)
        pad = -n_in % 256
        if pad:
            wp = jnp.pad(w, ((0, 0), (0, pad)))
            xp = jnp.pad(x, ((0, 0), (0, 0), (0, pad)))
            record(f"{name} dot, in padded to {n_in + pad}", chain_seconds(dot, (xp, wp), 0, args.chain,
                                                                           args.repeats), nbytes)
            del wp

    S = args.prompt_len
    cache = looped.init_cache(cfg, 1, S + 8, 4, "full", jnp.bfloat16)
    kc = jax.random.normal(key, cache.core_k.shape, jnp.float32).astype(jnp.bfloat16)
    cache = cache.replace(core_k=kc, core_v=kc * 0.5, length=jnp.full((1,), S, jnp.int32))
    del kc
    x = (jax.random.normal(key, (1, 1, D), jnp.float32)).astype(jnp.bfloat16)
    e = x * 0.3
    cos, sin = looped.rope_tables(cfg, cache.length[:, None])
    kv_bytes = 2 * S * cfg.kv_dim * 2

    def attention(x, ap, kc, vc):
        return looped.block_attention(ap, cfg, x, cos, sin, (kc, vc), cache.length)[0]
    record("attention (Wqkv + prefix attention + proj)",
           chain_seconds(attention, (x, lp["attn"], cache.core_k[0, 0], cache.core_v[0, 0]), 0, args.chain,
                         args.repeats), tree_bytes(lp["attn"]) + kv_bytes)

    def prefix_attention(q, kc, vc):
        k_new = q[:, :, :cfg.num_key_value_heads]
        return looped.attend_prefix(q, k_new, k_new, (kc, vc), cache.length, cfg.head_dim ** -0.5)
    q = jax.random.normal(key, (1, 1, cfg.n_heads, cfg.head_dim), jnp.float32).astype(jnp.bfloat16)
    record("prefix attention only (no projections)",
           chain_seconds(prefix_attention, (q, cache.core_k[0, 0], cache.core_v[0, 0]), 0, args.chain, args.repeats),
           kv_bytes)

    def block(x, lp, kc, vc):
        return looped.apply_block(lp, cfg, x, cos, sin, (kc, vc), cache.length)[0]
    record("one block", chain_seconds(block, (x, lp, cache.core_k[0, 0], cache.core_v[0, 0]), 0, args.chain,
                                      args.repeats), tree_bytes(lp) + kv_bytes)

    def core_step(x, core, cache, e):
        return looped.core_step(core, cfg, cache, x, e, 1, cos, sin)[0]
    core_bytes = tree_bytes(core) + cfg.n_layers_in_recurrent_block * kv_bytes
    record("core application (adapter + core block)",
           chain_seconds(core_step, (x, core, cache, e), 0, args.chain, args.repeats), core_bytes)

    os.makedirs(args.out, exist_ok=True)
    hlo = jax.jit(core_step).lower(x, core, cache, e).compile().as_text()
    with open(os.path.join(args.out, f"core_step_hlo{args.tag}.txt"), "w") as f:
        f.write(hlo)
    header = result_header("profile_looped_core")
    md = [f"# Huginn-0125 core application, op by op ({header['device']})", "",
          f"jax {header['jax']} · commit {header['git_commit']} · {header['date']}", "", f"`{header['command']}`", "",
          f"batch 1, one token, bf16 random weights, prefix {S} tokens; roofline at {args.bandwidth_tbs} TB/s; "
          f"SPECDEC_MATVEC={os.environ.get('SPECDEC_MATVEC', 'auto')} (the model's own ops below the matrices), "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}.", "",
          "| op | ms | bytes | TB/s | fraction of roofline |", "|---|---|---|---|---|"]
    md += [f"| {r['op']} | {r['ms']:.4f} | {r['bytes'] / 1e6:.1f} MB | {r['TBps']:.2f} | "
           f"{r['roofline_fraction']:.3f} |" for r in rows]
    write_results(args.out, "profile_looped_core" + args.tag, {**header, "rows": rows}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
