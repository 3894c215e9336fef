/* fm_quantize equals the reference quantizer bit for bit, for every mode x
 * element dtype x scale rule x scale layout, row-wise and column-wise outputs
 * (alone or fused), F32/BF16/F16 inputs, 2-D and 3-D, odd and empty shapes,
 * and nasty data (zeros, subnormals, max magnitudes, wide exponent spread,
 * NaN/Inf, exact ties), with and without epsilon.
 *
 * The reference (test_util.c) computes each block's scale by its rule's
 * definition and each code by nearest-value search; E2M1 packs element 2j in
 * the low nibble. Every output byte is poisoned with two different patterns
 * on two runs and must come out as the reference says both times (so every
 * byte is written), nothing is written past the buffers, the amax output is
 * max |x| (canonical NaN if any NaN, else Inf if any Inf), nonfinite_blocks
 * is the count over both outputs, and fm_last_error is "" after success. */
#include <float.h>
#include <math.h>

#include "test_util.h"

typedef struct {
    int ndim;
    int64_t E, rows, cols;
} shape;

static const shape shapes[] = {
    {2, 1, 1, 1}, {2, 1, 1, 256}, {2, 1, 2, 2}, {2, 1, 64, 1}, {2, 1, 129, 257}, {2, 1, 257, 130},
    {2, 1, 130, 258}, {2, 1, 3, 33}, {2, 1, 128, 128}, {2, 1, 0, 64}, {2, 1, 64, 0}, {2, 1, 0, 0},
    {3, 3, 40, 70}, {3, 2, 130, 66}, {3, 0, 4, 4}, {3, 2, 0, 6}, {3, 2, 6, 0}, {2, 1, 34, 160},
};

static long n_calls, n_elems;

static void run_case(fm_context *ctx, const tu_combo *cb, fm_scale_rule rule, fm_scale_layout sl, const shape *sh,
                     int kind, fm_dtype in_dt, float eps, int want_row, int want_col)
{
    int64_t n = sh->E * sh->rows * sh->cols;
    float *x = malloc(sizeof(float) * (size_t)(n ? n : 1));
    float *xr = malloc(sizeof(float) * (size_t)(n ? n : 1));
    tu_buf in = tu_buf_new((size_t)(n ? n : 1) * 4);
    tu_fill(x, n, sh->cols, kind);
    tu_store_input(x, n, in_dt, in.p, xr);
    fm_tensor tin = tu_input(in.p, in_dt, sh->ndim, sh->E, sh->rows, sh->cols);

    char ctxs[256];
    snprintf(ctxs, sizeof ctxs, "%s %s rule %s %s in %s shape %dD [%lld,%lld,%lld] data %s eps %g out %s%s",
             fm_dtype_name(cb->dt), fm_scale_mode_name(cb->m), tu_rule_name(rule), fm_scale_layout_name(sl),
             fm_dtype_name(in_dt), sh->ndim, (long long)sh->E, (long long)sh->rows, (long long)sh->cols,
             tu_data_name(kind), (double)eps, want_row ? "row" : "", want_col ? "col" : "");

    tu_qout o[2];
    uint8_t *rc[2] = {NULL, NULL};
    void *rs[2] = {NULL, NULL};
    int64_t bad = 0;
    int use[2] = {want_row, want_col};
    for (int k = 0; k < 2; k++) {
        if (!use[k])
            continue;
        ref_spec s = {cb->dt, cb->m, k ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE, sl};
        tu_qout_init(&o[k], &s, sh->ndim, sh->E, sh->rows, sh->cols);
        rc[k] = malloc((size_t)o[k].data.n + 1);
        rs[k] = malloc((size_t)o[k].scale.n + 4);
        bad += ref_quantize(xr, sh->E, sh->rows, sh->cols, rule, eps, &s, rc[k], rs[k]);
    }
    /* expected amax */
    uint32_t amax_want = 0;
    int any_nan = 0;
    for (int64_t i = 0; i < n; i++) {
        if (xr[i] != xr[i])
            any_nan = 1;
        else if (tu_f32_bits(fabsf(xr[i])) > amax_want)
            amax_want = tu_f32_bits(fabsf(xr[i]));
    }
    if (any_nan)
        amax_want = 0x7FC00000u;

    const uint8_t poisons[2] = {0xA5, 0x5A};
    for (int pi = 0; pi < 2; pi++) {
        for (int k = 0; k < 2; k++)
            if (use[k])
                tu_qout_poison(&o[k], poisons[pi]);
        float amax;
        int64_t nonfinite;
        memset(&amax, poisons[pi], sizeof amax);
        memset(&nonfinite, poisons[pi], sizeof nonfinite);
        fm_quant_config cfg = {.rule = rule, .epsilon = eps, .amax = &amax, .nonfinite_blocks = &nonfinite};
        fm_status st = fm_quantize(ctx, &cfg, &tin, use[0] ? &o[0].t : NULL, use[1] ? &o[1].t : NULL);
        n_calls++;
        n_elems += n;
        CHECK(st == FM_OK, "%s: status %s: %s", ctxs, fm_status_name(st), fm_last_error(ctx));
        if (st != FM_OK)
            break;
        CHECK(strcmp(fm_last_error(ctx), "") == 0, "%s: last error not empty after success", ctxs);
        for (int k = 0; k < 2; k++) {
            if (!use[k])
                continue;
            char c2[300];
            snprintf(c2, sizeof c2, "%s [%s output, poison 0x%02x]", ctxs, k ? "colwise" : "rowwise", poisons[pi]);
            if (!tu_same_bytes(o[k].data.p, rc[k], o[k].data.n, "codes", c2) && pi == 0) {
                /* say which element, for the first difference */
                int64_t R = ref_stored_rows(&o[k].s, sh->rows, sh->cols), C = ref_stored_cols(&o[k].s, sh->rows, sh->cols);
                for (int64_t e = 0, done = 0; e < sh->E && !done; e++)
                    for (int64_t r = 0; r < R && !done; r++)
                        for (int64_t c = 0; c < C && !done; c++) {
                            uint8_t g = ref_get_code(&o[k].s, o[k].data.p, sh->E, sh->rows, sh->cols, e, r, c);
                            uint8_t w = ref_get_code(&o[k].s, rc[k], sh->E, sh->rows, sh->cols, e, r, c);
                            if (g != w) {
                                float xv = k ? xr[(e * sh->rows + c) * sh->cols + r] : xr[(e * sh->rows + r) * sh->cols + c];
                                fprintf(stderr, "  expert %lld stored (%lld,%lld): x=%a code got 0x%x want 0x%x, scale got %a want %a\n",
                                        (long long)e, (long long)r, (long long)c, (double)xv, g, w,
                                        (double)ref_get_scale(&o[k].s, o[k].scale.p, sh->rows, sh->cols, e, r, c),
                                        (double)ref_get_scale(&o[k].s, rs[k], sh->rows, sh->cols, e, r, c));
                                done = 1;
                            }
                        }
            }
            tu_same_bytes(o[k].scale.p, rs[k], o[k].scale.n, "scales", c2);
            CHECK(tu_buf_guard_ok(&o[k].data) && tu_buf_guard_ok(&o[k].scale), "%s: write past the buffers", c2);
        }
        CHECK_EQ_U(tu_f32_bits(amax), amax_want, "%s: amax", ctxs);
        CHECK(nonfinite == bad, "%s: nonfinite_blocks %lld want %lld", ctxs, (long long)nonfinite, (long long)bad);
    }
    for (int k = 0; k < 2; k++)
        if (use[k]) {
            tu_qout_free(&o[k]);
            free(rc[k]);
            free(rs[k]);
        }
    tu_buf_free(&in);
    free(x);
    free(xr);
}

int main(void)
{
    tu_begin("test_quantize_matches_reference");
    fm_context *ctx1 = tu_cpu_context(1), *ctx3 = tu_cpu_context(3);
    const fm_dtype in_dts[3] = {FM_DTYPE_F32, FM_DTYPE_BF16, FM_DTYPE_F16};
    const float epss[5] = {0.0f, 0.0f, 0.0f, 1e-2f, 2.0f};
    long counter = 0;
    for (size_t ci = 0; ci < tu_ncombos; ci++) {
        const tu_combo *cb = &tu_combos[ci];
        int mx = cb->m == FM_SCALE_MX32;
        fm_scale_rule rules[3] = {FM_SCALE_RULE_DEFAULT, FM_SCALE_RULE_POW2,
                                  mx ? FM_SCALE_RULE_MX_FLOOR : FM_SCALE_RULE_EXACT};
        for (int ri = 0; ri < 3; ri++)
            for (int sl = 0; sl < 2; sl++)
                for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
                    const shape *sh = &shapes[si];
                    int row_ok = cb->dt != FM_DTYPE_E2M1 || sh->cols % 2 == 0;
                    int col_ok = cb->dt != FM_DTYPE_E2M1 || sh->rows % 2 == 0;
                    if (!row_ok && !col_ok)
                        continue;
                    for (int rep = 0; rep < 2; rep++, counter++) {
                        int kind = rep == 0 ? (int)(counter % TD_COUNT) : (counter % 2 ? TD_NONFINITE : TD_RANDOM);
                        int which = (int)(counter % 3); /* both, row only, col only */
                        int wr = row_ok && which != 2, wc = col_ok && which != 1;
                        if (!wr && !wc)
                            wr = row_ok, wc = col_ok;
                        run_case(counter % 2 ? ctx3 : ctx1, cb, rules[ri], (fm_scale_layout)sl, sh, kind,
                                 in_dts[counter % 3], epss[counter % 5], wr, wc);
                    }
                }
    }
    printf("%ld quantize calls, %ld input elements\n", n_calls, n_elems);
    fm_context_destroy(ctx1);
    fm_context_destroy(ctx3);
    return tu_end();
}
