"""The decode state a generation returns (`GenerateResult.state`), and what continuing from it needs.

A `Session` holds, per batch row, the model state over every token but the last (the *pending* token: generated, not
yet run through the model), that token, and the whole token history (prompts, new tokens, pending last) that n-gram
drafters search. `generate(model, new_ids, n, state=session)` prefills pending + new_ids from the model state and
generates on; the history makes a continued call see what a fresh call on the whole text would see. Immutable, like
every state here: continuing twice from one session gives the same bits twice.

A row whose model state ran past its last token (an AR batch row that met its EOS while other rows went on: the loop
steps every row) is marked not `resumable`; continuing re-prefills that row's history from an empty state.
Drafters' own states (an MTP head's cache, a self-draft's model state) are not kept: a continued call starts them on
the tokens it prefills, which changes how many drafts are accepted, never the output.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..errors import InputError


@struct.dataclass
class Session:
    model: Any  # the family's state (Qwen35State): every token but `pending`
    pending: jax.Array  # [B] int32
    history: np.ndarray = struct.field(pytree_node=False)  # [B, H] int32 (host): tokens, pending last
    hist_len: np.ndarray = struct.field(pytree_node=False)  # [B] int32
    resumable: np.ndarray = struct.field(pytree_node=False)  # [B] bool: the model state ends right before pending
    config: Any = struct.field(pytree_node=False)  # the model's config (a state belongs to one model)
    dtype: str = struct.field(pytree_node=False)

    @property
    def batch(self) -> int:
        return int(self.hist_len.shape[0])

    def tokens(self, row: int) -> np.ndarray:
        """Row `row`'s whole history (prompt(s) and generated tokens, the pending one last)."""
        return self.history[row, : int(self.hist_len[row])]


def make_session(model_state, pending, history: list[np.ndarray], resumable, config, dtype) -> Session:
    hist_len = np.asarray([len(h) for h in history], np.int32)
    buf = np.zeros((len(history), int(hist_len.max())), np.int32)
    for b, h in enumerate(history):
        buf[b, : len(h)] = h
    return Session(model=model_state, pending=jnp.asarray(pending, jnp.int32), history=buf, hist_len=hist_len,
                   resumable=np.asarray(resumable, bool), config=config, dtype=str(jnp.dtype(dtype)))


def check_session(session, model, batch: int) -> Session:
    """`session` may continue `model` with `batch` new prompts: one InputError naming what differs."""
    if not isinstance(session, Session):
        raise InputError(f"state must be the .state of an earlier generate() result (a Session); got "
                         f"{type(session).__name__}")
    if model.family != "qwen3_5":
        raise InputError("continuing from a state is supported for Qwen3.5 models only")
    if session.config != model.config:
        raise InputError("state comes from another model (its config differs from this model's)")
    if session.dtype != str(jnp.dtype(model.dtype)):
        raise InputError(f"state holds {session.dtype} values; this model runs in {jnp.dtype(model.dtype)}")
    if session.batch != batch:
        raise InputError(f"state has {session.batch} rows; got {batch} new prompts (one per row, [] for none)")
    return session


def continued_rows(session: Session, new: list[np.ndarray]) -> list[np.ndarray]:
    """Each row's whole token sequence: its history (pending last) and its new tokens."""
    return [np.concatenate([session.tokens(b), np.asarray(n, np.int32)]) for b, n in enumerate(new)]


def grown(model_state, max_len: int, resumable: np.ndarray):
    """The model state with caches of max_len slots (never shorter than they are) and the rows that are not
    resumable emptied (length 0, zero states), so a prefill of their whole history rebuilds them."""
    from ..models.qwen35.model import Qwen35State
    assert isinstance(model_state, Qwen35State)
    S = model_state.max_len
    pad = lambda x: jnp.pad(x, ((0, 0), (0, max(0, max_len - S))) + ((0, 0),) * (x.ndim - 2))
    state = model_state.replace(keys=tuple(map(pad, model_state.keys)), values=tuple(map(pad, model_state.values)))
    if resumable.all():
        return state
    keep = jnp.asarray(resumable)
    rows = lambda x, axis: jnp.where(keep.reshape((1,) * axis + (-1,) + (1,) * (x.ndim - axis - 1)), x,
                                     jnp.zeros_like(x))
    return state.replace(keys=tuple(rows(k, 0) for k in state.keys), values=tuple(rows(v, 0) for v in state.values),
                         conv=rows(state.conv, 1), recurrent=rows(state.recurrent, 1), length=rows(state.length, 0))
