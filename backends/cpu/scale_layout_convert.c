/* CPU scale layout conversion (compact <-> GEMM-ready). */
#include <string.h>

#include "cpu.h"

fm_status fm_cpu_scale_layout_convert(fm_context *ctx, const fm_tensor *src, fm_tensor *dst)
{
    (void)ctx;
    fm_scale_mode m = src->scale_mode;
    int64_t E = fm_tensor_experts(src), R = fm_tensor_stored_rows(src), C = fm_tensor_stored_cols(src);
    int64_t sper = fm_scale_count_2d(m, src->scale_layout, R, C);
    int64_t dper = fm_scale_count_2d(m, dst->scale_layout, R, C);
    int64_t br = m == FM_SCALE_BLOCK_128x128 ? 128 : m == FM_SCALE_TENSOR ? (R ? R : 1) : 1;
    int64_t bc = fm_mode_block_cols(m);
    if (bc == 0)
        bc = C ? C : 1;
    int64_t nbr = m == FM_SCALE_TENSOR ? 1 : fm_cdiv(R, br);
    int64_t nbc = (m == FM_SCALE_TENSOR || m == FM_SCALE_ROW) ? 1 : fm_cdiv(C, bc);
    int e8 = src->scale_dtype == FM_DTYPE_E8M0;
    /* An empty tensor may have no scale array at all (NULL): not even a zero
     * offset may be applied to it. */
    if (sper == 0 || dper == 0)
        return FM_OK;
    for (int64_t e = 0; e < E; e++) {
        if (e8) {
            const uint8_t *s = (const uint8_t *)src->scale + e * sper;
            uint8_t *d = (uint8_t *)dst->scale + e * dper;
            memset(d, 127, (size_t)dper);
            for (int64_t rb = 0; rb < nbr; rb++)
                for (int64_t cb = 0; cb < nbc; cb++)
                    d[fm_scale_offset(m, dst->scale_layout, R, C, rb * br, cb * bc)] =
                        s[fm_scale_offset(m, src->scale_layout, R, C, rb * br, cb * bc)];
        } else {
            const float *s = (const float *)src->scale + e * sper;
            float *d = (float *)dst->scale + e * dper;
            for (int64_t k = 0; k < dper; k++)
                d[k] = 1.0f;
            for (int64_t rb = 0; rb < nbr; rb++)
                for (int64_t cb = 0; cb < nbc; cb++)
                    d[fm_scale_offset(m, dst->scale_layout, R, C, rb * br, cb * bc)] =
                        s[fm_scale_offset(m, src->scale_layout, R, C, rb * br, cb * bc)];
        }
    }
    return FM_OK;
}
