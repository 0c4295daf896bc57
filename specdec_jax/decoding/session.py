"""The decode state a generation returns (`GenerateResult.state`), and what continuing from it needs.

A `Session` holds, per batch row, the model state over every token but the last (the *pending* token: generated, not
yet run through the model), that token, and the whole token history (prompts, new tokens, pending last) that n-gram
drafters search. `generate(model, new_ids, n, state=session)` prefills pending + new_ids from the model state and
generates on; the history makes a continued call see what a fresh call on the whole text would see. Immutable, like
every state here: continuing twice from one session gives the same bits twice.

A row whose model state ran past its last token (an AR batch row that met its EOS while other rows went on: the loop
steps every row) is marked not `resumable`; continuing re-prefills that row's history from an empty state. A looped
model's state is its KV cache alone, so its rows are always resumable: the cache's length is set back to the row's
history (`looped_session`), and what lies past it is masked and later overwritten. `settings` names what a looped
cache was made at (depth, cache mode); a continuation runs at the same.
A speculative generation's drafter state (an MTP head's cache, a self-draft's model state: the drafter's `carried`
part) is kept too, under the drafter's `carry_kind`: a continued call whose drafter has that kind continues it over
the tokens it prefills, as if the drafter had run the whole history; another drafter starts its own on those tokens
(fewer drafts accepted at first, the same output).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..errors import InputError
from ..results import GenerateResult
from .autoregressive import ARState, generated_counts


@struct.dataclass
class Session:
    model: Any  # the family's state (Qwen35State): every token but `pending`
    pending: jax.Array  # [B] int32
    history: np.ndarray = struct.field(pytree_node=False)  # [B, H] int32 (host): tokens, pending last
    hist_len: np.ndarray = struct.field(pytree_node=False)  # [B] int32
    resumable: np.ndarray = struct.field(pytree_node=False)  # [B] bool: the model state ends right before pending
    config: Any = struct.field(pytree_node=False)  # the model's config (a state belongs to one model)
    dtype: str = struct.field(pytree_node=False)
    settings: tuple = struct.field(pytree_node=False, default=())  # looped: (("num_steps", R), ("cache_mode", m))
    drafter: Any = None  # the drafter's carried state after a speculative generation (None: none kept)
    drafter_kind: str | None = struct.field(pytree_node=False, default=None)  # the drafter's carry_kind

    @property
    def batch(self) -> int:
        return int(self.hist_len.shape[0])

    def tokens(self, row: int) -> np.ndarray:
        """Row `row`'s whole history (prompt(s) and generated tokens, the pending one last)."""
        return self.history[row, : int(self.hist_len[row])]


def make_session(model_state, pending, history: list[np.ndarray], resumable, config, dtype,
                 settings: tuple = (), drafter_state=None) -> Session:
    """drafter_state: None, or (carry_kind, carried state) of the generation's drafter (`run_spec_loop`)."""
    hist_len = np.asarray([len(h) for h in history], np.int32)
    buf = np.zeros((len(history), int(hist_len.max())), np.int32)
    for b, h in enumerate(history):
        buf[b, : len(h)] = h
    kind, drafter = drafter_state or (None, None)
    return Session(model=model_state, pending=jnp.asarray(pending, jnp.int32), history=buf, hist_len=hist_len,
                   resumable=np.asarray(resumable, bool), config=config, dtype=str(jnp.dtype(dtype)),
                   settings=tuple(settings), drafter=drafter, drafter_kind=kind)


def drafter_carry(session: Session | None, drafter):
    """The drafter state a continuation of `session` starts `drafter` from: the session's, where it was kept for a
    drafter of this one's carry_kind and every row's model state ends right before its pending token (else None:
    the drafter starts on the tokens the continuation prefills)."""
    kind = getattr(drafter, "carry_kind", None)
    if session is None or kind is None or session.drafter_kind != kind or not session.resumable.all():
        return None
    return session.drafter


def looped_session(cache, prompts: list[np.ndarray], tokens: np.ndarray, counts: np.ndarray, config, dtype,
                   settings: tuple) -> Session:
    """A looped generation's Session: row b ran prompts[b] and generated tokens[b, :counts[b]] (its last pending);
    the cache (every token but the pending one at full depth, and maybe more) is cut back to that history."""
    from ..models.looped.cache import LoopedCache
    assert isinstance(cache, LoopedCache)
    history = [np.concatenate([p, tokens[b, : counts[b]]]).astype(np.int32) for b, p in enumerate(prompts)]
    pending = [int(tokens[b, counts[b] - 1]) for b in range(len(prompts))]
    cache = cache.replace(length=jnp.asarray([len(h) - 1 for h in history], jnp.int32))
    return make_session(cache, pending, history, np.ones(len(prompts), bool), config, dtype, settings)


def check_session(session, model, batch: int) -> Session:
    """`session` may continue `model` with `batch` new prompts: one InputError naming what differs."""
    if not isinstance(session, Session):
        raise InputError(f"state must be the .state of an earlier generate() result (a Session); got "
                         f"{type(session).__name__}")
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
    from ..models.looped.cache import LoopedCache, grown_cache
    from ..models.qwen35.model import Qwen35State, grow_state
    if isinstance(model_state, LoopedCache):  # always resumable: its length is the history but the pending token
        return grown_cache(model_state, max_len)
    assert isinstance(model_state, Qwen35State)
    state = grow_state(model_state, max_len)
    if resumable.all():
        return state
    keep = jnp.asarray(resumable)
    rows = lambda x, axis: jnp.where(keep.reshape((1,) * axis + (-1,) + (1,) * (x.ndim - axis - 1)), x,
                                     jnp.zeros_like(x))
    return state.replace(keys=tuple(rows(k, 0) for k in state.keys), values=tuple(rows(v, 0) for v in state.values),
                         conv=rows(state.conv, 1), recurrent=rows(state.recurrent, 1), length=rows(state.length, 0))


# ------------------------------------------------------------------------- a generation's result -> Session

def with_session(result: GenerateResult, model, prompts: list, eos_ids: tuple) -> GenerateResult:
    """The result with its decode state as a `Session` (what `generate(state=...)` continues): from an AR loop's
    state (each row's pending token is its last generated one; rows that met their EOS before the loop ended ran on
    and are not resumable) or a speculative loop's (the anchor is pending; finished rows' states stood still)."""
    raw = result.state
    if isinstance(raw, ARState):
        counts = generated_counts(result.tokens, raw.tokens_run, eos_ids)
        pending = [int(result.tokens[b, counts[b] - 1]) for b in range(len(prompts))]
        history = [np.concatenate([p, result.tokens[b, : counts[b]]]) for b, p in enumerate(prompts)]
        resumable = counts == raw.tokens_run
        model_state = raw.model
    else:  # SpecState
        hist, hist_len = np.asarray(raw.history), np.asarray(raw.hist_len)
        history = [hist[b, : hist_len[b]] for b in range(len(prompts))]
        pending, resumable, model_state = raw.anchor, np.ones(len(prompts), bool), raw.model
    result.state = make_session(model_state, pending, history, resumable, model.config, model.dtype,
                                drafter_state=result.drafter_state)
    result.drafter_state = None
    return result


def with_looped_session(result: GenerateResult, model, prompts: list, eos_ids: tuple,
                         settings: tuple) -> GenerateResult:
    """A looped generation's result with its cache as a `Session` (none from the parallel sampler, whose cache is
    not the target's at every depth)."""
    raw = result.state
    if raw is None:
        return result
    cache, steps = (raw.model, raw.tokens_run) if isinstance(raw, ARState) else (raw, result.tokens.shape[1])
    counts = generated_counts(result.tokens, steps, eos_ids)
    result.state = looped_session(cache, prompts, result.tokens, counts, model.config, model.dtype, settings)
    return result
