/* flowmoe — a whole MoE layer, forward and backward, in four recipes.
 *
 *   y = Σ_{j<k} p_tj · W2_e · swiglu(W1_e · x_t),  e = the j-th chosen expert
 *   (router: logits = x · Wrᵀ, then fm_moe_router)
 *
 * The caller owns the F32 master weights and their F32 gradients, in the
 * context's memory (device memory on CUDA). The layer owns its working
 * memory, sized at creation for up to cfg->max_tokens tokens, so a step
 * allocates nothing. Low-precision weight copies are refreshed by
 * fm_moe_layer_refresh_weights (once per optimizer step); those casts are
 * counted apart from the per-step ones (fm_moe_layer_info).
 *
 * Recipes (what each GEMM eats and what is saved for backward):
 *   BF16            BF16 GEMMs throughout; saves the BF16 GEMM inputs.
 *   FP8_BLOCKWISE   the usual FP8 baseline (TransformerEngine's blockwise
 *                   recipe): every FP8 GEMM operand quantized from BF16 for
 *                   its row-wise and column-wise use separately.
 *   FP8_FLOW        FP8-Flow-MoE: x quantized once before dispatch, dy once
 *                   in backward; permute, SwiGLU, dSwiGLU and the column-wise
 *                   copies stay in FP8 (fused ops, scaling-aware transposes).
 *   FP8_FLOW_FP4    FP8_FLOW with the activations saved for backward in
 *                   MXFP4, through direct conversions: the SwiGLU input, and
 *                   x as the MXFP4 rows the rank received over expert
 *                   parallelism, or its dispatched rows in MXFP4 with top-k
 *                   1 (on one rank with top-k >= 2 x's FP8 token rows, which
 *                   FP8_FLOW keeps, take fewer bytes than the k-fold
 *                   dispatched rows in MXFP4, so those are kept instead);
 *                   the GEMMs still eat FP8. On one rank
 *                   the dispatch moves nothing between GPUs, so its payload
 *                   stays FP8 (an MXFP4 payload there only added error:
 *                   +14.7% final loss in fm-train); over expert parallelism
 *                   the payload is what fm_convert_scaled makes of it, and
 *                   costs as much (fm-train --ep 2: +17.6% over 8 seeds).
 * FP8 recipes use E4M3 BLOCK_1x128 power-of-two activations and gradients,
 * E4M3 BLOCK_128x128 weights, and pad each expert to 128 rows.
 *
 * Expert parallelism (cfg->comm, see comm.h): the cfg->experts experts are
 * split over the communicator's ranks in contiguous blocks of
 * E_local = experts / nranks. Each rank routes its own tokens over all
 * experts, sends each token once to every rank owning one of its choices
 * (fm_ep_dispatch: BF16 rows for bf16 and fp8-blockwise, FP8 rows and
 * scales for fp8-flow, MXFP4 for fp8-flow-fp4 made by fm_convert_scaled and
 * turned back into FP8 on arrival), runs its local experts on what it
 * received, and gets each token's output back as BF16 partial sums
 * (fm_ep_combine). Backward sends dy the same way (in the recipe's gradient
 * precision) and combines dx and d(probabilities) back. With tokens split
 * over ranks in order (rank r holding the r-th block), every expert sees the
 * rows it would see on one rank in the same order, so its weight gradients
 * equal the single-rank layer's bit for bit; y and dx differ from it only by
 * the BF16 rounding of each rank's partial sum and the order of the sum.
 * Weights with a comm: router Wr [E, H] on every rank (its gradient is this
 * rank's tokens' share: sum it over ranks as any replicated parameter), w1
 * and w2 hold the rank's E_local experts. Every rank makes the same calls
 * (forward, backward, refresh) with the same config, max_tokens included;
 * a step that fails on one rank aborts the communicator (fm_comm_abort), so
 * that no rank waits for it forever. */
#ifndef FLOWMOE_LAYER_H
#define FLOWMOE_LAYER_H

#include "flowmoe/comm.h"
#include "flowmoe/context.h"
#include "flowmoe/moe.h"
#include "flowmoe/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fm_recipe {
    FM_RECIPE_BF16 = 0,
    FM_RECIPE_FP8_BLOCKWISE,
    FM_RECIPE_FP8_FLOW,
    FM_RECIPE_FP8_FLOW_FP4,
    FM_RECIPE_COUNT
} fm_recipe;

const char *fm_recipe_name(fm_recipe r);      /* "bf16", "fp8-blockwise", "fp8-flow", "fp8-flow-fp4" */
int fm_recipe_parse(const char *name, fm_recipe *out); /* 1 on success */

typedef struct fm_moe_layer_config {
    int64_t hidden;        /* H */
    int64_t ffn;           /* I, each expert's FFN size */
    int64_t experts;       /* E */
    int topk;              /* k in [1, E] */
    int pad_multiple;      /* rows per expert rounded up to this; 0: 128 for FP8 recipes, 1 for BF16 */
    fm_router_score score;
    int renormalize;       /* renormalise the k probabilities */
    fm_recipe recipe;
    int64_t max_tokens;    /* the largest T a step may use (on each rank) */
    fm_comm *comm;         /* expert parallelism over this rank's communicator; NULL: one rank */
    /* fp8-flow(-fp4): the column-wise copies of x and h that the weight
     * gradients read are scaled per 128 x 128 tile (0, the default: the ROWMAX
     * transpose, whose 128 x 1 blocks of a tile share the tile's largest row
     * scale anyway, so cuBLASLt runs its 1x128 x 128x128 product, about 1.2x
     * the 1x128 x 1x128 one on H100) or per 128 x 1 column block on its true
     * amax (1: the TIGHT transpose, which loses fewer small values to
     * underflow). dy and the SwiGLU input gradient stay TIGHT 128 x 1. */
    int wgrad_tight_columns;
    /* 1: every op of a step on the context's stream, one after another. 0 (the
     * default): on CUDA, backward runs the column-wise copies the weight
     * gradients read, and the way back to the tokens, on a second stream
     * beside the GEMMs (the context keeps a second workspace for it, of
     * fm_context_config.workspace_bytes). The results are the same bit for
     * bit; with a comm the layer always keeps to one stream. */
    int single_stream;
    /* fp8-flow(-fp4): what W2's weight gradient reads as h, the SwiGLU
     * output. 0 (the default): the FP8 h the forward made and fc2 read, kept
     * for backward, so the gradient is that of the forward's own product. 1:
     * h recomputed in backward from the saved SwiGLU input (FP8, or MXFP4 for
     * fp8-flow-fp4): R x I FP8 codes and their scales fewer kept (69 MB a
     * layer at T 4096, I 2048, k 8), one SwiGLU pass more, and an h made from
     * the rounded input, not the forward's. */
    int recompute_h;
} fm_moe_layer_config;

/* Caller-owned F32 tensors in the context's memory, row-major. */
typedef struct fm_moe_weights {
    float *router;         /* Wr [E, H] */
    float *w1;             /* W1 [E_local, 2I, H]: rows [0, I) gate, [I, 2I) up (E_local = E on one rank) */
    float *w2;             /* W2 [E_local, H, I] */
    /* Gradients, ACCUMULATED into by fm_moe_layer_backward (zero them per step). */
    float *grad_router;
    float *grad_w1;
    float *grad_w2;
} fm_moe_weights;

typedef struct fm_moe_layer fm_moe_layer;

typedef struct fm_moe_layer_info {
    int64_t workspace_bytes;       /* what the layer allocated in the context's memory */
    int64_t saved_bytes;           /* activation bytes the last forward kept for backward */
    int64_t casts_per_step;        /* explicit casts (fm_quantize / fm_dequantize calls) of the
                                      last forward + backward, from the context statistics */
    int64_t casts_per_refresh;     /* casts of the last weight refresh */
    int64_t routed_rows;           /* T·k of the last forward */
    int64_t padded_rows;           /* Σ padded M_e of the last forward */
} fm_moe_layer_info;

/* Workspace bytes a layer with this config would allocate (before creating it). */
fm_status fm_moe_layer_workspace_size(fm_context *ctx, const fm_moe_layer_config *cfg, int64_t *bytes);
fm_status fm_moe_layer_create(fm_context *ctx, const fm_moe_layer_config *cfg, fm_moe_layer **out);
void fm_moe_layer_destroy(fm_moe_layer *layer);
fm_status fm_moe_layer_get_info(const fm_moe_layer *layer, fm_moe_layer_info *out);

/* Re-derive the low-precision weight copies from the F32 masters. */
fm_status fm_moe_layer_refresh_weights(fm_moe_layer *layer, const fm_moe_weights *w);

/* x [T, H] F32 -> y [T, H] F32, T <= max_tokens. Saves what backward needs. */
fm_status fm_moe_layer_forward(fm_moe_layer *layer, const fm_moe_weights *w, const fm_tensor *x, fm_tensor *y);

/* dy [T, H] F32 (same T as the last forward) -> dx [T, H] F32 (router path
 * included); accumulates into w->grad_*. x is the last forward's input: the
 * router's weight gradient needs it, and the caller holds it anyway (the
 * residual stream), so the layer does not keep a copy. */
fm_status fm_moe_layer_backward(fm_moe_layer *layer, const fm_moe_weights *w, const fm_tensor *x,
                                const fm_tensor *dy, fm_tensor *dx);

#ifdef __cplusplus
}
#endif
#endif
