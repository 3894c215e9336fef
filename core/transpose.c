/* Public scaling-aware transpose and direct conversion: validate, count,
 * dispatch to the backend's one re-encoding op. */
#include "validate.h"

static int block_mode(fm_scale_mode m) { return m == FM_SCALE_BLOCK_1x128 || m == FM_SCALE_MX32; }

static fm_status check_requant(fm_context *ctx, const fm_requant_config *cfg, const fm_tensor *in,
                               const fm_tensor *out, int transpose)
{
    fm_status st;
    if ((unsigned)cfg->rule >= FM_REQUANT_RULE_COUNT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->rule: %d is not an fm_requant_rule", (int)cfg->rule);
    if ((st = fm_check_tensor(ctx, in, "in", FM_CHK_QUANT)))
        return st;
    if ((st = fm_check_tensor(ctx, out, "out", FM_CHK_QUANT)))
        return st;
    if ((st = fm_check_same_shape(ctx, in, "in", out, "out")))
        return st;
    if (transpose && in->layout == out->layout)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "out: a transpose needs the other layout than in (both are %s); use fm_convert_scaled "
                        "to change the format in place",
                        fm_layout_name(in->layout));
    if (!transpose && in->layout != out->layout)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "out: fm_convert_scaled keeps the layout (in is %s, out is %s); use fm_transpose_scaled",
                        fm_layout_name(in->layout), fm_layout_name(out->layout));
    int exact128 = in->scale_mode == FM_SCALE_BLOCK_128x128 || out->scale_mode == FM_SCALE_BLOCK_128x128;
    if (exact128) {
        if (!transpose || in->scale_mode != out->scale_mode || in->dtype != out->dtype)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "in, out: BLOCK_128x128 supports only the exact transpose to BLOCK_128x128 of the same "
                            "dtype (got %s %s -> %s %s)",
                            fm_dtype_name(in->dtype), fm_scale_mode_name(in->scale_mode), fm_dtype_name(out->dtype),
                            fm_scale_mode_name(out->scale_mode));
    } else {
        if (!block_mode(in->scale_mode))
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "in: scale_mode must be BLOCK_1x128 or MX32 (power-of-two block scales), got %s",
                            fm_scale_mode_name(in->scale_mode));
        if (!block_mode(out->scale_mode))
            return fm_error(ctx, FM_ERR_INVALID_ARG, "out: scale_mode must be BLOCK_1x128 or MX32, got %s",
                            fm_scale_mode_name(out->scale_mode));
    }
    if (cfg->rule == FM_REQUANT_ROWMAX &&
        (!transpose || in->dtype != out->dtype || in->scale_mode != out->scale_mode))
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "cfg->rule: ROWMAX applies to transposes that keep dtype and scale mode (got %s %s -> %s %s, "
                        "%s)",
                        fm_dtype_name(in->dtype), fm_scale_mode_name(in->scale_mode), fm_dtype_name(out->dtype),
                        fm_scale_mode_name(out->scale_mode), transpose ? "transpose" : "convert");
    if (cfg->rule == FM_REQUANT_MX_FLOOR && out->scale_mode != FM_SCALE_MX32)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->rule: MX_FLOOR applies to MX32 outputs only, out is %s",
                        fm_scale_mode_name(out->scale_mode));
    if (cfg->nonfinite_blocks && ((uintptr_t)cfg->nonfinite_blocks % sizeof(int64_t)))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->nonfinite_blocks: %p is not 8-byte aligned",
                        (void *)cfg->nonfinite_blocks);
    if ((st = fm_check_no_alias(ctx, out, "out", in, "in")))
        return st;
    return fm_check_disjoint(ctx, out->data, fm_tensor_nbytes(out), "out->data", out->scale,
                             fm_tensor_scale_nbytes(out), "out->scale");
}

static fm_status requant(fm_context *ctx, const fm_requant_config *cfg_in, const fm_tensor *in, fm_tensor *out,
                         int transpose)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_requant_config cfg = cfg_in ? *cfg_in : (fm_requant_config){0};
    fm_status st = check_requant(ctx, &cfg, in, out, transpose);
    if (st)
        return st;
    const char *op = transpose ? "fm_transpose_scaled" : "fm_convert_scaled";
    if (!ctx->be->requantize)
        return fm_error(ctx, FM_ERR_UNSUPPORTED, "%s: the %s backend does not implement it yet", op, ctx->be->name);
    if ((st = ctx->be->requantize(ctx, &cfg, in, out)))
        return st;
    /* Not a cast: codes stay low precision from end to end. */
    fm_op k = transpose ? FM_OP_TRANSPOSE_SCALED : FM_OP_CONVERT_SCALED;
    ctx->stats.calls[k]++;
    ctx->stats.op_calls++;
    ctx->stats.bytes_read += fm_tensor_nbytes(in) + fm_tensor_scale_nbytes(in);
    ctx->stats.bytes_written += fm_tensor_nbytes(out) + fm_tensor_scale_nbytes(out);
    return FM_OK;
}

fm_status fm_transpose_scaled(fm_context *ctx, const fm_requant_config *cfg, const fm_tensor *in, fm_tensor *out)
{
    return requant(ctx, cfg, in, out, 1);
}

fm_status fm_convert_scaled(fm_context *ctx, const fm_requant_config *cfg, const fm_tensor *in, fm_tensor *out)
{
    return requant(ctx, cfg, in, out, 0);
}
