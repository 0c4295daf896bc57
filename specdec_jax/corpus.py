"""Code corpus and tokenizer for the tiny checkpoints.

The corpus is the running interpreter's own standard library: it is always
present, needs no download, and is plain Python source, which is what the
speculative-decoding demos complete. A fixed set of top-level modules is held
out so that evaluation text and prompts are never seen by the tokenizer or the
models trained on the rest.
"""

from __future__ import annotations

import ast
import io
import json
import os
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
    """Return up to ``max_prompts`` distinct prompts from the held-out modules.

    Modules are visited round-robin (one prompt from each in turn) so that a
    few docstring-heavy modules do not crowd out the others. ``root``
    defaults to ``stdlib_root()``.
    """
    root = stdlib_root() if root is None else Path(root)
    _, heldout = split_corpus(root)
    per_module = [extract_prompts(text) for text in read_texts(root, heldout)]
    prompts: list[str] = []
    seen: set[str] = set()
    depth = 0
    while len(prompts) < max_prompts and any(depth < len(p) for p in per_module):
        for module_prompts in per_module:
            if depth < len(module_prompts) and module_prompts[depth] not in seen:
                seen.add(module_prompts[depth])
                prompts.append(module_prompts[depth])
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
    tokenizer.save(str(out / "tokenizer.json"))
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


def encode_corpus(tokenizer_dir: str | os.PathLike, texts: Sequence[str]) -> np.ndarray:
    """Encode ``texts`` into one flat array of token ids.

    Every document is followed by ``<|endoftext|>``, so documents are
    separated and a training window that crosses a boundary sees the same
    marker a sampler stops on. The dtype is ``uint16`` when the vocabulary
    fits (halving the size on disk), otherwise ``int32``.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    if eos_id is None:
        raise ValueError(f"{tokenizer_dir} has no {EOS_TOKEN!r} token")
    dtype = np.uint16 if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.int32
    pieces = []
    for encoding in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        pieces.append(np.asarray(encoding.ids, dtype=dtype))
        pieces.append(np.asarray([eos_id], dtype=dtype))
    if not pieces:
        return np.zeros((0,), dtype=dtype)
    return np.concatenate(pieces)
