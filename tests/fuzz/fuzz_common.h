/* Shared by the flowmoe libFuzzer harnesses: a byte reader over the fuzzer's
 * input and a loud failure that libFuzzer records as a crash. */
#ifndef FM_FUZZ_COMMON_H
#define FM_FUZZ_COMMON_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct {
    const uint8_t *p;
    size_t n, i;
} fz_reader;

/* Past the end of the input every read is 0, so a short input is still a
 * complete (mostly default) case. */
static inline uint8_t fz_u8(fz_reader *r) { return r->i < r->n ? r->p[r->i++] : 0; }

static inline uint32_t fz_u32(fz_reader *r)
{
    uint32_t v = 0;
    for (int k = 0; k < 4; k++)
        v |= (uint32_t)fz_u8(r) << (8 * k);
    return v;
}

static inline size_t fz_left(const fz_reader *r) { return r->n - r->i; }

/* splitmix64: fills buffers from a seed the input chooses. */
static inline uint64_t fz_mix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

#if defined(__GNUC__)
__attribute__((format(printf, 1, 2), noreturn))
#endif
static void fz_fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FUZZ ORACLE FAILURE: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    abort();
}

#endif
