/* One MoE layer step (forward + backward, every recipe; the flow recipes
 * also with h recomputed in backward) on CUDA is the same
 * bits run to run and with its backward on one stream or two
 * (cfg.single_stream; also at a size where the two streams' kernels overlap
 * for long), and against the CPU backend from the same weights and data: y, dx and the three weight
 * gradients within a relative Frobenius error bound. The GEMMs may differ
 * by their tolerance (cuBLASLt sums in F32, the CPU in double), and an FP8
 * recipe re-quantizes GEMM outputs, where such a difference can move a value
 * to the neighbouring code: the bound is the GEMM tolerance for bf16 and
 * what one E4M3 step on a few elements gives for the FP8 recipes. */
#include "gpu_test.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static float *randv(int64_t n, double s)
{
    float *v = malloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++)
        v[i] = (float)(gt_normal(&rng) * s);
    return v;
}

enum { WR, W1, W2, GR, G1, G2, X, Y, DY, DX, NB };

typedef struct {
    float *p[NB];
} bufs;

/* One forward + backward in ctx; buffers live in ctx's memory. */
static fm_status step(fm_context *ctx, const fm_moe_layer_config *cfg, bufs *b, int64_t T, int64_t H)
{
    fm_moe_weights w = {b->p[WR], b->p[W1], b->p[W2], b->p[GR], b->p[G1], b->p[G2]};
    fm_tensor x = fm_tensor_2d(b->p[X], FM_DTYPE_F32, T, H), y = fm_tensor_2d(b->p[Y], FM_DTYPE_F32, T, H);
    fm_tensor dy = fm_tensor_2d(b->p[DY], FM_DTYPE_F32, T, H), dx = fm_tensor_2d(b->p[DX], FM_DTYPE_F32, T, H);
    x.device = y.device = dy.device = dx.device = fm_context_device(ctx);
    return layer_step(ctx, cfg, &w, &x, &y, &dy, &dx, NULL);
}

/* Every output of a step at a size where queue 1's copies run for hundreds
 * of microseconds beside queue 0's GEMMs: two streams (three runs, outputs
 * poisoned between them) against one, bit for bit. A missing wait between
 * the queues shows here as a difference or as NaN. */
static void streams_agree(fm_context *gpu, fm_recipe rc)
{
    const int64_t T = 2048, H = 1024, I = 512, E = 8;
    const int k = 4;
    int64_t n[NB] = {E * H, E * 2 * I * H, E * H * I, E * H, E * 2 * I * H, E * H * I, T * H, T * H, T * H, T * H};
    double sc[NB] = {0.03, 0.03, 0.044, 0, 0, 0, 1, 0, 1, 0};
    bufs h, d;
    float *ref[NB] = {0};
    for (int i = 0; i < NB; i++) {
        h.p[i] = sc[i] > 0 ? randv(n[i], sc[i]) : calloc((size_t)n[i], 4);
        GT_CHECK(fm_context_alloc(gpu, (size_t)n[i] * 4, (void **)&d.p[i]) == FM_OK, "alloc: %s", fm_last_error(gpu));
    }
    for (int run = 0; run < 4; run++) {
        fm_moe_layer_config cfg = {.hidden = H, .ffn = I, .experts = E, .topk = k, .renormalize = 1,
                                   .recipe = rc, .max_tokens = T, .single_stream = run == 0};
        for (int i = 0; i < NB; i++) {
            if (sc[i] > 0 || i == GR || i == G1 || i == G2 || i == DY)
                GT_CHECK(fm_context_copy(gpu, d.p[i], FM_DEVICE_CUDA, h.p[i], FM_DEVICE_HOST, (size_t)n[i] * 4) ==
                             FM_OK,
                         "copy");
            else
                GT_CHECK(fm_context_memset(gpu, d.p[i], 0xFF, (size_t)n[i] * 4) == FM_OK, "poison");
        }
        fm_status st = step(gpu, &cfg, &d, T, H);
        GT_CHECK(st == FM_OK, "%s at T %lld, run %d: %s", fm_recipe_name(rc), (long long)T, run, fm_last_error(gpu));
        if (st)
            break;
        static const int outs[] = {Y, DX, GR, G1, G2};
        for (int o = 0; o < 5; o++) {
            int i = outs[o];
            float *g = malloc((size_t)n[i] * 4);
            GT_CHECK(fm_context_copy(gpu, g, FM_DEVICE_HOST, d.p[i], FM_DEVICE_CUDA, (size_t)n[i] * 4) == FM_OK,
                     "copy back");
            if (run == 0) {
                int64_t bad = 0;
                for (int64_t j = 0; j < n[i]; j++)
                    bad += !isfinite(g[j]);
                GT_CHECK(bad == 0, "%s at T %lld, one stream: output %d has %lld non-finite values",
                         fm_recipe_name(rc), (long long)T, o, (long long)bad);
                ref[i] = g;
                continue;
            }
            GT_CHECK(memcmp(g, ref[i], (size_t)n[i] * 4) == 0,
                     "%s at T %lld: output %d of two-stream run %d differs from the one-stream run", fm_recipe_name(rc),
                     (long long)T, o, run);
            free(g);
        }
    }
    for (int i = 0; i < NB; i++) {
        fm_context_free(gpu, d.p[i]);
        free(h.p[i]);
        free(ref[i]);
    }
}

int main(void)
{
    fm_context *gpu = gt_cuda_context("test_cuda_layer_matches_cpu");
    fm_context *cpu = gt_cpu_context();
    const int64_t T = 300, H = 256, I = 128, E = 4;
    const int k = 2;
    int64_t n[NB] = {E * H, E * 2 * I * H, E * H * I, E * H, E * 2 * I * H, E * H * I, T * H, T * H, T * H, T * H};
    double sc[NB] = {0.0625, 0.0625, 0.088, 0, 0, 0, 1, 0, 1, 0};
    bufs h, c, d;
    for (int i = 0; i < NB; i++) {
        h.p[i] = sc[i] > 0 ? randv(n[i], sc[i]) : calloc((size_t)n[i], 4);
        c.p[i] = malloc((size_t)n[i] * 4);
        d.p[i] = NULL;
    }
    /* every recipe, then the flow recipes with h recomputed in backward */
    for (int run = 0; run < FM_RECIPE_COUNT + 2; run++) {
        const int rh = run >= FM_RECIPE_COUNT;
        const int rc = !rh ? run : run == FM_RECIPE_COUNT ? FM_RECIPE_FP8_FLOW : FM_RECIPE_FP8_FLOW_FP4;
        char rn[48];
        snprintf(rn, sizeof rn, "%s%s", fm_recipe_name((fm_recipe)rc), rh ? ", h recomputed" : "");
        fm_moe_layer_config cfg = {.hidden = H, .ffn = I, .experts = E, .topk = k, .renormalize = 1,
                                   .recipe = (fm_recipe)rc, .max_tokens = T, .recompute_h = rh};
        for (int i = 0; i < NB; i++) {
            memcpy(c.p[i], h.p[i], (size_t)n[i] * 4);
            GT_CHECK(fm_context_alloc(gpu, (size_t)n[i] * 4, (void **)&d.p[i]) == FM_OK, "alloc: %s",
                     fm_last_error(gpu));
            GT_CHECK(fm_context_copy(gpu, d.p[i], FM_DEVICE_CUDA, h.p[i], FM_DEVICE_HOST, (size_t)n[i] * 4) == FM_OK,
                     "copy: %s", fm_last_error(gpu));
        }
        fm_status sc_ = step(cpu, &cfg, &c, T, H);
        GT_CHECK(sc_ == FM_OK, "%s on CPU: %s", rn, fm_last_error(cpu));
        fm_status sg = step(gpu, &cfg, &d, T, H);
        GT_CHECK(sg == FM_OK, "%s on CUDA: %s", rn, fm_last_error(gpu));
        /* Run to run on CUDA, the second run on one stream: the same bits. */
        static const int outs2[] = {Y, DX, GR, G1, G2};
        float *first[5] = {0};
        for (int o = 0; o < 5 && sg == FM_OK; o++) {
            int i = outs2[o];
            first[o] = malloc((size_t)n[i] * 4);
            GT_CHECK(fm_context_copy(gpu, first[o], FM_DEVICE_HOST, d.p[i], FM_DEVICE_CUDA, (size_t)n[i] * 4) == FM_OK,
                     "copy back");
        }
        for (int i = 0; i < NB && sg == FM_OK; i++)
            GT_CHECK(fm_context_copy(gpu, d.p[i], FM_DEVICE_CUDA, h.p[i], FM_DEVICE_HOST, (size_t)n[i] * 4) == FM_OK,
                     "copy: %s", fm_last_error(gpu));
        if (sg == FM_OK) {
            fm_moe_layer_config one = cfg;
            one.single_stream = 1;
            fm_status s2 = step(gpu, &one, &d, T, H);
            GT_CHECK(s2 == FM_OK, "%s on CUDA, second run: %s", rn, fm_last_error(gpu));
            for (int o = 0; o < 5 && s2 == FM_OK; o++) {
                int i = outs2[o];
                float *g = malloc((size_t)n[i] * 4);
                GT_CHECK(fm_context_copy(gpu, g, FM_DEVICE_HOST, d.p[i], FM_DEVICE_CUDA, (size_t)n[i] * 4) == FM_OK,
                         "copy back");
                GT_CHECK(memcmp(g, first[o], (size_t)n[i] * 4) == 0,
                         "%s: output %d differs between the two-stream and the one-stream CUDA run", rn, o);
                free(g);
            }
        }
        for (int o = 0; o < 5; o++)
            free(first[o]);
        if (sc_ == FM_OK && sg == FM_OK) {
            static const int outs[] = {Y, DX, GR, G1, G2};
            static const char *on[] = {"y", "dx", "grad_router", "grad_w1", "grad_w2"};
            double tol = rc == FM_RECIPE_BF16 ? 5e-3 : 1.5e-2;
            for (int o = 0; o < 5; o++) {
                int i = outs[o];
                float *g = malloc((size_t)n[i] * 4);
                GT_CHECK(fm_context_copy(gpu, g, FM_DEVICE_HOST, d.p[i], FM_DEVICE_CUDA, (size_t)n[i] * 4) == FM_OK,
                         "copy back");
                double e = gt_rel_frob(g, c.p[i], n[i]);
                printf("%-28s %-12s rel. error %.2e (bound %.0e)\n", rn, on[o], e, tol);
                GT_CHECK(e <= tol, "%s %s: CUDA vs CPU rel. Frobenius error %.3g > %.3g", rn, on[o], e, tol);
                free(g);
            }
        }
        for (int i = 0; i < NB; i++)
            fm_context_free(gpu, d.p[i]);
    }
    for (int i = 0; i < NB; i++)
        free(h.p[i]), free(c.p[i]);
    for (int rc = 0; rc < FM_RECIPE_COUNT; rc++)
        streams_agree(gpu, (fm_recipe)rc);
    fm_context_destroy(gpu);
    fm_context_destroy(cpu);
    printf("test_cuda_layer_matches_cpu: %d failures\n", gt_failures);
    return gt_failures ? 1 : 0;
}
