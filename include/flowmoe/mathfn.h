/* flowmoe — the transcendental and reduction rules of the MoE ops, once, for
 * every backend.
 *
 * Static inline, C11 and CUDA (host and device), like format.h. Every
 * function is a fixed sequence of IEEE F32 operations, each rounded to
 * nearest even: add, multiply, divide and fmaf (a fused multiply-add rounded
 * once). Nothing calls libm's expf (whose last bit differs between C
 * libraries and CUDA), and every fused operation is an explicit fmaf: the
 * build forbids contraction (-ffp-contract=off, nvcc -fmad=false), so the CPU
 * and the GPU evaluate the same expression tree and get the same bits.
 * Results that are NaN are the canonical NaN (format.h). */
#ifndef FLOWMOE_MATHFN_H
#define FLOWMOE_MATHFN_H

#include <stdint.h>

#include "flowmoe/format.h"

#if !defined(__CUDACC__)
#include <math.h> /* fmaf only: correctly rounded by C99, a hardware FMA on the GPU */
#endif

/* IEEE F32 division; on the device the explicit rn intrinsic, so that no
 * compiler flag can turn it into an approximate reciprocal. */
FM_HD float fm_divf(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

/* e^x for x already in [-104, 89] (steps 2 to 4):
 *  2. n = round(x / ln 2) by the 1.5 * 2^23 trick (|x / ln 2| < 151, so the
 *     add rounds to an integer exactly, ties to even); n is read from the
 *     bits of t = 1.5 * 2^23 + n, whose ulp is 1 there.
 *  3. r = x - n ln 2 with a Cody-Waite split of ln 2: LN2_HI has 16
 *     significant bits, so n * LN2_HI is exact for |n| <= 150 and the first
 *     fmaf loses nothing; LN2_LO carries the rest. |r| <= 0.3466.
 *  4. e^r by its degree-7 Taylor polynomial in Horner form with fmaf (the
 *     truncation error r^8 / 8! < 6e-9 relative, a tenth of an ulp), then
 *     times 2^n as (p * 2^n1) * 2^(n - n1), both powers normal and the first
 *     product exact, so that the result is p * 2^n rounded once (subnormal
 *     results and the overflow to +Inf included; results below 2^-150 round
 *     to +0 by themselves).
 * fm_exp_poly does steps 2 and 3 and the polynomial; fm_exp_clamped and
 * fm_exp_nonpos split n two ways that give the same bits. */
FM_HD float fm_exp_poly(float xc, int *n)
{
    const float LOG2E = 1.44269502f;
    const float LN2_HI = 0.693145752f; /* 0x3F317200: 16 significant bits */
    const float LN2_LO = 1.42860677e-06f; /* ln 2 - LN2_HI, rounded to F32 */
    const float SHIFT = 12582912.0f;      /* 1.5 * 2^23, bits 0x4B400000 */
    float t = xc * LOG2E + SHIFT;
    float nf = t - SHIFT;
    *n = (int)(fm_f32_bits(t) - 0x4B400000u);
    float r = fmaf(-nf, LN2_HI, xc);
    r = fmaf(-nf, LN2_LO, r);
    float p = 1.98412698e-04f; /* 1/7! */
    p = fmaf(p, r, 1.38888889e-03f); /* 1/6! */
    p = fmaf(p, r, 8.33333333e-03f); /* 1/5! */
    p = fmaf(p, r, 4.16666667e-02f); /* 1/4! */
    p = fmaf(p, r, 1.66666667e-01f); /* 1/3! */
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    return fmaf(p, r, 1.0f);
}

/* x in [-104, 89]: n in [-151, 129], n1 = n / 2 keeps both powers normal. */
FM_HD float fm_exp_clamped(float xc)
{
    int n;
    const float p = fm_exp_poly(xc, &n);
    const int n1 = n / 2;
    return (p * fm_bits_f32((uint32_t)(n1 + 127) << 23)) * fm_bits_f32((uint32_t)(n - n1 + 127) << 23);
}

/* x in [-104, 0] (the sigmoid's e^-|g|): n in [-151, 0]; n1 = max(n, -125)
 * keeps p * 2^n1 normal (p >= 0.7) and n - n1 >= -26; fm_exp_clamped's bits
 * in fewer integer operations (no signed halving). */
FM_HD float fm_exp_nonpos(float xc)
{
    int n;
    const float p = fm_exp_poly(xc, &n);
    const int n1 = n > -125 ? n : -125;
    return (p * fm_bits_f32((uint32_t)(n1 + 127) << 23)) * fm_bits_f32((uint32_t)(n - n1 + 127) << 23);
}

/* e^x with at most 1 ulp of error (tests/test_mathfn_exp_is_accurate bounds
 * it over a dense sweep), in four steps, without a branch (the GPU runs it
 * per element in the SwiGLU kernels, where branches and their convergence
 * bookkeeping cost as much as the arithmetic):
 *  1. x is clamped to [-104, 89] (NaN to 89) so that the steps below stay in
 *     range; the specials are selected at the end: NaN -> canonical NaN,
 *     x > 88.72284 (ln of the largest F32, rounded up) -> +Inf, which covers
 *     +Inf; x < -103.97208 (below ln 2^-150, where every result rounds to 0)
 *     -> +0, which covers -Inf.
 *  2.-4. fm_exp_clamped above. An exhaustive comparison over all 2^32
 *     inputs gave the same bits as the earlier branchy form. */
FM_HD float fm_expf(float x)
{
    float xc = x < 89.0f ? x : 89.0f;
    xc = xc > -104.0f ? xc : -104.0f;
    float y = fm_exp_clamped(xc);
    y = x > 88.72284f ? fm_bits_f32(0x7F800000u) : y;
    y = x < -103.97208f ? 0.0f : y;
    return fm_f32_is_nan(x) ? fm_bits_f32(FM_F32_CANON_NAN) : y;
}

/* 1 / x correctly rounded, for x in [1, 2] only (the sigmoid's 1 + e^-|g|).
 * On the device: the approximate reciprocal and one Newton step, which is
 * __frcp_rn's fast path without its range check and the call to its slow
 * path (the check is for results outside the normal range, which [1, 2]
 * never gives); tests/gpu/test_cuda_mathfn_equals_host compares every F32 of
 * [1, 2] with the host's division. */
FM_HD float fm_rcp_1to2f(float x)
{
#if defined(__CUDA_ARCH__)
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return fmaf(r, fmaf(-x, r, 1.0f), r);
#else
    return 1.0f / x;
#endif
}

/* sigmoid(g) and sigmoid(-g) from one exponential of a non-positive
 * argument, so that the reciprocal's operand stays in [1, 2] and nothing
 * overflows:
 *   e = e^-|g| (fm_exp_nonpos of max(-|g|, -104): e^-104 already rounds
 *     to +0), q = 1 / (1 + e), and
 *   (sigmoid(g), sigmoid(-g)) = (q, e q) for g >= 0, (e q, q) otherwise.
 * Both are within 3 ulps; sigmoid(-Inf) = 0, sigmoid(+Inf) = 1. A NaN g
 * gives finite values here (the callers make their own NaN). */
FM_HD void fm_sigmoid_pm(float g, float *sp, float *sn)
{
    float x = fm_bits_f32(fm_f32_bits(g) | 0x80000000u); /* -|g| */
    x = x > -104.0f ? x : -104.0f;                        /* NaN -> -104 too */
    const float e = fm_exp_nonpos(x);
    const float q = fm_rcp_1to2f(1.0f + e);
    const float eq = e * q;
    *sp = g >= 0.0f ? q : eq;
    *sn = g >= 0.0f ? eq : q;
}

/* fm_sigmoid_pm of 8 values, the same bits in fewer operations when every
 * |g| <= 86.5 (the SwiGLU kernels' common case). There n >= -125 (x / ln 2 >=
 * -124.8), so fm_exp_nonpos takes n1 = n, its second factor is 1, and its
 * first product p * 2^n is normal and exact: bits(p) + (n << 23), one
 * integer operation instead of two products and their powers. The clamp at
 * -104 does not act either. A group with any larger |g| or a NaN (whose -|g|
 * bits, read as a signed integer, exceed those of -86.5) takes
 * fm_sigmoid_pm element by element. test_cuda_mathfn_equals_host compares it
 * with fm_sigmoid_pm on the device over 2^24 patterns. */
FM_HD void fm_sigmoid_pm8(const float *g, float *sp, float *sn)
{
    uint32_t xb[8];
    int32_t worst = INT32_MIN;
    for (int k = 0; k < 8; k++) {
        xb[k] = fm_f32_bits(g[k]) | 0x80000000u; /* -|g| */
        worst = (int32_t)xb[k] > worst ? (int32_t)xb[k] : worst;
    }
    if (worst > (int32_t)0xC2AD0000u) { /* -86.5 */
        for (int k = 0; k < 8; k++)
            fm_sigmoid_pm(g[k], &sp[k], &sn[k]);
        return;
    }
    for (int k = 0; k < 8; k++) {
        int n;
        const float p = fm_exp_poly(fm_bits_f32(xb[k]), &n);
        const float e = fm_bits_f32(fm_f32_bits(p) + ((uint32_t)n << 23));
        const float q = fm_rcp_1to2f(1.0f + e);
        const float eq = e * q;
        sp[k] = g[k] >= 0.0f ? q : eq;
        sn[k] = g[k] >= 0.0f ? eq : q;
    }
}

/* sigmoid(g) as fm_sigmoid_pm computes it; NaN -> canonical NaN. */
FM_HD float fm_sigmoidf(float x)
{
    float sp, sn;
    fm_sigmoid_pm(x, &sp, &sn);
    return fm_f32_is_nan(x) ? fm_bits_f32(FM_F32_CANON_NAN) : sp;
}

/* silu(g) and d silu / dg = s * (1 + g * (1 - s)) with s = sigmoid(g), both
 * from fm_sigmoid_pm's pair (1 - s taken as sigmoid(-g), which keeps its
 * digits where s is close to 1), NaN payloads as they come:
 *   silu = g * s, dsilu = s * fmaf(g, sigmoid(-g), 1).
 * The fused kernels call this: their quantizer turns any NaN of a block into
 * the block's NaN code, so a canonical NaN would be two wasted instructions
 * an element. */
FM_HD void fm_silu_dsilu_rawf(float g, float *silu, float *dsilu)
{
    float s, sn;
    fm_sigmoid_pm(g, &s, &sn);
    *silu = g * s;
    *dsilu = s * fmaf(g, sn, 1.0f);
}

/* silu(g) = g * sigmoid(g), fm_silu_dsilu_rawf's first value. */
FM_HD float fm_silu_rawf(float g)
{
    float s, sn;
    fm_sigmoid_pm(g, &s, &sn);
    return g * s;
}

/* silu with NaN made canonical. silu(+Inf) = +Inf, silu(-Inf) = NaN
 * (-Inf * 0): a non-finite input never becomes a finite output. */
FM_HD float fm_siluf(float g)
{
    return fm_f32_canon(fm_silu_rawf(g));
}

/* fm_silu_dsilu_rawf with NaN made canonical. dsilu(+-Inf) = NaN (Inf * 0
 * inside); finite inputs give finite outputs. */
FM_HD void fm_silu_dsiluf(float g, float *silu, float *dsilu)
{
    fm_silu_dsilu_rawf(g, silu, dsilu);
    *silu = fm_f32_canon(*silu);
    *dsilu = fm_f32_canon(*dsilu);
}

FM_HD float fm_dsiluf(float g)
{
    float a, d;
    fm_silu_dsiluf(g, &a, &d);
    return d;
}

/* ---- the fixed reduction order ---------------------------------------------
 * Every sum that feeds an output of the MoE ops (softmax denominators, the
 * dot products of backward passes) is evaluated in this order, so that one
 * warp per row reproduces the CPU bit for bit (the SwiGLU backward's dprobs
 * groups elements in runs of 8 instead: fm_dot_order_runs_f32 below):
 *
 *   1. 32 partial sums p_l, l = 0..31, each starting at +0.0f; element i goes
 *      to p_{i mod 32}, in increasing i: p_l = fmaf(a_i, b_i, p_l).
 *   2. a fixed tree: for off = 16, 8, 4, 2, 1: p_l = p_l + p_{l+off} for
 *      l < off. The result is p_0 (NaN made canonical).
 *
 * On the GPU, lane l of a warp accumulates i = l, l + 32, ... with fmaf, then
 *   for (off = 16; off > 0; off >>= 1) v += __shfl_down_sync(~0u, v, off);
 * and lane 0 holds the result: lanes l >= 32 - off read their own value back,
 * but those sums never reach lane 0. A plain sum is the dot with b_i = 1
 * (fmaf(a, 1, p) rounds a + p once, exactly as p + a does). */
#define FM_DOT_LANES 32

FM_HD float fm_dot_tree_f32(float *p)
{
    for (int off = FM_DOT_LANES / 2; off > 0; off >>= 1)
        for (int l = 0; l < off; l++)
            p[l] = p[l] + p[l + off];
    return fm_f32_canon(p[0]);
}

/* sum_i a[i * sa] * b[i * sb] for i < n, in the fixed order above. */
FM_HD float fm_dot_order_strided_f32(const float *a, int64_t sa, const float *b, int64_t sb, int64_t n)
{
    float p[FM_DOT_LANES];
    for (int l = 0; l < FM_DOT_LANES; l++)
        p[l] = 0.0f;
    for (int64_t i = 0; i < n; i++)
        p[i % FM_DOT_LANES] = fmaf(a[i * sa], b[i * sb], p[i % FM_DOT_LANES]);
    return fm_dot_tree_f32(p);
}

FM_HD float fm_dot_order_f32(const float *a, const float *b, int64_t n)
{
    return fm_dot_order_strided_f32(a, 1, b, 1, n);
}

/* The SwiGLU backward's dprobs (the dot of a row of dh with a · u): the same
 * 32 partial sums and tree, but element i goes to p_{(i / 8) mod 32}, runs
 * of 8 in increasing i. The fused kernel walks a row 256 columns at a time
 * with 8 adjacent columns a lane, so lane l accumulates p_l in registers
 * (fm_dot_order_f32's order would have each 256-column chunk pass through
 * shared memory to regroup the columns by i mod 32). */
#define FM_DOT_RUN 8

FM_HD float fm_dot_order_runs_f32(const float *a, const float *b, int64_t n)
{
    float p[FM_DOT_LANES];
    for (int l = 0; l < FM_DOT_LANES; l++)
        p[l] = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const int l = (int)((i / FM_DOT_RUN) % FM_DOT_LANES);
        p[l] = fmaf(a[i], b[i], p[l]);
    }
    return fm_dot_tree_f32(p);
}

/* sum_i a[i] in the same order (each p_l = p_l + a_i). */
FM_HD float fm_sum_order_f32(const float *a, int64_t n)
{
    float p[FM_DOT_LANES];
    for (int l = 0; l < FM_DOT_LANES; l++)
        p[l] = 0.0f;
    for (int64_t i = 0; i < n; i++)
        p[i % FM_DOT_LANES] = p[i % FM_DOT_LANES] + a[i];
    return fm_dot_tree_f32(p);
}

/* softmax over n logits: x[j], or x[idx[j]] when idx is given, as
 * exp(x_j - max) / sum with the sum in the fixed order above (the max in
 * increasing j). The router's softmax scoring takes it over all E logits;
 * sigmoid scoring with renormalisation takes it over the k chosen logits
 * when their scores sum to +0 (every chosen logit below about -104, where
 * fm_sigmoidf rounds to 0): as the logits fall, s_j / sum_i s_i tends to
 * that softmax, since sigmoid(x) / e^x -> 1, so finite logits give finite
 * probabilities instead of 0 / 0. Logits all -Inf still give NaN
 * (-Inf - -Inf). */
FM_HD void fm_softmax_f32(const float *x, const int32_t *idx, int64_t n, float *p)
{
    float m = x[idx ? idx[0] : 0];
    for (int64_t j = 1; j < n; j++) {
        const float v = x[idx ? idx[j] : j];
        m = v > m ? v : m;
    }
    for (int64_t j = 0; j < n; j++)
        p[j] = fm_expf(x[idx ? idx[j] : j] - m);
    const float S = fm_sum_order_f32(p, n);
    for (int64_t j = 0; j < n; j++)
        p[j] = fm_divf(p[j], S);
}

#endif
