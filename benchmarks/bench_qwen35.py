"""Qwen3.5 AR decode on the GPU: this project vs transformers, plus logit agreement and a roofline.

Builds a Qwen3.5 text model with random bf16 weights (default: the transformers default config,
the 9B shape), saves it with save_pretrained, loads it with specdec_jax.load, then in one run:
  1. logits of a 256-token prompt from both (relative error),
  2. greedy decode (prompt 256, 128 new tokens): tok/s of both, token agreement,
  3. a per-component breakdown of one decode step (jitted pieces timed apart),
  4. the bandwidth roofline: weight bytes read per token / measured step time vs 4.3 TB/s.
Writes JSON + Markdown to --out.

    python benchmarks/bench_qwen35.py --out benchmarks/results            # 9B shape (GPU)
    python benchmarks/bench_qwen35.py --tiny --out /tmp/bench             # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specdec_jax.bench.harness import chained_time, result_header, write_results  # noqa: E402

PEAK_BW = 4.3e12  # vendor copy figure (PERFORMANCE.md); measured copy ~4.3 TB/s on this machine


def build_checkpoint(folder: str, tiny: bool, seed: int = 0):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    if tiny:
        cfg = Qwen3_5TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                                linear_num_value_heads=4)
    else:
        cfg = Qwen3_5TextConfig()  # transformers default: the 9B shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.uniform_(-1.0, 1.5)
                elif name.endswith("dt_bias"):
                    p.normal_(0.0, 0.5)
                elif "norm" in name and p.ndim == 1:
                    p.normal_(1.0 if name.endswith("linear_attn.norm.weight") else 0.0, 0.1)
                else:
                    p.normal_(0.0, p.shape[-1] ** -0.5 if p.ndim > 1 else 0.02)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(folder)
    return model, cfg


def hf_logits(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.as_tensor(ids, device=model.device)).logits.float().cpu().numpy()


def hf_greedy_time(model, ids, new_tokens: int):
    import torch
    x = torch.as_tensor(ids, device=model.device)
    with torch.no_grad():
        model.generate(x, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        dt = time.perf_counter() - t0
    return out[:, ids.shape[1]:].cpu().numpy(), dt


def weight_bytes(params) -> tuple[int, int]:
    """(all parameter bytes, bytes read per decoded token: everything but the unused embedding rows)."""
    leaves = jax.tree.leaves(params)
    total = sum(x.size * x.dtype.itemsize for x in leaves)
    embed = params["embed"]
    tied = params.get("lm_head") is None
    per_token = total - (0 if tied else embed.size * embed.dtype.itemsize) + embed.shape[1] * embed.dtype.itemsize
    mtp = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params.get("mtp")))
    return total - mtp, per_token - mtp


def component_times(model, prompt_len: int, chain: int = 64):
    """Time per application of each piece of one decode step (B=1, T=1), measured inside a jitted
    fori_loop of dependent calls (no dispatch overhead), on the model's random weights."""
    from specdec_jax.models import layers as L
    from specdec_jax.models.qwen35 import model as qwen35
    cfg, params = model.config, model.params
    dtype = params["embed"].dtype
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 1, cfg.hidden_size), dtype)
    state = qwen35.init_state(cfg, 1, prompt_len + 8, dtype)
    lin_p = params["layers"][cfg.linear_layers[0]]["mixer"]
    attn_p = params["layers"][cfg.attention_layers[0]]["mixer"]
    mlp_p = params["layers"][0]["mlp"]
    pos = jnp.full((1, 1), prompt_len, jnp.int32)
    mask = L.causal_cache_mask(pos, state.max_len)
    rec = jax.random.normal(jax.random.PRNGKey(2), state.recurrent[:1].shape, jnp.float32) * 0.1  # [1, B, HV, K, V]
    conv, kc, vc = state.conv[0], state.keys[0], state.values[0]
    head = qwen35.lm_head_weight(params)
    nbytes = lambda t: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(t))
    pieces = [
        ("gdn mixer", len(cfg.linear_layers), lin_p,
         lambda x: qwen35.gdn_mixer(lin_p, cfg, x, conv, rec, 0, "auto", False)[0]),
        ("attention mixer", len(cfg.attention_layers), attn_p,
         lambda x: qwen35.attention_mixer(attn_p, cfg, x, kc, vc, pos, mask)[0]),
        ("mlp", cfg.num_hidden_layers, mlp_p, lambda x: qwen35.mlp(mlp_p, cfg, x)),
        ("final norm + lm_head", 1, head, lambda x: jnp.einsum(
            "btd,vd->btv", L.rms_norm(x, params["final_norm"], cfg.rms_norm_eps, zero_centered=True), head,
            preferred_element_type=jnp.float32)),
    ]
    rows = []
    for name, count, weights, fn in pieces:
        t = chained_time(fn, x, chain)
        rows.append({"component": name, "ms": t * 1e3, "count": count, "total_ms": t * 1e3 * count,
                     "weight_bytes": nbytes(weights), "achieved_TBps": nbytes(weights) / t / 1e12})
    return rows


def fp32_check(folder: str, hf_model, ids) -> dict:
    """Both systems in float32 at full matmul precision: isolates implementation error from bf16 rounding."""
    import specdec_jax as sj
    from tests.qwen_helpers import rel_err
    hf_model.float()
    ref = hf_logits(hf_model, ids)
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(sj.forward_logits(sj.load(folder, dtype="float32"), ids))
    return {"logits_rel_err_fp32": rel_err(ours, ref),
            "argmax_agreement_fp32": float(np.mean(ours.argmax(-1) == ref.argmax(-1)))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tiny", action="store_true", help="small config for a CPU smoke run")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed generate() calls per system (median)")
    ap.add_argument("--skip-hf-generate", action="store_true")
    args = ap.parse_args()

    import specdec_jax as sj
    from tests.qwen_helpers import rel_err

    header = result_header("bench_qwen35")
    tmp_dir = tempfile.TemporaryDirectory()
    tmp = tmp_dir.name
    t0 = time.perf_counter()
    hf_model, hf_cfg = build_checkpoint(tmp, args.tiny)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = sj.load(tmp, dtype="bfloat16")
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.vocab_size, size=(1, args.prompt_len))

    ours_logits = np.asarray(sj.forward_logits(model, ids))
    ref_logits = hf_logits(hf_model, ids)
    logit_err = rel_err(ours_logits, ref_logits)
    argmax_agree = float(np.mean(ours_logits.argmax(-1) == ref_logits.argmax(-1)))
    del ours_logits, ref_logits

    runs = []
    for _ in range(args.repeats):
        r = sj.generate(model, ids, args.new_tokens, eos_token_id=False)
        runs.append(r.stats)
    ours_tokens = r.tokens
    decode_tps = float(np.median([s["decode_tokens_per_second"] for s in runs]))
    e2e_tps = float(np.median([s["tokens_per_second"] for s in runs]))
    step_s = 1.0 / decode_tps

    hf = {}
    if not args.skip_hf_generate:
        hf_tokens, hf_s = hf_greedy_time(hf_model, ids, args.new_tokens)
        hf = {"tokens_per_second": args.new_tokens / hf_s, "seconds": hf_s,
              "token_agreement": float(np.mean(hf_tokens[0] == ours_tokens[0])),
              "first_divergence": int(np.argmax(hf_tokens[0] != ours_tokens[0]))
              if np.any(hf_tokens[0] != ours_tokens[0]) else None}
    total_bytes, per_token_bytes = weight_bytes(model.params)
    comps = component_times(model, args.prompt_len)
    fp32 = fp32_check(tmp, hf_model, ids[:, :64])
    del hf_model
    tmp_dir.cleanup()
    result = {
        **header,
        "config": {"hidden_size": model.config.hidden_size, "layers": model.config.num_hidden_layers,
                   "vocab": model.vocab_size, "params_bytes_bf16": total_bytes},
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "build_seconds": build_s, "load_seconds": load_s,
        "logits_rel_err_vs_transformers_bf16": logit_err, "argmax_agreement_prompt": argmax_agree,
        "fp32_check_prompt64": fp32,
        "ours": {"decode_tokens_per_second": decode_tps, "end_to_end_tokens_per_second": e2e_tps,
                 "prefill_seconds": float(np.median([s["prefill_seconds"] for s in runs])),
                 "compile_seconds": runs[0]["compile_seconds"], "decode_step_ms": step_s * 1e3},
        "transformers": hf,
        "roofline": {
            "peak_TBps": PEAK_BW / 1e12,
            "bytes_per_token_all_weights": total_bytes,
            "bytes_per_token_read": per_token_bytes,
            "roofline_tokens_per_second_all_weights": PEAK_BW / total_bytes,
            "fraction_of_roofline_all_weights": decode_tps * total_bytes / PEAK_BW,
            "fraction_of_roofline_bytes_read": decode_tps * per_token_bytes / PEAK_BW,
            "achieved_TBps": decode_tps * per_token_bytes / 1e12,
        },
        "components": comps,
    }
    if hf:
        result["speedup_vs_transformers"] = decode_tps / hf["tokens_per_second"]
    md = [f"# Qwen3.5 AR decode ({'tiny' if args.tiny else '9B shape'}, random bf16 weights, batch 1)", "",
          f"{header['device']} · jax {header['jax']} · commit {header['git_commit']}", "",
          f"`{header['command']}`", "",
          "| system | decode tok/s | vs transformers | fraction of 4.3 TB/s roofline |", "|---|---|---|---|",
          f"| specdec_jax (lax.while_loop) | {decode_tps:.1f} | "
          f"{result.get('speedup_vs_transformers', float('nan')):.2f}× | "
          f"{result['roofline']['fraction_of_roofline_all_weights']:.1%} (all weights) / "
          f"{result['roofline']['fraction_of_roofline_bytes_read']:.1%} (bytes read) |"]
    if hf:
        md.append(f"| transformers eager generate | {hf['tokens_per_second']:.1f} | 1.00× | "
                  f"{hf['tokens_per_second'] * total_bytes / PEAK_BW:.1%} |")
    md += ["", f"Logits vs transformers (bf16, prompt {args.prompt_len}): relative error {logit_err:.2e}, "
               f"argmax agreement {argmax_agree:.1%}. Greedy tokens equal to transformers: "
               f"{hf.get('token_agreement', float('nan')):.1%} (first divergence: {hf.get('first_divergence')}).",
           f"Float32, both at full matmul precision (prompt 64): relative error {fp32['logits_rel_err_fp32']:.2e}, "
           f"argmax agreement {fp32['argmax_agreement_fp32']:.1%}.",
           "", "One decode step, pieces timed inside a jitted fori_loop of 64 dependent calls:", "",
           "| component | ms each | × count | total ms | weight GB | achieved TB/s |", "|---|---|---|---|---|---|"]
    for c in comps:
        md.append(f"| {c['component']} | {c['ms']:.3f} | {c['count']} | {c['total_ms']:.2f} | "
                  f"{c['weight_bytes'] / 1e9:.3f} | {c['achieved_TBps']:.2f} |")
    md.append(f"| **sum of pieces** | | | {sum(c['total_ms'] for c in comps):.2f} | | |")
    md.append(f"| **measured decode step** | | | {step_s * 1e3:.2f} | {per_token_bytes / 1e9:.2f} | "
              f"{result['roofline']['achieved_TBps']:.2f} |")
    write_results(args.out, "qwen35_tiny_ar" if args.tiny else "qwen35_9b_ar", result, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
