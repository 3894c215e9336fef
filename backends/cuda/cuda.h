/* CUDA backend internals (host side). C linkage for the vtable. */
#ifndef FLOWMOE_CUDA_H
#define FLOWMOE_CUDA_H

#include <cuda_runtime.h>
#include <cublasLt.h>

#include "../../core/internal.h"

typedef struct fm_cuda_state {
    int device;
    cudaDeviceProp prop;
    cublasLtHandle_t lt;
    void *workspace;
    size_t workspace_bytes;
    void *gemm;            /* GEMM plan cache and side streams (gemm.cu), NULL until the first GEMM */
    void *host_small;      /* FM_CUDA_HOST_SMALL bytes of pinned host memory: the small device-to-host
                            * readbacks an op waits for (a copy to pageable memory takes a staging detour) */
    struct fm_cuda_pending *pending; /* device memory: see fm_cuda_pending */
    /* Device memory, FM_CUDA_OP_WORDS bytes a queue, zeroed at creation:
     * state an op keeps on the device from one call to the next (the
     * power-of-two check's, which resets itself, so no call clears it). */
    void *op_words;
    cudaEvent_t swap_event; /* fm_context_set_stream: the new stream waits for the old */
    /* Queue 1 (internal.h's fm_queue_select): a stream and a workspace of its
     * own, so that its ops never share scratch with queue 0's; `queue` is
     * where ops go now. Made by fm_queue_prepare. */
    int queue;
    cudaStream_t q1_stream;
    cudaEvent_t q_event;
    void *q1_workspace;
} fm_cuda_state;

#define FM_CUDA_HOST_SMALL 256
#define FM_CUDA_OP_WORDS 64

/* The calling queue's op words (see fm_cuda_state.op_words). */
#define fm_cuda_op_words(ctx) ((void *)((char *)fm_cuda(ctx)->op_words + fm_cuda(ctx)->queue * FM_CUDA_OP_WORDS))

/* Bad input that only the device can see, found by an op that does not wait
 * for the device (the power-of-two check of scaling-aware ops' F32 scales,
 * whose kernels then write nothing; fm_moe_permute's expert ids and row
 * count, whose outputs then hold no placed slot; the native grouped GEMM's
 * device-only split sizes, which it clamps): the first such finding
 * since the last fm_context_synchronize waits here; that call reports it
 * (and clears it) with the sentence the CPU backend returns at once.
 * state: 0 none, 1 being written, 2 ready. */
enum {
    FM_CUDA_PENDING_SCALE_ROW = 1,   /* a = row, b = block, bits = the scale */
    FM_CUDA_PENDING_SCALE_BLOCK = 2, /* a = expert or group, b = stored row, c = block, bits = the scale */
    FM_CUDA_PENDING_BAD_ID = 3,      /* fm_moe_permute: entry [a, b] is (int)bits, outside [0, E = c), not -1 */
    FM_CUDA_PENDING_FEW_ROWS = 4,    /* fm_moe_permute: out has a rows, the routing needs b (pad c, bound d) */
    FM_CUDA_PENDING_SPLIT_NEG = 5,   /* fm_grouped_gemm, device-only splits: size [a] is b < 0 */
    FM_CUDA_PENDING_SPLIT_PAST = 6,  /* ... the sizes pass a's a rows at group b */
    FM_CUDA_PENDING_SPLIT_SUM = 7    /* ... the sizes sum to a, a has b rows */
};
typedef struct fm_cuda_pending {
    unsigned int state;
    unsigned int kind;
    unsigned int bits;
    unsigned int unused;
    long long a, b, c, d;
} fm_cuda_pending;

#ifdef __CUDACC__
/* A kernel's finding: claim the record (false: an earlier one waits to be
 * reported, and this one is dropped), fill it, post it. */
static __device__ __forceinline__ bool fm_pending_claim(fm_cuda_pending *p)
{
    return atomicCAS(&p->state, 0u, 1u) == 0u;
}
static __device__ __forceinline__ void fm_pending_post(fm_cuda_pending *p)
{
    __threadfence();
    atomicExch(&p->state, 2u);
}
#endif

static inline fm_cuda_state *fm_cuda(fm_context *ctx) { return (fm_cuda_state *)ctx->be_state; }
static inline cudaStream_t fm_cuda_stream(fm_context *ctx)
{
    const fm_cuda_state *s = fm_cuda(ctx);
    return s->queue ? s->q1_stream : (cudaStream_t)ctx->stream;
}

/* An op makes the context's device current and gives the caller's back. */
typedef struct fm_cuda_device_guard {
    int prev;
    int changed;
} fm_cuda_device_guard;

#ifdef __cplusplus
extern "C" {
#endif

/* A finding (state 2) as FM_ERR_INVALID_ARG and its op's sentence; FM_OK
 * for none (state 0). */
fm_status fm_cuda_pending_report(fm_context *ctx, const fm_cuda_pending *h);

/* Turn a CUDA error into a status and a sentence naming what failed. */
fm_status fm_cuda_check(fm_context *ctx, cudaError_t err, const char *what);
/* After a launch: the launch error, as above. */
fm_status fm_cuda_check_launch(fm_context *ctx, const char *kernel);

/* Op entry and exit: switch to the context's device and back; `leave`
 * returns fm_cuda_check(err, what). */
fm_status fm_cuda_enter(fm_context *ctx, fm_cuda_device_guard *g, const char *op);
fm_status fm_cuda_leave(fm_context *ctx, fm_cuda_device_guard *g, cudaError_t err, const char *what);

/* Scratch memory for one op, ordered on the context's stream: the context
 * workspace when it is large enough (ops on one stream run one after the
 * other, so they never share it at the same time), else a stream-ordered
 * cudaMallocAsync that the op frees with cudaFreeAsync (*owned = 1). */
fm_status fm_cuda_scratch(fm_context *ctx, size_t bytes, void **p, int *owned, const char *op);

/* The ops (one file each). */
fm_status fm_cuda_quantize(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *in, fm_tensor *out_row,
                           fm_tensor *out_col);
fm_status fm_cuda_dequantize(fm_context *ctx, const fm_tensor *in, fm_tensor *out);
fm_status fm_cuda_scale_layout_convert(fm_context *ctx, const fm_tensor *src, fm_tensor *dst);
fm_status fm_cuda_cast(fm_context *ctx, const fm_tensor *in, fm_tensor *out);
fm_status fm_cuda_requantize(fm_context *ctx, const fm_requant_config *cfg, const fm_tensor *in, fm_tensor *out);
fm_status fm_cuda_requantize_grouped(fm_context *ctx, const fm_requant_config *cfg, const fm_splits *splits,
                                     const fm_tensor *in, fm_tensor *out);
fm_status fm_cuda_requantize_grouped_rows(fm_context *ctx, const fm_requant_config *cfg, const fm_splits *splits,
                                          const fm_tensor *in, const fm_tensor *row_map, int topk, fm_tensor *out);
fm_status fm_cuda_gemm(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *a, const fm_tensor *b,
                       fm_tensor *d);
fm_status fm_cuda_grouped_gemm(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *splits,
                               const fm_tensor *a, const fm_tensor *b, fm_tensor *d);
/* The native sm_90a FP8 GEMM (grouped_gemm_sm90.cu): why it cannot run a
 * product (NULL: it can), and the product itself (splits NULL: dense). */
const char *fm_cuda_gemm_sm90_why_not(fm_context *ctx, const fm_splits *splits, const fm_tensor *a,
                                      const fm_tensor *b, const fm_tensor *d);
fm_status fm_cuda_gemm_sm90(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *splits, const fm_tensor *a,
                            const fm_tensor *b, fm_tensor *d);
/* Its k-grouped form (the experts' weight gradients): one expert's operands,
 * dW_e [N, K] (+)= A [N, m] · B [K, m]ᵀ with m contiguous in both and their
 * GEMM-layout scales (A 1x128, B 128x128); why it cannot run a product; the
 * product over n non-empty experts. */
typedef struct {
    const void *a, *b;
    const float *sa, *sb;
    int64_t m, e;
} fm_sm90_kjob;
const char *fm_cuda_gemm_wgrad_sm90_why_not(fm_context *ctx, const fm_splits *splits, const fm_tensor *dy,
                                            const fm_tensor *x, const fm_tensor *dw);
fm_status fm_cuda_gemm_wgrad_sm90(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *dy, const fm_tensor *x,
                                  fm_tensor *dw, const fm_sm90_kjob *jobs, int64_t n);
/* F32 products with M or N at most 16 (gemm_f32_skinny.cu): which kernel
 * takes D [M, N] = A · Bᵀ (0: none), and the product. */
int fm_cuda_gemm_skinny_kind(const fm_tensor *a, const fm_tensor *b, const fm_tensor *d, int64_t M, int64_t N,
                             int64_t K);
fm_status fm_cuda_gemm_skinny(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *a, const fm_tensor *b,
                              fm_tensor *d, int kind);
fm_status fm_cuda_grouped_gemm_wgrad(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *splits,
                                     const fm_tensor *dy, const fm_tensor *x, fm_tensor *dw);
/* Frees the GEMM plans and streams (context destroy). */
void fm_cuda_gemm_destroy(fm_cuda_state *s);
fm_status fm_cuda_moe_router(fm_context *ctx, const fm_router_config *cfg, const fm_tensor *logits,
                             fm_tensor *expert_ids, fm_tensor *probs, fm_tensor *tokens_per_expert);
fm_status fm_cuda_moe_router_backward(fm_context *ctx, const fm_router_config *cfg, const fm_tensor *logits,
                                      const fm_tensor *expert_ids, const fm_tensor *dprobs, fm_tensor *dlogits);
fm_status fm_cuda_moe_permute(fm_context *ctx, const fm_permute_config *cfg, const fm_tensor *x,
                              const fm_tensor *expert_ids, const fm_tensor *probs, fm_tensor *out, fm_tensor *row_map,
                              fm_tensor *slot_rows, fm_tensor *splits, fm_tensor *out_probs, int64_t *host_splits);
fm_status fm_cuda_moe_unpermute(fm_context *ctx, const fm_tensor *y, const fm_tensor *slot_rows,
                                const fm_tensor *probs, fm_tensor *out);
fm_status fm_cuda_moe_unpermute_backward(fm_context *ctx, const fm_tensor *dout, const fm_tensor *y,
                                         const fm_tensor *row_map, const fm_tensor *slot_rows, const fm_tensor *probs,
                                         fm_tensor *dy, fm_tensor *dprobs);
fm_status fm_cuda_moe_swiglu(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *in, const fm_tensor *probs,
                             fm_tensor *out_row, fm_tensor *out_col, fm_tensor *in_saved);
fm_status fm_cuda_moe_swiglu_backward(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *dh,
                                      const fm_tensor *in, const fm_tensor *probs, fm_tensor *din_row,
                                      fm_tensor *din_col, fm_tensor *dprobs);

#ifdef __cplusplus
}
#endif

#endif
