/* CPU reference fused weighted SwiGLU + quantize and its backward.
 *
 * The activation is computed into F32 rows with mathfn.h, then handed to the
 * CPU quantizer itself (fm_cpu_quantize), so the quantized outputs are by
 * construction what fm_quantize gives for that F32 tensor: one quantization
 * rule in the library, not two. */
#include <stdlib.h>

#include "cpu.h"

/* Row r of a row-wise tensor as exact F32: unscaled loads, or code x scale
 * for BLOCK_1x128 / MX32 with compact scales (what core admits here). */
static void decode_row(const fm_tensor *t, int64_t r, float *dst)
{
    int64_t C = t->shape[1];
    if (t->scale_mode == FM_SCALE_NONE) {
        fm_cpu_load_row(t->data, t->dtype, r * C, C, dst);
        return;
    }
    int64_t bc = fm_mode_block_cols(t->scale_mode), nb = fm_cdiv(C, bc);
    int fp4 = t->dtype == FM_DTYPE_E2M1;
    const uint8_t *row = (const uint8_t *)t->data + r * (fp4 ? C / 2 : C);
    for (int64_t b = 0; b < nb; b++) {
        float s = t->scale_dtype == FM_DTYPE_E8M0 ? fm_e8m0_to_f32(((const uint8_t *)t->scale)[r * nb + b])
                                                  : ((const float *)t->scale)[r * nb + b];
        int64_t c1 = (b + 1) * bc < C ? (b + 1) * bc : C;
        for (int64_t c = b * bc; c < c1; c++)
            dst[c] = fm_elem_decode(t->dtype, fp4 ? fm_cpu_get_nibble(row, c) : row[c]) * s;
    }
}

typedef struct {
    const fm_tensor *in, *dh, *probs;
    float *h;           /* [M, I] forward, [M, 2I] backward: the F32 result */
    float *dprobs;
    int64_t I;
    float *scratch;     /* [workers][3 I] */
} act_job;

static void fwd_rows(void *arg, int64_t begin, int64_t end, int worker)
{
    act_job *jb = arg;
    int64_t I = jb->I;
    float *x = jb->scratch + (size_t)worker * 3 * I;
    const float *p = jb->probs ? jb->probs->data : NULL;
    for (int64_t m = begin; m < end; m++) {
        decode_row(jb->in, m, x);
        float *h = jb->h + m * I;
        for (int64_t i = 0; i < I; i++) {
            float v = fm_siluf(x[i]) * x[I + i];
            h[i] = p ? v * p[m] : v;
        }
    }
}

static void bwd_rows(void *arg, int64_t begin, int64_t end, int worker)
{
    act_job *jb = arg;
    int64_t I = jb->I;
    float *x = jb->scratch + (size_t)worker * 3 * I, *dh = x + 2 * I;
    const float *p = jb->probs ? jb->probs->data : NULL;
    for (int64_t m = begin; m < end; m++) {
        decode_row(jb->in, m, x);
        decode_row(jb->dh, m, dh);
        float *din = jb->h + m * 2 * I;
        for (int64_t i = 0; i < I; i++) {
            float g = x[i], u = x[I + i], a, ds;
            fm_silu_dsiluf(g, &a, &ds);
            float q = p ? dh[i] * p[m] : dh[i];
            din[I + i] = q * a;
            din[i] = (q * u) * ds;
            x[i] = a * u; /* what dprobs dots with dh; the gate half of x has been read */
        }
        if (jb->dprobs)
            jb->dprobs[m] = fm_dot_order_runs_f32(dh, x, I);
    }
}

/* Quantize (or store) the F32 result [M, C] into the outputs. */
static fm_status emit(fm_context *ctx, const fm_quant_config *cfg, float *h, int64_t M, int64_t C, fm_tensor *row,
                      fm_tensor *col)
{
    if (row->scale_mode != FM_SCALE_NONE) {
        fm_tensor ht = fm_tensor_2d(h, FM_DTYPE_F32, M, C);
        return fm_cpu_quantize(ctx, cfg, &ht, row, col);
    }
    for (int64_t i = 0; i < M * C; i++)
        fm_cpu_store_f32(row->data, row->dtype, i, h[i]);
    return FM_OK;
}

static fm_status run(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *dh, const fm_tensor *in,
                     const fm_tensor *probs, fm_tensor *row, fm_tensor *col, fm_tensor *dprobs)
{
    int64_t M = in->shape[0], I = in->shape[1] / 2, C = dh ? 2 * I : I;
    float *h = malloc((size_t)(M * C > 0 ? M * C : 1) * sizeof(float));
    /* Per-worker rows only where there are rows: [0, 2I] bounds no I. */
    size_t width = M > 0 && I > 0 ? (size_t)I : 1;
    float *scratch = malloc((size_t)fm_cpu_workers(ctx) * 3 * width * sizeof(float));
    fm_status st = FM_OK;
    if (!h || !scratch)
        st = fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "%s: out of host memory for the F32 [%lld, %lld] activation",
                      dh ? "fm_moe_swiglu_backward" : "fm_moe_swiglu", (long long)M, (long long)C);
    if (!st) {
        act_job jb = {in, dh, probs, h, dprobs ? dprobs->data : NULL, I, scratch};
        if (I > 0) {
            fm_cpu_parallel_for(ctx, M, 16, dh ? bwd_rows : fwd_rows, &jb);
        } else if (jb.dprobs) {
            /* Rows of no columns: their count is bounded by no buffer and
             * their data may be NULL (no pointer from it, not even NULL + 0);
             * only dprobs has a value, the dot of nothing, +0. */
            for (int64_t m = 0; m < M; m++)
                jb.dprobs[m] = 0.0f;
        }
        st = emit(ctx, cfg, h, M, C, row, col);
    }
    free(h);
    free(scratch);
    return st;
}

fm_status fm_cpu_moe_swiglu(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *in, const fm_tensor *probs,
                            fm_tensor *out_row, fm_tensor *out_col, fm_tensor *in_saved)
{
    fm_status st = run(ctx, cfg, NULL, in, probs, out_row, out_col, NULL);
    if (st || !in_saved)
        return st;
    /* The saved copy is fm_quantize of in itself; amax and the non-finite
     * count belong to h. */
    fm_quant_config c = *cfg;
    c.amax = NULL;
    c.nonfinite_blocks = NULL;
    return fm_cpu_quantize(ctx, &c, in, in_saved, NULL);
}

fm_status fm_cpu_moe_swiglu_backward(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *dh,
                                     const fm_tensor *in, const fm_tensor *probs, fm_tensor *din_row,
                                     fm_tensor *din_col, fm_tensor *dprobs)
{
    return run(ctx, cfg, dh, in, probs, din_row, din_col, dprobs);
}
