/* CUDA unpermute + combine and its backward, bit-exact with
 * backends/cpu/moe_unpermute.c: the combine is the same fmaf chain in choice
 * order per element (one block per token, threads across H); dprobs is one
 * warp per (token, choice), lane-strided fmaf and the warp tree of mathfn's
 * fixed order. Slot rows of -1 (no expert on this rank) are skipped as the
 * CPU skips them; other row indices out of range are skipped on the device
 * too (the CPU refuses them): nothing is read or written out of bounds. */
#include "cuda.h"
#include "moe_common.cuh"

__global__ void unperm_kernel(const void *y, int ydt, int64_t R, const int32_t *sr, const float *w, int64_t k,
                              int64_t H, void *out, int odt)
{
    int64_t t = blockIdx.x;
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
        float acc = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int32_t r = sr[t * k + j];
            if (r < 0 || r >= R)
                continue;
            acc = fmaf(w ? w[t * k + j] : 1.0f, fm_moe_load(y, ydt, (int64_t)r * H + h), acc);
        }
        fm_moe_store(out, odt, t * H + h, acc);
    }
}

__global__ void scatter_kernel(const void *dout, int odt, const int32_t *rm, const float *w, int64_t n, int64_t k,
                               int64_t H, void *dy, int ydt)
{
    int64_t r = blockIdx.x;
    int32_t s = rm[r];
    int ok = s >= 0 && s < n;
    float ws = ok && w ? w[s] : 1.0f;
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x)
        fm_moe_store(dy, ydt, r * H + h, ok ? ws * fm_moe_load(dout, odt, (s / k) * H + h) : 0.0f);
}

__global__ void dprobs_kernel(const void *dout, int odt, const void *y, int ydt, int64_t R, const int32_t *sr,
                              int64_t n, int64_t H, int64_t k, float *dp)
{
    int64_t slot = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (slot >= n)
        return;
    int32_t r = sr[slot];
    int64_t t = slot / k;
    float p = 0.0f;
    if (r >= 0 && r < R)
        for (int64_t h = lane; h < H; h += 32)
            p = fmaf(fm_moe_load(dout, odt, t * H + h), fm_moe_load(y, ydt, (int64_t)r * H + h), p);
    float v = fm_warp_tree(p);
    if (lane == 0)
        dp[slot] = v;
}

extern "C" fm_status fm_cuda_moe_unpermute(fm_context *ctx, const fm_tensor *y, const fm_tensor *slot_rows,
                                           const fm_tensor *probs, fm_tensor *out)
{
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_moe_unpermute");
    if (st)
        return st;
    int64_t T = slot_rows->shape[0], k = slot_rows->shape[1], H = y->shape[1];
    if (T > 0)
        unperm_kernel<<<(unsigned)T, 256, 0, fm_cuda_stream(ctx)>>>(
            y->data, (int)y->dtype, y->shape[0], (const int32_t *)slot_rows->data,
            probs ? (const float *)probs->data : NULL, k, H, out->data, (int)out->dtype);
    return fm_cuda_leave(ctx, &g, cudaGetLastError(), "fm_moe_unpermute");
}

extern "C" fm_status fm_cuda_moe_unpermute_backward(fm_context *ctx, const fm_tensor *dout, const fm_tensor *y,
                                                    const fm_tensor *row_map, const fm_tensor *slot_rows,
                                                    const fm_tensor *probs, fm_tensor *dy, fm_tensor *dprobs)
{
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_moe_unpermute_backward");
    if (st)
        return st;
    int64_t T = dout->shape[0], H = dout->shape[1], k = slot_rows->shape[1], R = dy->shape[0], n = T * k;
    cudaStream_t s = fm_cuda_stream(ctx);
    const float *w = probs ? (const float *)probs->data : NULL;
    if (R > 0)
        scatter_kernel<<<(unsigned)R, 256, 0, s>>>(dout->data, (int)dout->dtype, (const int32_t *)row_map->data, w, n,
                                                   k, H, dy->data, (int)dy->dtype);
    if (dprobs && n > 0)
        dprobs_kernel<<<(unsigned)((n * 32 + 255) / 256), 256, 0, s>>>(dout->data, (int)dout->dtype, y->data,
                                                                        (int)y->dtype, R,
                                                                        (const int32_t *)slot_rows->data, n, H, k,
                                                                        (float *)dprobs->data);
    return fm_cuda_leave(ctx, &g, cudaGetLastError(), "fm_moe_unpermute_backward");
}
