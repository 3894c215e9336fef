/* Every code of every narrow format decodes to the value its fields define.
 *
 * E4M3, E5M2 (all 256), E2M1 (all 16, high nibble ignored), E8M0 (all 256),
 * BF16 and F16 (all 65536) against the oracle's field formula evaluated in
 * double; NaN codes give the canonical F32 NaN where format.h promises it.
 * Also: encode(decode(c)) == c for every non-NaN code, the fm_elem_* views
 * agree with the per-format functions, fm_exp2i is 2^p. */
#include <math.h>

#include "test_util.h"

static void check_f32(float got, double want, const char *fmt, uint32_t code, int canonical_nan)
{
    if (tu_is_nan(want)) {
        CHECK(got != got, "%s code 0x%x: want NaN, got %a", fmt, code, (double)got);
        if (canonical_nan)
            CHECK_EQ_U(tu_f32_bits(got), 0x7FC00000u, "%s code 0x%x: NaN must be the canonical 0x7FC00000", fmt,
                       code);
        return;
    }
    CHECK((double)(float)want == want, "%s code 0x%x: oracle value %a not an F32", fmt, code, want);
    CHECK_EQ_U(tu_f32_bits(got), tu_f32_bits((float)want), "%s code 0x%x (want %a)", fmt, code, want);
}

int main(void)
{
    tu_begin("test_codec_decode_every_code");

    /* the oracle's own sanity against values stated by the OCP / IEEE specs */
    CHECK(or_decode(OF_E4M3, 0x7E) == 448.0, "oracle E4M3 max");
    CHECK(or_decode(OF_E4M3, 0x01) == ldexp(1, -9), "oracle E4M3 min subnormal");
    CHECK(tu_is_nan(or_decode(OF_E4M3, 0xFF)), "oracle E4M3 NaN");
    CHECK(or_decode(OF_E5M2, 0x7B) == 57344.0, "oracle E5M2 max");
    CHECK(isinf(or_decode(OF_E5M2, 0xFC)) && or_decode(OF_E5M2, 0xFC) < 0, "oracle E5M2 -Inf");
    CHECK(or_decode(OF_E5M2, 0x01) == ldexp(1, -16), "oracle E5M2 min subnormal");
    CHECK(or_decode(OF_E2M1, 0x7) == 6.0 && or_decode(OF_E2M1, 0x1) == 0.5 && or_decode(OF_E2M1, 0xD) == -3.0,
          "oracle E2M1 values");
    CHECK(or_decode(OF_F16, 0x7BFF) == 65504.0 && or_decode(OF_F16, 0x0001) == ldexp(1, -24), "oracle F16");
    CHECK(or_decode(OF_BF16, 0x3F80) == 1.0 && or_decode(OF_BF16, 0x0001) == ldexp(1, -133), "oracle BF16");

    for (uint32_t c = 0; c < 256; c++) {
        check_f32(fm_e4m3_to_f32((uint8_t)c), or_decode(OF_E4M3, c), "E4M3", c, 1);
        check_f32(fm_e5m2_to_f32((uint8_t)c), or_decode(OF_E5M2, c), "E5M2", c, 1);
        check_f32(fm_e8m0_to_f32((uint8_t)c), or_decode(OF_E8M0, c), "E8M0", c, 1);
        check_f32(fm_elem_decode(FM_DTYPE_E4M3, (uint8_t)c), or_decode(OF_E4M3, c), "elem E4M3", c, 1);
        check_f32(fm_elem_decode(FM_DTYPE_E5M2, (uint8_t)c), or_decode(OF_E5M2, c), "elem E5M2", c, 1);
        /* only the low nibble is an E2M1 code */
        check_f32(fm_e2m1_to_f32((uint8_t)c), or_decode(OF_E2M1, c & 0xF), "E2M1", c, 1);
        check_f32(fm_elem_decode(FM_DTYPE_E2M1, (uint8_t)c), or_decode(OF_E2M1, c & 0xF), "elem E2M1", c, 1);

        /* every non-NaN code is a fixed point of encode(decode(.)), -0 included;
         * E5M2 Inf saturates to max (satfinite) */
        double v4 = or_decode(OF_E4M3, c), v5 = or_decode(OF_E5M2, c);
        if (!tu_is_nan(v4))
            CHECK_EQ_U(fm_e4m3_from_f32(fm_e4m3_to_f32((uint8_t)c)), c, "E4M3 round trip");
        if (!tu_is_nan(v5) && !isinf(v5))
            CHECK_EQ_U(fm_e5m2_from_f32(fm_e5m2_to_f32((uint8_t)c)), c, "E5M2 round trip");
        if (isinf(v5))
            CHECK_EQ_U(fm_e5m2_from_f32(fm_e5m2_to_f32((uint8_t)c)), (c & 0x80) | 0x7B, "E5M2 Inf saturates");
        if (c < 16)
            CHECK_EQ_U(fm_e2m1_from_f32(fm_e2m1_to_f32((uint8_t)c)), c, "E2M1 round trip");
    }

    for (uint32_t c = 0; c < 65536; c++) {
        double vb = or_decode(OF_BF16, c), vh = or_decode(OF_F16, c);
        /* decoding keeps BF16/F16 NaN payloads (no op writes here): NaN-ness only */
        check_f32(fm_bf16_to_f32((uint16_t)c), vb, "BF16", c, 0);
        check_f32(fm_f16_to_f32((uint16_t)c), vh, "F16", c, 0);
        if (!tu_is_nan(vb))
            CHECK_EQ_U(fm_bf16_from_f32(fm_bf16_to_f32((uint16_t)c)), c, "BF16 round trip");
        if (!tu_is_nan(vh))
            CHECK_EQ_U(fm_f16_from_f32(fm_f16_to_f32((uint16_t)c)), c, "F16 round trip");
    }

    CHECK(fm_elem_max(FM_DTYPE_E4M3) == or_max(OF_E4M3), "elem max E4M3");
    CHECK(fm_elem_max(FM_DTYPE_E5M2) == or_max(OF_E5M2), "elem max E5M2");
    CHECK(fm_elem_max(FM_DTYPE_E2M1) == or_max(OF_E2M1), "elem max E2M1");
    CHECK(tu_is_nan(or_decode(OF_E4M3, fm_elem_nan(FM_DTYPE_E4M3))), "E4M3 block NaN code is a NaN");
    CHECK(tu_is_nan(or_decode(OF_E5M2, fm_elem_nan(FM_DTYPE_E5M2))), "E5M2 block NaN code is a NaN");
    CHECK_EQ_U(fm_elem_nan(FM_DTYPE_E2M1), 0, "E2M1 has no NaN: non-finite blocks hold code 0");

    for (int p = -149; p <= 127; p++)
        CHECK_EQ_U(tu_f32_bits(fm_exp2i(p)), tu_f32_bits((float)ldexp(1.0, p)), "fm_exp2i(%d)", p);

    const uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFFFFFFFu, 0x7FBFFFFFu};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        float f = tu_bits_f32(nans[i]);
        CHECK(fm_f32_is_nan(f) && !fm_f32_is_finite(f), "NaN 0x%x", nans[i]);
        CHECK_EQ_U(tu_f32_bits(fm_f32_canon(f)), 0x7FC00000u, "canon of NaN 0x%x", nans[i]);
    }
    const uint32_t nonnan[] = {0x7F800000u, 0xFF800000u, 0x00000001u, 0x80000000u, 0x7F7FFFFFu};
    for (size_t i = 0; i < sizeof nonnan / sizeof nonnan[0]; i++) {
        float f = tu_bits_f32(nonnan[i]);
        CHECK(!fm_f32_is_nan(f), "not NaN 0x%x", nonnan[i]);
        CHECK(fm_f32_is_finite(f) == (i >= 2), "finite 0x%x", nonnan[i]);
        CHECK_EQ_U(tu_f32_bits(fm_f32_canon(f)), nonnan[i], "canon keeps 0x%x", nonnan[i]);
        CHECK_EQ_U(tu_f32_bits(fm_f32_abs(f)), nonnan[i] & 0x7FFFFFFFu, "abs 0x%x", nonnan[i]);
    }
    return tu_end();
}
