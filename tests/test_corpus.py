"""Tests for the stdlib code corpus, prompt extraction and BPE tokenizer."""

import numpy as np
import pytest

from specdec_jax.training import corpus

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


# ------------------------------------------------------------------ the larger corpus (site-packages)

def _file(package, path, text):
    import hashlib
    return corpus.SourceFile(package, "1.0", path, text, hashlib.sha256(text.encode()).hexdigest())


def test_deduplicate_keeps_the_first_of_each_text():
    a, b, a2 = _file("p", "a.py", "x = 1\n"), _file("p", "b.py", "y = 2\n"), _file("q", "vendored/a.py", "x = 1\n")
    assert corpus.deduplicate([a, b, a2]) == [a, b]


def test_split_by_module_holds_out_whole_directories_and_the_stdlib_modules():
    files = [_file("pkg", f"pkg/sub{i % 40}/m{i}.py", f"v = {i}\n") for i in range(400)]
    files += [_file(corpus.STDLIB_PACKAGE, name, f"# {name}\n") for name in corpus.HELD_OUT_MODULES[:3]]
    files += [_file(corpus.STDLIB_PACKAGE, "json/decoder.py", "# decoder\n")]
    files += [_file("other", "copy_of_heldout.py", "# bisect.py\n")]  # same text as a held-out module
    train, held = corpus.split_by_module(files, 0.25)
    assert {id(f) for f in train}.isdisjoint(id(f) for f in held)
    assert len(train) + len(held) == len(files) - 1  # the copy of a held-out text is dropped
    assert all(f.path != "copy_of_heldout.py" for f in train + held)
    held_groups = {f.module_group for f in held if f.package == "pkg"}
    assert 0 < len(held_groups) < 40  # whole directories, about a quarter of them
    assert not any(f.module_group in held_groups for f in train)
    assert {f.path for f in held if f.package == corpus.STDLIB_PACKAGE} == set(corpus.HELD_OUT_MODULES[:3])
    assert corpus.split_by_module(files, 0.25) == (train, held)  # stable: no run-dependent randomness


def test_cap_chars_keeps_a_stable_subset_in_input_order():
    files = [_file("p", f"m{i}.py", "x" * (10 + i)) for i in range(50)]
    kept = corpus.cap_chars(files, 400)
    assert 0 < sum(len(f.text) for f in kept) <= 400
    assert kept == [f for f in files if f in kept] and kept == corpus.cap_chars(files, 400)
    assert corpus.cap_chars(files, 0) == files


def test_file_manifest_and_licence_note():
    train = [_file("p", "a.py", "a\n"), _file("q", "b.py", "b\n")]
    held = [_file("p", "c.py", "c\n")]
    m = corpus.file_manifest(train, held)
    assert m["p"]["version"] == "1.0" and [r[0] for r in m["p"]["train"]] == ["a.py"]
    assert m["p"]["heldout"] == [["c.py", held[0].sha256[:corpus.MANIFEST_HASH_HEX]]]
    note = corpus.licence_note({"p": {"version": "1.0", "license": "MIT"}, "q": {"version": "2", "license": "A|B"}},
                               {"p": 2, "q": 1})
    assert "| p | 1.0 | 2 | MIT |" in note and "| q | 2 | 1 | A/B |" in note


def test_installed_sources_reads_distributions_and_leaves_out_tests_and_this_project():
    files, packages = corpus.installed_sources()
    names = {f.package for f in files}
    assert "numpy" in names and "numpy" in packages and packages["numpy"]["license"] != ""
    assert not any(f.package.replace("-", "_").lower() == "specdec_jax" for f in files)
    assert not any("/tests/" in "/" + f.path or f.path.split("/")[-1].startswith("test_") for f in files)
    assert all(f.path.endswith(".py") for f in files)


def test_parallel_encoding_equals_serial(small_tokenizer, monkeypatch):
    docs = [f"def f{i}():\n    return {i} * 'ü'\n" * (1 + i % 3) for i in range(40)]
    serial = corpus.encode_corpus(small_tokenizer, docs, workers=1)
    monkeypatch.setattr(corpus, "_PARALLEL_ENCODE_CHARS", 0)
    np.testing.assert_array_equal(corpus.encode_corpus(small_tokenizer, docs, workers=2), serial)
