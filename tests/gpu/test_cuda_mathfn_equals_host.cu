/* mathfn.h on the device gives the host's bits: fm_expf, fm_sigmoidf,
 * fm_siluf and fm_dsiluf over 2^24 F32 patterns spread over the whole bit
 * range (every sign, exponent and a spread of mantissas, NaN and Inf
 * included), and fm_rcp_1to2f (the device's reciprocal without the range
 * check of __frcp_rn) on every F32 of [1, 2], and fm_sigmoid_pm8 (eight at
 * once, the fused SwiGLU kernels' form) against the host's fm_sigmoid_pm on
 * the same patterns, grouped two ways: eight neighbours (mostly one class,
 * so the short path runs) and eight patterns 2^21 apart (mixed magnitudes).
 * The SwiGLU and router kernels are only bit-exact with the CPU if these
 * are. */
#include <stdio.h>

#include "flowmoe/mathfn.h"
#include "gpu_test.h"

enum { EXP, SIG, SILU, DSILU, SP8N, SN8N, SP8M, SN8M, NF };
#define N (1u << 24)

static __host__ __device__ uint32_t pattern(uint32_t i) { return (i << 8) | ((i * 37u + (i >> 11)) & 0xFFu); }

__global__ void eval_kernel(uint32_t *out)
{
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < N; i += gridDim.x * blockDim.x) {
        float x = __uint_as_float(pattern(i));
        out[EXP * N + i] = __float_as_uint(fm_expf(x));
        out[SIG * N + i] = __float_as_uint(fm_sigmoidf(x));
        out[SILU * N + i] = __float_as_uint(fm_siluf(x));
        out[DSILU * N + i] = __float_as_uint(fm_dsiluf(x));
    }
}

/* fm_sigmoid_pm8 over group j: patterns 8j..8j+7 (near) or j + k 2^21
 * (mixed) for k < 8. */
__global__ void sig8_kernel(uint32_t *out)
{
    for (uint32_t j = blockIdx.x * blockDim.x + threadIdx.x; j < N / 8; j += gridDim.x * blockDim.x)
        for (int mixed = 0; mixed < 2; mixed++) {
            float g[8], sp[8], sn[8];
            uint32_t idx[8];
            for (int k = 0; k < 8; k++) {
                idx[k] = mixed ? j + (uint32_t)k * (N / 8) : 8 * j + k;
                g[k] = __uint_as_float(pattern(idx[k]));
            }
            fm_sigmoid_pm8(g, sp, sn);
            for (int k = 0; k < 8; k++) {
                out[(mixed ? SP8M : SP8N) * N + idx[k]] = __float_as_uint(sp[k]);
                out[(mixed ? SN8M : SN8N) * N + idx[k]] = __float_as_uint(sn[k]);
            }
        }
}

/* every F32 of [1, 2]: 2^23 + 1 of them */
#define NR ((1u << 23) + 1)

__global__ void rcp_kernel(uint32_t *out)
{
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < NR; i += gridDim.x * blockDim.x)
        out[i] = __float_as_uint(fm_rcp_1to2f(__uint_as_float(0x3F800000u + i)));
}

int main(void)
{
    fm_context *ctx = gt_cuda_context("test_cuda_mathfn_equals_host");
    uint32_t *d = NULL, *h = (uint32_t *)malloc((size_t)NF * N * 4);
    GT_CUDA(cudaMalloc(&d, (size_t)NF * N * 4));
    GT_CUDA(cudaMemset(d, 0xA5, (size_t)NF * N * 4));
    eval_kernel<<<1024, 256>>>(d);
    GT_CUDA(cudaGetLastError());
    sig8_kernel<<<1024, 256>>>(d);
    GT_CUDA(cudaGetLastError());
    GT_CUDA(cudaMemcpy(h, d, (size_t)NF * N * 4, cudaMemcpyDeviceToHost));
    static const char *names[NF] = {"fm_expf", "fm_sigmoidf", "fm_siluf", "fm_dsiluf", "fm_sigmoid_pm8 s (near)",
                                    "fm_sigmoid_pm8 1-s (near)", "fm_sigmoid_pm8 s (mixed)", "fm_sigmoid_pm8 1-s (mixed)"};
    long bad[NF] = {0};
    for (uint32_t i = 0; i < N; i++) {
        float x = fm_bits_f32(pattern(i)), sp, sn;
        fm_sigmoid_pm(x, &sp, &sn);
        uint32_t want[NF] = {fm_f32_bits(fm_expf(x)), fm_f32_bits(fm_sigmoidf(x)), fm_f32_bits(fm_siluf(x)),
                             fm_f32_bits(fm_dsiluf(x)), fm_f32_bits(sp), fm_f32_bits(sn), fm_f32_bits(sp),
                             fm_f32_bits(sn)};
        for (int f = 0; f < NF; f++)
            if (h[f * N + i] != want[f] && bad[f]++ < 3)
                GT_CHECK(0, "%s(%a = 0x%08x): device 0x%08x, host 0x%08x", names[f], (double)x, pattern(i),
                         h[f * N + i], want[f]);
    }
    for (int f = 0; f < NF; f++)
        printf("%-12s %u patterns, %ld differ\n", names[f], N, bad[f]);

    GT_CUDA(cudaMemset(d, 0xA5, (size_t)NR * 4));
    rcp_kernel<<<1024, 256>>>(d);
    GT_CUDA(cudaGetLastError());
    GT_CUDA(cudaMemcpy(h, d, (size_t)NR * 4, cudaMemcpyDeviceToHost));
    long rbad = 0;
    for (uint32_t i = 0; i < NR; i++) {
        const float x = fm_bits_f32(0x3F800000u + i);
        const uint32_t want = fm_f32_bits(1.0f / x);
        if (h[i] != want && rbad++ < 3)
            GT_CHECK(0, "fm_rcp_1to2f(%a): device 0x%08x, host 1/x 0x%08x", (double)x, h[i], want);
    }
    printf("%-12s %u values of [1, 2], %ld differ\n", "fm_rcp_1to2f", NR, rbad);
    cudaFree(d);
    free(h);
    fm_context_destroy(ctx);
    printf("test_cuda_mathfn_equals_host: %d failures\n", gt_failures);
    return gt_failures ? 1 : 0;
}
