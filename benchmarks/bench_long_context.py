"""Long prompts at the Qwen3.5-9B shape (random bf16 weights, max_position_embeddings 262,144), through the public API.

Per prompt length (1K to 128K tokens), each in its own process (so its peak device memory is its own):
  - AR: `sj.generate` twice (the first compiles; the second is timed): prefill seconds and tok/s, prefill FLOP/s
    (weights and causal attention) against the bf16 peak, decode tok/s against the roofline (weight and KV bytes per
    token over a copy bandwidth measured in the same process), peak device memory against weights + KV cache;
  - speculation at gamma 8 with forced drafts: a registered drafter proposes AR's own continuation, so every draft
    is accepted (tokens per step 9) and the output must equal AR's token for token in bf16 (`exact`);
    spec_eff_gamma8 = speedup / tokens per step, the two runs alternated `--repeats` times.
`--kernel`: the attention kernels alone (no model): the flash prefill kernel against XLA's at each length's last
1024-token chunk (outputs compared, TFLOP/s per tile setting of `--flash-blocks`), and XLA's decode attention
(8 rows over the whole cache) in GB/s.

    BENCH_GIT_COMMIT=$(git rev-parse HEAD) python benchmarks/bench_long_context.py --out benchmarks/results   # GPU
    (a device's copy of the tree may carry a stale .git: BENCH_GIT_COMMIT names the commit that runs)
    python benchmarks/bench_long_context.py --tiny --out /tmp/lc                  # CPU smoke run (a tiny shape)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LENGTHS = (1024, 4096, 16384, 32768, 65536, 131072)
TINY_LENGTHS = (100, 300, 700)
CONTEXT = 262144  # Qwen3.5's trained context (transformers' config default says 32768)
BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12}  # dense bf16 tensor-core FLOP/s (SXM data sheets)
GIB = 1024 ** 3


def make_model(tiny: bool):
    """Random weights, the 9B shape (or a tiny one), made on the host and copied to the device leaf by leaf, so the
    device holds nothing but the weights (its peak memory is then the generation's): each leaf is a stretch of one
    pool of 2^24 normal draws, scaled by 1 / sqrt(fan-in), in bfloat16."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from transformers import Qwen3_5TextConfig
    from specdec_jax.models.qwen35.config import qwen35_config_from_dict
    from specdec_jax.loading import build_tree
    from specdec_jax.results import Model
    from specdec_jax.models.qwen35 import model as qwen35
    from specdec_jax.models.qwen35.mtp_head import leaf_shape
    raw = Qwen3_5TextConfig().to_dict()
    if tiny:
        raw.update(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, layer_types=None)
    raw.update(model_type="qwen3_5_text", max_position_embeddings=CONTEXT)
    cfg = qwen35_config_from_dict(raw)
    specs = qwen35.param_specs(cfg, {"model.embed_tokens.weight"}, "random")
    rng = np.random.default_rng(0)
    pool = rng.standard_normal(1 << 24).astype(np.float32)
    scaled = {}  # one bfloat16 pool per scale: a leaf is then a bfloat16 copy, no float32 temporary

    def make(leaf):
        shape = leaf_shape(leaf)
        scale = shape[-1] ** -0.5 if len(shape) > 1 else 0.1
        if scale not in scaled:
            scaled[scale] = (pool * np.float32(scale)).astype(jnp.bfloat16)
        values = np.roll(scaled[scale], int(rng.integers(pool.size)))  # each leaf starts elsewhere in the pool
        return jax.device_put(np.resize(values, int(np.prod(shape))).reshape(shape))

    return Model(config=cfg, params=build_tree(specs, make), dtype=jnp.dtype(jnp.bfloat16))


def copy_bandwidth(gib: float = 2.0, warm_s: float = 1.0) -> float:
    """Bytes per second of a device copy (read + write) of a `gib` GiB array: after `warm_s` seconds of copies (an
    idle GPU's clocks take that long to rise: probes timed cold in a fresh process read 1.9-2.5 TB/s on an H100
    that copies at 2.7), the best of 5 rounds of 20 copies dispatched back to back."""
    import time
    import jax
    import jax.numpy as jnp
    x = jax.random.normal(jax.random.PRNGKey(1), (int(gib * GIB) // 2,), jnp.bfloat16)
    add = jax.jit(lambda a: a + jnp.bfloat16(1))
    jax.block_until_ready(add(x))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        jax.block_until_ready([add(x) for _ in range(10)])
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready([add(x) for _ in range(20)])
        best = min(best, (time.perf_counter() - t0) / 20)
    return 2 * x.size * 2 / best


def cold_copy_bandwidth(gib: float = 2.0) -> float:
    """The probe before 2026-12-07 (night): median of 10 synced copies after 3, in whatever clock state the GPU is."""
    import jax
    import jax.numpy as jnp
    from specdec_jax.bench.harness import median_time
    x = jax.random.normal(jax.random.PRNGKey(1), (int(gib * GIB) // 2,), jnp.bfloat16)
    add = jax.jit(lambda a: a + jnp.bfloat16(1))
    return 2 * x.size * 2 / median_time(lambda: add(x), 10)


def byte_counts(model, context: int) -> dict:
    """Bytes a decode token reads: every weight but the input embedding (one row of it) and the MTP head; the KV
    cache up to `context`; the GDN states (read and written)."""
    import jax
    cfg = model.config
    params = {k: v for k, v in model.params.items() if k not in ("embed", "mtp", "draft")}
    weights = sum(x.nbytes for x in jax.tree.leaves(params)) + model.params["embed"][0].nbytes
    kv = len(cfg.attention_layers) * 2 * context * cfg.num_key_value_heads * cfg.head_dim * 2
    gdn = len(cfg.linear_layers) * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return {"weights": weights, "kv": kv, "gdn": 2 * gdn}


def prefill_flops(model, length: int) -> float:
    """Multiply-adds x 2 of a prefill: every weight product (the output head at the last position only) and causal
    attention (q.k and p.v over each position's predecessors)."""
    import jax
    cfg = model.config
    params = {k: v for k, v in model.params.items() if k not in ("embed", "mtp", "draft", "lm_head")}
    matmul = sum(x.size for x in jax.tree.leaves(params) if x.ndim >= 2)
    head = model.params.get("lm_head")
    head = head.size if head is not None else model.params["embed"].size
    attention = (4 * cfg.num_attention_heads * cfg.head_dim * length * (length + 1) / 2
                 * len(cfg.attention_layers))
    return 2.0 * matmul * length + 2.0 * head + attention


def peak_flops() -> float | None:
    import jax
    kind = jax.devices()[0].device_kind
    return next((v for k, v in BF16_PEAK.items() if k in kind), None)


def _register_continuation(tokens, length: int) -> None:
    from specdec_jax.bench.harness import register_reference_drafts
    register_reference_drafts("continuation", [tokens], [length])  # every draft AR's own next token: acceptance 1


def run_length(length: int, args) -> dict:
    """One prompt length in this process: AR (the default path) twice; AR at the speculation's decode rows (an exact
    generation equals AR at its own row count), whose output is the drafts; forced-draft speculation; then AR and
    speculation alternated `repeats` times. The continuation is written to `args.continuation` for the peak run."""
    import jax
    import numpy as np
    import specdec_jax as sj
    from specdec_jax.decoding import buckets
    from specdec_jax.decoding.decode_shape import choose_decode_rows
    t_start = time.perf_counter()
    model = make_model(args.tiny)
    prompt = np.random.default_rng(length).integers(0, model.vocab_size, length).astype(np.int32)
    n = args.new_tokens
    ar_first = sj.generate(model, [prompt], n, eos_token_id=False)
    ar_first.state = None
    rows = choose_decode_rows(args.gamma, None, "qwen3_5")
    reference = sj.generate(model, [prompt], n, eos_token_id=False, decode_rows=rows)
    reference.state = None
    with open(args.continuation, "w") as f:
        json.dump([int(t) for t in reference.tokens[0]], f)
    _register_continuation(reference.tokens[0], length)
    spec_first = sj.generate(model, [prompt], n, method="continuation", gamma=args.gamma, eos_token_id=False)
    spec_first.state = None
    runs = {"ar": [], "spec": []}
    for _ in range(args.repeats):
        for name in ("ar", "spec"):
            extra = {} if name == "ar" else {"method": "continuation", "gamma": args.gamma}
            runs[name].append(sj.generate(model, [prompt], n, eos_token_id=False, **extra))
            runs[name][-1].state = None  # one decode state alive at a time
    med = lambda name, key: float(np.median([r.stats[key] for r in runs[name]]))
    ar_decode, spec_decode = med("ar", "decode_seconds"), med("spec", "decode_seconds")
    prefill_s = med("ar", "prefill_seconds")
    tps = float(np.mean([r.stats["tokens_per_step"] for r in runs["spec"]]))
    speedup = ar_decode / spec_decode
    bandwidth = copy_bandwidth(0.25 if args.tiny else 2.0)
    counts = byte_counts(model, length + n // 2)  # the mean context of the decoded tokens
    per_token = counts["weights"] + counts["kv"] + counts["gdn"]
    decode_tok_s = (n - 1) / ar_decode
    flops = prefill_flops(model, length)
    peak = peak_flops()
    cfg = model.config
    cache_len = buckets.cache_length(length + n + 8, 1, cfg.max_position_embeddings)
    kv_cache = len(cfg.attention_layers) * 2 * cache_len * cfg.num_key_value_heads * cfg.head_dim * 2
    return {
        "prompt_len": length, "new_tokens": n, "cache_length": cache_len,
        "prefill_seconds": prefill_s, "prefill_tok_s": length / prefill_s,
        "prefill_tflops": flops / prefill_s / 1e12, "prefill_peak_frac": flops / prefill_s / peak if peak else None,
        "weights_gib": sum(x.nbytes for x in jax.tree.leaves(model.params)) / GIB, "kv_cache_gib": kv_cache / GIB,
        "decode_tok_s": decode_tok_s, "copy_gb_s": bandwidth / 1e9,
        "bytes_per_token": per_token, "roofline_tok_s": bandwidth / per_token,
        "roofline_frac": decode_tok_s / (bandwidth / per_token),
        "spec_decode_rows": rows, "spec_tokens_per_step": tps, "spec_speedup_gamma8": speedup,
        "spec_eff_gamma8": speedup / tps,
        "exact": all(np.array_equal(r.tokens, reference.tokens) for r in runs["spec"] + [spec_first]),
        "ar_repeatable": all(np.array_equal(r.tokens, ar_first.tokens) for r in runs["ar"]),
        "ar_compile_seconds": ar_first.stats["compile_seconds"],
        "spec_compile_seconds": spec_first.stats["compile_seconds"],
        "ar_decode_seconds": [r.stats["decode_seconds"] for r in runs["ar"]],
        "spec_decode_seconds": [r.stats["decode_seconds"] for r in runs["spec"]],
        "prefill_seconds_runs": [r.stats["prefill_seconds"] for r in runs["ar"]],
        "wall_seconds": time.perf_counter() - t_start,
    }


def peak_run(length: int, args) -> dict:
    """Peak device memory of AR and of the speculation in a fresh process whose programs load from the persistent
    compilation cache the run process filled (compiling would count the autotuner's scratch buffers)."""
    import numpy as np
    import specdec_jax as sj
    model = make_model(args.tiny)
    prompt = np.random.default_rng(length).integers(0, model.vocab_size, length).astype(np.int32)
    with open(args.continuation) as f:
        _register_continuation(json.load(f), length)
    ar = sj.generate(model, [prompt], args.new_tokens, eos_token_id=False)
    ar.state = None  # its decode state (a whole KV cache) is not what the speculation's peak should count
    spec = sj.generate(model, [prompt], args.new_tokens, method="continuation", gamma=args.gamma, eos_token_id=False)
    import jax
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    peak = max(int(ar.stats["peak_memory_bytes"] or 0), int(spec.stats["peak_memory_bytes"] or 0)) or None
    return {"peak_gib": peak / GIB if peak else None, "peak_ar_gib": (ar.stats["peak_memory_bytes"] or 0) / GIB,
            "peak_compile_seconds": ar.stats["compile_seconds"] + spec.stats["compile_seconds"],
            "peak_weights_gib": weights / GIB}


def kernel_rows(args) -> list[dict]:
    """The attention kernels alone at each length: the flash prefill kernel (per tile setting) against XLA's on the
    length's last 1024-token chunk, and XLA's 8-row decode attention over the whole cache."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels import attention as A
    from specdec_jax.decoding import buckets
    from specdec_jax.bench.harness import median_time
    nh, nkv, hd = (4, 2, 32) if args.tiny else (16, 4, 256)
    chunk = 256 if args.tiny else 1024
    settings = [dict(zip(("block_m", "block_k", "num_warps", "num_stages"), map(int, s.split(","))))
                for s in args.flash_blocks.split(";")]
    rows = []
    for length in args.lengths:
        cache = buckets.cache_length(length + args.new_tokens + 8, 1, CONTEXT)
        start = jnp.asarray([length - chunk], jnp.int32)
        key = jax.random.split(jax.random.PRNGKey(length), 4)
        q = jax.random.normal(key[0], (1, chunk, nh, hd), jnp.bfloat16)
        k = jax.random.normal(key[1], (1, cache, nkv, hd), jnp.bfloat16)
        v = jax.random.normal(key[2], (1, cache, nkv, hd), jnp.bfloat16)
        flops = 4 * nh * hd * sum(length - chunk + t + 1 for t in range(chunk))
        row = {"prompt_len": length, "cache_length": cache, "chunk": chunk, "flash": []}
        xla = jax.jit(lambda q, k, v, s: A.causal_attention(q, k, v, s, scale=hd ** -0.5,
                                                            implementation="reference"))
        want = None
        if length <= args.xla_limit:
            want = xla(q, k, v, start)
            sec = median_time(lambda: xla(q, k, v, start), 5)
            row["xla_seconds"], row["xla_tflops"] = sec, flops / sec / 1e12
        for blocks in settings:
            fn = jax.jit(lambda q, k, v, s, b=tuple(blocks.items()): A.causal_attention(
                q, k, v, s, scale=hd ** -0.5, implementation="pallas", blocks=dict(b)))
            try:
                got = fn(q, k, v, start)
                sec = median_time(lambda: fn(q, k, v, start), 10)
            except Exception as e:  # noqa: BLE001: a tile setting the compiler refuses is a row, not a crash
                row["flash"].append({**blocks, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            entry = {**blocks, "seconds": sec, "tflops": flops / sec / 1e12}
            if want is not None:
                entry["max_abs_err_vs_xla"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            row["flash"].append(entry)
        if args.cudnn:  # cuDNN's fused attention in two parts (prefix, unmasked; the chunk's own square, causal)
            two_part = "cudnn" if jax.default_backend() == "gpu" else "dpa-xla"  # the CPU smoke run: its XLA twin
            fn = jax.jit(lambda q, k, v, s: A.causal_attention(q, k, v, s, scale=hd ** -0.5,
                                                               implementation=two_part))
            try:
                got = fn(q, k, v, start)
                sec = median_time(lambda: fn(q, k, v, start), 10)
                row["cudnn_seconds"], row["cudnn_tflops"] = sec, flops / sec / 1e12
                if want is not None:
                    row["cudnn_max_abs_err_vs_xla"] = float(jnp.max(jnp.abs(got.astype(jnp.float32)
                                                                           - want.astype(jnp.float32))))
            except Exception as e:  # noqa: BLE001: not available on this device or version: a row, not a crash
                row["cudnn_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        # decode: 8 rows at the end of the prompt over the whole cache (XLA), as AR's exact path runs each step
        mask = A.causal_mask(jnp.asarray([length], jnp.int32), 8, cache)
        dec = jax.jit(lambda q, k, v, m: A.masked_attention(q, k, v, m, hd ** -0.5))
        q8 = q[:, :8]
        sec = median_time(lambda: dec(q8, k, v, mask), 20)
        row["decode_xla_seconds"] = sec
        row["decode_xla_gb_s"] = 2 * cache * nkv * hd * 2 / sec / 1e9
        from pallas_kernels.attention import decode as split_decode
        want8 = dec(q8, k, v, mask)
        read = 2 * (length + 8) * nkv * hd * 2  # the slots a split kernel reads
        for span in (1024, 4096):
            fn = jax.jit(lambda q, k, v, s, span=span: split_decode.split_attention(
                q, k, v, s, scale=hd ** -0.5, span=span, interpret=jax.default_backend() != "gpu"))
            start8 = jnp.asarray([length], jnp.int32)
            try:
                got = fn(q8, k, v, start8)
                sec = median_time(lambda: fn(q8, k, v, start8), 20)
                row[f"decode_split{span}_seconds"] = sec
                row[f"decode_split{span}_gb_s"] = read / sec / 1e9
                row[f"decode_split{span}_max_abs_err"] = float(jnp.max(jnp.abs(
                    got.astype(jnp.float32) - want8.astype(jnp.float32))))
            except Exception as e:  # noqa: BLE001
                row[f"decode_split{span}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def exact_tiny(args) -> dict:
    """The shipped tiny Qwen in bf16 on a long held-out text (the held-out stdlib files joined, cut to its last
    `--exact-len` tokens): AR and real n-gram / MTP speculation, outputs compared token for token."""
    import numpy as np
    import specdec_jax as sj
    from specdec_jax.training import corpus
    model = sj.load(os.path.join(ROOT, "checkpoints", "tiny-qwen35-code"), dtype="bfloat16")
    root = corpus.stdlib_root()
    text = "\n\n".join(corpus.read_texts(root, corpus.split_corpus(root)[1]))
    ids = np.asarray(model.tokenizer(text)["input_ids"][-args.exact_len:], np.int32)
    ar = sj.generate(model, [ids], args.new_tokens, eos_token_id=False)
    rows = [{"method": "ar", "decode_tok_s": ar.stats["decode_tokens_per_second"],
             "prefill_seconds": ar.stats["prefill_seconds"]}]
    for method, gamma in (("ngram", 4), ("ngram", 8), ("mtp", 4)):
        out = sj.generate(model, [ids], args.new_tokens, method=method, gamma=gamma, eos_token_id=False)
        out = sj.generate(model, [ids], args.new_tokens, method=method, gamma=gamma, eos_token_id=False)
        rows.append({"method": method, "gamma": gamma, "equal_to_ar": bool(np.array_equal(out.tokens, ar.tokens)),
                     "first_difference": (int(np.argmax(out.tokens[0] != ar.tokens[0]))
                                          if not np.array_equal(out.tokens, ar.tokens) else None),
                     "tokens_per_step": out.stats["tokens_per_step"],
                     "decode_tok_s": out.stats["decode_tokens_per_second"]})
        print(json.dumps(rows[-1]), flush=True)
    return {"prompt_len": int(len(ids)), "new_tokens": args.new_tokens, "rows": rows}


def markdown(result: dict) -> str:
    h = {k: result.get(k, "?") for k in ("device", "jax", "git_commit", "command")}
    md = [f"# Long prompts, Qwen3.5-9B shape, random bf16 weights ({h['device']}, jax {h['jax']})", "",
          f"commit `{h['git_commit']}`; `{h['command']}`", "",
          "| prompt | prefill s | prefill tok/s | prefill TFLOP/s (frac of peak) | peak GiB, AR (over weights + KV) | "
          "decode tok/s | roofline frac | spec eff gamma 8 (speedup, tokens/step) | bf16 exact |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            md.append(f"| {r['prompt_len']} | failed: {r['error'][:120]} |||||||| ")
            continue
        frac = f" ({r['prefill_peak_frac']:.2f})" if r.get("prefill_peak_frac") else ""
        over = r.get("peak_ar_gib", 0) - r["weights_gib"] - r["kv_cache_gib"]
        peak = f"{r['peak_ar_gib']:.1f} (+{over:.2f})" if r.get("peak_ar_gib") else "–"
        # a row carried from another commit (its own git_commit) may have only an estimate (its note says)
        roof = (f"{r['roofline_frac']:.3f}" if r.get("roofline_frac") is not None
                else f"~{r['roofline_frac_estimate']:.3f} (estimate)")
        prompt = f"{r['prompt_len']}" + (f" (at {r['git_commit'][:7]})" if r.get("git_commit") else "")
        md.append(f"| {prompt} | {r['prefill_seconds']:.3f} | {r['prefill_tok_s']:.0f} | "
                  f"{r['prefill_tflops']:.0f}{frac} | {peak} | {r['decode_tok_s']:.1f} | {roof} | "
                  f"{r['spec_eff_gamma8']:.3f} ({r['spec_speedup_gamma8']:.2f}x, {r['spec_tokens_per_step']:.2f}) | "
                  f"{r['exact']} |")
    md += [""] + [f"- {note}" for note in result.get("notes", [])]
    md += [f"- {r['prompt_len']}: {r['note']}" for r in result["rows"] if r.get("note")]
    return "\n".join(md) + "\n"


def child(cmd: list, env: dict, timeout: float, length: int) -> dict:
    """Run a child process; its RESULT line as a dict, or {"error": ...}."""
    if timeout < 10:
        return {"prompt_len": length, "error": "no time left"}
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"prompt_len": length, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else {"prompt_len": length, "error": run.stderr[-1500:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default=None, help="comma list of prompt lengths (default: 1K..128K; --tiny: small)")
    ap.add_argument("--new-tokens", type=int, default=127, help="tokens per generation (127 = 14 full steps of 9)")
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="timed AR / speculation rounds per length")
    ap.add_argument("--tiny", action="store_true", help="a tiny random shape (CPU smoke run)")
    ap.add_argument("--kernel", action="store_true", help="the attention kernels alone (no model)")
    ap.add_argument("--probe", action="store_true", help="the copy-bandwidth probe: cold (the old probe) then warm")
    ap.add_argument("--exact-len", type=int, default=0,
                    help="instead: the shipped tiny Qwen (bf16) on this many held-out tokens, speculation vs AR")
    ap.add_argument("--flash-blocks", default="64,64,4,2",
                    help="with --kernel: ';'-separated block_m,block_k,num_warps,num_stages settings")
    ap.add_argument("--cudnn", action="store_true", help="with --kernel: the library's cuDNN path too (prefix + square)")
    ap.add_argument("--xla-limit", type=int, default=32768, help="with --kernel: XLA's prefill attention up to here")
    ap.add_argument("--out", default=os.path.join(ROOT, "specdec_bench_out"), help="result folder")
    ap.add_argument("--tag", default="")
    ap.add_argument("--time-budget-s", type=float, default=540)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: one length, JSON on stdout
    ap.add_argument("--peak", action="store_true", help=argparse.SUPPRESS)  # with --one: the peak-memory child
    ap.add_argument("--continuation", default=None, help=argparse.SUPPRESS)  # with --one: the drafts' file
    args = ap.parse_args()
    args.lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths
                    else list(TINY_LENGTHS if args.tiny else LENGTHS))
    from specdec_jax.bench.harness import jsonable, result_header, write_results
    stem = "long_context_" + ("qwen35_tiny" if args.tiny else "qwen35_9b") + (f"_{args.tag}" if args.tag else "")
    if args.one is not None:
        row = (peak_run if args.peak else run_length)(args.one, args)
        row["header"] = result_header(stem, command=os.environ.get("BENCH_COMMAND"))
        print("RESULT " + json.dumps(jsonable(row)), flush=True)
        return
    if args.exact_len:
        res = {**result_header(f"long_context_exact_tiny_{args.exact_len}"), **exact_tiny(args)}
        write_results(args.out, f"long_context_exact_tiny{args.tag}", jsonable(res), json.dumps(jsonable(res), indent=1))
        return
    if args.probe:  # the old probe first, in this fresh process, then the warmed one, then the old one again
        gib = 0.25 if args.tiny else 2.0
        seen = {"cold_gb_s": cold_copy_bandwidth(gib) / 1e9, "warm_gb_s": copy_bandwidth(gib) / 1e9,
                "cold_after_warm_gb_s": cold_copy_bandwidth(gib) / 1e9}
        print("PROBE " + json.dumps(seen), flush=True)
        return
    if args.kernel:
        rows = kernel_rows(args)
        print(json.dumps(jsonable({**result_header("long_context_kernels"), "rows": rows}), indent=1))
        return
    t0 = time.perf_counter()
    # The header comes from a child: this process leaves the accelerator to them (JAX would reserve most of it).
    env = dict(os.environ, BENCH_COMMAND="python " + " ".join(sys.argv))
    result = {"rows": [], "new_tokens": args.new_tokens, "gamma": args.gamma,
              "drafts": "forced: AR's own continuation proposed as drafts (acceptance 1), through the public API"}
    for length in args.lengths:
        left = args.time_budget_s - (time.perf_counter() - t0)
        if left < 20:
            print(f"time budget reached before {length}", flush=True)
            break
        continuation = os.path.join(args.out, f".continuation_{length}.json")
        os.makedirs(args.out, exist_ok=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--one", str(length), "--new-tokens", str(args.new_tokens),
               "--gamma", str(args.gamma), "--repeats", str(args.repeats), "--continuation", continuation]
        cmd += ["--tiny"] if args.tiny else []
        row = child(cmd, env, left, length)
        if "error" not in row:
            left = args.time_budget_s - (time.perf_counter() - t0)
            peak = child(cmd + ["--peak"], env, left, length)
            row.update(peak if "error" not in peak else {"peak_error": peak["error"]})
            if row.get("peak_gib"):
                row["peak_over_weights_kv_gib"] = row["peak_gib"] - row["weights_gib"] - row["kv_cache_gib"]
        if os.path.exists(continuation):
            os.remove(continuation)
        header = row.pop("header", None)
        if header and "git_commit" not in result:  # the header's fields open the result (benchmarks/make_readme.py)
            result = {**header, **result}
        result["rows"] = sorted(result["rows"] + [row], key=lambda r: r["prompt_len"])
        print(json.dumps(row), flush=True)
        write_results(args.out, stem, jsonable(result), markdown(result), echo=False)
    if "git_commit" not in result:
        raise SystemExit("bench_long_context.py: no length finished; see the errors above")
    print(markdown(result))


if __name__ == "__main__":
    main()
