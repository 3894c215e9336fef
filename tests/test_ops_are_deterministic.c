/* Every public op gives the same bits whatever the CPU thread count and
 * whatever the output buffers held before: quantize (every dtype x mode,
 * every rule, both outputs, amax and the non-finite count, 3-D), dequantize,
 * scale layout conversion, cast, quantize_grouped, transpose_scaled and
 * convert_scaled (with their non-finite counts), the grouped transpose, every
 * GEMM form (dense for each scale pair with BF16 and F32 outputs and
 * accumulation, a long K, the linear layer's three GEMMs in FP8 and BF16,
 * m-grouped and k-grouped with empty and one-row experts), the router and
 * its backward, permute, unpermute and its backward, SwiGLU and its backward,
 * and EP dispatch / combine over the in-process communicator (each rank's
 * context with the run's thread count).
 *
 * The workload (ops_workload.h) runs with 1, 2 and 3 worker threads (the
 * work splits at different row boundaries each time), each run into fresh
 * output buffers poisoned with a different byte, over clean inputs holding a
 * few NaN and Inf, and again over inputs full of NaN, +-Inf, NaN payloads,
 * overflow-sized values and subnormals; every output must equal the 1-thread
 * run byte for byte. */
#include "ops_workload.h"
#include "test_util.h"

int main(void)
{
    tu_begin("test_ops_are_deterministic");
    static const int threads[3] = {1, 2, 3};
    static const uint8_t poison[3] = {0x00, 0xFF, 0xA5};
    for (int nasty = 0; nasty < 2; nasty++) {
        wl_inputs in;
        wl_setup(&in, tu_rand(), 0, nasty);
        wl_run ref;
        fm_context *ctx = tu_cpu_context(threads[0]);
        wl_run_all(&ref, ctx, &in, poison[0], threads[0]);
        fm_context_destroy(ctx);
        CHECK(ref.failures == 0, "%s inputs: %d op calls failed with 1 thread (printed above)",
              nasty ? "nasty" : "clean", ref.failures);
        CHECK(ref.nblob > 300, "only %d outputs recorded", ref.nblob);
        for (int t = 1; t < 3; t++) {
            wl_run again;
            ctx = tu_cpu_context(threads[t]);
            wl_run_all(&again, ctx, &in, poison[t], threads[t]);
            fm_context_destroy(ctx);
            char label[96];
            snprintf(label, sizeof label, "%s inputs, %d threads against 1", nasty ? "nasty" : "clean", threads[t]);
            int bad = wl_diff(&ref, &again, 0, label);
            CHECK(bad == 0, "%s: %d of %d outputs differ (printed above)", label, bad, ref.nblob);
            tu_checks += again.nblob;
            wl_run_free(&again);
        }
        int calls, outputs;
        wl_count(&ref, &calls, &outputs);
        printf("%s inputs: %d op calls, %d outputs, each the same bytes with 1, 2 and 3 threads\n",
               nasty ? "nasty" : "clean", calls, outputs);
        wl_run_free(&ref);
        wl_inputs_free(&in);
    }
    return tu_end();
}
