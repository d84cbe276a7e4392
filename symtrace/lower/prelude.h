/* symtrace C math prelude (C99).
 *
 * The CPU code generator pastes this text at the top of every translation unit it compiles
 * (symtrace.lower.toolchain.prelude_source()). Kernels call these functions inside
 * `#pragma omp simd` loops, so every float function here is branch-free straight-line code
 * that GCC/clang inline (always_inline) and vectorise: no libm calls, selects instead of ifs.
 * The exceptions are st_powf (calls libm powf, so a loop using it stays scalar) and the double
 * versions (st_exp, st_log, ...), which call libm.
 *
 * Compile without -ffast-math / -ffinite-math-only: NaN, +-Inf and -0.0 are handled explicitly
 * and rely on IEEE semantics. Expected flags: -O3 -march=native -fno-math-errno
 * -fno-trapping-math -std=c99 (no FP contraction in ISO mode; fused multiply-adds are written
 * out with ST_FMAF where the target has them). Default rounding mode (nearest-even) assumed.
 *
 * Semantics follow torch (CPU, float32) unless noted:
 *   st_reluf(-0.0) = -0.0, st_reluf(NaN) = NaN              (torch.relu)
 *   st_maxf/st_minf propagate NaN (torch.maximum/minimum); for +0.0 vs -0.0 torch's answer
 *     depends on the tensor size and operand order, so these follow IEEE 754-2019 instead:
 *     max(-0,+0) = +0, min(-0,+0) = -0, whatever the order.
 *   st_signf(NaN) = 0, st_signf(-0.0) = +0.0                (torch.sign)
 *   st_roundf rounds half to even                            (torch.round)
 *   st_sqrtf is correctly rounded (torch 2.13's float32 sqrt is 1 ulp off on ~0.2% of inputs)
 *   st_erfcf is provided too (no cancellation: relative accuracy down to the subnormals).
 *   st_gelu_erff(+Inf) = +Inf (torch float64 agrees; torch float32 returns NaN) and
 *     st_gelu_erff(FLT_MAX) = FLT_MAX (torch float32 overflows to +Inf);
 *   st_gelu_erff(-Inf) = st_gelu_tanhf(-Inf) = st_siluf(-Inf) = NaN, as in torch.
 *   st_sigmoidf / st_siluf / st_gelu_*f keep their tiny tails (e.g. sigmoid(-100) =
 *     3.7e-44) where eager's 1/(1+exp(-x)) returns 0.
 *   st_gelu_tanhf computes x*sigmoid(2u), u = sqrt(2/pi)*(x + 0.044715x^3), which equals
 *     torch's 0.5x(1+tanh(u)) without its cancellation for x << 0.
 *   fp16/bf16 conversions are bit-exact against torch's vectorised CPU conversions, including
 *     NaN payloads (h2f quiets signalling NaNs, f2h keeps the top payload bits and sets the quiet
 *     bit, f2bf returns 0xFFFF for every NaN).
 *   float -> integer casts (st_f2i32f, st_f2u8, ...) are defined for NaN, +-Inf and
 *     out-of-range inputs and give eager's x86-64 answers (see "float -> integer casts");
 *     integer add/sub/mul/neg/abs wrap modulo 2^64 (st_addi, ...), never signed overflow.
 *   double -> float conversions (overflow to +-Inf, NaN kept) rely on IEC 60559 (C99 Annex F),
 *     which GCC and clang implement; nothing here relies on undefined behaviour.
 *
 * Measured accuracy: max error in float32 ulps against torch float64 references, over 2^22
 * random bit patterns plus dense ranges ([-120, 100], [-20, 20], [-1, 1], |x| < 1e-3), GCC 12.2,
 * -march=native on an AVX-512 CPU (with FMA; without FMA the numbers are within +-0.4):
 *   st_expf 0.97   st_expm1f 1.44   st_logf 0.81   st_log1pf 0.82   st_tanhf 1.50
 *   st_sigmoidf 2.37   st_siluf 3.18   st_erff 1.74 (absolute error 1.04e-7)   st_erfcf 3.64
 *   st_gelu_erff 5.45 (plus 3M points in [-15, 15])   st_sqrtf 0.50 (correctly rounded)   st_rsqrtf 1.49
 *   st_gelu_tanhf 13.3 for x >= -3; below, the rounding of u costs about 2.4*|2u| ulps
 *     (204 ulps at x = -10, where the result is 1.9e-37; eager returns 0 there).
 * Subnormal results are rounded once from the exact-scale value (same bounds, in units of 2^-149).
 */
#ifndef SYMTRACE_PRELUDE_H
#define SYMTRACE_PRELUDE_H

#include <math.h>
#include <stdint.h>

#if defined(__GNUC__) || defined(__clang__)
#define ST_INLINE static inline __attribute__((always_inline))
#else
#define ST_INLINE static inline
#endif

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

/* a*b+c with one rounding where the target has an FMA instruction, else two roundings. */
#if defined(__FP_FAST_FMAF) && (defined(__GNUC__) || defined(__clang__))
#define ST_FMAF(a, b, c) __builtin_fmaf((a), (b), (c))
#define ST_HAVE_FMAF 1
#else
#define ST_FMAF(a, b, c) ((a) * (b) + (c))
#define ST_HAVE_FMAF 0
#endif

#define ST__INFF (__builtin_inff())
#define ST__NANF (__builtin_nanf(""))

/* ---------------------------------------------------------------- bit casts ----------- */
typedef union { float f; uint32_t u; } st__fbits;
ST_INLINE uint32_t st__f2u(float x) { st__fbits b; b.f = x; return b.u; }
ST_INLINE float st__u2f(uint32_t u) { st__fbits b; b.u = u; return b.f; }

/* c ? a : b on the bits. A plain ?: between two operands of one later operation lets GCC move
   that operation into both arms: (c ? p : q) / d became two divisions, the slowest instruction
   in these kernels. */
ST_INLINE float st__pick(int c, float a, float b)
{
    uint32_t m = (uint32_t)0 - (uint32_t)(c != 0);
    return st__u2f((st__f2u(a) & m) | (st__f2u(b) & ~m));
}

/* ---------------------------------------------------------------- constants ----------- */
#define ST__LOG2E 1.44269502f          /* 1/ln 2 */
#define ST__LN2_HI 0.693359375f        /* ln 2 = HI + LO; HI has 9 significant bits */
#define ST__LN2_LO (-2.12194442e-4f)
#define ST__ROUNDER 12582912.0f        /* 1.5 * 2^23: x + ROUNDER - ROUNDER rounds to integer */

/* (hi, lo) with hi + lo == a*a exactly. */
ST_INLINE void st__two_sqr(float a, float *hi, float *lo)
{
    float p = a * a;
#if ST_HAVE_FMAF
    *lo = __builtin_fmaf(a, a, -p);
#else
    float c = 4097.0f * a;          /* Veltkamp split; exact without contraction */
    float ah = c - (c - a);
    float al = a - ah;
    float e = ah * ah - p;
    e = e + 2.0f * ah * al;
    *lo = e + al * al;
#endif
    *hi = p;
}

/* p * 2^n for n in [-170, 150]: two exact steps, so a subnormal result is rounded once. */
ST_INLINE float st__scale2(float p, int32_t n)
{
    int32_t n1 = n >> 1;     /* arithmetic shift (GCC, clang): fewer instructions than n / 2 */
    int32_t n2 = n - n1;
    float s1 = st__u2f((uint32_t)(n1 + 127) << 23);
    float s2 = st__u2f((uint32_t)(n2 + 127) << 23);
    return (p * s1) * s2;
}

/* expm1(r) for |r| <= 0.354 (near-minimax, relative error 5e-10 before rounding). */
ST_INLINE float st__expm1_poly(float r)
{
    float p = ST_FMAF(r, 0.000197721121f, 0.00139341247f);
    p = ST_FMAF(p, r, 0.0083335368f);
    p = ST_FMAF(p, r, 0.0416664779f);
    p = ST_FMAF(p, r, 0.166666657f);
    p = ST_FMAF(p, r, 0.5f);
    return ST_FMAF(r * r, p, r);
}

/* Range reduction x = n ln2 + r, |r| <= ln2/2 (+ rounding). x must be finite, |x| < 2^21. */
ST_INLINE float st__reduce(float x, float lo, int32_t *n)
{
    float t = ST_FMAF(x + lo, ST__LOG2E, ST__ROUNDER);
    float k = t - ST__ROUNDER;
    *n = (int32_t)(st__f2u(t) - st__f2u(ST__ROUNDER));
    float r = ST_FMAF(-k, ST__LN2_HI, x);   /* exact: k*LN2_HI has <= 17 bits */
    r = r + lo;
    return ST_FMAF(-k, ST__LN2_LO, r);
}

/* Range reduction without a low part: x = n ln2 + r (|x| < 2^21, finite). */
ST_INLINE float st__reduce1(float x, int32_t *n)
{
    float t = ST_FMAF(x, ST__LOG2E, ST__ROUNDER);
    float k = t - ST__ROUNDER;
    *n = (int32_t)(st__f2u(t) - st__f2u(ST__ROUNDER));
    float r = ST_FMAF(-k, ST__LN2_HI, x);
    return ST_FMAF(-k, ST__LN2_LO, r);
}

/* exp(hi + lo) * 2^extra for finite hi in [-112, 92], |lo| < 2 and extra in [0, 48];
   overflow/underflow happen in the final scaling, so the result is +Inf, 0 or a subnormal
   as IEEE rounding gives (rounded once). */
ST_INLINE float st__exp_hls(float hi, float lo, int32_t extra)
{
    int32_t n;
    float r = st__reduce(hi, lo, &n);
    return st__scale2(1.0f + st__expm1_poly(r), n + extra);
}

ST_INLINE float st__clampf(float x, float lo, float hi)
{
    x = x != x ? 0.0f : x;     /* NaN: callers select their own NaN result */
    x = x < lo ? lo : x;
    return x > hi ? hi : x;
}

/* ------------------------------------------------------------- exp family ----------- */
ST_INLINE float st_expf(float x)
{
    /* st__exp_hls(x, 0, 0) without what it does not need here: no low part; 2^n as
       2^(n>>1) 2^(n-(n>>1)), both normal for |x| <= 150 (so a subnormal result is rounded once);
       inputs beyond that (and +-Inf) are selected at the end rather than clamped first, and NaN
       propagates through the arithmetic. */
    float t = ST_FMAF(x, ST__LOG2E, ST__ROUNDER);
    float k = t - ST__ROUNDER;
    int32_t n = (int32_t)(st__f2u(t) - st__f2u(ST__ROUNDER));
    float r = ST_FMAF(-k, ST__LN2_HI, x);     /* exact: |k| <= 217 */
    r = ST_FMAF(-k, ST__LN2_LO, r);
    int32_t n1 = n >> 1;                       /* arithmetic shift (GCC, clang) */
    float s1 = st__u2f((uint32_t)(n1 + 127) << 23);
    float s2 = st__u2f((uint32_t)(n - n1 + 127) << 23);
    float e = ((1.0f + st__expm1_poly(r)) * s1) * s2;
    e = x > 100.0f ? ST__INFF : e;
    return x < -150.0f ? 0.0f : e;
}

/* expm1 for x in [-30, 88]: 2^n*e + (2^n - 1) with e = expm1(r), no cancellation. */
ST_INLINE float st__expm1_mid(float x)
{
    int32_t n;
    float r = st__reduce1(x, &n);
    float e = st__expm1_poly(r);
    float s = st__u2f((uint32_t)(n + 127) << 23);
    return ST_FMAF(s, e, s - 1.0f);
}

ST_INLINE float st_expm1f(float x)
{
    float xc = st__clampf(x, -30.0f, 92.0f);
    float mid = st__expm1_mid(xc < 88.0f ? xc : 88.0f);
    int32_t n;
    float r = st__reduce1(xc, &n);
    float big = st__scale2(1.0f + st__expm1_poly(r), n) - 1.0f;   /* x >= 88: -1 is lost */
    float res = xc < 88.0f ? mid : big;
    res = fabsf(x) < 0x1p-25f ? x : res;   /* keeps -0.0 and subnormals exact */
    return x != x ? x : res;
}

ST_INLINE float st_tanhf(float x)
{
    /* |x| < 0.625: x + x^3 P(x^2); else 1 - 2/(e^2|x| + 1) as t/(t+2), t = expm1(2|x|) */
    float u = x * x;
    float p = ST_FMAF(u, 0.00215286738f, -0.00819016993f);
    p = ST_FMAF(p, u, 0.0217069369f);
    p = ST_FMAF(p, u, -0.0539481826f);
    p = ST_FMAF(p, u, 0.133332208f);
    p = ST_FMAF(p, u, -0.333333313f);
    float small = ST_FMAF(x, u * p, x);
    float a = fabsf(x) < 10.0f ? fabsf(x) : 10.0f;   /* tanh(10) rounds to 1; NaN -> 10 (selected below) */
    float t = st__expm1_mid(2.0f * a);
    float big = __builtin_copysignf(t / (t + 2.0f), x);
    float r = fabsf(x) < 0.625f ? small : big;
    r = fabsf(x) < 0x1p-13f ? x : r;               /* keeps -0.0 (and tanh x = x there) */
    return x != x ? x : r;
}

ST_INLINE float st_sigmoidf(float x)
{
    float a = -fabsf(x);
    int32_t n;                                    /* exp(-|x|); NaN -> exp(-112), selected below */
    float r0 = st__reduce1(a > -112.0f ? a : -112.0f, &n);
    float e = st__scale2(1.0f + st__expm1_poly(r0), n);
    float d = 1.0f + e;
    float r = st__pick(x < 0.0f, e, 1.0f) / d;    /* e/d or 1/d: one division */
    return x != x ? x : r;
}

/* x * sigmoid(v) for sign(v) == sign(x). For x < 0 the product x e^v is formed at 2^48 scale
   and scaled back once, so a small result does not inherit a subnormal e^v's lost bits. */
ST_INLINE float st__x_sigmoid(float x, float v)
{
    float a = -fabsf(v);
    float c = a > -112.0f ? a : -112.0f;          /* a <= 0; NaN -> -112 (callers select NaN) */
    int32_t n;                                    /* e^c * 2^48, in one scaling: 2^(n + 48) is */
    float r = st__reduce1(c, &n);                 /* normal for n in [-162, 0] */
    float es = (1.0f + st__expm1_poly(r)) * st__u2f((uint32_t)(n + 48 + 127) << 23);
    es = a < -112.0f ? 0.0f : es;                 /* -Inf * 0 = NaN, as torch gives */
    float d = 1.0f + es * 0x1p-48f;
    int neg = x < 0.0f;      /* (x es / d) 2^-48 or x / d (x * 1 and q * 1 are exact): one division */
    return ((x * st__pick(neg, es, 1.0f)) / d) * st__pick(neg, 0x1p-48f, 1.0f);
}

ST_INLINE float st_siluf(float x)
{
    float r = st__x_sigmoid(x, x);
    return x != x ? x : r;
}

ST_INLINE float st_gelu_tanhf(float x)
{
    /* 0.5 x (1 + tanh(u)) = x sigmoid(2u), 2u = x (C1 + C2 x^2) */
    const float C1 = 1.59576912f;    /* 2 sqrt(2/pi) */
    const float C2 = 0.0713548162f;  /* 2 sqrt(2/pi) * 0.044715 */
    float v = x * ST_FMAF(C2, x * x, C1);
    float r = st__x_sigmoid(x, v);
    return x != x ? x : r;
}

/* ------------------------------------------------------------- log family ----------- */
/* k ln2 + log(1 + f) + corr for f in [sqrt(1/2) - 1, sqrt(2) - 1]; f is exact. */
ST_INLINE float st__log_fk(float f, float k, float corr)
{
    float s = f / (2.0f + f);
    float z = s * s;
    float R = ST_FMAF(z, 0.242574602f, 0.284995526f);
    R = ST_FMAF(R, z, 0.400009662f);
    R = ST_FMAF(R, z, 0.666666627f);
    R = R * z;
    float hfsq = 0.5f * f * f;
    float tail = ST_FMAF(s, hfsq + R, ST_FMAF(k, ST__LN2_LO, corr));
    return ST_FMAF(k, ST__LN2_HI, f - (hfsq - tail));
}

/* log(x) + corr for finite x >= 2^-126: x = 2^k m, m in [sqrt(1/2), sqrt(2)). */
ST_INLINE float st__log_normal(float x, float kbias, float corr)
{
    uint32_t ix = st__f2u(x);
    uint32_t t = ix - 0x3f3504f3u;          /* bits of sqrt(1/2) */
    int32_t k = (int32_t)t >> 23;           /* arithmetic shift (GCC, clang) */
    float m = st__u2f(ix - ((uint32_t)k << 23));
    return st__log_fk(m - 1.0f, (float)k + kbias, corr);
}

ST_INLINE float st_logf(float x)
{
    int sub = x < 0x1p-126f;                /* zero, subnormal (and negatives) */
    float xs = sub ? x * 0x1p23f : x;
    xs = (xs > 0.0f && xs < ST__INFF) ? xs : 1.0f;
    float r = st__log_normal(xs, sub ? -23.0f : 0.0f, 0.0f);
    r = x == ST__INFF ? x : r;
    r = x == 0.0f ? -ST__INFF : r;
    r = x < 0.0f ? ST__NANF : r;
    return x != x ? x : r;
}

ST_INLINE float st_log1pf(float x)
{
    /* |x| small: f = x exactly. Else u = 1 + x plus the rounding error of that sum. */
    float a = st__log_fk(st__clampf(x, -0.29f, 0.41f), 0.0f, 0.0f);
    float u = 1.0f + x;
    float uc = (u > 0.0f && u < ST__INFF) ? u : 1.0f;
    float c = (x - (uc - 1.0f)) / uc;
    float b = st__log_normal(uc, 0.0f, c);
    float r = (x >= -0.29f && x <= 0.41f) ? a : b;
    r = fabsf(x) < 0x1p-24f ? x : r;
    r = x == ST__INFF ? x : r;
    r = x == -1.0f ? -ST__INFF : r;
    r = x < -1.0f ? ST__NANF : r;
    return x != x ? x : r;
}

/* ------------------------------------------------------------- erf family ----------- */
/* erf(z) for |z| <= 0.5: z + z P(z^2). */
ST_INLINE float st__erf_small(float z)
{
    float u = z * z;
    float p = ST_FMAF(u, 0.0047194222f, -0.0267583504f);
    p = ST_FMAF(p, u, 0.112828515f);
    p = ST_FMAF(p, u, -0.376126111f);
    p = ST_FMAF(p, u, 0.128379166f);
    return ST_FMAF(z, p, z);
}

/* erfcx(z) = exp(z^2) erfc(z) for z in [0.5, 10.5]: a polynomial in z - 1.5 below 2.5, else
   F(1/z^2) / z (near-minimax fits, relative error < 5e-9 before rounding). */
ST_INLINE float st__erfcx(float z)
{
    float s = z - 1.5f;
    float p = ST_FMAF(s, -8.69640098e-06f, 2.97457682e-05f);
    p = ST_FMAF(p, s, -7.1103932e-05f);
    p = ST_FMAF(p, s, 0.000215721229f);
    p = ST_FMAF(p, s, -0.000662455044f);
    p = ST_FMAF(p, s, 0.00188976829f);
    p = ST_FMAF(p, s, -0.0051459074f);
    p = ST_FMAF(p, s, 0.0133766197f);
    p = ST_FMAF(p, s, -0.0329309106f);
    p = ST_FMAF(p, s, 0.0761510804f);
    p = ST_FMAF(p, s, -0.163622916f);
    p = ST_FMAF(p, s, 0.321585417f);
    float r = 1.0f / z;
    float u = r * r;
    float q = ST_FMAF(u, -23.2915306f, 21.6223354f);
    q = ST_FMAF(q, u, -9.81372833f);
    q = ST_FMAF(q, u, 3.23388195f);
    q = ST_FMAF(q, u, -1.03743231f);
    q = ST_FMAF(q, u, 0.422627062f);
    q = ST_FMAF(q, u, -0.28208828f);
    q = ST_FMAF(q, u, 0.564189553f);
    return z < 2.5f ? p : q * r;
}

/* erfc(z) * 2^extra for z in [0.5, 10.5] given z^2 = z2hi + z2lo exactly. */
ST_INLINE float st__erfc_tail(float z, float z2hi, float z2lo, int32_t extra)
{
    return st__erfcx(z) * st__exp_hls(-z2hi, -z2lo, extra);
}

ST_INLINE float st__erfc_tail_z(float z)
{
    float hi, lo;
    st__two_sqr(z, &hi, &lo);
    return st__erfc_tail(z, hi, lo, 0);
}

ST_INLINE float st_erff(float x)
{
    float a = st__clampf(fabsf(x), 0.0f, 10.5f);
    float big = 1.0f - st__erfc_tail_z(a < 0.5f ? 0.5f : a);
    float r = a < 0.5f ? st__erf_small(x) : __builtin_copysignf(big, x);
    return x != x ? x : r;
}

ST_INLINE float st_erfcf(float x)
{
    float a = st__clampf(fabsf(x), 0.5f, 10.5f);
    float tail = st__erfc_tail_z(a);
    float r = x < 0.0f ? 2.0f - tail : tail;
    r = fabsf(x) < 0.5f ? 1.0f - st__erf_small(x) : r;
    return x != x ? x : r;
}

ST_INLINE float st_gelu_erff(float x)
{
    /* gelu(x) = x Phi(x), Phi(x) = 1 - erfc(z)/2 for x >= 0 and erfc(z)/2 for x < 0, z = |x|/sqrt(2),
       so a tiny result for x << 0 keeps its relative accuracy. erfc(z) = erfcx(z) exp(-z^2):
       erfcx(z) = t P(t) with t = 1/(1 + z/2) (near-minimax fit on z in [0, 10.5], relative error
       3.6e-9 before rounding); z^2 = x^2/2 exactly (two-product of x), and exp(-z^2) is scaled by
       2^48 (a normal float down to x = -14.8) so that the result is rounded once. One division,
       no branches: about half the instructions of st_erfcf. */
    float a = fabsf(x);
    a = a > 14.8f ? 14.8f : a;
    float t = 1.0f / ST_FMAF(a, 0.353553385f, 1.0f);
    float p = ST_FMAF(t, 0.0363174081f, -0.194295079f);
    p = ST_FMAF(p, t, 0.389891684f);
    p = ST_FMAF(p, t, -0.302262545f);
    p = ST_FMAF(p, t, -0.00990648661f);
    p = ST_FMAF(p, t, 0.0278040208f);
    p = ST_FMAF(p, t, 0.0580880642f);
    p = ST_FMAF(p, t, 0.184701085f);
    p = ST_FMAF(p, t, 0.245335832f);
    p = ST_FMAF(p, t, 0.282236814f);
    p = ST_FMAF(p, t, 0.282089174f);
    float hi, lo;
    st__two_sqr(a, &hi, &lo);
    int32_t n;
    float r = st__reduce(-0.5f * hi, -0.5f * lo, &n);              /* n in [-159, 0] */
    float e = (1.0f + st__expm1_poly(r)) * st__u2f((uint32_t)(n + 48 + 127) << 23);
    float q = (t * p) * e;                                         /* erfc(z) 2^48 */
    float pos = x * ST_FMAF(q, -0x1p-49f, 1.0f);
    float neg = ((0.5f * x) * q) * 0x1p-48f;
    /* |x| < 0.5: the rounding of t costs up to 6 ulps there (d erfcx/dt is largest near t = 1);
       0.5 x (1 + erf(x/sqrt2)) has no cancellation there */
    float small = (0.5f * x) * (1.0f + st__erf_small(x * 0.707106769f));
    pos = a < 0.5f ? small : pos;
    neg = a < 0.5f ? small : neg;
    neg = fabsf(x) > 14.8f ? x * 0.0f : neg;   /* underflows; -Inf * 0 = NaN, as torch gives */
    float res = x < 0.0f ? neg : pos;
    return x != x ? x : res;
}

/* ------------------------------------------------------------- elementary ----------- */
ST_INLINE float st_sqrtf(float x) { return __builtin_sqrtf(x); }
ST_INLINE float st_rsqrtf(float x) { return 1.0f / __builtin_sqrtf(x); }
ST_INLINE float st_absf(float x) { return __builtin_fabsf(x); }
ST_INLINE float st_reluf(float x) { return x < 0.0f ? 0.0f : x; }
ST_INLINE float st_signf(float x) { return (float)((x > 0.0f) - (x < 0.0f)); }
ST_INLINE float st_floorf(float x) { return __builtin_floorf(x); }
ST_INLINE float st_ceilf(float x) { return __builtin_ceilf(x); }
ST_INLINE float st_truncf(float x) { return __builtin_truncf(x); }
ST_INLINE float st_roundf(float x) { return __builtin_rintf(x); }  /* half to even */

ST_INLINE float st_maxf(float a, float b)
{
    float r = a > b ? a : b;
    r = a == b ? st__u2f(st__f2u(a) & st__f2u(b)) : r;   /* max(-0, +0) = +0 */
    r = b != b ? b : r;
    return a != a ? a : r;
}

ST_INLINE float st_minf(float a, float b)
{
    float r = a < b ? a : b;
    r = a == b ? st__u2f(st__f2u(a) | st__f2u(b)) : r;   /* min(-0, +0) = -0 */
    r = b != b ? b : r;
    return a != a ? a : r;
}

/* Calls libm powf: correct special cases (pow(x, 0) = 1, pow(-8, 1/3) = NaN, ...) but a
   loop that uses it is not vectorised. */
ST_INLINE float st_powf(float x, float y) { return powf(x, y); }

/* Masked loads (pooling windows past an edge): m ? v : o, where the read v comes from always
   happens (at a safe index where m fails). Written with bit masks, not a branch: gcc sinks a
   read into the branch that uses it and then cannot vectorise the loop. */
typedef union { double d; uint64_t u; } st__dbits;
ST_INLINE int64_t st__pick_index(int m, int64_t i, int64_t safe)
{
    uint64_t k = (uint64_t)0 - (uint64_t)(m != 0);
    return (int64_t)(((uint64_t)i & k) | ((uint64_t)safe & ~k));
}
ST_INLINE float st_pickf(int m, float v, float o)
{
    uint32_t k = (uint32_t)0 - (uint32_t)(m != 0);
    return st__u2f((st__f2u(v) & k) | (st__f2u(o) & ~k));
}
ST_INLINE double st_pick(int m, double v, double o)
{
    st__dbits a, b;
    uint64_t k = (uint64_t)0 - (uint64_t)(m != 0);
    a.d = v; b.d = o; a.u = (a.u & k) | (b.u & ~k);
    return a.d;
}
ST_INLINE int64_t st_pick_i64(int m, int64_t v, int64_t o) { return st__pick_index(m, v, o); }
ST_INLINE int st_pick_b(int m, int v, int o) { return (v & -(m != 0)) | (o & -(m == 0)); }

/* ------------------------------------------------------------ fp16 / bf16 ----------- */
ST_INLINE float st_h2f(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = (uint32_t)(h & 0x7fffu);
    uint32_t normal = (em << 13) + (112u << 23);                  /* rebias 15 -> 127 */
    uint32_t special = (em << 13) | 0x7f800000u | ((em & 0x3ffu) ? 0x00400000u : 0u);
    uint32_t sub = st__f2u((float)(int32_t)em * 0x1p-24f);          /* exact for em < 1024 */
    uint32_t e = em & 0x7c00u;
    uint32_t r = e == 0x7c00u ? special : (e == 0u ? sub : normal);
    return st__u2f(r | sign);
}

ST_INLINE uint16_t st_f2h(float f)
{
    uint32_t x = st__f2u(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a = x & 0x7fffffffu;
    uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
    uint32_t normal = (a - (112u << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;   /* RNE */
    uint32_t sub = st__f2u(st__u2f(a) + 0.5f) - 0x3f000000u;  /* FPU rounds to 2^-24 */
    uint32_t r = a >= 0x38800000u ? normal : sub;             /* >= 2^-14 */
    r = a >= 0x477ff000u ? 0x7c00u : r;                        /* >= 65520 -> Inf */
    r = a > 0x7f800000u ? nan : r;
    return (uint16_t)(r | sign);
}

ST_INLINE float st_bf2f(uint16_t h) { return st__u2f((uint32_t)h << 16); }

ST_INLINE uint16_t st_f2bf(float f)
{
    uint32_t x = st__f2u(f);
    uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;     /* RNE */
    return (uint16_t)(f != f ? 0xffffu : r);
}

/* ------------------------------------------------------ integer arithmetic ----------- */
/* Integer values are computed in int64_t. Signed overflow is undefined in C, while torch wraps
   (two's complement), so add/sub/mul/neg/abs go through uint64_t (defined modulo 2^64) and back
   with st__u2i64, which is defined for every value (and compiles to nothing). st_wrap_* reduce
   an int64 modulo 2^N into the range of an N-bit type, as torch's narrowing casts and its
   int8/int16/int32 arithmetic do; they use no implementation-defined conversion either. */
ST_INLINE int64_t st__u2i64(uint64_t u)
{
    return u <= (uint64_t)INT64_MAX ? (int64_t)u : (int64_t)(u - (uint64_t)INT64_MIN) + INT64_MIN;
}
ST_INLINE int64_t st_addi(int64_t a, int64_t b) { return st__u2i64((uint64_t)a + (uint64_t)b); }
ST_INLINE int64_t st_subi(int64_t a, int64_t b) { return st__u2i64((uint64_t)a - (uint64_t)b); }
ST_INLINE int64_t st_muli(int64_t a, int64_t b) { return st__u2i64((uint64_t)a * (uint64_t)b); }
ST_INLINE int64_t st_negi(int64_t a) { return st__u2i64((uint64_t)0 - (uint64_t)a); }
ST_INLINE int64_t st_absi(int64_t a) { return a < 0 ? st_negi(a) : a; }   /* abs(INT64_MIN) = INT64_MIN */
ST_INLINE int64_t st_wrap_i8(int64_t x) { return (int64_t)(((uint64_t)x & 0xffu) ^ 0x80u) - 0x80; }
ST_INLINE int64_t st_wrap_u8(int64_t x) { return (int64_t)((uint64_t)x & 0xffu); }
ST_INLINE int64_t st_wrap_i16(int64_t x) { return (int64_t)(((uint64_t)x & 0xffffu) ^ 0x8000u) - 0x8000; }
ST_INLINE int64_t st_wrap_i32(int64_t x)
{
    return (int64_t)(((uint64_t)x & 0xffffffffu) ^ 0x80000000u) - INT64_C(0x80000000);
}

/* --------------------------------------------------- float -> integer casts ----------- */
/* C leaves the conversion of NaN, +-Inf and out-of-range floating values to an integer type
   undefined (and compilers exploit it: a cast through int64 then int32 gave 0 where eager gives
   INT32_MIN). These are defined for every input: the value is range-checked first, only an
   in-range value is converted, and the answer for the rest is selected (branch-free, so loops
   using them vectorise). They reproduce eager torch (2.13) on x86-64, measured for float32,
   float64, float16 and bfloat16 sources, vectorised and scalar kernels alike:
     int32  trunc(x) when it fits, else INT32_MIN (NaN, +-Inf, out of range: the "integer
            indefinite" value of cvttps2dq / cvttsd2si)
     int64  trunc(x) when it fits, else INT64_MIN
     int16, int8  the low 16 / 8 bits of the int32 result (300.0 -> 44 as int8, 3e9 -> 0)
     uint8  the low 8 bits of the int64 result (c10 casts to uint8 through int64: -1.5 -> 255,
            and from float64 4294967301.0 -> 5)
     bool   x != 0 (NaN -> true); not a helper, the code generator writes the comparison.
   fp16/bf16 values are converted from their float value (exact). Other CPUs (aarch64's fcvtzs
   saturates): NaN -> 0 and out-of-range values clamp to the int32/int64 range before the same
   narrowing; not measured here. */
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)
#define ST__CVT_BAD32(x) INT32_MIN
#define ST__CVT_BAD64(x) INT64_MIN
#else
#define ST__CVT_BAD32(x) ((x) != (x) ? 0 : ((x) > 0 ? INT32_MAX : INT32_MIN))
#define ST__CVT_BAD64(x) ((x) != (x) ? 0 : ((x) > 0 ? INT64_MAX : INT64_MIN))
#endif

ST_INLINE int64_t st_f2i32f(float x)
{
    int ok = x >= -0x1p31f && x < 0x1p31f;           /* false for NaN */
    int32_t r = (int32_t)(ok ? x : 0.0f);
    return ok ? (int64_t)r : (int64_t)ST__CVT_BAD32(x);
}
ST_INLINE int64_t st_f2i32(double x)
{
    int ok = x > -2147483649.0 && x < 2147483648.0;  /* trunc(x) in [INT32_MIN, INT32_MAX] */
    int32_t r = (int32_t)(ok ? x : 0.0);
    return ok ? (int64_t)r : (int64_t)ST__CVT_BAD32(x);
}
ST_INLINE int64_t st_f2i64f(float x)
{
    int ok = x >= -0x1p63f && x < 0x1p63f;
    int64_t r = (int64_t)(ok ? x : 0.0f);
    return ok ? r : ST__CVT_BAD64(x);
}
ST_INLINE int64_t st_f2i64(double x)
{
    int ok = x >= -0x1p63 && x < 0x1p63;             /* doubles next to -2^63 are 2048 apart */
    int64_t r = (int64_t)(ok ? x : 0.0);
    return ok ? r : ST__CVT_BAD64(x);
}
ST_INLINE int64_t st_f2i16f(float x) { return st_wrap_i16(st_f2i32f(x)); }
ST_INLINE int64_t st_f2i16(double x) { return st_wrap_i16(st_f2i32(x)); }
ST_INLINE int64_t st_f2i8f(float x) { return st_wrap_i8(st_f2i32f(x)); }
ST_INLINE int64_t st_f2i8(double x) { return st_wrap_i8(st_f2i32(x)); }
ST_INLINE int64_t st_f2u8f(float x) { return st_wrap_u8(st_f2i64f(x)); }
ST_INLINE int64_t st_f2u8(double x) { return st_wrap_u8(st_f2i64(x)); }

/* ---------------------------------------------------------------- double ----------- */
/* libm-backed; loops using them are vectorised only where the compiler can. */
ST_INLINE double st_exp(double x) { return exp(x); }
ST_INLINE double st_expm1(double x) { return expm1(x); }
ST_INLINE double st_log(double x) { return log(x); }
ST_INLINE double st_log1p(double x) { return log1p(x); }
ST_INLINE double st_tanh(double x) { return tanh(x); }
ST_INLINE double st_erf(double x) { return erf(x); }
ST_INLINE double st_erfc(double x) { return erfc(x); }
ST_INLINE double st_sqrt(double x) { return __builtin_sqrt(x); }
ST_INLINE double st_rsqrt(double x) { return 1.0 / __builtin_sqrt(x); }
ST_INLINE double st_abs(double x) { return __builtin_fabs(x); }
ST_INLINE double st_relu(double x) { return x < 0.0 ? 0.0 : x; }
ST_INLINE double st_sign(double x) { return (double)((x > 0.0) - (x < 0.0)); }
ST_INLINE double st_floor(double x) { return __builtin_floor(x); }
ST_INLINE double st_ceil(double x) { return __builtin_ceil(x); }
ST_INLINE double st_trunc(double x) { return __builtin_trunc(x); }
ST_INLINE double st_round(double x) { return __builtin_rint(x); }
ST_INLINE double st_pow(double x, double y) { return pow(x, y); }

ST_INLINE double st__x_sigmoid_d(double x, double v)
{
    double e = exp(-fabs(v));
    double d = 1.0 + e;
    return (x < 0.0 ? x * e : x) / d;
}

ST_INLINE double st_sigmoid(double x)
{
    double e = exp(-fabs(x));
    double r = (x < 0.0 ? e : 1.0) / (1.0 + e);
    return x != x ? x : r;
}

ST_INLINE double st_silu(double x) { return x != x ? x : st__x_sigmoid_d(x, x); }

ST_INLINE double st_gelu_tanh(double x)
{
    const double C = 1.5957691216057308;   /* 2 sqrt(2/pi) */
    double v = C * (x + 0.044715 * x * x * x);
    return x != x ? x : st__x_sigmoid_d(x, v);
}

ST_INLINE double st_gelu_erf(double x) { return 0.5 * x * erfc(-x * 0.70710678118654752); }

ST_INLINE double st_max(double a, double b)
{
    union { double d; uint64_t u; } ua, ub;
    double r = a > b ? a : b;
    ua.d = a; ub.d = b; ua.u &= ub.u;
    r = a == b ? ua.d : r;
    r = b != b ? b : r;
    return a != a ? a : r;
}

ST_INLINE double st_min(double a, double b)
{
    union { double d; uint64_t u; } ua, ub;
    double r = a < b ? a : b;
    ua.d = a; ub.d = b; ua.u |= ub.u;
    r = a == b ? ua.d : r;
    r = b != b ? b : r;
    return a != a ? a : r;
}

#endif /* SYMTRACE_PRELUDE_H */
