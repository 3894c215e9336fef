/* Public GEMMs: validate, count, dispatch. The fm_linear_* entry points
 * check the natural shapes of a linear layer, then hand the backend's one
 * dense slot A [M, K] and B [N, K] through transposed views. */
#include <stdio.h>

#include "validate.h"

static int is_fp8(fm_dtype d) { return d == FM_DTYPE_E4M3 || d == FM_DTYPE_E5M2; }

/* One operand of a product as the caller named it. `t` is the view the
 * backend gets ([M, K] or [N, K]); `orig` the tensor the caller passed;
 * `need` says which copy has K contiguous, for the FP8 layout error. */
typedef struct {
    const fm_tensor *t, *orig;
    const char *name;
    const char *need;
} operand;

static int64_t rows_of(const fm_tensor *t) { return t->shape[t->ndim - 2]; }
static int64_t cols_of(const fm_tensor *t) { return t->shape[t->ndim - 1]; }

static int64_t tensor_bytes(const fm_tensor *t)
{
    return fm_tensor_nbytes(t) + (t->scale_mode ? fm_tensor_scale_nbytes(t) : 0);
}

static fm_status check_cfg(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *d, const char *dn)
{
    if (cfg->accumulate != 0 && cfg->accumulate != 1)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->accumulate: must be 0 or 1, got %d", cfg->accumulate);
    if ((int)cfg->impl < 0 || cfg->impl >= FM_GEMM_IMPL_COUNT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->impl: must be AUTO, LIBRARY or NATIVE (0..2), got %d",
                        (int)cfg->impl);
    if (cfg->accumulate && d->dtype != FM_DTYPE_F32)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "%s: cfg->accumulate adds into the output, which must then be F32 (main-grad); got %s", dn,
                        fm_dtype_name(d->dtype));
    return FM_OK;
}

static fm_status check_output(fm_context *ctx, const fm_tensor *d, const char *dn, int ndim)
{
    fm_status st = fm_check_tensor(ctx, d, dn, FM_CHK_UNSCALED | FM_CHK_ROWWISE);
    if (st)
        return st;
    if (d->ndim != ndim)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: must be %d-D, got ndim %d", dn, ndim, d->ndim);
    if (d->dtype != FM_DTYPE_BF16 && d->dtype != FM_DTYPE_F32)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: the GEMM output dtype must be BF16 or F32, got %s", dn,
                        fm_dtype_name(d->dtype));
    return FM_OK;
}

static int pair_ok(fm_scale_mode a, fm_scale_mode b)
{
    return (a == FM_SCALE_TENSOR && b == FM_SCALE_TENSOR) || (a == FM_SCALE_ROW && b == FM_SCALE_ROW) ||
           (a == FM_SCALE_BLOCK_1x128 && (b == FM_SCALE_BLOCK_128x128 || b == FM_SCALE_BLOCK_1x128)) ||
           (a == FM_SCALE_BLOCK_128x128 && b == FM_SCALE_BLOCK_128x128);
}

/* Operand dtypes, scale modes and layouts of A and B (descriptors already
 * checked). The k-grouped weight gradient takes only 1x128 x 1x128. */
static fm_status check_operands(fm_context *ctx, const operand *a, const operand *b, int wgrad)
{
    const fm_tensor *ta = a->t, *tb = b->t;
    int fa = is_fp8(ta->dtype), fb = is_fp8(tb->dtype);
    if (fa != fb || (!fa && ta->dtype != tb->dtype) ||
        (!fa && ta->dtype != FM_DTYPE_BF16 && ta->dtype != FM_DTYPE_F32))
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "%s, %s: dtypes %s x %s are not a GEMM pair; operands are both FP8 (E4M3/E5M2), both BF16 "
                        "or both F32",
                        a->name, b->name, fm_dtype_name(ta->dtype), fm_dtype_name(tb->dtype));
    if (!fa) {
        if (ta->scale_mode != FM_SCALE_NONE || tb->scale_mode != FM_SCALE_NONE)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "%s: %s operands of a GEMM are unscaled (scale_mode NONE), got %s",
                            ta->scale_mode ? a->name : b->name, fm_dtype_name(ta->dtype),
                            fm_scale_mode_name(ta->scale_mode ? ta->scale_mode : tb->scale_mode));
        return FM_OK;
    }
    if (ta->dtype == FM_DTYPE_E5M2 && tb->dtype == FM_DTYPE_E5M2)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "%s, %s: E5M2 x E5M2 is not a supported FP8 GEMM (cuBLASLt refuses it); quantize one "
                        "operand to E4M3",
                        a->name, b->name);
    const operand *ops[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        const fm_tensor *t = ops[i]->t;
        if (t->layout != FM_LAYOUT_ROWWISE)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: %s; got %s", ops[i]->name, ops[i]->need,
                            fm_layout_name(ops[i]->orig->layout));
        if (t->scale_mode == FM_SCALE_NONE)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: an FP8 operand needs a scale_mode, got NONE",
                            ops[i]->name);
    }
    /* k-grouped: each expert's X_iᵀ is its own matrix, so 128x128 blocks of
     * it (ROWMAX transposes) never straddle two experts. */
    int ok = wgrad ? ta->scale_mode == FM_SCALE_BLOCK_1x128 &&
                         (tb->scale_mode == FM_SCALE_BLOCK_1x128 || tb->scale_mode == FM_SCALE_BLOCK_128x128)
                   : pair_ok(ta->scale_mode, tb->scale_mode);
    if (!ok)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "%s, %s: scale pair %s x %s is not supported; %s", a->name, b->name,
                        fm_scale_mode_name(ta->scale_mode), fm_scale_mode_name(tb->scale_mode),
                        wgrad ? "the k-grouped weight gradient takes dy BLOCK_1x128 x x BLOCK_1x128 or "
                                "BLOCK_128x128"
                              : "use TENSOR x TENSOR, ROW x ROW, BLOCK_1x128 x BLOCK_128x128, "
                                "BLOCK_1x128 x BLOCK_1x128 or BLOCK_128x128 x BLOCK_128x128");
    return FM_OK;
}

/* The output against every buffer of an input. */
static fm_status check_alias(fm_context *ctx, const fm_tensor *d, const char *dn, const operand *a,
                             const operand *b)
{
    fm_status st = fm_check_no_alias(ctx, d, dn, a->orig, a->name);
    if (st)
        return st;
    return fm_check_no_alias(ctx, d, dn, b->orig, b->name);
}

static void count(fm_context *ctx, fm_op op, const fm_gemm_config *cfg, int64_t rd, const fm_tensor *d)
{
    int64_t wr = fm_tensor_nbytes(d);
    ctx->stats.calls[op]++;
    ctx->stats.op_calls++;
    ctx->stats.bytes_read += rd + (cfg->accumulate ? wr : 0);
    ctx->stats.bytes_written += wr;
}

/* Shared by fm_gemm and fm_linear_*: a, b are the views A [M, K], B [N, K];
 * shapes have been checked by the caller in its own terms. */
static fm_status dense(fm_context *ctx, const fm_gemm_config *cfg_in, const operand *a, const operand *b,
                       fm_tensor *d, const char *dn, const char *op)
{
    fm_gemm_config cfg = cfg_in ? *cfg_in : (fm_gemm_config){0};
    fm_status st;
    if ((st = check_cfg(ctx, &cfg, d, dn)))
        return st;
    if ((st = check_operands(ctx, a, b, 0)))
        return st;
    if ((st = check_alias(ctx, d, dn, a, b)))
        return st;
    if (!ctx->be->gemm)
        return fm_error(ctx, FM_ERR_UNSUPPORTED, "%s: the %s backend does not implement it", op, ctx->be->name);
    if ((st = ctx->be->gemm(ctx, &cfg, a->t, b->t, d)))
        return st;
    count(ctx, FM_OP_GEMM, &cfg, tensor_bytes(a->orig) + tensor_bytes(b->orig), d);
    return FM_OK;
}

/* Descriptor rules and ndim for the operands and the output. */
static fm_status check_descs(fm_context *ctx, const fm_tensor *x, const char *xn, int xdim, const fm_tensor *y,
                             const char *yn, int ydim, const fm_tensor *d, const char *dn, int ddim)
{
    fm_status st;
    if ((st = fm_check_tensor(ctx, x, xn, 0)))
        return st;
    if (x->ndim != xdim)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: must be %d-D, got ndim %d", xn, xdim, x->ndim);
    if ((st = fm_check_tensor(ctx, y, yn, 0)))
        return st;
    if (y->ndim != ydim)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: must be %d-D, got ndim %d", yn, ydim, y->ndim);
    return check_output(ctx, d, dn, ddim);
}

static fm_status shape_error(fm_context *ctx, const char *name, const char *want, const fm_tensor *t)
{
    return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: must be %s; got [%lld, %lld]", name, want,
                    (long long)rows_of(t), (long long)cols_of(t));
}

fm_status fm_gemm(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *a, const fm_tensor *b, fm_tensor *d)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_status st = check_descs(ctx, a, "a", 2, b, "b", 2, d, "d", 2);
    if (st)
        return st;
    char want[96];
    if (cols_of(b) != cols_of(a)) {
        snprintf(want, sizeof want, "[N, K] with K = %lld (a's columns)", (long long)cols_of(a));
        return shape_error(ctx, "b", want, b);
    }
    if (rows_of(d) != rows_of(a) || cols_of(d) != rows_of(b)) {
        snprintf(want, sizeof want, "[M, N] = [%lld, %lld] (a's rows, b's rows)", (long long)rows_of(a),
                 (long long)rows_of(b));
        return shape_error(ctx, "d", want, d);
    }
    operand oa = {a, a, "a", "an FP8 A [M, K] must be stored with K contiguous: pass its row-wise copy"};
    operand ob = {b, b, "b", "an FP8 B [N, K] must be stored with K contiguous: pass its row-wise copy"};
    return dense(ctx, cfg, &oa, &ob, d, "d", "fm_gemm");
}

fm_status fm_linear_forward(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *x, const fm_tensor *w,
                            fm_tensor *y)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_status st = check_descs(ctx, x, "x", 2, w, "w", 2, y, "y", 2);
    if (st)
        return st;
    char want[96];
    if (cols_of(w) != cols_of(x)) {
        snprintf(want, sizeof want, "[out, in] with in = %lld (x's columns)", (long long)cols_of(x));
        return shape_error(ctx, "w", want, w);
    }
    if (rows_of(y) != rows_of(x) || cols_of(y) != rows_of(w)) {
        snprintf(want, sizeof want, "[T, out] = [%lld, %lld] (x's rows, w's rows)", (long long)rows_of(x),
                 (long long)rows_of(w));
        return shape_error(ctx, "y", want, y);
    }
    operand ox = {x, x, "x", "the forward GEMM needs X's row-wise copy (K = in contiguous)"};
    operand ow = {w, w, "w", "the forward GEMM needs W's row-wise copy (K = in contiguous)"};
    return dense(ctx, cfg, &ox, &ow, y, "y", "fm_linear_forward");
}

fm_status fm_linear_dgrad(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *dy, const fm_tensor *w,
                          fm_tensor *dx)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_status st = check_descs(ctx, dy, "dy", 2, w, "w", 2, dx, "dx", 2);
    if (st)
        return st;
    char want[96];
    if (rows_of(w) != cols_of(dy)) {
        snprintf(want, sizeof want, "[out, in] with out = %lld (dy's columns)", (long long)cols_of(dy));
        return shape_error(ctx, "w", want, w);
    }
    if (rows_of(dx) != rows_of(dy) || cols_of(dx) != cols_of(w)) {
        snprintf(want, sizeof want, "[T, in] = [%lld, %lld] (dy's rows, w's columns)", (long long)rows_of(dy),
                 (long long)cols_of(w));
        return shape_error(ctx, "dx", want, dx);
    }
    /* dX = dY · W = dY · (Wᵀ)ᵀ: B is Wᵀ [in, out], K = out. */
    fm_tensor wt = fm_tensor_t(w);
    operand ody = {dy, dy, "dy", "the data-gradient GEMM needs dY's row-wise copy (K = out contiguous)"};
    operand ow = {&wt, w, "w", "the data-gradient GEMM needs W's column-wise copy (K = out contiguous)"};
    return dense(ctx, cfg, &ody, &ow, dx, "dx", "fm_linear_dgrad");
}

fm_status fm_linear_wgrad(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *dy, const fm_tensor *x,
                          fm_tensor *dw)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_status st = check_descs(ctx, dy, "dy", 2, x, "x", 2, dw, "dw", 2);
    if (st)
        return st;
    char want[96];
    if (rows_of(x) != rows_of(dy)) {
        snprintf(want, sizeof want, "[T, in] with T = %lld (dy's rows)", (long long)rows_of(dy));
        return shape_error(ctx, "x", want, x);
    }
    if (rows_of(dw) != cols_of(dy) || cols_of(dw) != cols_of(x)) {
        snprintf(want, sizeof want, "[out, in] = [%lld, %lld] (dy's columns, x's columns)", (long long)cols_of(dy),
                 (long long)cols_of(x));
        return shape_error(ctx, "dw", want, dw);
    }
    /* dW = dYᵀ · X = dYᵀ · (Xᵀ)ᵀ: A is dYᵀ [out, T], B is Xᵀ [in, T], K = T. */
    fm_tensor dyt = fm_tensor_t(dy), xt = fm_tensor_t(x);
    operand ody = {&dyt, dy, "dy", "the weight-gradient GEMM needs dY's column-wise copy (K = T contiguous)"};
    operand ox = {&xt, x, "x", "the weight-gradient GEMM needs X's column-wise copy (K = T contiguous)"};
    return dense(ctx, cfg, &ody, &ox, dw, "dw", "fm_linear_wgrad");
}

fm_status fm_grouped_gemm(fm_context *ctx, const fm_gemm_config *cfg_in, const fm_splits *splits,
                          const fm_tensor *a, const fm_tensor *b, fm_tensor *d)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_gemm_config cfg = cfg_in ? *cfg_in : (fm_gemm_config){0};
    fm_status st = check_descs(ctx, a, "a", 2, b, "b", 3, d, "d", 2);
    if (st)
        return st;
    char want[128];
    if (cols_of(b) != cols_of(a)) {
        snprintf(want, sizeof want, "[E, N, K] with K = %lld (a's columns)", (long long)cols_of(a));
        return fm_error(ctx, FM_ERR_INVALID_ARG, "b: must be %s; got [%lld, %lld, %lld]", want,
                        (long long)b->shape[0], (long long)b->shape[1], (long long)b->shape[2]);
    }
    if (rows_of(d) != rows_of(a) || cols_of(d) != rows_of(b)) {
        snprintf(want, sizeof want, "[sum M_i, N] = [%lld, %lld] (a's rows, b's rows per expert)",
                 (long long)rows_of(a), (long long)rows_of(b));
        return shape_error(ctx, "d", want, d);
    }
    /* Device-only split sizes (host NULL) spare the caller a device-to-host
     * copy: the native CUDA kernel reads them where they are. What cannot be
     * checked on the host, the kernel makes harmless (it clamps every size
     * and never writes past d's rows) and reports at the next
     * fm_context_synchronize. */
    int device_only = splits && !splits->host && splits->device;
    if (device_only) {
        if (ctx->kind != FM_BACKEND_CUDA)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "splits->host: NULL; the %s backend needs the group sizes in host memory", ctx->be->name);
        if (splits->groups != b->shape[0])
            return fm_error(ctx, FM_ERR_INVALID_ARG, "splits->groups: %lld, but b has %lld experts",
                            (long long)splits->groups, (long long)b->shape[0]);
        if ((uintptr_t)splits->device % sizeof(int64_t))
            return fm_error(ctx, FM_ERR_INVALID_ARG, "splits->device: %p is not 8-byte aligned",
                            (const void *)splits->device);
    } else if ((st = fm_check_splits(ctx, splits, rows_of(a), "a", b->shape[0], "b", "fm_grouped_gemm")))
        return st;
    if ((st = check_cfg(ctx, &cfg, d, "d")))
        return st;
    operand oa = {a, a, "a", "an FP8 A [sum M_i, K] must be stored with K contiguous: pass its row-wise copy"};
    operand ob = {b, b, "b", "an FP8 B [E, N, K] must be stored with K contiguous: pass its row-wise copy"};
    if ((st = check_operands(ctx, &oa, &ob, 0)))
        return st;
    if (is_fp8(a->dtype) && a->scale_mode == FM_SCALE_BLOCK_128x128)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "a: BLOCK_128x128 blocks would straddle the experts' row ranges; the grouped A takes "
                        "per-row scales (ROW, BLOCK_1x128) or TENSOR");
    if ((st = check_alias(ctx, d, "d", &oa, &ob)))
        return st;
    if (!ctx->be->grouped_gemm)
        return fm_error(ctx, FM_ERR_UNSUPPORTED, "fm_grouped_gemm: the %s backend does not implement it",
                        ctx->be->name);
    if ((st = ctx->be->grouped_gemm(ctx, &cfg, splits, a, b, d)))
        return st;
    count(ctx, FM_OP_GROUPED_GEMM, &cfg, tensor_bytes(a) + tensor_bytes(b), d);
    return FM_OK;
}

fm_status fm_grouped_gemm_wgrad(fm_context *ctx, const fm_gemm_config *cfg_in, const fm_splits *splits,
                                const fm_tensor *dy, const fm_tensor *x, fm_tensor *dw)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_gemm_config cfg = cfg_in ? *cfg_in : (fm_gemm_config){0};
    fm_status st = check_descs(ctx, dy, "dy", 2, x, "x", 2, dw, "dw", 3);
    if (st)
        return st;
    char want[128];
    if (rows_of(x) != rows_of(dy)) {
        snprintf(want, sizeof want, "[sum M_i, K] with sum M_i = %lld (dy's rows)", (long long)rows_of(dy));
        return shape_error(ctx, "x", want, x);
    }
    if (rows_of(dw) != cols_of(dy) || cols_of(dw) != cols_of(x))
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "dw: must be [E, N, K] = [E, %lld, %lld] (dy's columns, x's columns); got [%lld, %lld, %lld]",
                        (long long)cols_of(dy), (long long)cols_of(x), (long long)dw->shape[0],
                        (long long)dw->shape[1], (long long)dw->shape[2]);
    if ((st = fm_check_splits(ctx, splits, rows_of(dy), "dy", dw->shape[0], "dw", "fm_grouped_gemm_wgrad")))
        return st;
    if ((st = check_cfg(ctx, &cfg, dw, "dw")))
        return st;
    /* The FP8 rule speaks of the per-expert products dY_iᵀ [N, M_i] and
     * X_iᵀ [K, M_i]: K = M_i is contiguous in the grouped column-wise copy. */
    fm_tensor dyt = fm_tensor_t(dy), xt = fm_tensor_t(x);
    operand ody = {&dyt, dy, "dy",
                   "the k-grouped weight gradient needs dY's grouped column-wise copy (fm_transpose_scaled_grouped)"};
    operand ox = {&xt, x, "x",
                  "the k-grouped weight gradient needs X's grouped column-wise copy (fm_transpose_scaled_grouped)"};
    if ((st = check_operands(ctx, &ody, &ox, 1)))
        return st;
    const operand *ops[2] = {&ody, &ox};
    for (int i = 0; i < 2; i++) {
        const fm_tensor *t = ops[i]->orig;
        int64_t ns = fm_tensor_grouped_scale_count(t, splits);
        if (t->scale_mode && t->scale_capacity > 0 && ns * 4 > t->scale_capacity)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "%s: scale_capacity is %lld bytes but the grouped %s layout over these splits needs %lld",
                            ops[i]->name, (long long)t->scale_capacity, fm_scale_layout_name(t->scale_layout),
                            (long long)(ns * 4));
        const void *s = t->scale_mode ? t->scale : NULL;
        char nm[64];
        snprintf(nm, sizeof nm, "%s->scale", ops[i]->name);
        if ((st = fm_check_disjoint(ctx, dw->data, fm_tensor_nbytes(dw), "dw->data", t->data, fm_tensor_nbytes(t),
                                    ops[i]->name)) ||
            (st = fm_check_disjoint(ctx, dw->data, fm_tensor_nbytes(dw), "dw->data", s, ns * 4, nm)))
            return st;
    }
    if (!ctx->be->grouped_gemm_wgrad)
        return fm_error(ctx, FM_ERR_UNSUPPORTED, "fm_grouped_gemm_wgrad: the %s backend does not implement it",
                        ctx->be->name);
    if ((st = ctx->be->grouped_gemm_wgrad(ctx, &cfg, splits, dy, x, dw)))
        return st;
    int64_t rd = fm_tensor_nbytes(dy) + fm_tensor_nbytes(x) + 4 * (fm_tensor_grouped_scale_count(dy, splits) +
                                                                   fm_tensor_grouped_scale_count(x, splits));
    count(ctx, FM_OP_GROUPED_GEMM_WGRAD, &cfg, rd, dw);
    return FM_OK;
}
