/* The transport behind an fm_comm: a small vtable that the in-process
 * reference (inproc.c) and NCCL implement, and that comm.c's dispatch and
 * combine are written against. Every primitive is collective: each rank of
 * the group calls it in the same order. A primitive returns FM_ERR_BACKEND
 * (with a sentence in ctx, which may be NULL) when the group is aborted or
 * the transport fails; it then leaves the group aborted so that no rank
 * waits for another that has given up. */
#ifndef FLOWMOE_COMM_INTERNAL_H
#define FLOWMOE_COMM_INTERNAL_H

#include "../core/internal.h"
#include "flowmoe/comm.h"

/* One stream of rows of an all-to-all-v: this rank's packed rows, grouped by
 * destination, and where the rows it receives land, grouped by source. All
 * ranks pass the same segments in the same order with the same row_bytes;
 * recv may be NULL when this rank does not want that stream (host transports
 * only: NCCL cannot refuse rows a peer sends, so comm.c's device path gives
 * every recv, a scratch area for the streams nobody asked for). */
typedef struct fm_comm_seg {
    const void *send;
    void *recv;
    int64_t row_bytes;
} fm_comm_seg;

typedef struct fm_comm_ops {
    const char *name;
    /* Fixed-size all-to-all in host memory: block p of send (`bytes` each)
     * goes to rank p; block p of recv comes from rank p. (NCCL: through a
     * device staging buffer, then a host copy: the header and counts.) */
    fm_status (*alltoall)(fm_comm *c, fm_context *ctx, const void *send, void *recv, size_t bytes);
    /* *all_ok = 1 when every rank passed ok != 0 (NCCL: an allreduce-min). */
    fm_status (*agree)(fm_comm *c, fm_context *ctx, int ok, int *all_ok);
    /* Rows [send_off[p], send_off[p + 1]) of every segment go to rank p and
     * arrive at rows [recv_off[q], recv_off[q + 1]) of the receiver's segment
     * when they come from rank q (NCCL: grouped ncclSend/ncclRecv, one pair
     * per peer and segment). */
    fm_status (*alltoallv)(fm_comm *c, fm_context *ctx, int nseg, const fm_comm_seg *segs, const int64_t *send_off,
                           const int64_t *recv_off);
    /* This rank cannot go on: every later primitive returns FM_ERR_BACKEND
     * (in-process: on every rank, and the waiting ranks are released; NCCL:
     * on this rank, the ncclComm is left alone for the caller). */
    void (*fail)(fm_comm *c);
    /* fm_comm_abort: fail, plus the transport's own abort (NCCL: ncclCommAbort). */
    void (*abort)(fm_comm *c);
    void (*destroy)(fm_comm *c);

    /* The device path: NULL in a transport of host memory.
     * check_ctx: whether ctx can drive this rank (NCCL: the communicator's
     * device); a local argument check, FM_ERR_INVALID_ARG with a sentence.
     * stage: memory the transport keeps for this rank from call to call, at
     * least `bytes`, on the device (FM_DEVICE_CUDA) or pinned on the host
     * (FM_DEVICE_HOST); it first waits for the previous call's last use (see
     * done), and a larger request may move it (the old pointer is gone).
     * Failing to grow is a local failure (FM_ERR_OUT_OF_MEMORY).
     * sync: waits until ctx's stream and the previous call have finished,
     * watching the transport (NCCL: polls the stream and
     * ncclCommGetAsyncError), so a broken transport is FM_ERR_BACKEND rather
     * than a hang where the transport can tell.
     * done: queued after the call's last use of the staged memory. */
    fm_status (*check_ctx)(fm_comm *c, fm_context *ctx);
    fm_status (*stage)(fm_comm *c, fm_context *ctx, fm_device where, size_t bytes, void **p);
    fm_status (*sync)(fm_comm *c, fm_context *ctx);
    void (*done)(fm_comm *c, fm_context *ctx);
} fm_comm_ops;

struct fm_comm {
    const fm_comm_ops *ops;
    int rank, size;
    fm_device device;     /* where dispatch and combine tensors must live */
};

#endif
