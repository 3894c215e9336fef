/* Fuzzes the .npy reader of fm-formats (tools/npy.c) on arbitrary bytes.
 *
 * Oracle: no crash, no read outside the input (ASan), and the contract of
 * npy.h: on failure a sentence and nothing to free; on success a 2-D view
 * whose sizes agree with each other, with a data buffer of exactly nbytes
 * (every byte is read here, so a short allocation is an ASan report). An
 * image that parses is parsed again from a copy with one trailing byte cut:
 * either it still parses to the same array (the data ended before) or it is
 * refused, never read past its end. */
#include <string.h>

#include "fuzz_common.h"
#include "npy.h"

static void check_array(const npy_array *a, size_t len)
{
    if (a->dtype != NPY_F32 && a->dtype != NPY_F16 && a->dtype != NPY_BF16)
        fz_fail("npy: dtype %d", (int)a->dtype);
    if (a->elem_size != (a->dtype == NPY_F32 ? 4u : 2u))
        fz_fail("npy: elem_size %zu for %s", a->elem_size, npy_dtype_name(a->dtype));
    if (a->ndim < 0 || a->ndim > NPY_MAX_DIMS || a->rows < 0 || a->cols < 0)
        fz_fail("npy: ndim %d rows %lld cols %lld", a->ndim, (long long)a->rows, (long long)a->cols);
    unsigned __int128 n = (unsigned __int128)(uint64_t)a->rows * (uint64_t)a->cols * a->elem_size;
    if (n != a->nbytes)
        fz_fail("npy: nbytes %zu but rows %lld x cols %lld x %zu", a->nbytes, (long long)a->rows,
                (long long)a->cols, a->elem_size);
    unsigned __int128 prod = 1;
    for (int k = 0; k < a->ndim; k++)
        prod *= (uint64_t)a->shape[k];
    if (prod != (unsigned __int128)(uint64_t)a->rows * (uint64_t)a->cols)
        fz_fail("npy: the 2-D view [%lld, %lld] does not hold the file's shape", (long long)a->rows,
                (long long)a->cols);
    if ((a->nbytes == 0) != (a->data == NULL))
        fz_fail("npy: data %p for nbytes %zu", a->data, a->nbytes);
    /* F64 files shrink to F32, so the data never exceeds twice the input. */
    if (a->nbytes > 2 * len)
        fz_fail("npy: %zu data bytes from a %zu-byte image", a->nbytes, len);
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < a->nbytes; i++)
        sink ^= ((const uint8_t *)a->data)[i];
    (void)sink;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* An exact-size copy: ASan sees any read past the image's end. */
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf)
        return 0;
    memcpy(buf, data, size);
    npy_array a;
    char err[256];
    memset(&a, 0x5A, sizeof a);
    err[0] = '\0';
    int rc = npy_read_mem(buf, size, &a, err, sizeof err);
    if (rc) {
        if (!err[0])
            fz_fail("npy: refused without a sentence");
        free(buf);
        return 0;
    }
    check_array(&a, size);
    if (size > 0) {
        npy_array b;
        char err2[256] = "";
        if (npy_read_mem(buf, size - 1, &b, err2, sizeof err2) == 0) {
            check_array(&b, size - 1);
            if (b.nbytes != a.nbytes || (a.nbytes && memcmp(a.data, b.data, a.nbytes)))
                fz_fail("npy: cutting the last byte changed the array");
            npy_free(&b);
        } else if (!err2[0]) {
            fz_fail("npy: refused the cut image without a sentence");
        }
    }
    npy_free(&a);
    free(buf);
    return 0;
}
