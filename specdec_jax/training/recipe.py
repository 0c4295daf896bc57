"""What is trained: the run's options (`TrainOptions`), the model configs, the fp32 parameter inits,
the losses (Qwen3.5 next-token + MTP; Huginn with a sampled recurrence and truncated backprop) and
the recurrence draw (`sample_recurrence`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from ..models.qwen35.config import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35Config
from ..loading import TensorSource, build_tree, flatten_tree
from ..models.looped import model as looped
from ..models.qwen35 import mtp_head as mtp, model as qwen35

ARCHS = ("qwen35", "huginn")
DEFAULT_OUT = {"qwen35": "checkpoints/tiny-qwen35-code", "huginn": "checkpoints/tiny-huginn-code"}


@dataclasses.dataclass
class TrainOptions:
    """Everything a run depends on (recorded in train_log.json)."""

    arch: str = "qwen35"
    out: str = "checkpoints/tiny-qwen35-code"
    steps: int = 4000
    batch: int = 64
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    schedule: str = "time"  # "time": cosine progress = max(step fraction, time fraction); "steps"
    time_budget_s: float = 480.0  # training-loop seconds, compilation excluded
    log_every: int = 50
    eval_every: int = 500
    eval_max_tokens: int = 0  # 0 = the whole held-out split
    keep_best: bool = False  # save the parameters of the best periodic held-out evaluation (early stopping)
    seed: int = 0
    compute_dtype: str = "bfloat16"
    # model sizes (shared)
    hidden: int = 256
    heads: int = 4
    intermediate: int = 768
    # qwen35
    layers: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    linear_key_heads: int = 4
    linear_value_heads: int = 8
    linear_head_dim: int = 32
    rope_theta: float = 10_000.0
    mtp_weight: float = 0.3
    mtp_distill: float = 0.0  # share of the MTP loss taken against the model's own next-next distribution
    # huginn
    prelude: int = 2
    core: int = 2
    coda: int = 2
    mean_recurrence: int = 16
    min_recurrence: int = 1  # huginn: draws below it are raised to it (1 = the official draw, unchanged)
    backprop_depth: int = 4
    init_state_scale: float = 0.0  # huginn: 0 = zero initial state in training; > 0: the official random draw
    remat_recurrence: bool = False  # huginn: recompute each backprop step's activations (deep windows)
    init_from: str = ""  # a checkpoint folder of the same architecture and sizes to continue from ("" = random init)
    eval_depths: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    periodic_eval_depths: tuple[int, ...] = ()  # huginn: extra depths each periodic evaluation reports (the loss curve per r)
    command: str = ""
    quiet: bool = False


# ------------------------------------------------------------------------------------------ configs

def qwen35_config(vocab_size: int, o: TrainOptions, eos_token_id: int = 0) -> Qwen35Config:
    """Qwen3.5 text config: GDN and full attention 3:1 (layer i is full iff (i + 1) % 4 == 0), tied head."""
    layer_types = tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(o.layers))
    return Qwen35Config(
        vocab_size=vocab_size, hidden_size=o.hidden, num_hidden_layers=o.layers, num_attention_heads=o.heads,
        num_key_value_heads=o.kv_heads, head_dim=o.head_dim, intermediate_size=o.intermediate,
        layer_types=layer_types, linear_num_key_heads=o.linear_key_heads,
        linear_num_value_heads=o.linear_value_heads, linear_key_head_dim=o.linear_head_dim,
        linear_value_head_dim=o.linear_head_dim, rope_theta=o.rope_theta, tie_word_embeddings=True,
        mtp_num_hidden_layers=1, eos_token_id=(eos_token_id,), model_type="qwen3_5_text")


def qwen35_config_json(cfg: Qwen35Config) -> dict:
    d = cfg.to_hf_dict()
    d.update(mtp_num_hidden_layers=cfg.mtp_num_hidden_layers, bos_token_id=d.get("eos_token_id"), pad_token_id=1,
             dtype="bfloat16")
    return d


def huginn_config_dict(vocab_size: int, o: TrainOptions, eos_token_id: int = 0) -> dict:
    """Official `RavenConfig`-style config.json (the fields of tests/fixtures/looped/huginn_tiny)."""
    D = o.hidden
    depth = o.prelude + o.core * o.mean_recurrence + o.coda
    std = math.sqrt(2 / (5 * D))
    return {
        "n_embd": D, "n_heads": o.heads, "n_layers": o.prelude + o.core + o.coda,
        "block_size": max(4096, o.seq_len),
        "vocab_size": vocab_size, "padded_vocab_size": vocab_size, "padding_multiple": 64,
        "tie_embeddings": True, "intermediate_size": o.intermediate, "bias": False,
        "architecture_class_name": "RecurrentGPT", "block_class_name": "SandwichBlock",
        "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-6, "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU",
        "init_strategy": "takase", "init_orthogonal": False, "state_init": "zero", "injection_type": "linear",
        "n_layers_in_recurrent_block": o.core, "mean_recurrence": o.mean_recurrence,
        "sampling_scheme": "poisson-lognormal-filling", "mean_backprop_depth": o.backprop_depth,
        "n_layers_in_prelude": o.prelude, "n_layers_in_coda": o.coda, "qk_bias": True,
        "activation_checkpoint_impl": "per-iteration", "rope_base": 50000, "test_time_noise": 0,
        "test_time_noise_type": "fixed", "num_key_value_heads": o.heads, "head_dim": D // o.heads,
        "effective_expected_depth": depth,
        "init_values": {"std": std, "out_proj": std / math.sqrt(2 * depth), "embedding": std,
                        "embed_scale": math.sqrt(D)},
        "tie_word_embeddings": True, "architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
        "bos_token_id": eos_token_id, "eos_token_id": eos_token_id, "pad_token_id": 1, "torch_dtype": "bfloat16",
    }


def huginn_config(vocab_size: int, o: TrainOptions) -> looped.LoopedConfig:
    cfg = looped.looped_config_from_dict(huginn_config_dict(vocab_size, o), "huginn_config_dict")
    return dataclasses.replace(cfg, variant="huginn")


# ------------------------------------------------------------------------------------------- params

def init_qwen35_params(cfg: Qwen35Config, key: jax.Array, mtp_layers: int = 1, std: float = 0.02) -> dict:
    """fp32 parameters (GPT-style init): matrices ~ N(0, std), output projections std / sqrt(2 L),
    zero-centred norms 0, GDN gated norm 1, A_log = log U(1, 16), dt_bias = 1 (transformers' init),
    depthwise conv ~ U(+-1/sqrt(kernel))."""
    if cfg.is_moe:
        raise ValueError("init_qwen35_params: dense configs only")
    specs = qwen35.param_specs(cfg, {"model.embed_tokens.weight"}, "init_qwen35_params")
    out_std = std / math.sqrt(2 * cfg.num_hidden_layers)
    keys = dict(zip(specs, jax.random.split(key, len(specs) + 1)))

    def init(path):
        shape = mtp.leaf_shape(specs[path])
        name, k = path[-1], keys[path]
        if name == "A_log":
            return jnp.log(jax.random.uniform(k, shape, jnp.float32, 1.0, 16.0))
        if name == "dt_bias":
            return jnp.ones(shape, jnp.float32)
        if name == "conv":
            bound = 1.0 / math.sqrt(shape[-1])
            return jax.random.uniform(k, shape, jnp.float32, -bound, bound)
        if len(shape) == 1:  # the GDN output norm multiplies by w; every other norm by (1 + w)
            gated = len(path) > 2 and path[-2] == "mixer" and cfg.layer_types[path[1]] == LINEAR_ATTENTION
            return jnp.ones(shape, jnp.float32) if gated else jnp.zeros(shape, jnp.float32)
        s = out_std if name in ("o_proj", "out_proj", "down_proj") else std
        return jax.random.normal(k, shape, jnp.float32) * s

    params = build_tree({path: path for path in specs}, init)
    if mtp_layers:
        params["mtp"] = mtp.init_mtp_params(cfg, jax.random.fold_in(key, 1), jnp.float32, num_layers=mtp_layers,
                                            std=std)
    return params


def init_huginn_params(cfg: looped.LoopedConfig, key: jax.Array) -> dict:
    """fp32 parameters with the official "takase" init: std sqrt(2 / 5D) for matrices and the embedding,
    output projections std / sqrt(2 * effective depth), norms 1, qk_bias 0."""
    shapes = looped.expected_shapes(cfg)
    std = math.sqrt(2 / (5 * cfg.n_embd))
    depth = cfg.n_layers_in_prelude + cfg.n_layers_in_recurrent_block * cfg.mean_recurrence + cfg.n_layers_in_coda
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))

    def init(k):
        shape = shapes[k]
        if k.endswith("qk_bias"):
            return jnp.zeros(shape, jnp.float32)
        if len(shape) == 1:
            return jnp.ones(shape, jnp.float32)
        s = std / math.sqrt(2 * depth) if k.endswith(("attn.proj.weight", "mlp.proj.weight")) else std
        return jax.random.normal(keys[k], shape, jnp.float32) * s

    return build_tree({looped.param_path(k): k for k in shapes}, init)


def params_from_checkpoint(folder: str, arch: str, cfg, like: dict) -> dict:
    """fp32 parameters read from checkpoint `folder` (to continue training), checked against `like` (the tree a
    fresh init of `cfg` gives): the same names and shapes, else one error naming the first difference."""
    import os
    where = f"init_from {folder!r}"
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"{where}: not a checkpoint folder (no config.json); expected a folder written by "
                         "scripts/train_tiny.py")
    source = TensorSource(folder)
    try:
        if arch == "huginn":
            params = looped.load_looped_params(source, cfg, jnp.float32)[1]
        else:
            params = qwen35.load_params(source, cfg, jnp.float32)
    except Exception as err:  # names the tensor and the shapes; this adds which option caused the read
        raise ValueError(f"{where}: does not match the {arch} sizes given: {err}") from err
    want = {k: v.shape for k, v in flatten_tree(like).items()}
    got = {k: v.shape for k, v in flatten_tree(params).items()}
    for k in sorted(set(want) | set(got), key=str):
        if want.get(k) != got.get(k):
            raise ValueError(f"{where}: parameter {'.'.join(map(str, k))} is {got.get(k, 'missing')} in the "
                             f"checkpoint; the {arch} sizes given expect {want.get(k, 'no such parameter')}")
    return params


def count_params(params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


def cast(params, dtype):
    return jax.tree.map(lambda x: x.astype(dtype), params)


# ------------------------------------------------------------------------------------------- losses

def ce_rows(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row mean cross-entropy and top-1 accuracy [B]; logits [B, T, V] float32, labels [B, T]."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    acc = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return jnp.mean(ce, axis=-1), jnp.mean(acc, axis=-1)


def qwen35_outputs(params: dict, cfg: Qwen35Config, tokens: jax.Array, *, compute_dtype) -> dict[str, jax.Array]:
    """tokens [B, T + 2] -> per-row metrics [B]: ce, acc (next token) and, with an MTP head, mtp_ce, mtp_acc
    (token after next, from the target's hidden state and the true next token), mtp_agree (the MTP
    head's top-1 equals the model's own top-1 for that token, which is what a draft needs) and
    mtp_distill_ce (cross-entropy against the model's own distribution for that token, held fixed by a
    stop-gradient). GDN runs the differentiable chunked jnp reference."""
    p = cast(params, compute_dtype)
    B, W = tokens.shape
    T = W - 2
    state = qwen35.init_state(cfg, B, T, compute_dtype)
    logits, _, extras = qwen35.forward(p, cfg, state, tokens[:, :T], impl="reference", collect=True)
    ce, acc = ce_rows(logits, tokens[:, 1:T + 1])
    out = {"ce": ce, "acc": acc}
    if "mtp" in params:
        mtp_logits, _ = mtp.mtp_forward_train(p, cfg, extras["hidden"], tokens[:, 1:T + 1])
        out["mtp_ce"], out["mtp_acc"] = ce_rows(mtp_logits, tokens[:, 2:T + 2])
        # mtp_logits[:, t] and logits[:, t + 1] both predict token t + 2 after the same true prefix.
        head, model = mtp_logits[:, :T - 1].astype(jnp.float32), lax.stop_gradient(logits[:, 1:T]).astype(jnp.float32)
        out["mtp_agree"] = jnp.mean((jnp.argmax(head, -1) == jnp.argmax(model, -1)).astype(jnp.float32), axis=-1)
        out["mtp_distill_ce"] = jnp.mean(optax.softmax_cross_entropy(head, jax.nn.softmax(model, axis=-1)), axis=-1)
    return out


def qwen35_loss(params: dict, cfg: Qwen35Config, tokens: jax.Array, *, mtp_weight: float, compute_dtype,
                mtp_distill: float = 0.0):
    """tokens [B, T + 2] -> (CE + mtp_weight * ((1 - mtp_distill) * MTP CE + mtp_distill * MTP distill CE),
    mean metrics). The distillation term trains the head toward the model's own prediction, the one a
    draft must match to be accepted."""
    metrics = {k: jnp.mean(v) for k, v in qwen35_outputs(params, cfg, tokens, compute_dtype=compute_dtype).items()}
    if "mtp_ce" not in metrics:
        return metrics["ce"], metrics
    mtp_loss = (1.0 - mtp_distill) * metrics["mtp_ce"] + mtp_distill * metrics["mtp_distill_ce"]
    return metrics["ce"] + mtp_weight * mtp_loss, metrics


def mtp_chain_outputs(params: dict, cfg: Qwen35Config, tokens: jax.Array, *, depth: int,
                      compute_dtype) -> dict[str, jax.Array]:
    """tokens [B, T + depth + 1] -> per-row metrics [B] of the MTP head chained `depth` times from each of the
    first T positions as a draft chain runs it (`mtp.mtp_chain_train`), on the target's hidden states held fixed
    (stop-gradient). For each depth k: mtp{k}_ce / mtp{k}_acc against the true token t + k + 1, mtp{k}_agree
    (the head's top-1 equals the model's own for that token after the same true prefix), mtp{k}_distill_ce
    (cross-entropy against the model's distribution there); and mtp_accepted, the mean count of leading depths
    that agree: what a greedy step at gamma = depth would accept, with the true tokens as the chain's inputs
    (a draft chain feeds its own drafts, which equal the model's top-1 while it is being accepted)."""
    p = cast(params, compute_dtype)
    B, W = tokens.shape
    T = W - depth - 1
    n = T + depth  # the target runs on positions 0..n-1; its logits at t + k predict token t + k + 1
    state = qwen35.init_state(cfg, B, n, compute_dtype)
    logits, _, extras = qwen35.forward(p, cfg, state, tokens[:, :n], impl="reference", collect=True)
    logits, hidden = lax.stop_gradient(logits), lax.stop_gradient(extras["hidden"])
    chain = mtp.mtp_chain_train(p, cfg, hidden[:, :T], tokens[:, 1:n], depth)
    out, leading, accepted = {}, jnp.ones((B, T), jnp.float32), jnp.zeros((B, T), jnp.float32)
    for k, (head, _) in enumerate(chain, start=1):
        model = logits[:, k:k + T].astype(jnp.float32)
        out[f"mtp{k}_ce"], out[f"mtp{k}_acc"] = ce_rows(head, tokens[:, k + 1:k + 1 + T])
        match = (jnp.argmax(head, -1) == jnp.argmax(model, -1)).astype(jnp.float32)  # [B, T]
        out[f"mtp{k}_agree"] = jnp.mean(match, axis=-1)
        out[f"mtp{k}_distill_ce"] = jnp.mean(optax.softmax_cross_entropy(head, jax.nn.softmax(model, axis=-1)),
                                             axis=-1)
        leading = leading * match
        accepted = accepted + leading
    out["mtp_accepted"] = jnp.mean(accepted, axis=-1)
    return out


def mtp_chain_loss(mtp_params: dict, trunk_params: dict, cfg: Qwen35Config, tokens: jax.Array, *, depth: int,
                   distill: float, compute_dtype):
    """The MTP head alone trained for chained drafting, the model fixed: the mean over depths 1..depth of
    distill * (cross-entropy against the model's distribution) + (1 - distill) * (cross-entropy against the
    true token). Returns (loss, mean metrics); differentiate with respect to mtp_params only."""
    per_row = mtp_chain_outputs(dict(trunk_params, mtp=mtp_params), cfg, tokens, depth=depth,
                                compute_dtype=compute_dtype)
    metrics = {k: jnp.mean(v) for k, v in per_row.items()}
    loss = sum(distill * metrics[f"mtp{k}_distill_ce"] + (1.0 - distill) * metrics[f"mtp{k}_ce"]
               for k in range(1, depth + 1)) / depth
    return loss, metrics


def huginn_loss(params: dict, cfg: looped.LoopedConfig, tokens: jax.Array, n_no_grad: jax.Array,
                n_grad: jax.Array, init_key: jax.Array | None = None, *, backprop_depth: int, compute_dtype,
                init_state_scale: float = 0.0, remat_recurrence: bool = False):
    """tokens [B, T + 1]; n_no_grad, n_grad: int32 scalars (traced: one compile for every draw).

    init_state_scale > 0: the recurrence starts from the official random draw (`looped.initial_state` with
    init_key: truncated normal, std init_std * scale * embed_scale), as Huginn-0125 was trained, so the core must
    wash the noise out over its iterations; 0: from zeros (the state inference starts from).

    The no-grad recurrences run in a while loop on stop-gradient inputs; the last `n_grad`
    (<= backprop_depth) run in a scan of backprop_depth steps whose first
    backprop_depth - n_grad are skipped (identity), so shapes never change. remat_recurrence: each grad step's
    activations are recomputed in the backward pass (what a window of more than ~8 steps needs to fit).
    """
    p = cast(params, compute_dtype)
    B, W = tokens.shape
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    T = W - 1
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    cos, sin = looped.rope_tables(cfg, positions)
    length = jnp.zeros((B,), jnp.int32)
    e = looped.embed(p, cfg, ids)
    e, _, _ = looped.run_blocks(p.get("prelude", []), cfg, e, cos, sin, None, None, length)
    x = looped.initial_state(cfg, e, init_key if init_state_scale > 0 else None, init_state_scale)
    p_sg, e_sg = lax.stop_gradient(p), lax.stop_gradient(e)

    def no_grad_step(i, x):
        return looped.core_step(p_sg, cfg, None, x, e_sg, i, cos, sin)[0]

    x = lax.stop_gradient(lax.fori_loop(0, n_no_grad, no_grad_step, x))
    skip = backprop_depth - n_grad

    def apply_core(x, p, e, i):
        return looped.core_step(p, cfg, None, x, e, i, cos, sin)[0]

    if remat_recurrence:  # keep each step's input state only: memory flat in backprop_depth (one more forward)
        apply_core = jax.checkpoint(apply_core)

    def grad_step(x, j):
        # A skipped step costs nothing (cond, not compute-then-select), so a deep window is paid per draw.
        return lax.cond(j >= skip, lambda x: apply_core(x, p, e, n_no_grad + j - skip), lambda x: x, x), None

    x, _ = lax.scan(grad_step, x, jnp.arange(backprop_depth, dtype=jnp.int32))
    logits, _, _, _ = looped.coda_head(p, cfg, None, x, cos, sin, "all")
    ce, acc = (jnp.mean(v) for v in ce_rows(logits, labels))
    return ce, {"ce": ce, "acc": acc}


def sample_recurrence(rng: np.random.Generator, mean_recurrence: int, backprop_depth: int,
                      min_recurrence: int = 1) -> tuple[int, int]:
    """(no-grad steps, grad steps), the official poisson-lognormal-filling draw (total mean ~ max(mean, backprop_depth) + 1), a total
    below `min_recurrence` raised to it (the random draws are the same whatever the bound: 1 is the official draw)."""
    if min_recurrence < 1:
        raise ValueError(f"sample_recurrence: min_recurrence must be >= 1; got {min_recurrence}")
    s = backprop_depth
    t = max(mean_recurrence - s, 0)
    sigma = 0.5
    mu = math.log(t + s) - sigma ** 2 / 2
    p = max(int(rng.poisson(rng.lognormal(mu, sigma))) + 1, min_recurrence)
    return max(p - s, 0), min(s, p)
