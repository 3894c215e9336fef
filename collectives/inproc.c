/* The in-process reference communicator: one thread per rank, shared
 * memory. Every primitive is "post what I offer, barrier, pull what the
 * others offered me, barrier": the second barrier keeps each rank's posted
 * buffers alive until every peer has copied from them. The barrier is a
 * mutex + condition variable with a generation count (pthread_barrier_t
 * cannot be interrupted), so that fm_comm_abort wakes every waiter and turns
 * the pending and later collectives into FM_ERR_BACKEND. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "comm_internal.h"

typedef struct {
    const void *block;        /* alltoall */
    int ok;                   /* agree */
    int nseg;                 /* alltoallv */
    const fm_comm_seg *segs;
    const int64_t *send_off;
} inproc_post;

typedef struct {
    int n;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived, aborted, refs;
    unsigned long gen;
    inproc_post *post; /* [n] */
} inproc_group;

typedef struct {
    fm_comm base;
    inproc_group *g;
} inproc_comm;

static fm_status aborted_error(fm_context *ctx)
{
    return fm_error(ctx, FM_ERR_BACKEND,
                    "comm: the in-process group was aborted (fm_comm_abort on some rank); its communicators can "
                    "only be destroyed now");
}

static fm_status barrier(inproc_comm *c, fm_context *ctx)
{
    inproc_group *g = c->g;
    pthread_mutex_lock(&g->mu);
    if (!g->aborted) {
        if (++g->arrived == g->n) {
            g->arrived = 0;
            g->gen++;
            pthread_cond_broadcast(&g->cv);
        } else {
            unsigned long gen = g->gen;
            while (gen == g->gen && !g->aborted)
                pthread_cond_wait(&g->cv, &g->mu);
        }
    }
    int ab = g->aborted;
    pthread_mutex_unlock(&g->mu);
    return ab ? aborted_error(ctx) : FM_OK;
}

static fm_status inproc_alltoall(fm_comm *base, fm_context *ctx, const void *send, void *recv, size_t bytes)
{
    inproc_comm *c = (inproc_comm *)base;
    int me = base->rank;
    c->g->post[me].block = send;
    fm_status st = barrier(c, ctx);
    if (st)
        return st;
    for (int p = 0; p < base->size; p++)
        memcpy((uint8_t *)recv + (size_t)p * bytes, (const uint8_t *)c->g->post[p].block + (size_t)me * bytes, bytes);
    return barrier(c, ctx);
}

static fm_status inproc_agree(fm_comm *base, fm_context *ctx, int ok, int *all_ok)
{
    inproc_comm *c = (inproc_comm *)base;
    c->g->post[base->rank].ok = ok != 0;
    fm_status st = barrier(c, ctx);
    if (st)
        return st;
    int all = 1;
    for (int p = 0; p < base->size; p++)
        all &= c->g->post[p].ok;
    *all_ok = all;
    return barrier(c, ctx);
}

static fm_status inproc_alltoallv(fm_comm *base, fm_context *ctx, int nseg, const fm_comm_seg *segs,
                                  const int64_t *send_off, const int64_t *recv_off)
{
    inproc_comm *c = (inproc_comm *)base;
    int me = base->rank;
    inproc_post *mine = &c->g->post[me];
    mine->nseg = nseg;
    mine->segs = segs;
    mine->send_off = send_off;
    fm_status st = barrier(c, ctx);
    if (st)
        return st;
    for (int p = 0; p < base->size; p++) {
        const inproc_post *src = &c->g->post[p];
        int64_t rows = src->send_off[me + 1] - src->send_off[me];
        if (rows != recv_off[p + 1] - recv_off[p] || src->nseg != nseg) {
            /* comm.c agreed on the counts first, so this is a caller of the
             * transport that broke its contract: stop everybody. */
            pthread_mutex_lock(&c->g->mu);
            c->g->aborted = 1;
            pthread_cond_broadcast(&c->g->cv);
            pthread_mutex_unlock(&c->g->mu);
            return fm_error(ctx, FM_ERR_BACKEND,
                            "comm: rank %d offers %lld rows in %d segments to rank %d, which expects %lld in %d; "
                            "the group is aborted",
                            p, (long long)rows, src->nseg, me, (long long)(recv_off[p + 1] - recv_off[p]), nseg);
        }
        for (int s = 0; s < nseg && rows > 0; s++) {
            if (!segs[s].recv)
                continue;
            size_t rb = (size_t)segs[s].row_bytes;
            memcpy((uint8_t *)segs[s].recv + (size_t)recv_off[p] * rb,
                   (const uint8_t *)src->segs[s].send + (size_t)src->send_off[me] * rb, (size_t)rows * rb);
        }
    }
    return barrier(c, ctx);
}

static void inproc_abort(fm_comm *base)
{
    inproc_group *g = ((inproc_comm *)base)->g;
    pthread_mutex_lock(&g->mu);
    g->aborted = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void group_release(inproc_group *g)
{
    pthread_mutex_lock(&g->mu);
    int last = --g->refs == 0;
    pthread_mutex_unlock(&g->mu);
    if (!last)
        return;
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g->post);
    free(g);
}

static void inproc_destroy(fm_comm *base)
{
    inproc_comm *c = (inproc_comm *)base;
    group_release(c->g);
    free(c);
}

static const fm_comm_ops inproc_ops = {
    /* .name      = */ "in-process",
    /* .alltoall  = */ inproc_alltoall,
    /* .agree     = */ inproc_agree,
    /* .alltoallv = */ inproc_alltoallv,
    /* .fail      = */ inproc_abort,
    /* .abort     = */ inproc_abort,
    /* .destroy   = */ inproc_destroy,
    /* .check_ctx = */ NULL,
    /* .stage     = */ NULL,
    /* .sync      = */ NULL,
    /* .done      = */ NULL,
};

fm_status fm_comm_create_inproc(int nranks, fm_comm **ranks_out)
{
    fm_create_error(FM_OK, "%s", "");
    if (!ranks_out)
        return fm_create_error(FM_ERR_INVALID_ARG, "ranks_out: must point to an array of nranks fm_comm* to fill");
    if (nranks < 1 || nranks > 4096)
        return fm_create_error(FM_ERR_INVALID_ARG, "nranks: must be in [1, 4096], got %d", nranks);
    for (int r = 0; r < nranks; r++)
        ranks_out[r] = NULL;
    inproc_group *g = calloc(1, sizeof *g);
    inproc_post *post = calloc((size_t)nranks, sizeof *post);
    if (!g || !post) {
        free(g), free(post);
        return fm_create_error(FM_ERR_OUT_OF_MEMORY, "fm_comm_create_inproc: out of host memory for %d ranks",
                               nranks);
    }
    if (pthread_mutex_init(&g->mu, NULL)) {
        free(g), free(post);
        return fm_create_error(FM_ERR_BACKEND, "fm_comm_create_inproc: pthread_mutex_init failed");
    }
    if (pthread_cond_init(&g->cv, NULL)) {
        pthread_mutex_destroy(&g->mu);
        free(g), free(post);
        return fm_create_error(FM_ERR_BACKEND, "fm_comm_create_inproc: pthread_cond_init failed");
    }
    g->n = nranks;
    g->post = post;
    for (int r = 0; r < nranks; r++) {
        inproc_comm *c = calloc(1, sizeof *c);
        if (!c) {
            for (int q = 0; q < r; q++) {
                free(ranks_out[q]);
                ranks_out[q] = NULL;
            }
            g->refs = 1;
            group_release(g);
            return fm_create_error(FM_ERR_OUT_OF_MEMORY, "fm_comm_create_inproc: out of host memory for %d ranks",
                                   nranks);
        }
        c->base = (fm_comm){&inproc_ops, r, nranks, FM_DEVICE_HOST};
        c->g = g;
        ranks_out[r] = &c->base;
    }
    g->refs = nranks;
    return FM_OK;
}
