/* flowmoe internals shared by core and the backends. Not installed. */
#ifndef FLOWMOE_INTERNAL_H
#define FLOWMOE_INTERNAL_H

#include "flowmoe/flowmoe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The backend vtable. Ops receive descriptors core has already validated. */
typedef struct fm_backend {
    const char *name;
    fm_device device;
    fm_status (*quantize)(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *in,
                          fm_tensor *out_row, fm_tensor *out_col);
    fm_status (*dequantize)(fm_context *ctx, const fm_tensor *in, fm_tensor *out);
    fm_status (*scale_layout_convert)(fm_context *ctx, const fm_tensor *src, fm_tensor *dst);
    fm_status (*synchronize)(fm_context *ctx);
    fm_status (*set_stream)(fm_context *ctx, void *stream);
    void (*destroy)(fm_context *ctx);
    /* Context memory (fm_context_alloc and friends); validated by core. */
    fm_status (*mem_alloc)(fm_context *ctx, size_t bytes, void **out);
    void (*mem_free)(fm_context *ctx, void *p);
    fm_status (*mem_copy)(fm_context *ctx, void *dst, fm_device dd, const void *src, fm_device sd, size_t bytes);
    fm_status (*mem_set)(fm_context *ctx, void *p, int value, size_t bytes);
    /* fm_cast: unscaled F32/BF16/F16 conversion. */
    fm_status (*cast)(fm_context *ctx, const fm_tensor *in, fm_tensor *out);
    /* fm_transpose_scaled and fm_convert_scaled: one re-encoding op. */
    fm_status (*requantize)(fm_context *ctx, const fm_requant_config *cfg, const fm_tensor *in, fm_tensor *out);
    /* fm_transpose_scaled_grouped. */
    fm_status (*requantize_grouped)(fm_context *ctx, const fm_requant_config *cfg, const fm_splits *splits,
                                    const fm_tensor *in, fm_tensor *out);
    /* fm_transpose_scaled_grouped_rows. */
    fm_status (*requantize_grouped_rows)(fm_context *ctx, const fm_requant_config *cfg, const fm_splits *splits,
                                         const fm_tensor *in, const fm_tensor *row_map, int topk, fm_tensor *out);
    /* fm_gemm and the fm_linear_* entry points (core hands over A [M,K], B [N,K]). */
    fm_status (*gemm)(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *a, const fm_tensor *b,
                      fm_tensor *d);
    fm_status (*grouped_gemm)(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *splits,
                              const fm_tensor *a, const fm_tensor *b, fm_tensor *d);
    fm_status (*grouped_gemm_wgrad)(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *splits,
                                    const fm_tensor *dy, const fm_tensor *x, fm_tensor *dw);
    fm_status (*moe_router)(fm_context *ctx, const fm_router_config *cfg, const fm_tensor *logits,
                            fm_tensor *expert_ids, fm_tensor *probs, fm_tensor *tokens_per_expert);
    fm_status (*moe_router_backward)(fm_context *ctx, const fm_router_config *cfg, const fm_tensor *logits,
                                     const fm_tensor *expert_ids, const fm_tensor *dprobs, fm_tensor *dlogits);
    fm_status (*moe_permute)(fm_context *ctx, const fm_permute_config *cfg, const fm_tensor *x,
                             const fm_tensor *expert_ids, const fm_tensor *probs, fm_tensor *out,
                             fm_tensor *row_map, fm_tensor *slot_rows, fm_tensor *splits, fm_tensor *out_probs,
                             int64_t *host_splits);
    fm_status (*moe_unpermute)(fm_context *ctx, const fm_tensor *y, const fm_tensor *slot_rows,
                               const fm_tensor *probs, fm_tensor *out);
    fm_status (*moe_unpermute_backward)(fm_context *ctx, const fm_tensor *dout, const fm_tensor *y,
                                        const fm_tensor *row_map, const fm_tensor *slot_rows,
                                        const fm_tensor *probs, fm_tensor *dy, fm_tensor *dprobs);
    fm_status (*moe_swiglu)(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *in,
                            const fm_tensor *probs, fm_tensor *out_row, fm_tensor *out_col,
                            fm_tensor *in_saved);
    fm_status (*moe_swiglu_backward)(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *dh,
                                     const fm_tensor *in, const fm_tensor *probs, fm_tensor *din_row,
                                     fm_tensor *din_col, fm_tensor *dprobs);
    /* The two queues below; NULL where ops run in call order (CPU). */
    fm_status (*queue_prepare)(fm_context *ctx);
    fm_status (*queue_select)(fm_context *ctx, int q, int wait);
} fm_backend;

struct fm_context {
    fm_backend_kind kind;
    const fm_backend *be;
    void *be_state;        /* backend-owned (CUDA: handles, workspace) */
    void *stream;          /* cudaStream_t of a CUDA context; NULL = legacy default stream */
    int cpu_threads;
    fm_stats stats;
    char err[768];
};

/* Two in-order queues of work on one context, so that a caller (the layer)
 * can run memory-bound ops beside GEMMs: queue 0 is the context's stream,
 * queue 1 the backend's second one, with its own scratch. After
 * fm_queue_select(ctx, q, wait) ops go to queue q; with wait, q first waits
 * for everything enqueued so far on the other queue. Whoever selects queue 1
 * selects 0 again, with wait, before returning to its caller.
 * fm_queue_prepare allocates what queue 1 needs (do it outside a step). On a
 * backend without queues both are no-ops: ops run in call order there. */
static inline fm_status fm_queue_prepare(fm_context *ctx)
{
    return ctx->be->queue_prepare ? ctx->be->queue_prepare(ctx) : FM_OK;
}
static inline fm_status fm_queue_select(fm_context *ctx, int q, int wait)
{
    return ctx->be->queue_select ? ctx->be->queue_select(ctx, q, wait) : FM_OK;
}

/* Record a sentence for fm_last_error and return `st`. */
fm_status fm_error(fm_context *ctx, fm_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
void fm_error_clear(fm_context *ctx);
/* Error of fm_context_create, kept per thread. */
fm_status fm_create_error(fm_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Shape checks: 0 and a sentence fragment in `why` when invalid. */
int fm_tensor_shape_ok(const fm_tensor *t, const char **why);

/* Backends. */
extern const fm_backend fm_cpu_backend;
fm_status fm_cpu_backend_init(fm_context *ctx, const fm_context_config *cfg);

/* Whether this build has the CUDA backend and a usable device; the CUDA
 * backend's init (defined only when built with CUDA). */
int fm_cuda_compiled(void);
int fm_cuda_device_usable(int device);
fm_status fm_cuda_backend_init(fm_context *ctx, const fm_context_config *cfg);
/* Where a pointer lives, when the runtime can tell: 1 device, 0 host,
 * -1 unknown (no CUDA in this build, or the runtime could not say). */
int fm_cuda_pointer_is_device(const void *p);

/* Resolve FM_SCALE_RULE_DEFAULT for a mode. */
static inline fm_scale_rule fm_effective_rule(fm_scale_rule r, fm_scale_mode m)
{
    if (r != FM_SCALE_RULE_DEFAULT)
        return r;
    return (m == FM_SCALE_TENSOR || m == FM_SCALE_ROW) ? FM_SCALE_RULE_EXACT : FM_SCALE_RULE_POW2;
}

#ifdef __cplusplus
}
#endif
#endif
