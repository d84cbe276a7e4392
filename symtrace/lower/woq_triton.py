"""Weight-only int8/int4 Linear as Triton kernels (CUDA tensors; CPU tensors in Triton's
interpreter, ``TRITON_INTERPRET=1``, which is how the tests run them).

Same stored layout and numbers as the C kernels (:mod:`.woq_csrc`,
:mod:`symtrace.passes.quant.woq`): each weight is dequantized as the reference does,
``(q - z) * s`` in float32, then multiplied in float32 -- ``tl.dot`` with
``input_precision="ieee"`` (no TF32), so results match ``F.linear(x, dequantized W)`` to
float32 rounding. Two kernels: a GEMV for at most :data:`GEMV_MAX_M` rows of ``x`` (one
program per row and block of outputs, products summed along K) and a tiled GEMM above it.
Imported only when a ``woq_linear`` call gets CUDA tensors (or by tests): needs ``triton``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..passes.quant.woq import check_stored, group_count
from .triton_prelude import interpreter_defect

__all__ = ["linear", "GEMV_MAX_M"]

GEMV_MAX_M = 8


@triton.jit
def _dequant(w_ptr, s_ptr, z_ptr, n, k, mask, ldw, G, GS, ZDEF, BITS: tl.constexpr, HAS_Z: tl.constexpr):
    """(len(n), len(k)) float32 weights ``(q - z) * s``; 0 outside ``mask``."""
    nn_ = n[:, None]
    kk = k[None, :]
    if BITS == 8:
        q = tl.load(w_ptr + nn_ * ldw + kk, mask=mask, other=0).to(tl.float32)
    else:  # blocks of 32 inputs in 16 bytes: input 32b + i low nibble, 32b + 16 + i high nibble
        byte = tl.load(w_ptr + nn_ * ldw + (kk // 32) * 16 + (kk % 16), mask=mask, other=0).to(tl.int32)
        q = ((byte >> (((kk % 32) // 16) * 4)) & 15).to(tl.float32)
    g = kk // GS
    s = tl.load(s_ptr + nn_ * G + g, mask=mask, other=0.0)
    if HAS_Z:
        z = tl.load(z_ptr + nn_ * G + g, mask=mask, other=0).to(tl.float32)
        w = (q - z) * s
    else:
        w = (q - ZDEF) * s
    return w


@triton.jit
def _woq_gemv(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, N, K, ldx, ldw, G, GS, ZDEF, BITS: tl.constexpr,
              HAS_Z: tl.constexpr, HAS_B: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < N
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < K
        xv = tl.load(x_ptr + m * ldx + k, mask=kmask, other=0.0)
        w = _dequant(w_ptr, s_ptr, z_ptr, n, k, nmask[:, None] & kmask[None, :], ldw, G, GS, ZDEF, BITS, HAS_Z)
        acc += tl.sum(w * xv[None, :], axis=1)
    if HAS_B:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0)
    tl.store(y_ptr + m * N + n, acc, mask=nmask)


@triton.jit
def _woq_gemm(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, ldx, ldw, G, GS, ZDEF, BITS: tl.constexpr,
              HAS_Z: tl.constexpr, HAS_B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    mmask = m < M
    nmask = n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < K
        xt = tl.load(x_ptr + m[:, None] * ldx + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = _dequant(w_ptr, s_ptr, z_ptr, n, k, nmask[:, None] & kmask[None, :], ldw, G, GS, ZDEF, BITS, HAS_Z)
        acc += tl.dot(xt, tl.trans(w), input_precision="ieee")
    if HAS_B:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0)[None, :]
    tl.store(y_ptr + m[:, None] * N + n[None, :], acc, mask=mmask[:, None] & nmask[None, :])


def linear(x: torch.Tensor, qweight, scale, zero, bias, bits: int, group_size, in_features: int) -> torch.Tensor:
    """``woq_reference(...)`` by the Triton kernels, for a float32 ``x`` on the weights' device."""
    k = in_features
    check_stored(qweight, scale, zero, bias, bits, group_size, k)
    if x.dtype is not torch.float32:
        raise TypeError(f"the Triton woq_linear takes float32 activations, got {x.dtype}")
    n = qweight.shape[0]
    x2 = x.reshape(x.shape[:-1].numel(), k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_((bias.float() if bias is not None else torch.zeros(n, device=x.device)).expand_as(y))
    defect = interpreter_defect()   # every kernel here loops over K, a run-time size
    if defect:
        raise RuntimeError(f"woq_linear's Triton kernels: {defect}")
    qweight = qweight.contiguous()
    scale = scale.to(torch.float32).contiguous()
    zero = zero.contiguous() if zero is not None else scale  # (a placeholder pointer when there is none)
    b = bias.to(torch.float32).contiguous() if bias is not None else scale
    common = dict(BITS=bits, HAS_Z=zero is not scale, HAS_B=bias is not None)
    args = (x2, qweight, scale, zero, b, y)
    sizes = (n, k, x2.stride(0), qweight.shape[1], group_count(k, group_size), group_size or k,
             0.0 if bits == 8 else 8.0)
    if m <= GEMV_MAX_M:
        bn, bk = 32, 64
        _woq_gemv[(triton.cdiv(n, bn), m)](*args, *sizes, **common, BN=bn, BK=bk)
    else:
        bm, bn, bk = 32, 32, 32
        _woq_gemm[(triton.cdiv(m, bm), triton.cdiv(n, bn))](*args, m, *sizes, **common, BM=bm, BN=bn, BK=bk)
    return y
