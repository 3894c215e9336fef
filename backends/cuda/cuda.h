/* CUDA backend internals (host side). C linkage for the vtable. */
#ifndef FLOWMOE_CUDA_H
#define FLOWMOE_CUDA_H

#include <cuda_runtime.h>
#include <cublasLt.h>

#include "../../core/internal.h"

typedef struct fm_cuda_state {
    int device;
    cudaDeviceProp prop;
    cublasLtHandle_t lt;
    void *workspace;
    size_t workspace_bytes;
} fm_cuda_state;

static inline fm_cuda_state *fm_cuda(fm_context *ctx) { return (fm_cuda_state *)ctx->be_state; }
static inline cudaStream_t fm_cuda_stream(fm_context *ctx) { return (cudaStream_t)ctx->stream; }

#ifdef __cplusplus
extern "C" {
#endif

/* Turn a CUDA error into a status and a sentence naming what failed. */
fm_status fm_cuda_check(fm_context *ctx, cudaError_t err, const char *what);
/* After a launch: the launch error, as above. */
fm_status fm_cuda_check_launch(fm_context *ctx, const char *kernel);

#ifdef __cplusplus
}
#endif

#endif
