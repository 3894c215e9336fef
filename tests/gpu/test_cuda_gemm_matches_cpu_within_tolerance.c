/* CUDA GEMMs match the CPU reference within the DESIGN.md tolerance:
 * relative Frobenius error <= 5e-3 with BF16 output, <= 5e-4 with F32
 * output; every scale pair, BF16 and F32 operands in both layouts, COMPACT
 * and GEMM scale layouts, odd M and N, accumulate, m-grouped and k-grouped
 * forms with empty experts; NaN reaches the same outputs; and BLOCK_128x128 x
 * BLOCK_128x128 is refused with FM_ERR_UNSUPPORTED.
 * Every FP8 case runs twice, through cuBLASLt (cfg->impl LIBRARY) and through
 * the native sm_90a kernel (NATIVE), which must take exactly the products
 * gemm.h says it takes and refuse the others with a sentence. The native
 * kernel also gets its own shape classes: experts of 0, 1, 127, 128, 129 and
 * many rows, N and K off the 128 tile, one expert holding every row, more
 * experts than CTAs' tile tables hold on the host path, device-only split
 * sizes, split sizes that do not add up (nothing written past D, reported at
 * the next synchronize), and the
 * same bits run to run. The k-grouped weight gradient gets the same: both
 * implementations, the native kernel's refusals, and its own shape classes. */
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
static double unif(void) { return (double)(rnd() >> 11) * (1.0 / 9007199254740992.0); }

static int fp8(fm_dtype d) { return d == FM_DTYPE_E4M3 || d == FM_DTYPE_E5M2; }
static size_t esize(fm_dtype d) { return d == FM_DTYPE_F32 ? 4 : d == FM_DTYPE_BF16 ? 2 : 1; }

/* A host tensor with random finite contents and its device twin. */
typedef struct {
    fm_tensor h, d;
    size_t nd, ns;
} pairt;

static void fill(pairt *p, fm_tensor proto, size_t nscale)
{
    p->h = proto;
    p->nd = (size_t)fm_tensor_nbytes(&proto);
    p->ns = nscale;
    uint8_t *hd = malloc(p->nd + 1);
    for (size_t i = 0; i < p->nd; i += esize(proto.dtype)) {
        if (proto.dtype == FM_DTYPE_E4M3)
            hd[i] = (uint8_t)(rnd() % 0x7F) | (uint8_t)(rnd() & 0x80);
        else if (proto.dtype == FM_DTYPE_E5M2)
            hd[i] = (uint8_t)(rnd() % 0x7C) | (uint8_t)(rnd() & 0x80);
        else if (proto.dtype == FM_DTYPE_BF16) {
            float f = (float)((unif() * 2 - 1) * 4);
            uint32_t u;
            memcpy(&u, &f, 4);
            uint16_t b = (uint16_t)(u >> 16);
            memcpy(hd + i, &b, 2);
        } else {
            float f = (float)((unif() * 2 - 1) * 4);
            memcpy(hd + i, &f, 4);
        }
    }
    float *hs = NULL;
    if (nscale) {
        hs = malloc(nscale * 4);
        for (size_t i = 0; i < nscale; i++)
            hs[i] = ldexpf((float)(0.5 + unif()), (int)(rnd() % 17) - 8);
    }
    p->h.data = hd;
    p->h.scale = hs;
    p->d = p->h;
    p->d.device = FM_DEVICE_CUDA;
    void *dd = NULL, *ds = NULL;
    GT_CUDA(cudaMalloc(&dd, p->nd + 1));
    GT_CUDA(cudaMemcpy(dd, hd, p->nd, cudaMemcpyHostToDevice));
    if (nscale) {
        GT_CUDA(cudaMalloc(&ds, nscale * 4));
        GT_CUDA(cudaMemcpy(ds, hs, nscale * 4, cudaMemcpyHostToDevice));
    }
    p->d.data = dd;
    p->d.scale = ds;
}

static void upload(pairt *p)
{
    GT_CUDA(cudaMemcpy(p->d.data, p->h.data, p->nd, cudaMemcpyHostToDevice));
    if (p->ns)
        GT_CUDA(cudaMemcpy(p->d.scale, p->h.scale, p->ns * 4, cudaMemcpyHostToDevice));
}

static void drop(pairt *p)
{
    free(p->h.data);
    free(p->h.scale);
    cudaFree(p->d.data);
    if (p->d.scale)
        cudaFree(p->d.scale);
}

static double val(const void *p, fm_dtype t, size_t i)
{
    if (t == FM_DTYPE_BF16) {
        uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return ((const float *)p)[i];
}

/* Compares the device output with the host one: tolerance and NaN sets. */
static void compare(const pairt *out, const char *what)
{
    uint8_t *g = malloc(out->nd + 1);
    GT_CUDA(cudaMemcpy(g, out->d.data, out->nd, cudaMemcpyDeviceToHost));
    size_t n = out->nd / esize(out->h.dtype), nan_diff = 0;
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double r = val(out->h.data, out->h.dtype, i), x = val(g, out->h.dtype, i);
        if (isnan(r) || isnan(x)) {
            nan_diff += isnan(r) != isnan(x);
            continue;
        }
        num += (x - r) * (x - r);
        den += r * r;
    }
    double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    double tol = out->h.dtype == FM_DTYPE_BF16 ? 5e-3 : 5e-4;
    GT_CHECK(rel <= tol && nan_diff == 0, "%s: relative Frobenius error %.3g (tolerance %.0e), %zu NaN mismatches",
             what, rel, tol, nan_diff);
    free(g);
}

static pairt out_pair(fm_dtype dt, int ndim, int64_t e, int64_t r, int64_t c)
{
    pairt o;
    fm_tensor t = ndim == 3 ? fm_tensor_3d(NULL, dt, e, r, c) : fm_tensor_2d(NULL, dt, r, c);
    fill(&o, t, 0);
    return o;
}

static fm_tensor operand(fm_dtype dt, fm_scale_mode m, fm_scale_layout sl, fm_layout lay, int ndim, int64_t e,
                         int64_t r, int64_t c)
{
    fm_tensor t = ndim == 3 ? fm_tensor_3d(NULL, dt, e, r, c) : fm_tensor_2d(NULL, dt, r, c);
    t.layout = lay;
    t.scale_mode = m;
    t.scale_dtype = FM_DTYPE_F32;
    t.scale_layout = sl;
    return t;
}

typedef struct {
    fm_dtype a, b;
    fm_scale_mode ma, mb;
} pair_t;

static const pair_t pairs[] = {
    {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_SCALE_TENSOR},
    {FM_DTYPE_E4M3, FM_DTYPE_E5M2, FM_SCALE_ROW, FM_SCALE_ROW},
    {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128},
    {FM_DTYPE_E5M2, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_1x128},
    {FM_DTYPE_BF16, FM_DTYPE_BF16, FM_SCALE_NONE, FM_SCALE_NONE},
    {FM_DTYPE_F32, FM_DTYPE_F32, FM_SCALE_NONE, FM_SCALE_NONE},
};

/* cuBLASLt has FP8 kernels on Hopper only for some shapes (N a multiple of
 * 8, K of 128 with block scales, ...). The CUDA backend then answers
 * FM_ERR_UNSUPPORTED naming cuBLASLt: counted as skipped, never for shapes
 * whose dimensions and groups are all multiples of 128. */
static int gt_skipped;

static int aligned128(int64_t a, int64_t b, int64_t c, int64_t E, const int64_t *splits)
{
    int ok = a % 128 == 0 && b % 128 == 0 && c % 128 == 0;
    for (int64_t e = 0; splits && e < E; e++)
        ok = ok && splits[e] % 128 == 0;
    return ok;
}

/* The implementation the FP8 cases ask for (AUTO for the others). */
static fm_gemm_impl impl = FM_GEMM_IMPL_AUTO;
static int native_runs, native_refusals;
static const char *impl_name(void) { return impl == FM_GEMM_IMPL_NATIVE ? " [native]" : impl ? " [cuBLASLt]" : ""; }

/* gemm.h's list of what the native kernel takes (the GPU is a 9.0 one). */
static int native_takes(fm_dtype a, fm_dtype b, fm_scale_mode ma, fm_scale_mode mb, int64_t K, fm_dtype out)
{
    int pair = (ma == FM_SCALE_TENSOR && mb == FM_SCALE_TENSOR) ||
               (ma == FM_SCALE_BLOCK_1x128 && mb == FM_SCALE_BLOCK_128x128);
    return fp8(a) && fp8(b) && pair && K % 16 == 0 && (out == FM_DTYPE_BF16 || out == FM_DTYPE_F32);
}

static int refused_by_cublaslt(fm_status sc, fm_status sg, fm_context *gpu, int aligned)
{
    if (sc == FM_OK && sg == FM_ERR_UNSUPPORTED && strstr(fm_last_error(gpu), "cuBLASLt") && !aligned) {
        gt_skipped++;
        return 1;
    }
    return 0;
}

/* With NATIVE asked: the kernel ran where gemm.h says it takes the product,
 * and refused with a sentence naming it everywhere else (returns 1: no
 * output to compare). */
static int native_refused(fm_status sg, fm_context *gpu, int takes, const char *what)
{
    if (impl != FM_GEMM_IMPL_NATIVE)
        return 0;
    if (takes) {
        native_runs++;
        return 0;
    }
    GT_CHECK(sg == FM_ERR_UNSUPPORTED && strstr(fm_last_error(gpu), "native FP8 kernel"),
             "%s: NATIVE on a product the kernel does not take gave %s: %s", what, fm_status_name(sg),
             fm_last_error(gpu));
    native_refusals++;
    return 1;
}

static void dense(fm_context *cpu, fm_context *gpu, const pair_t *p, int64_t M, int64_t N, int64_t K, fm_dtype out,
                  int acc, int nan)
{
    fm_scale_layout sla = rnd() & 1 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
    fm_scale_layout slb = rnd() & 1 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
    fm_layout la = fp8(p->a) ? FM_LAYOUT_ROWWISE : (fm_layout)(rnd() & 1);
    fm_layout lb = fp8(p->b) ? FM_LAYOUT_ROWWISE : (fm_layout)(rnd() & 1);
    fm_tensor ta = operand(p->a, p->ma, sla, la, 2, 1, M, K), tb = operand(p->b, p->mb, slb, lb, 2, 1, N, K);
    pairt A, B, D = out_pair(out, 2, 1, M, N);
    fill(&A, ta, p->ma ? (size_t)fm_tensor_scale_count(&ta) : 0);
    fill(&B, tb, p->mb ? (size_t)fm_tensor_scale_count(&tb) : 0);
    if (nan && fp8(p->a)) {
        ((uint8_t *)A.h.data)[rnd() % A.nd] = p->a == FM_DTYPE_E4M3 ? 0x7F : 0x7E;
        upload(&A);
    }
    if (!acc)
        GT_CUDA(cudaMemset(D.d.data, 0xFF, D.nd));
    else
        GT_CUDA(cudaMemcpy(D.d.data, D.h.data, D.nd, cudaMemcpyHostToDevice));
    fm_gemm_config cfg = {.accumulate = acc, .impl = impl};
    char what[200];
    snprintf(what, sizeof what, "dense %s(%s, %s) x %s(%s, %s) M %lld N %lld K %lld -> %s%s%s%s", fm_dtype_name(p->a),
             fm_scale_mode_name(p->ma), fm_layout_name(la), fm_dtype_name(p->b), fm_scale_mode_name(p->mb),
             fm_layout_name(lb), (long long)M, (long long)N, (long long)K, fm_dtype_name(out),
             acc ? " accumulate" : "", nan ? " NaN" : "", impl_name());
    fm_status sc = fm_gemm(cpu, &cfg, &A.h, &B.h, &D.h);
    fm_status sg = fm_gemm(gpu, &cfg, &A.d, &B.d, &D.d);
    if (native_refused(sg, gpu, native_takes(p->a, p->b, p->ma, p->mb, K, out), what))
        sc = FM_ERR_UNSUPPORTED; /* nothing to compare */
    else if (!refused_by_cublaslt(sc, sg, gpu, aligned128(M, N, K, 0, NULL)))
    GT_CHECK(sc == FM_OK && sg == FM_OK, "%s: cpu %s, cuda %s: %s", what, fm_status_name(sc), fm_status_name(sg),
             fm_last_error(gpu));
    if (sc == FM_OK && sg == FM_OK) {
        GT_CUDA(cudaDeviceSynchronize());
        compare(&D, what);
    }
    drop(&A);
    drop(&B);
    drop(&D);
}

/* F32 with a side of at most 16 (gemm_f32_skinny.cu, the router's GEMMs):
 * the layouts that route there, odd sizes (no float4 path), NaN, and
 * accumulation; run twice, the bits must not move. */
static void skinny(fm_context *cpu, fm_context *gpu, int64_t M, int64_t N, int64_t K, fm_layout la, fm_layout lb,
                   int acc, int nan)
{
    pairt A, B, D = out_pair(FM_DTYPE_F32, 2, 1, M, N);
    fill(&A, operand(FM_DTYPE_F32, FM_SCALE_NONE, FM_SCALE_LAYOUT_COMPACT, la, 2, 1, M, K), 0);
    fill(&B, operand(FM_DTYPE_F32, FM_SCALE_NONE, FM_SCALE_LAYOUT_COMPACT, lb, 2, 1, N, K), 0);
    if (nan) {
        ((float *)A.h.data)[rnd() % (A.nd / 4)] = NAN;
        upload(&A);
    }
    GT_CUDA(acc ? cudaMemcpy(D.d.data, D.h.data, D.nd, cudaMemcpyHostToDevice) : cudaMemset(D.d.data, 0xFF, D.nd));
    fm_gemm_config cfg = {.accumulate = acc};
    char what[200];
    snprintf(what, sizeof what, "skinny F32 %s x %s M %lld N %lld K %lld%s%s", fm_layout_name(la), fm_layout_name(lb),
             (long long)M, (long long)N, (long long)K, acc ? " accumulate" : "", nan ? " NaN" : "");
    fm_status sc = fm_gemm(cpu, &cfg, &A.h, &B.h, &D.h), sg = fm_gemm(gpu, &cfg, &A.d, &B.d, &D.d);
    GT_CHECK(sc == FM_OK && sg == FM_OK, "%s: cpu %s, cuda %s: %s", what, fm_status_name(sc), fm_status_name(sg),
             fm_last_error(gpu));
    if (sc == FM_OK && sg == FM_OK) {
        GT_CUDA(cudaDeviceSynchronize());
        compare(&D, what);
        if (!acc) { /* the same call again: identical bits */
            uint8_t *g1 = malloc(D.nd), *g2 = malloc(D.nd);
            GT_CUDA(cudaMemcpy(g1, D.d.data, D.nd, cudaMemcpyDeviceToHost));
            GT_CHECK(fm_gemm(gpu, &cfg, &A.d, &B.d, &D.d) == FM_OK, "%s: second call", what);
            GT_CUDA(cudaMemcpy(g2, D.d.data, D.nd, cudaMemcpyDeviceToHost));
            GT_CHECK(!memcmp(g1, g2, D.nd), "%s: a second run gave other bits", what);
            free(g1);
            free(g2);
        }
    }
    drop(&A);
    drop(&B);
    drop(&D);
}

/* Where the split sizes live for the GPU call. */
enum { SPLITS_HOST, SPLITS_BOTH, SPLITS_DEVICE };

static void grouped_run(fm_context *cpu, fm_context *gpu, const pair_t *p, int64_t E, const int64_t *splits,
                        int64_t N, int64_t K, fm_dtype out, int where, int acc, int nan)
{
    int64_t S = 0;
    for (int64_t e = 0; e < E; e++)
        S += splits[e];
    fm_scale_layout sl = rnd() & 1 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
    fm_tensor ta = operand(p->a, p->ma, sl, FM_LAYOUT_ROWWISE, 2, 1, S, K);
    fm_tensor tb = operand(p->b, p->mb, sl, FM_LAYOUT_ROWWISE, 3, E, N, K);
    pairt A, B, D = out_pair(out, 2, 1, S, N);
    fill(&A, ta, p->ma ? (size_t)fm_tensor_scale_count(&ta) : 0);
    fill(&B, tb, p->mb ? (size_t)fm_tensor_scale_count(&tb) : 0);
    if (nan && fp8(p->a) && A.nd) {
        ((uint8_t *)A.h.data)[rnd() % A.nd] = p->a == FM_DTYPE_E4M3 ? 0x7F : 0x7E;
        upload(&A);
    }
    if (acc)
        GT_CUDA(cudaMemcpy(D.d.data, D.h.data, D.nd, cudaMemcpyHostToDevice));
    else
        GT_CUDA(cudaMemset(D.d.data, 0xFF, D.nd));
    int64_t *dsp = NULL;
    if (where != SPLITS_HOST) {
        GT_CUDA(cudaMalloc((void **)&dsp, (size_t)E * 8));
        GT_CUDA(cudaMemcpy(dsp, splits, (size_t)E * 8, cudaMemcpyHostToDevice));
    }
    fm_splits sp = {.groups = E, .host = splits};
    fm_splits spg = {.groups = E, .host = where == SPLITS_DEVICE ? NULL : splits, .device = dsp};
    fm_gemm_config cfg = {.accumulate = acc, .impl = impl};
    char what[200];
    snprintf(what, sizeof what, "m-grouped %s(%s, %s) x %s(%s) E %lld sum M %lld N %lld K %lld -> %s%s%s%s%s",
             fm_dtype_name(p->a), fm_scale_mode_name(p->ma), fm_scale_layout_name(sl), fm_dtype_name(p->b),
             fm_scale_mode_name(p->mb), (long long)E, (long long)S, (long long)N, (long long)K, fm_dtype_name(out),
             acc ? " accumulate" : "", nan ? " NaN" : "",
             where == SPLITS_DEVICE ? " device-only splits" : where == SPLITS_BOTH ? " device splits" : "",
             impl_name());
    fm_status sc = fm_grouped_gemm(cpu, &cfg, &sp, &A.h, &B.h, &D.h);
    fm_status sg = fm_grouped_gemm(gpu, &cfg, &spg, &A.d, &B.d, &D.d);
    int takes = native_takes(p->a, p->b, p->ma, p->mb, K, out) && (where != SPLITS_HOST || E <= 64);
    if (native_refused(sg, gpu, takes, what))
        sc = FM_ERR_UNSUPPORTED;
    else if (!refused_by_cublaslt(sc, sg, gpu, aligned128(N, K, 0, E, splits)))
        GT_CHECK(sc == FM_OK && sg == FM_OK, "%s: cpu %s, cuda %s: %s", what, fm_status_name(sc),
                 fm_status_name(sg), fm_last_error(gpu));
    if (sc == FM_OK && sg == FM_OK) {
        GT_CUDA(cudaDeviceSynchronize());
        compare(&D, what);
        if (impl == FM_GEMM_IMPL_NATIVE && !acc) { /* run to run: the same bits */
            uint8_t *first = malloc(D.nd + 1), *again = malloc(D.nd + 1);
            GT_CUDA(cudaMemcpy(first, D.d.data, D.nd, cudaMemcpyDeviceToHost));
            GT_CUDA(cudaMemset(D.d.data, 0xFF, D.nd));
            GT_CHECK(fm_grouped_gemm(gpu, &cfg, &spg, &A.d, &B.d, &D.d) == FM_OK, "%s, again: %s", what,
                     fm_last_error(gpu));
            GT_CUDA(cudaMemcpy(again, D.d.data, D.nd, cudaMemcpyDeviceToHost));
            GT_CHECK(!memcmp(first, again, D.nd), "%s: a second run gave other bits", what);
            free(first);
            free(again);
        }
    }
    cudaFree(dsp);
    drop(&A);
    drop(&B);
    drop(&D);
}

static void grouped(fm_context *cpu, fm_context *gpu, const pair_t *p, int64_t E, const int64_t *splits, int64_t N,
                    int64_t K, fm_dtype out)
{
    grouped_run(cpu, gpu, p, E, splits, N, K, out, SPLITS_HOST, 0, 0);
}

/* Device split sizes that do not add up: the native kernel must not write
 * past D (a canary after it stays), must still finish, and the next
 * synchronize reports the first fault in the host check's order, once. */
static void wrong_splits(fm_context *gpu)
{
    const int64_t S = 200, N = 128, K = 128, E = 3;
    static const struct {
        int64_t m[3];
        const char *says; /* NULL: sizes that add up */
    } cases[] = {
        {{150, -7, 190}, "splits->device[1]: -7 rows; sizes must be >= 0"},
        {{150, 60, 0}, "splits->device: the sizes sum past a's 200 rows (at group 1)"},
        {{50, 60, 70}, "splits->device: the sizes sum to 180 but a has 200 rows"},
        {{0, 200, 0}, NULL},
    };
    fm_tensor ta = operand(FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, FM_LAYOUT_ROWWISE, 2, 1, S, K);
    fm_tensor tb = operand(FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_SCALE_LAYOUT_COMPACT, FM_LAYOUT_ROWWISE, 3, E, N, K);
    pairt A, B;
    fill(&A, ta, (size_t)fm_tensor_scale_count(&ta));
    fill(&B, tb, (size_t)fm_tensor_scale_count(&tb));
    size_t nd = (size_t)(S * N * 2), canary = 1 << 16;
    uint8_t *dd = NULL, *h = malloc(canary);
    GT_CUDA(cudaMalloc((void **)&dd, nd + canary));
    int64_t *dsp = NULL;
    GT_CUDA(cudaMalloc((void **)&dsp, 3 * sizeof(int64_t)));
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        GT_CUDA(cudaMemset(dd, 0xA5, nd + canary));
        GT_CUDA(cudaMemcpy(dsp, cases[c].m, sizeof cases[c].m, cudaMemcpyHostToDevice));
        fm_tensor D = fm_tensor_2d(dd, FM_DTYPE_BF16, S, N);
        D.device = FM_DEVICE_CUDA;
        fm_splits sp = {.groups = E, .device = dsp};
        fm_gemm_config cfg = {.impl = FM_GEMM_IMPL_NATIVE};
        fm_status st = fm_grouped_gemm(gpu, &cfg, &sp, &A.d, &B.d, &D);
        GT_CHECK(st == FM_OK, "device splits case %zu: %s: %s", c, fm_status_name(st), fm_last_error(gpu));
        fm_status sy = fm_context_synchronize(gpu);
        if (cases[c].says)
            GT_CHECK(sy == FM_ERR_INVALID_ARG && !strcmp(fm_last_error(gpu), cases[c].says),
                     "device splits case %zu: synchronize gave %s '%s', expected '%s'", c, fm_status_name(sy),
                     fm_last_error(gpu), cases[c].says);
        else
            GT_CHECK(sy == FM_OK, "device splits case %zu (they add up): %s", c, fm_last_error(gpu));
        GT_CHECK(fm_context_synchronize(gpu) == FM_OK, "device splits case %zu reported twice: %s", c,
                 fm_last_error(gpu));
        GT_CUDA(cudaMemcpy(h, dd + nd, canary, cudaMemcpyDeviceToHost));
        size_t bad_bytes = 0;
        for (size_t i = 0; i < canary; i++)
            bad_bytes += h[i] != 0xA5;
        GT_CHECK(bad_bytes == 0, "device splits case %zu: %zu bytes written past D", c, bad_bytes);
    }
    free(h);
    cudaFree(dd);
    cudaFree(dsp);
    drop(&A);
    drop(&B);
}

/* The native kernel's own shape classes (FP8 pairs it takes only). */
static void native_shapes(fm_context *cpu, fm_context *gpu)
{
    static const pair_t np[] = {
        {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128},
        {FM_DTYPE_E4M3, FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128},
        {FM_DTYPE_E5M2, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128},
        {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_SCALE_TENSOR},
    };
    static const int64_t classes[] = {0, 1, 127, 128, 129, 1000, 0, 300};
    static int64_t one_hot[16], many[100];
    one_hot[5] = 2000;
    for (int e = 0; e < 100; e++)
        many[e] = (int64_t)(rnd() % 40) * (e % 3 != 0);
    impl = FM_GEMM_IMPL_NATIVE;
    for (size_t i = 0; i < sizeof np / sizeof np[0]; i++) {
        grouped_run(cpu, gpu, &np[i], 8, classes, 200, 336, FM_DTYPE_BF16, (int)(i % 3), 0, 0);
        grouped_run(cpu, gpu, &np[i], 8, classes, 131, 208, FM_DTYPE_F32, SPLITS_BOTH, 1, 0);
        grouped_run(cpu, gpu, &np[i], 8, classes, 256, 1040, FM_DTYPE_F32, SPLITS_HOST, 0, 1);
    }
    grouped_run(cpu, gpu, &np[0], 16, one_hot, 384, 512, FM_DTYPE_BF16, SPLITS_DEVICE, 0, 0);
    grouped_run(cpu, gpu, &np[0], 100, many, 96, 256, FM_DTYPE_BF16, SPLITS_BOTH, 0, 0);
    grouped_run(cpu, gpu, &np[0], 100, many, 96, 256, FM_DTYPE_BF16, SPLITS_HOST, 0, 0); /* refused: > 64 on host */
    /* Many tiles per CTA: the persistent loop and the stage ring wrap many times. */
    static const int64_t big[] = {5000, 3001, 0, 7999, 4000};
    grouped_run(cpu, gpu, &np[0], 5, big, 520, 768, FM_DTYPE_BF16, SPLITS_BOTH, 0, 0);
    for (size_t i = 0; i < sizeof np / sizeof np[0]; i++) {
        dense(cpu, gpu, &np[i], 1, 131, 208, FM_DTYPE_BF16, 0, 0);
        dense(cpu, gpu, &np[i], 129, 200, 1024, FM_DTYPE_F32, 1, 0);
        dense(cpu, gpu, &np[i], 1000, 384, 336, FM_DTYPE_BF16, 0, 1);
    }
    wrong_splits(gpu);
    impl = FM_GEMM_IMPL_AUTO;
}

/* k-grouped: the grouped column-wise scale arrays, sized per expert. kind 0:
 * BF16; 1: FP8 x 1x128; 2: FP8 x 128x128 (one scale a tile of each expert);
 * 3: E5M2 dy x E4M3 x 128x128. With NATIVE, the kernel must take exactly
 * the 128x128 kinds with every M_i a multiple of 16 and dW's rows whole
 * 16-byte pieces. */
static void kgrouped(fm_context *cpu, fm_context *gpu, int kind, int64_t E, const int64_t *splits, int64_t N,
                     int64_t K, fm_dtype out, int acc)
{
    const int isfp8 = kind != 0;
    int takes = kind >= 2 && K * (int64_t)esize(out) % 16 == 0;
    for (int64_t e = 0; e < E; e++)
        takes = takes && splits[e] % 16 == 0;
    fm_scale_mode m = isfp8 ? FM_SCALE_BLOCK_1x128 : FM_SCALE_NONE;
    fm_scale_mode mx = kind >= 2 ? FM_SCALE_BLOCK_128x128 : m;
    int64_t S = 0, nsy = 0, nsx = 0;
    fm_scale_layout sl = rnd() & 1 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
    for (int64_t e = 0; e < E; e++) {
        S += splits[e];
        nsy += fm_scale_count_2d(FM_SCALE_BLOCK_1x128, sl, N, splits[e]);
        nsx += fm_scale_count_2d(isfp8 ? mx : FM_SCALE_BLOCK_1x128, sl, K, splits[e]);
    }
    fm_dtype dt = isfp8 ? FM_DTYPE_E4M3 : FM_DTYPE_BF16;
    fm_layout lay = isfp8 || (rnd() & 1) ? FM_LAYOUT_COLWISE : FM_LAYOUT_ROWWISE;
    pairt Y, X, D = out_pair(out, 3, E, N, K);
    fill(&Y, operand(kind == 3 ? FM_DTYPE_E5M2 : dt, m, sl, lay, 2, 1, S, N), isfp8 ? (size_t)nsy : 0);
    fill(&X, operand(dt, mx, sl, lay, 2, 1, S, K), isfp8 ? (size_t)nsx : 0);
    if (acc)
        GT_CUDA(cudaMemcpy(D.d.data, D.h.data, D.nd, cudaMemcpyHostToDevice));
    else /* NaN everywhere: an output left unwritten shows */
        GT_CUDA(cudaMemset(D.d.data, 0xFF, D.nd));
    fm_splits sp = {.groups = E, .host = splits};
    fm_gemm_config cfg = {.accumulate = acc, .impl = isfp8 ? impl : FM_GEMM_IMPL_AUTO};
    char what[200];
    snprintf(what, sizeof what, "k-grouped %s %s (x %s) E %lld sum M %lld N %lld K %lld -> %s%s%s",
             fm_dtype_name(Y.h.dtype), fm_layout_name(lay), fm_scale_mode_name(mx), (long long)E, (long long)S,
             (long long)N, (long long)K, fm_dtype_name(out), acc ? " accumulate" : "", isfp8 ? impl_name() : "");
    fm_status sc = fm_grouped_gemm_wgrad(cpu, &cfg, &sp, &Y.h, &X.h, &D.h);
    fm_status sg = fm_grouped_gemm_wgrad(gpu, &cfg, &sp, &Y.d, &X.d, &D.d);
    if (isfp8 && native_refused(sg, gpu, takes, what))
        sc = sg = FM_ERR_UNSUPPORTED; /* checked there: nothing to compare */
    else if (!refused_by_cublaslt(sc, sg, gpu, aligned128(N, K, 0, E, splits)))
    GT_CHECK(sc == FM_OK && sg == FM_OK, "%s: cpu %s, cuda %s: %s", what, fm_status_name(sc), fm_status_name(sg),
             fm_last_error(gpu));
    if (sc == FM_OK && sg == FM_OK) {
        GT_CUDA(cudaDeviceSynchronize());
        compare(&D, what);
        if (impl == FM_GEMM_IMPL_NATIVE && !acc) { /* run to run: the same bits */
            uint8_t *first = malloc(D.nd + 1), *again = malloc(D.nd + 1);
            GT_CUDA(cudaMemcpy(first, D.d.data, D.nd, cudaMemcpyDeviceToHost));
            GT_CUDA(cudaMemset(D.d.data, 0xFF, D.nd));
            sg = fm_grouped_gemm_wgrad(gpu, &cfg, &sp, &Y.d, &X.d, &D.d);
            GT_CUDA(cudaMemcpy(again, D.d.data, D.nd, cudaMemcpyDeviceToHost));
            GT_CHECK(sg == FM_OK && memcmp(first, again, D.nd) == 0, "%s: a second run gave other bits (%s)", what,
                     fm_status_name(sg));
            free(first);
            free(again);
        }
    }
    drop(&Y);
    drop(&X);
    drop(&D);
}

/* The native k-grouped kernel's own shape classes: experts of 0, 16, 112,
 * 128, 144 and 1040 rows, N and K off every tile shape, a single row of
 * dW, more experts than one launch takes (64), and enough K blocks to wrap
 * the stage ring many times. */
static void native_kgrouped(fm_context *cpu, fm_context *gpu)
{
    static const int64_t classes[] = {0, 16, 112, 128, 144, 1040, 0, 256};
    static const int64_t big[] = {4096, 0, 2064};
    static int64_t many[70];
    for (int e = 0; e < 70; e++)
        many[e] = (int64_t)(rnd() % 6) * 16 * (e % 4 != 0);
    impl = FM_GEMM_IMPL_NATIVE;
    for (int kind = 2; kind <= 3; kind++) {
        kgrouped(cpu, gpu, kind, 8, classes, 200, 328, FM_DTYPE_F32, 1);
        kgrouped(cpu, gpu, kind, 8, classes, 200, 328, FM_DTYPE_F32, 0);
        kgrouped(cpu, gpu, kind, 8, classes, 200, 328, FM_DTYPE_BF16, 0);
    }
    kgrouped(cpu, gpu, 2, 8, classes, 1, 64, FM_DTYPE_F32, 1);
    kgrouped(cpu, gpu, 2, 8, classes, 5, 8, FM_DTYPE_BF16, 0);
    kgrouped(cpu, gpu, 2, 70, many, 96, 136, FM_DTYPE_F32, 1);
    kgrouped(cpu, gpu, 2, 70, many, 96, 136, FM_DTYPE_BF16, 0);
    kgrouped(cpu, gpu, 2, 3, big, 520, 776, FM_DTYPE_F32, 1);
    kgrouped(cpu, gpu, 2, 8, classes, 200, 330, FM_DTYPE_F32, 1); /* refused: dW's rows of 1320 bytes */
    kgrouped(cpu, gpu, 1, 8, classes, 200, 328, FM_DTYPE_F32, 1); /* refused: x 1x128 */
    static const int64_t odd[] = {16, 40, 0, 8};
    kgrouped(cpu, gpu, 2, 4, odd, 64, 128, FM_DTYPE_F32, 1); /* refused: M_i 40 */
    impl = FM_GEMM_IMPL_AUTO;
}

int main(void)
{
    fm_context *gpu = gt_cuda_context("test_cuda_gemm_matches_cpu_within_tolerance");
    fm_context *cpu = gt_cpu_context();
    static const int64_t shapes[][3] = {{1, 16, 128}, {37, 19, 256}, {130, 257, 384}, {64, 64, 4096}, {7, 200, 48}};
    static const int64_t sp1[] = {64, 0, 130, 1, 0, 33, 200, 16}, sp2[] = {0, 0, 257, 0};
    static const int64_t kp1[] = {128, 0, 256, 16, 0, 48, 512, 32}, kp2[] = {0, 384, 0, 0};
    static const int64_t sp128[] = {128, 0, 256, 128};
    static const fm_gemm_impl impls[] = {FM_GEMM_IMPL_LIBRARY, FM_GEMM_IMPL_NATIVE, FM_GEMM_IMPL_AUTO};
    for (int i = 0; i < 3; i++) {
        impl = impls[i];
        for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++) {
            if (impl != FM_GEMM_IMPL_AUTO && !fp8(pairs[p].a))
                continue;
            for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
                dense(cpu, gpu, &pairs[p], shapes[s][0], shapes[s][1], shapes[s][2], FM_DTYPE_BF16, 0, 0);
                dense(cpu, gpu, &pairs[p], shapes[s][0], shapes[s][1], shapes[s][2], FM_DTYPE_F32, 1, 0);
                dense(cpu, gpu, &pairs[p], shapes[s][0], shapes[s][1], shapes[s][2], FM_DTYPE_F32, 0, 1);
            }
            grouped(cpu, gpu, &pairs[p], 8, sp1, 96, 256, FM_DTYPE_BF16);
            grouped(cpu, gpu, &pairs[p], 4, sp2, 40, 384, FM_DTYPE_F32);
            grouped(cpu, gpu, &pairs[p], 4, sp128, 256, 256, FM_DTYPE_BF16);
        }
    }
    impl = FM_GEMM_IMPL_AUTO;
    /* unscaled operands take any K */
    dense(cpu, gpu, &pairs[4], 33, 17, 100, FM_DTYPE_BF16, 0, 0);
    dense(cpu, gpu, &pairs[5], 5, 3, 7, FM_DTYPE_F32, 1, 0);
    native_shapes(cpu, gpu);
    /* small N: A, B with K contiguous (the router's logits, T 4096 x E 8 over H 7168) */
    skinny(cpu, gpu, 4096, 8, 7168, FM_LAYOUT_ROWWISE, FM_LAYOUT_ROWWISE, 0, 0);
    skinny(cpu, gpu, 37, 13, 1001, FM_LAYOUT_ROWWISE, FM_LAYOUT_ROWWISE, 1, 0);
    skinny(cpu, gpu, 300, 1, 2048, FM_LAYOUT_ROWWISE, FM_LAYOUT_ROWWISE, 0, 1);
    skinny(cpu, gpu, 1, 16, 3, FM_LAYOUT_ROWWISE, FM_LAYOUT_ROWWISE, 1, 0);
    /* small M: B with N contiguous (the router's weight gradient, E 8 x H 7168 over T 4096) */
    skinny(cpu, gpu, 8, 7168, 4096, FM_LAYOUT_COLWISE, FM_LAYOUT_COLWISE, 1, 0);
    skinny(cpu, gpu, 16, 1000, 777, FM_LAYOUT_ROWWISE, FM_LAYOUT_COLWISE, 0, 1);
    skinny(cpu, gpu, 3, 33, 5000, FM_LAYOUT_COLWISE, FM_LAYOUT_COLWISE, 0, 0);
    skinny(cpu, gpu, 9, 1, 1, FM_LAYOUT_ROWWISE, FM_LAYOUT_COLWISE, 1, 0);
    GT_CHECK(native_runs > 0 && native_refusals > 0, "native kernel: %d runs, %d refusals (both expected)",
             native_runs, native_refusals);
    for (int i = 0; i < 3; i++) {
        impl = impls[i];
        for (int f = 0; f < 4; f++) {
            if (impl != FM_GEMM_IMPL_AUTO && f == 0)
                continue;
            kgrouped(cpu, gpu, f, 8, kp1, 64, 96, FM_DTYPE_F32, 1);
            kgrouped(cpu, gpu, f, 4, kp2, 33, 130, FM_DTYPE_BF16, 0);
            kgrouped(cpu, gpu, f, 4, sp128, 128, 256, FM_DTYPE_F32, 1);
        }
    }
    impl = FM_GEMM_IMPL_AUTO;
    native_kgrouped(cpu, gpu);

    /* cuBLASLt has no BLK128x128 x BLK128x128. */
    fm_tensor ta = operand(FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_SCALE_LAYOUT_GEMM, FM_LAYOUT_ROWWISE, 2, 1, 128, 128);
    pairt A, B, D = out_pair(FM_DTYPE_BF16, 2, 1, 128, 128);
    fill(&A, ta, (size_t)fm_tensor_scale_count(&ta));
    fill(&B, ta, (size_t)fm_tensor_scale_count(&ta));
    fm_status st = fm_gemm(gpu, NULL, &A.d, &B.d, &D.d);
    GT_CHECK(st == FM_ERR_UNSUPPORTED && strstr(fm_last_error(gpu), "BLOCK_128x128 x BLOCK_128x128"),
             "128x128 x 128x128: %s: %s", fm_status_name(st), fm_last_error(gpu));
    drop(&A);
    drop(&B);
    drop(&D);

    fm_context_destroy(cpu);
    fm_context_destroy(gpu);
    printf("test_cuda_gemm_matches_cpu_within_tolerance: %d failures, %d cases skipped (no cuBLASLt kernel for the "
           "shape), native kernel: %d products run, %d refused as gemm.h says\n",
           gt_failures, gt_skipped, native_runs, native_refusals);
    return gt_failures ? 1 : 0;
}
