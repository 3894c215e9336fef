/* F32 GEMMs with one side of at most 16 (the router's: logits = x · Wrᵀ
 * with N = E, and dWr = dlogitsᵀ · x with M = E). cuBLASLt's F32 kernels run
 * these memory-bound products at 35-55% of copy bandwidth (72 and 104 us a
 * layer step on H100 at T 4096, H 7168, E 8); here each reads its large
 * operand once, in full coalesced rows, and stays F32 end to end: 54 and 46
 * us, 73% and 85% of copy bandwidth (fm-bench, S11-14).
 *
 *   small N: D [M, N] = A [M, K] · B [N, K]ᵀ, A and B with K contiguous. A CTA
 *     takes 32 rows of A (4 a warp) and walks K in chunks of 16 KB of B,
 *     staged in shared memory one chunk ahead (every CTA reads all of B, from
 *     L2); a lane sums every 32nd element (a float4 of every 128th with
 *     16-byte rows) and the warp adds its lanes by shuffles in a fixed order.
 *   small M: D [M, N] = A [M, K] · B [N, K]ᵀ, B with N contiguous (stored
 *     [K, N], the transposed view of a row-major [K, N] input). A CTA takes
 *     32 columns; its 16 warps split K into 16 runs, a lane owns a column,
 *     and the 16 partial sums of each output are added in warp order through
 *     shared memory.
 * Both sum each output in one fixed order: results do not change run to
 * run. With cfg->accumulate the old D is added last, as the CPU rule does
 * (D + A·Bᵀ). */
#include <stdint.h>

#include "cuda.h"

#define SK_THREADS 256
#define SK_ROWS_PER_WARP 4
#define SK_MAX 16

template <int R, int C>
__device__ static __forceinline__ void sk_zero(float (&x)[R][C])
{
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int c = 0; c < C; c++)
            x[r][c] = 0.0f;
}

/* small N: NB (8 or 16) columns of D held per row, B staged in chunks of CH
 * elements (16 KB), two chunks in flight by cp.async so that no warp waits
 * for L2 between chunks. VEC 4 reads A and B as float4 (K % 4 == 0,
 * 16-byte aligned bases), 1 element by element. */
template <int NB>
struct sk_chunk {
    static const int CH = NB == 8 ? 512 : 256;
};

template <int NB, int VEC>
__device__ static __forceinline__ void sk_stage(float (*dst)[sk_chunk<NB>::CH], const float *b, int N, int64_t K,
                                                int64_t k0)
{
    const int CH = sk_chunk<NB>::CH;
    for (int i = threadIdx.x * VEC; i < NB * CH; i += SK_THREADS * VEC) {
        const int n = i / CH, k = i % CH;
        float *s = &dst[n][k];
        if (n < N && k0 + k + VEC <= K) {
            const float *g = b + (int64_t)n * K + k0 + k;
            asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"((uint32_t)__cvta_generic_to_shared(s)),
                         "l"(g), "n"(VEC * 4)
                         : "memory");
        } else {
#pragma unroll
            for (int v = 0; v < VEC; v++)
                s[v] = n < N && k0 + k + v < K ? __ldg(b + (int64_t)n * K + k0 + k + v) : 0.0f;
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int NB, int VEC>
__global__ void __launch_bounds__(SK_THREADS, NB == 8 ? 2 : 1) sk_small_n_kernel(const float *__restrict__ a,
                                                                 const float *__restrict__ b, float *d, int64_t M,
                                                                 int N, int64_t K, int accumulate)
{
    const int CH = sk_chunk<NB>::CH;
    __shared__ __align__(16) float bs[2][NB][sk_chunk<NB>::CH];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t r0 = ((int64_t)blockIdx.x * (SK_THREADS / 32) + warp) * SK_ROWS_PER_WARP;
    float acc[SK_ROWS_PER_WARP][NB];
    sk_zero(acc);
    const int64_t nch = (K + CH - 1) / CH;
    sk_stage<NB, VEC>(bs[0], b, N, K, 0);
    for (int64_t c = 0; c < nch; c++) {
        const int64_t k0 = c * CH;
        const int kc = K - k0 < CH ? (int)(K - k0) : CH;
        if (c + 1 < nch) {
            sk_stage<NB, VEC>(bs[(c + 1) & 1], b, N, K, k0 + CH);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();
        float (*bc)[sk_chunk<NB>::CH] = bs[c & 1];
        if (VEC == 4) {
#pragma unroll 2
            for (int j = lane * 4; j < kc; j += 128) {
                float4 x[SK_ROWS_PER_WARP];
#pragma unroll
                for (int r = 0; r < SK_ROWS_PER_WARP; r++)
                    x[r] = r0 + r < M ? __ldg((const float4 *)(a + (r0 + r) * K + k0 + j)) : make_float4(0, 0, 0, 0);
#pragma unroll
                for (int n = 0; n < NB; n++) {
                    const float4 y = *(const float4 *)&bc[n][j];
#pragma unroll
                    for (int r = 0; r < SK_ROWS_PER_WARP; r++) {
                        acc[r][n] = fmaf(x[r].x, y.x, acc[r][n]);
                        acc[r][n] = fmaf(x[r].y, y.y, acc[r][n]);
                        acc[r][n] = fmaf(x[r].z, y.z, acc[r][n]);
                        acc[r][n] = fmaf(x[r].w, y.w, acc[r][n]);
                    }
                }
            }
        } else {
#pragma unroll 4
            for (int j = lane; j < kc; j += 32) {
                float x[SK_ROWS_PER_WARP];
#pragma unroll
                for (int r = 0; r < SK_ROWS_PER_WARP; r++)
                    x[r] = r0 + r < M ? __ldg(a + (r0 + r) * K + k0 + j) : 0.0f;
#pragma unroll
                for (int n = 0; n < NB; n++) {
                    const float y = bc[n][j];
#pragma unroll
                    for (int r = 0; r < SK_ROWS_PER_WARP; r++)
                        acc[r][n] = fmaf(x[r], y, acc[r][n]);
                }
            }
        }
        __syncthreads(); /* chunk c's buffer is refilled by the next iteration's stage */
    }
#pragma unroll
    for (int r = 0; r < SK_ROWS_PER_WARP; r++)
#pragma unroll
        for (int n = 0; n < NB; n++) {
            float v = acc[r][n];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
            acc[r][n] = v;
        }
    /* lane n writes column n of the warp's rows (every lane holds every sum) */
#pragma unroll
    for (int r = 0; r < SK_ROWS_PER_WARP; r++) {
        if (r0 + r >= M)
            break;
        float v = 0.0f;
#pragma unroll
        for (int n = 0; n < NB; n++)
            if (n == lane)
                v = acc[r][n];
        if (lane < N) {
            float *o = d + (r0 + r) * N + lane;
            *o = accumulate ? *o + v : v;
        }
    }
}

/* small M: MB rows of D, CPL columns a lane (float2 loads of B when 2);
 * A's element (m, k) at a[m * sam + k * sak]. 16 warps a CTA split K; a
 * warp gathers the A values of its next SK_BATCH k into shared memory
 * (MB x SK_BATCH, any A layout) and reads them back as broadcast float4,
 * while its SK_BATCH rows of B are in flight. */
#define SK_MTHREADS 512
#define SK_BATCH 16
template <int MB, int CPL>
__global__ void __launch_bounds__(SK_MTHREADS) sk_small_m_kernel(const float *__restrict__ a, int64_t sam,
                                                                  int64_t sak, const float *__restrict__ b, float *d,
                                                                  int M, int64_t N, int64_t K, int accumulate)
{
    const int COLS = 32 * CPL, W = SK_MTHREADS / 32;
    __shared__ float part[W][MB][32 * CPL];
    __shared__ __align__(16) float abuf[W][SK_BATCH][MB];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t n0 = (int64_t)blockIdx.x * COLS + lane * CPL;
    const int64_t per = (K + W - 1) / W;
    const int64_t kb = warp * per < K ? warp * per : K, ke = kb + per < K ? kb + per : K;
    float acc[CPL][MB];
    sk_zero(acc);
    const bool pair = CPL == 2 && n0 + 1 < N;
    for (int64_t k = kb; k < ke; k += SK_BATCH) {
        const int kc = ke - k < SK_BATCH ? (int)(ke - k) : SK_BATCH;
        __syncwarp();
        for (int i = lane; i < SK_BATCH * MB; i += 32) {
            const int u = i / MB, m = i % MB;
            abuf[warp][u][m] = u < kc && m < M ? __ldg(a + m * sam + (k + u) * sak) : 0.0f;
        }
        __syncwarp();
        float y[SK_BATCH][CPL];
#pragma unroll
        for (int u = 0; u < SK_BATCH; u++) {
            const int64_t row = (k + u) * N + n0;
            if (u < kc && pair) {
                const float2 v = __ldg((const float2 *)(b + row));
                y[u][0] = v.x;
                y[u][CPL - 1] = v.y;
            } else {
                y[u][0] = u < kc && n0 < N ? __ldg(b + row) : 0.0f;
                if (CPL == 2)
                    y[u][CPL - 1] = u < kc && n0 + 1 < N ? __ldg(b + row + 1) : 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < SK_BATCH; u++)
#pragma unroll
            for (int m4 = 0; m4 < MB; m4 += 4) {
                const float4 x = *(const float4 *)&abuf[warp][u][m4];
#pragma unroll
                for (int c = 0; c < CPL; c++) {
                    acc[c][m4] = fmaf(x.x, y[u][c], acc[c][m4]);
                    acc[c][m4 + 1] = fmaf(x.y, y[u][c], acc[c][m4 + 1]);
                    acc[c][m4 + 2] = fmaf(x.z, y[u][c], acc[c][m4 + 2]);
                    acc[c][m4 + 3] = fmaf(x.w, y[u][c], acc[c][m4 + 3]);
                }
            }
    }
#pragma unroll
    for (int c = 0; c < CPL; c++)
#pragma unroll
        for (int m = 0; m < MB; m++)
            part[warp][m][lane * CPL + c] = acc[c][m];
    __syncthreads();
    for (int i = threadIdx.x; i < MB * COLS; i += SK_MTHREADS) {
        const int m = i / COLS, c = i % COLS;
        const int64_t col = (int64_t)blockIdx.x * COLS + c;
        if (m >= M || col >= N)
            continue;
        float v = part[0][m][c];
#pragma unroll
        for (int w = 1; w < W; w++)
            v += part[w][m][c];
        float *o = d + m * N + col;
        *o = accumulate ? *o + v : v;
    }
}

/* Which kernel takes D [M, N] = A · Bᵀ (F32, D row-major F32): 1 small N, 2
 * small M, 0 neither (cuBLASLt then). */
extern "C" int fm_cuda_gemm_skinny_kind(const fm_tensor *a, const fm_tensor *b, const fm_tensor *d, int64_t M,
                                        int64_t N, int64_t K)
{
    if (a->dtype != FM_DTYPE_F32 || b->dtype != FM_DTYPE_F32 || d->dtype != FM_DTYPE_F32 || M == 0 || N == 0 ||
        K == 0 || K >= ((int64_t)1 << 40))
        return 0;
    /* grids of M / 32 and N / 32 CTAs stay below the 2^31 - 1 limit */
    if (N <= SK_MAX && a->layout == FM_LAYOUT_ROWWISE && b->layout == FM_LAYOUT_ROWWISE &&
        M < ((int64_t)1 << 35))
        return 1;
    if (M <= SK_MAX && b->layout == FM_LAYOUT_COLWISE && N < ((int64_t)1 << 35))
        return 2;
    return 0;
}

extern "C" fm_status fm_cuda_gemm_skinny(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *a,
                                         const fm_tensor *b, fm_tensor *d, int kind)
{
    const int64_t M = a->shape[0], K = a->shape[1], N = b->shape[0];
    cudaStream_t s = fm_cuda_stream(ctx);
    const float *pa = (const float *)a->data, *pb = (const float *)b->data;
    float *pd = (float *)d->data;
    if (kind == 1) {
        const int vec = K % 4 == 0 && (uintptr_t)pa % 16 == 0 && (uintptr_t)pb % 16 == 0;
        const int64_t rows = (int64_t)(SK_THREADS / 32) * SK_ROWS_PER_WARP;
        const unsigned grid = (unsigned)((M + rows - 1) / rows);
        if (N <= 8)
            vec ? sk_small_n_kernel<8, 4><<<grid, SK_THREADS, 0, s>>>(pa, pb, pd, M, (int)N, K, cfg->accumulate)
                : sk_small_n_kernel<8, 1><<<grid, SK_THREADS, 0, s>>>(pa, pb, pd, M, (int)N, K, cfg->accumulate);
        else
            vec ? sk_small_n_kernel<16, 4><<<grid, SK_THREADS, 0, s>>>(pa, pb, pd, M, (int)N, K, cfg->accumulate)
                : sk_small_n_kernel<16, 1><<<grid, SK_THREADS, 0, s>>>(pa, pb, pd, M, (int)N, K, cfg->accumulate);
        return fm_cuda_check_launch(ctx, "F32 GEMM (small N) kernel");
    }
    /* A [M, K]: row-wise stored [M, K], column-wise stored [K, M]. */
    const int64_t sam = a->layout == FM_LAYOUT_ROWWISE ? K : 1, sak = a->layout == FM_LAYOUT_ROWWISE ? 1 : M;
    if (M <= 8) {
        const int pair = N % 2 == 0 && (uintptr_t)pb % 8 == 0;
        const unsigned grid = (unsigned)((N + 32 * (pair ? 2 : 1) - 1) / (32 * (pair ? 2 : 1)));
        if (pair)
            sk_small_m_kernel<8, 2><<<grid, SK_MTHREADS, 0, s>>>(pa, sam, sak, pb, pd, (int)M, N, K, cfg->accumulate);
        else
            sk_small_m_kernel<8, 1><<<grid, SK_MTHREADS, 0, s>>>(pa, sam, sak, pb, pd, (int)M, N, K, cfg->accumulate);
    } else {
        const unsigned grid = (unsigned)((N + 31) / 32);
        sk_small_m_kernel<16, 1><<<grid, SK_MTHREADS, 0, s>>>(pa, sam, sak, pb, pd, (int)M, N, K, cfg->accumulate);
    }
    return fm_cuda_check_launch(ctx, "F32 GEMM (small M) kernel");
}
