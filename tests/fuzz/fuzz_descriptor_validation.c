/* Fuzzes the descriptor validation of every public op with random
 * descriptors: shapes (negative, huge, overflowing), dtypes, layouts, scale
 * modes and layouts (in and out of range), NULL, misaligned and aliasing
 * pointers, declared capacities, and the ops' config structs.
 *
 * Every buffer is a real allocation of exactly the size the descriptor
 * declares: its data_capacity / scale_capacity when given, else the size the
 * shape needs. So an op that accepts a call and then writes past what it was
 * given is an AddressSanitizer report, not a silent corruption.
 *
 * Oracle, per call:
 *   - no crash, no sanitizer report;
 *   - a documented status; a NULL context gives FM_ERR_INVALID_ARG;
 *   - on failure fm_last_error is a sentence (non-empty), on success "";
 *   - a call refused with FM_ERR_INVALID_ARG or FM_ERR_UNSUPPORTED wrote no
 *     byte of any buffer it was given and counted nothing in the statistics;
 *   - an accepted call's outputs do not overlap any other buffer of the call.
 *
 * The ops of gemm.h and moe.h (and fm_transpose_scaled_grouped) are bound
 * weakly: they are fuzzed when the library defines them and skipped when the
 * build predates them. Until their backends exist they must still refuse
 * cleanly (FM_ERR_UNSUPPORTED after validation). */
#include <limits.h>
#include <math.h>
#include <string.h>

#include "flowmoe/flowmoe.h"
#include "fuzz_common.h"
#include "fuzz_cpu_context.h"

#pragma weak fm_transpose_scaled_grouped
#pragma weak fm_gemm
#pragma weak fm_linear_forward
#pragma weak fm_linear_dgrad
#pragma weak fm_linear_wgrad
#pragma weak fm_grouped_gemm
#pragma weak fm_grouped_gemm_wgrad
#pragma weak fm_moe_router
#pragma weak fm_moe_router_backward
#pragma weak fm_moe_permute
#pragma weak fm_moe_unpermute
#pragma weak fm_moe_unpermute_backward
#pragma weak fm_moe_swiglu
#pragma weak fm_moe_swiglu_backward

#define NSLOT 8
/* Big enough for shapes that span several 128-blocks, small enough to keep
 * executions fast; larger shapes get a smaller declared capacity. */
#define MAX_BUF (192u << 10)
#define NBUF (2 * NSLOT + 8)

static fm_context *g_ctx;
/* FM_FUZZ_TRACE=1: one line per call (op, status, error), to see what a
 * corpus reaches: `fuzz_descriptor_validation corpus/... -runs=0`. */
static int g_trace;

/* Every allocation of one case, so that all can be snapshotted and freed. */
typedef struct {
    uint8_t *p[NBUF], *snap[NBUF];
    size_t n[NBUF];
    int count;
} arena;

static uint8_t *arena_alloc(arena *a, size_t n, uint64_t *seed, int fill)
{
    if (a->count == NBUF)
        return NULL;
    uint8_t *p = malloc(n ? n : 1);
    if (!p)
        abort();
    for (size_t i = 0; i < n; i++) {
        if (fill == 0)
            p[i] = 0;
        else if (fill == 1) /* F32 1.0 read either as F32 or as bytes: 0x3F800000, E8M0 127-ish */
            p[i] = (uint8_t[]){0x00, 0x00, 0x80, 0x3F}[i & 3];
        else
            p[i] = (uint8_t)fz_mix(seed);
    }
    a->p[a->count] = p;
    a->n[a->count] = n;
    a->snap[a->count] = NULL;
    a->count++;
    return p;
}

static void arena_snapshot(arena *a)
{
    for (int i = 0; i < a->count; i++) {
        a->snap[i] = malloc(a->n[i] ? a->n[i] : 1);
        if (!a->snap[i])
            abort();
        memcpy(a->snap[i], a->p[i], a->n[i]);
    }
}

static int arena_changed(const arena *a)
{
    for (int i = 0; i < a->count; i++)
        if (memcmp(a->snap[i], a->p[i], a->n[i]))
            return i;
    return -1;
}

static void arena_free(arena *a)
{
    for (int i = 0; i < a->count; i++) {
        free(a->p[i]);
        free(a->snap[i]);
    }
    a->count = 0;
}

/* FM_FUZZ_TRACE: the call's descriptors, to turn a finding into a test. */
static void trace_call(const char *name, fm_tensor *const *tp, int nt, const fm_splits *sp)
{
    fprintf(stderr, "call %s\n", name);
    for (int i = 0; i < nt; i++) {
        const fm_tensor *t = tp[i];
        if (!t) {
            fprintf(stderr, "  t%d NULL\n", i);
            continue;
        }
        fprintf(stderr, "  t%d %s %s %s %s ndim %d [%lld %lld %lld] data %p cap %lld scale %p cap %lld dev %d\n", i,
                fm_dtype_name(t->dtype), fm_scale_mode_name(t->scale_mode), t->layout ? "colwise" : "rowwise",
                fm_scale_layout_name(t->scale_layout), t->ndim, (long long)t->shape[0], (long long)t->shape[1],
                (long long)t->shape[2], t->data, (long long)t->data_capacity, t->scale,
                (long long)t->scale_capacity, (int)t->device);
    }
    if (sp) {
        fprintf(stderr, "  splits %lld:", (long long)sp->groups);
        for (int64_t g = 0; sp->host && g < sp->groups && g < 16; g++)
            fprintf(stderr, " %lld", (long long)sp->host[g]);
        fprintf(stderr, "\n");
    }
}

static int64_t dim_from(uint8_t b)
{
    static const int64_t special[] = {128, 256, 257, 384, 511, 512, 1000, 4096, 65536, (int64_t)1 << 20,
                                      INT32_MAX, (int64_t)INT32_MAX + 1, (int64_t)1 << 40, INT64_MAX, -1, -128,
                                      INT64_MIN, 2, 32, 33};
    if (b < 160)
        return b;
    return special[(b - 160) % (sizeof special / sizeof special[0])];
}

/* Plausible templates first, so that valid calls are common and each
 * mutation then breaks one rule; the last template is all random fields. */
typedef struct {
    fm_dtype dt;
    fm_scale_mode m;
    fm_layout l;
} templ;
static const templ templates[] = {
    {FM_DTYPE_F32, FM_SCALE_NONE, FM_LAYOUT_ROWWISE},        {FM_DTYPE_BF16, FM_SCALE_NONE, FM_LAYOUT_ROWWISE},
    {FM_DTYPE_F16, FM_SCALE_NONE, FM_LAYOUT_ROWWISE},        {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE},
    {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE}, {FM_DTYPE_E5M2, FM_SCALE_MX32, FM_LAYOUT_ROWWISE},
    {FM_DTYPE_E4M3, FM_SCALE_MX32, FM_LAYOUT_COLWISE},       {FM_DTYPE_E2M1, FM_SCALE_MX32, FM_LAYOUT_ROWWISE},
    {FM_DTYPE_E2M1, FM_SCALE_MX32, FM_LAYOUT_COLWISE},       {FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_LAYOUT_ROWWISE},
    {FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_LAYOUT_ROWWISE},     {FM_DTYPE_E5M2, FM_SCALE_ROW, FM_LAYOUT_ROWWISE},
    {FM_DTYPE_I32, FM_SCALE_NONE, FM_LAYOUT_ROWWISE},        {FM_DTYPE_I64, FM_SCALE_NONE, FM_LAYOUT_ROWWISE},
    {FM_DTYPE_F32, FM_SCALE_NONE, FM_LAYOUT_COLWISE},        {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE},
};
#define NTEMPL ((int)(sizeof templates / sizeof templates[0]))

typedef struct {
    fm_tensor t;
    uint8_t *dbuf, *sbuf; /* own allocations (NULL when none) */
    size_t dlen, slen;
} slot;

static int enum_from(uint8_t b, int count)
{
    /* Mostly in range; now and then one past the end, a large or a negative value. */
    if (b < 224)
        return b % count;
    static const int odd[] = {FM_DTYPE_COUNT, 99, -1, INT_MAX, INT_MIN, 7, 3, 2};
    return odd[b % 8];
}

/* Allocation size for a declared need: honest when it fits, else a smaller
 * buffer with a declared capacity the op must refuse. */
static size_t size_for(int64_t need, int capmode, uint8_t cut, int64_t *cap)
{
    if (need < 0 || need > (int64_t)MAX_BUF) {
        *cap = 64;
        return 64;
    }
    if (capmode == 0) { /* no capacity given: the shape's size */
        *cap = 0;
        return (size_t)need;
    }
    if (capmode == 1 || need == 0) { /* the exact capacity */
        *cap = need ? need : 0;
        return (size_t)need;
    }
    int64_t c = need - 1 - (cut % (need < 64 ? need : 64)); /* too small: >= 0 */
    if (c < 1) {
        *cap = need;
        return (size_t)need;
    }
    *cap = c;
    return (size_t)c;
}

static void make_slot(fz_reader *r, arena *a, slot *s, const int64_t dims[4], uint64_t *seed)
{
    memset(s, 0, sizeof *s);
    uint8_t kind = fz_u8(r), nd = fz_u8(r), d0 = fz_u8(r), mut = fz_u8(r), mval = fz_u8(r), caps = fz_u8(r),
            cut = fz_u8(r), fill = fz_u8(r);
    fm_tensor *t = &s->t;
    const templ *tp = &templates[kind % NTEMPL];
    int random = kind >= 240;
    t->dtype = random ? (fm_dtype)enum_from(fz_u8(r), FM_DTYPE_COUNT) : tp->dt;
    t->scale_mode = random ? (fm_scale_mode)enum_from(fz_u8(r), FM_SCALE_MODE_COUNT) : tp->m;
    t->layout = random ? (fm_layout)enum_from(fz_u8(r), FM_LAYOUT_COUNT) : tp->l;
    t->scale_dtype = fm_scale_mode_dtype(t->scale_mode);
    t->scale_layout = (kind & 0x80) ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
    t->device = FM_DEVICE_HOST;
    t->ndim = (nd & 7) == 7 ? 3 : 2;
    /* dims from the shared pool so that the arguments' shapes agree often */
    for (int k = 0; k < 3; k++)
        t->shape[k] = dims[(d0 >> (2 * k)) & 3];
    if (t->ndim == 3 && t->shape[0] > 4 && t->shape[0] < 160)
        t->shape[0] = 1 + t->shape[0] % 4;

    switch (mut % 24) { /* at most one broken (or odd) field; most cases keep the template */
    case 0: t->ndim = (int)(int8_t)mval; break;
    case 1: t->shape[mval % 3] = dim_from(mval); break;
    case 2: t->dtype = (fm_dtype)enum_from(mval, FM_DTYPE_COUNT); break;
    case 3: t->scale_mode = (fm_scale_mode)enum_from(mval, FM_SCALE_MODE_COUNT); break;
    case 4: t->scale_dtype = (fm_dtype)enum_from(mval, FM_DTYPE_COUNT); break;
    case 5: t->layout = (fm_layout)enum_from(mval, FM_LAYOUT_COUNT); break;
    case 6: t->scale_layout = (fm_scale_layout)enum_from(mval, FM_SCALE_LAYOUT_COUNT); break;
    case 7: t->device = (fm_device)enum_from(mval, FM_DEVICE_COUNT); break;
    case 8: t->shape[1] = t->shape[1] | 1; break; /* odd: E2M1 packing */
    default: break;
    }

    int64_t need = fm_tensor_nbytes(t);
    int64_t sneed = t->scale_mode != FM_SCALE_NONE ? fm_tensor_scale_nbytes(t) : 0;
    int64_t dcap, scap;
    int misalign = (caps >> 4) == 1;
    s->dlen = size_for(need, caps & 3, cut, &dcap);
    s->slen = size_for(sneed < 0 ? -1 : sneed, (caps >> 2) & 3, cut >> 3, &scap);
    s->dbuf = arena_alloc(a, s->dlen + (size_t)misalign, seed, fill % 3);
    s->sbuf = arena_alloc(a, s->slen + (size_t)misalign, seed, (fill / 3) % 3);
    t->data = s->dbuf ? s->dbuf + misalign : NULL;
    t->scale = s->sbuf ? s->sbuf + misalign : NULL;
    t->data_capacity = dcap;
    t->scale_capacity = scap;
    if (t->scale_mode == FM_SCALE_NONE && !(caps & 0x80))
        t->scale = NULL;
    switch (caps >> 5) {
    case 2: t->data = NULL; break;
    case 3: t->scale = NULL; break;
    default: break;
    }
}

/* An aliasing pointer into another slot's buffer, with the capacity that is
 * really left there declared. */
static void alias_into(slot *s, int scale_side, const slot *o, int o_scale_side, uint8_t off)
{
    uint8_t *base = o_scale_side ? o->sbuf : o->dbuf;
    size_t len = o_scale_side ? o->slen : o->dlen;
    if (!base || len == 0)
        return;
    size_t k = (size_t)off * len / 256;
    if (scale_side) {
        s->t.scale = base + k;
        s->t.scale_capacity = (int64_t)(len - k);
    } else {
        s->t.data = base + k;
        s->t.data_capacity = (int64_t)(len - k);
    }
}

enum {
    OP_QUANTIZE, OP_DEQUANTIZE, OP_SCALE_LAYOUT, OP_TRANSPOSE, OP_CONVERT, OP_TRANSPOSE_GROUPED, OP_GEMM,
    OP_LIN_FWD, OP_LIN_DGRAD, OP_LIN_WGRAD, OP_GROUPED_GEMM, OP_GROUPED_WGRAD, OP_ROUTER, OP_ROUTER_BWD,
    OP_PERMUTE, OP_UNPERMUTE, OP_UNPERMUTE_BWD, OP_SWIGLU, OP_SWIGLU_BWD, OP_CONTEXT, NOPS
};

/* Per op: tensor arguments, which are outputs (bit i), which are read only
 * through their scales (their data pointer is not the op's business). */
static const struct {
    const char *name;
    int nt;
    unsigned out, scales_only;
} ops[NOPS] = {
    [OP_QUANTIZE] = {"fm_quantize", 3, 0x6, 0},
    [OP_DEQUANTIZE] = {"fm_dequantize", 2, 0x2, 0},
    [OP_SCALE_LAYOUT] = {"fm_scale_layout_convert", 2, 0x2, 0x3},
    [OP_TRANSPOSE] = {"fm_transpose_scaled", 2, 0x2, 0},
    [OP_CONVERT] = {"fm_convert_scaled", 2, 0x2, 0},
    [OP_TRANSPOSE_GROUPED] = {"fm_transpose_scaled_grouped", 2, 0x2, 0},
    [OP_GEMM] = {"fm_gemm", 3, 0x4, 0},
    [OP_LIN_FWD] = {"fm_linear_forward", 3, 0x4, 0},
    [OP_LIN_DGRAD] = {"fm_linear_dgrad", 3, 0x4, 0},
    [OP_LIN_WGRAD] = {"fm_linear_wgrad", 3, 0x4, 0},
    [OP_GROUPED_GEMM] = {"fm_grouped_gemm", 3, 0x4, 0},
    [OP_GROUPED_WGRAD] = {"fm_grouped_gemm_wgrad", 3, 0x4, 0},
    [OP_ROUTER] = {"fm_moe_router", 4, 0xE, 0},
    [OP_ROUTER_BWD] = {"fm_moe_router_backward", 4, 0x8, 0},
    [OP_PERMUTE] = {"fm_moe_permute", 8, 0xF8, 0},
    [OP_UNPERMUTE] = {"fm_moe_unpermute", 4, 0x8, 0},
    [OP_UNPERMUTE_BWD] = {"fm_moe_unpermute_backward", 7, 0x60, 0},
    [OP_SWIGLU] = {"fm_moe_swiglu", 5, 0x1C, 0},
    [OP_SWIGLU_BWD] = {"fm_moe_swiglu_backward", 6, 0x38, 0},
    [OP_CONTEXT] = {"fm_context_create", 0, 0, 0},
};

static int op_linked(int op)
{
    switch (op) {
    case OP_TRANSPOSE_GROUPED: return fm_transpose_scaled_grouped != NULL;
    case OP_GEMM: return fm_gemm != NULL;
    case OP_LIN_FWD: return fm_linear_forward != NULL;
    case OP_LIN_DGRAD: return fm_linear_dgrad != NULL;
    case OP_LIN_WGRAD: return fm_linear_wgrad != NULL;
    case OP_GROUPED_GEMM: return fm_grouped_gemm != NULL;
    case OP_GROUPED_WGRAD: return fm_grouped_gemm_wgrad != NULL;
    case OP_ROUTER: return fm_moe_router != NULL;
    case OP_ROUTER_BWD: return fm_moe_router_backward != NULL;
    case OP_PERMUTE: return fm_moe_permute != NULL;
    case OP_UNPERMUTE: return fm_moe_unpermute != NULL;
    case OP_UNPERMUTE_BWD: return fm_moe_unpermute_backward != NULL;
    case OP_SWIGLU: return fm_moe_swiglu != NULL;
    case OP_SWIGLU_BWD: return fm_moe_swiglu_backward != NULL;
    default: return 1;
    }
}

static void *small_ptr(fz_reader *r, arena *a, slot *sl, int nsl, size_t bytes, uint64_t *seed)
{
    uint8_t b = fz_u8(r);
    switch (b % 6) {
    case 0: return NULL;
    case 1: { /* misaligned */
        uint8_t *p = arena_alloc(a, bytes + 1, seed, 0);
        return p ? p + 1 : NULL;
    }
    case 2: { /* into a tensor's buffer (where it still has room) */
        const slot *o = &sl[(b >> 3) % nsl];
        uint8_t *base = (b & 0x80) ? o->sbuf : o->dbuf;
        size_t len = (b & 0x80) ? o->slen : o->dlen;
        if (base && len >= bytes)
            return base + (len - bytes) / 8 * 8 * (b & 1);
        return NULL;
    }
    default: return arena_alloc(a, bytes, seed, 0);
    }
}

static float odd_float(uint8_t b)
{
    static const float v[] = {0.0f, 1e-3f, 1e-30f, -1.0f, 1e30f};
    switch (b % 8) {
    case 5: return NAN;
    case 6: return INFINITY;
    case 7: return -0.0f;
    default: return v[b % 8];
    }
}

/* Groups: a host array the size it claims (the op cannot check that), or
 * NULL; sizes from the dims pool, so sums match a tensor's rows often. */
static fm_splits make_splits(fz_reader *r, arena *a, const int64_t dims[4], uint64_t *seed)
{
    fm_splits sp = {0};
    uint8_t g = fz_u8(r), how = fz_u8(r);
    sp.groups = g < 200 ? 1 + g % 8 : (int64_t[]){0, -1, INT64_MIN, (int64_t)1 << 40, 65}[g % 5];
    int with_host = (how & 3) != 0 && sp.groups >= 1 && sp.groups <= 65;
    if (with_host) {
        int64_t *h = (int64_t *)(void *)arena_alloc(a, (size_t)sp.groups * sizeof(int64_t), seed, 0);
        if (h) {
            for (int64_t k = 0; k < sp.groups; k++) {
                uint8_t v = fz_u8(r);
                h[k] = v < 192 ? dims[v & 3] / (1 + ((v >> 2) & 3)) : dim_from(v);
            }
            sp.host = h;
            if (how & 4) /* the CPU backend must not need it; it is readable host memory anyway */
                sp.device = h;
        }
    }
    return sp;
}

static int64_t cols_of(const fm_tensor *t)
{
    return (t->ndim == 2 || t->ndim == 3) ? t->shape[t->ndim - 1] : -1;
}

static void check_disjoint_outputs(int op, slot *sl, fm_tensor **tp)
{
    for (int i = 0; i < ops[op].nt; i++) {
        if (!((ops[op].out >> i) & 1) || !tp[i])
            continue;
        for (int j = 0; j < ops[op].nt; j++) {
            if (j == i || !tp[j])
                continue;
            for (int a = 0; a < 2; a++)
                for (int b = 0; b < 2; b++) {
                    const fm_tensor *x = tp[i], *y = tp[j];
                    if ((!a && ((ops[op].scales_only >> i) & 1)) || (!b && ((ops[op].scales_only >> j) & 1)))
                        continue;
                    const uint8_t *p = a ? x->scale : x->data, *q = b ? y->scale : y->data;
                    int64_t pn = a ? (x->scale_mode ? fm_tensor_scale_nbytes(x) : 0) : fm_tensor_nbytes(x);
                    int64_t qn = b ? (y->scale_mode ? fm_tensor_scale_nbytes(y) : 0) : fm_tensor_nbytes(y);
                    if (p && q && pn > 0 && qn > 0 && p < q + qn && q < p + pn)
                        fz_fail("%s accepted output %d (%s) overlapping argument %d (%s)", ops[op].name, i,
                                a ? "scale" : "data", j, b ? "scale" : "data");
                }
        }
    }
    (void)sl;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    g_ctx = fz_cpu_context();
    g_trace = getenv("FM_FUZZ_TRACE") != NULL;
    return 0;
}

static void fuzz_context_create(fz_reader *r)
{
    fm_context_config cfg = {0};
    cfg.backend = (fm_backend_kind)enum_from(fz_u8(r), FM_BACKEND_COUNT);
    cfg.device = (int)(int8_t)fz_u8(r);
    cfg.cpu_threads = (int)(int16_t)(fz_u8(r) | fz_u8(r) << 8) % 200;
    cfg.workspace_bytes = (size_t)fz_u8(r) << 20;
    fm_context *c = (fm_context *)(uintptr_t)0x1; /* poison: must be set */
    int null_cfg = fz_u8(r) == 0xFF;
    fm_status st = fm_context_create(null_cfg ? NULL : &cfg, &c);
    if (st == FM_OK) {
        if (!c || fm_last_error(NULL)[0])
            fz_fail("fm_context_create: FM_OK with ctx %p and error \"%s\"", (void *)c, fm_last_error(NULL));
        /* Every op of the fresh context refuses NULL arguments with a sentence. */
        if (fm_dequantize(c, NULL, NULL) != FM_ERR_INVALID_ARG || !fm_last_error(c)[0])
            fz_fail("fresh context: fm_dequantize(NULL, NULL) not refused with a sentence");
        fm_context_destroy(c);
        return;
    }
    if (st > FM_ERR_NO_DEVICE || c != NULL || !fm_last_error(NULL)[0])
        fz_fail("fm_context_create: status %d, ctx %p, error \"%s\"", (int)st, (void *)c, fm_last_error(NULL));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_reader rd = {data, size, 0}, *r = &rd;
    int op = fz_u8(r) % NOPS;
    uint8_t flags = fz_u8(r);
    if (!op_linked(op))
        return 0;
    if (op == OP_CONTEXT) {
        fuzz_context_create(r);
        return 0;
    }
    uint64_t seed = fz_u32(r);
    int64_t dims[4];
    for (int k = 0; k < 4; k++)
        dims[k] = dim_from(fz_u8(r));

    arena a = {0};
    slot sl[NSLOT];
    fm_tensor *tp[NSLOT];
    int nt = ops[op].nt;
    for (int i = 0; i < nt; i++) {
        make_slot(r, &a, &sl[i], dims, &seed);
        uint8_t p = fz_u8(r);
        tp[i] = p == 0xFF ? NULL : &sl[i].t; /* a NULL descriptor */
    }
    /* Aliasing: one or two pointers moved into another argument's buffer. */
    for (int k = 0; k < 2 && nt > 1; k++) {
        uint8_t b = fz_u8(r), off = fz_u8(r);
        if (b < 200)
            continue;
        int i = b % nt, j = (b / 8) % nt;
        alias_into(&sl[i], b & 1, &sl[j], (b >> 1) & 1, off);
    }
    if (op == OP_QUANTIZE && (flags & 0x40))
        tp[2] = tp[1]; /* the same descriptor as both outputs */

    fm_quant_config qc = {0};
    qc.rule = (fm_scale_rule)enum_from(fz_u8(r), FM_SCALE_RULE_COUNT);
    qc.epsilon = (flags & 0x10) ? odd_float(fz_u8(r)) : 0.0f;
    qc.amax = small_ptr(r, &a, sl, nt, sizeof(float), &seed);
    qc.nonfinite_blocks = small_ptr(r, &a, sl, nt, sizeof(int64_t), &seed);
    fm_requant_config rc = {0};
    rc.rule = (fm_requant_rule)enum_from(fz_u8(r), FM_REQUANT_RULE_COUNT);
    rc.nonfinite_blocks = small_ptr(r, &a, sl, nt, sizeof(int64_t), &seed);
    fm_gemm_config gc = {.accumulate = (int)(int8_t)fz_u8(r) % 3};
    fm_splits sp = make_splits(r, &a, dims, &seed);
    fm_router_config roc = {0};
    roc.topk = (int)(int8_t)fz_u8(r);
    roc.score = (fm_router_score)enum_from(fz_u8(r), FM_ROUTER_SCORE_COUNT);
    roc.renormalize = fz_u8(r) & 1;
    fm_permute_config pc = {.pad_multiple = (int)(int8_t)fz_u8(r)};
    if (pc.pad_multiple == -128)
        pc.pad_multiple = INT_MAX;
    int64_t *host_splits = NULL;
    if (op == OP_ROUTER || op == OP_ROUTER_BWD) {
        /* bias is [E] with E the logits' columns: allocated that size or absent */
        int64_t e = cols_of(&sl[0].t);
        if ((flags & 0x20) && e > 0 && e <= 4096)
            roc.bias = (const float *)(void *)arena_alloc(&a, (size_t)e * sizeof(float), &seed, 1);
    }
    if (op == OP_PERMUTE && (flags & 0x20)) {
        int64_t e = cols_of(&sl[6].t);
        if (e > 0 && e <= 4096)
            host_splits = (int64_t *)(void *)arena_alloc(&a, (size_t)e * sizeof(int64_t), &seed, 0);
    }
    /* "No capacity" (0) means the caller vouches for what the op needs, and
     * a grouped column-wise output needs more scales than its shape's
     * ungrouped size (what make_slot allocated): declare the real
     * allocation so that the op has to refuse a short one. */
    if (op == OP_TRANSPOSE_GROUPED && tp[1] && sl[1].sbuf && sl[1].t.scale_capacity == 0 &&
        (uint8_t *)sl[1].t.scale >= sl[1].sbuf && (uint8_t *)sl[1].t.scale <= sl[1].sbuf + 1) {
        if (sl[1].slen > 0)
            sl[1].t.scale_capacity = (int64_t)sl[1].slen;
        else
            sl[1].t.scale = NULL; /* nothing allocated: no capacity to declare */
    }
    const fm_quant_config *pq = (flags & 1) ? NULL : &qc;
    const fm_requant_config *prc = (flags & 1) ? NULL : &rc;
    const fm_gemm_config *pg = (flags & 1) ? NULL : &gc;
    const fm_router_config *pro = (flags & 1) ? NULL : &roc;
    const fm_permute_config *pp = (flags & 1) ? NULL : &pc;
    fm_context *ctx = (flags & 0x80) && (flags & 2) ? NULL : g_ctx;

    fm_stats before, after;
    fm_stats_get(g_ctx, &before);
    arena_snapshot(&a);
    fm_status st = FM_OK;
    /* Optional arguments left out are NULLed in tp too, so that the
     * disjointness oracle judges only what the call was given. */
    fm_tensor **t = tp;
    if (g_trace)
        trace_call(ops[op].name, tp, nt, op == OP_TRANSPOSE_GROUPED && !(flags & 4) ? &sp : NULL);
    switch (op) {
    case OP_QUANTIZE: st = fm_quantize(ctx, pq, t[0], t[1], t[2]); break;
    case OP_DEQUANTIZE: st = fm_dequantize(ctx, t[0], t[1]); break;
    case OP_SCALE_LAYOUT: st = fm_scale_layout_convert(ctx, t[0], t[1]); break;
    case OP_TRANSPOSE: st = fm_transpose_scaled(ctx, prc, t[0], t[1]); break;
    case OP_CONVERT: st = fm_convert_scaled(ctx, prc, t[0], t[1]); break;
    case OP_TRANSPOSE_GROUPED: st = fm_transpose_scaled_grouped(ctx, prc, (flags & 4) ? NULL : &sp, t[0], t[1]); break;
    case OP_GEMM: st = fm_gemm(ctx, pg, t[0], t[1], t[2]); break;
    case OP_LIN_FWD: st = fm_linear_forward(ctx, pg, t[0], t[1], t[2]); break;
    case OP_LIN_DGRAD: st = fm_linear_dgrad(ctx, pg, t[0], t[1], t[2]); break;
    case OP_LIN_WGRAD: st = fm_linear_wgrad(ctx, pg, t[0], t[1], t[2]); break;
    case OP_GROUPED_GEMM: st = fm_grouped_gemm(ctx, pg, (flags & 4) ? NULL : &sp, t[0], t[1], t[2]); break;
    case OP_GROUPED_WGRAD: st = fm_grouped_gemm_wgrad(ctx, pg, (flags & 4) ? NULL : &sp, t[0], t[1], t[2]); break;
    case OP_ROUTER: st = fm_moe_router(ctx, pro, t[0], t[1], t[2], (t[3] = (flags & 8) ? NULL : t[3])); break;
    case OP_ROUTER_BWD: st = fm_moe_router_backward(ctx, pro, t[0], t[1], t[2], t[3]); break;
    case OP_PERMUTE:
        st = fm_moe_permute(ctx, pp, t[0], t[1], (t[2] = (flags & 8) ? NULL : t[2]), t[3], t[4], t[5], t[6],
                            (t[7] = (flags & 8) ? NULL : t[7]), host_splits);
        break;
    case OP_UNPERMUTE: st = fm_moe_unpermute(ctx, t[0], t[1], (t[2] = (flags & 8) ? NULL : t[2]), t[3]); break;
    case OP_UNPERMUTE_BWD:
        st = fm_moe_unpermute_backward(ctx, t[0], t[1], t[2], t[3], (t[4] = (flags & 8) ? NULL : t[4]), t[5],
                                       (t[6] = (flags & 8) ? NULL : t[6]));
        break;
    case OP_SWIGLU:
        st = fm_moe_swiglu(ctx, pq, t[0], (t[1] = (flags & 8) ? NULL : t[1]), t[2], (t[3] = (flags & 4) ? NULL : t[3]),
                           (t[4] = (flags & 4) ? t[4] : NULL));
        break;
    case OP_SWIGLU_BWD:
        st = fm_moe_swiglu_backward(ctx, pq, t[0], t[1], (t[2] = (flags & 8) ? NULL : t[2]), t[3], (t[4] = (flags & 4) ? NULL : t[4]),
                                    (t[5] = (flags & 8) ? NULL : t[5]));
        break;
    default: break;
    }
    fm_stats_get(g_ctx, &after);
    if (g_trace)
        fprintf(stderr, "trace %s %s %s\n", ops[op].name, fm_status_name(st), ctx ? fm_last_error(ctx) : "(NULL ctx)");

    if ((unsigned)st > FM_ERR_NO_DEVICE)
        fz_fail("%s returned %d, not an fm_status", ops[op].name, (int)st);
    if (!ctx) {
        if (st != FM_ERR_INVALID_ARG)
            fz_fail("%s with a NULL context returned %s", ops[op].name, fm_status_name(st));
    } else if (st != FM_OK) {
        const char *e = fm_last_error(ctx);
        if (!e || strlen(e) < 8)
            fz_fail("%s returned %s with error sentence \"%s\"", ops[op].name, fm_status_name(st), e ? e : "(null)");
    } else if (fm_last_error(ctx)[0]) {
        fz_fail("%s succeeded but fm_last_error is \"%s\"", ops[op].name, fm_last_error(ctx));
    }
    if (st == FM_ERR_INVALID_ARG || st == FM_ERR_UNSUPPORTED) {
        int b = arena_changed(&a);
        if (b >= 0)
            fz_fail("%s refused the call (%s: \"%s\") but buffer %d changed", ops[op].name, fm_status_name(st),
                    ctx ? fm_last_error(ctx) : "", b);
        if (memcmp(&before, &after, sizeof before))
            fz_fail("%s refused the call (%s) but the statistics changed", ops[op].name, fm_status_name(st));
    }
    if (st == FM_OK)
        check_disjoint_outputs(op, sl, tp);
    arena_free(&a);
    return 0;
}
