"""Few-row float32 products at full precision: y [M, N] = x [M, K] @ w [N, K]^T for 2 <= M <= 16.

    small_gemm(x, w, interpret=False)   Pallas (Triton backend) kernel; interpret=True runs it on CPU
    reference(x, w)                     lax.dot_general at precision HIGHEST (the ground truth)
    supports(m, n, k)                   whether the kernel takes these sizes

Why it exists and the measurements behind its use: README.md.
"""

from .kernel import BLOCK_K, BLOCK_N, MAX_ROWS, small_gemm, supports
from .reference import reference

__all__ = ["BLOCK_K", "BLOCK_N", "MAX_ROWS", "small_gemm", "supports", "reference"]
