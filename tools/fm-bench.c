/* fm-bench: speed of the CUDA backend's memory-bound ops, as a fraction of
 * the device-to-device copy bandwidth measured in the same run; then the
 * GEMMs in TFLOP/s, next to a plain cuBLASLt BF16 call for scale.
 *
 * Each case: inputs rotated among buffers whose total exceeds L2 (so no rep
 * reads what the last one left in cache), warm-up, then many repetitions
 * timed one by one with CUDA events, each enqueued while the stream waits
 * in a host function (so that the host's launch latency is off the clock);
 * the median is reported. Bytes are the
 * op's own count (fm_stats: every input byte read once, every output byte
 * written once), so the fraction of copy bandwidth is the fraction of the
 * floor the op reaches.
 *
 * The scaling-aware transpose / conversion rows are timed next to the naive
 * path they replace (dequantize to BF16, then quantize column-wise), and the
 * speed-up of the first over the second is printed after the table.
 *
 * The MoE ops (permute, unpermute, SwiGLU and dSwiGLU + quantize) run at
 * issue 7's shapes in the same table, next to the unfused sequences of
 * library ops they replace; then a whole MoE layer's forward + backward per
 * recipe, in ms per step and relative to bf16, every picked layer made
 * first and all timed in rounds (--no-layer skips it: it allocates about
 * 4 GB a layer, 36 GB for the nine rows).
 *
 * With 2 GPUs or more and NCCL: expert-parallel dispatch and combine over
 * NCCL, one thread and rank per GPU (issue 9's shape: 16384 tokens per rank,
 * H 7168, k 8, 8 experts per rank, random routing): dispatch in BF16, FP8
 * E4M3 1x128 and MXFP4, MXFP4 including the FP8 -> MXFP4 conversion before
 * and MXFP4 -> FP8 after, combine in BF16, each next to NCCL alone moving
 * the same rows (grouped ncclSend/ncclRecv) in the same run; ms are rank
 * 0's, CUDA events after all GPUs idle and a host barrier, the median of
 * half of --reps. --no-ep skips it, --ep-only runs only it (exit 77 when it
 * cannot run).
 *
 *   fm-bench [--json] [--reps N] [--filter SUBSTRING] [--no-layer] [--no-ep] [--ep-only]
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
#include <cublasLt.h>
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

/* --filter: rows whose name holds the string, or, written "=NAME", the row
 * of exactly that name (a prefix of other rows' names picks them all). */
static int picked(const char *name, const char *filter)
{
    if (!filter)
        return 1;
    return filter[0] == '=' ? !strcmp(name, filter + 1) : strstr(name, filter) != NULL;
}

/* The stream waits in this host function while a repetition is enqueued:
 * the GPU then reaches the start event with the op's launches already
 * queued behind it, as in a training step where the host runs ahead, so
 * the events time the op's GPU work and not the host's launch latency (an
 * op with several launches would otherwise show the gaps between them;
 * nvbench holds the stream the same way). An op that synchronises inside
 * still waits for the GPU: that time stays on the clock. */
static void CUDART_CB hold_fn(void *arg)
{
    const double us = *(const double *)arg;
    struct timespec ts = {(time_t)(us / 1e6), (long)(fmod(us, 1e6) * 1e3)};
    nanosleep(&ts, NULL);
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* Median milliseconds of each of n calls fn(args[j]) over `reps` timed
 * rounds after `warm` untimed ones; a round times every call once, in turn,
 * so that a clock or power drift during the run (the layer's rows moved by
 * 0.3 ms between runs, one recipe after another) reaches every call alike
 * and the ratios between them stay a figure. The hold is twice the longest
 * enqueue seen in the warm-up, plus 50 us. */
static void time_medians(bench_fn fn, void *const *args, int n, cudaStream_t s, float *ms)
{
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    double enq = 0.0;
    for (int i = 0; i < warm; i++)
        for (int j = 0; j < n; j++) {
            CK(cudaStreamSynchronize(s));
            const double t0 = now_us();
            fn(args[j], i);
            const double t1 = now_us();
            enq = t1 - t0 > enq ? t1 - t0 : enq;
        }
    CK(cudaStreamSynchronize(s));
    static double hold;
    hold = 2.0 * enq + 50.0;
    hold = hold < 200000.0 ? hold : 200000.0;
    float *t = malloc(sizeof(float) * (size_t)reps * (size_t)n);
    if (!t) {
        fprintf(stderr, "fm-bench: out of host memory\n");
        exit(1);
    }
    for (int i = 0; i < reps; i++)
        for (int j = 0; j < n; j++) {
            CK(cudaLaunchHostFunc(s, hold_fn, &hold));
            CK(cudaEventRecord(a, s));
            fn(args[j], i);
            CK(cudaEventRecord(b, s));
            CK(cudaEventSynchronize(b));
            CK(cudaEventElapsedTime(&t[(size_t)j * (size_t)reps + (size_t)i], a, b));
        }
    for (int j = 0; j < n; j++) {
        float *tj = t + (size_t)j * (size_t)reps;
        qsort(tj, (size_t)reps, sizeof(float), cmpf);
        ms[j] = tj[reps / 2];
    }
    free(t);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
}

static float time_median(bench_fn fn, void *arg, cudaStream_t s)
{
    float m;
    time_medians(fn, &arg, 1, s, &m);
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

typedef enum { OP_QUANT, OP_CAST, OP_DEQUANT, OP_SLC, OP_TRANSPOSE, OP_CONVERT, OP_NAIVE, OP_TRANSPOSE_GROUPED, OP_TRANSPOSE_GROUPED128, OP_TRANSPOSE_ROWS } op_kind;

/* 8 ragged experts over 32768 rows (none a multiple of 128) for the grouped transpose. */
static const int64_t bench_split_sizes[8] = {4000, 5000, 3000, 6000, 2500, 4500, 3768, 4000};
static const fm_splits bench_splits = {8, bench_split_sizes, NULL};
/* What the FP8 layer hands over: experts padded to 128 rows. */
static const int64_t bench_split_sizes128[8] = {4096, 4992, 3072, 5888, 2560, 4480, 3840, 3840};
static const fm_splits bench_splits128 = {8, bench_split_sizes128, NULL};
/* The layer's routing (4096 tokens, k 8 of 8 experts: every expert gets
 * every token, in token order): the rows' transpose reads the 4096 token
 * rows through row_map r = e 4096 + i -> slot 8 i + e. */
#define BR_K 8
static const int64_t bench_split_rows[8] = {4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096};
static const fm_splits bench_splits_rows = {8, bench_split_rows, NULL};
static int is_grouped(op_kind k) { return k == OP_TRANSPOSE_GROUPED || k == OP_TRANSPOSE_GROUPED128 || k == OP_TRANSPOSE_ROWS; }
static const fm_splits *splits_of(op_kind k)
{
    return k == OP_TRANSPOSE_GROUPED128 ? &bench_splits128 : k == OP_TRANSPOSE_ROWS ? &bench_splits_rows : &bench_splits;
}

typedef struct bcase {
    const char *name;
    op_kind op;
    int64_t E, rows, cols;
    fm_dtype in;             /* quantize, cast: input dtype; dequantize: output dtype */
    fm_dtype elem;           /* element dtype of the quantized side; cast: output dtype */
    fm_scale_mode mode;
    fm_scale_layout sl;
    int row, col;            /* quantize: outputs; dequantize: row = in rowwise, col = transposing */
    double target;           /* fraction of copy bandwidth asked for, 0 = none */
    fm_dtype out_elem;       /* transpose_scaled / convert_scaled: the output format */
    fm_scale_mode out_mode;
    int trusted;             /* transpose / convert: cfg.trusted_pow2_scales (no check, no wait) */
    int out_gemm;            /* transpose / convert: output scales in the GEMM layout (else sl) */
} bcase;

static const bcase cases[] = {
    {"quantize BF16->E4M3 1x128 row+col", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0.90, 0, 0, 0, 0},
    {"quantize BF16->E4M3 1x128 row", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0, 0, 0, 0, 0},
    {"quantize BF16->E4M3 1x128 row+col, GEMM scales", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_GEMM, 1, 1, 0, 0, 0, 0, 0},
    {"quantize BF16->E4M3 MX32 row", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.90, 0, 0, 0, 0},
    {"quantize BF16->E4M3 MX32 row+col", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0.90, 0, 0, 0, 0},
    {"quantize BF16->E2M1 MX32 row", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.90, 0, 0, 0, 0},
    {"quantize BF16->E2M1 MX32 row+col", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0.90, 0, 0, 0, 0},
    /* the two MX32 row+col cases without the compact scales' scatter pass */
    {"quantize BF16->E4M3 MX32 row+col, GEMM scales", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_GEMM, 1, 1, 0, 0, 0, 0, 0},
    {"quantize BF16->E2M1 MX32 row+col, GEMM scales", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_GEMM, 1, 1, 0, 0, 0, 0, 0},
    {"quantize BF16->E5M2 1x128 row+col", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, 0, 0, 0, 0},
    {"quantize BF16->E4M3 128x128 row+col", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, 0, 0, 0, 0},
    {"quantize BF16->E4M3 TENSOR row (amax pass + encode)", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0, 0, 0, 0, 0},
    {"quantize BF16->E4M3 ROW row (amax pass + encode)", OP_QUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_ROW, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0, 0, 0, 0, 0},
    {"quantize F32->E4M3 1x128 row+col", OP_QUANT, 1, 16384, 7168, FM_DTYPE_F32, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, 0, 0, 0, 0},
    {"quantize BF16->E4M3 1x128 row+col, 8 experts", OP_QUANT, 8, 4096, 2048, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, 0, 0, 0, 0},
    /* the bf16 and fp8-blockwise layers' per-step x and dy cast ([T, H] F32 -> BF16) */
    {"cast F32 -> BF16 (the bf16 layer's x and dy)", OP_CAST, 1, 4096, 7168, FM_DTYPE_F32, FM_DTYPE_BF16, FM_SCALE_NONE, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0, 0, 0, 0, 0},
    {"cast F32 -> BF16", OP_CAST, 1, 32768, 7168, FM_DTYPE_F32, FM_DTYPE_BF16, FM_SCALE_NONE, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0, 0, 0, 0, 0},
    {"dequantize E4M3 1x128 -> BF16", OP_DEQUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.85, 0, 0, 0, 0},
    {"dequantize E4M3 MX32 -> BF16", OP_DEQUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.85, 0, 0, 0, 0},
    {"dequantize E2M1 MX32 -> BF16", OP_DEQUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.85, 0, 0, 0, 0},
    {"dequantize E4M3 1x128 -> F32", OP_DEQUANT, 1, 32768, 7168, FM_DTYPE_F32, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.85, 0, 0, 0, 0},
    {"dequantize E4M3 1x128 colwise -> BF16 rowwise (transpose)", OP_DEQUANT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 0, 1, 0, 0, 0, 0, 0},
    {"scale_layout_convert MX32 compact -> GEMM", OP_SLC, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_GEMM, 1, 0, 0, 0, 0, 0, 0},
    /* Scaling-aware transpose and direct conversion on codes and exponents; inputs are
     * quantized (POW2 scales) activation-like data, outputs compact. The naive row does what
     * they replace: dequantize to BF16, then quantize column-wise (two ops, timed together). */
    {"transpose_scaled E4M3 1x128 row->col", OP_TRANSPOSE, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0.85, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 0, 0},
    {"transpose_scaled E4M3 1x128 row->col, trusted POW2 scales", OP_TRANSPOSE, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 1, 0},
    {"transpose_scaled E4M3 1x128 row->col, trusted POW2 scales, GEMM-layout output scales", OP_TRANSPOSE, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 1, 1},
    {"transpose_scaled_grouped E4M3 1x128 row->col, 8 experts of 128-row multiples", OP_TRANSPOSE_GROUPED128, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0.85, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 0, 0},
    {"transpose_scaled_grouped E4M3 1x128 row->col, 8 experts of 128-row multiples, trusted POW2 scales", OP_TRANSPOSE_GROUPED128, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 1, 0},
    {"transpose_scaled_grouped E4M3 1x128 row->col, 8 experts of 128-row multiples, trusted POW2 scales, GEMM-layout output scales (the layer's call)", OP_TRANSPOSE_GROUPED128, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 1, 1},
    {"transpose_scaled_grouped E4M3 1x128 row -> 128x128 col (ROWMAX), 8 experts of 128-row multiples, trusted POW2 scales (the flow recipes' x and h)", OP_TRANSPOSE_GROUPED128, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, 1, 0},
    {"transpose_scaled_grouped_rows E4M3 1x128 row->col, 8 experts x 4096 of 4096 token rows, trusted POW2 scales (the flow recipes' dy)", OP_TRANSPOSE_ROWS, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 1, 0},
    {"transpose_scaled_grouped_rows E4M3 1x128 row -> 128x128 col (ROWMAX), 8 experts x 4096 of 4096 token rows, trusted POW2 scales (fp8-flow's x)", OP_TRANSPOSE_ROWS, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, 1, 0},
    {"transpose_scaled_grouped E4M3 1x128 row->col, 8 ragged experts (not multiples of 16)", OP_TRANSPOSE_GROUPED, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 0, 0},
    {"transpose_scaled E4M3 MX32 row->col", OP_TRANSPOSE, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_MX32, 0, 0},
    {"transpose_scaled E4M3 MX32 row->col, GEMM-layout output scales", OP_TRANSPOSE, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_MX32, 0, 1},
    {"transpose_scaled_grouped E4M3 MX32 row->col, 8 experts of 128-row multiples", OP_TRANSPOSE_GROUPED128, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_MX32, 0, 0},
    /* No arithmetic (codes copied, the scale grid transposed): what the transposed access
     * pattern itself costs, the ceiling for the rows above. */
    {"transpose_scaled E4M3 128x128 row->col (bytes only)", OP_TRANSPOSE, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, 1, 0},
    {"transpose_scaled E2M1 MX32 row->col", OP_TRANSPOSE, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E2M1, FM_SCALE_MX32, 0, 0},
    {"transpose_scaled_grouped E2M1 MX32 row->col, 8 experts of 128-row multiples", OP_TRANSPOSE_GROUPED128, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E2M1, FM_SCALE_MX32, 0, 0},
    /* From 1x128 (F32 scales) the op first checks on the device that every scale is a power
     * of two (a kernel before the conversion, on the clock; no host synchronisation since
     * S21); from MX32 (E8M0) there is nothing to check. */
    {"convert_scaled E4M3 1x128 -> E2M1 MX32", OP_CONVERT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.85, FM_DTYPE_E2M1, FM_SCALE_MX32, 0, 0},
    {"convert_scaled E4M3 1x128 -> E2M1 MX32, trusted POW2 scales", OP_CONVERT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0, FM_DTYPE_E2M1, FM_SCALE_MX32, 1, 0},
    /* FP8 -> FP8 between block modes: the same row kernel, an FP8 encoder */
    {"convert_scaled E4M3 1x128 -> E4M3 MX32", OP_CONVERT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0, FM_DTYPE_E4M3, FM_SCALE_MX32, 0, 0},
    {"convert_scaled E4M3 MX32 -> E2M1 MX32", OP_CONVERT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.85, FM_DTYPE_E2M1, FM_SCALE_MX32, 0, 0},
    {"convert_scaled E2M1 MX32 -> E4M3 1x128", OP_CONVERT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.85, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 0, 0},
    {"convert_scaled E2M1 MX32 -> E4M3 MX32", OP_CONVERT, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, 1, 0, 0.85, FM_DTYPE_E4M3, FM_SCALE_MX32, 0, 0},
    {"naive dequantize->requantize (BF16 round trip) E4M3 1x128 row->col", OP_NAIVE, 1, 32768, 7168, FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, 1, 1, 0, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, 0, 0},
};
#define NCASES (int)(sizeof cases / sizeof cases[0])

#define NROT 3

typedef struct run_arg {
    fm_context *ctx;
    const bcase *c;
    fm_tensor in[NROT], qrow[NROT], qcol[NROT], out[NROT];
    fm_tensor rmap; /* OP_TRANSPOSE_ROWS */
    int nrot;
    fm_quant_config qc;
    int failed;
} run_arg;

static void run_fn(void *p, int rep)
{
    run_arg *a = p;
    int k = rep % a->nrot;
    fm_status st;
    /* A 128x128 output takes the one rule that gives it (a tile's 128 x 1 blocks agree under ROWMAX). */
    const fm_requant_config rq = {
        .rule = a->c->out_mode == FM_SCALE_BLOCK_128x128 ? FM_REQUANT_ROWMAX : FM_REQUANT_TIGHT,
        .trusted_pow2_scales = a->c->trusted};
    if (a->c->op == OP_CAST)
        st = fm_cast(a->ctx, &a->in[k], &a->out[k]);
    else if (a->c->op == OP_QUANT)
        st = fm_quantize(a->ctx, &a->qc, &a->in[k], a->c->row ? &a->qrow[k] : NULL, a->c->col ? &a->qcol[k] : NULL);
    else if (a->c->op == OP_TRANSPOSE)
        st = fm_transpose_scaled(a->ctx, &rq, &a->qrow[k], &a->out[k]);
    else if (a->c->op == OP_TRANSPOSE_ROWS)
        st = fm_transpose_scaled_grouped_rows(a->ctx, &rq, splits_of(a->c->op), &a->qrow[k], &a->rmap, BR_K, &a->out[k]);
    else if (is_grouped(a->c->op))
        st = fm_transpose_scaled_grouped(a->ctx, &rq, splits_of(a->c->op), &a->qrow[k], &a->out[k]);
    else if (a->c->op == OP_CONVERT)
        st = fm_convert_scaled(a->ctx, &rq, &a->qrow[k], &a->out[k]);
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

/* ---- GEMMs: TFLOP/s of the cuBLASLt paths, and plain cuBLASLt for scale ---- */

typedef enum { G_DENSE, G_GROUPED, G_WGRAD, G_LT_BF16, G_LINWGRAD } gemm_kind;

typedef struct gcase {
    const char *name;
    gemm_kind kind;
    int64_t E, M, N, K; /* dense/grouped: D [M, N] = A [M, K] · B [N, K]ᵀ (M = sum M_i); wgrad: dW [E, N, K] over sum M */
    fm_dtype elem;      /* E4M3 or BF16 */
    fm_scale_mode ma, mb;
    fm_dtype out;
    int accumulate;
    fm_gemm_impl impl; /* FP8: the native sm_90a kernel or cuBLASLt (the comparison the GEMM issues ask for) */
} gcase;

static const gcase gcases[] = {
    {"gemm E4M3 1x128 x 128x128 -> BF16 [native sm90]", G_DENSE, 1, 8192, 8192, 8192, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_NATIVE},
    {"gemm E4M3 1x128 x 128x128 -> BF16 [cuBLASLt]", G_DENSE, 1, 8192, 8192, 8192, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_LIBRARY},
    {"gemm BF16 -> BF16", G_DENSE, 1, 8192, 8192, 8192, FM_DTYPE_BF16, FM_SCALE_NONE, FM_SCALE_NONE, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_AUTO},
    {"plain cuBLASLt BF16 -> BF16 (baseline, not flowmoe)", G_LT_BF16, 1, 8192, 8192, 8192, FM_DTYPE_BF16, FM_SCALE_NONE, FM_SCALE_NONE, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_AUTO},
    {"grouped_gemm E4M3 1x128 x 128x128 -> BF16, E=8 [native sm90]", G_GROUPED, 8, 32768, 4096, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_NATIVE},
    {"grouped_gemm E4M3 1x128 x 128x128 -> BF16, E=8 [cuBLASLt]", G_GROUPED, 8, 32768, 4096, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_LIBRARY},
    {"grouped_gemm E4M3 1x128 x 128x128 -> F32 +=, E=8 [native sm90]", G_GROUPED, 8, 32768, 4096, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_F32, 1, FM_GEMM_IMPL_NATIVE},
    {"grouped_gemm E4M3 1x128 x 128x128 -> BF16, E=32 of 1024 rows [native sm90]", G_GROUPED, 32, 32768, 4096, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_NATIVE},
    {"grouped_gemm E4M3 1x128 x 128x128 -> BF16, E=32 of 1024 rows [cuBLASLt]", G_GROUPED, 32, 32768, 4096, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_LIBRARY},
    {"grouped_gemm E4M3 1x128 x 128x128 -> BF16, E=64 of 512 rows [native sm90]", G_GROUPED, 64, 32768, 4096, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_NATIVE},
    {"grouped_gemm E4M3 1x128 x 128x128 -> BF16, E=64 of 512 rows [cuBLASLt]", G_GROUPED, 64, 32768, 4096, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_LIBRARY},
    {"grouped_gemm E4M3 1x128 x 128x128 -> BF16, E=64 of 256 rows, N 2048 [native sm90]", G_GROUPED, 64, 16384, 2048, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_NATIVE},
    {"grouped_gemm E4M3 1x128 x 128x128 -> BF16, E=64 of 256 rows, N 2048 [cuBLASLt]", G_GROUPED, 64, 16384, 2048, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_LIBRARY},
    /* The layer's other three m-grouped products at fm-bench's layer size (the first is E=8 above):
     * W2 forward [32768, 2048] x [7168, 2048]^T, and the data gradients through W2 and W1. */
    {"grouped_gemm E4M3 1x128 x 128x128 -> BF16, E=8, layer W2 forward, N 7168 K 2048 [native sm90]", G_GROUPED, 8, 32768, 7168, 2048, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_NATIVE},
    {"grouped_gemm E4M3 1x128 x 128x128 -> BF16, E=8, layer W2 forward, N 7168 K 2048 [cuBLASLt]", G_GROUPED, 8, 32768, 7168, 2048, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_LIBRARY},
    {"grouped_gemm E4M3 1x128 x 128x128 -> BF16, E=8, layer data gradient through W2, N 2048 K 7168 [native sm90]", G_GROUPED, 8, 32768, 2048, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_NATIVE},
    {"grouped_gemm E4M3 1x128 x 128x128 -> BF16, E=8, layer data gradient through W2, N 2048 K 7168 [cuBLASLt]", G_GROUPED, 8, 32768, 2048, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_LIBRARY},
    {"grouped_gemm E4M3 1x128 x 128x128 -> BF16, E=8, layer data gradient through W1, N 7168 K 4096 [native sm90]", G_GROUPED, 8, 32768, 7168, 4096, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_NATIVE},
    {"grouped_gemm E4M3 1x128 x 128x128 -> BF16, E=8, layer data gradient through W1, N 7168 K 4096 [cuBLASLt]", G_GROUPED, 8, 32768, 7168, 4096, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_LIBRARY},
    {"grouped_gemm BF16 -> BF16, E=8", G_GROUPED, 8, 32768, 4096, 7168, FM_DTYPE_BF16, FM_SCALE_NONE, FM_SCALE_NONE, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_AUTO},
    /* The router's F32 GEMMs (memory-bound: one pass over the 117 MB of x): the streaming kernels
     * next to cuBLASLt. linear_wgrad: dW [M, N] += dYᵀ [M, K] · X [K, N]. */
    {"gemm F32 -> F32, N 8 (router logits) [streaming]", G_DENSE, 1, 4096, 8, 7168, FM_DTYPE_F32, FM_SCALE_NONE, FM_SCALE_NONE, FM_DTYPE_F32, 0, FM_GEMM_IMPL_AUTO},
    {"gemm F32 -> F32, N 8 (router logits) [cuBLASLt]", G_DENSE, 1, 4096, 8, 7168, FM_DTYPE_F32, FM_SCALE_NONE, FM_SCALE_NONE, FM_DTYPE_F32, 0, FM_GEMM_IMPL_LIBRARY},
    {"linear_wgrad F32 -> F32 +=, M 8 (router weight gradient) [streaming]", G_LINWGRAD, 1, 8, 7168, 4096, FM_DTYPE_F32, FM_SCALE_NONE, FM_SCALE_NONE, FM_DTYPE_F32, 1, FM_GEMM_IMPL_AUTO},
    {"linear_wgrad F32 -> F32 +=, M 8 (router weight gradient) [cuBLASLt]", G_LINWGRAD, 1, 8, 7168, 4096, FM_DTYPE_F32, FM_SCALE_NONE, FM_SCALE_NONE, FM_DTYPE_F32, 1, FM_GEMM_IMPL_LIBRARY},
    /* The flow recipes' weight gradients (x and h per 128x128 tile): the layer's W1 [E, 4096, 7168]
     * and W2 [E, 7168, 2048] over 8 experts of 4096 rows, each native and through cuBLASLt. */
    {"grouped_gemm_wgrad E4M3 1x128 x 128x128 -> F32 +=, E=8, layer W1, N 4096 K 7168 [native sm90]", G_WGRAD, 8, 32768, 4096, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_F32, 1, FM_GEMM_IMPL_NATIVE},
    {"grouped_gemm_wgrad E4M3 1x128 x 128x128 -> F32 +=, E=8, layer W1, N 4096 K 7168 [cuBLASLt]", G_WGRAD, 8, 32768, 4096, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_F32, 1, FM_GEMM_IMPL_LIBRARY},
    {"grouped_gemm_wgrad E4M3 1x128 x 128x128 -> F32 +=, E=8, layer W2, N 7168 K 2048 [native sm90]", G_WGRAD, 8, 32768, 7168, 2048, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_F32, 1, FM_GEMM_IMPL_NATIVE},
    {"grouped_gemm_wgrad E4M3 1x128 x 128x128 -> F32 +=, E=8, layer W2, N 7168 K 2048 [cuBLASLt]", G_WGRAD, 8, 32768, 7168, 2048, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_F32, 1, FM_GEMM_IMPL_LIBRARY},
    {"grouped_gemm_wgrad E4M3 1x128 x 128x128 -> F32, E=8, layer W1, N 4096 K 7168 [native sm90]", G_WGRAD, 8, 32768, 4096, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_F32, 0, FM_GEMM_IMPL_NATIVE},
    {"grouped_gemm_wgrad E4M3 1x128 x 128x128 -> BF16, E=8, layer W1, N 4096 K 7168 [native sm90]", G_WGRAD, 8, 32768, 4096, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, FM_DTYPE_BF16, 0, FM_GEMM_IMPL_NATIVE},
    {"grouped_gemm_wgrad E4M3 1x128 x 1x128 -> F32 +=, E=8", G_WGRAD, 8, 32768, 4096, 7168, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_1x128, FM_DTYPE_F32, 1, FM_GEMM_IMPL_AUTO},
    {"grouped_gemm_wgrad BF16 -> F32 +=, E=8", G_WGRAD, 8, 32768, 4096, 7168, FM_DTYPE_BF16, FM_SCALE_NONE, FM_SCALE_NONE, FM_DTYPE_F32, 1, FM_GEMM_IMPL_AUTO},
};
#define NGCASES (int)(sizeof gcases / sizeof gcases[0])

typedef struct gresult {
    const char *name;
    char shape[64];
    double ms, tflops;
    int ok;
} gresult;

/* Device data of t: finite FP8 codes, or activation-like BF16. */
static void fill_codes(void *d, fm_dtype t, int64_t n)
{
    if (t != FM_DTYPE_E4M3) {
        fill_device(d, t, (size_t)n);
        return;
    }
    size_t chunk = (size_t)1 << 24;
    uint8_t *h = malloc(chunk);
    for (size_t i = 0; i < chunk; i++)
        h[i] = (uint8_t)(rnd() & 0xBF); /* exponent field never all ones: no NaN */
    for (int64_t off = 0; off < n; off += (int64_t)chunk)
        CK(cudaMemcpy((char *)d + off, h, (size_t)(n - off < (int64_t)chunk ? n - off : (int64_t)chunk),
                      cudaMemcpyHostToDevice));
    free(h);
}

static void fill_ones(float *d, int64_t n)
{
    float *h = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++)
        h[i] = 1.0f;
    CK(cudaMemcpy(d, h, sizeof(float) * (size_t)n, cudaMemcpyHostToDevice));
    free(h);
}

static fm_tensor gdesc(fm_dtype t, fm_scale_mode m, fm_layout lay, int64_t e, int64_t r, int64_t c)
{
    fm_tensor d = e > 0 ? fm_tensor_3d(NULL, t, e, r, c) : fm_tensor_2d(NULL, t, r, c);
    d.device = FM_DEVICE_CUDA;
    d.layout = lay;
    d.scale_mode = m;
    d.scale_dtype = FM_DTYPE_F32;
    d.scale_layout = FM_SCALE_LAYOUT_GEMM;
    d.data = dalloc(fm_tensor_nbytes(&d));
    fill_codes(d.data, t, fm_tensor_numel(&d));
    if (m) {
        int64_t n = fm_tensor_scale_count(&d);
        d.scale = dalloc(n * 4);
        fill_ones(d.scale, n);
    }
    return d;
}

typedef struct {
    fm_context *ctx;
    const gcase *c;
    fm_tensor a, b, d;
    fm_splits sp;
    int64_t splits[256];
    /* plain cuBLASLt */
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
    void *ws;
    size_t ws_bytes;
    cudaStream_t s;
    int failed;
} grun;

static void grun_fn(void *p, int rep)
{
    grun *g = p;
    (void)rep;
    fm_gemm_config cfg = {.accumulate = g->c->accumulate, .impl = g->c->impl};
    fm_status st = FM_OK;
    if (g->c->kind == G_DENSE)
        st = fm_gemm(g->ctx, &cfg, &g->a, &g->b, &g->d);
    else if (g->c->kind == G_GROUPED)
        st = fm_grouped_gemm(g->ctx, &cfg, &g->sp, &g->a, &g->b, &g->d);
    else if (g->c->kind == G_WGRAD)
        st = fm_grouped_gemm_wgrad(g->ctx, &cfg, &g->sp, &g->a, &g->b, &g->d);
    else if (g->c->kind == G_LINWGRAD)
        st = fm_linear_wgrad(g->ctx, &cfg, &g->a, &g->b, &g->d);
    else {
        float alpha = 1.0f, beta = 0.0f;
        cublasStatus_t cs = cublasLtMatmul(g->lt, g->desc, &alpha, g->b.data, g->la, g->a.data, g->lb, &beta,
                                           g->d.data, g->ld, g->d.data, g->ld, &g->algo, g->ws, g->ws_bytes, g->s);
        if (cs != CUBLAS_STATUS_SUCCESS && !g->failed) {
            fprintf(stderr, "fm-bench: %s: cublasLtMatmul: %s\n", g->c->name, cublasLtGetStatusString(cs));
            g->failed = 1;
        }
        return;
    }
    if (st != FM_OK && !g->failed) {
        fprintf(stderr, "fm-bench: %s: %s\n", g->c->name, fm_last_error(g->ctx));
        g->failed = 1;
    }
}

/* Plain cuBLASLt BF16 TN, row-major D = A · Bᵀ, best heuristic algorithm. */
static int lt_setup(grun *g)
{
    const gcase *c = g->c;
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    g->ws_bytes = (size_t)32 << 20;
    g->ws = dalloc((int64_t)g->ws_bytes);
    if (cublasLtCreate(&g->lt) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescCreate(&g->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(g->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(g->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&g->la, CUDA_R_16BF, (uint64_t)c->K, (uint64_t)c->N, c->K) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&g->lb, CUDA_R_16BF, (uint64_t)c->K, (uint64_t)c->M, c->K) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&g->ld, CUDA_R_16BF, (uint64_t)c->N, (uint64_t)c->M, c->N) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS)
        return 0;
    uint64_t wsb = g->ws_bytes;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb);
    cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(g->lt, g->desc, g->la, g->lb, g->ld, g->ld, pref, 1, &res,
                                                       &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (hs != CUBLAS_STATUS_SUCCESS || !found)
        return 0;
    g->algo = res.algo;
    return 1;
}

static void lt_teardown(grun *g)
{
    if (!g->lt)
        return;
    cublasLtMatrixLayoutDestroy(g->la);
    cublasLtMatrixLayoutDestroy(g->lb);
    cublasLtMatrixLayoutDestroy(g->ld);
    cublasLtMatmulDescDestroy(g->desc);
    cublasLtDestroy(g->lt);
    cudaFree(g->ws);
}

static void gfree(fm_tensor *t)
{
    if (t->data)
        cudaFree(t->data);
    if (t->scale_mode && t->scale)
        cudaFree(t->scale);
}

static int bench_gemms(fm_context *ctx, cudaStream_t s, const char *filter, gresult *out)
{
    int n = 0;
    for (int ci = 0; ci < NGCASES; ci++) {
        const gcase *c = &gcases[ci];
        if (!picked(c->name, filter))
            continue;
        grun g;
        memset(&g, 0, sizeof g);
        g.ctx = ctx;
        g.c = c;
        g.s = s;
        g.sp.groups = c->E;
        g.sp.host = g.splits;
        for (int64_t e = 0; e < c->E; e++)
            g.splits[e] = c->M / c->E;
        if (c->kind == G_LINWGRAD) { /* dY [K, M], X [K, N] row-wise -> dW [M, N] */
            g.a = gdesc(c->elem, FM_SCALE_NONE, FM_LAYOUT_ROWWISE, 0, c->K, c->M);
            g.b = gdesc(c->elem, FM_SCALE_NONE, FM_LAYOUT_ROWWISE, 0, c->K, c->N);
            g.d = gdesc(c->out, FM_SCALE_NONE, FM_LAYOUT_ROWWISE, 0, c->M, c->N);
        } else if (c->kind == G_WGRAD) { /* dY [sum M, N], X [sum M, K] (grouped column-wise for FP8) -> dW [E, N, K] */
            fm_layout lay = c->ma ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE;
            g.a = gdesc(c->elem, c->ma, lay, 0, c->M, c->N);
            g.b = gdesc(c->elem, c->mb, lay, 0, c->M, c->K);
            if (c->ma) { /* the grouped layout holds one scale array per expert */
                int64_t per_a = fm_scale_count_2d(c->ma, FM_SCALE_LAYOUT_GEMM, c->N, c->M / c->E);
                int64_t per_b = fm_scale_count_2d(c->mb, FM_SCALE_LAYOUT_GEMM, c->K, c->M / c->E);
                cudaFree(g.a.scale);
                cudaFree(g.b.scale);
                g.a.scale = dalloc(per_a * c->E * 4);
                g.b.scale = dalloc(per_b * c->E * 4);
                fill_ones(g.a.scale, per_a * c->E);
                fill_ones(g.b.scale, per_b * c->E);
            }
            g.d = gdesc(c->out, FM_SCALE_NONE, FM_LAYOUT_ROWWISE, c->E, c->N, c->K);
        } else {
            g.a = gdesc(c->elem, c->ma, FM_LAYOUT_ROWWISE, 0, c->M, c->K);
            g.b = gdesc(c->elem, c->mb, FM_LAYOUT_ROWWISE, c->kind == G_GROUPED ? c->E : 0, c->N, c->K);
            g.d = gdesc(c->out, FM_SCALE_NONE, FM_LAYOUT_ROWWISE, 0, c->M, c->N);
        }
        if (c->kind == G_LT_BF16 && !lt_setup(&g)) {
            fprintf(stderr, "fm-bench: %s: cuBLASLt set-up failed\n", c->name);
            g.failed = 1;
        }
        float ms = g.failed ? 0.0f : time_median(grun_fn, &g, s);
        CK(cudaGetLastError());
        gresult *r = &out[n++];
        r->name = c->name;
        if (c->kind == G_DENSE || c->kind == G_LT_BF16 || c->kind == G_LINWGRAD)
            snprintf(r->shape, sizeof r->shape, "%lldx%lldx%lld", (long long)c->M, (long long)c->N, (long long)c->K);
        else
            snprintf(r->shape, sizeof r->shape, "E%lld sumM %lld N %lld K %lld", (long long)c->E, (long long)c->M,
                     (long long)c->N, (long long)c->K);
        r->ms = ms;
        r->tflops = ms > 0 ? 2.0 * (double)c->M * (double)c->N * (double)c->K / (ms * 1e-3) / 1e12 : 0;
        r->ok = !g.failed;
        fprintf(stderr, "fm-bench: %-60s %8.1f us %7.1f TFLOP/s\n", c->name, ms * 1e3, r->tflops);
        lt_teardown(&g);
        gfree(&g.a);
        gfree(&g.b);
        gfree(&g.d);
    }
    return n;
}

typedef struct result {
    const char *name;
    char shape[64];
    double bytes, ms, gbs, frac, target;
    int ok;
} result;

/* ---- MoE ops at issue 7's shapes ----------------------------------------------
 * T = 16384 tokens, H = 7168, E = 32 experts, k = 8, I = 2048, experts padded
 * to 128 rows. The routing is a fixed-seed random top-k with realistic
 * imbalance (log-normal expert popularity), prepared once outside the timed
 * region; the permute writes its row maps, splits and permuted probabilities
 * every time (they are its outputs). SwiGLU runs over the ΣM padded rows that
 * routing produces, weighted by the permuted probabilities. The unfused rows
 * do the same with the library's own ops: the SwiGLU with a BF16 output, then
 * fm_quantize; their speed-ups are printed after the table. */

#define MB_T 16384
#define MB_H 7168
#define MB_E 32
#define MB_K 8
#define MB_I 2048
#define MB_PAD 128

typedef enum { M_PERMUTE, M_UNPERMUTE, M_SWIGLU, M_SWIGLU_UNFUSED, M_DSWIGLU, M_DSWIGLU_UNFUSED } moe_op;

typedef struct mcase {
    const char *name;
    moe_op op;
    fm_dtype in;   /* permute: x; unpermute: y; SwiGLU: in; dSwiGLU: dh (its in is the saved E4M3 1x128 copy) */
    fm_dtype out;  /* unpermute: out; SwiGLU, dSwiGLU: the quantized output's elements */
    int col;       /* SwiGLU, dSwiGLU: the column-wise copy too */
    double target;
} mcase;

static const mcase mcases[] = {
    {"moe_permute + pad 128, E4M3 1x128 data + scales, probs", M_PERMUTE, FM_DTYPE_E4M3, FM_DTYPE_E4M3, 0, 0.80},
    {"moe_unpermute + combine BF16 -> BF16, probs", M_UNPERMUTE, FM_DTYPE_BF16, FM_DTYPE_BF16, 0, 0.80},
    {"moe_unpermute + combine BF16 -> F32, probs", M_UNPERMUTE, FM_DTYPE_BF16, FM_DTYPE_F32, 0, 0.80},
    {"moe_swiglu BF16 -> E4M3 1x128 row, probs", M_SWIGLU, FM_DTYPE_BF16, FM_DTYPE_E4M3, 0, 0.85},
    {"moe_swiglu BF16 -> E4M3 1x128 row+col, probs", M_SWIGLU, FM_DTYPE_BF16, FM_DTYPE_E4M3, 1, 0},
    {"moe_swiglu E4M3 1x128 -> E4M3 1x128 row, probs (from FP8 input)", M_SWIGLU, FM_DTYPE_E4M3, FM_DTYPE_E4M3, 0, 0},
    {"unfused moe_swiglu BF16 -> BF16, fm_quantize -> E4M3 1x128 row", M_SWIGLU_UNFUSED, FM_DTYPE_BF16, FM_DTYPE_E4M3, 0, 0},
    {"moe_swiglu_backward dh BF16, in E4M3 1x128 -> E4M3 1x128 row, dprobs", M_DSWIGLU, FM_DTYPE_BF16, FM_DTYPE_E4M3, 0, 0.80},
    {"moe_swiglu_backward dh BF16, in E4M3 1x128 -> E4M3 1x128 row+col, dprobs", M_DSWIGLU, FM_DTYPE_BF16, FM_DTYPE_E4M3, 1, 0},
    {"unfused moe_swiglu_backward -> BF16, fm_quantize -> E4M3 1x128 row", M_DSWIGLU_UNFUSED, FM_DTYPE_BF16, FM_DTYPE_E4M3, 0, 0},
};
#define NMCASES (int)(sizeof mcases / sizeof mcases[0])

/* The routing every MoE case shares, on the device. */
typedef struct moe_routing {
    int64_t R, M;  /* R = T·k + E·(pad - 1) rows of the permute's output; M = Σ P_e */
    fm_tensor ids, probs, row_map, slot_rows, splits, out_probs;
    fm_tensor pm;  /* the first M rows of out_probs: the SwiGLU's per-row weights */
} moe_routing;

static fm_tensor mdev(fm_dtype t, fm_scale_mode m, int64_t rows, int64_t cols, fm_layout lay)
{
    fm_tensor d = m == FM_SCALE_NONE ? fm_tensor_2d(NULL, t, rows, cols)
                                     : fm_tensor_quant_2d(NULL, t, rows, cols, lay, m, NULL, FM_SCALE_LAYOUT_COMPACT);
    d.device = FM_DEVICE_CUDA;
    d.data = dalloc(fm_tensor_nbytes(&d));
    if (m != FM_SCALE_NONE)
        d.scale = dalloc(fm_tensor_scale_nbytes(&d));
    return d;
}

/* Unscaled inputs get activation-like values; quantized ones are those values
 * quantized (real codes and power-of-two scales). */
static int mfill(fm_context *ctx, cudaStream_t s, fm_tensor *t)
{
    int64_t n = fm_tensor_numel(t);
    if (t->scale_mode == FM_SCALE_NONE) {
        fill_device(t->data, t->dtype, (size_t)n);
        return 1;
    }
    fm_tensor src = fm_tensor_2d(dalloc(n * 2), FM_DTYPE_BF16, t->shape[0], t->shape[1]);
    src.device = FM_DEVICE_CUDA;
    fill_device(src.data, FM_DTYPE_BF16, (size_t)n);
    fm_status st = fm_quantize(ctx, NULL, &src, t, NULL);
    CK(cudaStreamSynchronize(s));
    cudaFree(src.data);
    if (st != FM_OK)
        fprintf(stderr, "fm-bench: setup quantize: %s\n", fm_last_error(ctx));
    return st == FM_OK;
}

static int routing_make(fm_context *ctx, cudaStream_t s, moe_routing *r)
{
    int64_t T = MB_T, E = MB_E, k = MB_K;
    double w[MB_E];
    for (int64_t e = 0; e < E; e++) { /* log-normal popularity: the busiest experts get a few times the average */
        double u = ((double)(rnd() >> 11) + 0.5) / 9007199254740992.0, v = (double)(rnd() >> 11) / 9007199254740992.0;
        w[e] = exp(0.5 * sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(T * k));
    float *pr = malloc(sizeof(float) * (size_t)(T * k));
    for (int64_t t = 0; t < T; t++) {
        double left[MB_E], sum = 0, psum = 0;
        memcpy(left, w, sizeof left);
        for (int64_t e = 0; e < E; e++)
            sum += left[e];
        for (int64_t j = 0; j < k; j++) { /* k distinct experts, drawn by popularity without replacement */
            double u = (double)(rnd() >> 11) / 9007199254740992.0 * sum;
            int64_t e = 0;
            while (e < E - 1 && (left[e] == 0 || u >= left[e])) {
                u -= left[e];
                e++;
            }
            while (left[e] == 0)
                e--;
            sum -= left[e];
            left[e] = 0;
            ids[t * k + j] = (int32_t)e;
            pr[t * k + j] = (float)(0.05 + (double)(rnd() >> 11) / 9007199254740992.0);
            psum += pr[t * k + j];
        }
        for (int64_t j = 0; j < k; j++)
            pr[t * k + j] = (float)(pr[t * k + j] / psum);
    }
    r->R = T * k + E * (MB_PAD - 1);
    r->ids = mdev(FM_DTYPE_I32, FM_SCALE_NONE, T, k, FM_LAYOUT_ROWWISE);
    r->probs = mdev(FM_DTYPE_F32, FM_SCALE_NONE, T, k, FM_LAYOUT_ROWWISE);
    CK(cudaMemcpy(r->ids.data, ids, sizeof(int32_t) * (size_t)(T * k), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(r->probs.data, pr, sizeof(float) * (size_t)(T * k), cudaMemcpyHostToDevice));
    free(ids);
    free(pr);
    r->row_map = mdev(FM_DTYPE_I32, FM_SCALE_NONE, r->R, 1, FM_LAYOUT_ROWWISE);
    r->slot_rows = mdev(FM_DTYPE_I32, FM_SCALE_NONE, T, k, FM_LAYOUT_ROWWISE);
    r->splits = mdev(FM_DTYPE_I64, FM_SCALE_NONE, 1, E, FM_LAYOUT_ROWWISE);
    r->out_probs = mdev(FM_DTYPE_F32, FM_SCALE_NONE, r->R, 1, FM_LAYOUT_ROWWISE);
    /* The maps and ΣP_e come from one permute of a narrow x. */
    fm_tensor x = mdev(FM_DTYPE_BF16, FM_SCALE_NONE, T, 32, FM_LAYOUT_ROWWISE);
    fm_tensor o = mdev(FM_DTYPE_BF16, FM_SCALE_NONE, r->R, 32, FM_LAYOUT_ROWWISE);
    int64_t hs[MB_E];
    fm_permute_config pc = {MB_PAD};
    fm_status st = fm_moe_permute(ctx, &pc, &x, &r->ids, &r->probs, &o, &r->row_map, &r->slot_rows, &r->splits,
                                  &r->out_probs, hs);
    CK(cudaStreamSynchronize(s));
    cudaFree(x.data);
    cudaFree(o.data);
    if (st != FM_OK) {
        fprintf(stderr, "fm-bench: setup permute: %s\n", fm_last_error(ctx));
        return 0;
    }
    r->M = 0;
    int64_t lo = hs[0], hi = hs[0];
    for (int64_t e = 0; e < E; e++) {
        r->M += hs[e];
        lo = hs[e] < lo ? hs[e] : lo;
        hi = hs[e] > hi ? hs[e] : hi;
    }
    fprintf(stderr, "fm-bench: MoE routing: %lld padded rows (%lld routed), expert rows %lld..%lld\n",
            (long long)r->M, (long long)(T * k), (long long)lo, (long long)hi);
    r->pm = r->out_probs;
    r->pm.shape[0] = r->M;
    return 1;
}

static void routing_free(moe_routing *r)
{
    fm_tensor *ts[] = {&r->ids, &r->probs, &r->row_map, &r->slot_rows, &r->splits, &r->out_probs};
    for (int i = 0; i < 6; i++)
        free_t(ts[i]);
}

typedef struct mrun {
    fm_context *ctx;
    const mcase *c;
    moe_routing *r;
    fm_tensor a[2], b[2], o[2], oc[2], tmp[2], dp; /* inputs, outputs, the unfused BF16 intermediate, dprobs */
    int failed;
} mrun;

static void mrun_fn(void *p, int rep)
{
    mrun *m = p;
    moe_routing *r = m->r;
    int k = rep & 1, col = m->c->col;
    fm_permute_config pc = {MB_PAD};
    fm_status st = FM_OK;
    switch (m->c->op) {
    case M_PERMUTE:
        st = fm_moe_permute(m->ctx, &pc, &m->a[k], &r->ids, &r->probs, &m->o[k], &r->row_map, &r->slot_rows,
                            &r->splits, &r->out_probs, NULL);
        break;
    case M_UNPERMUTE: st = fm_moe_unpermute(m->ctx, &m->a[k], &r->slot_rows, &r->probs, &m->o[k]); break;
    case M_SWIGLU: st = fm_moe_swiglu(m->ctx, NULL, &m->a[k], &r->pm, &m->o[k], col ? &m->oc[k] : NULL, NULL); break;
    case M_SWIGLU_UNFUSED:
        st = fm_moe_swiglu(m->ctx, NULL, &m->a[k], &r->pm, &m->tmp[k], NULL, NULL);
        if (st == FM_OK)
            st = fm_quantize(m->ctx, NULL, &m->tmp[k], &m->o[k], NULL);
        break;
    case M_DSWIGLU:
        st = fm_moe_swiglu_backward(m->ctx, NULL, &m->a[k], &m->b[k], &r->pm, &m->o[k], col ? &m->oc[k] : NULL, &m->dp);
        break;
    case M_DSWIGLU_UNFUSED:
        st = fm_moe_swiglu_backward(m->ctx, NULL, &m->a[k], &m->b[k], &r->pm, &m->tmp[k], NULL, &m->dp);
        if (st == FM_OK)
            st = fm_quantize(m->ctx, NULL, &m->tmp[k], &m->o[k], NULL);
        break;
    }
    if (st != FM_OK && !m->failed) {
        fprintf(stderr, "fm-bench: %s: %s\n", m->c->name, fm_last_error(m->ctx));
        m->failed = 1;
    }
}

/* Fills out[] like the memory-bound cases (bytes from fm_stats: what the op
 * reads and writes); returns the count, adds missed targets to *below. */
static int bench_moe(fm_context *ctx, cudaStream_t s, const char *filter, double copy_gbs, result *out, int *below,
                     double *swiglu_speedup, double *dswiglu_speedup)
{
    int n = 0, any = 0;
    for (int ci = 0; ci < NMCASES; ci++)
        any |= picked(mcases[ci].name, filter);
    moe_routing r;
    memset(&r, 0, sizeof r);
    if (!any || !routing_make(ctx, s, &r))
        return 0;
    const fm_scale_mode q = FM_SCALE_BLOCK_1x128;
    for (int ci = 0; ci < NMCASES; ci++) {
        const mcase *c = &mcases[ci];
        if (!picked(c->name, filter))
            continue;
        mrun m;
        memset(&m, 0, sizeof m);
        m.ctx = ctx;
        m.c = c;
        m.r = &r;
        int ok = 1;
        int64_t M = r.M, T = MB_T, H = MB_H, I = MB_I;
        for (int k = 0; k < 2; k++) { /* two of everything, alternating: each well beyond L2 */
            switch (c->op) {
            case M_PERMUTE:
                m.a[k] = mdev(c->in, q, T, H, FM_LAYOUT_ROWWISE);
                m.o[k] = mdev(c->in, q, r.R, H, FM_LAYOUT_ROWWISE);
                break;
            case M_UNPERMUTE:
                m.a[k] = mdev(c->in, FM_SCALE_NONE, M, H, FM_LAYOUT_ROWWISE);
                m.o[k] = mdev(c->out, FM_SCALE_NONE, T, H, FM_LAYOUT_ROWWISE);
                break;
            case M_SWIGLU:
            case M_SWIGLU_UNFUSED:
                m.a[k] = mdev(c->in, c->in == FM_DTYPE_BF16 ? FM_SCALE_NONE : q, M, 2 * I, FM_LAYOUT_ROWWISE);
                m.o[k] = mdev(c->out, q, M, I, FM_LAYOUT_ROWWISE);
                if (c->col)
                    m.oc[k] = mdev(c->out, q, M, I, FM_LAYOUT_COLWISE);
                if (c->op == M_SWIGLU_UNFUSED)
                    m.tmp[k] = mdev(FM_DTYPE_BF16, FM_SCALE_NONE, M, I, FM_LAYOUT_ROWWISE);
                break;
            case M_DSWIGLU:
            case M_DSWIGLU_UNFUSED:
                m.a[k] = mdev(c->in, FM_SCALE_NONE, M, I, FM_LAYOUT_ROWWISE);
                m.b[k] = mdev(FM_DTYPE_E4M3, q, M, 2 * I, FM_LAYOUT_ROWWISE);
                m.o[k] = mdev(c->out, q, M, 2 * I, FM_LAYOUT_ROWWISE);
                if (c->col)
                    m.oc[k] = mdev(c->out, q, M, 2 * I, FM_LAYOUT_COLWISE);
                if (c->op == M_DSWIGLU_UNFUSED)
                    m.tmp[k] = mdev(FM_DTYPE_BF16, FM_SCALE_NONE, M, 2 * I, FM_LAYOUT_ROWWISE);
                ok &= mfill(ctx, s, &m.b[k]);
                break;
            }
            ok &= mfill(ctx, s, &m.a[k]);
        }
        m.dp = mdev(FM_DTYPE_F32, FM_SCALE_NONE, M, 1, FM_LAYOUT_ROWWISE);
        m.failed = !ok;
        fm_stats s0, s1;
        fm_stats_get(ctx, &s0);
        mrun_fn(&m, 0);
        fm_stats_get(ctx, &s1);
        CK(cudaStreamSynchronize(s));
        double bytes = (double)(s1.bytes_read - s0.bytes_read + s1.bytes_written - s0.bytes_written);
        float ms = m.failed ? 0.0f : time_median(mrun_fn, &m, s);
        CK(cudaGetLastError());
        result *rs = &out[n++];
        rs->name = c->name;
        if (c->op == M_PERMUTE || c->op == M_UNPERMUTE)
            snprintf(rs->shape, sizeof rs->shape, "T%d H%d E%d k%d, %lld rows", MB_T, MB_H, MB_E, MB_K, (long long)M);
        else
            snprintf(rs->shape, sizeof rs->shape, "%lldx%lld", (long long)M, (long long)(2 * I));
        rs->bytes = bytes;
        rs->ms = ms;
        rs->gbs = ms > 0 ? bytes / (ms * 1e-3) / 1e9 : 0;
        rs->frac = rs->gbs / copy_gbs;
        rs->target = c->target;
        rs->ok = !m.failed;
        if (c->target > 0 && (rs->frac < c->target || !rs->ok))
            (*below)++;
        fprintf(stderr, "fm-bench: %-60s %8.1f us\n", c->name, ms * 1e3);
        for (int k = 0; k < 2; k++) {
            free_t(&m.a[k]);
            free_t(&m.b[k]);
            free_t(&m.o[k]);
            free_t(&m.oc[k]);
            free_t(&m.tmp[k]);
        }
        free_t(&m.dp);
    }
    routing_free(&r);
    /* Fused over unfused, each pair measured above. */
    const result *f = NULL, *u = NULL, *bf = NULL, *bu = NULL;
    for (int i = 0; i < n; i++)
        for (int ci = 0; ci < NMCASES; ci++) {
            const mcase *c = &mcases[ci];
            if (strcmp(out[i].name, c->name) || c->col || c->in != FM_DTYPE_BF16)
                continue; /* the pairs: BF16 in, row-wise out */
            if (c->op == M_SWIGLU)
                f = &out[i];
            else if (c->op == M_SWIGLU_UNFUSED)
                u = &out[i];
            else if (c->op == M_DSWIGLU)
                bf = &out[i];
            else if (c->op == M_DSWIGLU_UNFUSED)
                bu = &out[i];
        }
    if (f && u && f->ok && u->ok && f->ms > 0)
        *swiglu_speedup = u->ms / f->ms;
    if (bf && bu && bf->ok && bu->ok && bf->ms > 0)
        *dswiglu_speedup = bu->ms / bf->ms;
    return n;
}

/* ---- the whole layer, forward + backward, per recipe ------------------------- */

#define LB_T 4096
#define LB_H 7168
#define LB_I 2048
#define LB_E 8
#define LB_K 8

/* The layer rows: every recipe, then variants of one: fp8-flow with the
 * TIGHT 128 x 1 column copies of x and h (cfg.wgrad_tight_columns) next to
 * the default ROWMAX 128 x 128 ones, bf16 and fp8-flow with their backward
 * on one stream (cfg.single_stream) next to the default two, and the flow
 * recipes with h recomputed in backward (cfg.recompute_h) instead of kept. */
#define LB_ROWS (FM_RECIPE_COUNT + 5)
static const struct {
    fm_recipe recipe;
    int tight, single, recompute;
    const char *label;
} lb_variant[LB_ROWS - FM_RECIPE_COUNT] = {
    {FM_RECIPE_FP8_FLOW, 1, 0, 0, "fp8-flow, x and h 128x1 TIGHT for the weight gradients"},
    {FM_RECIPE_BF16, 0, 1, 0, "bf16, backward on one stream"},
    {FM_RECIPE_FP8_FLOW, 0, 1, 0, "fp8-flow, backward on one stream"},
    {FM_RECIPE_FP8_FLOW, 0, 0, 1, "fp8-flow, h recomputed in backward"},
    {FM_RECIPE_FP8_FLOW_FP4, 0, 0, 1, "fp8-flow-fp4, h recomputed in backward"},
};

typedef struct lresult {
    const char *label; /* the table's first column */
    fm_recipe recipe;
    double ms, speedup; /* ms per forward + backward; bf16's time over this recipe's */
    int64_t workspace;
    int64_t saved;      /* activation bytes the forward kept for backward (fm_moe_layer_info) */
    double saved_frac;  /* of bf16's */
    int ok;
} lresult;

typedef struct lrun {
    fm_context *ctx;
    fm_moe_layer *layer;
    fm_moe_weights w;
    fm_tensor x, y, dy, dx;
    const char *name;
    int failed;
} lrun;

static void lrun_fn(void *p, int rep)
{
    lrun *l = p;
    (void)rep;
    fm_status st = fm_moe_layer_forward(l->layer, &l->w, &l->x, &l->y);
    if (st == FM_OK)
        st = fm_moe_layer_backward(l->layer, &l->w, &l->x, &l->dy, &l->dx);
    if (st != FM_OK && !l->failed) {
        fprintf(stderr, "fm-bench: %s: %s\n", l->name, fm_last_error(l->ctx));
        l->failed = 1;
    }
}

/* N(0, sd) F32 on the device: weights at an initialisation's scale. */
static void fill_normal_f32(float *d, int64_t n, float sd)
{
    size_t chunk = (size_t)1 << 22;
    float *h = malloc(chunk * sizeof(float));
    for (size_t i = 0; i < chunk; i++) {
        double u = ((double)(rnd() >> 11) + 0.5) / 9007199254740992.0, v = (double)(rnd() >> 11) / 9007199254740992.0;
        h[i] = (float)(sd * sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
    }
    for (int64_t off = 0; off < n; off += (int64_t)chunk) {
        size_t m = (size_t)(n - off) < chunk ? (size_t)(n - off) : chunk;
        CK(cudaMemcpy(d + off, h, m * sizeof(float), cudaMemcpyHostToDevice));
    }
    free(h);
}

static int bench_layer(fm_context *ctx, cudaStream_t s, const char *filter, lresult *out)
{
    static const char *names[LB_ROWS] = {"moe_layer forward+backward bf16", "moe_layer forward+backward fp8-blockwise",
                                         "moe_layer forward+backward fp8-flow", "moe_layer forward+backward fp8-flow-fp4",
                                         "moe_layer forward+backward fp8-flow, wgrad tight columns",
                                         "moe_layer forward+backward bf16, one stream",
                                         "moe_layer forward+backward fp8-flow, one stream",
                                         "moe_layer forward+backward fp8-flow, h recomputed",
                                         "moe_layer forward+backward fp8-flow-fp4, h recomputed"};
    int any = 0;
    for (int r = 0; r < LB_ROWS; r++)
        any |= picked(names[r], filter);
    if (!any)
        return 0;
    lrun l;
    memset(&l, 0, sizeof l);
    l.ctx = ctx;
    int64_t nr = (int64_t)LB_E * LB_H, n1 = (int64_t)LB_E * 2 * LB_I * LB_H, n2 = (int64_t)LB_E * LB_H * LB_I;
    float **ws[6] = {&l.w.router, &l.w.w1, &l.w.w2, &l.w.grad_router, &l.w.grad_w1, &l.w.grad_w2};
    int64_t wn[6] = {nr, n1, n2, nr, n1, n2};
    for (int i = 0; i < 6; i++) {
        *ws[i] = dalloc(wn[i] * 4);
        if (i < 3)
            fill_normal_f32(*ws[i], wn[i], (float)(1.0 / sqrt(i == 2 ? LB_I : LB_H)));
        else
            CK(cudaMemset(*ws[i], 0, (size_t)wn[i] * 4));
    }
    fm_tensor *io[4] = {&l.x, &l.y, &l.dy, &l.dx};
    for (int i = 0; i < 4; i++) {
        *io[i] = fm_tensor_2d(dalloc((int64_t)LB_T * LB_H * 4), FM_DTYPE_F32, LB_T, LB_H);
        io[i]->device = FM_DEVICE_CUDA;
    }
    fill_device(l.x.data, FM_DTYPE_F32, (size_t)LB_T * LB_H);
    fill_device(l.dy.data, FM_DTYPE_F32, (size_t)LB_T * LB_H);
    /* Every picked layer is made first and all are timed in the same
     * rounds (time_medians): the speedups are ratios within one stretch of
     * the run, not of recipes measured one after another. */
    lrun runs[LB_ROWS];
    void *args[LB_ROWS];
    int rowof[LB_ROWS], timed[LB_ROWS], n = 0, nt = 0; /* timed: index into args, -1 if not timed */
    for (int r = 0; r < LB_ROWS; r++) {
        if (!picked(names[r], filter))
            continue;
        const int v = r - FM_RECIPE_COUNT;
        const fm_recipe rc = v < 0 ? (fm_recipe)r : lb_variant[v].recipe;
        fm_moe_layer_config cfg = {.hidden = LB_H, .ffn = LB_I, .experts = LB_E, .topk = LB_K,
                                   .score = FM_ROUTER_SOFTMAX, .renormalize = 1, .recipe = rc,
                                   .max_tokens = LB_T, .wgrad_tight_columns = v >= 0 && lb_variant[v].tight,
                                   .single_stream = v >= 0 && lb_variant[v].single,
                                   .recompute_h = v >= 0 && lb_variant[v].recompute};
        lresult *o = &out[n];
        memset(o, 0, sizeof *o);
        o->recipe = rc;
        o->label = v < 0 ? fm_recipe_name(rc) : lb_variant[v].label;
        lrun *u = &runs[n];
        *u = l;
        u->name = names[r];
        if (fm_moe_layer_create(ctx, &cfg, &u->layer) != FM_OK || fm_moe_layer_refresh_weights(u->layer, &u->w) != FM_OK) {
            fprintf(stderr, "fm-bench: %s: %s\n", names[r], fm_last_error(ctx));
            u->failed = 1;
        }
        timed[n] = u->failed ? -1 : nt;
        if (!u->failed)
            args[nt++] = u;
        rowof[n++] = r;
    }
    CK(cudaStreamSynchronize(s));
    float tms[LB_ROWS];
    if (nt > 0)
        time_medians(lrun_fn, args, nt, s, tms);
    CK(cudaGetLastError());
    double bf16_ms = 0;
    int64_t bf16_saved = 0;
    for (int j = 0; j < n; j++) {
        lrun *u = &runs[j];
        lresult *o = &out[j];
        const float ms = timed[j] < 0 || u->failed ? 0.0f : tms[timed[j]];
        fm_moe_layer_info info;
        if (u->layer && fm_moe_layer_get_info(u->layer, &info) == FM_OK)
            o->workspace = info.workspace_bytes, o->saved = info.saved_bytes;
        o->ms = ms;
        o->ok = !u->failed;
        if (rowof[j] == FM_RECIPE_BF16 && o->ok)
            bf16_ms = ms, bf16_saved = o->saved;
        fprintf(stderr, "fm-bench: %-60s %8.2f ms\n", u->name, ms);
        if (u->layer)
            fm_moe_layer_destroy(u->layer);
    }
    for (int j = 0; j < n; j++) {
        lresult *o = &out[j];
        o->speedup = bf16_ms > 0 && o->ok && o->ms > 0 ? bf16_ms / o->ms : 0;
        o->saved_frac = bf16_saved > 0 && o->ok ? (double)o->saved / (double)bf16_saved : 0;
    }
    for (int i = 0; i < 6; i++)
        cudaFree(*ws[i]);
    for (int i = 0; i < 4; i++)
        cudaFree(io[i]->data);
    return n;
}

/* ---- expert parallelism over NCCL ------------------------------------------ */

/* Issue 9's shape: per rank 16384 tokens (halved while the buffers would not
 * fit), H 7168, k 8, 8 experts per rank, each token's k experts distinct and
 * uniformly random. One thread per GPU, one rank each. */
typedef struct ep_result {
    const char *name;
    double mb, ms, speedup, raw_ms, frac; /* MB of rows rank 0 sends; speedup: BF16 dispatch / this; frac: raw / this */
    int ok;
} ep_result;
enum { EP_NRES = 5 };

#ifdef FM_HAVE_NCCL
#include <nccl.h>
#include <pthread.h>

#define EP_H 7168
#define EP_K 8
#define EP_EL 8
#define EP_MAXR 8

/* The timed calls: the library's, then NCCL alone moving the same bytes
 * (the rows' codes and scales, per peer) between buffers of the same sizes. */
enum { EPX_BF16, EPX_FP8, EPX_FP4, EPX_FP4_CONV, EPX_COMBINE, EPX_RAW_BF16, EPX_RAW_FP8, EPX_RAW_FP4, EPX_RAW_BACK,
       EPX_COUNT };
static const char *const ep_names[EP_NRES] = {
    "ep_dispatch BF16", "ep_dispatch FP8 E4M3 1x128", "ep_dispatch MXFP4 (E2M1 MX32)",
    "ep_dispatch MXFP4 incl. FP8->MXFP4 before, MXFP4->FP8 after", "ep_combine BF16"};
static const int ep_raw_of[EP_NRES] = {EPX_RAW_BF16, EPX_RAW_FP8, EPX_RAW_FP4, EPX_RAW_FP4, EPX_RAW_BACK};
/* bytes per row on the wire: BF16; E4M3 + F32 per 128; E2M1 + E8M0 per 32 */
static const int64_t ep_row_bytes[3] = {EP_H * 2, EP_H + EP_H / 128 * 4, EP_H / 2 + EP_H / 32};

typedef struct ep_world ep_world;

typedef struct ep_rank {
    ep_world *w;
    int r;
    fm_context *ctx;
    cudaStream_t s;
    ncclComm_t nc;
    fm_comm *comm;
    fm_tensor ids, probs, xb, x8, x4, ob, o8, o4, o8b, oids, op, out;
    void *raw_send, *raw_recv;
    int64_t R, sent, scnt[EP_MAXR], rcnt[EP_MAXR];
    float ms[EPX_COUNT]; /* rank 0's medians */
    int failed;
} ep_rank;

struct ep_world {
    int n, reps;
    int64_t T;
    unsigned mask; /* the calls to time */
    pthread_barrier_t bar;
    ep_rank rk[EP_MAXR];
};

static fm_tensor ep_mat(int64_t rows, int64_t cols, fm_dtype t)
{
    fm_tensor x = fm_tensor_2d(NULL, t, rows, cols);
    x.device = FM_DEVICE_CUDA;
    x.data = dalloc(fm_tensor_nbytes(&x));
    return x;
}

static fm_tensor ep_quant(int64_t rows, fm_dtype t, fm_scale_mode m)
{
    fm_tensor x = fm_tensor_quant_2d(NULL, t, rows, EP_H, FM_LAYOUT_ROWWISE, m, NULL, FM_SCALE_LAYOUT_COMPACT);
    x.device = FM_DEVICE_CUDA;
    x.data = dalloc(fm_tensor_nbytes(&x));
    x.scale = dalloc(fm_tensor_scale_nbytes(&x));
    return x;
}

/* The first `rows` rows of t. */
static fm_tensor ep_head(const fm_tensor *t, int64_t rows)
{
    fm_tensor v = *t;
    v.shape[0] = rows;
    return v;
}

/* Grouped ncclSend/ncclRecv: cnt_s[p] rows of row_bytes to p, cnt_r[p] from p. */
static ncclResult_t ep_raw(ep_rank *e, const void *send, void *recv, const int64_t *cnt_s, const int64_t *cnt_r,
                           int64_t row_bytes)
{
    int64_t so = 0, ro = 0;
    ncclResult_t r = ncclGroupStart();
    for (int p = 0; p < e->w->n && r == ncclSuccess; p++) {
        if (cnt_s[p])
            r = ncclSend((const char *)send + so * row_bytes, (size_t)(cnt_s[p] * row_bytes), ncclUint8, p, e->nc,
                         e->s);
        if (r == ncclSuccess && cnt_r[p])
            r = ncclRecv((char *)recv + ro * row_bytes, (size_t)(cnt_r[p] * row_bytes), ncclUint8, p, e->nc, e->s);
        so += cnt_s[p], ro += cnt_r[p];
    }
    ncclResult_t r2 = ncclGroupEnd();
    return r != ncclSuccess ? r : r2;
}

static void ep_call(ep_rank *e, int op)
{
    fm_ep_config cfg = {EP_EL};
    fm_requant_config rq = {0};
    fm_ep_dispatch_out o = {NULL, &e->oids, &e->op, NULL, NULL, NULL, 0};
    fm_status st = FM_OK;
    ncclResult_t nr = ncclSuccess;
    fm_tensor y = ep_head(&e->ob, e->R), o4 = ep_head(&e->o4, e->R), o8 = ep_head(&e->o8b, e->R);
    switch (op) {
    case EPX_BF16:
        o.x = &e->ob;
        st = fm_ep_dispatch(e->ctx, e->comm, &cfg, &e->xb, &e->ids, &e->probs, &o);
        break;
    case EPX_FP8:
        o.x = &e->o8;
        st = fm_ep_dispatch(e->ctx, e->comm, &cfg, &e->x8, &e->ids, &e->probs, &o);
        break;
    case EPX_FP4:
    case EPX_FP4_CONV:
        o.x = &e->o4;
        if (op == EPX_FP4_CONV)
            st = fm_convert_scaled(e->ctx, &rq, &e->x8, &e->x4);
        if (!st)
            st = fm_ep_dispatch(e->ctx, e->comm, &cfg, &e->x4, &e->ids, &e->probs, &o);
        if (!st && op == EPX_FP4_CONV)
            st = fm_convert_scaled(e->ctx, &rq, &o4, &o8);
        break;
    case EPX_COMBINE:
        st = fm_ep_combine(e->ctx, e->comm, &cfg, &e->ids, &y, &e->out);
        break;
    case EPX_RAW_BF16:
    case EPX_RAW_FP8:
    case EPX_RAW_FP4:
        nr = ep_raw(e, e->raw_send, e->raw_recv, e->scnt, e->rcnt, ep_row_bytes[op - EPX_RAW_BF16]);
        break;
    default:
        nr = ep_raw(e, y.data, e->raw_recv, e->rcnt, e->scnt, ep_row_bytes[0]);
        break;
    }
    if ((st || nr) && !e->failed) {
        fprintf(stderr, "fm-bench: EP rank %d, call %d: %s\n", e->r, op,
                st ? fm_last_error(e->ctx) : ncclGetErrorString(nr));
        e->failed = 1;
    }
}

/* Each timed call: every GPU idle, a host barrier, then rank 0 times its
 * stream with events around its own call (the others make theirs). */
static void *ep_thread(void *arg)
{
    ep_rank *e = arg;
    ep_world *w = e->w;
    CK(cudaSetDevice(e->r));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    float *t = malloc(sizeof(float) * (size_t)w->reps);
    for (int op = 0; op < EPX_COUNT; op++) {
        if (!((w->mask >> op) & 1))
            continue;
        for (int i = -warm; i < w->reps; i++) {
            CK(cudaDeviceSynchronize());
            pthread_barrier_wait(&w->bar);
            if (e->r == 0)
                CK(cudaEventRecord(a, e->s));
            ep_call(e, op);
            if (e->r == 0) {
                CK(cudaEventRecord(b, e->s));
                CK(cudaEventSynchronize(b));
                if (i >= 0)
                    CK(cudaEventElapsedTime(&t[i], a, b));
            }
        }
        if (e->r == 0) {
            qsort(t, (size_t)w->reps, sizeof(float), cmpf);
            e->ms[op] = t[w->reps / 2];
        }
    }
    CK(cudaDeviceSynchronize());
    free(t);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    /* every rank's thread at once: destroying NCCL communicators one after
     * the other from one thread can wait on the ranks not yet destroyed */
    fm_comm_destroy(e->comm);
    ncclCommDestroy(e->nc);
    return NULL;
}

/* Random distinct top-k routing for every rank, and the rows each rank
 * sends every other. */
static void ep_route(ep_world *w, int32_t **ids, float **probs)
{
    int n = w->n, E = n * EP_EL;
    for (int r = 0; r < n; r++) {
        ep_rank *e = &w->rk[r];
        memset(e->scnt, 0, sizeof e->scnt);
        memset(e->rcnt, 0, sizeof e->rcnt);
    }
    int perm[EP_MAXR * EP_EL];
    for (int r = 0; r < n; r++) {
        ep_rank *e = &w->rk[r];
        for (int64_t t = 0; t < w->T; t++) {
            for (int i = 0; i < E; i++)
                perm[i] = i;
            unsigned visited = 0;
            for (int j = 0; j < EP_K; j++) {
                int pick = j + (int)(rnd() % (uint64_t)(E - j));
                int g = perm[pick];
                perm[pick] = perm[j], perm[j] = g;
                ids[r][t * EP_K + j] = g;
                probs[r][t * EP_K + j] = (float)((rnd() >> 40) * 0x1p-24);
                visited |= 1u << (g / EP_EL);
            }
            for (int p = 0; p < n; p++)
                e->scnt[p] += (visited >> p) & 1;
        }
    }
    for (int r = 0; r < n; r++) {
        ep_rank *e = &w->rk[r];
        e->R = e->sent = 0;
        for (int p = 0; p < n; p++) {
            e->rcnt[p] = w->rk[p].scnt[r];
            e->R += e->rcnt[p];
            e->sent += e->scnt[p];
        }
    }
}

static int ep_section_wanted(const char *filter)
{
    for (int i = 0; i < EP_NRES; i++)
        if (picked(ep_names[i], filter))
            return 1;
    return 0;
}

static int bench_ep(const char *filter, ep_result *out, int *nranks, int64_t *tokens)
{
    if (!ep_section_wanted(filter))
        return 0;
    int nd = 0;
    CK(cudaGetDeviceCount(&nd));
    if (nd < 2) {
        fprintf(stderr, "fm-bench: EP section skipped: needs 2 GPUs, found %d\n", nd);
        return 0;
    }
    static ep_world w;
    memset(&w, 0, sizeof w);
    w.n = nd < EP_MAXR ? nd : EP_MAXR;
    w.reps = reps / 2 > 3 ? reps / 2 : 3;
    for (int i = 0; i < EP_NRES; i++)
        if (picked(ep_names[i], filter))
            w.mask |= (1u << i) | (1u << ep_raw_of[i]); /* result i is call i */
    int n = w.n;
    int32_t *ids[EP_MAXR];
    float *probs[EP_MAXR];
    /* per rank: inputs (BF16, FP8, MXFP4), outputs of every format for up to
     * cap rows, the BF16 combine, the raw buffers, the communicator's staging */
    for (w.T = 16384;; w.T /= 2) {
        for (int r = 0; r < n; r++) {
            ids[r] = malloc((size_t)w.T * EP_K * 4);
            probs[r] = malloc((size_t)w.T * EP_K * 4);
        }
        ep_route(&w, ids, probs);
        int fits = 1;
        for (int r = 0; r < n; r++) {
            size_t fr = 0, tot = 0;
            CK(cudaSetDevice(r));
            CK(cudaMemGetInfo(&fr, &tot));
            double row_in = 2.0 * EP_H + (double)ep_row_bytes[1] + ep_row_bytes[2];
            double row_out = row_in + ep_row_bytes[1];
            double need = (double)w.T * (row_in + 2.0 * EP_H) + (double)w.rk[r].R * row_out +
                          (double)w.rk[r].sent * 3 * ep_row_bytes[0] + (double)w.rk[r].R * 2 * ep_row_bytes[0];
            fits &= need < 0.8 * (double)fr;
        }
        if (fits || w.T <= 256)
            break;
        for (int r = 0; r < n; r++)
            free(ids[r]), free(probs[r]);
    }
    *nranks = n;
    *tokens = w.T;
    int devs[EP_MAXR];
    ncclComm_t ncs[EP_MAXR];
    for (int r = 0; r < n; r++)
        devs[r] = r;
    ncclResult_t nr = ncclCommInitAll(ncs, n, devs);
    if (nr != ncclSuccess) {
        fprintf(stderr, "fm-bench: EP section skipped: ncclCommInitAll over %d GPUs: %s\n", n, ncclGetErrorString(nr));
        for (int r = 0; r < n; r++)
            free(ids[r]), free(probs[r]);
        return 0;
    }
    int ok = 1;
    for (int r = 0; r < n; r++) {
        ep_rank *e = &w.rk[r];
        e->w = &w, e->r = r, e->nc = ncs[r];
        CK(cudaSetDevice(r));
        fm_context_config cc = {.backend = FM_BACKEND_CUDA, .device = r};
        if (fm_context_create(&cc, &e->ctx) != FM_OK) {
            fprintf(stderr, "fm-bench: EP: context on device %d: %s\n", r, fm_last_error(NULL));
            exit(1);
        }
        CK(cudaStreamCreateWithFlags(&e->s, cudaStreamNonBlocking));
        fm_context_set_stream(e->ctx, e->s);
        if (fm_comm_create_nccl(e->ctx, ncs[r], &e->comm) != FM_OK) {
            fprintf(stderr, "fm-bench: EP: fm_comm_create_nccl on rank %d: %s\n", r, fm_last_error(e->ctx));
            exit(1);
        }
        int64_t T = w.T, cap = e->R > 0 ? e->R : 1, rows = e->sent > cap ? e->sent : cap;
        e->ids = ep_mat(T, EP_K, FM_DTYPE_I32);
        e->probs = ep_mat(T, EP_K, FM_DTYPE_F32);
        CK(cudaMemcpy(e->ids.data, ids[r], (size_t)T * EP_K * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(e->probs.data, probs[r], (size_t)T * EP_K * 4, cudaMemcpyHostToDevice));
        e->xb = ep_mat(T, EP_H, FM_DTYPE_BF16);
        fill_device(e->xb.data, FM_DTYPE_BF16, (size_t)(T * EP_H));
        e->x8 = ep_quant(T, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128);
        e->x4 = ep_quant(T, FM_DTYPE_E2M1, FM_SCALE_MX32);
        fm_quant_config q = {0};
        fm_requant_config rq = {0};
        if (fm_quantize(e->ctx, &q, &e->xb, &e->x8, NULL) != FM_OK ||
            fm_convert_scaled(e->ctx, &rq, &e->x8, &e->x4) != FM_OK) {
            fprintf(stderr, "fm-bench: EP setup on rank %d: %s\n", r, fm_last_error(e->ctx));
            ok = 0;
        }
        e->ob = ep_mat(cap, EP_H, FM_DTYPE_BF16);
        e->o8 = ep_quant(cap, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128);
        e->o4 = ep_quant(cap, FM_DTYPE_E2M1, FM_SCALE_MX32);
        e->o8b = ep_quant(cap, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128);
        e->oids = ep_mat(cap, EP_K, FM_DTYPE_I32);
        e->op = ep_mat(cap, EP_K, FM_DTYPE_F32);
        e->out = ep_mat(T, EP_H, FM_DTYPE_BF16);
        e->raw_send = dalloc(rows * ep_row_bytes[0]);
        e->raw_recv = dalloc(rows * ep_row_bytes[0]);
        CK(cudaMemset(e->ob.data, 0, (size_t)fm_tensor_nbytes(&e->ob)));
        CK(cudaDeviceSynchronize());
    }
    for (int r = 0; r < n; r++)
        free(ids[r]), free(probs[r]);
    if (ok) {
        pthread_barrier_init(&w.bar, NULL, (unsigned)n);
        pthread_t th[EP_MAXR];
        for (int r = 0; r < n; r++)
            pthread_create(&th[r], NULL, ep_thread, &w.rk[r]);
        for (int r = 0; r < n; r++)
            pthread_join(th[r], NULL);
        pthread_barrier_destroy(&w.bar);
    }
    int failed = !ok;
    for (int r = 0; r < n; r++) {
        ep_rank *e = &w.rk[r];
        failed |= e->failed;
        CK(cudaSetDevice(r));
        fm_tensor *ts[12] = {&e->ids, &e->probs, &e->xb, &e->x8, &e->x4, &e->ob,
                             &e->o8,  &e->o4,    &e->o8b, &e->oids, &e->op, &e->out};
        for (int i = 0; i < 12; i++)
            free_t(ts[i]);
        cudaFree(e->raw_send);
        cudaFree(e->raw_recv);
        if (!ok) { /* the threads that destroy them did not run; aborting needs no peer */
            fm_comm_destroy(e->comm);
            ncclCommAbort(e->nc);
        }
        fm_context_destroy(e->ctx);
        cudaStreamDestroy(e->s);
    }
    CK(cudaSetDevice(0));
    const ep_rank *z = &w.rk[0];
    int nres = 0;
    for (int i = 0; i < EP_NRES; i++) {
        if (!picked(ep_names[i], filter))
            continue;
        ep_result *o = &out[nres++];
        o->name = ep_names[i];
        o->ok = !failed;
        o->mb = (double)(i == EP_NRES - 1 ? z->R : z->sent) * (double)ep_row_bytes[i < 3 ? i : i == 3 ? 2 : 0] / 1e6;
        o->ms = z->ms[i];
        o->raw_ms = z->ms[ep_raw_of[i]];
        o->frac = o->ms > 0 ? o->raw_ms / o->ms : 0;
        o->speedup = i < 4 && o->ms > 0 && (w.mask & 1u) ? z->ms[EPX_BF16] / o->ms : 0;
        fprintf(stderr, "fm-bench: %-60s %8.3f ms (raw NCCL %.3f ms)\n", o->name, o->ms, o->raw_ms);
    }
    return nres;
}

#else

static int bench_ep(const char *filter, ep_result *out, int *nranks, int64_t *tokens)
{
    (void)filter, (void)out, (void)nranks, (void)tokens;
    fprintf(stderr, "fm-bench: EP section skipped: this flowmoe was built without NCCL\n");
    return 0;
}

#endif

static void print_ep(int json, const ep_result *er, int ner, int n, int64_t T)
{
    if (json) {
        printf("  \"ep\": {\"ranks\": %d, \"tokens_per_rank\": %lld, \"H\": %d, \"k\": %d, \"experts_per_rank\": %d, "
               "\"cases\": [\n", n, (long long)T, 7168, 8, 8);
        for (int i = 0; i < ner; i++)
            printf("    {\"name\": \"%s\", \"mb_sent_rank0\": %.1f, \"ms\": %.3f, \"speedup_vs_bf16\": %.3f, "
                   "\"raw_nccl_ms\": %.3f, \"fraction_of_raw_nccl\": %.4f, \"ok\": %s}%s\n",
                   er[i].name, er[i].mb, er[i].ms, er[i].speedup, er[i].raw_ms, er[i].frac, er[i].ok ? "true" : "false",
                   i + 1 < ner ? "," : "");
        printf("  ]}");
        return;
    }
    if (!ner)
        return;
    printf("\n| EP over NCCL (%d ranks, %lld tokens per rank, H 7168, k 8, 8 experts per rank) | MB sent (rank 0) "
           "| ms | speedup vs BF16 dispatch | raw NCCL ms, same bytes | of raw NCCL bandwidth |\n"
           "|---|---:|---:|---:|---:|---:|\n",
           n, (long long)T);
    for (int i = 0; i < ner; i++) {
        char sp[32] = "-";
        if (er[i].speedup > 0)
            snprintf(sp, sizeof sp, "%.2fx", er[i].speedup);
        printf("| %s%s | %.1f | %.3f | %s | %.3f | %.1f%% |\n", er[i].name, er[i].ok ? "" : " (ERROR)", er[i].mb,
               er[i].ms, sp, er[i].raw_ms, er[i].frac * 100);
    }
}

int main(int argc, char **argv)
{
    int json = 0, layer = 1, ep = 1, ep_only = 0;
    const char *filter = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            json = 1;
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--filter") && i + 1 < argc)
            filter = argv[++i];
        else if (!strcmp(argv[i], "--no-layer"))
            layer = 0;
        else if (!strcmp(argv[i], "--no-ep"))
            ep = 0;
        else if (!strcmp(argv[i], "--ep-only"))
            ep_only = 1;
        else {
            fprintf(stderr, "usage: fm-bench [--json] [--reps N] [--filter SUBSTRING|=NAME] [--no-layer] [--no-ep] "
                            "[--ep-only]\n");
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

    ep_result er[EP_NRES];
    int ep_ranks = 0, ner = 0;
    int64_t ep_tokens = 0;
    if (ep_only) {
        ner = bench_ep(filter, er, &ep_ranks, &ep_tokens);
        if (json) {
            printf("{\n  \"device\": \"%s\",\n", prop.name);
            if (ner)
                print_ep(1, er, ner, ep_ranks, ep_tokens);
            printf("\n}\n");
        } else {
            printf("## fm-bench EP on %s\n", prop.name);
            print_ep(0, er, ner, ep_ranks, ep_tokens);
        }
        fm_context_destroy(ctx);
        cudaStreamDestroy(s);
        return ner ? 0 : 77;
    }

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

    result res[NCASES + NMCASES];
    int nres = 0, below = 0;
    for (int ci = 0; ci < NCASES; ci++) {
        const bcase *c = &cases[ci];
        if (!picked(c->name, filter))
            continue;
        run_arg a;
        memset(&a, 0, sizeof a);
        a.ctx = ctx;
        a.c = c;
        int64_t numel = c->E * c->rows * c->cols;
        int64_t in_bytes = c->op == OP_QUANT || c->op == OP_CAST ? numel * (fm_dtype_bits(c->in) / 8)
                                                                 : numel * fm_dtype_bits(c->elem) / 8;
        a.nrot = in_bytes * 2 > (int64_t)prop.l2CacheSize * 4 ? 2 : NROT;
        for (int k = 0; k < a.nrot; k++) {
            if (c->op == OP_CAST) {
                a.in[k] = shaped(c, dalloc(numel * (fm_dtype_bits(c->in) / 8)), c->in);
                fill_device(a.in[k].data, c->in, (size_t)numel);
                a.out[k] = shaped(c, dalloc(numel * (fm_dtype_bits(c->elem) / 8)), c->elem);
            } else if (c->op == OP_QUANT) {
                a.in[k] = shaped(c, dalloc(numel * (fm_dtype_bits(c->in) / 8)), c->in);
                fill_device(a.in[k].data, c->in, (size_t)numel);
                /* The outputs rotate too: both live beyond L2 across reps. */
                if (c->row)
                    a.qrow[k] = quant_desc(c, FM_LAYOUT_ROWWISE, c->sl);
                if (c->col)
                    a.qcol[k] = quant_desc(c, FM_LAYOUT_COLWISE, c->sl);
            } else {
                /* Real codes and scales: quantize random data first (the rows'
                 * transpose: of the token rows, rows / BR_K of them). */
                bcase ci_ = *c;
                if (c->op == OP_TRANSPOSE_ROWS)
                    ci_.rows = c->rows / BR_K;
                const int64_t nin = ci_.E * ci_.rows * ci_.cols;
                fm_tensor src = shaped(&ci_, dalloc(nin * 2), FM_DTYPE_BF16);
                fill_device(src.data, FM_DTYPE_BF16, (size_t)nin);
                fm_layout lay = c->row ? FM_LAYOUT_ROWWISE : FM_LAYOUT_COLWISE;
                a.qrow[k] = quant_desc(&ci_, lay, c->op == OP_SLC ? FM_SCALE_LAYOUT_COMPACT : c->sl);
                fm_quant_config q0 = {0};
                if (fm_quantize(ctx, &q0, &src, lay == FM_LAYOUT_ROWWISE ? &a.qrow[k] : NULL,
                                lay == FM_LAYOUT_COLWISE ? &a.qrow[k] : NULL) != FM_OK) {
                    fprintf(stderr, "fm-bench: setup quantize: %s\n", fm_last_error(ctx));
                    return 1;
                }
                CK(cudaStreamSynchronize(s));
                cudaFree(src.data);
                if (c->op == OP_TRANSPOSE || c->op == OP_CONVERT || is_grouped(c->op)) {
                    a.out[k] = shaped(c, NULL, c->out_elem);
                    a.out[k].layout = c->op == OP_CONVERT ? FM_LAYOUT_ROWWISE : FM_LAYOUT_COLWISE;
                    a.out[k].scale_mode = c->out_mode;
                    a.out[k].scale_dtype = fm_scale_mode_dtype(c->out_mode);
                    a.out[k].scale_layout = c->out_gemm ? FM_SCALE_LAYOUT_GEMM : c->sl;
                    a.out[k].data = dalloc(fm_tensor_nbytes(&a.out[k]));
                    a.out[k].scale = dalloc(is_grouped(c->op)
                                                ? fm_tensor_grouped_scale_count(&a.out[k], splits_of(c->op)) *
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
        if (c->op == OP_TRANSPOSE_ROWS) {
            const int64_t R = c->rows, T = c->rows / BR_K;
            int32_t *h = malloc(sizeof(int32_t) * (size_t)R);
            for (int64_t r = 0; r < R; r++)
                h[r] = (int32_t)((r % T) * BR_K + r / T);
            a.rmap = fm_tensor_2d(dalloc(R * 4), FM_DTYPE_I32, R, 1);
            a.rmap.device = FM_DEVICE_CUDA;
            CK(cudaMemcpy(a.rmap.data, h, sizeof(int32_t) * (size_t)R, cudaMemcpyHostToDevice));
            free(h);
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
            if (c->op == OP_DEQUANT || c->op == OP_CAST) {
                if (a.out[k].data)
                    cudaFree(a.out[k].data);
            } else if (c->op == OP_SLC && a.out[k].scale) {
                cudaFree(a.out[k].scale);
            } else if (c->op == OP_TRANSPOSE || c->op == OP_CONVERT || is_grouped(c->op)) {
                free_t(&a.out[k]);
            }
        }
        if (a.rmap.data)
            cudaFree(a.rmap.data);
        if (!json) {
            fprintf(stderr, "fm-bench: %-60s %8.1f us\n", c->name, ms * 1e3);
        }
    }

    double swiglu_speedup = 0, dswiglu_speedup = 0;
    nres += bench_moe(ctx, s, filter, copy_gbs, res + nres, &below, &swiglu_speedup, &dswiglu_speedup);

    gresult gres[NGCASES];
    int ngres = bench_gemms(ctx, s, filter, gres);

    lresult lres[LB_ROWS];
    int nlres = layer ? bench_layer(ctx, s, filter, lres) : 0;

    ner = ep ? bench_ep(filter, er, &ep_ranks, &ep_tokens) : 0;

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
        if (swiglu_speedup > 0)
            printf("  \"moe_swiglu_speedup_vs_unfused\": %.3f,\n", swiglu_speedup);
        if (dswiglu_speedup > 0)
            printf("  \"moe_swiglu_backward_speedup_vs_unfused\": %.3f,\n", dswiglu_speedup);
        printf("  \"cases\": [\n");
        for (int i = 0; i < nres; i++) {
            result *r = &res[i];
            printf("    {\"name\": \"%s\", \"shape\": \"%s\", \"bytes\": %.0f, \"median_us\": %.2f, \"gbs\": %.1f, "
                   "\"fraction_of_copy\": %.4f, \"target\": %.2f, \"ok\": %s}%s\n",
                   r->name, r->shape, r->bytes, r->ms * 1e3, r->gbs, r->frac, r->target, r->ok ? "true" : "false",
                   i + 1 < nres ? "," : "");
        }
        printf("  ],\n  \"gemm_cases\": [\n");
        for (int i = 0; i < ngres; i++)
            printf("    {\"name\": \"%s\", \"shape\": \"%s\", \"median_us\": %.2f, \"tflops\": %.1f, \"ok\": %s}%s\n",
                   gres[i].name, gres[i].shape, gres[i].ms * 1e3, gres[i].tflops, gres[i].ok ? "true" : "false",
                   i + 1 < ngres ? "," : "");
        printf("  ],\n  \"layer_cases\": [\n");
        for (int i = 0; i < nlres; i++)
            printf("    {\"recipe\": \"%s\", \"row\": \"%s\", \"T\": %d, \"H\": %d, \"I\": %d, \"E\": %d, \"k\": %d, "
                   "\"ms_per_step\": %.3f, \"speedup_vs_bf16\": %.3f, \"workspace_bytes\": %lld, "
                   "\"saved_bytes\": %lld, \"saved_vs_bf16\": %.4f, \"ok\": %s}%s\n",
                   fm_recipe_name(lres[i].recipe), lres[i].label, LB_T, LB_H, LB_I, LB_E, LB_K, lres[i].ms, lres[i].speedup,
                   (long long)lres[i].workspace, (long long)lres[i].saved, lres[i].saved_frac,
                   lres[i].ok ? "true" : "false", i + 1 < nlres ? "," : "");
        printf("  ]%s\n", ner ? "," : "");
        if (ner)
            print_ep(1, er, ner, ep_ranks, ep_tokens);
        printf("\n}\n");
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
        if (swiglu_speedup > 0)
            printf("\nFused SwiGLU + quantize vs the unfused library ops (fm_moe_swiglu to BF16, then fm_quantize): "
                   "**%.2fx** faster\n",
                   swiglu_speedup);
        if (dswiglu_speedup > 0)
            printf("\nFused dSwiGLU + quantize vs the unfused library ops (fm_moe_swiglu_backward to BF16, then "
                   "fm_quantize): **%.2fx** faster\n",
                   dswiglu_speedup);
        if (ngres) {
            printf("\n| GEMM | shape | median us | TFLOP/s |\n|---|---|---:|---:|\n");
            for (int i = 0; i < ngres; i++)
                printf("| %s%s | %s | %.1f | %.1f |\n", gres[i].name, gres[i].ok ? "" : " (ERROR)", gres[i].shape,
                       gres[i].ms * 1e3, gres[i].tflops);
        }
        if (nlres) {
            printf("\n| MoE layer forward + backward (T %d, H %d, I %d, E %d, k %d) | ms per step | speedup vs bf16 | "
                   "workspace GB | saved for backward MB | of bf16's |\n|---|---:|---:|---:|---:|---:|\n",
                   LB_T, LB_H, LB_I, LB_E, LB_K);
            for (int i = 0; i < nlres; i++)
                printf("| %s%s | %.2f | %.3fx | %.2f | %.1f | %.1f%% |\n", lres[i].label, lres[i].ok ? "" : " (ERROR)",
                       lres[i].ms, lres[i].speedup, (double)lres[i].workspace / 1e9, (double)lres[i].saved / 1e6,
                       100.0 * lres[i].saved_frac);
        }
        print_ep(0, er, ner, ep_ranks, ep_tokens);
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
