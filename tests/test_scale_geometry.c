/* Scale-array geometry: fm_scale_count_2d / fm_scale_offset (format.h) and
 * the descriptor size helpers (tensor.h) against the layouts as documented:
 * compact = row-major [R, ceil(C / block)]; GEMM BLOCK_1x128 =
 * [ceil(C/128)][round_up(R, 4)]; GEMM BLOCK_128x128 =
 * [ceil(R/128)][round_up(ceil(C/128), 4)]; GEMM MX32 = cuBLAS 128 x 4 tiles
 * of 512 entries. Every block maps inside the array, distinct blocks to
 * distinct entries, and all elements of a block to the same entry. */
#include "test_util.h"

static const fm_scale_mode modes[5] = {FM_SCALE_TENSOR, FM_SCALE_ROW, FM_SCALE_BLOCK_1x128, FM_SCALE_BLOCK_128x128,
                                       FM_SCALE_MX32};

static void check_geometry(fm_scale_mode m, fm_scale_layout l, int64_t R, int64_t C)
{
    int64_t n = fm_scale_count_2d(m, l, R, C);
    CHECK(n == ref_scale_count(m, l, R, C), "count %s %s R=%lld C=%lld: got %lld want %lld", fm_scale_mode_name(m),
          fm_scale_layout_name(l), (long long)R, (long long)C, (long long)n, (long long)ref_scale_count(m, l, R, C));
    if (n <= 0 || n > 1 << 22)
        return;
    uint8_t *hit = calloc((size_t)n, 1);
    int64_t br = ref_block_rows(m, R), bc = ref_block_cols(m, C);
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) {
            int64_t off = fm_scale_offset(m, l, R, C, r, c);
            int64_t want = ref_scale_offset(m, l, R, C, r, c);
            if (off != want) {
                CHECK(off == want, "offset %s %s R=%lld C=%lld (%lld,%lld): got %lld want %lld",
                      fm_scale_mode_name(m), fm_scale_layout_name(l), (long long)R, (long long)C, (long long)r,
                      (long long)c, (long long)off, (long long)want);
                free(hit);
                return;
            }
            if (off < 0 || off >= n) {
                CHECK(0, "offset %lld outside [0, %lld)", (long long)off, (long long)n);
                free(hit);
                return;
            }
            /* the block's first element owns the entry */
            int first = (r % br == 0) && (c % bc == 0);
            if (m == FM_SCALE_TENSOR)
                first = r == 0 && c == 0;
            if (first) {
                tu_checks++;
                if (hit[off]) {
                    CHECK(0, "%s %s R=%lld C=%lld: two blocks share entry %lld", fm_scale_mode_name(m),
                          fm_scale_layout_name(l), (long long)R, (long long)C, (long long)off);
                    free(hit);
                    return;
                }
                hit[off] = 1;
            } else {
                int64_t r0 = m == FM_SCALE_TENSOR ? 0 : r - r % br, c0 = m == FM_SCALE_TENSOR ? 0 : c - c % bc;
                tu_checks++;
                if (off != fm_scale_offset(m, l, R, C, r0, c0)) {
                    CHECK(0, "element (%lld,%lld) not with its block", (long long)r, (long long)c);
                    free(hit);
                    return;
                }
            }
        }
    free(hit);
}

int main(void)
{
    tu_begin("test_scale_geometry");
    /* cuBLAS's MX layout: row 0 block 1 is entry 1, row 32 block 0 is entry 4,
     * row 1 block 0 is entry 16, the second tile starts at 512 */
    CHECK(ref_scale_offset(FM_SCALE_MX32, FM_SCALE_LAYOUT_GEMM, 256, 256, 0, 32) == 1 &&
              ref_scale_offset(FM_SCALE_MX32, FM_SCALE_LAYOUT_GEMM, 256, 256, 32, 0) == 4 &&
              ref_scale_offset(FM_SCALE_MX32, FM_SCALE_LAYOUT_GEMM, 256, 256, 1, 0) == 16 &&
              ref_scale_offset(FM_SCALE_MX32, FM_SCALE_LAYOUT_GEMM, 256, 256, 0, 128) == 512,
          "reference MX swizzle");
    const int64_t dims[] = {0, 1, 2, 3, 4, 5, 31, 32, 33, 127, 128, 129, 130, 255, 256, 257, 300};
    const size_t nd = sizeof dims / sizeof dims[0];
    for (int mi = 0; mi < 5; mi++)
        for (int l = 0; l < 2; l++)
            for (size_t a = 0; a < nd; a++)
                for (size_t b = 0; b < nd; b++)
                    check_geometry(modes[mi], (fm_scale_layout)l, dims[a], dims[b]);

    /* descriptor sizes: 3-D, column-wise, E2M1 packing */
    for (int i = 0; i < 300; i++) {
        int64_t E = tu_randint(1, 4), rows = tu_randint(0, 300), cols = tu_randint(0, 300) & ~(int64_t)1;
        fm_scale_mode m = modes[tu_randint(0, 4)];
        fm_layout lay = (fm_layout)tu_randint(0, 1);
        fm_scale_layout sl = (fm_scale_layout)tu_randint(0, 1);
        fm_dtype dt = m == FM_SCALE_MX32 && tu_randint(0, 1) ? FM_DTYPE_E2M1 : FM_DTYPE_E4M3;
        if (dt == FM_DTYPE_E2M1 && lay == FM_LAYOUT_COLWISE)
            rows &= ~(int64_t)1;
        fm_tensor t = fm_tensor_3d(NULL, dt, E, rows, cols);
        t.layout = lay;
        t.scale_mode = m;
        t.scale_dtype = fm_scale_mode_dtype(m);
        t.scale_layout = sl;
        ref_spec s = {dt, m, lay, sl};
        CHECK(fm_tensor_numel(&t) == E * rows * cols, "numel");
        CHECK(fm_tensor_nbytes(&t) == ref_data_bytes(&s, E, rows, cols), "nbytes %s %lldx%lldx%lld",
              fm_dtype_name(dt), (long long)E, (long long)rows, (long long)cols);
        CHECK(fm_tensor_scale_nbytes(&t) == ref_scale_bytes(&s, E, rows, cols), "scale nbytes %s %s %s",
              fm_scale_mode_name(m), fm_layout_name(lay), fm_scale_layout_name(sl));
        CHECK(fm_tensor_stored_rows(&t) == ref_stored_rows(&s, rows, cols) &&
                  fm_tensor_stored_cols(&t) == ref_stored_cols(&s, rows, cols) && fm_tensor_experts(&t) == E,
              "stored shape");
    }
    fm_tensor bad = fm_tensor_2d(NULL, FM_DTYPE_F32, -1, 4);
    CHECK(fm_tensor_numel(&bad) == -1 && fm_tensor_nbytes(&bad) == -1 && fm_tensor_scale_count(&bad) == -1,
          "sizes of an invalid shape are -1");
    bad = fm_tensor_2d(NULL, FM_DTYPE_F32, 4, 4);
    bad.ndim = 4;
    CHECK(fm_tensor_numel(&bad) == -1, "ndim 4 numel is -1");
    return tu_end();
}
