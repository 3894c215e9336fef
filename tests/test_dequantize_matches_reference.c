/* fm_dequantize is value = code * scale_inv in F32, then RNE to the output
 * dtype (F32 / BF16 / F16, canonical NaN), written in the output's layout
 * (a column-wise input into a row-wise output is transposed on the way, and
 * the other way round). Judged bit for bit against the reference on
 * arbitrary codes (NaN codes, E5M2 Inf codes, subnormals) and arbitrary
 * scales (non-powers of two, subnormal, huge, NaN, E8M0 0xFF), every mode,
 * dtype, layout, scale layout, 2-D and 3-D, odd and empty shapes. Every
 * output byte is poisoned twice and must be written; nothing past it; the
 * input is untouched. */
#include <float.h>
#include <math.h>

#include "test_util.h"

static float random_scale(void)
{
    switch (tu_rand32() % 8) {
    case 0: return (float)ldexp(1.0, (int)tu_randint(-149, 127));
    case 1: return tu_bits_f32((tu_rand32() & 0x007FFFFFu) | 0x3F800000u); /* [1, 2) */
    case 2: return tu_bits_f32(tu_rand32() & 0x007FFFFFu);                               /* subnormal */
    case 3: return (float)ldexp(1.0 + tu_uniform(), (int)tu_randint(100, 127));
    case 4: return tu_rand32() % 16 == 0 ? tu_bits_f32(0x7FC00000u) : 1.0f;
    case 5: return tu_rand32() % 16 == 0 ? INFINITY : 0.5f;
    default: return (float)ldexp(tu_uniform(), (int)tu_randint(-30, 30));
    }
}

int main(void)
{
    tu_begin("test_dequantize_matches_reference");
    fm_context *ctx = tu_cpu_context(3);
    const int64_t shapes[][3] = {{1, 1, 2}, {1, 2, 1}, {1, 130, 258}, {1, 3, 70}, {3, 34, 160}, {2, 0, 4}, {1, 4, 0}, {1, 256, 130}};
    const fm_dtype outs[3] = {FM_DTYPE_F32, FM_DTYPE_BF16, FM_DTYPE_F16};
    char cs[240];
    long calls = 0;
    for (size_t ci = 0; ci < tu_ncombos; ci++)
        for (int lay = 0; lay < 2; lay++)
            for (int sl = 0; sl < 2; sl++)
                for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
                    const tu_combo *cb = &tu_combos[ci];
                    int64_t E = shapes[si][0], rows = shapes[si][1], cols = shapes[si][2], n = E * rows * cols;
                    if (cb->dt == FM_DTYPE_E2M1 && (lay ? rows : cols) % 2)
                        continue;
                    int ndim = E > 1 || !rows || !cols ? 3 : 2;
                    ref_spec s = {cb->dt, cb->m, (fm_layout)lay, (fm_scale_layout)sl};
                    tu_qout q;
                    tu_qout_init(&q, &s, ndim, E, rows, cols);
                    for (size_t b = 0; b < q.data.n; b++)
                        q.data.p[b] = (uint8_t)tu_rand32();
                    if (cb->m == FM_SCALE_MX32)
                        for (size_t b = 0; b < q.scale.n; b++)
                            q.scale.p[b] = (uint8_t)(tu_rand32() % 32 == 0 ? 0xFF : tu_randint(0, 254));
                    else
                        for (size_t b = 0; b < q.scale.n / 4; b++)
                            ((float *)q.scale.p)[b] = random_scale();
                    uint8_t *dcopy = malloc(q.data.n + 1), *scopy = malloc(q.scale.n + 1);
                    memcpy(dcopy, q.data.p, q.data.n);
                    memcpy(scopy, q.scale.p, q.scale.n);
                    for (int od = 0; od < 3; od++)
                        for (int ol = 0; ol < 2; ol++) {
                            size_t es = outs[od] == FM_DTYPE_F32 ? 4 : 2;
                            tu_buf ob = tu_buf_new((size_t)n * es);
                            uint8_t *want = malloc((size_t)n * es + 1);
                            ref_dequantize(q.data.p, q.scale.p, E, rows, cols, &s, outs[od], (fm_layout)ol, want);
                            fm_tensor to = tu_input(ob.p, outs[od], ndim, E, rows, cols);
                            to.layout = (fm_layout)ol;
                            snprintf(cs, sizeof cs, "%s %s %s %s [%lld,%lld,%lld] -> %s %s", fm_dtype_name(cb->dt),
                                     fm_scale_mode_name(cb->m), lay ? "colwise" : "rowwise",
                                     fm_scale_layout_name((fm_scale_layout)sl), (long long)E, (long long)rows,
                                     (long long)cols, fm_dtype_name(outs[od]), ol ? "colwise" : "rowwise");
                            const uint8_t poisons[2] = {0xA5, 0x5A};
                            for (int pi = 0; pi < 2; pi++) {
                                tu_buf_poison(&ob, poisons[pi]);
                                fm_status st = fm_dequantize(ctx, &q.t, &to);
                                calls++;
                                CHECK(st == FM_OK, "%s: %s", cs, fm_last_error(ctx));
                                CHECK(strcmp(fm_last_error(ctx), "") == 0, "%s: last error after success", cs);
                                if (!tu_same_bytes(ob.p, want, ob.n, "dequantized", cs) && pi == 0) {
                                    for (size_t i = 0; i < ob.n / es; i++)
                                        if (memcmp(ob.p + i * es, want + i * es, es)) {
                                            uint32_t g = 0, w = 0;
                                            memcpy(&g, ob.p + i * es, es);
                                            memcpy(&w, want + i * es, es);
                                            fprintf(stderr, "  element %zu: got 0x%x want 0x%x\n", i, g, w);
                                            break;
                                        }
                                }
                                CHECK(tu_buf_guard_ok(&ob), "%s: wrote past the output", cs);
                            }
                            free(want);
                            tu_buf_free(&ob);
                        }
                    tu_same_bytes(q.data.p, dcopy, q.data.n, "input codes untouched", cs);
                    tu_same_bytes(q.scale.p, scopy, q.scale.n, "input scales untouched", cs);
                    free(dcopy);
                    free(scopy);
                    tu_qout_free(&q);
                }
    printf("%ld dequantize calls\n", calls);
    fm_context_destroy(ctx);
    return tu_end();
}
