"""Tiny random Qwen3.5 checkpoints written by transformers' own save_pretrained (the reference)."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def tiny_text_config(*, ratio=2, moe=False, tied=False, layers=4, vocab=97, seed=0, **overrides):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig
    kw = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=2 * ratio, tie_word_embeddings=tied,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
              eos_token_id=None)
    if moe:
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
        kw.update(overrides)
        return Qwen3_5MoeTextConfig(**kw)
    kw.update(intermediate_size=48)
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


def randomize_(model, seed: int) -> None:
    """Spread every weight so that each one matters (HF init leaves norms at identity, A_log narrow)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.5, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name and p.ndim == 1:
                base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if p.ndim > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(fan_in))


def build_reference(cfg, seed: int = 0):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    torch.manual_seed(seed)
    cls = Qwen3_5MoeForCausalLM if "moe" in cfg.model_type else Qwen3_5ForCausalLM
    model = cls(cfg).eval()
    randomize_(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def save_reference(model, folder: str, *, multimodal: bool = False, mtp_layers: int = 0, seed: int = 0) -> str:
    """save_pretrained, optionally rewritten to the multimodal layout (nested text_config,
    model.language_model.* keys, a model.visual.* tensor to ignore) and with random mtp.* tensors."""
    model.save_pretrained(folder)
    if not (multimodal or mtp_layers):
        return folder
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    with open(os.path.join(folder, "config.json")) as f:
        text_cfg = json.load(f)
    if mtp_layers:
        tensors.update(random_mtp_tensors(model, mtp_layers, seed))
        text_cfg["mtp_num_hidden_layers"] = mtp_layers
    if multimodal:
        tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                   for k, v in tensors.items()}
        tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
        moe = "moe" in text_cfg["model_type"]
        text_cfg["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
        top = {"model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text_cfg,
               "tie_word_embeddings": text_cfg.get("tie_word_embeddings", False),
               "architectures": ["Qwen3_5ForConditionalGeneration"]}
        text_cfg = top
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(text_cfg, f, indent=1)
    return folder


def random_mtp_tensors(model, n_layers: int, seed: int) -> dict:
    """MTP head tensors shaped like the target's full-attention layer (vLLM's structure)."""
    g = torch.Generator().manual_seed(seed + 1)
    sd = model.state_dict()
    attn_layer = next(i for i, t in enumerate(model.config.layer_types) if t == "full_attention")
    D = model.config.hidden_size
    out = {"mtp.fc.weight": torch.randn(D, 2 * D, generator=g) / np.sqrt(2 * D)}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = 0.1 * torch.randn(D, generator=g)
    prefix = f"model.layers.{attn_layer}."
    for i in range(n_layers):
        for k, v in sd.items():
            if k.startswith(prefix):
                out[f"mtp.layers.{i}." + k[len(prefix):]] = v.clone() + 0.01 * torch.randn(v.shape, generator=g)
    return out


def reference_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def reference_greedy(model, ids: np.ndarray, n: int) -> np.ndarray:
    with torch.no_grad():
        out = model.generate(torch.as_tensor(ids, dtype=torch.long), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:].numpy()


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def small_vocab_model(folder: str, *, mtp_layers: int = 0, mtp_seed: int = 0):
    """The 2-layer (GDN, attention), 6-token model of the sampling tests, saved to `folder` and loaded in
    float32: a vocabulary small enough that the joint law of 3 tokens has 216 cells."""
    import specdec_jax as sj
    ref = build_reference(tiny_text_config(ratio=1, vocab=6, layers=2,
                                           layer_types=["linear_attention", "full_attention"]), seed=5)
    save_reference(ref, folder, mtp_layers=mtp_layers, seed=mtp_seed)
    return sj.load(folder, dtype="float32")
