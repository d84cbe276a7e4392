"""Attention of a decode step over its KV cache, in C (a step of the inference pipeline, :mod:`.pipeline`).

A decoder's step asks ``F.scaled_dot_product_attention(q, k, v)`` with one query row per head
(``q``: ``(B, H, 1, D)``) against the whole cache (``k``, ``v``: ``(B, Hkv, L, D)``; grouped
heads with ``enable_gqa=True``, ``H = G * Hkv``; or, as Hugging Face's StaticCache path lays
them out, the ``G`` query heads of a key-value head folded into ``G`` rows of one). torch's CPU
kernel is built for many query rows: measured here on 2 threads, about 40 us for 32 heads over
80 positions and 690 us over 2048, where reading the cache takes about 280 us.

:func:`decode_attention` rewrites the calls with at most :data:`MAX_ROWS` query rows and more
keys than that (a cache; an encoder's self-attention is left alone), head size 64 or 128 (float32,
CPU), ``dropout_p=0``, ``is_causal=False`` (or a value a data guard pins to false: Hugging Face
computes it from the query length) and a boolean or float32 mask, or none (a StaticCache step
masks its unfilled positions), into :class:`DecodeAttention` calls. Its kernel (AVX-512, or AVX2
with FMA: one template, 16- or 8-float vectors, chosen at run time) takes
the query rows that share a key-value head 4 at a time (each key and value row is read once
for them), computes the scores ``scale * q . k_j`` (one vector reduction per score),
applies the mask, the softmax (largest score first, then ``exp(s - max)`` and the sum), and the
weighted sum of the value rows in registers; (batch, key-value head, rows) tasks are split over
OpenMP threads. With AVX2 and a cache laid out positions outermost (:mod:`.kv_append`'s layout,
where a head's rows lie 2 KB or more apart), the threads split the positions instead, so that
each reads its share of the cache as one run of memory (``st_decode_attention_avx2``). That is
softmax attention as torch's SDPA computes it: a NaN score, or ``+inf`` as the largest, makes
the row NaN (as ``exp(inf - inf)`` does); a boolean mask adds ``-inf`` (a NaN score it drops
stays NaN); a row whose scores are all ``-inf`` (fully masked) gets zero weights, so its
output is ``0 x v``: zeros, or NaN where ``v`` holds NaN or an infinity; NaN or Inf in ``v``
reach the output as in ``softmax(s) @ v``.

Anything else at run time (another dtype or device, more query rows, head sizes other than 64
and 128 (the kernel keeps a row in registers), a last dimension that is not contiguous, an
empty cache, a mask of another dtype or rank, tensors that require grad with grad mode on, a
CPU with neither AVX-512 nor AVX2) runs torch's ``scaled_dot_product_attention`` with the same
arguments. Measured on an AVX2 CPU (2 threads): 1.3x torch at 32 heads / 8 KV heads over 80
positions, 2.3x over 2048; without grouping (12 heads, 80 positions) 0.91x. In kv_append's
layout (the positions split; called back to back, the cache warm; medians of 5): 32/8 heads
1.19x torch over 80 positions, 1.87x over 512, 2.97x over 2048 (torch's SDPA reads that layout
slowly); 12 heads without grouping 0.60x over 80 positions, 2.34x over 2048. Called back to
back, tasks by head are faster still in that layout (1.2-1.5x, 40-640 positions, both
groupings): the split pays where a decode step calls it, its cache cold (the step's weights
stream through the caches in between): a 1B Llama step, 32/8 heads, 0.9% less time with 64-170
positions cached, 5.4% with ~1100 (docs/lowering.md).
"""
from __future__ import annotations

import ctypes
import math
from typing import Any, List, Optional

import torch
import torch.nn.functional as F

from ..graph.graph_module import GraphModule
from ..graph.guards import check_data_guard
from ..graph.node import Node
from . import toolchain

__all__ = ["DecodeAttention", "decode_attention", "KERNEL", "MAX_ROWS"]

#: query rows per head the rewrite and the kernel take: a decode step (1; Hugging Face's
#: grouped layout without ``enable_gqa`` folds a group's heads into rows, ``G`` of them)
MAX_ROWS = 8

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
@PRELUDE@
#if defined(__x86_64__) || defined(__i386__)
#define ST_ATTN_X86 1
#include <immintrin.h>
/* ---- decode attention ---- */
#define ST_RMAX 4      /* query rows of one key-value head handled together */
/* each key and value row is prefetched ST_PF positions ahead: a cache laid out positions
   outermost (kv_append's layout) puts a head's consecutive rows 2 KB or more apart, where the
   hardware prefetchers, which stay within a 4 KB page, help little (measured on 2 threads over
   512 positions, 32/8 heads: about 390 -> 290 us cold); a prefetch past the end never faults
   (the address is computed as an integer) */
#define ST_PF 16
#define ST_ATTN_PREFETCH(row, ahead, nfloats)                                                       \
    do {                                                                                            \
        const uintptr_t a_ = (uintptr_t)(row) + (uintptr_t)((ahead) * 4);                           \
        for (int f_ = 0; f_ < (nfloats); f_ += 16) _mm_prefetch((const char*)(a_ + 4 * f_), _MM_HINT_T0); \
    } while (0)

/* the vector vocabulary of each instruction set: AVX-512 (16 floats) and AVX2 (8 floats) */
#define ST_AT512 __attribute__((target("avx512f,avx2,fma")))
#define ST_AT256 __attribute__((target("avx2,fma")))
#define V512 __m512
#define W512 16
#define LD512 _mm512_loadu_ps
#define ST512 _mm512_storeu_ps
#define ZERO512 _mm512_setzero_ps
#define SET512 _mm512_set1_ps
#define FMA512 _mm512_fmadd_ps
#define MUL512 _mm512_mul_ps
#define SUM512 _mm512_reduce_add_ps
#define V256 __m256
#define W256 8
#define LD256 _mm256_loadu_ps
#define ST256 _mm256_storeu_ps
#define ZERO256 _mm256_setzero_ps
#define SET256 _mm256_set1_ps
#define FMA256 _mm256_fmadd_ps
#define MUL256 _mm256_mul_ps
#define SUM256 st_attn_sum256
static inline ST_AT256 float st_attn_sum256(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* One (kv head, up to 4 query rows) task, for NR rows (4, or 1 without grouping) and NC
   vectors per row (D = Dv = W NC), constants so that the rows' vectors stay in registers
   (AVX2 has half as many: the compiler keeps what does not fit in L1): scores s[r * L + j] =
   scale * q_r . k_j, then (after the softmax) o_r = sum_j p[r][j] v_j * inv[r]. Rows past nr
   repeat row 0 (computed, not stored). */
#define ST_ATTN_FNS(I, NR, NC)                                                                        \
static ST_AT##I void st_attn_scores_##I##_##NR##_##NC(const float* const* qr, const float* kp,      \
                                                      int64_t kl, int64_t L, float scale, float* s) { \
    V##I qv[NR][NC];                                                                                  \
    for (int r = 0; r < NR; r++)                                                                      \
        for (int c = 0; c < NC; c++) qv[r][c] = LD##I(qr[r] + W##I * c);                              \
    for (int64_t j = 0; j < L; j++) {                                                                 \
        const float* kj = kp + j * kl;                                                                \
        ST_ATTN_PREFETCH(kj, ST_PF * kl, NC * W##I);                                                  \
        V##I acc[NR];                                                                                 \
        for (int r = 0; r < NR; r++) acc[r] = ZERO##I();                                              \
        for (int c = 0; c < NC; c++) {                                                                \
            const V##I kv = LD##I(kj + W##I * c);                                                     \
            for (int r = 0; r < NR; r++) acc[r] = FMA##I(qv[r][c], kv, acc[r]);                       \
        }                                                                                             \
        for (int r = 0; r < NR; r++) s[r * L + j] = SUM##I(acc[r]) * scale;                           \
    }                                                                                                 \
}                                                                                                     \
static ST_AT##I void st_attn_values_##I##_##NR##_##NC(const float* p, const float* vp, int64_t vl,  \
                                                      int64_t L, float* const* orow, const float* inv, \
                                                      int nr) {                                       \
    V##I acc[NR][NC];                                                                                 \
    for (int r = 0; r < NR; r++)                                                                      \
        for (int c = 0; c < NC; c++) acc[r][c] = ZERO##I();                                           \
    for (int64_t j = 0; j < L; j++) {                                                                 \
        const float* vj = vp + j * vl;                                                                \
        ST_ATTN_PREFETCH(vj, ST_PF * vl, NC * W##I);                                                  \
        V##I pr[NR];                                                                                  \
        for (int r = 0; r < NR; r++) pr[r] = SET##I(p[r * L + j]);                                    \
        for (int c = 0; c < NC; c++) {                                                                \
            const V##I vv = LD##I(vj + W##I * c);                                                     \
            for (int r = 0; r < NR; r++) acc[r][c] = FMA##I(pr[r], vv, acc[r][c]);                    \
        }                                                                                             \
    }                                                                                                 \
    for (int r = 0; r < nr; r++)                                                                      \
        for (int c = 0; c < NC; c++)                                                                  \
            ST##I(orow[r] + W##I * c, MUL##I(acc[r][c], SET##I(inv[r])));                             \
}
ST_ATTN_FNS(512, 4, 4)
ST_ATTN_FNS(512, 4, 8)
ST_ATTN_FNS(512, 1, 4)
ST_ATTN_FNS(512, 1, 8)
ST_ATTN_FNS(256, 4, 8)
ST_ATTN_FNS(256, 4, 16)
ST_ATTN_FNS(256, 1, 8)
ST_ATTN_FNS(256, 1, 16)

typedef void (*st_attn_scores_fn)(const float* const*, const float*, int64_t, int64_t, float, float*);
typedef void (*st_attn_values_fn)(const float*, const float*, int64_t, int64_t, float* const*, const float*, int);

/* the mask of one row into its scores: kind 1 bool (uint8; false: -inf added), 2 float (added) */
static void st_attn_mask(float* s, int64_t L, const void* mask, int kind, int64_t ml) {
    if (kind == 1) {
        const uint8_t* m = (const uint8_t*)mask;
        for (int64_t j = 0; j < L; j++) s[j] = m[j * ml] ? s[j] : s[j] - INFINITY;   /* (as torch adds -inf: NaN stays) */
    } else if (kind == 2) {
        const float* m = (const float*)mask;
        for (int64_t j = 0; j < L; j++) s[j] += m[j * ml];
    }
}

/* softmax weights of one row in place (max first, exp(s - max)); *inv = 1 / sum. Returns 0, or
   1 for a NaN row (a NaN score, or +Inf the largest: exp(inf - inf)), or 2 for a row of zero
   weights (every score -Inf: a fully masked row, whose output torch's SDPA makes 0 x v) */
static int st_attn_softmax(float* s, int64_t L, float* inv) {
    float m = -INFINITY;
    int bad = 0;
    for (int64_t j = 0; j < L; j++) {
        bad |= s[j] != s[j];
        m = s[j] > m ? s[j] : m;
    }
    if (bad || m == INFINITY) return 1;
    if (m == -INFINITY) return 2;
    float sum = 0.0f;
#pragma omp simd reduction(+:sum)
    for (int64_t j = 0; j < L; j++) {
        const float e = st_expf(s[j] - m);
        s[j] = e;
        sum += e;
    }
    *inv = 1.0f / sum;
    return 0;
}

#ifdef _OPENMP
#include <omp.h>
#define ST_TID() omp_get_thread_num()
#define ST_NTH() omp_get_num_threads()
#else
#define ST_TID() 0
#define ST_NTH() 1
#endif

/* The scores (unscaled) of 4 query rows q0..q3 against key rows k0..k3 (the same row for rows
   of one key-value head), nc vectors of 8 each */
static inline ST_AT256 __m128 st_attn_dot4_256(const float* q0, const float* q1, const float* q2, const float* q3,
                                               const float* k0, const float* k1, const float* k2, const float* k3,
                                               int nc) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int c = 0; c < nc; c++) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 8 * c), _mm256_loadu_ps(k0 + 8 * c), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + 8 * c), _mm256_loadu_ps(k1 + 8 * c), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + 8 * c), _mm256_loadu_ps(k2 + 8 * c), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + 8 * c), _mm256_loadu_ps(k3 + 8 * c), a3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
/* the same for 4 rows of one head: one key row, loaded once */
static inline ST_AT256 __m128 st_attn_dot4k_256(const float* q0, const float* q1, const float* q2, const float* q3,
                                                const float* kj, int nc) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int c = 0; c < nc; c++) {
        const __m256 kv = _mm256_loadu_ps(kj + 8 * c);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 8 * c), kv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + 8 * c), kv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + 8 * c), kv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + 8 * c), kv, a3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* The AVX2 kernel for a cache laid out positions outermost (kv_append's: all heads of a
   position together, a head's rows 2 KB or more apart, which ST_ATTN_FNS's (head, rows) tasks
   read 1.4x slower than a contiguous head even from L3): the positions are cut into chunks of
   ST_CH, the threads take runs of whole chunks, so that each reads its share of the cache as one
   run of memory. Per batch, in one parallel region: (1) the scores of every query row at the
   chunk's positions, kept position-major (s[j * R + r], R = H * M rows), masked; (2) per chunk,
   each row's largest score and NaN flag, combined; (3) exp(s - max) in place and the chunk's
   sums; (4) the chunk's weighted sums of the value rows, ST_JB positions at a time (8 vectors of
   a row in registers while the block's value rows, in L1, pass); (5) per row, the chunks' sums
   added in chunk order and scaled. A row's softmax is st_attn_softmax's (the same largest score
   and exp); its sums are added in another order, fixed by the chunks, so the result does not
   depend on the thread count. */
#define ST_JB 8
#define ST_CH 32
static ST_AT256 void st_decode_attention_avx2(
        const float* q, const float* k, const float* v, float* o, int64_t B, int64_t H, int64_t G, int64_t M,
        int64_t L, int64_t D, int64_t qb, int64_t qh, int64_t qi, int64_t kb, int64_t kh, int64_t kl,
        int64_t vb, int64_t vh, int64_t vl, float scale, const void* mask, int mask_kind, int64_t mb,
        int64_t mh, int64_t mi, int64_t ml, int nt, int par, float* scratch) {
    const int64_t R = H * M, GR = G * M, nc = D / 8, esize = mask_kind == 1 ? 1 : 4;
    const int64_t chunks = (L + ST_CH - 1) / ST_CH;
    const int64_t per_c = (R * (3 + D) + 15) / 16 * 16;   /* (a chunk's block, whole cache lines) */
    float* s = scratch;                   /* L * R scores, then weights */
    float* part = s + (L * R + 15) / 16 * 16;   /* per chunk: R maxima, R NaN flags, R sums, R x D sums of v */
    float* mx = part + chunks * per_c;    /* R: each row's largest score */
    int* state = (int*)(mx + R);          /* R: 0, 1 (NaN row) or 2 (a row of zeros) */
    int64_t* qoff = (int64_t*)(((uintptr_t)(state + R) + 7) & ~(uintptr_t)7);   /* R: rows' offsets in q, and */
    int64_t* moff = qoff + R;                                                     /* in the mask */
    for (int64_t r = 0; r < R; r++) {   /* row r: head r / M, query row r % M (a group's rows are together) */
        qoff[r] = (r / M) * qh + (r % M) * qi;
        moff[r] = (r / M) * mh + (r % M) * mi;
    }
    for (int64_t b = 0; b < B; b++) {
        const float* qbp = q + b * qb;
        const float* kbp = k + b * kb;
        const float* vbp = v + b * vb;
        const char* mbp = (const char*)mask + b * mb * esize;
#pragma omp parallel num_threads(nt) if(par)
        {
            /* (1) scores, and (2) each chunk's maxima and NaN flags */
#pragma omp for schedule(static)
            for (int64_t c = 0; c < chunks; c++) {
                float* pmax = part + c * per_c;
                float* pbad = pmax + R;
                for (int64_t r = 0; r < R; r++) { pmax[r] = -INFINITY; pbad[r] = 0.0f; }
                const int64_t j1 = (c + 1) * ST_CH < L ? (c + 1) * ST_CH : L;
                for (int64_t j = c * ST_CH; j < j1; j++) {
                    float* sj = s + j * R;
                    const float* kj = kbp + j * kl;
                    for (int64_t g = 0; g < H / G; g++) ST_ATTN_PREFETCH(kj + g * kh, 8 * kl, D);
                    for (int64_t r0 = 0; r0 < R; r0 += 4) {   /* 4 rows at a time, each with its head's key row */
                        const float* qr[4];
                        const float* kr[4];
                        for (int u = 0; u < 4; u++) {
                            const int64_t r = r0 + u < R ? r0 + u : R - 1;   /* (past R: repeated, not stored) */
                            qr[u] = qbp + qoff[r];
                            kr[u] = kj + (r / GR) * kh;
                        }
                        const __m128 t = _mm_mul_ps(kr[0] == kr[3]
                            ? st_attn_dot4k_256(qr[0], qr[1], qr[2], qr[3], kr[0], (int)nc)
                            : st_attn_dot4_256(qr[0], qr[1], qr[2], qr[3], kr[0], kr[1], kr[2], kr[3], (int)nc),
                            _mm_set1_ps(scale));
                        if (r0 + 4 <= R) {
                            _mm_storeu_ps(sj + r0, t);
                        } else {
                            float tt[4];
                            _mm_storeu_ps(tt, t);
                            for (int64_t u = 0; r0 + u < R; u++) sj[r0 + u] = tt[u];
                        }
                    }
                    if (mask_kind == 1)
                        for (int64_t r = 0; r < R; r++) sj[r] = *(const uint8_t*)(mbp + moff[r] + j * ml) ? sj[r] : sj[r] - INFINITY;
                    else if (mask_kind == 2)
                        for (int64_t r = 0; r < R; r++) sj[r] += *(const float*)(mbp + (moff[r] + j * ml) * 4);
#pragma omp simd
                    for (int64_t r = 0; r < R; r++) {
                        pbad[r] = sj[r] != sj[r] ? 1.0f : pbad[r];
                        pmax[r] = sj[r] > pmax[r] ? sj[r] : pmax[r];
                    }
                }
            }
#pragma omp single
            for (int64_t r = 0; r < R; r++) {
                float m = -INFINITY;
                int bad = 0;
                for (int64_t c = 0; c < chunks; c++) {
                    const float pm = part[c * per_c + r];
                    bad |= part[c * per_c + R + r] != 0.0f;
                    m = pm > m ? pm : m;
                }
                state[r] = bad || m == INFINITY ? 1 : m == -INFINITY ? 2 : 0;
                mx[r] = state[r] ? 0.0f : m;   /* (a NaN row is written at the end; a row of zeros gets weights 0) */
            }
            /* (3) the weights exp(s - max) and each chunk's sums; (4) its weighted sums of v */
#pragma omp for schedule(static)
            for (int64_t c = 0; c < chunks; c++) {
                float* psum = part + c * per_c + 2 * R;
                float* pout = psum + R;
                const int64_t j0c = c * ST_CH, j1c = (c + 1) * ST_CH < L ? (c + 1) * ST_CH : L;
                for (int64_t r = 0; r < R; r++) psum[r] = 0.0f;
                for (int64_t i = 0; i < R * D; i++) pout[i] = 0.0f;
                for (int64_t j = j0c; j < j1c; j++) {
                    float* sj = s + j * R;
#pragma omp simd
                    for (int64_t r = 0; r < R; r++) {
                        const float e = state[r] ? 0.0f : st_expf(sj[r] - mx[r]);
                        sj[r] = e;
                        psum[r] += e;
                    }
                }
                for (int64_t j0 = j0c; j0 < j1c; j0 += ST_JB) {
                    const int64_t j1 = j0 + ST_JB < j1c ? j0 + ST_JB : j1c;
                    for (int64_t g = 0; g < H / G; g++) {
                        const float* vg = vbp + g * vh;
                        for (int64_t j = j0; j < j1; j++) ST_ATTN_PREFETCH(vg + j * vl, 8 * vl, D);
                        for (int64_t row = 0; row < GR; row++) {
                            const int64_t r = g * GR + row;
                            for (int64_t c0 = 0; c0 < nc; c0 += 8) {   /* 8 vectors of the row at a time */
                                __m256 acc[8];
                                float* po = pout + r * D + 8 * c0;
                                for (int u = 0; u < 8; u++) acc[u] = _mm256_loadu_ps(po + 8 * u);
                                for (int64_t j = j0; j < j1; j++) {
                                    const __m256 w = _mm256_broadcast_ss(s + j * R + r);
                                    const float* vj = vg + j * vl + 8 * c0;
                                    for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 8 * u), acc[u]);
                                }
                                for (int u = 0; u < 8; u++) _mm256_storeu_ps(po + 8 * u, acc[u]);
                            }
                        }
                    }
                }
            }
            /* (5) the rows: the chunks' sums added in chunk order, scaled by 1 / sum */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < R; r++) {
                float* orow = o + (b * R + r) * D;
                if (state[r] == 1) {
                    for (int64_t d = 0; d < D; d++) orow[d] = NAN;
                    continue;
                }
                float sum = 0.0f;
                for (int64_t c = 0; c < chunks; c++) sum += part[c * per_c + 2 * R + r];
                /* (a row masked entirely: its weights are zeros, its sums 0 x v, zeros or NaN where
                   v holds NaN or an infinity, as torch's) */
                const __m256 iv = _mm256_set1_ps(state[r] ? 1.0f : 1.0f / sum);
                for (int64_t u = 0; u < nc; u++) {
                    __m256 a = _mm256_loadu_ps(part + 3 * R + r * D + 8 * u);
                    for (int64_t c = 1; c < chunks; c++) a = _mm256_add_ps(a, _mm256_loadu_ps(part + c * per_c + 3 * R + r * D + 8 * u));
                    _mm256_storeu_ps(orow + 8 * u, _mm256_mul_ps(a, iv));
                }
            }
        }
    }
}

#else
#define ST_ATTN_X86 0
#endif

/* o (B, H, M, D), contiguous, = softmax(scale * q . k^T + mask) @ v per (b, h, query row i),
   k and v at head h / G. Strides in elements, the last dimension contiguous; D (= Dv) 64 or
   128. The rows sharing a key-value head (G heads x M rows) go 4 at a time. mask: kind 0 none,
   1 bool (uint8), 2 float; element (b, h, i, j) at b * mb + h * mh + i * mi + j * ml.
   -1: no memory; -2: not these sizes, or neither AVX-512 nor AVX2+FMA here. */
int st_decode_attention(const float* q, const float* k, const float* v, float* o,
                        int64_t B, int64_t H, int64_t G, int64_t M, int64_t L, int64_t D, int64_t Dv,
                        int64_t qb, int64_t qh, int64_t qi, int64_t kb, int64_t kh, int64_t kl,
                        int64_t vb, int64_t vh, int64_t vl, float scale,
                        const void* mask, int32_t mask_kind, int64_t mb, int64_t mh, int64_t mi, int64_t ml,
                        int32_t nt) {
#if ST_ATTN_X86
    __builtin_cpu_init();
    const int wide = __builtin_cpu_supports("avx512f");
    if (!(wide || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        || D != Dv || (D != 64 && D != 128) || L <= 0 || M <= 0) return -2;
    const int64_t rows = G * M;   /* query rows per key-value head */
    const int nr_max = rows == 1 ? 1 : ST_RMAX;
    st_attn_scores_fn scores;
    st_attn_values_fn values;
    if (wide) {
        scores = nr_max == 4 ? (D == 64 ? st_attn_scores_512_4_4 : st_attn_scores_512_4_8)
                             : (D == 64 ? st_attn_scores_512_1_4 : st_attn_scores_512_1_8);
        values = nr_max == 4 ? (D == 64 ? st_attn_values_512_4_4 : st_attn_values_512_4_8)
                             : (D == 64 ? st_attn_values_512_1_4 : st_attn_values_512_1_8);
    } else if (kl <= kh || vl <= vh) {   /* a head's rows closer together than its heads: tasks by head */
        scores = nr_max == 4 ? (D == 64 ? st_attn_scores_256_4_8 : st_attn_scores_256_4_16)
                             : (D == 64 ? st_attn_scores_256_1_8 : st_attn_scores_256_1_16);
        values = nr_max == 4 ? (D == 64 ? st_attn_values_256_4_8 : st_attn_values_256_4_16)
                             : (D == 64 ? st_attn_values_256_1_8 : st_attn_values_256_1_16);
    } else {   /* positions outermost (kv_append's layout): the positions split among the threads */
        const int64_t R = H * M, chunks = (L + ST_CH - 1) / ST_CH;
        const size_t floats = (size_t)((L * R + 15) / 16 * 16 + chunks * ((R * (3 + D) + 15) / 16 * 16) + 6 * R + 16);
        float* scratch = (float*)malloc(floats * sizeof(float));
        if (!scratch) return -1;
        const int par = nt > 1 && chunks > 1 && B * H * M * L * (D + Dv) >= 32768;
        st_decode_attention_avx2(q, k, v, o, B, H, G, M, L, D, qb, qh, qi, kb, kh, kl, vb, vh, vl, scale,
                                 mask, mask_kind, mb, mh, mi, ml, nt, par, scratch);
        free(scratch);
        return 0;
    }
    const int64_t Hkv = H / G, groups = (rows + nr_max - 1) / nr_max, tasks = B * Hkv * groups;
    const int64_t esize = mask_kind == 1 ? 1 : 4;
    float* scratch = (float*)malloc((size_t)(tasks * nr_max * L) * sizeof(float));
    if (!scratch) return -1;
    const int par = nt > 1 && tasks > 1 && B * H * M * L * (D + Dv) >= 32768;
#pragma omp parallel for schedule(static) num_threads(nt) if(par)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t b = t / (Hkv * groups), g = (t / groups) % Hkv, r0 = (t % groups) * nr_max;
        const int nr = (int)(rows - r0 < nr_max ? rows - r0 : nr_max);
        const float* qr[ST_RMAX];
        float* orow[ST_RMAX];
        const char* mrow[ST_RMAX];
        float inv[ST_RMAX];
        int state[ST_RMAX];
        for (int r = 0; r < ST_RMAX; r++) {
            const int64_t row = r0 + (r < nr ? r : 0), h = g * G + row / M, i = row % M;
            qr[r] = q + b * qb + h * qh + i * qi;
            orow[r] = o + ((b * H + h) * M + i) * Dv;
            mrow[r] = (const char*)mask + (b * mb + h * mh + i * mi) * esize;
        }
        float* s = scratch + t * nr_max * L;
        const float* kp = k + b * kb + g * kh;
        const float* vp = v + b * vb + g * vh;
        scores(qr, kp, kl, L, scale, s);
        for (int r = 0; r < nr_max; r++) {
            if (mask_kind) st_attn_mask(s + r * L, L, mrow[r], mask_kind, ml);
            inv[r] = 0.0f;
            state[r] = st_attn_softmax(s + r * L, L, &inv[r]);
            if (state[r])   /* (its weights: zeros, so a row of zeros sums 0 x v; a NaN row is overwritten) */
                for (int64_t j = 0; j < L; j++) s[r * L + j] = 0.0f;
        }
        values(s, vp, vl, L, orow, inv, nr);
        for (int r = 0; r < nr; r++)   /* (a row of zeros keeps inv 0: 0 x its sums of 0 x v, zeros or NaN where v holds NaN or an infinity, as torch's) */
            if (state[r] == 1)
                for (int64_t d = 0; d < Dv; d++) orow[r][d] = NAN;
    }
    free(scratch);
    return 0;
#else
    (void)q; (void)k; (void)v; (void)o; (void)B; (void)H; (void)G; (void)M; (void)L; (void)D; (void)Dv;
    (void)qb; (void)qh; (void)qi; (void)kb; (void)kh; (void)kl; (void)vb; (void)vh; (void)vl; (void)scale;
    (void)mask; (void)mask_kind; (void)mb; (void)mh; (void)mi; (void)ml; (void)nt;
    return -2;
#endif
}
"""

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class _Kernel(toolchain.CheckedLibrary):
    """The compiled kernel, built on first use and checked against torch once."""

    def _load(self):
        lib = toolchain.load_library(_SOURCE.replace("@PRELUDE@", toolchain.prelude_source()))
        lib.st_decode_attention.argtypes = [_P, _P, _P, _P] + [_I64] * 16 + [ctypes.c_float, _P, _I32] \
            + [_I64] * 4 + [_I32]
        lib.st_decode_attention.restype = ctypes.c_int
        return lib

    def _self_check(self) -> str:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 6, 1, 64, generator=g), torch.randn(2, 2, 37, 64, generator=g),
                   torch.randn(2, 2, 37, 64, generator=g))
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        got = self.run(q, k, v, 1.0 / math.sqrt(64))
        if got is None:
            return "the kernel needs AVX-512 or AVX2 with FMA, which this CPU lacks"
        # and a cache laid out positions outermost (kv_append's), which AVX2 reads another way
        k2, v2 = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
        got2 = self.run(q, k2, v2, 1.0 / math.sqrt(64))
        ok = got2 is not None and all(torch.allclose(g, want, rtol=1e-4, atol=1e-5) for g in (got, got2))
        return "" if ok else "the kernel disagrees with torch"

    def run(self, q, k, v, scale: float, mask: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The kernel's result, or None where it does not run (no AVX-512 or AVX2, head sizes).
        ``mask``: None, or bool/float32 already expanded to ``(B, H, M, L)``."""
        b, h, m, d = q.shape
        hkv, n, dv = k.shape[1], k.shape[2], v.shape[3]
        out = torch.empty((b, h, m, dv), dtype=torch.float32)
        qs, ks, vs = q.stride(), k.stride(), v.stride()
        if mask is None:
            mptr, kind, ms = None, 0, (0, 0, 0, 0)
        else:
            mptr, kind, ms = mask.data_ptr(), 1 if mask.dtype is torch.bool else 2, mask.stride()
        rc = self._lib.st_decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), b, h, h // hkv,
                                           m, n, d, dv, qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1],
                                           vs[2], scale, mptr, kind, ms[0], ms[1], ms[2], ms[3],
                                           torch.get_num_threads())
        if rc == -1:
            raise MemoryError(f"decode attention: no memory for {b * h * m * n} scores")
        return out if rc == 0 else None


KERNEL = _Kernel()


class DecodeAttention:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, scale=scale, enable_gqa=enable_gqa)``
    (no dropout, not causal), by the C kernel for a few query rows (see the module doc)."""

    #: what the report says of its calls (they run as one call, not as generated kernels)
    extern_reason = "symtrace's decode-attention kernel (one call)"

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
        if not 1 <= lq <= MAX_ROWS or (kb, hkv, n) != tuple(v.shape[:3]) or kb != b or kd != d or v.shape[3] != d \
                or d not in (64, 128) or n == 0 or hkv == 0 or h % hkv or (h != hkv and not self.enable_gqa):
            return False
        if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1 or q.is_neg() or k.is_neg() or v.is_neg():
            return False   # (a negative view's memory holds the negated values)
        if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
            return False
        return KERNEL._ok is True or KERNEL.available()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self._applies(q, k, v):
            mask = _expanded_mask(attn_mask, q, k) if attn_mask is not None else None
            if attn_mask is None or mask is not None:
                scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
                out = KERNEL.run(q, k, v, scale, mask)
                if out is not None:
                    return out
        kwargs = {"attn_mask": attn_mask, "scale": self.scale}
        if self.enable_gqa:
            kwargs["enable_gqa"] = True
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    def fake_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The result's metadata on fake tensors (see :mod:`symtrace.graph.symbolic_shapes`)."""
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    def __repr__(self) -> str:
        return f"<decode_attention scale={self.scale} enable_gqa={self.enable_gqa}>"


def _expanded_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Optional[torch.Tensor]:
    """``mask`` as a ``(B, H, M, L)`` view (broadcast dimensions of stride 0), or None where
    the kernel does not take it (another dtype or device, not broadcastable)."""
    if mask.dtype not in (torch.bool, torch.float32) or not mask.is_cpu or not 2 <= mask.dim() <= 4:
        return None   # (torch's SDPA refuses a 1-d mask: so does the fallback)
    try:
        return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    except RuntimeError:
        return None


_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _mask_meta_ok(node: Node) -> bool:
    meta = node.meta.get("tensor_meta")
    return getattr(meta, "dtype", None) in (torch.bool, torch.float32) and len(getattr(meta, "shape", ())) <= 4


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
    """Rewrite ``gm``'s decode-step attention calls (see the module doc), in place; the names
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
        mask = bound.get("attn_mask")
        if mask is not None and not (isinstance(mask, Node) and _mask_meta_ok(mask)):
            continue
        if bound.get("dropout_p", 0.0) != 0.0 or _pinned(bound.get("is_causal", False)) is not False:
            continue
        scale, gqa = bound.get("scale"), bound.get("enable_gqa", False)
        if not (scale is None or type(scale) in (int, float)) or type(gqa) is not bool:
            continue
        meta = bound["query"].meta.get("tensor_meta")
        shape = getattr(meta, "shape", None)
        if shape is None or len(shape) != 4 or not isinstance(shape[2], int) or not 1 <= shape[2] <= MAX_ROWS \
                or shape[3] not in (64, 128) or getattr(meta, "dtype", None) is not torch.float32 \
                or getattr(getattr(meta, "device", None), "type", "cpu") != "cpu":
            continue
        kshape = getattr(bound["key"].meta.get("tensor_meta"), "shape", None)
        if kshape is None or len(kshape) != 4 or isinstance(kshape[2], int) and kshape[2] <= shape[2]:
            continue   # as many keys as queries: an encoder's attention, not a step over a cache
        if not KERNEL.available():   # (no AVX-512: torch's SDPA stays, the report says nothing false)
            break
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(DecodeAttention(None if scale is None else float(scale), gqa),
                                         (bound["query"], bound["key"], bound["value"])
                                         + ((mask,) if mask is not None else ()))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        notes.append(node.name)
    return notes
