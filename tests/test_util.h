/* Shared helpers of the CPU test suite: checks that count and report with
 * context, a seeded RNG, and an independent oracle of the scalar format rules
 * (nearest representable value by search over every code, not format.h's bit
 * tricks), used to judge the library's codecs and quantizers. */
#ifndef FM_TEST_UTIL_H
#define FM_TEST_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flowmoe/flowmoe.h"
#include "layer_step.h"

/* Every element dtype x scaling mode pair the library quantizes to. */
typedef struct {
    fm_dtype dt;
    fm_scale_mode m;
} tu_combo;
extern const tu_combo tu_combos[];
extern const size_t tu_ncombos;

/* ---- checks -------------------------------------------------------------- */

extern long tu_checks, tu_fails;

/* Seeds the RNG from FM_TEST_SEED when set, else from the clock, and prints
 * the seed so that a failing run can be replayed. */
void tu_begin(const char *name);
/* Prints the totals; the exit status: 0 only when every check passed and at
 * least one check ran (a test that asserts nothing fails). */
int tu_end(void);

int tu_fail(const char *file, int line, const char *expr, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
int tu_check_eq_u(const char *file, int line, const char *ea, const char *eb, uint64_t a, uint64_t b,
                  const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 7, 8)))
#endif
    ;

/* CHECK(cond, "context %d", x): counts, and on failure prints the context. */
#define CHECK(cond, ...) \
    ((void)(tu_checks++, (cond) ? 0 : tu_fail(__FILE__, __LINE__, #cond, __VA_ARGS__)))
/* Unsigned equality that prints both sides in hex. */
#define CHECK_EQ_U(a, b, ...) \
    ((void)tu_check_eq_u(__FILE__, __LINE__, #a, #b, (uint64_t)(a), (uint64_t)(b), __VA_ARGS__))

/* ---- RNG (xoshiro256**, seeded by splitmix64) ---------------------------- */

uint64_t tu_seed(void);
uint64_t tu_rand(void);
uint32_t tu_rand32(void);
double tu_uniform(void);          /* [0, 1) */
double tu_normal(void);           /* N(0, 1) */
int64_t tu_randint(int64_t lo, int64_t hi); /* [lo, hi] */

/* ---- bits ---------------------------------------------------------------- */

uint32_t tu_f32_bits(float f);
float tu_bits_f32(uint32_t u);
int tu_is_nan(double x);

/* ---- the oracle codec ---------------------------------------------------- */

typedef enum { OF_E4M3, OF_E5M2, OF_E2M1, OF_BF16, OF_F16, OF_E8M0, OF_COUNT } or_fmt;

/* Value of a code from the format's definition: sign, biased exponent and
 * mantissa fields, in double (ldexp), with the format's special codes. */
double or_decode(or_fmt f, uint32_t code);
/* x rounded to the nearest value of the format, ties to the code with an even
 * mantissa; FP8/FP4 saturate to +-max (Inf too); BF16/F16 overflow to Inf as
 * IEEE RNE does. NaN gives the code format.h names for the format. */
uint32_t or_encode(or_fmt f, double x);
double or_max(or_fmt f);
/* Spacing of the format's values in the binade that holds |v| (the
 * subnormal spacing below the smallest normal). */
double or_quantum(or_fmt f, double v);
int or_bits(or_fmt f);
const char *or_name(or_fmt f);
or_fmt or_from_dtype(fm_dtype d);

/* Scale rules from their definitions, by search over p in double. */
int or_pow2_exp(double a, double max_elem);  /* smallest p with a / 2^p <= max, clamped to [-127, 127] */
int or_floor_exp(double a, double max_elem); /* floor(log2 a) - floor(log2 max), clamped */

/* ---- the reference quantizer --------------------------------------------- */

/* One quantized output described independently of the library. */
typedef struct {
    fm_dtype dtype;           /* E4M3, E5M2, E2M1 */
    fm_scale_mode mode;
    fm_layout layout;
    fm_scale_layout slayout;
} ref_spec;

/* Stored matrix of one expert: rows x cols after the layout. */
int64_t ref_stored_rows(const ref_spec *s, int64_t rows, int64_t cols);
int64_t ref_stored_cols(const ref_spec *s, int64_t rows, int64_t cols);
/* Scale entries of one stored R x C matrix (GEMM padding included), and the
 * entry of stored element (r, c), written from the layouts' documentation. */
int64_t ref_scale_count(fm_scale_mode m, fm_scale_layout l, int64_t R, int64_t C);
int64_t ref_scale_offset(fm_scale_mode m, fm_scale_layout l, int64_t R, int64_t C, int64_t r, int64_t c);
int64_t ref_data_bytes(const ref_spec *s, int64_t E, int64_t rows, int64_t cols);
int64_t ref_scale_bytes(const ref_spec *s, int64_t E, int64_t rows, int64_t cols);
int ref_block_rows(fm_scale_mode m, int64_t R);
int64_t ref_block_cols(fm_scale_mode m, int64_t C);

/* Quantize x (E x rows x cols logical, F32 values) into codes and scales the
 * way DESIGN.md and quant.h define it. Returns the number of non-finite
 * blocks. */
int64_t ref_quantize(const float *x, int64_t E, int64_t rows, int64_t cols, fm_scale_rule rule, float eps,
                     const ref_spec *s, uint8_t *codes, void *scales);
/* Dequantize reference: code * scale in F32, then to `out` (F32 canonical NaN,
 * BF16, F16), written in the logical layout `out_layout`. */
void ref_dequantize(const uint8_t *codes, const void *scales, int64_t E, int64_t rows, int64_t cols,
                    const ref_spec *s, fm_dtype out, fm_layout out_layout, void *dst);
/* Code of stored element (r, c) of expert e. */
uint8_t ref_get_code(const ref_spec *s, const uint8_t *codes, int64_t E, int64_t rows, int64_t cols, int64_t e,
                     int64_t r, int64_t c);
/* Scale of stored element (r, c) of expert e as F32 (E8M0 decoded). */
float ref_get_scale(const ref_spec *s, const void *scales, int64_t rows, int64_t cols, int64_t e, int64_t r,
                    int64_t c);


/* Heap buffer with `guard` poisoned bytes after n payload bytes. */
typedef struct {
    uint8_t *p;
    size_t n, guard;
} tu_buf;

/* ---- test tensors and quantized outputs ---------------------------------- */

enum { TD_RANDOM, TD_ZEROS, TD_SUBNORMAL, TD_MAXMAG, TD_WIDE, TD_NONFINITE, TD_TIES, TD_COUNT };
const char *tu_data_name(int kind);
/* n logical values (rows of `cols`) of one kind of nasty data. */
void tu_fill(float *x, int64_t n, int64_t cols, int kind);
/* Store x as `d` (F32, BF16, F16); `rounded` gets the values the stored
 * input holds (what the library must quantize). */
void tu_store_input(const float *x, int64_t n, fm_dtype d, void *dst, float *rounded);

/* A quantized output with poison-able, guarded buffers. */
typedef struct {
    ref_spec s;
    int64_t E, rows, cols;
    tu_buf data, scale;
    fm_tensor t;
} tu_qout;
void tu_qout_init(tu_qout *o, const ref_spec *s, int ndim, int64_t E, int64_t rows, int64_t cols);
void tu_qout_poison(tu_qout *o, uint8_t v);
void tu_qout_free(tu_qout *o);
/* An input descriptor over `data`. */
fm_tensor tu_input(void *data, fm_dtype d, int ndim, int64_t E, int64_t rows, int64_t cols);
/* Byte compare with a report of the first difference; returns 1 when equal. */
int tu_same_bytes(const void *got, const void *want, size_t n, const char *what, const char *ctx);

/* ---- misc ---------------------------------------------------------------- */

/* A CPU context or exit(1) with the reason. */
fm_context *tu_cpu_context(int threads);

tu_buf tu_buf_new(size_t n);
void tu_buf_poison(tu_buf *b, uint8_t v);
int tu_buf_guard_ok(const tu_buf *b);
void tu_buf_free(tu_buf *b);

const char *tu_rule_name(fm_scale_rule r);

#endif
