/* The CUDA MoE ops produce the CPU reference's bytes: router (softmax and
 * sigmoid, bias, renormalisation) and its backward, permute + pad on FP8,
 * MXFP4 and BF16 rows with their scales, splits and maps, unpermute and its
 * backward, SwiGLU + quantize and dSwiGLU + quantize (FP8 1x128 row + column
 * outputs, MXFP4, BF16), with NaN tokens and empty experts. SwiGLU also on
 * its own: the fused kernels' cases (I a multiple of 128, BF16 / E4M3 1x128 /
 * E2M1 MX32 input, FP8 1x128 output, in_saved, dprobs) and the general path
 * next to them, with NaN, Inf, huge, zero and subnormal blocks. */
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

/* BF16 bits of a nasty 128-column block, pattern k: NaN, +-Inf, BF16's
 * largest magnitude, values whose activation overflows or nearly does,
 * zeros, subnormals; k >= 8 leaves the random data. */
static void nasty_bf16(uint16_t *x, int64_t n, int k)
{
    int64_t at = (int64_t)(rnd() % (uint64_t)n);
    switch (k) {
    case 0: x[at] = 0x7FC1; break;
    case 1: x[at] = 0x7F80; break;
    case 2: x[at] = 0xFF80; break;
    case 3: x[at] = 0x7F7F; x[(at + 5) % n] = 0xFF7F; break;
    case 4: for (int64_t i = 0; i < n; i += 3) x[i] = fm_bf16_from_f32(i % 2 ? 1e19f : -3e18f); break;
    case 5: for (int64_t i = 0; i < n; i++) x[i] = (uint16_t)(i % 2 ? 0x8000 : 0); break;
    case 6: for (int64_t i = 0; i < n; i++) x[i] = (uint16_t)((rnd() % 0x7F) | (i % 2 ? 0x8000 : 0)); break;
    default: break;
    }
}

static void upload(pair *p) { GT_CUDA(cudaMemcpy(p->d.data, p->h.data, p->nd, cudaMemcpyHostToDevice)); }
static void upload_scale(pair *p) { GT_CUDA(cudaMemcpy(p->d.scale, p->h.scale, p->ns, cudaMemcpyHostToDevice)); }

/* A row-wise [M, C] input of kind k: BF16 with nasty blocks, E4M3 1x128 or
 * E2M1 MX32 with random codes and scales (NaN codes and NaN scales in a few
 * blocks only, so that most blocks stay finite). */
static void act_input(pair *p, int k, int64_t M, int64_t C)
{
    static const fm_dtype dt[3] = {FM_DTYPE_BF16, FM_DTYPE_E4M3, FM_DTYPE_E2M1};
    static const fm_scale_mode sm[3] = {FM_SCALE_NONE, FM_SCALE_BLOCK_1x128, FM_SCALE_MX32};
    pair_make(p, q2d(dt[k], sm[k], M, C, FM_LAYOUT_ROWWISE), 1);
    for (int64_t r = 0; r < M; r++)
        for (int64_t c0 = 0; c0 < C; c0 += 128) {
            int64_t n = C - c0 < 128 ? C - c0 : 128;
            int pat = (int)((r * 7 + c0 / 128 * 3 + (uint64_t)k) % 11);
            if (k == 0) {
                nasty_bf16((uint16_t *)p->h.data + r * C + c0, n, pat);
            } else if (k == 1) {
                uint8_t *x = (uint8_t *)p->h.data + r * C + c0;
                for (int64_t i = 0; i < n; i++)
                    if ((x[i] & 0x7F) == 0x7F && pat)
                        x[i] = (uint8_t)(x[i] - 1);
            }
        }
    if (k == 1 && M > 2)
        ((float *)p->h.scale)[2 * fm_cdiv(C, 128) - 1] = NAN;
    if (k == 2)
        ((uint8_t *)p->h.scale)[(M - 1) * (C / 32)] = 0xFF;
    upload(p);
    if (k)
        upload_scale(p);
}

/* SwiGLU forward and backward, CPU against CUDA, over the fused kernels'
 * cases and the general path beside them. */
/* Rows of no columns ([3, 0] input): dprobs is +0 on both backends (the
 * CUDA backend once skipped its dprobs kernel there and left it unwritten). */
static void swiglu_empty_rows(fm_context *cpu, fm_context *gpu)
{
    pair in, pr, dh, din, dp;
    pair_make(&in, fm_tensor_2d(NULL, FM_DTYPE_BF16, 3, 0), 1);
    pair_make(&pr, fm_tensor_2d(NULL, FM_DTYPE_F32, 3, 1), 1);
    pair_make(&dh, fm_tensor_2d(NULL, FM_DTYPE_BF16, 3, 0), 1);
    pair_make(&din, fm_tensor_2d(NULL, FM_DTYPE_BF16, 3, 0), 0);
    pair_make(&dp, fm_tensor_2d(NULL, FM_DTYPE_F32, 3, 1), 0);
    GT_CHECK(fm_moe_swiglu_backward(cpu, NULL, &dh.h, &in.h, &pr.h, &din.h, NULL, &dp.h) == FM_OK, "%s",
             fm_last_error(cpu));
    GT_CHECK(fm_moe_swiglu_backward(gpu, NULL, &dh.d, &in.d, &pr.d, &din.d, NULL, &dp.d) == FM_OK, "%s",
             fm_last_error(gpu));
    pair_same(&dp, "dswiglu dprobs", "rows of no columns (M 3, I 0)");
    pair *all[] = {&in, &pr, &dh, &din, &dp};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        pair_free(all[i]);
}

static void swiglu_cases(fm_context *cpu, fm_context *gpu)
{
    swiglu_empty_rows(cpu, gpu);
    static const int64_t Ms[] = {1, 7, 130, 33};
    static const int64_t Is[] = {128, 384, 256, 640, 96};
    char cs[200];
    for (int ci = 0; ci < 60; ci++) {
        int64_t M = Ms[ci % 4], I = Is[ci % 5];
        int ink = (ci / 2) % 3, has_p = ci % 2, sv = ink ? 0 : (ci / 3) % 3;
        fm_dtype odt = ci % 3 == 2 ? FM_DTYPE_E5M2 : FM_DTYPE_E4M3;
        int colout = ci % 6 == 4, want_amax = ci % 8 == 6, dh32 = ci % 10 == 3, want_dp = has_p && ci % 4 != 1;
        fm_quant_config qc = {FM_SCALE_RULE_DEFAULT, ci % 5 == 1 ? 1e-3f : 0.0f, NULL, NULL};
        if (ci % 4 == 3)
            qc.rule = FM_SCALE_RULE_POW2;
        if (ci % 7 == 5 && sv != 2)
            qc.rule = FM_SCALE_RULE_EXACT;
        snprintf(cs, sizeof cs, "swiglu case %d M %lld I %lld in %d probs %d saved %d out %s col %d amax %d rule %d eps %g",
                 ci, (long long)M, (long long)I, ink, has_p, sv, fm_dtype_name(odt), colout, want_amax, (int)qc.rule,
                 (double)qc.epsilon);
        pair in, pr, out, oc, sav, dh, din, dinc, dp;
        act_input(&in, ink, M, 2 * I);
        pair_make(&pr, fm_tensor_2d(NULL, FM_DTYPE_F32, M, 1), 1);
        if (M > 3) {
            ((float *)pr.h.data)[3] = NAN;
            ((float *)pr.h.data)[1] = 0.0f;
            upload(&pr);
        }
        pair_make(&out, q2d(odt, FM_SCALE_BLOCK_1x128, M, I, FM_LAYOUT_ROWWISE), 0);
        if (colout)
            pair_make(&oc, q2d(odt, FM_SCALE_BLOCK_1x128, M, I, FM_LAYOUT_COLWISE), 0);
        if (sv)
            pair_make(&sav, q2d(sv == 1 ? FM_DTYPE_E4M3 : FM_DTYPE_E2M1, sv == 1 ? FM_SCALE_BLOCK_1x128 : FM_SCALE_MX32,
                                M, 2 * I, FM_LAYOUT_ROWWISE), 0);
        float amax_h = 0, *amax_d = NULL;
        fm_quant_config qh = qc, qd = qc;
        if (want_amax) {
            GT_CUDA(cudaMalloc((void **)&amax_d, sizeof(float)));
            qh.amax = &amax_h;
            qd.amax = amax_d;
        }
        const fm_tensor *ph = has_p ? &pr.h : NULL, *pd = has_p ? &pr.d : NULL;
        GT_CHECK(fm_moe_swiglu(cpu, &qh, &in.h, ph, &out.h, colout ? &oc.h : NULL, sv ? &sav.h : NULL) == FM_OK, "%s: %s",
                 cs, fm_last_error(cpu));
        GT_CHECK(fm_moe_swiglu(gpu, &qd, &in.d, pd, &out.d, colout ? &oc.d : NULL, sv ? &sav.d : NULL) == FM_OK, "%s: %s",
                 cs, fm_last_error(gpu));
        pair_same(&out, "swiglu out_row", cs);
        if (colout)
            pair_same(&oc, "swiglu out_col", cs);
        if (sv)
            pair_same(&sav, "swiglu in_saved", cs);
        if (want_amax) {
            float g;
            GT_CUDA(cudaMemcpy(&g, amax_d, sizeof g, cudaMemcpyDeviceToHost));
            GT_CHECK(!memcmp(&g, &amax_h, sizeof g), "%s: amax %g vs CPU %g", cs, (double)g, (double)amax_h);
        }

        pair_make(&dh, fm_tensor_2d(NULL, dh32 ? FM_DTYPE_F32 : FM_DTYPE_BF16, M, I), 1);
        if (!dh32) {
            for (int64_t r = 0; r < M; r++)
                for (int64_t c0 = 0; c0 < I; c0 += 128)
                    nasty_bf16((uint16_t *)dh.h.data + r * I + c0, I - c0 < 128 ? I - c0 : 128,
                               (int)((r * 5 + c0 / 128) % 13));
            upload(&dh);
        }
        pair_make(&din, q2d(odt, FM_SCALE_BLOCK_1x128, M, 2 * I, FM_LAYOUT_ROWWISE), 0);
        if (colout)
            pair_make(&dinc, q2d(odt, FM_SCALE_BLOCK_1x128, M, 2 * I, FM_LAYOUT_COLWISE), 0);
        pair_make(&dp, fm_tensor_2d(NULL, FM_DTYPE_F32, M, 1), 0);
        GT_CHECK(fm_moe_swiglu_backward(cpu, &qh, &dh.h, &in.h, ph, &din.h, colout ? &dinc.h : NULL,
                                        want_dp ? &dp.h : NULL) == FM_OK,
                 "%s: %s", cs, fm_last_error(cpu));
        GT_CHECK(fm_moe_swiglu_backward(gpu, &qd, &dh.d, &in.d, pd, &din.d, colout ? &dinc.d : NULL,
                                        want_dp ? &dp.d : NULL) == FM_OK,
                 "%s: %s", cs, fm_last_error(gpu));
        pair_same(&din, "dswiglu din_row", cs);
        if (colout)
            pair_same(&dinc, "dswiglu din_col", cs);
        pair_same(&dp, "dswiglu dprobs", cs);
        if (want_amax) {
            float g;
            GT_CUDA(cudaMemcpy(&g, amax_d, sizeof g, cudaMemcpyDeviceToHost));
            GT_CHECK(!memcmp(&g, &amax_h, sizeof g), "%s: backward amax %g vs CPU %g", cs, (double)g, (double)amax_h);
            cudaFree(amax_d);
        }
        pair *all[] = {&in, &pr, &out, &dh, &din, &dp};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            pair_free(all[i]);
        if (colout) {
            pair_free(&oc);
            pair_free(&dinc);
        }
        if (sv)
            pair_free(&sav);
    }
}

int main(void)
{
    fm_context *gpu = gt_cuda_context("test_cuda_moe_ops_bitexact_with_cpu");
    fm_context *cpu = gt_cpu_context();
    char cs[160];
    for (int it = 0; it < 24; it++) {
        int64_t T = 1 + (int64_t)(rnd() % 300), E = 1 + (int64_t)(rnd() % 40), k = 1 + (int64_t)(rnd() % (E < 8 ? E : 8));
        int64_t H = 32 * (1 + (int64_t)(rnd() % 12));
        /* The permute ranks slots in chunks of 2048: many chunks, and more
         * experts than fit 8 warps' shared-memory counters. */
        if (it == 22 || it == 23) {
            T = it == 22 ? 4000 : 6001;
            E = it == 22 ? 2000 : 64;
            k = 8;
            H = 64;
        }
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
        int64_t *hs = malloc((size_t)E * sizeof *hs);
        GT_CHECK(hs != NULL, "%s: host_splits allocation", cs);
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
        free(hs);

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
    swiglu_cases(cpu, gpu);
    fm_context_destroy(gpu);
    fm_context_destroy(cpu);
    printf("test_cuda_moe_ops_bitexact_with_cpu: %d failures\n", gt_failures);
    return gt_failures ? 1 : 0;
}
