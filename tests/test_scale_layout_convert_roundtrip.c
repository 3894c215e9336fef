/* Compact and GEMM-ready scale layouts hold the same scales:
 *  - fm_scale_layout_convert(compact -> GEMM) equals quantizing straight into
 *    the GEMM layout, byte for byte, padding included; GEMM -> compact gives
 *    back the compact array; compact -> compact and GEMM -> GEMM copy;
 *  - every GEMM entry that no block owns is 1.0 (E8M0 127);
 *  - the conversion copies entries as bits (NaN scales of non-finite blocks
 *    and arbitrary bit patterns survive), writes every byte of dst (two
 *    poisons) and nothing past it, and leaves the data and src untouched. */
#include "test_util.h"

static const fm_scale_mode modes[5] = {FM_SCALE_TENSOR, FM_SCALE_ROW, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128,
                                       FM_SCALE_MX32};

static void convert_check(fm_context *ctx, tu_qout *src, tu_qout *dst, const void *want, const char *what)
{
    uint8_t *before = malloc(src->scale.n + 1), *data_before = malloc(dst->data.n + 1);
    memcpy(before, src->scale.p, src->scale.n);
    memcpy(data_before, dst->data.p, dst->data.n);
    const uint8_t poisons[2] = {0xA5, 0x5A};
    for (int pi = 0; pi < 2; pi++) {
        tu_buf_poison(&dst->scale, poisons[pi]);
        fm_status st = fm_scale_layout_convert(ctx, &src->t, &dst->t);
        CHECK(st == FM_OK, "%s: %s", what, fm_last_error(ctx));
        CHECK(strcmp(fm_last_error(ctx), "") == 0, "%s: last error after success", what);
        tu_same_bytes(dst->scale.p, want, dst->scale.n, "converted scales", what);
        CHECK(tu_buf_guard_ok(&dst->scale), "%s: wrote past dst->scale", what);
    }
    tu_same_bytes(src->scale.p, before, src->scale.n, "src scales untouched", what);
    tu_same_bytes(dst->data.p, data_before, dst->data.n, "dst data untouched", what);
    free(before);
    free(data_before);
}

int main(void)
{
    tu_begin("test_scale_layout_convert_roundtrip");
    fm_context *ctx = tu_cpu_context(2);
    const int64_t shapes[][3] = {{1, 1, 32}, {1, 5, 70}, {1, 129, 257}, {1, 200, 520}, {3, 33, 130}, {2, 130, 2}, {2, 0, 4}, {1, 6, 0}};
    char cs[200];
    for (int mi = 0; mi < 5; mi++)
        for (int dt = 0; dt < 2; dt++)
            for (int lay = 0; lay < 2; lay++)
                for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
                    fm_dtype d = dt ? (modes[mi] == FM_SCALE_MX32 ? FM_DTYPE_E2M1 : FM_DTYPE_E5M2) : FM_DTYPE_E4M3;
                    int64_t E = shapes[si][0], rows = shapes[si][1], cols = shapes[si][2], n = E * rows * cols;
                    int ndim = E > 1 || !rows || !cols ? 3 : 2;
                    if (d == FM_DTYPE_E2M1 && (lay ? rows : cols) % 2)
                        continue; /* E2M1 stored rows must be even (validation test covers it) */
                    snprintf(cs, sizeof cs, "%s %s %s [%lld,%lld,%lld]", fm_dtype_name(d), fm_scale_mode_name(modes[mi]),
                             lay ? "colwise" : "rowwise", (long long)E, (long long)rows, (long long)cols);
                    ref_spec sc = {d, modes[mi], (fm_layout)lay, FM_SCALE_LAYOUT_COMPACT};
                    ref_spec sg = {d, modes[mi], (fm_layout)lay, FM_SCALE_LAYOUT_GEMM};
                    float *x = malloc(sizeof(float) * (size_t)(n + 1));
                    tu_fill(x, n, cols, si % 2 ? TD_NONFINITE : TD_RANDOM);
                    fm_tensor tin = tu_input(x, FM_DTYPE_F32, ndim, E, rows, cols);
                    tu_qout qc, qg, conv_g, conv_c;
                    tu_qout_init(&qc, &sc, ndim, E, rows, cols);
                    tu_qout_init(&qg, &sg, ndim, E, rows, cols);
                    tu_qout_init(&conv_g, &sg, ndim, E, rows, cols);
                    tu_qout_init(&conv_c, &sc, ndim, E, rows, cols);
                    fm_tensor *o1 = lay ? NULL : &qc.t, *o2 = lay ? &qc.t : NULL;
                    CHECK(fm_quantize(ctx, NULL, &tin, o1, o2) == FM_OK, "%s: %s", cs, fm_last_error(ctx));
                    o1 = lay ? NULL : &qg.t, o2 = lay ? &qg.t : NULL;
                    CHECK(fm_quantize(ctx, NULL, &tin, o1, o2) == FM_OK, "%s: %s", cs, fm_last_error(ctx));
                    tu_same_bytes(qc.data.p, qg.data.p, qc.data.n, "codes", cs);

                    char c2[260];
                    snprintf(c2, sizeof c2, "%s compact -> GEMM", cs);
                    convert_check(ctx, &qc, &conv_g, qg.scale.p, c2);
                    snprintf(c2, sizeof c2, "%s GEMM -> compact", cs);
                    convert_check(ctx, &qg, &conv_c, qc.scale.p, c2);
                    snprintf(c2, sizeof c2, "%s compact -> compact", cs);
                    convert_check(ctx, &qc, &conv_c, qc.scale.p, c2);
                    snprintf(c2, sizeof c2, "%s GEMM -> GEMM", cs);
                    convert_check(ctx, &qg, &conv_g, qg.scale.p, c2);

                    /* padding entries: the GEMM entries no block owns are 1 */
                    int64_t R = ref_stored_rows(&sg, rows, cols), C = ref_stored_cols(&sg, rows, cols);
                    int64_t per = ref_scale_count(modes[mi], FM_SCALE_LAYOUT_GEMM, R, C);
                    uint8_t *owned = calloc((size_t)(per + 1), 1);
                    for (int64_t r = 0; r < R; r++)
                        for (int64_t c = 0; c < C; c++)
                            owned[ref_scale_offset(modes[mi], FM_SCALE_LAYOUT_GEMM, R, C, r, c)] = 1;
                    if (modes[mi] == FM_SCALE_TENSOR || (modes[mi] == FM_SCALE_ROW && R))
                        for (int64_t k = 0; k < per; k++)
                            owned[k] = 1; /* empty matrices still own their TENSOR / ROW scales */
                    long pads = 0;
                    for (int64_t e = 0; e < E; e++)
                        for (int64_t k = 0; k < per; k++)
                            if (!owned[k]) {
                                pads++;
                                if (modes[mi] == FM_SCALE_MX32)
                                    CHECK(qg.scale.p[e * per + k] == 127, "%s: E8M0 padding entry %lld", cs, (long long)k);
                                else
                                    CHECK(((float *)qg.scale.p)[e * per + k] == 1.0f, "%s: F32 padding entry %lld", cs,
                                          (long long)k);
                            }
                    free(owned);

                    /* bits, not values: random scale bytes round trip through GEMM */
                    for (size_t b = 0; b < qc.scale.n; b++)
                        qc.scale.p[b] = (uint8_t)tu_rand32();
                    CHECK(fm_scale_layout_convert(ctx, &qc.t, &conv_g.t) == FM_OK, "%s random bits", cs);
                    CHECK(fm_scale_layout_convert(ctx, &conv_g.t, &conv_c.t) == FM_OK, "%s random bits back", cs);
                    tu_same_bytes(conv_c.scale.p, qc.scale.p, qc.scale.n, "random scale bits round trip", cs);

                    tu_qout_free(&qc);
                    tu_qout_free(&qg);
                    tu_qout_free(&conv_g);
                    tu_qout_free(&conv_c);
                    free(x);
                }
    /* scales only: data may be NULL */
    {
        float s1[4] = {1, 2, 4, 8}, s2[4];
        fm_tensor a = fm_tensor_quant_2d(NULL, FM_DTYPE_E4M3, 4, 128, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, s1,
                                         FM_SCALE_LAYOUT_COMPACT);
        fm_tensor b = fm_tensor_quant_2d(NULL, FM_DTYPE_E4M3, 4, 128, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, s2,
                                         FM_SCALE_LAYOUT_GEMM);
        CHECK(fm_scale_layout_convert(ctx, &a, &b) == FM_OK, "NULL data: %s", fm_last_error(ctx));
        CHECK(memcmp(s1, s2, sizeof s1) == 0, "4 x 128 1x128 GEMM == compact");
    }
    fm_context_destroy(ctx);
    return tu_end();
}
