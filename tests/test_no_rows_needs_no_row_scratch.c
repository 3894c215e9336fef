/* An op over no rows succeeds whatever the width of those rows: a tensor
 * [0, 2^31 - 2] holds nothing, so the op has nothing to compute and must not
 * size scratch by the width (a per-worker row buffer of 2^31 floats is 8 GiB,
 * 512 GiB for 64 workers). fuzz_descriptor_validation found
 * fm_moe_unpermute asking malloc for 0xfffffffe00 bytes on such a call.
 *
 * Outside AddressSanitizer the test caps its address space (RLIMIT_AS) at
 * what it uses plus 1 GiB, so any width-sized allocation fails and the op
 * answers FM_ERR_OUT_OF_MEMORY, which the checks catch. */
#include "test_util.h"

#if defined(__linux__)
#include <sys/resource.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define TU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TU_ASAN 1
#endif
#endif

static int cap_address_space(void)
{
#if defined(__linux__) && !defined(TU_ASAN)
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long pages = 0;
    if (!f)
        return 0;
    int ok = fscanf(f, "%lu", &pages) == 1;
    fclose(f);
    if (!ok)
        return 0;
    /* the virtual size now, plus room for the worker threads' stacks */
    rlim_t lim = (rlim_t)pages * 4096u + ((rlim_t)1 << 30);
    struct rlimit rl = {lim, lim};
    return setrlimit(RLIMIT_AS, &rl) == 0;
#else
    return 0;
#endif
}

#define WIDE ((int64_t)INT32_MAX - 1) /* even: E2M1 packs two per byte */

#define OK(call, what)                                                                                         \
    do {                                                                                                       \
        fm_status st_ = (call);                                                                                \
        CHECK(st_ == FM_OK, "%s over [0, %lld]: %s \"%s\"", what, (long long)WIDE, fm_status_name(st_),        \
              fm_last_error(ctx));                                                                             \
    } while (0)

int main(void)
{
    tu_begin("test_no_rows_needs_no_row_scratch");
    /* 64 threads: what the per-worker scratch was sized by */
    fm_context *ctx = tu_cpu_context(64);
    int capped = cap_address_space();
    printf("address space %s\n", capped ? "capped at its size + 1 GiB" : "not capped (ASan build or not Linux)");

    /* quantize / dequantize / transpose / convert over [0, WIDE] */
    static const fm_scale_mode modes[] = {FM_SCALE_BLOCK_1x128, FM_SCALE_MX32};
    for (size_t mi = 0; mi < 2; mi++) {
        fm_scale_mode m = modes[mi];
        fm_dtype dt = m == FM_SCALE_MX32 ? FM_DTYPE_E2M1 : FM_DTYPE_E4M3;
        fm_tensor in = fm_tensor_2d(NULL, FM_DTYPE_F32, 0, WIDE);
        fm_tensor row = fm_tensor_quant_2d(NULL, dt, 0, WIDE, FM_LAYOUT_ROWWISE, m, NULL, FM_SCALE_LAYOUT_COMPACT);
        fm_tensor col = fm_tensor_quant_2d(NULL, dt, 0, WIDE, FM_LAYOUT_COLWISE, m, NULL, FM_SCALE_LAYOUT_COMPACT);
        float amax = -1.0f;
        int64_t bad = -1;
        fm_quant_config qc = {.amax = &amax, .nonfinite_blocks = &bad};
        OK(fm_quantize(ctx, &qc, &in, &row, &col), "fm_quantize (row + col)");
        CHECK(amax == 0.0f && bad == 0, "fm_quantize [0, wide]: amax %g, nonfinite %lld", (double)amax,
              (long long)bad);
        fm_tensor out = in;
        OK(fm_dequantize(ctx, &row, &out), "fm_dequantize");
        fm_requant_config rc = {0};
        OK(fm_transpose_scaled(ctx, &rc, &row, &col), "fm_transpose_scaled");
        fm_tensor conv = row;
        conv.dtype = FM_DTYPE_E4M3;
        conv.scale_mode = FM_SCALE_BLOCK_1x128;
        conv.scale_dtype = FM_DTYPE_F32;
        OK(fm_convert_scaled(ctx, &rc, &row, &conv), "fm_convert_scaled");
    }

    /* router over no tokens and WIDE experts, and its backward */
    {
        fm_tensor logits = fm_tensor_2d(NULL, FM_DTYPE_F32, 0, WIDE);
        fm_tensor ids = fm_tensor_2d(NULL, FM_DTYPE_I32, 0, 2), probs = fm_tensor_2d(NULL, FM_DTYPE_F32, 0, 2);
        fm_router_config rcfg = {.topk = 2};
        OK(fm_moe_router(ctx, &rcfg, &logits, &ids, &probs, NULL), "fm_moe_router");
        fm_tensor dlogits = logits;
        OK(fm_moe_router_backward(ctx, &rcfg, &logits, &ids, &probs, &dlogits), "fm_moe_router_backward");
    }

    /* permute / unpermute (+ backward) over no tokens of WIDE hidden size */
    {
        fm_tensor x = fm_tensor_2d(NULL, FM_DTYPE_BF16, 0, WIDE), out = x;
        fm_tensor ids = fm_tensor_2d(NULL, FM_DTYPE_I32, 0, 1), probs = fm_tensor_2d(NULL, FM_DTYPE_F32, 0, 1);
        fm_tensor row_map = fm_tensor_2d(NULL, FM_DTYPE_I32, 0, 1), slot_rows = ids, out_probs = row_map;
        out_probs.dtype = FM_DTYPE_F32;
        int64_t sp[2] = {-1, -1};
        fm_tensor splits = fm_tensor_2d(sp, FM_DTYPE_I64, 1, 2);
        int64_t host[2] = {-1, -1};
        fm_permute_config pc = {.pad_multiple = 16};
        OK(fm_moe_permute(ctx, &pc, &x, &ids, &probs, &out, &row_map, &slot_rows, &splits, &out_probs, host),
           "fm_moe_permute");
        CHECK(sp[0] == 0 && sp[1] == 0 && host[0] == 0 && host[1] == 0,
              "fm_moe_permute over no tokens: splits %lld %lld, host %lld %lld", (long long)sp[0], (long long)sp[1],
              (long long)host[0], (long long)host[1]);
        fm_tensor y = out, back = fm_tensor_2d(NULL, FM_DTYPE_F32, 0, WIDE);
        OK(fm_moe_unpermute(ctx, &y, &slot_rows, &probs, &back), "fm_moe_unpermute");
        fm_tensor dy = fm_tensor_2d(NULL, FM_DTYPE_BF16, 0, WIDE), dprobs = probs;
        OK(fm_moe_unpermute_backward(ctx, &back, &y, &row_map, &slot_rows, &probs, &dy, &dprobs),
           "fm_moe_unpermute_backward");
    }

    /* SwiGLU (+ backward) over no rows of WIDE = 2I columns */
    {
        fm_tensor in = fm_tensor_2d(NULL, FM_DTYPE_BF16, 0, WIDE), probs = fm_tensor_2d(NULL, FM_DTYPE_F32, 0, 1);
        fm_tensor h = fm_tensor_quant_2d(NULL, FM_DTYPE_E4M3, 0, WIDE / 2, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128,
                                         NULL, FM_SCALE_LAYOUT_COMPACT);
        OK(fm_moe_swiglu(ctx, NULL, &in, &probs, &h, NULL, NULL), "fm_moe_swiglu");
        fm_tensor dh = fm_tensor_2d(NULL, FM_DTYPE_BF16, 0, WIDE / 2);
        fm_tensor din = fm_tensor_quant_2d(NULL, FM_DTYPE_E4M3, 0, WIDE, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128,
                                           NULL, FM_SCALE_LAYOUT_COMPACT);
        fm_tensor dprobs = probs;
        OK(fm_moe_swiglu_backward(ctx, NULL, &dh, &in, &probs, &din, NULL, &dprobs), "fm_moe_swiglu_backward");
    }

    /* GEMM of no rows over a WIDE K: D [0, 0] */
    {
        fm_tensor a = fm_tensor_2d(NULL, FM_DTYPE_BF16, 0, WIDE), b = a, d = fm_tensor_2d(NULL, FM_DTYPE_F32, 0, 0);
        OK(fm_gemm(ctx, NULL, &a, &b, &d), "fm_gemm (BF16, M = N = 0)");
    }

    fm_context_destroy(ctx);
    return tu_end();
}
