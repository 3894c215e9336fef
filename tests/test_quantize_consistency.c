/* Outputs that must agree with each other bit for bit:
 *  - the column-wise output of X equals the row-wise quantization of the
 *    explicitly transposed X (data and scales, both scale layouts);
 *  - a 3-D [E, rows, cols] input equals E separate 2-D quantizations (codes,
 *    scales, amax, nonfinite_blocks);
 *  - BF16 and F16 inputs equal the F32 input holding the same values;
 *  - the CPU thread count changes nothing;
 *  - epsilon floors amax (zero blocks take the scale of epsilon; an epsilon
 *    below every amax changes nothing);
 *  - E2M1 packs element 2j in the low nibble (OCP E2M1 code table). */
#include <math.h>

#include "test_util.h"

static fm_status quant(fm_context *ctx, fm_scale_rule rule, float eps, fm_tensor *in, tu_qout *row, tu_qout *col,
                       float *amax, int64_t *nf)
{
    fm_quant_config cfg = {.rule = rule, .epsilon = eps, .amax = amax, .nonfinite_blocks = nf};
    return fm_quantize(ctx, &cfg, in, row ? &row->t : NULL, col ? &col->t : NULL);
}

static int same_out(const tu_qout *a, const tu_qout *b, const char *what)
{
    int ok = tu_same_bytes(a->data.p, b->data.p, a->data.n < b->data.n ? a->data.n : b->data.n, "codes", what);
    CHECK(a->data.n == b->data.n && a->scale.n == b->scale.n, "%s: sizes", what);
    ok &= tu_same_bytes(a->scale.p, b->scale.p, a->scale.n < b->scale.n ? a->scale.n : b->scale.n, "scales", what);
    return ok;
}

int main(void)
{
    tu_begin("test_quantize_consistency");
    fm_context *ctx = tu_cpu_context(1), *ctx4 = tu_cpu_context(4);
    const int64_t shapes[][3] = {{1, 130, 258}, {1, 2, 64}, {1, 64, 2}, {1, 256, 34}, {4, 36, 130}, {3, 0, 8}, {2, 8, 0}};
    const int kinds[] = {TD_RANDOM, TD_NONFINITE, TD_SUBNORMAL, TD_TIES, TD_WIDE};
    char cs[200];
    long counter = 0;
    for (size_t ci = 0; ci < tu_ncombos; ci++)
        for (int sl = 0; sl < 2; sl++)
            for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++, counter++) {
                const tu_combo *cb = &tu_combos[ci];
                int64_t E = shapes[si][0], rows = shapes[si][1], cols = shapes[si][2], n = E * rows * cols;
                int ndim = E > 1 || rows == 0 || cols == 0 ? 3 : 2;
                int kind = kinds[counter % 5];
                fm_scale_rule rule = counter % 3 == 2 ? (cb->m == FM_SCALE_MX32 ? FM_SCALE_RULE_MX_FLOOR : FM_SCALE_RULE_POW2)
                                                      : FM_SCALE_RULE_DEFAULT;
                snprintf(cs, sizeof cs, "%s %s %s %s [%lld,%lld,%lld] %s", fm_dtype_name(cb->dt),
                         fm_scale_mode_name(cb->m), fm_scale_layout_name((fm_scale_layout)sl), tu_rule_name(rule),
                         (long long)E, (long long)rows, (long long)cols, tu_data_name(kind));
                float *x = malloc(sizeof(float) * (size_t)(n + 1)), *xt = malloc(sizeof(float) * (size_t)(n + 1));
                tu_fill(x, n, cols, kind);
                for (int64_t e = 0; e < E; e++)
                    for (int64_t i = 0; i < rows; i++)
                        for (int64_t j = 0; j < cols; j++)
                            xt[(e * cols + j) * rows + i] = x[(e * rows + i) * cols + j];
                fm_tensor tin = tu_input(x, FM_DTYPE_F32, ndim, E, rows, cols);
                fm_tensor tint = tu_input(xt, FM_DTYPE_F32, ndim, E, cols, rows);
                ref_spec rs = {cb->dt, cb->m, FM_LAYOUT_ROWWISE, (fm_scale_layout)sl};
                ref_spec cs_ = {cb->dt, cb->m, FM_LAYOUT_COLWISE, (fm_scale_layout)sl};
                tu_qout row, col, rowT, row4, col4;
                tu_qout_init(&row, &rs, ndim, E, rows, cols);
                tu_qout_init(&col, &cs_, ndim, E, rows, cols);
                tu_qout_init(&rowT, &rs, ndim, E, cols, rows);
                tu_qout_init(&row4, &rs, ndim, E, rows, cols);
                tu_qout_init(&col4, &cs_, ndim, E, rows, cols);
                float amax, amax4;
                int64_t nf, nf4;
                CHECK(quant(ctx, rule, 0, &tin, &row, &col, &amax, &nf) == FM_OK, "%s: %s", cs, fm_last_error(ctx));
                /* column-wise == row-wise of the transpose */
                CHECK(quant(ctx, rule, 0, &tint, &rowT, NULL, NULL, NULL) == FM_OK, "%s: %s", cs, fm_last_error(ctx));
                char c2[260];
                snprintf(c2, sizeof c2, "%s: colwise vs rowwise of transpose", cs);
                same_out(&col, &rowT, c2);
                /* thread count */
                CHECK(quant(ctx4, rule, 0, &tin, &row4, &col4, &amax4, &nf4) == FM_OK, "%s", cs);
                snprintf(c2, sizeof c2, "%s: 4 threads vs 1", cs);
                same_out(&row, &row4, c2);
                same_out(&col, &col4, c2);
                CHECK(tu_f32_bits(amax) == tu_f32_bits(amax4) && nf == nf4, "%s: amax/nonfinite vs threads", cs);

                /* 3-D == per-expert 2-D */
                if (ndim == 3 && rows && cols) {
                    float amax_e, amax_max = 0;
                    int64_t nf_e, nf_sum = 0;
                    int any_nan = 0;
                    for (int64_t e = 0; e < E; e++) {
                        tu_qout r2, c2o;
                        tu_qout_init(&r2, &rs, 2, 1, rows, cols);
                        tu_qout_init(&c2o, &cs_, 2, 1, rows, cols);
                        fm_tensor t2 = fm_tensor_2d(x + e * rows * cols, FM_DTYPE_F32, rows, cols);
                        CHECK(quant(ctx, rule, 0, &t2, &r2, &c2o, &amax_e, &nf_e) == FM_OK, "%s", cs);
                        snprintf(c2, sizeof c2, "%s: expert %lld vs 2-D", cs, (long long)e);
                        tu_same_bytes(r2.data.p, row.data.p + e * r2.data.n, r2.data.n, "row codes", c2);
                        tu_same_bytes(r2.scale.p, row.scale.p + e * r2.scale.n, r2.scale.n, "row scales", c2);
                        tu_same_bytes(c2o.data.p, col.data.p + e * c2o.data.n, c2o.data.n, "col codes", c2);
                        tu_same_bytes(c2o.scale.p, col.scale.p + e * c2o.scale.n, c2o.scale.n, "col scales", c2);
                        if (amax_e != amax_e)
                            any_nan = 1;
                        else if (amax_e > amax_max)
                            amax_max = amax_e;
                        nf_sum += nf_e;
                        tu_qout_free(&r2);
                        tu_qout_free(&c2o);
                    }
                    CHECK(nf == nf_sum, "%s: 3-D nonfinite %lld, sum of experts %lld", cs, (long long)nf, (long long)nf_sum);
                    CHECK(any_nan ? tu_f32_bits(amax) == 0x7FC00000u : amax == amax_max, "%s: 3-D amax %a", cs,
                          (double)amax);
                }

                /* BF16 / F16 inputs == F32 holding the same values */
                for (int d = 0; d < 2; d++) {
                    fm_dtype dt = d ? FM_DTYPE_F16 : FM_DTYPE_BF16;
                    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(n + 1));
                    float *xr = malloc(sizeof(float) * (size_t)(n + 1));
                    tu_store_input(x, n, dt, h, xr);
                    fm_tensor th = tu_input(h, dt, ndim, E, rows, cols), tf = tu_input(xr, FM_DTYPE_F32, ndim, E, rows, cols);
                    float a1, a2;
                    int64_t n1, n2;
                    CHECK(quant(ctx, rule, 0, &th, &row4, &col4, &a1, &n1) == FM_OK, "%s %s", cs, fm_dtype_name(dt));
                    CHECK(quant(ctx, rule, 0, &tf, &row, &col, &a2, &n2) == FM_OK, "%s", cs);
                    snprintf(c2, sizeof c2, "%s: %s input vs F32 of its values", cs, fm_dtype_name(dt));
                    same_out(&row4, &row, c2);
                    same_out(&col4, &col, c2);
                    CHECK(tu_f32_bits(a1) == tu_f32_bits(a2) && n1 == n2, "%s: amax/nonfinite", c2);
                    free(h);
                    free(xr);
                }
                tu_qout_free(&row);
                tu_qout_free(&col);
                tu_qout_free(&rowT);
                tu_qout_free(&row4);
                tu_qout_free(&col4);
                free(x);
                free(xt);
            }

    /* epsilon: an all-zero block takes the power-of-two scale of epsilon;
     * epsilon below the amax changes nothing */
    {
        float z[2 * 64] = {0};
        for (int j = 64; j < 128; j++)
            z[j] = (float)(j - 90) * 0.25f; /* second row: amax 9.25 */
        fm_tensor tz = fm_tensor_2d(z, FM_DTYPE_F32, 2, 64);
        ref_spec s = {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT};
        tu_qout a, b;
        tu_qout_init(&a, &s, 2, 1, 2, 64);
        tu_qout_init(&b, &s, 2, 1, 2, 64);
        CHECK(quant(ctx, FM_SCALE_RULE_DEFAULT, 3.0f, &tz, &a, NULL, NULL, NULL) == FM_OK, "eps quantize");
        float *sc = (float *)a.scale.p;
        CHECK(sc[0] == ldexpf(1.0f, or_pow2_exp(3.0, 448.0)), "zero row with eps 3: scale %a", (double)sc[0]);
        CHECK(sc[1] == ldexpf(1.0f, or_pow2_exp(9.25, 448.0)), "row amax 9.25 > eps 3 keeps its scale %a", (double)sc[1]);
        CHECK(quant(ctx, FM_SCALE_RULE_DEFAULT, 0.0f, &tz, &b, NULL, NULL, NULL) == FM_OK, "no-eps quantize");
        CHECK(((float *)b.scale.p)[0] == 1.0f, "amax 0 without epsilon: scale 1");
        tu_same_bytes(a.data.p + 64, b.data.p + 64, 64, "codes", "eps below amax changes nothing");
        tu_qout_free(&a);
        tu_qout_free(&b);
    }

    /* E2M1 packing, element 2j in the low nibble: OCP E2M1 codes of
     * 0.5 1 1.5 2 3 4 6 -0.5 are 1 2 3 4 5 6 7 9; the block amax 6 gives scale 1 */
    {
        float v[64] = {0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.5f, -6.0f, 0.0f, -0.0f, 0.25f};
        fm_tensor tv = fm_tensor_2d(v, FM_DTYPE_F32, 2, 32);
        ref_spec s = {FM_DTYPE_E2M1, FM_SCALE_MX32, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT};
        tu_qout a;
        tu_qout_init(&a, &s, 2, 1, 2, 32);
        CHECK(quant(ctx, FM_SCALE_RULE_DEFAULT, 0, &tv, &a, NULL, NULL, NULL) == FM_OK, "E2M1 quantize");
        const uint8_t want[6] = {0x21, 0x43, 0x65, 0x97, 0x0F, 0x08};
        tu_same_bytes(a.data.p, want, 6, "E2M1 bytes", "packing: element 2j in the low nibble");
        CHECK(a.scale.p[0] == 127 && a.scale.p[1] == 127, "E2M1 scales: amax 6 -> 2^0, amax 0 -> 2^0");
        tu_qout_free(&a);
    }
    fm_context_destroy(ctx);
    fm_context_destroy(ctx4);
    return tu_end();
}
