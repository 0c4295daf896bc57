"""A Gated DeltaNet layer's step inputs as the layer produces them (the packed form of the recurrent op): where q, k, v
lie in its conv output and b, a in its input projection's output (`PackedLayout`), the conv and gates the model
computes (`short_conv_silu`, `gate_values`), and the ground truth that takes them apart (`packed_inputs`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._kernel_utils import F32, l2norm_vec


class PackedLayout(NamedTuple):
    """Where a Gated DeltaNet layer's step inputs lie as the layer produces them (the packed form of the recurrent op,
    `packed_inputs`): channels of the conv output in the order q | k | v (q, k: `key_heads` heads of `key_dim`; v:
    `value_heads` heads of `value_dim`), and the raw gate inputs b (for beta) and a (for g) of value head h at columns
    `b_column + h` and `a_column + h` of the gate array (e.g. the fused input projection's output)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    b_column: int
    a_column: int

    @property
    def channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def short_conv_silu(window: jax.Array, weight: jax.Array, t: int) -> jax.Array:
    """The causal depthwise conv and SiLU of a Gated DeltaNet layer: window [B, W-1+R, C] (the W-1 previous
    pre-conv rows, then R >= t new ones), weight [C, W] -> the first t rows [B, t, C] in the window's dtype.
    The products are summed in float32 in tap order and rounded to the window's dtype before the SiLU (as
    transformers' conv runs in the activations' dtype)."""
    w = weight.astype(jnp.float32)
    conv = sum(window[:, i:i + t].astype(jnp.float32) * w[:, i] for i in range(weight.shape[1]))
    return jax.nn.silu(conv.astype(window.dtype))


def gate_values(b: jax.Array, a: jax.Array, a_log: jax.Array, dt_bias: jax.Array):
    """(beta, g) of a Gated DeltaNet layer: beta = sigmoid(b) in b's dtype, g = -exp(A_log) * softplus(a + dt_bias)
    in float32; b, a [..., HV], a_log, dt_bias [HV]."""
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return jax.nn.sigmoid(b), g


def check_packed_inputs(conv, gates, a_log, dt_bias, layout: PackedLayout, n_steps: int) -> tuple[int, int]:
    """The packed form's inputs (see `packed_inputs`); returns (B, R). Raises ValueError naming the bad one."""
    if not isinstance(layout, PackedLayout):
        raise ValueError(f"gated_delta: layout must be a PackedLayout; got {type(layout).__name__}")
    c, hv = layout.channels, layout.value_heads
    if conv.ndim != 3 or conv.shape[2] != c:
        raise ValueError(f"gated_delta: conv must be [B, R, C={c}] (C = 2 * key_heads * key_dim + value_heads * "
                         f"value_dim); got {tuple(conv.shape)}")
    b, r = conv.shape[:2]
    if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or not 1 <= n_steps <= r:
        raise ValueError(f"gated_delta: n_steps must be an int in [1, R={r}] (the rows of conv); got {n_steps!r}")
    if layout.key_heads < 1 or hv % layout.key_heads:
        raise ValueError(f"gated_delta: value_heads={hv} must be a multiple of key_heads={layout.key_heads}")
    if gates.ndim != 3 or gates.shape[:2] != (b, r):
        raise ValueError(f"gated_delta: gates must be [B={b}, R={r}, columns]; got {tuple(gates.shape)}")
    for name, col in (("b_column", layout.b_column), ("a_column", layout.a_column)):
        if not 0 <= col <= gates.shape[2] - hv:
            raise ValueError(f"gated_delta: layout.{name}={col} puts {hv} gate columns outside the gates' "
                             f"{gates.shape[2]}")
    for name, x in (("a_log", a_log), ("dt_bias", dt_bias)):
        if tuple(x.shape) != (hv,):
            raise ValueError(f"gated_delta: {name} must be [HV={hv}]; got {tuple(x.shape)}")
    return b, r


def packed_inputs(conv, gates, a_log, dt_bias, layout: PackedLayout, n_steps: int):
    """The recurrent op's inputs (q, k [B, n_steps, H, K]; v [B, n_steps, HV, V]; g, beta [B, n_steps, HV]) from a
    layer's conv output conv [B, R, C], gate array [B, R, columns], A_log and dt_bias [HV] (`layout` says where each
    lies): the packed form's ground truth."""
    b, _ = check_packed_inputs(conv, gates, a_log, dt_bias, layout, n_steps)
    hk, hv = layout.key_heads * layout.key_dim, layout.value_heads
    conv = conv[:, :n_steps]
    q = conv[..., :hk].reshape(b, n_steps, layout.key_heads, layout.key_dim)
    k = conv[..., hk:2 * hk].reshape(b, n_steps, layout.key_heads, layout.key_dim)
    v = conv[..., 2 * hk:].reshape(b, n_steps, hv, layout.value_dim)
    beta, g = gate_values(gates[:, :n_steps, layout.b_column:layout.b_column + hv],
                          gates[:, :n_steps, layout.a_column:layout.a_column + hv], a_log, dt_bias)
    return q, k, v, g, beta


def packed_loader(refs, head, l2norm: bool):
    """A recurrent-kernel program's step inputs in the packed form, as (fetch, prepare): fetch(t) issues position t's
    loads (q, k, v as the conv output holds them; the raw gate inputs a and b); prepare(raw) forms the step inputs
    (q, k, g, v, beta, (k, g) to stash), with beta = logistic(b) rounded to b's dtype and g = -exp(A_log) *
    softplus(a + dt_bias) in float32, computed as the model's XLA ops compute them (`gate_values`). No product feeds a
    sum in the gates, so no contraction into a fused multiply-add can make a kernel of one length compute them
    otherwise than one of another (the decode step and a verification). Two halves so that a kernel can issue every
    position's loads before it forms any inputs. refs: the program's q, k, v, b, a, A_log, dt_bias refs; `head`: its
    value head (read outside any loop body)."""
    q_ref, k_ref, v_ref, b_ref, a_ref, alog_ref, dtb_ref = refs
    neg_decay = -jnp.exp(alog_ref[head].astype(F32))
    dt_bias = dtb_ref[head].astype(F32)

    def fetch(t):
        return q_ref[t, :], k_ref[t, :], v_ref[t, :], b_ref[t], a_ref[t]

    def prepare(raw):
        q, k, v, b, a = raw
        q, k = q.astype(F32), k.astype(F32)
        if l2norm:
            q, k = l2norm_vec(q), l2norm_vec(k)
        x = a.astype(F32) + dt_bias
        g = neg_decay * (jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x))))  # softplus, as jax.nn.softplus
        beta = (1.0 / (1.0 + jnp.exp(-b.astype(F32)))).astype(b.dtype).astype(F32)
        return q, k, g, v.astype(F32), beta, (k, g)

    return fetch, prepare
