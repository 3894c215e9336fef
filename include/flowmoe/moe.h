/* flowmoe — MoE ops: router top-k, permute + pad, unpermute + combine, and
 * the fused weighted SwiGLU + quantize with its backward.
 *
 * Every op here is exact: the CUDA backend reproduces the CPU backend bit for
 * bit, SwiGLU and softmax included (their exp/sigmoid live in the shared
 * static-inline header flowmoe/mathfn.h, evaluated with explicit fmaf and no
 * contraction on both sides). Reductions that feed an output (softmax sums,
 * the dot products of backward passes) use the fixed order of
 * fm_dot_order_f32 in mathfn.h: 32 strided partial sums, then a fixed
 * pairwise tree, which is what one warp per row computes (the SwiGLU
 * backward's dprobs feeds runs of 8 columns to each partial sum instead,
 * fm_dot_order_runs_f32).
 *
 * Shapes: T tokens, E experts, k chosen experts per token, H hidden, I expert
 * FFN size, R rows of the expert-contiguous (permuted, padded) layout. Index
 * tensors are 2-D: expert ids [T, k] I32, per-row vectors [R, 1], per-expert
 * vectors [1, E] I64. */
#ifndef FLOWMOE_MOE_H
#define FLOWMOE_MOE_H

#include "flowmoe/context.h"
#include "flowmoe/quant.h"
#include "flowmoe/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fm_router_score {
    FM_ROUTER_SOFTMAX = 0, /* s = softmax(logits) over all E experts */
    FM_ROUTER_SIGMOID,     /* s = sigmoid(logits) (DeepSeek-V3) */
    FM_ROUTER_SCORE_COUNT
} fm_router_score;

typedef struct fm_router_config {
    int topk;               /* k in [1, E]; 0 means 1 */
    fm_router_score score;
    int renormalize;        /* probabilities divided by their sum over the k chosen experts */
    /* Optional [E] F32 in the logits' memory: added to s for SELECTION only
     * (auxiliary-loss-free balancing); the probabilities use s itself. */
    const float *bias;
} fm_router_config;

/* Router: logits [T, E] F32 -> expert_ids [T, k] I32 and probs [T, k] F32,
 * the k experts of each token in descending order of s + bias (ties: lower
 * expert id first), probs the matching s (renormalised when asked). Sigmoid
 * scores renormalised over chosen scores that all round to 0 (chosen logits
 * below about -104) take their limit, the softmax of the chosen logits
 * (mathfn.h's fm_softmax_f32), and the backward its gradient. A token
 * whose logits hold NaN gets NaN probabilities (its ids are still k distinct
 * valid experts, chosen with NaN ordered below every number).
 * tokens_per_expert [1, E] I64 (optional): how many tokens chose each expert. */
fm_status fm_moe_router(fm_context *ctx, const fm_router_config *cfg, const fm_tensor *logits,
                        fm_tensor *expert_ids, fm_tensor *probs, fm_tensor *tokens_per_expert);

/* Router backward: dprobs [T, k] F32 (gradient of the probs output) ->
 * dlogits [T, E] F32, through the scoring and the renormalisation (the
 * selection itself has no gradient; bias gets none). Takes the forward's
 * logits and expert_ids. */
fm_status fm_moe_router_backward(fm_context *ctx, const fm_router_config *cfg, const fm_tensor *logits,
                                 const fm_tensor *expert_ids, const fm_tensor *dprobs, fm_tensor *dlogits);

typedef struct fm_permute_config {
    int pad_multiple;   /* each expert's row count is rounded up to a multiple of this; 0 or 1: no padding */
} fm_permute_config;

/* Permute + pad: token rows x [T, H] -> expert-contiguous rows out [R, H].
 *
 * x is BF16/F32 unscaled, or quantized row-wise (E4M3/E5M2 with BLOCK_1x128 or
 * MX32, E2M1 with MX32; COMPACT scales): codes and scales travel together, no
 * cast. out has x's dtype, mode and compact scale layout. Expert e's rows
 * start at Σ_{e'<e} P_e' where P_e = round_up(M_e, pad_multiple) and M_e the
 * number of (token, choice) slots routed to e; inside an expert, rows follow
 * the source token index. R must be at least Σ P_e; R = T·k + E·(pad - 1)
 * always is. Padding rows, and every row past Σ P_e, are zero codes with
 * scale 1 (E8M0 127).
 *
 * Outputs besides out (all in the tensors' memory):
 *   row_map   [R, 1] I32: the source slot t·k + j of each row, -1 for padding.
 *   slot_rows [T, k] I32: the out row of each slot (the inverse of row_map).
 *   splits    [1, E] I64: P_e, the padded rows per expert (what the grouped
 *             GEMMs take as their device splits).
 *   out_probs [R, 1] F32, optional: probs[t, j] of each row, 0 for padding
 *             (probs [T, k] F32 must then be given).
 *   host_splits, optional: int64_t[E] host array that receives P_e too (on
 *             CUDA this waits for the device; leave NULL to stay asynchronous).
 * expert_ids [T, k] I32 must hold ids in [0, E) with E the columns of splits,
 * or -1: a slot with no expert here (what fm_ep_dispatch writes for the
 * choices that live on other ranks). A -1 slot takes no row, its slot_rows
 * entry is -1, and fm_moe_unpermute and its backward skip it. Any other id
 * out of range is reported as FM_ERR_INVALID_ARG, as is an out with fewer
 * rows than the routing needs. On CUDA both are found on the device: the
 * call reports them itself when host_splits makes it wait; otherwise it
 * returns FM_OK, its outputs hold zero rows (row_map and slot_rows -1;
 * splits the padded counts of the valid ids), and the next
 * fm_context_synchronize reports the finding. */
fm_status fm_moe_permute(fm_context *ctx, const fm_permute_config *cfg, const fm_tensor *x,
                         const fm_tensor *expert_ids, const fm_tensor *probs, fm_tensor *out, fm_tensor *row_map,
                         fm_tensor *slot_rows, fm_tensor *splits, fm_tensor *out_probs, int64_t *host_splits);

/* Unpermute + unpad + combine: expert rows y [R, H] (BF16/F32) -> out [T, H]
 * (BF16/F32): out[t] = Σ_{j<k} w_tj · y[slot_rows[t, j]] with w = probs [T, k]
 * F32, or w = 1 when probs is NULL (then it is also the backward of
 * fm_moe_permute for unscaled gradients). In F32, j in order:
 * acc = fmaf(w_tj, y, acc) starting from acc = 0, rounded once to out.
 * Slots whose slot_rows entry is -1 (no expert here) are skipped; a token
 * with no slot left gets a zero row. */
fm_status fm_moe_unpermute(fm_context *ctx, const fm_tensor *y, const fm_tensor *slot_rows, const fm_tensor *probs,
                           fm_tensor *out);

/* Backward of fm_moe_unpermute: dout [T, H] (BF16/F32) -> dy [R, H]
 * (BF16/F32), dy[slot_rows[t, j]] = w_tj · dout[t] (padding rows zero; row_map
 * tells which rows are padding), and, when probs is given, dprobs [T, k] F32 =
 * the fm_dot_order_f32 dot of dout[t] and y[slot_rows[t, j]] (y, the
 * forward's input, is then required); 0 for a slot whose slot_rows entry
 * is -1. */
fm_status fm_moe_unpermute_backward(fm_context *ctx, const fm_tensor *dout, const fm_tensor *y,
                                    const fm_tensor *row_map, const fm_tensor *slot_rows, const fm_tensor *probs,
                                    fm_tensor *dy, fm_tensor *dprobs);

/* Fused weighted SwiGLU + quantize: in [M, 2I] (gate in columns [0, I), up in
 * [I, 2I)) -> h [M, I] with h = (silu(g) · u) · p in F32, silu as in mathfn.h,
 * p = probs [M, 1] F32 (NULL: no weighting). in is BF16/F32, or quantized
 * row-wise (decoded exactly first: fp8-flow saves its activations in FP8).
 * out_row [M, I] and the optional out_col (column-wise) are quantized exactly
 * as fm_quantize(cfg, h) would quantize the F32 h, or out_row is BF16/F32
 * unscaled (then out_col must be NULL).
 * in_saved (optional, [M, 2I] row-wise quantized, e.g. E4M3 BLOCK_1x128 or
 * E2M1 MX32): `in` quantized as fm_quantize(cfg, in) would, written in the
 * same pass — the copy a recipe saves for fm_moe_swiglu_backward without an
 * extra read of `in` (in must then be BF16/F32). cfg->amax and
 * cfg->nonfinite_blocks describe h only, as quantized into out_row / out_col:
 * with an unscaled out_row nothing is quantized, and asking for them is
 * FM_ERR_INVALID_ARG (so is it for din_row in fm_moe_swiglu_backward). */
fm_status fm_moe_swiglu(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *in, const fm_tensor *probs,
                        fm_tensor *out_row, fm_tensor *out_col, fm_tensor *in_saved);

/* dSwiGLU + quantize: dh [M, I] (BF16/F32, or quantized row-wise) and the
 * forward's in [M, 2I] (BF16/F32 or quantized row-wise, e.g. the saved FP8 or
 * MXFP4 copy) -> din [M, 2I] = [dg | du] with, in F32,
 *   a = silu(g), q = dh · p,  du = q · a,  dg = (q · u) · dsilu(g)
 * (dsilu as in mathfn.h), quantized as fm_quantize would (din_row, optional
 * din_col column-wise), or din_row BF16/F32 unscaled. With probs given,
 * dprobs [M, 1] F32 (optional) = the fm_dot_order_runs_f32 dot of dh and a · u
 * (runs of 8 columns to each of the 32 partial sums). */
fm_status fm_moe_swiglu_backward(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *dh,
                                 const fm_tensor *in, const fm_tensor *probs, fm_tensor *din_row, fm_tensor *din_col,
                                 fm_tensor *dprobs);

#ifdef __cplusplus
}
#endif
#endif
