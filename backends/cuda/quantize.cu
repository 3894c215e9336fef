/* CUDA quantize: every mode, row-wise and column-wise outputs from one pass
 * over the input, bit-exact with backends/cpu/quantize.c.
 *
 * The work is cut into 128 x 128 tiles of the logical matrix (one CTA of 256
 * threads each). Every block of BLOCK_1x128, BLOCK_128x128 and MX32, in
 * either layout, lies inside one tile, so a tile computes its blocks' amax,
 * scales and codes from registers without another pass. Each thread holds an
 * 8 x 8 sub-tile (8 consecutive rows, 8 consecutive columns): row blocks
 * reduce across lanes with shuffles, column blocks across the thread's 8
 * rows, its partner lane and the other warps through shared memory. The
 * column-wise codes are transposed through a swizzled shared-memory tile so
 * that both outputs leave in full, coalesced segments.
 *
 * TENSOR and ROW blocks span many tiles: a first kernel reduces their amax
 * (atomicMax on the integer bits of |x|, which orders NaN > Inf > finite and
 * is order-independent, hence deterministic), a small kernel turns them into
 * scales and multipliers, then the tile kernel encodes. The same small kernel
 * writes the padding entries of GEMM scale layouts (1.0 / E8M0 127). */
#include <stdint.h>
#include <string.h>

#include "cuda.h"
#include "kernels.cuh"

#define QT 128
#define QTHREADS 256
/* Tile-major scales: a tile's compact 1x128 (F32) or MX32 (E8M0) scales of
 * one output are 128 words, one a stored row of the tile (its 1 or 4 block
 * scales); the row-wise output's at bytes 0-511 of the tile's QTM_TILE, the
 * column-wise output's at 512-1023 (from the workspace's start, so each
 * half is 4 whole L2 lines of 128 bytes: see scatter_discard). */
#define QTM_TILE 1024
/* in the tile kernel's MODE: both outputs store their scales tile-major
 * (qout.tmaj) */
#define QTM_FLAG 0x100
/* in the tile kernel's MODE, with BF16 into E2M1 outputs only: every output
 * takes the POW2 rule, so no value passes 6 and the packed codes leave
 * through fm_e2m1_sums_row / _cols instead of a clamp a pair */
#define QNC_FLAG 0x200
#define QMODE_FLAGS (QTM_FLAG | QNC_FLAG)
/* CTAs per SM the tile kernel's registers are capped for. A BF16 tile stays
 * packed: with both outputs, or with MX32 blocks, it fits 64 registers
 * without spilling, so four CTAs share an SM; the other single-output BF16
 * kernels fit 80 (three CTAs; at 64 they spill a few bytes). F32 and F16
 * tiles need about 108 (two CTAs). */
#define FM_QUANT_MIN_BLOCKS(IN, RE, CE, MODE)                                                         \
    ((IN) != FM_DTYPE_BF16 ? 2 : ((RE) && (CE)) || ((MODE) & ~QMODE_FLAGS) == FM_SCALE_MX32 ? 4 : 3)

typedef struct qout {
    uint8_t *data;
    void *scale;
    int mode, layout, rule, elem;
    int64_t R, C;          /* stored matrix */
    int64_t per;           /* scale entries per expert */
    int64_t code_bytes;    /* data bytes per expert */
    float *gmult;          /* TENSOR / ROW multipliers, [E * nblk] */
    uint32_t *gamax;       /* TENSOR / ROW amax bits, [E * nblk] */
    int64_t nblk;          /* TENSOR: 1, ROW: R */
    int e8;
    int vec;               /* vector stores are aligned */
    uint8_t *tmaj;         /* or NULL: this output's scales go tile-major here first (its half of
                            * QTM_TILE bytes a tile, see qscatter) */
    int gwords;            /* GEMM-layout MX32 scales, 4-byte aligned: a whole tile's row of four
                            * scales is one aligned word (fm_scale_offset) */
} qout;

/* ---- tile-major scales into the compact layout ---------------------------
 * Stored straight from the tile kernel, a tile's compact scales of one output
 * are 128 single-word (or single-byte) stores to 128 lines. Into both outputs
 * of a wide matrix that held row+col quantize [32768, 7168] at 77% of copy
 * against 86% with GEMM-layout scales, whose tile entries are contiguous
 * (Nsight Compute, S13-1: 18.4M L2 write sectors against 15.1M; the stores
 * stall the tile kernel on MIO throttle). So there the tile kernel writes
 * them tile-major (contiguous, QTM_TILE bytes a tile: 340 us, as with GEMM
 * scales, S14-6) and they are moved into place afterwards, in whole lines: an
 * item is the words of 32 tiles along one band of 128 stored rows. Part 0:
 * the row-wise output [R, ntc words], the band a tile row, items ordered by
 * (global tile row, group of 32 tile columns); part 1: the column-wise output
 * [C, ntr words], the band a tile column, items ordered by (group of 32 tile
 * rows of an expert, tile column). A unit is line j (of 4) of an item: 4 x
 * item + j. So the units of a range of groups of 32 tile rows are two
 * contiguous ranges, one a part (see launch_chunks).
 * Tried and slower: each item moved inside the tile kernel by the CTA that
 * completes its last tile (a fence and a count a tile: 84.4% -> 83.1% of
 * copy, S14-7; again in S25-3). */
typedef struct qscatter {
    const uint32_t *tm;
    uint32_t *dst[2];
    uint32_t ntr, ntc; /* tile rows and columns an expert (ntiles < 2^31) */
    uint32_t u0[2], u1[2]; /* the units to move, [u0, u1) of each part */
    int64_t lim[2];    /* stored rows of each output */
    int64_t perw[2];   /* words per expert */
} qscatter;

static __device__ __forceinline__ uint32_t scatter_units(const qscatter &s)
{
    return (s.u1[0] - s.u0[0]) + (s.u1[1] - s.u0[1]);
}

/* Unit i of s's list (part 0's range, then part 1's), moved by 128 threads
 * (tid 0..127): line j of each of up to 32 tiles along a band, i.e. the
 * tile-major words 32 j .. 32 j + 31 of the tiles' part, 32 stored rows of
 * the band times 32 tiles. Lane bb takes tile b0 + bb, warp w its words
 * 8 w .. 8 w + 7 (one 32-byte sector, two 16-byte loads), and stores them
 * into 8 stored rows: each warp-wide store is one row's 32 consecutive words,
 * a whole 128-byte line, and no shared memory is needed. Returns the thread's
 * tile-major line, for the caller to drop from L2 once all 128 threads have
 * read it (scatter_discard), or NULL. The previous form (an item of 32 tiles
 * x 128 rows a CTA of 256, transposed through shared memory) took 14.3 us for
 * [32768, 7168] (Nsight Compute, S29-5: stalled on the loads and on
 * shared-memory stores, 0.22 issues a cycle); this one 10.7-11.6 us (S29-6,
 * S29-7), and a CTA an item with all four lines' loads in flight, or two
 * lines, measured the same (S29-7). 32-bit indices (tile counts are below
 * 2^31): the old form with 64-bit indices took 73 registers and ran at 31% of
 * DRAM bandwidth (S17-1). */
static __device__ __forceinline__ const uint32_t *scatter_unit(const qscatter &s, uint32_t i, uint32_t tid)
{
    const uint32_t w = tid >> 5, bb = tid & 31, n0 = s.u1[0] - s.u0[0];
    const int part = i >= n0;
    const uint32_t kl = part ? s.u0[1] + (i - n0) : s.u0[0] + i, j = kl & 3, k = kl >> 2;
    uint32_t a, e, b0;
    if (part) { /* k = (e * nq + q) * ntc + a, nq groups of 32 tile rows an expert */
        const uint32_t g = k / s.ntc, nq = (s.ntr + 31) / 32;
        a = k - g * s.ntc, e = g / nq, b0 = (g - e * nq) * 32;
    } else { /* k = (e * ntr + a) * nbc + group, nbc groups of 32 tile columns */
        const uint32_t nbc = (s.ntc + 31) / 32, ka = k / nbc;
        b0 = (k - ka * nbc) * 32, e = ka / s.ntr, a = ka - e * s.ntr;
    }
    const uint32_t B = part ? s.ntr : s.ntc;
    if (bb >= B - b0)
        return NULL;
    /* tile b0 + bb along the band: tile0 + bb * tstep tiles on */
    const uint32_t tile0 = part ? (e * s.ntr + b0) * s.ntc + a : (e * s.ntr + a) * s.ntc + b0;
    const uint32_t tstep = part ? s.ntc : 1u;
    const uint32_t *line = s.tm + (size_t)(tile0 + bb * tstep) * (QTM_TILE / 4) + part * 128 + 32 * j;
    /* fields by ternary, not [part]: an indexed kernel parameter goes through a local copy */
    const int64_t lim = part ? s.lim[1] : s.lim[0];
    const int64_t row = (int64_t)a * 128 + 32 * j + 8 * w;
    uint32_t *dst = (part ? s.dst[1] : s.dst[0]) + (int64_t)e * (part ? s.perw[1] : s.perw[0]) + row * B + b0 + bb;
    const uint4 lo = *(const uint4 *)(line + 8 * w), hi = *(const uint4 *)(line + 8 * w + 4);
    const uint32_t v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int u = 0; u < 8; u++)
        if (row + u < lim)
            dst[(int64_t)u * B] = v[u];
    return line;
}

/* Once every thread of the unit has read its words (a barrier after
 * scatter_unit), one warp drops the tiles' lines from L2 unwritten: nothing
 * reads them again, and the FP8 kernels' lines never reached DRAM. */
static __device__ __forceinline__ void scatter_discard(const uint32_t *line)
{
    if (line)
        asm volatile("discard.global.L2 [%0], 128;" ::"l"(line) : "memory");
}

typedef struct qparams {
    const void *in;
    int64_t E, rows, cols, ntr, ntc, ntiles;
    fm_fastdiv ntrd, ntcd; /* ntr, ntc for fm_tile_place (ntiles < 2^31) */
    int vec_in;
    float eps;
    uint32_t *amax;                   /* cfg->amax as bits, or NULL */
    unsigned long long *nonfinite;    /* cfg->nonfinite_blocks, or NULL */
    qout o[2];                        /* [0] row-wise, [1] column-wise */
    int64_t tbeg, tend;               /* the tiles of this launch (a chunk, see launch_chunks) */
    int64_t pfrows;                   /* the tile this many rows below is prefetched into L2, or 0 */
    qscatter sc;                      /* tile-major launches: the previous chunk's units, moved at the end */
} qparams;

/* The thread's 8 x 8 sub-tile: rows w*16 + hr*8 + k, columns cv*8 + j of the
 * tile; a warp's load covers two whole rows of the tile. It is held as
 * 32-bit words t[k][.]: F32 and F16 inputs as the F32 bits of each element
 * (t[k][j]), BF16 still packed, elements 2q and 2q+1 in t[k][q] (low half
 * first), which halves the registers the tile needs; BF16 maxima are then
 * taken two at a time on the 16-bit halves (|x| bits order like |x|, NaN
 * above Inf above every finite value, as for F32). */
template <int IN>
static __device__ __forceinline__ void load_tile(const qparams &p, int64_t e, int64_t r0, int64_t c0, bool vec,
                                                 uint32_t t[8][8])
{
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, hr = l >> 4, cv = l & 15;
    const int64_t rb = r0 + w * 16 + hr * 8, cb = c0 + cv * 8;
    if (vec) {
        if (IN == FM_DTYPE_F32) {
            float4 raw[16];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const float4 *src = (const float4 *)((const float *)p.in + ((e * p.rows + rb + k) * p.cols + cb));
                raw[2 * k] = __ldcs(src);
                raw[2 * k + 1] = __ldcs(src + 1);
            }
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const float4 a = raw[2 * k], b = raw[2 * k + 1];
                t[k][0] = __float_as_uint(a.x); t[k][1] = __float_as_uint(a.y);
                t[k][2] = __float_as_uint(a.z); t[k][3] = __float_as_uint(a.w);
                t[k][4] = __float_as_uint(b.x); t[k][5] = __float_as_uint(b.y);
                t[k][6] = __float_as_uint(b.z); t[k][7] = __float_as_uint(b.w);
            }
        } else {
            uint4 raw[8];
#pragma unroll
            for (int k = 0; k < 8; k++)
                raw[k] = __ldcs((const uint4 *)((const uint16_t *)p.in + ((e * p.rows + rb + k) * p.cols + cb)));
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const uint32_t wd[4] = {raw[k].x, raw[k].y, raw[k].z, raw[k].w};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    if (IN == FM_DTYPE_BF16) {
                        t[k][q] = wd[q];
                    } else {
                        t[k][2 * q] = __float_as_uint(fm_hw_f16_to_f32((uint16_t)(wd[q] & 0xFFFFu)));
                        t[k][2 * q + 1] = __float_as_uint(fm_hw_f16_to_f32((uint16_t)(wd[q] >> 16)));
                    }
                }
            }
        }
        return;
    }
    /* Edge tiles and unaligned shapes: element loads; outside the matrix
     * reads as 0, which no amax notices. */
#pragma unroll
    for (int k = 0; k < 8; k++)
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int64_t rr = rb + k, cc = cb + j;
            uint32_t x = 0;
            if (rr < p.rows && cc < p.cols) {
                int64_t i = (e * p.rows + rr) * p.cols + cc;
                if (IN == FM_DTYPE_F32)
                    x = ((const uint32_t *)p.in)[i];
                else if (IN == FM_DTYPE_BF16)
                    x = ((const uint16_t *)p.in)[i];
                else
                    x = __float_as_uint(fm_hw_f16_to_f32(((const uint16_t *)p.in)[i]));
            }
            if (IN == FM_DTYPE_BF16)
                t[k][j >> 1] = (j & 1) ? t[k][j >> 1] | (x << 16) : x;
            else
                t[k][j] = x;
        }
}

/* Element (k, j) of the sub-tile as F32. */
template <int IN>
static __device__ __forceinline__ float tval(const uint32_t t[8][8], int k, int j)
{
    if (IN == FM_DTYPE_BF16)
        return __uint_as_float((j & 1) ? t[k][j >> 1] & 0xFFFF0000u : t[k][j >> 1] << 16);
    return __uint_as_float(t[k][j]);
}

static __device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b)
{
    uint32_t d;
    asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

/* The F32 bits of max |x| over row k of the sub-tile. D2 (BF16): those
 * bits times 2 (same order), from each word shifted left by one instead of
 * masked: |lo| << 1 in the low half, |hi| << 1 in the high half with lo's
 * sign in its lowest bit, which no maximum's upper 15 bits depend on. The
 * shift can take the FMA pipe, the mask the integer ALU, which the packed
 * E2M1 kernels saturate. */
template <int IN, bool D2 = false>
static __device__ __forceinline__ uint32_t row_absmax(const uint32_t t[8][8], int k)
{
    if (IN == FM_DTYPE_BF16 && D2) {
        const uint32_t m = max_u16x2(max_u16x2(t[k][0] << 1, t[k][1] << 1), max_u16x2(t[k][2] << 1, t[k][3] << 1));
        const uint32_t lo = m << 16, hi = m & 0xFFFE0000u;
        return lo > hi ? lo : hi;
    }
    if (IN == FM_DTYPE_BF16) {
        const uint32_t m = max_u16x2(max_u16x2(t[k][0] & 0x7FFF7FFFu, t[k][1] & 0x7FFF7FFFu),
                                     max_u16x2(t[k][2] & 0x7FFF7FFFu, t[k][3] & 0x7FFF7FFFu));
        const uint32_t lo = m << 16, hi = m & 0xFFFF0000u;
        return lo > hi ? lo : hi;
    }
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const uint32_t a = t[k][j] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

/* The F32 bits of max |x| over column j of the sub-tile (D2: times 2, as in
 * row_absmax). */
template <int IN, bool D2 = false>
static __device__ __forceinline__ uint32_t col_absmax(const uint32_t t[8][8], int j)
{
    if (IN == FM_DTYPE_BF16 && D2) {
        uint32_t m = 0;
#pragma unroll
        for (int k = 0; k < 8; k++)
            m = max_u16x2(m, t[k][j >> 1] << 1);
        return (j & 1) ? m & 0xFFFE0000u : m << 16;
    }
    if (IN == FM_DTYPE_BF16) {
        uint32_t m = 0;
#pragma unroll
        for (int k = 0; k < 8; k++)
            m = max_u16x2(m, t[k][j >> 1] & 0x7FFF7FFFu);
        return (j & 1) ? m & 0xFFFF0000u : m << 16;
    }
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const uint32_t a = t[k][j] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

static __device__ __forceinline__ uint32_t fm_umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

/* Scale entry (r, c) of stored matrix o, in tile t whose stored origin is
 * (r0, c0). KEEP (TM only): the tile-major scales (1: an E8M0 scale; 2, 4:
 * a half word or word of them, or an F32 scale's bits) are stored
 * evict_last, so that the scatter finds them in L2 and, discarding them
 * there, keeps them from DRAM altogether. */
template <bool TM, bool KEEP>
static __device__ __forceinline__ void put_scale(const qout &o, int64_t t, int64_t e, int64_t r, int64_t c,
                                                 int64_t r0, int64_t c0, float s32, uint8_t s8)
{
    if (TM) {
        uint8_t *b = o.tmaj + t * QTM_TILE;
        if (o.e8)
            fm_st_keep<KEEP, 1>(b + (r - r0) * 4 + ((c - c0) >> 5), s8);
        else
            fm_st_keep<KEEP, 4>(b + 4 * (r - r0), __float_as_uint(s32));
        return;
    }
    int64_t off = e * o.per + fm_scale_offset((fm_scale_mode)o.mode, (fm_scale_layout)o.layout, o.R, o.C, r, c);
    if (o.e8)
        ((uint8_t *)o.scale)[off] = s8;
    else
        ((float *)o.scale)[off] = s32;
}

/* The scale rule for an element type known at compile time. FAST: POW2,
 * the default for block scales, by fm_pick_scale_pow2_flat (no branches, a
 * handful of integer instructions), the others by fm_pick_scale. */
template <int ELEM, bool FAST>
static __device__ __forceinline__ float pick_scale(uint32_t m, float eps, int rule, float *s32, uint8_t *s8)
{
    if (FAST && rule == FM_SCALE_RULE_POW2)
        return fm_pick_scale_pow2_flat<ELEM>(m, eps, s32, s8);
    return fm_pick_scale(m, eps, rule, ELEM, s32, s8);
}

static __device__ __forceinline__ void count_bad(const qparams &p, uint32_t abits)
{
    if (abits >= 0x7F800000u && p.nonfinite)
        atomicAdd(p.nonfinite, 1ull);
}

/* A permuted column index for the per-warp column maxima: lanes 0..15 of a
 * store hold columns cv*8 + j for one j, which then fall in 16 banks. */
static __device__ __forceinline__ int pcol(int c) { return (c & 7) * 16 + (c >> 3); }

/* Byte offset in the column-code tile (tsm) of the E2M1 word of tile column
 * c and 8-row unit u: 4-byte units XOR-swizzled by the column's 8-column
 * group and parity, so that both the encode's writes and the store pass's
 * reads avoid bank conflicts. The store pass reads it in a closed form per
 * pass (quant_tile_kernel, "Pass `pass` reads ..."): a change of swizzle
 * changes both (the quantize test's E2M1 column outputs catch a mismatch). */
static __device__ __forceinline__ int tsm_e2m1_off(int c, int u)
{
    return c * 128 + 4 * (((u ^ (c >> 3)) & 15) | (((u ^ c) & 1) << 4));
}

/* The BF16 tile p.pfrows rows below (r0, c0) of expert e into L2, if it is
 * in the matrix: thread tid its row tid / 2, half tid % 2 (see PF in
 * quant_tile_kernel). */
template <bool TM>
static __device__ __forceinline__ void prefetch_tile(const qparams &p, int64_t e, int64_t r0, int64_t c0)
{
    const int tid = threadIdx.x;
    const int64_t pr = r0 + p.pfrows + (tid >> 1);
    if (!p.pfrows || pr >= p.rows)
        return;
    const uint16_t *a = (const uint16_t *)p.in + (e * p.rows + pr) * p.cols + c0 + (tid & 1) * 64;
    if (!TM)
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(a));
    else if ((tid & 1) == 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], 256;" ::"l"(a) : "memory");
}

/* MODE & ~QMODE_FLAGS: 0 reads each output's scaling mode at run time; FM_SCALE_BLOCK_1x128 or
 * FM_SCALE_MX32 promises that every output present has that mode, so the
 * compiler drops the other modes' code and the predicates it keeps live (the
 * BF16 activation paths get these). With QTM_FLAG both outputs store
 * their scales tile-major (qout.tmaj): a kernel of its own, because a
 * run-time choice between the two stores spills the 64-register BF16
 * kernels. */
template <int IN, int RE, int CE, int MODE>
__global__ void __launch_bounds__(QTHREADS, FM_QUANT_MIN_BLOCKS(IN, RE, CE, MODE)) quant_tile_kernel(const qparams p)
{
    __shared__ uint32_t red[8][128];
    __shared__ float cmul[4][128];
    __shared__ uint32_t wred[8];
    /* Column-wise codes of the tile, [tile column][tile row], 128 bytes a
     * column, 8-byte (FP8) or 4-byte (E2M1) units XOR-swizzled by the
     * column so both the scattered writes and the row reads avoid bank
     * conflicts. */
    __shared__ __align__(16) uint8_t tsm[128 * 128];

    const int tid = threadIdx.x, w = tid >> 5, l = tid & 31, hr = l >> 4, cv = l & 15;
    const qout &orow = p.o[0];
    const qout &ocol = p.o[1];
    constexpr int BM = MODE & ~QMODE_FLAGS;
    constexpr bool TM = (MODE & QTM_FLAG) != 0;
    /* The tile-major scales of the FP8 kernels stay in L2 (put_scale):
     * [32768, 7168] row+col 1x128 361.9 -> 356.8 us, MX32 364.1 -> 358.6-360.1
     * (S25-5, H100, against the tree before, twice each). Not for the E2M1
     * kernel that clamps, which runs on issue slots: 339.7 -> 341.6-344.5 us;
     * the one of QNC_FLAG gains: 289.8 -> 286.0 us (S28-7). */
    constexpr bool KEEP = TM && ((RE != FM_DTYPE_E2M1 && CE != FM_DTYPE_E2M1) || (MODE & QNC_FLAG));
    /* BF16 into E2M1 outputs only: encode packed pairs (fm_bf16x2_e2m1). With
     * an FP8 output beside, the F32 path, which keeps those kernels within 64
     * registers (the packed one spilled 8-22 bytes there when tried). */
    constexpr bool PK = IN == FM_DTYPE_BF16 && (RE == FM_DTYPE_E2M1 || !RE) && (CE == FM_DTYPE_E2M1 || !CE);
    /* ... and without the clamp (QNC_FLAG): that kernel runs on the integer
     * ALU pipe (Nsight Compute S28-1: 93% of its cycles), and the codes'
     * extraction two pairs at a time takes about half its instructions a
     * pair */
    constexpr bool NC = PK && (MODE & QNC_FLAG) != 0;
    /* ... and take their block maxima twice over (row_absmax's D2): 299.9
     * -> 293.1 us in one call (S28-9), 285.3 -> 281.5 (S28-10) */
    constexpr bool D2 = NC;
    /* The specialised kernels pick POW2 scales by fm_pick_scale_pow2_flat:
     * with the word stores below, [32768, 7168] row+col MX32 E4M3
     * 352.7-354.1 -> 351.1-351.7 us, E2M1 272.6-273.0 -> 270.1-270.7 (S31-2,
     * S31-6, H100). The runtime-mode and column-only kernels spill 8-16
     * bytes with it (ptxas); the E2M1 kernels spilled 128-388 bytes when
     * fm_pick_scale_pow2_flat stood alone (the rule taken as POW2), without
     * the generic path beside it. */
    constexpr bool FASTPICK = BM != 0 && RE != 0;
    /* MX32 tile-major scales leave as words: a tile row's four row scales
     * gathered by two shuffles, a thread's two column scales as a half word,
     * where single bytes took 512 + 512 stores a tile. Tile-major MX32 means
     * whole tiles (tile_major_ok), so no entry is out of the matrix. */
    constexpr bool TMWORDS = TM && BM == FM_SCALE_MX32;
    /* ... and so do a whole tile's GEMM-layout MX32 scales (qout.gwords),
     * straight into place: [32768, 7168] row+col E4M3 356.0-356.4 ->
     * 351.5-351.9 us, E2M1 282.8-283.3 -> 269.0-269.3 (S31-7, H100). Not in
     * the one-output kernels, which spill 12-24 bytes with it. */
    constexpr bool GWORDS = !TM && BM == FM_SCALE_MX32 && RE && CE;
    /* Each CTA brings a tile some 0.4 waves ahead into L2 (p.pfrows): a
     * tile's loads then wait on L2, not DRAM, and DRAM has reads queued
     * while the CTAs of a wave work on their tiles. [32768, 7168] (S32-5,
     * H100): compact row+col 1x128 351 -> 344 us, MX32 E4M3 352 -> 345,
     * E2M1 270 -> 259.5; GEMM-layout row+col 351 -> 334, E2M1 269 -> 246;
     * MX32 rows E4M3 262 -> 244, E2M1 216 -> 197. Tile-major launches by a
     * bulk prefetch: evict_last there gained nothing (their tile-major
     * scales are kept in L2 with evict_last too); the others with
     * evict_last, 4-10 us ahead of a plain prefetch or a bulk one. The
     * 3-CTA kernels (one 1x128 output) lost with it: 1x128 row 258 ->
     * 267-311 us; the column-only MX32 FP8 kernels spill 8 bytes with it.
     * Issued after the tile's own loads (row+col: compact 1x128 344 us
     * against 351 before them, S32-3, S32-4), or before them in the
     * row-only kernels, which spill 8 bytes after. */
    constexpr bool PF = BM && IN == FM_DTYPE_BF16 && RE && FM_QUANT_MIN_BLOCKS(IN, RE, CE, MODE) == 4;
    const int rmode = BM ? BM : orow.mode, cmode = BM ? BM : ocol.mode;
    const bool need_tmax = p.amax || (RE && rmode == FM_SCALE_BLOCK_128x128) ||
                           (CE && cmode == FM_SCALE_BLOCK_128x128);

    /* What follows a tile-major launch (the next chunk's tile kernel, or the
     * scatter after the last chunk) may start its CTAs once every CTA here has
     * started: its launch then overlaps this grid's last wave. */
    if constexpr (TM)
        fm_pdl_release();
    for (int64_t t = p.tbeg + blockIdx.x; t < p.tend; t += gridDim.x) {
        int64_t e, r0, c0;
        if (BM || IN != FM_DTYPE_BF16) {
            uint32_t eu, tru, tcu;
            fm_tile_place(p.ntcd, p.ntrd, (uint32_t)t, &eu, &tru, &tcu);
            e = eu, r0 = (int64_t)tru * QT, c0 = (int64_t)tcu * QT;
        } else { /* the BF16 kernels of a run-time mode spill 4-8 bytes at 80 registers with it */
            const int64_t tq = t / p.ntc;
            e = tq / p.ntr, r0 = (tq % p.ntr) * QT, c0 = (t % p.ntc) * QT;
        }
        const bool full = r0 + QT <= p.rows && c0 + QT <= p.cols;
        const int64_t rb = r0 + w * 16 + hr * 8, cb = c0 + cv * 8;

        if (PF && !CE && full)
            prefetch_tile<TM>(p, e, r0, c0);
        uint32_t v[8][8];
        load_tile<IN>(p, e, r0, c0, full && p.vec_in, v);
        if (PF && CE && full)
            prefetch_tile<TM>(p, e, r0, c0);

        uint32_t tmax = 0;
        if (need_tmax) {
            uint32_t m = 0;
#pragma unroll
            for (int k = 0; k < 8; k++)
                m = fm_umax(m, row_absmax<IN>(v, k));
#pragma unroll
            for (int s = 16; s; s >>= 1)
                m = fm_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, s));
            if (l == 0)
                wred[w] = m;
            __syncthreads();
#pragma unroll
            for (int i = 0; i < 8; i++)
                tmax = fm_umax(tmax, wred[i]);
            if (p.amax && tid == 0)
                atomicMax(p.amax, tmax > 0x7F800000u ? FM_F32_CANON_NAN : tmax);
        }

        /* ---- row-wise output: stored [rows, cols] ---- */
        if (RE) {
            float mult[8];
            const int mode = rmode;
            if (mode == FM_SCALE_BLOCK_1x128 || mode == FM_SCALE_MX32) {
                uint32_t rm[8];
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    uint32_t m = row_absmax<IN, D2>(v, k);
                    m = fm_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
                    m = fm_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
                    if (mode == FM_SCALE_BLOCK_1x128) {
                        m = fm_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, 4));
                        m = fm_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, 8));
                    }
                    rm[k] = m;
                }
                /* The lanes of a block share its 8 row maxima: each lane picks
                 * the scale of one (1x128) or two (MX32) rows and the others
                 * take the multipliers by shuffle, instead of every lane
                 * running the scale rule 8 times. */
                float s32a, s32b;
                uint8_t s8a, s8b;
                if (mode == FM_SCALE_BLOCK_1x128) {
                    const int ks = cv & 7;
                    uint32_t mine = 0;
#pragma unroll
                    for (int k = 0; k < 8; k++)
                        mine = k == ks ? rm[k] : mine;
                    if (D2)
                        mine >>= 1;
                    const float ma = pick_scale<RE, FASTPICK>(mine, p.eps, orow.rule, &s32a, &s8a);
                    if (cv < 8 && rb + ks < p.rows && c0 < p.cols) {
                        put_scale<TM, KEEP>(orow, t, e, rb + ks, c0, r0, c0, s32a, s8a);
                        count_bad(p, mine);
                    }
#pragma unroll
                    for (int k = 0; k < 8; k++)
                        mult[k] = __shfl_sync(0xFFFFFFFFu, ma, (l & 16) | k);
                } else {
                    const int i2 = (cv & 3) * 2;
                    uint32_t m0 = 0, m1 = 0;
#pragma unroll
                    for (int k = 0; k < 8; k += 2) {
                        m0 = k == i2 ? rm[k] : m0;
                        m1 = k == i2 ? rm[k + 1] : m1;
                    }
                    if (D2) {
                        m0 >>= 1;
                        m1 >>= 1;
                    }
                    const float ma = pick_scale<RE, FASTPICK>(m0, p.eps, orow.rule, &s32a, &s8a);
                    const float mb = pick_scale<RE, FASTPICK>(m1, p.eps, orow.rule, &s32b, &s8b);
                    const int64_t cs = c0 + (cv >> 2) * 32;
                    if (TMWORDS || (GWORDS && full && orow.gwords)) {
                        /* lane b = cv / 4 holds block b of rows i2, i2 + 1: lanes b, b ^ 1
                         * join halves (even b: row i2, blocks b, b + 1; odd b: row i2 + 1,
                         * blocks b - 1, b), then b, b ^ 2 words; lanes b < 2 store row
                         * i2 + b's */
                        const int b = cv >> 2;
                        const uint32_t pr = (uint32_t)s8a | (uint32_t)s8b << 8;
                        const uint32_t hw =
                            __byte_perm(pr, __shfl_xor_sync(0xFFFFFFFFu, pr, 4), (b & 1) ? 0x15u : 0x40u);
                        const uint32_t wd = __byte_perm(hw, __shfl_xor_sync(0xFFFFFFFFu, hw, 8), 0x5410u);
                        const int rt = w * 16 + hr * 8 + i2 + b; /* the row in the tile */
                        if (TMWORDS && b < 2)
                            fm_st_keep<KEEP, 4>(orow.tmaj + t * QTM_TILE + 4 * rt, wd);
                        else if (b < 2) /* row rt's four blocks are one word of the tile's 512 entries */
                            *(uint32_t *)((uint8_t *)orow.scale + e * orow.per +
                                          ((r0 >> 7) * p.ntc + (c0 >> 7)) * 512 + fm_mx32_gemm_entry(rt, 0)) = wd;
                        count_bad(p, m0);
                        count_bad(p, m1);
                    } else if (cs < p.cols) {
                        if (rb + i2 < p.rows) {
                            put_scale<TM, KEEP>(orow, t, e, rb + i2, cs, r0, c0, s32a, s8a);
                            count_bad(p, m0);
                        }
                        if (rb + i2 + 1 < p.rows) {
                            put_scale<TM, KEEP>(orow, t, e, rb + i2 + 1, cs, r0, c0, s32b, s8b);
                            count_bad(p, m1);
                        }
                    }
                    const int g0 = l & ~3;
#pragma unroll
                    for (int k = 0; k < 8; k++)
                        mult[k] = __shfl_sync(0xFFFFFFFFu, (k & 1) ? mb : ma, g0 + (k >> 1));
                }
            } else if (mode == FM_SCALE_BLOCK_128x128) {
                float s32;
                uint8_t s8;
                float m = fm_pick_scale(tmax, p.eps, orow.rule, RE, &s32, &s8);
                if (tid == 0) {
                    put_scale<TM, KEEP>(orow, t, e, r0, c0, r0, c0, s32, s8);
                    count_bad(p, tmax);
                }
#pragma unroll
                for (int k = 0; k < 8; k++)
                    mult[k] = m;
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    int64_t b = mode == FM_SCALE_TENSOR ? e : e * p.rows + (rb + k < p.rows ? rb + k : 0);
                    mult[k] = orow.gmult[b];
                }
            }
            const bool vs = full && orow.vec;
            uint8_t *const dst = orow.data + e * orow.code_bytes;
            /* The fast path's rows from one base a row apart (unsigned: the
             * halving is a shift, cols % 8 == 0 there). The compiler rebuilt
             * each row's 64-bit address from rr, about 20 instructions a row
             * (5 now); the E2M1 row+col kernels lose their spills with it:
             * 280.0 -> 276.5 us (S29-1, H100). */
            const uint64_t rstride = RE == FM_DTYPE_E2M1 ? (uint64_t)p.cols >> 1 : (uint64_t)p.cols;
            const uint64_t off0 = (uint64_t)rb * (uint64_t)p.cols + (uint64_t)cb;
            uint8_t *const rowp = dst + (RE == FM_DTYPE_E2M1 ? off0 >> 1 : off0);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                uint2 code;
                if (PK) {
                    /* E2M1 blocks are MX32: a power-of-two multiplier, and the
                     * BF16 pairs encode packed (fm_bf16x2_e2m1) */
                    const uint32_t mul = fm_e2m1_mul2(mult[k], mult[k]), me = fm_e2m1_mexp(mul);
                    uint32_t c[4];
#pragma unroll
                    for (int q = 0; q < 4; q++)
                        c[q] = NC ? fm_bf16x2_e2m1_mag(v[k][q], mul, me) : fm_bf16x2_e2m1(v[k][q], mul, me);
                    code.x = NC ? fm_e2m1_sums_row(c, v[k]) : fm_e2m1_pairs_row(c);
                    code.y = 0;
                } else {
                    float y[8];
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        y[j] = tval<IN>(v, k, j) * mult[k];
                    code = fm_encode8<RE>(y);
                }
                if (mult[k] != mult[k])
                    code.x = code.y = fm_nan_word<RE>();
                const int64_t rr = rb + k;
                if (vs) {
                    if (RE == FM_DTYPE_E2M1)
                        __stcs((unsigned int *)(rowp + k * rstride), code.x);
                    else
                        __stcs((uint2 *)(rowp + k * rstride), code);
                } else if (rr < p.rows) {
                    if (RE == FM_DTYPE_E2M1) {
#pragma unroll
                        for (int j = 0; j < 8; j += 2)
                            if (cb + j < p.cols)
                                dst[(rr * p.cols + cb + j) / 2] = (uint8_t)(code.x >> (4 * j));
                    } else {
#pragma unroll
                        for (int j = 0; j < 8; j++)
                            if (cb + j < p.cols)
                                dst[rr * p.cols + cb + j] = (uint8_t)((j < 4 ? code.x : code.y) >> (8 * (j & 3)));
                    }
                }
            }
        }

        /* ---- column-wise output: stored [cols, rows], blocks along rows ---- */
        if (CE) {
            float cm[8];
            const int mode = cmode;
            if (mode == FM_SCALE_BLOCK_1x128 || mode == FM_SCALE_MX32) {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    uint32_t m = col_absmax<IN, D2>(v, j);
                    m = fm_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, 16));
                    /* The packed E2M1 kernels store from both half-warps
                     * (the same word): no predicated region, in each of
                     * which they rebuilt the address (S28-4). The others
                     * keep the predicate, which they need to stay spill-free
                     * (the E2M1 ones spilled 4-16 bytes with it in S28). */
                    if (PK || hr == 0)
                        red[w][j * 16 + cv] = m;
                }
                __syncthreads();
                if (mode == FM_SCALE_BLOCK_1x128) {
                    if (tid < 128) {
                        const int c = tid, pc = pcol(c);
                        uint32_t m = 0;
#pragma unroll
                        for (int i = 0; i < 8; i++)
                            m = fm_umax(m, red[i][pc]);
                        if (D2)
                            m >>= 1;
                        float s32;
                        uint8_t s8;
                        cmul[0][pc] = pick_scale<CE, FASTPICK>(m, p.eps, ocol.rule, &s32, &s8);
                        if (c0 + c < p.cols) {
                            put_scale<TM, KEEP>(ocol, t, e, c0 + c, r0, c0, r0, s32, s8);
                            count_bad(p, m);
                        }
                    }
                } else {
                    const bool cw = TMWORDS || (GWORDS && full && ocol.gwords);
                    uint32_t cpair = 0; /* cw: blocks 2 s, 2 s + 1 of column c, s = tid / 128 */
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int idx = tid + h * QTHREADS, q = cw ? 2 * (tid >> 7) + h : idx >> 7, c = idx & 127,
                                  pc = pcol(c);
                        uint32_t m = fm_umax(red[2 * q][pc], red[2 * q + 1][pc]);
                        if (D2)
                            m >>= 1;
                        float s32;
                        uint8_t s8;
                        cmul[q][pc] = pick_scale<CE, FASTPICK>(m, p.eps, ocol.rule, &s32, &s8);
                        if (cw) {
                            cpair |= (uint32_t)s8 << (8 * h);
                            count_bad(p, m);
                        } else if (c0 + c < p.cols && r0 + 32 * q < p.rows) {
                            put_scale<TM, KEEP>(ocol, t, e, c0 + c, r0 + 32 * q, c0, r0, s32, s8);
                            count_bad(p, m);
                        }
                    }
                    if (TMWORDS)
                        fm_st_keep<KEEP, 2>(ocol.tmaj + t * QTM_TILE + 4 * (tid & 127) + 2 * (tid >> 7), cpair);
                    else if (cw) /* stored row c0 + c of the column-wise output, c = tid % 128 */
                        *(uint16_t *)((uint8_t *)ocol.scale + e * ocol.per + ((c0 >> 7) * p.ntr + (r0 >> 7)) * 512 +
                                      fm_mx32_gemm_entry(tid & 127, 2 * (tid >> 7))) = (uint16_t)cpair;
                }
                __syncthreads();
                const int q = mode == FM_SCALE_BLOCK_1x128 ? 0 : w >> 1;
#pragma unroll
                for (int j = 0; j < 8; j++)
                    cm[j] = cmul[q][j * 16 + cv];
            } else if (mode == FM_SCALE_BLOCK_128x128) {
                float s32;
                uint8_t s8;
                float m = fm_pick_scale(tmax, p.eps, ocol.rule, CE, &s32, &s8);
                if (tid == 0) {
                    put_scale<TM, KEEP>(ocol, t, e, c0, r0, c0, r0, s32, s8);
                    count_bad(p, tmax);
                }
#pragma unroll
                for (int j = 0; j < 8; j++)
                    cm[j] = m;
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    int64_t b = mode == FM_SCALE_TENSOR ? e : e * p.cols + (cb + j < p.cols ? cb + j : 0);
                    cm[j] = ocol.gmult[b];
                }
            }

            const int u = w * 2 + hr; /* this thread's 8-row unit of the tile column */
            if (PK) {
                /* packed as in the row-wise output; a word holds columns 2q, 2q + 1 */
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const uint32_t mul = fm_e2m1_mul2(cm[2 * q], cm[2 * q + 1]), me = fm_e2m1_mexp(mul);
                    uint32_t c8[8], x8[8], code[2];
#pragma unroll
                    for (int k = 0; k < 8; k++) {
                        x8[k] = v[k][q];
                        c8[k] = NC ? fm_bf16x2_e2m1_mag(x8[k], mul, me) : fm_bf16x2_e2m1(x8[k], mul, me);
                    }
                    if (NC)
                        fm_e2m1_sums_cols(c8, x8, &code[0], &code[1]);
                    else
                        fm_e2m1_pairs_cols(c8, &code[0], &code[1]);
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int j = 2 * q + h;
                        *(uint32_t *)(tsm + tsm_e2m1_off(cv * 8 + j, u)) = cm[j] != cm[j] ? fm_nan_word<CE>() : code[h];
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    float y[8];
#pragma unroll
                    for (int k = 0; k < 8; k++)
                        y[k] = tval<IN>(v, k, j) * cm[j];
                    uint2 code = fm_encode8<CE>(y);
                    if (cm[j] != cm[j])
                        code.x = code.y = fm_nan_word<CE>();
                    const int c = cv * 8 + j, f = (c >> 3) & 15;
                    if (CE == FM_DTYPE_E2M1)
                        *(uint32_t *)(tsm + tsm_e2m1_off(c, u)) = code.x;
                    else
                        *(uint2 *)(tsm + c * 128 + 8 * ((u ^ f) & 15)) = code;
                }
            }
            __syncthreads();

            const bool vs = full && ocol.vec;
            uint8_t *dst = ocol.data + e * ocol.code_bytes;
            if (CE == FM_DTYPE_E2M1) {
                /* Pass `pass` reads tile column c = tid / 16 + 16 pass, unit
                 * uu = tid % 16: tsm_e2m1_off(c, uu) is a base plus 2048 pass
                 * plus 4 (ub ^ 2 pass), since c / 8 = tid / 128 + 2 pass and
                 * (uu ^ c) & 1 stays; the compiler rebuilt it from c and uu in
                 * every pass (S28-4: 11 instructions a pass). */
                const int cq = tid >> 4, uu = tid & 15, ub = uu ^ (tid >> 7);
                const int tb = cq * 128 + (((uu ^ cq) & 1) << 6);
                if (vs) {
                    /* a pass moves 16 stored rows on (rows % 8 == 0) */
                    uint8_t *const cbase = dst + ((c0 + cq) * p.rows + r0 + 8 * uu) / 2;
#pragma unroll
                    for (int pass = 0; pass < 8; pass++)
                        __stcs((unsigned int *)(cbase + pass * 8 * p.rows),
                               *(const uint32_t *)(tsm + tb + pass * 2048 + 4 * (ub ^ (2 * pass))));
                } else {
#pragma unroll
                    for (int pass = 0; pass < 8; pass++) {
                        const uint32_t word = *(const uint32_t *)(tsm + tb + pass * 2048 + 4 * (ub ^ (2 * pass)));
                        const int64_t sr = c0 + cq + 16 * pass, sc = r0 + 8 * uu; /* stored row, first column */
                        if (sr < p.cols) {
#pragma unroll
                            for (int b = 0; b < 4; b++)
                                if (sc + 2 * b < p.rows)
                                    dst[(sr * p.rows + sc) / 2 + b] = (uint8_t)(word >> (8 * b));
                        }
                    }
                }
            } else {
                /* vs: a pass moves 32 stored rows on */
                uint8_t *const cbase = dst + (c0 + (tid >> 3)) * p.rows + r0 + 16 * (tid & 7);
#pragma unroll
                for (int pass = 0; pass < 4; pass++) {
                    const int idx = tid + pass * QTHREADS, c = idx >> 3, qq = idx & 7, f = (c >> 3) & 15;
                    const int pu = (2 * qq) ^ f;
                    uint4 val = *(const uint4 *)(tsm + c * 128 + 8 * (pu & ~1));
                    if (pu & 1) {
                        uint32_t tx = val.x, ty = val.y;
                        val.x = val.z;
                        val.y = val.w;
                        val.z = tx;
                        val.w = ty;
                    }
                    const int64_t sr = c0 + c, sc = r0 + 16 * qq;
                    if (vs) {
                        __stcs((uint4 *)(cbase + pass * 32 * p.rows), val);
                    } else if (sr < p.cols) {
                        uint32_t wd[4] = {val.x, val.y, val.z, val.w};
#pragma unroll
                        for (int b = 0; b < 16; b++)
                            if (sc + b < p.rows)
                                dst[sr * p.rows + sc + b] = (uint8_t)(wd[b >> 2] >> (8 * (b & 3)));
                    }
                }
            }
        }
        __syncthreads(); /* red, cmul, wred and tsm are reused by the next tile */
    }
    /* The previous chunk's scales into place, two units a CTA (one a half), by
     * the first CTAs once their own tile is done: by then that chunk, whose
     * last CTAs started before these, has finished or nearly (the wait). */
    if constexpr (TM) {
        const uint32_t n = scatter_units(p.sc);
        if (2 * blockIdx.x < n)
            fm_pdl_wait();
        for (uint32_t base = 2 * blockIdx.x; base < n; base += 2 * gridDim.x) {
            const uint32_t i = base + (tid >> 7);
            const uint32_t *line = i < n ? scatter_unit(p.sc, i, tid & 127) : NULL;
            __syncthreads();
            if ((tid & 127) < 32)
                scatter_discard(line);
        }
    }
}

/* ---- TENSOR / ROW: amax over many tiles ---------------------------------- */

typedef struct ppparams {
    const void *in;
    int64_t E, rows, cols, ntr, ntc, ntiles;
    fm_fastdiv ntrd, ntcd;
    int vec_in;
    uint32_t *tmax[2];   /* per expert, for a TENSOR output (row-wise, column-wise) */
    uint32_t *rmax;      /* per logical row, for a row-wise ROW output */
    uint32_t *cmax;      /* per logical column, for a column-wise ROW output */
} ppparams;

template <int IN>
__global__ void __launch_bounds__(QTHREADS, 2) quant_amax_kernel(const ppparams pp)
{
    __shared__ uint32_t red[8][128];
    __shared__ uint32_t wred[8];
    const int tid = threadIdx.x, w = tid >> 5, l = tid & 31, hr = l >> 4, cv = l & 15;
    qparams p;
    p.in = pp.in;
    p.E = pp.E;
    p.rows = pp.rows;
    p.cols = pp.cols;
    for (int64_t t = blockIdx.x; t < pp.ntiles; t += gridDim.x) {
        uint32_t eu, tru, tcu;
        fm_tile_place(pp.ntcd, pp.ntrd, (uint32_t)t, &eu, &tru, &tcu);
        const int64_t tc = tcu, tr = tru, e = eu;
        const int64_t r0 = tr * QT, c0 = tc * QT;
        const bool full = r0 + QT <= pp.rows && c0 + QT <= pp.cols;
        const int64_t rb = r0 + w * 16 + hr * 8;
        uint32_t v[8][8];
        load_tile<IN>(p, e, r0, c0, full && pp.vec_in, v);
        if (pp.tmax[0] || pp.tmax[1]) {
            uint32_t m = 0;
#pragma unroll
            for (int k = 0; k < 8; k++)
                m = fm_umax(m, row_absmax<IN>(v, k));
#pragma unroll
            for (int s = 16; s; s >>= 1)
                m = fm_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, s));
            if (l == 0)
                wred[w] = m;
            __syncthreads();
            if (tid == 0) {
                for (int i = 1; i < 8; i++)
                    m = fm_umax(m, wred[i]);
                if (pp.tmax[0])
                    atomicMax(pp.tmax[0] + e, m);
                if (pp.tmax[1])
                    atomicMax(pp.tmax[1] + e, m);
            }
        }
        if (pp.rmax) {
#pragma unroll
            for (int k = 0; k < 8; k++) {
                uint32_t m = row_absmax<IN>(v, k);
#pragma unroll
                for (int s = 1; s < 16; s <<= 1)
                    m = fm_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, s));
                if (cv == 0 && rb + k < pp.rows)
                    atomicMax(pp.rmax + e * pp.rows + rb + k, m);
            }
        }
        if (pp.cmax) {
#pragma unroll
            for (int j = 0; j < 8; j++) {
                uint32_t m = col_absmax<IN>(v, j);
                m = fm_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, 16));
                if (hr == 0)
                    red[w][j * 16 + cv] = m;
            }
            __syncthreads();
            if (tid < 128 && c0 + tid < pp.cols) {
                uint32_t m = 0;
                for (int i = 0; i < 8; i++)
                    m = fm_umax(m, red[i][pcol(tid)]);
                atomicMax(pp.cmax + e * pp.cols + c0 + tid, m);
            }
        }
        __syncthreads();
    }
}

/* ---- TENSOR / ROW scales, and GEMM-layout padding ------------------------ */

typedef struct auxparams {
    int64_t E;
    float eps;
    unsigned long long *nonfinite;
    int64_t n[2];       /* work items of each output */
    int kind[2];        /* 0 none, 1 TENSOR/ROW scales, 2 GEMM padding */
    qout o[2];
} auxparams;

__global__ void quant_aux_kernel(const auxparams a)
{
    const int64_t total = a.n[0] + a.n[1];
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int which = i < a.n[0] ? 0 : 1;
        const int64_t k = which ? i - a.n[0] : i;
        const qout &o = a.o[which];
        if (a.kind[which] == 1) {
            const int64_t e = k / o.nblk, b = k % o.nblk;
            const uint32_t m = o.gamax[k];
            float s32;
            uint8_t s8;
            o.gmult[k] = fm_pick_scale(m, a.eps, o.rule, o.elem, &s32, &s8);
            ((float *)o.scale)[e * o.per + b] = s32;
            if (m >= 0x7F800000u && a.nonfinite)
                atomicAdd(a.nonfinite, 1ull);
        } else {
            const int64_t e = k / o.per, kk = k % o.per;
            int64_t r, c;
            if (!fm_scale_entry((fm_scale_mode)o.mode, (fm_scale_layout)o.layout, o.R, o.C, kk, &r, &c)) {
                if (o.e8)
                    ((uint8_t *)o.scale)[e * o.per + kk] = 127;
                else
                    ((float *)o.scale)[e * o.per + kk] = 1.0f;
            }
        }
    }
}

/* The last chunk's units, after it (a PDL launch), a CTA of 128 a unit. */
__global__ void __launch_bounds__(128, 16) quant_scale_scatter_kernel(const qscatter s)
{
    fm_pdl_wait(); /* the tile kernel's scales */
    const uint32_t n = scatter_units(s);
    for (uint32_t i = blockIdx.x; i < n; i += gridDim.x) {
        const uint32_t *line = scatter_unit(s, i, threadIdx.x);
        __syncthreads();
        if (threadIdx.x < 32)
            scatter_discard(line);
    }
}

/* ---- host side ------------------------------------------------------------ */

template <int IN, int MODE>
static cudaError_t launch_tile(const qparams &p, int re, int ce, unsigned grid, cudaStream_t st, int pdl = 0)
{
#define FM_Q_CASE(R_, C_)                                                                        \
    if constexpr (!((MODE & QTM_FLAG) && ((R_) == 0 || (C_) == 0))) /* QTM_FLAG: both outputs */ \
        if (re == R_ && ce == C_)                                                                \
            return fm_launch(quant_tile_kernel<IN, R_, C_, MODE>, grid, QTHREADS, 0, st, pdl, p);
#define FM_Q_ROW(R_)                                                               \
    FM_Q_CASE(R_, 0) FM_Q_CASE(R_, FM_DTYPE_E4M3) FM_Q_CASE(R_, FM_DTYPE_E5M2)
    if constexpr ((MODE & QNC_FLAG) != 0) { /* BF16 into E2M1 outputs only */
        FM_Q_CASE(0, FM_DTYPE_E2M1) FM_Q_CASE(FM_DTYPE_E2M1, 0) FM_Q_CASE(FM_DTYPE_E2M1, FM_DTYPE_E2M1)
        return cudaSuccess;
    }
    FM_Q_CASE(0, FM_DTYPE_E4M3) FM_Q_CASE(0, FM_DTYPE_E5M2)
    FM_Q_ROW(FM_DTYPE_E4M3) FM_Q_ROW(FM_DTYPE_E5M2)
    if constexpr ((MODE & ~QTM_FLAG) != FM_SCALE_BLOCK_1x128) { /* E2M1 exists with MX32 only: no 1x128 kernels */
        FM_Q_CASE(0, FM_DTYPE_E2M1) FM_Q_CASE(FM_DTYPE_E2M1, 0) FM_Q_CASE(FM_DTYPE_E2M1, FM_DTYPE_E2M1)
        FM_Q_CASE(FM_DTYPE_E4M3, FM_DTYPE_E2M1) FM_Q_CASE(FM_DTYPE_E5M2, FM_DTYPE_E2M1)
        FM_Q_CASE(FM_DTYPE_E2M1, FM_DTYPE_E4M3) FM_Q_CASE(FM_DTYPE_E2M1, FM_DTYPE_E5M2)
    }
#undef FM_Q_ROW
#undef FM_Q_CASE
    return cudaSuccess;
}

/* The scaling mode every present output shares, when it is one the tile
 * kernel is specialised for; else 0. */
static int shared_block_mode(const fm_tensor *a, const fm_tensor *b)
{
    const fm_tensor *t = a ? a : b;
    if (!t || (a && b && a->scale_mode != b->scale_mode))
        return 0;
    return t->scale_mode == FM_SCALE_BLOCK_1x128 || t->scale_mode == FM_SCALE_MX32 ? t->scale_mode : 0;
}

static void setup_out(qout *o, const fm_tensor *t, const fm_quant_config *cfg, int colwise, int64_t rows,
                      int64_t cols)
{
    memset(o, 0, sizeof *o);
    if (!t)
        return;
    o->data = (uint8_t *)t->data;
    o->scale = t->scale;
    o->mode = t->scale_mode;
    o->layout = t->scale_layout;
    o->rule = fm_effective_rule(cfg->rule, t->scale_mode);
    o->elem = t->dtype;
    o->R = colwise ? cols : rows;
    o->C = colwise ? rows : cols;
    o->per = fm_scale_count_2d(t->scale_mode, t->scale_layout, o->R, o->C);
    o->code_bytes = t->dtype == FM_DTYPE_E2M1 ? o->R * o->C / 2 : o->R * o->C;
    o->e8 = t->scale_dtype == FM_DTYPE_E8M0;
    o->gwords = t->scale_mode == FM_SCALE_MX32 && t->scale_layout == FM_SCALE_LAYOUT_GEMM && o->e8 &&
                (uintptr_t)t->scale % 4 == 0;
    o->nblk = t->scale_mode == FM_SCALE_TENSOR ? 1 : o->R;
    uintptr_t a = (uintptr_t)t->data;
    if (!colwise)
        o->vec = cols % 8 == 0 && a % (t->dtype == FM_DTYPE_E2M1 ? 4 : 8) == 0;
    else
        o->vec = t->dtype == FM_DTYPE_E2M1 ? rows % 8 == 0 && a % 4 == 0 : rows % 16 == 0 && a % 16 == 0;
}

static int is_global_mode(const fm_tensor *t)
{
    return t && (t->scale_mode == FM_SCALE_TENSOR || t->scale_mode == FM_SCALE_ROW);
}

/* Whether output t's GEMM-layout scale array holds padding entries (more
 * entries than blocks), which the aux kernel fills; without any it is not
 * launched (it visits every entry: [32768, 7168] 1x128 row+col has none). */
static int has_gemm_padding(const fm_tensor *t, const qout *o)
{
    return t && t->scale_layout == FM_SCALE_LAYOUT_GEMM &&
           (t->scale_mode == FM_SCALE_BLOCK_1x128 || t->scale_mode == FM_SCALE_BLOCK_128x128 ||
            t->scale_mode == FM_SCALE_MX32) &&
           fm_scale_padding_2d(t->scale_mode, t->scale_layout, o->R, o->C) > 0;
}

/* Whether output t's scales can go tile-major (qscatter, launch_chunks):
 * compact 1x128 with F32 scales, or compact MX32 with E8M0 scales whose
 * stored rows hold whole 4-byte words of them (the block dimension a
 * multiple of 128). */
static int tile_major_ok(const fm_tensor *t, const qout *o, int colwise, int64_t rows, int64_t cols)
{
    if (!t || t->scale_layout != FM_SCALE_LAYOUT_COMPACT || (uintptr_t)t->scale % 4)
        return 0;
    if (t->scale_mode == FM_SCALE_BLOCK_1x128)
        return !o->e8;
    if (t->scale_mode == FM_SCALE_MX32)
        return o->e8 && (colwise ? rows : cols) % 128 == 0;
    return 0;
}

static unsigned grid_for(int64_t items, int64_t cap)
{
    int64_t g = items < cap ? items : cap;
    return (unsigned)(g > 0 ? g : 1);
}

/* Tile-major launches (BF16 into both outputs, compact scales), in chunks of
 * whole groups of 32 tile rows, each its own launch of the tile kernel: the
 * first CTAs of chunk c also move chunk c - 1's scales into place once their
 * tile is done, and a scatter kernel after the last chunk moves the last
 * chunk's. A lone scatter after the whole matrix took 11 us for [32768, 7168]
 * (S29-6), all of it on top of the tile kernel's time, because the tile
 * kernel holds every SM's registers to its end; under the next chunk's tiles
 * its DRAM writes share the stream's bandwidth.
 *
 * QTM_CHUNKS: two halves measured best, in six calls (S30-2 to S30-7, H100,
 * [32768, 7168] row+col against one launch and its scatter: 1x128
 * 354.0-354.6 -> 350.8-351.4 us, MX32 E4M3 355.6-356.9 -> 352.6-354.5,
 * E2M1 273.9-274.5 -> 272.8-273.6).
 * Each further chunk boundary costs more than its smaller exposed scatter
 * saves: four chunks 352.2-352.4 / 354.0-354.5 / 276.0 us, eight 352.5 /
 * 354.8 / 282.0. Not kept either: the units moved by a chunk's last CTAs
 * rather than its first (354 us: they then sit in the op's tail), spread
 * over the chunk (351.6 / 353.5 / 273.5), a small last chunk (one group of
 * eight: 352.8 / 354.7 / 273.5), and chunks of one wave of persistent CTAs
 * (tiles assigned by grid stride: 360-371 us; the dynamic order matters).
 *
 * Chunk c > 0 is a PDL launch that reads nothing of chunk c - 1 before its
 * wait, and writes before it only what chunk c - 1 neither reads nor writes
 * (its own tiles' codes and tile-major scales), so it needs no wait for those
 * (kernels.cuh's rule exists for a kernel's first write to data the one
 * before touches). Its CTA 0 always waits (every chunk has units), so chunk c
 * cannot finish before chunk c - 1: the scatter's wait on the last chunk then
 * covers them all, and so does whatever the stream runs next. Chunk 0 is a
 * plain launch, after all earlier work; each later chunk starts only once
 * every CTA of the one before has started. wave: the tile CTAs the GPU
 * holds at once; a chunk keeps to one wave at least. */
#define QTM_CHUNKS 2
/* kind: 0 1x128, 1 MX32, 2 MX32 into E2M1 outputs under POW2 (QNC_FLAG) */
static cudaError_t launch_chunks(qparams &p, int re, int ce, int kind, int64_t wave, cudaStream_t st)
{
    const int64_t ntr = p.ntr, ntc = p.ntc, nq = fm_cdiv(ntr, 32), ng = p.E * nq, nbc = fm_cdiv(ntc, 32);
    /* never more chunks than groups (an empty chunk would be a launch of no
     * CTAs), nor chunks of less than a wave */
    int64_t nch = p.ntiles / wave;
    nch = nch > QTM_CHUNKS ? QTM_CHUNKS : nch;
    nch = nch > ng ? ng : nch < 1 ? 1 : nch;
    qscatter q;
    memset(&q, 0, sizeof q);
    q.tm = (const uint32_t *)p.o[0].tmaj;
    q.ntr = (uint32_t)ntr;
    q.ntc = (uint32_t)ntc;
    for (int k = 0; k < 2; k++) {
        q.dst[k] = (uint32_t *)p.o[k].scale;
        q.lim[k] = p.o[k].R;
        q.perw[k] = p.o[k].e8 ? p.o[k].per / 4 : p.o[k].per;
    }
    /* group g's first tile row, over all experts; the units (4 an item, see
     * qscatter) fit 32 bits: 4 x ntiles x QTM_TILE bytes of workspace < 2^42 */
#define FM_GROUP_ROW(g) ((g) / nq * ntr + ((g) % nq * 32 < ntr ? (g) % nq * 32 : ntr))
    for (int64_t c = 0; c < nch; c++) {
        const int64_t g0 = ng * c / nch, g1 = ng * (c + 1) / nch, r0 = FM_GROUP_ROW(g0), r1 = FM_GROUP_ROW(g1);
        p.tbeg = r0 * ntc;
        p.tend = r1 * ntc;
        p.sc = q; /* chunk c - 1's units (none for chunk 0) */
        const unsigned grid = (unsigned)(p.tend - p.tbeg);
        const int pdl = c > 0;
        cudaError_t err;
        if (kind == 0)
            err = launch_tile<FM_DTYPE_BF16, FM_SCALE_BLOCK_1x128 | QTM_FLAG>(p, re, ce, grid, st, pdl);
        else if (kind == 2)
            err = launch_tile<FM_DTYPE_BF16, FM_SCALE_MX32 | QTM_FLAG | QNC_FLAG>(p, re, ce, grid, st, pdl);
        else
            err = launch_tile<FM_DTYPE_BF16, FM_SCALE_MX32 | QTM_FLAG>(p, re, ce, grid, st, pdl);
        if (err != cudaSuccess)
            return err;
        q.u0[0] = (uint32_t)(4 * r0 * nbc);
        q.u1[0] = (uint32_t)(4 * r1 * nbc);
        q.u0[1] = (uint32_t)(4 * g0 * ntc);
        q.u1[1] = (uint32_t)(4 * g1 * ntc);
    }
#undef FM_GROUP_ROW
    const int64_t units = (int64_t)(q.u1[0] - q.u0[0]) + (q.u1[1] - q.u0[1]);
    return fm_launch(quant_scale_scatter_kernel, grid_for(units, 1 << 30), 128, 0, st, 1, q);
}

extern "C" fm_status fm_cuda_quantize(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *in,
                                      fm_tensor *out_row, fm_tensor *out_col)
{
    fm_cuda_device_guard guard;
    fm_status st = fm_cuda_enter(ctx, &guard, "fm_quantize");
    if (st)
        return st;
    cudaStream_t s = fm_cuda_stream(ctx);
    const int64_t E = fm_tensor_experts(in), rows = fm_tensor_stored_rows(in), cols = fm_tensor_stored_cols(in);
    const int64_t numel = E * rows * cols;

    qparams p;
    memset(&p, 0, sizeof p);
    p.in = in->data;
    p.E = E;
    p.rows = rows;
    p.cols = cols;
    p.ntr = fm_cdiv(rows, QT);
    p.ntc = fm_cdiv(cols, QT);
    p.ntiles = numel ? E * p.ntr * p.ntc : 0;
    if (p.ntiles >= ((int64_t)1 << 31)) {
        fm_cuda_leave(ctx, &guard, cudaSuccess, NULL);
        return fm_error(ctx, FM_ERR_UNSUPPORTED,
                        "fm_quantize: %lld tiles of 128 x 128 exceed the kernel's 31-bit tile index",
                        (long long)p.ntiles);
    }
    if (p.ntiles) {
        p.ntrd = fm_fastdiv_make((uint32_t)p.ntr);
        p.ntcd = fm_fastdiv_make((uint32_t)p.ntc);
    }
    p.vec_in = cols % 8 == 0 && (uintptr_t)in->data % 16 == 0;
    p.eps = cfg->epsilon;
    p.amax = (uint32_t *)cfg->amax;
    p.nonfinite = (unsigned long long *)cfg->nonfinite_blocks;
    setup_out(&p.o[0], out_row, cfg, 0, rows, cols);
    setup_out(&p.o[1], out_col, cfg, 1, rows, cols);

    cudaError_t err = cudaSuccess;
    if (cfg->amax && (err = cudaMemsetAsync(cfg->amax, 0, sizeof(float), s)) != cudaSuccess)
        return fm_cuda_leave(ctx, &guard, err, "fm_quantize: cudaMemsetAsync(cfg->amax)");
    if (cfg->nonfinite_blocks && (err = cudaMemsetAsync(cfg->nonfinite_blocks, 0, sizeof(int64_t), s)) != cudaSuccess)
        return fm_cuda_leave(ctx, &guard, err, "fm_quantize: cudaMemsetAsync(cfg->nonfinite_blocks)");

    /* TENSOR / ROW: amax bits and multipliers in scratch, [E * nblk] each. */
    const fm_tensor *outs[2] = {out_row, out_col};
    int64_t nglob[2] = {0, 0}, scratch = 0;
    for (int k = 0; k < 2; k++)
        if (is_global_mode(outs[k])) {
            nglob[k] = E * p.o[k].nblk;
            scratch += fm_round_up(nglob[k], 64) * 8;
        }
    /* Tile-major scales, after it (qscatter, launch_chunks): BF16 into
     * both outputs, 32 and more tiles wide, more tiles than one wave of the
     * tile kernel, and the workspace holds them (no allocation for this).
     * Measured (S14-1, S14-2): [32768, 7168] row+col 77% -> 84% of copy
     * (the column-wise output alone tile-major: 80%); one output alone gains
     * nothing and pays the scatter (1x128 row 91.7% -> 89.2%), and neither
     * does a narrow matrix, whose scale lines L2 merges anyway ([8 x 4096,
     * 2048] row+col 87.6% -> 80.6%). */
    int tmaj = 0;
    const int64_t glob_bytes = scratch;
    const fm_cuda_state *cs = fm_cuda(ctx);
    const int hint = shared_block_mode(out_row, out_col);
    if (in->dtype == FM_DTYPE_BF16 && hint && p.ntc >= 32 && p.ntiles > (int64_t)cs->prop.multiProcessorCount * 4 &&
        (size_t)(scratch + p.ntiles * QTM_TILE) <= cs->workspace_bytes &&
        tile_major_ok(out_row, &p.o[0], 0, rows, cols) && tile_major_ok(out_col, &p.o[1], 1, rows, cols)) {
        tmaj = 1;
        scratch += p.ntiles * QTM_TILE;
    }
    void *buf = NULL;
    int owned = 0;
    if (scratch) {
        st = fm_cuda_scratch(ctx, (size_t)scratch, &buf, &owned, "fm_quantize");
        if (st) {
            fm_cuda_leave(ctx, &guard, cudaSuccess, NULL);
            return st;
        }
        if (tmaj) {
            p.o[0].tmaj = (uint8_t *)buf + glob_bytes;
            p.o[1].tmaj = p.o[0].tmaj + QTM_TILE / 2;
        }
    }
    if (glob_bytes) {
        uint8_t *b = (uint8_t *)buf;
        for (int k = 0; k < 2; k++)
            if (nglob[k]) {
                p.o[k].gamax = (uint32_t *)b;
                p.o[k].gmult = (float *)(b + fm_round_up(nglob[k], 64) * 4);
                b += fm_round_up(nglob[k], 64) * 8;
            }
        if ((err = cudaMemsetAsync(buf, 0, (size_t)glob_bytes, s)) != cudaSuccess)
            goto out;
        if (p.ntiles) {
            ppparams pp;
            memset(&pp, 0, sizeof pp);
            pp.in = in->data;
            pp.E = E;
            pp.rows = rows;
            pp.cols = cols;
            pp.ntr = p.ntr;
            pp.ntc = p.ntc;
            pp.ntrd = p.ntrd;
            pp.ntcd = p.ntcd;
            pp.ntiles = p.ntiles;
            pp.vec_in = p.vec_in;
            for (int k = 0; k < 2; k++)
                if (nglob[k] && outs[k]->scale_mode == FM_SCALE_TENSOR)
                    pp.tmax[k] = p.o[k].gamax;
            if (nglob[0] && out_row->scale_mode == FM_SCALE_ROW)
                pp.rmax = p.o[0].gamax;
            if (nglob[1] && out_col->scale_mode == FM_SCALE_ROW)
                pp.cmax = p.o[1].gamax;
            unsigned g = grid_for(p.ntiles, (int64_t)1 << 30);
            if (in->dtype == FM_DTYPE_F32)
                quant_amax_kernel<FM_DTYPE_F32><<<g, QTHREADS, 0, s>>>(pp);
            else if (in->dtype == FM_DTYPE_BF16)
                quant_amax_kernel<FM_DTYPE_BF16><<<g, QTHREADS, 0, s>>>(pp);
            else
                quant_amax_kernel<FM_DTYPE_F16><<<g, QTHREADS, 0, s>>>(pp);
            if ((err = cudaGetLastError()) != cudaSuccess)
                goto out;
        }
    }

    {
        auxparams a;
        memset(&a, 0, sizeof a);
        a.E = E;
        a.eps = cfg->epsilon;
        a.nonfinite = p.nonfinite;
        for (int k = 0; k < 2; k++) {
            a.o[k] = p.o[k];
            if (nglob[k]) {
                a.kind[k] = 1;
                a.n[k] = nglob[k];
            } else if (has_gemm_padding(outs[k], &p.o[k])) {
                a.kind[k] = 2;
                a.n[k] = E * p.o[k].per;
            }
        }
        if (a.n[0] + a.n[1] > 0) {
            quant_aux_kernel<<<grid_for(fm_cdiv(a.n[0] + a.n[1], 256), 4096), 256, 0, s>>>(a);
            if ((err = cudaGetLastError()) != cudaSuccess)
                goto out;
        }
    }

    if (p.ntiles) {
        const int re = out_row ? out_row->dtype : 0, ce = out_col ? out_col->dtype : 0;
        /* BF16 into E2M1 outputs only (MX32), every one under POW2 */
        const int nc = in->dtype == FM_DTYPE_BF16 && hint == FM_SCALE_MX32 &&
                       (re == FM_DTYPE_E2M1 || !re) && (ce == FM_DTYPE_E2M1 || !ce) &&
                       (!re || p.o[0].rule == FM_SCALE_RULE_POW2) && (!ce || p.o[1].rule == FM_SCALE_RULE_POW2);
        unsigned g = grid_for(p.ntiles, (int64_t)1 << 30);
        p.tend = p.ntiles;
        /* the prefetch's distance: 0.4 of a wave of 4 CTAs an SM, in whole
         * tile rows (2, 3, 4, 6, 8 rows of [32768, 7168]: 4 and 6 best,
         * S32-2, S32-3); none for narrow matrices ([8 x 4096, 2048]
         * row+col lost 3-13%), nor where a row's tiles are not 16-byte
         * aligned (the bulk prefetch's rule) */
        if (p.ntc >= 32 && p.vec_in)
            p.pfrows = fm_cdiv((int64_t)cs->prop.multiProcessorCount * 4 * 2, 5 * p.ntc) * QT;
        if (tmaj)
            err = launch_chunks(p, re, ce, hint == FM_SCALE_BLOCK_1x128 ? 0 : nc ? 2 : 1,
                                (int64_t)cs->prop.multiProcessorCount * 4, s);
        else if (in->dtype == FM_DTYPE_F32)
            err = launch_tile<FM_DTYPE_F32, 0>(p, re, ce, g, s);
        else if (nc)
            err = launch_tile<FM_DTYPE_BF16, FM_SCALE_MX32 | QNC_FLAG>(p, re, ce, g, s);
        else if (in->dtype == FM_DTYPE_BF16 && hint == FM_SCALE_BLOCK_1x128)
            err = launch_tile<FM_DTYPE_BF16, FM_SCALE_BLOCK_1x128>(p, re, ce, g, s);
        else if (in->dtype == FM_DTYPE_BF16 && hint == FM_SCALE_MX32)
            err = launch_tile<FM_DTYPE_BF16, FM_SCALE_MX32>(p, re, ce, g, s);
        else if (in->dtype == FM_DTYPE_BF16)
            err = launch_tile<FM_DTYPE_BF16, 0>(p, re, ce, g, s);
        else
            err = launch_tile<FM_DTYPE_F16, 0>(p, re, ce, g, s);
    }
out:
    if (owned) {
        cudaError_t e2 = cudaFreeAsync(buf, s);
        if (err == cudaSuccess)
            err = e2;
    }
    return fm_cuda_leave(ctx, &guard, err, "fm_quantize: kernel launch");
}
