/* Context memory: allocation in the context's device and copies between it
 * and the host, so that trainers and the layer need no CUDA calls of their
 * own. */
#include "internal.h"

fm_status fm_context_alloc(fm_context *ctx, size_t bytes, void **out)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    if (!out)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "out: must point to a void* to fill");
    *out = NULL;
    if (bytes == 0)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "bytes: must be at least 1");
    if (bytes > ((size_t)1 << 48))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "bytes: %zu is more than any device holds (limit 2^48)", bytes);
    return ctx->be->mem_alloc(ctx, bytes, out);
}

void fm_context_free(fm_context *ctx, void *p)
{
    if (ctx && p)
        ctx->be->mem_free(ctx, p);
}

static fm_status check_side(fm_context *ctx, fm_device d, const char *name)
{
    if ((unsigned)d >= FM_DEVICE_COUNT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s_device: %d is neither HOST nor CUDA", name, (int)d);
    if (d != FM_DEVICE_HOST && d != ctx->be->device)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s_device: CUDA memory is not this %s context's memory", name,
                        ctx->be->name);
    return FM_OK;
}

fm_status fm_context_copy(fm_context *ctx, void *dst, fm_device dst_device, const void *src, fm_device src_device,
                          size_t bytes)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_status st;
    if ((st = check_side(ctx, dst_device, "dst")) || (st = check_side(ctx, src_device, "src")))
        return st;
    if (bytes == 0)
        return FM_OK;
    if (!dst || !src)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: NULL with bytes = %zu", dst ? "src" : "dst", bytes);
    uintptr_t a = (uintptr_t)dst, b = (uintptr_t)src;
    if (dst_device == src_device && a < b + bytes && b < a + bytes && a != b)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "dst, src: the ranges overlap (use distinct buffers)");
    if (a == b && dst_device == src_device)
        return FM_OK;
    return ctx->be->mem_copy(ctx, dst, dst_device, src, src_device, bytes);
}

fm_status fm_context_memset(fm_context *ctx, void *p, int value, size_t bytes)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    if (bytes == 0)
        return FM_OK;
    if (!p)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "p: NULL with bytes = %zu", bytes);
    return ctx->be->mem_set(ctx, p, value, bytes);
}
