/* Ops only queue work on the context's stream: with the stream held by a
 * host callback that waits for the host thread, every op still returns, and
 * the results appear after the stream is released. That includes the
 * scaling-aware transpose with scales it must check: a bad one is reported
 * by the next fm_context_synchronize, and that call wrote nothing. An op that synchronised
 * inside would wait for the callback, which waits for the op: the callback
 * gives up after 20 s and the test fails. Repeated runs give identical bytes
 * (order-independent atomics only), checked here too. */
#include <stdatomic.h>
#include <time.h>

#include "gpu_test.h"

static atomic_int released, timed_out;

static void CUDART_CB gate(void *arg)
{
    (void)arg;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (!atomic_load(&released)) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        if (t.tv_sec - t0.tv_sec > 20) {
            atomic_store(&timed_out, 1);
            return;
        }
    }
}

int main(void)
{
    const char *name = "test_cuda_ops_never_block_the_host";
    fm_context *g = gt_cuda_context(name);
    cudaStream_t s;
    GT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    GT_CHECK(fm_context_set_stream(g, s) == FM_OK, "set_stream: %s", fm_last_error(g));
    const int64_t E = 2, R = 384, C = 1000;
    size_t n = (size_t)(E * R * C);
    uint16_t *h = malloc(n * 2);
    uint64_t x = 99;
    for (size_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        h[i] = (uint16_t)(x >> 48);  /* raw BF16 bits: NaN, Inf, subnormals too */
    }
    void *din, *dr[2], *drs[2], *dc[2], *dcs[2], *dam[2], *dout;
    GT_CUDA(cudaMalloc(&din, n * 2));
    GT_CUDA(cudaMalloc(&dout, n * 4));
    GT_CUDA(cudaMemcpy(din, h, n * 2, cudaMemcpyHostToDevice));
    fm_tensor in = fm_tensor_3d(din, FM_DTYPE_BF16, E, R, C);
    in.device = FM_DEVICE_CUDA;
    fm_tensor r[2], cw[2];
    for (int k = 0; k < 2; k++) {
        r[k] = in;
        r[k].dtype = FM_DTYPE_E4M3;
        r[k].scale_mode = FM_SCALE_ROW; /* exercises the amax pass and the scratch */
        r[k].scale_dtype = FM_DTYPE_F32;
        cw[k] = r[k];
        cw[k].layout = FM_LAYOUT_COLWISE;
        cw[k].scale_mode = FM_SCALE_BLOCK_1x128;
        cw[k].scale_layout = FM_SCALE_LAYOUT_GEMM;
        GT_CUDA(cudaMalloc(&dr[k], (size_t)fm_tensor_nbytes(&r[k])));
        GT_CUDA(cudaMalloc(&drs[k], (size_t)fm_tensor_scale_nbytes(&r[k])));
        GT_CUDA(cudaMalloc(&dc[k], (size_t)fm_tensor_nbytes(&cw[k])));
        GT_CUDA(cudaMalloc(&dcs[k], (size_t)fm_tensor_scale_nbytes(&cw[k])));
        GT_CUDA(cudaMalloc(&dam[k], 16));
        GT_CUDA(cudaMemset(dam[k], 0, 16)); /* bytes 4..8 sit between amax and the count; nobody writes them */
        r[k].data = dr[k];
        r[k].scale = drs[k];
        cw[k].data = dc[k];
        cw[k].scale = dcs[k];
    }
    fm_tensor out = fm_tensor_3d(dout, FM_DTYPE_F32, E, R, C);
    out.device = FM_DEVICE_CUDA;
    fm_tensor cg = cw[1];
    cg.scale_layout = FM_SCALE_LAYOUT_COMPACT;
    void *dcomp;
    /* Allocated before the gate: cudaMalloc itself may wait for the device. */
    GT_CUDA(cudaMalloc(&dcomp, (size_t)fm_tensor_scale_nbytes(&cg)));
    cg.scale = dcomp;
    /* The transposes back to row-wise 1 x 128: [0] warm-up, [1] the valid
     * call under the gate, [2] the call whose input has one bad scale (cw[0]'s
     * scales, which cw[1] gets too, with entry 5 set to 3). */
    fm_tensor rt[3], cbad = cw[1];
    void *drt[3], *drts[3], *dbads;
    const size_t nrt = (size_t)fm_tensor_nbytes(&r[0]);
    for (int k = 0; k < 3; k++) {
        rt[k] = r[0];
        rt[k].scale_mode = FM_SCALE_BLOCK_1x128;
        GT_CUDA(cudaMalloc(&drt[k], nrt));
        GT_CUDA(cudaMalloc(&drts[k], (size_t)fm_tensor_scale_nbytes(&rt[k])));
        GT_CUDA(cudaMemset(drt[k], 0xA5, nrt));
        GT_CUDA(cudaMemset(drts[k], 0xA5, (size_t)fm_tensor_scale_nbytes(&rt[k])));
        rt[k].data = drt[k];
        rt[k].scale = drts[k];
    }
    GT_CUDA(cudaMalloc(&dbads, (size_t)fm_tensor_scale_nbytes(&cbad)));
    cbad.scale = dbads;
    /* Warm every op first: with lazy module loading (CUDA's default) the
     * first launch of a kernel loads it, and that may wait for the device.
     * That is the runtime's one-time cost, not an op synchronising. */
    fm_quant_config q0 = {.amax = (float *)dam[0], .nonfinite_blocks = (int64_t *)((char *)dam[0] + 8)};
    GT_CHECK(fm_quantize(g, &q0, &in, &r[0], &cw[0]) == FM_OK, "warm quantize: %s", fm_last_error(g));
    GT_CHECK(fm_dequantize(g, &cw[0], &out) == FM_OK, "warm dequantize: %s", fm_last_error(g));
    fm_tensor cg0 = cg;
    cg0.data = cw[0].data;
    GT_CHECK(fm_scale_layout_convert(g, &cw[0], &cg0) == FM_OK, "warm convert: %s", fm_last_error(g));
    fm_requant_config rq = {.rule = FM_REQUANT_TIGHT}; /* untrusted: the device checks the scales */
    GT_CHECK(fm_transpose_scaled(g, &rq, &cw[0], &rt[0]) == FM_OK, "warm transpose: %s", fm_last_error(g));
    GT_CUDA(cudaStreamSynchronize(s));
    GT_CHECK(fm_context_synchronize(g) == FM_OK, "warm-up: %s", fm_last_error(g));
    {
        const float three = 3.0f;
        GT_CUDA(cudaMemcpy(dbads, cw[0].scale, (size_t)fm_tensor_scale_nbytes(&cbad), cudaMemcpyDeviceToDevice));
        GT_CUDA(cudaMemcpy((float *)dbads + 5, &three, 4, cudaMemcpyHostToDevice));
    }

    GT_CUDA(cudaLaunchHostFunc(s, gate, NULL));
    fm_quant_config q1 = {.amax = (float *)dam[1], .nonfinite_blocks = (int64_t *)((char *)dam[1] + 8)};
    fm_status a = fm_quantize(g, &q1, &in, &r[1], &cw[1]);
    fm_status b = fm_dequantize(g, &cw[1], &out);
    fm_status d = fm_scale_layout_convert(g, &cw[1], &cg);
    fm_status t1 = fm_transpose_scaled(g, &rq, &cw[1], &rt[1]);
    fm_status t2 = fm_transpose_scaled(g, &rq, &cbad, &rt[2]);
    int late = atomic_load(&timed_out);
    atomic_store(&released, 1);
    GT_CHECK(a == FM_OK && b == FM_OK && d == FM_OK && t1 == FM_OK && t2 == FM_OK, "ops: %s", fm_last_error(g));
    GT_CHECK(!late, "an op waited for the stream: the gate timed out before the ops returned");
    fm_status sy = fm_context_synchronize(g);
    GT_CHECK(sy == FM_ERR_INVALID_ARG && strstr(fm_last_error(g), "not a positive power of two"),
             "the bad scale: synchronize gave %s (%s)", fm_status_name(sy), fm_last_error(g));
    GT_CHECK(fm_context_synchronize(g) == FM_OK, "a second synchronize: %s (reported once)", fm_last_error(g));
    GT_CHECK(!atomic_load(&timed_out), "the gate timed out");
    {
        const size_t nrs = (size_t)fm_tensor_scale_nbytes(&rt[2]);
        unsigned char *u = malloc(nrt + nrs);
        GT_CUDA(cudaMemcpy(u, drt[2], nrt, cudaMemcpyDeviceToHost));
        GT_CUDA(cudaMemcpy(u + nrt, drts[2], nrs, cudaMemcpyDeviceToHost));
        size_t i = 0;
        while (i < nrt + nrs && u[i] == 0xA5)
            i++;
        GT_CHECK(i == nrt + nrs, "the refused transpose wrote byte %zu of its output (codes, then scales)", i);
        free(u);
    }

    /* Determinism: the two quantize runs wrote identical bytes. */
    size_t sizes[3] = {(size_t)fm_tensor_nbytes(&r[0]), (size_t)fm_tensor_scale_nbytes(&r[0]),
                       (size_t)fm_tensor_nbytes(&cw[0])};
    void *p0[6] = {dr[0], drs[0], dc[0], dam[0], drt[0], drts[0]};
    void *p1[6] = {dr[1], drs[1], dc[1], dam[1], drt[1], drts[1]};
    size_t sz[6] = {sizes[0], sizes[1], sizes[2], 16, nrt, (size_t)fm_tensor_scale_nbytes(&rt[0])};
    for (int i = 0; i < 6; i++) {
        unsigned char *u = malloc(sz[i]), *v = malloc(sz[i]);
        GT_CUDA(cudaMemcpy(u, p0[i], sz[i], cudaMemcpyDeviceToHost));
        GT_CUDA(cudaMemcpy(v, p1[i], sz[i], cudaMemcpyDeviceToHost));
        GT_CHECK(!memcmp(u, v, sz[i]), "buffer %d differs between two identical runs", i);
        free(u);
        free(v);
    }
    printf("  ops returned with the stream held; two runs identical; the bad scale reported at synchronize\n");
    cudaFree(dcomp);
    cudaFree(dbads);
    for (int k = 0; k < 3; k++) {
        cudaFree(drt[k]);
        cudaFree(drts[k]);
    }
    for (int k = 0; k < 2; k++) {
        cudaFree(dr[k]);
        cudaFree(drs[k]);
        cudaFree(dc[k]);
        cudaFree(dcs[k]);
        cudaFree(dam[k]);
    }
    cudaFree(din);
    cudaFree(dout);
    free(h);
    fm_context_destroy(g);
    cudaStreamDestroy(s);
    return gt_finish(name);
}
