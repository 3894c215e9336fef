/* Expert-parallel dispatch and combine over any fm_comm transport:
 * validation, the header exchange, the routing plan, packing and the
 * fixed-order reduction. Each call runs the same three collectives on every
 * rank, whatever happens locally, so that a rank with bad arguments cannot
 * leave the others waiting:
 *   1. alltoall of a header per peer (ok flag, op, dtype, scale mode, k,
 *      E_local, columns, and the row count this rank sends that peer or, in
 *      combine, expects back from it); every rank sees every rank's header
 *      and applies the same checks, so all agree on the verdict;
 *   2. agree on the local checks that need the exchanged counts (output
 *      capacity, combine's row count) and on host allocations;
 *   3. alltoallv of the payload, only when every rank said yes.
 * Packing and the reduction are host loops: tensors live in host memory for
 * the in-process transport. */
#include <stdlib.h>
#include <string.h>

#include "../backends/cpu/cpu.h"
#include "../core/validate.h"
#include "comm_internal.h"

enum { EP_DISPATCH = 1, EP_COMBINE = 2 };

typedef struct {
    int32_t op, ok, dtype, scale_mode, k, e_local, has_probs, pad_;
    int64_t cols;
    int64_t rows; /* dispatch: rows sent to the peer; combine: rows expected back from it */
} ep_header;

static const char *op_name(int op) { return op == EP_DISPATCH ? "fm_ep_dispatch" : "fm_ep_combine"; }

/* ---- communicators ------------------------------------------------------- */

void fm_comm_destroy(fm_comm *comm)
{
    if (comm)
        comm->ops->destroy(comm);
}

int fm_comm_rank(const fm_comm *comm) { return comm ? comm->rank : -1; }
int fm_comm_size(const fm_comm *comm) { return comm ? comm->size : -1; }

void fm_comm_abort(fm_comm *comm)
{
    if (comm)
        comm->ops->abort(comm);
}

fm_status fm_comm_create_nccl(fm_context *ctx, void *nccl_comm, fm_comm **out)
{
    (void)nccl_comm;
    if (out)
        *out = NULL;
#ifdef FM_HAVE_NCCL
    return fm_error(ctx, FM_ERR_UNSUPPORTED,
                    "fm_comm_create_nccl: the NCCL transport is not implemented yet in this flowmoe (issue 9); "
                    "use fm_comm_create_inproc for in-process ranks");
#else
    return fm_error(ctx, FM_ERR_UNSUPPORTED,
                    "fm_comm_create_nccl: this flowmoe was built without NCCL (meson option nccl, which needs "
                    "the CUDA backend); use fm_comm_create_inproc for in-process ranks");
#endif
}

/* ---- routing ------------------------------------------------------------- */

/* The distinct ranks token row `ids` (k global ids) visits, ascending; -1
 * entries go nowhere. Returns their count. */
static int token_ranks(const int32_t *ids, int64_t k, int e_local, int *ranks)
{
    int m = 0;
    for (int64_t j = 0; j < k; j++) {
        if (ids[j] < 0)
            continue;
        int r = ids[j] / e_local, i = m;
        int dup = 0;
        for (int q = 0; q < m; q++)
            dup |= ranks[q] == r;
        if (dup)
            continue;
        while (i > 0 && ranks[i - 1] > r) {
            ranks[i] = ranks[i - 1];
            i--;
        }
        ranks[i] = r;
        m++;
    }
    return m;
}

/* Rows this rank sends to each peer: counts[p] tokens visit p. */
static void count_rows(const int32_t *ids, int64_t T, int64_t k, int e_local, int *scratch, int64_t *counts, int n)
{
    for (int p = 0; p < n; p++)
        counts[p] = 0;
    for (int64_t t = 0; t < T; t++) {
        int m = token_ranks(ids + t * k, k, e_local, scratch);
        for (int i = 0; i < m; i++)
            counts[scratch[i]]++;
    }
}

/* ---- validation -------------------------------------------------------- */


static fm_status check_common(fm_context *ctx, fm_comm *comm, const fm_ep_config *cfg, const fm_tensor *expert_ids,
                              int64_t T)
{
    fm_status st;
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    if (comm->device != fm_context_device(ctx))
        return fm_error(ctx, FM_ERR_UNSUPPORTED,
                        "comm: the %s communicator moves %s memory but this is a %s context", comm->ops->name,
                        comm->device == FM_DEVICE_CUDA ? "CUDA" : "host", fm_context_backend_name(ctx));
    if (!cfg)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg: must point to an fm_ep_config (experts_per_rank >= 1)");
    if (cfg->experts_per_rank < 1)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->experts_per_rank: must be >= 1, got %d",
                        cfg->experts_per_rank);
    if ((int64_t)cfg->experts_per_rank * comm->size > INT32_MAX)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "cfg->experts_per_rank: %d experts on each of %d ranks overflow the I32 expert ids",
                        cfg->experts_per_rank, comm->size);
    if ((st = fm_check_mat(ctx, expert_ids, "expert_ids", FM_CHK_UNSCALED | FM_CHK_ROWWISE, FM_DTYPE_I32, T, -1)))
        return st;
    int64_t k = expert_ids->shape[1];
    if (k < 1)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "expert_ids: needs k >= 1 columns, got [%lld, 0]", (long long)T);
    if (T > INT32_MAX)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "expert_ids: %lld tokens; token indices travel as I32 (< 2^31)",
                        (long long)T);
    const int32_t *ids = expert_ids->data;
    int64_t E = (int64_t)cfg->experts_per_rank * comm->size;
    for (int64_t i = 0; i < T * k; i++)
        if (ids[i] < -1 || ids[i] >= E)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "expert_ids: entry [%lld, %lld] is %d, outside [0, nranks * experts_per_rank = %lld) and "
                            "not -1 (dropped)",
                            (long long)(i / k), (long long)(i % k), (int)ids[i], (long long)E);
    return FM_OK;
}

/* Every output given in the dispatch struct: shape [C, cols], the right
 * dtype, disjoint from the inputs and from each other. */
static fm_status check_dispatch(fm_context *ctx, fm_comm *comm, const fm_ep_config *cfg, const fm_tensor *x,
                                const fm_tensor *expert_ids, const fm_tensor *probs, fm_ep_dispatch_out *out)
{
    fm_status st;
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    if ((st = fm_check_rows(ctx, x, "x", -1, -1, 1)))
        return st;
    int64_t T = x->shape[0], H = x->shape[1];
    if ((st = check_common(ctx, comm, cfg, expert_ids, T)))
        return st;
    int64_t k = expert_ids->shape[1];
    if (probs && (st = fm_check_mat(ctx, probs, "probs", FM_CHK_UNSCALED | FM_CHK_ROWWISE, FM_DTYPE_F32, T, k)))
        return st;
    if (!out)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "out: must point to an fm_ep_dispatch_out");
    if (!out->x)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "out->x: the received rows' descriptor is required");
    if ((st = fm_check_rows(ctx, out->x, "out->x", -1, H, 1)))
        return st;
    int64_t C = out->x->shape[0];
    if (out->x->dtype != x->dtype || out->x->scale_mode != x->scale_mode)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "out->x: must have x's dtype and scale mode (%s, %s): rows are moved, not re-encoded; got "
                        "%s, %s",
                        fm_dtype_name(x->dtype), fm_scale_mode_name(x->scale_mode), fm_dtype_name(out->x->dtype),
                        fm_scale_mode_name(out->x->scale_mode));
    if (out->probs && !probs)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "out->probs: given, so probs [T, k] F32 must be given too");
    if (C > INT32_MAX)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "out->x: %lld rows of capacity; received rows are indexed as I32",
                        (long long)C);
    fm_tensor *outs[5] = {out->x, out->expert_ids, out->probs, out->src_rank, out->src_token};
    static const char *const on[5] = {"out->x", "out->expert_ids", "out->probs", "out->src_rank", "out->src_token"};
    static const fm_dtype odt[5] = {FM_DTYPE_COUNT, FM_DTYPE_I32, FM_DTYPE_F32, FM_DTYPE_I32, FM_DTYPE_I32};
    int64_t ocols[5] = {H, k, k, 1, 1};
    for (int i = 1; i < 5; i++)
        if (outs[i] && (st = fm_check_mat(ctx, outs[i], on[i], FM_CHK_UNSCALED | FM_CHK_ROWWISE, odt[i], C, ocols[i])))
            return st;
    const fm_tensor *ins[3] = {x, expert_ids, probs};
    static const char *const in_[3] = {"x", "expert_ids", "probs"};
    for (int i = 0; i < 5; i++) {
        if (!outs[i])
            continue;
        for (int j = 0; j < 3; j++)
            if (ins[j] && (st = fm_check_no_alias(ctx, outs[i], on[i], ins[j], in_[j])))
                return st;
        for (int j = i + 1; j < 5; j++)
            if (outs[j] && (st = fm_check_no_alias(ctx, outs[i], on[i], outs[j], on[j])))
                return st;
    }
    if (out->x->scale_mode &&
        (st = fm_check_disjoint(ctx, out->x->data, fm_tensor_nbytes(out->x), "out->x", out->x->scale,
                                fm_tensor_scale_nbytes(out->x), "its own scale")))
        return st;
    if (out->rows_from && ((uintptr_t)out->rows_from % sizeof(int64_t)))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "out->rows_from: %p is not 8-byte aligned", (void *)out->rows_from);
    return FM_OK;
}

static fm_status check_combine(fm_context *ctx, fm_comm *comm, const fm_ep_config *cfg, const fm_tensor *expert_ids,
                               const fm_tensor *y, fm_tensor *out)
{
    fm_status st;
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    if ((st = fm_check_rows(ctx, y, "y", -1, -1, 0)))
        return st;
    if ((st = fm_check_rows(ctx, out, "out", -1, y->shape[1], 0)))
        return st;
    if ((st = check_common(ctx, comm, cfg, expert_ids, out->shape[0])))
        return st;
    const fm_tensor *ins[2] = {y, expert_ids};
    static const char *const in_[2] = {"y", "expert_ids"};
    for (int j = 0; j < 2; j++)
        if ((st = fm_check_no_alias(ctx, out, "out", ins[j], in_[j])))
            return st;
    return FM_OK;
}

/* ---- the header exchange ------------------------------------------------ */

static fm_status check_headers(fm_context *ctx, int op, const ep_header *hdr, int n);

/* Sends `mine` (rows per peer in counts) and reads every rank's header into
 * hdr[n]. Returns the transport's status (not FM_OK: the group is gone,
 * return at once); *verdict is this rank's own failure when it had one,
 * else the outcome of the checks every rank applies alike to the headers. */
static fm_status exchange_headers(fm_context *ctx, fm_comm *comm, ep_header mine, const int64_t *counts,
                                  ep_header *hdr, fm_status *verdict)
{
    int n = comm->size;
    ep_header *send = malloc((size_t)n * sizeof *send);
    if (!send) {
        /* Cannot take part without a send buffer: release the others. */
        comm->ops->abort(comm);
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "%s: out of host memory for %d headers; the group is aborted",
                        op_name(mine.op), n);
    }
    for (int p = 0; p < n; p++) {
        send[p] = mine;
        send[p].rows = counts ? counts[p] : 0;
    }
    fm_status st = comm->ops->alltoall(comm, ctx, send, hdr, sizeof *send);
    free(send);
    if (st || *verdict)
        return st;
    *verdict = check_headers(ctx, mine.op, hdr, n);
    return FM_OK;
}

static fm_status check_headers(fm_context *ctx, int op, const ep_header *hdr, int n)
{
    for (int p = 0; p < n; p++)
        if (!hdr[p].ok)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "%s: rank %d refused its own arguments (fm_last_error on that rank says which), so no "
                            "rank moves data",
                            op_name(op), p);
    for (int p = 1; p < n; p++) {
        const ep_header *a = &hdr[0], *b = &hdr[p];
        if (b->op != a->op)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "comm: rank %d called %s while rank 0 called %s", p,
                            op_name(b->op), op_name(a->op));
        const char *what = NULL;
        long long va = 0, vb = 0;
        const char *arg = op == EP_DISPATCH ? "x" : "y";
        if (b->cols != a->cols)
            what = "columns (H)", va = a->cols, vb = b->cols;
        else if (b->dtype != a->dtype)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "%s: every rank must pass the same dtype; rank 0 has %s, rank %d has %s", arg,
                            fm_dtype_name((fm_dtype)a->dtype), p, fm_dtype_name((fm_dtype)b->dtype));
        else if (b->scale_mode != a->scale_mode)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "%s: every rank must pass the same scale mode; rank 0 has %s, rank %d has %s", arg,
                            fm_scale_mode_name((fm_scale_mode)a->scale_mode), p,
                            fm_scale_mode_name((fm_scale_mode)b->scale_mode));
        else if (b->k != a->k)
            arg = "expert_ids", what = "k (columns)", va = a->k, vb = b->k;
        else if (b->e_local != a->e_local)
            arg = "cfg->experts_per_rank", what = "value", va = a->e_local, vb = b->e_local;
        else if (b->has_probs != a->has_probs)
            arg = "probs", what = "presence (1 = given)", va = a->has_probs, vb = b->has_probs;
        if (what)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "%s: every rank must pass the same %s; rank 0 has %lld, rank %d has %lld", arg, what, va,
                            p, vb);
    }
    return FM_OK;
}

/* After the header verdict: a failed rank still joins agree() (saying no) so
 * the others return instead of waiting in the payload exchange. */
static fm_status agree(fm_context *ctx, fm_comm *comm, int op, fm_status local_st)
{
    int all_ok = 0;
    fm_status st = comm->ops->agree(comm, ctx, local_st == FM_OK, &all_ok);
    if (st)
        return st;
    if (local_st)
        return local_st;
    if (!all_ok)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "%s: another rank could not receive its rows (output capacity, row count or memory; "
                        "fm_last_error on that rank says which), so no rank moves data",
                        op_name(op));
    return FM_OK;
}

static int64_t row_bytes(const fm_tensor *t)
{
    return t->dtype == FM_DTYPE_E2M1 ? t->shape[1] / 2 : t->shape[1] * (fm_dtype_bits(t->dtype) / 8);
}

static int64_t scale_row_bytes(const fm_tensor *t)
{
    if (t->scale_mode == FM_SCALE_NONE)
        return 0;
    return fm_cdiv(t->shape[1], fm_mode_block_cols(t->scale_mode)) * (fm_dtype_bits(t->scale_dtype) / 8);
}

static void count_op(fm_context *ctx, fm_op op, int64_t rd, int64_t wr)
{
    ctx->stats.calls[op]++;
    ctx->stats.op_calls++;
    ctx->stats.bytes_read += rd;
    ctx->stats.bytes_written += wr;
}

/* ---- dispatch ------------------------------------------------------------- */

fm_status fm_ep_dispatch(fm_context *ctx, fm_comm *comm, const fm_ep_config *cfg, const fm_tensor *x,
                         const fm_tensor *expert_ids, const fm_tensor *probs, fm_ep_dispatch_out *out)
{
    if (!comm)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "comm: NULL; without a communicator this rank cannot tell the others (see fm_comm_abort)");
    fm_error_clear(ctx);
    int n = comm->size;
    fm_status local = check_dispatch(ctx, comm, cfg, x, expert_ids, probs, out);
    int64_t *cnt = calloc((size_t)(4 * n + 2), sizeof(int64_t));
    ep_header *hdr = malloc((size_t)n * sizeof *hdr);
    int64_t T = 0, k = 1, H = 0;
    int *tr = NULL;
    if (!local) {
        T = x->shape[0], k = expert_ids->shape[1], H = x->shape[1];
        tr = malloc((size_t)k * sizeof *tr);
    }
    if (!cnt || !hdr || (!local && !tr)) {
        free(cnt), free(hdr), free(tr);
        comm->ops->abort(comm);
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_ep_dispatch: out of host memory for %d ranks' counts; the "
                        "group is aborted", n);
    }
    /* send counts, send offsets [n + 1], receive offsets [n + 1], pack cursors */
    int64_t *scnt = cnt, *soff = cnt + n, *roff = cnt + 2 * n + 1, *cur = cnt + 3 * n + 2;
    ep_header mine = {EP_DISPATCH, local == FM_OK, 0, 0, 0, 0, 0, 0, 0, 0};
    if (!local) {
        count_rows(expert_ids->data, T, k, cfg->experts_per_rank, tr, scnt, n);
        mine = (ep_header){EP_DISPATCH, 1, (int32_t)x->dtype, (int32_t)x->scale_mode, (int32_t)k,
                           cfg->experts_per_rank, probs != NULL, 0, H, 0};
    }
    fm_status st = exchange_headers(ctx, comm, mine, scnt, hdr, &local);
    if (st) {
        free(cnt), free(hdr), free(tr);
        return st;
    }

    /* Local checks that need the counts, and the packed send buffers. */
    uint8_t *pk = NULL;
    int64_t rb = 0, sb = 0, sent = 0;
    if (!local) {
        soff[0] = roff[0] = 0;
        for (int p = 0; p < n; p++) {
            soff[p + 1] = soff[p] + scnt[p];
            roff[p + 1] = roff[p] + hdr[p].rows;
        }
        sent = soff[n];
        if (roff[n] > out->x->shape[0])
            local = fm_error(ctx, FM_ERR_INVALID_ARG,
                             "out->x: has room for %lld rows but %lld arrive (the capacity every out tensor shares; "
                             "the sum of all ranks' tokens always suffices)",
                             (long long)out->x->shape[0], (long long)roff[n]);
        rb = row_bytes(x), sb = scale_row_bytes(x);
    }
    int64_t mb = 4 + 8 * k; /* token, k local ids, k probs */
    if (!local && !(pk = malloc((size_t)(sent * (rb + sb + mb)) + 1)))
        local = fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_ep_dispatch: out of host memory for %lld rows to send",
                         (long long)sent);
    st = agree(ctx, comm, EP_DISPATCH, local);
    if (st) {
        free(cnt), free(hdr), free(tr), free(pk);
        return st;
    }

    /* Pack by destination, tokens ascending inside each. */
    uint8_t *pd = pk, *ps = pk + sent * rb, *pt = ps + sent * sb, *pi = pt + sent * 4, *pp = pi + sent * 4 * k;
    memcpy(cur, soff, (size_t)n * sizeof *cur);
    const int32_t *ids = expert_ids->data;
    const float *pr = probs ? probs->data : NULL;
    int el = cfg->experts_per_rank;
    for (int64_t t = 0; t < T; t++) {
        int m = token_ranks(ids + t * k, k, el, tr);
        for (int i = 0; i < m; i++) {
            int p = tr[i];
            int64_t r = cur[p]++;
            memcpy(pd + r * rb, (const uint8_t *)x->data + t * rb, (size_t)rb);
            if (sb)
                memcpy(ps + r * sb, (const uint8_t *)x->scale + t * sb, (size_t)sb);
            int32_t tok = (int32_t)t;
            memcpy(pt + r * 4, &tok, 4);
            for (int64_t j = 0; j < k; j++) {
                int32_t g = ids[t * k + j];
                int here = g >= 0 && g / el == p;
                int32_t lid = here ? g - p * el : -1;
                float pv = here && pr ? pr[t * k + j] : 0.0f;
                memcpy(pi + (r * k + j) * 4, &lid, 4);
                memcpy(pp + (r * k + j) * 4, &pv, 4);
            }
        }
    }

    fm_comm_seg segs[5];
    int ns = 0;
    segs[ns++] = (fm_comm_seg){pd, out->x->data, rb};
    if (sb)
        segs[ns++] = (fm_comm_seg){ps, out->x->scale, sb};
    segs[ns++] = (fm_comm_seg){pt, out->src_token ? out->src_token->data : NULL, 4};
    segs[ns++] = (fm_comm_seg){pi, out->expert_ids ? out->expert_ids->data : NULL, 4 * k};
    if (probs)
        segs[ns++] = (fm_comm_seg){pp, out->probs ? out->probs->data : NULL, 4 * k};
    st = comm->ops->alltoallv(comm, ctx, ns, segs, soff, roff);
    free(pk), free(tr);
    if (st) {
        free(cnt), free(hdr);
        return st;
    }
    int64_t R = roff[n];
    if (out->src_rank)
        for (int p = 0; p < n; p++)
            for (int64_t r = roff[p]; r < roff[p + 1]; r++)
                ((int32_t *)out->src_rank->data)[r] = p;
    if (out->rows_from)
        for (int p = 0; p < n; p++)
            out->rows_from[p] = hdr[p].rows;
    out->rows = R;
    int64_t moved_in = R * (rb + sb), moved_out = sent * (rb + sb);
    count_op(ctx, FM_OP_EP_DISPATCH,
             moved_out + fm_tensor_nbytes(expert_ids) + (probs ? fm_tensor_nbytes(probs) : 0),
             moved_in + R * ((out->expert_ids ? 4 * k : 0) + (out->probs ? 4 * k : 0) + (out->src_rank ? 4 : 0) +
                             (out->src_token ? 4 : 0)));
    free(cnt), free(hdr);
    return FM_OK;
}

/* ---- combine ------------------------------------------------------------ */

fm_status fm_ep_combine(fm_context *ctx, fm_comm *comm, const fm_ep_config *cfg, const fm_tensor *expert_ids,
                        const fm_tensor *y, fm_tensor *out)
{
    if (!comm)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "comm: NULL; without a communicator this rank cannot tell the others (see fm_comm_abort)");
    fm_error_clear(ctx);
    int n = comm->size;
    fm_status local = check_combine(ctx, comm, cfg, expert_ids, y, out);
    int64_t *cnt = calloc((size_t)(3 * n + 2), sizeof(int64_t));
    ep_header *hdr = malloc((size_t)n * sizeof *hdr);
    int64_t T = 0, k = 1, C = 0;
    int *tr = NULL;
    if (!local) {
        T = out->shape[0], k = expert_ids->shape[1], C = y->shape[1];
        tr = malloc((size_t)k * sizeof *tr);
    }
    if (!cnt || !hdr || (!local && !tr)) {
        free(cnt), free(hdr), free(tr);
        comm->ops->abort(comm);
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_ep_combine: out of host memory for %d ranks' counts; the "
                        "group is aborted", n);
    }
    /* rows expected back from each rank, their offsets, the offsets of the
     * rows this rank sends back (the dispatch's receive offsets) */
    int64_t *want = cnt, *woff = cnt + n, *yoff = cnt + 2 * n + 1;
    ep_header mine = {EP_COMBINE, local == FM_OK, 0, 0, 0, 0, 0, 0, 0, 0};
    if (!local) {
        count_rows(expert_ids->data, T, k, cfg->experts_per_rank, tr, want, n);
        mine = (ep_header){EP_COMBINE, 1, (int32_t)y->dtype, 0, (int32_t)k, cfg->experts_per_rank, 0, 0, C, 0};
    }
    fm_status st = exchange_headers(ctx, comm, mine, want, hdr, &local);
    if (st) {
        free(cnt), free(hdr), free(tr);
        return st;
    }
    int64_t esz = 0, back = 0;
    uint8_t *rcv = NULL;
    float *acc = NULL;
    if (!local) {
        woff[0] = yoff[0] = 0;
        for (int p = 0; p < n; p++) {
            woff[p + 1] = woff[p] + want[p];
            yoff[p + 1] = yoff[p] + hdr[p].rows;
        }
        if (yoff[n] != y->shape[0])
            local = fm_error(ctx, FM_ERR_INVALID_ARG,
                             "y: has %lld rows but the other ranks expect %lld back (the rows of the matching "
                             "fm_ep_dispatch, in its order)",
                             (long long)y->shape[0], (long long)yoff[n]);
        esz = fm_dtype_bits(y->dtype) / 8;
        back = woff[n];
    }
    if (!local && ((back > 0 && !(rcv = malloc((size_t)(back * C * esz)))) ||
                   !(acc = malloc((size_t)(C > 0 ? C : 1) * 2 * sizeof(float)))))
        local = fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_ep_combine: out of host memory for %lld rows coming back",
                         (long long)back);
    st = agree(ctx, comm, EP_COMBINE, local);
    if (st) {
        free(cnt), free(hdr), free(tr), free(rcv), free(acc);
        return st;
    }
    fm_comm_seg seg = {y->data, rcv, C * esz};
    st = comm->ops->alltoallv(comm, ctx, 1, &seg, yoff, woff);
    if (st) {
        free(cnt), free(hdr), free(tr), free(rcv), free(acc);
        return st;
    }

    /* out[t] = the visited ranks' rows in ascending rank order, F32 adds. */
    const int32_t *ids = expert_ids->data;
    float *row = acc + C;
    for (int64_t t = 0; t < T; t++) {
        int m = token_ranks(ids + t * k, k, cfg->experts_per_rank, tr);
        for (int64_t h = 0; h < C; h++)
            acc[h] = 0.0f;
        for (int i = 0; i < m; i++) {
            int64_t r = woff[tr[i]]++;
            fm_cpu_load_row(rcv, y->dtype, r * C, C, row);
            for (int64_t h = 0; h < C; h++)
                acc[h] = i == 0 ? row[h] : acc[h] + row[h];
        }
        for (int64_t h = 0; h < C; h++)
            fm_cpu_store_f32(out->data, out->dtype, t * C + h, acc[h]);
    }
    count_op(ctx, FM_OP_EP_COMBINE, fm_tensor_nbytes(y) + fm_tensor_nbytes(expert_ids) + back * C * esz,
             fm_tensor_nbytes(out));
    free(cnt), free(hdr), free(tr), free(rcv), free(acc);
    return FM_OK;
}
