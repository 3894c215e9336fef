/* CPU reference router: scores, top-k selection, probabilities, and the
 * backward to the logits. One token at a time, in the fixed orders of
 * mathfn.h, which is what the CUDA kernel's one warp per token computes. */
#include <stdlib.h>

#include "cpu.h"

static int row_has_nan(const float *x, int64_t E)
{
    for (int64_t e = 0; e < E; e++)
        if (fm_f32_is_nan(x[e]))
            return 1;
    return 0;
}

/* s = softmax(x) (mathfn.h's fm_softmax_f32) or sigmoid(x). */
static void scores(fm_router_score score, const float *x, int64_t E, float *s)
{
    if (score == FM_ROUTER_SIGMOID) {
        for (int64_t e = 0; e < E; e++)
            s[e] = fm_sigmoidf(x[e]);
        return;
    }
    fm_softmax_f32(x, NULL, E, s);
}

/* a ranks above b: numbers above NaN; equal keys keep the lower id (the
 * caller scans ids upwards and replaces only on a strict win). */
static int key_wins(float a, float b) { return !fm_f32_is_nan(a) && (fm_f32_is_nan(b) || a > b); }

/* The k experts of one token by descending key = s + bias. */
static void select_topk(const float *s, const float *bias, int64_t E, int k, int32_t *ids, float *key,
                        unsigned char *taken)
{
    for (int64_t e = 0; e < E; e++) {
        key[e] = bias ? s[e] + bias[e] : s[e];
        taken[e] = 0;
    }
    for (int j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || key_wins(key[e], key[best])))
                best = e;
        taken[best] = 1;
        ids[j] = (int32_t)best;
    }
}

fm_status fm_cpu_moe_router(fm_context *ctx, const fm_router_config *cfg, const fm_tensor *logits,
                            fm_tensor *expert_ids, fm_tensor *probs, fm_tensor *tokens_per_expert)
{
    int64_t T = logits->shape[0], E = logits->shape[1];
    int k = cfg->topk;
    int64_t *cnt = tokens_per_expert ? tokens_per_expert->data : NULL;
    if (cnt)
        for (int64_t e = 0; e < E; e++)
            cnt[e] = 0;
    /* No tokens: nothing bounds E (logits [0, E] hold nothing), so no
     * per-expert scratch. */
    if (T == 0)
        return FM_OK;
    float *buf = malloc((size_t)E * 2 * sizeof(float));
    unsigned char *taken = malloc((size_t)E);
    if (!buf || !taken) {
        free(buf);
        free(taken);
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_moe_router: out of host memory for %lld experts",
                        (long long)E);
    }
    float *s = buf, *key = buf + E;
    for (int64_t t = 0; t < T; t++) {
        const float *x = (const float *)logits->data + t * E;
        int32_t *ids = (int32_t *)expert_ids->data + t * k;
        float *p = (float *)probs->data + t * k;
        scores(cfg->score, x, E, s);
        select_topk(s, cfg->bias, E, k, ids, key, taken);
        for (int j = 0; j < k; j++)
            p[j] = s[ids[j]];
        if (cfg->renormalize) {
            float sum = fm_sum_order_f32(p, k);
            if (cfg->score == FM_ROUTER_SIGMOID && sum == 0.0f)
                fm_softmax_f32(x, ids, k, p); /* the limit of 0 / 0 */
            else
                for (int j = 0; j < k; j++)
                    p[j] = fm_divf(p[j], sum);
        }
        int nan = row_has_nan(x, E);
        for (int j = 0; j < k; j++) {
            p[j] = nan ? fm_bits_f32(FM_F32_CANON_NAN) : fm_f32_canon(p[j]);
            if (cnt)
                cnt[ids[j]]++;
        }
    }
    free(buf);
    free(taken);
    return FM_OK;
}

fm_status fm_cpu_moe_router_backward(fm_context *ctx, const fm_router_config *cfg, const fm_tensor *logits,
                                     const fm_tensor *expert_ids, const fm_tensor *dprobs, fm_tensor *dlogits)
{
    int64_t T = logits->shape[0], E = logits->shape[1];
    int k = cfg->topk;
    const int32_t *all_ids = expert_ids->data;
    for (int64_t i = 0; i < T * k; i++)
        if (all_ids[i] < 0 || all_ids[i] >= E)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "expert_ids: entry [%lld, %lld] is %d, outside [0, E = %lld)",
                            (long long)(i / k), (long long)(i % k), (int)all_ids[i], (long long)E);
    if (T == 0)
        return FM_OK;
    float *buf = malloc((size_t)(2 * E + 3 * k) * sizeof(float));
    if (!buf)
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_moe_router_backward: out of host memory");
    float *s = buf, *ds = buf + E, *sel = buf + 2 * E, *g = sel + k, *p = g + k;
    for (int64_t t = 0; t < T; t++) {
        const float *x = (const float *)logits->data + t * E;
        const int32_t *ids = all_ids + t * k;
        const float *dp = (const float *)dprobs->data + t * k;
        float *dx = (float *)dlogits->data + t * E;
        if (row_has_nan(x, E)) {
            for (int64_t e = 0; e < E; e++)
                dx[e] = fm_bits_f32(FM_F32_CANON_NAN);
            continue;
        }
        scores(cfg->score, x, E, s);
        for (int j = 0; j < k; j++)
            sel[j] = s[ids[j]];
        const float S = cfg->renormalize ? fm_sum_order_f32(sel, k) : 0.0f;
        /* sigmoid scores renormalised over zeros: the forward took their limit, the softmax p
         * of the chosen logits, whose gradient is p_j (dp_j - sum_i dp_i p_i) there, 0 elsewhere */
        const int limit = cfg->renormalize && cfg->score == FM_ROUTER_SIGMOID && S == 0.0f;
        if (limit) {
            fm_softmax_f32(x, ids, k, p);
            float c = fm_dot_order_f32(dp, p, k);
            for (int j = 0; j < k; j++)
                g[j] = p[j] * (dp[j] - c);
        } else if (cfg->renormalize) {
            /* p = sel / S: dsel_j = (dp_j - sum_i dp_i p_i) / S */
            for (int j = 0; j < k; j++)
                p[j] = fm_divf(sel[j], S);
            float c = fm_dot_order_f32(dp, p, k);
            for (int j = 0; j < k; j++)
                g[j] = fm_divf(dp[j] - c, S);
        } else {
            for (int j = 0; j < k; j++)
                g[j] = dp[j];
        }
        for (int64_t e = 0; e < E; e++)
            ds[e] = 0.0f;
        for (int j = 0; j < k; j++)
            ds[ids[j]] = ds[ids[j]] + g[j];
        if (limit) {
            for (int64_t e = 0; e < E; e++)
                dx[e] = fm_f32_canon(ds[e]);
        } else if (cfg->score == FM_ROUTER_SIGMOID) {
            for (int64_t e = 0; e < E; e++)
                dx[e] = fm_f32_canon(ds[e] * (s[e] * (1.0f - s[e])));
        } else {
            /* sum_e ds_e s_e has nonzero terms only at the chosen experts */
            float d = fm_dot_order_f32(g, sel, k);
            for (int64_t e = 0; e < E; e++)
                dx[e] = fm_f32_canon(s[e] * (ds[e] - d));
        }
    }
    free(buf);
    return FM_OK;
}
