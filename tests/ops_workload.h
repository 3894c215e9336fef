/* Every public op of flowmoe on one context over fixed inputs, each output
 * read back into a named blob: the workload shared by the determinism tests
 * (CPU at several thread counts, CUDA run to run) and by the CUDA-against-CPU
 * non-finite test.
 *
 * Only the public API is used: inputs are copied into the context's memory
 * with fm_context_copy, outputs are fm_context_alloc'ed and poisoned with
 * fm_context_memset (a byte chosen per run, so that an element an op forgets
 * to write shows up as a difference), and read back with fm_context_copy. The
 * same code therefore runs on the CPU and on the CUDA backend.
 *
 * Inputs are made once, on the host, by wl_setup: random values from a seed,
 * and the quantized, routed and permuted inputs of the later ops made by a
 * CPU context (so every run of every backend starts from the same bytes).
 * `safe` picks shapes every CUDA path takes (cuBLASLt's FP8 kernels want
 * multiples of 128); otherwise the shapes are odd. `nasty` puts NaN, +-Inf,
 * non-canonical NaN payloads, overflow-sized values (3e38, or 1e20 rows whose
 * products overflow) and subnormals into every input; otherwise the inputs
 * hold only a few NaN and Inf. */
#ifndef FM_OPS_WORKLOAD_H
#define FM_OPS_WORKLOAD_H

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flowmoe/flowmoe.h"

/* ---- host tensors ---------------------------------------------------------- */

typedef struct {
    fm_tensor t;    /* host pointers */
    size_t nd, ns;  /* data and scale bytes */
} wl_host;

static void wl_die(const char *what, fm_context *ctx)
{
    fprintf(stderr, "ops workload setup: %s: %s\n", what, fm_last_error(ctx));
    exit(1);
}

static fm_tensor wl_desc(fm_dtype dt, fm_scale_mode m, fm_layout lay, fm_scale_layout sl, int ndim, int64_t e,
                         int64_t r, int64_t c)
{
    fm_tensor t = ndim == 3 ? fm_tensor_3d(NULL, dt, e, r, c) : fm_tensor_2d(NULL, dt, r, c);
    t.layout = lay;
    t.scale_mode = m;
    if (m != FM_SCALE_NONE)
        t.scale_dtype = fm_scale_mode_dtype(m);
    t.scale_layout = sl;
    return t;
}

static fm_tensor wl_plain(fm_dtype dt, int64_t r, int64_t c) { return fm_tensor_2d(NULL, dt, r, c); }

/* ns_bytes: the scale bytes when they are not the descriptor's own (grouped layouts). */
static wl_host wl_host_new(fm_tensor proto, int64_t ns_bytes)
{
    wl_host h;
    h.t = proto;
    h.nd = (size_t)fm_tensor_nbytes(&proto);
    h.ns = proto.scale_mode == FM_SCALE_NONE ? 0
         : ns_bytes > 0                      ? (size_t)ns_bytes
                                             : (size_t)fm_tensor_scale_nbytes(&proto);
    h.t.data = calloc(h.nd + 8, 1);
    h.t.scale = h.ns ? calloc(h.ns + 8, 1) : NULL;
    h.t.device = FM_DEVICE_HOST;
    return h;
}

static void wl_host_free(wl_host *h)
{
    free(h->t.data);
    free(h->t.scale);
    h->t.data = h->t.scale = NULL;
}

/* ---- the seeded generator ---------------------------------------------------- */

static uint64_t wl_state;
static uint64_t wl_next(void)
{
    uint64_t z = (wl_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static int64_t wl_int(int64_t lo, int64_t hi) { return lo + (int64_t)(wl_next() % (uint64_t)(hi - lo + 1)); }
static float wl_val(void) { return (float)((double)(wl_next() >> 11) / 9007199254740992.0 * 4.0 - 2.0); }

/* Specials: NaN (canonical and with a payload, both signs), +-Inf,
 * overflow-sized finite values, a subnormal, -0. */
static const uint32_t wl_specials[] = {0x7FC00000u, 0xFFC12345u, 0x7F800000u, 0xFF800000u,
                                       0x7F61B1E6u /* 3e38 */, 0xFF782C96u /* -3.3e38 */, 0x00000005u, 0x80000000u};
enum { WL_NSPECIALS = sizeof wl_specials / sizeof wl_specials[0] };

static float wl_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* n values of rows of `cols`: random in [-2, 2), with specials: nasty puts
 * one in about every 40 values, light puts one NaN and one +Inf. */
static void wl_fill(float *x, int64_t n, int nasty)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = wl_val();
    if (n == 0)
        return;
    if (!nasty) {
        x[wl_int(0, n - 1)] = wl_bits(0x7FC00000u);
        x[wl_int(0, n - 1)] = wl_bits(0x7F800000u);
        return;
    }
    for (int64_t i = 0; i < n / 40 + 1; i++)
        x[wl_int(0, n - 1)] = wl_bits(wl_specials[wl_next() % WL_NSPECIALS]);
}

static wl_host wl_f32(int64_t r, int64_t c, int nasty)
{
    wl_host h = wl_host_new(wl_plain(FM_DTYPE_F32, r, c), 0);
    wl_fill((float *)h.t.data, r * c, nasty);
    return h;
}

/* The same values as BF16 or F16 (RNE, so overflow-sized values become Inf in F16). */
static wl_host wl_narrow(const wl_host *f, fm_dtype dt)
{
    wl_host h = wl_host_new(f->t, 0);
    h.t.dtype = dt;
    free(h.t.data);
    h.nd = (size_t)fm_tensor_nbytes(&h.t);
    h.t.data = calloc(h.nd + 8, 1);
    int64_t n = fm_tensor_numel(&f->t);
    for (int64_t i = 0; i < n; i++) {
        float v = ((const float *)f->t.data)[i];
        ((uint16_t *)h.t.data)[i] = dt == FM_DTYPE_BF16 ? fm_bf16_from_f32(v) : fm_f16_from_f32(v);
    }
    return h;
}

/* Quantized (POW2 / default rule) by the CPU reference. */
static wl_host wl_quant(fm_context *cpu, const wl_host *src, fm_dtype dt, fm_scale_mode m, fm_layout lay,
                        fm_scale_layout sl)
{
    const fm_tensor *s = &src->t;
    wl_host h = wl_host_new(wl_desc(dt, m, lay, sl, s->ndim, s->ndim == 3 ? s->shape[0] : 1,
                                    s->shape[s->ndim - 2], s->shape[s->ndim - 1]),
                            0);
    fm_quant_config c = {0};
    if (fm_quantize(cpu, &c, s, lay == FM_LAYOUT_ROWWISE ? &h.t : NULL, lay == FM_LAYOUT_COLWISE ? &h.t : NULL))
        wl_die("fm_quantize", cpu);
    return h;
}

/* ---- the inputs ---------------------------------------------------------------- */

enum { WL_NPAIRS = 7, WL_MAXG = 8 };

typedef struct {
    fm_dtype a, b;
    fm_scale_mode ma, mb;
    int cpu_only; /* cuBLASLt has no such product */
} wl_pair;

static const wl_pair wl_pairs[WL_NPAIRS] = {
    {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_SCALE_TENSOR, 0},
    {FM_DTYPE_E4M3, FM_DTYPE_E5M2, FM_SCALE_ROW, FM_SCALE_ROW, 0},
    {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128, 0},
    {FM_DTYPE_E5M2, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_1x128, 0},
    {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_SCALE_BLOCK_128x128, 1},
    {FM_DTYPE_BF16, FM_DTYPE_BF16, FM_SCALE_NONE, FM_SCALE_NONE, 0},
    {FM_DTYPE_F32, FM_DTYPE_F32, FM_SCALE_NONE, FM_SCALE_NONE, 0},
};

typedef struct {
    int safe, nasty;
    /* quantize, dequantize, transposes, conversions, casts */
    int64_t QM, QK;
    wl_host xf, xb, xh, x3;
    wl_host q_e4_row, q_e4_col, q_e5_mx, q_e4_mx, q_e2_mx, q_e4_128;
    int64_t gs[WL_MAXG], gse[WL_MAXG];
    int ng, nge;
    /* GEMMs */
    int64_t GM, GN, GK;
    wl_host ga[WL_NPAIRS], gb[WL_NPAIRS], gd0; /* gd0: F32 [GM, GN] to accumulate into */
    wl_host ka, kb, ka8, kb8;                  /* [128, 4096]: a long K */
    int64_t LT, LIN, LOUT;
    wl_host lx, lw, ldy, lx_row, lx_col, lw_row, lw_col, ldy_row, ldy_col, lg0; /* lg0: F32 main-grad */
    int64_t sp[WL_MAXG];
    int nsp;
    int64_t SN, SK, SM;
    wl_host sa8, sb8, sa5, sb5, sab, sbb;    /* m-grouped: 1x128 x 128x128, ROW x ROW, BF16 */
    wl_host wy8, wx8, wyb, wxb, wg0;         /* k-grouped: FP8 grouped column-wise, BF16 row-wise; F32 dW */
    /* MoE */
    int64_t T, E, H, I, K;
    wl_host logits, bias, ids[3], dprobs[3];
    wl_host px_b, px_8, px_4, pids, pprobs;
    int64_t R;
    wl_host slot_rows, row_map, y, dout;
    wl_host sw_in, sw_in8, sw_p, sw_dh, sw_dh8, sw_in2;
    /* EP (CPU only) */
    int64_t ep_T[3];
    wl_host ep_x[3], ep_ids[3], ep_p[3], ep_y[3];
} wl_inputs;

static const fm_router_config wl_router_cfgs[3] = {
    {3, FM_ROUTER_SOFTMAX, 1, NULL},
    {2, FM_ROUTER_SIGMOID, 0, NULL}, /* with the bias */
    {1, FM_ROUTER_SOFTMAX, 0, NULL},
};

static fm_router_config wl_router_cfg(const wl_inputs *in, int i)
{
    fm_router_config c = wl_router_cfgs[i];
    if (i == 1)
        c.bias = (const float *)in->bias.t.data;
    return c;
}

/* Columns [0, 16) of rows [r0, r1) of an F32 matrix of `cols` columns set to huge positive values. */
static void wl_huge_rows(wl_host *h, int64_t r0, int64_t r1, int64_t cols, float base)
{
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c = 0; c < 16 && c < cols; c++)
            ((float *)h->t.data)[r * cols + c] = base * (1.0f + 0.5f * fabsf(wl_val()));
}

/* GEMM sources: random in [-2, 2). WL_HUGE adds rows starting with 16
 * values of about 1e20 (A: rows 1 and 2, B: row 3): their products with each
 * other overflow F32, while every partial sum with an ordinary row stays far
 * from FLT_MAX, so an F32 accumulation and the double rule agree on which
 * outputs are +Inf. Their block scales (about 2^58) multiply to a finite F32:
 * scale products that overflow F32 are outside the GEMM contract (gemm.h,
 * "Range"; at 1e34 cuBLASLt turned 0 x Inf into NaN). WL_SPECIALS adds NaN (one with a payload), +-Inf, an Inf
 * meeting a zero. Operands with scales that span many rows (TENSOR,
 * BLOCK_128x128) take WL_HUGE only: one NaN would make every output NaN. */
enum { WL_CLEAN, WL_HUGE, WL_SPECIALS };

static wl_host wl_gemm_src(int64_t r, int64_t k, int level, int which)
{
    wl_host h = wl_host_new(wl_plain(FM_DTYPE_F32, r, k), 0);
    float *x = (float *)h.t.data;
    for (int64_t i = 0; i < r * k; i++)
        x[i] = wl_val();
    if (level >= WL_HUGE)
        wl_huge_rows(&h, which ? 3 : 1, which ? 4 : 3, k, 1e20f);
    if (level < WL_SPECIALS)
        return h;
    if (which == 0) {
        x[7 * k + 5 % k] = wl_bits(0x7FC00000u);
        x[9 * k + 100 % k] = wl_bits(0x7F800000u);
        x[10 * k + 3] = wl_bits(0xFF800000u), x[10 * k + k - 1] = wl_bits(0x7F800000u);
    } else {
        x[11 * k + 100 % k] = wl_bits(0xFF800000u);
        x[12 * k + 17] = wl_bits(0xFFC12345u);
        x[20 * k + k / 2] = 0.0f;
    }
    return h;
}

static void wl_copy_host(wl_host *dst, const wl_host *src)
{
    *dst = wl_host_new(src->t, (int64_t)src->ns);
    memcpy(dst->t.data, src->t.data, src->nd);
    if (src->ns)
        memcpy(dst->t.scale, src->t.scale, src->ns);
}

static wl_host wl_i32(int64_t r, int64_t c) { return wl_host_new(wl_plain(FM_DTYPE_I32, r, c), 0); }

static void wl_setup(wl_inputs *in, uint64_t seed, int safe, int nasty)
{
    memset(in, 0, sizeof *in);
    wl_state = seed;
    in->safe = safe;
    in->nasty = nasty;
    fm_context *cpu = NULL;
    fm_context_config cc = {FM_BACKEND_CPU, 0, 0, 1};
    if (fm_context_create(&cc, &cpu))
        wl_die("fm_context_create", NULL);

    /* quantize family: odd sizes always (every op here is exact on both backends) */
    in->QM = 300, in->QK = 520;
    in->xf = wl_f32(in->QM, in->QK, nasty);
    in->xb = wl_narrow(&in->xf, FM_DTYPE_BF16);
    in->xh = wl_narrow(&in->xf, FM_DTYPE_F16);
    in->x3 = wl_host_new(fm_tensor_3d(NULL, FM_DTYPE_F32, 3, 130, 96), 0);
    wl_fill((float *)in->x3.t.data, 3 * 130 * 96, nasty);
    in->q_e4_row = wl_quant(cpu, &in->xf, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT);
    in->q_e4_col = wl_quant(cpu, &in->xf, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE, FM_SCALE_LAYOUT_GEMM);
    in->q_e5_mx = wl_quant(cpu, &in->xf, FM_DTYPE_E5M2, FM_SCALE_MX32, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT);
    in->q_e4_mx = wl_quant(cpu, &in->xf, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT);
    in->q_e2_mx = wl_quant(cpu, &in->xf, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT);
    in->q_e4_128 = wl_quant(cpu, &in->xf, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_LAYOUT_ROWWISE,
                            FM_SCALE_LAYOUT_COMPACT);
    if (nasty) {
        /* codes the quantizer never writes: E5M2 +-Inf, a NaN code in a finite block */
        ((uint8_t *)in->q_e5_mx.t.data)[3 * in->QK + 40] = 0x7C;
        ((uint8_t *)in->q_e5_mx.t.data)[4 * in->QK + 7] = 0xFC;
        ((uint8_t *)in->q_e4_row.t.data)[5 * in->QK + 300] = 0xFF;
    }
    static const int64_t gs[] = {0, 77, 123, 0, 100}, gse[] = {78, 0, 122, 100};
    in->ng = 5, in->nge = 4;
    memcpy(in->gs, gs, sizeof gs);
    memcpy(in->gse, gse, sizeof gse);

    /* dense GEMMs. The odd shapes are large enough for the CPU GEMM to split
     * the rows over 3 workers (it wants about 2^20 multiply-adds each). */
    in->GM = safe ? 256 : 387, in->GN = safe ? 128 : 45, in->GK = safe ? 384 : 203;
    const int full = nasty ? WL_SPECIALS : WL_CLEAN, wide = nasty ? WL_HUGE : WL_CLEAN;
    wl_host fa = wl_gemm_src(in->GM, in->GK, full, 0), fb = wl_gemm_src(in->GN, in->GK, full, 1);
    wl_host fa1 = wl_gemm_src(in->GM, in->GK, wide, 0), fb1 = wl_gemm_src(in->GN, in->GK, wide, 1);
    for (int p = 0; p < WL_NPAIRS; p++) {
        const wl_pair *pr = &wl_pairs[p];
        fm_scale_layout sla = p & 1 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
        fm_scale_layout slb = p & 1 ? FM_SCALE_LAYOUT_COMPACT : FM_SCALE_LAYOUT_GEMM;
        if (pr->ma != FM_SCALE_NONE) {
            int wa = pr->ma == FM_SCALE_TENSOR || pr->ma == FM_SCALE_BLOCK_128x128;
            int wb = pr->mb == FM_SCALE_TENSOR || pr->mb == FM_SCALE_BLOCK_128x128;
            in->ga[p] = wl_quant(cpu, wa ? &fa1 : &fa, pr->a, pr->ma, FM_LAYOUT_ROWWISE, sla);
            in->gb[p] = wl_quant(cpu, wb ? &fb1 : &fb, pr->b, pr->mb, FM_LAYOUT_ROWWISE, slb);
        } else if (pr->a == FM_DTYPE_BF16) {
            in->ga[p] = wl_narrow(&fa, FM_DTYPE_BF16);
            in->gb[p] = wl_narrow(&fb, FM_DTYPE_BF16);
        } else {
            wl_copy_host(&in->ga[p], &fa);
            wl_copy_host(&in->gb[p], &fb);
        }
    }
    if (nasty) {
        ((uint8_t *)in->gb[1].t.data)[13 * in->GK + 17] = 0x7C; /* E5M2 +Inf code */
        ((uint8_t *)in->ga[3].t.data)[14 * in->GK + 20] = 0xFC; /* E5M2 -Inf code */
    }
    in->gd0 = wl_f32(in->GM, in->GN, nasty);
    if (!nasty)
        for (int64_t i = 0; i < in->GM * in->GN; i++)
            ((float *)in->gd0.t.data)[i] = wl_val();
    wl_host_free(&fa);
    wl_host_free(&fb);
    wl_host_free(&fa1);
    wl_host_free(&fb1);

    /* a long K, where a library could be tempted into split-K reductions */
    wl_host f1 = wl_gemm_src(128, 4096, full, 0), f2 = wl_gemm_src(128, 4096, full, 1);
    wl_host f3 = wl_gemm_src(128, 4096, wide, 1);
    in->ka = wl_narrow(&f1, FM_DTYPE_BF16);
    in->kb = wl_narrow(&f2, FM_DTYPE_BF16);
    in->ka8 = wl_quant(cpu, &f1, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT);
    in->kb8 = wl_quant(cpu, &f3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_GEMM);
    wl_host_free(&f1);
    wl_host_free(&f2);
    wl_host_free(&f3);

    /* a linear layer's three GEMMs */
    in->LT = safe ? 256 : 387, in->LIN = safe ? 384 : 203, in->LOUT = safe ? 128 : 45;
    in->lx = wl_gemm_src(in->LT, in->LIN, full, 0);
    in->lw = wl_gemm_src(in->LOUT, in->LIN, full, 1);
    in->ldy = wl_gemm_src(in->LT, in->LOUT, full, 0);
    wl_host lw1 = wl_gemm_src(in->LOUT, in->LIN, wide, 1);
    in->lx_row = wl_quant(cpu, &in->lx, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT);
    in->lx_col = wl_quant(cpu, &in->lx, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE, FM_SCALE_LAYOUT_GEMM);
    in->lw_row = wl_quant(cpu, &lw1, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_GEMM);
    in->lw_col = wl_quant(cpu, &lw1, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_LAYOUT_COLWISE,
                          FM_SCALE_LAYOUT_COMPACT);
    wl_host_free(&lw1);
    in->ldy_row = wl_quant(cpu, &in->ldy, FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE,
                           FM_SCALE_LAYOUT_COMPACT);
    in->ldy_col = wl_quant(cpu, &in->ldy, FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE,
                           FM_SCALE_LAYOUT_COMPACT);
    in->lg0 = wl_f32(in->LOUT, in->LIN, 0);

    /* grouped GEMMs: experts of 0 and 1 row on the CPU, multiples of 128 where cuBLASLt needs them */
    static const int64_t sp_odd[] = {61, 0, 250, 1, 0, 350}, sp_safe[] = {128, 0, 256, 128};
    in->nsp = safe ? 4 : 6;
    memcpy(in->sp, safe ? sp_safe : sp_odd, (size_t)in->nsp * sizeof(int64_t));
    in->SM = 0;
    for (int e = 0; e < in->nsp; e++)
        in->SM += in->sp[e];
    in->SN = safe ? 128 : 45, in->SK = safe ? 256 : 203;
    {
        wl_host a = wl_gemm_src(in->SM, in->SK, full, 0);
        wl_host b = wl_host_new(fm_tensor_3d(NULL, FM_DTYPE_F32, in->nsp, in->SN, in->SK), 0);
        wl_host b1 = wl_host_new(b.t, 0);
        for (int64_t e = 0; e < in->nsp; e++) {
            wl_host be = wl_gemm_src(in->SN, in->SK, full, 1), be1 = wl_gemm_src(in->SN, in->SK, wide, 1);
            memcpy((float *)b.t.data + e * in->SN * in->SK, be.t.data, be.nd);
            memcpy((float *)b1.t.data + e * in->SN * in->SK, be1.t.data, be1.nd);
            wl_host_free(&be);
            wl_host_free(&be1);
        }
        in->sa8 = wl_quant(cpu, &a, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT);
        in->sb8 = wl_quant(cpu, &b1, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_GEMM);
        wl_host_free(&b1);
        in->sa5 = wl_quant(cpu, &a, FM_DTYPE_E4M3, FM_SCALE_ROW, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT);
        in->sb5 = wl_quant(cpu, &b, FM_DTYPE_E5M2, FM_SCALE_ROW, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT);
        in->sab = wl_narrow(&a, FM_DTYPE_BF16);
        in->sbb = wl_narrow(&b, FM_DTYPE_BF16);
        wl_host_free(&a);
        wl_host_free(&b);
    }
    {
        fm_splits s = {in->nsp, in->sp, NULL};
        wl_host y = wl_gemm_src(in->SM, in->SN, full, 0), x = wl_gemm_src(in->SM, in->SK, full, 1);
        fm_quant_config qc = {0};
        fm_tensor py = wl_desc(FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE, FM_SCALE_LAYOUT_COMPACT, 2, 1,
                               in->SM, in->SN);
        fm_tensor px = wl_desc(FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE, FM_SCALE_LAYOUT_GEMM, 2, 1,
                               in->SM, in->SK);
        in->wy8 = wl_host_new(py, fm_tensor_grouped_scale_count(&py, &s) * 4);
        in->wx8 = wl_host_new(px, fm_tensor_grouped_scale_count(&px, &s) * 4);
        if (fm_quantize_grouped(cpu, &qc, &s, &y.t, NULL, &in->wy8.t) ||
            fm_quantize_grouped(cpu, &qc, &s, &x.t, NULL, &in->wx8.t))
            wl_die("fm_quantize_grouped", cpu);
        in->wyb = wl_narrow(&y, FM_DTYPE_BF16);
        in->wxb = wl_narrow(&x, FM_DTYPE_BF16);
        in->wg0 = wl_f32(in->nsp * in->SN, in->SK, 0);
        wl_host_free(&y);
        wl_host_free(&x);
    }

    /* MoE: T tokens over E experts, k = 3 */
    in->T = 300, in->E = 10, in->H = 200, in->I = 100, in->K = 3;
    int64_t T = in->T, E = in->E, H = in->H, I = in->I, K = in->K;
    in->logits = wl_f32(T, E, 0);
    if (nasty) {
        float *lg = (float *)in->logits.t.data;
        lg[0 * E + 3] = wl_bits(0x7FC00000u);
        lg[1 * E + 2] = wl_bits(0x7F800000u);
        lg[2 * E + 5] = wl_bits(0xFF800000u);
        lg[3 * E + 1] = 3e38f, lg[3 * E + 4] = -3e38f;
        for (int64_t e = 0; e < E; e++)
            lg[4 * E + e] = wl_bits(0xFF800000u);
        lg[5 * E + 0] = lg[5 * E + 9] = wl_bits(0x7F800000u);
        lg[6 * E + 7] = wl_bits(0xFFC12345u);
    } else {
        ((float *)in->logits.t.data)[7 * E + 2] = wl_bits(0x7FC00000u);
    }
    in->bias = wl_f32(1, E, 0);
    for (int i = 0; i < 3; i++) {
        fm_router_config rc = wl_router_cfg(in, i);
        in->ids[i] = wl_i32(T, rc.topk);
        wl_host pr = wl_f32(T, rc.topk, 0);
        if (fm_moe_router(cpu, &rc, &in->logits.t, &in->ids[i].t, &pr.t, NULL))
            wl_die("fm_moe_router", cpu);
        wl_host_free(&pr);
        in->dprobs[i] = wl_f32(T, rc.topk, nasty);
    }
    /* permute: the softmax top-3 routing with a few slots on no expert */
    wl_copy_host(&in->pids, &in->ids[0]);
    for (int64_t t = 0; t < T; t += 7)
        ((int32_t *)in->pids.t.data)[t * K + (t % K)] = -1;
    in->pprobs = wl_f32(T, K, nasty);
    {
        wl_host x = wl_f32(T, H, nasty);
        in->px_b = wl_narrow(&x, FM_DTYPE_BF16);
        in->px_8 = wl_quant(cpu, &x, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT);
        in->px_4 = wl_quant(cpu, &x, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_COMPACT);
        wl_host_free(&x);
        if (nasty) {
            /* a non-canonical NaN scale and payload: permute moves bytes */
            ((uint32_t *)in->px_8.t.scale)[2 * 2 + 1] = 0xFFC0BEEFu;
            ((uint16_t *)in->px_b.t.data)[9 * H + 3] = 0xFFA1;
        }
    }
    in->R = T * K + E * 15; /* pad 16 */
    {
        int64_t R = in->R;
        in->slot_rows = wl_i32(T, K);
        in->row_map = wl_i32(R, 1);
        wl_host out = wl_host_new(wl_plain(FM_DTYPE_BF16, R, H), 0);
        wl_host sp = wl_host_new(wl_plain(FM_DTYPE_I64, 1, E), 0);
        fm_permute_config pc = {16};
        if (fm_moe_permute(cpu, &pc, &in->px_b.t, &in->pids.t, NULL, &out.t, &in->row_map.t, &in->slot_rows.t, &sp.t,
                           NULL, NULL))
            wl_die("fm_moe_permute", cpu);
        wl_host_free(&out);
        wl_host_free(&sp);
        wl_host yf = wl_f32(R, H, nasty);
        in->y = wl_narrow(&yf, FM_DTYPE_BF16);
        wl_host_free(&yf);
        in->dout = wl_f32(T, H, nasty);
    }
    /* SwiGLU: M = T rows, I = 100 (the general path) and 128 (the fused kernels on CUDA) */
    {
        wl_host in2 = wl_f32(T, 2 * I, nasty), dh = wl_f32(T, I, nasty);
        in->sw_in = wl_narrow(&in2, FM_DTYPE_BF16);
        in->sw_in8 = wl_quant(cpu, &in2, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE,
                              FM_SCALE_LAYOUT_COMPACT);
        wl_copy_host(&in->sw_dh, &dh);
        in->sw_dh8 = wl_quant(cpu, &dh, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE,
                              FM_SCALE_LAYOUT_COMPACT);
        in->sw_p = wl_f32(T, 1, nasty);
        wl_host x2 = wl_f32(T, 256, nasty);
        in->sw_in2 = wl_narrow(&x2, FM_DTYPE_BF16);
        wl_host_free(&x2);
        wl_host_free(&in2);
        wl_host_free(&dh);
    }
    /* EP: 3 ranks of 4 experts, one rank with a single token */
    static const int64_t ept[3] = {50, 1, 37};
    for (int r = 0; r < 3; r++) {
        in->ep_T[r] = ept[r];
        wl_host x = wl_f32(ept[r], 256, nasty);
        in->ep_x[r] = wl_quant(cpu, &x, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE,
                               FM_SCALE_LAYOUT_COMPACT);
        wl_host_free(&x);
        in->ep_ids[r] = wl_i32(ept[r], 2);
        for (int64_t i = 0; i < ept[r] * 2; i++)
            ((int32_t *)in->ep_ids[r].t.data)[i] = i % 11 == 5 ? -1 : (int32_t)wl_int(0, 11);
        in->ep_p[r] = wl_f32(ept[r], 2, nasty);
        in->ep_y[r] = wl_f32(88, 256, nasty); /* 88 = every token of every rank */
    }
    fm_context_destroy(cpu);
}

static void wl_inputs_free(wl_inputs *in)
{
    wl_host *all[] = {&in->xf, &in->xb, &in->xh, &in->x3, &in->q_e4_row, &in->q_e4_col, &in->q_e5_mx, &in->q_e4_mx,
                      &in->q_e2_mx, &in->q_e4_128, &in->gd0, &in->ka, &in->kb, &in->ka8, &in->kb8, &in->lx, &in->lw,
                      &in->ldy, &in->lx_row, &in->lx_col, &in->lw_row, &in->lw_col, &in->ldy_row, &in->ldy_col,
                      &in->lg0, &in->sa8, &in->sb8, &in->sa5, &in->sb5, &in->sab, &in->sbb, &in->wy8, &in->wx8,
                      &in->wyb, &in->wxb, &in->wg0, &in->logits, &in->bias, &in->pids, &in->pprobs, &in->px_b,
                      &in->px_8, &in->px_4, &in->slot_rows, &in->row_map, &in->y, &in->dout, &in->sw_in,
                      &in->sw_in8, &in->sw_p, &in->sw_dh, &in->sw_dh8, &in->sw_in2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        wl_host_free(all[i]);
    for (int p = 0; p < WL_NPAIRS; p++)
        wl_host_free(&in->ga[p]), wl_host_free(&in->gb[p]);
    for (int i = 0; i < 3; i++) {
        wl_host_free(&in->ids[i]), wl_host_free(&in->dprobs[i]);
        wl_host_free(&in->ep_x[i]), wl_host_free(&in->ep_ids[i]), wl_host_free(&in->ep_p[i]);
        wl_host_free(&in->ep_y[i]);
    }
}

/* ---- one run: context memory, outputs, blobs ----------------------------------- */

typedef struct {
    char name[256];
    int gemm;        /* a GEMM output: two backends agree within the tolerance, not bit for bit */
    fm_dtype dtype;
    size_t n;
    uint8_t *bytes;
} wl_blob;

typedef struct {
    fm_context *ctx;
    int cuda;        /* the CUDA op set */
    uint8_t poison;
    int ep_threads;  /* CPU threads of each EP rank's context */
    const wl_inputs *in;
    wl_blob *blob;
    int nblob, cap;
    void **mem;
    int nmem, memcap;
    int failures;
} wl_run;

static void *wl_mem(wl_run *r, size_t n)
{
    void *p = NULL;
    if (fm_context_alloc(r->ctx, n + 16, &p) != FM_OK)
        wl_die("fm_context_alloc", r->ctx);
    if (r->nmem == r->memcap) {
        r->memcap = r->memcap ? 2 * r->memcap : 256;
        r->mem = (void **)realloc(r->mem, (size_t)r->memcap * sizeof(void *));
    }
    r->mem[r->nmem++] = p;
    return p;
}

static void *wl_up(wl_run *r, const void *h, size_t n)
{
    void *p = wl_mem(r, n);
    if (n && fm_context_copy(r->ctx, p, fm_context_device(r->ctx), h, FM_DEVICE_HOST, n) != FM_OK)
        wl_die("fm_context_copy", r->ctx);
    return p;
}

static void *wl_poisoned(wl_run *r, size_t n)
{
    void *p = wl_mem(r, n);
    if (fm_context_memset(r->ctx, p, r->poison, n + 16) != FM_OK)
        wl_die("fm_context_memset", r->ctx);
    return p;
}

/* An input in the context's memory. */
static fm_tensor wl_in(wl_run *r, const wl_host *h)
{
    fm_tensor t = h->t;
    t.device = fm_context_device(r->ctx);
    t.data = wl_up(r, h->t.data, h->nd);
    t.scale = h->ns ? wl_up(r, h->t.scale, h->ns) : NULL;
    return t;
}

/* A poisoned output shaped as proto (scale bytes ns when not the descriptor's own). */
static fm_tensor wl_out(wl_run *r, fm_tensor proto, int64_t ns)
{
    fm_tensor t = proto;
    t.device = fm_context_device(r->ctx);
    t.data = wl_poisoned(r, (size_t)fm_tensor_nbytes(&proto));
    t.scale = proto.scale_mode == FM_SCALE_NONE
                  ? NULL
                  : wl_poisoned(r, (size_t)(ns > 0 ? ns : fm_tensor_scale_nbytes(&proto)));
    return t;
}

/* An F32 accumulation target holding the host values. */
static fm_tensor wl_acc(wl_run *r, const wl_host *h, fm_tensor shape)
{
    fm_tensor t = shape;
    t.device = fm_context_device(r->ctx);
    t.data = wl_up(r, h->t.data, h->nd);
    return t;
}

static void wl_push(wl_run *r, const char *name, const void *src, fm_device dev, size_t n, int gemm, fm_dtype dt)
{
    if (r->nblob == r->cap) {
        r->cap = r->cap ? 2 * r->cap : 256;
        r->blob = (wl_blob *)realloc(r->blob, (size_t)r->cap * sizeof(wl_blob));
    }
    wl_blob *b = &r->blob[r->nblob++];
    snprintf(b->name, sizeof b->name, "%s", name);
    b->gemm = gemm;
    b->dtype = dt;
    b->n = n;
    b->bytes = (uint8_t *)malloc(n + 1);
    if (n && fm_context_copy(r->ctx, b->bytes, FM_DEVICE_HOST, src, dev, n) != FM_OK)
        wl_die("fm_context_copy (read back)", r->ctx);
}

static void wl_keep_raw(wl_run *r, const char *cs, const char *what, const void *p, size_t n)
{
    char name[256];
    snprintf(name, sizeof name, "%s: %s", cs, what);
    wl_push(r, name, p, fm_context_device(r->ctx), n, 0, FM_DTYPE_COUNT);
}

/* Data and scales of an output (scale bytes ns when not the descriptor's own). */
static void wl_keep(wl_run *r, const char *cs, const char *what, const fm_tensor *t, int64_t ns)
{
    char name[256];
    snprintf(name, sizeof name, "%s: %s", cs, what);
    wl_push(r, name, t->data, t->device, (size_t)fm_tensor_nbytes(t), 0, t->dtype);
    if (t->scale_mode != FM_SCALE_NONE) {
        snprintf(name, sizeof name, "%s: %s scales", cs, what);
        wl_push(r, name, t->scale, t->device, (size_t)(ns > 0 ? ns : fm_tensor_scale_nbytes(t)), 0, t->scale_dtype);
    }
}

static void wl_keep_gemm(wl_run *r, const char *cs, const fm_tensor *d)
{
    char name[256];
    snprintf(name, sizeof name, "%s: d", cs);
    wl_push(r, name, d->data, d->device, (size_t)fm_tensor_nbytes(d), 1, d->dtype);
}

/* Records a failed call (the comparison sees its status too). */
static int wl_ok(wl_run *r, const char *cs, fm_status st)
{
    char name[256];
    int32_t s = (int32_t)st;
    snprintf(name, sizeof name, "%s: status", cs);
    wl_push(r, name, &s, FM_DEVICE_HOST, sizeof s, 0, FM_DTYPE_I32);
    if (st != FM_OK) {
        r->failures++;
        fprintf(stderr, "ops workload [%s]: %s: %s: %s\n", fm_context_backend_name(r->ctx), cs, fm_status_name(st),
                fm_last_error(r->ctx));
    }
    return st == FM_OK;
}

static const char *wl_fmt(char *buf, size_t n, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static const char *wl_fmt(char *buf, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, n, fmt, ap);
    va_end(ap);
    return buf;
}

/* ---- the ops ---------------------------------------------------------------------- */

static const struct {
    fm_dtype dt;
    fm_scale_mode m;
} wl_combos[] = {
    {FM_DTYPE_E4M3, FM_SCALE_TENSOR}, {FM_DTYPE_E4M3, FM_SCALE_ROW}, {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
    {FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128}, {FM_DTYPE_E4M3, FM_SCALE_MX32}, {FM_DTYPE_E5M2, FM_SCALE_TENSOR},
    {FM_DTYPE_E5M2, FM_SCALE_ROW}, {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E5M2, FM_SCALE_BLOCK_128x128},
    {FM_DTYPE_E5M2, FM_SCALE_MX32}, {FM_DTYPE_E2M1, FM_SCALE_MX32},
};

static void wl_quant_ops(wl_run *r)
{
    const wl_inputs *in = r->in;
    char cs[128];
    const wl_host *src[3] = {&in->xf, &in->xb, &in->xh};
    for (size_t ci = 0; ci < sizeof wl_combos / sizeof wl_combos[0]; ci++)
        for (int rv = 0; rv < 2; rv++) {
            fm_dtype dt = wl_combos[ci].dt;
            fm_scale_mode m = wl_combos[ci].m;
            fm_scale_rule rule = rv == 0                                            ? FM_SCALE_RULE_DEFAULT
                               : m == FM_SCALE_MX32                                 ? FM_SCALE_RULE_MX_FLOOR
                               : m == FM_SCALE_TENSOR || m == FM_SCALE_ROW          ? FM_SCALE_RULE_POW2
                                                                                    : FM_SCALE_RULE_EXACT;
            const wl_host *s = src[(ci + (size_t)rv) % 3];
            fm_scale_layout sl = (ci + (size_t)rv) & 1 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
            wl_fmt(cs, sizeof cs, "quantize %s %s rule %d from %s %s", fm_dtype_name(dt), fm_scale_mode_name(m),
                   (int)rule, fm_dtype_name(s->t.dtype), fm_scale_layout_name(sl));
            fm_tensor x = wl_in(r, s);
            fm_tensor o1 = wl_out(r, wl_desc(dt, m, FM_LAYOUT_ROWWISE, sl, 2, 1, in->QM, in->QK), 0);
            fm_tensor o2 = wl_out(r, wl_desc(dt, m, FM_LAYOUT_COLWISE, sl, 2, 1, in->QM, in->QK), 0);
            float *amax = (float *)wl_poisoned(r, sizeof(float));
            int64_t *nf = (int64_t *)wl_poisoned(r, sizeof(int64_t));
            fm_quant_config qc = {rule, ci == 2 && rv ? 1e-3f : 0.0f, amax, nf};
            if (wl_ok(r, cs, fm_quantize(r->ctx, &qc, &x, &o1, &o2))) {
                wl_keep(r, cs, "row-wise", &o1, 0);
                wl_keep(r, cs, "column-wise", &o2, 0);
                wl_keep_raw(r, cs, "amax", amax, sizeof(float));
                wl_keep_raw(r, cs, "nonfinite_blocks", nf, sizeof(int64_t));
            }
        }
    /* a stack of experts */
    {
        fm_tensor x = wl_in(r, &in->x3);
        const char *c3 = "quantize 3-D E4M3 1x128";
        fm_tensor o1 = wl_out(r, wl_desc(FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE, FM_SCALE_LAYOUT_GEMM,
                                         3, 3, 130, 96), 0);
        fm_tensor o2 = wl_out(r, wl_desc(FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE,
                                         FM_SCALE_LAYOUT_COMPACT, 3, 3, 130, 96), 0);
        fm_quant_config qc = {0};
        if (wl_ok(r, c3, fm_quantize(r->ctx, &qc, &x, &o1, &o2))) {
            wl_keep(r, c3, "row-wise", &o1, 0);
            wl_keep(r, c3, "column-wise", &o2, 0);
        }
        c3 = "quantize 3-D E4M3 128x128";
        fm_tensor o3 = wl_out(r, wl_desc(FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_LAYOUT_ROWWISE,
                                         FM_SCALE_LAYOUT_GEMM, 3, 3, 130, 96), 0);
        if (wl_ok(r, c3, fm_quantize(r->ctx, &qc, &x, &o3, NULL)))
            wl_keep(r, c3, "row-wise", &o3, 0);
    }
    /* dequantize, into every output dtype and both layouts */
    const wl_host *qs[6] = {&in->q_e4_row, &in->q_e4_col, &in->q_e5_mx, &in->q_e4_mx, &in->q_e2_mx, &in->q_e4_128};
    static const fm_dtype odt[3] = {FM_DTYPE_F32, FM_DTYPE_BF16, FM_DTYPE_F16};
    for (int q = 0; q < 6; q++)
        for (int o = 0; o < 3; o++) {
            fm_layout lay = (fm_layout)((q + o) & 1);
            wl_fmt(cs, sizeof cs, "dequantize %s %s %s -> %s %s", fm_dtype_name(qs[q]->t.dtype),
                   fm_scale_mode_name(qs[q]->t.scale_mode), fm_layout_name(qs[q]->t.layout), fm_dtype_name(odt[o]),
                   fm_layout_name(lay));
            fm_tensor x = wl_in(r, qs[q]);
            fm_tensor out = wl_out(r, wl_desc(odt[o], FM_SCALE_NONE, lay, FM_SCALE_LAYOUT_COMPACT, 2, 1, in->QM, in->QK), 0);
            if (wl_ok(r, cs, fm_dequantize(r->ctx, &x, &out)))
                wl_keep(r, cs, "out", &out, 0);
        }
    /* scale layouts, there and back */
    const wl_host *ls[4] = {&in->q_e4_row, &in->q_e4_col, &in->q_e5_mx, &in->q_e4_128};
    for (int q = 0; q < 4; q++) {
        wl_fmt(cs, sizeof cs, "scale_layout_convert %s %s %s", fm_dtype_name(ls[q]->t.dtype),
               fm_scale_mode_name(ls[q]->t.scale_mode), fm_layout_name(ls[q]->t.layout));
        fm_tensor x = wl_in(r, ls[q]);
        fm_tensor to = ls[q]->t;
        to.scale_layout = ls[q]->t.scale_layout == FM_SCALE_LAYOUT_GEMM ? FM_SCALE_LAYOUT_COMPACT : FM_SCALE_LAYOUT_GEMM;
        fm_tensor a = wl_out(r, to, 0), b = wl_out(r, ls[q]->t, 0);
        a.data = b.data = x.data;
        if (wl_ok(r, cs, fm_scale_layout_convert(r->ctx, &x, &a)) &&
            wl_ok(r, cs, fm_scale_layout_convert(r->ctx, &a, &b))) {
            wl_keep_raw(r, cs, "converted scales", a.scale, (size_t)fm_tensor_scale_nbytes(&a));
            wl_keep_raw(r, cs, "converted back", b.scale, (size_t)fm_tensor_scale_nbytes(&b));
        }
    }
    /* unscaled casts */
    const wl_host *cs_src[3] = {&in->xf, &in->xb, &in->xh};
    static const fm_dtype cdt[3] = {FM_DTYPE_BF16, FM_DTYPE_F16, FM_DTYPE_F32};
    for (int c = 0; c < 3; c++) {
        fm_layout lay = (fm_layout)(c & 1);
        wl_fmt(cs, sizeof cs, "cast %s -> %s %s", fm_dtype_name(cs_src[c]->t.dtype), fm_dtype_name(cdt[c]),
               fm_layout_name(lay));
        fm_tensor x = wl_in(r, cs_src[c]);
        fm_tensor out = wl_out(r, wl_desc(cdt[c], FM_SCALE_NONE, lay, FM_SCALE_LAYOUT_COMPACT, 2, 1, in->QM, in->QK), 0);
        if (wl_ok(r, cs, fm_cast(r->ctx, &x, &out)))
            wl_keep(r, cs, "out", &out, 0);
    }
    /* quantize over groups of rows */
    for (int g = 0; g < 3; g++) {
        fm_splits sp = {g == 1 ? in->nge : in->ng, g == 1 ? in->gse : in->gs, NULL};
        fm_dtype dt = g == 1 ? FM_DTYPE_E2M1 : FM_DTYPE_E4M3;
        fm_scale_mode m = g == 1 ? FM_SCALE_MX32 : FM_SCALE_BLOCK_1x128;
        fm_scale_mode mr = g == 2 ? FM_SCALE_TENSOR : m;
        fm_scale_layout sl = g == 1 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT;
        wl_fmt(cs, sizeof cs, "quantize_grouped %s %s (row-wise %s)", fm_dtype_name(dt), fm_scale_mode_name(m),
               fm_scale_mode_name(mr));
        fm_tensor x = wl_in(r, &in->xf);
        fm_tensor pc = wl_desc(dt, m, FM_LAYOUT_COLWISE, sl, 2, 1, in->QM, in->QK);
        int64_t ns = fm_tensor_grouped_scale_count(&pc, &sp) * (dt == FM_DTYPE_E2M1 ? 1 : 4);
        fm_tensor o1 = wl_out(r, wl_desc(dt, mr, FM_LAYOUT_ROWWISE, sl, 2, 1, in->QM, in->QK), 0);
        fm_tensor o2 = wl_out(r, pc, ns);
        fm_quant_config qc = {0};
        if (wl_ok(r, cs, fm_quantize_grouped(r->ctx, &qc, &sp, &x, &o1, &o2))) {
            wl_keep(r, cs, "row-wise", &o1, 0);
            wl_keep(r, cs, "grouped column-wise", &o2, ns);
        }
    }
}

static void wl_requant_ops(wl_run *r)
{
    const wl_inputs *in = r->in;
    char cs[128];
    typedef struct {
        const wl_host *src;
        fm_dtype dt;
        fm_scale_mode m;
        fm_scale_layout sl;
        fm_requant_rule rule;
        int transpose;
    } rq;
    const rq cases[] = {
        {&in->q_e4_row, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, FM_REQUANT_TIGHT, 1},
        {&in->q_e4_row, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_GEMM, FM_REQUANT_ROWMAX, 1},
        {&in->q_e4_row, FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, FM_REQUANT_TIGHT, 1},
        {&in->q_e4_row, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_GEMM, FM_REQUANT_TIGHT, 1},
        {&in->q_e4_col, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, FM_REQUANT_TIGHT, 1},
        {&in->q_e5_mx, FM_DTYPE_E5M2, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, FM_REQUANT_TIGHT, 1},
        {&in->q_e5_mx, FM_DTYPE_E5M2, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, FM_REQUANT_MX_FLOOR, 1},
        {&in->q_e2_mx, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, FM_REQUANT_TIGHT, 1},
        {&in->q_e4_128, FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128, FM_SCALE_LAYOUT_COMPACT, FM_REQUANT_TIGHT, 1},
        {&in->q_e4_row, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, FM_REQUANT_TIGHT, 0},
        {&in->q_e4_row, FM_DTYPE_E2M1, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, FM_REQUANT_MX_FLOOR, 0},
        {&in->q_e2_mx, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, FM_REQUANT_TIGHT, 0},
        {&in->q_e2_mx, FM_DTYPE_E4M3, FM_SCALE_MX32, FM_SCALE_LAYOUT_GEMM, FM_REQUANT_TIGHT, 0},
        {&in->q_e4_mx, FM_DTYPE_E5M2, FM_SCALE_MX32, FM_SCALE_LAYOUT_COMPACT, FM_REQUANT_TIGHT, 0},
        {&in->q_e5_mx, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_LAYOUT_COMPACT, FM_REQUANT_TIGHT, 0},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const rq *q = &cases[c];
        fm_layout lay = q->transpose ? (fm_layout)!q->src->t.layout : q->src->t.layout;
        wl_fmt(cs, sizeof cs, "%s %s %s %s -> %s %s %s rule %d", q->transpose ? "transpose_scaled" : "convert_scaled",
               fm_dtype_name(q->src->t.dtype), fm_scale_mode_name(q->src->t.scale_mode),
               fm_layout_name(q->src->t.layout), fm_dtype_name(q->dt), fm_scale_mode_name(q->m), fm_layout_name(lay),
               (int)q->rule);
        fm_tensor x = wl_in(r, q->src);
        fm_tensor out = wl_out(r, wl_desc(q->dt, q->m, lay, q->sl, 2, 1, in->QM, in->QK), 0);
        int64_t *nf = (int64_t *)wl_poisoned(r, sizeof(int64_t));
        fm_requant_config rc = {q->rule, nf, 0};
        fm_status st = q->transpose ? fm_transpose_scaled(r->ctx, &rc, &x, &out) : fm_convert_scaled(r->ctx, &rc, &x, &out);
        if (wl_ok(r, cs, st)) {
            wl_keep(r, cs, "out", &out, 0);
            wl_keep_raw(r, cs, "nonfinite_blocks", nf, sizeof(int64_t));
        }
    }
    /* per-expert transposes */
    for (int g = 0; g < 4; g++) {
        const wl_host *src = g == 3 ? &in->q_e5_mx : &in->q_e4_row;
        int even = g == 2;
        fm_splits sp = {even ? in->nge : in->ng, even ? in->gse : in->gs, NULL};
        fm_dtype dt = g == 2 ? FM_DTYPE_E2M1 : src->t.dtype;
        fm_scale_mode m = g >= 2 ? FM_SCALE_MX32 : FM_SCALE_BLOCK_1x128;
        fm_requant_rule rule = g == 1 ? FM_REQUANT_ROWMAX : FM_REQUANT_TIGHT;
        fm_tensor pc = wl_desc(dt, m, FM_LAYOUT_COLWISE, g & 1 ? FM_SCALE_LAYOUT_GEMM : FM_SCALE_LAYOUT_COMPACT, 2, 1,
                               in->QM, in->QK);
        int64_t ns = fm_tensor_grouped_scale_count(&pc, &sp) * (m == FM_SCALE_MX32 ? 1 : 4);
        wl_fmt(cs, sizeof cs, "transpose_scaled_grouped %s %s -> %s %s rule %d", fm_dtype_name(src->t.dtype),
               fm_scale_mode_name(src->t.scale_mode), fm_dtype_name(dt), fm_scale_mode_name(m), (int)rule);
        fm_tensor x = wl_in(r, src);
        fm_tensor out = wl_out(r, pc, ns);
        int64_t *nf = (int64_t *)wl_poisoned(r, sizeof(int64_t));
        fm_requant_config rc = {rule, nf, 0};
        if (wl_ok(r, cs, fm_transpose_scaled_grouped(r->ctx, &rc, &sp, &x, &out))) {
            wl_keep(r, cs, "out", &out, ns);
            wl_keep_raw(r, cs, "nonfinite_blocks", nf, sizeof(int64_t));
        }
    }
}

static void wl_gemm_ops(wl_run *r)
{
    const wl_inputs *in = r->in;
    char cs[160];
    fm_context *ctx = r->ctx;
    for (int p = 0; p < WL_NPAIRS; p++) {
        const wl_pair *pr = &wl_pairs[p];
        if (pr->cpu_only && r->cuda)
            continue;
        for (int v = 0; v < 3; v++) {
            /* BF16 out; F32 out accumulating; F32 out with the unscaled operands stored column-wise */
            fm_dtype odt = v == 0 ? FM_DTYPE_BF16 : FM_DTYPE_F32;
            wl_fmt(cs, sizeof cs, "gemm %s %s x %s %s -> %s%s%s", fm_dtype_name(pr->a), fm_scale_mode_name(pr->ma),
                   fm_dtype_name(pr->b), fm_scale_mode_name(pr->mb), fm_dtype_name(odt), v == 1 ? " accumulate" : "",
                   v == 2 && !pr->ma ? " column-wise operands" : "");
            fm_tensor a = wl_in(r, &in->ga[p]), b = wl_in(r, &in->gb[p]);
            fm_tensor d = v == 1 ? wl_acc(r, &in->gd0, wl_plain(FM_DTYPE_F32, in->GM, in->GN))
                                 : wl_out(r, wl_plain(odt, in->GM, in->GN), 0);
            fm_gemm_config gc = {.accumulate = v == 1};
            fm_status st;
            if (v == 2 && pr->ma == FM_SCALE_NONE) {
                /* the same logical operands stored the other way: a transposed copy made by fm_cast */
                fm_tensor at = wl_out(r, wl_desc(pr->a, FM_SCALE_NONE, FM_LAYOUT_COLWISE, FM_SCALE_LAYOUT_COMPACT, 2, 1,
                                                 in->GM, in->GK), 0);
                fm_tensor bt = wl_out(r, wl_desc(pr->b, FM_SCALE_NONE, FM_LAYOUT_COLWISE, FM_SCALE_LAYOUT_COMPACT, 2, 1,
                                                 in->GN, in->GK), 0);
                st = fm_cast(ctx, &a, &at);
                if (!st)
                    st = fm_cast(ctx, &b, &bt);
                if (!st)
                    st = fm_gemm(ctx, &gc, &at, &bt, &d);
            } else {
                st = fm_gemm(ctx, &gc, &a, &b, &d);
            }
            if (wl_ok(r, cs, st))
                wl_keep_gemm(r, cs, &d);
        }
    }
    /* a long K */
    for (int v = 0; v < 2; v++) {
        wl_fmt(cs, sizeof cs, "gemm [128, 4096] x [128, 4096] %s", v ? "E4M3 1x128 x 128x128 -> BF16" : "BF16 -> F32");
        fm_tensor a = wl_in(r, v ? &in->ka8 : &in->ka), b = wl_in(r, v ? &in->kb8 : &in->kb);
        fm_tensor d = wl_out(r, wl_plain(v ? FM_DTYPE_BF16 : FM_DTYPE_F32, 128, 128), 0);
        if (wl_ok(r, cs, fm_gemm(ctx, NULL, &a, &b, &d)))
            wl_keep_gemm(r, cs, &d);
    }
    /* the linear layer, FP8 and BF16 */
    for (int f = 0; f < 2; f++) {
        fm_tensor x, w, dy, xc, wc, dyc;
        if (f == 0) {
            x = wl_in(r, &in->lx_row), xc = wl_in(r, &in->lx_col), w = wl_in(r, &in->lw_row);
            wc = wl_in(r, &in->lw_col), dy = wl_in(r, &in->ldy_row), dyc = wl_in(r, &in->ldy_col);
        } else {
            wl_host hx = wl_narrow(&in->lx, FM_DTYPE_BF16), hw = wl_narrow(&in->lw, FM_DTYPE_BF16);
            wl_host hdy = wl_narrow(&in->ldy, FM_DTYPE_BF16);
            x = xc = wl_in(r, &hx), w = wc = wl_in(r, &hw), dy = dyc = wl_in(r, &hdy);
            wl_host_free(&hx), wl_host_free(&hw), wl_host_free(&hdy);
        }
        const char *kind = f ? "BF16" : "FP8";
        fm_tensor y = wl_out(r, wl_plain(FM_DTYPE_BF16, in->LT, in->LOUT), 0);
        fm_tensor dx = wl_out(r, wl_plain(FM_DTYPE_F32, in->LT, in->LIN), 0);
        fm_tensor dw = wl_acc(r, &in->lg0, wl_plain(FM_DTYPE_F32, in->LOUT, in->LIN));
        fm_gemm_config acc = {.accumulate = 1};
        if (wl_ok(r, wl_fmt(cs, sizeof cs, "linear_forward %s", kind), fm_linear_forward(ctx, NULL, &x, &w, &y)))
            wl_keep_gemm(r, cs, &y);
        if (wl_ok(r, wl_fmt(cs, sizeof cs, "linear_dgrad %s", kind), fm_linear_dgrad(ctx, NULL, &dy, &wc, &dx)))
            wl_keep_gemm(r, cs, &dx);
        if (wl_ok(r, wl_fmt(cs, sizeof cs, "linear_wgrad %s accumulate", kind),
                  fm_linear_wgrad(ctx, &acc, &dyc, &xc, &dw)))
            wl_keep_gemm(r, cs, &dw);
    }
    /* experts: m-grouped and k-grouped */
    fm_splits sp = {in->nsp, in->sp, NULL};
    const wl_host *ga[3] = {&in->sa8, &in->sa5, &in->sab}, *gb[3] = {&in->sb8, &in->sb5, &in->sbb};
    for (int g = 0; g < 3; g++) {
        fm_dtype odt = g == 1 ? FM_DTYPE_F32 : FM_DTYPE_BF16;
        wl_fmt(cs, sizeof cs, "grouped_gemm %s %s x %s %s -> %s", fm_dtype_name(ga[g]->t.dtype),
               fm_scale_mode_name(ga[g]->t.scale_mode), fm_dtype_name(gb[g]->t.dtype),
               fm_scale_mode_name(gb[g]->t.scale_mode), fm_dtype_name(odt));
        fm_tensor a = wl_in(r, ga[g]), b = wl_in(r, gb[g]);
        fm_tensor d = wl_out(r, wl_plain(odt, in->SM, in->SN), 0);
        if (wl_ok(r, cs, fm_grouped_gemm(ctx, NULL, &sp, &a, &b, &d)))
            wl_keep_gemm(r, cs, &d);
    }
    for (int g = 0; g < 2; g++) {
        wl_fmt(cs, sizeof cs, "grouped_gemm_wgrad %s", g ? "BF16 row-wise -> BF16" : "FP8 grouped column-wise -> F32 accumulate");
        fm_tensor dy = wl_in(r, g ? &in->wyb : &in->wy8), x = wl_in(r, g ? &in->wxb : &in->wx8);
        fm_tensor shape = fm_tensor_3d(NULL, g ? FM_DTYPE_BF16 : FM_DTYPE_F32, in->nsp, in->SN, in->SK);
        fm_tensor dw = g ? wl_out(r, shape, 0) : wl_acc(r, &in->wg0, shape);
        fm_gemm_config gc = {.accumulate = !g};
        if (wl_ok(r, cs, fm_grouped_gemm_wgrad(ctx, &gc, &sp, &dy, &x, &dw)))
            wl_keep_gemm(r, cs, &dw);
    }
}

static void wl_moe_ops(wl_run *r)
{
    const wl_inputs *in = r->in;
    fm_context *ctx = r->ctx;
    char cs[160];
    int64_t T = in->T, E = in->E, H = in->H, K = in->K, R = in->R;
    fm_tensor logits = wl_in(r, &in->logits);
    fm_tensor bias = wl_in(r, &in->bias);
    for (int i = 0; i < 3; i++) {
        fm_router_config rc = wl_router_cfg(in, i);
        if (rc.bias)
            rc.bias = (const float *)bias.data;
        int k = rc.topk;
        wl_fmt(cs, sizeof cs, "moe_router %s k %d renormalize %d bias %d", rc.score ? "sigmoid" : "softmax", k,
               rc.renormalize, rc.bias != NULL);
        fm_tensor ids = wl_out(r, wl_plain(FM_DTYPE_I32, T, k), 0), pr = wl_out(r, wl_plain(FM_DTYPE_F32, T, k), 0);
        fm_tensor tpe = wl_out(r, wl_plain(FM_DTYPE_I64, 1, E), 0);
        if (wl_ok(r, cs, fm_moe_router(ctx, &rc, &logits, &ids, &pr, &tpe))) {
            wl_keep(r, cs, "expert_ids", &ids, 0);
            wl_keep(r, cs, "probs", &pr, 0);
            wl_keep(r, cs, "tokens_per_expert", &tpe, 0);
        }
        fm_tensor fids = wl_in(r, &in->ids[i]), dp = wl_in(r, &in->dprobs[i]);
        fm_tensor dl = wl_out(r, wl_plain(FM_DTYPE_F32, T, E), 0);
        wl_fmt(cs, sizeof cs, "moe_router_backward %s k %d renormalize %d", rc.score ? "sigmoid" : "softmax", k,
               rc.renormalize);
        if (wl_ok(r, cs, fm_moe_router_backward(ctx, &rc, &logits, &fids, &dp, &dl)))
            wl_keep(r, cs, "dlogits", &dl, 0);
    }
    /* permute + pad: BF16, FP8 1x128 and MXFP4 rows */
    const wl_host *px[3] = {&in->px_b, &in->px_8, &in->px_4};
    static const int pads[3] = {0, 16, 32};
    fm_tensor ids = wl_in(r, &in->pids), probs = wl_in(r, &in->pprobs);
    for (int v = 0; v < 3; v++) {
        int64_t P = pads[v] > 1 ? pads[v] : 1, RR = T * K + E * (P - 1);
        wl_fmt(cs, sizeof cs, "moe_permute %s %s pad %d", fm_dtype_name(px[v]->t.dtype),
               fm_scale_mode_name(px[v]->t.scale_mode), pads[v]);
        fm_tensor x = wl_in(r, px[v]);
        fm_tensor out = wl_out(r, wl_desc(px[v]->t.dtype, px[v]->t.scale_mode, FM_LAYOUT_ROWWISE,
                                          FM_SCALE_LAYOUT_COMPACT, 2, 1, RR, H), 0);
        fm_tensor rm = wl_out(r, wl_plain(FM_DTYPE_I32, RR, 1), 0), sr = wl_out(r, wl_plain(FM_DTYPE_I32, T, K), 0);
        fm_tensor spl = wl_out(r, wl_plain(FM_DTYPE_I64, 1, E), 0), op = wl_out(r, wl_plain(FM_DTYPE_F32, RR, 1), 0);
        int64_t hs[16];
        memset(hs, r->poison, sizeof hs);
        if (wl_ok(r, cs, fm_moe_permute(ctx, &(fm_permute_config){pads[v]}, &x, &ids, &probs, &out, &rm, &sr, &spl,
                                        &op, hs))) {
            wl_keep(r, cs, "out", &out, 0);
            wl_keep(r, cs, "row_map", &rm, 0);
            wl_keep(r, cs, "slot_rows", &sr, 0);
            wl_keep(r, cs, "splits", &spl, 0);
            wl_keep(r, cs, "out_probs", &op, 0);
            char name[256];
            snprintf(name, sizeof name, "%s: host_splits", cs);
            wl_push(r, name, hs, FM_DEVICE_HOST, (size_t)E * sizeof(int64_t), 0, FM_DTYPE_I64);
        }
    }
    /* unpermute + combine and its backward over the pad-16 routing */
    fm_tensor y = wl_in(r, &in->y), sr = wl_in(r, &in->slot_rows), rm = wl_in(r, &in->row_map);
    fm_tensor dout = wl_in(r, &in->dout);
    for (int v = 0; v < 2; v++) {
        wl_fmt(cs, sizeof cs, "moe_unpermute %s", v ? "unweighted -> BF16" : "weighted -> F32");
        fm_tensor out = wl_out(r, wl_plain(v ? FM_DTYPE_BF16 : FM_DTYPE_F32, T, H), 0);
        if (wl_ok(r, cs, fm_moe_unpermute(ctx, &y, &sr, v ? NULL : &probs, &out)))
            wl_keep(r, cs, "out", &out, 0);
        wl_fmt(cs, sizeof cs, "moe_unpermute_backward %s", v ? "unweighted -> F32" : "weighted -> BF16, dprobs");
        fm_tensor dy = wl_out(r, wl_plain(v ? FM_DTYPE_F32 : FM_DTYPE_BF16, R, H), 0);
        fm_tensor dp = wl_out(r, wl_plain(FM_DTYPE_F32, T, K), 0);
        if (wl_ok(r, cs, fm_moe_unpermute_backward(ctx, &dout, v ? NULL : &y, &rm, &sr, v ? NULL : &probs, &dy,
                                                   v ? NULL : &dp))) {
            wl_keep(r, cs, "dy", &dy, 0);
            if (!v)
                wl_keep(r, cs, "dprobs", &dp, 0);
        }
    }
    /* SwiGLU and its backward */
    int64_t I = in->I;
    fm_tensor swp = wl_in(r, &in->sw_p);
    for (int v = 0; v < 3; v++) {
        int64_t II = v == 2 ? 128 : I;
        const wl_host *src = v == 1 ? &in->sw_in8 : v == 2 ? &in->sw_in2 : &in->sw_in;
        wl_fmt(cs, sizeof cs, "moe_swiglu I %lld from %s %s", (long long)II, fm_dtype_name(src->t.dtype),
               v == 1 ? "-> BF16, no probs" : v == 2 ? "-> E4M3 1x128 + saved MXFP4" : "-> E4M3 1x128 row + col + saved E4M3");
        fm_tensor x = wl_in(r, src);
        fm_tensor orow = v == 1 ? wl_out(r, wl_plain(FM_DTYPE_BF16, T, II), 0)
                                : wl_out(r, wl_desc(FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE,
                                                    FM_SCALE_LAYOUT_COMPACT, 2, 1, T, II), 0);
        fm_tensor ocol = wl_out(r, wl_desc(FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE,
                                           FM_SCALE_LAYOUT_GEMM, 2, 1, T, II), 0);
        fm_tensor sav = wl_out(r, wl_desc(v == 2 ? FM_DTYPE_E2M1 : FM_DTYPE_E4M3,
                                          v == 2 ? FM_SCALE_MX32 : FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE,
                                          FM_SCALE_LAYOUT_COMPACT, 2, 1, T, 2 * II), 0);
        /* amax and the non-finite count describe the quantized h: none for a BF16 out_row */
        float *amax = v == 1 ? NULL : (float *)wl_poisoned(r, sizeof(float));
        int64_t *nf = v == 1 ? NULL : (int64_t *)wl_poisoned(r, sizeof(int64_t));
        fm_quant_config qc = {FM_SCALE_RULE_DEFAULT, 0.0f, amax, nf};
        fm_status st = fm_moe_swiglu(ctx, &qc, &x, v == 1 ? NULL : &swp, &orow, v == 0 ? &ocol : NULL,
                                     v == 1 ? NULL : &sav);
        if (wl_ok(r, cs, st)) {
            wl_keep(r, cs, "out_row", &orow, 0);
            if (v == 0)
                wl_keep(r, cs, "out_col", &ocol, 0);
            if (v != 1)
                wl_keep(r, cs, "in_saved", &sav, 0);
            if (amax) {
                wl_keep_raw(r, cs, "amax", amax, sizeof(float));
                wl_keep_raw(r, cs, "nonfinite_blocks", nf, sizeof(int64_t));
            }
        }
    }
    for (int v = 0; v < 2; v++) {
        wl_fmt(cs, sizeof cs, "moe_swiglu_backward %s", v ? "E4M3 dh and in -> BF16, no probs"
                                                          : "F32 dh, BF16 in -> E4M3 1x128 row + col, dprobs");
        fm_tensor dh = wl_in(r, v ? &in->sw_dh8 : &in->sw_dh), x = wl_in(r, v ? &in->sw_in8 : &in->sw_in);
        fm_tensor drow = v ? wl_out(r, wl_plain(FM_DTYPE_BF16, T, 2 * I), 0)
                           : wl_out(r, wl_desc(FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_ROWWISE,
                                               FM_SCALE_LAYOUT_COMPACT, 2, 1, T, 2 * I), 0);
        fm_tensor dcol = wl_out(r, wl_desc(FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_LAYOUT_COLWISE,
                                           FM_SCALE_LAYOUT_COMPACT, 2, 1, T, 2 * I), 0);
        fm_tensor dp = wl_out(r, wl_plain(FM_DTYPE_F32, T, 1), 0);
        int64_t *nf = (int64_t *)wl_poisoned(r, sizeof(int64_t));
        fm_quant_config qc = {FM_SCALE_RULE_DEFAULT, 0.0f, NULL, v ? NULL : nf};
        if (wl_ok(r, cs, fm_moe_swiglu_backward(ctx, &qc, &dh, &x, v ? NULL : &swp, &drow, v ? NULL : &dcol,
                                                v ? NULL : &dp))) {
            wl_keep(r, cs, "din_row", &drow, 0);
            if (!v) {
                wl_keep(r, cs, "din_col", &dcol, 0);
                wl_keep(r, cs, "dprobs", &dp, 0);
                wl_keep_raw(r, cs, "nonfinite_blocks", nf, sizeof(int64_t));
            }
        }
    }
}

/* ---- expert parallelism over the in-process communicator (CPU) -------------------- */

enum { WL_RANKS = 3, WL_EP_H = 256, WL_EP_CAP = 88 };

typedef struct {
    const wl_inputs *in;
    int rank, threads;
    uint8_t poison;
    fm_comm *comm;
    uint8_t *ox, *oxs;
    int32_t *oids, *osr, *ost;
    float *op, *out, *pback;
    int64_t rows, rows_from[WL_RANKS];
    fm_status st[3];
    char err[3][200];
} wl_rank;

static void *wl_rank_main(void *arg)
{
    wl_rank *w = (wl_rank *)arg;
    const wl_inputs *in = w->in;
    int r = w->rank;
    int64_t T = in->ep_T[r], H = WL_EP_H, C = WL_EP_CAP;
    fm_context *ctx = NULL;
    fm_context_config cc = {FM_BACKEND_CPU, 0, 0, w->threads};
    if (fm_context_create(&cc, &ctx)) {
        w->st[0] = FM_ERR_BACKEND;
        fm_comm_abort(w->comm);
        return NULL;
    }
    fm_ep_config cfg = {4};
    fm_tensor ox = fm_tensor_quant_2d(w->ox, FM_DTYPE_E4M3, C, H, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, w->oxs,
                                      FM_SCALE_LAYOUT_COMPACT);
    fm_tensor oids = fm_tensor_2d(w->oids, FM_DTYPE_I32, C, 2), op = fm_tensor_2d(w->op, FM_DTYPE_F32, C, 2);
    fm_tensor osr = fm_tensor_2d(w->osr, FM_DTYPE_I32, C, 1), ost = fm_tensor_2d(w->ost, FM_DTYPE_I32, C, 1);
    fm_ep_dispatch_out o = {&ox, &oids, &op, &osr, &ost, w->rows_from, -1};
    w->st[0] = fm_ep_dispatch(ctx, w->comm, &cfg, &in->ep_x[r].t, &in->ep_ids[r].t, &in->ep_p[r].t, &o);
    snprintf(w->err[0], sizeof w->err[0], "%s", fm_last_error(ctx));
    w->rows = o.rows;
    if (w->st[0] == FM_OK) {
        fm_tensor y = fm_tensor_2d(in->ep_y[r].t.data, FM_DTYPE_F32, o.rows, H);
        fm_tensor out = fm_tensor_2d(w->out, FM_DTYPE_F32, T, H);
        w->st[1] = fm_ep_combine(ctx, w->comm, &cfg, &in->ep_ids[r].t, &y, &out);
        snprintf(w->err[1], sizeof w->err[1], "%s", fm_last_error(ctx));
        fm_tensor rp = fm_tensor_2d(w->op, FM_DTYPE_F32, o.rows, 2), pb = fm_tensor_2d(w->pback, FM_DTYPE_F32, T, 2);
        w->st[2] = fm_ep_combine(ctx, w->comm, &cfg, &in->ep_ids[r].t, &rp, &pb);
        snprintf(w->err[2], sizeof w->err[2], "%s", fm_last_error(ctx));
    }
    fm_context_destroy(ctx);
    return NULL;
}

static void wl_ep_ops(wl_run *r)
{
    fm_comm *comms[WL_RANKS];
    if (fm_comm_create_inproc(WL_RANKS, comms) != FM_OK)
        wl_die("fm_comm_create_inproc", NULL);
    wl_rank w[WL_RANKS];
    pthread_t th[WL_RANKS];
    int64_t C = WL_EP_CAP, H = WL_EP_H;
    for (int k = 0; k < WL_RANKS; k++) {
        memset(&w[k], 0, sizeof w[k]);
        w[k].in = r->in, w[k].rank = k, w[k].threads = r->ep_threads, w[k].poison = r->poison, w[k].comm = comms[k];
        w[k].ox = (uint8_t *)malloc((size_t)(C * H)), w[k].oxs = (uint8_t *)malloc((size_t)(C * 2 * 4));
        w[k].oids = (int32_t *)malloc((size_t)(C * 2 * 4)), w[k].osr = (int32_t *)malloc((size_t)C * 4);
        w[k].ost = (int32_t *)malloc((size_t)C * 4), w[k].op = (float *)malloc((size_t)(C * 2 * 4));
        w[k].out = (float *)malloc((size_t)(r->in->ep_T[k] * H * 4 + 4));
        w[k].pback = (float *)malloc((size_t)(r->in->ep_T[k] * 2 * 4 + 4));
        memset(w[k].ox, r->poison, (size_t)(C * H)), memset(w[k].oxs, r->poison, (size_t)(C * 8));
        memset(w[k].oids, r->poison, (size_t)(C * 8)), memset(w[k].osr, r->poison, (size_t)C * 4);
        memset(w[k].ost, r->poison, (size_t)C * 4), memset(w[k].op, r->poison, (size_t)(C * 8));
        memset(w[k].out, r->poison, (size_t)(r->in->ep_T[k] * H * 4 + 4));
        memset(w[k].pback, r->poison, (size_t)(r->in->ep_T[k] * 2 * 4 + 4));
    }
    for (int k = 0; k < WL_RANKS; k++)
        if (pthread_create(&th[k], NULL, wl_rank_main, &w[k]))
            wl_die("pthread_create", NULL);
    for (int k = 0; k < WL_RANKS; k++)
        pthread_join(th[k], NULL);
    char cs[64], name[256];
    for (int k = 0; k < WL_RANKS; k++) {
        int64_t T = r->in->ep_T[k];
        static const char *ops[3] = {"ep_dispatch", "ep_combine", "ep_combine (probs back)"};
        for (int i = 0; i < 3; i++) {
            snprintf(cs, sizeof cs, "%s rank %d", ops[i], k);
            if (w[k].st[i] != FM_OK) {
                r->failures++;
                fprintf(stderr, "ops workload: %s: %s: %s\n", cs, fm_status_name(w[k].st[i]), w[k].err[i]);
            }
            snprintf(name, sizeof name, "%s: status", cs);
            int32_t s = (int32_t)w[k].st[i];
            wl_push(r, name, &s, FM_DEVICE_HOST, 4, 0, FM_DTYPE_I32);
        }
        snprintf(cs, sizeof cs, "ep rank %d", k);
        /* rows past the received count are left as they were (documented): not compared */
        size_t R = w[k].st[0] == FM_OK && w[k].rows >= 0 && w[k].rows <= C ? (size_t)w[k].rows : 0;
        struct {
            const char *what;
            const void *p;
            size_t n;
        } outs[] = {{"dispatched x", w[k].ox, R * (size_t)H}, {"dispatched scales", w[k].oxs, R * 8},
                    {"local ids", w[k].oids, R * 8},          {"probs", w[k].op, R * 8},
                    {"src_rank", w[k].osr, R * 4},            {"src_token", w[k].ost, R * 4},
                    {"rows", &w[k].rows, 8},                    {"rows_from", w[k].rows_from, sizeof w[k].rows_from},
                    {"combined", w[k].out, (size_t)(T * H * 4)}, {"probs back", w[k].pback, (size_t)(T * 8)}};
        for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++) {
            snprintf(name, sizeof name, "%s: %s", cs, outs[i].what);
            wl_push(r, name, outs[i].p, FM_DEVICE_HOST, outs[i].n, 0, FM_DTYPE_COUNT);
        }
        free(w[k].ox), free(w[k].oxs), free(w[k].oids), free(w[k].osr), free(w[k].ost), free(w[k].op);
        free(w[k].out), free(w[k].pback);
        fm_comm_destroy(comms[k]);
    }
}

/* Every op. ep_threads > 0: EP too, each rank a CPU context with that many
 * threads (the in-process communicator takes host tensors). ep_threads = 0:
 * the ops the CUDA backend runs (no EP, no BLOCK_128x128 x BLOCK_128x128
 * GEMM), also on a CPU context, so that its outputs line up with a CUDA
 * run's. */
static void wl_run_all(wl_run *r, fm_context *ctx, const wl_inputs *in, uint8_t poison, int ep_threads)
{
    memset(r, 0, sizeof *r);
    r->ctx = ctx;
    r->cuda = fm_context_backend(ctx) == FM_BACKEND_CUDA || ep_threads <= 0;
    r->poison = poison;
    r->ep_threads = ep_threads;
    r->in = in;
    wl_quant_ops(r);
    wl_requant_ops(r);
    wl_gemm_ops(r);
    wl_moe_ops(r);
    if (!r->cuda)
        wl_ep_ops(r);
    if (fm_context_synchronize(ctx) != FM_OK)
        wl_die("fm_context_synchronize", ctx);
    for (int i = 0; i < r->nmem; i++)
        fm_context_free(ctx, r->mem[i]);
    free(r->mem);
    r->mem = NULL;
    r->nmem = 0;
}

static void wl_run_free(wl_run *r)
{
    for (int i = 0; i < r->nblob; i++)
        free(r->blob[i].bytes);
    free(r->blob);
    r->blob = NULL;
    r->nblob = 0;
}

/* ---- comparing two runs ----------------------------------------------------------- */

/* How many op calls a run made and how many outputs it read back. */
static void wl_count(const wl_run *r, int *calls, int *outputs)
{
    *calls = *outputs = 0;
    for (int i = 0; i < r->nblob; i++) {
        size_t n = strlen(r->blob[i].name);
        if (n >= 8 && !strcmp(r->blob[i].name + n - 8, ": status"))
            ++*calls;
        else
            ++*outputs;
    }
}

static double wl_gemm_val(const wl_blob *b, size_t i)
{
    if (b->dtype == FM_DTYPE_BF16)
        return (double)fm_bf16_to_f32(((const uint16_t *)b->bytes)[i]);
    return (double)((const float *)b->bytes)[i];
}

/* 0: NaN, 1: +Inf, 2: -Inf, 3: finite */
static int wl_class(double v) { return isnan(v) ? 0 : isinf(v) ? (v > 0 ? 1 : 2) : 3; }

/* Compares blob lists; gemm_tolerance: GEMM outputs need the same NaN, +Inf
 * and -Inf positions and the DESIGN.md relative Frobenius error over the
 * finite ones, everything else the same bytes. Prints every difference as
 * "label: blob: ..." and returns how many blobs differ. */
static int wl_diff(const wl_run *a, const wl_run *b, int gemm_tolerance, const char *label)
{
    int bad = 0;
    if (a->nblob != b->nblob) {
        fprintf(stderr, "%s: %d outputs against %d\n", label, a->nblob, b->nblob);
        return 1;
    }
    for (int i = 0; i < a->nblob; i++) {
        const wl_blob *x = &a->blob[i], *y = &b->blob[i];
        if (strcmp(x->name, y->name) || x->n != y->n) {
            fprintf(stderr, "%s: output %d is \"%s\" (%zu bytes) against \"%s\" (%zu bytes)\n", label, i, x->name,
                    x->n, y->name, y->n);
            return bad + 1;
        }
        if (gemm_tolerance && x->gemm) {
            static const char *cn[4] = {"NaN", "+Inf", "-Inf", "finite"};
            size_t n = x->n / (x->dtype == FM_DTYPE_BF16 ? 2 : 4), moved[4][4] = {{0}}, cls = 0, first = 0;
            double num = 0, den = 0;
            for (size_t k = 0; k < n; k++) {
                double u = wl_gemm_val(x, k), v = wl_gemm_val(y, k);
                int cu = wl_class(u), cv = wl_class(v);
                if (cu != cv) {
                    if (cls++ == 0)
                        first = k;
                    moved[cu][cv]++;
                    continue;
                }
                if (cu == 3)
                    num += (u - v) * (u - v), den += u * u;
            }
            double rel = den > 0 ? sqrt(num / den) : sqrt(num);
            double tol = x->dtype == FM_DTYPE_BF16 ? 5e-3 : 5e-4;
            if (cls || !(rel <= tol)) {
                bad++;
                fprintf(stderr, "%s: %s: relative Frobenius error of the finite elements %.3g (tolerance %.0e); %zu of %zu "
                        "elements differ in class", label, x->name, rel, tol, cls, n);
                for (int c = 0; c < 4; c++)
                    for (int d = 0; d < 4; d++)
                        if (moved[c][d])
                            fprintf(stderr, ", %zu %s against %s", moved[c][d], cn[c], cn[d]);
                if (cls)
                    fprintf(stderr, " (first: element %zu, %g against %g)", first, wl_gemm_val(x, first),
                            wl_gemm_val(y, first));
                fprintf(stderr, "\n");
            }
            continue;
        }
        size_t diff = 0, first = 0;
        for (size_t k = 0; k < x->n; k++)
            if (x->bytes[k] != y->bytes[k] && diff++ == 0)
                first = k;
        if (diff) {
            bad++;
            fprintf(stderr, "%s: %s: %zu of %zu bytes differ, first at byte %zu (0x%02x against 0x%02x)\n", label,
                    x->name, diff, x->n, first, x->bytes[first], y->bytes[first]);
        }
    }
    return bad;
}

#endif
