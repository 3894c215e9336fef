/* fm_transpose_scaled_grouped_rows(cfg, splits, x, row_map, k) equals, bit
 * for bit (codes, scales, nonfinite_blocks), fm_transpose_scaled_grouped of
 * the rows fm_moe_permute makes from x with that row_map: FP8 inputs in
 * 1x128 and MX32, every rule and output the grouped transpose takes (the
 * ROWMAX 128 x 128 tiles, E2M1 outputs), padding to 1, 16 and 128 rows,
 * tokens routed nowhere, empty experts, nasty data; nothing outside the
 * output is written. Refusals: a non-power-of-two scale on a row no expert
 * reads, topk 0, a row_map of the wrong type or length. */
#include "routing_ids.h"
#include "test_util.h"

typedef struct {
    fm_dtype dt;
    fm_scale_mode m;
} fmt;

static size_t ssize(fm_scale_mode m) { return m == FM_SCALE_MX32 ? 1 : 4; }

/* A quantized [rows, N] tensor in its own buffers (layout and mode of f). */
typedef struct {
    fm_tensor t;
    tu_buf d, s;
} qt;

static qt qt_new(fm_dtype dt, fm_scale_mode m, fm_layout lay, int64_t rows, int64_t N)
{
    qt q;
    q.t = fm_tensor_quant_2d(NULL, dt, rows, N, lay, m, NULL, FM_SCALE_LAYOUT_COMPACT);
    q.d = tu_buf_new((size_t)fm_tensor_nbytes(&q.t));
    q.s = tu_buf_new((size_t)fm_tensor_scale_nbytes(&q.t));
    q.t.data = q.d.p;
    q.t.scale = q.s.p;
    return q;
}

static void qt_free(qt *q)
{
    tu_buf_free(&q->d);
    tu_buf_free(&q->s);
}

/* x [T, N] routed to E experts, k choices each (some -1), padded to `pad`. */
static void check_case(fm_context *ctx, int64_t T, int64_t N, int64_t E, int k, int pad, fmt fi, fmt fo,
                       fm_requant_rule rule, int kind)
{
    char cs[200];
    snprintf(cs, sizeof cs, "%s %s -> %s %s rule %d %s T %lld N %lld E %lld k %d pad %d", fm_dtype_name(fi.dt),
             fm_scale_mode_name(fi.m), fm_dtype_name(fo.dt), fm_scale_mode_name(fo.m), (int)rule, tu_data_name(kind),
             (long long)T, (long long)N, (long long)E, k, pad);
    float *x = malloc(sizeof(float) * (size_t)(T * N + 1));
    tu_fill(x, T * N, N, kind);
    qt xin = qt_new(fi.dt, fi.m, FM_LAYOUT_ROWWISE, T, N);
    fm_tensor tx = fm_tensor_2d(x, FM_DTYPE_F32, T, N);
    CHECK(fm_quantize(ctx, NULL, &tx, &xin.t, NULL) == FM_OK, "%s: quantize: %s", cs, fm_last_error(ctx));

    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(T * k + 1));
    random_routing(ids, T, k, E, tu_rand);
    const int64_t Rmax = T * k + E * (pad - 1);
    qt xp = qt_new(fi.dt, fi.m, FM_LAYOUT_ROWWISE, Rmax, N);
    int32_t *rm = malloc(sizeof(int32_t) * (size_t)(Rmax + 1)), *sr = malloc(sizeof(int32_t) * (size_t)(T * k + 1));
    int64_t *spl = malloc(sizeof(int64_t) * (size_t)E), *hs = malloc(sizeof(int64_t) * (size_t)E);
    fm_tensor tid = fm_tensor_2d(ids, FM_DTYPE_I32, T, k), trm = fm_tensor_2d(rm, FM_DTYPE_I32, Rmax, 1);
    fm_tensor tsr = fm_tensor_2d(sr, FM_DTYPE_I32, T, k), tsp = fm_tensor_2d(spl, FM_DTYPE_I64, 1, E);
    fm_permute_config pc = {pad};
    CHECK(fm_moe_permute(ctx, &pc, &xin.t, &tid, NULL, &xp.t, &trm, &tsr, &tsp, NULL, hs) == FM_OK, "%s: permute: %s",
          cs, fm_last_error(ctx));
    int64_t R = 0;
    for (int64_t e = 0; e < E; e++)
        R += hs[e];
    fm_splits sp = {.groups = E, .host = hs};
    xp.t.shape[0] = R;
    trm.shape[0] = R;

    fm_tensor shape = fm_tensor_quant_2d(NULL, fo.dt, R, N, FM_LAYOUT_COLWISE, fo.m, NULL, FM_SCALE_LAYOUT_COMPACT);
    const int64_t nsc = fm_tensor_grouped_scale_count(&shape, &sp);
    const size_t db = (size_t)(fo.dt == FM_DTYPE_E2M1 ? R * N / 2 : R * N), sb = (size_t)nsc * ssize(fo.m);
    tu_buf wd = tu_buf_new(db), ws = tu_buf_new(sb), gd = tu_buf_new(db), gs = tu_buf_new(sb);
    tu_buf_poison(&wd, 0x11);
    tu_buf_poison(&ws, 0x22);
    tu_buf_poison(&gd, 0x33);
    tu_buf_poison(&gs, 0x44);
    fm_tensor want = shape, got = shape;
    want.data = wd.p, want.scale = ws.p, got.data = gd.p, got.scale = gs.p;
    int64_t wbad = -7, gbad = -9;
    fm_requant_config wc = {.rule = rule, .nonfinite_blocks = &wbad}, gc = {.rule = rule, .nonfinite_blocks = &gbad};
    CHECK(fm_transpose_scaled_grouped(ctx, &wc, &sp, &xp.t, &want) == FM_OK, "%s: grouped: %s", cs,
          fm_last_error(ctx));
    CHECK(fm_transpose_scaled_grouped_rows(ctx, &gc, &sp, &xin.t, &trm, k, &got) == FM_OK, "%s: rows: %s", cs,
          fm_last_error(ctx));
    tu_same_bytes(gd.p, wd.p, db, "codes", cs);
    tu_same_bytes(gs.p, ws.p, sb, "scales", cs);
    CHECK(gbad == wbad, "%s: nonfinite_blocks %lld, the permuted rows' %lld", cs, (long long)gbad, (long long)wbad);
    CHECK(tu_buf_guard_ok(&gd) && tu_buf_guard_ok(&gs), "%s: wrote past out", cs);

    tu_buf_free(&wd), tu_buf_free(&ws), tu_buf_free(&gd), tu_buf_free(&gs);
    qt_free(&xp), qt_free(&xin);
    free(x), free(ids), free(rm), free(sr), free(spl), free(hs);
}

static void test_equals_permute_then_transpose(fm_context *ctx)
{
    static const struct {
        fmt i, o;
        fm_requant_rule rule;
    } cases[] = {
        {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, FM_REQUANT_TIGHT},
        {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, FM_REQUANT_ROWMAX},
        {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128}, FM_REQUANT_ROWMAX},
        {{FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128}, FM_REQUANT_TIGHT},
        {{FM_DTYPE_E4M3, FM_SCALE_MX32}, {FM_DTYPE_E4M3, FM_SCALE_MX32}, FM_REQUANT_MX_FLOOR},
        {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E5M2, FM_SCALE_MX32}, FM_REQUANT_TIGHT},
        {{FM_DTYPE_E4M3, FM_SCALE_MX32}, {FM_DTYPE_E2M1, FM_SCALE_MX32}, FM_REQUANT_TIGHT},
    };
    static const int pads[] = {128, 16, 1};
    static const int64_t Ns[] = {256, 160, 48};
    int it = 0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int p = 0; p < 3; p++, it++) {
            const int pad = cases[c].o.dt == FM_DTYPE_E2M1 ? 2 * pads[p] : pads[p]; /* E2M1 groups stay even */
            const int64_t E = 1 + it % 6;
            const int k = 1 + it % 3 < E ? 1 + it % 3 : (int)E;
            check_case(ctx, 37 + 61 * (it % 4), Ns[it % 3], E, k, pad, cases[c].i, cases[c].o, cases[c].rule,
                       it % TD_COUNT);
        }
}

/* Refusals name the argument; a bad scale counts on a row no expert reads. */
static void test_refusals(fm_context *ctx)
{
    const int64_t T = 4, N = 128, R = 4;
    qt xin = qt_new(FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, T, N);
    memset(xin.d.p, 0x38, xin.d.n);
    for (int64_t t = 0; t < T; t++)
        ((float *)xin.s.p)[t] = t == 3 ? 3.0f : 0.5f;
    int32_t rm[4] = {0, 1, 2, -1}; /* token 3 (k = 1) is read by no row */
    int64_t hs[1] = {R};
    fm_splits sp = {.groups = 1, .host = hs};
    fm_tensor trm = fm_tensor_2d(rm, FM_DTYPE_I32, R, 1);
    qt out = qt_new(FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE, R, N);
    tu_buf_poison(&out.d, 0x5A);
    fm_status st = fm_transpose_scaled_grouped_rows(ctx, NULL, &sp, &xin.t, &trm, 1, &out.t);
    CHECK(st == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "in->scale") && strstr(fm_last_error(ctx), "row 3"),
          "unused row's scale 3: %d %s", (int)st, fm_last_error(ctx));
    CHECK(out.d.p[0] == 0x5A && out.d.p[out.d.n - 1] == 0x5A, "a refused call wrote out");
    ((float *)xin.s.p)[3] = 0.25f;
    CHECK(fm_transpose_scaled_grouped_rows(ctx, NULL, &sp, &xin.t, &trm, 1, &out.t) == FM_OK, "valid: %s",
          fm_last_error(ctx));
    st = fm_transpose_scaled_grouped_rows(ctx, NULL, &sp, &xin.t, &trm, 0, &out.t);
    CHECK(st == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "topk"), "topk 0: %s", fm_last_error(ctx));
    fm_tensor f32 = fm_tensor_2d(rm, FM_DTYPE_F32, R, 1);
    st = fm_transpose_scaled_grouped_rows(ctx, NULL, &sp, &xin.t, &f32, 1, &out.t);
    CHECK(st == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "row_map"), "F32 row_map: %s", fm_last_error(ctx));
    fm_tensor shortm = fm_tensor_2d(rm, FM_DTYPE_I32, R - 1, 1);
    st = fm_transpose_scaled_grouped_rows(ctx, NULL, &sp, &xin.t, &shortm, 1, &out.t);
    CHECK(st == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "row_map"), "short row_map: %s", fm_last_error(ctx));
    st = fm_transpose_scaled_grouped_rows(ctx, NULL, NULL, &xin.t, &trm, 1, &out.t);
    CHECK(st == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "splits"), "NULL splits: %s", fm_last_error(ctx));
    qt_free(&out);
    qt_free(&xin);
}

int main(void)
{
    tu_begin("test_transpose_rows_equals_permute_then_transpose");
    fm_context *ctx = tu_cpu_context(1);
    test_equals_permute_then_transpose(ctx);
    test_refusals(ctx);
    fm_context_destroy(ctx);
    return tu_end();
}
