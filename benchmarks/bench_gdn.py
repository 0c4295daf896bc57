"""Gated-delta kernels on the GPU: correctness against the reference, then paired timings.

Compares, on the same random inputs (never zeros) and alternating implementations each repeat:
  pallas     pallas_kernels.gated_delta Pallas kernels (chunk for T > 64 and at 64; recurrent for T <= 64)
  reference  the XLA path (implementation="reference": chunked WY / step recurrence in jnp)
  fla        flash-linear-attention (fla-core 0.6.0) chunk_gated_delta_rule / fused_recurrent_gated_delta_rule
  fla_snap   fla 0.6.0's fused recurrent kernel plus one state store per position (the per-position
             snapshot rollback of vLLM / SGLang; fla 0.6.0 itself has no such output)

Timing: every measured call is chained N times (each call's final state feeds the next, as in decode),
inside one jitted function for JAX and one CUDA graph for torch; time per call = median over repeats
of (chain time / N), after warm-up. Writes gdn_<tag>.json and gdn_<tag>.md to --out.

    python benchmarks/bench_gdn.py --out "$OUT" [--quick] [--skip-fla]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import gated_delta as gd  # noqa: E402
from pallas_kernels.gated_delta import pallas_ops, reference  # noqa: E402
from specdec_jax.bench.harness import alternate, result_header, write_results  # noqa: E402

CHUNK_T = 64  # T above this uses the chunk kernel, at or below it the recurrent kernel


# ----------------------------------------------------------------------------------------------- inputs

def make_inputs(b, t, h, hv, k_dim, v_dim, seed=0, dtype=np.float32):
    """Random inputs shaped like Qwen3.5's GDN layer inputs (raw q, k: the kernels L2-normalise)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, k_dim), np.float32)
    k = rng.standard_normal((b, t, h, k_dim), np.float32)
    v = rng.standard_normal((b, t, hv, v_dim), np.float32)
    # g = -exp(A_log) softplus(a + dt_bias): mostly mild decay, a tail down to about -8.
    g = -np.exp(rng.uniform(-2.0, 1.0, (1, 1, hv))).astype(np.float32) * np.log1p(
        np.exp(rng.standard_normal((b, t, hv)).astype(np.float32)))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, hv)).astype(np.float32)))
    s0 = 0.1 * rng.standard_normal((b, hv, k_dim, v_dim), np.float32)
    to = lambda x: x.astype(dtype)
    return dict(q=to(q), k=to(k), v=to(v), g=g.astype(np.float32), beta=beta.astype(np.float32), s0=s0)


def to_jax(x, dtype):
    return {n: jnp.asarray(a, dtype if n in ("q", "k", "v") else jnp.float32) for n, a in x.items()}


def rel(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ------------------------------------------------------------------------------------------- torch side

def torch_side():
    """Imports torch/fla lazily; returns (torch, fla chunk, fla fused recurrent, snapshot kernel)."""
    import torch
    import triton
    import triton.language as tl
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    @triton.jit
    def snapshot_kernel(q, k, v, g, beta, o, h0, ht, h_all, scale, T, H: tl.constexpr, HV: tl.constexpr,
                        K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        # fla 0.6.0 fused_recurrent_gated_delta_rule_fwd_kernel (headwise beta, scalar gate, q/k L2
        # norm in kernel, K-major state), plus one store of the state per position into h_all.
        i_v, i_nh = tl.program_id(0), tl.program_id(1)
        i_n, i_hv = i_nh // HV, i_nh % HV
        i_h = i_hv // (HV // H)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        p_q = q + (i_n * T * H + i_h) * K + o_k
        p_k = k + (i_n * T * H + i_h) * K + o_k
        p_v = v + (i_n * T * HV + i_hv) * V + o_v
        p_g = g + i_n * T * HV + i_hv
        p_beta = beta + i_n * T * HV + i_hv
        p_o = o + (i_n * T * HV + i_hv) * V + o_v
        p_hall = h_all + (i_n * T * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(h0 + i_nh * K * V + o_k[:, None] * V + o_v[None, :]).to(tl.float32)
        for _ in range(0, T):
            b_q = tl.load(p_q).to(tl.float32)
            b_k = tl.load(p_k).to(tl.float32)
            b_v = tl.load(p_v).to(tl.float32)
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
            b_beta = tl.load(p_beta).to(tl.float32)
            b_h *= tl.exp(tl.load(p_g).to(tl.float32))
            b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
            b_h += b_k[:, None] * b_v
            tl.store(p_o, tl.sum(b_h * b_q[:, None], 0).to(p_o.dtype.element_ty))
            tl.store(p_hall, b_h)
            p_q += H * K
            p_k += H * K
            p_v += HV * V
            p_g += HV
            p_beta += HV
            p_o += HV * V
            p_hall += HV * K * V
        tl.store(ht + i_nh * K * V + o_k[:, None] * V + o_v[None, :], b_h)

    def fla_snapshot(q, k, v, g, beta, h0, scale):
        b, t, h, k_dim = q.shape
        hv, v_dim = v.shape[2], v.shape[3]
        o = torch.empty_like(v)
        ht = torch.empty(b, hv, k_dim, v_dim, device=q.device, dtype=torch.float32)
        h_all = torch.empty(b, t, hv, k_dim, v_dim, device=q.device, dtype=torch.float32)
        bv = 8  # fla's choice for the fused recurrent kernel
        snapshot_kernel[(v_dim // bv, b * hv)](q, k, v, g, beta, o, h0, ht, h_all, scale, t, H=h, HV=hv, K=k_dim,
                                               V=v_dim, BK=k_dim, BV=bv, num_warps=1, num_stages=3)
        return o, ht, h_all

    return torch, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, fla_snapshot


def torch_inputs(torch, x, dtype):
    dev = "cuda"
    out = {}
    for n, a in x.items():
        t = torch.from_numpy(np.ascontiguousarray(np.asarray(a, np.float32))).to(dev)
        out[n] = t.to(dtype) if n in ("q", "k", "v") else t
    return out


# --------------------------------------------------------------------------------------------- timing

def jax_chain(step, n):
    """jit((s0, inputs) -> s after n chained calls s = step(s, inputs)); inputs are arguments, not
    constants (closing over them would let XLA constant-fold the whole chain at compile time)."""
    def run(s, x):
        for _ in range(n):
            s = step(s, x)
        return s
    return jax.jit(run)


def time_jax(fn, n, *args):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / n


class TorchGraph:
    """CUDA graph of n chained calls; replay timed with CUDA events."""

    def __init__(self, torch, step, s0, n):
        self.torch = torch
        self.s_in = s0.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up: autotuning and compilation happen here, outside the graph
                s = self.s_in
                for _ in range(n):
                    s = step(s)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            s = self.s_in
            for _ in range(n):
                s = step(s)
        self.out = s
        self.n = n

    def __call__(self):
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3 / self.n


class TorchEager:
    """n chained eager calls timed with CUDA events (includes Python launch overhead)."""

    def __init__(self, torch, step, s0, n):
        self.torch, self.step, self.s0, self.n = torch, step, s0, n
        for _ in range(3):
            self._run()
        torch.cuda.synchronize()

    def _run(self):
        s = self.s0
        for _ in range(self.n):
            s = self.step(s)
        return s

    def __call__(self):
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3 / self.n


# ------------------------------------------------------------------------------------- cost accounting

def chunk_cost(b, t, h, hv, k_dim, v_dim, c=64):
    """(FLOPs of the chunked WY form, minimum HBM bytes: inputs, output and state once)."""
    nc = math.ceil(t / c)
    flops = b * hv * nc * (2 * c * c * (3 * k_dim + 2 * v_dim) + 6 * c * k_dim * v_dim)
    nbytes = 2 * (2 * b * t * h * k_dim + 2 * b * t * hv * v_dim) + 8 * b * t * hv + 8 * b * hv * k_dim * v_dim
    return flops, nbytes


def recurrent_cost(b, t, h, hv, k_dim, v_dim, extra_bytes=0):
    flops = b * hv * t * 6 * k_dim * v_dim
    nbytes = 2 * (2 * b * t * h * k_dim + 2 * b * t * hv * v_dim) + 8 * b * t * hv + 8 * b * hv * k_dim * v_dim
    return flops, nbytes + extra_bytes


# ------------------------------------------------------------------------------------------- sections

def measure_ceilings():
    """Device copy bandwidth (read + write) and bf16 matmul rate on random data."""
    x = jax.random.normal(jax.random.PRNGKey(0), (1 << 29,), jnp.float32)  # 2 GiB
    copy = jax.jit(lambda a: a * 1.0001)
    t_copy = np.median([time_jax(copy, 1, x) for _ in range(3 + 10)][3:])
    a = jax.random.normal(jax.random.PRNGKey(1), (8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda m: (m @ m).astype(jnp.bfloat16))
    t_mm = np.median([time_jax(mm, 1, a) for _ in range(3 + 10)][3:])
    return {"copy_TBps": 2 * x.nbytes / t_copy / 1e12, "bf16_matmul_TFLOPs": 2 * 8192 ** 3 / t_mm / 1e12}


def check_correctness(log, with_fla, small=False, fp32=False):
    """Kernels vs reference on the GPU: fp32 inputs (~1e-6 expected) and bf16 inputs (~3e-3)."""
    rows = []
    cases = [("bf16", jnp.bfloat16, 1, 1024, 16, 32, 128, 128)]
    if fp32:
        cases = [("fp32", jnp.float32, 1, 200, 2, 4, 128, 128),
                 ("fp32-odd", jnp.float32, 2, 77, 1, 3, 48, 40)] + cases
    if small:
        cases = [("fp32", jnp.float32, 1, 70, 1, 4, 128, 32), ("bf16", jnp.bfloat16, 1, 64, 1, 4, 128, 32)]
    for name, dt, b, t, h, hv, kd, vd in cases:
        x = to_jax(make_inputs(b, t, h, hv, kd, vd, seed=1), dt)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        kw = dict(initial_state=x["s0"], use_qk_l2norm=True)
        with jax.default_matmul_precision("highest"):
            ref = gd.chunk_gated_delta_rule(*args, return_pseudo_values=True, implementation="reference", **kw)
        out = pallas_ops.chunk_gated_delta_rule(*args, return_pseudo_values=True, **kw)
        finite = bool(jnp.all(jnp.isfinite(out.o.astype(jnp.float32))) & jnp.all(jnp.isfinite(out.v_new)))
        rows.append(dict(case=name, op="chunk", T=t, o=rel(out.o, ref.o), state=rel(out.final_state, ref.final_state),
                         v_new=rel(out.v_new, ref.v_new), finite=finite))
        ts = min(t, 16)
        sl = [a[:, :ts] for a in args]
        with jax.default_matmul_precision("highest"):
            ref_r = reference.naive_recurrent_gated_delta_rule(*sl, return_pseudo_values=True, return_all_states=True,
                                                               **kw)
        out_r = pallas_ops.fused_recurrent_gated_delta_rule(*sl, return_pseudo_values=True, return_all_states=True,
                                                            **kw)
        rows.append(dict(case=name, op="recurrent", T=ts, o=rel(out_r.o, ref_r.o),
                         state=rel(out_r.final_state, ref_r.final_state), v_new=rel(out_r.v_new, ref_r.v_new),
                         all_states=rel(out_r.all_states, ref_r.all_states)))
        try:
            out_m = pallas_ops.fused_recurrent_gated_delta_rule(*sl, return_pseudo_values=True, backend="mosaic",
                                                                block_v=32, **kw)
            rows.append(dict(case=name, op="recurrent[mosaic]", T=ts, o=rel(out_m.o, ref_r.o),
                             state=rel(out_m.final_state, ref_r.final_state), v_new=rel(out_m.v_new, ref_r.v_new)))
        except Exception as e:  # noqa: BLE001 - the Mosaic GPU kernel is a measured alternative
            log(f"mosaic recurrent failed: {type(e).__name__}: {str(e)[:1500]}")
        for a in (0, 1, ts // 2, ts):
            n = jnp.full((b,), a, jnp.int32)
            want = x["s0"] if a == 0 else ref_r.all_states[:, a - 1]
            got = pallas_ops.commit_state(x["s0"], sl[1], sl[3], out_r.v_new, n, use_qk_l2norm=True)
            rows.append(dict(case=name, op=f"commit a={a}", T=ts, state=rel(got, want)))
        if with_fla and dt == jnp.bfloat16 and not small:
            torch, fla_chunk, fla_rec, fla_snap = torch_side()
            xt = torch_inputs(torch, make_inputs(b, t, h, hv, kd, vd, seed=1), torch.bfloat16)
            o, st = fla_chunk(xt["q"], xt["k"], xt["v"], xt["g"], xt["beta"], scale=kd ** -0.5,
                              initial_state=xt["s0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
            rows.append(dict(case=name, op="fla chunk", T=t, o=rel(jnp.asarray(o.float().cpu().numpy()), ref.o),
                             state=rel(jnp.asarray(st.cpu().numpy()), ref.final_state)))
            sl_t = {n_: (a[:, :ts] if a.dim() >= 3 and n_ != "s0" else a) for n_, a in xt.items()}
            o, st, h_all = fla_snap(sl_t["q"].contiguous(), sl_t["k"].contiguous(), sl_t["v"].contiguous(),
                                    sl_t["g"].contiguous(), sl_t["beta"].contiguous(), xt["s0"], kd ** -0.5)
            rows.append(dict(case=name, op="fla_snap", T=ts, o=rel(jnp.asarray(o.float().cpu().numpy()), ref_r.o),
                             all_states=rel(jnp.asarray(h_all.cpu().numpy()), ref_r.all_states)))
    for r in rows:
        log(json.dumps(r))
    return rows


def bench(log, args, save=lambda rows: None):
    """Paired timings at Qwen3.5-9B shapes (H=16, HV=32, K=V=128, bf16) and H=HV=32 at T=8192."""
    b, h, hv, kd, vd = (1, 1, 2, 32, 32) if args.small else (1, 16, 32, 128, 128)
    scale = kd ** -0.5
    results = []
    fla = None
    if not args.skip_fla:
        try:
            fla = torch_side()
        except Exception as e:  # noqa: BLE001 - the JAX numbers stand alone when fla is missing
            log(f"fla unavailable: {type(e).__name__}: {e}")
    # Longest first: the numbers the targets are about come in even if a run is cut short.
    t_list = [8192, 64, 16, 4, 1, 1024] if not (args.quick or args.small) else [128, 64, 4]
    shapes = [(h, t) for t in t_list[:1]] + ([] if args.small else [(32, 8192)]) + [(h, t) for t in t_list[1:]]
    if args.sizes:
        wanted = [int(s) for s in args.sizes.split(",")]
        shapes = [(h, t) for t in wanted]
    for hh, t in shapes:
        x_np = make_inputs(b, t, hh, hv, kd, vd, seed=t)
        x = to_jax(x_np, jnp.bfloat16)
        # Long chains amortise JAX's per-jit dispatch (tens of us) over the launch-bound small-T calls.
        n_chain = 16 if t <= 64 else (4 if t <= 1024 else 2)
        repeats = args.repeats
        timers, meta = {}, {}

        def add_jax(name, step, kind, extra_bytes=0):
            try:
                t0 = time.perf_counter()
                fn = jax_chain(step, n_chain)
                jax.block_until_ready(fn(x["s0"], x))  # compile + warm-up
                jax.block_until_ready(fn(x["s0"], x))
                log(f"[T={t} H={hh}] {name}: compiled and warmed up in {time.perf_counter() - t0:.1f} s")
                timers[name] = lambda fn=fn: time_jax(fn, n_chain, x["s0"], x)
                meta[name] = (kind, extra_bytes)
            except Exception as e:  # noqa: BLE001 - report and keep measuring the rest
                log(f"[T={t} H={hh}] {name} failed: {type(e).__name__}: {str(e)[:800]}")
                traceback.print_exc()

        kw = dict(use_qk_l2norm=True, scale=scale)
        qkvgb = lambda x: (x["q"], x["k"], x["v"], x["g"], x["beta"])
        if t >= CHUNK_T:
            chunk_variants = [(args.block_v, args.state_dot, True)]
            if t == 8192 and hh == h:
                chunk_variants.append((args.block_v, args.state_dot, False))
                if args.variants:
                    chunk_variants += [(64, "bf16", True), (16, "bf16", True), (32, "f32", True)]
            for bv, sd, split in chunk_variants:
                add_jax(f"pallas_chunk[bv={bv},{sd},{'split' if split else 'fused'}]",
                        lambda s, x, bv=bv, sd=sd, split=split: pallas_ops.chunk_gated_delta_rule(
                            *qkvgb(x), initial_state=s, block_v=bv, state_dot=sd, split_output=split,
                            **kw).final_state, "chunk")
            if hh == h:
                add_jax("reference_chunk", lambda s, x: gd.chunk_gated_delta_rule(
                    *qkvgb(x), initial_state=s, implementation="reference", **kw).final_state, "chunk")
        if t <= CHUNK_T:
            n_acc = jnp.full((b,), max(1, t // 2), jnp.int32)
            u_bytes = 4 * b * t * hv * vd
            snap_bytes = 4 * b * t * hv * kd * vd
            rec_variants = [("triton", 8, 1), ("mosaic", 32, 1)]
            if args.variants:
                rec_variants += [("triton", 16, 1), ("triton", 32, 4), ("mosaic", 16, 1), ("mosaic", 64, 1)]
            for be, bv, nw in rec_variants:
                add_jax(f"pallas_recurrent[{be},bv={bv}]",
                        lambda s, x, be=be, bv=bv, nw=nw: pallas_ops.fused_recurrent_gated_delta_rule(
                            *qkvgb(x), initial_state=s, block_v=bv, num_warps=nw, backend=be,
                            **kw).final_state, "recurrent")

            def verify_commit(s, x, commit, be, bv):
                out = pallas_ops.fused_recurrent_gated_delta_rule(*qkvgb(x), initial_state=s,
                                                                  return_pseudo_values=True, backend=be,
                                                                  block_v=bv, output_final_state=False, **kw)
                return commit(s, x["k"], x["g"], out.v_new, n_acc, use_qk_l2norm=True)

            for be, bv, _ in rec_variants[:2]:
                add_jax(f"pallas_verify+commit[{be},bv={bv}]",
                        lambda s, x, be=be, bv=bv: verify_commit(s, x, pallas_ops.commit_state, be, bv),
                        "recurrent", u_bytes + 8 * b * hv * kd * vd)
            add_jax("pallas_snapshot_verify", lambda s, x: pallas_ops.fused_recurrent_gated_delta_rule(
                *qkvgb(x), initial_state=s, return_all_states=True, output_final_state=False,
                **kw).all_states[:, t // 2 if t > 1 else 0], "recurrent", snap_bytes)
            add_jax("pallas_commit_only", lambda s, x: pallas_ops.commit_state(
                s, x["k"], x["g"], x["v"].astype(jnp.float32), n_acc, use_qk_l2norm=True), "commit")
            add_jax("jnp_commit_only", lambda s, x: gd.commit_state(
                s, x["k"], x["g"], x["v"].astype(jnp.float32), n_acc, use_qk_l2norm=True,
                implementation="reference"), "commit")
            add_jax("reference_recurrent", lambda s, x: gd.fused_recurrent_gated_delta_rule(
                *qkvgb(x), initial_state=s, implementation="reference", **kw).final_state, "recurrent")
        if fla is not None:
            torch, fla_chunk, fla_rec, fla_snap = fla
            xt = torch_inputs(torch, x_np, torch.bfloat16)
            qt, kt, vt, gt, bt = xt["q"], xt["k"], xt["v"], xt["g"], xt["beta"]

            def add_torch(name, step, kind, extra_bytes=0):
                try:
                    t0 = time.perf_counter()
                    timers[name] = TorchGraph(torch, step, xt["s0"], n_chain)
                    meta[name] = (kind, extra_bytes)
                    log(f"[T={t} H={hh}] {name}: captured in {time.perf_counter() - t0:.1f} s")
                except Exception as e:  # noqa: BLE001 - fall back to eager chains timed with events
                    log(f"[T={t} H={hh}] {name} graph capture failed ({type(e).__name__}: {str(e)[:300]}); eager")
                    try:
                        timers[name + "(eager)"] = TorchEager(torch, step, xt["s0"], n_chain)
                        meta[name + "(eager)"] = (kind, extra_bytes)
                    except Exception as e2:  # noqa: BLE001
                        log(f"[T={t} H={hh}] {name} failed: {type(e2).__name__}: {str(e2)[:800]}")

            if t >= CHUNK_T:
                add_torch("fla_chunk", lambda s: fla_chunk(qt, kt, vt, gt, bt, scale=scale, initial_state=s,
                                                           output_final_state=True,
                                                           use_qk_l2norm_in_kernel=True)[1], "chunk")
            if t <= CHUNK_T:
                add_torch("fla_recurrent", lambda s: fla_rec(qt, kt, vt, gt, bt, scale=scale, initial_state=s,
                                                             output_final_state=True,
                                                             use_qk_l2norm_in_kernel=True)[1], "recurrent")
                add_torch("fla_snapshot_verify", lambda s: fla_snap(qt, kt, vt, gt, bt, s, scale)[2][
                    :, t // 2 if t > 1 else 0].contiguous(), "recurrent", 4 * b * t * hv * kd * vd)
        med = {name: float(np.median(v)) for name, v in alternate(timers, repeats).items()}
        for name, sec in med.items():
            kind, extra = meta[name]
            if kind == "chunk":
                flops, nbytes = chunk_cost(b, t, hh, hv, kd, vd)
            elif kind == "commit":
                flops, nbytes = 2 * b * hv * t * kd * vd, 8 * b * hv * kd * vd + 6 * b * t * hv * vd
            else:
                flops, nbytes = recurrent_cost(b, t, hh, hv, kd, vd)
            nbytes += extra
            row = dict(T=t, H=hh, HV=hv, impl=name, ms=sec * 1e3, TBps=nbytes / sec / 1e12,
                       TFLOPs=flops / sec / 1e12, chain=n_chain, repeats=repeats)
            results.append(row)
            log(json.dumps(row))
        save(results)
    return results


def markdown(header, ceilings, checks, rows):
    lines = [f"# Gated delta kernels: {header['device']}", "",
             f"jax {header['jax']} / jaxlib {header['jaxlib']}; commit `{header['git_commit']}`; {header['date']}",
             f"Command: `{header['command']}`", ""]
    if ceilings:
        lines += [f"Measured ceilings: copy {ceilings['copy_TBps']:.2f} TB/s (read + write), "
                  f"bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s.", ""]
    if checks:
        lines += ["## Correctness on the GPU (relative error vs the fp32 reference)", "",
                  "| inputs | op | T | o | state | v_new | all_states |", "|---|---|---|---|---|---|---|"]
        fmt = lambda r, key: f"{r[key]:.1e}" if key in r else ""
        for r in checks:
            lines.append(f"| {r['case']} | {r['op']} | {r['T']} | {fmt(r, 'o')} | {fmt(r, 'state')} | "
                         f"{fmt(r, 'v_new')} | {fmt(r, 'all_states')} |")
        lines.append("")
    if rows:
        lines += ["## Time per call (B=1, K=V=128, bf16 q/k/v, fp32 state, q/k L2-normalised in kernel)", "",
                  "ratio = fla time / this time (> 1: faster than fla's counterpart at the same T, H).", "",
                  "| T | H/HV | impl | ms | TB/s | TFLOP/s | ratio vs fla |", "|---|---|---|---|---|---|---|"]
        fla_ms = {}
        for r in rows:
            if r["impl"] in ("fla_chunk", "fla_recurrent", "fla_snapshot_verify"):
                fla_ms[(r["T"], r["H"], r["impl"])] = r["ms"]
        for r in rows:
            impl = r["impl"]
            if "commit_only" in impl:
                base = None
            elif "snapshot" in impl or "verify" in impl:
                base = fla_ms.get((r["T"], r["H"], "fla_snapshot_verify"))
            elif r["T"] <= CHUNK_T and "chunk" not in impl:
                base = fla_ms.get((r["T"], r["H"], "fla_recurrent"))
            else:
                base = fla_ms.get((r["T"], r["H"], "fla_chunk"))
            ratio = f"{base / r['ms']:.2f}" if base else ""
            lines.append(f"| {r['T']} | {r['H']}/{r['HV']} | {impl} | {r['ms']:.4f} | {r['TBps']:.2f} | "
                         f"{r['TFLOPs']:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--variants", action="store_true", help="also time more kernel tuning variants")
    parser.add_argument("--skip-fla", action="store_true")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke test of this script)")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--skip-ceilings", action="store_true", help="no copy / matmul ceiling measurement")
    parser.add_argument("--check-fp32", action="store_true", help="also check fp32 inputs (slow IEEE kernels)")
    parser.add_argument("--sizes", default=None, help="comma-separated T values to time (default: all)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--block-v", type=int, default=32, help="chunk state kernel block (default run)")
    parser.add_argument("--state-dot", default="bf16", help="chunk state kernel product dtype (default run)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, f"gdn_{args.tag}.log"), "w")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    header = result_header("gated_delta")
    log(json.dumps(header))
    ceilings = None if args.skip_ceilings else measure_ceilings()
    log(json.dumps(ceilings))
    checks = [] if args.skip_check else check_correctness(log, not args.skip_fla, args.small, args.check_fp32)

    def save(rows):  # after every size, so a run cut short still leaves its numbers
        md = markdown(header, ceilings, checks, rows)
        write_results(args.out, f"gdn_{args.tag}", dict(header, ceilings=ceilings, correctness=checks, timings=rows),
                      md, echo=False)
        return md

    rows = bench(log, args, save)
    print(save(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
