"""Attention of one new token over a KV cache, in C (a step of the inference pipeline, :mod:`.pipeline`).

A decoder's step asks ``F.scaled_dot_product_attention(q, k, v)`` with one query row per head
(``q``: ``(B, H, 1, D)``) against the whole cache (``k``, ``v``: ``(B, Hkv, L, D)``; grouped
heads with ``enable_gqa=True``, ``H = G * Hkv``). torch's CPU kernel is built for many query
rows: measured here on 2 threads, about 40 us for 32 heads over 80 positions and 690 us over
2048, where reading the cache takes about 280 us. :func:`decode_attention` rewrites the calls
whose arguments say ``attn_mask=None``, ``dropout_p=0``, ``is_causal=False`` (or a value a
data guard pins to false) and one query row
(float32, CPU) into :class:`DecodeAttention` calls. Its AVX-512 kernel takes the query rows
that share a key-value head together (up to 4: each key and value row is read once for them),
computes the scores ``scale * q . k_j`` (16-float vectors, one reduction per score), the
softmax (largest score first, then ``exp(s - max)`` and the sum), and the weighted sum of the
value rows in registers; (batch, head group) tasks are split over OpenMP threads. That is
softmax attention by its definition: a NaN score, or an infinite largest score, makes the
head's row NaN (as ``exp(inf - inf)`` does), and NaN or Inf in ``v`` reach the output as in
``softmax(s) @ v``.

Anything else at run time (another dtype or device, more query rows, head sizes other than 64
and 128 (the kernel keeps a row in registers), a last dimension that is not contiguous, an empty cache, tensors
that require grad with grad mode on, a CPU without AVX-512) runs torch's
``scaled_dot_product_attention`` with the same arguments.
"""
from __future__ import annotations

import ctypes
import math
import threading
from typing import Any, List, Optional

import torch
import torch.nn.functional as F

from ..graph.graph_module import GraphModule
from ..graph.guards import check_data_guard
from ..graph.node import Node
from . import toolchain

__all__ = ["DecodeAttention", "decode_attention", "KERNEL"]

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
@PRELUDE@
/* ---- decode attention ---- */
#define ST_AT __attribute__((target("avx512f,avx2,fma")))
#define ST_RMAX 4      /* query rows of one key-value head handled together */

/* One (kv head, up to 4 query rows) task, for NR rows (4, or 1 without grouping) and NC
   16-float chunks per row (D = Dv = 16 NC), constants so that the rows' vectors stay in
   registers: scores s[r * L + j] = scale * q_r . k_j, then (after the softmax) o_r = sum_j
   p[r][j] v_j * inv[r]. Rows past nr repeat row 0 (computed, not stored). */
#define ST_ATTN_FNS(NR, NC)                                                                           \
static ST_AT void st_attn_scores_##NR##_##NC(const float* const* qr, const float* kp, int64_t kl,    \
                                             int64_t L, float scale, float* s) {                      \
    __m512 qv[NR][NC];                                                                                \
    for (int r = 0; r < NR; r++)                                                                      \
        for (int c = 0; c < NC; c++) qv[r][c] = _mm512_loadu_ps(qr[r] + 16 * c);                     \
    for (int64_t j = 0; j < L; j++) {                                                                 \
        const float* kj = kp + j * kl;                                                                \
        __m512 acc[NR];                                                                               \
        for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();                                    \
        for (int c = 0; c < NC; c++) {                                                                \
            const __m512 kv = _mm512_loadu_ps(kj + 16 * c);                                           \
            for (int r = 0; r < NR; r++) acc[r] = _mm512_fmadd_ps(qv[r][c], kv, acc[r]);              \
        }                                                                                             \
        for (int r = 0; r < NR; r++) s[r * L + j] = _mm512_reduce_add_ps(acc[r]) * scale;             \
    }                                                                                                 \
}                                                                                                     \
static ST_AT void st_attn_values_##NR##_##NC(const float* p, const float* vp, int64_t vl, int64_t L,  \
                                             float* const* orow, const float* inv, int nr) {          \
    __m512 acc[NR][NC];                                                                               \
    for (int r = 0; r < NR; r++)                                                                      \
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();                                 \
    for (int64_t j = 0; j < L; j++) {                                                                 \
        const float* vj = vp + j * vl;                                                                \
        __m512 pr[NR];                                                                                \
        for (int r = 0; r < NR; r++) pr[r] = _mm512_set1_ps(p[r * L + j]);                            \
        for (int c = 0; c < NC; c++) {                                                                \
            const __m512 vv = _mm512_loadu_ps(vj + 16 * c);                                           \
            for (int r = 0; r < NR; r++) acc[r][c] = _mm512_fmadd_ps(pr[r], vv, acc[r][c]);           \
        }                                                                                             \
    }                                                                                                 \
    for (int r = 0; r < nr; r++)                                                                      \
        for (int c = 0; c < NC; c++)                                                                  \
            _mm512_storeu_ps(orow[r] + 16 * c, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv[r])));     \
}
ST_ATTN_FNS(4, 4)
ST_ATTN_FNS(4, 8)
ST_ATTN_FNS(1, 4)
ST_ATTN_FNS(1, 8)

/* softmax weights of one row in place (max first, exp(s - max)); returns 1 / sum, or NaN when
   a score is NaN or the largest is infinite (softmax's NaN row) */
static float st_attn_softmax(float* s, int64_t L) {
    float m = -INFINITY;
    int bad = 0;
    for (int64_t j = 0; j < L; j++) {
        bad |= s[j] != s[j];
        m = s[j] > m ? s[j] : m;
    }
    if (bad || isinf(m)) return NAN;
    float sum = 0.0f;
#pragma omp simd reduction(+:sum)
    for (int64_t j = 0; j < L; j++) {
        const float e = st_expf(s[j] - m);
        s[j] = e;
        sum += e;
    }
    return 1.0f / sum;
}

/* o (B, H, 1, D), contiguous, = softmax(scale * q . k^T) @ v per (b, h), k and v at head h / G.
   Strides in elements, the last dimension contiguous; D (= Dv) 64 or 128. -1: no memory;
   -2: not these sizes, or no AVX-512 here. */
int st_decode_attention(const float* q, const float* k, const float* v, float* o,
                        int64_t B, int64_t H, int64_t G, int64_t L, int64_t D, int64_t Dv,
                        int64_t qb, int64_t qh, int64_t kb, int64_t kh, int64_t kl,
                        int64_t vb, int64_t vh, int64_t vl, float scale, int32_t nt) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || D != Dv || (D != 64 && D != 128) || L <= 0) return -2;
    const int nr_max = G == 1 ? 1 : ST_RMAX;
    const int64_t Hkv = H / G, groups = (G + nr_max - 1) / nr_max, tasks = B * Hkv * groups;
    float* scratch = (float*)malloc((size_t)(tasks * nr_max * L) * sizeof(float));
    if (!scratch) return -1;
    const int par = nt > 1 && tasks > 1 && B * H * L * (D + Dv) >= 32768;
#pragma omp parallel for schedule(static) num_threads(nt) if(par)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t b = t / (Hkv * groups), g = (t / groups) % Hkv, h0 = g * G + (t % groups) * nr_max;
        const int nr = (int)(g * G + G - h0 < nr_max ? g * G + G - h0 : nr_max);
        const float* qr[ST_RMAX];
        float* orow[ST_RMAX];
        float inv[ST_RMAX];
        for (int r = 0; r < ST_RMAX; r++) {
            const int64_t h = h0 + (r < nr ? r : 0);
            qr[r] = q + b * qb + h * qh;
            orow[r] = o + (b * H + h) * Dv;
        }
        float* s = scratch + t * nr_max * L;
        const float* kp = k + b * kb + g * kh;
        const float* vp = v + b * vb + g * vh;
        if (nr_max == 4) {
            if (D == 64) st_attn_scores_4_4(qr, kp, kl, L, scale, s); else st_attn_scores_4_8(qr, kp, kl, L, scale, s);
        } else {
            if (D == 64) st_attn_scores_1_4(qr, kp, kl, L, scale, s); else st_attn_scores_1_8(qr, kp, kl, L, scale, s);
        }
        for (int r = 0; r < nr_max; r++) inv[r] = st_attn_softmax(s + r * L, L);
        if (nr_max == 4) {
            if (D == 64) st_attn_values_4_4(s, vp, vl, L, orow, inv, nr); else st_attn_values_4_8(s, vp, vl, L, orow, inv, nr);
        } else {
            if (D == 64) st_attn_values_1_4(s, vp, vl, L, orow, inv, nr); else st_attn_values_1_8(s, vp, vl, L, orow, inv, nr);
        }
        for (int r = 0; r < nr; r++)
            if (inv[r] != inv[r])
                for (int64_t d = 0; d < Dv; d++) orow[r][d] = NAN;
    }
    free(scratch);
    return 0;
}
#else
int st_decode_attention(const float* q, const float* k, const float* v, float* o,
                        int64_t B, int64_t H, int64_t G, int64_t L, int64_t D, int64_t Dv,
                        int64_t qb, int64_t qh, int64_t kb, int64_t kh, int64_t kl,
                        int64_t vb, int64_t vh, int64_t vl, float scale, int32_t nt) {
    return -2;
}
#endif
"""

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class _Kernel:
    """The compiled kernel, built on first use and checked against torch once."""

    def __init__(self):
        self._lib = None
        self._ok: Optional[bool] = None
        self._lock = threading.Lock()
        self.reason = ""

    def _load(self):
        lib = toolchain.load_library(_SOURCE.replace("@PRELUDE@", toolchain.prelude_source()))
        lib.st_decode_attention.argtypes = [_P, _P, _P, _P] + [_I64] * 14 + [ctypes.c_float, _I32]
        lib.st_decode_attention.restype = ctypes.c_int
        return lib

    def available(self) -> bool:
        return toolchain.load_once(self, self._load, self._self_check)

    def _self_check(self) -> str:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 6, 1, 64, generator=g), torch.randn(2, 2, 37, 64, generator=g),
                   torch.randn(2, 2, 37, 64, generator=g))
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        got = self.run(q, k, v, 1.0 / math.sqrt(64))
        if got is None:
            return "the kernel needs AVX-512, which this CPU lacks"
        return "" if torch.allclose(got, want, rtol=1e-4, atol=1e-5) else "the kernel disagrees with torch"

    def run(self, q, k, v, scale: float) -> Optional[torch.Tensor]:
        """The kernel's result, or None where it does not run (no AVX-512, head sizes)."""
        b, h, _, d = q.shape
        hkv, n, dv = k.shape[1], k.shape[2], v.shape[3]
        out = torch.empty((b, h, 1, dv), dtype=torch.float32)
        qs, ks, vs = q.stride(), k.stride(), v.stride()
        rc = self._lib.st_decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), b, h, h // hkv,
                                           n, d, dv, qs[0], qs[1], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
                                           scale, torch.get_num_threads())
        if rc == -1:
            raise MemoryError(f"decode attention: no memory for {b * h * n} scores")
        return out if rc == 0 else None


KERNEL = _Kernel()


class DecodeAttention:
    """``F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa)`` (no mask,
    no dropout, not causal), by the C kernel when ``q`` has one query row (see the module doc)."""

    def __init__(self, scale: Optional[float], enable_gqa: bool):
        self.scale = scale
        self.enable_gqa = bool(enable_gqa)
        self.__name__ = "decode_attention"

    def _applies(self, q, k, v) -> bool:
        f32 = torch.float32
        if not (q.dtype is f32 and k.dtype is f32 and v.dtype is f32 and q.is_cpu and k.is_cpu and v.is_cpu
                and q.dim() == 4 and k.dim() == 4 and v.dim() == 4):
            return False
        b, h, lq, d = q.shape
        kb, hkv, n, kd = k.shape
        if lq != 1 or (kb, hkv, n) != tuple(v.shape[:3]) or kb != b or kd != d or v.shape[3] != d \
                or d not in (64, 128) or n == 0 or hkv == 0 or h % hkv or (h != hkv and not self.enable_gqa):
            return False
        if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
            return False
        if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
            return False
        return KERNEL._ok is True or KERNEL.available()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._applies(q, k, v):
            scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
            out = KERNEL.run(q, k, v, scale)
            if out is not None:
                return out
        kwargs = {"scale": self.scale}
        if self.enable_gqa:
            kwargs["enable_gqa"] = True
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    def fake_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The result's metadata on fake tensors (see :mod:`symtrace.graph.symbolic_shapes`)."""
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    def __repr__(self) -> str:
        return f"<decode_attention scale={self.scale} enable_gqa={self.enable_gqa}>"


_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _pinned(value: Any) -> Any:
    """``value`` itself, or for a node whose truth a data guard pins (Hugging Face computes
    ``is_causal = q.shape[2] > 1`` in the program), the truth the guard holds it to; else the
    node."""
    if not isinstance(value, Node):
        return value
    for user in value.users:
        if user.op == "call_function" and user.target is check_data_guard and len(user.args) == 2 \
                and user.args[0] is value:
            guard = user.args[1]
            if getattr(guard, "check", None) in ("bool", "eq", "is") and type(guard.expected) is bool:
                return guard.expected
    return value


def decode_attention(gm: GraphModule) -> List[str]:
    """Rewrite ``gm``'s one-query-row attention calls (see the module doc), in place; the names
    of the rewritten nodes."""
    notes = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not F.scaled_dot_product_attention:
            continue
        if len(node.args) > 3 or set(node.kwargs) - set(_NAMES):
            continue
        bound = dict(zip(_NAMES, node.args), **node.kwargs)
        if not all(isinstance(bound.get(n), Node) for n in _NAMES[:3]):
            continue
        if bound.get("attn_mask") is not None or bound.get("dropout_p", 0.0) != 0.0 \
                or _pinned(bound.get("is_causal", False)) is not False:
            continue
        scale, gqa = bound.get("scale"), bound.get("enable_gqa", False)
        if not (scale is None or type(scale) in (int, float)) or type(gqa) is not bool:
            continue
        meta = bound["query"].meta.get("tensor_meta")
        shape = getattr(meta, "shape", None)
        if shape is None or len(shape) != 4 or not isinstance(shape[2], int) or shape[2] != 1 \
                or getattr(meta, "dtype", None) is not torch.float32 \
                or getattr(getattr(meta, "device", None), "type", "cpu") != "cpu":
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(DecodeAttention(None if scale is None else float(scale), gqa),
                                         (bound["query"], bound["key"], bound["value"]))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        notes.append(node.name)
    return notes
