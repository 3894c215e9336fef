/* CUDA router and router backward, bit-exact with backends/cpu/moe_router.c.
 *
 * One warp per token: lane l scores experts l, l + 32, ... and holds the
 * softmax partial sum p_l, so the warp tree gives mathfn's fixed order. The
 * scores live in shared memory for the selection, which lane 0 runs as the
 * CPU does (k strict-win scans over the experts, ties to the lower id).
 * Routers are tiny next to the expert GEMMs; this favours exactness over
 * parallelism inside the selection. */
#include "cuda.h"
#include "moe_common.cuh"

#define ROUTER_WARPS 4

static __device__ int key_wins(float a, float b) { return !fm_f32_is_nan(a) && (fm_f32_is_nan(b) || a > b); }

/* s[0..E) of token x into shared s; returns through all lanes */
static __device__ void scores(int sig, const float *x, int E, float *s)
{
    int lane = threadIdx.x & 31;
    if (sig) {
        for (int e = lane; e < E; e += 32)
            s[e] = fm_sigmoidf(x[e]);
        __syncwarp();
        return;
    }
    float m = x[0];
    for (int e = 1; e < E; e++) /* the CPU's order: a max is order-free but NaN handling is not */
        m = x[e] > m ? x[e] : m;
    float p = 0.0f;
    for (int e = lane; e < E; e += 32) {
        float v = fm_expf(x[e] - m);
        s[e] = v;
        p = p + v;
    }
    float sum = __shfl_sync(0xFFFFFFFFu, fm_warp_tree(p), 0);
    __syncwarp();
    for (int e = lane; e < E; e += 32)
        s[e] = fm_divf(s[e], sum);
    __syncwarp();
}

static __device__ int row_has_nan(const float *x, int E)
{
    int n = 0;
    for (int e = threadIdx.x & 31; e < E; e += 32)
        n |= fm_f32_is_nan(x[e]);
    return __any_sync(0xFFFFFFFFu, n);
}

/* fixed-order sum of v[0..n) by one warp (v in shared memory) */
static __device__ float warp_sum(const float *v, int n)
{
    float p = 0.0f;
    for (int i = threadIdx.x & 31; i < n; i += 32)
        p = p + v[i];
    return __shfl_sync(0xFFFFFFFFu, fm_warp_tree(p), 0);
}

static __device__ float warp_dot(const float *a, const float *b, int n)
{
    float p = 0.0f;
    for (int i = threadIdx.x & 31; i < n; i += 32)
        p = fmaf(a[i], b[i], p);
    return __shfl_sync(0xFFFFFFFFu, fm_warp_tree(p), 0);
}

__global__ void router_fwd_kernel(const float *logits, const float *bias, int T, int E, int k, int sig, int renorm,
                                  int32_t *ids, float *probs, unsigned long long *cnt)
{
    extern __shared__ float sh[];
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *s = sh + w * (2 * E + k), *key = s + E, *p = key + E;
    int t = blockIdx.x * ROUTER_WARPS + w;
    if (t >= T)
        return;
    const float *x = logits + (int64_t)t * E;
    scores(sig, x, E, s);
    int nan = row_has_nan(x, E);
    if (lane == 0) {
        for (int e = 0; e < E; e++)
            key[e] = bias ? s[e] + bias[e] : s[e];
        int32_t *id = ids + (int64_t)t * k;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++)
                    taken |= id[i] == e;
                if (!taken && (best < 0 || key_wins(key[e], key[best])))
                    best = e;
            }
            id[j] = best;
            p[j] = s[best];
        }
    }
    __syncwarp();
    if (renorm) {
        float sum = warp_sum(p, k);
        if (sig && sum == 0.0f) { /* the limit of 0 / 0, rare: one lane, mathfn's sequential form */
            __syncwarp();         /* every lane has read p before lane 0 rewrites it */
            if (lane == 0)
                fm_softmax_f32(x, ids + (int64_t)t * k, k, p);
        } else {
            for (int j = lane; j < k; j += 32)
                p[j] = fm_divf(p[j], sum);
        }
        __syncwarp();
    }
    for (int j = lane; j < k; j += 32) {
        probs[(int64_t)t * k + j] = nan ? fm_bits_f32(FM_F32_CANON_NAN) : fm_f32_canon(p[j]);
        if (cnt)
            atomicAdd(&cnt[ids[(int64_t)t * k + j]], 1ull);
    }
}

__global__ void router_bwd_kernel(const float *logits, const int32_t *ids, const float *dprobs, int T, int E, int k,
                                  int sig, int renorm, float *dlogits)
{
    extern __shared__ float sh[];
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *s = sh + w * (2 * E + 3 * k), *ds = s + E, *sel = ds + E, *g = sel + k, *pp = g + k;
    int t = blockIdx.x * ROUTER_WARPS + w;
    if (t >= T)
        return;
    const float *x = logits + (int64_t)t * E;
    const int32_t *id = ids + (int64_t)t * k;
    const float *dp = dprobs + (int64_t)t * k;
    float *dx = dlogits + (int64_t)t * E;
    if (row_has_nan(x, E)) {
        for (int e = lane; e < E; e += 32)
            dx[e] = fm_bits_f32(FM_F32_CANON_NAN);
        return;
    }
    scores(sig, x, E, s);
    for (int j = lane; j < k; j += 32) {
        int e = id[j];
        sel[j] = (e >= 0 && e < E) ? s[e] : 0.0f;
    }
    __syncwarp();
    int ids_ok = 1; /* the CPU refuses ids out of range; here they only must not be read through */
    for (int j = lane; j < k; j += 32)
        ids_ok &= id[j] >= 0 && id[j] < E;
    ids_ok = __all_sync(0xFFFFFFFFu, ids_ok);
    const float S = renorm ? warp_sum(sel, k) : 0.0f;
    /* sigmoid scores renormalised over zeros: the forward's limit, as the CPU */
    const bool limit = renorm && sig && S == 0.0f && ids_ok;
    if (limit) {
        if (lane == 0)
            fm_softmax_f32(x, id, k, pp);
        __syncwarp();
        float c = warp_dot(dp, pp, k);
        for (int j = lane; j < k; j += 32)
            g[j] = pp[j] * (dp[j] - c);
    } else if (renorm) {
        for (int j = lane; j < k; j += 32)
            pp[j] = fm_divf(sel[j], S);
        __syncwarp();
        float c = warp_dot(dp, pp, k);
        for (int j = lane; j < k; j += 32)
            g[j] = fm_divf(dp[j] - c, S);
    } else {
        for (int j = lane; j < k; j += 32)
            g[j] = dp[j];
    }
    for (int e = lane; e < E; e += 32)
        ds[e] = 0.0f;
    __syncwarp();
    if (lane == 0) /* choice order, as the CPU adds duplicates */
        for (int j = 0; j < k; j++)
            if (id[j] >= 0 && id[j] < E)
                ds[id[j]] = ds[id[j]] + g[j];
    __syncwarp();
    if (limit) {
        for (int e = lane; e < E; e += 32)
            dx[e] = fm_f32_canon(ds[e]);
    } else if (sig) {
        for (int e = lane; e < E; e += 32)
            dx[e] = fm_f32_canon(ds[e] * (s[e] * (1.0f - s[e])));
    } else {
        float d = warp_dot(g, sel, k);
        for (int e = lane; e < E; e += 32)
            dx[e] = fm_f32_canon(s[e] * (ds[e] - d));
    }
}

extern "C" fm_status fm_cuda_moe_router(fm_context *ctx, const fm_router_config *cfg, const fm_tensor *logits,
                                        fm_tensor *expert_ids, fm_tensor *probs, fm_tensor *tokens_per_expert)
{
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_moe_router");
    if (st)
        return st;
    int T = (int)logits->shape[0], E = (int)logits->shape[1], k = cfg->topk;
    cudaStream_t s = fm_cuda_stream(ctx);
    cudaError_t err = cudaSuccess;
    if (tokens_per_expert)
        err = cudaMemsetAsync(tokens_per_expert->data, 0, (size_t)E * 8, s);
    size_t sh = (size_t)ROUTER_WARPS * (2 * E + k) * sizeof(float);
    if (err == cudaSuccess && sh > 48 * 1024)
        err = cudaFuncSetAttribute(router_fwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sh);
    if (err == cudaSuccess && T > 0) {
        router_fwd_kernel<<<(T + ROUTER_WARPS - 1) / ROUTER_WARPS, ROUTER_WARPS * 32, sh, s>>>(
            (const float *)logits->data, cfg->bias, T, E, k, cfg->score == FM_ROUTER_SIGMOID, cfg->renormalize,
            (int32_t *)expert_ids->data, (float *)probs->data,
            tokens_per_expert ? (unsigned long long *)tokens_per_expert->data : NULL);
        err = cudaGetLastError();
    }
    return fm_cuda_leave(ctx, &g, err, "fm_moe_router");
}

extern "C" fm_status fm_cuda_moe_router_backward(fm_context *ctx, const fm_router_config *cfg,
                                                 const fm_tensor *logits, const fm_tensor *expert_ids,
                                                 const fm_tensor *dprobs, fm_tensor *dlogits)
{
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_moe_router_backward");
    if (st)
        return st;
    int T = (int)logits->shape[0], E = (int)logits->shape[1], k = cfg->topk;
    cudaStream_t s = fm_cuda_stream(ctx);
    cudaError_t err = cudaSuccess;
    size_t sh = (size_t)ROUTER_WARPS * (2 * E + 3 * k) * sizeof(float);
    if (sh > 48 * 1024)
        err = cudaFuncSetAttribute(router_bwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sh);
    if (err == cudaSuccess && T > 0) {
        router_bwd_kernel<<<(T + ROUTER_WARPS - 1) / ROUTER_WARPS, ROUTER_WARPS * 32, sh, s>>>(
            (const float *)logits->data, (const int32_t *)expert_ids->data, (const float *)dprobs->data, T, E, k,
            cfg->score == FM_ROUTER_SIGMOID, cfg->renormalize, (float *)dlogits->data);
        err = cudaGetLastError();
    }
    return fm_cuda_leave(ctx, &g, err, "fm_moe_router_backward");
}
