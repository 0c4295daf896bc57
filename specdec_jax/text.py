"""Text at the edges: prompts from the command line and checkpoint tokenizers (shared by the CLI and the bench)."""

from __future__ import annotations

import os
import re

from .errors import CheckpointError

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """Interpret \\n, \\t, \\r and \\\\ in a command-line prompt; other backslashes stay as they are."""
    return re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], text)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether the folder holds tokenizer files (whether they load is `load_tokenizer`'s to say)."""
    return any(os.path.isfile(os.path.join(folder, n)) for n in TOKENIZER_FILES)


def load_tokenizer(folder: str | os.PathLike):
    """The checkpoint folder's tokenizer (transformers AutoTokenizer)."""
    folder = os.fspath(folder)
    if not has_tokenizer(folder):
        raise CheckpointError(f"no tokenizer in '{folder}' (expected tokenizer.json / tokenizer_config.json "
                              f"beside config.json)")
    try:
        # Only the tokenizer is used: its import-time advice that PyTorch is missing (the runtime install has
        # none) would be a stray line on stderr.
        advice = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
        try:
            from transformers import AutoTokenizer
        finally:
            if advice is None:
                del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
            else:
                os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = advice
        from transformers.utils import logging as hf_logging
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # it reads config.json and warns about model types it does not know
        try:
            return AutoTokenizer.from_pretrained(folder)
        finally:
            hf_logging.set_verbosity(verbosity)
    except Exception as e:  # transformers raises many types; one line is enough to act on
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"could not load the tokenizer in '{folder}': {first}") from None
