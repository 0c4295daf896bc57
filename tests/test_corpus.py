"""Tests for the stdlib code corpus, prompt extraction and BPE tokenizer."""

import numpy as np
import pytest

from specdec_jax import corpus

SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "class A:\n\tdef f(self):\n\t\treturn {'k': [1, 2]}  # tabs\n",
    "\n\n\nx = 1\n\n\n\ny = x .real\n\n",
    '    s = "héllo wörld ☃ 日本語 🐍"\r\n',
    "f( )  ;  g ,h\n# trailing spaces   \n   ",
]

SOURCE = '''\
"""Module docstring is not a prompt."""
import os


@decorator
def top(a, b=1):
    """Add things."""
    return a + b


def multi(
    x,
    y,
):
    """First line.

    More detail.
    """
    def inner():
        """Nested functions are not prompts."""


def nodoc():
    return 1


def header(): "Docstring on the header line is skipped."


class Klass:
    """Class docstrings are not prompts."""

    async def method(self) -> str:
        """Méthode with ünïcode."""  # trailing comment
        return "x"
'''

EXPECTED_PROMPTS = [
    'def top(a, b=1):\n    """Add things."""\n',
    'def multi(\n    x,\n    y,\n):\n    """First line.\n\n    More detail.\n    """\n',
    '    async def method(self) -> str:\n        """Méthode with ünïcode."""\n',
]


def test_split_is_deterministic_disjoint_and_complete():
    root = corpus.stdlib_root()
    train, heldout = corpus.split_corpus(root)
    assert (train, heldout) == corpus.split_corpus(root)
    assert heldout == list(corpus.HELD_OUT_MODULES)
    assert not set(train) & set(heldout)
    assert train == sorted(train) and len(train) > 100
    assert sorted(train + heldout) == corpus.list_source_files(root)
    excluded = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}
    assert not any(excluded & set(path.split("/")[:-1]) for path in train)


def test_extract_prompts_exact():
    assert corpus.extract_prompts(SOURCE, max_prompts=10) == EXPECTED_PROMPTS
    assert corpus.extract_prompts(SOURCE, max_prompts=2) == EXPECTED_PROMPTS[:2]
    assert corpus.extract_prompts("def broken(:\n") == []


def test_heldout_prompts():
    prompts = corpus.heldout_prompts(max_prompts=24)
    assert len(prompts) == 24 and len(set(prompts)) == 24
    assert prompts == corpus.heldout_prompts(max_prompts=24)
    for prompt in prompts:
        assert prompt.lstrip().startswith(("def ", "async def "))
        assert prompt.endswith(('"\n', "'\n"))


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    root = corpus.stdlib_root()
    train, _ = corpus.split_corpus(root)
    texts = corpus.read_texts(root, [p for p in train if "/" not in p][:6])
    return corpus.train_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=512)


def test_tokenizer_round_trips_with_transformers(small_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(small_tokenizer)
    assert tok.convert_tokens_to_ids(corpus.EOS_TOKEN) == 0 == tok.eos_token_id
    assert tok.pad_token == corpus.PAD_TOKEN and tok.pad_token_id != tok.eos_token_id
    assert len(tok) == 512
    for text in SNIPPETS + EXPECTED_PROMPTS:
        ids = tok.encode(text)
        assert 0 not in ids
        assert tok.decode(ids) == text


def test_encode_corpus_separates_documents_with_eos(small_tokenizer):
    docs = ["def f():\n    pass\n", "x = 'ü'\n", ""]
    ids = corpus.encode_corpus(small_tokenizer, docs)
    assert ids.ndim == 1 and ids.dtype in (np.uint16, np.int32)
    eos_positions = np.flatnonzero(ids == 0)
    assert eos_positions.size == len(docs) and eos_positions[-1] == ids.size - 1

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(small_tokenizer / "tokenizer.json"))
    pieces = np.split(ids, eos_positions + 1)[: len(docs)]
    assert [tok.decode(p[:-1].tolist()) for p in pieces] == docs
