"""Layout-keeping ops the inference pipeline (:mod:`.pipeline`) puts in its graphs.

``ChannelShuffle`` stands for ShuffleNet's ``view, transpose, contiguous, view``: it keeps the
channels-last layout of the convolutions around it (see :func:`.pipeline.channel_shuffles`).
``ShuffleCat`` is a ``ChannelShuffle`` of a ``cat`` of as many equal parts as groups (every
ShuffleNet unit ends so): one pass of a small C kernel interleaves the parts' channels.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch

from . import toolchain

__all__ = ["ChannelShuffle", "ShuffleCat"]


class ChannelShuffle:
    """``torch.channel_shuffle(x, groups)``; its result keeps ``x``'s memory format (channels-last
    in, channels-last out), which :meth:`fake_call` says for symbolic metadata too."""

    __module__ = "symtrace.lower.layout_ops"

    def __init__(self, groups: int):
        self.groups = groups
        self.__name__ = "channel_shuffle"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.channel_shuffle(x, self.groups)

    def fake_call(self, x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)   # (preserve_format: the strides torch's CPU kernel gives)

    def __repr__(self):
        return f"<channel_shuffle groups={self.groups}>"


# --------------------------------------------------------------------------- cat + shuffle

_SHUFFLE_CAT_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* out (N, g*Cg, H, W) channels-last: out[n, i*g + j, h, w] = part_j[n, i, h, w]. Each part's
   channels are contiguous (stride 1); desc[4 j .. 4 j + 3]: part j's address and its strides
   along N, H and W, in elements. The element type only matters by size (this is data
   movement): 1, 2, 4 or 8 bytes. */
#define ST_PART(T, j) ((const T*)(intptr_t)desc[4 * (j)] + n * desc[4 * (j) + 1] + h * desc[4 * (j) + 2] \
                       + w * desc[4 * (j) + 3])
#define ST_SHUF(T)                                                                               \
    _Pragma("omp parallel for schedule(static) num_threads(nt) if(par)")                         \
    for (int64_t p = 0; p < N * H * W; p++) {                                                    \
        const int64_t n = p / (H * W), h = (p / W) % H, w = p % W;                                \
        T* o = (T*)out + p * g * Cg;                                                             \
        if (g == 2) {                                                                            \
            const T* a = ST_PART(T, 0);                 \
            const T* b = ST_PART(T, 1);                 \
            for (int64_t i = 0; i < Cg; i++) { o[2 * i] = a[i]; o[2 * i + 1] = b[i]; }           \
        } else {                                                                                 \
            for (int64_t j = 0; j < g; j++) {                                                    \
                const T* a = ST_PART(T, j);             \
                for (int64_t i = 0; i < Cg; i++) o[i * g + j] = a[i];                            \
            }                                                                                    \
        }                                                                                        \
    }

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
/* 4-byte elements, g = 2: eight of each part interleaved per two 8-lane stores */
__attribute__((target("avx")))
static void st_interleave2_avx(const uint32_t* a, const uint32_t* b, uint32_t* o, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 va = _mm256_loadu_ps((const float*)(a + i)), vb = _mm256_loadu_ps((const float*)(b + i));
        const __m256 lo = _mm256_unpacklo_ps(va, vb), hi = _mm256_unpackhi_ps(va, vb);
        _mm256_storeu_ps((float*)(o + 2 * i), _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps((float*)(o + 2 * i + 8), _mm256_permute2f128_ps(lo, hi, 0x31));
    }
    for (; i < n; i++) { o[2 * i] = a[i]; o[2 * i + 1] = b[i]; }
}
#define ST_HAVE_AVX_INTERLEAVE 1
#endif

int st_shuffle_cat(const int64_t* desc, int64_t g, int64_t N, int64_t Cg, int64_t H, int64_t W,
                   void* out, int64_t esize, int32_t nt) {
    const int par = nt > 1 && N * H * W * g * Cg * esize >= (1 << 16);
#ifdef ST_HAVE_AVX_INTERLEAVE
    __builtin_cpu_init();
    if (esize == 4 && g == 2 && __builtin_cpu_supports("avx")) {
#pragma omp parallel for schedule(static) num_threads(nt) if(par)
        for (int64_t p = 0; p < N * H * W; p++) {
            const int64_t n = p / (H * W), h = (p / W) % H, w = p % W;
            st_interleave2_avx(ST_PART(uint32_t, 0),
                               ST_PART(uint32_t, 1),
                               (uint32_t*)out + p * 2 * Cg, Cg);
        }
        return 0;
    }
#endif
    switch (esize) {
    case 1: { ST_SHUF(uint8_t) return 0; }
    case 2: { ST_SHUF(uint16_t) return 0; }
    case 4: { ST_SHUF(uint32_t) return 0; }
    case 8: { ST_SHUF(uint64_t) return 0; }
    default: return -2;
    }
}
"""

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class _ShuffleKernel(toolchain.CheckedLibrary):
    """The compiled kernel, built on first use and checked against torch once."""

    def _load(self):
        lib = toolchain.load_library(_SHUFFLE_CAT_SOURCE)
        lib.st_shuffle_cat.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _P, _I64, _I32]
        lib.st_shuffle_cat.restype = ctypes.c_int
        return lib

    def _self_check(self) -> str:
        g = torch.Generator().manual_seed(0)
        parts = [torch.randn(2, 3, 5, 7, generator=g).contiguous(memory_format=torch.channels_last)
                 for _ in range(3)]
        want = torch.channel_shuffle(torch.cat(parts, 1), 3)
        got = self.run(parts)
        return "" if got is not None and torch.equal(got, want) else "the kernel disagrees with torch"

    def run(self, parts: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        g = len(parts)
        n, cg, h, w = parts[0].shape
        out = torch.empty((n, g * cg, h, w), dtype=parts[0].dtype, memory_format=torch.channels_last)
        desc = (ctypes.c_int64 * (4 * g))(*[v for p in parts for v in (p.data_ptr(), p.stride(0), p.stride(2),
                                                                         p.stride(3))])
        rc = self._lib.st_shuffle_cat(desc, g, n, cg, h, w, out.data_ptr(), out.element_size(), torch.get_num_threads())
        return out if rc == 0 else None


SHUFFLE_KERNEL = _ShuffleKernel()


class ShuffleCat:
    """``torch.channel_shuffle(torch.cat(parts, 1), len(parts))`` where every part has the same
    shape: channel ``i * g + j`` of the result is channel ``i`` of part ``j``. One pass of
    symtrace's kernel writes the channels-last result from parts whose channels are contiguous
    (ShuffleNet's units, between channels-last convolutions), where torch copies twice (the cat,
    then the shuffle); anything else runs those two torch calls."""

    __module__ = "symtrace.lower.layout_ops"
    #: what the report says of its calls (one call, not generated kernels)
    extern_reason = "symtrace's cat + channel-shuffle kernel (one call)"

    def __init__(self, groups: int):
        self.groups = groups
        self.__name__ = "shuffle_cat"

    def _applies(self, parts) -> bool:
        if len(parts) != self.groups or not all(type(p) is torch.Tensor for p in parts):
            return False
        first = parts[0]
        if first.dim() != 4 or not first.is_cpu or first.element_size() not in (1, 2, 4, 8) \
                or first.is_quantized or first.is_complex():
            return False
        for p in parts:
            if p.shape != first.shape or p.dtype != first.dtype or not p.is_cpu or p.stride(1) != 1 \
                    or p.layout != torch.strided or p.is_conj() or p.is_neg():
                return False
        if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
            return False
        return first.numel() > 0 and (SHUFFLE_KERNEL._ok is True or SHUFFLE_KERNEL.available())

    def __call__(self, *parts: torch.Tensor) -> torch.Tensor:
        if self._applies(parts):
            out = SHUFFLE_KERNEL.run(parts)
            if out is not None:
                return out
        return torch.channel_shuffle(torch.cat(parts, 1), self.groups)

    def fake_call(self, *parts: torch.Tensor) -> torch.Tensor:
        """The result's metadata on fake tensors (see :mod:`symtrace.graph.symbolic_shapes`)."""
        return torch.empty_like(torch.cat(parts, 1))

    def __repr__(self):
        return f"<shuffle_cat groups={self.groups}>"
