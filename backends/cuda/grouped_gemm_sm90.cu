/* FP8 block-scaled GEMM for Hopper (sm_90a): m-grouped over a contiguous
 * expert layout, and dense as one group. D [ΣM_i, N] = A [ΣM_i, K] · B_iᵀ,
 * both FP8 with K contiguous, scaled BLOCK_1x128 x BLOCK_128x128 (DeepSeek)
 * or TENSOR x TENSOR (one scale per expert for B). Output BF16, F32, or added
 * into F32 (by reductions in the L2). Its k-grouped form, the experts'
 * weight gradients over ragged M_i, is the second kernel below (gk_kernel).
 *
 * One persistent launch: every CTA walks the tiles t = blockIdx.x,
 * + gridDim.x, ... of all experts (split sizes read on the device, so no host
 * synchronisation; a table of tile and row prefix sums in shared memory maps
 * t to its expert). Tiles are 192 x 128, 128 x 192 or 128 x 128 (rows x
 * columns), picked per call (gm_pick_shape). A CTA is a producer warpgroup
 * and two or three consumer warpgroups:
 *   - the producer (its first thread working) streams each 128-wide K
 *     block's A and B tiles, A's row scales and B's block scales into a ring
 *     of GM_STAGES shared-memory stages with TMA, each stage completing on a
 *     "full" mbarrier and handed back on an "empty" one;
 *   - each consumer owns 64 of the tile's rows: per K block, four m64nBNk32
 *     wgmma into a partial accumulator, then the FP32 promotion
 *     acc += partial · (sa_row · sb_block). The partial sum of
 *     one 128-K block never carries over, which both applies the block scales
 *     exactly where the reference rule applies them and keeps the tensor
 *     cores' reduced-precision accumulation to 128 products.
 *   setmaxnreg moves registers from the producer to the consumers. BF16
 *   results leave through a per-warp shared-memory staging area as 16-byte
 *   row pieces.
 * Rows of a tile past its expert's end belong to the next expert (or lie past
 * A, where TMA reads zeros): they are computed and never stored. K past the
 * end is zero-filled by TMA, so a partial last K block adds nothing. Block
 * scales must be in the GEMM layout (16-byte aligned); others are converted
 * into scratch first.
 *
 * The reference rule (gemm.h) sums in double; this kernel sums each K block
 * in the tensor cores and the blocks in F32, within the stated tolerance.
 * notes/grouped_gemm_sm90.md has the versions, their figures, and what was
 * tried and did not pay. */
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "cuda.h"
#include "sm90.cuh"

/* The tile's rows come from CWG consumer warpgroups of 64 rows each, its
 * columns are BN, both template parameters of the kernel (CWG 3 with BN 128,
 * CWG 2 with BN 128 or 192; host code names its choice CWG and BN too): the
 * macros below read them from the scope they expand in. */
#define GM_BM (64 * CWG)
#define GM_BN BN /* 128 or 192 columns, the template parameter BN */
#define GM_BK 128
#define GM_STAGES (GM_STAGE_BYTES <= 32768 ? 6 : 5)
#define GM_TILE_A (GM_BM * GM_BK)
#define GM_STAGE_BYTES (GM_BM * GM_BK + GM_BN * GM_BK)
/* A stage's A scales: one per row of the tile, loaded from the 16-byte
 * aligned row at or before the tile's first (a TMA box starts on 16 bytes
 * along its inner dimension: an unaligned start is an illegal instruction),
 * so 4 more, in a slot that keeps the next one 128-byte aligned. */
#define GM_SA_BOX (GM_BM + 4)
#define GM_SA_BYTES ((GM_SA_BOX * 4 + 127) / 128 * 128)
/* A consumer warp's epilogue staging area: 16 rows x 32 BF16 or 16 F32 columns. */
#define GM_EPI_BYTES (4 * CWG * 1024)
#define GM_SB_BYTES 128 /* a stage's B scales: the 16 bytes holding each of its (up to 2) blocks, in a 128-byte slot */
#define GM_THREADS (128 * (CWG + 1))
#define GM_MAX_GROUPS 1024 /* device splits: the per-CTA tile table is in shared memory */
#define GM_HOST_SPLITS 64  /* host-only splits travel in the kernel parameters */
#define GM_GROUP_M 8       /* tiles of 8 consecutive m blocks run together (gm_params.group_m may say 4) */

typedef struct {
    /* Block scales (BLK): A's GEMM-layout scales travel by TMA (map_sa), B's
     * 16 bytes at a time by bulk copy from sb[e * sb_es + nb * sb_ns + kb / 4 * 4].
     * TENSOR scales: sa[0] for A, sb[e] for expert e's B. */
    const float *sa, *sb;
    long long sb_es, sb_ns;
    void *d;
    long long ldd;
    const int64_t *splits; /* device split sizes, or NULL: host_splits */
    fm_cuda_pending *pend; /* device-only splits: where sizes that do not add up are reported */
    int host_splits[GM_HOST_SPLITS];
    int groups, rows, n, k;
    int group_m; /* m blocks that sweep the n blocks together (gm_swizzle) */
    int accumulate;
    int vec; /* 16 bytes of a row of D from a multiple of 16 bytes are 16-byte aligned (D and N allow it) */
} gm_params;

/* Device code that only sm_90a assembles: the host pass and the sm_90a pass
 * see it; the plain sm_90 pass compiles a kernel that traps. */
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GM_SM90A 1
#else
#define GM_SM90A 0
#endif

#if GM_SM90A
/* `bytes` (a multiple of 16, both addresses 16-byte aligned) from global
 * memory into shared memory, completing on `bar`. */
__device__ static __forceinline__ void gm_bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(sm90_sa(dst)), "l"((uint64_t)src), "r"(bytes), "r"(sm90_sa(bar))
                 : "memory");
}

/* As sm90_tma_load_2d, into the same offset of every CTA of the cluster in
 * `mask`, completing on each one's barrier at that offset. */
__device__ static __forceinline__ void gm_tma_load_mc(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1,
                                                      uint16_t mask)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%3, %4}], [%2], %5;"
                 ::"r"(sm90_sa(dst)), "l"((uint64_t)map), "r"(sm90_sa(bar)), "r"(c0), "r"(c1), "h"(mask)
                 : "memory");
}

/* Arrival on the barrier at the same offset in cluster CTA `cta`. */
__device__ static __forceinline__ void gm_bar_arrive_cta(uint64_t *b, uint32_t cta)
{
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(sm90_sa(b)), "r"(cta));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

__device__ static __forceinline__ uint32_t gm_cta_rank(void)
{
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

/* Every thread of the cluster: barrier initialisation before any remote
 * use, and no CTA gone while a peer may still arrive on its barriers. */
__device__ static __forceinline__ void gm_cluster_sync(void)
{
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

/* wgmma shared-memory descriptor of a K-major tile written by TMA with the
 * 128-byte swizzle: rows of 128 bytes, groups of 8 rows 1024 bytes apart
 * (the stride byte offset); the leading byte offset is unused in this mode.
 * The high word is the same for every tile, so the low word (the address in
 * 16-byte units, below 2^14 for any shared address) is all that changes:
 * kept as 32 bits, the K steps are one add, not a 64-bit add and its carry. */
#define GM_DESC_HI 0x40000040u /* swizzle mode 1 (128 bytes) in bits 62-63, stride 1024 >> 4 in bits 32-45 */
__device__ static __forceinline__ uint32_t gm_desc_lo(uint32_t saddr) { return ((saddr & 0x3FFFF) >> 4) | (1u << 16); }

__device__ static __forceinline__ uint64_t gm_desc(uint32_t lo)
{
    uint64_t d;
    asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo), "r"(GM_DESC_HI));
    return d;
}

/* A 32-bit shared-memory load (the generic form costs a 64-bit address and
 * the generic-to-shared check). */
__device__ static __forceinline__ float gm_lds(uint32_t saddr)
{
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(saddr) : "memory");
    return v;
}

/* The accumulator operands of a wgmma: its registers %0-%63 (and %64-%95
 * for N 192) in the instruction text, and their constraints. */
#define GM_REGS_0_63 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define GM_REGS_64_95 \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define GM_OUT_0_63(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define GM_OUT_64_95(d) \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])

/* One m64nNk32 FP8 wgmma (N 128 or 192): d (N / 2 F32 per thread) = or +=
 * A (64 x 32) x B (N x 32)^T, both from shared memory through their
 * descriptors; TA and TB name the PTX types. */
#define GM_WGMMA_N128(TA, TB, d, da, db, acc)                                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                \
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32." TA "." TB " {" GM_REGS_0_63                   \
                 "}, %64, %65, p, 1, 1;\n}\n"                                                                \
                 : GM_OUT_0_63(d)                                                                          \
                 : "l"(da), "l"(db), "r"(acc))

#define GM_WGMMA_N192(TA, TB, d, da, db, acc)                                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"                                                \
                 "wgmma.mma_async.sync.aligned.m64n192k32.f32." TA "." TB " {" GM_REGS_0_63 ", " GM_REGS_64_95 \
                 "}, %96, %97, p, 1, 1;\n}\n"                                                                \
                 : GM_OUT_0_63(d), GM_OUT_64_95(d)                                                        \
                 : "l"(da), "l"(db), "r"(acc))

/* Keeps the compiler from touching an accumulator while a wgmma owns it. */
#define GM_FENCE(x) asm volatile("" : "+f"(x)::"memory")

/* The wgmma macro W for the operand types TA, TB (0 E4M3, 1 E5M2). */
#define GM_MMA_TYPED(W, d, da, db, acc)              \
    do {                                             \
        if (TA == 0 && TB == 0)                      \
            W("e4m3", "e4m3", d, da, db, acc);       \
        else if (TA == 0)                            \
            W("e4m3", "e5m2", d, da, db, acc);       \
        else                                         \
            W("e5m2", "e4m3", d, da, db, acc);       \
    } while (0)

template <int TA, int TB, int BN>
__device__ static __forceinline__ void gm_mma(float *d, uint64_t da, uint64_t db, int acc)
{
    /* E5M2 x E5M2 never gets here: the API refuses it (as cuBLASLt does). */
    if (BN == 128)
        GM_MMA_TYPED(GM_WGMMA_N128, d, da, db, acc);
    else
        GM_MMA_TYPED(GM_WGMMA_N192, d, da, db, acc);
}

/* Tile L of one expert's mt x nt grid -> (m block, n block): `group` m
 * blocks sweep the n blocks together, so that their A tiles and the B tiles
 * they share stay in L2. */
__device__ static __forceinline__ void gm_swizzle(int L, int mt, int nt, int group, int *mb, int *nb)
{
    int g = L / (group * nt), first = g * group;
    int gm = mt - first < group ? mt - first : group;
    int r = L - g * group * nt;
    *mb = first + r % gm;
    *nb = r / gm;
}

/* Tile t of all experts -> (expert, m block, n block). Empty experts share
 * their start with the next expert; the last start <= t is the one that owns
 * tiles. Inside an expert, `group` m blocks sweep the n blocks together. */
__device__ static __forceinline__ void gm_tile(const int *tile_pfx, const int *row_pfx, int G, int nt, int bm, int group,
                                               int t, int *e, int *mb, int *nb)
{
    int lo = 0, hi = G - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (tile_pfx[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    *e = lo;
    gm_swizzle(t - tile_pfx[lo], (row_pfx[lo + 1] - row_pfx[lo] + bm - 1) / bm, nt, group, mb, nb);
}

/* Consumer side of one K block: wait for its stage, read its scales (into
 * s0[q], s1[q] for the warp's two rows and the q-th 64-column third of a
 * 192-column tile, which spans two 128-column B blocks: the middle third is
 * in the first for an even n block, in the second for an odd one; all three
 * the same for 128 columns), and issue its four wgmmas into `part` as one
 * commit group. Returns without waiting for them. */
template <int TA, int TB, int BLK, int CWG, int BN>
__device__ static __forceinline__ void gm_issue(float *part, uint32_t sm, uint64_t *full, uint32_t s_sa,
                                                uint32_t s_sb, int s, int ph, int kb, int wg, int sa_row, int odd,
                                                float ts, float *s0, float *s1)
{
    sm90_bar_wait(&full[s], ph);
#pragma unroll
    for (int q = 0; q < 3; q++)
        s0[q] = s1[q] = ts;
    if (BLK) { /* read now: the stage is handed back before the promotion */
        const uint32_t a = s_sa + s * GM_SA_BYTES + sa_row * 4, b = s_sb + s * GM_SB_BYTES + (kb & 3) * 4;
        const float a0 = gm_lds(a), a1 = gm_lds(a + 32), blo = gm_lds(b);
        s0[0] = a0 * blo;
        s1[0] = a1 * blo;
        if (BN == 128) {
            s0[1] = s0[2] = s0[0];
            s1[1] = s1[2] = s1[0];
        } else {
            const float bhi = gm_lds(b + 16);
            s0[2] = a0 * bhi;
            s1[2] = a1 * bhi;
            s0[1] = odd ? s0[2] : s0[0];
            s1[1] = odd ? s1[2] : s1[0];
        }
    }
    const uint32_t base = sm + s * GM_STAGE_BYTES;
    const uint32_t da = gm_desc_lo(base + wg * 64 * GM_BK), db = gm_desc_lo(base + GM_TILE_A);
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
        GM_FENCE(part[i]);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int k = 0; k < GM_BK / 32; k++) /* 32 bytes along K: +2 in the descriptor's 16-byte units */
        gm_mma<TA, TB, BN>(part, gm_desc(da + 2 * k), gm_desc(db + 2 * k), k);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

/* After the wait for `part`'s group: hand its stage back (one arrival per
 * warp) and fold it into the accumulator with its scales. */
template <int CL, int BN>
__device__ static __forceinline__ void gm_retire(float *acc, float *part, uint64_t *empty, int s, int lane,
                                                 const float *s0, const float *s1)
{
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
        GM_FENCE(part[i]);
    if (lane == 0) {
        if (CL > 1) /* every CTA of the cluster wrote into this stage: all are told */
            for (uint32_t c = 0; c < CL; c++)
                gm_bar_arrive_cta(&empty[s], c);
        else
            sm90_bar_arrive(&empty[s]);
    }
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
        const int q = BN == 128 ? 0 : j / 8;
        acc[4 * j + 0] = fmaf(part[4 * j + 0], s0[q], acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(part[4 * j + 1], s0[q], acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(part[4 * j + 2], s1[q], acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(part[4 * j + 3], s1[q], acc[4 * j + 3]);
    }
}

/* Stores a warp's 16 x BN BF16 outputs (rows from expert row r0; expert
 * rows start at global row g0, m_e of them; columns from n0) 32 columns at a
 * time through its 1 KB staging area: stmatrix turns the accumulator layout
 * (each lane 4 bytes of a row per 8 columns) into rows, read back 16 bytes a
 * lane. Stored straight from registers, 4-byte pieces of 8 rows per
 * instruction held the epilogue to the store pipe's pace (ncu: 5% of the
 * samples, both warpgroups idle on the tensor cores); this stores 4 times
 * fewer, whole 64-byte row pieces. Rows of 64 bytes: the 16-byte chunk c of
 * row r sits at chunk c ^ (r / 2 % 4), so neither side has bank conflicts. */
template <int BN, typename P>
__device__ static __forceinline__ void gm_store_bf16(const P *p, const float *acc, uint32_t buf, int lane,
                                                     int r0, int g0, int m_e, int n0)
{
    const int lrow = ((lane >> 3) & 1) * 8 + (lane & 7); /* the row whose address this lane gives stmatrix */
#pragma unroll
    for (int j0 = 0; j0 < BN / 8; j0 += 4) {
        __syncwarp(); /* the previous chunk's reads are done */
#pragma unroll
        for (int h = 0; h < 2; h++) {
            /* matrices: rows 0-7 and 8-15 of column group j, then of j + 1 */
            const int j = j0 + 2 * h, cc = 2 * h + (lane >> 4);
            uint32_t w[4];
            __nv_bfloat162 b;
            b = __floats2bfloat162_rn(acc[4 * j + 0], acc[4 * j + 1]);
            w[0] = *(uint32_t *)&b;
            b = __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
            w[1] = *(uint32_t *)&b;
            b = __floats2bfloat162_rn(acc[4 * j + 4], acc[4 * j + 5]);
            w[2] = *(uint32_t *)&b;
            b = __floats2bfloat162_rn(acc[4 * j + 6], acc[4 * j + 7]);
            w[3] = *(uint32_t *)&b;
            const uint32_t a = buf + lrow * 64 + ((cc ^ ((lrow >> 1) & 3)) << 4);
            asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(w[0]),
                         "r"(w[1]), "r"(w[2]), "r"(w[3])
                         : "memory");
        }
        __syncwarp();
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const int pc = lane + 32 * q, row = pc >> 2, c = pc & 3;
            uint4 v;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(buf + row * 64 + ((c ^ ((row >> 1) & 3)) << 4))
                         : "memory");
            const int er = r0 + row, col = n0 + (j0 + c) * 8;
            const long long gr = (long long)g0 + er;
            if (er < m_e && gr < p->rows && col < p->n) {
                __nv_bfloat16 *o = (__nv_bfloat16 *)p->d + gr * p->ldd + col;
                if (p->vec && col + 8 <= p->n)
                    *(uint4 *)o = v;
                else {
                    const uint32_t x[4] = {v.x, v.y, v.z, v.w};
                    for (int i = 0; i < 8 && col + i < p->n; i++) {
                        const uint16_t u = (uint16_t)(x[i / 2] >> (16 * (i & 1)));
                        o[i] = *(const __nv_bfloat16 *)&u;
                    }
                }
            }
        }
    }
}

/* As gm_store_bf16 for F32 outputs, 16 columns (64 bytes a row) at a time.
 * With accumulate, each 16-byte piece is added where it lies by a vector
 * reduction (red.add.v4.f32, performed in the L2, RNE, F32 subnormals
 * flushed to zero): the old D never comes into the SM. Loading it first
 * (into the free partial accumulator) and storing the sum ran 10% slower on
 * the grouped E 8 product (S19-6: 1040 -> 1142 TFLOP/s). One writer per
 * element: the sum is the same bits run to run. */
template <int BN, typename P>
__device__ static __forceinline__ void gm_store_f32(const P *p, const float *acc, uint32_t buf, int lane, int r0,
                                                    int g0, int m_e, int n0)
{
    const int lr = lane >> 2, sw = (lr >> 1) & 3; /* rows lr and lr + 8 share the swizzle */
#pragma unroll
    for (int c = 0; c < BN / 16; c++) {
        __syncwarp(); /* the previous chunk's reads are done */
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int j = 2 * c + h, u = 2 * h + ((lane & 3) >> 1);
            const uint32_t a = buf + lr * 64 + ((u ^ sw) << 4) + (lane & 1) * 8;
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(a), "f"(acc[4 * j + 0]), "f"(acc[4 * j + 1])
                         : "memory");
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(a + 8 * 64), "f"(acc[4 * j + 2]),
                         "f"(acc[4 * j + 3])
                         : "memory");
        }
        __syncwarp();
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const int pc = lane + 32 * q, row = pc >> 2, u = pc & 3;
            float4 v;
            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                         : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                         : "r"(buf + row * 64 + ((u ^ ((row >> 1) & 3)) << 4))
                         : "memory");
            const int er = r0 + row, col = n0 + c * 16 + u * 4;
            const long long gr = (long long)g0 + er;
            if (er < m_e && gr < p->rows && col < p->n) {
                float *o = (float *)p->d + gr * p->ldd + col;
                const float x[4] = {v.x, v.y, v.z, v.w};
                if (p->vec && col + 4 <= p->n) {
                    if (p->accumulate)
                        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(o), "f"(v.x), "f"(v.y),
                                     "f"(v.z), "f"(v.w)
                                     : "memory");
                    else
                        *(float4 *)o = v;
                } else
                    for (int i = 0; i < 4 && col + i < p->n; i++) {
                        if (p->accumulate)
                            asm volatile("red.global.add.f32 [%0], %1;" ::"l"(o + i), "f"(x[i]) : "memory");
                        else
                            o[i] = x[i];
                    }
            }
        }
    }
}

template <int CWG, int BN>
__device__ static __forceinline__ void gm_next(int *s, int *ph)
{
    if (++*s == GM_STAGES) {
        *s = 0;
        *ph ^= 1;
    }
}

/* A stage's B scales (GEMM layout, `ns` entries a 128-row block, from `sb`):
 * the 16 bytes holding K block kb's scale of each 128-column block the n
 * block's columns fall in, the first at 16 bytes 0 and a second (192
 * columns) at 16. A block past the last (an n block past it, the second of
 * an odd pair, or the second half of the last) reads the last one: its
 * columns are not stored. */
template <int BN>
__device__ static __forceinline__ void gm_load_sb(float *dst, const float *sb, long long ns, int nb, int nblk, int kb,
                                                  uint64_t *bar)
{
    const int b0 = nb * BN / 128;
    for (int h = 0; h < (BN == 128 ? 1 : 2); h++) {
        const int bk = b0 + h < nblk ? b0 + h : nblk - 1;
        gm_bulk_load(dst + 4 * h, sb + bk * ns + (kb & ~3), 16, bar);
    }
}

/* The shared memory of both kernels: the 1024-aligned stages, their scale
 * slots, the full and empty barriers, the epilogue staging (the m-grouped
 * kernel's tile tables follow it). */
template <int CWG, int BN>
__device__ static __forceinline__ void gm_carve(unsigned char *raw, unsigned char **sm, float **s_sa, float **s_sb,
                                                uint64_t **full, uint64_t **empty, unsigned char **epi)
{
    *sm = (unsigned char *)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
    *s_sa = (float *)(*sm + GM_STAGES * GM_STAGE_BYTES);
    *s_sb = (float *)((unsigned char *)*s_sa + GM_STAGES * GM_SA_BYTES);
    *full = (uint64_t *)((unsigned char *)*s_sb + GM_STAGES * GM_SB_BYTES);
    *empty = *full + GM_STAGES;
    *epi = (unsigned char *)(((uintptr_t)(*empty + GM_STAGES) + 127) & ~(uintptr_t)127);
}

/* One thread: the ring's barriers, `arrivals` consumer warps to hand a stage back. */
template <int CWG, int BN>
__device__ static __forceinline__ void gm_bars_init(uint64_t *full, uint64_t *empty, int arrivals)
{
    for (int s = 0; s < GM_STAGES; s++) {
        sm90_bar_init(&full[s], 1);
        sm90_bar_init(&empty[s], arrivals);
    }
    sm90_bar_init_fence();
}

/* Registers per thread: the producer warpgroup gives back what the
 * consumers take, within the SM's 64K (warpgroup-wide, so every warp of it). */
template <int CWG, int PRODUCER>
__device__ static __forceinline__ void gm_regs(void)
{
    if (PRODUCER && CWG == 2)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    else if (PRODUCER)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 32;\n" ::: "memory");
    else if (CWG == 2)
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    else
        asm volatile("setmaxnreg.inc.sync.aligned.u32 160;\n" ::: "memory");
}

/* A consumer's K block kb: issue, wait for its wgmmas, hand the stage back,
 * promote, and step the ring position (s, ph). */
template <int TA, int TB, int BLK, int CL, int CWG, int BN>
__device__ static __forceinline__ void gm_kblock(float *acc, float *part, uint32_t sm, uint64_t *full, uint64_t *empty,
                                                 uint32_t s_sa, uint32_t s_sb, int *s, int *ph, int kb, int wg,
                                                 int sa_row, int odd, float ts, int lane)
{
    float s0[3], s1[3];
    gm_issue<TA, TB, BLK, CWG, BN>(part, sm, full, s_sa, s_sb, *s, *ph, kb, wg, sa_row, odd, ts, s0, s1);
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    gm_retire<CL, BN>(acc, part, empty, *s, lane, s0, s1);
    gm_next<CWG, BN>(s, ph);
}

#endif /* GM_SM90A */

/* CL: CTAs per cluster (launched with the cluster attribute when > 1);
 * CWG: consumer warpgroups; BN: tile columns. */
template <int TA, int TB, int DF32, int BLK, int CL, int CWG, int BN>
__global__ void __launch_bounds__(GM_THREADS, 1)
    gm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
              const __grid_constant__ CUtensorMap map_sa, const gm_params p)
{
#if !GM_SM90A
    __trap(); /* the plain sm_90 pass: wgmma and setmaxnreg exist only in sm_90a, which a 9.0 GPU loads */
#else
    extern __shared__ unsigned char gm_smem_raw[];
    unsigned char *sm, *epi;
    float *s_sa, *s_sb;
    uint64_t *full, *empty;
    gm_carve<CWG, BN>(gm_smem_raw, &sm, &s_sa, &s_sb, &full, &empty, &epi);
    int *tile_pfx = (int *)(epi + GM_EPI_BYTES);
    int *row_pfx = tile_pfx + p.groups + 1;
    /* The warp index and the tile count from lane 0: the compiler then knows
     * them warp-uniform, the consumers' branch and tile loop are uniform, and
     * the stage addresses and wgmma descriptors live in uniform registers
     * (UIADD3 between the QGMMAs instead of R2UR copies and their waits: the
     * grouped E 8 product 1187 -> 1263 TFLOP/s, S18-6). */
    const int warp = __shfl_sync(0xffffffffu, threadIdx.x >> 5, 0), lane = threadIdx.x & 31;
    const int G = p.groups, nkb = (p.k + GM_BK - 1) / GM_BK;
    /* A cluster's CTAs take the n blocks cn * CL + rank of one
     * "cluster tile" cn; n blocks past N compute and store nothing. */
    const int nt = (p.n + GM_BN * CL - 1) / (GM_BN * CL);
    const uint32_t rank = CL > 1 ? gm_cta_rank() : 0;
    const int cid = blockIdx.x / CL, ncl = gridDim.x / CL;

    if (warp == 0) {
        /* Prefix sums of rows and tiles per expert. Split sizes come from the
         * caller's device memory unchecked: clamping each to [0, rows] and
         * every row to < rows below keeps a wrong split from writing outside D.
         * Device-only sizes that do not add up are also reported (CTA 0, in
         * the host check's order: a negative size or a sum past the rows at
         * the first group that shows it, else a total other than the rows). */
        long long ct = 0, cr = 0, raw = 0, bad_m = 0;
        int bad_kind = 0, bad_g = 0;
        for (int b0 = 0; b0 < G; b0 += 32) {
            int e = b0 + lane;
            long long m = 0;
            if (e < G)
                m = p.splits ? p.splits[e] : p.host_splits[e];
            if (p.pend && blockIdx.x == 0) {
                /* the inclusive prefix of the sizes clamped to [0, rows + 1]:
                 * it passes the rows where the raw sum does, and cannot
                 * overflow whatever the device memory holds */
                long long q = m < 0 ? 0 : m > p.rows ? (long long)p.rows + 1 : m;
                for (int o = 1; o < 32; o <<= 1) {
                    const long long xq = __shfl_up_sync(0xffffffffu, q, o);
                    if (lane >= o)
                        q += xq;
                }
                const unsigned viol = __ballot_sync(0xffffffffu, e < G && (m < 0 || raw + q > p.rows));
                if (viol && !bad_kind) {
                    const int l0 = __ffs(viol) - 1;
                    bad_m = __shfl_sync(0xffffffffu, m, l0);
                    bad_kind = bad_m < 0 ? FM_CUDA_PENDING_SPLIT_NEG : FM_CUDA_PENDING_SPLIT_PAST;
                    bad_g = b0 + l0;
                }
                raw += __shfl_sync(0xffffffffu, q, 31);
            }
            m = m < 0 ? 0 : m > p.rows ? p.rows : m;
            long long t = ((m + GM_BM - 1) / GM_BM) * nt, r = m;
            for (int o = 1; o < 32; o <<= 1) {
                long long xt = __shfl_up_sync(0xffffffffu, t, o), xr = __shfl_up_sync(0xffffffffu, r, o);
                if (lane >= o) {
                    t += xt;
                    r += xr;
                }
            }
            if (e < G) {
                tile_pfx[e + 1] = (int)(ct + t < INT_MAX ? ct + t : INT_MAX);
                row_pfx[e + 1] = (int)(cr + r < INT_MAX ? cr + r : INT_MAX);
            }
            ct += __shfl_sync(0xffffffffu, t, 31);
            cr += __shfl_sync(0xffffffffu, r, 31);
        }
        if (lane == 0)
            tile_pfx[0] = row_pfx[0] = 0;
        if (p.pend && blockIdx.x == 0 && lane == 0 && (bad_kind || raw != p.rows) && fm_pending_claim(p.pend)) {
            p.pend->kind = bad_kind ? bad_kind : FM_CUDA_PENDING_SPLIT_SUM;
            p.pend->a = bad_kind == FM_CUDA_PENDING_SPLIT_NEG ? bad_g : bad_kind ? p.rows : raw;
            p.pend->b = bad_kind == FM_CUDA_PENDING_SPLIT_NEG ? bad_m : bad_kind ? bad_g : p.rows;
            fm_pending_post(p.pend);
        }
    } else if (warp == 1 && lane == 0) {
        gm_bars_init<CWG, BN>(full, empty, 4 * CWG * CL); /* one arrival per consumer warp of the cluster */
    }
    __syncthreads();
    if (CL > 1)
        gm_cluster_sync();
    const int total = __shfl_sync(0xffffffffu, tile_pfx[G], 0);

    if (warp >= 4 * CWG) {
        gm_regs<CWG, 1>();
        if (warp == 4 * CWG && lane == 0) {
            int s = 0, ph = 0;
            for (int t = cid; t < total; t += ncl) {
                int e, mb, nb;
                gm_tile(tile_pfx, row_pfx, G, nt, GM_BM, p.group_m, t, &e, &mb, &nb);
                nb = nb * CL + rank;
                int arow = row_pfx[e] + mb * GM_BM, brow = e * p.n + nb * GM_BN;
                for (int kb = 0; kb < nkb; kb++) {
                    sm90_bar_wait(&empty[s], ph ^ 1);
                    unsigned char *st = sm + s * GM_STAGE_BYTES;
                    sm90_bar_expect(&full[s], GM_STAGE_BYTES + (BLK ? GM_SA_BOX * 4 + 16 * (BN == 128 ? 1 : 2) : 0));
                    if (CL > 1)
                        gm_tma_load_mc(st + rank * (GM_BM / CL) * GM_BK, &map_a, &full[s], kb * GM_BK,
                                       arow + rank * (GM_BM / CL), (uint16_t)((1u << CL) - 1));
                    else
                        sm90_tma_load_2d(st, &map_a, &full[s], kb * GM_BK, arow);
                    sm90_tma_load_2d(st + GM_TILE_A, &map_b, &full[s], kb * GM_BK, brow);
                    if (BLK) {
                        /* Scales through the copy engine too: read from global
                         * memory by the consumers, their latency stalled every
                         * K block (ncu: 30% of the samples). */
                        sm90_tma_load_2d(s_sa + s * (GM_SA_BYTES / 4), &map_sa, &full[s], arow & ~3, kb);
                        gm_load_sb<BN>(s_sb + s * (GM_SB_BYTES / 4), p.sb + e * p.sb_es, p.sb_ns, nb, (p.n + 127) / 128,
                                       kb, &full[s]);
                    }
                    gm_next<CWG, BN>(&s, &ph);
                }
            }
        }
    } else {
        gm_regs<CWG, 0>();
        const int wg = warp >> 2, wr = (warp & 3) * 16 + (lane >> 2);
        const uint32_t sm_u = sm90_sa(sm), sa_u = sm90_sa(s_sa), sb_u = sm90_sa(s_sb);
        /* One partial accumulator: kept in flight with a second one (block
         * kb + 1 issued before block kb's promotion) the kernel ran 11% slower;
         * the other consumer warpgroups keep the tensor cores busy instead. */
        float acc[BN / 2], part[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; i++)
            part[i] = 0.0f;
        int s = 0, ph = 0;
        for (int t = cid; t < total; t += ncl) {
            int e, mb, nb;
            gm_tile(tile_pfx, row_pfx, G, nt, GM_BM, p.group_m, t, &e, &mb, &nb);
            nb = nb * CL + rank;
            const int m_e = row_pfx[e + 1] - row_pfx[e];
            const int sa_row = ((row_pfx[e] + mb * GM_BM) & 3) + wg * 64 + wr; /* in the stage's A scale slot */
            /* TENSOR x TENSOR: two scales for the whole tile. */
            const float ts = BLK ? 1.0f : __ldg(p.sa) * __ldg(p.sb + e);
#pragma unroll
            for (int i = 0; i < BN / 2; i++)
                acc[i] = 0.0f;
            for (int kb = 0; kb < nkb; kb++)
                gm_kblock<TA, TB, BLK, CL, CWG, BN>(acc, part, sm_u, full, empty, sa_u, sb_u, &s, &ph, kb, wg, sa_row,
                                                    nb & 1, ts, lane);
            const uint32_t buf = sm90_sa(epi) + warp * 1024;
            const int wr0 = mb * GM_BM + wg * 64 + (warp & 3) * 16; /* the warp's first expert row */
            if (DF32)
                gm_store_f32<BN>(&p, acc, buf, lane, wr0, row_pfx[e], m_e, nb * GM_BN);
            else
                gm_store_bf16<BN>(&p, acc, buf, lane, wr0, row_pfx[e], m_e, nb * GM_BN);
        }
    }
    if (CL > 1)
        gm_cluster_sync();
#endif
}

/* ---- k-grouped: the experts' weight gradients ----------------------------
 *
 * dW_e [N, K] (+)= A_e [N, m_e] · B_e [K, m_e]ᵀ for every expert e: A_e is
 * dY_eᵀ and B_e is X_eᵀ in the grouped column-wise layout (each expert its
 * own row-major matrix, m_e contiguous), A 1x128 and B 128x128 blocks along
 * m_e (the ROWMAX transpose of x): the m-grouped kernel's scale pair, so the
 * consumers' issue, promotion and epilogue are its code. What differs: the
 * row pitch m_e changes per expert, so every expert has its own tensor maps,
 * and they travel in the kernel parameters (GK_MAX experts a launch); every
 * expert has the same ceil(N / BM) x ceil(K / BN) tiles with ceil(m_e / 128)
 * K blocks (TMA zero-fills past m_e); the A scales come by bulk copy. The
 * shared memory is laid out as the m-grouped kernel's, without its tables. */
#define GK_MAX 64 /* experts a launch: 2 tensor maps each in the parameters (at most 32 KB) */

typedef struct {
    CUtensorMap a[GK_MAX], b[GK_MAX]; /* A_g [N, m_g] and B_g [K, m_g], bytes, 128-byte swizzle */
    /* GEMM layout: A 1x128 [ceil(m/128)][sa_ld], B 128x128 [ceil(K/128)][round_up(ceil(m/128), 4)] */
    const float *sa[GK_MAX], *sb[GK_MAX];
    int m[GK_MAX], e[GK_MAX]; /* m_g > 0, and the expert's index in D */
    int groups, dr, sa_ld; /* dr: the rows of each dW_e (N) */
    /* D [E * dr, n] as the m-grouped epilogue writes it (gm_params' names) */
    void *d;
    long long ldd;
    int rows, n, vec, accumulate;
} gk_params;

template <int TA, int TB, int DF32, int CWG, int BN>
__global__ void __launch_bounds__(GM_THREADS, 1) gk_kernel(const __grid_constant__ gk_params p)
{
#if !GM_SM90A
    __trap();
#else
    extern __shared__ unsigned char gm_smem_raw[];
    unsigned char *sm, *epi;
    float *s_sa, *s_sb;
    uint64_t *full, *empty;
    gm_carve<CWG, BN>(gm_smem_raw, &sm, &s_sa, &s_sb, &full, &empty, &epi);
    const int warp = __shfl_sync(0xffffffffu, threadIdx.x >> 5, 0), lane = threadIdx.x & 31;
    const int mt = (p.dr + GM_BM - 1) / GM_BM, nt = (p.n + GM_BN - 1) / GM_BN, per = mt * nt;
    const int total = p.groups * per, nblk = (p.n + 127) / 128;

    if (warp == 1 && lane == 0)
        gm_bars_init<CWG, BN>(full, empty, 4 * CWG); /* one arrival per consumer warp */
    __syncthreads();

    if (warp >= 4 * CWG) {
        gm_regs<CWG, 1>();
        if (warp == 4 * CWG && lane == 0) {
            int s = 0, ph = 0;
            for (int t = blockIdx.x; t < total; t += gridDim.x) {
                const int g = t / per;
                int mb, nb;
                gm_swizzle(t - g * per, mt, nt, GM_GROUP_M, &mb, &nb);
                const int nkb = (p.m[g] + GM_BK - 1) / GM_BK, sb_ns = (nkb + 3) & ~3, r0 = mb * GM_BM;
                /* the tile's A scales, up to the padded row count */
                const uint32_t sab = (uint32_t)(p.sa_ld - r0 < GM_BM ? p.sa_ld - r0 : GM_BM) * 4;
                const float *sa = p.sa[g] + r0, *sb = p.sb[g];
                for (int kb = 0; kb < nkb; kb++) {
                    sm90_bar_wait(&empty[s], ph ^ 1);
                    unsigned char *st = sm + s * GM_STAGE_BYTES;
                    sm90_bar_expect(&full[s], GM_STAGE_BYTES + sab + 16 * (BN == 128 ? 1 : 2));
                    sm90_tma_load_2d(st, &p.a[g], &full[s], kb * GM_BK, r0);
                    sm90_tma_load_2d(st + GM_TILE_A, &p.b[g], &full[s], kb * GM_BK, nb * GM_BN);
                    gm_bulk_load(s_sa + s * (GM_SA_BYTES / 4), sa + (long long)kb * p.sa_ld, sab, &full[s]);
                    gm_load_sb<BN>(s_sb + s * (GM_SB_BYTES / 4), sb, sb_ns, nb, nblk, kb, &full[s]);
                    gm_next<CWG, BN>(&s, &ph);
                }
            }
        }
    } else {
        gm_regs<CWG, 0>();
        const int wg = warp >> 2, wr = (warp & 3) * 16 + (lane >> 2);
        const uint32_t sm_u = sm90_sa(sm), sa_u = sm90_sa(s_sa), sb_u = sm90_sa(s_sb), buf = sm90_sa(epi) + warp * 1024;
        float acc[BN / 2], part[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; i++)
            part[i] = 0.0f;
        int s = 0, ph = 0;
        for (int t = blockIdx.x; t < total; t += gridDim.x) {
            const int g = t / per;
            int mb, nb;
            gm_swizzle(t - g * per, mt, nt, GM_GROUP_M, &mb, &nb);
            const int nkb = (p.m[g] + GM_BK - 1) / GM_BK;
#pragma unroll
            for (int i = 0; i < BN / 2; i++)
                acc[i] = 0.0f;
            for (int kb = 0; kb < nkb; kb++)
                gm_kblock<TA, TB, 1, 1, CWG, BN>(acc, part, sm_u, full, empty, sa_u, sb_u, &s, &ph, kb, wg,
                                                 wg * 64 + wr, nb & 1, 1.0f, lane);
            const int r0 = mb * GM_BM + wg * 64 + (warp & 3) * 16; /* the warp's first row of dW_e */
            if (DF32)
                gm_store_f32<BN>(&p, acc, buf, lane, r0, p.e[g] * p.dr, p.dr, nb * GM_BN);
            else
                gm_store_bf16<BN>(&p, acc, buf, lane, r0, p.e[g] * p.dr, p.dr, nb * GM_BN);
        }
    }
#endif
}

/* ---- host ---------------------------------------------------------------- */

static int gm_fp8(fm_dtype t) { return t == FM_DTYPE_E4M3 || t == FM_DTYPE_E5M2; }

/* What both kernels need (NULL: met): a 9.0 GPU, FP8 operands, BF16 or F32
 * out, and the driver's tensor-map encoder. */
static const char *gm_why_not_common(fm_context *ctx, fm_dtype ta, fm_dtype tb, fm_dtype td)
{
    const cudaDeviceProp *pr = &fm_cuda(ctx)->prop;
    if (pr->major != 9 || pr->minor != 0)
        return "runs on compute capability 9.0 (H100/H200) only";
    if (!gm_fp8(ta) || !gm_fp8(tb))
        return "takes FP8 (E4M3/E5M2) operands only";
    if (td != FM_DTYPE_BF16 && td != FM_DTYPE_F32)
        return "writes BF16 or F32 only";
    if (!sm90_tensor_map_encoder())
        return "needs the driver's cuTensorMapEncodeTiled, which this driver does not give";
    return NULL;
}

/* Why the native kernel cannot run this product (NULL: it can). */
extern "C" const char *fm_cuda_gemm_sm90_why_not(fm_context *ctx, const fm_splits *splits, const fm_tensor *a,
                                                 const fm_tensor *b, const fm_tensor *d)
{
    const char *why = gm_why_not_common(ctx, a->dtype, b->dtype, d->dtype);
    if (why)
        return why;
    if (a->layout != FM_LAYOUT_ROWWISE || b->layout != FM_LAYOUT_ROWWISE)
        return "takes both operands with K contiguous";
    if (!(a->scale_mode == FM_SCALE_TENSOR && b->scale_mode == FM_SCALE_TENSOR) &&
        !(a->scale_mode == FM_SCALE_BLOCK_1x128 && b->scale_mode == FM_SCALE_BLOCK_128x128))
        return "takes the scale pairs TENSOR x TENSOR and BLOCK_1x128 x BLOCK_128x128 only";
    int64_t S = a->shape[0], K = a->shape[1];
    int64_t E = splits ? splits->groups : 1, N = b->shape[b->ndim - 2];
    if (K % 16 || ((uintptr_t)a->data | (uintptr_t)b->data) % 16)
        return "needs K a multiple of 16 and 16-byte aligned operands (TMA)";
    if (splits && !splits->device && E > GM_HOST_SPLITS)
        return "needs device split sizes for more than 64 experts";
    if (E > GM_MAX_GROUPS)
        return "takes at most 1024 experts";
    if (S >= INT_MAX || K >= INT_MAX || E * N >= INT_MAX || (S / 128 + E) * fm_cdiv(N, 128) >= INT_MAX)
        return "takes fewer than 2^31 rows, columns and tiles";
    return NULL;
}

/* Tile shapes: rows x columns (consumer warpgroups x 64 rows). */
enum { GM_192x128, GM_128x128, GM_128x192 };

/* Shared memory: alignment slack, the stages, their scale slots, the
 * barriers, two tables of groups + 1 ints. */
#define GM_SMEM(groups)                                                                                      \
    (1024 + GM_STAGES * (GM_STAGE_BYTES + GM_SA_BYTES + GM_SB_BYTES) + 2 * GM_STAGES * 8 + 128 + GM_EPI_BYTES + \
     2 * ((size_t)(groups) + 1) * 4)

template <int TA, int TB, int DF32, int BLK, int CL, int CWG, int BN>
static cudaError_t gm_launch(const CUtensorMap *maps, const gm_params *p, int grid, size_t smem, cudaStream_t s)
{
    static int ready; /* set for the largest table once; setting it twice is harmless */
    if (!ready) {
        cudaError_t err = cudaFuncSetAttribute(gm_kernel<TA, TB, DF32, BLK, CL, CWG, BN>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)GM_SMEM(GM_MAX_GROUPS));
        if (err != cudaSuccess)
            return err;
        ready = 1;
    }
    cudaLaunchConfig_t lc = {};
    cudaLaunchAttribute at[1];
    lc.gridDim = dim3((unsigned)grid);
    lc.blockDim = dim3(GM_THREADS);
    lc.dynamicSmemBytes = smem;
    lc.stream = s;
    if (CL > 1) {
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = CL;
        at[0].val.clusterDim.y = 1;
        at[0].val.clusterDim.z = 1;
        lc.attrs = at;
        lc.numAttrs = 1;
    }
    return cudaLaunchKernelEx(&lc, gm_kernel<TA, TB, DF32, BLK, CL, CWG, BN>, maps[0], maps[1], maps[2], *p);
}

template <int TA, int TB, int CL, int CWG, int BN>
static cudaError_t gm_launch_cw(int f32, int blk, const CUtensorMap *maps, const gm_params *p, int grid, size_t smem,
                                cudaStream_t s)
{
#define GM_L(DF, BK) gm_launch<TA, TB, DF, BK, CL, CWG, BN>(maps, p, grid, smem, s)
    return blk ? (f32 ? GM_L(1, 1) : GM_L(0, 1)) : (f32 ? GM_L(1, 0) : GM_L(0, 0));
#undef GM_L
}

template <int TA, int TB, int CL>
static cudaError_t gm_launch_shape(int f32, int blk, int shape, const CUtensorMap *maps, const gm_params *p, int grid,
                                   size_t smem, cudaStream_t s)
{
    switch (shape) {
    case GM_192x128: return gm_launch_cw<TA, TB, CL, 3, 128>(f32, blk, maps, p, grid, smem, s);
    case GM_128x128: return gm_launch_cw<TA, TB, CL, 2, 128>(f32, blk, maps, p, grid, smem, s);
    default: return gm_launch_cw<TA, TB, CL, 2, 192>(f32, blk, maps, p, grid, smem, s);
    }
}

template <int TA, int TB>
static cudaError_t gm_launch_ab(int f32, int blk, int cl, int shape, const CUtensorMap *maps, const gm_params *p,
                                int grid, size_t smem, cudaStream_t s)
{
    return cl > 1 ? gm_launch_shape<TA, TB, 2>(f32, blk, shape, maps, p, grid, smem, s)
                  : gm_launch_shape<TA, TB, 1>(f32, blk, shape, maps, p, grid, smem, s);
}

/* The index of environment variable `name`'s value in vals[0..n), or -1
 * (unset, or none of them). */
static int gm_knob(const char *name, const char *const *vals, int n)
{
    const char *v = getenv(name);
    for (int i = 0; v && i < n; i++)
        if (!strcmp(v, vals[i]))
            return i;
    return -1;
}

/* FLOWMOE_SM90_TILE=192x128, 128x128 or 128x192 forces a tile shape (a
 * tuning and test knob, read once; anything else: chosen per call). */
static int gm_tile_knob(void)
{
    static const char *const shapes[] = {"192x128", "128x128", "128x192"}; /* GM_192x128, ... in order */
    static int knob = -2;
    if (knob == -2)
        knob = gm_knob("FLOWMOE_SM90_TILE", shapes, 3);
    return knob;
}

/* The tile shape with the least work per call, counting the rows and columns
 * computed past the experts' ends and N, and each shape's speed per output
 * computed. S18-6 (H200, K 7168): with little rounding 192 x 128 runs 7%
 * faster than 128 x 192 (E 8 of 4096 rows 1263 against 1214 TFLOP/s, dense
 * 8192^3 1317 against 1260), which runs 8% faster than 128 x 128; 128-row
 * tiles win on 1024-row experts and below (64 of 256 rows, N 2048: 128 x 192
 * 1107, 192 x 128 803). Device-only sizes: by the mean. FLOWMOE_SM90_TILE
 * forces a shape. `speed`: each shape's speed per output computed, in
 * GM_192x128, GM_128x128, GM_128x192 order. */
static const double gm_speed_mgrouped[3] = {1.07, 0.92, 1.0};
static int gm_pick_shape(const fm_splits *splits, int64_t S, int64_t N, const double *speed)
{
    const int forced = gm_tile_knob();
    if (forced >= 0)
        return forced;
    double r2 = 0, r3 = 0;
    int64_t E = splits ? splits->groups : 1;
    for (int64_t e = 0; e < E; e++) {
        int64_t m = !splits ? S : splits->host ? splits->host[e] : fm_cdiv(S, E);
        r2 += (double)fm_round_up(m, 128);
        r3 += (double)fm_round_up(m, 192);
    }
    const double n128 = (double)fm_round_up(N, 128), n192 = (double)fm_round_up(N, 192);
    const double c[3] = {r3 * n128 / speed[0], r2 * n128 / speed[1], r2 * n192 / speed[2]};
    return c[0] <= c[1] && c[0] <= c[2] ? GM_192x128 : c[1] < c[2] ? GM_128x128 : GM_128x192;
}

/* CTAs per cluster. With 2, a pair works on two neighbouring n blocks of one
 * m block and shares the A tile, each loading half of it into both (TMA
 * multicast): 28 KB from L2 per K block instead of 40. The environment
 * variable FLOWMOE_SM90_CLUSTER=2 asks for it (a tuning knob, read once);
 * notes/grouped_gemm_sm90.md has what it measured. */
static int gm_cluster_size(void)
{
    static const char *const two[] = {"2"};
    static int cl;
    if (!cl)
        cl = gm_knob("FLOWMOE_SM90_CLUSTER", two, 1) == 0 ? 2 : 1;
    return cl;
}

/* A 2-D tensor map: `outer` rows of `inner` elements (F32, or bytes with the
 * 128-byte swizzle wgmma reads), row pitch `pitch` bytes, boxes of
 * box_inner x box_outer. */
static fm_status gm_map(fm_context *ctx, CUtensorMap *m, const void *base, int fp32, int64_t inner, int64_t outer,
                        int64_t pitch, int box_inner, int box_outer, const char *what)
{
    cuuint64_t dims[2] = {(cuuint64_t)inner, (cuuint64_t)outer};
    cuuint64_t strides[1] = {(cuuint64_t)pitch};
    cuuint32_t box[2] = {(cuuint32_t)box_inner, (cuuint32_t)box_outer};
    cuuint32_t es[2] = {1, 1};
    CUresult r = sm90_tensor_map_encoder()(m, fp32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 2,
                              (void *)base, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              fp32 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return fm_error(ctx, FM_ERR_BACKEND, "native FP8 GEMM: cuTensorMapEncodeTiled(%s) failed with CUresult %d",
                        what, (int)r);
    return FM_OK;
}

/* The block scales as the kernel reads them: GEMM layout, 16-byte aligned.
 * Others are converted into scratch (a pass over a few MB). */
static int gm_scales_ready(const fm_tensor *t)
{
    return t->scale_layout == FM_SCALE_LAYOUT_GEMM && (uintptr_t)t->scale % 16 == 0;
}

/* D = A · Bᵀ per expert (splits NULL: dense). The caller checked
 * fm_cuda_gemm_sm90_why_not and that nothing is empty, and holds the device. */
extern "C" fm_status fm_cuda_gemm_sm90(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *splits,
                                       const fm_tensor *a, const fm_tensor *b, fm_tensor *d)
{
    int64_t S = a->shape[0], K = a->shape[1], N = b->shape[b->ndim - 2];
    int64_t E = splits ? splits->groups : 1;
    int64_t nkb = fm_cdiv(K, 128), R4 = fm_round_up(S, 4);
    int blk = a->scale_mode == FM_SCALE_BLOCK_1x128, cl = gm_cluster_size();
    const int shape = gm_pick_shape(splits, S, N, gm_speed_mgrouped);
    const int CWG = shape == GM_192x128 ? 3 : 2, BN = shape == GM_128x192 ? 192 : 128; /* read by the GM_ macros below */
    cudaStream_t s = fm_cuda_stream(ctx);
    fm_status st = FM_OK;
    gm_params p;
    memset(&p, 0, sizeof p);
    p.sa = (const float *)a->scale;
    p.sb = (const float *)b->scale;
    void *scratch = NULL;
    int owned = 0;
    if (blk) {
        int64_t per_b = fm_scale_count_2d(FM_SCALE_BLOCK_128x128, FM_SCALE_LAYOUT_GEMM, N, K);
        size_t need_a = gm_scales_ready(a) ? 0 : (size_t)fm_round_up(nkb * R4 * 4, 256);
        size_t need_b = gm_scales_ready(b) ? 0 : (size_t)(E * per_b * 4);
        if (need_a + need_b) {
            if ((st = fm_cuda_scratch(ctx, need_a + need_b, &scratch, &owned, "fm_grouped_gemm (native)")))
                return st;
            fm_tensor ga = *a, gb = *b;
            ga.scale_layout = gb.scale_layout = FM_SCALE_LAYOUT_GEMM;
            ga.scale = scratch;
            gb.scale = (char *)scratch + need_a;
            if (need_a && !st && !(st = fm_cuda_scale_layout_convert(ctx, a, &ga)))
                p.sa = (const float *)ga.scale;
            if (need_b && !st && !(st = fm_cuda_scale_layout_convert(ctx, b, &gb)))
                p.sb = (const float *)gb.scale;
        }
        p.sb_es = per_b;
        p.sb_ns = fm_round_up(nkb, 4);
    }
    p.d = d->data;
    p.ldd = N;
    p.groups = (int)E;
    p.rows = (int)S;
    p.n = (int)N;
    p.k = (int)K;
    p.accumulate = cfg->accumulate;
    /* Experts of 2048 rows and more: groups of 4 m blocks. S19-13 (H100, one
     * binary each, twice): E 8 of 4096 rows 1213 / 1221 -> 1251 / 1259
     * TFLOP/s, the layer's data gradient through W1 1194 -> 1210 / 1245, its
     * W2 forward level, its data gradient through W2 1221 / 1237 -> 1213 /
     * 1222; but dense 8192^3 1366 / 1359 -> 1349 / 1347 and E 32 of 1024 rows
     * 1231 / 1223 -> 1217 / 1210, which keep 8 (16: dense 1281 / 1266).
     * S19-14 (another H100, against the binary before): E 8 1170 / 1174 ->
     * 1201 / 1203, the layer's products +1-1.5%. */
    p.group_m = splits && S >= 2048 * E ? 4 : GM_GROUP_M;
    p.vec = N % (d->dtype == FM_DTYPE_F32 ? 4 : 8) == 0 && (uintptr_t)d->data % 16 == 0;
    if (splits && splits->device) {
        p.splits = splits->device;
        p.pend = splits->host ? NULL : fm_cuda(ctx)->pending; /* host sizes were checked on the host */
    }
    else if (splits)
        for (int64_t e = 0; e < E; e++)
            p.host_splits[e] = (int)splits->host[e];
    else
        p.host_splits[0] = (int)S;
    /* maps[2]: A's scales viewed as nkb rows of R4 floats (GEMM layout), one
     * box = the GM_BM rows of a tile in one K block (and up to 4 before them).
     * Unused for TENSOR scales. */
    CUtensorMap maps[3];
    memset(maps, 0, sizeof maps);
    if (!st)
        st = gm_map(ctx, &maps[0], a->data, 0, K, S, K, GM_BK, GM_BM / cl, "A");
    if (!st)
        st = gm_map(ctx, &maps[1], b->data, 0, K, E * N, K, GM_BK, GM_BN, "B");
    if (!st && blk)
        st = gm_map(ctx, &maps[2], p.sa, 1, R4, nkb, R4 * 4, GM_SA_BOX, 1, "A scales");
    if (!st) {
        int64_t tiles = (S / GM_BM + E) * fm_cdiv(N, GM_BN * cl); /* cluster tiles */
        int64_t clusters = fm_cuda(ctx)->prop.multiProcessorCount / cl;
        int grid = (int)(tiles < clusters ? tiles : clusters) * cl;
        size_t smem = GM_SMEM(E);
        int ta = a->dtype == FM_DTYPE_E5M2, tb = b->dtype == FM_DTYPE_E5M2, f32 = d->dtype == FM_DTYPE_F32;
        cudaError_t err;
        if (ta == 0 && tb == 0)
            err = gm_launch_ab<0, 0>(f32, blk, cl, shape, maps, &p, grid, smem, s);
        else if (ta == 0)
            err = gm_launch_ab<0, 1>(f32, blk, cl, shape, maps, &p, grid, smem, s);
        else
            err = gm_launch_ab<1, 0>(f32, blk, cl, shape, maps, &p, grid, smem, s);
        st = fm_cuda_check(ctx, err, "native FP8 GEMM kernel launch");
    }
    if (owned) {
        cudaError_t err = cudaFreeAsync(scratch, s);
        fm_status st2 = fm_cuda_check(ctx, err, "native FP8 GEMM: cudaFreeAsync(scratch)");
        if (!st)
            st = st2;
    }
    return st;
}

/* ---- host: k-grouped ------------------------------------------------------ */

/* Why the native kernel cannot run this weight gradient (NULL: it can). */
extern "C" const char *fm_cuda_gemm_wgrad_sm90_why_not(fm_context *ctx, const fm_splits *splits,
                                                       const fm_tensor *dy, const fm_tensor *x, const fm_tensor *dw)
{
    const char *why = gm_why_not_common(ctx, dy->dtype, x->dtype, dw->dtype);
    if (why)
        return why;
    if (dy->scale_mode != FM_SCALE_BLOCK_1x128 || x->scale_mode != FM_SCALE_BLOCK_128x128)
        return "takes the k-grouped scale pair dy BLOCK_1x128 x x BLOCK_128x128 only (x from the ROWMAX transpose)";
    int64_t E = dw->shape[0], N = dw->shape[1], K = dw->shape[2];
    for (int64_t e = 0; e < E; e++)
        if (splits->host[e] % 16)
            return "needs every M_i a multiple of 16 (an expert's rows are a TMA row pitch)";
    if (K * (dw->dtype == FM_DTYPE_F32 ? 4 : 2) % 16 || (uintptr_t)dw->data % 16)
        return "needs dW's rows a multiple of 16 bytes (K a multiple of 4 for F32, 8 for BF16) and dW 16-byte "
               "aligned (TMA)";
    if (((uintptr_t)dy->data | (uintptr_t)x->data) % 16 ||
        (dy->scale_layout == FM_SCALE_LAYOUT_GEMM && (uintptr_t)dy->scale % 16) ||
        (x->scale_layout == FM_SCALE_LAYOUT_GEMM && (uintptr_t)x->scale % 16))
        return "needs 16-byte aligned operands and scales (TMA)";
    if (N >= INT_MAX / 2 || K >= INT_MAX / 2 || E * N >= INT_MAX ||
        fm_cdiv(N, 64) * fm_cdiv(K, 128) * GK_MAX >= INT_MAX)
        return "takes fewer than 2^30 rows and columns and 2^31 tiles a launch";
    return NULL;
}

/* The tile shapes' speeds on the k-grouped product, against 128 x 192 (S19-6,
 * H100, the layer's W1 gradient into F32 +=: 192 x 128 1100-1103 TFLOP/s,
 * 128 x 128 1104-1105, 128 x 192 1158-1166; W2's ranks the same). Unlike
 * the m-grouped product, 192 x 128 does not lead here. */
static const double gk_speed[3] = {0.95, 0.95, 1.0};

template <int TA, int TB, int DF32, int CWG, int BN>
static cudaError_t gk_launch(const gk_params *p, int grid, cudaStream_t s)
{
    static int ready;
    if (!ready) {
        cudaError_t err = cudaFuncSetAttribute(gk_kernel<TA, TB, DF32, CWG, BN>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)GM_SMEM(0));
        if (err != cudaSuccess)
            return err;
        ready = 1;
    }
    gk_kernel<TA, TB, DF32, CWG, BN><<<grid, GM_THREADS, GM_SMEM(0), s>>>(*p);
    return cudaGetLastError();
}

template <int TA, int TB>
static cudaError_t gk_launch_ab(int f32, int shape, const gk_params *p, int grid, cudaStream_t s)
{
#define GK_L(CWG, BN) (f32 ? gk_launch<TA, TB, 1, CWG, BN>(p, grid, s) : gk_launch<TA, TB, 0, CWG, BN>(p, grid, s))
    switch (shape) {
    case GM_192x128: return GK_L(3, 128);
    case GM_128x128: return GK_L(2, 128);
    default: return GK_L(2, 192);
    }
#undef GK_L
}

/* dW_e (+)= A_e · B_eᵀ for the n experts in jobs (m > 0 each; the caller
 * zeroed the empty experts' dW when not accumulating), GK_MAX a launch. The
 * caller checked fm_cuda_gemm_wgrad_sm90_why_not and holds the device. */
extern "C" fm_status fm_cuda_gemm_wgrad_sm90(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *dy,
                                             const fm_tensor *x, fm_tensor *dw, const fm_sm90_kjob *jobs, int64_t n)
{
    int64_t E = dw->shape[0], N = dw->shape[1], K = dw->shape[2];
    const int f32 = dw->dtype == FM_DTYPE_F32;
    /* rows N, columns K: the tile that computes least past them (the experts' rows play no part) */
    const int shape = gm_pick_shape(NULL, N, K, gk_speed);
    const int CWG = shape == GM_192x128 ? 3 : 2, BN = shape == GM_128x192 ? 192 : 128; /* 64-row warpgroups, columns */
    const int ta = dy->dtype == FM_DTYPE_E5M2, tb = x->dtype == FM_DTYPE_E5M2;
    cudaStream_t s = fm_cuda_stream(ctx);
    gk_params *p = (gk_params *)malloc(sizeof *p); /* 18 KB: not on the caller's stack */
    if (!p)
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_grouped_gemm_wgrad (native): out of host memory");
    memset(p, 0, sizeof *p);
    fm_status st = FM_OK;
    p->dr = (int)N;
    p->n = (int)K;
    p->d = dw->data;
    p->ldd = K;
    p->rows = (int)(E * N);
    p->vec = 1; /* fm_cuda_gemm_wgrad_sm90_why_not: rows of 16-byte multiples, 16-byte aligned */
    p->sa_ld = (int)fm_round_up(N, 4);
    p->accumulate = cfg->accumulate;
    const int64_t per = fm_cdiv(N, CWG * 64) * fm_cdiv(K, BN);
    for (int64_t j0 = 0; j0 < n && !st; j0 += GK_MAX) {
        const int G = (int)(n - j0 < GK_MAX ? n - j0 : GK_MAX);
        for (int g = 0; g < G && !st; g++) {
            const fm_sm90_kjob *j = &jobs[j0 + g];
            st = gm_map(ctx, &p->a[g], j->a, 0, j->m, N, j->m, GM_BK, CWG * 64, "dy");
            if (!st)
                st = gm_map(ctx, &p->b[g], j->b, 0, j->m, K, j->m, GM_BK, BN, "x");
            p->sa[g] = j->sa;
            p->sb[g] = j->sb;
            p->m[g] = (int)j->m;
            p->e[g] = (int)j->e;
        }
        p->groups = G;
        if (st)
            break;
        const int64_t tiles = per * G, sms = fm_cuda(ctx)->prop.multiProcessorCount;
        const int grid = (int)(tiles < sms ? tiles : sms);
        cudaError_t err = ta == 0 && tb == 0 ? gk_launch_ab<0, 0>(f32, shape, p, grid, s)
                          : ta == 0           ? gk_launch_ab<0, 1>(f32, shape, p, grid, s)
                                              : gk_launch_ab<1, 0>(f32, shape, p, grid, s);
        st = fm_cuda_check(ctx, err, "native FP8 GEMM (k-grouped) kernel launch");
    }
    free(p);
    return st;
}
