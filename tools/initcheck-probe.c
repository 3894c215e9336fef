/* Does compute-sanitizer initcheck see what cuBLASLt's GEMMs write? One
 * BF16 GEMM into a freshly allocated D (no memset), then a copy of D to the
 * host: on an H100 with cuBLASLt 13 (device run S3-13) initcheck reported all
 * of D uninitialized (65536 errors) although the GEMM returned FM_OK and
 * memcheck is clean, so initcheck's reports on buffers that only a cuBLASLt
 * GEMM wrote (the layer test's SwiGLU input) are not evidence of a bug.
 * Not built by meson (a diagnostic for a GPU machine):
 *   gcc -Iinclude -I/usr/local/cuda/include tools/initcheck-probe.c build-gpu/libflowmoe.a \
 *       -L/usr/local/cuda/lib64 -lcublasLt -lcudart -lstdc++ -lm -lpthread -o probe
 *   compute-sanitizer --tool initcheck --print-limit 2 ./probe */
#include <stdio.h>
#include <stdlib.h>
#include <cuda_runtime.h>
#include "flowmoe/flowmoe.h"
int main(void)
{
    fm_context_config cc = {FM_BACKEND_CUDA, 0, 0, 0};
    fm_context *g;
    if (fm_context_create(&cc, &g)) { printf("ctx: %s\n", fm_last_error(NULL)); return 1; }
    int64_t M = 1024, N = 1024, K = 1024;
    void *a, *b, *d;
    cudaMalloc(&a, M * K * 2); cudaMalloc(&b, N * K * 2); cudaMalloc(&d, M * N * 2);
    cudaMemset(a, 0, M * K * 2); cudaMemset(b, 0, N * K * 2);
    fm_tensor ta = fm_tensor_2d(a, FM_DTYPE_BF16, M, K), tb = fm_tensor_2d(b, FM_DTYPE_BF16, N, K), td = fm_tensor_2d(d, FM_DTYPE_BF16, M, N);
    ta.device = tb.device = td.device = FM_DEVICE_CUDA;
    fm_status st = fm_gemm(g, NULL, &ta, &tb, &td);
    cudaDeviceSynchronize();
    void *h = malloc(M * N * 2);
    cudaMemcpy(h, d, M * N * 2, cudaMemcpyDeviceToHost);
    printf("gemm status %d (%s); copied D\n", (int)st, st ? fm_last_error(g) : "ok");
    return 0;
}
