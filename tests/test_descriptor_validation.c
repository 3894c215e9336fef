/* Every invalid call is refused before anything is written.
 *
 * For each of the cases below (fm_quantize, fm_dequantize,
 * fm_scale_layout_convert, fm_context_create), starting from a valid call and
 * breaking one rule: the status is the documented one (FM_ERR_INVALID_ARG,
 * or FM_ERR_UNSUPPORTED for reserved NV16), fm_last_error is a sentence that
 * names the argument (substring), no byte of any buffer the call was given
 * (inputs, outputs, amax, nonfinite_blocks) changes, nothing crashes, the
 * failed call counts nothing in the statistics, and a following valid call
 * succeeds with fm_last_error "". */
#include <math.h>

#include "test_util.h"

#define ARENA (1u << 20)
/* regions of the arena (bytes) */
#define IN_OFF 0
#define ROWD_OFF (128u << 10)
#define ROWS_OFF (256u << 10)
#define COLD_OFF (384u << 10)
#define COLS_OFF (512u << 10)
#define AMAX_OFF (640u << 10)
#define NF_OFF (AMAX_OFF + 64)
#define DOUT_OFF (768u << 10)

static uint8_t *arena, *snap;
static int n_cases[4];
static const char *op_names[4] = {"fm_quantize", "fm_dequantize", "fm_scale_layout_convert", "fm_context_create"};

typedef struct {
    fm_tensor in, row, col;
    fm_quant_config cfg;
    fm_tensor *pin, *prow, *pcol;
    const fm_quant_config *pcfg;
    /* dequantize / convert */
    fm_tensor qin, dout, src, dst;
    fm_tensor *pqin, *pdout, *psrc, *pdst;
} scen;

static void baseline(scen *s)
{
    memset(s, 0, sizeof *s);
    s->in = fm_tensor_2d(arena + IN_OFF, FM_DTYPE_F32, 64, 256);
    s->row = fm_tensor_quant_2d(arena + ROWD_OFF, FM_DTYPE_E4M3, 64, 256, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128,
                                arena + ROWS_OFF, FM_SCALE_LAYOUT_COMPACT);
    s->col = fm_tensor_quant_2d(arena + COLD_OFF, FM_DTYPE_E4M3, 64, 256, FM_LAYOUT_COLWISE, FM_SCALE_BLOCK_1x128,
                                arena + COLS_OFF, FM_SCALE_LAYOUT_COMPACT);
    s->cfg.amax = (float *)(arena + AMAX_OFF);
    s->cfg.nonfinite_blocks = (int64_t *)(arena + NF_OFF);
    s->pin = &s->in;
    s->prow = &s->row;
    s->pcol = &s->col;
    s->pcfg = &s->cfg;
    s->qin = s->row;
    s->dout = fm_tensor_2d(arena + DOUT_OFF, FM_DTYPE_F32, 64, 256);
    s->src = s->row;
    s->src.data = NULL;
    s->dst = s->src;
    s->dst.scale = arena + COLS_OFF;
    s->dst.scale_layout = FM_SCALE_LAYOUT_GEMM;
    s->pqin = &s->qin;
    s->pdout = &s->dout;
    s->psrc = &s->src;
    s->pdst = &s->dst;
}

static void fresh_arena(void)
{
    for (size_t i = 0; i < ARENA; i++)
        arena[i] = 0xA5;
    float *x = (float *)(arena + IN_OFF);
    for (int i = 0; i < 64 * 256; i++)
        x[i] = (float)tu_normal();
    memcpy(snap, arena, ARENA);
}

static void run_case(fm_context *ctx, int op, int id, scen *s, fm_status want, const char *substr)
{
    fm_stats before, after;
    fm_stats_get(ctx, &before);
    fm_status st;
    if (op == 0)
        st = fm_quantize(ctx, s->pcfg, s->pin, s->prow, s->pcol);
    else if (op == 1)
        st = fm_dequantize(ctx, s->pqin, s->pdout);
    else
        st = fm_scale_layout_convert(ctx, s->psrc, s->pdst);
    n_cases[op]++;
    const char *err = fm_last_error(ctx);
    CHECK(st == want, "%s case %d (%s): status %s, want %s; error \"%s\"", op_names[op], id, substr,
          fm_status_name(st), fm_status_name(want), err);
    CHECK(err && strlen(err) > 10 && strstr(err, substr), "%s case %d: error \"%s\" must name \"%s\"", op_names[op],
          id, err ? err : "(null)", substr);
    size_t diff = 0;
    for (size_t i = 0; i < ARENA; i++)
        diff += arena[i] != snap[i];
    CHECK(diff == 0, "%s case %d (%s): %zu bytes of the buffers changed", op_names[op], id, substr, diff);
    fm_stats_get(ctx, &after);
    CHECK(memcmp(&before, &after, sizeof before) == 0, "%s case %d: a failed call changed the statistics",
          op_names[op], id);
    /* the valid call succeeds and clears the error */
    scen ok;
    baseline(&ok);
    st = op == 0 ? fm_quantize(ctx, ok.pcfg, ok.pin, ok.prow, ok.pcol)
       : op == 1 ? fm_dequantize(ctx, ok.pqin, ok.pdout)
                 : fm_scale_layout_convert(ctx, ok.psrc, ok.pdst);
    CHECK(st == FM_OK && strcmp(fm_last_error(ctx), "") == 0, "%s: valid call after case %d: %s \"%s\"", op_names[op],
          id, fm_status_name(st), fm_last_error(ctx));
    fresh_arena();
}

#define INV FM_ERR_INVALID_ARG
#define UNS FM_ERR_UNSUPPORTED
#define Q(...) do { baseline(&s); __VA_ARGS__; } while (0)

int main(void)
{
    tu_begin("test_descriptor_validation");
    if (posix_memalign((void **)&arena, 64, ARENA) || !(snap = malloc(ARENA)))
        return 1;
    fm_context *ctx = tu_cpu_context(2);
    fresh_arena();
    scen s;
    int id = 0;
    /* the baseline calls are valid */
    baseline(&s);
    CHECK(fm_quantize(ctx, s.pcfg, s.pin, s.prow, s.pcol) == FM_OK, "baseline quantize: %s", fm_last_error(ctx));
    CHECK(fm_dequantize(ctx, s.pqin, s.pdout) == FM_OK, "baseline dequantize: %s", fm_last_error(ctx));
    CHECK(fm_scale_layout_convert(ctx, s.psrc, s.pdst) == FM_OK, "baseline convert: %s", fm_last_error(ctx));
    fresh_arena();

#define QC(want, sub, ...) do { Q(__VA_ARGS__); run_case(ctx, 0, ++id, &s, want, sub); } while (0)
    /* ---- fm_quantize: the input ---- */
    QC(INV, "in: the descriptor pointer is NULL", s.pin = NULL);
    QC(INV, "in: data is NULL", s.in.data = NULL);
    QC(INV, "in: invalid shape", s.in.ndim = 1);
    QC(INV, "in: invalid shape", s.in.ndim = 4);
    QC(INV, "in: invalid shape", s.in.ndim = 0);
    QC(INV, "negative", s.in.shape[0] = -64);
    QC(INV, "negative", s.in.shape[1] = -1);
    QC(INV, "exceeds 2^31", s.in.shape[1] = (int64_t)1 << 40);
    QC(INV, "2^56", s.in.ndim = 3; s.in.shape[0] = INT32_MAX; s.in.shape[1] = INT32_MAX; s.in.shape[2] = INT32_MAX);
    QC(INV, "in: invalid shape", s.in.ndim = 3; s.in.shape[2] = -5);
    QC(INV, "in: dtype 99", s.in.dtype = (fm_dtype)99);
    QC(INV, "in: dtype", s.in.dtype = (fm_dtype)-1);
    QC(INV, "in: dtype must be F32, BF16 or F16", s.in.dtype = FM_DTYPE_E4M3);
    QC(INV, "in: dtype must be F32, BF16 or F16", s.in.dtype = FM_DTYPE_I32);
    QC(INV, "in: dtype must be F32, BF16 or F16", s.in.dtype = FM_DTYPE_E8M0);
    QC(INV, "in: must be row-wise", s.in.layout = FM_LAYOUT_COLWISE);
    QC(INV, "in: layout 7", s.in.layout = (fm_layout)7);
    QC(INV, "in: device 5", s.in.device = (fm_device)5);
    QC(INV, "in: device is CUDA", s.in.device = FM_DEVICE_CUDA);
    QC(INV, "in: must be unscaled", s.in.scale_mode = FM_SCALE_BLOCK_1x128; s.in.scale = arena + AMAX_OFF + 128);
    QC(INV, "in: scale_mode 77", s.in.scale_mode = (fm_scale_mode)77);
    QC(INV, "in: data", s.in.data = arena + IN_OFF + 1);
    QC(INV, "in: data", s.in.dtype = FM_DTYPE_BF16; s.in.data = arena + IN_OFF + 1);
    /* ---- fm_quantize: the outputs ---- */
    QC(INV, "out_rowwise, out_colwise: both are NULL", s.prow = NULL; s.pcol = NULL);
    QC(INV, "out_rowwise: dtype must be E4M3, E5M2 or E2M1", s.row.dtype = FM_DTYPE_F32);
    QC(INV, "out_rowwise: dtype must be E4M3, E5M2 or E2M1", s.row.dtype = FM_DTYPE_BF16);
    QC(INV, "out_colwise: dtype must be E4M3, E5M2 or E2M1", s.col.dtype = FM_DTYPE_E8M0);
    QC(INV, "out_rowwise: a quantized tensor needs a scale_mode", s.row.scale_mode = FM_SCALE_NONE);
    QC(UNS, "out_rowwise: scale_mode NV16", s.row.scale_mode = FM_SCALE_NV16; s.row.scale_dtype = FM_DTYPE_E4M3);
    QC(UNS, "out_colwise: scale_mode NV16", s.col.scale_mode = FM_SCALE_NV16);
    QC(INV, "out_rowwise: E2M1 elements need scale_mode MX32", s.row.dtype = FM_DTYPE_E2M1);
    QC(INV, "out_colwise: E2M1 elements need scale_mode MX32", s.col.dtype = FM_DTYPE_E2M1; s.col.scale_mode = FM_SCALE_TENSOR);
    QC(INV, "out_rowwise: scale_mode MX32 needs scale_dtype E8M0", s.row.scale_mode = FM_SCALE_MX32);
    QC(INV, "out_rowwise: scale_mode BLOCK_1x128 needs scale_dtype F32", s.row.scale_dtype = FM_DTYPE_E8M0);
    QC(INV, "out_colwise: scale_mode ROW needs scale_dtype F32", s.col.scale_mode = FM_SCALE_ROW; s.col.scale_dtype = FM_DTYPE_BF16);
    QC(INV, "out_rowwise: scale is NULL", s.row.scale = NULL);
    QC(INV, "out_colwise: scale is NULL", s.col.scale = NULL);
    QC(INV, "out_rowwise: data is NULL", s.row.data = NULL);
    QC(INV, "out_rowwise: scale", s.row.scale = arena + ROWS_OFF + 2);
    QC(INV, "out_colwise: scale", s.col.scale = arena + COLS_OFF + 1);
    QC(INV, "out_rowwise: must be row-wise", s.row.layout = FM_LAYOUT_COLWISE);
    QC(INV, "out_colwise: must be column-wise", s.col.layout = FM_LAYOUT_ROWWISE);
    QC(INV, "out_colwise: must be column-wise", s.pcol = &s.row); /* the same descriptor twice */
    QC(INV, "out_rowwise: logical shape", s.row.shape[1] = 128);
    QC(INV, "out_rowwise: logical shape", s.row.ndim = 3; s.row.shape[0] = 1; s.row.shape[1] = 64; s.row.shape[2] = 256);
    QC(INV, "out_colwise: logical shape", s.col.shape[0] = 256; s.col.shape[1] = 64); /* stored, not logical */
    QC(INV, "out_rowwise: device is CUDA", s.row.device = FM_DEVICE_CUDA);
    QC(INV, "out_colwise: device is CUDA", s.col.device = FM_DEVICE_CUDA);
    QC(INV, "out_rowwise: scale_mode 42", s.row.scale_mode = (fm_scale_mode)42);
    QC(INV, "out_rowwise: scale_layout 3", s.row.scale_layout = (fm_scale_layout)3);
    QC(INV, "out_rowwise: invalid shape", s.row.shape[0] = -64);
    QC(INV, "out_rowwise: E2M1 packs two codes per byte", s.in.shape[1] = 255; s.row.shape[1] = 255; s.pcol = NULL;
       s.row.dtype = FM_DTYPE_E2M1; s.row.scale_mode = FM_SCALE_MX32; s.row.scale_dtype = FM_DTYPE_E8M0);
    QC(INV, "out_colwise: E2M1 packs two codes per byte", s.in.shape[0] = 63; s.col.shape[0] = 63; s.prow = NULL;
       s.col.dtype = FM_DTYPE_E2M1; s.col.scale_mode = FM_SCALE_MX32; s.col.scale_dtype = FM_DTYPE_E8M0);
    /* ---- fm_quantize: the config ---- */
    QC(INV, "cfg->rule", s.cfg.rule = (fm_scale_rule)9);
    QC(INV, "cfg->rule", s.cfg.rule = (fm_scale_rule)-2);
    QC(INV, "cfg->rule: EXACT", s.cfg.rule = FM_SCALE_RULE_EXACT; s.row.scale_mode = FM_SCALE_MX32;
       s.row.scale_dtype = FM_DTYPE_E8M0);
    QC(INV, "cfg->rule: MX_FLOOR", s.cfg.rule = FM_SCALE_RULE_MX_FLOOR);
    QC(INV, "cfg->rule: MX_FLOOR", s.cfg.rule = FM_SCALE_RULE_MX_FLOOR; s.row.scale_mode = FM_SCALE_TENSOR; s.pcol = NULL);
    QC(INV, "cfg->epsilon", s.cfg.epsilon = -1.0f);
    QC(INV, "cfg->epsilon", s.cfg.epsilon = NAN);
    QC(INV, "cfg->epsilon", s.cfg.epsilon = INFINITY);
    QC(INV, "cfg->amax", s.cfg.amax = (float *)(arena + AMAX_OFF + 2));
    QC(INV, "cfg->nonfinite_blocks", s.cfg.nonfinite_blocks = (int64_t *)(arena + NF_OFF + 4));
    /* ---- fm_quantize: overlapping buffers ---- */
    QC(INV, "out_rowwise->data and in->data", s.row.data = arena + IN_OFF + 4096);
    QC(INV, "out_rowwise->scale and in->data", s.row.scale = arena + IN_OFF + 64);
    QC(INV, "out_colwise->data and in->data", s.col.data = arena + IN_OFF + 60000);
    QC(INV, "out_rowwise->data and out_rowwise->scale", s.row.scale = arena + ROWD_OFF + 1024);
    QC(INV, "out_rowwise->data and out_colwise->data", s.col.data = arena + ROWD_OFF + 100);
    QC(INV, "out_rowwise->scale and out_colwise->scale", s.col.scale = arena + ROWS_OFF + 256);
    QC(INV, "cfg->amax", s.cfg.amax = (float *)(arena + ROWD_OFF + 64));
    QC(INV, "cfg->amax", s.cfg.amax = (float *)(arena + IN_OFF + 8));
    QC(INV, "cfg->nonfinite_blocks", s.cfg.nonfinite_blocks = (int64_t *)(arena + COLS_OFF + 16));
    QC(INV, "cfg->nonfinite_blocks", s.cfg.nonfinite_blocks = (int64_t *)(void *)s.cfg.amax);

#define DC(want, sub, ...) do { Q(__VA_ARGS__); run_case(ctx, 1, ++id, &s, want, sub); } while (0)
    /* ---- fm_dequantize ---- */
    DC(INV, "in: the descriptor pointer is NULL", s.pqin = NULL);
    DC(INV, "out: the descriptor pointer is NULL", s.pdout = NULL);
    DC(INV, "in: dtype must be E4M3, E5M2 or E2M1", s.qin.dtype = FM_DTYPE_F32);
    DC(INV, "in: a quantized tensor needs a scale_mode", s.qin.scale_mode = FM_SCALE_NONE);
    DC(UNS, "in: scale_mode NV16", s.qin.scale_mode = FM_SCALE_NV16; s.qin.scale_dtype = FM_DTYPE_E4M3);
    DC(INV, "in: E2M1 elements need scale_mode MX32", s.qin.dtype = FM_DTYPE_E2M1);
    DC(INV, "in: scale_mode MX32 needs scale_dtype E8M0", s.qin.scale_mode = FM_SCALE_MX32);
    DC(INV, "in: data is NULL", s.qin.data = NULL);
    DC(INV, "in: scale is NULL", s.qin.scale = NULL);
    DC(INV, "in: scale", s.qin.scale = arena + ROWS_OFF + 3);
    DC(INV, "in: device is CUDA", s.qin.device = FM_DEVICE_CUDA);
    DC(INV, "in: invalid shape", s.qin.ndim = 1);
    DC(INV, "in: E2M1 packs two codes per byte", s.qin.dtype = FM_DTYPE_E2M1; s.qin.scale_mode = FM_SCALE_MX32;
       s.qin.scale_dtype = FM_DTYPE_E8M0; s.qin.shape[1] = 255; s.dout.shape[1] = 255);
    DC(INV, "out: dtype must be F32, BF16 or F16", s.dout.dtype = FM_DTYPE_E4M3);
    DC(INV, "out: dtype must be F32, BF16 or F16", s.dout.dtype = FM_DTYPE_I64);
    DC(INV, "out: must be unscaled", s.dout.scale_mode = FM_SCALE_BLOCK_1x128; s.dout.scale = arena + COLS_OFF);
    DC(INV, "out: logical shape", s.dout.shape[0] = 32);
    DC(INV, "out: logical shape", s.dout.shape[0] = 256; s.dout.shape[1] = 64);
    DC(INV, "out: data is NULL", s.dout.data = NULL);
    DC(INV, "out: data", s.dout.data = arena + DOUT_OFF + 2);
    DC(INV, "out: data", s.dout.dtype = FM_DTYPE_F16; s.dout.data = arena + DOUT_OFF + 1);
    DC(INV, "out: device is CUDA", s.dout.device = FM_DEVICE_CUDA);
    DC(INV, "out->data and in->data", s.dout.data = arena + ROWD_OFF);
    DC(INV, "out->data and in->scale", s.dout.data = arena + ROWS_OFF - 1024);
    DC(INV, "out: invalid shape", s.dout.shape[1] = -256);

#define SC(want, sub, ...) do { Q(__VA_ARGS__); run_case(ctx, 2, ++id, &s, want, sub); } while (0)
    /* ---- fm_scale_layout_convert ---- */
    SC(INV, "src: the descriptor pointer is NULL", s.psrc = NULL);
    SC(INV, "dst: the descriptor pointer is NULL", s.pdst = NULL);
    SC(INV, "src: scale is NULL", s.src.scale = NULL);
    SC(INV, "dst: scale is NULL", s.dst.scale = NULL);
    SC(INV, "dst: must describe the same tensor", s.dst.dtype = FM_DTYPE_E5M2);
    SC(INV, "dst: must describe the same tensor", s.dst.layout = FM_LAYOUT_COLWISE);
    SC(INV, "dst: must describe the same tensor", s.dst.scale_mode = FM_SCALE_BLOCK_128x128);
    SC(INV, "dst: logical shape", s.dst.shape[1] = 384);
    SC(INV, "dst->scale and src->scale", s.dst.scale = arena + ROWS_OFF + 64);
    SC(INV, "src: a quantized tensor needs a scale_mode", s.src.scale_mode = FM_SCALE_NONE);
    SC(INV, "src: dtype must be E4M3, E5M2 or E2M1", s.src.dtype = FM_DTYPE_F32);
    SC(INV, "dst: scale_layout 2", s.dst.scale_layout = FM_SCALE_LAYOUT_COUNT);
    SC(INV, "dst: scale", s.dst.scale = arena + COLS_OFF + 2);
    SC(INV, "dst: device is CUDA", s.dst.device = FM_DEVICE_CUDA);
    SC(UNS, "src: scale_mode NV16", s.src.scale_mode = FM_SCALE_NV16; s.src.scale_dtype = FM_DTYPE_E4M3);
    SC(INV, "dst: scale_mode MX32 needs scale_dtype E8M0", s.src.scale_mode = FM_SCALE_MX32;
       s.src.scale_dtype = FM_DTYPE_E8M0; s.dst.scale_mode = FM_SCALE_MX32);
    SC(INV, "src: invalid shape", s.src.ndim = 5);

    /* ---- NULL context: refused, nothing written ---- */
    baseline(&s);
    CHECK(fm_quantize(NULL, s.pcfg, s.pin, s.prow, s.pcol) == INV, "NULL ctx quantize");
    CHECK(fm_dequantize(NULL, s.pqin, s.pdout) == INV, "NULL ctx dequantize");
    CHECK(fm_scale_layout_convert(NULL, s.psrc, s.pdst) == INV, "NULL ctx convert");
    CHECK(memcmp(arena, snap, ARENA) == 0, "NULL ctx calls wrote nothing");

    /* ---- fm_context_create ---- */
    struct {
        fm_context_config cfg;
        int null_out;
        fm_status want;
        const char *sub;
    } cc[] = {
        {{.backend = FM_BACKEND_CPU}, 1, INV, "out"},
        {{.backend = (fm_backend_kind)7}, 0, INV, "cfg->backend"},
        {{.backend = (fm_backend_kind)-1}, 0, INV, "cfg->backend"},
        {{.backend = FM_BACKEND_CPU, .device = -1}, 0, INV, "cfg->device"},
        {{.backend = FM_BACKEND_CPU, .cpu_threads = -1}, 0, INV, "cfg->cpu_threads"},
        {{.backend = FM_BACKEND_CPU, .cpu_threads = 5000}, 0, INV, "cfg->cpu_threads"},
        {{.backend = FM_BACKEND_AUTO, .device = -3}, 0, INV, "cfg->device"},
    };
    for (size_t i = 0; i < sizeof cc / sizeof cc[0]; i++) {
        fm_context *c = (fm_context *)(void *)arena; /* poisoned: must become NULL */
        fm_status st = fm_context_create(&cc[i].cfg, cc[i].null_out ? NULL : &c);
        n_cases[3]++;
        const char *err = fm_last_error(NULL);
        CHECK(st == cc[i].want, "context case %zu: %s", i, fm_status_name(st));
        CHECK(strlen(err) > 5 && strstr(err, cc[i].sub), "context case %zu: error \"%s\" must name %s", i, err, cc[i].sub);
        if (!cc[i].null_out)
            CHECK(c == NULL, "context case %zu: *out must be NULL on failure", i);
    }
    /* a CUDA context on a machine (or build) without CUDA: NO_DEVICE with a sentence */
    {
        fm_context_config cfg = {.backend = FM_BACKEND_CUDA};
        fm_context *c = NULL;
        fm_status st = fm_context_create(&cfg, &c);
        if (st == FM_OK) {
            fm_context_destroy(c);
        } else {
            CHECK(st == FM_ERR_NO_DEVICE || st == FM_ERR_BACKEND, "CUDA context without a device: %s", fm_status_name(st));
            CHECK(c == NULL && strlen(fm_last_error(NULL)) > 5, "CUDA context failure sentence");
        }
    }
    fm_context *c = NULL;
    CHECK(fm_context_create(NULL, &c) == FM_OK && c, "NULL cfg = AUTO works");
    CHECK(strcmp(fm_last_error(NULL), "") == 0, "create error cleared after success");
    fm_context_destroy(c);

    int total = n_cases[0] + n_cases[1] + n_cases[2] + n_cases[3];
    printf("invalid cases: %d quantize, %d dequantize, %d scale_layout_convert, %d context_create = %d\n", n_cases[0],
           n_cases[1], n_cases[2], n_cases[3], total);
    CHECK(total >= 60, "at least 60 invalid cases");
    fm_context_destroy(ctx);
    free(arena);
    free(snap);
    return tu_end();
}
