"""Looped-model AR decode on the GPU at the Huginn-0125 shape, with a bandwidth roofline.

Builds Huginn-0125's shape (n_embd 5280, 55 heads of 96, prelude 2 / core 4 / coda 2, vocab 65536,
intermediate 17920, tied head) with random bf16 weights made directly on the device (no file),
then measures in one process:
  1. AR decode tok/s at r = 32 (prompt 256, 64 new tokens): one jitted prefill, one on-device
     lax.while_loop decode (compile excluded, median over --repeats runs after a warm-up run);
  2. time of one core-block application (adapter + 4 core layers) on a [1, 1, D] input reading a
     256-token depth-indexed cache: median of single jitted calls, and the per-application time
     inside one jitted fori_loop of chained applications (no dispatch overhead);
  3. the roofline: weight bytes read per token = (adapter + core block) x r + prelude + coda +
     ln_f + head, over --bandwidth-tbs (4.3 TB/s, H200), and the same with the KV bytes read.
Writes JSON + Markdown to --out (device, jax/jaxlib versions, git commit, exact command).

    python benchmarks/bench_looped.py --out benchmarks/results        # Huginn-0125 shape (GPU)
    python benchmarks/bench_looped.py --tiny --out /tmp/bench          # CPU smoke run
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from specdec_jax.bench.harness import median_time, result_header, write_results  # noqa: E402
from specdec_jax.results import Model  # noqa: E402
from specdec_jax.decoding import looped_ar  # noqa: E402
from specdec_jax.models.looped import model as looped  # noqa: E402


def bench_config(tiny: bool) -> looped.LoopedConfig:
    """Huginn-0125 (MODELS.md) or a tiny model of the same structure for CPU smoke runs."""
    if tiny:
        D, H, hd, P, Lc, C, V, F = 64, 4, 16, 1, 2, 1, 512, 128
    else:
        D, H, hd, P, Lc, C, V, F = 5280, 55, 96, 2, 4, 2, 65536, 17920
    return looped.LoopedConfig(
        vocab_size=V, n_embd=D, n_heads=H, num_key_value_heads=H, head_dim=hd, n_layers_in_prelude=P,
        n_layers_in_recurrent_block=Lc, n_layers_in_coda=C, intermediate_size=F, norm_eps=1e-6, qk_bias=True,
        rope_base=50_000.0, tie_embeddings=True, embed_scale=math.sqrt(D), mean_recurrence=32,
        init_std=math.sqrt(2 / (5 * D)), variant="huginn")


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def roofline(params: dict, cfg: looped.LoopedConfig, num_steps: int, max_len: int, bw: float) -> dict:
    """Bytes each decoded token must read, and the time that takes at bandwidth `bw` (bytes/s).

    The adapter is applied at every recurrence, so it counts with the core block. The embedding
    lookup reads one row; a tied head reads all of wte. KV: every slot a token attends to is read
    over the full preallocated length (the attention masks, it does not skip).
    """
    core_app = tree_bytes(params["adapter"]) + tree_bytes(params["core_block"])
    head = params["wte"] if cfg.tie_embeddings else params["lm_head"]
    once = (tree_bytes(params.get("prelude", [])) + tree_bytes(params.get("coda", [])) + tree_bytes(params["ln_f"])
            + tree_bytes(head) + cfg.n_embd * params["wte"].dtype.itemsize)
    weights = core_app * num_steps + once
    slots = cfg.n_layers_in_prelude + num_steps * cfg.n_layers_in_recurrent_block + cfg.n_layers_in_coda
    kv = 2 * slots * max_len * cfg.kv_dim * params["wte"].dtype.itemsize
    return {"core_application_bytes": core_app, "once_per_token_bytes": once, "weight_bytes_per_token": weights,
            "kv_bytes_per_token": kv, "bandwidth_bytes_per_s": bw,
            "core_application_roofline_s": core_app / bw,
            "weights_roofline_tok_s": bw / weights, "weights_kv_roofline_tok_s": bw / (weights + kv)}


def time_core_block(params: dict, cfg: looped.LoopedConfig, cache: looped.LoopedCache, repeats: int,
                    chain: int, key: jax.Array) -> dict:
    """Median seconds of one core-block application on [1, 1, D] with the prefilled cache."""
    core = {"adapter": params["adapter"], "core_block": params["core_block"]}
    kx, ke = jax.random.split(key)
    dtype = params["adapter"].dtype
    x = jax.random.normal(kx, (cache.length.shape[0], 1, cfg.n_embd), jnp.float32).astype(dtype)
    e = (jax.random.normal(ke, x.shape, jnp.float32) * cfg.embed_scale * 0.02).astype(dtype)
    cos, sin = looped.rope_tables(cfg, cache.length[:, None])

    @jax.jit
    def one(core, cache, x, e, cos, sin):
        return looped.core_step(core, cfg, cache, x, e, 0, cos, sin)[0]

    @jax.jit
    def chained(core, cache, x, e, cos, sin):
        # Each application consumes the previous output, so none can be hoisted or merged.
        def body(s, x):
            return looped.core_step(core, cfg, cache, x, e, s % cache.step_slots, cos, sin)[0]
        return lax.fori_loop(0, chain, body, x)

    single = median_time(lambda: one(core, cache, x, e, cos, sin), repeats)
    looped_s = median_time(lambda: chained(core, cache, x, e, cos, sin), max(3, repeats // 20)) / chain
    return {"single_call_s": single, "in_loop_s": looped_s}


def markdown(result: dict) -> str:
    r, roof, ar, core = result["num_steps"], result["roofline"], result["ar"], result["core_block"]
    tok = ar["decode_tokens_per_second"]
    lines = [
        f"# Looped AR decode, {result['shape']} shape, r = {r}",
        "",
        f"device {result['device']} · jax {result['jax']} / jaxlib {result['jaxlib']} · commit "
        f"`{result['git_commit']}` · {result['date']}",
        "",
        f"`{result['command']}`",
        "",
        f"prompt {result['prompt_len']}, {result['new_tokens']} new tokens, batch {result['batch']}, "
        f"bf16 random weights (N(0, 0.02)), zero initial state, full depth-indexed cache "
        f"({result['cache_bytes'] / 2**20:.1f} MiB), median of {result['repeats']} runs",
        "",
        "| metric | measured | roofline | fraction of roofline |",
        "|---|---|---|---|",
        f"| AR decode tok/s (weights only) | {tok:.2f} | {roof['weights_roofline_tok_s']:.2f} | "
        f"{tok / roof['weights_roofline_tok_s']:.3f} |",
        f"| AR decode tok/s (weights + KV) | {tok:.2f} | {roof['weights_kv_roofline_tok_s']:.2f} | "
        f"{tok / roof['weights_kv_roofline_tok_s']:.3f} |",
        f"| core-block application, single jitted call (ms) | {core['single_call_s'] * 1e3:.3f} | "
        f"{roof['core_application_roofline_s'] * 1e3:.3f} | "
        f"{roof['core_application_roofline_s'] / core['single_call_s']:.3f} |",
        f"| core-block application, inside fori_loop (ms) | {core['in_loop_s'] * 1e3:.3f} | "
        f"{roof['core_application_roofline_s'] * 1e3:.3f} | "
        f"{roof['core_application_roofline_s'] / core['in_loop_s']:.3f} |",
        f"| prefill (s) | {ar['prefill_seconds']:.4f} | | |",
        "",
        f"Bytes per token: core application (adapter + core block) {roof['core_application_bytes'] / 1e9:.3f} GB "
        f"x {r} + once-per-token {roof['once_per_token_bytes'] / 1e9:.3f} GB = "
        f"{roof['weight_bytes_per_token'] / 1e9:.2f} GB weights, + {roof['kv_bytes_per_token'] / 1e9:.3f} GB KV; "
        f"bandwidth {roof['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s. Fraction of roofline: measured / roofline for "
        f"tok/s, roofline / measured for times (1.0 = at the bandwidth bound).",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model and sizes (CPU smoke run)")
    ap.add_argument("--num-steps", type=int, default=None, help="recurrence depth r (default 32, tiny 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 256, tiny 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens (default 64, tiny 8)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="timed AR runs (after one warm-up run)")
    ap.add_argument("--core-repeats", type=int, default=200, help="timed single core-block calls")
    ap.add_argument("--chain", type=int, default=64, help="core-block applications per fori_loop timing")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.3, help="memory bandwidth for the roofline (TB/s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    num_steps = args.num_steps or (4 if args.tiny else 32)
    prompt_len = args.prompt_len or (16 if args.tiny else 256)
    new_tokens = args.new_tokens or (8 if args.tiny else 64)
    core_repeats = min(args.core_repeats, 20) if args.tiny else args.core_repeats

    cfg = bench_config(args.tiny)
    key_params, key_prompt, key_core = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    t0 = time.perf_counter()
    params = looped.init_random_params(cfg, key_params, jnp.bfloat16, std=0.02)
    jax.block_until_ready(params)
    print(f"random bf16 params: {tree_bytes(params) / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
    model = Model(config=cfg, params=params, dtype=jnp.bfloat16)
    prompt = np.asarray(jax.random.randint(key_prompt, (args.batch, prompt_len), 0, cfg.vocab_size))
    max_len = prompt_len + new_tokens

    runs = [looped_ar.generate(model, prompt, new_tokens, num_steps, max_len=max_len) for _ in range(1 + args.repeats)]
    compile_s = runs[0].stats["compile_seconds"]
    timed = [run.stats for run in runs[1:]]
    ar = {k: float(np.median([s[k] for s in timed]))
          for k in ("decode_tokens_per_second", "tokens_per_second", "prefill_seconds", "decode_seconds")}
    ar.update(compile_seconds=compile_s, new_tokens_per_run=timed[0]["new_tokens"],
              decode_tokens_per_second_all=[s["decode_tokens_per_second"] for s in timed])
    print(f"AR decode: {ar['decode_tokens_per_second']:.2f} tok/s (median of {args.repeats})", flush=True)

    cache = looped.init_cache(cfg, args.batch, max_len, num_steps, "full", jnp.bfloat16)
    _, cache, _ = looped.forward_jit(params, cfg, cache, jnp.asarray(prompt), num_steps, logits_for="last")
    core = time_core_block(params, cfg, cache, core_repeats, args.chain, key_core)
    print(f"core block: {core['single_call_s'] * 1e3:.3f} ms per call, {core['in_loop_s'] * 1e3:.3f} ms in a loop",
          flush=True)

    result = result_header("looped_ar_decode")
    result.update(shape="tiny" if args.tiny else "Huginn-0125", num_steps=num_steps, prompt_len=prompt_len,
                  new_tokens=new_tokens, batch=args.batch, repeats=args.repeats, config=str(cfg),
                  cache_bytes=looped.cache_bytes(cfg, args.batch, max_len, num_steps, "full", jnp.bfloat16),
                  ar=ar, core_block=core,
                  roofline=roofline(params, cfg, num_steps, max_len, args.bandwidth_tbs * 1e12))
    stem = f"looped_ar_{'tiny' if args.tiny else 'huginn0125'}_r{num_steps}_{time.strftime('%Y%m%d_%H%M%S')}"
    write_results(args.out, stem, result, markdown(result))
    return result


if __name__ == "__main__":
    main()
