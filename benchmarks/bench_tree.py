"""Draft-tree benchmark for Qwen3.5: tree verify vs chain verify vs AR, speculative-state memory, end to end.

In one run, for --random-9b (the Qwen3.5-9B shape, random bf16 weights; --tiny: a CPU smoke shape)
and/or --model (a checkpoint folder):
  - step costs from a --prefix-token committed prefix (random recurrent states), per node budget N in
    --nodes: one tree verify (`tree_forward`, collect="pseudo") of N nodes for three shapes (bushy:
    the first N breadth-first nodes of --step-tree; star; chain as a tree) vs one chain verify of N
    tokens (`qwen35.forward`, collect="pseudo") vs one AR step, plus the commits (tree: deepest node);
  - memory: the recurrent state kept to commit any node, summed over GDN layers (tree-WY: k, g, v_new
    per node; snapshots: one [HV, K, V] fp32 state per node), from traced shapes (jax.eval_shape);
  - end to end (--model): greedy, paired with AR on the same prompts (cut to their last --prompt-len
    tokens: one compile per configuration, then one warm-up run): AR, MTP chains (gamma = tree depth),
    MTP trees (--trees), then n-gram chains and trees: decode tok/s, mean accepted drafts per step,
    median speedup over AR, outputs equal to AR. No configuration starts after --time-budget-s.
Files (tree_<name>.json / .md in --out) are rewritten after every section and configuration.

    python benchmarks/bench_tree.py --random-9b --model checkpoints/tiny-qwen35-code --prompts build/corpus/prompts.json --out benchmarks/results
    JAX_PLATFORMS=cpu python benchmarks/bench_tree.py --random-9b --tiny --nodes 8,16 --out /tmp/bt
    JAX_PLATFORMS=cpu python benchmarks/bench_tree.py --model checkpoints/tiny-qwen35-code --prompts build/corpus/prompts.json --num-prompts 2 --max-new-tokens 16 --nodes 8 --trees "2,2,1" --out /tmp/bt
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_spec import load_prompts, prefix_state, random_9b_model  # noqa: E402
from specdec_jax.bench.harness import (compile_all, cut_prompts, decode_tokens_per_second,  # noqa: E402
                                  median_time, result_header, write_results)
from specdec_jax.decoding.tree_spec import path_table, tree_commit, tree_depth, tree_forward, \
    tree_from_branching  # noqa: E402
from specdec_jax.models.qwen35 import model as qwen35  # noqa: E402

MiB = 2 ** 20


def step_shapes(branching, n: int, keep=("bushy", "star", "chain")) -> dict:
    """{label: (parents, depth)} of n-node trees: the first n breadth-first nodes of `branching`
    (still a tree: parents[i] < i), a star and a chain (those in `keep`)."""
    bushy, _ = tree_from_branching(branching)
    if len(bushy) < n:
        raise SystemExit(f"--step-tree {branching} has {len(bushy)} nodes < N = {n}")
    shapes = {"bushy": bushy[:n], "star": tree_from_branching((n - 1,))[0],
              "chain": tree_from_branching((1,) * (n - 1))[0]}
    return {k: (p, tree_depth(p)) for k, p in shapes.items() if k in keep}


def nbytes(x) -> int:
    return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def step_costs(model, name, nodes, branching, prefix, repeats, keep):
    """Median ms of tree verify (3 shapes) / chain verify (N tokens) / AR step / commits, per N.
    Every variant is lowered first, then all compile on a thread pool (9B compiles are slow)."""
    cfg, params = model.config, model.params
    base = prefix_state(model, prefix, prefix + max(nodes) + 2)
    fns, args = {"ar": jax.jit(lambda p, s, t: qwen35.forward(p, cfg, s, t, logits_for="last")[0])}, {}
    args["ar"] = (params, base, jnp.ones((1, 1), jnp.int32))
    for n in nodes:
        toks = jnp.ones((1, n), jnp.int32)
        fns["chain", n] = jax.jit(lambda p, s, t: qwen35.forward(p, cfg, s, t, collect="pseudo"))
        args["chain", n] = (params, base, toks)
        _, vs, ex = jax.eval_shape(fns["chain", n], *args["chain", n])
        fns["chain-commit", n] = jax.jit(lambda b, v, e, k: qwen35.commit(b, v, e, k))
        args["chain-commit", n] = (base, vs, ex, jnp.full((1,), n, jnp.int32))
        for shape, (par, dep) in step_shapes(branching, n, keep).items():
            fns["tree", n, shape] = jax.jit(lambda p, s, t, par=par, dep=dep:
                                            tree_forward(p, cfg, s, t, par, dep, collect="pseudo"))
            args["tree", n, shape] = (params, base, toks)
            _, vs, ex = jax.eval_shape(fns["tree", n, shape], *args["tree", n, shape])
            node = int(np.argmax(dep))  # deepest node: the longest accepted path
            fns["tree-commit", n, shape] = jax.jit(lambda b, v, e, a, pth, k, par=par:
                                                   tree_commit(b, v, e, par, a, pth, k))
            args["tree-commit", n, shape] = (base, vs, ex, jnp.full((1,), node, jnp.int32),
                                             jnp.asarray(path_table(par)[node][None]),
                                             jnp.full((1,), dep[node] + 1, jnp.int32))
    t0 = time.perf_counter()
    lowered = {k: fns[k].lower(*args[k]) for k in fns}
    run = compile_all(lowered, workers=8)
    print(f"[{name}] compiled {len(run)} variants in {time.perf_counter() - t0:.1f} s", flush=True)

    def ms(key, *a):
        return median_time(lambda: run[key](*a), repeats) * 1e3

    t_ar = ms("ar", *args["ar"])
    rows = []
    for n in nodes:
        _, vs, ex = run["chain", n](*args["chain", n])
        t_chain = ms(("chain", n), *args["chain", n])
        t_cc = ms(("chain-commit", n), base, vs, ex, args["chain-commit", n][3])
        for shape, (par, dep) in step_shapes(branching, n, keep).items():
            key = ("tree", n, shape)
            _, vs, ex = run[key](*args[key])
            t_tree = ms(key, *args[key])
            t_tc = ms(("tree-commit", n, shape), base, vs, ex, *args["tree-commit", n, shape][3:])
            rows.append({"model": name, "nodes": n, "shape": shape, "depth": int(dep.max()), "tree_verify_ms": t_tree,
                         "chain_verify_ms": t_chain, "ar_step_ms": t_ar, "tree_over_chain": t_tree / t_chain,
                         "tree_over_ar": t_tree / t_ar, "tree_commit_ms": t_tc, "chain_commit_ms": t_cc})
            print(json.dumps(rows[-1]), flush=True)
            del vs, ex
    return rows


def memory(model, name, nodes, branching, prefix):
    """Speculative recurrent-state bytes per mode from traced shapes (nothing large is allocated)."""
    cfg, params = model.config, model.params
    base = jax.eval_shape(lambda: qwen35.init_state(cfg, 1, prefix + max(nodes) + 2, model.dtype))
    rows = []
    for n in nodes:
        par, dep = step_shapes(branching, n)["bushy"]
        toks = jax.ShapeDtypeStruct((1, n), jnp.int32)
        gdn = {mode: jax.eval_shape(lambda p, s, t, mode=mode: tree_forward(p, cfg, s, t, par, dep, collect=mode)[2],
                                    params, base, toks)["gdn"] for mode in ("pseudo", "snapshot")}
        wy = sum(nbytes(ex[k]) for ex in gdn["pseudo"] for k in ("k", "g", "v_new"))
        snap = sum(nbytes(ex["all_states"]) for ex in gdn["snapshot"])
        rows.append({"model": name, "nodes": n, "gdn_layers": len(gdn["pseudo"]), "tree_wy_bytes": wy,
                     "snapshot_bytes": snap, "ratio": snap / wy,
                     "conv_source_bytes": sum(nbytes(ex["conv_source"]) for ex in gdn["pseudo"])})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def end_to_end(model, args, result, save, t_start):
    """AR first, then every configuration over all prompts (paired per prompt with AR)."""
    import specdec_jax as sj
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = load_prompts(args.prompts, tok, 10 ** 4)
    if args.prompt_len:
        prompts = cut_prompts(prompts, args.prompt_len)
    prompts = prompts[:args.num_prompts]
    trees = [tuple(int(b) for b in t.split(",")) for t in args.trees.split(";") if t.strip()]
    supported = sj.supported_methods(model)
    configs = [("ar", "ar", {}, 1)]
    for d in [x for x in ("mtp", "ngram") if x in supported and not (x == "ngram" and args.no_ngram)]:
        configs += [(f"{d} chain γ={g}", d, {"gamma": g}, g + 1) for g in sorted({len(t) for t in trees})]
        configs += [(f"{d}-tree {','.join(map(str, t))}", f"{d}-tree", {"tree": t}, len(tree_from_branching(t)[0]))
                    for t in trees]
    result["e2e_setup"] = {"prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
                           "max_new_tokens": args.max_new_tokens, "skipped": []}
    ar_tokens, ar_tps = [], []
    for label, method, kw, n_verify in configs:
        if time.perf_counter() - t_start > args.time_budget_s:
            result["e2e_setup"]["skipped"].append(label)
            continue
        warmed, rows = {}, []
        for i, ids in enumerate(prompts):
            ids = np.asarray([ids])
            if ids.shape[1] not in warmed:  # compile + first run, untimed
                warm = sj.generate(model, ids, args.max_new_tokens, method=method, eos_token_id=False, **kw)
                warmed[ids.shape[1]] = warm.stats["compile_seconds"]
            r = sj.generate(model, ids, args.max_new_tokens, method=method, eos_token_id=False, **kw)
            tps = decode_tokens_per_second(r.stats)  # tokens after the prefill's
            if method == "ar":
                ar_tokens.append(r.tokens)
                ar_tps.append(tps)
            rows.append({"tps": tps, "mean_accepted": r.stats.get("mean_accepted", 0.0),
                         "tokens_per_step": r.stats.get("tokens_per_step", 1.0),
                         "verify_steps": r.stats.get("verify_steps", r.stats["new_tokens"]),
                         "speedup": tps / ar_tps[i], "equal_to_ar": bool(np.array_equal(r.tokens, ar_tokens[i]))})
        result["e2e"].append({
            "config": label, "method": method, "options": kw, "nodes_per_verify": n_verify,
            "depth": len(kw["tree"]) if "tree" in kw else kw.get("gamma", 0),
            "median_tps": float(np.median([r["tps"] for r in rows])),
            "mean_accepted": float(np.mean([r["mean_accepted"] for r in rows])),
            "tokens_per_step": float(np.mean([r["tokens_per_step"] for r in rows])),
            "median_speedup": float(np.median([r["speedup"] for r in rows])),
            "all_equal_to_ar": all(r["equal_to_ar"] for r in rows), "compile_seconds": sum(warmed.values()),
            "per_prompt": rows})
        print(json.dumps({k: v for k, v in result["e2e"][-1].items() if k != "per_prompt"}), flush=True)
        save()


def verdict(result) -> list[str]:
    """Plain statements: where trees pay and where they do not, from the numbers above."""
    out = []
    for model in dict.fromkeys(r["model"] for r in result["steps"]):
        rows = [r for r in result["steps"] if r["model"] == model and r["shape"] == "bushy"]
        out += [] if not rows else [f"- Step ({model}): a bushy tree verify costs " + ", ".join(
            f"N={r['nodes']}: {r['tree_over_chain']:.2f}× the chain verify, {r['tree_over_ar']:.2f}× an AR step"
            for r in rows) + ". A tree pays only if its extra accepted tokens per step outgrow that cost."]
    for model in dict.fromkeys(r["model"] for r in result["memory"]):
        r = [r for r in result["memory"] if r["model"] == model][-1]
        target = f" (target ≥ 16× at N = 64: {'met' if r['ratio'] >= 16 else 'NOT met'})" if r["nodes"] == 64 else ""
        out.append(f"- Memory ({model}): per-node snapshots keep {r['ratio']:.1f}× the tree-WY state at "
                   f"N={r['nodes']} ({r['snapshot_bytes'] / MiB:.2f} vs {r['tree_wy_bytes'] / MiB:.2f} MiB){target}.")
    e2e = result["e2e"]
    for t in [c for c in e2e if c["method"].endswith("-tree")]:
        chain = next((c for c in e2e if c["method"] == t["method"][:-5] and c["depth"] == t["depth"]), None)
        if chain is None:
            continue
        pays = t["median_speedup"] > chain["median_speedup"]
        why = ("" if pays else " (it accepts no more than the chain)" if t["mean_accepted"] <= chain["mean_accepted"]
               else " (more accepted tokens do not cover the wider verify)")
        out.append(f"- E2E {t['config']} ({t['nodes_per_verify']} nodes): {t['mean_accepted']:.2f} accepted/step vs "
                   f"{chain['mean_accepted']:.2f} for the {chain['config']}; speedup over AR "
                   f"{t['median_speedup']:.2f}× vs {chain['median_speedup']:.2f}×: "
                   f"{'pays' if pays else 'does not pay'}{why}.")
    return out


def markdown(result, args) -> str:
    h = result
    md = [f"# Draft trees: step costs, speculative memory, end to end ({h['name']})", "",
          f"{h['device']} · jax {h['jax']} · commit {h['git_commit']}", "", f"`{h['command']}`", "",
          f"Step costs (median of {args.repeats}, from a {args.prefix}-token prefix; bushy = first N breadth-first "
          f"nodes of {args.step_tree}; chain verify = N tokens through `qwen35.forward`):", "",
          "| model | N | tree shape | depth | tree verify ms | chain verify ms | AR step ms | tree / chain | tree / AR "
          "| tree commit ms | chain commit ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['model']} | {r['nodes']} | {r['shape']} | {r['depth']} | {r['tree_verify_ms']:.3f} | "
           f"{r['chain_verify_ms']:.3f} | {r['ar_step_ms']:.3f} | {r['tree_over_chain']:.2f}× | "
           f"{r['tree_over_ar']:.2f}× | {r['tree_commit_ms']:.3f} | {r['chain_commit_ms']:.3f} |" for r in h["steps"]]
    md += ["", "Speculative recurrent-state memory per sequence, all GDN layers (tree-WY: k, g, v_new per node; "
               "snapshots: one fp32 [HV, K, V] state per node; both also keep the conv source):", "",
           "| model | N | GDN layers | tree-WY MiB | snapshots MiB | snapshots / tree-WY | conv source MiB |",
           "|---|---|---|---|---|---|---|"]
    md += [f"| {r['model']} | {r['nodes']} | {r['gdn_layers']} | {r['tree_wy_bytes'] / MiB:.3f} | "
           f"{r['snapshot_bytes'] / MiB:.3f} | {r['ratio']:.1f}× | {r['conv_source_bytes'] / MiB:.3f} |"
           for r in h["memory"]]
    if "e2e_setup" in h:
        s = h["e2e_setup"]
        md += ["", f"End to end ({h['model_path']}), greedy, {s['prompts']} prompts, {s['max_new_tokens']} new tokens, "
                   "decode tok/s paired with AR per prompt (median speedup):", "",
               "| config | nodes / verify | decode tok/s | mean accepted / step | tokens / step | speedup over AR "
               "| equal to AR | compile s |", "|---|---|---|---|---|---|---|---|"]
        md += [f"| {c['config']} | {c['nodes_per_verify']} | {c['median_tps']:.1f} | {c['mean_accepted']:.2f} | "
               f"{c['tokens_per_step']:.2f} | {c['median_speedup']:.2f}× | {c['all_equal_to_ar']} | "
               f"{c['compile_seconds']:.1f} |" for c in h["e2e"]]
        if s["skipped"]:
            md += ["", f"Not run (time budget): {', '.join(s['skipped'])}."]
    return "\n".join(md + ["", "Where trees pay:", ""] + verdict(result)) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (step costs, memory, end to end)")
    ap.add_argument("--random-9b", action="store_true", help="Qwen3.5-9B shape with random weights")
    ap.add_argument("--tiny", action="store_true", help="with --random-9b: a tiny shape (CPU smoke run)")
    ap.add_argument("--nodes", default="8,16,32,64", help="node budgets N for step costs and memory")
    ap.add_argument("--step-tree", default="4,2,2,2,2,2", help="branching whose first N nodes form the bushy tree")
    ap.add_argument("--shapes", default="bushy,star,chain", help="tree shapes timed per N (bushy always in memory)")
    ap.add_argument("--prefix", type=int, default=256, help="committed prefix length for step costs")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--prompts", default="heldout", help="'heldout' or a .json list / text file of prompts")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64, help="keep prompts of >= this many tokens, cut to "
                    "their last this many (one compile per configuration); 0: as they are (last 384)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--trees", default="4,2,1;2,2,2,1;8,1,1;4,4,2", help="';'-separated branching lists")
    ap.add_argument("--no-ngram", action="store_true", help="skip the n-gram chain / tree configurations")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--time-budget-s", type=float, default=float("inf"),
                    help="no e2e configuration starts after this many seconds from the start")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not (args.random_9b or args.model):
        ap.error("give --random-9b and/or --model")
    t_start = time.perf_counter()
    import specdec_jax as sj

    nodes = [int(n) for n in args.nodes.split(",")]
    branching = tuple(int(b) for b in args.step_tree.split(","))
    models = []
    if args.random_9b:
        models.append(("qwen35_tiny_random" if args.tiny else "qwen35_9b_random", lambda: random_9b_model(args.tiny)))
    if args.model:
        models.append((os.path.basename(os.path.normpath(args.model)), lambda: sj.load(args.model, dtype="bfloat16")))
    name = "+".join(n for n, _ in models)
    result = {**result_header("bench_tree"), "name": name, "model_path": args.model,
              "steps": [], "memory": [], "e2e": []}

    def save(final=False):
        write_results(args.out, f"tree_{name}", result, markdown(result, args), echo=final)

    model = None
    for mname, make in models:
        model = make()
        result["steps"] += step_costs(model, mname, nodes, branching, args.prefix, args.repeats,
                                      tuple(args.shapes.split(",")))
        save()
        result["memory"] += memory(model, mname, nodes, branching, args.prefix)
        save()
    if args.model and not args.skip_e2e:
        end_to_end(model, args, result, save, t_start)
    save(final=True)


if __name__ == "__main__":
    main()
