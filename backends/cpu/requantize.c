/* CPU reference of the scaling-aware transpose and the direct FP8 <-> MXFP4
 * conversions: one re-encoding on codes and scale exponents (transpose.h). */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

#define P_NAN INT_MIN     /* input block exponent of a non-finite block */
#define P_EMPTY INT_MIN   /* output block that has seen no nonzero code */

static uint8_t get_code(const uint8_t *data, fm_dtype t, int64_t C, int64_t r, int64_t c)
{
    return t == FM_DTYPE_E2M1 ? fm_cpu_get_nibble(data + (size_t)(r * C / 2), c) : data[(size_t)(r * C + c)];
}

static void put_code(uint8_t *data, fm_dtype t, int64_t C, int64_t r, int64_t c, uint8_t v)
{
    if (t == FM_DTYPE_E2M1)
        fm_cpu_put_nibble(data + (size_t)(r * C / 2), c, v);
    else
        data[(size_t)(r * C + c)] = v;
}

static size_t scale_bytes(const fm_tensor *t) { return t->scale_dtype == FM_DTYPE_E8M0 ? 1 : 4; }

/* BLOCK_128x128 -> BLOCK_128x128 transposed: codes and scale grid move, nothing is re-rounded. */
static void transpose_128x128(const fm_tensor *in, fm_tensor *out, int64_t E, int64_t R, int64_t C)
{
    int64_t sin = fm_scale_count_2d(in->scale_mode, in->scale_layout, R, C);
    int64_t sout = fm_scale_count_2d(out->scale_mode, out->scale_layout, C, R);
    for (int64_t e = 0; e < E; e++) {
        const uint8_t *a = (const uint8_t *)in->data + (size_t)(e * R * C);
        uint8_t *b = (uint8_t *)out->data + (size_t)(e * R * C);
        for (int64_t r = 0; r < R; r++)
            for (int64_t c = 0; c < C; c++)
                b[(size_t)(c * R + r)] = a[(size_t)(r * C + c)];
        const float *s = (const float *)in->scale + e * sin;
        float *d = (float *)out->scale + e * sout;
        for (int64_t k = 0; k < sout; k++)
            d[k] = 1.0f;
        for (int64_t rb = 0; rb < fm_cdiv(R, 128); rb++)
            for (int64_t cb = 0; cb < fm_cdiv(C, 128); cb++)
                d[fm_scale_offset(out->scale_mode, out->scale_layout, C, R, cb * 128, rb * 128)] =
                    s[fm_scale_offset(in->scale_mode, in->scale_layout, R, C, rb * 128, cb * 128)];
    }
}

fm_status fm_cpu_requantize(fm_context *ctx, const fm_requant_config *cfg, const fm_tensor *in, fm_tensor *out)
{
    int64_t E = fm_tensor_experts(in), Ri = fm_tensor_stored_rows(in), Ci = fm_tensor_stored_cols(in);
    /* An empty tensor has no codes and, in the block modes, no scales: its
     * buffers may be NULL and nothing is written. */
    if (fm_tensor_numel(in) == 0) {
        if (cfg->nonfinite_blocks)
            *cfg->nonfinite_blocks = 0;
        return FM_OK;
    }
    int transpose = in->layout != out->layout;
    if (in->scale_mode == FM_SCALE_BLOCK_128x128) {
        transpose_128x128(in, out, E, Ri, Ci);
        if (cfg->nonfinite_blocks)
            *cfg->nonfinite_blocks = 0;
        return FM_OK;
    }
    int64_t Ro = transpose ? Ci : Ri, Co = transpose ? Ri : Ci;
    int64_t bi = fm_mode_block_cols(in->scale_mode), bo = fm_mode_block_cols(out->scale_mode);
    int64_t nbi = fm_cdiv(Ci, bi), nbo = fm_cdiv(Co, bo);
    int64_t sin = fm_scale_count_2d(in->scale_mode, in->scale_layout, Ri, Ci);
    int64_t sout = fm_scale_count_2d(out->scale_mode, out->scale_layout, Ro, Co);
    int64_t in_bytes = fm_tensor_nbytes(in) / (E ? E : 1), out_bytes = fm_tensor_nbytes(out) / (E ? E : 1);
    int rowmax = cfg->rule == FM_REQUANT_ROWMAX, floor_rule = cfg->rule == FM_REQUANT_MX_FLOOR;
    fm_dtype ti = in->dtype, to = out->dtype;
    uint8_t nan = fm_elem_nan(to);

    size_t ni = (size_t)(Ri * nbi > 0 ? Ri * nbi : 1), no = (size_t)(Ro * nbo > 0 ? Ro * nbo : 1);
    int *pin = malloc(ni * sizeof(int));
    int *pout = malloc(no * sizeof(int));
    uint8_t *bad = malloc(no);
    if (!pin || !pout || !bad) {
        free(pin);
        free(pout);
        free(bad);
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "%s: out of host memory for the block exponents",
                        transpose ? "fm_transpose_scaled" : "fm_convert_scaled");
    }
    /* P of each code alone, for the output format. */
    int lut[256];
    for (int c = 0; c < 256; c++)
        lut[c] = fm_code_scale_exp(ti, (uint8_t)c, to, floor_rule);

    /* Every input scale is checked before anything is written. */
    for (int64_t e = 0; e < E; e++) {
        const uint8_t *sb = (const uint8_t *)in->scale + (size_t)(e * sin) * scale_bytes(in);
        for (int64_t r = 0; r < Ri; r++)
            for (int64_t cb = 0; cb < nbi; cb++) {
                int64_t off = fm_scale_offset(in->scale_mode, in->scale_layout, Ri, Ci, r, cb * bi);
                if (in->scale_dtype == FM_DTYPE_E8M0)
                    continue;
                int p;
                float s = ((const float *)sb)[off];
                if (!fm_f32_pow2_exp(s, &p)) {
                    free(pin);
                    free(pout);
                    free(bad);
                    return fm_error(ctx, FM_ERR_INVALID_ARG,
                                    "in->scale: the scale of block (expert %lld, stored row %lld, block %lld) is %g, "
                                    "not a positive power of two; scaling-aware ops need POW2 scales",
                                    (long long)e, (long long)r, (long long)cb, (double)s);
                }
            }
    }

    int64_t total_bad = 0;
    for (int64_t e = 0; e < E; e++) {
        const uint8_t *sb = (const uint8_t *)in->scale + (size_t)(e * sin) * scale_bytes(in);
        const uint8_t *a = (const uint8_t *)in->data + (size_t)(e * in_bytes);
        uint8_t *b = (uint8_t *)out->data + (size_t)(e * out_bytes);
        for (int64_t r = 0; r < Ri; r++)
            for (int64_t cb = 0; cb < nbi; cb++) {
                int64_t off = fm_scale_offset(in->scale_mode, in->scale_layout, Ri, Ci, r, cb * bi);
                int p = 0;
                if (in->scale_dtype == FM_DTYPE_E8M0)
                    p = sb[off] == FM_E8M0_NAN ? P_NAN : (int)sb[off] - 127;
                else if (fm_f32_pow2_exp(((const float *)sb)[off], &p) == 2)
                    p = P_NAN;
                pin[r * nbi + cb] = p;
            }
        for (int64_t k = 0; k < Ro * nbo; k++) {
            pout[k] = P_EMPTY;
            bad[k] = 0;
        }
        /* Each output block's exponent from the codes and exponents it covers. */
        for (int64_t r = 0; r < Ri; r++)
            for (int64_t c = 0; c < Ci; c++) {
                int64_t ro = transpose ? c : r, co = transpose ? r : c;
                int64_t k = ro * nbo + co / bo;
                int p = pin[r * nbi + c / bi];
                uint8_t code = get_code(a, ti, Ci, r, c);
                if (p == P_NAN || fm_elem_code_nonfinite(ti, code)) {
                    bad[k] = 1;
                    continue;
                }
                int q = rowmax ? p : fm_elem_code_mag(ti, code) ? lut[code] + p : P_EMPTY;
                if (q > pout[k])
                    pout[k] = q;
            }
        uint8_t *so8 = (uint8_t *)out->scale + (size_t)(e * sout) * scale_bytes(out);
        float *so32 = (float *)so8;
        if (out->scale_dtype == FM_DTYPE_E8M0)
            memset(so8, 127, (size_t)sout);
        else
            for (int64_t k = 0; k < sout; k++)
                so32[k] = 1.0f;
        for (int64_t ro = 0; ro < Ro; ro++)
            for (int64_t cb = 0; cb < nbo; cb++) {
                int64_t k = ro * nbo + cb;
                int64_t off = fm_scale_offset(out->scale_mode, out->scale_layout, Ro, Co, ro, cb * bo);
                int p = pout[k] == P_EMPTY ? 0 : pout[k] < -127 ? -127 : pout[k] > 127 ? 127 : pout[k];
                pout[k] = p;
                total_bad += bad[k];
                if (out->scale_dtype == FM_DTYPE_E8M0)
                    so8[off] = bad[k] ? (uint8_t)FM_E8M0_NAN : (uint8_t)(p + 127);
                else
                    so32[off] = bad[k] ? fm_bits_f32(FM_F32_CANON_NAN) : fm_exp2i(p);
            }
        for (int64_t r = 0; r < Ri; r++)
            for (int64_t c = 0; c < Ci; c++) {
                int64_t ro = transpose ? c : r, co = transpose ? r : c;
                int64_t k = ro * nbo + co / bo;
                uint8_t v = bad[k] ? nan
                                   : fm_requant_code(ti, get_code(a, ti, Ci, r, c), pin[r * nbi + c / bi] - pout[k], to);
                put_code(b, to, Co, ro, co, v);
            }
    }
    if (cfg->nonfinite_blocks)
        *cfg->nonfinite_blocks = total_bad;
    free(pin);
    free(pout);
    free(bad);
    return FM_OK;
}
