"""Shape buckets: a generation's compiled programs are keyed on a few sizes, not on the exact prompt length, cache
length and number of new tokens, so a user's next prompt reuses what an earlier one compiled.

- The cache length S (prompt + new tokens + the last verification's rows) is rounded up the ladder
  256, 1024, 4096, then powers of two up to 65,536, then multiples of 16,384 (past 64K a doubling would read twice
  the KV cache a step needs; a multiple of 16K adds at most 25% there).
- The prompt is prefilled in chunks of a fixed size (`prefill_chunk`: the smallest of 256, 512 and 1024 tokens that
  holds the longest prompt, 1024 beyond; 256 only in caches of 256 slots)
  from a buffer of S tokens (rounded up to a chunk), with each row's valid length traced: a chunk's padding rows
  change nothing in the state (`qwen35.forward(prefill_lens=...)`), so the prefill program depends on (S, chunk)
  only, and a prompt gives the same bits in every bucket that prefills it in the same chunk size. It is one program
  for AR and every speculative method of the family (`prefill.prefill_buffer`; MTP drafters, which also take the
  hidden states, share another).
- A batch of more than SMALL_BATCH rows is not padded to a bucket (its cache is the length it needs, its chunk no
  longer than its longest prompt rounded up to 16): padding multiplies a prefill's activations by the batch (at
  20,000 rows of 4-token prompts a 256-token chunk over a 256-slot cache asked for 43 GB of attention scores), and a
  large batch's compile is spread over its rows.
- The number of new tokens is traced; the output buffers hold S tokens. Where a loop must know its trip count to
  run without reading a flag back each step (on the GPU, with no EOS id: `static_new_tokens`), the exact count is
  part of the program instead.
"""

from __future__ import annotations

import numpy as np

from ..errors import InputError

CACHE_LADDER = (256, 1024, 4096)
POW2_LIMIT = 65536
LONG_STEP = 16384
# Chosen on an H100 for both families (9B and Huginn-0125 shapes, bf16; docs/LOG.md, 2026-12-07): a prompt pays for
# a whole chunk, so it takes the smallest that holds it; past 1024 tokens, chunks of 1024. Larger chunks were faster
# only where the prompt fills them (a few % at the 9B shape), and a long prompt's padded last chunk costs as much.
PREFILL_CHUNKS = (256, 512, 1024)


SMALL_BATCH = 16


def cache_bucket(needed: int) -> int:
    """The cache length a generation needing `needed` positions runs at."""
    for size in CACHE_LADDER:
        if needed <= size:
            return size
    if needed <= POW2_LIMIT:
        return 1 << (int(needed) - 1).bit_length()
    return -(-int(needed) // LONG_STEP) * LONG_STEP


def prefill_chunk(longest_prompt: int, batch: int = 1, cache_len: int | None = None) -> int:
    """Tokens per prefill chunk for a batch whose longest prompt has `longest_prompt` tokens, into a cache of
    `cache_len` slots: the smallest of PREFILL_CHUNKS that holds the prompt (the largest beyond), but the smallest
    chunk only where the cache is no longer than it. A cache bucket past 256 slots holds prompts of any length up to
    it, and each chunk size is a program of its own: in those buckets a short prompt takes the next chunk (a few ms
    more once, against a compile of seconds), so a bucket compiles at most two prefills."""
    chunk = next((c for c in PREFILL_CHUNKS if longest_prompt <= c), PREFILL_CHUNKS[-1])
    if chunk == PREFILL_CHUNKS[0] and cache_len is not None and cache_len > chunk and len(PREFILL_CHUNKS) > 1:
        chunk = PREFILL_CHUNKS[1]
    return chunk if batch <= SMALL_BATCH else min(chunk, -(-longest_prompt // 16) * 16)


def cache_length(needed: int, batch: int, limit: int) -> int:
    """The cache length of a generation needing `needed` positions: its bucket (at most the model's context
    `limit`, at least `needed`) for a batch of up to SMALL_BATCH rows, else `needed`."""
    if batch > SMALL_BATCH:
        return needed
    return max(needed, min(cache_bucket(needed), limit))


def prompt_buffer(cache_len: int, chunk: int) -> int:
    """Length of the padded prompt buffer: the cache length rounded up to whole chunks."""
    return -(-cache_len // chunk) * chunk


def pad_prompts(rows: list[np.ndarray], width: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Ragged prompts -> (ids [B, width] int32, right-padded with pad_id; lengths [B] int32)."""
    ids = np.full((len(rows), width), pad_id, np.int32)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = row
    return ids, np.asarray([len(r) for r in rows], np.int32)


def static_new_tokens(eos_ids: tuple, sure_steps: bool) -> bool:
    """Whether max_new_tokens is part of the decode program (a loop of known trip count) rather than traced: on the
    GPU a loop of unknown trip count reads its predicate back every step (measured ~90 us a step at the 9B shape:
    `speculative.sure_steps_enabled`); with no EOS id every step is known to run, so the count is worth a program.
    With an EOS id any step may be the last and the count is traced."""
    return not eos_ids and sure_steps


def split_prompts(input_ids, vocab_size: int, allow_empty: bool = False) -> list[np.ndarray]:
    """A [B, T] array or a list of 1-D integer sequences (ragged) -> a list of B int32 rows, each checked: at least
    one token (none needed where allow_empty: a continuation's new tokens), integers, inside the vocabulary. One
    InputError naming the row and position otherwise."""
    if isinstance(input_ids, (list, tuple)) and not input_ids:
        raise InputError("input_ids is empty: a batch needs at least one prompt")
    if isinstance(input_ids, (list, tuple)) and all(np.ndim(r) == 1 for r in input_ids):
        rows = list(input_ids)
        where = lambda b, t=None: f"prompts[{b}]" + ("" if t is None else f"[{t}]")
    else:
        try:
            ids = np.asarray(input_ids)
        except Exception as e:  # noqa: BLE001 (ragged nesting and the like)
            raise InputError(f"input_ids must be an integer array [batch, tokens] or a list of 1-D token sequences; "
                             f"could not convert: {e}") from None
        if ids.ndim == 1:
            raise InputError(f"input_ids must be 2-D [batch, tokens] or a list of 1-D sequences; got shape {ids.shape} "
                             f"(wrap a single prompt as [ids])")
        if ids.ndim != 2:
            raise InputError(f"input_ids must be 2-D [batch, tokens]; got shape {ids.shape}")
        if ids.shape[0] == 0:
            raise InputError(f"input_ids is empty (shape {ids.shape}): a batch needs at least one prompt")
        rows = list(ids)
        where = lambda b, t=None: f"input_ids[{b}" + ("]" if t is None else f", {t}]")
    out = []
    for b, row in enumerate(rows):
        arr = np.asarray(row)
        if arr.size == 0 and not allow_empty:
            raise InputError(f"{where(b)} is empty: a prompt needs at least one token")
        if arr.size == 0:
            out.append(np.zeros(0, np.int32))
            continue
        if not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"{where(b)} must hold integers; got dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= vocab_size)
        if bad.any():
            t = int(np.argmax(bad))
            raise InputError(f"{where(b, t)} = {int(arr[t])} is outside the vocabulary [0, {vocab_size})")
        out.append(arr.astype(np.int32))
    return out

