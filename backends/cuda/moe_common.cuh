/* Device helpers of the MoE kernels: element loads and stores with exactly
 * the CPU backend's rules (cpu.h's fm_cpu_load_f32 / fm_cpu_store_f32), the
 * exact decode of row-wise quantized rows, and the warp form of mathfn.h's
 * fixed reduction order. */
#ifndef FLOWMOE_CUDA_MOE_COMMON_CUH
#define FLOWMOE_CUDA_MOE_COMMON_CUH

#include "flowmoe/mathfn.h"
#include "kernels.cuh"

FM_DI float fm_moe_load(const void *p, int dt, int64_t i)
{
    if (dt == FM_DTYPE_BF16)
        return fm_bf16_to_f32(((const uint16_t *)p)[i]);
    if (dt == FM_DTYPE_F16)
        return fm_f16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

FM_DI void fm_moe_store(void *p, int dt, int64_t i, float v)
{
    if (dt == FM_DTYPE_BF16)
        ((uint16_t *)p)[i] = fm_bf16_from_f32(v);
    else if (dt == FM_DTYPE_F16)
        ((uint16_t *)p)[i] = fm_f16_from_f32(v);
    else
        ((float *)p)[i] = fm_f32_canon(v);
}

/* A row-wise tensor as the kernels read it: unscaled, or codes with compact
 * BLOCK_1x128 / MX32 scales. */
typedef struct fm_moe_rows {
    const void *data;
    const void *scale;
    int dtype, e8;
    int64_t cols, bc, nb; /* block columns and blocks per row (quantized) */
} fm_moe_rows;

static inline fm_moe_rows fm_moe_rows_of(const fm_tensor *t)
{
    fm_moe_rows r;
    r.data = t->data;
    r.scale = t->scale;
    r.dtype = (int)t->dtype;
    r.e8 = t->scale_dtype == FM_DTYPE_E8M0;
    r.cols = t->shape[1];
    r.bc = t->scale_mode == FM_SCALE_NONE ? 0 : fm_mode_block_cols(t->scale_mode);
    r.nb = r.bc ? fm_cdiv(r.cols, r.bc) : 0;
    return r;
}

/* Element (r, c) as exact F32: code x scale_inv, as backends/cpu/moe_swiglu.c. */
FM_DI float fm_moe_rows_get(const fm_moe_rows &t, int64_t r, int64_t c)
{
    if (!t.bc)
        return fm_moe_load(t.data, t.dtype, r * t.cols + c);
    int64_t b = r * t.nb + c / t.bc;
    float s = t.e8 ? fm_e8m0_to_f32(((const uint8_t *)t.scale)[b]) : ((const float *)t.scale)[b];
    uint8_t code;
    if (t.dtype == FM_DTYPE_E2M1) {
        uint8_t by = ((const uint8_t *)t.data)[(r * t.cols + c) >> 1];
        code = (c & 1) ? (uint8_t)(by >> 4) : (uint8_t)(by & 0xFu);
    } else {
        code = ((const uint8_t *)t.data)[r * t.cols + c];
    }
    return fm_elem_decode((fm_dtype)t.dtype, code) * s;
}

/* Lane l's partial sum p_l, reduced by the tree of fm_dot_tree_f32; every
 * lane of the warp must call it; lane 0 gets the result. */
FM_DI float fm_warp_tree(float v)
{
    for (int off = FM_DOT_LANES / 2; off > 0; off >>= 1)
        v = v + __shfl_down_sync(0xFFFFFFFFu, v, off);
    return fm_f32_canon(v);
}

#endif
