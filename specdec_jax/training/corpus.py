"""Code corpus and tokenizer for the tiny checkpoints.

Two sources, both offline: the running interpreter's standard library (always
present) and the Python sources of every installed distribution (its
site-packages, found through each distribution's RECORD). Files are
deduplicated by text; held out are a fixed set of stdlib modules (the benchmark
prompts come from them) plus whole package directories chosen by a stable hash,
so evaluation text and prompts are never seen by the tokenizer or the models
trained on the rest.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import sysconfig
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

# Held out for evaluation and prompt extraction. Only top-level single-file
# modules that every CPython 3.12 ships, so the split does not depend on how
# a distribution packages the stdlib. They are small, docstring-rich and
# mostly pure Python, which gives natural "signature + docstring" prompts.
# Kept sorted so the tuple order equals the order `split_corpus` returns.
HELD_OUT_MODULES: tuple[str, ...] = (
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "difflib.py",
    "fractions.py",
    "graphlib.py",
    "heapq.py",
    "pprint.py",
    "shlex.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
)

# Test suites are dominated by boilerplate and deliberately odd code (bad
# encodings, syntax-error fixtures); idlelib and lib2to3 are large, niche and
# partly duplicated elsewhere; site/dist-packages are third-party code whose
# contents vary between machines and would make the corpus non-reproducible.
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)


def stdlib_root() -> Path:
    """Return the standard-library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: str | os.PathLike) -> list[str]:
    """List the ``.py`` files under ``root`` as sorted POSIX relative paths.

    Directories named in ``_EXCLUDED_DIRS`` (``site-packages``, ``test``,
    ``tests``, ``idlelib``, ``lib2to3``, ``__pycache__``, ...) are skipped at
    any depth.
    """
    root = Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.endswith(".py"):
                found.append((rel_dir / name).as_posix())
    return sorted(found)


def split_corpus(root: str | os.PathLike) -> tuple[list[str], list[str]]:
    """Split the source files under ``root`` into ``(train, heldout)``.

    Held out are the entries of ``HELD_OUT_MODULES`` that exist under
    ``root`` (in that tuple's order); train is every other file from
    ``list_source_files``. Both lists are deterministic.
    """
    files = list_source_files(root)
    present = set(files)
    heldout = [name for name in HELD_OUT_MODULES if name in present]
    held = set(heldout)
    train = [path for path in files if path not in held]
    return train, heldout


def read_texts(root: str | os.PathLike, paths: Iterable[str]) -> list[str]:
    """Read each of ``paths`` (relative to ``root``) as UTF-8 text.

    Undecodable bytes become U+FFFD rather than aborting the corpus build.
    """
    root = Path(root)
    return [(root / path).read_text(encoding="utf-8", errors="replace") for path in paths]


def _prompt_functions(body: Sequence[ast.stmt]):
    """Yield module-level functions and methods (any class nesting), in source order."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from _prompt_functions(node.body)


def extract_prompts(text: str, max_prompts: int | None = None) -> list[str]:
    """Extract code-completion prompts from Python source ``text``.

    For every module-level function or method whose first statement is a
    docstring, the prompt is the verbatim source from its ``def`` line (not
    its decorators) through the end of the docstring, ending with a newline.
    Method prompts keep their original indentation. Prompts are returned in
    source order, at most ``max_prompts`` of them (all when ``None``).
    Source that does not parse yields no prompts.
    """
    try:
        with warnings.catch_warnings():
            # Old-style escapes in some sources raise SyntaxWarning on 3.12; irrelevant here.
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(text)
    except SyntaxError:
        return []
    # Split exactly where the parser counts lines (\n, \r\n, \r), unlike
    # str.splitlines, which also breaks on form feeds and other separators.
    lines = io.StringIO(text, newline="").readlines()
    prompts = []
    for func in _prompt_functions(tree.body):
        if max_prompts is not None and len(prompts) >= max_prompts:
            break
        first = func.body[0]
        if not (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            continue
        doc = first.value
        doc_line = lines[doc.lineno - 1]
        # A docstring on the header line (`def f(): "doc"`) leaves no room
        # for an indented body to complete, so it makes a poor prompt.
        if doc_line.encode("utf-8")[: doc.col_offset].strip():
            continue
        chunk = lines[func.lineno - 1 : doc.end_lineno]
        # ast column offsets count UTF-8 bytes; drop anything after the docstring.
        chunk[-1] = chunk[-1].encode("utf-8")[: doc.end_col_offset].decode("utf-8")
        prompt = "".join(chunk)
        prompts.append(prompt if prompt.endswith(("\n", "\r")) else prompt + "\n")
    return prompts


def heldout_prompts(root: str | os.PathLike | None = None, max_prompts: int = 64) -> list[str]:
    """Return up to ``max_prompts`` distinct prompts from the stdlib's held-out modules
    (`prompts_from_texts`). ``root`` defaults to ``stdlib_root()``."""
    root = stdlib_root() if root is None else Path(root)
    _, heldout = split_corpus(root)
    return prompts_from_texts(read_texts(root, heldout), max_prompts)


def prompts_from_texts(texts: Sequence[str], max_prompts: int) -> list[str]:
    """Up to ``max_prompts`` distinct signature + docstring prompts, visiting the texts round-robin (one
    prompt from each in turn) so that a few docstring-heavy modules do not crowd out the others."""
    per_text = [extract_prompts(text) for text in texts]
    prompts: list[str] = []
    seen: set[str] = set()
    depth = 0
    while len(prompts) < max_prompts and any(depth < len(p) for p in per_text):
        for text_prompts in per_text:
            if depth < len(text_prompts) and text_prompts[depth] not in seen:
                seen.add(text_prompts[depth])
                prompts.append(text_prompts[depth])
                if len(prompts) == max_prompts:
                    break
        depth += 1
    return prompts


def train_tokenizer(
    texts: Sequence[str],
    out_dir: str | os.PathLike,
    vocab_size: int = 8192,
    *,
    model_max_length: int = 2048,
    min_frequency: int = 2,
) -> Path:
    """Train a byte-level BPE tokenizer on ``texts`` and save it to ``out_dir``.

    Writes ``tokenizer.json`` and a ``tokenizer_config.json`` that
    ``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads. Token id 0
    is ``<|endoftext|>`` (also BOS) and id 1 is ``<|pad|>``. Because every byte
    is in the initial alphabet and nothing is normalised, decoding an encoding
    reproduces any text exactly. Returns ``out_dir`` as a ``Path``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # No prefix space: a leading space would change the first token of every
    # prompt and break exact decode(encode(x)) == x.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)  # compact: the checkpoint folders have a size budget
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "model_max_length": model_max_length,
        "add_prefix_space": False,
        # Transformers versions that honour this flag strip spaces before
        # punctuation on decode, corrupting code such as `x = a .b`.
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def encode_corpus(tokenizer_dir: str | os.PathLike, texts: Sequence[str], workers: int | None = None) -> np.ndarray:
    """Encode ``texts`` into one flat array of token ids.

    Every document is followed by ``<|endoftext|>``, so documents are
    separated and a training window that crosses a boundary sees the same
    marker a sampler stops on. The dtype is ``uint16`` when the vocabulary
    fits (halving the size on disk), otherwise ``int32``. Large inputs are
    encoded by ``workers`` processes (default: one per CPU), in order.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    if eos_id is None:
        raise ValueError(f"{tokenizer_dir} has no {EOS_TOKEN!r} token")
    dtype = np.uint16 if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.int32
    workers = workers or os.cpu_count() or 1
    chars = sum(map(len, texts))
    if workers == 1 or chars < _PARALLEL_ENCODE_CHARS:
        pieces = [_encode_slice(tokenizer, texts, eos_id, dtype)]
    else:
        pieces = _encode_in_processes(str(Path(tokenizer_dir) / "tokenizer.json"), texts, eos_id, dtype, workers)
    pieces = [p for p in pieces if p.size]
    return np.concatenate(pieces) if pieces else np.zeros((0,), dtype=dtype)


_PARALLEL_ENCODE_CHARS = 20_000_000  # below this, process start-up costs more than it saves


def _encode_slice(tokenizer, texts: Sequence[str], eos_id: int, dtype) -> np.ndarray:
    pieces = []
    for encoding in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        pieces.append(np.asarray(encoding.ids, dtype=dtype))
        pieces.append(np.asarray([eos_id], dtype=dtype))
    return np.concatenate(pieces) if pieces else np.zeros((0,), dtype=dtype)


def _encode_task(tokenizer_file: str, texts: list[str], eos_id: int, dtype) -> np.ndarray:
    from tokenizers import Tokenizer
    return _encode_slice(Tokenizer.from_file(tokenizer_file), texts, eos_id, dtype)


def _encode_in_processes(tokenizer_file: str, texts: Sequence[str], eos_id: int, dtype, workers: int):
    """Contiguous slices of about equal characters (4 per worker), encoded by spawned processes (not forked:
    the caller may hold threads, e.g. JAX's), results in order."""
    import concurrent.futures
    import multiprocessing

    bounds, target, acc = [0], sum(map(len, texts)) / (4 * workers), 0
    for i, t in enumerate(texts):
        acc += len(t)
        if acc >= target:
            bounds.append(i + 1)
            acc = 0
    if bounds[-1] != len(texts):
        bounds.append(len(texts))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_encode_task, tokenizer_file, list(texts[a:b]), eos_id, dtype)
                   for a, b in zip(bounds[:-1], bounds[1:])]
        return [f.result() for f in futures]


# ------------------------------------------------------------------ installed packages (larger corpus)

STDLIB_PACKAGE = "python-stdlib"


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One Python source file of the corpus: where it came from and its text.

    ``package`` is the distribution name (``python-stdlib`` for the standard library), ``path`` the
    file's path inside it (POSIX, relative), ``sha256`` the hash of its UTF-8 text.
    """

    package: str
    version: str
    path: str
    text: str
    sha256: str

    @property
    def module_group(self) -> str:
        """The held-out unit: a package directory (``package:dir``), so a module and its siblings
        fall on the same side of the split."""
        return f"{self.package}:{Path(self.path).parent.as_posix()}"


def _source(package: str, version: str, rel: str, raw: bytes) -> SourceFile:
    text = raw.decode("utf-8", errors="replace")
    return SourceFile(package, version, rel, text, hashlib.sha256(text.encode("utf-8")).hexdigest())


def _excluded(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in _EXCLUDED_DIRS or p.startswith(("test_", "tests_")) for p in parts[:-1]) or \
        parts[-1].startswith("test_") or parts[-1].endswith("_test.py")


def stdlib_sources() -> list[SourceFile]:
    """The standard library's source files (as `list_source_files`), package ``python-stdlib``."""
    root = stdlib_root()
    version = platform.python_version()
    return [_source(STDLIB_PACKAGE, version, rel, (root / rel).read_bytes()) for rel in list_source_files(root)]


def installed_sources(max_file_bytes: int = 400_000, excluded_packages: Iterable[str] = ("specdec_jax",)
                      ) -> tuple[list[SourceFile], dict[str, dict]]:
    """The ``.py`` files of every installed distribution (the running interpreter's site-packages), from
    each distribution's RECORD, sorted by (package, path); tests, files over ``max_file_bytes``
    (generated tables) and ``excluded_packages`` (this project, when installed) are left out. Also
    returns ``{package: {"version", "license"}}``."""
    excluded_packages = {p.replace("-", "_").lower() for p in excluded_packages}
    files, packages = [], {}
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        meta = dist.metadata  # parsed on every access: read once
        name, version = (meta["Name"] or "").strip(), meta["Version"] or ""
        if not name or name in packages or name.replace("-", "_").lower() in excluded_packages:
            continue
        entries = dist.files
        if not entries:
            continue
        packages[name] = {"version": version, "license": distribution_license(meta)}
        for entry in sorted(entries, key=str):
            rel = Path(str(entry)).as_posix()
            if not rel.endswith(".py") or rel.startswith("..") or _excluded(rel):
                continue
            path = Path(dist.locate_file(entry))
            try:
                if not path.is_file() or path.stat().st_size > max_file_bytes:
                    continue
                raw = path.read_bytes()
            except OSError:
                continue
            files.append(_source(name, version, rel, raw))
    return files, packages


def distribution_license(meta) -> str:
    """A distribution's licence as its metadata states it: License-Expression, else a one-line License
    field, else the licence classifiers; "unknown" when none is given."""
    expression = (meta.get("License-Expression") or "").strip()
    if expression:
        return expression
    text = (meta.get("License") or "").strip()
    if text and "\n" not in text and len(text) <= 80:
        return text
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return "; ".join(classifiers)
    return text.splitlines()[0][:80] if text else "unknown"


def deduplicate(files: Sequence[SourceFile]) -> list[SourceFile]:
    """Keep the first file of each distinct text (vendored copies, packages installed twice)."""
    seen: set[str] = set()
    out = []
    for f in files:
        if f.sha256 not in seen:
            seen.add(f.sha256)
            out.append(f)
    return out


def _fraction(key: str) -> float:
    """A stable number in [0, 1) from a string (the split and the caps must not depend on the run)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


def split_by_module(files: Sequence[SourceFile], heldout_fraction: float) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, heldout): the stdlib's `HELD_OUT_MODULES` plus every package directory whose stable hash
    falls under ``heldout_fraction``; a train file whose text equals a held-out one is dropped."""
    held = [f for f in files if (f.package == STDLIB_PACKAGE and f.path in HELD_OUT_MODULES)
            or (f.package != STDLIB_PACKAGE and _fraction(f.module_group) < heldout_fraction)]
    held_ids = {id(f) for f in held}
    held_hashes = {f.sha256 for f in held}
    train = [f for f in files if id(f) not in held_ids and f.sha256 not in held_hashes]
    return train, held


def cap_chars(files: Sequence[SourceFile], max_chars: int) -> list[SourceFile]:
    """At most ``max_chars`` characters: files are kept in stable hash order until the cap (the order
    of the result is the input order)."""
    if max_chars <= 0 or sum(len(f.text) for f in files) <= max_chars:
        return list(files)
    keep, total = set(), 0
    for f in sorted(files, key=lambda f: _fraction(f.package + "/" + f.path)):
        if total + len(f.text) > max_chars:
            continue
        keep.add(id(f))
        total += len(f.text)
    return [f for f in files if id(f) in keep]


MANIFEST_HASH_HEX = 16  # 64 bits of each file's SHA-256: enough to tell files apart, a quarter of the bytes


def file_manifest(train: Sequence[SourceFile], heldout: Sequence[SourceFile]) -> dict:
    """Every corpus file grouped by package: ``{package: {"version", "train": [[path, sha256 prefix]],
    "heldout": [...]}}``, in corpus order."""
    out: dict[str, dict] = {}
    for split, files in (("train", train), ("heldout", heldout)):
        for f in files:
            entry = out.setdefault(f.package, {"version": f.version, "train": [], "heldout": []})
            entry[split].append([f.path, f.sha256[:MANIFEST_HASH_HEX]])
    return out


def licence_note(packages: dict[str, dict], counts: dict[str, int]) -> str:
    """Markdown: which packages' source the corpus holds, with each one's stated licence."""
    lines = ["# Training data licences", "",
             "The model in this folder was trained on Python source files of the packages below (and the",
             "Python standard library, PSF-2.0), read from one machine's installed packages by",
             "`scripts/build_corpus.py`; `corpus_manifest.json.gz` lists every file with its package, version",
             "and SHA-256 prefix. The source stays under its own licence; the weights are a small test model, not a",
             "redistribution of that source. Licences as each package's metadata states them:", "",
             "| package | version | files | licence |", "|---|---|---|---|"]
    for name in sorted(counts, key=str.lower):
        info = packages.get(name, {"version": "", "license": "PSF-2.0" if name == STDLIB_PACKAGE else "unknown"})
        lines.append(f"| {name} | {info['version']} | {counts[name]} | {info['license'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"
