/* Public fm_cast: validate, count, dispatch. */
#include "validate.h"

fm_status fm_cast(fm_context *ctx, const fm_tensor *in, fm_tensor *out)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_status st;
    if ((st = fm_check_tensor(ctx, in, "in", FM_CHK_HIGH | FM_CHK_UNSCALED)) ||
        (st = fm_check_tensor(ctx, out, "out", FM_CHK_HIGH | FM_CHK_UNSCALED)) ||
        (st = fm_check_same_shape(ctx, in, "in", out, "out")) || (st = fm_check_no_alias(ctx, out, "out", in, "in")))
        return st;
    if (!ctx->be->cast)
        return fm_error(ctx, FM_ERR_UNSUPPORTED, "fm_cast: the %s backend does not implement it", ctx->be->name);
    if ((st = ctx->be->cast(ctx, in, out)))
        return st;
    ctx->stats.calls[FM_OP_CAST]++;
    ctx->stats.op_calls++;
    ctx->stats.bytes_read += fm_tensor_nbytes(in);
    ctx->stats.bytes_written += fm_tensor_nbytes(out);
    return FM_OK;
}
