/* CUDA permute + pad, bit-exact with backends/cpu/moe_permute.c, without a
 * host synchronisation (unless host_splits is asked for):
 *   1. count the slots per expert (atomic adds: counts are order-free) and
 *      flag ids out of range (-1, a slot with no expert, is skipped: its
 *      slot_rows entry keeps the -1 the memset put there);
 *   2. one thread: padded sizes, offsets, splits, and a flag when the
 *      routing needs more than R rows;
 *   3. one block per expert ranks its slots in slot order with ballots and
 *      a block prefix (stable: rows follow the source token), writing
 *      slot_rows and row_map; skipped entirely when a flag is up, so
 *      nothing is ever written past R;
 *   4. one block per output row moves codes and compact scales (16-byte
 *      vectors when rows allow), zeros and scale 1 for padding.
 * A flagged call is reported as FM_ERR_INVALID_ARG when host_splits makes
 * it synchronise; otherwise its outputs hold zero rows and row_map -1. */
#include "cuda.h"
#include "moe_common.cuh"

enum { PERM_BAD_ID = 1, PERM_TOO_FEW_ROWS = 2 };

__global__ void perm_count_kernel(const int32_t *ids, int64_t n, int E, unsigned long long *cnt, int *flag)
{
    for (int64_t s = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; s < n; s += (int64_t)gridDim.x * blockDim.x) {
        int e = ids[s];
        if (e == -1)
            continue;
        if (e < 0 || e >= E)
            atomicOr(flag, PERM_BAD_ID);
        else
            atomicAdd(&cnt[e], 1ull);
    }
}

__global__ void perm_offsets_kernel(unsigned long long *cnt_off, int E, int64_t pad, int64_t R, int64_t *splits,
                                    int *flag, int64_t *need)
{
    int64_t off = 0;
    for (int e = 0; e < E; e++) {
        int64_t P = fm_round_up((int64_t)cnt_off[e], pad);
        splits[e] = P;
        cnt_off[e] = (unsigned long long)off;
        off += P;
    }
    *need = off;
    if (off > R)
        atomicOr(flag, PERM_TOO_FEW_ROWS);
}

__global__ void perm_rank_kernel(const int32_t *ids, int64_t n, const unsigned long long *off, const int *flag,
                                 int32_t *slot_rows, int32_t *row_map)
{
    __shared__ int wsum[32];
    if (*flag)
        return;
    int e = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int64_t base = (int64_t)off[e];
    for (int64_t c0 = 0; c0 < n; c0 += blockDim.x) {
        int64_t s = c0 + threadIdx.x;
        int f = s < n && ids[s] == e;
        unsigned b = __ballot_sync(0xFFFFFFFFu, f);
        if (lane == 0)
            wsum[w] = __popc(b);
        __syncthreads();
        int wb = 0, tot = 0;
        for (int i = 0; i < nw; i++) {
            wb += i < w ? wsum[i] : 0;
            tot += wsum[i];
        }
        if (f) {
            int64_t row = base + wb + __popc(b & ((1u << lane) - 1u));
            slot_rows[s] = (int32_t)row;
            row_map[row] = (int32_t)s;
        }
        base += tot;
        __syncthreads();
    }
}

__global__ void perm_copy_kernel(const uint8_t *x, const uint8_t *xs, const int32_t *row_map, const float *probs,
                                 int64_t R, int64_t k, int64_t rb, int64_t sb, int e8, int vec, uint8_t *out,
                                 uint8_t *outs, float *out_probs)
{
    int64_t r = blockIdx.x;
    int32_t s = row_map[r];
    uint8_t *dst = out + r * rb;
    const uint8_t *src = s >= 0 ? x + (int64_t)(s / k) * rb : NULL;
    if (vec) {
        for (int64_t i = threadIdx.x; i < rb / 16; i += blockDim.x)
            ((uint4 *)dst)[i] = src ? ((const uint4 *)src)[i] : make_uint4(0, 0, 0, 0);
    } else {
        for (int64_t i = threadIdx.x; i < rb; i += blockDim.x)
            dst[i] = src ? src[i] : 0;
    }
    if (sb) {
        uint8_t *sd = outs + r * sb;
        if (s >= 0) {
            const uint8_t *ss = xs + (int64_t)(s / k) * sb;
            for (int64_t i = threadIdx.x; i < sb; i += blockDim.x)
                sd[i] = ss[i];
        } else if (e8) {
            for (int64_t i = threadIdx.x; i < sb; i += blockDim.x)
                sd[i] = 127;
        } else {
            for (int64_t i = threadIdx.x; i < sb / 4; i += blockDim.x)
                ((float *)sd)[i] = 1.0f;
        }
    }
    if (out_probs && threadIdx.x == 0)
        out_probs[r] = s >= 0 ? probs[s] : 0.0f;
}

extern "C" fm_status fm_cuda_moe_permute(fm_context *ctx, const fm_permute_config *cfg, const fm_tensor *x,
                                         const fm_tensor *expert_ids, const fm_tensor *probs, fm_tensor *out,
                                         fm_tensor *row_map, fm_tensor *slot_rows, fm_tensor *splits,
                                         fm_tensor *out_probs, int64_t *host_splits)
{
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_moe_permute");
    if (st)
        return st;
    int64_t T = x->shape[0], H = x->shape[1], k = expert_ids->shape[1], E = splits->shape[1], R = out->shape[0];
    int64_t n = T * k, pad = cfg->pad_multiple > 1 ? cfg->pad_multiple : 1;
    int64_t rb = x->dtype == FM_DTYPE_E2M1 ? H / 2 : H * (fm_dtype_bits(x->dtype) / 8);
    int64_t sb = x->scale_mode == FM_SCALE_NONE
                     ? 0
                     : fm_cdiv(H, fm_mode_block_cols(x->scale_mode)) * (fm_dtype_bits(x->scale_dtype) / 8);
    cudaStream_t s = fm_cuda_stream(ctx);
    /* scratch: E counts/offsets, the flag, the needed row count */
    size_t bytes = (size_t)E * 8 + 16;
    void *scr;
    int owned;
    if ((st = fm_cuda_scratch(ctx, bytes, &scr, &owned, "fm_moe_permute"))) {
        fm_cuda_leave(ctx, &g, cudaSuccess, "fm_moe_permute");
        return st;
    }
    unsigned long long *cnt = (unsigned long long *)scr;
    int64_t *need = (int64_t *)((uint8_t *)scr + E * 8);
    int *flag = (int *)(need + 1);
    cudaError_t err = cudaMemsetAsync(scr, 0, bytes, s);
    if (err == cudaSuccess && R > 0)
        err = cudaMemsetAsync(row_map->data, 0xFF, (size_t)R * 4, s); /* -1 */
    if (err == cudaSuccess && n > 0)
        err = cudaMemsetAsync(slot_rows->data, 0xFF, (size_t)n * 4, s); /* -1: slots with no expert */
    if (err == cudaSuccess) {
        if (n > 0)
            perm_count_kernel<<<(unsigned)((n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024), 256, 0, s>>>(
                (const int32_t *)expert_ids->data, n, (int)E, cnt, flag);
        perm_offsets_kernel<<<1, 1, 0, s>>>(cnt, (int)E, pad, R, (int64_t *)splits->data, flag, need);
        if (n > 0)
            perm_rank_kernel<<<(unsigned)E, 1024, 0, s>>>((const int32_t *)expert_ids->data, n, cnt, flag,
                                                          (int32_t *)slot_rows->data, (int32_t *)row_map->data);
        int vec = rb % 16 == 0 && ((uintptr_t)x->data % 16) == 0 && ((uintptr_t)out->data % 16) == 0;
        if (R > 0)
            perm_copy_kernel<<<(unsigned)R, 128, 0, s>>>(
                (const uint8_t *)x->data, (const uint8_t *)x->scale, (const int32_t *)row_map->data,
                probs ? (const float *)probs->data : NULL, R, k, rb, sb, x->scale_dtype == FM_DTYPE_E8M0, vec,
                (uint8_t *)out->data, (uint8_t *)out->scale, out_probs ? (float *)out_probs->data : NULL);
        err = cudaGetLastError();
    }
    int hflag = 0;
    int64_t hneed = 0;
    if (err == cudaSuccess && host_splits) {
        err = cudaMemcpyAsync(host_splits, splits->data, (size_t)E * 8, cudaMemcpyDeviceToHost, s);
        if (err == cudaSuccess)
            err = cudaMemcpyAsync(&hneed, need, 8, cudaMemcpyDeviceToHost, s);
        if (err == cudaSuccess)
            err = cudaMemcpyAsync(&hflag, flag, 4, cudaMemcpyDeviceToHost, s);
        if (err == cudaSuccess)
            err = cudaStreamSynchronize(s);
    }
    if (owned) {
        cudaError_t e2 = cudaFreeAsync(scr, s);
        if (err == cudaSuccess)
            err = e2;
    }
    if ((st = fm_cuda_leave(ctx, &g, err, "fm_moe_permute")))
        return st;
    if (hflag & PERM_BAD_ID)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "expert_ids: holds an id outside [0, E = %lld) that is not -1 (E = splits' columns)",
                        (long long)E);
    if (hflag & PERM_TOO_FEW_ROWS)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "out: has %lld rows but this routing needs %lld (sum over experts of their slot count rounded "
                        "up to pad_multiple %lld)",
                        (long long)R, (long long)hneed, (long long)pad);
    return FM_OK;
}
