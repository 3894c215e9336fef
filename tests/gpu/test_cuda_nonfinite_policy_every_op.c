/* On inputs full of NaN (canonical and with payloads), +-Inf, overflow-sized
 * values and subnormals, the CUDA backend follows the non-finite policy the
 * way the CPU reference does: every op of the workload (tests/ops_workload.h,
 * the one the determinism tests run) on a CUDA and a CPU context over the
 * same bytes, then
 *   - the exact ops (quantize with amax and the non-finite count, dequantize,
 *     scale layouts, casts, transposes, conversions, router, permute,
 *     unpermute, SwiGLU and their backwards): the same bytes;
 *   - the GEMMs: NaN, +Inf and -Inf at the same positions, and the DESIGN.md
 *     relative Frobenius error (5e-3 BF16, 5e-4 F32 outputs) over the
 *     finite ones.
 * The GEMM inputs hold NaN and Inf elements, E5M2 Inf codes, NaN block
 * scales (a quantized non-finite block), and rows of 1e20 whose products with
 * each other overflow F32 while every partial sum with an ordinary row stays
 * far from FLT_MAX (and whose scale products stay finite in F32, gemm.h's
 * range condition): where the CPU's double rule says +Inf, an F32
 * accumulation must say +Inf too, and nowhere else may a number become
 * non-finite or the other way round. tests/test_nonfinite_policy_every_op.c
 * checks the CPU itself against the policy, op by op. */
#include "gpu_test.h"

#include "../ops_workload.h"

int main(void)
{
    const char *name = "test_cuda_nonfinite_policy_every_op";
    fm_context *gpu = gt_cuda_context(name);
    fm_context *cpu = gt_cpu_context();
    const char *env = getenv("FM_TEST_SEED");
    uint64_t seed = env && *env ? strtoull(env, NULL, 0) : 0x0F1A7ull;
    printf("%s: seed %llu (replay with FM_TEST_SEED=%llu)\n", name, (unsigned long long)seed,
           (unsigned long long)seed);
    wl_inputs in;
    wl_setup(&in, seed, 1, 1);
    wl_run c, g;
    wl_run_all(&c, cpu, &in, 0x5A, 0);
    wl_run_all(&g, gpu, &in, 0xA5, 0);
    GT_CHECK(c.failures == 0 && g.failures == 0, "op calls failed: %d on the CPU, %d on CUDA (printed above)",
             c.failures, g.failures);
    int bad = wl_diff(&c, &g, 1, "CPU against CUDA");
    int gemms = 0, calls, outputs;
    for (int i = 0; i < c.nblob; i++)
        gemms += c.blob[i].gemm;
    wl_count(&c, &calls, &outputs);
    GT_CHECK(bad == 0, "%d of %d outputs differ (printed above)", bad, c.nblob);
    printf("%s: %d op calls, %d outputs compared (%d GEMM outputs by class and tolerance, the rest byte for byte)\n",
           name, calls, outputs, gemms);
    wl_run_free(&c);
    wl_run_free(&g);
    wl_inputs_free(&in);
    fm_context_destroy(cpu);
    fm_context_destroy(gpu);
    return gt_finish(name);
}
