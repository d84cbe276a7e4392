"""C source of the weight-only int8/int4 Linear kernels used by :mod:`symtrace.lower.woq_cpu`.

``y = x @ dequantize(W).T + bias`` for float32 activations ``x`` (M, K) and weights stored as

* **int8**: ``(N, K)`` int8, row-major;
* **int4**: ``(N, 16 * ceil(K / 32))`` uint8, in blocks of 32 inputs: byte ``16 b + i`` of a row
  holds input ``32 b + i`` in its low nibble and input ``32 b + 16 + i`` in its high nibble
  (padding nibbles past ``K`` hold the zero point). A vector load of 16 (or 8) bytes unpacks
  to two runs of contiguous inputs with one AND and one shift;

with float32 scales ``(N, G)`` and optional zero points ``(N, G)`` (as float32 here; without
them 0 for int8 and 8 for int4), ``G`` groups of ``gs`` inputs along K (``gs`` a multiple of 32,
or ``gs = K`` and ``G = 1``: per output channel). A weight dequantizes exactly as the
reference does, ``w = ((float)q - z) * s`` in float32; the kernels multiply and sum in float32
in their own order (fused multiply-adds, vector lanes, K chunks), so results agree with
``dequantize-then-matmul`` to float32 rounding, and NaN/Inf in ``x`` propagate as in the
matmul (``inf * 0`` is NaN).

The kernels read weights through ``st_wptr``: row-major as stored, or (``blocked``; the AVX-512
and the ``activations="int8"`` kernels, where K is a multiple of 32, on a copy :mod:`.woq_cpu`
makes once) in blocks of 4 rows
whose 32-input chunks sit side by side, so that a GEMV reading 4 rows streams one run of memory.

* ``st_woq_linear(plan, x, M, ldx, y, isa, nt)`` -- M = 1 (decode): a GEMV that dequantizes in
  registers, R rows of W at a time sharing the loads of ``x`` and prefetching the rows two
  blocks ahead (cold weights stream at the copy bandwidth); M > 1 (prefill): a GEMM that
  dequantizes 4 rows x 512 inputs of W into a scratch block (in L1) once and multiplies every
  row of ``x`` against it with a 4 x 4 (AVX2: 4 x 2) register tile of dot products. Output rows
  are split over ``nt`` OpenMP threads (torch's pool; see ``docs/lowering.md``).
* ``st_woq_linear_a8(plan, x, M, ldx, y, isa, nt)`` -- ``activations="int8"``: int4 or symmetric
  int8 weights in row blocks against ``x`` rounded per block of 32 inputs, products summed in
  integers (AVX512-VNNI or AVX2; the kernels live in :mod:`.woq_a8_csrc`).
* ``st_woq_cpu_isa()`` -- what the CPU can run: 3 AVX-512 with VNNI (and BW), 2 AVX-512F,
  1 AVX2+FMA, 0 portable C.

The AVX2 and AVX-512 versions are compiled with ``__attribute__((target(...)))`` whatever the
build flags, and chosen at run time (``isa``, capped by :func:`st_woq_cpu_isa` in Python); the
portable version is plain C. All three are made from one template (:func:`source`).
"""
from __future__ import annotations

from .woq_a8_csrc import SOURCE as A8_SOURCE

__all__ = ["source", "ISAS"]

#: isa number -> name (the ``isa`` argument of ``st_woq_linear``; "avx512vnni" runs the AVX-512
#: float kernels, and ``st_woq_linear_a8`` besides)
ISAS = {0: "portable", 1: "avx2", 2: "avx512", 3: "avx512vnni"}

_HEADER = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__x86_64__) || defined(__i386__)
#define ST_X86 1
#include <immintrin.h>
#else
#define ST_X86 0
#endif
#define ST_KC 512          /* inputs per K chunk of the GEMM (4 rows x 512 x 4 B = 8 KB scratch) */
#define ST_INLINE static inline __attribute__((always_inline))

typedef struct {
    const void* w; const float* scale; const float* zero; const float* bias;
    int64_t N, K, G, gs, ldw;  /* ldw: bytes per row of w */
    float zdef;                /* the zero point when zero is NULL */
    int32_t bits;
    int32_t blocked;           /* w in row blocks (see st_wptr) */
} st_woq;

/* The 32 weights of row n from input k on (k a multiple of 32): 32 bytes (int8) or 16 (int4).
   Row-major, or blocked: rows in blocks of 4 (N padded), each block chunk after chunk of 32
   inputs with the 4 rows' chunks side by side, so that a GEMV reading 4 rows at a time
   streams one run of memory (the hardware prefetcher follows one stream, not 4 or 8). */
ST_INLINE const char* st_wptr(const st_woq* p, int64_t n, int64_t k) {
    if (p->blocked)
        return (const char*)p->w + (n >> 2) * 4 * p->ldw + (k >> 5) * 16 * p->bits + (n & 3) * 4 * p->bits;
    return (const char*)p->w + n * p->ldw + k * p->bits / 8;
}
#define ST_PF_AHEAD 2048   /* bytes ahead of a blocked stream to prefetch */
#ifndef ST_PIECE
#define ST_PIECE 16        /* blocks of 16 rows a GEMV thread takes at a time (st_take) */
#endif

/* How the GEMVs share their output rows among threads: thread t walks part t of tn first, a
   piece of `step` units at a time from part t's counter, then takes pieces from the other
   parts' counters, so that a thread the machine runs slower (its core busy, or slow to wake)
   does not hold up the call. The counters (st_counters: tn of them, 128 bytes apart (no two in
   one cache line, nor in an adjacent pair the hardware may fetch together), zero)
   hand out each piece once. st_take: the first unit of part u's next piece, or -1 when part u
   (len units) is done. */
static int64_t* st_counters(int64_t tn) { return (int64_t*)calloc((size_t)(16 * tn), sizeof(int64_t)); }
static inline int64_t st_take(int64_t* ctr, int64_t u, int64_t step, int64_t len) {
    int64_t i;
#pragma omp atomic capture
    { i = ctr[16 * u]; ctr[16 * u] += step; }
    return i < len ? i : -1;
}

int st_woq_cpu_isa(void) {
#if ST_X86 && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"))
        return 3;
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
}

ST_INLINE float st_zero(const st_woq* p, int64_t n, int64_t g) { return p->zero ? p->zero[n * p->G + g] : p->zdef; }

/* one weight, plain C (the kernels' tails): unscaled q - z, and dequantized (q - z) * s */
ST_INLINE float st_uw(const st_woq* p, int64_t n, int64_t k, int64_t g) {
    float q;
    const char* c = st_wptr(p, n, k & ~(int64_t)31);
    if (p->bits == 8) q = (float)((const int8_t*)c)[k & 31];
    else {
        const uint8_t b = ((const uint8_t*)c)[k & 15];
        q = (float)((k & 16) ? (b >> 4) : (b & 15));
    }
    return q - st_zero(p, n, g);
}
ST_INLINE float st_w(const st_woq* p, int64_t n, int64_t k, int64_t g) {
    return st_uw(p, n, k, g) * p->scale[n * p->G + g];
}
"""

# --- per-ISA vector vocabulary ---------------------------------------------------------------
_PORTABLE = r"""
typedef float V_@S@;
#define VL_@S@ 1
#define T_@S@
ST_INLINE V_@S@ vzero_@S@(void) { return 0.0f; }
ST_INLINE V_@S@ vset1_@S@(float a) { return a; }
ST_INLINE V_@S@ vload_@S@(const float* p) { return *p; }
ST_INLINE V_@S@ vfma_@S@(V_@S@ a, V_@S@ b, V_@S@ c) { return a * b + c; }
ST_INLINE void vstore_@S@(float* p, V_@S@ v) { *p = v; }
ST_INLINE float vsum_@S@(V_@S@ v) { return v; }
ST_INLINE void deq32_@S@_8(const st_woq* p, int64_t n, int64_t k, V_@S@ s, V_@S@ z, V_@S@* o) {
    const int8_t* w = (const int8_t*)st_wptr(p, n, k);
    for (int j = 0; j < 32; j++) o[j] = ((float)w[j] - z) * s;
}
ST_INLINE void deq32_@S@_4(const st_woq* p, int64_t n, int64_t k, V_@S@ s, V_@S@ z, V_@S@* o) {
    const uint8_t* w = (const uint8_t*)st_wptr(p, n, k);
    for (int j = 0; j < 16; j++) {
        o[j] = ((float)(w[j] & 15) - z) * s;
        o[j + 16] = ((float)(w[j] >> 4) - z) * s;
    }
}
/* unscaled weights q - z of 32 inputs (zc: the group's constant from zconst) */
typedef V_@S@ ZC_@S@;
ST_INLINE ZC_@S@ zconst_@S@_8(float z) { return z; }
ST_INLINE ZC_@S@ zconst_@S@_4(float z) { return z; }
ST_INLINE void uw32_@S@_8(const char* wp, ZC_@S@ z, V_@S@* o, int hz) {
    const int8_t* w = (const int8_t*)wp;
    for (int j = 0; j < 32; j++) o[j] = hz ? (float)w[j] - z : (float)w[j];
}
ST_INLINE void uw32_@S@_4(const char* wp, ZC_@S@ z, V_@S@* o, int hz) {
    (void)hz;
    const uint8_t* w = (const uint8_t*)wp;
    for (int j = 0; j < 16; j++) {
        o[j] = (float)(w[j] & 15) - z;
        o[j + 16] = (float)(w[j] >> 4) - z;
    }
}
"""

_AVX2 = r"""
#define T_@S@ __attribute__((target("avx2,fma")))
typedef __m256 V_@S@;
#define VL_@S@ 8
ST_INLINE T_@S@ V_@S@ vzero_@S@(void) { return _mm256_setzero_ps(); }
ST_INLINE T_@S@ V_@S@ vset1_@S@(float a) { return _mm256_set1_ps(a); }
ST_INLINE T_@S@ V_@S@ vload_@S@(const float* p) { return _mm256_loadu_ps(p); }
ST_INLINE T_@S@ V_@S@ vfma_@S@(V_@S@ a, V_@S@ b, V_@S@ c) { return _mm256_fmadd_ps(a, b, c); }
ST_INLINE T_@S@ void vstore_@S@(float* p, V_@S@ v) { _mm256_storeu_ps(p, v); }
ST_INLINE T_@S@ float vsum_@S@(V_@S@ v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}
ST_INLINE T_@S@ V_@S@ deq_@S@(__m256i q, V_@S@ s, V_@S@ z) { return _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(q), z), s); }
ST_INLINE T_@S@ void deq32_@S@_8(const st_woq* p, int64_t n, int64_t k, V_@S@ s, V_@S@ z, V_@S@* o) {
    const int8_t* w = (const int8_t*)st_wptr(p, n, k);
    for (int j = 0; j < 4; j++) o[j] = deq_@S@(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + 8 * j))), s, z);
}
ST_INLINE T_@S@ void deq32_@S@_4(const st_woq* p, int64_t n, int64_t k, V_@S@ s, V_@S@ z, V_@S@* o) {
    const uint8_t* w = (const uint8_t*)st_wptr(p, n, k);
    const __m256i m = _mm256_set1_epi32(15);
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)w));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w + 8)));
    o[0] = deq_@S@(_mm256_and_si256(a, m), s, z);
    o[1] = deq_@S@(_mm256_and_si256(b, m), s, z);
    o[2] = deq_@S@(_mm256_srli_epi32(a, 4), s, z);
    o[3] = deq_@S@(_mm256_srli_epi32(b, 4), s, z);
}
typedef V_@S@ ZC_@S@;
ST_INLINE T_@S@ ZC_@S@ zconst_@S@_8(float z) { return _mm256_set1_ps(z); }
ST_INLINE T_@S@ ZC_@S@ zconst_@S@_4(float z) { return _mm256_set1_ps(z); }
ST_INLINE T_@S@ V_@S@ uw_@S@(__m256i q, ZC_@S@ z) { return _mm256_sub_ps(_mm256_cvtepi32_ps(q), z); }
ST_INLINE T_@S@ void uw32_@S@_8(const char* wp, ZC_@S@ z, V_@S@* o, int hz) {
    const int8_t* w = (const int8_t*)wp;
    for (int j = 0; j < 4; j++) {
        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + 8 * j))));
        o[j] = hz ? _mm256_sub_ps(v, z) : v;
    }
}
ST_INLINE T_@S@ void uw32_@S@_4(const char* wp, ZC_@S@ z, V_@S@* o, int hz) {
    (void)hz;
    const uint8_t* w = (const uint8_t*)wp;
    const __m256i m = _mm256_set1_epi32(15);
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)w));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w + 8)));
    o[0] = uw_@S@(_mm256_and_si256(a, m), z);
    o[1] = uw_@S@(_mm256_and_si256(b, m), z);
    o[2] = uw_@S@(_mm256_srli_epi32(a, 4), z);
    o[3] = uw_@S@(_mm256_srli_epi32(b, 4), z);
}
"""

_AVX512 = r"""
#define T_@S@ __attribute__((target("avx512f,avx2,fma")))
typedef __m512 V_@S@;
#define VL_@S@ 16
ST_INLINE T_@S@ V_@S@ vzero_@S@(void) { return _mm512_setzero_ps(); }
ST_INLINE T_@S@ V_@S@ vset1_@S@(float a) { return _mm512_set1_ps(a); }
ST_INLINE T_@S@ V_@S@ vload_@S@(const float* p) { return _mm512_loadu_ps(p); }
ST_INLINE T_@S@ V_@S@ vfma_@S@(V_@S@ a, V_@S@ b, V_@S@ c) { return _mm512_fmadd_ps(a, b, c); }
ST_INLINE T_@S@ void vstore_@S@(float* p, V_@S@ v) { _mm512_storeu_ps(p, v); }
ST_INLINE T_@S@ float vsum_@S@(V_@S@ v) { return _mm512_reduce_add_ps(v); }
ST_INLINE T_@S@ V_@S@ deq_@S@(__m512i q, V_@S@ s, V_@S@ z) { return _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(q), z), s); }
ST_INLINE T_@S@ void deq32_@S@_8(const st_woq* p, int64_t n, int64_t k, V_@S@ s, V_@S@ z, V_@S@* o) {
    const int8_t* w = (const int8_t*)st_wptr(p, n, k);
    o[0] = deq_@S@(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)), s, z);
    o[1] = deq_@S@(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + 16))), s, z);
}
ST_INLINE T_@S@ void deq32_@S@_4(const st_woq* p, int64_t n, int64_t k, V_@S@ s, V_@S@ z, V_@S@* o) {
    const uint8_t* w = (const uint8_t*)st_wptr(p, n, k);
    __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)w));
    o[0] = deq_@S@(_mm512_and_si512(a, _mm512_set1_epi32(15)), s, z);
    o[1] = deq_@S@(_mm512_srli_epi32(a, 4), s, z);
}
/* int8: the zero point; int4: the 16 values q - z of a nibble, looked up with one permute */
typedef V_@S@ ZC_@S@;
ST_INLINE T_@S@ ZC_@S@ zconst_@S@_8(float z) { return _mm512_set1_ps(z); }
ST_INLINE T_@S@ ZC_@S@ zconst_@S@_4(float z) {
    return _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(z));
}
ST_INLINE T_@S@ void uw32_@S@_8(const char* wp, ZC_@S@ z, V_@S@* o, int hz) {
    const int8_t* w = (const int8_t*)wp;
    for (int j = 0; j < 2; j++) {
        __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + 16 * j))));
        o[j] = hz ? _mm512_sub_ps(v, z) : v;
    }
}
ST_INLINE T_@S@ void uw32_@S@_4(const char* wp, ZC_@S@ t, V_@S@* o, int hz) {
    (void)hz;
    const uint8_t* w = (const uint8_t*)wp;
    __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)w));
    o[0] = _mm512_permutexvar_ps(_mm512_and_si512(a, _mm512_set1_epi32(15)), t);
    o[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), t);
}
"""

# --- the kernels, written once over the vocabulary (@S@: isa, @B@: bits, @R@: GEMV rows per stream,
# @ST@: GEMV streams,
# @MR@ x @NR@: the GEMM register tile) ----------------------------------------------------------
_GEMV = r"""
/* GEMV: y[n] for rows n0 .. n1-1, one activation row x. Per (row, group): the sum of
   x * (q - z) in vector lanes, then times the group's scale into the row's accumulators.
   The rows go @R@ at a time from each of @ST@ streams: the range is cut into @ST@ parts (whole
   blocks of @R@ rows) walked side by side, so that @ST@ sequential runs of the weight are read at
   once. One run alone left the memory idle while a core converted and multiplied: on a Xeon
   (Sapphire Rapids, 2 threads, weights streamed from memory) the int8 GEMV read 18-20 GB/s with
   one stream per thread and 27-28 GB/s with two; a bare read loop reaches 33-35. */
static T_@S@ void gemv_@S@_@B@@ZN@(const st_woq* p, const float* x, float* y, int64_t n0, int64_t n1) {
    enum { NV = 32 / VL_@S@, RR = @R@ * @ST@ };
    const int64_t K = p->K, G = p->G, gs = p->gs;
    const int64_t part = ((n1 - n0 + RR - 1) / RR) * @R@;   /* rows per stream, whole blocks */
    for (int64_t i = 0; i < part; i += @R@) {
        int64_t rows[RR];
        int live[RR];          /* a row past its part (or past n1) repeats a live one, not stored */
        V_@S@ acc[RR];   /* (one per row: NV per row spilled the group sums to memory on AVX2) */
        float tail[RR];
        /* each row's first 32 weights and what to prefetch with them; the chunk of 32 inputs at k
           lies (k / 32) * step bytes on (both layouts: see st_wptr). Computed once here: the
           addresses computed per chunk in the loop cost more instructions than the vector work */
        const char* w0[RR];
        const char* pf0[RR];
        const int64_t step = p->blocked ? 16 * @B@ : 4 * @B@;
        for (int r = 0; r < RR; r++) {
            const int64_t own = n0 + (r / @R@) * part + i + r % @R@;
            const int64_t end = n0 + (r / @R@ + 1) * part < n1 ? n0 + (r / @R@ + 1) * part : n1;
            live[r] = own < end;
            rows[r] = live[r] ? own : n0 + i;
            w0[r] = st_wptr(p, rows[r], 0);
            /* blocked: the same stream further on; row-major: the row 2 blocks on */
            pf0[r] = p->blocked ? w0[r] + ST_PF_AHEAD
                : st_wptr(p, rows[r] + 2 * @R@ < p->N ? rows[r] + 2 * @R@ : p->N - 1, 0);
            tail[r] = 0.0f;
            acc[r] = vzero_@S@();
        }
        for (int64_t g = 0; g < G; g++) {
            const int64_t k0 = g * gs, k1 = k0 + gs < K ? k0 + gs : K;
            ZC_@S@ zc[RR];
            V_@S@ ga[RR][NV];
            for (int r = 0; r < RR; r++) {
                zc[r] = zconst_@S@_@B@(st_zero(p, rows[r], g));
                for (int j = 0; j < NV; j++) ga[r][j] = vzero_@S@();
            }
            int64_t k = k0, off = (k0 >> 5) * step;
            for (; k + 32 <= k1; k += 32, off += step) {
                V_@S@ xv[NV];
                for (int j = 0; j < NV; j++) xv[j] = vload_@S@(x + k + j * VL_@S@);
                for (int r = 0; r < RR; r++) {
                    __builtin_prefetch(pf0[r] + off);
                    V_@S@ wv[NV];
                    uw32_@S@_@B@(w0[r] + off, zc[r], wv, @HZ@);
                    for (int j = 0; j < NV; j++) ga[r][j] = vfma_@S@(xv[j], wv[j], ga[r][j]);
                }
            }
            for (int r = 0; r < RR; r++) {  /* (all rows: constant bounds keep ga/acc in registers) */
                const V_@S@ s = vset1_@S@(p->scale[rows[r] * G + g]);
                for (int j = 0; j < NV; j++) acc[r] = vfma_@S@(ga[r][j], s, acc[r]);
            }
            if (k < k1)  /* the K tail (last group only) */
                for (int r = 0; r < RR; r++) {
                    if (!live[r]) continue;
                    float t = 0.0f;
                    for (int64_t kk = k; kk < k1; kk++) t += x[kk] * st_uw(p, rows[r], kk, g);
                    tail[r] += t * p->scale[rows[r] * G + g];
                }
        }
        for (int r = 0; r < RR; r++)
            if (live[r]) y[rows[r]] = vsum_@S@(acc[r]) + tail[r] + (p->bias ? p->bias[rows[r]] : 0.0f);
    }
}

"""

_GEMM = r"""
/* dequantized W[n, k0:k1] into dst (k0 a multiple of 32), zero-padded to a multiple of 32 */
static T_@S@ void deqrow_@S@_@B@(const st_woq* p, int64_t n, int64_t k0, int64_t k1, float* dst) {
    enum { NV = 32 / VL_@S@ };
    int64_t g = k0 / p->gs, next = (g + 1) * p->gs, k = k0;
    for (; k + 32 <= k1; k += 32) {
        while (k >= next) { g++; next += p->gs; }
        V_@S@ wv[NV];
        deq32_@S@_@B@(p, n, k, vset1_@S@(p->scale[n * p->G + g]), vset1_@S@(st_zero(p, n, g)), wv);
        for (int j = 0; j < NV; j++) vstore_@S@(dst + (k - k0) + j * VL_@S@, wv[j]);
    }
    for (; k < k1; k++) {
        while (k >= next) { g++; next += p->gs; }
        dst[k - k0] = st_w(p, n, k, g);
    }
    for (; (k - k0) % 32; k++) dst[k - k0] = 0.0f;
}

/* GEMM: y[:, n0 .. n1-1] for x (M, ldx), rows zero-padded to a multiple of 32 */
static T_@S@ void gemm_@S@_@B@(const st_woq* p, const float* x, int64_t ldx, int64_t M, float* y,
                                int64_t n0, int64_t n1) {
    float wbuf[@NR@ * ST_KC];
    const int64_t K = p->K, N = p->N;
    for (int64_t n = n0; n < n1; n += @NR@) {
        const int nr = n1 - n < @NR@ ? (int)(n1 - n) : @NR@;
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < nr; j++) y[m * N + n + j] = p->bias ? p->bias[n + j] : 0.0f;
        for (int64_t kc = 0; kc < K; kc += ST_KC) {
            const int64_t kl = K - kc < ST_KC ? K - kc : ST_KC, klv = (kl + 31) / 32 * 32;
            for (int j = 0; j < @NR@; j++) deqrow_@S@_@B@(p, j < nr ? n + j : n, kc, kc + kl, wbuf + j * ST_KC);
            for (int64_t m = 0; m < M; m += @MR@) {
                const int mr = M - m < @MR@ ? (int)(M - m) : @MR@;
                const float* xr[@MR@];
                V_@S@ acc[@MR@][@NR@];
                for (int i = 0; i < @MR@; i++) {
                    xr[i] = x + (i < mr ? m + i : m) * ldx + kc;
                    for (int j = 0; j < @NR@; j++) acc[i][j] = vzero_@S@();
                }
                for (int64_t k = 0; k < klv; k += VL_@S@) {
                    V_@S@ wv[@NR@];
                    for (int j = 0; j < @NR@; j++) wv[j] = vload_@S@(wbuf + j * ST_KC + k);
                    for (int i = 0; i < @MR@; i++) {
                        const V_@S@ xv = vload_@S@(xr[i] + k);
                        for (int j = 0; j < @NR@; j++) acc[i][j] = vfma_@S@(xv, wv[j], acc[i][j]);
                    }
                }
                for (int i = 0; i < mr; i++)
                    for (int j = 0; j < nr; j++) y[(m + i) * N + n + j] += vsum_@S@(acc[i][j]);
            }
        }
    }
}
"""

_ENTRY = r"""
typedef void (*st_gemv_fn)(const st_woq*, const float*, float*, int64_t, int64_t);
typedef void (*st_gemm_fn)(const st_woq*, const float*, int64_t, int64_t, float*, int64_t, int64_t);

/* y (M, N) = x (M, K; rows ldx apart) @ dequantize(W).T + bias. isa: 0 portable, 1 AVX2,
   2 AVX-512 (the caller caps it by st_woq_cpu_isa()). Returns -1 when a temporary cannot be
   allocated, -2 for an isa this build lacks. */
int st_woq_linear(const st_woq* p, const float* x, int64_t M, int64_t ldx, float* y, int32_t isa, int32_t nt) {
    const int64_t N = p->N, K = p->K;
    if (M <= 0 || N <= 0) return 0;
    if (K == 0) {
        for (int64_t i = 0; i < M * N; i++) y[i] = p->bias ? p->bias[i % N] : 0.0f;
        return 0;
    }
    st_gemv_fn gemv = 0;
    st_gemm_fn gemm = 0;
    if (isa == 3) isa = 2;  /* float activations: the AVX-512 kernels */
    const int z = p->zero != 0 || p->zdef != 0.0f;  /* int8 symmetric: no zero point to subtract */
    switch (isa * 8 + p->bits) {
        case 8: gemv = z ? gemv_portable_8_z : gemv_portable_8; gemm = gemm_portable_8; break;
        case 4: gemv = gemv_portable_4_z; gemm = gemm_portable_4; break;
#if ST_X86
        case 16: gemv = z ? gemv_avx2_8_z : gemv_avx2_8; gemm = gemm_avx2_8; break;
        case 12: gemv = gemv_avx2_4_z; gemm = gemm_avx2_4; break;
        case 24: gemv = z ? gemv_avx512_8_z : gemv_avx512_8; gemm = gemm_avx512_8; break;
        case 20: gemv = gemv_avx512_4_z; gemm = gemm_avx512_4; break;
#endif
        default: return -2;
    }
    const int par = nt > 1 && M * N * K >= 65536;
    if (M == 1) {   /* blocks of 16 output rows, ST_PIECE at a time, shared as st_take does */
        const int64_t blocks = (N + 15) / 16, tn = par ? nt : 1, per = (blocks + tn - 1) / tn;
        int64_t* next = st_counters(tn);
        if (!next) return -1;
#pragma omp parallel for schedule(static) num_threads(nt) if(par)
        for (int64_t t = 0; t < tn; t++)
            for (int64_t o = 0; o < tn; o++) {
                const int64_t u = (t + o) % tn, b0 = u * per, len = blocks - b0 < per ? blocks - b0 : per;
                for (int64_t i; (i = st_take(next, u, ST_PIECE, len)) >= 0;) {
                    const int64_t e = b0 + (i + ST_PIECE < len ? i + ST_PIECE : len);   /* (the piece's last block + 1) */
                    gemv(p, x, y, 16 * (b0 + i), 16 * e < N ? 16 * e : N);
                }
            }
        free(next);
        return 0;
    }
    const int64_t kp = (K + 31) / 32 * 32;
    float* xp = 0;
    if (kp != K || ldx != K) {  /* the GEMM reads whole vectors: rows padded with zeros */
        xp = (float*)malloc((size_t)(M * kp) * sizeof(float));
        if (!xp) return -1;
        for (int64_t m = 0; m < M; m++) {
            memcpy(xp + m * kp, x + m * ldx, (size_t)K * sizeof(float));
            memset(xp + m * kp + K, 0, (size_t)(kp - K) * sizeof(float));
        }
        x = xp;
        ldx = kp;
    }
    const int64_t blocks = (N + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(nt) if(par)
    for (int64_t b = 0; b < blocks; b++) gemm(p, x, ldx, M, y, b * 16, b * 16 + 16 < N ? b * 16 + 16 : N);
    free(xp);
    return 0;
}
"""

# isa name -> (vocabulary, GEMV rows per stream, GEMV streams, GEMM tile MR, NR)
_ISA_PARTS = {"portable": (_PORTABLE, 1, 1, 2, 2), "avx2": (_AVX2, 2, 1, 4, 2), "avx512": (_AVX512, 4, 2, 4, 4)}


def _instance(isa: str) -> str:
    vocab, r, streams, mr, nr = _ISA_PARTS[isa]
    text = vocab + "".join(_GEMM.replace("@B@", str(b)) for b in (8, 4))
    text += "".join(_GEMV.replace("@B@", str(b)).replace("@ZN@", zn).replace("@HZ@", hz)
                    for b, zn, hz in ((8, "", "0"), (8, "_z", "1"), (4, "_z", "1")))
    for key, val in (("@S@", isa), ("@R@", str(r)), ("@ST@", str(streams)), ("@MR@", str(mr)), ("@NR@", str(nr))):
        text = text.replace(key, val)
    return text


def source() -> str:
    """The whole translation unit (portable kernels always; AVX2/AVX-512/VNNI ones on x86; the
    ``activations="int8"`` kernels of :mod:`.woq_a8_csrc`)."""
    x86 = _instance("avx2") + _instance("avx512")
    return _HEADER + _instance("portable") + "#if ST_X86\n" + x86 + "#endif\n" + _ENTRY + A8_SOURCE
