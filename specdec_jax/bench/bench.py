"""Paired decoding benchmark behind `python -m specdec_jax bench`: every method on the same prompts.

    result = run_bench("checkpoints/tiny-qwen35-code", ["ar", "ngram"], "heldout", max_new_tokens=128,
                       method_options={"ngram": {"gamma": 8}})
    paths = write_report(result, "benchmarks/results/bench-tiny-qwen35-code")   # bench.json / .md / .png

Protocol, per prompt: every method runs once untimed (first executions of a shape pay one-time costs:
compilation, allocation, thread pools), then `repeats` timed rounds in which the methods alternate
(the order rotates by one method each round, so no method always runs right after another). EOS is
ignored, so every run generates exactly `max_new_tokens` tokens and all methods do the same work.

Metric (the same for every method): decode tok/s = (new_tokens - 1) / decode_seconds, the tokens
after the first (every method takes the first one from the prefill logits) over the wall time of
the decode loop; prefill and compile time are excluded. A prompt's value is the median over its
timed rounds; a method's speedup on a prompt is its decode tok/s over ar's on that prompt (ar is
always run: it is the baseline). Over prompts we report the median and a percentile-bootstrap 95%
interval of the median (prompts resampled with replacement, fixed seed).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from .. import shipped
from ..errors import CheckpointError, InputError
from .harness import (BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, alternation, bootstrap_ci,
                      decode_tokens_per_second, jsonable, own_reference_rows, result_header, write_results)
from ..text import load_tokenizer, unescape

BASELINE = "ar"
METRIC = ("decode tok/s = (new_tokens - 1) / decode_seconds: tokens after the first (every method takes the "
          "first from the prefill logits) over the wall time of the decode loop; prefill and compile excluded")
REPORT_STEM = "bench"


# ----------------------------------------------------------------------------------------------------------
# inputs


def load_prompt_texts(spec: str | os.PathLike, limit: int | None = None) -> list[str]:
    """'heldout' (held-out stdlib modules, see corpus.heldout_prompts), a .json list of strings, or a text
    file with one prompt per line (\\n, \\t, \\r, \\\\ escapes interpreted; blank lines skipped)."""
    if limit is not None and limit < 1:
        raise InputError(f"the number of prompts must be >= 1; got {limit}")
    spec = os.fspath(spec)
    if spec == "heldout":
        from ..training.corpus import heldout_prompts
        texts = heldout_prompts(max_prompts=limit or 64)
        if not texts:
            raise InputError("no held-out prompts found in this interpreter's standard library")
        return texts
    path = Path(spec).expanduser()
    if not path.exists():
        raise InputError(f"prompts file '{spec}' does not exist (use 'heldout' or a .json / text file)")
    if not path.is_file():
        raise InputError(f"prompts '{spec}' is not a file")
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"could not read prompts file '{spec}': {e}") from None
    if path.suffix.lower() == ".json":
        try:
            texts = json.loads(raw)
        except json.JSONDecodeError as e:
            raise InputError(f"prompts file '{spec}' is not valid JSON: {e}") from None
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise InputError(f"prompts file '{spec}' must hold a JSON list of strings")
        texts = [t for t in texts if t]
    else:
        texts = [unescape(line) for line in raw.splitlines() if line.strip()]
    if not texts:
        raise InputError(f"prompts file '{spec}' holds no prompts")
    return texts[:limit] if limit else texts


def tokenize_prompts(tokenizer, texts: Sequence[str], max_prompt_tokens: int) -> list[dict]:
    """[{text, ids, tokens, truncated}], ids left-truncated to the last `max_prompt_tokens` tokens."""
    if max_prompt_tokens < 1:
        raise InputError(f"max_prompt_tokens must be >= 1; got {max_prompt_tokens}")
    out = []
    for i, text in enumerate(texts):
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise InputError(f"prompt {i} ({text[:40]!r}) encodes to no tokens")
        out.append({"text": text, "ids": ids[-max_prompt_tokens:], "tokens": min(len(ids), max_prompt_tokens),
                    "truncated": len(ids) > max_prompt_tokens})
    return out


def check_methods(model, methods: Sequence[str]) -> list[str]:
    """The methods to run, ar first (the baseline is always run); InputError naming any the model lacks."""
    from .. import api
    from .. import methods as registry
    if isinstance(methods, str):
        methods = methods.split(",")
    methods = [m.strip() for m in methods if m.strip()]
    supported = tuple(api.supported_methods(model))
    known = registry.known()
    if not methods:
        raise InputError(f"no methods given; supported for this {model.family} model: {', '.join(supported)}")
    for m in methods:
        if m not in supported:
            if m in known:
                need = registry.requirement(m, model.family)
                raise InputError(f"method '{m}' is not supported by this {model.family} model"
                                 + (f": it needs {need}" if need else "") + f"; supported: {', '.join(supported)}")
            raise InputError(f"unknown method '{m}'; supported for this {model.family} model: {', '.join(supported)}")
    ordered = [BASELINE] + [m for m in dict.fromkeys(methods) if m != BASELINE]
    return ordered


# ----------------------------------------------------------------------------------------------------------
# running


def _accepted(stats: Mapping) -> list[int] | None:
    counts = stats.get("accepted_counts")
    if counts is None:
        return None
    row = counts[0] if counts and isinstance(counts[0], (list, tuple)) else counts
    return [int(a) for a in row if int(a) >= 0]


def run_bench(model_dir: str | os.PathLike, methods: Sequence[str] | str, prompts: str | os.PathLike | Sequence[str]
              = "heldout", *, max_new_tokens: int = 128, method_options: Mapping[str, Mapping] | None = None,
              temperature: float = 0.0, seed: int = 0, repeats: int = 1, dtype: str | None = None,
              progress: bool = True, num_prompts: int | None = 16, max_prompt_tokens: int = 256,
              command: str | None = None) -> dict:
    """Run the paired benchmark; returns a JSON-serialisable dict (see write_report).

    model_dir: a checkpoint folder or a shipped checkpoint's name ("tiny-qwen", "tiny-huginn").
    methods: names the model supports ("ar" is added first when missing). prompts: "heldout", a prompts
    file (see load_prompt_texts) or a list of strings; the first `num_prompts` are used (None: all).
    method_options: {method: {option: value}} passed to `generate` for that method (e.g. gamma, rollback).
    dtype: parameter dtype (default float32 on CPU, bfloat16 elsewhere). Every input is checked before
    the first generation; errors are SpecdecError subclasses.
    """
    import jax

    import specdec_jax as sj

    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 2:
        raise InputError(f"max_new_tokens must be an integer >= 2 (decode speed needs tokens after the first); "
                         f"got {max_new_tokens!r}")
    if not isinstance(repeats, (int, np.integer)) or repeats < 1:
        raise InputError(f"repeats must be an integer >= 1; got {repeats!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InputError(f"temperature must be a finite number >= 0; got {temperature}")
    method_options = {k: dict(v) for k, v in (method_options or {}).items()}

    folder = shipped.resolve(os.path.expanduser(os.fspath(model_dir)))
    if not os.path.isdir(folder):
        raise CheckpointError(f"model folder '{folder}' does not exist" if not os.path.exists(folder)
                              else f"model '{folder}' is not a folder")
    if isinstance(prompts, (str, os.PathLike)):
        source = os.fspath(prompts)
        texts = load_prompt_texts(source, num_prompts)
    else:
        source = "list"
        texts = [str(t) for t in prompts][:num_prompts] if num_prompts else [str(t) for t in prompts]
        if not texts:
            raise InputError("the prompt list is empty")
    tokenizer = load_tokenizer(folder)
    items = tokenize_prompts(tokenizer, texts, max_prompt_tokens)
    dtype = dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    model = sj.load(folder, dtype=dtype)
    methods = check_methods(model, methods)
    stray = sorted(set(method_options) - set(methods))
    if stray:
        raise InputError(f"method_options for methods that are not run: {', '.join(stray)}")
    header = result_header("specdec_jax bench", command)

    def generate(method, ids, **extra):
        return sj.generate(model, np.asarray([ids], np.int64), int(max_new_tokens), method=method,
                           temperature=temperature, seed=seed, eos_token_id=False,
                           **{**method_options.get(method, {}), **extra})

    def reference_for(rec: dict, base: dict, ids) -> dict:
        """The AR record a method's output is compared with: AR at the method's decode row count when it took
        the exact path there (an exact generation equals AR at the same row count; one untimed extra run)."""
        rows = own_reference_rows(rec.get("stats", {}), base.get("stats", {}))
        if rows is None:
            return base
        return dict(base, tokens=np.asarray(generate(BASELINE, ids, decode_rows=rows).tokens[0]).tolist())

    from tqdm.auto import tqdm
    runs = {m: [] for m in methods}
    t_start = time.perf_counter()
    total = len(items) * len(methods) * (1 + repeats)
    with tqdm(total=total, desc="bench", unit="run", disable=not progress, file=sys.stderr,
              dynamic_ncols=True) as bar:
        for p, item in enumerate(items):
            record = {m: {"prompt": p, "timed": []} for m in methods}
            for m in methods:  # warm-up, untimed
                bar.set_postfix_str(f"prompt {p + 1}/{len(items)} {m} warm-up")
                out = generate(m, item["ids"])
                record[m]["compile_seconds"] = float(out.stats.get("compile_seconds", math.nan))
                bar.update()
            for r, m in alternation(methods, repeats, rotate=True):
                bar.set_postfix_str(f"prompt {p + 1}/{len(items)} {m} {r + 1}/{repeats}")
                out = generate(m, item["ids"])
                s = out.stats
                record[m]["timed"].append({
                    "decode_tps": decode_tokens_per_second(s, out.tokens.shape[0]),
                    "decode_seconds": float(s["decode_seconds"]), "prefill_seconds": float(s["prefill_seconds"]),
                    "new_tokens": int(s["new_tokens"])})
                if r == 0:  # the same seed gives the same tokens in every round
                    record[m]["tokens"] = np.asarray(out.tokens[0]).tolist()
                    record[m]["stats"] = {k2: v for k2, v in s.items()
                                          if k2 != "state" and isinstance(v, (int, float, str, bool, list))}
                bar.update()
            for m in methods:
                runs[m].append(_prompt_row(record[m], reference_for(record[m], record[BASELINE], item["ids"]),
                                           temperature))
    wall = time.perf_counter() - t_start

    summary = {m: _summarize(runs[m], m, temperature) for m in methods}
    return {
        **header,
        "model": {"path": os.path.abspath(folder), "name": os.path.basename(os.path.normpath(folder)),
                  "family": model.family, "dtype": dtype},
        "settings": {"methods": methods, "method_options": method_options, "max_new_tokens": int(max_new_tokens),
                     "temperature": float(temperature), "seed": int(seed), "repeats": int(repeats),
                     "prompts": source, "num_prompts": len(items), "max_prompt_tokens": int(max_prompt_tokens),
                     "eos": "ignored: every run generates max_new_tokens tokens", "baseline": BASELINE,
                     "metric": METRIC,
                     "protocol": "per prompt: one untimed warm-up run per method, then `repeats` timed rounds with "
                                 "the methods alternating (order rotated by one each round); per-prompt value = "
                                 "median over rounds",
                     "interval": f"percentile bootstrap of the median over prompts, {BOOTSTRAP_RESAMPLES} "
                                 f"resamples, numpy seed {BOOTSTRAP_SEED}"},
        "prompts": [{"index": i, "tokens": it["tokens"], "truncated": it["truncated"], "text": it["text"]}
                    for i, it in enumerate(items)],
        "runs": runs,
        "summary": summary,
        "wall_seconds": wall,
    }


def _prompt_row(rec: dict, base: dict, temperature: float) -> dict:
    tps = [t["decode_tps"] for t in rec["timed"]]
    base_tps = float(np.median([t["decode_tps"] for t in base["timed"]]))
    row = {
        "prompt": rec["prompt"],
        "decode_tps": float(np.median(tps)),
        "decode_tps_runs": tps,
        "decode_seconds_runs": [t["decode_seconds"] for t in rec["timed"]],
        "prefill_seconds_runs": [t["prefill_seconds"] for t in rec["timed"]],
        "compile_seconds": rec["compile_seconds"],
        "new_tokens": rec["timed"][0]["new_tokens"],
        "speedup": float(np.median(tps)) / base_tps if base_tps > 0 else math.nan,
        "equal_to_ar": bool(rec["tokens"] == base["tokens"]) if temperature == 0 else None,
        "tokens": rec["tokens"],
    }
    stats = rec["stats"]
    accepted = _accepted(stats)
    if accepted is not None:
        row.update(verify_steps=int(stats.get("verify_steps", len(accepted))), accepted_counts=accepted,
                   mean_accepted=float(np.mean(accepted)) if accepted else 0.0,
                   tokens_per_step=float(np.mean(accepted) + 1) if accepted else 0.0)
    row["options"] = {k: v for k, v in stats.items() if k in ("gamma", "rollback", "num_steps", "cache_mode")}
    return row


def _summarize(rows: list[dict], method: str, temperature: float) -> dict:
    tps = [r["decode_tps"] for r in rows]
    speedups = [r["speedup"] for r in rows]
    lo, hi = bootstrap_ci(speedups)
    out = {
        "decode_tps_median": float(np.median(tps)), "decode_tps_mean": float(np.mean(tps)),
        "speedup_median": float(np.median(speedups)), "speedup_ci95": [lo, hi],
        "speedup_geomean": float(np.exp(np.mean(np.log(speedups)))) if all(s > 0 for s in speedups) else math.nan,
        "compile_seconds_mean": float(np.mean([r["compile_seconds"] for r in rows])),
        "options": rows[0]["options"] if rows else {},
        "speculative": bool(rows) and "accepted_counts" in rows[0],
        "greedy_equal_to_ar": (sum(bool(r["equal_to_ar"]) for r in rows) if temperature == 0 else None),
        "prompts": len(rows),
    }
    if out["speculative"]:
        pooled = [a for r in rows for a in r["accepted_counts"]]
        top = max(pooled + [int(out["options"].get("gamma", 0))])
        out.update(verify_steps=int(sum(r["verify_steps"] for r in rows)),
                   mean_accepted=float(np.mean(pooled)) if pooled else 0.0,
                   tokens_per_step=float(np.mean(pooled) + 1) if pooled else 0.0,
                   accepted_histogram=np.bincount(np.asarray(pooled, np.int64), minlength=top + 1).tolist())
    else:
        out.update(verify_steps=None, mean_accepted=None, tokens_per_step=None, accepted_histogram=None)
    return out


# ----------------------------------------------------------------------------------------------------------
# report


def _fmt(v, spec: str, none: str = "–") -> str:
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _options_text(opts: Mapping) -> str:
    return ", ".join(f"{k}={v}" for k, v in opts.items()) or "–"


def markdown_report(result: dict, png_name: str | None = f"{REPORT_STEM}.png") -> str:
    st, summary, prompts = result["settings"], result["summary"], result["prompts"]
    methods = st["methods"]
    greedy = st["temperature"] == 0
    lens = [p["tokens"] for p in prompts]
    n_trunc = sum(p["truncated"] for p in prompts)
    src = {"heldout": "held-out stdlib modules"}.get(st["prompts"], st["prompts"])
    lines = [
        f"# Decoding benchmark: {result['model']['name']}", "",
        f"{result['device']} ({result['platform']}) · jax {result['jax']} / jaxlib {result['jaxlib']} · "
        f"commit {result['git_commit']} · {result['date']}", "",
        f"`{result['command']}`", "",
        f"{len(prompts)} prompt{'s' if len(prompts) != 1 else ''} ({src}; "
        + (f"{min(lens)}–{max(lens)}" if min(lens) != max(lens) else f"{min(lens)}") + " tokens"
        + (f", {n_trunc} left-truncated to {st['max_prompt_tokens']}" if n_trunc else "") + "), "
        f"{st['max_new_tokens']} new tokens each (EOS ignored), "
        + ("greedy" if greedy else f"temperature {st['temperature']:g}") + f", seed {st['seed']}, "
        f"{result['model']['family']} {result['model']['dtype']}. Per prompt: one untimed warm-up run per method, "
        f"then {st['repeats']} timed round{'s' if st['repeats'] != 1 else ''} with the methods alternating"
        + (" (order rotated each round)" if st["repeats"] > 1 else "") + ".", "",
        f"Decode tok/s = (new tokens − 1) / decode seconds: the tokens after the first (every method takes the "
        f"first from the prefill logits) over the wall time of the decode loop; prefill and compile excluded; "
        f"a prompt's value is the median over its timed rounds. Speedup = decode tok/s / ar's on the same "
        f"prompt; median over prompts with a 95% percentile-bootstrap interval ({BOOTSTRAP_RESAMPLES:,} "
        f"resamples of the prompts, seed {BOOTSTRAP_SEED}). Accepted drafts per verify step are pooled over all "
        f"verify steps; tokens per step = accepted + 1.", "",
        "| method | options | decode tok/s (median) | speedup vs ar (median) | 95% interval | "
        "accepted drafts / step | tokens / step | verify steps | " + ("greedy output = ar |" if greedy else "|"),
        "|---|---|---:|---:|---:|---:|---:|---:|" + ("---|" if greedy else ""),
    ]
    for m in methods:
        s = summary[m]
        lo, hi = s["speedup_ci95"]
        eq = ""
        if greedy:
            eq = "baseline" if m == BASELINE else f"{s['greedy_equal_to_ar']}/{s['prompts']}"
            eq = f" {eq} |"
        lines.append(f"| {m} | {_options_text(s['options'])} | {s['decode_tps_median']:,.1f} | "
                     f"{s['speedup_median']:.2f}× | {_fmt(lo, '.2f')}–{_fmt(hi, '.2f')} | "
                     f"{_fmt(s['mean_accepted'], '.2f')} | {_fmt(s['tokens_per_step'], '.2f')} | "
                     f"{_fmt(s['verify_steps'], 'd')} |" + eq)
    others = [m for m in methods if m != BASELINE]
    head = ["prompt", "tokens", "ar tok/s"]
    for m in others:
        head += [f"{m} speedup"] + ([f"{m} accepted / step"] if summary[m]["speculative"] else [])
    lines += ["", "Per prompt (decode tok/s for ar; speedup and accepted drafts / step for the others):", "",
              "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    runs = result["runs"]
    for i, p in enumerate(prompts):
        cells = [str(i), str(p["tokens"]), f"{runs[BASELINE][i]['decode_tps']:,.1f}"]
        for m in others:
            r = runs[m][i]
            flag = " ≠" if r["equal_to_ar"] is False else ""
            cells.append(f"{r['speedup']:.2f}×{flag}")
            if summary[m]["speculative"]:
                cells.append(_fmt(r.get("mean_accepted"), ".2f"))
        lines.append("| " + " | ".join(cells) + " |")
    if greedy and any(r["equal_to_ar"] is False for m in others for r in runs[m]):
        lines += ["", "≠: greedy output differs from ar's on that prompt."]
    if png_name:
        lines += ["", f"![accepted drafts per verify step and speedups]({png_name})"]
    lines += ["", f"Total wall time {result['wall_seconds']:.1f} s (including compilation)."]
    return "\n".join(lines) + "\n"


def plot_report(result: dict, path: str | os.PathLike) -> None:
    """Two panels: accepted drafts per verify step (fraction of steps) for each speculative method, and each
    method's median speedup over ar with its 95% interval."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summary, methods = result["summary"], result["settings"]["methods"]
    spec = [m for m in methods if summary[m]["speculative"]]
    color = {m: "0.7" if m == BASELINE else f"C{i % 10}" for i, m in enumerate(methods)}
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    if spec:
        top = max(len(summary[m]["accepted_histogram"]) for m in spec)
        width = 0.8 / len(spec)
        for j, m in enumerate(spec):
            h = np.asarray(summary[m]["accepted_histogram"], np.float64)
            frac = h / max(h.sum(), 1)
            x = np.arange(len(h)) + (j - (len(spec) - 1) / 2) * width
            ax1.bar(x, frac, width=width, color=color[m], label=f"{m} (mean {summary[m]['mean_accepted']:.2f})")
        ax1.set_xticks(range(top))
        ax1.legend(fontsize=8)
    else:
        ax1.text(0.5, 0.5, "no speculative methods", ha="center", va="center", transform=ax1.transAxes)
    ax1.set_xlabel("accepted drafts per verify step")
    ax1.set_ylabel("fraction of verify steps")
    ax1.set_title("Accepted drafts per verify step")

    y = np.arange(len(methods))
    med = np.array([summary[m]["speedup_median"] for m in methods])
    ci = np.array([summary[m]["speedup_ci95"] for m in methods], np.float64)
    err = np.abs(np.stack([med - ci[:, 0], ci[:, 1] - med]))
    ax2.barh(y, med, color=[color[m] for m in methods])
    ax2.errorbar(med, y, xerr=np.nan_to_num(err), fmt="none", ecolor="black", capsize=4)
    ax2.axvline(1.0, color="black", lw=0.8, ls="--")
    for yi, v in zip(y, med):
        ax2.annotate(f"{v:.2f}×", (v, yi), xytext=(4, 6), textcoords="offset points", fontsize=8)
    ax2.set_yticks(y, methods)
    ax2.invert_yaxis()
    ax2.set_xlabel("decode speedup over ar (median, 95% bootstrap interval)")
    ax2.set_title(f"Speedup ({len(result['prompts'])} prompts, {result['settings']['max_new_tokens']} new tokens)")
    fig.suptitle(f"{result['model']['name']} · {result['device']} · {result['model']['dtype']}", fontsize=10)
    fig.savefig(os.fspath(path), dpi=120)


def write_report(result: dict, out_dir: str | os.PathLike) -> dict[str, str | None]:
    """Write bench.json (everything), bench.md and bench.png into out_dir; returns {"json", "markdown", "png"}
    (png None, with result["plot_error"] set, when matplotlib is missing or plotting fails)."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    png = out / f"{REPORT_STEM}.png"
    try:
        plot_report(result, png)
        png_path = str(png)
    except ImportError as e:
        result["plot_error"] = f"no plot: matplotlib is not installed ({e}); pip install 'specdec_jax[bench]'"
        png_path = None
    md = markdown_report(result, png.name if png_path else None)
    paths = {"json": str(out / f"{REPORT_STEM}.json"), "markdown": str(out / f"{REPORT_STEM}.md"), "png": png_path}
    result["report_files"] = paths
    write_results(out, REPORT_STEM, jsonable(result), md, echo=False)
    return paths
