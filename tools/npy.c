/* .npy reader and F32 writer; see npy.h for the contract. */
#include "npy.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "npy.c copies little-endian file data as is; add byte swapping for a big-endian host"
#endif

static int fail(char *err, size_t errlen, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

const char *npy_dtype_name(npy_dtype t)
{
    switch (t) {
    case NPY_F32: return "F32";
    case NPY_F16: return "F16";
    case NPY_BF16: return "BF16";
    }
    return "?";
}

/* ---- header ------------------------------------------------------------ */

enum file_type { FT_F32, FT_F16, FT_BF16, FT_F64 };

typedef struct {
    int fortran;
    int ndim;
    int64_t shape[NPY_MAX_DIMS];
    enum file_type ft;
    size_t file_elem;  /* bytes per element in the file */
    char descr[16];
} header;

typedef struct {
    const char *s;
    size_t n, i;
} cursor;

static void skip_ws(cursor *c)
{
    while (c->i < c->n && (c->s[c->i] == ' ' || c->s[c->i] == '\t' || c->s[c->i] == '\n' || c->s[c->i] == '\r'))
        c->i++;
}

static int peek(cursor *c)
{
    skip_ws(c);
    return c->i < c->n ? (unsigned char)c->s[c->i] : -1;
}

static int expect(cursor *c, char ch, const char *what, char *err, size_t errlen)
{
    int p = peek(c);
    if (p != ch)
        return fail(err, errlen, "header: expected '%c' %s at byte %zu of the header, found %s", ch, what, c->i,
                    p < 0 ? "the end of the header" : "something else");
    c->i++;
    return 0;
}

/* A Python string literal without escapes, which is all numpy ever writes for
 * keys and dtype strings. */
static int parse_str(cursor *c, char *buf, size_t cap, char *err, size_t errlen)
{
    int q = peek(c);
    if (q != '\'' && q != '"')
        return fail(err, errlen, "header: expected a quoted string at byte %zu of the header", c->i);
    size_t start = ++c->i, len = 0;
    while (c->i < c->n && c->s[c->i] != q) {
        unsigned char ch = (unsigned char)c->s[c->i];
        if (ch == '\\' || ch < 0x20 || ch > 0x7E)
            return fail(err, errlen, "header: unsupported character 0x%02x in a string at byte %zu of the header",
                        ch, c->i);
        c->i++;
        len++;
    }
    if (c->i >= c->n)
        return fail(err, errlen, "header: unterminated string starting at byte %zu of the header", start - 1);
    c->i++;
    if (len >= cap)
        return fail(err, errlen, "header: string at byte %zu is %zu characters long; at most %zu are expected here",
                    start - 1, len, cap - 1);
    memcpy(buf, c->s + start, len);
    buf[len] = '\0';
    return 0;
}

static int parse_int(cursor *c, int64_t *v, char *err, size_t errlen)
{
    skip_ws(c);
    size_t start = c->i;
    int64_t x = 0;
    while (c->i < c->n && c->s[c->i] >= '0' && c->s[c->i] <= '9') {
        int d = c->s[c->i] - '0';
        if (x > (INT64_MAX - d) / 10)
            return fail(err, errlen, "header: the shape entry at byte %zu of the header does not fit in 64 bits",
                        start);
        x = x * 10 + d;
        c->i++;
    }
    if (c->i == start)
        return fail(err, errlen, "header: expected a non-negative integer in the shape at byte %zu of the header",
                    start);
    /* Files written by Python 2 numpy spell longs as 2L. */
    if (c->i < c->n && (c->s[c->i] == 'L' || c->s[c->i] == 'l'))
        c->i++;
    *v = x;
    return 0;
}

static int parse_bool(cursor *c, int *v, char *err, size_t errlen)
{
    skip_ws(c);
    if (c->n - c->i >= 4 && !memcmp(c->s + c->i, "True", 4)) {
        c->i += 4;
        *v = 1;
        return 0;
    }
    if (c->n - c->i >= 5 && !memcmp(c->s + c->i, "False", 5)) {
        c->i += 5;
        *v = 0;
        return 0;
    }
    return fail(err, errlen, "header: 'fortran_order' must be True or False (byte %zu of the header)", c->i);
}

static int parse_shape(cursor *c, header *h, char *err, size_t errlen)
{
    if (expect(c, '(', "to open the 'shape' tuple", err, errlen))
        return -1;
    h->ndim = 0;
    for (;;) {
        int p = peek(c);
        if (p == ')') {
            c->i++;
            return 0;
        }
        if (h->ndim == NPY_MAX_DIMS)
            return fail(err, errlen, "header: the shape has more than %d dimensions", NPY_MAX_DIMS);
        if (parse_int(c, &h->shape[h->ndim], err, errlen))
            return -1;
        h->ndim++;
        p = peek(c);
        if (p == ',')
            c->i++;
        else if (p != ')')
            return fail(err, errlen, "header: expected ',' or ')' in the shape at byte %zu of the header", c->i);
    }
}

static int classify_descr(header *h, char *err, size_t errlen)
{
    const char *d = h->descr;
    static const struct {
        const char *name;
        enum file_type ft;
        size_t size;
    } known[] = {
        {"<f4", FT_F32, 4}, {"<f2", FT_F16, 2}, {"<f8", FT_F64, 8},  {"<V2", FT_BF16, 2},
        {"|V2", FT_BF16, 2}, {"bfloat16", FT_BF16, 2}, {"<bf16", FT_BF16, 2},
    };
    for (size_t k = 0; k < sizeof known / sizeof known[0]; k++)
        if (!strcmp(d, known[k].name)) {
            h->ft = known[k].ft;
            h->file_elem = known[k].size;
            return 0;
        }
    if (d[0] == '>')
        return fail(err, errlen,
                    "dtype '%s' is big-endian; save it little-endian first (arr.astype(arr.dtype.newbyteorder('<')))",
                    d);
    return fail(err, errlen,
                "dtype '%s' is not supported; expected little-endian float32 '<f4', float16 '<f2', float64 '<f8' "
                "or ml_dtypes bfloat16 ('<V2')",
                d);
}

static int parse_dict(const char *s, size_t n, header *h, char *err, size_t errlen)
{
    cursor c = {s, n, 0};
    int have_descr = 0, have_fortran = 0, have_shape = 0;
    if (expect(&c, '{', "at the start of the header dictionary", err, errlen))
        return -1;
    for (;;) {
        int p = peek(&c);
        if (p == '}') {
            c.i++;
            break;
        }
        char key[32];
        if (parse_str(&c, key, sizeof key, err, errlen))
            return -1;
        if (expect(&c, ':', "after a key", err, errlen))
            return -1;
        if (!strcmp(key, "descr")) {
            if (have_descr++)
                return fail(err, errlen, "header: key 'descr' appears twice");
            if (peek(&c) == '[')
                return fail(err, errlen, "header: 'descr' is a list (a structured dtype); only plain float arrays "
                                         "are supported");
            if (parse_str(&c, h->descr, sizeof h->descr, err, errlen))
                return -1;
        } else if (!strcmp(key, "fortran_order")) {
            if (have_fortran++)
                return fail(err, errlen, "header: key 'fortran_order' appears twice");
            if (parse_bool(&c, &h->fortran, err, errlen))
                return -1;
        } else if (!strcmp(key, "shape")) {
            if (have_shape++)
                return fail(err, errlen, "header: key 'shape' appears twice");
            if (parse_shape(&c, h, err, errlen))
                return -1;
        } else {
            return fail(err, errlen, "header: unexpected key '%s'; a .npy header has only 'descr', "
                                     "'fortran_order' and 'shape'",
                        key);
        }
        p = peek(&c);
        if (p == ',')
            c.i++;
        else if (p != '}')
            return fail(err, errlen, "header: expected ',' or '}' after the value of '%s' at byte %zu of the header",
                        key, c.i);
    }
    if (peek(&c) >= 0)
        return fail(err, errlen, "header: unexpected text after the closing '}' at byte %zu of the header", c.i);
    if (!have_descr || !have_fortran || !have_shape)
        return fail(err, errlen, "header: missing key '%s'",
                    !have_descr ? "descr" : !have_fortran ? "fortran_order" : "shape");
    return classify_descr(h, err, errlen);
}

/* The fixed part: magic, version, header length. Returns the header's start
 * offset, or 0 after writing err. `avail` bytes of `p` are readable. */
static size_t parse_preamble(const unsigned char *p, size_t avail, size_t *hlen, char *err, size_t errlen)
{
    static const unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
    if (avail < 8 || memcmp(p, magic, 6)) {
        if (avail >= 6 && memcmp(p, magic, 6))
            fail(err, errlen, "not a .npy file: the first 6 bytes are not the magic string \\x93NUMPY");
        else
            fail(err, errlen, "not a .npy file: only %zu bytes, too short for the magic string and version", avail);
        return 0;
    }
    unsigned major = p[6], minor = p[7];
    if (major < 1 || major > 3 || minor != 0) {
        fail(err, errlen, "unsupported .npy format version %u.%u (1.0, 2.0 and 3.0 are supported)", major, minor);
        return 0;
    }
    size_t fixed = major == 1 ? 10 : 12;
    if (avail < fixed) {
        fail(err, errlen, "truncated .npy file: %zu bytes, but version %u.0 needs %zu before the header", avail, major,
             fixed);
        return 0;
    }
    uint32_t n = major == 1 ? (uint32_t)p[8] | (uint32_t)p[9] << 8
                            : (uint32_t)p[8] | (uint32_t)p[9] << 8 | (uint32_t)p[10] << 16 | (uint32_t)p[11] << 24;
    if (n == 0) {
        fail(err, errlen, "corrupt .npy file: the header length is 0");
        return 0;
    }
    if (n > NPY_MAX_HEADER) {
        fail(err, errlen, "corrupt .npy file: the header claims %u bytes, more than the %d this reader accepts", n,
             NPY_MAX_HEADER);
        return 0;
    }
    *hlen = n;
    return fixed;
}

/* Fills the 2-D view and byte counts; refuses shapes whose products overflow. */
static int geometry(const header *h, npy_array *out, size_t *file_bytes, char *err, size_t errlen)
{
    int64_t numel = 1, lead = 1;
    for (int k = 0; k < h->ndim; k++) {
        int64_t d = h->shape[k];
        if (d != 0 && numel > INT64_MAX / d)
            return fail(err, errlen, "shape: the product of the dimensions overflows 64 bits (dimension %d is %lld)",
                        k, (long long)d);
        numel *= d;
        if (k < h->ndim - 1)
            lead *= d; /* a factor of numel, or 0 once a dimension is 0: no overflow */
    }
    size_t out_elem = h->ft == FT_F64 || h->ft == FT_F32 ? 4 : 2;
    if ((uint64_t)numel > (uint64_t)(SIZE_MAX / h->file_elem))
        return fail(err, errlen, "shape: %lld elements of '%s' do not fit in this machine's address space",
                    (long long)numel, h->descr);
    out->dtype = h->ft == FT_F16 ? NPY_F16 : h->ft == FT_BF16 ? NPY_BF16 : NPY_F32;
    out->ndim = h->ndim;
    memcpy(out->shape, h->shape, sizeof out->shape);
    out->rows = h->ndim >= 2 ? lead : 1;
    out->cols = h->ndim >= 1 ? h->shape[h->ndim - 1] : 1;
    out->elem_size = out_elem;
    out->nbytes = (size_t)numel * out_elem;
    memcpy(out->descr, h->descr, sizeof out->descr);
    *file_bytes = (size_t)numel * h->file_elem;
    return 0;
}

static void shape_text(const header *h, char *buf, size_t cap)
{
    size_t o = 0;
    o += (size_t)snprintf(buf + o, cap - o, "(");
    for (int k = 0; k < h->ndim && o < cap; k++)
        o += (size_t)snprintf(buf + o, cap - o, "%lld%s", (long long)h->shape[k],
                              k + 1 < h->ndim ? ", " : h->ndim == 1 ? "," : "");
    if (o < cap)
        snprintf(buf + o, cap - o, ")");
}

static float f64_to_f32(const unsigned char *p)
{
    double d;
    memcpy(&d, p, sizeof d);
    return (float)d;
}

/* File bytes (C or Fortran order, file dtype) -> out->data (C order). */
static void convert(const header *h, const unsigned char *src, npy_array *out)
{
    int64_t numel = (int64_t)(out->nbytes / out->elem_size);
    if (numel == 0)
        return;
    size_t fe = h->file_elem, oe = out->elem_size;
    unsigned char *dst = out->data;
    if (!h->fortran || h->ndim < 2) {
        if (h->ft != FT_F64) {
            memcpy(dst, src, out->nbytes);
            return;
        }
        for (int64_t i = 0; i < numel; i++) {
            float f = f64_to_f32(src + (size_t)i * fe);
            memcpy(dst + (size_t)i * oe, &f, sizeof f);
        }
        return;
    }
    /* Fortran order: walk the C-order output and follow column-major source
     * strides, carrying like an odometer. */
    int n = h->ndim;
    int64_t idx[NPY_MAX_DIMS] = {0}, stride[NPY_MAX_DIMS];
    stride[0] = 1;
    for (int k = 1; k < n; k++)
        stride[k] = stride[k - 1] * h->shape[k - 1];
    int64_t s = 0;
    for (int64_t i = 0; i < numel; i++) {
        const unsigned char *p = src + (size_t)s * fe;
        if (h->ft == FT_F64) {
            float f = f64_to_f32(p);
            memcpy(dst + (size_t)i * oe, &f, sizeof f);
        } else {
            memcpy(dst + (size_t)i * oe, p, oe);
        }
        for (int k = n - 1; k >= 0; k--) {
            if (++idx[k] < h->shape[k]) {
                s += stride[k];
                break;
            }
            s -= stride[k] * (h->shape[k] - 1);
            idx[k] = 0;
        }
    }
}

static int parse_header_block(const char *text, size_t hlen, header *h, char *err, size_t errlen)
{
    memset(h, 0, sizeof *h);
    return parse_dict(text, hlen, h, err, errlen);
}

static int finish(const header *h, const unsigned char *file_data, npy_array *out, char *err, size_t errlen)
{
    if (out->nbytes == 0) {
        out->data = NULL;
        return 0;
    }
    out->data = malloc(out->nbytes);
    if (!out->data)
        return fail(err, errlen, "out of memory for %zu bytes of tensor data", out->nbytes);
    convert(h, file_data, out);
    return 0;
}

int npy_read_mem(const void *buf, size_t len, npy_array *out, char *err, size_t errlen)
{
    if (!out)
        return fail(err, errlen, "npy_read_mem: out is NULL");
    memset(out, 0, sizeof *out);
    if (!buf && len)
        return fail(err, errlen, "npy_read_mem: buf is NULL");
    const unsigned char *p = buf;
    size_t hlen, off = parse_preamble(p, len, &hlen, err, errlen);
    if (!off)
        return -1;
    if (hlen > len - off)
        return fail(err, errlen, "truncated .npy file: the header claims %zu bytes but only %zu follow", hlen,
                    len - off);
    header h;
    size_t file_bytes;
    if (parse_header_block((const char *)p + off, hlen, &h, err, errlen) ||
        geometry(&h, out, &file_bytes, err, errlen))
        return -1;
    size_t data_off = off + hlen;
    if (file_bytes > len - data_off) {
        char st[64 * 3];
        shape_text(&h, st, sizeof st);
        return fail(err, errlen, "truncated .npy file: shape %s of '%s' needs %zu data bytes but the file has %zu", st,
                    h.descr, file_bytes, len - data_off);
    }
    return finish(&h, p + data_off, out, err, errlen);
}

int npy_read_file(const char *path, npy_array *out, char *err, size_t errlen)
{
    if (!out)
        return fail(err, errlen, "npy_read_file: out is NULL");
    memset(out, 0, sizeof *out);
    if (!path)
        return fail(err, errlen, "npy_read_file: path is NULL");
    FILE *f = fopen(path, "rb");
    if (!f)
        return fail(err, errlen, "%s: cannot open: %s", path, strerror(errno));
    int rc = -1;
    char *text = NULL;
    unsigned char *raw = NULL;
    unsigned char pre[12];
    size_t got = fread(pre, 1, sizeof pre, f), hlen;
    char sub[512];
    size_t off = parse_preamble(pre, got, &hlen, sub, sizeof sub);
    if (!off) {
        fail(err, errlen, "%s: %s", path, sub);
        goto out;
    }
    /* Version 1.0 headers start at byte 10: two of the bytes read belong to them. */
    text = malloc(hlen);
    if (!text) {
        fail(err, errlen, "%s: out of memory for a %zu-byte header", path, hlen);
        goto out;
    }
    size_t have = got - off < hlen ? got - off : hlen;
    memcpy(text, pre + off, have);
    if (have < hlen && fread(text + have, 1, hlen - have, f) != hlen - have) {
        fail(err, errlen, "%s: truncated .npy file: the header claims %zu bytes but the file ends first", path, hlen);
        goto out;
    }
    header h;
    size_t file_bytes;
    if (parse_header_block(text, hlen, &h, sub, sizeof sub) || geometry(&h, out, &file_bytes, sub, sizeof sub)) {
        fail(err, errlen, "%s: %s", path, sub);
        goto out;
    }
    size_t data_off = off + hlen;
    char st[64 * 3];
    shape_text(&h, st, sizeof st);
    /* Regular files: compare sizes before allocating, so a lying header costs
     * nothing. Pipes and the like: a short read below catches it. */
    struct stat sb;
    if (fstat(fileno(f), &sb) == 0 && S_ISREG(sb.st_mode)) {
        uint64_t fsize = (uint64_t)sb.st_size;
        uint64_t avail = fsize > data_off ? fsize - data_off : 0;
        if ((uint64_t)file_bytes > avail) {
            fail(err, errlen, "%s: truncated .npy file: shape %s of '%s' needs %zu data bytes but the file has %llu",
                 path, st, h.descr, file_bytes, (unsigned long long)avail);
            goto out;
        }
    }
    /* Plain C-order F32/F16/BF16: read in place; otherwise stage the raw bytes. */
    int direct = h.ft != FT_F64 && (!h.fortran || h.ndim < 2);
    if (out->nbytes) {
        raw = malloc(direct ? out->nbytes : file_bytes);
        if (!raw) {
            fail(err, errlen, "%s: out of memory for %zu bytes of tensor data", path, direct ? out->nbytes : file_bytes);
            goto out;
        }
        if (fread(raw, 1, file_bytes, f) != file_bytes) {
            fail(err, errlen, "%s: truncated .npy file: shape %s of '%s' needs %zu data bytes but the file ends first",
                 path, st, h.descr, file_bytes);
            goto out;
        }
        if (direct) {
            out->data = raw;
            raw = NULL;
        } else if (finish(&h, raw, out, sub, sizeof sub)) {
            fail(err, errlen, "%s: %s", path, sub);
            goto out;
        }
    }
    rc = 0;
out:
    if (rc)
        memset(out, 0, sizeof *out);
    free(text);
    free(raw);
    fclose(f);
    return rc;
}

void npy_free(npy_array *a)
{
    if (!a)
        return;
    free(a->data);
    memset(a, 0, sizeof *a);
}

int npy_write_f32(const char *path, const float *data, int64_t rows, int64_t cols, int rows_is_1d, char *err,
                  size_t errlen)
{
    if (!path || rows < 0 || cols < 0 || (rows_is_1d && rows != 1) || (rows && cols && !data))
        return fail(err, errlen, "npy_write_f32: invalid arguments (rows %lld, cols %lld)", (long long)rows,
                    (long long)cols);
    if (cols && (uint64_t)rows > (uint64_t)(SIZE_MAX / 4) / (uint64_t)cols)
        return fail(err, errlen, "npy_write_f32: [%lld, %lld] is too large", (long long)rows, (long long)cols);
    char dict[160];
    int n = rows_is_1d ? snprintf(dict, sizeof dict, "{'descr': '<f4', 'fortran_order': False, 'shape': (%lld,), }",
                                  (long long)cols)
                       : snprintf(dict, sizeof dict, "{'descr': '<f4', 'fortran_order': False, 'shape': (%lld, %lld), }",
                                  (long long)rows, (long long)cols);
    /* numpy pads the header with spaces so the data starts 64-byte aligned,
     * and ends it with a newline. */
    size_t total = 10 + (size_t)n + 1;
    size_t pad = (64 - total % 64) % 64;
    size_t hlen = (size_t)n + pad + 1;
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(hlen & 0xFF),
                             (unsigned char)(hlen >> 8)};
    FILE *f = fopen(path, "wb");
    if (!f)
        return fail(err, errlen, "%s: cannot create: %s", path, strerror(errno));
    int ok = fwrite(pre, 1, sizeof pre, f) == sizeof pre && fwrite(dict, 1, (size_t)n, f) == (size_t)n;
    for (size_t k = 0; ok && k < pad; k++)
        ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF;
    size_t count = (size_t)rows * (size_t)cols;
    ok = ok && (count == 0 || fwrite(data, sizeof(float), count, f) == count);
    if (fclose(f) != 0)
        ok = 0;
    if (!ok)
        return fail(err, errlen, "%s: write failed: %s", path, strerror(errno));
    return 0;
}
