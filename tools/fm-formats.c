/* fm-formats: how well does each flowmoe format hold *your* tensor?
 *
 * Reads a tensor from a .npy file (F32, BF16, F16; F64 is narrowed to F32) or
 * generates an activation-like one, quantizes it with every element format,
 * scaling mode, scale rule and data layout the library has, dequantizes it
 * back and prints one table of error statistics; then a second table of what
 * re-encoding an existing FP8/FP4 copy costs (scaling-aware transpose and
 * conversion against the naive BF16 round trip). Uses only the public API. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <unistd.h>

#include "cli.h"
#include "flowmoe/flowmoe.h"
#include "npy.h"

#ifdef FM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define MAX_ELEMS (INT64_C(1) << 28) /* ~16 bytes of working memory per element */
#define MAX_DIM (INT64_C(1) << 24)

static const char *prog = "fm-formats";

static void usage(FILE *f)
{
    fprintf(f,
            "usage: %s [--in FILE.npy | --rows N --cols N --seed S --dtype bf16|f32|f16]\n"
            "          [--backend cpu|cuda|auto] [--csv FILE] [--dump FILE.npy] [--help]\n"
            "\n"
            "Quantizes one tensor with every flowmoe format (FP8 E4M3/E5M2 with tensor, row, 1x128 and\n"
            "128x128 scales, MXFP8 and MXFP4 with 1x32 E8M0 scales), row-wise and column-wise, dequantizes\n"
            "it, and prints the error of each: pick the cheapest format whose error your model tolerates.\n"
            "\n"
            "  --in FILE.npy     tensor to study: .npy float32, float16, float64 or ml_dtypes bfloat16;\n"
            "                    N-D arrays are viewed as [product of leading dims, last dim]\n"
            "  --rows N          rows (tokens) of the generated tensor (default 512)\n"
            "  --cols N          columns (hidden size) of the generated tensor (default 7168)\n"
            "  --seed S          seed of the generated tensor (default 1)\n"
            "  --dtype T         dtype of the generated tensor: bf16 (default), f32 or f16\n"
            "  --backend B       cpu (default), cuda, or auto (cuda when a GPU is usable)\n"
            "  --csv FILE        also write the table as CSV\n"
            "  --dump FILE.npy   write the input tensor (as float32) to FILE.npy\n"
            "  --help            this text\n"
            "\n"
            "The generated tensor imitates MoE activations: Student-t (3 degrees of freedom) values,\n"
            "a lognormal magnitude per token and a few outlier channels scaled 20-100x.\n",
            prog);
}

static int usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, "%s: ", prog);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n\n");
    usage(stderr);
    return 2;
}

/* ---- options ------------------------------------------------------------ */

typedef struct {
    const char *in, *csv, *dump;
    int64_t rows, cols;
    uint64_t seed;
    fm_dtype gen_dtype;
    fm_backend_kind backend;
    int rows_set, cols_set, seed_set, dtype_set;
} options;

/* Returns -1 to go on, else the exit status. */
static int parse_args(int argc, char **argv, options *o)
{
    *o = (options){.rows = 512, .cols = 7168, .seed = 1, .gen_dtype = FM_DTYPE_BF16, .backend = FM_BACKEND_CPU};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        static const char *const with_value[] = {"--in", "--rows", "--cols", "--seed", "--dtype",
                                                 "--backend", "--csv", "--dump"};
        const char *name = NULL, *val = NULL;
        int got = cli_option(argc, argv, &i, with_value, sizeof with_value / sizeof with_value[0], &name, &val);
        if (got < 0)
            return usage_error("%s needs a value", name);
        if (got == 0)
            return usage_error("unknown argument '%s'", a);
        int64_t v;
        if (!strcmp(name, "--in")) {
            o->in = val;
        } else if (!strcmp(name, "--csv")) {
            o->csv = val;
        } else if (!strcmp(name, "--dump")) {
            o->dump = val;
        } else if (!strcmp(name, "--rows")) {
            if (cli_parse_i64(val, 1, MAX_DIM, &o->rows))
                return usage_error("--rows must be an integer in 1..16777216, got '%s'", val);
            o->rows_set = 1;
        } else if (!strcmp(name, "--cols")) {
            if (cli_parse_i64(val, 1, MAX_DIM, &o->cols))
                return usage_error("--cols must be an integer in 1..16777216, got '%s'", val);
            o->cols_set = 1;
        } else if (!strcmp(name, "--seed")) {
            if (cli_parse_i64(val, 0, INT64_MAX, &v))
                return usage_error("--seed must be a non-negative integer, got '%s'", val);
            o->seed = (uint64_t)v;
            o->seed_set = 1;
        } else if (!strcmp(name, "--dtype")) {
            if (!strcmp(val, "bf16"))
                o->gen_dtype = FM_DTYPE_BF16;
            else if (!strcmp(val, "f32"))
                o->gen_dtype = FM_DTYPE_F32;
            else if (!strcmp(val, "f16"))
                o->gen_dtype = FM_DTYPE_F16;
            else
                return usage_error("--dtype must be bf16, f32 or f16, got '%s'", val);
            o->dtype_set = 1;
        } else if (!strcmp(name, "--backend")) {
            if (!strcmp(val, "cpu"))
                o->backend = FM_BACKEND_CPU;
            else if (!strcmp(val, "cuda"))
                o->backend = FM_BACKEND_CUDA;
            else if (!strcmp(val, "auto"))
                o->backend = FM_BACKEND_AUTO;
            else
                return usage_error("--backend must be cpu, cuda or auto, got '%s'", val);
        }
    }
    if (o->in && (o->rows_set || o->cols_set || o->seed_set || o->dtype_set))
        return usage_error("%s", "--rows, --cols, --seed and --dtype describe the generated tensor; "
                                 "they cannot be combined with --in");
    if (!o->in && o->rows * o->cols > MAX_ELEMS)
        return usage_error("%s", "--rows x --cols must be at most 268435456 elements");
    return -1;
}

/* ---- the generated tensor ------------------------------------------------ */

typedef struct {
    uint64_t s[4];
} rng;

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15u);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
    return z ^ (z >> 31);
}

static void rng_seed(rng *r, uint64_t seed)
{
    for (int k = 0; k < 4; k++)
        r->s[k] = splitmix64(&seed);
}

/* xoshiro256**: fast, and the same stream on every platform, so a seed names
 * one tensor everywhere. */
static uint64_t rng_next(rng *r)
{
    uint64_t *s = r->s;
    uint64_t x = s[1] * 5, res = ((x << 7) | (x >> 57)) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = (s[3] << 45) | (s[3] >> 19);
    return res;
}

static double rng_uniform(rng *r) { return ((double)(rng_next(r) >> 11) + 0.5) * 0x1p-53; } /* (0, 1) */

#define GEN_NU 3
#define GEN_ROW_SIGMA 0.5
#define GEN_OUT_MIN 20.0
#define GEN_OUT_MAX 100.0

/* Bailey's polar method: one Student-t(nu) draw without a chi-square sum. */
static double rng_student_t(rng *r, double nu)
{
    for (;;) {
        double u = 2.0 * rng_uniform(r) - 1.0, v = 2.0 * rng_uniform(r) - 1.0, w = u * u + v * v;
        if (w < 1.0 && w > 0.0)
            return u * sqrt(nu * (pow(w, -2.0 / nu) - 1.0) / w);
    }
}

static double rng_normal(rng *r)
{
    return sqrt(-2.0 * log(rng_uniform(r))) * cos(6.283185307179586 * rng_uniform(r));
}

static int64_t gen_outlier_count(int64_t cols) { return cols < 4 ? 1 : cols / 1024 > 2 ? cols / 1024 : 2; }

/* Every row draws from its own stream, so the tensor for a seed does not
 * depend on how many threads generate it. */
static void rng_seed_row(rng *r, uint64_t seed, int64_t row)
{
    uint64_t k = seed ^ 0x5851F42D4C957F2Du;
    uint64_t z = splitmix64(&k) ^ (uint64_t)row;
    rng_seed(r, z);
}

typedef struct {
    float *x;
    const float *colscale;
    int64_t cols;
    uint64_t seed;
} gen_job;

static void gen_rows(void *arg, int chunk, int64_t begin, int64_t end)
{
    (void)chunk;
    const gen_job *g = arg;
    for (int64_t i = begin; i < end; i++) {
        rng r;
        rng_seed_row(&r, g->seed, i);
        double rs = exp(GEN_ROW_SIGMA * rng_normal(&r));
        float *row = g->x + i * g->cols;
        for (int64_t j = 0; j < g->cols; j++)
            row[j] = (float)(rng_student_t(&r, GEN_NU) * rs) * g->colscale[j];
    }
}

static void parallel_for(int64_t n, void (*fn)(void *, int, int64_t, int64_t), void *arg);

static int generate(float *x, int64_t rows, int64_t cols, uint64_t seed)
{
    rng r;
    rng_seed_row(&r, seed, -1);
    float *colscale = malloc((size_t)cols * sizeof *colscale);
    if (!colscale)
        return -1;
    for (int64_t j = 0; j < cols; j++)
        colscale[j] = 1.0f;
    for (int64_t k = gen_outlier_count(cols); k > 0; k--)
        colscale[rng_next(&r) % (uint64_t)cols] =
            (float)(GEN_OUT_MIN + (GEN_OUT_MAX - GEN_OUT_MIN) * rng_uniform(&r));
    gen_job g = {x, colscale, cols, seed};
    parallel_for(rows, gen_rows, &g);
    free(colscale);
    return 0;
}

/* ---- a few threads for the tool's own loops ------------------------------ */

#define NCHUNKS 16 /* fixed, so sums reduce in the same order on any machine */

typedef struct {
    void (*fn)(void *, int, int64_t, int64_t);
    void *arg;
    int64_t n;
    int next;
    pthread_mutex_t mu;
} pool_job;

static void *pool_worker(void *p)
{
    pool_job *j = p;
    for (;;) {
        pthread_mutex_lock(&j->mu);
        int c = j->next++;
        pthread_mutex_unlock(&j->mu);
        if (c >= NCHUNKS)
            return NULL;
        j->fn(j->arg, c, j->n * c / NCHUNKS, j->n * (c + 1) / NCHUNKS);
    }
}

/* fn(arg, chunk, begin, end) over NCHUNKS contiguous chunks of [0, n). */
static void parallel_for(int64_t n, void (*fn)(void *, int, int64_t, int64_t), void *arg)
{
    long nt = sysconf(_SC_NPROCESSORS_ONLN);
    nt = nt < 1 ? 1 : nt > NCHUNKS ? NCHUNKS : nt;
    pool_job j = {fn, arg, n, 0, PTHREAD_MUTEX_INITIALIZER};
    pthread_t th[NCHUNKS];
    int started[NCHUNKS] = {0};
    for (long t = 1; t < nt; t++)
        started[t] = pthread_create(&th[t], NULL, pool_worker, &j) == 0;
    pool_worker(&j);
    for (long t = 1; t < nt; t++)
        if (started[t])
            pthread_join(th[t], NULL);
}

/* ---- buffers that live on the host, and on the device when asked --------- */

typedef struct {
    void *h, *d;
    size_t n;
} buf;

static int on_device;

static int buf_alloc(buf *b, size_t n, char *err, size_t errlen)
{
    b->n = n;
    b->d = NULL;
    b->h = malloc(n ? n : 1);
    if (!b->h) {
        snprintf(err, errlen, "out of host memory (%zu bytes)", n);
        return -1;
    }
#ifdef FM_HAVE_CUDA
    if (on_device) {
        cudaError_t e = cudaMalloc(&b->d, n ? n : 1);
        if (e != cudaSuccess) {
            b->d = NULL;
            snprintf(err, errlen, "cudaMalloc of %zu bytes failed: %s", n, cudaGetErrorString(e));
            return -1;
        }
    }
#endif
    return 0;
}

static void buf_free(buf *b)
{
    free(b->h);
#ifdef FM_HAVE_CUDA
    if (b->d)
        cudaFree(b->d);
#endif
    b->h = b->d = NULL;
}

/* The pointer the context works on. */
static void *buf_op(const buf *b) { return on_device ? b->d : b->h; }

static int buf_upload(buf *b, char *err, size_t errlen)
{
#ifdef FM_HAVE_CUDA
    if (on_device) {
        cudaError_t e = cudaMemcpy(b->d, b->h, b->n, cudaMemcpyHostToDevice);
        if (e != cudaSuccess) {
            snprintf(err, errlen, "cudaMemcpy to the device failed: %s", cudaGetErrorString(e));
            return -1;
        }
    }
#endif
    (void)b, (void)err, (void)errlen;
    return 0;
}

static int buf_download(buf *b, char *err, size_t errlen)
{
#ifdef FM_HAVE_CUDA
    if (on_device) {
        cudaError_t e = cudaMemcpy(b->h, b->d, b->n, cudaMemcpyDeviceToHost);
        if (e != cudaSuccess) {
            snprintf(err, errlen, "cudaMemcpy from the device failed: %s", cudaGetErrorString(e));
            return -1;
        }
    }
#endif
    (void)b, (void)err, (void)errlen;
    return 0;
}

/* ---- the formats ---------------------------------------------------------- */

typedef struct {
    const char *family;  /* what a user would call it */
    fm_dtype elem;
    fm_scale_mode mode;
    fm_scale_rule rule;
} variant;

static const variant variants[] = {
    {"FP8 E4M3", FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_SCALE_RULE_EXACT},
    {"FP8 E4M3", FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_SCALE_RULE_POW2},
    {"FP8 E4M3", FM_DTYPE_E4M3, FM_SCALE_ROW, FM_SCALE_RULE_EXACT},
    {"FP8 E4M3", FM_DTYPE_E4M3, FM_SCALE_ROW, FM_SCALE_RULE_POW2},
    {"FP8 E4M3", FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_RULE_POW2},
    {"FP8 E4M3", FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_RULE_EXACT},
    {"FP8 E4M3", FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_SCALE_RULE_POW2},
    {"FP8 E4M3", FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_SCALE_RULE_EXACT},
    {"FP8 E5M2", FM_DTYPE_E5M2, FM_SCALE_TENSOR, FM_SCALE_RULE_EXACT},
    {"FP8 E5M2", FM_DTYPE_E5M2, FM_SCALE_TENSOR, FM_SCALE_RULE_POW2},
    {"FP8 E5M2", FM_DTYPE_E5M2, FM_SCALE_ROW, FM_SCALE_RULE_EXACT},
    {"FP8 E5M2", FM_DTYPE_E5M2, FM_SCALE_ROW, FM_SCALE_RULE_POW2},
    {"FP8 E5M2", FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_SCALE_RULE_POW2},
    {"FP8 E5M2", FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_SCALE_RULE_EXACT},
    {"FP8 E5M2", FM_DTYPE_E5M2, FM_SCALE_BLOCK_128x128, FM_SCALE_RULE_POW2},
    {"FP8 E5M2", FM_DTYPE_E5M2, FM_SCALE_BLOCK_128x128, FM_SCALE_RULE_EXACT},
    {"MXFP8 E4M3", FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_RULE_POW2},
    {"MXFP8 E4M3", FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_RULE_MX_FLOOR},
    {"MXFP8 E5M2", FM_DTYPE_E5M2, FM_SCALE_MX32, FM_SCALE_RULE_POW2},
    {"MXFP8 E5M2", FM_DTYPE_E5M2, FM_SCALE_MX32, FM_SCALE_RULE_MX_FLOOR},
    {"MXFP4 E2M1", FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_RULE_POW2},
    {"MXFP4 E2M1", FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_RULE_MX_FLOOR},
};
#define NVARIANTS ((int)(sizeof variants / sizeof variants[0]))

static const char *scaling_name(fm_scale_mode m)
{
    switch (m) {
    case FM_SCALE_TENSOR: return "tensor";
    case FM_SCALE_ROW: return "row";
    case FM_SCALE_BLOCK_1x128: return "1x128";
    case FM_SCALE_BLOCK_128x128: return "128x128";
    case FM_SCALE_MX32: return "1x32";
    default: return "?";
    }
}

static const char *rule_name(fm_scale_rule r, fm_scale_mode m)
{
    if (m == FM_SCALE_MX32)
        return r == FM_SCALE_RULE_MX_FLOOR ? "floor" : "ceil";
    return r == FM_SCALE_RULE_EXACT ? "exact" : "pow2";
}

/* What fm_quant_config's zero rule picks, so the table can mark it. */
static int is_default_rule(fm_scale_rule r, fm_scale_mode m)
{
    return (m == FM_SCALE_TENSOR || m == FM_SCALE_ROW) ? r == FM_SCALE_RULE_EXACT : r == FM_SCALE_RULE_POW2;
}

/* ---- measurements --------------------------------------------------------- */

typedef struct {
    int ok;
    char why[512];
    double bytes_per_elem;
    double sig, noise;      /* sum x^2, sum (q - x)^2 over finite pairs */
    double max_rel, sum_rel;
    int64_t nonzero, flushed, saturated, clipped, total, lost; /* lost: finite x, non-finite q */
} result;

static uint8_t max_code(fm_dtype t) { return t == FM_DTYPE_E4M3 ? 0x7E : t == FM_DTYPE_E5M2 ? 0x7B : 0x7; }

typedef struct {
    const float *x, *q;
    result part[NCHUNKS];
    int64_t n;
} measure_job;

static void measure_chunk(void *arg, int chunk, int64_t begin, int64_t end)
{
    measure_job *m = arg;
    result *r = &m->part[chunk];
    const float *x = m->x, *q = m->q;
    for (int64_t i = begin; i < end; i++) {
        float xi = x[i], qi = q[i];
        if (!isfinite(xi))
            continue;
        if (!isfinite(qi)) {
            r->lost++;
            continue;
        }
        double d = (double)qi - (double)xi;
        r->sig += (double)xi * xi;
        r->noise += d * d;
        if (xi != 0.0f) {
            double rel = fabs(d) / fabs((double)xi);
            r->nonzero++;
            r->sum_rel += rel;
            if (rel > r->max_rel)
                r->max_rel = rel;
            if (qi == 0.0f)
                r->flushed++;
        }
    }
}

static void measure_values(result *r, const float *x, const float *q, int64_t n)
{
    measure_job *m = calloc(1, sizeof *m);
    if (!m) {
        r->ok = 0;
        snprintf(r->why, sizeof r->why, "out of host memory");
        return;
    }
    m->x = x;
    m->q = q;
    m->n = n;
    parallel_for(n, measure_chunk, m);
    for (int c = 0; c < NCHUNKS; c++) {
        const result *p = &m->part[c];
        r->sig += p->sig;
        r->noise += p->noise;
        r->sum_rel += p->sum_rel;
        r->max_rel = p->max_rel > r->max_rel ? p->max_rel : r->max_rel;
        r->nonzero += p->nonzero;
        r->flushed += p->flushed;
        r->lost += p->lost;
    }
    free(m);
}

/* Codes at +-max; "clipped" when the input lay beyond what that code stands
 * for (a few ulps of slack: EXACT scales put the block amax right on it). */
static void measure_codes(result *r, const uint8_t *codes, fm_dtype t, int colwise, int64_t rows, int64_t cols,
                          const float *x, const float *q)
{
    uint8_t mc = max_code(t);
    int fp4 = t == FM_DTYPE_E2M1;
    uint8_t mask = fp4 ? 0x7 : 0x7F;
    int64_t n = rows * cols, sc = colwise ? rows : cols;
    for (int64_t k = 0; k < n; k++) {
        uint8_t c = fp4 ? (uint8_t)(codes[k / 2] >> (4 * (k & 1))) : codes[k];
        if ((c & mask) != mc)
            continue;
        r->saturated++;
        int64_t sr = k / sc, scol = k % sc;
        int64_t li = colwise ? scol * cols + sr : sr * cols + scol;
        if (isfinite(x[li]) && isfinite(q[li]) && fabs((double)x[li]) > fabs((double)q[li]) * (1.0 + 1e-6))
            r->clipped++;
    }
}

static double now_s(void)
{
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
    fm_context *ctx;
    buf *in;            /* the input on the context's side */
    fm_dtype in_dtype;
    int64_t rows, cols;
    const float *x;     /* the input as F32, host */
} job;

static int api_fail(const job *jb, const char *what, fm_status st, char *err, size_t errlen)
{
    if (st == FM_OK)
        return 0;
    snprintf(err, errlen, "%s: %s: %s", what, fm_status_name(st), fm_last_error(jb->ctx));
    return -1;
}

/* Dequantizes q into deq (F32, row-wise, the input's shape), brings it to the
 * host and adds its error statistics against the input to r. */
static int measure_copy(const job *jb, const fm_tensor *q, buf *deq, result *r, char *err, size_t errlen)
{
    fm_tensor y = fm_tensor_2d(buf_op(deq), FM_DTYPE_F32, jb->rows, jb->cols);
    y.device = q->device;
    if (api_fail(jb, "fm_dequantize", fm_dequantize(jb->ctx, q, &y), err, errlen) ||
        api_fail(jb, "fm_context_synchronize", fm_context_synchronize(jb->ctx), err, errlen) ||
        buf_download(deq, err, errlen))
        return -1;
    r->ok = 1;
    r->total = jb->rows * jb->cols;
    measure_values(r, jb->x, deq->h, r->total);
    return 0;
}

/* Quantizes into both layouts in one call (the fused path the trainer uses),
 * then dequantizes each back to a row-wise F32 matrix and measures it. When
 * the fused call refuses (say an odd length for MXFP4 in one layout), each
 * layout is tried alone so that the other still gets measured. */
static void run_variant(const job *jb, const variant *v, result res[2])
{
    fm_device dev = on_device ? FM_DEVICE_CUDA : FM_DEVICE_HOST;
    fm_tensor in = fm_tensor_2d(buf_op(jb->in), jb->in_dtype, jb->rows, jb->cols);
    in.device = dev;
    fm_tensor out[2];
    buf codes[2] = {{0}}, scales[2] = {{0}}, deq[2] = {{0}};
    char err[2][sizeof res[0].why] = {"", ""};
    int live[2] = {1, 1};
    memset(res, 0, 2 * sizeof *res);
    int64_t numel = jb->rows * jb->cols;
    fm_quant_config qc = {.rule = v->rule};
    fm_status st;

    for (int l = 0; l < 2; l++) {
        out[l] = fm_tensor_quant_2d(NULL, v->elem, jb->rows, jb->cols, l ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE,
                                    v->mode, NULL, FM_SCALE_LAYOUT_COMPACT);
        out[l].device = dev;
        int64_t nb = fm_tensor_nbytes(&out[l]), ns = fm_tensor_scale_nbytes(&out[l]);
        res[l].bytes_per_elem = (double)(nb + ns) / (double)numel;
        if (nb < 0 || ns < 0) {
            snprintf(err[l], sizeof err[l], "the library rejects the shape [%lld, %lld] for this format",
                     (long long)jb->rows, (long long)jb->cols);
            live[l] = 0;
        } else if (buf_alloc(&codes[l], (size_t)nb, err[l], sizeof err[l]) ||
                   buf_alloc(&scales[l], (size_t)ns, err[l], sizeof err[l]) ||
                   buf_alloc(&deq[l], (size_t)numel * sizeof(float), err[l], sizeof err[l])) {
            live[l] = 0;
        }
        out[l].data = buf_op(&codes[l]);
        out[l].scale = buf_op(&scales[l]);
    }

    if (live[0] && live[1] && fm_quantize(jb->ctx, &qc, &in, &out[0], &out[1]) == FM_OK) {
        /* both done */
    } else {
        for (int l = 0; l < 2; l++) {
            if (!live[l])
                continue;
            st = fm_quantize(jb->ctx, &qc, &in, l ? NULL : &out[0], l ? &out[1] : NULL);
            if (st != FM_OK) {
                snprintf(err[l], sizeof err[l], "fm_quantize: %s: %s", fm_status_name(st), fm_last_error(jb->ctx));
                live[l] = 0;
            }
        }
    }
    for (int l = 0; l < 2; l++) {
        if (!live[l])
            continue;
        if (measure_copy(jb, &out[l], &deq[l], &res[l], err[l], sizeof err[l]) ||
            buf_download(&codes[l], err[l], sizeof err[l])) {
            live[l] = 0;
            continue;
        }
        measure_codes(&res[l], codes[l].h, v->elem, l, jb->rows, jb->cols, jb->x, deq[l].h);
    }
    for (int l = 0; l < 2; l++) {
        if (!live[l]) {
            res[l].ok = 0;
            memcpy(res[l].why, err[l], sizeof res[l].why);
        }
        buf_free(&codes[l]);
        buf_free(&scales[l]);
        buf_free(&deq[l]);
    }
}

/* ---- re-encoding paths: what a second quantization costs ------------------ */

static double sqnr_db(const result *r) { return r->noise > 0 ? 10.0 * log10(r->sig / r->noise) : INFINITY; }

/* The backward GEMMs need column-wise copies, and FP4 dispatch an MXFP4 copy,
 * of a tensor that already exists row-wise in FP8. Each path below is
 * measured against the original input: "direct" quantizes the original
 * straight into the target (the ideal, but the original is gone by then),
 * "scaling-aware" re-encodes the FP8 codes (fm_transpose_scaled /
 * fm_convert_scaled, no second rounding where the target range allows),
 * "naive" dequantizes to BF16 and quantizes again with fresh scales: power of
 * two (which lands on the scaling-aware bits, at the price of a BF16 pass)
 * or exact amax / max scales (TE's usual choice for 1x128), whose second
 * rounding is the double quantization error. */
typedef struct {
    const char *name;
    fm_dtype src_elem, dst_elem;
    fm_scale_mode src_mode, dst_mode;
    int transpose;
} repath;

static const repath repaths[] = {
    {"E4M3 1x128 row -> col", FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_1x128, 1},
    {"E4M3 MX32 row -> col", FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_MX32, 1},
    {"E2M1 MX32 row -> col", FM_DTYPE_E2M1, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_MX32, 1},
    {"E4M3 1x128 -> E2M1 MX32", FM_DTYPE_E4M3, FM_DTYPE_E2M1, FM_SCALE_BLOCK_1x128, FM_SCALE_MX32, 0},
};
#define NREPATHS ((int)(sizeof repaths / sizeof repaths[0]))

typedef struct {
    fm_tensor t;
    buf codes, scales;
} qcopy;

static int qcopy_make(qcopy *q, fm_dtype elem, fm_scale_mode mode, fm_layout lay, int64_t rows, int64_t cols,
                      char *err, size_t errlen)
{
    memset(q, 0, sizeof *q);
    q->t = fm_tensor_quant_2d(NULL, elem, rows, cols, lay, mode, NULL, FM_SCALE_LAYOUT_COMPACT);
    q->t.device = on_device ? FM_DEVICE_CUDA : FM_DEVICE_HOST;
    int64_t nb = fm_tensor_nbytes(&q->t), ns = fm_tensor_scale_nbytes(&q->t);
    if (nb < 0 || ns < 0) {
        snprintf(err, errlen, "the library rejects [%lld, %lld] for %s %s", (long long)rows, (long long)cols,
                 fm_dtype_name(elem), fm_layout_name(lay));
        return -1;
    }
    if (buf_alloc(&q->codes, (size_t)nb, err, errlen) || buf_alloc(&q->scales, (size_t)ns, err, errlen))
        return -1;
    q->t.data = buf_op(&q->codes);
    q->t.scale = buf_op(&q->scales);
    return 0;
}

static void qcopy_free(qcopy *q)
{
    buf_free(&q->codes);
    buf_free(&q->scales);
}

/* res[0] direct, res[1] scaling-aware, res[2] naive with power-of-two scales,
 * res[3] naive with exact scales (1x128 targets only; else res[3].ok = 0). */
static int run_repath(const job *jb, const repath *p, result res[4], char *err, size_t errlen)
{
    const fm_layout dl = p->transpose ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE;
    const int64_t R = jb->rows, C = jb->cols;
    fm_device dev = on_device ? FM_DEVICE_CUDA : FM_DEVICE_HOST;
    qcopy src, dst;
    buf deq = {0}, mid = {0};
    int rc = -1;
    memset(&src, 0, sizeof src);
    memset(&dst, 0, sizeof dst);
    fm_tensor in = fm_tensor_2d(buf_op(jb->in), jb->in_dtype, R, C);
    in.device = dev;
    if (qcopy_make(&src, p->src_elem, p->src_mode, FM_LAYOUT_ROWWISE, R, C, err, errlen) ||
        qcopy_make(&dst, p->dst_elem, p->dst_mode, dl, R, C, err, errlen) ||
        buf_alloc(&deq, (size_t)(R * C) * sizeof(float), err, errlen) ||
        buf_alloc(&mid, (size_t)(R * C) * 2, err, errlen))
        goto done;
    /* direct */
    if (api_fail(jb, "fm_quantize (direct)", fm_quantize(jb->ctx, NULL, &in, dl ? NULL : &dst.t, dl ? &dst.t : NULL),
                 err, errlen) ||
        measure_copy(jb, &dst.t, &deq, &res[0], err, errlen))
        goto done;
    /* scaling-aware, from the row-wise FP8 (or FP4) copy */
    if (api_fail(jb, "fm_quantize (row-wise source)", fm_quantize(jb->ctx, NULL, &in, &src.t, NULL), err, errlen))
        goto done;
    fm_status st = p->transpose ? fm_transpose_scaled(jb->ctx, NULL, &src.t, &dst.t)
                                : fm_convert_scaled(jb->ctx, NULL, &src.t, &dst.t);
    if (api_fail(jb, p->transpose ? "fm_transpose_scaled" : "fm_convert_scaled", st, err, errlen) ||
        measure_copy(jb, &dst.t, &deq, &res[1], err, errlen))
        goto done;
    /* naive: dequantize to BF16, quantize again with fresh scales */
    fm_tensor m = fm_tensor_2d(buf_op(&mid), FM_DTYPE_BF16, R, C);
    m.device = dev;
    if (api_fail(jb, "fm_dequantize (naive)", fm_dequantize(jb->ctx, &src.t, &m), err, errlen) ||
        api_fail(jb, "fm_quantize (naive)", fm_quantize(jb->ctx, NULL, &m, dl ? NULL : &dst.t, dl ? &dst.t : NULL),
                 err, errlen) ||
        measure_copy(jb, &dst.t, &deq, &res[2], err, errlen))
        goto done;
    res[3].ok = 0;
    if (p->dst_mode == FM_SCALE_BLOCK_1x128) {
        fm_quant_config exact = {.rule = FM_SCALE_RULE_EXACT};
        if (api_fail(jb, "fm_quantize (naive, exact scales)",
                     fm_quantize(jb->ctx, &exact, &m, dl ? NULL : &dst.t, dl ? &dst.t : NULL), err, errlen) ||
            measure_copy(jb, &dst.t, &deq, &res[3], err, errlen))
            goto done;
    }
    rc = 0;
done:
    qcopy_free(&src);
    qcopy_free(&dst);
    buf_free(&deq);
    buf_free(&mid);
    return rc;
}

static void print_repaths(const job *jb)
{
    printf("\nRe-encoding an FP8/FP4 copy that already exists (what the backward GEMMs and FP4 dispatch need): "
           "SQNR in dB against the input, and in brackets the noise a path adds over quantizing the input "
           "directly into the target:\n\n");
    printf("%-24s  %7s  %-18s  %-18s  %-18s\n", "path", "direct", "scaling-aware", "naive, pow2 scales",
           "naive, exact scales");
    printf("%-24s  %7s  %-18s  %-18s  %-18s\n", "------------------------", "-------", "------------------",
           "------------------", "------------------");
    for (int k = 0; k < NREPATHS; k++) {
        result r[4];
        char err[512], cell[3][64];
        memset(r, 0, sizeof r);
        if (run_repath(jb, &repaths[k], r, err, sizeof err)) {
            printf("%-24s  n/a: %s\n", repaths[k].name, err);
            continue;
        }
        for (int i = 1; i < 4; i++) {
            if (!r[i].ok)
                snprintf(cell[i - 1], sizeof cell[i - 1], "-");
            else
                snprintf(cell[i - 1], sizeof cell[i - 1], "%.2f (%+.1f%%)", sqnr_db(&r[i]),
                         r[0].noise > 0 ? (r[i].noise - r[0].noise) / r[0].noise * 100.0 : 0.0);
        }
        printf("%-24s  %7.2f  %-18s  %-18s  %s\n", repaths[k].name, sqnr_db(&r[0]), cell[0], cell[1], cell[2]);
    }
}

/* ---- output ----------------------------------------------------------------- */

static double frac(int64_t a, int64_t b) { return b > 0 ? (double)a / (double)b : 0.0; }

/* Percentages that stay honest at both ends: a non-zero count never prints 0. */
static void pct(char *s, size_t n, int64_t a, int64_t b)
{
    double p = 100.0 * frac(a, b);
    if (a == 0)
        snprintf(s, n, "0");
    else if (p < 0.001)
        snprintf(s, n, "<0.001");
    else
        snprintf(s, n, "%.3f", p);
}

#define ROW_FMT "%-10s  %-7s  %-6s  %-6s  %6s  %7s  %8s  %8s  %7s  %7s  %7s\n"

static void print_header(void)
{
    printf(ROW_FMT, "format", "scaling", "rule", "layout", "B/elem", "SQNR dB", "max rel", "mean rel", "sat %",
           "clip %", "ftz %");
    printf(ROW_FMT, "----------", "-------", "------", "------", "------", "-------", "--------", "--------",
           "-------", "-------", "-------");
}

static void print_row(const variant *v, int layout, const result *r)
{
    char rule[16], bpe[16], db[16], mx[16], mean[16], sat[16], clip[16], ftz[16];
    snprintf(rule, sizeof rule, "%s%s", rule_name(v->rule, v->mode), is_default_rule(v->rule, v->mode) ? "*" : "");
    snprintf(bpe, sizeof bpe, "%.3f", r->bytes_per_elem);
    if (!r->ok) {
        printf("%-10s  %-7s  %-6s  %-6s  %6s  n/a: %s\n", v->family, scaling_name(v->mode), rule,
               layout ? "col" : "row", bpe, r->why);
        return;
    }
    double s = sqnr_db(r);
    if (isinf(s))
        snprintf(db, sizeof db, "inf");
    else
        snprintf(db, sizeof db, "%.2f", s);
    snprintf(mx, sizeof mx, "%.2e", r->max_rel);
    snprintf(mean, sizeof mean, "%.2e", r->nonzero ? r->sum_rel / (double)r->nonzero : 0.0);
    pct(sat, sizeof sat, r->saturated, r->total);
    pct(clip, sizeof clip, r->clipped, r->total);
    pct(ftz, sizeof ftz, r->flushed, r->nonzero);
    if (r->lost == 0) {
        printf(ROW_FMT, v->family, scaling_name(v->mode), rule, layout ? "col" : "row", bpe, db, mx, mean, sat, clip,
               ftz);
        return;
    }
    /* A NaN/Inf input turns its whole scale block into NaN: say how much was
     * lost, and never print statistics of nothing as if they were perfect. */
    if (r->sig == 0 && r->noise == 0 && r->nonzero == 0)
        printf("%-10s  %-7s  %-6s  %-6s  %6s  n/a: all %lld finite values share a block with a NaN/Inf input\n",
               v->family, scaling_name(v->mode), rule, layout ? "col" : "row", bpe, (long long)r->lost);
    else
        printf("%-10s  %-7s  %-6s  %-6s  %6s  %7s  %8s  %8s  %7s  %7s  %7s  (%lld finite values lost to NaN blocks)\n",
               v->family, scaling_name(v->mode), rule, layout ? "col" : "row", bpe, db, mx, mean, sat, clip, ftz,
               (long long)r->lost);
}

static int write_csv(FILE *f, const char *path, result (*res)[2])
{
    fprintf(f, "format,element,scaling,rule,default_rule,layout,bytes_per_elem,sqnr_db,max_rel_err,mean_rel_err,"
               "saturated_frac,clipped_frac,flushed_frac,nonfinite_lost,error\n");
    for (int k = 0; k < NVARIANTS; k++)
        for (int l = 0; l < 2; l++) {
            const variant *v = &variants[k];
            const result *r = &res[k][l];
            fprintf(f, "%s,%s,%s,%s,%d,%s,%.6f,", v->family, fm_dtype_name(v->elem), scaling_name(v->mode),
                    rule_name(v->rule, v->mode), is_default_rule(v->rule, v->mode), l ? "col" : "row",
                    r->bytes_per_elem);
            if (r->ok) {
                /* Commas cannot appear in numbers; errors are quoted below. */
                fprintf(f, "%.6f,%.6e,%.6e,%.6e,%.6e,%.6e,%lld,\n", sqnr_db(r), r->max_rel,
                        r->nonzero ? r->sum_rel / (double)r->nonzero : 0.0, frac(r->saturated, r->total),
                        frac(r->clipped, r->total), frac(r->flushed, r->nonzero), (long long)r->lost);
            } else {
                fprintf(f, ",,,,,,,\"");
                for (const char *c = r->why; *c; c++)
                    fputs(*c == '"' ? "\"\"" : (char[2]){*c, 0}, f);
                fprintf(f, "\"\n");
            }
        }
    if (fclose(f) != 0) {
        fprintf(stderr, "%s: writing %s failed: %s\n", prog, path, strerror(errno));
        return -1;
    }
    return 0;
}

/* ---- main ------------------------------------------------------------------- */

static float to_f32(const void *p, fm_dtype t, int64_t i)
{
    if (t == FM_DTYPE_F32)
        return ((const float *)p)[i];
    if (t == FM_DTYPE_BF16)
        return fm_bf16_to_f32(((const uint16_t *)p)[i]);
    return fm_f16_to_f32(((const uint16_t *)p)[i]);
}

int main(int argc, char **argv)
{
    options o;
    int rc = parse_args(argc, argv, &o);
    if (rc >= 0)
        return rc;
    rc = 1;
    double t0 = now_s();

    /* Opened first, so a bad path fails before seconds of work. */
    FILE *csv = NULL;
    if (o.csv && !(csv = fopen(o.csv, "w"))) {
        fprintf(stderr, "%s: cannot create %s: %s\n", prog, o.csv, strerror(errno));
        return 1;
    }
    fm_context *ctx = NULL;
    fm_context_config cc = {.backend = o.backend};
    fm_status st = fm_context_create(&cc, &ctx);
    if (st != FM_OK) {
        fprintf(stderr, "%s: cannot create a %s context: %s\n", prog,
                o.backend == FM_BACKEND_CUDA ? "cuda" : o.backend == FM_BACKEND_AUTO ? "auto" : "cpu",
                fm_last_error(NULL));
        if (csv)
            fclose(csv);
        return 1;
    }
    on_device = fm_context_device(ctx) == FM_DEVICE_CUDA;
#ifndef FM_HAVE_CUDA
    if (on_device) {
        fprintf(stderr, "%s: the context is on a CUDA device but this tool was built without CUDA\n", prog);
        fm_context_destroy(ctx);
        if (csv)
            fclose(csv);
        return 1;
    }
#endif

    /* The input, in its own dtype (what the quantizer reads), and as F32
     * (what the errors are measured against: every input dtype is exact in F32). */
    npy_array arr = {0};
    buf in = {0};
    float *x = NULL;
    int64_t rows, cols;
    fm_dtype in_dtype;
    char what[512], err[512];
    if (o.in) {
        if (npy_read_file(o.in, &arr, err, sizeof err)) {
            fprintf(stderr, "%s: %s\n", prog, err);
            goto out;
        }
        rows = arr.rows;
        cols = arr.cols;
        in_dtype = arr.dtype == NPY_BF16 ? FM_DTYPE_BF16 : arr.dtype == NPY_F16 ? FM_DTYPE_F16 : FM_DTYPE_F32;
        if (rows == 0 || cols == 0) {
            fprintf(stderr, "%s: %s: the tensor is empty ([%lld, %lld]); nothing to measure\n", prog, o.in,
                    (long long)rows, (long long)cols);
            goto out;
        }
        if (rows > MAX_ELEMS / cols) {
            fprintf(stderr, "%s: %s: [%lld, %lld] has more than %lld elements; pass a slice\n", prog, o.in,
                    (long long)rows, (long long)cols, (long long)MAX_ELEMS);
            goto out;
        }
        snprintf(what, sizeof what, "%s ('%s'%s)", o.in, arr.descr,
                 arr.ndim == 2 ? "" : arr.ndim < 2 ? ", viewed as one row" : ", leading dims flattened");
    } else {
        rows = o.rows;
        cols = o.cols;
        in_dtype = o.gen_dtype;
        snprintf(what, sizeof what,
                 "generated: Student-t(%d) x per-token lognormal(sigma %.1f), %lld outlier channels x%.0f-%.0f, "
                 "seed %llu",
                 GEN_NU, GEN_ROW_SIGMA, (long long)gen_outlier_count(cols), GEN_OUT_MIN, GEN_OUT_MAX,
                 (unsigned long long)o.seed);
    }
    int64_t numel = rows * cols;
    size_t esize = (size_t)fm_dtype_bits(in_dtype) / 8;
    x = malloc((size_t)numel * sizeof *x);
    if (!x || buf_alloc(&in, (size_t)numel * esize, err, sizeof err)) {
        fprintf(stderr, "%s: %s\n", prog, x ? err : "out of host memory");
        goto out;
    }
    if (o.in) {
        memcpy(in.h, arr.data, (size_t)numel * esize);
        npy_free(&arr);
        for (int64_t i = 0; i < numel; i++)
            x[i] = to_f32(in.h, in_dtype, i);
    } else {
        if (generate(x, rows, cols, o.seed)) {
            fprintf(stderr, "%s: out of host memory\n", prog);
            goto out;
        }
        for (int64_t i = 0; i < numel; i++) {
            if (in_dtype == FM_DTYPE_BF16)
                ((uint16_t *)in.h)[i] = fm_bf16_from_f32(x[i]);
            else if (in_dtype == FM_DTYPE_F16)
                ((uint16_t *)in.h)[i] = fm_f16_from_f32(x[i]);
            else
                ((float *)in.h)[i] = x[i];
            x[i] = to_f32(in.h, in_dtype, i);
        }
    }
    if (o.dump && npy_write_f32(o.dump, x, rows, cols, 0, err, sizeof err)) {
        fprintf(stderr, "%s: %s\n", prog, err);
        goto out;
    }
    if (buf_upload(&in, err, sizeof err)) {
        fprintf(stderr, "%s: %s\n", prog, err);
        goto out;
    }

    int64_t nonfinite = 0, zeros = 0;
    double amax = 0;
    for (int64_t i = 0; i < numel; i++) {
        if (!isfinite(x[i]))
            nonfinite++;
        else if (x[i] == 0.0f)
            zeros++;
        else if (fabs((double)x[i]) > amax)
            amax = fabs((double)x[i]);
    }
    printf("%s: [%lld, %lld] %s on the %s backend; %s\n", prog, (long long)rows, (long long)cols,
           fm_dtype_name(in_dtype), fm_context_backend_name(ctx), what);
    printf("input: amax %.4g, %.3f%% zeros, %lld non-finite\n\n", amax, 100.0 * frac(zeros, numel),
           (long long)nonfinite);

    result(*res)[2] = calloc(NVARIANTS, sizeof *res);
    if (!res) {
        fprintf(stderr, "%s: out of host memory\n", prog);
        goto out;
    }
    job jb = {ctx, &in, in_dtype, rows, cols, x};
    print_header();
    int failed = 0;
    int64_t lost = 0;
    for (int k = 0; k < NVARIANTS; k++) {
        if (k > 0 && strcmp(variants[k].family, variants[k - 1].family))
            printf("\n");
        run_variant(&jb, &variants[k], res[k]);
        for (int l = 0; l < 2; l++) {
            print_row(&variants[k], l, &res[k][l]);
            failed += !res[k][l].ok;
            lost += res[k][l].lost;
        }
        fflush(stdout);
    }
    printf("\nB/elem: data+scale bytes per element | SQNR: 10log10(sum x^2/sum err^2) | rel: |q-x|/|x| over nonzero x"
           " | sat: codes at +-max | clip: |x| beyond max*scale | ftz: nonzero x that became 0 | *: default rule\n");
    if (nonfinite)
        printf("note: %lld non-finite inputs are left out of the statistics, and so are the finite values that "
               "shared a scale block with one (they come back NaN: %lld over all rows above)\n",
               (long long)nonfinite, (long long)lost);
    if (failed)
        printf("note: %d of %d rows could not be measured (n/a above)\n", failed, 2 * NVARIANTS);
    print_repaths(&jb);
    printf("\n%d formats x 2 layouts and %d re-encoding paths in %.1f s\n", NVARIANTS, NREPATHS, now_s() - t0);
    rc = 0;
    if (csv && write_csv(csv, o.csv, res))
        rc = 1;
    csv = NULL;
    free(res);
out:
    npy_free(&arr);
    buf_free(&in);
    free(x);
    fm_context_destroy(ctx);
    if (csv)
        fclose(csv);
    return rc;
}
