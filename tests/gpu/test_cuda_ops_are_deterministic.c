/* Every op the CUDA backend implements gives the same bits run to run:
 * the op workload of the CPU determinism test (tests/ops_workload.h: every
 * quantize mode with amax and non-finite counts, dequantize, scale layouts,
 * casts, grouped quantize, transposes and conversions, every GEMM form with
 * BF16 and FP8 operands and accumulation, a [128, 4096] x [128, 4096]
 * product where a library could pick split-K, m- and k-grouped GEMMs, router,
 * permute, unpermute, SwiGLU, forward and backward) runs three times into
 * output buffers poisoned differently: twice on one context (cached GEMM
 * plans) and once on a fresh context (plans chosen again), over clean inputs
 * and over inputs full of NaN, +-Inf and overflow-sized values. Every output
 * byte must be equal, GEMMs included: cuBLASLt's algorithm choice and its
 * reductions (split-K with atomics would break this) are part of what is
 * tested, not excused. */
#include "gpu_test.h"

#include "../ops_workload.h"

int main(void)
{
    const char *name = "test_cuda_ops_are_deterministic";
    fm_context *gpu = gt_cuda_context(name);
    const char *env = getenv("FM_TEST_SEED");
    uint64_t seed = env && *env ? strtoull(env, NULL, 0) : 0x5EEDull;
    printf("%s: seed %llu (replay with FM_TEST_SEED=%llu)\n", name, (unsigned long long)seed,
           (unsigned long long)seed);
    for (int nasty = 0; nasty < 2; nasty++) {
        wl_inputs in;
        wl_setup(&in, seed + (uint64_t)nasty, 1, nasty);
        wl_run ref, again, fresh;
        wl_run_all(&ref, gpu, &in, 0x00, 0);
        GT_CHECK(ref.failures == 0, "%s inputs: %d op calls failed (printed above)", nasty ? "nasty" : "clean",
                 ref.failures);
        wl_run_all(&again, gpu, &in, 0xFF, 0);
        fm_context *gpu2 = gt_cuda_context(name);
        wl_run_all(&fresh, gpu2, &in, 0xA5, 0);
        fm_context_destroy(gpu2);
        char label[64];
        snprintf(label, sizeof label, "%s inputs, second run", nasty ? "nasty" : "clean");
        int bad = wl_diff(&ref, &again, 0, label);
        GT_CHECK(bad == 0, "%s: %d of %d outputs differ (printed above)", label, bad, ref.nblob);
        snprintf(label, sizeof label, "%s inputs, fresh context", nasty ? "nasty" : "clean");
        bad = wl_diff(&ref, &fresh, 0, label);
        GT_CHECK(bad == 0, "%s: %d of %d outputs differ (printed above)", label, bad, ref.nblob);
        int calls, outputs;
        wl_count(&ref, &calls, &outputs);
        printf("%s: %s inputs: %d op calls, %d outputs compared over 3 runs\n", name, nasty ? "nasty" : "clean", calls,
               outputs);
        wl_run_free(&ref);
        wl_run_free(&again);
        wl_run_free(&fresh);
        wl_inputs_free(&in);
    }
    fm_context_destroy(gpu);
    return gt_finish(name);
}
