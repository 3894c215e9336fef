/* Fuzzes fm_quantize and fm_dequantize on small fuzzer-chosen tensors.
 *
 * The input picks the input dtype (F32, BF16, F16; its raw bits, so every
 * NaN payload, Inf, subnormal and signed zero occurs), the shape (1 row,
 * block edges +-1, 3-D stacks), one or both outputs (every element dtype x
 * scale mode pair, either scale layout), the scale rule and epsilon.
 *
 * Oracle:
 *   1. codes, scales (GEMM-layout padding included), amax and the
 *      non-finite block count equal a straightforward per-element reference
 *      written here from DESIGN.md with format.h's codecs and scale rules;
 *   2. dequantize equals code * scale in F32 (canonical NaN) element by
 *      element, through a layout change for column-wise outputs;
 *   3. round trip: every element of a finite block dequantizes to within half
 *      a quantum of the element format at |x| / scale, times the scale (F32
 *      slack for EXACT scales); elements that the OCP floor rule saturates
 *      come back as +-max * scale; every element of a block that held NaN or
 *      Inf comes back NaN. A finite input within half a quantum of FLT_MAX
 *      may round up to 2^128 (e.g. E4M3, 0x1.ff8p+127 -> 256 x 2^120): its
 *      code x scale is then not an F32 and dequantizes to +-Inf, as F32
 *      arithmetic gives (a property of the formats, not of the ops). */
#include <math.h>
#include <string.h>

#include "flowmoe/flowmoe.h"
#include "fuzz_common.h"
#include "fuzz_cpu_context.h"

static fm_context *g_ctx;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    g_ctx = fz_cpu_context();
    return 0;
}

static const struct {
    fm_dtype dt;
    fm_scale_mode m;
} combos[] = {
    {FM_DTYPE_E4M3, FM_SCALE_TENSOR},        {FM_DTYPE_E4M3, FM_SCALE_ROW},  {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
    {FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128}, {FM_DTYPE_E4M3, FM_SCALE_MX32}, {FM_DTYPE_E5M2, FM_SCALE_TENSOR},
    {FM_DTYPE_E5M2, FM_SCALE_ROW},           {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128},
    {FM_DTYPE_E5M2, FM_SCALE_BLOCK_128x128}, {FM_DTYPE_E5M2, FM_SCALE_MX32}, {FM_DTYPE_E2M1, FM_SCALE_MX32},
};
#define NCOMBO ((int)(sizeof combos / sizeof combos[0]))

static int64_t dim_from(uint8_t b)
{
    static const int64_t edge[] = {1, 2, 3, 31, 32, 33, 127, 128, 129, 130, 255, 256, 257, 64, 96, 160};
    return b < 128 ? edge[b % 16] : 1 + (b - 128) % 72;
}

typedef struct {
    fm_tensor t;
    uint8_t *data, *scale;
    size_t dbytes, sbytes;
    fm_scale_rule rule; /* effective */
    int colwise;
} qout;

static float load_in(const void *p, fm_dtype d, int64_t i)
{
    if (d == FM_DTYPE_BF16)
        return fm_bf16_to_f32(((const uint16_t *)p)[i]);
    if (d == FM_DTYPE_F16)
        return fm_f16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* Spacing of the element format's values at magnitude v (>= 0). */
static double quantum(fm_dtype t, double v)
{
    int emin = t == FM_DTYPE_E4M3 ? -6 : t == FM_DTYPE_E5M2 ? -14 : 0;
    int mb = t == FM_DTYPE_E4M3 ? 3 : t == FM_DTYPE_E5M2 ? 2 : 1;
    double mx = fm_elem_max(t);
    if (v > mx)
        v = mx;
    if (v < ldexp(1.0, emin))
        return ldexp(1.0, emin - mb);
    int e;
    frexp(v, &e); /* v = f * 2^e, f in [0.5, 1) */
    return ldexp(1.0, e - 1 - mb);
}

/* The reference quantization of one output, written element by element. */
static int64_t ref_quantize(const float *x, int64_t E, int64_t rows, int64_t cols, const qout *o, float eps,
                            uint8_t *codes, uint8_t *scales)
{
    const fm_tensor *t = &o->t;
    int64_t R = o->colwise ? cols : rows, C = o->colwise ? rows : cols;
    int64_t per = fm_scale_count_2d(t->scale_mode, t->scale_layout, R, C);
    int e8 = t->scale_dtype == FM_DTYPE_E8M0;
    int64_t br = t->scale_mode == FM_SCALE_TENSOR ? R : t->scale_mode == FM_SCALE_BLOCK_128x128 ? 128 : 1;
    int64_t bc = t->scale_mode == FM_SCALE_TENSOR || t->scale_mode == FM_SCALE_ROW ? C
               : t->scale_mode == FM_SCALE_MX32 ? 32 : 128;
    if (br < 1)
        br = 1;
    if (bc < 1)
        bc = 1;
    int64_t bad = 0;
    memset(codes, 0, o->dbytes);
    for (int64_t e = 0; e < E; e++) {
        uint8_t *sb = scales + (size_t)(e * per) * (e8 ? 1 : 4);
        for (int64_t k = 0; k < per; k++) {
            if (e8)
                sb[k] = 127;
            else
                memcpy(sb + 4 * k, &(float){1.0f}, 4);
        }
        /* a TENSOR scale exists for an empty matrix too */
        int64_t nbr = R ? (R + br - 1) / br : t->scale_mode == FM_SCALE_TENSOR;
        int64_t nbc = C ? (C + bc - 1) / bc : (t->scale_mode == FM_SCALE_TENSOR || t->scale_mode == FM_SCALE_ROW);
        for (int64_t rb = 0; rb < nbr; rb++)
            for (int64_t cb = 0; cb < nbc; cb++) {
                float amax = 0.0f;
                int nonfinite = 0;
                for (int64_t r = rb * br; r < (rb + 1) * br && r < R; r++)
                    for (int64_t c = cb * bc; c < (cb + 1) * bc && c < C; c++) {
                        int64_t li = o->colwise ? c : r, lj = o->colwise ? r : c;
                        float v = x[(e * rows + li) * cols + lj];
                        if (!isfinite(v))
                            nonfinite = 1;
                        else if (fabsf(v) > amax)
                            amax = fabsf(v);
                    }
                float mult, s;
                uint8_t s8;
                if (nonfinite) {
                    bad++;
                    mult = NAN;
                    s = fm_bits_f32(FM_F32_CANON_NAN);
                    s8 = FM_E8M0_NAN;
                } else {
                    float a = amax < eps ? eps : amax;
                    if (o->rule == FM_SCALE_RULE_EXACT) {
                        mult = fm_exact_scale(a, t->dtype);
                        s = 1.0f / mult;
                        s8 = 0;
                    } else {
                        int p = o->rule == FM_SCALE_RULE_MX_FLOOR ? fm_mx_floor_scale_exp(a, t->dtype)
                                                                   : fm_pow2_scale_exp(a, t->dtype);
                        mult = fm_exp2i(-p);
                        s = fm_exp2i(p);
                        s8 = (uint8_t)(p + 127);
                    }
                }
                int64_t off = fm_scale_offset(t->scale_mode, t->scale_layout, R, C, rb * br, cb * bc);
                if (e8)
                    sb[off] = s8;
                else
                    memcpy(sb + 4 * off, &s, 4);
                for (int64_t r = rb * br; r < (rb + 1) * br && r < R; r++)
                    for (int64_t c = cb * bc; c < (cb + 1) * bc && c < C; c++) {
                        int64_t li = o->colwise ? c : r, lj = o->colwise ? r : c;
                        float v = x[(e * rows + li) * cols + lj];
                        uint8_t code = nonfinite ? fm_elem_nan(t->dtype) : fm_elem_encode(t->dtype, v * mult);
                        if (t->dtype == FM_DTYPE_E2M1) {
                            uint8_t *b = codes + (size_t)((e * R + r) * C + c) / 2;
                            *b |= (uint8_t)((code & 0xF) << ((c & 1) * 4));
                        } else {
                            codes[(e * R + r) * C + c] = code;
                        }
                    }
            }
    }
    return bad;
}

static void first_diff(const char *what, const uint8_t *got, const uint8_t *want, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i])
            fz_fail("%s differs from the reference at byte %zu: 0x%02x, want 0x%02x", what, i, got[i], want[i]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_reader rd = {data, size, 0}, *r = &rd;
    uint8_t b0 = fz_u8(r), b1 = fz_u8(r), b2 = fz_u8(r), b3 = fz_u8(r), b4 = fz_u8(r), b5 = fz_u8(r),
            b6 = fz_u8(r), b7 = fz_u8(r);
    fm_dtype idt = (fm_dtype[]){FM_DTYPE_F32, FM_DTYPE_BF16, FM_DTYPE_F16}[b0 % 3];
    int ndim = (b0 & 0x80) ? 3 : 2;
    int64_t E = ndim == 3 ? 1 + b3 % 3 : 1;
    if (ndim == 3 && (b3 & 0x40))
        E = 0; /* an empty stack */
    int64_t rows = dim_from(b1), cols = dim_from(b2);
    while (E * rows * cols > 4096)
        rows = (rows + 1) / 2;
    int which = 1 + b5 % 3; /* 1 row-wise, 2 column-wise, 3 both */
    int nout = 0;
    qout out[2];
    memset(out, 0, sizeof out);

    int ci = b4 % NCOMBO;
    /* E2M1 packs two codes per byte: even stored rows */
    if (combos[ci].dt == FM_DTYPE_E2M1 || combos[(ci + (b4 >> 4)) % NCOMBO].dt == FM_DTYPE_E2M1) {
        cols += cols & 1;
        rows += rows & 1;
    }
    float eps = (b7 & 3) == 0 ? (float[]){1e-3f, 1e-30f, 0.5f, 1e-42f, 3e38f, 1.0f, 448.0f, 1e-8f}[(b7 >> 2) & 7]
                              : 0.0f;
    for (int k = 0; k < 2; k++) {
        if (!((which >> k) & 1))
            continue;
        qout *o = &out[nout++];
        int cc = k == 0 ? ci : (ci + (b4 >> 4)) % NCOMBO;
        o->colwise = k;
        fm_scale_mode m = combos[cc].m;
        fm_scale_layout sl = ((b5 >> (2 + k)) & 1) ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
        o->t = ndim == 3 ? fm_tensor_3d(NULL, combos[cc].dt, E, rows, cols) : fm_tensor_2d(NULL, combos[cc].dt, rows, cols);
        o->t.layout = k ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE;
        o->t.scale_mode = m;
        o->t.scale_dtype = fm_scale_mode_dtype(m);
        o->t.scale_layout = sl;
        o->dbytes = (size_t)fm_tensor_nbytes(&o->t);
        o->sbytes = (size_t)fm_tensor_scale_nbytes(&o->t);
    }
    /* One rule for the call, valid for every output chosen. */
    fm_scale_rule rule = FM_SCALE_RULE_DEFAULT;
    int any_mx = 0, all_mx = 1;
    for (int k = 0; k < nout; k++) {
        any_mx |= out[k].t.scale_mode == FM_SCALE_MX32;
        all_mx &= out[k].t.scale_mode == FM_SCALE_MX32;
    }
    switch (b6 % 4) {
    case 1: rule = FM_SCALE_RULE_POW2; break;
    case 2: rule = any_mx ? FM_SCALE_RULE_DEFAULT : FM_SCALE_RULE_EXACT; break;
    case 3: rule = all_mx ? FM_SCALE_RULE_MX_FLOOR : FM_SCALE_RULE_DEFAULT; break;
    default: break;
    }
    for (int k = 0; k < nout; k++)
        out[k].rule = rule == FM_SCALE_RULE_DEFAULT
                    ? (out[k].t.scale_mode == FM_SCALE_TENSOR || out[k].t.scale_mode == FM_SCALE_ROW
                           ? FM_SCALE_RULE_EXACT
                           : FM_SCALE_RULE_POW2)
                    : rule;

    /* Input: raw bits of the input dtype from the fuzzer, repeated. */
    int64_t n = E * rows * cols;
    size_t esz = idt == FM_DTYPE_F32 ? 4 : 2;
    uint8_t *in = malloc((size_t)n * esz + 1);
    float *x = malloc((size_t)(n ? n : 1) * sizeof(float));
    if (!in || !x)
        abort();
    size_t avail = fz_left(r);
    for (size_t i = 0; i < (size_t)n * esz; i++)
        in[i] = avail ? r->p[r->i + i % avail] : (uint8_t)(i * 37);
    for (int64_t i = 0; i < n; i++)
        x[i] = load_in(in, idt, i);
    fm_tensor tin = ndim == 3 ? fm_tensor_3d(in, idt, E, rows, cols) : fm_tensor_2d(in, idt, rows, cols);

    for (int k = 0; k < nout; k++) {
        out[k].data = malloc(out[k].dbytes + 1);
        out[k].scale = malloc(out[k].sbytes + 1);
        if (!out[k].data || !out[k].scale)
            abort();
        memset(out[k].data, 0xA5, out[k].dbytes); /* poisoned */
        memset(out[k].scale, 0xA5, out[k].sbytes);
        out[k].t.data = out[k].data;
        out[k].t.scale = out[k].scale;
        out[k].t.data_capacity = (int64_t)out[k].dbytes;
        out[k].t.scale_capacity = (int64_t)out[k].sbytes;
    }
    float amax = -1.0f;
    int64_t nonfinite = -1;
    fm_quant_config cfg = {.rule = rule, .epsilon = eps, .amax = &amax, .nonfinite_blocks = &nonfinite};
    fm_tensor *orow = NULL, *ocol = NULL;
    for (int k = 0; k < nout; k++)
        *(out[k].colwise ? &ocol : &orow) = &out[k].t;
    fm_status st = fm_quantize(g_ctx, &cfg, &tin, orow, ocol);
    if (st != FM_OK)
        fz_fail("fm_quantize refused a valid call: %s \"%s\"", fm_status_name(st), fm_last_error(g_ctx));

    /* 1. the reference */
    int64_t want_bad = 0;
    for (int k = 0; k < nout; k++) {
        uint8_t *wc = malloc(out[k].dbytes + 1), *ws = malloc(out[k].sbytes + 1);
        if (!wc || !ws)
            abort();
        want_bad += ref_quantize(x, E, rows, cols, &out[k], eps, wc, ws);
        char what[96];
        snprintf(what, sizeof what, "%s %s %s %s codes", out[k].colwise ? "colwise" : "rowwise",
                 fm_dtype_name(out[k].t.dtype), fm_scale_mode_name(out[k].t.scale_mode),
                 fm_scale_layout_name(out[k].t.scale_layout));
        first_diff(what, out[k].data, wc, out[k].dbytes);
        snprintf(what, sizeof what, "%s %s %s %s scales", out[k].colwise ? "colwise" : "rowwise",
                 fm_dtype_name(out[k].t.dtype), fm_scale_mode_name(out[k].t.scale_mode),
                 fm_scale_layout_name(out[k].t.scale_layout));
        first_diff(what, out[k].scale, ws, out[k].sbytes);
        free(wc);
        free(ws);
    }
    if (nonfinite != want_bad)
        fz_fail("nonfinite_blocks %lld, want %lld", (long long)nonfinite, (long long)want_bad);
    {
        uint32_t m = 0;
        for (int64_t i = 0; i < n; i++) {
            uint32_t v = fm_f32_bits(x[i]) & 0x7FFFFFFFu;
            m = v > m ? v : m;
        }
        uint32_t want = m > 0x7F800000u ? FM_F32_CANON_NAN : m;
        if (fm_f32_bits(amax) != want)
            fz_fail("amax bits 0x%08x, want 0x%08x", fm_f32_bits(amax), want);
    }

    /* 2 and 3: dequantize and the round trip */
    float *y = malloc((size_t)(n ? n : 1) * sizeof(float) + 4);
    if (!y)
        abort();
    for (int k = 0; k < nout; k++) {
        qout *o = &out[k];
        fm_tensor ty = ndim == 3 ? fm_tensor_3d(y, FM_DTYPE_F32, E, rows, cols) : fm_tensor_2d(y, FM_DTYPE_F32, rows, cols);
        ty.data_capacity = n * 4;
        memset(y, 0xA5, (size_t)n * 4);
        st = fm_dequantize(g_ctx, &o->t, &ty);
        if (st != FM_OK)
            fz_fail("fm_dequantize refused a valid call: %s \"%s\"", fm_status_name(st), fm_last_error(g_ctx));
        int64_t R = o->colwise ? cols : rows, C = o->colwise ? rows : cols;
        int64_t per = fm_scale_count_2d(o->t.scale_mode, o->t.scale_layout, R, C);
        double emax = fm_elem_max(o->t.dtype);
        for (int64_t e = 0; e < E; e++)
            for (int64_t i = 0; i < rows; i++)
                for (int64_t j = 0; j < cols; j++) {
                    int64_t sr = o->colwise ? j : i, sc = o->colwise ? i : j;
                    int64_t off = e * per + fm_scale_offset(o->t.scale_mode, o->t.scale_layout, R, C, sr, sc);
                    float s;
                    if (o->t.scale_dtype == FM_DTYPE_E8M0)
                        s = fm_e8m0_to_f32(o->scale[off]);
                    else
                        memcpy(&s, o->scale + 4 * off, 4);
                    uint8_t code;
                    if (o->t.dtype == FM_DTYPE_E2M1) {
                        uint8_t byte = o->data[((e * R + sr) * C + sc) / 2];
                        code = (sc & 1) ? byte >> 4 : byte & 0xF;
                    } else {
                        code = o->data[(e * R + sr) * C + sc];
                    }
                    float want = fm_f32_canon(fm_elem_decode(o->t.dtype, code) * s);
                    float got = y[(e * rows + i) * cols + j];
                    if (fm_f32_bits(got) != fm_f32_bits(want))
                        fz_fail("dequantize [%lld,%lld,%lld]: 0x%08x, want code 0x%02x x scale %g = 0x%08x",
                                (long long)e, (long long)i, (long long)j, fm_f32_bits(got), code, (double)s,
                                fm_f32_bits(want));
                    float xv = x[(e * rows + i) * cols + j];
                    if (isnan(s)) {
                        if (!isnan(got))
                            fz_fail("a non-finite block dequantized to %g at [%lld,%lld,%lld]", (double)got,
                                    (long long)e, (long long)i, (long long)j);
                        continue;
                    }
                    if (!isfinite(xv))
                        fz_fail("input %g at [%lld,%lld,%lld] left a finite scale %g", (double)xv, (long long)e,
                                (long long)i, (long long)j, (double)s);
                    double sd = s, v = fabs((double)xv) / sd;
                    /* Within half a quantum of FLT_MAX a value rounds up to 2^128:
                     * code * scale is then beyond F32, and F32 arithmetic says Inf. */
                    double exact = (double)fm_elem_decode(o->t.dtype, code) * sd;
                    if (fabs(exact) > 0x1.fffffep+127) {
                        if (got != (float)copysign(INFINITY, exact))
                            fz_fail("code 0x%02x x scale %a overflows F32 but dequantized to %a", code, sd,
                                    (double)got);
                        continue;
                    }
                    if (o->rule == FM_SCALE_RULE_MX_FLOOR && v > emax) {
                        float sat = fm_f32_canon((float)(xv < 0 ? -emax : emax) * s);
                        if (fm_f32_bits(got) != fm_f32_bits(sat))
                            fz_fail("MX_FLOOR saturation: %g / %g should give %g, got %g", (double)xv, sd,
                                    (double)sat, (double)got);
                        continue;
                    }
                    double bound = 0.5 * quantum(o->t.dtype, v) * sd + ldexp(1.0, -149);
                    if (o->rule == FM_SCALE_RULE_EXACT)
                        bound = bound * (1 + ldexp(1.0, -20)) + fabs((double)xv) * ldexp(1.0, -21);
                    if (fabs((double)got - (double)xv) > bound)
                        fz_fail("round trip %s %s %s rule %d: x %a -> %a (scale %a), error %g > bound %g",
                                o->colwise ? "colwise" : "rowwise", fm_dtype_name(o->t.dtype),
                                fm_scale_mode_name(o->t.scale_mode), (int)o->rule, (double)xv, (double)got, sd,
                                fabs((double)got - (double)xv), bound);
                }
    }
    free(y);
    for (int k = 0; k < nout; k++) {
        free(out[k].data);
        free(out[k].scale);
    }
    free(in);
    free(x);
    return 0;
}
