/* The README's example: a BF16 tensor to FP8 (E4M3, 1x128 blocks, power-of-two
 * scales) row-wise and column-wise in one call, and back to F32.
 * The part between the README markers is copied verbatim into README.md. */
/* README: begin */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "flowmoe/flowmoe.h"

int main(void)
{
    enum { M = 256, K = 512 };
    uint16_t *x = malloc(M * K * sizeof *x);               /* BF16 input [M, K] */
    uint8_t *row = malloc(M * K), *col = malloc(M * K);    /* E4M3 codes */
    float *row_s = malloc(M * (K / 128) * sizeof(float));  /* one scale per 1x128 block */
    float *col_s = malloc(K * (M / 128) * sizeof(float));  /* column-wise: 128x1 blocks */
    float *y = malloc(M * K * sizeof *y);
    for (int i = 0; i < M * K; i++)
        x[i] = fm_bf16_from_f32(sinf(0.01f * (float)i) * (float)(1 + i % 7));

    fm_context *ctx;
    if (fm_context_create(&(fm_context_config){.backend = FM_BACKEND_CPU}, &ctx) != FM_OK) {
        fprintf(stderr, "%s\n", fm_last_error(NULL));
        return 1;
    }
    fm_tensor in = fm_tensor_2d(x, FM_DTYPE_BF16, M, K);
    fm_tensor q_row = fm_tensor_quant_2d(row, FM_DTYPE_E4M3, M, K, FM_LAYOUT_ROWWISE,
                                         FM_SCALE_BLOCK_1x128, row_s, FM_SCALE_LAYOUT_COMPACT);
    fm_tensor q_col = fm_tensor_quant_2d(col, FM_DTYPE_E4M3, M, K, FM_LAYOUT_COLWISE,
                                         FM_SCALE_BLOCK_1x128, col_s, FM_SCALE_LAYOUT_COMPACT);
    fm_tensor out = fm_tensor_2d(y, FM_DTYPE_F32, M, K);

    /* One pass writes both copies: row-wise for the forward GEMM, column-wise
     * (stored transposed) for the weight-gradient GEMM. */
    if (fm_quantize(ctx, &(fm_quant_config){0}, &in, &q_row, &q_col) != FM_OK ||
        fm_dequantize(ctx, &q_col, &out) != FM_OK) {                 /* back to [M, K] F32 */
        fprintf(stderr, "flowmoe: %s\n", fm_last_error(ctx));
        return 1;
    }
    double worst = 0;
    for (int i = 0; i < M * K; i++) {
        double xi = fm_bf16_to_f32(x[i]), err = fabs(y[i] - xi) / fmax(fabs(xi), 1e-3);
        worst = err > worst ? err : worst;
    }
    printf("E4M3 1x128: %d x %d, scale[0] = %g, worst relative error %.4f\n", M, K, row_s[0], worst);
    fm_context_destroy(ctx);
    free(x), free(row), free(col), free(row_s), free(col_s), free(y);
    return worst < 0.07 ? 0 : 1; /* E4M3 keeps 3 mantissa bits: |error| <= 2^-4 relative */
}
/* README: end */
