/* The non-finite policy of DESIGN.md, op by op, on the CPU reference: NaN,
 * +Inf, -Inf (NaN with payloads too) and overflow-sized finite values (3e38,
 * FLT_MAX, products beyond FLT_MAX) fed in chosen places, and for each op
 * the rule it documents, with "nothing finite where a non-finite went in"
 * checked from an independent dependency analysis:
 *
 *  - quantize (every dtype x mode, both layouts, F32/BF16/F16 input): a block
 *    holding NaN or Inf has a NaN scale and NaN codes and dequantizes to NaN,
 *    every other block (overflow-sized values included) is finite, the
 *    non-finite count is the number of such blocks over both outputs, amax is
 *    NaN if any NaN, else +Inf if any Inf, else max |x|; dequantize gives
 *    code x scale in F32 (NaN exactly in the NaN blocks);
 *  - quantize_grouped: column-wise blocks restart at every group, so a NaN
 *    stays in its group's blocks; it reports no count (refused if asked);
 *  - transpose_scaled, convert_scaled, the grouped transpose: an output
 *    block is non-finite (NaN scale, NaN codes, counted) exactly when one of
 *    its elements came from a NaN scale or a NaN/Inf code; the 128x128
 *    transpose moves NaN and Inf scales unchanged; an Inf input scale of a
 *    power-of-two mode is refused and nothing is written;
 *  - fm_cast: NaN stays NaN, Inf keeps its sign, overflow rounds to Inf;
 *  - every GEMM (dense for each scale pair, linear forward / dgrad / wgrad,
 *    m-grouped, k-grouped; BF16 and F32 output; accumulate into a D holding
 *    NaN and Inf): the exact rule (tests/gemm_ref.h) bit for bit, every output
 *    whose dot product includes a NaN/Inf element, a NaN/Inf scale or whose
 *    old D is non-finite is non-finite, every other one finite; with
 *    overflow-sized finite operands: +-Inf exactly where the exact value is
 *    beyond the output's range, never NaN, and exact cancellation stays
 *    finite (the double rule);
 *  - router: a token with a NaN logit gets NaN probabilities and k distinct
 *    valid ids (sigmoid: the NaN expert ranked last), other tokens are
 *    untouched; the backward gives a NaN row; NaN/Inf dprobs reach every
 *    dlogit they feed (softmax: the whole row; sigmoid: the chosen experts).
 *    +-Inf logits: moe.h is silent; what happens follows from mathfn.h's
 *    documented sigmoid(+-Inf) = 1 / 0 and the softmax exp(x - max) form, and
 *    is checked as such (see the report of issue 10);
 *  - permute: codes, scales (NaN payloads included) and probs move byte for
 *    byte; unpermute: the documented fmaf chain, so NaN and Inf reach the
 *    sum, 3e38 + 3e38 overflows to Inf; its backward: w * dout and the
 *    fixed-order dot, non-finite wherever a non-finite input feeds them;
 *  - SwiGLU and its backward: the F32 results of mathfn.h's formulas (silu
 *    of -Inf is NaN, documented), non-finite wherever a non-finite input
 *    feeds them, quantized with NaN blocks exactly where they are
 *    non-finite (overflow of finite inputs included) and counted;
 *  - EP combine: the plain F32 sum over the visited ranks carries NaN and
 *    Inf and overflows to Inf; dispatch moves NaN payloads unchanged. */
#include <float.h>
#include <math.h>
#include <pthread.h>

#include "flowmoe/mathfn.h"
#include "gemm_ref.h"

static const uint32_t NAN_BITS[] = {0x7FC00000u, 0xFFC12345u, 0x7FA00001u};
static const uint32_t INF_BITS[] = {0x7F800000u, 0xFF800000u};

static int nonfinite_f(float v) { return !isfinite(v); }

/* ---- quantized tensors as the test reads them --------------------------------- */

typedef struct {
    ref_spec s;
    int64_t rows, cols; /* logical */
    const uint8_t *codes;
    const void *scales;
} qview;

static qview qv_of(const fm_tensor *t)
{
    qview q = {{t->dtype, t->scale_mode, t->layout, t->scale_layout}, t->shape[0], t->shape[1], t->data, t->scale};
    return q;
}

static int code_nonfinite(fm_dtype dt, uint8_t c)
{
    return dt == FM_DTYPE_E4M3 ? (c & 0x7F) == 0x7F : dt == FM_DTYPE_E5M2 ? (c & 0x7C) == 0x7C : 0;
}

static uint8_t nan_code(fm_dtype dt) { return dt == FM_DTYPE_E4M3 ? 0x7F : dt == FM_DTYPE_E5M2 ? 0x7E : 0; }

/* logical (i, j) -> stored (r, c) */
static void stored_rc(const qview *q, int64_t i, int64_t j, int64_t *r, int64_t *c)
{
    *r = q->s.layout == FM_LAYOUT_COLWISE ? j : i;
    *c = q->s.layout == FM_LAYOUT_COLWISE ? i : j;
}

static uint8_t q_code(const qview *q, int64_t i, int64_t j)
{
    int64_t r, c;
    stored_rc(q, i, j, &r, &c);
    return ref_get_code(&q->s, q->codes, 1, q->rows, q->cols, 0, r, c);
}

static float q_scale(const qview *q, int64_t i, int64_t j)
{
    int64_t r, c;
    stored_rc(q, i, j, &r, &c);
    return ref_get_scale(&q->s, q->scales, q->rows, q->cols, 0, r, c);
}

static int q_elem_nonfinite(const qview *q, int64_t i, int64_t j)
{
    return !isfinite(q_scale(q, i, j)) || code_nonfinite(q->s.dtype, q_code(q, i, j));
}

typedef int (*bad_fn)(const void *arg, int64_t i, int64_t j);

/* Every block of q: non-finite (NaN scale: canonical F32 NaN or E8M0 0xFF;
 * every code the element NaN) exactly when bad() holds for one of its
 * elements, else a finite positive scale and no NaN/Inf code. Returns the
 * number of non-finite blocks. */
static int64_t check_blocks(const qview *q, bad_fn bad, const void *arg, const char *cs)
{
    int64_t R = ref_stored_rows(&q->s, q->rows, q->cols), C = ref_stored_cols(&q->s, q->rows, q->cols);
    int64_t br = ref_block_rows(q->s.mode, R), bc = ref_block_cols(q->s.mode, C);
    int64_t nbr = q->s.mode == FM_SCALE_TENSOR ? (R > 0) : (R + br - 1) / br;
    int64_t nbc = q->s.mode == FM_SCALE_TENSOR || q->s.mode == FM_SCALE_ROW ? (C > 0) : (C + bc - 1) / bc;
    int64_t nbad = 0, wrong = 0;
    for (int64_t rb = 0; rb < nbr; rb++)
        for (int64_t cb = 0; cb < nbc; cb++) {
            int64_t r0 = rb * br, r1 = r0 + br < R ? r0 + br : R, c0 = cb * bc, c1 = c0 + bc < C ? c0 + bc : C;
            int any = 0;
            for (int64_t r = r0; r < r1 && !any; r++)
                for (int64_t c = c0; c < c1 && !any; c++)
                    any = q->s.layout == FM_LAYOUT_COLWISE ? bad(arg, c, r) : bad(arg, r, c);
            nbad += any;
            int64_t off = ref_scale_offset(q->s.mode, q->s.slayout, R, C, r0, c0);
            uint32_t sbits = q->s.mode == FM_SCALE_MX32 ? ((const uint8_t *)q->scales)[off]
                                                        : tu_f32_bits(((const float *)q->scales)[off]);
            float sv = ref_get_scale(&q->s, q->scales, q->rows, q->cols, 0, r0, c0);
            int scale_ok = any ? sbits == (q->s.mode == FM_SCALE_MX32 ? 0xFFu : 0x7FC00000u) : isfinite(sv) && sv > 0;
            int codes_ok = 1;
            for (int64_t r = r0; r < r1; r++)
                for (int64_t c = c0; c < c1; c++) {
                    uint8_t code = ref_get_code(&q->s, q->codes, 1, q->rows, q->cols, 0, r, c);
                    codes_ok &= any ? code == nan_code(q->s.dtype) : !code_nonfinite(q->s.dtype, code);
                }
            tu_checks++;
            if ((!scale_ok || !codes_ok) && wrong++ < 3)
                tu_fail(__FILE__, __LINE__, "block non-finite exactly when an input is",
                        "%s: stored block (%lld, %lld) of %s %s %s: input non-finite %d, scale bits 0x%x, codes %s", cs,
                        (long long)rb, (long long)cb, fm_dtype_name(q->s.dtype), fm_scale_mode_name(q->s.mode),
                        fm_layout_name(q->s.layout), any, sbits, codes_ok ? "ok" : "wrong");
        }
    return nbad;
}

typedef struct {
    const float *x;
    int64_t cols;
} fgrid;

static int bad_f32(const void *arg, int64_t i, int64_t j)
{
    const fgrid *g = arg;
    return nonfinite_f(g->x[i * g->cols + j]);
}

static int bad_q(const void *arg, int64_t i, int64_t j) { return q_elem_nonfinite((const qview *)arg, i, j); }

/* ---- quantize and dequantize ---------------------------------------------------- */

/* n values with every kind of special in chosen places. */
static void fill_specials(float *x, int64_t n, int dense)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)tu_normal();
    int reps = dense ? 3 : 1;
    for (int r = 0; r < reps; r++) {
        for (size_t k = 0; k < 3; k++)
            x[tu_randint(0, n - 1)] = tu_bits_f32(NAN_BITS[k]);
        for (size_t k = 0; k < 2; k++)
            x[tu_randint(0, n - 1)] = tu_bits_f32(INF_BITS[k]);
        x[tu_randint(0, n - 1)] = 3e38f;
        x[tu_randint(0, n - 1)] = -3.3e38f;
        x[tu_randint(0, n - 1)] = FLT_MAX;
    }
}

static void quantize_policy(fm_context *ctx)
{
    const int64_t rows = 136, cols = 264, n = rows * cols;
    float *x = malloc(sizeof(float) * (size_t)n), *xr = malloc(sizeof(float) * (size_t)n);
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)n);
    float *deq = malloc(sizeof(float) * (size_t)n), *want = malloc(sizeof(float) * (size_t)n);
    char cs[200];
    for (size_t ci = 0; ci < tu_ncombos; ci++)
        for (int idt = 0; idt < 3; idt++) {
            fm_dtype in_dt = idt == 0 ? FM_DTYPE_F32 : idt == 1 ? FM_DTYPE_BF16 : FM_DTYPE_F16;
            fill_specials(x, n, (int)(ci + (size_t)idt) % 2);
            void *inbuf = x;
            if (in_dt == FM_DTYPE_F32)
                memcpy(xr, x, sizeof(float) * (size_t)n);
            else
                tu_store_input(x, n, in_dt, h, xr), inbuf = h;
            fm_tensor tin = fm_tensor_2d(inbuf, in_dt, rows, cols);
            tu_qout q[2];
            for (int k = 0; k < 2; k++) {
                ref_spec s = {tu_combos[ci].dt, tu_combos[ci].m, (fm_layout)k,
                              (fm_scale_layout)((ci + (size_t)k + (size_t)idt) & 1)};
                tu_qout_init(&q[k], &s, 2, 1, rows, cols);
                tu_qout_poison(&q[k], 0x5A);
            }
            float amax = 1.0f;
            int64_t nf = -1;
            fm_quant_config cfg = {.amax = &amax, .nonfinite_blocks = &nf};
            snprintf(cs, sizeof cs, "quantize %s %s from %s", fm_dtype_name(tu_combos[ci].dt),
                     fm_scale_mode_name(tu_combos[ci].m), fm_dtype_name(in_dt));
            fm_status st = fm_quantize(ctx, &cfg, &tin, &q[0].t, &q[1].t);
            CHECK(st == FM_OK, "%s: %s", cs, fm_last_error(ctx));
            if (st == FM_OK) {
                fgrid g = {xr, cols};
                int64_t want_nf = 0;
                for (int k = 0; k < 2; k++) {
                    qview v = qv_of(&q[k].t);
                    want_nf += check_blocks(&v, bad_f32, &g, cs);
                    /* dequantize: code x scale in F32, NaN exactly in the NaN blocks */
                    fm_tensor to = fm_tensor_2d(deq, FM_DTYPE_F32, rows, cols);
                    CHECK(fm_dequantize(ctx, &q[k].t, &to) == FM_OK, "%s: dequantize: %s", cs, fm_last_error(ctx));
                    ref_dequantize(q[k].data.p, q[k].scale.p, 1, rows, cols, &q[k].s, FM_DTYPE_F32, FM_LAYOUT_ROWWISE,
                                   want);
                    int64_t bad = 0;
                    for (int64_t i = 0; i < rows; i++)
                        for (int64_t j = 0; j < cols; j++) {
                            float d = deq[i * cols + j];
                            int nanblk = isnan(q_scale(&v, i, j));
                            tu_checks++;
                            if ((tu_f32_bits(d) != tu_f32_bits(want[i * cols + j]) || (nanblk != isnan(d))) &&
                                bad++ < 3)
                                tu_fail(__FILE__, __LINE__, "dequantize = code x scale, NaN iff NaN block",
                                        "%s out %d (%lld, %lld): got %a want %a (NaN block %d, input %a)", cs, k,
                                        (long long)i, (long long)j, (double)d, (double)want[i * cols + j], nanblk,
                                        (double)xr[i * cols + j]);
                        }
                }
                CHECK(nf == want_nf && nf > 0, "%s: nonfinite_blocks %lld, want %lld", cs, (long long)nf,
                      (long long)want_nf);
                int any_nan = 0, any_inf = 0;
                uint32_t mx = 0;
                for (int64_t i = 0; i < n; i++) {
                    any_nan |= isnan(xr[i]);
                    any_inf |= isinf(xr[i]);
                    uint32_t a = tu_f32_bits(xr[i]) & 0x7FFFFFFFu;
                    if (isfinite(xr[i]) && a > mx)
                        mx = a;
                }
                uint32_t want_amax = any_nan ? 0x7FC00000u : any_inf ? 0x7F800000u : mx;
                CHECK_EQ_U(tu_f32_bits(amax), want_amax, "%s: amax", cs);
            }
            tu_qout_free(&q[0]);
            tu_qout_free(&q[1]);
        }
    free(x), free(xr), free(h), free(deq), free(want);
}

/* Column-wise blocks of fm_quantize_grouped restart at every group. */
static void quantize_grouped_policy(fm_context *ctx)
{
    const int64_t cols = 200;
    static const int64_t sp4[] = {0, 70, 1, 0, 65}, sp2[] = {0, 70, 2, 0, 64};
    char cs[160];
    for (int v = 0; v < 2; v++) {
        const int64_t *sp = v ? sp2 : sp4;
        int64_t G = 5, rows = 136;
        fm_dtype dt = v ? FM_DTYPE_E2M1 : FM_DTYPE_E4M3;
        fm_scale_mode m = v ? FM_SCALE_MX32 : FM_SCALE_BLOCK_1x128;
        fm_scale_layout sl = v ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
        snprintf(cs, sizeof cs, "quantize_grouped %s %s", fm_dtype_name(dt), fm_scale_mode_name(m));
        float *x = malloc(sizeof(float) * (size_t)(rows * cols));
        for (int64_t i = 0; i < rows * cols; i++)
            x[i] = (float)tu_normal();
        /* a NaN in the last row of group 1 and an Inf in the first row of group 4: their column
         * blocks must not reach the neighbouring group */
        x[69 * cols + 5] = tu_bits_f32(NAN_BITS[1]);
        x[71 * cols + 100] = tu_bits_f32(INF_BITS[1]);
        x[72 * cols + 33] = 3e38f;
        fm_splits s = {G, sp, NULL};
        fm_tensor tin = fm_tensor_2d(x, FM_DTYPE_F32, rows, cols);
        fm_tensor col = fm_tensor_quant_2d(NULL, dt, rows, cols, FM_LAYOUT_COLWISE, m, NULL, sl);
        int64_t ns = fm_tensor_grouped_scale_count(&col, &s) * (v ? 1 : 4);
        tu_buf cd = tu_buf_new((size_t)fm_tensor_nbytes(&col)), csb = tu_buf_new((size_t)ns);
        tu_buf_poison(&cd, 0x33), tu_buf_poison(&csb, 0x33);
        col.data = cd.p, col.scale = csb.p;
        fm_quant_config cfg = {0};
        fm_status st = fm_quantize_grouped(ctx, &cfg, &s, &tin, NULL, &col);
        CHECK(st == FM_OK, "%s: %s", cs, fm_last_error(ctx));
        if (st == FM_OK) {
            int64_t r0 = 0, s0 = 0, nbad = 0;
            for (int64_t g = 0; g < G; g++) {
                int64_t mg = sp[g];
                /* group g alone: a column-wise [mg, cols] matrix with its own scales */
                fm_tensor one = col;
                one.shape[0] = mg;
                one.data = cd.p + r0 * cols * (v ? 1 : 2) / 2;
                one.scale = csb.p + s0 * (v ? 1 : 4);
                qview q = qv_of(&one);
                fgrid gr = {x + r0 * cols, cols};
                if (mg > 0)
                    nbad += check_blocks(&q, bad_f32, &gr, cs);
                s0 += ref_scale_count(m, sl, cols, mg);
                r0 += mg;
            }
            /* NaN: 1 block (group 1); Inf: 1 block (group 4); 3e38 is finite */
            CHECK(nbad == 2, "%s: %lld non-finite column blocks over the groups, want 2", cs, (long long)nbad);
            CHECK(tu_buf_guard_ok(&cd) && tu_buf_guard_ok(&csb), "%s: wrote past the grouped buffers", cs);
        }
        int64_t cnt = 0;
        fm_quant_config ask = {.nonfinite_blocks = &cnt};
        CHECK(fm_quantize_grouped(ctx, &ask, &s, &tin, NULL, &col) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "cfg->nonfinite_blocks"),
              "%s: a count it cannot give is refused, naming cfg->nonfinite_blocks: %s", cs, fm_last_error(ctx));
        tu_buf_free(&cd), tu_buf_free(&csb);
        free(x);
    }
}

/* ---- transposes and conversions ----------------------------------------------------- */

typedef struct {
    fm_dtype dt;
    fm_scale_mode m;
    fm_layout lay;
    fm_scale_layout sl;
} qfmt;

/* A quantized [rows, cols] input from F32 data with NaN and Inf, then codes
 * the quantizer never writes poked into finite blocks: an E4M3 NaN code, E5M2
 * +-Inf codes. */
static void make_requant_input(fm_context *ctx, const qfmt *f, int64_t rows, int64_t cols, tu_qout *q)
{
    float *x = malloc(sizeof(float) * (size_t)(rows * cols));
    for (int64_t i = 0; i < rows * cols; i++)
        x[i] = (float)tu_normal();
    x[tu_randint(0, rows * cols - 1)] = tu_bits_f32(NAN_BITS[0]);
    x[tu_randint(0, rows * cols - 1)] = tu_bits_f32(INF_BITS[1]);
    x[tu_randint(0, rows * cols - 1)] = 3e38f;
    ref_spec s = {f->dt, f->m, f->lay, f->sl};
    tu_qout_init(q, &s, 2, 1, rows, cols);
    fm_tensor tin = fm_tensor_2d(x, FM_DTYPE_F32, rows, cols);
    fm_quant_config cfg = {0};
    if (fm_quantize(ctx, &cfg, &tin, f->lay == FM_LAYOUT_ROWWISE ? &q->t : NULL,
                    f->lay == FM_LAYOUT_COLWISE ? &q->t : NULL) != FM_OK) {
        fprintf(stderr, "quantize: %s\n", fm_last_error(ctx));
        exit(1);
    }
    qview v = qv_of(&q->t);
    for (int p = 0; p < 3; p++) {
        int64_t i = tu_randint(0, rows - 1), j = tu_randint(0, cols - 1);
        if (f->dt == FM_DTYPE_E2M1 || q_elem_nonfinite(&v, i, j))
            continue;
        int64_t r, c;
        stored_rc(&v, i, j, &r, &c);
        int64_t R = ref_stored_rows(&s, rows, cols), C = ref_stored_cols(&s, rows, cols);
        uint8_t code = f->dt == FM_DTYPE_E4M3 ? (p ? 0xFF : 0x7F) : (p ? 0xFC : 0x7C);
        ((uint8_t *)q->data.p)[r * C + c] = code;
        (void)R;
    }
    free(x);
}

static void requant_policy(fm_context *ctx)
{
    const int64_t rows = 136, cols = 264;
    typedef struct {
        qfmt in, out;
        fm_requant_rule rule;
        int transpose;
    } rcase;
    static const rcase cases[] = {
        {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT},
         {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE, FM_SCALE_LAYOUT_COMPACT}, FM_REQUANT_TIGHT, 1},
        {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_GEMM},
         {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE, FM_SCALE_LAYOUT_GEMM}, FM_REQUANT_ROWMAX, 1},
        {{FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT},
         {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE, FM_SCALE_LAYOUT_COMPACT}, FM_REQUANT_TIGHT, 1},
        {{FM_DTYPE_E5M2, FM_SCALE_MX32, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT},
         {FM_DTYPE_E2M1, FM_SCALE_MX32, FM_LAYOUT_COLWISE, FM_SCALE_LAYOUT_COMPACT}, FM_REQUANT_TIGHT, 1},
        {{FM_DTYPE_E2M1, FM_SCALE_MX32, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT},
         {FM_DTYPE_E2M1, FM_SCALE_MX32, FM_LAYOUT_COLWISE, FM_SCALE_LAYOUT_GEMM}, FM_REQUANT_MX_FLOOR, 1},
        {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE, FM_SCALE_LAYOUT_COMPACT},
         {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT}, FM_REQUANT_TIGHT, 1},
        {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT},
         {FM_DTYPE_E2M1, FM_SCALE_MX32, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT}, FM_REQUANT_TIGHT, 0},
        {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT},
         {FM_DTYPE_E2M1, FM_SCALE_MX32, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_GEMM}, FM_REQUANT_MX_FLOOR, 0},
        {{FM_DTYPE_E2M1, FM_SCALE_MX32, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT},
         {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT}, FM_REQUANT_TIGHT, 0},
        {{FM_DTYPE_E5M2, FM_SCALE_MX32, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT},
         {FM_DTYPE_E4M3, FM_SCALE_MX32, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT}, FM_REQUANT_TIGHT, 0},
    };
    char cs[200];
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const rcase *rc = &cases[ci];
        snprintf(cs, sizeof cs, "%s %s %s %s -> %s %s %s rule %d", rc->transpose ? "transpose_scaled" : "convert_scaled",
                 fm_dtype_name(rc->in.dt), fm_scale_mode_name(rc->in.m), fm_layout_name(rc->in.lay),
                 fm_dtype_name(rc->out.dt), fm_scale_mode_name(rc->out.m), fm_layout_name(rc->out.lay), (int)rc->rule);
        for (int rep = 0; rep < 2; rep++) {
            tu_qout in, out;
            make_requant_input(ctx, &rc->in, rows, cols, &in);
            ref_spec so = {rc->out.dt, rc->out.m, rc->out.lay, rc->out.sl};
            tu_qout_init(&out, &so, 2, 1, rows, cols);
            tu_qout_poison(&out, 0x44);
            int64_t nf = -1;
            fm_requant_config cfg = {rc->rule, &nf, 0};
            fm_status st = rc->transpose ? fm_transpose_scaled(ctx, &cfg, &in.t, &out.t)
                                         : fm_convert_scaled(ctx, &cfg, &in.t, &out.t);
            CHECK(st == FM_OK, "%s: %s", cs, fm_last_error(ctx));
            if (st == FM_OK) {
                qview vi = qv_of(&in.t), vo = qv_of(&out.t);
                int64_t want = check_blocks(&vo, bad_q, &vi, cs);
                CHECK(nf == want && want > 0, "%s: nonfinite_blocks %lld, want %lld", cs, (long long)nf,
                      (long long)want);
            }
            /* an Inf input scale is not a power of two: refused, nothing written */
            if (rc->in.m == FM_SCALE_BLOCK_1x128) {
                tu_qout_poison(&out, 0x44);
                ((float *)in.scale.p)[tu_randint(0, (int64_t)(in.scale.n / 4) - 1)] =
                    tu_bits_f32(INF_BITS[tu_randint(0, 1)]);
                nf = -7;
                st = rc->transpose ? fm_transpose_scaled(ctx, &cfg, &in.t, &out.t)
                                   : fm_convert_scaled(ctx, &cfg, &in.t, &out.t);
                int untouched = nf == -7;
                for (size_t b = 0; b < out.data.n; b++)
                    untouched &= out.data.p[b] == 0x44;
                for (size_t b = 0; b < out.scale.n; b++)
                    untouched &= out.scale.p[b] == 0x44;
                CHECK(st == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "in") && untouched,
                      "%s with an Inf input scale: %s (%s), output untouched %d", cs, fm_status_name(st),
                      fm_last_error(ctx), untouched);
            }
            tu_qout_free(&in);
            tu_qout_free(&out);
        }
    }

    /* 128x128 -> 128x128: the exact transpose moves NaN and Inf scales unchanged */
    {
        qfmt f = {FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT};
        tu_qout in, out;
        make_requant_input(ctx, &f, 300, 260, &in);
        float *s = (float *)in.scale.p; /* [3, 3] compact */
        s[1] = tu_bits_f32(INF_BITS[0]);
        s[5] = tu_bits_f32(NAN_BITS[1]);
        ref_spec so = {FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_LAYOUT_COLWISE, FM_SCALE_LAYOUT_COMPACT};
        tu_qout_init(&out, &so, 2, 1, 300, 260);
        tu_qout_poison(&out, 0x44);
        fm_requant_config cfg = {0};
        CHECK(fm_transpose_scaled(ctx, &cfg, &in.t, &out.t) == FM_OK, "128x128 transpose: %s", fm_last_error(ctx));
        qview vi = qv_of(&in.t), vo = qv_of(&out.t);
        int64_t bad = 0;
        for (int64_t i = 0; i < 300; i++)
            for (int64_t j = 0; j < 260; j++) {
                tu_checks++;
                if ((q_code(&vi, i, j) != q_code(&vo, i, j) ||
                     tu_f32_bits(q_scale(&vi, i, j)) != tu_f32_bits(q_scale(&vo, i, j))) &&
                    bad++ < 3)
                    tu_fail(__FILE__, __LINE__, "128x128 transpose moves codes and scales",
                            "(%lld, %lld): code 0x%x -> 0x%x, scale 0x%x -> 0x%x", (long long)i, (long long)j,
                            q_code(&vi, i, j), q_code(&vo, i, j), tu_f32_bits(q_scale(&vi, i, j)),
                            tu_f32_bits(q_scale(&vo, i, j)));
            }
        tu_qout_free(&in);
        tu_qout_free(&out);
    }

    /* per-expert transpose: a NaN stays in its expert's blocks */
    {
        static const int64_t sp[] = {0, 70, 1, 0, 65};
        fm_splits s = {5, sp, NULL};
        qfmt f = {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT};
        tu_qout in;
        make_requant_input(ctx, &f, rows, cols, &in);
        /* a NaN code at the last row of expert 1, next to expert 2's single row */
        ((uint8_t *)in.data.p)[69 * cols + 17] = 0x7F;
        fm_tensor out = fm_tensor_quant_2d(NULL, FM_DTYPE_E4M3, rows, cols, FM_LAYOUT_COLWISE, FM_SCALE_BLOCK_1x128,
                                           NULL, FM_SCALE_LAYOUT_COMPACT);
        int64_t ns = fm_tensor_grouped_scale_count(&out, &s) * 4;
        tu_buf od = tu_buf_new((size_t)fm_tensor_nbytes(&out)), os = tu_buf_new((size_t)ns);
        out.data = od.p, out.scale = os.p;
        int64_t nf = -1;
        fm_requant_config cfg = {FM_REQUANT_TIGHT, &nf, 0};
        fm_status st = fm_transpose_scaled_grouped(ctx, &cfg, &s, &in.t, &out);
        CHECK(st == FM_OK, "grouped transpose: %s", fm_last_error(ctx));
        if (st == FM_OK) {
            qview vi = qv_of(&in.t);
            int64_t r0 = 0, s0 = 0, want = 0;
            for (int g = 0; g < 5; g++) {
                fm_tensor one = out;
                one.shape[0] = sp[g];
                one.data = od.p + r0 * cols;
                one.scale = os.p + s0 * 4;
                qview vo = qv_of(&one);
                /* the group's input rows, as a view shifted by r0 */
                qview vg = vi;
                vg.rows = sp[g];
                vg.codes = (const uint8_t *)in.data.p + r0 * cols;
                vg.scales = (const float *)in.scale.p + r0 * ((cols + 127) / 128);
                if (sp[g])
                    want += check_blocks(&vo, bad_q, &vg, "grouped transpose");
                s0 += ref_scale_count(FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, cols, sp[g]);
                r0 += sp[g];
            }
            CHECK(nf == want && want > 0, "grouped transpose: nonfinite_blocks %lld, want %lld", (long long)nf,
                  (long long)want);
        }
        tu_qout_free(&in);
        tu_buf_free(&od), tu_buf_free(&os);
    }
}

/* ---- fm_cast ---------------------------------------------------------------------------- */

static void cast_policy(fm_context *ctx)
{
    enum { N = 64 };
    float x[N];
    for (int i = 0; i < N; i++)
        x[i] = (float)tu_normal();
    static const uint32_t sp[] = {0x7FC00000u, 0xFFC12345u, 0x7FA00001u, 0x7F800000u, 0xFF800000u,
                                  0x7F7FFFFFu /* FLT_MAX */, 0x7F61B1E6u /* 3e38 */, 0xC7800000u /* -65536 */,
                                  0x477FF000u /* 65520: F16 max + half ulp */, 0x00000001u};
    for (size_t i = 0; i < sizeof sp / sizeof sp[0]; i++)
        x[i * 5] = tu_bits_f32(sp[i]);
    static const fm_dtype dts[3] = {FM_DTYPE_F32, FM_DTYPE_BF16, FM_DTYPE_F16};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
            if (a == b)
                continue;
            uint16_t src16[N], dst16[N];
            float src32[N], dst32[N], vals[N];
            void *src = a == 0 ? (void *)src32 : (void *)src16, *dst = b == 0 ? (void *)dst32 : (void *)dst16;
            if (a == 0)
                memcpy(src32, x, sizeof x), memcpy(vals, x, sizeof x);
            else
                tu_store_input(x, N, dts[a], src16, vals);
            memset(dst32, 0x55, sizeof dst32), memset(dst16, 0x55, sizeof dst16);
            fm_tensor ti = fm_tensor_2d(src, dts[a], 4, N / 4), to = fm_tensor_2d(dst, dts[b], 4, N / 4);
            CHECK(fm_cast(ctx, &ti, &to) == FM_OK, "cast %s -> %s: %s", fm_dtype_name(dts[a]), fm_dtype_name(dts[b]),
                  fm_last_error(ctx));
            for (int i = 0; i < N; i++) {
                double got = b == 0 ? (double)dst32[i] : or_decode(b == 1 ? OF_BF16 : OF_F16, dst16[i]);
                double want = b == 0 ? (double)vals[i] : or_decode(b == 1 ? OF_BF16 : OF_F16,
                                                                    or_encode(b == 1 ? OF_BF16 : OF_F16, vals[i]));
                int ok = isnan(vals[i]) ? isnan(got) : got == want;
                CHECK(ok, "cast %s -> %s: %a gave %a, want %a", fm_dtype_name(dts[a]), fm_dtype_name(dts[b]),
                      (double)vals[i], got, want);
                CHECK(!nonfinite_f(vals[i]) || !isfinite(got), "cast %s -> %s: non-finite %a became %a",
                      fm_dtype_name(dts[a]), fm_dtype_name(dts[b]), (double)vals[i], got);
            }
        }
}

/* ---- GEMMs ---------------------------------------------------------------------------------- */

enum { P_NAN, P_PINF, P_NINF, P_NAN_SCALE, P_INF_SCALE, P_KINDS };

/* A non-finite input at operand element (e, r, k): a NaN / +-Inf element (E4M3
 * has no Inf: a NaN code), or a NaN / Inf scale (an unscaled operand: a NaN
 * element instead). */
static void poke(gr_op *o, int64_t e, int64_t r, int64_t k, int what)
{
    if ((what == P_NAN_SCALE || what == P_INF_SCALE) && o->mode != FM_SCALE_NONE) {
        *gr_scale_ptr(o, e, r, k) = what == P_NAN_SCALE ? tu_bits_f32(NAN_BITS[tu_randint(0, 2)])
                                                        : tu_bits_f32(INF_BITS[tu_randint(0, 1)]);
        return;
    }
    if (what != P_PINF && what != P_NINF)
        what = P_NAN;
    if (o->dt == FM_DTYPE_E4M3)
        what = P_NAN;
    int neg = what == P_NINF;
    uint32_t bits;
    double v = what == P_NAN ? NAN : neg ? -INFINITY : INFINITY;
    switch (o->dt) {
    case FM_DTYPE_E4M3: bits = tu_randint(0, 1) ? 0xFFu : 0x7Fu; break;
    case FM_DTYPE_E5M2: bits = what == P_NAN ? (tu_randint(0, 1) ? 0x7Eu : 0xFDu) : neg ? 0xFCu : 0x7Cu; break;
    case FM_DTYPE_BF16: bits = what == P_NAN ? (tu_randint(0, 1) ? 0x7FC0u : 0xFFA1u) : neg ? 0xFF80u : 0x7F80u; break;
    default: bits = what == P_NAN ? NAN_BITS[tu_randint(0, 2)] : INF_BITS[neg]; break;
    }
    o->v[(e * o->rows + r) * o->K + k] = v;
    gr_store(o, e, r, k, bits);
}

/* Element (e, r, k) of an operand holds or is scaled by a non-finite value. */
static int op_nonfinite(const gr_op *o, int64_t e, int64_t r, int64_t k)
{
    return !isfinite(o->v[(e * o->rows + r) * o->K + k]) || !isfinite(gr_scale(o, e, r, k));
}

/* An overflow-sized operand element: 3e38 (BF16: its nearest value), or an
 * FP8 max code in a block scaled by 2^110 (code x scale stays below
 * FLT_MAX, products of two exceed it). */
static void poke_huge(gr_op *o, int64_t e, int64_t r, int64_t k, int neg)
{
    uint32_t bits;
    double v;
    if (o->dt == FM_DTYPE_E4M3 || o->dt == FM_DTYPE_E5M2) {
        bits = (o->dt == FM_DTYPE_E4M3 ? 0x7Eu : 0x7Bu) | (neg ? 0x80u : 0u);
        v = or_decode(or_from_dtype(o->dt), bits);
        if (o->mode != FM_SCALE_NONE) {
            /* the element's whole block gets the large scale: rescale its other values too */
            float *sp = gr_scale_ptr(o, e, r, k), old = *sp;
            if (old != 0x1p110f) {
                for (int64_t rr = 0; rr < o->rows; rr++)
                    for (int64_t kk = 0; kk < o->K; kk++)
                        if (gr_scale_ptr(o, e, rr, kk) == sp) {
                            gr_store(o, e, rr, kk, 0);
                            o->v[(e * o->rows + rr) * o->K + kk] = 0.0;
                        }
                *sp = 0x1p110f;
            }
        }
    } else if (o->dt == FM_DTYPE_BF16) {
        bits = or_encode(OF_BF16, neg ? -3e38 : 3e38);
        v = or_decode(OF_BF16, bits);
    } else {
        float f = neg ? -3e38f : 3e38f;
        bits = tu_f32_bits(f);
        v = f;
    }
    o->v[(e * o->rows + r) * o->K + k] = v;
    gr_store(o, e, r, k, bits);
}

typedef struct {
    const char *what;
    int huge;        /* the overflow scenario: no non-finite inputs */
    int accumulate;
    fm_dtype odt;
    int64_t bad, nonfinite_seen, inf_seen;
} gcheck;

/* One output element: the exact rule, and the policy. */
static void gemm_elem(gcheck *g, const void *d, int64_t i, double ref, uint32_t old, int64_t K, int dep)
{
    uint32_t want = gr_round(ref, g->odt, g->accumulate, old, K), got = gr_get_out(d, g->odt, i);
    double gv = g->odt == FM_DTYPE_BF16 ? or_decode(OF_BF16, got) : (double)tu_bits_f32(got);
    int old_nf = g->accumulate && !isfinite((double)tu_bits_f32(old));
    int must_nf = dep || old_nf;
    int ok = got == want && (!must_nf || !isfinite(gv)) && (g->huge || must_nf || isfinite(gv)) &&
             !(g->huge && !old_nf && isnan(gv));
    g->nonfinite_seen += !isfinite(gv);
    g->inf_seen += isinf(gv) ? 1 : 0; /* glibc's isinf(-Inf) may be -1 */
    tu_checks++;
    if (!ok && g->bad++ < 4)
        tu_fail(__FILE__, __LINE__, "GEMM output = the rule, non-finite exactly where a non-finite input feeds it",
                "%s element %lld: got 0x%x (%g) want 0x%x, depends on a non-finite input %d, old D non-finite %d",
                g->what, (long long)i, got, gv, want, dep, old_nf);
}

static void gemm_done(gcheck *g)
{
    CHECK(g->bad == 0, "%s: %lld outputs broke the rule", g->what, (long long)g->bad);
    CHECK(g->huge ? g->inf_seen > 0 : g->nonfinite_seen > 0, "%s: no output %s, the case tests nothing", g->what,
          g->huge ? "overflowed" : "was non-finite");
}

static void *gemm_out(int64_t n, fm_dtype dt, int accumulate)
{
    void *d = gr_out_new(n, dt, accumulate);
    if (accumulate) /* old D with NaN and Inf in it */
        for (int k = 0; k < 3; k++)
            ((float *)d)[tu_randint(0, n - 1)] = tu_bits_f32(k == 2 ? INF_BITS[1] : NAN_BITS[k]);
    return d;
}

/* dep[m * N + n]: the dot product of A row m (matrix ea, from row ra0) and B row n (matrix eb) meets a non-finite input. */
static void gemm_deps(const gr_op *A, int64_t ea, int64_t ra0, const gr_op *B, int64_t eb, int64_t M, char *dep)
{
    int64_t N = B->rows, K = A->K;
    char *na = calloc((size_t)(M * K + 1), 1), *nb = calloc((size_t)(N * K + 1), 1);
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++)
            na[m * K + k] = (char)op_nonfinite(A, ea, ra0 + m, k);
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++)
            nb[n * K + k] = (char)op_nonfinite(B, eb, n, k);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            char any = 0;
            for (int64_t k = 0; k < K && !any; k++)
                any = na[m * K + k] | nb[n * K + k];
            dep[m * N + n] = any;
        }
    free(na), free(nb);
}

/* A few non-finite inputs (nan scenario) or overflow-sized ones (huge). */
static void spoil(gr_op *o, int64_t e, int huge, int count)
{
    if (o->rows == 0 || o->K == 0)
        return;
    for (int c = 0; c < count; c++) {
        int64_t r = tu_randint(0, o->rows - 1), k = tu_randint(0, o->K - 1);
        if (huge)
            poke_huge(o, e, r, k, c % 3 == 2);
        else
            poke(o, e, r, k, (int)tu_randint(0, P_KINDS - 1));
    }
}

/* Two overflow-sized values meeting in one dot product (row ra of A's
 * matrix ea, row rb of B's matrix eb, the same k): the product overflows. */
static void overflow_pair(gr_op *A, int64_t ea, int64_t ra, gr_op *B, int64_t eb, int64_t rb)
{
    if (A->K == 0)
        return;
    int64_t k = tu_randint(0, A->K - 1);
    poke_huge(A, ea, ra, k, 0);
    poke_huge(B, eb, rb, k, 1);
}

typedef struct {
    fm_dtype a, b;
    fm_scale_mode ma, mb;
} gpair;

static const gpair gpairs[] = {
    {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_SCALE_TENSOR},
    {FM_DTYPE_E4M3, FM_DTYPE_E5M2, FM_SCALE_ROW, FM_SCALE_ROW},
    {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128},
    {FM_DTYPE_E5M2, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_1x128},
    {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_SCALE_BLOCK_128x128},
    {FM_DTYPE_BF16, FM_DTYPE_BF16, FM_SCALE_NONE, FM_SCALE_NONE},
    {FM_DTYPE_F32, FM_DTYPE_F32, FM_SCALE_NONE, FM_SCALE_NONE},
};
enum { NGPAIRS = sizeof gpairs / sizeof gpairs[0] };

/* Checks a product D [M, N] = A (matrix ea, rows ra0..) x B (matrix eb) at d + row0 * N. */
static void gemm_check_block(gcheck *g, const gr_op *A, int64_t ea, int64_t ra0, const gr_op *B, int64_t eb,
                             int64_t M, const void *d, const uint32_t *old, int64_t row0)
{
    int64_t N = B->rows;
    double *ref = malloc(sizeof(double) * (size_t)(M * N + 1));
    char *dep = malloc((size_t)(M * N + 1));
    gr_ref(A, ea, ra0, B, eb, M, ref);
    gemm_deps(A, ea, ra0, B, eb, M, dep);
    for (int64_t i = 0; i < M * N; i++)
        gemm_elem(g, d, row0 * N + i, ref[i], old ? old[row0 * N + i] : 0, A->K, dep[i]);
    free(ref), free(dep);
}

static void dense_policy(fm_context *ctx)
{
    char what[200];
    for (int p = 0; p < NGPAIRS; p++)
        for (int huge = 0; huge < 2; huge++)
            for (int v = 0; v < 2; v++) {
                const gpair *pr = &gpairs[p];
                int64_t M = tu_randint(20, 45), N = tu_randint(20, 40), K = tu_randint(150, 300);
                fm_dtype odt = v ? FM_DTYPE_F32 : FM_DTYPE_BF16;
                int acc = v && !huge;
                gr_op A, B;
                gr_make(&A, pr->a, pr->ma, FM_SCALE_LAYOUT_COMPACT, FM_LAYOUT_ROWWISE, 1, M, K, GR_RANDOM);
                gr_make(&B, pr->b, pr->mb, FM_SCALE_LAYOUT_GEMM, pr->mb ? FM_LAYOUT_ROWWISE : FM_LAYOUT_COLWISE, 1, N,
                        K, GR_RANDOM);
                spoil(&A, 0, huge, huge ? 4 : 3);
                spoil(&B, 0, huge, huge ? 4 : 3);
                if (huge)
                    overflow_pair(&A, 0, tu_randint(1, M - 1), &B, 0, tu_randint(1, N - 1));
                if (huge && pr->ma == FM_SCALE_NONE) {
                    /* an exact cancellation, 3e38 - 3e38 + small terms, in the dot product of rows 0:
                     * the double rule keeps it finite */
                    for (int64_t k = 0; k < K; k++) {
                        uint32_t one = pr->a == FM_DTYPE_BF16 ? 0x3F00u : 0x3F000000u; /* 0.5 */
                        gr_store(&A, 0, 0, k, one), A.v[k] = 0.5;
                        gr_store(&B, 0, 0, k, one), B.v[k] = 0.5;
                    }
                    poke_huge(&A, 0, 0, 0, 0), poke_huge(&A, 0, 0, 1, 0);
                    gr_store(&B, 0, 0, 0, pr->b == FM_DTYPE_BF16 ? 0x3F80u : 0x3F800000u), B.v[0] = 1.0;
                    gr_store(&B, 0, 0, 1, pr->b == FM_DTYPE_BF16 ? 0xBF80u : 0xBF800000u), B.v[1] = -1.0;
                }
                snprintf(what, sizeof what, "gemm %s %s x %s %s M %lld N %lld K %lld -> %s%s, %s inputs",
                         fm_dtype_name(pr->a), fm_scale_mode_name(pr->ma), fm_dtype_name(pr->b),
                         fm_scale_mode_name(pr->mb), (long long)M, (long long)N, (long long)K, fm_dtype_name(odt),
                         acc ? " accumulate" : "", huge ? "overflow-sized" : "NaN/Inf");
                void *d = gemm_out(M * N, odt, acc);
                uint32_t *old = malloc(sizeof(uint32_t) * (size_t)(M * N));
                memcpy(old, d, acc ? sizeof(uint32_t) * (size_t)(M * N) : 0);
                fm_tensor dt = fm_tensor_2d(d, odt, M, N);
                fm_gemm_config cfg = {.accumulate = acc};
                fm_status st = fm_gemm(ctx, &cfg, &A.t, &B.t, &dt);
                CHECK(st == FM_OK, "%s: %s", what, fm_last_error(ctx));
                if (st == FM_OK) {
                    gcheck g = {what, huge, acc, odt, 0, 0, 0};
                    gemm_check_block(&g, &A, 0, 0, &B, 0, M, d, acc ? old : NULL, 0);
                    if (huge && pr->ma == FM_SCALE_NONE) {
                        double c = odt == FM_DTYPE_BF16 ? or_decode(OF_BF16, gr_get_out(d, odt, 0))
                                                        : (double)tu_bits_f32(gr_get_out(d, odt, 0));
                        double w = 0.25 * (double)(K - 2);
                        if (odt == FM_DTYPE_BF16)
                            w = or_decode(OF_BF16, or_encode(OF_BF16, w));
                        CHECK(c == w, "%s: 3e38 - 3e38 + %lld x 0.25 in a dot product gave %g", what, (long long)(K - 2),
                              c);
                    }
                    gemm_done(&g);
                }
                free(d), free(old);
                gr_free(&A), gr_free(&B);
            }
}

static void linear_policy(fm_context *ctx)
{
    char what[160];
    for (int f = 0; f < 2; f++)
        for (int huge = 0; huge < 2; huge++) {
            int64_t T = 45, IN = 150, OUT = 37;
            fm_dtype d8 = f ? FM_DTYPE_BF16 : FM_DTYPE_E4M3, d5 = f ? FM_DTYPE_BF16 : FM_DTYPE_E5M2;
            fm_scale_mode m1 = f ? FM_SCALE_NONE : FM_SCALE_BLOCK_1x128, m2 = f ? FM_SCALE_NONE : FM_SCALE_BLOCK_128x128;
            const char *kind = f ? "BF16" : "FP8";
            /* forward: x [T, IN] x w [OUT, IN] */
            gr_op X, W, DY, WT, DYT, XT;
            gr_make(&X, d8, m1, FM_SCALE_LAYOUT_COMPACT, FM_LAYOUT_ROWWISE, 1, T, IN, GR_RANDOM);
            gr_make(&W, d8, m2, FM_SCALE_LAYOUT_GEMM, FM_LAYOUT_ROWWISE, 1, OUT, IN, GR_RANDOM);
            spoil(&X, 0, huge, 3), spoil(&W, 0, huge, 2);
            if (huge)
                overflow_pair(&X, 0, tu_randint(0, T - 1), &W, 0, tu_randint(0, OUT - 1));
            void *y = gemm_out(T * OUT, FM_DTYPE_BF16, 0);
            fm_tensor ty = fm_tensor_2d(y, FM_DTYPE_BF16, T, OUT);
            snprintf(what, sizeof what, "linear_forward %s, %s inputs", kind, huge ? "overflow-sized" : "NaN/Inf");
            fm_status st = fm_linear_forward(ctx, NULL, &X.t, &W.t, &ty);
            CHECK(st == FM_OK, "%s: %s", what, fm_last_error(ctx));
            if (st == FM_OK) {
                gcheck g = {what, huge, 0, FM_DTYPE_BF16, 0, 0, 0};
                gemm_check_block(&g, &X, 0, 0, &W, 0, T, y, NULL, 0);
                gemm_done(&g);
            }
            /* dgrad: dx [T, IN] = dy [T, OUT] . w, w given column-wise: its stored form is wT [IN, OUT] row-wise */
            gr_make(&DY, d5, m1, FM_SCALE_LAYOUT_COMPACT, FM_LAYOUT_ROWWISE, 1, T, OUT, GR_RANDOM);
            gr_make(&WT, d8, m2, FM_SCALE_LAYOUT_COMPACT, FM_LAYOUT_ROWWISE, 1, IN, OUT, GR_RANDOM);
            spoil(&DY, 0, huge, 3), spoil(&WT, 0, huge, 2);
            if (huge)
                overflow_pair(&DY, 0, tu_randint(0, T - 1), &WT, 0, tu_randint(0, IN - 1));
            void *dx = gemm_out(T * IN, FM_DTYPE_F32, 0);
            fm_tensor tdx = fm_tensor_2d(dx, FM_DTYPE_F32, T, IN), wcol = fm_tensor_t(&WT.t);
            snprintf(what, sizeof what, "linear_dgrad %s, %s inputs", kind, huge ? "overflow-sized" : "NaN/Inf");
            st = fm_linear_dgrad(ctx, NULL, &DY.t, &wcol, &tdx);
            CHECK(st == FM_OK, "%s: %s", what, fm_last_error(ctx));
            if (st == FM_OK) {
                gcheck g = {what, huge, 0, FM_DTYPE_F32, 0, 0, 0};
                gemm_check_block(&g, &DY, 0, 0, &WT, 0, T, dx, NULL, 0);
                gemm_done(&g);
            }
            /* wgrad: dw [OUT, IN] += dy^T x: dy and x column-wise, stored dyT [OUT, T] and xT [IN, T] */
            gr_make(&DYT, d5, m1, FM_SCALE_LAYOUT_GEMM, FM_LAYOUT_ROWWISE, 1, OUT, T, GR_RANDOM);
            gr_make(&XT, d8, m1, FM_SCALE_LAYOUT_COMPACT, FM_LAYOUT_ROWWISE, 1, IN, T, GR_RANDOM);
            spoil(&DYT, 0, huge, 3), spoil(&XT, 0, huge, 2);
            if (huge)
                overflow_pair(&DYT, 0, tu_randint(0, OUT - 1), &XT, 0, tu_randint(0, IN - 1));
            void *dw = gemm_out(OUT * IN, FM_DTYPE_F32, !huge);
            uint32_t *old = malloc(sizeof(uint32_t) * (size_t)(OUT * IN));
            memcpy(old, dw, sizeof(uint32_t) * (size_t)(OUT * IN));
            fm_tensor tdw = fm_tensor_2d(dw, FM_DTYPE_F32, OUT, IN), dyc = fm_tensor_t(&DYT.t), xc = fm_tensor_t(&XT.t);
            fm_gemm_config cfg = {.accumulate = !huge};
            snprintf(what, sizeof what, "linear_wgrad %s%s, %s inputs", kind, huge ? "" : " accumulate",
                     huge ? "overflow-sized" : "NaN/Inf");
            st = fm_linear_wgrad(ctx, &cfg, &dyc, &xc, &tdw);
            CHECK(st == FM_OK, "%s: %s", what, fm_last_error(ctx));
            if (st == FM_OK) {
                gcheck g = {what, huge, !huge, FM_DTYPE_F32, 0, 0, 0};
                gemm_check_block(&g, &DYT, 0, 0, &XT, 0, OUT, dw, huge ? NULL : old, 0);
                gemm_done(&g);
            }
            free(y), free(dx), free(dw), free(old);
            gr_free(&X), gr_free(&W), gr_free(&DY), gr_free(&WT), gr_free(&DYT), gr_free(&XT);
        }
}

static void grouped_policy(fm_context *ctx)
{
    static const int64_t sp[] = {7, 0, 20, 1, 13};
    const int64_t E = 5, S = 41, N = 30, K = 200;
    fm_splits s = {E, sp, NULL};
    char what[200];
    static const gpair gp[] = {
        {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128},
        {FM_DTYPE_E4M3, FM_DTYPE_E5M2, FM_SCALE_ROW, FM_SCALE_ROW},
        {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_SCALE_TENSOR},
        {FM_DTYPE_BF16, FM_DTYPE_BF16, FM_SCALE_NONE, FM_SCALE_NONE},
    };
    for (int p = 0; p < 4; p++)
        for (int huge = 0; huge < 2; huge++) {
            gr_op A, B;
            gr_make(&A, gp[p].a, gp[p].ma, FM_SCALE_LAYOUT_COMPACT, FM_LAYOUT_ROWWISE, 1, S, K, GR_RANDOM);
            gr_make(&B, gp[p].b, gp[p].mb, FM_SCALE_LAYOUT_GEMM, FM_LAYOUT_ROWWISE, -E, N, K, GR_RANDOM);
            spoil(&A, 0, huge, 4);
            for (int64_t e = 0; e < E; e++)
                spoil(&B, e, huge, e == 2 ? 2 : 1);
            if (huge) /* in expert 2's rows */
                overflow_pair(&A, 0, 7 + tu_randint(0, 19), &B, 2, tu_randint(0, N - 1));
            fm_dtype odt = huge ? FM_DTYPE_F32 : FM_DTYPE_BF16;
            void *d = gemm_out(S * N, odt, 0);
            fm_tensor dt = fm_tensor_2d(d, odt, S, N);
            snprintf(what, sizeof what, "grouped_gemm %s %s x %s %s -> %s, %s inputs", fm_dtype_name(gp[p].a),
                     fm_scale_mode_name(gp[p].ma), fm_dtype_name(gp[p].b), fm_scale_mode_name(gp[p].mb),
                     fm_dtype_name(odt), huge ? "overflow-sized" : "NaN/Inf");
            fm_status st = fm_grouped_gemm(ctx, NULL, &s, &A.t, &B.t, &dt);
            CHECK(st == FM_OK, "%s: %s", what, fm_last_error(ctx));
            if (st == FM_OK) {
                gcheck g = {what, huge, 0, odt, 0, 0, 0};
                int64_t r0 = 0;
                for (int64_t e = 0; e < E; e++) {
                    if (sp[e])
                        gemm_check_block(&g, &A, 0, r0, &B, e, sp[e], d, NULL, r0);
                    r0 += sp[e];
                }
                gemm_done(&g);
            }
            free(d);
            gr_free(&A), gr_free(&B);
        }
    /* k-grouped: each expert's dyT [N, M_e] and xT [K, M_e], one after the other */
    for (int f = 0; f < 2; f++)
        for (int huge = 0; huge < 2; huge++) {
            fm_dtype dt = f ? FM_DTYPE_BF16 : FM_DTYPE_E4M3;
            fm_scale_mode m = f ? FM_SCALE_NONE : FM_SCALE_BLOCK_1x128;
            int64_t Kx = 50;
            gr_op Y[5], X[5];
            size_t es = f ? 2 : 1, ydb = 0, xdb = 0, ysb = 0, xsb = 0;
            for (int64_t e = 0; e < E; e++) {
                gr_make(&Y[e], dt, m, FM_SCALE_LAYOUT_COMPACT, FM_LAYOUT_ROWWISE, 1, N, sp[e], GR_RANDOM);
                gr_make(&X[e], dt, m, FM_SCALE_LAYOUT_COMPACT, FM_LAYOUT_ROWWISE, 1, Kx, sp[e], GR_RANDOM);
                if (e != 3) {
                    spoil(&Y[e], 0, huge, 1);
                    spoil(&X[e], 0, huge, e == 4 ? 2 : 1);
                }
                if (huge && e == 2)
                    overflow_pair(&Y[e], 0, tu_randint(0, N - 1), &X[e], 0, tu_randint(0, Kx - 1));
                ydb += (size_t)(N * sp[e]) * es, xdb += (size_t)(Kx * sp[e]) * es;
                ysb += (size_t)Y[e].per_scales, xsb += (size_t)X[e].per_scales;
            }
            uint8_t *yd = malloc(ydb + 1), *xd = malloc(xdb + 1);
            float *ys = malloc(4 * ysb + 4), *xs = malloc(4 * xsb + 4);
            size_t yo = 0, xo = 0, yso = 0, xso = 0;
            for (int64_t e = 0; e < E; e++) {
                memcpy(yd + yo, Y[e].data, (size_t)(N * sp[e]) * es), yo += (size_t)(N * sp[e]) * es;
                memcpy(xd + xo, X[e].data, (size_t)(Kx * sp[e]) * es), xo += (size_t)(Kx * sp[e]) * es;
                if (m) {
                    memcpy(ys + yso, Y[e].scale, 4 * (size_t)Y[e].per_scales), yso += (size_t)Y[e].per_scales;
                    memcpy(xs + xso, X[e].scale, 4 * (size_t)X[e].per_scales), xso += (size_t)X[e].per_scales;
                }
            }
            fm_tensor ty = fm_tensor_2d(yd, dt, S, N), tx = fm_tensor_2d(xd, dt, S, Kx);
            ty.layout = tx.layout = FM_LAYOUT_COLWISE;
            if (m) {
                ty.scale_mode = tx.scale_mode = m;
                ty.scale_dtype = tx.scale_dtype = FM_DTYPE_F32;
                ty.scale = ys, tx.scale = xs;
            }
            int acc = !huge;
            void *dw = gemm_out(E * N * Kx, FM_DTYPE_F32, acc);
            uint32_t *old = malloc(sizeof(uint32_t) * (size_t)(E * N * Kx));
            memcpy(old, dw, sizeof(uint32_t) * (size_t)(E * N * Kx));
            fm_tensor tdw = fm_tensor_3d(dw, FM_DTYPE_F32, E, N, Kx);
            fm_gemm_config cfg = {.accumulate = acc};
            snprintf(what, sizeof what, "grouped_gemm_wgrad %s%s, %s inputs", fm_dtype_name(dt),
                     acc ? " accumulate" : "", huge ? "overflow-sized" : "NaN/Inf");
            fm_status st = fm_grouped_gemm_wgrad(ctx, &cfg, &s, &ty, &tx, &tdw);
            CHECK(st == FM_OK, "%s: %s", what, fm_last_error(ctx));
            if (st == FM_OK) {
                gcheck g = {what, huge, acc, FM_DTYPE_F32, 0, 0, 0};
                for (int64_t e = 0; e < E; e++)
                    gemm_check_block(&g, &Y[e], 0, 0, &X[e], 0, N, (float *)dw + e * N * Kx,
                                     acc ? old + e * N * Kx : NULL, 0);
                gemm_done(&g);
            }
            free(yd), free(xd), free(ys), free(xs), free(dw), free(old);
            for (int64_t e = 0; e < E; e++)
                gr_free(&Y[e]), gr_free(&X[e]);
        }
}

/* ---- router ------------------------------------------------------------------------------ */

static int row_has_nan(const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (isnan(x[i]))
            return 1;
    return 0;
}

static void router_policy(fm_context *ctx)
{
    enum { T = 40, E = 9 };
    float lg[T * E], clean[T * E], bias[E];
    for (int i = 0; i < T * E; i++)
        lg[i] = clean[i] = (float)tu_normal();
    for (int e = 0; e < E; e++)
        bias[e] = (float)(0.1 * tu_normal());
    lg[0 * E + 3] = tu_bits_f32(NAN_BITS[0]);
    lg[1 * E + 0] = tu_bits_f32(NAN_BITS[1]);
    for (int e = 0; e < E; e++)
        lg[2 * E + e] = tu_bits_f32(NAN_BITS[2]);
    lg[3 * E + 4] = tu_bits_f32(NAN_BITS[0]), lg[3 * E + 6] = tu_bits_f32(INF_BITS[0]);
    lg[4 * E + 5] = tu_bits_f32(INF_BITS[0]);
    lg[5 * E + 2] = tu_bits_f32(INF_BITS[1]);
    for (int e = 0; e < E; e++)
        lg[6 * E + e] = tu_bits_f32(INF_BITS[1]);
    lg[7 * E + 1] = 3e38f, lg[7 * E + 4] = -3e38f;
    lg[8 * E + 0] = lg[8 * E + 8] = tu_bits_f32(INF_BITS[0]);
    lg[9 * E + 6] = -3.3e38f;
    static const fm_router_config cfgs[4] = {
        {3, FM_ROUTER_SOFTMAX, 1, NULL}, {2, FM_ROUTER_SOFTMAX, 0, NULL},
        {2, FM_ROUTER_SIGMOID, 0, NULL}, {4, FM_ROUTER_SIGMOID, 1, NULL}};
    for (int c = 0; c < 5; c++) {
        fm_router_config rc = cfgs[c == 4 ? 2 : c];
        if (c == 4)
            rc.bias = bias; /* sigmoid with a selection bias */
        int k = rc.topk, sig = rc.score == FM_ROUTER_SIGMOID;
        char cs[96];
        snprintf(cs, sizeof cs, "router %s k %d renormalize %d bias %d", sig ? "sigmoid" : "softmax", k,
                 rc.renormalize, rc.bias != NULL);
        int32_t ids[T * 4], ids_c[T * 4];
        float pr[T * 4], pr_c[T * 4];
        int64_t tpe[E];
        fm_tensor tl = fm_tensor_2d(lg, FM_DTYPE_F32, T, E), tlc = fm_tensor_2d(clean, FM_DTYPE_F32, T, E);
        fm_tensor ti = fm_tensor_2d(ids, FM_DTYPE_I32, T, k), tp = fm_tensor_2d(pr, FM_DTYPE_F32, T, k);
        fm_tensor tic = fm_tensor_2d(ids_c, FM_DTYPE_I32, T, k), tpc = fm_tensor_2d(pr_c, FM_DTYPE_F32, T, k);
        fm_tensor tt = fm_tensor_2d(tpe, FM_DTYPE_I64, 1, E);
        CHECK(fm_moe_router(ctx, &rc, &tl, &ti, &tp, &tt) == FM_OK, "%s: %s", cs, fm_last_error(ctx));
        CHECK(fm_moe_router(ctx, &rc, &tlc, &tic, &tpc, NULL) == FM_OK, "%s clean: %s", cs, fm_last_error(ctx));
        int64_t hist[E] = {0};
        for (int t = 0; t < T; t++) {
            const float *x = lg + t * E;
            int special = t < 10, nan = row_has_nan(x, E);
            unsigned seen = 0;
            for (int j = 0; j < k; j++) {
                int32_t id = ids[t * k + j];
                CHECK(id >= 0 && id < E && !(seen >> id & 1), "%s token %d: id %d invalid or repeated", cs, t, id);
                if (id >= 0 && id < E)
                    seen |= 1u << id, hist[id]++;
            }
            if (!special) { /* untouched by the other tokens' specials */
                CHECK(!memcmp(ids + t * k, ids_c + t * k, (size_t)k * 4) && !memcmp(pr + t * k, pr_c + t * k, (size_t)k * 4),
                      "%s token %d: differs from the run without special tokens", cs, t);
                continue;
            }
            if (nan) {
                for (int j = 0; j < k; j++)
                    CHECK_EQ_U(tu_f32_bits(pr[t * k + j]), 0x7FC00000u, "%s token %d (NaN logit): prob %d", cs, t, j);
                if (sig) { /* NaN ranks below every number */
                    int finite_experts = 0;
                    for (int e = 0; e < E; e++)
                        finite_experts += !isnan(x[e]);
                    for (int j = 0; j < k && j < finite_experts; j++)
                        CHECK(!isnan(x[ids[t * k + j]]), "%s token %d: NaN expert %d ranked above a number", cs, t,
                              ids[t * k + j]);
                }
                continue;
            }
            /* +-Inf and overflow-sized logits: moe.h says nothing; mathfn.h documents
             * sigmoid(+Inf) = 1 and sigmoid(-Inf) = 0, and softmax is exp(x - max) / sum,
             * so +Inf (Inf - Inf) or all -Inf make the token's softmax NaN */
            int pinf = 0, ninf = 0;
            for (int e = 0; e < E; e++)
                pinf += x[e] == INFINITY, ninf += x[e] == -INFINITY;
            for (int j = 0; j < k; j++) {
                float p = pr[t * k + j], xv = x[ids[t * k + j]];
                if ((!sig && (pinf || ninf == E)) || (sig && rc.renormalize && ninf == E))
                    CHECK_EQ_U(tu_f32_bits(p), 0x7FC00000u, "%s token %d (%s): prob %d", cs, t,
                               sig ? "all -Inf: 0 / 0" : "+Inf or all -Inf logits", j);
                else
                    CHECK(isfinite(p) && p >= 0 && p <= 1, "%s token %d: prob %d is %a", cs, t, j, (double)p);
                if (!sig && !rc.bias && !pinf && ninf < E)
                    CHECK(xv != -INFINITY, "%s token %d: an expert of logit -Inf (probability 0) chosen", cs, t);
                if (sig && !rc.renormalize && xv == INFINITY)
                    CHECK(p == 1.0f, "%s token %d: sigmoid(+Inf) prob %a, mathfn.h says 1", cs, t, (double)p);
                if (sig && !rc.bias && pinf + ninf < E - k)
                    CHECK(xv != -INFINITY, "%s token %d: sigmoid(-Inf) = 0 chosen over numbers", cs, t);
            }
            if (t == 7 && !sig) /* 3e38 against -3e38 and ordinary logits: a clean 1 */
                CHECK(ids[t * k] == 1 && pr[t * k] == 1.0f, "%s token 7: top id %d prob %a", cs, ids[t * k],
                      (double)pr[t * k]);
        }
        for (int e = 0; e < E; e++)
            CHECK(tpe[e] == hist[e], "%s: tokens_per_expert[%d] %lld, ids say %lld", cs, e, (long long)tpe[e],
                  (long long)hist[e]);

        /* backward: NaN logits give a NaN row; NaN / Inf dprobs reach what they feed */
        float dp[T * 4], dl[T * E], dl_c[T * E];
        for (int i = 0; i < T * k; i++)
            dp[i] = (float)tu_normal();
        float dp_clean[T * 4];
        memcpy(dp_clean, dp, sizeof dp);
        dp[12 * k + 0] = tu_bits_f32(NAN_BITS[1]);
        dp[13 * k + k - 1] = tu_bits_f32(INF_BITS[0]);
        dp[14 * k + 0] = tu_bits_f32(INF_BITS[1]);
        fm_tensor tdp = fm_tensor_2d(dp, FM_DTYPE_F32, T, k), tdl = fm_tensor_2d(dl, FM_DTYPE_F32, T, E);
        fm_tensor tdpc = fm_tensor_2d(dp_clean, FM_DTYPE_F32, T, k), tdlc = fm_tensor_2d(dl_c, FM_DTYPE_F32, T, E);
        CHECK(fm_moe_router_backward(ctx, &rc, &tl, &ti, &tdp, &tdl) == FM_OK, "%s backward: %s", cs,
              fm_last_error(ctx));
        CHECK(fm_moe_router_backward(ctx, &rc, &tl, &ti, &tdpc, &tdlc) == FM_OK, "%s backward: %s", cs,
              fm_last_error(ctx));
        for (int t = 0; t < T; t++) {
            const float *x = lg + t * E;
            if (t < 10) {
                if (row_has_nan(x, E))
                    for (int e = 0; e < E; e++)
                        CHECK_EQ_U(tu_f32_bits(dl[t * E + e]), 0x7FC00000u, "%s backward token %d (NaN logit)", cs, t);
                continue;
            }
            for (int e = 0; e < E; e++) {
                /* softmax: every dlogit of the token feeds on every dprob; sigmoid: a chosen
                 * expert's on its own dprob, or on all of them through the renormalisation */
                int dep = 0, chosen = 0;
                for (int j = 0; j < k; j++)
                    chosen |= ids[t * k + j] == e;
                for (int j = 0; j < k; j++)
                    if (!isfinite(dp[t * k + j]))
                        dep |= !sig || ids[t * k + j] == e || (rc.renormalize && chosen);
                float v = dl[t * E + e];
                if (dep)
                    CHECK(!isfinite(v), "%s backward token %d expert %d: %a from a non-finite dprob", cs, t, e,
                          (double)v);
                else
                    CHECK(tu_f32_bits(v) == tu_f32_bits(dl_c[t * E + e]), "%s backward token %d expert %d: %a, "
                          "without the non-finite dprobs %a", cs, t, e, (double)v, (double)dl_c[t * E + e]);
            }
        }
    }
}

/* ---- permute, unpermute ----------------------------------------------------------------------- */

typedef struct {
    int64_t T, k, E, H, R;
    int32_t *ids, *row_map, *slot_rows;
    float *probs;
} routing;

static void make_routing(fm_context *ctx, routing *rt, int64_t T, int64_t k, int64_t E, int64_t H, int pad)
{
    rt->T = T, rt->k = k, rt->E = E, rt->H = H;
    rt->R = T * k + E * (pad - 1);
    rt->ids = malloc((size_t)(T * k) * 4), rt->probs = malloc((size_t)(T * k) * 4);
    rt->row_map = malloc((size_t)rt->R * 4), rt->slot_rows = malloc((size_t)(T * k) * 4);
    for (int64_t i = 0; i < T * k; i++) {
        rt->ids[i] = i % 7 == 3 ? -1 : (int32_t)tu_randint(0, E - 1);
        rt->probs[i] = (float)tu_uniform();
    }
    rt->probs[0] = tu_bits_f32(NAN_BITS[1]);
    rt->probs[k + 1] = tu_bits_f32(INF_BITS[0]);
    rt->probs[2 * k] = 0.0f;
    rt->probs[3 * k + 1] = tu_bits_f32(NAN_BITS[2]);
    /* the same two experts for token 4's first two choices, probability 1: 3e38 + 3e38 */
    rt->ids[4 * k] = 0, rt->ids[4 * k + 1] = 1, rt->probs[4 * k] = rt->probs[4 * k + 1] = 1.0f;
    float *x = calloc((size_t)(T * H), 4), *out = malloc((size_t)(rt->R * H) * 4);
    int64_t sp[64];
    fm_tensor tx = fm_tensor_2d(x, FM_DTYPE_F32, T, H), ti = fm_tensor_2d(rt->ids, FM_DTYPE_I32, T, k);
    fm_tensor to = fm_tensor_2d(out, FM_DTYPE_F32, rt->R, H), trm = fm_tensor_2d(rt->row_map, FM_DTYPE_I32, rt->R, 1);
    fm_tensor tsr = fm_tensor_2d(rt->slot_rows, FM_DTYPE_I32, T, k), tsp = fm_tensor_2d(sp, FM_DTYPE_I64, 1, E);
    fm_permute_config pc = {pad};
    if (fm_moe_permute(ctx, &pc, &tx, &ti, NULL, &to, &trm, &tsr, &tsp, NULL, NULL) != FM_OK) {
        fprintf(stderr, "permute: %s\n", fm_last_error(ctx));
        exit(1);
    }
    free(x), free(out);
}

static void free_routing(routing *rt) { free(rt->ids), free(rt->probs), free(rt->row_map), free(rt->slot_rows); }

static void permute_policy(fm_context *ctx)
{
    const int64_t T = 30, k = 3, E = 5, H = 200;
    typedef struct {
        fm_dtype dt;
        fm_scale_mode m;
    } kd;
    static const kd kinds[] = {{FM_DTYPE_F32, FM_SCALE_NONE}, {FM_DTYPE_BF16, FM_SCALE_NONE},
                               {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E2M1, FM_SCALE_MX32}};
    for (int v = 0; v < 4; v++) {
        routing rt;
        make_routing(ctx, &rt, T, k, E, H, 8);
        int64_t R = rt.R;
        int64_t rb = kinds[v].dt == FM_DTYPE_E2M1 ? H / 2 : H * (kinds[v].dt == FM_DTYPE_F32 ? 4 : kinds[v].dt == FM_DTYPE_BF16 ? 2 : 1);
        int64_t sb = kinds[v].m == FM_SCALE_MX32 ? H / 32 + (H % 32 != 0) : kinds[v].m ? 4 * ((H + 127) / 128) : 0;
        uint8_t *x = malloc((size_t)(T * rb)), *xs = malloc((size_t)(T * sb + 1));
        for (int64_t i = 0; i < T * rb; i++)
            x[i] = (uint8_t)tu_rand32();
        for (int64_t i = 0; i < T * sb; i++)
            xs[i] = (uint8_t)tu_randint(110, 140);
        if (kinds[v].m == FM_SCALE_BLOCK_1x128) {
            for (int64_t i = 0; i < T * sb / 4; i++)
                ((float *)xs)[i] = ldexpf(1.0f, (int)tu_randint(-10, 10));
            ((uint32_t *)xs)[3] = 0x7FC0BEEFu, ((uint32_t *)xs)[8] = 0xFF800000u;
        }
        if (kinds[v].m == FM_SCALE_MX32)
            xs[5] = 0xFF;
        if (kinds[v].dt == FM_DTYPE_F32) {
            uint32_t *xf = (uint32_t *)x;
            static const uint32_t sp[] = {0x7FC12345u, 0xFFFFFFFFu, 0x7F800000u, 0xFF800000u, 0x7F61B1E6u, 0x80000000u, 1u};
            for (size_t i = 0; i < sizeof sp / sizeof sp[0]; i++)
                xf[tu_randint(0, T * H - 1)] = sp[i];
        }
        tu_buf out = tu_buf_new((size_t)(R * rb)), outs = tu_buf_new((size_t)(R * sb));
        tu_buf op = tu_buf_new((size_t)R * 4);
        tu_buf_poison(&out, 0xC3), tu_buf_poison(&outs, 0xC3), tu_buf_poison(&op, 0xC3);
        int32_t *rm = malloc((size_t)R * 4), *sr = malloc((size_t)(T * k) * 4);
        int64_t spl[8];
        fm_tensor tx = kinds[v].m ? fm_tensor_quant_2d(x, kinds[v].dt, T, H, FM_LAYOUT_ROWWISE, kinds[v].m, xs,
                                                       FM_SCALE_LAYOUT_COMPACT)
                                  : fm_tensor_2d(x, kinds[v].dt, T, H);
        fm_tensor to = tx;
        to.shape[0] = R, to.data = out.p, to.scale = kinds[v].m ? (void *)outs.p : NULL;
        fm_tensor ti = fm_tensor_2d(rt.ids, FM_DTYPE_I32, T, k), tp = fm_tensor_2d(rt.probs, FM_DTYPE_F32, T, k);
        fm_tensor trm = fm_tensor_2d(rm, FM_DTYPE_I32, R, 1), tsr = fm_tensor_2d(sr, FM_DTYPE_I32, T, k);
        fm_tensor tsp = fm_tensor_2d(spl, FM_DTYPE_I64, 1, E), top = fm_tensor_2d(op.p, FM_DTYPE_F32, R, 1);
        fm_permute_config pc = {8};
        fm_status st = fm_moe_permute(ctx, &pc, &tx, &ti, &tp, &to, &trm, &tsr, &tsp, &top, NULL);
        CHECK(st == FM_OK, "permute %s: %s", fm_dtype_name(kinds[v].dt), fm_last_error(ctx));
        int64_t bad = 0;
        for (int64_t r = 0; r < R && st == FM_OK; r++) {
            int32_t s = rm[r];
            int ok;
            if (s >= 0) {
                int64_t t = s / k;
                ok = sr[s] == r && !memcmp(out.p + r * rb, x + t * rb, (size_t)rb) &&
                     !memcmp(outs.p + r * sb, xs + t * sb, (size_t)sb) &&
                     tu_f32_bits(((float *)op.p)[r]) == tu_f32_bits(rt.probs[s]);
            } else {
                ok = ((float *)op.p)[r] == 0.0f;
                for (int64_t b = 0; b < rb; b++)
                    ok &= out.p[r * rb + b] == 0;
                for (int64_t b = 0; b < sb; b++)
                    ok &= kinds[v].m == FM_SCALE_MX32 ? outs.p[r * sb + b] == 127
                                                      : ((float *)(outs.p + r * sb))[b / 4] == 1.0f;
            }
            tu_checks++;
            if (!ok && bad++ < 3)
                tu_fail(__FILE__, __LINE__, "permute moves bytes unchanged",
                        "%s: out row %lld (source slot %d) is not the source row's bytes (NaN payloads, Inf, scales, "
                        "prob) / a zero padding row", fm_dtype_name(kinds[v].dt), (long long)r, s);
        }
        CHECK(tu_buf_guard_ok(&out) && tu_buf_guard_ok(&outs) && tu_buf_guard_ok(&op), "permute: wrote past its outputs");
        tu_buf_free(&out), tu_buf_free(&outs), tu_buf_free(&op);
        free(x), free(xs), free(rm), free(sr);
        free_routing(&rt);
    }
}

static uint32_t store_bits(float v, fm_dtype dt)
{
    if (dt == FM_DTYPE_BF16)
        return or_encode(OF_BF16, v);
    return isnan(v) ? 0x7FC00000u : tu_f32_bits(v);
}

static void unpermute_policy(fm_context *ctx)
{
    const int64_t T = 30, k = 3, E = 5, H = 40;
    routing rt;
    make_routing(ctx, &rt, T, k, E, H, 4);
    int64_t R = rt.R;
    float *y = malloc((size_t)(R * H) * 4), *dout = malloc((size_t)(T * H) * 4);
    for (int64_t i = 0; i < R * H; i++)
        y[i] = (float)tu_normal();
    for (int64_t i = 0; i < T * H; i++)
        dout[i] = (float)tu_normal();
    /* specials in rows that slots use, and 3e38 in both rows of token 4's first two choices */
    for (int i = 0; i < 6; i++) {
        int64_t s = tu_randint(0, T * k - 1);
        if (rt.slot_rows[s] >= 0)
            y[rt.slot_rows[s] * H + tu_randint(0, H - 1)] = tu_bits_f32(i < 3 ? NAN_BITS[i] : INF_BITS[i % 2]);
        dout[tu_randint(0, T * H - 1)] = tu_bits_f32(i < 3 ? NAN_BITS[i] : INF_BITS[i % 2]);
    }
    y[rt.slot_rows[4 * k] * H + 7] = 3e38f, y[rt.slot_rows[4 * k + 1] * H + 7] = 3e38f;
    fm_tensor ty = fm_tensor_2d(y, FM_DTYPE_F32, R, H), tsr = fm_tensor_2d(rt.slot_rows, FM_DTYPE_I32, T, k);
    fm_tensor tp = fm_tensor_2d(rt.probs, FM_DTYPE_F32, T, k), trm = fm_tensor_2d(rt.row_map, FM_DTYPE_I32, R, 1);
    for (int v = 0; v < 3; v++) {
        fm_dtype odt = v == 1 ? FM_DTYPE_BF16 : FM_DTYPE_F32;
        int weighted = v != 2;
        void *out = malloc((size_t)(T * H) * 4);
        memset(out, 0x77, (size_t)(T * H) * 4);
        fm_tensor to = fm_tensor_2d(out, odt, T, H);
        fm_status st = fm_moe_unpermute(ctx, &ty, &tsr, weighted ? &tp : NULL, &to);
        CHECK(st == FM_OK, "unpermute: %s", fm_last_error(ctx));
        int64_t bad = 0, nonfin = 0;
        for (int64_t t = 0; t < T && st == FM_OK; t++)
            for (int64_t h = 0; h < H; h++) {
                float acc = 0.0f;
                int dep = 0;
                for (int64_t j = 0; j < k; j++) {
                    int32_t r = rt.slot_rows[t * k + j];
                    if (r < 0)
                        continue;
                    float w = weighted ? rt.probs[t * k + j] : 1.0f;
                    acc = fmaf(w, y[r * H + h], acc);
                    dep |= !isfinite(w) || !isfinite(y[r * H + h]);
                }
                uint32_t want = store_bits(acc, odt);
                uint32_t got = odt == FM_DTYPE_BF16 ? ((uint16_t *)out)[t * H + h] : ((uint32_t *)out)[t * H + h];
                double gv = odt == FM_DTYPE_BF16 ? or_decode(OF_BF16, got) : (double)tu_bits_f32(got);
                nonfin += !isfinite(gv);
                tu_checks++;
                if ((got != want || (dep && isfinite(gv))) && bad++ < 3)
                    tu_fail(__FILE__, __LINE__, "unpermute = the fmaf chain, non-finite where a non-finite input feeds it",
                            "%s%s out (%lld, %lld): got 0x%x want 0x%x, depends on a non-finite input %d",
                            fm_dtype_name(odt), weighted ? " weighted" : "", (long long)t, (long long)h, got, want, dep);
            }
        double o47 = odt == FM_DTYPE_BF16 ? or_decode(OF_BF16, ((uint16_t *)out)[4 * H + 7]) : ((float *)out)[4 * H + 7];
        CHECK(o47 == INFINITY || isnan(o47), "unpermute: 3e38 + 3e38 gave %g, not +Inf", o47);
        CHECK(nonfin > 0, "unpermute: no non-finite output");
        free(out);
    }
    /* backward: dy = w * dout, dprobs = the fixed-order dot */
    float *dy = malloc((size_t)(R * H) * 4), *dp = malloc((size_t)(T * k) * 4);
    memset(dy, 0x77, (size_t)(R * H) * 4), memset(dp, 0x77, (size_t)(T * k) * 4);
    fm_tensor tdo = fm_tensor_2d(dout, FM_DTYPE_F32, T, H), tdy = fm_tensor_2d(dy, FM_DTYPE_F32, R, H);
    fm_tensor tdp = fm_tensor_2d(dp, FM_DTYPE_F32, T, k);
    fm_status st = fm_moe_unpermute_backward(ctx, &tdo, &ty, &trm, &tsr, &tp, &tdy, &tdp);
    CHECK(st == FM_OK, "unpermute_backward: %s", fm_last_error(ctx));
    int64_t bad = 0;
    for (int64_t r = 0; r < R && st == FM_OK; r++) {
        int32_t s = rt.row_map[r];
        for (int64_t h = 0; h < H; h++) {
            float want = s < 0 ? 0.0f : rt.probs[s] * dout[(s / k) * H + h];
            int dep = s >= 0 && (!isfinite(rt.probs[s]) || !isfinite(dout[(s / k) * H + h]));
            float got = dy[r * H + h];
            tu_checks++;
            if ((store_bits(want, FM_DTYPE_F32) != tu_f32_bits(got) || (dep && isfinite(got))) && bad++ < 3)
                tu_fail(__FILE__, __LINE__, "dy = w * dout", "row %lld col %lld: got %a want %a, dep %d", (long long)r,
                        (long long)h, (double)got, (double)want, dep);
        }
    }
    for (int64_t t = 0; t < T && st == FM_OK; t++)
        for (int64_t j = 0; j < k; j++) {
            int32_t r = rt.slot_rows[t * k + j];
            float want = r < 0 ? 0.0f : fm_dot_order_f32(dout + t * H, y + r * H, H);
            int dep = 0;
            for (int64_t h = 0; h < H && r >= 0; h++)
                dep |= !isfinite(dout[t * H + h]) || !isfinite(y[r * H + h]);
            float got = dp[t * k + j];
            tu_checks++;
            if ((store_bits(want, FM_DTYPE_F32) != tu_f32_bits(got) || (dep && isfinite(got))) && bad++ < 6)
                tu_fail(__FILE__, __LINE__, "dprobs = the fixed-order dot", "slot (%lld, %lld): got %a want %a, dep %d",
                        (long long)t, (long long)j, (double)got, (double)want, dep);
        }
    free(y), free(dout), free(dy), free(dp);
    free_routing(&rt);
}

/* ---- SwiGLU ------------------------------------------------------------------------------------- */

static void swiglu_policy(fm_context *ctx)
{
    const int64_t M = 40, I = 160;
    float *in = malloc((size_t)(M * 2 * I) * 4), *p = malloc((size_t)M * 4), *dh = malloc((size_t)(M * I) * 4);
    for (int64_t i = 0; i < M * 2 * I; i++)
        in[i] = (float)tu_normal();
    for (int64_t i = 0; i < M * I; i++)
        dh[i] = (float)tu_normal();
    for (int64_t m = 0; m < M; m++)
        p[m] = (float)tu_uniform();
    float *g = in, *u = in + I; /* row m: g[m * 2I + i], u[m * 2I + i] */
    int64_t L = 2 * I;
    g[1 * L + 3] = tu_bits_f32(NAN_BITS[0]);
    u[2 * L + 4] = tu_bits_f32(NAN_BITS[1]);
    g[3 * L + 5] = -INFINITY;                          /* silu(-Inf) = NaN (mathfn.h) */
    g[4 * L + 6] = INFINITY;
    g[8 * L + 150] = 0.0f, u[8 * L + 150] = INFINITY; /* silu(0) * Inf */
    g[9 * L + 7] = -200.0f, u[9 * L + 7] = -INFINITY; /* silu(-200) = -0, times -Inf */
    g[10 * L + 9] = 3e38f, u[10 * L + 9] = 3e38f;     /* finite inputs, h overflows to +Inf */
    u[11 * L + 130] = 3e38f;                          /* finite h unless silu(g) * 3e38 overflows */
    p[5] = tu_bits_f32(NAN_BITS[2]), p[6] = INFINITY, p[7] = 0.0f;
    g[7 * L + 8] = INFINITY;                          /* Inf times probability 0 */
    dh[12 * I + 3] = tu_bits_f32(NAN_BITS[1]), dh[13 * I + 100] = -INFINITY, dh[14 * I + 5] = 3e38f;
    u[14 * L + 5] = 3e38f;
    fm_tensor tin = fm_tensor_2d(in, FM_DTYPE_F32, M, 2 * I), tp = fm_tensor_2d(p, FM_DTYPE_F32, M, 1);
    fm_tensor tdh = fm_tensor_2d(dh, FM_DTYPE_F32, M, I);
    /* the documented F32 formulas (moe.h, mathfn.h) */
    float *h = malloc((size_t)(M * I) * 4), *din = malloc((size_t)(M * 2 * I) * 4), *dpr = malloc((size_t)M * 4);
    char *hdep = malloc((size_t)(M * I)), *ddep = malloc((size_t)(M * 2 * I)), *pdep = malloc((size_t)M);
    float *au = malloc((size_t)I * 4);
    for (int64_t m = 0; m < M; m++) {
        pdep[m] = 0;
        for (int64_t i = 0; i < I; i++) {
            float gv = g[m * L + i], uv = u[m * L + i], a = fm_siluf(gv), q = dh[m * I + i] * p[m];
            h[m * I + i] = (a * uv) * p[m];
            hdep[m * I + i] = !isfinite(gv) || !isfinite(uv) || !isfinite(p[m]);
            din[m * L + I + i] = q * a;
            din[m * L + i] = (q * uv) * fm_dsiluf(gv);
            ddep[m * L + I + i] = !isfinite(dh[m * I + i]) || !isfinite(p[m]) || !isfinite(gv);
            ddep[m * L + i] = ddep[m * L + I + i] || !isfinite(uv);
            au[i] = a * uv;
            pdep[m] |= !isfinite(dh[m * I + i]) || !isfinite(gv) || !isfinite(uv);
        }
        dpr[m] = fm_dot_order_runs_f32(dh + m * I, au, I);
    }
    const char *fw = "swiglu", *bw = "swiglu_backward";
    /* unscaled outputs: the formulas bit for bit, non-finite wherever a non-finite input feeds them */
    {
        float *o = malloc((size_t)(M * I) * 4);
        fm_tensor to = fm_tensor_2d(o, FM_DTYPE_F32, M, I);
        CHECK(fm_moe_swiglu(ctx, NULL, &tin, &tp, &to, NULL, NULL) == FM_OK, "%s: %s", fw, fm_last_error(ctx));
        int64_t bad = 0;
        for (int64_t i = 0; i < M * I; i++) {
            tu_checks++;
            if ((tu_f32_bits(o[i]) != store_bits(h[i], FM_DTYPE_F32) || (hdep[i] && isfinite(o[i]))) && bad++ < 3)
                tu_fail(__FILE__, __LINE__, "h = (silu(g) u) p", "(%lld, %lld): got %a want %a, dep %d",
                        (long long)(i / I), (long long)(i % I), (double)o[i], (double)h[i], hdep[i]);
        }
        CHECK(o[10 * I + 9] == INFINITY, "%s: silu(3e38) * 3e38 gave %a", fw, (double)o[10 * I + 9]);
        float *d = malloc((size_t)(M * 2 * I) * 4), *dp = malloc((size_t)M * 4);
        fm_tensor td = fm_tensor_2d(d, FM_DTYPE_F32, M, 2 * I), tdp = fm_tensor_2d(dp, FM_DTYPE_F32, M, 1);
        CHECK(fm_moe_swiglu_backward(ctx, NULL, &tdh, &tin, &tp, &td, NULL, &tdp) == FM_OK, "%s: %s", bw,
              fm_last_error(ctx));
        for (int64_t i = 0; i < M * 2 * I; i++) {
            tu_checks++;
            if ((tu_f32_bits(d[i]) != store_bits(din[i], FM_DTYPE_F32) || (ddep[i] && isfinite(d[i]))) && bad++ < 6)
                tu_fail(__FILE__, __LINE__, "din = [dg | du]", "(%lld, %lld): got %a want %a, dep %d",
                        (long long)(i / L), (long long)(i % L), (double)d[i], (double)din[i], ddep[i]);
        }
        for (int64_t m = 0; m < M; m++) {
            tu_checks++;
            if ((tu_f32_bits(dp[m]) != store_bits(dpr[m], FM_DTYPE_F32) || (pdep[m] && isfinite(dp[m]))) && bad++ < 9)
                tu_fail(__FILE__, __LINE__, "dprobs = dot(dh, silu(g) u)", "row %lld: got %a want %a, dep %d",
                        (long long)m, (double)dp[m], (double)dpr[m], pdep[m]);
        }
        /* amax and the count describe a quantized result: asked for with an unscaled output they
         * would never be written, so the call is refused and leaves them alone */
        float amax = 42.0f;
        int64_t cnt = 42;
        fm_quant_config ask_amax = {.amax = &amax}, ask_cnt = {.nonfinite_blocks = &cnt};
        CHECK(fm_moe_swiglu(ctx, &ask_cnt, &tin, &tp, &to, NULL, NULL) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "cfg->nonfinite_blocks") && cnt == 42,
              "%s to F32 asked for nonfinite_blocks: %s, count %lld", fw, fm_last_error(ctx), (long long)cnt);
        CHECK(fm_moe_swiglu_backward(ctx, &ask_amax, &tdh, &tin, &tp, &td, NULL, NULL) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "cfg->amax") && amax == 42.0f,
              "%s to F32 asked for amax: %s, amax %a", bw, fm_last_error(ctx), (double)amax);
        free(o), free(d), free(dp);
    }
    /* quantized outputs: NaN blocks exactly where the result is non-finite (overflow included), counted;
     * in_saved: NaN blocks where the input is */
    for (int bwd = 0; bwd < 2; bwd++) {
        int64_t C = bwd ? 2 * I : I;
        ref_spec sr = {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT};
        ref_spec sc = {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE, FM_SCALE_LAYOUT_GEMM};
        ref_spec ss = {FM_DTYPE_E2M1, FM_SCALE_MX32, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT};
        tu_qout qr, qc, qs;
        tu_qout_init(&qr, &sr, 2, 1, M, C);
        tu_qout_init(&qc, &sc, 2, 1, M, C);
        tu_qout_init(&qs, &ss, 2, 1, M, 2 * I);
        tu_qout_poison(&qr, 0x21), tu_qout_poison(&qc, 0x21), tu_qout_poison(&qs, 0x21);
        float amax = 0;
        int64_t nf = -1;
        fm_quant_config cfg = {.amax = &amax, .nonfinite_blocks = &nf};
        const char *cs = bwd ? bw : fw;
        fm_status st = bwd ? fm_moe_swiglu_backward(ctx, &cfg, &tdh, &tin, &tp, &qr.t, &qc.t, NULL)
                           : fm_moe_swiglu(ctx, &cfg, &tin, &tp, &qr.t, &qc.t, &qs.t);
        CHECK(st == FM_OK, "%s quantized: %s", cs, fm_last_error(ctx));
        if (st == FM_OK) {
            fgrid gr = {bwd ? din : h, C};
            qview vr = qv_of(&qr.t), vc = qv_of(&qc.t);
            int64_t want = check_blocks(&vr, bad_f32, &gr, cs) + check_blocks(&vc, bad_f32, &gr, cs);
            CHECK(nf == want && want > 0, "%s: nonfinite_blocks %lld, want %lld", cs, (long long)nf, (long long)want);
            int any_nan = 0;
            for (int64_t i = 0; i < M * C; i++)
                any_nan |= isnan(gr.x[i]);
            CHECK(any_nan ? tu_f32_bits(amax) == 0x7FC00000u : isinf(amax), "%s: amax %a", cs, (double)amax);
            if (!bwd) {
                fgrid gi = {in, 2 * I};
                qview vs = qv_of(&qs.t);
                check_blocks(&vs, bad_f32, &gi, "swiglu in_saved");
            }
        }
        tu_qout_free(&qr), tu_qout_free(&qc), tu_qout_free(&qs);
    }
    free(in), free(p), free(dh), free(h), free(din), free(dpr), free(hdep), free(ddep), free(pdep), free(au);
}

/* ---- EP: dispatch moves bytes, combine sums in F32 ------------------------------------------------ */

enum { EP_R = 2, EP_H = 8, EP_K = 2, EP_CAP = 16 };

typedef struct {
    int r;
    fm_comm *comm;
    int64_t T;
    float x[8 * EP_H], probs[8 * EP_K], ox[EP_CAP * EP_H], op[EP_CAP * EP_K], y[EP_CAP * EP_H], out[8 * EP_H];
    int32_t ids[8 * EP_K], oids[EP_CAP * EP_K], osr[EP_CAP], ost[EP_CAP];
    int64_t rows;
    fm_status st[2];
} ep_rank;

static void *ep_main(void *arg)
{
    ep_rank *w = arg;
    fm_context *ctx = tu_cpu_context(1);
    fm_ep_config cfg = {2};
    fm_tensor x = fm_tensor_2d(w->x, FM_DTYPE_F32, w->T, EP_H), ids = fm_tensor_2d(w->ids, FM_DTYPE_I32, w->T, EP_K);
    fm_tensor pr = fm_tensor_2d(w->probs, FM_DTYPE_F32, w->T, EP_K);
    fm_tensor ox = fm_tensor_2d(w->ox, FM_DTYPE_F32, EP_CAP, EP_H), oids = fm_tensor_2d(w->oids, FM_DTYPE_I32, EP_CAP, EP_K);
    fm_tensor op = fm_tensor_2d(w->op, FM_DTYPE_F32, EP_CAP, EP_K), osr = fm_tensor_2d(w->osr, FM_DTYPE_I32, EP_CAP, 1);
    fm_tensor ost = fm_tensor_2d(w->ost, FM_DTYPE_I32, EP_CAP, 1);
    fm_ep_dispatch_out o = {&ox, &oids, &op, &osr, &ost, NULL, -1};
    w->st[0] = fm_ep_dispatch(ctx, w->comm, &cfg, &x, &ids, &pr, &o);
    w->rows = o.rows;
    /* y: the received rows' "expert outputs", with NaN, Inf and 3e38 */
    for (int64_t i = 0; i < EP_CAP * EP_H; i++)
        w->y[i] = (float)((i * 7 + w->r * 3) % 11) - 5.0f;
    for (int64_t i = 0; i < o.rows; i++) {
        if (w->ost[i] == 0)
            w->y[i * EP_H + 1] = 3e38f; /* token 0 of each rank visits both ranks: 3e38 + 3e38 */
        if (w->ost[i] == 1 && w->r == 0)
            w->y[i * EP_H + 2] = tu_bits_f32(NAN_BITS[1]);
        if (w->ost[i] == 2 && w->r == 1)
            w->y[i * EP_H + 3] = -INFINITY;
    }
    fm_tensor y = fm_tensor_2d(w->y, FM_DTYPE_F32, o.rows, EP_H), out = fm_tensor_2d(w->out, FM_DTYPE_F32, w->T, EP_H);
    if (w->st[0] == FM_OK)
        w->st[1] = fm_ep_combine(ctx, w->comm, &cfg, &ids, &y, &out);
    fm_context_destroy(ctx);
    return NULL;
}

static void ep_policy(void)
{
    ep_rank w[EP_R];
    fm_comm *comms[EP_R];
    CHECK(fm_comm_create_inproc(EP_R, comms) == FM_OK, "fm_comm_create_inproc: %s", fm_last_error(NULL));
    static const uint32_t payloads[] = {0x7FC12345u, 0xFFFFFFFFu, 0x7F800000u, 0xFF800000u, 0x7F61B1E6u};
    for (int r = 0; r < EP_R; r++) {
        memset(&w[r], 0, sizeof w[r]);
        w[r].r = r, w[r].comm = comms[r], w[r].T = 6 - r;
        for (int64_t i = 0; i < w[r].T * EP_H; i++)
            w[r].x[i] = (float)tu_normal();
        for (size_t i = 0; i < sizeof payloads / sizeof payloads[0]; i++)
            ((uint32_t *)w[r].x)[tu_randint(0, w[r].T * EP_H - 1)] = payloads[i];
        for (int64_t t = 0; t < w[r].T; t++) {
            /* token 0 visits both ranks, token 1 only rank 0, token 2 only rank 1, the rest at random */
            w[r].ids[t * EP_K] = t == 0 ? 0 : t == 1 ? 1 : t == 2 ? 3 : (int32_t)tu_randint(0, 3);
            w[r].ids[t * EP_K + 1] = t == 0 ? 2 : t == 1 ? 0 : t == 2 ? -1 : (int32_t)tu_randint(-1, 3);
            w[r].probs[t * EP_K] = tu_bits_f32(t == 3 ? NAN_BITS[1] : 0x3F000000u);
            w[r].probs[t * EP_K + 1] = tu_bits_f32(t == 4 ? INF_BITS[1] : 0x3E800000u);
        }
        memset(w[r].ox, 0x99, sizeof w[r].ox);
    }
    pthread_t th[EP_R];
    for (int r = 0; r < EP_R; r++)
        pthread_create(&th[r], NULL, ep_main, &w[r]);
    for (int r = 0; r < EP_R; r++)
        pthread_join(th[r], NULL);
    for (int r = 0; r < EP_R; r++)
        CHECK(w[r].st[0] == FM_OK && w[r].st[1] == FM_OK, "rank %d: dispatch %s, combine %s", r,
              fm_status_name(w[r].st[0]), fm_status_name(w[r].st[1]));
    /* dispatch: each received row is its source row's bytes, probs bits included */
    for (int d = 0; d < EP_R; d++)
        for (int64_t i = 0; i < w[d].rows; i++) {
            const ep_rank *s = &w[w[d].osr[i]];
            int64_t t = w[d].ost[i];
            CHECK(!memcmp(w[d].ox + i * EP_H, s->x + t * EP_H, EP_H * 4), "dispatch: rank %d row %lld is not rank %d "
                  "token %lld's bytes", d, (long long)i, w[d].osr[i], (long long)t);
            for (int j = 0; j < EP_K; j++) {
                int32_t gid = s->ids[t * EP_K + j];
                if (gid / 2 == d && gid >= 0)
                    CHECK_EQ_U(tu_f32_bits(w[d].op[i * EP_K + j]), tu_f32_bits(s->probs[t * EP_K + j]),
                               "dispatch: rank %d row %lld prob %d", d, (long long)i, j);
            }
        }
    /* combine: out[t] = y of the first rank visited, + y of the next, in F32 */
    for (int s = 0; s < EP_R; s++)
        for (int64_t t = 0; t < w[s].T; t++)
            for (int h = 0; h < EP_H; h++) {
                float acc = 0.0f;
                int n = 0, dep = 0;
                for (int d = 0; d < EP_R; d++)
                    for (int64_t i = 0; i < w[d].rows; i++)
                        if (w[d].osr[i] == s && w[d].ost[i] == t) {
                            float v = w[d].y[i * EP_H + h];
                            acc = n++ ? acc + v : v;
                            dep |= !isfinite(v);
                        }
                float got = w[s].out[t * EP_H + h];
                CHECK(tu_f32_bits(got) == store_bits(acc, FM_DTYPE_F32) && (!dep || !isfinite(got)),
                      "combine: rank %d token %lld col %d: got %a want %a (dep %d)", s, (long long)t, h, (double)got,
                      (double)acc, dep);
            }
    for (int r = 0; r < EP_R; r++) {
        CHECK(w[r].out[0 * EP_H + 1] == INFINITY, "combine: 3e38 + 3e38 gave %a on rank %d", (double)w[r].out[1], r);
        fm_comm_destroy(comms[r]);
    }
}

int main(void)
{
    tu_begin("test_nonfinite_policy_every_op");
    fm_context *ctx = tu_cpu_context(2);
    quantize_policy(ctx);
    quantize_grouped_policy(ctx);
    requant_policy(ctx);
    cast_policy(ctx);
    dense_policy(ctx);
    linear_policy(ctx);
    grouped_policy(ctx);
    router_policy(ctx);
    permute_policy(ctx);
    unpermute_policy(ctx);
    swiglu_policy(ctx);
    ep_policy();
    fm_context_destroy(ctx);
    return tu_end();
}
