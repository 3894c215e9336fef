/* The device halves of fm_ep_dispatch and fm_ep_combine
 * (collectives/comm.c): C entry points without CUDA types, so comm.c stays
 * plain C. Everything is queued on the context's stream on the context's
 * device; the arguments are comm.c's, already validated. */
#ifndef FLOWMOE_CUDA_EP_H
#define FLOWMOE_CUDA_EP_H

#include "../../core/internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The CUDA device ordinal of a CUDA context (the NCCL transport checks it
 * against its communicator's). */
int fm_cuda_ep_device(const fm_context *ctx);

/* cudaMemcpyAsync of `bytes` (either side pinned host or device memory),
 * NOT waited for: the caller waits through its transport's sync. */
fm_status fm_cuda_ep_copy(fm_context *ctx, void *dst, const void *src, size_t bytes, const char *what);

/* Dispatch's pack: send row r is token tok[r] of x, bound for rank dst[r].
 * Copies the row's rb bytes of codes and sb bytes of compact scales, and
 * writes its token index, its k local ids (global id - dst E_local where
 * dst owns the choice, else -1) and the matching probs (0 where -1; pp may
 * be NULL when there are no probs). */
typedef struct fm_ep_pack {
    const void *x, *xs;
    int64_t rb, sb;
    const int32_t *ids;   /* [T, k] global ids, device */
    const float *probs;   /* [T, k] or NULL */
    int64_t k;
    int e_local;
    const int32_t *tok, *dst; /* [rows], device */
    int64_t rows;
    void *pd, *ps;
    int32_t *pt, *pi;
    float *pp;
} fm_ep_pack;
fm_status fm_cuda_ep_pack(fm_context *ctx, const fm_ep_pack *a);

/* src_rank[i] = p for the received rows i in [roff[p], roff[p + 1]) (roff
 * [n + 1] in device memory), i < rows. */
fm_status fm_cuda_ep_fill_src_rank(fm_context *ctx, int32_t *src_rank, const int64_t *roff, int n, int64_t rows);

/* Combine's sum: out[t] (T rows of C, odt) = recv rows rows[toff[t]],
 * rows[toff[t] + 1], ... (ydt) added in that order in F32 (first row, then
 * plain adds), rounded once as format.h stores; a zero row where toff[t] ==
 * toff[t + 1]. toff [T + 1] and rows in device memory. */
fm_status fm_cuda_ep_sum(fm_context *ctx, const void *recv, fm_dtype ydt, const int32_t *toff, const int32_t *rows,
                         int64_t T, int64_t C, void *out, fm_dtype odt);

#ifdef __cplusplus
}
#endif
#endif
