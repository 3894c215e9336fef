/* The CUDA backend: context state, errors, pointer checks, the vtable. */
#include <stdlib.h>

#include "cuda.h"

extern "C" {

int fm_cuda_compiled(void) { return 1; }

int fm_cuda_device_usable(int device)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* clear the sticky "no driver" error */
        return 0;
    }
    return device < n;
}

int fm_cuda_pointer_is_device(const void *p)
{
    if (!p)
        return -1;
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged)
        return 1;
    if (a.type == cudaMemoryTypeHost)
        return -1; /* pinned host memory is reachable from both: say nothing */
    return 0;
}

fm_status fm_cuda_check(fm_context *ctx, cudaError_t err, const char *what)
{
    if (err == cudaSuccess)
        return FM_OK;
    return fm_error(ctx, err == cudaErrorMemoryAllocation ? FM_ERR_OUT_OF_MEMORY : FM_ERR_BACKEND,
                    "%s: CUDA error %d (%s): %s", what, (int)err, cudaGetErrorName(err), cudaGetErrorString(err));
}

fm_status fm_cuda_check_launch(fm_context *ctx, const char *kernel)
{
    return fm_cuda_check(ctx, cudaGetLastError(), kernel);
}

fm_status fm_cuda_enter(fm_context *ctx, fm_cuda_device_guard *g, const char *op)
{
    g->changed = 0;
    cudaError_t err = cudaGetDevice(&g->prev);
    if (err == cudaSuccess && g->prev != fm_cuda(ctx)->device) {
        err = cudaSetDevice(fm_cuda(ctx)->device);
        g->changed = err == cudaSuccess;
    }
    return fm_cuda_check(ctx, err, op);
}

fm_status fm_cuda_leave(fm_context *ctx, fm_cuda_device_guard *g, cudaError_t err, const char *what)
{
    if (g->changed)
        cudaSetDevice(g->prev);
    if (err == cudaSuccess)
        return FM_OK;
    cudaGetLastError(); /* a launch error is not sticky: clear it for the next op */
    return fm_cuda_check(ctx, err, what);
}

fm_status fm_cuda_scratch(fm_context *ctx, size_t bytes, void **p, int *owned, const char *op)
{
    fm_cuda_state *s = fm_cuda(ctx);
    *owned = 0;
    if (bytes <= s->workspace_bytes) {
        *p = s->queue ? s->q1_workspace : s->workspace;
        return FM_OK;
    }
    cudaError_t err = cudaMallocAsync(p, bytes, fm_cuda_stream(ctx));
    if (err != cudaSuccess) {
        cudaGetLastError();
        return fm_error(ctx, err == cudaErrorMemoryAllocation ? FM_ERR_OUT_OF_MEMORY : FM_ERR_BACKEND,
                        "%s: %zu bytes of scratch (more than the %zu-byte workspace): cudaMallocAsync: %s", op,
                        bytes, s->workspace_bytes, cudaGetErrorString(err));
    }
    *owned = 1;
    return FM_OK;
}

fm_status fm_cuda_pending_report(fm_context *ctx, const fm_cuda_pending *h)
{
    if (!h->state)
        return FM_OK;
    switch (h->kind) {
    case FM_CUDA_PENDING_BAD_ID:
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "expert_ids: entry [%lld, %lld] is %d, outside [0, E = %lld) and not -1 (no expert) "
                        "(E = splits' columns)",
                        h->a, h->b, (int)h->bits, h->c);
    case FM_CUDA_PENDING_FEW_ROWS:
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "out: has %lld rows but this routing needs %lld (sum over experts of their slot count "
                        "rounded up to pad_multiple %lld); R = T*k + E*(pad-1) = %lld always suffices",
                        h->a, h->b, h->c, h->d);
    case FM_CUDA_PENDING_SPLIT_NEG:
        return fm_error(ctx, FM_ERR_INVALID_ARG, "splits->device[%lld]: %lld rows; sizes must be >= 0", h->a, h->b);
    case FM_CUDA_PENDING_SPLIT_PAST:
        return fm_error(ctx, FM_ERR_INVALID_ARG, "splits->device: the sizes sum past a's %lld rows (at group %lld)",
                        h->a, h->b);
    case FM_CUDA_PENDING_SPLIT_SUM:
        return fm_error(ctx, FM_ERR_INVALID_ARG, "splits->device: the sizes sum to %lld but a has %lld rows", h->a,
                        h->b);
    case FM_CUDA_PENDING_SCALE_ROW:
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "in->scale: the scale of row %lld, block %lld is %g, not a positive power of two; "
                        "scaling-aware ops need POW2 scales",
                        h->a, h->b, (double)fm_bits_f32(h->bits));
    case FM_CUDA_PENDING_SCALE_BLOCK:
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "in->scale: the scale of block (expert %lld, stored row %lld, block %lld) is %g, "
                        "not a positive power of two; scaling-aware ops need POW2 scales",
                        h->a, h->b, h->c, (double)fm_bits_f32(h->bits));
    default:
        return fm_error(ctx, FM_ERR_BACKEND, "internal: a device finding of unknown kind %u (state %u)", h->kind,
                        h->state);
    }
}

/* Waits for both queues, then reports the device's pending finding (see
 * fm_cuda_pending) and clears it. */
static fm_status cuda_synchronize(fm_context *ctx)
{
    fm_cuda_state *s = fm_cuda(ctx);
    cudaSetDevice(s->device);
    cudaStream_t q0 = (cudaStream_t)ctx->stream;
    cudaError_t err = cudaSuccess;
    if (s->q1_stream)
        err = cudaStreamSynchronize(s->q1_stream);
    if (err != cudaSuccess) {
        /* Still wait for the context's stream: the caller may free what its
         * ops use as soon as this returns, error or not. */
        cudaStreamSynchronize(q0);
        return fm_cuda_check(ctx, err, "fm_context_synchronize");
    }
    /* The read and the clear on the context's stream, finished before this
     * returns: no later op (either queue) can post before the clear lands. */
    fm_cuda_pending *h = (fm_cuda_pending *)s->host_small;
    h->state = 0;
    err = cudaMemcpyAsync(h, s->pending, sizeof *h, cudaMemcpyDeviceToHost, q0);
    if (err == cudaSuccess)
        err = cudaStreamSynchronize(q0);
    if (err == cudaSuccess && h->state) {
        err = cudaMemsetAsync(s->pending, 0, sizeof *h, q0);
        if (err == cudaSuccess)
            err = cudaStreamSynchronize(q0);
    }
    fm_status st = fm_cuda_check(ctx, err, "fm_context_synchronize");
    return st ? st : fm_cuda_pending_report(ctx, h);
}

/* The new stream waits for what the old one holds: the context's scratch,
 * its op words and its pending finding are used by one op at a time. */
static fm_status cuda_set_stream(fm_context *ctx, void *stream)
{
    fm_cuda_state *s = fm_cuda(ctx);
    if (stream != ctx->stream) {
        fm_cuda_device_guard g;
        fm_status st = fm_cuda_enter(ctx, &g, "fm_context_set_stream");
        if (st)
            return st;
        cudaError_t err = cudaEventRecord(s->swap_event, (cudaStream_t)ctx->stream);
        if (err == cudaSuccess)
            err = cudaStreamWaitEvent((cudaStream_t)stream, s->swap_event, 0);
        if ((st = fm_cuda_leave(ctx, &g, err, "fm_context_set_stream: ordering the new stream after the old")))
            return st;
    }
    ctx->stream = stream;
    return FM_OK;
}

static void cuda_destroy(fm_context *ctx)
{
    fm_cuda_state *s = fm_cuda(ctx);
    if (!s)
        return;
    cudaSetDevice(s->device);
    fm_cuda_gemm_destroy(s);
    if (s->workspace)
        cudaFree(s->workspace);
    if (s->q1_workspace) {
        cudaFree(s->q1_workspace);
        cudaStreamDestroy(s->q1_stream);
        cudaEventDestroy(s->q_event);
    }
    if (s->host_small)
        cudaFreeHost(s->host_small);
    if (s->pending)
        cudaFree(s->pending); /* op_words lie in the same allocation */
    if (s->swap_event)
        cudaEventDestroy(s->swap_event);
    if (s->lt)
        cublasLtDestroy(s->lt);
    free(s);
    ctx->be_state = NULL;
}

static fm_status cuda_mem_alloc(fm_context *ctx, size_t bytes, void **out)
{
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_context_alloc");
    if (st)
        return st;
    return fm_cuda_leave(ctx, &g, cudaMalloc(out, bytes), "fm_context_alloc: cudaMalloc");
}

static void cuda_mem_free(fm_context *ctx, void *p)
{
    fm_cuda_device_guard g;
    if (fm_cuda_enter(ctx, &g, "fm_context_free") == FM_OK)
        fm_cuda_leave(ctx, &g, cudaFree(p), "fm_context_free: cudaFree");
}

static fm_status cuda_mem_copy(fm_context *ctx, void *dst, fm_device dd, const void *src, fm_device sd, size_t bytes)
{
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_context_copy");
    if (st)
        return st;
    cudaStream_t s = fm_cuda_stream(ctx);
    cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s);
    /* Host memory may be reused the moment the call returns: wait for it. */
    if (err == cudaSuccess && (dd == FM_DEVICE_HOST || sd == FM_DEVICE_HOST))
        err = cudaStreamSynchronize(s);
    return fm_cuda_leave(ctx, &g, err, "fm_context_copy: cudaMemcpyAsync");
}

static fm_status cuda_mem_set(fm_context *ctx, void *p, int value, size_t bytes)
{
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_context_memset");
    if (st)
        return st;
    return fm_cuda_leave(ctx, &g, cudaMemsetAsync(p, value, bytes, fm_cuda_stream(ctx)),
                         "fm_context_memset: cudaMemsetAsync");
}

/* Queue 1: a non-blocking stream, the event that orders the two queues, and
 * a workspace the size of the context's (every op sizes its scratch by
 * workspace_bytes). */
static fm_status cuda_queue_prepare(fm_context *ctx)
{
    fm_cuda_state *s = fm_cuda(ctx);
    if (s->q1_workspace)
        return FM_OK;
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_queue_prepare");
    if (st)
        return st;
    cudaStream_t q = NULL;
    cudaEvent_t ev = NULL;
    void *ws = NULL;
    /* (A higher priority for either queue's streams measured the same, S12-2.) */
    cudaError_t err = cudaStreamCreateWithFlags(&q, cudaStreamNonBlocking);
    if (err == cudaSuccess)
        err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (err == cudaSuccess)
        err = cudaMalloc(&ws, s->workspace_bytes);
    if (err != cudaSuccess) {
        if (ev)
            cudaEventDestroy(ev);
        if (q)
            cudaStreamDestroy(q);
        return fm_cuda_leave(ctx, &g, err, "second queue (stream, event, workspace)");
    }
    s->q1_stream = q;
    s->q_event = ev;
    s->q1_workspace = ws;
    return fm_cuda_leave(ctx, &g, cudaSuccess, "fm_queue_prepare");
}

static fm_status cuda_queue_select(fm_context *ctx, int q, int wait)
{
    fm_cuda_state *s = fm_cuda(ctx);
    if (q && !s->q1_workspace)
        return fm_error(ctx, FM_ERR_BACKEND, "queue 1 selected before fm_queue_prepare made it");
    cudaError_t err = cudaSuccess;
    if (wait && s->q1_workspace) {
        cudaStream_t q0 = (cudaStream_t)ctx->stream, q1 = s->q1_stream;
        fm_cuda_device_guard g;
        fm_status st = fm_cuda_enter(ctx, &g, "fm_queue_select");
        if (st)
            return st;
        err = cudaEventRecord(s->q_event, q ? q0 : q1);
        if (err == cudaSuccess)
            err = cudaStreamWaitEvent(q ? q1 : q0, s->q_event, 0);
        if ((st = fm_cuda_leave(ctx, &g, err, "fm_queue_select: ordering the two queues")))
            return st;
    }
    s->queue = q != 0;
    return FM_OK;
}

static const fm_backend cuda_backend = {
    /* .name                 = */ "cuda",
    /* .device               = */ FM_DEVICE_CUDA,
    /* .quantize             = */ fm_cuda_quantize,
    /* .dequantize           = */ fm_cuda_dequantize,
    /* .scale_layout_convert = */ fm_cuda_scale_layout_convert,
    /* .synchronize          = */ cuda_synchronize,
    /* .set_stream           = */ cuda_set_stream,
    /* .destroy              = */ cuda_destroy,
    /* .mem_alloc            = */ cuda_mem_alloc,
    /* .mem_free             = */ cuda_mem_free,
    /* .mem_copy             = */ cuda_mem_copy,
    /* .mem_set              = */ cuda_mem_set,
    /* .cast                 = */ fm_cuda_cast,
    /* .requantize           = */ fm_cuda_requantize,
    /* .requantize_grouped    = */ fm_cuda_requantize_grouped,
    /* .requantize_grouped_rows = */ fm_cuda_requantize_grouped_rows,
    /* .gemm                  = */ fm_cuda_gemm,
    /* .grouped_gemm          = */ fm_cuda_grouped_gemm,
    /* .grouped_gemm_wgrad    = */ fm_cuda_grouped_gemm_wgrad,
    /* .moe_router            = */ fm_cuda_moe_router,
    /* .moe_router_backward   = */ fm_cuda_moe_router_backward,
    /* .moe_permute           = */ fm_cuda_moe_permute,
    /* .moe_unpermute         = */ fm_cuda_moe_unpermute,
    /* .moe_unpermute_backward= */ fm_cuda_moe_unpermute_backward,
    /* .moe_swiglu            = */ fm_cuda_moe_swiglu,
    /* .moe_swiglu_backward   = */ fm_cuda_moe_swiglu_backward,
    /* .queue_prepare         = */ cuda_queue_prepare,
    /* .queue_select          = */ cuda_queue_select,
};

fm_status fm_cuda_backend_init(fm_context *ctx, const fm_context_config *cfg)
{
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess || n == 0) {
        cudaGetLastError();
        return fm_create_error(FM_ERR_NO_DEVICE, "backend: CUDA was asked for but no CUDA device is usable (%s)",
                               err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    }
    if (cfg->device >= n)
        return fm_create_error(FM_ERR_INVALID_ARG, "cfg->device: %d, but only %d CUDA device(s) exist", cfg->device, n);
    fm_cuda_state *s = (fm_cuda_state *)calloc(1, sizeof *s);
    if (!s)
        return fm_create_error(FM_ERR_OUT_OF_MEMORY, "fm_context_create: out of host memory");
    s->device = cfg->device;
    ctx->be_state = s;
    ctx->be = &cuda_backend;
    const char *step = "cudaSetDevice";
    if ((err = cudaSetDevice(s->device)) != cudaSuccess ||
        (step = "cudaGetDeviceProperties", err = cudaGetDeviceProperties(&s->prop, s->device)) != cudaSuccess)
        goto fail;
    if (s->prop.major < 9) {
        cuda_destroy(ctx);
        return fm_create_error(FM_ERR_UNSUPPORTED, "backend: device %d (%s) is sm_%d%d; flowmoe's kernels need sm_90 (Hopper)",
                               cfg->device, s->prop.name, s->prop.major, s->prop.minor);
    }
    s->workspace_bytes = cfg->workspace_bytes ? cfg->workspace_bytes : ((size_t)64 << 20);
    step = "cudaMalloc(workspace)";
    if ((err = cudaMalloc(&s->workspace, s->workspace_bytes)) != cudaSuccess)
        goto fail;
    step = "cudaMallocHost(readback buffer)";
    if ((err = cudaMallocHost(&s->host_small, FM_CUDA_HOST_SMALL)) != cudaSuccess) {
        s->host_small = NULL;
        goto fail;
    }
    /* the pending finding, then the op words of the two queues */
    step = "cudaMalloc(pending findings, op words)";
    if ((err = cudaMalloc((void **)&s->pending, 64 + 2 * FM_CUDA_OP_WORDS)) != cudaSuccess) {
        s->pending = NULL;
        goto fail;
    }
    static_assert(sizeof(fm_cuda_pending) <= 64, "the op words follow the pending finding");
    s->op_words = (char *)s->pending + 64;
    /* the memset done before any op, on any stream, may post */
    step = "cudaMemset(pending findings, op words)";
    if ((err = cudaMemset(s->pending, 0, 64 + 2 * FM_CUDA_OP_WORDS)) != cudaSuccess ||
        (err = cudaStreamSynchronize(0)) != cudaSuccess)
        goto fail;
    step = "cudaEventCreateWithFlags(stream swap)";
    if ((err = cudaEventCreateWithFlags(&s->swap_event, cudaEventDisableTiming)) != cudaSuccess) {
        s->swap_event = NULL;
        goto fail;
    }
    if (cublasLtCreate(&s->lt) != CUBLAS_STATUS_SUCCESS) {
        s->lt = NULL;
        cuda_destroy(ctx);
        return fm_create_error(FM_ERR_BACKEND, "backend: cublasLtCreate failed on device %d", cfg->device);
    }
    return FM_OK;
fail:
    cuda_destroy(ctx);
    cudaGetLastError();
    return fm_create_error(err == cudaErrorMemoryAllocation ? FM_ERR_OUT_OF_MEMORY : FM_ERR_BACKEND,
                           "backend: %s failed on device %d: %s", step, cfg->device, cudaGetErrorString(err));
}

} /* extern "C" */
