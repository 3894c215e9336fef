/* The MoE layer: forward and backward of four recipes composed from the
 * public ops, so it runs on every backend that implements them and its casts
 * are counted by the same statistics as any caller's. */
#include <stdlib.h>
#include <string.h>

#include "validate.h"

#define PAD_FP8 128

/* One buffer of the layer's working memory. */
typedef struct lbuf {
    void *p;
    int64_t bytes;
} lbuf;

/* A quantized (or plain) matrix: data and scales. */
typedef struct qbuf {
    lbuf d, s;
} qbuf;

struct fm_moe_layer {
    fm_context *ctx;
    fm_moe_layer_config cfg;
    fm_dtype act_dt;           /* FP8 element dtype of activations and gradients */
    void *mem;                 /* the one allocation everything below is carved from */
    int64_t mem_bytes;
    int64_t *host_splits;      /* [E] padded rows per expert of the last forward (host) */
    int64_t T, R;              /* tokens and used rows of the last forward */
    int have_forward, have_weights;
    int queues;                /* backward uses the context's second queue (fm_queue_select) */
    fm_moe_layer_info info;
    /* expert parallelism: nranks 1 and El = experts without a comm */
    int nranks;
    int64_t El;                /* local experts */
    int64_t cap;               /* rows a rank can receive: nranks * max_tokens */
    int64_t Rr;                /* rows received by the last forward (T without a comm) */

    /* routing */
    lbuf logits, ids, probs, tpe, row_map, slot_rows, splits, rprobs, ones, dprobs, dprobs_rows, dlogits, scratch1;
    /* expert parallelism: received ids [cap, k] (local), probs, d(probs); the
     * BF16 partial sums sent back (y, then dx) */
    lbuf rids, rprobk, dprobk;
    qbuf yr;
    qbuf xr, xin4, xr4;        /* received x (payload format); fp4: x and received x in MXFP4 (xr4 kept for backward) */
    qbuf dyr;                  /* received dy */
    /* weights (refreshed) */
    qbuf w1, w1t, w2, w2t;     /* BF16: w*t are transposed copies; FP8: 128x128 row-wise and column-wise */
    /* forward */
    qbuf xin;                  /* x before dispatch: BF16, or FP8 (flow recipes) */
    qbuf xp;                   /* dispatched rows: BF16 or FP8 */
    qbuf xp4;                  /* fp4 with top-k 1 on one rank (!x_rows): xp in MXFP4, what backward keeps */
    qbuf xp8;                  /* blockwise: row-wise FP8 of xp */
    qbuf xcol;                 /* grouped column-wise FP8 of xp (blockwise saves it; flow makes it in backward) */
    qbuf a;                    /* fc1 output, BF16 [R, 2I] */
    qbuf asv;                  /* flow: a quantized in the SwiGLU pass (FP8 or MXFP4), saved */
    qbuf h;                    /* SwiGLU output: BF16 (bf16, blockwise) */
    qbuf hq;                   /* FP8 row-wise SwiGLU output (flow: kept for backward unless cfg.recompute_h) */
    qbuf hcol;                 /* grouped column-wise FP8 of h */
    qbuf yp;                   /* fc2 output, BF16 [R, H] */
    /* backward */
    qbuf dyin;                 /* dy before dispatch: BF16 or FP8 */
    qbuf dyp, dyq, dycol, dh, da, daq, dacol, dxp;
};

static int is_fp8(fm_recipe r) { return r != FM_RECIPE_BF16; }
static int is_flow(fm_recipe r) { return r == FM_RECIPE_FP8_FLOW || r == FM_RECIPE_FP8_FLOW_FP4; }
/* fp8-flow keeps x for backward as its T token rows (the permute's input),
 * not as the T·k + padding permuted rows: the weight gradient's column copy
 * reads them through row_map (fm_transpose_scaled_grouped_rows), 212 MB
 * less kept at T 4096, H 7168, k 8, in the time the permuted rows' takes
 * (S12-12). dy keeps the plain transpose: the data gradient needs its
 * permuted rows anyway, so there is nothing to save. The CUDA kernel reads
 * rows in 16-byte pieces.
 * fp8-flow-fp4 reads them too, where they hold what the GEMM read in fewer
 * bytes than the T·k + padding permuted rows in MXFP4 (H (1/2 + 1/32) bytes
 * each), which rounded it once more: on one rank with top-k >= 2 the T FP8
 * token rows (H (1 + 4/128) each); over expert parallelism the MXFP4 rows
 * the rank received (never more rows than it permutes), kept as they came
 * and turned into FP8 again in backward, as the forward did. */
static int x_rows(const fm_moe_layer_config *c)
{
    if (c->hidden % 16)
        return 0;
    return c->recipe == FM_RECIPE_FP8_FLOW ||
           (c->recipe == FM_RECIPE_FP8_FLOW_FP4 && (c->comm || c->topk >= 2));
}

/* Where x_rows holds: fp8-flow-fp4 over expert parallelism, whose backward
 * takes x's rows from the MXFP4 rows received (L->xr4), not from the FP8
 * rows made of them. */
static int x_rows_fp4(const fm_moe_layer_config *c) { return c->recipe == FM_RECIPE_FP8_FLOW_FP4 && c->comm; }

const char *fm_recipe_name(fm_recipe r)
{
    switch (r) {
    case FM_RECIPE_BF16: return "bf16";
    case FM_RECIPE_FP8_BLOCKWISE: return "fp8-blockwise";
    case FM_RECIPE_FP8_FLOW: return "fp8-flow";
    case FM_RECIPE_FP8_FLOW_FP4: return "fp8-flow-fp4";
    default: return "unknown";
    }
}

int fm_recipe_parse(const char *name, fm_recipe *out)
{
    if (!name || !out)
        return 0;
    for (int r = 0; r < FM_RECIPE_COUNT; r++)
        if (!strcmp(name, fm_recipe_name((fm_recipe)r))) {
            *out = (fm_recipe)r;
            return 1;
        }
    return 0;
}

/* ---- sizes ---------------------------------------------------------------- */

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static int pad_of(const fm_moe_layer_config *c)
{
    if (c->pad_multiple > 0)
        return c->pad_multiple;
    return is_fp8(c->recipe) ? PAD_FP8 : 1;
}

/* Ranks, local experts and receive capacity from the config (checked). */
static void ep_shape(fm_moe_layer *L)
{
    L->nranks = L->cfg.comm ? fm_comm_size(L->cfg.comm) : 1;
    L->El = L->cfg.experts / L->nranks;
    L->cap = L->nranks * L->cfg.max_tokens;
}

/* Rows of the permuted buffers: every routed slot a rank can receive (all
 * ranks' tokens, k each) plus each local expert's padding. */
static int64_t max_rows(const fm_moe_layer *L)
{
    return L->nranks * L->cfg.max_tokens * L->cfg.topk + L->El * (pad_of(&L->cfg) - 1);
}

/* Element bytes of an [rows, cols] matrix. */
static int64_t mat_bytes(fm_dtype dt, int64_t rows, int64_t cols) { return rows * cols * fm_dtype_bits(dt) / 8; }

/* Scale bytes of a row-wise [rows, cols] matrix (compact), or of a grouped
 * column-wise one (at most `groups` extra partial blocks per stored row). */
static int64_t row_scale_bytes(fm_scale_mode m, int64_t rows, int64_t cols)
{
    if (m == FM_SCALE_MX32)
        return rows * fm_cdiv(cols, 32);
    if (m == FM_SCALE_BLOCK_1x128)
        return rows * fm_cdiv(cols, 128) * 4;
    return 0;
}

/* Grouped column-wise FP8 holds either scale mode gcol8 is given, in the GEMM
 * layout: 1x128 (round_up(cols, 4) per 128 rows of a group) or 128x128
 * (4-padded block columns per group). */
static int64_t gcol_scale_bytes(fm_scale_mode m, int64_t rows, int64_t cols, int64_t groups)
{
    if (m == FM_SCALE_MX32)
        return cols * (rows / 32 + groups);
    int64_t b1 = fm_round_up(cols, 4) * (rows / 128 + groups);
    int64_t b128 = fm_cdiv(cols, 128) * (rows / 128 + 4 * groups);
    return 4 * max64(b1, b128);
}

typedef struct planner {
    uint8_t *base; /* NULL while sizing */
    int64_t off;
} planner;

static lbuf take(planner *p, int64_t bytes)
{
    lbuf b = {NULL, bytes};
    if (bytes <= 0)
        return (lbuf){NULL, 0};
    if (p->base)
        b.p = p->base + p->off;
    p->off += (bytes + 255) & ~(int64_t)255;
    return b;
}

static qbuf take_q(planner *p, fm_dtype dt, fm_scale_mode m, int64_t rows, int64_t cols)
{
    qbuf q;
    q.d = take(p, mat_bytes(dt, rows, cols));
    q.s = take(p, row_scale_bytes(m, rows, cols));
    return q;
}

static qbuf take_gcol(planner *p, fm_dtype dt, fm_scale_mode m, int64_t rows, int64_t cols, int64_t groups)
{
    qbuf q;
    q.d = take(p, mat_bytes(dt, rows, cols));
    q.s = take(p, gcol_scale_bytes(m, rows, cols, groups));
    return q;
}

/* Lays out (or sizes, with base NULL) every buffer a recipe uses. */
static void plan(fm_moe_layer *L, planner *p)
{
    const fm_moe_layer_config *c = &L->cfg;
    int64_t T = c->max_tokens, Eg = c->experts, H = c->hidden, I = c->ffn, k = c->topk, R = max_rows(L);
    int64_t E = L->El, C = L->cap; /* local experts; rows received (T on one rank) */
    fm_recipe rc = c->recipe;
    const fm_dtype B = FM_DTYPE_BF16, Q = FM_DTYPE_E4M3, F4 = FM_DTYPE_E2M1;
    const fm_scale_mode S = FM_SCALE_BLOCK_1x128, MX = FM_SCALE_MX32;

    L->logits = take(p, T * Eg * 4);
    L->ids = take(p, T * k * 4);
    L->probs = take(p, T * k * 4);
    L->tpe = take(p, Eg * 8);
    L->row_map = take(p, R * 4);
    L->slot_rows = take(p, C * k * 4);
    L->splits = take(p, E * 8);
    L->rprobs = take(p, R * 4);
    L->ones = take(p, C * 4);
    L->dprobs = take(p, T * k * 4);
    L->dprobs_rows = take(p, R * 4);
    L->dlogits = take(p, T * Eg * 4);
    L->scratch1 = take(p, R * 4);
    if (c->comm) {
        int fp8_payload = is_flow(rc);
        L->rids = take(p, C * k * 4);
        L->rprobk = take(p, C * k * 4);
        L->dprobk = take(p, C * k * 4);
        L->yr = take_q(p, B, FM_SCALE_NONE, C, H);
        L->xr = fp8_payload ? take_q(p, Q, S, C, H) : take_q(p, B, FM_SCALE_NONE, C, H);
        L->dyr = fp8_payload ? take_q(p, Q, S, C, H) : take_q(p, B, FM_SCALE_NONE, C, H);
        if (rc == FM_RECIPE_FP8_FLOW_FP4) {
            L->xin4 = take_q(p, F4, MX, T, H);
            L->xr4 = take_q(p, F4, MX, C, H);
        }
    }

    if (rc == FM_RECIPE_BF16) {
        L->w1 = take_q(p, B, FM_SCALE_NONE, E * 2 * I, H);
        L->w1t = take_q(p, B, FM_SCALE_NONE, E * H, 2 * I);
        L->w2 = take_q(p, B, FM_SCALE_NONE, E * H, I);
        L->w2t = take_q(p, B, FM_SCALE_NONE, E * I, H);
    } else {
        /* GEMM-layout 128x128 scales, in either orientation (q3) */
        const fm_scale_mode W = FM_SCALE_BLOCK_128x128;
        const fm_scale_layout G = FM_SCALE_LAYOUT_GEMM;
        int64_t b1 = E * 4 * max64(fm_scale_count_2d(W, G, 2 * I, H), fm_scale_count_2d(W, G, H, 2 * I));
        int64_t b2 = E * 4 * max64(fm_scale_count_2d(W, G, H, I), fm_scale_count_2d(W, G, I, H));
        L->w1.d = take(p, E * 2 * I * H), L->w1.s = take(p, b1);
        L->w1t.d = take(p, E * 2 * I * H), L->w1t.s = take(p, b1);
        L->w2.d = take(p, E * H * I), L->w2.s = take(p, b2);
        L->w2t.d = take(p, E * H * I), L->w2t.s = take(p, b2);
    }

    /* forward */
    switch (rc) {
    case FM_RECIPE_BF16:
        L->xin = take_q(p, B, FM_SCALE_NONE, T, H);
        L->xp = take_q(p, B, FM_SCALE_NONE, R, H);
        L->h = take_q(p, B, FM_SCALE_NONE, R, I);
        break;
    case FM_RECIPE_FP8_BLOCKWISE:
        L->xin = take_q(p, B, FM_SCALE_NONE, T, H);
        L->xp = take_q(p, B, FM_SCALE_NONE, R, H);
        L->xp8 = take_q(p, Q, S, R, H);
        L->xcol = take_gcol(p, Q, S, R, H, E);
        L->h = take_q(p, B, FM_SCALE_NONE, R, I);
        L->hq = take_q(p, Q, S, R, I);
        L->hcol = take_gcol(p, Q, S, R, I, E);
        break;
    case FM_RECIPE_FP8_FLOW:
        L->xin = take_q(p, Q, S, T, H);
        L->xp = take_q(p, Q, S, R, H);
        L->xcol = take_gcol(p, Q, S, R, H, E);
        L->asv = take_q(p, Q, S, R, 2 * I);
        L->hq = take_q(p, Q, S, R, I);
        L->hcol = take_gcol(p, Q, S, R, I, E);
        break;
    case FM_RECIPE_FP8_FLOW_FP4:
        L->xin = take_q(p, Q, S, T, H);
        L->xp = take_q(p, Q, S, R, H);
        if (!x_rows(c))
            L->xp4 = take_q(p, F4, MX, R, H);
        L->xcol = take_gcol(p, Q, S, R, H, E);
        L->asv = take_q(p, F4, MX, R, 2 * I);
        L->hq = take_q(p, Q, S, R, I);
        L->hcol = take_gcol(p, Q, S, R, I, E);
        break;
    default: break;
    }
    L->a = take_q(p, B, FM_SCALE_NONE, R, 2 * I);
    L->yp = take_q(p, B, FM_SCALE_NONE, R, H);

    /* backward */
    L->dh = take_q(p, B, FM_SCALE_NONE, R, I);
    L->dxp = take_q(p, B, FM_SCALE_NONE, R, H);
    if (rc == FM_RECIPE_BF16) {
        L->dyin = take_q(p, B, FM_SCALE_NONE, T, H);
        L->dyp = take_q(p, B, FM_SCALE_NONE, R, H);
        L->da = take_q(p, B, FM_SCALE_NONE, R, 2 * I);
    } else if (rc == FM_RECIPE_FP8_BLOCKWISE) {
        L->dyin = take_q(p, B, FM_SCALE_NONE, T, H);
        L->dyp = take_q(p, B, FM_SCALE_NONE, R, H);
        L->dyq = take_q(p, Q, S, R, H);
        L->dycol = take_gcol(p, Q, S, R, H, E);
        L->da = take_q(p, B, FM_SCALE_NONE, R, 2 * I);
        L->daq = take_q(p, Q, S, R, 2 * I);
        L->dacol = take_gcol(p, Q, S, R, 2 * I, E);
    } else {
        L->dyin = take_q(p, Q, S, T, H);
        L->dyq = take_q(p, Q, S, R, H);
        L->dycol = take_gcol(p, Q, S, R, H, E);
        L->daq = take_q(p, Q, S, R, 2 * I);
        L->dacol = take_gcol(p, Q, S, R, 2 * I, E);
    }
}

/* ---- descriptors ---------------------------------------------------------- */

static fm_tensor plain(fm_moe_layer *L, const lbuf *b, fm_dtype dt, int64_t rows, int64_t cols)
{
    fm_tensor t = fm_tensor_2d(b->p, dt, rows, cols);
    t.device = fm_context_device(L->ctx);
    return t;
}

static fm_tensor plain3(fm_moe_layer *L, void *p, fm_dtype dt, int64_t e, int64_t rows, int64_t cols)
{
    fm_tensor t = fm_tensor_3d(p, dt, e, rows, cols);
    t.device = fm_context_device(L->ctx);
    return t;
}

static fm_tensor quant(fm_moe_layer *L, const qbuf *q, fm_dtype dt, fm_scale_mode m, fm_layout lay, int64_t rows,
                       int64_t cols)
{
    fm_tensor t = fm_tensor_quant_2d(q->d.p, dt, rows, cols, lay, m, q->s.p, FM_SCALE_LAYOUT_COMPACT);
    t.device = fm_context_device(L->ctx);
    t.data_capacity = q->d.bytes;
    t.scale_capacity = q->s.bytes;
    return t;
}

static fm_tensor q3(fm_moe_layer *L, const qbuf *q, int64_t e, int64_t rows, int64_t cols, fm_layout lay)
{
    fm_tensor t = plain3(L, q->d.p, FM_DTYPE_E4M3, e, rows, cols);
    t.layout = lay;
    t.scale_mode = FM_SCALE_BLOCK_128x128;
    t.scale = q->s.p;
    t.scale_dtype = FM_DTYPE_F32;
    /* what cuBLASLt and the native kernel read: no repack per GEMM call */
    t.scale_layout = FM_SCALE_LAYOUT_GEMM;
    return t;
}

/* Row-wise FP8 (E4M3 1x128) activation [rows, cols]. */
static fm_tensor act8(fm_moe_layer *L, const qbuf *q, int64_t rows, int64_t cols)
{
    return quant(L, q, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, rows, cols);
}

static fm_tensor act4(fm_moe_layer *L, const qbuf *q, int64_t rows, int64_t cols)
{
    return quant(L, q, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_LAYOUT_ROWWISE, rows, cols);
}

/* Grouped column-wise FP8 [rows, cols] over the experts, for the weight
 * gradients (scale mode m: 1x128, or 128x128 for the flow recipes' ROWMAX
 * copies of x and h): GEMM-layout scales, which they read without a repack;
 * gcol_scale_bytes sizes the buffers for either mode. */
static fm_tensor gcol8(fm_moe_layer *L, const qbuf *q, fm_scale_mode m, int64_t rows, int64_t cols)
{
    fm_tensor t = quant(L, q, FM_DTYPE_E4M3, m, FM_LAYOUT_COLWISE, rows, cols);
    t.scale_layout = FM_SCALE_LAYOUT_GEMM;
    return t;
}

static fm_tensor bf(fm_moe_layer *L, const qbuf *q, int64_t rows, int64_t cols)
{
    fm_tensor t = plain(L, &q->d, FM_DTYPE_BF16, rows, cols);
    t.data_capacity = q->d.bytes;
    return t;
}

/* ---- create / destroy ----------------------------------------------------- */

static fm_status check_config(fm_context *ctx, const fm_moe_layer_config *c)
{
    if (!c)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg: NULL; the layer needs its sizes");
    if ((unsigned)c->recipe >= FM_RECIPE_COUNT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->recipe: %d is not an fm_recipe", (int)c->recipe);
    if (c->hidden < 1 || c->ffn < 1 || c->experts < 1 || c->max_tokens < 1)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "cfg: hidden (%lld), ffn (%lld), experts (%lld) and max_tokens (%lld) must all be >= 1",
                        (long long)c->hidden, (long long)c->ffn, (long long)c->experts, (long long)c->max_tokens);
    if (c->hidden > (1 << 20) || c->ffn > (1 << 20) || c->experts > 4096 || c->max_tokens > ((int64_t)1 << 24))
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "cfg: hidden and ffn must be <= 2^20, experts <= 4096, max_tokens <= 2^24");
    if (c->topk < 1 || c->topk > c->experts)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->topk: %d is outside 1..experts (%lld)", c->topk,
                        (long long)c->experts);
    if (c->pad_multiple < 0 || c->pad_multiple > 4096)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->pad_multiple: %d is outside 0..4096", c->pad_multiple);
    if (c->wgrad_tight_columns != 0 && c->wgrad_tight_columns != 1)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->wgrad_tight_columns: %d is neither 0 nor 1",
                        c->wgrad_tight_columns);
    if (c->single_stream != 0 && c->single_stream != 1)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->single_stream: %d is neither 0 nor 1", c->single_stream);
    if (c->recompute_h != 0 && c->recompute_h != 1)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->recompute_h: %d is neither 0 nor 1", c->recompute_h);
    if ((unsigned)c->score >= FM_ROUTER_SCORE_COUNT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->score: %d is not an fm_router_score", (int)c->score);
    if (c->recipe == FM_RECIPE_FP8_FLOW_FP4 && (c->hidden % 32 || c->ffn % 16))
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "cfg: fp8-flow-fp4 keeps MXFP4 rows of H and 2I elements: hidden (%lld) must be a multiple "
                        "of 32 and ffn (%lld) of 16",
                        (long long)c->hidden, (long long)c->ffn);
    if (is_fp8(c->recipe) && pad_of(c) % 128)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "cfg->pad_multiple: %d; FP8 recipes pad experts to a multiple of 128 rows (0 picks 128)",
                        c->pad_multiple);
    if (c->comm) {
        int n = fm_comm_size(c->comm);
        if (n < 1 || c->experts % n)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "cfg->comm: its %d ranks must split cfg->experts (%lld) into equal contiguous blocks", n,
                            (long long)c->experts);
        if ((int64_t)n * c->max_tokens > INT32_MAX / c->topk)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "cfg: %d ranks x max_tokens (%lld) x topk (%d) routed rows must stay below 2^31", n,
                            (long long)c->max_tokens, c->topk);
    }
    return FM_OK;
}

fm_status fm_moe_layer_workspace_size(fm_context *ctx, const fm_moe_layer_config *cfg, int64_t *bytes)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_status st = check_config(ctx, cfg);
    if (st)
        return st;
    if (!bytes)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "bytes: NULL");
    fm_moe_layer L;
    memset(&L, 0, sizeof L);
    L.cfg = *cfg;
    ep_shape(&L);
    planner p = {NULL, 0};
    plan(&L, &p);
    *bytes = p.off;
    return FM_OK;
}

fm_status fm_moe_layer_create(fm_context *ctx, const fm_moe_layer_config *cfg, fm_moe_layer **out)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    if (!out)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "out: must point to an fm_moe_layer* to fill");
    *out = NULL;
    fm_status st = check_config(ctx, cfg);
    if (st)
        return st;
    fm_moe_layer *L = calloc(1, sizeof *L);
    if (!L)
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_moe_layer_create: out of host memory");
    L->ctx = ctx;
    L->cfg = *cfg;
    if (L->cfg.pad_multiple == 0)
        L->cfg.pad_multiple = pad_of(cfg);
    L->act_dt = FM_DTYPE_E4M3;
    ep_shape(L);
    planner p = {NULL, 0};
    plan(L, &p);
    L->mem_bytes = p.off;
    L->host_splits = calloc((size_t)cfg->experts, sizeof(int64_t));
    if (!L->host_splits) {
        free(L);
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_moe_layer_create: out of host memory");
    }
    if ((st = fm_context_alloc(ctx, (size_t)L->mem_bytes, &L->mem))) {
        free(L->host_splits);
        free(L);
        return st;
    }
    /* Zeroed once, at creation: compute-sanitizer's initcheck does not see
     * cuBLASLt's (TMA) stores, so the layer's own kernels reading a GEMM
     * output would be reported; after this memset they are not. Nothing in
     * a step relies on the zeros: test_cuda_layer_matches_cpu and the layer
     * determinism tests compare every output. */
    if ((st = fm_context_memset(ctx, L->mem, 0, (size_t)L->mem_bytes))) {
        fm_moe_layer_destroy(L);
        return st;
    }
    p = (planner){L->mem, 0};
    plan(L, &p);
    /* The all-ones column that turns fm_moe_unpermute_backward into the
     * row -> slot gather of d(probabilities). */
    float *ones = malloc((size_t)L->cap * sizeof(float));
    if (!ones) {
        fm_moe_layer_destroy(L);
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_moe_layer_create: out of host memory");
    }
    for (int64_t i = 0; i < L->cap; i++)
        ones[i] = 1.0f;
    st = fm_context_copy(ctx, L->ones.p, fm_context_device(ctx), ones, FM_DEVICE_HOST, (size_t)L->cap * sizeof(float));
    free(ones);
    if (st) {
        fm_moe_layer_destroy(L);
        return st;
    }
    L->queues = !cfg->comm && !cfg->single_stream;
    if (L->queues && (st = fm_queue_prepare(ctx))) {
        fm_moe_layer_destroy(L);
        return st;
    }
    L->info.workspace_bytes = L->mem_bytes;
    *out = L;
    return FM_OK;
}

void fm_moe_layer_destroy(fm_moe_layer *L)
{
    if (!L)
        return;
    fm_context_free(L->ctx, L->mem);
    free(L->host_splits);
    free(L);
}

fm_status fm_moe_layer_get_info(const fm_moe_layer *L, fm_moe_layer_info *out)
{
    if (!L || !out)
        return FM_ERR_INVALID_ARG;
    *out = L->info;
    return FM_OK;
}

/* ---- weights -------------------------------------------------------------- */

static fm_status check_weights(fm_moe_layer *L, const fm_moe_weights *w, int grads)
{
    if (!w)
        return fm_error(L->ctx, FM_ERR_INVALID_ARG, "w: NULL; the layer needs the caller's weights");
    if (!w->router || !w->w1 || !w->w2)
        return fm_error(L->ctx, FM_ERR_INVALID_ARG, "w: router, w1 and w2 must all be given (F32 masters)");
    if (grads && (!w->grad_router || !w->grad_w1 || !w->grad_w2))
        return fm_error(L->ctx, FM_ERR_INVALID_ARG,
                        "w: grad_router, grad_w1 and grad_w2 must all be given to backward (F32 accumulators)");
    return FM_OK;
}

static int64_t casts_now(fm_context *ctx)
{
    fm_stats s;
    fm_stats_get(ctx, &s);
    return s.casts_to_low + s.casts_to_high;
}

fm_status fm_moe_layer_refresh_weights(fm_moe_layer *L, const fm_moe_weights *w)
{
    if (!L)
        return FM_ERR_INVALID_ARG;
    fm_context *ctx = L->ctx;
    fm_error_clear(ctx);
    fm_status st = check_weights(L, w, 0);
    if (st)
        return st;
    int64_t E = L->El, H = L->cfg.hidden, I = L->cfg.ffn, c0 = casts_now(ctx);
    fm_tensor w1 = plain3(L, w->w1, FM_DTYPE_F32, E, 2 * I, H), w2 = plain3(L, w->w2, FM_DTYPE_F32, E, H, I);
    if (L->cfg.recipe == FM_RECIPE_BF16) {
        /* Row-wise copies for the forward, transposed ones ([E, H, 2I] and
         * [E, I, H] row-wise) for the data gradient. */
        fm_tensor b1 = plain3(L, L->w1.d.p, FM_DTYPE_BF16, E, 2 * I, H);
        fm_tensor b2 = plain3(L, L->w2.d.p, FM_DTYPE_BF16, E, H, I);
        fm_tensor b1t = plain3(L, L->w1t.d.p, FM_DTYPE_BF16, E, 2 * I, H);
        fm_tensor b2t = plain3(L, L->w2t.d.p, FM_DTYPE_BF16, E, H, I);
        b1t.layout = b2t.layout = FM_LAYOUT_COLWISE;
        if ((st = fm_cast(ctx, &w1, &b1)) || (st = fm_cast(ctx, &w1, &b1t)) || (st = fm_cast(ctx, &w2, &b2)) ||
            (st = fm_cast(ctx, &w2, &b2t)))
            return st;
    } else {
        fm_quant_config qc = {.rule = FM_SCALE_RULE_POW2};
        fm_tensor r1 = q3(L, &L->w1, E, 2 * I, H, FM_LAYOUT_ROWWISE), c1 = q3(L, &L->w1t, E, 2 * I, H, FM_LAYOUT_COLWISE);
        fm_tensor r2 = q3(L, &L->w2, E, H, I, FM_LAYOUT_ROWWISE), c2 = q3(L, &L->w2t, E, H, I, FM_LAYOUT_COLWISE);
        if ((st = fm_quantize(ctx, &qc, &w1, &r1, &c1)) || (st = fm_quantize(ctx, &qc, &w2, &r2, &c2)))
            return st;
    }
    L->info.casts_per_refresh = casts_now(ctx) - c0;
    L->have_weights = 1;
    return FM_OK;
}

/* W1 and W2 as the grouped GEMMs take them: B [E, N, K]. dgrad = the
 * transposed copy (BF16: its own row-wise array; FP8: the column-wise copy
 * seen through fm_tensor_t). */
static fm_tensor weight_b(fm_moe_layer *L, int which, int dgrad)
{
    int64_t E = L->El, H = L->cfg.hidden, I = L->cfg.ffn;
    int64_t rows = which == 1 ? 2 * I : H, cols = which == 1 ? H : I;
    const qbuf *q = which == 1 ? (dgrad ? &L->w1t : &L->w1) : (dgrad ? &L->w2t : &L->w2);
    if (L->cfg.recipe == FM_RECIPE_BF16)
        return dgrad ? plain3(L, q->d.p, FM_DTYPE_BF16, E, cols, rows) : plain3(L, q->d.p, FM_DTYPE_BF16, E, rows, cols);
    fm_tensor t = q3(L, q, E, rows, cols, dgrad ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE);
    return dgrad ? fm_tensor_t(&t) : t;
}

/* ---- forward -------------------------------------------------------------- */

static fm_status check_io(fm_moe_layer *L, const fm_tensor *t, const char *name, int64_t T)
{
    fm_status st = fm_check_tensor(L->ctx, t, name, FM_CHK_UNSCALED | FM_CHK_ROWWISE);
    if (st)
        return st;
    if (t->dtype != FM_DTYPE_F32 || t->ndim != 2 || t->shape[1] != L->cfg.hidden)
        return fm_error(L->ctx, FM_ERR_INVALID_ARG, "%s: must be F32 [T, %lld] (hidden), got %s ndim %d cols %lld",
                        name, (long long)L->cfg.hidden, fm_dtype_name(t->dtype), t->ndim,
                        (long long)t->shape[t->ndim - 1]);
    if (T >= 0 && t->shape[0] != T)
        return fm_error(L->ctx, FM_ERR_INVALID_ARG, "%s: %lld rows, the last forward had T = %lld", name,
                        (long long)t->shape[0], (long long)T);
    if (t->shape[0] > L->cfg.max_tokens)
        return fm_error(L->ctx, FM_ERR_INVALID_ARG, "%s: T = %lld is more than cfg->max_tokens (%lld)", name,
                        (long long)t->shape[0], (long long)L->cfg.max_tokens);
    return FM_OK;
}

static int64_t tensor_total(const fm_tensor *t)
{
    return fm_tensor_nbytes(t) + (t->scale_mode ? fm_tensor_scale_nbytes(t) : 0);
}

/* With a comm, a failed step on this rank must not leave the others waiting
 * in a collective it will never join. */
static fm_status ep_fail(fm_moe_layer *L, fm_status st)
{
    if (st && L->cfg.comm)
        fm_comm_abort(L->cfg.comm);
    return st;
}

/* The tokens' rows as the local permute takes them: this rank's own (one
 * rank), or the rows other ranks sent here. `in` is the payload [T, H] in
 * the recipe's precision; on return *rows_in is the permute's input and
 * *Rr its row count. fp4 (x only) sends MXFP4 and turns it back into FP8. */
static fm_status ep_dispatch(fm_moe_layer *L, fm_tensor *in, const qbuf *recv, const fm_tensor *ids,
                             const fm_tensor *probs, int with_fp4, fm_tensor *rows_in, int64_t *Rr)
{
    fm_context *ctx = L->ctx;
    int64_t T = in->shape[0], H = L->cfg.hidden, k = L->cfg.topk;
    fm_status st;
    fm_requant_config rq = {.trusted_pow2_scales = 1}; /* the layer's own POW2 scales */
    fm_ep_config ep = {.experts_per_rank = (int)L->El};
    fm_tensor send = *in, got;
    if (with_fp4) {
        send = act4(L, &L->xin4, T, H);
        got = act4(L, &L->xr4, L->cap, H);
        if ((st = fm_convert_scaled(ctx, &rq, in, &send)))
            return st;
    } else {
        got = in->scale_mode ? act8(L, recv, L->cap, H) : bf(L, recv, L->cap, H);
    }
    fm_tensor rids = plain(L, &L->rids, FM_DTYPE_I32, L->cap, k), rp = plain(L, &L->rprobk, FM_DTYPE_F32, L->cap, k);
    fm_ep_dispatch_out o = {.x = &got, .expert_ids = probs ? &rids : NULL, .probs = probs ? &rp : NULL};
    if ((st = fm_ep_dispatch(ctx, L->cfg.comm, &ep, &send, ids, probs, &o)))
        return st;
    *Rr = o.rows;
    *rows_in = in->scale_mode ? act8(L, recv, o.rows, H) : bf(L, recv, o.rows, H);
    if (with_fp4) {
        got.shape[0] = o.rows;
        if ((st = fm_convert_scaled(ctx, &rq, &got, rows_in)))
            return st;
    }
    return FM_OK;
}

/* Rows [Rr, H] of this rank's experts, summed per received row (the
 * unpermute), back to the tokens: out [T, H] F32, directly on one rank, else
 * through BF16 partial sums and fm_ep_combine. */
static fm_status ep_combine(fm_moe_layer *L, fm_tensor *rows, const fm_tensor *slot_rows, const fm_tensor *ids,
                            fm_tensor *out)
{
    fm_context *ctx = L->ctx;
    if (!L->cfg.comm)
        return fm_moe_unpermute(ctx, rows, slot_rows, NULL, out);
    fm_tensor part = bf(L, &L->yr, slot_rows->shape[0], L->cfg.hidden);
    fm_ep_config ep = {.experts_per_rank = (int)L->El};
    fm_status st = fm_moe_unpermute(ctx, rows, slot_rows, NULL, &part);
    return st ? st : fm_ep_combine(ctx, L->cfg.comm, &ep, ids, &part, out);
}

static fm_status forward(fm_moe_layer *L, const fm_moe_weights *w, const fm_tensor *x, fm_tensor *y)
{
    fm_context *ctx = L->ctx;
    fm_status st;
    if ((st = check_weights(L, w, 0)) || (st = check_io(L, x, "x", -1)) || (st = check_io(L, y, "y", x->shape[0])))
        return st;
    if (!L->have_weights)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "layer: no weights yet; call fm_moe_layer_refresh_weights after each optimizer step");
    const fm_moe_layer_config *c = &L->cfg;
    fm_recipe rc = c->recipe;
    int64_t T = x->shape[0], Eg = c->experts, E = L->El, H = c->hidden, I = c->ffn, k = c->topk, Rm = max_rows(L);
    int64_t c0 = casts_now(ctx);
    fm_quant_config qc = {.rule = FM_SCALE_RULE_POW2};

    /* Router, in F32, over every expert. */
    fm_tensor wr = plain(L, &(lbuf){w->router, 0}, FM_DTYPE_F32, Eg, H);
    fm_tensor logits = plain(L, &L->logits, FM_DTYPE_F32, T, Eg);
    fm_gemm_config g0 = {0};
    if ((st = fm_gemm(ctx, &g0, x, &wr, &logits)))
        return st;
    fm_router_config rcfg = {.topk = c->topk, .score = c->score, .renormalize = c->renormalize};
    fm_tensor ids = plain(L, &L->ids, FM_DTYPE_I32, T, k), probs = plain(L, &L->probs, FM_DTYPE_F32, T, k);
    fm_tensor tpe = plain(L, &L->tpe, FM_DTYPE_I64, 1, Eg);
    if ((st = fm_moe_router(ctx, &rcfg, &logits, &ids, &probs, &tpe)))
        return st;

    /* Dispatch: the payload in the recipe's precision. */
    fm_tensor xin, xp;
    if (rc == FM_RECIPE_BF16 || rc == FM_RECIPE_FP8_BLOCKWISE) {
        xin = bf(L, &L->xin, T, H);
        if ((st = fm_cast(ctx, x, &xin)))
            return st;
        xp = bf(L, &L->xp, Rm, H);
    } else {
        xin = act8(L, &L->xin, T, H);
        if ((st = fm_quantize(ctx, &qc, x, &xin, NULL)))
            return st;
        xp = act8(L, &L->xp, Rm, H);
    }
    /* Over expert parallelism the permute takes the rows other ranks sent,
     * with their local ids and probabilities. */
    fm_tensor pin = xin, pids = ids, pprobs = probs;
    int64_t Rr = T;
    if (c->comm) {
        if ((st = ep_dispatch(L, &xin, &L->xr, &ids, &probs, rc == FM_RECIPE_FP8_FLOW_FP4, &pin, &Rr)))
            return st;
        pids = plain(L, &L->rids, FM_DTYPE_I32, Rr, k);
        pprobs = plain(L, &L->rprobk, FM_DTYPE_F32, Rr, k);
    }
    fm_permute_config pc = {.pad_multiple = c->pad_multiple};
    fm_tensor row_map = plain(L, &L->row_map, FM_DTYPE_I32, Rm, 1);
    fm_tensor slot_rows = plain(L, &L->slot_rows, FM_DTYPE_I32, Rr, k);
    fm_tensor splits = plain(L, &L->splits, FM_DTYPE_I64, 1, E);
    fm_tensor rprobs = plain(L, &L->rprobs, FM_DTYPE_F32, Rm, 1);
    if ((st = fm_moe_permute(ctx, &pc, &pin, &pids, &pprobs, &xp, &row_map, &slot_rows, &splits, &rprobs,
                             L->host_splits)))
        return st;
    int64_t R = 0;
    for (int64_t e = 0; e < E; e++)
        R += L->host_splits[e];
    fm_splits sp = {E, L->host_splits, (const int64_t *)L->splits.p};
    rprobs.shape[0] = R;

    /* fc1: the GEMM's row-wise operand. */
    fm_tensor a_in;
    int64_t saved = 0;
    if (rc == FM_RECIPE_BF16) {
        a_in = bf(L, &L->xp, R, H);
        saved += tensor_total(&a_in);
    } else if (rc == FM_RECIPE_FP8_BLOCKWISE) {
        fm_tensor xpb = bf(L, &L->xp, R, H), xrow = act8(L, &L->xp8, R, H);
        fm_tensor xcol = gcol8(L, &L->xcol, FM_SCALE_BLOCK_1x128, R, H);
        if ((st = fm_quantize_grouped(ctx, &qc, &sp, &xpb, &xrow, &xcol)))
            return st;
        a_in = xrow;
        saved += tensor_total(&xcol);
    } else if (rc == FM_RECIPE_FP8_FLOW || x_rows(c)) {
        a_in = act8(L, &L->xp, R, H);
        /* backward reads x's token rows (received ones over EP), or these */
        fm_tensor kept = !x_rows(c) ? a_in : x_rows_fp4(c) ? act4(L, &L->xr4, Rr, H) : pin;
        saved += tensor_total(&kept);
    } else {
        /* The GEMM eats the FP8 rows; backward keeps them in MXFP4. */
        fm_tensor x4 = act4(L, &L->xp4, R, H);
        a_in = act8(L, &L->xp, R, H);
        fm_requant_config rq = {.trusted_pow2_scales = 1}; /* the layer's own POW2 scales */
        if ((st = fm_convert_scaled(ctx, &rq, &a_in, &x4)))
            return st;
        saved += tensor_total(&x4);
    }
    fm_tensor a = bf(L, &L->a, R, 2 * I);
    fm_tensor w1 = weight_b(L, 1, 0), w2 = weight_b(L, 2, 0);
    if ((st = fm_grouped_gemm(ctx, &g0, &sp, &a_in, &w1, &a)))
        return st;

    /* SwiGLU, weighted by the routing probability of each row. */
    fm_tensor h_in;
    if (rc == FM_RECIPE_BF16 || rc == FM_RECIPE_FP8_BLOCKWISE) {
        fm_tensor h = bf(L, &L->h, R, I);
        if ((st = fm_moe_swiglu(ctx, &qc, &a, &rprobs, &h, NULL, NULL)))
            return st;
        saved += tensor_total(&a);
        if (rc == FM_RECIPE_BF16) {
            h_in = h;
            saved += tensor_total(&h);
        } else {
            fm_tensor hrow = act8(L, &L->hq, R, I), hcol = gcol8(L, &L->hcol, FM_SCALE_BLOCK_1x128, R, I);
            if ((st = fm_quantize_grouped(ctx, &qc, &sp, &h, &hrow, &hcol)))
                return st;
            h_in = hrow;
            saved += tensor_total(&hcol);
        }
    } else {
        fm_tensor asv = rc == FM_RECIPE_FP8_FLOW ? act8(L, &L->asv, R, 2 * I) : act4(L, &L->asv, R, 2 * I);
        h_in = act8(L, &L->hq, R, I);
        if ((st = fm_moe_swiglu(ctx, &qc, &a, &rprobs, &h_in, NULL, &asv)))
            return st;
        saved += tensor_total(&asv); /* dSwiGLU's input */
        if (!c->recompute_h)
            saved += tensor_total(&h_in); /* W2's gradient's h */
    }

    /* fc2 and the combine (the probabilities are already in h). */
    fm_tensor yp = bf(L, &L->yp, R, H);
    if ((st = fm_grouped_gemm(ctx, &g0, &sp, &h_in, &w2, &yp)))
        return st;
    yp.shape[0] = Rm; /* slot_rows index the whole permuted buffer */
    if ((st = ep_combine(L, &yp, &slot_rows, &ids, y)))
        return st;

    /* Routing state kept for backward: logits, ids, probs, maps, row probs
     * (and the received rows' ids and probs). */
    saved += T * Eg * 4 + T * k * 4 * 2 + Rr * k * 4 + R * 4 * 2 + (c->comm ? Rr * k * 8 : 0);
    L->T = T;
    L->R = R;
    L->Rr = Rr;
    L->have_forward = 1;
    L->info.saved_bytes = saved;
    L->info.routed_rows = T * k;
    L->info.padded_rows = R;
    L->info.casts_per_step = casts_now(ctx) - c0;
    return FM_OK;
}

fm_status fm_moe_layer_forward(fm_moe_layer *L, const fm_moe_weights *w, const fm_tensor *x, fm_tensor *y)
{
    if (!L)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(L->ctx);
    return ep_fail(L, forward(L, w, x, y));
}

/* ---- backward ------------------------------------------------------------- */

/* BF16 weight gradients: one GEMM per expert on row slices (BF16 operands
 * need no column-wise copy). */
static fm_status wgrad_bf16(fm_moe_layer *L, const qbuf *dy, int64_t N, const qbuf *x, int64_t K, float *dw)
{
    fm_gemm_config acc = {.accumulate = 1};
    int64_t r0 = 0;
    for (int64_t e = 0; e < L->El; e++) {
        int64_t m = L->host_splits[e];
        if (m) {
            fm_tensor d = plain(L, &(lbuf){(uint16_t *)dy->d.p + r0 * N, 0}, FM_DTYPE_BF16, m, N);
            fm_tensor xx = plain(L, &(lbuf){(uint16_t *)x->d.p + r0 * K, 0}, FM_DTYPE_BF16, m, K);
            fm_tensor g = plain(L, &(lbuf){dw + e * N * K, 0}, FM_DTYPE_F32, N, K);
            fm_status st = fm_linear_wgrad(L->ctx, &acc, &d, &xx, &g);
            if (st)
                return st;
        }
        r0 += m;
    }
    return FM_OK;
}

/* The layer's use of the context's second queue (none without it). */
static fm_status use_queue(fm_moe_layer *L, int q, int wait)
{
    return L->queues ? fm_queue_select(L->ctx, q, wait) : FM_OK;
}

/* Back to tokens: dx = Σ_j dxp[row(t, j)], d(probs), then the router's
 * share of dx and its weight gradient. */
static fm_status to_tokens(fm_moe_layer *L, const fm_moe_weights *w, const fm_tensor *x, fm_tensor *dxp, fm_tensor *dx)
{
    fm_context *ctx = L->ctx;
    const fm_moe_layer_config *c = &L->cfg;
    int64_t T = L->T, Rr = L->Rr, Rm = max_rows(L), Eg = c->experts, H = c->hidden, k = c->topk;
    fm_tensor slot_rows = plain(L, &L->slot_rows, FM_DTYPE_I32, Rr, k);
    fm_tensor row_map = plain(L, &L->row_map, FM_DTYPE_I32, Rm, 1);
    fm_tensor ids = plain(L, &L->ids, FM_DTYPE_I32, T, k), probs = plain(L, &L->probs, FM_DTYPE_F32, T, k);
    fm_gemm_config acc = {.accumulate = 1};
    fm_status st;
    dxp->shape[0] = Rm;
    if ((st = ep_combine(L, dxp, &slot_rows, &ids, dx)))
        return st;
    /* d(probs)[t, j] = dprobs_rows[row(t, j)]: unpermute_backward with a
     * one-column dout of ones is exactly that gather (a one-term dot). Over
     * expert parallelism it gathers the received rows' slots, and the
     * combine brings each choice's value home from the one rank it lives on. */
    fm_tensor ones = plain(L, &L->ones, FM_DTYPE_F32, Rr, 1), dpr = plain(L, &L->dprobs_rows, FM_DTYPE_F32, Rm, 1);
    fm_tensor scratch = plain(L, &L->scratch1, FM_DTYPE_F32, Rm, 1), dprobs = plain(L, &L->dprobs, FM_DTYPE_F32, T, k);
    fm_tensor pprobs = probs, dpk = dprobs;
    if (c->comm) {
        pprobs = plain(L, &L->rprobk, FM_DTYPE_F32, Rr, k);
        dpk = plain(L, &L->dprobk, FM_DTYPE_F32, Rr, k);
    }
    if ((st = fm_moe_unpermute_backward(ctx, &ones, &dpr, &row_map, &slot_rows, &pprobs, &scratch, &dpk)))
        return st;
    fm_ep_config ep = {.experts_per_rank = (int)L->El};
    if (c->comm && (st = fm_ep_combine(ctx, c->comm, &ep, &ids, &dpk, &dprobs)))
        return st;
    fm_router_config rcfg = {.topk = c->topk, .score = c->score, .renormalize = c->renormalize};
    fm_tensor logits = plain(L, &L->logits, FM_DTYPE_F32, T, Eg), dlogits = plain(L, &L->dlogits, FM_DTYPE_F32, T, Eg);
    if ((st = fm_moe_router_backward(ctx, &rcfg, &logits, &ids, &dprobs, &dlogits)))
        return st;
    fm_tensor wr = plain(L, &(lbuf){w->router, 0}, FM_DTYPE_F32, Eg, H);
    fm_tensor gwr = plain(L, &(lbuf){w->grad_router, 0}, FM_DTYPE_F32, Eg, H);
    /* The router GEMMs have F32 operands, which any layout serves. */
    if ((st = fm_linear_wgrad(ctx, &acc, &dlogits, x, &gwr)) || (st = fm_linear_dgrad(ctx, &acc, &dlogits, &wr, dx)))
        return st;
    return FM_OK;
}

static fm_status backward(fm_moe_layer *L, const fm_moe_weights *w, const fm_tensor *x, const fm_tensor *dy,
                          fm_tensor *dx)
{
    fm_context *ctx = L->ctx;
    fm_status st;
    if (!L->have_forward)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "layer: backward needs a forward first");
    if ((st = check_weights(L, w, 1)) || (st = check_io(L, x, "x", L->T)) || (st = check_io(L, dy, "dy", L->T)) ||
        (st = check_io(L, dx, "dx", L->T)))
        return st;
    const fm_moe_layer_config *c = &L->cfg;
    fm_recipe rc = c->recipe;
    int64_t T = L->T, R = L->R, Rr = L->Rr, E = L->El, H = c->hidden, I = c->ffn, k = c->topk;
    int64_t Rm = max_rows(L);
    int64_t c0 = casts_now(ctx);
    fm_quant_config qc = {.rule = FM_SCALE_RULE_POW2};
    fm_gemm_config g0 = {0}, acc = {.accumulate = 1};
    fm_requant_config rq = {.trusted_pow2_scales = 1}; /* the layer's own POW2 scales */
    /* x and h as the weight gradients read them: the flow recipes' ROWMAX copies
     * with one scale per 128 x 128 tile unless cfg->wgrad_tight_columns asks for
     * TIGHT 128 x 1 blocks; fp8-blockwise quantizes its 1x128 copies directly. */
    const int tile_wgrad = is_flow(rc) && !c->wgrad_tight_columns;
    fm_requant_config rqw = rq;
    rqw.rule = tile_wgrad ? FM_REQUANT_ROWMAX : FM_REQUANT_TIGHT;
    const fm_scale_mode wmode = tile_wgrad ? FM_SCALE_BLOCK_128x128 : FM_SCALE_BLOCK_1x128;
    fm_splits sp = {E, L->host_splits, (const int64_t *)L->splits.p};
    fm_tensor slot_rows = plain(L, &L->slot_rows, FM_DTYPE_I32, Rr, k);
    fm_tensor row_map = plain(L, &L->row_map, FM_DTYPE_I32, Rm, 1);
    fm_tensor splits = plain(L, &L->splits, FM_DTYPE_I64, 1, E);
    fm_tensor ids = plain(L, &L->ids, FM_DTYPE_I32, T, k);
    fm_tensor rprobs = plain(L, &L->rprobs, FM_DTYPE_F32, R, 1);
    fm_permute_config pc = {.pad_multiple = c->pad_multiple};

    /* dy to the experts' rows: the combine was an unweighted sum, so its
     * backward is a permute of dy, in the recipe's precision. */
    fm_tensor dyin, dyp;
    if (rc == FM_RECIPE_BF16 || rc == FM_RECIPE_FP8_BLOCKWISE) {
        dyin = bf(L, &L->dyin, T, H);
        dyp = bf(L, &L->dyp, Rm, H);
        if ((st = fm_cast(ctx, dy, &dyin)))
            return st;
    } else {
        dyin = act8(L, &L->dyin, T, H);
        dyp = act8(L, &L->dyq, Rm, H);
        if ((st = fm_quantize(ctx, &qc, dy, &dyin, NULL)))
            return st;
    }
    /* Over expert parallelism dy travels to the experts' ranks like x did,
     * and is permuted with the local ids the forward received. */
    fm_tensor pin = dyin, pids = ids;
    if (c->comm) {
        int64_t got = 0;
        if ((st = ep_dispatch(L, &dyin, &L->dyr, &ids, NULL, 0, &pin, &got)))
            return st;
        if (got != Rr)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "layer: backward received %lld rows of dy where the forward received %lld: every rank "
                            "must run backward after the same forward",
                            (long long)got, (long long)Rr);
        pids = plain(L, &L->rids, FM_DTYPE_I32, Rr, k);
    }
    if ((st = fm_moe_permute(ctx, &pc, &pin, &pids, NULL, &dyp, &row_map, &slot_rows, &splits, NULL, NULL)))
        return st;
    dyp.shape[0] = R;
    fm_tensor dy_row = dyp, dy_col = {0};
    if (rc == FM_RECIPE_FP8_BLOCKWISE) {
        dy_row = act8(L, &L->dyq, R, H);
        dy_col = gcol8(L, &L->dycol, FM_SCALE_BLOCK_1x128, R, H);
        if ((st = fm_quantize_grouped(ctx, &qc, &sp, &dyp, &dy_row, &dy_col)))
            return st;
    }

    /* The column-wise copies that only the weight gradients read go to the
     * second queue, beside the data-gradient GEMMs; the weight gradients come
     * last, beside the combine. The ops and their inputs are those of one
     * queue, so the results are too, bit for bit. */
    fm_tensor a_saved = bf(L, &L->a, R, 2 * I), hcol = {0}, xcol = {0};
    if (rc == FM_RECIPE_FP8_BLOCKWISE) {
        hcol = gcol8(L, &L->hcol, FM_SCALE_BLOCK_1x128, R, I);
        xcol = gcol8(L, &L->xcol, FM_SCALE_BLOCK_1x128, R, H);
    } else if (is_flow(rc)) {
        a_saved = rc == FM_RECIPE_FP8_FLOW ? act8(L, &L->asv, R, 2 * I) : act4(L, &L->asv, R, 2 * I);
        hcol = gcol8(L, &L->hcol, wmode, R, I);
        xcol = gcol8(L, &L->xcol, wmode, R, H);
        dy_col = gcol8(L, &L->dycol, FM_SCALE_BLOCK_1x128, R, H);
        /* h: the forward's own (kept), or recomputed from the saved SwiGLU
         * input (cfg->recompute_h). */
        fm_tensor hq = act8(L, &L->hq, R, I), xp = act8(L, &L->xp, R, H);
        if ((st = use_queue(L, 1, 1)) || (st = fm_transpose_scaled_grouped(ctx, &rq, &sp, &dy_row, &dy_col)) ||
            (c->recompute_h && (st = fm_moe_swiglu(ctx, &qc, &a_saved, &rprobs, &hq, NULL, NULL))) ||
            (st = fm_transpose_scaled_grouped(ctx, &rqw, &sp, &hq, &hcol)))
            return st;
        if (x_rows(c)) {
            /* the forward's permute input: x's token rows, or the rows this rank received */
            fm_tensor xrows = c->comm ? act8(L, &L->xr, Rr, H) : act8(L, &L->xin, T, H);
            fm_tensor rmap = plain(L, &L->row_map, FM_DTYPE_I32, R, 1);
            if (x_rows_fp4(c)) {
                fm_tensor x4 = act4(L, &L->xr4, Rr, H);
                st = fm_convert_scaled(ctx, &rq, &x4, &xrows);
            }
            if (!st)
                st = fm_transpose_scaled_grouped_rows(ctx, &rqw, &sp, &xrows, &rmap, c->topk, &xcol);
        } else {
            if (rc == FM_RECIPE_FP8_FLOW_FP4) {
                fm_tensor x4 = act4(L, &L->xp4, R, H);
                if ((st = fm_convert_scaled(ctx, &rq, &x4, &xp)))
                    return st;
            }
            st = fm_transpose_scaled_grouped(ctx, &rqw, &sp, &xp, &xcol);
        }
        if (st || (st = use_queue(L, 0, 0)))
            return st;
    }

    /* fc2's data gradient, dSwiGLU (and the probabilities' gradient per row). */
    fm_tensor dh = bf(L, &L->dh, R, I), w2t = weight_b(L, 2, 1), w1t = weight_b(L, 1, 1);
    if ((st = fm_grouped_gemm(ctx, &g0, &sp, &dy_row, &w2t, &dh)))
        return st;
    fm_tensor dprobs_rows = plain(L, &L->dprobs_rows, FM_DTYPE_F32, R, 1);
    fm_tensor da_row, da_col = {0};
    if (rc == FM_RECIPE_BF16 || rc == FM_RECIPE_FP8_BLOCKWISE) {
        fm_tensor da = bf(L, &L->da, R, 2 * I);
        if ((st = fm_moe_swiglu_backward(ctx, &qc, &dh, &a_saved, &rprobs, &da, NULL, &dprobs_rows)))
            return st;
        da_row = da;
        if (rc == FM_RECIPE_FP8_BLOCKWISE) {
            da_row = act8(L, &L->daq, R, 2 * I);
            da_col = gcol8(L, &L->dacol, FM_SCALE_BLOCK_1x128, R, 2 * I);
            if ((st = fm_quantize_grouped(ctx, &qc, &sp, &da, &da_row, &da_col)))
                return st;
        }
    } else {
        da_row = act8(L, &L->daq, R, 2 * I);
        da_col = gcol8(L, &L->dacol, FM_SCALE_BLOCK_1x128, R, 2 * I);
        if ((st = fm_moe_swiglu_backward(ctx, &qc, &dh, &a_saved, &rprobs, &da_row, NULL, &dprobs_rows)) ||
            (st = use_queue(L, 1, 1)) || (st = fm_transpose_scaled_grouped(ctx, &rq, &sp, &da_row, &da_col)) ||
            (st = use_queue(L, 0, 0)))
            return st;
    }

    /* fc1's data gradient; then the weight gradients (once the copies are
     * done) while the second queue brings dx and d(probs) back to the tokens. */
    fm_tensor dxp = bf(L, &L->dxp, R, H);
    if ((st = fm_grouped_gemm(ctx, &g0, &sp, &da_row, &w1t, &dxp)) || (st = use_queue(L, 0, 1)) ||
        (st = use_queue(L, 1, 1)) || (st = to_tokens(L, w, x, &dxp, dx)) || (st = use_queue(L, 0, 0)))
        return st;
    fm_tensor gw2 = plain3(L, w->grad_w2, FM_DTYPE_F32, E, H, I), gw1 = plain3(L, w->grad_w1, FM_DTYPE_F32, E, 2 * I, H);
    if (rc == FM_RECIPE_BF16) {
        if ((st = wgrad_bf16(L, &L->dyp, H, &L->h, I, w->grad_w2)) ||
            (st = wgrad_bf16(L, &L->da, 2 * I, &L->xp, H, w->grad_w1)))
            return st;
    } else if ((st = fm_grouped_gemm_wgrad(ctx, &acc, &sp, &dy_col, &hcol, &gw2)) ||
               (st = fm_grouped_gemm_wgrad(ctx, &acc, &sp, &da_col, &xcol, &gw1)))
        return st;
    L->info.casts_per_step += casts_now(ctx) - c0;
    L->have_forward = 0;
    return FM_OK;
}

fm_status fm_moe_layer_backward(fm_moe_layer *L, const fm_moe_weights *w, const fm_tensor *x, const fm_tensor *dy,
                                fm_tensor *dx)
{
    if (!L)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(L->ctx);
    fm_status st = backward(L, w, x, dy, dx);
    /* Queue 0 waits for the second queue's work, even after a failure: the
     * caller's next op on the context stream must see all of this step. */
    fm_status st2 = use_queue(L, 0, 1);
    return ep_fail(L, st ? st : st2);
}
