/* Scaling-aware transpose and direct FP8 <-> MXFP4 conversion (CPU reference):
 * with the TIGHT rule, re-encoding equals quantizing the dequantized input with
 * the POW2 rule (MX_FLOOR: the floor rule), bit for bit, codes and scales; the
 * ROWMAX rule equals column-wise quantization with the rowmax column scales;
 * every code x shift is the RNE of the exact value; NaN blocks stay NaN;
 * non-power-of-two scales are refused. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flowmoe/flowmoe.h"

static int failures, checks;
#define CHECK(cond, ...)                                                                                   \
    do {                                                                                                   \
        checks++;                                                                                          \
        if (!(cond)) {                                                                                     \
            if (failures++ < 20) {                                                                         \
                printf("FAIL %s:%d: ", __FILE__, __LINE__);                                                \
                printf(__VA_ARGS__);                                                                       \
                printf("\n");                                                                              \
            }                                                                                              \
        }                                                                                                  \
    } while (0)

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double unif(void) { return (double)(rnd() >> 11) / 9007199254740992.0; }

/* Independent rounding: nearest code by enumeration, ties to the even code,
 * saturating to the largest finite. */
static double decode_d(fm_dtype t, unsigned c) { return (double)fm_elem_decode(t, (uint8_t)c); }
static uint8_t nearest_code(fm_dtype t, double v)
{
    unsigned n = t == FM_DTYPE_E2M1 ? 8 : 128, best = 0;
    double bd = INFINITY;
    for (unsigned c = 0; c < n; c++) {
        double d = decode_d(t, c);
        if (isnan(d) || isinf(d))
            continue;
        double e = fabs(fabs(v) - d);
        if (e < bd || (e == bd && !(c & 1) && (best & 1))) {
            bd = e;
            best = c;
        }
    }
    unsigned sign = signbit(v) ? (t == FM_DTYPE_E2M1 ? 0x8u : 0x80u) : 0u;
    return (uint8_t)(best | sign);
}

static void test_every_code_every_shift(void)
{
    fm_dtype ts[] = {FM_DTYPE_E4M3, FM_DTYPE_E5M2, FM_DTYPE_E2M1};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
            fm_dtype ti = ts[a], to = ts[b];
            unsigned n = ti == FM_DTYPE_E2M1 ? 16 : 256;
            for (unsigned c = 0; c < n; c++) {
                if (fm_elem_code_nonfinite(ti, (uint8_t)c))
                    continue;
                for (int s = -31; s <= 31; s++) {
                    double exact = ldexp(decode_d(ti, c), s);
                    uint8_t want = nearest_code(to, exact);
                    uint8_t got = fm_requant_code(ti, (uint8_t)c, s, to);
                    CHECK(got == want, "%s code 0x%02x shift %d -> %s: got 0x%02x want 0x%02x", fm_dtype_name(ti), c,
                          s, fm_dtype_name(to), got, want);
                }
            }
        }
}

/* A quantized tensor with its own buffers. */
typedef struct {
    fm_tensor t;
    uint8_t *data;
    void *scale;
} qbuf;

static qbuf qalloc(int E, int R, int C, fm_dtype dt, fm_layout lay, fm_scale_mode m, fm_scale_layout sl)
{
    qbuf q;
    q.t = fm_tensor_quant_2d(NULL, dt, R, C, lay, m, NULL, sl);
    if (E > 1) {
        q.t.ndim = 3;
        q.t.shape[0] = E;
        q.t.shape[1] = R;
        q.t.shape[2] = C;
    }
    size_t nb = (size_t)fm_tensor_nbytes(&q.t), ns = (size_t)fm_tensor_scale_nbytes(&q.t);
    q.data = malloc(nb ? nb : 1);
    q.scale = malloc(ns ? ns : 1);
    memset(q.data, 0xA5, nb ? nb : 1); /* poison */
    memset(q.scale, 0xA5, ns ? ns : 1);
    q.t.data = q.data;
    q.t.scale = q.scale;
    return q;
}
static void qfree(qbuf *q)
{
    free(q->data);
    free(q->scale);
}

static float *make_input(int E, int R, int C, int kind)
{
    size_t n = (size_t)E * R * C;
    float *x = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        double v = (unif() - 0.5) * ldexp(1.0, (int)(rnd() % 40) - 20); /* wide exponent spread */
        if (kind == 1 && rnd() % 5 == 0)
            v = 0.0;
        if (kind == 2)
            v = (unif() - 0.5) * 1e-38; /* subnormal-heavy */
        x[i] = (float)v;
    }
    if (kind == 3 && n > 7) {
        x[n / 3] = NAN;
        x[n / 2] = -INFINITY;
    }
    return x;
}

static int same_bytes(const qbuf *a, const qbuf *b)
{
    return memcmp(a->data, b->data, (size_t)fm_tensor_nbytes(&a->t)) == 0 &&
           memcmp(a->scale, b->scale, (size_t)fm_tensor_scale_nbytes(&a->t)) == 0;
}

/* in -> requant (TIGHT / MX_FLOOR) vs quantize(dequantize(in)). */
static void check_equals_requantize(fm_context *ctx, int E, int R, int C, int kind, fm_dtype ti, fm_scale_mode mi,
                                    fm_dtype to, fm_scale_mode mo, int transpose, fm_scale_layout sl_out,
                                    fm_requant_rule rule)
{
    float *x = make_input(E, R, C, kind);
    fm_tensor xin = E > 1 ? fm_tensor_3d(x, FM_DTYPE_F32, E, R, C) : fm_tensor_2d(x, FM_DTYPE_F32, R, C);
    qbuf q = qalloc(E, R, C, ti, FM_LAYOUT_ROWWISE, mi, FM_SCALE_LAYOUT_COMPACT);
    fm_status st = fm_quantize(ctx, NULL, &xin, &q.t, NULL);
    CHECK(st == FM_OK, "quantize: %s", fm_last_error(ctx));
    /* the dequantized input, exact in F32 */
    size_t n = (size_t)E * R * C;
    float *d = malloc((n ? n : 1) * sizeof(float));
    fm_tensor dt = E > 1 ? fm_tensor_3d(d, FM_DTYPE_F32, E, R, C) : fm_tensor_2d(d, FM_DTYPE_F32, R, C);
    st = fm_dequantize(ctx, &q.t, &dt);
    CHECK(st == FM_OK, "dequantize: %s", fm_last_error(ctx));

    fm_layout lo = transpose ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE;
    qbuf got = qalloc(E, R, C, to, lo, mo, sl_out), want = qalloc(E, R, C, to, lo, mo, sl_out);
    int64_t bad = -1, want_bad = -1;
    fm_requant_config rc = {.rule = rule, .nonfinite_blocks = &bad};
    st = transpose ? fm_transpose_scaled(ctx, &rc, &q.t, &got.t) : fm_convert_scaled(ctx, &rc, &q.t, &got.t);
    CHECK(st == FM_OK, "requant: %s", fm_last_error(ctx));
    fm_quant_config qc = {.rule = rule == FM_REQUANT_MX_FLOOR ? FM_SCALE_RULE_MX_FLOOR : FM_SCALE_RULE_POW2,
                          .nonfinite_blocks = &want_bad};
    st = transpose ? fm_quantize(ctx, &qc, &dt, NULL, &want.t) : fm_quantize(ctx, &qc, &dt, &want.t, NULL);
    CHECK(st == FM_OK, "re-quantize: %s", fm_last_error(ctx));
    CHECK(same_bytes(&got, &want), "%s %s -> %s %s %s [%d,%d,%d] kind %d rule %d: differs from quantize(dequantize)",
          fm_dtype_name(ti), fm_scale_mode_name(mi), fm_dtype_name(to), fm_scale_mode_name(mo),
          transpose ? "transpose" : "convert", E, R, C, kind, (int)rule);
    CHECK(bad == want_bad, "nonfinite blocks %lld, quantize says %lld", (long long)bad, (long long)want_bad);
    qfree(&got);
    qfree(&want);
    qfree(&q);
    free(d);
    free(x);
}

static void test_tight_equals_quantize_of_dequantized(fm_context *ctx)
{
    int shapes[][3] = {{1, 1, 2}, {1, 128, 128}, {1, 129, 258}, {1, 300, 130}, {3, 64, 96}, {2, 0, 64}, {1, 33, 32}};
    struct {
        fm_dtype ti;
        fm_scale_mode mi;
        fm_dtype to;
        fm_scale_mode mo;
    } pairs[] = {
        {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
        {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128},
        {FM_DTYPE_E4M3, FM_SCALE_MX32, FM_DTYPE_E4M3, FM_SCALE_MX32},
        {FM_DTYPE_E5M2, FM_SCALE_MX32, FM_DTYPE_E5M2, FM_SCALE_MX32},
        {FM_DTYPE_E2M1, FM_SCALE_MX32, FM_DTYPE_E2M1, FM_SCALE_MX32},
        {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_DTYPE_E2M1, FM_SCALE_MX32},
        {FM_DTYPE_E4M3, FM_SCALE_MX32, FM_DTYPE_E2M1, FM_SCALE_MX32},
        {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_DTYPE_E2M1, FM_SCALE_MX32},
        {FM_DTYPE_E2M1, FM_SCALE_MX32, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
        {FM_DTYPE_E2M1, FM_SCALE_MX32, FM_DTYPE_E4M3, FM_SCALE_MX32},
        {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_DTYPE_E5M2, FM_SCALE_MX32},
    };
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++)
            for (int transpose = 0; transpose < 2; transpose++)
                for (int kind = 0; kind < 4; kind++) {
                    int E = shapes[s][0], R = shapes[s][1], C = shapes[s][2];
                    int fp4 = pairs[p].ti == FM_DTYPE_E2M1 || pairs[p].to == FM_DTYPE_E2M1;
                    if (fp4 && ((R & 1) || (C & 1)))
                        continue;
                    fm_scale_layout sl = (kind & 1) ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
                    check_equals_requantize(ctx, E, R, C, kind, pairs[p].ti, pairs[p].mi, pairs[p].to, pairs[p].mo,
                                            transpose, sl, FM_REQUANT_TIGHT);
                    if (pairs[p].mo == FM_SCALE_MX32)
                        check_equals_requantize(ctx, E, R, C, kind, pairs[p].ti, pairs[p].mi, pairs[p].to,
                                                pairs[p].mo, transpose, sl, FM_REQUANT_MX_FLOOR);
                }
}

/* ROWMAX: column scale = max of the row scales in the tile; codes are the
 * column-wise quantization of the dequantized values with that scale. */
static void test_rowmax_uses_max_row_scale(fm_context *ctx)
{
    int R = 200, C = 260;
    float *x = make_input(1, R, C, 1);
    fm_tensor xin = fm_tensor_2d(x, FM_DTYPE_F32, R, C);
    qbuf q = qalloc(1, R, C, FM_DTYPE_E4M3, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT);
    fm_status st = fm_quantize(ctx, NULL, &xin, &q.t, NULL);
    CHECK(st == FM_OK, "quantize: %s", fm_last_error(ctx));
    qbuf o = qalloc(1, R, C, FM_DTYPE_E4M3, FM_LAYOUT_COLWISE, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT);
    fm_requant_config rc = {.rule = FM_REQUANT_ROWMAX};
    st = fm_transpose_scaled(ctx, &rc, &q.t, &o.t);
    CHECK(st == FM_OK, "transpose: %s", fm_last_error(ctx));
    const float *rs = q.scale, *cs = o.scale;
    int nbr = (C + 127) / 128, nbc = (R + 127) / 128;
    for (int j = 0; j < C; j++)
        for (int ib = 0; ib < nbc; ib++) {
            float m = 0.0f;
            for (int i = ib * 128; i < R && i < ib * 128 + 128; i++)
                m = fmaxf(m, rs[i * nbr + j / 128]);
            CHECK(cs[j * nbc + ib] == m, "col %d block %d scale %g want %g", j, ib, cs[j * nbc + ib], m);
            for (int i = ib * 128; i < R && i < ib * 128 + 128; i++) {
                double deq = (double)fm_e4m3_to_f32(q.data[i * C + j]) * rs[i * nbr + j / 128];
                uint8_t want = nearest_code(FM_DTYPE_E4M3, deq / m);
                CHECK(o.data[j * R + i] == want, "(%d,%d) code 0x%02x want 0x%02x", i, j, o.data[j * R + i], want);
            }
        }
    qfree(&q);
    qfree(&o);
    free(x);
}

/* ROWMAX into BLOCK_128x128: the codes are the ROWMAX 128 x 1 codes, the tile's
 * one scale is what each of its 128 x 1 blocks got, and a tile with any
 * non-finite column is NaN as a whole (NaN scale, NaN codes, counted once).
 * Both scale layouts, partial tiles, E4M3 and E5M2, with and without NaN. */
static void test_rowmax_tile_output_equals_rowmax_columns(fm_context *ctx)
{
    static const int shapes[][2] = {{200, 260}, {128, 128}, {1, 300}, {257, 129}};
    fm_dtype dts[] = {FM_DTYPE_E4M3, FM_DTYPE_E5M2};
    for (int si = 0; si < 4; si++)
        for (int di = 0; di < 2; di++)
            for (int kind = 0; kind < 4; kind++) {
                const int R = shapes[si][0], C = shapes[si][1];
                const fm_dtype dt = dts[di];
                const fm_scale_layout sl = (kind & 1) ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
                float *x = make_input(1, R, C, kind);
                fm_tensor xin = fm_tensor_2d(x, FM_DTYPE_F32, R, C);
                qbuf q = qalloc(1, R, C, dt, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT);
                CHECK(fm_quantize(ctx, NULL, &xin, &q.t, NULL) == FM_OK, "quantize: %s", fm_last_error(ctx));
                /* A NaN code under a finite scale: only its column's 128 x 1 block is
                 * non-finite, the whole 128 x 128 tile must be. */
                if (kind >= 2)
                    q.data[rnd() % (uint64_t)(R * C)] = fm_elem_nan(dt);
                qbuf o1 = qalloc(1, R, C, dt, FM_LAYOUT_COLWISE, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT);
                qbuf o2 = qalloc(1, R, C, dt, FM_LAYOUT_COLWISE, FM_SCALE_BLOCK_128x128, sl);
                int64_t n1 = -1, n2 = -1;
                fm_requant_config r1 = {.rule = FM_REQUANT_ROWMAX, .nonfinite_blocks = &n1};
                fm_requant_config r2 = {.rule = FM_REQUANT_ROWMAX, .nonfinite_blocks = &n2};
                CHECK(fm_transpose_scaled(ctx, &r1, &q.t, &o1.t) == FM_OK, "128x1: %s", fm_last_error(ctx));
                CHECK(fm_transpose_scaled(ctx, &r2, &q.t, &o2.t) == FM_OK, "128x128: %s", fm_last_error(ctx));
                const float *s1 = o1.scale, *s2 = o2.scale;
                const int nbc = (R + 127) / 128, ntc = (C + 127) / 128;
                int64_t bad_tiles = 0;
                const uint8_t nan = fm_elem_nan(dt);
                for (int tc = 0; tc < ntc; tc++)
                    for (int tr = 0; tr < nbc; tr++) {
                        int bad = 0;
                        for (int j = tc * 128; j < C && j < tc * 128 + 128; j++)
                            bad |= isnan(s1[j * nbc + tr]);
                        bad_tiles += bad;
                        /* stored [C, R]: tile (tc, tr) is stored rows tc*128.., columns tr*128.. */
                        float ts = s2[fm_scale_offset(FM_SCALE_BLOCK_128x128, sl, C, R, tc * 128, tr * 128)];
                        float want = bad ? NAN : s1[tc * 128 * nbc + tr];
                        CHECK(bad ? isnan(ts) : ts == want, "%dx%d %s tile (%d,%d): scale %g want %g", R, C,
                              fm_dtype_name(dt), tc, tr, ts, want);
                        for (int j = tc * 128; j < C && j < tc * 128 + 128; j++) {
                            if (!bad)
                                CHECK(s1[j * nbc + tr] == want, "column %d of tile (%d,%d): scale %g, tile %g", j,
                                      tc, tr, s1[j * nbc + tr], want);
                            for (int i = tr * 128; i < R && i < tr * 128 + 128; i++)
                                CHECK(o2.data[j * R + i] == (bad ? nan : o1.data[j * R + i]),
                                      "%dx%d %s (%d,%d): code 0x%02x, 128x1 gives 0x%02x (bad %d)", R, C,
                                      fm_dtype_name(dt), i, j, o2.data[j * R + i], o1.data[j * R + i], bad);
                        }
                    }
                CHECK(n2 == bad_tiles, "nonfinite_blocks %lld, %lld tiles hold non-finite values", (long long)n2,
                      (long long)bad_tiles);
                CHECK(kind < 2 || bad_tiles > 0, "the NaN input made no tile non-finite");
                qfree(&q);
                qfree(&o1);
                qfree(&o2);
                free(x);
            }
    /* TIGHT cannot give one scale per tile, nor can a conversion. */
    qbuf q = qalloc(1, 64, 64, FM_DTYPE_E4M3, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT);
    qbuf o = qalloc(1, 64, 64, FM_DTYPE_E4M3, FM_LAYOUT_COLWISE, FM_SCALE_BLOCK_128x128, FM_SCALE_LAYOUT_COMPACT);
    for (int i = 0; i < 64 * 64; i++)
        q.data[i] = 0x38;
    for (int i = 0; i < 64; i++)
        ((float *)q.scale)[i] = 1.0f;
    CHECK(fm_transpose_scaled(ctx, NULL, &q.t, &o.t) == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "ROWMAX"),
          "TIGHT 1x128 -> 128x128 accepted: %s", fm_last_error(ctx));
    fm_requant_config rm = {.rule = FM_REQUANT_ROWMAX};
    o.t.dtype = FM_DTYPE_E5M2;
    CHECK(fm_transpose_scaled(ctx, &rm, &q.t, &o.t) == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "dtype"),
          "ROWMAX E4M3 -> E5M2 128x128 accepted: %s", fm_last_error(ctx));
    qfree(&q);
    qfree(&o);
}

static void test_128x128_transpose_is_exact(fm_context *ctx)
{
    int R = 300, C = 200;
    float *x = make_input(1, R, C, 0);
    fm_tensor xin = fm_tensor_2d(x, FM_DTYPE_F32, R, C);
    fm_quant_config exact = {.rule = FM_SCALE_RULE_EXACT};
    qbuf q = qalloc(1, R, C, FM_DTYPE_E4M3, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_128x128, FM_SCALE_LAYOUT_COMPACT);
    qbuf o = qalloc(1, R, C, FM_DTYPE_E4M3, FM_LAYOUT_COLWISE, FM_SCALE_BLOCK_128x128, FM_SCALE_LAYOUT_GEMM);
    qbuf w = qalloc(1, R, C, FM_DTYPE_E4M3, FM_LAYOUT_COLWISE, FM_SCALE_BLOCK_128x128, FM_SCALE_LAYOUT_GEMM);
    CHECK(fm_quantize(ctx, &exact, &xin, &q.t, &w.t) == FM_OK, "quantize: %s", fm_last_error(ctx));
    CHECK(fm_transpose_scaled(ctx, NULL, &q.t, &o.t) == FM_OK, "transpose: %s", fm_last_error(ctx));
    /* A 128x128 tile has one scale either way, so quantizing column-wise gives the same. */
    CHECK(same_bytes(&o, &w), "128x128 transpose differs from the column-wise quantization");
    qfree(&q);
    qfree(&o);
    qfree(&w);
    free(x);
}

static void test_nan_block_stays_nan(fm_context *ctx)
{
    int R = 256, C = 256;
    float *x = make_input(1, R, C, 0);
    x[5 * C + 200] = NAN; /* row 5, column block 1 */
    fm_tensor xin = fm_tensor_2d(x, FM_DTYPE_F32, R, C);
    qbuf q = qalloc(1, R, C, FM_DTYPE_E4M3, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT);
    CHECK(fm_quantize(ctx, NULL, &xin, &q.t, NULL) == FM_OK, "quantize: %s", fm_last_error(ctx));
    qbuf o = qalloc(1, R, C, FM_DTYPE_E4M3, FM_LAYOUT_COLWISE, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT);
    int64_t bad = -1;
    fm_requant_config rc = {.nonfinite_blocks = &bad};
    CHECK(fm_transpose_scaled(ctx, &rc, &q.t, &o.t) == FM_OK, "transpose: %s", fm_last_error(ctx));
    /* Row 5's block covers columns 128..255: their row-block 0 goes NaN. */
    CHECK(bad == 128, "nonfinite blocks %lld, want 128", (long long)bad);
    const float *cs = o.scale;
    for (int j = 0; j < C; j++) {
        int nan_expected = j >= 128;
        CHECK(isnan(cs[j * 2 + 0]) == nan_expected, "col %d block 0 scale %g", j, cs[j * 2]);
        CHECK(!isnan(cs[j * 2 + 1]), "col %d block 1 scale %g", j, cs[j * 2 + 1]);
        if (nan_expected)
            CHECK(o.data[j * R + 7] == 0x7F, "col %d row 7 code 0x%02x, want NaN", j, o.data[j * R + 7]);
    }
    qfree(&q);
    qfree(&o);
    free(x);
}

static void test_non_pow2_scale_is_refused(fm_context *ctx)
{
    int R = 4, C = 256;
    qbuf q = qalloc(1, R, C, FM_DTYPE_E4M3, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT);
    memset(q.data, 0x38, (size_t)R * C);
    float *s = q.scale;
    for (int k = 0; k < R * 2; k++)
        s[k] = 0.25f;
    s[5] = 0.3f;
    qbuf o = qalloc(1, R, C, FM_DTYPE_E4M3, FM_LAYOUT_COLWISE, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT);
    uint8_t before = o.data[0];
    fm_status st = fm_transpose_scaled(ctx, NULL, &q.t, &o.t);
    CHECK(st == FM_ERR_INVALID_ARG, "status %d", (int)st);
    CHECK(strstr(fm_last_error(ctx), "in->scale") && strstr(fm_last_error(ctx), "power of two"), "message: %s",
          fm_last_error(ctx));
    CHECK(o.data[0] == before, "output written although the call failed");
    float bads[] = {0.0f, -0.25f, INFINITY};
    for (int k = 0; k < 3; k++) {
        s[5] = bads[k];
        CHECK(fm_transpose_scaled(ctx, NULL, &q.t, &o.t) == FM_ERR_INVALID_ARG, "scale %g accepted", bads[k]);
    }
    s[5] = 0.25f;
    CHECK(fm_transpose_scaled(ctx, NULL, &q.t, &o.t) == FM_OK, "valid call failed: %s", fm_last_error(ctx));
    /* Rule / layout combinations that make no sense are refused, with the argument named. */
    fm_requant_config rowmax = {.rule = FM_REQUANT_ROWMAX};
    CHECK(fm_convert_scaled(ctx, &rowmax, &q.t, &o.t) == FM_ERR_INVALID_ARG, "convert across layouts accepted");
    o.t.layout = FM_LAYOUT_ROWWISE;
    CHECK(fm_convert_scaled(ctx, &rowmax, &q.t, &o.t) == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "cfg->rule"),
          "ROWMAX convert accepted: %s", fm_last_error(ctx));
    CHECK(fm_transpose_scaled(ctx, NULL, &q.t, &o.t) == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "layout"),
          "same-layout transpose accepted: %s", fm_last_error(ctx));
    qfree(&q);
    qfree(&o);
}

int main(void)
{
    fm_context_config cc = {.backend = FM_BACKEND_CPU};
    fm_context *ctx;
    if (fm_context_create(&cc, &ctx) != FM_OK) {
        printf("context: %s\n", fm_last_error(NULL));
        return 1;
    }
    test_every_code_every_shift();
    test_tight_equals_quantize_of_dequantized(ctx);
    test_rowmax_uses_max_row_scale(ctx);
    test_rowmax_tile_output_equals_rowmax_columns(ctx);
    test_128x128_transpose_is_exact(ctx);
    test_nan_block_stays_nan(ctx);
    test_non_pow2_scale_is_refused(ctx);
    fm_stats s;
    fm_stats_get(ctx, &s);
    CHECK(s.casts_to_low + s.casts_to_high > 0 && s.calls[FM_OP_TRANSPOSE_SCALED] > 0,
          "stats count transposes as ops, not casts");
    fm_context_destroy(ctx);
    printf("%d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
