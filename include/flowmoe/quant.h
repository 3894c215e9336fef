/* flowmoe — quantize, dequantize, scale layout conversion. */
#ifndef FLOWMOE_QUANT_H
#define FLOWMOE_QUANT_H

#include "flowmoe/context.h"
#include "flowmoe/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fm_quant_config {
    fm_scale_rule rule;   /* DEFAULT: POW2 for BLOCK_* and MX32, EXACT for TENSOR and ROW */
    float epsilon;        /* amax is floored to epsilon before the scale is chosen (0 = off) */
    /* Optional outputs, in the memory of the input tensor (device memory on
     * CUDA, so no host synchronisation is needed): */
    float *amax;                /* max |x| over the whole input; NaN if any NaN, else Inf if any Inf */
    int64_t *nonfinite_blocks;  /* number of scale blocks that held NaN or Inf, over all outputs */
} fm_quant_config;

/* Quantize `in` (F32, BF16 or F16, row-wise, unscaled) into a row-wise and/or a
 * column-wise output in one pass; either output may be NULL, not both. Each
 * output's descriptor chooses its element dtype (E4M3, E5M2, or E2M1 with
 * MX32), scale mode and scale layout; its shape is the input's logical shape.
 *
 * A block holding NaN or Inf gets a NaN scale (F32 NaN, E8M0 0xFF) and every
 * code of the block is the element format's NaN (E4M3 0x7F, E5M2 0x7E; E2M1
 * has none: 0), so the block dequantizes to NaN. The call still succeeds. */
fm_status fm_quantize(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *in,
                      fm_tensor *out_rowwise, fm_tensor *out_colwise);

/* Dequantize a quantized tensor into F32, BF16 or F16: value = code * scale_inv
 * in F32, then rounded to the output dtype (RNE). The output may use either
 * layout: a column-wise input dequantized into a row-wise output is transposed
 * on the way. */
fm_status fm_dequantize(fm_context *ctx, const fm_tensor *in, fm_tensor *out);

/* Copy the scale array of `src` into `dst` in dst's scale layout (compact <->
 * GEMM-ready). Both describe the same tensor (dtype, shape, layout, mode); only
 * the scale arrays are touched. Padding entries of the GEMM layout are set to
 * 1.0 (E8M0 127). */
fm_status fm_scale_layout_convert(fm_context *ctx, const fm_tensor *src, fm_tensor *dst);

/* fm_quantize over ragged groups of rows (experts), for operands of the
 * k-grouped weight-gradient GEMM: `in` is [ΣM_i, C] row-wise with the groups'
 * rows contiguous in split order (needs splits->host). The row-wise output is
 * laid out as fm_quantize would write it for the whole tensor; the
 * column-wise output is in the GROUPED layout of fm_transpose_scaled_grouped
 * (group i's rows quantized as their own column-wise matrix [C, M_i], blocks
 * restarting at every group). One explicit cast, whatever the group count. */
fm_status fm_quantize_grouped(fm_context *ctx, const fm_quant_config *cfg, const fm_splits *splits,
                              const fm_tensor *in, fm_tensor *out_rowwise, fm_tensor *out_colwise);

/* Unscaled conversion between F32, BF16 and F16 (same shape, any layouts,
 * RNE, NaN kept): no block scales involved, so not counted as an FP8 cast. */
fm_status fm_cast(fm_context *ctx, const fm_tensor *in, fm_tensor *out);

#ifdef __cplusplus
}
#endif
#endif
