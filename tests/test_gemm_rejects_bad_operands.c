/* Every GEMM entry point refuses a call that breaks a rule of gemm.h before
 * anything is written: the status is FM_ERR_INVALID_ARG, fm_last_error names
 * the argument and the rule (substring), no byte of any buffer changes, the
 * statistics count nothing, and the valid call it was derived from works. */
#include "test_util.h"

#define ARENA (1u << 20)
static uint8_t *arena, *snap;

enum { OP_GEMM, OP_FWD, OP_DGRAD, OP_WGRAD, OP_GROUPED, OP_KGROUPED };

typedef struct {
    fm_tensor a, b, d;
    fm_gemm_config cfg;
    fm_splits sp;
    int64_t splits[3];
    int op;
} call_t;

/* Valid calls: M 64, N 32, K 256 (grouped: E 3, sum M 64). */
static void base(call_t *c, int op)
{
    memset(c, 0, sizeof *c);
    c->op = op;
    float *sa = (float *)(arena + (64u << 10)), *sb = (float *)(arena + (96u << 10));
    fm_tensor a = fm_tensor_quant_2d(arena, FM_DTYPE_E4M3, 64, 256, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, sa,
                                     FM_SCALE_LAYOUT_COMPACT);
    fm_tensor b = fm_tensor_quant_2d(arena + (32u << 10), FM_DTYPE_E4M3, 32, 256, FM_LAYOUT_ROWWISE,
                                     FM_SCALE_BLOCK_128x128, sb, FM_SCALE_LAYOUT_GEMM);
    c->d = fm_tensor_2d(arena + (128u << 10), FM_DTYPE_F32, 64, 32);
    c->splits[0] = 20, c->splits[1] = 0, c->splits[2] = 44;
    c->sp = (fm_splits){.groups = 3, .host = c->splits};
    switch (op) {
    case OP_DGRAD: /* dy [64, 256] row-wise, w [256, 32] column-wise -> dx [64, 32] */
        c->a = a;
        c->b = fm_tensor_t(&b);
        break;
    case OP_WGRAD: /* dy [256, 64], x [256, 32] column-wise -> dw [64, 32] */
        b.scale_mode = FM_SCALE_BLOCK_1x128;
        c->a = fm_tensor_t(&a);
        c->b = fm_tensor_t(&b);
        break;
    case OP_GROUPED:
        c->a = a;
        c->b = fm_tensor_3d(b.data, FM_DTYPE_E4M3, 3, 32, 256);
        c->b.scale_mode = FM_SCALE_BLOCK_128x128;
        c->b.scale = sb;
        c->b.scale_dtype = FM_DTYPE_F32;
        break;
    case OP_KGROUPED: /* dy [64, 32], x [64, 16] grouped column-wise -> dw [3, 32, 16] */
        c->a = fm_tensor_quant_2d(arena, FM_DTYPE_E4M3, 64, 32, FM_LAYOUT_COLWISE, FM_SCALE_BLOCK_1x128, sa,
                                  FM_SCALE_LAYOUT_COMPACT);
        c->b = fm_tensor_quant_2d(arena + (32u << 10), FM_DTYPE_E4M3, 64, 16, FM_LAYOUT_COLWISE,
                                  FM_SCALE_BLOCK_1x128, sb, FM_SCALE_LAYOUT_COMPACT);
        c->d = fm_tensor_3d(arena + (128u << 10), FM_DTYPE_F32, 3, 32, 16);
        break;
    default:
        c->a = a;
        c->b = b;
    }
}

static fm_status run(fm_context *ctx, call_t *c)
{
    switch (c->op) {
    case OP_FWD: return fm_linear_forward(ctx, &c->cfg, &c->a, &c->b, &c->d);
    case OP_DGRAD: return fm_linear_dgrad(ctx, &c->cfg, &c->a, &c->b, &c->d);
    case OP_WGRAD: return fm_linear_wgrad(ctx, &c->cfg, &c->a, &c->b, &c->d);
    case OP_GROUPED: return fm_grouped_gemm(ctx, &c->cfg, &c->sp, &c->a, &c->b, &c->d);
    case OP_KGROUPED: return fm_grouped_gemm_wgrad(ctx, &c->cfg, &c->sp, &c->a, &c->b, &c->d);
    default: return fm_gemm(ctx, &c->cfg, &c->a, &c->b, &c->d);
    }
}

static void expect(fm_context *ctx, call_t *c, const char *substr, const char *what)
{
    for (size_t i = 0; i < ARENA; i++)
        arena[i] = (uint8_t)(i * 7 + 3);
    /* finite scales and codes so that the valid form can run */
    float *s = (float *)(arena + (64u << 10));
    for (int i = 0; i < 16384; i++)
        s[i] = 1.0f;
    for (int i = 0; i < (64 << 10); i++)
        arena[i] &= 0x3F;
    memcpy(snap, arena, ARENA);
    fm_stats before, after;
    fm_stats_get(ctx, &before);
    fm_status st = run(ctx, c);
    fm_stats_get(ctx, &after);
    const char *err = fm_last_error(ctx);
    CHECK(st == FM_ERR_INVALID_ARG, "%s: status %s (%s)", what, fm_status_name(st), err);
    CHECK(strstr(err, substr) != NULL, "%s: error \"%s\" does not contain \"%s\"", what, err, substr);
    CHECK(memcmp(arena, snap, ARENA) == 0, "%s: a buffer changed", what);
    CHECK(memcmp(&before, &after, sizeof before) == 0, "%s: the failed call was counted", what);
}

static void valid(fm_context *ctx, int op)
{
    call_t c;
    base(&c, op);
    fm_status st = run(ctx, &c);
    CHECK(st == FM_OK && fm_last_error(ctx)[0] == 0, "valid op %d: %s: %s", op, fm_status_name(st),
          fm_last_error(ctx));
}

int main(void)
{
    tu_begin("test_gemm_rejects_bad_operands");
    fm_context *ctx = tu_cpu_context(2);
    arena = malloc(ARENA);
    snap = malloc(ARENA);
    call_t c;
#define CASE(op, mutate, substr)                                                  \
    do {                                                                          \
        base(&c, op);                                                             \
        mutate;                                                                   \
        expect(ctx, &c, substr, #op ": " #mutate);                                \
        valid(ctx, op);                                                           \
    } while (0)
    CASE(OP_GEMM, (c.a.dtype = FM_DTYPE_E5M2, c.b.dtype = FM_DTYPE_E5M2), "E5M2 x E5M2");
    CASE(OP_GEMM, (c.b = fm_tensor_2d(c.b.data, FM_DTYPE_BF16, 32, 256)), "are not a GEMM pair");
    CASE(OP_GEMM, (c.a = fm_tensor_t(&c.a), c.a.shape[0] = 64, c.a.shape[1] = 256), "a: an FP8 A [M, K] must be stored with K contiguous");
    CASE(OP_FWD, (c.b.layout = FM_LAYOUT_COLWISE, c.b.shape[0] = 32, c.b.shape[1] = 256), "w: the forward GEMM needs W's row-wise copy");
    CASE(OP_DGRAD, (c.b = fm_tensor_t(&c.b), c.b.shape[0] = 256, c.b.shape[1] = 32), "w: the data-gradient GEMM needs W's column-wise copy (K = out contiguous); got rowwise");
    CASE(OP_DGRAD, (c.a.layout = FM_LAYOUT_COLWISE), "dy: the data-gradient GEMM needs dY's row-wise copy");
    CASE(OP_WGRAD, (c.a.layout = FM_LAYOUT_ROWWISE), "dy: the weight-gradient GEMM needs dY's column-wise copy");
    CASE(OP_WGRAD, (c.b.layout = FM_LAYOUT_ROWWISE), "x: the weight-gradient GEMM needs X's column-wise copy");
    CASE(OP_GEMM, (c.b.shape[1] = 128), "b: must be [N, K] with K = 256");
    CASE(OP_GEMM, (c.d.shape[1] = 31), "d: must be [M, N] = [64, 32]");
    CASE(OP_DGRAD, (c.b.shape[0] = 255), "w: must be [out, in] with out = 256");
    CASE(OP_WGRAD, (c.d.shape[0] = 63), "dw: must be [out, in] = [64, 32]");
    CASE(OP_GEMM, (c.a.scale_mode = FM_SCALE_ROW, c.b.scale_mode = FM_SCALE_TENSOR), "scale pair ROW x TENSOR is not supported");
    CASE(OP_GEMM, (c.b.scale_mode = FM_SCALE_MX32, c.b.scale_dtype = FM_DTYPE_E8M0), "scale pair BLOCK_1x128 x MX32");
    CASE(OP_GEMM, (c.a.scale_mode = FM_SCALE_NONE), "a: an FP8 operand needs a scale_mode");
    CASE(OP_GEMM, (c.a = fm_tensor_2d(c.a.data, FM_DTYPE_BF16, 64, 256), c.b = fm_tensor_2d(c.b.data, FM_DTYPE_BF16, 32, 256), c.b.scale_mode = FM_SCALE_TENSOR, c.b.scale = arena), "b: BF16 operands of a GEMM are unscaled");
    CASE(OP_GEMM, (c.cfg.accumulate = 1, c.d.dtype = FM_DTYPE_BF16), "d: cfg->accumulate adds into the output, which must then be F32");
    CASE(OP_GEMM, (c.cfg.accumulate = 2), "cfg->accumulate: must be 0 or 1");
    CASE(OP_GEMM, (c.cfg.impl = (fm_gemm_impl)3), "cfg->impl: must be AUTO, LIBRARY or NATIVE (0..2), got 3");
    CASE(OP_GROUPED, (c.cfg.impl = (fm_gemm_impl)-1), "cfg->impl: must be AUTO, LIBRARY or NATIVE");
    /* Found by fuzz_descriptor_validation: a scale_dtype that does not fit the
     * mode once made the scale size unknown and slipped past scale_capacity. */
    CASE(OP_WGRAD, (c.b.scale_dtype = FM_DTYPE_I32, c.b.scale_capacity = 64), "x: scale_mode BLOCK_1x128 needs scale_dtype F32");
    CASE(OP_GEMM, (c.d.dtype = FM_DTYPE_F16), "d: the GEMM output dtype must be BF16 or F32");
    CASE(OP_GEMM, (c.d.layout = FM_LAYOUT_COLWISE), "d: must be row-wise");
    CASE(OP_GEMM, (c.d.data = arena + 1024, c.d.dtype = FM_DTYPE_BF16), "overlap");
    CASE(OP_GEMM, (c.d.data = (uint8_t *)c.b.scale), "overlap");
    CASE(OP_GEMM, (c.a.ndim = 3), "a: must be 2-D");
    CASE(OP_GROUPED, (c.sp.host = NULL), "splits->host: NULL");
    /* device-only split sizes are a CUDA-backend form */
    CASE(OP_GROUPED, (c.sp.host = NULL, c.sp.device = c.splits), "splits->host: NULL; the cpu backend needs the group sizes in host memory");
    CASE(OP_GROUPED, (c.splits[1] = 1), "splits->host: the sizes sum past a's 64 rows");
    CASE(OP_GROUPED, (c.splits[2] = 40), "splits->host: the sizes sum to 60 but a has 64 rows");
    CASE(OP_GROUPED, (c.splits[1] = -1, c.splits[2] = 45), "splits->host[1]: -1 rows");
    CASE(OP_GROUPED, (c.sp.groups = 2), "splits->groups: 2, but b has 3 experts");
    CASE(OP_GROUPED, (c.a.scale_mode = FM_SCALE_BLOCK_128x128), "a: BLOCK_128x128 blocks would straddle");
    CASE(OP_GROUPED, (c.b.ndim = 2), "b: must be 3-D");
    CASE(OP_KGROUPED, (c.a.scale_mode = FM_SCALE_BLOCK_128x128), "the k-grouped weight gradient takes dy BLOCK_1x128 x x BLOCK_1x128 or BLOCK_128x128");
    CASE(OP_KGROUPED, (c.b.scale_mode = FM_SCALE_ROW), "the k-grouped weight gradient takes dy BLOCK_1x128 x x BLOCK_1x128 or BLOCK_128x128");
    CASE(OP_KGROUPED, (c.a.layout = FM_LAYOUT_ROWWISE), "dy: the k-grouped weight gradient needs dY's grouped column-wise copy");
    CASE(OP_KGROUPED, (c.a.scale_capacity = 4 * 32 + 4), "dy: scale_capacity is 132 bytes but the grouped compact layout over these splits needs 256");
    CASE(OP_KGROUPED, (c.sp.host = NULL), "splits->host: NULL");
    CASE(OP_KGROUPED, (c.d.dtype = FM_DTYPE_BF16, c.cfg.accumulate = 1), "dw: cfg->accumulate");
    CASE(OP_KGROUPED, (c.d.shape[2] = 17), "dw: must be [E, N, K] = [E, 32, 16]");
    CASE(OP_KGROUPED, (c.d.data = arena + 100), "overlap");
#undef CASE
    free(arena);
    free(snap);
    fm_context_destroy(ctx);
    return tu_end();
}
