"""The registry of decoding methods: what `generate()` can run for each model family.

A method is a `MethodSpec`: its family, its kind (how `api.generate` runs it: plain AR, chain speculation
with a drafter, tree speculation with a tree drafter, or looped self-speculation), the options it accepts,
what a checkpoint must hold for it, and for drafting kinds how its drafter is built from the options.
Adding a drafter is one module under `drafters/` plus one entry here; `generate`, `supported_methods`, the
CLI and the benchmark harness find it through `lookup` / `supported` / `known`.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Callable

from .errors import InputError
from .options import bool_option, int_option

DRAFT_TABLES_FILE = "draft_tables.safetensors"
AR, CHAIN, TREE, LOOPED_SPEC = "ar", "chain", "tree", "looped-spec"
CHAIN_OPTIONS = frozenset({"gamma", "rollback", "exact", "decode_rows"})
_MTP_NEED = "the MTP head (mtp.* tensors in the checkpoint)"


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """name; family ("qwen3_5" | "looped"); kind (AR, CHAIN, TREE, LOOPED_SPEC); options it accepts (None:
    checked by the kind's own runner); needs: what the checkpoint must hold (the error names it); available:
    model -> bool; drafter: (model, options) -> drafter, for CHAIN and TREE (options already checked);
    default_gamma: a chain method's draft length when the caller gives none."""

    name: str
    family: str
    kind: str
    options: frozenset | None = None
    needs: str = ""
    available: Callable = lambda model: True
    drafter: Callable | None = None
    default_gamma: int = 4  # CHAIN: drafts per step unless the caller sets gamma


# ------------------------------------------------------------------------------------------ drafters

def _has_mtp(model) -> bool:
    return bool(model.params.get("mtp"))


def _tables(model) -> dict:
    return model.params.get("draft") or {}


def _ngram(model, options):
    from .drafters.ngram import NgramDrafter
    max_n, min_n = int_option(options, "max_n", 3, 1), int_option(options, "min_n", 1, 1)
    if not min_n <= max_n:
        raise InputError(f"n-gram sizes need 1 <= min_n <= max_n; got min_n={min_n}, max_n={max_n}")
    return NgramDrafter(max_n=max_n, min_n=min_n)


def _table(model, options):
    from .drafters.table import SEARCH_METHODS, TableDrafter
    search = options.get("search", TableDrafter.search)
    if search not in SEARCH_METHODS:
        raise InputError(f"search must be one of {list(SEARCH_METHODS)} (jnp.searchsorted's methods); got {search!r}")
    return TableDrafter(search=search)


def _mtp(model, options):
    from .drafters.mtp import MtpDrafter
    drafter = MtpDrafter(unroll=bool_option(options, "unroll_drafts", True), kernels=options.get("kernels", "auto"))
    drafter.check(model.params, model.config)
    return drafter


def _mtp_shortlist(model, options):
    from .drafters.mtp import MtpDrafter
    available = int(model.params["draft"]["shortlist"].shape[0])
    drafter = MtpDrafter(unroll=bool_option(options, "unroll_drafts", True), kernels=options.get("kernels", "auto"),
                         shortlist_size=int_option(options, "shortlist_size", available, 1, available,
                                                   " (the stored shortlist)"))
    drafter.check(model.params, model.config)
    return drafter


def _shortlist_size(model, options) -> int:
    """Option shortlist_size of a self-draft: 0 (default, the full vocabulary) up to the stored shortlist."""
    if int_option(options, "shortlist_size", 0, 0) == 0:
        return 0
    if "shortlist" not in _tables(model):
        raise InputError(f"shortlist_size={options['shortlist_size']!r} needs the checkpoint's token shortlist "
                         f"({DRAFT_TABLES_FILE}, scripts/build_draft_tables.py); this model has none")
    available = int(model.params["draft"]["shortlist"].shape[0])
    return int_option(options, "shortlist_size", 0, 0, available, " (the stored shortlist)")


def _self_draft(model, options, method: str):
    from .drafters import self_draft
    shortlist = _shortlist_size(model, options)
    unroll = bool_option(options, "unroll_drafts", True)
    if method == "partial-mlp":
        return self_draft.SelfDrafter(method, mlp_keep=self_draft.parse_mlp_keep(
            options.get("mlp_keep", self_draft.DEFAULT_MLP_KEEP)), shortlist_size=shortlist, unroll=unroll)
    layers = model.config.num_hidden_layers
    skip = options.get("skip_layers")
    skip = self_draft.default_skip_layers(layers) if skip is None else skip
    return self_draft.SelfDrafter(method, skip_layers=self_draft.parse_skip_layers(skip, layers),
                                  shortlist_size=shortlist, unroll=unroll)


def _tree_mtp(model, options):
    from .drafters.tree import TreeMtpDrafter
    return TreeMtpDrafter()


def _tree_ngram(model, options):
    from .drafters.tree import TreeNgramDrafter
    return TreeNgramDrafter()


# ------------------------------------------------------------------------------------------ registry

def _deep(model) -> bool:
    return model.config.num_hidden_layers > 1


_TREE_OPTIONS = frozenset({"tree", "rollback", "exact"})
# Self-drafts draft 2 tokens per step by default: a draft costs 0.7-0.85 of an AR step at the Qwen3.5-9B shape, so
# short chains win. At the acceptance measured on the shipped checkpoint and the 9B step costs measured on the
# H200, gamma 2 projects to 0.91-0.97x of AR against 0.77-0.92x at gamma 3 and 0.69-0.86x at gamma 4
# (benchmarks/results/selfdraft_projection_qwen35_9b.md).
SELF_DRAFT_GAMMA = 2
# MTP drafts 4 tokens per step by default. On the shipped checkpoint, whose head is trained for chained drafting
# (scripts/train_mtp_head.py), 8 held-out prompts end to end on the H200 (3 rounds each) gave gamma 3 / 4 / 5 / 6
# 1.85x / 1.95x / 1.98x over AR in one run and gamma 4 / 5 / 6 1.97x / 1.98x / 2.00x in another (MTP-shortlist gamma
# 4 / 5: 1.99x-2.00x / 2.04x): past 4 the gain is within run-to-run spread, while each draft is a head forward that
# also reads the output head (at the 9B shape 2 GB). Before the head was trained for chaining, gamma 3 beat 4 (1.75x /
# 1.58x in the same session; docs/LOG.md, 2026-12-03).
MTP_GAMMA = 4
REGISTRY: tuple[MethodSpec, ...] = (
    MethodSpec("ar", "qwen3_5", AR, frozenset({"exact", "decode_rows"})),
    MethodSpec("ngram", "qwen3_5", CHAIN, CHAIN_OPTIONS | {"max_n", "min_n"}, drafter=_ngram),
    MethodSpec("ngram-table", "qwen3_5", CHAIN, CHAIN_OPTIONS | {"search"},
               needs=f"a model n-gram table ({DRAFT_TABLES_FILE}, scripts/build_draft_tables.py)",
               available=lambda m: "table_keys" in _tables(m), drafter=_table),
    MethodSpec("mtp", "qwen3_5", CHAIN, CHAIN_OPTIONS | {"unroll_drafts", "kernels"}, needs=_MTP_NEED,
               available=_has_mtp,
               drafter=_mtp, default_gamma=MTP_GAMMA),
    MethodSpec("mtp-shortlist", "qwen3_5", CHAIN, CHAIN_OPTIONS | {"shortlist_size", "unroll_drafts", "kernels"},
               needs=f"the MTP head and a token shortlist ({DRAFT_TABLES_FILE}, scripts/build_draft_tables.py)",
               available=lambda m: _has_mtp(m) and "shortlist" in _tables(m), drafter=_mtp_shortlist,
               default_gamma=MTP_GAMMA),
    MethodSpec("layer-skip", "qwen3_5", CHAIN, CHAIN_OPTIONS | {"skip_layers", "shortlist_size", "unroll_drafts"},
               needs="more than one layer",
               available=_deep, drafter=lambda m, o: _self_draft(m, o, "layer-skip"), default_gamma=SELF_DRAFT_GAMMA),
    MethodSpec("residual-reuse", "qwen3_5", CHAIN, CHAIN_OPTIONS | {"skip_layers", "shortlist_size", "unroll_drafts"},
               needs="more than one layer",
               available=_deep, drafter=lambda m, o: _self_draft(m, o, "residual-reuse"), default_gamma=SELF_DRAFT_GAMMA),
    MethodSpec("partial-mlp", "qwen3_5", CHAIN, CHAIN_OPTIONS | {"mlp_keep", "shortlist_size", "unroll_drafts"},
               needs="a model on one device (its MLP cut takes the first columns in the checkpoint's order; "
                     "load without mesh=)",
               available=lambda m: getattr(m.config, "mesh", None) is None,
               drafter=lambda m, o: _self_draft(m, o, "partial-mlp"), default_gamma=SELF_DRAFT_GAMMA),
    MethodSpec("ngram-tree", "qwen3_5", TREE, _TREE_OPTIONS, drafter=_tree_ngram),
    MethodSpec("mtp-tree", "qwen3_5", TREE, _TREE_OPTIONS, needs=_MTP_NEED, available=_has_mtp, drafter=_tree_mtp),
    MethodSpec("ar", "looped", AR, frozenset({"num_steps", "cache_mode", "exact", "decode_rows"})),
    MethodSpec("self-spec", "looped", LOOPED_SPEC),
    MethodSpec("mature-spec", "looped", LOOPED_SPEC),
    MethodSpec("das-wave", "looped", LOOPED_SPEC),
    MethodSpec("parallel-sampler", "looped", LOOPED_SPEC),
)


# What each option does, one line each, for `specdec-jax generate --help` (which methods take which options is
# the registry's, `accepted_options`). Listed in the order the help shows them.
OPTION_HELP = {
    "gamma": "draft tokens per step, >= 1 (default 4; self-drafts 2; das-wave, parallel-sampler 16: the window "
             "width)",
    "exact": "true (default where possible): every decode forward at one padded row count, output equal to AR's "
             "bit for bit; false: faster, in bfloat16 may differ",
    "decode_rows": "the exact path's row count (default max(8, gamma + 1); looped max(17, gamma + 1))",
    "rollback": "how the GDN state is committed: replay (chain default), snapshot, pseudo (tree default)",
    "max_n": "longest n-gram matched against the context (default 3)",
    "min_n": "shortest n-gram matched (default 1)",
    "search": "table lookup: compare_all (default), scan_unrolled, scan, sort (jnp.searchsorted's methods)",
    "unroll_drafts": "drafts as straight-line code (default true) or a loop",
    "kernels": "the MTP head's few-row forwards: auto (default), xla, blocks",
    "shortlist_size": "draft among the first N tokens of the checkpoint's token shortlist (self-drafts: 0 = all)",
    "skip_layers": "layer indices the draft skips, e.g. 3,4 (default the middle quarter)",
    "mlp_keep": "share of each MLP's channels the draft keeps, in (0, 1] (default 0.75)",
    "tree": "branching factor per tree level, e.g. 4,2,1 (the default)",
    "num_steps": "recurrence depth of the target (default the config's mean recurrence)",
    "cache_mode": "full (default, exact) or compressed KV cache",
    "draft_steps": "recurrence depth of the draft (default max(1, num_steps // 8))",
    "read_k": "which depth's keys of the verified prefix the draft reads: aligned or deep",
    "read_v": "which depth's values of the verified prefix the draft reads: aligned or deep",
    "k": "recurrent updates per round (default 2)",
    "carry": "carry the unverified window into the next block (default true)",
    "window_init": "initial window width (default 2)",
    "rounds": "rounds per block (default gamma - window_init + 1), or fill",
    "inner_steps": "recurrences per round (default 4)",
    "epsilon": "latent-difference freezing threshold (default 0.03)",
    "ema": "embedding moving-average weight, in [0, 1) (default 0.1)",
    "max_len": "KV-cache length (default prompt + max_new_tokens + the method's extra rows)",
    "eos_token_id": "stop ids: an id, a list, or false (never stop early); default the config's",
}
GENERATE_OPTIONS = ("max_len", "eos_token_id")  # generate()'s own keywords, for every method
LIST_OPTIONS = frozenset({"tree", "skip_layers"})  # lists even when one value is given


def accepted_options(spec: MethodSpec) -> tuple[str, ...]:
    """The options `spec`'s method takes beyond generate()'s own, in OPTION_HELP's order."""
    if spec.options is not None:
        names = set(spec.options)
    else:  # looped self-speculation checks its own set (looped_plan.make_plan); num_steps is generate_looped_spec's
        from .decoding.looped_plan import METHOD_OPTIONS
        names = {"num_steps", *METHOD_OPTIONS[spec.name]}
    return tuple(k for k in OPTION_HELP if k in names) + tuple(sorted(names - set(OPTION_HELP)))


def did_you_mean(name: str, choices) -> str:
    """" (did you mean 'x'?)" for the closest of `choices` (difflib), or ""."""
    close = difflib.get_close_matches(str(name), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def spec_for(family: str, name: str) -> MethodSpec | None:
    """The registry entry of `name` in `family` (whether a given checkpoint can run it is `lookup`'s question)."""
    return next((s for s in REGISTRY if s.name == name and s.family == family), None)


def family_methods(family: str) -> tuple[str, ...]:
    return tuple(s.name for s in REGISTRY if s.family == family)


def known() -> set[str]:
    """Every method some family supports."""
    return {s.name for s in REGISTRY}


def supported(model) -> tuple[str, ...]:
    """Methods this model can run (its family's, those whose requirements the checkpoint meets)."""
    return tuple(s.name for s in REGISTRY if s.family == model.family and s.available(model))


def requirement(name: str, family: str = "qwen3_5") -> str:
    """What a checkpoint needs for `name` ("" when nothing special)."""
    return next((s.needs for s in REGISTRY if s.name == name and s.family == family), "")


def lookup(model, name: str) -> MethodSpec:
    """The spec of `name` for this model, or one InputError saying what is missing / what is supported."""
    spec = spec_for(model.family, name)
    if spec is None or not spec.available(model):
        names = supported(model)
        need = spec.needs if spec is not None else ""
        hint = did_you_mean(name, names or family_methods(model.family)) if spec is None else ""
        raise InputError(f"method {name!r} is not supported for this {model.family} model{hint}"
                         + (f": it needs {need}" if need else "") + f"; supported: {', '.join(names)}")
    return spec


def check_options(spec: MethodSpec, options: dict) -> None:
    """Unknown options of a method with a fixed option set: one InputError listing what it accepts."""
    if spec.options is None:
        return
    unknown = set(options) - spec.options
    if unknown:
        hints = "".join(did_you_mean(k, spec.options) for k in sorted(unknown))
        raise InputError(f"generate(method={spec.name!r}): unknown options {sorted(unknown)}{hints}; "
                         f"accepted: {sorted(spec.options)}")
