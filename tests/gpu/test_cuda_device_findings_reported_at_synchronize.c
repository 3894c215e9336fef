/* Bad input that only the device can see, in a CUDA call that does not wait
 * for the device, is reported by the next fm_context_synchronize with the
 * sentence the CPU backend returns at once, and only once:
 *  - fm_moe_permute with an expert id out of range, and with too few out
 *    rows, without host_splits: the call returns FM_OK and its outputs hold
 *    no placed slot (slot_rows and row_map -1); with host_splits the call
 *    itself reports, and nothing is left pending;
 *  - fm_transpose_scaled and fm_convert_scaled with an F32 scale that is
 *    not a power of two: the call returns FM_OK and writes nothing, on
 *    every kernel that may follow the scale check;
 *  - with several bad scales, the one named is the CPU's (the first in its
 *    order), and the check's state carries nothing from one call to the
 *    next: refused and accepted calls in turn, each accepted one equal to
 *    the CPU's, non-finite count included;
 *  - of two findings before a synchronize, the first is reported;
 *  - a valid call after them gives the CPU's result. */
#include "gpu_test.h"

static const int64_t T = 37, H = 64, K = 2, E = 5, PAD = 16;

static void *dalloc(size_t n, int fill)
{
    void *p;
    GT_CUDA(cudaMalloc(&p, n));
    GT_CUDA(cudaMemset(p, fill, n));
    return p;
}

static void *dcopy(const void *h, size_t n)
{
    void *p = dalloc(n, 0);
    GT_CUDA(cudaMemcpy(p, h, n, cudaMemcpyHostToDevice));
    return p;
}

/* Every I32 of a device array equals v. */
static int all_i32(const void *d, int64_t n, int32_t v)
{
    int32_t *h = malloc((size_t)n * 4);
    GT_CUDA(cudaMemcpy(h, d, (size_t)n * 4, cudaMemcpyDeviceToHost));
    int ok = 1;
    for (int64_t i = 0; i < n; i++)
        ok &= h[i] == v;
    free(h);
    return ok;
}

static int same_dev_host(const void *d, const void *h, size_t n)
{
    void *g = malloc(n);
    GT_CUDA(cudaMemcpy(g, d, n, cudaMemcpyDeviceToHost));
    int ok = !memcmp(g, h, n);
    free(g);
    return ok;
}

/* fm_moe_permute's device buffers: x [T, H] BF16, ids [T, K], out [R, H],
 * row_map, slot_rows, splits; the outputs poisoned. */
typedef struct dperm {
    void *p[6];
    fm_tensor t[6]; /* x, ids, out, row_map, slot_rows, splits */
} dperm;

static void dperm_make(dperm *d, const uint16_t *x, const int32_t *ids, int64_t R)
{
    d->p[0] = dcopy(x, (size_t)(T * H) * 2);
    d->p[1] = dcopy(ids, (size_t)(T * K) * 4);
    d->p[2] = dalloc((size_t)(R * H) * 2, 0xA5);
    d->p[3] = dalloc((size_t)R * 4, 0xA5);
    d->p[4] = dalloc((size_t)(T * K) * 4, 0xA5);
    d->p[5] = dalloc((size_t)E * 8, 0xA5);
    d->t[0] = fm_tensor_2d(d->p[0], FM_DTYPE_BF16, T, H);
    d->t[1] = fm_tensor_2d(d->p[1], FM_DTYPE_I32, T, K);
    d->t[2] = fm_tensor_2d(d->p[2], FM_DTYPE_BF16, R, H);
    d->t[3] = fm_tensor_2d(d->p[3], FM_DTYPE_I32, R, 1);
    d->t[4] = fm_tensor_2d(d->p[4], FM_DTYPE_I32, T, K);
    d->t[5] = fm_tensor_2d(d->p[5], FM_DTYPE_I64, 1, E);
    for (int i = 0; i < 6; i++)
        d->t[i].device = FM_DEVICE_CUDA;
}

static fm_status dperm_run(fm_context *gpu, dperm *d, int64_t *host_splits)
{
    fm_permute_config pc = {.pad_multiple = PAD};
    return fm_moe_permute(gpu, &pc, &d->t[0], &d->t[1], NULL, &d->t[2], &d->t[3], &d->t[4], &d->t[5], NULL,
                          host_splits);
}

static void dperm_free(dperm *d)
{
    for (int i = 0; i < 6; i++)
        cudaFree(d->p[i]);
}

/* BF16 values near 1, [T, H]. */
static uint16_t *make_x(void)
{
    uint16_t *x = malloc((size_t)(T * H) * 2);
    for (int64_t i = 0; i < T * H; i++)
        x[i] = (uint16_t)(0x3F80u + (uint16_t)(i % 97));
    return x;
}

/* A permute of BF16 rows by `ids` into R rows on both backends. expect_pending:
 * the GPU call itself returns FM_OK and the synchronize refuses. Returns the
 * CPU status. */
static fm_status permute_case(fm_context *cpu, fm_context *gpu, const char *cs, const int32_t *ids, int64_t R,
                              int host_splits, int expect_pending)
{
    uint16_t *x = make_x();
    int32_t *hrm = malloc((size_t)R * 4), *hsr = malloc((size_t)(T * K) * 4);
    int64_t hsp[8], hs_cpu[8], hs_gpu[8];
    uint16_t *hout = malloc((size_t)(R * H) * 2);
    fm_permute_config pc = {.pad_multiple = PAD};
    fm_tensor xh = fm_tensor_2d(x, FM_DTYPE_BF16, T, H), ih = fm_tensor_2d((void *)ids, FM_DTYPE_I32, T, K);
    fm_tensor oh = fm_tensor_2d(hout, FM_DTYPE_BF16, R, H), rmh = fm_tensor_2d(hrm, FM_DTYPE_I32, R, 1);
    fm_tensor srh = fm_tensor_2d(hsr, FM_DTYPE_I32, T, K), sph = fm_tensor_2d(hsp, FM_DTYPE_I64, 1, E);
    fm_status stc = fm_moe_permute(cpu, &pc, &xh, &ih, NULL, &oh, &rmh, &srh, &sph, NULL,
                                   host_splits ? hs_cpu : NULL);
    char cmsg[512];
    snprintf(cmsg, sizeof cmsg, "%s", fm_last_error(cpu));

    dperm d;
    dperm_make(&d, x, ids, R);
    void *dout = d.p[2], *drm = d.p[3], *dsr = d.p[4], *dsp = d.p[5];
    fm_status stg = dperm_run(gpu, &d, host_splits ? hs_gpu : NULL);
    char gmsg[512];
    snprintf(gmsg, sizeof gmsg, "%s", fm_last_error(gpu));
    fm_status sy = fm_context_synchronize(gpu);
    char smsg[512];
    snprintf(smsg, sizeof smsg, "%s", fm_last_error(gpu));
    if (expect_pending) {
        GT_CHECK(stg == FM_OK, "%s: the call returned %s (%s); the finding should wait", cs, fm_status_name(stg), gmsg);
        GT_CHECK(sy == FM_ERR_INVALID_ARG && !strcmp(smsg, cmsg), "%s: synchronize gave %s '%s', the CPU '%s'", cs,
                 fm_status_name(sy), smsg, cmsg);
        GT_CHECK(all_i32(dsr, T * K, -1) && all_i32(drm, R, -1), "%s: a flagged call placed slots", cs);
        GT_CHECK(fm_context_synchronize(gpu) == FM_OK, "%s: reported twice: %s", cs, fm_last_error(gpu));
    } else {
        GT_CHECK(stg == stc, "%s: gpu %s (%s), cpu %s (%s)", cs, fm_status_name(stg), gmsg, fm_status_name(stc), cmsg);
        GT_CHECK(sy == FM_OK, "%s: synchronize after the call: %s", cs, smsg);
        if (stc == FM_OK && stg == FM_OK) {
            GT_CHECK(same_dev_host(dout, hout, (size_t)(R * H) * 2) && same_dev_host(drm, hrm, (size_t)R * 4) &&
                         same_dev_host(dsr, hsr, (size_t)(T * K) * 4) && same_dev_host(dsp, hsp, (size_t)E * 8),
                     "%s: the outputs differ from the CPU's", cs);
            GT_CHECK(!host_splits || !memcmp(hs_cpu, hs_gpu, (size_t)E * 8), "%s: host_splits differ", cs);
        } else {
            GT_CHECK(!strcmp(gmsg, cmsg), "%s: gpu says '%s', cpu '%s'", cs, gmsg, cmsg);
        }
    }
    dperm_free(&d);
    free(x);
    free(hrm);
    free(hsr);
    free(hout);
    return stc;
}

/* The scale-checked calls a bad scale is tried on. The kernel after the
 * check may start while the check runs (programmatic launch) and must still
 * write nothing: each kind of kernel, and for the TMA transpose a CTA with
 * more tiles than its ring has stages (the producer has then waited for the
 * check mid-stream) and one with fewer (it waits after its last tile). */
typedef struct badcase {
    const char *name;
    int64_t R, C;
    fm_dtype odt;  /* E4M3: the TMA transpose; E5M2: rq_fp8t_kernel; E2M1: the row conversion */
    int transpose; /* 0: fm_convert_scaled to MX32 */
} badcase;

static const badcase BAD[] = {
    {"[128, 256] transpose, 2 tiles", 128, 256, FM_DTYPE_E4M3, 1},
    {"[8192, 4096] transpose, 2048 tiles", 8192, 4096, FM_DTYPE_E4M3, 1},
    {"[1024, 512] transpose into E5M2", 1024, 512, FM_DTYPE_E5M2, 1},
    {"[1024, 512] conversion into E2M1", 1024, 512, FM_DTYPE_E2M1, 0},
};

/* The first of n host bytes that is no longer the 0xA5 poison (n: none). */
static size_t first_written(const unsigned char *h, size_t n)
{
    size_t i = 0;
    while (i < n && h[i] == 0xA5)
        i++;
    return i;
}

/* An E4M3 1x128 row-wise tensor of case c, zero codes, scales 1 but block
 * `bad`'s, which is 3, through the CUDA backend's scale check. The outputs'
 * codes (returned in *keep_out, *out_bytes), scales and non-finite count are
 * poisoned first; the scales and the count are checked here. */
static fm_status bad_scale_call(fm_context *gpu, const badcase *c, int64_t bad, void **keep_out, size_t *out_bytes)
{
    const int64_t R = c->R, C = c->C, nb = R * (C / 128);
    float *sc = malloc((size_t)nb * 4);
    for (int64_t i = 0; i < nb; i++)
        sc[i] = 1.0f;
    sc[bad] = 3.0f;
    fm_tensor in = fm_tensor_2d(dalloc((size_t)(R * C), 0), FM_DTYPE_E4M3, R, C);
    in.device = FM_DEVICE_CUDA;
    in.scale_mode = FM_SCALE_BLOCK_1x128;
    in.scale_dtype = FM_DTYPE_F32;
    in.scale = dcopy(sc, (size_t)nb * 4);
    free(sc);
    fm_tensor out = in;
    out.dtype = c->odt;
    if (c->transpose) {
        out.layout = FM_LAYOUT_COLWISE;
    } else {
        out.scale_mode = FM_SCALE_MX32;
        out.scale_dtype = FM_DTYPE_E8M0;
    }
    *out_bytes = (size_t)(c->odt == FM_DTYPE_E2M1 ? R * C / 2 : R * C);
    out.data = dalloc(*out_bytes, 0xA5);
    out.scale = dalloc((size_t)fm_tensor_scale_nbytes(&out), 0xA5);
    fm_requant_config rq = {.rule = FM_REQUANT_TIGHT};
    int64_t *dnf = dalloc(8, 0xA5);
    rq.nonfinite_blocks = dnf;
    fm_status st = c->transpose ? fm_transpose_scaled(gpu, &rq, &in, &out) : fm_convert_scaled(gpu, &rq, &in, &out);
    GT_CUDA(cudaDeviceSynchronize());
    size_t ns = (size_t)fm_tensor_scale_nbytes(&out);
    unsigned char *h = malloc(ns + 8);
    GT_CUDA(cudaMemcpy(h, out.scale, ns, cudaMemcpyDeviceToHost));
    GT_CUDA(cudaMemcpy(h + ns, dnf, 8, cudaMemcpyDeviceToHost));
    const size_t i = first_written(h, ns + 8);
    GT_CHECK(i == ns + 8, "%s: the refused call wrote %s byte %zu", c->name, i < ns ? "scale" : "nonfinite_blocks",
             i < ns ? i : i - ns);
    free(h);
    cudaFree(in.data);
    cudaFree(in.scale);
    cudaFree(out.scale);
    cudaFree(dnf);
    *keep_out = out.data;
    return st;
}

/* Every byte of device buffer d (n bytes) is still 0xA5; frees it. */
static int untouched_free(void *d, size_t n)
{
    unsigned char *h = malloc(n);
    GT_CUDA(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost));
    const int ok = first_written(h, n) == n;
    free(h);
    cudaFree(d);
    return ok;
}

/* Row conversions [R, C] E4M3 1x128 -> E2M1 MX32 one after another on both
 * backends: call k has NaN codes, and on odd k three scales that are not
 * powers of two, spread over the tensor (the smallest not first). A refused
 * CUDA call returns FM_OK, its synchronize returns the CPU's sentence, and
 * its outputs and count stay poisoned; an accepted one equals the CPU. */
static void conversion_sequence(fm_context *cpu, fm_context *gpu)
{
    const int64_t R = 2048, C = 1024, nbr = C / 128, nb = R * nbr, ns = R * (C / 32);
    uint8_t *codes = malloc((size_t)(R * C)), *hcodes = malloc((size_t)(R * C / 2)), *hs = malloc((size_t)ns);
    uint8_t *gcodes = malloc((size_t)(R * C / 2)), *gs = malloc((size_t)ns);
    float *sc = malloc((size_t)nb * 4);
    uint64_t rng = 0x5EEDull;
    for (int k = 0; k < 6; k++) {
        const int refuse = k & 1;
        for (int64_t i = 0; i < R * C; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            codes[i] = (uint8_t)(rng >> 56);
        }
        for (int64_t i = 0; i < nb; i++)
            sc[i] = ldexpf(1.0f, (int)(i * 7 % 23) - 11);
        const int64_t bad[3] = {(k * 7919 + 4097) % nb, (k * 131 + 17) % (nb / 2) + 1, nb - 1 - k};
        int64_t first = nb;
        if (refuse)
            for (int j = 0; j < 3; j++) {
                sc[bad[j]] = j == 1 ? -2.0f : 3.0f * (float)(j + 1);
                first = bad[j] < first ? bad[j] : first;
            }
        fm_tensor hin = fm_tensor_2d(codes, FM_DTYPE_E4M3, R, C);
        hin.scale_mode = FM_SCALE_BLOCK_1x128;
        hin.scale_dtype = FM_DTYPE_F32;
        hin.scale = sc;
        fm_tensor hout = hin;
        hout.dtype = FM_DTYPE_E2M1;
        hout.data = hcodes;
        hout.scale_mode = FM_SCALE_MX32;
        hout.scale_dtype = FM_DTYPE_E8M0;
        hout.scale = hs;
        int64_t hnf = -1, nf = 0;
        fm_requant_config hrq = {.rule = FM_REQUANT_TIGHT, .nonfinite_blocks = &hnf};
        const fm_status hst = fm_convert_scaled(cpu, &hrq, &hin, &hout);
        char cmsg[512];
        snprintf(cmsg, sizeof cmsg, "%s", fm_last_error(cpu));
        GT_CHECK(hst == (refuse ? FM_ERR_INVALID_ARG : FM_OK), "sequence call %d: the CPU: %s (%s)", k,
                 fm_status_name(hst), cmsg);

        fm_tensor in = hin;
        in.device = FM_DEVICE_CUDA;
        in.data = dcopy(codes, (size_t)(R * C));
        in.scale = dcopy(sc, (size_t)nb * 4);
        fm_tensor out = hout;
        out.device = FM_DEVICE_CUDA;
        out.data = dalloc((size_t)(R * C / 2), 0xA5);
        out.scale = dalloc((size_t)ns, 0xA5);
        int64_t *dnf = dalloc(8, 0xA5);
        fm_requant_config rq = {.rule = FM_REQUANT_TIGHT, .nonfinite_blocks = dnf};
        GT_CHECK(fm_convert_scaled(gpu, &rq, &in, &out) == FM_OK, "sequence call %d: %s", k, fm_last_error(gpu));
        const fm_status sy = fm_context_synchronize(gpu);
        GT_CUDA(cudaMemcpy(gcodes, out.data, (size_t)(R * C / 2), cudaMemcpyDeviceToHost));
        GT_CUDA(cudaMemcpy(gs, out.scale, (size_t)ns, cudaMemcpyDeviceToHost));
        GT_CUDA(cudaMemcpy(&nf, dnf, 8, cudaMemcpyDeviceToHost));
        if (refuse) {
            char want[96];
            snprintf(want, sizeof want, "block (expert 0, stored row %lld, block %lld) is %g,", (long long)(first / nbr),
                     (long long)(first % nbr), (double)sc[first]);
            GT_CHECK(sy == FM_ERR_INVALID_ARG && strstr(cmsg, want) && !strcmp(fm_last_error(gpu), cmsg),
                     "sequence call %d: %s '%s', the CPU '%s' (%s)", k, fm_status_name(sy), fm_last_error(gpu), cmsg,
                     want);
            GT_CHECK(fm_context_synchronize(gpu) == FM_OK, "sequence call %d: reported twice", k);
            const size_t i = first_written(gcodes, (size_t)(R * C / 2)), j = first_written(gs, (size_t)ns);
            GT_CHECK(i == (size_t)(R * C / 2) && j == (size_t)ns && first_written((unsigned char *)&nf, 8) == 8,
                     "sequence call %d: the refused call wrote (code byte %zu, scale byte %zu, count %llx)", k, i, j,
                     (unsigned long long)nf);
        } else {
            GT_CHECK(sy == FM_OK, "sequence call %d: %s (%s)", k, fm_status_name(sy), fm_last_error(gpu));
            GT_CHECK(!memcmp(gcodes, hcodes, (size_t)(R * C / 2)) && !memcmp(gs, hs, (size_t)ns) && nf == hnf,
                     "sequence call %d: the outputs differ from the CPU's (%lld non-finite blocks, the CPU %lld)", k,
                     (long long)nf, (long long)hnf);
        }
        cudaFree(in.data);
        cudaFree(in.scale);
        cudaFree(out.data);
        cudaFree(out.scale);
        cudaFree(dnf);
    }
    free(codes);
    free(hcodes);
    free(hs);
    free(gcodes);
    free(gs);
    free(sc);
}

int main(void)
{
    const char *name = "test_cuda_device_findings_reported_at_synchronize";
    fm_context *gpu = gt_cuda_context(name), *cpu = gt_cpu_context();
    int32_t ids[T * K];
    for (int64_t i = 0; i < T * K; i++)
        ids[i] = (int32_t)((i * 7 + i / K) % E);
    ids[9] = -1; /* no expert: skipped, not bad */
    int64_t cnt[8] = {0}, need = 0;
    for (int64_t i = 0; i < T * K; i++)
        if (ids[i] >= 0)
            cnt[ids[i]]++;
    for (int64_t e = 0; e < E; e++)
        need += (cnt[e] + PAD - 1) / PAD * PAD;
    const int64_t bound = T * K + E * (PAD - 1);

    /* valid, with and without host_splits */
    GT_CHECK(permute_case(cpu, gpu, "valid", ids, bound, 0, 0) == FM_OK, "the valid routing was refused");
    permute_case(cpu, gpu, "valid, host_splits", ids, need, 1, 0);

    /* bad ids (the first one named), then too few rows */
    int32_t bad[T * K];
    memcpy(bad, ids, sizeof bad);
    bad[41] = (int32_t)E;
    bad[60] = -7;
    GT_CHECK(permute_case(cpu, gpu, "bad id", bad, bound, 0, 1) == FM_ERR_INVALID_ARG, "the CPU took a bad id");
    permute_case(cpu, gpu, "bad id, host_splits", bad, bound, 1, 0);
    GT_CHECK(permute_case(cpu, gpu, "too few rows", ids, need - 1, 0, 1) == FM_ERR_INVALID_ARG,
             "the CPU took too few rows");
    permute_case(cpu, gpu, "too few rows, host_splits", ids, need - 1, 1, 0);

    /* a bad scale: nothing written, reported once, by each kernel kind */
    void *tout;
    size_t tbytes;
    for (size_t k = 0; k < sizeof BAD / sizeof BAD[0]; k++) {
        const badcase *c = &BAD[k];
        const int64_t nbi = c->C / 128, bad = (c->R * nbi) / 2 + 1; /* row R / 2, block 1 */
        GT_CHECK(bad_scale_call(gpu, c, bad, &tout, &tbytes) == FM_OK,
                 "%s: refused at once instead of at the synchronize: %s", c->name, fm_last_error(gpu));
        GT_CHECK(untouched_free(tout, tbytes), "%s: the refused call wrote its output", c->name);
        char want[96];
        snprintf(want, sizeof want, "block (expert 0, stored row %lld, block 1) is 3,", (long long)(c->R / 2));
        fm_status sy = fm_context_synchronize(gpu);
        GT_CHECK(sy == FM_ERR_INVALID_ARG && strstr(fm_last_error(gpu), want), "%s: the bad scale: %s (%s)", c->name,
                 fm_status_name(sy), fm_last_error(gpu));
        GT_CHECK(fm_context_synchronize(gpu) == FM_OK, "%s: the bad scale reported twice: %s", c->name,
                 fm_last_error(gpu));
    }

    conversion_sequence(cpu, gpu);

    /* two findings: the first is reported, the second dropped */
    {
        uint16_t *x = make_x();
        dperm d;
        dperm_make(&d, x, bad, bound);
        GT_CHECK(dperm_run(gpu, &d, NULL) == FM_OK, "the bad permute: %s", fm_last_error(gpu));
        GT_CHECK(bad_scale_call(gpu, &BAD[0], 77, &tout, &tbytes) == FM_OK, "the transpose: %s", fm_last_error(gpu));
        cudaFree(tout);
        fm_status sy = fm_context_synchronize(gpu);
        GT_CHECK(sy == FM_ERR_INVALID_ARG && strstr(fm_last_error(gpu), "expert_ids: entry [20, 1] is 5,"),
                 "two findings: %s (%s)", fm_status_name(sy), fm_last_error(gpu));
        GT_CHECK(fm_context_synchronize(gpu) == FM_OK, "two findings: a second report: %s", fm_last_error(gpu));
        dperm_free(&d);
        free(x);
    }

    /* and a valid call afterwards */
    permute_case(cpu, gpu, "valid after the findings", ids, bound, 0, 0);

    fm_context_destroy(gpu);
    fm_context_destroy(cpu);
    return gt_finish(name);
}
