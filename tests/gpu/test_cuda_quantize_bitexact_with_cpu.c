/* CUDA quantize and dequantize produce the CPU reference's bytes: codes,
 * scales, amax, non-finite count, dequantized values (every mode and element
 * dtype, row-wise and column-wise in one call, partial blocks, several
 * experts, NaN and Inf blocks). fm-xval runs the full matrix; this is the
 * short form every GPU test run includes. */
#include <math.h>
#include <stdint.h>

#include "gpu_test.h"

static uint64_t rng = 12345;
static uint64_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static int same_dev(const void *h, const void *d, size_t n, const char *what, const char *cs)
{
    unsigned char *g = malloc(n ? n : 1);
    GT_CUDA(cudaMemcpy(g, d, n, cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += ((const unsigned char *)h)[i] != g[i];
    free(g);
    GT_CHECK(bad == 0, "%s: %s: %zu of %zu bytes differ", cs, what, bad, n);
    return bad == 0;
}

typedef struct side {
    fm_tensor t;
    void *hd, *hs, *dd, *ds;
    size_t nd, ns;
} side;

static void side_make(side *s, fm_tensor proto, fm_layout lay, fm_dtype el, fm_scale_mode m, fm_scale_layout sl)
{
    s->t = proto;
    s->t.dtype = el;
    s->t.layout = lay;
    s->t.scale_mode = m;
    s->t.scale_dtype = fm_scale_mode_dtype(m);
    s->t.scale_layout = sl;
    s->nd = (size_t)fm_tensor_nbytes(&s->t);
    s->ns = (size_t)fm_tensor_scale_nbytes(&s->t);
    s->hd = malloc(s->nd + 1);
    s->hs = malloc(s->ns + 1);
    memset(s->hd, 0x5A, s->nd);
    memset(s->hs, 0x5A, s->ns);
    GT_CUDA(cudaMalloc(&s->dd, s->nd + 1));
    GT_CUDA(cudaMalloc(&s->ds, s->ns + 1));
    GT_CUDA(cudaMemset(s->dd, 0xA5, s->nd));
    GT_CUDA(cudaMemset(s->ds, 0xA5, s->ns));
}

static void side_free(side *s)
{
    free(s->hd);
    free(s->hs);
    cudaFree(s->dd);
    cudaFree(s->ds);
}

static fm_tensor on(const side *s, int dev)
{
    fm_tensor t = s->t;
    t.device = dev ? FM_DEVICE_CUDA : FM_DEVICE_HOST;
    t.data = dev ? s->dd : s->hd;
    t.scale = dev ? s->ds : s->hs;
    return t;
}

int main(void)
{
    const char *name = "test_cuda_quantize_bitexact_with_cpu";
    fm_context *g = gt_cuda_context(name), *c = gt_cpu_context();
    struct {
        int64_t E, R, C;
    } shapes[] = {{1, 300, 520}, {3, 130, 256}, {1, 256, 7168}};
    struct {
        fm_dtype el;
        fm_scale_mode m;
    } cfgs[] = {{FM_DTYPE_E4M3, FM_SCALE_TENSOR},        {FM_DTYPE_E5M2, FM_SCALE_ROW},
                {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},   {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128},
                {FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128}, {FM_DTYPE_E4M3, FM_SCALE_MX32},
                {FM_DTYPE_E5M2, FM_SCALE_MX32},          {FM_DTYPE_E2M1, FM_SCALE_MX32}};
    int cases = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (size_t ci = 0; ci < sizeof cfgs / sizeof cfgs[0]; ci++)
            for (int sl = 0; sl < 2; sl++) {
                int64_t n = shapes[si].E * shapes[si].R * shapes[si].C;
                uint16_t *hin = malloc((size_t)n * 2);
                for (int64_t i = 0; i < n; i++) {
                    double v = ldexp((double)(rnd() % 1000) / 500.0 - 1.0, (int)(rnd() % 40) - 20);
                    hin[i] = fm_bf16_from_f32((float)v);
                }
                hin[rnd() % n] = 0x7FC1;  /* a NaN */
                hin[rnd() % n] = 0xFF80;  /* -Inf */
                void *din;
                GT_CUDA(cudaMalloc(&din, (size_t)n * 2));
                GT_CUDA(cudaMemcpy(din, hin, (size_t)n * 2, cudaMemcpyHostToDevice));
                fm_tensor proto = shapes[si].E > 1 ? fm_tensor_3d(NULL, FM_DTYPE_BF16, shapes[si].E, shapes[si].R, shapes[si].C)
                                                   : fm_tensor_2d(NULL, FM_DTYPE_BF16, shapes[si].R, shapes[si].C);
                fm_tensor ih = proto, id = proto;
                ih.data = hin;
                id.data = din;
                id.device = FM_DEVICE_CUDA;
                side r, col;
                fm_scale_layout L = sl ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
                side_make(&r, proto, FM_LAYOUT_ROWWISE, cfgs[ci].el, cfgs[ci].m, L);
                side_make(&col, proto, FM_LAYOUT_COLWISE, cfgs[ci].el, cfgs[ci].m, L);
                float hamax = -1, *damax;
                int64_t hnf = -1, *dnf;
                GT_CUDA(cudaMalloc((void **)&damax, 4));
                GT_CUDA(cudaMalloc((void **)&dnf, 8));
                fm_quant_config qh = {.amax = &hamax, .nonfinite_blocks = &hnf};
                fm_quant_config qd = {.amax = damax, .nonfinite_blocks = dnf};
                fm_tensor rh = on(&r, 0), ch = on(&col, 0), rd = on(&r, 1), cd = on(&col, 1);
                char cs[160];
                snprintf(cs, sizeof cs, "[%lld,%lld,%lld] %s %s %s", (long long)shapes[si].E, (long long)shapes[si].R,
                         (long long)shapes[si].C, fm_dtype_name(cfgs[ci].el), fm_scale_mode_name(cfgs[ci].m),
                         fm_scale_layout_name(L));
                fm_status a = fm_quantize(c, &qh, &ih, &rh, &ch), b = fm_quantize(g, &qd, &id, &rd, &cd);
                GT_CHECK(a == FM_OK && b == FM_OK, "%s: quantize cpu %s gpu %s (%s)", cs, fm_last_error(c),
                         fm_last_error(g), fm_status_name(b));
                GT_CUDA(cudaDeviceSynchronize());
                same_dev(r.hd, r.dd, r.nd, "row-wise codes", cs);
                same_dev(r.hs, r.ds, r.ns, "row-wise scales", cs);
                same_dev(col.hd, col.dd, col.nd, "column-wise codes", cs);
                same_dev(col.hs, col.ds, col.ns, "column-wise scales", cs);
                same_dev(&hamax, damax, 4, "amax", cs);
                same_dev(&hnf, dnf, 8, "nonfinite_blocks", cs);
                GT_CHECK(hnf >= 2, "%s: the NaN and the Inf should make at least 2 non-finite blocks, got %lld", cs,
                         (long long)hnf);

                /* Dequantize both ways (column-wise input, row-wise BF16 out). */
                void *hout = malloc((size_t)n * 2), *dout;
                GT_CUDA(cudaMalloc(&dout, (size_t)n * 2));
                fm_tensor oh = proto, od = proto;
                oh.data = hout;
                od.data = dout;
                od.device = FM_DEVICE_CUDA;
                a = fm_dequantize(c, &ch, &oh);
                b = fm_dequantize(g, &cd, &od);
                GT_CHECK(a == FM_OK && b == FM_OK, "%s: dequantize: %s", cs, fm_last_error(g));
                GT_CUDA(cudaDeviceSynchronize());
                same_dev(hout, dout, (size_t)n * 2, "dequantized (transposed)", cs);
                a = fm_dequantize(c, &rh, &oh);
                b = fm_dequantize(g, &rd, &od);
                GT_CUDA(cudaDeviceSynchronize());
                same_dev(hout, dout, (size_t)n * 2, "dequantized", cs);
                free(hout);
                cudaFree(dout);
                side_free(&r);
                side_free(&col);
                cudaFree(damax);
                cudaFree(dnf);
                cudaFree(din);
                free(hin);
                cases++;
            }
    printf("%d cases\n", cases);
    fm_context_destroy(c);
    fm_context_destroy(g);
    return gt_finish(name);
}
