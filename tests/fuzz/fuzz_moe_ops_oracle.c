/* Fuzzes the CPU MoE ops fm_moe_permute, fm_moe_unpermute (+ backward) and
 * fm_moe_swiglu (+ backward, unscaled outputs) on fuzzer-chosen routings
 * (ids in [-1, E), now and then one out of range), token rows of every
 * payload format holding any bit pattern (NaN payloads, Inf, garbage
 * scales), probabilities of any bits, padding multiples, spare rows.
 *
 * Oracle, written here from moe.h, not from the library's code:
 *   - permute: the routing counted per expert; a routing that needs more rows
 *     than out has, or an id outside [-1, E), is refused with
 *     FM_ERR_INVALID_ARG and nothing is written; otherwise expert e's rows
 *     start at the sum of the earlier experts' padded counts, slots in
 *     increasing t * k + j, and out, its scales, row_map, slot_rows, splits,
 *     host_splits and out_probs are exactly that: source rows byte for byte,
 *     padding rows zero codes with scale 1 (E8M0 127), out_probs the probs'
 *     bits or 0;
 *   - unpermute: out[t] = the fmaf chain over t's slots in order, from +0,
 *     rounded once (F32 canonical NaN, BF16 RNE), a token with no slot left a
 *     zero row; backward: dy[row] = w * dout[t] (padding rows 0), dprobs the
 *     32-lane fmaf dot then the fixed tree (0 for a -1 slot);
 *   - SwiGLU to F32 / BF16: h = (silu(g) u) p and [dg | du], dprobs (its
 *     dot in runs of 8: lane (i / 8) % 32), with mathfn.h's silu / dsilu
 *     (the documented rule), bit for bit.
 * Before anything else: a valid call is accepted, nothing crashes, nothing
 * is written past the buffers (ASan). */
#include <math.h>
#include <string.h>

#include "flowmoe/flowmoe.h"
#include "flowmoe/mathfn.h"
#include "fuzz_common.h"
#include "fuzz_cpu_context.h"

static fm_context *g_ctx;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    g_ctx = fz_cpu_context();
    return 0;
}

static const struct {
    fm_dtype dt;
    fm_scale_mode m;
} kinds[] = {
    {FM_DTYPE_F32, FM_SCALE_NONE}, {FM_DTYPE_BF16, FM_SCALE_NONE}, {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
    {FM_DTYPE_E5M2, FM_SCALE_MX32}, {FM_DTYPE_E2M1, FM_SCALE_MX32},
};
#define NKINDS 5

static uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* F32 -> BF16, round to nearest even, NaN -> 0x7FC0 (the library's canonical NaN). */
static uint16_t bf16_rne(float f)
{
    uint32_t u = f2u(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static uint32_t f32_store(float f) { return isnan(f) ? 0x7FC00000u : f2u(f); }

/* The fixed order of moe.h: 32 lanes of fmaf, lane i % 32 (run 1) or, for
 * SwiGLU's dprobs, lane (i / 8) % 32 (run 8), then the tree 16, 8, 4, 2, 1. */
static float dot32_run(const float *a, const float *b, int64_t n, int64_t run)
{
    float p[32] = {0};
    for (int64_t i = 0; i < n; i++)
        p[(i / run) % 32] = fmaf(a[i], b[i], p[(i / run) % 32]);
    for (int off = 16; off > 0; off >>= 1)
        for (int l = 0; l < off; l++)
            p[l] = p[l] + p[l + off];
    return p[0];
}

static float dot32(const float *a, const float *b, int64_t n) { return dot32_run(a, b, n, 1); }

static float load(const void *p, fm_dtype dt, int64_t i)
{
    return dt == FM_DTYPE_BF16 ? u2f((uint32_t)((const uint16_t *)p)[i] << 16) : ((const float *)p)[i];
}

static void same(const char *what, const void *got, const void *want, size_t n, const char *ctx)
{
    if (memcmp(got, want, n)) {
        size_t i = 0;
        while (((const uint8_t *)got)[i] == ((const uint8_t *)want)[i])
            i++;
        fz_fail("%s: %s differs at byte %zu of %zu (0x%02x, want 0x%02x)", ctx, what, i, n,
                ((const uint8_t *)got)[i], ((const uint8_t *)want)[i]);
    }
}

static void untouched(const char *what, const uint8_t *p, size_t n, uint8_t poison, const char *ctx)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != poison)
            fz_fail("%s: refused, yet %s byte %zu was written", ctx, what, i);
}

/* Bytes from the input, repeated (a short input still fills everything). */
static void fill(uint8_t *dst, size_t n, fz_reader *r, uint64_t *seed)
{
    size_t avail = fz_left(r);
    for (size_t i = 0; i < n; i++)
        dst[i] = avail ? r->p[r->i + (i % avail)] ^ (uint8_t)(i / avail) : (uint8_t)fz_mix(seed);
    r->i += avail < n ? avail : n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_reader rd = {data, size, 0}, *r = &rd;
    uint8_t b0 = fz_u8(r), b1 = fz_u8(r), b2 = fz_u8(r), b3 = fz_u8(r), b4 = fz_u8(r), b5 = fz_u8(r),
            b6 = fz_u8(r), b7 = fz_u8(r);
    int kd = b0 % NKINDS;
    fm_dtype dt = kinds[kd].dt;
    fm_scale_mode m = kinds[kd].m;
    int64_t T = 1 + b1 % 48, k = 1 + b2 % 8, E = 1 + b3 % 12, H = 2 * (1 + b4 % 100);
    while (T * H > 4096)
        T = (T + 1) / 2;
    static const int pads[8] = {0, 1, 2, 3, 4, 8, 16, 5};
    int pad = pads[b5 % 8], P1 = pad > 1 ? pad : 1;
    int with_probs = b6 & 1, with_outp = with_probs && (b6 & 2), with_host = (b6 & 4) != 0;
    int64_t R = T * k + E * (P1 - 1) + (b6 & 8 ? b7 % 5 : 0) - (b6 & 16 ? b7 % 7 : 0);
    if (R < 0)
        R = 0;
    uint8_t poison = b7;
    uint64_t seed = b7 * 0x9E3779B9ull + size;
    char ctx[160];
    snprintf(ctx, sizeof ctx, "%s %s T %lld k %lld E %lld H %lld pad %d R %lld flags 0x%02x",
             fm_dtype_name(dt), fm_scale_mode_name(m), (long long)T, (long long)k, (long long)E, (long long)H, pad,
             (long long)R, b6);

    /* routing: id = byte % (E + 1) - 1; 0xFF now and then: E (out of range) */
    int32_t *ids = malloc((size_t)(T * k) * 4);
    int bad_id = 0;
    for (int64_t i = 0; i < T * k; i++) {
        uint8_t b = fz_u8(r);
        ids[i] = b == 0xFF && (b6 & 0x20) ? (int32_t)E + (b & 1) : (int32_t)(b % (E + 1)) - 1;
        bad_id |= ids[i] >= E;
    }
    int64_t rb = dt == FM_DTYPE_E2M1 ? H / 2 : H * (dt == FM_DTYPE_F32 ? 4 : dt == FM_DTYPE_BF16 ? 2 : 1);
    int64_t nsc = m == FM_SCALE_NONE ? 0 : (H + fm_mode_block_cols(m) - 1) / fm_mode_block_cols(m);
    int64_t sb = nsc * (m == FM_SCALE_MX32 ? 1 : 4);
    uint8_t *x = malloc((size_t)(T * rb) + 1), *xs = malloc((size_t)(T * sb) + 1);
    float *probs = malloc((size_t)(T * k) * 4 + 4);
    fill((uint8_t *)probs, (size_t)(T * k) * 4, r, &seed);
    fill(x, (size_t)(T * rb), r, &seed);
    fill(xs, (size_t)(T * sb), r, &seed);

    /* the reference routing */
    int64_t *cnt = calloc((size_t)E, 8), *start = calloc((size_t)E, 8), need = 0;
    for (int64_t i = 0; i < T * k; i++)
        if (ids[i] >= 0 && ids[i] < E)
            cnt[ids[i]]++;
    for (int64_t e = 0; e < E; e++) {
        start[e] = need;
        need += (cnt[e] + P1 - 1) / P1 * P1;
    }
    int refuse = bad_id || need > R;
    int32_t *w_map = malloc((size_t)R * 4 + 4), *w_slot = malloc((size_t)(T * k) * 4);
    for (int64_t i = 0; i < R; i++)
        w_map[i] = -1;
    int64_t *w_split = malloc((size_t)E * 8), *pos = malloc((size_t)E * 8);
    for (int64_t e = 0; e < E; e++) {
        w_split[e] = (cnt[e] + P1 - 1) / P1 * P1;
        pos[e] = start[e];
    }
    for (int64_t i = 0; i < T * k && !refuse; i++) {
        if (ids[i] < 0) {
            w_slot[i] = -1;
            continue;
        }
        int64_t row = pos[ids[i]]++;
        w_slot[i] = (int32_t)row;
        w_map[row] = (int32_t)i;
    }

    /* permute */
    uint8_t *out = malloc((size_t)(R * rb) + 1), *outs = malloc((size_t)(R * sb) + 1);
    int32_t *rm = malloc((size_t)R * 4 + 4), *sr = malloc((size_t)(T * k) * 4);
    int64_t *spl = malloc((size_t)E * 8), *hs = malloc((size_t)E * 8);
    float *op = malloc((size_t)R * 4 + 4);
    memset(out, poison, (size_t)(R * rb)), memset(outs, poison, (size_t)(R * sb));
    memset(rm, poison, (size_t)R * 4), memset(sr, poison, (size_t)(T * k) * 4);
    memset(spl, poison, (size_t)E * 8), memset(hs, poison, (size_t)E * 8), memset(op, poison, (size_t)R * 4);
    fm_tensor tx = m ? fm_tensor_quant_2d(x, dt, T, H, FM_LAYOUT_ROWWISE, m, xs, FM_SCALE_LAYOUT_COMPACT)
                     : fm_tensor_2d(x, dt, T, H);
    fm_tensor to = tx;
    to.shape[0] = R, to.data = out, to.scale = m ? outs : NULL;
    tx.data_capacity = T * rb, to.data_capacity = R * rb;
    fm_tensor tid = fm_tensor_2d(ids, FM_DTYPE_I32, T, k), tp = fm_tensor_2d(probs, FM_DTYPE_F32, T, k);
    fm_tensor trm = fm_tensor_2d(rm, FM_DTYPE_I32, R, 1), tsr = fm_tensor_2d(sr, FM_DTYPE_I32, T, k);
    fm_tensor tsp = fm_tensor_2d(spl, FM_DTYPE_I64, 1, E), top = fm_tensor_2d(op, FM_DTYPE_F32, R, 1);
    fm_permute_config pc = {pad};
    fm_status st = fm_moe_permute(g_ctx, &pc, &tx, &tid, with_probs ? &tp : NULL, &to, &trm, &tsr, &tsp,
                                  with_outp ? &top : NULL, with_host ? hs : NULL);
    if (R == 0 && st == FM_ERR_INVALID_ARG && !refuse)
        goto done; /* an empty out is a descriptor the ops may refuse: nothing to compare */
    if (refuse) {
        if (st != FM_ERR_INVALID_ARG)
            fz_fail("%s: permute of a routing that %s returned %s", ctx,
                    bad_id ? "holds an id >= E" : "needs more rows than out has", fm_status_name(st));
        untouched("out", out, (size_t)(R * rb), poison, ctx);
        untouched("out scales", outs, (size_t)(R * sb), poison, ctx);
        untouched("row_map", (uint8_t *)rm, (size_t)R * 4, poison, ctx);
        untouched("slot_rows", (uint8_t *)sr, (size_t)(T * k) * 4, poison, ctx);
        untouched("splits", (uint8_t *)spl, (size_t)E * 8, poison, ctx);
        untouched("host_splits", (uint8_t *)hs, (size_t)E * 8, poison, ctx);
        untouched("out_probs", (uint8_t *)op, (size_t)R * 4, poison, ctx);
        goto done;
    }
    if (st != FM_OK)
        fz_fail("%s: permute refused a valid call: %s", ctx, fm_last_error(g_ctx));
    same("row_map", rm, w_map, (size_t)R * 4, ctx);
    same("slot_rows", sr, w_slot, (size_t)(T * k) * 4, ctx);
    same("splits", spl, w_split, (size_t)E * 8, ctx);
    if (with_host)
        same("host_splits", hs, w_split, (size_t)E * 8, ctx);
    for (int64_t row = 0; row < R; row++) {
        int32_t s = w_map[row];
        if (s >= 0) {
            same("a moved row", out + row * rb, x + (s / k) * rb, (size_t)rb, ctx);
            same("a moved row's scales", outs + row * sb, xs + (s / k) * sb, (size_t)sb, ctx);
            if (with_outp && f2u(op[row]) != f2u(probs[s]))
                fz_fail("%s: out_probs[%lld] 0x%08x, want probs[%d] 0x%08x", ctx, (long long)row, f2u(op[row]), s,
                        f2u(probs[s]));
            continue;
        }
        for (int64_t b = 0; b < rb; b++)
            if (out[row * rb + b])
                fz_fail("%s: padding row %lld byte %lld is 0x%02x", ctx, (long long)row, (long long)b,
                        out[row * rb + b]);
        for (int64_t c = 0; c < nsc; c++)
            if (m == FM_SCALE_MX32 ? outs[row * sb + c] != 127 : f2u(((float *)(outs + row * sb))[c]) != 0x3F800000u)
                fz_fail("%s: padding row %lld scale %lld is not 1", ctx, (long long)row, (long long)c);
        if (with_outp && f2u(op[row]) != 0)
            fz_fail("%s: padding row %lld out_probs 0x%08x", ctx, (long long)row, f2u(op[row]));
    }

    /* unpermute and its backward: y [R, H] F32 or BF16 from the input's bytes */
    {
        fm_dtype ydt = b6 & 0x40 ? FM_DTYPE_BF16 : FM_DTYPE_F32, odt = b6 & 0x80 ? FM_DTYPE_BF16 : FM_DTYPE_F32;
        size_t ye = ydt == FM_DTYPE_BF16 ? 2 : 4, oe = odt == FM_DTYPE_BF16 ? 2 : 4;
        uint8_t *y = malloc((size_t)(R * H) * ye + 1), *uo = malloc((size_t)(T * H) * oe + 1);
        uint8_t *dout = malloc((size_t)(T * H) * 4 + 1), *dy = malloc((size_t)(R * H) * oe + 1);
        float *dp = malloc((size_t)(T * k) * 4), *row = malloc((size_t)H * 4), *a = malloc((size_t)H * 4);
        fill(y, (size_t)(R * H) * ye, r, &seed);
        fill(dout, (size_t)(T * H) * 4, r, &seed);
        memset(uo, poison, (size_t)(T * H) * oe), memset(dy, poison, (size_t)(R * H) * oe);
        memset(dp, poison, (size_t)(T * k) * 4);
        fm_tensor ty = fm_tensor_2d(y, ydt, R, H), tuo = fm_tensor_2d(uo, odt, T, H);
        fm_tensor tdo = fm_tensor_2d(dout, FM_DTYPE_F32, T, H), tdy = fm_tensor_2d(dy, odt, R, H);
        fm_tensor tdp = fm_tensor_2d(dp, FM_DTYPE_F32, T, k);
        if ((st = fm_moe_unpermute(g_ctx, &ty, &tsr, with_probs ? &tp : NULL, &tuo)))
            fz_fail("%s: unpermute: %s", ctx, fm_last_error(g_ctx));
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                float acc = 0.0f;
                for (int64_t j = 0; j < k; j++) {
                    int32_t s = w_slot[t * k + j];
                    if (s >= 0)
                        acc = fmaf(with_probs ? probs[t * k + j] : 1.0f, load(y, ydt, s * H + h), acc);
                }
                uint32_t got = odt == FM_DTYPE_BF16 ? ((uint16_t *)uo)[t * H + h] : ((uint32_t *)uo)[t * H + h];
                uint32_t want = odt == FM_DTYPE_BF16 ? bf16_rne(acc) : f32_store(acc);
                if (got != want)
                    fz_fail("%s: unpermute out (%lld, %lld) 0x%x, want 0x%x", ctx, (long long)t, (long long)h, got,
                            want);
            }
        if ((st = fm_moe_unpermute_backward(g_ctx, &tdo, with_probs ? &ty : NULL, &trm, &tsr,
                                            with_probs ? &tp : NULL, &tdy, with_probs ? &tdp : NULL)))
            fz_fail("%s: unpermute_backward: %s", ctx, fm_last_error(g_ctx));
        for (int64_t rr = 0; rr < R; rr++)
            for (int64_t h = 0; h < H; h++) {
                int32_t s = w_map[rr];
                float v = s < 0 ? 0.0f : (with_probs ? probs[s] : 1.0f) * ((float *)dout)[(s / k) * H + h];
                uint32_t got = odt == FM_DTYPE_BF16 ? ((uint16_t *)dy)[rr * H + h] : ((uint32_t *)dy)[rr * H + h];
                uint32_t want = odt == FM_DTYPE_BF16 ? bf16_rne(v) : f32_store(v);
                if (got != want)
                    fz_fail("%s: unpermute_backward dy (%lld, %lld) 0x%x, want 0x%x", ctx, (long long)rr,
                            (long long)h, got, want);
            }
        for (int64_t i = 0; i < T * k && with_probs; i++) {
            int32_t s = w_slot[i];
            float want = 0.0f;
            if (s >= 0) {
                for (int64_t h = 0; h < H; h++)
                    row[h] = load(y, ydt, s * H + h), a[h] = ((float *)dout)[(i / k) * H + h];
                want = dot32(a, row, H);
            }
            if (f2u(dp[i]) != f32_store(want))
                fz_fail("%s: dprobs[%lld] 0x%08x, want 0x%08x", ctx, (long long)i, f2u(dp[i]), f32_store(want));
        }
        free(y), free(uo), free(dout), free(dy), free(dp), free(row), free(a);
    }

    /* SwiGLU to an unscaled output: in [T, H] = [g | u] from the input's bytes */
    {
        int64_t I = H / 2;
        fm_dtype idt = b5 & 0x08 ? FM_DTYPE_BF16 : FM_DTYPE_F32, odt = b5 & 0x10 ? FM_DTYPE_BF16 : FM_DTYPE_F32;
        size_t ie = idt == FM_DTYPE_BF16 ? 2 : 4, oe = odt == FM_DTYPE_BF16 ? 2 : 4;
        uint8_t *in = malloc((size_t)(T * H) * ie), *hh = malloc((size_t)(T * I) * oe + 1);
        uint8_t *dh = malloc((size_t)(T * I) * 4), *din = malloc((size_t)(T * H) * oe + 1);
        float *p = malloc((size_t)T * 4), *dp = malloc((size_t)T * 4), *au = malloc((size_t)I * 4 + 4);
        fill(in, (size_t)(T * H) * ie, r, &seed);
        fill(dh, (size_t)(T * I) * 4, r, &seed);
        fill((uint8_t *)p, (size_t)T * 4, r, &seed);
        memset(hh, poison, (size_t)(T * I) * oe), memset(din, poison, (size_t)(T * H) * oe);
        memset(dp, poison, (size_t)T * 4);
        int wp = (b5 & 0x20) != 0;
        fm_tensor tin = fm_tensor_2d(in, idt, T, H), th = fm_tensor_2d(hh, odt, T, I), tpp = fm_tensor_2d(p, FM_DTYPE_F32, T, 1);
        fm_tensor tdh = fm_tensor_2d(dh, FM_DTYPE_F32, T, I), tdin = fm_tensor_2d(din, odt, T, H);
        fm_tensor tdp = fm_tensor_2d(dp, FM_DTYPE_F32, T, 1);
        if ((st = fm_moe_swiglu(g_ctx, NULL, &tin, wp ? &tpp : NULL, &th, NULL, NULL)))
            fz_fail("%s: swiglu: %s", ctx, fm_last_error(g_ctx));
        if ((st = fm_moe_swiglu_backward(g_ctx, NULL, &tdh, &tin, wp ? &tpp : NULL, &tdin, NULL, wp ? &tdp : NULL)))
            fz_fail("%s: swiglu_backward: %s", ctx, fm_last_error(g_ctx));
        for (int64_t t = 0; t < T; t++) {
            for (int64_t i = 0; i < I; i++) {
                float g = load(in, idt, t * H + i), u = load(in, idt, t * H + I + i), d = ((float *)dh)[t * I + i];
                float a = fm_siluf(g), v = a * u, q = wp ? d * p[t] : d;
                float want[3] = {wp ? v * p[t] : v, (q * u) * fm_dsiluf(g), q * a};
                uint8_t *dst[3] = {hh, din, din};
                int64_t at[3] = {t * I + i, t * H + i, t * H + I + i};
                for (int o = 0; o < 3; o++) {
                    uint32_t got = odt == FM_DTYPE_BF16 ? ((uint16_t *)dst[o])[at[o]] : ((uint32_t *)dst[o])[at[o]];
                    uint32_t w = odt == FM_DTYPE_BF16 ? bf16_rne(want[o]) : f32_store(want[o]);
                    if (got != w)
                        fz_fail("%s: swiglu%s (%lld, %lld) 0x%x, want 0x%x", ctx, o ? " backward" : "", (long long)t,
                                (long long)i + (o == 2 ? I : 0), got, w);
                }
                au[i] = v;
            }
            if (wp) {
                float want = dot32_run((float *)dh + t * I, au, I, 8);
                if (f2u(dp[t]) != f32_store(want))
                    fz_fail("%s: swiglu dprobs[%lld] 0x%08x, want 0x%08x", ctx, (long long)t, f2u(dp[t]),
                            f32_store(want));
            }
        }
        free(in), free(hh), free(dh), free(din), free(p), free(dp), free(au);
    }
done:
    free(ids), free(x), free(xs), free(probs), free(cnt), free(start), free(w_map), free(w_slot), free(w_split);
    free(pos), free(out), free(outs), free(rm), free(sr), free(spl), free(hs), free(op);
    return 0;
}
