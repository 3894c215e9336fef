/* A small, defensive .npy reader and an F32 writer for the flowmoe tools.
 *
 * Reads format versions 1.0, 2.0 and 3.0 with little-endian float data:
 * '<f4' (F32), '<f2' (F16), '<f8' (F64, numpy's default, converted to F32 on
 * load) and bfloat16 as ml_dtypes writes it: numpy has no bfloat16 type, so
 * ml_dtypes saves its arrays with descr '<V2' (an anonymous 2-byte void); this
 * reader takes any 2-byte void to be bfloat16, and also accepts the spelled
 * out names 'bfloat16' / '<bf16'.
 *
 * Shapes map to a 2-D [rows, cols] view: () -> [1, 1], (N,) -> [1, N],
 * (A, B) -> [A, B], (A, ..., Z) -> [A * ... * Y, Z]. Fortran-ordered arrays
 * are transposed to C order on load.
 *
 * The input is untrusted (the reader is fuzzed): every malformed file yields
 * a non-zero return and a sentence in `err`, never a crash or a read outside
 * the buffer. */
#ifndef FM_TOOLS_NPY_H
#define FM_TOOLS_NPY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NPY_MAX_DIMS 32
/* numpy itself refuses headers above 10000 bytes unless told otherwise; a
 * little more room costs nothing and still bounds what a hostile file can
 * make us allocate before any data is read. */
#define NPY_MAX_HEADER 65536

typedef enum npy_dtype {
    NPY_F32 = 0,
    NPY_F16,
    NPY_BF16,
} npy_dtype;

typedef struct npy_array {
    npy_dtype dtype;            /* of `data`: F64 files arrive as NPY_F32 */
    int ndim;                   /* as in the file */
    int64_t shape[NPY_MAX_DIMS];
    int64_t rows, cols;         /* the 2-D view described above */
    size_t elem_size;           /* bytes per element of `data` (4 or 2) */
    size_t nbytes;              /* rows * cols * elem_size */
    void *data;                 /* malloc'd, C order; NULL when nbytes == 0 */
    char descr[16];             /* the file's dtype string, for messages */
} npy_array;

/* Parse a whole .npy image in memory. Returns 0 on success; otherwise
 * non-zero, `out` holds nothing to free, and `err` (if not NULL) a sentence. */
int npy_read_mem(const void *buf, size_t len, npy_array *out, char *err, size_t errlen);

/* Read a .npy file. Same contract as npy_read_mem; the data is read straight
 * into its final buffer (no second copy of a large file). */
int npy_read_file(const char *path, npy_array *out, char *err, size_t errlen);

void npy_free(npy_array *a);

/* Write a C-ordered [rows, cols] F32 array as a version 1.0 .npy file
 * (shape (cols,) when rows_is_1d). Returns 0 on success. */
int npy_write_f32(const char *path, const float *data, int64_t rows, int64_t cols, int rows_is_1d, char *err,
                  size_t errlen);

const char *npy_dtype_name(npy_dtype t);

#ifdef __cplusplus
}
#endif
#endif
