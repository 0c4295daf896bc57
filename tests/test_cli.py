"""`python -m specdec_jax generate`: bad input is one line on stderr and exit code 2; a tiny checkpoint
(random weights, a small BPE tokenizer) generates end to end."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from specdec_jax import cli, corpus, training

REPO = Path(__file__).resolve().parents[1]
TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"] * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    tok_dir = corpus.train_tokenizer(TEXTS, root / "tokenizer", vocab_size=300, min_frequency=1)
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size()
    o = training.TrainOptions(hidden=32, layers=4, heads=4, kv_heads=2, head_dim=16, linear_key_heads=2,
                              linear_value_heads=4, linear_head_dim=8, intermediate=64)
    cfg = training.qwen35_config(vocab, o)
    params = training.init_qwen35_params(cfg, jax.random.PRNGKey(0), std=0.2)
    folder = root / "model"
    training.save_checkpoint(folder, "qwen35", params, cfg, training.qwen35_config_json(cfg), tok_dir)
    return folder


def run_module(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "specdec_jax", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)


def one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


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


def test_generate_end_to_end(checkpoint):
    proc = run_module("generate", "--model", str(checkpoint), "--prompt", r"def add(a, b):\n",
                      "--max-new-tokens", "8", "--compare-ar", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def add(a, b):\n")
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("method"))
    assert "tokens/s" in lines[header] and "mean accepted" in lines[header]
    row = lines[header + 1].split()
    assert row[0] == "ar" and float(row[1].replace(",", "")) > 0 and 1 <= int(row[2]) <= 8
