/* fm_moe_swiglu's outputs are exactly fm_quantize of h = (silu(g) * u) * p
 * computed here from the decoded input (fm_dequantize of quantized inputs),
 * row-wise and column-wise, FP8 1x128, MXFP8, MXFP4, TENSOR, and unscaled
 * BF16/F32; likewise fm_moe_swiglu_backward's din = [(q u) dsilu(g) | q a]
 * with q = dh p, and dprobs = the fixed-order dot of dh and a u. Then the
 * math: h and the gradients against a double model (finite differences of
 * L = sum dh . h for din and dprobs). NaN stays in its row. Bad arguments
 * are refused by name. */
#include <math.h>

#include "flowmoe/mathfn.h"
#include "test_util.h"

typedef struct {
    fm_dtype dt;
    fm_scale_mode m;
} kind;

static const kind in_kinds[] = {{FM_DTYPE_F32, FM_SCALE_NONE},
                                {FM_DTYPE_BF16, FM_SCALE_NONE},
                                {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
                                {FM_DTYPE_E2M1, FM_SCALE_MX32}};
static const kind out_kinds[] = {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
                                 {FM_DTYPE_E5M2, FM_SCALE_MX32},
                                 {FM_DTYPE_E2M1, FM_SCALE_MX32},
                                 {FM_DTYPE_E4M3, FM_SCALE_TENSOR},
                                 {FM_DTYPE_BF16, FM_SCALE_NONE},
                                 {FM_DTYPE_F32, FM_SCALE_NONE}};

/* A quantized (or F32/BF16) copy of F32 values x [M, C], and its exact F32 decoding. */
typedef struct {
    fm_tensor t;
    void *d, *s;
    float *dec;
} holder;

static void make_input(fm_context *ctx, const kind *kd, const float *x, int64_t M, int64_t C, holder *h)
{
    h->d = malloc((size_t)(M * C * 4 + 16));
    h->s = malloc((size_t)(M * (C / 32 + 1) * 4));
    h->dec = malloc((size_t)(M * C * 4 + 16));
    if (kd->m == FM_SCALE_NONE) {
        tu_store_input(x, M * C, kd->dt, h->d, h->dec);
        h->t = fm_tensor_2d(h->d, kd->dt, M, C);
        return;
    }
    fm_tensor tx = fm_tensor_2d((void *)x, FM_DTYPE_F32, M, C);
    h->t = fm_tensor_quant_2d(h->d, kd->dt, M, C, FM_LAYOUT_ROWWISE, kd->m, h->s, FM_SCALE_LAYOUT_COMPACT);
    CHECK(fm_quantize(ctx, NULL, &tx, &h->t, NULL) == FM_OK, "quantize input: %s", fm_last_error(ctx));
    fm_tensor td = fm_tensor_2d(h->dec, FM_DTYPE_F32, M, C);
    CHECK(fm_dequantize(ctx, &h->t, &td) == FM_OK, "dequantize input: %s", fm_last_error(ctx));
}

static void free_holder(holder *h) { free(h->d), free(h->s), free(h->dec); }

/* outputs of one kind, [M, C]: row-wise, plus column-wise for quantized kinds */
typedef struct {
    tu_buf d[2], s[2];
    fm_tensor t[2];
    int two;
} outs;

static void make_outs(const kind *kd, int64_t M, int64_t C, int want_col, outs *o)
{
    o->two = want_col && kd->m != FM_SCALE_NONE;
    for (int i = 0; i < 1 + o->two; i++) {
        if (kd->m == FM_SCALE_NONE)
            o->t[i] = fm_tensor_2d(NULL, kd->dt, M, C);
        else
            o->t[i] = fm_tensor_quant_2d(NULL, kd->dt, M, C, i ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE, kd->m, NULL,
                                         FM_SCALE_LAYOUT_COMPACT);
        o->d[i] = tu_buf_new((size_t)fm_tensor_nbytes(&o->t[i]));
        o->s[i] = tu_buf_new((size_t)(kd->m == FM_SCALE_NONE ? 0 : fm_tensor_scale_nbytes(&o->t[i])));
        tu_buf_poison(&o->d[i], 0xCD);
        tu_buf_poison(&o->s[i], 0xCD);
        o->t[i].data = o->d[i].p;
        o->t[i].scale = kd->m == FM_SCALE_NONE ? NULL : o->s[i].p;
    }
}

static void free_outs(outs *o)
{
    for (int i = 0; i < 1 + o->two; i++)
        tu_buf_free(&o->d[i]), tu_buf_free(&o->s[i]);
}

/* got equals fm_quantize (or the plain store) of the F32 values want [M, C] */
static void same_as_quantize(fm_context *ctx, const kind *kd, float *want, int64_t M, int64_t C, outs *got,
                             const char *c)
{
    outs ref;
    make_outs(kd, M, C, got->two, &ref);
    fm_tensor tw = fm_tensor_2d(want, FM_DTYPE_F32, M, C);
    if (kd->m == FM_SCALE_NONE) {
        for (int64_t i = 0; i < M * C; i++) {
            if (kd->dt == FM_DTYPE_F32)
                ((uint32_t *)ref.d[0].p)[i] = want[i] != want[i] ? 0x7FC00000u : tu_f32_bits(want[i]);
            else
                ((uint16_t *)ref.d[0].p)[i] = (uint16_t)or_encode(OF_BF16, (double)want[i]);
        }
    } else {
        CHECK(fm_quantize(ctx, NULL, &tw, &ref.t[0], got->two ? &ref.t[1] : NULL) == FM_OK, "%s: reference quantize: %s",
              c, fm_last_error(ctx));
    }
    for (int i = 0; i < 1 + got->two; i++) {
        tu_same_bytes(got->d[i].p, ref.d[i].p, (size_t)fm_tensor_nbytes(&got->t[i]), i ? "col codes" : "row codes", c);
        if (kd->m != FM_SCALE_NONE)
            tu_same_bytes(got->s[i].p, ref.s[i].p, (size_t)fm_tensor_scale_nbytes(&got->t[i]),
                          i ? "col scales" : "row scales", c);
        CHECK(tu_buf_guard_ok(&got->d[i]) && tu_buf_guard_ok(&got->s[i]), "%s: guard", c);
    }
    free_outs(&ref);
}

static double dsilu_d(double g)
{
    double s = 1.0 / (1.0 + exp(-g));
    return s * (1.0 + g * (1.0 - s));
}

int main(void)
{
    tu_begin("test_moe_swiglu_quantizes_like_fm_quantize");
    fm_context *ctx = tu_cpu_context(2);
    for (int it = 0; it < 72; it++) {
        const kind *ik = &in_kinds[it % 4], *ok = &out_kinds[(it / 4) % 6];
        int64_t M = tu_randint(1, 40), I = 2 * tu_randint(1, 100);
        if (it % 5 == 0)
            I = 128 + 32 * tu_randint(0, 4);
        int use_p = it % 3 != 0, col = it % 2;
        if (col && ok->dt == FM_DTYPE_E2M1)
            M += M % 2; /* column-wise E2M1 packs pairs of rows */
        float *x = malloc((size_t)(M * 2 * I * 4)), *dhf = malloc((size_t)(M * I * 4)), *p = malloc((size_t)M * 4);
        for (int64_t i = 0; i < M * 2 * I; i++)
            x[i] = (float)(tu_normal() * 2.0);
        for (int64_t i = 0; i < M * I; i++)
            dhf[i] = (float)tu_normal();
        for (int64_t m = 0; m < M; m++)
            p[m] = (float)tu_uniform();
        int64_t nan_row = M > 2 ? 1 : -1;
        if (nan_row >= 0)
            x[nan_row * 2 * I + I + 3 % I] = NAN;
        if (M > 3)
            x[2 * 2 * I] = -30.0f, x[3 * 2 * I + 1] = 60.0f; /* saturating sigmoids */
        holder in, dh;
        make_input(ctx, ik, x, M, 2 * I, &in);
        make_input(ctx, ik, dhf, M, I, &dh);
        fm_tensor tp = fm_tensor_2d(p, FM_DTYPE_F32, M, 1);
        char c[160];
        snprintf(c, sizeof c, "it %d in %s %s -> %s %s M %lld I %lld probs %d col %d", it, fm_dtype_name(ik->dt),
                 fm_scale_mode_name(ik->m), fm_dtype_name(ok->dt), fm_scale_mode_name(ok->m), (long long)M,
                 (long long)I, use_p, col);

        /* forward */
        float *h = malloc((size_t)(M * I * 4));
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < I; i++) {
                float g = in.dec[m * 2 * I + i], u = in.dec[m * 2 * I + I + i];
                float e = fm_expf(-fabsf(g)), q = 1.0f / (1.0f + e), s = g >= 0.0f ? q : e * q;
                float a = g * s, v = a * u;
                h[m * I + i] = use_p ? v * p[m] : v;
            }
        outs o;
        make_outs(ok, M, I, col, &o);
        CHECK(fm_moe_swiglu(ctx, NULL, &in.t, use_p ? &tp : NULL, &o.t[0], o.two ? &o.t[1] : NULL, NULL) == FM_OK,
              "%s: %s", c, fm_last_error(ctx));
        same_as_quantize(ctx, ok, h, M, I, &o, c);
        free_outs(&o);
        /* h itself against double, finite rows */
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < I; i++) {
                double g = in.dec[m * 2 * I + i], u = in.dec[m * 2 * I + I + i];
                double want = g / (1.0 + exp(-g)) * u * (use_p ? p[m] : 1.0);
                if (m == nan_row)
                    continue;
                CHECK(fabs(h[m * I + i] - want) <= 1e-6 * fabs(want) + 1e-30, "%s: h %g vs %g", c,
                      (double)h[m * I + i], want);
            }

        /* backward */
        float *din = malloc((size_t)(M * 2 * I * 4)), *dpw = malloc((size_t)M * 4), *au = malloc((size_t)I * 4);
        for (int64_t m = 0; m < M; m++) {
            for (int64_t i = 0; i < I; i++) {
                float g = in.dec[m * 2 * I + i], u = in.dec[m * 2 * I + I + i], d = dh.dec[m * I + i];
                /* sigmoid(+-g) from e^-|g|, as mathfn.h defines them */
                float e = fm_expf(-fabsf(g)), r = 1.0f / (1.0f + e), s = g >= 0.0f ? r : e * r;
                float sn = g >= 0.0f ? e * r : r, a = g * s;
                float ds = s * fmaf(g, sn, 1.0f);
                float q = use_p ? d * p[m] : d;
                din[m * 2 * I + I + i] = q * a;
                din[m * 2 * I + i] = (q * u) * ds;
                au[i] = a * u;
            }
            dpw[m] = fm_dot_order_runs_f32(dh.dec + m * I, au, I);
        }
        make_outs(ok, M, 2 * I, col, &o);
        tu_buf dpb = tu_buf_new((size_t)M * 4);
        tu_buf_poison(&dpb, 0xCD);
        fm_tensor tdp = fm_tensor_2d(dpb.p, FM_DTYPE_F32, M, 1);
        CHECK(fm_moe_swiglu_backward(ctx, NULL, &dh.t, &in.t, use_p ? &tp : NULL, &o.t[0], o.two ? &o.t[1] : NULL,
                                     use_p ? &tdp : NULL) == FM_OK,
              "%s backward: %s", c, fm_last_error(ctx));
        same_as_quantize(ctx, ok, din, M, 2 * I, &o, c);
        free_outs(&o);
        if (use_p)
            for (int64_t m = 0; m < M; m++)
                CHECK_EQ_U(((uint32_t *)dpb.p)[m], dpw[m] != dpw[m] ? 0x7FC00000u : tu_f32_bits(dpw[m]),
                           "%s: dprobs[%lld]", c, (long long)m);
        /* finite differences of L = sum dh . h in double */
        for (int64_t m = 0; m < M && m < 6; m++) {
            if (m == nan_row)
                continue;
            double pm = use_p ? p[m] : 1.0, L_dp = 0, mag = 0;
            for (int64_t i = 0; i < I; i++) {
                double g = in.dec[m * 2 * I + i], u = in.dec[m * 2 * I + I + i], d = dh.dec[m * I + i], e = 1e-5;
                double f = g / (1 + exp(-g));
                double fdg = ((g + e) / (1 + exp(-(g + e))) - (g - e) / (1 + exp(-(g - e)))) / (2 * e) * u * pm * d;
                double fdu = f * pm * d; /* h is linear in u */
                CHECK(fabs(din[m * 2 * I + i] - fdg) <= 2e-5 * (fabs(fdg) + fabs(u * pm * d)) + 1e-6, "%s: dg %g vs %g",
                      c, (double)din[m * 2 * I + i], fdg);
                CHECK(fabs(din[m * 2 * I + I + i] - fdu) <= 1e-6 * fabs(fdu) + 1e-30, "%s: du %g vs %g", c,
                      (double)din[m * 2 * I + I + i], fdu);
                CHECK(fabs(dsilu_d(g) * u * pm * d - fdg) <= 1e-4 * (fabs(fdg) + 1e-3), "model self-check");
                L_dp += d * f * u;
                mag += fabs(d * f * u);
            }
            if (use_p)
                CHECK(fabs(((float *)dpb.p)[m] - L_dp) <= 1e-5 * (mag + 1e-6), "%s: dprobs %g vs %g", c,
                      (double)((float *)dpb.p)[m], L_dp);
        }
        tu_buf_free(&dpb);
        free(x), free(dhf), free(p), free(h), free(din), free(dpw), free(au);
        free_holder(&in), free_holder(&dh);
    }

    /* invalid arguments */
    {
        float x[4 * 6], y[4 * 6], pr[4];
        fm_tensor tin = fm_tensor_2d(x, FM_DTYPE_F32, 4, 6), to = fm_tensor_2d(y, FM_DTYPE_F32, 4, 3);
        fm_tensor odd = fm_tensor_2d(x, FM_DTYPE_F32, 4, 5);
        CHECK(fm_moe_swiglu(ctx, NULL, &odd, NULL, &to, NULL, NULL) == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "in"),
              "odd columns: %s", fm_last_error(ctx));
        fm_tensor wrong = fm_tensor_2d(y, FM_DTYPE_F32, 4, 4);
        CHECK(fm_moe_swiglu(ctx, NULL, &tin, NULL, &wrong, NULL, NULL) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "out_row"), "out shape: %s", fm_last_error(ctx));
        fm_tensor col = fm_tensor_quant_2d(pr, FM_DTYPE_E4M3, 4, 3, FM_LAYOUT_COLWISE, FM_SCALE_TENSOR, pr,
                                           FM_SCALE_LAYOUT_COMPACT);
        CHECK(fm_moe_swiglu(ctx, NULL, &tin, NULL, &to, &col, NULL) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "out_col"), "col with unscaled row: %s", fm_last_error(ctx));
        fm_tensor tp = fm_tensor_2d(pr, FM_DTYPE_F32, 3, 1);
        CHECK(fm_moe_swiglu(ctx, NULL, &tin, &tp, &to, NULL, NULL) == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "probs"),
              "probs shape: %s", fm_last_error(ctx));
        fm_quant_config qc = {.epsilon = -1.0f};
        CHECK(fm_moe_swiglu(ctx, &qc, &tin, NULL, &to, NULL, NULL) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "epsilon"), "epsilon: %s", fm_last_error(ctx));
        fm_tensor al = fm_tensor_2d(x, FM_DTYPE_F32, 4, 3);
        CHECK(fm_moe_swiglu(ctx, NULL, &tin, NULL, &al, NULL, NULL) == FM_ERR_INVALID_ARG, "out aliasing in");
        fm_tensor dh = fm_tensor_2d(pr, FM_DTYPE_F32, 4, 1), din = fm_tensor_2d(y, FM_DTYPE_F32, 4, 6);
        float dpv[4];
        fm_tensor tdp = fm_tensor_2d(dpv, FM_DTYPE_F32, 4, 1);
        CHECK(fm_moe_swiglu_backward(ctx, NULL, &dh, &tin, NULL, &din, NULL, NULL) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "dh"), "dh shape: %s", fm_last_error(ctx));
        float dhv[12];
        fm_tensor dh2 = fm_tensor_2d(dhv, FM_DTYPE_F32, 4, 3);
        CHECK(fm_moe_swiglu_backward(ctx, NULL, &dh2, &tin, NULL, &din, NULL, &tdp) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "probs"), "dprobs without probs: %s", fm_last_error(ctx));
    }
    fm_context_destroy(ctx);
    return tu_end();
}
