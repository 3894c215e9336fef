/* fm-train's host-side math: the RNG, RMSNorm forward and backward, AdamW
 * and the teacher model. None of it calls the library, so the targets the
 * students regress do not depend on the code under test, and a test can
 * check each piece against finite differences and closed forms. */
#ifndef FM_TRAIN_HOST_H
#define FM_TRAIN_HOST_H

#include <stdint.h>

/* ---- RNG: xoshiro256** seeded by splitmix64, the same stream everywhere -- */

typedef struct {
    uint64_t s[4];
} tr_rng;

void tr_rng_seed(tr_rng *r, uint64_t seed);
uint64_t tr_rng_next(tr_rng *r);
double tr_uniform(tr_rng *r); /* [0, 1) */
double tr_normal(tr_rng *r);  /* N(0, 1) */
void tr_fill_normal(tr_rng *r, float *x, int64_t n, double std);

/* ---- RMSNorm with a learned gain ----------------------------------------- */

#define TR_RMSNORM_EPS 1e-6

/* y[t, :] = x[t, :] * g / rms(x[t, :]), rms = sqrt(mean(x²) + eps); rstd[t]
 * = 1 / rms is what backward needs. Sums in double. */
void tr_rmsnorm_forward(const float *x, const float *g, int64_t T, int64_t H, float *y, float *rstd);
/* dx (written) and dg (ACCUMULATED into) from dy, for the forward above. */
void tr_rmsnorm_backward(const float *x, const float *g, const float *rstd, const float *dy, int64_t T,
                         int64_t H, float *dx, float *dg);

/* ---- AdamW ----------------------------------------------------------------- */

typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
} tr_adamw;

/* One step t (1-based) of AdamW with bias correction and decoupled weight
 * decay (p -= lr·wd·p, as PyTorch's AdamW does), on n parameters; m and v
 * start at zero. decay = 0 skips the weight decay (norm gains). */
void tr_adamw_step(const tr_adamw *opt, int64_t t, float *p, const float *grad, float *m, float *v, int64_t n,
                   int decay);

/* ---- the MoE of flowmoe/layer.h, in double ------------------------------- */

typedef struct {
    int64_t hidden, ffn, experts;
    int topk;
    int renormalize; /* softmax scores over E, top-k, renormalised over the k when set */
} tr_moe_shape;

/* One MoE layer's F32 weights, laid out as fm_moe_weights: router [E, H],
 * w1 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]. */
typedef struct {
    const float *router, *w1, *w2;
} tr_moe_params;

/* y [T, H] = Σ_j p_tj · W2_e · (silu(gate) · up) for the k experts of
 * highest softmax score (ties: lower id first), computed in double.
 * 0 on success, -1 when out of memory. */
int tr_moe_forward(const tr_moe_shape *s, const tr_moe_params *w, const double *x, int64_t T, double *y);

/* The teacher: L blocks x = x + MoE(RMSNorm(x)) with fixed random weights. */
typedef struct {
    tr_moe_shape shape;
    int layers;
    float *gain;   /* [L, H] */
    float *router; /* [L, E, H] */
    float *w1;     /* [L, E, 2I, H] */
    float *w2;     /* [L, E, H, I] */
} tr_teacher;

/* Random weights for the teacher and the students' initialisation:
 * unit-variance expert pre-activations for a unit-RMS input, router logits
 * of standard deviation `router_std`, W2 scaled so that an expert's output
 * has about out_std² · E[(silu(g)·u)²] variance. */
void tr_init_moe(tr_rng *r, const tr_moe_shape *s, double router_std, double out_std, float *router, float *w1,
                 float *w2);

/* rank in [1, H): the router and W1 read x through one random rank-`rank`
 * projection per layer; otherwise (0 or >= H) full-rank random weights.
 * 0 on success, -1 when out of memory. */
int tr_teacher_create(tr_teacher *t, const tr_moe_shape *s, int layers, int64_t rank, uint64_t seed);
void tr_teacher_destroy(tr_teacher *t);
/* y [T, H] = teacher(x [T, H]); 0 on success, -1 when out of memory. */
int tr_teacher_forward(const tr_teacher *t, const float *x, int64_t T, float *y);

#endif
