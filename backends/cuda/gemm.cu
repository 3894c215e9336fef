/* CUDA GEMMs through cuBLASLt (sm_90): dense, m-grouped and k-grouped.
 *
 * Row-major D [M, N] = A [M, K] · B [N, K]ᵀ is, in cuBLASLt's column-major
 * terms, Dᵀ [N, M] = B · Aᵀ: cuBLASLt's A is our B (transa = T for K
 * contiguous), its B is our A (transb = N), m = N, n = M. FP8 operands are
 * always K contiguous (core checks), so FP8 runs in the TN form Hopper needs.
 *
 * Scales: TENSOR -> SCALAR_32F, ROW -> OUTER_VEC_32F, BLOCK_1x128 ->
 * VEC128_32F, BLOCK_128x128 -> BLK128x128_32F. The GEMM scale layout of
 * format.h is the one these modes read; COMPACT scales, and slices of a
 * grouped A, are repacked into scratch by a small kernel first.
 *
 * Grouped: one cuBLASLt call per non-empty expert, spread over side streams
 * forked from the context stream with an event and joined back with events,
 * each stream with its own part of the workspace. No host synchronisation.
 *
 * FP8 products the native sm_90a kernel takes (grouped_gemm_sm90.cu) go there
 * when cfg->impl says NATIVE, or says AUTO and the kernel measured faster
 * (pick_native below). */
#include <stdlib.h>
#include <string.h>

#include "cuda.h"

#define GEMM_CACHE 32
#define GEMM_STREAMS 4
#define LT_WS_DENSE ((size_t)32 << 20)
#define LT_WS_GROUPED ((size_t)8 << 20)

/* Everything a matmul plan depends on. */
typedef struct {
    int64_t m, n, k, lda, ldb, ldd;
    int transa, transb;
    int atype, btype, dtype;
    int amode, bmode; /* cuBLASLt scale modes, -1 = unscaled */
    int align_a, align_b, align_d;
    int beta1;
} plan_key;

typedef struct {
    plan_key key;
    int used;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
    size_t ws_need;
    int ws_cap_mb;
} plan;

typedef struct fm_cuda_gemm_state {
    plan plans[GEMM_CACHE];
    int next;
    /* by queue (fm_queue_select): a GEMM on queue 1 never waits behind queue 0's experts */
    cudaStream_t side[2][GEMM_STREAMS];
    cudaEvent_t fork[2], join[2][GEMM_STREAMS];
    int streams_ready;
} gemm_state;

extern "C" void fm_cuda_gemm_destroy(fm_cuda_state *s)
{
    gemm_state *g = (gemm_state *)s->gemm;
    if (!g)
        return;
    for (int i = 0; i < GEMM_CACHE; i++)
        if (g->plans[i].used) {
            cublasLtMatmulDescDestroy(g->plans[i].desc);
            cublasLtMatrixLayoutDestroy(g->plans[i].la);
            cublasLtMatrixLayoutDestroy(g->plans[i].lb);
            cublasLtMatrixLayoutDestroy(g->plans[i].ld);
        }
    if (g->streams_ready)
        for (int q = 0; q < 2; q++) {
            for (int i = 0; i < GEMM_STREAMS; i++) {
                cudaStreamDestroy(g->side[q][i]);
                cudaEventDestroy(g->join[q][i]);
            }
            cudaEventDestroy(g->fork[q]);
        }
    free(g);
    s->gemm = NULL;
}

static fm_status lt_check(fm_context *ctx, cublasStatus_t st, const char *what)
{
    if (st == CUBLAS_STATUS_SUCCESS)
        return FM_OK;
    return fm_error(ctx, st == CUBLAS_STATUS_ALLOC_FAILED ? FM_ERR_OUT_OF_MEMORY : FM_ERR_BACKEND,
                    "%s: cuBLASLt error %d (%s)", what, (int)st, cublasLtGetStatusString(st));
}

static gemm_state *state(fm_context *ctx)
{
    fm_cuda_state *s = fm_cuda(ctx);
    if (!s->gemm)
        s->gemm = calloc(1, sizeof(gemm_state));
    return (gemm_state *)s->gemm;
}

static int lt_mode(fm_scale_mode m)
{
    switch (m) {
    case FM_SCALE_TENSOR: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case FM_SCALE_ROW: return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    case FM_SCALE_BLOCK_1x128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case FM_SCALE_BLOCK_128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    default: return -1;
    }
}

static cudaDataType_t lt_type(fm_dtype d)
{
    switch (d) {
    case FM_DTYPE_E4M3: return CUDA_R_8F_E4M3;
    case FM_DTYPE_E5M2: return CUDA_R_8F_E5M2;
    case FM_DTYPE_BF16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
    }
}

static int ptr_align(const void *p)
{
    uintptr_t u = (uintptr_t)p;
    int a = 256;
    while (a > 1 && (u % (uintptr_t)a))
        a >>= 1;
    return a;
}

/* Plan of one product: from the cache, or built (descriptor, layouts and
 * the heuristic's best algorithm for `ws` bytes of workspace). */
static fm_status get_plan(fm_context *ctx, const plan_key *key, size_t ws, plan **out)
{
    gemm_state *g = state(ctx);
    if (!g)
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_gemm: out of host memory for the plan cache");
    int ws_mb = (int)(ws >> 20);
    for (int i = 0; i < GEMM_CACHE; i++)
        if (g->plans[i].used && g->plans[i].ws_cap_mb == ws_mb && !memcmp(&g->plans[i].key, key, sizeof *key)) {
            *out = &g->plans[i];
            return FM_OK;
        }
    plan *p = &g->plans[g->next];
    g->next = (g->next + 1) % GEMM_CACHE;
    if (p->used) {
        cublasLtMatmulDescDestroy(p->desc);
        cublasLtMatrixLayoutDestroy(p->la);
        cublasLtMatrixLayoutDestroy(p->lb);
        cublasLtMatrixLayoutDestroy(p->ld);
    }
    memset(p, 0, sizeof *p);
    fm_status st;
    cublasLtMatmulPreference_t pref = NULL;
    cublasOperation_t ta = key->transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = key->transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    /* column-major stored shapes of cuBLASLt's A (our B) and B (our A) */
    uint64_t ar = key->transa ? key->k : key->m, ac = key->transa ? key->m : key->k;
    uint64_t br = key->transb ? key->n : key->k, bc = key->transb ? key->k : key->n;
    if ((st = lt_check(ctx, cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                       "cublasLtMatmulDescCreate")))
        return st;
    p->used = 1; /* from here on, destroyed with the entry */
    if ((st = lt_check(ctx, cublasLtMatrixLayoutCreate(&p->la, (cudaDataType_t)key->atype, ar, ac, key->lda),
                       "cublasLtMatrixLayoutCreate(A)")) ||
        (st = lt_check(ctx, cublasLtMatrixLayoutCreate(&p->lb, (cudaDataType_t)key->btype, br, bc, key->ldb),
                       "cublasLtMatrixLayoutCreate(B)")) ||
        (st = lt_check(ctx, cublasLtMatrixLayoutCreate(&p->ld, (cudaDataType_t)key->dtype, key->m, key->n, key->ldd),
                       "cublasLtMatrixLayoutCreate(D)")))
        goto fail;
    if ((st = lt_check(ctx, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta),
                       "CUBLASLT_MATMUL_DESC_TRANSA")) ||
        (st = lt_check(ctx, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb),
                       "CUBLASLT_MATMUL_DESC_TRANSB")))
        goto fail;
    if (key->amode >= 0) {
        int32_t am = key->amode, bm = key->bmode;
        if ((st = lt_check(ctx, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof am),
                           "CUBLASLT_MATMUL_DESC_A_SCALE_MODE")) ||
            (st = lt_check(ctx, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof bm),
                           "CUBLASLT_MATMUL_DESC_B_SCALE_MODE")))
            goto fail;
        /* The heuristic refuses vector scale modes without scale pointers;
         * any device address serves here, each call sets the real ones. */
        const void *any = fm_cuda(ctx)->workspace;
        if ((st = lt_check(ctx, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &any,
                                                               sizeof any),
                           "CUBLASLT_MATMUL_DESC_A_SCALE_POINTER")) ||
            (st = lt_check(ctx, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &any,
                                                               sizeof any),
                           "CUBLASLT_MATMUL_DESC_B_SCALE_POINTER")))
            goto fail;
    }
    {
        uint64_t wsb = ws;
        uint32_t al_a = (uint32_t)key->align_a, al_b = (uint32_t)key->align_b, al_d = (uint32_t)key->align_d;
        if ((st = lt_check(ctx, cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate")))
            goto fail;
        if ((st = lt_check(ctx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                                     &wsb, sizeof wsb),
                           "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES")) ||
            (st = lt_check(ctx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                                     &al_a, sizeof al_a),
                           "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES")) ||
            (st = lt_check(ctx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                                     &al_b, sizeof al_b),
                           "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES")) ||
            (st = lt_check(ctx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                                     &al_d, sizeof al_d),
                           "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES")) ||
            (st = lt_check(ctx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                                     &al_d, sizeof al_d),
                           "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES")))
            goto fail;
        cublasLtMatmulHeuristicResult_t res;
        int found = 0;
        memset(&res, 0, sizeof res);
        cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(fm_cuda(ctx)->lt, p->desc, p->la, p->lb, p->ld, p->ld,
                                                           pref, 1, &res, &found);
        if (hs == CUBLAS_STATUS_NOT_SUPPORTED || (hs == CUBLAS_STATUS_SUCCESS && found == 0)) {
            st = fm_error(ctx, FM_ERR_UNSUPPORTED,
                          "fm_gemm: cuBLASLt has no algorithm for this product (cuBLASLt m %lld n %lld k %lld, "
                          "types %d x %d -> %d, scale modes %d x %d); on Hopper its FP8 kernels want N a multiple "
                          "of 8 and, with block scales, M a multiple of 8 and K of 128 (multiples of 128 always "
                          "work: pad the operands)",
                          (long long)key->m, (long long)key->n, (long long)key->k, key->atype, key->btype,
                          key->dtype, key->amode, key->bmode);
            goto fail;
        }
        if ((st = lt_check(ctx, hs, "cublasLtMatmulAlgoGetHeuristic")))
            goto fail;
        p->algo = res.algo;
        p->ws_need = res.workspaceSize;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    p->key = *key;
    p->ws_cap_mb = ws_mb;
    *out = p;
    return FM_OK;
fail:
    if (pref)
        cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatmulDescDestroy(p->desc);
    if (p->la)
        cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb)
        cublasLtMatrixLayoutDestroy(p->lb);
    if (p->ld)
        cublasLtMatrixLayoutDestroy(p->ld);
    memset(p, 0, sizeof *p);
    return st;
}

/* One operand [rows, K] as cuBLASLt gets it. */
typedef struct {
    const void *data;
    fm_dtype dtype;
    int colwise;      /* stored [K, rows] */
    int64_t ld;
    const float *scale; /* in cuBLASLt's layout */
    fm_scale_mode mode;
} lt_op;

/* D [M, N] (row stride ldd) = A · Bᵀ on `stream` with `ws` bytes of workspace. */
static fm_status lt_matmul(fm_context *ctx, const lt_op *a, const lt_op *b, int64_t M, int64_t N, int64_t K,
                           void *d, fm_dtype ddt, int64_t ldd, int accumulate, cudaStream_t stream, void *ws,
                           size_t ws_bytes)
{
    plan_key key;
    memset(&key, 0, sizeof key);
    key.m = N;
    key.n = M;
    key.k = K;
    key.transa = !b->colwise; /* our B row-wise = column-major [K, N]: transpose to [N, K] */
    key.transb = a->colwise;  /* our A row-wise = column-major [K, M]: as is */
    key.lda = b->ld;
    key.ldb = a->ld;
    key.ldd = ldd;
    key.atype = lt_type(b->dtype);
    key.btype = lt_type(a->dtype);
    key.dtype = lt_type(ddt);
    key.amode = lt_mode(b->mode);
    key.bmode = lt_mode(a->mode);
    key.align_a = ptr_align(b->data);
    key.align_b = ptr_align(a->data);
    key.align_d = ptr_align(d);
    key.beta1 = accumulate;
    plan *p = NULL;
    fm_status st = get_plan(ctx, &key, ws_bytes, &p);
    if (st)
        return st;
    if (key.amode >= 0) {
        /* cuBLASLt's A is our B: its scale goes to A_SCALE_POINTER. */
        const void *sa = b->scale, *sb = a->scale;
        if ((st = lt_check(ctx, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa),
                           "CUBLASLT_MATMUL_DESC_A_SCALE_POINTER")) ||
            (st = lt_check(ctx, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb),
                           "CUBLASLT_MATMUL_DESC_B_SCALE_POINTER")))
            return st;
    }
    float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    return lt_check(ctx,
                    cublasLtMatmul(fm_cuda(ctx)->lt, p->desc, &alpha, b->data, p->la, a->data, p->lb, &beta, d, p->ld,
                                   d, p->ld, &p->algo, ws, ws_bytes, stream),
                    "cublasLtMatmul");
}

/* ---- scale repacking ----------------------------------------------------- */

/* Scale repacks, batched: a grouped GEMM repacks each expert's scales (its
 * slice of a GEMM-layout array is not a standalone array), and a launch per
 * expert and operand was 2E small launches a GEMM (128 a layer step at E 8).
 * One job: dst = the GEMM-layout scales of the stored [R, C] matrix whose
 * entries are found in src (layout sl over an sR x sC matrix) at stored row
 * r0 + r; padding entries get 1. A batch of up to REPACK_BATCH jobs with the
 * same mode and layout goes to the device in the launch's parameters. */
#define REPACK_BATCH 32

typedef struct repack_job {
    const float *src;
    float *dst;
    int64_t sR, sC, r0, R, C;
    int64_t n0; /* the job's first index in the batch */
    int64_t t0; /* BLOCK_1x128: its first 32 x 32 tile in the batch */
} repack_job;

typedef struct repack_batch {
    repack_job j[REPACK_BATCH];
    int count;
    int mode, sl;
    int64_t total; /* entries over the batch */
    int64_t tiles; /* BLOCK_1x128: tiles over the batch */
} repack_batch;

/* BLOCK_1x128, the common case (every activation operand of a grouped GEMM):
 * dst[cb][r] (rows padded to R4) = src scale of row r0 + r, column block cb,
 * a transpose of the compact [row][block] array. Through a 32 x 32 shared
 * tile, so that both the reads (along a row's blocks) and the writes (along
 * the rows) are coalesced; the entry-per-thread kernel below read with a
 * stride of a whole row and divided 64-bit indices per entry. */
__global__ void __launch_bounds__(256) repack_1x128(const repack_batch b)
{
    __shared__ float tile[32][33];
    const int64_t tb = blockIdx.x;
    int q = 0; /* the last job starting at or before this tile */
    for (int t = 1; t < b.count; t++)
        q = b.j[t].t0 <= tb ? t : q;
    const repack_job &jb = b.j[q];
    const int64_t R = jb.R, R4 = fm_round_up(R, 4), nk = fm_cdiv(jb.C, 128);
    const uint32_t tt = (uint32_t)(tb - jb.t0), nbc = (uint32_t)fm_cdiv(nk, 32);
    const uint32_t tr = tt / nbc, tc = tt - tr * nbc;
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int64_t r = (int64_t)tr * 32 + ty + 8 * i, cb = (int64_t)tc * 32 + tx;
        float v = 1.0f;
        if (r < R && cb < nk)
            v = jb.src[fm_scale_offset(FM_SCALE_BLOCK_1x128, (fm_scale_layout)b.sl, jb.sR, jb.sC, jb.r0 + r, cb * 128)];
        tile[ty + 8 * i][tx] = v;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int64_t cb = (int64_t)tc * 32 + ty + 8 * i, r = (int64_t)tr * 32 + tx;
        if (cb < nk && r < R4)
            jb.dst[cb * R4 + r] = tile[tx][ty + 8 * i];
    }
}

__global__ void repack_scales(const repack_batch b)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= b.total)
        return;
    int q = 0; /* the last job starting at or before i */
    for (int t = 1; t < b.count; t++)
        q = b.j[t].n0 <= i ? t : q;
    const repack_job &jb = b.j[q];
    const int64_t k = i - jb.n0, R = jb.R, C = jb.C;
    const fm_scale_mode mode = (fm_scale_mode)b.mode;
    int64_t r, c;
    if (mode == FM_SCALE_TENSOR) {
        jb.dst[0] = jb.src[0];
        return;
    }
    if (mode == FM_SCALE_ROW) {
        r = k;
        c = 0;
    } else { /* BLOCK_128x128 (BLOCK_1x128 batches go to repack_1x128) */
        const int64_t nk4 = fm_round_up(fm_cdiv(C, 128), 4);
        r = (k / nk4) * 128;
        c = (k % nk4) * 128;
    }
    jb.dst[k] = (r < R && c < C) ? jb.src[fm_scale_offset(mode, (fm_scale_layout)b.sl, jb.sR, jb.sC, jb.r0 + r, c)]
                                 : 1.0f;
}

static int64_t lt_scale_count(fm_scale_mode m, int64_t R, int64_t C)
{
    return m == FM_SCALE_ROW ? R : fm_scale_count_2d(m, FM_SCALE_LAYOUT_GEMM, R, C);
}

/* Bytes of scratch a repack of [R, C] takes, 256-aligned. */
static size_t repack_bytes(fm_scale_mode m, int64_t R, int64_t C)
{
    return (size_t)fm_round_up(lt_scale_count(m, R, C) * 4, 256);
}

static void repack_init(repack_batch *b)
{
    b->count = 0;
    b->total = 0;
    b->tiles = 0;
}

static fm_status repack_flush(fm_context *ctx, repack_batch *b)
{
    if (b->count == 0)
        return FM_OK;
    const int64_t total = b->total;
    if (total > 0 && b->mode == FM_SCALE_BLOCK_1x128)
        repack_1x128<<<(unsigned)b->tiles, 256, 0, fm_cuda_stream(ctx)>>>(*b);
    else if (total > 0)
        repack_scales<<<(unsigned)fm_cdiv(total, 256), 256, 0, fm_cuda_stream(ctx)>>>(*b);
    repack_init(b);
    return total > 0 ? fm_cuda_check_launch(ctx, "repack_scales") : FM_OK;
}

/* Queues one job (launching the batch when it is full or the mode changes). */
static fm_status repack_add(fm_context *ctx, repack_batch *b, const float *src, fm_scale_mode mode, fm_scale_layout sl,
                            int64_t sR, int64_t sC, int64_t r0, float *dst, int64_t R, int64_t C)
{
    const int64_t n = lt_scale_count(mode, R, C);
    if (n <= 0)
        return FM_OK;
    fm_status st = FM_OK;
    if (b->count && (b->mode != (int)mode || b->sl != (int)sl))
        st = repack_flush(ctx, b);
    if (st)
        return st;
    b->mode = (int)mode;
    b->sl = (int)sl;
    b->j[b->count] = (repack_job){src, dst, sR, sC, r0, R, C, b->total, b->tiles};
    b->count++;
    b->total += n;
    if (mode == FM_SCALE_BLOCK_1x128)
        b->tiles += fm_cdiv(fm_round_up(R, 4), 32) * fm_cdiv(fm_cdiv(C, 128), 32);
    return b->count == REPACK_BATCH ? repack_flush(ctx, b) : FM_OK;
}

static fm_status repack(fm_context *ctx, const float *src, fm_scale_mode mode, fm_scale_layout sl, int64_t sR,
                        int64_t sC, int64_t r0, float *dst, int64_t R, int64_t C)
{
    repack_batch b;
    repack_init(&b);
    fm_status st = repack_add(ctx, &b, src, mode, sl, sR, sC, r0, dst, R, C);
    return st ? st : repack_flush(ctx, &b);
}

/* ---- entry points -------------------------------------------------------- */

static int is_fp8(fm_dtype d) { return d == FM_DTYPE_E4M3 || d == FM_DTYPE_E5M2; }

static fm_status check_supported(fm_context *ctx, const fm_tensor *a, const fm_tensor *b, int64_t K, const char *op)
{
    if (a->scale_mode == FM_SCALE_BLOCK_128x128 && b->scale_mode == FM_SCALE_BLOCK_128x128)
        return fm_error(ctx, FM_ERR_UNSUPPORTED,
                        "%s: BLOCK_128x128 x BLOCK_128x128 is not supported by cuBLASLt (BLK128x128 on both "
                        "operands); quantize A with BLOCK_1x128 or use the CPU backend",
                        op);
    if (is_fp8(a->dtype) && K % 16)
        return fm_error(ctx, FM_ERR_UNSUPPORTED,
                        "%s: cuBLASLt's FP8 GEMM needs K (and so the leading dimensions) to be a multiple of 16; "
                        "K is %lld",
                        op, (long long)K);
    return FM_OK;
}

static int gemm_repack_needed(const fm_tensor *t)
{
    return (t->scale_mode == FM_SCALE_BLOCK_1x128 || t->scale_mode == FM_SCALE_BLOCK_128x128) &&
           t->scale_layout != FM_SCALE_LAYOUT_GEMM;
}

static lt_op op_of(const fm_tensor *t, const void *data, int64_t rows, int64_t K)
{
    lt_op o;
    o.data = data;
    o.dtype = t->dtype;
    o.colwise = t->layout == FM_LAYOUT_COLWISE;
    o.ld = o.colwise ? rows : K;
    o.scale = (const float *)t->scale;
    o.mode = t->scale_mode;
    return o;
}

static fm_status zero_output(fm_context *ctx, void *d, int64_t bytes, cudaStream_t s)
{
    return fm_cuda_check(ctx, cudaMemsetAsync(d, 0, (size_t)bytes, s), "cudaMemsetAsync(D)");
}

/* cuBLASLt's F32 GEMM writes F32 only: a BF16 result of F32 operands goes
 * through an F32 buffer and fm_cast (one more rounding than the CPU's, well
 * inside the tolerance). `d` is not accumulated into (core requires F32 D
 * for that). */
static fm_status via_f32(fm_context *ctx, fm_tensor *d, fm_tensor *tmp, void **buf)
{
    *tmp = *d;
    tmp->dtype = FM_DTYPE_F32;
    tmp->data_capacity = 0;
    *buf = NULL;
    size_t n = (size_t)fm_tensor_nbytes(tmp);
    cudaError_t err = cudaMallocAsync(buf, n ? n : 4, fm_cuda_stream(ctx));
    tmp->data = *buf;
    return fm_cuda_check(ctx, err, "F32 GEMM result buffer: cudaMallocAsync");
}

static fm_status via_f32_finish(fm_context *ctx, fm_status st, fm_tensor *tmp, fm_tensor *d, void *buf)
{
    if (!st)
        st = fm_cuda_cast(ctx, tmp, d);
    cudaError_t err = cudaFreeAsync(buf, fm_cuda_stream(ctx));
    fm_status st2 = fm_cuda_check(ctx, err, "F32 GEMM result buffer: cudaFreeAsync");
    return st ? st : st2;
}

/* AUTO takes the native kernel for m-grouped products whose experts average
 * at most this many rows, or that come with device split sizes only; cuBLASLt
 * otherwise. Measured on H100 in one fm-bench run (device run S18-17,
 * notes/grouped_gemm_sm90.md, K 7168): 64 experts of 256 rows, native 1.78x
 * cuBLASLt's per-expert calls; of 512 rows 0.98x; 32 of 1024 rows 0.98x; 8
 * of 4096 rows 0.94x (the layer's other products 0.93-1.00x); dense 8192^3
 * 1.01x. The layer's fp8-flow step ran 1.5% slower with every grouped
 * product native (S18-10, H200). */
#define NATIVE_AUTO_MAX_MEAN_ROWS 256

/* Whether AUTO takes the native kernel for the k-grouped weight gradients
 * it can run (dy 1x128 x x 128x128): not yet. S19-7 (H100, one fm-bench
 * run): the layer's W1 gradient into F32 += native 1119 TFLOP/s against
 * cuBLASLt's per-expert calls 1156 (0.97x), W2's 1095 against 1130; the
 * fp8-flow layer step 9.30 / 9.42 ms -> 9.58 / 9.51 ms with it. */
#define NATIVE_AUTO_WGRAD 0

/* Whether the native kernel runs this product (1) or cuBLASLt does (0);
 * with cfg->impl NATIVE and a product it cannot take, *st gets the error. */
static int pick_native(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *sp, const fm_tensor *a,
                       const fm_tensor *b, const fm_tensor *d, const char *op, fm_status *st)
{
    *st = FM_OK;
    if (cfg->impl == FM_GEMM_IMPL_LIBRARY)
        return 0;
    const char *why = fm_cuda_gemm_sm90_why_not(ctx, sp, a, b, d);
    if (why && cfg->impl == FM_GEMM_IMPL_NATIVE)
        *st = fm_error(ctx, FM_ERR_UNSUPPORTED, "%s: cfg->impl is NATIVE, and the native FP8 kernel %s", op, why);
    if (why || cfg->impl == FM_GEMM_IMPL_NATIVE)
        return !why;
    return sp && (!sp->host || a->shape[0] <= NATIVE_AUTO_MAX_MEAN_ROWS * sp->groups);
}

extern "C" fm_status fm_cuda_gemm(fm_context *ctx, const fm_gemm_config *cfg, const fm_tensor *a, const fm_tensor *b,
                                  fm_tensor *d)
{
    fm_status nst;
    int native = pick_native(ctx, cfg, NULL, a, b, d, "fm_gemm", &nst);
    if (nst)
        return nst;
    if (a->dtype == FM_DTYPE_F32 && d->dtype != FM_DTYPE_F32) {
        fm_tensor tmp;
        void *buf;
        fm_status st = via_f32(ctx, d, &tmp, &buf);
        if (st)
            return st;
        return via_f32_finish(ctx, fm_cuda_gemm(ctx, cfg, a, b, &tmp), &tmp, d, buf);
    }
    int64_t M = a->shape[0], N = b->shape[0], K = a->shape[1];
    fm_status st = check_supported(ctx, a, b, K, "fm_gemm");
    if (st || M == 0 || N == 0)
        return st;
    fm_cuda_device_guard g;
    if ((st = fm_cuda_enter(ctx, &g, "fm_gemm")))
        return st;
    cudaStream_t s = fm_cuda_stream(ctx);
    if (K == 0) {
        st = cfg->accumulate ? FM_OK : zero_output(ctx, d->data, fm_tensor_nbytes(d), s);
        fm_cuda_leave(ctx, &g, cudaSuccess, "fm_gemm");
        return st;
    }
    if (native) {
        st = fm_cuda_gemm_sm90(ctx, cfg, NULL, a, b, d);
        fm_cuda_leave(ctx, &g, cudaSuccess, "fm_gemm");
        return st;
    }
    /* F32 with a side of at most 16 (the router's GEMMs): a streaming kernel
     * unless cuBLASLt is asked for. */
    int skinny = cfg->impl == FM_GEMM_IMPL_LIBRARY ? 0 : fm_cuda_gemm_skinny_kind(a, b, d, M, N, K);
    if (skinny) {
        st = fm_cuda_gemm_skinny(ctx, cfg, a, b, d, skinny);
        fm_cuda_leave(ctx, &g, cudaSuccess, "fm_gemm");
        return st;
    }
    lt_op oa = op_of(a, a->data, M, K), ob = op_of(b, b->data, N, K);
    size_t sa_bytes = 0, sb_bytes = 0;
    /* TENSOR and ROW scales read the same in both layouts. */
    int rep_a = gemm_repack_needed(a), rep_b = gemm_repack_needed(b);
    if (rep_a)
        sa_bytes = repack_bytes(a->scale_mode, M, K);
    if (rep_b)
        sb_bytes = repack_bytes(b->scale_mode, N, K);
    void *scratch;
    int owned;
    if ((st = fm_cuda_scratch(ctx, sa_bytes + sb_bytes + LT_WS_DENSE, &scratch, &owned, "fm_gemm"))) {
        fm_cuda_leave(ctx, &g, cudaSuccess, "fm_gemm");
        return st;
    }
    char *p = (char *)scratch;
    if (rep_a && !st) {
        oa.scale = (float *)p;
        st = repack(ctx, (const float *)a->scale, a->scale_mode, a->scale_layout, M, K, 0, (float *)p, M, K);
        p += sa_bytes;
    }
    if (rep_b && !st) {
        ob.scale = (float *)p;
        st = repack(ctx, (const float *)b->scale, b->scale_mode, b->scale_layout, N, K, 0, (float *)p, N, K);
        p += sb_bytes;
    }
    if (!st)
        st = lt_matmul(ctx, &oa, &ob, M, N, K, d->data, d->dtype, N, cfg->accumulate, s, p, LT_WS_DENSE);
    cudaError_t err = owned ? cudaFreeAsync(scratch, s) : cudaSuccess;
    fm_status st2 = fm_cuda_leave(ctx, &g, err, "cudaFreeAsync(scratch)");
    return st ? st : st2;
}

static fm_status ensure_streams(fm_context *ctx, gemm_state *g)
{
    if (g->streams_ready)
        return FM_OK;
    cudaStream_t *ss = &g->side[0][0];
    cudaEvent_t *js = &g->join[0][0];
    const int n = 2 * GEMM_STREAMS;
    cudaError_t err = cudaEventCreateWithFlags(&g->fork[0], cudaEventDisableTiming);
    if (err == cudaSuccess && (err = cudaEventCreateWithFlags(&g->fork[1], cudaEventDisableTiming)) != cudaSuccess)
        cudaEventDestroy(g->fork[0]);
    if (err != cudaSuccess)
        return fm_cuda_check(ctx, err, "grouped GEMM streams");
    int i = 0;
    for (; err == cudaSuccess && i < n; i++) {
        err = cudaStreamCreateWithFlags(&ss[i], cudaStreamNonBlocking);
        if (err == cudaSuccess && (err = cudaEventCreateWithFlags(&js[i], cudaEventDisableTiming)) != cudaSuccess)
            cudaStreamDestroy(ss[i]);
    }
    if (err != cudaSuccess) {
        for (int j = 0; j < i - 1; j++) {
            cudaStreamDestroy(ss[j]);
            cudaEventDestroy(js[j]);
        }
        cudaEventDestroy(g->fork[0]);
        cudaEventDestroy(g->fork[1]);
        return fm_cuda_check(ctx, err, "grouped GEMM streams");
    }
    g->streams_ready = 1;
    return FM_OK;
}

/* One expert's product, prepared on the host. */
typedef struct {
    lt_op a, b;
    int64_t M, N, K;
    void *d;
    int64_t ldd;
} expert_job;

/* Runs the jobs over the side streams, joined back into the context stream. */
static fm_status run_grouped(fm_context *ctx, const expert_job *jobs, int64_t n, fm_dtype ddt, int accumulate,
                             char *ws)
{
    cudaStream_t s = fm_cuda_stream(ctx);
    if (n == 0)
        return FM_OK;
    if (n == 1)
        return lt_matmul(ctx, &jobs[0].a, &jobs[0].b, jobs[0].M, jobs[0].N, jobs[0].K, jobs[0].d, ddt, jobs[0].ldd,
                         accumulate, s, ws, LT_WS_GROUPED);
    gemm_state *g = state(ctx);
    fm_status st = g ? ensure_streams(ctx, g)
                     : fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "grouped GEMM: out of host memory for the stream state");
    if (st)
        return st;
    int ns = n < GEMM_STREAMS ? (int)n : GEMM_STREAMS;
    const int q = fm_cuda(ctx)->queue;
    cudaStream_t *side = g->side[q];
    cudaEvent_t *join = g->join[q];
    cudaError_t err = cudaEventRecord(g->fork[q], s);
    for (int i = 0; err == cudaSuccess && i < ns; i++)
        err = cudaStreamWaitEvent(side[i], g->fork[q], 0);
    if ((st = fm_cuda_check(ctx, err, "grouped GEMM fork")))
        return st;
    for (int64_t e = 0; e < n && !st; e++) {
        int i = (int)(e % ns);
        st = lt_matmul(ctx, &jobs[e].a, &jobs[e].b, jobs[e].M, jobs[e].N, jobs[e].K, jobs[e].d, ddt, jobs[e].ldd,
                       accumulate, side[i], ws + (size_t)i * LT_WS_GROUPED, LT_WS_GROUPED);
    }
    /* Join even after a failure, so that the context stream never runs ahead
     * of work queued on the side streams. */
    for (int i = 0; i < ns; i++) {
        cudaError_t e1 = cudaEventRecord(join[i], side[i]);
        cudaError_t e2 = e1 == cudaSuccess ? cudaStreamWaitEvent(s, join[i], 0) : e1;
        if (e2 != cudaSuccess && !st)
            st = fm_cuda_check(ctx, e2, "grouped GEMM join");
    }
    return st;
}

extern "C" fm_status fm_cuda_grouped_gemm(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *splits,
                                          const fm_tensor *a, const fm_tensor *b, fm_tensor *d)
{
    fm_status nst;
    int native = pick_native(ctx, cfg, splits, a, b, d, "fm_grouped_gemm", &nst);
    if (nst)
        return nst;
    if (!native && !splits->host) {
        const char *why = cfg->impl == FM_GEMM_IMPL_LIBRARY ? "cfg->impl is LIBRARY"
                                                            : fm_cuda_gemm_sm90_why_not(ctx, splits, a, b, d);
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "splits->host: NULL; the cuBLASLt path sizes each expert's call on the host and needs it "
                        "(the native kernel, which reads device sizes, does not apply: %s)",
                        why);
    }
    if (a->dtype == FM_DTYPE_F32 && d->dtype != FM_DTYPE_F32) {
        fm_tensor tmp;
        void *buf;
        fm_status st = via_f32(ctx, d, &tmp, &buf);
        if (st)
            return st;
        return via_f32_finish(ctx, fm_cuda_grouped_gemm(ctx, cfg, splits, a, b, &tmp), &tmp, d, buf);
    }
    int64_t E = b->shape[0], N = b->shape[1], K = b->shape[2], S = a->shape[0];
    fm_status st = check_supported(ctx, a, b, K, "fm_grouped_gemm");
    if (st || N == 0 || S == 0)
        return st;
    fm_cuda_device_guard g;
    if ((st = fm_cuda_enter(ctx, &g, "fm_grouped_gemm")))
        return st;
    cudaStream_t s = fm_cuda_stream(ctx);
    if (K == 0) {
        st = cfg->accumulate ? FM_OK : zero_output(ctx, d->data, fm_tensor_nbytes(d), s);
        fm_cuda_leave(ctx, &g, cudaSuccess, "fm_grouped_gemm");
        return st;
    }
    if (native) {
        st = fm_cuda_gemm_sm90(ctx, cfg, splits, a, b, d);
        fm_cuda_leave(ctx, &g, cudaSuccess, "fm_grouped_gemm");
        return st;
    }
    expert_job *jobs = (expert_job *)calloc((size_t)E + 1, sizeof *jobs);
    if (!jobs) {
        fm_cuda_leave(ctx, &g, cudaSuccess, "fm_grouped_gemm");
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_grouped_gemm: out of host memory");
    }
    /* A's per-row scales are repacked per expert (its slice of a GEMM-layout
     * array is not a standalone array); B's when they are COMPACT. */
    int rep_a = a->scale_mode == FM_SCALE_ROW || a->scale_mode == FM_SCALE_BLOCK_1x128;
    /* An expert's TENSOR scale inside B's array is only 4-byte aligned, and
     * cuBLASLt refuses that at launch: each gets a 256-byte slot. */
    int rep_b = gemm_repack_needed(b) || b->scale_mode == FM_SCALE_TENSOR;
    size_t scale_bytes = 0;
    for (int64_t e = 0; e < E; e++)
        if (splits->host[e] > 0)
            scale_bytes += (rep_a ? repack_bytes(a->scale_mode, splits->host[e], K) : 0) +
                           (rep_b ? repack_bytes(b->scale_mode, N, K) : 0);
    void *scratch;
    int owned;
    if ((st = fm_cuda_scratch(ctx, scale_bytes + GEMM_STREAMS * LT_WS_GROUPED, &scratch, &owned, "fm_grouped_gemm"))) {
        free(jobs);
        fm_cuda_leave(ctx, &g, cudaSuccess, "fm_grouped_gemm");
        return st;
    }
    char *p = (char *)scratch;
    int64_t n = 0, row0 = 0, ab = fm_dtype_bits(a->dtype) / 8, bb = fm_dtype_bits(b->dtype) / 8;
    int64_t db = fm_dtype_bits(d->dtype) / 8;
    repack_batch rb[2]; /* A's and B's repacks (4 KiB of stack) */
    repack_batch *ba = &rb[0], *bbt = &rb[1];
    repack_init(ba);
    repack_init(bbt);
    int64_t bsc = b->scale_mode ? fm_scale_count_2d(b->scale_mode, b->scale_layout, N, K) : 0;
    for (int64_t e = 0; e < E && !st; e++) {
        int64_t m = splits->host[e];
        if (m == 0)
            continue;
        expert_job *j = &jobs[n++];
        /* A row-wise: rows row0.. start at row0 * K; column-wise (unscaled):
         * stored [K, S], the slice starts at column row0 with ld S. */
        int64_t aoff = a->layout == FM_LAYOUT_COLWISE ? row0 : row0 * K;
        j->a = op_of(a, (const char *)a->data + aoff * ab, m, K);
        if (a->layout == FM_LAYOUT_COLWISE)
            j->a.ld = S;
        j->b = op_of(b, (const char *)b->data + e * N * K * bb, N, K);
        if (b->scale_mode && !rep_b)
            j->b.scale = (const float *)b->scale + e * bsc;
        if (rep_a) {
            j->a.scale = (const float *)p;
            st = repack_add(ctx, ba, (const float *)a->scale, a->scale_mode, a->scale_layout, S, K, row0, (float *)p,
                            m, K);
            p += repack_bytes(a->scale_mode, m, K);
        }
        if (rep_b && !st) {
            j->b.scale = (const float *)p;
            st = repack_add(ctx, bbt, (const float *)b->scale + e * bsc, b->scale_mode, b->scale_layout, N, K, 0,
                            (float *)p, N, K);
            p += repack_bytes(b->scale_mode, N, K);
        }
        j->M = m;
        j->N = N;
        j->K = K;
        j->d = (char *)d->data + row0 * N * db;
        j->ldd = N;
        row0 += m;
    }
    if (!st)
        st = repack_flush(ctx, ba);
    if (!st)
        st = repack_flush(ctx, bbt);
    if (!st)
        st = run_grouped(ctx, jobs, n, d->dtype, cfg->accumulate, p);
    free(jobs);
    cudaError_t err = owned ? cudaFreeAsync(scratch, s) : cudaSuccess;
    fm_status st2 = fm_cuda_leave(ctx, &g, err, "cudaFreeAsync(scratch)");
    return st ? st : st2;
}

extern "C" fm_status fm_cuda_grouped_gemm_wgrad(fm_context *ctx, const fm_gemm_config *cfg, const fm_splits *splits,
                                                const fm_tensor *dy, const fm_tensor *x, fm_tensor *dw)
{
    const char *why = cfg->impl == FM_GEMM_IMPL_LIBRARY ? "" : fm_cuda_gemm_wgrad_sm90_why_not(ctx, splits, dy, x, dw);
    if (cfg->impl == FM_GEMM_IMPL_NATIVE && why)
        return fm_error(ctx, FM_ERR_UNSUPPORTED,
                        "fm_grouped_gemm_wgrad: cfg->impl is NATIVE, and the native FP8 kernel %s", why);
    const int native = !why && (cfg->impl == FM_GEMM_IMPL_NATIVE || NATIVE_AUTO_WGRAD);
    if (dy->dtype == FM_DTYPE_F32 && dw->dtype != FM_DTYPE_F32) {
        fm_tensor tmp;
        void *buf;
        fm_status st = via_f32(ctx, dw, &tmp, &buf);
        if (st)
            return st;
        return via_f32_finish(ctx, fm_cuda_grouped_gemm_wgrad(ctx, cfg, splits, dy, x, &tmp), &tmp, dw, buf);
    }
    int64_t E = dw->shape[0], N = dw->shape[1], K = dw->shape[2];
    int fp8 = is_fp8(dy->dtype);
    for (int64_t e = 0; e < E && fp8; e++)
        if (splits->host[e] % 16)
            return fm_error(ctx, FM_ERR_UNSUPPORTED,
                            "fm_grouped_gemm_wgrad: cuBLASLt's FP8 GEMM needs each expert's M_i (its K) to be a "
                            "multiple of 16; splits->host[%lld] is %lld",
                            (long long)e, (long long)splits->host[e]);
    if (N == 0 || K == 0)
        return FM_OK;
    fm_cuda_device_guard g;
    fm_status st = fm_cuda_enter(ctx, &g, "fm_grouped_gemm_wgrad");
    if (st)
        return st;
    cudaStream_t s = fm_cuda_stream(ctx);
    expert_job *jobs = (expert_job *)calloc((size_t)E + 1, sizeof *jobs);
    fm_sm90_kjob *kjobs = native ? (fm_sm90_kjob *)calloc((size_t)E + 1, sizeof *kjobs) : NULL;
    if (!jobs || (native && !kjobs)) {
        free(jobs);
        free(kjobs);
        fm_cuda_leave(ctx, &g, cudaSuccess, "fm_grouped_gemm_wgrad");
        return fm_error(ctx, FM_ERR_OUT_OF_MEMORY, "fm_grouped_gemm_wgrad: out of host memory");
    }
    int rep = fp8 && dy->scale_layout != FM_SCALE_LAYOUT_GEMM;
    int repx = fp8 && x->scale_layout != FM_SCALE_LAYOUT_GEMM;
    size_t scale_bytes = 0;
    for (int64_t e = 0; e < E; e++)
        if (splits->host[e] > 0)
            scale_bytes += (rep ? repack_bytes(FM_SCALE_BLOCK_1x128, N, splits->host[e]) : 0) +
                           (repx ? repack_bytes(x->scale_mode, K, splits->host[e]) : 0);
    void *scratch;
    int owned;
    if ((st = fm_cuda_scratch(ctx, scale_bytes + (native ? 0 : GEMM_STREAMS * LT_WS_GROUPED), &scratch, &owned,
                              "fm_grouped_gemm_wgrad"))) {
        free(jobs);
        free(kjobs);
        fm_cuda_leave(ctx, &g, cudaSuccess, "fm_grouped_gemm_wgrad");
        return st;
    }
    char *p = (char *)scratch;
    int64_t n = 0, row0 = 0, soff_dy = 0, soff_x = 0;
    int64_t ab = fm_dtype_bits(dy->dtype) / 8, bb = fm_dtype_bits(x->dtype) / 8, db = fm_dtype_bits(dw->dtype) / 8;
    repack_batch rb[2]; /* dY's and X's repacks (4 KiB of stack) */
    repack_batch *bdy = &rb[0], *bx = &rb[1];
    repack_init(bdy);
    repack_init(bx);
    for (int64_t e = 0; e < E && !st; e++) {
        int64_t m = splits->host[e];
        char *de = (char *)dw->data + e * N * K * db;
        if (m == 0) {
            if (!cfg->accumulate)
                st = zero_output(ctx, de, N * K * db, s);
            continue;
        }
        expert_job *j = &jobs[n++];
        /* dW_e [N, K] = dY_eᵀ [N, m] · (X_eᵀ [K, m])ᵀ. Grouped column-wise:
         * dY_eᵀ is stored row-major [N, m] at N * row0 (K = m contiguous).
         * Row-wise (unscaled): dY_eᵀ is rows row0.. of dy read transposed. */
        int colw = dy->layout == FM_LAYOUT_COLWISE, colx = x->layout == FM_LAYOUT_COLWISE;
        j->a.data = (const char *)dy->data + row0 * N * ab;
        j->a.dtype = dy->dtype;
        j->a.colwise = !colw;
        j->a.ld = colw ? m : N;
        j->a.mode = dy->scale_mode;
        j->a.scale = fp8 ? (const float *)dy->scale + soff_dy : NULL;
        j->b.data = (const char *)x->data + row0 * K * bb;
        j->b.dtype = x->dtype;
        j->b.colwise = !colx;
        j->b.ld = colx ? m : K;
        j->b.mode = x->scale_mode;
        j->b.scale = fp8 ? (const float *)x->scale + soff_x : NULL;
        if (rep) {
            st = repack_add(ctx, bdy, j->a.scale, FM_SCALE_BLOCK_1x128, dy->scale_layout, N, m, 0, (float *)p, N, m);
            j->a.scale = (const float *)p;
            p += repack_bytes(FM_SCALE_BLOCK_1x128, N, m);
        }
        if (repx && !st) {
            st = repack_add(ctx, bx, j->b.scale, x->scale_mode, x->scale_layout, K, m, 0, (float *)p, K, m);
            j->b.scale = (const float *)p;
            p += repack_bytes(x->scale_mode, K, m);
        }
        j->M = N;
        j->N = K;
        j->K = m;
        j->d = de;
        j->ldd = K;
        if (native)
            kjobs[n - 1] = (fm_sm90_kjob){j->a.data, j->b.data, j->a.scale, j->b.scale, m, e};
        if (fp8) {
            soff_dy += fm_scale_count_2d(FM_SCALE_BLOCK_1x128, dy->scale_layout, N, m);
            soff_x += fm_scale_count_2d(x->scale_mode, x->scale_layout, K, m);
        }
        row0 += m;
    }
    if (!st)
        st = repack_flush(ctx, bdy);
    if (!st)
        st = repack_flush(ctx, bx);
    if (!st && native)
        st = fm_cuda_gemm_wgrad_sm90(ctx, cfg, dy, x, dw, kjobs, n);
    else if (!st)
        st = run_grouped(ctx, jobs, n, dw->dtype, cfg->accumulate, p);
    free(jobs);
    free(kjobs);
    cudaError_t err = owned ? cudaFreeAsync(scratch, s) : cudaSuccess;
    fm_status st2 = fm_cuda_leave(ctx, &g, err, "cudaFreeAsync(scratch)");
    return st ? st : st2;
}
