/* How fast can DRAM serve a byte transpose's access pattern on this GPU, with
 * no arithmetic at all? Each CTA streams tiles through shared memory with TMA
 * only: a box of BH rows x BW bytes of the [R, C] input in, the same bytes out
 * as a box of BW rows x BH bytes at the transposed place of the [C, R] output
 * (the codes land untransposed inside the box: only the addresses matter
 * here). So a transpose kernel with tiles of BH x BW cannot beat its line, and
 * the "copy" lines (the box stored where it was read) show what the tile walk
 * alone costs. Prints each line's time and its share of a device-to-device
 * cudaMemcpy of the same bytes measured in the same run (bytes read +
 * written, as fm-bench counts them). The last lines pass the codes through
 * 8 consumer warps' registers, as rq_fp8t_tma_kernel does, and store them
 * three ways: 8-byte st.global pieces of 128-byte runs (the kernel's way),
 * a shared staging buffer sent whole by one TMA store after a CTA barrier,
 * or each warp's 16 staged rows sent by the warp itself (one TMA store, or
 * a bulk copy a row); with plain or swizzled (conflict-free) loads.
 * notes/transpose_scaled.md (twenty-fourth and thirty-third sessions) has
 * what it measured.
 * Not built by meson (a diagnostic for a GPU machine):
 *   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -o transpose-floor \
 *        tools/transpose-floor.cu && ./transpose-floor [R C] */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "../backends/cuda/sm90.cuh"

#define CK(x)                                                                                                  \
    do {                                                                                                       \
        cudaError_t e_ = (x);                                                                                  \
        if (e_ != cudaSuccess) {                                                                               \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));                      \
            exit(1);                                                                                           \
        }                                                                                                      \
    } while (0)

__device__ static __forceinline__ void tma_store_2d(const CUtensorMap *map, const void *src, int c0, int c1)
{
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"((uint64_t)map),
                 "r"(sm90_sa(src)), "r"(c0), "r"(c1)
                 : "memory");
}

/* One thread a CTA streams its tiles through S stages, S - 1 loads ahead of
 * the store. The tile walk is tile columns fastest (cols_first) or tile rows
 * fastest. */
#define MAXS 4
__global__ void __launch_bounds__(32) tma_pattern(const __grid_constant__ CUtensorMap in,
                                                  const __grid_constant__ CUtensorMap out, int S, int BH, int BW,
                                                  int ntr, int ntc, int transpose, int cols_first)
{
    extern __shared__ uint8_t dyn[];
    __shared__ uint64_t full[MAXS];
    if (threadIdx.x != 0)
        return;
    uint8_t *base = dyn + ((1024u - (sm90_sa(dyn) & 1023u)) & 1023u);
    const int bytes = BH * BW, n = ntr * ntc;
    const int cnt = n > (int)blockIdx.x ? (n - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x : 0;
    for (int s = 0; s < S; s++)
        sm90_bar_init(&full[s], 1);
    sm90_bar_init_fence();
    int tr[MAXS], tc[MAXS];
#define PLACE(j)                                                                                    \
    do {                                                                                            \
        const int t_ = (int)blockIdx.x + (j) * (int)gridDim.x, s_ = (j) % S;                        \
        tr[s_] = cols_first ? t_ / ntc : t_ % ntr;                                                  \
        tc[s_] = cols_first ? t_ % ntc : t_ / ntr;                                                  \
    } while (0)
#define LOAD(j)                                                                                     \
    do {                                                                                            \
        PLACE(j);                                                                                   \
        sm90_bar_expect(&full[(j) % S], bytes);                                                     \
        sm90_tma_load_2d(base + ((j) % S) * bytes, &in, &full[(j) % S], tc[(j) % S] * BW, tr[(j) % S] * BH); \
    } while (0)
    for (int j = 0; j < S - 1 && j < cnt; j++)
        LOAD(j);
    for (int i = 0; i < cnt; i++) {
        const int s = i % S;
        sm90_bar_wait(&full[s], (i / S) & 1);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        if (transpose)
            tma_store_2d(&out, base + s * bytes, tr[s] * BH, tc[s] * BW);
        else
            tma_store_2d(&out, base + s * bytes, tc[s] * BW, tr[s] * BH);
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        const int j = i + S - 1;
        if (j < cnt) {
            /* stage j % S was read by tile i - 1's store: all but the newest group done reading */
            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            LOAD(j);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

/* The register patterns' shared parts: barrier set-up, the producer (lane 0
 * of warp 8 streams BH-row boxes through S stages), and a consumer lane's
 * 8 pieces of 8 bytes of half h of a stage: plain addresses (bank
 * conflicts), or with swz a 128-byte swizzled box read in
 * rq_fp8t_tma_kernel's conflict-free order (rows permuted: only the
 * addresses matter here). */
__device__ static void init_bars(uint64_t *full, uint64_t *empty, int S)
{
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++) {
            sm90_bar_init(&full[s], 1);
            sm90_bar_init(&empty[s], 8);
        }
        sm90_bar_init_fence();
    }
    __syncthreads();
}

__device__ static void produce(const CUtensorMap *in, uint8_t *base, uint64_t *full, uint64_t *empty, int S, int BH,
                               int ntr, int ntc, int cols_first)
{
    if ((threadIdx.x & 31) != 0)
        return;
    const int n = ntr * ntc;
    int i = 0;
    for (int t = blockIdx.x; t < n; t += gridDim.x, i++) {
        const int s = i % S;
        if (i >= S)
            sm90_bar_wait(&empty[s], ((i / S) & 1) ^ 1);
        const int tr = cols_first ? t / ntc : t % ntr, tc = cols_first ? t % ntc : t / ntr;
        sm90_bar_expect(&full[s], BH * 128);
        sm90_tma_load_2d(base + s * BH * 128, in, &full[s], tc * 128, tr * BH);
    }
}

__device__ static __forceinline__ void take(const uint8_t *stage, uint64_t *empty, int h, int last, int swz,
                                            uint2 v[8])
{
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, rg = lane >> 1, cg = lane & 1, m = rg & 7;
    const uint32_t lane_off = 1024u * rg + 8u * cg + 128u * m + 16u * (w ^ m);
#pragma unroll
    for (int j = 0; j < 8; j++)
        v[j] = *(const uint2 *)(stage + (swz ? 16384 * h + (lane_off ^ (144u * j))
                                             : (128 * h + 8 * rg + j) * 128 + 16 * w + 8 * cg));
    __syncwarp();
    if (lane == 0 && last)
        sm90_bar_arrive(empty); /* the stage is handed back after its last half */
}

/* The store side of the library's TMA transpose: the same loads, but 8
 * consumer warps take each stage and store it with 8-byte st.global pieces
 * at the transposed place (lane l of warp w: output rows 16 w + 8 (l % 2) +
 * j, bytes 8 (l / 2) .. + 7 of the tile's run; a warp's store covers two
 * 128-byte output runs), as rq_fp8t_tma_kernel does. BH 256: a box of two
 * tiles' rows, the second half's runs stored right after the first's. */
template <int BH>
__global__ void __launch_bounds__(288) reg_store_pattern(const __grid_constant__ CUtensorMap in, uint8_t *out,
                                                         long R, int ntr, int ntc, int cols_first, int swz)
{
    extern __shared__ uint8_t dyn[];
    __shared__ uint64_t full[MAXS], empty[MAXS];
    uint8_t *base = dyn + ((1024u - (sm90_sa(dyn) & 1023u)) & 1023u);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, n = ntr * ntc, S = BH == 128 ? MAXS : 2;
    init_bars(full, empty, S);
    if (w == 8)
        return produce(&in, base, full, empty, S, BH, ntr, ntc, cols_first);
    const int rg = lane >> 1, cg = lane & 1;
    int i = 0;
    for (int t = blockIdx.x; t < n; t += gridDim.x, i++) {
        const int s = i % S;
        sm90_bar_wait(&full[s], (i / S) & 1);
        const int tr = cols_first ? t / ntc : t % ntr, tc = cols_first ? t % ntc : t / ntr;
        for (int h = 0; h < BH / 128; h++) {
            uint2 v[8];
            take(base + s * BH * 128, &empty[s], h, h == BH / 128 - 1, swz, v);
            uint8_t *o = out + (long)(tc * 128 + 16 * w + 8 * cg) * R + tr * BH + 128 * h + 8 * rg;
#pragma unroll
            for (int j = 0; j < 8; j++)
                __stcs((uint2 *)(o + (long)j * R), v[j]);
        }
    }
}

/* As reg_store_pattern (BH-row boxes in 2 stages), but the consumers write
 * their pieces into a staging buffer of 128 rows x BH bytes in shared
 * memory at the transposed place, and send it three ways:
 *  - MODE 0: one thread sends the whole buffer with one TMA store after a
 *    named barrier of the 8 consumer warps. With NB = 2 buffers it first
 *    waits until the store before has read the other one, so one barrier a
 *    box does; with 1, a second barrier keeps the next box's writes off the
 *    buffer until the store has read it.
 *  - MODE 1, 2: no CTA barrier; each warp sends its own 16 rows once its
 *    lanes have written them, as one TMA store of a BH x 16 box (1) or as
 *    16 one-dimensional bulk copies of BH bytes, one a lane (2: no tensor
 *    map, so any row pitch). */
template <int BH, int NB, int MODE>
__global__ void __launch_bounds__(288) staged_pattern(const __grid_constant__ CUtensorMap in,
                                                      const __grid_constant__ CUtensorMap out, uint8_t *outp, long R,
                                                      int ntr, int ntc, int cols_first, int swz)
{
    extern __shared__ uint8_t dyn[];
    __shared__ uint64_t full[MAXS], empty[MAXS];
    uint8_t *base = dyn + ((1024u - (sm90_sa(dyn) & 1023u)) & 1023u);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, n = ntr * ntc, S = 2;
    uint8_t *stage_out = base + S * BH * 128;
    init_bars(full, empty, S);
    if (w == 8)
        return produce(&in, base, full, empty, S, BH, ntr, ntc, cols_first);
    const int rg = lane >> 1, cg = lane & 1;
    /* the threads that send (and so wait for their own sends) */
    const bool issuer = MODE == 0 ? threadIdx.x == 0 : MODE == 1 ? lane == 0 : lane < 16;
    int i = 0;
    for (int t = blockIdx.x; t < n; t += gridDim.x, i++) {
        const int s = i % S;
        uint8_t *so = stage_out + (i % NB) * BH * 128;
        sm90_bar_wait(&full[s], (i / S) & 1);
        const int tr = cols_first ? t / ntc : t % ntr, tc = cols_first ? t % ntc : t / ntr;
        if (MODE == 0 && NB == 1 && i > 0) {
            if (issuer)
                asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            asm volatile("bar.sync 1, 256;" ::: "memory");
        } else if (MODE != 0 && i >= NB) {
            if (issuer && NB == 1)
                asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            else if (issuer)
                asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            __syncwarp();
        }
        for (int h = 0; h < BH / 128; h++) {
            uint2 v[8];
            take(base + s * BH * 128, &empty[s], h, h == BH / 128 - 1, swz, v);
#pragma unroll
            for (int j = 0; j < 8; j++)
                *(uint2 *)(so + (16 * w + 8 * cg + j) * BH + 128 * h + 8 * rg) = v[j];
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        if (MODE == 0) {
            if (NB > 1 && issuer)
                asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            asm volatile("bar.sync 1, 256;" ::: "memory");
        } else
            __syncwarp();
        if (issuer) {
            if (MODE == 0)
                tma_store_2d(&out, so, tr * BH, tc * 128);
            else if (MODE == 1)
                tma_store_2d(&out, so + 16 * w * BH, tr * BH, tc * 128 + 16 * w);
            else
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                                 outp + (long)(tc * 128 + 16 * w + lane) * R + (long)tr * BH),
                             "r"(sm90_sa(so + (16 * w + lane) * BH)), "r"(BH)
                             : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
    }
    if (issuer)
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

static CUtensorMap map2d(void *p, long inner, long outer, int box_inner, int box_outer, int swz = 0)
{
    CUtensorMap m;
    const cuuint64_t dims[2] = {(cuuint64_t)inner, (cuuint64_t)outer};
    const cuuint64_t strides[1] = {(cuuint64_t)inner};
    const cuuint32_t box[2] = {(cuuint32_t)box_inner, (cuuint32_t)box_outer}, es[2] = {1, 1};
    if (sm90_tensor_map_encoder()(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, p, dims, strides, box, es,
                                  CU_TENSOR_MAP_INTERLEAVE_NONE, swz ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        fprintf(stderr, "tensor map %ld x %ld, box %d x %d refused\n", inner, outer, box_inner, box_outer);
        exit(1);
    }
    return m;
}

static float median(float *v, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            float t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return v[n / 2];
}

static const int reps = 21;
static cudaEvent_t e0, e1;

/* Median time of launch() in ms over reps runs, after two warm-up runs. */
template <typename F>
static float time_ms(F launch)
{
    float ts[reps];
    for (int r = 0; r < reps + 2; r++) {
        CK(cudaEventRecord(e0));
        launch();
        CK(cudaGetLastError());
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        if (r >= 2)
            CK(cudaEventElapsedTime(&ts[r - 2], e0, e1));
    }
    return median(ts, reps);
}

int main(int argc, char **argv)
{
    const long R = argc > 2 ? atol(argv[1]) : 32768, C = argc > 2 ? atol(argv[2]) : 7168;
    const size_t n = (size_t)R * C;
    uint8_t *a, *b;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    CK(cudaMemset(a, 1, n));
    CK(cudaMemset(b, 2, n));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const float copy_ms = time_ms([&] { CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice)); });
    printf("# %s, [%ld, %ld] bytes; copy %.1f us = %.1f GB/s (read + written)\n", prop.name, R, C, copy_ms * 1e3,
           2.0 * n / (copy_ms * 1e-3) / 1e9);
    printf("| pattern | box BH x BW | walk | stages | CTAs/SM | us | of copy |\n|---|---|---|---:|---:|---:|---:|\n");
    const int shapes[][2] = {{128, 128}, {256, 128}, {128, 256}, {256, 256}, {64, 256}, {256, 64}};
    for (int transpose = 1; transpose >= 0; transpose--)
        for (const auto &sh : shapes)
            for (int cf = 1; cf >= 0; cf--) {
                const int BH = sh[0], BW = sh[1];
                if (R % BH || C % BW)
                    continue;
                const CUtensorMap mi = map2d(a, C, R, BW, BH);
                const CUtensorMap mo = transpose ? map2d(b, R, C, BH, BW) : map2d(b, C, R, BW, BH);
                const int S = BH * BW * MAXS <= 160 * 1024 ? MAXS : 3;
                const size_t smem = 1024 + (size_t)S * BH * BW;
                CK(cudaFuncSetAttribute(tma_pattern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
                int per = 0;
                CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, tma_pattern, 32, smem));
                const int ntr = (int)(R / BH), ntc = (int)(C / BW);
                const int grid = per * sms < ntr * ntc ? per * sms : ntr * ntc;
                const float ms =
                    time_ms([&] { tma_pattern<<<grid, 32, smem>>>(mi, mo, S, BH, BW, ntr, ntc, transpose, cf); });
                printf("| %s | %d x %d | %s | %d | %d | %.1f | %.1f%% |\n", transpose ? "transpose" : "copy", BH, BW,
                       cf ? "cols first" : "rows first", S, per, ms * 1e3, 100.0 * copy_ms / ms);
            }
    for (int swz = 0; swz <= 1; swz++)
    for (int bh = 128; bh <= 256; bh += 128)
        for (int cf = 1; cf >= 0; cf--) {
            if (R % bh)
                continue;
            void (*k)(CUtensorMap, uint8_t *, long, int, int, int, int) =
                bh == 128 ? reg_store_pattern<128> : reg_store_pattern<256>;
            const CUtensorMap mi = map2d(a, C, R, 128, bh, swz);
            const int S = bh == 128 ? MAXS : 2; /* as the kernel: 4 tiles a CTA in flight either way */
            const size_t smem = 1024 + (size_t)S * bh * 128;
            CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
            int per = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, k, 288, smem));
            const int ntr = (int)(R / bh), ntc = (int)(C / 128);
            const int grid = per * sms < ntr * ntc ? per * sms : ntr * ntc;
            const float ms = time_ms([&] { k<<<grid, 288, smem>>>(mi, b, R, ntr, ntc, cf, swz); });
            printf("| transpose, 8-byte register stores%s | %d x 128 | %s | %d | %d | %.1f | %.1f%% |\n",
                   swz ? ", swizzled loads" : "", bh, cf ? "cols first" : "rows first", S, per, ms * 1e3,
                   100.0 * copy_ms / ms);
        }
    /* the staged patterns: MODE 0 with plain and swizzled loads, both walks;
     * the per-warp modes with swizzled loads, tile columns fastest */
    for (int mode = 0; mode <= 2; mode++)
        for (int swz = mode ? 1 : 0; swz <= 1; swz++)
            for (int bh = mode ? 256 : 128; bh <= 256; bh += 128)
                for (int nb = 1; nb <= 2; nb++)
                    for (int cf = 1; cf >= (mode ? 1 : 0); cf--) {
                        if (R % bh)
                            continue;
                        void (*k)(CUtensorMap, CUtensorMap, uint8_t *, long, int, int, int, int) =
                            bh == 128 ? (nb == 1 ? staged_pattern<128, 1, 0> : staged_pattern<128, 2, 0>)
                            : mode == 0 ? (nb == 1 ? staged_pattern<256, 1, 0> : staged_pattern<256, 2, 0>)
                            : mode == 1 ? (nb == 1 ? staged_pattern<256, 1, 1> : staged_pattern<256, 2, 1>)
                                        : (nb == 1 ? staged_pattern<256, 1, 2> : staged_pattern<256, 2, 2>);
                        const CUtensorMap mi = map2d(a, C, R, 128, bh, swz),
                                          mo = map2d(b, R, C, bh, mode == 1 ? 16 : 128);
                        const size_t smem = 1024 + (size_t)(2 + nb) * bh * 128;
                        CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
                        int per = 0;
                        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, k, 288, smem));
                        const int ntr = (int)(R / bh), ntc = (int)(C / 128);
                        const int grid = per * sms < ntr * ntc ? per * sms : ntr * ntc;
                        const float ms = time_ms([&] { k<<<grid, 288, smem>>>(mi, mo, b, R, ntr, ntc, cf, swz); });
                        static const char *how[] = {"one TMA store a box", "a TMA store of 16 rows a warp",
                                                    "16 bulk copies of a row a warp"};
                        printf("| transpose, staged in shared, %s (%d buffer%s)%s | %d x 128 | %s | 2 | %d | %.1f | "
                               "%.1f%% |\n",
                               how[mode], nb, nb > 1 ? "s" : "", swz ? ", swizzled loads" : "", bh,
                               cf ? "cols first" : "rows first", per, ms * 1e3, 100.0 * copy_ms / ms);
                    }
    return 0;
}
