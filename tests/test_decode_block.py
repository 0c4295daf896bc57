"""Decode-block ops: every implementation against the reference math (float32; the Pallas kernels in interpret
mode on CPU), and the MTP head built from them against the head's own forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_block as db
from pallas_kernels.decode_block import reference

IMPLS = ["reference", "pallas"]


def _rand(key, shape, scale=1.0):
    return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32) * scale


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ["plain", "two_norms_normed_out", "silu_residual"])
def test_block_linear_matches_the_unfused_math(impl, case):
    m, din, dout = 16, 64, 48
    x, w = _rand(0, (m, din)), _rand(1, (dout, din), 0.1)
    n0, n1 = _rand(2, (din // 2,), 0.1), _rand(3, (din // 2,), 0.1)
    res = _rand(4, (m, dout))
    if case == "plain":
        got, want = db.block_linear(x, w, implementation=impl), x @ w.T
    elif case == "two_norms_normed_out":
        got, normed = db.block_linear(x, w, norms=(n0, n1), want_normed=True, implementation=impl)
        halves = [reference.rms_norm0(h, n, 1e-6) for h, n in zip(jnp.split(x, 2, axis=1), (n0, n1))]
        want_normed = jnp.concatenate(halves, axis=1)
        np.testing.assert_allclose(normed, want_normed, rtol=1e-5, atol=1e-5)
        want = want_normed @ w.T
    else:
        w2 = _rand(5, (2 * dout, din), 0.1)
        got = db.block_linear(x, w2, norms=(jnp.zeros((din,)),), residual=res,
                              epilogue="silu_mul", implementation=impl)
        h = reference.rms_norm0(x, jnp.zeros((din,)), 1e-6) @ w2.T
        want = jax.nn.silu(h[:, :dout]) * h[:, dout:] + res
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _naive_attention(qkv, start, kc, vc, qn, kn, inv_freq, n_heads, n_new, eps=1e-6):
    """Row by row with numpy: norms, rotate-half RoPE, a dense softmax, the gate."""
    qkv, kc, vc = (np.asarray(a, np.float64) for a in (qkv, kc, vc))
    B, Tp, _ = qkv.shape
    NKV, hd = kc.shape[2], kc.shape[3]
    half = len(inv_freq)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x) + eps) * (1 + np.asarray(w))

    def rope(x, pos):
        f = pos * np.asarray(inv_freq, np.float64)
        out = x.copy()
        a, b = x[:half], x[half:2 * half]
        out[:half] = a * np.cos(f) - b * np.sin(f)
        out[half:2 * half] = b * np.cos(f) + a * np.sin(f)
        return out

    out = np.zeros((B, Tp, n_heads * hd))
    kc, vc = kc.copy(), vc.copy()
    for b in range(B):
        s0 = int(start[b])
        for t in range(n_new):
            for g in range(NKV):
                base = 2 * n_heads * hd
                kc[b, s0 + t, g] = rope(norm(qkv[b, t, base + g * hd: base + (g + 1) * hd], kn), s0 + t)
                vc[b, s0 + t, g] = qkv[b, t, base + NKV * hd + g * hd: base + NKV * hd + (g + 1) * hd]
        for t in range(n_new):
            for h in range(n_heads):
                g = h // (n_heads // NKV)
                q = rope(norm(qkv[b, t, 2 * h * hd: 2 * h * hd + hd], qn), s0 + t)
                gate = qkv[b, t, 2 * h * hd + hd: 2 * (h + 1) * hd]
                sc = kc[b, : s0 + t + 1, g] @ q / np.sqrt(hd)
                p = np.exp(sc - sc.max())
                o = (p / p.sum()) @ vc[b, : s0 + t + 1, g]
                out[b, t, h * hd:(h + 1) * hd] = o / (1 + np.exp(-gate))
    return out, kc, vc


@pytest.mark.parametrize("impl", IMPLS)
def test_cached_attention_matches_a_row_by_row_computation(impl):
    B, Tp, n_new, NH, NKV, hd, S = 2, 16, 3, 4, 2, 32, 128
    inv_freq = 1.0 / 10000 ** (np.arange(0, 8, 2) / 8)  # partial rotary: 8 of 32 dims
    qkv = _rand(0, (B, Tp, (2 * NH + 2 * NKV) * hd))
    kc, vc = _rand(1, (B, S, NKV, hd)), _rand(2, (B, S, NKV, hd))
    qn, kn = _rand(3, (hd,), 0.1), _rand(4, (hd,), 0.1)
    start = jnp.array([70, 0], jnp.int32)  # a start past one block of slots, and an empty cache
    freqs = db.rope_frequencies(hd, inv_freq)
    got, kc2, vc2 = db.cached_attention(qkv, start, kc, vc, qn, kn, freqs, n_heads=NH, n_new=n_new,
                                        implementation=impl)
    want, kw, vw = _naive_attention(qkv, start, kc, vc, qn, kn, inv_freq, NH, n_new)
    np.testing.assert_allclose(got[:, :n_new], want[:, :n_new], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(kc2, kw, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(vc2, vw, rtol=0, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("splits", [2, 3])
def test_attention_splits_combine_to_the_whole_attention(impl, splits):
    """Split over the cache (3 splits of 2 blocks: one split sees no cached slot; the second batch row's cache is
    empty), the partial results combined by a product's input equal the row-by-row attention."""
    B, Tp, n_new, NH, NKV, hd, S = 2, 16, 3, 4, 2, 32, 128
    inv_freq = 1.0 / 10000 ** (np.arange(0, 8, 2) / 8)
    qkv = _rand(0, (B, Tp, (2 * NH + 2 * NKV) * hd))
    kc, vc = _rand(1, (B, S, NKV, hd)), _rand(2, (B, S, NKV, hd))
    qn, kn = _rand(3, (hd,), 0.1), _rand(4, (hd,), 0.1)
    start = jnp.array([70, 0], jnp.int32)
    parts, kc2, vc2 = db.cached_attention(qkv, start, kc, vc, qn, kn, db.rope_frequencies(hd, inv_freq), n_heads=NH,
                                          n_new=n_new, splits=splits, implementation=impl)
    assert parts.out.shape == (splits, B * Tp, NH * hd) and parts.lse.shape == (splits, B * Tp, NH)
    want, kw, vw = _naive_attention(qkv, start, kc, vc, qn, kn, inv_freq, NH, n_new)
    got = reference.combine(parts).reshape(B, Tp, NH * hd)
    np.testing.assert_allclose(got[:, :n_new], want[:, :n_new], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(kc2, kw, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(vc2, vw, rtol=0, atol=0)
    w, res = _rand(5, (48, NH * hd), 0.1), _rand(6, (B * Tp, 48))
    np.testing.assert_allclose(db.block_linear(parts, w, residual=res, implementation=impl),
                               reference.combine(parts) @ w.T + res, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_projects_each_head_for_a_head_sum(impl):
    """Each head's output projection from the attention, summed onto a residual by the SwiGLU product (which also
    returns that sum): the same as the attention, then a product of its own."""
    B, Tp, n_new, NH, NKV, hd, S, D = 1, 16, 2, 4, 2, 32, 128, 48
    inv_freq = 1.0 / 10000 ** (np.arange(0, 8, 2) / 8)
    qkv = _rand(0, (B, Tp, (2 * NH + 2 * NKV) * hd))
    kc, vc = _rand(1, (B, S, NKV, hd)), _rand(2, (B, S, NKV, hd))
    qn, kn, wo = _rand(3, (hd,), 0.1), _rand(4, (hd,), 0.1), _rand(5, (D, NH * hd), 0.1)
    res, w, nw = _rand(6, (B * Tp, D)), _rand(7, (64, D), 0.1), _rand(8, (D,), 0.1)
    args = (qkv, jnp.array([40], jnp.int32), kc, vc, qn, kn, db.rope_frequencies(hd, inv_freq))
    kw = dict(n_heads=NH, n_new=n_new, implementation=impl)
    parts, kc2, _ = db.cached_attention(*args, out_proj=wo, **kw)
    out, kc_want, _ = db.cached_attention(*args, **kw)
    assert parts.shape == (NH, B * Tp, D)
    x_want = out.reshape(B * Tp, NH * hd) @ wo.T + res
    np.testing.assert_allclose(jnp.sum(parts, axis=0) + res, x_want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(kc2, kc_want, rtol=0, atol=0)
    h, x = db.block_linear(db.HeadSum(parts, res), w, norms=(nw,), epilogue="silu_mul", want_input=True,
                           implementation=impl)
    np.testing.assert_allclose(x, x_want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(h, db.block_linear(x_want, w, norms=(nw,), epilogue="silu_mul",
                                                  implementation="reference"), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_block_linear_gathers_its_rows(impl):
    """[table[ids] ; rest] at padded rows (rest passed with padding rows of its own), normed per part."""
    B, T, V, D = 2, 3, 40, 32
    ids = jnp.asarray([[5, 0, 39], [7, 7, 1]], jnp.int32)
    table, rest = _rand(0, (V, D)), _rand(1, (B, 5, D))
    w, n0, n1 = _rand(2, (48, 2 * D), 0.1), _rand(3, (D,), 0.1), _rand(4, (D,), 0.1)
    got, normed = db.block_linear(db.Gathered(table, ids, rest, 16), w, norms=(n0, n1), want_normed=True,
                                  implementation=impl)
    x = jnp.zeros((B, 16, 2 * D)).at[:, :T].set(jnp.concatenate([table[ids], rest[:, :T]], axis=-1))
    want = db.block_linear(x.reshape(B * 16, 2 * D), w, norms=(n0, n1), implementation="reference")
    assert got.shape == (B * 16, 48) and normed.shape == (B * 16, 2 * D)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_split_block_and_gather_settings_are_read_and_checked(monkeypatch):
    assert [db.attention_splits(n, 64) for n in (512, 1024, 1280, 2048, 4096)] == [1, 1, 2, 2, 4]
    assert [db.attention_block(hd) for hd in (32, 64, 128, 256)] == [256, 256, 128, 64]
    assert db.gather_inputs() is True and db.fuse_out_proj() is False
    monkeypatch.setattr(db, "SPLITS", 8)
    assert db.attention_splits(256, 64) == 1 and db.attention_splits(4096, 64) == 8
    monkeypatch.setattr(db, "GATHER", False)
    monkeypatch.setattr(db, "FUSE_OUT_PROJ", True)
    assert db.gather_inputs() is False and db.fuse_out_proj() is True
    monkeypatch.setattr(db, "SLOTS", 64)
    assert db.attention_block(64) == 64 and db.attention_splits(256, 64) == 4


# ------------------------------------------------------------------------------------ the MTP head from blocks
import functools  # noqa: E402
import os  # noqa: E402

import specdec_jax as sj  # noqa: E402
from specdec_jax.errors import InputError  # noqa: E402
from specdec_jax.models.qwen35 import mtp_head  # noqa: E402

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "tiny-qwen35-code")


@pytest.fixture(scope="module")
def tiny():
    return sj.load(TINY, dtype="float32")


_mtp_forward = jax.jit(mtp_head.mtp_forward, static_argnums=1)


@pytest.mark.parametrize("impl,splits,gather,slots,fuse", [("reference", "1", "1", "64", "0")] + [
    ("pallas", *form) for form in (("1", "1", "64", "0"), ("3", "0", "64", "0"), ("2", "1", "128", "0"),
                                   ("1", "1", "256", "1"))])
def test_mtp_head_from_blocks_matches_its_forward(tiny, impl, splits, gather, slots, fuse, monkeypatch):
    """Prompt entries through the head's own forward, then a 4-position update and a 1-position draft through both
    forms: logits, hidden states and the cache they leave agree (float32); attention in one program per head or split
    over the cache, the fc input gathered by the product or padded by XLA, the output projection in the attention or
    a product of its own."""
    monkeypatch.setattr(db, "SPLITS", int(splits))
    monkeypatch.setattr(db, "GATHER", gather == "1")
    monkeypatch.setattr(db, "SLOTS", int(slots))
    monkeypatch.setattr(db, "FUSE_OUT_PROJ", fuse == "1")
    cfg, params = tiny.config, tiny.params
    # Jitted, as a generation runs them (op by op, each op compiled on its own per shape): the head's own forward is
    # one program for every case; the blocks' form is traced anew here (the settings above are read while tracing).
    blocks = jax.jit(functools.partial(mtp_head.mtp_forward_blocks, implementation=impl), static_argnums=1)
    B, P = 2, 70
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, tiny.vocab_size, (B, P + 5)), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((B, P + 5, cfg.hidden_size)), jnp.float32)
    k, v = mtp_head.init_mtp_cache(cfg, B, 130, jnp.float32, round_to=db.CACHE_MULTIPLE)
    assert k.shape[1] == 256
    pos = lambda a, n: jnp.broadcast_to(jnp.arange(a, a + n, dtype=jnp.int32)[None], (B, n))
    _, _, k, v = _mtp_forward(params, cfg, hidden[:, :P], ids[:, :P], k, v, pos(0, P))
    assert mtp_head.blocks_supported(params, cfg, 4, k.shape[1])
    for start, n in ((P, 4), (P + 4, 1)):
        args = (hidden[:, start:start + n], ids[:, start:start + n])
        want = _mtp_forward(params, cfg, *args, k, v, pos(start, n))
        got = blocks(params, cfg, *args, k, v, pos(start, n))
        assert got[1].shape == (B, 16, cfg.hidden_size)  # hidden_out keeps its padding rows
        for g, w in zip((got[0], got[1][:, :n], *got[2:]), want):
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4)
        k, v = want[2], want[3]


def test_mtp_drafting_with_blocks_is_exact(tiny):
    ids = np.asarray([[1542, 12, 290, 1239, 11, 2023, 198, 220, 220, 220, 422]]) % tiny.vocab_size
    ar = sj.generate(tiny, ids, 40, eos_token_id=False).tokens
    res = sj.generate(tiny, ids, 40, method="mtp", gamma=3, kernels="blocks", eos_token_id=False)
    np.testing.assert_array_equal(res.tokens, ar)
    assert res.stats["mean_accepted"] > 0.5
    with pytest.raises(InputError, match=r"kernels must be one of \['auto', 'xla', 'blocks'\]; got 'fast'"):
        sj.generate(tiny, ids, 4, method="mtp", kernels="fast")


def test_warps_setting_is_read_and_checked(monkeypatch):
    assert db.warps() == db.WARPS == (8, 4)
    monkeypatch.setattr(db, "WARPS", (2, 8))
    assert db.warps() == (2, 8)
