/* The CUDA MoE ops produce the CPU reference's bytes: router (softmax and
 * sigmoid, bias, renormalisation) and its backward, permute + pad on FP8,
 * MXFP4 and BF16 rows with their scales, splits and maps, unpermute and its
 * backward, SwiGLU + quantize and dSwiGLU + quantize (FP8 1x128 row + column
 * outputs, MXFP4, BF16), with NaN tokens and empty experts. */
#include <math.h>
#include <stdint.h>

#include "gpu_test.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static float frand(void) { return (float)((double)(rnd() >> 11) / 9007199254740992.0 * 4.0 - 2.0); }

/* A tensor on both sides: host copy h (data, scale), device copy d. */
typedef struct {
    fm_tensor h, d;
    size_t nd, ns;
} pair;

static void pair_make(pair *p, fm_tensor proto, int fill)
{
    p->h = proto;
    p->nd = (size_t)fm_tensor_nbytes(&proto);
    p->ns = proto.scale_mode ? (size_t)fm_tensor_scale_nbytes(&proto) : 0;
    p->h.data = malloc(p->nd + 1);
    p->h.scale = p->ns ? malloc(p->ns) : NULL;
    memset(p->h.data, 0xCD, p->nd);
    if (fill)
        for (size_t i = 0; i < p->nd; i++)
            ((uint8_t *)p->h.data)[i] = (uint8_t)rnd();
    if (fill && proto.dtype == FM_DTYPE_F32)
        for (size_t i = 0; i < p->nd / 4; i++)
            ((float *)p->h.data)[i] = frand();
    if (fill && proto.dtype == FM_DTYPE_BF16)
        for (size_t i = 0; i < p->nd / 2; i++)
            ((uint16_t *)p->h.data)[i] = (uint16_t)(fm_bf16_from_f32(frand()));
    for (size_t i = 0; i < p->ns; i++)
        ((uint8_t *)p->h.scale)[i] = (uint8_t)(120 + rnd() % 14);
    if (p->ns && proto.scale_dtype == FM_DTYPE_F32)
        for (size_t i = 0; i < p->ns / 4; i++)
            ((float *)p->h.scale)[i] = ldexpf(1.0f, (int)(rnd() % 20) - 10);
    p->d = p->h;
    p->d.device = FM_DEVICE_CUDA;
    GT_CUDA(cudaMalloc(&p->d.data, p->nd + 1));
    GT_CUDA(cudaMemcpy(p->d.data, p->h.data, p->nd, cudaMemcpyHostToDevice));
    if (p->ns) {
        GT_CUDA(cudaMalloc(&p->d.scale, p->ns));
        GT_CUDA(cudaMemcpy(p->d.scale, p->h.scale, p->ns, cudaMemcpyHostToDevice));
    }
}

static void pair_same(const pair *p, const char *what, const char *cs)
{
    uint8_t *g = malloc(p->nd + p->ns + 1);
    GT_CUDA(cudaMemcpy(g, p->d.data, p->nd, cudaMemcpyDeviceToHost));
    if (p->ns)
        GT_CUDA(cudaMemcpy(g + p->nd, p->d.scale, p->ns, cudaMemcpyDeviceToHost));
    size_t bad = 0, first = (size_t)-1;
    for (size_t i = 0; i < p->nd; i++)
        if (((uint8_t *)p->h.data)[i] != g[i] && bad++ == 0)
            first = i;
    for (size_t i = 0; i < p->ns; i++)
        bad += ((uint8_t *)p->h.scale)[i] != g[p->nd + i];
    GT_CHECK(bad == 0, "%s: %s: %zu bytes differ (first data byte %zu)", cs, what, bad, first);
    free(g);
}

static void pair_free(pair *p)
{
    free(p->h.data);
    free(p->h.scale);
    cudaFree(p->d.data);
    if (p->ns)
        cudaFree(p->d.scale);
}

static fm_tensor q2d(fm_dtype dt, fm_scale_mode m, int64_t r, int64_t c, fm_layout l)
{
    if (m == FM_SCALE_NONE)
        return fm_tensor_2d(NULL, dt, r, c);
    return fm_tensor_quant_2d(NULL, dt, r, c, l, m, NULL, FM_SCALE_LAYOUT_COMPACT);
}

int main(void)
{
    fm_context *gpu = gt_cuda_context("test_cuda_moe_ops_bitexact_with_cpu");
    fm_context *cpu = gt_cpu_context();
    char cs[160];
    for (int it = 0; it < 24; it++) {
        int64_t T = 1 + (int64_t)(rnd() % 300), E = 1 + (int64_t)(rnd() % 40), k = 1 + (int64_t)(rnd() % (E < 8 ? E : 8));
        int64_t H = 32 * (1 + (int64_t)(rnd() % 12));
        snprintf(cs, sizeof cs, "it %d T %lld E %lld k %lld H %lld", it, (long long)T, (long long)E, (long long)k,
                 (long long)H);
        /* router */
        pair lg, ids, pr, cnt, dp, dl;
        pair_make(&lg, fm_tensor_2d(NULL, FM_DTYPE_F32, T, E), 1);
        ((float *)lg.h.data)[0] = NAN;
        GT_CUDA(cudaMemcpy(lg.d.data, lg.h.data, lg.nd, cudaMemcpyHostToDevice));
        pair_make(&ids, fm_tensor_2d(NULL, FM_DTYPE_I32, T, k), 0);
        pair_make(&pr, fm_tensor_2d(NULL, FM_DTYPE_F32, T, k), 0);
        pair_make(&cnt, fm_tensor_2d(NULL, FM_DTYPE_I64, 1, E), 0);
        fm_router_config rc = {(int)k, it % 2 ? FM_ROUTER_SIGMOID : FM_ROUTER_SOFTMAX, it % 3 == 0, NULL};
        GT_CHECK(fm_moe_router(cpu, &rc, &lg.h, &ids.h, &pr.h, &cnt.h) == FM_OK, "%s", fm_last_error(cpu));
        GT_CHECK(fm_moe_router(gpu, &rc, &lg.d, &ids.d, &pr.d, &cnt.d) == FM_OK, "%s", fm_last_error(gpu));
        pair_same(&ids, "router ids", cs);
        pair_same(&pr, "router probs", cs);
        pair_same(&cnt, "tokens_per_expert", cs);
        pair_make(&dp, fm_tensor_2d(NULL, FM_DTYPE_F32, T, k), 1);
        pair_make(&dl, fm_tensor_2d(NULL, FM_DTYPE_F32, T, E), 0);
        GT_CHECK(fm_moe_router_backward(cpu, &rc, &lg.h, &ids.h, &dp.h, &dl.h) == FM_OK, "%s", fm_last_error(cpu));
        GT_CHECK(fm_moe_router_backward(gpu, &rc, &lg.d, &ids.d, &dp.d, &dl.d) == FM_OK, "%s", fm_last_error(gpu));
        pair_same(&dl, "dlogits", cs);

        /* permute: skew the routing so that some experts are empty */
        if (it % 4 == 1)
            for (int64_t i = 0; i < T * k; i++)
                ((int32_t *)ids.h.data)[i] = (int32_t)(i % k);
        GT_CUDA(cudaMemcpy(ids.d.data, ids.h.data, ids.nd, cudaMemcpyHostToDevice));
        static const fm_dtype dts[3] = {FM_DTYPE_E4M3, FM_DTYPE_E2M1, FM_DTYPE_BF16};
        static const fm_scale_mode ms[3] = {FM_SCALE_BLOCK_1x128, FM_SCALE_MX32, FM_SCALE_NONE};
        int kd = it % 3;
        int pad = it % 2 ? 16 : 0;
        int64_t R = T * k + E * (pad ? pad - 1 : 0) + 3;
        pair x, out, rm, sr, sp, op;
        pair_make(&x, q2d(dts[kd], ms[kd], T, H, FM_LAYOUT_ROWWISE), 1);
        pair_make(&out, q2d(dts[kd], ms[kd], R, H, FM_LAYOUT_ROWWISE), 0);
        pair_make(&rm, fm_tensor_2d(NULL, FM_DTYPE_I32, R, 1), 0);
        pair_make(&sr, fm_tensor_2d(NULL, FM_DTYPE_I32, T, k), 0);
        pair_make(&sp, fm_tensor_2d(NULL, FM_DTYPE_I64, 1, E), 0);
        pair_make(&op, fm_tensor_2d(NULL, FM_DTYPE_F32, R, 1), 0);
        fm_permute_config pc = {pad};
        int64_t hs[64];
        GT_CHECK(fm_moe_permute(cpu, &pc, &x.h, &ids.h, &pr.h, &out.h, &rm.h, &sr.h, &sp.h, &op.h, NULL) == FM_OK, "%s",
                 fm_last_error(cpu));
        GT_CHECK(fm_moe_permute(gpu, &pc, &x.d, &ids.d, &pr.d, &out.d, &rm.d, &sr.d, &sp.d, &op.d, hs) == FM_OK, "%s",
                 fm_last_error(gpu));
        pair_same(&out, "permuted rows", cs);
        pair_same(&rm, "row_map", cs);
        pair_same(&sr, "slot_rows", cs);
        pair_same(&sp, "splits", cs);
        pair_same(&op, "out_probs", cs);
        GT_CHECK(!memcmp(hs, sp.h.data, (size_t)E * 8), "%s: host_splits", cs);

        /* unpermute and backward on F32/BF16 rows over the same maps */
        pair y, uo, dout, dy, dpr;
        pair_make(&y, fm_tensor_2d(NULL, it % 2 ? FM_DTYPE_BF16 : FM_DTYPE_F32, R, H), 1);
        pair_make(&uo, fm_tensor_2d(NULL, it % 3 ? FM_DTYPE_BF16 : FM_DTYPE_F32, T, H), 0);
        GT_CHECK(fm_moe_unpermute(cpu, &y.h, &sr.h, &pr.h, &uo.h) == FM_OK, "%s", fm_last_error(cpu));
        GT_CHECK(fm_moe_unpermute(gpu, &y.d, &sr.d, &pr.d, &uo.d) == FM_OK, "%s", fm_last_error(gpu));
        pair_same(&uo, "unpermute", cs);
        pair_make(&dout, fm_tensor_2d(NULL, uo.h.dtype, T, H), 1);
        pair_make(&dy, fm_tensor_2d(NULL, y.h.dtype, R, H), 0);
        pair_make(&dpr, fm_tensor_2d(NULL, FM_DTYPE_F32, T, k), 0);
        GT_CHECK(fm_moe_unpermute_backward(cpu, &dout.h, &y.h, &rm.h, &sr.h, &pr.h, &dy.h, &dpr.h) == FM_OK, "%s",
                 fm_last_error(cpu));
        GT_CHECK(fm_moe_unpermute_backward(gpu, &dout.d, &y.d, &rm.d, &sr.d, &pr.d, &dy.d, &dpr.d) == FM_OK, "%s",
                 fm_last_error(gpu));
        pair_same(&dy, "unpermute dy", cs);
        pair_same(&dpr, "unpermute dprobs", cs);

        /* SwiGLU over the permuted rows, probs per row */
        int64_t M = R, I = H / 2;
        pair sin, so, sc, dh, din, dinc, sdp;
        pair_make(&sin, fm_tensor_2d(NULL, it % 2 ? FM_DTYPE_BF16 : FM_DTYPE_F32, M, 2 * I), 1);
        static const fm_dtype odt[3] = {FM_DTYPE_E4M3, FM_DTYPE_E2M1, FM_DTYPE_BF16};
        pair_make(&so, q2d(odt[kd], ms[kd], M, I, FM_LAYOUT_ROWWISE), 0);
        int col = kd == 0;
        if (col)
            pair_make(&sc, q2d(odt[kd], ms[kd], M, I, FM_LAYOUT_COLWISE), 0);
        GT_CHECK(fm_moe_swiglu(cpu, NULL, &sin.h, &op.h, &so.h, col ? &sc.h : NULL, NULL) == FM_OK, "%s", fm_last_error(cpu));
        GT_CHECK(fm_moe_swiglu(gpu, NULL, &sin.d, &op.d, &so.d, col ? &sc.d : NULL, NULL) == FM_OK, "%s", fm_last_error(gpu));
        pair_same(&so, "swiglu row", cs);
        if (col)
            pair_same(&sc, "swiglu col", cs);
        pair_make(&dh, fm_tensor_2d(NULL, FM_DTYPE_F32, M, I), 1);
        pair_make(&din, q2d(odt[kd], ms[kd], M, 2 * I, FM_LAYOUT_ROWWISE), 0);
        if (col)
            pair_make(&dinc, q2d(odt[kd], ms[kd], M, 2 * I, FM_LAYOUT_COLWISE), 0);
        pair_make(&sdp, fm_tensor_2d(NULL, FM_DTYPE_F32, M, 1), 0);
        GT_CHECK(fm_moe_swiglu_backward(cpu, NULL, &dh.h, &sin.h, &op.h, &din.h, col ? &dinc.h : NULL, &sdp.h) == FM_OK,
                 "%s", fm_last_error(cpu));
        GT_CHECK(fm_moe_swiglu_backward(gpu, NULL, &dh.d, &sin.d, &op.d, &din.d, col ? &dinc.d : NULL, &sdp.d) == FM_OK,
                 "%s", fm_last_error(gpu));
        pair_same(&din, "dswiglu row", cs);
        if (col)
            pair_same(&dinc, "dswiglu col", cs);
        pair_same(&sdp, "dswiglu dprobs", cs);

        pair *all[] = {&lg, &ids, &pr, &cnt, &dp, &dl, &x, &out, &rm, &sr, &sp, &op, &y, &uo, &dout, &dy, &dpr,
                       &sin, &so, &dh, &din, &sdp};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            pair_free(all[i]);
        if (col) {
            pair_free(&sc);
            pair_free(&dinc);
        }
    }
    fm_context_destroy(gpu);
    fm_context_destroy(cpu);
    printf("test_cuda_moe_ops_bitexact_with_cpu: %d failures\n", gt_failures);
    return gt_failures ? 1 : 0;
}
