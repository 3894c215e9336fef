/* CPU reference permute + pad: token rows to expert-contiguous rows, codes
 * and compact scales moved together, padding rows zero with scale 1. The
 * routing is counted and checked before anything is written. */
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

/* Bytes of one stored row of codes, and of its compact scales. */
static int64_t row_bytes(const fm_tensor *t)
{
    int64_t H = t->shape[1];
    return t->dtype == FM_DTYPE_E2M1 ? H / 2 : H * (fm_dtype_bits(t->dtype) / 8);
}

static int64_t scale_row_bytes(const fm_tensor *t)
{
    if (t->scale_mode == FM_SCALE_NONE)
        return 0;
    return fm_cdiv(t->shape[1], fm_mode_block_cols(t->scale_mode)) * (fm_dtype_bits(t->scale_dtype) / 8);
}

typedef struct {
    const fm_tensor *x;
    fm_tensor *out;
    const int32_t *row_map;
    int64_t k, rb, sb;
} copy_job;

static void copy_rows(void *arg, int64_t begin, int64_t end, int worker)
{
    (void)worker;
    copy_job *j = arg;
    const fm_tensor *x = j->x;
    fm_tensor *out = j->out;
    int64_t nsc = j->sb ? j->sb / (fm_dtype_bits(out->scale_dtype) / 8) : 0;
    for (int64_t r = begin; r < end; r++) {
        uint8_t *dst = (uint8_t *)out->data + r * j->rb;
        int32_t s = j->row_map[r];
        if (s >= 0)
            memcpy(dst, (const uint8_t *)x->data + (s / j->k) * j->rb, (size_t)j->rb);
        else
            memset(dst, 0, (size_t)j->rb);
        if (!j->sb)
            continue;
        uint8_t *sdst = (uint8_t *)out->scale + r * j->sb;
        if (s >= 0)
            memcpy(sdst, (const uint8_t *)x->scale + (s / j->k) * j->sb, (size_t)j->sb);
        else if (out->scale_dtype == FM_DTYPE_E8M0)
            memset(sdst, 127, (size_t)j->sb);
        else
            for (int64_t i = 0; i < nsc; i++)
                ((float *)sdst)[i] = 1.0f;
    }
}

fm_status fm_cpu_moe_permute(fm_context *ctx, const fm_permute_config *cfg, const fm_tensor *x,
                             const fm_tensor *expert_ids, const fm_tensor *probs, fm_tensor *out, fm_tensor *row_map,
                             fm_tensor *slot_rows, fm_tensor *splits, fm_tensor *out_probs, int64_t *host_splits)
{
    int64_t T = x->shape[0], k = expert_ids->shape[1], E = splits->shape[1], R = out->shape[0];
    int64_t pad = cfg->pad_multiple > 1 ? cfg->pad_multiple : 1;
    const int32_t *ids = expert_ids->data;
    int64_t *start = calloc((size_t)E, sizeof(int64_t));
    if (!start)
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_moe_permute: out of host memory for %lld experts",
                        (long long)E);
    for (int64_t i = 0; i < T * k; i++) {
        if (ids[i] < -1 || ids[i] >= E) {
            free(start);
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "expert_ids: entry [%lld, %lld] is %d, outside [0, E = %lld) and not -1 (no expert) "
                            "(E = splits' columns)",
                            (long long)(i / k), (long long)(i % k), (int)ids[i], (long long)E);
        }
        if (ids[i] >= 0)
            start[ids[i]]++;
    }
    int64_t need = 0;
    for (int64_t e = 0; e < E; e++)
        need += fm_round_up(start[e], pad);
    if (need > R) {
        free(start);
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "out: has %lld rows but this routing needs %lld (sum over experts of their slot count "
                        "rounded up to pad_multiple %lld); R = T*k + E*(pad-1) = %lld always suffices",
                        (long long)R, (long long)need, (long long)pad, (long long)(T * k + E * (pad - 1)));
    }
    int64_t *P = splits->data;
    for (int64_t e = 0, off = 0; e < E; e++) {
        P[e] = fm_round_up(start[e], pad);
        start[e] = off;
        off += P[e];
    }
    int32_t *rm = row_map->data, *sr = slot_rows->data;
    for (int64_t r = 0; r < R; r++)
        rm[r] = -1;
    /* slots in increasing t * k + j: rows inside an expert follow the token */
    for (int64_t i = 0; i < T * k; i++) {
        if (ids[i] < 0) {
            sr[i] = -1;
            continue;
        }
        int64_t row = start[ids[i]]++;
        sr[i] = (int32_t)row;
        rm[row] = (int32_t)i;
    }
    free(start);
    if (out_probs) {
        const float *p = probs->data;
        float *op = out_probs->data;
        for (int64_t r = 0; r < R; r++)
            op[r] = rm[r] >= 0 ? p[rm[r]] : 0.0f;
    }
    if (host_splits)
        memcpy(host_splits, splits->data, (size_t)E * sizeof(int64_t));
    copy_job j = {x, out, rm, k, row_bytes(x), scale_row_bytes(x)};
    fm_cpu_parallel_for(ctx, R, 256, copy_rows, &j);
    return FM_OK;
}
