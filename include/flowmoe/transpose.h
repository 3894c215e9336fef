/* flowmoe — scaling-aware transposes and direct FP8 <-> MXFP4 conversions.
 *
 * Both ops re-encode block-scaled codes into another block structure using
 * only the codes and the power-of-two scale exponents: no trip through a
 * higher precision, no second rounding. With the TIGHT rule the result is, bit
 * for bit, what fm_quantize (POW2 rule) gives when fed the dequantized input:
 * each output block's exponent is the power-of-two rule applied to the true
 * amax of the block, computed as max(P(|code|) + p_in) over its elements, and
 * each output code is the correctly rounded (RNE, subnormals included,
 * satfinite) encoding of code * 2^(p_in - p_out), an exact exponent shift. */
#ifndef FLOWMOE_TRANSPOSE_H
#define FLOWMOE_TRANSPOSE_H

#include "flowmoe/context.h"
#include "flowmoe/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fm_requant_rule {
    FM_REQUANT_TIGHT = 0, /* power-of-two rule on each output block's true amax (default) */
    FM_REQUANT_ROWMAX,    /* max of the input block exponents the output block covers (the FP8-Flow
                             paper's rule); transposes with the same dtype and mode only */
    FM_REQUANT_MX_FLOOR,  /* OCP v1.0 floor rule on the true amax; MX32 outputs only (may saturate) */
    FM_REQUANT_RULE_COUNT
} fm_requant_rule;

typedef struct fm_requant_config {
    fm_requant_rule rule;
    /* Optional, in the tensors' memory: output blocks that are non-finite
     * (an input NaN/Inf code or NaN scale reached them). */
    int64_t *nonfinite_blocks;
    /* Nonzero: the caller vouches that every F32 input scale is a power of
     * two (or NaN), as flowmoe's quantizers with a POW2 rule and its fused
     * FP8 ops write them. The CUDA backend then skips its check of the
     * scales (a small kernel before the op's own). A scale that breaks the
     * promise is read as 1 there; the CPU backend checks regardless and
     * refuses it. */
    int trusted_pow2_scales;
} fm_requant_config;

/* Scaling-aware transpose: `in` row-wise (or column-wise) quantized with
 * power-of-two scales (BLOCK_1x128 with F32 powers of two, or MX32), `out` the
 * other layout of the same logical tensor, element dtype E4M3, E5M2 or E2M1
 * (E2M1 with MX32), mode BLOCK_1x128 or MX32. FP8 1x128 -> 128x1, MXFP8 1x32 ->
 * 32x1, MXFP4 row-wise -> column-wise, and FP8 row-wise -> MXFP4 column-wise
 * in one pass. A block holding NaN stays NaN (NaN scale, NaN codes).
 * BLOCK_128x128 -> BLOCK_128x128 of the same dtype is the exact transpose of
 * codes and scale grid (any F32 scales).
 * FP8 BLOCK_1x128 -> BLOCK_128x128 of the same dtype, rule ROWMAX only: the
 * ROWMAX transpose gives every 128 x 1 block of a 128 x 128 tile the same
 * exponent (the largest row exponent of the tile), so its codes are exactly
 * the 128 x 1 output's and the tile's one scale is that exponent. A tile with
 * any non-finite block is non-finite as a whole (NaN scale, NaN codes) and
 * counts once in nonfinite_blocks. This is the operand the k-grouped weight
 * gradient takes as x for cuBLASLt's faster 1x128 x 128x128 product.
 * An input F32 scale that is not a power of two (or is 0, negative or Inf) is
 * rejected with FM_ERR_INVALID_ARG, and nothing is written. The CPU backend
 * returns that at once. The CUDA backend checks the scales on the device
 * and never waits for it: the call returns FM_OK, its kernels write
 * nothing, and the next fm_context_synchronize returns FM_ERR_INVALID_ARG
 * with the same sentence (the first such finding since the last
 * synchronize). The same holds for every op of this header. */
fm_status fm_transpose_scaled(fm_context *ctx, const fm_requant_config *cfg, const fm_tensor *in, fm_tensor *out);

/* Direct conversion in the same layout: FP8 (BLOCK_1x128 or MX32, power-of-two
 * scales) -> MXFP4, MXFP4 -> FP8 (BLOCK_1x128 or MX32), or between the FP8
 * formats. MXFP4 -> FP8 is exact wherever the FP8 block range holds the
 * values, correctly rounded where it does not. */
fm_status fm_convert_scaled(fm_context *ctx, const fm_requant_config *cfg, const fm_tensor *in, fm_tensor *out);

/* Per-expert scaling-aware transpose, for the k-grouped weight-gradient
 * GEMM: `in` is [ΣM_i, N] row-wise (the experts' rows contiguous in split
 * order; same input rules as fm_transpose_scaled); `out` is [ΣM_i, N] in the
 * GROUPED column-wise layout: expert i's rows become their own column-wise
 * matrix [N, M_i] (row-major), with their own scale array in out's scale
 * layout, placed after expert i-1's (data at element offset N·Σ_{j<i} M_j,
 * scales at the sum of the earlier experts' scale counts). Column blocks
 * (128x1 or 32x1) therefore never straddle two experts, M_i need not be a
 * multiple of the block, and an empty expert takes no space. Each expert's
 * result equals fm_transpose_scaled on its slice alone, nonfinite_blocks
 * counts over all groups, and F32 input scales are checked as there. With
 * an E2M1 `out` every M_i must be even (a group's stored rows are whole
 * bytes); a BLOCK_128x128 input has no grouped form. Needs splits->host, which also
 * sizes the CUDA launch; splits->device is not read (the CUDA backend hands
 * the per-group offsets to its kernel without waiting for the device).
 * BLOCK_1x128 -> BLOCK_128x128 (ROWMAX) is grouped the same way: each group's
 * tiles start at its first row. */
fm_status fm_transpose_scaled_grouped(fm_context *ctx, const fm_requant_config *cfg, const fm_splits *splits,
                                      const fm_tensor *in, fm_tensor *out);

/* fm_transpose_scaled_grouped of the rows fm_moe_permute would make, read
 * straight from the tokens' rows: `in` is [T, N] row-wise FP8 (E4M3/E5M2,
 * BLOCK_1x128 or MX32, COMPACT scales); row_map [R, 1] I32 (R = Σ splits,
 * fm_moe_permute's row_map) names row r's source slot t·topk + j, so row r
 * is in's row t, and an entry outside [0, T·topk) (-1: padding) is a row
 * of zero codes with scale 1, as the permute pads. out is [R, N] as for
 * fm_transpose_scaled_grouped, and bit for bit what
 * fm_transpose_scaled_grouped(cfg, splits, permute(in)) gives, without
 * the permuted copy in memory (so a layer can keep x as T rows instead of
 * R = T·topk + padding for its weight gradient). Every F32 scale of `in`
 * is checked, used or not, unless cfg->trusted_pow2_scales. CUDA needs N
 * a multiple of 16 (FM_ERR_UNSUPPORTED otherwise). */
fm_status fm_transpose_scaled_grouped_rows(fm_context *ctx, const fm_requant_config *cfg, const fm_splits *splits,
                                           const fm_tensor *in, const fm_tensor *row_map, int topk, fm_tensor *out);

#ifdef __cplusplus
}
#endif
#endif
