/* flowmoe — GEMMs for training: dense and grouped (experts).
 *
 * Every product here is D = A · Bᵀ on the LOGICAL matrices: A is [M, K],
 * B is [N, K], D is [M, N] (nn.Linear's form: Y = X · Wᵀ). For the transposed
 * products of a backward pass, pass the other copy through fm_tensor_t() or
 * use the fm_linear_* entry points, which name the copy each operand needs.
 *
 * Operands:
 *   - FP8 (E4M3 or E5M2; E5M2 x E5M2 is refused as cuBLASLt refuses it), both
 *     with K contiguous, i.e. stored row-wise: Hopper's FP8 tensor cores (and
 *     cuBLASLt on sm_90) take FP8 only in this "TN" form. An FP8 operand stored
 *     the other way is an error that says which copy is needed, never a silent
 *     transpose. Scale pairs (A x B):
 *       TENSOR x TENSOR, ROW x ROW (per-row of A times per-row of B),
 *       BLOCK_1x128 x BLOCK_128x128 (DeepSeek: activations x weights),
 *       BLOCK_1x128 x BLOCK_1x128 (both 1x128 along K: the weight gradient;
 *       the k-grouped form also takes x BLOCK_128x128),
 *       BLOCK_128x128 x BLOCK_128x128 (CPU only: cuBLASLt has no such mode,
 *       the CUDA backend answers FM_ERR_UNSUPPORTED).
 *     Scales in either layout (COMPACT or GEMM).
 *     The CUDA backend (cuBLASLt) needs FP8 K to be a multiple of 16 (for the
 *     k-grouped form: every M_i); otherwise FM_ERR_UNSUPPORTED.
 *   - BF16 x BF16 (the bf16 recipe) or F32 x F32, any storage layout. On
 *     CUDA an F32 product with M or N at most 16 whose large operand streams
 *     in rows (N small: A and B with K contiguous; M small: B with N
 *     contiguous; the router's GEMMs) runs a memory-bound kernel of its own
 *     that sums in a fixed order; cfg->impl LIBRARY keeps it on cuBLASLt.
 * Output D: BF16 or F32, row-wise, unscaled. With cfg->accumulate, D must be
 * F32 and the product is added to it (beta = 1: main-grad accumulation).
 *
 * Reference rule (DESIGN.md): D = Σ_kb (sa·sb) · Σ_{k in kb} a·b with K blocks
 * of 128 (the whole K for TENSOR/ROW and unscaled operands), a and b the
 * decoded codes. The CPU backend sums in double and rounds once (RNE) to the
 * output dtype (after adding the old D when accumulating). The CUDA backend
 * matches within relative Frobenius error 5e-3 (BF16 out) / 5e-4 (F32 out).
 * NaN in an operand (a NaN code or a NaN scale) reaches every output it
 * touches.
 * Range: the CUDA backend (cuBLASLt) forms the product of an A and a B block
 * scale in F32. Where that product overflows F32 (scales of about 2^64 each,
 * i.e. block amaxes near 1e21 in E4M3; a model that has diverged), the
 * outputs it reaches are NaN (0 x Inf) or +-Inf on CUDA while the CPU's
 * double rule may give finite values: such operands are outside the
 * tolerance contract, and CUDA never returns a wrong finite number for them
 * (test_cuda_nonfinite_policy_every_op saw whole TENSOR-scaled outputs turn
 * NaN). Inside that range, an F32 accumulation that overflows gives the
 * +-Inf the double rule gives. */
#ifndef FLOWMOE_GEMM_H
#define FLOWMOE_GEMM_H

#include "flowmoe/context.h"
#include "flowmoe/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which CUDA implementation runs an FP8 product (the CPU backend has one and
 * ignores this):
 *   AUTO     (the default) the faster of the two where both apply, as
 *            measured on H100: the native kernel for m-grouped products whose
 *            experts average at most 256 rows (many small experts: one
 *            launch instead of one call per expert, 1.8x at 64 experts of
 *            256 rows) or that come with device split sizes only; cuBLASLt
 *            for dense products and larger experts (native 0.93-1.01x
 *            there), and for the k-grouped weight gradient (native 0.97x
 *            on the layer's shapes, and the layer step 1-3% slower with it);
 *   LIBRARY  cuBLASLt always (per-expert calls for the grouped forms);
 *   NATIVE   the native sm_90a kernel (grouped_gemm_sm90.cu: TMA, wgmma and
 *            in-kernel block-scale promotion, one persistent launch for all
 *            experts, split sizes read on the device), or FM_ERR_UNSUPPORTED
 *            saying why it does not apply. It applies to fm_gemm,
 *            fm_linear_forward/dgrad and fm_grouped_gemm on a compute
 *            capability 9.0 GPU with FP8 operands scaled TENSOR x TENSOR or
 *            BLOCK_1x128 x BLOCK_128x128, both K contiguous, K a multiple of
 *            16, 16-byte aligned data, BF16 or F32 out, at most 1024 experts
 *            (64 when only host split sizes are given); and to
 *            fm_grouped_gemm_wgrad with FP8 dy BLOCK_1x128 x x BLOCK_128x128
 *            (the ROWMAX copy), every M_i a multiple of 16, dW's rows whole
 *            16-byte pieces (K a multiple of 4 for F32, 8 for BF16), 16-byte
 *            aligned data and scales, any number of experts.
 *            Its accumulate (D += ...) adds in the L2 (red.add.f32), which
 *            flushes F32 subnormal inputs and sums to zero: inside the
 *            tolerance, and the same bits run to run. */
typedef enum fm_gemm_impl {
    FM_GEMM_IMPL_AUTO = 0,
    FM_GEMM_IMPL_LIBRARY,
    FM_GEMM_IMPL_NATIVE,
    FM_GEMM_IMPL_COUNT
} fm_gemm_impl;

typedef struct fm_gemm_config {
    int accumulate;   /* D += A·Bᵀ (D F32) instead of D = A·Bᵀ */
    fm_gemm_impl impl;
} fm_gemm_config;

/* Dense: A [M, K], B [N, K], D [M, N]. */
fm_status fm_gemm(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *a, const fm_tensor *b,
                  fm_tensor *d);

/* The three GEMMs of a linear layer Y = X · Wᵀ with X [T, in], W [out, in],
 * Y [T, out]. Each takes the tensors under their natural logical shapes and
 * checks it was given the copy it needs (for FP8: the one with K contiguous):
 *   forward   Y  = X · Wᵀ    x row-wise,  w row-wise   (K = in)
 *   dgrad     dX = dY · W    dy row-wise, w column-wise (K = out)
 *   wgrad     dW = dYᵀ · X   dy column-wise, x column-wise (K = T); usually
 *             with cfg->accumulate into the F32 main-grad. */
fm_status fm_linear_forward(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *x, const fm_tensor *w,
                            fm_tensor *y);
fm_status fm_linear_dgrad(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *dy, const fm_tensor *w,
                          fm_tensor *dx);
fm_status fm_linear_wgrad(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *dy, const fm_tensor *x,
                          fm_tensor *dw);

/* m-grouped (expert forward and data-gradient): A [ΣM_i, K] row-wise with
 * the experts' rows contiguous in split order, B [E, N, K] (one matrix per
 * expert), D [ΣM_i, N]: D_i = A_i · B_iᵀ. `splits` gives M_i; Σ M_i must
 * equal A's rows. Host sizes are required by the CPU backend and by the
 * cuBLASLt path; on CUDA, splits->host may be NULL when splits->device is
 * given and the native kernel applies (no device-to-host copy: sizes that do
 * not add up are clamped on the device, never written past d, and reported
 * by the next fm_context_synchronize with the sentence a host check gives,
 * naming splits->device; a product with no rows, columns or K launches
 * nothing and reads no sizes). Empty
 * experts write nothing. A's scales are per row (ROW, BLOCK_1x128) or one for
 * all rows (TENSOR); B's TENSOR scale is one per expert. No padding rule: M_i may be any size >= 0, because every A scale
 * mode here is per row. */
fm_status fm_grouped_gemm(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *splits,
                          const fm_tensor *a, const fm_tensor *b, fm_tensor *d);

/* k-grouped (expert weight gradient): dW_i = dY_iᵀ · X_i over ragged M_i.
 * dy is [ΣM_i, N] and x is [ΣM_i, K], both in the GROUPED column-wise layout
 * (see fm_transpose_scaled_grouped): expert i's slice is stored as its own
 * column-wise matrix ([N, M_i] row-major for dy) with its own scale array in
 * the tensor's scale layout, and the experts' matrices and scale arrays follow
 * each other in split order. So 1x128 blocks run along M and restart at every
 * expert: M_i need not be a multiple of 128. FP8 dy BLOCK_1x128 x x
 * BLOCK_1x128 or BLOCK_128x128 (one scale per 128 x 128 tile of each expert's
 * X_iᵀ, as the ROWMAX transpose writes it; cuBLASLt runs that pair about 1.2x
 * faster on H100), or BF16/F32 unscaled. dw is [E, N, K], F32 (usually with cfg->accumulate)
 * or BF16. An empty expert's dW_i is 0 (unchanged when accumulating). */
fm_status fm_grouped_gemm_wgrad(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *splits,
                                const fm_tensor *dy, const fm_tensor *x, fm_tensor *dw);

#ifdef __cplusplus
}
#endif
#endif
