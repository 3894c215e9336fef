/* CPU GEMMs: the reference rule of DESIGN.md, blocked and threaded.
 *
 * For each output element: per K block (128 along K for BLOCK_* scales, the
 * whole K otherwise) the double sum of the products of the decoded codes in
 * ascending k, times (double)sa * (double)sb; the block terms summed in
 * double in ascending block order starting from +0; the old D added in
 * double when accumulating; one RNE rounding to the output dtype. Every
 * element is computed by one thread in that fixed order, so results do not
 * depend on the thread count or the blocking. With K = 0 the product is +0
 * (accumulate leaves D as it is). */
#include <math.h>
#include <stdlib.h>

#include "cpu.h"

enum { MR = 4, NR = 8, MC = 64, NB = 64, KC = 128 };

/* c[MR][NR] += a-panel x b-panel over kc (see FM_KERNEL_4x8_BODY). */
typedef void (*kernel_fn)(const double *a, const double *b, int64_t kc, double *c, int64_t ldc);

/* A [rows, K] operand as the kernel sees it: logical element (r, k) is at
 * element index (r0 + r) * rs + k * cs of data; its scale is found with
 * fm_scale_offset over the stored sR x sC matrix at stored row r0 + r
 * (scaled operands are always stored with K contiguous). */
typedef struct {
    const void *data;
    fm_dtype dtype;
    int64_t rs, cs, r0;
    const float *scale;
    fm_scale_mode mode;
    fm_scale_layout sl;
    int64_t sR, sC;
    const double *tab; /* FP8 code -> value */
} gop;

typedef struct {
    gop a, b;
    int64_t M, N, K, kblk;
    void *d;
    fm_dtype ddt;
    int64_t ldd;
    int accumulate;
    double *scratch;
    size_t scratch_per_worker;
    kernel_fn kernel;
} gjob;

/* Round a double to BF16 once: round to odd into F32 keeps the sticky
 * information that F32 -> BF16 RNE needs, so the two steps round as one. */
static uint16_t bf16_from_double(double x)
{
    if (isnan(x))
        return (uint16_t)FM_BF16_CANON_NAN;
    float f = (float)x;
    if (fabs((double)f) > fabs(x))
        f = nextafterf(f, 0.0f);
    if ((double)f != x)
        f = fm_bits_f32(fm_f32_bits(f) | 1u);
    return fm_bf16_from_f32(f);
}

/* Rows [r_begin, r_begin + nr) x k [k0, k0 + kc) of an operand, decoded,
 * as panels of w rows stored [k][w]; rows past nr up to rows_pad are 0. */
static void pack(const gop *o, int64_t r_begin, int64_t nr, int64_t k0, int64_t kc, int64_t rows_pad, int w,
                 double *dst)
{
    for (int64_t i = 0; i < rows_pad; i++) {
        double *p = dst + (i / w) * kc * w + (i % w);
        if (i >= nr) {
            for (int64_t k = 0; k < kc; k++)
                p[k * w] = 0.0;
            continue;
        }
        int64_t base = (o->r0 + r_begin + i) * o->rs + k0 * o->cs;
        switch (o->dtype) {
        case FM_DTYPE_E4M3:
        case FM_DTYPE_E5M2: {
            const uint8_t *s = (const uint8_t *)o->data + base;
            for (int64_t k = 0; k < kc; k++)
                p[k * w] = o->tab[s[k * o->cs]];
            break;
        }
        case FM_DTYPE_BF16: {
            const uint16_t *s = (const uint16_t *)o->data + base;
            for (int64_t k = 0; k < kc; k++)
                p[k * w] = (double)fm_bf16_to_f32(s[k * o->cs]);
            break;
        }
        default: {
            const float *s = (const float *)o->data + base;
            for (int64_t k = 0; k < kc; k++)
                p[k * w] = (double)s[k * o->cs];
            break;
        }
        }
    }
}

/* c[4][8] (row stride ldc) += Σ_k a[k][0..3] ⊗ b[k][0..7], k ascending:
 * each element is its own chain of double multiply then add (no FMA: the
 * build forbids contraction), so the sums stay in the rule's order whatever
 * the vector width. */
#define FM_LD(v, p) memcpy(&(v), (p), sizeof(v4d))
#define FM_ST(p, v) memcpy((p), &(v), sizeof(v4d))
#define FM_KERNEL_4x8_BODY                                                                  \
    {                                                                                       \
        v4d c00, c01, c10, c11, c20, c21, c30, c31;                                         \
        FM_LD(c00, c); FM_LD(c01, c + 4);                                                   \
        FM_LD(c10, c + ldc); FM_LD(c11, c + ldc + 4);                                       \
        FM_LD(c20, c + 2 * ldc); FM_LD(c21, c + 2 * ldc + 4);                               \
        FM_LD(c30, c + 3 * ldc); FM_LD(c31, c + 3 * ldc + 4);                               \
        for (int64_t k = 0; k < kc; k++) {                                                  \
            v4d b0, b1;                                                                     \
            FM_LD(b0, b + 8 * k); FM_LD(b1, b + 8 * k + 4);                                 \
            v4d z = {0.0, 0.0, 0.0, 0.0};                                                   \
            v4d a0 = z + a[4 * k], a1 = z + a[4 * k + 1];                                   \
            v4d a2 = z + a[4 * k + 2], a3 = z + a[4 * k + 3];                               \
            c00 += a0 * b0; c01 += a0 * b1;                                                 \
            c10 += a1 * b0; c11 += a1 * b1;                                                 \
            c20 += a2 * b0; c21 += a2 * b1;                                                 \
            c30 += a3 * b0; c31 += a3 * b1;                                                 \
        }                                                                                   \
        FM_ST(c, c00); FM_ST(c + 4, c01);                                                   \
        FM_ST(c + ldc, c10); FM_ST(c + ldc + 4, c11);                                       \
        FM_ST(c + 2 * ldc, c20); FM_ST(c + 2 * ldc + 4, c21);                               \
        FM_ST(c + 3 * ldc, c30); FM_ST(c + 3 * ldc + 4, c31);                               \
    }

#if defined(__GNUC__) && defined(__x86_64__)
/* GNU vector extension: plain SSE2 lanes by default, AVX2 where the CPU has
 * it (chosen once per call); both compute the same IEEE operations. */
typedef double v4d __attribute__((vector_size(32)));
static void kernel4x8(const double *a, const double *b, int64_t kc, double *c, int64_t ldc) FM_KERNEL_4x8_BODY
__attribute__((target("avx2"))) static void kernel4x8_avx2(const double *a, const double *b, int64_t kc, double *c,
                                                           int64_t ldc) FM_KERNEL_4x8_BODY
static kernel_fn pick_kernel(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? kernel4x8_avx2 : kernel4x8;
}
#else
static void kernel4x8(const double *a, const double *b, int64_t kc, double *c, int64_t ldc)
{
    for (int64_t k = 0; k < kc; k++)
        for (int i = 0; i < 4; i++)
            for (int jj = 0; jj < 8; jj++)
                c[i * ldc + jj] += a[4 * k + i] * b[8 * k + jj];
}
static kernel_fn pick_kernel(void) { return kernel4x8; }
#endif

static double scale_at(const gop *o, int64_t r, int64_t k)
{
    if (o->mode == FM_SCALE_NONE)
        return 1.0;
    return (double)o->scale[fm_scale_offset(o->mode, o->sl, o->sR, o->sC, o->r0 + r, k)];
}

static void run_rows(void *arg, int64_t m0, int64_t m1, int worker)
{
    const gjob *j = arg;
    double *ap = j->scratch + (size_t)worker * j->scratch_per_worker;
    double *bp = ap + MC * KC, *blk = bp + NB * KC, *tot = blk + MC * NB, *sa = tot + MC * NB, *sb = sa + MC;
    int64_t nblk = j->K == 0 ? 0 : fm_cdiv(j->K, j->kblk);
    for (int64_t mc0 = m0; mc0 < m1; mc0 += MC) {
        int64_t mr = m1 - mc0 < MC ? m1 - mc0 : MC, mpad = fm_round_up(mr, MR);
        for (int64_t n0 = 0; n0 < j->N; n0 += NB) {
            int64_t nr = j->N - n0 < NB ? j->N - n0 : NB, npad = fm_round_up(nr, NR);
            for (int64_t i = 0; i < mr * NB; i++)
                tot[i] = 0.0;
            for (int64_t kb = 0; kb < nblk; kb++) {
                int64_t kb0 = kb * j->kblk, kb1 = kb0 + j->kblk < j->K ? kb0 + j->kblk : j->K;
                for (int64_t i = 0; i < mpad * NB; i++)
                    blk[i] = 0.0;
                for (int64_t k0 = kb0; k0 < kb1; k0 += KC) {
                    int64_t kc = kb1 - k0 < KC ? kb1 - k0 : KC;
                    pack(&j->a, mc0, mr, k0, kc, mpad, MR, ap);
                    pack(&j->b, n0, nr, k0, kc, npad, NR, bp);
                    for (int64_t i = 0; i < mpad; i += MR)
                        for (int64_t jj = 0; jj < npad; jj += NR)
                            j->kernel(ap + i * kc, bp + jj * kc, kc, blk + i * NB + jj, NB);
                }
                for (int64_t i = 0; i < mr; i++)
                    sa[i] = scale_at(&j->a, mc0 + i, kb0);
                for (int64_t c = 0; c < nr; c++)
                    sb[c] = scale_at(&j->b, n0 + c, kb0);
                for (int64_t i = 0; i < mr; i++)
                    for (int64_t c = 0; c < nr; c++)
                        tot[i * NB + c] += (sa[i] * sb[c]) * blk[i * NB + c];
            }
            for (int64_t i = 0; i < mr; i++) {
                int64_t off = (mc0 + i) * j->ldd + n0;
                if (j->ddt == FM_DTYPE_F32) {
                    float *d = (float *)j->d + off;
                    for (int64_t c = 0; c < nr; c++) {
                        double v = j->accumulate ? (double)d[c] + tot[i * NB + c] : tot[i * NB + c];
                        d[c] = fm_f32_canon((float)v);
                    }
                } else {
                    uint16_t *d = (uint16_t *)j->d + off;
                    for (int64_t c = 0; c < nr; c++)
                        d[c] = bf16_from_double(tot[i * NB + c]);
                }
            }
        }
    }
}

typedef struct {
    double e4m3[256], e5m2[256];
} fp8_tables;

static void build_tables(fp8_tables *t)
{
    for (int c = 0; c < 256; c++) {
        t->e4m3[c] = (double)fm_e4m3_to_f32((uint8_t)c);
        t->e5m2[c] = (double)fm_e5m2_to_f32((uint8_t)c);
    }
}

static const double *table_for(const fp8_tables *t, fm_dtype d)
{
    return d == FM_DTYPE_E4M3 ? t->e4m3 : d == FM_DTYPE_E5M2 ? t->e5m2 : NULL;
}

/* A product over the job's operands (scratch and tables already set). */
static void run(fm_context *ctx, gjob *j)
{
    if (j->M == 0 || j->N == 0)
        return;
    if (j->K == 0 && j->accumulate)
        return;
    j->kblk = j->a.mode == FM_SCALE_BLOCK_1x128 || j->a.mode == FM_SCALE_BLOCK_128x128 ? 128
            : (j->K > 0 ? j->K : 1);
    /* Threads pay off from about a million multiply-adds each. */
    int64_t min_rows = ((int64_t)1 << 20) / (j->N * (j->K > 0 ? j->K : 1));
    fm_cpu_parallel_for(ctx, j->M, min_rows < MR ? MR : min_rows, run_rows, j);
}

static fm_status job_init(fm_context *ctx, gjob *j, const fm_gemm_config *cfg, fm_tensor *d, const char *op)
{
    int workers = fm_cpu_workers(ctx);
    j->scratch_per_worker = MC * KC + NB * KC + 2 * MC * NB + MC + NB;
    j->scratch = malloc(sizeof(double) * j->scratch_per_worker * (size_t)workers);
    if (!j->scratch)
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "%s: out of host memory for %d workers' panels", op, workers);
    j->ddt = d->dtype;
    j->accumulate = cfg->accumulate;
    j->kernel = pick_kernel();
    return FM_OK;
}

/* Operand (r, k) strides of a 2-D logical [rows, K] view stored either way. */
static gop operand_of(const fm_tensor *t, const fp8_tables *tabs)
{
    gop o = {0};
    int64_t rows = t->shape[t->ndim - 2], K = t->shape[t->ndim - 1];
    o.data = t->data;
    o.dtype = t->dtype;
    o.rs = t->layout == FM_LAYOUT_ROWWISE ? K : 1;
    o.cs = t->layout == FM_LAYOUT_ROWWISE ? 1 : rows;
    o.scale = (const float *)t->scale;
    o.mode = t->scale_mode;
    o.sl = t->scale_layout;
    o.sR = rows;
    o.sC = K;
    o.tab = table_for(tabs, t->dtype);
    return o;
}

fm_status fm_cpu_gemm(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *a, const fm_tensor *b,
                      fm_tensor *d)
{
    fp8_tables tabs;
    build_tables(&tabs);
    gjob j = {0};
    fm_status st = job_init(ctx, &j, cfg, d, "fm_gemm");
    if (st)
        return st;
    j.a = operand_of(a, &tabs);
    j.b = operand_of(b, &tabs);
    j.M = a->shape[0];
    j.N = b->shape[0];
    j.K = a->shape[1];
    j.d = d->data;
    j.ldd = j.N;
    run(ctx, &j);
    free(j.scratch);
    return FM_OK;
}

/* p + bytes, leaving NULL alone: an empty tensor may come without a buffer,
 * and even a zero offset on a null pointer is undefined in C. */
static void *byte_at(const void *p, int64_t bytes)
{
    return p ? (void *)((const uint8_t *)p + bytes) : NULL;
}

fm_status fm_cpu_grouped_gemm(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *splits,
                              const fm_tensor *a, const fm_tensor *b, fm_tensor *d)
{
    fp8_tables tabs;
    build_tables(&tabs);
    gjob j = {0};
    fm_status st = job_init(ctx, &j, cfg, d, "fm_grouped_gemm");
    if (st)
        return st;
    int64_t N = b->shape[1], K = b->shape[2], esize = fm_dtype_bits(b->dtype) / 8;
    int64_t bscales = b->scale_mode ? fm_scale_count_2d(b->scale_mode, b->scale_layout, N, K) : 0;
    fm_tensor b2 = fm_tensor_2d(NULL, b->dtype, N, K);
    b2.layout = b->layout;
    b2.scale_mode = b->scale_mode;
    b2.scale_layout = b->scale_layout;
    j.a = operand_of(a, &tabs);
    j.N = N;
    j.K = K;
    j.ldd = N;
    int64_t row0 = 0;
    for (int64_t e = 0; e < splits->groups; e++) {
        int64_t m = splits->host[e];
        b2.data = byte_at(b->data, e * N * K * esize);
        b2.scale = b->scale_mode ? byte_at(b->scale, e * bscales * 4) : NULL;
        j.b = operand_of(&b2, &tabs);
        j.a.r0 = row0;
        j.M = m;
        j.d = byte_at(d->data, row0 * N * (fm_dtype_bits(d->dtype) / 8));
        run(ctx, &j);
        row0 += m;
    }
    free(j.scratch);
    return FM_OK;
}

/* Expert g's slice of a [sum M_i, C] tensor as the logical [C, M_g] operand
 * (its transpose): in the grouped column-wise layout the stored [C, M_g]
 * matrix itself, row-wise (unscaled only) a strided view of the rows. */
static gop slice_t(const fm_tensor *t, int64_t row0, int64_t m, int64_t scale_off, const fp8_tables *tabs)
{
    int64_t C = t->shape[1], esize = fm_dtype_bits(t->dtype) / 8;
    gop o = {0};
    o.data = byte_at(t->data, row0 * C * esize);
    o.dtype = t->dtype;
    o.rs = t->layout == FM_LAYOUT_COLWISE ? m : 1;
    o.cs = t->layout == FM_LAYOUT_COLWISE ? 1 : C;
    o.scale = t->scale_mode ? byte_at(t->scale, scale_off * 4) : NULL;
    o.mode = t->scale_mode;
    o.sl = t->scale_layout;
    o.sR = C;
    o.sC = m;
    o.tab = table_for(tabs, t->dtype);
    return o;
}

fm_status fm_cpu_grouped_gemm_wgrad(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *splits,
                                    const fm_tensor *dy, const fm_tensor *x, fm_tensor *dw)
{
    fp8_tables tabs;
    build_tables(&tabs);
    gjob j = {0};
    fm_status st = job_init(ctx, &j, cfg, dw, "fm_grouped_gemm_wgrad");
    if (st)
        return st;
    int64_t N = dy->shape[1], K = x->shape[1], row0 = 0, soff_dy = 0, soff_x = 0;
    int64_t desize = fm_dtype_bits(dw->dtype) / 8;
    j.M = N;
    j.N = K;
    j.ldd = K;
    for (int64_t e = 0; e < splits->groups; e++) {
        int64_t m = splits->host[e];
        j.a = slice_t(dy, row0, m, soff_dy, &tabs);
        j.b = slice_t(x, row0, m, soff_x, &tabs);
        j.K = m;
        j.d = byte_at(dw->data, e * N * K * desize);
        run(ctx, &j);
        row0 += m;
        if (dy->scale_mode)
            soff_dy += fm_scale_count_2d(dy->scale_mode, dy->scale_layout, N, m);
        if (x->scale_mode)
            soff_x += fm_scale_count_2d(x->scale_mode, x->scale_layout, K, m);
    }
    free(j.scratch);
    return FM_OK;
}
