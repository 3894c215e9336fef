/* CPU reference quantize: every mode, row-wise and column-wise outputs.
 *
 * Three steps per expert: (A) the amax of every scale block, kept as the
 * integer bits of |x| so that Inf and NaN order above every finite value and
 * a block is non-finite exactly when its amax bits are >= 0x7F800000;
 * (B) each block's scale by the rule; (C) the codes. */
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

typedef struct {
    fm_tensor *out;
    int colwise;
    fm_scale_rule rule;
    int64_t R, C;         /* stored matrix */
    int64_t br, bc;       /* block extent in stored rows / cols */
    int64_t nbr, nbc;     /* block grid */
    uint32_t *amax;       /* [nbr * nbc] bits of the block amax */
    float *mult;          /* [nbr * nbc] code = encode(x * mult); NaN marks a non-finite block */
    uint32_t *colmax;     /* [cols] running column amax bits (column-wise plans) */
    size_t code_bytes;    /* data bytes per expert */
} plan;

typedef struct {
    const fm_tensor *in;
    int64_t rows, cols;
    plan *p;
    int np;
    int64_t e;            /* expert being encoded */
    int64_t panels;       /* 128-row panels per expert */
    float *tiles;         /* [workers][128 * TW] */
} enc_job;

static void plan_init(plan *p, fm_tensor *out, int colwise, fm_scale_rule rule, int64_t rows, int64_t cols)
{
    p->out = out;
    p->colwise = colwise;
    p->rule = rule;
    p->R = colwise ? cols : rows;
    p->C = colwise ? rows : cols;
    switch (out->scale_mode) {
    case FM_SCALE_TENSOR: p->br = p->R; p->bc = p->C; break;
    case FM_SCALE_ROW: p->br = 1; p->bc = p->C; break;
    case FM_SCALE_BLOCK_128x128: p->br = 128; p->bc = 128; break;
    default: p->br = 1; p->bc = fm_mode_block_cols(out->scale_mode); break;
    }
    if (p->br < 1)
        p->br = 1;
    if (p->bc < 1)
        p->bc = 1;
    /* An empty matrix still has its TENSOR scale, and empty rows their ROW scales. */
    int whole_c = out->scale_mode == FM_SCALE_TENSOR || out->scale_mode == FM_SCALE_ROW;
    p->nbr = p->R ? fm_cdiv(p->R, p->br) : (out->scale_mode == FM_SCALE_TENSOR);
    p->nbc = p->C ? fm_cdiv(p->C, p->bc) : whole_c;
    p->code_bytes = (size_t)(out->dtype == FM_DTYPE_E2M1 ? p->R * p->C / 2 : p->R * p->C);
}

static inline uint32_t abs_bits(float x) { return fm_f32_bits(x) & 0x7FFFFFFFu; }

/* (A) for one logical row i of the current expert. Column-wise blocks run
 * down the columns: collect a running max per column (contiguous) and fold it
 * into the block grid when the block's last row has been seen. */
static void amax_row(plan *p, const float *x, int64_t i, int64_t rows, int64_t cols)
{
    if (!p->colwise) {
        uint32_t *a = p->amax + (i / p->br) * p->nbc;
        for (int64_t cb = 0; cb < p->nbc; cb++) {
            int64_t j0 = cb * p->bc, j1 = j0 + p->bc < cols ? j0 + p->bc : cols;
            uint32_t m = a[cb];
            for (int64_t j = j0; j < j1; j++) {
                uint32_t v = abs_bits(x[j]);
                m = v > m ? v : m;
            }
            a[cb] = m;
        }
        return;
    }
    uint32_t *cm = p->colmax;
    for (int64_t j = 0; j < cols; j++) {
        uint32_t v = abs_bits(x[j]);
        cm[j] = v > cm[j] ? v : cm[j];
    }
    if ((i + 1) % p->bc != 0 && i + 1 != rows)
        return;
    int64_t cblk = i / p->bc;
    for (int64_t j = 0; j < cols; j++) {
        uint32_t *a = p->amax + (j / p->br) * p->nbc + cblk;
        *a = cm[j] > *a ? cm[j] : *a;
        cm[j] = 0;
    }
}

/* (B): scales of one expert into its slice of out->scale; returns the
 * number of non-finite blocks. */
static int64_t choose_scales(plan *p, const fm_quant_config *cfg, int64_t e)
{
    fm_tensor *o = p->out;
    int64_t per = fm_scale_count_2d(o->scale_mode, o->scale_layout, p->R, p->C);
    if (per == 0) /* an empty matrix without scales: o->scale may be NULL */
        return 0;
    int e8 = o->scale_dtype == FM_DTYPE_E8M0;
    uint8_t *s8 = (uint8_t *)o->scale + e * per;
    float *s32 = (float *)o->scale + e * per;
    /* GEMM-layout padding reads as scale 1. */
    if (e8)
        memset(s8, 127, (size_t)per);
    else
        for (int64_t k = 0; k < per; k++)
            s32[k] = 1.0f;
    int64_t bad = 0;
    for (int64_t rb = 0; rb < p->nbr; rb++)
        for (int64_t cb = 0; cb < p->nbc; cb++) {
            int64_t b = rb * p->nbc + cb;
            int64_t off = fm_scale_offset(o->scale_mode, o->scale_layout, p->R, p->C, rb * p->br, cb * p->bc);
            if (p->amax[b] >= 0x7F800000u) {
                bad++;
                p->mult[b] = fm_bits_f32(FM_F32_CANON_NAN);
                if (e8)
                    s8[off] = FM_E8M0_NAN;
                else
                    s32[off] = fm_bits_f32(FM_F32_CANON_NAN);
                continue;
            }
            float a = fm_bits_f32(p->amax[b]);
            if (a < cfg->epsilon)
                a = cfg->epsilon;
            if (p->rule == FM_SCALE_RULE_EXACT) {
                float m = fm_exact_scale(a, o->dtype);
                p->mult[b] = m;
                s32[off] = 1.0f / m;
            } else {
                int pw = p->rule == FM_SCALE_RULE_MX_FLOOR ? fm_mx_floor_scale_exp(a, o->dtype)
                                                            : fm_pow2_scale_exp(a, o->dtype);
                p->mult[b] = fm_exp2i(-pw);
                if (e8)
                    s8[off] = (uint8_t)(pw + 127);
                else
                    s32[off] = fm_exp2i(pw);
            }
        }
    return bad;
}

/* (C) row-wise codes of logical row i, columns [j0, j1) (block aligned). */
static void encode_row(const plan *p, const float *x, int64_t e, int64_t i, int64_t cols, int64_t j0, int64_t j1)
{
    fm_dtype t = p->out->dtype;
    uint8_t nan = fm_elem_nan(t);
    uint8_t *base = (uint8_t *)p->out->data + (size_t)e * p->code_bytes;
    const float *m = p->mult + (i / p->br) * p->nbc;
    if (t == FM_DTYPE_E2M1) {
        uint8_t *row = base + (size_t)(i * cols / 2);
        for (int64_t j = j0; j + 1 < j1; j += 2) {
            float mj = m[j / p->bc];
            uint8_t lo = nan, hi = nan;
            if (!fm_f32_is_nan(mj)) {
                lo = fm_e2m1_from_f32(x[j - j0] * mj);
                hi = fm_e2m1_from_f32(x[j + 1 - j0] * mj);
            }
            row[j / 2] = (uint8_t)(lo | (hi << 4));
        }
        return;
    }
    uint8_t *row = base + (size_t)(i * cols);
    for (int64_t b0 = j0; b0 < j1;) {
        int64_t b1 = (b0 / p->bc + 1) * p->bc;
        if (b1 > j1)
            b1 = j1;
        float mj = m[b0 / p->bc];
        if (fm_f32_is_nan(mj))
            memset(row + b0, nan, (size_t)(b1 - b0));
        else if (t == FM_DTYPE_E4M3)
            for (int64_t j = b0; j < b1; j++)
                row[j] = fm_e4m3_from_f32(x[j - j0] * mj);
        else
            for (int64_t j = b0; j < b1; j++)
                row[j] = fm_e5m2_from_f32(x[j - j0] * mj);
        b0 = b1;
    }
}

/* (C) column-wise codes of a tile: logical rows [i0, i1), columns [j0, j1),
 * tile[(i - i0) * TW + (j - j0)]. Writes run along i, the stored row. */
#define TW 256
static void encode_tile_colwise(const plan *p, const float *tile, int64_t e, int64_t i0, int64_t i1, int64_t j0,
                                int64_t j1)
{
    fm_dtype t = p->out->dtype;
    uint8_t nan = fm_elem_nan(t);
    int64_t rows = p->C;
    uint8_t *base = (uint8_t *)p->out->data + (size_t)e * p->code_bytes;
    for (int64_t j = j0; j < j1; j++) {
        const float *m = p->mult + (j / p->br) * p->nbc;
        const float *x = tile + (j - j0);
        if (t == FM_DTYPE_E2M1) {
            uint8_t *row = base + (size_t)(j * rows / 2);
            for (int64_t i = i0; i + 1 < i1; i += 2) {
                float mi = m[i / p->bc];
                uint8_t lo = nan, hi = nan;
                if (!fm_f32_is_nan(mi)) {
                    lo = fm_e2m1_from_f32(x[(i - i0) * TW] * mi);
                    hi = fm_e2m1_from_f32(x[(i + 1 - i0) * TW] * mi);
                }
                row[i / 2] = (uint8_t)(lo | (hi << 4));
            }
            continue;
        }
        uint8_t *row = base + (size_t)(j * rows);
        for (int64_t i = i0; i < i1; i++) {
            float mi = m[i / p->bc];
            row[i] = fm_f32_is_nan(mi) ? nan : fm_elem_encode(t, x[(i - i0) * TW] * mi);
        }
    }
}

/* Items are 128-row panels; each is encoded in tiles of 128 x TW so that the
 * column-wise writes stay in cache. Panels are even-aligned, so E2M1 bytes
 * shared by two logical rows never straddle workers. */
static void encode_panels(void *arg, int64_t begin, int64_t end, int worker)
{
    enc_job *jb = arg;
    float *tile = jb->tiles + (size_t)worker * 128 * TW;
    const fm_tensor *in = jb->in;
    for (int64_t pn = begin; pn < end; pn++) {
        int64_t i0 = pn * 128, i1 = i0 + 128 < jb->rows ? i0 + 128 : jb->rows;
        for (int64_t j0 = 0; j0 < jb->cols; j0 += TW) {
            int64_t j1 = j0 + TW < jb->cols ? j0 + TW : jb->cols;
            for (int64_t i = i0; i < i1; i++) {
                float *x = tile + (i - i0) * TW;
                fm_cpu_load_row(in->data, in->dtype, (jb->e * jb->rows + i) * jb->cols + j0, j1 - j0, x);
                for (int k = 0; k < jb->np; k++)
                    if (!jb->p[k].colwise)
                        encode_row(&jb->p[k], x, jb->e, i, jb->cols, j0, j1);
            }
            for (int k = 0; k < jb->np; k++)
                if (jb->p[k].colwise)
                    encode_tile_colwise(&jb->p[k], tile, jb->e, i0, i1, j0, j1);
        }
    }
}

fm_status fm_cpu_quantize(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *in, fm_tensor *out_row,
                          fm_tensor *out_col)
{
    int64_t E = fm_tensor_experts(in), rows = fm_tensor_stored_rows(in), cols = fm_tensor_stored_cols(in);
    plan p[2];
    int np = 0;
    if (out_row)
        plan_init(&p[np++], out_row, 0, fm_effective_rule(cfg->rule, out_row->scale_mode), rows, cols);
    if (out_col)
        plan_init(&p[np++], out_col, 1, fm_effective_rule(cfg->rule, out_col->scale_mode), rows, cols);

    /* Nothing to encode and no scale to write: no scratch either, which a
     * [0, 2^31 - 2] input would size by its width. */
    if ((E == 0 || rows == 0 || cols == 0) && (!out_row || fm_tensor_scale_count(out_row) == 0) &&
        (!out_col || fm_tensor_scale_count(out_col) == 0)) {
        if (cfg->amax)
            *cfg->amax = 0.0f;
        if (cfg->nonfinite_blocks)
            *cfg->nonfinite_blocks = 0;
        return FM_OK;
    }
    int64_t panels = fm_cdiv(rows, 128);
    int64_t workers = fm_cpu_workers(ctx);
    fm_status st = FM_OK;
    /* Row buffers only where there are rows: a TENSOR-mode [0, C] has a scale
     * to write but nothing to load. */
    size_t width = E > 0 && rows > 0 && cols > 0 ? (size_t)cols : 1;
    float *rowbuf = malloc(width * sizeof(float));
    float *tiles = malloc((size_t)workers * 128 * 256 * sizeof(float));
    for (int k = 0; k < np; k++) {
        size_t nb = (size_t)(p[k].nbr * p[k].nbc);
        p[k].amax = malloc((nb ? nb : 1) * sizeof(uint32_t));
        p[k].mult = malloc((nb ? nb : 1) * sizeof(float));
        p[k].colmax = calloc(width, sizeof(uint32_t));
        if (!p[k].amax || !p[k].mult || !p[k].colmax)
            st = FM_ERR_OUT_OF_MEMORY;
    }
    if (!rowbuf || !tiles)
        st = FM_ERR_OUT_OF_MEMORY;
    if (st) {
        fm_error(ctx, st, "fm_quantize: out of host memory for the block scratch of a [%lld, %lld] input",
                 (long long)rows, (long long)cols);
        goto done;
    }

    uint32_t amax_all = 0;
    int64_t bad = 0;
    for (int64_t e = 0; e < E; e++) {
        for (int k = 0; k < np; k++)
            memset(p[k].amax, 0, (size_t)(p[k].nbr * p[k].nbc) * sizeof(uint32_t));
        /* Rows of no columns hold nothing to load (in->data may be NULL). */
        for (int64_t i = 0; i < rows && cols > 0; i++) {
            fm_cpu_load_row(in->data, in->dtype, (e * rows + i) * cols, cols, rowbuf);
            for (int k = 0; k < np; k++)
                amax_row(&p[k], rowbuf, i, rows, cols);
            if (cfg->amax)
                for (int64_t j = 0; j < cols; j++) {
                    uint32_t v = abs_bits(rowbuf[j]);
                    amax_all = v > amax_all ? v : amax_all;
                }
        }
        for (int k = 0; k < np; k++)
            bad += choose_scales(&p[k], cfg, e);
        enc_job jb = {in, rows, cols, p, np, e, panels, tiles};
        fm_cpu_parallel_for(ctx, panels, 1, encode_panels, &jb);
    }
    if (cfg->amax)
        *cfg->amax = amax_all > 0x7F800000u ? fm_bits_f32(FM_F32_CANON_NAN) : fm_bits_f32(amax_all);
    if (cfg->nonfinite_blocks)
        *cfg->nonfinite_blocks = bad;
done:
    free(rowbuf);
    free(tiles);
    for (int k = 0; k < np; k++) {
        free(p[k].amax);
        free(p[k].mult);
        free(p[k].colmax);
    }
    return st;
}
