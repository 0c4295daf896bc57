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
    assert L._use_reduce(1, in_dim)
    got = L.linear(x, w)
    assert got.shape == want.shape == lead + (70,)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_reduce_form_only_for_single_rows_and_auto_rule(monkeypatch):
    monkeypatch.setenv("SPECDEC_MATVEC", "reduce")
    assert not L._use_reduce(2, 300)  # several rows: always the matrix product
    monkeypatch.setenv("SPECDEC_MATVEC", "auto")
    on_gpu = jax.default_backend() == "gpu"
    assert L._use_reduce(1, 5280) == on_gpu  # 5280 % 128 != 0
    assert not L._use_reduce(1, 4096)
    monkeypatch.setenv("SPECDEC_MATVEC", "fast")
    with pytest.raises(ValueError, match="SPECDEC_MATVEC"):
        L.matvec_mode()
