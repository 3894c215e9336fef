/* flowmoe — expert parallelism: communicators, dispatch and combine.
 *
 * The experts of a layer are spread over the ranks of a communicator in
 * contiguous blocks: with E_local = cfg->experts_per_rank, rank r owns the
 * global experts [r * E_local, (r + 1) * E_local), its local expert e being
 * global expert r * E_local + e.
 *
 * Collective rules (every call below that takes an fm_comm):
 *   - EVERY rank of the communicator must make the same sequence of calls.
 *     A rank whose own arguments are invalid still takes part: its call
 *     exchanges a header (shape, dtype, scale mode, k, E_local, row counts)
 *     with every other rank before any payload moves, so every rank learns
 *     of the failure and returns FM_ERR_INVALID_ARG with a sentence (the
 *     failing rank names its argument, the others name the failing rank).
 *     Arguments that disagree across ranks (H, dtype, scale mode, k,
 *     E_local) are reported the same way, naming the first rank that
 *     differs from rank 0. Nobody waits forever for a rank that failed.
 *   - Only a NULL comm cannot take part (there is nothing to talk on); use
 *     fm_comm_abort to release the others then.
 *   - Each rank passes its own context (per rank thread or per GPU).
 *
 * Exactness: dispatch moves bytes (codes, compact scales, ids, probs), so
 * it is exact for every payload format; combine sums in F32 in the fixed
 * order documented at fm_ep_combine, so every implementation (the
 * in-process reference, NCCL) gives the same bits. */
#ifndef FLOWMOE_COMM_H
#define FLOWMOE_COMM_H

#include "flowmoe/context.h"
#include "flowmoe/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fm_comm fm_comm;

/* An in-process group of `nranks` ranks that talk through shared memory:
 * ranks_out[r] (an array of nranks handles the caller provides) is rank r's
 * communicator, to be used by one thread. Each handle is destroyed on its
 * own; the group's shared state goes with the last. On failure every
 * ranks_out[r] is NULL and fm_last_error(NULL) says why. Tensors must be in
 * host memory (CPU contexts). */
fm_status fm_comm_create_inproc(int nranks, fm_comm **ranks_out);

/* A communicator over an NCCL communicator the caller already has
 * (`nccl_comm` is an ncclComm_t; the caller keeps owning it, and destroys it
 * after fm_comm_destroy unless fm_comm_abort aborted it). The context must
 * be a CUDA context on the ncclComm's device; each call's context must be
 * one on that device too. Dispatch and combine are queued on the context's
 * stream, but each call first waits for that stream (its routing plan is
 * made on the host from expert_ids) and for the header exchange; the
 * payload exchange and the kernels after it are left queued. The
 * communicator keeps staging memory on the device (about the rows sent,
 * or received back, times their bytes) and in pinned host memory, grown on
 * demand and freed by fm_comm_destroy. A failed NCCL or CUDA call
 * (FM_ERR_BACKEND) breaks this rank's communicator: later calls fail at
 * once; abort every rank then (fm_comm_abort). FM_ERR_UNSUPPORTED with a
 * sentence in builds without NCCL. */
fm_status fm_comm_create_nccl(fm_context *ctx, void *nccl_comm, fm_comm **out);

/* NCCL: waits for the communicator's queued work; never destroys the
 * ncclComm. */
void fm_comm_destroy(fm_comm *comm);
/* -1 for a NULL comm. */
int fm_comm_rank(const fm_comm *comm);
int fm_comm_size(const fm_comm *comm);

/* Marks the whole group broken: calls waiting in (or later entering) a
 * collective on any rank of this communicator return FM_ERR_BACKEND. For a
 * rank that must leave without making the collective calls the others make.
 * The communicators can then only be destroyed.
 * NCCL: the other ranks live in other threads or processes, so this reaches
 * this rank only: it calls ncclCommAbort on the caller's ncclComm_t (which
 * frees it: do not ncclCommDestroy it afterwards), and this rank's calls,
 * one that waits for the GPU in another thread included, return
 * FM_ERR_BACKEND (one inside an NCCL call finishes that call first). Each rank
 * aborts its own communicator; until then a peer learns of it only where
 * NCCL tells it (a network transport sees the connection go; a peer on
 * NVLink or shared memory keeps waiting). */
void fm_comm_abort(fm_comm *comm);

typedef struct fm_ep_config {
    int experts_per_rank;   /* E_local >= 1: rank r owns experts [r E_local, (r + 1) E_local) */
} fm_ep_config;

/* Where the received rows go. Buffers are the caller's, with a row capacity
 * C = x->shape[0] that every given tensor shares; the worst case is the sum
 * over ranks of their token counts T. Only x is required. */
typedef struct fm_ep_dispatch_out {
    fm_tensor *x;            /* [C, H]: the dispatched x's dtype, scale mode, COMPACT scales */
    fm_tensor *expert_ids;   /* [C, k] I32, optional: LOCAL expert ids in [0, E_local), -1 for a
                              * choice that lives on another rank */
    fm_tensor *probs;        /* [C, k] F32, optional (needs probs): the choice's probability, 0 where -1 */
    fm_tensor *src_rank;     /* [C, 1] I32, optional: the rank the row came from */
    fm_tensor *src_token;    /* [C, 1] I32, optional: its token index on that rank */
    int64_t *rows_from;      /* optional host int64_t[nranks]: rows received from each rank */
    int64_t rows;            /* OUT: R_recv, the rows received (host value) */
} fm_ep_dispatch_out;

/* Dispatch: send every token's row of x to the ranks that own its chosen
 * experts, ONCE per rank however many of its k choices that rank owns.
 *
 * x [T, H] row-wise: F32/BF16/F16 unscaled, or E4M3/E5M2 with BLOCK_1x128 or
 * MX32 scales, or E2M1 (MXFP4) with MX32 scales, scales COMPACT; data and
 * scales move byte for byte (an MXFP4 payload is made by the caller with
 * fm_convert_scaled from FP8 before, and turned back into FP8 after:
 * dispatch does not re-encode). expert_ids [T, k] I32 global ids in
 * [0, nranks * E_local), or -1 (a dropped choice: it goes nowhere; a token
 * with every choice -1 is not sent). probs [T, k] F32, optional.
 *
 * Received rows, in this fixed order: by source rank ascending, then by
 * source token index ascending; row i has src_rank, src_token, and for each
 * choice j < k the LOCAL id (global id - rank * E_local) when this rank owns
 * that choice's expert, else -1, and the matching prob (0 where -1). So
 * out->x rows [0, rows) with out->expert_ids and out->probs are exactly the
 * input of a local fm_moe_permute (which skips -1 slots), and the rows past
 * `rows` are left untouched. A rank that receives nothing gets rows = 0.
 *
 * Backward: the gradient of the dispatched rows dx_recv [R_recv, H]
 * (BF16/F32, one per received row, summed over the row's local experts) goes
 * back with fm_ep_combine(ctx, comm, cfg, expert_ids, dx_recv, dx): dx[t] is
 * the sum over the ranks t visited, the gradient of a row sent to several
 * ranks. The gradient of the received probs, dprobs_recv [R_recv, k] F32
 * with 0 in the -1 slots (fm_moe_unpermute_backward gives 0 there), goes
 * back with the same call into dprobs [T, k]: each choice lives on one rank,
 * so the sum over ranks is that rank's value (a -0 comes back as +0 when the
 * token also visits another rank, the only bit the sum can change). */
fm_status fm_ep_dispatch(fm_context *ctx, fm_comm *comm, const fm_ep_config *cfg, const fm_tensor *x,
                         const fm_tensor *expert_ids, const fm_tensor *probs, fm_ep_dispatch_out *out);

/* Combine: the inverse of fm_ep_dispatch. y [R_recv, C] (F32/BF16/F16
 * unscaled) holds one row per row this rank's last matching dispatch
 * received, in that dispatch's order (typically the local fm_moe_unpermute
 * of the experts' output with the received probs: the row already summed
 * over its local experts and weighted). Each row goes back to its source
 * rank, and out [T, C] (F32/BF16/F16) gets, for each of this rank's tokens
 * t, the sum over the ranks t visited (those owning at least one of its
 * choices in expert_ids [T, k], the dispatch's routing), in ascending rank
 * order, in F32: acc = y_first, then acc = acc + y_next (plain F32 adds, no
 * fma), rounded once to out's dtype. A token that visited no rank gets a
 * zero row. R_recv must equal what the matching dispatch received: each
 * rank tells the others how many rows it expects back, and a mismatch is
 * FM_ERR_INVALID_ARG on every rank.
 *
 * Backward: dout [T, C] goes to the rows that produced it with
 * fm_ep_dispatch(ctx, comm, cfg, dout, expert_ids, NULL, &o) (o.x [R_recv, C]
 * in the recipe's precision: quantize dout first for an FP8 or MXFP4
 * gradient payload): each received row's gradient is dout of its token. */
fm_status fm_ep_combine(fm_context *ctx, fm_comm *comm, const fm_ep_config *cfg, const fm_tensor *expert_ids,
                        const fm_tensor *y, fm_tensor *out);

#ifdef __cplusplus
}
#endif
#endif
