/* The hardware conversions the CUDA kernels use instead of format.h's
 * software codecs give the same bits: cvt.rn.satfinite.{e4m3,e5m2}x2.f32,
 * the integer E2M1 encoder and the eight-wide one built on cvt e4m3x2, cvt.rn.{bf16,f16}x2.f32 with canonical NaN,
 * for ALL 2^32 F32 bit patterns (NaN excepted for the three element encoders:
 * every kernel path that could meet a NaN writes the NaN code itself), and
 * the decoders (every FP8 code, every E2M1 nibble, every F16 value); and
 * the packed BF16 -> E2M1 encoder (fm_bf16x2_e2m1) gives fm_e2m1_from_f32 of
 * the F32 product for every BF16 value and every MX32 multiplier 2^k that
 * a block holding it can have (|x| 2^k < 8), in both halves of the pair; and
 * the row conversions' FP8 -> E2M1 encoder (fm_fp8x8_e2m1) gives
 * fm_e2m1_from_f32 of the exact product for every code, place and shift; and
 * the row conversions' E2M1 -> FP8 path (fm_e2m1x8_as_e4m3 and
 * fm_e2m1x8_to_fp8) gives format.h's codes for every E2M1 code, place and
 * shift; and
 * the POW2 quantize's packing of those sums (fm_e2m1_sums_row / _cols)
 * gives the same for every BF16 value and multiplier, in a random place of
 * a row and of a column pair; and
 * fm_pick_scale_pow2 (the POW2 scale pick of the fused SwiGLU kernels) and
 * fm_pick_scale_pow2_flat (quantize's) give fm_pick_scale's multiplier, F32
 * scale and E8M0 scale for every block maximum (all 2^31 non-negative
 * patterns and the NaNs, with eps 0 and 2^-40). */
#include <stdio.h>

#include "../../backends/cuda/kernels.cuh"
#include "gpu_test.h"

enum { E4M3, E5M2, E2M1, BF16, F16, E2M1X8, PICK_E4M3, PICK_E5M2, PICK_E2M1, NENC };

/* 0 when fm_pick_scale_pow2 and fm_pick_scale_pow2_flat both agree with
 * fm_pick_scale on all three results. */
template <int ELEM>
__device__ uint32_t pick_differs(uint32_t abits, float eps)
{
    float s32a, s32b, s32c;
    uint8_t s8a, s8b, s8c;
    const float ma = fm_pick_scale_pow2<ELEM>(abits, eps, &s32a, &s8a);
    const float mc = fm_pick_scale_pow2_flat<ELEM>(abits, eps, &s32c, &s8c);
    const float mb = fm_pick_scale(abits, eps, FM_SCALE_RULE_POW2, ELEM, &s32b, &s8b);
    return __float_as_uint(ma) != __float_as_uint(mb) || __float_as_uint(s32a) != __float_as_uint(s32b) ||
           s8a != s8b || __float_as_uint(mc) != __float_as_uint(mb) ||
           __float_as_uint(s32c) != __float_as_uint(s32b) || s8c != s8b;
}

__global__ void enc_kernel(unsigned long long *bad, unsigned int *first)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < (1ull << 32);
         i += (uint64_t)gridDim.x * blockDim.x) {
        const uint32_t u = (uint32_t)i;
        const float x = __uint_as_float(u);
        const int nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
        /* Pair x with a neighbour so the second lane of each x2 is exercised too. */
        const float y = __uint_as_float(u ^ 0x00400001u);
        const int ynan = ((u ^ 0x00400001u) & 0x7FFFFFFFu) > 0x7F800000u;
        uint32_t got[NENC], want[NENC];
        int skip[NENC] = {nan || ynan, nan || ynan, nan, 0, 0, 0, 0, 0, 0};
        got[E4M3] = fm_hw_e4m3x2(x, y);
        want[E4M3] = fm_e4m3_from_f32(x) | ((uint32_t)fm_e4m3_from_f32(y) << 8);
        got[E5M2] = fm_hw_e5m2x2(y, x);
        want[E5M2] = fm_e5m2_from_f32(y) | ((uint32_t)fm_e5m2_from_f32(x) << 8);
        got[E2M1] = fm_fast_e2m1(x);
        want[E2M1] = fm_e2m1_from_f32(x);
        got[BF16] = fm_hw_bf16x2(x, y);
        want[BF16] = fm_bf16_from_f32(x) | ((uint32_t)fm_bf16_from_f32(y) << 16);
        got[F16] = fm_hw_f16x2(y, x);
        want[F16] = fm_f16_from_f32(y) | ((uint32_t)fm_f16_from_f32(x) << 16);
        /* The eight-wide E2M1 encoder: u lands in every position j through
         * u ^ K_j (K_0 = 0), so every pattern is tried in every position. */
        {
            const uint32_t K[8] = {0u, 0x80000000u, 0x00400001u, 0x00800000u,
                                   0x01000000u, 0x80400000u, 0x00000003u, 0x40000000u};
            float v8[8];
            uint32_t mask = 0;
            want[E2M1X8] = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const uint32_t uj = u ^ K[j];
                v8[j] = __uint_as_float(uj);
                if ((uj & 0x7FFFFFFFu) <= 0x7F800000u) {
                    mask |= 0xFu << (4 * j);
                    want[E2M1X8] |= (uint32_t)fm_e2m1_from_f32(v8[j]) << (4 * j);
                }
            }
            got[E2M1X8] = fm_fast_e2m1x8(v8) & mask;
        }
        {
            /* the sign bit chooses eps; the rest is the block maximum */
            const uint32_t ab = u & 0x7FFFFFFFu;
            const float eps = (u >> 31) ? 9.094947e-13f : 0.0f; /* 2^-40 */
            got[PICK_E4M3] = pick_differs<FM_DTYPE_E4M3>(ab, eps);
            got[PICK_E5M2] = pick_differs<FM_DTYPE_E5M2>(ab, eps);
            got[PICK_E2M1] = pick_differs<FM_DTYPE_E2M1>(ab, eps);
            want[PICK_E4M3] = want[PICK_E5M2] = want[PICK_E2M1] = 0;
        }
        for (int k = 0; k < NENC; k++)
            if (!skip[k] && got[k] != want[k]) {
                if (atomicAdd(&bad[k], 1ull) == 0)
                    first[k] = u;
            }
    }
}

/* The expected code of BF16 x times 2^k, or 16 where no block can hold the
 * pair (|x| 2^k >= 8, or x not finite). */
__device__ uint32_t bf16_e2m1_want(uint32_t x, int k)
{
    const float f = __uint_as_float(x << 16), y = f * fm_exp2i(k);
    if (!(fabsf(f) <= 3.4e38f) || !(fabsf(y) < 8.0f))
        return 16;
    return fm_e2m1_from_f32(y);
}

/* Every BF16 x (the low half) with every k in [-126, 127]; the high half
 * holds another pattern and another k so that both halves see every case. */
__global__ void bf16_e2m1_kernel(unsigned long long *bad, unsigned int *first)
{
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 65536u * 254u)
        return;
    const uint32_t xl = i & 0xFFFFu, xh = (xl * 40503u + 12345u) & 0xFFFFu;
    const int kl = (int)(i >> 16) - 126, kh = (int)(((i >> 16) * 97u + (i & 0xFFu)) % 254u) - 126;
    const uint32_t mul = fm_e2m1_mul2(fm_exp2i(kl), fm_exp2i(kh));
    const uint32_t got = fm_bf16x2_e2m1(xl | (xh << 16), mul, fm_e2m1_mexp(mul));
    const uint32_t wl = bf16_e2m1_want(xl, kl), wh = bf16_e2m1_want(xh, kh);
    if ((wl < 16 && (got & 0xFu) != wl) || (wh < 16 && ((got >> 16) & 0xFu) != wh) || (got & 0xFFF0FFF0u)) {
        if (atomicAdd(bad, 1ull) == 0)
            *first = i;
    }
}

/* The POW2 quantize's E2M1 packing (fm_bf16x2_e2m1_mag, then
 * fm_e2m1_sums_row / _cols): every BF16 x with every k whose product a POW2
 * block holds (|x| 2^k <= 6, finite), in a place of a row of 8 (one
 * multiplier) and of a column pair (8 rows x 2 columns, each column its own
 * multiplier), beside random values such a block holds; every eighth column
 * pair has a non-finite block beside (a NaN multiplier over any bits),
 * whose codes the caller replaces, so only x's column is checked there.
 * Thread i: x = i mod 2^16, k = i / 2^16 - 126. */
__device__ uint32_t xs32(uint32_t *h)
{
    *h ^= *h << 13;
    *h ^= *h >> 17;
    *h ^= *h << 5;
    return *h;
}

__device__ bool pow2_holds(uint32_t x, int k)
{
    const float f = __uint_as_float(x << 16);
    return fabsf(f) <= 3.4e38f && fabsf(f * fm_exp2i(k)) <= 6.0f;
}

/* a random BF16 a POW2 block with multiplier 2^k holds: an exponent near
 * the grid's (or any, or a signed zero) */
__device__ uint32_t pow2_pick(uint32_t *h, int k)
{
    for (int t = 0; t < 8; t++) {
        const uint32_t r = xs32(h);
        const int e = (int)(r >> 24) % 16 - 11 - k + 127; /* |v| 2^k in [2^-11, 2^5) */
        const uint32_t x = (r & 0x807Fu) | ((r & 0x10000u) ? (r >> 8) & 0x7F80u : (uint32_t)(e & 0xFF) << 7);
        if (e > 0 && e < 255 && pow2_holds(x, k))
            return x;
    }
    return xs32(h) & 0x8000u;
}

__device__ uint32_t e2m1_of(uint32_t x, int k) { return fm_e2m1_from_f32(__uint_as_float(x << 16) * fm_exp2i(k)); }

__global__ void e2m1_sums_kernel(unsigned long long *bad, unsigned int *first)
{
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 65536u * 254u)
        return;
    const uint32_t x = i & 0xFFFFu;
    const int k = (int)(i >> 16) - 126;
    if (!pow2_holds(x, k))
        return; /* no POW2 block holds it */
    uint32_t h = i * 2654435761u + 0x9E3779B9u;
    bool differs = false;
    /* a row */
    {
        const int place = (int)(xs32(&h) & 7u);
        uint32_t e[8], s[4], w[4];
        for (int j = 0; j < 8; j++)
            e[j] = j == place ? x : pow2_pick(&h, k);
        const uint32_t mul = fm_e2m1_mul2(fm_exp2i(k), fm_exp2i(k)), me = fm_e2m1_mexp(mul);
        for (int q = 0; q < 4; q++) {
            w[q] = e[2 * q] | (e[2 * q + 1] << 16);
            s[q] = fm_bf16x2_e2m1_mag(w[q], mul, me);
        }
        const uint32_t got = fm_e2m1_sums_row(s, w);
        for (int j = 0; j < 8; j++)
            differs |= ((got >> (4 * j)) & 0xFu) != e2m1_of(e[j], k);
    }
    /* a column pair: x in column c of row r, the other column with its own k */
    {
        const uint32_t r0 = xs32(&h);
        const int row = (int)(r0 & 7u), c = (int)((r0 >> 3) & 1u), ko = (int)((r0 >> 8) % 254u) - 126;
        const bool nan_beside = ((r0 >> 4) & 7u) == 0;
        const int kc[2] = {c ? ko : k, c ? k : ko};
        uint32_t e[8][2], s[8], w[8];
        for (int r = 0; r < 8; r++)
            for (int j = 0; j < 2; j++)
                e[r][j] = r == row && j == c ? x : nan_beside && j != c ? xs32(&h) & 0xFFFFu : pow2_pick(&h, kc[j]);
        const float m0 = fm_exp2i(kc[0]), m1 = fm_exp2i(kc[1]), nan = __uint_as_float(FM_F32_CANON_NAN);
        const uint32_t mul = fm_e2m1_mul2(nan_beside && c == 1 ? nan : m0, nan_beside && c == 0 ? nan : m1);
        const uint32_t me = fm_e2m1_mexp(mul);
        for (int r = 0; r < 8; r++) {
            w[r] = e[r][0] | (e[r][1] << 16);
            s[r] = fm_bf16x2_e2m1_mag(w[r], mul, me);
        }
        uint32_t col[2];
        fm_e2m1_sums_cols(s, w, &col[0], &col[1]);
        for (int j = 0; j < 2; j++)
            if (!nan_beside || j == c)
                for (int r = 0; r < 8; r++)
                    differs |= ((col[j] >> (4 * r)) & 0xFu) != e2m1_of(e[r][j], kc[j]);
    }
    if (differs && atomicAdd(bad, 1ull) == 0)
        *first = i;
}

/* FP8 codes times 2^d into E2M1 (fm_fp8x8_e2m1, the row conversions'
 * encoder), for every code of each FP8 dtype in every one of the eight
 * places, with every d in [-23, 14], with and without the clamp. The
 * encoder's contract is a whole word of codes a block can hold: no NaN
 * code, and without the clamp every |v| 2^d <= 6 (the caller writes NaN
 * blocks itself and clamps where a value can pass 6). So the other seven
 * places get codes no larger in magnitude than the one tested (those are
 * valid wherever it is), with random signs, 16 words a thread.
 * Thread i: code = i mod 256, place = (i / 256) mod 8, then d + 23 (38
 * values), then the kind (dtype and clamp, 4). */
__device__ float fp8_value(int ti, uint32_t code)
{
    return ti == FM_DTYPE_E4M3 ? fm_e4m3_to_f32((uint8_t)code) : fm_e5m2_to_f32((uint8_t)code);
}

template <int TI, bool CLAMP>
__device__ bool fp8_e2m1_differs(uint32_t code, int place, int d)
{
    const float v = fp8_value(TI, code);
    if (v != v || (!CLAMP && !(fabsf(v * fm_exp2i(d)) <= 6.0f)))
        return false; /* no block holds it */
    uint32_t h = code * 0x9E3779B1u + (uint32_t)(place * 977 + d * 131 + TI * 7 + CLAMP);
    for (int rep = 0; rep < 16; rep++) {
        uint8_t b[8];
        for (int j = 0; j < 8; j++) {
            h = h * 1664525u + 1013904223u;
            const uint32_t mag = rep == 0 && j == 0 ? 0u : (h >> 8) % ((code & 0x7Fu) + 1u);
            b[j] = (uint8_t)(mag | ((h >> 31) << 7));
        }
        b[place] = (uint8_t)code;
        const uint32_t w0 = b[0] | b[1] << 8 | b[2] << 16 | (uint32_t)b[3] << 24;
        const uint32_t w1 = b[4] | b[5] << 8 | b[6] << 16 | (uint32_t)b[7] << 24;
        const uint32_t got = fm_fp8x8_e2m1<TI, CLAMP>(w0, w1, fm_h2_shift3_of(d));
        for (int j = 0; j < 8; j++) /* exact products: 4 significant bits, exponents far inside F32's */
            if (((got >> (4 * j)) & 0xFu) != fm_e2m1_from_f32(fp8_value(TI, b[j]) * fm_exp2i(d)))
                return true;
    }
    return false;
}

__global__ void fp8_e2m1_kernel(unsigned long long *bad, unsigned int *first)
{
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 4u * 38u * 2048u)
        return;
    const uint32_t code = i & 0xFFu;
    const int place = (int)((i >> 8) & 7u), d = (int)((i >> 11) % 38u) - 23, kind = (int)((i >> 11) / 38u);
    const bool differs = kind == 0   ? fp8_e2m1_differs<FM_DTYPE_E4M3, false>(code, place, d)
                         : kind == 1 ? fp8_e2m1_differs<FM_DTYPE_E4M3, true>(code, place, d)
                         : kind == 2 ? fp8_e2m1_differs<FM_DTYPE_E5M2, false>(code, place, d)
                                     : fp8_e2m1_differs<FM_DTYPE_E5M2, true>(code, place, d);
    if (differs && atomicAdd(bad, 1ull) == 0)
        *first = i;
}

/* E2M1 words into FP8 (fm_e2m1x8_as_e4m3, then fm_e2m1x8_to_fp8: the row
 * conversions out of MXFP4), for every E2M1 code in every one of the 32
 * places of a segment's four words, with every d that keeps 0.5 2^d normal
 * and the code's product within the format: the other places get codes no
 * larger in magnitude, random signs, 16 segments a thread. Each byte of
 * fm_e2m1x8_as_e4m3 and of fm_e2m1x8_as_e4m3_split (the MXFP4 transpose's
 * form: even elements, then odd ones) must be the E4M3 code of the value
 * times 2^-6, each of fm_e2m1x8_to_fp8 the FP8 code of the value times 2^d.
 * Thread i: code = i mod 16, place = (i / 16) mod 32, then d + 13 (30
 * values), then the output dtype (2). */
__global__ void e2m1_fp8_kernel(unsigned long long *bad, unsigned int *first)
{
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 2u * 30u * 512u)
        return;
    const uint32_t code = i & 0xFu;
    const int place = (int)((i >> 4) & 31u), d = (int)((i >> 9) % 30u) - 13;
    const bool e5 = (i >> 9) / 30u != 0;
    const float v = fm_e2m1_to_f32((uint8_t)code);
    if (d < (e5 ? -13 : -5) || !(fabsf(v) * fm_exp2i(d) <= (e5 ? 57344.0f : 448.0f)))
        return; /* no block of the row conversion holds it */
    uint32_t h = code * 0x9E3779B1u + (uint32_t)(place * 977 + d * 131 + e5);
    bool differs = false;
    for (int rep = 0; rep < 16 && !differs; rep++) {
        uint32_t w[4], e[8], o[8], sp[8];
        for (int k = 0; k < 4; k++) {
            w[k] = 0;
            for (int j = 0; j < 8; j++) {
                h = h * 1664525u + 1013904223u;
                const uint32_t mag = rep == 0 && k == 0 && j == 0 ? 0u : (h >> 8) % ((code & 7u) + 1u);
                w[k] |= (mag | ((h >> 31) << 3)) << (4 * j);
            }
        }
        w[place >> 3] = (w[place >> 3] & ~(0xFu << (4 * (place & 7)))) | (code << (4 * (place & 7)));
        for (int k = 0; k < 4; k++) {
            fm_e2m1x8_as_e4m3(w[k], &e[2 * k], &e[2 * k + 1]);
            fm_e2m1x8_as_e4m3_split(w[k], &sp[2 * k], &sp[2 * k + 1]);
        }
        if (e5)
            fm_e2m1x8_to_fp8<FM_DTYPE_E5M2>(w, e, d, o);
        else
            fm_e2m1x8_to_fp8<FM_DTYPE_E4M3>(w, e, d, o);
        for (int j = 0; j < 32; j++) {
            const float x = fm_e2m1_to_f32((uint8_t)(w[j >> 3] >> (4 * (j & 7))));
            const uint32_t eb = (e[j >> 2] >> (8 * (j & 3))) & 0xFFu, ob = (o[j >> 2] >> (8 * (j & 3))) & 0xFFu;
            const int p = j & 7; /* element p of word j / 8: split word p % 2, byte p / 2 */
            const uint32_t sb = (sp[2 * (j >> 3) + (p & 1)] >> (8 * (p >> 1))) & 0xFFu;
            differs |= eb != fm_e4m3_from_f32(x * 0.015625f);
            differs |= sb != fm_e4m3_from_f32(x * 0.015625f);
            differs |= ob != (e5 ? fm_e5m2_from_f32(x * fm_exp2i(d)) : fm_e4m3_from_f32(x * fm_exp2i(d)));
        }
    }
    if (differs && atomicAdd(bad, 1ull) == 0)
        *first = i;
}

__global__ void dec_kernel(unsigned long long *bad)
{
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 65536)
        return;
    /* every F16 */
    float a = fm_hw_f16_to_f32((uint16_t)i), b = fm_f16_to_f32((uint16_t)i);
    if (!(a != a && b != b) && __float_as_uint(a) != __float_as_uint(b))
        atomicAdd(&bad[0], 1ull);
    if (i < 65536) {
        /* every pair of FP8 codes */
        float lo, hi;
        fm_hw_e4m3x2_to_f32(i, &lo, &hi);
        float wl = fm_e4m3_to_f32((uint8_t)i), wh = fm_e4m3_to_f32((uint8_t)(i >> 8));
        if (!(lo != lo && wl != wl) && __float_as_uint(lo) != __float_as_uint(wl))
            atomicAdd(&bad[1], 1ull);
        if (!(hi != hi && wh != wh) && __float_as_uint(hi) != __float_as_uint(wh))
            atomicAdd(&bad[1], 1ull);
        fm_hw_e5m2x2_to_f32(i, &lo, &hi);
        wl = fm_e5m2_to_f32((uint8_t)i);
        wh = fm_e5m2_to_f32((uint8_t)(i >> 8));
        if (!(lo != lo && wl != wl) && __float_as_uint(lo) != __float_as_uint(wl))
            atomicAdd(&bad[2], 1ull);
        if (!(hi != hi && wh != wh) && __float_as_uint(hi) != __float_as_uint(wh))
            atomicAdd(&bad[2], 1ull);
    }
    if (i < 16 && __float_as_uint(fm_fast_e2m1_to_f32(i)) != __float_as_uint(fm_e2m1_to_f32((uint8_t)i)))
        atomicAdd(&bad[3], 1ull);
}

int main(void)
{
    const char *name = "test_cuda_hw_fp8_cvt_equals_codec";
    fm_context *ctx = gt_cuda_context(name);
    unsigned long long *bad;
    unsigned int *first;
    GT_CUDA(cudaMalloc(&bad, 17 * sizeof *bad));
    GT_CUDA(cudaMalloc(&first, 17 * sizeof *first));
    GT_CUDA(cudaMemset(bad, 0, 17 * sizeof *bad));
    GT_CUDA(cudaMemset(first, 0, 17 * sizeof *first));
    enc_kernel<<<132 * 16, 256>>>(bad, first);
    GT_CUDA(cudaGetLastError());
    dec_kernel<<<256, 256>>>(bad + 9); /* after the NENC encoders' counts */
    GT_CUDA(cudaGetLastError());
    bf16_e2m1_kernel<<<65536u * 254u / 256u, 256>>>(bad + 13, first + 13);
    GT_CUDA(cudaGetLastError());
    fp8_e2m1_kernel<<<4u * 38u * 2048u / 256u, 256>>>(bad + 14, first + 14);
    GT_CUDA(cudaGetLastError());
    e2m1_sums_kernel<<<65536u * 254u / 256u, 256>>>(bad + 15, first + 15);
    GT_CUDA(cudaGetLastError());
    e2m1_fp8_kernel<<<2u * 30u * 512u / 256u, 256>>>(bad + 16, first + 16);
    GT_CUDA(cudaGetLastError());
    GT_CUDA(cudaDeviceSynchronize());
    unsigned long long h[17];
    unsigned int f[17];
    GT_CUDA(cudaMemcpy(h, bad, sizeof h, cudaMemcpyDeviceToHost));
    GT_CUDA(cudaMemcpy(f, first, sizeof f, cudaMemcpyDeviceToHost));
    static const char *enc[NENC] = {"e4m3x2", "e5m2x2", "e2m1", "bf16x2", "f16x2", "e2m1x8 (grid + cvt)",
                                    "pick_scale_pow2 e4m3", "pick_scale_pow2 e5m2", "pick_scale_pow2 e2m1"};
    for (int k = 0; k < NENC; k++) {
        GT_CHECK(h[k] == 0, "%s: %llu of 2^32 inputs differ from format.h; first 0x%08x", enc[k], h[k], f[k]);
        printf("  encode %-22s all 2^32 F32 patterns: %llu mismatches\n", enc[k], h[k]);
    }
    static const char *dec[4] = {"f16 -> f32", "e4m3x2 -> f32", "e5m2x2 -> f32", "e2m1 -> f32"};
    for (int k = 0; k < 4; k++) {
        GT_CHECK(h[9 + k] == 0, "decode %s: %llu mismatches", dec[k], h[9 + k]);
        printf("  decode %-22s every code: %llu mismatches\n", dec[k], h[9 + k]);
    }
    GT_CHECK(h[13] == 0, "bf16x2 -> e2m1 (packed): %llu of 65536 x 254 pairs differ from format.h; first index %u", h[13],
             f[13]);
    printf("  encode %-22s every BF16 x every MX32 multiplier: %llu mismatches\n", "bf16x2 -> e2m1 packed", h[13]);
    GT_CHECK(h[14] == 0,
             "fp8x8 -> e2m1 (row conversions): %llu of 4 x 38 x 2048 cases differ from format.h; first index %u", h[14],
             f[14]);
    printf("  encode %-22s every FP8 code x place x shift -23..14, clamped or not: %llu mismatches\n",
           "fp8x8 -> e2m1", h[14]);
    GT_CHECK(h[15] == 0,
             "bf16x2 -> e2m1 sums packed by row and column (POW2): %llu of 65536 x 254 cases differ from format.h; "
             "first index %u",
             h[15], f[15]);
    printf("  encode %-22s every BF16 x every POW2 multiplier, a row and a column pair: %llu mismatches\n",
           "bf16 sums -> e2m1", h[15]);
    GT_CHECK(h[16] == 0, "e2m1x8 -> e4m3 / e5m2 (row conversions): %llu of 2 x 30 x 512 cases differ; first index %u",
             h[16], f[16]);
    printf("  encode %-22s every E2M1 code x place x shift, into E4M3 and E5M2: %llu mismatches\n", "e2m1x8 -> fp8",
           h[16]);
    cudaFree(bad);
    cudaFree(first);
    fm_context_destroy(ctx);
    return gt_finish(name);
}
