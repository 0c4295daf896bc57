"""The public calls: load, forward_logits, generate. Inputs are checked here, before any compute."""

from __future__ import annotations

import functools
import os

import jax.numpy as jnp
import numpy as np

from .config import read_config
from .decoding.autoregressive import FamilyOps, generate_autoregressive
from .decoding.decode_shape import exact_rows
from .decoding.looped_spec import LOOPED_SPEC_METHODS
from .decoding.sampling import SamplingConfig
from .errors import InputError
from .loading import TensorSource, resolve_dtype
from .model import GenerateResult, Model
from .options import check_context_length, float_option, int_option, validate_input_ids

QWEN35_METHODS = ("ar", "ngram", "ngram-table", "mtp", "mtp-shortlist", "layer-skip", "residual-reuse", "partial-mlp",
                  "ngram-tree", "mtp-tree")
DRAFT_TABLES_FILE = "draft_tables.safetensors"
LOOPED_METHODS = ("ar",) + LOOPED_SPEC_METHODS


def load(path: str | os.PathLike, dtype="bfloat16") -> Model:
    """Load an HF checkpoint folder (config.json + safetensors) as a `Model`.

    Qwen3.5 (`qwen3_5`, `qwen3_5_text`, `qwen3_5_moe`, `qwen3_5_moe_text`) and looped models
    (`huginn_raven`: Huginn-0125 and the Raven retrofits). Every tensor's presence and shape is
    checked from the file headers before any tensor is read.
    """
    path = os.fspath(path)
    cfg = read_config(path)
    jdtype = resolve_dtype(dtype)
    if cfg.family == "looped":
        from .models import looped
        return looped.load_looped(path, dtype)
    from .models import qwen35
    source = TensorSource(path)
    params = qwen35.load_params(source, cfg, jdtype)
    tables = os.path.join(path, DRAFT_TABLES_FILE)
    if os.path.isfile(tables):
        from .drafters.table import load_draft_tables
        params["draft"] = load_draft_tables(tables, cfg.vocab_size)
    return Model(config=cfg, params=params, path=path, dtype=jdtype)


def supported_methods(model: Model) -> tuple[str, ...]:
    """Methods this model can run: MTP needs mtp.* weights, table drafters need draft tables."""
    if model.family != "qwen3_5":
        return LOOPED_METHODS
    has_mtp = bool(model.params.get("mtp"))
    tables = model.params.get("draft") or {}
    ok = {"ar": True, "ngram": True, "ngram-table": "table_keys" in tables, "mtp": has_mtp,
          "mtp-shortlist": has_mtp and "shortlist" in tables, "ngram-tree": True, "mtp-tree": has_mtp,
          "layer-skip": model.config.num_hidden_layers > 1, "residual-reuse": model.config.num_hidden_layers > 1,
          "partial-mlp": True}
    return tuple(m for m in QWEN35_METHODS if ok[m])


def _method_requirement(method: str) -> str:
    return {"mtp": "the MTP head (mtp.* tensors in the checkpoint)",
            "mtp-tree": "the MTP head (mtp.* tensors in the checkpoint)",
            "mtp-shortlist": f"the MTP head and a token shortlist ({DRAFT_TABLES_FILE}, "
                             "scripts/build_draft_tables.py)",
            "ngram-table": f"a model n-gram table ({DRAFT_TABLES_FILE}, scripts/build_draft_tables.py)"}.get(method, "")


@functools.cache
def qwen_ops(decode_rows: int = 0) -> FamilyOps:
    """Qwen3.5 AR operations; decode_rows > 0: each decode step at that padded row count (exact path)."""
    from .decoding.decode_shape import pad_rows
    from .models import qwen35

    def step(params, cfg, state, ids):
        logits, state, _ = qwen35.forward(params, cfg, state, ids, logits_for="last")
        return logits[:, 0], state

    def decode(params, cfg, state, ids):  # ids [B, 1]; logits of every row, as a verification computes them
        n_valid = jnp.ones((ids.shape[0],), jnp.int32)
        logits, state, _ = qwen35.forward(params, cfg, state, pad_rows(ids, decode_rows), n_valid=n_valid)
        return logits[:, 0], state

    return FamilyOps(init_state=qwen35.init_state, step=step, decode=decode if decode_rows else None)


def forward_logits(model: Model, input_ids, **options):
    """Logits [B, T, vocab] float32 for every position of `input_ids` [B, T] (fresh state).

    Looped models take `num_steps` (recurrence depth, default the config's mean recurrence).
    """
    ids = validate_input_ids(input_ids, model.vocab_size)
    if model.family == "looped":
        from .models import looped
        return looped.forward_logits(model, ids, **options)
    if options:
        raise InputError(f"forward_logits: unknown options for a Qwen3.5 model: {sorted(options)}")
    from .models import qwen35
    state = qwen35.init_state(model.config, ids.shape[0], ids.shape[1], model.dtype)
    logits, _ = qwen35.forward_jit(model.params, model.config, state, jnp.asarray(ids))
    return logits


def generate(model: Model, input_ids, max_new_tokens: int, method: str = "ar", temperature: float = 0.0,
             seed: int = 0, *, top_k: int = 0, top_p: float = 1.0, eos_token_id=None, max_len: int | None = None,
             **method_options) -> GenerateResult:
    """Generate `max_new_tokens` tokens after `input_ids` [B, T]; the whole loop runs on device.

    result.tokens [B, max_new_tokens] (new tokens only; after its EOS a row is padded with the first EOS id);
    result.stats: new_tokens, seconds, tokens_per_second, ... (see GenerateResult).
    eos_token_id: None = the config's EOS ids, False/() = never stop early, int or list of ints.
    max_len: KV-cache length (default prompt + max_new_tokens).
    """
    ids = validate_input_ids(input_ids, model.vocab_size)
    methods = supported_methods(model)
    if method not in methods:
        need = _method_requirement(method) if model.family == "qwen3_5" and method in QWEN35_METHODS else ""
        raise InputError(f"method {method!r} is not supported for this {model.family} model"
                         + (f": it needs {need}" if need else "") + f"; supported: {', '.join(methods)}")
    args = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
            "seed": seed}
    max_new_tokens = int_option(args, "max_new_tokens", None, 1)
    sampling = SamplingConfig(float_option(args, "temperature", None, 0.0, 1e30, " (finite)"),
                              int_option(args, "top_k", None, 0, None, " (0 = off)"),
                              float_option(args, "top_p", None, 0.0, 1.0))
    seed = int_option(args, "seed", None, 0, 2 ** 32 - 1, " (a 32-bit PRNG seed)")
    if max_len is not None:
        max_len = int_option({"max_len": max_len}, "max_len", None, 1)
    eos_ids = _eos_ids(eos_token_id, model)
    if model.family == "looped" and method != "ar":
        # Looped self-speculation sizes its own cache (its default gamma depends on the method).
        from .decoding.looped_spec import generate_looped_spec
        return generate_looped_spec(model, ids, int(max_new_tokens), method, sampling=sampling, seed=seed,
                                    eos_ids=eos_ids, max_len=max_len, **method_options)
    if method in TREE_METHODS:
        return _generate_tree_qwen(model, ids, int(max_new_tokens), method, max_len, sampling, seed, eos_ids,
                                   method_options)
    gamma = int_option(method_options, "gamma", DEFAULT_GAMMA, 0, None, " (the draft length)") if method != "ar" else 0
    if model.family != "looped":
        rows = exact_rows(method_options, gamma, "qwen3_5", _not_exact_because(method_options, gamma))
    else:
        compressed = method_options.get("cache_mode") == "compressed"
        rows = exact_rows(method_options, 0, "looped", "a compressed cache is another model (cache_mode='full' "
                                                       "is exact)" if compressed else None)
    extra, extra_what = (rows, f"decode_rows ({rows})") if rows else (gamma, f"gamma ({gamma})")
    needed = ids.shape[1] + int(max_new_tokens) + extra
    check_context_length(needed, model.config.max_position_embeddings,
                         f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens})"
                         + (f" + {extra_what}" if extra else ""))
    if max_len is None:
        max_len = needed
    if needed > max_len:
        raise InputError(f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens})"
                         + (f" + {extra_what}" if extra else "") + f" = {needed} exceeds the cache length "
                         f"max_len={max_len}")
    if model.family == "looped":
        from .decoding import looped_ar
        unknown = sorted(set(method_options) - {"num_steps", "cache_mode", "exact", "decode_rows"})
        if unknown:
            raise InputError(f"generate(method='ar') on a looped model: unknown options {unknown}; accepted: "
                             f"['cache_mode', 'decode_rows', 'exact', 'num_steps']")
        options = {k: v for k, v in method_options.items() if k not in ("exact", "decode_rows")}
        return looped_ar.generate(model, ids, int(max_new_tokens), sampling=sampling, seed=seed, eos_ids=eos_ids,
                                  max_len=max_len, decode_rows=rows, **options)
    if method != "ar":
        return _generate_speculative_qwen(model, ids, int(max_new_tokens), method, gamma, max_len, sampling, seed,
                                          eos_ids, method_options, rows)
    unknown = set(method_options) - {"exact", "decode_rows"}
    if unknown:
        raise InputError(f"generate(method={method!r}): unknown options {sorted(unknown)}; accepted: "
                         f"['decode_rows', 'exact']")
    result = generate_autoregressive(qwen_ops(rows), model.params, model.config, ids, int(max_new_tokens),
                                     max_len=max_len, sampling=sampling, seed=seed, eos_ids=eos_ids,
                                     state_dtype=model.dtype)
    result.stats.update(exact=bool(rows), decode_rows=rows or 1)
    return result


def _not_exact_because(options: dict, gamma: int) -> str | None:
    """Why a Qwen3.5 chain generation with these options cannot take the exact path (None: it can)."""
    from .decoding.decode_shape import MAX_DECODE_ROWS
    if options.get("rollback") == "pseudo":
        return ("rollback='pseudo' rebuilds the GDN state from pseudo-values, exact only in exact arithmetic "
                "(use rollback='replay' or 'snapshot')")
    if gamma + 1 > MAX_DECODE_ROWS:
        return f"gamma + 1 = {gamma + 1} exceeds the {MAX_DECODE_ROWS} rows the step recurrence verifies"
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


DEFAULT_GAMMA = 4
_CHAIN_OPTIONS = {"gamma", "rollback", "exact", "decode_rows"}
_SPEC_OPTIONS = {"ngram": _CHAIN_OPTIONS | {"max_n", "min_n"}, "ngram-table": _CHAIN_OPTIONS,
                 "mtp": _CHAIN_OPTIONS, "mtp-shortlist": _CHAIN_OPTIONS | {"shortlist_size"},
                 "layer-skip": _CHAIN_OPTIONS | {"skip_layers"}, "residual-reuse": _CHAIN_OPTIONS | {"skip_layers"},
                 "partial-mlp": _CHAIN_OPTIONS | {"mlp_keep"}}


def _generate_speculative_qwen(model, ids, max_new_tokens, method, gamma, max_len, sampling, seed, eos_ids,
                               options, rows: int) -> GenerateResult:
    from .decoding.speculative import DEFAULT_ROLLBACK, ROLLBACK_MODES, generate_speculative
    from .drafters.mtp import MtpDrafter
    from .models.qwen35 import MAX_RECURRENT_VERIFY
    from .drafters.ngram import NgramDrafter
    from .drafters.self_draft import SELF_DRAFT_METHODS
    from .drafters.table import TableDrafter
    unknown = set(options) - _SPEC_OPTIONS[method]
    if unknown:
        raise InputError(f"generate(method={method!r}): unknown options {sorted(unknown)}; "
                         f"accepted: {sorted(_SPEC_OPTIONS[method])}")
    # Replay verifies through the step recurrence (at most MAX_RECURRENT_VERIFY positions); longer drafts
    # default to the pseudo-value commit, which has no limit.
    rollback = options.get("rollback", DEFAULT_ROLLBACK if gamma + 1 <= MAX_RECURRENT_VERIFY else "pseudo")
    if rollback not in ROLLBACK_MODES:
        raise InputError(f"rollback must be one of {ROLLBACK_MODES}; got {rollback!r}")
    if rollback in ("snapshot", "replay") and gamma + 1 > MAX_RECURRENT_VERIFY:
        raise InputError(f"{rollback} rollback verifies at most {MAX_RECURRENT_VERIFY} positions; gamma={gamma} "
                         f"needs {gamma + 1} (rollback='pseudo' has no limit)")
    max_n, min_n = int_option(options, "max_n", 3, 1), int_option(options, "min_n", 1, 1)
    if not min_n <= max_n:
        raise InputError(f"n-gram sizes need 1 <= min_n <= max_n; got min_n={min_n}, max_n={max_n}")
    if method == "ngram":
        drafter = NgramDrafter(max_n=max_n, min_n=min_n)
    elif method == "ngram-table":
        drafter = TableDrafter()
    elif method == "mtp":
        drafter = MtpDrafter()
    elif method in SELF_DRAFT_METHODS:
        drafter = _self_drafter(method, options, model.config)
    else:
        available = int(model.params["draft"]["shortlist"].shape[0])
        size = int_option(options, "shortlist_size", available, 1, available, " (the stored shortlist)")
        drafter = MtpDrafter(shortlist_size=size)
    return generate_speculative(model.params, model.config, ids, max_new_tokens, drafter=drafter, gamma=gamma,
                                max_len=max_len, sampling=sampling, seed=seed, eos_ids=eos_ids,
                                state_dtype=model.dtype, rollback=rollback, decode_rows=rows)


def _self_drafter(method: str, options: dict, cfg):
    """A self-draft (layer-skip, residual-reuse, partial-mlp) with its options checked."""
    from .drafters import self_draft
    if method == "partial-mlp":
        return self_draft.SelfDrafter(method, mlp_keep=self_draft.parse_mlp_keep(
            options.get("mlp_keep", self_draft.DEFAULT_MLP_KEEP)))
    skip = options.get("skip_layers")
    skip = self_draft.default_skip_layers(cfg.num_hidden_layers) if skip is None else skip
    return self_draft.SelfDrafter(method, skip_layers=self_draft.parse_skip_layers(skip, cfg.num_hidden_layers))


TREE_METHODS = ("ngram-tree", "mtp-tree")
DEFAULT_TREE = (4, 2, 1)


def _generate_tree_qwen(model, ids, max_new_tokens, method, max_len, sampling, seed, eos_ids,
                        options) -> GenerateResult:
    """Draft trees (static branching per level), verified with tree attention and tree-WY GDN; greedy or
    exact sampling (multi-draft recursive rejection sampling over the tree)."""
    from .decoding.tree_spec import ROLLBACK_MODES, generate_tree, tree_from_branching
    from .drafters.tree import TreeMtpDrafter, TreeNgramDrafter
    unknown = set(options) - {"tree", "rollback", "exact"}
    if unknown:
        raise InputError(f"generate(method={method!r}): unknown options {sorted(unknown)}; accepted: "
                         f"['exact', 'rollback', 'tree']")
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
    need = ids.shape[1] + max_new_tokens + len(parents)
    check_context_length(need, model.config.max_position_embeddings,
                         f"prompt ({ids.shape[1]}) + max_new_tokens ({max_new_tokens}) + tree nodes ({len(parents)})")
    if max_len is not None and max_len < need:
        raise InputError(f"prompt ({ids.shape[1]}) + max_new_tokens ({max_new_tokens}) + tree nodes "
                         f"({len(parents)}) = {need} exceeds max_len={max_len}")
    drafter = TreeMtpDrafter() if method == "mtp-tree" else TreeNgramDrafter()
    return generate_tree(model.params, model.config, ids, max_new_tokens, drafter=drafter, parents=parents,
                         max_len=max_len, eos_ids=eos_ids, state_dtype=model.dtype, rollback=rollback, seed=seed,
                         sampling=sampling)
