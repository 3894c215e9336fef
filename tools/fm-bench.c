/* fm-bench: speed of the CUDA backend's memory-bound ops, as a fraction of
 * the device-to-device copy bandwidth measured in the same run.
 *
 * Each case: inputs rotated among buffers whose total exceeds L2 (so no rep
 * reads what the last one left in cache), warm-up, then many repetitions
 * timed one by one with CUDA events; the median is reported. Bytes are the
 * op's own count (fm_stats: every input byte read once, every output byte
 * written once), so the fraction of copy bandwidth is the fraction of the
 * floor the op reaches.
 *
 * The scaling-aware transpose / conversion rows are timed next to the naive
 * path they replace (dequantize to BF16, then quantize column-wise), and the
 * speed-up of the first over the second is printed after the table.
 *
 *   fm-bench [--json] [--reps N] [--filter SUBSTRING]
 * Markdown table on stdout; --json prints JSON instead. Exit 77 without GPU.
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

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "fm-bench: %s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static int reps = 40, warm = 5;

static int cmpf(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

typedef void (*bench_fn)(void *arg, int rep);

/* Median milliseconds of fn over `reps` timed calls after `warm` calls. */
static float time_median(bench_fn fn, void *arg, cudaStream_t s)
{
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < warm; i++)
        fn(arg, i);
    CK(cudaStreamSynchronize(s));
    float *t = malloc(sizeof(float) * (size_t)reps);
    for (int i = 0; i < reps; i++) {
        CK(cudaEventRecord(a, s));
        fn(arg, i);
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        CK(cudaEventElapsedTime(&t[i], a, b));
    }
    qsort(t, (size_t)reps, sizeof(float), cmpf);
    float m = t[reps / 2];
    free(t);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return m;
}

/* ---- device-to-device copy ------------------------------------------------ */

typedef struct {
    void *dst, *src[2];
    size_t n;
    cudaStream_t s;
} copy_arg;

static void copy_fn(void *p, int rep)
{
    copy_arg *c = p;
    CK(cudaMemcpyAsync(c->dst, c->src[rep & 1], c->n, cudaMemcpyDeviceToDevice, c->s));
}

/* ---- random device data ----------------------------------------------------- */

static uint64_t rng = 0x243F6A8885A308D3ull;
static uint64_t rnd(void)
{
    uint64_t z = (rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Activation-like values (normal-ish, a few outliers) of dtype t. */
static void fill_device(void *d, fm_dtype t, size_t n)
{
    size_t esz = (size_t)fm_dtype_bits(t) / 8, chunk = (size_t)1 << 22;
    void *h = malloc(chunk * esz);
    for (size_t i = 0; i < chunk; i++) {
        double u = ((double)(rnd() >> 11) + 0.5) / 9007199254740992.0, v = (double)(rnd() >> 11) / 9007199254740992.0;
        float x = (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
        if (rnd() % 1000 == 0)
            x *= 50.0f;
        if (t == FM_DTYPE_F32)
            ((float *)h)[i] = x;
        else if (t == FM_DTYPE_BF16)
            ((uint16_t *)h)[i] = fm_bf16_from_f32(x);
        else
            ((uint16_t *)h)[i] = fm_f16_from_f32(x);
    }
    for (size_t off = 0; off < n; off += chunk) {
        size_t m = n - off < chunk ? n - off : chunk;
        CK(cudaMemcpy((char *)d + off * esz, h, m * esz, cudaMemcpyHostToDevice));
    }
    free(h);
}

/* ---- cases ---------------------------------------------------------------- */

typedef enum { OP_QUANT, OP_DEQUANT, OP_SLC, OP_TRANSPOSE, OP_CONVERT, OP_NAIVE, OP_TRANSPOSE_GROUPED } op_kind;

/* 8 ragged experts over 32768 rows (none a multiple of 128) for the grouped transpose. */
static const int64_t bench_split_sizes[8] = {4000, 5000, 3000, 6000, 2500, 4500, 3768, 4000};
static const fm_splits bench_splits = {8, bench_split_sizes, NULL};

typedef struct bcase {
    const char *name;
    op_kind op;
    int64_t E, rows, cols;
    fm_dtype in;             /* quantize: input dtype; dequantize: output dtype */
    fm_dtype elem;           /* element dtype of the quantized side */
    fm_scale_mode mode;
    fm_scale_layout sl;
    int row, col;            /* quantize: outputs; dequantize: row = in rowwise, col = transposing */
    double target;           /* fraction of copy bandwidth asked for, 0 = none */
    fm_dtype out_elem;       /* transpose_scaled / convert_scaled: the output format */
    fm_scale_mode out_mode;
} bcase;

static const bcase cases[] = {
    {"quantize BF16->E4M3 1x128 row+col", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0.90, 0, 0},
    {"quantize BF16->E4M3 1x128 row", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0, 0, 0},
    {"quantize BF16->E4M3 1x128 row+col, GEMM scales", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_GEMM, 1, 1, 0, 0, 0},
    {"quantize BF16->E4M3 MX32 row", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.90, 0, 0},
    {"quantize BF16->E4M3 MX32 row+col", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0.90, 0, 0},
    {"quantize BF16->E2M1 MX32 row", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.90, 0, 0},
    {"quantize BF16->E2M1 MX32 row+col", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0.90, 0, 0},
    {"quantize BF16->E5M2 1x128 row+col", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, 0, 0},
    {"quantize BF16->E4M3 128x128 row+col", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, 0, 0},
    {"quantize BF16->E4M3 TENSOR row (amax pass + encode)", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0, 0, 0},
    {"quantize BF16->E4M3 ROW row (amax pass + encode)", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_ROW, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0, 0, 0},
    {"quantize F32->E4M3 1x128 row+col", OP_QUANT, 1, 16384, 7168, FM_DTYPE_F32, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, 0, 0},
    {"quantize BF16->E4M3 1x128 row+col, 8 experts", OP_QUANT, 8, 4096, 2048, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, 0, 0},
    {"dequantize E4M3 1x128 -> BF16", OP_DEQUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.85, 0, 0},
    {"dequantize E4M3 MX32 -> BF16", OP_DEQUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.85, 0, 0},
    {"dequantize E2M1 MX32 -> BF16", OP_DEQUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.85, 0, 0},
    {"dequantize E4M3 1x128 -> F32", OP_DEQUANT, 1, 32768, 7168, FM_DTYPE_F32, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.85, 0, 0},
    {"dequantize E4M3 1x128 colwise -> BF16 rowwise (transpose)", OP_DEQUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 0, 1, 0, 0, 0},
    {"scale_layout_convert MX32 compact -> GEMM", OP_SLC, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_GEMM, 1, 0, 0, 0, 0},
    /* Scaling-aware transpose and direct conversion on codes and exponents; inputs are
     * quantized (POW2 scales) activation-like data, outputs compact. The naive row does what
     * they replace: dequantize to BF16, then quantize column-wise (two ops, timed together). */
    {"transpose_scaled E4M3 1x128 row->col", OP_TRANSPOSE, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0.85, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
    {"transpose_scaled_grouped E4M3 1x128 row->col, 8 ragged experts", OP_TRANSPOSE_GROUPED, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0.85, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
    {"transpose_scaled E4M3 MX32 row->col", OP_TRANSPOSE, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_MX32},
    {"transpose_scaled E2M1 MX32 row->col", OP_TRANSPOSE, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E2M1, FM_SCALE_MX32},
    {"convert_scaled E4M3 1x128 -> E2M1 MX32", OP_CONVERT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0, FM_DTYPE_E2M1, FM_SCALE_MX32},
    {"convert_scaled E2M1 MX32 -> E4M3 1x128", OP_CONVERT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
    {"naive dequantize->requantize (BF16 round trip) E4M3 1x128 row->col", OP_NAIVE, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
};
#define NCASES (int)(sizeof cases / sizeof cases[0])

#define NROT 3

typedef struct run_arg {
    fm_context *ctx;
    const bcase *c;
    fm_tensor in[NROT], qrow[NROT], qcol[NROT], out[NROT];
    int nrot;
    fm_quant_config qc;
    int failed;
} run_arg;

static void run_fn(void *p, int rep)
{
    run_arg *a = p;
    int k = rep % a->nrot;
    fm_status st;
    if (a->c->op == OP_QUANT)
        st = fm_quantize(a->ctx, &a->qc, &a->in[k], a->c->row ? &a->qrow[k] : NULL, a->c->col ? &a->qcol[k] : NULL);
    else if (a->c->op == OP_TRANSPOSE)
        st = fm_transpose_scaled(a->ctx, NULL, &a->qrow[k], &a->out[k]);
    else if (a->c->op == OP_TRANSPOSE_GROUPED)
        st = fm_transpose_scaled_grouped(a->ctx, NULL, &bench_splits, &a->qrow[k], &a->out[k]);
    else if (a->c->op == OP_CONVERT)
        st = fm_convert_scaled(a->ctx, NULL, &a->qrow[k], &a->out[k]);
    else if (a->c->op == OP_NAIVE) {
        /* what the scaling-aware transpose replaces: codes -> BF16 -> column-wise codes */
        st = fm_dequantize(a->ctx, &a->qrow[k], &a->in[k]);
        if (st == FM_OK)
            st = fm_quantize(a->ctx, &a->qc, &a->in[k], NULL, &a->qcol[k]);
    } else if (a->c->op == OP_DEQUANT)
        st = fm_dequantize(a->ctx, &a->qrow[k], &a->out[k]);
    else
        st = fm_scale_layout_convert(a->ctx, &a->qrow[k], &a->out[k]);
    if (st != FM_OK && !a->failed) {
        fprintf(stderr, "fm-bench: %s: %s\n", a->c->name, fm_last_error(a->ctx));
        a->failed = 1;
    }
}

static void *dalloc(int64_t n)
{
    void *p = NULL;
    CK(cudaMalloc(&p, (size_t)(n > 0 ? n : 1)));
    return p;
}

static fm_tensor shaped(const bcase *c, void *data, fm_dtype t)
{
    fm_tensor r = c->E > 1 ? fm_tensor_3d(data, t, c->E, c->rows, c->cols) : fm_tensor_2d(data, t, c->rows, c->cols);
    r.device = FM_DEVICE_CUDA;
    return r;
}

static fm_tensor quant_desc(const bcase *c, fm_layout lay, fm_scale_layout sl)
{
    fm_tensor t = shaped(c, NULL, c->elem);
    t.layout = lay;
    t.scale_mode = c->mode;
    t.scale_dtype = fm_scale_mode_dtype(c->mode);
    t.scale_layout = sl;
    t.data = dalloc(fm_tensor_nbytes(&t));
    t.scale = dalloc(fm_tensor_scale_nbytes(&t));
    return t;
}

static void free_t(fm_tensor *t)
{
    if (t->data)
        cudaFree(t->data);
    if (t->scale)
        cudaFree(t->scale);
    t->data = t->scale = NULL;
}

typedef struct result {
    const char *name;
    char shape[64];
    double bytes, ms, gbs, frac, target;
    int ok;
} result;

int main(int argc, char **argv)
{
    int json = 0;
    const char *filter = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            json = 1;
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--filter") && i + 1 < argc)
            filter = argv[++i];
        else {
            fprintf(stderr, "usage: fm-bench [--json] [--reps N] [--filter SUBSTRING]\n");
            return 2;
        }
    }
    if (reps < 3)
        reps = 3;
    fm_context *ctx;
    fm_context_config cfg = {.backend = FM_BACKEND_CUDA};
    if (fm_context_create(&cfg, &ctx) != FM_OK) {
        printf("fm-bench: skipped: no usable CUDA device (%s)\n", fm_last_error(NULL));
        return 77;
    }
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    fm_context_set_stream(ctx, s);
    int dev = 0;
    CK(cudaGetDevice(&dev));
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    int drv = 0, rt = 0;
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);

    /* Copy bandwidth: 1 GiB, two alternating sources. */
    copy_arg ca;
    ca.n = (size_t)1 << 30;
    ca.dst = dalloc((int64_t)ca.n);
    ca.src[0] = dalloc((int64_t)ca.n);
    ca.src[1] = dalloc((int64_t)ca.n);
    ca.s = s;
    CK(cudaMemset(ca.src[0], 1, ca.n));
    CK(cudaMemset(ca.src[1], 2, ca.n));
    float copy_ms = time_median(copy_fn, &ca, s);
    double copy_gbs = 2.0 * (double)ca.n / (copy_ms * 1e-3) / 1e9;
    cudaFree(ca.dst);
    cudaFree(ca.src[0]);
    cudaFree(ca.src[1]);

    result res[NCASES];
    int nres = 0, below = 0;
    for (int ci = 0; ci < NCASES; ci++) {
        const bcase *c = &cases[ci];
        if (filter && !strstr(c->name, filter))
            continue;
        run_arg a;
        memset(&a, 0, sizeof a);
        a.ctx = ctx;
        a.c = c;
        int64_t numel = c->E * c->rows * c->cols;
        int64_t in_bytes = c->op == OP_QUANT ? numel * (fm_dtype_bits(c->in) / 8) : numel * fm_dtype_bits(c->elem) / 8;
        a.nrot = in_bytes * 2 > (int64_t)prop.l2CacheSize * 4 ? 2 : NROT;
        for (int k = 0; k < a.nrot; k++) {
            if (c->op == OP_QUANT) {
                a.in[k] = shaped(c, dalloc(numel * (fm_dtype_bits(c->in) / 8)), c->in);
                fill_device(a.in[k].data, c->in, (size_t)numel);
                /* The outputs rotate too: both live beyond L2 across reps. */
                if (c->row)
                    a.qrow[k] = quant_desc(c, FM_LAYOUT_ROWWISE, c->sl);
                if (c->col)
                    a.qcol[k] = quant_desc(c, FM_LAYOUT_COLWISE, c->sl);
            } else {
                /* Real codes and scales: quantize random data first. */
                fm_tensor src = shaped(c, dalloc(numel * 2), FM_DTYPE_BF16);
                fill_device(src.data, FM_DTYPE_BF16, (size_t)numel);
                fm_layout lay = c->row ? FM_LAYOUT_ROWWISE : FM_LAYOUT_COLWISE;
                a.qrow[k] = quant_desc(c, lay, c->op == OP_SLC ? FM_SCALE_LAYOUT_COMPACT : c->sl);
                fm_quant_config q0 = {0};
                if (fm_quantize(ctx, &q0, &src, lay == FM_LAYOUT_ROWWISE ? &a.qrow[k] : NULL,
                                lay == FM_LAYOUT_COLWISE ? &a.qrow[k] : NULL) != FM_OK) {
                    fprintf(stderr, "fm-bench: setup quantize: %s\n", fm_last_error(ctx));
                    return 1;
                }
                CK(cudaStreamSynchronize(s));
                cudaFree(src.data);
                if (c->op == OP_TRANSPOSE || c->op == OP_CONVERT || c->op == OP_TRANSPOSE_GROUPED) {
                    a.out[k] = shaped(c, NULL, c->out_elem);
                    a.out[k].layout = c->op == OP_CONVERT ? FM_LAYOUT_ROWWISE : FM_LAYOUT_COLWISE;
                    a.out[k].scale_mode = c->out_mode;
                    a.out[k].scale_dtype = fm_scale_mode_dtype(c->out_mode);
                    a.out[k].scale_layout = c->sl;
                    a.out[k].data = dalloc(fm_tensor_nbytes(&a.out[k]));
                    a.out[k].scale = dalloc(c->op == OP_TRANSPOSE_GROUPED
                                                ? fm_tensor_grouped_scale_count(&a.out[k], &bench_splits) *
                                                      (fm_dtype_bits(a.out[k].scale_dtype) / 8)
                                                : fm_tensor_scale_nbytes(&a.out[k]));
                } else if (c->op == OP_NAIVE) {
                    a.in[k] = shaped(c, dalloc(numel * 2), FM_DTYPE_BF16); /* the BF16 intermediate */
                    a.qcol[k] = quant_desc(c, FM_LAYOUT_COLWISE, c->sl);
                } else if (c->op == OP_DEQUANT) {
                    a.out[k] = shaped(c, NULL, c->in);
                    a.out[k].layout = c->col ? (lay == FM_LAYOUT_ROWWISE ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE) : lay;
                    a.out[k].data = dalloc(fm_tensor_nbytes(&a.out[k]));
                } else {
                    a.out[k] = a.qrow[k];
                    a.out[k].scale_layout = c->sl;
                    a.out[k].data = NULL;
                    a.out[k].scale = dalloc(fm_tensor_scale_nbytes(&a.out[k]));
                }
            }
        }
        fm_stats s0, s1;
        fm_stats_get(ctx, &s0);
        run_fn(&a, 0);
        fm_stats_get(ctx, &s1);
        CK(cudaStreamSynchronize(s));
        double bytes = (double)(s1.bytes_read - s0.bytes_read + s1.bytes_written - s0.bytes_written);
        float ms = time_median(run_fn, &a, s);
        CK(cudaGetLastError());
        result *r = &res[nres++];
        r->name = c->name;
        if (c->E > 1)
            snprintf(r->shape, sizeof r->shape, "%lldx%lldx%lld", (long long)c->E, (long long)c->rows, (long long)c->cols);
        else
            snprintf(r->shape, sizeof r->shape, "%lldx%lld", (long long)c->rows, (long long)c->cols);
        r->bytes = bytes;
        r->ms = ms;
        r->gbs = bytes / (ms * 1e-3) / 1e9;
        r->frac = r->gbs / copy_gbs;
        r->target = c->target;
        r->ok = !a.failed;
        if (c->target > 0 && (r->frac < c->target || !r->ok))
            below++;
        for (int k = 0; k < a.nrot; k++) {
            if (a.in[k].data)
                cudaFree(a.in[k].data);
            free_t(&a.qrow[k]);
            free_t(&a.qcol[k]);
            if (c->op == OP_DEQUANT) {
                if (a.out[k].data)
                    cudaFree(a.out[k].data);
            } else if (c->op == OP_SLC && a.out[k].scale) {
                cudaFree(a.out[k].scale);
            } else if (c->op == OP_TRANSPOSE || c->op == OP_CONVERT || c->op == OP_TRANSPOSE_GROUPED) {
                free_t(&a.out[k]);
            }
        }
        if (!json) {
            fprintf(stderr, "fm-bench: %-60s %8.1f us\n", c->name, ms * 1e3);
        }
    }

    /* The scaling-aware transpose against the BF16 round trip it replaces. */
    double speedup = 0;
    {
        const result *fast = NULL, *naive = NULL;
        for (int i = 0; i < nres; i++) {
            if (!strcmp(res[i].name, "transpose_scaled E4M3 1x128 row->col"))
                fast = &res[i];
            if (!strncmp(res[i].name, "naive dequantize->requantize", 28))
                naive = &res[i];
        }
        if (fast && naive && fast->ok && naive->ok && fast->ms > 0)
            speedup = naive->ms / fast->ms;
    }

    char date[32];
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", gmtime(&now));
    if (json) {
        printf("{\n  \"device\": \"%s\",\n  \"sm_count\": %d,\n  \"l2_bytes\": %d,\n  \"driver\": %d,\n  \"runtime\": %d,\n"
               "  \"date\": \"%s\",\n  \"reps\": %d,\n  \"copy_gbs\": %.1f,\n",
               prop.name, prop.multiProcessorCount, prop.l2CacheSize, drv, rt, date, reps, copy_gbs);
        if (speedup > 0)
            printf("  \"transpose_scaled_speedup_vs_bf16_round_trip\": %.3f,\n", speedup);
        printf("  \"cases\": [\n");
        for (int i = 0; i < nres; i++) {
            result *r = &res[i];
            printf("    {\"name\": \"%s\", \"shape\": \"%s\", \"bytes\": %.0f, \"median_us\": %.2f, \"gbs\": %.1f, "
                   "\"fraction_of_copy\": %.4f, \"target\": %.2f, \"ok\": %s}%s\n",
                   r->name, r->shape, r->bytes, r->ms * 1e3, r->gbs, r->frac, r->target, r->ok ? "true" : "false",
                   i + 1 < nres ? "," : "");
        }
        printf("  ]\n}\n");
    } else {
        printf("## fm-bench on %s (%d SMs, L2 %d MiB), %s\n\n", prop.name, prop.multiProcessorCount,
               prop.l2CacheSize >> 20, date);
        printf("Device-to-device copy (cudaMemcpyAsync, 1 GiB, read + write): **%.1f GB/s** (median of %d)\n\n",
               copy_gbs, reps);
        printf("| op | shape | MB moved | median us | GB/s | of copy | target |\n");
        printf("|---|---|---:|---:|---:|---:|---|\n");
        for (int i = 0; i < nres; i++) {
            result *r = &res[i];
            char tg[32] = "";
            if (r->target > 0)
                snprintf(tg, sizeof tg, ">= %.0f%% %s", r->target * 100, r->frac >= r->target && r->ok ? "met" : "MISSED");
            printf("| %s%s | %s | %.1f | %.1f | %.1f | %.1f%% | %s |\n", r->name, r->ok ? "" : " (ERROR)", r->shape,
                   r->bytes / 1e6, r->ms * 1e3, r->gbs, r->frac * 100, tg);
        }
        if (speedup > 0)
            printf("\nScaling-aware transpose (E4M3 1x128 row->col) vs the naive BF16 round trip (dequantize, then "
                   "quantize column-wise): **%.2fx** faster\n",
                   speedup);
        printf("\n%d target(s) missed\n", below);
    }
    fm_context_destroy(ctx);
    cudaStreamDestroy(s);
    return 0;
}

#else

int main(void)
{
    printf("fm-bench: skipped: this flowmoe was built without the CUDA backend\n");
    return 77;
}

#endif
