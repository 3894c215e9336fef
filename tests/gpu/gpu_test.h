/* Shared by the GPU tests: a CUDA context or exit 77 (meson SKIP), checks. */
#ifndef FM_GPU_TEST_H
#define FM_GPU_TEST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "flowmoe/flowmoe.h"
#include "../layer_step.h"

static int gt_failures;

#define GT_CHECK(cond, ...)                                             \
    do {                                                                \
        if (!(cond)) {                                                  \
            gt_failures++;                                              \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                               \
            fprintf(stderr, "\n");                                      \
        }                                                               \
    } while (0)

#define GT_CUDA(x)                                                                                 \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* A CUDA context, or exit 77 with a sentence when no device is usable. */
static inline fm_context *gt_cuda_context(const char *test)
{
    fm_context *ctx = NULL;
    fm_context_config c;
    memset(&c, 0, sizeof c);
    c.backend = FM_BACKEND_CUDA;
    if (fm_context_create(&c, &ctx) != FM_OK) {
        printf("%s: skipped: no usable CUDA device (%s)\n", test, fm_last_error(NULL));
        exit(77);
    }
    return ctx;
}

static inline fm_context *gt_cpu_context(void)
{
    fm_context *ctx = NULL;
    fm_context_config c;
    memset(&c, 0, sizeof c);
    c.backend = FM_BACKEND_CPU;
    if (fm_context_create(&c, &ctx) != FM_OK) {
        fprintf(stderr, "CPU context: %s\n", fm_last_error(NULL));
        exit(1);
    }
    return ctx;
}

/* A normal variate (sum of 12 uniforms) from a xorshift state. */
static inline double gt_normal(uint64_t *rng)
{
    double u = 0;
    for (int i = 0; i < 12; i++) {
        *rng ^= *rng << 13, *rng ^= *rng >> 7, *rng ^= *rng << 17;
        u += (double)(*rng >> 11) * (1.0 / 9007199254740992.0);
    }
    return u - 6.0;
}

/* Relative Frobenius error of a against b (absolute when b is all zero). */
static inline double gt_rel_frob(const float *a, const float *b, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static inline int gt_finish(const char *test)
{
    if (gt_failures) {
        fprintf(stderr, "%s: %d check(s) failed\n", test, gt_failures);
        return 1;
    }
    printf("%s: ok\n", test);
    return 0;
}

#endif
