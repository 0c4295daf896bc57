"""layers.linear: the single-row reduction form equals the matrix product; the mode switch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.models import layers as L


@pytest.mark.parametrize("in_dim", [5280, 300, 256])
@pytest.mark.parametrize("lead", [(1,), (1, 1)])
def test_reduce_form_equals_dot(monkeypatch, in_dim, lead):
    x = jax.random.normal(jax.random.PRNGKey(0), lead + (in_dim,), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (70, in_dim), jnp.float32)
    monkeypatch.setenv("SPECDEC_MATVEC", "dot")
    want = L.linear(x, w)
    monkeypatch.setenv("SPECDEC_MATVEC", "reduce")
    assert L.product_form(1, in_dim, x.dtype) == "reduce"
    got = L.linear(x, w)
    assert got.shape == want.shape == lead + (70,)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_product_form_rule(monkeypatch):
    f32, bf16 = jnp.float32, jnp.bfloat16
    monkeypatch.setenv("SPECDEC_MATVEC", "reduce")
    assert L.product_form(2, 300, f32) == "dot"  # several rows: never the reduction
    monkeypatch.setenv("SPECDEC_MATVEC", "auto")
    if jax.default_backend() != "gpu":
        assert L.product_form(1, 5280, f32) == "dot"
        with jax.default_matmul_precision("highest"):
            assert L.product_form(9, 4096, f32) == "dot"  # TF32x3 is a GPU algorithm
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert L.product_form(1, 5280, bf16) == "reduce"  # 5280 % 128 != 0
    assert L.product_form(1, 4096, bf16) == "dot"
    assert L.product_form(9, 4096, f32) == "dot"  # float32 at the default precision: XLA's choice
    with jax.default_matmul_precision("highest"):
        assert L.highest_matmul_precision()
        assert L.product_form(9, 4096, f32) == L.product_form(2, 4096, f32) == "tf32x3"
        assert L.product_form(L.MAX_FEW_ROWS, 4096, f32) == "tf32x3"
        assert L.product_form(L.MAX_FEW_ROWS + 1, 4096, f32) == "dot"  # prefill-sized: the GEMM
        assert L.product_form(9, 4096, bf16) == "dot" and L.product_form(1, 4096, f32) == "dot"
        monkeypatch.setenv("SPECDEC_MATVEC", "dot")
        assert L.product_form(9, 4096, f32) == "dot"
    monkeypatch.setenv("SPECDEC_MATVEC", "fast")
    with pytest.raises(ValueError, match="SPECDEC_MATVEC"):
        L.matvec_mode()
