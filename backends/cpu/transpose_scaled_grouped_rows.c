/* CPU fm_transpose_scaled_grouped_rows: by its definition, the grouped
 * transpose of the rows fm_moe_permute would make (padding: zero codes,
 * scale 1), built here in host memory. The reference needs no speed; the
 * CUDA kernel reads the token rows in place. */
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "flowmoe/format.h"

fm_status fm_cpu_requantize_grouped_rows(fm_context *ctx, const fm_requant_config *cfg, const fm_splits *splits,
                                         const fm_tensor *in, const fm_tensor *row_map, int topk, fm_tensor *out)
{
    const int64_t T = in->shape[0], N = in->shape[1], R = out->shape[0];
    const int64_t nb = fm_cdiv(N, in->scale_mode == FM_SCALE_MX32 ? 32 : 128);
    const int e8 = in->scale_dtype == FM_DTYPE_E8M0;
    const size_t sb = e8 ? 1 : 4;
    /* Every F32 scale of in, used or not (what the CUDA check reads too). */
    if (!cfg->trusted_pow2_scales && !e8)
        for (int64_t i = 0; i < T * nb; i++) {
            int p;
            const float s = ((const float *)in->scale)[i];
            if (!fm_f32_pow2_exp(s, &p))
                return fm_error(ctx, FM_ERR_INVALID_ARG,
                                "in->scale: the scale of row %lld, block %lld is %g, not a positive power of two; "
                                "scaling-aware ops need POW2 scales",
                                (long long)(i / nb), (long long)(i % nb), (double)s);
        }
    fm_requant_config c = *cfg;
    c.trusted_pow2_scales = 1;
    fm_tensor rows = *in;
    rows.shape[0] = R;
    if (R == 0 || N == 0) {
        rows.data = rows.scale = NULL;
        return fm_cpu_requantize_grouped(ctx, &c, splits, &rows, out);
    }
    uint8_t *codes = malloc((size_t)(R * N)), *scales = malloc((size_t)(R * nb) * sb);
    if (!codes || !scales) {
        free(codes);
        free(scales);
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_transpose_scaled_grouped_rows: out of host memory for %lld rows",
                        (long long)R);
    }
    const int32_t *rm = (const int32_t *)row_map->data;
    const float one = 1.0f;
    for (int64_t r = 0; r < R; r++) {
        const int64_t s = rm[r];
        uint8_t *cr = codes + r * N, *sr = scales + (size_t)(r * nb) * sb;
        if (s >= 0 && s < T * topk) {
            const int64_t t = s / topk;
            memcpy(cr, (const uint8_t *)in->data + t * N, (size_t)N);
            memcpy(sr, (const uint8_t *)in->scale + (size_t)(t * nb) * sb, (size_t)nb * sb);
            continue;
        }
        memset(cr, 0, (size_t)N);
        for (int64_t b = 0; b < nb; b++)
            if (e8)
                sr[b] = 127;
            else
                memcpy(sr + 4 * b, &one, 4);
    }
    rows.data = codes;
    rows.scale = scales;
    fm_status st = fm_cpu_requantize_grouped(ctx, &c, splits, &rows, out);
    free(codes);
    free(scales);
    return st;
}
