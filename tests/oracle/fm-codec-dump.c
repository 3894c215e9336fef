/* fm-codec-dump IN OUT: for each little-endian F32 bit pattern in IN, writes
 * to OUT one record of the library's codec results: E4M3, E5M2, E2M1 (one
 * byte each, E2M1 in the low nibble), then BF16 and F16 (two bytes each,
 * little-endian): 7 bytes per input. check_codecs_ml_dtypes.py compares them
 * with ml_dtypes. */
#include <stdio.h>
#include <string.h>

#include "flowmoe/flowmoe.h"

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s IN.f32bits OUT.codes\n", argv[0]);
        return 2;
    }
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (!in || !out) {
        fprintf(stderr, "fm-codec-dump: cannot open %s or %s\n", argv[1], argv[2]);
        return 2;
    }
    unsigned char b[4], rec[7];
    while (fread(b, 1, 4, in) == 4) {
        uint32_t u = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
        float x = fm_bits_f32(u);
        uint16_t h = fm_bf16_from_f32(x), f = fm_f16_from_f32(x);
        rec[0] = fm_e4m3_from_f32(x);
        rec[1] = fm_e5m2_from_f32(x);
        rec[2] = fm_e2m1_from_f32(x);
        rec[3] = (unsigned char)(h & 0xFF);
        rec[4] = (unsigned char)(h >> 8);
        rec[5] = (unsigned char)(f & 0xFF);
        rec[6] = (unsigned char)(f >> 8);
        if (fwrite(rec, 1, 7, out) != 7) {
            fprintf(stderr, "fm-codec-dump: write failed\n");
            return 2;
        }
    }
    if (fclose(out) != 0)
        return 2;
    fclose(in);
    return 0;
}
