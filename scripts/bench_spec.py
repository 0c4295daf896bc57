"""Speculative decoding benchmark for Qwen3.5, paired with AR on the same prompts.

For a checkpoint folder (or --random-9b: the transformers default 9B shape with random bf16 weights):
  - end to end: AR and n-gram speculation alternate on every prompt (greedy): tok/s, mean accepted
    drafts per verify step, speedup (median over prompts), outputs checked equal to AR;
  - step costs: one verification forward of gamma + 1 tokens vs one AR step, and the commit, for
    gamma in --gammas, in both rollback modes;
  - speculative recurrent-state memory: what a verification keeps for rollback (snapshot: one GDN
    state per position; pseudo: k, g, v_new per position), from the traced shapes.

    python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --prompts heldout --out benchmarks/results
    python scripts/bench_spec.py --random-9b --skip-e2e --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from scripts.bench_common import median_time, result_header, write_results  # noqa: E402


def random_9b_model(tiny: bool):
    """Random bf16 weights made on the device in the fused layout (no file, no transformers)."""
    from specdec_jax.config import qwen35_config_from_dict
    from specdec_jax.loading import build_tree
    from specdec_jax.model import Model
    from specdec_jax.models import qwen35
    from transformers import Qwen3_5TextConfig
    raw = Qwen3_5TextConfig().to_dict()
    if tiny:
        raw.update(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, layer_types=None)
    raw["model_type"] = "qwen3_5_text"
    cfg = qwen35_config_from_dict(raw)
    specs = qwen35.param_specs(cfg, {"model.embed_tokens.weight"}, "random")
    keys = iter(jax.random.split(jax.random.PRNGKey(0), len(specs)))

    def make(leaf):
        shape = (sum(s[0] for _, s in leaf.groups[0]),) + leaf.groups[0][0][1][1:]
        if len(leaf.groups) > 1 or leaf.stack:
            shape = (len(leaf.groups),) + shape
        if leaf.groups[0][0][0].endswith("conv1d.weight"):
            shape = (shape[0], shape[2])
        scale = shape[-1] ** -0.5 if len(shape) > 1 else 0.1
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(jnp.bfloat16)

    return Model(config=cfg, params=build_tree(specs, make), dtype=jnp.bfloat16)


def load_prompts(spec: str, tokenizer, limit: int) -> list[list[int]]:
    if spec == "heldout":
        from specdec_jax.corpus import heldout_prompts
        texts = heldout_prompts(max_prompts=limit)
    else:
        with open(spec) as f:
            texts = json.load(f) if spec.endswith(".json") else [line.rstrip("\n").replace("\\n", "\n") for line in f]
    return [tokenizer(t)["input_ids"][-384:] for t in texts[:limit]]


def step_costs(model, gammas, prompt_len: int, repeats: int):
    """Median time of one verification forward (gamma + 1 tokens, collect) vs one AR step, plus commit.

    Every variant is lowered first and compiled on a thread pool (XLA compiles release the GIL):
    a 9B forward takes tens of seconds to compile, and there are two per (gamma, rollback).
    """
    from concurrent.futures import ThreadPoolExecutor

    from specdec_jax.models import qwen35
    cfg, params = model.config, model.params
    max_len = prompt_len + max(gammas) + 2
    base = qwen35.init_state(cfg, 1, max_len, model.dtype)
    base = base.replace(length=jnp.full((1,), prompt_len, jnp.int32),
                        recurrent=tuple(jax.random.normal(jax.random.PRNGKey(i), r.shape, jnp.float32) * 0.1
                                        for i, r in enumerate(base.recurrent)))
    tok1 = jnp.ones((1, 1), jnp.int32)
    ar = jax.jit(lambda p, s, t: qwen35.forward(p, cfg, s, t, logits_for="last")[0])
    commit = jax.jit(lambda s, v, e, n: qwen35.commit(s, v, e, n))
    variants = [(rb, g) for rb in ("pseudo", "snapshot") for g in gammas if not (rb == "snapshot" and g + 1 > 64)]
    lowered = {"ar": ar.lower(params, base, tok1)}
    verify_fns = {}
    for rb, g in variants:
        verify_fns[rb, g] = jax.jit(lambda p, s, t, rb=rb: qwen35.forward(p, cfg, s, t, collect=rb))
        lowered[rb, g] = verify_fns[rb, g].lower(params, base, jnp.ones((1, g + 1), jnp.int32))
    with ThreadPoolExecutor(max_workers=8) as pool:
        compiled = dict(zip(lowered, pool.map(lambda lo: lo.compile(), lowered.values())))
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
    ap.add_argument("--e2e-methods", default="ngram,ngram-table,mtp,mtp-shortlist",
                    help="comma list (n-gram runs with both rollback modes, the others with pseudo-values)")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-steps", action="store_true", help="no step-cost table (end to end only)")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    import specdec_jax as sj

    gammas = [int(g) for g in args.gammas.split(",")]
    header = result_header("bench_spec")
    if args.random_9b:
        model, name = random_9b_model(args.tiny), ("qwen35_tiny_random" if args.tiny else "qwen35_9b_random")
    else:
        model, name = sj.load(args.model, dtype="bfloat16"), os.path.basename(os.path.normpath(args.model))
    result = {**header, "model": name, "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "steps": [] if args.skip_steps else step_costs(model, gammas, 256, args.repeats)}

    def save():
        write_results(args.out, f"spec_{name}{args.tag}", result, markdown(result, name, header, args))

    if not args.skip_e2e:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.model)
        prompts = load_prompts(args.prompts, tok, 10 ** 4 if args.prompt_len else args.num_prompts)
        if args.prompt_len:
            prompts = [p[-args.prompt_len:] for p in prompts if len(p) >= args.prompt_len]
        prompts = [np.asarray([p]) for p in prompts[:args.num_prompts]]
        available = set(sj.supported_methods(model))
        configs = [(m, rb) for m in args.e2e_methods.split(",") if m in available
                   for rb in (("pseudo", "snapshot") if m == "ngram" else ("pseudo",))]
        result["e2e_skipped_methods"] = [m for m in args.e2e_methods.split(",") if m not in available]

        def run(ids, method, rollback):
            if method == "ar":
                return sj.generate(model, ids, args.max_new_tokens, eos_token_id=False)
            return sj.generate(model, ids, args.max_new_tokens, method=method, gamma=args.e2e_gamma,
                               rollback=rollback, eos_token_id=False)

        if prompts:  # warm-up: compile and GPU autotuning happen here, outside the timed runs
            for method, rollback in [("ar", None)] + configs:
                run(prompts[0], method, rollback)
        result["e2e"] = []
        for ids in prompts:
            ar = run(ids, "ar", None)
            row = {"prompt_tokens": ids.shape[1], "ar_tps": ar.stats["decode_tokens_per_second"]}
            for method, rollback in configs:
                sp = run(ids, method, rollback)
                # Same formula as AR's decode tok/s: tokens after the first (which comes from the prefill).
                tps = (sp.stats["new_tokens"] - 1) / sp.stats["decode_seconds"]
                row[f"{method}/{rollback}"] = {"tps": tps, "speedup": tps / row["ar_tps"],
                                               "mean_accepted": sp.stats["mean_accepted"],
                                               "verify_steps": sp.stats["verify_steps"],
                                               "equal_to_ar": bool((sp.tokens == ar.tokens).all())}
            result["e2e"].append(row)
            print(json.dumps(row), flush=True)
            rows = result["e2e"]
            result["e2e_summary"] = {
                f"{m}/{rb}": {"median_speedup": float(np.median([r[f"{m}/{rb}"]["speedup"] for r in rows])),
                              "mean_accepted": float(np.mean([r[f"{m}/{rb}"]["mean_accepted"] for r in rows])),
                              "all_equal_to_ar": all(r[f"{m}/{rb}"]["equal_to_ar"] for r in rows)}
                for m, rb in configs}
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
        md += ["", f"End to end, greedy, gamma={args.e2e_gamma}, {len(result['e2e'])} prompts of "
                   f"{args.prompt_len or 'their own'} tokens, {args.max_new_tokens} new tokens (decode tok/s, each "
                   f"prompt paired with AR; compile and autotuning in a warm-up run before):", "",
               "| method / rollback | median speedup over AR | mean accepted drafts / step | outputs equal to AR |",
               "|---|---|---|---|"]
        for key, s in result["e2e_summary"].items():
            md.append(f"| {key} | {s['median_speedup']:.2f}× | {s['mean_accepted']:.2f} | {s['all_equal_to_ar']} |")
        if result.get("e2e_skipped_methods"):
            md += ["", f"Not run (the checkpoint lacks what they need): {', '.join(result['e2e_skipped_methods'])}."]
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()
