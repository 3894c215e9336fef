/* flowmoe — context, backend choice, errors, statistics. */
#ifndef FLOWMOE_CONTEXT_H
#define FLOWMOE_CONTEXT_H

#include "flowmoe/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fm_context fm_context;

typedef enum fm_backend_kind {
    FM_BACKEND_AUTO = 0, /* CUDA when a device is usable, else CPU */
    FM_BACKEND_CPU,
    FM_BACKEND_CUDA,
    FM_BACKEND_COUNT
} fm_backend_kind;

typedef struct fm_context_config {
    fm_backend_kind backend;
    int device;                 /* CUDA device ordinal (CUDA backend) */
    size_t workspace_bytes;     /* CUDA workspace; 0 = library default */
    int cpu_threads;            /* CPU backend worker threads; 0 = all cores */
} fm_context_config;

/* `cfg` may be NULL (AUTO). On failure *out is NULL and the status says why;
 * fm_last_error(NULL) then holds the sentence. */
fm_status fm_context_create(const fm_context_config *cfg, fm_context **out);
void fm_context_destroy(fm_context *ctx);

fm_backend_kind fm_context_backend(const fm_context *ctx);
const char *fm_context_backend_name(const fm_context *ctx);
/* The device tensors given to this context must live on (HOST or CUDA). */
fm_device fm_context_device(const fm_context *ctx);

/* The last error of this context as a sentence naming the argument and the
 * rule it broke; "" after success. With ctx == NULL: the last error of
 * fm_context_create on this thread. The pointer stays valid until the next
 * call on this context. */
const char *fm_last_error(const fm_context *ctx);

/* CUDA backend: the stream every op is queued on (a cudaStream_t; NULL = the
 * legacy default stream). Work already queued on the previous stream comes
 * first: the new stream waits for it (an event, not the host), so the previous
 * stream must still exist when this is called: set the next stream before
 * destroying the current one (the event is recorded on it). FM_ERR_UNSUPPORTED
 * on the CPU backend. */
fm_status fm_context_set_stream(fm_context *ctx, void *stream);
void *fm_context_stream(const fm_context *ctx);
/* Waits for every op queued on the context's stream (no-op on CPU). Then
 * reports bad input that only the device could see and that an op which
 * does not wait for the device left pending (FM_ERR_INVALID_ARG and the
 * op's sentence; the first since the last call): on CUDA, a scaling-aware
 * op's F32 scale that is not a power of two (transpose.h),
 * fm_moe_permute's bad expert ids or too short out (moe.h), and device-only
 * split sizes of fm_grouped_gemm that do not add up (gemm.h). */
fm_status fm_context_synchronize(fm_context *ctx);

/* Memory in the context's own device: malloc on the CPU backend, cudaMalloc
 * on CUDA; at least 256-byte aligned. The trainer may use it for its tensors
 * (it owns what it allocates; fm_context_free releases it). */
fm_status fm_context_alloc(fm_context *ctx, size_t bytes, void **out);
void fm_context_free(fm_context *ctx, void *p);
/* Copy `bytes` from src to dst, each on the host or in the context's memory
 * (`*_device` says which). Queued on the context's stream; a copy that
 * involves host memory has completed when the call returns. */
fm_status fm_context_copy(fm_context *ctx, void *dst, fm_device dst_device, const void *src, fm_device src_device,
                          size_t bytes);
/* Set `bytes` bytes of context memory to `value` (queued on the stream). */
fm_status fm_context_memset(fm_context *ctx, void *p, int value, size_t bytes);

/* Op counters, one per public op. */
typedef enum fm_op {
    FM_OP_QUANTIZE = 0,
    FM_OP_DEQUANTIZE,
    FM_OP_SCALE_LAYOUT_CONVERT,
    FM_OP_TRANSPOSE_SCALED,
    FM_OP_CONVERT_SCALED,
    FM_OP_TRANSPOSE_SCALED_GROUPED,
    FM_OP_GEMM,                /* fm_gemm and fm_linear_* */
    FM_OP_GROUPED_GEMM,
    FM_OP_GROUPED_GEMM_WGRAD,
    FM_OP_MOE_ROUTER,
    FM_OP_MOE_ROUTER_BACKWARD,
    FM_OP_MOE_PERMUTE,
    FM_OP_MOE_UNPERMUTE,
    FM_OP_MOE_UNPERMUTE_BACKWARD,
    FM_OP_MOE_SWIGLU,
    FM_OP_MOE_SWIGLU_BACKWARD,
    FM_OP_CAST,                /* fm_cast: between F32, BF16 and F16, unscaled */
    FM_OP_QUANTIZE_GROUPED,
    FM_OP_EP_DISPATCH,         /* fm_ep_dispatch: bytes = rows sent and received */
    FM_OP_EP_COMBINE,
    FM_OP_COUNT_ = 32          /* room for later ops; the array below has this size */
} fm_op;

typedef struct fm_stats {
    int64_t casts_to_low;      /* explicit casts high precision -> low precision (quantize) */
    int64_t casts_to_high;     /* explicit casts low -> high (dequantize) */
    int64_t bytes_read;        /* bytes the ops read from tensors (data + scales) */
    int64_t bytes_written;     /* bytes the ops wrote */
    int64_t op_calls;          /* successful op calls, all ops: on CUDA, the calls
                                * that returned FM_OK, including one whose input
                                * only the device could refuse (reported by the
                                * next fm_context_synchronize, which does not
                                * take back its counts) */
    int64_t calls[FM_OP_COUNT_];
} fm_stats;

fm_status fm_stats_get(const fm_context *ctx, fm_stats *out);
fm_status fm_stats_reset(fm_context *ctx);
const char *fm_op_name(fm_op op);

#ifdef __cplusplus
}
#endif
#endif
