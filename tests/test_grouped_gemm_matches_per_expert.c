/* fm_grouped_gemm (m-grouped) and fm_grouped_gemm_wgrad (k-grouped) give,
 * expert by expert, bit for bit what the DESIGN.md rule gives on that
 * expert's slice alone (gemm_ref.h): ragged splits, empty experts, all rows
 * in one expert, one expert, every scale pair (k-grouped: x 1x128 or
 * 128x128), both scale layouts; the
 * k-grouped operands in the grouped column-wise layout are assembled by hand
 * here from per-expert matrices and scale arrays. Rows of an empty expert
 * are never written. */
#include "gemm_ref.h"

static void random_splits(int64_t *s, int64_t E, int pattern)
{
    for (int64_t e = 0; e < E; e++)
        s[e] = pattern == 0 ? tu_randint(0, 3) == 0 ? 0 : tu_randint(1, 150) : 0;
    if (pattern == 1)
        s[tu_randint(0, E - 1)] = tu_randint(1, 300); /* everything in one expert */
    if (pattern == 2)
        for (int64_t e = 0; e < E; e++)
            s[e] = e % 2 ? 0 : tu_randint(1, 3); /* tiny and empty */
}

typedef struct {
    fm_dtype a, b;
    fm_scale_mode ma, mb;
} pair;

static void m_grouped(fm_context *ctx, const pair *p, int64_t E, int pattern)
{
    int64_t splits[8], S = 0;
    random_splits(splits, E, pattern);
    for (int64_t e = 0; e < E; e++)
        S += splits[e];
    int64_t N = tu_randint(1, 140), K = tu_randint(1, 300);
    fm_dtype out = (fm_dtype)tu_randint(0, 1);
    int acc = out == FM_DTYPE_F32 && tu_randint(0, 1);
    fm_scale_layout sla = tu_randint(0, 1) ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
    fm_scale_layout slb = tu_randint(0, 1) ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
    gr_op A, B;
    gr_make(&A, p->a, p->ma, sla, FM_LAYOUT_ROWWISE, 1, S, K, GR_RANDOM);
    gr_make(&B, p->b, p->mb, slb, FM_LAYOUT_ROWWISE, -E, N, K, GR_RANDOM);
    void *d0 = gr_out_new(S * N, out, acc), *d = malloc((size_t)(S * N * 4 + 16));
    memcpy(d, d0, (size_t)(S * N * gr_esize(out)));
    fm_tensor dt = fm_tensor_2d(d, out, S, N);
    fm_splits sp = {.groups = E, .host = splits};
    fm_gemm_config cfg = {.accumulate = acc};
    char what[200];
    snprintf(what, sizeof what, "m-grouped %s(%s) x %s(%s) E %lld pattern %d sum M %lld N %lld K %lld -> %s%s",
             fm_dtype_name(p->a), fm_scale_mode_name(p->ma), fm_dtype_name(p->b), fm_scale_mode_name(p->mb),
             (long long)E, pattern, (long long)S, (long long)N, (long long)K, fm_dtype_name(out),
             acc ? " accumulate" : "");
    fm_status st = fm_grouped_gemm(ctx, &cfg, &sp, &A.t, &B.t, &dt);
    CHECK(st == FM_OK, "%s: %s: %s", what, fm_status_name(st), fm_last_error(ctx));
    double *ref = malloc((size_t)(300 * N + 1) * sizeof(double));
    int64_t row0 = 0, bad = 0;
    for (int64_t e = 0; e < E && st == FM_OK; e++) {
        gr_ref(&A, 0, row0, &B, e, splits[e], ref);
        for (int64_t i = 0; i < splits[e] * N && bad < 3; i++) {
            int64_t o = row0 * N + i;
            uint32_t want = gr_round(ref[i], out, acc, gr_get_out(d0, out, o), K);
            uint32_t got = gr_get_out(d, out, o);
            if (got != want)
                bad++;
            CHECK(got == want, "%s: expert %lld element (%lld, %lld) got 0x%08x want 0x%08x", what, (long long)e,
                  (long long)(i / N), (long long)(i % N), got, want);
        }
        row0 += splits[e];
    }
    free(ref);
    free(d);
    free(d0);
    gr_free(&A);
    gr_free(&B);
}

/* dW_e = dY_eᵀ · X_e: A_e = dY_eᵀ [N, M_e], B_e = X_eᵀ [K, M_e]. */
/* kind 0: BF16; 1: FP8 dy 1x128 x x 1x128; 2: FP8 dy 1x128 x x 128x128 (the
 * flow recipes' ROWMAX column copies of x and h). */
static void k_grouped(fm_context *ctx, int kind, int64_t E, int pattern)
{
    const int fp8 = kind != 0;
    int64_t splits[8], S = 0;
    random_splits(splits, E, pattern);
    for (int64_t e = 0; e < E; e++)
        S += splits[e];
    int64_t N = tu_randint(1, 70), K = tu_randint(1, 90);
    fm_dtype out = (fm_dtype)tu_randint(0, 1);
    int acc = out == FM_DTYPE_F32 && tu_randint(0, 1);
    fm_scale_layout sl = tu_randint(0, 1) ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
    fm_dtype da = fp8 ? FM_DTYPE_E4M3 : FM_DTYPE_BF16, db = fp8 ? (fm_dtype)tu_randint(3, 4) : FM_DTYPE_BF16;
    fm_scale_mode m = fp8 ? FM_SCALE_BLOCK_1x128 : FM_SCALE_NONE;
    fm_scale_mode mx = kind == 2 ? FM_SCALE_BLOCK_128x128 : m;
    /* Row-wise per-expert [N, M_e] matrices concatenate into the grouped
     * column-wise layout; column-wise ones ([M_e, N] stored) into the plain
     * row-wise tensor (unscaled only). */
    fm_layout le = fp8 || tu_randint(0, 1) ? FM_LAYOUT_ROWWISE : FM_LAYOUT_COLWISE;
    gr_op A[8], B[8];
    size_t ea = (size_t)gr_esize(da), eb = (size_t)gr_esize(db);
    uint8_t *dyd = malloc(S * N * ea + 16), *xd = malloc(S * K * eb + 16);
    float *dys = malloc(sizeof(float) * (size_t)(2 * (N + 4) * (S + 128 * E) + 16));
    float *xs = malloc(sizeof(float) * (size_t)(2 * (K + 4) * (S + 128 * E) + 16));
    int64_t row0 = 0, sa = 0, sb = 0;
    for (int64_t e = 0; e < E; e++) {
        gr_make(&A[e], da, m, sl, le, 1, N, splits[e], GR_RANDOM);
        gr_make(&B[e], db, mx, sl, le, 1, K, splits[e], GR_RANDOM);
        memcpy(dyd + row0 * N * ea, A[e].data, (size_t)splits[e] * N * ea);
        memcpy(xd + row0 * K * eb, B[e].data, (size_t)splits[e] * K * eb);
        if (fp8) {
            memcpy(dys + sa, A[e].scale, sizeof(float) * (size_t)A[e].per_scales);
            memcpy(xs + sb, B[e].scale, sizeof(float) * (size_t)B[e].per_scales);
            sa += A[e].per_scales;
            sb += B[e].per_scales;
        }
        row0 += splits[e];
    }
    fm_layout lt = le == FM_LAYOUT_ROWWISE ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE;
    fm_tensor dy = fm_tensor_2d(dyd, da, S, N), x = fm_tensor_2d(xd, db, S, K);
    dy.layout = x.layout = lt;
    if (fp8) {
        dy.scale_mode = m;
        x.scale_mode = mx;
        dy.scale_layout = x.scale_layout = sl;
        dy.scale = dys;
        x.scale = xs;
        dy.scale_capacity = sa * 4;
        x.scale_capacity = sb * 4;
    }
    void *d0 = gr_out_new(E * N * K, out, acc), *d = malloc((size_t)(E * N * K * 4 + 16));
    memcpy(d, d0, (size_t)(E * N * K * gr_esize(out)));
    fm_tensor dw = fm_tensor_3d(d, out, E, N, K);
    fm_splits sp = {.groups = E, .host = splits};
    fm_gemm_config cfg = {.accumulate = acc};
    char what[200];
    snprintf(what, sizeof what, "k-grouped %s x %s %s (x %s), %s E %lld pattern %d sum M %lld N %lld K %lld -> %s%s",
             fm_dtype_name(da), fm_dtype_name(db), fm_layout_name(lt), fm_scale_mode_name(mx),
             fm_scale_layout_name(sl), (long long)E,
             pattern, (long long)S, (long long)N, (long long)K, fm_dtype_name(out), acc ? " accumulate" : "");
    fm_status st = fm_grouped_gemm_wgrad(ctx, &cfg, &sp, &dy, &x, &dw);
    CHECK(st == FM_OK, "%s: %s: %s", what, fm_status_name(st), fm_last_error(ctx));
    double *ref = malloc((size_t)(N * K + 1) * sizeof(double));
    int bad = 0;
    for (int64_t e = 0; e < E && st == FM_OK; e++) {
        gr_ref(&A[e], 0, 0, &B[e], 0, N, ref);
        for (int64_t i = 0; i < N * K && bad < 3; i++) {
            int64_t o = e * N * K + i;
            uint32_t want = gr_round(ref[i], out, acc, gr_get_out(d0, out, o), splits[e]);
            uint32_t got = gr_get_out(d, out, o);
            if (got != want)
                bad++;
            CHECK(got == want, "%s: expert %lld (M_e %lld) element (%lld, %lld) got 0x%08x want 0x%08x", what,
                  (long long)e, (long long)splits[e], (long long)(i / K), (long long)(i % K), got, want);
        }
    }
    for (int64_t e = 0; e < E; e++) {
        gr_free(&A[e]);
        gr_free(&B[e]);
    }
    free(ref);
    free(d);
    free(d0);
    free(dyd);
    free(xd);
    free(dys);
    free(xs);
}

int main(void)
{
    tu_begin("test_grouped_gemm_matches_per_expert");
    fm_context *ctx = tu_cpu_context(2);
    static const pair pairs[] = {
        {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_SCALE_TENSOR},
        {FM_DTYPE_E5M2, FM_DTYPE_E4M3, FM_SCALE_ROW, FM_SCALE_ROW},
        {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128},
        {FM_DTYPE_E4M3, FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_1x128},
        {FM_DTYPE_BF16, FM_DTYPE_BF16, FM_SCALE_NONE, FM_SCALE_NONE},
        {FM_DTYPE_F32, FM_DTYPE_F32, FM_SCALE_NONE, FM_SCALE_NONE},
    };
    static const int64_t Es[] = {1, 3, 8};
    for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++)
        for (int ei = 0; ei < 3; ei++)
            for (int pattern = 0; pattern < 3; pattern++)
                m_grouped(ctx, &pairs[p], Es[ei], pattern);
    for (int kind = 0; kind < 3; kind++)
        for (int ei = 0; ei < 3; ei++)
            for (int pattern = 0; pattern < 3; pattern++)
                for (int rep = 0; rep < 2; rep++)
                    k_grouped(ctx, kind, Es[ei], pattern);
    fm_context_destroy(ctx);
    return tu_end();
}
