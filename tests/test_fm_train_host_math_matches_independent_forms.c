/* fm-train's host math (tools/train_host.c) against independent forms:
 * RMSNorm backward against central finite differences of a double-precision
 * forward written here; AdamW against its closed forms (first step, constant
 * gradient, pure weight decay); the MoE and the teacher against a dense
 * reference that scores every expert and picks the top k by sorting. */
#include <math.h>

#include "test_util.h"
#include "train_host.h"

/* ---- RMSNorm ------------------------------------------------------------- */

/* loss = Σ c · g · x / sqrt(mean(x²) + eps) over one row, in double. */
static double rms_row_loss(const double *x, const double *g, const double *c, int64_t H)
{
    double ss = 0, l = 0;
    for (int64_t i = 0; i < H; i++)
        ss += x[i] * x[i];
    double r = 1.0 / sqrt(ss / (double)H + TR_RMSNORM_EPS);
    for (int64_t i = 0; i < H; i++)
        l += c[i] * g[i] * x[i] * r;
    return l;
}

static void test_rmsnorm(int64_t T, int64_t H, double xscale)
{
    float *x = malloc((size_t)(T * H) * 4), *g = malloc((size_t)H * 4), *dy = malloc((size_t)(T * H) * 4);
    float *y = malloc((size_t)(T * H) * 4), *rstd = malloc((size_t)T * 4), *dx = malloc((size_t)(T * H) * 4);
    float *dg = malloc((size_t)H * 4);
    double *xd = malloc((size_t)H * 8), *gd = malloc((size_t)H * 8), *cd = malloc((size_t)H * 8);
    for (int64_t i = 0; i < T * H; i++) {
        x[i] = (float)(xscale * tu_normal());
        dy[i] = (float)tu_normal();
        y[i] = dx[i] = NAN; /* poison */
    }
    for (int64_t i = 0; i < H; i++) {
        g[i] = (float)(1.0 + 0.3 * tu_normal());
        dg[i] = 0.5f; /* dg accumulates: the 0.5 must survive */
    }
    tr_rmsnorm_forward(x, g, T, H, y, rstd);
    tr_rmsnorm_backward(x, g, rstd, dy, T, H, dx, dg);
    double *dg_ref = calloc((size_t)H, 8);
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < H; i++)
            xd[i] = x[t * H + i], gd[i] = g[i], cd[i] = dy[t * H + i];
        double ss = 0;
        for (int64_t i = 0; i < H; i++)
            ss += xd[i] * xd[i];
        double r = 1.0 / sqrt(ss / (double)H + TR_RMSNORM_EPS);
        for (int64_t i = 0; i < H; i++) {
            double want = xd[i] * r * gd[i];
            CHECK(fabs(y[t * H + i] - want) <= 1e-6 * fabs(want) + 1e-30, "rmsnorm y[%lld,%lld] %g vs %g",
                  (long long)t, (long long)i, y[t * H + i], want);
            dg_ref[i] += cd[i] * xd[i] * r;
        }
        for (int64_t i = 0; i < H; i++) {
            double h = 1e-6 * (fabs(xd[i]) + xscale), keep = xd[i];
            xd[i] = keep + h;
            double lp = rms_row_loss(xd, gd, cd, H);
            xd[i] = keep - h;
            double lm = rms_row_loss(xd, gd, cd, H);
            xd[i] = keep;
            double fd = (lp - lm) / (2 * h), scale = r * (fabs(cd[i]) * fabs(gd[i]) + 1);
            CHECK(fabs(dx[t * H + i] - fd) <= 1e-4 * scale, "rmsnorm dx[%lld,%lld] %g vs finite difference %g (H=%lld)",
                  (long long)t, (long long)i, dx[t * H + i], fd, (long long)H);
        }
    }
    for (int64_t i = 0; i < H; i++)
        CHECK(fabs(dg[i] - (0.5 + dg_ref[i])) <= 1e-5 * (1 + fabs(dg_ref[i])) * sqrt((double)T),
              "rmsnorm dg[%lld] %g vs 0.5 + %g", (long long)i, dg[i], dg_ref[i]);
    free(x), free(g), free(dy), free(y), free(rstd), free(dx), free(dg), free(xd), free(gd), free(cd), free(dg_ref);
}

/* ---- AdamW --------------------------------------------------------------- */

static void test_adamw(void)
{
    enum { N = 64 };
    float p[N], p0[N], g[N], m[N], v[N];
    tr_adamw opt = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};

    /* a constant gradient: the bias-corrected moments are exactly g and g², so
     * every step moves by lr·g/(|g| + eps) (plus the decay, off here) */
    for (int i = 0; i < N; i++) {
        p[i] = p0[i] = (float)tu_normal();
        g[i] = (float)(tu_normal() * pow(10, tu_randint(-6, 2)));
        m[i] = v[i] = 0;
    }
    g[0] = 0; /* no gradient, no decay: stays put */
    for (int t = 1; t <= 25; t++)
        tr_adamw_step(&opt, t, p, g, m, v, N, 0);
    for (int i = 0; i < N; i++) {
        double want = p0[i] - 25 * opt.lr * g[i] / (fabs(g[i]) + opt.eps);
        CHECK(fabs(p[i] - want) <= 1e-5 * (1 + fabs(want)), "adamw constant gradient p[%d] %.9g vs %.9g (g %g)", i,
              p[i], want, g[i]);
    }
    /* pure decoupled weight decay: p·(1 − lr·wd)^t */
    for (int i = 0; i < N; i++)
        p[i] = p0[i], g[i] = 0, m[i] = v[i] = 0;
    for (int t = 1; t <= 10; t++)
        tr_adamw_step(&opt, t, p, g, m, v, N, 1);
    for (int i = 0; i < N; i++) {
        double want = p0[i] * pow(1 - opt.lr * opt.weight_decay, 10);
        CHECK(fabs(p[i] - want) <= 1e-6 * (1 + fabs(want)), "adamw decay p[%d] %.9g vs %.9g", i, p[i], want);
    }
    /* two different gradients: step 2 by hand, with bias correction */
    for (int i = 0; i < N; i++)
        p[i] = p0[i], m[i] = v[i] = 0, g[i] = (float)tu_normal();
    float g2[N];
    for (int i = 0; i < N; i++)
        g2[i] = (float)tu_normal();
    tr_adamw_step(&opt, 1, p, g, m, v, N, 1);
    tr_adamw_step(&opt, 2, p, g2, m, v, N, 1);
    for (int i = 0; i < N; i++) {
        double q = p0[i] * (1 - opt.lr * opt.weight_decay) - opt.lr * g[i] / (fabs(g[i]) + opt.eps);
        double m2 = 0.9 * 0.1 * g[i] + 0.1 * g2[i], v2 = 0.95 * 0.05 * g[i] * g[i] + 0.05 * g2[i] * g2[i];
        double want = q * (1 - opt.lr * opt.weight_decay) - opt.lr * (m2 / 0.19) / (sqrt(v2 / 0.0975) + opt.eps);
        CHECK(fabs(p[i] - want) <= 1e-6 * (1 + fabs(want)), "adamw step 2 p[%d] %.9g vs %.9g", i, p[i], want);
    }
}

/* ---- the MoE and the teacher --------------------------------------------- */

static const double *sort_scores;
static int by_score_then_id(const void *a, const void *b)
{
    int64_t i = *(const int64_t *)a, j = *(const int64_t *)b;
    if (sort_scores[i] != sort_scores[j])
        return sort_scores[i] > sort_scores[j] ? -1 : 1;
    return i < j ? -1 : 1;
}

/* Every expert's output for one token, the full softmax, sorted selection. */
static void dense_moe_token(const tr_moe_shape *s, const tr_moe_params *w, const double *x, double *y)
{
    int64_t H = s->hidden, I = s->ffn, E = s->experts;
    double *logit = malloc((size_t)E * 8), *out = malloc((size_t)(E * H) * 8);
    int64_t *order = malloc((size_t)E * 8);
    double den = 0;
    for (int64_t e = 0; e < E; e++) {
        logit[e] = 0;
        for (int64_t i = 0; i < H; i++)
            logit[e] += w->router[e * H + i] * x[i];
    }
    for (int64_t e = 0; e < E; e++)
        den += exp(logit[e]); /* the logits here are small: no max shift needed */
    for (int64_t e = 0; e < E; e++) {
        logit[e] = exp(logit[e]) / den;
        order[e] = e;
        for (int64_t o = 0; o < H; o++) {
            double acc = 0;
            for (int64_t f = 0; f < I; f++) {
                double a = 0, b = 0;
                for (int64_t i = 0; i < H; i++) {
                    a += w->w1[(e * 2 * I + f) * H + i] * x[i];
                    b += w->w1[(e * 2 * I + I + f) * H + i] * x[i];
                }
                acc += w->w2[(e * H + o) * I + f] * (a / (1 + exp(-a))) * b;
            }
            out[e * H + o] = acc;
        }
    }
    sort_scores = logit;
    qsort(order, (size_t)E, sizeof *order, by_score_then_id);
    double psum = 0;
    for (int j = 0; j < s->topk; j++)
        psum += logit[order[j]];
    for (int64_t o = 0; o < H; o++) {
        y[o] = 0;
        for (int j = 0; j < s->topk; j++)
            y[o] += (s->renormalize ? logit[order[j]] / psum : logit[order[j]]) * out[order[j] * H + o];
    }
    free(logit), free(out), free(order);
}

/* ties: experts 1 and E-1 get expert 0's router row, so their scores tie
 * exactly and the lower id must win. */
static void test_moe(int64_t T, int64_t H, int64_t I, int64_t E, int k, int renorm, int ties)
{
    tr_moe_shape s = {.hidden = H, .ffn = I, .experts = E, .topk = k, .renormalize = renorm};
    float *r = malloc((size_t)(E * H) * 4), *w1 = malloc((size_t)(E * 2 * I * H) * 4);
    float *w2 = malloc((size_t)(E * H * I) * 4);
    double *x = malloc((size_t)(T * H) * 8), *y = malloc((size_t)(T * H) * 8), *want = malloc((size_t)H * 8);
    tr_rng rng;
    tr_rng_seed(&rng, tu_rand());
    tr_init_moe(&rng, &s, 2.0, 1.0, r, w1, w2);
    if (ties && E >= 3) {
        memcpy(r + H, r, (size_t)H * 4);
        memcpy(r + (E - 1) * H, r, (size_t)H * 4);
    }
    for (int64_t i = 0; i < T * H; i++)
        x[i] = tu_normal(), y[i] = NAN;
    tr_moe_params w = {r, w1, w2};
    CHECK(tr_moe_forward(&s, &w, x, T, y) == 0, "tr_moe_forward failed");
    for (int64_t t = 0; t < T; t++) {
        dense_moe_token(&s, &w, x + t * H, want);
        for (int64_t o = 0; o < H; o++)
            CHECK(fabs(y[t * H + o] - want[o]) <= 1e-10 * (1 + fabs(want[o])),
                  "moe y[%lld,%lld] %.15g vs dense %.15g (T=%lld H=%lld I=%lld E=%lld k=%d renorm=%d)",
                  (long long)t, (long long)o, y[t * H + o], want[o], (long long)T, (long long)H, (long long)I,
                  (long long)E, k, renorm);
    }
    free(r), free(w1), free(w2), free(x), free(y), free(want);
}

/* Numerical rank of a [rows, cols] matrix by Gaussian elimination with
 * complete pivoting, in double: each step takes the largest remaining
 * element, so the steps stop where what is left is rounding (the F32 inputs'
 * 2^-24) and not a small pivot a column order happened to give (partial
 * pivoting called a rank-3 matrix rank 4 for 1 seed in a few hundred). */
static int64_t matrix_rank(const float *m, int64_t rows, int64_t cols)
{
    double *a = malloc((size_t)(rows * cols) * 8), big = 0;
    for (int64_t i = 0; i < rows * cols; i++)
        a[i] = m[i], big = fabs(a[i]) > big ? fabs(a[i]) : big;
    int64_t rank = 0;
    while (rank < rows && rank < cols) {
        int64_t pr = rank, pc = rank;
        for (int64_t r = rank; r < rows; r++)
            for (int64_t c = rank; c < cols; c++)
                if (fabs(a[r * cols + c]) > fabs(a[pr * cols + pc]))
                    pr = r, pc = c;
        if (fabs(a[pr * cols + pc]) <= 1e-5 * big)
            break;
        for (int64_t j = 0; j < cols; j++) { /* the pivot's row and column to position rank */
            double t = a[pr * cols + j];
            a[pr * cols + j] = a[rank * cols + j], a[rank * cols + j] = t;
        }
        for (int64_t r = 0; r < rows; r++) {
            double t = a[r * cols + pc];
            a[r * cols + pc] = a[r * cols + rank], a[r * cols + rank] = t;
        }
        for (int64_t r = rank + 1; r < rows; r++) {
            double f = a[r * cols + rank] / a[rank * cols + rank];
            for (int64_t j = rank; j < cols; j++)
                a[r * cols + j] -= f * a[rank * cols + j];
        }
        rank++;
    }
    free(a);
    return rank;
}

static void test_teacher(int64_t rank)
{
    tr_moe_shape s = {.hidden = 12, .ffn = 6, .experts = 5, .topk = 2, .renormalize = 1};
    int L = 3;
    int64_t T = 9, H = s.hidden, I = s.ffn, E = s.experts;
    uint64_t seed = tu_rand();
    tr_teacher a, b, c;
    CHECK(tr_teacher_create(&a, &s, L, rank, seed) == 0 && tr_teacher_create(&b, &s, L, rank, seed) == 0 &&
              tr_teacher_create(&c, &s, L, rank, seed + 1) == 0,
          "teacher creation failed");
    for (int l = 0; l < L; l++) { /* the router and W1 rows together span `rank` dimensions of x */
        float *rows = malloc((size_t)((E + E * 2 * I) * H) * 4);
        memcpy(rows, a.router + l * E * H, (size_t)(E * H) * 4);
        memcpy(rows + E * H, a.w1 + l * E * 2 * I * H, (size_t)(E * 2 * I * H) * 4);
        int64_t want = rank >= 1 && rank < H ? rank : H, got = matrix_rank(rows, E + E * 2 * I, H);
        CHECK(got == want, "teacher layer %d: router and W1 have rank %lld, want %lld", l, (long long)got, (long long)want);
        free(rows);
    }
    CHECK(!memcmp(a.w1, b.w1, (size_t)(L * E * 2 * I * H) * 4) && !memcmp(a.gain, b.gain, (size_t)(L * H) * 4),
          "the same seed must give the same teacher");
    CHECK(memcmp(a.w1, c.w1, (size_t)(L * E * 2 * I * H) * 4), "another seed must give another teacher");
    float *x = malloc((size_t)(T * H) * 4), *y = malloc((size_t)(T * H) * 4);
    for (int64_t i = 0; i < T * H; i++)
        x[i] = (float)tu_normal(), y[i] = NAN;
    CHECK(tr_teacher_forward(&a, x, T, y) == 0, "teacher forward failed");
    double *h = malloc((size_t)H * 8), *n = malloc((size_t)H * 8), *o = malloc((size_t)H * 8);
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < H; i++)
            h[i] = x[t * H + i];
        for (int l = 0; l < L; l++) {
            double ss = 0;
            for (int64_t i = 0; i < H; i++)
                ss += h[i] * h[i];
            for (int64_t i = 0; i < H; i++)
                n[i] = h[i] / sqrt(ss / (double)H + TR_RMSNORM_EPS) * a.gain[l * H + i];
            tr_moe_params w = {a.router + l * E * H, a.w1 + l * E * 2 * I * H, a.w2 + l * E * H * I};
            dense_moe_token(&s, &w, n, o);
            for (int64_t i = 0; i < H; i++)
                h[i] += o[i];
        }
        for (int64_t i = 0; i < H; i++)
            CHECK(fabs(y[t * H + i] - h[i]) <= 1e-6 * (1 + fabs(h[i])), "teacher y[%lld,%lld] %g vs %g", (long long)t,
                  (long long)i, y[t * H + i], h[i]);
    }
    tr_teacher_destroy(&a), tr_teacher_destroy(&b), tr_teacher_destroy(&c);
    free(x), free(y), free(h), free(n), free(o);
}

int main(void)
{
    tu_begin("test_fm_train_host_math_matches_independent_forms");
    test_rmsnorm(7, 33, 1.0);
    test_rmsnorm(1, 1, 3.0);
    test_rmsnorm(3, 128, 1e-3); /* small inputs: eps matters */
    test_rmsnorm(2, 64, 1e3);
    test_adamw();
    test_moe(6, 10, 7, 6, 1, 1, 0);
    test_moe(6, 10, 7, 6, 2, 1, 0);
    test_moe(6, 10, 7, 6, 2, 0, 0);
    test_moe(4, 9, 3, 6, 6, 1, 0); /* k = E: the whole softmax mixture */
    test_moe(1, 1, 1, 1, 1, 0, 0); /* one token, one expert, no renormalisation */
    test_moe(16, 8, 4, 5, 1, 1, 1);
    test_moe(16, 8, 4, 5, 2, 0, 1);
    test_teacher(0);
    test_teacher(3);
    return tu_end();
}
