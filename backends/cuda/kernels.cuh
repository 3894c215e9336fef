/* Device helpers shared by the CUDA kernels and the GPU tests that prove them.
 *
 * format.h is the specification; where a hardware instruction replaces one
 * of its functions for speed, tests/gpu/test_cuda_hw_fp8_cvt_equals_codec.cu
 * checks that the two agree on every F32 bit pattern (NaN aside: every path
 * that could feed a NaN into these picks the NaN code explicitly). */
#ifndef FLOWMOE_CUDA_KERNELS_CUH
#define FLOWMOE_CUDA_KERNELS_CUH

#include <stdint.h>

#include "flowmoe/format.h"

#define FM_DI static __device__ __forceinline__

/* Two F32 -> two E4M3 / E5M2 codes, `lo` in the low byte: cvt.rn.satfinite. */
FM_DI uint32_t fm_hw_e4m3x2(float lo, float hi)
{
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
}

FM_DI uint32_t fm_hw_e5m2x2(float lo, float hi)
{
    unsigned short d;
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
}

/* E2M1 has no conversion instruction on Hopper; integer RNE instead, all
 * full-rate instructions. |y| >= 1: drop 22 of the fraction bits of |y| / 2^-1
 * rebiased so the exponent field counts E2M1 exponents, ties to even, clamp
 * to 7 (satfinite; Inf too). |y| < 1: the code is RNE(2|y|), an integer in
 * [0, 2], found by adding 2^23 (one FMA: 2|y| is exact, so the one rounding
 * is the RNE of the sum). */
FM_DI uint32_t fm_fast_e2m1(float y)
{
    const uint32_t u = __float_as_uint(y), ab = u & 0x7FFFFFFFu;
    const uint32_t t = ab - 0x3F000000u;
    uint32_t hi = (t + 0x1FFFFFu + ((t >> 22) & 1u)) >> 22;
    hi = hi < 7u ? hi : 7u;
    const uint32_t lo = __float_as_uint(__fmaf_rn(__uint_as_float(ab), 2.0f, 8388608.0f)) - 0x4B000000u;
    return (ab >= 0x3F800000u ? hi : lo) | ((u >> 28) & 8u);
}

/* |y| rounded to the E2M1 grid (satfinite, RNE), times 2^-6, with y's sign:
 * adding and subtracting a power of two whose ulp is the grid step of |y|'s
 * binade (0.5 below 2, then 1, then 2) rounds to nearest even in one F32 add.
 * The 2^-6 puts E2M1's smallest normal on E4M3's, so the result is exact in
 * E4M3 and its E4M3 code holds the E2M1 code in bits 2-4 (and the sign in 7). */
FM_DI float fm_e2m1_grid_e4m3(float y)
{
    const float a = fminf(fabsf(y) * 0x1p-6f, 0x1.8p-4f); /* 6 * 2^-6; NaN and Inf give 6 */
    uint32_t e = (__float_as_uint(a) & 0x7F800000u) + (22u << 23);
    e = e > 0x3C800000u + (22u << 23) ? e : 0x3C800000u + (22u << 23);
    const float m = __uint_as_float(e);
    const float r = __fsub_rn(__fadd_rn(a, m), m);
    return __uint_as_float(__float_as_uint(r) | (__float_as_uint(y) & 0x80000000u));
}

/* Eight F32 -> eight E2M1 codes, element i in bits 4i..4i+3: the bits of
 * fm_fast_e2m1 (NaN aside), with one cvt per two elements. */
FM_DI uint32_t fm_fast_e2m1x8(const float *y)
{
    float g[8];
#pragma unroll
    for (int i = 0; i < 8; i++)
        g[i] = fm_e2m1_grid_e4m3(y[i]);
    /* even elements in one word, odd in the other: byte i holds element 2i (2i+1) */
    const uint32_t we = fm_hw_e4m3x2(g[0], g[2]) | (fm_hw_e4m3x2(g[4], g[6]) << 16);
    const uint32_t wo = fm_hw_e4m3x2(g[1], g[3]) | (fm_hw_e4m3x2(g[5], g[7]) << 16);
    const uint32_t ne = ((we >> 2) & 0x07070707u) | ((we >> 4) & 0x08080808u);
    const uint32_t no = ((wo >> 2) & 0x07070707u) | ((wo >> 4) & 0x08080808u);
    return ne | (no << 4);
}

/* fm_bf16x2_e2m1's multiplier word for the block multipliers 2^k_lo and
 * 2^k_hi (k in [-126, 127], as every MX32 block's): the BF16 bits of each,
 * which are the high halves of their F32 bits. A NaN multiplier (a
 * non-finite block) gives codes the caller replaces. */
FM_DI uint32_t fm_e2m1_mul2(float lo, float hi)
{
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
}
/* ... and its exponent word: each half plus (133 - 254) << 7. */
FM_DI uint32_t fm_e2m1_mexp(uint32_t mul) { return __vadd2(mul, 0xC380C380u); }

/* fm_bf16x2_e2m1: two BF16 values (low half first) times 2^k_lo and 2^k_hi
 * -> their two E2M1 codes in bits 0-3 and 16-19, equal to fm_e2m1_from_f32 of the F32
 * product wherever |x| 2^k < 8, which the POW2 and MX_FLOOR rules keep for
 * every element of a finite block; a half outside that (a non-finite
 * block's) gets some code but leaves the other half's alone. mul: the BF16
 * bits of 2^k in each half, mexp: fm_e2m1_mexp of it. One BF16 FMA rounds:
 * s = x 2^k + M' with M = 2^(e + 6) for |x| 2^k in [2^e, 2^(e+1)) (floor
 * 2^6), whose BF16 ulp is the E2M1 step of that binade, so the FMA's RNE is
 * the E2M1 one and s's mantissa field counts steps above M; M' = M (1 + 2d
 * / 128), d = e_M - 6 in {0, 1, 2}, adds the code of the binade's first
 * grid point, so the field is the E2M1 magnitude code (8 where MX_FLOOR
 * lets a value round past 6: clamped to 7, satfinite). Every integer step
 * stays inside its 16-bit half: u is in [0x4280, 0x7FFF] per half, so
 * u - 0x4280 borrows from no other half and u plus the offset stays below
 * 0x8100. fm_bf16x2_e2m1_mp gives M' without a sign. Checked for every BF16
 * x and k by tests/gpu/test_cuda_hw_fp8_cvt_equals_codec.cu, with Inf and
 * NaN beside in the other half, the sums' packing on random words too. */
FM_DI uint32_t fm_bf16x2_e2m1_mp(uint32_t x, uint32_t mexp)
{
    const uint32_t u = __viaddmax_s16x2(x & 0x7F807F80u, mexp, 0x42804280u); /* e_M << 7, biased */
    return u + ((u - 0x42804280u) >> 6);
}

/* s = x 2^k + M' with M' of x's sign (joined by OR: a plain add would carry
 * out of a half whose value is out of range), so s has it too: each half's
 * bits 0-3 hold the magnitude code, bit 15 the sign. */
FM_DI uint32_t fm_bf16x2_e2m1_sum(uint32_t x, uint32_t mul, uint32_t mexp)
{
    const uint32_t mp = fm_bf16x2_e2m1_mp(x, mexp) | (x & 0x80008000u);
    uint32_t s;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(s) : "r"(x), "r"(mul), "r"(mp));
    return s;
}

/* s = |x| 2^k + M': the magnitude alone, the sign left in x for the
 * packing (fm_e2m1_sums_row / _cols). The abs is an HFMA2 on the FMA pipe
 * where _sum's sign takes a LOP3 on the integer ALU, which the POW2 E2M1
 * row+col quantize saturates: 282.0-282.7 -> 279.9-280.2 us (S29-1, H100).
 * Moving M' to the FMA pipe too (0x4280 + ((65 t) >> 6) by an IMAD, t =
 * 128 d from a VIADDMNMX with floor 0: one ALU instruction a pair fewer)
 * measured no faster (S29-1, 276.3-276.7 against 276.4-276.9 us) and needs
 * a non-finite column's multiplier that keeps t = 0 in its half. */
FM_DI uint32_t fm_bf16x2_e2m1_mag(uint32_t x, uint32_t mul, uint32_t mexp)
{
    const uint32_t mp = fm_bf16x2_e2m1_mp(x, mexp);
    uint32_t s;
    asm("{\n\t.reg .b32 a;\n\tabs.bf16x2 a, %1;\n\tfma.rn.bf16x2 %0, a, %2, %3;\n\t}"
        : "=r"(s)
        : "r"(x), "r"(mul), "r"(mp));
    return s;
}

FM_DI uint32_t fm_bf16x2_e2m1(uint32_t x, uint32_t mul, uint32_t mexp)
{
    const uint32_t s = fm_bf16x2_e2m1_sum(x, mul, mexp);
    return __vminu2(s & 0x000F000Fu, 0x00070007u) | ((s >> 12) & 0x00080008u);
}

/* Four E2M1 codes from two fm_bf16x2_e2m1_mag results a, b whose magnitude
 * codes are at most 7 (no value past 6, as under the POW2 rule), and the
 * BF16 words xa, xb they came from: the code bytes (byte 0 or 2 of a half)
 * picked by SEL (a's bytes 0-3, b's 4-7), each with its element's sign in
 * bit 3 (a sign-replicating PRMT of the same halves' high bytes in x),
 * then byte 2 added onto byte 0 and byte 3 onto byte 1 as their high
 * nibbles (one LEA.HI). The low 16 bits hold the four nibbles; the rest is
 * not read. The shift-adds here and in fm_bf16x2_e2m1_mp as IMAD.HI
 * (mad.hi by 2^k + 1, which ptxas cannot turn back into an ALU shift), to
 * unload the integer ALU, measured slower: each took an IMAD.MOV for its
 * 64-bit addend (S28-5: 303.5 us against 290.0 with both as shifts). */
template <uint32_t SEL>
FM_DI uint32_t fm_e2m1_nib4(uint32_t a, uint32_t b, uint32_t xa, uint32_t xb)
{
    uint32_t g, x;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(g) : "r"(xa), "r"(xb), "n"(SEL + 0x9999u));
    x = (__byte_perm(a, b, SEL) & 0x07070707u) | (g & 0x08080808u);
    return x + (x >> 12);
}

/* Four fm_bf16x2_e2m1_mag results of one row (s[q]: elements 2q, 2q + 1
 * of the BF16 words x[q]), codes at most 7 -> the row's eight codes,
 * element i in bits 4i..4i+3: the same bits as fm_e2m1_pairs_row of
 * fm_bf16x2_e2m1, with about half the integer ALU instructions a pair. */
FM_DI uint32_t fm_e2m1_sums_row(const uint32_t s[4], const uint32_t x[4])
{
    /* bytes: elements 0, 2, 1, 3, so the shift puts 1 over 0 and 3 over 2 */
    return __byte_perm(fm_e2m1_nib4<0x6240u>(s[0], s[1], x[0], x[1]),
                       fm_e2m1_nib4<0x6240u>(s[2], s[3], x[2], x[3]), 0x5410);
}

/* Eight fm_bf16x2_e2m1_mag results of one column pair (s[k]: row k of
 * columns 2q and 2q + 1, from the BF16 word x[k]), codes at most 7 -> each
 * column's eight codes, row k in bits 4k..4k+3 (as fm_e2m1_pairs_cols of
 * fm_bf16x2_e2m1). */
FM_DI void fm_e2m1_sums_cols(const uint32_t s[8], const uint32_t x[8], uint32_t *col_lo, uint32_t *col_hi)
{
    /* w[j]: byte 0 rows 2j, 2j + 1 of the low column, byte 1 of the high */
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; j++)
        w[j] = fm_e2m1_nib4<0x6420u>(s[2 * j], s[2 * j + 1], x[2 * j], x[2 * j + 1]);
    const uint32_t p = __byte_perm(w[0], w[1], 0x5140), q = __byte_perm(w[2], w[3], 0x5140);
    *col_lo = __byte_perm(p, q, 0x5410);
    *col_hi = __byte_perm(p, q, 0x7632);
}

/* Four fm_bf16x2_e2m1 results of one row's elements (c[q]: 2q and 2q+1
 * in bytes 0 and 2, at most 15 each; bytes 1 and 3 are not read, so
 * fm_fp8x8_e2m1's sums pass as they are) -> the row's eight codes, element i
 * in bits 4i..4i+3. Bytes 0 and 2 of c[0], c[1] interleaved by one PRMT
 * (elements 0, 2, 1, 3 in bytes 0-3), then the high pair shifted onto the
 * low one by one LEA.HI: the add is an OR there, its nibbles do not meet. */
FM_DI uint32_t fm_e2m1_pairs_row(const uint32_t c[4])
{
    uint32_t x = __byte_perm(c[0], c[1], 0x6240), y = __byte_perm(c[2], c[3], 0x6240);
    x += x >> 12;
    y += y >> 12;
    return __byte_perm(x, y, 0x5410);
}

/* Eight fm_bf16x2_e2m1 results of one column pair (c[k]: row k of columns
 * 2q and 2q+1) -> each column's eight codes, row k in bits 4k..4k+3. */
FM_DI void fm_e2m1_pairs_cols(const uint32_t c[8], uint32_t *col_lo, uint32_t *col_hi)
{
    uint32_t a = 0, b = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        a |= c[k] << (4 * k);
        b |= c[k + 4] << (4 * k);
    }
    *col_lo = __byte_perm(a, b, 0x5410);
    *col_hi = __byte_perm(a, b, 0x7632);
}

/* 2^k as a half-precision number in both halves, k in [-24, 15]
 * (subnormal below -14). */
FM_DI uint32_t fm_h2_pow2(int k)
{
    const uint32_t h = k >= -14 ? (uint32_t)(k + 15) << 10 : 1u << (k + 24);
    return h | (h << 16);
}

/* The three multipliers fm_fp8x8_e2m1 takes for a shift d in [-23, 14]:
 * 2^(d + 1), 2^d and 2^(d - 1) as half-precision pairs. */
typedef struct fm_h2_shift3 {
    uint32_t up, at, down;
} fm_h2_shift3;

FM_DI fm_h2_shift3 fm_h2_shift3_of(int d)
{
    fm_h2_shift3 m;
    m.up = fm_h2_pow2(d + 1);
    m.at = fm_h2_pow2(d);
    m.down = fm_h2_pow2(d - 1);
    return m;
}

/* The same for d in [-13, 14], where all three are normal: without
 * fm_h2_pow2's subnormal branch (the MXFP4 transpose's shifts, 6 to 14). */
FM_DI fm_h2_shift3 fm_h2_shift3_normal(int d)
{
    fm_h2_shift3 m;
    m.at = ((uint32_t)(d + 15) << 10) * 0x10001u;
    m.up = m.at + 0x04000400u;
    m.down = m.at - 0x04000400u;
    return m;
}

/* fm_fp8x8_e2m1's two parts (below): a pair of exact half-precision values
 * h (elements 2q, 2q + 1) times 2^d -> their magnitude codes, each in the
 * low byte of its half (1024 + code) ... */
template <bool CLAMP>
FM_DI uint32_t fm_h2_e2m1_mag(uint32_t h, fm_h2_shift3 m)
{
    uint32_t s;
    asm("{ .reg .b32 a, x, y, z; abs.f16x2 a, %1;\n\t"
        "fma.rn.f16x2 x, a, %2, %5;\n\t"
        "fma.rn.f16x2 y, a, %3, %6;\n\t"
        "fma.rn.f16x2 z, a, %4, %7;\n\t"
        "min.f16x2 x, x, y;\n\t"
        "min.f16x2 %0, x, z; }"
        : "=r"(s)
        : "r"(h), "r"(m.up), "r"(m.at), "r"(m.down), "r"(0x64006400u), "r"(0x64026402u), "r"(0x64046404u));
    if (CLAMP)
        asm("min.f16x2 %0, %1, %2;" : "=r"(s) : "r"(s), "r"(0x64076407u)); /* 1024 + 7 */
    return s;
}

/* ... and the eight codes of four pairs c[q] (elements 2q, 2q + 1), with
 * the signs of w0 and w1's bytes' bit 7 (byte i = element i), as FP8 codes
 * have them. The MXFP4 transpose calls the two with each row's values
 * already multiplied by their row's own power of two (exactly). */
FM_DI uint32_t fm_e2m1_signed_row(const uint32_t (&c)[4], uint32_t w0, uint32_t w1)
{
    uint32_t even, odd; /* byte j: 0xFF where element 2j (2j + 1) is negative */
    asm("prmt.b32 %0, %1, %2, 0xECA8;" : "=r"(even) : "r"(w0), "r"(w1));
    asm("prmt.b32 %0, %1, %2, 0xFDB9;" : "=r"(odd) : "r"(w0), "r"(w1));
    /* r | (even & 0x08080808) | (odd & 0x80808080) as two LOP3s (a | b & c:
     * 0xF8); written in C the compiler takes three */
    uint32_t r = fm_e2m1_pairs_row(c);
    asm("lop3.b32 %0, %1, %2, 0x08080808, 0xF8;" : "=r"(r) : "r"(r), "r"(even));
    asm("lop3.b32 %0, %1, %2, 0x80808080, 0xF8;" : "=r"(r) : "r"(r), "r"(odd));
    return r;
}

/* Eight FP8 codes of dtype TI (two words, byte i = element i) times 2^d ->
 * eight E2M1 codes, element i in bits 4i..4i+3, equal to fm_e2m1_from_f32
 * of the exact product, for d in [-23, 14] (m = fm_h2_shift3_of(d): its
 * multipliers are half-precision numbers there). The E2M1 magnitude code
 * of v = |x| 2^d is min(RNE(2v), RNE(v) + 2, RNE(v / 2) + 4): each term is
 * the code where its binade's step is the grid's ([0, 2), [2, 4), [4, 6]),
 * and elsewhere the larger one, as RNE is monotonic. Each term is one
 * half-precision FMA onto 1024 + 2j, where the ulp is 1: an FP8 value has
 * at most 4 significant bits and the product is exact inside the FMA, so
 * its one rounding is the grid's RNE, ties to even included (1024 + 2j
 * keeps the parity), and the sum's low byte is the term. A pair of codes
 * takes one cvt (of a word's lower or upper half: F2FP reads .H1 itself),
 * three FMAs and one three-way minimum (VHMNMX); the S27 form took the
 * binade from the exponent bits, three integer instructions a pair more:
 * the row conversion 1x128 -> E2M1, trusted, 112.4 -> 109.0 us (H200,
 * S37-3). With CLAMP the minimum with 1031 (code 7) saturates as
 * satfinite rounds (an overflow to Inf included); without, the caller knows
 * no product passes 6. The signs come from the codes' bit 7 by two
 * sign-replicating PRMTs, after the packing. The word must be one a block
 * can hold: a NaN code, or without CLAMP a product past 6, may spill into
 * its neighbours' codes (the callers write non-finite blocks themselves).
 * Checked for every code in every place, every d, with and without CLAMP,
 * by tests/gpu/test_cuda_hw_fp8_cvt_equals_codec.cu. */
template <int TI, bool CLAMP>
FM_DI uint32_t fm_fp8x8_e2m1(uint32_t w0, uint32_t w1, fm_h2_shift3 m)
{
    uint32_t c[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const uint32_t wq = q < 2 ? w0 : w1;
        uint32_t h;
        if (TI == FM_DTYPE_E4M3) {
            if (q & 1)
                asm("{ .reg .b16 l, u; mov.b32 {l, u}, %1; cvt.rn.f16x2.e4m3x2 %0, u; }" : "=r"(h) : "r"(wq));
            else
                asm("{ .reg .b16 l, u; mov.b32 {l, u}, %1; cvt.rn.f16x2.e4m3x2 %0, l; }" : "=r"(h) : "r"(wq));
        } else {
            h = __byte_perm(wq, 0u, q & 1 ? 0x3424 : 0x1404); /* an E5M2 code is the high byte of its F16 */
        }
        c[q] = fm_h2_e2m1_mag<CLAMP>(h, m);
    }
    return fm_e2m1_signed_row(c, w0, w1);
}

/* fm_e2m1x8_as_e4m3's bytes (below) in another order, byte i of `even`
 * element 2i, of `odd` element 2i + 1: a magnitude code m is the byte
 * m << 2, so each word takes two shifts of the codes and one LOP3 (the
 * MXFP4 transpose reads its transposed bytes so: a byte's two codes are
 * neighbouring columns of one row). Built into fm_e2m1x8_as_e4m3 by two
 * PRMTs, the row conversion E2M1 MX32 -> E4M3 MX32 ran 101.7 -> 115.3 us
 * (H200, S40-4), so that one keeps its own form; the codec test checks
 * both for every code in every place. */
FM_DI void fm_e2m1x8_as_e4m3_split(uint32_t w, uint32_t *even, uint32_t *odd)
{
    *even = ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
    *odd = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}

/* Eight E2M1 codes (one word) as the E4M3 codes of the same values times
 * 2^-6 (two words, byte i = element i): E2M1's sign, exponent and mantissa
 * bits placed in E4M3's sign, low exponent and high mantissa bits, so that
 * E2M1's subnormal 0.5 lands on E4M3's subnormal 2^-7. Each code's
 * magnitude selects its byte from a table by one PRMT (the nibbles are the
 * selector); the signs come from a PRMT that puts element 2j's byte and the
 * sign-replicated byte of element 2j + 1 side by side, shifted so that
 * their bit 3 lands on bit 7. */
FM_DI void fm_e2m1x8_as_e4m3(uint32_t w, uint32_t *lo, uint32_t *hi)
{
    const uint32_t sel = w & 0x77777777u;
    uint32_t mlo, mhi, zlo, zhi;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(mlo) : "r"(0x0C080400u), "r"(0x1C181410u), "r"(sel));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(mhi) : "r"(0x0C080400u), "r"(0x1C181410u), "r"(sel >> 16));
    asm("prmt.b32 %0, %1, 0, 0x9180;" : "=r"(zlo) : "r"(w));
    asm("prmt.b32 %0, %1, 0, 0xB3A2;" : "=r"(zhi) : "r"(w));
    *lo = mlo | ((zlo << 4) & 0x80808080u);
    *hi = mhi | ((zhi << 4) & 0x80808080u);
}

/* E2M1 codes times 2^d into FP8 codes TO when every product is a normal
 * FP8 value no larger than the format's largest: E2M1's one mantissa bit
 * fits in FP8's, so the code of v 2^d is the code of v with d added to its
 * exponent field, and one PRMT per four codes picks them from an eight-byte
 * table (magnitude 0 stays 0); the signs are the words' bit 7 (e: the
 * words of fm_e2m1x8_as_e4m3). w: the four E2M1 words, o: eight FP8 words.
 * A d too large for the words' largest magnitude carries a table byte into
 * the next, larger one: only bytes of magnitudes the words do not hold.
 * The row conversion out of MXFP4 took 124 instructions a segment to encode
 * through F32 products before (rq_encode_row), 21 now: E2M1 MX32 -> E4M3
 * MX32 104.3 -> 101.8 us, -> E4M3 1x128 101.8 -> 100.5 (H200, S37-6). */
template <int TO>
FM_DI void fm_e2m1x8_to_fp8(const uint32_t (&w)[4], const uint32_t (&e)[8], int d, uint32_t (&o)[8])
{
    /* codes of 0, 0.5, 1, 1.5 and 2, 3, 4, 6; one binade adds 8 (E4M3) or 4 (E5M2) */
    const uint32_t step = (uint32_t)(d * (TO == FM_DTYPE_E4M3 ? 8 : 4));
    const uint32_t t0 = (TO == FM_DTYPE_E4M3 ? 0x3C383000u : 0x3E3C3800u) + step * 0x01010100u;
    const uint32_t t1 = (TO == FM_DTYPE_E4M3 ? 0x4C484440u : 0x46444240u) + step * 0x01010101u;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const uint32_t sel = w[k] & 0x77777777u;
        uint32_t a, b;
        asm("prmt.b32 %0, %1, %2, %3;" : "=r"(a) : "r"(t0), "r"(t1), "r"(sel));
        asm("prmt.b32 %0, %1, %2, %3;" : "=r"(b) : "r"(t0), "r"(t1), "r"(sel >> 16));
        o[2 * k] = a | (e[2 * k] & 0x80808080u);
        o[2 * k + 1] = b | (e[2 * k + 1] & 0x80808080u);
    }
}

/* Two F32 -> BF16 / F16 (RNE, F16 overflows to Inf) through the hardware
 * cvt, NaN made canonical as format.h requires; low half = lo. */
FM_DI uint32_t fm_hw_bf16x2(float lo, float hi)
{
    uint32_t d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    if (lo != lo)
        d = (d & 0xFFFF0000u) | FM_BF16_CANON_NAN;
    if (hi != hi)
        d = (d & 0x0000FFFFu) | (FM_BF16_CANON_NAN << 16);
    return d;
}

FM_DI uint32_t fm_hw_f16x2(float lo, float hi)
{
    uint32_t d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    if (lo != lo)
        d = (d & 0xFFFF0000u) | FM_F16_CANON_NAN;
    if (hi != hi)
        d = (d & 0x0000FFFFu) | (FM_F16_CANON_NAN << 16);
    return d;
}

/* Two FP8 codes (low byte first) -> two exact F32 values, through F16
 * (every E4M3 and E5M2 value is an F16 value). NaN codes give some NaN. */
FM_DI void fm_hw_e4m3x2_to_f32(uint32_t two, float *lo, float *hi)
{
    uint32_t h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)two));
    asm("cvt.f32.f16 %0, %1;" : "=f"(*lo) : "h"((unsigned short)(h & 0xFFFFu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(*hi) : "h"((unsigned short)(h >> 16)));
}

FM_DI void fm_hw_e5m2x2_to_f32(uint32_t two, float *lo, float *hi)
{
    /* An E5M2 code is the top byte of the F16 with the same value. */
    asm("cvt.f32.f16 %0, %1;" : "=f"(*lo) : "h"((unsigned short)((two & 0xFFu) << 8)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(*hi) : "h"((unsigned short)(two & 0xFF00u)));
}

/* One E2M1 nibble -> F32 (exact): magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}. */
FM_DI float fm_fast_e2m1_to_f32(uint32_t nib)
{
    uint32_t e = (nib >> 1) & 3u, m = nib & 1u;
    uint32_t mag = e ? ((e + 126u) << 23) | (m << 22) : (m ? 0x3F000000u : 0u);
    return __uint_as_float(mag | ((nib & 8u) << 28));
}

FM_DI float fm_hw_f16_to_f32(uint16_t h)
{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

/* Eight codes of one element dtype from eight F32 values already multiplied
 * by the block's multiplier: FP8 -> 8 bytes (uint2), E2M1 -> 4 bytes (x). */
template <int ELEM>
FM_DI uint2 fm_encode8(const float *y)
{
    uint2 r;
    if (ELEM == FM_DTYPE_E4M3) {
        r.x = fm_hw_e4m3x2(y[0], y[1]) | (fm_hw_e4m3x2(y[2], y[3]) << 16);
        r.y = fm_hw_e4m3x2(y[4], y[5]) | (fm_hw_e4m3x2(y[6], y[7]) << 16);
    } else if (ELEM == FM_DTYPE_E5M2) {
        r.x = fm_hw_e5m2x2(y[0], y[1]) | (fm_hw_e5m2x2(y[2], y[3]) << 16);
        r.y = fm_hw_e5m2x2(y[4], y[5]) | (fm_hw_e5m2x2(y[6], y[7]) << 16);
    } else {
        r.x = fm_fast_e2m1x8(y);
        r.y = 0;
    }
    return r;
}

/* The code bytes every element of a non-finite block gets, replicated. */
template <int ELEM>
FM_DI uint32_t fm_nan_word()
{
    return ELEM == FM_DTYPE_E4M3 ? 0x7F7F7F7Fu : ELEM == FM_DTYPE_E5M2 ? 0x7E7E7E7Eu : 0u;
}

/* A block's multiplier and stored scale from its amax bits, exactly as the
 * CPU's choose_scales: NaN multiplier marks a non-finite block. */
FM_DI float fm_pick_scale(uint32_t abits, float eps, int rule, int elem, float *s32, uint8_t *s8)
{
    if (abits >= 0x7F800000u) {
        *s32 = fm_bits_f32(FM_F32_CANON_NAN);
        *s8 = (uint8_t)FM_E8M0_NAN;
        return fm_bits_f32(FM_F32_CANON_NAN);
    }
    float a = fm_bits_f32(abits);
    if (a < eps)
        a = eps;
    if (rule == FM_SCALE_RULE_EXACT) {
        float m = fm_exact_scale(a, (fm_dtype)elem);
        *s32 = __fdiv_rn(1.0f, m);
        *s8 = 0;
        return m;
    }
    int pw = rule == FM_SCALE_RULE_MX_FLOOR ? fm_mx_floor_scale_exp(a, (fm_dtype)elem)
                                            : fm_pow2_scale_exp(a, (fm_dtype)elem);
    *s32 = fm_exp2i(pw);
    *s8 = (uint8_t)(pw + 127);
    return fm_exp2i(-pw);
}

/* fm_pick_scale for the POW2 rule and an element type known at compile
 * time, the common case in integer operations. With t = bits(a) +
 * (0x7FFFFF - max_frac), the exponent field E of t is a's exponent plus 1
 * exactly when a's fraction exceeds the element maximum's, so the scale
 * exponent is pw = E - 127 - emax: the scale 2^pw has the bits
 * (E - emax) << 23 and the multiplier 2^-pw the bits (254 + emax - E) << 23,
 * both normal while E > emax and a is finite (pw in [-126, 120], where
 * fm_pow2_scale_exp's clamps and fm_exp2i's subnormal branch do not act).
 * Zero, tiny, non-finite blocks take fm_pick_scale. */
template <int ELEM>
FM_DI float fm_pick_scale_pow2(uint32_t abits, float eps, float *s32, uint8_t *s8)
{
    const int emax = ELEM == FM_DTYPE_E4M3 ? 8 : ELEM == FM_DTYPE_E5M2 ? 15 : 2;
    const uint32_t add = ELEM == FM_DTYPE_E2M1 ? 0x3FFFFFu : 0x1FFFFFu; /* 0x7FFFFF - max_frac */
    const float a = fm_bits_f32(abits);
    const uint32_t u = fm_f32_bits(a < eps ? eps : a); /* NaN stays NaN (and goes the long way) */
    const uint32_t ef = (u + add) & 0x7F800000u;
    if (u < 0x7F800000u && ef > ((uint32_t)emax << 23)) {
        *s32 = fm_bits_f32(ef - ((uint32_t)emax << 23));
        *s8 = (uint8_t)((ef >> 23) - emax);
        return fm_bits_f32(((uint32_t)(254 + emax) << 23) - ef);
    }
    return fm_pick_scale(abits, eps, FM_SCALE_RULE_POW2, ELEM, s32, s8);
}

/* The same results without a branch, for every block maximum: where
 * E - emax (the E8M0 code e8 = pw + 127) is below 1 (a below 2^(emax - 126)
 * or subnormal, whose t keeps E <= 1) the rule's clamp at -127 gives e8 = 0;
 * a = 0 gives pw = 0 (e8 = 127); E never passes 255, so pw stays below 127
 * and the multiplier 2^-pw, bits (254 - e8) << 23, is normal. The scale 2^pw
 * is e8 << 23, or 2^-127 (subnormal) for e8 = 0. A NaN or infinite maximum
 * gives NaNs and the E8M0 NaN, as fm_pick_scale does. Quantize's tile kernels
 * take this one ([32768, 7168] MX32 E4M3 row+col 352.1-353.6 -> 351.5-351.7
 * us over its word stores alone, S31-2); the fused SwiGLU kernels keep
 * fm_pick_scale_pow2: 1.7-2.0% slower with this one (S31-9, H100). */
template <int ELEM>
FM_DI float fm_pick_scale_pow2_flat(uint32_t abits, float eps, float *s32, uint8_t *s8)
{
    const uint32_t emax = ELEM == FM_DTYPE_E4M3 ? 8 : ELEM == FM_DTYPE_E5M2 ? 15 : 2;
    const uint32_t add = ELEM == FM_DTYPE_E2M1 ? 0x3FFFFFu : 0x1FFFFFu; /* 0x7FFFFF - max_frac */
    const float a = fm_bits_f32(abits);
    const uint32_t u = fm_f32_bits(a < eps ? eps : a); /* a NaN stays */
    const uint32_t ef = (u + add) >> 23;
    const uint32_t e8 = u == 0 ? 127u : ef > emax ? ef - emax : 0u;
    const bool bad = abits >= 0x7F800000u;
    *s8 = bad ? (uint8_t)FM_E8M0_NAN : (uint8_t)e8;
    *s32 = fm_bits_f32(bad ? FM_F32_CANON_NAN : e8 ? e8 << 23 : 0x400000u);
    return fm_bits_f32(bad ? FM_F32_CANON_NAN : (254u - e8) << 23);
}

/* The inverse of fm_scale_offset within one matrix: which block entry k of a
 * scale array holds, as the stored (r, c) of the block's first element.
 * Returns 0 for padding entries of the GEMM layouts. */
FM_HD int fm_scale_entry(fm_scale_mode m, fm_scale_layout l, int64_t R, int64_t C, int64_t k, int64_t *r,
                         int64_t *c)
{
    int gemm = l == FM_SCALE_LAYOUT_GEMM;
    switch (m) {
    case FM_SCALE_TENSOR: *r = 0; *c = 0; return k == 0;
    case FM_SCALE_ROW: *r = k; *c = 0; return k < R;
    case FM_SCALE_BLOCK_1x128: {
        int64_t ncb = fm_cdiv(C, 128);
        if (gemm) {
            int64_t rp = fm_round_up(R, 4);
            *r = k % rp;
            *c = (k / rp) * 128;
            return *r < R;
        }
        *r = k / ncb;
        *c = (k % ncb) * 128;
        return 1;
    }
    case FM_SCALE_BLOCK_128x128: {
        int64_t ncb = fm_cdiv(C, 128);
        int64_t w = gemm ? fm_round_up(ncb, 4) : ncb;
        int64_t cb = k % w;
        *r = (k / w) * 128;
        *c = cb * 128;
        return cb < ncb;
    }
    case FM_SCALE_MX32: {
        int64_t ncb = fm_cdiv(C, 32);
        if (gemm) {
            int64_t ncb4 = fm_round_up(ncb, 4) / 4, tile = k / 512, w = k % 512;
            int64_t rr = (tile / ncb4) * 128 + ((w % 16) / 4) * 32 + w / 16;
            int64_t cb = (tile % ncb4) * 4 + w % 4;
            *r = rr;
            *c = cb * 32;
            return rr < R && cb < ncb;
        }
        *r = k / ncb;
        *c = (k % ncb) * 32;
        return 1;
    }
    default: *r = 0; *c = 0; return 0;
    }
}

/* Unsigned 32-bit division by a run-time constant (Granlund-Montgomery, as
 * CUTLASS's FastDivmod): one mul.hi and a shift instead of a division loop. */
typedef struct fm_fastdiv {
    uint32_t d, mul, shift;
} fm_fastdiv;

static inline fm_fastdiv fm_fastdiv_make(uint32_t d)
{
    fm_fastdiv f;
    f.d = d;
    f.shift = 0;
    while (f.shift < 32 && ((uint64_t)1 << f.shift) < d)
        f.shift++;
    f.mul = (uint32_t)((((uint64_t)1 << 32) * (((uint64_t)1 << f.shift) - d)) / d + 1);
    return f;
}

FM_DI uint32_t fm_fastdiv_div(fm_fastdiv f, uint32_t n)
{
    if (f.d == 1)
        return n;
    uint32_t t = __umulhi(n, f.mul);
    return (t + ((n - t) >> 1)) >> (f.shift - 1);
}

/* Tile t (< 2^31) of E x ntr x ntc tiles, tile columns fastest: its
 * expert, tile row and tile column (the tile kernels of quantize,
 * dequantize and requantize; requantize's row-segment kernel with segments
 * for tiles). With the two counts and the two outputs swapped, tile rows
 * fastest (requantize's plain transposes, rq_tile<false>). A 64-bit `/` or
 * `%` by a run-time value compiles to a subroutine of about 60
 * instructions, which every thread of a tile kernel would run before its
 * first load. */
FM_DI void fm_tile_place(fm_fastdiv ntc, fm_fastdiv ntr, uint32_t t, uint32_t *e, uint32_t *tr, uint32_t *tc)
{
    const uint32_t tq = fm_fastdiv_div(ntc, t);
    *tc = t - tq * ntc.d;
    *e = fm_fastdiv_div(ntr, tq);
    *tr = tq - *e * ntr.d;
}

/* Programmatic dependent launch (sm_90). A kernel that fm_launch starts with
 * pdl set may begin while the kernel before it in the stream still runs (once
 * each CTA of that one has called fm_pdl_release or exited), so a prologue
 * that reads only older data overlaps that kernel's tail and the launch gap.
 * It must call fm_pdl_wait before it reads what that kernel writes and
 * before its own first write: the wait returns when that kernel has finished
 * and its writes are visible (at once in a kernel launched without pdl). */
FM_DI void fm_pdl_wait(void) { asm volatile("griddepcontrol.wait;" ::: "memory"); }
FM_DI void fm_pdl_release(void) { asm volatile("griddepcontrol.launch_dependents;"); }

/* An L2 cache policy for accesses whose lines should outlive the streamed
 * ones around them (evict_last): data a later kernel of the same op reads
 * again. For ld/st with .L2::cache_hint. */
FM_DI uint64_t fm_l2_keep_policy(void)
{
    uint64_t pol;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}

/* W bytes of v (1, 2 or 4) stored at p; KEEP: under fm_l2_keep_policy. */
template <bool KEEP, int W>
FM_DI void fm_st_keep(void *p, uint32_t v)
{
    if (KEEP) {
        const uint64_t pol = fm_l2_keep_policy();
        if (W == 1)
            asm volatile("st.global.L2::cache_hint.u8 [%0], %1, %2;" ::"l"(p), "r"(v), "l"(pol) : "memory");
        else if (W == 2)
            asm volatile("st.global.L2::cache_hint.b16 [%0], %1, %2;" ::"l"(p), "h"((unsigned short)v), "l"(pol)
                         : "memory");
        else
            asm volatile("st.global.L2::cache_hint.b32 [%0], %1, %2;" ::"l"(p), "r"(v), "l"(pol) : "memory");
    } else if (W == 1) {
        *(uint8_t *)p = (uint8_t)v;
    } else if (W == 2) {
        *(uint16_t *)p = (uint16_t)v;
    } else {
        *(uint32_t *)p = v;
    }
}

template <typename... P, typename... A>
static cudaError_t fm_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, int pdl,
                             A &&...args)
{
    cudaLaunchAttribute at;
    at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t lc = {};
    lc.gridDim = grid;
    lc.blockDim = block;
    lc.dynamicSmemBytes = smem;
    lc.stream = s;
    lc.attrs = &at;
    lc.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&lc, kernel, args...);
}

#endif
