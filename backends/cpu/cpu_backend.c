/* The CPU backend: the reference every other backend is checked against. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu.h"

static fm_status cpu_synchronize(fm_context *ctx)
{
    (void)ctx;
    return FM_OK;
}

static fm_status cpu_mem_alloc(fm_context *ctx, size_t bytes, void **out)
{
    /* 256-byte alignment like cudaMalloc, so descriptors valid on one backend stay valid on the other. */
    size_t n = (bytes + 255) & ~(size_t)255;
    *out = aligned_alloc(256, n);
    if (!*out)
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_context_alloc: %zu bytes of host memory are not available",
                        bytes);
    return FM_OK;
}

static void cpu_mem_free(fm_context *ctx, void *p)
{
    (void)ctx;
    free(p);
}

static fm_status cpu_mem_copy(fm_context *ctx, void *dst, fm_device dd, const void *src, fm_device sd, size_t bytes)
{
    (void)ctx;
    (void)dd;
    (void)sd;
    memcpy(dst, src, bytes);
    return FM_OK;
}

static fm_status cpu_mem_set(fm_context *ctx, void *p, int value, size_t bytes)
{
    (void)ctx;
    memset(p, value, bytes);
    return FM_OK;
}

const fm_backend fm_cpu_backend = {
    /* .name                 = */ "cpu",
    /* .device               = */ FM_DEVICE_HOST,
    /* .quantize             = */ fm_cpu_quantize,
    /* .dequantize           = */ fm_cpu_dequantize,
    /* .scale_layout_convert = */ fm_cpu_scale_layout_convert,
    /* .synchronize          = */ cpu_synchronize,
    /* .set_stream           = */ NULL,
    /* .destroy              = */ NULL,
    /* .mem_alloc            = */ cpu_mem_alloc,
    /* .mem_free             = */ cpu_mem_free,
    /* .mem_copy             = */ cpu_mem_copy,
    /* .mem_set              = */ cpu_mem_set,
    /* .cast                 = */ fm_cpu_cast,
    /* .requantize           = */ fm_cpu_requantize,
    /* .requantize_grouped    = */ fm_cpu_requantize_grouped,
    /* .requantize_grouped_rows = */ fm_cpu_requantize_grouped_rows,
    /* .gemm                  = */ fm_cpu_gemm,
    /* .grouped_gemm          = */ fm_cpu_grouped_gemm,
    /* .grouped_gemm_wgrad    = */ fm_cpu_grouped_gemm_wgrad,
    /* .moe_router            = */ fm_cpu_moe_router,
    /* .moe_router_backward   = */ fm_cpu_moe_router_backward,
    /* .moe_permute           = */ fm_cpu_moe_permute,
    /* .moe_unpermute         = */ fm_cpu_moe_unpermute,
    /* .moe_unpermute_backward= */ fm_cpu_moe_unpermute_backward,
    /* .moe_swiglu            = */ fm_cpu_moe_swiglu,
    /* .moe_swiglu_backward   = */ fm_cpu_moe_swiglu_backward,
    /* .queue_prepare         = */ NULL, /* ops run in call order */
    /* .queue_select          = */ NULL,
};

fm_status fm_cpu_backend_init(fm_context *ctx, const fm_context_config *cfg)
{
    long n = cfg->cpu_threads;
    if (n <= 0) {
        n = sysconf(_SC_NPROCESSORS_ONLN);
        if (n < 1)
            n = 1;
        if (n > 64)
            n = 64;
    }
    ctx->cpu_threads = (int)n;
    ctx->be = &fm_cpu_backend;
    return FM_OK;
}

typedef struct {
    fm_cpu_range_fn fn;
    void *arg;
    int64_t begin, end;
    int worker;
} range_job;

static void *run_job(void *p)
{
    range_job *j = p;
    j->fn(j->arg, j->begin, j->end, j->worker);
    return NULL;
}

int fm_cpu_workers(const fm_context *ctx)
{
    int w = ctx->cpu_threads > 0 ? ctx->cpu_threads : 1;
    return w < FM_CPU_MAX_WORKERS ? w : FM_CPU_MAX_WORKERS;
}

void fm_cpu_parallel_for(const fm_context *ctx, int64_t n, int64_t min_chunk, fm_cpu_range_fn fn, void *arg)
{
    if (n <= 0)
        return;
    int64_t workers = fm_cpu_workers(ctx);
    if (min_chunk < 1)
        min_chunk = 1;
    if (workers > n / min_chunk)
        workers = n / min_chunk;
    if (workers <= 1) {
        fn(arg, 0, n, 0);
        return;
    }
    range_job jobs[FM_CPU_MAX_WORKERS];
    pthread_t th[FM_CPU_MAX_WORKERS];
    int started[FM_CPU_MAX_WORKERS] = {0};
    int64_t chunk = (n + workers - 1) / workers;
    for (int64_t w = 0; w < workers; w++) {
        jobs[w] = (range_job){fn, arg, w * chunk, (w + 1) * chunk < n ? (w + 1) * chunk : n, (int)w};
        /* Worker 0 runs on the calling thread; a failed spawn runs inline. */
        if (w > 0 && jobs[w].begin < jobs[w].end)
            started[w] = pthread_create(&th[w], NULL, run_job, &jobs[w]) == 0;
    }
    for (int64_t w = 0; w < workers; w++)
        if (!started[w] && jobs[w].begin < jobs[w].end)
            fn(arg, jobs[w].begin, jobs[w].end, (int)w);
    for (int64_t w = 1; w < workers; w++)
        if (started[w])
            pthread_join(th[w], NULL);
}
