"""`python -m specdec_jax generate`: bad input is one line on stderr and exit code 2; a tiny checkpoint
(random weights, a small BPE tokenizer) generates end to end. Also the shipped checkpoints' aliases, the text
API (`generate_text`), method options on the command line, and the runtime's imports."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax import api, cli, methods, shipped
from specdec_jax.errors import CheckpointError, InputError
from specdec_jax.results import GenerateResult
from tests.conftest import one_line_error

REPO = Path(__file__).resolve().parents[1]


def run_module(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "specdec_jax", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)


def test_missing_folder_exits_2(tmp_path):
    proc = run_module("generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x")
    one_line_error(proc.returncode, proc.stderr, "nowhere", "does not exist")
    assert proc.stdout == ""


def test_unknown_method_exits_2(checkpoint, capsys):
    rc = cli.main(["generate", "--model", str(checkpoint), "--method", "telepathy", "--prompt", "x"])
    err = capsys.readouterr().err
    one_line_error(rc, err, "unknown method 'telepathy'", "ar")


@pytest.mark.parametrize("args, needle", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "many"], "invalid int value"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"),
    (["--num-steps", "4"], "looped models only"),
])
def test_bad_numbers_exit_2(checkpoint, capsys, args, needle):
    rc = cli.main(["generate", "--model", str(checkpoint), "--prompt", "x", *args])
    one_line_error(rc, capsys.readouterr().err, needle)


def test_shortlist_without_draft_tables_exits_2(checkpoint, capsys):
    rc = cli.main(["generate", "--model", str(checkpoint), "--prompt", "x", "--method", "layer-skip",
                   "--shortlist-size", "16"])
    one_line_error(rc, capsys.readouterr().err, "shortlist_size=16 needs the checkpoint's token shortlist")


def test_missing_tokenizer_exits_2(checkpoint, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(checkpoint / name, bare / name)
    rc = cli.main(["generate", "--model", str(bare), "--prompt", "x"])
    one_line_error(rc, capsys.readouterr().err, "no tokenizer")


def test_no_command_exits_2(capsys):
    one_line_error(cli.main([]), capsys.readouterr().err, "required")


def test_unescape():
    assert cli.unescape(r"def f(x):\n\treturn x\\n") == "def f(x):\n\treturn x\\n"
    assert cli.unescape(r"a\qb") == r"a\qb"


def test_generate_end_to_end(checkpoint, capsys):
    # In this process (cli.main, as `python -m specdec_jax` calls it: test_missing_folder_exits_2 runs that entry in
    # a process of its own): a second process started JAX and compiled every program again (~10 s on 2 cores, its
    # compilation cache cold on a fresh machine); here they serve test_generate_text_* too.
    rc = cli.main(["generate", "--model", str(checkpoint), "--prompt", r"def add(a, b):\n",
                   "--max-new-tokens", "8", "--compare-ar", "--dtype", "float32"])
    proc = capsys.readouterr()
    assert rc == 0, proc.err
    assert proc.out.startswith("def add(a, b):\n")
    lines = proc.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("method"))
    assert "tokens/s" in lines[header] and "mean accepted" in lines[header]
    row = lines[header + 1].split()
    assert row[0] == "ar" and float(row[1].replace(",", "")) > 0 and 1 <= int(row[2]) <= 8



@pytest.fixture(scope="module")
def model(checkpoint):
    return sj.load(checkpoint, dtype="float32")


# ---------------------------------------------------------------------------------- shipped checkpoints

def test_aliases_resolve_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shipped.resolve("tiny-qwen") == str(REPO / "checkpoints" / "tiny-qwen35-code")
    assert shipped.resolve("tiny-huginn") == str(REPO / "checkpoints" / "tiny-huginn-code")
    (tmp_path / "tiny-qwen").mkdir()  # a folder of that name wins
    assert shipped.resolve("tiny-qwen") == "tiny-qwen"
    assert shipped.resolve("elsewhere") == "elsewhere"  # not an alias: load's own error names it


def test_missing_alias_names_every_place_looked(tmp_path, monkeypatch, capsys):
    roots = [tmp_path / "source" / "checkpoints", tmp_path / "prefix" / "share" / "specdec_jax" / "checkpoints"]
    monkeypatch.setattr(shipped, "search_roots", lambda: roots)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"'tiny-huginn' \(tiny-huginn-code\) not found; looked in") as e:
        sj.load("tiny-huginn")
    for root in roots:
        assert str(root / "tiny-huginn-code") in str(e.value)
    one_line_error(cli.main(["generate", "--model", "tiny-qwen", "--prompt", "x"]), capsys.readouterr().err,
                   str(roots[0] / "tiny-qwen35-code"), str(roots[1] / "tiny-qwen35-code"))


def test_pyproject_installs_the_checkpoints_where_the_resolver_looks():
    """`pip install .` puts checkpoints/ under <prefix>/share/specdec_jax/checkpoints (data-files), a path
    search_roots tries; the console command is cli.main; the runtime needs no plotting library."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    data_files = project["tool"]["setuptools"]["data-files"]
    for folder in shipped.ALIASES.values():
        assert data_files["/".join(shipped.DATA_SUBDIR + (folder,))] == [f"checkpoints/{folder}/*"]
        assert (REPO / "checkpoints" / folder / "config.json").is_file()
    assert Path(sys.prefix, *shipped.DATA_SUBDIR) in shipped.search_roots()
    assert project["project"]["scripts"]["specdec-jax"] == "specdec_jax.cli:main"
    assert not any(d.startswith(("matplotlib", "torch", "optax")) for d in project["project"]["dependencies"])


def test_the_runtime_needs_no_torch_optax_or_matplotlib():
    """The demo's install has none of them: every library module but training/ imports, and the shipped model
    loads with its tokenizer, while they are unimportable."""
    code = """
import sys
for name in ("torch", "optax", "matplotlib"):
    sys.modules[name] = None
import importlib, pathlib
import pallas_kernels, specdec_jax as sj
for pkg in (sj, pallas_kernels):
    root = pathlib.Path(pkg.__file__).parent
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        if "training" not in rel.parts and rel.name != "__main__":
            importlib.import_module(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
assert sj.load("tiny-huginn", dtype="float32").tokenizer is not None
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/",
                          timeout=300)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------- text API

def test_generate_text_str_and_list(model):
    tok = model.tokenizer
    assert tok is not None
    prompt = "def add(a, b):\n"
    out = sj.generate_text(model, prompt, 4, eos_token_id=False)
    ids = sj.generate(model, [tok.encode(prompt, add_special_tokens=False)], 4, eos_token_id=False).tokens[0]
    assert out.tokens == [int(t) for t in ids] and isinstance(out.text, str)
    assert out.text == tok.decode(out.tokens, skip_special_tokens=True)
    assert out.stats["new_tokens"] == 4
    # A list: each prompt's continuation, as when it is alone (unequal lengths: ragged, or a call each).
    other = sj.generate_text(model, "x", 4, eos_token_id=False)
    both = sj.generate_text(model, ["x", prompt], 4, eos_token_id=False)
    assert both.text == [other.text, out.text] and both.tokens == [other.tokens, out.tokens]


def test_generate_text_stops_at_eos(model):
    first = sj.generate_text(model, "class Point:\n", 3, eos_token_id=False).tokens[0]
    out = sj.generate_text(model, "class Point:\n", 3, eos_token_id=first)
    assert out.tokens == [first]


def test_generate_text_unequal_prompts_go_ragged_or_one_call_each(model, monkeypatch):
    """Unequal token lengths: a list of 1-D arrays to generate; where it refuses one, a call per prompt."""
    calls = []

    def ragged(model_, ids, n, **options):
        calls.append(ids)
        return GenerateResult(np.full((len(ids), n), 7), {"new_tokens": n * len(ids), "seconds": 1.0})
    monkeypatch.setattr(api, "generate", ragged)
    prompts = ["def add(a, b):\n", "x"]
    out = sj.generate_text(model, prompts, 2, method="ngram")
    assert len(calls) == 1 and [np.ndim(row) for row in calls[0]] == [1, 1]
    assert out.tokens == [[7, 7], [7, 7]] and len(out.text) == 2

    calls.clear()
    sj.generate_text(model, ["def", "def"], 2)  # equal lengths: one [B, T] array
    assert len(calls) == 1 and np.shape(calls[0]) == (2, len(model.tokenizer.encode("def")))

    calls.clear()

    def rectangular(model_, ids, n, **options):
        if isinstance(ids, list) and np.ndim(ids[0]) == 1 and len({len(r) for r in ids}) > 1:
            raise InputError("input_ids rows must have equal lengths")
        calls.append(ids)
        return GenerateResult(np.full((1, n), 7), {"new_tokens": n, "seconds": 0.5, "compile_seconds": 1.0})
    monkeypatch.setattr(api, "generate", rectangular)
    out = sj.generate_text(model, prompts, 2)
    assert len(calls) == 2 and out.stats["new_tokens"] == 4 and out.stats["seconds"] == 1.0
    assert out.stats["tokens_per_second"] == 4.0 and len(out.stats["per_prompt"]) == 2


def test_generate_text_bad_input(model):
    with pytest.raises(InputError, match="a prompt \\(str\\) or a non-empty list of str"):
        sj.generate_text(model, [], 2)
    with pytest.raises(InputError, match="a prompt \\(str\\) or a non-empty list of str"):
        sj.generate_text(model, [[1, 2]], 2)
    with pytest.raises(InputError, match="encodes to no tokens"):
        sj.generate_text(model, "", 2)
    bare = sj.Model(model.config, model.params, path="somewhere")
    with pytest.raises(InputError, match="needs a tokenizer.*'somewhere'"):
        sj.generate_text(bare, "x", 2)
    # the tokenizer is no part of a model's identity (Model is hashable: configs are jit-static)
    assert sj.Model(model.config, None, tokenizer=1) == sj.Model(model.config, None, tokenizer=2)


# ---------------------------------------------------------------------------------- CLI options

def test_generate_help_lists_every_method_and_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    listing = out.split("methods and their options")[1].split("\noptions:")[0]
    for spec in methods.REGISTRY:
        line = next(x for x in listing.splitlines() if x.strip().startswith(spec.name + " "))
        assert line.split(None, 1)[1].startswith(methods.accepted_options(spec)[0]), line
        assert all(name in methods.OPTION_HELP for name in methods.accepted_options(spec)), spec.name
    for name in methods.OPTION_HELP:
        assert f"\n  {name} " in out


@pytest.mark.parametrize("text, value", [
    ("4", 4), ("0.5", 0.5), ("true", True), ("False", False), ("none", None), ("snapshot", "snapshot"),
    ("4,2,1", (4, 2, 1)), ("fill", "fill"), ("1e-3", 1e-3), ("3,", (3,)),
])
def test_option_values(text, value):
    assert cli.parse_value(text) == value and type(cli.parse_value(text)) is type(value)


def test_list_options_stay_lists():
    assert cli.parse_value("4", as_list=True) == (4,)


@pytest.mark.parametrize("args, needles", [
    (["--method", "ar", "--gamma", "4"], ["--gamma does not apply to method 'ar'", "exact, decode_rows"]),
    (["--method", "ar", "--skip-layers", "1"], ["--skip-layers does not apply"]),
    (["--method", "ngram", "--mlp-keep", "0.5"], ["--mlp-keep does not apply to method 'ngram'"]),
    (["--method", "ngarm"], ["unknown method 'ngarm'", "did you mean 'ngram'?"]),
    (["--method", "self-spec"], ["unknown method 'self-spec'", "another family"]),
    (["--method", "ngram", "--option", "gama=3"],
     ["unknown option 'gama' for method 'ngram'", "did you mean 'gamma'?"]),
    (["--method", "ar", "--option", "tree=2,1"], ["unknown option 'tree' for method 'ar'"]),
    (["--option", "gamma"], ["--option takes key=value"]),
    (["--method", "ngram", "--gamma", "4", "--option", "gamma=5"], ["'gamma' is set twice"]),
    (["--option", "temperature=0.5"], ["use --temperature"]),
])
def test_options_that_do_not_apply_are_refused(checkpoint, capsys, args, needles):
    one_line_error(cli.main(["generate", "--model", str(checkpoint), "--prompt", "x", *args]),
                   capsys.readouterr().err, *needles)


def test_option_reaches_the_method(checkpoint, monkeypatch, capsys):
    """--option values arrive typed at generate; progress lines go to stderr; the table has compile seconds."""
    seen = {}

    def fake(model_, ids, n, method="ar", _stream=None, **options):
        seen.update(options, method=method)
        tokens = np.ones((1, n), np.int64)
        if _stream is not None:  # sj.stream's chunks
            _stream[1](tokens)
        return GenerateResult(tokens, {"new_tokens": n, "tokens_per_second": 10.0, "compile_seconds": 1.5})
    monkeypatch.setattr(api, "generate", fake)
    rc = cli.main(["generate", "--model", str(checkpoint), "--prompt", "x", "--method", "ngram-tree",
                   "--option", "tree=2,1", "--option", "rollback=snapshot", "--option", "eos-token-id=false",
                   "--no-exact", "--max-new-tokens", "3", "--progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert seen["method"] == "ngram-tree" and seen["tree"] == (2, 1) and seen["rollback"] == "snapshot"
    assert seen["eos_token_id"] is False and seen["exact"] is False
    assert "loading" in captured.err and "compiling and running ngram-tree" in captured.err
    header = next(line for line in captured.out.splitlines() if line.startswith("method"))
    lines = captured.out.splitlines()
    row = lines[lines.index(header) + 1].split()
    assert header.split()[-2:] == ["compile", "s"] and row[0] == "ngram-tree" and row[-1] == "1.5"


def test_corrupt_checkpoint_exits_2(checkpoint, tmp_path, capsys):
    dst = tmp_path / "cut"
    shutil.copytree(checkpoint, dst)
    with open(dst / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    one_line_error(cli.main(["generate", "--model", str(dst), "--prompt", "x"]), capsys.readouterr().err,
                   "model.safetensors' is truncated or corrupt")


def test_bench_out_defaults_outside_the_repository_results(checkpoint, tmp_path, monkeypatch, capsys):
    from specdec_jax.bench import bench
    written = {}

    def write_report(result, out):
        written["out"] = out
        md = tmp_path / "bench.md"
        md.write_text("report")
        return {"json": str(tmp_path / "bench.json"), "markdown": str(md), "png": None}
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: {})
    monkeypatch.setattr(bench, "write_report", write_report)
    assert cli.main(["bench", "--model", str(checkpoint)]) == 0, capsys.readouterr().err
    assert written["out"] == os.path.join(cli.DEFAULT_BENCH_OUT, "bench-model")
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    assert f"./{cli.DEFAULT_BENCH_OUT}/bench-<model name>" in capsys.readouterr().out


def test_bench_gamma_0_is_refused(capsys):
    one_line_error(cli.main(["bench", "--gamma", "0"]), capsys.readouterr().err,
                   "--gamma must be in [1, 128] (at most --max-new-tokens); got 0")
