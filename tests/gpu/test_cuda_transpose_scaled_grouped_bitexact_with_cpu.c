/* CUDA fm_transpose_scaled_grouped writes the CPU reference's bytes (codes,
 * the grouped scale arrays, GEMM-layout padding, nonfinite count) for every
 * input / output format pair, ragged splits with empty groups and groups of
 * 1, 127, 128 and 129 rows, groups all of whole 128-row tiles (MXFP4 among
 * them under every rule), all rows in one group, and NaN blocks, and the
 * ROWMAX transpose into BLOCK_128x128 (one scale a tile); nothing
 * past the grouped layout is written; non-power-of-two scales are refused
 * alike. fm-xval runs a wider matrix; this is the short form. The same for
 * fm_transpose_scaled_grouped_rows (the token rows read through a permute's
 * row_map, padding and unrouted choices included). */
#include <math.h>
#include <stdint.h>

#include "gpu_test.h"
#include "../routing_ids.h"

static uint64_t rng = 777;
static uint64_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

typedef struct {
    fm_dtype dt;
    fm_scale_mode m;
} fmt;

static const fmt fmts[] = {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128},
                           {FM_DTYPE_E4M3, FM_SCALE_MX32},        {FM_DTYPE_E5M2, FM_SCALE_MX32},
                           {FM_DTYPE_E2M1, FM_SCALE_MX32}};
#define NF (int)(sizeof fmts / sizeof fmts[0])

/* Copies device bytes [0, n + guard) and compares the first n with the host's, the guard with 0xA5. */
static void same_dev(const void *h, const void *d, size_t n, size_t guard, const char *what, const char *cs)
{
    unsigned char *g = malloc(n + guard + 1);
    GT_CUDA(cudaMemcpy(g, d, n + guard, cudaMemcpyDeviceToHost));
    size_t bad = 0, first = n;
    for (size_t i = 0; i < n; i++)
        if (((const unsigned char *)h)[i] != g[i])
            first = bad++ ? first : i;
    size_t over = 0;
    for (size_t i = n; i < n + guard; i++)
        over += g[i] != 0xA5;
    free(g);
    GT_CHECK(bad == 0, "%s: %s: %zu of %zu bytes differ, first at %zu", cs, what, bad, n, first);
    GT_CHECK(over == 0, "%s: %s: %zu bytes written past the grouped layout", cs, what, over);
}

static void *dev_copy(const void *h, size_t n, size_t guard)
{
    void *d;
    GT_CUDA(cudaMalloc(&d, n + guard + 1));
    GT_CUDA(cudaMemset(d, 0xA5, n + guard + 1));
    if (n && h)
        GT_CUDA(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
    return d;
}

/* A grouped column-wise output: the descriptor t, and h, the same over host
 * buffers of its codes (nd bytes) and grouped scale array (ns bytes) filled
 * with the 0xA5 that same_dev checks the device's guard bytes against. */
typedef struct {
    fm_tensor t, h;
    size_t nd, ns;
} gout;

static gout gout_new(fmt fo, int64_t rows, int64_t N, fm_scale_layout sl, const fm_splits *sp)
{
    gout g;
    g.t = fm_tensor_quant_2d(NULL, fo.dt, rows, N, FM_LAYOUT_COLWISE, fo.m, NULL, sl);
    g.nd = (size_t)fm_tensor_nbytes(&g.t);
    g.ns = (size_t)fm_tensor_grouped_scale_count(&g.t, sp) * (fo.m == FM_SCALE_MX32 ? 1 : 4);
    g.h = g.t;
    g.h.data = malloc(g.nd + 1);
    g.h.scale = malloc(g.ns + 1);
    memset(g.h.data, 0xA5, g.nd + 1);
    memset(g.h.scale, 0xA5, g.ns + 1);
    return g;
}

/* After both backends ran a case: the same status, then the same bytes
 * (codes, scales, nonfinite count), or for a refusal the same sentence and
 * the device outputs untouched. A bad scale reaches the CUDA caller at the
 * next synchronize (transpose.h): the call's status when it failed, else
 * the synchronize's. gmsg was kept before synchronising, which clears the
 * context's last error. */
static void same_outcome(fm_context *gpu, const char *cs, fm_status stc, const char *cmsg, fm_status stg,
                         const char *gmsg, const void *hod, const void *od, size_t nod, const void *hos,
                         const void *os, size_t nos, size_t guard, const int64_t *hbad, const void *dbad)
{
    const fm_status sts = fm_context_synchronize(gpu);
    char smsg[768];
    snprintf(smsg, sizeof smsg, "%s", fm_last_error(gpu));
    if (stg == FM_OK) {
        stg = sts;
        gmsg = smsg;
    } else {
        GT_CHECK(sts == FM_OK, "%s: synchronize after a refused call: %s", cs, smsg);
    }
    GT_CHECK(stc == stg, "%s: cpu %s (%s), gpu %s (%s)", cs, fm_status_name(stc), cmsg, fm_status_name(stg), gmsg);
    if (stc == FM_OK && stg == FM_OK) {
        same_dev(hod, od, nod, guard, "codes", cs);
        same_dev(hos, os, nos, guard, "scales", cs);
        same_dev(hbad, dbad, 8, 0, "nonfinite_blocks", cs);
    } else if (stc == FM_ERR_INVALID_ARG) {
        GT_CHECK(!strcmp(cmsg, gmsg), "%s: cpu says '%s', gpu '%s'", cs, cmsg, gmsg);
        same_dev(hod, od, nod, guard, "codes of a refused call", cs);
        same_dev(hos, os, nos, guard, "scales of a refused call", cs);
        int64_t poison; /* dev_copy's fill */
        memset(&poison, 0xA5, sizeof poison);
        same_dev(&poison, dbad, 8, 0, "nonfinite_blocks of a refused call", cs);
    }
}

/* out_off: the device codes start that many bytes past an aligned base
 * (FP8 outputs need only be element-aligned), whose bytes before them must
 * stay untouched too. */
static void run_case(fm_context *cpu, fm_context *gpu, const int64_t *sizes, int64_t G, int64_t N, fmt fi, fmt fo,
                     fm_requant_rule rule, fm_scale_layout sli, fm_scale_layout slo, int nan_blocks, int bad_scale,
                     int out_off)
{
    int64_t rows = 0;
    for (int64_t g = 0; g < G; g++)
        rows += sizes[g];
    char cs[200];
    snprintf(cs, sizeof cs, "%s %s -> %s %s rule %d %s/%s N %lld groups %lld rows %lld%s%s out +%d",
             fm_dtype_name(fi.dt), fm_scale_mode_name(fi.m), fm_dtype_name(fo.dt), fm_scale_mode_name(fo.m), (int)rule,
             fm_scale_layout_name(sli), fm_scale_layout_name(slo), (long long)N, (long long)G, (long long)rows,
             nan_blocks ? " NaN" : "", bad_scale ? " non-pow2 scale" : "", out_off);
    size_t n = (size_t)(rows * N);
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        x[i] = (float)ldexp((double)(int64_t)(rnd() % 2001 - 1000) / 1000.0, (int)(rnd() % 40) - 20);
        if (rnd() % 9 == 0)
            x[i] = 0.0f;
    }
    if (nan_blocks && n > 3) {
        x[rnd() % n] = NAN;
        x[rnd() % n] = -INFINITY;
    }
    fm_tensor in = fm_tensor_quant_2d(NULL, fi.dt, rows, N, FM_LAYOUT_ROWWISE, fi.m, NULL, sli);
    size_t nid = (size_t)fm_tensor_nbytes(&in), nis = (size_t)fm_tensor_scale_nbytes(&in);
    void *hid = malloc(nid + 1), *his = malloc(nis + 1);
    in.data = hid;
    in.scale = his;
    fm_tensor xt = fm_tensor_2d(x, FM_DTYPE_F32, rows, N);
    GT_CHECK(fm_quantize(cpu, NULL, &xt, &in, NULL) == FM_OK, "%s: quantize: %s", cs, fm_last_error(cpu));
    /* and a NaN code under a finite scale: one column block non-finite (a 128x128 tile: all of it) */
    if (nan_blocks && fi.dt != FM_DTYPE_E2M1 && nid > 0)
        ((uint8_t *)hid)[rnd() % nid] = fm_elem_nan(fi.dt);
    if (bad_scale && fi.m == FM_SCALE_BLOCK_1x128 && nis >= 4)
        ((float *)his)[rnd() % (nis / 4)] = 0.75f;

    fm_splits sp = {.groups = G, .host = sizes};
    gout o = gout_new(fo, rows, N, slo, &sp);
    fm_tensor out = o.t;
    const size_t nod = o.nd, nos = o.ns;
    void *hod = o.h.data, *hos = o.h.scale;
    int64_t hbad = -1;
    fm_requant_config ch = {.rule = rule, .nonfinite_blocks = &hbad};
    fm_status stc = fm_transpose_scaled_grouped(cpu, &ch, &sp, &in, &o.h);
    char cmsg[768];
    snprintf(cmsg, sizeof cmsg, "%s", fm_last_error(cpu));

    const size_t guard = 64;
    fm_tensor ind = in, od = out;
    ind.device = od.device = FM_DEVICE_CUDA;
    ind.data = dev_copy(hid, nid, 0);
    ind.scale = dev_copy(his, nis, 0);
    uint8_t *obase = dev_copy(NULL, nod + (size_t)out_off, guard);
    od.data = obase + out_off;
    od.scale = dev_copy(NULL, nos, guard);
    int64_t *dbad = dev_copy(NULL, 8, 0);
    fm_requant_config cd = {.rule = rule, .nonfinite_blocks = dbad};
    fm_status stg = fm_transpose_scaled_grouped(gpu, &cd, &sp, &ind, &od);
    char gmsg[768];
    snprintf(gmsg, sizeof gmsg, "%s", fm_last_error(gpu));
    same_outcome(gpu, cs, stc, cmsg, stg, gmsg, hod, od.data, nod, hos, od.scale, nos, guard, &hbad, dbad);
    if (out_off) {
        uint8_t front[8];
        memset(front, 0xA5, sizeof front);
        same_dev(front, obase, (size_t)out_off, 0, "bytes before the codes", cs);
    }
    cudaFree(ind.data);
    cudaFree(ind.scale);
    cudaFree(obase);
    cudaFree(od.scale);
    cudaFree(dbad);
    free(hid);
    free(his);
    free(hod);
    free(hos);
    free(x);
}

/* fm_transpose_scaled_grouped_rows: T tokens of N columns, k distinct
 * experts of E each (a choice in 5 routed nowhere), padded to `pad` rows by
 * the CPU permute, whose row_map both backends read. */
static void run_rows_case(fm_context *cpu, fm_context *gpu, int64_t T, int64_t N, int64_t E, int k, int pad, fmt fi,
                          fmt fo, fm_requant_rule rule, int nan_blocks, int bad_scale)
{
    char cs[200];
    snprintf(cs, sizeof cs, "rows: %s %s -> %s %s rule %d T %lld N %lld E %lld k %d pad %d%s%s", fm_dtype_name(fi.dt),
             fm_scale_mode_name(fi.m), fm_dtype_name(fo.dt), fm_scale_mode_name(fo.m), (int)rule, (long long)T,
             (long long)N, (long long)E, k, pad, nan_blocks ? " NaN" : "", bad_scale ? " non-pow2 scale" : "");
    const size_t n = (size_t)(T * N);
    float *x = malloc(sizeof(float) * (n + 1));
    for (size_t i = 0; i < n; i++)
        x[i] = rnd() % 9 == 0 ? 0.0f
                              : (float)ldexp((double)(int64_t)(rnd() % 2001 - 1000) / 1000.0, (int)(rnd() % 40) - 20);
    fm_tensor in = fm_tensor_quant_2d(NULL, fi.dt, T, N, FM_LAYOUT_ROWWISE, fi.m, NULL, FM_SCALE_LAYOUT_COMPACT);
    const size_t nid = (size_t)fm_tensor_nbytes(&in), nis = (size_t)fm_tensor_scale_nbytes(&in);
    void *hid = malloc(nid + 1), *his = malloc(nis + 1);
    in.data = hid;
    in.scale = his;
    fm_tensor xt = fm_tensor_2d(x, FM_DTYPE_F32, T, N);
    GT_CHECK(fm_quantize(cpu, NULL, &xt, &in, NULL) == FM_OK, "%s: quantize: %s", cs, fm_last_error(cpu));
    if (nan_blocks && nid > 0)
        ((uint8_t *)hid)[rnd() % nid] = fm_elem_nan(fi.dt);
    if (bad_scale && fi.m == FM_SCALE_BLOCK_1x128 && nis >= 4)
        ((float *)his)[nis / 4 - 1] = 0.75f; /* the last token's, routed or not */

    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(T * k + 1));
    random_routing(ids, T, k, E, rnd);
    const int64_t Rmax = T * k + E * (pad - 1);
    fm_tensor xp = fm_tensor_quant_2d(NULL, fi.dt, Rmax, N, FM_LAYOUT_ROWWISE, fi.m, NULL, FM_SCALE_LAYOUT_COMPACT);
    xp.data = malloc((size_t)fm_tensor_nbytes(&xp) + 1);
    xp.scale = malloc((size_t)fm_tensor_scale_nbytes(&xp) + 1);
    int32_t *rm = malloc(sizeof(int32_t) * (size_t)(Rmax + 1)), *sr = malloc(sizeof(int32_t) * (size_t)(T * k + 1));
    int64_t *spl = malloc(sizeof(int64_t) * (size_t)E), *hs = malloc(sizeof(int64_t) * (size_t)E);
    fm_tensor tid = fm_tensor_2d(ids, FM_DTYPE_I32, T, k), trm = fm_tensor_2d(rm, FM_DTYPE_I32, Rmax, 1);
    fm_tensor tsr = fm_tensor_2d(sr, FM_DTYPE_I32, T, k), tsp = fm_tensor_2d(spl, FM_DTYPE_I64, 1, E);
    fm_permute_config pc = {pad};
    GT_CHECK(fm_moe_permute(cpu, &pc, &in, &tid, NULL, &xp, &trm, &tsr, &tsp, NULL, hs) == FM_OK, "%s: permute: %s",
             cs, fm_last_error(cpu));
    int64_t R = 0;
    for (int64_t e = 0; e < E; e++)
        R += hs[e];
    trm.shape[0] = R;
    fm_splits sp = {.groups = E, .host = hs};

    gout o = gout_new(fo, R, N, FM_SCALE_LAYOUT_COMPACT, &sp);
    fm_tensor out = o.t;
    const size_t nod = o.nd, nos = o.ns;
    void *hod = o.h.data, *hos = o.h.scale;
    int64_t hbad = -1;
    fm_requant_config ch = {.rule = rule, .nonfinite_blocks = &hbad};
    fm_status stc = fm_transpose_scaled_grouped_rows(cpu, &ch, &sp, &in, &trm, k, &o.h);
    char cmsg[768];
    snprintf(cmsg, sizeof cmsg, "%s", fm_last_error(cpu));

    const size_t guard = 64;
    fm_tensor ind = in, od = out, rmd = trm;
    ind.device = od.device = rmd.device = FM_DEVICE_CUDA;
    ind.data = dev_copy(hid, nid, 0);
    ind.scale = dev_copy(his, nis, 0);
    rmd.data = dev_copy(rm, sizeof(int32_t) * (size_t)R, 0);
    od.data = dev_copy(NULL, nod, guard);
    od.scale = dev_copy(NULL, nos, guard);
    int64_t *dbad = dev_copy(NULL, 8, 0);
    fm_requant_config cd = {.rule = rule, .nonfinite_blocks = dbad};
    fm_status stg = fm_transpose_scaled_grouped_rows(gpu, &cd, &sp, &ind, &rmd, k, &od);
    char gmsg[768];
    snprintf(gmsg, sizeof gmsg, "%s", fm_last_error(gpu));
    same_outcome(gpu, cs, stc, cmsg, stg, gmsg, hod, od.data, nod, hos, od.scale, nos, guard, &hbad, dbad);
    cudaFree(ind.data);
    cudaFree(ind.scale);
    cudaFree(rmd.data);
    cudaFree(od.data);
    cudaFree(od.scale);
    cudaFree(dbad);
    free(hid), free(his), free(hod), free(hos), free(x), free(ids), free(xp.data), free(xp.scale);
    free(rm), free(sr), free(spl), free(hs);
}

int main(void)
{
    const char *name = "test_cuda_transpose_scaled_grouped_bitexact_with_cpu";
    fm_context *gpu = gt_cuda_context(name);
    fm_context *cpu = gt_cpu_context();
    static const int64_t s_edge[] = {0, 1, 127, 128, 129, 0, 300}, s_edge2[] = {0, 2, 126, 128, 130, 0, 300};
    static const int64_t s_one[] = {0, 0, 515, 0}, s_one2[] = {0, 0, 516, 0};
    /* whole 128-row tiles in every group (the layer's padded experts): the TMA kernel's grouped case */
    static const int64_t s_whole[] = {128, 0, 384, 256, 0, 128};
    int64_t s_rand[8];
    static const int64_t Ns[] = {7168 / 28, 200, 130, 64};
    int c = 0;
    for (int a = 0; a < NF; a++)
        for (int b = 0; b < NF; b++)
            for (int v = 0; v < 4; v++, c++) {
                const int e2m1_out = fmts[b].dt == FM_DTYPE_E2M1;
                const int64_t *sz;
                int64_t G;
                if (v == 0) {
                    sz = e2m1_out ? s_edge2 : s_edge;
                    G = 7;
                } else if (v == 1) {
                    sz = e2m1_out ? s_one2 : s_one;
                    G = 4;
                } else if (v == 3) {
                    sz = s_whole;
                    G = 6;
                } else {
                    for (int g = 0; g < 8; g++) {
                        s_rand[g] = rnd() % 4 == 0 ? 0 : (int64_t)(rnd() % 400);
                        if (e2m1_out)
                            s_rand[g] &= ~(int64_t)1;
                    }
                    sz = s_rand;
                    G = 8;
                }
                fm_requant_rule rule = FM_REQUANT_TIGHT;
                if (c % 3 == 1 && fmts[a].dt == fmts[b].dt && fmts[a].m == fmts[b].m)
                    rule = FM_REQUANT_ROWMAX;
                else if (c % 3 == 2 && fmts[b].m == FM_SCALE_MX32)
                    rule = FM_REQUANT_MX_FLOOR;
                /* N a multiple of 16 with whole groups, as the TMA kernel needs (272, 288: a partial column tile) */
                const int64_t N = v == 3 ? 256 + 16 * (c % 3) : Ns[c % 4];
                run_case(cpu, gpu, sz, G, N, fmts[a], fmts[b], rule, (fm_scale_layout)(c & 1),
                         (fm_scale_layout)((c >> 1) & 1), c % 5 == 0, 0, 0);
            }
    /* MXFP4 -> MXFP4 in groups of whole tiles (the TMA kernel's MXFP4 form):
     * every rule, each pair of scale layouts, NaN blocks or none, N of one or
     * more column tiles. */
    for (int k = 0; k < 12; k++)
        run_case(cpu, gpu, s_whole, 6, k % 4 < 2 ? 128 : 384, fmts[NF - 1], fmts[NF - 1], (fm_requant_rule)(k % 3),
                 (fm_scale_layout)(k & 1), (fm_scale_layout)((k >> 1) & 1), k % 4 != 0, 0, 0);
    /* ROWMAX into one scale per 128 x 128 tile of each group (the flow
     * recipes' x and h for the weight gradients): both FP8 dtypes, both
     * layouts, NaN tiles. */
    static const fmt tile_out[] = {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128}, {FM_DTYPE_E5M2, FM_SCALE_BLOCK_128x128}};
    for (int k = 0; k < 8; k++) {
        for (int g = 0; g < 8; g++)
            s_rand[g] = rnd() % 4 == 0 ? 0 : (int64_t)(rnd() % 400);
        const int64_t *sz = k % 3 == 0 ? s_edge : k % 3 == 1 ? s_one : s_rand;
        const int64_t G = k % 3 == 0 ? 7 : k % 3 == 1 ? 4 : 8;
        run_case(cpu, gpu, sz, G, Ns[k % 4], fmts[k & 1], tile_out[k & 1], FM_REQUANT_ROWMAX,
                 (fm_scale_layout)((k >> 1) & 1), (fm_scale_layout)((k >> 2) & 1), k % 3 != 1, 0, 0);
    }
    /* ... with whole 128-row tiles in every group (the layer's h, the TMA
     * kernel's grouped case, where the warps agree on a tile's NaN verdict at
     * a barrier): NaN tiles or none, N = 272 for a partial column tile. */
    for (int k = 0; k < 8; k++)
        run_case(cpu, gpu, s_whole, 6, k & 4 ? 272 : 256, fmts[k & 1], tile_out[k & 1], FM_REQUANT_ROWMAX,
                 (fm_scale_layout)((k >> 1) & 1), (fm_scale_layout)((k >> 2) & 1), k % 3 != 2, 0, 0);
    /* codes at an odd address (each output row then starts anywhere; the TMA
     * kernel's ragged stores): ragged groups and whole 128-row ones, both
     * rules, compact and GEMM-layout scales */
    for (int k = 0; k < 6; k++) {
        for (int g = 0; g < 8; g++)
            s_rand[g] = rnd() % 4 == 0 ? 0 : (int64_t)(rnd() % 400);
        const int64_t *sz = k % 3 == 0 ? s_edge : k % 3 == 1 ? s_whole : s_rand;
        const int64_t G = k % 3 == 0 ? 7 : k % 3 == 1 ? 6 : 8;
        run_case(cpu, gpu, sz, G, k & 1 ? 256 : 64, fmts[k & 1], fmts[k & 1],
                 k < 3 ? FM_REQUANT_TIGHT : FM_REQUANT_ROWMAX, (fm_scale_layout)(k & 1), (fm_scale_layout)(k >> 2),
                 k == 2, 0, 1 + (int)(rnd() % 7));
    }
    /* Refusals: non-power-of-two F32 input scales. */
    static const int64_t s_bad[] = {100, 0, 156};
    for (int k = 0; k < 2; k++)
        run_case(cpu, gpu, s_bad, 3, 256, fmts[k], fmts[k], FM_REQUANT_TIGHT, (fm_scale_layout)k,
                 FM_SCALE_LAYOUT_COMPACT, 0, 1, k);
    /* The rows' transpose: FP8 outputs (what the CUDA kernel writes), the
     * flow recipes' TIGHT and ROWMAX tile calls first. */
    static const struct {
        fmt i, o;
        fm_requant_rule rule;
    } rc[] = {
        {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, FM_REQUANT_TIGHT},
        {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E4M3, FM_SCALE_BLOCK_128x128}, FM_REQUANT_ROWMAX},
        {{FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E5M2, FM_SCALE_BLOCK_1x128}, FM_REQUANT_ROWMAX},
        {{FM_DTYPE_E4M3, FM_SCALE_MX32}, {FM_DTYPE_E4M3, FM_SCALE_MX32}, FM_REQUANT_MX_FLOOR},
        {{FM_DTYPE_E4M3, FM_SCALE_BLOCK_1x128}, {FM_DTYPE_E5M2, FM_SCALE_MX32}, FM_REQUANT_TIGHT},
    };
    for (int i = 0; i < 15; i++) {
        const int64_t E = 1 + i % 8;
        const int k = 1 + i % 4 < E ? 1 + i % 4 : (int)E;
        run_rows_case(cpu, gpu, 50 + 97 * (i % 5), i % 3 ? 256 : 7168 / 28 + 16, E, k, i % 2 ? 128 : 16, rc[i % 5].i,
                      rc[i % 5].o, rc[i % 5].rule, i % 3 == 2, 0);
    }
    /* groups of 8-row multiples (every output row of the gathering TMA
     * kernel 8-byte aligned) and of any size (its ragged last tiles and
     * unaligned rows), each under both rules */
    for (int i = 0; i < 4; i++)
        run_rows_case(cpu, gpu, 333, 7168 / 28 + 16, 6, 3, i < 2 ? 8 : 1, rc[i & 1].i, rc[i & 1].o, rc[i & 1].rule,
                      0, 0);
    /* a non-power-of-two scale on the last token: refused alike, routed or not */
    run_rows_case(cpu, gpu, 100, 256, 4, 2, 128, rc[0].i, rc[0].o, FM_REQUANT_TIGHT, 0, 1);
    fm_context_destroy(cpu);
    fm_context_destroy(gpu);
    return gt_finish(name);
}
