"""Qwen3.5-35B-A3B (MoE) on one GPU: random bf16 weights at the full 40-layer shape, through the public API.

`--part model` (one process, so its peak device memory is its own):
  - roofline: the bytes a decode token reads (every non-expert weight, the output head, 8 experts per layer, one
    embedding row, the KV cache) against a copy bandwidth measured in the same run;
  - AR, the default (exact) path and one row (`exact=False`), a 256-token prompt: tok/s; an 8K-token prompt: prefill
    seconds and the peak device memory against weights + KV cache;
  - a forced-acceptance cost curve: a registered drafter proposes AR's own continuation (each position kept with
    probability p), so tokens per step is set by p and gamma; per row seconds per step, speedup over the default AR,
    and the step's floor: the non-expert bytes plus the union of the experts the step's rows select (from the router
    on AR's continuation, per layer), against the bandwidth;
  - bf16 exactness: every speculation (forced drafts, n-gram, MTP) equals AR at its decode rows token for token.
`--part kernel`: one layer's experts alone, each implementation of `pallas_kernels.experts` (and kernel tiles) at a
decode step (1 valid row of 8, 5 and 9 rows) and a 1024-token prefill chunk: seconds and GB/s of the union's bytes.

    BENCH_GIT_COMMIT=$(git rev-parse HEAD) python benchmarks/bench_moe.py --part model --out benchmarks/results
    python benchmarks/bench_moe.py --tiny --part model --out /tmp/moe          # CPU smoke run (a tiny shape)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_long_context import GIB, copy_bandwidth  # noqa: E402  (one bandwidth probe for every runner)

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, layer_types=None)


def moe_config(tiny: bool, layers: int = 0):
    """transformers' Qwen3_5MoeTextConfig defaults (the 35B-A3B shape: 40 layers, 256 experts, top 8), one MTP layer.
    layers: another depth (its layer types in the same 3 : 1 pattern), for a quicker look at a layer's costs."""
    from transformers import Qwen3_5MoeTextConfig
    from specdec_jax.models.qwen35.config import qwen35_config_from_dict
    raw = Qwen3_5MoeTextConfig().to_dict()
    raw.update(TINY if tiny else {})
    if layers:
        raw.update(num_hidden_layers=layers, layer_types=None)
    raw.update(model_type="qwen3_5_moe_text", mtp_num_hidden_layers=1, max_position_embeddings=32768)
    return qwen35_config_from_dict(raw)


def make_model(cfg):
    """Random bf16 weights drawn on the device leaf by leaf (scale 1 / sqrt(fan-in)), the MTP layer included."""
    import jax
    import jax.numpy as jnp
    from specdec_jax.loading import build_tree
    from specdec_jax.models.qwen35 import model as qwen35
    from specdec_jax.models.qwen35.mtp_head import leaf_shape
    from specdec_jax.results import Model
    specs = qwen35.param_specs(cfg, {"model.embed_tokens.weight", "mtp.layers.0.input_layernorm.weight"}, "random")
    keys = iter(jax.random.split(jax.random.PRNGKey(0), len(specs)))
    draw = jax.jit(lambda key, scale, shape: jax.random.normal(key, shape, jnp.bfloat16) * scale.astype(jnp.bfloat16),
                   static_argnums=2)

    def make(leaf):
        shape = leaf_shape(leaf)
        return draw(next(keys), jnp.float32(shape[-1] ** -0.5 if len(shape) > 1 else 0.1), shape)

    params = qwen35.moe_layout(build_tree(specs, make), cfg)  # the loader's layout (`params.FUSE_MOE_INPUTS`)
    return Model(config=cfg, params=params, dtype=jnp.dtype(jnp.bfloat16))


# The decode-path settings the `variants` stage compares (and `--settings` sets for a whole run): the MoE input
# layout (router, shared gate|up and shared expert gate as one weight: 1, or three: 0), the rows up to which the
# router's top-k comes from compare ranks (0: always a sort), the expert kernel's decode tiles' block_n, and who
# emits the dense GEMMs (`gemm`: triton, XLA's Triton GEMM fusions; cublas, cuBLAS at its heuristic's algorithm,
# no autotuning, so each shape gets one algorithm in every program), and whether decode forwards of up to block_m
# tokens run the expert kernel on shared rows (`shared`: 1, experts.SHARED_ROWS_DECODE) or on the sorted layout (0),
# the decode tiles' pipeline stages (`stages`), and whether decode forwards on the kernel run the shared expert as one
# more tile of its launches (`shared_tile`: 1, mlp.SHARED_EXPERT_TILE, with its `router_gate` input layout) or as
# XLA GEMMs and an add (0).
SETTINGS = ("fuse", "topk_rows", "block_n", "gemm", "shared", "stages", "shared_tile")
CUBLAS_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}
_NOW = dict(fuse=1, topk_rows=64, block_n=32, gemm="triton", shared=1, stages=3, shared_tile=0)
VARIANTS = {"base": _NOW, "shared_tile": dict(_NOW, shared_tile=1)}


def current_settings() -> dict:
    from pallas_kernels import experts
    from specdec_jax.decoding import compiled
    from specdec_jax.models.qwen35 import mlp, params
    options = compiled.GPU_COMPILER_OPTIONS["qwen3_5"]
    return dict(fuse=int(params.FUSE_MOE_INPUTS), topk_rows=mlp.TOPK_COMPARE_MAX_ROWS,
                block_n=experts.DECODE_BLOCKS["block_n"],
                gemm="cublas" if options.get("xla_gpu_enable_triton_gemm") is False else "triton",
                shared=int(experts.SHARED_ROWS_DECODE), stages=experts.DECODE_BLOCKS["num_stages"],
                shared_tile=int(mlp.SHARED_EXPERT_TILE))


def set_settings(settings: dict) -> None:
    """Set the library's switches to `settings` (keys of SETTINGS; those left out keep their values)."""
    from pallas_kernels import experts
    from specdec_jax.decoding import compiled
    from specdec_jax.models.qwen35 import mlp, params
    chosen = {**current_settings(), **settings}
    if chosen["gemm"] not in ("triton", "cublas"):
        raise ValueError(f"gemm must be triton or cublas; got {chosen['gemm']!r}")
    params.FUSE_MOE_INPUTS = bool(int(chosen["fuse"]))
    mlp.TOPK_COMPARE_MAX_ROWS = int(chosen["topk_rows"])
    experts.DECODE_BLOCKS = dict(experts.DECODE_BLOCKS, block_n=int(chosen["block_n"]),
                                 num_stages=int(chosen["stages"]))
    experts.SHARED_ROWS_DECODE = bool(int(chosen["shared"]))
    mlp.SHARED_EXPERT_TILE = bool(int(chosen["shared_tile"]))
    options = {k: v for k, v in compiled.GPU_COMPILER_OPTIONS["qwen3_5"].items() if k not in CUBLAS_OPTIONS}
    compiled.GPU_COMPILER_OPTIONS["qwen3_5"] = {**options, **(CUBLAS_OPTIONS if chosen["gemm"] == "cublas" else {})}


def apply_settings(model, settings: dict):
    """`set_settings`, returning the model in that MoE input layout (the expert weights shared, not copied)."""
    from specdec_jax.models.qwen35 import model as qwen35
    from specdec_jax.results import Model
    set_settings(settings)
    chosen = current_settings()
    params = qwen35.moe_layout(model.params, model.config, fused=bool(int(chosen["fuse"])),
                               shared_tile=bool(int(chosen["shared_tile"])))
    return Model(config=model.config, params=params, dtype=model.dtype)


def byte_counts(model, context: int) -> dict:
    """Non-expert bytes a decode token reads (every target weight but the experts and the MTP head, one embedding
    row), one expert's bytes, the KV cache up to `context`."""
    import jax
    cfg = model.config
    expert_names = ("experts_gate_up", "experts_down")
    nonexpert = 0
    for name, leaf in jax.tree_util.tree_leaves_with_path({k: v for k, v in model.params.items()
                                                           if k not in ("embed", "mtp", "draft")}):
        if not any(getattr(p, "key", None) in expert_names for p in name):
            nonexpert += leaf.nbytes
    nonexpert += model.params["embed"][0].nbytes
    layer = model.params["layers"][0]["mlp"]
    expert = (layer["experts_gate_up"][0].nbytes + layer["experts_down"][0].nbytes)
    kv = len(cfg.attention_layers) * 2 * context * cfg.num_key_value_heads * cfg.head_dim * 2
    return {"nonexpert": nonexpert, "expert": expert, "kv": kv}


def routes(model, ids):
    """Each MoE layer's expert ids for every position of `ids` [T] (one forward, the router's choice): [L, T, k]."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels import experts
    from specdec_jax.models.qwen35 import model as qwen35
    cfg = model.config
    seen, original = [], experts.expert_swiglu

    def recording(x, expert_ids, *args, **kwargs):
        jax.debug.callback(lambda a: seen.append(np.asarray(a)), expert_ids)
        return original(x, expert_ids, *args, **kwargs)

    experts.expert_swiglu = recording
    try:
        state = qwen35.init_state(cfg, 1, len(ids) + 16, model.dtype)
        run = jax.jit(lambda p, s, x: qwen35.forward(p, cfg, s, x, logits_for="last")[0])
        run(model.params, state, jnp.asarray(ids, jnp.int32)[None]).block_until_ready()
        jax.effects_barrier()
    finally:
        experts.expert_swiglu = original
    return np.stack(seen[-len(cfg.layer_types):])


def step_floor(route, start: int, rows: int, counts: dict, bandwidth: float) -> float:
    """Seconds to read a verification step's bytes: non-expert weights + every layer's union of the experts its
    `rows` positions from `start` select."""
    import numpy as np
    union = sum(len(np.unique(layer[start:start + rows])) for layer in route)
    return (counts["nonexpert"] + counts["kv"] + union * counts["expert"]) / bandwidth


# The model part's stages, in the order they run: n-gram exactness, AR at one row, AR on XLA's expert paths (the
# kernel's baseline; an error there is recorded), AR with the experts' layout sorted and compared (its A/B), device
# traces of AR (where a token's time goes, kernel by kernel),
# the forced-acceptance curve, the long prompt, MTP.
STAGES = ("variants", "ngram", "onerow", "xla", "layout", "profile", "curve", "long", "mtp")


def model_part(args, save) -> dict:
    """The model measurements; `save(partial)` after each stage (a time limit keeps what was measured)."""
    import jax
    import numpy as np
    import specdec_jax as sj
    from specdec_jax.bench.harness import register_reference_drafts
    from specdec_jax.decoding import buckets
    from specdec_jax.decoding.decode_shape import choose_decode_rows
    t0 = time.perf_counter()
    cfg = moe_config(args.tiny, args.layers)
    bandwidth = copy_bandwidth(0.25 if args.tiny else 2.0)  # before the weights: its copies need room
    model = make_model(cfg)
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    from pallas_kernels import experts
    out = {"experts_gpu_implementation": experts.GPU_DEFAULT or "xla (gather / ragged)", "settings": current_settings(),
           "num_hidden_layers": cfg.num_hidden_layers, "num_experts": cfg.num_experts,
           "num_experts_per_tok": cfg.num_experts_per_tok, "weights_gib": weights / GIB}
    n = args.new_tokens
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt_len).astype(np.int32)
    left = lambda: args.time_budget_s - (time.perf_counter() - t0)

    def timed(label, on=None, **options):  # first call compiles, the next `repeats` are timed (median decode seconds)
        on = model if on is None else on
        first = sj.generate(on, [prompt], n, eos_token_id=False, **options)
        first.state = None
        runs = []
        for _ in range(args.repeats):
            runs.append(sj.generate(on, [prompt], n, eos_token_id=False, **options))
            runs[-1].state = None
        dec = float(np.median([r.stats["decode_seconds"] for r in runs]))
        print(f"{label}: decode {dec:.4f} s, compile {first.stats['compile_seconds']:.1f} s", flush=True)
        return first, runs, dec

    counts = byte_counts(model, args.prompt_len + n // 2)
    per_token = counts["nonexpert"] + counts["kv"] + cfg.num_hidden_layers * cfg.num_experts_per_tok * counts["expert"]
    out.update(copy_gb_s=bandwidth / 1e9, nonexpert_gib=counts["nonexpert"] / GIB,
               expert_mib=counts["expert"] / 2 ** 20,
               bytes_per_token=per_token, roofline_tok_s=bandwidth / per_token, prompt_len=args.prompt_len,
               new_tokens=n)
    stages = set(args.stages.split(","))
    if "variants" in stages:  # AR (default path) under each of VARIANTS, alternating over rounds, in one process
        chosen, decs, firsts, forced = current_settings(), {}, {}, {}

        def forced_exact(on, ar_first, gamma):  # spec at p 1 against this setting's AR at the same rows
            rows = choose_decode_rows(gamma, None, "qwen3_5")
            assert ar_first.stats.get("decode_rows") == rows, (ar_first.stats.get("decode_rows"), rows)
            register_reference_drafts("forced", [ar_first.tokens[0]], [len(prompt)], p=1.0, seed=gamma)
            spec = sj.generate(on, [prompt], n, method="forced", gamma=gamma, eos_token_id=False)
            again = sj.generate(on, [prompt], n, method="forced", gamma=gamma, eos_token_id=False)
            return {"gamma": gamma, "exact": bool(np.array_equal(spec.tokens, ar_first.tokens)
                                                  and np.array_equal(again.tokens, ar_first.tokens)),
                    "seconds_per_step": again.stats["decode_seconds"] / again.stats["verify_steps"],
                    "tokens_per_step": again.stats["tokens_per_step"]}

        try:
            for r in range(args.rounds):
                for name, settings in VARIANTS.items():
                    if left() < 30:
                        break
                    firsts.setdefault(name, None)
                    on = apply_settings(model, settings)
                    first, _, dec = timed(f"ar {name} (round {r})", on=on)
                    decs.setdefault(name, []).append(dec)
                    if firsts[name] is None:  # round 0: the setting's exactness, forced acceptance at gamma 4
                        firsts[name] = first
                        forced[name] = forced_exact(on, first, 4)
                        print(name, json.dumps(forced[name]), flush=True)
        finally:
            model = apply_settings(model, chosen)
        variants = {name: {**VARIANTS[name], "ar_tok_s": (n - 1) / float(np.median(d)), "rounds": len(d),
                           "compile_seconds": firsts[name].stats["compile_seconds"],
                           "equal_to_first": bool(np.array_equal(firsts[name].tokens,
                                                                 firsts[next(iter(firsts))].tokens)),
                           "forced": forced.get(name)}
                    for name, d in decs.items()}
        out["variants"] = variants
        exact = [v for v in variants if (variants[v]["forced"] or {}).get("exact")]  # only an exact setting can win
        best = max(exact or variants, key=lambda v: variants[v]["ar_tok_s"])
        out["fastest_variant"] = best
        print(json.dumps(variants), flush=True)
        print("fastest:", best, ",".join(f"{k}={VARIANTS[best][k]}" for k in SETTINGS), flush=True)
        save(out)
        if stages == {"variants"}:
            return out
    ar_first, ar_runs, ar_dec = timed("ar default")
    out.update(ar_tok_s=(n - 1) / ar_dec, ar_compile_seconds=ar_first.stats["compile_seconds"],
               ar_decode_rows=ar_first.stats.get("decode_rows"),
               ar_prefill_seconds=ar_runs[-1].stats["prefill_seconds"])
    exact = {}

    def exact_method(method):  # bf16: the method's greedy output against AR at its decode rows
        if left() < 60:
            exact[method] = "time budget"
            return
        first = sj.generate(model, [prompt], n, method=method, gamma=4, eos_token_id=False)
        first.state = None
        spec = sj.generate(model, [prompt], n, method=method, gamma=4, eos_token_id=False)
        ref = sj.generate(model, [prompt], n, eos_token_id=False, decode_rows=spec.stats["decode_rows"])
        exact[method] = {"equal_to_ar": bool(np.array_equal(spec.tokens, ref.tokens)),
                         "tokens_per_step": spec.stats["tokens_per_step"],
                         "seconds_per_step": spec.stats["decode_seconds"] / spec.stats["verify_steps"],
                         "compile_seconds": first.stats["compile_seconds"]}
        print(method, json.dumps(exact[method]), flush=True)
        save({**out, "exact_methods": exact})

    if "ngram" in stages:
        exact_method("ngram")  # first: the expert kernel's exactness in the model, before the timings that follow
    if "onerow" in stages:
        one_first, _, one_dec = timed("ar 1 row", exact=False)
        out.update(ar_1row_tok_s=(n - 1) / one_dec, ar_1row_compile_seconds=one_first.stats["compile_seconds"])
        out["ar_default_over_fastest"] = out["ar_tok_s"] / max(out["ar_tok_s"], out["ar_1row_tok_s"])
    if experts.GPU_DEFAULT is not None and "xla" in stages:  # the same AR on XLA's paths (gather / ragged): what the kernel replaces
        chosen, experts.GPU_DEFAULT = experts.GPU_DEFAULT, None  # a compile switch: `compiled` keys on it
        try:
            xla_first, _, xla_dec = timed("ar xla paths")
            out.update(ar_xla_tok_s=(n - 1) / xla_dec, ar_xla_compile_seconds=xla_first.stats["compile_seconds"],
                       ar_over_xla=xla_dec / ar_dec,
                       ar_xla_equal=bool(np.array_equal(xla_first.tokens, ar_first.tokens)))
        except Exception as exc:  # at 40 layers XLA's ragged prefill asks for a transposed copy of the experts
            out["ar_xla_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print("ar xla paths:", out["ar_xla_error"], flush=True)
        finally:
            experts.GPU_DEFAULT = chosen
        save(out)
    if "layout" in stages:  # the experts' layout sorted (LAYOUT_COMPARE_MAX_COPIES 0) against compared (256) for
        # decode steps, alternating, in one process: the compare layout's A/B
        chosen, decs, firsts = experts.LAYOUT_COMPARE_MAX_COPIES, {0: [], 256: []}, {}
        try:
            for _ in range(2):
                for setting in (0, 256):
                    experts.LAYOUT_COMPARE_MAX_COPIES = setting
                    firsts[setting], _, dec = timed(f"ar layout {'compared' if setting else 'sorted'}")
                    decs[setting].append(dec)
        finally:
            experts.LAYOUT_COMPARE_MAX_COPIES = chosen
        out.update(ar_sorted_layout_tok_s=(n - 1) / float(np.median(decs[0])),
                   ar_compared_layout_tok_s=(n - 1) / float(np.median(decs[256])),
                   layouts_equal_tokens=bool(np.array_equal(firsts[0].tokens, firsts[256].tokens)))
        print(json.dumps({k: out[k] for k in ("ar_sorted_layout_tok_s", "ar_compared_layout_tok_s",
                                              "layouts_equal_tokens")}), flush=True)
        save(out)
    if "profile" in stages:  # one traced AR call per path: device time by kernel family, idle time, per token
        from specdec_jax.bench.profiling import device_kernel_profile, kernel_profile_markdown
        profiles = {}
        for label, options in (("AR default", {}), ("AR 1 row", {"exact": False})):
            if left() < 40:
                break
            profiles[f"{label}, per token"] = device_kernel_profile(
                lambda: sj.generate(model, [prompt], n, eos_token_id=False, **options).tokens, per=n - 1)
        out["profiles"] = profiles
        md = "\n".join(kernel_profile_markdown(profiles, unit="token"))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"moe_profile{args.suffix}.md"), "w") as f:
            f.write(md + "\n")
        print(md, flush=True)
        save(out)
    out["ar_roofline_frac"] = out["ar_tok_s"] / out["roofline_tok_s"]
    out["peak_256_gib"] = (ar_runs[-1].stats.get("peak_memory_bytes") or 0) / GIB
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, list)}), flush=True)
    save(out)

    rows = []
    route = None
    for gamma, p in (args.curve if "curve" in stages else []):
        if left() < 60:
            rows.append({"gamma": gamma, "p": p, "error": "time budget"})
            continue
        dec_rows = choose_decode_rows(gamma, None, "qwen3_5")
        reference = sj.generate(model, [prompt], n, eos_token_id=False, decode_rows=dec_rows)
        reference.state = None
        if route is None:
            route = routes(model, np.concatenate([prompt, reference.tokens[0]]))
        register_reference_drafts("forced", [reference.tokens[0]], [len(prompt)], p=p, seed=gamma)
        first, runs, dec = timed(f"forced gamma {gamma} p {p}", method="forced", gamma=gamma)
        steps = float(np.median([r.stats["verify_steps"] for r in runs]))
        tps = float(np.mean([r.stats["tokens_per_step"] for r in runs]))
        floors = [step_floor(route, len(prompt) + s * (gamma + 1), gamma + 1, counts, bandwidth)
                  for s in range(int(steps))]
        row = {"gamma": gamma, "p": p, "decode_rows": dec_rows, "tokens_per_step": tps, "verify_steps": steps,
               "seconds_per_step": dec / steps, "speedup": ar_dec / dec,
               "floor_seconds_per_step": float(np.mean(floors)),
               "exact": all(np.array_equal(r.tokens, reference.tokens) for r in runs + [first]),
               "compile_seconds": first.stats["compile_seconds"]}
        row["step_over_floor"] = row["seconds_per_step"] / row["floor_seconds_per_step"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        save({**out, "rows": rows})
    out["rows"] = rows
    if left() > 90 and args.long_prompt and "long" in stages:
        long = np.random.default_rng(1).integers(0, cfg.vocab_size, args.long_prompt).astype(np.int32)
        first = sj.generate(model, [long], 32, eos_token_id=False)
        first.state = None
        again = sj.generate(model, [long], 32, eos_token_id=False)
        again.state = None
        cache = buckets.cache_length(args.long_prompt + 32 + 8, 1, cfg.max_position_embeddings)
        kv = len(cfg.attention_layers) * 2 * cache * cfg.num_key_value_heads * cfg.head_dim * 2
        peak = (again.stats.get("peak_memory_bytes") or 0) / GIB
        out["long_prompt"] = {"prompt_len": args.long_prompt, "prefill_seconds": again.stats["prefill_seconds"],
                              "prefill_tok_s": args.long_prompt / again.stats["prefill_seconds"],
                              "decode_tok_s": 31 / again.stats["decode_seconds"], "cache_length": cache,
                              "kv_cache_gib": kv / GIB, "peak_gib": peak,
                              "peak_over_weights_kv_gib": peak - weights / GIB - kv / GIB,
                              "compile_seconds": first.stats["compile_seconds"]}
        print(json.dumps(out["long_prompt"]), flush=True)
        save(out)
    for method in ("mtp",) if "mtp" in stages else ():
        exact_method(method)
    out["exact_methods"] = exact
    out["wall_seconds"] = time.perf_counter() - t0
    return out


def kernel_part(args, save=lambda rows: None) -> list[dict]:
    """One layer's experts alone: each implementation at decode and prefill sizes; random routing (uniform)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels import experts as X
    from specdec_jax.bench.harness import median_time
    cfg = moe_config(args.tiny, args.layers)
    E, D, inter, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    key = jax.random.split(jax.random.PRNGKey(0), 3)
    gate_up = jax.random.normal(key[0], (E, 2 * inter, D), jnp.bfloat16) * D ** -0.5
    down = jax.random.normal(key[1], (E, D, inter), jnp.bfloat16) * inter ** -0.5
    expert_bytes = (2 * inter * D + D * inter) * 2
    bandwidth = copy_bandwidth(0.25 if args.tiny else 2.0)
    settings = [dict(zip(("block_m", "block_n", "block_k", "num_warps", "num_stages"), map(int, s.split(","))))
                for s in args.blocks.split(";")]
    rng = np.random.default_rng(0)
    out = []
    for label, tokens, valid, decode_shape in (("decode 1 of 8", 8, 1, True), ("decode 5", 5, 5, True),
                                               ("decode 9", 9, 9, True), ("prefill 1024", 1024, 1024, False)):
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)]).astype(np.int32)
        ids[valid:] = -1
        union = len(np.unique(ids[ids >= 0]))
        x = jax.random.normal(key[2], (tokens, D), jnp.bfloat16)
        floor = union * expert_bytes / bandwidth
        row = {"case": label, "tokens": tokens, "valid": valid, "union_experts": union, "floor_seconds": floor}
        want = None
        for impl, blocks in ([("gather", None), ("ragged", None)] + [("pallas", b) for b in settings]):
            if impl == "gather" and tokens * k > 4 * E:
                continue
            fn = jax.jit(lambda x, i, g, d, impl=impl, b=tuple((blocks or {}).items()): X.expert_swiglu(
                x, i, g, d, implementation=impl, decode_shape=decode_shape, blocks=dict(b)))
            name = impl if blocks is None else impl + ":" + ",".join(str(v) for v in blocks.values())
            try:
                got = fn(x, jnp.asarray(ids), gate_up, down)
                sec = median_time(lambda: fn(x, jnp.asarray(ids), gate_up, down), 20)
            except Exception as e:  # noqa: BLE001: a setting the compiler refuses is a row, not a crash
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            got = np.asarray(got, np.float32)
            want = got if want is None else want
            row[name] = {"seconds": sec, "over_floor": sec / floor, "max_abs_diff": float(np.max(np.abs(got - want)))}
        out.append(row)
        save(out)
        print(json.dumps(row), flush=True)
    return out


def chosen_blocks(path: str) -> tuple[dict, dict]:
    """(decode tiles, prefill tiles) from a `--part kernel` result: for decode the setting with the least time summed
    over the decode cases; for prefill the fastest on the prefill chunk among the settings with the decode pick's
    block_k (a row's K-step order is the same in both: `pallas_kernels/experts/README.md`)."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    names = lambda row: [k for k, v in row.items() if k.startswith("pallas:") and isinstance(v, dict) and "seconds" in v]
    tiles = lambda name: dict(zip(("block_m", "block_n", "block_k", "num_warps", "num_stages"),
                                  map(int, name.split(":")[1].split(","))))
    decode = [r for r in rows if r["case"].startswith("decode")]
    prefill = [r for r in rows if r["case"].startswith("prefill")]
    common = set.intersection(*(set(names(r)) for r in decode))
    if not common:
        raise SystemExit(f"{path}: no kernel setting ran every decode case")
    best_decode = min(common, key=lambda n: sum(r[n]["seconds"] for r in decode))
    same_k = [n for r in prefill for n in names(r) if tiles(n)["block_k"] == tiles(best_decode)["block_k"]]
    if not same_k:
        raise SystemExit(f"{path}: no prefill setting with block_k {tiles(best_decode)['block_k']}")
    best_prefill = min(same_k, key=lambda n: prefill[0][n]["seconds"])
    return tiles(best_decode), tiles(best_prefill)


def markdown(result: dict) -> str:
    g = lambda k, f="{:.1f}": f.format(result[k]) if isinstance(result.get(k), (int, float)) else "–"
    md = [f"# Qwen3.5-35B-A3B shape (MoE), random bf16 weights ({result.get('device')}, jax {result.get('jax')})", "",
          f"commit `{result.get('git_commit')}`; `{result.get('command')}`", "",
          f"{result.get('num_hidden_layers')} layers, {g('weights_gib')} GiB of weights; copy bandwidth "
          f"{g('copy_gb_s', '{:.0f}')} GB/s; roofline {g('roofline_tok_s')} tok/s; AR (default) {g('ar_tok_s')} tok/s "
          f"({g('ar_roofline_frac', '{:.3f}')} of roofline), one row {g('ar_1row_tok_s')} tok/s; AR on XLA's expert paths "
          f"{g('ar_xla_tok_s')} tok/s (the default {g('ar_over_xla', '{:.2f}')}x that)", "",
          "| gamma | p | tokens/step | s/step | floor s/step | step / floor | speedup | bf16 exact |",
          "|---|---|---|---|---|---|---|---|"]
    for r in result.get("rows", []):
        if "error" in r:
            md.append(f"| {r['gamma']} | {r['p']} | {r['error']} ||||||")
            continue
        md.append(f"| {r['gamma']} | {r['p']} | {r['tokens_per_step']:.2f} | {r['seconds_per_step'] * 1e3:.2f} ms | "
                  f"{r['floor_seconds_per_step'] * 1e3:.2f} ms | {r['step_over_floor']:.3f} | {r['speedup']:.2f}x | "
                  f"{r['exact']} |")
    long = result.get("long_prompt")
    if long:
        where = f" (carried from {long['carried']['commit'][:7]}: {long['carried']['note']})" if long.get("carried") else ""
        md += ["", f"{long['prompt_len']}-token prompt: prefill {long['prefill_tok_s']:.0f} tok/s, decode "
                   f"{long['decode_tok_s']:.1f} tok/s, peak {long['peak_over_weights_kv_gib']:.2f} GiB over weights + "
                   f"KV{where}"]
    for method, r in (result.get("exact_methods") or {}).items():
        if isinstance(r, dict):
            where = f" (carried from {r['carried']['commit'][:7]})" if r.get("carried") else ""
            md.append(f"{method}, gamma 4: equal to AR {r['equal_to_ar']}, {r['seconds_per_step'] * 1e3:.2f} ms a step, "
                      f"{r['tokens_per_step']:.2f} tokens a step{where}")
    if result.get("git_commit_note"):
        md.append(f"commit note: {result['git_commit_note']}")
    md += [""] + [f"- {note}" for note in result.get("notes", [])]
    return "\n".join(md) + "\n"


def merge_halves(paths: list[str]) -> dict:
    """The halves of a run split by --stages (the same commit and device) as one result: the first half's header and
    AR, every half's stages; the commands joined with ' && '."""
    halves = [json.load(open(p)) for p in paths]
    for key in ("git_commit", "device", "num_hidden_layers"):
        values = {str(h.get(key)) for h in halves}
        if len(values) > 1:
            raise SystemExit(f"--merge: the halves differ in {key}: {sorted(values)}")
    merged = dict(halves[0])
    for h in halves[1:]:
        for k, v in h.items():
            if k == "rows":
                merged["rows"] = merged.get("rows", []) + v
            elif k == "exact_methods":
                merged[k] = {**merged.get(k, {}), **v}
            elif k not in merged:
                merged[k] = v
    merged["command"] = " && ".join(h["command"] for h in halves)
    merged["benchmark"] = "moe_qwen35_35b_a3b"
    if "ar_1row_tok_s" in merged:
        merged["ar_default_over_fastest"] = merged["ar_tok_s"] / max(merged["ar_tok_s"], merged["ar_1row_tok_s"])
    return merged


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("model", "kernel"), default="model")
    ap.add_argument("--tiny", action="store_true", help="a tiny random shape (CPU smoke run)")
    ap.add_argument("--experts", default=None, choices=("gather", "ragged", "pallas"),
                    help="with --part model: the expert products' implementation on the GPU (default: the library's)")
    ap.add_argument("--layers", type=int, default=0, help="another depth than the shape's (0: its 40 layers)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--long-prompt", type=int, default=8192, help="AR prefill + decode at this prompt length (0: off)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="with --stages variants: rounds over VARIANTS")
    ap.add_argument("--curve", default="4:1.0,8:1.0", help="gamma:p pairs of the forced-acceptance curve")
    ap.add_argument("--blocks", default="16,32,64,4,4;16,64,64,4,4;16,32,128,4,3;64,64,64,4,3",
                    help="with --part kernel: ';'-separated block_m,block_n,block_k,num_warps,num_stages")
    ap.add_argument("--blocks-from", default=None,
                    help="with --part model: take the kernel's tiles from a --part kernel result (`chosen_blocks`)")
    ap.add_argument("--out", default=os.path.join(ROOT, "specdec_bench_out"))
    ap.add_argument("--time-budget-s", type=float, default=540)
    ap.add_argument("--stages", default=",".join(STAGES),
                    help=f"with --part model: which of {','.join(STAGES)} run (AR at the default path always runs: "
                         f"every other figure is against it); split a run over two device commands with --suffix")
    ap.add_argument("--settings", default=None, help=f"key=value,... of {','.join(SETTINGS)}: the decode path's "
                    "settings for the whole run instead of the library's (`apply_settings`)")
    ap.add_argument("--suffix", default="", help="appended to the result's file name (a run split by --stages)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="instead: join the halves of a run split by --stages into moe_qwen35_35b_a3b.json in --out")
    args = ap.parse_args()
    if args.merge:
        from specdec_jax.bench.harness import write_results
        merged = merge_halves(args.merge)
        write_results(args.out, "moe_qwen35_35b_a3b", merged, markdown(merged))
        return
    if not set(args.stages.split(",")) <= set(STAGES):
        ap.error(f"--stages must name some of {','.join(STAGES)}; got {args.stages!r}")
    args.curve = [(int(g), float(p)) for g, p in (c.split(":") for c in args.curve.split(","))]
    from specdec_jax.bench.harness import jsonable, result_header, write_results
    from pallas_kernels import experts
    if args.experts:
        experts.GPU_DEFAULT = args.experts
    if args.settings:
        settings = dict(kv.split("=") for kv in args.settings.split(","))
        if not set(settings) <= set(SETTINGS):
            ap.error(f"--settings takes keys of {','.join(SETTINGS)}; got {args.settings!r}")
        set_settings(settings)
    if args.blocks_from:
        experts.DECODE_BLOCKS, experts.PREFILL_BLOCKS = chosen_blocks(args.blocks_from)
        print("tiles:", experts.DECODE_BLOCKS, experts.PREFILL_BLOCKS, flush=True)
    stem = ("moe_qwen35_" + ("tiny" if args.tiny else "35b_a3b") + (f"_{args.layers}layers" if args.layers else "")
            + (f"_{args.experts}" if args.experts else "") + args.suffix)
    if args.part == "kernel":
        header = result_header(stem + "_kernels", command="python " + " ".join(sys.argv))
        os.makedirs(args.out, exist_ok=True)

        def save_rows(rows):  # after each case: a time limit keeps what was measured
            with open(os.path.join(args.out, stem + "_kernels.json"), "w") as f:
                json.dump(jsonable({**header, "rows": rows}), f, indent=1)

        print(json.dumps(jsonable({**header, "rows": kernel_part(args, save_rows)}), indent=1))
        return
    header = result_header(stem, command="python " + " ".join(sys.argv))
    save = lambda partial: write_results(args.out, stem, jsonable({**header, **partial}),
                                         markdown({**header, **partial}), echo=False)
    res = {**header, **model_part(args, save)}
    save(res)
    print(markdown(res))


if __name__ == "__main__":
    main()
