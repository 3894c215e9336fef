/* Per-block scale rules and the round-trip error bound, checked as
 * properties of the library's own outputs (no reference codes involved):
 *
 *  POW2 (default for BLOCK_* and MX32): every scale is a power of two 2^p,
 *    amax / 2^p <= max_elem, and amax / 2^(p-1) > max_elem unless p = -127
 *    (clamped); so nothing saturates: each element dequantizes within half
 *    the quantum of its code's binade (subnormal quantum included) times
 *    the scale.
 *  MX_FLOOR: p = floor(log2 amax) - emax_elem (clamped to [-127, 127]),
 *    elements beyond max_elem saturate to +-max, the rest obey the bound.
 *  EXACT: scale_inv = 1 / (max_elem / amax) in F32 (1 for amax 0), and the
 *    bound up to F32 rounding of the multiplier.
 * Epsilon floors amax. Data includes adversarial blocks whose amax sits on
 * and around max_elem * 2^k, where a careless scale would round one element
 * past the largest code. */
#include <float.h>
#include <math.h>

#include "test_util.h"

#define TD_EDGE TD_COUNT

static long n_blocks, n_saturated_floor, n_overflow;

static void fill_edges(float *x, int64_t n, or_fmt f)
{
    double mx = or_max(f), q = or_quantum(f, mx);
    int em;
    frexp(mx, &em);
    const double edges[] = {mx, mx + q / 2, mx + q / 4, mx + q, ldexp(1.0, em) - ldexp(1.0, em - 24), 1.5 * ldexp(1.0, em - 1),
                            ldexp(1.0, em - 1), mx - q / 2};
    for (int64_t b = 0; b < n; b += 32) {
        int k = (int)tu_randint(-100, 100);
        double top = edges[tu_randint(0, sizeof edges / sizeof edges[0] - 1)];
        for (int64_t i = b; i < n && i < b + 32; i++) {
            double v = (i == b) ? top : top * tu_uniform();
            float fv = (float)ldexp(v, k);
            if (tu_rand32() & 1)
                fv = nextafterf(fv, INFINITY);
            x[i] = (tu_rand32() & 1) ? -fv : fv;
        }
    }
}

static void run(fm_context *ctx, const tu_combo *cb, fm_scale_rule rule, int ndim, int64_t E, int64_t rows, int64_t cols,
                int kind, float eps)
{
    or_fmt f = or_from_dtype(cb->dt);
    double mx = or_max(f);
    int64_t n = E * rows * cols;
    float *x = malloc(sizeof(float) * (size_t)(n ? n : 1));
    if (kind == TD_EDGE)
        fill_edges(x, n, f);
    else
        tu_fill(x, n, cols, kind);
    fm_tensor tin = tu_input(x, FM_DTYPE_F32, ndim, E, rows, cols);
    fm_scale_rule eff = rule == FM_SCALE_RULE_DEFAULT
                            ? (cb->m == FM_SCALE_TENSOR || cb->m == FM_SCALE_ROW ? FM_SCALE_RULE_EXACT : FM_SCALE_RULE_POW2)
                            : rule;
    char cs[200];
    snprintf(cs, sizeof cs, "%s %s %s [%lld,%lld,%lld] data %s eps %g", fm_dtype_name(cb->dt), fm_scale_mode_name(cb->m),
             tu_rule_name(rule), (long long)E, (long long)rows, (long long)cols,
             kind == TD_EDGE ? "edges" : tu_data_name(kind), (double)eps);

    tu_qout o[2];
    for (int k = 0; k < 2; k++) {
        ref_spec s = {cb->dt, cb->m, k ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT};
        tu_qout_init(&o[k], &s, ndim, E, rows, cols);
    }
    fm_quant_config cfg = {.rule = rule, .epsilon = eps};
    fm_status st = fm_quantize(ctx, &cfg, &tin, &o[0].t, &o[1].t);
    CHECK(st == FM_OK, "%s: quantize %s: %s", cs, fm_status_name(st), fm_last_error(ctx));
    float *deq = malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int k = 0; k < 2 && st == FM_OK; k++) {
        fm_tensor tout = tu_input(deq, FM_DTYPE_F32, ndim, E, rows, cols);
        fm_status ds = fm_dequantize(ctx, &o[k].t, &tout); /* back to the logical row-wise layout */
        CHECK(ds == FM_OK, "%s: dequantize %s", cs, fm_last_error(ctx));
        const ref_spec *s = &o[k].s;
        int64_t R = ref_stored_rows(s, rows, cols), C = ref_stored_cols(s, rows, cols);
        int64_t br = ref_block_rows(s->mode, R), bc = ref_block_cols(s->mode, C);
        int64_t nbr = s->mode == FM_SCALE_TENSOR ? 1 : (R + br - 1) / br;
        int64_t nbc = (s->mode == FM_SCALE_TENSOR || s->mode == FM_SCALE_ROW) ? 1 : (C + bc - 1) / bc;
        for (int64_t e = 0; e < E; e++)
            for (int64_t rb = 0; rb < nbr; rb++)
                for (int64_t cbk = 0; cbk < nbc; cbk++) {
                    int64_t r0 = rb * br, r1 = r0 + br < R ? r0 + br : R, c0 = cbk * bc, c1 = c0 + bc < C ? c0 + bc : C;
                    double amax = 0;
                    for (int64_t r = r0; r < r1; r++)
                        for (int64_t c = c0; c < c1; c++) {
                            double v = k ? x[(e * rows + c) * cols + r] : x[(e * rows + r) * cols + c];
                            amax = fabs(v) > amax ? fabs(v) : amax;
                        }
                    double a = amax < eps ? eps : amax;
                    double sc = R && C ? ref_get_scale(s, o[k].scale.p, rows, cols, e, r0, c0) : 1.0;
                    if (!(R && C))
                        continue;
                    n_blocks++;
                    int ex;
                    double fr = frexp(sc, &ex);
                    int p = ex - 1;
                    if (eff == FM_SCALE_RULE_POW2) {
                        CHECK(fr == 0.5, "%s out %d block (%lld,%lld): scale %a not a power of two", cs, k,
                              (long long)rb, (long long)cbk, sc);
                        CHECK(a / sc <= mx, "%s: amax %a / scale %a > max", cs, a, sc);
                        CHECK(a == 0 ? p == 0 : (p == -127 || a / (sc / 2) > mx),
                              "%s: amax %a: scale %a is not the smallest power of two", cs, a, sc);
                    } else if (eff == FM_SCALE_RULE_MX_FLOOR) {
                        int ea, em;
                        frexp(a, &ea);
                        frexp(mx, &em);
                        int want = a == 0 ? 0 : (ea - 1) - (em - 1);
                        want = want < -127 ? -127 : want > 127 ? 127 : want;
                        CHECK(fr == 0.5 && p == want, "%s: MX floor amax %a: scale %a want 2^%d", cs, a, sc, want);
                    } else {
                        float m = (float)a == 0.0f ? 1.0f : (float)mx / (float)a;
                        if (isinf(m))
                            m = FLT_MAX;
                        CHECK_EQ_U(tu_f32_bits((float)sc), tu_f32_bits(1.0f / m), "%s: EXACT scale of amax %a", cs, a);
                    }
                    for (int64_t r = r0; r < r1; r++)
                        for (int64_t c = c0; c < c1; c++) {
                            int64_t li = k ? (e * rows + c) * cols + r : (e * rows + r) * cols + c;
                            double xv = x[li], dv = deq[li];
                            uint8_t code = ref_get_code(s, o[k].data.p, E, rows, cols, e, r, c);
                            double cv = or_decode(f, code);
                            double qv = or_quantum(f, cv);
                            /* code * scale is exact in double; dequantize rounds it to F32,
                             * which overflows to Inf for a code that rounded up next to
                             * FLT_MAX (e.g. 0x1.fffffep127 -> E4M3 256 * 2^120 = 2^128).
                             * The bound is on the exact value; the F32 result is checked to
                             * be that value's rounding. */
                            double exact = cv * sc;
                            tu_checks++;
                            if ((double)(float)exact != dv && !(tu_is_nan(exact) && tu_is_nan(dv)))
                                tu_fail(__FILE__, __LINE__, "deq == fl(code * scale)", "%s: code 0x%x scale %a deq %a", cs,
                                        code, sc, dv);
                            if (fabs(exact) > FLT_MAX)
                                n_overflow++;
                            dv = exact;
                            if (eff == FM_SCALE_RULE_POW2) {
                                tu_checks++;
                                if (!(fabs(xv) / sc <= mx && fabs(dv - xv) <= 0.5 * qv * sc))
                                    tu_fail(__FILE__, __LINE__, "|deq - x| <= q/2 * scale",
                                            "%s out %d (%lld,%lld): x %a deq %a code 0x%x scale %a", cs, k, (long long)r,
                                            (long long)c, xv, dv, code, sc);
                            } else if (eff == FM_SCALE_RULE_MX_FLOOR) {
                                tu_checks++;
                                int ok;
                                if (fabs(xv) / sc > mx) {
                                    n_saturated_floor++;
                                    ok = fabs(cv) == mx && (cv < 0) == (xv < 0);
                                } else {
                                    ok = fabs(dv - xv) <= 0.5 * qv * sc;
                                }
                                if (!ok)
                                    tu_fail(__FILE__, __LINE__, "MX floor element", "%s: x %a deq %a code 0x%x scale %a",
                                            cs, xv, dv, code, sc);
                            } else {
                                double bound = 0.5 * qv * sc * (1 + 0x1p-20) + (fabs(xv) + fabs(dv)) * 0x1p-21 + 0x1p-149;
                                tu_checks++;
                                if (!(fabs(dv - xv) <= bound))
                                    tu_fail(__FILE__, __LINE__, "EXACT element", "%s: x %a deq %a code 0x%x scale %a",
                                            cs, xv, dv, code, sc);
                            }
                        }
                }
    }
    for (int k = 0; k < 2; k++)
        tu_qout_free(&o[k]);
    free(deq);
    free(x);
}

int main(void)
{
    tu_begin("test_pow2_scale_never_saturates");
    fm_context *ctx = tu_cpu_context(2);
    const int64_t shapes[][4] = {{2, 1, 1, 256}, {2, 1, 130, 258}, {2, 1, 64, 96}, {3, 2, 34, 160}};
    const int kinds[] = {TD_RANDOM, TD_ZEROS, TD_SUBNORMAL, TD_MAXMAG, TD_WIDE, TD_TIES, TD_EDGE};
    long counter = 0;
    for (size_t ci = 0; ci < tu_ncombos; ci++) {
        int mxm = tu_combos[ci].m == FM_SCALE_MX32;
        fm_scale_rule rules[3] = {FM_SCALE_RULE_DEFAULT, FM_SCALE_RULE_POW2,
                                  mxm ? FM_SCALE_RULE_MX_FLOOR : FM_SCALE_RULE_EXACT};
        for (int ri = 0; ri < 3; ri++)
            for (size_t si = 0; si < 4; si++)
                for (size_t ki = 0; ki < sizeof kinds / sizeof kinds[0]; ki++, counter++)
                    run(ctx, &tu_combos[ci], rules[ri], (int)shapes[si][0], shapes[si][1],
                        /* E2M1 column-wise needs an even row count */
                        shapes[si][2] + (tu_combos[ci].dt == FM_DTYPE_E2M1 && shapes[si][2] % 2), shapes[si][3],
                        kinds[ki], counter % 4 == 3 ? 1e-3f : 0.0f);
    }
    printf("%ld blocks checked, %ld saturated elements under MX_FLOOR, %ld dequantized past FLT_MAX to Inf\n",
           n_blocks, n_saturated_floor, n_overflow);
    CHECK(n_saturated_floor > 0, "the data must make MX_FLOOR saturate somewhere, or that branch is untested");
    fm_context_destroy(ctx);
    return tu_end();
}
