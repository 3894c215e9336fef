/* The device half of fm_ep_combine: per token, the rows that came back from
 * the ranks it visited, added in ascending rank order in F32 exactly as
 * collectives/comm.c's host loop does (acc = first row, then acc + next with
 * __fadd_rn: no contraction can apply), rounded once through format.h's
 * stores (moe_common.cuh's fm_moe_store), so the bits equal the in-process
 * reference's. A block per token, threads across the columns, eight columns
 * per thread when the rows allow 16-byte loads and stores. */
#include "cuda.h"
#include "ep.h"
#include "moe_common.cuh"

enum { SUM_THREADS = 128 };

/* Eight consecutive elements starting at a 16-byte boundary. */
FM_DI void sum_load8(const void *p, int dt, int64_t i, float *v)
{
    if (dt == FM_DTYPE_F32) {
        const float4 a = ((const float4 *)p)[i / 4], b = ((const float4 *)p)[i / 4 + 1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        return;
    }
    const uint4 u = ((const uint4 *)p)[i / 8];
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint16_t lo = (uint16_t)(w[j] & 0xFFFFu), hi = (uint16_t)(w[j] >> 16);
        v[2 * j] = dt == FM_DTYPE_BF16 ? fm_bf16_to_f32(lo) : fm_f16_to_f32(lo);
        v[2 * j + 1] = dt == FM_DTYPE_BF16 ? fm_bf16_to_f32(hi) : fm_f16_to_f32(hi);
    }
}

FM_DI void sum_store8(void *p, int dt, int64_t i, const float *v)
{
    if (dt == FM_DTYPE_F32) {
        float c[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            c[j] = fm_f32_canon(v[j]);
        ((float4 *)p)[i / 4] = make_float4(c[0], c[1], c[2], c[3]);
        ((float4 *)p)[i / 4 + 1] = make_float4(c[4], c[5], c[6], c[7]);
        return;
    }
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint32_t lo = dt == FM_DTYPE_BF16 ? fm_bf16_from_f32(v[2 * j]) : fm_f16_from_f32(v[2 * j]);
        const uint32_t hi = dt == FM_DTYPE_BF16 ? fm_bf16_from_f32(v[2 * j + 1]) : fm_f16_from_f32(v[2 * j + 1]);
        w[j] = lo | (hi << 16);
    }
    ((uint4 *)p)[i / 8] = make_uint4(w[0], w[1], w[2], w[3]);
}

template <bool VEC>
__global__ void ep_sum_kernel(const void *recv, int ydt, const int32_t *toff, const int32_t *rows, int64_t C,
                              void *out, int odt)
{
    const int64_t t = blockIdx.x;
    const int32_t first = toff[t];
    const int m = toff[t + 1] - first;
    if (VEC) {
        for (int64_t h = threadIdx.x * 8; h < C; h += (int64_t)blockDim.x * 8) {
            float acc[8], v[8];
#pragma unroll
            for (int j = 0; j < 8; j++)
                acc[j] = 0.0f;
            for (int i = 0; i < m; i++) {
                sum_load8(recv, ydt, (int64_t)rows[first + i] * C + h, v);
#pragma unroll
                for (int j = 0; j < 8; j++)
                    acc[j] = i == 0 ? v[j] : __fadd_rn(acc[j], v[j]);
            }
            sum_store8(out, odt, t * C + h, acc);
        }
    } else {
        for (int64_t h = threadIdx.x; h < C; h += blockDim.x) {
            float acc = 0.0f;
            for (int i = 0; i < m; i++) {
                const float v = fm_moe_load(recv, ydt, (int64_t)rows[first + i] * C + h);
                acc = i == 0 ? v : __fadd_rn(acc, v);
            }
            fm_moe_store(out, odt, t * C + h, acc);
        }
    }
}

extern "C" fm_status fm_cuda_ep_sum(fm_context *ctx, const void *recv, fm_dtype ydt, const int32_t *toff,
                                    const int32_t *rows, int64_t T, int64_t C, void *out, fm_dtype odt)
{
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_ep_combine: sum");
    if (st)
        return st;
    cudaStream_t s = fm_cuda_stream(ctx);
    /* recv rows start at multiples of C elements from a 256-byte aligned base */
    const bool vec = C % 8 == 0 && (uintptr_t)recv % 16 == 0 && (uintptr_t)out % 16 == 0;
    if (T > 0 && C > 0) {
        if (vec)
            ep_sum_kernel<true><<<(unsigned)T, SUM_THREADS, 0, s>>>(recv, (int)ydt, toff, rows, C, out, (int)odt);
        else
            ep_sum_kernel<false><<<(unsigned)T, SUM_THREADS, 0, s>>>(recv, (int)ydt, toff, rows, C, out, (int)odt);
    }
    return fm_cuda_leave(ctx, &g, cudaGetLastError(), "fm_ep_combine: ep_sum_kernel");
}
