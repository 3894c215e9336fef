/* An empty tensor needs no memory: every op accepts a tensor with no
 * elements (a zero dimension, or a 3-D stack of 0 experts) whose data and,
 * where the mode then has no scale entries, scale pointers are NULL. It
 * succeeds, writes its optional counters (amax 0, 0 non-finite blocks), and
 * never forms a pointer from NULL (not even NULL + 0, undefined in C: the
 * UBSan builds of the CI and of tools/fuzz.sh report it). Found by
 * tests/fuzz/fuzz_descriptor_validation. */
#include "test_util.h"

static fm_tensor q2(fm_dtype dt, int64_t r, int64_t c, fm_layout l, fm_scale_mode m, fm_scale_layout sl)
{
    return fm_tensor_quant_2d(NULL, dt, r, c, l, m, NULL, sl);
}

int main(void)
{
    tu_begin("test_empty_tensors_accept_null_buffers");
    fm_context *ctx = tu_cpu_context(2);
    /* logical shapes with no elements, and the 3-D stack of no experts */
    static const int64_t shapes[][3] = {{2, 0, 256}, {2, 256, 0}, {2, 0, 0}, {3, 0, 64}};
    static const fm_scale_mode modes[] = {FM_SCALE_BLOCK_1x128, FM_SCALE_MX32, FM_SCALE_BLOCK_128x128};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (size_t mi = 0; mi < sizeof modes / sizeof modes[0]; mi++)
            for (int sl = 0; sl < 2; sl++) {
                int64_t R = shapes[si][1], C = shapes[si][2];
                fm_scale_mode m = modes[mi];
                fm_dtype dt = m == FM_SCALE_MX32 ? FM_DTYPE_E2M1 : FM_DTYPE_E4M3;
                fm_tensor in = fm_tensor_2d(NULL, FM_DTYPE_F32, R, C);
                fm_tensor row = q2(dt, R, C, FM_LAYOUT_ROWWISE, m, (fm_scale_layout)sl);
                fm_tensor col = q2(dt, R, C, FM_LAYOUT_COLWISE, m, (fm_scale_layout)sl);
                if (shapes[si][0] == 3) { /* [0 experts, R, C] */
                    in = fm_tensor_3d(NULL, FM_DTYPE_F32, 0, R, C);
                    row.ndim = col.ndim = 3;
                    row.shape[0] = col.shape[0] = 0;
                    row.shape[1] = col.shape[1] = R;
                    row.shape[2] = col.shape[2] = C;
                }
                char what[96];
                snprintf(what, sizeof what, "[%s%lld, %lld] %s %s %s", shapes[si][0] == 3 ? "0, " : "", (long long)R,
                         (long long)C, fm_dtype_name(dt), fm_scale_mode_name(m), fm_scale_layout_name(sl));
                CHECK(fm_tensor_numel(&in) == 0 && fm_tensor_scale_count(&row) == 0 &&
                          fm_tensor_scale_count(&col) == 0,
                      "%s: the case is empty and has no scale entries", what);

                float amax = -1.0f;
                int64_t bad = -1;
                fm_quant_config qc = {.amax = &amax, .nonfinite_blocks = &bad};
                fm_status st = fm_quantize(ctx, &qc, &in, &row, m == FM_SCALE_BLOCK_128x128 ? NULL : &col);
                CHECK(st == FM_OK, "%s: fm_quantize: %s \"%s\"", what, fm_status_name(st), fm_last_error(ctx));
                CHECK(amax == 0.0f && bad == 0, "%s: fm_quantize wrote amax %g, nonfinite %lld", what, (double)amax,
                      (long long)bad);

                fm_tensor out = in;
                st = fm_dequantize(ctx, &row, &out);
                CHECK(st == FM_OK, "%s: fm_dequantize: %s \"%s\"", what, fm_status_name(st), fm_last_error(ctx));

                fm_tensor dst = row;
                dst.scale_layout = sl ? FM_SCALE_LAYOUT_COMPACT : FM_SCALE_LAYOUT_GEMM;
                st = fm_scale_layout_convert(ctx, &row, &dst);
                CHECK(st == FM_OK, "%s: fm_scale_layout_convert: %s \"%s\"", what, fm_status_name(st),
                      fm_last_error(ctx));

                bad = -1;
                fm_requant_config rc = {.nonfinite_blocks = &bad};
                st = fm_transpose_scaled(ctx, &rc, &row, &col);
                CHECK(st == FM_OK && bad == 0, "%s: fm_transpose_scaled: %s \"%s\", nonfinite %lld", what,
                      fm_status_name(st), fm_last_error(ctx), (long long)bad);
                if (m != FM_SCALE_BLOCK_128x128) {
                    fm_tensor conv = row;
                    conv.dtype = FM_DTYPE_E5M2;
                    conv.scale_mode = FM_SCALE_BLOCK_1x128;
                    conv.scale_dtype = FM_DTYPE_F32;
                    bad = -1;
                    st = fm_convert_scaled(ctx, &rc, &row, &conv);
                    CHECK(st == FM_OK && bad == 0, "%s: fm_convert_scaled: %s \"%s\", nonfinite %lld", what,
                          fm_status_name(st), fm_last_error(ctx), (long long)bad);
                    /* Per-expert, with empty groups around the rows. */
                    int64_t sizes[3] = {0, R, 0};
                    fm_splits sp = {3, sizes, NULL};
                    if (row.ndim == 2 && (dt != FM_DTYPE_E2M1 || R % 2 == 0)) {
                        bad = -1;
                        st = fm_transpose_scaled_grouped(ctx, &rc, &sp, &row, &col);
                        CHECK(st == FM_OK && bad == 0,
                              "%s: fm_transpose_scaled_grouped: %s \"%s\", nonfinite %lld", what,
                              fm_status_name(st), fm_last_error(ctx), (long long)bad);
                    }
                }
            }
    /* SwiGLU over rows of no columns (I = 0): nothing to compute, but
     * dprobs is the dot of nothing, +0 (fuzz_descriptor_validation found the
     * CPU forming NULL + 0 here). */
    for (int q = 0; q < 2; q++) {
        fm_tensor in = fm_tensor_2d(NULL, FM_DTYPE_F32, 3, 0), dh = in, din = in;
        fm_tensor h = q ? q2(FM_DTYPE_E4M3, 3, 0, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT) : in;
        float p[3] = {0.5f, 1.0f, 2.0f}, dp[3] = {-1.0f, -1.0f, -1.0f};
        fm_tensor tp = fm_tensor_2d(p, FM_DTYPE_F32, 3, 1), tdp = fm_tensor_2d(dp, FM_DTYPE_F32, 3, 1);
        fm_status st = fm_moe_swiglu(ctx, NULL, &in, &tp, &h, NULL, NULL);
        CHECK(st == FM_OK, "fm_moe_swiglu [3, 0] -> %s: %s \"%s\"", q ? "E4M3" : "F32", fm_status_name(st),
              fm_last_error(ctx));
        if (q)
            din = q2(FM_DTYPE_E4M3, 3, 0, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT);
        st = fm_moe_swiglu_backward(ctx, NULL, &dh, &in, &tp, &din, NULL, &tdp);
        CHECK(st == FM_OK, "fm_moe_swiglu_backward [3, 0]: %s \"%s\"", fm_status_name(st), fm_last_error(ctx));
        for (int i = 0; i < 3; i++)
            CHECK_EQ_U(tu_f32_bits(dp[i]), 0u, "fm_moe_swiglu_backward [3, 0]: dprobs[%d]", i);
    }
    /* Grouped GEMMs over experts of no rows, every operand without a buffer
     * but dw (fuzz_descriptor_validation found the CPU offsetting a NULL B by
     * each expert's zero bytes): nothing read, dW of an empty expert is 0. */
    {
        int64_t sizes[2] = {0, 0};
        fm_splits sp = {2, sizes, NULL};
        fm_tensor a = fm_tensor_2d(NULL, FM_DTYPE_F32, 0, 0), b = fm_tensor_3d(NULL, FM_DTYPE_F32, 2, 0, 0);
        fm_tensor d = fm_tensor_2d(NULL, FM_DTYPE_F32, 0, 0);
        fm_status st = fm_grouped_gemm(ctx, NULL, &sp, &a, &b, &d);
        CHECK(st == FM_OK, "fm_grouped_gemm [0, 0] x [2, 0, 0]: %s \"%s\"", fm_status_name(st), fm_last_error(ctx));
        float w[2 * 5 * 3];
        for (int i = 0; i < 30; i++)
            w[i] = -1.0f;
        fm_tensor dy = fm_tensor_2d(NULL, FM_DTYPE_F32, 0, 5), x = fm_tensor_2d(NULL, FM_DTYPE_F32, 0, 3);
        fm_tensor dw = fm_tensor_3d(w, FM_DTYPE_F32, 2, 5, 3);
        st = fm_grouped_gemm_wgrad(ctx, NULL, &sp, &dy, &x, &dw);
        CHECK(st == FM_OK, "fm_grouped_gemm_wgrad over empty experts: %s \"%s\"", fm_status_name(st),
              fm_last_error(ctx));
        for (int i = 0; i < 30; i++)
            CHECK_EQ_U(tu_f32_bits(w[i]), 0u, "fm_grouped_gemm_wgrad over empty experts: dw[%d]", i);
    }
    fm_context_destroy(ctx);
    return tu_end();
}
