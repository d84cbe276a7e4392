"""C source of the ``activations="int8"`` weight-only kernels (part of :func:`.woq_csrc.source`).

``y = round_activations(x) @ dequantize(W).T + bias`` for int4 weights or symmetric int8 ones (no
zero point), held in row blocks (``st_wptr``'s blocked layout, K a multiple of 32): ``x`` is
rounded per block of 32 inputs exactly as :func:`~symtrace.passes.quant.woq.round_activations`
does, the products of bytes are summed exactly in integers, and the int32 sums are scaled in
float32 once per block of 32 (``x``'s scale) and per group (the weight's scale and zero point).

* **AVX512-VNNI** (isa 3): ``vpdpbusd`` multiplies unsigned nibbles by signed int8, 4 rows x 16
  inputs per instruction.
* **AVX2** (isa 1 and 2): ``vpmaddubsw`` multiplies unsigned by signed bytes into pairs of int16
  (at most 2 x 127 x 127 for an int8 weight; for nibbles the low- and high-nibble pairs are added
  and then pairs of those by ``vphaddw``: at most 8 x 15 x 127; no saturation either way) and
  ``vpmaddwd`` by ones widens them to int32; a 4-row block's sums are folded into one vector
  with horizontal adds.

Symmetric int8 weights meet ``|x|`` with ``x``'s sign moved onto them (they must lie in
[-127, 127]: :mod:`.woq_cpu` checks once per weight).

``st_woq_linear_a8(plan, x, M, ldx, y, isa, nt)`` returns -1 (no memory), -2 (not such a weight,
or an isa without these kernels) or -3 (``x`` holds NaN or an infinity: the caller rounds in torch
and runs the float kernels).
"""
from __future__ import annotations

__all__ = ["SOURCE"]

SOURCE = r"""
#if ST_X86
#define T_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

/* x (K, a multiple of 32) rounded per block of 32: xq int8, xs[c] = amax / 127 (the block's
   scale); -3 when a block holds NaN or an infinity. As round_activations: q = rint(x * (127 /
   amax)) in float32, half to even (MXCSR's default), 0 for an all-zero block; x and amax are
   first scaled by 2^64 (exactly) where amax < 2^-64, so that 127 / amax cannot overflow. */
static T_VNNI int st_round_x(const float* x, int64_t K, int8_t* xq, float* xs) {
    const __m512 inf = _mm512_set1_ps(INFINITY);
    for (int64_t c = 0; c < K / 32; c++) {
        const __m512 a = _mm512_loadu_ps(x + 32 * c), b = _mm512_loadu_ps(x + 32 * c + 16);
        const __m512 aa = _mm512_abs_ps(a), ab = _mm512_abs_ps(b);
        if ((_mm512_cmp_ps_mask(aa, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(ab, inf, _CMP_LT_OQ)) != 0xFFFF) return -3;
        const float m = _mm512_reduce_max_ps(_mm512_max_ps(aa, ab));
        const float up = m < 0x1p-64f ? 0x1p64f : 1.0f;
        const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / (m * up) : 0.0f), upv = _mm512_set1_ps(up);
        xs[c] = m / 127.0f;
        _mm_storeu_si128((__m128i*)(xq + 32 * c),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(a, upv), inv))));
        _mm_storeu_si128((__m128i*)(xq + 32 * c + 16),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(b, upv), inv))));
    }
    return 0;
}

/* the two 16-byte halves of x's block c, each repeated in the 4 lanes of 128 bits (one per row
   of a 4-row weight block) */
ST_INLINE T_VNNI __m512i st_xhalf(const int8_t* xq, int64_t c, int h) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xq + 32 * c + 16 * h)));
}

/* xz[16 g + l]: sum over group g's blocks c of xs[c] * (the 8 inputs lane l of a row's sums
   covers): what the group's zero point times (q - z) takes off, per lane */
static T_VNNI void st_zero_terms(const st_woq* p, const int8_t* xq, const float* xs, float* xz) {
    const int64_t cpg = p->gs / 32, nc = p->K / 32;
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t g = 0; g < p->G; g++) {
        __m512 t = _mm512_setzero_ps();
        for (int64_t c = g * cpg; c < (g + 1) * cpg && c < nc; c++) {
            __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, st_xhalf(xq, c, 0));
            s = _mm512_dpbusd_epi32(s, ones, st_xhalf(xq, c, 1));
            t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(xs[c]), t);
        }
        _mm512_storeu_ps(xz + 16 * g, t);
    }
}

/* One 4-row block of W (rows n .. n+nr-1, nr <= 4; W int4 in row blocks) against MR rows of
   the rounded x (xq, xs, xz: those rows' bytes, block scales and zero terms, one row after the
   next): y[r * ldy + n + i] = round(x_r) . w_{n+i} + bias. Lane l of a row's sums belongs to
   W row l / 4. */
#define ST_A8_BLOCK(MR)                                                                                \
static T_VNNI void st_a8_block_##MR(const st_woq* p, const int8_t* xq, const float* xs, const float* xz, \
                                    const int64_t* rows, int nr, float* y, int64_t ldy, int64_t n) {    \
    const int64_t K = p->K, G = p->G, cpg = p->gs / 32, nc = K / 32;                                    \
    const __m512i m4 = _mm512_set1_epi8(15);                                                            \
    const __m512i lane_row = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);         \
    const char* w = st_wptr(p, n, 0);                                                                   \
    __m512 acc[MR];                                                                                     \
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();                                          \
    for (int64_t g = 0; g < G; g++) {                                                                   \
        __m512 ga[MR];                                                                                  \
        for (int r = 0; r < MR; r++) ga[r] = _mm512_setzero_ps();                                       \
        const int64_t c1 = (g + 1) * cpg < nc ? (g + 1) * cpg : nc;                                     \
        for (int64_t c = g * cpg; c < c1; c++) {                                                        \
            const __m512i wv = _mm512_loadu_si512(w + c * 64);                                          \
            __builtin_prefetch(w + c * 64 + ST_PF_AHEAD);                                               \
            const __m512i lo = _mm512_and_si512(wv, m4);                                                \
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);                          \
            for (int r = 0; r < MR; r++) {                                                              \
                __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, st_xhalf(xq + r * K, c, 0)); \
                s = _mm512_dpbusd_epi32(s, hi, st_xhalf(xq + r * K, c, 1));                             \
                ga[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(xs[r * nc + c]), ga[r]);  \
            }                                                                                           \
        }                                                                                               \
        const __m128 s4 = _mm_setr_ps(p->scale[rows[0] * G + g], p->scale[rows[1] * G + g],             \
                                      p->scale[rows[2] * G + g], p->scale[rows[3] * G + g]);            \
        const __m128 z4 = _mm_setr_ps(st_zero(p, rows[0], g), st_zero(p, rows[1], g),                   \
                                      st_zero(p, rows[2], g), st_zero(p, rows[3], g));                  \
        const __m512 sv = _mm512_permutexvar_ps(lane_row, _mm512_castps128_ps512(s4));                 \
        const __m512 zv = _mm512_permutexvar_ps(lane_row, _mm512_castps128_ps512(z4));                  \
        for (int r = 0; r < MR; r++) {                                                                  \
            ga[r] = _mm512_fnmadd_ps(zv, _mm512_loadu_ps(xz + r * G * 16 + 16 * g), ga[r]);             \
            acc[r] = _mm512_fmadd_ps(ga[r], sv, acc[r]);                                                \
        }                                                                                               \
    }                                                                                                   \
    for (int r = 0; r < MR; r++) {                                                                      \
        float t[16];                                                                                    \
        _mm512_storeu_ps(t, acc[r]);                                                                    \
        for (int i = 0; i < nr; i++)                                                                    \
            y[r * ldy + n + i] = ((t[4 * i] + t[4 * i + 1]) + (t[4 * i + 2] + t[4 * i + 3]))            \
                                 + (p->bias ? p->bias[n + i] : 0.0f);                                   \
    }                                                                                                   \
}
ST_A8_BLOCK(8)
ST_A8_BLOCK(4)
ST_A8_BLOCK(1)

/* The same for symmetric int8 W (values in [-127, 127], no zero point): a 128-byte chunk is 4
   rows x 32 inputs, two vectors of 2 rows each. vpdpbusd multiplies unsigned by signed bytes,
   so |x| meets w with x's sign moved onto it (w -> -w where x < 0; |w| <= 127 cannot
   overflow). Lane l of the first vector's sums belongs to W row l / 8, of the second to
   2 + l / 8. */
#define ST_A8_BLOCK8(MR)                                                                               \
static T_VNNI void st_a8_block8_##MR(const st_woq* p, const int8_t* xq, const float* xs,               \
                                     const int64_t* rows, int nr, float* y, int64_t ldy, int64_t n) {   \
    const int64_t K = p->K, G = p->G, cpg = p->gs / 32, nc = K / 32;                                    \
    const __m512i lane_row = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);         \
    const char* w = st_wptr(p, n, 0);                                                                   \
    __m512 acc[MR][2];                                                                                  \
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                           \
    for (int64_t g = 0; g < G; g++) {                                                                   \
        __m512 ga[MR][2];                                                                               \
        for (int r = 0; r < MR; r++) ga[r][0] = ga[r][1] = _mm512_setzero_ps();                         \
        const int64_t c1 = (g + 1) * cpg < nc ? (g + 1) * cpg : nc;                                     \
        for (int64_t c = g * cpg; c < c1; c++) {                                                        \
            const __m512i w01 = _mm512_loadu_si512(w + c * 128), w23 = _mm512_loadu_si512(w + c * 128 + 64); \
            __builtin_prefetch(w + c * 128 + ST_PF_AHEAD);                                              \
            __builtin_prefetch(w + c * 128 + 64 + ST_PF_AHEAD);                                         \
            for (int r = 0; r < MR; r++) {                                                              \
                const __m512i xb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(xq + r * K + 32 * c))); \
                const __mmask64 neg = _mm512_movepi8_mask(xb);                                          \
                const __m512i ax = _mm512_abs_epi8(xb);                                                 \
                const __m512i z = _mm512_setzero_si512();                                               \
                const __m512i s0 = _mm512_dpbusd_epi32(z, ax, _mm512_mask_sub_epi8(w01, neg, z, w01));  \
                const __m512i s1 = _mm512_dpbusd_epi32(z, ax, _mm512_mask_sub_epi8(w23, neg, z, w23));  \
                const __m512 xsc = _mm512_set1_ps(xs[r * nc + c]);                                      \
                ga[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), xsc, ga[r][0]);                      \
                ga[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), xsc, ga[r][1]);                      \
            }                                                                                           \
        }                                                                                               \
        const __m512 sv0 = _mm512_permutexvar_ps(lane_row, _mm512_castps128_ps512(_mm_setr_ps(         \
            p->scale[rows[0] * G + g], p->scale[rows[1] * G + g], 0.0f, 0.0f)));                        \
        const __m512 sv1 = _mm512_permutexvar_ps(lane_row, _mm512_castps128_ps512(_mm_setr_ps(         \
            p->scale[rows[2] * G + g], p->scale[rows[3] * G + g], 0.0f, 0.0f)));                        \
        for (int r = 0; r < MR; r++) {                                                                  \
            acc[r][0] = _mm512_fmadd_ps(ga[r][0], sv0, acc[r][0]);                                      \
            acc[r][1] = _mm512_fmadd_ps(ga[r][1], sv1, acc[r][1]);                                      \
        }                                                                                               \
    }                                                                                                   \
    for (int r = 0; r < MR; r++) {                                                                      \
        float t[32];                                                                                    \
        _mm512_storeu_ps(t, acc[r][0]);                                                                 \
        _mm512_storeu_ps(t + 16, acc[r][1]);                                                            \
        for (int i = 0; i < nr; i++) {                                                                  \
            const float* u = t + 8 * i;                                                                 \
            y[r * ldy + n + i] = (((u[0] + u[1]) + (u[2] + u[3])) + ((u[4] + u[5]) + (u[6] + u[7])))    \
                                 + (p->bias ? p->bias[n + i] : 0.0f);                                   \
        }                                                                                               \
    }                                                                                                   \
}
ST_A8_BLOCK8(4)
ST_A8_BLOCK8(1)

/* ST_A8_STREAMS whole 4-row blocks of W (rows ns[s] .. ns[s] + 3) against one row of the
   rounded x, their 32-input chunks taken in turn: that many sequential streams of the weight in
   flight at once, as st_a2_streams_1 does for AVX2. On a Xeon (Sapphire Rapids, 2 threads,
   weights from memory) one stream per thread read int8 and int4 weights at 21-22 GB/s and
   two at 26-29. Each row's arithmetic is st_a8_block_1's / st_a8_block8_1's, in the same order: the
   same bits. */
#define ST_A8_STREAMS 2
static T_VNNI void st_a8_streams_1(const st_woq* p, const int8_t* xq, const float* xs, const float* xz,
                                   float* y, const int64_t* ns) {
    const int64_t K = p->K, G = p->G, cpg = p->gs / 32, nc = K / 32;
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i lane_row = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const char* w[ST_A8_STREAMS];
    __m512 acc[ST_A8_STREAMS];
    for (int s = 0; s < ST_A8_STREAMS; s++) {
        w[s] = st_wptr(p, ns[s], 0);
        acc[s] = _mm512_setzero_ps();
    }
    for (int64_t g = 0; g < G; g++) {
        __m512 ga[ST_A8_STREAMS];
        for (int s = 0; s < ST_A8_STREAMS; s++) ga[s] = _mm512_setzero_ps();
        const int64_t c1 = (g + 1) * cpg < nc ? (g + 1) * cpg : nc;
        for (int64_t c = g * cpg; c < c1; c++) {
            const __m512i x0 = st_xhalf(xq, c, 0), x1 = st_xhalf(xq, c, 1);
            const __m512 xsc = _mm512_set1_ps(xs[c]);
            for (int s = 0; s < ST_A8_STREAMS; s++) {
                const __m512i wv = _mm512_loadu_si512(w[s] + c * 64);
                __builtin_prefetch(w[s] + c * 64 + ST_PF_AHEAD);
                const __m512i lo = _mm512_and_si512(wv, m4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);
                __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x0);
                d = _mm512_dpbusd_epi32(d, hi, x1);
                ga[s] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), xsc, ga[s]);
            }
        }
        const __m512 xzg = _mm512_loadu_ps(xz + 16 * g);
        for (int s = 0; s < ST_A8_STREAMS; s++) {
            const int64_t r = ns[s];
            const __m128 s4 = _mm_setr_ps(p->scale[r * G + g], p->scale[(r + 1) * G + g],
                                          p->scale[(r + 2) * G + g], p->scale[(r + 3) * G + g]);
            const __m128 z4 = _mm_setr_ps(st_zero(p, r, g), st_zero(p, r + 1, g),
                                          st_zero(p, r + 2, g), st_zero(p, r + 3, g));
            const __m512 sv = _mm512_permutexvar_ps(lane_row, _mm512_castps128_ps512(s4));
            const __m512 zv = _mm512_permutexvar_ps(lane_row, _mm512_castps128_ps512(z4));
            ga[s] = _mm512_fnmadd_ps(zv, xzg, ga[s]);
            acc[s] = _mm512_fmadd_ps(ga[s], sv, acc[s]);
        }
    }
    for (int s = 0; s < ST_A8_STREAMS; s++) {
        float t[16];
        _mm512_storeu_ps(t, acc[s]);
        for (int i = 0; i < 4; i++) {
            const int64_t n = ns[s] + i;
            y[n] = ((t[4 * i] + t[4 * i + 1]) + (t[4 * i + 2] + t[4 * i + 3])) + (p->bias ? p->bias[n] : 0.0f);
        }
    }
}
/* The same for symmetric int8 W (st_a8_block8_1's arithmetic, in its order) */
static T_VNNI void st_a8_streams8_1(const st_woq* p, const int8_t* xq, const float* xs, float* y, const int64_t* ns) {
    const int64_t K = p->K, G = p->G, cpg = p->gs / 32, nc = K / 32;
    const __m512i lane_row = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i z = _mm512_setzero_si512();
    const char* w[ST_A8_STREAMS];
    __m512 acc[ST_A8_STREAMS][2];
    for (int s = 0; s < ST_A8_STREAMS; s++) {
        w[s] = st_wptr(p, ns[s], 0);
        acc[s][0] = acc[s][1] = _mm512_setzero_ps();
    }
    for (int64_t g = 0; g < G; g++) {
        __m512 ga[ST_A8_STREAMS][2];
        for (int s = 0; s < ST_A8_STREAMS; s++) ga[s][0] = ga[s][1] = _mm512_setzero_ps();
        const int64_t c1 = (g + 1) * cpg < nc ? (g + 1) * cpg : nc;
        for (int64_t c = g * cpg; c < c1; c++) {
            const __m512i xb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(xq + 32 * c)));
            const __mmask64 neg = _mm512_movepi8_mask(xb);
            const __m512i ax = _mm512_abs_epi8(xb);
            const __m512 xsc = _mm512_set1_ps(xs[c]);
            for (int s = 0; s < ST_A8_STREAMS; s++) {
                const char* ws = w[s] + c * 128;
                const __m512i w01 = _mm512_loadu_si512(ws), w23 = _mm512_loadu_si512(ws + 64);
                __builtin_prefetch(ws + ST_PF_AHEAD);
                __builtin_prefetch(ws + 64 + ST_PF_AHEAD);
                const __m512i s0 = _mm512_dpbusd_epi32(z, ax, _mm512_mask_sub_epi8(w01, neg, z, w01));
                const __m512i s1 = _mm512_dpbusd_epi32(z, ax, _mm512_mask_sub_epi8(w23, neg, z, w23));
                ga[s][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), xsc, ga[s][0]);
                ga[s][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), xsc, ga[s][1]);
            }
        }
        for (int s = 0; s < ST_A8_STREAMS; s++) {
            const int64_t r = ns[s];
            const __m512 sv0 = _mm512_permutexvar_ps(lane_row, _mm512_castps128_ps512(_mm_setr_ps(
                p->scale[r * G + g], p->scale[(r + 1) * G + g], 0.0f, 0.0f)));
            const __m512 sv1 = _mm512_permutexvar_ps(lane_row, _mm512_castps128_ps512(_mm_setr_ps(
                p->scale[(r + 2) * G + g], p->scale[(r + 3) * G + g], 0.0f, 0.0f)));
            acc[s][0] = _mm512_fmadd_ps(ga[s][0], sv0, acc[s][0]);
            acc[s][1] = _mm512_fmadd_ps(ga[s][1], sv1, acc[s][1]);
        }
    }
    for (int s = 0; s < ST_A8_STREAMS; s++) {
        float t[32];
        _mm512_storeu_ps(t, acc[s][0]);
        _mm512_storeu_ps(t + 16, acc[s][1]);
        for (int i = 0; i < 4; i++) {
            const float* u = t + 8 * i;
            const int64_t n = ns[s] + i;
            y[n] = (((u[0] + u[1]) + (u[2] + u[3])) + ((u[4] + u[5]) + (u[6] + u[7]))) + (p->bias ? p->bias[n] : 0.0f);
        }
    }
}

/* rows n0 .. n1-1 (n0 a multiple of 4) of y (M, N) = round(x) @ dequantize(W).T + bias: each
   4-row block of W against the rows of x, BIG at a time, then MID, then 1 (int8 weights: 4,
   then 1; the block's weights stay in L1 while every row of x passes); PFX names the kernels */
#define ST_A8_GEMM(NAME, TARGET, PFX, BIG, MID)                                                        \
static TARGET void NAME(const st_woq* p, int64_t M, const int8_t* xq, const float* xs, const float* xz, \
                        float* y, int64_t n0, int64_t n1) {                                            \
    const int64_t K = p->K, nc = K / 32, G = p->G, N = p->N;                                            \
    for (int64_t n = n0; n < n1; n += 4) {                                                              \
        const int nr = n1 - n < 4 ? (int)(n1 - n) : 4;                                                  \
        int64_t rows[4];                                                                                \
        for (int r = 0; r < 4; r++) rows[r] = r < nr ? n + r : n;                                       \
        int64_t m = 0;                                                                                  \
        if (p->bits == 8) {                                                                             \
            for (; m + 4 <= M; m += 4) PFX##_block8_4(p, xq + m * K, xs + m * nc, rows, nr, y + m * N, N, n); \
            for (; m < M; m++) PFX##_block8_1(p, xq + m * K, xs + m * nc, rows, nr, y + m * N, N, n);   \
            continue;                                                                                   \
        }                                                                                               \
        for (; m + BIG <= M; m += BIG)                                                                  \
            PFX##_block_##BIG(p, xq + m * K, xs + m * nc, xz + m * G * 16, rows, nr, y + m * N, N, n);  \
        for (; m + MID <= M; m += MID)                                                                  \
            PFX##_block_##MID(p, xq + m * K, xs + m * nc, xz + m * G * 16, rows, nr, y + m * N, N, n);  \
        for (; m < M; m++)                                                                              \
            PFX##_block_1(p, xq + m * K, xs + m * nc, xz + m * G * 16, rows, nr, y + m * N, N, n);      \
    }                                                                                                   \
}
ST_A8_GEMM(st_gemm_a8_4, T_VNNI, st_a8, 8, 4)
#endif

#if ST_X86
#define T_A2 __attribute__((target("avx2,fma")))

/* st_round_x with AVX2 (the same numbers) */
static T_A2 int st_round_x_avx2(const float* x, int64_t K, int8_t* xq, float* xs) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 inf = _mm256_set1_ps(INFINITY);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  /* undo the packs' lane split */
    for (int64_t c = 0; c < K / 32; c++) {
        __m256 v[4], a[4];
        int finite = 0xFF;
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + 32 * c + 8 * j);
            a[j] = _mm256_and_ps(v[j], absm);
            finite &= _mm256_movemask_ps(_mm256_cmp_ps(a[j], inf, _CMP_LT_OQ));
        }
        if (finite != 0xFF) return -3;
        const __m256 mx = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float m = _mm_cvtss_f32(h);
        const float up = m < 0x1p-64f ? 0x1p64f : 1.0f;
        const __m256 inv = _mm256_set1_ps(m > 0.0f ? 127.0f / (m * up) : 0.0f), upv = _mm256_set1_ps(up);
        xs[c] = m / 127.0f;
        __m256i q[4];
        for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(v[j], upv), inv));
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i*)(xq + 32 * c), _mm256_permutevar8x32_epi32(b, order));
    }
    return 0;
}

/* One 32-input chunk of a 4-row int4 block against x's rounded chunk: lo01/hi01 hold rows 0
   and 1 (one per 128-bit half; low nibbles: inputs 0-15, high: 16-31), lo23/hi23 rows 2 and 3,
   xl/xh x's inputs 0-15 / 16-31 in both halves. Int32 lanes: 0-1 row 0, 2-3 row 2, 4-5 row 1,
   6-7 row 3; lane 2j + h (h = 0, 1) covers inputs 8h .. 8h+7 and 16+8h .. 16+8h+7. */
ST_INLINE T_A2 __m256i st_a2_dot4(__m256i lo01, __m256i hi01, __m256i lo23, __m256i hi23, __m256i xl, __m256i xh) {
    const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(lo01, xl), _mm256_maddubs_epi16(hi01, xh));
    const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(lo23, xl), _mm256_maddubs_epi16(hi23, xh));
    return _mm256_madd_epi16(_mm256_hadd_epi16(s01, s23), _mm256_set1_epi16(1));  /* |pair| <= 4 x 3810 */
}

ST_INLINE T_A2 __m256i st_a2_xhalf(const int8_t* xb, int h) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xb + 16 * h)));
}

/* xz[8 g + l] (rows of x G * 16 apart, as for VNNI): sum over group g's blocks c of xs[c] * (the inputs lane l of st_a2_dot4 covers) */
static T_A2 void st_zero_terms_avx2(const st_woq* p, const int8_t* xq, const float* xs, float* xz) {
    const int64_t cpg = p->gs / 32, nc = p->K / 32;
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t g = 0; g < p->G; g++) {
        __m256 t = _mm256_setzero_ps();
        for (int64_t c = g * cpg; c < (g + 1) * cpg && c < nc; c++) {
            const __m256i s = st_a2_dot4(ones, ones, ones, ones, st_a2_xhalf(xq + 32 * c, 0), st_a2_xhalf(xq + 32 * c, 1));
            t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(xs[c]), t);
        }
        _mm256_storeu_ps(xz + 8 * g, t);
    }
}

/* One 4-row int4 block of W (rows n .. n+nr-1) against MR rows of the rounded x, as
   st_a8_block_MR does with VNNI */
#define ST_A2_BLOCK(MR)                                                                                \
static T_A2 void st_a2_block_##MR(const st_woq* p, const int8_t* xq, const float* xs, const float* xz,  \
                                  const int64_t* rows, int nr, float* y, int64_t ldy, int64_t n) {      \
    const int64_t K = p->K, G = p->G, cpg = p->gs / 32, nc = K / 32;                                    \
    const __m256i m4 = _mm256_set1_epi8(15);                                                            \
    const char* w = st_wptr(p, n, 0);                                                                   \
    __m256 acc[MR];                                                                                     \
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();                                          \
    for (int64_t g = 0; g < G; g++) {                                                                   \
        __m256 ga[MR];                                                                                  \
        for (int r = 0; r < MR; r++) ga[r] = _mm256_setzero_ps();                                       \
        const int64_t c1 = (g + 1) * cpg < nc ? (g + 1) * cpg : nc;                                     \
        for (int64_t c = g * cpg; c < c1; c++) {                                                        \
            const __m256i w01 = _mm256_loadu_si256((const __m256i*)(w + c * 64));                       \
            const __m256i w23 = _mm256_loadu_si256((const __m256i*)(w + c * 64 + 32));                  \
            __builtin_prefetch(w + c * 64 + ST_PF_AHEAD);                                               \
            const __m256i lo01 = _mm256_and_si256(w01, m4), hi01 = _mm256_and_si256(_mm256_srli_epi16(w01, 4), m4); \
            const __m256i lo23 = _mm256_and_si256(w23, m4), hi23 = _mm256_and_si256(_mm256_srli_epi16(w23, 4), m4); \
            for (int r = 0; r < MR; r++) {                                                              \
                const int8_t* xb = xq + r * K + 32 * c;                                                 \
                const __m256i s = st_a2_dot4(lo01, hi01, lo23, hi23, st_a2_xhalf(xb, 0), st_a2_xhalf(xb, 1)); \
                ga[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(xs[r * nc + c]), ga[r]);  \
            }                                                                                           \
        }                                                                                               \
        const float s0 = p->scale[rows[0] * G + g], s1 = p->scale[rows[1] * G + g],                    \
                    s2 = p->scale[rows[2] * G + g], s3 = p->scale[rows[3] * G + g];                     \
        const float z0 = st_zero(p, rows[0], g), z1 = st_zero(p, rows[1], g),                           \
                    z2 = st_zero(p, rows[2], g), z3 = st_zero(p, rows[3], g);                           \
        const __m256 sv = _mm256_setr_ps(s0, s0, s2, s2, s1, s1, s3, s3);                               \
        const __m256 zv = _mm256_setr_ps(z0, z0, z2, z2, z1, z1, z3, z3);                               \
        for (int r = 0; r < MR; r++) {                                                                  \
            ga[r] = _mm256_fnmadd_ps(zv, _mm256_loadu_ps(xz + r * G * 16 + 8 * g), ga[r]);               \
            acc[r] = _mm256_fmadd_ps(ga[r], sv, acc[r]);                                                \
        }                                                                                               \
    }                                                                                                   \
    static const int first_lane[4] = {0, 4, 2, 6};                                                      \
    for (int r = 0; r < MR; r++) {                                                                      \
        float t[8];                                                                                     \
        _mm256_storeu_ps(t, acc[r]);                                                                    \
        for (int i = 0; i < nr; i++)                                                                    \
            y[r * ldy + n + i] = (t[first_lane[i]] + t[first_lane[i] + 1]) + (p->bias ? p->bias[n + i] : 0.0f); \
    }                                                                                                   \
}
ST_A2_BLOCK(4)
ST_A2_BLOCK(2)
ST_A2_BLOCK(1)

/* The same for symmetric int8 W: a 128-byte chunk is 4 rows x 32 inputs, one vector per row;
   |x| meets w with x's sign moved onto it (vpsignb). Int32 lanes after the horizontal adds:
   lane i and i + 4 belong to row i. */
#define ST_A2_BLOCK8(MR)                                                                               \
static T_A2 void st_a2_block8_##MR(const st_woq* p, const int8_t* xq, const float* xs,                 \
                                   const int64_t* rows, int nr, float* y, int64_t ldy, int64_t n) {     \
    const int64_t K = p->K, G = p->G, cpg = p->gs / 32, nc = K / 32;                                    \
    const __m256i ones = _mm256_set1_epi16(1);                                                          \
    const char* w = st_wptr(p, n, 0);                                                                   \
    __m256 acc[MR];                                                                                     \
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();                                          \
    for (int64_t g = 0; g < G; g++) {                                                                   \
        __m256 ga[MR];                                                                                  \
        for (int r = 0; r < MR; r++) ga[r] = _mm256_setzero_ps();                                       \
        const int64_t c1 = (g + 1) * cpg < nc ? (g + 1) * cpg : nc;                                     \
        for (int64_t c = g * cpg; c < c1; c++) {                                                        \
            __m256i wv[4];                                                                              \
            for (int i = 0; i < 4; i++) wv[i] = _mm256_loadu_si256((const __m256i*)(w + c * 128 + 32 * i)); \
            __builtin_prefetch(w + c * 128 + ST_PF_AHEAD);                                              \
            __builtin_prefetch(w + c * 128 + 64 + ST_PF_AHEAD);                                         \
            for (int r = 0; r < MR; r++) {                                                              \
                const __m256i xb = _mm256_loadu_si256((const __m256i*)(xq + r * K + 32 * c));           \
                const __m256i ax = _mm256_abs_epi8(xb);                                                 \
                __m256i d[4];                                                                           \
                for (int i = 0; i < 4; i++)                                                             \
                    d[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[i], xb)), ones); \
                const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3])); \
                ga[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(xs[r * nc + c]), ga[r]);  \
            }                                                                                           \
        }                                                                                               \
        const float s0 = p->scale[rows[0] * G + g], s1 = p->scale[rows[1] * G + g],                    \
                    s2 = p->scale[rows[2] * G + g], s3 = p->scale[rows[3] * G + g];                     \
        const __m256 sv = _mm256_setr_ps(s0, s1, s2, s3, s0, s1, s2, s3);                               \
        for (int r = 0; r < MR; r++) acc[r] = _mm256_fmadd_ps(ga[r], sv, acc[r]);                       \
    }                                                                                                   \
    for (int r = 0; r < MR; r++) {                                                                      \
        float t[8];                                                                                     \
        _mm256_storeu_ps(t, acc[r]);                                                                    \
        for (int i = 0; i < nr; i++) y[r * ldy + n + i] = (t[i] + t[i + 4]) + (p->bias ? p->bias[n + i] : 0.0f); \
    }                                                                                                   \
}
ST_A2_BLOCK8(4)
ST_A2_BLOCK8(1)

ST_A8_GEMM(st_gemm_a2, T_A2, st_a2, 4, 2)
/* ST_A2_STREAMS 4-row int4 blocks of W (rows ns[s] .. ns[s] + 3, each whole) against one row of
   the rounded x, their 32-input chunks taken in turn, so that as many sequential streams are in
   flight at once (the caller places the blocks far apart: each stream runs on through the blocks
   after its own). st_a2_block_1 reads one block after the other: a single stream, which this
   project's 2-core AMD EPYC serves more slowly than several; the 1B decoder's GEMVs took ~7%
   less time this way, and more streams (8) lost. The blocks' sums are independent chains too.
   Each row's arithmetic is st_a2_block_1's, in the same order, so the results are the same
   bits. */
#define ST_A2_STREAMS 4
#define ST_A2_UNIT 4
static T_A2 void st_a2_streams_1(const st_woq* p, const int8_t* xq, const float* xs, const float* xz,
                                 float* y, const int64_t* ns) {
    const int64_t G = p->G, cpg = p->gs / 32, nc = p->K / 32;
    const __m256i m4 = _mm256_set1_epi8(15);
    const char* w[ST_A2_STREAMS];
    for (int s = 0; s < ST_A2_STREAMS; s++) w[s] = st_wptr(p, ns[s], 0);
    __m256 acc[ST_A2_STREAMS];
    for (int s = 0; s < ST_A2_STREAMS; s++) acc[s] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 ga[ST_A2_STREAMS];
        for (int s = 0; s < ST_A2_STREAMS; s++) ga[s] = _mm256_setzero_ps();
        const int64_t c1 = (g + 1) * cpg < nc ? (g + 1) * cpg : nc;
        for (int64_t c = g * cpg; c < c1; c++) {
            const __m256i xl = st_a2_xhalf(xq + 32 * c, 0), xh = st_a2_xhalf(xq + 32 * c, 1);
            const __m256 xsc = _mm256_set1_ps(xs[c]);
            for (int s = 0; s < ST_A2_STREAMS; s++) {
                const char* ws = w[s] + c * 64;
                const __m256i w01 = _mm256_loadu_si256((const __m256i*)ws);
                const __m256i w23 = _mm256_loadu_si256((const __m256i*)(ws + 32));
                __builtin_prefetch(ws + ST_PF_AHEAD);
                const __m256i lo01 = _mm256_and_si256(w01, m4), hi01 = _mm256_and_si256(_mm256_srli_epi16(w01, 4), m4);
                const __m256i lo23 = _mm256_and_si256(w23, m4), hi23 = _mm256_and_si256(_mm256_srli_epi16(w23, 4), m4);
                ga[s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(st_a2_dot4(lo01, hi01, lo23, hi23, xl, xh)), xsc, ga[s]);
            }
        }
        const __m256 xzg = _mm256_loadu_ps(xz + 8 * g);
        for (int s = 0; s < ST_A2_STREAMS; s++) {
            const int64_t r = ns[s];
            const float s0 = p->scale[r * G + g], s1 = p->scale[(r + 1) * G + g],
                        s2 = p->scale[(r + 2) * G + g], s3 = p->scale[(r + 3) * G + g];
            const float z0 = st_zero(p, r, g), z1 = st_zero(p, r + 1, g), z2 = st_zero(p, r + 2, g),
                        z3 = st_zero(p, r + 3, g);
            const __m256 sv = _mm256_setr_ps(s0, s0, s2, s2, s1, s1, s3, s3);
            const __m256 zv = _mm256_setr_ps(z0, z0, z2, z2, z1, z1, z3, z3);
            acc[s] = _mm256_fmadd_ps(_mm256_fnmadd_ps(zv, xzg, ga[s]), sv, acc[s]);
        }
    }
    static const int first_lane[4] = {0, 4, 2, 6};
    for (int s = 0; s < ST_A2_STREAMS; s++) {
        float t[8];
        _mm256_storeu_ps(t, acc[s]);
        for (int i = 0; i < 4; i++) {
            const int64_t r = ns[s] + i;
            y[r] = (t[first_lane[i]] + t[first_lane[i] + 1]) + (p->bias ? p->bias[r] : 0.0f);
        }
    }
}
/* The same for symmetric int8 W (st_a2_block8_1's arithmetic, in its order) */
static T_A2 void st_a2_streams8_1(const st_woq* p, const int8_t* xq, const float* xs, float* y, const int64_t* ns) {
    const int64_t G = p->G, cpg = p->gs / 32, nc = p->K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    const char* w[ST_A2_STREAMS];
    for (int s = 0; s < ST_A2_STREAMS; s++) w[s] = st_wptr(p, ns[s], 0);
    __m256 acc[ST_A2_STREAMS];
    for (int s = 0; s < ST_A2_STREAMS; s++) acc[s] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 ga[ST_A2_STREAMS];
        for (int s = 0; s < ST_A2_STREAMS; s++) ga[s] = _mm256_setzero_ps();
        const int64_t c1 = (g + 1) * cpg < nc ? (g + 1) * cpg : nc;
        for (int64_t c = g * cpg; c < c1; c++) {
            const __m256i xb = _mm256_loadu_si256((const __m256i*)(xq + 32 * c));
            const __m256i ax = _mm256_abs_epi8(xb);
            const __m256 xsc = _mm256_set1_ps(xs[c]);
            for (int s = 0; s < ST_A2_STREAMS; s++) {
                const char* ws = w[s] + c * 128;
                __builtin_prefetch(ws + ST_PF_AHEAD);
                __builtin_prefetch(ws + 64 + ST_PF_AHEAD);
                __m256i d[4];
                for (int i = 0; i < 4; i++)
                    d[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(
                        _mm256_loadu_si256((const __m256i*)(ws + 32 * i)), xb)), ones);
                const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
                ga[s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), xsc, ga[s]);
            }
        }
        for (int s = 0; s < ST_A2_STREAMS; s++) {
            const int64_t r = ns[s];
            const float s0 = p->scale[r * G + g], s1 = p->scale[(r + 1) * G + g],
                        s2 = p->scale[(r + 2) * G + g], s3 = p->scale[(r + 3) * G + g];
            acc[s] = _mm256_fmadd_ps(ga[s], _mm256_setr_ps(s0, s1, s2, s3, s0, s1, s2, s3), acc[s]);
        }
    }
    for (int s = 0; s < ST_A2_STREAMS; s++) {
        float t[8];
        _mm256_storeu_ps(t, acc[s]);
        for (int i = 0; i < 4; i++) {
            const int64_t r = ns[s] + i;
            y[r] = (t[i] + t[i + 4]) + (p->bias ? p->bias[r] : 0.0f);
        }
    }
}
#endif

/* nonzero: st_woq_linear_a8 reads a GEMV's weight as one stream, the order before
   st_a8_streams_1 / st_a2_streams_1 and their int8 twins (benchmarks and tests compare the
   two; same bits) */
int st_a8_one_stream = 0;

/* y (M, N) = round_activations(x) @ dequantize(W).T + bias for int4 or symmetric int8 W in row
   blocks (K a multiple of 32; rows of x ldx apart). isa 3: the VNNI kernels; 1, 2: AVX2.
   -1: no memory; -2: not this build / not such a weight; -3: x holds NaN or inf. */
int st_woq_linear_a8(const st_woq* p, const float* x, int64_t M, int64_t ldx, float* y, int32_t isa, int32_t nt) {
#if ST_X86
    const int64_t N = p->N, K = p->K, nc = K / 32;
    if (!(p->bits == 4 || (p->bits == 8 && !p->zero && p->zdef == 0.0f)) || !p->blocked || K % 32 || p->gs % 32
        || K == 0 || isa < 1) return -2;
    if (N <= 0 || M <= 0) return 0;
    const int vnni = isa >= 3;
    /* per row of x: its bytes, block scales and zero terms (16 per group with VNNI, 8 with AVX2) */
    const size_t per_row = (size_t)K + (size_t)nc * sizeof(float) + (size_t)p->G * 16 * sizeof(float);
    int8_t* xq = (int8_t*)malloc((size_t)M * per_row + 64);
    if (!xq) return -1;
    float* xs = (float*)(((uintptr_t)(xq + M * K) + 63) & ~(uintptr_t)63);
    float* xz = xs + M * nc;
    int rc = 0;
    for (int64_t m = 0; m < M && rc == 0; m++) {
        int8_t* xqm = xq + m * K;
        float* xsm = xs + m * nc;
        rc = vnni ? st_round_x(x + m * ldx, K, xqm, xsm) : st_round_x_avx2(x + m * ldx, K, xqm, xsm);
        if (rc == 0 && p->bits == 4) {
            if (vnni) st_zero_terms(p, xqm, xsm, xz + m * p->G * 16);
            else st_zero_terms_avx2(p, xqm, xsm, xz + m * p->G * 16);
        }
    }
    if (rc == 0) {
        const int par = nt > 1 && M * N * K >= 65536;
        /* one row of x (a decode step's GEMV): the 4-row blocks cut into `streams` spans per
           thread (ST_A8_STREAMS with VNNI, ST_A2_STREAMS without); part t (thread t's spans)
           is read side by side, a 32-input chunk of each span in turn (st_a8_streams_1 /
           st_a8_streams8_1, st_a2_streams_1 / st_a2_streams8_1), and shared as st_take does,
           ST_A2_UNIT blocks of each span at a time; the rows after the last whole span shared
           out among the threads as one stream each */
        const int streams = vnni ? ST_A8_STREAMS : ST_A2_STREAMS;
        const int64_t tn = par ? nt : 1, spans = tn * streams, span = N / 4 / spans;
        int64_t* next = M == 1 && span > 0 && !st_a8_one_stream ? st_counters(tn) : 0;
        if (next) {
            const int64_t tail = 4 * spans * span, per = ((N - tail + 3) / 4 + tn - 1) / tn;
#pragma omp parallel for schedule(static) num_threads(nt) if(par)
            for (int64_t t = 0; t < tn; t++) {
                for (int64_t o = 0; o < tn; o++) {
                    const int64_t u = (t + o) % tn;   /* its own spans first, then the others' */
                    for (int64_t i0; (i0 = st_take(next, u, ST_A2_UNIT, span)) >= 0;) {
                        const int64_t i1 = i0 + ST_A2_UNIT < span ? i0 + ST_A2_UNIT : span;
                        for (int64_t i = i0; i < i1; i++) {
                            int64_t ns[ST_A2_STREAMS > ST_A8_STREAMS ? ST_A2_STREAMS : ST_A8_STREAMS];
                            for (int s = 0; s < streams; s++) ns[s] = 4 * ((u * streams + s) * span + i);
                            if (vnni && p->bits == 4) st_a8_streams_1(p, xq, xs, xz, y, ns);
                            else if (vnni) st_a8_streams8_1(p, xq, xs, y, ns);
                            else if (p->bits == 4) st_a2_streams_1(p, xq, xs, xz, y, ns);
                            else st_a2_streams8_1(p, xq, xs, y, ns);
                        }
                    }
                    if (o == 0) {
                        const int64_t n0 = tail + 4 * t * per, n1 = n0 + 4 * per < N ? n0 + 4 * per : N;
                        if (n0 < n1 && vnni) st_gemm_a8_4(p, M, xq, xs, xz, y, n0, n1);
                        else if (n0 < n1) st_gemm_a2(p, M, xq, xs, xz, y, n0, n1);
                    }
                }
            }
            free(next);
        } else {
            const int64_t blocks = (N + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(nt) if(par)
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t n0 = b * 16, n1 = b * 16 + 16 < N ? b * 16 + 16 : N;
                if (vnni) st_gemm_a8_4(p, M, xq, xs, xz, y, n0, n1);
                else st_gemm_a2(p, M, xq, xs, xz, y, n0, n1);
            }
        }
    }
    free(xq);
    return rc;
#else
    (void)p; (void)x; (void)M; (void)ldx; (void)y; (void)isa; (void)nt;
    return -2;
#endif
}
"""
