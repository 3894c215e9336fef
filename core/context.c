/* Context creation, backend selection, errors and statistics. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static _Thread_local char create_err[768];

fm_status fm_error(fm_context *ctx, fm_status st, const char *fmt, ...)
{
    if (!ctx)
        return st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->err, sizeof ctx->err, fmt, ap);
    va_end(ap);
    return st;
}

void fm_error_clear(fm_context *ctx)
{
    if (ctx)
        ctx->err[0] = '\0';
}

fm_status fm_create_error(fm_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(create_err, sizeof create_err, fmt, ap);
    va_end(ap);
    return st;
}

const char *fm_last_error(const fm_context *ctx)
{
    return ctx ? ctx->err : create_err;
}

#ifndef FM_HAVE_CUDA
/* Builds without CUDA: the hooks core calls answer "not here". */
int fm_cuda_compiled(void) { return 0; }
int fm_cuda_device_usable(int device) { (void)device; return 0; }
int fm_cuda_pointer_is_device(const void *p) { (void)p; return -1; }
fm_status fm_cuda_backend_init(fm_context *ctx, const fm_context_config *cfg)
{
    (void)ctx;
    (void)cfg;
    return fm_create_error(FM_ERR_NO_DEVICE,
                           "backend: this flowmoe was built without CUDA (meson option cuda=disabled "
                           "or no nvcc at configure time)");
}
#endif

fm_status fm_context_create(const fm_context_config *cfg, fm_context **out)
{
    create_err[0] = '\0';
    if (!out)
        return fm_create_error(FM_ERR_INVALID_ARG, "out: must point to an fm_context* to fill");
    *out = NULL;
    fm_context_config c = cfg ? *cfg : (fm_context_config){0};
    if ((unsigned)c.backend >= FM_BACKEND_COUNT)
        return fm_create_error(FM_ERR_INVALID_ARG,
                               "cfg->backend: %d is not an fm_backend_kind (AUTO, CPU or CUDA)",
                               (int)c.backend);
    if (c.device < 0)
        return fm_create_error(FM_ERR_INVALID_ARG, "cfg->device: %d is negative", c.device);
    if (c.cpu_threads < 0 || c.cpu_threads > 1024)
        return fm_create_error(FM_ERR_INVALID_ARG,
                               "cfg->cpu_threads: %d is outside 0..1024 (0 = all cores)",
                               c.cpu_threads);

    fm_context *ctx = calloc(1, sizeof *ctx);
    if (!ctx)
        return fm_create_error(FM_ERR_OUT_OF_MEMORY, "fm_context_create: out of host memory");

    fm_backend_kind kind = c.backend;
    if (kind == FM_BACKEND_AUTO)
        kind = fm_cuda_device_usable(c.device) ? FM_BACKEND_CUDA : FM_BACKEND_CPU;
    ctx->kind = kind;

    fm_status st = kind == FM_BACKEND_CUDA ? fm_cuda_backend_init(ctx, &c) : fm_cpu_backend_init(ctx, &c);
    if (st != FM_OK) {
        free(ctx);
        return st;
    }
    *out = ctx;
    return FM_OK;
}

void fm_context_destroy(fm_context *ctx)
{
    if (!ctx)
        return;
    if (ctx->be && ctx->be->destroy)
        ctx->be->destroy(ctx);
    free(ctx);
}

fm_backend_kind fm_context_backend(const fm_context *ctx) { return ctx ? ctx->kind : FM_BACKEND_AUTO; }

const char *fm_context_backend_name(const fm_context *ctx)
{
    return ctx && ctx->be ? ctx->be->name : "none";
}

fm_device fm_context_device(const fm_context *ctx)
{
    return ctx && ctx->be ? ctx->be->device : FM_DEVICE_HOST;
}

fm_status fm_context_set_stream(fm_context *ctx, void *stream)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    if (!ctx->be->set_stream)
        return fm_error(ctx, FM_ERR_UNSUPPORTED,
                        "stream: the %s backend has no streams; only a CUDA context takes one",
                        ctx->be->name);
    return ctx->be->set_stream(ctx, stream);
}

void *fm_context_stream(const fm_context *ctx) { return ctx ? ctx->stream : NULL; }

fm_status fm_context_synchronize(fm_context *ctx)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    return ctx->be->synchronize ? ctx->be->synchronize(ctx) : FM_OK;
}

fm_status fm_stats_get(const fm_context *ctx, fm_stats *out)
{
    if (!ctx || !out)
        return FM_ERR_INVALID_ARG;
    *out = ctx->stats;
    return FM_OK;
}

fm_status fm_stats_reset(fm_context *ctx)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    memset(&ctx->stats, 0, sizeof ctx->stats);
    return FM_OK;
}

const char *fm_op_name(fm_op op)
{
    switch (op) {
    case FM_OP_QUANTIZE: return "quantize";
    case FM_OP_DEQUANTIZE: return "dequantize";
    case FM_OP_SCALE_LAYOUT_CONVERT: return "scale_layout_convert";
    case FM_OP_TRANSPOSE_SCALED: return "transpose_scaled";
    case FM_OP_CONVERT_SCALED: return "convert_scaled";
    case FM_OP_TRANSPOSE_SCALED_GROUPED: return "transpose_scaled_grouped";
    case FM_OP_GEMM: return "gemm";
    case FM_OP_GROUPED_GEMM: return "grouped_gemm";
    case FM_OP_GROUPED_GEMM_WGRAD: return "grouped_gemm_wgrad";
    case FM_OP_MOE_ROUTER: return "moe_router";
    case FM_OP_MOE_ROUTER_BACKWARD: return "moe_router_backward";
    case FM_OP_MOE_PERMUTE: return "moe_permute";
    case FM_OP_MOE_UNPERMUTE: return "moe_unpermute";
    case FM_OP_MOE_UNPERMUTE_BACKWARD: return "moe_unpermute_backward";
    case FM_OP_MOE_SWIGLU: return "moe_swiglu";
    case FM_OP_MOE_SWIGLU_BACKWARD: return "moe_swiglu_backward";
    case FM_OP_CAST: return "cast";
    case FM_OP_QUANTIZE_GROUPED: return "quantize_grouped";
    case FM_OP_EP_DISPATCH: return "ep_dispatch";
    case FM_OP_EP_COMBINE: return "ep_combine";
    default: return "unknown";
    }
}
