/* A rank whose arguments are bad, or disagree with the other ranks', makes
 * EVERY rank of the in-process group return FM_ERR_INVALID_ARG with a
 * sentence (the bad rank names its argument, the others name the rank),
 * nobody hangs (alarm() fails the test if a call never returns), nothing is
 * received, and the group stays usable: a correct dispatch follows each
 * refusal. Covered: a different H, a different dtype, a different k,
 * E_local or probs presence, an expert id out of range on one rank, a NULL
 * context, a too-small output on one rank, a combine whose y rows do not
 * match, one rank calling combine while the others dispatch. fm_comm_abort
 * releases ranks that wait for a rank that never comes (FM_ERR_BACKEND).
 * Plus the creation paths: bad nranks, and NCCL absent from this build. */
#include <pthread.h>
#include <unistd.h>

#include "test_util.h"

enum { N = 4, T = 6, K = 2, H = 64, EL = 2 };

typedef enum { FAULT_NONE, FAULT_H, FAULT_DTYPE, FAULT_K, FAULT_EL, FAULT_PROBS, FAULT_ID, FAULT_CTX, FAULT_CAP,
               FAULT_COMBINE_ROWS, FAULT_WRONG_OP, FAULT_ABORT, FAULT_COUNT } fault;

static const char *const fault_names[] = {"none", "H", "dtype", "k", "E_local", "probs", "id", "NULL ctx",
                                          "capacity", "combine rows", "wrong op", "abort"};

typedef struct {
    int r, bad_rank;
    fault f;
    fm_comm *comm;
    fm_context *ctx;
    float x[T * H], probs[T * K], out[N * T * H], oprobs[N * T * K], y[N * T * H], back[T * H];
    int32_t ids[T * K], oids[N * T * K];
    fm_status st;
    int64_t rows;
    char err[300];
} rank_io;

static void *rank_main(void *arg)
{
    rank_io *io = arg;
    int me_bad = io->r == io->bad_rank;
    fault f = me_bad ? io->f : FAULT_NONE;
    fm_ep_config cfg = {f == FAULT_EL ? EL + 1 : EL};
    fm_tensor x = fm_tensor_2d(io->x, f == FAULT_DTYPE ? FM_DTYPE_BF16 : FM_DTYPE_F32, T, f == FAULT_H ? H / 2 : H);
    int k = f == FAULT_K ? 1 : K;
    fm_tensor ids = fm_tensor_2d(io->ids, FM_DTYPE_I32, T, k), pr = fm_tensor_2d(io->probs, FM_DTYPE_F32, T, k);
    int64_t cap = f == FAULT_CAP ? 0 : N * T;
    fm_tensor ox = fm_tensor_2d(io->out, x.dtype, cap, x.shape[1]);
    fm_tensor oids = fm_tensor_2d(io->oids, FM_DTYPE_I32, cap, k), op = fm_tensor_2d(io->oprobs, FM_DTYPE_F32, cap, k);
    fm_ep_dispatch_out o = {&ox, &oids, f == FAULT_PROBS ? NULL : &op, NULL, NULL, NULL, -7};
    fm_context *ctx = f == FAULT_CTX ? NULL : io->ctx;
    if (io->f == FAULT_COMBINE_ROWS) {
        /* dispatch first (fine everywhere), then a combine with one row too many on the bad rank */
        io->st = fm_ep_dispatch(ctx, io->comm, &cfg, &x, &ids, &pr, &o);
        if (io->st == FM_OK) {
            fm_tensor y = fm_tensor_2d(io->y, FM_DTYPE_F32, o.rows + (me_bad ? 1 : 0), H);
            fm_tensor back = fm_tensor_2d(io->back, FM_DTYPE_F32, T, H);
            io->st = fm_ep_combine(ctx, io->comm, &cfg, &ids, &y, &back);
        }
    } else if (f == FAULT_WRONG_OP) {
        fm_tensor y = fm_tensor_2d(io->y, FM_DTYPE_F32, 0, H), back = fm_tensor_2d(io->back, FM_DTYPE_F32, T, H);
        io->st = fm_ep_combine(ctx, io->comm, &cfg, &ids, &y, &back);
    } else if (f == FAULT_ABORT) {
        fm_comm_abort(io->comm); /* leaves without dispatching */
        io->st = FM_ERR_BACKEND;
    } else {
        io->st = fm_ep_dispatch(ctx, io->comm, &cfg, &x, &ids, f == FAULT_PROBS ? NULL : &pr, &o);
    }
    io->rows = o.rows;
    snprintf(io->err, sizeof io->err, "%s", ctx ? fm_last_error(ctx) : "");
    return NULL;
}

static void run(rank_io *io, fm_comm **comms, fault f, int bad)
{
    pthread_t th[N];
    for (int r = 0; r < N; r++) {
        io[r].r = r;
        io[r].bad_rank = bad;
        io[r].f = f;
        io[r].comm = comms[r];
        io[r].rows = -7;
        for (int i = 0; i < T * K; i++)
            io[r].ids[i] = (int32_t)tu_randint(0, N * EL - 1);
        if (f == FAULT_ID && r == bad)
            io[r].ids[3] = N * EL;
        memset(io[r].out, 0xCD, sizeof io[r].out);
        pthread_create(&th[r], NULL, rank_main, &io[r]);
    }
    for (int r = 0; r < N; r++)
        pthread_join(th[r], NULL);
}

int main(void)
{
    tu_begin("test_ep_rejects_mismatched_ranks");
    fm_comm *comms[N];
    CHECK(fm_comm_create_inproc(N, comms) == FM_OK, "create: %s", fm_last_error(NULL));
    static rank_io io[N];
    for (int r = 0; r < N; r++) {
        io[r].ctx = tu_cpu_context(1);
        for (int i = 0; i < T * H; i++)
            io[r].x[i] = (float)tu_normal();
        for (int i = 0; i < T * K; i++)
            io[r].probs[i] = (float)tu_uniform();
    }
    for (int f = FAULT_H; f < FAULT_ABORT; f++) {
        int bad = (int)tu_randint(0, N - 1);
        alarm(20); /* a rank left waiting fails the test */
        run(io, comms, (fault)f, bad);
        alarm(0);
        for (int r = 0; r < N; r++) {
            const char *c = fault_names[f];
            if (f == FAULT_CTX && r == bad) {
                CHECK(io[r].st == FM_ERR_INVALID_ARG, "%s: rank %d (bad) status %d", c, r, io[r].st);
                continue;
            }
            CHECK(io[r].st == FM_ERR_INVALID_ARG, "%s (bad rank %d): rank %d returned %s: %s", c, bad, r,
                  fm_status_name(io[r].st), io[r].err);
            CHECK(strlen(io[r].err) > 10, "%s: rank %d has no sentence", c, r);
            if (f == FAULT_COMBINE_ROWS)
                continue; /* the dispatch before it succeeded */
            CHECK(io[r].rows == -7, "%s: rank %d reported %lld rows received", c, r, (long long)io[r].rows);
            uint32_t first;
            memcpy(&first, io[r].out, 4);
            CHECK(first == 0xCDCDCDCDu,
                  "%s: rank %d received rows anyway", c, r);
            /* the sentence: the bad rank names its argument; the others, for a
             * disagreement, name the rank that differs; for a local refusal, the rank */
            int disagreement = f == FAULT_H || f == FAULT_DTYPE || f == FAULT_K || f == FAULT_EL || f == FAULT_PROBS ||
                               f == FAULT_WRONG_OP;
            char rk[16];
            snprintf(rk, sizeof rk, "rank %d", bad);
            if (disagreement && bad != 0)
                CHECK(strstr(io[r].err, rk) != NULL, "%s: rank %d's sentence does not name %s: %s", c, r, rk,
                      io[r].err);
            else if (!disagreement && r != bad)
                CHECK(strstr(io[r].err, f == FAULT_CAP || f == FAULT_COMBINE_ROWS ? "another rank" : rk) != NULL,
                      "%s: rank %d's sentence does not point at the failing rank %d: %s", c, r, bad, io[r].err);
            if (r == bad && f == FAULT_ID)
                CHECK(strstr(io[r].err, "expert_ids") != NULL, "%s: bad rank's sentence: %s", c, io[r].err);
            if (r == bad && f == FAULT_CAP)
                CHECK(strstr(io[r].err, "out->x") != NULL, "%s: bad rank's sentence: %s", c, io[r].err);
            if (f == FAULT_H)
                CHECK(strstr(io[r].err, "x:") != NULL && strstr(io[r].err, "H"), "H: sentence %s", io[r].err);
        }
        /* the group still works after a refusal */
        alarm(20);
        run(io, comms, FAULT_NONE, -1);
        alarm(0);
        int64_t total = 0;
        for (int r = 0; r < N; r++) {
            CHECK(io[r].st == FM_OK, "after %s: a correct dispatch on rank %d: %s", fault_names[f], r, io[r].err);
            total += io[r].rows;
        }
        CHECK(total > 0 && total <= N * T * K, "after %s: %lld rows moved in all", fault_names[f], (long long)total);
    }

    /* abort: the ranks that dispatch return FM_ERR_BACKEND instead of waiting */
    alarm(20);
    run(io, comms, FAULT_ABORT, 1);
    alarm(0);
    for (int r = 0; r < N; r++)
        CHECK(io[r].st == FM_ERR_BACKEND && (r == 1 || strstr(io[r].err, "abort")), "abort: rank %d: %s %s", r,
              fm_status_name(io[r].st), io[r].err);
    for (int r = 0; r < N; r++)
        fm_comm_destroy(comms[r]);

    /* creation and NULL arguments */
    fm_comm *one[2] = {(fm_comm *)&io[0], (fm_comm *)&io[1]};
    CHECK(fm_comm_create_inproc(0, one) == FM_ERR_INVALID_ARG && one[0] == (fm_comm *)&io[0] &&
              strstr(fm_last_error(NULL), "nranks"),
          "nranks 0: %s", fm_last_error(NULL));
    CHECK(fm_comm_create_inproc(2, NULL) == FM_ERR_INVALID_ARG && strstr(fm_last_error(NULL), "ranks_out"),
          "ranks_out NULL: %s", fm_last_error(NULL));
    fm_comm *nc = (fm_comm *)&io[0];
    fm_status st = fm_comm_create_nccl(io[0].ctx, NULL, &nc);
    CHECK(st == FM_ERR_UNSUPPORTED || st == FM_ERR_INVALID_ARG, "create_nccl without NCCL or a comm: %s",
          fm_status_name(st));
    CHECK(nc == NULL && strstr(fm_last_error(io[0].ctx), "NCCL") != NULL, "create_nccl: %s",
          fm_last_error(io[0].ctx));
    fm_ep_config cfg = {EL};
    fm_tensor x = fm_tensor_2d(io[0].x, FM_DTYPE_F32, T, H), ids = fm_tensor_2d(io[0].ids, FM_DTYPE_I32, T, K);
    fm_ep_dispatch_out o = {&x, NULL, NULL, NULL, NULL, NULL, 0};
    CHECK(fm_ep_dispatch(io[0].ctx, NULL, &cfg, &x, &ids, NULL, &o) == FM_ERR_INVALID_ARG &&
              strstr(fm_last_error(io[0].ctx), "comm"),
          "NULL comm: %s", fm_last_error(io[0].ctx));
    CHECK(fm_comm_rank(NULL) == -1 && fm_comm_size(NULL) == -1, "rank/size of NULL");
    for (int r = 0; r < N; r++)
        fm_context_destroy(io[r].ctx);
    return tu_end();
}
