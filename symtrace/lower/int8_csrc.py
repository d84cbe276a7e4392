"""C source of the int8 Linear kernels used by :mod:`symtrace.lower.int8_cpu`.

One translation unit, built by :func:`symtrace.lower.toolchain.load_library` (``-march=native``):

* ``st_int8_linear`` -- ``out = epilogue(x @ W.T)`` for uint8 (or int8, flipped to uint8 first)
  activations ``x`` (M, K) and int8 weights packed by :func:`pack_weight`'s layout, with
  exact int32 accumulation. The epilogue is the portable backend's, in float64:
  ``y = base[n] + (acc - x_zp * rowsum[n]) * mult[n]``, then either round half to even and
  clamp to ``[lo, hi]`` (uint8/int8 output), optionally dequantized again to float32
  (``(q - zp) * scale`` in float32, as ``dequantize_per_tensor``), or optional ReLU and a
  float32 result straight from the accumulator.
* ``st_int8_linear_f32`` -- the same for a float32 ``x`` quantized in the call with static
  parameters (``quantize_per_tensor``'s float32 arithmetic), so a graph's first Linear takes
  the float input directly.
* ``st_int8_quantize_dynamic`` -- per-tensor uint8 quantization of a float32 tensor from its own
  min/max, with the same arithmetic as the portable backend (float64 parameters, float32
  ``x * (1 / scale)``, round half to even).
* ``st_int8_dynamic_linear`` -- both of the above in one call.

Packed weights: ``G = ceil(N / 64)`` groups of 64 output channels, ``KG = ceil(K / 4)`` groups
of 4 inputs; byte ``((g * KG + kg) * 64 + c) * 4 + j`` holds ``W[64 g + c, 4 kg + j]`` (zero
outside ``W``). With AVX512-VNNI (checked at compile time: the library is built for the CPU it
runs on) the inner loop is one ``vpdpbusd`` per 16 outputs and 4 inputs; otherwise plain C.
Defining ``ST_INT8_GENERIC`` forces the plain-C path (used by the tests to check both).
"""

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) \
    && defined(__AVX512VNNI__) && !defined(ST_INT8_GENERIC)
#define ST_VNNI 1
#include <immintrin.h>
#else
#define ST_VNNI 0
#endif

#define ST_GW 64   /* output channels per packed group */
#define ST_MR 4    /* rows of x per register tile (16 zmm accumulators) */
#define ST_MS 64   /* rows of x per parallel task */
#define ST_KC 64   /* groups of 4 inputs per K chunk (64 x 256 B = 16 KB of packed weights) */
#define ST_INLINE static inline __attribute__((always_inline))

typedef struct {
    const int32_t* rowsum; const double* mult; const double* base;
    double lo, hi; int32_t xzp;
    int32_t mode; /* 0: uint8, 1: int8, 2: float32 from the accumulator, 3: float32 (q - dqz) * dqs */
    int32_t relu; void* out; int64_t N; float dqs, dqz;
} st_epi;

int st_int8_isa(void) { return ST_VNNI; }

/* one output value, plain C (also the reference for the vector epilogue) */
ST_INLINE void st_epi1(const st_epi* e, int64_t row, int64_t c, int32_t acc) {
    int32_t a = (int32_t)((uint32_t)acc - (uint32_t)e->xzp * (uint32_t)e->rowsum[c]);
    double y = e->base[c] + (double)a * e->mult[c];
    if (e->mode == 2) {
        if (e->relu && y < 0.0) y = 0.0;
        ((float*)e->out)[row * e->N + c] = (float)y;
        return;
    }
    y = nearbyint(y);
    if (!(y >= e->lo)) y = e->lo;   /* NaN -> lo, as the vector epilogue's max_pd (and fbgemm) */
    if (y > e->hi) y = e->hi;
    if (e->mode == 3) ((float*)e->out)[row * e->N + c] = ((float)(int32_t)y - e->dqz) * e->dqs;
    else if (e->mode == 0) ((uint8_t*)e->out)[row * e->N + c] = (uint8_t)(int32_t)y;
    else ((int8_t*)e->out)[row * e->N + c] = (int8_t)(int32_t)y;
}

#if ST_VNNI
ST_INLINE void st_epi16(const st_epi* e, int64_t row, int64_t c0, __m512i a) {
    int64_t n = e->N - c0;
    if (n <= 0) return;
    __mmask16 m = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
    a = _mm512_sub_epi32(a, _mm512_mullo_epi32(_mm512_set1_epi32(e->xzp), _mm512_loadu_si512(e->rowsum + c0)));
    __m512d a0 = _mm512_cvtepi32_pd(_mm512_castsi512_si256(a));
    __m512d a1 = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(a, 1));
    __m512d y0 = _mm512_add_pd(_mm512_loadu_pd(e->base + c0), _mm512_mul_pd(a0, _mm512_loadu_pd(e->mult + c0)));
    __m512d y1 = _mm512_add_pd(_mm512_loadu_pd(e->base + c0 + 8), _mm512_mul_pd(a1, _mm512_loadu_pd(e->mult + c0 + 8)));
    if (e->mode == 2) {
        if (e->relu) {  /* max(0, y): a NaN y passes through, as torch.relu */
            y0 = _mm512_max_pd(_mm512_setzero_pd(), y0);
            y1 = _mm512_max_pd(_mm512_setzero_pd(), y1);
        }
        __m512 f = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(y0)), _mm512_cvtpd_ps(y1), 1);
        _mm512_mask_storeu_ps((float*)e->out + row * e->N + c0, m, f);
        return;
    }
    __m512d lo = _mm512_set1_pd(e->lo), hi = _mm512_set1_pd(e->hi);
    y0 = _mm512_min_pd(_mm512_max_pd(_mm512_roundscale_pd(y0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
    y1 = _mm512_min_pd(_mm512_max_pd(_mm512_roundscale_pd(y1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtpd_epi32(y0)), _mm512_cvtpd_epi32(y1), 1);
    if (e->mode == 3) {
        __m512 f = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(e->dqz)), _mm512_set1_ps(e->dqs));
        _mm512_mask_storeu_ps((float*)e->out + row * e->N + c0, m, f);
        return;
    }
    _mm_mask_storeu_epi8((int8_t*)e->out + row * e->N + c0, m, _mm512_cvtepi32_epi8(q));
}

/* rows m0 .. m0+MR-1 of x against one packed group: 4 x 16 outputs per row in registers
   (named accumulators, not an array: GCC keeps those in zmm registers). acc += x(u8) . w(s8):
   with GCC the intrinsic costs a register copy per use (the accumulator is not tied), so
   inline assembly where the compiler takes it. */
#if defined(__GNUC__)
#define ST_DP(acc, a, b) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#else
#define ST_DP(acc, a, b) (acc) = _mm512_dpbusd_epi32((acc), (a), (b))
#endif
#define ST_BCAST(r, off, tailbytes) \
    if (MR > r) { \
        int32_t xw = 0; \
        memcpy(&xw, xr + r * K + (off), tailbytes); \
        xb = _mm512_set1_epi32(xw); \
        ST_DP(c##r##0, xb, w0); ST_DP(c##r##1, xb, w1); ST_DP(c##r##2, xb, w2); ST_DP(c##r##3, xb, w3); \
    }
#define ST_STEP(off, tailbytes, wptr) { \
        const int8_t* w = (wptr); \
        __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64); \
        __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192); \
        __m512i xb; \
        ST_BCAST(0, off, tailbytes) ST_BCAST(1, off, tailbytes) ST_BCAST(2, off, tailbytes) \
        ST_BCAST(3, off, tailbytes) \
    }
#define ST_DECL(r) __m512i c##r##0 = z, c##r##1 = z, c##r##2 = z, c##r##3 = z; \
    if (!first && MR > r) { \
        c##r##0 = _mm512_loadu_si512(buf + r * ST_GW); c##r##1 = _mm512_loadu_si512(buf + r * ST_GW + 16); \
        c##r##2 = _mm512_loadu_si512(buf + r * ST_GW + 32); c##r##3 = _mm512_loadu_si512(buf + r * ST_GW + 48); }
#define ST_STORE(r) if (MR > r) { \
        if (last) { \
            st_epi16(e, m0 + r, c0, c##r##0); st_epi16(e, m0 + r, c0 + 16, c##r##1); \
            st_epi16(e, m0 + r, c0 + 32, c##r##2); st_epi16(e, m0 + r, c0 + 48, c##r##3); \
        } else { \
            _mm512_storeu_si512(buf + r * ST_GW, c##r##0); _mm512_storeu_si512(buf + r * ST_GW + 16, c##r##1); \
            _mm512_storeu_si512(buf + r * ST_GW + 32, c##r##2); _mm512_storeu_si512(buf + r * ST_GW + 48, c##r##3); \
        } }

/* input groups kg0 .. kg1-1 of the tile; partial sums live in buf (MR x 64 int32) between chunks */
ST_INLINE void st_tile(const uint8_t* x, int64_t K, const int8_t* wg, int64_t m0, int64_t c0, const st_epi* e,
                       const int MR, int64_t kg0, int64_t kg1, int first, int last, int32_t* buf) {
    const __m512i z = _mm512_setzero_si512();
    ST_DECL(0) ST_DECL(1) ST_DECL(2) ST_DECL(3)
    const int64_t K4 = K / 4, kend = kg1 < K4 ? kg1 : K4;
    const uint8_t* xr = x + m0 * K;
    for (int64_t kg = kg0; kg < kend; kg++) ST_STEP(kg * 4, 4, wg + kg * 256)
    if ((K & 3) && kg1 > K4) ST_STEP(K4 * 4, (size_t)(K & 3), wg + K4 * 256)  /* partial group: weights are 0 past K */
    ST_STORE(0) ST_STORE(1) ST_STORE(2) ST_STORE(3)
}

/* rows ms0 .. ms1-1 (at most ST_MS) against one group, in K chunks of ST_KC groups of 4 inputs: a
   chunk of packed weights (16 KB) stays in L1 while every row tile uses it */
static void st_task(const uint8_t* x, int64_t K, const int8_t* wg, int64_t ms0, int64_t ms1, int64_t c0,
                    const st_epi* e) {
    int32_t buf[ST_MS * ST_GW];
    const int64_t KG = (K + 3) / 4;
    int64_t kc = 0;
    do {
        const int64_t kend = kc + ST_KC < KG ? kc + ST_KC : KG;
        const int first = kc == 0, last = kend == KG;
        for (int64_t m0 = ms0; m0 < ms1; m0 += ST_MR) {
            int32_t* b = buf + (m0 - ms0) * ST_GW;
            switch (ms1 - m0 < ST_MR ? (int)(ms1 - m0) : ST_MR) {
                case 4: st_tile(x, K, wg, m0, c0, e, 4, kc, kend, first, last, b); break;
                case 3: st_tile(x, K, wg, m0, c0, e, 3, kc, kend, first, last, b); break;
                case 2: st_tile(x, K, wg, m0, c0, e, 2, kc, kend, first, last, b); break;
                default: st_tile(x, K, wg, m0, c0, e, 1, kc, kend, first, last, b); break;
            }
        }
        kc = kend;
    } while (kc < KG);
}
#else
static void st_task(const uint8_t* x, int64_t K, const int8_t* wg, int64_t ms0, int64_t ms1, int64_t c0,
                    const st_epi* e) {
    const int64_t KG = (K + 3) / 4, m0 = ms0;
    for (int r = 0; r < ms1 - ms0; r++) {
        const uint8_t* xr = x + (m0 + r) * K;
        int32_t acc[ST_GW];
        for (int c = 0; c < ST_GW; c++) acc[c] = 0;
        for (int64_t kg = 0; kg < KG; kg++) {
            int32_t xv[4];
            for (int j = 0; j < 4; j++) {
                int64_t k = kg * 4 + j;
                xv[j] = k < K ? (int32_t)xr[k] : 0;
            }
            const int8_t* w = wg + kg * 256;
            for (int c = 0; c < ST_GW; c++)
                acc[c] += xv[0] * w[4 * c] + xv[1] * w[4 * c + 1] + xv[2] * w[4 * c + 2] + xv[3] * w[4 * c + 3];
        }
        for (int c = 0; c < ST_GW && c0 + c < e->N; c++) st_epi1(e, m0 + r, c0 + c, acc[c]);
    }
}
#endif

static void st_gemm(const uint8_t* x, int64_t M, int64_t K, const int8_t* wp, const st_epi* e, int nt) {
    const int64_t G = (e->N + ST_GW - 1) / ST_GW, KG = (K + 3) / 4, MS = (M + ST_MS - 1) / ST_MS;
    const int64_t tasks = G * MS;
    (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt) if(nt > 1 && M * e->N * K > 262144)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t g = t / MS, ms0 = (t % MS) * ST_MS, ms1 = ms0 + ST_MS < M ? ms0 + ST_MS : M;
        st_task(x, K, wp + g * KG * 256, ms0, ms1, g * ST_GW, e);
    }
}

/* Everything about one Linear call site that does not change between calls. */
typedef struct {
    const int8_t* wp; const int32_t* rowsum; const double* mult; const double* base;
    double lo, hi; int64_t N, K; int32_t mode, relu; double dqs, dqz;
} st_plan;

/* x: (M, K) uint8, or int8 (x_is_s8: flipped to uint8 x ^ 0x80 first, with xzp already + 128),
   out: (M, N). Returns -1 when the temporary for a flipped input cannot be allocated. */
int st_int8_linear(const st_plan* p, const uint8_t* x, int64_t M, int32_t x_is_s8, int32_t xzp, void* out,
                   int32_t nt) {
    st_epi e = {p->rowsum, p->mult, p->base, p->lo, p->hi, xzp, p->mode, p->relu, out, p->N,
                (float)p->dqs, (float)p->dqz};
    if (M <= 0 || p->N <= 0) return 0;
    if (!x_is_s8) { st_gemm(x, M, p->K, p->wp, &e, nt); return 0; }
    uint8_t* xu = (uint8_t*)malloc((size_t)(M * p->K) + 1);
    if (!xu) return -1;
    for (int64_t i = 0; i < M * p->K; i++) xu[i] = x[i] ^ 0x80u;
    st_gemm(xu, M, p->K, p->wp, &e, nt);
    free(xu);
    return 0;
}

/* q = clamp(round(x * inv) + zf, lo, hi) (+ 128 when flip: int8 values stored as uint8), all in
   float32 with round half to even, as quantize_per_tensor computes it for a float32 x */
static void st_quantize_static(const float* x, int64_t n, float inv, float zf, float lo, float hi, int flip,
                               uint8_t* q) {
    const float add = flip ? 128.0f : 0.0f;
    int64_t i = 0;
#if ST_VNNI
    const __m512 vinv = _mm512_set1_ps(inv), vz = _mm512_set1_ps(zf), vadd = _mm512_set1_ps(add);
    const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_add_ps(_mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, vz), vlo), vhi), vadd);
        _mm_storeu_si128((__m128i*)(q + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
    }
#endif
    for (; i < n; i++) {
        float v = nearbyintf(x[i] * inv) + zf;
        if (!(v >= lo)) v = lo;   /* NaN -> lo, as the vector loop's max_ps: no UB cast of NaN */
        if (v > hi) v = hi;
        q[i] = (uint8_t)(int32_t)(v + add);
    }
}

/* st_int8_linear for a float32 x (M, K), quantized first with x_inv = 1 / scale (as float32),
   zero point x_zp and range [lo, hi] (int8 values when lo < 0). Returns -1 when the temporary
   cannot be allocated. */
int st_int8_linear_f32(const st_plan* p, const float* x, int64_t M, double x_inv, int32_t x_zp, int32_t lo,
                       int32_t hi, void* out, int32_t nt) {
    if (M <= 0 || p->N <= 0) return 0;
    const int flip = lo < 0;
    const int64_t n = M * p->K;
    uint8_t stackbuf[8192];
    uint8_t* xq = n <= (int64_t)sizeof(stackbuf) ? stackbuf : (uint8_t*)malloc((size_t)n);
    if (!xq) return -1;
    st_quantize_static(x, n, (float)x_inv, (float)x_zp, (float)lo, (float)hi, flip, xq);
    st_epi e = {p->rowsum, p->mult, p->base, p->lo, p->hi, x_zp + (flip ? 128 : 0), p->mode, p->relu, out, p->N,
                (float)p->dqs, (float)p->dqz};
    st_gemm(xq, M, p->K, p->wp, &e, nt);
    if (xq != stackbuf) free(xq);
    return 0;
}

/* uint8 q = clamp(round(x * (float)(1 / scale)) + zp, 0, 255) with scale/zp from x's own range
   (widened to include 0); info[0] = scale, info[1] = zp. Returns -1 (nothing written) when x
   holds a NaN or an infinity. */
int st_int8_quantize_dynamic(const float* x, int64_t n, uint8_t* q, double* info) {
    if (n <= 0) { info[0] = 1.0; info[1] = 0.0; return 0; }
    float mn = x[0], mx = x[0];
    int bad = 0;
    int64_t i = 0;
#if ST_VNNI
    if (n >= 16) {
        __m512 vmn = _mm512_loadu_ps(x), vmx = vmn;
        __mmask16 nan = 0;
        for (; i + 16 <= n; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            vmn = _mm512_min_ps(vmn, v);
            vmx = _mm512_max_ps(vmx, v);
        }
        bad = nan != 0;
        mn = _mm512_reduce_min_ps(vmn);
        mx = _mm512_reduce_max_ps(vmx);
    }
#endif
    for (; i < n; i++) {
        float v = x[i];
        if (v != v) bad = 1;
        if (v < mn) mn = v;
        if (v > mx) mx = v;
    }
    if (bad || !isfinite(mn) || !isfinite(mx)) return -1;
    double lo = (0.0 < (double)mn) ? 0.0 : (double)mn;   /* Python: min(mn, 0.0) */
    double hi = (0.0 > (double)mx) ? 0.0 : (double)mx;   /* Python: max(mx, 0.0) */
    double scale = (hi - lo) / 255.0;
    if (1e-8 > scale) scale = 1e-8;
    double z = nearbyint(-lo / scale);
    if (0.0 > z) z = 0.0;
    if (255.0 < z) z = 255.0;
    const float inv = (float)(1.0 / scale), zf = (float)z;
    st_quantize_static(x, n, inv, zf, 0.0f, 255.0f, 0, q);  /* (adding 0 changes no value) */
    info[0] = scale;
    info[1] = z;
    return 0;
}

/* float x (M, K) -> dynamic uint8 -> int8 GEMM -> float32 out (M, N):
   y = base[n] + acc * (mult[n] * scale) with p->mult the weight scales and p->base the bias,
   optional ReLU. Returns -1 (nothing written) when x is not finite, -2 when the temporaries
   cannot be allocated (small ones live on the stack). */
int st_int8_dynamic_linear(const st_plan* p, const float* x, int64_t M, float* out, int32_t nt) {
    const int64_t N = p->N, K = p->K, NP = (N + ST_GW - 1) / ST_GW * ST_GW;
    uint8_t qstack[8192];
    double mstack[512], info[2];
    uint8_t* q = M * K <= (int64_t)sizeof(qstack) ? qstack : (uint8_t*)malloc((size_t)(M * K));
    double* mult = NP <= 512 ? mstack : (double*)malloc((size_t)NP * sizeof(double));
    int rc = 0;
    if (!q || !mult) rc = -2;
    else if (st_int8_quantize_dynamic(x, M * K, q, info) != 0) rc = -1;
    else {
        for (int64_t c = 0; c < NP; c++) mult[c] = p->mult[c] * info[0];
        st_epi e = {p->rowsum, mult, p->base, 0.0, 0.0, (int32_t)info[1], 2, p->relu, out, N, 1.0f, 0.0f};
        if (M > 0 && N > 0) st_gemm(q, M, K, p->wp, &e, nt);
    }
    if (q && q != qstack) free(q);
    if (mult && mult != mstack) free(mult);
    return rc;
}
"""
