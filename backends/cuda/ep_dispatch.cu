/* The device half of fm_ep_dispatch (collectives/comm.c builds the routing
 * plan on the host): the pack of the rows to send, grouped by destination,
 * and the received rows' src_rank. Rows move as bytes, so the result is the
 * in-process reference's, bit for bit.
 *
 * Pack: a warp per send row (eight rows per block, grid-stride), 16-byte
 * vectors where the row length and both buffers allow, else 4-byte words,
 * else bytes; the lanes then write the row's token, local ids and probs. */
#include "cuda.h"
#include "ep.h"
#include "kernels.cuh"

enum { EP_WARPS = 8 };

/* Widest copy unit (16, 4 or 1 bytes) that divides the row length and both
 * row bases: the rows start at multiples of `bytes` from the two pointers. */
static int ep_unit(int64_t bytes, const void *a, const void *b)
{
    uintptr_t m = (uintptr_t)bytes | (uintptr_t)a | (uintptr_t)b;
    return m % 16 == 0 ? 16 : m % 4 == 0 ? 4 : 1;
}

FM_DI void ep_copy_row(uint8_t *dst, const uint8_t *src, int64_t bytes, int unit, int lane)
{
    if (unit == 16) {
        for (int64_t i = lane; i < bytes / 16; i += 32)
            ((uint4 *)dst)[i] = ((const uint4 *)src)[i];
    } else if (unit == 4) {
        for (int64_t i = lane; i < bytes / 4; i += 32)
            ((uint32_t *)dst)[i] = ((const uint32_t *)src)[i];
    } else {
        for (int64_t i = lane; i < bytes; i += 32)
            dst[i] = src[i];
    }
}

__global__ void ep_pack_kernel(fm_ep_pack a, int du, int su)
{
    const int lane = threadIdx.x & 31;
    for (int64_t r = blockIdx.x * (int64_t)EP_WARPS + (threadIdx.x >> 5); r < a.rows;
         r += (int64_t)gridDim.x * EP_WARPS) {
        const int64_t t = a.tok[r];
        const int p = a.dst[r];
        ep_copy_row((uint8_t *)a.pd + r * a.rb, (const uint8_t *)a.x + t * a.rb, a.rb, du, lane);
        if (a.sb)
            ep_copy_row((uint8_t *)a.ps + r * a.sb, (const uint8_t *)a.xs + t * a.sb, a.sb, su, lane);
        if (lane == 0)
            a.pt[r] = (int32_t)t;
        for (int64_t j = lane; j < a.k; j += 32) {
            const int32_t g = a.ids[t * a.k + j];
            const int here = g >= 0 && g / a.e_local == p;
            a.pi[r * a.k + j] = here ? g - p * a.e_local : -1;
            if (a.pp)
                a.pp[r * a.k + j] = here ? a.probs[t * a.k + j] : 0.0f;
        }
    }
}

__global__ void ep_src_rank_kernel(int32_t *src_rank, const int64_t *roff, int n, int64_t rows)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows; i += (int64_t)gridDim.x * blockDim.x) {
        int lo = 0, hi = n - 1; /* the last p with roff[p] <= i */
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (roff[mid] <= i)
                lo = mid;
            else
                hi = mid - 1;
        }
        src_rank[i] = lo;
    }
}

static unsigned ep_blocks(int64_t units, int64_t per_block)
{
    int64_t b = (units + per_block - 1) / per_block;
    return (unsigned)(b < 65535 ? (b > 0 ? b : 1) : 65535);
}

extern "C" int fm_cuda_ep_device(const fm_context *ctx) { return ((const fm_cuda_state *)ctx->be_state)->device; }

extern "C" fm_status fm_cuda_ep_copy(fm_context *ctx, void *dst, const void *src, size_t bytes, const char *what)
{
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, what);
    if (st)
        return st;
    return fm_cuda_leave(ctx, &g, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, fm_cuda_stream(ctx)), what);
}

extern "C" fm_status fm_cuda_ep_pack(fm_context *ctx, const fm_ep_pack *a)
{
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_ep_dispatch: pack");
    if (st)
        return st;
    if (a->rows > 0)
        ep_pack_kernel<<<ep_blocks(a->rows, EP_WARPS), EP_WARPS * 32, 0, fm_cuda_stream(ctx)>>>(
            *a, ep_unit(a->rb, a->x, a->pd), ep_unit(a->sb, a->xs, a->ps));
    return fm_cuda_leave(ctx, &g, cudaGetLastError(), "fm_ep_dispatch: ep_pack_kernel");
}

extern "C" fm_status fm_cuda_ep_fill_src_rank(fm_context *ctx, int32_t *src_rank, const int64_t *roff, int n,
                                              int64_t rows)
{
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_ep_dispatch: src_rank");
    if (st)
        return st;
    if (rows > 0)
        ep_src_rank_kernel<<<ep_blocks(rows, 256), 256, 0, fm_cuda_stream(ctx)>>>(src_rank, roff, n, rows);
    return fm_cuda_leave(ctx, &g, cudaGetLastError(), "fm_ep_dispatch: ep_src_rank_kernel");
}
