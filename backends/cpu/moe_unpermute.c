/* CPU reference unpermute + unpad + combine and its backward. Row indices
 * come from the caller (normally fm_moe_permute): they are checked before
 * anything is written. */
#include <stdlib.h>

#include "cpu.h"

static fm_status check_rows_in(fm_context *ctx, const fm_tensor *t, const char *name, int64_t lo, int64_t hi)
{
    const int32_t *v = t->data;
    int64_t n = fm_tensor_numel(t), c = t->shape[1];
    for (int64_t i = 0; i < n; i++)
        if (v[i] < lo || v[i] >= hi)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: entry [%lld, %lld] is %d, outside [%lld, %lld)", name,
                            (long long)(i / c), (long long)(i % c), (int)v[i], (long long)lo, (long long)hi);
    return FM_OK;
}

typedef struct {
    const fm_tensor *y, *dout, *probs, *slot_rows, *row_map;
    fm_tensor *out, *dy, *dprobs;
    int64_t k, H;
    float *scratch; /* [workers][2 H] */
} unperm_job;

static void combine_tokens(void *arg, int64_t begin, int64_t end, int worker)
{
    unperm_job *jb = arg;
    float *acc = jb->scratch + (size_t)worker * 2 * jb->H, *row = acc + jb->H;
    const int32_t *sr = jb->slot_rows->data;
    const float *w = jb->probs ? jb->probs->data : NULL;
    for (int64_t t = begin; t < end; t++) {
        for (int64_t h = 0; h < jb->H; h++)
            acc[h] = 0.0f;
        for (int64_t j = 0; j < jb->k; j++) {
            if (sr[t * jb->k + j] < 0)
                continue;
            float wj = w ? w[t * jb->k + j] : 1.0f;
            fm_cpu_load_row(jb->y->data, jb->y->dtype, (int64_t)sr[t * jb->k + j] * jb->H, jb->H, row);
            for (int64_t h = 0; h < jb->H; h++)
                acc[h] = fmaf(wj, row[h], acc[h]);
        }
        for (int64_t h = 0; h < jb->H; h++)
            fm_cpu_store_f32(jb->out->data, jb->out->dtype, t * jb->H + h, acc[h]);
    }
}

fm_status fm_cpu_moe_unpermute(fm_context *ctx, const fm_tensor *y, const fm_tensor *slot_rows,
                               const fm_tensor *probs, fm_tensor *out)
{
    int64_t T = slot_rows->shape[0], H = y->shape[1];
    fm_status st = check_rows_in(ctx, slot_rows, "slot_rows", -1, y->shape[0]);
    /* No tokens: nothing bounds H, so no row scratch either. */
    if (st || T == 0)
        return st;
    float *scratch = malloc((size_t)fm_cpu_workers(ctx) * 2 * (size_t)(H ? H : 1) * sizeof(float));
    if (!scratch)
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_moe_unpermute: out of host memory");
    unperm_job jb = {y, NULL, probs, slot_rows, NULL, out, NULL, NULL, slot_rows->shape[1], H, scratch};
    fm_cpu_parallel_for(ctx, T, 16, combine_tokens, &jb);
    free(scratch);
    return FM_OK;
}

/* dy rows from row_map: padding rows zero, row (t, j) = w_tj * dout[t]. */
static void scatter_rows(void *arg, int64_t begin, int64_t end, int worker)
{
    unperm_job *jb = arg;
    float *row = jb->scratch + (size_t)worker * 2 * jb->H;
    const int32_t *rm = jb->row_map->data;
    const float *w = jb->probs ? jb->probs->data : NULL;
    for (int64_t r = begin; r < end; r++) {
        int32_t s = rm[r];
        if (s < 0) {
            for (int64_t h = 0; h < jb->H; h++)
                fm_cpu_store_f32(jb->dy->data, jb->dy->dtype, r * jb->H + h, 0.0f);
            continue;
        }
        float ws = w ? w[s] : 1.0f;
        fm_cpu_load_row(jb->dout->data, jb->dout->dtype, (s / jb->k) * jb->H, jb->H, row);
        for (int64_t h = 0; h < jb->H; h++)
            fm_cpu_store_f32(jb->dy->data, jb->dy->dtype, r * jb->H + h, ws * row[h]);
    }
}

static void dot_slots(void *arg, int64_t begin, int64_t end, int worker)
{
    unperm_job *jb = arg;
    float *a = jb->scratch + (size_t)worker * 2 * jb->H, *b = a + jb->H;
    const int32_t *sr = jb->slot_rows->data;
    float *dp = jb->dprobs->data;
    for (int64_t t = begin; t < end; t++) {
        fm_cpu_load_row(jb->dout->data, jb->dout->dtype, t * jb->H, jb->H, a);
        for (int64_t j = 0; j < jb->k; j++) {
            if (sr[t * jb->k + j] < 0) {
                dp[t * jb->k + j] = 0.0f;
                continue;
            }
            fm_cpu_load_row(jb->y->data, jb->y->dtype, (int64_t)sr[t * jb->k + j] * jb->H, jb->H, b);
            dp[t * jb->k + j] = fm_dot_order_f32(a, b, jb->H);
        }
    }
}

fm_status fm_cpu_moe_unpermute_backward(fm_context *ctx, const fm_tensor *dout, const fm_tensor *y,
                                        const fm_tensor *row_map, const fm_tensor *slot_rows, const fm_tensor *probs,
                                        fm_tensor *dy, fm_tensor *dprobs)
{
    int64_t T = dout->shape[0], H = dout->shape[1], k = slot_rows->shape[1], R = dy->shape[0];
    fm_status st = check_rows_in(ctx, row_map, "row_map", -1, T * k);
    if (!st && dprobs)
        st = check_rows_in(ctx, slot_rows, "slot_rows", -1, R);
    /* No row to write and no dot to take: nothing bounds H. */
    if (st || (R == 0 && (!dprobs || T == 0)))
        return st;
    float *scratch = malloc((size_t)fm_cpu_workers(ctx) * 2 * (size_t)(H ? H : 1) * sizeof(float));
    if (!scratch)
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_moe_unpermute_backward: out of host memory");
    unperm_job jb = {y, dout, probs, slot_rows, row_map, NULL, dy, dprobs, k, H, scratch};
    fm_cpu_parallel_for(ctx, R, 64, scatter_rows, &jb);
    if (dprobs)
        fm_cpu_parallel_for(ctx, T, 16, dot_slots, &jb);
    free(scratch);
    return FM_OK;
}
