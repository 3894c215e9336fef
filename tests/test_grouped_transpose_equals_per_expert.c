/* fm_transpose_scaled_grouped: each group's part of the output (its own
 * column-wise [N, M_i] matrix at element offset N * sum(M_j, j < i), its own
 * scale array after the earlier groups' ones) equals, bit for bit,
 * fm_transpose_scaled of that group's rows alone, for every dtype / mode /
 * rule / scale layout the op accepts, ragged splits with empty groups, 1, 127,
 * 128 and 129 rows, all rows in one group, and nasty data; nothing outside
 * the grouped layout is written; nonfinite_blocks is the sum over groups;
 * invalid splits and descriptors are refused with a sentence naming them. */
#include <math.h>

#include "test_util.h"

typedef struct {
    fm_dtype dt;
    fm_scale_mode m;
} fmt;

static const fmt formats[] = {
    {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E4M3, FM_SCALE_MX32},
    {FM_DTYPE_E5M2, FM_SCALE_MX32},        {FM_DTYPE_E2M1, FM_SCALE_MX32},
    /* outputs only: ROWMAX 1x128 -> one scale per 128 x 128 tile of each group */
    {FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128}, {FM_DTYPE_E5M2, FM_SCALE_BLOCK_128x128},
};
#define NFMT (sizeof formats / sizeof formats[0])

static size_t scale_size(fm_scale_mode m) { return m == FM_SCALE_MX32 ? 1 : 4; }

/* Data bytes of `rows` stored rows of `cols` elements. */
static int64_t code_bytes(fm_dtype d, int64_t rows, int64_t cols)
{
    return d == FM_DTYPE_E2M1 ? rows * cols / 2 : rows * cols;
}

/* A row-wise quantized copy of x [rows, N] (its own buffers). */
typedef struct {
    fm_tensor t;
    tu_buf data, scale;
} qt;

static qt quantize_rows(fm_context *ctx, const float *x, int64_t rows, int64_t N, fmt f, fm_scale_layout sl)
{
    qt q;
    q.t = fm_tensor_quant_2d(NULL, f.dt, rows, N, FM_LAYOUT_ROWWISE, f.m, NULL, sl);
    q.data = tu_buf_new((size_t)fm_tensor_nbytes(&q.t));
    q.scale = tu_buf_new((size_t)fm_tensor_scale_nbytes(&q.t));
    q.t.data = q.data.p;
    q.t.scale = q.scale.p;
    fm_tensor xt = fm_tensor_2d((void *)x, FM_DTYPE_F32, rows, N);
    CHECK(fm_quantize(ctx, NULL, &xt, &q.t, NULL) == FM_OK, "quantize: %s", fm_last_error(ctx));
    return q;
}

static void qt_free(qt *q)
{
    tu_buf_free(&q->data);
    tu_buf_free(&q->scale);
}

/* One grouped transpose checked against the per-group ones. */
static void check_case(fm_context *ctx, const int64_t *sizes, int64_t G, int64_t N, fmt fi, fmt fo,
                       fm_requant_rule rule, fm_scale_layout sli, fm_scale_layout slo, int kind)
{
    int64_t rows = 0;
    for (int64_t g = 0; g < G; g++)
        rows += sizes[g];
    char cs[256];
    int n = snprintf(cs, sizeof cs, "%s %s -> %s %s rule %d layouts %s/%s %s N %lld splits", fm_dtype_name(fi.dt),
                     fm_scale_mode_name(fi.m), fm_dtype_name(fo.dt), fm_scale_mode_name(fo.m), (int)rule,
                     fm_scale_layout_name(sli), fm_scale_layout_name(slo), tu_data_name(kind), (long long)N);
    for (int64_t g = 0; g < G && n < (int)sizeof cs - 8; g++)
        n += snprintf(cs + n, sizeof cs - (size_t)n, " %lld", (long long)sizes[g]);

    float *x = malloc(sizeof(float) * (size_t)(rows * N > 0 ? rows * N : 1));
    tu_fill(x, rows * N, N, kind);
    qt in = quantize_rows(ctx, x, rows, N, fi, sli);

    /* Sizes of the grouped layout from the layouts' documentation (test_util), not the library. */
    int64_t want_scales = 0;
    for (int64_t g = 0; g < G; g++)
        want_scales += ref_scale_count(fo.m, slo, N, sizes[g]);
    fm_splits sp = {.groups = G, .host = sizes};
    fm_tensor out = fm_tensor_quant_2d(NULL, fo.dt, rows, N, FM_LAYOUT_COLWISE, fo.m, NULL, slo);
    CHECK(fm_tensor_grouped_scale_count(&out, &sp) == want_scales, "%s: grouped scale count %lld, want %lld", cs,
          (long long)fm_tensor_grouped_scale_count(&out, &sp), (long long)want_scales);
    tu_buf od = tu_buf_new((size_t)code_bytes(fo.dt, rows, N));
    tu_buf os = tu_buf_new((size_t)want_scales * scale_size(fo.m));
    tu_buf_poison(&od, 0xA5);
    tu_buf_poison(&os, 0x5A);
    out.data = od.p;
    out.scale = os.p;
    out.data_capacity = (int64_t)od.n;
    out.scale_capacity = (int64_t)os.n;
    int64_t bad = -7;
    fm_requant_config rc = {.rule = rule, .nonfinite_blocks = &bad};
    fm_status st = fm_transpose_scaled_grouped(ctx, &rc, &sp, &in.t, &out);
    CHECK(st == FM_OK, "%s: %s", cs, fm_last_error(ctx));
    CHECK(tu_buf_guard_ok(&od) && tu_buf_guard_ok(&os), "%s: wrote past the grouped layout", cs);

    int64_t row0 = 0, s0 = 0, want_bad = 0;
    for (int64_t g = 0; g < G; g++) {
        const int64_t M = sizes[g];
        qt slice = quantize_rows(ctx, x + row0 * N, M, N, fi, FM_SCALE_LAYOUT_COMPACT);
        fm_tensor want = fm_tensor_quant_2d(NULL, fo.dt, M, N, FM_LAYOUT_COLWISE, fo.m, NULL, slo);
        tu_buf wd = tu_buf_new((size_t)fm_tensor_nbytes(&want)), ws = tu_buf_new((size_t)fm_tensor_scale_nbytes(&want));
        tu_buf_poison(&wd, 0x33);
        tu_buf_poison(&ws, 0x44);
        want.data = wd.p;
        want.scale = ws.p;
        int64_t gbad = -7;
        fm_requant_config wc = {.rule = rule, .nonfinite_blocks = &gbad};
        CHECK(fm_transpose_scaled(ctx, &wc, &slice.t, &want) == FM_OK, "%s group %lld: %s", cs, (long long)g,
              fm_last_error(ctx));
        want_bad += gbad;
        char what[300];
        snprintf(what, sizeof what, "%s group %lld codes", cs, (long long)g);
        tu_same_bytes(od.p + code_bytes(fo.dt, row0, N), wd.p, wd.n, what, "");
        snprintf(what, sizeof what, "%s group %lld scales", cs, (long long)g);
        CHECK((int64_t)ws.n == ref_scale_count(fo.m, slo, N, M) * (int64_t)scale_size(fo.m), "%s group %lld", cs,
              (long long)g);
        tu_same_bytes(os.p + (size_t)s0 * scale_size(fo.m), ws.p, ws.n, what, "");
        tu_buf_free(&wd);
        tu_buf_free(&ws);
        qt_free(&slice);
        row0 += M;
        s0 += ref_scale_count(fo.m, slo, N, M);
    }
    CHECK(bad == want_bad, "%s: nonfinite_blocks %lld, groups alone %lld", cs, (long long)bad, (long long)want_bad);
    tu_buf_free(&od);
    tu_buf_free(&os);
    qt_free(&in);
    free(x);
}

static int accepts(fmt fi, fmt fo, fm_requant_rule rule)
{
    if (fi.m == FM_SCALE_BLOCK_128x128)
        return 0;
    if (fo.m == FM_SCALE_BLOCK_128x128)
        return rule == FM_REQUANT_ROWMAX && fi.dt == fo.dt && fi.m == FM_SCALE_BLOCK_1x128;
    if (rule == FM_REQUANT_ROWMAX)
        return fi.dt == fo.dt && fi.m == fo.m;
    if (rule == FM_REQUANT_MX_FLOOR)
        return fo.m == FM_SCALE_MX32;
    return 1;
}

static void test_every_format_and_split(fm_context *ctx)
{
    /* Ragged splits; E2M1 outputs take the even variant (odd is refused, see below). */
    static const int64_t s_edge[] = {0, 1, 127, 128, 129, 0}, s_edge2[] = {0, 2, 126, 128, 130, 0};
    static const int64_t s_one[] = {0, 0, 300, 0}, s_single[] = {257}, s_single2[] = {258};
    static const int64_t s_empty[] = {0, 0, 0}, s_row[] = {1}, s_row2[] = {2};
    struct {
        const int64_t *odd, *even;
        int64_t G;
    } splits[] = {{s_edge, s_edge2, 6}, {s_one, s_one, 4}, {s_single, s_single2, 1}, {s_empty, s_empty, 3},
                  {s_row, s_row2, 1}, {NULL, NULL, 8}};
    static const int64_t Ns[] = {200, 256, 34, 130, 2};
    int64_t rnd[8];
    long iter = 0;
    for (size_t a = 0; a < NFMT; a++)
        for (size_t b = 0; b < NFMT; b++)
            for (int rule = 0; rule < FM_REQUANT_RULE_COUNT; rule++) {
                if (!accepts(formats[a], formats[b], (fm_requant_rule)rule))
                    continue;
                for (size_t s = 0; s < sizeof splits / sizeof splits[0]; s++, iter++) {
                    const int e2m1_out = formats[b].dt == FM_DTYPE_E2M1;
                    const int64_t *sz = e2m1_out ? splits[s].even : splits[s].odd;
                    if (!sz) { /* 8 random experts, some empty */
                        for (int g = 0; g < 8; g++) {
                            rnd[g] = tu_randint(0, 3) == 0 ? 0 : tu_randint(1, 260);
                            if (e2m1_out)
                                rnd[g] &= ~(int64_t)1;
                        }
                        sz = rnd;
                    }
                    int64_t N = Ns[iter % 5];
                    if (formats[a].dt == FM_DTYPE_E2M1 && (N & 1))
                        N++;
                    check_case(ctx, sz, splits[s].G, N, formats[a], formats[b], (fm_requant_rule)rule,
                               (fm_scale_layout)(iter & 1), (fm_scale_layout)((iter >> 1) & 1), (int)(iter % TD_COUNT));
                }
            }
}

/* Every refusal names the argument; nothing is written. */
static void test_invalid_arguments_are_refused(fm_context *ctx)
{
    const int64_t rows = 260, N = 256;
    float *x = malloc(sizeof(float) * rows * N);
    tu_fill(x, rows * N, N, TD_RANDOM);
    fmt f = {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128};
    qt in = quantize_rows(ctx, x, rows, N, f, FM_SCALE_LAYOUT_COMPACT);
    int64_t ok_sizes[] = {10, 0, 10, 240};
    fm_splits sp = {.groups = 4, .host = ok_sizes};
    fm_tensor out = fm_tensor_quant_2d(NULL, f.dt, rows, N, FM_LAYOUT_COLWISE, f.m, NULL, FM_SCALE_LAYOUT_COMPACT);
    int64_t ns = fm_tensor_grouped_scale_count(&out, &sp);
    CHECK(ns == N * (1 + 0 + 1 + 2), "grouped scale count %lld", (long long)ns);
    tu_buf od = tu_buf_new((size_t)(rows * N)), os = tu_buf_new((size_t)ns * 4);
    tu_buf_poison(&od, 0xA5);
    tu_buf_poison(&os, 0xA5);
    out.data = od.p;
    out.scale = os.p;

#define REFUSED(sp_, in_, out_, word)                                                                          \
    do {                                                                                                       \
        fm_status st_ = fm_transpose_scaled_grouped(ctx, NULL, sp_, in_, out_);                                \
        CHECK(st_ == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), word), "status %s, message '%s', want '%s'", \
              fm_status_name(st_), fm_last_error(ctx), word);                                                  \
    } while (0)

    REFUSED(NULL, &in.t, &out, "splits");
    int64_t neg[] = {100, -1, 161}, less[] = {100, 0, 150}, more[] = {100, 0, 170}, big[] = {INT64_MAX, 1, 0};
    fm_splits bad[] = {{.groups = 0, .host = ok_sizes},   {.groups = -2, .host = ok_sizes},
                       {.groups = 3, .host = NULL},        {.groups = 3, .host = neg},
                       {.groups = 3, .host = less},        {.groups = 3, .host = more},
                       {.groups = 3, .host = big}};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        REFUSED(&bad[k], &in.t, &out, "splits");
        CHECK(fm_tensor_grouped_scale_count(&out, &bad[k]) == -1, "grouped scale count of invalid splits %zu", k);
    }
    CHECK(fm_tensor_grouped_scale_count(&out, NULL) == -1, "grouped scale count without splits");

    /* Capacity measured on the grouped scale array (longer than the ungrouped N * 3). */
    out.scale_capacity = (ns - 1) * 4;
    CHECK(fm_tensor_scale_count(&out) < ns, "the case must have more grouped than ungrouped scales");
    REFUSED(&sp, &in.t, &out, "scale_capacity");
    out.scale_capacity = 0;

    /* The input's scales right after the ungrouped size of out's: only the grouped measure sees the overlap. */
    const int64_t nu = fm_tensor_scale_count(&out);
    tu_buf shared = tu_buf_new((size_t)(nu * 4) + in.scale.n);
    memcpy(shared.p + nu * 4, in.scale.p, in.scale.n);
    fm_tensor in2 = in.t, alias = out;
    in2.scale = shared.p + nu * 4;
    alias.scale = shared.p;
    REFUSED(&sp, &in2, &alias, "overlap");
    tu_buf_free(&shared);

    fm_tensor rw = out;
    rw.layout = FM_LAYOUT_ROWWISE;
    REFUSED(&sp, &in.t, &rw, "out");
    fm_tensor in_col = in.t;
    in_col.layout = FM_LAYOUT_COLWISE;
    REFUSED(&sp, &in_col, &out, "in");
    fm_tensor in3 = in.t, out3 = out;
    in3.ndim = out3.ndim = 3;
    in3.shape[0] = out3.shape[0] = 1;
    in3.shape[1] = out3.shape[1] = rows;
    in3.shape[2] = out3.shape[2] = N;
    REFUSED(&sp, &in3, &out3, "in");
    fm_requant_config floor_rule = {.rule = FM_REQUANT_MX_FLOOR};
    CHECK(fm_transpose_scaled_grouped(ctx, &floor_rule, &sp, &in.t, &out) == FM_ERR_INVALID_ARG &&
              strstr(fm_last_error(ctx), "cfg->rule"),
          "MX_FLOOR into BLOCK_1x128 accepted: %s", fm_last_error(ctx));

    /* E2M1 output: odd groups would split a byte between two groups' matrices. */
    fmt f4 = {FM_DTYPE_E2M1, FM_SCALE_MX32};
    fm_tensor out4 = fm_tensor_quant_2d(od.p, f4.dt, rows, N, FM_LAYOUT_COLWISE, f4.m, NULL, FM_SCALE_LAYOUT_COMPACT);
    int64_t odd[] = {99, 1, 160};
    fm_splits sp_odd = {.groups = 3, .host = odd};
    tu_buf os4 = tu_buf_new((size_t)fm_tensor_grouped_scale_count(&out4, &sp_odd));
    out4.scale = os4.p;
    REFUSED(&sp_odd, &in.t, &out4, "splits");
    CHECK(strstr(fm_last_error(ctx), "even"), "message: %s", fm_last_error(ctx));

    /* BLOCK_128x128 has no grouped form. */
    fmt f128 = {FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128};
    fm_tensor in128 = fm_tensor_quant_2d(in.data.p, f128.dt, rows, N, FM_LAYOUT_ROWWISE, f128.m, in.scale.p,
                                         FM_SCALE_LAYOUT_COMPACT);
    fm_tensor out128 = fm_tensor_quant_2d(od.p, f128.dt, rows, N, FM_LAYOUT_COLWISE, f128.m, os.p,
                                          FM_SCALE_LAYOUT_COMPACT);
    REFUSED(&sp, &in128, &out128, "BLOCK_128x128");

    /* A scale that is not a power of two: refused before anything is written. */
    float *s = (float *)in.scale.p;
    float keep = s[5];
    s[5] = keep * 1.5f;
    REFUSED(&sp, &in.t, &out, "power of two");
    /* The CPU reference checks even when the caller vouches for the scales. */
    fm_requant_config trusted = {.trusted_pow2_scales = 1};
    CHECK(fm_transpose_scaled_grouped(ctx, &trusted, &sp, &in.t, &out) == FM_ERR_INVALID_ARG &&
              strstr(fm_last_error(ctx), "power of two"),
          "trusted_pow2_scales let a scale of 1.5 x 2^k through the CPU: %s", fm_last_error(ctx));
    s[5] = keep;
    int untouched = 1;
    for (size_t i = 0; i < od.n; i++)
        untouched &= od.p[i] == 0xA5;
    for (size_t i = 0; i < os.n; i++)
        untouched &= os.p[i] == 0xA5;
    CHECK(untouched, "a refused call wrote its output");

    fm_stats before, after;
    fm_stats_get(ctx, &before);
    CHECK(fm_transpose_scaled_grouped(ctx, NULL, &sp, &in.t, &out) == FM_OK, "valid call: %s", fm_last_error(ctx));
    fm_stats_get(ctx, &after);
    CHECK(after.calls[FM_OP_TRANSPOSE_SCALED_GROUPED] == before.calls[FM_OP_TRANSPOSE_SCALED_GROUPED] + 1 &&
              after.casts_to_low == before.casts_to_low && after.casts_to_high == before.casts_to_high,
          "stats: the grouped transpose is counted as an op, not a cast");
#undef REFUSED
    tu_buf_free(&os4);
    tu_buf_free(&od);
    tu_buf_free(&os);
    qt_free(&in);
    free(x);
}

int main(void)
{
    tu_begin("test_grouped_transpose_equals_per_expert");
    fm_context *ctx = tu_cpu_context(2);
    test_every_format_and_split(ctx);
    test_invalid_arguments_are_refused(ctx);
    fm_context_destroy(ctx);
    return tu_end();
}
