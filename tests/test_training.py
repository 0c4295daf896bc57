"""Training of the tiny checkpoints (both archs) and the Qwen3.5 MTP head, on CPU.

A few optimizer steps on a tiny config must lower the loss; the written Qwen3.5 checkpoint must load
in specdec_jax and in transformers and both must decode the same greedy tokens (fp32); the MTP head
must match a small PyTorch implementation written here from vLLM's description.
"""

from __future__ import annotations

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import specdec_jax as sj
from specdec_jax import training
from specdec_jax.models.qwen35 import mtp_head as mtp, model as qwen35
from tests import qwen_helpers as H

VOCAB = 96
TINY_QWEN = dict(hidden=32, layers=4, heads=4, kv_heads=2, head_dim=16, linear_key_heads=2, linear_value_heads=4,
                 linear_head_dim=8, intermediate=64)
TINY_HUGINN = dict(hidden=32, heads=4, prelude=1, core=1, coda=1, intermediate=64, mean_recurrence=4,
                   backprop_depth=2, eval_depths=(1, 4))


def bigram_tokens(n: int, seed: int) -> np.ndarray:
    """A learnable toy language: each token follows from the previous one 85% of the time."""
    rng = np.random.default_rng(seed)
    table = rng.integers(2, VOCAB, size=VOCAB)
    noise = rng.integers(2, VOCAB, size=n)
    keep = rng.random(n) < 0.85
    out = np.empty(n, np.uint16)
    out[0] = 5
    for i in range(1, n):
        out[i] = table[out[i - 1]] if keep[i] else noise[i]
    return out


def _options(tmp_path, arch: str, **kw) -> training.TrainOptions:
    base = dict(arch=arch, out=str(tmp_path / arch) if tmp_path is not None else arch, steps=40, batch=8, seq_len=32, lr=1e-2, warmup_steps=5,
                log_every=5, eval_every=0, time_budget_s=300, quiet=True, schedule="steps")
    base.update(TINY_QWEN if arch == "qwen35" else TINY_HUGINN)
    base.update(kw)
    return training.TrainOptions(**base)


def _history(folder) -> list[dict]:
    return json.loads((folder / "train_log.json").read_text())["history"]


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    o = _options(tmp, "qwen35")
    data = bigram_tokens(12_000, seed=0)
    summary = training.run_training(o, data[:10_000], data[10_000:], vocab_size=VOCAB)
    return tmp / "qwen35", summary


def test_qwen35_training_lowers_loss_and_writes_checkpoint(qwen_run):
    folder, summary = qwen_run
    hist = _history(folder)
    assert hist[0]["step"] == 1 and summary["steps"] == 40
    assert summary["final_train_loss"] < hist[0]["loss"] - 1.0, (hist[0], summary["final_train_loss"])
    assert hist[-1]["mtp_ce"] < hist[0]["mtp_ce"]
    assert summary["eval"]["ce"] < math.log(VOCAB) - 1.0
    for name in ("config.json", "model.safetensors", "README.md", "train_log.json"):
        assert (folder / name).is_file(), name
    config = json.loads((folder / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1 and config["eos_token_id"] == 0
    assert "held-out" in (folder / "README.md").read_text().lower()


def test_mtp_agreement_and_self_distillation(qwen_run):
    """mtp_agree compares the head's top-1 for token t + 2 with the model's own (logits at t + 1); the
    distillation term is the cross-entropy against the model's distribution. On the trained toy model (its
    language is mostly a bigram chain) the head agrees with the model far more often than with the model's
    prediction one position earlier, so an offset error would show."""
    model = sj.load(qwen_run[0], dtype="float32")
    cfg, params = model.config, model.params
    tokens = jnp.asarray(bigram_tokens(2 * 10, seed=1).reshape(2, 10), jnp.int32)

    @jax.jit  # one compile for everything compared below
    def run(params, tokens):
        out = training.qwen35_outputs(params, cfg, tokens, compute_dtype=jnp.float32)
        logits, _, extras = qwen35.forward(params, cfg, qwen35.init_state(cfg, 2, 8, jnp.float32), tokens[:, :8],
                                           impl="reference", collect=True)
        head, _ = mtp.mtp_forward_train(params, cfg, extras["hidden"], tokens[:, 1:9])
        loss, _ = training.qwen35_loss(params, cfg, tokens, mtp_weight=0.5, compute_dtype=jnp.float32,
                                       mtp_distill=0.4)
        return out, logits, head, loss

    out, logits, head, loss = run(params, tokens)
    agree = (jnp.argmax(head[:, :7], -1) == jnp.argmax(logits[:, 1:8], -1)).mean(-1)
    np.testing.assert_allclose(out["mtp_agree"], agree, atol=1e-6)
    shifted = (jnp.argmax(head[:, :7], -1) == jnp.argmax(logits[:, :7], -1)).mean()
    assert float(jnp.mean(agree)) >= 0.5 > float(shifted)
    ce = -(jax.nn.softmax(logits[:, 1:8]) * jax.nn.log_softmax(head[:, :7])).sum(-1).mean(-1)
    np.testing.assert_allclose(out["mtp_distill_ce"], ce, rtol=1e-5)
    m = {k: jnp.mean(v) for k, v in out.items()}
    np.testing.assert_allclose(loss, m["ce"] + 0.5 * (0.6 * m["mtp_ce"] + 0.4 * m["mtp_distill_ce"]), rtol=1e-5)


def test_qwen35_checkpoint_matches_transformers(qwen_run):
    folder, _ = qwen_run
    from transformers import Qwen3_5ForCausalLM
    ref, info = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    model = sj.load(folder, dtype="float32")
    assert "mtp" in model.params  # the MTP head is loaded here, and simply unused by transformers
    ids = bigram_tokens(2_000, seed=5)[None, 100:110].astype(np.int64)
    ours = sj.generate(model, ids, 16, eos_token_id=False).tokens
    np.testing.assert_array_equal(ours, H.reference_greedy(ref.eval(), ids, 16))
    logits = sj.forward_logits(model, ids)
    assert H.rel_err(logits, H.reference_logits(ref, ids)) <= 1e-4


def test_huginn_training_lowers_loss_and_loads(tmp_path):
    """Continued from a checkpoint (init_from; its first loss is the saved weights' loss on the first batch and
    draw, which a fresh init does not give), with a deep rematerialized backprop window."""
    o = _options(tmp_path, "huginn", steps=30, init_from=str(tmp_path / "start"), backprop_depth=6,
                 remat_recurrence=True, eval_every=20, periodic_eval_depths=(1,))
    cfg = training.huginn_config(VOCAB, o)
    start = training.init_huginn_params(cfg, jax.random.PRNGKey(7))
    training.save_checkpoint(tmp_path / "start", "huginn", start, cfg, training.huginn_config_dict(VOCAB, o), None)
    data = bigram_tokens(12_000, seed=1)
    first = training.sample_windows(np.random.default_rng(o.seed), data[:10_000], o.batch, o.seq_len + 1)
    n, k = training.sample_recurrence(np.random.default_rng(o.seed + 1), o.mean_recurrence, o.backprop_depth)
    # Jitted: one program for the three losses below (op by op, each of the loss's ops compiled on its own).
    loss_of = jax.jit(lambda p: training.huginn_loss(training.cast(training.cast(p, jnp.bfloat16), jnp.float32), cfg,
                                                     jnp.asarray(first), jnp.int32(n), jnp.int32(k),
                                                     backprop_depth=o.backprop_depth, compute_dtype=jnp.bfloat16)[0])
    start_loss = lambda p: float(loss_of(p))
    summary = training.run_training(o, data[:10_000], data[10_000:], vocab_size=VOCAB)
    hist = _history(tmp_path / "huginn")
    assert hist[0]["loss"] == pytest.approx(start_loss(start), abs=1e-3)  # bf16: the step's program vs this one
    fresh = training.init_huginn_params(cfg, jax.random.PRNGKey(o.seed))
    assert abs(start_loss(fresh) - start_loss(start)) > 2e-2, (start_loss(fresh), start_loss(start))
    log = json.loads((tmp_path / "huginn" / "train_log.json").read_text())
    assert log["init_from"]["path"] == o.init_from
    periodic = log["evals"][0]  # step 20: the loss at the mean recurrence (4) and at each periodic depth
    assert periodic["step"] == 20 and set(periodic["ce_per_depth"]) == {"1", "4"}
    assert periodic["ce_per_depth"]["4"] == pytest.approx(periodic["ce"]) and periodic["ce_per_depth"]["1"] > periodic["ce"]
    assert summary["final_train_loss"] < hist[0]["loss"] - 1.0, (hist[0], summary["final_train_loss"])
    assert set(summary["eval"]["per_depth"]) == {1, 4}
    assert summary["eval"]["per_depth"][4]["ce"] < math.log(VOCAB) - 1.0
    model = sj.load(tmp_path / "huginn", dtype="float32")
    assert model.family == "looped" and model.config.mean_recurrence == 4
    out = sj.generate(model, data[None, :6].astype(np.int64), 4, eos_token_id=False)
    assert out.tokens.shape == (1, 4)


def test_huginn_loss_from_a_random_initial_state():
    """init_state_scale 0 starts the recurrence from zeros (any key); > 0 from a draw that depends on the key."""
    o = training.TrainOptions(arch="huginn", **TINY_HUGINN)
    cfg = training.huginn_config(VOCAB, o)
    params = training.init_huginn_params(cfg, jax.random.PRNGKey(0))
    tokens = jnp.asarray(bigram_tokens(2 * 17, seed=3).reshape(2, 17))
    run = jax.jit(training.huginn_loss, static_argnums=1,  # jitted, as training runs it
                  static_argnames=("backprop_depth", "compute_dtype", "init_state_scale"))
    loss = lambda key, scale: float(run(params, cfg, tokens, jnp.int32(1), jnp.int32(2), key, backprop_depth=2,
                                        compute_dtype=jnp.float32, init_state_scale=scale)[0])
    k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
    assert loss(k1, 0.0) == loss(k2, 0.0) == loss(None, 0.0)
    assert loss(k1, 1.0) != loss(k2, 1.0) and loss(k1, 1.0) != loss(k1, 0.0)


def test_huginn_backprop_window_and_init_from_errors(tmp_path):
    """A draw's loss does not depend on the window's length or on rematerialization; its gradient reaches as
    deep as the window: 5 steps all with gradient differ from 3 without and 2 with. init_from of another size
    or of no checkpoint is one error naming the parameter or the folder."""
    o = training.TrainOptions(arch="huginn", **TINY_HUGINN)
    cfg = training.huginn_config(VOCAB, o)
    params = training.init_huginn_params(cfg, jax.random.PRNGKey(0))
    tokens = jnp.asarray(bigram_tokens(2 * 17, seed=3).reshape(2, 17))

    @jax.jit
    def grad(n, k):
        return {bd: jax.value_and_grad(lambda p: training.huginn_loss(
            p, cfg, tokens, n, k, backprop_depth=bd, compute_dtype=jnp.float32, remat_recurrence=bd > 5)[0])(params)
            for bd in (5, 8)}

    flat = lambda g: jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])
    (l5, g5), (l8, g8) = grad(jnp.int32(0), jnp.int32(5)).values()
    (l_trunc, g_trunc), _ = grad(jnp.int32(3), jnp.int32(2)).values()
    assert float(l5) == float(l8) == float(l_trunc)  # the same 5 recurrences forward
    np.testing.assert_allclose(flat(g8), flat(g5), rtol=1e-4, atol=1e-6)
    assert float(jnp.max(jnp.abs(flat(g5) - flat(g_trunc)))) > 1e-3
    training.save_checkpoint(tmp_path / "ck", "huginn", params, cfg, training.huginn_config_dict(VOCAB, o), None)
    wider = training.TrainOptions(arch="huginn", **dict(TINY_HUGINN, intermediate=128))
    cfg_wide = training.huginn_config(VOCAB, wider)
    with pytest.raises(ValueError, match="init_from .*ck.*does not match the huginn sizes"):
        training.params_from_checkpoint(str(tmp_path / "ck"), "huginn", cfg_wide,
                                        training.init_huginn_params(cfg_wide, jax.random.PRNGKey(0)))
    with pytest.raises(ValueError, match="init_from .*nowhere.*not a checkpoint folder"):
        training.params_from_checkpoint(str(tmp_path / "nowhere"), "huginn", cfg, params)
    loaded = training.params_from_checkpoint(str(tmp_path / "ck"), "huginn", cfg, params)
    np.testing.assert_array_equal(np.asarray(loaded["adapter"]), np.asarray(training.cast(params, jnp.bfloat16)["adapter"],
                                                                           np.float32))


def test_recurrence_sampler():
    rng = np.random.default_rng(0)
    draws = [training.sample_recurrence(rng, 16, 4) for _ in range(4000)]
    n, k = np.array(draws).T
    assert np.all((k >= 1) & (k <= 4)) and np.all(n >= 0)
    assert np.all((n == 0) | (k == 4))  # no-grad steps only once the backprop window is full
    assert abs(np.mean(n + k) - 17) < 0.5  # Poisson-lognormal around the mean, plus one
    # A floor raises the short draws only: the same random stream, every other draw unchanged.
    rng = np.random.default_rng(0)
    floored = np.array([training.sample_recurrence(rng, 16, 4, 8) for _ in range(4000)])
    total, floored_total = n + k, floored.sum(axis=1)
    assert np.all(floored_total >= 8)
    assert np.array_equal(floored_total, np.maximum(total, 8))
    assert np.all((floored[:, 0] == 0) | (floored[:, 1] == 4))
    with pytest.raises(ValueError, match="min_recurrence must be >= 1"):
        training.sample_recurrence(rng, 16, 4, 0)


# --------------------------------------------------------------------------------------------- MTP

def torch_mtp(t: dict, cfg, hidden: torch.Tensor, next_ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """vLLM's Qwen3.5 MTP head on HF-named tensors `t`, fp32: logits for the tokens at t + 2."""
    eps, nH, nKV, hd = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def norm(x, w):  # zero-centred RMSNorm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)

    B, T, _ = hidden.shape
    emb = t["model.embed_tokens.weight"]
    e = norm(emb[next_ids], t["mtp.pre_fc_norm_embedding.weight"])
    h = norm(hidden, t["mtp.pre_fc_norm_hidden.weight"])
    x = torch.cat([e, h], -1) @ t["mtp.fc.weight"].T
    p = "mtp.layers.0."
    y = norm(x, t[p + "input_layernorm.weight"])
    qg = (y @ t[p + "self_attn.q_proj.weight"].T).view(B, T, nH, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(B, T, nH * hd)
    q = norm(q, t[p + "self_attn.q_norm.weight"])
    k = norm((y @ t[p + "self_attn.k_proj.weight"].T).view(B, T, nKV, hd), t[p + "self_attn.k_norm.weight"])
    v = (y @ t[p + "self_attn.v_proj.weight"].T).view(B, T, nKV, hd)
    rd = int(hd * cfg.partial_rotary_factor)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)
    ang = (torch.arange(T, dtype=torch.float32) + offset)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[None, :, None], torch.cat([ang, ang], -1).sin()[None, :, None]

    def rope(z):
        r, rest = z[..., :rd], z[..., rd:]
        rotated = torch.cat([-r[..., rd // 2:], r[..., :rd // 2]], -1)
        return torch.cat([r * cos + rotated * sin, rest], -1)

    q, k = rope(q), rope(k)
    rep = nH // nKV
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * hd ** -0.5
    scores = scores.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float("-inf"))
    attn = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(B, T, nH * hd)
    x = x + (attn * torch.sigmoid(gate)) @ t[p + "self_attn.o_proj.weight"].T
    y = norm(x, t[p + "post_attention_layernorm.weight"])
    mlp = torch.nn.functional.silu(y @ t[p + "mlp.gate_proj.weight"].T) * (y @ t[p + "mlp.up_proj.weight"].T)
    x = x + mlp @ t[p + "mlp.down_proj.weight"].T
    return norm(x, t["mtp.norm.weight"]) @ emb.T


@pytest.fixture(scope="module")
def mtp_setup():
    o = training.TrainOptions(**TINY_QWEN)
    cfg = training.qwen35_config(VOCAB, o)
    params = training.init_qwen35_params(cfg, jax.random.PRNGKey(3), std=0.3)
    # Random norm weights and a strong MTP layer, so that every piece matters.
    keys = iter(jax.random.split(jax.random.PRNGKey(4), 64))
    params["mtp"] = jax.tree.map(lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape) if x.ndim == 1 else x,
                                 params["mtp"])
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((2, 11, cfg.hidden_size)).astype(np.float32)
    next_ids = rng.integers(0, VOCAB, size=(2, 11))
    return cfg, params, hidden, next_ids


# Jitted, as training and decoding run them (op by op, each of the head's ops would compile on its own per shape).
_mtp_forward_train = jax.jit(mtp.mtp_forward_train, static_argnums=1)
_mtp_forward = jax.jit(mtp.mtp_forward, static_argnums=1)


def test_mtp_forward_matches_torch(mtp_setup):
    cfg, params, hidden, next_ids = mtp_setup
    logits, hidden_out = _mtp_forward_train(params, cfg, jnp.asarray(hidden), jnp.asarray(next_ids))
    assert logits.shape == (2, 11, VOCAB) and hidden_out.shape == hidden.shape
    tensors = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in qwen35.hf_tensors(params, cfg).items()}
    want = torch_mtp(tensors, cfg, torch.from_numpy(hidden), torch.from_numpy(next_ids)).numpy()
    assert H.rel_err(logits, want) <= 1e-5


def test_mtp_cached_forward_equals_full(mtp_setup):
    cfg, params, hidden, next_ids = mtp_setup
    full, full_hidden = _mtp_forward_train(params, cfg, jnp.asarray(hidden), jnp.asarray(next_ids))
    k_cache, v_cache = mtp.init_mtp_cache(cfg, 2, 16, jnp.float32)
    pieces, hiddens = [], []
    for start, stop in ((0, 1), (1, 6), (6, 11)):  # T = 1 (decode) and multi-token (verification) calls
        pos = jnp.broadcast_to(jnp.arange(start, stop, dtype=jnp.int32)[None], (2, stop - start))
        lg, ho, k_cache, v_cache = _mtp_forward(params, cfg, jnp.asarray(hidden[:, start:stop]),
                                                jnp.asarray(next_ids[:, start:stop]), k_cache, v_cache, pos)
        pieces.append(lg)
        hiddens.append(ho)
    assert H.rel_err(jnp.concatenate(pieces, axis=1), full) <= 1e-5
    assert H.rel_err(jnp.concatenate(hiddens, axis=1), full_hidden) <= 1e-5


def test_mtp_chain_equals_the_drafters_cached_chain(mtp_setup):
    """mtp_chain_train's depth k of origin t is the drafter's k-th chained forward after committing positions
    0..t: the cached head on the target's hiddens, then fed its own hidden_out with the next token, one row at a
    time (the provisional entries past the committed ones). Checked at several origins and depths."""
    cfg, params, hidden, ids = mtp_setup
    depth, T = 3, hidden.shape[1] - 2
    chain = jax.jit(mtp.mtp_chain_train, static_argnums=(1, 4))(params, cfg, jnp.asarray(hidden[:, :T]),
                                                                  jnp.asarray(ids), depth)
    assert len(chain) == depth and chain[0][0].shape == (2, T, VOCAB)
    for t in (0, 4, T - 1):
        k_cache, v_cache = mtp.init_mtp_cache(cfg, 2, 16, jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(t + 1, dtype=jnp.int32)[None], (2, t + 1))
        lg, ho, k_cache, v_cache = _mtp_forward(params, cfg, jnp.asarray(hidden[:, :t + 1]),
                                                jnp.asarray(ids[:, :t + 1]), k_cache, v_cache, pos)
        lg, ho = lg[:, -1:], ho[:, -1:]
        for k in range(1, depth + 1):
            if k > 1:
                pos = jnp.full((2, 1), t + k - 1, jnp.int32)
                lg, ho, k_cache, v_cache = _mtp_forward(params, cfg, ho, jnp.asarray(ids[:, t + k - 1:t + k]),
                                                        k_cache, v_cache, pos)
            assert H.rel_err(chain[k - 1][0][:, t], lg[:, 0]) <= 1e-5, (t, k)
            assert H.rel_err(chain[k - 1][1][:, t], ho[:, 0]) <= 1e-5, (t, k)
    # Depth 1 is the plain head; depth 2 differs from it (it reads its own hidden state), so the test can fail.
    full, _ = _mtp_forward_train(params, cfg, jnp.asarray(hidden[:, :T]), jnp.asarray(ids[:, :T]))
    assert H.rel_err(chain[0][0], full) <= 1e-5
    assert H.rel_err(chain[1][0][:, :T - 1], full[:, 1:]) > 1e-2


def test_mtp_chain_metrics_count_leading_agreements(qwen_run):
    """mtp_accepted counts, per origin, the depths agreeing with the model before the first that does not; each
    depth's agreement compares with the model's logits k positions on (its token's prediction)."""
    model = sj.load(qwen_run[0], dtype="float32")
    cfg, params = model.config, model.params
    depth, tokens = 3, jnp.asarray(bigram_tokens(2 * 12, seed=2).reshape(2, 12), jnp.int32)
    T = tokens.shape[1] - depth - 1
    out = jax.jit(training.mtp_chain_outputs, static_argnames=("cfg", "depth", "compute_dtype"))(
        params, cfg, tokens, depth=depth, compute_dtype=jnp.float32)

    @jax.jit
    def reference(params, tokens):
        logits, _, extras = qwen35.forward(params, cfg, qwen35.init_state(cfg, 2, T + depth, jnp.float32),
                                           tokens[:, :T + depth], impl="reference", collect=True)
        return logits, mtp.mtp_chain_train(params, cfg, extras["hidden"][:, :T], tokens[:, 1:T + depth], depth)

    logits, chain = reference(params, tokens)
    match = np.stack([np.asarray(jnp.argmax(c[0], -1) == jnp.argmax(logits[:, k:k + T], -1))
                      for k, c in enumerate(chain, start=1)])  # [depth, B, T]
    np.testing.assert_allclose(out["mtp2_agree"], match[1].mean(-1), atol=1e-6)
    np.testing.assert_allclose(out["mtp_accepted"], np.cumprod(match, axis=0).sum(0).mean(-1), atol=1e-6)
    assert float(out["mtp1_agree"].mean()) >= 0.5  # the trained toy head agrees with its model


def test_train_mtp_head_changes_the_head_alone(qwen_run, tmp_path):
    """scripts/train_mtp_head.py: held-out accepted drafts rise on the toy language, every tensor but mtp.* is the
    input checkpoint's bit for bit, the folder loads, and bad input is refused before any training."""
    from safetensors.numpy import load_file as load_np
    from scripts import train_mtp_head

    folder = tmp_path / "model"
    shutil.copytree(qwen_run[0], folder)
    (folder / "tokenizer.json").write_text('{"toy": true}')
    corpus = tmp_path / "corpus"
    (corpus / "tokenizer").mkdir(parents=True)
    (corpus / "tokenizer" / "tokenizer.json").write_text('{"toy": true}')
    data = bigram_tokens(12_000, seed=0)
    np.save(corpus / "train.npy", data[:10_000])
    np.save(corpus / "heldout.npy", data[10_000:])
    out = tmp_path / "chain"
    argv = ["--model", str(folder), "--corpus", str(corpus), "--out", str(out), "--depth", "2", "--steps", "40",
            "--batch", "8", "--seq-len", "32", "--lr", "1e-2", "--warmup-steps", "5", "--eval-every", "0",
            "--compute-dtype", "float32", "--log-every", "20"]
    assert train_mtp_head.main(argv) == 0
    log = json.loads((out / train_mtp_head.LOG_NAME).read_text())
    assert log["final"]["mtp_accepted"] > log["baseline"]["mtp_accepted"] + 0.05, (log["baseline"], log["final"])
    before, after = load_np(str(folder / "model.safetensors")), load_np(str(out / "model.safetensors"))
    assert set(before) == set(after)
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all(k.startswith("mtp.") for k in changed), changed
    assert "chained drafting" in (out / "README.md").read_text()
    assert sj.load(out, dtype="float32").config == sj.load(folder, dtype="float32").config
    for bad, needle in ((["--distill", "1.5"], "--distill"), (["--depth", "0"], "--depth"),
                        (["--out", str(folder)], "--out")):
        with pytest.raises(SystemExit):
            train_mtp_head.parse_args(argv + bad)
    (corpus / "tokenizer" / "tokenizer.json").write_text('{"other": true}')
    with pytest.raises(SystemExit):
        train_mtp_head.parse_args(argv)


@pytest.mark.parametrize("name", ["tiny-qwen35-code", "tiny-huginn-code"])
def test_shipped_checkpoint_folder_budget_manifest_and_licences(name):
    import gzip
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "checkpoints" / name
    assert training.folder_bytes(folder) <= training.MAX_CHECKPOINT_BYTES
    manifest = json.loads(gzip.open(folder / "corpus_manifest.json.gz", "rt").read())["packages"]
    licences = (folder / "LICENSES.md").read_text()
    assert len(manifest) > 20  # the standard library and the installed packages
    for package, entry in manifest.items():
        assert f"| {package} | " in licences and entry["version"]
        assert all(len(sha) == 16 and path.endswith(".py") for path, sha in entry["train"] + entry["heldout"])
    assert sum(len(e["heldout"]) for e in manifest.values()) > 0
    assert (folder / "tokenizer.json").read_bytes() == (folder.parent / "tiny-qwen35-code" / "tokenizer.json").read_bytes()
