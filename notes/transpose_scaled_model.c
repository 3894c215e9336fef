/* Host model of rq_fp8t_tma_kernel's arithmetic (backends/cuda/requantize.cu;
 * this model is not in the build), one 128 x 128 tile of a 1x128 -> 128x1 transpose with
 * TI == TO, checked bit for bit against the CPU reference fm_transpose_scaled
 * on random tiles: row exponents over the whole F32 range (subnormal scales
 * too) with spreads of 0-40 octaves, NaN scales, non-finite codes, signed
 * zero columns, codes near the format's maximum, partial tiles. Half
 * precision is modelled exactly: an f16 times a power of two is exact in F32
 * and rounded once by format.h's RNE F32 -> F16, as HMUL2 rounds it. First,
 * the kernel's data movement (check_data_movement).
 *   meson setup /tmp/cpu -Dcuda=disabled && ninja -C /tmp/cpu libflowmoe.a
 *   cc -O2 -std=c11 -Iinclude notes/transpose_scaled_model.c /tmp/cpu/libflowmoe.a -lm -lpthread -o /tmp/model
 *   /tmp/model 200000      # tiles; prints the mismatches and how many columns took each path */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "flowmoe/flowmoe.h"

#define NAN_ROW 4000000
#define EMPTY (-4000000)

static uint64_t rs = 88172645463325252ull;
static uint32_t rnd(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)rs;
}

static float f16v(uint16_t h) { return fm_f16_to_f32(h); }
static uint16_t f16mul(uint16_t a, uint16_t b) { return fm_f16_from_f32(f16v(a) * f16v(b)); }

/* rqf_factor_bits */
static uint16_t factor(int p, int Q)
{
    int d = p - Q;
    d = d < -26 ? -26 : d > 1 ? 1 : d;
    int i = d + 26, e = i - 26;
    return i == 27 ? 0x7E00u : e < -24 ? 0u : e >= -14 ? (uint16_t)((e + 15) << 10) : (uint16_t)(1u << (e + 24));
}

static uint16_t dec16(fm_dtype t, uint8_t c)
{
    if (t == FM_DTYPE_E5M2)
        return (uint16_t)(c << 8);
    return fm_f16_from_f32(fm_e4m3_to_f32(c)); /* exact */
}

static long fast_cols, slow_key_cols, slow_code_cols, bad_cols;

/* The model for one tile: codes[r][c] (r < R valid rows), p[r] (rq_pin),
 * out codes[c][r], out exps pout[c] (1000 = bad). */
static void model_tile(fm_dtype t, int rowmax, int R, int C, const uint8_t *codes, const int *p, uint8_t *out,
                       int *pout, int *bad)
{
    int Q = EMPTY, minp = 1 << 30;
    for (int r = 0; r < R; r++)
        if (p[r] > -1000 && p[r] < 1000) {
            Q = p[r] > Q ? p[r] : Q;
            minp = p[r] < minp ? p[r] : minp;
        }
    if (Q == EMPTY)
        Q = 0;
    const int L = t == FM_DTYPE_E4M3 ? 15 : 8;
    const uint16_t thr = t == FM_DTYPE_E4M3 ? 0x0100u : 0x1800u;
    const int all_exact = minp >= Q - L; /* every product s exact */
    static uint16_t s[128][128];
    for (int r = 0; r < 128; r++) {
        int pr = r < R ? p[r] : EMPTY;
        uint16_t F = factor(pr, Q);
        for (int c = 0; c < C; c++) {
            uint8_t code = r < R ? codes[r * C + c] : 0;
            s[r][c] = f16mul(dec16(t, code), F);
        }
    }
    for (int c = 0; c < C; c++) {
        uint16_t K = 0;
        int nanrow = 0, nfcode = 0;
        for (int r = 0; r < 128; r++) {
            uint16_t a = s[r][c] & 0x7FFFu;
            K = a > K ? a : K;
            if (r < R && p[r] == NAN_ROW)
                nanrow = 1;
            if (r < R && fm_elem_code_nonfinite(t, codes[r * C + c]))
                nfcode = 1;
        }
        int po, isbad = 0;
        if (rowmax) {
            isbad = nanrow || nfcode;
            po = Q;
        } else if (K >= 0x7C00u) {
            isbad = 1;
            po = 0;
        } else if (K >= 0x400u && K >= thr) {
            po = Q + (((int)K + 0xFF) >> 10) - (t == FM_DTYPE_E4M3 ? 23 : 30);
        } else if (K >= thr) {
            po = fm_pow2_scale_exp(f16v(K), t) + Q;
        } else {
            /* exact key from the elements */
            slow_key_cols++;
            int key = EMPTY;
            for (int r = 0; r < R; r++) {
                uint8_t code = codes[r * C + c];
                if (!fm_elem_code_mag(t, code))
                    continue;
                int k = fm_code_scale_exp(t, code, t, 0) + p[r];
                key = k > key ? k : key;
            }
            po = key == EMPTY ? 0 : key;
        }
        if (!isbad)
            po = po < -127 ? -127 : po > 127 ? 127 : po;
        bad[c] = isbad;
        pout[c] = po;
        if (isbad) {
            bad_cols++;
            for (int r = 0; r < R; r++)
                out[c * R + r] = fm_elem_nan(t);
            continue;
        }
        const int d = Q - po;
        const int fast = d >= 0 && d <= 15 && (all_exact || (t == FM_DTYPE_E4M3 && d <= 6));
        if (fast) {
            fast_cols++;
            uint16_t M = (uint16_t)((15 + d) << 10);
            for (int r = 0; r < R; r++) {
                uint16_t y = f16mul(s[r][c], M);
                out[c * R + r] = fm_elem_encode(t, f16v(y));
            }
        } else {
            slow_code_cols++;
            for (int r = 0; r < R; r++)
                out[c * R + r] = fm_requant_code(t, codes[r * C + c], p[r] - po, t);
        }
    }
}

static uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s)
{
    uint64_t v = ((uint64_t)y << 32) | x;
    uint32_t r = 0;
    for (int n = 0; n < 4; n++) {
        uint32_t b = (s >> (4 * n)) & 7u;
        r |= (uint32_t)((v >> (8 * b)) & 0xFFu) << (8 * n);
    }
    return r;
}

static void t4(uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3, uint32_t *c0, uint32_t *c1, uint32_t *c2,
               uint32_t *c3)
{
    const uint32_t t0 = byte_perm(r0, r1, 0x5140), t1 = byte_perm(r0, r1, 0x7362);
    const uint32_t t2 = byte_perm(r2, r3, 0x5140), t3 = byte_perm(r2, r3, 0x7362);
    *c0 = byte_perm(t0, t2, 0x5410);
    *c1 = byte_perm(t0, t2, 0x7632);
    *c2 = byte_perm(t1, t3, 0x5410);
    *c3 = byte_perm(t1, t3, 0x7632);
}

/* The data movement: a tile placed as TMA's 128-byte swizzle places it
 * (address bits 4-6 ^= bits 7-9), read with the kernel's XOR addresses,
 * transposed with rqf_t4 and put back in order with the lane's selectors:
 * every lane must end with its 8 columns' 8 logical rows; also the
 * shared-memory wavefronts of each warp-wide load (2 is the minimum). */
static int check_data_movement(void)
{
    static uint8_t tile[128][128], smem[16384];
    for (int r = 0; r < 128; r++)
        for (int c = 0; c < 128; c++)
            tile[r][c] = (uint8_t)(r * 131 + c * 7 + (r >> 3));
    /* TMA SWIZZLE_128B: byte address bits [4:6] ^= bits [7:9] */
    for (int r = 0; r < 128; r++)
        for (int c = 0; c < 128; c++) {
            uint32_t a = (uint32_t)(r * 128 + c);
            a ^= ((a >> 7) & 7u) << 4;
            smem[a] = tile[r][c];
        }
    int bad = 0, worst_wave = 0;
    for (int w = 0; w < 8; w++) {
        for (int k = 0; k < 8; k++) {
            /* wavefronts: distinct 4-byte words per bank over the warp's 32 lanes */
            uint32_t words[32][32];
            int nw[32] = {0};
            for (int lane = 0; lane < 32; lane++) {
                int rg = lane >> 1, cg = lane & 1, m = rg & 7;
                uint32_t lane_off = 1024u * rg + 8u * cg + 128u * m + 16u * (w ^ m);
                uint32_t a = lane_off ^ (144u * k);
                for (int h = 0; h < 2; h++) {
                    uint32_t word = (a + 4 * h) / 4, bank = word % 32;
                    int seen = 0;
                    for (int i = 0; i < nw[bank]; i++)
                        seen |= words[bank][i] == word;
                    if (!seen)
                        words[bank][nw[bank]++] = word;
                }
            }
            int wave = 0;
            for (int b = 0; b < 32; b++)
                wave = nw[b] > wave ? nw[b] : wave;
            worst_wave = wave > worst_wave ? wave : worst_wave;
        }
        for (int lane = 0; lane < 32; lane++) {
            int rg = lane >> 1, cg = lane & 1, m = rg & 7;
            uint32_t lane_off = 1024u * rg + 8u * cg + 128u * m + 16u * (w ^ m);
            uint32_t cw[8][2], col[8][2], sel[2];
            for (int k = 0; k < 8; k++) {
                uint32_t a = lane_off ^ (144u * k);
                memcpy(&cw[k][0], smem + a, 4);
                memcpy(&cw[k][1], smem + a + 4, 4);
            }
            for (int h = 0; h < 2; h++) {
                sel[h] = 0;
                for (int b = 0; b < 4; b++)
                    sel[h] |= (uint32_t)(4 * (h ^ (m >> 2)) + (b ^ (m & 3))) << (4 * b);
            }
            for (int h = 0; h < 2; h++)
                for (int q = 0; q < 2; q++)
                    t4(cw[4 * h][q], cw[4 * h + 1][q], cw[4 * h + 2][q], cw[4 * h + 3][q], &col[4 * q][h],
                       &col[4 * q + 1][h], &col[4 * q + 2][h], &col[4 * q + 3][h]);
            for (int j = 0; j < 8; j++) {
                uint32_t a = col[j][0], b = col[j][1];
                col[j][0] = byte_perm(a, b, sel[0]);
                col[j][1] = byte_perm(a, b, sel[1]);
            }
            for (int j = 0; j < 8; j++)
                for (int r = 0; r < 8; r++) {
                    uint8_t got = (uint8_t)(col[j][r >> 2] >> (8 * (r & 3)));
                    uint8_t want = tile[8 * rg + r][16 * w + 8 * cg + j];
                    if (got != want && bad++ < 5)
                        printf("w %d lane %d col %d row %d: got %02x want %02x\n", w, lane, j, r, got, want);
                }
        }
    }
    printf("%d wrong bytes; worst wavefronts of a warp-wide 8-byte load: %d (2 is the minimum for 256 bytes)\n",
           bad, worst_wave);
    return bad != 0 || worst_wave != 2;
}

int main(int argc, char **argv)
{
    if (check_data_movement())
        return 1;
    int iters = argc > 1 ? atoi(argv[1]) : 2000;
    fm_context *ctx;
    if (fm_context_create(&(fm_context_config){.backend = FM_BACKEND_CPU}, &ctx) != FM_OK)
        return 1;
    long fails = 0;
    static uint8_t codes[128 * 128], ref[128 * 128], mod[128 * 128];
    static float sin_[128], sout[128];
    static int p[128], pout[128], bad[128];
    for (int it = 0; it < iters; it++) {
        fm_dtype t = (it & 1) ? FM_DTYPE_E5M2 : FM_DTYPE_E4M3;
        int rowmax = (it >> 1) % 3 == 0;
        int R = (it % 7 == 0) ? 16 * (1 + (int)(rnd() % 8)) : 128;
        int C = (it % 5 == 0) ? 16 * (1 + (int)(rnd() % 8)) : 128;
        int kind = (int)(rnd() % 8);
        /* row exponents: base anywhere from -149 to 127, spread 0..40 */
        int spread = (int)(rnd() % 41);
        int base = -149 + (int)(rnd() % 277);
        if (kind == 0)
            base = -149 + (int)(rnd() % 30);
        if (kind == 1)
            base = 100 + (int)(rnd() % 28);
        for (int r = 0; r < R; r++) {
            int pr = base + (spread ? (int)(rnd() % (unsigned)(spread + 1)) : 0);
            if (pr > 127)
                pr = 127;
            if (pr < -149)
                pr = -149;
            p[r] = pr;
            sin_[r] = ldexpf(1.0f, pr);
            if (kind == 2 && rnd() % 64 == 0) {
                p[r] = NAN_ROW;
                sin_[r] = NAN;
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) {
                uint8_t code = (uint8_t)rnd();
                uint32_t u = rnd() % 16;
                if (kind == 3 || u < 3)
                    code &= 0x87; /* small / subnormal */
                if (kind == 4 && (c % 9 == 0))
                    code = (uint8_t)(rnd() & 0x80); /* zero columns (signed zeros) */
                if (kind == 5)
                    code = (uint8_t)((rnd() & 0x80) | (0x70 + rnd() % 15)); /* near max */
                if (fm_elem_code_nonfinite(t, code) && kind != 6)
                    code &= 0xF7; /* non-finite codes only in kind 6 (mostly) */
                codes[r * C + c] = code;
            }
        /* model */
        model_tile(t, rowmax, R, C, codes, p, mod, pout, bad);
        /* reference */
        fm_tensor in = fm_tensor_quant_2d(codes, t, R, C, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, sin_,
                                          FM_SCALE_LAYOUT_COMPACT);
        fm_tensor out = fm_tensor_quant_2d(ref, t, R, C, FM_LAYOUT_COLWISE, FM_SCALE_BLOCK_1x128, sout,
                                           FM_SCALE_LAYOUT_COMPACT);
        fm_requant_config cfg = {.rule = rowmax ? FM_REQUANT_ROWMAX : FM_REQUANT_TIGHT};
        if (fm_transpose_scaled(ctx, &cfg, &in, &out) != FM_OK) {
            printf("ref failed: %s\n", fm_last_error(ctx));
            return 1;
        }
        for (int c = 0; c < C; c++) {
            uint32_t sb;
            memcpy(&sb, &sout[c], 4);
            int rbad = sb == 0x7FC00000u;
            int rp = 0;
            if (!rbad)
                fm_f32_pow2_exp(sout[c], &rp);
            if (rbad != bad[c] || (!rbad && rp != pout[c])) {
                if (fails < 10)
                    printf("it %d col %d: scale ref %s%d model %s%d (t %d rowmax %d kind %d)\n", it, c,
                           rbad ? "NaN " : "", rp, bad[c] ? "NaN " : "", pout[c], t, rowmax, kind);
                fails++;
            }
            for (int r = 0; r < R; r++)
                if (ref[c * R + r] != mod[c * R + r]) {
                    if (fails < 10)
                        printf("it %d (%d,%d): ref %02x model %02x p %d pout %d code %02x (t %d rowmax %d kind %d)\n",
                               it, r, c, ref[c * R + r], mod[c * R + r], p[r], pout[c], codes[r * C + c], t, rowmax,
                               kind);
                    fails++;
                }
        }
    }
    printf("%d tiles, %ld mismatches; columns: fast codes %ld, slow codes %ld, slow keys %ld, non-finite %ld\n",
           iters, fails, fast_cols, slow_code_cols, slow_key_cols, bad_cols);
    fm_context_destroy(ctx);
    return fails != 0;
}
