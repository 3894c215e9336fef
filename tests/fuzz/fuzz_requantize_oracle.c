/* Fuzzes fm_transpose_scaled and fm_convert_scaled on fuzzer-chosen codes and
 * power-of-two scales (every code, NaN/Inf codes, NaN scales, E8M0 over its
 * whole range, garbage in the GEMM-layout padding that must be ignored).
 *
 * Oracle, the property DESIGN.md states:
 *   - TIGHT (and MX_FLOOR) output == fm_quantize(fm_dequantize(in)) with the
 *     POW2 (MX_FLOOR) rule, byte for byte (codes, scales, padding) and the
 *     same non-finite block count, whenever the dequantized input is exact in
 *     F32 (always with scales in 2^[-100, 100]; inputs with scales at the ends
 *     of the E8M0/F32 range, where F32 itself would round, skip only this
 *     comparison);
 *   - ROWMAX output == a reference written here: each output block's exponent
 *     is the largest input block exponent it covers, each code the RNE
 *     encoding of the exact value (in double) shifted by it;
 *   - ROWMAX BLOCK_1x128 -> BLOCK_128x128: the same reference, the 128 x 1
 *     blocks of each 128 x 128 tile one block (non-finite as a whole);
 *   - BLOCK_128x128 -> BLOCK_128x128: codes and scale grid transposed exactly.
 * Before anything else: a valid call is accepted, nothing crashes. */
#include <math.h>
#include <string.h>

#include "flowmoe/flowmoe.h"
#include "fuzz_common.h"
#include "fuzz_cpu_context.h"

static fm_context *g_ctx;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    g_ctx = fz_cpu_context();
    return 0;
}

static const struct {
    fm_dtype dt;
    fm_scale_mode m;
} combos[] = {
    {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E4M3, FM_SCALE_MX32},
    {FM_DTYPE_E5M2, FM_SCALE_MX32},        {FM_DTYPE_E2M1, FM_SCALE_MX32},        {FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128},
    {FM_DTYPE_E5M2, FM_SCALE_BLOCK_128x128},
};
#define NCOMBO 7

static int64_t dim_from(uint8_t b)
{
    static const int64_t edge[] = {1, 2, 3, 31, 32, 33, 64, 127, 128, 129, 130, 160, 255, 256, 257, 96};
    return b < 128 ? edge[b % 16] : 1 + (b - 128) % 72;
}

typedef struct {
    fm_tensor t;
    int64_t R, C, per; /* stored matrix, scale entries per expert */
    size_t dbytes, sbytes;
} desc;

static void describe(desc *d, int ndim, int64_t E, int64_t rows, int64_t cols, fm_dtype dt, fm_scale_mode m,
                     fm_layout l, fm_scale_layout sl, void *data, void *scale)
{
    d->t = ndim == 3 ? fm_tensor_3d(data, dt, E, rows, cols) : fm_tensor_2d(data, dt, rows, cols);
    d->t.layout = l;
    d->t.scale_mode = m;
    d->t.scale_dtype = fm_scale_mode_dtype(m);
    d->t.scale_layout = sl;
    d->t.scale = scale;
    d->R = l == FM_LAYOUT_COLWISE ? cols : rows;
    d->C = l == FM_LAYOUT_COLWISE ? rows : cols;
    d->per = fm_scale_count_2d(m, sl, d->R, d->C);
    d->dbytes = (size_t)fm_tensor_nbytes(&d->t);
    d->sbytes = (size_t)fm_tensor_scale_nbytes(&d->t);
    d->t.data_capacity = (int64_t)d->dbytes;
    d->t.scale_capacity = (int64_t)d->sbytes;
}

static uint8_t get_code(const desc *d, const uint8_t *data, int64_t e, int64_t r, int64_t c)
{
    if (d->t.dtype == FM_DTYPE_E2M1) {
        uint8_t b = data[((e * d->R + r) * d->C + c) / 2];
        return (c & 1) ? b >> 4 : b & 0xF;
    }
    return data[(e * d->R + r) * d->C + c];
}

static void put_code(const desc *d, uint8_t *data, int64_t e, int64_t r, int64_t c, uint8_t v)
{
    if (d->t.dtype == FM_DTYPE_E2M1) {
        uint8_t *b = data + ((e * d->R + r) * d->C + c) / 2;
        *b = (c & 1) ? (uint8_t)((*b & 0x0F) | (v << 4)) : (uint8_t)((*b & 0xF0) | (v & 0xF));
    } else {
        data[(e * d->R + r) * d->C + c] = v;
    }
}

static int64_t scale_off(const desc *d, int64_t e, int64_t r, int64_t c)
{
    return e * d->per + fm_scale_offset(d->t.scale_mode, d->t.scale_layout, d->R, d->C, r, c);
}

/* Block exponent (NaN block: *nan = 1) of stored element (r, c). */
static int block_exp(const desc *d, const uint8_t *scale, int64_t e, int64_t r, int64_t c, int *nan)
{
    int64_t off = scale_off(d, e, r, c);
    *nan = 0;
    if (d->t.scale_dtype == FM_DTYPE_E8M0) {
        if (scale[off] == 0xFF) {
            *nan = 1;
            return 0;
        }
        return (int)scale[off] - 127;
    }
    float s;
    memcpy(&s, scale + 4 * off, 4);
    if (isnan(s)) {
        *nan = 1;
        return 0;
    }
    int ex;
    frexp(s, &ex);
    return ex - 1;
}

static void set_scale(const desc *d, uint8_t *scale, int64_t off, int p, int nan)
{
    if (d->t.scale_dtype == FM_DTYPE_E8M0) {
        scale[off] = nan ? 0xFF : (uint8_t)(p + 127);
    } else {
        float s = nan ? NAN : (float)ldexp(1.0, p);
        memcpy(scale + 4 * off, &s, 4);
    }
}

static void fill_pad(const desc *d, uint8_t *scale)
{
    if (d->t.scale_dtype == FM_DTYPE_E8M0)
        memset(scale, 127, d->sbytes);
    else
        for (size_t k = 0; k < d->sbytes / 4; k++)
            memcpy(scale + 4 * k, &(float){1.0f}, 4);
}

static void same(const char *what, const uint8_t *got, const uint8_t *want, size_t n, const char *ctx)
{
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i])
            fz_fail("%s: %s differ at byte %zu: 0x%02x, want 0x%02x", ctx, what, i, got[i], want[i]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_reader rd = {data, size, 0}, *r = &rd;
    uint8_t b0 = fz_u8(r), b1 = fz_u8(r), b2 = fz_u8(r), b3 = fz_u8(r), b4 = fz_u8(r), b5 = fz_u8(r),
            b6 = fz_u8(r), b7 = fz_u8(r);
    int ci = b0 % NCOMBO, co = b1 % NCOMBO;
    int transpose = !(b2 & 1);
    fm_layout lin = (b2 & 2) ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE;
    fm_scale_layout slin = (b2 & 4) ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
    fm_scale_layout slout = (b2 & 8) ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
    int full_range = (b2 & 0x30) == 0x30; /* scales at the ends of the range */
    /* BLOCK_1x128 -> BLOCK_128x128 of the same FP8 dtype under ROWMAX: one
     * block a 128 x 128 tile (the ROWMAX reference below, tiles merged). */
    int tile = combos[ci].m == FM_SCALE_BLOCK_1x128 && combos[co].m == FM_SCALE_BLOCK_128x128 && (b3 & 0x40);
    if (tile) {
        co = 5 + (combos[ci].dt == FM_DTYPE_E5M2);
        transpose = 1;
    }
    int exact128 = !tile && (combos[ci].m == FM_SCALE_BLOCK_128x128 || combos[co].m == FM_SCALE_BLOCK_128x128);
    if (exact128) {
        if (combos[ci].m != FM_SCALE_BLOCK_128x128)
            ci = 5 + (ci & 1);
        co = ci;
        transpose = 1;
    }
    fm_requant_rule rule = tile ? FM_REQUANT_ROWMAX : (fm_requant_rule)(b3 % 3);
    if (rule == FM_REQUANT_ROWMAX && !tile && (!transpose || ci != co))
        rule = FM_REQUANT_TIGHT;
    if (rule == FM_REQUANT_MX_FLOOR && combos[co].m != FM_SCALE_MX32)
        rule = FM_REQUANT_TIGHT;
    int ndim = (b6 & 0x80) ? 3 : 2;
    int64_t E = ndim == 3 ? 1 + b6 % 3 : 1;
    if (ndim == 3 && (b6 & 0x40))
        E = 0;
    int64_t rows = dim_from(b4), cols = dim_from(b5);
    while (E * rows * cols > 4096)
        rows = (rows + 1) / 2;
    if (combos[ci].dt == FM_DTYPE_E2M1 || combos[co].dt == FM_DTYPE_E2M1) {
        rows += rows & 1;
        cols += cols & 1;
    }
    fm_layout lout = transpose ? (lin == FM_LAYOUT_ROWWISE ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE) : lin;

    desc in, out, q;
    describe(&in, ndim, E, rows, cols, combos[ci].dt, combos[ci].m, lin, slin, NULL, NULL);
    describe(&out, ndim, E, rows, cols, combos[co].dt, combos[co].m, lout, slout, NULL, NULL);
    uint8_t *idata = malloc(in.dbytes + 1), *iscale = malloc(in.sbytes + 1);
    uint8_t *odata = malloc(out.dbytes + 1), *oscale = malloc(out.sbytes + 1);
    if (!idata || !iscale || !odata || !oscale)
        abort();
    in.t.data = idata;
    in.t.scale = iscale;
    out.t.data = odata;
    out.t.scale = oscale;

    /* Codes: the fuzzer's bytes, repeated. Scales: the padding gets garbage
     * first (NaN, zero, non-powers of two: ignored by definition), then every
     * block its exponent. */
    size_t avail = fz_left(r);
    const uint8_t *src = r->p + r->i;
    for (size_t i = 0; i < in.dbytes; i++)
        idata[i] = avail ? src[i % avail] : (uint8_t)(i * 77);
    uint64_t seed = b7 * 0x100000001ull + avail;
    for (size_t i = 0; i < in.sbytes; i++)
        iscale[i] = (uint8_t)fz_mix(&seed);
    int64_t bc_in = fm_mode_block_cols(in.t.scale_mode), br_in = in.t.scale_mode == FM_SCALE_BLOCK_128x128 ? 128 : 1;
    size_t si = in.dbytes;
    for (int64_t e = 0; e < E; e++)
        for (int64_t rr = 0; rr < in.R; rr += br_in)
            for (int64_t cc = 0; cc < in.C; cc += bc_in) {
                uint8_t b = avail ? src[si++ % avail] : (uint8_t)(rr + cc);
                int64_t off = scale_off(&in, e, rr, cc);
                if (exact128) { /* any F32 */
                    uint32_t u = (uint32_t)fz_mix(&seed);
                    memcpy(iscale + 4 * off, &u, 4);
                    continue;
                }
                /* F32 powers of two down to the subnormal 2^-149; E8M0 2^-127 .. 2^127 */
                int p = !full_range ? (int)(b % 201) - 100
                      : in.t.scale_dtype == FM_DTYPE_E8M0 ? (int)b - 127 : (int)b * 277 / 256 - 149;
                set_scale(&in, iscale, off, p, b == 0xFF);
            }
    memset(odata, 0xA5, out.dbytes);
    memset(oscale, 0xA5, out.sbytes);
    int64_t nonfinite = -1;
    fm_requant_config cfg = {.rule = rule, .nonfinite_blocks = &nonfinite};
    char ctx[160];
    snprintf(ctx, sizeof ctx, "%s %s %s %s %s -> %s %s %s %s rule %d E %lld [%lld, %lld]",
             transpose ? "transpose" : "convert", fm_dtype_name(in.t.dtype), fm_scale_mode_name(in.t.scale_mode),
             fm_layout_name(lin), fm_scale_layout_name(slin), fm_dtype_name(out.t.dtype),
             fm_scale_mode_name(out.t.scale_mode), fm_layout_name(lout), fm_scale_layout_name(slout), (int)rule,
             (long long)E, (long long)rows, (long long)cols);
    fm_status st = transpose ? fm_transpose_scaled(g_ctx, &cfg, &in.t, &out.t) : fm_convert_scaled(g_ctx, &cfg, &in.t, &out.t);
    if (st != FM_OK)
        fz_fail("%s: refused a valid call: %s \"%s\"", ctx, fm_status_name(st), fm_last_error(g_ctx));

    if (exact128) {
        uint8_t *wd = malloc(out.dbytes + 1), *ws = malloc(out.sbytes + 1);
        fill_pad(&out, ws);
        for (int64_t e = 0; e < E; e++)
            for (int64_t i = 0; i < in.R; i++)
                for (int64_t j = 0; j < in.C; j++) {
                    put_code(&out, wd, e, j, i, get_code(&in, idata, e, i, j));
                    if (i % 128 == 0 && j % 128 == 0)
                        memcpy(ws + 4 * scale_off(&out, e, j, i), iscale + 4 * scale_off(&in, e, i, j), 4);
                }
        same("codes", odata, wd, out.dbytes, ctx);
        same("scales", oscale, ws, out.sbytes, ctx);
        if (nonfinite != 0)
            fz_fail("%s: nonfinite_blocks %lld for an exact transpose", ctx, (long long)nonfinite);
        free(wd);
        free(ws);
    } else if (rule == FM_REQUANT_ROWMAX) {
        /* the reference, from the rule's words */
        uint8_t *wd = calloc(out.dbytes + 1, 1), *ws = malloc(out.sbytes + 1);
        fill_pad(&out, ws);
        int64_t bo = fm_mode_block_cols(out.t.scale_mode), nbo = (out.C + bo - 1) / bo;
        int *pout = malloc(sizeof(int) * (size_t)(out.R * nbo + 1));
        uint8_t *bad = calloc((size_t)(out.R * nbo + 1), 1);
        int64_t want_bad = 0;
        for (int64_t e = 0; e < E; e++) {
            for (int64_t k = 0; k < out.R * nbo; k++) {
                pout[k] = -100000;
                bad[k] = 0;
            }
            for (int64_t i = 0; i < in.R; i++)
                for (int64_t j = 0; j < in.C; j++) {
                    int nan, p = block_exp(&in, iscale, e, i, j, &nan);
                    int64_t k = j * nbo + i / bo; /* transposed: stored (j, i) */
                    uint8_t c = get_code(&in, idata, e, i, j);
                    if (nan || isnan(fm_elem_decode(in.t.dtype, c)) || isinf(fm_elem_decode(in.t.dtype, c)))
                        bad[k] = 1;
                    else if (p > pout[k])
                        pout[k] = p;
                }
            if (tile) /* the 128 stored rows of a tile are one block */
                for (int64_t t0 = 0; t0 < out.R; t0 += 128)
                    for (int64_t cb = 0; cb < nbo; cb++) {
                        uint8_t any = 0;
                        for (int64_t r = t0; r < out.R && r < t0 + 128; r++)
                            any |= bad[r * nbo + cb];
                        for (int64_t r = t0; r < out.R && r < t0 + 128; r++)
                            bad[r * nbo + cb] = any;
                    }
            for (int64_t k = 0; k < out.R * nbo; k++) {
                int p = pout[k] < -127 ? -127 : pout[k] > 127 ? 127 : pout[k];
                pout[k] = p;
                want_bad += bad[k] && (!tile || (k / nbo) % 128 == 0);
                set_scale(&out, ws, scale_off(&out, e, k / nbo, (k % nbo) * bo), p, bad[k]);
            }
            for (int64_t i = 0; i < in.R; i++)
                for (int64_t j = 0; j < in.C; j++) {
                    int nan, p = block_exp(&in, iscale, e, i, j, &nan);
                    int64_t k = j * nbo + i / bo;
                    uint8_t c = get_code(&in, idata, e, i, j), v;
                    if (bad[k])
                        v = fm_elem_nan(out.t.dtype);
                    else
                        v = fm_elem_encode(out.t.dtype,
                                           (float)ldexp((double)fm_elem_decode(in.t.dtype, c), p - pout[k]));
                    put_code(&out, wd, e, j, i, v);
                }
        }
        same("codes", odata, wd, out.dbytes, ctx);
        same("scales", oscale, ws, out.sbytes, ctx);
        if (nonfinite != want_bad)
            fz_fail("%s: nonfinite_blocks %lld, want %lld", ctx, (long long)nonfinite, (long long)want_bad);
        free(pout);
        free(bad);
        free(wd);
        free(ws);
    } else {
        /* Is the dequantized input exact in F32? */
        int exact = 1;
        for (int64_t e = 0; e < E && exact; e++)
            for (int64_t i = 0; i < in.R && exact; i++)
                for (int64_t j = 0; j < in.C && exact; j++) {
                    int nan, p = block_exp(&in, iscale, e, i, j, &nan);
                    double v = ldexp((double)fm_elem_decode(in.t.dtype, get_code(&in, idata, e, i, j)), p);
                    if (!nan && isfinite(v) && ((double)(float)v != v || isinf((float)v)))
                        exact = 0;
                }
        if (exact) {
            int64_t n = E * rows * cols;
            float *x = malloc((size_t)(n ? n : 1) * sizeof(float));
            fm_tensor tx = ndim == 3 ? fm_tensor_3d(x, FM_DTYPE_F32, E, rows, cols) : fm_tensor_2d(x, FM_DTYPE_F32, rows, cols);
            if ((st = fm_dequantize(g_ctx, &in.t, &tx)))
                fz_fail("%s: fm_dequantize: %s", ctx, fm_last_error(g_ctx));
            uint8_t *qd = malloc(out.dbytes + 1), *qs = malloc(out.sbytes + 1);
            describe(&q, ndim, E, rows, cols, out.t.dtype, out.t.scale_mode, lout, slout, qd, qs);
            int64_t qbad = -1;
            fm_quant_config qc = {.rule = rule == FM_REQUANT_MX_FLOOR ? FM_SCALE_RULE_MX_FLOOR : FM_SCALE_RULE_POW2,
                                  .nonfinite_blocks = &qbad};
            if ((st = fm_quantize(g_ctx, &qc, &tx, lout == FM_LAYOUT_ROWWISE ? &q.t : NULL,
                                  lout == FM_LAYOUT_COLWISE ? &q.t : NULL)))
                fz_fail("%s: fm_quantize: %s", ctx, fm_last_error(g_ctx));
            same("codes vs quantize(dequantize(in))", odata, qd, out.dbytes, ctx);
            same("scales vs quantize(dequantize(in))", oscale, qs, out.sbytes, ctx);
            if (nonfinite != qbad)
                fz_fail("%s: nonfinite_blocks %lld, quantize(dequantize(in)) counts %lld", ctx, (long long)nonfinite,
                        (long long)qbad);
            free(x);
            free(qd);
            free(qs);
        }
    }
    free(idata);
    free(iscale);
    free(odata);
    free(oscale);
    return 0;
}
