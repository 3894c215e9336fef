/* Public scaling-aware transpose and direct conversion: validate, count,
 * dispatch to the backend's one re-encoding op. */
#include "validate.h"

static int block_mode(fm_scale_mode m) { return m == FM_SCALE_BLOCK_1x128 || m == FM_SCALE_MX32; }

/* FP8 1x128 -> 128x128 under ROWMAX: every 128 x 1 output block of a tile
 * gets the same exponent (the tile's largest row exponent), so the tile's
 * one scale says it all. */
static int tile_rowmax(const fm_requant_config *cfg, const fm_tensor *in, const fm_tensor *out)
{
    return cfg->rule == FM_REQUANT_ROWMAX && in->scale_mode == FM_SCALE_BLOCK_1x128 &&
           out->scale_mode == FM_SCALE_BLOCK_128x128;
}

/* Bytes of out's scale array: the grouped one when splits are given. */
static int64_t out_scale_nbytes(const fm_tensor *out, const fm_splits *splits)
{
    if (!splits)
        return fm_tensor_scale_nbytes(out);
    return fm_tensor_grouped_scale_count(out, splits) * (fm_dtype_bits(out->scale_dtype) / 8);
}

/* Rows of the grouped layout must stay whole bytes per group when E2M1 packs them. */
static fm_status check_grouped(fm_context *ctx, const fm_splits *splits, const fm_tensor *in, const fm_tensor *out)
{
    fm_status st;
    if (in->ndim != 2)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "in: the grouped transpose takes a 2-D [sum(M_i), N] tensor, "
                        "got ndim %d", in->ndim);
    if ((st = fm_check_splits(ctx, splits, in->shape[0], "in", -1, NULL, "fm_transpose_scaled_grouped")))
        return st;
    if (in->scale_mode == FM_SCALE_BLOCK_128x128)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "in: the grouped transpose takes BLOCK_1x128 or MX32 (power-of-two block scales), not "
                        "BLOCK_128x128");
    if (out->dtype == FM_DTYPE_E2M1)
        for (int64_t g = 0; g < splits->groups; g++)
            if (splits->host[g] & 1)
                return fm_error(ctx, FM_ERR_INVALID_ARG,
                                "splits: out is E2M1 (two codes a byte) and each group's rows become its own "
                                "stored rows, so every group needs an even size; group %lld has %lld",
                                (long long)g, (long long)splits->host[g]);
    return FM_OK;
}

/* splits: NULL for fm_transpose_scaled / fm_convert_scaled, the groups of
 * fm_transpose_scaled_grouped (whose out scale array is the grouped one).
 * in_bufs: the tensor whose buffers out must not overlap (in, except for
 * the rows' transpose, whose `in` describes the permuted rows it reads). */
static fm_status check_requant(fm_context *ctx, const fm_requant_config *cfg, const fm_splits *splits,
                               const fm_tensor *in, const fm_tensor *out, int transpose, const fm_tensor *in_bufs)
{
    fm_status st;
    if ((unsigned)cfg->rule >= FM_REQUANT_RULE_COUNT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->rule: %d is not an fm_requant_rule", (int)cfg->rule);
    unsigned grouped_in = splits ? FM_CHK_ROWWISE : 0, grouped_out = splits ? FM_CHK_COLWISE : 0;
    if ((st = fm_check_tensor(ctx, in, "in", FM_CHK_QUANT | grouped_in)))
        return st;
    if ((st = fm_check_tensor(ctx, out, "out", FM_CHK_QUANT | grouped_out)))
        return st;
    if ((st = fm_check_same_shape(ctx, in, "in", out, "out")))
        return st;
    if (splits && (st = check_grouped(ctx, splits, in, out)))
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
    if (tile_rowmax(cfg, in, out)) {
        if (!transpose || in->dtype != out->dtype || (in->dtype != FM_DTYPE_E4M3 && in->dtype != FM_DTYPE_E5M2))
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "in, out: BLOCK_1x128 -> BLOCK_128x128 (ROWMAX) is a transpose that keeps the FP8 dtype "
                            "(got %s -> %s, %s)",
                            fm_dtype_name(in->dtype), fm_dtype_name(out->dtype), transpose ? "transpose" : "convert");
    } else if (exact128) {
        if (!transpose || in->scale_mode != out->scale_mode || in->dtype != out->dtype)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "in, out: BLOCK_128x128 supports only the exact transpose to BLOCK_128x128 of the same "
                            "dtype, and BLOCK_1x128 -> BLOCK_128x128 transposes under the ROWMAX rule (got %s %s -> "
                            "%s %s)",
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
    if (cfg->rule == FM_REQUANT_ROWMAX && !tile_rowmax(cfg, in, out) &&
        (!transpose || in->dtype != out->dtype || in->scale_mode != out->scale_mode))
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "cfg->rule: ROWMAX applies to transposes that keep dtype and scale mode, or that take "
                        "BLOCK_1x128 to BLOCK_128x128 (got %s %s -> %s %s, %s)",
                        fm_dtype_name(in->dtype), fm_scale_mode_name(in->scale_mode), fm_dtype_name(out->dtype),
                        fm_scale_mode_name(out->scale_mode), transpose ? "transpose" : "convert");
    if (cfg->rule == FM_REQUANT_MX_FLOOR && out->scale_mode != FM_SCALE_MX32)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->rule: MX_FLOOR applies to MX32 outputs only, out is %s",
                        fm_scale_mode_name(out->scale_mode));
    if (cfg->nonfinite_blocks && ((uintptr_t)cfg->nonfinite_blocks % sizeof(int64_t)))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->nonfinite_blocks: %p is not 8-byte aligned",
                        (void *)cfg->nonfinite_blocks);
    if (!splits) {
        if ((st = fm_check_no_alias(ctx, out, "out", in, "in")))
            return st;
        return fm_check_disjoint(ctx, out->data, fm_tensor_nbytes(out), "out->data", out->scale,
                                 fm_tensor_scale_nbytes(out), "out->scale");
    }
    /* The grouped scale array is longer than the ungrouped one that
     * fm_check_tensor and fm_check_no_alias measure. */
    const int64_t out_sbytes = out_scale_nbytes(out, splits);
    if (out->scale_capacity > 0 && out_sbytes > out->scale_capacity)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "out: scale_capacity is %lld bytes but the grouped %s layout over splits needs %lld",
                        (long long)out->scale_capacity, fm_scale_layout_name(out->scale_layout),
                        (long long)out_sbytes);
    const void *ob[2] = {out->data, out->scale}, *ib[2] = {in_bufs->data, in_bufs->scale};
    const int64_t on[2] = {fm_tensor_nbytes(out), out_sbytes};
    const int64_t inn[2] = {fm_tensor_nbytes(in_bufs), fm_tensor_scale_nbytes(in_bufs)};
    static const char *oname[2] = {"out->data", "out->scale"}, *iname[2] = {"in->data", "in->scale"};
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            if ((st = fm_check_disjoint(ctx, ob[i], on[i], oname[i], ib[j], inn[j], iname[j])))
                return st;
    return fm_check_disjoint(ctx, out->data, on[0], "out->data", out->scale, on[1], "out->scale");
}

static fm_status requant(fm_context *ctx, const fm_requant_config *cfg_in, const fm_tensor *in, fm_tensor *out,
                         int transpose)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_requant_config cfg = cfg_in ? *cfg_in : (fm_requant_config){0};
    fm_status st = check_requant(ctx, &cfg, NULL, in, out, transpose, in);
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

/* A grouped transpose done: not a cast (like fm_transpose_scaled); its bytes. */
static void count_grouped(fm_context *ctx, int64_t read, const fm_tensor *out, const fm_splits *splits)
{
    ctx->stats.calls[FM_OP_TRANSPOSE_SCALED_GROUPED]++;
    ctx->stats.op_calls++;
    ctx->stats.bytes_read += read;
    ctx->stats.bytes_written += fm_tensor_nbytes(out) + out_scale_nbytes(out, splits);
}

fm_status fm_transpose_scaled_grouped(fm_context *ctx, const fm_requant_config *cfg_in, const fm_splits *splits,
                                      const fm_tensor *in, fm_tensor *out)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_requant_config cfg = cfg_in ? *cfg_in : (fm_requant_config){0};
    /* NULL splits would read as the ungrouped op below: refuse them first. */
    if (!splits)
        return fm_check_splits(ctx, NULL, 0, "in", -1, NULL, "fm_transpose_scaled_grouped");
    fm_status st = check_requant(ctx, &cfg, splits, in, out, 1, in);
    if (st)
        return st;
    if (!ctx->be->requantize_grouped)
        return fm_error(ctx, FM_ERR_UNSUPPORTED,
                        "fm_transpose_scaled_grouped: the %s backend does not implement it yet", ctx->be->name);
    if ((st = ctx->be->requantize_grouped(ctx, &cfg, splits, in, out)))
        return st;
    count_grouped(ctx, fm_tensor_nbytes(in) + fm_tensor_scale_nbytes(in), out, splits);
    return FM_OK;
}

fm_status fm_transpose_scaled_grouped_rows(fm_context *ctx, const fm_requant_config *cfg_in, const fm_splits *splits,
                                           const fm_tensor *in, const fm_tensor *row_map, int topk, fm_tensor *out)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_requant_config cfg = cfg_in ? *cfg_in : (fm_requant_config){0};
    if (!splits)
        return fm_check_splits(ctx, NULL, 0, "out", -1, NULL, "fm_transpose_scaled_grouped_rows");
    fm_status st;
    if ((st = fm_check_rows(ctx, in, "in", -1, -1, 1)))
        return st;
    if (in->dtype != FM_DTYPE_E4M3 && in->dtype != FM_DTYPE_E5M2)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "in: the rows' transpose takes FP8 rows (E4M3 or E5M2), got %s",
                        fm_dtype_name(in->dtype));
    if (!out)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "out: NULL");
    if (out->ndim != 2 || out->shape[1] != in->shape[1])
        return fm_error(ctx, FM_ERR_INVALID_ARG, "out: must be 2-D [R, N] with in's N = %lld columns",
                        (long long)in->shape[1]);
    const int64_t T = in->shape[0], R = out->shape[0];
    if (topk < 1 || (T > 0 && topk > INT32_MAX / T))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "topk: %d; it must be >= 1 with T (%lld) x topk below 2^31", topk,
                        (long long)T);
    if ((st = fm_check_mat(ctx, row_map, "row_map", FM_CHK_UNSCALED, FM_DTYPE_I32, R, 1)))
        return st;
    /* The grouped rules on the rows the permute would make: in's descriptor with out's row count. */
    fm_tensor rows = *in;
    rows.shape[0] = R;
    rows.data_capacity = rows.scale_capacity = 0; /* a view: in's own buffers were checked above */
    if ((st = check_requant(ctx, &cfg, splits, &rows, out, 1, in)) ||
        (st = fm_check_disjoint(ctx, out->data, fm_tensor_nbytes(out), "out->data", row_map->data,
                                fm_tensor_nbytes(row_map), "row_map->data")) ||
        (st = fm_check_disjoint(ctx, out->scale, out_scale_nbytes(out, splits), "out->scale", row_map->data,
                                fm_tensor_nbytes(row_map), "row_map->data")))
        return st;
    if (!ctx->be->requantize_grouped_rows)
        return fm_error(ctx, FM_ERR_UNSUPPORTED,
                        "fm_transpose_scaled_grouped_rows: the %s backend does not implement it yet", ctx->be->name);
    if ((st = ctx->be->requantize_grouped_rows(ctx, &cfg, splits, in, row_map, topk, out)))
        return st;
    /* in's rows counted once, like every op's input */
    count_grouped(ctx, fm_tensor_nbytes(in) + fm_tensor_scale_nbytes(in) + fm_tensor_nbytes(row_map), out, splits);
    return FM_OK;
}
