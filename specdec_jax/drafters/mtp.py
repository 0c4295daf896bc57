"""MTP drafter: Qwen3.5's own multi-token-prediction head, chained to draft gamma tokens.

The head's entry at position t consumes (h_t, token t+1) and predicts token t+2 (models/qwen35/mtp_head.py).
The drafter keeps the head's KV cache in step with the target's committed length:

- init: entries for every prompt position (the prompt's target hiddens, the first new token
  closing the window); the last entry predicts the first draft. A continuation (`carry`) appends the
  prefilled positions' entries to the cache the head had after the earlier generation.
- propose: draft 1 comes from the stored prediction; drafts 2..gamma chain the head on its own
  output hidden state (the target's hidden there is not known yet), writing provisional entries
  past the committed length.
- update (after verification): re-run the head on the verifier's true hidden states of anchor +
  drafts with the emitted tokens, keep the first n_keep entries (length += n_keep): the
  provisional entries are overwritten or masked, like the target's own KV rollback.

Shortlist mode (`shortlist_size > 0`): drafts are chosen among a static list of frequent tokens
(params["draft"]["shortlist"], from the model's own generations) with a [N, D] head instead of the
full [vocab, D] one; verification keeps the output exact, since the target decides.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import decode_block

from ..decoding.sampling import SamplingConfig, probabilities, select_token, shortlist_choice
from ..errors import InputError
from ..models.qwen35 import mtp_head
from ..models.qwen35 import model as qwen35

KERNELS = ("auto", "xla", "blocks")
# "auto" runs the decode blocks on the GPU for heads up to this hidden size: there a draft is a chain of launches of
# ~1 us of work each, and seven launches beat XLA's ~30. Measured on the H200 at the shipped checkpoint (hidden 256):
# per chained forward 1.03-1.17x faster, end to end over 8 held-out prompts MTP gamma 3 1.59x -> 1.63x and gamma 4
# 1.54x -> 1.60x over AR, 8 of 8 outputs equal, at batch 1 (pallas_kernels/decode_block/README.md). Larger heads read their weights at memory speed, where these untuned
# products have not been measured against cuBLAS, and batches were not measured: XLA there.
AUTO_MAX_HIDDEN = 1024
# ... and for caches up to this many slots: per chained forward on the H200 (tiny checkpoint) the blocks took 28.2 /
# 32.3 / 37.8 µs at cache fills 200 / 400 / 1000 against XLA's 33.4 / 33.6 / 37.2, and at fill 3000 47.3 µs at best
# (4 splits) against XLA's 34.9: XLA's attention spreads a long cache over the whole GPU.
AUTO_MAX_CACHE = 1024


@dataclasses.dataclass(frozen=True)
class MtpDrafter:
    shortlist_size: int = 0
    # Drafts 2..gamma as straight-line code (True) or a lax.scan loop (False). XLA's GPU runtime runs a loop
    # nested in the decode loop's body from the host, one command buffer per iteration, splitting the step's
    # own command buffer around it; unrolled, the step stays one. Chosen on the H200, tiny checkpoint end to end:
    # gamma 3 1.42x -> 1.54x, gamma 4 1.33x -> 1.43x over AR (docs/LOG.md, 2026-12-02).
    unroll: bool = True
    # How the head runs its few-row forwards (each draft, and the update after verification): "xla" (the jnp
    # forward, ~30 launches), "blocks" (pallas_kernels/decode_block: seven launches; refused where
    # `mtp_head.blocks_supported` says no) or "auto" (blocks on the GPU at batch 1 for heads up to AUTO_MAX_HIDDEN
    # and caches up to AUTO_MAX_CACHE slots where supported, else xla). The prompt's forward always runs as xla.
    kernels: str = "auto"
    deterministic = False
    needs_hidden = True
    # What a continuation may start from (`init`'s carry): the head's cache and length, the same for every MTP
    # drafter (chain or tree, shortlist or not): the head and its inputs are the model's.
    carry_kind = "mtp"

    @property
    def name(self) -> str:
        return "mtp-shortlist" if self.shortlist_size else "mtp"

    # --------------------------------------------------------------------------------- helpers
    def _head_logits(self, params, hidden_out: jax.Array) -> jax.Array:
        """hidden_out [..., D] -> draft logits over the full vocabulary or the shortlist [..., N]."""
        head = qwen35.lm_head_weight(params)
        if self.shortlist_size:
            head = head[params["draft"]["shortlist"][: self.shortlist_size]]  # [N, D]
        return jnp.einsum("...d,vd->...v", hidden_out, head.astype(hidden_out.dtype),
                          preferred_element_type=jnp.float32)

    def _choose(self, params, logits: jax.Array, key, sampling: SamplingConfig):
        """(token ids, q over the full vocabulary or None when greedy) from head logits [B, N]."""
        if self.shortlist_size:
            return shortlist_choice(logits, params["draft"]["shortlist"][: self.shortlist_size],
                                    qwen35.lm_head_weight(params).shape[0], key, sampling)
        ids = select_token(logits, key, sampling).astype(jnp.int32)
        return ids, (None if sampling.greedy else probabilities(logits, sampling))

    def check(self, params, cfg) -> None:
        """One clear error, before any compute, for kernels the head cannot run."""
        if self.kernels not in KERNELS:
            raise InputError(f"kernels must be one of {list(KERNELS)}; got {self.kernels!r}")
        if self.kernels == "blocks" and not self._blocks_fit(params, cfg, 1):
            raise InputError("kernels='blocks': this MTP head does not fit the decode-block kernels (one device, a "
                             "dense MLP, a power-of-two head dim, sizes with power-of-two blocks >= 16); use "
                             "kernels='xla'")

    def _blocks_fit(self, params, cfg, rows: int, batch: int = 1) -> bool:
        return mtp_head.blocks_supported(params, cfg, rows, decode_block.CACHE_MULTIPLE, self.shortlist_size or None,
                                         batch)

    def _head(self, params):
        head = qwen35.lm_head_weight(params)
        return head[params["draft"]["shortlist"][: self.shortlist_size]] if self.shortlist_size else head  # [N, D]

    def _blocks_run(self, params, cfg, rows: int, batch: int, cache_len: int) -> bool:
        """Whether a forward of `rows` positions per row over a cache of cache_len slots runs as decode blocks."""
        chosen = self.kernels == "blocks" or (self.kernels == "auto" and jax.default_backend() == "gpu" and batch == 1
                                              and cfg.hidden_size <= AUTO_MAX_HIDDEN and cache_len <= AUTO_MAX_CACHE)
        return (chosen and cache_len % decode_block.CACHE_MULTIPLE == 0
                and self._blocks_fit(params, cfg, rows, batch))

    def _run(self, params, cfg, hidden, next_ids, k, v, positions):
        B, T = next_ids.shape
        if self._blocks_run(params, cfg, T, B, k.shape[1]):
            return mtp_head.mtp_forward_blocks(params, cfg, hidden, next_ids, k, v, positions,
                                               head=self._head(params))
        _, hout, k, v = mtp_head.mtp_forward(params, cfg, hidden[:, :T], next_ids, k, v, positions,
                                             compute_logits=False)
        return self._head_logits(params, hout), hout, k, v

    # ------------------------------------------------------------------------------- interface
    def init(self, params, cfg, prompt, max_len, *, hidden, first_token, lens=None, carry=None, **_):
        """lens [B]: each row's prompt length in a padded prompt buffer (None: every row holds T tokens). The rows
        past a row's length are run too (one forward for the batch); their K/V lie past its cache length, masked
        and later overwritten. carry: None, or the head's state after an earlier generation of these rows (a
        continuation): its cache holds entries for each row's first carry["length"] positions, and prompt row b the
        tokens the target prefilled from there (its pending token first); their entries continue that cache."""
        B, T = prompt.shape
        lens = jnp.full((B,), T, jnp.int32) if lens is None else lens
        # Slots past max_len: the decode blocks store a block of new rows from each start (`cached_attention`), and
        # read whole blocks of slots: the cache is rounded up to their multiple only where a draft's forward will run
        # as blocks (at a batch of 20,000 rows on the CPU the rounding made the cache 20x the slots it needed).
        # The prompt buffer may be longer than the cache (a batch past buckets.SMALL_BATCH rows has a cache of the
        # length it needs and a buffer of whole chunks): the head runs over the whole buffer, so it gets its slots.
        # A continuation writes its valid rows only (at most max_len positions in all), never shrinking the cache.
        slots = (max(max_len, T) if carry is None else max(max_len, carry["k"].shape[1] - decode_block.MAX_ROWS)
                 ) + decode_block.MAX_ROWS
        rounded = -(-slots // decode_block.CACHE_MULTIPLE) * decode_block.CACHE_MULTIPLE
        size = rounded if self._blocks_run(params, cfg, 1, B, rounded) else slots
        next_ids = jnp.concatenate([prompt[:, 1:], first_token[:, None]], axis=1)  # [B, T]
        next_ids = next_ids.at[jnp.arange(B), lens - 1].set(first_token)  # the first new token after each prompt
        last = (lens - 1)[:, None, None]
        if carry is None:
            k, v = mtp_head.init_mtp_cache(cfg, B, size, params["embed"].dtype)
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
            logits, hout, k, v = self._run(params, cfg, hidden, next_ids, k, v, positions)
            return {"k": k, "v": v, "length": lens.astype(jnp.int32),
                    "logits": jnp.take_along_axis(logits, last, axis=1)[:, 0],
                    "hidden": jnp.take_along_axis(hout, last, axis=1)}
        grow = lambda c: jnp.pad(c, ((0, 0), (0, max(0, size - c.shape[1])), (0, 0), (0, 0)))
        base = carry["length"]
        positions = base[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B, T]
        valid = jnp.arange(T)[None] < lens[:, None]
        _, hout, k, v = mtp_head.mtp_forward(params, cfg, hidden[:, :T], next_ids, grow(carry["k"]), grow(carry["v"]),
                                             positions, compute_logits=False, valid=valid)
        hidden_last = jnp.take_along_axis(hout, last, axis=1)  # [B, 1, D]
        return {"k": k, "v": v, "length": base + lens.astype(jnp.int32),
                "logits": self._head_logits(params, hidden_last[:, 0]), "hidden": hidden_last}

    @staticmethod
    def carried(state) -> dict:
        """The part of the state a continuation starts from (`init`'s carry)."""
        return {"k": state["k"], "v": state["v"], "length": state["length"]}

    def propose(self, params, cfg, state, history, hist_len, gamma: int, key, *, sampling=SamplingConfig(), **_):
        keys = jax.random.split(key, gamma)
        d1, q1 = self._choose(params, state["logits"], keys[0], sampling)

        def chain(carry, xs):
            token, hidden, k, v = carry
            i, step_key = xs
            pos = (state["length"] + i)[:, None]  # provisional entry past the committed length
            logits, hout, k, v = self._run(params, cfg, hidden, token[:, None], k, v, pos)
            nxt, q = self._choose(params, logits[:, 0], step_key, sampling)
            return (nxt, hout, k, v), (nxt, q)

        carry, xs = (d1, state["hidden"], state["k"], state["v"]), (jnp.arange(gamma - 1, dtype=jnp.int32), keys[1:])
        if self.unroll:  # straight-line code; a chained forward may hand on its padded hidden state (no slice)
            outs = []
            for i in range(gamma - 1):
                carry, out = chain(carry, (xs[0][i], xs[1][i]))
                outs.append(out)
            _, _, k, v = carry
            rest = [o[0] for o in outs]
            q_rest = [o[1] for o in outs]
        else:
            def chain_rows(carry, xs):  # a scan's carry keeps its shape
                (nxt, hout, k, v), out = chain(carry, xs)
                return (nxt, hout[:, :1], k, v), out
            (_, _, k, v), (rest, q_rest) = lax.scan(chain_rows, carry, xs)
            rest, q_rest = list(rest), (list(q_rest) if q_rest is not None else [])
        drafts = jnp.stack([d1] + list(rest), axis=1)  # [B, gamma]
        q = None if sampling.greedy else jnp.stack([q1] + list(q_rest), axis=1)
        return drafts, q, dict(state, k=k, v=v)

    def update(self, state, *, emitted, n_keep, verified, params, cfg, **_):
        B, G1 = emitted.shape
        positions = state["length"][:, None] + jnp.arange(G1, dtype=jnp.int32)[None]  # anchor + drafts
        logits, hout, k, v = self._run(params, cfg, verified["hidden"], emitted, state["k"], state["v"], positions)
        last = jnp.maximum(n_keep - 1, 0)
        pick = lambda x: jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, ...]
        moved = (n_keep > 0)[:, None]
        return {"k": k, "v": v, "length": state["length"] + n_keep,
                "logits": jnp.where(moved, pick(logits)[:, 0], state["logits"]),
                "hidden": jnp.where(moved[:, :, None], pick(hout), state["hidden"])}

