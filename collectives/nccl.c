/* The NCCL transport: an fm_comm over an ncclComm_t that the caller owns
 * (this file never destroys it; fm_comm_abort aborts it, as comm.h says).
 *
 *  - alltoall (the headers) and agree run on a stream of the transport's
 *    own, through small device buffers and pinned host buffers: a grouped
 *    ncclSend/ncclRecv per peer (ncclAllReduce min for agree), then a copy
 *    to the host. They work whatever the context, so a rank whose context is
 *    wrong still tells the others.
 *  - alltoallv (the payload) runs on the context's stream: one
 *    ncclSend/ncclRecv pair per peer and segment in one group, empty ones
 *    left out; nothing waits for it.
 *  - Every host wait polls a CUDA event, and between polls asks NCCL for an
 *    asynchronous error and looks for fm_comm_abort from another thread: a
 *    failure NCCL reports, or an abort, ends the wait with FM_ERR_BACKEND.
 *    (A peer that simply stops, on a transport that cannot tell, still
 *    leaves this rank waiting: NCCL itself has no timeout.)
 *  - Any NCCL or CUDA failure marks this rank's communicator broken: later
 *    calls return FM_ERR_BACKEND at once. The ncclComm is left for the
 *    caller, who aborts it (fm_comm_abort) on every rank.
 * A mutex keeps fm_comm_abort (ncclCommAbort frees the ncclComm) from
 * racing with this rank's own NCCL calls. */
#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "../backends/cuda/ep.h"
#include "comm_internal.h"

typedef struct {
    fm_comm base;
    ncclComm_t nc;
    int dev;                 /* the communicator's CUDA device */
    pthread_mutex_t mu;      /* nc and the flags below */
    int broken, nc_aborted;
    cudaStream_t hs;         /* headers and agree */
    cudaEvent_t ev;          /* the wait in progress */
    cudaEvent_t done;        /* the previous call's last use of the staging (transport `done`) */
    uint8_t *hdev, *hhost;   /* header buffers: send half, receive half; hcap bytes each half */
    size_t hcap;
    void *sdev, *shost;      /* staging for comm.c's device path */
    size_t sdev_cap, shost_cap;
} nccl_comm;

typedef struct {
    int prev, changed;
} dev_guard;

static cudaError_t dev_enter(const nccl_comm *c, dev_guard *g)
{
    g->changed = 0;
    cudaError_t e = cudaGetDevice(&g->prev);
    if (e == cudaSuccess && g->prev != c->dev) {
        e = cudaSetDevice(c->dev);
        g->changed = e == cudaSuccess;
    }
    return e;
}

static void dev_leave(const dev_guard *g)
{
    if (g->changed)
        cudaSetDevice(g->prev);
}

/* The sentences below are written with mu held. */
static fm_status gone(const nccl_comm *c, fm_context *ctx)
{
    if (c->nc_aborted)
        return fm_error(ctx, FM_ERR_BACKEND,
                        "comm: rank %d's NCCL communicator was aborted (fm_comm_abort); it can only be destroyed now",
                        c->base.rank);
    return fm_error(ctx, FM_ERR_BACKEND,
                    "comm: rank %d's NCCL communicator is broken by an earlier NCCL or CUDA failure; call "
                    "fm_comm_abort on every rank (it aborts the ncclComm), then fm_comm_destroy",
                    c->base.rank);
}

static fm_status nccl_status(nccl_comm *c, fm_context *ctx, ncclResult_t r, const char *call)
{
    /* A nonblocking communicator returns ncclInProgress while it issues the
     * work; its state says when that is over. */
    while (r == ncclInProgress) {
        ncclResult_t q = ncclCommGetAsyncError(c->nc, &r);
        if (q != ncclSuccess)
            r = q;
        else if (r == ncclInProgress)
            sched_yield();
    }
    if (r == ncclSuccess)
        return FM_OK;
    c->broken = 1;
    const char *last = ncclGetLastError(c->nc);
    return fm_error(ctx, FM_ERR_BACKEND,
                    "comm: %s failed on rank %d: NCCL error %d (%s)%s%s; the communicator is broken now: call "
                    "fm_comm_abort on every rank (it aborts the ncclComm), then fm_comm_destroy",
                    call, c->base.rank, (int)r, ncclGetErrorString(r), last && *last ? ": " : "", last ? last : "");
}

static fm_status cuda_status(nccl_comm *c, fm_context *ctx, cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return FM_OK;
    cudaGetLastError();
    c->broken = 1;
    return fm_error(ctx, e == cudaErrorMemoryAllocation ? FM_ERR_OUT_OF_MEMORY : FM_ERR_BACKEND,
                    "comm: %s failed on rank %d: CUDA error %d (%s): %s; the NCCL communicator is broken now", what,
                    c->base.rank, (int)e, cudaGetErrorName(e), cudaGetErrorString(e));
}

/* The entry of every primitive that talks to the device: mu held and the
 * communicator's device current; an error when the group is broken or the
 * device cannot be made current. The caller ends with leave() whatever
 * this returns. */
static fm_status enter(nccl_comm *c, fm_context *ctx, dev_guard *g)
{
    pthread_mutex_lock(&c->mu);
    cudaError_t e = dev_enter(c, g);
    if (c->broken)
        return gone(c, ctx);
    if (e != cudaSuccess)
        return cuda_status(c, ctx, e, "cudaSetDevice");
    return FM_OK;
}

static void leave(nccl_comm *c, const dev_guard *g)
{
    dev_leave(g);
    pthread_mutex_unlock(&c->mu);
}


/* Waits for `ev` without holding mu; between polls, NCCL's asynchronous
 * error and the broken flag (fm_comm_abort from another thread). */
static fm_status wait_event(nccl_comm *c, fm_context *ctx, cudaEvent_t ev, const char *what)
{
    for (unsigned spin = 0;; spin++) {
        cudaError_t e = cudaEventQuery(ev);
        if (e == cudaSuccess)
            return FM_OK;
        fm_status st = FM_OK;
        pthread_mutex_lock(&c->mu);
        if (c->broken) {
            st = gone(c, ctx);
        } else if (e != cudaErrorNotReady) {
            st = cuda_status(c, ctx, e, what);
        } else {
            ncclResult_t ar = ncclSuccess, r = ncclCommGetAsyncError(c->nc, &ar);
            if (r != ncclSuccess)
                st = nccl_status(c, ctx, r, "ncclCommGetAsyncError");
            else if (ar != ncclSuccess && ar != ncclInProgress)
                st = nccl_status(c, ctx, ar, what);
        }
        pthread_mutex_unlock(&c->mu);
        if (st)
            return st;
        if (spin >= 64)
            sched_yield();
    }
}

/* Room for `bytes` in each half of the header buffers (mu held). */
static fm_status header_room(nccl_comm *c, fm_context *ctx, size_t bytes)
{
    if (bytes <= c->hcap)
        return FM_OK;
    cudaFree(c->hdev);
    cudaFreeHost(c->hhost);
    c->hdev = c->hhost = NULL;
    c->hcap = 0;
    cudaError_t e = cudaMalloc((void **)&c->hdev, 2 * bytes);
    if (e == cudaSuccess)
        e = cudaMallocHost((void **)&c->hhost, 2 * bytes);
    if (e != cudaSuccess)
        return cuda_status(c, ctx, e, "growing the header buffers");
    c->hcap = bytes;
    return FM_OK;
}

/* ncclGroupEnd after the calls of a group; the first failure wins. */
static fm_status group_end(nccl_comm *c, fm_context *ctx, ncclResult_t first, const char *first_call)
{
    ncclResult_t r = ncclGroupEnd();
    if (first != ncclSuccess && first != ncclInProgress)
        return nccl_status(c, ctx, first, first_call);
    return nccl_status(c, ctx, r, "ncclGroupEnd");
}

static fm_status nccl_alltoall(fm_comm *base, fm_context *ctx, const void *send, void *recv, size_t bytes)
{
    nccl_comm *c = (nccl_comm *)base;
    int n = base->size;
    size_t total = (size_t)n * bytes;
    /* the previous call's payload is through before its headers' successor starts */
    fm_status st = wait_event(c, ctx, c->done, "waiting for the previous dispatch or combine");
    if (st)
        return st;
    dev_guard g;
    st = enter(c, ctx, &g);
    if (!st)
        st = header_room(c, ctx, total);
    if (!st) {
        memcpy(c->hhost, send, total);
        st = cuda_status(c, ctx, cudaMemcpyAsync(c->hdev, c->hhost, total, cudaMemcpyHostToDevice, c->hs),
                         "cudaMemcpyAsync of the headers");
    }
    if (!st) {
        ncclResult_t r = ncclGroupStart();
        const char *call = "ncclGroupStart";
        for (int p = 0; p < n && r == ncclSuccess; p++) {
            call = "ncclSend (headers)";
            r = ncclSend(c->hdev + (size_t)p * bytes, bytes, ncclUint8, p, c->nc, c->hs);
            if (r == ncclSuccess) {
                call = "ncclRecv (headers)";
                r = ncclRecv(c->hdev + c->hcap + (size_t)p * bytes, bytes, ncclUint8, p, c->nc, c->hs);
            }
        }
        st = group_end(c, ctx, r, call);
    }
    if (!st)
        st = cuda_status(c, ctx,
                         cudaMemcpyAsync(c->hhost + c->hcap, c->hdev + c->hcap, total, cudaMemcpyDeviceToHost, c->hs),
                         "cudaMemcpyAsync of the headers");
    if (!st)
        st = cuda_status(c, ctx, cudaEventRecord(c->ev, c->hs), "cudaEventRecord");
    leave(c, &g);
    if (!st)
        st = wait_event(c, ctx, c->ev, "the header exchange");
    if (!st)
        memcpy(recv, c->hhost + c->hcap, total);
    return st;
}

static fm_status nccl_agree(fm_comm *base, fm_context *ctx, int ok, int *all_ok)
{
    nccl_comm *c = (nccl_comm *)base;
    dev_guard g;
    fm_status st = FM_OK;
    st = enter(c, ctx, &g);
    int32_t *hv = (int32_t *)c->hhost, *dv = (int32_t *)c->hdev;
    if (!st) {
        hv[0] = ok != 0;
        st = cuda_status(c, ctx, cudaMemcpyAsync(dv, hv, 4, cudaMemcpyHostToDevice, c->hs), "cudaMemcpyAsync");
    }
    if (!st)
        st = nccl_status(c, ctx, ncclAllReduce(dv, dv, 1, ncclInt32, ncclMin, c->nc, c->hs), "ncclAllReduce (agree)");
    if (!st)
        st = cuda_status(c, ctx, cudaMemcpyAsync(hv + 1, dv, 4, cudaMemcpyDeviceToHost, c->hs), "cudaMemcpyAsync");
    if (!st)
        st = cuda_status(c, ctx, cudaEventRecord(c->ev, c->hs), "cudaEventRecord");
    leave(c, &g);
    if (!st)
        st = wait_event(c, ctx, c->ev, "agreeing on the verdict");
    if (!st)
        *all_ok = hv[1];
    return st;
}

static fm_status nccl_alltoallv(fm_comm *base, fm_context *ctx, int nseg, const fm_comm_seg *segs,
                                const int64_t *send_off, const int64_t *recv_off)
{
    nccl_comm *c = (nccl_comm *)base;
    int n = base->size;
    cudaStream_t s = (cudaStream_t)ctx->stream;
    dev_guard g;
    fm_status st = FM_OK;
    st = enter(c, ctx, &g);
    for (int q = 0; q < nseg && !st; q++)
        if (!segs[q].recv && segs[q].row_bytes > 0 && recv_off[n] > 0) {
            c->broken = 1;
            st = fm_error(ctx, FM_ERR_BACKEND,
                          "comm: the NCCL all-to-all-v was given no receive buffer for segment %d; NCCL cannot refuse "
                          "rows a peer sends, so the communicator is broken now",
                          q);
        }
    if (!st) {
        ncclResult_t r = ncclGroupStart();
        const char *call = "ncclGroupStart";
        for (int p = 0; p < n && r == ncclSuccess; p++)
            for (int q = 0; q < nseg && r == ncclSuccess; q++) {
                size_t rb = (size_t)segs[q].row_bytes;
                size_t sn = (size_t)(send_off[p + 1] - send_off[p]) * rb;
                size_t rn = (size_t)(recv_off[p + 1] - recv_off[p]) * rb;
                if (sn) {
                    call = "ncclSend";
                    r = ncclSend((const uint8_t *)segs[q].send + (size_t)send_off[p] * rb, sn, ncclUint8, p, c->nc, s);
                }
                if (rn && r == ncclSuccess) {
                    call = "ncclRecv";
                    r = ncclRecv((uint8_t *)segs[q].recv + (size_t)recv_off[p] * rb, rn, ncclUint8, p, c->nc, s);
                }
            }
        st = group_end(c, ctx, r, call);
    }
    leave(c, &g);
    return st;
}

static fm_status nccl_check_ctx(fm_comm *base, fm_context *ctx)
{
    nccl_comm *c = (nccl_comm *)base;
    if (fm_cuda_ep_device(ctx) != c->dev)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "ctx: works on CUDA device %d but rank %d's NCCL communicator lives on device %d",
                        fm_cuda_ep_device(ctx), base->rank, c->dev);
    return FM_OK;
}

static fm_status nccl_sync(fm_comm *base, fm_context *ctx)
{
    nccl_comm *c = (nccl_comm *)base;
    dev_guard g;
    fm_status st = enter(c, ctx, &g);
    if (!st)
        st = cuda_status(c, ctx, cudaEventRecord(c->ev, (cudaStream_t)ctx->stream), "cudaEventRecord");
    leave(c, &g);
    if (!st)
        st = wait_event(c, ctx, c->ev, "waiting for the context's stream");
    if (!st)
        st = wait_event(c, ctx, c->done, "waiting for the previous dispatch or combine");
    return st;
}

static fm_status nccl_stage(fm_comm *base, fm_context *ctx, fm_device where, size_t bytes, void **p)
{
    nccl_comm *c = (nccl_comm *)base;
    int host = where == FM_DEVICE_HOST;
    void **buf = host ? &c->shost : &c->sdev;
    size_t *cap = host ? &c->shost_cap : &c->sdev_cap;
    fm_status st = wait_event(c, ctx, c->done, "waiting for the previous dispatch or combine");
    if (st)
        return st;
    if (bytes > *cap) {
        dev_guard g;
        cudaError_t e = dev_enter(c, &g);
        if (e == cudaSuccess) {
            if (host)
                cudaFreeHost(*buf);
            else
                cudaFree(*buf);
            *buf = NULL;
            *cap = 0;
            size_t want = (bytes + ((size_t)2 << 20) - 1) & ~(((size_t)2 << 20) - 1);
            e = host ? cudaMallocHost(buf, want) : cudaMalloc(buf, want);
            if (e == cudaSuccess)
                *cap = want;
            else
                *buf = NULL;
        }
        dev_leave(&g);
        if (e != cudaSuccess) {
            cudaGetLastError();
            return fm_error(ctx, e == cudaErrorMemoryAllocation ? FM_ERR_OUT_OF_MEMORY : FM_ERR_BACKEND,
                            "comm: %zu bytes of %s staging for the NCCL transport on rank %d: %s", bytes,
                            host ? "pinned host" : "device", base->rank, cudaGetErrorString(e));
        }
    }
    *p = *buf;
    return FM_OK;
}

static void nccl_done(fm_comm *base, fm_context *ctx)
{
    nccl_comm *c = (nccl_comm *)base;
    dev_guard g;
    pthread_mutex_lock(&c->mu);
    cudaError_t e = dev_enter(c, &g);
    if (e == cudaSuccess)
        e = cudaEventRecord(c->done, (cudaStream_t)ctx->stream);
    if (e != cudaSuccess) {
        /* without the event the staging could be reused too early */
        cudaGetLastError();
        c->broken = 1;
    }
    leave(c, &g);
}

static void nccl_fail(fm_comm *base)
{
    nccl_comm *c = (nccl_comm *)base;
    pthread_mutex_lock(&c->mu);
    c->broken = 1;
    pthread_mutex_unlock(&c->mu);
}

static void nccl_abort(fm_comm *base)
{
    nccl_comm *c = (nccl_comm *)base;
    pthread_mutex_lock(&c->mu);
    c->broken = 1;
    if (!c->nc_aborted) {
        ncclCommAbort(c->nc);
        c->nc_aborted = 1;
    }
    pthread_mutex_unlock(&c->mu);
}

static void nccl_destroy(fm_comm *base)
{
    nccl_comm *c = (nccl_comm *)base;
    dev_guard g;
    int ok = dev_enter(c, &g) == cudaSuccess;
    /* work still queued may read the staging: let it finish (an aborted
     * communicator's work was cancelled by ncclCommAbort) */
    if (ok && c->done && !c->broken)
        wait_event(c, NULL, c->done, "fm_comm_destroy");
    if (c->hs)
        cudaStreamDestroy(c->hs);
    if (c->ev)
        cudaEventDestroy(c->ev);
    if (c->done)
        cudaEventDestroy(c->done);
    cudaFree(c->hdev);
    cudaFree(c->sdev);
    cudaFreeHost(c->hhost);
    cudaFreeHost(c->shost);
    cudaGetLastError();
    dev_leave(&g);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static const fm_comm_ops nccl_ops = {
    /* .name      = */ "NCCL",
    /* .alltoall  = */ nccl_alltoall,
    /* .agree     = */ nccl_agree,
    /* .alltoallv = */ nccl_alltoallv,
    /* .fail      = */ nccl_fail,
    /* .abort     = */ nccl_abort,
    /* .destroy   = */ nccl_destroy,
    /* .check_ctx = */ nccl_check_ctx,
    /* .stage     = */ nccl_stage,
    /* .sync      = */ nccl_sync,
    /* .done      = */ nccl_done,
};

fm_status fm_comm_create_nccl(fm_context *ctx, void *nccl_comm_, fm_comm **out)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    if (!out)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "out: must point to an fm_comm* to fill");
    *out = NULL;
    if (fm_context_device(ctx) != FM_DEVICE_CUDA)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "ctx: a %s context; the NCCL transport moves CUDA memory and needs a CUDA context",
                        fm_context_backend_name(ctx));
    if (!nccl_comm_)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "nccl_comm: NULL; pass the NCCL communicator (an ncclComm_t) this rank belongs to");
    ncclComm_t nc = (ncclComm_t)nccl_comm_;
    ncclResult_t r, ar = ncclSuccess;
    int rank = -1, size = 0, dev = -1;
    const char *call = "ncclCommGetAsyncError";
    if ((r = ncclCommGetAsyncError(nc, &ar)) == ncclSuccess && (r = ar) == ncclSuccess &&
        (call = "ncclCommUserRank", r = ncclCommUserRank(nc, &rank)) == ncclSuccess &&
        (call = "ncclCommCount", r = ncclCommCount(nc, &size)) == ncclSuccess)
        call = "ncclCommCuDevice", r = ncclCommCuDevice(nc, &dev);
    if (r != ncclSuccess)
        return fm_error(ctx, r == ncclInProgress ? FM_ERR_INVALID_ARG : FM_ERR_BACKEND,
                        "nccl_comm: %s: NCCL %s (%s); the communicator must be initialized and healthy", call,
                        r == ncclInProgress ? "says it is still in progress" : "error",
                        ncclGetErrorString(r));
    if (dev != fm_cuda_ep_device(ctx))
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "nccl_comm: the NCCL communicator lives on CUDA device %d but ctx works on device %d", dev,
                        fm_cuda_ep_device(ctx));
    nccl_comm *c = calloc(1, sizeof *c);
    if (!c)
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_comm_create_nccl: out of host memory");
    if (pthread_mutex_init(&c->mu, NULL)) {
        free(c);
        return fm_error(ctx, FM_ERR_BACKEND, "fm_comm_create_nccl: pthread_mutex_init failed");
    }
    c->base = (fm_comm){&nccl_ops, rank, size, FM_DEVICE_CUDA};
    c->nc = nc;
    c->dev = dev;
    dev_guard g;
    const char *step = "cudaSetDevice";
    cudaError_t e = dev_enter(c, &g);
    if (e == cudaSuccess)
        step = "cudaStreamCreateWithFlags", e = cudaStreamCreateWithFlags(&c->hs, cudaStreamNonBlocking);
    if (e == cudaSuccess)
        step = "cudaEventCreateWithFlags", e = cudaEventCreateWithFlags(&c->ev, cudaEventDisableTiming);
    if (e == cudaSuccess)
        e = cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming);
    /* room for the headers of every call (comm.c's are 48 bytes) */
    size_t hb = (size_t)size * 64;
    if (e == cudaSuccess)
        step = "cudaMalloc", e = cudaMalloc((void **)&c->hdev, 2 * hb);
    if (e == cudaSuccess)
        step = "cudaMallocHost", e = cudaMallocHost((void **)&c->hhost, 2 * hb);
    if (e == cudaSuccess)
        c->hcap = hb;
    dev_leave(&g);
    if (e != cudaSuccess) {
        cudaGetLastError();
        c->broken = 1;
        nccl_destroy(&c->base);
        return fm_error(ctx, e == cudaErrorMemoryAllocation ? FM_ERR_OUT_OF_MEMORY : FM_ERR_BACKEND,
                        "fm_comm_create_nccl: %s on device %d: %s", step, dev, cudaGetErrorString(e));
    }
    *out = &c->base;
    return FM_OK;
}
