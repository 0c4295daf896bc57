"""The multi-device half of tests/test_tensor_parallel.py, run in its own process: JAX must start with
XLA_FLAGS=--xla_force_host_platform_device_count=4 (four CPU devices), which the pytest process cannot set for
itself once JAX is running. One process for every case, so JAX starts and each program compiles once.

Prints one JSON object (the last line of stdout): the single-device (AR) and mesh outputs, where parameters and
states live, and the errors of the refused meshes. The parent test asserts on it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import specdec_jax as sj  # noqa: E402

CHECKPOINT = os.path.join(ROOT, "checkpoints", "tiny-qwen35-code")
LOOPED_CHECKPOINT = os.path.join(ROOT, "checkpoints", "tiny-huginn-code")
PROMPT = np.array([[5, 17, 300, 42, 8, 99, 1000, 7]], np.int32)
NEW_TOKENS = 14
# Per mesh size, the methods run: AR on 2 devices (KV heads split), MTP on 4 (KV heads copied, the harder layout).
# MTP's generation runs the prefill, the decode-row forwards AR's steps run (the exact path: both at 8 rows) inside the
# chain loop every drafter shares (n-gram's included), the rollback and the MTP head's own sharded forward, so AR and
# n-gram on 4 devices added no program that MTP and 2-device AR do not run between them (each cost ~6 s on 2 cores).
METHODS = {2: ("ar",), 4: ("mtp",)}
MESH_SIZES = tuple(METHODS)


def mesh_of(n: int, names=("tp",)):
    return jax.make_mesh((n,), names, devices=jax.devices()[:n])


def generate(model, method: str):
    return sj.generate(model, PROMPT, NEW_TOKENS, method=method, eos_token_id=False,
                       **({"gamma": 4} if method != "ar" else {}))


def placement(x) -> dict:
    """Where an array lives: its partition, the shape each device holds, whether every device holds all of it."""
    return {"spec": str(x.sharding.spec), "shape": list(x.shape),
            "shard_shapes": [list(s.data.shape) for s in x.addressable_shards],
            "replicated": bool(x.sharding.is_fully_replicated)}


def shards_equal(x, a: int, b: int) -> bool:
    """Whether devices a and b hold the same values (copies of one head)."""
    shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
    return bool(np.array_equal(np.asarray(shards[a].data), np.asarray(shards[b].data)))


def refusal(fn) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001: the parent checks the type and the message
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": ""}


def refused_meshes() -> dict:
    """A head count that neither divides nor is divided by the mesh (a folder with only config.json: the error
    must come before any tensor is read), a mesh without "tp", and a looped model."""
    with open(os.path.join(CHECKPOINT, "config.json")) as f:
        raw = json.load(f)
    raw.update(num_attention_heads=6, num_key_value_heads=3, linear_num_key_heads=3, linear_num_value_heads=6)
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(raw, f)
    return {"bad_heads": refusal(lambda: sj.load(folder, dtype="float32", mesh=mesh_of(2))),
            "no_tp_axis": refusal(lambda: sj.load(CHECKPOINT, dtype="float32", mesh=mesh_of(2, ("data",)))),
            "looped": refusal(lambda: sj.load(LOOPED_CHECKPOINT, dtype="float32", mesh=mesh_of(2)))}


def random_moe_model(mesh=None):
    """A random MoE model: 8 experts (top 2) and a shared expert, 2 GDN key heads (copied on 4 devices)."""
    from specdec_jax.models.qwen35.config import qwen35_config_from_dict
    from specdec_jax.loading import build_tree
    from specdec_jax.results import Model
    from specdec_jax.models.qwen35 import mtp_head as mtp, model as qwen35
    cfg = qwen35_config_from_dict(dict(
        model_type="qwen3_5_moe_text", vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24))
    specs = qwen35.param_specs(cfg, {"model.embed_tokens.weight"}, "random")
    rng = np.random.default_rng(0)  # numpy: no per-shape compile
    params = build_tree(specs, lambda leaf: (rng.standard_normal(mtp.leaf_shape(leaf)) * 0.3).astype(np.float32))
    if mesh is None:
        return Model(config=cfg, params=jax.tree.map(jax.numpy.asarray, params), dtype=np.float32)
    cfg = qwen35.with_mesh(cfg, mesh, "random_moe_model")
    params = qwen35.shard_params(params, cfg)
    return Model(config=cfg, params=params, dtype=np.float32)


def moe_logits() -> dict:
    """Logits of 4 tokens of the random MoE model on one device and on 4 (4 tokens x top-2 <= 8 experts: the
    decode path, which reads only the selected experts' weights)."""
    single, split = random_moe_model(), random_moe_model(mesh_of(4))
    ids = np.array([[3, 50, 7, 91]], np.int32)
    a, b = np.asarray(sj.forward_logits(single, ids)), np.asarray(sj.forward_logits(split, ids))
    mlp = split.params["layers"][0]["mlp"]
    return {"experts": placement(mlp["experts_gate_up"]), "shared": placement(mlp["shared_gate_up_proj"]),
            "rel": float(np.linalg.norm(a - b) / np.linalg.norm(a)),
            "argmax_equal": bool((a.argmax(-1) == b.argmax(-1)).all())}


def main() -> None:
    out = {"devices": len(jax.devices()), "refused": refused_meshes(), "moe": moe_logits()}
    # One device: AR only. Greedy n-gram and MTP equal AR's tokens there (the exact path: test_exact.py,
    # test_drafters.py), so AR's are the reference for every method on the meshes; running them on one device too
    # would compile 4 more programs (~10 s on 2 CPU cores).
    out["single"] = {"ar": generate(sj.load(CHECKPOINT, dtype="float32"), "ar").tokens.tolist()}
    for n in MESH_SIZES:
        model = sj.load(CHECKPOINT, dtype="float32", mesh=mesh_of(n))
        layers = model.params["layers"]
        attn, gdn = layers[model.config.attention_layers[0]], layers[model.config.linear_layers[0]]
        runs = {m: generate(model, m) for m in METHODS[n]}
        state = runs[METHODS[n][0]].state.model  # the decode state the generation left (the same compiled programs)
        out[str(n)] = {
            "tokens": {m: r.tokens.tolist() for m, r in runs.items()},
            "params": {"embed": placement(model.params["embed"]), "qkv_proj": placement(attn["mixer"]["qkv_proj"]),
                       "o_proj": placement(attn["mixer"]["o_proj"]), "in_proj": placement(gdn["mixer"]["in_proj"]),
                       "gate_up_proj": placement(gdn["mlp"]["gate_up_proj"]),
                       "down_proj": placement(gdn["mlp"]["down_proj"]),
                       "mtp_qkv_proj": placement(model.params["mtp"]["layers"][0]["mixer"]["qkv_proj"]),
                       "final_norm": placement(model.params["final_norm"])},
            "state": {"keys": placement(state.keys[0]), "conv": placement(state.conv),
                      "recurrent": placement(state.recurrent), "length": placement(state.length)},
            # 4 devices, 2 KV heads: devices 0 and 1 hold copies of head 0, devices 2 and 3 of head 1.
            "kv_copies": [shards_equal(state.keys[0], 0, 1), shards_equal(state.keys[0], 2, 3),
                          shards_equal(state.keys[0], 0, 2)] if n == 4 else None,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
