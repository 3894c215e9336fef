/* CPU reference of the scaling-aware transpose and the direct FP8 <-> MXFP4
 * conversions: one re-encoding on codes and scale exponents (transpose.h). */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

#define P_NAN INT_MIN     /* input block exponent of a non-finite block */
#define P_EMPTY INT_MIN   /* output block that has seen no nonzero code */

static uint8_t get_code(const uint8_t *data, fm_dtype t, int64_t C, int64_t r, int64_t c)
{
    return t == FM_DTYPE_E2M1 ? fm_cpu_get_nibble(data + (size_t)(r * C / 2), c) : data[(size_t)(r * C + c)];
}

static void put_code(uint8_t *data, fm_dtype t, int64_t C, int64_t r, int64_t c, uint8_t v)
{
    if (t == FM_DTYPE_E2M1)
        fm_cpu_put_nibble(data + (size_t)(r * C / 2), c, v);
    else
        data[(size_t)(r * C + c)] = v;
}

static size_t scale_bytes(const fm_tensor *t) { return t->scale_dtype == FM_DTYPE_E8M0 ? 1 : 4; }

/* BLOCK_128x128 -> BLOCK_128x128 transposed: codes and scale grid move, nothing is re-rounded. */
static void transpose_128x128(const fm_tensor *in, fm_tensor *out, int64_t E, int64_t R, int64_t C)
{
    int64_t sin = fm_scale_count_2d(in->scale_mode, in->scale_layout, R, C);
    int64_t sout = fm_scale_count_2d(out->scale_mode, out->scale_layout, C, R);
    for (int64_t e = 0; e < E; e++) {
        const uint8_t *a = (const uint8_t *)in->data + (size_t)(e * R * C);
        uint8_t *b = (uint8_t *)out->data + (size_t)(e * R * C);
        for (int64_t r = 0; r < R; r++)
            for (int64_t c = 0; c < C; c++)
                b[(size_t)(c * R + r)] = a[(size_t)(r * C + c)];
        const float *s = (const float *)in->scale + e * sin;
        float *d = (float *)out->scale + e * sout;
        for (int64_t k = 0; k < sout; k++)
            d[k] = 1.0f;
        for (int64_t rb = 0; rb < fm_cdiv(R, 128); rb++)
            for (int64_t cb = 0; cb < fm_cdiv(C, 128); cb++)
                d[fm_scale_offset(out->scale_mode, out->scale_layout, C, R, cb * 128, rb * 128)] =
                    s[fm_scale_offset(in->scale_mode, in->scale_layout, R, C, rb * 128, cb * 128)];
    }
}

/* What every matrix of one call shares, and scratch for the largest one. */
typedef struct rq_plan {
    const fm_tensor *in, *out;
    fm_dtype ti, to;
    int transpose, rowmax, tile; /* tile: a 128x128 output (1x128 in, ROWMAX): one block per 128 x 128 tile */
    int64_t bi, bo;
    int lut[256]; /* P of each code alone, for the output format */
    int *pin, *pout;
    uint8_t *bad;
} rq_plan;

/* One input matrix, as the scale array sees it: its Ri rows are rows
 * row0.. of a matrix of sR rows (a whole expert: row0 0, sR Ri; a group of
 * fm_transpose_scaled_grouped: its place in [sum(M_i), N]). */
typedef struct rq_matrix {
    const uint8_t *a, *sb; /* codes of row 0, the scale array holding its rows */
    int64_t sR, row0, Ri, Ci;
    uint8_t *b, *so;       /* output codes and this matrix's own output scale array */
} rq_matrix;

static fm_status plan_init(fm_context *ctx, rq_plan *pl, const fm_requant_config *cfg, const fm_tensor *in,
                           const fm_tensor *out, int64_t max_rows, const char *op)
{
    int64_t Ci = fm_tensor_stored_cols(in);
    pl->in = in;
    pl->out = out;
    pl->ti = in->dtype;
    pl->to = out->dtype;
    pl->transpose = in->layout != out->layout;
    pl->rowmax = cfg->rule == FM_REQUANT_ROWMAX;
    pl->tile = out->scale_mode == FM_SCALE_BLOCK_128x128;
    pl->bi = fm_mode_block_cols(in->scale_mode);
    pl->bo = fm_mode_block_cols(out->scale_mode);
    int64_t Ro = pl->transpose ? Ci : max_rows, Co = pl->transpose ? max_rows : Ci;
    int64_t nin = max_rows * fm_cdiv(Ci, pl->bi), nout = Ro * fm_cdiv(Co, pl->bo);
    size_t ni = (size_t)(nin > 0 ? nin : 1), no = (size_t)(nout > 0 ? nout : 1);
    pl->pin = malloc(ni * sizeof(int));
    pl->pout = malloc(no * sizeof(int));
    pl->bad = malloc(no);
    if (!pl->pin || !pl->pout || !pl->bad) {
        free(pl->pin);
        free(pl->pout);
        free(pl->bad);
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "%s: out of host memory for the block exponents", op);
    }
    for (int c = 0; c < 256; c++)
        pl->lut[c] = fm_code_scale_exp(pl->ti, (uint8_t)c, pl->to, cfg->rule == FM_REQUANT_MX_FLOOR);
    return FM_OK;
}

static void plan_free(rq_plan *pl)
{
    free(pl->pin);
    free(pl->pout);
    free(pl->bad);
}

static int64_t in_scale_off(const rq_plan *pl, const rq_matrix *m, int64_t r, int64_t cb)
{
    return fm_scale_offset(pl->in->scale_mode, pl->in->scale_layout, m->sR, m->Ci, m->row0 + r, cb * pl->bi);
}

/* Every input scale is checked before anything is written; `expert` names the matrix in the sentence. */
static fm_status check_pow2(fm_context *ctx, const rq_plan *pl, const rq_matrix *m, int64_t expert)
{
    if (pl->in->scale_dtype == FM_DTYPE_E8M0)
        return FM_OK;
    int64_t nbi = fm_cdiv(m->Ci, pl->bi);
    for (int64_t r = 0; r < m->Ri; r++)
        for (int64_t cb = 0; cb < nbi; cb++) {
            int p;
            float s = ((const float *)m->sb)[in_scale_off(pl, m, r, cb)];
            if (!fm_f32_pow2_exp(s, &p))
                return fm_error(ctx, FM_ERR_INVALID_ARG,
                                "in->scale: the scale of block (expert %lld, stored row %lld, block %lld) is %g, "
                                "not a positive power of two; scaling-aware ops need POW2 scales",
                                (long long)expert, (long long)r, (long long)cb, (double)s);
        }
    return FM_OK;
}

/* Re-encodes one matrix; returns its count of non-finite output blocks. */
static int64_t requant_matrix(rq_plan *pl, const rq_matrix *m)
{
    const fm_tensor *out = pl->out;
    const int transpose = pl->transpose;
    const int64_t Ri = m->Ri, Ci = m->Ci, bi = pl->bi, bo = pl->bo;
    const int64_t Ro = transpose ? Ci : Ri, Co = transpose ? Ri : Ci;
    const int64_t nbi = fm_cdiv(Ci, bi), nbo = fm_cdiv(Co, bo);
    const int64_t sout = fm_scale_count_2d(out->scale_mode, out->scale_layout, Ro, Co);
    const fm_dtype ti = pl->ti, to = pl->to;
    const uint8_t nan = fm_elem_nan(to);
    int *pin = pl->pin, *pout = pl->pout;
    uint8_t *bad = pl->bad;

    for (int64_t r = 0; r < Ri; r++)
        for (int64_t cb = 0; cb < nbi; cb++) {
            int64_t off = in_scale_off(pl, m, r, cb);
            int p = 0;
            if (pl->in->scale_dtype == FM_DTYPE_E8M0)
                p = m->sb[off] == FM_E8M0_NAN ? P_NAN : (int)m->sb[off] - 127;
            else if (fm_f32_pow2_exp(((const float *)m->sb)[off], &p) == 2)
                p = P_NAN;
            pin[r * nbi + cb] = p;
        }
    for (int64_t k = 0; k < Ro * nbo; k++) {
        pout[k] = P_EMPTY;
        bad[k] = 0;
    }
    /* Each output block's exponent from the codes and exponents it covers. */
    for (int64_t r = 0; r < Ri; r++)
        for (int64_t c = 0; c < Ci; c++) {
            int64_t ro = transpose ? c : r, co = transpose ? r : c;
            int64_t k = ro * nbo + co / bo;
            int p = pin[r * nbi + c / bi];
            uint8_t code = get_code(m->a, ti, Ci, r, c);
            if (p == P_NAN || fm_elem_code_nonfinite(ti, code)) {
                bad[k] = 1;
                continue;
            }
            int q = pl->rowmax ? p : fm_elem_code_mag(ti, code) ? pl->lut[code] + p : P_EMPTY;
            if (q > pout[k])
                pout[k] = q;
        }
    /* A 128x128 output block is the 128 stored rows of a tile: ROWMAX gave
     * them one exponent, and one non-finite column makes the whole tile so. */
    if (pl->tile)
        for (int64_t t0 = 0; t0 < Ro; t0 += 128)
            for (int64_t cb = 0; cb < nbo; cb++) {
                uint8_t any = 0;
                for (int64_t ro = t0; ro < Ro && ro < t0 + 128; ro++)
                    any |= bad[ro * nbo + cb];
                for (int64_t ro = t0; ro < Ro && ro < t0 + 128; ro++)
                    bad[ro * nbo + cb] = any;
            }
    float *so32 = (float *)m->so;
    if (out->scale_dtype == FM_DTYPE_E8M0)
        memset(m->so, 127, (size_t)sout);
    else
        for (int64_t k = 0; k < sout; k++)
            so32[k] = 1.0f;
    int64_t nbad = 0;
    for (int64_t ro = 0; ro < Ro; ro++)
        for (int64_t cb = 0; cb < nbo; cb++) {
            int64_t k = ro * nbo + cb;
            int64_t off = fm_scale_offset(out->scale_mode, out->scale_layout, Ro, Co, ro, cb * bo);
            int p = pout[k] == P_EMPTY ? 0 : pout[k] < -127 ? -127 : pout[k] > 127 ? 127 : pout[k];
            pout[k] = p;
            nbad += bad[k] && (!pl->tile || ro % 128 == 0);
            if (out->scale_dtype == FM_DTYPE_E8M0)
                m->so[off] = bad[k] ? (uint8_t)FM_E8M0_NAN : (uint8_t)(p + 127);
            else
                so32[off] = bad[k] ? fm_bits_f32(FM_F32_CANON_NAN) : fm_exp2i(p);
        }
    for (int64_t r = 0; r < Ri; r++)
        for (int64_t c = 0; c < Ci; c++) {
            int64_t ro = transpose ? c : r, co = transpose ? r : c;
            int64_t k = ro * nbo + co / bo;
            uint8_t v = bad[k] ? nan
                               : fm_requant_code(ti, get_code(m->a, ti, Ci, r, c), pin[r * nbi + c / bi] - pout[k], to);
            put_code(m->b, to, Co, ro, co, v);
        }
    return nbad;
}

fm_status fm_cpu_requantize(fm_context *ctx, const fm_requant_config *cfg, const fm_tensor *in, fm_tensor *out)
{
    int64_t E = fm_tensor_experts(in), Ri = fm_tensor_stored_rows(in), Ci = fm_tensor_stored_cols(in);
    /* An empty tensor has no codes and, in the block modes, no scales: its
     * buffers may be NULL and nothing is written. */
    if (fm_tensor_numel(in) == 0) {
        if (cfg->nonfinite_blocks)
            *cfg->nonfinite_blocks = 0;
        return FM_OK;
    }
    int transpose = in->layout != out->layout;
    if (in->scale_mode == FM_SCALE_BLOCK_128x128) {
        transpose_128x128(in, out, E, Ri, Ci);
        if (cfg->nonfinite_blocks)
            *cfg->nonfinite_blocks = 0;
        return FM_OK;
    }
    int64_t Ro = transpose ? Ci : Ri, Co = transpose ? Ri : Ci;
    int64_t sin = fm_scale_count_2d(in->scale_mode, in->scale_layout, Ri, Ci);
    int64_t sout = fm_scale_count_2d(out->scale_mode, out->scale_layout, Ro, Co);
    int64_t in_bytes = fm_tensor_nbytes(in) / (E ? E : 1), out_bytes = fm_tensor_nbytes(out) / (E ? E : 1);
    rq_plan pl;
    fm_status st = plan_init(ctx, &pl, cfg, in, out, Ri, transpose ? "fm_transpose_scaled" : "fm_convert_scaled");
    if (st)
        return st;
    rq_matrix *ms = malloc((size_t)(E > 0 ? E : 1) * sizeof *ms);
    if (!ms) {
        plan_free(&pl);
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "%s: out of host memory",
                        transpose ? "fm_transpose_scaled" : "fm_convert_scaled");
    }
    for (int64_t e = 0; e < E; e++)
        ms[e] = (rq_matrix){
            .a = (const uint8_t *)in->data + (size_t)(e * in_bytes),
            .sb = (const uint8_t *)in->scale + (size_t)(e * sin) * scale_bytes(in),
            .sR = Ri, .row0 = 0, .Ri = Ri, .Ci = Ci,
            .b = (uint8_t *)out->data + (size_t)(e * out_bytes),
            .so = (uint8_t *)out->scale + (size_t)(e * sout) * scale_bytes(out),
        };
    for (int64_t e = 0; e < E && !st; e++)
        st = check_pow2(ctx, &pl, &ms[e], e);
    int64_t total_bad = 0;
    for (int64_t e = 0; e < E && !st; e++)
        total_bad += requant_matrix(&pl, &ms[e]);
    if (!st && cfg->nonfinite_blocks)
        *cfg->nonfinite_blocks = total_bad;
    free(ms);
    plan_free(&pl);
    return st;
}

/* Each group's rows are a matrix of their own: same rules as above, read
 * from their place in the [sum(M_i), N] input, written to the group's own
 * column-wise matrix and scale array. */
fm_status fm_cpu_requantize_grouped(fm_context *ctx, const fm_requant_config *cfg, const fm_splits *splits,
                                    const fm_tensor *in, fm_tensor *out)
{
    const int64_t G = splits->groups, R = in->shape[0], N = in->shape[1];
    /* Nothing to move, and the buffers may be NULL (no pointer arithmetic on them). */
    if (R == 0 || N == 0) {
        if (cfg->nonfinite_blocks)
            *cfg->nonfinite_blocks = 0;
        return FM_OK;
    }
    int64_t max_rows = 0;
    for (int64_t g = 0; g < G; g++)
        max_rows = splits->host[g] > max_rows ? splits->host[g] : max_rows;
    rq_plan pl;
    fm_status st = plan_init(ctx, &pl, cfg, in, out, max_rows, "fm_transpose_scaled_grouped");
    if (st)
        return st;
    rq_matrix *ms = malloc((size_t)G * sizeof *ms);
    if (!ms) {
        plan_free(&pl);
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_transpose_scaled_grouped: out of host memory");
    }
    /* Element offsets N * row0 are whole bytes for E2M1: N is even for an
     * E2M1 input, every group size is for an E2M1 output (core checks both). */
    const int in4 = in->dtype == FM_DTYPE_E2M1, out4 = out->dtype == FM_DTYPE_E2M1;
    int64_t row0 = 0, s0 = 0;
    for (int64_t g = 0; g < G; g++) {
        const int64_t M = splits->host[g];
        ms[g] = (rq_matrix){
            .a = (const uint8_t *)in->data + (size_t)(in4 ? row0 * N / 2 : row0 * N),
            .sb = (const uint8_t *)in->scale,
            .sR = R, .row0 = row0, .Ri = M, .Ci = N,
            .b = (uint8_t *)out->data + (size_t)(out4 ? row0 * N / 2 : row0 * N),
            .so = (uint8_t *)out->scale + (size_t)s0 * scale_bytes(out),
        };
        row0 += M;
        s0 += fm_scale_count_2d(out->scale_mode, out->scale_layout, N, M);
    }
    for (int64_t g = 0; g < G && !st; g++)
        st = check_pow2(ctx, &pl, &ms[g], g);
    int64_t total_bad = 0;
    for (int64_t g = 0; g < G && !st; g++)
        total_bad += requant_matrix(&pl, &ms[g]);
    if (!st && cfg->nonfinite_blocks)
        *cfg->nonfinite_blocks = total_bad;
    free(ms);
    plan_free(&pl);
    return st;
}
