/* Buffers not aligned to their elements are refused with a status and a
 * sentence; buffers aligned to their elements but not to 16 bytes, and odd
 * shapes, work (a slower path) and still match the CPU bit for bit. */
#include "gpu_test.h"

int main(void)
{
    const char *name = "test_cuda_rejects_misaligned_buffers";
    fm_context *g = gt_cuda_context(name), *c = gt_cpu_context();
    const int64_t R = 130, C = 200;
    char *din, *dcodes, *dscale, *dmisc;
    GT_CUDA(cudaMalloc((void **)&din, R * C * 4 + 64));
    GT_CUDA(cudaMalloc((void **)&dcodes, R * C + 64));
    GT_CUDA(cudaMalloc((void **)&dscale, R * 2 * 4 + 64));
    GT_CUDA(cudaMalloc((void **)&dmisc, 64));
    GT_CUDA(cudaMemset(din, 0x3C, R * C * 4 + 64));
    fm_quant_config q = {0};
    fm_tensor in = fm_tensor_2d(din, FM_DTYPE_F32, R, C);
    in.device = FM_DEVICE_CUDA;
    fm_tensor out = fm_tensor_quant_2d(dcodes, FM_DTYPE_E4M3, R, C, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, dscale,
                                       FM_SCALE_LAYOUT_COMPACT);
    out.device = FM_DEVICE_CUDA;

    struct {
        const char *what, *needle;
        int field;
        int off;
    } bad[] = {{"F32 input 2 bytes off", "in", 0, 2},
               {"F32 scale 1 byte off", "scale", 1, 1},
               {"amax 2 bytes off", "cfg->amax", 2, 2},
               {"nonfinite count 4 bytes off", "cfg->nonfinite_blocks", 3, 4}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fm_tensor ti = in, to = out;
        fm_quant_config qc = q;
        if (bad[i].field == 0)
            ti.data = din + bad[i].off;
        if (bad[i].field == 1)
            to.scale = dscale + bad[i].off;
        if (bad[i].field == 2)
            qc.amax = (float *)(dmisc + bad[i].off);
        if (bad[i].field == 3)
            qc.nonfinite_blocks = (int64_t *)(dmisc + 16 + bad[i].off);
        fm_status st = fm_quantize(g, &qc, &ti, &to, NULL);
        const char *msg = fm_last_error(g);
        GT_CHECK(st == FM_ERR_INVALID_ARG, "%s: status %s", bad[i].what, fm_status_name(st));
        GT_CHECK(strstr(msg, bad[i].needle) && strstr(msg, "align"), "%s: sentence \"%s\"", bad[i].what, msg);
        printf("  %-30s -> %s: %s\n", bad[i].what, fm_status_name(st), msg);
    }

    /* Element-aligned but not 16-byte aligned: accepted, and exact. */
    fm_tensor ti = in, to = out;
    ti.data = din + 4;
    to.data = dcodes + 1;
    to.scale = dscale + 4;
    GT_CHECK(fm_quantize(g, &q, &ti, &to, NULL) == FM_OK, "offset buffers: %s", fm_last_error(g));
    float *hin = malloc(R * C * 4);
    unsigned char *hc = malloc(R * C), *gc = malloc(R * C);
    float *hs = malloc(R * 2 * 4), *gs = malloc(R * 2 * 4);
    GT_CUDA(cudaMemcpy(hin, din + 4, R * C * 4, cudaMemcpyDeviceToHost));
    fm_tensor hi = fm_tensor_2d(hin, FM_DTYPE_F32, R, C);
    fm_tensor ho = fm_tensor_quant_2d(hc, FM_DTYPE_E4M3, R, C, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, hs,
                                      FM_SCALE_LAYOUT_COMPACT);
    GT_CHECK(fm_quantize(c, &q, &hi, &ho, NULL) == FM_OK, "cpu: %s", fm_last_error(c));
    GT_CUDA(cudaMemcpy(gc, dcodes + 1, R * C, cudaMemcpyDeviceToHost));
    GT_CUDA(cudaMemcpy(gs, dscale + 4, R * 2 * 4, cudaMemcpyDeviceToHost));
    GT_CHECK(!memcmp(hc, gc, R * C) && !memcmp(hs, gs, R * 2 * 4), "offset buffers: result differs from the CPU");
    free(hin);
    free(hc);
    free(gc);
    free(hs);
    free(gs);
    cudaFree(din);
    cudaFree(dcodes);
    cudaFree(dscale);
    cudaFree(dmisc);
    fm_context_destroy(c);
    fm_context_destroy(g);
    return gt_finish(name);
}
