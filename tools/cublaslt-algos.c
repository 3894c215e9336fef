/* How fast each of cuBLASLt's candidate algorithms runs a grouped product
 * the way the CUDA backend issues it (E equal experts round-robin over S
 * streams, fm_grouped_gemm's run_grouped): the heuristic's first answer is
 * what get_plan takes, and this shows whether a later one is faster for the
 * layer's shapes. Not built by meson (a diagnostic for a GPU machine):
 *   nvcc -O2 -o lt-algos tools/cublaslt-algos.c -lcublasLt && ./lt-algos
 * Arguments (cuBLASLt's names: D[m, n] = op(A) op(B), A our B operand):
 *   name m n k ta tb atype btype dtype amode bmode beta E S ws_mb
 * types: e4m3 e5m2 bf16 f32; modes: -1 (unscaled), cuBLASLt's scale-mode
 * numbers (0 SCALAR, 3 OUTER_VEC, 4 VEC128, 5 BLK128x128). Without
 * arguments it runs the fp8-flow layer step's six products (T 4096, H 7168,
 * I 2048, E 8, k 8) and their BF16 versions. */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)
#define LK(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cublasLtGetStatusName(s_)); exit(1); } } while (0)
#define MAXALGO 24
#define MAXS 8

static cublasLtHandle_t lt;
static int first_only; /* time the heuristic's first algorithm only */

static cudaDataType_t ty(const char *s)
{
    return !strcmp(s, "e4m3") ? CUDA_R_8F_E4M3 : !strcmp(s, "e5m2") ? CUDA_R_8F_E5M2 : !strcmp(s, "bf16") ? CUDA_R_16BF : CUDA_R_32F;
}
static size_t tsz(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : t == CUDA_R_16BF ? 2 : 1; }

static int cmpf(const void *a, const void *b) { float x = *(const float *)a, y = *(const float *)b; return (x > y) - (x < y); }

/* Fills with bytes that decode to finite values of every type used here. */
static void fill(void *p, size_t n, cudaDataType_t t)
{
    unsigned char *h = malloc(n);
    uint32_t s = 12345u;
    for (size_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        unsigned char b = (unsigned char)(s >> 24);
        if (t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2)
            b = (unsigned char)((b & 0x80) | (0x20 + (b & 0x1F))); /* moderate exponents, no NaN/Inf */
        else if ((t == CUDA_R_16BF && (i & 1)) || (t == CUDA_R_32F && (i & 3) == 3))
            b = (unsigned char)((b & 0x80) | 0x3C | (b & 1)); /* sign + exponent byte near 1.0 */
        h[i] = b;
    }
    CK(cudaMemcpy(p, h, n, cudaMemcpyHostToDevice));
    free(h);
}

static size_t scale_count(int mode, long rows, long cols_k)
{
    /* rows of the operand (not k) x k blocks; generous for every mode */
    if (mode < 0) return 0;
    if (mode == 0) return 1;
    if (mode == 3) return (size_t)rows;
    if (mode == 5) return (size_t)((rows + 127) / 128) * ((cols_k + 127) / 128) + 64;
    return (size_t)((rows + 3) / 4 * 4) * ((cols_k + 127) / 128 + 3) + 64;
}

static void run(const char *name, long m, long n, long k, int ta, int tb, const char *as, const char *bs, const char *ds,
                int amode, int bmode, int beta1, int E, int S, int ws_mb)
{
    cudaDataType_t at = ty(as), bt = ty(bs), dt = ty(ds);
    cublasLtMatmulDesc_t d;
    cublasLtMatrixLayout_t la, lb, ld;
    LK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    LK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
    LK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
    long ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
    LK(cublasLtMatrixLayoutCreate(&la, at, ar, ac, ar));
    LK(cublasLtMatrixLayoutCreate(&lb, bt, br, bc, br));
    LK(cublasLtMatrixLayoutCreate(&ld, dt, m, n, m));
    size_t abytes = (size_t)m * k * tsz(at), bbytes = (size_t)n * k * tsz(bt), dbytes = (size_t)m * n * tsz(dt);
    void *A[64], *B[64], *D[64];
    float *sa[64], *sb[64];
    size_t nsa = scale_count(amode, m, k), nsb = scale_count(bmode, n, k);
    float *ones = malloc((nsa > nsb ? nsa : nsb) * 4 + 4);
    for (size_t i = 0; i < (nsa > nsb ? nsa : nsb) + 1; i++) ones[i] = 1.0f;
    for (int e = 0; e < E; e++) {
        CK(cudaMalloc(&A[e], abytes)); fill(A[e], abytes, at);
        CK(cudaMalloc(&B[e], bbytes)); fill(B[e], bbytes, bt);
        CK(cudaMalloc(&D[e], dbytes)); CK(cudaMemset(D[e], 0, dbytes));
        sa[e] = sb[e] = NULL;
        if (amode >= 0) {
            CK(cudaMalloc((void **)&sa[e], nsa * 4)); CK(cudaMemcpy(sa[e], ones, nsa * 4, cudaMemcpyHostToDevice));
            CK(cudaMalloc((void **)&sb[e], nsb * 4)); CK(cudaMemcpy(sb[e], ones, nsb * 4, cudaMemcpyHostToDevice));
        }
    }
    free(ones);
    if (amode >= 0) {
        LK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &amode, sizeof amode));
        LK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bmode, sizeof bmode));
        LK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa[0], sizeof sa[0]));
        LK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb[0], sizeof sb[0]));
    }
    /* one descriptor per expert (scale pointers differ) */
    cublasLtMatmulDesc_t de[64];
    for (int e = 0; e < E; e++) {
        LK(cublasLtMatmulDescCreate(&de[e], CUBLAS_COMPUTE_32F, CUDA_R_32F));
        LK(cublasLtMatmulDescSetAttribute(de[e], CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
        LK(cublasLtMatmulDescSetAttribute(de[e], CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
        if (amode >= 0) {
            LK(cublasLtMatmulDescSetAttribute(de[e], CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &amode, sizeof amode));
            LK(cublasLtMatmulDescSetAttribute(de[e], CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bmode, sizeof bmode));
            LK(cublasLtMatmulDescSetAttribute(de[e], CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa[e], sizeof sa[e]));
            LK(cublasLtMatmulDescSetAttribute(de[e], CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb[e], sizeof sb[e]));
        }
    }
    cublasLtMatmulPreference_t p;
    LK(cublasLtMatmulPreferenceCreate(&p));
    uint64_t ws = (uint64_t)ws_mb << 20;
    LK(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    cublasLtMatmulHeuristicResult_t r[MAXALGO];
    int found = 0;
    LK(cublasLtMatmulAlgoGetHeuristic(lt, d, la, lb, ld, ld, p, MAXALGO, r, &found));
    void *wsp;
    CK(cudaMalloc(&wsp, (size_t)S * (ws ? ws : 256)));
    cudaStream_t main_s, side[MAXS];
    cudaEvent_t fork, join[MAXS], t0, t1;
    CK(cudaStreamCreateWithFlags(&main_s, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    for (int i = 0; i < S; i++) {
        CK(cudaStreamCreateWithFlags(&side[i], cudaStreamNonBlocking));
        CK(cudaEventCreateWithFlags(&join[i], cudaEventDisableTiming));
    }
    CK(cudaEventCreate(&t0));
    CK(cudaEventCreate(&t1));
    double flop = 2.0 * m * n * k * E;
    float alpha = 1.0f, beta = beta1 ? 1.0f : 0.0f;
    printf("## %s: m %ld n %ld k %ld op %c%c %s x %s -> %s modes %d x %d beta %d, E %d on %d streams, ws %d MB: %d algos\n",
           name, m, n, k, ta ? 'T' : 'N', tb ? 'T' : 'N', as, bs, ds, amode, bmode, beta1, E, S, ws_mb, found);
    for (int a = 0; a < (first_only ? 1 : found); a++) {
        if (r[a].state != CUBLAS_STATUS_SUCCESS) continue;
        int tile = 0, stages = 0, splitk = 0, swz = 0, red = 0, cust = 0, cl = 0;
        size_t w;
        cublasLtMatmulAlgoConfigGetAttribute(&r[a].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &w);
        cublasLtMatmulAlgoConfigGetAttribute(&r[a].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &w);
        cublasLtMatmulAlgoConfigGetAttribute(&r[a].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &w);
        cublasLtMatmulAlgoConfigGetAttribute(&r[a].algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof swz, &w);
        cublasLtMatmulAlgoConfigGetAttribute(&r[a].algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof red, &w);
        cublasLtMatmulAlgoConfigGetAttribute(&r[a].algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &cust, sizeof cust, &w);
        cublasLtMatmulAlgoConfigGetAttribute(&r[a].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cl, sizeof cl, &w);
        float ms[12];
        int bad = 0;
        for (int rep = -2; rep < 12 && !bad; rep++) {
            CK(cudaEventRecord(t0, main_s));
            CK(cudaEventRecord(fork, main_s));
            for (int i = 0; i < S; i++) CK(cudaStreamWaitEvent(side[i], fork, 0));
            for (int e = 0; e < E; e++) {
                int i = e % S;
                cublasStatus_t s = cublasLtMatmul(lt, de[e], &alpha, A[e], la, B[e], lb, &beta, D[e], ld, D[e], ld,
                                                  &r[a].algo, (char *)wsp + (size_t)i * ws, ws, side[i]);
                if (s != CUBLAS_STATUS_SUCCESS) { printf("  algo %d: %s\n", a, cublasLtGetStatusName(s)); bad = 1; break; }
            }
            for (int i = 0; i < S; i++) { CK(cudaEventRecord(join[i], side[i])); CK(cudaStreamWaitEvent(main_s, join[i], 0)); }
            CK(cudaEventRecord(t1, main_s));
            CK(cudaEventSynchronize(t1));
            if (rep >= 0) CK(cudaEventElapsedTime(&ms[rep], t0, t1));
        }
        if (bad) continue;
        qsort(ms, 12, sizeof ms[0], cmpf);
        printf("  algo %2d: tile %3d stages %3d splitk %2d red %d swz %d custom %2d cluster %2d ws %8zu  %8.1f us  %7.1f TFLOP/s%s\n",
               a, tile, stages, splitk, red, swz, cust, cl, r[a].workspaceSize, 1e3 * ms[6], flop / (ms[6] * 1e-3) / 1e12,
               a == 0 ? "  <- the heuristic's first" : "");
    }
    fflush(stdout);
    for (int e = 0; e < E; e++) {
        cudaFree(A[e]); cudaFree(B[e]); cudaFree(D[e]);
        if (sa[e]) { cudaFree(sa[e]); cudaFree(sb[e]); }
        cublasLtMatmulDescDestroy(de[e]);
    }
    cudaFree(wsp);
    for (int i = 0; i < S; i++) { cudaStreamDestroy(side[i]); cudaEventDestroy(join[i]); }
    cudaStreamDestroy(main_s);
    cudaEventDestroy(fork); cudaEventDestroy(t0); cudaEventDestroy(t1);
    cublasLtMatmulPreferenceDestroy(p);
    cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(d);
}

int main(int argc, char **argv)
{
    LK(cublasLtCreate(&lt));
    if (argc == 16) {
        run(argv[1], atol(argv[2]), atol(argv[3]), atol(argv[4]), atoi(argv[5]), atoi(argv[6]), argv[7], argv[8], argv[9],
            atoi(argv[10]), atoi(argv[11]), atoi(argv[12]), atoi(argv[13]), atoi(argv[14]), atoi(argv[15]));
        return 0;
    }
    if (argc != 1) {
        fprintf(stderr, "usage: %s [name m n k ta tb atype btype dtype amode bmode beta E S ws_mb]\n", argv[0]);
        return 2;
    }
    /* The layer step's products per expert (M_i 4096 rows): cuBLASLt's m is
     * our N, its n our M. Forward / data gradients: weights (128x128 blocks)
     * x activations (1x128) -> BF16; weight gradients: both column-wise
     * 1x128, stored transposed by the scaling-aware transpose (so TN as
     * well) -> F32 accumulated; the BF16 weight gradient reads row-wise
     * operands (NT). */
    const int E = 8, S = 4, W = 8;
    run("fwd W1 (gate|up)", 4096, 4096, 7168, 1, 0, "e4m3", "e4m3", "bf16", 5, 4, 0, E, S, W);
    run("fwd W2 (down)", 7168, 4096, 2048, 1, 0, "e4m3", "e4m3", "bf16", 5, 4, 0, E, S, W);
    run("dgrad W2", 2048, 4096, 7168, 1, 0, "e4m3", "e4m3", "bf16", 5, 4, 0, E, S, W);
    run("dgrad W1", 7168, 4096, 4096, 1, 0, "e4m3", "e4m3", "bf16", 5, 4, 0, E, S, W);
    run("wgrad W1", 7168, 4096, 4096, 1, 0, "e4m3", "e4m3", "f32", 4, 4, 1, E, S, W);
    run("wgrad W2", 2048, 7168, 4096, 1, 0, "e4m3", "e4m3", "f32", 4, 4, 1, E, S, W);
    run("wgrad W1 32 MB ws", 7168, 4096, 4096, 1, 0, "e4m3", "e4m3", "f32", 4, 4, 1, E, S, 32);
    run("wgrad W1 1 stream", 7168, 4096, 4096, 1, 0, "e4m3", "e4m3", "f32", 4, 4, 1, E, 1, W);
    run("wgrad W1 BF16 (fm-bench's baseline)", 7168, 4096, 4096, 0, 1, "bf16", "bf16", "f32", -1, -1, 1, E, S, W);
    run("fwd W1 BF16 (fm-bench's baseline)", 4096, 4096, 7168, 1, 0, "bf16", "bf16", "bf16", -1, -1, 0, E, S, W);
    /* How many streams the experts go over (GEMM_STREAMS), FP8 next to BF16. */
    first_only = 1;
    for (int ns = 2; ns <= 8; ns *= 2)
        for (int rep = 0; rep < 2; rep++) {
            run("streams: wgrad W1 FP8", 7168, 4096, 4096, 1, 0, "e4m3", "e4m3", "f32", 4, 4, 1, E, ns, W);
            run("streams: wgrad W1 BF16", 7168, 4096, 4096, 0, 1, "bf16", "bf16", "f32", -1, -1, 1, E, ns, W);
            run("streams: fwd W1 FP8", 4096, 4096, 7168, 1, 0, "e4m3", "e4m3", "bf16", 5, 4, 0, E, ns, W);
            run("streams: fwd W1 BF16", 4096, 4096, 7168, 1, 0, "bf16", "bf16", "bf16", -1, -1, 0, E, ns, W);
            run("streams: wgrad W2 FP8", 2048, 7168, 4096, 1, 0, "e4m3", "e4m3", "f32", 4, 4, 1, E, ns, W);
        }
    return 0;
}
