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
 *      capacity, combine's row count) and on allocations;
 *   3. alltoallv of the payload, only when every rank said yes.
 * Two paths share that skeleton.
 *   - Host transport (in-process): tensors in host memory; packing and the
 *     reduction are host loops.
 *   - Device transport (NCCL): tensors in the context's CUDA memory. In this
 *     first version the routing plan is still made on the host, from a copy
 *     of expert_ids (T x k I32) that the call waits for before the header
 *     exchange: every call synchronises with the context's stream there (and
 *     waits again for the headers and the verdict). The rows themselves never
 *     leave the device: a gather kernel packs the rows to send, grouped by
 *     destination, into the transport's staging memory, and the
 *     all-to-all-v writes the received rows straight into out->x, already in
 *     the contract's order (each sender packs its tokens ascending). Combine
 *     sends y as it is (its rows are grouped by source rank in dispatch
 *     order) and a kernel adds the rows that come back in the fixed order
 *     (backends/cuda/ep_*.cu). Only the plan (send row -> token and
 *     destination; token -> returned rows) goes from host to device. A CUDA
 *     failure after the verdict breaks this rank's transport and leaves its
 *     peers without its rows: abort every rank then. */
#include <stdlib.h>
#include <string.h>

#include "../backends/cpu/cpu.h"
#include "../backends/cuda/ep.h"
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

#ifndef FM_HAVE_NCCL
fm_status fm_comm_create_nccl(fm_context *ctx, void *nccl_comm, fm_comm **out)
{
    (void)nccl_comm;
    if (out)
        *out = NULL;
    return fm_error(ctx, FM_ERR_UNSUPPORTED,
                    "fm_comm_create_nccl: this flowmoe was built without NCCL (meson option nccl, which needs "
                    "the CUDA backend); use fm_comm_create_inproc for in-process ranks");
}
#endif

#ifndef FM_HAVE_CUDA
/* Builds without CUDA have no device transport: the device path's hooks
 * answer "not here". */
fm_status fm_cuda_ep_copy(fm_context *ctx, void *dst, const void *src, size_t bytes, const char *what)
{
    (void)dst, (void)src, (void)bytes;
    return fm_error(ctx, FM_ERR_UNSUPPORTED, "%s: this flowmoe was built without CUDA", what);
}
fm_status fm_cuda_ep_pack(fm_context *ctx, const fm_ep_pack *a)
{
    (void)a;
    return fm_error(ctx, FM_ERR_UNSUPPORTED, "fm_ep_dispatch: this flowmoe was built without CUDA");
}
fm_status fm_cuda_ep_fill_src_rank(fm_context *ctx, int32_t *src_rank, const int64_t *roff, int n, int64_t rows)
{
    (void)src_rank, (void)roff, (void)n, (void)rows;
    return fm_error(ctx, FM_ERR_UNSUPPORTED, "fm_ep_dispatch: this flowmoe was built without CUDA");
}
fm_status fm_cuda_ep_sum(fm_context *ctx, const void *recv, fm_dtype ydt, const int32_t *toff, const int32_t *rows,
                         int64_t T, int64_t C, void *out, fm_dtype odt)
{
    (void)recv, (void)ydt, (void)toff, (void)rows, (void)T, (void)C, (void)out, (void)odt;
    return fm_error(ctx, FM_ERR_UNSUPPORTED, "fm_ep_combine: this flowmoe was built without CUDA");
}
#endif

/* ---- routing ------------------------------------------------------------- */

static int lowest_bit(uint64_t v)
{
#if defined(__GNUC__)
    return __builtin_ctzll(v);
#else
    int i = 0;
    for (; !(v & 1); v >>= 1)
        i++;
    return i;
#endif
}

/* The ranks every token visits, found once per call (the call walks them
 * two or three times, and this host work sits between the GPU and the
 * exchange on a device transport): token t visits the distinct ranks
 * vis[t kn + i], i < nv[t], ascending (kn = min(k, nranks)); -1 choices go
 * nowhere. A bit per rank in `bits` sorts and dedups them. */
typedef struct {
    int *vis, *nv;
    int64_t kn;
    uint64_t *bits; /* [ceil(nranks / 64)], zero between tokens */
} visits;

static int visits_alloc(visits *v, int64_t T, int64_t k, int n)
{
    v->kn = k < n ? k : n;
    v->vis = malloc((size_t)(T * v->kn + T + 1) * sizeof *v->vis);
    v->nv = v->vis ? v->vis + T * v->kn : NULL;
    v->bits = calloc((size_t)(n + 63) / 64, sizeof *v->bits);
    return v->vis && v->bits;
}

static void visits_free(visits *v)
{
    free(v->vis);
    free(v->bits);
}

static void find_visits(const int32_t *ids, int64_t T, int64_t k, int e_local, int n, const visits *v)
{
    int nw = (n + 63) / 64;
    for (int64_t t = 0; t < T; t++) {
        const int32_t *row = ids + t * k;
        int *out = v->vis + t * v->kn, m = 0;
        for (int64_t j = 0; j < k; j++)
            if (row[j] >= 0) {
                int p = row[j] / e_local;
                v->bits[p / 64] |= 1ull << (p % 64);
            }
        for (int w = 0; w < nw; w++) {
            for (uint64_t b = v->bits[w]; b; b &= b - 1)
                out[m++] = w * 64 + lowest_bit(b);
            v->bits[w] = 0;
        }
        v->nv[t] = m;
    }
}

/* Rows this rank sends to each peer: counts[p] tokens visit p. */
static void count_rows(const visits *v, int64_t T, int64_t *counts, int n)
{
    for (int p = 0; p < n; p++)
        counts[p] = 0;
    for (int64_t t = 0; t < T; t++)
        for (int i = 0; i < v->nv[t]; i++)
            counts[v->vis[t * v->kn + i]]++;
}

/* The send plan: rows grouped by destination (soff [n + 1]), tokens
 * ascending inside each; send row r is token tok[r] bound for rank dst[r].
 * cur [n] is scratch. */
static void plan_rows(const visits *v, int64_t T, const int64_t *soff, int64_t *cur, int n, int32_t *tok,
                      int32_t *dst)
{
    memcpy(cur, soff, (size_t)n * sizeof *cur);
    for (int64_t t = 0; t < T; t++)
        for (int i = 0; i < v->nv[t]; i++) {
            int p = v->vis[t * v->kn + i];
            int64_t r = cur[p]++;
            tok[r] = (int32_t)t;
            dst[r] = p;
        }
}

/* Offsets into staged memory: regions start 256 bytes apart at least, so
 * every region is as aligned as the staging itself. */
static size_t stage_al(int64_t bytes) { return ((size_t)bytes + 255) & ~(size_t)255; }

/* The dispatch plan as it goes to the device: roff [n + 1] I64, then tok
 * and dst [rows] I32 (the host path keeps only tok and dst). */
static size_t plan_bytes(int n, int64_t rows) { return stage_al(8 * (n + 1)) + 2 * stage_al(4 * rows); }

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
    if (comm->ops->check_ctx && (st = comm->ops->check_ctx(comm, ctx)))
        return st;
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
    return FM_OK;
}

/* The ids' values (on the host), once the descriptor is known to be good. */
static fm_status check_ids(fm_context *ctx, const int32_t *ids, int64_t T, int64_t k, int64_t E)
{
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
        comm->ops->fail(comm);
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

/* ---- the routing on the host ------------------------------------------- */

/* expert_ids' values on the host, checked: the tensor itself for a host
 * transport; for a device transport, a copy in the transport's pinned
 * staging with `extra` bytes after it for the caller's plan (*hplan), which
 * waits for the context's stream. Returns the transport's status (not
 * FM_OK: the group is gone, return at once); a local failure goes to
 * *local. */
static fm_status routing_on_host(fm_context *ctx, fm_comm *comm, const fm_ep_config *cfg, const fm_tensor *expert_ids,
                                 size_t extra, const int32_t **ids, uint8_t **hplan, fm_status *local)
{
    int64_t T = expert_ids->shape[0], k = expert_ids->shape[1];
    if (comm->device == FM_DEVICE_HOST) {
        *ids = expert_ids->data;
    } else {
        size_t nb = (size_t)(T * k) * 4;
        void *h = NULL;
        if ((*local = comm->ops->stage(comm, ctx, FM_DEVICE_HOST, stage_al((int64_t)nb) + extra, &h)))
            return FM_OK;
        if (nb && (*local = fm_cuda_ep_copy(ctx, h, expert_ids->data, nb, "fm_ep: expert_ids to the host")))
            return FM_OK;
        fm_status st = comm->ops->sync(comm, ctx);
        if (st)
            return st;
        *ids = h;
        *hplan = (uint8_t *)h + stage_al((int64_t)nb);
    }
    *local = check_ids(ctx, *ids, T, k, (int64_t)cfg->experts_per_rank * comm->size);
    return FM_OK;
}

/* ---- dispatch ------------------------------------------------------------- */

/* The host path's payload: rows, scales, token, k local ids, k probs per
 * send row, each stream contiguous. */
typedef struct {
    uint8_t *pd, *ps, *pt, *pi, *pp;
} host_pack;

static void pack_host(const fm_tensor *x, const int32_t *ids, const float *pr, int64_t k, int el, int64_t rb,
                      int64_t sb, const int32_t *tok, const int32_t *dst, int64_t sent, const host_pack *h)
{
    for (int64_t r = 0; r < sent; r++) {
        int64_t t = tok[r];
        int p = dst[r];
        memcpy(h->pd + r * rb, (const uint8_t *)x->data + t * rb, (size_t)rb);
        if (sb)
            memcpy(h->ps + r * sb, (const uint8_t *)x->scale + t * sb, (size_t)sb);
        int32_t tk = (int32_t)t;
        memcpy(h->pt + r * 4, &tk, 4);
        for (int64_t j = 0; j < k; j++) {
            int32_t g = ids[t * k + j];
            int here = g >= 0 && g / el == p;
            int32_t lid = here ? g - p * el : -1;
            float pv = here && pr ? pr[t * k + j] : 0.0f;
            memcpy(h->pi + (r * k + j) * 4, &lid, 4);
            memcpy(h->pp + (r * k + j) * 4, &pv, 4);
        }
    }
}

/* The device path's staging: the plan (as plan_bytes lays it out), the
 * send streams, and where the streams this rank did not ask for land. */
typedef struct {
    size_t plan, pd, ps, pt, pi, pp, rt, ri, rp, total;
} dev_layout;

static dev_layout dispatch_layout(int n, int64_t sent, int64_t R, int64_t rb, int64_t sb, int64_t k, int has_probs,
                                  const fm_ep_dispatch_out *out)
{
    dev_layout l;
    size_t at = 0;
    l.plan = at, at += plan_bytes(n, sent);
    l.pd = at, at += stage_al(sent * rb);
    l.ps = at, at += stage_al(sent * sb);
    l.pt = at, at += stage_al(sent * 4);
    l.pi = at, at += stage_al(sent * 4 * k);
    l.pp = at, at += has_probs ? stage_al(sent * 4 * k) : 0;
    l.rt = at, at += out->src_token ? 0 : stage_al(R * 4);
    l.ri = at, at += out->expert_ids ? 0 : stage_al(R * 4 * k);
    l.rp = at, at += has_probs && !out->probs ? stage_al(R * 4 * k) : 0;
    l.total = at;
    return l;
}

/* The device path after the verdict: the plan to the device, pack, the
 * exchange into the outputs, src_rank. Returns the transport's status;
 * a CUDA failure breaks the transport too (the peers miss this rank's
 * rows, see the header comment). */
static fm_status dispatch_device(fm_context *ctx, fm_comm *comm, const fm_ep_config *cfg, const fm_tensor *x,
                                 const fm_tensor *expert_ids, const fm_tensor *probs, fm_ep_dispatch_out *out,
                                 const int64_t *soff, const int64_t *roff, uint8_t *hplan, uint8_t *stage,
                                 const dev_layout *l, int64_t rb, int64_t sb)
{
    int n = comm->size;
    int64_t k = expert_ids->shape[1], sent = soff[n], R = roff[n];
    uint8_t *dplan = stage + l->plan;
    const int32_t *dtok = (const int32_t *)(dplan + stage_al(8 * (n + 1)));
    fm_ep_pack a = {.x = x->data, .xs = x->scale, .rb = rb, .sb = sb, .ids = expert_ids->data,
                    .probs = probs ? probs->data : NULL, .k = k, .e_local = cfg->experts_per_rank, .tok = dtok,
                    .dst = dtok + stage_al(4 * sent) / 4, .rows = sent, .pd = stage + l->pd, .ps = stage + l->ps,
                    .pt = (int32_t *)(stage + l->pt), .pi = (int32_t *)(stage + l->pi),
                    .pp = probs ? (float *)(stage + l->pp) : NULL};
    fm_status st = fm_cuda_ep_copy(ctx, dplan, hplan, plan_bytes(n, sent), "fm_ep_dispatch: the plan to the device");
    if (!st)
        st = fm_cuda_ep_pack(ctx, &a);
    if (st) {
        comm->ops->fail(comm);
        comm->ops->done(comm, ctx);
        return st;
    }
    fm_comm_seg segs[5];
    int ns = 0;
    segs[ns++] = (fm_comm_seg){stage + l->pd, out->x->data, rb};
    if (sb)
        segs[ns++] = (fm_comm_seg){stage + l->ps, out->x->scale, sb};
    segs[ns++] = (fm_comm_seg){stage + l->pt, out->src_token ? out->src_token->data : stage + l->rt, 4};
    segs[ns++] = (fm_comm_seg){stage + l->pi, out->expert_ids ? out->expert_ids->data : stage + l->ri, 4 * k};
    if (probs)
        segs[ns++] = (fm_comm_seg){stage + l->pp, out->probs ? out->probs->data : stage + l->rp, 4 * k};
    st = comm->ops->alltoallv(comm, ctx, ns, segs, soff, roff);
    if (!st && out->src_rank && (st = fm_cuda_ep_fill_src_rank(ctx, out->src_rank->data, (const int64_t *)dplan, n,
                                                                R)))
        comm->ops->fail(comm);
    comm->ops->done(comm, ctx);
    return st;
}

fm_status fm_ep_dispatch(fm_context *ctx, fm_comm *comm, const fm_ep_config *cfg, const fm_tensor *x,
                         const fm_tensor *expert_ids, const fm_tensor *probs, fm_ep_dispatch_out *out)
{
    if (!comm)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "comm: NULL; without a communicator this rank cannot tell the others (see fm_comm_abort)");
    fm_error_clear(ctx);
    int n = comm->size, dev = comm->device == FM_DEVICE_CUDA;
    fm_status local = check_dispatch(ctx, comm, cfg, x, expert_ids, probs, out);
    int64_t *cnt = calloc((size_t)(4 * n + 2), sizeof(int64_t));
    ep_header *hdr = malloc((size_t)n * sizeof *hdr);
    int64_t T = 0, k = 1, H = 0;
    visits v = {NULL, NULL, 1, NULL};
    int have_v = 1;
    if (!local) {
        T = x->shape[0], k = expert_ids->shape[1], H = x->shape[1];
        have_v = visits_alloc(&v, T, k, n);
    }
    if (!cnt || !hdr || !have_v) {
        free(cnt), free(hdr), visits_free(&v);
        comm->ops->fail(comm);
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_ep_dispatch: out of host memory for %d ranks' counts; the "
                        "group is aborted", n);
    }
    /* send counts, send offsets [n + 1], receive offsets [n + 1], pack cursors */
    int64_t *scnt = cnt, *soff = cnt + n, *roff = cnt + 2 * n + 1, *cur = cnt + 3 * n + 2;
    const int32_t *ids = NULL;
    uint8_t *hplan = NULL;
    fm_status st = FM_OK;
    if (!local)
        st = routing_on_host(ctx, comm, cfg, expert_ids, plan_bytes(n, T * v.kn), &ids, &hplan, &local);
    if (st) {
        free(cnt), free(hdr), visits_free(&v);
        return st;
    }
    ep_header mine = {EP_DISPATCH, local == FM_OK, 0, 0, 0, 0, 0, 0, 0, 0};
    if (!local) {
        find_visits(ids, T, k, cfg->experts_per_rank, n, &v);
        count_rows(&v, T, scnt, n);
        mine = (ep_header){EP_DISPATCH, 1, (int32_t)x->dtype, (int32_t)x->scale_mode, (int32_t)k,
                           cfg->experts_per_rank, probs != NULL, 0, H, 0};
    }
    st = exchange_headers(ctx, comm, mine, scnt, hdr, &local);
    if (st) {
        free(cnt), free(hdr), visits_free(&v);
        return st;
    }

    /* Local checks that need the counts, and the send buffers. */
    int64_t rb = 0, sb = 0, sent = 0, R = 0;
    if (!local) {
        soff[0] = roff[0] = 0;
        for (int p = 0; p < n; p++) {
            soff[p + 1] = soff[p] + scnt[p];
            roff[p + 1] = roff[p] + hdr[p].rows;
        }
        sent = soff[n], R = roff[n];
        if (R > out->x->shape[0])
            local = fm_error(ctx, FM_ERR_INVALID_ARG,
                             "out->x: has room for %lld rows but %lld arrive (the capacity every out tensor shares; "
                             "the sum of all ranks' tokens always suffices)",
                             (long long)out->x->shape[0], (long long)R);
        rb = row_bytes(x), sb = scale_row_bytes(x);
    }
    int64_t mb = 8 + 4 + 8 * k; /* host path: the plan (token, destination), token, k local ids, k probs */
    uint8_t *pk = NULL, *stage = NULL;
    dev_layout l = {0};
    if (!local && dev) {
        void *p = NULL;
        l = dispatch_layout(n, sent, R, rb, sb, k, probs != NULL, out);
        local = comm->ops->stage(comm, ctx, FM_DEVICE_CUDA, l.total, &p);
        stage = p;
    } else if (!local && !(pk = malloc((size_t)(sent * (rb + sb + mb)) + 1))) {
        local = fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_ep_dispatch: out of host memory for %lld rows to send",
                         (long long)sent);
    }
    st = agree(ctx, comm, EP_DISPATCH, local);
    if (st) {
        free(cnt), free(hdr), visits_free(&v), free(pk);
        return st;
    }

    /* The plan: by destination, tokens ascending inside each. */
    if (dev) {
        memcpy(hplan, roff, (size_t)(n + 1) * sizeof *roff);
        int32_t *tok = (int32_t *)(hplan + stage_al(8 * (n + 1)));
        plan_rows(&v, T, soff, cur, n, tok, tok + stage_al(4 * sent) / 4);
        st = dispatch_device(ctx, comm, cfg, x, expert_ids, probs, out, soff, roff, hplan, stage, &l, rb, sb);
    } else {
        int32_t *tok = (int32_t *)pk, *dst = tok + sent;
        host_pack h;
        h.pd = pk + sent * 8, h.ps = h.pd + sent * rb, h.pt = h.ps + sent * sb, h.pi = h.pt + sent * 4;
        h.pp = h.pi + sent * 4 * k;
        plan_rows(&v, T, soff, cur, n, tok, dst);
        pack_host(x, ids, probs ? probs->data : NULL, k, cfg->experts_per_rank, rb, sb, tok, dst, sent, &h);
        fm_comm_seg segs[5];
        int ns = 0;
        segs[ns++] = (fm_comm_seg){h.pd, out->x->data, rb};
        if (sb)
            segs[ns++] = (fm_comm_seg){h.ps, out->x->scale, sb};
        segs[ns++] = (fm_comm_seg){h.pt, out->src_token ? out->src_token->data : NULL, 4};
        segs[ns++] = (fm_comm_seg){h.pi, out->expert_ids ? out->expert_ids->data : NULL, 4 * k};
        if (probs)
            segs[ns++] = (fm_comm_seg){h.pp, out->probs ? out->probs->data : NULL, 4 * k};
        st = comm->ops->alltoallv(comm, ctx, ns, segs, soff, roff);
        if (!st && out->src_rank)
            for (int p = 0; p < n; p++)
                for (int64_t r = roff[p]; r < roff[p + 1]; r++)
                    ((int32_t *)out->src_rank->data)[r] = p;
    }
    free(pk), visits_free(&v);
    if (st) {
        free(cnt), free(hdr);
        return st;
    }
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

/* The device path after the verdict: for each token the rows that come back
 * for it (CSR: toff [T + 1], then the rows, ascending rank) to the device,
 * the exchange of y into the staging, the sum into out. */
static fm_status combine_device(fm_context *ctx, fm_comm *comm, const visits *v, const fm_tensor *y, fm_tensor *out,
                                const int64_t *yoff, const int64_t *woff, int64_t *cur, uint8_t *hplan, uint8_t *stage,
                                size_t recv_bytes)
{
    int n = comm->size;
    int64_t T = out->shape[0], C = y->shape[1];
    int32_t *toff = (int32_t *)hplan, *rows = (int32_t *)(hplan + stage_al(4 * (T + 1)));
    memcpy(cur, woff, (size_t)n * sizeof *cur);
    int32_t at = 0;
    for (int64_t t = 0; t < T; t++) {
        toff[t] = at;
        for (int i = 0; i < v->nv[t]; i++)
            rows[at++] = (int32_t)cur[v->vis[t * v->kn + i]]++;
    }
    toff[T] = at;
    uint8_t *recv = stage, *dcsr = stage + recv_bytes;
    const int32_t *dtoff = (const int32_t *)dcsr, *drows = (const int32_t *)(dcsr + stage_al(4 * (T + 1)));
    fm_status st = fm_cuda_ep_copy(ctx, dcsr, hplan, stage_al(4 * (T + 1)) + stage_al(4 * (int64_t)at),
                                   "fm_ep_combine: the plan to the device");
    if (st) {
        comm->ops->fail(comm);
        comm->ops->done(comm, ctx);
        return st;
    }
    fm_comm_seg seg = {y->data, recv, C * (fm_dtype_bits(y->dtype) / 8)};
    st = comm->ops->alltoallv(comm, ctx, 1, &seg, yoff, woff);
    if (!st && (st = fm_cuda_ep_sum(ctx, recv, y->dtype, dtoff, drows, T, C, out->data, out->dtype)))
        comm->ops->fail(comm);
    comm->ops->done(comm, ctx);
    return st;
}

fm_status fm_ep_combine(fm_context *ctx, fm_comm *comm, const fm_ep_config *cfg, const fm_tensor *expert_ids,
                        const fm_tensor *y, fm_tensor *out)
{
    if (!comm)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "comm: NULL; without a communicator this rank cannot tell the others (see fm_comm_abort)");
    fm_error_clear(ctx);
    int n = comm->size, dev = comm->device == FM_DEVICE_CUDA;
    fm_status local = check_combine(ctx, comm, cfg, expert_ids, y, out);
    int64_t *cnt = calloc((size_t)(4 * n + 2), sizeof(int64_t));
    ep_header *hdr = malloc((size_t)n * sizeof *hdr);
    int64_t T = 0, k = 1, C = 0;
    visits v = {NULL, NULL, 1, NULL};
    int have_v = 1;
    if (!local) {
        T = out->shape[0], k = expert_ids->shape[1], C = y->shape[1];
        have_v = visits_alloc(&v, T, k, n);
    }
    if (!cnt || !hdr || !have_v) {
        free(cnt), free(hdr), visits_free(&v);
        comm->ops->fail(comm);
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_ep_combine: out of host memory for %d ranks' counts; the "
                        "group is aborted", n);
    }
    /* rows expected back from each rank, their offsets, the offsets of the
     * rows this rank sends back (the dispatch's receive offsets), cursors */
    int64_t *want = cnt, *woff = cnt + n, *yoff = cnt + 2 * n + 1, *cur = cnt + 3 * n + 2;
    const int32_t *ids = NULL;
    uint8_t *hplan = NULL;
    fm_status st = FM_OK;
    if (!local)
        st = routing_on_host(ctx, comm, cfg, expert_ids, stage_al(4 * (T + 1)) + stage_al(4 * T * v.kn), &ids, &hplan,
                             &local);
    if (st) {
        free(cnt), free(hdr), visits_free(&v);
        return st;
    }
    ep_header mine = {EP_COMBINE, local == FM_OK, 0, 0, 0, 0, 0, 0, 0, 0};
    if (!local) {
        find_visits(ids, T, k, cfg->experts_per_rank, n, &v);
        count_rows(&v, T, want, n);
        mine = (ep_header){EP_COMBINE, 1, (int32_t)y->dtype, 0, (int32_t)k, cfg->experts_per_rank, 0, 0, C, 0};
    }
    st = exchange_headers(ctx, comm, mine, want, hdr, &local);
    if (st) {
        free(cnt), free(hdr), visits_free(&v);
        return st;
    }
    int64_t esz = 0, back = 0;
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
        if (!local && dev && back > INT32_MAX)
            local = fm_error(ctx, FM_ERR_INVALID_ARG,
                             "expert_ids: %lld rows would come back; the device path indexes them as I32 (< 2^31)",
                             (long long)back);
    }
    uint8_t *rcv = NULL, *stage = NULL;
    float *acc = NULL;
    size_t recv_bytes = stage_al(back * C * esz);
    if (!local && dev) {
        void *p = NULL;
        local = comm->ops->stage(comm, ctx, FM_DEVICE_CUDA,
                                 recv_bytes + stage_al(4 * (T + 1)) + stage_al(4 * back), &p);
        stage = p;
    } else if (!local && ((back > 0 && !(rcv = malloc((size_t)(back * C * esz)))) ||
                          !(acc = malloc((size_t)(C > 0 ? C : 1) * 2 * sizeof(float))))) {
        local = fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_ep_combine: out of host memory for %lld rows coming back",
                         (long long)back);
    }
    st = agree(ctx, comm, EP_COMBINE, local);
    if (st) {
        free(cnt), free(hdr), visits_free(&v), free(rcv), free(acc);
        return st;
    }
    if (dev) {
        st = combine_device(ctx, comm, &v, y, out, yoff, woff, cur, hplan, stage, recv_bytes);
    } else {
        fm_comm_seg seg = {y->data, rcv, C * esz};
        st = comm->ops->alltoallv(comm, ctx, 1, &seg, yoff, woff);
        /* out[t] = the visited ranks' rows in ascending rank order, F32 adds. */
        float *row = acc + C;
        for (int64_t t = 0; t < T && !st; t++) {
            for (int64_t h = 0; h < C; h++)
                acc[h] = 0.0f;
            for (int i = 0; i < v.nv[t]; i++) {
                int64_t r = woff[v.vis[t * v.kn + i]]++;
                fm_cpu_load_row(rcv, y->dtype, r * C, C, row);
                for (int64_t h = 0; h < C; h++)
                    acc[h] = i == 0 ? row[h] : acc[h] + row[h];
            }
            for (int64_t h = 0; h < C; h++)
                fm_cpu_store_f32(out->data, out->dtype, t * C + h, acc[h]);
        }
    }
    free(cnt), free(hdr), visits_free(&v), free(rcv), free(acc);
    if (st)
        return st;
    count_op(ctx, FM_OP_EP_COMBINE, fm_tensor_nbytes(y) + fm_tensor_nbytes(expert_ids) + back * C * esz,
             fm_tensor_nbytes(out));
    return FM_OK;
}
