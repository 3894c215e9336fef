/* Descriptor helpers: constructors, sizes, names. */
#include "internal.h"

fm_tensor fm_tensor_2d(void *data, fm_dtype dtype, int64_t rows, int64_t cols)
{
    fm_tensor t = {0};
    t.data = data;
    t.dtype = dtype;
    t.ndim = 2;
    t.shape[0] = rows;
    t.shape[1] = cols;
    return t;
}

fm_tensor fm_tensor_3d(void *data, fm_dtype dtype, int64_t experts, int64_t rows, int64_t cols)
{
    fm_tensor t = {0};
    t.data = data;
    t.dtype = dtype;
    t.ndim = 3;
    t.shape[0] = experts;
    t.shape[1] = rows;
    t.shape[2] = cols;
    return t;
}

fm_tensor fm_tensor_quant_2d(void *data, fm_dtype dtype, int64_t rows, int64_t cols, fm_layout layout,
                             fm_scale_mode mode, void *scale, fm_scale_layout scale_layout)
{
    fm_tensor t = fm_tensor_2d(data, dtype, rows, cols);
    t.layout = layout;
    t.scale_mode = mode;
    t.scale = scale;
    t.scale_dtype = fm_scale_mode_dtype(mode);
    t.scale_layout = scale_layout;
    return t;
}

fm_tensor fm_tensor_t(const fm_tensor *t)
{
    fm_tensor v = *t;
    int r = t->ndim == 3 ? 1 : 0;
    v.shape[r] = t->shape[r + 1];
    v.shape[r + 1] = t->shape[r];
    v.layout = t->layout == FM_LAYOUT_ROWWISE ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE;
    return v;
}

#define FM_MAX_DIM ((int64_t)INT32_MAX)
#define FM_MAX_NUMEL ((int64_t)1 << 56)

int fm_tensor_shape_ok(const fm_tensor *t, const char **why)
{
    if (t->ndim != 2 && t->ndim != 3) {
        *why = "ndim must be 2 ([rows, cols]) or 3 ([experts, rows, cols])";
        return 0;
    }
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0) {
            *why = "a dimension is negative";
            return 0;
        }
        if (t->shape[i] > FM_MAX_DIM) {
            *why = "a dimension exceeds 2^31 - 1";
            return 0;
        }
        if (t->shape[i] && n > FM_MAX_NUMEL / t->shape[i]) {
            *why = "the element count exceeds 2^56";
            return 0;
        }
        n *= t->shape[i];
    }
    return 1;
}

int64_t fm_tensor_experts(const fm_tensor *t)
{
    const char *why;
    if (!t || !fm_tensor_shape_ok(t, &why))
        return -1;
    return t->ndim == 3 ? t->shape[0] : 1;
}

static int64_t logical_rows(const fm_tensor *t) { return t->shape[t->ndim - 2]; }
static int64_t logical_cols(const fm_tensor *t) { return t->shape[t->ndim - 1]; }

int64_t fm_tensor_stored_rows(const fm_tensor *t)
{
    const char *why;
    if (!t || !fm_tensor_shape_ok(t, &why))
        return -1;
    return t->layout == FM_LAYOUT_COLWISE ? logical_cols(t) : logical_rows(t);
}

int64_t fm_tensor_stored_cols(const fm_tensor *t)
{
    const char *why;
    if (!t || !fm_tensor_shape_ok(t, &why))
        return -1;
    return t->layout == FM_LAYOUT_COLWISE ? logical_rows(t) : logical_cols(t);
}

int64_t fm_tensor_numel(const fm_tensor *t)
{
    const char *why;
    if (!t || !fm_tensor_shape_ok(t, &why))
        return -1;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

int64_t fm_tensor_nbytes(const fm_tensor *t)
{
    int64_t n = fm_tensor_numel(t);
    int bits = t ? fm_dtype_bits(t->dtype) : 0;
    if (n < 0 || bits == 0)
        return -1;
    if (bits == 4) /* packed per stored row: an odd row still takes whole bytes */
        return fm_tensor_experts(t) * fm_tensor_stored_rows(t) * ((fm_tensor_stored_cols(t) + 1) / 2);
    return n * (bits / 8);
}

int64_t fm_tensor_scale_count(const fm_tensor *t)
{
    if (!t || fm_tensor_numel(t) < 0 || (unsigned)t->scale_mode >= FM_SCALE_MODE_COUNT ||
        (unsigned)t->scale_layout >= FM_SCALE_LAYOUT_COUNT)
        return -1;
    if (t->scale_mode == FM_SCALE_NONE)
        return 0;
    /* A bounded element count still allows a huge row count with no columns
     * (ROW scales: one per row) and the GEMM layouts round up: sizes past
     * 2^56 rows or columns, or a count past int64, are answered -1 rather
     * than overflowed (fuzz_descriptor_validation found R = 2^62, C = 0). */
    int64_t R = fm_tensor_stored_rows(t), C = fm_tensor_stored_cols(t), E = fm_tensor_experts(t);
    const int64_t lim = (int64_t)1 << 56;
    if (R > lim || C > lim || E < 0)
        return -1;
    int64_t n = fm_scale_count_2d(t->scale_mode, t->scale_layout, R, C);
    return n > 0 && E > INT64_MAX / n ? -1 : E * n;
}

int64_t fm_tensor_grouped_scale_count(const fm_tensor *t, const fm_splits *splits)
{
    if (!t || t->ndim != 2 || fm_tensor_scale_count(t) < 0 || !splits || splits->groups < 1 || !splits->host)
        return -1;
    int64_t rows = t->shape[0], cols = t->shape[1], seen = 0, n = 0;
    for (int64_t g = 0; g < splits->groups; g++) {
        int64_t m = splits->host[g];
        if (m < 0 || m > rows - seen)
            return -1;
        seen += m;
        if (t->scale_mode != FM_SCALE_NONE)
            n += t->layout == FM_LAYOUT_COLWISE ? fm_scale_count_2d(t->scale_mode, t->scale_layout, cols, m)
                                                : fm_scale_count_2d(t->scale_mode, t->scale_layout, m, cols);
    }
    return seen == rows ? n : -1;
}

int64_t fm_tensor_scale_nbytes(const fm_tensor *t)
{
    int64_t n = fm_tensor_scale_count(t);
    if (n < 0)
        return -1;
    int bits = fm_dtype_bits(t->scale_dtype);
    return bits >= 8 && n <= INT64_MAX / (bits / 8) ? n * (bits / 8) : -1;
}

int fm_dtype_bits(fm_dtype d)
{
    switch (d) {
    case FM_DTYPE_F32: case FM_DTYPE_I32: return 32;
    case FM_DTYPE_BF16: case FM_DTYPE_F16: return 16;
    case FM_DTYPE_E4M3: case FM_DTYPE_E5M2: case FM_DTYPE_E8M0: return 8;
    case FM_DTYPE_E2M1: return 4;
    case FM_DTYPE_I64: return 64;
    default: return 0;
    }
}

const char *fm_dtype_name(fm_dtype d)
{
    static const char *n[] = {"F32", "BF16", "F16", "E4M3", "E5M2", "E2M1", "E8M0", "I32", "I64"};
    return (unsigned)d < FM_DTYPE_COUNT ? n[d] : "invalid-dtype";
}

const char *fm_scale_mode_name(fm_scale_mode m)
{
    static const char *n[] = {"NONE", "TENSOR", "ROW", "BLOCK_1x128", "BLOCK_128x128", "MX32", "NV16"};
    return (unsigned)m < FM_SCALE_MODE_COUNT ? n[m] : "invalid-scale-mode";
}

const char *fm_scale_layout_name(fm_scale_layout l)
{
    return l == FM_SCALE_LAYOUT_COMPACT ? "compact" : l == FM_SCALE_LAYOUT_GEMM ? "gemm" : "invalid-scale-layout";
}

const char *fm_layout_name(fm_layout l)
{
    return l == FM_LAYOUT_ROWWISE ? "rowwise" : l == FM_LAYOUT_COLWISE ? "colwise" : "invalid-layout";
}

const char *fm_status_name(fm_status s)
{
    switch (s) {
    case FM_OK: return "FM_OK";
    case FM_ERR_INVALID_ARG: return "FM_ERR_INVALID_ARG";
    case FM_ERR_UNSUPPORTED: return "FM_ERR_UNSUPPORTED";
    case FM_ERR_OUT_OF_MEMORY: return "FM_ERR_OUT_OF_MEMORY";
    case FM_ERR_BACKEND: return "FM_ERR_BACKEND";
    case FM_ERR_NO_DEVICE: return "FM_ERR_NO_DEVICE";
    default: return "FM_ERR_UNKNOWN";
    }
}

fm_dtype fm_scale_mode_dtype(fm_scale_mode m)
{
    return m == FM_SCALE_MX32 ? FM_DTYPE_E8M0 : m == FM_SCALE_NV16 ? FM_DTYPE_E4M3 : FM_DTYPE_F32;
}

int fm_scale_mode_block_rows(fm_scale_mode m) { return m == FM_SCALE_BLOCK_128x128 ? 128 : 1; }
int fm_scale_mode_block_cols(fm_scale_mode m) { return fm_mode_block_cols(m); }
