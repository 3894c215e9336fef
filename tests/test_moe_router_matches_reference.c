/* fm_moe_router picks the k experts of largest s + bias (ties to the lower
 * id, NaN below every number) and returns s itself (renormalised over the k
 * when asked), s = softmax in mathfn's fixed order or sigmoid; a token with a
 * NaN logit gets NaN probabilities; tokens_per_expert counts the choices.
 * Judged against a reference written here (selection by sorting, not by the
 * library's scan), probabilities also against double-precision softmax and
 * sigmoid. fm_moe_router_backward is the gradient of the probabilities,
 * checked by central finite differences of a double model of the forward
 * (selection fixed). Sigmoid scores renormalised over chosen scores that all
 * round to 0 take the softmax of the chosen logits: tokens whose logits all
 * lie in [-400, -105] get finite probabilities that match the double model
 * and a backward that matches its differences. Invalid arguments are refused
 * with their names. */
#include <math.h>

#include "flowmoe/mathfn.h"
#include "test_util.h"

typedef struct {
    float key;
    int id;
} kv;

static int kv_cmp(const void *a, const void *b)
{
    const kv *x = a, *y = b;
    int xn = x->key != x->key, yn = y->key != y->key;
    if (xn != yn)
        return xn - yn; /* numbers first */
    if (!xn && x->key != y->key)
        return x->key > y->key ? -1 : 1;
    return x->id - y->id;
}

/* s of one token as the contract defines it. */
static void ref_scores(int sig, const float *x, int E, float *s)
{
    if (sig) {
        for (int e = 0; e < E; e++) { /* 1 / (1 + e^-x), through e^-|x| as mathfn.h defines it */
            float ex = fm_expf(-fabsf(x[e])), q = 1.0f / (1.0f + ex);
            s[e] = x[e] >= 0.0f ? q : ex * q;
        }
        return;
    }
    float m = x[0], ex[512];
    for (int e = 1; e < E; e++)
        if (x[e] > m)
            m = x[e];
    for (int e = 0; e < E; e++)
        ex[e] = fm_expf(x[e] - m);
    float sum = fm_sum_order_f32(ex, E);
    for (int e = 0; e < E; e++)
        s[e] = ex[e] / sum;
}

/* double model: probabilities of the fixed chosen ids */
static void model(int sig, int renorm, const double *x, int E, const int32_t *ids, int k, double *p)
{
    double s[512], m = x[0], sum = 0;
    for (int e = 1; e < E; e++)
        m = x[e] > m ? x[e] : m;
    for (int e = 0; e < E; e++) {
        s[e] = sig ? 1.0 / (1.0 + exp(-x[e])) : exp(x[e] - m);
        sum += s[e];
    }
    if (!sig)
        for (int e = 0; e < E; e++)
            s[e] /= sum;
    double S = 0;
    for (int j = 0; j < k; j++)
        S += s[ids[j]];
    for (int j = 0; j < k; j++)
        p[j] = renorm ? s[ids[j]] / S : s[ids[j]];
}

int main(void)
{
    tu_begin("test_moe_router_matches_reference");
    fm_context *ctx = tu_cpu_context(2);
    for (int it = 0; it < 160; it++) {
        int T = (int)tu_randint(1, 67), E = (int)tu_randint(1, 70);
        if (it % 7 == 0)
            E = (int)tu_randint(1, 8);
        int k = it % 5 == 0 ? 1 : it % 5 == 1 ? E : (int)tu_randint(1, E < 8 ? E : 8);
        int sig = it % 2, renorm = (it / 2) % 2, use_bias = (it / 4) % 2;
        float *x = malloc((size_t)T * E * 4), *bias = malloc((size_t)E * 4), *probs = malloc((size_t)T * k * 4);
        int32_t *ids = malloc((size_t)T * k * 4);
        int64_t *cnt = malloc((size_t)E * 8);
        for (int i = 0; i < T * E; i++)
            x[i] = (float)(tu_normal() * 3.0);
        for (int e = 0; e < E; e++)
            bias[e] = (float)(tu_normal() * 0.3);
        /* nasty tokens: exact ties, a NaN, -Inf, huge logits */
        if (T > 3) {
            for (int e = 0; e < E; e++)
                x[0 * E + e] = (float)(e % 3);
            x[1 * E + (int)tu_randint(0, E - 1)] = NAN;
            x[2 * E + (int)tu_randint(0, E - 1)] = -INFINITY;
            for (int e = 0; e < E; e++)
                x[3 * E + e] = (float)(tu_normal() * 1e4);
        }
        /* far below zero: every sigmoid rounds to 0 (renormalised: the softmax limit) */
        if (T > 4)
            for (int e = 0; e < E; e++)
                x[4 * E + e] = (float)(-105.0 - 295.0 * tu_uniform());
        memset(ids, 0xA5, (size_t)T * k * 4);
        memset(probs, 0xA5, (size_t)T * k * 4);
        fm_tensor tl = fm_tensor_2d(x, FM_DTYPE_F32, T, E), ti = fm_tensor_2d(ids, FM_DTYPE_I32, T, k);
        fm_tensor tp = fm_tensor_2d(probs, FM_DTYPE_F32, T, k), tc = fm_tensor_2d(cnt, FM_DTYPE_I64, 1, E);
        fm_router_config cfg = {k, sig ? FM_ROUTER_SIGMOID : FM_ROUTER_SOFTMAX, renorm, use_bias ? bias : NULL};
        if (k == 1 && it % 10 == 0)
            cfg.topk = 0; /* 0 means 1 */
        CHECK(fm_moe_router(ctx, &cfg, &tl, &ti, &tp, &tc) == FM_OK, "router: %s", fm_last_error(ctx));
        int64_t want_cnt[512] = {0};
        for (int t = 0; t < T; t++) {
            float s[512];
            kv kvs[512];
            const float *xt = x + t * E;
            ref_scores(sig, xt, E, s);
            int has_nan = 0;
            for (int e = 0; e < E; e++) {
                kvs[e].key = use_bias ? s[e] + bias[e] : s[e];
                kvs[e].id = e;
                has_nan |= xt[e] != xt[e];
            }
            qsort(kvs, (size_t)E, sizeof(kv), kv_cmp);
            float p[512], S = 0;
            for (int j = 0; j < k; j++)
                p[j] = s[kvs[j].id];
            S = fm_sum_order_f32(p, k);
            float lim[512]; /* sigmoid scores renormalised over zeros: the softmax of the chosen logits */
            if (sig && renorm && S == 0.0f) {
                float m = xt[kvs[0].id];
                for (int j = 1; j < k; j++)
                    m = xt[kvs[j].id] > m ? xt[kvs[j].id] : m;
                for (int j = 0; j < k; j++)
                    lim[j] = fm_expf(xt[kvs[j].id] - m);
                float L = fm_sum_order_f32(lim, k);
                for (int j = 0; j < k; j++)
                    lim[j] = lim[j] / L;
            }
            for (int j = 0; j < k; j++) {
                want_cnt[kvs[j].id]++;
                CHECK(ids[t * k + j] == kvs[j].id, "it %d T %d E %d k %d sig %d bias %d: token %d choice %d id %d want %d",
                      it, T, E, k, sig, use_bias, t, j, ids[t * k + j], kvs[j].id);
                float want = renorm ? (sig && S == 0.0f ? lim[j] : p[j] / S) : p[j];
                if (has_nan)
                    CHECK_EQ_U(tu_f32_bits(probs[t * k + j]), 0x7FC00000u, "NaN token %d: canonical NaN probs", t);
                else
                    CHECK_EQ_U(tu_f32_bits(probs[t * k + j]), tu_f32_bits(want != want ? NAN : want),
                               "it %d token %d choice %d prob", it, t, j);
            }
            /* probabilities are close to the true ones (finite tokens) */
            /* close to the true ones: a few ulps, plus what rounding x - max
             * to F32 costs exp (half an ulp of the difference, relative) */
            double span = 0;
            for (int e = 0; e < E; e++)
                span = fabs((double)xt[e]) > span ? fabs((double)xt[e]) : span;
            /* the softmax limit, on logits the double model holds (exp(-x) finite): exp(x - max)
             * rounds as softmax's does; chosen logits all -Inf stay 0 / 0, documented */
            const int limit = sig && renorm && S == 0.0f && span < 700;
            if (!has_nan && (span < 100 || limit)) {
                double xd[512], pd[512];
                for (int e = 0; e < E; e++)
                    xd[e] = xt[e];
                model(sig, renorm, xd, E, ids + t * k, k, pd);
                double tol = 5e-7 + (sig && !limit ? 0 : 2 * span * 6e-8);
                if (limit)
                    for (int j = 0; j < k; j++)
                        CHECK(isfinite(probs[t * k + j]), "token %d: sigmoid renormalised over zeros gave %a", t,
                              (double)probs[t * k + j]);
                for (int j = 0; j < k; j++)
                    CHECK(fabs(probs[t * k + j] - pd[j]) <= tol * fabs(pd[j]) + 1e-37, "token %d: prob %a vs double %a",
                          t, (double)probs[t * k + j], pd[j]);
            }
        }
        for (int e = 0; e < E; e++)
            CHECK(cnt[e] == want_cnt[e], "tokens_per_expert[%d] = %lld want %lld", e, (long long)cnt[e],
                  (long long)want_cnt[e]);

        /* bias moves the selection but not the probabilities */
        if (use_bias && !renorm) {
            int32_t *ids0 = malloc((size_t)T * k * 4);
            float *p0 = malloc((size_t)T * k * 4), s[512];
            fm_tensor ti0 = fm_tensor_2d(ids0, FM_DTYPE_I32, T, k), tp0 = fm_tensor_2d(p0, FM_DTYPE_F32, T, k);
            fm_router_config c0 = cfg;
            c0.bias = NULL;
            CHECK(fm_moe_router(ctx, &c0, &tl, &ti0, &tp0, NULL) == FM_OK, "router without bias");
            for (int t = 0; t < T; t++) {
                ref_scores(sig, x + t * E, E, s);
                for (int j = 0; j < k; j++)
                    if (probs[t * k + j] == probs[t * k + j])
                        CHECK(probs[t * k + j] == s[ids[t * k + j]], "bias leaks into the probability");
            }
            free(ids0);
            free(p0);
        }

        /* backward: central differences of the double model, finite tokens */
        float *dp = malloc((size_t)T * k * 4), *dl = malloc((size_t)T * E * 4);
        for (int i = 0; i < T * k; i++)
            dp[i] = (float)tu_normal();
        memset(dl, 0xA5, (size_t)T * E * 4);
        fm_tensor tdp = fm_tensor_2d(dp, FM_DTYPE_F32, T, k), tdl = fm_tensor_2d(dl, FM_DTYPE_F32, T, E);
        CHECK(fm_moe_router_backward(ctx, &cfg, &tl, &ti, &tdp, &tdl) == FM_OK, "backward: %s", fm_last_error(ctx));
        for (int t = 0; t < T; t++) {
            const float *xt = x + t * E;
            int has_nan = 0, big = 0;
            for (int e = 0; e < E; e++) {
                has_nan |= xt[e] != xt[e];
                big |= !(fabsf(xt[e]) < 100.0f);
            }
            if (has_nan) {
                for (int e = 0; e < E; e++)
                    CHECK_EQ_U(tu_f32_bits(dl[t * E + e]), 0x7FC00000u, "NaN token %d: NaN dlogits", t);
                continue;
            }
            /* chosen sigmoid scores all 0 under renormalisation: the softmax limit, whose
             * F32 exp(x - max) is good to about 2 span 6e-8 (as the forward's check) */
            float sc[512], cs[512];
            ref_scores(sig, xt, E, sc);
            for (int j = 0; j < k; j++)
                cs[j] = sc[ids[t * k + j]];
            const int limit = sig && renorm && fm_sum_order_f32(cs, k) == 0.0f;
            int finite = 1;
            for (int e = 0; e < E; e++)
                finite &= isfinite(xt[e]) && fabsf(xt[e]) < 700.0f;
            if (big && !(limit && finite))
                continue;
            const double ftol = limit ? 1e-4 : 1e-5;
            double xd[512], pp[512], pm[512];
            for (int e = 0; e < E; e++)
                xd[e] = xt[e];
            for (int e = 0; e < E; e++) {
                double h = 1e-6, keep = xd[e];
                xd[e] = keep + h;
                model(sig, renorm, xd, E, ids + t * k, k, pp);
                xd[e] = keep - h;
                model(sig, renorm, xd, E, ids + t * k, k, pm);
                xd[e] = keep;
                double g = 0, mag = 0;
                for (int j = 0; j < k; j++) {
                    g += dp[t * k + j] * (pp[j] - pm[j]) / (2 * h);
                    mag += fabs(dp[t * k + j]);
                }
                CHECK(fabs(dl[t * E + e] - g) <= ftol * (mag + 1.0), "it %d token %d expert %d: dlogit %a vs %a%s", it,
                      t, e, (double)dl[t * E + e], g, limit ? " (softmax limit)" : "");
            }
        }
        free(dp);
        free(dl);
        free(x);
        free(bias);
        free(probs);
        free(ids);
        free(cnt);
    }

    /* invalid arguments */
    float x[12] = {0}, p[6];
    int32_t ids[6];
    fm_tensor tl = fm_tensor_2d(x, FM_DTYPE_F32, 3, 4), ti = fm_tensor_2d(ids, FM_DTYPE_I32, 3, 2);
    fm_tensor tp = fm_tensor_2d(p, FM_DTYPE_F32, 3, 2);
    fm_router_config cfg = {5, 0, 0, NULL};
    CHECK(fm_moe_router(ctx, &cfg, &tl, &ti, &tp, NULL) == FM_ERR_INVALID_ARG &&
              strstr(fm_last_error(ctx), "cfg->topk"), "topk > E: %s", fm_last_error(ctx));
    cfg.topk = 2;
    cfg.score = (fm_router_score)7;
    CHECK(fm_moe_router(ctx, &cfg, &tl, &ti, &tp, NULL) == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "cfg->score"),
          "bad score: %s", fm_last_error(ctx));
    cfg.score = FM_ROUTER_SOFTMAX;
    fm_tensor bad = fm_tensor_2d(p, FM_DTYPE_F32, 3, 3);
    CHECK(fm_moe_router(ctx, &cfg, &tl, &ti, &bad, NULL) == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "probs"),
          "probs shape: %s", fm_last_error(ctx));
    bad = fm_tensor_2d(ids, FM_DTYPE_I64, 3, 2);
    CHECK(fm_moe_router(ctx, &cfg, &tl, &bad, &tp, NULL) == FM_ERR_INVALID_ARG &&
              strstr(fm_last_error(ctx), "expert_ids"), "ids dtype: %s", fm_last_error(ctx));
    fm_tensor alias = fm_tensor_2d(x, FM_DTYPE_F32, 3, 2);
    CHECK(fm_moe_router(ctx, &cfg, &tl, &ti, &alias, NULL) == FM_ERR_INVALID_ARG, "probs aliasing logits");
    ids[0] = 9;
    ids[1] = 0;
    fm_tensor tdl = fm_tensor_2d(x, FM_DTYPE_F32, 3, 4);
    float dl[12];
    tdl.data = dl;
    CHECK(fm_moe_router_backward(ctx, &cfg, &tl, &ti, &tp, &tdl) == FM_ERR_INVALID_ARG &&
              strstr(fm_last_error(ctx), "expert_ids"), "backward id out of range: %s", fm_last_error(ctx));
    fm_context_destroy(ctx);
    return tu_end();
}
