/* fm_moe_permute equals the straightforward composition "group the (token,
 * choice) slots by expert in token order, then pad each expert to the
 * multiple with zero rows of scale 1": codes and compact scales (FP8 1x128,
 * FP8 and FP4 MX32) moved bit for bit, BF16/F32 rows too, row_map, slot_rows,
 * splits, host_splits and out_probs, on random routings with empty experts,
 * all tokens on one expert, k = 1 and 8, odd T, rows to spare past the
 * routing, slots with no expert (-1, some tokens with none at all). A NaN token stays in its own rows. fm_moe_unpermute is the fmaf
 * combine in choice order skipping -1 slots; its backward scatters w * dout and gives dprobs
 * as the fixed-order dot, checked by finite differences of a double model.
 * Routings that do not fit, ids out of range and bad descriptors are refused
 * before anything is written. */
#include <math.h>

#include "flowmoe/mathfn.h"
#include "test_util.h"

typedef struct {
    fm_dtype dt;
    fm_scale_mode m;
} kind;

static const kind kinds[] = {{FM_DTYPE_F32, FM_SCALE_NONE},      {FM_DTYPE_BF16, FM_SCALE_NONE},
                             {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E5M2, FM_SCALE_MX32},
                             {FM_DTYPE_E2M1, FM_SCALE_MX32}};

static int64_t rbytes(const kind *kd, int64_t H)
{
    return kd->dt == FM_DTYPE_E2M1 ? H / 2 : H * (kd->dt == FM_DTYPE_F32 ? 4 : kd->dt == FM_DTYPE_BF16 ? 2 : 1);
}
static int64_t sbytes(const kind *kd, int64_t H)
{
    if (kd->m == FM_SCALE_NONE)
        return 0;
    return kd->m == FM_SCALE_MX32 ? (H + 31) / 32 : 4 * ((H + 127) / 128);
}

static fm_tensor desc(const kind *kd, void *d, void *s, int64_t rows, int64_t H)
{
    if (kd->m == FM_SCALE_NONE)
        return fm_tensor_2d(d, kd->dt, rows, H);
    return fm_tensor_quant_2d(d, kd->dt, rows, H, FM_LAYOUT_ROWWISE, kd->m, s, FM_SCALE_LAYOUT_COMPACT);
}

static void permute_case(fm_context *ctx, int it)
{
    const kind *kd = &kinds[it % 5];
    int64_t T = tu_randint(1, 41) | (it % 3 == 0), E = tu_randint(1, 12), k = it % 4 == 0 ? 1 : tu_randint(1, 8);
    if (it % 6 == 1)
        k = 8;
    int64_t H = 2 * tu_randint(1, 150);
    int pad = it % 4 == 0 ? 0 : it % 4 == 1 ? 1 : it % 4 == 2 ? 16 : 128;
    int64_t P1 = pad > 1 ? pad : 1;
    int64_t R = T * k + E * (P1 - 1) + (it % 2 ? tu_randint(0, 5) : 0);
    int64_t rb = rbytes(kd, H), sb = sbytes(kd, H);
    uint8_t *x = malloc((size_t)(T * rb)), *xs = malloc((size_t)(T * sb + 1));
    for (int64_t i = 0; i < T * rb; i++)
        x[i] = (uint8_t)tu_rand32();
    if (kd->dt == FM_DTYPE_F32)
        for (int64_t i = 0; i < T * H; i++)
            ((float *)x)[i] = (float)tu_normal();
    for (int64_t i = 0; i < T * sb; i++)
        xs[i] = (uint8_t)tu_randint(100, 150);
    if (kd->m == FM_SCALE_BLOCK_1x128)
        for (int64_t i = 0; i < T * sb / 4; i++)
            ((float *)xs)[i] = ldexpf(1.0f, (int)tu_randint(-20, 20));
    /* token nan_t carries NaN (NaN codes, a NaN scale, NaN values) */
    int64_t nan_t = tu_randint(0, T - 1);
    if (kd->dt == FM_DTYPE_F32)
        ((float *)x)[nan_t * H] = NAN;
    else if (kd->dt == FM_DTYPE_BF16)
        ((uint16_t *)x)[nan_t * H] = 0x7FC0;
    else if (kd->m == FM_SCALE_MX32)
        xs[nan_t * sb] = 0xFF;
    else
        ((float *)xs)[nan_t * sb / 4] = NAN;

    int32_t *ids = malloc((size_t)(T * k * 4));
    /* 0 random, 1 all on one expert, 2 skewed to few, 3 distinct per token, 4 empty tail, 5 random with -1 */
    int mode = it % 6;
    int64_t one = tu_randint(0, E - 1);
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < k; j++) {
            int64_t e = mode == 1 ? one : mode == 2 ? tu_randint(0, E > 2 ? 2 : E - 1)
                      : mode == 3 ? (t + j) % E : mode == 4 ? tu_randint(0, (E - 1) / 2) : tu_randint(0, E - 1);
            ids[t * k + j] = mode == 5 && (t % 3 == 0 || tu_randint(0, 2) == 0) ? -1 : (int32_t)e;
        }
    float *probs = malloc((size_t)(T * k * 4));
    for (int64_t i = 0; i < T * k; i++)
        probs[i] = (float)tu_uniform();

    /* the composition */
    int64_t *cnt = calloc((size_t)E, 8), *wsplit = calloc((size_t)E, 8);
    int32_t *wmap = malloc((size_t)(R * 4)), *wslot = malloc((size_t)(T * k * 4));
    for (int64_t r = 0; r < R; r++)
        wmap[r] = -1;
    for (int64_t i = 0; i < T * k; i++)
        wslot[i] = -1;
    int64_t row = 0;
    for (int64_t e = 0; e < E; e++) {
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < k; j++)
                if (ids[t * k + j] == e) {
                    wmap[row] = (int32_t)(t * k + j);
                    wslot[t * k + j] = (int32_t)row;
                    row++;
                    cnt[e]++;
                }
        while (pad > 1 && cnt[e] % pad)
            row++, cnt[e]++;
        wsplit[e] = cnt[e];
    }
    tu_buf out = tu_buf_new((size_t)(R * rb)), outs = tu_buf_new((size_t)(R * sb));
    tu_buf rm = tu_buf_new((size_t)R * 4), sr = tu_buf_new((size_t)(T * k * 4)), sp = tu_buf_new((size_t)E * 8);
    tu_buf op = tu_buf_new((size_t)R * 4);
    tu_buf_poison(&out, 0xCD);
    tu_buf_poison(&outs, 0xCD);
    tu_buf_poison(&rm, 0xCD);
    tu_buf_poison(&sr, 0xCD);
    tu_buf_poison(&sp, 0xCD);
    tu_buf_poison(&op, 0xCD);
    int64_t hs[16];
    memset(hs, 0xCD, sizeof hs);
    fm_tensor tx = desc(kd, x, xs, T, H), tout = desc(kd, out.p, outs.p, R, H);
    fm_tensor tid = fm_tensor_2d(ids, FM_DTYPE_I32, T, k), tp = fm_tensor_2d(probs, FM_DTYPE_F32, T, k);
    fm_tensor trm = fm_tensor_2d(rm.p, FM_DTYPE_I32, R, 1), tsr = fm_tensor_2d(sr.p, FM_DTYPE_I32, T, k);
    fm_tensor tsp = fm_tensor_2d(sp.p, FM_DTYPE_I64, 1, E), top = fm_tensor_2d(op.p, FM_DTYPE_F32, R, 1);
    fm_permute_config cfg = {pad};
    char c[160];
    snprintf(c, sizeof c, "it %d %s %s T %lld E %lld k %lld H %lld pad %d R %lld mode %d", it, fm_dtype_name(kd->dt),
             fm_scale_mode_name(kd->m), (long long)T, (long long)E, (long long)k, (long long)H, pad, (long long)R,
             mode);
    fm_status st = fm_moe_permute(ctx, &cfg, &tx, &tid, &tp, &tout, &trm, &tsr, &tsp, &top, hs);
    CHECK(st == FM_OK, "%s: %s", c, fm_last_error(ctx));
    tu_same_bytes(sp.p, wsplit, (size_t)E * 8, "splits", c);
    tu_same_bytes(hs, wsplit, (size_t)E * 8, "host_splits", c);
    tu_same_bytes(rm.p, wmap, (size_t)R * 4, "row_map", c);
    tu_same_bytes(sr.p, wslot, (size_t)(T * k * 4), "slot_rows", c);
    int nan_leak = 0;
    for (int64_t r = 0; r < R; r++) {
        int32_t s = wmap[r];
        uint8_t zero[2048] = {0};
        const uint8_t *wd = s >= 0 ? x + (s / k) * rb : zero;
        CHECK(!memcmp(out.p + r * rb, wd, (size_t)rb), "%s: row %lld (slot %d) codes", c, (long long)r, s);
        if (sb) {
            uint8_t ones[64];
            for (int64_t i = 0; i < sb; i++)
                ones[i] = 127;
            if (kd->m == FM_SCALE_BLOCK_1x128)
                for (int64_t i = 0; i < sb / 4; i++)
                    ((float *)ones)[i] = 1.0f;
            const uint8_t *ws = s >= 0 ? xs + (s / k) * sb : ones;
            CHECK(!memcmp(outs.p + r * sb, ws, (size_t)sb), "%s: row %lld scales", c, (long long)r);
        }
        float wp = s >= 0 ? probs[s] : 0.0f;
        CHECK(((float *)op.p)[r] == wp, "%s: out_probs[%lld]", c, (long long)r);
        /* NaN only in the rows of the NaN token */
        if (s < 0 || s / k != nan_t) {
            if (kd->dt == FM_DTYPE_F32)
                for (int64_t h = 0; h < H; h++)
                    nan_leak |= ((float *)out.p)[r * H + h] != ((float *)out.p)[r * H + h];
            if (kd->m == FM_SCALE_MX32)
                for (int64_t i = 0; i < sb; i++)
                    nan_leak |= outs.p[r * sb + i] == 0xFF;
        }
    }
    CHECK(!nan_leak, "%s: NaN outside the NaN token's rows", c);
    CHECK(tu_buf_guard_ok(&out) && tu_buf_guard_ok(&outs) && tu_buf_guard_ok(&rm) && tu_buf_guard_ok(&op),
          "%s: writes past the buffers", c);

    /* a routing that does not fit in R - 1 rows... is refused before any write */
    int64_t need = 0;
    for (int64_t e = 0; e < E; e++)
        need += wsplit[e];
    if (need > 0) {
        fm_tensor small = desc(kd, out.p, outs.p, need - 1, H), srm = fm_tensor_2d(rm.p, FM_DTYPE_I32, need - 1, 1);
        fm_tensor sop = fm_tensor_2d(op.p, FM_DTYPE_F32, need - 1, 1);
        tu_buf_poison(&sp, 0xEE);
        tu_buf_poison(&rm, 0xEE);
        CHECK(fm_moe_permute(ctx, &cfg, &tx, &tid, &tp, &small, &srm, &tsr, &tsp, &sop, NULL) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "out:"),
              "%s: R = need - 1 must be refused naming out: %s", c, fm_last_error(ctx));
        CHECK(sp.p[0] == 0xEE && rm.p[0] == 0xEE, "%s: a refused permute wrote", c);
    }
    free(x), free(xs), free(ids), free(probs), free(cnt), free(wsplit), free(wmap), free(wslot);
    tu_buf_free(&out), tu_buf_free(&outs), tu_buf_free(&rm), tu_buf_free(&sr), tu_buf_free(&sp), tu_buf_free(&op);
}

/* unpermute, its backward, and the gradient check */
static void unpermute_case(fm_context *ctx, int it)
{
    int64_t T = tu_randint(1, 37), k = it % 3 == 0 ? 1 : tu_randint(1, 8), H = tu_randint(1, 100);
    int64_t R = T * k + tu_randint(0, 9);
    fm_dtype ydt = it % 2 ? FM_DTYPE_BF16 : FM_DTYPE_F32, odt = it % 4 < 2 ? FM_DTYPE_F32 : FM_DTYPE_BF16;
    int use_p = it % 5 != 0;
    /* a random injective slot -> row map; the other rows are padding */
    int32_t *perm = malloc((size_t)R * 4), *sr = malloc((size_t)(T * k * 4)), *rm = malloc((size_t)R * 4);
    for (int64_t r = 0; r < R; r++)
        perm[r] = (int32_t)r;
    for (int64_t r = R - 1; r > 0; r--) {
        int64_t q = tu_randint(0, r);
        int32_t tmp = perm[r];
        perm[r] = perm[q];
        perm[q] = tmp;
    }
    for (int64_t r = 0; r < R; r++)
        rm[r] = -1;
    /* every 4th case drops some slots (-1: no expert here), token 0 all of them */
    for (int64_t s = 0; s < T * k; s++) {
        if (it % 4 == 3 && (s < k || tu_randint(0, 2) == 0)) {
            sr[s] = -1;
            continue;
        }
        sr[s] = perm[s];
        rm[perm[s]] = (int32_t)s;
    }
    float *yf = malloc((size_t)(R * H * 4)), *w = malloc((size_t)(T * k * 4)), *dof = malloc((size_t)(T * H * 4));
    void *y = malloc((size_t)(R * H * 4)), *dout = malloc((size_t)(T * H * 4));
    for (int64_t i = 0; i < R * H; i++)
        yf[i] = (float)tu_normal();
    for (int64_t i = 0; i < T * H; i++)
        dof[i] = (float)tu_normal();
    if (H > 3 && T > 1 && sr[k] >= 0)
        yf[sr[k] * H + 2] = NAN; /* token 1's first choice */
    for (int64_t i = 0; i < T * k; i++)
        w[i] = (float)tu_uniform();
    tu_store_input(yf, R * H, ydt, y, yf);
    tu_store_input(dof, T * H, odt, dout, dof);
    fm_tensor ty = fm_tensor_2d(y, ydt, R, H), tsr = fm_tensor_2d(sr, FM_DTYPE_I32, T, k);
    fm_tensor tw = fm_tensor_2d(w, FM_DTYPE_F32, T, k), trm = fm_tensor_2d(rm, FM_DTYPE_I32, R, 1);
    tu_buf out = tu_buf_new((size_t)(T * H * 4));
    tu_buf_poison(&out, 0xCD);
    fm_tensor to = fm_tensor_2d(out.p, odt, T, H);
    char c[128];
    snprintf(c, sizeof c, "unpermute it %d T %lld k %lld H %lld R %lld %s->%s probs %d", it, (long long)T, (long long)k,
             (long long)H, (long long)R, fm_dtype_name(ydt), fm_dtype_name(odt), use_p);
    CHECK(fm_moe_unpermute(ctx, &ty, &tsr, use_p ? &tw : NULL, &to) == FM_OK, "%s: %s", c, fm_last_error(ctx));
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++)
                if (sr[t * k + j] >= 0)
                    acc = fmaf(use_p ? w[t * k + j] : 1.0f, yf[sr[t * k + j] * H + h], acc);
            uint32_t want = odt == FM_DTYPE_F32 ? tu_f32_bits(acc != acc ? NAN : acc)
                                                : or_encode(OF_BF16, (double)acc);
            if (acc != acc)
                want = odt == FM_DTYPE_F32 ? 0x7FC00000u : 0x7FC0u;
            uint32_t got = odt == FM_DTYPE_F32 ? ((uint32_t *)out.p)[t * H + h] : ((uint16_t *)out.p)[t * H + h];
            CHECK_EQ_U(got, want, "%s: out[%lld, %lld]", c, (long long)t, (long long)h);
            if (acc != acc)
                CHECK(t == 1, "%s: NaN reached token %lld", c, (long long)t);
        }
    CHECK(tu_buf_guard_ok(&out), "%s: guard", c);

    /* backward */
    tu_buf dy = tu_buf_new((size_t)(R * H * 4)), dp = tu_buf_new((size_t)(T * k * 4));
    tu_buf_poison(&dy, 0xCD);
    tu_buf_poison(&dp, 0xCD);
    fm_tensor tdo = fm_tensor_2d(dout, odt, T, H), tdy = fm_tensor_2d(dy.p, ydt, R, H);
    fm_tensor tdp = fm_tensor_2d(dp.p, FM_DTYPE_F32, T, k);
    CHECK(fm_moe_unpermute_backward(ctx, &tdo, use_p ? &ty : NULL, &trm, &tsr, use_p ? &tw : NULL, &tdy,
                                    use_p ? &tdp : NULL) == FM_OK,
          "%s backward: %s", c, fm_last_error(ctx));
    for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < H; h++) {
            int32_t s = rm[r];
            float v = s < 0 ? 0.0f : (use_p ? w[s] : 1.0f) * dof[(s / k) * H + h];
            uint32_t want = ydt == FM_DTYPE_F32 ? tu_f32_bits(v) : or_encode(OF_BF16, (double)v);
            uint32_t got = ydt == FM_DTYPE_F32 ? ((uint32_t *)dy.p)[r * H + h] : ((uint16_t *)dy.p)[r * H + h];
            CHECK_EQ_U(got, want, "%s: dy[%lld, %lld] (slot %d)", c, (long long)r, (long long)h, s);
        }
    if (use_p)
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < k; j++) {
                float a[128], b[128];
                double fd = 0, mag = 0;
                if (sr[t * k + j] < 0) {
                    CHECK_EQ_U(((uint32_t *)dp.p)[t * k + j], 0u, "%s: dprobs of a -1 slot", c);
                    continue;
                }
                for (int64_t h = 0; h < H; h++) {
                    a[h] = dof[t * H + h];
                    b[h] = yf[sr[t * k + j] * H + h];
                }
                float want = fm_dot_order_f32(a, b, H);
                CHECK_EQ_U(((uint32_t *)dp.p)[t * k + j], tu_f32_bits(want != want ? NAN : want), "%s: dprobs order",
                           c);
                if (want != want)
                    continue;
                /* d/dw of L = sum dout . out, in double by central differences */
                double eps = 1e-3;
                for (int64_t h = 0; h < H; h++) {
                    double lp = 0, lm = 0;
                    /* the other choices' terms cancel in lp - lm (one may hold the NaN) */
                    lp += ((double)w[t * k + j] + eps) * yf[sr[t * k + j] * H + h];
                    lm += ((double)w[t * k + j] - eps) * yf[sr[t * k + j] * H + h];
                    fd += a[h] * (lp - lm) / (2 * eps);
                    mag += fabs(a[h] * b[h]);
                }
                CHECK(fabs(((float *)dp.p)[t * k + j] - fd) <= 1e-5 * (mag + 1), "%s: dprobs %g vs %g", c,
                      (double)((float *)dp.p)[t * k + j], fd);
            }
    /* out-of-range rows are refused */
    sr[0] = (int32_t)R;
    CHECK(fm_moe_unpermute(ctx, &ty, &tsr, NULL, &to) == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "slot_rows"),
          "%s: slot_rows out of range: %s", c, fm_last_error(ctx));
    rm[0] = (int32_t)(T * k);
    CHECK(fm_moe_unpermute_backward(ctx, &tdo, NULL, &trm, &tsr, NULL, &tdy, NULL) == FM_ERR_INVALID_ARG &&
              strstr(fm_last_error(ctx), "row_map"),
          "%s: row_map out of range: %s", c, fm_last_error(ctx));
    free(perm), free(sr), free(rm), free(yf), free(w), free(dof), free(y), free(dout);
    tu_buf_free(&out), tu_buf_free(&dy), tu_buf_free(&dp);
}

int main(void)
{
    tu_begin("test_moe_permute_matches_composition");
    fm_context *ctx = tu_cpu_context(2);
    for (int it = 0; it < 180; it++)
        permute_case(ctx, it);
    for (int it = 0; it < 80; it++)
        unpermute_case(ctx, it);

    /* permute then unpermute with w = 1 and k = 1 is the identity on F32 rows */
    {
        int64_t T = 13, H = 40, E = 5;
        float x[13 * 40], back[13 * 40], outd[(13 + 5 * 15) * 40];
        int32_t ids[13], rm[13 + 75], sr[13];
        int64_t sp[5];
        for (int i = 0; i < T * H; i++)
            x[i] = (float)tu_normal();
        for (int t = 0; t < T; t++)
            ids[t] = (int32_t)tu_randint(0, E - 1);
        int64_t R = T + E * 15;
        fm_tensor tx = fm_tensor_2d(x, FM_DTYPE_F32, T, H), to = fm_tensor_2d(outd, FM_DTYPE_F32, R, H);
        fm_tensor tid = fm_tensor_2d(ids, FM_DTYPE_I32, T, 1), trm = fm_tensor_2d(rm, FM_DTYPE_I32, R, 1);
        fm_tensor tsr = fm_tensor_2d(sr, FM_DTYPE_I32, T, 1), tsp = fm_tensor_2d(sp, FM_DTYPE_I64, 1, E);
        fm_tensor tb = fm_tensor_2d(back, FM_DTYPE_F32, T, H);
        fm_permute_config cfg = {16};
        CHECK(fm_moe_permute(ctx, &cfg, &tx, &tid, NULL, &to, &trm, &tsr, &tsp, NULL, NULL) == FM_OK, "roundtrip permute");
        CHECK(fm_moe_unpermute(ctx, &to, &tsr, NULL, &tb) == FM_OK, "roundtrip unpermute");
        CHECK(!memcmp(x, back, sizeof x), "permute then unpermute is the identity");

        /* invalid arguments */
        cfg.pad_multiple = -1;
        CHECK(fm_moe_permute(ctx, &cfg, &tx, &tid, NULL, &to, &trm, &tsr, &tsp, NULL, NULL) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "pad_multiple"), "negative pad: %s", fm_last_error(ctx));
        cfg.pad_multiple = 0;
        ids[3] = (int32_t)E;
        CHECK(fm_moe_permute(ctx, &cfg, &tx, &tid, NULL, &to, &trm, &tsr, &tsp, NULL, NULL) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "expert_ids"), "id out of range: %s", fm_last_error(ctx));
        ids[3] = -2;
        CHECK(fm_moe_permute(ctx, &cfg, &tx, &tid, NULL, &to, &trm, &tsr, &tsp, NULL, NULL) == FM_ERR_INVALID_ARG,
              "negative id other than -1");
        ids[3] = 0;
        fm_tensor op = fm_tensor_2d(back, FM_DTYPE_F32, R, 1);
        CHECK(fm_moe_permute(ctx, &cfg, &tx, &tid, NULL, &to, &trm, &tsr, &tsp, &op, NULL) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "out_probs"), "out_probs without probs: %s", fm_last_error(ctx));
        fm_tensor bad = fm_tensor_2d(outd, FM_DTYPE_BF16, R, H);
        CHECK(fm_moe_permute(ctx, &cfg, &tx, &tid, NULL, &bad, &trm, &tsr, &tsp, NULL, NULL) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "out"), "out dtype: %s", fm_last_error(ctx));
        fm_tensor brm = fm_tensor_2d(rm, FM_DTYPE_I32, R - 1, 1);
        CHECK(fm_moe_permute(ctx, &cfg, &tx, &tid, NULL, &to, &brm, &tsr, &tsp, NULL, NULL) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "row_map"), "row_map shape: %s", fm_last_error(ctx));
        fm_tensor alias = fm_tensor_2d(x, FM_DTYPE_F32, R, H);
        CHECK(fm_moe_permute(ctx, &cfg, &tx, &tid, NULL, &alias, &trm, &tsr, &tsp, NULL, NULL) == FM_ERR_INVALID_ARG,
              "out aliasing x");
        fm_tensor q = fm_tensor_quant_2d(outd, FM_DTYPE_E4M3, T, H, FM_LAYOUT_ROWWISE, FM_SCALE_BLOCK_1x128, back,
                                         FM_SCALE_LAYOUT_GEMM);
        CHECK(fm_moe_permute(ctx, &cfg, &q, &tid, NULL, &to, &trm, &tsr, &tsp, NULL, NULL) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "COMPACT"), "GEMM-layout scales: %s", fm_last_error(ctx));
        fm_tensor y16 = fm_tensor_2d(outd, FM_DTYPE_E4M3, R, H);
        CHECK(fm_moe_unpermute(ctx, &y16, &tsr, NULL, &tb) == FM_ERR_INVALID_ARG && strstr(fm_last_error(ctx), "y"),
              "unpermute of FP8: %s", fm_last_error(ctx));
        fm_tensor dpr = fm_tensor_2d(back, FM_DTYPE_F32, T, 1);
        CHECK(fm_moe_unpermute_backward(ctx, &tb, NULL, &trm, &tsr, NULL, &to, &dpr) == FM_ERR_INVALID_ARG &&
                  strstr(fm_last_error(ctx), "probs"), "dprobs without probs: %s", fm_last_error(ctx));
    }
    fm_context_destroy(ctx);
    return tu_end();
}
