"""Causal attention over a KV cache (pallas_kernels/attention): every implementation against a float64 numpy
softmax, and the model's prefill through the flash kernel against XLA's path.

Cases: grouped query heads (1, 2 and 4 per key head), ragged per-row start positions (a chunk deep in a cache), a
cache whose length is not a whole number of key tiles, a head size that is not a power of two (padded), bfloat16.
The Pallas kernel runs in interpret mode here; the GPU run is benchmarks/bench_long_context.py's check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from pallas_kernels import attention as A
from specdec_jax.decoding.prefill import chunked_prefill
from specdec_jax.models.qwen35 import model as qwen35
from tests import qwen_helpers as H


def _naive(q, k, v, starts, scale):
    """float64 softmax, one query row at a time."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, NH, _ = q.shape
    group = NH // k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for t in range(T):
            seen = min(starts[b] + t + 1, k.shape[1])
            for h in range(NH):
                s = k[b, :seen, h // group] @ q[b, t, h] * scale
                w = np.exp(s - s.max())
                out[b, t, h] = w @ v[b, :seen, h // group] / w.sum()
    return out


CASES = {  # B, T, NH, NKV, hd, S, starts
    "ragged starts": (3, 40, 8, 2, 64, 200, [0, 37, 150]),
    "one kv head, odd cache": (2, 96, 4, 1, 16, 300, [5, 190]),
    "mha, hd 24": (1, 33, 2, 2, 24, 130, [90]),
}


ON_THIS_DEVICE = [i for i in A.IMPLEMENTATIONS if i != "cudnn" or jax.default_backend() == "gpu"]  # cuDNN: the GPU's


@pytest.mark.parametrize("implementation", ON_THIS_DEVICE)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_causal_attention_matches_softmax(implementation, case, dtype):
    B, T, NH, NKV, hd, S, starts = CASES[case]
    rng = np.random.default_rng(len(case))
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in
               [(B, T, NH, hd), (B, S, NKV, hd), (B, S, NKV, hd)])
    cast = lambda x: jnp.asarray(x, dtype)
    blocks = dict(block_m=32, block_k=64, num_warps=4, num_stages=2)  # several row blocks and key tiles per case
    got = A.causal_attention(cast(q), cast(k), cast(v), jnp.asarray(starts, jnp.int32), scale=hd ** -0.5,
                             implementation=implementation, blocks=blocks)
    assert got.shape == q.shape and got.dtype == jnp.dtype(dtype)
    # the naive softmax of the rounded inputs: what each implementation computes, up to its own rounding
    want = _naive(*(np.asarray(cast(x), np.float32) for x in (q, k, v)), starts, hd ** -0.5)
    tol = 2e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)


def test_two_part_attention_reads_the_rows_own_keys_past_the_cache():
    """The prefix + square decomposition (cuDNN's, here through XLA) given the rows' own K/V: a padded last chunk
    reaching past the cache's end (start + T > S) still gives every row inside the cache its softmax; a row at
    start 0 has no prefix."""
    B, T, NH, NKV, hd, S = 2, 48, 4, 2, 32, 120
    starts = [0, 100]  # row 1's chunk covers positions 100..147: 20 inside the cache, 28 padding past it
    rng = np.random.default_rng(7)
    q = rng.standard_normal((B, T, NH, hd)).astype(np.float32)
    full_k, full_v = (rng.standard_normal((B, 160, NKV, hd)).astype(np.float32) for _ in range(2))
    own = np.arange(T)[None, :] + np.asarray(starts)[:, None]  # [B, T] positions
    new_k = np.stack([full_k[b, own[b]] for b in range(B)])
    new_v = np.stack([full_v[b, own[b]] for b in range(B)])
    got = A.causal_attention(jnp.asarray(q), jnp.asarray(full_k[:, :S]), jnp.asarray(full_v[:, :S]),
                             jnp.asarray(starts, jnp.int32), scale=hd ** -0.5, implementation="dpa-xla",
                             new_kv=(jnp.asarray(new_k), jnp.asarray(new_v)))
    want = _naive(q, full_k, full_v, starts, hd ** -0.5)
    inside = own < S  # [B, T]
    np.testing.assert_allclose(np.asarray(got)[inside], want[inside], rtol=2e-5, atol=2e-5)


def test_two_part_merge_keeps_bf16_attention_accuracy_on_peaky_heads(monkeypatch):
    """Peaky scores (log-sum-exps up to ~130): the prefix + square merge in bf16 stays as close to the float32
    softmax as bf16 attention in one piece, because it merges float32 log-sum-exps; the control rounds them to bf16
    (what jax.nn.dot_product_attention returns) and lands several times further."""
    from pallas_kernels.attention import prefix
    B, T, NH, NKV, hd, S = 1, 128, 4, 2, 64, 1200
    start = jnp.asarray([1000], jnp.int32)
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal(shape) * 5.0, jnp.bfloat16) for shape in [(B, T, NH, hd), (B, S, NKV, hd)])
    v = jnp.asarray(rng.standard_normal((B, S, NKV, hd)), jnp.bfloat16)
    f32 = A.causal_attention(*(x.astype(jnp.float32) for x in (q, k, v)), start, scale=hd ** -0.5,
                             implementation="reference")
    error = lambda implementation: float(jnp.max(jnp.abs(A.causal_attention(
        q, k, v, start, scale=hd ** -0.5, implementation=implementation).astype(jnp.float32) - f32)))
    one_piece, merged = error("reference"), error("dpa-xla")
    assert merged <= 1.5 * one_piece, (merged, one_piece)
    exact_part = prefix._xla_part
    monkeypatch.setattr(prefix, "_xla_part", lambda *a, **kw: (lambda o, r: (o, r.astype(jnp.bfloat16).astype(
        jnp.float32)))(*exact_part(*a, **kw)))
    assert error("dpa-xla") > 5 * one_piece


def test_prefill_over_long_caches_takes_cudnn_on_the_gpu(monkeypatch):
    """With the GPU's kernels ("auto" resolving to them), prefill chunks over caches of CUDNN_MIN_CACHE slots and
    more take cuDNN, shorter caches the flash kernel; an explicit "pallas" keeps the flash kernel anywhere; cuDNN
    falls back to the flash kernel for float32 or a head size it does not take."""
    monkeypatch.setattr(A, "resolve", lambda implementation="auto": "pallas")
    assert A.path("auto", A.FLASH_MIN_ROWS, A.CUDNN_MIN_CACHE) == "cudnn"
    assert A.path("auto", 1024, A.CUDNN_MIN_CACHE - 1) == "pallas"
    assert A.path("pallas", 1024, A.CUDNN_MIN_CACHE) == "pallas"
    assert A.path("auto", 8, A.CUDNN_MIN_CACHE) == "pallas-split"
    from pallas_kernels.attention import prefix
    assert prefix.cudnn_takes(jnp.zeros((1, 2, 4, 256), jnp.bfloat16))
    assert not prefix.cudnn_takes(jnp.zeros((1, 2, 4, 256), jnp.float32))
    assert not prefix.cudnn_takes(jnp.zeros((1, 2, 4, 20), jnp.bfloat16))


def test_auto_is_the_reference_off_the_gpu():
    assert A.resolve("auto") == ("pallas" if jax.default_backend() == "gpu" else "reference")
    with pytest.raises(ValueError, match="implementation must be one of"):
        A.resolve("cudnn-flash")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ref = H.build_reference(H.tiny_text_config(ratio=2, vocab=61), seed=31)
    folder = str(tmp_path_factory.mktemp("attention"))
    H.save_reference(ref, folder)
    return sj.load(folder, dtype="float32")


def test_chunked_flash_prefill_is_the_one_shot_prefill(model):
    """Two ragged prompts (100 and 70 tokens) prefilled in chunks of 72 rows (the flash kernel: >= FLASH_MIN_ROWS)
    give the last logits and the state of one unpadded XLA forward per prompt (fp32 tolerance), and the same next
    token."""
    cfg = model.config
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in (100, 70)]
    chunk, width, max_len = 72, 144, 256
    assert chunk >= A.FLASH_MIN_ROWS
    assert qwen35.attention_path("pallas", chunk, max_len) == "pallas"
    ids = np.zeros((2, width), np.int32)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = r

    def run(st, piece, n_valid):
        logits, st, _ = qwen35.forward(model.params, cfg, st, piece, logits_for="last", prefill_lens=n_valid,
                                       impl="pallas")
        return logits[:, 0], st, None

    logits, state = chunked_prefill(run, qwen35.init_state(cfg, 2, max_len, jnp.float32), jnp.asarray(ids),
                                    jnp.asarray([len(r) for r in rows], jnp.int32), chunk)[:2]
    # jitted: op by op, each of the forward's ops would compile on its own (hundreds of programs)
    reference = jax.jit(lambda params, st, piece: qwen35.forward(params, cfg, st, piece, logits_for="last",
                                                                 impl="reference")[:2])
    for b, r in enumerate(rows):
        fresh = qwen35.init_state(cfg, 1, max_len, jnp.float32)
        want, want_state = reference(model.params, fresh, jnp.asarray(r)[None])
        np.testing.assert_allclose(np.asarray(logits[b]), np.asarray(want[0, 0]), rtol=1e-4, atol=1e-4)
        assert int(np.argmax(logits[b])) == int(np.argmax(want[0, 0]))
        got_state = state.batch_rows(slice(b, b + 1))
        for a, w in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
            a, w = np.asarray(a, np.float32), np.asarray(w, np.float32)
            if a.ndim >= 2 and a.shape[1] == max_len:  # K/V: only the slots the prompt wrote are defined
                a, w = a[:, :len(r)], w[:, :len(r)]
            # 2e-4: the deepest layers' K/V, two compilations of the same float32 arithmetic apart
            np.testing.assert_allclose(a, w, rtol=1e-4, atol=2e-4)


def test_paths_by_rows_and_cache_length():
    """Prefill chunks take the flash kernel, few rows over a long cache the split kernel, few rows over a short one
    XLA's path; a GDN implementation other than auto / pallas keeps XLA's attention."""
    long = A.SPLIT_MIN_CACHE
    assert qwen35.attention_path("pallas", A.FLASH_MIN_ROWS, 256) == "pallas"
    assert qwen35.attention_path("pallas", 8, 256) is None
    assert qwen35.attention_path("pallas", 8, long) == "pallas-split"
    assert qwen35.attention_path("reference", 1024, long) is None
    auto = qwen35.attention_path("auto", 8, long)
    assert auto == ("pallas-split" if jax.default_backend() == "gpu" else None)


def test_split_kernel_decode_steps_equal_xla(model):
    """Decode-shaped forwards (8 rows, 2 valid) over a cache of SPLIT_MIN_CACHE slots through the split kernel give
    XLA's logits (fp32 tolerance) and states, step after step."""
    cfg = model.config
    # jitted, as generate runs it (op by op, each of the forward's ops compiled on its own per shape and impl)
    forward = jax.jit(qwen35.forward, static_argnames=("cfg", "impl"))
    ids = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 30)), jnp.int32)
    state = qwen35.init_state(cfg, 1, A.SPLIT_MIN_CACHE, jnp.float32)
    _, state, _ = forward(model.params, cfg, state, ids, impl="reference")
    states = {"pallas": state, "reference": state}
    rows = jnp.asarray(np.random.default_rng(6).integers(0, cfg.vocab_size, (3, 1, 8)), jnp.int32)
    for step in range(3):
        logits = {}
        for impl in states:
            logits[impl], states[impl], _ = forward(model.params, cfg, states[impl], rows[step], impl=impl,
                                                    n_valid=jnp.asarray([2], jnp.int32))
        np.testing.assert_allclose(np.asarray(logits["pallas"]), np.asarray(logits["reference"]), rtol=1e-4,
                                   atol=1e-4)
    for a, b in zip(jax.tree.leaves(states["pallas"]), jax.tree.leaves(states["reference"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_a_cache_the_device_cannot_hold_is_one_error_before_any_compute(model, monkeypatch):
    """A device that reports its memory (the GPU) refuses a decode state that does not fit, naming the sizes, before
    anything runs; a prompt past the context is refused too."""
    from specdec_jax import memory
    from specdec_jax.errors import InputError
    monkeypatch.setattr(memory, "_stats", lambda: {"bytes_limit": 3 * memory.GIB, "bytes_in_use": 2 * memory.GIB})
    monkeypatch.setattr(qwen35, "forward", lambda *a, **k: pytest.fail("computed before refusing"))
    with pytest.raises(InputError, match=r"decode state of 1 row\(s\) over a cache of 256 positions needs .* GiB "
                                         r"free of 3\.00 GiB"):
        sj.generate(model, [[1, 2, 3]], 4)
    too_long = model.config.max_position_embeddings
    with pytest.raises(InputError, match="exceeds the model's context length"):
        sj.generate(model, [[1] * too_long], 4)
