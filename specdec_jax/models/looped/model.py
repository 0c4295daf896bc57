"""Looped (recurrent-depth) models in functional JAX: Huginn-0125 and the Raven retrofits.

Official code: seal-rg/recurrent-pretraining `recpre/raven_modeling_minimal.py` (Huginn) and
retrofitting-recurrence `raven_modeling_minimal_llama.py` / `raven_modeling_minimal_olmo.py`.
All three share one skeleton (D = n_embd, r = num_steps):

    e   = prelude(wte(ids) * embed_scale)                    # [B, T, D]
    x_0 = initial state (zeros by default; see `initial_state`)
    x_s = core_block(adapter(concat[x_{s-1}, e]))            # s = 1..r, shared weights
    lat = ln_f(x_r)  (Huginn only: its iterate_forward ends in ln_f; the retrofits return x_r as is)
    logits = lm_head(ln_f(coda(lat)))                         # float32

Variants (told apart by the weights; `detect_variant`):
    huginn       SandwichBlock  x = n2(attn(n1 x) + x); x = n4(mlp(n3 x) + x); qk_bias; RoPE on
                 interleaved pairs (base `rope_base`); embed_scale sqrt(D); tied head.
    raven_llama  pre-norm       x += attn(n1 x); x += mlp(n2 x); GQA; rotate-half RoPE with
                 `rope_theta` and llama3 `rope_scaling`; embed_scale from init_values (1.0).
    raven_olmo2  post-norm      x += n1(attn(x)); x += n2(mlp(x)); RMSNorm on the whole q and k
                 projections (q_norm over H*hd, k_norm over NKV*hd) before RoPE; head_dim from config.

KV cache (`LoopedCache`) is depth-indexed like the official "full" lookup: one slot per prelude
layer, per (recurrence step, core layer) and per coda layer. The attention of core layer j at step
s reads the verified prefix from step slot `read_step_k[s]` (K) and `read_step_v[s]` (V) -- by
default s itself -- and its new K/V are written to slot s. Compressed mode keeps one slot per core
layer ("latest recurrence wins"): the prefix is always read at the last depth it was computed at.

This module owns the three stages and the forwards: `prelude`, `core_step` (one recurrence step),
`coda_head`, `forward` (any depth, read schedules, early exits), the exact path's `decode_forward`,
`forward_jit` and `forward_logits`.
The rest lives beside it and is re-exported here: weights and loading in `params`, the cache
in `cache`, the layer math (norm, RoPE, attention, blocks, embedding, initial state, adapter)
in `blocks`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...errors import InputError
from .config import (INITIAL_STATE_MODES, VARIANTS, LoopedConfig, looped_config_from_dict,  # noqa: F401
                             parse_eos_ids, settle_variant, validate_config)
from ...options import validate_input_ids
from .. import layers as L
from .cache import (CACHE_MODES, LoopedCache, cache_bytes, cache_lengths, cache_positions,  # noqa: F401
                    check_cache_mode, grown_cache, init_cache, scatter_tokens, write_layer, write_tokens)
from .blocks import (apply_block, apply_rope, attend_prefix, block_attention, block_mlp,  # noqa: F401
                            block_norm, embed, initial_state, inject, rope_tables, run_blocks)
from .params import (detect_variant, expected_shapes, init_random_params, load_looped,  # noqa: F401
                            load_looped_params, official_tensors, param_path)


# ---------------------------------------------------------------------------------- stages

# How many recurrence steps one iteration of the depth loop (a lax.scan) runs. On the GPU, XLA runs a loop nested
# in a decode loop from the host, one command buffer per iteration, so the rolled recurrence pays a host round trip
# per step; unrolled, a step has none, but every program holds num_steps copies of the core block. Measured on the
# H200 (tiny Huginn, r = 16, exact path, 8 prompts; docs/LOG.md, 2026-12-02): AR 1073 / 1080 / 1091 / 1094 tok/s at
# unroll 1 / 4 / 8 / full, the looped methods within run-to-run spread (das-wave 3.16x / 3.14x / 3.07x / 3.04x), while
# full unrolling doubled compile time (AR 10 -> 24 s, methods 19 -> 34 s). The round trips are not where a looped
# step's time goes: the loop stays rolled. An integer >= 1 or "full" (tests compare the forms).
RECURRENCE_UNROLL: int | str = 1


def recurrence_unroll(num_steps: int) -> int:
    """The depth loop's unroll for a recurrence of num_steps: RECURRENCE_UNROLL ("full", or an integer >= 1), read
    when a forward is traced; at most num_steps."""
    value = str(RECURRENCE_UNROLL)
    if value == "full":
        return max(num_steps, 1)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"RECURRENCE_UNROLL must be 'full' or an integer >= 1; got {value!r}")
    return max(min(int(value), num_steps), 1)


def prelude(params: dict, cfg: LoopedConfig, cache: LoopedCache | None, input_ids: jax.Array, cos: jax.Array,
            sin: jax.Array):
    """Embedding and prelude layers of input_ids [B, T] after the cache's committed prefix (None: no prefix).

    cos/sin from `rope_tables` at the new tokens' positions. The cache is only read. Returns (embedded
    [B, T, D]: what every recurrence step injects, k, v [P, B, T, NKV, hd]: the prelude layers' new K/V).
    """
    e = embed(params, cfg, input_ids)
    pk = None if cache is None else cache.prelude_k
    pv = None if cache is None else cache.prelude_v
    return run_blocks(params.get("prelude", []), cfg, e, cos, sin, pk, pv, cache_lengths(cache, input_ids.shape[0]))


def core_step(params: dict, cfg: LoopedConfig, cache: LoopedCache | None, x: jax.Array, embedded: jax.Array,
              step, cos: jax.Array, sin: jax.Array, read_k=None, read_v=None):
    """One core-block application: adapter(concat[x, embedded]) then the core layers.

    x, embedded [B, T, D]; step: recurrence index (int or traced); cos/sin from `rope_tables`;
    read_k / read_v: cache step slots the prefix K and V are read from (default `step`; always 0 in
    compressed mode). The cache is only read. Returns (x [B, T, D], k, v [L, B, T, NKV, hd]) -- the
    new tokens' K/V, to be written into slot `step` by the caller.
    """
    if cache is not None and cache.mode == "compressed":
        read_k = read_v = 0
    read_k = step if read_k is None else read_k
    read_v = step if read_v is None else read_v
    h = inject(params, cfg, x, embedded, jnp.asarray(step) == 0)
    length = cache_lengths(cache, x.shape[0])
    ks, vs = [], []
    for j, lp in enumerate(params["core_block"]):
        prefix = None if cache is None else (cache.core_k[read_k, j], cache.core_v[read_v, j])
        h, k, v = apply_block(lp, cfg, h, cos, sin, prefix, length)
        ks.append(k)
        vs.append(v)
    return h, jnp.stack(ks), jnp.stack(vs)


def _read_schedule(spec, num_steps: int, slots: int | None, name: str) -> jax.Array:
    """Per-step slot indices [num_steps] int32 from None (aligned), a scalar, or a [num_steps] array."""
    if spec is None:
        return jnp.arange(num_steps, dtype=jnp.int32)
    if isinstance(spec, (int, np.integer)) or (isinstance(spec, (np.ndarray, list, tuple))):
        values = np.atleast_1d(np.asarray(spec))
        if values.ndim != 1 or values.shape[0] not in (1, num_steps):
            raise InputError(f"{name} must be a scalar or have shape [{num_steps}]; got shape {values.shape}")
        if slots is not None and ((values < 0) | (values >= slots)).any():
            raise InputError(f"{name}={values.tolist()} is outside the cache's step slots [0, {slots})")
    spec = jnp.asarray(spec, jnp.int32)
    if spec.ndim > 1 or (spec.ndim == 1 and spec.shape[0] != num_steps):
        raise InputError(f"{name} must be a scalar or have shape [{num_steps}]; got shape {spec.shape}")
    return jnp.broadcast_to(spec, (num_steps,))


def _recur(params, cfg, cache, x, embedded, cos, sin, read_k, read_v, num_steps: int, depths: tuple[int, ...]):
    """x after each depth in `depths` (sorted, last = num_steps) and K/V of every step [R, L, B, T, NKV, hd].

    One lax.scan per segment between requested depths (unrolled by `recurrence_unroll`), and
    intermediate states come out of the same pass that continues to num_steps.
    """
    states, ks, vs = {}, [], []
    start = 0
    for stop in depths:
        def body(x, xs):
            step, rk, rv = xs
            x, k, v = core_step(params, cfg, cache, x, embedded, step, cos, sin, rk, rv)
            return x, (k, v)

        xs = (jnp.arange(start, stop, dtype=jnp.int32), read_k[start:stop], read_v[start:stop])
        x, (k, v) = lax.scan(body, x, xs, unroll=recurrence_unroll(stop - start))
        states[stop] = x
        ks.append(k)
        vs.append(v)
        start = stop
    return states, jnp.concatenate(ks), jnp.concatenate(vs)


def coda_head(params, cfg, cache, x, cos, sin, logits_for: str, last_index=None):
    """Latent after the recurrence -> (logits float32, latent, coda K/V [C, B, T, NKV, hd]). logits_for "last": the
    logits of row last_index[b] of each sequence (None: the last row) [B, 1, V]."""
    latent = block_norm(cfg, x, params["ln_f"]) if cfg.variant == "huginn" else x
    length = cache_lengths(cache, x.shape[0])
    ck = None if cache is None else cache.coda_k
    cv = None if cache is None else cache.coda_v
    h, k, v = run_blocks(params.get("coda", []), cfg, latent, cos, sin, ck, cv, length)
    if logits_for == "last":
        h = h[:, -1:] if last_index is None else jnp.take_along_axis(h, last_index[:, None, None], axis=1)
    h = block_norm(cfg, h, params["ln_f"])
    head = params["wte"] if cfg.tie_embeddings else params["lm_head"]
    return L.linear(h, head).astype(jnp.float32), latent, k, v


def forward(params: dict, cfg: LoopedConfig, cache: LoopedCache | None, input_ids: jax.Array, *,
            num_steps: int, read_step_k=None, read_step_v=None, exit_depths: tuple[int, ...] = (),
            init_key: jax.Array | None = None, init_scale: float = 1.0, logits_for: str = "all", prefill_lens=None):
    """T >= 1 new tokens continuing `cache` (positions from cache.length), recurrence depth num_steps.

    input_ids [B, T] int. cache None = no prefix and nothing written (full-sequence forward).
    read_step_k / read_step_v: step slot each recurrence step reads the prefix K / V from: None =
      aligned (step s reads slot s, the official behaviour), an int (all steps read that slot, e.g.
      num_steps - 1 = the mature full-depth K/V), or an int array [num_steps]; traced values allowed.
      New K/V of step s always go to slot s.
    exit_depths: static depths d (1 <= d <= num_steps) whose logits are also returned, computed from
      the state after d recurrences by (ln_f for Huginn,) coda, ln_f and head in the same pass. Their
      coda attends to the cached prefix's coda K/V (full depth) and writes nothing.
    init_key / init_scale: random initial state (see `initial_state`); default zeros.
    logits_for: "all" -> logits [B, T, V]; "last" -> [B, 1, V] (the coda still runs on every token).
    prefill_lens: None, or [B] int32 (traced): a padded prefill chunk, rows past prefill_lens[b] padding. They attend
      only to what lies before them (causal), so the valid rows are computed as without them; only the valid rows'
      K/V are written (`scatter_tokens`), length advances by prefill_lens, and "last" logits are each row's last
      valid row's (a row with none: garbage, its cache untouched).

    Returns (logits float32, new cache or None, extras): extras["latents"] [B, T, D] is the official
    `latent_states` (Huginn: ln_f of the final state); extras["exit_logits"] = {d: logits}.
    """
    if num_steps < 1:
        raise InputError(f"num_steps must be >= 1; got {num_steps}")
    if input_ids.ndim != 2 or input_ids.shape[1] < 1:
        raise InputError(f"input_ids must be [batch, tokens] with tokens >= 1; got shape {input_ids.shape}")
    if logits_for not in ("all", "last"):
        raise InputError(f"logits_for must be 'all' or 'last'; got {logits_for!r}")
    bad = [d for d in exit_depths if not 1 <= d <= num_steps]
    if bad:
        raise InputError(f"exit_depths {bad} must lie in [1, num_steps={num_steps}]")
    slots = None
    if cache is not None:
        slots = cache.step_slots
        if cache.mode == "full" and num_steps > slots:
            raise InputError(f"num_steps={num_steps} exceeds the cache's {slots} step slots (init_cache num_steps)")
        if cache.mode == "compressed" and (read_step_k is not None or read_step_v is not None):
            raise InputError("read_step_k/read_step_v need a 'full' cache: a compressed cache has one slot per layer")
    B, T = input_ids.shape
    read_k = _read_schedule(read_step_k, num_steps, slots, "read_step_k")
    read_v = _read_schedule(read_step_v, num_steps, slots, "read_step_v")
    cos, sin = rope_tables(cfg, cache_positions(cache, B, T))

    e, new_pk, new_pv = prelude(params, cfg, cache, input_ids, cos, sin)
    x0 = initial_state(cfg, e, init_key, init_scale)
    depths = tuple(sorted(set(exit_depths) | {num_steps}))
    states, new_ck, new_cv = _recur(params, cfg, cache, x0, e, cos, sin, read_k, read_v, num_steps, depths)
    if prefill_lens is not None and (cache is None or exit_depths):
        raise InputError("prefill_lens is a padded prefill of a cache: it needs a cache and takes no exit_depths")
    last = None if prefill_lens is None else jnp.maximum(prefill_lens - 1, 0).astype(jnp.int32)
    logits, latent, new_dk, new_dv = coda_head(params, cfg, cache, states[num_steps], cos, sin, logits_for, last)
    exits = {d: logits if d == num_steps else coda_head(params, cfg, cache, states[d], cos, sin, logits_for)[0]
             for d in exit_depths}
    extras = {"latents": latent, "exit_logits": exits}
    if cache is None:
        return logits, None, extras
    if cache.mode == "compressed":  # latest recurrence wins
        new_ck, new_cv = new_ck[-1:], new_cv[-1:]
    start = cache.length
    if prefill_lens is None:
        write, advance = write_tokens, T
    else:
        write, advance = functools.partial(scatter_tokens, n_valid=prefill_lens), prefill_lens
    new_cache = cache.replace(
        prelude_k=write(cache.prelude_k, new_pk, start), prelude_v=write(cache.prelude_v, new_pv, start),
        core_k=write(cache.core_k, new_ck, start), core_v=write(cache.core_v, new_cv, start),
        coda_k=write(cache.coda_k, new_dk, start), coda_v=write(cache.coda_v, new_dv, start),
        length=cache.length + advance)
    return logits, new_cache, extras


def decode_forward(params: dict, cfg: LoopedConfig, cache: LoopedCache, input_ids: jax.Array, n_valid: jax.Array,
                   *, num_steps: int):
    """The exact path's decode-shape forward at full depth: input_ids [B, T] (T = the generation's decode
    row count; rows past n_valid [B] are padding) -> (logits [B, T, V] float32, cache with length + n_valid).

    Aligned reads (step s reads and writes slot s, the official semantics), the initial state zeros. Each
    layer writes its new K/V into its cache slot first and then attends over the whole slot with a causal
    position mask, so a token's keys are reduced in one order -- by cache position -- whether it is an AR
    step's first row or a verification's j-th: with every decode forward of a generation at the same row
    count, AR and speculation compute the same logits bit for bit (the prefix-plus-new two-block softmax
    of `forward` splits the reduction where the committed prefix ends, which differs between the two).
    """
    if cache.mode != "full":
        raise InputError("the exact decode path needs a 'full' cache (one slot per recurrence step)")
    B, T = input_ids.shape
    start = cache.length
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    cos, sin = rope_tables(cfg, positions)
    mask = L.causal_cache_mask(positions, cache.max_len)
    scale = cfg.head_dim ** -0.5

    def run(blocks, x, kbuf, vbuf, lead):  # blocks in order; layer i writes slot lead + (i,)
        for i, lp in enumerate(blocks):
            bufs = {}

            def attend(q, k, v, at=lead + (i,)):
                bufs["k"], bufs["v"] = write_layer(kbuf, k, at, start), write_layer(vbuf, v, at, start)
                return L.attention(q, bufs["k"][at], bufs["v"][at], mask, scale)

            x, _, _ = apply_block(lp, cfg, x, cos, sin, None, start, attend)
            kbuf, vbuf = bufs["k"], bufs["v"]
        return x, kbuf, vbuf

    e = embed(params, cfg, input_ids)
    e, pk, pv = run(params.get("prelude", []), e, cache.prelude_k, cache.prelude_v, ())

    def core(carry, step):
        x, ck, cv = carry
        h = inject(params, cfg, x, e, step == 0)
        return run(params["core_block"], h, ck, cv, (step,)), None

    (x, ck, cv), _ = lax.scan(core, (initial_state(cfg, e), cache.core_k, cache.core_v),
                              jnp.arange(num_steps, dtype=jnp.int32), unroll=recurrence_unroll(num_steps))
    latent = block_norm(cfg, x, params["ln_f"]) if cfg.variant == "huginn" else x
    h, dk, dv = run(params.get("coda", []), latent, cache.coda_k, cache.coda_v, ())
    h = block_norm(cfg, h, params["ln_f"])
    head = params["wte"] if cfg.tie_embeddings else params["lm_head"]
    logits = L.linear(h, head).astype(jnp.float32)
    return logits, cache.replace(prelude_k=pk, prelude_v=pv, core_k=ck, core_v=cv, coda_k=dk, coda_v=dv,
                                 length=start + n_valid)


@functools.partial(jax.jit, static_argnames=("cfg", "num_steps", "exit_depths", "init_scale", "logits_for"),
                   donate_argnames=("cache",))
def _forward_jit(params, cfg, cache, input_ids, read_k, read_v, init_key, *, num_steps, exit_depths, init_scale,
                 logits_for):
    return forward(params, cfg, cache, input_ids, num_steps=num_steps, read_step_k=read_k, read_step_v=read_v,
                   exit_depths=exit_depths, init_key=init_key, init_scale=init_scale, logits_for=logits_for)


def forward_jit(params, cfg, cache, input_ids, num_steps, read_step_k=None, read_step_v=None, exit_depths=(),
                init_key=None, init_scale=1.0, logits_for="all"):
    """Jitted `forward` with the cache donated: (logits, new_cache, extras).

    With a full cache the read schedules are passed as int32 arrays [num_steps] (None -> aligned),
    so aligned, Deep-K/V, Mature-V and per-step reads share one compiled executable.
    """
    if cache is not None and cache.mode == "full":
        read_step_k = _read_schedule(read_step_k, num_steps, cache.step_slots, "read_step_k")
        read_step_v = _read_schedule(read_step_v, num_steps, cache.step_slots, "read_step_v")
    return _forward_jit(params, cfg, cache, input_ids, read_step_k, read_step_v, init_key, num_steps=num_steps,
                        exit_depths=tuple(exit_depths), init_scale=init_scale, logits_for=logits_for)


# ---------------------------------------------------------------------------------- public calls

def check_steps(num_steps, cfg: LoopedConfig) -> int:
    num_steps = cfg.mean_recurrence if num_steps is None else num_steps
    if not isinstance(num_steps, (int, np.integer)) or isinstance(num_steps, bool) or num_steps < 1:
        raise InputError(f"num_steps (recurrence depth) must be an integer >= 1; got {num_steps!r}")
    return int(num_steps)


def forward_logits(model, input_ids, num_steps: int | None = None, *, exit_depths: tuple[int, ...] = (),
                   return_extras: bool = False):
    """Logits [B, T, vocab] float32 for every position of input_ids [B, T], fresh (no) cache.

    num_steps: recurrence depth (default the config's mean_recurrence). return_extras: also return
    the extras of `forward` (latents, exit logits).
    """
    cfg = model.config
    ids = validate_input_ids(input_ids, cfg.vocab_size)
    num_steps = check_steps(num_steps, cfg)
    logits, _, extras = forward_jit(model.params, cfg, None, jnp.asarray(ids), num_steps,
                                    exit_depths=tuple(exit_depths))
    return (logits, extras) if return_extras else logits
