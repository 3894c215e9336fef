/* CUDA quantize and dequantize produce the CPU reference's bytes: codes,
 * scales, amax, non-finite count, dequantized values (every mode and element
 * dtype, row-wise and column-wise in one call, partial blocks, several
 * experts, NaN and Inf blocks). fm-xval runs the full matrix; this is the
 * short form every GPU test run includes. The `wide` shapes have more 128 x 128
 * tiles than the GPU holds CTAs at once (a CTA a tile: later tiles run on CTAs
 * launched as others end), whole and partial ones mixed, from every input
 * dtype; there each output alone (the one-output kernels) must match too.
 * BF16 shapes 32 and more tiles wide quantized into both outputs at once
 * store compact 1x128 and MX32 scales tile-major, then scatter them
 * (quantize.cu): over several experts, partial tiles ([3, 700, 4100]: 1x128
 * only, MX32 needs whole tiles for it) and more than 32 tile rows
 * ([1, 4224, 4096]). With two waves of tiles and more, the tile kernel runs
 * as two chunks of groups of 32 tile rows, the second moving the first's
 * scales: on an H100 (or H200) [1, 4224, 4096] splits its 33 tile rows 32 +
 * 1, so that the second chunk's 32 CTAs move the first's 256 units in four
 * rounds, and [3, 4100, 4100] (33 tile rows an expert, partial tiles both
 * ways) splits inside the second expert. */
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
        fm_dtype in;
        int wide;
    } shapes[] = {{1, 300, 520, FM_DTYPE_BF16, 0},   {3, 130, 256, FM_DTYPE_BF16, 0},
                  {1, 256, 7168, FM_DTYPE_BF16, 0},  {9, 1100, 1040, FM_DTYPE_BF16, 1},
                  {1, 8200, 2056, FM_DTYPE_F16, 1},  {1, 8200, 2056, FM_DTYPE_F32, 1},
                  {1, 4224, 4096, FM_DTYPE_BF16, 1}, {3, 700, 4100, FM_DTYPE_BF16, 1},
                  {3, 4100, 4100, FM_DTYPE_BF16, 1}};
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
                const fm_dtype it = shapes[si].in;
                const size_t eb = (size_t)fm_dtype_bits(it) / 8;
                void *hin = malloc((size_t)n * eb);
                for (int64_t i = 0; i < n; i++) {
                    /* F16's range is narrower: its inputs keep to it */
                    int sh = it == FM_DTYPE_F16 ? (int)(rnd() % 30) - 14 : (int)(rnd() % 40) - 20;
                    float v = (float)ldexp((double)(rnd() % 1000) / 500.0 - 1.0, sh);
                    if (it == FM_DTYPE_F32)
                        ((float *)hin)[i] = v;
                    else
                        ((uint16_t *)hin)[i] = it == FM_DTYPE_BF16 ? fm_bf16_from_f32(v) : fm_f16_from_f32(v);
                }
                for (int q = 0; q < 2; q++) { /* a NaN and a -Inf */
                    int64_t i = (int64_t)(rnd() % (uint64_t)n);
                    if (it == FM_DTYPE_F32)
                        ((float *)hin)[i] = q ? -INFINITY : NAN;
                    else if (it == FM_DTYPE_BF16)
                        ((uint16_t *)hin)[i] = q ? 0xFF80 : 0x7FC1;
                    else
                        ((uint16_t *)hin)[i] = q ? 0xFC00 : 0x7E01;
                }
                void *din;
                GT_CUDA(cudaMalloc(&din, (size_t)n * eb));
                GT_CUDA(cudaMemcpy(din, hin, (size_t)n * eb, cudaMemcpyHostToDevice));
                fm_tensor proto = shapes[si].E > 1 ? fm_tensor_3d(NULL, it, shapes[si].E, shapes[si].R, shapes[si].C)
                                                   : fm_tensor_2d(NULL, it, shapes[si].R, shapes[si].C);
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
                snprintf(cs, sizeof cs, "[%lld,%lld,%lld] %s -> %s %s %s", (long long)shapes[si].E,
                         (long long)shapes[si].R, (long long)shapes[si].C, fm_dtype_name(it),
                         fm_dtype_name(cfgs[ci].el), fm_scale_mode_name(cfgs[ci].m), fm_scale_layout_name(L));
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
                if (shapes[si].wide) {
                    /* each output alone, into poisoned buffers */
                    fm_quant_config q0 = {0};
                    for (int which = 0; which < 2; which++) {
                        side *sd = which ? &col : &r;
                        fm_tensor one = on(sd, 1);
                        GT_CUDA(cudaMemset(sd->dd, 0xA5, sd->nd));
                        GT_CUDA(cudaMemset(sd->ds, 0xA5, sd->ns));
                        b = fm_quantize(g, &q0, &id, which ? NULL : &one, which ? &one : NULL);
                        GT_CHECK(b == FM_OK, "%s: %s output alone: %s", cs, which ? "column-wise" : "row-wise",
                                 fm_last_error(g));
                        GT_CUDA(cudaDeviceSynchronize());
                        same_dev(sd->hd, sd->dd, sd->nd, which ? "column-wise codes alone" : "row-wise codes alone",
                                 cs);
                        same_dev(sd->hs, sd->ds, sd->ns, which ? "column-wise scales alone" : "row-wise scales alone",
                                 cs);
                    }
                }

                /* Dequantize both ways (column-wise input, row-wise BF16 out). */
                void *hout = malloc((size_t)n * eb), *dout;
                GT_CUDA(cudaMalloc(&dout, (size_t)n * eb));
                fm_tensor oh = proto, od = proto;
                oh.data = hout;
                od.data = dout;
                od.device = FM_DEVICE_CUDA;
                a = fm_dequantize(c, &ch, &oh);
                b = fm_dequantize(g, &cd, &od);
                GT_CHECK(a == FM_OK && b == FM_OK, "%s: dequantize: %s", cs, fm_last_error(g));
                GT_CUDA(cudaDeviceSynchronize());
                same_dev(hout, dout, (size_t)n * eb, "dequantized (transposed)", cs);
                a = fm_dequantize(c, &rh, &oh);
                b = fm_dequantize(g, &rd, &od);
                GT_CUDA(cudaDeviceSynchronize());
                same_dev(hout, dout, (size_t)n * eb, "dequantized", cs);
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
