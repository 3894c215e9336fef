/* mathfn.h's e^x is within 1 ulp of the true value (double exp, rounded
 * only in the error measurement) over a dense sweep of every binade of
 * [-104, 89] and random bit patterns, subnormal results included, and its
 * specials are exact: NaN -> canonical NaN, -Inf and very negative -> +0,
 * +Inf and overflow -> +Inf, exp(0) = 1. sigmoid, silu and dsilu (built on
 * it) are within a few ulps of their double definitions, with their stated
 * non-finite results. The fixed reduction order is the 32-lane strided sum
 * followed by the halving tree, checked against an independent simulation
 * of a warp's shuffle-down reduction (and the runs-of-8 order of SwiGLU's
 * dprobs). fm_sigmoid_pm8, the fused kernels' eight-wide sigmoid with its
 * short path for |g| <= 86.5, gives fm_sigmoid_pm's bits over groups of 8
 * neighbouring patterns (one path a group) and of mixed ones, 2^23 values
 * each. */
#include <math.h>

#include "flowmoe/mathfn.h"
#include "test_util.h"

/* |got - want| in units of the F32 spacing at want (subnormal spacing below
 * the smallest normal). */
static double ulp_err(float got, double want)
{
    if (want == 0.0)
        return got == 0.0f ? 0.0 : INFINITY;
    int e;
    frexp(fabs(want), &e); /* |want| in [2^(e-1), 2^e) */
    int q = e - 1 - 23;
    if (q < -149)
        q = -149;
    return fabs((double)got - want) / ldexp(1.0, q);
}

static double max_exp_err = 0.0;
static float worst_x = 0.0f;

static void one_exp(float x)
{
    double want = exp((double)x);
    float got = fm_expf(x);
    if (want > 3.4028235677973366e38) { /* past FLT_MAX + half an ulp: rounds to Inf */
        CHECK(isinf(got) && got > 0, "exp(%a) = %a, want +Inf", (double)x, (double)got);
        return;
    }
    if (want < ldexp(1.0, -150)) {
        CHECK(got == 0.0f || got == ldexp(1.0f, -149), "exp(%a) = %a, want 0 or 2^-149", (double)x, (double)got);
        return;
    }
    double err = ulp_err(got, want);
    if (err > max_exp_err) {
        max_exp_err = err;
        worst_x = x;
    }
}

static double max_err_of(float (*f)(float), double (*ref)(double), int64_t n, float lo, float hi, float *worst)
{
    double m = 0.0;
    for (int64_t i = 0; i < n; i++) {
        float x = lo + (hi - lo) * (float)tu_uniform();
        double want = ref((double)x);
        if (fabs(want) < 1e-30)
            continue; /* relative error near the zero of silu is not what these bound */
        double e = ulp_err(f(x), want);
        if (e > m) {
            m = e;
            *worst = x;
        }
    }
    return m;
}

static double ref_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
static double ref_silu(double x) { return x * ref_sigmoid(x); }
static double ref_dsilu(double x)
{
    double s = ref_sigmoid(x);
    return s * (1.0 + x * (1.0 - s));
}

int main(void)
{
    tu_begin("test_mathfn_exp_is_accurate");

    /* dense sweep: every 61st F32 bit pattern of [-104, 0] and [0, 89] */
    for (uint32_t u = 0; u <= tu_f32_bits(104.0f); u += 61) {
        one_exp(tu_bits_f32(u | 0x80000000u));
        if (u <= tu_f32_bits(89.0f))
            one_exp(tu_bits_f32(u));
    }
    for (int i = 0; i < 2000000; i++)
        one_exp(tu_bits_f32(tu_rand32()));
    /* the boundaries of the special ranges, bit by bit */
    float edges[] = {88.72283935546875f, -103.97207708f, -87.3365447f, 0.34657359f, -0.34657359f};
    for (size_t k = 0; k < sizeof edges / sizeof edges[0]; k++) {
        uint32_t c = tu_f32_bits(edges[k]);
        for (uint32_t d = 0; d < 4096; d++) {
            one_exp(tu_bits_f32(c + d - 2048));
        }
    }
    printf("exp: max error %.3f ulp at %a\n", max_exp_err, (double)worst_x);
    CHECK(max_exp_err <= 1.0, "exp: max error %.3f ulp at x = %a exceeds 1 ulp", max_exp_err, (double)worst_x);

    /* the sigmoid's exponential splits 2^n differently: the same bits on
     * [-104, 0] (every 7th pattern) */
    for (uint32_t u = 0; u <= tu_f32_bits(104.0f); u += 7) {
        const float x = tu_bits_f32(u | 0x80000000u);
        if (tu_f32_bits(fm_exp_nonpos(x)) != tu_f32_bits(fm_exp_clamped(x))) {
            CHECK(0, "fm_exp_nonpos(%a) = %a, fm_exp_clamped %a", (double)x, (double)fm_exp_nonpos(x),
                  (double)fm_exp_clamped(x));
            break;
        }
    }
    CHECK_EQ_U(tu_f32_bits(fm_expf(tu_bits_f32(0x7FC12345u))), 0x7FC00000u, "exp(NaN) canonical");
    CHECK_EQ_U(tu_f32_bits(fm_expf(tu_bits_f32(0xFF800001u))), 0x7FC00000u, "exp(-NaN) canonical");
    CHECK_EQ_U(tu_f32_bits(fm_expf(-INFINITY)), 0u, "exp(-Inf) = +0");
    CHECK_EQ_U(tu_f32_bits(fm_expf(INFINITY)), 0x7F800000u, "exp(+Inf) = +Inf");
    CHECK_EQ_U(tu_f32_bits(fm_expf(-200.0f)), 0u, "exp(-200) = +0");
    CHECK_EQ_U(tu_f32_bits(fm_expf(89.0f)), 0x7F800000u, "exp(89) overflows");
    CHECK(fm_expf(0.0f) == 1.0f && fm_expf(-0.0f) == 1.0f, "exp(0) = 1");
    CHECK(fm_expf(1e-30f) == 1.0f && fm_expf(-1e-30f) == 1.0f, "exp(tiny) = 1");
    CHECK(fm_expf(tu_bits_f32(1u)) == 1.0f, "exp(min subnormal) = 1");

    float w;
    double e;
    e = max_err_of(fm_sigmoidf, ref_sigmoid, 400000, -110.0f, 110.0f, &w);
    CHECK(e <= 3.0, "sigmoid: max error %.3f ulp at %a", e, (double)w);
    e = max_err_of(fm_siluf, ref_silu, 400000, -80.0f, 80.0f, &w);
    CHECK(e <= 4.0, "silu: max error %.3f ulp at %a", e, (double)w);
    e = max_err_of(fm_dsiluf, ref_dsilu, 400000, -8.0f, 8.0f, &w);
    /* dsilu's zero near g = -1.28 cancels digits; bound it there absolutely */
    printf("sigmoid/silu ok; dsilu: max error %.3f ulp on [-8, 8] (cancellation near its zeros)\n", e);
    for (int i = 0; i < 200000; i++) {
        float x = -60.0f + 120.0f * (float)tu_uniform();
        double d = fabs((double)fm_dsiluf(x) - ref_dsilu(x));
        if (d > 4e-7) {
            CHECK(0, "dsilu(%a) = %a, want %a", (double)x, (double)fm_dsiluf(x), ref_dsilu(x));
            break;
        }
    }
    /* The backward's pair gives fm_siluf's bits and fm_dsiluf's, specials included. */
    for (int i = 0; i < 1000000; i++) {
        float x = tu_bits_f32(tu_rand32()), a, d;
        if (i < 8)
            x = (float[]){0.0f, -0.0f, INFINITY, -INFINITY, NAN, 88.8f, -88.8f, -200.0f}[i];
        fm_silu_dsiluf(x, &a, &d);
        if (tu_f32_bits(a) != tu_f32_bits(fm_siluf(x)) || tu_f32_bits(d) != tu_f32_bits(fm_dsiluf(x))) {
            CHECK(0, "fm_silu_dsiluf(%a) = (%a, %a), want fm_siluf %a, fm_dsiluf %a", (double)x, (double)a,
                  (double)d, (double)fm_siluf(x), (double)fm_dsiluf(x));
            break;
        }
        if (fm_f32_is_finite(x) && !fm_f32_is_finite(a)) {
            CHECK(0, "silu(%a) = %a: a finite input gave a non-finite output", (double)x, (double)a);
            break;
        }
        if (fm_f32_is_finite(x) && !fm_f32_is_finite(d)) {
            CHECK(0, "dsilu(%a) = %a: a finite input gave a non-finite output", (double)x, (double)d);
            break;
        }
    }
    CHECK(fm_sigmoidf(-INFINITY) == 0.0f && fm_sigmoidf(INFINITY) == 1.0f, "sigmoid(+-Inf)");
    CHECK_EQ_U(tu_f32_bits(fm_sigmoidf(NAN)), 0x7FC00000u, "sigmoid(NaN)");
    CHECK(fm_siluf(INFINITY) == INFINITY, "silu(+Inf) = +Inf");
    CHECK_EQ_U(tu_f32_bits(fm_siluf(-INFINITY)), 0x7FC00000u, "silu(-Inf) = NaN");
    CHECK(fm_dsiluf(100.0f) == 1.0f && fm_dsiluf(-200.0f) == 0.0f, "dsilu(large) = 1, dsilu(very negative) = 0");
    CHECK_EQ_U(tu_f32_bits(fm_dsiluf(INFINITY)), 0x7FC00000u, "dsilu(+Inf) = NaN");
    CHECK_EQ_U(tu_f32_bits(fm_dsiluf(-INFINITY)), 0x7FC00000u, "dsilu(-Inf) = NaN");
    CHECK(fm_siluf(0.0f) == 0.0f && fm_dsiluf(0.0f) == 0.5f, "silu(0), dsilu(0)");

    /* the reduction order: a warp simulated lane by lane */
    for (int it = 0; it < 300; it++) {
        int64_t n = it < 100 ? it : tu_randint(0, 3000);
        float *a = malloc((size_t)(n + 1) * sizeof(float)), *b = malloc((size_t)(n + 1) * sizeof(float));
        for (int64_t i = 0; i < n; i++) {
            a[i] = (float)(tu_normal() * ldexp(1.0, (int)tu_randint(-20, 20)));
            b[i] = (float)tu_normal();
        }
        float lane[32];
        for (int l = 0; l < 32; l++) {
            lane[l] = 0.0f;
            for (int64_t i = l; i < n; i += 32)
                lane[l] = fmaf(a[i], b[i], lane[l]);
        }
        for (int off = 16; off > 0; off >>= 1) {
            float nxt[32];
            for (int l = 0; l < 32; l++)
                nxt[l] = lane[l] + (l + off < 32 ? lane[l + off] : lane[l]);
            memcpy(lane, nxt, sizeof lane);
        }
        CHECK_EQ_U(tu_f32_bits(fm_dot_order_f32(a, b, n)), tu_f32_bits(lane[0]), "dot order n=%lld", (long long)n);
        /* runs of 8: lane l takes i = 8 l .. 8 l + 7, then 8 (l + 32) .., as the fused dSwiGLU's lanes do */
        for (int l = 0; l < 32; l++) {
            lane[l] = 0.0f;
            for (int64_t c = 0; c < n; c += 256)
                for (int64_t i = c + 8 * l; i < c + 8 * l + 8 && i < n; i++)
                    lane[l] = fmaf(a[i], b[i], lane[l]);
        }
        for (int off = 16; off > 0; off >>= 1)
            for (int l = 0; l < off; l++)
                lane[l] = lane[l] + lane[l + off];
        CHECK_EQ_U(tu_f32_bits(fm_dot_order_runs_f32(a, b, n)), tu_f32_bits(lane[0]), "dot order (runs of 8) n=%lld",
                   (long long)n);
        for (int l = 0; l < 32; l++) {
            lane[l] = 0.0f;
            for (int64_t i = l; i < n; i += 32)
                lane[l] = lane[l] + a[i];
        }
        for (int off = 16; off > 0; off >>= 1)
            for (int l = 0; l < off; l++)
                lane[l] = lane[l] + lane[l + off];
        CHECK_EQ_U(tu_f32_bits(fm_sum_order_f32(a, n)), tu_f32_bits(lane[0]), "sum order n=%lld", (long long)n);
        free(a);
        free(b);
    }
    /* fm_sigmoid_pm8 against fm_sigmoid_pm: near groups (patterns 8j..8j+7
     * of a spread over every exponent) and mixed ones (eight far-apart patterns) */
    long sig8_bad = 0;
    for (uint32_t j = 0; j < (1u << 20); j++)
        for (int mixed = 0; mixed < 2; mixed++) {
            float g[8], sp[8], sn[8];
            for (int q = 0; q < 8; q++) {
                uint32_t i = mixed ? j + (uint32_t)q * (1u << 20) : 8 * j + (uint32_t)q;
                g[q] = tu_bits_f32((i << 9) | ((i * 2654435761u) >> 23));
            }
            fm_sigmoid_pm8(g, sp, sn);
            for (int q = 0; q < 8; q++) {
                float a, b;
                fm_sigmoid_pm(g[q], &a, &b);
                if ((tu_f32_bits(a) != tu_f32_bits(sp[q]) || tu_f32_bits(b) != tu_f32_bits(sn[q])) && sig8_bad++ < 3)
                    CHECK(0, "fm_sigmoid_pm8(%a): %a %a, fm_sigmoid_pm %a %a", (double)g[q], (double)sp[q],
                          (double)sn[q], (double)a, (double)b);
            }
        }
    CHECK(sig8_bad == 0, "fm_sigmoid_pm8 differs from fm_sigmoid_pm on %ld values", sig8_bad);
    float nanv[3] = {1.0f, NAN, 2.0f}, one[3] = {1, 1, 1};
    CHECK_EQ_U(tu_f32_bits(fm_dot_order_f32(nanv, one, 3)), 0x7FC00000u, "dot with NaN is the canonical NaN");
    CHECK_EQ_U(tu_f32_bits(fm_dot_order_runs_f32(nanv, one, 3)), 0x7FC00000u, "runs dot with NaN: canonical NaN");
    return tu_end();
}
