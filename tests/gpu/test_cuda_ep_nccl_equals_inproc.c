/* Expert-parallel dispatch and combine over NCCL (CUDA contexts, one thread
 * and one GPU per rank, communicators from ncclCommInitAll) give the bits of
 * the in-process reference (CPU contexts, the same inputs):
 *  - dispatch: out->x codes and compact scales, expert_ids, probs,
 *    src_rank, src_token, rows and rows_from; every output buffer is
 *    poisoned first and compared whole, so rows past the received count
 *    must stay untouched as the reference leaves them;
 *  - combine of random rows (NaN, Inf, -0, subnormals, huge values; y F32
 *    or BF16, out F32, BF16 or F16): the fixed-order F32 sum;
 *  - combine of the received probs back to [T, k] (dispatch's probs
 *    backward);
 *  - a dispatch with only out->x (the other streams land in scratch).
 * On 2 GPUs, and on 4 when there are: random routings, every choice on one
 * rank, every token to rank 0 (the others receive nothing), dropped choices
 * and tokens, a rank with no tokens; k = 1, 8 and random; every payload
 * format (F32, BF16, E4M3/E5M2 1x128, E4M3/E5M2 MX32, E2M1 MX32); widths
 * that take the kernels' 16-byte, 4-byte and byte paths.
 * Then the argument checks over NCCL: one rank with a bad expert id, a
 * different H, too small an output, a NULL context, a context on another
 * GPU, or a combine y with one row too many makes EVERY rank return
 * FM_ERR_INVALID_ARG (alarm() fails a hang), and a correct dispatch follows;
 * creation with a CPU context, a NULL or another GPU's ncclComm is refused;
 * after fm_comm_abort, calls return FM_ERR_BACKEND at once.
 * Skips (77) with fewer than 2 GPUs or without NCCL. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "gpu_test.h"

#ifdef FM_HAVE_NCCL
#include <nccl.h>

static const char *const TEST = "test_cuda_ep_nccl_equals_inproc";

typedef struct {
    fm_dtype dt;
    fm_scale_mode m;
} kind;

static const kind kinds[] = {
    {FM_DTYPE_F32, FM_SCALE_NONE},         {FM_DTYPE_BF16, FM_SCALE_NONE},  {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
    {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E4M3, FM_SCALE_MX32}, {FM_DTYPE_E5M2, FM_SCALE_MX32},
    {FM_DTYPE_E2M1, FM_SCALE_MX32},
};

enum { MAXR = 8 };

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint64_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static int64_t randint(int64_t lo, int64_t hi) { return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1)); }

static uint64_t mix(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* y[rank][row][h] of the random combine, with specials now and then. */
static float yval(uint64_t seed, int r, int64_t row, int64_t h)
{
    uint64_t u = mix(seed ^ mix(((uint64_t)r << 48) ^ ((uint64_t)row << 20) ^ (uint64_t)h));
    switch (u % 97) {
    case 0: return NAN;
    case 1: return INFINITY;
    case 2: return -INFINITY;
    case 3: return -0.0f;
    case 4: return 1e-40f;
    case 5: return 3.4e38f;
    case 6: return -3.4e38f;
    default: return (float)((double)(int64_t)(u >> 11) / 9007199254740992.0 * 8.0 - 4.0);
    }
}

typedef struct {
    int n, el, k, has_probs, omit; /* omit: no optional dispatch outputs (they land in scratch) */
    int64_t H, rb, sb;
    kind kd;
    fm_dtype ydt, odt;
    uint64_t yseed;
} scase;

/* One rank's buffers on one side (host for the reference, its GPU for NCCL). */
typedef struct {
    void *x, *xs, *ids, *probs;                /* inputs */
    void *ox, *oxs, *oids, *op, *osr, *ost;    /* dispatch outputs */
    void *y, *outr, *pback;                    /* combine input and outputs */
} bufs;

/* Output bytes of one rank, both sides compared whole. */
typedef struct {
    size_t ox, oxs, oids, op, osr, ost, outr, pback;
} sizes;

typedef struct {
    const scase *c;
    int r, dev; /* dev: the buffers are on GPU r */
    fm_context *ctx;
    fm_comm *comm;
    int64_t T, cap;
    bufs b;
    int64_t rows, rows_from[MAXR];
    fm_status st[3];
    char err[3][300];
} rank_io;

static fm_tensor mat(void *p, fm_dtype dt, int64_t r, int64_t c, int dev)
{
    fm_tensor t = fm_tensor_2d(p, dt, r, c);
    t.device = dev ? FM_DEVICE_CUDA : FM_DEVICE_HOST;
    return t;
}

static fm_tensor rows_t(void *p, void *s, const kind *kd, int64_t r, int64_t c, int dev)
{
    fm_tensor t = kd->m ? fm_tensor_quant_2d(p, kd->dt, r, c, FM_LAYOUT_ROWWISE, kd->m, s, FM_SCALE_LAYOUT_COMPACT)
                        : fm_tensor_2d(p, kd->dt, r, c);
    t.device = dev ? FM_DEVICE_CUDA : FM_DEVICE_HOST;
    return t;
}

static void record(rank_io *io, int i, fm_status st)
{
    io->st[i] = st;
    snprintf(io->err[i], sizeof io->err[i], "%s", fm_last_error(io->ctx));
}

static void *rank_main(void *arg)
{
    rank_io *io = arg;
    const scase *c = io->c;
    int d = io->dev;
    int64_t T = io->T, k = c->k, H = c->H, cap = io->cap;
    if (d)
        cudaSetDevice(io->r);
    fm_ep_config cfg = {c->el};
    fm_tensor x = rows_t(io->b.x, io->b.xs, &c->kd, T, H, d), ox = rows_t(io->b.ox, io->b.oxs, &c->kd, cap, H, d);
    fm_tensor ids = mat(io->b.ids, FM_DTYPE_I32, T, k, d), pr = mat(io->b.probs, FM_DTYPE_F32, T, k, d);
    fm_tensor oids = mat(io->b.oids, FM_DTYPE_I32, cap, k, d), op = mat(io->b.op, FM_DTYPE_F32, cap, k, d);
    fm_tensor osr = mat(io->b.osr, FM_DTYPE_I32, cap, 1, d), ost = mat(io->b.ost, FM_DTYPE_I32, cap, 1, d);
    fm_ep_dispatch_out o = {&ox, &oids, c->has_probs ? &op : NULL, &osr, &ost, io->rows_from, -1};
    if (c->omit)
        o.expert_ids = o.probs = o.src_rank = o.src_token = NULL, o.rows_from = NULL;
    record(io, 0, fm_ep_dispatch(io->ctx, io->comm, &cfg, &x, &ids, c->has_probs ? &pr : NULL, &o));
    io->rows = o.rows;
    if (io->st[0])
        return NULL;
    fm_tensor y = mat(io->b.y, c->ydt, o.rows, H, d), outr = mat(io->b.outr, c->odt, T, H, d);
    record(io, 1, fm_ep_combine(io->ctx, io->comm, &cfg, &ids, &y, &outr));
    if (c->has_probs && !c->omit) {
        fm_tensor rp = mat(io->b.op, FM_DTYPE_F32, o.rows, k, d), pb = mat(io->b.pback, FM_DTYPE_F32, T, k, d);
        record(io, 2, fm_ep_combine(io->ctx, io->comm, &cfg, &ids, &rp, &pb));
    }
    if (d)
        fm_context_synchronize(io->ctx);
    return NULL;
}

static void run_ranks(rank_io *io, int n)
{
    pthread_t th[MAXR];
    alarm(120); /* a rank left waiting fails the test */
    for (int r = 0; r < n; r++)
        pthread_create(&th[r], NULL, rank_main, &io[r]);
    for (int r = 0; r < n; r++)
        pthread_join(th[r], NULL);
    alarm(0);
}

static size_t esz(fm_dtype d) { return (size_t)fm_dtype_bits(d) / 8; }

/* Host inputs of one rank (reference side), outputs poisoned. */
static void make_host(rank_io *io, const scase *c, int mode)
{
    int64_t T = io->T, k = c->k, cap = io->cap, E = (int64_t)c->n * c->el;
    bufs *b = &io->b;
    b->x = malloc((size_t)(T * c->rb) + 16);
    b->xs = malloc((size_t)(T * c->sb) + 16);
    for (int64_t i = 0; i < T * c->rb; i++)
        ((uint8_t *)b->x)[i] = (uint8_t)rnd();
    for (int64_t i = 0; i < T * c->sb; i++)
        ((uint8_t *)b->xs)[i] = (uint8_t)rnd(); /* scales move as bytes: NaN scales included */
    b->ids = malloc((size_t)(T * k) * 4 + 16);
    b->probs = malloc((size_t)(T * k) * 4 + 16);
    int32_t *ids = b->ids;
    float *pr = b->probs;
    for (int64_t t = 0; t < T; t++) {
        int one = (int)randint(0, c->n - 1);
        for (int64_t j = 0; j < k; j++) {
            int64_t g = mode == 1   ? one * c->el + randint(0, c->el - 1)
                      : mode == 2   ? randint(0, c->el - 1)
                      : mode == 3 && (t % 5 == 0 || randint(0, 3) == 0) ? -1
                                    : randint(0, E - 1);
            ids[t * k + j] = (int32_t)g;
            pr[t * k + j] = (float)((double)(rnd() >> 11) / 9007199254740992.0);
        }
    }
    b->y = malloc((size_t)cap * (size_t)c->H * 4 + 16);
    for (int64_t i = 0; i < cap; i++)
        for (int64_t h = 0; h < c->H; h++) {
            float v = yval(c->yseed, io->r, i, h);
            if (c->ydt == FM_DTYPE_F32)
                ((float *)b->y)[i * c->H + h] = v;
            else
                ((uint16_t *)b->y)[i * c->H + h] = fm_bf16_from_f32(v);
        }
}

static sizes out_sizes(const rank_io *io, const scase *c)
{
    sizes s;
    s.ox = (size_t)(io->cap * c->rb);
    s.oxs = (size_t)(io->cap * c->sb);
    s.oids = s.op = (size_t)(io->cap * c->k) * 4;
    s.osr = s.ost = (size_t)io->cap * 4;
    s.outr = (size_t)(io->T * c->H) * esz(c->odt);
    s.pback = (size_t)(io->T * c->k) * 4;
    return s;
}

static void alloc_outputs_host(rank_io *io, const sizes *s)
{
    bufs *b = &io->b;
    void **o[8] = {&b->ox, &b->oxs, &b->oids, &b->op, &b->osr, &b->ost, &b->outr, &b->pback};
    const size_t *n = &s->ox;
    for (int i = 0; i < 8; i++) {
        *o[i] = malloc(n[i] + 16);
        memset(*o[i], 0xCD, n[i] + 16);
    }
}

/* The same inputs on GPU r, outputs poisoned the same way. */
static void make_device(rank_io *g, const rank_io *h, const scase *c, const sizes *s)
{
    GT_CUDA(cudaSetDevice(g->r));
    const bufs *hb = &h->b;
    bufs *b = &g->b;
    size_t in[5] = {(size_t)(h->T * c->rb), (size_t)(h->T * c->sb), (size_t)(h->T * c->k) * 4,
                    (size_t)(h->T * c->k) * 4, (size_t)h->cap * (size_t)c->H * 4};
    void *const src[5] = {hb->x, hb->xs, hb->ids, hb->probs, hb->y};
    void **dst[5] = {&b->x, &b->xs, &b->ids, &b->probs, &b->y};
    for (int i = 0; i < 5; i++) {
        GT_CUDA(cudaMalloc(dst[i], in[i] + 16));
        GT_CUDA(cudaMemcpy(*dst[i], src[i], in[i], cudaMemcpyHostToDevice));
    }
    void **o[8] = {&b->ox, &b->oxs, &b->oids, &b->op, &b->osr, &b->ost, &b->outr, &b->pback};
    const size_t *n = &s->ox;
    for (int i = 0; i < 8; i++) {
        GT_CUDA(cudaMalloc(o[i], n[i] + 16));
        GT_CUDA(cudaMemset(*o[i], 0xCD, n[i] + 16));
    }
    /* the ranks' streams do not wait for the legacy stream's memsets */
    GT_CUDA(cudaDeviceSynchronize());
}

static void free_bufs(bufs *b, int dev)
{
    void *p[13] = {b->x, b->xs, b->ids, b->probs, b->ox, b->oxs, b->oids, b->op, b->osr, b->ost, b->y, b->outr,
                   b->pback};
    for (int i = 0; i < 13; i++)
        dev ? (void)cudaFree(p[i]) : free(p[i]);
}

static void same(const void *want, const void *dev_p, size_t n, const char *what, const char *cs, int r)
{
    uint8_t *got = malloc(n + 16);
    GT_CUDA(cudaMemcpy(got, dev_p, n + 16, cudaMemcpyDeviceToHost));
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n + 16; i++)
        if (got[i] != ((const uint8_t *)want)[i] && bad++ == 0)
            first = i;
    GT_CHECK(bad == 0, "%s rank %d: %s: %zu of %zu bytes differ from the in-process reference (first at %zu: %02x, "
             "want %02x)", cs, r, what, bad, n, first, got[first], ((const uint8_t *)want)[first]);
    free(got);
}

typedef struct {
    int n;
    fm_context *cpu[MAXR], *gpu[MAXR];
    fm_comm *ref[MAXR], *nc[MAXR];
    ncclComm_t raw[MAXR];
    cudaStream_t s[MAXR];
} world;

static void run_case(world *w, const kind *kd, int mode, int it)
{
    int n = w->n;
    scase c;
    memset(&c, 0, sizeof c);
    c.n = n;
    c.el = (int)randint(1, 3);
    c.k = it % 3 == 0 ? 1 : it % 3 == 1 ? 8 : (int)randint(1, 8);
    c.has_probs = it % 4 != 3;
    c.omit = it % 5 == 2;
    /* widths for every copy path: random (bytes, words), multiples of 128 (16-byte vectors) */
    c.H = it % 2 ? randint(1, 300) : 128 * randint(1, 8);
    if (kd->dt == FM_DTYPE_E2M1)
        c.H += c.H & 1;
    c.kd = *kd;
    c.rb = kd->dt == FM_DTYPE_E2M1 ? c.H / 2 : c.H * (int64_t)esz(kd->dt);
    c.sb = kd->m == FM_SCALE_NONE ? 0 : kd->m == FM_SCALE_MX32 ? (c.H + 31) / 32 : (c.H + 127) / 128 * 4;
    c.ydt = it % 2 ? FM_DTYPE_BF16 : FM_DTYPE_F32;
    static const fm_dtype odts[3] = {FM_DTYPE_F32, FM_DTYPE_BF16, FM_DTYPE_F16};
    c.odt = odts[it % 3];
    c.yseed = rnd();
    rank_io h[MAXR], g[MAXR];
    memset(h, 0, sizeof h);
    memset(g, 0, sizeof g);
    int64_t total = 0;
    for (int r = 0; r < n; r++) {
        h[r].T = (mode == 4 && r == n - 1) ? 0 : randint(1, 40);
        total += h[r].T;
    }
    sizes sz[MAXR];
    for (int r = 0; r < n; r++) {
        h[r].c = &c, h[r].r = r, h[r].dev = 0, h[r].ctx = w->cpu[r], h[r].comm = w->ref[r];
        h[r].cap = total + randint(0, 3);
        make_host(&h[r], &c, mode);
        sz[r] = out_sizes(&h[r], &c);
        alloc_outputs_host(&h[r], &sz[r]);
        g[r] = h[r];
        g[r].dev = 1, g[r].ctx = w->gpu[r], g[r].comm = w->nc[r];
        make_device(&g[r], &h[r], &c, &sz[r]);
        memset(h[r].rows_from, 0xCD, sizeof h[r].rows_from);
        memset(g[r].rows_from, 0xCD, sizeof g[r].rows_from);
    }
    char cs[200];
    snprintf(cs, sizeof cs, "nranks %d %s %s mode %d it %d E_local %d k %d H %lld probs %d omit %d y %s out %s", n,
             fm_dtype_name(kd->dt), fm_scale_mode_name(kd->m), mode, it, c.el, c.k, (long long)c.H, c.has_probs,
             c.omit, fm_dtype_name(c.ydt), fm_dtype_name(c.odt));
    run_ranks(h, n);
    run_ranks(g, n);
    for (int r = 0; r < n; r++) {
        for (int i = 0; i < 3; i++) {
            GT_CHECK(h[r].st[i] == FM_OK, "%s rank %d: reference call %d: %s", cs, r, i, h[r].err[i]);
            GT_CHECK(g[r].st[i] == FM_OK, "%s rank %d: NCCL call %d: %s", cs, r, i, g[r].err[i]);
        }
        GT_CHECK(g[r].rows == h[r].rows, "%s rank %d: received %lld rows, the reference %lld", cs, r,
                 (long long)g[r].rows, (long long)h[r].rows);
        GT_CHECK(!memcmp(g[r].rows_from, h[r].rows_from, sizeof h[r].rows_from), "%s rank %d: rows_from differ", cs, r);
        same(h[r].b.ox, g[r].b.ox, sz[r].ox, "out->x data", cs, r);
        same(h[r].b.oxs, g[r].b.oxs, sz[r].oxs, "out->x scales", cs, r);
        same(h[r].b.oids, g[r].b.oids, sz[r].oids, "out->expert_ids", cs, r);
        same(h[r].b.op, g[r].b.op, sz[r].op, "out->probs", cs, r);
        same(h[r].b.osr, g[r].b.osr, sz[r].osr, "out->src_rank", cs, r);
        same(h[r].b.ost, g[r].b.ost, sz[r].ost, "out->src_token", cs, r);
        same(h[r].b.outr, g[r].b.outr, sz[r].outr, "combine out", cs, r);
        same(h[r].b.pback, g[r].b.pback, sz[r].pback, "probs back through combine", cs, r);
        free_bufs(&h[r].b, 0);
        GT_CUDA(cudaSetDevice(r));
        free_bufs(&g[r].b, 1);
    }
}

/* ---- the argument checks over NCCL ---------------------------------------- */

typedef enum { F_NONE, F_ID, F_H, F_CAP, F_NULL_CTX, F_WRONG_GPU, F_COMBINE_ROWS, F_COUNT } fault;
static const char *const fault_names[] = {"none", "expert id", "H", "capacity", "NULL ctx", "ctx of another GPU",
                                          "combine rows"};

enum { FT = 6, FK = 2, FH = 64, FEL = 2 };

typedef struct {
    world *w;
    int r, bad;
    fault f;
    fm_context *other; /* a context on another GPU than rank `bad`'s */
    void *x, *ids, *ox, *y, *back;
    fm_status st;
    int64_t rows;
    char err[300];
} fio;

static void *fault_main(void *arg)
{
    fio *io = arg;
    cudaSetDevice(io->r);
    fault f = io->r == io->bad ? io->f : F_NONE;
    fm_context *ctx = f == F_NULL_CTX ? NULL : f == F_WRONG_GPU ? io->other : io->w->gpu[io->r];
    int n = io->w->n;
    fm_ep_config cfg = {FEL};
    fm_tensor x = mat(io->x, FM_DTYPE_F32, FT, f == F_H ? FH / 2 : FH, 1), ids = mat(io->ids, FM_DTYPE_I32, FT, FK, 1);
    fm_tensor ox = mat(io->ox, FM_DTYPE_F32, f == F_CAP ? 0 : n * FT, x.shape[1], 1);
    fm_ep_dispatch_out o = {&ox, NULL, NULL, NULL, NULL, NULL, -7};
    io->st = fm_ep_dispatch(ctx, io->w->nc[io->r], &cfg, &x, &ids, NULL, &o);
    if (io->f == F_COMBINE_ROWS && io->st == FM_OK) {
        fm_tensor y = mat(io->y, FM_DTYPE_F32, o.rows + (f == F_COMBINE_ROWS), FH, 1);
        fm_tensor back = mat(io->back, FM_DTYPE_F32, FT, FH, 1);
        io->st = fm_ep_combine(ctx, io->w->nc[io->r], &cfg, &ids, &y, &back);
    }
    io->rows = o.rows;
    snprintf(io->err, sizeof io->err, "%s", ctx ? fm_last_error(ctx) : "");
    if (ctx)
        fm_context_synchronize(ctx);
    return NULL;
}

static void run_faults(world *w)
{
    int n = w->n;
    fio io[MAXR];
    memset(io, 0, sizeof io);
    /* a second context per GPU: the "wrong GPU" rank borrows its neighbour's, not one another thread uses */
    fm_context *spare[MAXR];
    for (int r = 0; r < n; r++) {
        fm_context_config cc;
        memset(&cc, 0, sizeof cc);
        cc.backend = FM_BACKEND_CUDA;
        cc.device = r;
        if (fm_context_create(&cc, &spare[r]) != FM_OK) {
            fprintf(stderr, "FAIL: CUDA context on device %d: %s\n", r, fm_last_error(NULL));
            exit(1);
        }
    }
    for (int r = 0; r < n; r++) {
        GT_CUDA(cudaSetDevice(r));
        int32_t hid[FT * FK];
        float hx[FT * FH];
        for (int i = 0; i < FT * FH; i++)
            hx[i] = (float)i;
        GT_CUDA(cudaMalloc(&io[r].x, sizeof hx));
        GT_CUDA(cudaMemcpy(io[r].x, hx, sizeof hx, cudaMemcpyHostToDevice));
        GT_CUDA(cudaMalloc(&io[r].ids, sizeof hid));
        GT_CUDA(cudaMalloc(&io[r].ox, (size_t)(n * FT * FH) * 4));
        GT_CUDA(cudaMalloc(&io[r].y, (size_t)(n * FT * FH) * 4 + 4 * FH));
        GT_CUDA(cudaMemset(io[r].y, 0, (size_t)(n * FT * FH) * 4 + 4 * FH));
        GT_CUDA(cudaMalloc(&io[r].back, (size_t)(FT * FH) * 4));
    }
    for (int f = F_NONE; f < F_COUNT; f++) {
        for (int pass = 0; pass < 2; pass++) { /* the fault, then a correct call on the same communicators */
            int bad = (int)randint(0, n - 1);
            fault ff = pass ? F_NONE : (fault)f;
            pthread_t th[MAXR];
            for (int r = 0; r < n; r++) {
                GT_CUDA(cudaSetDevice(r));
                int32_t hid[FT * FK];
                for (int i = 0; i < FT * FK; i++)
                    hid[i] = (int32_t)randint(0, n * FEL - 1);
                if (ff == F_ID && r == bad)
                    hid[3] = n * FEL;
                GT_CUDA(cudaMemcpy(io[r].ids, hid, sizeof hid, cudaMemcpyHostToDevice));
                GT_CUDA(cudaMemset(io[r].ox, 0xCD, (size_t)(n * FT * FH) * 4));
                GT_CUDA(cudaDeviceSynchronize());
                io[r].w = w, io[r].r = r, io[r].bad = bad, io[r].f = ff, io[r].other = spare[(bad + 1) % n];
                io[r].st = FM_OK, io[r].rows = -7, io[r].err[0] = 0;
            }
            alarm(60);
            for (int r = 0; r < n; r++)
                pthread_create(&th[r], NULL, fault_main, &io[r]);
            for (int r = 0; r < n; r++)
                pthread_join(th[r], NULL);
            alarm(0);
            for (int r = 0; r < n; r++) {
                const char *fn = fault_names[ff];
                if (ff == F_NONE) {
                    GT_CHECK(io[r].st == FM_OK, "after %s: a correct dispatch on rank %d: %s", fault_names[f], r,
                             io[r].err);
                    continue;
                }
                GT_CHECK(io[r].st == FM_ERR_INVALID_ARG, "%s (bad rank %d): rank %d returned %s: %s", fn, bad, r,
                         fm_status_name(io[r].st), io[r].err);
                if (ff == F_NULL_CTX && r == bad)
                    continue;
                GT_CHECK(strlen(io[r].err) > 10, "%s: rank %d has no sentence", fn, r);
                if (ff == F_COMBINE_ROWS)
                    continue; /* the dispatch before it succeeded */
                GT_CHECK(io[r].rows == -7, "%s: rank %d reported %lld rows received", fn, r, (long long)io[r].rows);
                uint32_t first = 0;
                GT_CUDA(cudaSetDevice(r));
                GT_CUDA(cudaMemcpy(&first, io[r].ox, 4, cudaMemcpyDeviceToHost));
                GT_CHECK(first == 0xCDCDCDCDu, "%s: rank %d received rows anyway", fn, r);
                if (r == bad && ff == F_ID)
                    GT_CHECK(strstr(io[r].err, "expert_ids") != NULL, "%s: %s", fn, io[r].err);
                if (r == bad && ff == F_CAP)
                    GT_CHECK(strstr(io[r].err, "out->x") != NULL, "%s: %s", fn, io[r].err);
                if (r == bad && ff == F_WRONG_GPU)
                    GT_CHECK(strstr(io[r].err, "ctx") != NULL && strstr(io[r].err, "device") != NULL, "%s: %s", fn,
                             io[r].err);
            }
        }
    }
    for (int r = 0; r < n; r++) {
        GT_CUDA(cudaSetDevice(r));
        cudaFree(io[r].x), cudaFree(io[r].ids), cudaFree(io[r].ox), cudaFree(io[r].y), cudaFree(io[r].back);
        fm_context_destroy(spare[r]);
    }
}

static void check_creation(world *w)
{
    fm_comm *c = (fm_comm *)w;
    fm_status st = fm_comm_create_nccl(w->cpu[0], w->raw[0], &c);
    GT_CHECK(st == FM_ERR_INVALID_ARG && c == NULL && strstr(fm_last_error(w->cpu[0]), "CUDA context"),
             "a CPU context: %s: %s", fm_status_name(st), fm_last_error(w->cpu[0]));
    c = (fm_comm *)w;
    st = fm_comm_create_nccl(w->gpu[0], NULL, &c);
    GT_CHECK(st == FM_ERR_INVALID_ARG && c == NULL && strstr(fm_last_error(w->gpu[0]), "nccl_comm"),
             "a NULL ncclComm: %s: %s", fm_status_name(st), fm_last_error(w->gpu[0]));
    c = (fm_comm *)w;
    st = fm_comm_create_nccl(w->gpu[0], w->raw[1], &c);
    GT_CHECK(st == FM_ERR_INVALID_ARG && c == NULL && strstr(fm_last_error(w->gpu[0]), "device 1"),
             "rank 1's ncclComm with a device-0 context: %s: %s", fm_status_name(st), fm_last_error(w->gpu[0]));
    for (int r = 0; r < w->n; r++)
        GT_CHECK(fm_comm_rank(w->nc[r]) == r && fm_comm_size(w->nc[r]) == w->n, "rank/size of NCCL comm %d: %d/%d", r,
                 fm_comm_rank(w->nc[r]), fm_comm_size(w->nc[r]));
}

/* fm_comm_abort on every rank: ncclCommAbort, then calls return
 * FM_ERR_BACKEND at once (no NCCL call is made on the aborted comm). */
static void check_abort(world *w)
{
    for (int r = 0; r < w->n; r++)
        fm_comm_abort(w->nc[r]);
    for (int r = 0; r < w->n; r++) {
        GT_CUDA(cudaSetDevice(r));
        void *x, *ids, *ox;
        GT_CUDA(cudaMalloc(&x, 64 * 4));
        GT_CUDA(cudaMalloc(&ids, 4));
        GT_CUDA(cudaMalloc(&ox, 64 * 4 * 8));
        GT_CUDA(cudaMemset(ids, 0, 4));
        GT_CUDA(cudaDeviceSynchronize());
        fm_ep_config cfg = {1};
        fm_tensor tx = mat(x, FM_DTYPE_F32, 1, 64, 1), ti = mat(ids, FM_DTYPE_I32, 1, 1, 1);
        fm_tensor to = mat(ox, FM_DTYPE_F32, 8, 64, 1);
        fm_ep_dispatch_out o = {&to, NULL, NULL, NULL, NULL, NULL, -7};
        alarm(20);
        fm_status st = fm_ep_dispatch(w->gpu[r], w->nc[r], &cfg, &tx, &ti, NULL, &o);
        alarm(0);
        GT_CHECK(st == FM_ERR_BACKEND && strstr(fm_last_error(w->gpu[r]), "abort"), "after abort: rank %d: %s: %s", r,
                 fm_status_name(st), fm_last_error(w->gpu[r]));
        cudaFree(x), cudaFree(ids), cudaFree(ox);
    }
}

static void run_world(int n)
{
    world w;
    memset(&w, 0, sizeof w);
    w.n = n;
    int devs[MAXR];
    for (int r = 0; r < n; r++)
        devs[r] = r;
    ncclResult_t nr = ncclCommInitAll(w.raw, n, devs);
    if (nr != ncclSuccess) {
        gt_failures++;
        fprintf(stderr, "FAIL: ncclCommInitAll over %d GPUs: %s\n", n, ncclGetErrorString(nr));
        return;
    }
    GT_CHECK(fm_comm_create_inproc(n, w.ref) == FM_OK, "inproc: %s", fm_last_error(NULL));
    for (int r = 0; r < n; r++) {
        fm_context_config cc;
        memset(&cc, 0, sizeof cc);
        cc.backend = FM_BACKEND_CUDA;
        cc.device = r;
        if (fm_context_create(&cc, &w.gpu[r]) != FM_OK) {
            fprintf(stderr, "FAIL: CUDA context on device %d: %s\n", r, fm_last_error(NULL));
            exit(1);
        }
        w.cpu[r] = gt_cpu_context();
        GT_CUDA(cudaSetDevice(r));
        GT_CUDA(cudaStreamCreateWithFlags(&w.s[r], cudaStreamNonBlocking));
        fm_context_set_stream(w.gpu[r], w.s[r]);
        fm_status st = fm_comm_create_nccl(w.gpu[r], w.raw[r], &w.nc[r]);
        if (st != FM_OK) {
            fprintf(stderr, "FAIL: fm_comm_create_nccl rank %d: %s\n", r, fm_last_error(w.gpu[r]));
            exit(1);
        }
    }
    check_creation(&w);
    int it = 0;
    for (int rep = 0; rep < 2; rep++)
        for (size_t kd = 0; kd < sizeof kinds / sizeof kinds[0]; kd++)
            for (int mode = 0; mode < 5; mode++)
                run_case(&w, &kinds[kd], mode, it++);
    run_faults(&w);
    check_abort(&w);
    for (int r = 0; r < n; r++) {
        fm_comm_destroy(w.nc[r]);
        fm_comm_destroy(w.ref[r]);
        fm_context_destroy(w.gpu[r]);
        fm_context_destroy(w.cpu[r]);
        cudaSetDevice(r);
        cudaStreamDestroy(w.s[r]);
        /* the ncclComms were aborted (fm_comm_abort): nothing left to destroy */
    }
    printf("%s: %d ranks done\n", TEST, n);
}

int main(void)
{
    int nd = 0;
    if (cudaGetDeviceCount(&nd) != cudaSuccess || nd < 2) {
        printf("%s: skipped: needs 2 CUDA devices, found %d\n", TEST, nd);
        return 77;
    }
    fm_context *probe = gt_cuda_context(TEST);
    fm_context_destroy(probe);
    const char *seed = getenv("FM_TEST_SEED");
    rng = seed ? strtoull(seed, NULL, 10) | 1 : ((uint64_t)time(NULL) * 2654435761u) | 1;
    printf("%s: seed %llu (FM_TEST_SEED replays it)\n", TEST, (unsigned long long)rng);
    run_world(2);
    if (nd >= 4)
        run_world(4);
    return gt_finish(TEST);
}

#else

int main(void)
{
    printf("test_cuda_ep_nccl_equals_inproc: skipped: this flowmoe was built without NCCL\n");
    return 77;
}

#endif
