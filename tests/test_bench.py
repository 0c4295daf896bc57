"""`python -m specdec_jax bench`: paired runs on a tiny checkpoint write JSON / Markdown / PNG; the bootstrap
interval on known data; bad input is one line on stderr and exit code 2, before any generation."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from specdec_jax.bench import bench, harness, profiling
from specdec_jax import cli
from tests.conftest import one_line_error

@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("def add(a, b):\\n    return\n\nclass Point:\\n    def __init__(self, x, y):\\n\n")
    return path


def test_bootstrap_ci_known_data():
    # Two values: resampled medians are 1 (p=1/4), 1.5 (p=1/2), 2 (p=1/4), so the 95% interval is [1, 2].
    assert bench.bootstrap_ci([1.0, 2.0]) == (1.0, 2.0)
    assert bench.bootstrap_ci([3.0] * 7) == (3.0, 3.0)
    assert bench.bootstrap_ci([1.25]) == (1.25, 1.25)
    assert all(np.isnan(bench.bootstrap_ci([])))
    x = np.arange(1, 101, dtype=float)
    lo, hi = bench.bootstrap_ci(x)
    assert (lo, hi) == bench.bootstrap_ci(x)  # fixed seed: deterministic
    # The median of 1..100 is 50.5; its sampling sd is about 1.25 * 29 / sqrt(100) = 3.6, so the interval
    # spans roughly +-7 around it.
    assert 40 < lo < 50.5 < hi < 61
    assert 8 < hi - lo < 20
    lo_m, hi_m = bench.bootstrap_ci(x, np.mean)
    assert abs((lo_m + hi_m) / 2 - 50.5) < 1.5 and 9 < hi_m - lo_m < 14  # 2 * 1.96 * 29 / 10 = 11.3


def test_busy_and_idle_stretches_of_kernel_intervals():
    # [0, 10] and [5, 12] overlap (busy 12), then idle 3, [15, 20], idle 20, [40, 41]
    busy, idle = profiling.busy_and_idle([(40.0, 41.0), (0.0, 10.0), (15.0, 20.0), (5.0, 12.0)])
    assert busy == 18.0 and idle == [3.0, 20.0]
    assert profiling.busy_and_idle([]) == (0.0, [])
    assert profiling.busy_and_idle([(2.0, 9.0), (3.0, 4.0)]) == (7.0, [])  # nested: no idle


def test_wait_sites_name_the_kernels_around_each_long_idle_stretch():
    events = [(0.0, 10.0, "a"), (5.0, 12.0, "b"), (40.0, 41.0, "c"), (41.5, 42.0, "d"), (80.0, 90.0, "c")]
    # idle: 12 -> 40 after b (b ended last), 41 -> 41.5 (short), 42 -> 80 after d
    assert profiling.wait_sites(events, min_gap=10.0) == [("d", "c", 1, 38.0), ("b", "c", 1, 28.0)]
    assert profiling.wait_sites(events + [(100.0, 101.0, "x"), (130.0, 131.0, "c")], min_gap=10.0)[0] == \
        ("d", "c", 1, 38.0)
    assert profiling.wait_sites([(0.0, 5.0, "a"), (1.0, 2.0, "b"), (20.0, 21.0, "c")], min_gap=10.0) == \
        [("a", "c", 1, 15.0)]  # the kernel that ended last, not the one that started last


def test_call_edges_span_the_call_annotation_up_to_its_first_and_from_its_last_kernel():
    kernels = [(30.0, 40.0, "a"), (10.0 + 40.0, 70.0, "b"), (45.0, 60.0, "c")]
    host = [(5.0, 100.0, profiling.CALL_ANNOTATION), (6.0, 25.0, "dispatch"), (72.0, 95.0, "sync")]
    lead_in, tail = profiling.call_edges(kernels, host)
    assert lead_in == (5.0, 30.0) and tail == (70.0, 100.0)
    assert profiling.host_during([lead_in], host)[1:] == [("dispatch", 1, 19.0)]
    assert profiling.call_edges(kernels, host[1:]) is None  # no annotation
    assert profiling.call_edges([], host) is None  # no kernel (a CPU trace)


def test_host_during_waits_sums_each_host_event_over_the_idle_windows():
    kernels = [(0.0, 10.0, "a"), (40.0, 41.0, "c"), (41.5, 42.0, "d"), (80.0, 90.0, "c")]
    assert profiling.wait_windows(kernels, min_gap=10.0) == [(10.0, 40.0), (42.0, 80.0)]
    host = [(5.0, 20.0, "sync"), (30.0, 90.0, "update"), (41.0, 41.4, "launch"), (95.0, 99.0, "late")]
    # sync overlaps 10 -> 20; update 30 -> 40 and 42 -> 80; launch lies in a short gap; late in none
    assert profiling.host_during(profiling.wait_windows(kernels, min_gap=10.0), host) == [
        ("update", 2, 48.0), ("sync", 1, 10.0)]
    assert profiling.host_during([], host) == []


def test_host_api_time_by_kind():
    events = [("cuLaunchKernel", 3.0), ("cuLaunchKernelEx", 5.0), ("cuStreamSynchronize", 40.0),
              ("cuMemcpyDtoHAsync_v2", 2.0), ("ThunkExecutor::Execute", 100.0)]
    assert profiling.host_api_time(events) == {"launch": [2, 8.0], "sync": [1, 40.0], "copy": [1, 2.0]}


def test_kernel_profile_runs_and_reports_on_any_machine():
    profile = profiling.device_kernel_profile(lambda: jax.numpy.ones(4) * 2, per=1.0)
    assert profile["wall_us"] > 0 and profile["busy_us"] >= 0 and profile["idle_us"] >= profile["wait_us"] >= 0
    assert set(profile["host_api"]) == {"launch", "sync", "copy"}
    md = "\n".join(profiling.kernel_profile_markdown({"one call": profile}))
    assert "| one call |" in md and "host launch API" in md


def test_decode_tokens_per_second():
    # The first token comes from the prefill, so 9 of the 10 new tokens are decode tokens.
    assert bench.decode_tokens_per_second({"new_tokens": 10, "decode_seconds": 0.5}) == pytest.approx(18.0)


def test_load_prompt_texts(tmp_path, prompts_file):
    assert bench.load_prompt_texts(prompts_file) == ["def add(a, b):\n    return",
                                                     "class Point:\n    def __init__(self, x, y):\n"]
    assert bench.load_prompt_texts(prompts_file, 1) == ["def add(a, b):\n    return"]
    js = tmp_path / "p.json"
    js.write_text(json.dumps(["x = 1\n", "def f():\n"]))
    assert bench.load_prompt_texts(js) == ["x = 1\n", "def f():\n"]
    held = bench.load_prompt_texts("heldout", 3)
    assert len(held) == 3 and all(t.lstrip().startswith(("def ", "async def ")) for t in held)


def test_bench_writes_reports(checkpoint, prompts_file, tmp_path, capsys):
    out = tmp_path / "report"
    rc = cli.main(["bench", "--model", str(checkpoint), "--methods", "ar,ngram", "--prompts", str(prompts_file),
                   "--max-new-tokens", "8", "--gamma", "2", "--dtype", "float32", "--out", str(out),
                   "--max-prompt-tokens", "5"])  # both prompts left-truncated to 5 tokens: one compilation each
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    paths = [out / "bench.json", out / "bench.md", out / "bench.png"]
    assert all(p.is_file() for p in paths)
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    result = json.loads(paths[0].read_text())
    for key in ("device", "platform", "jax", "jaxlib", "git_commit", "command", "date", "model", "settings",
                "prompts", "runs", "summary"):
        assert key in result, key
    assert result["command"].startswith("python -m specdec_jax bench --model")
    st = result["settings"]
    assert st["methods"] == ["ar", "ngram"] and st["num_prompts"] == 2 and st["max_new_tokens"] == 8
    assert st["method_options"] == {"ngram": {"gamma": 2}}
    assert "decode_seconds" in st["metric"]
    assert [p["text"] for p in result["prompts"]] == bench.load_prompt_texts(prompts_file)
    assert all(p["tokens"] == 5 and p["truncated"] for p in result["prompts"])

    ar, ng = result["summary"]["ar"], result["summary"]["ngram"]
    assert ar["speedup_median"] == 1.0 and ar["speculative"] is False and ar["mean_accepted"] is None
    assert ar["decode_tps_median"] > 0 and ng["decode_tps_median"] > 0
    lo, hi = ng["speedup_ci95"]
    assert lo <= ng["speedup_median"] <= hi
    assert ng["speculative"] is True and ng["options"]["gamma"] == 2
    assert 0 <= ng["mean_accepted"] <= 2 and ng["tokens_per_step"] == pytest.approx(ng["mean_accepted"] + 1)
    assert len(ng["accepted_histogram"]) == 3 and sum(ng["accepted_histogram"]) == ng["verify_steps"] > 0
    assert ng["greedy_equal_to_ar"] == 2  # exact speculative decoding: greedy output equals ar's

    for method in ("ar", "ngram"):
        rows = result["runs"][method]
        assert len(rows) == 2
        for row in rows:
            assert row["new_tokens"] == 8 and len(row["tokens"]) == 8  # EOS ignored: always max_new_tokens
            assert len(row["decode_tps_runs"]) == 1 and row["decode_tps"] > 0
    for row, ar_row in zip(result["runs"]["ngram"], result["runs"]["ar"]):
        assert row["speedup"] == pytest.approx(row["decode_tps"] / ar_row["decode_tps"])
        assert row["equal_to_ar"] is True and row["tokens"] == ar_row["tokens"]

    md = paths[1].read_text()
    assert md in captured.out
    assert "| method | options | decode tok/s (median) | speedup vs ar (median) | 95% interval |" in md
    assert "| ngram | gamma=2, rollback=" in md and "| ar | – |" in md and "2/2" in md
    assert "(new tokens − 1) / decode seconds" in md and "![" in md


@pytest.mark.parametrize("args, needles", [
    (["--methods", "ar,telepathy"], ("unknown method 'telepathy'", "ar")),
    (["--methods", ","], ("--methods",)),
    (["--prompts", "{tmp}/nowhere.txt"], ("nowhere.txt", "does not exist")),
    (["--prompts", "{tmp}/empty.txt"], ("empty.txt", "no prompts")),
    (["--prompts", "{tmp}/empty.json"], ("empty.json", "no prompts")),
    (["--prompts", "{tmp}/bad.json"], ("bad.json", "list of strings")),
    (["--repeats", "0"], ("--repeats",)),
    (["--max-new-tokens", "1"], ("--max-new-tokens",)),
    (["--gamma", "-1"], ("--gamma",)),
])
def test_bench_bad_input_exits_2(checkpoint, prompts_file, tmp_path, capsys, args, needles):
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "bad.json").write_text('{"prompt": "x"}')
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--prompts" not in args:
        args += ["--prompts", str(prompts_file)]
    out = tmp_path / "report"
    rc = cli.main(["bench", "--model", str(checkpoint), "--out", str(out), *args])
    captured = capsys.readouterr()
    one_line_error(rc, captured.err, *needles)
    assert captured.out == "" and not out.exists()  # nothing ran, nothing was written


def test_bench_missing_model_exits_2(tmp_path, capsys):
    rc = cli.main(["bench", "--model", str(tmp_path / "nowhere")])
    one_line_error(rc, capsys.readouterr().err, "nowhere", "does not exist")


def test_tokenize_prompts_left_truncates():
    class Chars:  # one token per character
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    items = bench.tokenize_prompts(Chars(), ["abcdef", "xy"], max_prompt_tokens=4)
    assert [it["ids"] for it in items] == [[ord(c) for c in "cdef"], [ord("x"), ord("y")]]
    assert [(it["tokens"], it["truncated"]) for it in items] == [(4, True), (2, False)]
    with pytest.raises(bench.InputError, match="encodes to no tokens"):
        bench.tokenize_prompts(Chars(), ["ok", ""], max_prompt_tokens=4)


GPU_LIKE_HLO = """HloModule jit_loop, is_scheduled=true

%command_buffer (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %add_fusion = f32[4]{0} fusion(%p0), kind=kLoop, calls=%fused_add
}

%body.7 (carry: (s32[], f32[4], /*index=2*/pred[])) -> (s32[], f32[4], /*index=2*/pred[]) {
  %carry = (s32[], f32[4]{0}, /*index=2*/pred[]) parameter(0)
  %gte.1 = f32[4]{0} get-tuple-element(%carry), index=1
  %call.3 = f32[4]{0} call(%gte.1), to_apply=%command_buffer
  %custom-call.2 = f32[4]{0} custom-call(%call.3), custom_call_target="__cub$DeviceRadixSort"
  %copy.4 = f32[4]{0} copy(%custom-call.2)
  ROOT %tuple.5 = (s32[], f32[4]{0}, /*index=2*/pred[]) tuple(%gte.1, %copy.4)
}

ENTRY %main.9 (x: f32[4]) -> (s32[], f32[4], /*index=2*/pred[]) {
  %x = f32[4]{0} parameter(0)
  %tuple.8 = (s32[], f32[4]{0}, /*index=2*/pred[]) tuple(%x)
  ROOT %while.6 = (s32[], f32[4]{0}, /*index=2*/pred[]) while(%tuple.8), condition=%cond.1, body=%body.7
}
"""


def test_while_loops_lists_each_loops_trip_count_and_what_its_body_launches():
    comps = profiling.hlo_computations(GPU_LIKE_HLO)
    assert set(comps) == {"command_buffer", "body.7", "ENTRY"}  # headers with '=' in index comments too
    assert [op for _, op, _ in comps["ENTRY"]] == ["parameter", "tuple", "while"]
    loops = profiling.while_loops(GPU_LIKE_HLO)
    assert loops == {"while while.6 in ENTRY (body body.7)": {"known_trip_count": None, "body": {
        "command_buffer": 1, "custom-call __cub$DeviceRadixSort": 1, "copy": 1}}}
    counted = GPU_LIKE_HLO.replace("body=%body.7", 'body=%body.7, backend_config={"known_trip_count":{"n":"23"}}')
    assert profiling.while_loops(counted)["while while.6 in ENTRY (body body.7)"]["known_trip_count"] == 23
    assert profiling.while_loops(GPU_LIKE_HLO.replace("while(", "call(")) == {}


def test_bench_compile_measures_each_method_cold_and_refuses_bad_input(tmp_path, capsys):
    """benchmarks/bench_compile.py: a method's first call compiles (caches cleared before it), its second reuses the
    programs; an unknown method or an option without its partner is one clear error before any model is made."""
    from benchmarks import bench_compile

    argv = ["--random-9b", "--tiny", "--methods", "ar", "--prompt-len", "8", "--max-new-tokens", "4",
            "--out", str(tmp_path)]
    assert bench_compile.main(argv) == 0
    rows = json.loads((tmp_path / "compile_qwen35_tiny_random.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["ar"]
    assert rows[0]["compile_seconds"] > 0 and not rows[0]["recompiled_on_second_call"], rows
    for bad, needle in ((["--model", "x", "--tiny"], "--tiny"), (["--random-9b", "--methods", "ar,nope"], "nope")):
        with pytest.raises(SystemExit):
            bench_compile.parse_args(bad)
        assert needle in capsys.readouterr().err
