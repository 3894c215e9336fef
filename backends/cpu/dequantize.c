/* CPU reference dequantize: value = code * scale_inv in F32, then the output
 * dtype (RNE, canonical NaN); a layout change transposes on the way. */
#include <string.h>

#include "cpu.h"

typedef struct {
    const fm_tensor *in;
    fm_tensor *out;
    int64_t R, C;       /* stored input matrix */
    int transpose;
    float lut[256];     /* code -> value */
} deq_job;

static float scale_at(const fm_tensor *t, const void *sbase, int64_t R, int64_t C, int64_t r, int64_t c)
{
    int64_t off = fm_scale_offset(t->scale_mode, t->scale_layout, R, C, r, c);
    if (t->scale_dtype == FM_DTYPE_E8M0)
        return fm_e8m0_to_f32(((const uint8_t *)sbase)[off]);
    return ((const float *)sbase)[off];
}

/* Items are (expert, stored row) pairs. */
static void deq_rows(void *arg, int64_t begin, int64_t end, int worker)
{
    (void)worker;
    deq_job *j = arg;
    const fm_tensor *in = j->in;
    int64_t R = j->R, C = j->C;
    int64_t per = fm_scale_count_2d(in->scale_mode, in->scale_layout, R, C);
    int fp4 = in->dtype == FM_DTYPE_E2M1;
    int64_t bc = fm_mode_block_cols(in->scale_mode);
    if (bc == 0)
        bc = C ? C : 1; /* TENSOR, ROW: one scale per stored row */
    for (int64_t it = begin; it < end; it++) {
        int64_t e = it / R, r = it % R;
        const uint8_t *row = (const uint8_t *)in->data + (size_t)(e * R + r) * (size_t)(fp4 ? C / 2 : C);
        const uint8_t *sbase = (const uint8_t *)in->scale + (size_t)(e * per) * (in->scale_dtype == FM_DTYPE_E8M0 ? 1 : 4);
        for (int64_t c0 = 0; c0 < C; c0 += bc) {
            float s = scale_at(in, sbase, R, C, r, c0);
            int64_t c1 = c0 + bc < C ? c0 + bc : C;
            for (int64_t c = c0; c < c1; c++) {
                uint8_t code = fp4 ? fm_cpu_get_nibble(row, c) : row[c];
                float v = j->lut[code] * s;
                /* out index: same stored position, or transposed */
                int64_t oi = j->transpose ? (e * C + c) * R + r : (e * R + r) * C + c;
                fm_cpu_store_f32(j->out->data, j->out->dtype, oi, v);
            }
        }
    }
}

fm_status fm_cpu_dequantize(fm_context *ctx, const fm_tensor *in, fm_tensor *out)
{
    if (fm_tensor_numel(in) == 0) /* nothing to write; the buffers may be NULL */
        return FM_OK;
    deq_job j;
    j.in = in;
    j.out = out;
    j.R = fm_tensor_stored_rows(in);
    j.C = fm_tensor_stored_cols(in);
    j.transpose = in->layout != out->layout;
    for (int c = 0; c < 256; c++)
        j.lut[c] = fm_elem_decode(in->dtype, (uint8_t)c);
    fm_cpu_parallel_for(ctx, fm_tensor_experts(in) * j.R, 64, deq_rows, &j);
    return FM_OK;
}
