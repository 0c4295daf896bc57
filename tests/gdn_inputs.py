"""Random gated-delta inputs and the relative error, shared by test_gated_delta.py and test_tree_wy.py.

Built from a few compiled programs rather than op by op: run eagerly, every jnp op compiles once per input
shape, and over the ~80 input shapes of the two files that compiling was most of their time on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gated_delta import reference

# Every draw is made at this one length and cut to its shape: with jax's (default) partitionable threefry, element
# i of a draw depends only on the key and i, so the cut is exactly the draw made at that shape, and the random
# programs compile once instead of once per shape. The largest input here is 65536 elements (an s0 of
# 2 x 8 x 128 x 32); the assert below names a larger one.
_FLAT = 1 << 16


@functools.partial(jax.jit, static_argnums=1)
def _draws(key, strong: float):
    ks = jax.random.split(key, 8)
    n = (_FLAT,)
    return (jax.random.normal(ks[0], n), jax.random.normal(ks[1], n), jax.random.normal(ks[2], n),
            jax.random.bernoulli(ks[3], strong, n), jax.random.uniform(ks[4], n, minval=-20.0, maxval=-1.0),
            jax.random.uniform(ks[5], n, minval=-0.5, maxval=0.0), jax.random.normal(ks[6], n),
            jax.random.normal(ks[7], n))


@functools.partial(jax.jit, static_argnames=("dtype", "normalize_k"))
def _finish(q, k, v, is_strong, g_strong, g_mild, beta, s0, *, dtype, normalize_k):
    if normalize_k:  # without in-kernel normalisation the recurrence needs |k| ~ 1 to stay bounded
        k = reference.l2_normalize(k)
    g = jnp.where(is_strong, g_strong, g_mild)
    return dict(q=q.astype(dtype), k=k.astype(dtype), v=v.astype(dtype), g=g, beta=jax.nn.sigmoid(beta),
                s0=0.5 * s0)


def make_inputs(b, t, h, hv, k_dim, v_dim, dtype=jnp.float32, seed=0, normalize_k=True, strong=0.1):
    """Random inputs; gates mostly mild, a fraction `strong` of them down to -20."""
    shapes = ((b, t, h, k_dim), (b, t, h, k_dim), (b, t, hv, v_dim)) + ((b, t, hv),) * 4 + ((b, hv, k_dim, v_dim),)
    assert max(int(np.prod(s)) for s in shapes) <= _FLAT, f"an input of more than {_FLAT} elements: raise _FLAT"
    flat = _draws(jax.random.PRNGKey(seed), strong)
    parts = [np.asarray(x)[:int(np.prod(s))].reshape(s) for x, s in zip(flat, shapes)]
    return _finish(*parts, dtype=dtype, normalize_k=normalize_k)


def rel_err(a, b) -> float:
    a = np.asarray(a).astype(np.float64)  # bfloat16 (ml_dtypes) and float32 widen exactly
    b = np.asarray(b).astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
