/* GEMM test operands and the reference product, written from DESIGN.md's
 * rule with the test oracle's codecs and scale geometry (not format.h): per
 * K block (128 for BLOCK_* scales, all of K otherwise) the double sum of the
 * decoded products in ascending k, times sa * sb; block terms summed in
 * ascending order from +0; old D added in double when accumulating; one RNE
 * rounding to the output dtype. */
#ifndef FM_GEMM_REF_H
#define FM_GEMM_REF_H

#include <math.h>

#include "test_util.h"

/* E stored matrices, each the logical [rows, K] (FP8 always row-wise). */
typedef struct {
    fm_dtype dt;
    fm_scale_mode mode;
    fm_scale_layout sl;
    fm_layout layout;
    int64_t E, rows, K, per_scales;
    uint8_t *data;
    float *scale;
    double *v; /* [E][rows][K] decoded values */
    fm_tensor t;
} gr_op;

enum { GR_RANDOM, GR_WIDE, GR_ZEROS, GR_MAXMAG };

static int gr_esize(fm_dtype d) { return d == FM_DTYPE_F32 ? 4 : d == FM_DTYPE_BF16 ? 2 : 1; }

static double gr_scale_value(int kind)
{
    if (kind == GR_WIDE)
        return ldexp(1.0 + tu_uniform(), (int)tu_randint(-30, 30));
    if (tu_randint(0, 1))
        return ldexp(1.0, (int)tu_randint(-8, 8));
    return ldexp(0.5 + tu_uniform(), (int)tu_randint(-6, 6));
}

/* A finite value of dt and its storage bits. */
static double gr_value(fm_dtype dt, int kind, uint32_t *bits)
{
    if (dt == FM_DTYPE_E4M3 || dt == FM_DTYPE_E5M2) {
        or_fmt f = or_from_dtype(dt);
        for (;;) {
            uint32_t c = kind == GR_ZEROS ? (tu_rand32() & 0x80u)
                       : kind == GR_MAXMAG ? ((tu_rand32() & 0x80u) | (dt == FM_DTYPE_E4M3 ? 0x7Eu : 0x7Bu))
                                           : (tu_rand32() & 0xFFu);
            double v = or_decode(f, c);
            if (isfinite(v)) {
                *bits = c;
                return v;
            }
        }
    }
    double x = kind == GR_ZEROS ? 0.0 : tu_normal() * ldexp(1.0, (int)tu_randint(-4, 4));
    if (kind == GR_MAXMAG)
        x = (tu_randint(0, 1) ? 1 : -1) * ldexp(1.5, 100);
    if (dt == FM_DTYPE_BF16) {
        *bits = or_encode(OF_BF16, x);
        return or_decode(OF_BF16, *bits);
    }
    float f = (float)x;
    memcpy(bits, &f, 4);
    return (double)f;
}

static void gr_store(gr_op *o, int64_t e, int64_t r, int64_t k, uint32_t bits)
{
    int64_t i = o->layout == FM_LAYOUT_ROWWISE ? (e * o->rows + r) * o->K + k : (e * o->K + k) * o->rows + r;
    int es = gr_esize(o->dt);
    if (es == 1)
        o->data[i] = (uint8_t)bits;
    else if (es == 2)
        ((uint16_t *)o->data)[i] = (uint16_t)bits;
    else
        ((uint32_t *)o->data)[i] = bits;
}

/* Scale entry of (e, r, k): the test's own geometry (ref_scale_offset). */
static float *gr_scale_ptr(const gr_op *o, int64_t e, int64_t r, int64_t k)
{
    return o->scale + e * o->per_scales + ref_scale_offset(o->mode, o->sl, o->rows, o->K, r, k);
}

static double gr_scale(const gr_op *o, int64_t e, int64_t r, int64_t k)
{
    return o->mode == FM_SCALE_NONE ? 1.0 : (double)*gr_scale_ptr(o, e, r, k);
}

static void gr_make(gr_op *o, fm_dtype dt, fm_scale_mode mode, fm_scale_layout sl, fm_layout layout, int64_t E,
                    int64_t rows, int64_t K, int kind)
{
    memset(o, 0, sizeof *o);
    int stack = E < 0; /* E < 0: a 3-D stack of -E matrices, even of one */
    if (stack)
        E = -E;
    o->dt = dt;
    o->mode = mode;
    o->sl = sl;
    o->layout = layout;
    o->E = E;
    o->rows = rows;
    o->K = K;
    int64_t n = E * rows * K;
    o->data = malloc((size_t)(n * gr_esize(dt) + 16));
    o->v = malloc((size_t)(n + 1) * sizeof(double));
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t k = 0; k < K; k++) {
                uint32_t bits;
                o->v[(e * rows + r) * K + k] = gr_value(dt, kind, &bits);
                gr_store(o, e, r, k, bits);
            }
    if (mode != FM_SCALE_NONE) {
        o->per_scales = ref_scale_count(mode, sl, rows, K);
        o->scale = malloc((size_t)(E * o->per_scales + 1) * sizeof(float));
        /* NaN in the padding: a GEMM that reads it shows it. */
        for (int64_t i = 0; i < E * o->per_scales; i++)
            o->scale[i] = NAN;
        for (int64_t e = 0; e < E; e++)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t k = 0; k < K; k += 128) {
                    float *p = gr_scale_ptr(o, e, r, k);
                    if (isnan(*p))
                        *p = (float)gr_scale_value(kind);
                }
    }
    o->t = E == 1 && !stack ? fm_tensor_2d(o->data, dt, rows, K) : fm_tensor_3d(o->data, dt, E, rows, K);
    o->t.layout = layout;
    o->t.scale_mode = mode;
    o->t.scale = o->scale;
    o->t.scale_dtype = FM_DTYPE_F32;
    o->t.scale_layout = sl;
}

static void gr_free(gr_op *o)
{
    free(o->data);
    free(o->scale);
    free(o->v);
}

static int gr_blocked(fm_scale_mode m) { return m == FM_SCALE_BLOCK_1x128 || m == FM_SCALE_BLOCK_128x128; }

/* out[M][N] = the unrounded rule for rows [ra0, ra0 + M) of A's matrix ea
 * against B's matrix eb (all N rows). */
static void gr_ref(const gr_op *A, int64_t ea, int64_t ra0, const gr_op *B, int64_t eb, int64_t M, double *out)
{
    int64_t N = B->rows, K = A->K;
    int64_t kblk = gr_blocked(A->mode) ? 128 : K;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            const double *a = A->v + (ea * A->rows + ra0 + m) * K, *b = B->v + (eb * B->rows + n) * K;
            double tot = 0.0;
            for (int64_t k0 = 0; k0 < K; k0 += kblk) {
                double s = 0.0;
                for (int64_t k = k0; k < k0 + kblk && k < K; k++)
                    s += a[k] * b[k];
                tot += (gr_scale(A, ea, ra0 + m, k0) * gr_scale(B, eb, n, k0)) * s;
            }
            out[m * N + n] = tot;
        }
}

/* The stored bits the rule gives for `tot` (old: the previous F32 bits). */
static uint32_t gr_round(double tot, fm_dtype out, int accumulate, uint32_t old, int64_t K)
{
    if (accumulate && K == 0)
        return old;
    double x = tot;
    if (accumulate) {
        float f;
        memcpy(&f, &old, 4);
        x = (double)f + tot;
    }
    if (out == FM_DTYPE_BF16)
        return or_encode(OF_BF16, x);
    if (isnan(x))
        return 0x7FC00000u;
    float f = (float)x;
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static uint32_t gr_get_out(const void *d, fm_dtype dt, int64_t i)
{
    return dt == FM_DTYPE_BF16 ? ((const uint16_t *)d)[i] : ((const uint32_t *)d)[i];
}

/* A poisoned (or, when accumulating, random F32) output buffer. */
static void *gr_out_new(int64_t n, fm_dtype dt, int accumulate)
{
    void *d = malloc((size_t)(n * gr_esize(dt) + 16));
    if (accumulate) {
        float *f = d;
        for (int64_t i = 0; i < n; i++)
            f[i] = (float)tu_normal();
    } else {
        memset(d, 0xA5, (size_t)(n * gr_esize(dt)));
    }
    return d;
}

#endif
