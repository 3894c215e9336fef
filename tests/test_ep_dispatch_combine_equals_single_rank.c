/* Expert-parallel dispatch and combine over the in-process communicator
 * (one thread per rank) equal what one process computes straightforwardly:
 *
 *  - dispatch: rank d receives, for each source rank s ascending and each
 *    of s's tokens t ascending that has a choice on d, one row: x[t]'s codes
 *    and compact scales byte for byte, src_rank s, src_token t, local ids
 *    (id - d E_local, -1 for choices elsewhere or dropped) and probs (0
 *    there); rows past the received count stay untouched;
 *  - combine of random rows y (specials included): out[t] = the rows of the
 *    ranks t visited, ascending, added in F32 (first row, then + next),
 *    rounded once; a token that visited nobody gets zeros;
 *  - the identity expert, end to end: dispatch, local fm_moe_permute (which
 *    skips -1), the expert returns its input, fm_moe_unpermute with the
 *    received probs, combine: out[t] = Σ_{ranks p visited, ascending} of
 *    (fmaf chain over t's choices j on p, j ascending, of p_tj x[t]) — with
 *    one rank, exactly the single-process permute + unpermute;
 *  - the probs' backward path: combine of the received probs [R, k] brings
 *    back probs (dropped choices 0) bit for bit.
 * nranks 1, 2, 4, 8 (and 70, past one word of the implementation's rank
 * mask, on small rows); random routings, all choices on one rank, every token
 * to rank 0 (the others receive nothing), dropped choices and tokens, ranks
 * with no tokens, k = 1 and 8; every payload format. */
#include <math.h>
#include <pthread.h>
#include <unistd.h>

#include "test_util.h"

typedef struct {
    fm_dtype dt;
    fm_scale_mode m;
} kind;

static const kind kinds[] = {
    {FM_DTYPE_F32, FM_SCALE_NONE},         {FM_DTYPE_BF16, FM_SCALE_NONE},  {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
    {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E4M3, FM_SCALE_MX32}, {FM_DTYPE_E5M2, FM_SCALE_MX32},
    {FM_DTYPE_E2M1, FM_SCALE_MX32},
};

enum { MAXR = 70 };

typedef struct {
    int nranks, el, k, has_probs;
    int64_t H;
    kind kd;
    int64_t rb, sb;
    fm_dtype ydt, odt; /* combine of random rows: y and out dtypes */
    uint64_t yseed;
} scase;

typedef struct {
    const scase *c;
    int r;
    fm_comm *comm;
    fm_context *ctx;
    int64_t T, cap;
    uint8_t *x, *xs;
    int32_t *ids;
    float *probs;
    /* dispatch outputs */
    uint8_t *ox, *oxs;
    int32_t *oids, *osr, *ost;
    float *op;
    int64_t rows, rows_from[MAXR];
    /* combine of random rows, the identity pipeline, the probs round trip */
    void *yr, *outr;
    float *ident, *pback;
    fm_status st[5];
    char err[5][256];
} rank_io;

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
    default: return (float)((double)(int64_t)(u >> 11) / 9007199254740992.0 * 8.0 - 4.0);
    }
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
    int64_t T = io->T, k = c->k, H = c->H, cap = io->cap;
    fm_ep_config cfg = {c->el};
    fm_tensor x = fm_tensor_2d(io->x, c->kd.dt, T, H), ox = fm_tensor_2d(io->ox, c->kd.dt, cap, H);
    if (c->kd.m) {
        x = fm_tensor_quant_2d(io->x, c->kd.dt, T, H, FM_LAYOUT_ROWWISE, c->kd.m, io->xs, FM_SCALE_LAYOUT_COMPACT);
        ox = fm_tensor_quant_2d(io->ox, c->kd.dt, cap, H, FM_LAYOUT_ROWWISE, c->kd.m, io->oxs,
                                FM_SCALE_LAYOUT_COMPACT);
    }
    fm_tensor ids = fm_tensor_2d(io->ids, FM_DTYPE_I32, T, k), pr = fm_tensor_2d(io->probs, FM_DTYPE_F32, T, k);
    fm_tensor oids = fm_tensor_2d(io->oids, FM_DTYPE_I32, cap, k), op = fm_tensor_2d(io->op, FM_DTYPE_F32, cap, k);
    fm_tensor osr = fm_tensor_2d(io->osr, FM_DTYPE_I32, cap, 1), ost = fm_tensor_2d(io->ost, FM_DTYPE_I32, cap, 1);
    fm_ep_dispatch_out o = {&ox, &oids, c->has_probs ? &op : NULL, &osr, &ost, io->rows_from, -1};
    record(io, 0, fm_ep_dispatch(io->ctx, io->comm, &cfg, &x, &ids, c->has_probs ? &pr : NULL, &o));
    io->rows = o.rows;
    if (io->st[0])
        return NULL;
    int64_t R = o.rows;

    /* combine of random rows */
    float *yf = malloc((size_t)(R * H + 1) * 4);
    for (int64_t i = 0; i < R; i++)
        for (int64_t h = 0; h < H; h++)
            yf[i * H + h] = yval(c->yseed, io->r, i, h);
    tu_store_input(yf, R * H, c->ydt, io->yr, yf);
    free(yf);
    fm_tensor y = fm_tensor_2d(io->yr, c->ydt, R, H), outr = fm_tensor_2d(io->outr, c->odt, T, H);
    record(io, 1, fm_ep_combine(io->ctx, io->comm, &cfg, &ids, &y, &outr));

    /* the probs come back through combine (dispatch's probs backward) */
    if (c->has_probs) {
        fm_tensor rp = fm_tensor_2d(io->op, FM_DTYPE_F32, R, k), pb = fm_tensor_2d(io->pback, FM_DTYPE_F32, T, k);
        record(io, 2, fm_ep_combine(io->ctx, io->comm, &cfg, &ids, &rp, &pb));
    }

    /* identity expert: permute locally, return the rows, unpermute, combine */
    if (c->has_probs && !c->kd.m) {
        int64_t P = R * k;
        void *perm = malloc((size_t)(P * H + 1) * 4);
        int32_t *rm = malloc((size_t)(P + 1) * 4), *sr = malloc((size_t)(R * k + 1) * 4);
        int64_t *sp = malloc((size_t)c->el * 8);
        float *yl = malloc((size_t)(R * H + 1) * 4);
        fm_tensor rx = fm_tensor_2d(io->ox, c->kd.dt, R, H), rid = fm_tensor_2d(io->oids, FM_DTYPE_I32, R, k);
        fm_tensor rp = fm_tensor_2d(io->op, FM_DTYPE_F32, R, k), tp = fm_tensor_2d(perm, c->kd.dt, P, H);
        fm_tensor trm = fm_tensor_2d(rm, FM_DTYPE_I32, P, 1), tsr = fm_tensor_2d(sr, FM_DTYPE_I32, R, k);
        fm_tensor tsp = fm_tensor_2d(sp, FM_DTYPE_I64, 1, c->el), tyl = fm_tensor_2d(yl, FM_DTYPE_F32, R, H);
        fm_tensor tid = fm_tensor_2d(io->ident, FM_DTYPE_F32, T, H);
        fm_status st = fm_moe_permute(io->ctx, NULL, &rx, &rid, NULL, &tp, &trm, &tsr, &tsp, NULL, NULL);
        if (!st)
            st = fm_moe_unpermute(io->ctx, &tp, &tsr, &rp, &tyl);
        /* a local failure still joins the collective (with a bad y) so nobody waits */
        fm_tensor bad = fm_tensor_2d(yl, FM_DTYPE_F32, R + 1, H);
        fm_status cs = fm_ep_combine(io->ctx, io->comm, &cfg, &ids, st ? &bad : &tyl, &tid);
        record(io, 3, st ? st : cs);
        free(perm), free(rm), free(sr), free(sp), free(yl);
    }
    return NULL;
}

static void run_ranks(rank_io *io, int n)
{
    pthread_t th[MAXR];
    for (int r = 0; r < n; r++)
        pthread_create(&th[r], NULL, rank_main, &io[r]);
    for (int r = 0; r < n; r++)
        pthread_join(th[r], NULL);
}

static uint32_t out_bits(const void *p, fm_dtype dt, int64_t i)
{
    return dt == FM_DTYPE_F32 ? ((const uint32_t *)p)[i] : ((const uint16_t *)p)[i];
}

static uint32_t want_bits(float v, fm_dtype dt)
{
    if (v != v)
        return dt == FM_DTYPE_F32 ? 0x7FC00000u : 0x7FC0u;
    return dt == FM_DTYPE_F32 ? tu_f32_bits(v) : or_encode(OF_BF16, (double)v);
}

static float load(const void *p, fm_dtype dt, int64_t i)
{
    return dt == FM_DTYPE_F32 ? ((const float *)p)[i] : tu_bits_f32((uint32_t)((const uint16_t *)p)[i] << 16);
}

/* does token t of rank s have a choice on rank d */
static int visits(const rank_io *s, int64_t t, int d)
{
    for (int j = 0; j < s->c->k; j++) {
        int32_t g = s->ids[t * s->c->k + j];
        if (g >= 0 && g / s->c->el == d)
            return 1;
    }
    return 0;
}

static void check_case(rank_io *io, const scase *c, const char *cs)
{
    int n = c->nranks;
    int64_t k = c->k, H = c->H, rb = c->rb, sb = c->sb;
    for (int d = 0; d < n; d++) {
        rank_io *me = &io[d];
        char cc[300];
        snprintf(cc, sizeof cc, "%s rank %d", cs, d);
        CHECK(me->st[0] == FM_OK, "%s: dispatch: %s", cc, me->err[0]);
        if (me->st[0])
            return;
        /* the reference receive list */
        int64_t row = 0;
        int bad = 0;
        for (int s = 0; s < n; s++) {
            int64_t from = 0;
            for (int64_t t = 0; t < io[s].T; t++) {
                if (!visits(&io[s], t, d))
                    continue;
                from++;
                if (row >= me->rows) {
                    row++;
                    continue;
                }
                bad |= memcmp(me->ox + row * rb, io[s].x + t * rb, (size_t)rb) != 0;
                bad |= sb && memcmp(me->oxs + row * sb, io[s].xs + t * sb, (size_t)sb) != 0;
                bad |= me->osr[row] != s || me->ost[row] != t;
                for (int64_t j = 0; j < k; j++) {
                    int32_t g = io[s].ids[t * k + j];
                    int here = g >= 0 && g / c->el == d;
                    bad |= me->oids[row * k + j] != (here ? g - d * c->el : -1);
                    if (c->has_probs)
                        bad |= tu_f32_bits(me->op[row * k + j]) != tu_f32_bits(here ? io[s].probs[t * k + j] : 0.0f);
                }
                row++;
            }
            CHECK(me->rows_from[s] == from, "%s: rows_from[%d] %lld, want %lld", cc, s, (long long)me->rows_from[s],
                  (long long)from);
        }
        CHECK(me->rows == row, "%s: received %lld rows, want %lld", cc, (long long)me->rows, (long long)row);
        CHECK(!bad, "%s: received rows differ from the reference (data, scales or metadata)", cc);
        /* rows past the count are untouched */
        int touched = 0;
        for (int64_t i = row * rb; i < me->cap * rb; i++)
            touched |= me->ox[i] != 0xCD;
        for (int64_t i = row; i < me->cap; i++)
            touched |= me->osr[i] != (int32_t)0xCDCDCDCD || me->ost[i] != (int32_t)0xCDCDCDCD;
        for (int64_t i = row * k; i < me->cap * k; i++)
            touched |= me->oids[i] != (int32_t)0xCDCDCDCD;
        CHECK(!touched, "%s: wrote past the received rows", cc);

        /* combine of random rows: the reference sum in ascending rank order */
        CHECK(me->st[1] == FM_OK, "%s: combine: %s", cc, me->err[1]);
        int64_t *cur = calloc((size_t)n, 8), *base = calloc((size_t)n, 8);
        /* base[p]: where rank d's rows start among rank p's received rows */
        for (int p = 0; p < n; p++)
            for (int s = 0; s < d; s++)
                for (int64_t t = 0; t < io[s].T; t++)
                    base[p] += visits(&io[s], t, p);
        int cbad = 0, ibad = 0, pbad = 0;
        for (int64_t t = 0; t < me->T; t++) {
            int first = 1;
            int64_t rowp[MAXR];
            for (int p = 0; p < n; p++)
                rowp[p] = visits(me, t, p) ? base[p] + cur[p]++ : -1;
            for (int64_t h = 0; h < H; h++) {
                float acc = 0.0f, idacc = 0.0f;
                first = 1;
                for (int p = 0; p < n; p++) {
                    if (rowp[p] < 0)
                        continue;
                    /* y as rank p stored it (rounded to ydt) */
                    float v = yval(c->yseed, p, rowp[p], h);
                    v = c->ydt == FM_DTYPE_BF16 ? load(&(uint16_t){(uint16_t)or_encode(OF_BF16, (double)v)},
                                                       FM_DTYPE_BF16, 0)
                                                : v;
                    if (v != v)
                        v = NAN;
                    float part = 0.0f;
                    for (int64_t j = 0; j < k && !c->kd.m; j++) {
                        int32_t g = me->ids[t * k + j];
                        if (g >= 0 && g / c->el == p)
                            part = fmaf(me->probs[t * k + j], load(me->x, c->kd.dt, t * H + h), part);
                    }
                    acc = first ? v : acc + v;
                    idacc = first ? part : idacc + part;
                    first = 0;
                }
                cbad |= out_bits(me->outr, c->odt, t * H + h) != want_bits(acc, c->odt);
                if (me->st[3] == FM_OK && c->has_probs && !c->kd.m)
                    ibad |= tu_f32_bits(me->ident[t * H + h]) != want_bits(idacc, FM_DTYPE_F32);
            }
            if (c->has_probs)
                for (int64_t j = 0; j < k; j++)
                    pbad |= tu_f32_bits(me->pback[t * k + j]) !=
                            tu_f32_bits(me->ids[t * k + j] >= 0 ? me->probs[t * k + j] : 0.0f);
        }
        CHECK(!cbad, "%s: combine differs from the ascending-rank F32 sum", cc);
        if (c->has_probs) {
            CHECK(me->st[2] == FM_OK, "%s: probs combine: %s", cc, me->err[2]);
            CHECK(!pbad, "%s: probs did not come back through combine", cc);
        }
        if (c->has_probs && !c->kd.m) {
            CHECK(me->st[3] == FM_OK, "%s: identity pipeline: %s", cc, me->err[3]);
            CHECK(!ibad, "%s: identity expert: combine(unpermute(permute(dispatch(x)))) differs", cc);
        }
        free(cur), free(base);
    }
}

/* With one rank the identity pipeline is the single-process permute +
 * unpermute: compare with the library's own single-rank ops. */
static void check_single_rank_equals_local(rank_io *io, const scase *c, const char *cs)
{
    if (c->nranks != 1 || !c->has_probs || c->kd.m || io->st[3])
        return;
    int64_t T = io->T, k = c->k, H = c->H;
    fm_context *ctx = io->ctx;
    void *perm = malloc((size_t)(T * k * H + 1) * 4);
    int32_t *rm = malloc((size_t)(T * k + 1) * 4), *sr = malloc((size_t)(T * k + 1) * 4);
    int64_t *sp = malloc((size_t)c->el * 8);
    float *o = malloc((size_t)(T * H + 1) * 4);
    fm_tensor x = fm_tensor_2d(io->x, c->kd.dt, T, H), ids = fm_tensor_2d(io->ids, FM_DTYPE_I32, T, k);
    fm_tensor pr = fm_tensor_2d(io->probs, FM_DTYPE_F32, T, k), tp = fm_tensor_2d(perm, c->kd.dt, T * k, H);
    fm_tensor trm = fm_tensor_2d(rm, FM_DTYPE_I32, T * k, 1), tsr = fm_tensor_2d(sr, FM_DTYPE_I32, T, k);
    fm_tensor tsp = fm_tensor_2d(sp, FM_DTYPE_I64, 1, c->el), to = fm_tensor_2d(o, FM_DTYPE_F32, T, H);
    CHECK(fm_moe_permute(ctx, NULL, &x, &ids, NULL, &tp, &trm, &tsr, &tsp, NULL, NULL) == FM_OK &&
              fm_moe_unpermute(ctx, &tp, &tsr, &pr, &to) == FM_OK,
          "%s: single-process ops: %s", cs, fm_last_error(ctx));
    CHECK(!memcmp(o, io->ident, (size_t)(T * H * 4)), "%s: one-rank EP differs from the single-process layer", cs);
    free(perm), free(rm), free(sr), free(sp), free(o);
}

static void run_case(int n, const kind *kd, int mode, int it)
{
    scase c = {0};
    c.nranks = n;
    c.el = (int)tu_randint(1, 3);
    int E = n * c.el;
    c.k = it % 3 == 0 ? 1 : it % 3 == 1 ? 8 : (int)tu_randint(1, 8);
    c.has_probs = it % 4 != 3;
    c.H = tu_randint(1, n > 8 ? 16 : 300); /* many ranks: small rows, the routing is the point */
    if (kd->dt == FM_DTYPE_E2M1)
        c.H += c.H & 1;
    c.kd = *kd;
    c.rb = kd->dt == FM_DTYPE_E2M1 ? c.H / 2 : c.H * (fm_dtype_bits(kd->dt) / 8);
    c.sb = kd->m == FM_SCALE_NONE ? 0 : kd->m == FM_SCALE_MX32 ? (c.H + 31) / 32 : (c.H + 127) / 128 * 4;
    c.ydt = it % 2 ? FM_DTYPE_BF16 : FM_DTYPE_F32;
    c.odt = it % 5 < 2 ? FM_DTYPE_BF16 : FM_DTYPE_F32;
    c.yseed = tu_rand();
    fm_comm *comms[MAXR];
    CHECK(fm_comm_create_inproc(n, comms) == FM_OK, "create: %s", fm_last_error(NULL));
    rank_io io[MAXR];
    memset(io, 0, sizeof io);
    int64_t total = 0;
    for (int r = 0; r < n; r++) {
        rank_io *m = &io[r];
        m->c = &c;
        m->r = r;
        m->comm = comms[r];
        m->ctx = tu_cpu_context(1);
        CHECK(fm_comm_rank(comms[r]) == r && fm_comm_size(comms[r]) == n, "rank/size of comm %d", r);
        m->T = (mode == 4 && r == n - 1) ? 0 : tu_randint(1, n > 8 ? 3 : 40);
        total += m->T;
    }
    int64_t slack = tu_randint(0, 3);
    for (int r = 0; r < n; r++) {
        rank_io *m = &io[r];
        int64_t T = m->T, k = c.k;
        m->cap = total + slack;
        m->x = malloc((size_t)(T * c.rb + 1));
        m->xs = malloc((size_t)(T * c.sb + 1));
        for (int64_t i = 0; i < T * c.rb; i++)
            m->x[i] = (uint8_t)tu_rand();
        for (int64_t i = 0; i < T * c.sb; i++)
            m->xs[i] = (uint8_t)tu_rand(); /* scales move as bytes: NaN scales included */
        if (kd->dt == FM_DTYPE_F32)
            for (int64_t i = 0; i < T * c.H; i++)
                ((float *)m->x)[i] = i % 17 == 5 ? NAN : (float)tu_normal();
        if (kd->dt == FM_DTYPE_BF16)
            for (int64_t i = 0; i < T * c.H; i++)
                ((uint16_t *)m->x)[i] = (uint16_t)(tu_f32_bits((float)tu_normal()) >> 16);
        m->ids = malloc((size_t)(T * k + 1) * 4);
        m->probs = malloc((size_t)(T * k + 1) * 4);
        for (int64_t t = 0; t < T; t++) {
            int one = (int)tu_randint(0, n - 1);
            for (int64_t j = 0; j < k; j++) {
                int64_t g = mode == 1   ? one * c.el + tu_randint(0, c.el - 1)
                          : mode == 2   ? tu_randint(0, c.el - 1)
                          : mode == 3 && (t % 5 == 0 || tu_randint(0, 3) == 0) ? -1
                                        : tu_randint(0, E - 1);
                m->ids[t * k + j] = (int32_t)g;
                m->probs[t * k + j] = (float)tu_uniform();
            }
        }
        int64_t cap = m->cap;
        m->ox = malloc((size_t)(cap * c.rb + 1));
        m->oxs = malloc((size_t)(cap * c.sb + 1));
        m->oids = malloc((size_t)(cap * k + 1) * 4);
        m->op = malloc((size_t)(cap * k + 1) * 4);
        m->osr = malloc((size_t)(cap + 1) * 4);
        m->ost = malloc((size_t)(cap + 1) * 4);
        memset(m->ox, 0xCD, (size_t)(cap * c.rb + 1));
        memset(m->oxs, 0xCD, (size_t)(cap * c.sb + 1));
        memset(m->oids, 0xCD, (size_t)(cap * k + 1) * 4);
        memset(m->op, 0xCD, (size_t)(cap * k + 1) * 4);
        memset(m->osr, 0xCD, (size_t)(cap + 1) * 4);
        memset(m->ost, 0xCD, (size_t)(cap + 1) * 4);
        memset(m->rows_from, 0xCD, sizeof m->rows_from);
        m->yr = malloc((size_t)(cap * c.H + 1) * 4);
        m->outr = malloc((size_t)(T * c.H + 1) * 4);
        m->ident = malloc((size_t)(T * c.H + 1) * 4);
        m->pback = malloc((size_t)(T * k + 1) * 4);
        memset(m->outr, 0xCD, (size_t)(T * c.H + 1) * 4);
        memset(m->ident, 0xCD, (size_t)(T * c.H + 1) * 4);
        memset(m->pback, 0xCD, (size_t)(T * k + 1) * 4);
    }
    char cs[200];
    snprintf(cs, sizeof cs, "nranks %d %s %s mode %d it %d E_local %d k %d H %lld probs %d y %s out %s", n,
             fm_dtype_name(kd->dt), fm_scale_mode_name(kd->m), mode, it, c.el, c.k, (long long)c.H, c.has_probs,
             fm_dtype_name(c.ydt), fm_dtype_name(c.odt));
    alarm(60); /* a hang fails the test instead of stalling CI */
    run_ranks(io, n);
    alarm(0);
    check_case(io, &c, cs);
    check_single_rank_equals_local(io, &c, cs);
    for (int r = 0; r < n; r++) {
        rank_io *m = &io[r];
        fm_stats stt;
        fm_stats_get(m->ctx, &stt);
        CHECK(stt.calls[FM_OP_EP_DISPATCH] == 1, "%s: rank %d counted %lld dispatches", cs, r,
              (long long)stt.calls[FM_OP_EP_DISPATCH]);
        free(m->x), free(m->xs), free(m->ids), free(m->probs), free(m->ox), free(m->oxs), free(m->oids);
        free(m->op), free(m->osr), free(m->ost), free(m->yr), free(m->outr), free(m->ident), free(m->pback);
        fm_context_destroy(m->ctx);
        fm_comm_destroy(comms[r]);
    }
}

int main(void)
{
    tu_begin("test_ep_dispatch_combine_equals_single_rank");
    static const int ns[] = {1, 2, 4, 8};
    int it = 0;
    for (int a = 0; a < 4; a++)
        for (size_t kd = 0; kd < sizeof kinds / sizeof kinds[0]; kd++)
            for (int mode = 0; mode < 5; mode++)
                run_case(ns[a], &kinds[kd], mode, it++);
    /* more ranks than one 64-bit word of the rank mask */
    for (int mode = 0; mode < 5; mode++)
        run_case(MAXR, &kinds[2], mode, it++);
    return tu_end();
}
