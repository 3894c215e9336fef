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
    size_t code_bytes;    /* data bytes per expert */
} plan;

typedef struct {
    const fm_tensor *in;
    int64_t rows, cols;
    plan *p;
    int np;
    int64_t e;            /* expert being encoded */
    int64_t panels;       /* 128-row panels per expert */
    float *rowbuf;        /* [FM_CPU_MAX_WORKERS][cols] */
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

/* (A) for one logical row i of the current expert. */
static void amax_row(plan *p, const float *x, int64_t i, int64_t cols)
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
    } else {
        int64_t cblk = i / p->bc;
        for (int64_t j = 0; j < cols; j++) {
            uint32_t *a = p->amax + (j / p->br) * p->nbc + cblk;
            uint32_t v = abs_bits(x[j]);
            *a = v > *a ? v : *a;
        }
    }
}

/* (B): scales of one expert into its slice of out->scale; returns the
 * number of non-finite blocks. */
static int64_t choose_scales(plan *p, const fm_quant_config *cfg, int64_t e)
{
    fm_tensor *o = p->out;
    int64_t per = fm_scale_count_2d(o->scale_mode, o->scale_layout, p->R, p->C);
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

/* (C) for one logical row i. */
static void encode_row(const plan *p, const float *x, int64_t e, int64_t i, int64_t cols)
{
    fm_dtype t = p->out->dtype;
    uint8_t nan = fm_elem_nan(t);
    uint8_t *base = (uint8_t *)p->out->data + (size_t)e * p->code_bytes;
    if (!p->colwise) {
        const float *m = p->mult + (i / p->br) * p->nbc;
        if (t == FM_DTYPE_E2M1) {
            uint8_t *row = base + (size_t)(i * cols / 2);
            for (int64_t j = 0; j + 1 < cols; j += 2) {
                float mj = m[j / p->bc];
                uint8_t lo, hi;
                if (fm_f32_is_nan(mj)) {
                    lo = hi = nan;
                } else {
                    lo = fm_e2m1_from_f32(x[j] * mj);
                    hi = fm_e2m1_from_f32(x[j + 1] * mj);
                }
                row[j / 2] = (uint8_t)(lo | (hi << 4));
            }
            return;
        }
        uint8_t *row = base + (size_t)(i * cols);
        for (int64_t cb = 0; cb < p->nbc; cb++) {
            int64_t j0 = cb * p->bc, j1 = j0 + p->bc < cols ? j0 + p->bc : cols;
            float mj = m[cb];
            if (fm_f32_is_nan(mj)) {
                memset(row + j0, nan, (size_t)(j1 - j0));
            } else if (t == FM_DTYPE_E4M3) {
                for (int64_t j = j0; j < j1; j++)
                    row[j] = fm_e4m3_from_f32(x[j] * mj);
            } else {
                for (int64_t j = j0; j < j1; j++)
                    row[j] = fm_e5m2_from_f32(x[j] * mj);
            }
        }
    } else {
        int64_t rows = p->C, cblk = i / p->bc;
        for (int64_t j = 0; j < cols; j++) {
            float mj = p->mult[(j / p->br) * p->nbc + cblk];
            uint8_t c = fm_f32_is_nan(mj) ? nan : fm_elem_encode(t, x[j] * mj);
            if (t == FM_DTYPE_E2M1)
                fm_cpu_put_nibble(base + (size_t)(j * rows / 2), i, c);
            else
                base[(size_t)(j * rows + i)] = c;
        }
    }
}

static void encode_panels(void *arg, int64_t begin, int64_t end, int worker)
{
    enc_job *jb = arg;
    float *x = jb->rowbuf + (size_t)worker * (size_t)jb->cols;
    const fm_tensor *in = jb->in;
    for (int64_t pn = begin; pn < end; pn++) {
        int64_t i0 = pn * 128, i1 = i0 + 128 < jb->rows ? i0 + 128 : jb->rows;
        for (int64_t i = i0; i < i1; i++) {
            fm_cpu_load_row(in->data, in->dtype, (jb->e * jb->rows + i) * jb->cols, jb->cols, x);
            for (int k = 0; k < jb->np; k++)
                encode_row(&jb->p[k], x, jb->e, i, jb->cols);
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

    int64_t panels = fm_cdiv(rows, 128);
    int64_t workers = ctx->cpu_threads < FM_CPU_MAX_WORKERS ? ctx->cpu_threads : FM_CPU_MAX_WORKERS;
    fm_status st = FM_OK;
    /* Row 0 for step (A), then one row per encoding worker. */
    float *rowbuf = malloc((size_t)(cols ? cols : 1) * sizeof(float) * (size_t)(workers + 1));
    for (int k = 0; k < np; k++) {
        size_t nb = (size_t)(p[k].nbr * p[k].nbc);
        p[k].amax = malloc((nb ? nb : 1) * sizeof(uint32_t));
        p[k].mult = malloc((nb ? nb : 1) * sizeof(float));
        if (!p[k].amax || !p[k].mult)
            st = FM_ERR_OUT_OF_MEMORY;
    }
    if (!rowbuf)
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
        for (int64_t i = 0; i < rows; i++) {
            fm_cpu_load_row(in->data, in->dtype, (e * rows + i) * cols, cols, rowbuf);
            for (int k = 0; k < np; k++)
                amax_row(&p[k], rowbuf, i, cols);
            if (cfg->amax)
                for (int64_t j = 0; j < cols; j++) {
                    uint32_t v = abs_bits(rowbuf[j]);
                    amax_all = v > amax_all ? v : amax_all;
                }
        }
        for (int k = 0; k < np; k++)
            bad += choose_scales(&p[k], cfg, e);
        enc_job jb = {in, rows, cols, p, np, e, panels, rowbuf + cols};
        fm_cpu_parallel_for(ctx, panels, 1, encode_panels, &jb);
    }
    if (cfg->amax)
        *cfg->amax = amax_all > 0x7F800000u ? fm_bits_f32(FM_F32_CANON_NAN) : fm_bits_f32(amax_all);
    if (cfg->nonfinite_blocks)
        *cfg->nonfinite_blocks = bad;
done:
    free(rowbuf);
    for (int k = 0; k < np; k++) {
        free(p[k].amax);
        free(p[k].mult);
    }
    return st;
}
