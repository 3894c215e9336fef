/* F32 -> E4M3 / E5M2 / E2M1 is round-to-nearest-even with saturation to the
 * largest finite value (Inf included), NaN -> the format's NaN code (E2M1,
 * which has none: 0x7), signed zeros kept.
 *
 * Judged against the oracle (nearest of every code's value, ties to the even
 * code) over: all 2^16 BF16 bit patterns; both sides of every rounding
 * boundary (each midpoint, midpoint +- 1 F32 ulp, each value +- 1 ulp) and of
 * the overflow thresholds; signed zeros, F32 subnormals, +-Inf, NaNs with
 * payloads; and random F32 bit patterns. */
#include <float.h>
#include <math.h>

#include "test_util.h"

static const or_fmt fmts[3] = {OF_E4M3, OF_E5M2, OF_E2M1};
static const fm_dtype dts[3] = {FM_DTYPE_E4M3, FM_DTYPE_E5M2, FM_DTYPE_E2M1};

static uint32_t lib_encode(int k, float x)
{
    switch (k) {
    case 0: return fm_e4m3_from_f32(x);
    case 1: return fm_e5m2_from_f32(x);
    default: return fm_e2m1_from_f32(x);
    }
}

static long n_inputs;

static void check_one(int k, float x, const char *why)
{
    uint32_t want = or_encode(fmts[k], (double)x);
    n_inputs++;
    CHECK_EQ_U(lib_encode(k, x), want, "%s(%a = bits 0x%08x) [%s]", or_name(fmts[k]), (double)x, tu_f32_bits(x),
               why);
    CHECK_EQ_U(fm_elem_encode(dts[k], x), want, "fm_elem_encode %s(%a) [%s]", or_name(fmts[k]), (double)x, why);
}

static void check_both_signs(int k, float x, const char *why)
{
    check_one(k, x, why);
    check_one(k, -x, why);
}

int main(void)
{
    tu_begin("test_fp8_fp4_encode_is_rne_satfinite");

    /* the oracle itself against the OCP spec's own examples */
    CHECK(or_encode(OF_E4M3, 464.0) == 0x7E && or_encode(OF_E4M3, 1e30) == 0x7E, "oracle E4M3 satfinite");
    CHECK(or_encode(OF_E4M3, -INFINITY) == 0xFE, "oracle E4M3 -Inf -> -max");
    CHECK(or_encode(OF_E5M2, INFINITY) == 0x7B, "oracle E5M2 Inf -> max");
    CHECK(or_encode(OF_E2M1, 5.0) == 0x6 && or_encode(OF_E2M1, 0.25) == 0x0 && or_encode(OF_E2M1, 0.75) == 0x2,
          "oracle E2M1 ties to even");
    CHECK(or_encode(OF_E4M3, 17.0) == or_encode(OF_E4M3, 16.0) && or_encode(OF_E4M3, 19.0) == or_encode(OF_E4M3, 20.0),
          "oracle E4M3 ties to even");
    CHECK(or_encode(OF_E4M3, -0.0) == 0x80 && or_encode(OF_E2M1, -0.0) == 0x8, "oracle signed zero");

    for (int k = 0; k < 3; k++) {
        or_fmt f = fmts[k];
        /* 1. all 2^16 BF16 inputs */
        for (uint32_t b = 0; b < 65536; b++)
            check_one(k, tu_bits_f32(b << 16), "BF16 exhaustive");

        /* 2. every rounding boundary of the format */
        int ncodes = 1 << (or_bits(f) - 1);
        double prev = -1;
        for (int c = 0; c < ncodes; c++) {
            double v = or_decode(f, (uint32_t)c);
            if (tu_is_nan(v) || isinf(v))
                continue;
            float fv = (float)v;
            check_both_signs(k, fv, "value");
            check_both_signs(k, nextafterf(fv, 0.0f), "value - ulp");
            check_both_signs(k, nextafterf(fv, INFINITY), "value + ulp");
            if (prev >= 0 && v > prev) {
                float mid = (float)((prev + v) / 2);
                CHECK((double)mid == (prev + v) / 2, "%s midpoint %a exact in F32", or_name(f), (prev + v) / 2);
                check_both_signs(k, mid, "midpoint");
                check_both_signs(k, nextafterf(mid, 0.0f), "midpoint - ulp");
                check_both_signs(k, nextafterf(mid, INFINITY), "midpoint + ulp");
            }
            if (v > prev)
                prev = v;
        }
        /* 3. overflow thresholds: max, the IEEE-style midpoint to the next binade,
         * the next binade, and far beyond: all saturate to +-max */
        double mx = or_max(f);
        int ex;
        frexp(mx, &ex);
        double next_binade = ldexp(1.0, ex);
        double q = or_quantum(f, mx);
        const double over[] = {mx, mx + q / 2, mx + q, next_binade, (mx + next_binade) / 2, next_binade * 1.5,
                               1e10, (double)FLT_MAX};
        for (size_t i = 0; i < sizeof over / sizeof over[0]; i++) {
            float o = (float)over[i];
            check_both_signs(k, o, "overflow threshold");
            check_both_signs(k, nextafterf(o, 0.0f), "overflow threshold - ulp");
            check_both_signs(k, nextafterf(o, INFINITY), "overflow threshold + ulp");
            CHECK_EQ_U(lib_encode(k, o) & ((1u << (or_bits(f) - 1)) - 1), or_encode(f, mx),
                       "%s(%a) saturates to max", or_name(f), over[i]);
        }
        /* 4. specials */
        check_both_signs(k, 0.0f, "zero");
        CHECK_EQ_U(lib_encode(k, -0.0f), 1u << (or_bits(f) - 1), "%s(-0) keeps the sign", or_name(f));
        check_both_signs(k, INFINITY, "Inf");
        CHECK_EQ_U(lib_encode(k, INFINITY), or_encode(f, mx), "%s(+Inf) = +max", or_name(f));
        const uint32_t sub[] = {0x00000001u, 0x00000002u, 0x00400000u, 0x007FFFFFu, 0x00800000u, 0x00800001u};
        for (size_t i = 0; i < sizeof sub / sizeof sub[0]; i++) {
            check_both_signs(k, tu_bits_f32(sub[i]), "F32 subnormal / tiny");
            CHECK_EQ_U(lib_encode(k, tu_bits_f32(sub[i] | 0x80000000u)), 1u << (or_bits(f) - 1),
                       "%s(-tiny) = -0", or_name(f));
        }
        const uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0xFFFFFFFFu,
                                 0x7FA12345u};
        const uint32_t nan_code[3] = {0x7F, 0x7E, 0x7};
        for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
            check_one(k, tu_bits_f32(nans[i]), "NaN");
            CHECK_EQ_U(lib_encode(k, tu_bits_f32(nans[i])), nan_code[k], "%s(NaN 0x%08x)", or_name(f), nans[i]);
        }
        /* 5. random F32: raw bit patterns, and values in the format's own range
         * (where every rounding decision happens) */
        for (int i = 0; i < 300000; i++)
            check_one(k, tu_bits_f32(tu_rand32()), "random bits");
        for (int i = 0; i < 300000; i++) {
            uint32_t u = tu_rand32();
            uint32_t e = (uint32_t)(127 + tu_randint(-30, 20));
            check_one(k, tu_bits_f32((u & 0x807FFFFFu) | (e << 23)), "random in range");
        }
    }
    printf("%ld inputs checked against the oracle\n", n_inputs);
    return tu_end();
}
