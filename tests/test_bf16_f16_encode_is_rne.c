/* F32 -> BF16 and F32 -> F16 are IEEE round-to-nearest-even (overflow to
 * Inf), NaN -> the canonical quiet NaN (0x7FC0, 0x7E00), signed zeros and
 * subnormals (F32 and target) kept.
 *
 * Judged against the oracle over both sides of every rounding boundary of
 * every positive finite value of the target (midpoints +- 1 ulp), the
 * overflow threshold, specials, millions of random F32 bit patterns, and
 * all 2^16 BF16 values to F16. */
#include <float.h>
#include <math.h>

#include "test_util.h"

static long n_inputs;

static uint32_t lib(int f16, float x) { return f16 ? fm_f16_from_f32(x) : fm_bf16_from_f32(x); }

static void check_one(int f16, float x, const char *why)
{
    or_fmt f = f16 ? OF_F16 : OF_BF16;
    n_inputs++;
    CHECK_EQ_U(lib(f16, x), or_encode(f, (double)x), "%s(%a = 0x%08x) [%s]", or_name(f), (double)x,
               tu_f32_bits(x), why);
}

static void around(int f16, float x, const char *why)
{
    float v[3] = {x, nextafterf(x, 0.0f), nextafterf(x, INFINITY)};
    for (int i = 0; i < 3; i++) {
        check_one(f16, v[i], why);
        check_one(f16, -v[i], why);
    }
}

int main(void)
{
    tu_begin("test_bf16_f16_encode_is_rne");

    CHECK(or_encode(OF_F16, 65519.0) == 0x7BFF && or_encode(OF_F16, 65520.0) == 0x7C00, "oracle F16 overflow");
    CHECK(or_encode(OF_BF16, 1.0 + ldexp(1, -8)) == 0x3F80 && or_encode(OF_BF16, 1.0 + 3 * ldexp(1, -8)) == 0x3F82,
          "oracle BF16 ties to even");

    for (int f16 = 0; f16 < 2; f16++) {
        or_fmt f = f16 ? OF_F16 : OF_BF16;
        uint32_t maxc = f16 ? 0x7BFF : 0x7F7F;
        for (uint32_t c = 0; c <= maxc; c++) {
            double v = or_decode(f, c);
            around(f16, (float)v, "value");
            if (c < maxc) {
                double mid = (v + or_decode(f, c + 1)) / 2;
                CHECK((double)(float)mid == mid, "midpoint exact");
                around(f16, (float)mid, "midpoint");
            }
        }
        double mx = or_max(f);
        int ex;
        frexp(mx, &ex);
        around(f16, (float)((mx + ldexp(1.0, ex)) / 2), "overflow midpoint");
        around(f16, (float)ldexp(1.0, ex), "next binade");
        around(f16, FLT_MAX, "FLT_MAX");
        around(f16, INFINITY, "Inf");
        CHECK_EQ_U(lib(f16, INFINITY), f16 ? 0x7C00 : 0x7F80, "%s(+Inf)", or_name(f));
        CHECK_EQ_U(lib(f16, -INFINITY), f16 ? 0xFC00 : 0xFF80, "%s(-Inf)", or_name(f));
        CHECK_EQ_U(lib(f16, -0.0f), 0x8000, "%s(-0)", or_name(f));
        const uint32_t sub[] = {0x00000001u, 0x00000002u, 0x00008000u, 0x00010000u, 0x00018000u, 0x00400000u,
                                0x007FFFFFu, 0x00800000u};
        for (size_t i = 0; i < sizeof sub / sizeof sub[0]; i++)
            around(f16, tu_bits_f32(sub[i]), "F32 subnormal");
        const uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0xFFFFFFFFu,
                                 0x7F80FFFFu, 0xFFBFFFFFu};
        for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++)
            CHECK_EQ_U(lib(f16, tu_bits_f32(nans[i])), f16 ? 0x7E00 : 0x7FC0, "%s(NaN 0x%08x) canonical",
                       or_name(f), nans[i]);
        for (int i = 0; i < 2000000; i++) {
            uint32_t u = tu_rand32();
            if ((u & 0x7FFFFFFFu) > 0x7F800000u)
                continue; /* NaNs: covered above */
            check_one(f16, tu_bits_f32(u), "random bits");
        }
        /* the F16 range is narrow: most random patterns are far outside it */
        for (int i = 0; i < 1000000; i++) {
            uint32_t u = tu_rand32();
            uint32_t e = (uint32_t)(127 + tu_randint(-30, 17));
            check_one(f16, tu_bits_f32((u & 0x807FFFFFu) | (e << 23)), "random near range");
        }
    }
    for (uint32_t b = 0; b < 65536; b++) {
        float x = tu_bits_f32(b << 16);
        if (x != x)
            continue;
        check_one(1, x, "BF16 exhaustive to F16");
    }
    printf("%ld inputs checked against the oracle\n", n_inputs);
    return tu_end();
}
