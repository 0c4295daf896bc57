"""The headline index (benchmarks/headline.json), the result files it cites and the READMEs generated from it agree,
and the README keeps the house's size rules."""

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from benchmarks import make_readme as mr

ROOT = Path(__file__).resolve().parents[1]
ROWS = mr.load_index()


def words(text: str) -> int:
    return len(text.split())


def test_index_rows_have_every_field_and_unique_ids():
    assert 1 <= len(ROWS) <= 8, f"{len(ROWS)} headline rows; the README's table holds at most 8"
    for r in ROWS:
        missing = [f for f in mr.FIELDS if not str(r.get(f, "")).strip()]
        assert not missing, f"row {r.get('id')!r} lacks {missing}"
        assert r["claim"].endswith(".") and r["claim"].count(". ") == 0, f"{r['id']}: the claim is one sentence"
    ids = [r["id"] for r in ROWS]
    assert len(ids) == len(set(ids)), f"duplicate ids in {ids}"


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_row_file_exists_names_its_commit_and_holds_the_value(row):
    path = mr.RESULTS / row["file"]
    assert path.suffix == ".json" and path.is_file(), f"{row['id']}: {path.relative_to(ROOT)} is missing"
    data = mr.result_header(row)
    commit = data.get("git_commit", "")
    assert mr.COMMIT.match(commit), f"{row['id']}: {row['file']}'s header has no full 40-hex git_commit ({commit!r})"
    git = ROOT / ".git"
    if git.exists():
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip()
        if shallow == "false":
            found = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True)
            assert found.returncode == 0, f"{row['id']}: commit {commit} of {row['file']} is not in this repository"
    for key, expected in row.get("checks", []):
        actual = mr.lookup(data, key)
        digits = len(str(expected).split(".")[1]) if "." in str(expected) else 0
        assert round(float(actual), digits) == expected, f"{row['id']}: {row['file']}:{key} is {actual}, not {expected}"


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_row_command_runs_a_script_of_this_tree(row):
    argv = shlex.split(row["command"])
    assert argv[0] == "python", f"{row['id']}: {row['command']!r}"
    if argv[1] == "-m":
        assert argv[2] == "specdec_jax", row["command"]
    else:
        assert (ROOT / argv[1]).is_file(), f"{row['id']}: {argv[1]} does not exist"


def test_readmes_are_generated_from_the_index():
    readme = mr.README.read_text()
    assert readme == mr.with_glance(readme, ROWS), "README.md's table is stale: python benchmarks/make_readme.py"
    assert mr.BENCH_README.read_text() == mr.bench_readme(ROWS), \
        "benchmarks/README.md is stale: python benchmarks/make_readme.py"
    table = readme[readme.index(mr.START):readme.index(mr.END)]
    for line in table.splitlines()[3:]:
        for cell in line.strip("|").split(" | "):
            assert words(cell) <= 30, f"at-a-glance cell of {words(cell)} words: {cell[:80]}..."


def test_readme_stays_short():
    lines = mr.README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md is {len(lines)} lines (at most 200)"
    for line in lines:
        if line.startswith("|"):
            for cell in re.split(r"(?<!\\)\|", line.strip().strip("|")):
                assert words(cell) <= 60, f"README table cell of {words(cell)} words: {cell[:80]}..."


def test_results_hold_only_what_is_cited():
    files = [p for p in mr.RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= 80, f"{len(files)} files under benchmarks/results (at most 80)"
    cited = set()
    for doc in [mr.README, mr.BENCH_README, *ROOT.glob("docs/*.md"), *ROOT.glob("pallas_kernels/*/README.md"),
                *ROOT.glob("checkpoints/*/README.md")]:
        cited |= set(re.findall(r"[\w.+-]+\.(?:json|md|png)", doc.read_text()))
    uncited = sorted(p.name for p in files if p.name not in cited and p.with_suffix(".json").name not in cited
                     and p.with_suffix(".md").name not in cited)
    assert not uncited, f"result files no doc cites: {uncited}"


def test_index_is_valid_json_with_rows():
    data = json.loads(mr.INDEX.read_text())
    assert isinstance(data["rows"], list)
