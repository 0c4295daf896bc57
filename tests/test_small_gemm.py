"""The few-row float32 product: the Pallas kernel (interpret mode on CPU) against the reference, its size checks,
and when `layers.linear` hands a product to it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import small_gemm as sg
from specdec_jax.models import layers as L


def _operands(m, n, k, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(kx, (m, k), jnp.float32), jax.random.normal(kw, (n, k), jnp.float32) * k ** -0.5


@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (9, 192, 256), (16, 128, 384), (8, 64, 512)])
def test_kernel_matches_reference(m, n, k):
    x, w = _operands(m, n, k, seed=m)
    got = np.asarray(sg.small_gemm(x, w, interpret=True))
    want = np.asarray(sg.reference(x, w))
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_rows_do_not_see_each_other():
    """A row's result does not depend on the other rows (the exact path pads decode forwards with rows)."""
    x, w = _operands(9, 128, 256)
    full = np.asarray(sg.small_gemm(x, w, interpret=True))
    other = x.at[1:].set(jax.random.normal(jax.random.PRNGKey(7), (8, 256)))
    np.testing.assert_array_equal(np.asarray(sg.small_gemm(other, w, interpret=True))[0], full[0])


def test_sizes_and_dtypes_are_checked():
    assert sg.supports(16, 128, 256) and not sg.supports(17, 128, 256)
    assert not sg.supports(4, 100, 256) and not sg.supports(4, 128, 200)
    x, w = _operands(4, 64, 128)
    with pytest.raises(ValueError, match="float32"):
        sg.small_gemm(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="multiple of"):
        sg.small_gemm(x, w[:60], interpret=True)
    with pytest.raises(ValueError, match="disagree on K"):
        sg.small_gemm(x, w[:, :64], interpret=True)


@pytest.fixture
def on_gpu(monkeypatch):
    """`linear` as it decides on a GPU, the kernel run in interpret mode; records the products it took."""
    calls, original = [], sg.small_gemm

    def kernel(x, w):
        calls.append(x.shape)
        return original(x, w, interpret=True)

    monkeypatch.setattr(L.small_gemm, "small_gemm", kernel)
    monkeypatch.setattr(L.jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("SPECDEC_MATVEC", raising=False)
    return calls


def test_linear_routes_few_row_full_precision_products(on_gpu, monkeypatch):
    x, w = _operands(9, 128, 256)
    x3 = x.reshape(1, 9, 256)
    with jax.default_matmul_precision("highest"):
        y = L.linear(x3, w)
        assert on_gpu == [(9, 256)]
        np.testing.assert_allclose(np.asarray(y)[0], np.asarray(sg.reference(x, w)), rtol=1e-5, atol=1e-5)
        L.linear(x[:1].reshape(1, 1, 256), w)  # one row: XLA's product (measured near the roofline)
        L.linear(jnp.concatenate([x, x]).reshape(1, 18, 256), w)  # more rows than the kernel takes
        L.linear(x3.astype(jnp.bfloat16), w.astype(jnp.bfloat16))  # 16-bit: tensor cores
        L.linear(x3, w[:100])  # N not a multiple of the block
        monkeypatch.setenv("SPECDEC_MATVEC", "dot")  # the XLA baseline, for A/B runs
        L.linear(x3, w)
    L.linear(x3, w)  # default precision (TF32 on the GPU): not this kernel
    assert on_gpu == [(9, 256)]
