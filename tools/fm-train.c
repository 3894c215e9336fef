/* fm-train: trains a small MoE model with each flowmoe recipe side by side.
 *
 * The model is embedding-free: L blocks x = x + MoE(RMSNorm(x)), the MoE
 * being flowmoe's layer (fm_moe_layer) in the recipe under test. The task is
 * regression onto a fixed random TEACHER of the same architecture, computed on
 * the host in double without the library (train_host.c), so the targets do
 * not depend on the code under test and the loss has a known floor (zero).
 * The teacher's router and W1 read x through a random rank-4 projection
 * (--teacher-rank): a full-rank random MoE needs far more samples than a
 * one-minute run sees, and the students would learn only its linear part.
 * Every recipe's student starts from the same weights and sees the same
 * batches; the loss curves differ only by the recipe's arithmetic.
 *
 * The host keeps F32 masters, AdamW and RMSNorm; the layers' weights and
 * gradients live in the context's memory (device memory on CUDA), copied in
 * before each refresh and back after each backward. Activations cross the
 * same way around each layer call: slow on a GPU, but the layer is what is
 * measured, and it keeps the trainer backend-agnostic.
 *
 * --ep N runs expert parallelism over N in-process ranks (one thread and one
 * CPU context each, fm_comm_create_inproc): rank r takes the r-th block of
 * each batch's tokens and owns the r-th block of each layer's experts; the
 * layer dispatches and combines between them. Every rank keeps a full replica
 * of the host masters: after backward the ranks sum the replicated gradients
 * (norm gains, router) in rank order and gather the expert ones from their
 * owners, so every replica takes the same AdamW step. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "flowmoe/flowmoe.h"
#include "svg.h"
#include "train_host.h"

static const char *prog = "fm-train";

#define MAX_DIM 65536
#define LAST_STEPS 10 /* the training-loss column is the mean over these */
#define EVAL_BATCHES 8 /* held-out batches every recipe's final weights are judged on */

/* ---- options ------------------------------------------------------------- */

typedef struct {
    fm_backend_kind backend;
    fm_recipe recipes[FM_RECIPE_COUNT];
    int nrecipes;
    int control;   /* one more bf16 student from slightly perturbed initial weights */
    int wgrad_tight; /* fm_moe_layer_config.wgrad_tight_columns of every layer */
    int recompute_h; /* fm_moe_layer_config.recompute_h of every layer */
    int nstudents; /* nrecipes + control */
    int64_t steps, layers, hidden, ffn, experts, topk, tokens, threads, print_every, rank, ep;
    uint64_t seed;
    double lr, wd;
    const char *out;
} options;

static const options defaults = {
    .backend = FM_BACKEND_CPU,
    .recipes = {FM_RECIPE_BF16, FM_RECIPE_FP8_BLOCKWISE, FM_RECIPE_FP8_FLOW, FM_RECIPE_FP8_FLOW_FP4},
    .nrecipes = FM_RECIPE_COUNT,
    .steps = 200,
    .layers = 2,
    .hidden = 128,
    .ffn = 64,
    .experts = 4,
    .topk = 2,
    .tokens = 256,
    .rank = 4,
    .ep = 1,
    .seed = 1,
    .lr = 1e-2,
    .wd = 0.01,
    .out = "out/fm-train",
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: %s [--backend cpu|cuda] [--recipes LIST] [--steps N] [--seed S] [--layers L]\n"
            "          [--hidden H] [--ffn I] [--experts E] [--topk K] [--tokens T] [--lr LR] [--wd WD]\n"
            "          [--teacher-rank R] [--threads N] [--ep N] [--print-every N] [--control] [--wgrad-tight]\n"
            "          [--recompute-h] [--out DIR] [--help]\n"
            "\n"
            "Trains a small MoE model (L blocks x = x + MoE(RMSNorm(x)), AdamW, MSE) to imitate a fixed\n"
            "random teacher of the same shape, once per flowmoe recipe, from the same initial weights\n"
            "and on the same batches, and compares the recipes' loss, casts, saved activations and speed.\n"
            "\n"
            "  --backend B       cpu (default) or cuda\n"
            "  --recipes LIST    comma-separated, of bf16, fp8-blockwise, fp8-flow, fp8-flow-fp4 (default: all)\n"
            "  --steps N         optimizer steps, a fresh batch each (default %lld)\n"
            "  --seed S          seed of the teacher, the initial weights and the data (default %llu)\n"
            "  --layers L        MoE blocks (default %lld)\n"
            "  --hidden H        hidden size (default %lld)\n"
            "  --ffn I           each expert's FFN size (default %lld)\n"
            "  --experts E       experts per layer (default %lld)\n"
            "  --topk K          experts per token, 1..E (default %lld)\n"
            "  --tokens T        tokens per batch (default %lld)\n"
            "  --lr LR           AdamW learning rate (default %g; betas 0.9, 0.95)\n"
            "  --wd WD           AdamW decoupled weight decay of the MoE weights (default %g)\n"
            "  --teacher-rank R  the teacher's router and W1 read x through a random rank-R projection,\n"
            "                    so that a short run learns a good part of it; 0 = full rank (default %lld)\n"
            "  --threads N       CPU backend threads, 0 = all cores (default 0); with --ep, shared by the ranks\n"
            "  --ep N            expert parallelism over N in-process ranks (CPU backend; N divides E;\n"
            "                    default 1): each rank trains on 1/N of the tokens with 1/N of the experts\n"
            "  --print-every N   a progress line every N steps (default: about 50 lines per run)\n"
            "  --control         also train bf16-control: bf16 from initial weights changed by a relative\n"
            "                    2^-12, whose gap to bf16 is how far two runs drift apart on this task alone\n"
            "  --wgrad-tight     fp8-flow(-fp4): weight gradients read x and h scaled per 128 x 1 column\n"
            "                    block (TIGHT) instead of per 128 x 128 tile (ROWMAX, the default)\n"
            "  --recompute-h     fp8-flow(-fp4): backward recomputes h from the saved SwiGLU input instead\n"
            "                    of keeping the forward's (fewer bytes kept, one more SwiGLU pass)\n"
            "  --out DIR         where loss.csv and loss.svg go (default %s)\n"
            "  --help            this text\n",
            prog, (long long)defaults.steps, (unsigned long long)defaults.seed, (long long)defaults.layers,
            (long long)defaults.hidden, (long long)defaults.ffn, (long long)defaults.experts,
            (long long)defaults.topk, (long long)defaults.tokens, defaults.lr, defaults.wd, (long long)defaults.rank,
            defaults.out);
}

static int usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, "%s: ", prog);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n\n");
    usage(stderr);
    return 2;
}

static int parse_f64(const char *s, double lo, double hi, double *v)
{
    char *end;
    if (!s || !*s)
        return -1;
    errno = 0;
    double x = strtod(s, &end);
    if (errno || *end || !isfinite(x) || x < lo || x > hi)
        return -1;
    *v = x;
    return 0;
}

static int parse_recipes(const char *s, options *o)
{
    o->nrecipes = 0;
    char buf[256];
    if (strlen(s) >= sizeof buf)
        return -1;
    strcpy(buf, s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        fm_recipe r;
        if (!fm_recipe_parse(tok, &r))
            return -1;
        for (int i = 0; i < o->nrecipes; i++)
            if (o->recipes[i] == r)
                return -1;
        o->recipes[o->nrecipes++] = r;
    }
    return o->nrecipes > 0 ? 0 : -1;
}

/* Returns -1 to go on, else the exit status. */
static int parse_args(int argc, char **argv, options *o)
{
    *o = defaults;
    int print_every_set = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--control")) {
            o->control = 1;
            continue;
        }
        if (!strcmp(a, "--wgrad-tight")) {
            o->wgrad_tight = 1;
            continue;
        }
        if (!strcmp(a, "--recompute-h")) {
            o->recompute_h = 1;
            continue;
        }
        static const char *const with_value[] = {"--backend", "--recipes", "--steps", "--seed", "--layers",
                                                 "--hidden", "--ffn", "--experts", "--topk", "--tokens",
                                                 "--lr", "--wd", "--threads", "--print-every", "--teacher-rank", "--out",
                                                 "--ep"};
        const char *name = NULL, *val = NULL;
        int got = cli_option(argc, argv, &i, with_value, sizeof with_value / sizeof with_value[0], &name, &val);
        if (got < 0)
            return usage_error("%s needs a value", name);
        if (got == 0)
            return usage_error("unknown argument '%s'", a);
        int64_t v;
        if (!strcmp(name, "--backend")) {
            if (!strcmp(val, "cpu"))
                o->backend = FM_BACKEND_CPU;
            else if (!strcmp(val, "cuda"))
                o->backend = FM_BACKEND_CUDA;
            else
                return usage_error("--backend must be cpu or cuda, got '%s'", val);
        } else if (!strcmp(name, "--recipes")) {
            if (parse_recipes(val, o))
                return usage_error("--recipes must be distinct names among bf16, fp8-blockwise, fp8-flow, "
                                   "fp8-flow-fp4, separated by commas; got '%s'", val);
        } else if (!strcmp(name, "--seed")) {
            if (cli_parse_i64(val, 0, INT64_MAX, &v))
                return usage_error("--seed must be a non-negative integer, got '%s'", val);
            o->seed = (uint64_t)v;
        } else if (!strcmp(name, "--lr")) {
            if (parse_f64(val, 1e-12, 10, &o->lr))
                return usage_error("--lr must be a number in [1e-12, 10], got '%s'", val);
        } else if (!strcmp(name, "--wd")) {
            if (parse_f64(val, 0, 10, &o->wd))
                return usage_error("--wd must be a number in [0, 10], got '%s'", val);
        } else if (!strcmp(name, "--out")) {
            if (!*val)
                return usage_error("%s", "--out must name a directory");
            o->out = val;
        } else {
            static const struct {
                const char *name;
                int64_t lo, hi;
                const char *rule;
            } ints[] = {
                {"--steps", 1, 10000000, "--steps must be an integer in 1..10000000, got '%s'"},
                {"--layers", 1, 64, "--layers must be an integer in 1..64, got '%s'"},
                {"--hidden", 1, MAX_DIM, "--hidden must be an integer in 1..65536, got '%s'"},
                {"--ffn", 1, MAX_DIM, "--ffn must be an integer in 1..65536, got '%s'"},
                {"--experts", 1, 1024, "--experts must be an integer in 1..1024, got '%s'"},
                {"--topk", 1, 1024, "--topk must be an integer in 1..1024, got '%s'"},
                {"--tokens", 1, 1 << 20, "--tokens must be an integer in 1..1048576, got '%s'"},
                {"--threads", 0, 1024, "--threads must be an integer in 0..1024, got '%s'"},
                {"--print-every", 1, 10000000, "--print-every must be an integer in 1..10000000, got '%s'"},
                {"--teacher-rank", 0, MAX_DIM, "--teacher-rank must be an integer in 0..65536, got '%s'"},
                {"--ep", 1, 64, "--ep must be an integer in 1..64, got '%s'"},
            };
            int64_t *dst[] = {&o->steps, &o->layers, &o->hidden, &o->ffn, &o->experts,
                              &o->topk, &o->tokens, &o->threads, &o->print_every, &o->rank, &o->ep};
            for (size_t k = 0; k < sizeof ints / sizeof ints[0]; k++)
                if (!strcmp(name, ints[k].name)) {
                    if (cli_parse_i64(val, ints[k].lo, ints[k].hi, dst[k]))
                        return usage_error(ints[k].rule, val);
                    if (dst[k] == &o->print_every)
                        print_every_set = 1;
                }
        }
    }
    if (o->topk > o->experts)
        return usage_error("%s", "--topk must not exceed --experts");
    if (o->experts % o->ep)
        return usage_error("%s", "--ep must divide --experts (each rank owns an equal block of experts)");
    if (o->ep > 1 && o->backend != FM_BACKEND_CPU)
        return usage_error("%s", "--ep runs in-process ranks on the CPU backend; N GPUs need one process per GPU "
                                 "with an NCCL communicator, which fm-train does not start yet");
    if (o->control) {
        int has_bf16 = 0;
        for (int r = 0; r < o->nrecipes; r++)
            has_bf16 |= o->recipes[r] == FM_RECIPE_BF16;
        if (!has_bf16)
            return usage_error("%s", "--control needs bf16 among --recipes (its gap is to bf16)");
    }
    o->nstudents = o->nrecipes + o->control;
    /* Working set: the biggest buffers are the expert weights, ~20 floats per
     * weight per recipe (masters, grads, moments, layer copies), on every
     * --ep rank (each keeps a replica of the masters). */
    double weights = (double)o->layers * (double)o->experts * 3.0 * (double)o->ffn * (double)o->hidden;
    if (weights * 80.0 * o->nstudents * (double)o->ep + (double)o->tokens * (double)o->hidden * 4.0 * 8 * (double)o->layers >
        64.0 * (1ull << 30))
        return usage_error("%s", "the model is too large: it would need over 64 GiB of memory");
    if (!print_every_set)
        o->print_every = o->steps <= 50 ? 1 : (o->steps + 49) / 50;
    return -1;
}

/* ---- helpers ------------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* mkdir -p */
static int make_dirs(const char *path)
{
    char buf[4096];
    size_t n = strlen(path);
    if (n >= sizeof buf)
        return -1;
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != '\0')
            continue;
        char c = buf[i];
        buf[i] = '\0';
        if (mkdir(buf, 0777) && errno != EEXIST)
            return -1;
        buf[i] = c;
    }
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode) ? 0 : -1;
}

static int64_t explicit_casts(fm_context *ctx)
{
    fm_stats st;
    if (fm_stats_get(ctx, &st) != FM_OK)
        return 0;
    return st.casts_to_low + st.casts_to_high;
}

/* ---- the model ----------------------------------------------------------- */

enum { P_GAIN, P_ROUTER, P_W1, P_W2, NPARAM };

/* One block x = x + MoE(RMSNorm(x)) of one student. */
typedef struct {
    fm_moe_layer *layer;
    float *p[NPARAM], *g[NPARAM], *m[NPARAM], *v[NPARAM]; /* host: masters, grads, AdamW moments */
    float *gs[NPARAM];                                    /* --ep: the gradient summed over ranks (else g) */
    fm_moe_weights dev;                                   /* context memory: weights, grads */
    float *dev_x;                                         /* context memory: the layer's input [T, H],
                                                             kept for its backward */
    void *dev_mem;
    float *x, *n, *rstd;                                  /* host: block input, its norm, 1/rms */
    void *host_mem;
} block;

typedef struct {
    fm_recipe recipe;
    const char *name; /* the recipe's, or bf16-control */
    int control;      /* bf16 from perturbed initial weights (--control) */
    block *blocks;
    double *loss;           /* [steps] */
    double seconds;         /* this recipe's share of the run */
    int64_t measured_casts; /* last step: explicit casts around every layer call */
    /* Read from the layers after the last training step (an evaluation
     * forward would overwrite them): layer 0's casts per step, and the saved
     * activation bytes averaged over the layers. */
    int64_t info_casts, info_casts_sum; /* layer 0's, all layers' */
    double info_saved;
    double eval_loss;       /* mean loss of the final weights on the held-out batches */
    double eval_bf16;       /* the same weights through bf16 layers: training apart from the forward's format */
    double eval_fwd;        /* bf16's final weights through this recipe's layers: the forward's format alone */
} student;

struct ep_group;

typedef struct {
    const options *o;
    fm_context *ctx;
    fm_device dev;
    int64_t T, H, I, E;    /* T: this rank's tokens */
    int64_t Tall, t0;      /* the batch's tokens; this rank's first */
    int64_t Tmax;          /* the most tokens any rank has (every rank's layer max_tokens) */
    int rank, nranks;
    fm_comm *comm;         /* NULL without --ep */
    struct ep_group *grp;
    student *st;           /* this rank's students (other ranks read their gradients) */
    int64_t count[NPARAM]; /* parameters per block (host masters) */
    int64_t lcount[NPARAM], loff[NPARAM]; /* this rank's part in the layer: W1, W2 its experts' slice */
    float *dev_a, *dev_b;  /* context memory: a layer call's output and dy, [T, H] */
    float *out, *dcur, *dn, *dxn; /* host scratch, [T, H] */
    tr_adamw opt;
} trainer;

/* ---- the ranks of --ep --------------------------------------------------- */

/* What the rank threads share: a barrier that a failing rank breaks (so no
 * rank waits for it), and one slot per rank for the sums. */
typedef struct ep_group {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n, waiting, broken;
    unsigned long gen;
    double slot[64];
    trainer *tr[64];
} ep_group;

static int ep_barrier(trainer *tr)
{
    ep_group *g = tr->grp;
    if (!g)
        return 0;
    pthread_mutex_lock(&g->mu);
    unsigned long gen = g->gen;
    if (++g->waiting == g->n) {
        g->waiting = 0;
        g->gen++;
        pthread_cond_broadcast(&g->cv);
    } else {
        while (gen == g->gen && !g->broken)
            pthread_cond_wait(&g->cv, &g->mu);
    }
    int broken = g->broken;
    pthread_mutex_unlock(&g->mu);
    return broken;
}

/* A rank that fails releases the others: from the barrier, and from the
 * layer's collectives (fm_comm_abort). */
static void ep_break(trainer *tr)
{
    ep_group *g = tr->grp;
    if (!g)
        return;
    pthread_mutex_lock(&g->mu);
    g->broken = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    fm_comm_abort(tr->comm);
}

/* *sum = Σ over ranks in rank order of v: the same bits on every rank. */
static int ep_sum(trainer *tr, double v, double *sum)
{
    if (!tr->grp) {
        *sum = v;
        return 0;
    }
    tr->grp->slot[tr->rank] = v;
    if (ep_barrier(tr))
        return 1;
    double s = 0;
    for (int q = 0; q < tr->nranks; q++)
        s += tr->grp->slot[q];
    *sum = s;
    return ep_barrier(tr);
}

static int fail(fm_context *ctx, const char *what)
{
    fprintf(stderr, "%s: %s: %s\n", prog, what, fm_last_error(ctx));
    return 1;
}

#define CALL(what, expr)                \
    do {                                \
        if ((expr) != FM_OK)            \
            return fail(tr->ctx, what); \
    } while (0)

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* Host and context memory of one block, weights copied from `init`. */
static int block_create(trainer *tr, fm_recipe recipe, block *b, const block *init)
{
    const options *o = tr->o;
    *b = (block){0};
    size_t host_floats = 0, arrays = tr->grp ? 5 : 4;
    for (int p = 0; p < NPARAM; p++)
        host_floats += arrays * (size_t)tr->count[p];
    host_floats += 2 * (size_t)(tr->T * tr->H) + (size_t)tr->T;
    float *h = calloc(host_floats, sizeof(float));
    if (!h) {
        fprintf(stderr, "%s: out of host memory\n", prog);
        return 1;
    }
    b->host_mem = h;
    for (int p = 0; p < NPARAM; p++) {
        b->p[p] = h, h += tr->count[p];
        b->g[p] = h, h += tr->count[p];
        b->m[p] = h, h += tr->count[p];
        b->v[p] = h, h += tr->count[p];
        b->gs[p] = b->g[p];
        if (tr->grp)
            b->gs[p] = h, h += tr->count[p];
        if (init)
            memcpy(b->p[p], init->p[p], (size_t)tr->count[p] * sizeof(float));
    }
    b->x = h, h += tr->T * tr->H;
    b->n = h, h += tr->T * tr->H;
    b->rstd = h;

    /* Context memory: router, w1, w2, their gradients and the layer's input,
     * each 256-byte aligned. */
    size_t off[7], total = 0;
    for (int k = 0; k < 7; k++) {
        off[k] = total;
        total += round_up((size_t)(k < 6 ? tr->lcount[P_ROUTER + k % 3] : tr->T * tr->H) * sizeof(float), 256);
    }
    void *d;
    if (fm_context_alloc(tr->ctx, total, &d) != FM_OK)
        return fail(tr->ctx, "fm_context_alloc");
    b->dev_mem = d;
    char *base = d;
    b->dev = (fm_moe_weights){.router = (float *)(base + off[0]), .w1 = (float *)(base + off[1]),
                              .w2 = (float *)(base + off[2]), .grad_router = (float *)(base + off[3]),
                              .grad_w1 = (float *)(base + off[4]), .grad_w2 = (float *)(base + off[5])};
    b->dev_x = (float *)(base + off[6]);
    fm_moe_layer_config cfg = {.hidden = tr->H, .ffn = tr->I, .experts = tr->E, .topk = (int)o->topk,
                               .score = FM_ROUTER_SOFTMAX, .renormalize = 1, .recipe = recipe,
                               .max_tokens = tr->Tmax, .comm = tr->comm, .wgrad_tight_columns = o->wgrad_tight,
                               .recompute_h = o->recompute_h};
    if (fm_moe_layer_create(tr->ctx, &cfg, &b->layer) != FM_OK)
        return fail(tr->ctx, "fm_moe_layer_create");
    return 0;
}

static void block_destroy(trainer *tr, block *b)
{
    if (b->layer)
        fm_moe_layer_destroy(b->layer);
    if (b->dev_mem)
        fm_context_free(tr->ctx, b->dev_mem);
    free(b->host_mem);
    *b = (block){0};
}

/* A copy of `bytes` between host and context memory. */
static fm_status to_dev(trainer *tr, void *dst, const void *src, size_t bytes)
{
    return fm_context_copy(tr->ctx, dst, tr->dev, src, FM_DEVICE_HOST, bytes);
}
static fm_status to_host(trainer *tr, void *dst, const void *src, size_t bytes)
{
    return fm_context_copy(tr->ctx, dst, FM_DEVICE_HOST, src, tr->dev, bytes);
}

static fm_tensor act_tensor(trainer *tr, float *p)
{
    fm_tensor t = fm_tensor_2d(p, FM_DTYPE_F32, tr->T, tr->H);
    t.device = tr->dev;
    return t;
}

/* After every rank's backward (--ep): into gs, the replicated gradients
 * (norm gains, router: each rank's tokens' share) summed in rank order, and
 * the expert gradients gathered from the ranks that own them. */
static int ep_reduce_grads(trainer *tr, const student *s)
{
    if (!tr->grp)
        return 0;
    int si = (int)(s - tr->st);
    if (ep_barrier(tr))
        return 1;
    for (int64_t l = 0; l < tr->o->layers; l++) {
        const block *bl = &s->blocks[l];
        for (int p = 0; p < NPARAM; p++) {
            for (int q = 0; q < tr->nranks; q++) {
                const trainer *o = tr->grp->tr[q];
                const float *g = o->st[si].blocks[l].g[p];
                if (p == P_W1 || p == P_W2)
                    memcpy(bl->gs[p] + o->loff[p], g + o->loff[p], (size_t)o->lcount[p] * sizeof(float));
                else if (q == 0)
                    memcpy(bl->gs[p], g, (size_t)tr->count[p] * sizeof(float));
                else
                    for (int64_t i = 0; i < tr->count[p]; i++)
                        bl->gs[p][i] += g[i];
            }
        }
    }
    return ep_barrier(tr);
}

/* The host masters to the device and the layers' low-precision copies. */
static int refresh(trainer *tr, student *s)
{
    for (int64_t l = 0; l < tr->o->layers; l++) {
        block *bl = &s->blocks[l];
        CALL("weights to the device", to_dev(tr, bl->dev.router, bl->p[P_ROUTER], (size_t)tr->count[P_ROUTER] * 4));
        CALL("weights to the device",
             to_dev(tr, bl->dev.w1, bl->p[P_W1] + tr->loff[P_W1], (size_t)tr->lcount[P_W1] * 4));
        CALL("weights to the device",
             to_dev(tr, bl->dev.w2, bl->p[P_W2] + tr->loff[P_W2], (size_t)tr->lcount[P_W2] * 4));
        CALL("fm_moe_layer_refresh_weights", fm_moe_layer_refresh_weights(bl->layer, &bl->dev));
    }
    return 0;
}

/* The model on x; the output lands in tr->out. Adds the explicit casts of
 * the layer calls to *casts. */
static int forward(trainer *tr, student *s, const float *x, int64_t *casts)
{
    const int64_t L = tr->o->layers, TH = tr->T * tr->H;
    const size_t act_bytes = (size_t)TH * sizeof(float);
    fm_tensor b = act_tensor(tr, tr->dev_b);
    memcpy(s->blocks[0].x, x, act_bytes);
    for (int64_t l = 0; l < L; l++) {
        block *bl = &s->blocks[l];
        tr_rmsnorm_forward(bl->x, bl->p[P_GAIN], tr->T, tr->H, bl->n, bl->rstd);
        CALL("activations to the device", to_dev(tr, bl->dev_x, bl->n, act_bytes));
        fm_tensor in = act_tensor(tr, bl->dev_x);
        int64_t c0 = explicit_casts(tr->ctx);
        CALL("fm_moe_layer_forward", fm_moe_layer_forward(bl->layer, &bl->dev, &in, &b));
        *casts += explicit_casts(tr->ctx) - c0;
        CALL("activations to the host", to_host(tr, tr->out, tr->dev_b, act_bytes));
        float *next = l + 1 < L ? s->blocks[l + 1].x : tr->out;
        for (int64_t i = 0; i < TH; i++)
            next[i] = bl->x[i] + tr->out[i];
    }
    return 0;
}

/* One optimizer step of student s on this rank's tokens x -> target y. */
static int train_step(trainer *tr, student *s, int64_t step, const float *x, const float *y)
{
    const int64_t L = tr->o->layers, TH = tr->T * tr->H;
    const size_t act_bytes = (size_t)TH * sizeof(float);
    double t0 = now_s();
    int64_t casts = 0;
    fm_tensor a = act_tensor(tr, tr->dev_a), b = act_tensor(tr, tr->dev_b);
    if (refresh(tr, s) || forward(tr, s, x, &casts))
        return 1;
    /* loss = mean((out - y)²) over the whole batch, and its gradient */
    const double all = (double)(tr->Tall * tr->H);
    double loss = 0;
    for (int64_t i = 0; i < TH; i++) {
        double d = (double)tr->out[i] - y[i];
        loss += d * d;
        tr->dcur[i] = (float)(2.0 * d / all);
    }
    if (ep_sum(tr, loss, &loss))
        return 1;
    s->loss[step - 1] = loss / all;
    /* backward */
    for (int64_t l = L - 1; l >= 0; l--) {
        block *bl = &s->blocks[l];
        CALL("fm_context_memset", fm_context_memset(tr->ctx, bl->dev.grad_router, 0, (size_t)tr->count[P_ROUTER] * 4));
        CALL("fm_context_memset", fm_context_memset(tr->ctx, bl->dev.grad_w1, 0, (size_t)tr->lcount[P_W1] * 4));
        CALL("fm_context_memset", fm_context_memset(tr->ctx, bl->dev.grad_w2, 0, (size_t)tr->lcount[P_W2] * 4));
        CALL("gradients to the device", to_dev(tr, tr->dev_a, tr->dcur, act_bytes));
        fm_tensor in = act_tensor(tr, bl->dev_x);
        int64_t c0 = explicit_casts(tr->ctx);
        CALL("fm_moe_layer_backward", fm_moe_layer_backward(bl->layer, &bl->dev, &in, &a, &b));
        casts += explicit_casts(tr->ctx) - c0;
        CALL("gradients to the host", to_host(tr, tr->dn, tr->dev_b, act_bytes));
        CALL("gradients to the host", to_host(tr, bl->g[P_ROUTER], bl->dev.grad_router, (size_t)tr->count[P_ROUTER] * 4));
        CALL("gradients to the host",
             to_host(tr, bl->g[P_W1] + tr->loff[P_W1], bl->dev.grad_w1, (size_t)tr->lcount[P_W1] * 4));
        CALL("gradients to the host",
             to_host(tr, bl->g[P_W2] + tr->loff[P_W2], bl->dev.grad_w2, (size_t)tr->lcount[P_W2] * 4));
        memset(bl->g[P_GAIN], 0, (size_t)tr->count[P_GAIN] * sizeof(float));
        tr_rmsnorm_backward(bl->x, bl->p[P_GAIN], bl->rstd, tr->dn, tr->T, tr->H, tr->dxn, bl->g[P_GAIN]);
        for (int64_t i = 0; i < TH; i++) /* the residual path carries dcur on */
            tr->dcur[i] += tr->dxn[i];
    }
    if (ep_reduce_grads(tr, s))
        return 1;
    /* AdamW; the norm gains are not decayed, as is usual */
    for (int64_t l = 0; l < L; l++) {
        block *bl = &s->blocks[l];
        for (int p = 0; p < NPARAM; p++)
            tr_adamw_step(&tr->opt, step, bl->p[p], bl->gs[p], bl->m[p], bl->v[p], tr->count[p], p != P_GAIN);
    }
    s->measured_casts = casts;
    s->seconds += now_s() - t0;
    return 0;
}

/* The layer facts of the last training step, before evaluation forwards
 * overwrite them. */
static void keep_info(const trainer *tr, student *s)
{
    s->info_casts = -1;
    s->info_casts_sum = 0;
    s->info_saved = 0;
    for (int64_t l = 0; l < tr->o->layers; l++) {
        fm_moe_layer_info info;
        if (fm_moe_layer_get_info(s->blocks[l].layer, &info) == FM_OK) {
            s->info_casts_sum += info.casts_per_step;
            s->info_saved += (double)info.saved_bytes / (double)tr->o->layers;
            if (l == 0)
                s->info_casts = info.casts_per_step;
        }
    }
}

/* The final weights on held-out batches, the same for every recipe: the
 * training loss of the last steps moves with each fresh batch by more than
 * the gaps between recipes, this does not. */
static int evaluate(trainer *tr, student *s, const float *xs, const float *ys, double *loss)
{
    const int64_t TH = tr->T * tr->H, batch = tr->Tall * tr->H, mine = tr->t0 * tr->H;
    int64_t casts = 0;
    double sum = 0;
    if (refresh(tr, s))
        return 1;
    for (int b = 0; b < EVAL_BATCHES; b++) {
        if (forward(tr, s, xs + b * batch + mine, &casts))
            return 1;
        double l = 0;
        for (int64_t i = 0; i < TH; i++) {
            double d = (double)tr->out[i] - ys[b * batch + mine + i];
            l += d * d;
        }
        if (ep_sum(tr, l, &l))
            return 1;
        sum += l / (double)batch;
    }
    *loss = sum / EVAL_BATCHES;
    return 0;
}

/* The bf16 student (not --control's) that every gap is to, or -1. */
static int bf16_student(const student *st, int n)
{
    for (int r = 0; r < n; r++)
        if (st[r].recipe == FM_RECIPE_BF16 && !st[r].control)
            return r;
    return -1;
}

/* Student w's final weights through layers of `recipe` on the held-out batches. */
static int evaluate_as(trainer *tr, fm_recipe recipe, student *w, const float *xs, const float *ys, double *loss)
{
    const int64_t L = tr->o->layers;
    student ev = {.recipe = recipe, .blocks = calloc((size_t)L, sizeof(block))};
    int rc = !ev.blocks;
    if (rc)
        fprintf(stderr, "%s: out of host memory\n", prog);
    for (int64_t l = 0; l < L && !rc; l++)
        rc = block_create(tr, recipe, &ev.blocks[l], &w->blocks[l]);
    if (!rc)
        rc = evaluate(tr, &ev, xs, ys, loss);
    for (int64_t l = 0; ev.blocks && l < L; l++)
        block_destroy(tr, &ev.blocks[l]);
    free(ev.blocks);
    return rc;
}

/* A low-precision recipe's gap to bf16, taken apart (bf16 is the student of
 * that recipe without --control; NULL when the run has none):
 *  - s's final weights through bf16 layers: what its training did to the
 *    weights, without its own forward's quantization on top;
 *  - bf16's final weights through s's layers: what its forward's format costs
 *    on weights it did not train. */
static int evaluate_apart(trainer *tr, student *s, student *bf16, const float *xs, const float *ys)
{
    if (s->recipe == FM_RECIPE_BF16) {
        s->eval_bf16 = s->eval_loss;
        s->eval_fwd = bf16 ? bf16->eval_loss : NAN;
        return 0;
    }
    s->eval_fwd = NAN;
    int rc = evaluate_as(tr, FM_RECIPE_BF16, s, xs, ys, &s->eval_bf16);
    if (!rc && bf16)
        rc = evaluate_as(tr, s->recipe, bf16, xs, ys, &s->eval_fwd);
    return rc;
}

/* ---- output -------------------------------------------------------------- */

static double final_loss(const student *s, int64_t steps)
{
    int64_t n = steps < LAST_STEPS ? steps : LAST_STEPS;
    double sum = 0;
    for (int64_t i = steps - n; i < steps; i++)
        sum += s->loss[i];
    return sum / (double)n;
}

static int write_outputs(const options *o, const student *st)
{
    if (make_dirs(o->out)) {
        fprintf(stderr, "%s: cannot create the directory %s: %s\n", prog, o->out, strerror(errno));
        return 1;
    }
    char path[4200];
    snprintf(path, sizeof path, "%s/loss.csv", o->out);
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "%s: cannot write %s: %s\n", prog, path, strerror(errno));
        return 1;
    }
    fputs("step", f);
    for (int r = 0; r < o->nstudents; r++)
        fprintf(f, ",%s", st[r].name);
    fputc('\n', f);
    for (int64_t i = 0; i < o->steps; i++) {
        fprintf(f, "%lld", (long long)(i + 1));
        for (int r = 0; r < o->nstudents; r++)
            fprintf(f, ",%.9g", st[r].loss[i]);
        fputc('\n', f);
    }
    if (fclose(f)) {
        fprintf(stderr, "%s: cannot write %s: %s\n", prog, path, strerror(errno));
        return 1;
    }
    printf("wrote %s\n", path);

    snprintf(path, sizeof path, "%s/loss.svg", o->out);
    f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "%s: cannot write %s: %s\n", prog, path, strerror(errno));
        return 1;
    }
    const char *names[FM_RECIPE_COUNT + 1];
    const double *curves[FM_RECIPE_COUNT + 1];
    for (int r = 0; r < o->nstudents; r++)
        names[r] = st[r].name, curves[r] = st[r].loss;
    char title[256];
    snprintf(title, sizeof title, "fm-train: %lld layers, H=%lld, I=%lld, E=%lld, top-%lld, %lld tokens/step, seed %llu",
             (long long)o->layers, (long long)o->hidden, (long long)o->ffn, (long long)o->experts,
             (long long)o->topk, (long long)o->tokens, (unsigned long long)o->seed);
    int bad = svg_log_plot(f, title, "step", "MSE loss to the teacher (log scale)", o->nstudents, names, curves,
                           o->steps);
    if (fclose(f) || bad) {
        fprintf(stderr, "%s: cannot write %s: %s\n", prog, path, strerror(errno));
        return 1;
    }
    printf("wrote %s\n", path);
    return 0;
}

static void print_table(const trainer *tr, const student *st)
{
    const options *o = tr->o;
    const int bi = bf16_student(st, o->nstudents);
    const double base = bi >= 0 ? st[bi].eval_loss : NAN;
    int64_t n = o->steps < LAST_STEPS ? o->steps : LAST_STEPS;
    printf("\n| recipe | final loss (%d held-out batches) | gap to bf16 | the same weights, bf16 forward | gap to bf16 | "
           "bf16's weights, this forward | gap to bf16 | training loss (last %lld) | casts / layer-step | "
           "saved for backward / layer | tokens/s |\n",
           EVAL_BATCHES, (long long)n);
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int r = 0; r < o->nstudents; r++) {
        const student *s = &st[r];
        char gap[32] = "-", gap16[32] = "-", fwd[32] = "-", gapf[32] = "-";
        if (bi >= 0 && r != bi) {
            snprintf(gap, sizeof gap, "%+.2f%%", 100.0 * (s->eval_loss - base) / base);
            snprintf(gap16, sizeof gap16, "%+.2f%%", 100.0 * (s->eval_bf16 - base) / base);
        }
        if (bi >= 0) {
            snprintf(fwd, sizeof fwd, "%.4e", s->eval_fwd);
            if (r != bi)
                snprintf(gapf, sizeof gapf, "%+.2f%%", 100.0 * (s->eval_fwd - base) / base);
        }
        printf("| %s | %.4e | %s | %.4e | %s | %s | %s | %.4e | %lld | %.0f B (%.1f KiB) | %.0f |\n", s->name,
               s->eval_loss, gap, s->eval_bf16, gap16, fwd, gapf, final_loss(s, o->steps), (long long)s->info_casts,
               s->info_saved, s->info_saved / 1024.0,
               s->seconds > 0 ? (double)(o->tokens * o->steps) / s->seconds : 0);
    }
    if (tr->nranks > 1)
        printf("(--ep %d: casts and saved bytes are rank 0's layers', for its %lld of the %lld tokens; tokens/s is "
               "the whole batch over rank 0's time)\n",
               tr->nranks, (long long)tr->T, (long long)tr->Tall);
}

/* The layer's own count (fm_moe_layer_get_info) must agree with the context
 * statistics measured around each call; a mismatch means one of them is wrong. */
static void check_casts(const trainer *tr, const student *s)
{
    (void)tr;
    if (s->info_casts_sum != s->measured_casts)
        fprintf(stderr, "%s: warning: %s: the layers report %lld casts per step in all, the context statistics "
                        "counted %lld around the layer calls\n",
                prog, fm_recipe_name(s->recipe), (long long)s->info_casts_sum, (long long)s->measured_casts);
}

/* ---- main ---------------------------------------------------------------- */

static int run(trainer *tr, student *st)
{
    const options *o = tr->o;
    const int64_t T = tr->T, Tall = tr->Tall, H = tr->H, I = tr->I, E = tr->E, L = o->layers;
    const int lead = tr->rank == 0; /* prints and writes the outputs */
    tr->st = st;
    tr_moe_shape shape = {.hidden = H, .ffn = I, .experts = E, .topk = (int)o->topk, .renormalize = 1};

    /* Sizes the layer cannot take are usage errors, found before any work. */
    for (int r = 0; r < o->nrecipes; r++) {
        fm_moe_layer_config cfg = {.hidden = H, .ffn = I, .experts = E, .topk = (int)o->topk,
                                   .score = FM_ROUTER_SOFTMAX, .renormalize = 1, .recipe = o->recipes[r],
                                   .max_tokens = tr->Tmax, .comm = tr->comm};
        int64_t bytes;
        if (fm_moe_layer_workspace_size(tr->ctx, &cfg, &bytes) != FM_OK) {
            if (lead) {
                fprintf(stderr, "%s: %s: %s\n\n", prog, fm_recipe_name(o->recipes[r]), fm_last_error(tr->ctx));
                usage(stderr);
            }
            return 2;
        }
    }

    tr_teacher teacher;
    if (tr_teacher_create(&teacher, &shape, (int)L, o->rank, o->seed ^ 0x7465616368657221u)) {
        fprintf(stderr, "%s: out of host memory\n", prog);
        return 1;
    }
    int rc = 0;
    /* Every rank draws the whole batch (the same bits) and trains on its part. */
    const size_t mine = (size_t)((T > 0 ? T : 1) * H) * sizeof(float);
    float *x = malloc((size_t)(Tall * H) * sizeof *x), *y = malloc((size_t)(Tall * H) * sizeof *y);
    tr->out = malloc(mine);
    tr->dcur = malloc(mine);
    tr->dn = malloc(mine);
    tr->dxn = malloc(mine);
    block *init = calloc((size_t)L, sizeof *init);
    if (!x || !y || !tr->out || !tr->dcur || !tr->dn || !tr->dxn || !init) {
        fprintf(stderr, "%s: out of host memory\n", prog);
        rc = 1;
        goto done;
    }
    /* The shared initial weights: host arrays only, copied into every student. */
    tr_rng init_rng;
    tr_rng_seed(&init_rng, o->seed ^ 0x73747564656e7473u);
    for (int64_t l = 0; l < L && !rc; l++) {
        for (int p = 0; p < NPARAM && !rc; p++)
            if (!(init[l].p[p] = malloc((size_t)tr->count[p] * sizeof(float)))) {
                fprintf(stderr, "%s: out of host memory\n", prog);
                rc = 1;
            }
        if (rc)
            break;
        for (int64_t i = 0; i < H; i++)
            init[l].p[P_GAIN][i] = 1.0f;
        /* A small W2, as residual branches are usually initialised: the loss
         * starts at the teacher's own variance, not at that plus the student's. */
        tr_init_moe(&init_rng, &shape, 1.0, 0.1, init[l].p[P_ROUTER], init[l].p[P_W1], init[l].p[P_W2]);
    }
    for (int r = 0; r < o->nstudents && !rc; r++) {
        st[r].control = r >= o->nrecipes;
        st[r].recipe = st[r].control ? FM_RECIPE_BF16 : o->recipes[r];
        st[r].name = st[r].control ? "bf16-control" : fm_recipe_name(st[r].recipe);
        st[r].loss = calloc((size_t)o->steps, sizeof(double));
        st[r].blocks = calloc((size_t)L, sizeof(block));
        if (!st[r].loss || !st[r].blocks) {
            fprintf(stderr, "%s: out of host memory\n", prog);
            rc = 1;
            break;
        }
        for (int64_t l = 0; l < L && !rc; l++)
            rc = block_create(tr, st[r].recipe, &st[r].blocks[l], &init[l]);
        if (st[r].control && !rc) {
            /* The control's weights: each times 1 + 2^-12 u, u uniform in
             * [-1, 1), far below a bf16 rounding step. */
            tr_rng prng;
            tr_rng_seed(&prng, o->seed ^ 0x636f6e74726f6c21u);
            for (int64_t l = 0; l < L; l++)
                for (int q = 0; q < NPARAM; q++)
                    for (int64_t i = 0; i < tr->count[q]; i++)
                        st[r].blocks[l].p[q][i] *= (float)(1.0 + (2.0 * tr_uniform(&prng) - 1.0) / 4096.0);
        }
    }
    if (!rc) {
        void *a, *b;
        if (fm_context_alloc(tr->ctx, mine, &a) != FM_OK)
            rc = fail(tr->ctx, "fm_context_alloc");
        else if (tr->dev_a = a, fm_context_alloc(tr->ctx, mine, &b) != FM_OK)
            rc = fail(tr->ctx, "fm_context_alloc");
        else
            tr->dev_b = b;
    }
    if (rc)
        goto done;

    if (lead) {
        printf("%s: %lld layers x (H=%lld, I=%lld, E=%lld, top-%lld), %lld tokens/step, %lld steps, lr %g, seed "
               "%llu, %s backend",
               prog, (long long)L, (long long)H, (long long)I, (long long)E, (long long)o->topk, (long long)Tall,
               (long long)o->steps, o->lr, (unsigned long long)o->seed, fm_context_backend_name(tr->ctx));
        if (tr->comm)
            printf(", expert parallelism over %d in-process ranks (%lld experts each)", tr->nranks,
                   (long long)(E / tr->nranks));
        printf("\n%8s", "step");
        for (int r = 0; r < o->nstudents; r++)
            printf("  %13s", st[r].name);
        printf("  %10s\n", "tokens/s");
    }

    tr_rng data;
    tr_rng_seed(&data, o->seed ^ 0x6261746368657321u);
    double wall0 = now_s(), tick = wall0;
    int64_t since = 0;
    for (int64_t step = 1; step <= o->steps && !rc; step++) {
        tr_fill_normal(&data, x, Tall * H, 1.0);
        if (tr_teacher_forward(&teacher, x, Tall, y)) {
            fprintf(stderr, "%s: out of host memory\n", prog);
            rc = 1;
            break;
        }
        for (int r = 0; r < o->nstudents && !rc; r++)
            rc = train_step(tr, &st[r], step, x + tr->t0 * H, y + tr->t0 * H);
        since++;
        if (!rc && lead && (step % o->print_every == 0 || step == o->steps || step == 1)) {
            double t = now_s();
            printf("%8lld", (long long)step);
            for (int r = 0; r < o->nstudents; r++)
                printf("  %13.4e", st[r].loss[step - 1]);
            printf("  %10.0f\n", (double)(Tall * since * o->nstudents) / (t - tick));
            fflush(stdout);
            tick = t, since = 0;
        }
    }
    if (rc)
        goto done;
    double wall = now_s() - wall0;
    for (int r = 0; r < o->nstudents; r++)
        keep_info(tr, &st[r]);
    {
        float *xs = malloc((size_t)(EVAL_BATCHES * Tall * H) * sizeof *xs);
        float *ys = malloc((size_t)(EVAL_BATCHES * Tall * H) * sizeof *ys);
        tr_rng held;
        tr_rng_seed(&held, o->seed ^ 0x686f6c646f757421u);
        rc = !xs || !ys;
        if (rc)
            fprintf(stderr, "%s: out of host memory\n", prog);
        for (int b = 0; b < EVAL_BATCHES && !rc; b++) {
            tr_fill_normal(&held, xs + b * Tall * H, Tall * H, 1.0);
            if (tr_teacher_forward(&teacher, xs + b * Tall * H, Tall, ys + b * Tall * H)) {
                fprintf(stderr, "%s: out of host memory\n", prog);
                rc = 1;
            }
        }
        for (int r = 0; r < o->nstudents && !rc; r++)
            rc = evaluate(tr, &st[r], xs, ys, &st[r].eval_loss);
        const int bi = bf16_student(st, o->nstudents);
        for (int r = 0; r < o->nstudents && !rc; r++)
            rc = evaluate_apart(tr, &st[r], bi >= 0 ? &st[bi] : NULL, xs, ys);
        free(xs), free(ys);
    }
    if (rc || !lead)
        goto done;
    print_table(tr, st);
    for (int r = 0; r < o->nstudents; r++)
        check_casts(tr, &st[r]);
    printf("\n%lld steps x %d students in %.1f s (tokens/s: each recipe's own time, teacher excluded)\n",
           (long long)o->steps, o->nstudents, wall);
    rc = write_outputs(o, st);

done:
    for (int r = 0; r < o->nstudents; r++) {
        for (int64_t l = 0; st[r].blocks && l < L; l++)
            block_destroy(tr, &st[r].blocks[l]);
        free(st[r].blocks), free(st[r].loss);
    }
    for (int64_t l = 0; init && l < L; l++)
        for (int p = 0; p < NPARAM; p++)
            free(init[l].p[p]);
    free(init);
    if (tr->dev_a)
        fm_context_free(tr->ctx, tr->dev_a);
    if (tr->dev_b)
        fm_context_free(tr->ctx, tr->dev_b);
    free(x), free(y), free(tr->out), free(tr->dcur), free(tr->dn), free(tr->dxn);
    tr_teacher_destroy(&teacher);
    return rc;
}

typedef struct {
    trainer tr;
    student st[FM_RECIPE_COUNT + 1];
    int rc;
} rank_job;

static void *rank_main(void *arg)
{
    rank_job *j = arg;
    j->rc = run(&j->tr, j->st);
    if (j->rc)
        ep_break(&j->tr);
    return NULL;
}

int main(int argc, char **argv)
{
    options o;
    int rc = parse_args(argc, argv, &o);
    if (rc >= 0)
        return rc;
    const int n = (int)o.ep;
    /* --threads is the whole run's; each rank gets its share (at least one). */
    long cores = o.threads > 0 ? (long)o.threads : sysconf(_SC_NPROCESSORS_ONLN);
    int per_rank = n == 1 ? (int)o.threads : (int)(cores / n > 0 ? cores / n : 1);
    rank_job *jobs = calloc((size_t)n, sizeof *jobs);
    fm_comm *comms[64] = {0};
    ep_group grp = {.n = n};
    if (!jobs) {
        fprintf(stderr, "%s: out of host memory\n", prog);
        return 1;
    }
    if (n > 1) {
        pthread_mutex_init(&grp.mu, NULL);
        pthread_cond_init(&grp.cv, NULL);
        if (fm_comm_create_inproc(n, comms) != FM_OK) {
            fprintf(stderr, "%s: %s\n", prog, fm_last_error(NULL));
            free(jobs);
            return 1;
        }
    }
    int made = 0;
    rc = 0;
    for (int r = 0; r < n && !rc; r++, made++) {
        fm_context *ctx;
        fm_context_config cc = {.backend = o.backend, .cpu_threads = per_rank};
        if (fm_context_create(&cc, &ctx) != FM_OK) {
            fprintf(stderr, "%s: %s\n", prog, fm_last_error(NULL));
            rc = 1;
            break;
        }
        /* rank r: tokens [t0, t0 + T), the first T % n ranks one more */
        int64_t base = o.tokens / n, extra = o.tokens % n;
        trainer *tr = &jobs[r].tr;
        *tr = (trainer){.o = &o, .ctx = ctx, .dev = fm_context_device(ctx), .T = base + (r < extra),
                        .Tall = o.tokens, .t0 = r * base + (r < extra ? r : extra), .Tmax = base + (extra > 0),
                        .H = o.hidden, .I = o.ffn, .E = o.experts, .rank = r, .nranks = n, .comm = comms[r],
                        .grp = n > 1 ? &grp : NULL,
                        .opt = {.lr = o.lr, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = o.wd}};
        tr->count[P_GAIN] = tr->lcount[P_GAIN] = o.hidden;
        tr->count[P_ROUTER] = tr->lcount[P_ROUTER] = o.experts * o.hidden;
        tr->count[P_W1] = o.experts * 2 * o.ffn * o.hidden;
        tr->count[P_W2] = o.experts * o.hidden * o.ffn;
        tr->lcount[P_W1] = tr->count[P_W1] / n, tr->loff[P_W1] = r * tr->lcount[P_W1];
        tr->lcount[P_W2] = tr->count[P_W2] / n, tr->loff[P_W2] = r * tr->lcount[P_W2];
        grp.tr[r] = tr;
    }
    if (!rc) {
        if (n == 1) {
            rank_main(&jobs[0]);
        } else {
            pthread_t th[64];
            for (int r = 0; r < n; r++)
                if (pthread_create(&th[r], NULL, rank_main, &jobs[r])) {
                    fprintf(stderr, "%s: cannot start rank %d's thread\n", prog, r);
                    exit(1); /* the started ranks wait for it in their collectives */
                }
            for (int r = 0; r < n; r++)
                pthread_join(th[r], NULL);
        }
        for (int r = 0; r < n; r++)
            rc = jobs[r].rc > rc ? jobs[r].rc : rc;
    }
    for (int r = 0; r < made; r++)
        fm_context_destroy(jobs[r].tr.ctx);
    for (int r = 0; r < n; r++)
        fm_comm_destroy(comms[r]);
    if (n > 1) {
        pthread_mutex_destroy(&grp.mu);
        pthread_cond_destroy(&grp.cv);
    }
    free(jobs);
    return rc;
}
