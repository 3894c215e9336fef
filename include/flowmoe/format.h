/* flowmoe — the scalar format rules, once, for every backend.
 *
 * Static inline, C11 and CUDA (host and device). The CPU backend is the
 * specification and the CUDA kernels call these same functions, so both
 * compute the same bits. Nothing here depends on the floating-point
 * environment beyond IEEE round-to-nearest F32 multiply and divide with
 * subnormals kept (no FTZ: never build with fast-math flags).
 *
 * Rules:
 *  - F32 -> E4M3/E5M2/E2M1: round to nearest even, saturate to the largest
 *    finite value (Inf too: "satfinite"). NaN -> E4M3 0x7F, E5M2 0x7E, E2M1
 *    (which has no NaN) 0x7. Signed zeros are kept.
 *  - F32 -> BF16 / F16: round to nearest even; F16 overflows to Inf.
 *  - Every NaN a flowmoe op writes in F32, BF16 or F16 is the canonical
 *    positive quiet NaN (0x7FC00000, 0x7FC0, 0x7E00): payloads never depend
 *    on the backend's NaN propagation.
 *  - E8M0: 2^(c - 127), 0xFF = NaN.
 */
#ifndef FLOWMOE_FORMAT_H
#define FLOWMOE_FORMAT_H

#include <stdint.h>
#include "flowmoe/types.h"

#if defined(__CUDACC__)
#define FM_HD static inline __host__ __device__
#else
#include <string.h>
#define FM_HD static inline
#endif

#define FM_E4M3_MAX 448.0f
#define FM_E5M2_MAX 57344.0f
#define FM_E2M1_MAX 6.0f
#define FM_E4M3_NAN 0x7Fu
#define FM_E5M2_NAN 0x7Eu
#define FM_E8M0_NAN 0xFFu
#define FM_F32_CANON_NAN 0x7FC00000u
#define FM_BF16_CANON_NAN 0x7FC0u
#define FM_F16_CANON_NAN 0x7E00u

/* ---- bit casts ---------------------------------------------------------- */

FM_HD uint32_t fm_f32_bits(float f)
{
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}

FM_HD float fm_bits_f32(uint32_t u)
{
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* f != f: one compare on either side (the build never enables finite-math). */
FM_HD int fm_f32_is_nan(float f) { return f != f; }
FM_HD int fm_f32_is_finite(float f) { return (fm_f32_bits(f) & 0x7F800000u) != 0x7F800000u; }
FM_HD float fm_f32_abs(float f) { return fm_bits_f32(fm_f32_bits(f) & 0x7FFFFFFFu); }
FM_HD float fm_f32_canon(float f) { return fm_f32_is_nan(f) ? fm_bits_f32(FM_F32_CANON_NAN) : f; }

/* 2^p exactly, for p in [-149, 127]. */
FM_HD float fm_exp2i(int p)
{
    if (p >= -126)
        return fm_bits_f32((uint32_t)(p + 127) << 23);
    return fm_bits_f32(1u << (p + 149));
}

/* v / 2^s rounded to nearest even; v < 2^31. */
FM_HD uint32_t fm_rne_shift(uint32_t v, int s)
{
    if (s <= 0)
        return v;
    if (s >= 32)
        return 0;
    uint32_t q = v >> s;
    uint32_t rem = v & ((1u << s) - 1u);
    uint32_t half = 1u << (s - 1);
    return q + (uint32_t)(rem > half || (rem == half && (q & 1u)));
}

/* ---- generic binary-float encoder ---------------------------------------
 * |x| rounded (RNE) to the format with `mbits` mantissa bits and exponent
 * bias `bias`, returned as a magnitude code and clamped to `max_code`.
 * Target subnormals fall out of the same integer rounding: a carry out of the
 * mantissa lands in the exponent field. */
FM_HD uint32_t fm_encode_magnitude(uint32_t abs_bits, int mbits, int bias, uint32_t max_code)
{
    int f = (int)(abs_bits >> 23);
    int emin = 1 - bias;
    uint32_t code;
    if (f - 127 >= emin) {
        uint32_t t = abs_bits - ((uint32_t)(127 - bias) << 23);
        code = fm_rne_shift(t, 23 - mbits);
    } else {
        uint32_t mant = (abs_bits & 0x7FFFFFu) | (f ? 0x800000u : 0u);
        int fe = f ? f : 1;
        int s = (emin - mbits) - (fe - 150);
        code = s > 24 ? 0u : fm_rne_shift(mant, s);
    }
    return code > max_code ? max_code : code;
}

FM_HD uint8_t fm_e4m3_from_f32(float x)
{
    uint32_t u = fm_f32_bits(x), a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u)
        return (uint8_t)FM_E4M3_NAN;
    return (uint8_t)(((u >> 24) & 0x80u) | fm_encode_magnitude(a, 3, 7, 0x7Eu));
}

FM_HD uint8_t fm_e5m2_from_f32(float x)
{
    uint32_t u = fm_f32_bits(x), a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u)
        return (uint8_t)FM_E5M2_NAN;
    return (uint8_t)(((u >> 24) & 0x80u) | fm_encode_magnitude(a, 2, 15, 0x7Bu));
}

/* One E2M1 code in the low nibble. */
FM_HD uint8_t fm_e2m1_from_f32(float x)
{
    uint32_t u = fm_f32_bits(x), a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u)
        return 0x7u;
    return (uint8_t)(((u >> 28) & 0x8u) | fm_encode_magnitude(a, 1, 1, 0x7u));
}

FM_HD uint16_t fm_bf16_from_f32(float x)
{
    uint32_t u = fm_f32_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)FM_BF16_CANON_NAN;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

FM_HD uint16_t fm_f16_from_f32(float x)
{
    uint32_t u = fm_f32_bits(x), a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u)
        return (uint16_t)FM_F16_CANON_NAN;
    return (uint16_t)(((u >> 16) & 0x8000u) | fm_encode_magnitude(a, 10, 15, 0x7C00u));
}

/* ---- decoders (exact) --------------------------------------------------- */

FM_HD float fm_bf16_to_f32(uint16_t h) { return fm_bits_f32((uint32_t)h << 16); }

FM_HD float fm_f16_to_f32(uint16_t h)
{
    uint32_t s = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F)
        return fm_bits_f32(s | 0x7F800000u | (m << 13));
    if (e == 0)
        return fm_bits_f32(s | fm_f32_bits((float)m * fm_exp2i(-24)));
    return fm_bits_f32(s | ((e + 112u) << 23) | (m << 13));
}

/* Codes with few mantissa bits: normal = ((e - bias + 127) << 23) | m << (23 - mbits);
 * subnormal = m * 2^(1 - bias - mbits), both exact in F32. */
FM_HD float fm_decode_small(uint32_t code, int ebits, int mbits, int bias)
{
    uint32_t s = (code >> (ebits + mbits)) & 1u;
    uint32_t e = (code >> mbits) & ((1u << ebits) - 1u);
    uint32_t m = code & ((1u << mbits) - 1u);
    uint32_t mag;
    if (e == 0)
        mag = fm_f32_bits((float)m * fm_exp2i(1 - bias - mbits));
    else
        mag = ((e - (uint32_t)bias + 127u) << 23) | (m << (23 - mbits));
    return fm_bits_f32((s << 31) | mag);
}

FM_HD float fm_e4m3_to_f32(uint8_t c)
{
    if ((c & 0x7Fu) == 0x7Fu)
        return fm_bits_f32(FM_F32_CANON_NAN);
    return fm_decode_small(c, 4, 3, 7);
}

FM_HD float fm_e5m2_to_f32(uint8_t c)
{
    if ((c & 0x7Cu) == 0x7Cu) {
        if (c & 0x3u)
            return fm_bits_f32(FM_F32_CANON_NAN);
        return fm_bits_f32(((uint32_t)(c & 0x80u) << 24) | 0x7F800000u);
    }
    return fm_decode_small(c, 5, 2, 15);
}

/* Low nibble of `c`. */
FM_HD float fm_e2m1_to_f32(uint8_t c) { return fm_decode_small(c & 0xFu, 2, 1, 1); }

FM_HD float fm_e8m0_to_f32(uint8_t c)
{
    if (c == FM_E8M0_NAN)
        return fm_bits_f32(FM_F32_CANON_NAN);
    return fm_exp2i((int)c - 127);
}

/* ---- element dtypes as a value ------------------------------------------ */

FM_HD float fm_elem_max(fm_dtype t)
{
    return t == FM_DTYPE_E4M3 ? FM_E4M3_MAX : t == FM_DTYPE_E5M2 ? FM_E5M2_MAX : FM_E2M1_MAX;
}

FM_HD uint8_t fm_elem_encode(fm_dtype t, float x)
{
    return t == FM_DTYPE_E4M3 ? fm_e4m3_from_f32(x)
         : t == FM_DTYPE_E5M2 ? fm_e5m2_from_f32(x)
                              : fm_e2m1_from_f32(x);
}

FM_HD float fm_elem_decode(fm_dtype t, uint8_t c)
{
    return t == FM_DTYPE_E4M3 ? fm_e4m3_to_f32(c)
         : t == FM_DTYPE_E5M2 ? fm_e5m2_to_f32(c)
                              : fm_e2m1_to_f32(c);
}

/* The NaN code a non-finite block is filled with (E2M1 has none: 0, the
 * block's NaN scale carries the NaN). */
FM_HD uint8_t fm_elem_nan(fm_dtype t)
{
    return t == FM_DTYPE_E4M3 ? (uint8_t)FM_E4M3_NAN : t == FM_DTYPE_E5M2 ? (uint8_t)FM_E5M2_NAN : 0u;
}

/* ---- scale rules -------------------------------------------------------- */

/* floor(log2 a) and the 23 fraction bits of a = 1.f * 2^e, for finite a > 0
 * (subnormals normalised). */
FM_HD int fm_f32_frexp_bits(float a, uint32_t *frac23)
{
    uint32_t u = fm_f32_bits(a) & 0x7FFFFFFFu;
    int f = (int)(u >> 23);
    if (f) {
        *frac23 = u & 0x7FFFFFu;
        return f - 127;
    }
    int msb = 31;
    while (!(u >> msb))
        msb--;
    *frac23 = (u << (23 - msb)) & 0x7FFFFFu;
    return msb - 149;
}

/* Power-of-two rule: the exponent p of the smallest 2^p with a / 2^p <= the
 * element max, from exponent and mantissa bits only; a = 0 gives p = 0;
 * p clamped to [-127, 127] (the E8M0 range). `a` finite, >= 0. */
FM_HD int fm_pow2_scale_exp(float a, fm_dtype elem)
{
    /* element max = 1.max_frac * 2^emax */
    int emax = elem == FM_DTYPE_E4M3 ? 8 : elem == FM_DTYPE_E5M2 ? 15 : 2;
    uint32_t max_frac = elem == FM_DTYPE_E2M1 ? 0x400000u : 0x600000u;
    /* Without branches (the fused GPU kernels run this twice per 8
     * elements): a subnormal a is normalised by an exact multiply by 2^64;
     * both operands of each ?: are computed, and the product of a normal a
     * is never used. */
    uint32_t u = fm_f32_bits(a) & 0x7FFFFFFFu;
    int sub = u < 0x800000u;
    uint32_t v = sub ? fm_f32_bits(a * 18446744073709551616.0f) & 0x7FFFFFFFu : u;
    int e = (int)(v >> 23) - (sub ? 127 + 64 : 127);
    int p = e - emax + ((v & 0x7FFFFFu) > max_frac ? 1 : 0);
    p = p < -127 ? -127 : p > 127 ? 127 : p;
    return u == 0 ? 0 : p;
}

/* OCP MX v1.0 rule: floor(log2 a) - emax_elem, clamped to [-127, 127];
 * a = 0 gives 0. Elements may then saturate. */
FM_HD int fm_mx_floor_scale_exp(float a, fm_dtype elem)
{
    if (a == 0.0f)
        return 0;
    int emax = elem == FM_DTYPE_E4M3 ? 8 : elem == FM_DTYPE_E5M2 ? 15 : 2;
    uint32_t frac;
    int p = fm_f32_frexp_bits(a, &frac) - emax;
    return p < -127 ? -127 : p > 127 ? 127 : p;
}

/* EXACT rule: the multiplier max_elem / a (F32 division), 1 for a = 0,
 * FLT_MAX where the quotient overflows. scale_inv = 1 / multiplier. */
FM_HD float fm_exact_scale(float a, fm_dtype elem)
{
    if (a == 0.0f)
        return 1.0f;
    float s = fm_elem_max(elem) / a;
    return fm_f32_is_finite(s) ? s : fm_bits_f32(0x7F7FFFFFu);
}

/* ---- re-encoding on exponents (scaling-aware transpose, FP8 <-> MXFP4) -- */

/* The exponent of a power-of-two F32 scale: 1 and *p for a positive finite
 * power of two (subnormals too), 2 for NaN (a non-finite block), 0 for
 * anything else (not a power of two, zero, negative, Inf). */
FM_HD int fm_f32_pow2_exp(float s, int *p)
{
    uint32_t u = fm_f32_bits(s);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return 2;
    if (u & 0x80000000u)
        return 0;
    uint32_t f = u >> 23, m = u & 0x7FFFFFu;
    if (f == 0xFFu || u == 0)
        return 0;
    if (f) {
        if (m)
            return 0;
        *p = (int)f - 127;
        return 1;
    }
    if (m & (m - 1u))
        return 0;
    int b = 0;
    while ((m >> b) != 1u)
        b++;
    *p = b - 149;
    return 1;
}

/* Whether an element code is non-finite (E4M3 NaN, E5M2 Inf/NaN). */
FM_HD int fm_elem_code_nonfinite(fm_dtype t, uint8_t c)
{
    return t == FM_DTYPE_E4M3 ? (c & 0x7Fu) == 0x7Fu : t == FM_DTYPE_E5M2 ? (c & 0x7Cu) == 0x7Cu : 0;
}

/* Magnitude bits of a code (sign dropped; E2M1 in the low nibble). */
FM_HD uint8_t fm_elem_code_mag(fm_dtype t, uint8_t c)
{
    return t == FM_DTYPE_E2M1 ? (uint8_t)(c & 0x7u) : (uint8_t)(c & 0x7Fu);
}

/* The power-of-two rule's exponent for one finite nonzero element code taken
 * alone, for an output element dtype `out` (no clamping is reached: single
 * codes lie in [2^-16, 57344]). With `floor_rule`, the OCP floor rule. The
 * block exponent is then max(code_exp + p_in) over the block, clamped to
 * [-127, 127]: the rules are monotone and commute with exact power-of-two
 * shifts, so this equals the rule applied to the block's true amax. */
FM_HD int fm_code_scale_exp(fm_dtype in, uint8_t code, fm_dtype out, int floor_rule)
{
    float a = fm_f32_abs(fm_elem_decode(in, code));
    return floor_rule ? fm_mx_floor_scale_exp(a, out) : fm_pow2_scale_exp(a, out);
}

/* The output code for input `code` shifted by 2^d (d = p_in - p_out):
 * RNE + satfinite of an exactly representable F32 product. Shifts below
 * -149 leave nothing of an FP8/FP4 value: the F32 product then still rounds
 * to the same (zero) code. */
FM_HD uint8_t fm_requant_code(fm_dtype in, uint8_t code, int d, fm_dtype out)
{
    if (d < -149)
        d = -149;
    if (d > 127)
        d = 127;
    return fm_elem_encode(out, fm_elem_decode(in, code) * fm_exp2i(d));
}

/* ---- scale array geometry -----------------------------------------------
 * R x C is one STORED matrix (after the layout); r, c a stored element. */

FM_HD int64_t fm_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
FM_HD int64_t fm_round_up(int64_t a, int64_t b) { return fm_cdiv(a, b) * b; }

FM_HD int fm_mode_block_cols(fm_scale_mode m)
{
    return m == FM_SCALE_BLOCK_1x128 || m == FM_SCALE_BLOCK_128x128 ? 128
         : m == FM_SCALE_MX32 ? 32 : m == FM_SCALE_NV16 ? 16 : 0;
}

/* Scale entries of one stored matrix, GEMM-layout padding included. */
FM_HD int64_t fm_scale_count_2d(fm_scale_mode m, fm_scale_layout l, int64_t R, int64_t C)
{
    switch (m) {
    case FM_SCALE_TENSOR: return 1;
    case FM_SCALE_ROW: return R;
    case FM_SCALE_BLOCK_1x128:
        return l == FM_SCALE_LAYOUT_GEMM ? fm_cdiv(C, 128) * fm_round_up(R, 4) : R * fm_cdiv(C, 128);
    case FM_SCALE_BLOCK_128x128:
        return l == FM_SCALE_LAYOUT_GEMM ? fm_cdiv(R, 128) * fm_round_up(fm_cdiv(C, 128), 4)
                                         : fm_cdiv(R, 128) * fm_cdiv(C, 128);
    case FM_SCALE_MX32:
        return l == FM_SCALE_LAYOUT_GEMM ? fm_round_up(R, 128) * fm_round_up(fm_cdiv(C, 32), 4)
                                         : R * fm_cdiv(C, 32);
    case FM_SCALE_NV16: return R * fm_cdiv(C, 16);
    default: return 0;
    }
}

/* Padding entries of one matrix's scale array in layout l: entries that
 * hold no block's scale (always 0 for the compact layout). */
FM_HD int64_t fm_scale_padding_2d(fm_scale_mode m, fm_scale_layout l, int64_t R, int64_t C)
{
    return fm_scale_count_2d(m, l, R, C) - fm_scale_count_2d(m, FM_SCALE_LAYOUT_COMPACT, R, C);
}

/* Entry of row rt (0 <= rt < 128) and block b (0..3) inside one 512-byte
 * tile of the MX32 GEMM layout: cuBLAS's swizzle keeps rows rt, rt + 32,
 * rt + 64, rt + 96 in one 16-byte line, so a row's four blocks are one word. */
FM_HD int fm_mx32_gemm_entry(int rt, int b)
{
    return (rt & 31) * 16 + (rt >> 5) * 4 + b;
}

/* Offset of the scale of stored element (r, c) in one matrix's scale array.
 * GEMM layouts: BLOCK_1x128 is [ceil(C/128)][round_up(R, 4)] (R contiguous,
 * cuBLASLt VEC128); BLOCK_128x128 is [ceil(R/128)][round_up(ceil(C/128), 4)]
 * (cuBLASLt BLK128x128); MX32 is cuBLAS's 128 x 4 swizzled tiles of 512 bytes. */
FM_HD int64_t fm_scale_offset(fm_scale_mode m, fm_scale_layout l, int64_t R, int64_t C,
                              int64_t r, int64_t c)
{
    switch (m) {
    case FM_SCALE_TENSOR: return 0;
    case FM_SCALE_ROW: return r;
    case FM_SCALE_BLOCK_1x128:
        return l == FM_SCALE_LAYOUT_GEMM ? (c / 128) * fm_round_up(R, 4) + r
                                         : r * fm_cdiv(C, 128) + c / 128;
    case FM_SCALE_BLOCK_128x128:
        return l == FM_SCALE_LAYOUT_GEMM ? (r / 128) * fm_round_up(fm_cdiv(C, 128), 4) + c / 128
                                         : (r / 128) * fm_cdiv(C, 128) + c / 128;
    case FM_SCALE_MX32:
        if (l == FM_SCALE_LAYOUT_GEMM) {
            int64_t cb = c / 32, ncb4 = fm_round_up(fm_cdiv(C, 32), 4) / 4;
            int64_t tile = (r / 128) * ncb4 + cb / 4;
            return tile * 512 + fm_mx32_gemm_entry((int)(r % 128), (int)(cb % 4));
        }
        return r * fm_cdiv(C, 32) + c / 32;
    case FM_SCALE_NV16: return r * fm_cdiv(C, 16) + c / 16;
    default: return 0;
    }
}

#endif
