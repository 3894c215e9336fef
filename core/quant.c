/* Public quantize / dequantize / scale-layout ops: validate, count, dispatch. */
#include <stdio.h>

#include "validate.h"

static fm_status check_output_self(fm_context *ctx, const fm_tensor *t, const char *name)
{
    char a[64], b[64];
    snprintf(a, sizeof a, "%s->data", name);
    snprintf(b, sizeof b, "%s->scale", name);
    return fm_check_disjoint(ctx, t->data, fm_tensor_nbytes(t), a, t->scale, fm_tensor_scale_nbytes(t), b);
}

static void count(fm_context *ctx, fm_op op, int64_t rd, int64_t wr)
{
    ctx->stats.calls[op]++;
    ctx->stats.op_calls++;
    ctx->stats.bytes_read += rd;
    ctx->stats.bytes_written += wr;
}

static int64_t tensor_bytes(const fm_tensor *t)
{
    if (!t)
        return 0;
    return fm_tensor_nbytes(t) + (t->scale_mode ? fm_tensor_scale_nbytes(t) : 0);
}

static fm_status check_quant_output(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *in,
                                    const fm_tensor *out, const char *name, unsigned layout_flag)
{
    fm_status st = fm_check_tensor(ctx, out, name, FM_CHK_QUANT | layout_flag);
    if (st)
        return st;
    if ((st = fm_check_same_shape(ctx, in, "in", out, name)))
        return st;
    fm_scale_rule r = fm_effective_rule(cfg->rule, out->scale_mode);
    if (out->scale_mode == FM_SCALE_MX32 && r == FM_SCALE_RULE_EXACT)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "cfg->rule: EXACT scales are not powers of two and cannot be stored as E8M0 (%s is MX32); "
                        "use POW2 or MX_FLOOR",
                        name);
    if (out->scale_mode != FM_SCALE_MX32 && r == FM_SCALE_RULE_MX_FLOOR)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->rule: MX_FLOOR applies to MX32 only, %s is %s", name,
                        fm_scale_mode_name(out->scale_mode));
    if ((st = fm_check_no_alias(ctx, out, name, in, "in")))
        return st;
    return check_output_self(ctx, out, name);
}

/* cfg->amax and cfg->nonfinite_blocks are written too: like the outputs, they
 * may not alias the input or an output's data or scale. */
static fm_status check_cfg_output(fm_context *ctx, const void *p, int64_t n, const char *pname, const fm_tensor *in,
                                  const fm_tensor *out_row, const fm_tensor *out_col)
{
    const fm_tensor *t[3] = {in, out_row, out_col};
    static const char *tn[3] = {"in", "out_rowwise", "out_colwise"};
    char b[64];
    fm_status st;
    for (int i = 0; i < 3; i++) {
        if (!t[i])
            continue;
        snprintf(b, sizeof b, "%s->data", tn[i]);
        if ((st = fm_check_disjoint(ctx, p, n, pname, t[i]->data, fm_tensor_nbytes(t[i]), b)))
            return st;
        snprintf(b, sizeof b, "%s->scale", tn[i]);
        if (t[i]->scale_mode &&
            (st = fm_check_disjoint(ctx, p, n, pname, t[i]->scale, fm_tensor_scale_nbytes(t[i]), b)))
            return st;
    }
    return FM_OK;
}

fm_status fm_quantize(fm_context *ctx, const fm_quant_config *cfg_in, const fm_tensor *in, fm_tensor *out_row,
                      fm_tensor *out_col)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_quant_config cfg = cfg_in ? *cfg_in : (fm_quant_config){0};
    fm_status st;
    if ((unsigned)cfg.rule >= FM_SCALE_RULE_COUNT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->rule: %d is not an fm_scale_rule", (int)cfg.rule);
    if (!(cfg.epsilon >= 0.0f) || !fm_f32_is_finite(cfg.epsilon))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->epsilon: must be finite and >= 0, got %g",
                        (double)cfg.epsilon);
    if ((st = fm_check_tensor(ctx, in, "in", FM_CHK_HIGH | FM_CHK_UNSCALED | FM_CHK_ROWWISE)))
        return st;
    if (!out_row && !out_col)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "out_rowwise, out_colwise: both are NULL; give at least one");
    if (out_row && (st = check_quant_output(ctx, &cfg, in, out_row, "out_rowwise", FM_CHK_ROWWISE)))
        return st;
    if (out_col && (st = check_quant_output(ctx, &cfg, in, out_col, "out_colwise", FM_CHK_COLWISE)))
        return st;
    if (out_row && out_col && (st = fm_check_no_alias(ctx, out_row, "out_rowwise", out_col, "out_colwise")))
        return st;
    if (cfg.amax && ((uintptr_t)cfg.amax % sizeof(float)))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->amax: %p is not 4-byte aligned", (void *)cfg.amax);
    if (cfg.nonfinite_blocks && ((uintptr_t)cfg.nonfinite_blocks % sizeof(int64_t)))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->nonfinite_blocks: %p is not 8-byte aligned",
                        (void *)cfg.nonfinite_blocks);
    if (cfg.amax && (st = check_cfg_output(ctx, cfg.amax, sizeof(float), "cfg->amax", in, out_row, out_col)))
        return st;
    if (cfg.nonfinite_blocks && (st = check_cfg_output(ctx, cfg.nonfinite_blocks, sizeof(int64_t),
                                                       "cfg->nonfinite_blocks", in, out_row, out_col)))
        return st;
    if ((st = fm_check_disjoint(ctx, cfg.amax, sizeof(float), "cfg->amax", cfg.nonfinite_blocks, sizeof(int64_t),
                                "cfg->nonfinite_blocks")))
        return st;
    /* The optional outputs live where the input does (no host round trip on CUDA). */
    void *opt[2] = {cfg.amax, cfg.nonfinite_blocks};
    static const char *optn[2] = {"cfg->amax", "cfg->nonfinite_blocks"};
    for (int i = 0; i < 2; i++) {
        int dev = opt[i] ? fm_cuda_pointer_is_device(opt[i]) : -1;
        if ((dev == 0 && in->device == FM_DEVICE_CUDA) || (dev == 1 && in->device == FM_DEVICE_HOST))
            return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: %p is %s memory but the input lives on %s; it must be %s",
                            optn[i], opt[i], dev ? "CUDA device" : "host", in->device == FM_DEVICE_CUDA ? "CUDA" : "HOST",
                            in->device == FM_DEVICE_CUDA ? "device memory" : "host memory");
    }
    if (!ctx->be->quantize)
        return fm_error(ctx, FM_ERR_UNSUPPORTED, "fm_quantize: the %s backend does not implement it", ctx->be->name);
    if ((st = ctx->be->quantize(ctx, &cfg, in, out_row, out_col)))
        return st;
    ctx->stats.casts_to_low++;
    count(ctx, FM_OP_QUANTIZE, tensor_bytes(in), tensor_bytes(out_row) + tensor_bytes(out_col));
    return FM_OK;
}

fm_status fm_dequantize(fm_context *ctx, const fm_tensor *in, fm_tensor *out)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_status st;
    if ((st = fm_check_tensor(ctx, in, "in", FM_CHK_QUANT)))
        return st;
    if ((st = fm_check_tensor(ctx, out, "out", FM_CHK_HIGH | FM_CHK_UNSCALED)))
        return st;
    if ((st = fm_check_same_shape(ctx, in, "in", out, "out")))
        return st;
    if ((st = fm_check_no_alias(ctx, out, "out", in, "in")))
        return st;
    if (!ctx->be->dequantize)
        return fm_error(ctx, FM_ERR_UNSUPPORTED, "fm_dequantize: the %s backend does not implement it",
                        ctx->be->name);
    if ((st = ctx->be->dequantize(ctx, in, out)))
        return st;
    ctx->stats.casts_to_high++;
    count(ctx, FM_OP_DEQUANTIZE, tensor_bytes(in), tensor_bytes(out));
    return FM_OK;
}

fm_status fm_scale_layout_convert(fm_context *ctx, const fm_tensor *src, fm_tensor *dst)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_status st;
    if ((st = fm_check_tensor(ctx, src, "src", FM_CHK_QUANT | FM_CHK_SCALES_ONLY)))
        return st;
    if ((st = fm_check_tensor(ctx, dst, "dst", FM_CHK_QUANT | FM_CHK_SCALES_ONLY)))
        return st;
    if ((st = fm_check_same_shape(ctx, src, "src", dst, "dst")))
        return st;
    if (src->dtype != dst->dtype || src->layout != dst->layout || src->scale_mode != dst->scale_mode)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "dst: must describe the same tensor as src (dtype %s/%s, layout %s/%s, scale_mode %s/%s); "
                        "only scale_layout may differ",
                        fm_dtype_name(src->dtype), fm_dtype_name(dst->dtype), fm_layout_name(src->layout),
                        fm_layout_name(dst->layout), fm_scale_mode_name(src->scale_mode),
                        fm_scale_mode_name(dst->scale_mode));
    if ((st = fm_check_disjoint(ctx, dst->scale, fm_tensor_scale_nbytes(dst), "dst->scale", src->scale,
                                fm_tensor_scale_nbytes(src), "src->scale")))
        return st;
    if (!ctx->be->scale_layout_convert)
        return fm_error(ctx, FM_ERR_UNSUPPORTED, "fm_scale_layout_convert: the %s backend does not implement it",
                        ctx->be->name);
    if ((st = ctx->be->scale_layout_convert(ctx, src, dst)))
        return st;
    count(ctx, FM_OP_SCALE_LAYOUT_CONVERT, fm_tensor_scale_nbytes(src), fm_tensor_scale_nbytes(dst));
    return FM_OK;
}

/* Group g of a grouped column-wise tensor, as a standalone column-wise
 * matrix [rows, C]: its data after the earlier groups' and its scale array
 * after theirs (the layout fm_transpose_scaled_grouped writes). */
static fm_tensor group_colwise_view(const fm_tensor *t, int64_t row0, int64_t rows, int64_t scale0)
{
    fm_tensor v = *t;
    v.shape[0] = rows;
    int64_t C = t->shape[1];
    v.data = (uint8_t *)t->data + row0 * C * fm_dtype_bits(t->dtype) / 8;
    v.scale = (uint8_t *)t->scale + scale0 * (t->scale_dtype == FM_DTYPE_E8M0 ? 1 : 4);
    v.data_capacity = 0;
    v.scale_capacity = 0;
    return v;
}

static fm_tensor row_slice(const fm_tensor *t, int64_t row0, int64_t rows)
{
    fm_tensor v = *t;
    v.shape[0] = rows;
    v.data = (uint8_t *)t->data + row0 * t->shape[1] * fm_dtype_bits(t->dtype) / 8;
    if (t->scale_mode)
        v.scale = (uint8_t *)t->scale +
                  row0 * (fm_tensor_scale_count(t) / (t->shape[0] ? t->shape[0] : 1)) *
                      (t->scale_dtype == FM_DTYPE_E8M0 ? 1 : 4);
    v.data_capacity = 0;
    v.scale_capacity = 0;
    return v;
}

fm_status fm_quantize_grouped(fm_context *ctx, const fm_quant_config *cfg_in, const fm_splits *splits,
                              const fm_tensor *in, fm_tensor *out_row, fm_tensor *out_col)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_quant_config cfg = cfg_in ? *cfg_in : (fm_quant_config){0};
    fm_status st;
    if (cfg.amax || cfg.nonfinite_blocks)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "cfg->amax, cfg->nonfinite_blocks: not produced by fm_quantize_grouped; leave them NULL "
                        "(fm_quantize gives them for the whole tensor)");
    if ((st = fm_check_tensor(ctx, in, "in", FM_CHK_HIGH | FM_CHK_UNSCALED | FM_CHK_ROWWISE)))
        return st;
    if (in->ndim != 2)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "in: must be 2-D [rows, cols] (the groups split the rows)");
    if ((st = fm_check_splits(ctx, splits, in->shape[0], "in", -1, NULL, "fm_quantize_grouped")))
        return st;
    if (!out_row && !out_col)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "out_rowwise, out_colwise: both are NULL; give at least one");
    if (out_row && (st = check_quant_output(ctx, &cfg, in, out_row, "out_rowwise", FM_CHK_ROWWISE)))
        return st;
    if (out_col) {
        /* The whole-tensor checks except the scale size, which is the groups' sum. */
        fm_tensor whole = *out_col;
        whole.scale_capacity = 0;
        if ((st = check_quant_output(ctx, &cfg, in, &whole, "out_colwise", FM_CHK_COLWISE)))
            return st;
        for (int64_t g = 0; g < splits->groups; g++)
            if (out_col->dtype == FM_DTYPE_E2M1 && (splits->host[g] & 1))
                return fm_error(ctx, FM_ERR_INVALID_ARG,
                                "splits->host[%lld]: %lld is odd; an E2M1 column-wise group stores its rows as "
                                "packed pairs, so every group size must be even",
                                (long long)g, (long long)splits->host[g]);
        int64_t need = fm_tensor_grouped_scale_count(out_col, splits);
        int64_t bytes = need * (out_col->scale_dtype == FM_DTYPE_E8M0 ? 1 : 4);
        if (out_col->scale_capacity && out_col->scale_capacity < bytes)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "out_colwise->scale_capacity: %lld bytes, the grouped layout needs %lld",
                            (long long)out_col->scale_capacity, (long long)bytes);
        if (out_row && (st = fm_check_no_alias(ctx, out_row, "out_rowwise", out_col, "out_colwise")))
            return st;
    }
    if (!ctx->be->quantize)
        return fm_error(ctx, FM_ERR_UNSUPPORTED, "fm_quantize_grouped: the %s backend does not implement it",
                        ctx->be->name);
    /* Row-wise scales in the GEMM layout interleave the groups, and TENSOR or
     * 128x128 scales span them: one call for the whole row-wise output then,
     * and column-wise per group. Row-local compact scales go group by group
     * with the column-wise output, in one pass over each group's input. */
    int row_local = out_row && out_row->scale_layout == FM_SCALE_LAYOUT_COMPACT &&
                    (out_row->scale_mode == FM_SCALE_ROW || out_row->scale_mode == FM_SCALE_BLOCK_1x128 ||
                     out_row->scale_mode == FM_SCALE_MX32);
    int row_whole = out_row && !row_local;
    if (row_whole && (st = ctx->be->quantize(ctx, &cfg, in, out_row, NULL)))
        return st;
    int64_t r0 = 0, s0 = 0;
    for (int64_t g = 0; g < splits->groups; g++) {
        int64_t m = splits->host[g];
        if (m == 0)
            continue;
        fm_tensor ig = row_slice(in, r0, m), rg, cg;
        if (out_row && !row_whole)
            rg = row_slice(out_row, r0, m);
        if (out_col)
            cg = group_colwise_view(out_col, r0, m, s0);
        fm_tensor *rp = out_row && !row_whole ? &rg : NULL, *cp = out_col ? &cg : NULL;
        if ((rp || cp) && (st = ctx->be->quantize(ctx, &cfg, &ig, rp, cp)))
            return st;
        if (out_col)
            s0 += fm_tensor_scale_count(&cg);
        r0 += m;
    }
    ctx->stats.casts_to_low++;
    count(ctx, FM_OP_QUANTIZE_GROUPED, tensor_bytes(in), tensor_bytes(out_row) + tensor_bytes(out_col));
    return FM_OK;
}
