/* Memory in the wrong place is refused with a status and a sentence naming
 * the argument, before any kernel runs: host pointers given to the CUDA
 * backend (data, scale, amax, count), a descriptor saying HOST on a CUDA
 * context, and device pointers given to the CPU backend. */
#include "gpu_test.h"

static void expect(fm_context *ctx, fm_status st, const char *what, const char *needle)
{
    const char *msg = fm_last_error(ctx);
    GT_CHECK(st == FM_ERR_INVALID_ARG, "%s: status %s (%s)", what, fm_status_name(st), msg);
    GT_CHECK(strstr(msg, needle) != NULL, "%s: sentence \"%s\" does not name %s", what, msg, needle);
    printf("  %-46s -> %s: %s\n", what, fm_status_name(st), msg);
}

int main(void)
{
    const char *name = "test_cuda_rejects_host_pointer";
    fm_context *g = gt_cuda_context(name), *c = gt_cpu_context();
    const int64_t R = 256, C = 256;
    void *din, *dcodes, *dscale, *damax;
    GT_CUDA(cudaMalloc(&din, R * C * 2));
    GT_CUDA(cudaMalloc(&dcodes, R * C));
    GT_CUDA(cudaMalloc(&dscale, R * 2 * 4));
    GT_CUDA(cudaMalloc(&damax, 16));
    GT_CUDA(cudaMemset(din, 0, R * C * 2));
    void *hin = calloc(R * C, 2), *hcodes = calloc(R * C, 1), *hscale = calloc(R * 2, 4);
    float hamax;
    int64_t hnf;

    fm_tensor in = fm_tensor_2d(din, FM_DTYPE_BF16, R, C);
    in.device = FM_DEVICE_CUDA;
    fm_tensor out = fm_tensor_quant_2d(dcodes, FM_DTYPE_E4M3, R, C, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, dscale,
                                       FM_SCALE_LAYOUT_COMPACT);
    out.device = FM_DEVICE_CUDA;
    fm_quant_config q = {0};
    GT_CHECK(fm_quantize(g, &q, &in, &out, NULL) == FM_OK, "the valid call fails: %s", fm_last_error(g));
    GT_CUDA(cudaDeviceSynchronize());

    fm_tensor t = in;
    t.data = hin;
    expect(g, fm_quantize(g, &q, &t, &out, NULL), "CUDA backend, host input data", "in");
    fm_tensor o = out;
    o.data = hcodes;
    expect(g, fm_quantize(g, &q, &in, &o, NULL), "CUDA backend, host output data", "out_rowwise");
    o = out;
    o.scale = hscale;
    expect(g, fm_quantize(g, &q, &in, &o, NULL), "CUDA backend, host output scale", "scale");
    fm_quant_config qa = {.amax = &hamax};
    expect(g, fm_quantize(g, &qa, &in, &out, NULL), "CUDA backend, host amax", "cfg->amax");
    fm_quant_config qn = {.nonfinite_blocks = &hnf};
    expect(g, fm_quantize(g, &qn, &in, &out, NULL), "CUDA backend, host nonfinite count", "cfg->nonfinite_blocks");
    t = in;
    t.device = FM_DEVICE_HOST;
    expect(g, fm_quantize(g, &q, &t, &out, NULL), "CUDA backend, descriptor says HOST", "in");
    fm_tensor deq = fm_tensor_2d(hin, FM_DTYPE_BF16, R, C);
    deq.device = FM_DEVICE_CUDA;
    expect(g, fm_dequantize(g, &out, &deq), "CUDA dequantize into host memory", "out");

    /* The CPU backend given device memory. */
    fm_tensor ch = fm_tensor_2d(din, FM_DTYPE_BF16, R, C);
    fm_tensor co = fm_tensor_quant_2d(hcodes, FM_DTYPE_E4M3, R, C, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, hscale,
                                      FM_SCALE_LAYOUT_COMPACT);
    expect(c, fm_quantize(c, &q, &ch, &co, NULL), "CPU backend, device input data", "in");
    ch.data = hin;
    co.scale = dscale;
    expect(c, fm_quantize(c, &q, &ch, &co, NULL), "CPU backend, device output scale", "scale");
    co.scale = hscale;
    fm_quant_config qd = {.amax = (float *)damax};
    expect(c, fm_quantize(c, &qd, &ch, &co, NULL), "CPU backend, device amax", "cfg->amax");

    cudaFree(din);
    cudaFree(dcodes);
    cudaFree(dscale);
    cudaFree(damax);
    free(hin);
    free(hcodes);
    free(hscale);
    fm_context_destroy(c);
    fm_context_destroy(g);
    return gt_finish(name);
}
