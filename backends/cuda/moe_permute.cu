/* CUDA permute + pad, bit-exact with backends/cpu/moe_permute.c, without a
 * host synchronisation (unless host_splits is asked for):
 *   1. the slots are cut into chunks (perm_chunk), one warp each: a histogram
 *      of the chunk's experts (shared-memory counters, then one atomic add
 *      per chunk and expert into the totals; integer counts are order-free)
 *      and a flag for ids out of range (-1, a slot with no expert, is
 *      skipped);
 *   2. one block, one scan: padded sizes, offsets and splits, a flag when
 *      the routing needs more than R rows, and each chunk's first row per
 *      expert (the expert's offset plus the counts of the chunks before
 *      it);
 *   3. each warp walks its chunk again in slot order, 32 slots a step: lanes
 *      with the same expert find each other (match.any) and take
 *      consecutive rows after the chunk's running counter, so rows follow
 *      the source slot as on the CPU; slots with no expert, and every slot
 *      of a flagged call, get slot_rows -1, so nothing is ever written past
 *      R;
 *   4. one block per token reads its row of codes and compact scales once
 *      and writes it to each of its slots' rows: the input is read once,
 *      not k times as a gather by output row reads it;
 *   5. in the same launch, other blocks give the output rows that no slot
 *      took (each expert's padding, known from step 2, and the rows past the
 *      need) zeros, scale 1, prob 0 and row_map -1.
 * Every entry of row_map and slot_rows is written by steps 3 and 5, so no
 * memset runs before them. A flagged call is reported as
 * FM_ERR_INVALID_ARG when host_splits makes it synchronise; otherwise its
 * outputs hold zero rows and row_map -1, and the finding waits in the
 * context for fm_context_synchronize (cuda.h, fm_cuda_pending). */
#include <cub/block/block_scan.cuh>

#include "cuda.h"
#include "moe_common.cuh"

enum { PERM_BAD_ID = 1, PERM_TOO_FEW_ROWS = 2 };

/* Slots per warp chunk: short chunks give more warps; long ones keep the
 * per-chunk counters (chunks x E) small when there are many experts. */
static int64_t perm_chunk(int64_t E) { return E <= 256 ? 256 : 2048; }
#define PERM_SMEM 49152   /* shared memory for the per-warp expert counters without an opt-in */

/* Warps per block of the chunk kernels: each holds E 32-bit counters. */
static int perm_warps(int64_t E) { return E * 4 * 8 <= PERM_SMEM ? 8 : 1; }

__global__ void perm_hist_kernel(const int32_t *__restrict__ ids, int64_t n, int E, int64_t ch, int64_t nchunk,
                                 uint32_t *__restrict__ hist, unsigned long long *cnt, int *flag,
                                 uint32_t *first_bad)
{
    extern __shared__ uint32_t perm_sh[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t c = (int64_t)blockIdx.x * (blockDim.x >> 5) + w;
    uint32_t *h = perm_sh + (int64_t)w * E;
    for (int e = lane; e < E; e += 32)
        h[e] = 0;
    __syncwarp();
    if (c >= nchunk)
        return;
    const int64_t s1 = c * ch + ch < n ? c * ch + ch : n;
    int bad = 0;
    for (int64_t s = c * ch + lane; s < s1; s += 32) {
        const int e = ids[s];
        if (e >= 0 && e < E)
            atomicAdd(&h[e], 1u);
        else if (e != -1) {
            bad = 1;
            atomicMax(first_bad, ~(uint32_t)s); /* the first bad slot, as its complement (0: none) */
        }
    }
    if (__any_sync(0xFFFFFFFFu, bad) && lane == 0)
        atomicOr(flag, PERM_BAD_ID);
    __syncwarp();
    for (int e = lane; e < E; e += 32) {
        const uint32_t v = h[e];
        hist[(uint32_t)e * (uint32_t)(nchunk + 1) + (uint32_t)c] = v;
        if (v)
            atomicAdd(&cnt[e], (unsigned long long)v);
    }
}

/* Step 2 as one block-wide exclusive scan (CUB's BlockScan) over hist,
 * [E][nchunk + 1]: each expert's per-chunk counts, closed by one more item,
 * its padding P_e - c_e (P_e = c_e rounded up to pad). The prefix before
 * (e, 0) is offset_e, the one before (e, c) chunk c's first row for expert
 * e, the one before the padding item expert e's first padding row. A tile
 * makes one round trip to memory: the totals c_e come in with the tile's
 * counts, no load depends on another, and nothing read is written (the
 * offsets go to their own array). Nsight Compute still gives it about 20 us
 * at the benchmark's size (16K items, 3 tiles; a warp per expert took
 * 29-36 us, this scan after a pass over the totals 21 us, 256 threads 19
 * us): the time is not in its round trips, and where it is remains open.
 * 32-bit sums are exact: the launcher keeps n + E pad, which bounds every
 * prefix, below 2^32. cnt: totals; hist: counts in, first rows out; off,
 * padbeg: out. */
#define PERM_SCAN_THREADS 1024
#define PERM_SCAN_ITEMS 8
typedef cub::BlockScan<uint32_t, PERM_SCAN_THREADS, cub::BLOCK_SCAN_WARP_SCANS> perm_block_scan;

__global__ void __launch_bounds__(PERM_SCAN_THREADS, 1)
    perm_offsets_kernel(const unsigned long long *cnt, uint32_t *off, uint32_t *padbeg, int E, int64_t pad, int64_t R,
                        int64_t *splits, int *flag, int64_t *need, uint32_t *hist, int64_t nchunk,
                        const int32_t *ids, int64_t k, int64_t bound, const uint32_t *first_bad,
                        fm_cuda_pending *fnd, fm_cuda_pending *pend)
{
    __shared__ typename perm_block_scan::TempStorage tmp;
    const uint32_t per = (uint32_t)nchunk + 1, N = (uint32_t)E * per, pd = (uint32_t)pad;
    uint32_t carry = 0;
    for (uint32_t f0 = 0; f0 < N; f0 += PERM_SCAN_THREADS * PERM_SCAN_ITEMS) {
        const uint32_t f = f0 + threadIdx.x * PERM_SCAN_ITEMS, e0 = f / per, c0 = f - e0 * per;
        uint32_t v[PERM_SCAN_ITEMS];
        uint32_t e = e0, c = c0;
#pragma unroll
        for (int u = 0; u < PERM_SCAN_ITEMS; u++) {
            v[u] = f + u >= N ? 0u : c + 1 < per ? hist[f + u] : (uint32_t)cnt[e];
            if (++c == per) {
                c = 0;
                e++;
            }
        }
        e = e0;
        c = c0;
#pragma unroll
        for (int u = 0; u < PERM_SCAN_ITEMS; u++) { /* a total into its padding */
            if (f + u < N && c + 1 == per) {
                const uint32_t P = (v[u] + pd - 1) / pd * pd;
                splits[e] = P;
                v[u] = P - v[u];
            }
            if (++c == per) {
                c = 0;
                e++;
            }
        }
        uint32_t total;
        perm_block_scan(tmp).ExclusiveSum(v, v, total);
        e = e0;
        c = c0;
#pragma unroll
        for (int u = 0; u < PERM_SCAN_ITEMS; u++) {
            if (f + u < N) {
                const uint32_t before = carry + v[u];
                if (c == 0)
                    off[e] = before;
                if (c + 1 < per)
                    hist[f + u] = before;
                else
                    padbeg[e] = before;
            }
            if (++c == per) {
                c = 0;
                e++;
            }
        }
        carry += total;
        __syncthreads(); /* tmp is reused by the next tile */
    }
    if (threadIdx.x == 0) {
        *need = carry;
        if (carry > R)
            atomicOr(flag, PERM_TOO_FEW_ROWS);
        /* The finding, named as the CPU names it (the first bad slot before
         * the row count): the host reads it back when the call waits;
         * otherwise it waits in the context for fm_context_synchronize. */
        const int f = *flag;
        if (f) {
            fm_cuda_pending v = {2u, FM_CUDA_PENDING_FEW_ROWS, 0u, 0u, R, (long long)carry, pad, bound};
            if (f & PERM_BAD_ID) {
                const uint32_t i = ~*first_bad;
                v.kind = FM_CUDA_PENDING_BAD_ID;
                v.a = (long long)(i / (uint32_t)k);
                v.b = (long long)(i % (uint32_t)k);
                v.bits = (unsigned int)ids[i];
                v.c = E;
            }
            *fnd = v;
            if (pend && fm_pending_claim(pend)) {
                pend->kind = v.kind;
                pend->bits = v.bits;
                pend->a = v.a;
                pend->b = v.b;
                pend->c = v.c;
                pend->d = v.d;
                fm_pending_post(pend);
            }
        }
    }
}

__global__ void perm_place_kernel(const int32_t *__restrict__ ids, int64_t n, int E, int64_t ch, int64_t nchunk,
                                  const uint32_t *__restrict__ base, const int *flag, int32_t *__restrict__ slot_rows,
                                  int32_t *__restrict__ row_map)
{
    extern __shared__ uint32_t perm_sh[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t c = (int64_t)blockIdx.x * (blockDim.x >> 5) + w;
    if (c >= nchunk)
        return;
    const int64_t s1 = c * ch + ch < n ? c * ch + ch : n;
    if (*flag) { /* a flagged call places nothing */
        for (int64_t s = c * ch + lane; s < s1; s += 32)
            slot_rows[s] = -1;
        return;
    }
    uint32_t *run = perm_sh + (int64_t)w * E;
    for (int e = lane; e < E; e += 32)
        run[e] = base[(uint32_t)e * (uint32_t)(nchunk + 1) + (uint32_t)c];
    __syncwarp();
    const unsigned below = (1u << lane) - 1u;
    for (int64_t s0 = c * ch; s0 < s1; s0 += 32) {
        const int64_t s = s0 + lane;
        const int e = s < s1 ? ids[s] : -1;
        const unsigned peers = __match_any_sync(0xFFFFFFFFu, e);
        uint32_t row = 0;
        if (e >= 0) {
            row = run[e] + __popc(peers & below);
            slot_rows[s] = (int32_t)row;
            row_map[row] = (int32_t)s;
        } else if (s < s1) {
            slot_rows[s] = -1; /* a dropped slot */
        }
        __syncwarp();
        if (e >= 0 && (peers & below) == 0)
            run[e] = row + __popc(peers);
        __syncwarp();
    }
}

#define PERM_MOVE_THREADS 128
#define PERM_UNROLL 4

/* What the moving kernel needs: the rows, the scatter's slot rows, and the
 * fill's segment bounds from perm_offsets_kernel. */
typedef struct perm_move {
    const uint8_t *x, *xs;       /* [T, rb] codes, [T, sb] compact scales */
    const int32_t *slot_rows;
    const float *probs;
    uint8_t *out, *outs;
    float *out_probs;
    int32_t *row_map;
    const uint32_t *off, *padbeg; /* each expert's first row and first padding row */
    const int64_t *need;
    const int *flag;
    int64_t T, k, rb, sb, R;
    int E, vec, svec, fvec, e8;
    unsigned fill_blocks;
} perm_move;

/* Token t's row of codes and scales, read once, written to each of its
 * slots' rows. */
FM_DI void perm_scatter_row(const perm_move &p, int64_t t)
{
    const int32_t *dst = p.slot_rows + t * p.k;
    const int64_t k = p.k, rb = p.rb, sb = p.sb;
    int any = 0;
    for (int64_t j = 0; j < k; j++)
        any |= dst[j] >= 0;
    if (!any)
        return; /* every choice dropped: nothing reads this row */
    const int tid = threadIdx.x;
    if (p.vec) {
        const uint4 *src = (const uint4 *)(p.x + t * rb);
        const int64_t n16 = rb / 16;
        for (int64_t i0 = 0; i0 < n16; i0 += PERM_UNROLL * PERM_MOVE_THREADS) {
            uint4 v[PERM_UNROLL];
#pragma unroll
            for (int u = 0; u < PERM_UNROLL; u++) {
                const int64_t i = i0 + u * PERM_MOVE_THREADS + tid;
                if (i < n16)
                    v[u] = __ldcs(src + i);
            }
            for (int64_t j = 0; j < k; j++) {
                const int32_t d = dst[j];
                if (d < 0)
                    continue;
                uint4 *o = (uint4 *)(p.out + (int64_t)d * rb);
#pragma unroll
                for (int u = 0; u < PERM_UNROLL; u++) {
                    const int64_t i = i0 + u * PERM_MOVE_THREADS + tid;
                    if (i < n16)
                        o[i] = v[u];
                }
            }
        }
    } else {
        const uint8_t *src = p.x + t * rb;
        for (int64_t i = tid; i < rb; i += PERM_MOVE_THREADS) {
            const uint8_t v = src[i];
            for (int64_t j = 0; j < k; j++)
                if (dst[j] >= 0)
                    p.out[(int64_t)dst[j] * rb + i] = v;
        }
    }
    if (sb) {
        if (p.svec) {
            const uint32_t *ss = (const uint32_t *)(p.xs + t * sb);
            for (int64_t i = tid; i < sb / 4; i += PERM_MOVE_THREADS) {
                const uint32_t v = ss[i];
                for (int64_t j = 0; j < k; j++)
                    if (dst[j] >= 0)
                        ((uint32_t *)(p.outs + (int64_t)dst[j] * sb))[i] = v;
            }
        } else {
            const uint8_t *ss = p.xs + t * sb;
            for (int64_t i = tid; i < sb; i += PERM_MOVE_THREADS) {
                const uint8_t v = ss[i];
                for (int64_t j = 0; j < k; j++)
                    if (dst[j] >= 0)
                        p.outs[(int64_t)dst[j] * sb + i] = v;
            }
        }
    }
    if (p.out_probs)
        for (int64_t j = tid; j < k; j += PERM_MOVE_THREADS)
            if (dst[j] >= 0)
                p.out_probs[dst[j]] = p.probs[t * k + j];
}

/* The rows no slot took: zero codes, scale 1 (E8M0 127), prob 0, row_map
 * -1. They are known without looking: segment y < E is expert y's padding,
 * from its first padding row to the next expert's offset (the need, for the
 * last), segment E the rows past the need (every row of a flagged call);
 * fill block f of F takes rows f, f + F, ... of each. */
FM_DI void perm_fill_rows(const perm_move &p, unsigned f, unsigned F)
{
    const int tid = threadIdx.x;
    const bool flagged = *p.flag != 0;
    const int64_t rb = p.rb, sb = p.sb;
    for (int y = 0; y <= p.E; y++) {
        int64_t a, b;
        if (y == p.E) {
            a = flagged ? 0 : *p.need;
            b = p.R;
        } else {
            a = flagged ? 0 : p.padbeg[y];
            b = flagged ? 0 : y + 1 < p.E ? p.off[y + 1] : *p.need;
        }
        for (int64_t r = a + f; r < b; r += F) {
            uint8_t *d = p.out + r * rb;
            if (p.fvec) {
                for (int64_t i = tid; i < rb / 16; i += PERM_MOVE_THREADS)
                    ((uint4 *)d)[i] = make_uint4(0, 0, 0, 0);
            } else {
                for (int64_t i = tid; i < rb; i += PERM_MOVE_THREADS)
                    d[i] = 0;
            }
            if (sb) {
                uint8_t *sd = p.outs + r * sb;
                if (p.e8) {
                    for (int64_t i = tid; i < sb; i += PERM_MOVE_THREADS)
                        sd[i] = 127;
                } else {
                    for (int64_t i = tid; i < sb / 4; i += PERM_MOVE_THREADS)
                        ((float *)sd)[i] = 1.0f;
                }
            }
            if (tid == 0) {
                p.row_map[r] = -1;
                if (p.out_probs)
                    p.out_probs[r] = 0.0f;
            }
        }
    }
}

/* Steps 4 and 5 in one launch, so that the fill runs beside the scatter
 * instead of after it: the first fill_blocks blocks fill, the next T
 * scatter a token each. Their rows are disjoint. 16 blocks an SM: the
 * full 2048 threads, 32 registers (without the bound ptxas took 40 and
 * spilled). */
__global__ void __launch_bounds__(PERM_MOVE_THREADS, 16) perm_move_kernel(const perm_move p)
{
    if (blockIdx.x < p.fill_blocks)
        perm_fill_rows(p, blockIdx.x, p.fill_blocks);
    else
        perm_scatter_row(p, (int64_t)(blockIdx.x - p.fill_blocks));
}

extern "C" fm_status fm_cuda_moe_permute(fm_context *ctx, const fm_permute_config *cfg, const fm_tensor *x,
                                         const fm_tensor *expert_ids, const fm_tensor *probs, fm_tensor *out,
                                         fm_tensor *row_map, fm_tensor *slot_rows, fm_tensor *splits,
                                         fm_tensor *out_probs, int64_t *host_splits)
{
    int64_t T = x->shape[0], H = x->shape[1], k = expert_ids->shape[1], E = splits->shape[1], R = out->shape[0];
    int64_t n = T * k, pad = cfg->pad_multiple > 1 ? cfg->pad_multiple : 1;
    const int wpb = perm_warps(E);
    const size_t shm = (size_t)wpb * (size_t)E * 4;
    if (shm > fm_cuda(ctx)->prop.sharedMemPerBlockOptin)
        return fm_error(ctx, FM_ERR_UNSUPPORTED,
                        "splits: %lld experts need %zu bytes of shared memory for the CUDA permute's counters, more "
                        "than this device's %zu",
                        (long long)E, shm, (size_t)fm_cuda(ctx)->prop.sharedMemPerBlockOptin);
    const int64_t ch = perm_chunk(E), nchunk = fm_cdiv(n, ch);
    /* perm_offsets_kernel's 32-bit (expert, chunk) indices and row sums */
    if ((nchunk + 1) * E >= ((int64_t)1 << 32) || n + E * pad >= ((int64_t)1 << 32))
        return fm_error(ctx, FM_ERR_UNSUPPORTED,
                        "expert_ids: %lld slots over %lld experts padded to %lld rows are more than the CUDA permute "
                        "ranks in one call (2^32 rows)",
                        (long long)n, (long long)E, (long long)pad);
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_moe_permute");
    if (st)
        return st;
    int64_t rb = x->dtype == FM_DTYPE_E2M1 ? H / 2 : H * (fm_dtype_bits(x->dtype) / 8);
    int64_t sb = x->scale_mode == FM_SCALE_NONE
                     ? 0
                     : fm_cdiv(H, fm_mode_block_cols(x->scale_mode)) * (fm_dtype_bits(x->scale_dtype) / 8);
    cudaStream_t s = fm_cuda_stream(ctx);
    /* scratch: E totals, the needed row count, the flag, the first bad slot
     * (complemented), E first padding rows and E offsets (32-bit), the
     * finding (64 bytes), then the per-chunk counts / first rows,
     * [E][nchunk + 1]; the head is zeroed */
    const size_t head = (size_t)E * 16 + 16 + 64;
    size_t bytes = head + (size_t)(nchunk + 1) * (size_t)E * 4;
    void *scr;
    int owned;
    if ((st = fm_cuda_scratch(ctx, bytes, &scr, &owned, "fm_moe_permute"))) {
        fm_cuda_leave(ctx, &g, cudaSuccess, "fm_moe_permute");
        return st;
    }
    unsigned long long *cnt = (unsigned long long *)scr;
    int64_t *need = (int64_t *)((uint8_t *)scr + E * 8);
    int *flag = (int *)(need + 1);
    uint32_t *first_bad = (uint32_t *)(flag + 1);
    uint32_t *padbeg = (uint32_t *)((uint8_t *)scr + E * 8 + 16), *off = padbeg + E;
    fm_cuda_pending *fnd = (fm_cuda_pending *)(off + E);
    static_assert(sizeof(fm_cuda_pending) <= 64, "the finding's place in the scratch head");
    uint32_t *hist = (uint32_t *)((uint8_t *)scr + head);
    cudaError_t err = cudaMemsetAsync(scr, 0, head, s);
    if (err == cudaSuccess && shm > PERM_SMEM) {
        err = cudaFuncSetAttribute(perm_hist_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm);
        if (err == cudaSuccess)
            err = cudaFuncSetAttribute(perm_place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm);
    }
    if (err == cudaSuccess) {
        const unsigned cb = (unsigned)fm_cdiv(nchunk, wpb);
        if (n > 0)
            perm_hist_kernel<<<cb, 32 * wpb, shm, s>>>((const int32_t *)expert_ids->data, n, (int)E, ch, nchunk,
                                                       hist, cnt, flag, first_bad);
        perm_offsets_kernel<<<1, PERM_SCAN_THREADS, 0, s>>>(cnt, off, padbeg, (int)E, pad, R,
                                                            (int64_t *)splits->data, flag, need, hist, nchunk,
                                                            (const int32_t *)expert_ids->data, k,
                                                            n + E * (pad - 1), first_bad, fnd,
                                                            host_splits ? NULL : fm_cuda(ctx)->pending);
        if (n > 0)
            perm_place_kernel<<<cb, 32 * wpb, shm, s>>>((const int32_t *)expert_ids->data, n, (int)E, ch, nchunk,
                                                        hist, flag, (int32_t *)slot_rows->data, (int32_t *)row_map->data);
        perm_move p;
        p.x = (const uint8_t *)x->data;
        p.xs = (const uint8_t *)x->scale;
        p.slot_rows = (const int32_t *)slot_rows->data;
        p.probs = probs ? (const float *)probs->data : NULL;
        p.out = (uint8_t *)out->data;
        p.outs = (uint8_t *)out->scale;
        p.out_probs = out_probs ? (float *)out_probs->data : NULL;
        p.row_map = (int32_t *)row_map->data;
        p.off = off;
        p.padbeg = padbeg;
        p.need = need;
        p.flag = flag;
        p.T = n > 0 ? T : 0; /* no slots: nothing to scatter */
        p.k = k;
        p.rb = rb;
        p.sb = sb;
        p.R = R;
        p.E = (int)E;
        p.vec = rb % 16 == 0 && ((uintptr_t)x->data % 16) == 0 && ((uintptr_t)out->data % 16) == 0;
        p.svec = sb % 4 == 0 && ((uintptr_t)x->scale % 4) == 0 && ((uintptr_t)out->scale % 4) == 0;
        p.fvec = rb % 16 == 0 && ((uintptr_t)out->data % 16) == 0;
        p.e8 = x->scale_dtype == FM_DTYPE_E8M0;
        /* two fill blocks an SM: the padding is at most E (pad - 1) rows
         * plus the rows past the need, small next to the scatter */
        p.fill_blocks = R > 0 ? (unsigned)(2 * fm_cuda(ctx)->prop.multiProcessorCount) : 0;
        if (p.T + p.fill_blocks > 0)
            perm_move_kernel<<<(unsigned)(p.T + p.fill_blocks), PERM_MOVE_THREADS, 0, s>>>(p);
        err = cudaGetLastError();
    }
    /* the finding comes back through the context's pinned buffer */
    fm_cuda_pending *h = (fm_cuda_pending *)fm_cuda(ctx)->host_small;
    h->state = 0;
    if (err == cudaSuccess && host_splits) {
        err = cudaMemcpyAsync(host_splits, splits->data, (size_t)E * 8, cudaMemcpyDeviceToHost, s);
        if (err == cudaSuccess)
            err = cudaMemcpyAsync(h, fnd, sizeof *h, cudaMemcpyDeviceToHost, s);
        if (err == cudaSuccess)
            err = cudaStreamSynchronize(s);
    }
    if (owned) {
        cudaError_t e2 = cudaFreeAsync(scr, s);
        if (err == cudaSuccess)
            err = e2;
    }
    if ((st = fm_cuda_leave(ctx, &g, err, "fm_moe_permute")))
        return st;
    return fm_cuda_pending_report(ctx, h);
}
