/* The MoE layer over expert parallelism (the in-process communicator, one
 * thread per rank, each with its own CPU context) equals the single-rank
 * layer run on all ranks' tokens at once (rank r holding the r-th block of
 * tokens, its experts the r-th block of experts):
 *
 *  - bf16, fp8-blockwise, fp8-flow: the rows each expert sees are the same
 *    bytes in the same order, so every expert weight gradient equals the
 *    single-rank one bit for bit;
 *  - fp8-flow-fp4 sends x as MXFP4 (fm_convert_scaled there and back), which
 *    the single-rank layer does not (about 20% relative difference in y at
 *    these sizes: FP4's own error), so its reference is the same layer over
 *    a communicator of ONE rank: the same round trip, and then the same
 *    bit-for-bit expert gradients whatever the rank count;
 *  - y and dx differ only by the BF16 rounding of each rank's partial sum
 *    and the order of the sum: relative Frobenius error <= 5e-3 (DESIGN.md's
 *    BF16-output GEMM tolerance); the router gradient (this rank's tokens'
 *    share, summed over ranks here) <= 5e-4 (the F32-output one);
 *  - the flow recipes still make exactly 2 casts per step on every rank;
 *  - a second run gives the same bits (y, dx and every gradient).
 * 1, 2, 4 and 8 ranks (8: one expert each), ranks with no tokens, k = 2
 * and 3. Also: a config whose
 * ranks do not split the experts is refused with a sentence, and a rank that
 * fails its step (a bad x) aborts the group: the others return
 * FM_ERR_BACKEND instead of waiting forever. */
#include <math.h>
#include <pthread.h>

#include "test_util.h"

enum { MAXR = 8 };

typedef struct {
    int64_t H, I, E, Tmax;
    int k;
    fm_recipe rc;
    const float *wr, *w1, *w2;
} model;

typedef struct {
    const model *m;
    int r, nranks;
    fm_comm *comm;
    int64_t T;
    const float *x, *dy;
    float *y, *dx, *gr, *g1, *g2;
    int bad_x; /* this rank passes x with the wrong width */
    fm_status st;
    int64_t casts;
    char err[256];
} rank_io;

static fm_status run_layer(fm_context *ctx, const model *m, fm_comm *comm, int nranks, int rank, int64_t T,
                           int64_t Tmax, const float *x, const float *dy, float *y, float *dx, float *gr, float *g1,
                           float *g2, int bad_x, int64_t *casts)
{
    int64_t El = m->E / nranks;
    fm_moe_layer_config cfg = {.hidden = m->H, .ffn = m->I, .experts = m->E, .topk = m->k, .renormalize = 1,
                               .recipe = m->rc, .max_tokens = Tmax, .comm = comm};
    fm_moe_weights w = {(float *)m->wr, (float *)m->w1 + rank * El * 2 * m->I * m->H,
                        (float *)m->w2 + rank * El * m->H * m->I, gr, g1, g2};
    fm_tensor tx = fm_tensor_2d((void *)x, FM_DTYPE_F32, T, bad_x ? m->H - 1 : m->H);
    fm_tensor ty = fm_tensor_2d(y, FM_DTYPE_F32, T, m->H);
    fm_tensor tdy = fm_tensor_2d((void *)dy, FM_DTYPE_F32, T, m->H), tdx = fm_tensor_2d(dx, FM_DTYPE_F32, T, m->H);
    fm_moe_layer_info info = {0};
    fm_status st = layer_step(ctx, &cfg, &w, &tx, &ty, &tdy, &tdx, &info);
    *casts = info.casts_per_step;
    return st;
}

static void *rank_main(void *arg)
{
    rank_io *io = arg;
    fm_context *ctx = tu_cpu_context(1);
    io->st = run_layer(ctx, io->m, io->comm, io->nranks, io->r, io->T, io->m->Tmax, io->x, io->dy, io->y, io->dx,
                       io->gr, io->g1, io->g2, io->bad_x, &io->casts);
    snprintf(io->err, sizeof io->err, "%s", fm_last_error(ctx));
    fm_context_destroy(ctx);
    return NULL;
}

static double rel_frob(const float *got, const float *want, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)got[i] - (double)want[i];
        num += d * d;
        den += (double)want[i] * want[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static int all_finite(const float *p, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(p[i]))
            return 0;
    return 1;
}

/* The outputs of one expert-parallel step: y, dx (all tokens, rank blocks
 * in order), each rank's grad_router share [nranks][E, H], grad_w1, grad_w2
 * (all experts, rank blocks in order). */
typedef struct {
    float *p[5];
} ep_out;

/* One step over nranks in-process ranks (a thread and a CPU context each);
 * 1 when every rank succeeded (and made 2 casts, for the flow recipes). */
static int run_ep(const model *m, int nranks, const int64_t *Tr, const float *x, const float *dy, ep_out *out,
                  const char *what)
{
    int64_t H = m->H, I = m->I, E = m->E, El = E / nranks, Tall = 0, Tmax = 0;
    for (int r = 0; r < nranks; r++) {
        Tall += Tr[r];
        Tmax = Tr[r] > Tmax ? Tr[r] : Tmax;
    }
    model mr = *m;
    mr.Tmax = Tmax > 0 ? Tmax : 1;
    float *y = malloc((size_t)(Tall * H) * 4 + 4), *dx = malloc((size_t)(Tall * H) * 4 + 4);
    float *gr = calloc((size_t)(nranks * E * H), 4), *g1 = calloc((size_t)(E * 2 * I * H), 4);
    float *g2 = calloc((size_t)(E * H * I), 4);
    memset(y, 0xFF, (size_t)(Tall * H) * 4); /* NaN: every element must be written */
    memset(dx, 0xFF, (size_t)(Tall * H) * 4);
    *out = (ep_out){{y, dx, gr, g1, g2}};
    fm_comm *comms[MAXR];
    rank_io io[MAXR];
    CHECK(fm_comm_create_inproc(nranks, comms) == FM_OK, "%s: fm_comm_create_inproc: %s", what, fm_last_error(NULL));
    int64_t t0 = 0;
    for (int r = 0; r < nranks; r++) {
        io[r] = (rank_io){.m = &mr, .r = r, .nranks = nranks, .comm = comms[r], .T = Tr[r], .x = x + t0 * H,
                          .dy = dy + t0 * H, .y = y + t0 * H, .dx = dx + t0 * H, .gr = gr + r * E * H,
                          .g1 = g1 + r * El * 2 * I * H, .g2 = g2 + r * El * H * I};
        t0 += Tr[r];
    }
    pthread_t th[MAXR];
    for (int r = 0; r < nranks; r++)
        pthread_create(&th[r], NULL, rank_main, &io[r]);
    for (int r = 0; r < nranks; r++)
        pthread_join(th[r], NULL);
    int ok = 1;
    for (int r = 0; r < nranks; r++) {
        CHECK(io[r].st == FM_OK, "%s: rank %d: %s \"%s\"", what, r, fm_status_name(io[r].st), io[r].err);
        ok &= io[r].st == FM_OK;
        if (m->rc == FM_RECIPE_FP8_FLOW || m->rc == FM_RECIPE_FP8_FLOW_FP4)
            CHECK(io[r].st || io[r].casts == 2, "%s: rank %d made %lld casts in its step, not 2", what, r,
                  (long long)io[r].casts);
    }
    for (int r = 0; r < nranks; r++)
        fm_comm_destroy(comms[r]);
    return ok;
}

static void one_case(const model *m, int nranks, const int64_t *Tr)
{
    int64_t H = m->H, I = m->I, E = m->E, Tall = 0;
    for (int r = 0; r < nranks; r++)
        Tall += Tr[r];
    float *x = malloc((size_t)(Tall * H) * 4), *dy = malloc((size_t)(Tall * H) * 4);
    for (int64_t i = 0; i < Tall * H; i++)
        x[i] = (float)tu_normal(), dy[i] = (float)tu_normal();
    char what[96];
    snprintf(what, sizeof what, "%s, %d ranks, k %d", fm_recipe_name(m->rc), nranks, m->k);

    /* the single-rank layer over every token */
    float *y1 = malloc((size_t)(Tall * H) * 4), *dx1 = malloc((size_t)(Tall * H) * 4);
    float *gr1 = calloc((size_t)(E * H), 4), *g11 = calloc((size_t)(E * 2 * I * H), 4);
    float *g21 = calloc((size_t)(E * H * I), 4);
    fm_context *ctx = tu_cpu_context(2);
    int64_t casts1 = 0;
    fm_comm *one = NULL;
    if (m->rc == FM_RECIPE_FP8_FLOW_FP4)
        CHECK(fm_comm_create_inproc(1, &one) == FM_OK, "%s: fm_comm_create_inproc(1): %s", what, fm_last_error(NULL));
    fm_status st = run_layer(ctx, m, one, 1, 0, Tall, Tall, x, dy, y1, dx1, gr1, g11, g21, 0, &casts1);
    CHECK(st == FM_OK, "%s: the single-rank layer: %s", what, fm_last_error(ctx));
    fm_comm_destroy(one);
    fm_context_destroy(ctx);

    /* the same over nranks in-process ranks, twice: the second run must
     * give the same bits (the reductions have a fixed order) */
    ep_out a, b;
    int ok = run_ep(m, nranks, Tr, x, dy, &a, what) & run_ep(m, nranks, Tr, x, dy, &b, what);
    const int64_t n[5] = {Tall * H, Tall * H, nranks * E * H, E * 2 * I * H, E * H * I};
    static const char *const on[5] = {"y", "dx", "grad_router", "grad_w1", "grad_w2"};
    for (int o = 0; o < 5 && ok; o++)
        CHECK(memcmp(a.p[o], b.p[o], (size_t)n[o] * 4) == 0, "%s: %s differs between two runs", what, on[o]);
    float *y = a.p[0], *dx = a.p[1], *gr = a.p[2], *g1 = a.p[3], *g2 = a.p[4];
    if (ok) {
        for (int r = 1; r < nranks; r++) /* this rank's share, summed */
            for (int64_t i = 0; i < E * H; i++)
                gr[i] += gr[r * E * H + i];
        int64_t n1 = E * 2 * I * H, n2 = E * H * I;
        double ey = rel_frob(y, y1, Tall * H), edx = rel_frob(dx, dx1, Tall * H), er = rel_frob(gr, gr1, E * H);
        CHECK(all_finite(y, Tall * H) && all_finite(dx, Tall * H), "%s: y or dx holds a non-finite value", what);
        CHECK(ey <= 5e-3, "%s: y rel. error %.3g against the single-rank layer (tol 5e-3)", what, ey);
        CHECK(edx <= 5e-3, "%s: dx rel. error %.3g against the single-rank layer (tol 5e-3)", what, edx);
        CHECK(er <= 5e-4, "%s: grad_router rel. error %.3g (tol 5e-4)", what, er);
        CHECK(memcmp(g1, g11, (size_t)n1 * 4) == 0, "%s: grad_w1 differs from the single-rank layer's", what);
        CHECK(memcmp(g2, g21, (size_t)n2 * 4) == 0, "%s: grad_w2 differs from the single-rank layer's", what);
    }
    free(x), free(dy), free(y1), free(dx1), free(gr1), free(g11), free(g21);
    for (int o = 0; o < 5; o++)
        free(a.p[o]), free(b.p[o]);
}

/* One rank passes x of the wrong width: it fails with INVALID_ARG and its
 * abort releases the others with FM_ERR_BACKEND. */
static void failing_rank(const model *m)
{
    enum { N = 3 };
    model mr = *m;
    mr.E = 6;
    mr.Tmax = 20;
    float *buf = calloc((size_t)(N * 20 * m->H) * 7, 4);
    for (int64_t i = 0; i < N * 20 * m->H; i++)
        buf[i] = (float)tu_normal();
    fm_comm *comms[N];
    CHECK(fm_comm_create_inproc(N, comms) == FM_OK, "fm_comm_create_inproc: %s", fm_last_error(NULL));
    rank_io io[N];
    float *g1 = calloc((size_t)(mr.E * 2 * m->I * m->H), 4), *g2 = calloc((size_t)(mr.E * m->H * m->I), 4);
    float *gr = calloc((size_t)(N * mr.E * m->H), 4);
    float *wr = calloc((size_t)(mr.E * m->H), 4), *w1 = calloc((size_t)(mr.E * 2 * m->I * m->H), 4);
    float *w2 = calloc((size_t)(mr.E * m->H * m->I), 4);
    mr.wr = wr, mr.w1 = w1, mr.w2 = w2;
    int64_t per = 20 * m->H;
    for (int r = 0; r < N; r++)
        io[r] = (rank_io){.m = &mr, .r = r, .nranks = N, .comm = comms[r], .T = 20, .x = buf,
                          .dy = buf + per, .y = buf + (2 + r) * per, .dx = buf + (2 + N + r) * per,
                          .gr = gr + r * mr.E * m->H, .g1 = g1 + r * 2 * 2 * m->I * m->H,
                          .g2 = g2 + r * 2 * m->H * m->I, .bad_x = r == 1};
    pthread_t th[N];
    for (int r = 0; r < N; r++)
        pthread_create(&th[r], NULL, rank_main, &io[r]);
    for (int r = 0; r < N; r++)
        pthread_join(th[r], NULL);
    CHECK(io[1].st == FM_ERR_INVALID_ARG && strstr(io[1].err, "x:"), "the bad rank: %s \"%s\"",
          fm_status_name(io[1].st), io[1].err);
    CHECK(io[0].st == FM_ERR_BACKEND && io[2].st == FM_ERR_BACKEND,
          "the good ranks after the bad one aborted: %s \"%s\", %s \"%s\"", fm_status_name(io[0].st), io[0].err,
          fm_status_name(io[2].st), io[2].err);
    for (int r = 0; r < N; r++)
        fm_comm_destroy(comms[r]);
    free(buf), free(g1), free(g2), free(gr), free(wr), free(w1), free(w2);
}

int main(void)
{
    tu_begin("test_moe_layer_ep_equals_single_rank");
    const int64_t H = 128, I = 64, E = 8;
    float *wr = malloc((size_t)(E * H) * 4), *w1 = malloc((size_t)(E * 2 * I * H) * 4);
    float *w2 = malloc((size_t)(E * H * I) * 4);
    for (int64_t i = 0; i < E * H; i++)
        wr[i] = (float)(tu_normal() * 0.1);
    for (int64_t i = 0; i < E * 2 * I * H; i++)
        w1[i] = (float)(tu_normal() * 0.09);
    for (int64_t i = 0; i < E * H * I; i++)
        w2[i] = (float)(tu_normal() * 0.12);

    static const int64_t tokens[4][MAXR] = {{97}, {61, 80}, {45, 0, 70, 33}, {12, 30, 0, 7, 25, 1, 19, 40}};
    static const int ranks[4] = {1, 2, 4, 8};
    for (int rc = 0; rc < FM_RECIPE_COUNT; rc++)
        for (int c = 0; c < 4; c++) {
            model m = {H, I, E, 0, c == 1 ? 3 : 2, (fm_recipe)rc, wr, w1, w2};
            one_case(&m, ranks[c], tokens[c]);
        }

    /* 3 ranks cannot split 8 experts */
    {
        fm_comm *comms[3];
        CHECK(fm_comm_create_inproc(3, comms) == FM_OK, "fm_comm_create_inproc: %s", fm_last_error(NULL));
        fm_context *ctx = tu_cpu_context(1);
        fm_moe_layer_config cfg = {.hidden = H, .ffn = I, .experts = E, .topk = 2, .max_tokens = 8,
                                   .comm = comms[0]};
        fm_moe_layer *L = NULL;
        fm_status st = fm_moe_layer_create(ctx, &cfg, &L);
        CHECK(st == FM_ERR_INVALID_ARG && L == NULL && strstr(fm_last_error(ctx), "cfg->comm"),
              "3 ranks over 8 experts: %s \"%s\"", fm_status_name(st), fm_last_error(ctx));
        fm_context_destroy(ctx);
        for (int r = 0; r < 3; r++)
            fm_comm_destroy(comms[r]);
    }
    model m = {H, I, E, 0, 2, FM_RECIPE_FP8_FLOW, wr, w1, w2};
    failing_rank(&m);
    free(wr), free(w1), free(w2);
    return tu_end();
}
