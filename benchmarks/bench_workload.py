"""Real workloads through the public API (issue 48): prompts of natural lengths, compile time included.

Parts (each writes its rows into one result JSON as it goes; --parts picks them):
  sequence   the 9-call sequence a new user runs: prompts of 20-50 tokens, 24-40 new tokens, one method:
             per call wall seconds, compile seconds, programs compiled.
  workload   N held-out prompts cut at random lengths (--min-len..--max-len tokens) from the held-out files,
             max_new_tokens drawn from --min-new..--max-new, per method: wall time split into compile / prefill /
             decode, programs compiled, overall tokens/s, and whether each speculative output equals AR's.
  lengths    new prompt lengths in a warm bucket (--lengths, e.g. 1000,1001,1002): a call's wall time beyond its
             prefill and decode (what a new shape costs), AR.
  batch      ragged batches of B prompts (--batches): AR and n-gram aggregate tok/s, speedup, bf16 rows equal
             within the call and to their batch-1 runs. --forced-p P: the speculation drafts AR's own continuation
             with a fraction 1 - P of the drafts altered (forced acceptance P, `harness.register_reference_drafts`)
             instead of n-gram drafts.
  second     a second process on a warm persistent compilation cache: its first generate's wall seconds after load.
  stream     sj.stream in chunks of --chunk-steps against generate (wall seconds, AR and n-gram).
  chunks     prefill tokens/s by chunk size (--chunks) at --chunk-lengths, and the one-shot prefill of the exact prompt.
  exact      --exact-prompts held-out prompts of natural lengths: every method's output equal to AR's, batch 1 (each
             prompt in its bucket) and as one ragged batch (within the call); rows of the ragged batch equal to their
             batch-1 runs (reported, not required in bf16); the same prompt in two cache buckets (reported); the
             batch continued (generate(state=...)) with a next turn of 1-32 tokens per row: the method and AR from
             the method's batch state, equal; a drafter with a state of its own (MTP, self-draft) is continued
             once more with that state dropped (tokens per step of both). Looped models' prompts are at most
             --exact-len tokens.

    python benchmarks/bench_workload.py --model checkpoints/tiny-qwen35-code --parts sequence,workload,second
    python benchmarks/bench_workload.py --random-9b --damp 0.02 --parts lengths,batch --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import specdec_jax as sj  # noqa: E402
from specdec_jax.bench.harness import result_header, write_results  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint folder (or tiny-qwen)")
    src.add_argument("--random-9b", action="store_true", help="Qwen3.5-9B shape, random bf16 weights")
    src.add_argument("--random-huginn", action="store_true", help="Huginn-0125 shape, random bf16 weights")
    ap.add_argument("--tiny", action="store_true", help="with --random-9b / --random-huginn: a tiny shape (CPU smoke)")
    ap.add_argument("--damp", type=float, default=0.02, help="--random-9b: residual writes scaled (drafts accepted)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--parts", default="sequence,workload,second")
    ap.add_argument("--methods", default="ar,ngram", help="workload: methods (name or name:gamma)")
    ap.add_argument("--prompts", type=int, default=100, help="workload: number of prompts")
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--min-new", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--lengths", default="1000,1001,1002")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--batch-new", type=int, default=128)
    ap.add_argument("--forced-p", type=float, default=None, help="batch: forced acceptance p instead of n-gram")
    ap.add_argument("--batch-gamma", type=int, default=4, help="batch: the speculation's gamma")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-steps", type=int, default=16, help="stream: decode steps a chunk")
    ap.add_argument("--chunks", default="256,512,1024",
                    help="chunks: prefill chunk sizes to time ('oneshot': one forward of the exact prompt)")
    ap.add_argument("--chunk-lengths", default="256,1000,4000", help="chunks: prompt lengths")
    ap.add_argument("--chunk-repeats", type=int, default=3, help="chunks: timed prefills per setting (median)")
    ap.add_argument("--exact-prompts", type=int, default=20)
    ap.add_argument("--exact-len", type=int, default=128, help="exact: the longest prompt of a looped model")
    ap.add_argument("--exact-new", type=int, default=64)
    ap.add_argument("--skip-batch1", action="store_true",
                    help="exact: only the ragged batch and its continuation (no batch-1 runs, no second bucket)")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "specdec_bench_out"))
    ap.add_argument("--name", default=None, help="result file stem (default workload_<model>)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting new work after this many seconds")
    return ap.parse_args(argv)


def load_model(args):
    if args.random_9b:
        import dataclasses
        from benchmarks.bench_spec import random_9b_model
        model = random_9b_model(args.tiny, args.dtype, args.damp)
        if args.damp < 1:  # the head tied to the embedding: with damped residual writes a token's top logit is the
            # token itself, so n-gram drafts are accepted (as the public-API check of the cost curve was run)
            model = dataclasses.replace(model, params=dict(model.params, lm_head=None))
        # Qwen3.5's trained context (transformers' config default says 32768), so long prompts fit
        model = dataclasses.replace(model, config=dataclasses.replace(model.config, max_position_embeddings=262144))
        return model, "qwen35_tiny_random" if args.tiny else "qwen35_9b_random"
    if args.random_huginn:
        return random_huginn_model(args.tiny, args.dtype), "huginn_tiny_random" if args.tiny else "huginn0125_random"
    model = sj.load(args.model, dtype=args.dtype)
    return model, os.path.basename(os.path.normpath(model.path))


def random_huginn_model(tiny: bool, dtype: str):
    """Huginn-0125's shape (or a tiny one of the same structure), random weights N(0, 0.02) made on the device."""
    import jax
    import jax.numpy as jnp
    from benchmarks.bench_looped import bench_config
    from specdec_jax.models.looped import model as looped
    from specdec_jax.results import Model
    cfg = bench_config(tiny)
    params = looped.init_random_params(cfg, jax.random.PRNGKey(0), jnp.dtype(dtype), std=0.02)
    return Model(config=cfg, params=params, dtype=jnp.dtype(dtype))


def method_spec(text: str) -> tuple[str, dict]:
    name, _, gamma = text.partition(":")
    return name, ({"gamma": int(gamma)} if gamma else {})


def heldout_token_files(model) -> list[np.ndarray]:
    """The held-out stdlib files, tokenized with the model's tokenizer (random ids for a random model)."""
    from specdec_jax.training import corpus
    if model.tokenizer is None:
        rng = np.random.default_rng(1)
        return [rng.integers(0, model.vocab_size, 4096).astype(np.int32) for _ in range(16)]
    root = corpus.stdlib_root()
    texts = corpus.read_texts(root, corpus.split_corpus(root)[1])
    return [np.asarray(model.tokenizer.encode(t, add_special_tokens=False), np.int32) for t in texts]


def natural_prompts(files, count, lo, hi, rng) -> list[np.ndarray]:
    """`count` prompts, each a random cut of a random held-out file at a random length in [lo, hi]."""
    long_enough = [f for f in files if len(f) >= lo]
    out = []
    for _ in range(count):
        f = long_enough[rng.integers(len(long_enough))]
        n = int(rng.integers(lo, min(hi, len(f)) + 1))
        start = int(rng.integers(0, len(f) - n + 1))
        out.append(f[start:start + n])
    return out


def timed_generate(model, prompts, n, method, **options):
    t0 = time.perf_counter()
    res = sj.generate(model, prompts, n, method=method, **options)
    return res, time.perf_counter() - t0


def part_sequence(model, args, rng, out):
    lengths = rng.integers(20, 51, 9)
    news = rng.integers(24, 41, 9)
    files = heldout_token_files(model)
    prompts = natural_prompts(files, 9, 20, 50, rng)
    rows = []
    method = "self-spec" if model.family == "looped" else "ngram"  # a chain method of the family, gamma 4
    for p, n in zip([p[:L] for p, L in zip(prompts, lengths)], news):
        res, wall = timed_generate(model, [p], int(n), method, gamma=4)
        rows.append({"prompt_len": len(p), "max_new_tokens": int(n), "wall_seconds": wall,
                     "compile_seconds": res.stats["compile_seconds"], "compiled_programs": res.stats["compiled_programs"]})
        print(f"  sequence: prompt {len(p):4d} new {int(n):3d}: {wall:.3f} s, {res.stats['compiled_programs']} "
              f"programs compiled", flush=True)
    out["sequence"] = {"method": f"{method}:4", "calls": rows,
                       "calls_that_compiled": sum(r["compiled_programs"] > 0 for r in rows),
                       "max_reuse_seconds": max([r["wall_seconds"] for r in rows if not r["compiled_programs"]] + [0])}


def part_workload(model, args, rng, out, t_start):
    files = heldout_token_files(model)
    prompts = natural_prompts(files, args.prompts, args.min_len, args.max_len, rng)
    news = [int(x) for x in rng.integers(args.min_new, args.max_new + 1, args.prompts)]
    result = {}
    ar_tokens = {}
    for text in args.methods.split(","):
        name, options = method_spec(text)
        tot = dict(wall=0.0, compile=0.0, prefill=0.0, decode=0.0, tokens=0, programs=0, calls=0, equal_to_ar=0)
        for i, (p, n) in enumerate(zip(prompts, news)):
            if time.perf_counter() - t_start > args.budget_s:
                break
            res, wall = timed_generate(model, [p], n, name, **options)
            s = res.stats
            tot["wall"] += wall
            tot["compile"] += s["compile_seconds"]
            tot["prefill"] += s["prefill_seconds"]
            tot["decode"] += s["decode_seconds"]
            tot["tokens"] += s["new_tokens"]
            tot["programs"] += s["compiled_programs"]
            tot["calls"] += 1
            if name == "ar":
                ar_tokens[i] = res.tokens
            elif i in ar_tokens:
                tot["equal_to_ar"] += int(np.array_equal(res.tokens, ar_tokens[i]))
        tot["tokens_per_second_overall"] = tot["tokens"] / max(tot["wall"], 1e-9)
        tot["tokens_per_second_decoding"] = tot["tokens"] / max(tot["prefill"] + tot["decode"], 1e-9)
        result[text] = tot
        print(f"  workload {text}: {tot['calls']} calls, {tot['programs']} programs compiled, wall {tot['wall']:.1f} s "
              f"(compile {tot['compile']:.1f}, prefill {tot['prefill']:.1f}, decode {tot['decode']:.1f}), "
              f"{tot['tokens_per_second_overall']:.1f} tok/s overall", flush=True)
    out["workload"] = {"prompts": len(prompts), "prompt_lengths": [len(p) for p in prompts], "max_new_tokens": news,
                       "methods": result}


def part_lengths(model, args, rng, out):
    files = heldout_token_files(model)
    base = natural_prompts(files, 1, 4096, 4096, rng)[0] if model.tokenizer else rng.integers(
        0, model.vocab_size, 4096).astype(np.int32)
    rows = []
    for L in [int(x) for x in args.lengths.split(",")]:
        res, wall = timed_generate(model, [base[:L]], 32, "ar")
        s = res.stats
        rows.append({"prompt_len": L, "wall_seconds": wall, "prefill_seconds": s["prefill_seconds"],
                     "decode_seconds": s["decode_seconds"], "compile_seconds": s["compile_seconds"],
                     "compiled_programs": s["compiled_programs"],
                     "beyond_prefill_and_decode_seconds": wall - s["prefill_seconds"] - s["decode_seconds"]})
        print(f"  lengths: {L}: wall {wall:.3f} s, beyond prefill+decode {rows[-1]['beyond_prefill_and_decode_seconds']:.3f} "
              f"s, {s['compiled_programs']} programs compiled", flush=True)
    out["lengths"] = {"method": "ar", "max_new_tokens": 32, "rows": rows}


def part_batch(model, args, rng, out, t_start, save=lambda: None):
    files = heldout_token_files(model)
    rows = []
    for B in [int(x) for x in args.batches.split(",")]:
        if time.perf_counter() - t_start > args.budget_s:
            break
        prompts = natural_prompts(files, B, 64, 512, rng)
        spec_name, spec_options = "ngram", {"gamma": args.batch_gamma}
        if args.forced_p is not None:  # drafts: the exact reference (AR at the speculation's rows), some altered
            from specdec_jax.bench.harness import register_reference_drafts
            from specdec_jax.decoding.decode_shape import choose_decode_rows
            rows_ = choose_decode_rows(args.batch_gamma, None, "qwen3_5")
            reference = sj.generate(model, prompts, args.batch_new, eos_token_id=False, decode_rows=rows_)
            register_reference_drafts("forced", reference.tokens, [len(p) for p in prompts], args.forced_p,
                                      seed=B)
            spec_name = "forced"
        runs = {}
        for name, options in (("ar", {}), (spec_name, spec_options)):
            timed_generate(model, prompts, args.batch_new, name, eos_token_id=False, **options)  # compile + warm
            best = None
            for _ in range(3):
                res, wall = timed_generate(model, prompts, args.batch_new, name, eos_token_id=False, **options)
                if best is None or res.stats["seconds"] < best[0].stats["seconds"]:
                    best = (res, wall)
            runs[name] = best[0]
        ar, ng = runs["ar"], runs[spec_name]
        alone = [sj.generate(model, [p], args.batch_new, eos_token_id=False).tokens[0] for p in prompts[:4]]
        row = {"batch": B, "prompt_lengths": [len(p) for p in prompts],
               "ar_tok_s": ar.stats["tokens_per_second"], "spec_tok_s": ng.stats["tokens_per_second"],
               "speedup": ng.stats["tokens_per_second"] / ar.stats["tokens_per_second"],
               "spec_tokens_per_step": ng.stats.get("tokens_per_step"),
               "rows_equal_ar_within_call": int(sum(np.array_equal(a, b) for a, b in zip(ar.tokens, ng.tokens))),
               "rows_checked_against_batch1": len(alone),
               "rows_equal_batch1": int(sum(np.array_equal(a, ar.tokens[i]) for i, a in enumerate(alone)))}
        rows.append(row)
        out["batch"] = {"max_new_tokens": args.batch_new, "gamma": args.batch_gamma, "rows": rows}
        save()
        print(f"  batch {B}: AR {row['ar_tok_s']:.1f} tok/s, {spec_name} {row['spec_tok_s']:.1f} tok/s "
              f"({row['speedup']:.2f}x, {row['spec_tokens_per_step']:.2f} tokens/step); rows equal to AR in the call "
              f"{row['rows_equal_ar_within_call']}/{B}, to batch-1 AR {row['rows_equal_batch1']}/{len(alone)}",
              flush=True)
    out["batch"] = {"max_new_tokens": args.batch_new, "gamma": args.batch_gamma, "rows": rows,
                    "drafts": ("n-gram" if args.forced_p is None else
                               f"forced acceptance p {args.forced_p}: AR's continuation (at the speculation's rows), "
                               f"a fraction {1 - args.forced_p:g} of the drafts altered")}


def part_exact(model, args, rng, out, t_start, save=lambda: None):
    files = heldout_token_files(model)
    # natural lengths (a ragged batch); looped models up to --exact-len (their prefill is the costlier)
    longest = args.exact_len if model.family == "looped" else 512
    prompts = natural_prompts(files, args.exact_prompts, 16, longest, rng)
    n = args.exact_new
    single = not args.skip_batch1
    ar1 = [sj.generate(model, [p], n).tokens[0] for p in prompts] if single else []
    ar_batch = sj.generate(model, prompts, n)
    rows = {"ar": {"batch_rows_equal_batch1": int(sum(np.array_equal(a, b) for a, b in zip(ar_batch.tokens, ar1)))
                   if single else None}}
    if single:  # the same prompts with a budget that puts them in another cache bucket
        other = [sj.generate(model, [p], n, max_len=4096).tokens[0] for p in prompts]
        rows["ar"]["other_bucket_equal"] = int(sum(np.array_equal(a, b) for a, b in zip(other, ar1)))
    # Continuation: each row's next turn (1-32 new tokens) after its batch generation, continued from the method's
    # batch state by the method and by AR (the same state in; rows that met their EOS go on with the next turn)
    turn = natural_prompts(files, len(prompts), 1, 32, rng)
    for text in args.methods.split(","):
        name, options = method_spec(text)
        if name == "ar" or time.perf_counter() - t_start > args.budget_s:
            continue
        one = [sj.generate(model, [p], n, method=name, **options) for p in prompts] if single else []
        batch = sj.generate(model, prompts, n, method=name, **options)
        cont = sj.generate(model, turn, n, method=name, state=batch.state, **options)
        ar_cont = sj.generate(model, turn, n, state=batch.state)
        # The drafter's own state dropped (what continuation did before it was carried): acceptance only
        dropped = (sj.generate(model, turn, n, method=name, state=batch.state.replace(drafter=None, drafter_kind=None),
                               **options) if getattr(batch.state, "drafter_kind", None) else None)
        rows[text] = {
            "continued_equal_ar": int(sum(np.array_equal(a, b) for a, b in zip(cont.tokens, ar_cont.tokens))),
            "batch1_equal_ar": int(sum(np.array_equal(r.tokens[0], a) for r, a in zip(one, ar1))) if single else None,
            "batch_equal_ar_within_call": int(sum(np.array_equal(a, b) for a, b in zip(batch.tokens, ar_batch.tokens))),
            "batch_rows_equal_batch1": (int(sum(np.array_equal(b, r.tokens[0]) for b, r in zip(batch.tokens, one)))
                                        if single else None),
            "tokens_per_step_batch1": float(np.mean([r.stats.get("tokens_per_step", 1.0) for r in one])) if one else None,
            "tokens_per_step_batch": batch.stats.get("tokens_per_step"),
            "tokens_per_step_continued": cont.stats.get("tokens_per_step"),
            "tokens_per_step_continued_drafter_restarted": dropped.stats.get("tokens_per_step") if dropped else None,
            "continued_drafter_restarted_equal_ar": (
                int(sum(np.array_equal(a, b) for a, b in zip(dropped.tokens, ar_cont.tokens))) if dropped else None),
        }
        out["exact"] = {"prompts": len(prompts), "prompt_lengths": [len(p) for p in prompts], "max_new_tokens": n,
                        "methods": rows}
        save()
        r = rows[text]
        ones = (f"batch 1 equal to AR {r['batch1_equal_ar']}/{len(prompts)}, batch rows equal to batch 1 "
                f"{r['batch_rows_equal_batch1']}/{len(prompts)}, " if single else "")
        print(f"  exact {text}: {ones}ragged batch equal to AR in the call {r['batch_equal_ar_within_call']}/"
              f"{len(prompts)}, continued equal to AR's continuation {r['continued_equal_ar']}/{len(prompts)}"
              + (f" ({r['tokens_per_step_continued']:.2f} tokens/step; drafter restarted: "
                 f"{r['tokens_per_step_continued_drafter_restarted']:.2f})"
                 if r['tokens_per_step_continued_drafter_restarted'] is not None else ""), flush=True)
    out["exact"] = {"prompts": len(prompts), "prompt_lengths": [len(p) for p in prompts], "max_new_tokens": n,
                    "methods": rows}


def part_chunks(model, args, rng, out, t_start):
    """Prefill tokens/s by chunk size (the bucketed prefill's default is chosen by this), and, where --chunks lists
    'oneshot', one forward of the exact prompt (the path before buckets); AR with one new token, the median of
    --chunk-repeats prefills after a first (compiling) call. Longest prompts first, under --budget-s."""
    from specdec_jax.decoding import autoregressive, buckets
    from specdec_jax.decoding.sampling import SamplingConfig
    from specdec_jax.models.family import family_for
    lengths = sorted((int(x) for x in args.chunk_lengths.split(",")), reverse=True)
    files = heldout_token_files(model)
    joined = np.concatenate(files)
    base = (rng.integers(0, model.vocab_size, max(lengths)).astype(np.int32) if model.tokenizer is None
            or len(joined) < max(lengths) else joined[:max(lengths)])
    rows = []
    saved = buckets.PREFILL_CHUNKS
    family = family_for(model.config)
    for L in lengths:
        for chunk in [c if c == "oneshot" else int(c) for c in args.chunks.split(",")]:
            if time.perf_counter() - t_start > args.budget_s:
                print(f"  chunks: budget reached before prompt {L} chunk {chunk}", flush=True)
                break
            prompt = base[:L]

            def run():
                if chunk == "oneshot":
                    return autoregressive.generate_ar(family, model, prompt[None], 1, decode_rows=8, max_len=L + 9,
                                                      sampling=SamplingConfig(), seed=0, eos_ids=())
                buckets.PREFILL_CHUNKS = (chunk,)
                try:
                    return sj.generate(model, [prompt], 1, eos_token_id=False)
                finally:
                    buckets.PREFILL_CHUNKS = saved
            try:
                first = run()
                times = sorted(run().stats["prefill_seconds"] for _ in range(args.chunk_repeats))
            except Exception as exc:  # e.g. out of memory: recorded, the sweep goes on
                rows.append({"prompt_len": L, "chunk": chunk, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                print(f"  chunks: prompt {L:6d} chunk {chunk!s:>7}: {rows[-1]['error'][:120]}", flush=True)
                continue
            med = times[len(times) // 2]
            rows.append({"prompt_len": L, "chunk": chunk, "prefill_seconds": med, "prefill_seconds_all": times,
                         "prefill_tok_s": L / med, "compile_seconds": first.stats["compile_seconds"],
                         "peak_memory_bytes": first.stats.get("peak_memory_bytes")})
            print(f"  chunks: prompt {L:6d} chunk {chunk!s:>7}: prefill {med * 1e3:9.2f} ms, "
                  f"{L / med:9.0f} tok/s (compile {first.stats['compile_seconds']:.1f} s)", flush=True)
    out["chunks"] = {"rows": rows}


def part_stream(model, args, rng, out, t_start):
    """sj.stream in chunks of --chunk-steps against generate, the same prompt and settings, alternated, best of 5
    wall seconds each (the stream's wall time runs to its last piece)."""
    files = heldout_token_files(model)
    prompt = natural_prompts(files, 1, 256, 256, rng)
    rows = []
    for name in ("ar", "ngram"):
        sj.generate(model, prompt, args.batch_new, method=name, eos_token_id=False)
        list(sj.stream(model, prompt, args.batch_new, chunk_steps=args.chunk_steps, method=name, eos_token_id=False))
        gen, streamed = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            whole = sj.generate(model, prompt, args.batch_new, method=name, eos_token_id=False).tokens
            gen.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pieces = list(sj.stream(model, prompt, args.batch_new, chunk_steps=args.chunk_steps, method=name,
                                    eos_token_id=False))
            streamed.append(time.perf_counter() - t0)
        rows.append({"method": name, "generate_seconds": min(gen), "stream_seconds": min(streamed),
                     "overhead": min(streamed) / min(gen) - 1, "pieces": len(pieces),
                     "equal": bool(np.array_equal(np.concatenate(pieces, axis=1), whole))})
        print(f"  stream {name}: generate {min(gen) * 1e3:.1f} ms, stream {min(streamed) * 1e3:.1f} ms "
              f"({rows[-1]['overhead'] * 100:+.1f}%), {len(pieces)} pieces, equal {rows[-1]['equal']}", flush=True)
    out["stream"] = {"chunk_steps": args.chunk_steps, "max_new_tokens": args.batch_new, "rows": rows}


SECOND = """
import sys, time
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[3])
import jax
import specdec_jax as sj
if sys.argv[1] == "random-9b":  # weights made on the device: 'load' is their making
    from benchmarks.bench_spec import random_9b_model
    m = random_9b_model(sys.argv[4] == "tiny", sys.argv[2], 0.02)
    jax.block_until_ready(m.params)
else:
    m = sj.load(sys.argv[1], dtype=sys.argv[2])
t1 = time.perf_counter()
r = sj.generate(m, [[15, 12, 290, 123, 7, 7, 88]], 32, method="ngram")
t2 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {r.stats['compile_seconds']:.3f}")
"""


def part_second(model, args, out):
    """Two fresh processes on one empty cache folder: the second's first generate after load."""
    source = "random-9b" if model is None or model.path is None else model.path
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, SPECDEC_COMPILATION_CACHE=cache)
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        rows = []
        for run in ("first process (cold cache)", "second process (warm cache)"):
            done = subprocess.run([sys.executable, "-c", SECOND, source, args.dtype, root,
                                   "tiny" if args.tiny else "full"], env=env, capture_output=True,
                                  text=True, check=True)
            load_s, gen_s, compile_s = map(float, done.stdout.split()[-3:])
            rows.append({"run": run, "load_seconds": load_s, "first_generate_seconds": gen_s,
                         "compile_seconds": compile_s})
            print(f"  second: {run}: load {load_s:.2f} s, first generate {gen_s:.2f} s (compile {compile_s:.2f})",
                  flush=True)
    out["second_process"] = rows


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    if args.parts == "second" and args.random_9b:  # the processes make their own weights: none held here
        model, name = None, "qwen35_tiny_random" if args.tiny else "qwen35_9b_random"
    else:
        model, name = load_model(args)
    stem = args.name or f"workload_{name}"
    out = result_header(stem)
    out.update(model=name, dtype=args.dtype)
    parts = args.parts.split(",")

    def save():
        write_results(args.out, stem, out, "```json\n" + json.dumps({k: v for k, v in out.items()
                                                                     if k not in ("env",)}, indent=1)[:20000] + "\n```\n", echo=False)

    for part in parts:
        print(f"part {part}", flush=True)
        if part == "sequence":
            part_sequence(model, args, rng, out)
        elif part == "workload":
            part_workload(model, args, rng, out, t_start)
        elif part == "lengths":
            part_lengths(model, args, rng, out)
        elif part == "batch":
            part_batch(model, args, rng, out, t_start, save)
        elif part == "second":
            part_second(model, args, out)
        elif part == "stream":
            part_stream(model, args, rng, out, t_start)
        elif part == "chunks":
            part_chunks(model, args, rng, out, t_start)
        elif part == "exact":
            part_exact(model, args, rng, out, t_start, save)
        else:
            raise SystemExit(f"unknown part {part!r}")
        save()
    print(f"wrote {os.path.join(args.out, stem)}.json")


if __name__ == "__main__":
    main()
