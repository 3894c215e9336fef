/* The context statistics count casts, bytes and calls on CUDA as on CPU. */
#include "gpu_test.h"

int main(void)
{
    const char *name = "test_cuda_stats_count_casts";
    fm_context *ctx[2] = {gt_cuda_context(name), gt_cpu_context()};
    fm_stats st[2];
    const int64_t R = 128, C = 256;
    for (int k = 0; k < 2; k++) {
        void *in, *codes, *scale, *out;
        if (k == 0) {
            GT_CUDA(cudaMalloc(&in, R * C * 2));
            GT_CUDA(cudaMalloc(&codes, R * C));
            GT_CUDA(cudaMalloc(&scale, R * 2 * 4));
            GT_CUDA(cudaMalloc(&out, R * C * 4));
            GT_CUDA(cudaMemset(in, 0x3F, R * C * 2));
        } else {
            in = malloc(R * C * 2);
            memset(in, 0x3F, R * C * 2);
            codes = malloc(R * C);
            scale = malloc(R * 2 * 4);
            out = malloc(R * C * 4);
        }
        fm_device dev = k == 0 ? FM_DEVICE_CUDA : FM_DEVICE_HOST;
        fm_tensor ti = fm_tensor_2d(in, FM_DTYPE_BF16, R, C);
        ti.device = dev;
        fm_tensor tq = fm_tensor_quant_2d(codes, FM_DTYPE_E4M3, R, C, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, scale,
                                          FM_SCALE_LAYOUT_COMPACT);
        tq.device = dev;
        fm_tensor to = fm_tensor_2d(out, FM_DTYPE_F32, R, C);
        to.device = dev;
        fm_quant_config q = {0};
        fm_stats_reset(ctx[k]);
        GT_CHECK(fm_quantize(ctx[k], &q, &ti, &tq, NULL) == FM_OK, "%s", fm_last_error(ctx[k]));
        GT_CHECK(fm_quantize(ctx[k], &q, &ti, &tq, NULL) == FM_OK, "%s", fm_last_error(ctx[k]));
        GT_CHECK(fm_dequantize(ctx[k], &tq, &to) == FM_OK, "%s", fm_last_error(ctx[k]));
        fm_context_synchronize(ctx[k]);
        fm_stats_get(ctx[k], &st[k]);
        if (k == 0) {
            cudaFree(in);
            cudaFree(codes);
            cudaFree(scale);
            cudaFree(out);
        } else {
            free(in);
            free(codes);
            free(scale);
            free(out);
        }
    }
    GT_CHECK(st[0].casts_to_low == 2 && st[0].casts_to_high == 1, "CUDA casts %lld / %lld, want 2 / 1",
             (long long)st[0].casts_to_low, (long long)st[0].casts_to_high);
    GT_CHECK(st[0].casts_to_low == st[1].casts_to_low && st[0].casts_to_high == st[1].casts_to_high &&
                 st[0].bytes_read == st[1].bytes_read && st[0].bytes_written == st[1].bytes_written &&
                 st[0].op_calls == st[1].op_calls,
             "CUDA and CPU statistics differ");
    fm_context_destroy(ctx[0]);
    fm_context_destroy(ctx[1]);
    return gt_finish(name);
}
