/* A layer step (forward + backward) gives the same bits every time, whatever
 * the CPU thread count: the outputs, dx and every accumulated gradient of
 * every recipe, run to run and with 1, 2 and 3 worker threads. Work is split
 * into fixed chunks and every reduction has a fixed order, so nothing may
 * depend on scheduling. */
#include "test_util.h"

typedef struct {
    float *y, *dx, *gr, *g1, *g2;
} result;

static void step(int threads, fm_recipe rc, int64_t T, int64_t H, int64_t I, int64_t E, int k, const float *wr,
                 const float *w1, const float *w2, const float *x, const float *dy, result *out)
{
    fm_context *ctx = tu_cpu_context(threads);
    fm_moe_layer_config cfg = {.hidden = H, .ffn = I, .experts = E, .topk = k, .renormalize = 1, .recipe = rc,
                               .max_tokens = T};
    out->y = malloc((size_t)(T * H) * 4), out->dx = malloc((size_t)(T * H) * 4);
    out->gr = calloc((size_t)(E * H), 4), out->g1 = calloc((size_t)(E * 2 * I * H), 4);
    out->g2 = calloc((size_t)(E * H * I), 4);
    fm_moe_weights w = {(float *)wr, (float *)w1, (float *)w2, out->gr, out->g1, out->g2};
    fm_tensor tx = fm_tensor_2d((void *)x, FM_DTYPE_F32, T, H), ty = fm_tensor_2d(out->y, FM_DTYPE_F32, T, H);
    fm_tensor tdy = fm_tensor_2d((void *)dy, FM_DTYPE_F32, T, H), tdx = fm_tensor_2d(out->dx, FM_DTYPE_F32, T, H);
    fm_status st = layer_step(ctx, &cfg, &w, &tx, &ty, &tdy, &tdx, NULL);
    CHECK(st == FM_OK, "%s, %d threads: %s", fm_recipe_name(rc), threads, fm_last_error(ctx));
    fm_context_destroy(ctx);
}

static void drop(result *r) { free(r->y), free(r->dx), free(r->gr), free(r->g1), free(r->g2); }

int main(void)
{
    tu_begin("test_moe_layer_is_deterministic");
    const int64_t T = 150, H = 128, I = 64, E = 6;
    const int k = 2;
    float *wr = malloc((size_t)(E * H) * 4), *w1 = malloc((size_t)(E * 2 * I * H) * 4);
    float *w2 = malloc((size_t)(E * H * I) * 4), *x = malloc((size_t)(T * H) * 4), *dy = malloc((size_t)(T * H) * 4);
    for (int64_t i = 0; i < E * H; i++)
        wr[i] = (float)(tu_normal() * 0.1);
    for (int64_t i = 0; i < E * 2 * I * H; i++)
        w1[i] = (float)(tu_normal() * 0.09);
    for (int64_t i = 0; i < E * H * I; i++)
        w2[i] = (float)(tu_normal() * 0.12);
    for (int64_t i = 0; i < T * H; i++)
        x[i] = (float)tu_normal(), dy[i] = (float)tu_normal();
    const int64_t n[5] = {T * H, T * H, E * H, E * 2 * I * H, E * H * I};
    static const char *names[5] = {"y", "dx", "grad_router", "grad_w1", "grad_w2"};
    for (int rc = 0; rc < FM_RECIPE_COUNT; rc++) {
        result ref, again;
        step(1, (fm_recipe)rc, T, H, I, E, k, wr, w1, w2, x, dy, &ref);
        static const int threads[3] = {1, 2, 3};
        for (int t = 0; t < 3; t++) {
            step(threads[t], (fm_recipe)rc, T, H, I, E, k, wr, w1, w2, x, dy, &again);
            float *a[5] = {ref.y, ref.dx, ref.gr, ref.g1, ref.g2}, *b[5] = {again.y, again.dx, again.gr, again.g1,
                                                                           again.g2};
            for (int o = 0; o < 5; o++)
                CHECK(memcmp(a[o], b[o], (size_t)n[o] * 4) == 0, "%s: %s differs with %d threads from the 1-thread run",
                      fm_recipe_name((fm_recipe)rc), names[o], threads[t]);
            drop(&again);
        }
        drop(&ref);
    }
    free(wr), free(w1), free(w2), free(x), free(dy);
    return tu_end();
}
