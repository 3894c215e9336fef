/* CPU fm_cast: element by element through F32, which holds BF16 and F16
 * exactly, so the only rounding is the output's RNE. */
#include "cpu.h"

typedef struct {
    const fm_tensor *in, *out;
    int64_t R, C; /* per matrix, logical */
} cast_job;

static int64_t stored_index(const fm_tensor *t, int64_t R, int64_t C, int64_t e, int64_t r, int64_t c)
{
    return e * R * C + (t->layout == FM_LAYOUT_ROWWISE ? r * C + c : c * R + r);
}

static void cast_rows(void *arg, int64_t begin, int64_t end, int worker)
{
    (void)worker;
    const cast_job *j = arg;
    for (int64_t g = begin; g < end; g++) { /* g = e * R + r */
        int64_t e = g / j->R, r = g % j->R;
        for (int64_t c = 0; c < j->C; c++) {
            float v = fm_cpu_load_f32(j->in->data, j->in->dtype, stored_index(j->in, j->R, j->C, e, r, c));
            fm_cpu_store_f32(j->out->data, j->out->dtype, stored_index(j->out, j->R, j->C, e, r, c), v);
        }
    }
}

fm_status fm_cpu_cast(fm_context *ctx, const fm_tensor *in, fm_tensor *out)
{
    int r = in->ndim == 3 ? 1 : 0;
    cast_job j = {in, out, in->shape[r], in->shape[r + 1]};
    fm_cpu_parallel_for(ctx, fm_tensor_experts(in) * j.R, 64, cast_rows, &j);
    return FM_OK;
}
