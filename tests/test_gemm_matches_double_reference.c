/* fm_gemm and fm_linear_* give, bit for bit, the DESIGN.md rule computed in
 * double by a straightforward triple loop (gemm_ref.h): every dtype pair,
 * every scale pair, both scale layouts, row- and column-wise BF16/F32
 * operands, odd shapes, a partial last K block, one row, K = 0, BF16 and F32
 * outputs, accumulate, wide scale spreads, zeros and max magnitudes; and the
 * result does not depend on the thread count. */
#include "gemm_ref.h"

typedef struct {
    fm_dtype a, b;
    fm_scale_mode ma, mb;
} pair;

static const pair pairs[] = {
    {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_SCALE_TENSOR},
    {FM_DTYPE_E4M3, FM_DTYPE_E5M2, FM_SCALE_ROW, FM_SCALE_ROW},
    {FM_DTYPE_E5M2, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128},
    {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128},
    {FM_DTYPE_E4M3, FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_1x128},
    {FM_DTYPE_E5M2, FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_SCALE_TENSOR},
    {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_SCALE_BLOCK_128x128},
    {FM_DTYPE_BF16, FM_DTYPE_BF16, FM_SCALE_NONE, FM_SCALE_NONE},
    {FM_DTYPE_F32, FM_DTYPE_F32, FM_SCALE_NONE, FM_SCALE_NONE},
};

static const int64_t shapes[][3] = {
    /* M, N, K */
    {1, 1, 1}, {1, 70, 257}, {37, 19, 128}, {5, 3, 0}, {65, 130, 300}, {130, 9, 385}, {4, 4, 129}, {17, 256, 64},
};

static int fp8(fm_dtype d) { return d == FM_DTYPE_E4M3 || d == FM_DTYPE_E5M2; }

/* One product through the entry point `via` (0 fm_gemm, 1 forward, 2 dgrad,
 * 3 wgrad), with A [M, K] and B [N, K] given as the copies it needs. */
static fm_status call(fm_context *ctx, int via, const fm_gemm_config *cfg, const gr_op *A, const gr_op *B,
                      fm_tensor *d)
{
    fm_tensor at = fm_tensor_t(&A->t), bt = fm_tensor_t(&B->t);
    switch (via) {
    case 1: return fm_linear_forward(ctx, cfg, &A->t, &B->t, d);
    case 2: return fm_linear_dgrad(ctx, cfg, &A->t, &bt, d);   /* w = Bᵀ's other copy: W [K, N] column-wise */
    case 3: return fm_linear_wgrad(ctx, cfg, &at, &bt, d);     /* dy [K, M], x [K, N], both column-wise */
    default: return fm_gemm(ctx, cfg, &A->t, &B->t, d);
    }
}

static void one(fm_context *const *ctxs, int nctx, const pair *p, const int64_t *shape, fm_dtype out, int acc,
                int kind, int via)
{
    int64_t M = shape[0], N = shape[1], K = shape[2];
    fm_scale_layout sla = tu_randint(0, 1) ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
    fm_scale_layout slb = tu_randint(0, 1) ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
    fm_layout la = fp8(p->a) ? FM_LAYOUT_ROWWISE : (fm_layout)tu_randint(0, 1);
    fm_layout lb = fp8(p->b) ? FM_LAYOUT_ROWWISE : (fm_layout)tu_randint(0, 1);
    gr_op A, B;
    gr_make(&A, p->a, p->ma, sla, la, 1, M, K, kind);
    gr_make(&B, p->b, p->mb, slb, lb, 1, N, K, kind);
    double *ref = malloc((size_t)(M * N + 1) * sizeof(double));
    gr_ref(&A, 0, 0, &B, 0, M, ref);
    void *d0 = gr_out_new(M * N, out, acc);
    void *d = malloc((size_t)(M * N * 4 + 16));
    fm_gemm_config cfg = {.accumulate = acc};
    char what[256];
    snprintf(what, sizeof what,
             "%s(%s) x %s(%s) A %s/%s B %s/%s M %lld N %lld K %lld -> %s%s data %d via %d", fm_dtype_name(p->a),
             fm_scale_mode_name(p->ma), fm_dtype_name(p->b), fm_scale_mode_name(p->mb), fm_layout_name(la),
             fm_scale_layout_name(sla), fm_layout_name(lb), fm_scale_layout_name(slb), (long long)M, (long long)N,
             (long long)K, fm_dtype_name(out), acc ? " accumulate" : "", kind, via);
    for (int c = 0; c < nctx; c++) {
        memcpy(d, d0, (size_t)(M * N * gr_esize(out)));
        fm_tensor dt = fm_tensor_2d(d, out, M, N);
        fm_status st = call(ctxs[c], via, &cfg, &A, &B, &dt);
        CHECK(st == FM_OK, "%s: status %s: %s", what, fm_status_name(st), fm_last_error(ctxs[c]));
        if (st)
            continue;
        int bad = 0;
        for (int64_t i = 0; i < M * N && bad < 3; i++) {
            uint32_t want = gr_round(ref[i], out, acc, gr_get_out(d0, out, i), K);
            uint32_t got = gr_get_out(d, out, i);
            if (got != want) {
                bad++;
                CHECK(got == want, "%s ctx %d: element (%lld, %lld) got 0x%08x want 0x%08x (exact %.17g)", what, c,
                      (long long)(i / N), (long long)(i % N), got, want, ref[i]);
            }
        }
        CHECK(bad == 0, "%s ctx %d: mismatches", what, c);
    }
    free(d);
    free(d0);
    free(ref);
    gr_free(&A);
    gr_free(&B);
}

int main(void)
{
    tu_begin("test_gemm_matches_double_reference");
    fm_context *ctxs[3] = {tu_cpu_context(2), tu_cpu_context(1), tu_cpu_context(3)};
    size_t np = sizeof pairs / sizeof pairs[0], ns = sizeof shapes / sizeof shapes[0];
    for (size_t p = 0; p < np; p++)
        for (size_t s = 0; s < ns; s++) {
            int via = (int)tu_randint(0, 3);
            one(ctxs, 1, &pairs[p], shapes[s], FM_DTYPE_F32, 0, GR_RANDOM, via);
            one(ctxs, 1, &pairs[p], shapes[s], FM_DTYPE_BF16, 0, GR_RANDOM, (int)tu_randint(0, 3));
            one(ctxs, 1, &pairs[p], shapes[s], FM_DTYPE_F32, 1, GR_RANDOM, (int)tu_randint(0, 3));
            fm_dtype out = (fm_dtype)tu_randint(0, 1); /* F32 or BF16 */
            one(ctxs, 1, &pairs[p], shapes[s], out, out == FM_DTYPE_F32 && tu_randint(0, 1),
                (int)tu_randint(GR_WIDE, GR_MAXMAG), (int)tu_randint(0, 3));
        }
    /* Large enough to be split over threads: 1, 2 and 3 workers agree. */
    static const int64_t big[3] = {300, 200, 700};
    for (size_t p = 0; p < np; p++)
        one(ctxs, 3, &pairs[p], big, (fm_dtype)tu_randint(0, 1), 0, GR_RANDOM, 0);
    for (int c = 0; c < 3; c++)
        fm_context_destroy(ctxs[c]);
    return tu_end();
}
