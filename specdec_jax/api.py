"""The public calls: load, forward_logits, generate. Inputs are checked here, before any compute."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from .models.qwen35.config import read_config
from .decoding import session as sessions
from .decoding.autoregressive import generate_ar
from .decoding.decode_shape import exact_rows
from .decoding.sampling import SamplingConfig
from . import compile_cache, methods, sharding, shipped
from .errors import CheckpointError, InputError
from .loading import TensorSource, resolve_dtype
from .methods import DRAFT_TABLES_FILE
from .results import GenerateResult, Model, TextResult
from .decoding.buckets import split_prompts
from .memory import peak_bytes
from .options import check_context_length, float_option, int_option, validate_input_ids

QWEN35_METHODS = methods.family_methods("qwen3_5")
LOOPED_METHODS = methods.family_methods("looped")


def load(path: str | os.PathLike, dtype="bfloat16", mesh=None) -> Model:
    """Load an HF checkpoint folder (config.json + safetensors) as a `Model`; `model.tokenizer` is the folder's
    tokenizer (None when it has none). `path` may also name a shipped checkpoint: "tiny-qwen", "tiny-huginn"
    (shipped.py; a folder of that name wins).

    Qwen3.5 (`qwen3_5`, `qwen3_5_text`, `qwen3_5_moe`, `qwen3_5_moe_text`) and looped models
    (`huginn_raven`: Huginn-0125 and the Raven retrofits). Every tensor's presence and shape is
    checked from the file headers before any tensor is read.

    mesh: None (one device), or a `jax.sharding.Mesh` with an axis "tp" (Qwen3.5 only): tensor parallelism.
    Heads, MLP columns, experts and the vocabulary are split over that axis (sharding.py); generation then
    runs the same jitted steps on every device of the mesh. Whether the model can be split is checked first.
    """
    compile_cache.enable()
    path = shipped.resolve(path)
    cfg = read_config(path)
    jdtype = resolve_dtype(dtype)
    if mesh is not None:
        cfg = _with_mesh(cfg, mesh, path)
    tokenizer = _folder_tokenizer(path)
    if cfg.family == "looped":
        from .models.looped import model as looped
        return dataclasses.replace(looped.load_looped(path, dtype), tokenizer=tokenizer)
    from .models.qwen35 import model as qwen35
    source = TensorSource(path)
    params = qwen35.load_params(source, cfg, jdtype)
    tables = os.path.join(path, DRAFT_TABLES_FILE)
    if os.path.isfile(tables):
        from .drafters.table import load_draft_tables
        params["draft"] = load_draft_tables(tables, cfg.vocab_size)
        if cfg.mesh is not None:
            params["draft"] = sharding.replicate(params["draft"], cfg.mesh)
    return Model(config=cfg, params=params, path=path, dtype=jdtype, tokenizer=tokenizer)


def _folder_tokenizer(path: str):
    """The folder's tokenizer, None when it has no tokenizer files. Tokenizer files that do not load leave it None
    with a warning that says why: the weights are still usable with token ids (generate_text then refuses)."""
    import warnings
    from . import text
    if not text.has_tokenizer(path):
        return None
    try:
        return text.load_tokenizer(path)
    except CheckpointError as e:
        warnings.warn(f"{e}; model.tokenizer is None", stacklevel=3)
        return None


def _with_mesh(cfg, mesh, path: str):
    """cfg laid out for `mesh` (qwen35.with_mesh: a "tp" axis, every count splittable): one InputError, before any
    tensor is read."""
    where = f"load({path!r}, mesh=...)"
    sharding.check_mesh(mesh, where)
    if cfg.family == "looped":
        raise InputError(f"{where}: tensor parallelism (mesh=) is supported for Qwen3.5 models only; "
                         f"this is a looped ({cfg.variant}) model (load it without mesh=)")
    from .models.qwen35 import model as qwen35
    return qwen35.with_mesh(cfg, mesh, f"{where} ({os.path.join(path, 'config.json')})")


def supported_methods(model: Model) -> tuple[str, ...]:
    """Methods this model can run (the registry, `methods.py`): MTP needs mtp.* weights, table drafters need
    draft tables."""
    return methods.supported(model)


def forward_logits(model: Model, input_ids, **options):
    """Logits [B, T, vocab] float32 for every position of `input_ids` [B, T] (fresh state).

    Looped models take `num_steps` (recurrence depth, default the config's mean recurrence).
    """
    ids = validate_input_ids(input_ids, model.vocab_size)
    if model.family == "looped":
        from .models.looped import model as looped
        return looped.forward_logits(model, ids, **options)
    if options:
        raise InputError(f"forward_logits: unknown options for a Qwen3.5 model: {sorted(options)}")
    from .models.qwen35 import model as qwen35
    state = qwen35.init_state(model.config, ids.shape[0], ids.shape[1], model.dtype)
    logits, _ = qwen35.forward_jit(model.params, model.config, state, jnp.asarray(ids))
    return logits


def generate(model: Model, input_ids, max_new_tokens: int, method: str = "ar", temperature: float = 0.0,
             seed: int = 0, *, top_k: int = 0, top_p: float = 1.0, eos_token_id=None, max_len: int | None = None,
             state=None, _stream=None, **method_options) -> GenerateResult:
    """Generate `max_new_tokens` tokens after each prompt; the whole loop runs on device.

    input_ids: [B, T] token ids, or a list of B 1-D sequences of any lengths (a ragged batch, prefilled in padded
    chunks with each row's length traced).
    result.tokens [B, max_new_tokens] (new tokens only; after its EOS a row is padded with the first EOS id);
    result.stats: new_tokens, seconds, tokens_per_second, compile_seconds, compiled_programs (0 when every
    program was reused), peak_memory_bytes (the device's peak in this process so far; None where the device does not
    report it), ... (see GenerateResult).
    eos_token_id: None = the config's EOS ids, False/() = never stop early, int or list of ints.
    max_len: KV-cache length (default: the bucket of prompt + max_new_tokens + the last verification's rows;
    Qwen3.5 programs are compiled per bucket, not per prompt length: decoding/buckets.py).
    state: None, or an earlier result's `.state`: continue that generation, input_ids then holding each row's new
    tokens (may be empty) after its history; nothing already run is prefilled again, and the method may differ (a
    looped model's at the same num_steps and cache_mode). result.state is the decode state after the call
    (`decoding.session.Session`; None after the parallel sampler, which is not exact).
    """
    result = _generate(model, input_ids, max_new_tokens, method, temperature, seed, top_k=top_k, top_p=top_p,
                       eos_token_id=eos_token_id, max_len=max_len, state=state, _stream=_stream, **method_options)
    result.stats["peak_memory_bytes"] = peak_bytes()
    return result


def _generate(model: Model, input_ids, max_new_tokens: int, method: str = "ar", temperature: float = 0.0,
              seed: int = 0, *, top_k: int = 0, top_p: float = 1.0, eos_token_id=None, max_len: int | None = None,
              state=None, _stream=None, **method_options) -> GenerateResult:
    compile_cache.enable()
    prompts = split_prompts(input_ids, model.vocab_size, allow_empty=state is not None)
    session, new_rows = None, prompts
    if state is not None:
        session = sessions.check_session(state, model, len(prompts))
        prompts = sessions.continued_rows(session, prompts)
    longest = max(len(p) for p in prompts)
    spec = methods.lookup(model, method)
    args = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
            "seed": seed}
    max_new_tokens = int_option(args, "max_new_tokens", None, 1)
    sampling = SamplingConfig(float_option(args, "temperature", None, 0.0),
                              int_option(args, "top_k", None, 0, None, " (0 = off)"),
                              float_option(args, "top_p", None, 0.0, 1.0, lo_open=True))
    seed = int_option(args, "seed", None, 0, 2 ** 32 - 1, " (a 32-bit PRNG seed)")
    if max_len is not None:
        max_len = int_option({"max_len": max_len}, "max_len", None, 1)
    eos_ids = _eos_ids(eos_token_id, model)
    if spec.kind == methods.LOOPED_SPEC:
        # Looped self-speculation sizes its own cache (its default gamma depends on the method) and buckets it.
        from .decoding.looped_spec import generate_looped_spec
        initial = None
        if session is not None:  # each row's pending token, then its new ones, after what the cache holds
            initial = session.model
            new_rows = [np.concatenate([[p], r]).astype(np.int32) for p, r in zip(np.asarray(session.pending),
                                                                                    new_rows)]
        result = generate_looped_spec(model, new_rows, int(max_new_tokens), method, sampling=sampling, seed=seed,
                                      eos_ids=eos_ids, max_len=max_len, initial=initial, stream=_stream,
                                      **method_options)
        settings = (("num_steps", result.stats["num_steps"]), ("cache_mode", "full"))
        return sessions.with_looped_session(result, model, prompts, eos_ids, settings)
    methods.check_options(spec, method_options)
    if spec.kind == methods.TREE:
        # The tree's node count is known only once its options are read: _generate_tree_qwen buckets the cache.
        tree = _generate_tree_qwen(model, prompts, int(max_new_tokens), spec, max_len, sampling, seed, eos_ids,
                                   method_options, session, _stream)
        return sessions.with_session(tree, model, prompts, eos_ids)
    gamma = (int_option(method_options, "gamma", spec.default_gamma, 1, None, " (the draft length)")
             if spec.kind == methods.CHAIN else 0)
    rows = exact_rows(method_options, gamma, model.family, _not_exact_because(model.family, method_options, gamma))
    extra, extra_what = (rows, f"decode_rows ({rows})") if rows else (gamma, f"gamma ({gamma})")
    needed = longest + int(max_new_tokens) + extra
    what = (f"prompt ({longest} tokens{' in the longest row' if len(prompts) > 1 else ''}) + max_new_tokens "
            f"({max_new_tokens})" + (f" + {extra_what}" if extra else ""))
    check_context_length(needed, model.config.max_position_embeddings, what)
    if max_len is not None and needed > max_len:
        raise InputError(f"{what} = {needed} exceeds the cache length max_len={max_len}")
    if spec.kind == methods.CHAIN:
        buckets = _buckets(model, prompts, needed, max_len, eos_ids, session)
        result = _generate_speculative_qwen(model, int(max_new_tokens), spec, gamma, sampling, seed, eos_ids,
                                            method_options, rows, buckets, _stream, session)
        return sessions.with_session(result, model, prompts, eos_ids)
    # AR: the family's remaining options choose the model (looped: num_steps, cache_mode); checked there.
    from .models.family import family_for
    family = family_for(model.config, **{k: v for k, v in method_options.items() if k not in ("exact", "decode_rows")})
    if session is not None and session.settings and tuple(family.describe().items()) != session.settings:
        raise InputError(f"state was made at {dict(session.settings)}; this call runs {dict(family.describe())} "
                         f"(continue with the state's settings)")
    buckets = _buckets(model, prompts, needed, max_len, eos_ids, session, family)
    result = generate_ar(family, model, buckets.pop("ids"), int(max_new_tokens), decode_rows=rows, sampling=sampling,
                         seed=seed, eos_ids=eos_ids, stream=_stream, **buckets)
    if model.family == "looped":
        return sessions.with_looped_session(result, model, prompts, eos_ids, tuple(family.describe().items()))
    return sessions.with_session(result, model, prompts, eos_ids)


def stream(model: Model, input_ids, max_new_tokens: int, chunk_steps: int = 16, **options):
    """`generate`, yielding the new tokens as numpy arrays [B, k] while the device produces them: the decode loop
    runs `chunk_steps` steps a call (AR: a token a step; speculation: up to gamma + 1), its state carried from call
    to call, and every chunk yields the positions all rows have reached. The pieces concatenated are
    `generate(model, input_ids, max_new_tokens, **options).tokens`, for every method (looped speculation: blocks of
    up to gamma + 1 tokens; trees: a path of the tree a step). Bad input raises here, before any compute. The
    generator's return value (StopIteration.value) is the GenerateResult."""
    import queue
    import threading
    chunk_steps = int_option({"chunk_steps": chunk_steps}, "chunk_steps", None, 1, None, " (decode steps a chunk)")
    pieces: queue.Queue = queue.Queue()
    done = object()

    def work():
        try:
            pieces.put((done, generate(model, input_ids, max_new_tokens, _stream=(chunk_steps, pieces.put),
                                       **options)))
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            pieces.put((done, e))

    threading.Thread(target=work, name="specdec-stream", daemon=True).start()
    first = pieces.get()  # the checks, the compile and the first chunk: bad input raises here, not at iteration
    if isinstance(first, tuple) and first[0] is done and isinstance(first[1], BaseException):
        raise first[1]

    def pieces_of():
        item = first
        while True:
            if isinstance(item, tuple) and item[0] is done:
                if isinstance(item[1], BaseException):
                    raise item[1]
                return item[1]
            yield item
            item = pieces.get()

    return pieces_of()


_ADDITIVE_STATS = ("new_tokens", "seconds", "prefill_seconds", "decode_seconds", "compile_seconds",
                   "compiled_programs", "verify_steps")


def _summed_stats(per_call: list[dict], rows: list[list[int]]) -> dict:
    """Stats of several calls that together ran one batch (call c ran the batch rows rows[c]): counts, seconds and
    programs summed, rates over the sums, mean_accepted / tokens_per_step weighted by verify steps, per-row lists put
    back in row order; the other keys are the first call's."""
    stats = dict(per_call[0])
    for key in _ADDITIVE_STATS:
        if all(s.get(key) is not None for s in per_call):
            stats[key] = sum(s[key] for s in per_call)
    steps = [s.get("verify_steps") for s in per_call]
    for key in ("mean_accepted", "tokens_per_step"):
        if key in stats and all(steps):
            stats[key] = sum(s[key] * n for s, n in zip(per_call, steps)) / sum(steps)
    batch = sum(len(r) for r in rows)
    for key, value in per_call[0].items():
        if isinstance(value, list) and len(value) == len(rows[0]):  # one entry per row
            stats[key] = [None] * batch
            for ids, s in zip(rows, per_call):
                for i, v in zip(ids, s[key]):
                    stats[key][i] = v
    if "new_tokens" in stats and "seconds" in stats:
        stats["tokens_per_second"] = stats["new_tokens"] / max(stats["seconds"], 1e-9)
    if "new_tokens" in stats and "decode_seconds" in stats:
        stats["decode_tokens_per_second"] = max(stats["new_tokens"] - batch, 0) / max(stats["decode_seconds"], 1e-9)
    return stats


def _buckets(model: Model, prompts: list, needed: int, max_len: int | None, eos_ids: tuple, session=None,
             family=None) -> dict:
    """The shapes a generation compiles for (`decoding.buckets`): the padded prompt buffer `ids` [B, P] and its
    valid lengths `lens` [B], the cache length `max_len` (the caller's, or the bucket of `needed` positions,
    within the model's context), the prefill `chunk`, and `token_buffer` (0: max_new_tokens is part of the decode
    program, see `buckets.static_new_tokens`). session: a continuation: `prompts` are the rows' whole histories,
    and `initial` (the session's state, its caches grown to max_len) holds their first `starts` tokens. family: the
    model family the state is made for (None: Qwen3.5's)."""
    from .decoding import buckets
    from .decoding.speculative import sure_steps_enabled
    starts = np.zeros(len(prompts), np.int32)
    if session is not None:
        starts = np.where(session.resumable, np.asarray(session.model.length), 0).astype(np.int32)
    if max_len is None:
        max_len = buckets.cache_length(needed, len(prompts), model.config.max_position_embeddings)
        if session is not None:
            max_len = max(max_len, session.model.max_len)
    elif session is not None and max_len < session.model.max_len:
        raise InputError(f"max_len={max_len} is shorter than the state's cache ({session.model.max_len} slots)")
    longest = max(len(p) - int(s) for p, s in zip(prompts, starts))  # the tokens this call prefills
    chunk = buckets.prefill_chunk(longest, len(prompts), max_len)
    ids, lens = buckets.pad_prompts(prompts, buckets.prompt_buffer(max_len, chunk))
    token_buffer = 0 if buckets.static_new_tokens(eos_ids, sure_steps_enabled()) else max_len
    from .memory import check_fits
    from .models.family import QWEN35
    family = family or QWEN35
    check_fits(jax.eval_shape(lambda: family.init_state(model.config, len(prompts), max_len,
                                                        family.state_dtype(model))),
               f"the decode state of {len(prompts)} row(s) over a cache of {max_len} positions",
               devices=getattr(model.config, "tp_size", 1))
    plan = dict(ids=ids, lens=lens, max_len=max_len, chunk=chunk, token_buffer=token_buffer)
    if session is not None:
        from .decoding.session import grown
        plan.update(initial=grown(session.model, max_len, session.resumable), starts=starts)
    return plan


def _not_exact_because(family: str, options: dict, gamma: int) -> str | None:
    """Why a generation of this family with these options cannot take the exact path (None: it can; a gamma
    past the exact path's rows is refused by exact_rows unless exact=False)."""
    if family == "looped":
        return ("a compressed cache is another model (cache_mode='full' is exact)"
                if options.get("cache_mode") == "compressed" else None)
    if options.get("rollback") == "pseudo":
        return ("rollback='pseudo' rebuilds the GDN state from pseudo-values, exact only in exact arithmetic "
                "(use rollback='replay' or 'snapshot')")
    return None


def _eos_ids(eos_token_id, model: Model) -> tuple[int, ...]:
    """None: the config's EOS ids; False or (): never stop early; an id or a list of ids in the vocabulary."""
    if eos_token_id is None:
        return tuple(model.config.eos_token_id)
    if eos_token_id is False:
        return ()
    ids = np.atleast_1d(np.asarray(eos_token_id, dtype=object)).ravel().tolist()
    for i in ids:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or not 0 <= i < model.vocab_size:
            raise InputError(f"eos_token_id must be None, False, or token ids in [0, {model.vocab_size}); "
                             f"got {eos_token_id!r}")
    return tuple(int(i) for i in ids)


def _generate_speculative_qwen(model, max_new_tokens, spec, gamma, sampling, seed, eos_ids, options, rows: int,
                               buckets: dict, stream=None, session=None) -> GenerateResult:
    """Chain speculation with the method's drafter (options already checked against the method's set), at the
    shapes `buckets` (`_buckets`); session: a continuation (its drafter state, `session.drafter_carry`)."""
    from .decoding.speculative import DEFAULT_ROLLBACK, ROLLBACK_MODES, generate_speculative
    from .models.qwen35.model import MAX_RECURRENT_VERIFY
    # Replay verifies through the step recurrence (at most MAX_RECURRENT_VERIFY positions); longer drafts
    # (reached only with exact=False: exact_rows refuses them otherwise) default to the pseudo-value commit.
    rollback = options.get("rollback", DEFAULT_ROLLBACK if gamma + 1 <= MAX_RECURRENT_VERIFY else "pseudo")
    if rollback not in ROLLBACK_MODES:
        raise InputError(f"rollback must be one of {ROLLBACK_MODES}; got {rollback!r}")
    if rollback in ("snapshot", "replay") and gamma + 1 > MAX_RECURRENT_VERIFY:
        raise InputError(f"{rollback} rollback verifies at most {MAX_RECURRENT_VERIFY} positions; gamma={gamma} "
                         f"needs {gamma + 1} (rollback='pseudo' has no limit)")
    drafter = spec.drafter(model, options)
    buckets = dict(buckets)
    return generate_speculative(model.params, model.config, buckets.pop("ids"), max_new_tokens, drafter=drafter,
                                gamma=gamma, sampling=sampling, seed=seed, eos_ids=eos_ids, state_dtype=model.dtype,
                                rollback=rollback, decode_rows=rows, stream=stream,
                                drafter_initial=sessions.drafter_carry(session, drafter), **buckets)


DEFAULT_TREE = (4, 2, 1)


def _generate_tree_qwen(model, prompts, max_new_tokens, spec, max_len, sampling, seed, eos_ids,
                        options, session=None, stream=None) -> GenerateResult:
    """Draft trees (static branching per level), verified with tree attention and tree-WY GDN; greedy or
    exact sampling (multi-draft recursive rejection sampling over the tree)."""
    from .decoding.tree_spec import ROLLBACK_MODES, generate_tree, tree_from_branching
    exact_rows(options, 0, "qwen3_5", "tree verification is not bit-exact: its GDN state runs through the tree-WY "
                                      "form and its attention through a tree mask, neither of which is the "
                                      "arithmetic of an AR step (use a chain method for exact output)")
    tree = options.get("tree", DEFAULT_TREE)
    if (isinstance(tree, (str, bytes)) or not hasattr(tree, "__len__") or not len(tree)
            or not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b >= 1 for b in tree)):
        raise InputError(f"tree must be a non-empty list of branching factors (integers >= 1), one per level; "
                         f"got {tree!r}")
    branching = tuple(int(b) for b in tree)
    parents, _ = tree_from_branching(branching)
    if len(parents) > 64:
        raise InputError(f"tree {branching} has {len(parents)} nodes; at most 64 are supported")
    rollback = options.get("rollback", "pseudo")
    if rollback not in ROLLBACK_MODES:
        raise InputError(f"rollback must be one of {ROLLBACK_MODES}; got {rollback!r}")
    longest = max(len(p) for p in prompts)
    need = longest + max_new_tokens + len(parents)
    check_context_length(need, model.config.max_position_embeddings,
                         f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) + tree nodes ({len(parents)})")
    if max_len is not None and max_len < need:
        raise InputError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) + tree nodes "
                         f"({len(parents)}) = {need} exceeds max_len={max_len}")
    drafter = spec.drafter(model, options)
    buckets = _buckets(model, prompts, need, max_len, eos_ids, session)
    return generate_tree(model.params, model.config, buckets.pop("ids"), max_new_tokens, drafter=drafter,
                         parents=parents, eos_ids=eos_ids, state_dtype=model.dtype, rollback=rollback, seed=seed,
                         sampling=sampling, stream=stream, drafter_initial=sessions.drafter_carry(session, drafter),
                         **buckets)


def generate_text(model: Model, prompt, max_new_tokens: int, **options) -> TextResult:
    """Text in, text out: encode `prompt` (a str, or a list of str) with `model.tokenizer`, `generate`, decode
    each continuation through its first EOS. options: `generate`'s (method, temperature, gamma, ...).

    result.text: a str for a str prompt, a list of str for a list; result.tokens likewise (lists of ids);
    result.stats: the generation's. Prompts of unequal token lengths go to `generate` as a ragged list, or one
    call each where it takes none.
    """
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise InputError(f"generate_text needs a tokenizer; the model loaded from {model.path!r} has none (a "
                         f"tokenizer.json beside config.json), so encode the prompt yourself and call generate")
    single = isinstance(prompt, str)
    prompts = [prompt] if single else prompt
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise InputError(f"generate_text takes a prompt (str) or a non-empty list of str; got {prompt!r:.80}")
    encoded = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    for p, ids in zip(prompts, encoded):
        if not ids:
            raise InputError(f"prompt {p!r:.80} encodes to no tokens")
    eos_ids = set(_eos_ids(options.get("eos_token_id"), model))
    if len({len(ids) for ids in encoded}) == 1:
        outs = [generate(model, np.asarray(encoded, np.int32), max_new_tokens, **options)]
    else:
        try:
            outs = [generate(model, [np.asarray(ids, np.int32) for ids in encoded], max_new_tokens, **options)]
        except InputError as e:
            # A generate without ragged batches refuses the list (input_ids / equal lengths): one call per prompt.
            if "input_ids" not in str(e) and "equal" not in str(e):
                raise
            outs = [generate(model, [ids], max_new_tokens, **options) for ids in encoded]
    tokens = []
    for row in (r for out in outs for r in np.asarray(out.tokens)):
        ids = [int(t) for t in row]
        end = next((i + 1 for i, t in enumerate(ids) if t in eos_ids), len(ids))
        tokens.append(ids[:end])
    text = [tokenizer.decode(ids, skip_special_tokens=True) for ids in tokens]
    stats = (outs[0].stats if len(outs) == 1 else
             {**_summed_stats([o.stats for o in outs], [[i] for i in range(len(outs))]),
              "per_prompt": [o.stats for o in outs]})
    return TextResult(text[0] if single else text, tokens[0] if single else tokens, stats)
