/* A block holding NaN or +-Inf gets a NaN scale (F32 canonical NaN, E8M0
 * 0xFF), every code of the block is the element NaN (E4M3 0x7F, E5M2 0x7E,
 * E2M1 0), the block dequantizes to NaN (canonical, in F32/BF16/F16), the
 * call succeeds, every other block is exactly what it is with the bad element
 * replaced by 0, nonfinite_blocks counts the bad blocks over both outputs,
 * and amax is NaN if any NaN, else Inf if any Inf. */
#include <math.h>

#include "test_util.h"

int main(void)
{
    tu_begin("test_nonfinite_blocks_propagate");
    fm_context *ctx = tu_cpu_context(2);
    const int64_t rows = 140, cols = 260;
    const int64_t n = rows * cols;
    float *x = malloc(sizeof(float) * n), *clean = malloc(sizeof(float) * n);
    const uint32_t bads[] = {0x7FC00000u, 0xFFC00001u, 0x7F800001u, 0x7F800000u, 0xFF800000u};
    char cs[200];
    for (size_t ci = 0; ci < tu_ncombos; ci++)
        for (int rule = 0; rule < 2; rule++)
            for (int trial = 0; trial < 4; trial++) {
                    int in_dt = (int)((trial + ci + (size_t)rule) % 3);
                    const tu_combo *cb = &tu_combos[ci];
                    fm_scale_rule r = rule ? (cb->m == FM_SCALE_MX32 ? FM_SCALE_RULE_MX_FLOOR : FM_SCALE_RULE_POW2)
                                           : FM_SCALE_RULE_DEFAULT;
                    fm_dtype idt = in_dt == 0 ? FM_DTYPE_F32 : in_dt == 1 ? FM_DTYPE_BF16 : FM_DTYPE_F16;
                    tu_fill(x, n, cols, TD_RANDOM);
                    for (int64_t i = 0; i < n; i++)
                        x[i] = fmaxf(fminf(x[i], 60000.0f), -60000.0f); /* F16 input stays finite */
                    memcpy(clean, x, sizeof(float) * n);
                    /* 1 to 3 bad elements; trial 3 mixes NaN and Inf */
                    int nbad = trial + 1 > 3 ? 3 : trial + 1;
                    int has_nan = 0, has_inf = 0;
                    for (int b = 0; b < nbad; b++) {
                        int64_t at = tu_randint(0, n - 1);
                        uint32_t bits = trial == 3 ? bads[b == 0 ? 0 : 3 + (b & 1)] : bads[tu_randint(0, 4)];
                        x[at] = tu_bits_f32(bits);
                        clean[at] = 0.0f;
                        if (x[at] != x[at])
                            has_nan = 1;
                        else
                            has_inf = 1;
                    }
                    snprintf(cs, sizeof cs, "%s %s %s in %s trial %d", fm_dtype_name(cb->dt), fm_scale_mode_name(cb->m),
                             tu_rule_name(r), fm_dtype_name(idt), trial);
                    uint16_t *h = malloc(sizeof(uint16_t) * n);
                    float *xr = malloc(sizeof(float) * n), *cr = malloc(sizeof(float) * n);
                    void *inbuf = x;
                    if (idt != FM_DTYPE_F32) {
                        tu_store_input(x, n, idt, h, xr);
                        inbuf = h;
                    } else {
                        memcpy(xr, x, sizeof(float) * n);
                    }
                    memcpy(cr, clean, sizeof(float) * n);
                    if (idt != FM_DTYPE_F32) {
                        uint16_t *tmp = malloc(sizeof(uint16_t) * n);
                        tu_store_input(clean, n, idt, tmp, cr);
                        free(tmp);
                    }
                    fm_tensor tin = fm_tensor_2d(inbuf, idt, rows, cols);
                    fm_tensor tclean = fm_tensor_2d(cr, FM_DTYPE_F32, rows, cols);
                    tu_qout q[2], qc[2];
                    for (int k = 0; k < 2; k++) {
                        ref_spec s = {cb->dt, cb->m, (fm_layout)k, (fm_scale_layout)(trial & 1)};
                        tu_qout_init(&q[k], &s, 2, 1, rows, cols);
                        tu_qout_init(&qc[k], &s, 2, 1, rows, cols);
                    }
                    float amax;
                    int64_t nf;
                    fm_quant_config cfg = {.rule = r, .amax = &amax, .nonfinite_blocks = &nf};
                    CHECK(fm_quantize(ctx, &cfg, &tin, &q[0].t, &q[1].t) == FM_OK, "%s: %s", cs, fm_last_error(ctx));
                    fm_quant_config cfg2 = {.rule = r};
                    CHECK(fm_quantize(ctx, &cfg2, &tclean, &qc[0].t, &qc[1].t) == FM_OK, "%s clean", cs);
                    CHECK(has_nan ? tu_f32_bits(amax) == 0x7FC00000u : (isinf(amax) && amax > 0), "%s: amax %a", cs,
                          (double)amax);
                    int64_t want_nf = 0;
                    for (int k = 0; k < 2; k++) {
                        const ref_spec *s = &q[k].s;
                        int64_t R = ref_stored_rows(s, rows, cols), C = ref_stored_cols(s, rows, cols);
                        int64_t br = ref_block_rows(s->mode, R), bc = ref_block_cols(s->mode, C);
                        int64_t nbr = s->mode == FM_SCALE_TENSOR ? 1 : (R + br - 1) / br;
                        int64_t nbc = (s->mode == FM_SCALE_TENSOR || s->mode == FM_SCALE_ROW) ? 1 : (C + bc - 1) / bc;
                        uint8_t nan_code = cb->dt == FM_DTYPE_E4M3 ? 0x7F : cb->dt == FM_DTYPE_E5M2 ? 0x7E : 0;
                        for (int64_t rb = 0; rb < nbr; rb++)
                            for (int64_t cbk = 0; cbk < nbc; cbk++) {
                                int64_t r0 = rb * br, r1 = r0 + br < R ? r0 + br : R, c0 = cbk * bc, c1 = c0 + bc < C ? c0 + bc : C;
                                int bad = 0;
                                for (int64_t rr = r0; rr < r1; rr++)
                                    for (int64_t cc = c0; cc < c1; cc++) {
                                        float v = k ? xr[cc * cols + rr] : xr[rr * cols + cc];
                                        bad |= !isfinite(v);
                                    }
                                want_nf += bad;
                                float sc = ref_get_scale(s, q[k].scale.p, rows, cols, 0, r0, c0);
                                float scc = ref_get_scale(s, qc[k].scale.p, rows, cols, 0, r0, c0);
                                int64_t off = ref_scale_offset(s->mode, s->slayout, R, C, r0, c0);
                                if (bad) {
                                    if (s->mode == FM_SCALE_MX32)
                                        CHECK_EQ_U(q[k].scale.p[off], 0xFF, "%s out %d: E8M0 NaN scale", cs, k);
                                    else
                                        CHECK_EQ_U(tu_f32_bits(sc), 0x7FC00000u, "%s out %d: F32 NaN scale", cs, k);
                                } else {
                                    CHECK_EQ_U(tu_f32_bits(sc), tu_f32_bits(scc), "%s out %d block (%lld,%lld) untouched",
                                               cs, k, (long long)rb, (long long)cbk);
                                }
                                for (int64_t rr = r0; rr < r1; rr++)
                                    for (int64_t cc = c0; cc < c1; cc++) {
                                        uint8_t g = ref_get_code(s, q[k].data.p, 1, rows, cols, 0, rr, cc);
                                        uint8_t w = bad ? nan_code : ref_get_code(s, qc[k].data.p, 1, rows, cols, 0, rr, cc);
                                        if (g != w)
                                            CHECK_EQ_U(g, w, "%s out %d element (%lld,%lld) bad block %d", cs, k,
                                                       (long long)rr, (long long)cc, bad);
                                        else
                                            tu_checks++;
                                    }
                            }
                        /* dequantize: the bad blocks read NaN (canonical) in every output dtype */
                        for (int od = 0; od < 3; od++) {
                            fm_dtype odt = od == 0 ? FM_DTYPE_F32 : od == 1 ? FM_DTYPE_BF16 : FM_DTYPE_F16;
                            tu_buf ob = tu_buf_new((size_t)n * 4);
                            fm_tensor to = fm_tensor_2d(ob.p, odt, rows, cols);
                            CHECK(fm_dequantize(ctx, &q[k].t, &to) == FM_OK, "%s dequantize: %s", cs, fm_last_error(ctx));
                            for (int64_t i = 0; i < rows; i++)
                                for (int64_t j = 0; j < cols; j++) {
                                    int64_t rr = k ? j : i, cc = k ? i : j;
                                    int in_bad_block;
                                    float sc = ref_get_scale(s, q[k].scale.p, rows, cols, 0, rr, cc);
                                    in_bad_block = sc != sc;
                                    uint32_t bits = odt == FM_DTYPE_F32 ? ((uint32_t *)ob.p)[i * cols + j]
                                                                         : ((uint16_t *)ob.p)[i * cols + j];
                                    uint32_t canon = odt == FM_DTYPE_F32 ? 0x7FC00000u : odt == FM_DTYPE_BF16 ? 0x7FC0u : 0x7E00u;
                                    tu_checks++;
                                    if (in_bad_block ? bits != canon : bits == canon)
                                        tu_fail(__FILE__, __LINE__, "dequantized NaN iff bad block",
                                                "%s out %d to %s (%lld,%lld): bits 0x%x", cs, k, fm_dtype_name(odt),
                                                (long long)i, (long long)j, bits);
                                }
                            tu_buf_free(&ob);
                        }
                    }
                    CHECK(nf == want_nf && nf > 0, "%s: nonfinite_blocks %lld want %lld", cs, (long long)nf,
                          (long long)want_nf);
                    (void)has_inf;
                    for (int k = 0; k < 2; k++) {
                        tu_qout_free(&q[k]);
                        tu_qout_free(&qc[k]);
                    }
                    free(h);
                    free(xr);
                    free(cr);
            }
    free(x);
    free(clean);
    fm_context_destroy(ctx);
    return tu_end();
}
