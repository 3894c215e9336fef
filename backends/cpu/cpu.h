/* CPU backend internals. */
#ifndef FLOWMOE_CPU_H
#define FLOWMOE_CPU_H

#include "../../core/internal.h"

fm_status fm_cpu_quantize(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *in, fm_tensor *out_row,
                          fm_tensor *out_col);
fm_status fm_cpu_dequantize(fm_context *ctx, const fm_tensor *in, fm_tensor *out);
fm_status fm_cpu_scale_layout_convert(fm_context *ctx, const fm_tensor *src, fm_tensor *dst);
fm_status fm_cpu_cast(fm_context *ctx, const fm_tensor *in, fm_tensor *out);
fm_status fm_cpu_requantize(fm_context *ctx, const fm_requant_config *cfg, const fm_tensor *in, fm_tensor *out);
fm_status fm_cpu_requantize_grouped(fm_context *ctx, const fm_requant_config *cfg, const fm_splits *splits,
                                    const fm_tensor *in, fm_tensor *out);
fm_status fm_cpu_requantize_grouped_rows(fm_context *ctx, const fm_requant_config *cfg, const fm_splits *splits,
                                         const fm_tensor *in, const fm_tensor *row_map, int topk, fm_tensor *out);
fm_status fm_cpu_gemm(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *a, const fm_tensor *b,
                      fm_tensor *d);
fm_status fm_cpu_grouped_gemm(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *splits,
                              const fm_tensor *a, const fm_tensor *b, fm_tensor *d);
fm_status fm_cpu_grouped_gemm_wgrad(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *splits,
                                    const fm_tensor *dy, const fm_tensor *x, fm_tensor *dw);
fm_status fm_cpu_moe_router(fm_context *ctx, const fm_router_config *cfg, const fm_tensor *logits,
                            fm_tensor *expert_ids, fm_tensor *probs, fm_tensor *tokens_per_expert);
fm_status fm_cpu_moe_router_backward(fm_context *ctx, const fm_router_config *cfg, const fm_tensor *logits,
                                     const fm_tensor *expert_ids, const fm_tensor *dprobs, fm_tensor *dlogits);
fm_status fm_cpu_moe_permute(fm_context *ctx, const fm_permute_config *cfg, const fm_tensor *x,
                             const fm_tensor *expert_ids, const fm_tensor *probs, fm_tensor *out, fm_tensor *row_map,
                             fm_tensor *slot_rows, fm_tensor *splits, fm_tensor *out_probs, int64_t *host_splits);
fm_status fm_cpu_moe_unpermute(fm_context *ctx, const fm_tensor *y, const fm_tensor *slot_rows,
                               const fm_tensor *probs, fm_tensor *out);
fm_status fm_cpu_moe_unpermute_backward(fm_context *ctx, const fm_tensor *dout, const fm_tensor *y,
                                        const fm_tensor *row_map, const fm_tensor *slot_rows, const fm_tensor *probs,
                                        fm_tensor *dy, fm_tensor *dprobs);
fm_status fm_cpu_moe_swiglu(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *in, const fm_tensor *probs,
                            fm_tensor *out_row, fm_tensor *out_col, fm_tensor *in_saved);
fm_status fm_cpu_moe_swiglu_backward(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *dh,
                                     const fm_tensor *in, const fm_tensor *probs, fm_tensor *din_row,
                                     fm_tensor *din_col, fm_tensor *dprobs);

/* Runs fn(arg, begin, end, worker) over [0, n) split into contiguous chunks
 * of at least min_chunk, one per worker (at most ctx->cpu_threads, at most
 * 64; worker in [0, 64)), and waits. Chunks are fixed by n and the worker
 * count, so results that combine per-chunk values in chunk order are
 * deterministic. */
#define FM_CPU_MAX_WORKERS 64
typedef void (*fm_cpu_range_fn)(void *arg, int64_t begin, int64_t end, int worker);
void fm_cpu_parallel_for(const fm_context *ctx, int64_t n, int64_t min_chunk, fm_cpu_range_fn fn, void *arg);
/* The most workers fm_cpu_parallel_for runs (1..64): what per-worker scratch
 * is sized by. */
int fm_cpu_workers(const fm_context *ctx);

/* Loading unscaled elements as F32 (exact). */
static inline float fm_cpu_load_f32(const void *p, fm_dtype t, int64_t i)
{
    switch (t) {
    case FM_DTYPE_BF16: return fm_bf16_to_f32(((const uint16_t *)p)[i]);
    case FM_DTYPE_F16: return fm_f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline void fm_cpu_load_row(const void *p, fm_dtype t, int64_t off, int64_t n, float *dst)
{
    if (t == FM_DTYPE_F32) {
        memcpy(dst, (const float *)p + off, (size_t)n * sizeof(float));
        return;
    }
    for (int64_t j = 0; j < n; j++)
        dst[j] = fm_cpu_load_f32(p, t, off + j);
}

/* Store an F32 value as F32/BF16/F16; NaN becomes the canonical NaN. */
static inline void fm_cpu_store_f32(void *p, fm_dtype t, int64_t i, float v)
{
    switch (t) {
    case FM_DTYPE_BF16: ((uint16_t *)p)[i] = fm_bf16_from_f32(v); break;
    case FM_DTYPE_F16: ((uint16_t *)p)[i] = fm_f16_from_f32(v); break;
    default: ((float *)p)[i] = fm_f32_canon(v); break;
    }
}

/* A stored E2M1 nibble write (element c of a packed row). */
static inline void fm_cpu_put_nibble(uint8_t *row, int64_t c, uint8_t code)
{
    uint8_t *b = row + (c >> 1);
    *b = (c & 1) ? (uint8_t)((*b & 0x0Fu) | (code << 4)) : (uint8_t)((*b & 0xF0u) | (code & 0x0Fu));
}

static inline uint8_t fm_cpu_get_nibble(const uint8_t *row, int64_t c)
{
    return (c & 1) ? (uint8_t)(row[c >> 1] >> 4) : (uint8_t)(row[c >> 1] & 0x0Fu);
}

#endif
