"""layers.linear: the single-row reduction form equals the matrix product; the mode switch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.models import layers as L


@pytest.mark.parametrize("in_dim", [5280, 300, 256])
@pytest.mark.parametrize("lead", [(1,), (1, 1), (9,), (2, 8)])
def test_reduce_form_equals_dot(monkeypatch, in_dim, lead):
    x = jax.random.normal(jax.random.PRNGKey(0), lead + (in_dim,), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (70, in_dim), jnp.float32)
    monkeypatch.setenv("SPECDEC_MATVEC", "dot")
    want = L.linear(x, w)
    monkeypatch.setenv("SPECDEC_MATVEC", "reduce")
    assert L._use_reduce(int(np.prod(lead)), in_dim, x.dtype)
    got = L.linear(x, w)
    assert got.shape == want.shape == lead + (70,)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_reduce_form_rows_and_auto_rule(monkeypatch):
    f32, bf16 = jnp.float32, jnp.bfloat16
    monkeypatch.setenv("SPECDEC_MATVEC", "reduce")
    assert L._use_reduce(L.MAX_REDUCE_ROWS, 300, bf16)
    assert not L._use_reduce(L.MAX_REDUCE_ROWS + 1, 300, f32)  # prefill-sized products: always the matrix product
    monkeypatch.setenv("SPECDEC_MATVEC", "auto")
    assert not L._use_reduce(1, 5280, f32) or jax.default_backend() == "gpu"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert L._use_reduce(1, 5280, bf16)  # 5280 % 128 != 0
    assert not L._use_reduce(1, 4096, bf16)
    assert not L._use_reduce(9, 4096, f32)  # float32 at the default precision: the GEMM
    with jax.default_matmul_precision("highest"):
        assert L.highest_matmul_precision()
        assert L._use_reduce(9, 4096, f32) and L._use_reduce(2, 4096, f32)
        assert not L._use_reduce(9, 4096, bf16) and not L._use_reduce(17, 4096, f32)
        assert not L._use_reduce(1, 4096, f32)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with jax.default_matmul_precision("highest"):
        assert not L._use_reduce(9, 4096, f32)
    monkeypatch.setenv("SPECDEC_MATVEC", "fast")
    with pytest.raises(ValueError, match="SPECDEC_MATVEC"):
        L.matvec_mode()
