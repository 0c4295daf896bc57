"""Tensor-parallel benchmark (issue 18): a random bf16 Qwen3.5 of the 27B dense shape on 1 and 2 GPUs.

  - AR: decode tok/s on one device (no mesh) and on a mesh of jax.devices()[:n] for each n in --devices, the runs
    alternating in one process on the same prompt (greedy, the exact path's decode shape, as `generate` runs it);
  - communication: the collectives the sharded AR decode step compiles to (read from its HLO: kind, shape, count
    per step), each timed alone on the mesh in a loop of dependent calls; their sum estimates the communication
    time per step (an upper bound where XLA overlaps them with compute), beside the measured step time minus half
    the one-device time;
  - the forced-acceptance cost curve on the largest mesh: n-gram drafts whose accepted count follows a seeded
    schedule (speculative.forced_acceptance), speedup over AR on the same mesh against tokens per step.

The weights are random, made directly on their devices in the mesh's layout (random values need no reordering).

    python benchmarks/bench_tensor_parallel.py --out benchmarks/results                       # 1 and 2 GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python benchmarks/bench_tensor_parallel.py --tiny --out /tmp/x                       # CPU smoke run
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from specdec_jax.bench.harness import result_header, write_results  # noqa: E402
from benchmarks.bench_spec import qwen35_shape_config  # noqa: E402

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
HLO_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16, "s32": jnp.int32, "u32": jnp.uint32}


# ------------------------------------------------------------------------------------------------ model

@functools.cache
def _normal(sharding):
    """A jitted N(0, scale^2) maker whose output lands where `sharding` says (each device draws its own part)."""
    return jax.jit(lambda key, scale, shape, dtype: (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype),
                   static_argnums=(2, 3), out_shardings=sharding)


def random_model(shape: str, n_devices: int, dtype):
    """A random Qwen3.5 of `shape` on one device (n_devices = 1: no mesh) or split over jax.devices()[:n]."""
    from specdec_jax import sharding
    from specdec_jax.loading import build_tree
    from specdec_jax.results import Model
    from specdec_jax.models.qwen35 import mtp_head as mtp, model as qwen35
    cfg = qwen35_shape_config(shape)
    if n_devices > 1:
        cfg = qwen35.with_mesh(cfg, jax.make_mesh((n_devices,), ("tp",), devices=jax.devices()[:n_devices]),
                               f"random {shape}")
    specs = qwen35.param_specs(cfg, {"model.embed_tokens.weight"}, "random")
    fused = qwen35.fused_segments(cfg)
    keys = dict(zip(specs, jax.random.split(jax.random.PRNGKey(0), len(specs))))

    def make(path):
        leaf_shape = mtp.leaf_shape(specs[path])
        if path[-1] in fused:  # head copies of a large mesh (sharding.grouped_rows) add rows
            leaf_shape = (len(sharding.grouped_rows(fused[path[-1]], cfg.tp_size)),) + leaf_shape[1:]
        scale = leaf_shape[-1] ** -0.5 if len(leaf_shape) > 1 else 0.1
        place = (NamedSharding(cfg.mesh, sharding.param_partition(path)) if cfg.mesh is not None
                 else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        return _normal(place)(keys[path], jnp.float32(scale), leaf_shape, jnp.dtype(dtype))

    params = build_tree({path: path for path in specs}, make)
    return Model(config=cfg, params=params, dtype=jnp.dtype(dtype))


def compile_all(lowered: dict) -> tuple[dict, dict]:
    """Compile lowered programs on a thread pool (XLA compiles release the GIL): executables and seconds each."""
    def one(lo):
        t0 = time.perf_counter()
        return lo.compile(), time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=8) as pool:
        done = dict(zip(lowered, pool.map(one, lowered.values())))
    return {k: v[0] for k, v in done.items()}, {str(k): v[1] for k, v in done.items()}


# ------------------------------------------------------------------------------------------------- AR

def ar_programs(model, prompt, new_tokens: int) -> tuple[dict, dict]:
    """The exact path's AR prefill and decode loop of `model`, compiled (prefill first: the loop is compiled for
    the shardings of the state the prefill returns)."""
    from specdec_jax.decoding import autoregressive as ar
    from specdec_jax.decoding.compiled import output_structs
    from specdec_jax.decoding.decode_shape import choose_decode_rows
    from specdec_jax.decoding.sampling import SamplingConfig
    from specdec_jax.models.family import QWEN35
    rows = choose_decode_rows(0, None, "qwen3_5")
    ops, cfg = ar.ar_ops(QWEN35, rows), model.config
    prefill = ar._prefill.lower(model.params, prompt, ops=ops, cfg=cfg, max_len=prompt.shape[1] + new_tokens + rows,
                                state_dtype=model.dtype).compile()
    logits_s, state_s = output_structs(prefill)
    loop = ar._decode_loop.lower(model.params, state_s, logits_s, jax.random.PRNGKey(0), ops=ops, cfg=cfg,
                                 max_new_tokens=new_tokens, sampling=SamplingConfig(), eos_ids=())
    return {"prefill": prefill}, {"loop": loop}


def ar_seconds_per_token(model, exe, prompt, new_tokens: int) -> float:
    logits, state = jax.block_until_ready(exe["prefill"](model.params, prompt))
    t0 = time.perf_counter()
    jax.block_until_ready(exe["loop"](model.params, state, logits, jax.random.PRNGKey(0)))
    return (time.perf_counter() - t0) / (new_tokens - 1)


# ------------------------------------------------------------------------------------------ collectives

_HLO_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_HLO_COLLECTIVE = re.compile(r"= (.*?) (" + "|".join(COLLECTIVES) + r")(-start)?\(")


def hlo_collectives(text: str) -> list[dict]:
    """Collectives in a compiled program's HLO: kind, result dtype and shape (the largest array of a tuple result),
    count. A loop body appears once: in a decode loop the counts are per step (plus the few outside the loop)."""
    found = collections.Counter()
    for result, kind, _ in _HLO_COLLECTIVE.findall(text):
        arrays = [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _HLO_ARRAY.findall(result)]
        if arrays:
            found[(kind,) + max(arrays, key=lambda a: math.prod(a[1]))] += 1
    return [{"kind": k, "dtype": dt, "shape": list(shape), "count": n} for (k, dt, shape), n in sorted(found.items())]


def collective_seconds(mesh, kind: str, dtype: str, shape: tuple, chain: int = 200) -> float | None:
    """Seconds of one collective of this per-device result shape on `mesh`, timed in a loop of `chain` dependent
    calls; None for kinds other than all-reduce and all-gather (and for dtypes not in HLO_DTYPES)."""
    if kind not in ("all-reduce", "all-gather") or dtype not in HLO_DTYPES:
        return None
    n = mesh.shape["tp"]
    local = tuple(shape)
    if kind == "all-gather":  # the result is n parts gathered along some axis: time the same bytes along axis 0
        local = (math.prod(shape) // n,)

    def body(_, x):
        y = jax.lax.psum(x, "tp") if kind == "all-reduce" else jax.lax.all_gather(x, "tp", tiled=True)[:x.shape[0]]
        return (y * 0.5).astype(x.dtype)

    def run(x):
        return jax.lax.fori_loop(0, chain, body, x)

    fn = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    x = jax.device_put(jnp.ones((n * local[0],) + local[1:], HLO_DTYPES[dtype]), NamedSharding(mesh, P("tp")))
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / chain


# ------------------------------------------------------------------------------------------- cost curve

def curve_programs(model, prompt, new_tokens: int, gammas) -> tuple[dict, dict]:
    """n-gram speculation with forced acceptance (accept_p traced), exact path, replay rollback: prefill per gamma
    compiled first, then each loop for the state the prefill returns."""
    from specdec_jax.decoding import speculative as sp
    from specdec_jax.decoding.compiled import output_structs
    from specdec_jax.decoding.decode_shape import choose_decode_rows
    from specdec_jax.decoding.sampling import SamplingConfig
    from specdec_jax.drafters.ngram import NgramDrafter
    key, cfg = jax.random.PRNGKey(0), model.config
    max_len = prompt.shape[1] + new_tokens + max(choose_decode_rows(g, None, "qwen3_5") for g in gammas)
    statics = {g: dict(cfg=cfg, sampling=SamplingConfig(), eos_ids=(), gamma=g, max_new_tokens=new_tokens,
                       drafter=NgramDrafter(), impl="auto") for g in gammas}
    prefills, _ = compile_all({g: sp._spec_prefill.lower(model.params, prompt, key, max_len=max_len,
                                                          state_dtype=model.dtype, **statics[g]) for g in gammas})
    loops = {}
    for g in gammas:
        state_s, dstate_s = output_structs(prefills[g])
        loops[g] = sp._spec_loop.lower(model.params, state_s, dstate_s, key, jnp.float32(0.5), rollback="replay",
                                       decode_rows=choose_decode_rows(g, None, "qwen3_5"), **statics[g])
    return prefills, loops


def spec_run(model, prefill, loop, prompt, p: float):
    key = jax.random.PRNGKey(0)
    state, dstate = jax.block_until_ready(prefill(model.params, prompt, key))
    accept_p = jax.block_until_ready(jnp.float32(p))  # on the device before the clock starts
    t0 = time.perf_counter()
    _, state, _ = jax.block_until_ready(loop(model.params, state, dstate, key, accept_p))
    seconds = time.perf_counter() - t0
    steps = int(state.steps)
    accepted = np.asarray(state.accepted)[:steps, 0]
    return seconds, steps, float((accepted + 1).mean()), int(state.n_out[0]) - 1


# ------------------------------------------------------------------------------------------------- main

def markdown(r: dict) -> str:
    h = r["header"]
    md = [f"# Tensor parallel ({r['shape']} random {r['dtype']})", "",
          f"{h['device']} · jax {h['jax']} · commit {h['git_commit']} · {h['date']}", "", f"`{h['command']}`", "",
          f"Greedy, batch 1, prompt {r['prompt_len']} random tokens, {r['new_tokens']} new tokens, exact path "
          f"(every decode forward at {r['decode_rows']} rows), median of {r['repeats']} runs; the device counts "
          "alternate in one process. Weights random (no checkpoint), split by `sharding.PARAM_PARTITIONS`.", "",
          "## AR", "", "| devices | ms / token | tok/s | speedup over 1 device | ideal ms (1 device ÷ n) |",
          "|---|---|---|---|---|"]
    one = r["ar"].get("1")
    for n, row in r["ar"].items():
        ideal = f"{one['ms_per_token'] / int(n):.3f}" if one else "-"
        speed = f"{one['ms_per_token'] / row['ms_per_token']:.2f}×" if one else "-"
        md.append(f"| {n} | {row['ms_per_token']:.3f} | {row['tok_s']:.1f} | {speed} | {ideal} |")
    for n, comm in r["communication"].items():
        md += ["", f"## Collectives of the AR decode step, {n} devices", "",
               "Read from the compiled decode loop's HLO (a loop body appears once: counts are per step, plus the "
               "few outside the loop); each timed alone on the mesh, in a loop of dependent calls.", "",
               "| collective | dtype | shape | count | µs each | µs per step |", "|---|---|---|---|---|---|"]
        for c in comm["collectives"]:
            each = f"{c['seconds'] * 1e6:.1f}" if c["seconds"] is not None else "not timed"
            total = f"{c['seconds'] * c['count'] * 1e6:.1f}" if c["seconds"] is not None else "-"
            md.append(f"| {c['kind']} | {c['dtype']} | {c['shape']} | {c['count']} | {each} | {total} |")
        md += ["", f"Sum of the timed collectives: **{comm['timed_ms_per_step']:.3f} ms per step**"
               + (f"; measured step time minus the ideal (one device ÷ {n}): {comm['overhead_ms_per_step']:.3f} ms."
                  if comm.get("overhead_ms_per_step") is not None else ".")]
    if r.get("curve"):
        c = r["curve"]
        md += ["", f"## Forced-acceptance cost curve, {c['devices']} devices (n-gram, replay, exact path)", "",
               f"AR on the same mesh: {c['ar_ms_per_token']:.3f} ms per token. Each draft kept with probability p "
               "(stopping at the first rejection); outputs meaningless.", "",
               "| gamma | p | tokens / step | ms / step | speedup over AR | speedup ÷ tokens per step |",
               "|---|---|---|---|---|---|"]
        for row in c["rows"]:
            md.append(f"| {row['gamma']} | {row['p']:.2f} | {row['tokens_per_step']:.2f} | "
                      f"{row['ms_per_step']:.3f} | {row['speedup']:.2f}× | {row['speedup_over_tokens_per_step']:.3f} |")
    md += ["", "Compile seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in r["compile_seconds"].items())]
    return "\n".join(md) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape and short runs (CPU smoke run on fake devices)")
    ap.add_argument("--devices", default="1,2", help="device counts for AR (1 = no mesh)")
    ap.add_argument("--gammas", default=None, help="cost-curve draft lengths (default 2,4,8; --tiny 2,4)")
    ap.add_argument("--ps", default=None, help="cost-curve acceptance probabilities (default 0,0.5,0.7,0.8,0.9,1)")
    ap.add_argument("--skip-curve", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    tiny = args.tiny
    shape = "tiny" if tiny else "27b"
    prompt_len = args.prompt_len or (16 if tiny else 64)
    new_tokens = args.max_new_tokens or (16 if tiny else 128)
    repeats = args.repeats or (2 if tiny else 5)
    gammas = [int(g) for g in (args.gammas or ("2,4" if tiny else "2,4,8")).split(",")]
    ps = [float(p) for p in (args.ps or ("0.5,1" if tiny else "0,0.5,0.7,0.8,0.9,1")).split(",")]
    counts = [int(n) for n in args.devices.split(",")]
    if max(counts) > len(jax.devices()):
        raise SystemExit(f"bench_tensor_parallel.py: --devices {args.devices} needs {max(counts)} devices; "
                         f"{len(jax.devices())} visible ({jax.devices()[0].platform})")
    from specdec_jax.decoding.decode_shape import choose_decode_rows
    header = result_header("bench_tensor_parallel")
    result = {"header": header, "shape": shape, "dtype": args.dtype, "prompt_len": prompt_len,
              "new_tokens": new_tokens, "repeats": repeats, "decode_rows": choose_decode_rows(0, None, "qwen3_5"),
              "ar": {}, "communication": {}, "compile_seconds": {}}
    stem = f"tensor_parallel_{shape}_random{args.tag}"
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, 512 if tiny else 248320, (1, prompt_len)), jnp.int32)

    models, exe = {}, {}
    for n in counts:
        t0 = time.perf_counter()
        models[n] = random_model(shape, n, args.dtype)
        prefill, loop = ar_programs(models[n], prompt, new_tokens)
        done, seconds = compile_all(loop)
        exe[n] = {**prefill, **done}
        result["compile_seconds"][f"ar_loop_{n}"] = seconds["loop"]
        print(f"{n} device(s): model and AR programs in {time.perf_counter() - t0:.0f} s", flush=True)
    times = {n: [] for n in counts}
    for n in counts:  # warm-up
        ar_seconds_per_token(models[n], exe[n], prompt, new_tokens)
    for _ in range(repeats):
        for n in counts:  # alternating: drift hits every device count alike
            times[n].append(ar_seconds_per_token(models[n], exe[n], prompt, new_tokens))
    for n in counts:
        sec = float(np.median(times[n]))
        result["ar"][str(n)] = {"ms_per_token": sec * 1e3, "tok_s": 1 / sec}
        print(json.dumps({"devices": n, **result["ar"][str(n)]}), flush=True)

    for n in counts:
        if n == 1:
            continue
        found = hlo_collectives(exe[n]["loop"].as_text())
        for c in found:
            c["seconds"] = collective_seconds(models[n].config.mesh, c["kind"], c["dtype"], tuple(c["shape"]))
        timed = sum(c["seconds"] * c["count"] for c in found if c["seconds"] is not None)
        comm = {"collectives": found, "timed_ms_per_step": timed * 1e3}
        if 1 in counts:
            comm["overhead_ms_per_step"] = (result["ar"][str(n)]["ms_per_token"]
                                            - result["ar"]["1"]["ms_per_token"] / n)
        result["communication"][str(n)] = comm
        print(json.dumps({"devices": n, **comm}), flush=True)
    write_results(args.out, stem, result, markdown(result), echo=False)

    if not args.skip_curve:
        n = max(counts)
        model = models[n]
        for other in [k for k in models if k != n]:  # free the other device counts' weights first
            del models[other], exe[other]
        prefills, lowered = curve_programs(model, prompt, new_tokens, gammas)
        loops, seconds = compile_all(lowered)
        result["compile_seconds"].update({f"spec_loop_{n}_gamma{g}": s for g, s in seconds.items()})
        ar_times = []
        rows = []
        for g in gammas:
            spec_run(model, prefills[g], loops[g], prompt, 1.0)  # warm-up
            for p in ps:
                runs = []
                for _ in range(repeats):
                    runs.append(spec_run(model, prefills[g], loops[g], prompt, p))
                    ar_times.append(ar_seconds_per_token(model, exe[n], prompt, new_tokens))
                ar_sec = float(np.median(ar_times))
                per_token = float(np.median([r[0] / r[3] for r in runs]))  # per token the steps produced
                tps = float(np.mean([r[2] for r in runs]))
                rows.append({"gamma": g, "p": p, "tokens_per_step": tps,
                             "ms_per_step": float(np.median([r[0] / r[1] for r in runs])) * 1e3,
                             "speedup": ar_sec / per_token, "speedup_over_tokens_per_step": ar_sec / per_token / tps})
                print(json.dumps(rows[-1]), flush=True)
        result["curve"] = {"devices": n, "ar_ms_per_token": float(np.median(ar_times)) * 1e3, "rows": rows}
    write_results(args.out, stem, result, markdown(result))


if __name__ == "__main__":
    main()
