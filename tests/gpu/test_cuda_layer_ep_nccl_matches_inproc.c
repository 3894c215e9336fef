/* The MoE layer over expert parallelism on CUDA (NCCL communicators from
 * ncclCommInitAll, one thread and one GPU per rank) matches the same layer
 * over the in-process communicator on the CPU, rank by rank, from the same
 * weights and tokens: y, dx and the three weight gradients within the
 * bounds of test_cuda_layer_matches_cpu (the GEMMs differ by their
 * tolerance: cuBLASLt sums in F32, the CPU in double). Every recipe; rank r
 * holds its block of tokens (unequal counts) and of experts. Runs on as many
 * GPUs as there are, up to 4: on one GPU a one-rank communicator still sends
 * every row through NCCL and the pack / unpack kernels. Skips (77) without a
 * CUDA device or without NCCL. */
#include <pthread.h>

#include "gpu_test.h"

#ifdef FM_HAVE_NCCL
#include <nccl.h>

static const char *const TEST = "test_cuda_layer_ep_nccl_matches_inproc";

enum { MAXR = 4 };
enum { WR, W1, W2, GR, G1, G2, X, Y, DY, DX, NB };

typedef struct {
    int r, n, cuda;
    fm_context *ctx;
    fm_comm *comm;
    fm_recipe rc;
    int64_t T, Tmax, H, I, E;
    int k;
    float *p[NB]; /* the rank's buffers in ctx's memory */
    fm_status st;
    char err[256];
} rank_io;

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static void *rank_step(void *arg)
{
    rank_io *io = arg;
    if (io->cuda)
        cudaSetDevice(io->r);
    fm_moe_layer_config cfg = {.hidden = io->H, .ffn = io->I, .experts = io->E, .topk = io->k, .renormalize = 1,
                               .recipe = io->rc, .max_tokens = io->Tmax, .comm = io->comm};
    fm_moe_weights w = {io->p[WR], io->p[W1], io->p[W2], io->p[GR], io->p[G1], io->p[G2]};
    fm_tensor x = fm_tensor_2d(io->p[X], FM_DTYPE_F32, io->T, io->H), y = fm_tensor_2d(io->p[Y], FM_DTYPE_F32, io->T, io->H);
    fm_tensor dy = fm_tensor_2d(io->p[DY], FM_DTYPE_F32, io->T, io->H);
    fm_tensor dx = fm_tensor_2d(io->p[DX], FM_DTYPE_F32, io->T, io->H);
    x.device = y.device = dy.device = dx.device = fm_context_device(io->ctx);
    fm_status st = layer_step(io->ctx, &cfg, &w, &x, &y, &dy, &dx, NULL);
    io->st = st;
    snprintf(io->err, sizeof io->err, "%s", fm_last_error(io->ctx));
    return NULL;
}

static void run_ranks(rank_io *io, int n)
{
    pthread_t th[MAXR];
    for (int r = 0; r < n; r++)
        pthread_create(&th[r], NULL, rank_step, &io[r]);
    for (int r = 0; r < n; r++)
        pthread_join(th[r], NULL);
}

static void run_world(int n)
{
    const int64_t H = 256, I = 128, E = 8, El = E / n;
    const int k = 2;
    static const int64_t Tr[MAXR] = {150, 97, 0, 121};
    ncclComm_t raw[MAXR];
    int devs[MAXR];
    for (int r = 0; r < n; r++)
        devs[r] = r;
    ncclResult_t nr = ncclCommInitAll(raw, n, devs);
    if (nr != ncclSuccess) {
        gt_failures++;
        fprintf(stderr, "FAIL: ncclCommInitAll over %d GPUs: %s\n", n, ncclGetErrorString(nr));
        return;
    }
    fm_context *gpu[MAXR], *cpu[MAXR];
    fm_comm *nc[MAXR], *ref[MAXR];
    GT_CHECK(fm_comm_create_inproc(n, ref) == FM_OK, "inproc: %s", fm_last_error(NULL));
    for (int r = 0; r < n; r++) {
        fm_context_config cc;
        memset(&cc, 0, sizeof cc);
        cc.backend = FM_BACKEND_CUDA;
        cc.device = r;
        if (fm_context_create(&cc, &gpu[r]) != FM_OK) {
            fprintf(stderr, "FAIL: CUDA context on device %d: %s\n", r, fm_last_error(NULL));
            exit(1);
        }
        cpu[r] = gt_cpu_context();
        if (fm_comm_create_nccl(gpu[r], raw[r], &nc[r]) != FM_OK) {
            fprintf(stderr, "FAIL: fm_comm_create_nccl rank %d: %s\n", r, fm_last_error(gpu[r]));
            exit(1);
        }
    }
    int64_t Tmax = 0, n_el[NB];
    for (int r = 0; r < n; r++)
        Tmax = Tr[r] > Tmax ? Tr[r] : Tmax;
    n_el[WR] = n_el[GR] = E * H;
    n_el[W1] = n_el[G1] = El * 2 * I * H;
    n_el[W2] = n_el[G2] = El * H * I;
    for (int b = X; b < NB; b++)
        n_el[b] = Tmax * H;
    static const double sc[NB] = {0.0625, 0.0625, 0.088, 0, 0, 0, 1, 0, 1, 0};
    int aborted = 0;
    for (int rc = 0; rc < FM_RECIPE_COUNT && !aborted; rc++) {
        const char *rn = fm_recipe_name((fm_recipe)rc);
        float *host[MAXR][NB];
        rank_io g[MAXR], c[MAXR];
        for (int r = 0; r < n; r++) {
            g[r] = (rank_io){.r = r, .n = n, .cuda = 1, .ctx = gpu[r], .comm = nc[r], .rc = (fm_recipe)rc,
                             .T = Tr[r], .Tmax = Tmax, .H = H, .I = I, .E = E, .k = k};
            c[r] = g[r];
            c[r].cuda = 0, c[r].ctx = cpu[r], c[r].comm = ref[r];
            for (int b = 0; b < NB; b++) {
                size_t bytes = (size_t)n_el[b] * 4;
                host[r][b] = malloc(bytes);
                for (int64_t i = 0; i < n_el[b]; i++) /* the router is every rank's copy of one matrix */
                    host[r][b][i] = sc[b] > 0 ? (float)(gt_normal(&rng) * sc[b]) : 0.0f;
                if (b == WR && r > 0)
                    memcpy(host[r][b], host[0][b], bytes);
                c[r].p[b] = malloc(bytes);
                memcpy(c[r].p[b], host[r][b], bytes);
                cudaSetDevice(r);
                GT_CHECK(fm_context_alloc(gpu[r], bytes, (void **)&g[r].p[b]) == FM_OK, "alloc: %s",
                         fm_last_error(gpu[r]));
                GT_CHECK(fm_context_copy(gpu[r], g[r].p[b], FM_DEVICE_CUDA, host[r][b], FM_DEVICE_HOST, bytes) == FM_OK,
                         "copy: %s", fm_last_error(gpu[r]));
            }
        }
        run_ranks(c, n);
        run_ranks(g, n);
        for (int r = 0; r < n; r++)
            aborted |= g[r].st != FM_OK; /* the layer aborted the communicators */
        for (int r = 0; r < n; r++) {
            GT_CHECK(c[r].st == FM_OK, "%s, %d ranks: CPU rank %d: %s", rn, n, r, c[r].err);
            GT_CHECK(g[r].st == FM_OK, "%s, %d ranks: CUDA rank %d: %s", rn, n, r, g[r].err);
            if (c[r].st || g[r].st)
                continue;
            static const int outs[] = {Y, DX, GR, G1, G2};
            static const char *on[] = {"y", "dx", "grad_router", "grad_w1", "grad_w2"};
            double tol = rc == FM_RECIPE_BF16 ? 5e-3 : 1.5e-2;
            for (int o = 0; o < 5; o++) {
                int b = outs[o];
                int64_t m = b == Y || b == DX ? Tr[r] * H : n_el[b];
                float *got = malloc((size_t)n_el[b] * 4);
                cudaSetDevice(r);
                GT_CHECK(fm_context_copy(gpu[r], got, FM_DEVICE_HOST, g[r].p[b], FM_DEVICE_CUDA, (size_t)n_el[b] * 4) ==
                             FM_OK,
                         "copy back");
                double e = gt_rel_frob(got, c[r].p[b], m);
                printf("%-14s %d ranks, rank %d %-12s rel. error %.2e (bound %.0e)\n", rn, n, r, on[o], e, tol);
                GT_CHECK(e <= tol, "%s, %d ranks, rank %d %s: NCCL/CUDA vs in-process/CPU rel. error %.3g > %.3g", rn,
                         n, r, on[o], e, tol);
                free(got);
            }
        }
        for (int r = 0; r < n; r++)
            for (int b = 0; b < NB; b++) {
                cudaSetDevice(r);
                fm_context_free(gpu[r], g[r].p[b]);
                free(c[r].p[b]), free(host[r][b]);
            }
    }
    for (int r = 0; r < n; r++) {
        fm_comm_destroy(nc[r]);
        fm_comm_destroy(ref[r]);
        fm_context_destroy(gpu[r]);
        fm_context_destroy(cpu[r]);
        if (!aborted) /* fm_comm_abort freed them */
            ncclCommDestroy(raw[r]);
    }
    printf("%s: %d ranks done\n", TEST, n);
}

int main(void)
{
    int nd = 0;
    if (cudaGetDeviceCount(&nd) != cudaSuccess || nd < 1) {
        printf("%s: skipped: no CUDA device\n", TEST);
        return 77;
    }
    fm_context *probe = gt_cuda_context(TEST);
    fm_context_destroy(probe);
    run_world(1);
    if (nd >= 2)
        run_world(2);
    if (nd >= 4)
        run_world(4);
    printf("%s: %d failures\n", TEST, gt_failures);
    return gt_failures ? 1 : 0;
}

#else

int main(void)
{
    printf("test_cuda_layer_ep_nccl_matches_inproc: skipped: built without NCCL\n");
    return 77;
}

#endif
