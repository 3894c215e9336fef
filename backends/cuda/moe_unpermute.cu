/* CUDA unpermute + combine and its backward, bit-exact with
 * backends/cpu/moe_unpermute.c: the combine is the same fmaf chain in choice
 * order per element (one block per token, threads across H); dprobs is one
 * warp per (token, choice), lane-strided fmaf and the warp tree of mathfn's
 * fixed order. Slot rows of -1 (no expert on this rank) are skipped as the
 * CPU skips them; other row indices out of range are skipped on the device
 * too (the CPU refuses them): nothing is read or written out of bounds.
 * BF16 / F32 rows whose width is a multiple of 8 take kernels specialised on
 * the dtypes that move 8 elements per thread in 16-byte accesses and, in the
 * combine, issue the loads of 4 choices before their fmaf chain (the same
 * chain, in the same order). */
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

/* 8 consecutive elements of a BF16 (YB) or F32 row as F32. */
template <int YB>
FM_DI void unperm_load8(const void *p, int64_t i8, float *v)
{
    if (YB) {
        const uint4 w = __ldg((const uint4 *)p + i8);
        const uint32_t q[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            v[2 * k] = __uint_as_float(q[k] << 16);
            v[2 * k + 1] = __uint_as_float(q[k] & 0xFFFF0000u);
        }
    } else {
        const float4 a = __ldg((const float4 *)p + 2 * i8), b = __ldg((const float4 *)p + 2 * i8 + 1);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
}

/* fm_moe_store's rule on 8 consecutive elements. */
template <int OB>
FM_DI void unperm_store8(void *p, int64_t i8, const float *v)
{
    if (OB) {
        uint32_t q[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            q[k] = (uint32_t)fm_bf16_from_f32(v[2 * k]) | ((uint32_t)fm_bf16_from_f32(v[2 * k + 1]) << 16);
        ((uint4 *)p)[i8] = make_uint4(q[0], q[1], q[2], q[3]);
    } else {
        float c[8];
#pragma unroll
        for (int k = 0; k < 8; k++)
            c[k] = fm_f32_canon(v[k]);
        ((float4 *)p)[2 * i8] = make_float4(c[0], c[1], c[2], c[3]);
        ((float4 *)p)[2 * i8 + 1] = make_float4(c[4], c[5], c[6], c[7]);
    }
}

#define UNPERM_GROUP 4 /* choices whose loads are in flight together */

template <int YB, int OB>
__global__ void __launch_bounds__(128) unperm_vec_kernel(const void *__restrict__ y, int64_t R,
                                                         const int32_t *__restrict__ sr, const float *__restrict__ w,
                                                         int64_t k, int64_t H, void *__restrict__ out)
{
    const int64_t t = blockIdx.x, n8 = H / 8;
    for (int64_t i = threadIdx.x; i < n8; i += blockDim.x) {
        float acc[8];
#pragma unroll
        for (int e = 0; e < 8; e++)
            acc[e] = 0.0f;
        for (int64_t j0 = 0; j0 < k; j0 += UNPERM_GROUP) {
            float v[UNPERM_GROUP][8], wj[UNPERM_GROUP];
            bool use[UNPERM_GROUP];
#pragma unroll
            for (int q = 0; q < UNPERM_GROUP; q++) {
                const int64_t j = j0 + q;
                const int32_t r = j < k ? __ldg(sr + t * k + j) : -1;
                use[q] = r >= 0 && r < R;
                wj[q] = use[q] && w ? __ldg(w + t * k + j) : 1.0f;
                if (use[q])
                    unperm_load8<YB>((const uint8_t *)y + (int64_t)r * H * (YB ? 2 : 4), i, v[q]);
            }
#pragma unroll
            for (int q = 0; q < UNPERM_GROUP; q++)
                if (use[q])
#pragma unroll
                    for (int e = 0; e < 8; e++)
                        acc[e] = fmaf(wj[q], v[q][e], acc[e]);
        }
        unperm_store8<OB>((uint8_t *)out + t * H * (OB ? 2 : 4), i, acc);
    }
}

/* dy[r] = w_s dout[s / k] for rows with a slot, zero rows for padding. */
template <int DB, int YB>
__global__ void __launch_bounds__(128) scatter_vec_kernel(const void *__restrict__ dout,
                                                          const int32_t *__restrict__ rm, const float *__restrict__ w,
                                                          int64_t n, int64_t k, int64_t H, void *__restrict__ dy)
{
    const int64_t r = blockIdx.x, n8 = H / 8;
    const int32_t s = rm[r];
    const bool ok = s >= 0 && s < n;
    const float ws = ok && w ? w[s] : 1.0f;
    const uint8_t *src = ok ? (const uint8_t *)dout + (s / k) * H * (DB ? 2 : 4) : NULL;
    for (int64_t i = threadIdx.x; i < n8; i += blockDim.x) {
        float v[8];
        if (ok) {
            unperm_load8<DB>(src, i, v);
#pragma unroll
            for (int e = 0; e < 8; e++)
                v[e] = ws * v[e];
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++)
                v[e] = 0.0f;
        }
        unperm_store8<YB>((uint8_t *)dy + r * H * (YB ? 2 : 4), i, v);
    }
}

/* BF16 / F32 rows of 8-element multiples at 16-byte aligned addresses. */
static int vec8(const fm_tensor *a, const fm_tensor *b)
{
    const fm_tensor *t[2] = {a, b};
    for (int i = 0; i < 2; i++)
        if ((t[i]->dtype != FM_DTYPE_BF16 && t[i]->dtype != FM_DTYPE_F32) || (uintptr_t)t[i]->data % 16)
            return 0;
    return a->shape[1] % 8 == 0;
}

/* One thread per element of dy [R, H] (grid-stride): the layer's one-column
 * gather (H 1) took a CTA per row, 31 us for 32768 rows; this takes 3. */
__global__ void scatter_kernel(const void *dout, int odt, const int32_t *rm, const float *w, int64_t n, int64_t k,
                               int64_t R, int64_t H, void *dy, int ydt)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < R * H;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / H, h = i - r * H;
        const int32_t s = rm[r];
        const int ok = s >= 0 && s < n;
        const float ws = ok && w ? w[s] : 1.0f;
        fm_moe_store(dy, ydt, i, ok ? ws * fm_moe_load(dout, odt, (s / k) * H + h) : 0.0f);
    }
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
    const int32_t *sr = (const int32_t *)slot_rows->data;
    const float *w = probs ? (const float *)probs->data : NULL;
    cudaStream_t s = fm_cuda_stream(ctx);
    if (T > 0 && vec8(y, out)) {
        const int yb = y->dtype == FM_DTYPE_BF16, ob = out->dtype == FM_DTYPE_BF16;
        const unsigned b = (unsigned)T;
        if (yb && ob)
            unperm_vec_kernel<1, 1><<<b, 128, 0, s>>>(y->data, y->shape[0], sr, w, k, H, out->data);
        else if (yb)
            unperm_vec_kernel<1, 0><<<b, 128, 0, s>>>(y->data, y->shape[0], sr, w, k, H, out->data);
        else if (ob)
            unperm_vec_kernel<0, 1><<<b, 128, 0, s>>>(y->data, y->shape[0], sr, w, k, H, out->data);
        else
            unperm_vec_kernel<0, 0><<<b, 128, 0, s>>>(y->data, y->shape[0], sr, w, k, H, out->data);
    } else if (T > 0) {
        unperm_kernel<<<(unsigned)T, 256, 0, s>>>(y->data, (int)y->dtype, y->shape[0], sr, w, k, H, out->data,
                                                  (int)out->dtype);
    }
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
    if (R > 0 && vec8(dout, dy)) {
        const int db = dout->dtype == FM_DTYPE_BF16, yb = dy->dtype == FM_DTYPE_BF16;
        const int32_t *rm = (const int32_t *)row_map->data;
        const unsigned b = (unsigned)R;
        if (db && yb)
            scatter_vec_kernel<1, 1><<<b, 128, 0, s>>>(dout->data, rm, w, n, k, H, dy->data);
        else if (db)
            scatter_vec_kernel<1, 0><<<b, 128, 0, s>>>(dout->data, rm, w, n, k, H, dy->data);
        else if (yb)
            scatter_vec_kernel<0, 1><<<b, 128, 0, s>>>(dout->data, rm, w, n, k, H, dy->data);
        else
            scatter_vec_kernel<0, 0><<<b, 128, 0, s>>>(dout->data, rm, w, n, k, H, dy->data);
    } else if (R > 0 && H > 0) {
        const int64_t blocks = (R * H + 255) / 256;
        scatter_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), 256, 0, s>>>(
            dout->data, (int)dout->dtype, (const int32_t *)row_map->data, w, n, k, R, H, dy->data, (int)dy->dtype);
    }
    if (dprobs && n > 0)
        dprobs_kernel<<<(unsigned)((n * 32 + 255) / 256), 256, 0, s>>>(dout->data, (int)dout->dtype, y->data,
                                                                        (int)y->dtype, R,
                                                                        (const int32_t *)slot_rows->data, n, H, k,
                                                                        (float *)dprobs->data);
    return fm_cuda_leave(ctx, &g, cudaGetLastError(), "fm_moe_unpermute_backward");
}
