/* Which FP8 / BF16 / F32 products cuBLASLt has an algorithm for on this GPU:
 * one line per (types, scale modes, m, n, k, ops) with the heuristic's
 * answer. The CUDA GEMMs refuse what it refuses (FM_ERR_UNSUPPORTED); on an
 * H100 with cuBLASLt 13.0 it showed FP8 needs m (our N) a multiple of 8 and,
 * with VEC128 / BLK128x128 scales, n (our M) a multiple of 8 and k of 128.
 * Not built by meson (a diagnostic for a GPU machine):
 *   nvcc -o lt-probe tools/cublaslt-probe.c -lcublasLt && ./lt-probe */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdio.h>
static cublasLtHandle_t lt;
static const char *tn(cudaDataType_t t){return t==CUDA_R_8F_E4M3?"e4m3":t==CUDA_R_8F_E5M2?"e5m2":t==CUDA_R_16BF?"bf16":"f32";}
static void probe(cudaDataType_t at, cudaDataType_t bt, cudaDataType_t dt, int amode, int bmode, long m, long n, long k, int ta, int tb)
{
    cublasLtMatmulDesc_t d; cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
    cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
    static float *dummy;
    if (!dummy) cudaMalloc((void **)&dummy, 1 << 20);
    if (amode >= 0) {
        cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &dummy, sizeof dummy);
        cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &dummy, sizeof dummy);
        cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &amode, sizeof amode);
        cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bmode, sizeof bmode);
    }
    cublasLtMatrixLayoutCreate(&la, at, ta ? k : m, ta ? m : k, ta ? k : m);
    cublasLtMatrixLayoutCreate(&lb, bt, tb ? n : k, tb ? k : n, tb ? n : k);
    cublasLtMatrixLayoutCreate(&ld, dt, m, n, m);
    cublasLtMatmulPreference_t p; cublasLtMatmulPreferenceCreate(&p);
    uint64_t ws = 32 << 20; cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    cublasLtMatmulHeuristicResult_t r; int found = 0;
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt, d, la, lb, ld, ld, p, 1, &r, &found);
    printf("%s x %s -> %s modes %d x %d  m %ld n %ld k %ld  op %c%c : %s found %d\n", tn(at), tn(bt), tn(dt), amode, bmode, m, n, k,
           ta ? 'T' : 'N', tb ? 'T' : 'N', cublasLtGetStatusName(s), found);
    cublasLtMatmulPreferenceDestroy(p); cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(ld); cublasLtMatmulDescDestroy(d);
}
int main(void)
{
    cublasLtCreate(&lt);
    long sh[][3] = {{128,128,128},{96,37,256},{96,128,256},{16,1,128},{19,37,256},{4,256,128},{128,37,128},{40,257,384},{64,128,128},{128,8,128},{256,1,128}};
    int ns = sizeof sh / sizeof sh[0];
    int modes[][2] = {{0,0},{3,3},{4,5},{4,4},{5,4}};
    cudaDataType_t pairs[][2] = {{CUDA_R_8F_E4M3,CUDA_R_8F_E4M3},{CUDA_R_8F_E4M3,CUDA_R_8F_E5M2},{CUDA_R_8F_E5M2,CUDA_R_8F_E4M3}};
    for (int pi = 0; pi < 3; pi++) for (int mi = 0; mi < 5; mi++) for (int s = 0; s < ns; s++)
        probe(pairs[pi][0], pairs[pi][1], CUDA_R_16BF, modes[mi][0], modes[mi][1], sh[s][0], sh[s][1], sh[s][2], 1, 0);
    for (int s = 0; s < ns; s++) {
        probe(CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, -1, -1, sh[s][0], sh[s][1], sh[s][2], 1, 0);
        probe(CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, -1, -1, sh[s][0], sh[s][1], sh[s][2], 0, 1);
        probe(CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, -1, -1, sh[s][0], sh[s][1], sh[s][2], 1, 0);
        probe(CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, -1, -1, sh[s][0], sh[s][1], sh[s][2], 0, 0);
        probe(CUDA_R_32F, CUDA_R_32F, CUDA_R_16BF, -1, -1, sh[s][0], sh[s][1], sh[s][2], 1, 0);
    }
    probe(CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_32F, 4, 5, 128, 128, 128, 1, 0);
    probe(CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_32F, 4, 4, 128, 128, 128, 1, 0);
    return 0;
}
