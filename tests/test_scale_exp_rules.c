/* The scale rules of format.h against their definitions.
 *
 * fm_pow2_scale_exp: the smallest p with a / 2^p <= max_elem (search over p
 * in double), a = 0 -> 0, clamped to [-127, 127]; fm_mx_floor_scale_exp:
 * floor(log2 a) - floor(log2 max_elem), clamped; fm_exact_scale:
 * max_elem / a in F32, 1 for a = 0, FLT_MAX where it overflows. Over every
 * non-negative finite BF16 amax (normal and subnormal), random F32 amax,
 * random F32 subnormal amax (the clamp), and the edges of each binade. And
 * the monotonicity of fm_code_scale_exp over magnitude codes. */
#include <float.h>
#include <math.h>

#include "test_util.h"

static const fm_dtype dts[3] = {FM_DTYPE_E4M3, FM_DTYPE_E5M2, FM_DTYPE_E2M1};

static void check_amax(float a, const char *why)
{
    for (int k = 0; k < 3; k++) {
        double mx = or_max(or_from_dtype(dts[k]));
        int want = or_pow2_exp(a, mx);
        int got = fm_pow2_scale_exp(a, dts[k]);
        CHECK(got == want, "pow2 %s amax %a (0x%08x) [%s]: got %d want %d", fm_dtype_name(dts[k]), (double)a,
              tu_f32_bits(a), why, got, want);
        /* the properties the rule promises: nothing saturates, and the scale is
         * the smallest power that does so unless clamped */
        if (a > 0) {
            CHECK(ldexp(a, -got) <= mx, "pow2 %s amax %a: a / 2^%d > max", fm_dtype_name(dts[k]), (double)a, got);
            CHECK(got == -127 || ldexp(a, -(got - 1)) > mx, "pow2 %s amax %a: 2^%d would do", fm_dtype_name(dts[k]),
                  (double)a, got - 1);
        } else {
            CHECK(got == 0, "pow2 of amax 0 is 2^0");
        }
        int wantf = or_floor_exp(a, mx);
        int gotf = fm_mx_floor_scale_exp(a, dts[k]);
        CHECK(gotf == wantf, "mx floor %s amax %a [%s]: got %d want %d", fm_dtype_name(dts[k]), (double)a, why, gotf,
              wantf);
        if (dts[k] != FM_DTYPE_E2M1) {
            float m = fm_exact_scale(a, dts[k]);
            float wm = a == 0.0f ? 1.0f : (float)mx / a;
            if (isinf(wm))
                wm = FLT_MAX;
            CHECK_EQ_U(tu_f32_bits(m), tu_f32_bits(wm), "exact %s amax %a", fm_dtype_name(dts[k]), (double)a);
        }
    }
}

int main(void)
{
    tu_begin("test_scale_exp_rules");
    /* worked examples from DESIGN.md / OCP: E4M3 max 448 = 1.75 * 2^8 */
    CHECK(fm_pow2_scale_exp(448.0f, FM_DTYPE_E4M3) == 0 && fm_pow2_scale_exp(449.0f, FM_DTYPE_E4M3) == 1,
          "448 fits 2^0, 449 needs 2^1");
    CHECK(fm_pow2_scale_exp(6.0f, FM_DTYPE_E2M1) == 0 && fm_pow2_scale_exp(6.5f, FM_DTYPE_E2M1) == 1, "E2M1 6");
    CHECK(fm_mx_floor_scale_exp(500.0f, FM_DTYPE_E4M3) == 0 && fm_mx_floor_scale_exp(512.0f, FM_DTYPE_E4M3) == 1,
          "OCP floor: floor(log2 500) - 8 = 0");
    CHECK(fm_pow2_scale_exp(tu_bits_f32(1), FM_DTYPE_E4M3) == -127, "subnormal amax clamps to -127");

    for (uint32_t b = 0; b <= 0x7F80; b++) { /* every non-negative BF16 below Inf */
        if (b == 0x7F80)
            break;
        check_amax(tu_bits_f32(b << 16), "BF16 exhaustive");
    }
    for (int i = 0; i < 200000; i++) {
        uint32_t u = tu_rand32() & 0x7FFFFFFFu;
        if (u >= 0x7F800000u)
            continue;
        check_amax(tu_bits_f32(u), "random F32");
    }
    for (int i = 0; i < 20000; i++)
        check_amax(tu_bits_f32(tu_rand32() & 0x007FFFFFu), "random F32 subnormal");
    /* binade edges: 2^e, and 1.max_frac * 2^e +- 1 ulp, for every e */
    for (int e = -149; e <= 127; e++) {
        float p = (float)ldexp(1.0, e);
        check_amax(p, "power of two");
        check_amax(nextafterf(p, 0.0f), "power of two - ulp");
        check_amax(nextafterf(p, INFINITY), "power of two + ulp");
        if (e >= -126)
            for (int k = 0; k < 3; k++) {
                double mx = or_max(or_from_dtype(dts[k]));
                int em;
                frexp(mx, &em);
                float edge = (float)ldexp(mx, e - (em - 1)); /* max's mantissa at exponent e */
                if (isinf(edge) || edge == 0.0f)
                    continue;
                check_amax(edge, "mantissa edge");
                check_amax(nextafterf(edge, 0.0f), "mantissa edge - ulp");
                check_amax(nextafterf(edge, INFINITY), "mantissa edge + ulp");
            }
    }
    check_amax(FLT_MAX, "FLT_MAX");

    /* What the CUDA row-segment conversion (requantize.cu, rq_max_mag) rests
     * on: a block's key is the key of its largest magnitude code, because
     * fm_code_scale_exp never falls as the magnitude code rises, over the
     * finite codes of every input format and either rule, and the
     * non-finite codes lie above every finite one. */
    for (int i = 0; i < 3; i++)
        for (int o = 0; o < 3; o++)
            for (int fl = 0; fl < 2; fl++) {
                const int nmag = dts[i] == FM_DTYPE_E2M1 ? 8 : 128;
                int prev = -1000, seen_nonfinite = 0;
                for (int m = 1; m < nmag; m++) { /* 0: the empty block, apart */
                    if (fm_elem_code_nonfinite(dts[i], (uint8_t)m)) {
                        seen_nonfinite = 1;
                        continue;
                    }
                    CHECK(!seen_nonfinite, "%s: finite magnitude code 0x%02x above a non-finite one",
                          fm_dtype_name(dts[i]), m);
                    const int k = fm_code_scale_exp(dts[i], (uint8_t)m, dts[o], fl);
                    CHECK(k >= prev, "fm_code_scale_exp(%s -> %s, %s) falls at magnitude code 0x%02x: %d after %d",
                          fm_dtype_name(dts[i]), fm_dtype_name(dts[o]), fl ? "mx floor" : "pow2", m, k, prev);
                    prev = k;
                }
            }
    return tu_end();
}
