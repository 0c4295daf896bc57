"""Registers, spills and code size of the small-T GDN kernels, without a GPU: the Pallas kernel is lowered to
Triton IR here (a cross-platform lowering for "cuda" with a stand-in sm_90 device), compiled by the local Triton
and `ptxas -v`. What a device profile cannot show: whether a kernel spills, and how large its unrolled code is.

    python scripts/kernel_resources.py --rows 1,9,17 [--kernels verify,verify-stash,stacked,replay,packed,packed-stash]
        [--unroll-max 64]

Needs `triton` importable and `ptxas` on PATH (both are on the development machine; the GPU machine's bundled
Triton may differ). Shapes: Qwen3.5-9B's GDN layer (H 16, HV 32, K = V = 128), bf16, block_v 8, 1 warp.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def lower_to_ttir(kernel: str, t: int) -> str:
    """Triton IR of the recurrent ("verify": outputs only, as under replay rollback; "verify-stash": the same, also
    copying its inputs into the replay's stacks of 24 layers; "stacked": a counted step that reads and writes its layer
    of the stack of 24 layers' states) or replay kernel at T = t."""
    import jax._src.pallas.triton.pallas_call_registration as registration
    from pallas_kernels.gated_delta import recurrent_kernel as rk

    class _Sm90:
        compute_capability = "9.0"

    registration.gpu_info_lib.get_gpu_info = lambda: _Sm90()
    captured = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        b, h, hv, k_dim, v_dim, bf = 1, 16, 32, 128, 128, jnp.bfloat16
        sds = jax.ShapeDtypeStruct
        keys, values = sds((b, t, h, k_dim), bf), sds((b, t, hv, v_dim), bf)
        gates, betas = sds((b, t, hv), jnp.float32), sds((b, t, hv), bf)
        state, counts = sds((b, hv, k_dim, v_dim), jnp.float32), sds((1,), jnp.int32)
        if kernel == "stacked":  # a counted decode / verification step reading and writing its layer of a stack
            stack = sds((24, b, hv, k_dim, v_dim), jnp.float32)
            fn = lambda q, k, v, g, be, s0, n, layer: rk.recurrent_fwd(
                q, k, v, g, be, s0, scale=k_dim ** -0.5, l2norm=True, want_vnew=False, want_states=False, block_v=8,
                interpret=False, counts=n, layer=layer)
            args = (keys, keys, values, gates, betas, stack, counts, sds((1,), jnp.int32))
        elif kernel == "verify-stash":  # a verification under replay rollback: outputs only, the pseudo-value
            # replay's inputs (keys as used, gates, pseudo-values; fp32) stored into its stacks of 24 layers
            stack = sds((24, b, hv, k_dim, v_dim), jnp.float32)
            stash = (sds((24,) + keys.shape, jnp.float32), sds((24,) + gates.shape, jnp.float32),
                     sds((24,) + values.shape, jnp.float32))
            fn = lambda q, k, v, g, be, s0, layer, stash: rk.recurrent_fwd(
                q, k, v, g, be, s0, scale=k_dim ** -0.5, l2norm=True, want_vnew=False, want_states=False, block_v=8,
                interpret=False, want_state=False, layer=layer, stash=stash)
            args = (keys, keys, values, gates, betas, stack, sds((1,), jnp.int32), stash)
        elif kernel in ("packed", "packed-stash"):  # the packed form: a counted decode step on its layer of the
            # stack (packed), or a verification that stores its keys, gates and pseudo-values into the replay's stacks
            from pallas_kernels.gated_delta.packed import PackedLayout
            layout = PackedLayout(h, hv, k_dim, v_dim, b_column=2 * h * k_dim + 2 * hv * v_dim,
                                  a_column=2 * h * k_dim + 2 * hv * v_dim + hv)
            rows, stack = max(t, 8), sds((24, b, hv, k_dim, v_dim), jnp.float32)
            conv, proj = sds((b, rows, layout.channels), bf), sds((b, rows, layout.a_column + hv), bf)
            heads = sds((hv,), jnp.float32)
            stash = (sds((24, b, t, h, k_dim), jnp.float32), sds((24, b, t, hv), jnp.float32),
                     sds((24, b, t, hv, v_dim), jnp.float32))
            common = dict(layout=layout, n_steps=t, scale=k_dim ** -0.5, l2norm=True, block_v=8, interpret=False)
            if kernel == "packed":
                fn = lambda c, pr, al, dtb, s0, n, layer: rk.recurrent_packed_fwd(
                    c, pr, al, dtb, s0, counts=n, layer=layer, **common)
                args = (conv, proj, heads, heads, stack, counts, sds((1,), jnp.int32))
            else:
                fn = lambda c, pr, al, dtb, s0, layer, st: rk.recurrent_packed_fwd(
                    c, pr, al, dtb, s0, layer=layer, stash=st, want_state=False, **common)
                args = (conv, proj, heads, heads, stack, sds((1,), jnp.int32), stash)
        elif kernel == "replay":
            fn = lambda k, v, g, be, s0, n: rk.replay_fwd(k, v, g, be, s0, n, l2norm=True, block_v=8, interpret=False)
            args = (keys, values, gates, betas, state, counts)
        else:
            fn = lambda q, k, v, g, be, s0: rk.recurrent_fwd(
                q, k, v, g, be, s0, scale=k_dim ** -0.5, l2norm=True, want_vnew=False, want_states=False, block_v=8,
                interpret=False, want_state=False)
            args = (keys, keys, values, gates, betas, state)
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    return captured[0]


def resources(ttir: str, warps: int = 1) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 2})
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    words = log.replace(",", " ").split()
    registers = int(words[words.index("registers") - 1])
    spills = int(words[words.index("spill") - 2]) if "spill" in words else 0
    return {"registers": registers, "spill_store_bytes": spills, "cubin_kb": len(compiled.asm["cubin"]) / 1024,
            "bar_sync": compiled.asm["ptx"].count("bar.sync")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,3,9,17")
    ap.add_argument("--kernels", default="verify,replay")
    ap.add_argument("--unroll-max", type=int, default=None, help="SPECDEC_GDN_UNROLL_MAX for the lowering")
    args = ap.parse_args()
    if args.unroll_max is not None:
        os.environ["SPECDEC_GDN_UNROLL_MAX"] = str(args.unroll_max)
    print("| kernel | T | registers | spill stores (bytes) | cubin KB | bar.sync |\n|---|---|---|---|---|---|")
    for kernel in args.kernels.split(","):
        for t in (int(x) for x in args.rows.split(",")):
            r = resources(lower_to_ttir(kernel, t))
            print(f"| {kernel} | {t} | {r['registers']} | {r['spill_store_bytes']} | {r['cubin_kb']:.0f} | {r['bar_sync']} |",
                  flush=True)


if __name__ == "__main__":
    main()
