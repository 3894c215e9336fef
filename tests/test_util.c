/* The shared test helpers and the independent oracle (see test_util.h). The
 * oracle deliberately shares no code with format.h: values come from the
 * formats' field definitions evaluated in double, rounding from a search
 * over every representable value. */
#include "test_util.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <time.h>
#include <unistd.h>

const tu_combo tu_combos[] = {
    {FM_DTYPE_E4M3, FM_SCALE_TENSOR}, {FM_DTYPE_E4M3, FM_SCALE_ROW}, {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128},
    {FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128}, {FM_DTYPE_E4M3, FM_SCALE_MX32}, {FM_DTYPE_E5M2, FM_SCALE_TENSOR},
    {FM_DTYPE_E5M2, FM_SCALE_ROW}, {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E5M2, FM_SCALE_BLOCK_128x128},
    {FM_DTYPE_E5M2, FM_SCALE_MX32}, {FM_DTYPE_E2M1, FM_SCALE_MX32},
};
const size_t tu_ncombos = sizeof tu_combos / sizeof tu_combos[0];

long tu_checks, tu_fails;
static const char *tu_name = "test";
static uint64_t tu_seed_v, tu_s[4];
#define TU_MAX_REPORTS 40

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void tu_begin(const char *name)
{
    tu_name = name;
    const char *env = getenv("FM_TEST_SEED");
    tu_seed_v = env && *env ? strtoull(env, NULL, 0)
                            : ((uint64_t)time(NULL) * 0x100000001B3ull) ^ ((uint64_t)getpid() << 16);
    uint64_t x = tu_seed_v;
    for (int i = 0; i < 4; i++)
        tu_s[i] = splitmix64(&x);
    printf("%s: seed %llu (replay with FM_TEST_SEED=%llu)\n", name, (unsigned long long)tu_seed_v,
           (unsigned long long)tu_seed_v);
    fflush(stdout);
}

int tu_end(void)
{
    if (tu_checks == 0) {
        printf("%s: FAIL: no check ran\n", tu_name);
        return 1;
    }
    printf("%s: %ld checks, %ld failed (seed %llu)\n", tu_name, tu_checks, tu_fails,
           (unsigned long long)tu_seed_v);
    return tu_fails ? 1 : 0;
}

/* Counts one failure and prints it (head, then the caller's message), up to
 * TU_MAX_REPORTS of them; returns 0 so that checks can return it. */
static int report_fail(const char *file, int line, const char *head, const char *fmt, va_list ap)
{
    tu_fails++;
    if (tu_fails > TU_MAX_REPORTS) {
        if (tu_fails == TU_MAX_REPORTS + 1)
            fprintf(stderr, "(further failures counted, not printed)\n");
        return 0;
    }
    fprintf(stderr, "%s:%d: FAIL %s: ", file, line, head);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    return 0;
}

int tu_fail(const char *file, int line, const char *expr, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    report_fail(file, line, expr, fmt, ap);
    va_end(ap);
    return 0;
}

int tu_check_eq_u(const char *file, int line, const char *ea, const char *eb, uint64_t a, uint64_t b,
                  const char *fmt, ...)
{
    tu_checks++;
    if (a == b)
        return 1;
    char head[256];
    snprintf(head, sizeof head, "%s == %s: got 0x%llx, want 0x%llx", ea, eb, (unsigned long long)a,
             (unsigned long long)b);
    va_list ap;
    va_start(ap, fmt);
    report_fail(file, line, head, fmt, ap);
    va_end(ap);
    return 0;
}

/* ---- RNG ----------------------------------------------------------------- */

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t tu_seed(void) { return tu_seed_v; }

uint64_t tu_rand(void)
{
    uint64_t r = rotl(tu_s[1] * 5, 7) * 9, t = tu_s[1] << 17;
    tu_s[2] ^= tu_s[0];
    tu_s[3] ^= tu_s[1];
    tu_s[1] ^= tu_s[2];
    tu_s[0] ^= tu_s[3];
    tu_s[2] ^= t;
    tu_s[3] = rotl(tu_s[3], 45);
    return r;
}

uint32_t tu_rand32(void) { return (uint32_t)(tu_rand() >> 32); }
double tu_uniform(void) { return (double)(tu_rand() >> 11) * 0x1p-53; }

double tu_normal(void)
{
    double u = tu_uniform(), v = tu_uniform();
    return sqrt(-2.0 * log(1.0 - u)) * cos(6.283185307179586 * v);
}

int64_t tu_randint(int64_t lo, int64_t hi) { return lo + (int64_t)(tu_rand() % (uint64_t)(hi - lo + 1)); }

/* ---- bits ---------------------------------------------------------------- */

uint32_t tu_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

float tu_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int tu_is_nan(double x) { return x != x; }

/* ---- oracle codec -------------------------------------------------------- */

typedef struct {
    const char *name;
    int ebits, mbits, bias;
    int special;      /* 0 none (E2M1), 1 IEEE Inf/NaN at all-ones exponent, 2 E4M3FN (S.1111.111 NaN only) */
    int saturating;   /* satfinite (FP8/FP4) or IEEE overflow to Inf (BF16/F16) */
    uint32_t nan_code;
} fmt_def;

static const fmt_def fdefs[OF_COUNT] = {
    [OF_E4M3] = {"E4M3", 4, 3, 7, 2, 1, 0x7F},
    [OF_E5M2] = {"E5M2", 5, 2, 15, 1, 1, 0x7E},
    [OF_E2M1] = {"E2M1", 2, 1, 1, 0, 1, 0x7},
    [OF_BF16] = {"BF16", 8, 7, 127, 1, 0, 0x7FC0},
    [OF_F16] = {"F16", 5, 10, 15, 1, 0, 0x7E00},
    [OF_E8M0] = {"E8M0", 8, 0, 127, 0, 1, 0xFF},
};

int or_bits(or_fmt f) { return f == OF_E8M0 ? 8 : 1 + fdefs[f].ebits + fdefs[f].mbits; }
const char *or_name(or_fmt f) { return fdefs[f].name; }

or_fmt or_from_dtype(fm_dtype d)
{
    switch (d) {
    case FM_DTYPE_E4M3: return OF_E4M3;
    case FM_DTYPE_E5M2: return OF_E5M2;
    case FM_DTYPE_E2M1: return OF_E2M1;
    case FM_DTYPE_BF16: return OF_BF16;
    case FM_DTYPE_F16: return OF_F16;
    default: return OF_E8M0;
    }
}

double or_decode(or_fmt f, uint32_t code)
{
    if (f == OF_E8M0)
        return code == 0xFF ? NAN : ldexp(1.0, (int)code - 127);
    const fmt_def *d = &fdefs[f];
    int nb = or_bits(f);
    uint32_t s = (code >> (nb - 1)) & 1u;
    uint32_t e = (code >> d->mbits) & ((1u << d->ebits) - 1u);
    uint32_t m = code & ((1u << d->mbits) - 1u);
    uint32_t eall = (1u << d->ebits) - 1u, mall = (1u << d->mbits) - 1u;
    double v;
    if (d->special == 1 && e == eall)
        v = m ? NAN : INFINITY;
    else if (d->special == 2 && e == eall && m == mall)
        v = NAN;
    else if (e == 0)
        v = ldexp((double)m, 1 - d->bias - d->mbits);                     /* 0.m * 2^(1-bias) */
    else
        v = ldexp((double)((1u << d->mbits) + m), (int)e - d->bias - d->mbits); /* 1.m * 2^(e-bias) */
    if (tu_is_nan(v))
        return v;
    return s ? -v : v;
}

typedef struct {
    int n;
    double *val;
    uint32_t *code;
} fmt_table;

static fmt_table tables[OF_COUNT];

static const fmt_table *table(or_fmt f)
{
    fmt_table *t = &tables[f];
    if (t->n)
        return t;
    int nb = or_bits(f);
    uint32_t npos = 1u << (nb - 1);
    t->val = malloc(sizeof(double) * npos);
    t->code = malloc(sizeof(uint32_t) * npos);
    for (uint32_t c = 0; c < npos; c++) {
        double v = or_decode(f, c);
        if (tu_is_nan(v) || isinf(v))
            continue;
        /* insertion keeps the table sorted by value whatever the code order */
        int k = t->n++;
        while (k > 0 && t->val[k - 1] > v) {
            t->val[k] = t->val[k - 1];
            t->code[k] = t->code[k - 1];
            k--;
        }
        t->val[k] = v;
        t->code[k] = c;
    }
    return t;
}

double or_max(or_fmt f)
{
    const fmt_table *t = table(f);
    return t->val[t->n - 1];
}

static uint32_t even_of(uint32_t a, uint32_t b) { return (a & 1u) == 0 ? a : b; }

uint32_t or_encode(or_fmt f, double x)
{
    const fmt_def *d = &fdefs[f];
    if (tu_is_nan(x))
        return d->nan_code;
    const fmt_table *t = table(f);
    int nb = or_bits(f);
    uint32_t sign = signbit(x) ? 1u << (nb - 1) : 0u;
    double a = fabs(x);
    double mx = t->val[t->n - 1];
    uint32_t mag;
    if (a >= mx) {
        if (d->saturating) {
            mag = t->code[t->n - 1];
        } else {
            /* IEEE: the next value past max would be 2^(emax+1), an Inf code with
             * an even (zero) mantissa, so the midpoint ties to Inf. */
            int ex;
            frexp(mx, &ex);
            double next = ldexp(1.0, ex);
            double mid = (mx + next) / 2;
            uint32_t inf = ((1u << d->ebits) - 1u) << d->mbits;
            mag = a < mid ? t->code[t->n - 1] : a > mid ? inf : even_of(inf, t->code[t->n - 1]);
        }
    } else {
        int lo = 0, hi = t->n - 1; /* val[lo] <= a < val[hi] */
        while (hi - lo > 1) {
            int m = (lo + hi) / 2;
            if (t->val[m] <= a)
                lo = m;
            else
                hi = m;
        }
        double mid = (t->val[lo] + t->val[hi]) / 2;
        mag = a < mid ? t->code[lo] : a > mid ? t->code[hi] : even_of(t->code[lo], t->code[hi]);
    }
    return sign | mag;
}

double or_quantum(or_fmt f, double v)
{
    const fmt_def *d = &fdefs[f];
    v = fabs(v);
    double min_normal = ldexp(1.0, 1 - d->bias);
    if (v < min_normal)
        return ldexp(1.0, 1 - d->bias - d->mbits);
    int ex;
    frexp(v, &ex);
    return ldexp(1.0, ex - 1 - d->mbits);
}

static int clamp127(int p) { return p < -127 ? -127 : p > 127 ? 127 : p; }

int or_pow2_exp(double a, double max_elem)
{
    if (a == 0.0)
        return 0;
    /* a < 2^ea, so at p = ea - 40 the quotient is >= 2^39, above every max:
     * search upward from there */
    int ea;
    frexp(a, &ea);
    for (int p = ea - 40;; p++)
        if (ldexp(a, -p) <= max_elem)
            return clamp127(p);
}

int or_floor_exp(double a, double max_elem)
{
    if (a == 0.0)
        return 0;
    int ea, em;
    frexp(a, &ea);
    frexp(max_elem, &em);
    return clamp127((ea - 1) - (em - 1));
}

/* ---- reference quantizer ------------------------------------------------- */

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t rup(int64_t a, int64_t b) { return cdiv(a, b) * b; }

int64_t ref_stored_rows(const ref_spec *s, int64_t rows, int64_t cols)
{
    return s->layout == FM_LAYOUT_COLWISE ? cols : rows;
}

int64_t ref_stored_cols(const ref_spec *s, int64_t rows, int64_t cols)
{
    return s->layout == FM_LAYOUT_COLWISE ? rows : cols;
}

int ref_block_rows(fm_scale_mode m, int64_t R)
{
    return m == FM_SCALE_BLOCK_128x128 ? 128 : m == FM_SCALE_TENSOR ? (int)(R > 0 ? R : 1) : 1;
}

int64_t ref_block_cols(fm_scale_mode m, int64_t C)
{
    switch (m) {
    case FM_SCALE_BLOCK_1x128: case FM_SCALE_BLOCK_128x128: return 128;
    case FM_SCALE_MX32: return 32;
    default: return C > 0 ? C : 1;
    }
}

int64_t ref_scale_count(fm_scale_mode m, fm_scale_layout l, int64_t R, int64_t C)
{
    int gemm = l == FM_SCALE_LAYOUT_GEMM;
    switch (m) {
    case FM_SCALE_TENSOR: return 1;
    case FM_SCALE_ROW: return R;
    case FM_SCALE_BLOCK_1x128: return gemm ? cdiv(C, 128) * rup(R, 4) : R * cdiv(C, 128);
    case FM_SCALE_BLOCK_128x128: return gemm ? cdiv(R, 128) * rup(cdiv(C, 128), 4) : cdiv(R, 128) * cdiv(C, 128);
    case FM_SCALE_MX32: {
        /* cuBLAS block-scaled layout: tiles of 128 rows x 4 blocks, 512 entries each */
        int64_t ntr = cdiv(R, 128), ntc = cdiv(cdiv(C, 32), 4);
        return gemm ? ntr * ntc * 512 : R * cdiv(C, 32);
    }
    default: return -1;
    }
}

int64_t ref_scale_offset(fm_scale_mode m, fm_scale_layout l, int64_t R, int64_t C, int64_t r, int64_t c)
{
    int gemm = l == FM_SCALE_LAYOUT_GEMM;
    switch (m) {
    case FM_SCALE_TENSOR: return 0;
    case FM_SCALE_ROW: return r;
    case FM_SCALE_BLOCK_1x128:
        /* GEMM: VEC128, scales of one 128-column block contiguous over the rows (rows padded to 4) */
        return gemm ? (c / 128) * rup(R, 4) + r : r * cdiv(C, 128) + c / 128;
    case FM_SCALE_BLOCK_128x128:
        return gemm ? (r / 128) * rup(cdiv(C, 128), 4) + c / 128 : (r / 128) * cdiv(C, 128) + c / 128;
    case FM_SCALE_MX32: {
        int64_t kb = c / 32;
        if (!gemm)
            return r * cdiv(C, 32) + kb;
        int64_t ntc = cdiv(cdiv(C, 32), 4);
        int64_t tile = (r / 128) * ntc + kb / 4;
        int64_t rr = r % 128;
        /* inside a tile: [32 rows][4 row groups of 32][4 blocks] */
        return tile * 512 + (rr % 32) * 16 + (rr / 32) * 4 + kb % 4;
    }
    default: return -1;
    }
}

int64_t ref_data_bytes(const ref_spec *s, int64_t E, int64_t rows, int64_t cols)
{
    int64_t R = ref_stored_rows(s, rows, cols), C = ref_stored_cols(s, rows, cols);
    return s->dtype == FM_DTYPE_E2M1 ? E * R * (C / 2) : E * R * C;
}

int64_t ref_scale_bytes(const ref_spec *s, int64_t E, int64_t rows, int64_t cols)
{
    int64_t R = ref_stored_rows(s, rows, cols), C = ref_stored_cols(s, rows, cols);
    return E * ref_scale_count(s->mode, s->slayout, R, C) * (s->mode == FM_SCALE_MX32 ? 1 : 4);
}

static float stored_x(const float *x, int64_t rows, int64_t cols, const ref_spec *s, int64_t e, int64_t r,
                      int64_t c)
{
    return s->layout == FM_LAYOUT_COLWISE ? x[(e * rows + c) * cols + r] : x[(e * rows + r) * cols + c];
}

static void put_code(const ref_spec *s, uint8_t *codes, int64_t R, int64_t C, int64_t e, int64_t r, int64_t c,
                     uint8_t v)
{
    if (s->dtype == FM_DTYPE_E2M1) {
        uint8_t *b = codes + e * R * (C / 2) + r * (C / 2) + c / 2;
        if (c % 2 == 0)
            *b = (uint8_t)((*b & 0xF0) | (v & 0xF));
        else
            *b = (uint8_t)((*b & 0x0F) | ((v & 0xF) << 4));
    } else {
        codes[e * R * C + r * C + c] = v;
    }
}

uint8_t ref_get_code(const ref_spec *s, const uint8_t *codes, int64_t E, int64_t rows, int64_t cols, int64_t e,
                     int64_t r, int64_t c)
{
    (void)E;
    int64_t R = ref_stored_rows(s, rows, cols), C = ref_stored_cols(s, rows, cols);
    if (s->dtype == FM_DTYPE_E2M1) {
        uint8_t b = codes[e * R * (C / 2) + r * (C / 2) + c / 2];
        return c % 2 == 0 ? (b & 0xF) : (uint8_t)(b >> 4);
    }
    return codes[e * R * C + r * C + c];
}

float ref_get_scale(const ref_spec *s, const void *scales, int64_t rows, int64_t cols, int64_t e, int64_t r,
                    int64_t c)
{
    int64_t R = ref_stored_rows(s, rows, cols), C = ref_stored_cols(s, rows, cols);
    int64_t per = ref_scale_count(s->mode, s->slayout, R, C);
    int64_t off = e * per + ref_scale_offset(s->mode, s->slayout, R, C, r, c);
    if (s->mode == FM_SCALE_MX32)
        return (float)or_decode(OF_E8M0, ((const uint8_t *)scales)[off]);
    return ((const float *)scales)[off];
}

int64_t ref_quantize(const float *x, int64_t E, int64_t rows, int64_t cols, fm_scale_rule rule, float eps,
                     const ref_spec *s, uint8_t *codes, void *scales)
{
    int64_t R = ref_stored_rows(s, rows, cols), C = ref_stored_cols(s, rows, cols);
    int64_t per = ref_scale_count(s->mode, s->slayout, R, C);
    int e8 = s->mode == FM_SCALE_MX32;
    or_fmt f = or_from_dtype(s->dtype);
    double mx = or_max(f);
    if (rule == FM_SCALE_RULE_DEFAULT)
        rule = (s->mode == FM_SCALE_TENSOR || s->mode == FM_SCALE_ROW) ? FM_SCALE_RULE_EXACT : FM_SCALE_RULE_POW2;
    int64_t br = ref_block_rows(s->mode, R), bc = ref_block_cols(s->mode, C);
    int64_t nbr = s->mode == FM_SCALE_TENSOR ? 1 : cdiv(R, br);
    int64_t nbc = (s->mode == FM_SCALE_TENSOR || s->mode == FM_SCALE_ROW) ? 1 : cdiv(C, bc);
    uint8_t nan_code = s->dtype == FM_DTYPE_E4M3 ? 0x7F : s->dtype == FM_DTYPE_E5M2 ? 0x7E : 0;
    int64_t bad = 0;
    memset(codes, 0, (size_t)ref_data_bytes(s, E, rows, cols));
    for (int64_t e = 0; e < E; e++) {
        for (int64_t k = 0; k < per; k++) {
            if (e8)
                ((uint8_t *)scales)[e * per + k] = 127;
            else
                ((float *)scales)[e * per + k] = 1.0f;
        }
        for (int64_t rb = 0; rb < nbr; rb++)
            for (int64_t cb = 0; cb < nbc; cb++) {
                int64_t r0 = rb * br, r1 = r0 + br < R ? r0 + br : R;
                int64_t c0 = cb * bc, c1 = c0 + bc < C ? c0 + bc : C;
                double amax = 0;
                int nonfinite = 0;
                for (int64_t r = r0; r < r1; r++)
                    for (int64_t c = c0; c < c1; c++) {
                        double v = stored_x(x, rows, cols, s, e, r, c);
                        if (!isfinite(v))
                            nonfinite = 1;
                        else if (fabs(v) > amax)
                            amax = fabs(v);
                    }
                int64_t off = e * per + ref_scale_offset(s->mode, s->slayout, R, C, r0, c0);
                if (nonfinite) {
                    bad++;
                    if (e8)
                        ((uint8_t *)scales)[off] = 0xFF;
                    else
                        ((float *)scales)[off] = tu_bits_f32(0x7FC00000u);
                    for (int64_t r = r0; r < r1; r++)
                        for (int64_t c = c0; c < c1; c++)
                            put_code(s, codes, R, C, e, r, c, nan_code);
                    continue;
                }
                double a = amax < eps ? eps : amax;
                if (rule == FM_SCALE_RULE_EXACT) {
                    float af = (float)a, mxf = (float)mx;
                    float m = af == 0.0f ? 1.0f : mxf / af;
                    if (isinf(m))
                        m = FLT_MAX;
                    ((float *)scales)[off] = 1.0f / m;
                    for (int64_t r = r0; r < r1; r++)
                        for (int64_t c = c0; c < c1; c++) {
                            float prod = stored_x(x, rows, cols, s, e, r, c) * m;
                            put_code(s, codes, R, C, e, r, c, (uint8_t)or_encode(f, prod));
                        }
                } else {
                    int p = rule == FM_SCALE_RULE_MX_FLOOR ? or_floor_exp(a, mx) : or_pow2_exp(a, mx);
                    if (e8)
                        ((uint8_t *)scales)[off] = (uint8_t)(p + 127);
                    else
                        ((float *)scales)[off] = (float)ldexp(1.0, p);
                    for (int64_t r = r0; r < r1; r++)
                        for (int64_t c = c0; c < c1; c++) {
                            double v = ldexp((double)stored_x(x, rows, cols, s, e, r, c), -p);
                            put_code(s, codes, R, C, e, r, c, (uint8_t)or_encode(f, v));
                        }
                }
            }
    }
    return bad;
}

void ref_dequantize(const uint8_t *codes, const void *scales, int64_t E, int64_t rows, int64_t cols,
                    const ref_spec *s, fm_dtype out, fm_layout out_layout, void *dst)
{
    int64_t R = ref_stored_rows(s, rows, cols), C = ref_stored_cols(s, rows, cols);
    or_fmt f = or_from_dtype(s->dtype);
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = 0; r < R; r++)
            for (int64_t c = 0; c < C; c++) {
                double code = or_decode(f, ref_get_code(s, codes, E, rows, cols, e, r, c));
                double sc = ref_get_scale(s, scales, rows, cols, e, r, c);
                /* both factors have <= 24 significant bits: the double product is
                 * exact, so one rounding to float is the F32 multiply */
                float v = (float)(code * sc);
                int64_t i = s->layout == FM_LAYOUT_COLWISE ? c : r; /* logical row */
                int64_t j = s->layout == FM_LAYOUT_COLWISE ? r : c; /* logical col */
                int64_t oi = out_layout == FM_LAYOUT_COLWISE ? (e * cols + j) * rows + i : (e * rows + i) * cols + j;
                if (out == FM_DTYPE_F32)
                    ((uint32_t *)dst)[oi] = tu_is_nan(v) ? 0x7FC00000u : tu_f32_bits(v);
                else
                    ((uint16_t *)dst)[oi] = (uint16_t)or_encode(out == FM_DTYPE_BF16 ? OF_BF16 : OF_F16, v);
            }
}

/* ---- misc ---------------------------------------------------------------- */

fm_context *tu_cpu_context(int threads)
{
    fm_context_config cfg = {.backend = FM_BACKEND_CPU, .cpu_threads = threads};
    fm_context *ctx = NULL;
    fm_status st = fm_context_create(&cfg, &ctx);
    if (st != FM_OK || !ctx) {
        fprintf(stderr, "fm_context_create(CPU) failed: %d %s\n", (int)st, fm_last_error(NULL));
        exit(1);
    }
    return ctx;
}

tu_buf tu_buf_new(size_t n)
{
    tu_buf b = {NULL, n, 64};
    /* 64-byte alignment, like any real allocator's large blocks */
    if (posix_memalign((void **)&b.p, 64, n + b.guard) != 0) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(1);
    }
    memset(b.p, 0xEE, n + b.guard);
    return b;
}

void tu_buf_poison(tu_buf *b, uint8_t v)
{
    memset(b->p, v, b->n);
    memset(b->p + b->n, 0xEE, b->guard);
}

int tu_buf_guard_ok(const tu_buf *b)
{
    for (size_t i = 0; i < b->guard; i++)
        if (b->p[b->n + i] != 0xEE)
            return 0;
    return 1;
}

void tu_buf_free(tu_buf *b)
{
    free(b->p);
    b->p = NULL;
}

const char *tu_rule_name(fm_scale_rule r)
{
    static const char *n[] = {"DEFAULT", "POW2", "EXACT", "MX_FLOOR"};
    return (unsigned)r < 4 ? n[r] : "bad-rule";
}

/* ---- test tensors ---------------------------------------------------------- */

const char *tu_data_name(int kind)
{
    static const char *n[] = {"random", "zeros", "subnormal", "maxmag", "wide", "nonfinite", "ties"};
    return (unsigned)kind < TD_COUNT ? n[kind] : "?";
}

void tu_fill(float *x, int64_t n, int64_t cols, int kind)
{
    int row_exp = 0, blk_exp = 0;
    for (int64_t i = 0; i < n; i++) {
        if (cols > 0 && i % cols == 0)
            row_exp = (int)tu_randint(-20, 20);
        if (i % 32 == 0)
            blk_exp = (int)tu_randint(-6, 6);
        uint32_t u = tu_rand32();
        float v;
        switch (kind) {
        case TD_ZEROS: v = (u & 1) ? -0.0f : 0.0f; break;
        case TD_SUBNORMAL:
            if (u % 10 < 6)
                v = tu_bits_f32(tu_rand32() & 0x807FFFFFu);
            else if (u % 10 < 9)
                v = (float)ldexp(tu_normal(), (int)tu_randint(-130, -118));
            else
                v = 0.0f;
            break;
        case TD_MAXMAG:
            switch (u % 6) {
            case 0: v = FLT_MAX; break;
            case 1: v = -FLT_MAX; break;
            case 2: v = nextafterf(FLT_MAX, 0.0f); break;
            case 3: v = (float)ldexp(1.0 + tu_uniform(), (int)tu_randint(118, 127)); break;
            case 4: v = (float)(tu_normal() * 1e-3); break; /* small values beside huge ones */
            default: v = (float)((tu_rand32() & 1 ? -1 : 1) * 448.0 * ldexp(1.0, (int)tu_randint(100, 118))); break;
            }
            break;
        case TD_WIDE:
            do
                v = tu_bits_f32(tu_rand32());
            while (!isfinite(v));
            break;
        case TD_NONFINITE:
            if (u % 200 == 0)
                v = tu_bits_f32(0x7F800001u | (tu_rand32() & 0x803FFFFFu) | 0x00400000u * (u >> 31));
            else if (u % 200 == 1)
                v = INFINITY;
            else if (u % 200 == 2)
                v = -INFINITY;
            else
                v = (float)ldexp(tu_normal(), row_exp);
            break;
        case TD_TIES: v = (float)ldexp((double)tu_randint(-64, 64), blk_exp); break;
        default: {
            double g = tu_normal();
            if (u % 64 == 0)
                g *= 100; /* outlier */
            v = (float)ldexp(g, row_exp);
            break;
        }
        }
        x[i] = v;
    }
}

void tu_store_input(const float *x, int64_t n, fm_dtype d, void *dst, float *rounded)
{
    for (int64_t i = 0; i < n; i++) {
        if (d == FM_DTYPE_F32) {
            ((float *)dst)[i] = x[i];
            rounded[i] = x[i];
        } else {
            or_fmt f = d == FM_DTYPE_BF16 ? OF_BF16 : OF_F16;
            uint16_t c = (uint16_t)or_encode(f, x[i]);
            ((uint16_t *)dst)[i] = c;
            rounded[i] = (float)or_decode(f, c);
        }
    }
}

fm_tensor tu_input(void *data, fm_dtype d, int ndim, int64_t E, int64_t rows, int64_t cols)
{
    return ndim == 3 ? fm_tensor_3d(data, d, E, rows, cols) : fm_tensor_2d(data, d, rows, cols);
}

void tu_qout_init(tu_qout *o, const ref_spec *s, int ndim, int64_t E, int64_t rows, int64_t cols)
{
    o->s = *s;
    o->E = E;
    o->rows = rows;
    o->cols = cols;
    o->data = tu_buf_new((size_t)ref_data_bytes(s, E, rows, cols));
    o->scale = tu_buf_new((size_t)ref_scale_bytes(s, E, rows, cols));
    o->t = tu_input(o->data.p, s->dtype, ndim, E, rows, cols);
    o->t.layout = s->layout;
    o->t.scale_mode = s->mode;
    o->t.scale = o->scale.p;
    o->t.scale_dtype = s->mode == FM_SCALE_MX32 ? FM_DTYPE_E8M0 : FM_DTYPE_F32;
    o->t.scale_layout = s->slayout;
}

void tu_qout_poison(tu_qout *o, uint8_t v)
{
    tu_buf_poison(&o->data, v);
    tu_buf_poison(&o->scale, v);
}

void tu_qout_free(tu_qout *o)
{
    tu_buf_free(&o->data);
    tu_buf_free(&o->scale);
}

int tu_same_bytes(const void *got, const void *want, size_t n, const char *what, const char *ctx)
{
    const uint8_t *g = got, *w = want;
    tu_checks++;
    if (memcmp(g, w, n) == 0)
        return 1;
    size_t i = 0, bad = 0;
    while (g[i] == w[i])
        i++;
    for (size_t k = 0; k < n; k++)
        bad += g[k] != w[k];
    tu_fail(__FILE__, __LINE__, what, "%s: %zu of %zu bytes differ, first at byte %zu: got 0x%02x want 0x%02x", ctx,
            bad, n, i, g[i], w[i]);
    return 0;
}
