/* NaN in a GEMM operand, as a NaN code (E4M3 0x7F/0xFF, E5M2 NaN), an E5M2
 * Inf met by a zero, a NaN BF16/F32 element or a NaN scale, reaches every
 * output it touches and no other: the output is NaN (canonical bits) exactly
 * where the reference rule (gemm_ref.h) gives NaN, and equal to it elsewhere. */
#include "gemm_ref.h"

typedef struct {
    fm_dtype a, b;
    fm_scale_mode ma, mb;
} pair;

static void poison(gr_op *o, int64_t r, int64_t k, int what)
{
    double v = NAN;
    uint32_t bits = o->dt == FM_DTYPE_E4M3 ? 0x7Fu : o->dt == FM_DTYPE_E5M2 ? 0xFEu
                  : o->dt == FM_DTYPE_BF16 ? 0xFFC1u : 0x7F800001u;
    if (what == 1 && o->dt == FM_DTYPE_E5M2) {
        bits = 0x7Cu; /* +Inf */
        v = INFINITY;
    }
    if (what == 2 && o->mode != FM_SCALE_NONE) {
        *gr_scale_ptr(o, 0, r, k) = NAN;
        return;
    }
    o->v[r * o->K + k] = v;
    gr_store(o, 0, r, k, bits);
}

int main(void)
{
    tu_begin("test_gemm_nan_propagates");
    fm_context *ctx = tu_cpu_context(2);
    static const pair pairs[] = {
        {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_TENSOR, FM_SCALE_TENSOR},
        {FM_DTYPE_E5M2, FM_DTYPE_E4M3, FM_SCALE_ROW, FM_SCALE_ROW},
        {FM_DTYPE_E4M3, FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128},
        {FM_DTYPE_E4M3, FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_1x128},
        {FM_DTYPE_BF16, FM_DTYPE_BF16, FM_SCALE_NONE, FM_SCALE_NONE},
        {FM_DTYPE_F32, FM_DTYPE_F32, FM_SCALE_NONE, FM_SCALE_NONE},
    };
    for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++)
        for (int rep = 0; rep < 6; rep++) {
            int64_t M = tu_randint(1, 40), N = tu_randint(1, 200), K = tu_randint(1, 400);
            fm_dtype out = (fm_dtype)tu_randint(0, 1);
            gr_op A, B;
            gr_make(&A, pairs[p].a, pairs[p].ma, FM_SCALE_LAYOUT_COMPACT, FM_LAYOUT_ROWWISE, 1, M, K, GR_RANDOM);
            gr_make(&B, pairs[p].b, pairs[p].mb, FM_SCALE_LAYOUT_GEMM, FM_LAYOUT_ROWWISE, 1, N, K, GR_RANDOM);
            int what = rep % 3;
            int64_t ka = tu_randint(0, K - 1);
            gr_op *tgt = tu_randint(0, 1) ? &A : &B;
            if (what == 1) /* an E5M2 Inf where there is one */
                tgt = A.dt == FM_DTYPE_E5M2 ? &A : B.dt == FM_DTYPE_E5M2 ? &B : tgt;
            gr_op *other = tgt == &A ? &B : &A;
            poison(tgt, tu_randint(0, tgt->rows - 1), ka, what);
            if (what == 1) /* ... meets zeros of the other operand */
                for (int64_t r = 0; r < other->rows; r++) {
                    other->v[r * K + ka] = 0.0;
                    gr_store(other, 0, r, ka, 0);
                }
            double *ref = malloc((size_t)(M * N) * sizeof(double));
            gr_ref(&A, 0, 0, &B, 0, M, ref);
            void *d = gr_out_new(M * N, out, 0);
            fm_tensor dt = fm_tensor_2d(d, out, M, N);
            fm_status st = fm_gemm(ctx, NULL, &A.t, &B.t, &dt);
            CHECK(st == FM_OK, "status %s: %s", fm_status_name(st), fm_last_error(ctx));
            int64_t nans = 0, bad = 0;
            for (int64_t i = 0; i < M * N && st == FM_OK; i++) {
                uint32_t want = gr_round(ref[i], out, 0, 0, K), got = gr_get_out(d, out, i);
                nans += isnan(ref[i]);
                if (got != want && bad++ < 3)
                    CHECK(got == want, "%s x %s (%s x %s) M %lld N %lld K %lld poison %d: (%lld, %lld) got 0x%x want 0x%x",
                          fm_dtype_name(pairs[p].a), fm_dtype_name(pairs[p].b), fm_scale_mode_name(pairs[p].ma),
                          fm_scale_mode_name(pairs[p].mb), (long long)M, (long long)N, (long long)K, what,
                          (long long)(i / N), (long long)(i % N), got, want);
            }
            CHECK(bad == 0, "mismatches");
            /* The poison touched something unless it was a scale of an
             * unscaled operand or an Inf in a dtype without Inf. */
            int inert = what == 2 && pairs[p].ma == FM_SCALE_NONE;
            CHECK(inert || nans > 0, "poison %d reached no output", what);
            free(ref);
            free(d);
            gr_free(&A);
            gr_free(&B);
        }
    fm_context_destroy(ctx);
    return tu_end();
}
