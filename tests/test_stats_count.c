/* Context statistics as context.h documents them: each successful
 * fm_quantize is one cast to low precision, each fm_dequantize one cast to
 * high precision, fm_scale_layout_convert neither; op_calls and calls[op]
 * count successful calls; bytes_read / bytes_written are the tensors' data
 * and scale bytes (GEMM padding included); fm_stats_reset zeroes all;
 * failed calls count nothing. */
#include "test_util.h"

int main(void)
{
    tu_begin("test_stats_count");
    fm_context *ctx = tu_cpu_context(2);
    fm_stats st;
    CHECK(fm_stats_get(ctx, &st) == FM_OK && st.op_calls == 0 && st.casts_to_low == 0, "fresh context: zeros");
    CHECK(fm_stats_get(NULL, &st) == FM_ERR_INVALID_ARG && fm_stats_get(ctx, NULL) == FM_ERR_INVALID_ARG,
          "stats_get NULL arguments");
    CHECK(fm_stats_reset(NULL) == FM_ERR_INVALID_ARG, "stats_reset NULL");

    int64_t want_low = 0, want_high = 0, want_rd = 0, want_wr = 0, want_calls[3] = {0, 0, 0};
    for (int it = 0; it < 30; it++) {
        int64_t rows = tu_randint(1, 300), cols = 2 * tu_randint(1, 150);
        fm_dtype idt = (fm_dtype)tu_randint(0, 2);
        fm_scale_mode m = (fm_scale_mode)tu_randint(FM_SCALE_TENSOR, FM_SCALE_MX32);
        fm_dtype qdt = m == FM_SCALE_MX32 && it % 2 ? FM_DTYPE_E2M1 : FM_DTYPE_E5M2;
        if (qdt == FM_DTYPE_E2M1)
            rows += rows % 2;
        fm_scale_layout sl = (fm_scale_layout)(it % 2);
        int64_t n = rows * cols;
        tu_buf in = tu_buf_new((size_t)n * 4);
        memset(in.p, 0, (size_t)n * 4);
        fm_tensor tin = fm_tensor_2d(in.p, idt, rows, cols);
        ref_spec rs = {qdt, m, FM_LAYOUT_ROWWISE, sl}, cs = {qdt, m, FM_LAYOUT_COLWISE, sl};
        tu_qout qr, qc, qg;
        tu_qout_init(&qr, &rs, 2, 1, rows, cols);
        tu_qout_init(&qc, &cs, 2, 1, rows, cols);
        ref_spec gs = rs;
        gs.slayout = (fm_scale_layout)!sl;
        tu_qout_init(&qg, &gs, 2, 1, rows, cols);
        int both = it % 3 != 0;
        CHECK(fm_quantize(ctx, NULL, &tin, &qr.t, both ? &qc.t : NULL) == FM_OK, "quantize: %s", fm_last_error(ctx));
        int64_t esz = idt == FM_DTYPE_F32 ? 4 : 2;
        want_low++;
        want_calls[0]++;
        want_rd += n * esz;
        want_wr += (int64_t)(qr.data.n + qr.scale.n) + (both ? (int64_t)(qc.data.n + qc.scale.n) : 0);

        fm_dtype odt = (fm_dtype)tu_randint(0, 2);
        int64_t osz = odt == FM_DTYPE_F32 ? 4 : 2;
        tu_buf ob = tu_buf_new((size_t)n * 4);
        fm_tensor to = fm_tensor_2d(ob.p, odt, rows, cols);
        CHECK(fm_dequantize(ctx, &qr.t, &to) == FM_OK, "dequantize: %s", fm_last_error(ctx));
        want_high++;
        want_calls[1]++;
        want_rd += (int64_t)(qr.data.n + qr.scale.n);
        want_wr += n * osz;

        CHECK(fm_scale_layout_convert(ctx, &qr.t, &qg.t) == FM_OK, "convert: %s", fm_last_error(ctx));
        want_calls[2]++;
        want_rd += (int64_t)qr.scale.n;
        want_wr += (int64_t)qg.scale.n;

        /* failed calls count nothing */
        fm_tensor bad = tin;
        bad.ndim = 1;
        CHECK(fm_quantize(ctx, NULL, &bad, &qr.t, NULL) == FM_ERR_INVALID_ARG, "invalid quantize");
        CHECK(fm_dequantize(ctx, &qr.t, &bad) == FM_ERR_INVALID_ARG, "invalid dequantize");
        fm_tensor badq = qg.t;
        badq.dtype = FM_DTYPE_F32;
        CHECK(fm_scale_layout_convert(ctx, &qr.t, &badq) == FM_ERR_INVALID_ARG, "invalid convert");

        CHECK(fm_stats_get(ctx, &st) == FM_OK, "stats_get");
        CHECK(st.casts_to_low == want_low && st.casts_to_high == want_high, "casts %lld/%lld want %lld/%lld",
              (long long)st.casts_to_low, (long long)st.casts_to_high, (long long)want_low, (long long)want_high);
        CHECK(st.op_calls == want_calls[0] + want_calls[1] + want_calls[2], "op_calls %lld", (long long)st.op_calls);
        CHECK(st.calls[FM_OP_QUANTIZE] == want_calls[0] && st.calls[FM_OP_DEQUANTIZE] == want_calls[1] &&
                  st.calls[FM_OP_SCALE_LAYOUT_CONVERT] == want_calls[2],
              "per-op calls");
        CHECK(st.bytes_read == want_rd, "bytes_read %lld want %lld (it %d)", (long long)st.bytes_read, (long long)want_rd, it);
        CHECK(st.bytes_written == want_wr, "bytes_written %lld want %lld (it %d)", (long long)st.bytes_written,
              (long long)want_wr, it);
        tu_buf_free(&in);
        tu_buf_free(&ob);
        tu_qout_free(&qr);
        tu_qout_free(&qc);
        tu_qout_free(&qg);
    }
    CHECK(fm_stats_reset(ctx) == FM_OK, "reset");
    fm_stats zero;
    memset(&zero, 0, sizeof zero);
    CHECK(fm_stats_get(ctx, &st) == FM_OK && memcmp(&st, &zero, sizeof st) == 0, "reset zeroes every counter");
    CHECK(strcmp(fm_op_name(FM_OP_QUANTIZE), "quantize") == 0 && strcmp(fm_op_name(FM_OP_DEQUANTIZE), "dequantize") == 0,
          "op names");
    fm_context_destroy(ctx);
    return tu_end();
}
