/* flowmoe — the tensor descriptor. Descriptors own no memory. */
#ifndef FLOWMOE_TENSOR_H
#define FLOWMOE_TENSOR_H

#include "flowmoe/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A dense 2-D matrix [rows, cols] or a stack of experts [E, rows, cols].
 * `shape` is always the LOGICAL shape; `layout` says whether each matrix is
 * stored as is (row-wise) or transposed (column-wise).
 *
 * For E2M1 each stored row must hold an even number of elements: two codes
 * share a byte, element 2j in the low nibble. */
typedef struct fm_tensor {
    void *data;
    fm_dtype dtype;
    fm_device device;       /* where data and scale live */
    int ndim;               /* 2 or 3 */
    int64_t shape[3];       /* [rows, cols] or [E, rows, cols] */
    fm_layout layout;

    fm_scale_mode scale_mode;
    void *scale;            /* scale_inv: dequantized value = code * scale_inv */
    fm_dtype scale_dtype;   /* F32, or E8M0 for MX32 */
    fm_scale_layout scale_layout;

    /* Optional buffer sizes in bytes (0 = not given). When given, ops check
     * that the shape and scale mode fit in them before touching memory. */
    int64_t data_capacity;
    int64_t scale_capacity;
} fm_tensor;

/* Ragged groups (experts) along the rows of a tensor: group g owns rows
 * [sum(rows[0..g)), sum(rows[0..g])). `host` is needed by every CPU op and by
 * CUDA ops that must know the sizes when they launch; `device` (CUDA, same
 * values) lets kernels read them without a host synchronisation. Ops say which
 * they need. Group sizes may be 0 (an empty expert). */
typedef struct fm_splits {
    int64_t groups;          /* number of groups E (>= 1) */
    const int64_t *host;     /* [groups] rows per group in host memory, or NULL */
    const int64_t *device;   /* [groups] the same in device memory, or NULL */
} fm_splits;

/* Convenience constructors: fill a descriptor, nothing else. */
fm_tensor fm_tensor_2d(void *data, fm_dtype dtype, int64_t rows, int64_t cols);
fm_tensor fm_tensor_3d(void *data, fm_dtype dtype, int64_t experts, int64_t rows, int64_t cols);
/* A quantized 2-D tensor with its scale array; scale dtype follows the mode. */
fm_tensor fm_tensor_quant_2d(void *data, fm_dtype dtype, int64_t rows, int64_t cols,
                             fm_layout layout, fm_scale_mode mode, void *scale,
                             fm_scale_layout scale_layout);

/* The transposed view: a column-wise [r, c] tensor is, byte for byte, the
 * row-wise [c, r] tensor (and the other way round); scales are unchanged
 * because blocks always run along the stored dimension. */
fm_tensor fm_tensor_t(const fm_tensor *t);

/* Sizes. Each returns -1 when the descriptor's shape is not valid (negative,
 * overflowing, wrong ndim); they never touch the data. */
int64_t fm_tensor_numel(const fm_tensor *t);
int64_t fm_tensor_nbytes(const fm_tensor *t);       /* data bytes, E2M1 packed */
int64_t fm_tensor_scale_count(const fm_tensor *t);  /* scale entries incl. GEMM-layout padding */
int64_t fm_tensor_scale_nbytes(const fm_tensor *t);
int64_t fm_tensor_experts(const fm_tensor *t);      /* 1 for 2-D */
int64_t fm_tensor_stored_rows(const fm_tensor *t);  /* per matrix, after the layout */
int64_t fm_tensor_stored_cols(const fm_tensor *t);

/* Scale entries of a tensor in the GROUPED layout over `splits` (each group's
 * rows stored as its own matrix with its own scale array, one after another;
 * see fm_transpose_scaled_grouped). Needs splits->host; -1 when invalid. */
int64_t fm_tensor_grouped_scale_count(const fm_tensor *t, const fm_splits *splits);

/* Element size in bits (4 for E2M1), 0 for an unknown dtype. */
int fm_dtype_bits(fm_dtype dtype);
const char *fm_dtype_name(fm_dtype dtype);
const char *fm_scale_mode_name(fm_scale_mode mode);
const char *fm_scale_layout_name(fm_scale_layout layout);
const char *fm_layout_name(fm_layout layout);
const char *fm_status_name(fm_status status);
/* The scale dtype a mode requires (F32, or E8M0 for MX32). */
fm_dtype fm_scale_mode_dtype(fm_scale_mode mode);
/* Block extent along the stored rows and columns (1x128 -> 1, 128). */
int fm_scale_mode_block_rows(fm_scale_mode mode);
int fm_scale_mode_block_cols(fm_scale_mode mode);

#ifdef __cplusplus
}
#endif
#endif
