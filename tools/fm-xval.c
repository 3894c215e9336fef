/* fm-xval: cross-validates the CUDA backend against the CPU reference.
 *
 * Every op both backends implement runs over a matrix of shapes (one row,
 * partial blocks, several experts, empty, large), dtypes, modes, layouts,
 * rules and input kinds, on fresh random data per case, into outputs
 * poisoned with different bytes on each side (so an element neither backend
 * writes still shows), and the results are compared by the op's rule:
 * bit-exact for quantize / convert ops. One line per op: passed, failed,
 * skipped. Exit 1 on any failure, 77 when no CUDA device is usable.
 *
 * Registering a later op is one entry in `xv_ops` below.
 *
 *   fm-xval [-o OP] [-q] [-s SEED] [-v]
 *     -o OP    run only OP (repeatable)
 *     -q       quick: small shapes and a sample of the configurations
 *              (what runs under compute-sanitizer)
 *     -s SEED  random seed (default: from the clock; printed)
 *     -v       print every case
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "flowmoe/flowmoe.h"

#ifdef FM_HAVE_CUDA
#include <cuda_runtime.h>

/* ---- environment ---------------------------------------------------------- */

typedef struct xv_counts {
    long pass, fail, skip;
} xv_counts;

typedef struct xv_env {
    fm_context *cpu, *gpu;
    uint64_t rng;
    int quick, verbose;
    long printed;       /* failure reports printed so far */
    int cuda_broken;    /* a CUDA error left the device unusable */
} xv_env;

static uint64_t rnd(xv_env *x)
{
    /* splitmix64 */
    uint64_t z = (x->rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double rndu(xv_env *x) { return (double)(rnd(x) >> 11) * (1.0 / 9007199254740992.0); }
/* N(0, 1) by Box-Muller */
static double rndn(xv_env *x)
{
    double u = rndu(x), v = rndu(x);
    return sqrt(-2.0 * log(u > 0 ? u : 1e-300)) * cos(6.283185307179586 * v);
}
static int rndi(xv_env *x, int lo, int hi) { return lo + (int)(rnd(x) % (uint64_t)(hi - lo + 1)); }

static float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static int cuda_ok(xv_env *x, cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return 1;
    fprintf(stderr, "fm-xval: %s: %s\n", what, cudaGetErrorString(e));
    x->cuda_broken = 1;
    return 0;
}

/* A host buffer and its device twin, poisoned differently. */
typedef struct xv_buf {
    void *h, *d;
    size_t n;
} xv_buf;

static int buf_alloc(xv_env *x, xv_buf *b, size_t n)
{
    b->n = n;
    b->h = malloc(n ? n : 1);
    b->d = NULL;
    if (!b->h)
        return 0;
    return cuda_ok(x, cudaMalloc(&b->d, n ? n : 1), "cudaMalloc");
}

static void buf_free(xv_buf *b)
{
    free(b->h);
    if (b->d)
        cudaFree(b->d);
    b->h = b->d = NULL;
}

static int buf_poison(xv_env *x, xv_buf *b)
{
    memset(b->h, 0x5A, b->n ? b->n : 1);
    return cuda_ok(x, cudaMemset(b->d, 0xA5, b->n ? b->n : 1), "cudaMemset");
}

static int buf_upload(xv_env *x, xv_buf *b)
{
    return cuda_ok(x, cudaMemcpy(b->d, b->h, b->n, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
}

/* After both backends ran an op: -1 when both succeeded (the outputs are
 * compared next), 2 when both refused with the same status (a skip), 1 when
 * they disagree (reported). cmsg is the CPU's error sentence. */
static int status_verdict(xv_env *x, const char *name, fm_status stc, const char *cmsg, fm_status stg)
{
    if (stc == FM_OK && stg == FM_OK)
        return -1;
    if (stc == stg)
        return 2;
    if (x->printed++ < 20)
        fprintf(stderr, "FAIL %s: status cpu %s (%s) gpu %s (%s)\n", name, fm_status_name(stc), cmsg,
                fm_status_name(stg), fm_last_error(x->gpu));
    return 1;
}

/* Compares b->h with the device copy; reports the first differing byte. */
static int buf_same(xv_env *x, const xv_buf *b, const char *what, const char *casename)
{
    if (b->n == 0)
        return 1;
    unsigned char *g = malloc(b->n);
    if (!g || !cuda_ok(x, cudaMemcpy(g, b->d, b->n, cudaMemcpyDeviceToHost), "cudaMemcpy D2H")) {
        free(g);
        return 0;
    }
    const unsigned char *c = b->h;
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < b->n; i++)
        if (c[i] != g[i]) {
            if (!bad)
                first = i;
            bad++;
        }
    if (bad && x->printed < 20) {
        x->printed++;
        fprintf(stderr, "FAIL %s: %s: %zu of %zu bytes differ; first at byte %zu: cpu 0x%02x gpu 0x%02x\n", casename,
                what, bad, b->n, first, c[first], g[first]);
    }
    free(g);
    return bad == 0;
}

/* ---- input data ------------------------------------------------------------ */

enum { K_RANDOM, K_ZEROS, K_SUBNORMAL, K_MAXMAG, K_NONFINITE, K_RAWBITS, K_COUNT };
static const char *kind_name[K_COUNT] = {"random", "zeros", "subnormal", "maxmag", "nonfinite", "rawbits"};

/* One value of a kind, as F32 (the row's exponent offset widens the spread
 * between rows so per-row scales differ). */
static float gen_value(xv_env *x, int kind, int row_off)
{
    double s = (rnd(x) & 1) ? -1.0 : 1.0;
    switch (kind) {
    case K_ZEROS: return (rnd(x) & 7) == 0 ? -0.0f : 0.0f;
    case K_SUBNORMAL: {
        int r = rndi(x, 0, 5);
        if (r == 0) /* F32 subnormal */
            return f32_from_bits((uint32_t)(rnd(x) & 0x7FFFFF) | (rnd(x) & 1 ? 0x80000000u : 0));
        if (r == 1) /* BF16-representable subnormal-range values */
            return (float)(s * ldexp(1.0 + rndu(x), rndi(x, -140, -126)));
        if (r == 2) /* F16 subnormals */
            return (float)(s * ldexp((double)rndi(x, 1, 1023), -24));
        if (r == 3)
            return 0.0f;
        return (float)(s * ldexp(1.0 + rndu(x), rndi(x, -30, -10)));
    }
    case K_MAXMAG: {
        static const float big[] = {3.4028235e38f, 3.0e38f, 1.7e38f, 65504.0f, 65519.0f, 65520.0f, 448.0f, 464.0f,
                                    480.0f, 57344.0f, 61440.0f, 6.0f, 7.0f, 1e30f, 2.0e38f};
        if (rnd(x) & 1)
            return (float)(s * big[rnd(x) % (sizeof big / sizeof big[0])]);
        return (float)(s * ldexp(1.0 + rndu(x), rndi(x, 100, 127)));
    }
    case K_NONFINITE: {
        uint64_t r = rnd(x) % 1000;
        if (r == 0)
            return f32_from_bits(0x7F800000u);
        if (r == 1)
            return f32_from_bits(0xFF800000u);
        if (r == 2)
            return f32_from_bits(0x7FC00000u | (uint32_t)(rnd(x) & 0x3FFFFF) | (rnd(x) & 1 ? 0x80000000u : 0));
        if (r == 3)
            return f32_from_bits(0x7F800001u); /* signalling NaN */
        return (float)(s * ldexp(1.0 + rndu(x), rndi(x, -20, 20)));
    }
    case K_RAWBITS: return f32_from_bits((uint32_t)rnd(x));
    default: return (float)(s * ldexp(1.0 + rndu(x), rndi(x, -40, 40) + row_off));
    }
}

static int dtype_bytes(fm_dtype t) { return fm_dtype_bits(t) / 8; }

/* Fills a host buffer of n elements of dtype t. RAWBITS draws raw patterns of
 * the dtype itself (NaN payloads, Inf, subnormals of that dtype). */
static void gen_input(xv_env *x, void *h, fm_dtype t, int64_t E, int64_t rows, int64_t cols, int kind)
{
    int64_t n = E * rows * cols;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = (i / (cols ? cols : 1)) % (rows ? rows : 1);
        int row_off = (int)(r % 7) * 6 - 18;
        if (kind == K_RAWBITS && t != FM_DTYPE_F32) {
            ((uint16_t *)h)[i] = (uint16_t)rnd(x);
            continue;
        }
        float v = gen_value(x, kind, row_off);
        if (t == FM_DTYPE_F32)
            ((float *)h)[i] = v;
        else if (t == FM_DTYPE_BF16)
            ((uint16_t *)h)[i] = fm_bf16_from_f32(v);
        else
            ((uint16_t *)h)[i] = fm_f16_from_f32(v);
    }
}

/* ---- shapes ---------------------------------------------------------------- */

typedef struct xv_shape {
    int64_t E, rows, cols;
    int ndim;
    int large;
} xv_shape;

static const xv_shape shapes[] = {
    {1, 1, 128, 2, 0},   {1, 1, 7, 2, 0},      {1, 2, 6, 2, 0},     {1, 3, 5, 2, 0},      {1, 32, 32, 2, 0},
    {1, 127, 129, 2, 0}, {1, 128, 128, 2, 0},  {1, 130, 300, 2, 0}, {1, 256, 1024, 2, 0}, {1, 64, 4096, 3, 0},
    {3, 200, 136, 3, 0}, {4, 128, 256, 3, 0},  {2, 33, 64, 3, 0},   {1, 0, 128, 2, 0},    {1, 128, 0, 2, 0},
    {0, 16, 16, 3, 0},   {1, 1000, 520, 2, 0}, {2, 384, 2048, 3, 1}, {1, 1024, 7168, 2, 1},
    {3, 200, 144, 3, 0}, /* 3 experts of 200 rows, N a multiple of 16: partial tiles at each expert's end (TMA) */
};
#define NSHAPES (int)(sizeof shapes / sizeof shapes[0])

static fm_tensor make_tensor(const xv_shape *s, void *data, fm_dtype t, fm_device dev)
{
    fm_tensor r = s->ndim == 3 ? fm_tensor_3d(data, t, s->E, s->rows, s->cols) : fm_tensor_2d(data, t, s->rows, s->cols);
    r.device = dev;
    return r;
}

static void quantized(fm_tensor *t, fm_layout lay, fm_scale_mode m, fm_scale_layout sl, void *scale)
{
    t->layout = lay;
    t->scale_mode = m;
    t->scale = scale;
    t->scale_dtype = fm_scale_mode_dtype(m);
    t->scale_layout = sl;
}

/* Quick mode: small shapes, and every `stride`-th configuration. */
static int shape_skipped(const xv_env *x, const xv_shape *s)
{
    return x->quick && (s->large || s->E * s->rows * s->cols > 100000);
}

/* ---- configurations shared by the quantized-tensor ops ---------------------- */

typedef struct xv_qcfg {
    fm_dtype elem;
    fm_scale_mode mode;
    fm_scale_rule rule;
    fm_scale_layout sl;
} xv_qcfg;

static int build_qcfgs(xv_qcfg *out)
{
    int n = 0;
    static const fm_scale_mode modes[] = {FM_SCALE_TENSOR, FM_SCALE_ROW, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128,
                                          FM_SCALE_MX32};
    for (int mi = 0; mi < 5; mi++) {
        fm_scale_mode m = modes[mi];
        int mx = m == FM_SCALE_MX32;
        int gemm_layouts = (m == FM_SCALE_TENSOR || m == FM_SCALE_ROW) ? 1 : 2;
        for (int ei = 0; ei < (mx ? 3 : 2); ei++) {
            fm_dtype el = ei == 0 ? FM_DTYPE_E4M3 : ei == 1 ? FM_DTYPE_E5M2 : FM_DTYPE_E2M1;
            for (int ri = 0; ri < 3; ri++) {
                fm_scale_rule rule = ri == 0 ? FM_SCALE_RULE_DEFAULT
                                   : ri == 1 ? (mx ? FM_SCALE_RULE_MX_FLOOR : FM_SCALE_RULE_EXACT)
                                             : FM_SCALE_RULE_POW2;
                if (ri == 2 && (m == FM_SCALE_BLOCK_1x128 || m == FM_SCALE_BLOCK_128x128 || mx))
                    continue; /* POW2 is their default */
                for (int li = 0; li < gemm_layouts; li++)
                    out[n++] = (xv_qcfg){el, m, rule, li ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT};
            }
        }
    }
    return n;
}

static void qcfg_name(const xv_qcfg *c, char *b, size_t n)
{
    static const char *rn[] = {"default", "pow2", "exact", "mx_floor"};
    snprintf(b, n, "%s/%s/%s/%s", fm_dtype_name(c->elem), fm_scale_mode_name(c->mode), rn[c->rule],
             fm_scale_layout_name(c->sl));
}

/* ---- op: quantize -------------------------------------------------------- */

typedef struct xv_qout {
    fm_tensor th, td;
    xv_buf data, scale;
} xv_qout;

static int qout_setup(xv_env *x, xv_qout *o, const xv_shape *s, const xv_qcfg *c, fm_layout lay)
{
    memset(o, 0, sizeof *o);
    o->th = make_tensor(s, NULL, c->elem, FM_DEVICE_HOST);
    quantized(&o->th, lay, c->mode, c->sl, NULL);
    int64_t nb = fm_tensor_nbytes(&o->th), ns = fm_tensor_scale_nbytes(&o->th);
    if (nb < 0 || ns < 0)
        return 0;
    if (!buf_alloc(x, &o->data, (size_t)nb) || !buf_alloc(x, &o->scale, (size_t)ns))
        return 0;
    if (!buf_poison(x, &o->data) || !buf_poison(x, &o->scale))
        return 0;
    o->th.data = o->data.h;
    o->th.scale = o->scale.h;
    o->td = o->th;
    o->td.device = FM_DEVICE_CUDA;
    o->td.data = o->data.d;
    o->td.scale = o->scale.d;
    return 1;
}

static void qout_free(xv_qout *o)
{
    buf_free(&o->data);
    buf_free(&o->scale);
}

/* 0 pass, 1 fail, 2 skip */
static int quant_case(xv_env *x, const xv_shape *s, fm_dtype in_t, int kind, const xv_qcfg *rc, const xv_qcfg *cc,
                      float eps, int want_amax, const char *name)
{
    int res = 1;
    xv_buf in = {0}, amax = {0}, nonf = {0};
    xv_qout orow, ocol;
    memset(&orow, 0, sizeof orow);
    memset(&ocol, 0, sizeof ocol);
    int64_t n = s->E * s->rows * s->cols;
    if (!buf_alloc(x, &in, (size_t)n * (size_t)dtype_bytes(in_t)))
        goto done;
    gen_input(x, in.h, in_t, s->E, s->rows, s->cols, kind);
    if (!buf_upload(x, &in))
        goto done;
    if (rc && !qout_setup(x, &orow, s, rc, FM_LAYOUT_ROWWISE))
        goto done;
    if (cc && !qout_setup(x, &ocol, s, cc, FM_LAYOUT_COLWISE))
        goto done;
    if (!buf_alloc(x, &amax, 4) || !buf_alloc(x, &nonf, 8) || !buf_poison(x, &amax) || !buf_poison(x, &nonf))
        goto done;

    fm_tensor ih = make_tensor(s, in.h, in_t, FM_DEVICE_HOST), id = make_tensor(s, in.d, in_t, FM_DEVICE_CUDA);
    fm_quant_config qh = {.rule = rc ? rc->rule : cc->rule, .epsilon = eps};
    fm_quant_config qd = qh;
    if (want_amax) {
        qh.amax = amax.h;
        qh.nonfinite_blocks = nonf.h;
        qd.amax = amax.d;
        qd.nonfinite_blocks = nonf.d;
    }
    fm_stats s0c, s0g, s1c, s1g;
    fm_stats_get(x->cpu, &s0c);
    fm_stats_get(x->gpu, &s0g);
    fm_status stc = fm_quantize(x->cpu, &qh, &ih, rc ? &orow.th : NULL, cc ? &ocol.th : NULL);
    fm_status stg = fm_quantize(x->gpu, &qd, &id, rc ? &orow.td : NULL, cc ? &ocol.td : NULL);
    if (stg == FM_OK && !cuda_ok(x, cudaDeviceSynchronize(), "quantize"))
        stg = FM_ERR_BACKEND;
    if ((res = status_verdict(x, name, stc, fm_last_error(x->cpu), stg)) >= 0)
        goto done;
    int ok = 1;
    if (rc)
        ok &= buf_same(x, &orow.data, "rowwise codes", name) & buf_same(x, &orow.scale, "rowwise scales", name);
    if (cc)
        ok &= buf_same(x, &ocol.data, "colwise codes", name) & buf_same(x, &ocol.scale, "colwise scales", name);
    if (want_amax)
        ok &= buf_same(x, &amax, "amax", name) & buf_same(x, &nonf, "nonfinite_blocks", name);
    fm_stats_get(x->cpu, &s1c);
    fm_stats_get(x->gpu, &s1g);
    if (s1c.casts_to_low - s0c.casts_to_low != s1g.casts_to_low - s0g.casts_to_low ||
        s1c.bytes_read - s0c.bytes_read != s1g.bytes_read - s0g.bytes_read ||
        s1c.bytes_written - s0c.bytes_written != s1g.bytes_written - s0g.bytes_written) {
        ok = 0;
        if (x->printed++ < 20)
            fprintf(stderr, "FAIL %s: statistics differ between the backends\n", name);
    }
    res = ok ? 0 : 1;
done:
    buf_free(&in);
    buf_free(&amax);
    buf_free(&nonf);
    qout_free(&orow);
    qout_free(&ocol);
    return res;
}

static void tally(xv_env *x, xv_counts *c, int r, const char *name)
{
    if (r == 0)
        c->pass++;
    else if (r == 1)
        c->fail++;
    else
        c->skip++;
    if (x->verbose)
        printf("  %s %s\n", r == 0 ? "pass" : r == 1 ? "FAIL" : "skip", name);
}

static void shape_name(const xv_shape *s, char *b, size_t n)
{
    if (s->ndim == 3)
        snprintf(b, n, "[%lld,%lld,%lld]", (long long)s->E, (long long)s->rows, (long long)s->cols);
    else
        snprintf(b, n, "[%lld,%lld]", (long long)s->rows, (long long)s->cols);
}

static void xv_quantize(xv_env *x, xv_counts *cnt)
{
    xv_qcfg cf[64];
    int ncf = build_qcfgs(cf);
    static const fm_dtype ins[] = {FM_DTYPE_BF16, FM_DTYPE_F32, FM_DTYPE_F16};
    long serial = 0;
    for (int si = 0; si < NSHAPES && !x->cuda_broken; si++) {
        const xv_shape *s = &shapes[si];
        if (shape_skipped(x, s))
            continue;
        for (int ci = 0; ci < ncf && !x->cuda_broken; ci++) {
            for (int sel = 0; sel < 4 && !x->cuda_broken; sel++) {
                serial++;
                /* Large shapes and quick mode take a sample of the matrix. */
                if (s->large && serial % 6)
                    continue;
                if (x->quick && serial % 5)
                    continue;
                const xv_qcfg *rc = sel == 0 || sel == 2 || sel == 3 ? &cf[ci] : NULL;
                const xv_qcfg *cc = sel == 1 || sel == 2 ? &cf[ci] : NULL;
                xv_qcfg mixed;
                if (sel == 3) {
                    /* Row-wise and column-wise outputs with different configs,
                     * same rule family (one rule per call). */
                    mixed = cf[(ci * 7 + 3) % ncf];
                    int ok_mix = (mixed.mode == FM_SCALE_MX32) == (cf[ci].mode == FM_SCALE_MX32);
                    if (!ok_mix)
                        continue;
                    mixed.rule = cf[ci].rule;
                    cc = &mixed;
                }
                fm_dtype in_t = ins[serial % 3];
                int kind = (int)((serial / 3) % K_COUNT);
                float eps = serial % 7 == 0 ? (float)ldexp(1.0, -rndi(x, 0, 20)) : 0.0f;
                int want_amax = serial % 2 == 0 || kind == K_NONFINITE;
                char sn[64], rn[64] = "-", cn[64] = "-", name[320];
                shape_name(s, sn, sizeof sn);
                if (rc)
                    qcfg_name(rc, rn, sizeof rn);
                if (cc)
                    qcfg_name(cc, cn, sizeof cn);
                snprintf(name, sizeof name, "quantize %s %s->row:%s col:%s kind=%s eps=%g", sn, fm_dtype_name(in_t),
                         rn, cn, kind_name[kind], (double)eps);
                tally(x, cnt, quant_case(x, s, in_t, kind, rc, cc, eps, want_amax, name), name);
            }
        }
    }
}

/* ---- op: dequantize -------------------------------------------------------- */

static void random_scales(xv_env *x, void *h, size_t nbytes, int e8)
{
    if (e8) {
        for (size_t i = 0; i < nbytes; i++) {
            uint64_t r = rnd(x) % 64;
            ((uint8_t *)h)[i] = r == 0 ? 0xFF : r < 4 ? (uint8_t)rnd(x) : (uint8_t)(127 + rndi(x, -20, 20));
        }
        return;
    }
    float *f = h;
    for (size_t i = 0; i < nbytes / 4; i++) {
        uint64_t r = rnd(x) % 64;
        if (r == 0)
            f[i] = f32_from_bits(0x7FC00000u);
        else if (r == 1)
            f[i] = f32_from_bits(0x7F800000u);
        else if (r < 6)
            f[i] = f32_from_bits((uint32_t)rnd(x)); /* anything: subnormal, huge, NaN payloads */
        else if (r < 30)
            f[i] = (float)ldexp(1.0, rndi(x, -30, 30));
        else
            f[i] = (float)ldexp(1.0 + rndu(x), rndi(x, -30, 30));
    }
}

static int dequant_case(xv_env *x, const xv_shape *s, const xv_qcfg *c, fm_layout in_lay, fm_layout out_lay,
                        fm_dtype out_t, const char *name)
{
    int res = 1;
    xv_buf codes = {0}, scale = {0}, out = {0};
    fm_tensor ih = make_tensor(s, NULL, c->elem, FM_DEVICE_HOST);
    quantized(&ih, in_lay, c->mode, c->sl, NULL);
    int64_t nb = fm_tensor_nbytes(&ih), ns = fm_tensor_scale_nbytes(&ih);
    fm_tensor oh = make_tensor(s, NULL, out_t, FM_DEVICE_HOST);
    oh.layout = out_lay;
    int64_t no = fm_tensor_nbytes(&oh);
    if (nb < 0 || ns < 0 || no < 0)
        return 2;
    if (!buf_alloc(x, &codes, (size_t)nb) || !buf_alloc(x, &scale, (size_t)ns) || !buf_alloc(x, &out, (size_t)no))
        goto done;
    for (size_t i = 0; i < codes.n; i++)
        ((uint8_t *)codes.h)[i] = (uint8_t)rnd(x);
    random_scales(x, scale.h, scale.n, ih.scale_dtype == FM_DTYPE_E8M0);
    if (!buf_upload(x, &codes) || !buf_upload(x, &scale) || !buf_poison(x, &out))
        goto done;
    ih.data = codes.h;
    ih.scale = scale.h;
    fm_tensor id = ih;
    id.device = FM_DEVICE_CUDA;
    id.data = codes.d;
    id.scale = scale.d;
    oh.data = out.h;
    fm_tensor od = oh;
    od.device = FM_DEVICE_CUDA;
    od.data = out.d;
    fm_status stc = fm_dequantize(x->cpu, &ih, &oh);
    fm_status stg = fm_dequantize(x->gpu, &id, &od);
    if (stg == FM_OK && !cuda_ok(x, cudaDeviceSynchronize(), "dequantize"))
        stg = FM_ERR_BACKEND;
    if ((res = status_verdict(x, name, stc, fm_last_error(x->cpu), stg)) >= 0)
        goto done;
    res = buf_same(x, &out, "output", name) ? 0 : 1;
done:
    buf_free(&codes);
    buf_free(&scale);
    buf_free(&out);
    return res;
}

static void xv_dequantize(xv_env *x, xv_counts *cnt)
{
    xv_qcfg cf[64];
    int ncf = build_qcfgs(cf);
    static const fm_dtype outs[] = {FM_DTYPE_BF16, FM_DTYPE_F32, FM_DTYPE_F16};
    long serial = 0;
    for (int si = 0; si < NSHAPES && !x->cuda_broken; si++) {
        const xv_shape *s = &shapes[si];
        if (shape_skipped(x, s))
            continue;
        for (int ci = 0; ci < ncf && !x->cuda_broken; ci++) {
            if (cf[ci].rule != FM_SCALE_RULE_DEFAULT)
                continue; /* the rule does not matter to dequantize */
            for (int v = 0; v < 12 && !x->cuda_broken; v++) {
                serial++;
                if (s->large && serial % 5)
                    continue;
                if (x->quick && serial % 4)
                    continue;
                fm_layout il = (v & 1) ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE;
                fm_layout ol = (v & 2) ? (il == FM_LAYOUT_ROWWISE ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE) : il;
                fm_dtype ot = outs[(v >> 2) % 3];
                char sn[64], cn[64], name[256];
                shape_name(s, sn, sizeof sn);
                qcfg_name(&cf[ci], cn, sizeof cn);
                snprintf(name, sizeof name, "dequantize %s %s %s -> %s %s", sn, cn, fm_layout_name(il),
                         fm_dtype_name(ot), fm_layout_name(ol));
                tally(x, cnt, dequant_case(x, s, &cf[ci], il, ol, ot, name), name);
            }
        }
    }
}

/* ---- op: scale_layout_convert ---------------------------------------------- */

static int slc_case(xv_env *x, const xv_shape *s, const xv_qcfg *c, fm_layout lay, fm_scale_layout from,
                    fm_scale_layout to, const char *name)
{
    int res = 1;
    xv_buf src = {0}, dst = {0};
    fm_tensor sh = make_tensor(s, NULL, c->elem, FM_DEVICE_HOST);
    quantized(&sh, lay, c->mode, from, NULL);
    fm_tensor dh = sh;
    dh.scale_layout = to;
    int64_t ns = fm_tensor_scale_nbytes(&sh), nd = fm_tensor_scale_nbytes(&dh);
    if (ns < 0 || nd < 0)
        return 2;
    if (!buf_alloc(x, &src, (size_t)ns) || !buf_alloc(x, &dst, (size_t)nd))
        goto done;
    for (size_t i = 0; i < src.n; i++)
        ((uint8_t *)src.h)[i] = (uint8_t)rnd(x);
    if (!buf_upload(x, &src) || !buf_poison(x, &dst))
        goto done;
    sh.scale = src.h;
    dh.scale = dst.h;
    fm_tensor sd = sh, dd = dh;
    sd.device = dd.device = FM_DEVICE_CUDA;
    sd.scale = src.d;
    dd.scale = dst.d;
    fm_status stc = fm_scale_layout_convert(x->cpu, &sh, &dh);
    fm_status stg = fm_scale_layout_convert(x->gpu, &sd, &dd);
    if (stg == FM_OK && !cuda_ok(x, cudaDeviceSynchronize(), "scale_layout_convert"))
        stg = FM_ERR_BACKEND;
    if ((res = status_verdict(x, name, stc, fm_last_error(x->cpu), stg)) >= 0)
        goto done;
    res = buf_same(x, &dst, "dst scales", name) ? 0 : 1;
done:
    buf_free(&src);
    buf_free(&dst);
    return res;
}

/* ---- op: cast ----------------------------------------------------------------
 * F32 / BF16 / F16 into each other, any layout pair, every input kind
 * (raw bit patterns included): bit-exact. */

static int cast_case(xv_env *x, const xv_shape *s, fm_dtype it, fm_dtype ot, fm_layout li, fm_layout lo, int kind,
                     const char *name)
{
    xv_buf in = {0}, out = {0};
    int res = 1;
    fm_tensor th = make_tensor(s, NULL, it, FM_DEVICE_HOST), oh = make_tensor(s, NULL, ot, FM_DEVICE_HOST);
    th.layout = li;
    oh.layout = lo;
    if (!buf_alloc(x, &in, (size_t)fm_tensor_nbytes(&th)) || !buf_alloc(x, &out, (size_t)fm_tensor_nbytes(&oh)) ||
        !buf_poison(x, &out))
        goto done;
    /* The input's stored order does not matter to the generator: any bits do. */
    gen_input(x, in.h, it, s->E, s->rows, s->cols, kind);
    if (!buf_upload(x, &in))
        goto done;
    fm_tensor td = th, od = oh;
    th.data = in.h, oh.data = out.h;
    td.data = in.d, od.data = out.d;
    td.device = od.device = FM_DEVICE_CUDA;
    fm_status stc = fm_cast(x->cpu, &th, &oh);
    char cmsg[256];
    snprintf(cmsg, sizeof cmsg, "%s", fm_last_error(x->cpu));
    fm_status stg = fm_cast(x->gpu, &td, &od);
    if (stg == FM_OK && !cuda_ok(x, cudaDeviceSynchronize(), name))
        stg = FM_ERR_BACKEND;
    if ((res = status_verdict(x, name, stc, cmsg, stg)) >= 0)
        goto done;
    res = buf_same(x, &out, "values", name) ? 0 : 1;
done:
    buf_free(&in);
    buf_free(&out);
    return res;
}

static void xv_cast(xv_env *x, xv_counts *cnt)
{
    static const fm_dtype dts[] = {FM_DTYPE_F32, FM_DTYPE_BF16, FM_DTYPE_F16};
    long serial = 0;
    for (int si = 0; si < NSHAPES && !x->cuda_broken; si++) {
        const xv_shape *s = &shapes[si];
        if (shape_skipped(x, s))
            continue;
        for (int v = 0; v < 36 && !x->cuda_broken; v++) {
            serial++;
            if ((s->large || x->quick) && serial % 4)
                continue;
            fm_dtype it = dts[v % 3], ot = dts[(v / 3) % 3];
            fm_layout li = (v / 9) & 1 ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE;
            fm_layout lo = (v / 18) & 1 ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE;
            int kind = (int)(serial % K_COUNT);
            char sn[64], name[256];
            shape_name(s, sn, sizeof sn);
            snprintf(name, sizeof name, "cast %s %s %s -> %s %s kind=%s", sn, fm_dtype_name(it), fm_layout_name(li),
                     fm_dtype_name(ot), fm_layout_name(lo), kind_name[kind]);
            tally(x, cnt, cast_case(x, s, it, ot, li, lo, kind, name), name);
        }
    }
}

static void xv_scale_layout_convert(xv_env *x, xv_counts *cnt)
{
    xv_qcfg cf[64];
    int ncf = build_qcfgs(cf);
    for (int si = 0; si < NSHAPES && !x->cuda_broken; si++) {
        const xv_shape *s = &shapes[si];
        if (shape_skipped(x, s))
            continue;
        for (int ci = 0; ci < ncf && !x->cuda_broken; ci++) {
            if (cf[ci].rule != FM_SCALE_RULE_DEFAULT || cf[ci].sl != FM_SCALE_LAYOUT_COMPACT)
                continue;
            for (int v = 0; v < 8; v++) {
                fm_layout lay = (v & 1) ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE;
                fm_scale_layout from = (v & 2) ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
                fm_scale_layout to = (v & 4) ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
                char sn[64], cn[64], name[256];
                shape_name(s, sn, sizeof sn);
                qcfg_name(&cf[ci], cn, sizeof cn);
                snprintf(name, sizeof name, "scale_layout_convert %s %s %s %s -> %s", sn, cn, fm_layout_name(lay),
                         fm_scale_layout_name(from), fm_scale_layout_name(to));
                tally(x, cnt, slc_case(x, s, &cf[ci], lay, from, to, name), name);
            }
        }
    }
}

/* ---- ops: transpose_scaled, convert_scaled ---------------------------------
 * Inputs are quantized on the CPU (POW2 scales) from fresh data of every
 * kind; the "scrambled" kind then overwrites the codes with random bytes
 * (NaN / Inf codes of finite blocks, every magnitude) and the scales with
 * random powers of two over the whole range (F32 subnormal ones, E8M0 0 and
 * 254, NaN), and the padding entries of a GEMM-layout F32 input with 3.0,
 * which both backends must ignore. Codes, scales and the nonfinite count are
 * compared bit for bit. A few cases plant non-power-of-two scales: both
 * backends must refuse with the same sentence and leave every output as it
 * was. */

typedef struct xv_rqfmt {
    fm_dtype elem;
    fm_scale_mode mode;
} xv_rqfmt;

static const xv_rqfmt rq_fmts[] = {
    {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E4M3, FM_SCALE_MX32},
    {FM_DTYPE_E5M2, FM_SCALE_MX32},        {FM_DTYPE_E2M1, FM_SCALE_MX32},
};
#define NRQFMTS (int)(sizeof rq_fmts / sizeof rq_fmts[0])

enum { RQ_SCRAMBLED = K_COUNT, RQ_KINDS };
static const char *rq_kind_name(int k) { return k == RQ_SCRAMBLED ? "scrambled" : kind_name[k]; }
static const char *rq_rule_name[] = {"tight", "rowmax", "mx_floor"};

/* Marks the scale entries of real blocks of one stored R x C matrix. */
static void mark_real_entries(unsigned char *mark, int64_t per, fm_scale_mode m, fm_scale_layout sl, int64_t R,
                              int64_t C)
{
    memset(mark, 0, (size_t)(per > 0 ? per : 1));
    int64_t b = fm_scale_mode_block_cols(m), br = fm_scale_mode_block_rows(m);
    for (int64_t r = 0; r < R; r += br)
        for (int64_t c = 0; c < C; c += b)
            mark[fm_scale_offset(m, sl, R, C, r, c)] = 1;
}

/* The quantized input: host and device copies of the same codes and scales. */
/* A re-encoding case's verdict once both backends ran: status_verdict's
 * when it settles it, else the codes, scales and nonfinite count bit for bit. */
/* A poisoned buffer that neither backend wrote: the host side still all
 * buf_poison's 0x5A, the device side all 0xA5. */
static int buf_untouched(xv_env *x, const xv_buf *b, const char *what, const char *casename)
{
    if (b->n == 0)
        return 1;
    unsigned char *g = malloc(b->n);
    int ok = g && cuda_ok(x, cudaMemcpy(g, b->d, b->n, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    size_t i = 0;
    while (ok && i < b->n && g[i] == 0xA5 && ((const unsigned char *)b->h)[i] == 0x5A)
        i++;
    free(g);
    if (ok && i < b->n && x->printed++ < 20)
        fprintf(stderr, "FAIL %s: a refused call wrote %s byte %zu\n", casename, what, i);
    return ok && i == b->n;
}

static int rq_verdict(xv_env *x, const char *name, fm_status stc, const char *cmsg, fm_status stg, xv_qout *out,
                      xv_buf *nonf)
{
    if (stc == FM_ERR_INVALID_ARG && stg == FM_ERR_INVALID_ARG) {
        /* Refused alike (e.g. scrambled scales that are not powers of two,
         * which CUDA reports at the synchronize): the same sentence, and
         * nothing written on either side. */
        int ok = !strcmp(cmsg, fm_last_error(x->gpu));
        if (!ok && x->printed++ < 20)
            fprintf(stderr, "FAIL %s: refused with other sentences: cpu '%s', gpu '%s'\n", name, cmsg,
                    fm_last_error(x->gpu));
        ok &= buf_untouched(x, &out->data, "codes", name) & buf_untouched(x, &out->scale, "scales", name) &
              buf_untouched(x, nonf, "nonfinite_blocks", name);
        return ok ? 0 : 1;
    }
    int res = status_verdict(x, name, stc, cmsg, stg);
    if (res >= 0)
        return res;
    return (buf_same(x, &out->data, "codes", name) & buf_same(x, &out->scale, "scales", name) &
            buf_same(x, nonf, "nonfinite_blocks", name))
               ? 0
               : 1;
}

static int rq_make_input(xv_env *x, xv_qout *q, const xv_shape *s, const xv_qcfg *c, fm_layout lay, int kind)
{
    if (!qout_setup(x, q, s, c, lay))
        return 0;
    int64_t n = s->E * s->rows * s->cols;
    fm_dtype src_t = (rnd(x) & 1) ? FM_DTYPE_F32 : FM_DTYPE_BF16;
    xv_buf src = {0};
    if (!(src.h = malloc((size_t)(n > 0 ? n : 1) * (size_t)dtype_bytes(src_t))))
        return 0;
    gen_input(x, src.h, src_t, s->E, s->rows, s->cols, kind == RQ_SCRAMBLED ? K_RANDOM : kind);
    fm_tensor sh = make_tensor(s, src.h, src_t, FM_DEVICE_HOST);
    fm_quant_config qc = {.rule = c->rule};
    fm_status st = fm_quantize(x->cpu, &qc, &sh, lay == FM_LAYOUT_ROWWISE ? &q->th : NULL,
                               lay == FM_LAYOUT_COLWISE ? &q->th : NULL);
    free(src.h);
    if (st != FM_OK)
        return 0;
    if (kind == RQ_SCRAMBLED) {
        uint8_t *d = q->data.h;
        for (size_t i = 0; i < q->data.n; i++)
            if (rnd(x) & 1)
                d[i] = (uint8_t)rnd(x);
        /* One 32-byte run in 16 keeps only subnormal magnitudes (signs
         * kept): blocks whose largest code is tiny, where the conversions
         * take their largest shifts (an E5M2 block of subnormals, up to
         * 2^18, is past the row conversion's E2M1 encoder). */
        const uint8_t sub = c->elem == FM_DTYPE_E4M3 ? 0x87 : c->elem == FM_DTYPE_E5M2 ? 0x83 : 0x99;
        for (size_t i = 0; i + 32 <= q->data.n; i += 32)
            if (rnd(x) % 16 == 0)
                for (size_t j = i; j < i + 32; j++)
                    d[j] &= sub;
        int64_t E = fm_tensor_experts(&q->th), R = fm_tensor_stored_rows(&q->th), C = fm_tensor_stored_cols(&q->th);
        int64_t per = fm_scale_count_2d(c->mode, c->sl, R, C);
        if (q->th.scale_dtype == FM_DTYPE_E8M0) {
            uint8_t *sc = q->scale.h;
            for (size_t i = 0; i < q->scale.n; i++) {
                uint64_t r = rnd(x) % 32;
                sc[i] = r == 0 ? 0xFF : r == 1 ? 0 : r == 2 ? 254 : r < 12 ? (uint8_t)rnd(x) : (uint8_t)(127 + rndi(x, -12, 12));
            }
        } else {
            unsigned char *mark = malloc((size_t)(per > 0 ? per : 1));
            if (!mark)
                return 0;
            mark_real_entries(mark, per, c->mode, c->sl, R, C);
            float *sc = q->scale.h;
            for (int64_t e = 0; e < E; e++)
                for (int64_t k = 0; k < per; k++) {
                    uint64_t r = rnd(x) % 32;
                    float v = r == 0   ? f32_from_bits(0x7FC00000u)
                            : r < 4    ? (float)ldexp(1.0, rndi(x, -149, 127))
                            : r < 6    ? (float)ldexp(1.0, rndi(x, -149, -120))
                            : r < 8    ? (float)ldexp(1.0, rndi(x, 100, 127))
                                       : (float)ldexp(1.0, rndi(x, -12, 12));
                    sc[e * per + k] = mark[k] ? v : 3.0f;
                }
            free(mark);
        }
    }
    return buf_upload(x, &q->data) && buf_upload(x, &q->scale);
}

/* The device side of a scaling-aware call: CUDA reports a bad scale at the
 * next synchronize (transpose.h), with the sentence in fm_last_error. */
static fm_status rq_settle(xv_env *x, const char *name)
{
    fm_status st = fm_context_synchronize(x->gpu);
    if (st != FM_OK && st != FM_ERR_INVALID_ARG && x->printed++ < 20)
        fprintf(stderr, "FAIL %s: synchronize: %s\n", name, fm_last_error(x->gpu));
    return st;
}

/* 0 pass, 1 fail, 2 skip. bad_scales > 0: plant that many non-power-of-two
 * F32 scales and expect both backends to refuse. */
static int rq_case(xv_env *x, const xv_shape *s, int transpose, const xv_qcfg *ic, fm_layout il, const xv_qcfg *oc,
                   fm_requant_rule rule, int kind, int bad_scales, const char *name)
{
    int res = 1;
    xv_qout in, out;
    xv_buf nonf = {0};
    memset(&in, 0, sizeof in);
    memset(&out, 0, sizeof out);
    fm_layout ol = transpose ? (il == FM_LAYOUT_ROWWISE ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE) : il;
    if (!rq_make_input(x, &in, s, ic, il, kind)) {
        res = x->cuda_broken ? 1 : 2; /* a shape the input format cannot hold (E2M1, odd rows) */
        goto done;
    }
    if (bad_scales) {
        int64_t R = fm_tensor_stored_rows(&in.th), C = fm_tensor_stored_cols(&in.th), E = fm_tensor_experts(&in.th);
        int64_t per = fm_scale_count_2d(ic->mode, ic->sl, R, C), nbr = fm_cdiv(C, fm_mode_block_cols(ic->mode));
        if (E * R * nbr == 0 || in.th.scale_dtype != FM_DTYPE_F32) {
            res = 2;
            goto done;
        }
        static const float bads[] = {3.0f, 0.0f, -2.0f, 0.75f, 1.0e-45f * 3.0f, INFINITY, -0.0f, 1.5e30f};
        for (int b = 0; b < bad_scales; b++) {
            int64_t e = rndi(x, 0, (int)E - 1), r = rndi(x, 0, (int)(R - 1)), cb = rndi(x, 0, (int)(nbr - 1));
            float v = bads[rnd(x) % (sizeof bads / sizeof bads[0])];
            ((float *)in.scale.h)[e * per + fm_scale_offset(ic->mode, ic->sl, R, C, r, cb * fm_mode_block_cols(ic->mode))] = v;
        }
        if (!buf_upload(x, &in.scale))
            goto done;
    }
    if (!qout_setup(x, &out, s, oc, ol) || !buf_alloc(x, &nonf, 8) || !buf_poison(x, &nonf))
        goto done;
    /* Valid scales: half the calls vouch for them (the CUDA backend skips its check). */
    const int trust = !bad_scales && (rnd(x) & 1);
    fm_requant_config ch = {.rule = rule, .nonfinite_blocks = nonf.h, .trusted_pow2_scales = trust};
    fm_requant_config cd = {.rule = rule, .nonfinite_blocks = nonf.d, .trusted_pow2_scales = trust};
    fm_status stc = transpose ? fm_transpose_scaled(x->cpu, &ch, &in.th, &out.th) : fm_convert_scaled(x->cpu, &ch, &in.th, &out.th);
    char cmsg[768];
    snprintf(cmsg, sizeof cmsg, "%s", fm_last_error(x->cpu));
    fm_status stg = transpose ? fm_transpose_scaled(x->gpu, &cd, &in.td, &out.td) : fm_convert_scaled(x->gpu, &cd, &in.td, &out.td);
    if (stg == FM_OK)
        stg = rq_settle(x, name);
    /* Planted bad scales: both must refuse over the scale (rq_verdict then
     * wants the same sentence, the same first block, and nothing written). */
    if (bad_scales && (stc != FM_ERR_INVALID_ARG || stg != FM_ERR_INVALID_ARG ||
                       !strstr(cmsg, "not a positive power of two"))) {
        if (x->printed++ < 20)
            fprintf(stderr, "FAIL %s: expected both to refuse the scale: cpu %s (%s) gpu %s (%s)\n", name,
                    fm_status_name(stc), cmsg, fm_status_name(stg), fm_last_error(x->gpu));
        goto done;
    }
    res = rq_verdict(x, name, stc, cmsg, stg, &out, &nonf);
done:
    qout_free(&in);
    qout_free(&out);
    buf_free(&nonf);
    return res;
}

static void rq_run(xv_env *x, xv_counts *cnt, int transpose)
{
    const char *opn = transpose ? "transpose_scaled" : "convert_scaled";
    long serial = 0;
    for (int si = 0; si < NSHAPES && !x->cuda_broken; si++) {
        const xv_shape *s = &shapes[si];
        if (shape_skipped(x, s))
            continue;
        for (int fi = 0; fi < NRQFMTS && !x->cuda_broken; fi++)
            for (int fo = 0; fo < NRQFMTS && !x->cuda_broken; fo++)
                for (int v = 0; v < 4 && !x->cuda_broken; v++) {
                    serial++;
                    if (s->large && serial % 8)
                        continue;
                    if (x->quick && serial % 5)
                        continue;
                    const xv_rqfmt *a = &rq_fmts[fi], *b = &rq_fmts[fo];
                    int same = a->elem == b->elem && a->mode == b->mode;
                    /* Rule: mostly TIGHT; ROWMAX where it applies; MX_FLOOR for MX32 outputs. */
                    fm_requant_rule rule = FM_REQUANT_TIGHT;
                    if (v == 1 && transpose && same)
                        rule = FM_REQUANT_ROWMAX;
                    else if (v == 2 && b->mode == FM_SCALE_MX32)
                        rule = FM_REQUANT_MX_FLOOR;
                    fm_layout il = (serial / 3) % 2 ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE;
                    xv_qcfg ic = {a->elem, a->mode, FM_SCALE_RULE_POW2,
                                  (serial / 5) % 3 == 2 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT};
                    xv_qcfg oc = {b->elem, b->mode, FM_SCALE_RULE_POW2,
                                  (serial / 7) % 3 == 2 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT};
                    int kind = (int)((serial + v) % RQ_KINDS);
                    char sn[64], name[320];
                    shape_name(s, sn, sizeof sn);
                    snprintf(name, sizeof name, "%s %s %s %s %s %s -> %s %s %s rule=%s kind=%s", opn, sn,
                             fm_dtype_name(a->elem), fm_scale_mode_name(a->mode), fm_layout_name(il),
                             fm_scale_layout_name(ic.sl), fm_dtype_name(b->elem), fm_scale_mode_name(b->mode),
                             fm_scale_layout_name(oc.sl), rq_rule_name[rule], rq_kind_name(kind));
                    tally(x, cnt, rq_case(x, s, transpose, &ic, il, &oc, rule, kind, 0, name), name);
                }
        /* BLOCK_128x128: the exact transpose (POW2 and EXACT scales). */
        if (transpose)
            for (int v = 0; v < 4 && !x->cuda_broken; v++) {
                serial++;
                if (x->quick && serial % 3)
                    continue;
                xv_qcfg c = {v & 1 ? FM_DTYPE_E5M2 : FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128,
                             v & 2 ? FM_SCALE_RULE_EXACT : FM_SCALE_RULE_POW2,
                             serial % 2 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT};
                xv_qcfg oc = c;
                oc.sl = (serial / 2) % 2 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
                fm_layout il = v < 2 ? FM_LAYOUT_ROWWISE : FM_LAYOUT_COLWISE;
                int kind = (int)(serial % K_COUNT);
                char sn[64], name[320];
                shape_name(s, sn, sizeof sn);
                snprintf(name, sizeof name, "%s %s %s BLOCK_128x128 %s %s -> %s kind=%s", opn, sn,
                         fm_dtype_name(c.elem), c.rule == FM_SCALE_RULE_EXACT ? "exact" : "pow2",
                         fm_scale_layout_name(c.sl), fm_scale_layout_name(oc.sl), kind_name[kind]);
                tally(x, cnt, rq_case(x, s, 1, &c, il, &oc, FM_REQUANT_TIGHT, kind, 0, name), name);
            }
        /* BLOCK_1x128 -> BLOCK_128x128 under ROWMAX: one scale a tile. */
        if (transpose)
            for (int v = 0; v < 4 && !x->cuda_broken; v++) {
                serial++;
                if ((x->quick || s->large) && serial % 3)
                    continue;
                fm_dtype e = v & 1 ? FM_DTYPE_E5M2 : FM_DTYPE_E4M3;
                xv_qcfg ic = {e, FM_SCALE_BLOCK_1x128, FM_SCALE_RULE_POW2,
                              serial % 2 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT};
                xv_qcfg oc = {e, FM_SCALE_BLOCK_128x128, FM_SCALE_RULE_POW2,
                              (serial / 2) % 2 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT};
                fm_layout il = v < 2 ? FM_LAYOUT_ROWWISE : FM_LAYOUT_COLWISE;
                int kind = (int)(serial % RQ_KINDS);
                char sn[64], name[320];
                shape_name(s, sn, sizeof sn);
                snprintf(name, sizeof name, "%s %s %s BLOCK_1x128 %s %s -> BLOCK_128x128 %s rule=rowmax kind=%s",
                         opn, sn, fm_dtype_name(e), fm_layout_name(il), fm_scale_layout_name(ic.sl),
                         fm_scale_layout_name(oc.sl), rq_kind_name(kind));
                tally(x, cnt, rq_case(x, s, 1, &ic, il, &oc, FM_REQUANT_ROWMAX, kind, 0, name), name);
            }
    }
    /* Non-power-of-two F32 scales: refused by both, before anything is written. */
    static const xv_shape bad_shapes[] = {{1, 130, 300, 2, 0}, {3, 200, 136, 3, 0}, {1, 1, 7, 2, 0}};
    for (int k = 0; k < 6 && !x->cuda_broken; k++) {
        const xv_shape *s = &bad_shapes[k % 3];
        const xv_rqfmt *b = &rq_fmts[k % 4]; /* FP8 outputs: every shape below is valid for them */
        xv_qcfg ic = {k & 1 ? FM_DTYPE_E5M2 : FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_RULE_POW2,
                      k >= 3 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT};
        xv_qcfg oc = {b->elem, b->mode, FM_SCALE_RULE_POW2, FM_SCALE_LAYOUT_COMPACT};
        fm_layout il = k % 2 ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE;
        char sn[64], name[320];
        shape_name(s, sn, sizeof sn);
        snprintf(name, sizeof name, "%s %s %s BLOCK_1x128 %s %s -> %s %s: %d non-pow2 scale(s) refused", opn, sn,
                 fm_dtype_name(ic.elem), fm_scale_layout_name(ic.sl), fm_layout_name(il), fm_dtype_name(b->elem),
                 fm_scale_mode_name(b->mode), 1 + k % 2);
        int r = rq_case(x, s, transpose, &ic, il, &oc, FM_REQUANT_TIGHT, K_RANDOM, 1 + k % 2, name);
        tally(x, cnt, r == 2 ? 1 : r, name); /* these shapes always hold the input: a skip is a failure */
    }
}

static void xv_transpose_scaled(xv_env *x, xv_counts *cnt) { rq_run(x, cnt, 1); }
static void xv_convert_scaled(xv_env *x, xv_counts *cnt) { rq_run(x, cnt, 0); }

/* ---- op: transpose_scaled_grouped -------------------------------------------
 * Ragged splits with empty groups (and groups of 1, 127, 128, 129 rows) of a
 * row-wise input of every kind (scrambled included) in every format pair;
 * codes, the grouped scale arrays (GEMM padding too) and the nonfinite count
 * compared bit for bit; odd E2M1 groups and non-power-of-two scales refused
 * alike. */

/* A grouped transpose's output: the grouped scale array in place of the
 * ungrouped one, poisoned, and the nonfinite count's buffer; 0 on failure. */
static int grouped_out(xv_env *x, xv_qout *out, const fm_splits *sp, xv_buf *nonf)
{
    int64_t ns = fm_tensor_grouped_scale_count(&out->th, sp);
    buf_free(&out->scale);
    if (ns < 0 || !buf_alloc(x, &out->scale, (size_t)ns * (size_t)(fm_dtype_bits(out->th.scale_dtype) / 8)) ||
        !buf_poison(x, &out->scale) || !buf_alloc(x, nonf, 8) || !buf_poison(x, nonf))
        return 0;
    out->th.scale = out->scale.h;
    out->td.scale = out->scale.d;
    return 1;
}

/* refuse: 0 a valid call, 1 plant a non-power-of-two scale, 2 splits the
 * op must refuse as they are; refusals must be alike and write nothing. */
static int rqg_case(xv_env *x, const int64_t *sizes, int64_t G, int64_t N, const xv_qcfg *ic, const xv_qcfg *oc,
                    fm_requant_rule rule, int kind, int refuse, const char *name)
{
    int res = 1;
    int64_t rows = 0;
    for (int64_t g = 0; g < G; g++)
        rows += sizes[g];
    const xv_shape s = {1, rows, N, 2, 0};
    xv_qout in, out;
    xv_buf nonf = {0};
    memset(&in, 0, sizeof in);
    memset(&out, 0, sizeof out);
    fm_splits sp = {.groups = G, .host = sizes};
    if (!rq_make_input(x, &in, &s, ic, FM_LAYOUT_ROWWISE, kind)) {
        res = x->cuda_broken ? 1 : 2;
        goto done;
    }
    if (refuse == 1 && in.th.scale_dtype == FM_DTYPE_F32 && in.scale.n >= 4) {
        int64_t R = fm_tensor_stored_rows(&in.th), C = fm_tensor_stored_cols(&in.th);
        int64_t r = rndi(x, 0, (int)(R - 1)), cb = rndi(x, 0, (int)(fm_cdiv(C, fm_mode_block_cols(ic->mode)) - 1));
        ((float *)in.scale.h)[fm_scale_offset(ic->mode, ic->sl, R, C, r, cb * fm_mode_block_cols(ic->mode))] = 0.75f;
        if (!buf_upload(x, &in.scale))
            goto done;
    }
    if (!qout_setup(x, &out, &s, oc, FM_LAYOUT_COLWISE))
        goto done;
    if (!grouped_out(x, &out, &sp, &nonf))
        goto done;
    const int trust = !refuse && (rnd(x) & 1); /* as in rq_case */
    fm_requant_config ch = {.rule = rule, .nonfinite_blocks = nonf.h, .trusted_pow2_scales = trust};
    fm_requant_config cd = {.rule = rule, .nonfinite_blocks = nonf.d, .trusted_pow2_scales = trust};
    fm_status stc = fm_transpose_scaled_grouped(x->cpu, &ch, &sp, &in.th, &out.th);
    char cmsg[768];
    snprintf(cmsg, sizeof cmsg, "%s", fm_last_error(x->cpu));
    fm_status stg = fm_transpose_scaled_grouped(x->gpu, &cd, &sp, &in.td, &out.td);
    if (stg == FM_OK)
        stg = rq_settle(x, name);
    /* Refusals: both must refuse (rq_verdict then wants the same sentence
     * and nothing written). */
    if (refuse && (stc != FM_ERR_INVALID_ARG || stg != FM_ERR_INVALID_ARG)) {
        if (x->printed++ < 20)
            fprintf(stderr, "FAIL %s: expected both to refuse: cpu %s (%s) gpu %s (%s)\n", name,
                    fm_status_name(stc), cmsg, fm_status_name(stg), fm_last_error(x->gpu));
        goto done;
    }
    res = rq_verdict(x, name, stc, cmsg, stg, &out, &nonf);
done:
    qout_free(&in);
    qout_free(&out);
    buf_free(&nonf);
    return res;
}

static void xv_transpose_scaled_grouped(xv_env *x, xv_counts *cnt)
{
    static const int64_t s_edge[] = {0, 1, 127, 128, 129, 0, 300}, s_one[] = {0, 0, 515, 0};
    static const int64_t s_single[] = {1}, s_empty[] = {0, 0};
    static const int64_t Ns[] = {128, 130, 1000, 32, 258, 2};
    /* Variants 6 and 7: every group whole 128-row tiles (the layer's padded experts) and N a
     * multiple of 16, the TMA kernel's grouped case; 6 fixed, 7 random. */
    static const int64_t s_whole[] = {128, 0, 384, 256, 0, 128}, Nw[] = {128, 272, 1024, 32};
    long serial = 0;
    for (int fi = 0; fi < NRQFMTS && !x->cuda_broken; fi++)
        for (int fo = 0; fo < NRQFMTS && !x->cuda_broken; fo++)
            for (int v = 0; v < 8 && !x->cuda_broken; v++) {
                serial++;
                if (x->quick && serial % 3)
                    continue;
                const xv_rqfmt *a = &rq_fmts[fi], *b = &rq_fmts[fo];
                const int e2m1_out = b->elem == FM_DTYPE_E2M1;
                int64_t sz[12], G;
                const int64_t *src = v == 0   ? s_edge
                                     : v == 1 ? s_one
                                     : v == 2 ? s_single
                                     : v == 3 ? s_empty
                                     : v == 6 ? s_whole
                                              : NULL;
                G = v == 0 ? 7 : v == 1 ? 4 : v == 2 ? 1 : v == 3 ? 2 : v == 6 ? 6 : 12;
                for (int64_t g = 0; g < G; g++) {
                    sz[g] = src      ? src[g]
                            : v == 7 ? 128 * (rnd(x) % 4 == 0 ? 0 : rndi(x, 1, 8))
                                     : (rnd(x) % 4 == 0 ? 0 : rndi(x, 1, v == 5 ? 2000 : 300));
                    if (e2m1_out)
                        sz[g] += sz[g] & 1; /* odd groups are refused for E2M1 outputs: see below */
                }
                int64_t N = v >= 6 ? Nw[serial % 4] : Ns[serial % 6];
                if (a->elem == FM_DTYPE_E2M1 && (N & 1))
                    N++;
                int same = a->elem == b->elem && a->mode == b->mode;
                fm_requant_rule rule = FM_REQUANT_TIGHT;
                if (serial % 3 == 1 && same)
                    rule = FM_REQUANT_ROWMAX;
                else if (serial % 3 == 2 && b->mode == FM_SCALE_MX32)
                    rule = FM_REQUANT_MX_FLOOR;
                xv_qcfg ic = {a->elem, a->mode, FM_SCALE_RULE_POW2,
                              (serial / 2) % 2 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT};
                xv_qcfg oc = {b->elem, b->mode, FM_SCALE_RULE_POW2,
                              (serial / 4) % 2 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT};
                int kind = (int)(serial % RQ_KINDS);
                char name[320];
                int n = snprintf(name, sizeof name, "transpose_scaled_grouped N=%lld %s %s %s -> %s %s %s rule=%s "
                                 "kind=%s splits", (long long)N, fm_dtype_name(a->elem), fm_scale_mode_name(a->mode),
                                 fm_scale_layout_name(ic.sl), fm_dtype_name(b->elem), fm_scale_mode_name(b->mode),
                                 fm_scale_layout_name(oc.sl), rq_rule_name[rule], rq_kind_name(kind));
                for (int64_t g = 0; g < G && n < (int)sizeof name - 8; g++)
                    n += snprintf(name + n, sizeof name - (size_t)n, " %lld", (long long)sz[g]);
                tally(x, cnt, rqg_case(x, sz, G, N, &ic, &oc, rule, kind, 0, name), name);
            }
    /* ROWMAX into one scale per 128 x 128 tile of each group (the flow
     * recipes' x and h for the weight gradients); v % 4 == 2: whole 128-row
     * tiles in every group and N a multiple of 16 (the layer's h, the TMA
     * kernel's grouped case). */
    for (int v = 0; v < 12 && !x->cuda_broken; v++) {
        serial++;
        if (x->quick && v % 3)
            continue;
        fm_dtype e = v & 1 ? FM_DTYPE_E5M2 : FM_DTYPE_E4M3;
        int64_t sz[12], G = v % 4 == 0 ? 7 : 12;
        for (int64_t g = 0; g < G; g++)
            sz[g] = v % 4 == 0   ? s_edge[g]
                    : v % 4 == 2 ? 128 * (rnd(x) % 4 == 0 ? 0 : rndi(x, 1, 8))
                                 : (rnd(x) % 4 == 0 ? 0 : rndi(x, 1, v % 4 == 3 ? 2000 : 300));
        int64_t N = v % 4 == 2 ? Nw[serial % 4] : Ns[serial % 5];
        xv_qcfg ic = {e, FM_SCALE_BLOCK_1x128, FM_SCALE_RULE_POW2,
                      (v / 2) % 2 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT};
        xv_qcfg oc = {e, FM_SCALE_BLOCK_128x128, FM_SCALE_RULE_POW2,
                      (v / 4) % 2 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT};
        int kind = (int)(serial % RQ_KINDS);
        char name[320];
        int n = snprintf(name, sizeof name, "transpose_scaled_grouped N=%lld %s BLOCK_1x128 %s -> BLOCK_128x128 %s "
                         "rule=rowmax kind=%s splits", (long long)N, fm_dtype_name(e), fm_scale_layout_name(ic.sl),
                         fm_scale_layout_name(oc.sl), rq_kind_name(kind));
        for (int64_t g = 0; g < G && n < (int)sizeof name - 8; g++)
            n += snprintf(name + n, sizeof name - (size_t)n, " %lld", (long long)sz[g]);
        tally(x, cnt, rqg_case(x, sz, G, N, &ic, &oc, FM_REQUANT_ROWMAX, kind, 0, name), name);
    }
    /* Refusals: a non-power-of-two F32 scale, and an odd group for an E2M1 output. */
    static const int64_t s_bad[] = {100, 0, 157}, s_odd[] = {100, 3, 157};
    for (int k = 0; k < 4 && !x->cuda_broken; k++) {
        const xv_rqfmt *a = &rq_fmts[k % 2], *b = k < 2 ? a : &rq_fmts[4];
        xv_qcfg ic = {a->elem, a->mode, FM_SCALE_RULE_POW2, k & 1 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT};
        xv_qcfg oc = {b->elem, b->mode, FM_SCALE_RULE_POW2, FM_SCALE_LAYOUT_COMPACT};
        char name[200];
        snprintf(name, sizeof name, "transpose_scaled_grouped %s refused alike",
                 k < 2 ? "non-pow2 scale" : "odd E2M1 group");
        int r = rqg_case(x, k < 2 ? s_bad : s_odd, 3, 256, &ic, &oc, FM_REQUANT_TIGHT, K_RANDOM, k < 2 ? 1 : 2, name);
        tally(x, cnt, r == 2 ? 1 : r, name);
    }
}

/* ---- op: transpose_scaled_grouped_rows --------------------------------------
 * The grouped transpose of rows read through a row map: T token rows of an
 * FP8 input of every kind, a random map over R rows (repeats, -1 and
 * out-of-range entries: padding), ragged groups; FP8 outputs in every rule
 * (what the CUDA kernel writes). Bit for bit, as transpose_scaled_grouped. */
static int rqr_case(xv_env *x, int64_t T, int k, const int64_t *sizes, int64_t G, int64_t N, const xv_qcfg *ic,
                    const xv_qcfg *oc, fm_requant_rule rule, int kind, const char *name)
{
    int res = 1;
    int64_t R = 0;
    for (int64_t g = 0; g < G; g++)
        R += sizes[g];
    const xv_shape si = {1, T, N, 2, 0}, so = {1, R, N, 2, 0};
    xv_qout in, out;
    xv_buf nonf = {0}, rm = {0};
    memset(&in, 0, sizeof in);
    memset(&out, 0, sizeof out);
    fm_splits sp = {.groups = G, .host = sizes};
    if (!rq_make_input(x, &in, &si, ic, FM_LAYOUT_ROWWISE, kind)) {
        res = x->cuda_broken ? 1 : 2;
        goto done;
    }
    if (!qout_setup(x, &out, &so, oc, FM_LAYOUT_COLWISE) || !buf_alloc(x, &rm, (size_t)(R > 0 ? R : 1) * 4))
        goto done;
    for (int64_t r = 0; r < R; r++) {
        const int u = rndi(x, 0, 9);
        ((int32_t *)rm.h)[r] = u == 0 ? -1 : u == 1 ? (int32_t)(T * k + rndi(x, 0, 5)) : (int32_t)rndi(x, 0, (int)(T * k - 1));
    }
    if (!buf_upload(x, &rm))
        goto done;
    if (!grouped_out(x, &out, &sp, &nonf))
        goto done;
    fm_tensor mh = fm_tensor_2d(rm.h, FM_DTYPE_I32, R, 1), md = fm_tensor_2d(rm.d, FM_DTYPE_I32, R, 1);
    md.device = FM_DEVICE_CUDA;
    const int trust = rnd(x) & 1;
    fm_requant_config ch = {.rule = rule, .nonfinite_blocks = nonf.h, .trusted_pow2_scales = trust};
    fm_requant_config cd = {.rule = rule, .nonfinite_blocks = nonf.d, .trusted_pow2_scales = trust};
    fm_status stc = fm_transpose_scaled_grouped_rows(x->cpu, &ch, &sp, &in.th, &mh, k, &out.th);
    char cmsg[768];
    snprintf(cmsg, sizeof cmsg, "%s", fm_last_error(x->cpu));
    fm_status stg = fm_transpose_scaled_grouped_rows(x->gpu, &cd, &sp, &in.td, &md, k, &out.td);
    if (stg == FM_OK)
        stg = rq_settle(x, name);
    res = rq_verdict(x, name, stc, cmsg, stg, &out, &nonf);
done:
    qout_free(&in);
    qout_free(&out);
    buf_free(&nonf);
    buf_free(&rm);
    return res;
}

static void xv_transpose_scaled_grouped_rows(xv_env *x, xv_counts *cnt)
{
    static const int64_t Ns[] = {128, 272, 1024, 16, 7168};
    for (int v = 0; v < 40 && !x->cuda_broken; v++) {
        if (x->quick && v % 3)
            continue;
        const xv_rqfmt *a = &rq_fmts[v % 4], *b = &rq_fmts[(v / 4) % 4]; /* the FP8 formats */
        const int tile = v % 5 == 4 && a->mode == FM_SCALE_BLOCK_1x128;
        fm_requant_rule rule = tile ? FM_REQUANT_ROWMAX : FM_REQUANT_TIGHT;
        if (!tile && v % 3 == 1 && a->elem == b->elem && a->mode == b->mode)
            rule = FM_REQUANT_ROWMAX;
        else if (!tile && v % 3 == 2 && b->mode == FM_SCALE_MX32)
            rule = FM_REQUANT_MX_FLOOR;
        const int64_t N = v % 10 == 9 ? Ns[4] : Ns[v % 4], T = rndi(x, 1, N > 1024 ? 300 : 700);
        const int k = rndi(x, 1, 8);
        int64_t sz[12];
        const int64_t G = rndi(x, 1, 12);
        for (int64_t g = 0; g < G; g++)
            sz[g] = rnd(x) % 4 == 0 ? 0 : rndi(x, 1, N > 1024 ? 200 : 400);
        xv_qcfg ic = {a->elem, a->mode, FM_SCALE_RULE_POW2, FM_SCALE_LAYOUT_COMPACT};
        xv_qcfg oc = {tile ? a->elem : b->elem, tile ? FM_SCALE_BLOCK_128x128 : b->mode, FM_SCALE_RULE_POW2,
                      v % 2 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT};
        int kind = v % RQ_KINDS;
        char name[320];
        int n = snprintf(name, sizeof name, "transpose_scaled_grouped_rows T=%lld k=%d N=%lld %s %s -> %s %s %s rule=%s "
                         "kind=%s splits", (long long)T, k, (long long)N, fm_dtype_name(ic.elem),
                         fm_scale_mode_name(ic.mode), fm_dtype_name(oc.elem), fm_scale_mode_name(oc.mode),
                         fm_scale_layout_name(oc.sl), rq_rule_name[rule], rq_kind_name(kind));
        for (int64_t g = 0; g < G && n < (int)sizeof name - 8; g++)
            n += snprintf(name + n, sizeof name - (size_t)n, " %lld", (long long)sz[g]);
        tally(x, cnt, rqr_case(x, T, k, sz, G, N, &ic, &oc, rule, kind, name), name);
    }
}

/* ---- GEMMs: CUDA within the DESIGN.md tolerance of the CPU reference (see gm_compare) */

/* Random FP8 operands, random F32 scales, random BF16/F32 values. FP8 data
 * of two kinds: `wide`, codes uniform over every finite code (magnitudes
 * 2^-9 .. 448 for E4M3, 2^-16 .. 57344 for E5M2, so that a few products
 * dominate each dot), or normal values quantized (activation-like: most
 * codes within a few binades of the top). */
static void gm_fill(xv_env *x, xv_buf *b, fm_dtype t, int wide)
{
    uint8_t *p = b->h;
    for (size_t i = 0; i < b->n; i += (size_t)dtype_bytes(t)) {
        if (t == FM_DTYPE_E4M3 && !wide)
            p[i] = fm_e4m3_from_f32((float)(rndn(x) * 64.0));
        else if (t == FM_DTYPE_E5M2 && !wide)
            p[i] = fm_e5m2_from_f32((float)(rndn(x) * 8192.0));
        else if (t == FM_DTYPE_E4M3)
            p[i] = (uint8_t)((rnd(x) % 0x7F) | (rnd(x) & 0x80));
        else if (t == FM_DTYPE_E5M2)
            p[i] = (uint8_t)((rnd(x) % 0x7C) | (rnd(x) & 0x80));
        else {
            float f = (float)((rndu(x) * 2 - 1) * 4);
            if (t == FM_DTYPE_BF16) {
                uint16_t h = fm_bf16_from_f32(f);
                memcpy(p + i, &h, 2);
            } else {
                memcpy(p + i, &f, 4);
            }
        }
    }
}

static void gm_fill_scales(xv_env *x, xv_buf *b)
{
    float *s = b->h;
    for (size_t i = 0; i < b->n / 4; i++)
        s[i] = ldexpf((float)(0.5 + rndu(x)), rndi(x, -8, 8));
}

static double gm_val(const void *p, fm_dtype t, size_t i)
{
    return t == FM_DTYPE_BF16 ? (double)fm_bf16_to_f32(((const uint16_t *)p)[i]) : (double)((const float *)p)[i];
}

/* Relative Frobenius error of got against ref (n BF16 or F32 values) over
 * the elements finite on both; *class_diff counts those whose class
 * (finite, NaN, +Inf, -Inf) differs between the two. */
static double rel_frob_classes(const void *ref, const void *got, fm_dtype t, size_t n, size_t *class_diff)
{
    double num = 0, den = 0;
    *class_diff = 0;
    for (size_t i = 0; i < n; i++) {
        const double r = gm_val(ref, t, i), v = gm_val(got, t, i);
        if (!isfinite(r) || !isfinite(v)) {
            *class_diff += !(isnan(r) ? isnan(v) : !isnan(v) && r == v);
            continue;
        }
        num += (v - r) * (v - r);
        den += r * r;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The device output against the host one: 0 pass, 1 fail. DESIGN.md's
 * tolerance (5e-3 BF16 output, 5e-4 F32), except F32 outputs of FP8 codes
 * uniform over every finite code (`wide`): 1e-3. There a few products
 * dominate each 128-term block and the tensor cores' own accumulation
 * inside a block (about 14 retained bits on Hopper, per DeepSeek-V3; the
 * promotion to F32 happens between blocks) costs up to 6.9e-4 relative
 * (S10-11, S10-12: 28 seeds, [1 x 16 x 128] with ROW scales), where normal
 * values reach 3.0e-4 and BF16 operands 8.6e-7. A wrong scale or expert
 * errs by O(1). */
static int gm_compare(xv_env *x, const xv_buf *d, fm_dtype t, const char *name, int wide)
{
    void *g = malloc(d->n ? d->n : 1);
    if (!g || !cuda_ok(x, cudaMemcpy(g, d->d, d->n, cudaMemcpyDeviceToHost), "cudaMemcpy D2H")) {
        free(g);
        return 1;
    }
    size_t class_diff;
    const double rel = rel_frob_classes(d->h, g, t, d->n / (size_t)dtype_bytes(t), &class_diff);
    const double tol = t == FM_DTYPE_BF16 ? 5e-3 : wide ? 1e-3 : 5e-4;
    free(g);
    if (x->verbose)
        printf("  %s: relative Frobenius error %.3g (tolerance %.0e)\n", name, rel, tol);
    if (rel <= tol && class_diff == 0)
        return 0;
    if (x->printed++ < 20)
        fprintf(stderr, "FAIL %s: relative Frobenius error %.3g (tolerance %.0e), %zu elements non-finite on one side "
                        "or differently\n", name, rel, tol, class_diff);
    return 1;
}

/* The operand pairs both backends take (BLK128x128 x BLK128x128 is CPU only). */
static const struct {
    fm_dtype a, b;
    fm_scale_mode ma, mb;
} gm_pairs[] = {
    {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_SCALE_TENSOR},
    {FM_DTYPE_E4M3, FM_DTYPE_E5M2, FM_SCALE_ROW, FM_SCALE_ROW},
    {FM_DTYPE_E5M2, FM_DTYPE_E4M3, FM_SCALE_ROW, FM_SCALE_ROW},
    {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128},
    {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_1x128},
    {FM_DTYPE_BF16, FM_DTYPE_BF16, FM_SCALE_NONE, FM_SCALE_NONE},
    {FM_DTYPE_F32, FM_DTYPE_F32, FM_SCALE_NONE, FM_SCALE_NONE},
};
#define GM_NPAIRS (int)(sizeof gm_pairs / sizeof gm_pairs[0])

/* One operand: host and device buffers with the same contents. */
typedef struct {
    xv_buf data, scale;
    fm_tensor h, d;
} gm_op;

static int gm_op_make(xv_env *x, gm_op *o, fm_tensor proto, int64_t nscale, int wide)
{
    memset(o, 0, sizeof *o);
    if (!buf_alloc(x, &o->data, (size_t)fm_tensor_nbytes(&proto)) ||
        !buf_alloc(x, &o->scale, (size_t)(nscale > 0 ? nscale : 0) * 4))
        return 0;
    gm_fill(x, &o->data, proto.dtype, wide);
    gm_fill_scales(x, &o->scale);
    o->h = o->d = proto;
    o->h.data = o->data.h;
    o->d.data = o->data.d;
    o->d.device = FM_DEVICE_CUDA;
    if (proto.scale_mode) {
        o->h.scale = o->scale.h;
        o->d.scale = o->scale.d;
    }
    return buf_upload(x, &o->data) && buf_upload(x, &o->scale);
}

static void gm_op_free(gm_op *o)
{
    buf_free(&o->data);
    buf_free(&o->scale);
}

static fm_tensor gm_desc(fm_dtype t, fm_scale_mode m, fm_scale_layout sl, fm_layout lay, int64_t e, int64_t r,
                         int64_t c)
{
    fm_tensor d = e > 0 ? fm_tensor_3d(NULL, t, e, r, c) : fm_tensor_2d(NULL, t, r, c);
    d.layout = lay;
    d.scale_mode = m;
    d.scale_dtype = FM_DTYPE_F32;
    d.scale_layout = sl;
    return d;
}

enum { GM_DENSE, GM_MGROUPED, GM_KGROUPED };

/* Shapes every cuBLASLt FP8 mode takes on Hopper: M, N, K and every group
 * size multiples of 128. The CUDA backend may answer FM_ERR_UNSUPPORTED for
 * other shapes (cuBLASLt has no kernel for them), never for these. */
static int gm_aligned(int64_t M, int64_t N, int64_t K, int64_t E, const int64_t *splits)
{
    if (M % 128 || N % 128 || K % 128)
        return 0;
    for (int64_t e = 0; splits && e < E; e++)
        if (splits[e] % 128)
            return 0;
    return 1;
}

/* One case of `form`: 0 pass, 1 fail, 2 skip (both refused alike). */
static int gm_case(xv_env *x, int form, int pi, int64_t M, int64_t N, int64_t K, int64_t E, const int64_t *splits,
                   fm_dtype out, int acc, fm_gemm_impl impl, const char *name0)
{
    fm_scale_layout sl = rnd(x) & 1 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
    int fp8 = gm_pairs[pi].ma != FM_SCALE_NONE, wide = fp8 && (rnd(x) & 1);
    char name[320];
    snprintf(name, sizeof name, "%s%s", name0, !fp8 ? "" : wide ? ", codes uniform" : ", values normal");
    gm_op A, B;
    fm_tensor ta, tb, td;
    int64_t nsa = 0, nsb = 0;
    fm_layout la = fp8 ? FM_LAYOUT_ROWWISE : (fm_layout)(rnd(x) & 1);
    fm_layout lb = form == GM_MGROUPED || fp8 ? FM_LAYOUT_ROWWISE : (fm_layout)(rnd(x) & 1);
    if (form == GM_KGROUPED) { /* dy [sum M, M], x [sum M, N] grouped column-wise; K = sum M */
        la = lb = fp8 ? FM_LAYOUT_COLWISE : la;
        ta = gm_desc(gm_pairs[pi].a, gm_pairs[pi].ma, sl, la, 0, K, M);
        tb = gm_desc(gm_pairs[pi].b, gm_pairs[pi].mb, sl, lb, 0, K, N);
        for (int64_t e = 0; fp8 && e < E; e++) {
            nsa += fm_scale_count_2d(FM_SCALE_BLOCK_1x128, sl, M, splits[e]);
            nsb += fm_scale_count_2d(gm_pairs[pi].mb, sl, N, splits[e]);
        }
        td = gm_desc(out, FM_SCALE_NONE, FM_SCALE_LAYOUT_COMPACT, FM_LAYOUT_ROWWISE, E, M, N);
    } else {
        ta = gm_desc(gm_pairs[pi].a, gm_pairs[pi].ma, sl, la, 0, M, K);
        tb = gm_desc(gm_pairs[pi].b, gm_pairs[pi].mb, sl, lb, form == GM_MGROUPED ? E : 0, N, K);
        nsa = fm_tensor_scale_count(&ta);
        nsb = fm_tensor_scale_count(&tb);
        td = gm_desc(out, FM_SCALE_NONE, FM_SCALE_LAYOUT_COMPACT, FM_LAYOUT_ROWWISE, 0, M, N);
    }
    xv_buf D;
    int r = 1;
    if (!gm_op_make(x, &A, ta, nsa, wide) || !gm_op_make(x, &B, tb, nsb, wide) ||
        !buf_alloc(x, &D, (size_t)fm_tensor_nbytes(&td)))
        goto done;
    gm_fill(x, &D, out, 0);
    if (!buf_upload(x, &D))
        goto done;
    fm_tensor dh = td, dd = td;
    dh.data = D.h;
    dd.data = D.d;
    dd.device = FM_DEVICE_CUDA;
    fm_gemm_config cfg = {.accumulate = acc, .impl = impl};
    fm_splits sp = {.groups = E, .host = splits};
    fm_status stc, stg;
    if (form == GM_DENSE) {
        stc = fm_gemm(x->cpu, &cfg, &A.h, &B.h, &dh);
        stg = fm_gemm(x->gpu, &cfg, &A.d, &B.d, &dd);
    } else if (form == GM_MGROUPED) {
        stc = fm_grouped_gemm(x->cpu, &cfg, &sp, &A.h, &B.h, &dh);
        stg = fm_grouped_gemm(x->gpu, &cfg, &sp, &A.d, &B.d, &dd);
    } else {
        stc = fm_grouped_gemm_wgrad(x->cpu, &cfg, &sp, &A.h, &B.h, &dh);
        stg = fm_grouped_gemm_wgrad(x->gpu, &cfg, &sp, &A.d, &B.d, &dd);
    }
    char cmsg[256];
    snprintf(cmsg, sizeof cmsg, "%s", fm_last_error(x->cpu));
    if (stc == FM_OK && stg == FM_ERR_UNSUPPORTED && strstr(fm_last_error(x->gpu), "cuBLASLt") &&
        !gm_aligned(M, N, K, E, form == GM_DENSE ? NULL : splits)) {
        /* cuBLASLt has no FP8 kernel for this shape on this GPU: the CUDA
         * backend says so (a skip, not a pass); aligned shapes must run. */
        if (x->verbose)
            printf("  skip %s: %s\n", name, fm_last_error(x->gpu));
        r = 2;
        goto done;
    }
    r = status_verdict(x, name, stc, cmsg, stg);
    if (r == -1)
        r = cuda_ok(x, cudaDeviceSynchronize(), name) ? gm_compare(x, &D, out, name, wide) : 1;
done:
    gm_op_free(&A);
    gm_op_free(&B);
    buf_free(&D);
    return r;
}

static const int64_t gm_shapes[][3] = {{1, 16, 128}, {37, 19, 256}, {130, 257, 384}, {256, 512, 1024}, {7, 200, 48}};

static void xv_gemm(xv_env *x, xv_counts *cnt)
{
    int ns = x->quick ? 3 : (int)(sizeof gm_shapes / sizeof gm_shapes[0]);
    for (int pi = 0; pi < GM_NPAIRS; pi++)
        for (int s = 0; s < ns; s++)
            for (int o = 0; o < 3; o++) {
                fm_dtype out = o == 0 ? FM_DTYPE_BF16 : FM_DTYPE_F32;
                char name[200];
                snprintf(name, sizeof name, "gemm %s(%s) x %s(%s) [%lld x %lld x %lld] -> %s%s",
                         fm_dtype_name(gm_pairs[pi].a), fm_scale_mode_name(gm_pairs[pi].ma),
                         fm_dtype_name(gm_pairs[pi].b), fm_scale_mode_name(gm_pairs[pi].mb),
                         (long long)gm_shapes[s][0], (long long)gm_shapes[s][1], (long long)gm_shapes[s][2],
                         fm_dtype_name(out), o == 2 ? " accumulate" : "");
                tally(x, cnt, gm_case(x, GM_DENSE, pi, gm_shapes[s][0], gm_shapes[s][1], gm_shapes[s][2], 0, NULL,
                                      out, o == 2, FM_GEMM_IMPL_AUTO, name), name);
            }
}

/* Ragged splits with empty experts; multiples of 16 where `fp8k` (cuBLASLt's
 * FP8 K) asks for it. */
static int64_t gm_splits(xv_env *x, int64_t *s, int64_t E, int fp8k)
{
    int64_t S = 0;
    for (int64_t e = 0; e < E; e++) {
        s[e] = rndi(x, 0, 3) == 0 ? 0 : rndi(x, 1, 300);
        if (fp8k)
            s[e] = s[e] / 16 * 16;
        S += s[e];
    }
    return S;
}

static void xv_grouped_gemm(xv_env *x, xv_counts *cnt)
{
    int reps = x->quick ? 1 : 3;
    for (int pi = 0; pi < GM_NPAIRS; pi++)
        for (int rep = 0; rep < reps; rep++) {
            int64_t s[8], E = rndi(x, 1, 8), S = gm_splits(x, s, E, 0), N = 16 * rndi(x, 1, 20), K = 16 * rndi(x, 1, 40);
            fm_dtype out = rep % 2 ? FM_DTYPE_F32 : FM_DTYPE_BF16;
            char name[200];
            snprintf(name, sizeof name, "grouped_gemm %s(%s) x %s(%s) E %lld sum M %lld N %lld K %lld -> %s",
                     fm_dtype_name(gm_pairs[pi].a), fm_scale_mode_name(gm_pairs[pi].ma), fm_dtype_name(gm_pairs[pi].b),
                     fm_scale_mode_name(gm_pairs[pi].mb), (long long)E, (long long)S, (long long)N, (long long)K,
                     fm_dtype_name(out));
            tally(x, cnt, gm_case(x, GM_MGROUPED, pi, S, N, K, E, s, out, 0, FM_GEMM_IMPL_AUTO, name), name);
        }
}

/* The four operand kinds through AUTO, and the native k-grouped kernel
 * (cfg->impl NATIVE) on the one it takes, with dW's rows whole 16-byte
 * pieces as it needs them (every M_i is a multiple of 16 here). */
static void xv_grouped_gemm_wgrad(xv_env *x, xv_counts *cnt)
{
    static const int pis[] = {3, 4, 5, 6, 3}; /* dy 1x128 x x 128x128, 1x128 x 1x128, BF16, F32; native */
    int reps = x->quick ? 1 : 3;
    for (int k = 0; k < 5; k++)
        for (int rep = 0; rep < reps; rep++) {
            int pi = pis[k], fp8 = gm_pairs[pi].ma != FM_SCALE_NONE, native = k == 4;
            int64_t s[8], E = rndi(x, 1, 8), S = gm_splits(x, s, E, fp8), N = rndi(x, 1, 300), M = rndi(x, 1, 200);
            if (native)
                N = 8 * rndi(x, 1, 40);
            fm_dtype out = rep % 2 ? FM_DTYPE_BF16 : FM_DTYPE_F32;
            char name[200];
            snprintf(name, sizeof name, "grouped_gemm_wgrad %s(%s) x %s(%s) E %lld sum M %lld -> [%lld, %lld] %s%s",
                     fm_dtype_name(gm_pairs[pi].a), fm_scale_mode_name(gm_pairs[pi].ma), fm_dtype_name(gm_pairs[pi].b),
                     fm_scale_mode_name(gm_pairs[pi].mb), (long long)E, (long long)S, (long long)M, (long long)N,
                     fm_dtype_name(out), native ? " [native]" : "");
            tally(x, cnt,
                  gm_case(x, GM_KGROUPED, pi, M, N, S, E, s, out, out == FM_DTYPE_F32,
                          native ? FM_GEMM_IMPL_NATIVE : FM_GEMM_IMPL_AUTO, name),
                  name);
        }
}

/* ---- MoE ops: router, permute, unpermute, SwiGLU ----------------------------
 * Exact by contract, so every output (codes, scales, maps, splits, the
 * probabilities, amax and the nonfinite count) is compared bit for bit. Inputs
 * are fresh random data of several kinds (unit-range values, the nasty kinds
 * above, NaN / Inf / tied router logits), routings random, skewed (empty
 * experts) and all-to-one-expert; every output starts poisoned differently on
 * each side. */

enum { MT_UNIT = RQ_KINDS }; /* uniform in [-2, 2]: the values activations have */

static void mt_fill(xv_env *x, void *h, fm_dtype t, int64_t n, int kind)
{
    if (kind != MT_UNIT) {
        gen_input(x, h, t, 1, n, 1, kind);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        float v = (float)(rndu(x) * 4 - 2);
        if (t == FM_DTYPE_F32)
            ((float *)h)[i] = v;
        else
            ((uint16_t *)h)[i] = fm_bf16_from_f32(v);
    }
}

static fm_tensor mt_desc(fm_dtype t, fm_scale_mode m, int64_t rows, int64_t cols, fm_layout lay)
{
    if (m == FM_SCALE_NONE)
        return fm_tensor_2d(NULL, t, rows, cols);
    return fm_tensor_quant_2d(NULL, t, rows, cols, lay, m, NULL, FM_SCALE_LAYOUT_COMPACT);
}

/* A tensor of any descriptor on both sides. kind < 0: an output, poisoned.
 * Otherwise an input with the same bytes on both sides: unscaled F32/BF16
 * values of that kind, index tensors random bytes (overwritten by the caller),
 * and quantized rows either fm_quantize'd on the CPU from values of that kind
 * or, for RQ_SCRAMBLED, random codes and scale bytes (for the ops that move
 * them without decoding). */
static int mt_make(xv_env *x, xv_qout *o, fm_tensor proto, int kind)
{
    memset(o, 0, sizeof *o);
    o->th = proto;
    o->th.device = FM_DEVICE_HOST;
    int64_t nb = fm_tensor_nbytes(&proto), ns = proto.scale_mode ? fm_tensor_scale_nbytes(&proto) : 0;
    if (nb < 0 || ns < 0 || !buf_alloc(x, &o->data, (size_t)nb) || !buf_alloc(x, &o->scale, (size_t)ns) ||
        !buf_poison(x, &o->data) || !buf_poison(x, &o->scale))
        return 0;
    o->th.data = o->data.h;
    o->th.scale = proto.scale_mode ? o->scale.h : NULL;
    o->td = o->th;
    o->td.device = FM_DEVICE_CUDA;
    o->td.data = o->data.d;
    o->td.scale = proto.scale_mode ? o->scale.d : NULL;
    if (kind < 0)
        return 1;
    int64_t n = fm_tensor_numel(&proto);
    if (proto.scale_mode && kind != RQ_SCRAMBLED) {
        fm_dtype st = rnd(x) & 1 ? FM_DTYPE_F32 : FM_DTYPE_BF16;
        void *src = malloc((size_t)(n > 0 ? n : 1) * (size_t)dtype_bytes(st));
        if (!src)
            return 0;
        mt_fill(x, src, st, n, kind);
        fm_tensor sh = fm_tensor_2d(src, st, proto.shape[0], proto.shape[1]);
        fm_status s = fm_quantize(x->cpu, NULL, &sh, &o->th, NULL);
        free(src);
        if (s != FM_OK)
            return 0;
    } else if (!proto.scale_mode && kind != RQ_SCRAMBLED && (proto.dtype == FM_DTYPE_F32 || proto.dtype == FM_DTYPE_BF16)) {
        mt_fill(x, o->data.h, proto.dtype, n, kind);
    } else {
        for (size_t i = 0; i < o->data.n; i++)
            ((uint8_t *)o->data.h)[i] = (uint8_t)rnd(x);
        for (size_t i = 0; i < o->scale.n; i++)
            ((uint8_t *)o->scale.h)[i] = (uint8_t)rnd(x);
    }
    return buf_upload(x, &o->data) && buf_upload(x, &o->scale);
}

static int mt_same(xv_env *x, const xv_qout *o, const char *what, const char *name)
{
    char sw[96];
    snprintf(sw, sizeof sw, "%s scales", what);
    return buf_same(x, &o->data, what, name) & buf_same(x, &o->scale, sw, name);
}

/* Both backends ran: synchronise, then status_verdict (-1: compare outputs). */
static int mt_verdict(xv_env *x, const char *name, fm_status stc, fm_status stg)
{
    if (stg == FM_OK && !cuda_ok(x, cudaDeviceSynchronize(), name))
        stg = FM_ERR_BACKEND;
    return status_verdict(x, name, stc, fm_last_error(x->cpu), stg);
}

#define MT_H(o, on) ((on) ? &(o).th : NULL)
#define MT_D(o, on) ((on) ? &(o).td : NULL)

/* ---- op: moe_router, moe_router_backward ------------------------------------ */

/* Logits [T, E]; with `nasty`, tokens of ties (a few repeated values, or all
 * equal), NaN, +-Inf (several +Inf: tied too), huge magnitudes, and logits
 * all in [-400, -105] (every sigmoid 0: the renormalised limit). */
static void rt_logits(xv_env *x, float *l, int64_t T, int64_t E, int nasty)
{
    static const float tie[] = {-1.0f, 0.5f, 2.0f};
    for (int64_t t = 0; t < T; t++) {
        float *r = l + t * E;
        int m = nasty ? rndi(x, 0, 8) : 0;
        for (int64_t e = 0; e < E; e++)
            r[e] = m == 1   ? tie[rnd(x) % 3]
                   : m == 2 ? 0.75f
                   : m == 3 ? (float)((rndu(x) * 2 - 1) * 1e30)
                   : m == 8 ? (float)(-105.0 - 295.0 * rndu(x))
                            : (float)((rndu(x) * 2 - 1) * 4);
        int64_t e = rndi(x, 0, (int)E - 1);
        if (m == 4)
            r[e] = NAN;
        else if (m == 5)
            r[e] = r[rndi(x, 0, (int)E - 1)] = INFINITY;
        else if (m == 6)
            r[e] = -INFINITY;
        else if (m == 7)
            for (int64_t j = 0; j < E; j++)
                r[j] = j % 2 ? -INFINITY : r[j];
    }
}

/* bwd: the backward, fed the CPU forward's ids (so it is checked on its own). */
static int rt_case(xv_env *x, int bwd, const fm_router_config *rc, int with_bias, int64_t T, int64_t E, int nasty,
                   int want_count, const char *name)
{
    int res = 1, k = rc->topk;
    xv_qout lg, ids, pr, cnt, dp, dl;
    xv_qout *all[] = {&lg, &ids, &pr, &cnt, &dp, &dl};
    for (int i = 0; i < 6; i++)
        memset(all[i], 0, sizeof *all[i]);
    xv_buf bias = {0};
    if (!mt_make(x, &lg, fm_tensor_2d(NULL, FM_DTYPE_F32, T, E), -1) ||
        !mt_make(x, &ids, fm_tensor_2d(NULL, FM_DTYPE_I32, T, k), -1) ||
        !mt_make(x, &pr, fm_tensor_2d(NULL, FM_DTYPE_F32, T, k), -1) ||
        !mt_make(x, &cnt, fm_tensor_2d(NULL, FM_DTYPE_I64, 1, E), -1) || !buf_alloc(x, &bias, (size_t)E * 4))
        goto done;
    rt_logits(x, lg.data.h, T, E, nasty);
    /* Half the biases on a coarse grid, so that s + bias ties too. */
    int coarse = rnd(x) & 1;
    for (int64_t e = 0; e < E; e++)
        ((float *)bias.h)[e] = coarse ? 0.25f * (float)rndi(x, -2, 2) : (float)((rndu(x) * 2 - 1) * 0.5);
    if (!buf_upload(x, &lg.data) || !buf_upload(x, &bias))
        goto done;
    fm_router_config ch = *rc, cd = *rc;
    if (with_bias) {
        ch.bias = bias.h;
        cd.bias = bias.d;
    }
    fm_status stc, stg;
    if (!bwd) {
        stc = fm_moe_router(x->cpu, &ch, &lg.th, &ids.th, &pr.th, MT_H(cnt, want_count));
        stg = fm_moe_router(x->gpu, &cd, &lg.td, &ids.td, &pr.td, MT_D(cnt, want_count));
        if ((res = mt_verdict(x, name, stc, stg)) >= 0)
            goto done;
        res = (buf_same(x, &ids.data, "expert_ids", name) & buf_same(x, &pr.data, "probs", name) &
               (want_count ? buf_same(x, &cnt.data, "tokens_per_expert", name) : 1))
                  ? 0
                  : 1;
        goto done;
    }
    if (fm_moe_router(x->cpu, &ch, &lg.th, &ids.th, &pr.th, NULL) != FM_OK || !buf_upload(x, &ids.data) ||
        !mt_make(x, &dp, fm_tensor_2d(NULL, FM_DTYPE_F32, T, k), nasty && (rnd(x) & 1) ? K_NONFINITE : MT_UNIT) ||
        !mt_make(x, &dl, fm_tensor_2d(NULL, FM_DTYPE_F32, T, E), -1))
        goto done;
    stc = fm_moe_router_backward(x->cpu, &ch, &lg.th, &ids.th, &dp.th, &dl.th);
    stg = fm_moe_router_backward(x->gpu, &cd, &lg.td, &ids.td, &dp.td, &dl.td);
    if ((res = mt_verdict(x, name, stc, stg)) >= 0)
        goto done;
    res = buf_same(x, &dl.data, "dlogits", name) ? 0 : 1;
done:
    for (int i = 0; i < 6; i++)
        qout_free(all[i]);
    buf_free(&bias);
    return res;
}

static void rt_run(xv_env *x, xv_counts *cnt, int bwd)
{
    static const int64_t Es[] = {4, 7, 16, 33, 64};
    static const int ks[] = {1, 2, 8};
    const int64_t Ts[] = {1, 77, x->quick ? 300 : 3000};
    long serial = 0;
    for (int sc = 0; sc < 2; sc++)
        for (int bi = 0; bi < 2; bi++)
            for (int rn = 0; rn < 2; rn++)
                for (int ki = 0; ki < 3; ki++)
                    for (int ei = 0; ei < 5; ei++)
                        for (int ti = 0; ti < 3 && !x->cuda_broken; ti++) {
                            if (ks[ki] > Es[ei])
                                continue;
                            serial++;
                            if (x->quick && serial % 7)
                                continue;
                            fm_router_config rc = {ks[ki], sc ? FM_ROUTER_SIGMOID : FM_ROUTER_SOFTMAX, rn, NULL};
                            int nasty = serial % 3 != 0, want_count = serial % 4 != 0;
                            char name[200];
                            snprintf(name, sizeof name, "moe_router%s %s%s%s k=%d E=%lld T=%lld%s%s",
                                     bwd ? "_backward" : "", sc ? "sigmoid" : "softmax", bi ? " bias" : "",
                                     rn ? " renormalize" : "", ks[ki], (long long)Es[ei], (long long)Ts[ti],
                                     nasty ? " nasty" : "", !bwd && want_count ? " tokens_per_expert" : "");
                            tally(x, cnt, rt_case(x, bwd, &rc, bi, Ts[ti], Es[ei], nasty, want_count, name), name);
                        }
}

static void xv_moe_router(xv_env *x, xv_counts *cnt) { rt_run(x, cnt, 0); }
static void xv_moe_router_backward(xv_env *x, xv_counts *cnt) { rt_run(x, cnt, 1); }

/* ---- routings and the row maps built from them ------------------------------ */

enum { ROUTE_RANDOM, ROUTE_SKEWED, ROUTE_ONE, ROUTE_COUNT };
static const char *route_name[ROUTE_COUNT] = {"random", "skewed", "one-expert"};

/* ids [T, k]: k distinct experts per token (RANDOM), distinct among the first
 * third of the experts (SKEWED: the others stay empty), or every slot to one
 * expert (ONE). */
static void mt_routing(xv_env *x, int32_t *ids, int64_t T, int64_t E, int64_t k, int route)
{
    int64_t pool = route == ROUTE_SKEWED ? (E / 3 > k ? E / 3 : k) : E, one = rndi(x, 0, (int)E - 1);
    int32_t perm[64];
    for (int64_t t = 0; t < T; t++) {
        for (int64_t e = 0; e < pool; e++)
            perm[e] = (int32_t)e;
        for (int64_t j = 0; j < k; j++) {
            int64_t p = j + (int64_t)(rnd(x) % (uint64_t)(pool - j));
            int32_t v = perm[p];
            perm[p] = perm[j];
            perm[j] = v;
            ids[t * k + j] = route == ROUTE_ONE ? (int32_t)one : v;
        }
    }
}

typedef struct mt_shape {
    int64_t T, E, k, H;
    int large;
} mt_shape;

static const mt_shape mt_shapes[] = {
    {1, 4, 1, 128, 0}, {37, 8, 2, 300, 0}, {129, 32, 8, 256, 0}, {5, 64, 8, 64, 0}, {1000, 64, 8, 512, 1},
};
#define MT_NSHAPES (int)(sizeof mt_shapes / sizeof mt_shapes[0])

/* The maps of a routing, on both sides: the CPU permute of a small F32 x
 * gives row_map [R, 1] and slot_rows [T, k] (R = T·k + E·(pad - 1)). */
static int mt_maps(xv_env *x, const xv_qout *ids, int64_t E, int pad, xv_qout *rm, xv_qout *sr)
{
    int64_t T = ids->th.shape[0], k = ids->th.shape[1], R = T * k + E * (pad > 1 ? pad - 1 : 0);
    xv_qout xs, out, sp;
    memset(&xs, 0, sizeof xs);
    memset(&out, 0, sizeof out);
    memset(&sp, 0, sizeof sp);
    int ok = mt_make(x, &xs, fm_tensor_2d(NULL, FM_DTYPE_F32, T, 2), MT_UNIT) &&
             mt_make(x, &out, fm_tensor_2d(NULL, FM_DTYPE_F32, R, 2), -1) &&
             mt_make(x, &sp, fm_tensor_2d(NULL, FM_DTYPE_I64, 1, E), -1) &&
             mt_make(x, rm, fm_tensor_2d(NULL, FM_DTYPE_I32, R, 1), -1) &&
             mt_make(x, sr, fm_tensor_2d(NULL, FM_DTYPE_I32, T, k), -1);
    fm_permute_config pc = {pad};
    ok = ok && fm_moe_permute(x->cpu, &pc, &xs.th, &ids->th, NULL, &out.th, &rm->th, &sr->th, &sp.th, NULL, NULL) == FM_OK &&
         buf_upload(x, &rm->data) && buf_upload(x, &sr->data);
    qout_free(&xs);
    qout_free(&out);
    qout_free(&sp);
    return ok;
}

/* ---- op: moe_permute ------------------------------------------------------ */

static const struct {
    fm_dtype t;
    fm_scale_mode m;
} mt_fmts[] = {
    {FM_DTYPE_BF16, FM_SCALE_NONE}, {FM_DTYPE_F32, FM_SCALE_NONE}, {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
    {FM_DTYPE_E5M2, FM_SCALE_MX32}, {FM_DTYPE_E2M1, FM_SCALE_MX32},
};

/* rows: 0 the bound T·k + E·(pad - 1), 1 the bound + 3, 2 exactly Σ P_e. */
static int pm_case(xv_env *x, const mt_shape *s, int fi, int pad, int route, int rows, int with_probs, int with_op,
                   int with_hs, const char *name)
{
    int res = 1;
    int64_t T = s->T, E = s->E, k = s->k, H = s->H, p = pad > 1 ? pad : 1;
    xv_qout xs, ids, pr, out, rm, sr, sp, op;
    xv_qout *all[] = {&xs, &ids, &pr, &out, &rm, &sr, &sp, &op};
    for (int i = 0; i < 8; i++)
        memset(all[i], 0, sizeof *all[i]);
    int64_t hs[2][64];
    memset(hs[0], 0x5A, sizeof hs[0]);
    memset(hs[1], 0xA5, sizeof hs[1]);
    if (!mt_make(x, &xs, mt_desc(mt_fmts[fi].t, mt_fmts[fi].m, T, H, FM_LAYOUT_ROWWISE), RQ_SCRAMBLED) ||
        !mt_make(x, &ids, fm_tensor_2d(NULL, FM_DTYPE_I32, T, k), 0) ||
        !mt_make(x, &pr, fm_tensor_2d(NULL, FM_DTYPE_F32, T, k), MT_UNIT))
        goto done;
    mt_routing(x, ids.data.h, T, E, k, route);
    int64_t R = T * k + E * (p - 1) + (rows == 1 ? 3 : 0), cnt[64] = {0};
    if (rows == 2) {
        for (int64_t i = 0; i < T * k; i++)
            cnt[((int32_t *)ids.data.h)[i]]++;
        R = 0;
        for (int64_t e = 0; e < E; e++)
            R += fm_round_up(cnt[e], p);
    }
    if (!buf_upload(x, &ids.data) || !mt_make(x, &out, mt_desc(xs.th.dtype, xs.th.scale_mode, R, H, FM_LAYOUT_ROWWISE), -1) ||
        !mt_make(x, &rm, fm_tensor_2d(NULL, FM_DTYPE_I32, R, 1), -1) ||
        !mt_make(x, &sr, fm_tensor_2d(NULL, FM_DTYPE_I32, T, k), -1) ||
        !mt_make(x, &sp, fm_tensor_2d(NULL, FM_DTYPE_I64, 1, E), -1) ||
        !mt_make(x, &op, fm_tensor_2d(NULL, FM_DTYPE_F32, R, 1), -1))
        goto done;
    fm_permute_config pc = {pad};
    fm_status stc = fm_moe_permute(x->cpu, &pc, &xs.th, &ids.th, MT_H(pr, with_probs), &out.th, &rm.th, &sr.th,
                                   &sp.th, MT_H(op, with_op), with_hs ? hs[0] : NULL);
    fm_status stg = fm_moe_permute(x->gpu, &pc, &xs.td, &ids.td, MT_D(pr, with_probs), &out.td, &rm.td, &sr.td,
                                   &sp.td, MT_D(op, with_op), with_hs ? hs[1] : NULL);
    if ((res = mt_verdict(x, name, stc, stg)) >= 0)
        goto done;
    int ok = mt_same(x, &out, "out", name) & buf_same(x, &rm.data, "row_map", name) &
             buf_same(x, &sr.data, "slot_rows", name) & buf_same(x, &sp.data, "splits", name);
    if (with_op)
        ok &= buf_same(x, &op.data, "out_probs", name);
    if (with_hs && (memcmp(hs[0], hs[1], (size_t)E * 8) || memcmp(hs[0], sp.data.h, (size_t)E * 8))) {
        ok = 0;
        if (x->printed++ < 20)
            fprintf(stderr, "FAIL %s: host_splits differ (between the backends or from splits)\n", name);
    }
    res = ok ? 0 : 1;
done:
    for (int i = 0; i < 8; i++)
        qout_free(all[i]);
    return res;
}

static void xv_moe_permute(xv_env *x, xv_counts *cnt)
{
    static const int pads[] = {0, 1, 16, 128};
    long serial = 0;
    for (int si = 0; si < MT_NSHAPES; si++)
        for (int fi = 0; fi < 5; fi++)
            for (int pi = 0; pi < 4; pi++)
                for (int route = 0; route < ROUTE_COUNT && !x->cuda_broken; route++) {
                    const mt_shape *s = &mt_shapes[si];
                    serial++;
                    if ((x->quick && (s->large || serial % 4)) || (s->large && serial % 3))
                        continue;
                    int rows = (int)(serial % 3), with_probs = serial % 5 != 1, with_op = with_probs && serial % 5 != 2;
                    int with_hs = (serial / 3) % 2;
                    char name[240];
                    snprintf(name, sizeof name,
                             "moe_permute T=%lld E=%lld k=%lld H=%lld %s %s pad=%d %s R=%s%s%s%s", (long long)s->T,
                             (long long)s->E, (long long)s->k, (long long)s->H, fm_dtype_name(mt_fmts[fi].t),
                             fm_scale_mode_name(mt_fmts[fi].m), pads[pi], route_name[route],
                             rows == 0 ? "bound" : rows == 1 ? "bound+3" : "exact", with_probs ? " probs" : "",
                             with_op ? " out_probs" : "", with_hs ? " host_splits" : "");
                    tally(x, cnt, pm_case(x, s, fi, pads[pi], route, rows, with_probs, with_op, with_hs, name), name);
                }
}

/* ---- ops: moe_unpermute, moe_unpermute_backward ---------------------------- */

/* bwd: 0 forward; 1 backward with dprobs; 2 backward, probs but no dprobs;
 * 3 backward without probs (the backward of permute). */
static int up_case(xv_env *x, const mt_shape *s, int pad, int route, fm_dtype yt, fm_dtype ot, int with_probs,
                   int bwd, int kind, const char *name)
{
    int res = 1;
    int64_t T = s->T, E = s->E, k = s->k, H = s->H, R = T * k + E * (pad > 1 ? pad - 1 : 0);
    xv_qout ids, pr, rm, sr, y, o, dy, dpr;
    xv_qout *all[] = {&ids, &pr, &rm, &sr, &y, &o, &dy, &dpr};
    for (int i = 0; i < 8; i++)
        memset(all[i], 0, sizeof *all[i]);
    if (!mt_make(x, &ids, fm_tensor_2d(NULL, FM_DTYPE_I32, T, k), 0))
        goto done;
    mt_routing(x, ids.data.h, T, E, k, route);
    if (!mt_maps(x, &ids, E, pad, &rm, &sr) || !mt_make(x, &pr, fm_tensor_2d(NULL, FM_DTYPE_F32, T, k), MT_UNIT) ||
        !mt_make(x, &y, fm_tensor_2d(NULL, yt, R, H), kind))
        goto done;
    fm_status stc, stg;
    if (!bwd) {
        if (!mt_make(x, &o, fm_tensor_2d(NULL, ot, T, H), -1))
            goto done;
        stc = fm_moe_unpermute(x->cpu, &y.th, &sr.th, MT_H(pr, with_probs), &o.th);
        stg = fm_moe_unpermute(x->gpu, &y.td, &sr.td, MT_D(pr, with_probs), &o.td);
        if ((res = mt_verdict(x, name, stc, stg)) >= 0)
            goto done;
        res = buf_same(x, &o.data, "out", name) ? 0 : 1;
        goto done;
    }
    int want_dp = bwd == 1;
    if (!mt_make(x, &o, fm_tensor_2d(NULL, ot, T, H), kind) || !mt_make(x, &dy, fm_tensor_2d(NULL, yt, R, H), -1) ||
        !mt_make(x, &dpr, fm_tensor_2d(NULL, FM_DTYPE_F32, T, k), -1))
        goto done;
    stc = fm_moe_unpermute_backward(x->cpu, &o.th, want_dp ? &y.th : NULL, &rm.th, &sr.th, MT_H(pr, bwd < 3), &dy.th,
                                    MT_H(dpr, want_dp));
    stg = fm_moe_unpermute_backward(x->gpu, &o.td, want_dp ? &y.td : NULL, &rm.td, &sr.td, MT_D(pr, bwd < 3), &dy.td,
                                    MT_D(dpr, want_dp));
    if ((res = mt_verdict(x, name, stc, stg)) >= 0)
        goto done;
    res = (buf_same(x, &dy.data, "dy", name) & (want_dp ? buf_same(x, &dpr.data, "dprobs", name) : 1)) ? 0 : 1;
done:
    for (int i = 0; i < 8; i++)
        qout_free(all[i]);
    return res;
}

static void up_run(xv_env *x, xv_counts *cnt, int bwd)
{
    static const int pads[] = {1, 16, 128};
    static const fm_dtype dts[] = {FM_DTYPE_BF16, FM_DTYPE_F32};
    long serial = 0;
    for (int si = 0; si < MT_NSHAPES; si++)
        for (int pi = 0; pi < 3; pi++)
            for (int yi = 0; yi < 2; yi++)
                for (int oi = 0; oi < 2; oi++)
                    for (int v = 0; v < (bwd ? 3 : 2) && !x->cuda_broken; v++) {
                        const mt_shape *s = &mt_shapes[si];
                        serial++;
                        if ((x->quick && (s->large || serial % 3)) || (s->large && serial % 3))
                            continue;
                        int route = (int)((serial / 3) % ROUTE_COUNT), kind = serial % 5 == 0 ? K_NONFINITE : MT_UNIT;
                        int mode = bwd ? v + 1 : 0, with_probs = bwd ? v < 2 : v == 0;
                        char name[240];
                        snprintf(name, sizeof name, "moe_unpermute%s T=%lld E=%lld k=%lld H=%lld pad=%d %s y %s out %s%s%s%s",
                                 bwd ? "_backward" : "", (long long)s->T, (long long)s->E, (long long)s->k,
                                 (long long)s->H, pads[pi], route_name[route], fm_dtype_name(dts[yi]),
                                 fm_dtype_name(dts[oi]), with_probs ? " probs" : "", mode == 1 ? " dprobs" : "",
                                 kind == K_NONFINITE ? " nonfinite" : "");
                        tally(x, cnt, up_case(x, s, pads[pi], route, dts[yi], dts[oi], with_probs, mode, kind, name),
                              name);
                    }
}

static void xv_moe_unpermute(xv_env *x, xv_counts *cnt) { up_run(x, cnt, 0); }
static void xv_moe_unpermute_backward(xv_env *x, xv_counts *cnt) { up_run(x, cnt, 1); }

/* ---- ops: moe_swiglu, moe_swiglu_backward ---------------------------------- */

/* Row formats of the SwiGLU inputs and outputs; col: also a column-wise copy. */
typedef struct sw_fmt {
    fm_dtype t;
    fm_scale_mode m;
    int col;
} sw_fmt;

static const sw_fmt sw_ins[] = {
    {FM_DTYPE_BF16, FM_SCALE_NONE, 0}, {FM_DTYPE_F32, FM_SCALE_NONE, 0},
    {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 0}, {FM_DTYPE_E2M1, FM_SCALE_MX32, 0},
};
static const sw_fmt sw_outs[] = {
    {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 0}, {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 1},
    {FM_DTYPE_E2M1, FM_SCALE_MX32, 0}, {FM_DTYPE_BF16, FM_SCALE_NONE, 0}, {FM_DTYPE_F32, FM_SCALE_NONE, 0},
};
/* in_saved of the forward: none, E4M3 1x128, E2M1 MX32. */
static const sw_fmt sw_saved[] = {
    {FM_DTYPE_COUNT, FM_SCALE_NONE, 0}, {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 0}, {FM_DTYPE_E2M1, FM_SCALE_MX32, 0},
};

static const int64_t sw_shapes[][3] = {{1, 64, 0}, {37, 300, 0}, {128, 256, 0}, {130, 128, 0}, {600, 1024, 1}};
#define SW_NSHAPES (int)(sizeof sw_shapes / sizeof sw_shapes[0])

static void sw_fmt_name(const sw_fmt *f, char *b, size_t n)
{
    snprintf(b, n, "%s%s%s%s", fm_dtype_name(f->t), f->m ? " " : "", f->m ? fm_scale_mode_name(f->m) : "",
             f->col ? " row+col" : "");
}

/* Forward (bwd = 0): in [M, 2I] -> out [M, I] (+ col, + in_saved). Backward:
 * dh [M, I] of format `a`, in [M, 2I] of format `b` -> din [M, 2I] (+ col) and
 * dprobs. `extra`: forward, the in_saved format; backward, 1 asks for dprobs. */
static int sw_case(xv_env *x, int bwd, int64_t M, int64_t I, const sw_fmt *a, const sw_fmt *b, const sw_fmt *o,
                   const sw_fmt *saved, int with_probs, int with_dprobs, int kind, int want_amax, const char *name)
{
    int res = 1;
    xv_qout in, dh, pr, row, col, sv, dp;
    xv_qout *all[] = {&in, &dh, &pr, &row, &col, &sv, &dp};
    for (int i = 0; i < 7; i++)
        memset(all[i], 0, sizeof *all[i]);
    xv_buf amax = {0}, nonf = {0};
    int64_t C = bwd ? 2 * I : I; /* the outputs' columns */
    const sw_fmt *fi = bwd ? b : a;
    int with_saved = !bwd && saved && saved->t != FM_DTYPE_COUNT;
    if (!mt_make(x, &in, mt_desc(fi->t, fi->m, M, 2 * I, FM_LAYOUT_ROWWISE), kind) ||
        (bwd && !mt_make(x, &dh, mt_desc(a->t, a->m, M, I, FM_LAYOUT_ROWWISE), rnd(x) % 4 ? MT_UNIT : kind)) ||
        !mt_make(x, &pr, fm_tensor_2d(NULL, FM_DTYPE_F32, M, 1), MT_UNIT) ||
        !mt_make(x, &row, mt_desc(o->t, o->m, M, C, FM_LAYOUT_ROWWISE), -1) ||
        (o->col && !mt_make(x, &col, mt_desc(o->t, o->m, M, C, FM_LAYOUT_COLWISE), -1)) ||
        (with_saved && !mt_make(x, &sv, mt_desc(saved->t, saved->m, M, 2 * I, FM_LAYOUT_ROWWISE), -1)) ||
        !mt_make(x, &dp, fm_tensor_2d(NULL, FM_DTYPE_F32, M, 1), -1) || !buf_alloc(x, &amax, 4) ||
        !buf_alloc(x, &nonf, 8) || !buf_poison(x, &amax) || !buf_poison(x, &nonf))
        goto done;
    fm_quant_config qh = {0}, qd = {0};
    if (want_amax) {
        qh.amax = amax.h;
        qh.nonfinite_blocks = nonf.h;
        qd.amax = amax.d;
        qd.nonfinite_blocks = nonf.d;
    }
    fm_status stc, stg;
    if (!bwd) {
        stc = fm_moe_swiglu(x->cpu, &qh, &in.th, MT_H(pr, with_probs), &row.th, MT_H(col, o->col), MT_H(sv, with_saved));
        stg = fm_moe_swiglu(x->gpu, &qd, &in.td, MT_D(pr, with_probs), &row.td, MT_D(col, o->col), MT_D(sv, with_saved));
    } else {
        stc = fm_moe_swiglu_backward(x->cpu, &qh, &dh.th, &in.th, MT_H(pr, with_probs), &row.th, MT_H(col, o->col),
                                     MT_H(dp, with_dprobs));
        stg = fm_moe_swiglu_backward(x->gpu, &qd, &dh.td, &in.td, MT_D(pr, with_probs), &row.td, MT_D(col, o->col),
                                     MT_D(dp, with_dprobs));
    }
    if ((res = mt_verdict(x, name, stc, stg)) >= 0)
        goto done;
    int ok = mt_same(x, &row, bwd ? "din_row" : "out_row", name);
    if (o->col)
        ok &= mt_same(x, &col, bwd ? "din_col" : "out_col", name);
    if (with_saved)
        ok &= mt_same(x, &sv, "in_saved", name);
    if (with_dprobs)
        ok &= buf_same(x, &dp.data, "dprobs", name);
    if (want_amax)
        ok &= buf_same(x, &amax, "amax", name) & buf_same(x, &nonf, "nonfinite_blocks", name);
    res = ok ? 0 : 1;
done:
    for (int i = 0; i < 7; i++)
        qout_free(all[i]);
    buf_free(&amax);
    buf_free(&nonf);
    return res;
}

static void xv_moe_swiglu(xv_env *x, xv_counts *cnt)
{
    long serial = 0;
    for (int si = 0; si < SW_NSHAPES; si++)
        for (int ii = 0; ii < 4; ii++)
            for (int oi = 0; oi < 5; oi++)
                for (int vi = 0; vi < 3; vi++)
                    for (int p = 0; p < 2 && !x->cuda_broken; p++) {
                        const sw_fmt *a = &sw_ins[ii], *o = &sw_outs[oi], *sv = &sw_saved[vi];
                        if (vi && a->m != FM_SCALE_NONE)
                            continue; /* in_saved is written from an unscaled in only */
                        serial++;
                        int large = (int)sw_shapes[si][2];
                        /* quick: one case in 4, the one taken rotating (so no inner loop's value is never hit) */
                        if ((x->quick && (large || serial % 4 != (serial / 4) % 4)) || (large && serial % 3))
                            continue;
                        int kind = serial % 5 == 1 ? K_NONFINITE : serial % 5 == 3 ? K_MAXMAG : MT_UNIT;
                        int want_amax = o->m != FM_SCALE_NONE && serial % 2;
                        char an[48], on[48], vn[48] = "-", name[280];
                        sw_fmt_name(a, an, sizeof an);
                        sw_fmt_name(o, on, sizeof on);
                        if (vi)
                            sw_fmt_name(sv, vn, sizeof vn);
                        snprintf(name, sizeof name, "moe_swiglu M=%lld I=%lld in %s -> %s saved %s%s kind=%s%s",
                                 (long long)sw_shapes[si][0], (long long)sw_shapes[si][1], an, on, vn,
                                 p ? " probs" : "", kind == MT_UNIT ? "unit" : kind_name[kind],
                                 want_amax ? " amax" : "");
                        tally(x, cnt, sw_case(x, 0, sw_shapes[si][0], sw_shapes[si][1], a, NULL, o, sv, p, 0, kind,
                                              want_amax, name),
                              name);
                    }
}

static void xv_moe_swiglu_backward(xv_env *x, xv_counts *cnt)
{
    static const sw_fmt dins[] = {
        {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 0}, {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 1},
        {FM_DTYPE_E2M1, FM_SCALE_MX32, 0}, {FM_DTYPE_BF16, FM_SCALE_NONE, 0},
    };
    long serial = 0;
    for (int si = 0; si < SW_NSHAPES; si++)
        for (int di = 0; di < 4; di++)      /* dh */
            for (int ii = 0; ii < 4; ii++)  /* the saved in */
                for (int oi = 0; oi < 4; oi++)
                    for (int p = 0; p < 3 && !x->cuda_broken; p++) {
                        const sw_fmt *a = &sw_ins[di], *b = &sw_ins[ii], *o = &dins[oi];
                        serial++;
                        int large = (int)sw_shapes[si][2];
                        if ((x->quick && (large || serial % 12 != (serial / 12) % 12)) || (large && serial % 4) ||
                            (!x->quick && serial % 2))
                            continue;
                        int kind = serial % 5 == 2 ? K_NONFINITE : serial % 7 == 4 ? K_MAXMAG : MT_UNIT;
                        int want_amax = o->m != FM_SCALE_NONE && serial % 3 == 0;
                        char an[48], bn[48], on[48], name[280];
                        sw_fmt_name(a, an, sizeof an);
                        sw_fmt_name(b, bn, sizeof bn);
                        sw_fmt_name(o, on, sizeof on);
                        snprintf(name, sizeof name, "moe_swiglu_backward M=%lld I=%lld dh %s in %s -> %s%s%s kind=%s%s",
                                 (long long)sw_shapes[si][0], (long long)sw_shapes[si][1], an, bn, on,
                                 p ? " probs" : "", p == 2 ? " dprobs" : "", kind == MT_UNIT ? "unit" : kind_name[kind],
                                 want_amax ? " amax" : "");
                        tally(x, cnt, sw_case(x, 1, sw_shapes[si][0], sw_shapes[si][1], a, b, o, NULL, p > 0, p == 2,
                                              kind, want_amax, name),
                              name);
                    }
}

/* ---- op: moe_layer -------------------------------------------------------------
 * One layer step (create, weight refresh, forward, backward) per recipe on
 * both backends from the same F32 weights and data: y, dx and the three
 * accumulated weight gradients within a relative Frobenius error: 5e-3 for
 * bf16 (the GEMM tolerance); the FP8 recipes re-quantize GEMM outputs, where
 * a last-bit GEMM difference moves a value to the neighbouring code (an
 * E4M3 step is 1/16 to 1/8 of the value, an E2M1 step up to 1/3), so 3e-2,
 * and 4e-2 for fp8-flow-fp4: 144 cases over three seeds (S8-14) reached
 * 0.018 and 0.021 with the bounds of test_cuda_layer_matches_cpu's one
 * shape (1.5e-2); shapes with few rows an expert get wider bounds (below);
 * a real fault (a wrong expert, a lost scale) errs by O(1). The gradients
 * start non-zero: backward
 * accumulates. Shapes: odd token counts, k = 1 and k = E, each router
 * scoring, renormalised or not, explicit padding multiples (32 for bf16,
 * 128 for FP8) as well as the recipe default. Kinds: random; every third
 * token zero (its logits all tie: the lower expert ids win on both); one
 * NaN element in one token. Elements non-finite on either side must be
 * non-finite alike on both (NaN, +Inf, -Inf); the error is taken over the
 * rest. (Token magnitudes spread over 2^+-12 were tried and dropped: a
 * code flip in the largest token outweighs the bound, which is written for
 * data of one scale; they showed both backends making the same NaN row
 * when sigmoid renormalisation divided 0 by 0, which the router now
 * replaces by its limit, RELIABILITY.md.) */

#include "../tests/layer_step.h"

typedef struct ly_shape {
    int64_t T, H, I, E;
    int k, pad;
    fm_router_score score;
    int renorm;
} ly_shape;

static const ly_shape ly_shapes[] = {
    {7, 128, 128, 2, 1, 0, FM_ROUTER_SOFTMAX, 0},   {300, 256, 128, 4, 2, 0, FM_ROUTER_SOFTMAX, 1},
    {130, 384, 256, 8, 8, 32, FM_ROUTER_SIGMOID, 1}, {257, 256, 384, 16, 4, 0, FM_ROUTER_SIGMOID, 0},
};
#define LY_NSHAPES (int)(sizeof ly_shapes / sizeof ly_shapes[0])
enum { LY_RANDOM, LY_ZEROS, LY_NAN, LY_KINDS };
static const char *ly_kind_name[LY_KINDS] = {"random", "zero-tokens", "nan-token"};

enum { LY_WR, LY_W1, LY_W2, LY_GR, LY_G1, LY_G2, LY_X, LY_Y, LY_DY, LY_DX, LY_NB };

/* 0 pass, 1 fail. */
static int ly_case(xv_env *x, const ly_shape *s, fm_recipe rc, int kind, const char *name)
{
    const int64_t T = s->T, H = s->H, I = s->I, E = s->E;
    const int64_t n[LY_NB] = {E * H, E * 2 * I * H, E * H * I, E * H, E * 2 * I * H, E * H * I,
                              T * H, T * H, T * H, T * H};
    const double sc[LY_NB] = {0.0625, 0.0625, 0.088, 0.01, 0.01, 0.01, 1, 0, 1, 0};
    float *h[LY_NB] = {0}, *d[LY_NB] = {0};
    int res = 1;
    for (int i = 0; i < LY_NB; i++) {
        if (!(h[i] = malloc((size_t)n[i] * 4)))
            goto done;
        for (int64_t j = 0; j < n[i]; j++)
            h[i][j] = (float)(rndn(x) * sc[i]);
    }
    for (int64_t t = 0; kind == LY_ZEROS && t < T; t += 3)
        memset(h[LY_X] + t * H, 0, (size_t)H * 4);
    if (kind == LY_NAN)
        h[LY_X][rndi(x, 0, (int)(T * H - 1))] = f32_from_bits(0x7FC00000u);
    for (int i = 0; i < LY_NB; i++) {
        if (!cuda_ok(x, cudaMalloc((void **)&d[i], (size_t)n[i] * 4), "cudaMalloc") ||
            !cuda_ok(x, cudaMemcpy(d[i], h[i], (size_t)n[i] * 4, cudaMemcpyHostToDevice), "cudaMemcpy H2D"))
            goto done;
    }
    if (!cuda_ok(x, cudaMemset(d[LY_Y], 0xA5, (size_t)n[LY_Y] * 4), "poison") ||
        !cuda_ok(x, cudaMemset(d[LY_DX], 0xA5, (size_t)n[LY_DX] * 4), "poison"))
        goto done;
    for (int64_t j = 0; j < n[LY_Y]; j++)
        h[LY_Y][j] = h[LY_DX][j] = f32_from_bits(0xA5A5A5A5u);
    /* FP8 recipes pad to 128 rows (the GEMM scale blocks); s->pad is for bf16 */
    const int pad = rc == FM_RECIPE_BF16 ? s->pad : s->pad ? 128 : 0;
    fm_moe_layer_config cfg = {.hidden = H, .ffn = I, .experts = E, .topk = s->k, .pad_multiple = pad,
                               .score = s->score, .renormalize = s->renorm, .recipe = rc, .max_tokens = T};
    fm_moe_weights wc = {h[LY_WR], h[LY_W1], h[LY_W2], h[LY_GR], h[LY_G1], h[LY_G2]};
    fm_moe_weights wg = {d[LY_WR], d[LY_W1], d[LY_W2], d[LY_GR], d[LY_G1], d[LY_G2]};
    fm_tensor xc = fm_tensor_2d(h[LY_X], FM_DTYPE_F32, T, H), yc = fm_tensor_2d(h[LY_Y], FM_DTYPE_F32, T, H);
    fm_tensor dyc = fm_tensor_2d(h[LY_DY], FM_DTYPE_F32, T, H), dxc = fm_tensor_2d(h[LY_DX], FM_DTYPE_F32, T, H);
    fm_tensor xg = fm_tensor_2d(d[LY_X], FM_DTYPE_F32, T, H), yg = fm_tensor_2d(d[LY_Y], FM_DTYPE_F32, T, H);
    fm_tensor dyg = fm_tensor_2d(d[LY_DY], FM_DTYPE_F32, T, H), dxg = fm_tensor_2d(d[LY_DX], FM_DTYPE_F32, T, H);
    xg.device = yg.device = dyg.device = dxg.device = FM_DEVICE_CUDA;
    fm_status stc = layer_step(x->cpu, &cfg, &wc, &xc, &yc, &dyc, &dxc, NULL);
    char cmsg[768];
    snprintf(cmsg, sizeof cmsg, "%s", fm_last_error(x->cpu));
    fm_status stg = layer_step(x->gpu, &cfg, &wg, &xg, &yg, &dyg, &dxg, NULL);
    res = status_verdict(x, name, stc, cmsg, stg);
    if (res == 2) { /* refused alike; every config here is valid */
        if (x->printed++ < 20)
            fprintf(stderr, "FAIL %s: both backends refused: %s\n", name, cmsg);
        res = 1;
    }
    if (res >= 0)
        goto done;
    res = 0;
    static const int outs[] = {LY_Y, LY_DX, LY_GR, LY_G1, LY_G2};
    static const char *on[] = {"y", "dx", "grad_router", "grad_w1", "grad_w2"};
    /* A code flip moves one row's term of an expert's weight-gradient sum,
     * relative to the sum by about 1 / sqrt(rows) of the flip. The bounds
     * were set on 64 or more routed rows an expert; fewer widen them by
     * sqrt(32 / rows) (T 7, k 1, E 2: 3.02x; 16 seeds of S10-1 reached
     * 0.038 for fp8-flow and 0.079 for fp8-flow-fp4 there; the unwidened
     * bounds failed 2 of those 16 runs, and 1 of 21 in S9). */
    const double rows = (double)T * s->k / (double)E;
    const double few = rc == FM_RECIPE_BF16 || rows >= 32 ? 1.0 : sqrt(32.0 / rows);
    const double tol0 = (rc == FM_RECIPE_BF16 ? 5e-3 : rc == FM_RECIPE_FP8_FLOW_FP4 ? 4e-2 : 3e-2) * few;
    for (int o = 0; o < 5; o++) {
        const int i = outs[o];
        /* The router gradient of fp8-flow-fp4 with few rows: a sum over a
         * handful of tokens of dprobs that each rest on MXFP4 codes (a flip
         * moves a value up to 1/3). S12-11, T 7: 36 draws below 0.079, and
         * S12-9 drew 0.186 (a zero-tokens case); held to 0.3, under the O(1)
         * of a wrong expert or a lost scale. */
        const double tol = i == LY_GR && rc == FM_RECIPE_FP8_FLOW_FP4 && few > 1.0 ? 0.3 : tol0;
        float *g = malloc((size_t)n[i] * 4);
        if (!g || !cuda_ok(x, cudaMemcpy(g, d[i], (size_t)n[i] * 4, cudaMemcpyDeviceToHost), "cudaMemcpy D2H")) {
            free(g);
            res = 1;
            break;
        }
        size_t nf = 0, nfc = 0;
        const double e = rel_frob_classes(h[i], g, FM_DTYPE_F32, (size_t)n[i], &nf);
        for (int64_t j = 0; j < n[i]; j++)
            nfc += !isfinite(h[i][j]);
        if (x->verbose)
            printf("  %s %s: rel. Frobenius error %.2e (bound %.2g), %zu non-finite on the CPU, %zu differ in "
                   "class\n", name, on[o], e, tol, nfc, nf);
        if (!(e <= tol) || nf) {
            res = 1;
            if (x->printed++ < 20)
                fprintf(stderr, "FAIL %s: %s rel. Frobenius error %.3g (bound %.3g), %zu elements finite on one "
                        "side only or non-finite differently\n", name, on[o], e, tol, nf);
        }
        free(g);
    }
done:
    for (int i = 0; i < LY_NB; i++) {
        free(h[i]);
        if (d[i])
            cudaFree(d[i]);
    }
    return res;
}

static void xv_moe_layer(xv_env *x, xv_counts *cnt)
{
    long serial = 0;
    for (int si = 0; si < LY_NSHAPES && !x->cuda_broken; si++)
        for (int rc = 0; rc < FM_RECIPE_COUNT && !x->cuda_broken; rc++)
            for (int kind = 0; kind < LY_KINDS && !x->cuda_broken; kind++) {
                serial++;
                if (x->quick && (serial + kind) % 3)
                    continue;
                const ly_shape *s = &ly_shapes[si];
                char name[256];
                snprintf(name, sizeof name, "moe_layer T%lld H%lld I%lld E%lld k%d pad %s %s%s %s %s",
                         (long long)s->T, (long long)s->H, (long long)s->I, (long long)s->E, s->k,
                         s->pad ? "explicit" : "default",
                         s->score == FM_ROUTER_SIGMOID ? "sigmoid" : "softmax", s->renorm ? " renorm" : "",
                         fm_recipe_name((fm_recipe)rc), ly_kind_name[kind]);
                tally(x, cnt, ly_case(x, s, (fm_recipe)rc, kind, name), name);
            }
}

/* ---- the op table: a later op registers here ------------------------------- */

typedef void (*xv_op_fn)(xv_env *x, xv_counts *c);
static const struct {
    const char *name;
    xv_op_fn run;
} xv_ops[] = {
    {"quantize", xv_quantize},
    {"dequantize", xv_dequantize},
    {"scale_layout_convert", xv_scale_layout_convert},
    {"cast", xv_cast},
    {"transpose_scaled", xv_transpose_scaled},
    {"convert_scaled", xv_convert_scaled},
    {"transpose_scaled_grouped", xv_transpose_scaled_grouped},
    {"transpose_scaled_grouped_rows", xv_transpose_scaled_grouped_rows},
    {"gemm", xv_gemm},
    {"grouped_gemm", xv_grouped_gemm},
    {"grouped_gemm_wgrad", xv_grouped_gemm_wgrad},
    {"moe_router", xv_moe_router},
    {"moe_router_backward", xv_moe_router_backward},
    {"moe_permute", xv_moe_permute},
    {"moe_unpermute", xv_moe_unpermute},
    {"moe_unpermute_backward", xv_moe_unpermute_backward},
    {"moe_swiglu", xv_moe_swiglu},
    {"moe_swiglu_backward", xv_moe_swiglu_backward},
    {"moe_layer", xv_moe_layer},
};
#define NOPS (int)(sizeof xv_ops / sizeof xv_ops[0])

static void usage(void)
{
    fprintf(stderr, "usage: fm-xval [-o OP]... [-q] [-s SEED] [-v]\nops:");
    for (int i = 0; i < NOPS; i++)
        fprintf(stderr, " %s", xv_ops[i].name);
    fprintf(stderr, "\n");
}

int main(int argc, char **argv)
{
    xv_env x;
    memset(&x, 0, sizeof x);
    const char *only[16];
    int nonly = 0;
    uint64_t seed = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-o") && i + 1 < argc && nonly < 16)
            only[nonly++] = argv[++i];
        else if (!strcmp(argv[i], "-q"))
            x.quick = 1;
        else if (!strcmp(argv[i], "-v"))
            x.verbose = 1;
        else if (!strcmp(argv[i], "-s") && i + 1 < argc)
            seed = strtoull(argv[++i], NULL, 0);
        else {
            usage();
            return 2;
        }
    }
    for (int k = 0; k < nonly; k++) {
        int found = 0;
        for (int i = 0; i < NOPS; i++)
            found |= !strcmp(only[k], xv_ops[i].name);
        if (!found) {
            fprintf(stderr, "fm-xval: unknown op '%s'\n", only[k]);
            usage();
            return 2;
        }
    }
    fm_context_config cg = {.backend = FM_BACKEND_CUDA};
    fm_status st = fm_context_create(&cg, &x.gpu);
    if (st != FM_OK) {
        printf("fm-xval: skipped: no usable CUDA device (%s)\n", fm_last_error(NULL));
        return 77;
    }
    fm_context_config cc = {.backend = FM_BACKEND_CPU};
    if ((st = fm_context_create(&cc, &x.cpu)) != FM_OK) {
        fprintf(stderr, "fm-xval: CPU context: %s\n", fm_last_error(NULL));
        return 1;
    }
    x.rng = seed;
    struct cudaDeviceProp prop;
    int dev = 0;
    cudaGetDevice(&dev);
    cudaGetDeviceProperties(&prop, dev);
    printf("fm-xval: CPU reference vs CUDA on %s, seed %" PRIu64 "%s\n", prop.name, seed, x.quick ? ", quick" : "");
    int failed = 0;
    for (int i = 0; i < NOPS; i++) {
        int sel = nonly == 0;
        for (int k = 0; k < nonly; k++)
            sel |= !strcmp(only[k], xv_ops[i].name);
        if (!sel)
            continue;
        xv_counts c = {0, 0, 0};
        clock_t t0 = clock();
        xv_ops[i].run(&x, &c);
        if (x.cuda_broken)
            c.fail++;
        printf("%-24s %6ld passed %6ld failed %6ld skipped  (%.1f s)\n", xv_ops[i].name, c.pass, c.fail, c.skip,
               (double)(clock() - t0) / CLOCKS_PER_SEC);
        fflush(stdout);
        failed |= c.fail > 0;
        if (x.cuda_broken)
            break;
    }
    fm_context_destroy(x.cpu);
    fm_context_destroy(x.gpu);
    printf("fm-xval: %s\n", failed ? "FAILED" : "all passed");
    return failed ? 1 : 0;
}

#else /* no CUDA in this build */

int main(void)
{
    printf("fm-xval: skipped: this flowmoe was built without the CUDA backend, so there is nothing to cross-validate\n");
    return 77;
}

#endif
