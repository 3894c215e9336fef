/* flowmoe — dtypes, scaling modes, layouts, status codes.
 *
 * Every enum's zero value is the sensible default, so that zero-initialised
 * config structs and descriptors read well at the call site. */
#ifndef FLOWMOE_TYPES_H
#define FLOWMOE_TYPES_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fm_status {
    FM_OK = 0,
    FM_ERR_INVALID_ARG = 1,   /* a descriptor or argument broke a rule; fm_last_error says which */
    FM_ERR_UNSUPPORTED = 2,   /* valid, but this backend does not implement it */
    FM_ERR_OUT_OF_MEMORY = 3,
    FM_ERR_BACKEND = 4,       /* the device runtime (CUDA, cuBLASLt, NCCL) reported an error */
    FM_ERR_NO_DEVICE = 5      /* a CUDA backend was asked for but no usable device exists */
} fm_status;

typedef enum fm_dtype {
    FM_DTYPE_F32 = 0,
    FM_DTYPE_BF16,
    FM_DTYPE_F16,
    FM_DTYPE_E4M3,   /* FN: max 448, no Inf, NaN = S.1111.111 */
    FM_DTYPE_E5M2,   /* IEEE-like, max 57344 */
    FM_DTYPE_E2M1,   /* packed two per byte, element 2j in the low nibble */
    FM_DTYPE_E8M0,   /* power-of-two scale, bias 127, 0xFF = NaN */
    FM_DTYPE_I32,
    FM_DTYPE_I64,
    FM_DTYPE_COUNT
} fm_dtype;

typedef enum fm_scale_mode {
    FM_SCALE_NONE = 0,       /* unscaled data (F32/BF16/F16 inputs, outputs) */
    FM_SCALE_TENSOR,         /* one F32 scale_inv per matrix (per expert for 3-D) */
    FM_SCALE_ROW,            /* one F32 scale_inv per stored row */
    FM_SCALE_BLOCK_1x128,    /* one F32 per 1 x 128 block along the stored (contiguous) dim */
    FM_SCALE_BLOCK_128x128,  /* one F32 per 128 x 128 block */
    FM_SCALE_MX32,           /* one E8M0 per 1 x 32 block along the stored dim (OCP MX v1.0) */
    FM_SCALE_NV16,           /* reserved: one E4M3 per 1 x 16 + one F32 per tensor (not implemented) */
    FM_SCALE_MODE_COUNT
} fm_scale_mode;

/* Where the scale array's entries live (see fm_scale_offset in format.h). */
typedef enum fm_scale_layout {
    FM_SCALE_LAYOUT_COMPACT = 0, /* row-major [stored_rows, ceil(stored_cols / block)] */
    FM_SCALE_LAYOUT_GEMM,        /* what the GEMM consumes (cuBLASLt VEC128 / BLK128x128 / MX swizzle) */
    FM_SCALE_LAYOUT_COUNT
} fm_scale_layout;

/* Row-wise data is stored as the logical [rows, cols] matrix, row-major.
 * Column-wise data is the same logical matrix stored transposed, [cols, rows]
 * row-major: the copy the backward GEMMs consume. Scale blocks always run
 * along the stored contiguous dimension, so a column-wise BLOCK_1x128 tensor
 * has 128 x 1 blocks of the logical matrix. */
typedef enum fm_layout {
    FM_LAYOUT_ROWWISE = 0,
    FM_LAYOUT_COLWISE,
    FM_LAYOUT_COUNT
} fm_layout;

typedef enum fm_device {
    FM_DEVICE_HOST = 0,
    FM_DEVICE_CUDA,
    FM_DEVICE_COUNT
} fm_device;

/* How a quantizer picks each block's scale_inv. */
typedef enum fm_scale_rule {
    FM_SCALE_RULE_DEFAULT = 0, /* POW2 for BLOCK_* and MX32, EXACT for TENSOR and ROW */
    FM_SCALE_RULE_POW2,        /* smallest power of two with amax / s <= max_elem: nothing saturates */
    FM_SCALE_RULE_EXACT,       /* s = 1 / (max_elem / amax), any F32 (not for MX32) */
    FM_SCALE_RULE_MX_FLOOR,    /* OCP v1.0: 2^(floor(log2 amax) - emax_elem), elements saturate */
    FM_SCALE_RULE_COUNT
} fm_scale_rule;

#ifdef __cplusplus
}
#endif
#endif
