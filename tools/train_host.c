/* fm-train's host-side math (see train_host.h). */
#include "train_host.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- RNG ----------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15u);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
    return z ^ (z >> 31);
}

void tr_rng_seed(tr_rng *r, uint64_t seed)
{
    for (int k = 0; k < 4; k++)
        r->s[k] = splitmix64(&seed);
}

uint64_t tr_rng_next(tr_rng *r)
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

double tr_uniform(tr_rng *r) { return (double)(tr_rng_next(r) >> 11) * 0x1p-53; }

/* Box-Muller, one value per call: a stream that does not depend on how many
 * values a caller draws at once. */
double tr_normal(tr_rng *r)
{
    double u1 = 1.0 - tr_uniform(r), u2 = tr_uniform(r); /* u1 in (0, 1] */
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

void tr_fill_normal(tr_rng *r, float *x, int64_t n, double std)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(std * tr_normal(r));
}

/* ---- RMSNorm ------------------------------------------------------------- */

void tr_rmsnorm_forward(const float *x, const float *g, int64_t T, int64_t H, float *y, float *rstd)
{
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * H;
        double ss = 0;
        for (int64_t i = 0; i < H; i++)
            ss += (double)xt[i] * xt[i];
        double rs = 1.0 / sqrt(ss / (double)H + TR_RMSNORM_EPS);
        rstd[t] = (float)rs;
        for (int64_t i = 0; i < H; i++)
            y[t * H + i] = (float)((double)xt[i] * rs * g[i]);
    }
}

/* With n = x·r, r = (mean(x²) + eps)^(-1/2) and y = g·n:
 *   dx_i = r·g_i·dy_i − x_i·r³/H · Σ_j g_j·dy_j·x_j,   dg_i = Σ_t dy_ti·n_ti. */
void tr_rmsnorm_backward(const float *x, const float *g, const float *rstd, const float *dy, int64_t T,
                         int64_t H, float *dx, float *dg)
{
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * H, *dyt = dy + t * H;
        double r = rstd[t], dot = 0;
        for (int64_t i = 0; i < H; i++) {
            dot += (double)g[i] * dyt[i] * xt[i];
            dg[i] += (float)((double)dyt[i] * xt[i] * r);
        }
        double c = dot * r * r * r / (double)H;
        for (int64_t i = 0; i < H; i++)
            dx[t * H + i] = (float)(r * g[i] * dyt[i] - xt[i] * c);
    }
}

/* ---- AdamW --------------------------------------------------------------- */

void tr_adamw_step(const tr_adamw *opt, int64_t t, float *p, const float *grad, float *m, float *v, int64_t n,
                   int decay)
{
    double b1 = opt->beta1, b2 = opt->beta2;
    double c1 = 1.0 - pow(b1, (double)t), c2 = 1.0 - pow(b2, (double)t);
    double shrink = decay ? 1.0 - opt->lr * opt->weight_decay : 1.0;
    for (int64_t i = 0; i < n; i++) {
        double gi = grad[i];
        double mi = b1 * m[i] + (1.0 - b1) * gi, vi = b2 * v[i] + (1.0 - b2) * gi * gi;
        m[i] = (float)mi;
        v[i] = (float)vi;
        p[i] = (float)((double)p[i] * shrink - opt->lr * (mi / c1) / (sqrt(vi / c2) + opt->eps));
    }
}

/* ---- the MoE in double --------------------------------------------------- */

int tr_moe_forward(const tr_moe_shape *s, const tr_moe_params *w, const double *x, int64_t T, double *y)
{
    int64_t H = s->hidden, I = s->ffn, E = s->experts;
    int k = s->topk;
    double *score = malloc((size_t)E * sizeof *score), *act = malloc((size_t)I * sizeof *act);
    double *p = malloc((size_t)k * sizeof *p);
    int64_t *chosen = malloc((size_t)k * sizeof *chosen);
    char *taken = malloc((size_t)E);
    if (!score || !act || !p || !chosen || !taken) {
        free(score), free(act), free(p), free(chosen), free(taken);
        return -1;
    }
    for (int64_t t = 0; t < T; t++) {
        const double *xt = x + t * H;
        double *yt = y + t * H, mx = -INFINITY, sum = 0;
        for (int64_t e = 0; e < E; e++) {
            double l = 0;
            for (int64_t i = 0; i < H; i++)
                l += (double)w->router[e * H + i] * xt[i];
            score[e] = l;
            mx = l > mx ? l : mx;
        }
        for (int64_t e = 0; e < E; e++)
            sum += (score[e] = exp(score[e] - mx));
        for (int64_t e = 0; e < E; e++)
            score[e] /= sum;
        memset(taken, 0, (size_t)E);
        double psum = 0;
        for (int j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || score[e] > score[best]))
                    best = e;
            taken[best] = 1;
            chosen[j] = best;
            psum += (p[j] = score[best]);
        }
        for (int64_t i = 0; i < H; i++)
            yt[i] = 0;
        for (int j = 0; j < k; j++) {
            int64_t e = chosen[j];
            double pj = s->renormalize ? p[j] / psum : p[j];
            const float *w1 = w->w1 + e * 2 * I * H, *w2 = w->w2 + e * H * I;
            for (int64_t f = 0; f < I; f++) {
                double gate = 0, up = 0;
                for (int64_t i = 0; i < H; i++) {
                    gate += (double)w1[f * H + i] * xt[i];
                    up += (double)w1[(I + f) * H + i] * xt[i];
                }
                act[f] = gate / (1.0 + exp(-gate)) * up;
            }
            for (int64_t i = 0; i < H; i++) {
                double o = 0;
                for (int64_t f = 0; f < I; f++)
                    o += (double)w2[i * I + f] * act[f];
                yt[i] += pj * o;
            }
        }
    }
    free(score), free(act), free(p), free(chosen), free(taken);
    return 0;
}

void tr_init_moe(tr_rng *r, const tr_moe_shape *s, double router_std, double out_std, float *router, float *w1,
                 float *w2)
{
    int64_t H = s->hidden, I = s->ffn, E = s->experts;
    tr_fill_normal(r, router, E * H, router_std / sqrt((double)H));
    tr_fill_normal(r, w1, E * 2 * I * H, 1.0 / sqrt((double)H));
    tr_fill_normal(r, w2, E * H * I, out_std / sqrt((double)I));
}

int tr_teacher_create(tr_teacher *t, const tr_moe_shape *s, int layers, int64_t rank, uint64_t seed)
{
    int64_t H = s->hidden, I = s->ffn, E = s->experts;
    *t = (tr_teacher){.shape = *s, .layers = layers};
    rank = rank < 1 || rank > H ? H : rank;
    t->gain = malloc((size_t)(layers * H) * sizeof(float));
    t->router = malloc((size_t)(layers * E * H) * sizeof(float));
    t->w1 = malloc((size_t)(layers * E * 2 * I * H) * sizeof(float));
    t->w2 = malloc((size_t)(layers * E * H * I) * sizeof(float));
    float *proj = malloc((size_t)(rank * H) * sizeof(float));
    float *coef = malloc((size_t)((E + E * 2 * I) * rank) * sizeof(float));
    if (!t->gain || !t->router || !t->w1 || !t->w2 || !proj || !coef) {
        free(proj), free(coef);
        tr_teacher_destroy(t);
        return -1;
    }
    tr_rng r;
    tr_rng_seed(&r, seed);
    for (int l = 0; l < layers; l++) {
        /* Gains away from 1 and decisive routing (logits of standard
         * deviation 2) give the students something to learn in every part. */
        for (int64_t i = 0; i < H; i++)
            t->gain[l * H + i] = (float)(1.0 + 0.2 * tr_normal(&r));
        float *router = t->router + l * E * H, *w1 = t->w1 + l * E * 2 * I * H;
        tr_init_moe(&r, s, 2.0, 1.0, router, w1, t->w2 + l * E * H * I);
        if (rank == H)
            continue;
        /* Router and W1 read x through one random rank-r projection P [r, H]:
         * rows = C · P with C [rows, r], scaled like the full-rank weights. */
        tr_fill_normal(&r, proj, rank * H, 1.0 / sqrt((double)H));
        tr_fill_normal(&r, coef, E * rank, 2.0 / sqrt((double)rank));
        tr_fill_normal(&r, coef + E * rank, E * 2 * I * rank, 1.0 / sqrt((double)rank));
        for (int64_t row = 0; row < E + E * 2 * I; row++) {
            float *dst = row < E ? router + row * H : w1 + (row - E) * H;
            for (int64_t i = 0; i < H; i++) {
                double acc = 0;
                for (int64_t q = 0; q < rank; q++)
                    acc += (double)coef[row * rank + q] * proj[q * H + i];
                dst[i] = (float)acc;
            }
        }
    }
    free(proj), free(coef);
    return 0;
}

void tr_teacher_destroy(tr_teacher *t)
{
    free(t->gain), free(t->router), free(t->w1), free(t->w2);
    *t = (tr_teacher){0};
}

int tr_teacher_forward(const tr_teacher *t, const float *x, int64_t T, float *y)
{
    int64_t H = t->shape.hidden, E = t->shape.experts, I = t->shape.ffn;
    double *h = malloc((size_t)(T * H) * sizeof *h), *n = malloc((size_t)(T * H) * sizeof *n);
    double *o = malloc((size_t)(T * H) * sizeof *o);
    if (!h || !n || !o) {
        free(h), free(n), free(o);
        return -1;
    }
    for (int64_t i = 0; i < T * H; i++)
        h[i] = x[i];
    for (int l = 0; l < t->layers; l++) {
        const float *g = t->gain + l * H;
        for (int64_t r = 0; r < T; r++) {
            double ss = 0;
            for (int64_t i = 0; i < H; i++)
                ss += h[r * H + i] * h[r * H + i];
            double rs = 1.0 / sqrt(ss / (double)H + TR_RMSNORM_EPS);
            for (int64_t i = 0; i < H; i++)
                n[r * H + i] = h[r * H + i] * rs * g[i];
        }
        tr_moe_params w = {t->router + l * E * H, t->w1 + l * E * 2 * I * H, t->w2 + l * E * H * I};
        if (tr_moe_forward(&t->shape, &w, n, T, o)) {
            free(h), free(n), free(o);
            return -1;
        }
        for (int64_t i = 0; i < T * H; i++)
            h[i] += o[i];
    }
    for (int64_t i = 0; i < T * H; i++)
        y[i] = (float)h[i];
    free(h), free(n), free(o);
    return 0;
}
