/* Descriptor validation: once, in core, before any backend runs. */
#include <stdint.h>
#include <stdio.h>

#include "validate.h"

static int is_quant_elem(fm_dtype d)
{
    return d == FM_DTYPE_E4M3 || d == FM_DTYPE_E5M2 || d == FM_DTYPE_E2M1;
}

static int is_high(fm_dtype d) { return d == FM_DTYPE_F32 || d == FM_DTYPE_BF16 || d == FM_DTYPE_F16; }

fm_status fm_check_tensor(fm_context *ctx, const fm_tensor *t, const char *name, unsigned flags)
{
    const char *why;
    if (!t)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: the descriptor pointer is NULL", name);
    if (!fm_tensor_shape_ok(t, &why))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: invalid shape (ndim %d): %s", name, t->ndim, why);
    if ((unsigned)t->dtype >= FM_DTYPE_COUNT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: dtype %d is not an fm_dtype", name, (int)t->dtype);
    if ((unsigned)t->layout >= FM_LAYOUT_COUNT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: layout %d is neither ROWWISE nor COLWISE", name,
                        (int)t->layout);
    if ((unsigned)t->device >= FM_DEVICE_COUNT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: device %d is neither HOST nor CUDA", name, (int)t->device);
    if ((unsigned)t->scale_mode >= FM_SCALE_MODE_COUNT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: scale_mode %d is not an fm_scale_mode", name,
                        (int)t->scale_mode);
    if ((unsigned)t->scale_layout >= FM_SCALE_LAYOUT_COUNT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: scale_layout %d is neither COMPACT nor GEMM", name,
                        (int)t->scale_layout);
    if ((flags & FM_CHK_ROWWISE) && t->layout != FM_LAYOUT_ROWWISE)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: must be row-wise (layout ROWWISE), got %s", name,
                        fm_layout_name(t->layout));
    if ((flags & FM_CHK_COLWISE) && t->layout != FM_LAYOUT_COLWISE)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: must be column-wise (layout COLWISE), got %s", name,
                        fm_layout_name(t->layout));
    if ((flags & FM_CHK_HIGH) && !is_high(t->dtype))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: dtype must be F32, BF16 or F16, got %s", name,
                        fm_dtype_name(t->dtype));
    if ((flags & FM_CHK_UNSCALED) && t->scale_mode != FM_SCALE_NONE)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: must be unscaled (scale_mode NONE), got %s", name,
                        fm_scale_mode_name(t->scale_mode));

    if (flags & FM_CHK_QUANT) {
        if (!is_quant_elem(t->dtype))
            return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: dtype must be E4M3, E5M2 or E2M1, got %s", name,
                            fm_dtype_name(t->dtype));
        if (t->scale_mode == FM_SCALE_NONE)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: a quantized tensor needs a scale_mode, got NONE", name);
        if (t->scale_mode == FM_SCALE_NV16)
            return fm_error(ctx, FM_ERR_UNSUPPORTED, "%s: scale_mode NV16 (NVFP4) is reserved and not implemented",
                            name);
        if (t->dtype == FM_DTYPE_E2M1 && t->scale_mode != FM_SCALE_MX32)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "%s: E2M1 elements need scale_mode MX32 (MXFP4), got %s", name,
                            fm_scale_mode_name(t->scale_mode));
    }
    /* Any scaled tensor, whatever the op accepts it as: the scale entries'
     * size follows from scale_dtype, and a backend reads what the mode says. */
    if (t->scale_mode != FM_SCALE_NONE) {
        if (t->scale_mode == FM_SCALE_NV16)
            return fm_error(ctx, FM_ERR_UNSUPPORTED, "%s: scale_mode NV16 (NVFP4) is reserved and not implemented",
                            name);
        fm_dtype want = fm_scale_mode_dtype(t->scale_mode);
        if (t->scale_dtype != want)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: scale_mode %s needs scale_dtype %s, got %s", name,
                            fm_scale_mode_name(t->scale_mode), fm_dtype_name(want), fm_dtype_name(t->scale_dtype));
        if (fm_tensor_scale_nbytes(t) < 0)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: the scale array of scale_mode %s over this shape is too "
                            "large to address", name, fm_scale_mode_name(t->scale_mode));
    }
    if (t->dtype == FM_DTYPE_E2M1 && (fm_tensor_stored_cols(t) & 1))
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "%s: E2M1 packs two codes per byte, so each stored row needs an even length; "
                        "stored rows have %lld elements",
                        name, (long long)fm_tensor_stored_cols(t));

    fm_device want_dev = fm_context_device(ctx);
    if (t->device != want_dev)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "%s: device is %s but the %s context works on %s memory", name,
                        t->device == FM_DEVICE_CUDA ? "CUDA" : "HOST", fm_context_backend_name(ctx),
                        want_dev == FM_DEVICE_CUDA ? "CUDA" : "HOST");

    int64_t numel = fm_tensor_numel(t);
    int want_data = !(flags & FM_CHK_SCALES_ONLY);
    if (want_data && numel > 0 && !t->data)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: data is NULL for a tensor of %lld elements", name,
                        (long long)numel);
    int ebytes = fm_dtype_bits(t->dtype) / 8;
    if (want_data && numel > 0 && ebytes > 1 && ((uintptr_t)t->data % (uintptr_t)ebytes))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: data %p is not aligned to its %d-byte %s elements", name,
                        t->data, ebytes, fm_dtype_name(t->dtype));

    int64_t need = fm_tensor_nbytes(t);
    if (want_data && t->data_capacity > 0 && need > t->data_capacity)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "%s: data_capacity is %lld bytes but the shape needs %lld", name,
                        (long long)t->data_capacity, (long long)need);
    if (t->scale_mode != FM_SCALE_NONE) {
        int64_t ns = fm_tensor_scale_count(t);
        int64_t sneed = fm_tensor_scale_nbytes(t);
        if (t->scale_capacity > 0 && sneed > t->scale_capacity)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "%s: scale_capacity is %lld bytes but scale_mode %s in the %s layout needs %lld", name,
                            (long long)t->scale_capacity, fm_scale_mode_name(t->scale_mode),
                            fm_scale_layout_name(t->scale_layout), (long long)sneed);
        if (ns > 0 && !t->scale)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: scale is NULL but scale_mode %s needs %lld entries", name,
                            fm_scale_mode_name(t->scale_mode), (long long)ns);
        int sbytes = fm_dtype_bits(t->scale_dtype) / 8;
        if (ns > 0 && sbytes > 1 && ((uintptr_t)t->scale % (uintptr_t)sbytes))
            return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: scale %p is not aligned to its %d-byte %s entries", name,
                            t->scale, sbytes, fm_dtype_name(t->scale_dtype));
    }

    /* Where the runtime can tell, catch a pointer in the wrong memory. */
    if (want_data && numel > 0) {
        int dev = fm_cuda_pointer_is_device(t->data);
        if (dev == 1 && t->device == FM_DEVICE_HOST)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: data %p is CUDA device memory but the descriptor says HOST",
                            name, t->data);
        if (dev == 0 && t->device == FM_DEVICE_CUDA)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "%s: data %p is host memory but the descriptor says CUDA (device pointers only)", name,
                            t->data);
    }
    if (t->scale_mode != FM_SCALE_NONE && t->scale && fm_tensor_scale_count(t) > 0) {
        int dev = fm_cuda_pointer_is_device(t->scale);
        if (dev == 1 && t->device == FM_DEVICE_HOST)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "%s: scale %p is CUDA device memory but the descriptor says HOST", name, t->scale);
        if (dev == 0 && t->device == FM_DEVICE_CUDA)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "%s: scale %p is host memory but the descriptor says CUDA (device pointers only)", name,
                            t->scale);
    }
    return FM_OK;
}

fm_status fm_check_same_shape(fm_context *ctx, const fm_tensor *a, const char *an, const fm_tensor *b,
                              const char *bn)
{
    int same = a->ndim == b->ndim;
    for (int i = 0; same && i < a->ndim; i++)
        same = a->shape[i] == b->shape[i];
    if (!same) {
        long long s[2][3] = {{0}};
        for (int i = 0; i < 3; i++) {
            s[0][i] = i < a->ndim ? (long long)a->shape[i] : -1;
            s[1][i] = i < b->ndim ? (long long)b->shape[i] : -1;
        }
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "%s: logical shape must equal %s's; got ndim %d [%lld, %lld, %lld] vs ndim %d [%lld, %lld, %lld] "
                        "(-1 = absent)",
                        bn, an, b->ndim, s[1][0], s[1][1], s[1][2], a->ndim, s[0][0], s[0][1], s[0][2]);
    }
    return FM_OK;
}

fm_status fm_check_disjoint(fm_context *ctx, const void *p, int64_t pn, const char *pname, const void *q, int64_t qn,
                            const char *qname)
{
    if (!p || !q || pn <= 0 || qn <= 0)
        return FM_OK;
    uintptr_t a0 = (uintptr_t)p, a1 = a0 + (uintptr_t)pn, b0 = (uintptr_t)q, b1 = b0 + (uintptr_t)qn;
    if (a0 < b1 && b0 < a1)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "%s and %s overlap in memory; an output may not alias another buffer of the call", pname,
                        qname);
    return FM_OK;
}

fm_status fm_check_no_alias(fm_context *ctx, const fm_tensor *out, const char *on, const fm_tensor *other,
                            const char *tn)
{
    char a[96], b[96];
    int64_t od = fm_tensor_nbytes(out), td = fm_tensor_nbytes(other);
    int64_t os = fm_tensor_scale_nbytes(out), ts = fm_tensor_scale_nbytes(other);
    const void *obuf[2] = {out->data, out->scale}, *tbuf[2] = {other->data, other->scale};
    int64_t on_[2] = {od, out->scale_mode ? os : 0}, tn_[2] = {td, other->scale_mode ? ts : 0};
    static const char *what[2] = {"data", "scale"};
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
            snprintf(a, sizeof a, "%s->%s", on, what[i]);
            snprintf(b, sizeof b, "%s->%s", tn, what[j]);
            fm_status st = fm_check_disjoint(ctx, obuf[i], on_[i], a, tbuf[j], tn_[j], b);
            if (st)
                return st;
        }
    return FM_OK;
}

fm_status fm_check_splits(fm_context *ctx, const fm_splits *splits, int64_t rows, const char *rows_name,
                          int64_t groups, const char *groups_owner, const char *op)
{
    if (!splits)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "splits: the pointer is NULL; %s needs the group sizes", op);
    if (groups >= 0 && splits->groups != groups)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "splits->groups: %lld, but %s has %lld experts",
                        (long long)splits->groups, groups_owner, (long long)groups);
    if (splits->groups < 1 || splits->groups > ((int64_t)1 << 24))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "splits->groups: %lld is outside 1..2^24",
                        (long long)splits->groups);
    if (!splits->host)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "splits->host: NULL; %s needs the group sizes in host memory (its work is sized on the "
                        "host)",
                        op);
    int64_t sum = 0;
    for (int64_t g = 0; g < splits->groups; g++) {
        int64_t m = splits->host[g];
        if (m < 0)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "splits->host[%lld]: %lld rows; sizes must be >= 0",
                            (long long)g, (long long)m);
        if (m > rows - sum)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "splits->host: the sizes sum past %s's %lld rows (at group %lld)",
                            rows_name, (long long)rows, (long long)g);
        sum += m;
    }
    if (sum != rows)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "splits->host: the sizes sum to %lld but %s has %lld rows",
                        (long long)sum, rows_name, (long long)rows);
    if (splits->device && ((uintptr_t)splits->device % sizeof(int64_t)))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "splits->device: %p is not 8-byte aligned",
                        (const void *)splits->device);
    return FM_OK;
}

fm_status fm_check_mat(fm_context *ctx, const fm_tensor *t, const char *name, unsigned flags, fm_dtype dtype,
                       int64_t rows, int64_t cols)
{
    fm_status st = fm_check_tensor(ctx, t, name, flags);
    if (st)
        return st;
    if (t->ndim != 2)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: must be a 2-D tensor, got ndim %d", name, t->ndim);
    if (dtype != FM_DTYPE_COUNT && t->dtype != dtype)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: dtype must be %s, got %s", name, fm_dtype_name(dtype),
                        fm_dtype_name(t->dtype));
    if ((rows >= 0 && t->shape[0] != rows) || (cols >= 0 && t->shape[1] != cols))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: shape must be [%lld, %lld] (-1 = any), got [%lld, %lld]", name,
                        (long long)rows, (long long)cols, (long long)t->shape[0], (long long)t->shape[1]);
    return FM_OK;
}

fm_status fm_check_rows(fm_context *ctx, const fm_tensor *t, const char *name, int64_t rows, int64_t cols,
                        int allow_quant)
{
    fm_status st = fm_check_tensor(ctx, t, name, FM_CHK_ROWWISE);
    if (st)
        return st;
    int high = t->dtype == FM_DTYPE_F32 || t->dtype == FM_DTYPE_BF16 || t->dtype == FM_DTYPE_F16;
    if (high)
        return fm_check_mat(ctx, t, name, FM_CHK_ROWWISE | FM_CHK_UNSCALED | FM_CHK_HIGH, FM_DTYPE_COUNT, rows, cols);
    if (!allow_quant)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: dtype must be F32, BF16 or F16, got %s", name,
                        fm_dtype_name(t->dtype));
    if ((st = fm_check_mat(ctx, t, name, FM_CHK_ROWWISE | FM_CHK_QUANT, FM_DTYPE_COUNT, rows, cols)))
        return st;
    if (t->scale_mode != FM_SCALE_BLOCK_1x128 && t->scale_mode != FM_SCALE_MX32)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "%s: quantized rows must use BLOCK_1x128 or MX32 scales (row blocks), got %s", name,
                        fm_scale_mode_name(t->scale_mode));
    if (t->scale_layout != FM_SCALE_LAYOUT_COMPACT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: scales must be in the COMPACT layout, got %s", name,
                        fm_scale_layout_name(t->scale_layout));
    return FM_OK;
}
