"""Speculative decoding benchmark for Qwen3.5, paired with AR on the same prompts.

For a checkpoint folder (or --random-9b: the transformers default 9B shape with random bf16 weights):
  - end to end: AR and n-gram speculation alternate on every prompt (greedy): tok/s, mean accepted
    drafts per verify step, speedup (median over prompts), outputs checked equal to AR;
  - step costs: one verification forward of gamma + 1 tokens vs one AR step, and the commit, for
    gamma in --gammas, in both rollback modes;
  - speculative recurrent-state memory: what a verification keeps for rollback (snapshot: one GDN
    state per position; pseudo: k, g, v_new per position), from the traced shapes.

    python benchmarks/bench_spec.py --model checkpoints/tiny-qwen35-code --prompts heldout --out benchmarks/results
    python benchmarks/bench_spec.py --random-9b --skip-e2e --out benchmarks/results
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specdec_jax.bench.harness import (alternate, compile_all, compile_timed, cut_prompts,  # noqa: E402
                                  decode_tokens_per_second, finish_plot, median_time, own_reference_rows,
                                  result_header, write_results)
from specdec_jax.bench.profiling import device_kernel_profile, kernel_profile_markdown  # noqa: E402
from specdec_jax.decoding.compiled import compiler_options  # noqa: E402


RESIDUAL_WRITES = ("o_proj", "out_proj", "down_proj")  # the projections that write into the residual stream


# Shapes of random Qwen3.5 models, as overrides of transformers' Qwen3_5TextConfig defaults (the 9B shape).
# "27b": Qwen3.5-27B (dense) as public copies of its config.json give it (model_type qwen3_5, text_config): 64 layers
# (full attention every 4th), hidden 5120, MLP 17408, 24 query heads and 4 KV heads of 256, GDN 16 key and 48 value
# heads of 128, vocabulary 248320. Not read from the official file (no access here); MTP head left out.
QWEN35_SHAPES = {
    "9b": {},
    "27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48, layer_types=None,
                full_attention_interval=4, tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, layer_types=None),
}


def qwen35_shape_config(shape: str):
    """The Qwen35Config of a named random shape (QWEN35_SHAPES)."""
    from specdec_jax.models.qwen35.config import qwen35_config_from_dict
    from transformers import Qwen3_5TextConfig
    raw = Qwen3_5TextConfig().to_dict()
    raw.update(QWEN35_SHAPES[shape])
    raw["model_type"] = "qwen3_5_text"
    return qwen35_config_from_dict(raw)


def add_model_source(ap) -> None:
    """The model a step benchmark runs: --random-9b (with --tiny for a CPU smoke shape) or --model FOLDER."""
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--random-9b", action="store_true", help="Qwen3.5-9B shape, random bf16 weights")
    src.add_argument("--model", help="a Qwen3.5 checkpoint folder")
    ap.add_argument("--tiny", action="store_true", help="with --random-9b: a tiny shape (CPU smoke run)")


def model_from_args(args):
    """(model, name) for `add_model_source`'s arguments; a checkpoint loads in bfloat16."""
    if args.random_9b:
        return random_9b_model(args.tiny), ("qwen35_tiny_random" if args.tiny else "qwen35_9b_random")
    import specdec_jax as sj
    return sj.load(args.model, dtype="bfloat16"), os.path.basename(os.path.normpath(args.model))


def random_9b_model(tiny: bool, dtype: str = "bfloat16", damp: float = 1.0):
    """Random weights (bfloat16 unless `dtype`) made on the device in the fused layout (no file, no transformers).
    damp: every residual write (attention / GDN output, MLP down projection) scaled by it; 0.02 keeps the
    embedding dominant, so top-1 margins are wide and greedy outputs are stable text-like sequences."""
    from specdec_jax.loading import build_tree
    from specdec_jax.results import Model
    from specdec_jax.models.qwen35 import model as qwen35
    cfg = qwen35_shape_config("tiny" if tiny else "9b")
    specs = qwen35.param_specs(cfg, {"model.embed_tokens.weight"}, "random")
    keys = iter(jax.random.split(jax.random.PRNGKey(0), len(specs)))

    def make(leaf):
        shape = (sum(s[0] for _, s in leaf.groups[0]),) + leaf.groups[0][0][1][1:]
        if len(leaf.groups) > 1 or leaf.stack:
            shape = (len(leaf.groups),) + shape
        if leaf.groups[0][0][0].endswith("conv1d.weight"):
            shape = (shape[0], shape[2])
        scale = shape[-1] ** -0.5 if len(shape) > 1 else 0.1
        if leaf.groups[0][0][0].split(".")[-2] in RESIDUAL_WRITES:
            scale *= damp
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(dtype)

    return Model(config=cfg, params=build_tree(specs, make), dtype=jnp.dtype(dtype))


def load_prompts(spec: str, tokenizer, limit: int, keep: int = 384) -> list[list[int]]:
    """Token lists (each its last `keep` tokens): 'heldout' (signature + docstring prompts of the stdlib's held-out
    modules), 'heldout-files' (those modules' whole files: long prompts), or a .json list / text file of prompts."""
    from specdec_jax.training import corpus
    if spec == "heldout":
        texts = corpus.heldout_prompts(max_prompts=limit)
    elif spec == "heldout-files":
        root = corpus.stdlib_root()
        texts = corpus.read_texts(root, corpus.split_corpus(root)[1])
    else:
        with open(spec) as f:
            texts = json.load(f) if spec.endswith(".json") else [line.rstrip("\n").replace("\\n", "\n") for line in f]
    return [tokenizer(t)["input_ids"][-keep:] for t in texts[:limit]]


def prefix_state(model, prefix: int, max_len: int):
    """A state as after a `prefix`-token prompt: that length, random GDN states (the K/V slots stay zeros)."""
    from specdec_jax.models.qwen35 import model as qwen35
    base = qwen35.init_state(model.config, 1, max_len, model.dtype)
    return base.replace(length=jnp.full((1,), prefix, jnp.int32),
                        recurrent=jnp.stack([jax.random.normal(jax.random.PRNGKey(i), r.shape, jnp.float32) * 0.1
                                             for i, r in enumerate(base.recurrent)]))


def step_costs(model, gammas, prompt_len: int, repeats: int):
    """Median time of one verification forward (gamma + 1 tokens, collect) vs one AR step, plus commit.

    Every variant is lowered first and compiled on a thread pool (XLA compiles release the GIL):
    a 9B forward takes tens of seconds to compile, and there are two per (gamma, rollback).
    """
    from specdec_jax.models.qwen35 import model as qwen35
    cfg, params = model.config, model.params
    base = prefix_state(model, prompt_len, prompt_len + max(gammas) + 2)
    tok1 = jnp.ones((1, 1), jnp.int32)
    ar = jax.jit(lambda p, s, t: qwen35.forward(p, cfg, s, t, logits_for="last")[0])
    commit = jax.jit(lambda s, v, e, n: qwen35.commit(s, v, e, n))
    variants = [(rb, g) for rb in ("pseudo", "snapshot") for g in gammas if not (rb == "snapshot" and g + 1 > 64)]
    lowered = {"ar": ar.lower(params, base, tok1)}
    verify_fns = {}
    for rb, g in variants:
        verify_fns[rb, g] = jax.jit(lambda p, s, t, rb=rb: qwen35.forward(p, cfg, s, t, collect=rb))
        lowered[rb, g] = verify_fns[rb, g].lower(params, base, jnp.ones((1, g + 1), jnp.int32))
    compiled = compile_all(lowered, workers=8)
    print(f"compiled {len(compiled)} forwards", flush=True)
    t_ar = median_time(lambda: compiled["ar"](params, base, tok1), repeats)
    rows = []
    for rb, g in variants:
        toks = jnp.ones((1, g + 1), jnp.int32)
        verify = compiled[rb, g]
        logits, vstate, extras = verify(params, base, toks)
        n_keep = jnp.full((1,), (g + 2) // 2, jnp.int32)
        t_v = median_time(lambda: verify(params, base, toks), repeats)
        t_c = median_time(lambda: commit(base, vstate, extras, n_keep), repeats)
        rollback_bytes = sum(x.size * x.dtype.itemsize for ex in extras["gdn"]
                             for name, x in ex.items() if name in ("k", "g", "v_new", "all_states"))
        rows.append({"rollback": rb, "gamma": g, "verify_ms": t_v * 1e3, "ar_step_ms": t_ar * 1e3,
                     "verify_over_ar": t_v / t_ar, "commit_ms": t_c * 1e3, "rollback_state_bytes": int(rollback_bytes)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


CURVE_METHODS = ("ngram", "mtp", "layer-skip", "residual-reuse", "partial-mlp")


def parse_curve_method(text: str) -> tuple[str, dict]:
    """'method[:key=value[:key=value ...]]' -> (method, options); values are Python literals, e.g.
    'partial-mlp:mlp_keep=0.75:shortlist_size=32768'."""
    import ast
    name, *items = text.strip().split(":")
    options = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"curve method {text!r}: options are key=value, separated by ':'; got {item!r}")
        try:
            options[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"curve method {text!r}: {key}={value!r} is not a Python literal") from None
    return name, options


def parse_e2e_method(text: str) -> tuple[str, int | None, dict, str | None]:
    """'method[:gamma][:key=value ...][/rollback]' -> (method, gamma or None, options, rollback or None)."""
    spec, _, rollback = text.strip().partition("/")
    name, _, rest = spec.partition(":")
    gamma = None
    if rest and "=" not in rest.split(":")[0]:
        head, _, rest = rest.partition(":")
        try:
            gamma = int(head)
        except ValueError:
            raise ValueError(f"e2e method {text!r}: gamma must be an integer; got {head!r}") from None
    _, options = parse_curve_method(name + (":" + rest if rest else ""))
    return name, gamma, options, rollback or None


def curve_drafter(model, method: str):
    """The drafter a cost-curve method runs, built by the method registry (default options unless given)."""
    from specdec_jax import methods
    name, options = parse_curve_method(method)
    if name == "mtp" and not model.params.get("mtp"):
        raise SystemExit("bench_spec.py: --curve-method mtp needs a checkpoint with an MTP head (mtp.* tensors)")
    spec = methods.lookup(model, name)
    methods.check_options(spec, options)
    return spec.drafter(model, options)


def with_synthetic_shortlist(model, methods_text):
    """A random model has no draft tables: for curve methods with a shortlist_size, give it the first N token
    ids as its shortlist (only the cost is measured, and it does not depend on which ids they are)."""
    import dataclasses
    sizes = [parse_curve_method(m)[1].get("shortlist_size", 0) for m in methods_text]
    if not any(sizes) or (model.params.get("draft") or {}).get("shortlist") is not None:
        return model
    draft = {"shortlist": jnp.arange(max(sizes), dtype=jnp.int32)}
    return dataclasses.replace(model, params=dict(model.params, draft=draft))


def forced_cost_curve(model, ps, gammas, rollbacks, prompt_len: int, new_tokens: int, repeats: int,
                      time_budget_s: float, on_row=None, methods=("ngram",), exact_modes=(True,),
                      kernel_profile: bool = False, ar_eos: int | None = None) -> dict:
    """End-to-end time per token of AR and of n-gram speculation whose accepted count follows a seeded
    schedule (each draft kept with probability p, stopping at the first rejection; the real acceptance
    still runs on the verifier's logits: `speculative.forced_acceptance`). One compile per (gamma,
    rollback); p is a traced argument. Outputs are meaningless: this measures step cost against tokens
    per step, independently of the weights. Compiles run in parallel; each job's seconds are reported.
    exact_modes: True (AR and verification at the decode shape, the default path), False (AR at one row,
    verification at gamma + 1 rows), or both; every row is paired with AR of its own setting.
    methods: the drafters (CURVE_METHODS), compiled together; each row names its method.
    kernel_profile: also trace one AR run and one run per setting (at the largest p) with the profiler, and
    keep each one's device time kernel by kernel, per token (AR) or per step, under result["kernel_profiles"].
    ar_eos: also time AR (the first exact mode) with that EOS id configured, as a real checkpoint's generation runs:
    its loop then reads its predicate back every token as speculation's does every step (without EOS its trip count
    is known), under result["ar_with_eos"]; the rows stay paired with AR without EOS."""
    from specdec_jax.decoding import autoregressive as ar_mod
    from specdec_jax.decoding import speculative as sp
    from specdec_jax.decoding.sampling import SamplingConfig
    from specdec_jax.models.qwen35 import model as qwen35
    cfg, params = model.config, model.params
    t_start = time.perf_counter()
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, prompt_len)), jnp.int32)
    key = jax.random.PRNGKey(0)
    drafters = {m: curve_drafter(model, m) for m in methods}
    sampling = SamplingConfig()
    from specdec_jax.decoding.decode_shape import choose_decode_rows
    from specdec_jax.models.family import QWEN35
    rows_of = {g: choose_decode_rows(g, None, "qwen3_5") for g in gammas}
    ar_rows = choose_decode_rows(0, None, "qwen3_5")
    max_len = prompt_len + new_tokens + max(max(gammas) + 1, *rows_of.values())
    static_ap = dict(ops=ar_mod.ar_ops(QWEN35), cfg=cfg, max_len=max_len, state_dtype=model.dtype)
    logits_s, state_s = jax.eval_shape(functools.partial(ar_mod._prefill, **static_ap), params, prompt)
    jobs = {"ar_prefill": lambda: ar_mod._prefill.lower(params, prompt, **static_ap)}
    static_ad = {}
    for ex in exact_modes:
        static_ad[ex] = dict(ops=ar_mod.ar_ops(QWEN35, ar_rows if ex else 0), cfg=cfg, max_new_tokens=new_tokens,
                             sampling=sampling, eos_ids=())
        jobs["ar_loop", ex] = functools.partial(ar_mod._decode_loop.lower, params, state_s, logits_s, key,
                                                **static_ad[ex])
    if ar_eos is not None:
        jobs["ar_loop_eos"] = functools.partial(ar_mod._decode_loop.lower, params, state_s, logits_s, key,
                                                **dict(static_ad[exact_modes[0]], eos_ids=(int(ar_eos),)))
    # rollback-major, exact first: the default's rows come first
    configs = [(m, g, rb, ex) for m in methods for rb in rollbacks for ex in exact_modes for g in gammas
               if not (rb in ("replay", "snapshot") and g + 1 > qwen35.MAX_RECURRENT_VERIFY)
               and not (ex and rb == "pseudo")]
    for m in methods:
        for g in gammas:
            static_p = dict(cfg=cfg, max_len=max_len, sampling=sampling, eos_ids=(), state_dtype=model.dtype, gamma=g,
                            max_new_tokens=new_tokens, drafter=drafters[m], impl="auto")
            shapes = jax.eval_shape(functools.partial(sp._spec_prefill, **static_p), params, prompt, key)
            jobs["prefill", m, g] = functools.partial(sp._spec_prefill.lower, params, prompt, key, **static_p)
            for rb in rollbacks:
                for ex in exact_modes:
                    if (m, g, rb, ex) not in configs:
                        continue
                    static_l = dict(cfg=cfg, sampling=sampling, eos_ids=(), gamma=g, max_new_tokens=new_tokens,
                                    drafter=drafters[m], rollback=rb, impl="auto",
                                    decode_rows=rows_of[g] if ex else 0, defer=sp.defer_commit(rb))
                    jobs["loop", m, g, rb, ex] = functools.partial(sp._spec_loop.lower, params, shapes[0], shapes[1],
                                                                   key, jnp.float32(0.5), **static_l)
    lowered = {name: make() for name, make in jobs.items()}
    print(f"lowered {len(lowered)} functions in {time.perf_counter() - t_start:.0f} s", flush=True)

    t0 = time.perf_counter()
    exe, compile_s = compile_timed(lowered, workers=12, options=compiler_options("qwen3_5"))
    print(f"compiled in {time.perf_counter() - t0:.0f} s (pool of 12)", flush=True)

    def ar_run(ex, loop=None):
        logits, state = exe["ar_prefill"](params, prompt)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        tokens, state, steps = exe[loop or ("ar_loop", ex)](params, state, logits, key)
        jax.block_until_ready(tokens)
        sec = time.perf_counter() - t0
        if int(steps) != new_tokens:
            raise RuntimeError(f"AR stopped after {int(steps)} of {new_tokens} tokens (EOS id {ar_eos} generated): "
                               "its time per token is not comparable; pass another --ar-eos id")
        return sec / (new_tokens - 1)

    def spec_run(m, g, rb, ex, p):
        state, dstate = exe["prefill", m, g](params, prompt, key)
        accept_p = jnp.float32(p)  # on the device before the clock starts: the schedule's scaffolding, not decoding
        jax.block_until_ready((state, accept_p))
        t0 = time.perf_counter()
        tokens, state, dstate = exe["loop", m, g, rb, ex](params, state, dstate, key, accept_p)
        jax.block_until_ready(tokens)
        sec = time.perf_counter() - t0
        steps = int(state.steps)
        acc = np.asarray(state.accepted)[:steps, 0]
        emitted = int(state.n_out[0]) - 1  # every token the steps produced (the last step may overshoot)
        returned = min(emitted, new_tokens - 1)
        return sec, float((acc + 1).mean()), steps, emitted, returned

    def traced_ar(ex):  # the decode loop alone, from a fresh prefill
        logits, state = exe["ar_prefill"](params, prompt)
        jax.block_until_ready(state)
        return lambda: exe["ar_loop", ex](params, state, logits, key)

    def traced_spec(m, g, rb, ex, p):
        state, dstate = exe["prefill", m, g](params, prompt, key)
        accept_p = jnp.float32(p)
        jax.block_until_ready((state, accept_p))
        return lambda: exe["loop", m, g, rb, ex](params, state, dstate, key, accept_p)

    ar_times = {}
    for ex in exact_modes:
        ar_run(ex)  # warm-up (autotuning)
        ar_times[ex] = [ar_run(ex) for _ in range(repeats)]
    rows = []
    result = {"compile_seconds": compile_s, "rows": rows, "decode_rows": rows_of, "ar_decode_rows": ar_rows}

    def ar_summary():
        for ex in exact_modes:
            sec = float(np.median(ar_times[ex]))
            result["ar_exact" if ex else "ar_fast"] = {"s_per_token": sec, "tok_s": 1 / sec}
        default = result["ar_exact" if True in exact_modes else "ar_fast"]
        result["ar_s_per_token"], result["ar_tok_s"] = default["s_per_token"], default["tok_s"]

    ar_summary()
    if ar_eos is not None:
        ex = exact_modes[0]
        ar_run(ex, "ar_loop_eos")  # warm-up
        paired = alternate({"eos": lambda: ar_run(ex, "ar_loop_eos"), "ar": lambda: ar_run(ex)}, repeats)
        ar_times[ex] += paired["ar"]
        sec_eos, sec = float(np.median(paired["eos"])), float(np.median(paired["ar"]))
        result["ar_with_eos"] = {"eos_id": int(ar_eos), "exact": ex, "s_per_token": sec_eos, "tok_s": 1 / sec_eos,
                                 "paired_ar_s_per_token": sec, "time_over_ar": sec_eos / sec}
        ar_summary()
    if kernel_profile:
        profiles = result["kernel_profiles"] = {}
        for ex in exact_modes:
            profiles[f"AR ({'exact' if ex else 'fast'}), per token"] = device_kernel_profile(
                traced_ar(ex), new_tokens - 1)
        for m, g, rb, ex in configs:
            p = max(ps)
            steps = spec_run(m, g, rb, ex, p)[2]
            profiles[f"{m} gamma {g} {rb} ({'exact' if ex else 'fast'}) p {p:g}, per step"] = device_kernel_profile(
                traced_spec(m, g, rb, ex, p), steps)
        if on_row:
            on_row(result)
    for m, g, rb, ex in configs:
        spec_run(m, g, rb, ex, 1.0)  # warm-up
        for p in ps:
            if time.perf_counter() - t_start > time_budget_s:
                print("time budget reached", flush=True)
                return result
            paired = alternate({"spec": lambda: spec_run(m, g, rb, ex, p), "ar": lambda: ar_run(ex)}, repeats)
            runs = paired["spec"]
            ar_times[ex] += paired["ar"]
            per_emitted = float(np.median([r[0] / r[3] for r in runs]))  # seconds per token the steps made
            per_returned = float(np.median([r[0] / r[4] for r in runs]))
            tps = float(np.mean([r[1] for r in runs]))
            ar_sec = float(np.median(ar_times[ex]))
            row = {"method": m, "gamma": g, "rollback": rb, "exact": ex, "decode_rows": rows_of[g] if ex else g + 1, "p": p,
                   "tokens_per_step": tps, "seconds": per_emitted,
                   "seconds_per_step": float(np.median([r[0] / r[2] for r in runs])),
                   "speedup": ar_sec / per_emitted, "speedup_over_tokens_per_step": ar_sec / per_emitted / tps,
                   "speedup_returned": ar_sec / per_returned, "steps": int(np.median([r[2] for r in runs])),
                   "default": rb == sp.DEFAULT_ROLLBACK and ex, "compile_seconds": compile_s[str(("loop", m, g, rb, ex))]}
            rows.append(row)
            ar_summary()
            print(json.dumps(row), flush=True)
            if on_row:
                on_row(result)
    return result


def cost_curve_markdown(result, header, args) -> str:
    md = [f"# Speculative cost curve, forced acceptance ({result['model']})", "",
          f"{header['device']} · jax {header['jax']} · commit {header['commit']} · {header['date']}", "",
          f"`{header['command']}`", "",
          f"Drafts ({result.get('method', 'ngram')}) whose accepted count follows a seeded schedule (each draft kept with probability p, "
          "stopping at the first rejection); the real acceptance still runs on the verifier's logits. The outputs "
          "are meaningless: the rows measure time per token against tokens per step. Greedy, batch 1, prompt "
          f"{args.prompt_len} random tokens, {args.max_new_tokens} new tokens, median of {args.repeats} runs, AR "
          f"alternating with speculation in the same process. AR: **{result['ar_tok_s']:.1f} tok/s** "
          f"({result['ar_s_per_token'] * 1e3:.3f} ms per token) on the default (exact) path"
          + (f", {result['ar_fast']['tok_s']:.1f} tok/s at one row (exact=False; the exact path's AR costs "
             f"{result['ar_fast']['tok_s'] / result['ar_exact']['tok_s']:.3f}× its time per token)"
             if 'ar_fast' in result and 'ar_exact' in result else "") + ". Each row's speedup is over AR of its "
          "own setting (exact: every decode forward at the decode shape, `decode rows`; fast: verification at "
          "gamma + 1 rows, AR at one)." + ar_eos_sentence(result), "",
          "`speedup` is per token the steps produced (AR time per token ÷ decode time per emitted token): the "
          "step-cost measure, so `speedup ÷ tokens per step` = AR token time ÷ step time. `returned` counts only "
          f"the {args.max_new_tokens - 1} tokens after the prefill's that the call returns: the last step can "
          "overshoot the budget (up to gamma tokens thrown away), which costs short generations a few percent at "
          "high acceptance.", "",
          "| method | gamma | rollback | exact (decode rows) | default | p | tokens / step | steps | ms / step | speedup over AR | speedup ÷ tokens per step | speedup, returned tokens | compile s |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        exact = f"yes ({r['decode_rows']})" if r.get("exact") else "no"
        md.append(f"| {r.get('method', 'ngram')} | {r['gamma']} | {r['rollback']} | {exact} | {'yes' if r['default'] else 'no'} | {r['p']:.2f} | "
                  f"{r['tokens_per_step']:.2f} | {r['steps']} | {r['seconds_per_step'] * 1e3:.3f} | "
                  f"{r['speedup']:.2f}× | {r['speedup_over_tokens_per_step']:.3f} | {r['speedup_returned']:.2f}× | "
                  f"{r['compile_seconds']:.0f} |")
    md += ["", "Compile seconds: each job's own wall time while 12 compiled at once on the machine's CPU cores.", "",
           f"![speedup against tokens per step]({result['stem']}.png)"]
    return "\n".join(md) + "\n"


def ar_eos_sentence(result) -> str:
    """The cost-curve report's line on AR with an EOS id configured ('' when not measured)."""
    e = result.get("ar_with_eos")
    if not e:
        return ""
    return (f" AR as a real checkpoint runs it, with an EOS id configured ({e['eos_id']}, never generated here): "
            f"**{e['tok_s']:.1f} tok/s**, {e['time_over_ar']:.3f}× the time per token of AR without one (alternated "
            "with it in this run): its loop then reads its predicate back after every token, as the speculative loop "
            "does after every step, where without EOS its trip count is known. The rows are paired with AR without "
            "EOS, the faster baseline.")


def plot_cost_curve(result, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    top = max([r["tokens_per_step"] for r in result["rows"]] + [2.0])
    ax.plot([1, top], [1, top], "k--", lw=1, label="ideal y = x")
    key_of = lambda r: (r.get("method", "ngram"), r["gamma"], r["rollback"], r.get("exact", False))
    several = len({r.get("method", "ngram") for r in result["rows"]}) > 1
    for key in dict.fromkeys(map(key_of, result["rows"])):
        pts = sorted((r["tokens_per_step"], r["speedup"]) for r in result["rows"] if key_of(r) == key)
        ax.plot([a for a, _ in pts], [b for _, b in pts], "o-" if key[3] else "x:", ms=3,
                label=(f"{key[0]}, " if several else "") + f"gamma {key[1]}, {key[2]}{', exact' if key[3] else ''}")
    finish_plot(fig, ax, path, "tokens per step", "speedup over AR", f"{result['model']}: forced-acceptance cost curve")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (with tokenizer for --prompts heldout)")
    ap.add_argument("--random-9b", action="store_true", help="Qwen3.5-9B shape with random weights")
    ap.add_argument("--tiny", action="store_true", help="with --random-9b: a tiny shape (CPU smoke run)")
    ap.add_argument("--prompts", default="heldout", help="'heldout' or a .json list / text file of prompts")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64,
                    help="prompts cut to their last N tokens, shorter ones dropped (one compile per method); 0 keeps them")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gammas", default="1,2,4,8,16")
    ap.add_argument("--e2e-gamma", type=int, default=8)
    ap.add_argument("--e2e-repeats", type=int, default=3,
                    help="rounds per prompt, each running AR then every method; a method's speedup on a prompt is the "
                    "median of its rounds' ratios to that round's AR (one run of 128 tokens is ~20 ms: single pairs "
                    "moved the median over 8 prompts by ~5%%)")
    ap.add_argument("--e2e-methods", default="ngram,ngram/snapshot,ngram-table,mtp,mtp-shortlist",
                    help="comma list of METHOD[:GAMMA][:KEY=VALUE ...][/ROLLBACK] (default gamma --e2e-gamma, default "
                         "rollback; options as generate() takes them, e.g. mtp:3:unroll_drafts=False)")
    ap.add_argument("--forced-acceptance", default=None, metavar="P,P,...",
                    help="cost curve only: acceptance probabilities in [0, 1] that replace the real acceptance "
                         "outcome (n-gram drafts; outputs meaningless); writes spec_cost_curve_<model>")
    ap.add_argument("--rollbacks", default="replay,pseudo,snapshot", help="with --forced-acceptance")
    ap.add_argument("--curve-method", default="ngram", help="with --forced-acceptance: comma list of drafters, each "
                    f"one of {CURVE_METHODS} with options as ':key=value' (e.g. partial-mlp:mlp_keep=0.75:"
                    "shortlist_size=32768; a random model gets a synthetic shortlist); a method without an "
                    "acceptance step, such as ar, is refused")
    ap.add_argument("--time-budget-s", type=float, default=1e9, help="with --forced-acceptance")
    ap.add_argument("--exact", default="both", choices=("both", "on", "off"),
                    help="with --forced-acceptance: the exact path (default), the fast one, or both")
    ap.add_argument("--ar-eos", type=int, default=None, metavar="ID",
                    help="with --forced-acceptance: also time AR with this EOS id configured (reported beside the rows)")
    ap.add_argument("--kernel-profile", action="store_true",
                    help="with --forced-acceptance: also trace AR and each setting once with the profiler and write "
                         "kernel_profile_<model><tag>.json / .md (device time kernel by kernel, per token or step)")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-steps", action="store_true", help="no step-cost table (end to end only)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the weights' dtype (a checkpoint is loaded in it; --random-9b is made in it)")
    ap.add_argument("--precision", default=None, choices=(None, "highest"),
                    help="jax_default_matmul_precision for the whole run (float32 as the exactness tests run it)")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    import specdec_jax as sj
    if args.precision:
        jax.config.update("jax_default_matmul_precision", args.precision)

    gammas = [int(g) for g in args.gammas.split(",")]
    ps = None
    if args.forced_acceptance is not None:
        try:
            ps = [float(p) for p in args.forced_acceptance.split(",")]
        except ValueError:
            ap.error(f"--forced-acceptance: a comma list of probabilities in [0, 1]; got {args.forced_acceptance!r}")
        if not ps or not all(0.0 <= p <= 1.0 for p in ps):
            ap.error(f"--forced-acceptance: every probability must lie in [0, 1]; got {args.forced_acceptance!r}")
        curve_methods = [m.strip() for m in args.curve_method.split(",") if m.strip()]
        for m in curve_methods or [args.curve_method]:
            try:
                m = parse_curve_method(m)[0]
            except ValueError as e:
                ap.error(f"--curve-method: {e}")
            if m not in CURVE_METHODS:
                ap.error(f"--forced-acceptance needs a chain speculative method with an acceptance step; "
                         f"--curve-method {m!r} is not one of {CURVE_METHODS}")
        from specdec_jax.decoding.speculative import ROLLBACK_MODES
        bad = [rb for rb in args.rollbacks.split(",") if rb not in ROLLBACK_MODES]
        if bad:
            ap.error(f"--rollbacks: unknown {bad}; expected some of {ROLLBACK_MODES}")
    header = result_header("bench_spec")
    if args.random_9b:
        model, name = (random_9b_model(args.tiny, args.dtype),
                       ("qwen35_tiny_random" if args.tiny else "qwen35_9b_random"))
    else:
        model, name = sj.load(args.model, dtype=args.dtype), os.path.basename(os.path.normpath(args.model))
    name += "" if args.dtype == "bfloat16" else f"_{args.dtype}" + (f"_{args.precision}" if args.precision else "")
    if ps is not None:
        if args.random_9b:
            model = with_synthetic_shortlist(model, curve_methods)
        stem = f"spec_cost_curve_{name}{args.tag}"
        head = {**header, "commit": header["git_commit"], "model": name, "stem": stem, "method": args.curve_method}

        def save_curve(res):
            full = {**head, **res}
            write_results(args.out, stem, full, cost_curve_markdown(full, head, args), echo=False)
            if full.get("kernel_profiles"):
                kstem = f"kernel_profile_{name}{args.tag}"
                md = [f"# Device time kernel by kernel ({name})", "",
                      f"{head['device']} · jax {head['jax']} · commit {head['commit']} · {head['date']}", "",
                      f"`{head['command']}`", "",
                      "One traced decode loop per setting (jax.profiler; the spec rows at the largest forced p). "
                      "`device busy` is the union of kernel intervals; `gap` = wall - busy: launch and host "
                      "overhead. `idle`: where the device sat idle between its first and last kernel, in waits of "
                      "at least 10 µs (on the host: a loop predicate read back, an empty launch queue) and between "
                      "back-to-back kernels (launch latency, or a host issuing kernels slower than they run); `host "
                      "launch API` / `host sync`: the host's time in CUDA launch and synchronize calls (tracing makes "
                      "launches dearer). Rows: kernel families (instance numbers stripped), per token (AR) or per "
                      "step.", ""]
                md += kernel_profile_markdown(full["kernel_profiles"])
                write_results(args.out, kstem, {**head, "stem": kstem, "kernel_profiles": full["kernel_profiles"]},
                              "\n".join(md) + "\n", echo=False)
            if full["rows"]:
                plot_cost_curve(full, os.path.join(args.out, stem + ".png"))

        res = forced_cost_curve(model, ps, gammas, args.rollbacks.split(","), args.prompt_len or 256,
                                args.max_new_tokens, max(1, args.repeats), args.time_budget_s, on_row=save_curve,
                                methods=tuple(curve_methods),
                                exact_modes={"both": (True, False), "on": (True,), "off": (False,)}[args.exact],
                                kernel_profile=args.kernel_profile, ar_eos=args.ar_eos)
        save_curve(res)
        return
    result = {**header, "model": name, "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "steps": [] if args.skip_steps else step_costs(model, gammas, 256, args.repeats)}

    def save():
        write_results(args.out, f"spec_{name}{args.tag}", result, markdown(result, name, header, args))

    if not args.skip_e2e:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.model)
        prompts = load_prompts(args.prompts, tok, 10 ** 4 if args.prompt_len else args.num_prompts,
                               keep=max(384, args.prompt_len or 0))
        if args.prompt_len:
            prompts = cut_prompts(prompts, args.prompt_len)
        prompts = [np.asarray([p]) for p in prompts[:args.num_prompts]]
        from specdec_jax.decoding.speculative import DEFAULT_ROLLBACK
        available = set(sj.supported_methods(model))
        configs, skipped = [], []
        for item in args.e2e_methods.split(","):
            method, gamma, options, rollback = parse_e2e_method(item)
            (configs if method in available else skipped).append(
                (method, gamma or args.e2e_gamma, rollback or DEFAULT_ROLLBACK, options))
        result["e2e_skipped_methods"] = [c[0] for c in skipped]
        label = lambda m, g, rb, opts: f"{m}:{g}{''.join(f':{k}={v}' for k, v in opts.items())}/{rb}"

        def run(ids, method, gamma=None, rollback=None, options=()):
            if method == "ar":
                return sj.generate(model, ids, args.max_new_tokens, eos_token_id=False)
            return sj.generate(model, ids, args.max_new_tokens, method=method, gamma=gamma, rollback=rollback,
                               eos_token_id=False, **dict(options))

        result["compile_seconds"] = {}
        if prompts:  # warm-up: compile and GPU autotuning happen here, outside the timed runs
            result["compile_seconds"]["ar"] = run(prompts[0], "ar").stats["compile_seconds"]
            for c in configs:
                result["compile_seconds"][label(*c)] = run(prompts[0], *c).stats["compile_seconds"]
        result["e2e"] = []
        rounds = max(1, args.e2e_repeats)
        for ids in prompts:
            ar_tps, tps, first = [], {label(*c): [] for c in configs}, {}
            for _ in range(rounds):  # AR, then every method, again and again: each method paired with each round's AR
                ar = run(ids, "ar")
                ar_tps.append(ar.stats["decode_tokens_per_second"])
                for c in configs:
                    sp = run(ids, *c)
                    # Same formula as AR's decode tok/s: tokens after the first (which comes from the prefill).
                    tps[label(*c)].append(decode_tokens_per_second(sp.stats))
                    first.setdefault(label(*c), (sp, ar))
            row = {"prompt_tokens": ids.shape[1], "ar_tps": float(np.median(ar_tps)), "ar_tps_rounds": ar_tps}
            for c in configs:
                sp, ar = first[label(*c)]
                own_rows = own_reference_rows(sp.stats, ar.stats)
                ref = ar.tokens if own_rows is None else sj.generate(model, ids, args.max_new_tokens,
                                                                     eos_token_id=False, decode_rows=own_rows).tokens
                ratios = [t / a for t, a in zip(tps[label(*c)], ar_tps)]
                row[label(*c)] = {"tps": float(np.median(tps[label(*c)])), "speedup": float(np.median(ratios)),
                                  "speedup_rounds": ratios, "mean_accepted": sp.stats["mean_accepted"],
                                  "verify_steps": sp.stats["verify_steps"],
                                  "equal_to_ar": bool((sp.tokens == ref).all())}
            result["e2e"].append(row)
            print(json.dumps(row), flush=True)
            rows = result["e2e"]
            result["e2e_summary"] = {
                label(*c): {"median_speedup": float(np.median([r[label(*c)]["speedup"] for r in rows])),
                            "mean_accepted": float(np.mean([r[label(*c)]["mean_accepted"] for r in rows])),
                            "equal_to_ar": sum(r[label(*c)]["equal_to_ar"] for r in rows),
                            "compile_seconds": result["compile_seconds"][label(*c)]}
                for c in configs}
            save()
    save()


def markdown(result, name, header, args) -> str:
    md = [f"# Speculative decoding step costs and speedups ({name})", "",
          f"{header['device']} · jax {header['jax']} · commit {header['git_commit']}", "", f"`{header['command']}`",
          "", f"XLA_FLAGS={result['xla_flags']!r}", "", "| rollback | gamma | verify ms | AR step ms | verify / AR | commit ms | rollback state |",
          "|---|---|---|---|---|---|---|"]
    for r in result["steps"]:
        md.append(f"| {r['rollback']} | {r['gamma']} | {r['verify_ms']:.3f} | {r['ar_step_ms']:.3f} | "
                  f"{r['verify_over_ar']:.2f}× | {r['commit_ms']:.3f} | {r['rollback_state_bytes'] / 2**20:.2f} MiB |")
    if "e2e_summary" in result:
        n = len(result["e2e"])
        ar_tps = float(np.median([r["ar_tps"] for r in result["e2e"]]))
        md += ["", f"End to end, greedy, {n} prompts of {args.prompt_len or 'their own'} tokens, "
                   f"{args.max_new_tokens} new tokens (decode tok/s; {args.e2e_repeats} rounds per prompt, each "
                   f"running AR then every method; a prompt's speedup is the median of its rounds' ratios to that "
                   f"round's AR; compile and autotuning in a warm-up run before). AR: median {ar_tps:.1f} tok/s, "
                   f"compiled in "
                   f"{result['compile_seconds'].get('ar', float('nan')):.1f} s.", "",
               "| method:gamma / rollback | median speedup over AR | mean accepted drafts / step | outputs equal to AR "
               "| compile s |", "|---|---|---|---|---|"]
        for key, s in result["e2e_summary"].items():
            md.append(f"| {key} | {s['median_speedup']:.2f}× | {s['mean_accepted']:.2f} | {s['equal_to_ar']} of {n} "
                      f"| {s['compile_seconds']:.1f} |")
        if result.get("e2e_skipped_methods"):
            md += ["", f"Not run (the checkpoint lacks what they need): {', '.join(result['e2e_skipped_methods'])}."]
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()
