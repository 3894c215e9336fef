/* Public MoE ops (router, permute, unpermute, SwiGLU): validate, count,
 * dispatch. None of them is a cast: quantized data moves as codes and
 * scales, and SwiGLU's quantization is part of the fused op, so only the op
 * counters and the bytes are counted.
 *
 * What depends on the data (expert ids in range, the routing fitting in R
 * rows, row indices in range) cannot be checked here without reading device
 * memory: the CPU backend checks it before it writes anything; the CUDA
 * backend checks it on the device and never writes out of bounds. */
#include <stdio.h>

#include "validate.h"

static void count(fm_context *ctx, fm_op op, int64_t rd, int64_t wr)
{
    ctx->stats.calls[op]++;
    ctx->stats.op_calls++;
    ctx->stats.bytes_read += rd;
    ctx->stats.bytes_written += wr;
}

static int64_t tbytes(const fm_tensor *t)
{
    if (!t)
        return 0;
    return fm_tensor_nbytes(t) + (t->scale_mode ? fm_tensor_scale_nbytes(t) : 0);
}


static fm_status check_index(fm_context *ctx, const fm_tensor *t, const char *name, fm_dtype dtype, int64_t rows,
                             int64_t cols)
{
    return fm_check_mat(ctx, t, name, FM_CHK_UNSCALED | FM_CHK_ROWWISE, dtype, rows, cols);
}

/* Each output against every other buffer of the call (NULL entries skipped). */
static fm_status check_outputs_disjoint(fm_context *ctx, fm_tensor *const *outs, const char *const *on, int nout,
                                        const fm_tensor *const *ins, const char *const *in_, int nin)
{
    fm_status st;
    for (int i = 0; i < nout; i++) {
        if (!outs[i])
            continue;
        for (int j = 0; j < nin; j++)
            if (ins[j] && (st = fm_check_no_alias(ctx, outs[i], on[i], ins[j], in_[j])))
                return st;
        for (int j = i + 1; j < nout; j++)
            if (outs[j] && (st = fm_check_no_alias(ctx, outs[i], on[i], outs[j], on[j])))
                return st;
        if (outs[i]->scale_mode &&
            (st = fm_check_disjoint(ctx, outs[i]->data, fm_tensor_nbytes(outs[i]), on[i], outs[i]->scale,
                                    fm_tensor_scale_nbytes(outs[i]), "its own scale")))
            return st;
    }
    return FM_OK;
}

/* A raw pointer argument: aligned, and in the memory of the context. */
static fm_status check_ptr(fm_context *ctx, const void *p, size_t align, const char *name, int want_device)
{
    if ((uintptr_t)p % align)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: %p is not %zu-byte aligned", name, p, align);
    int dev = fm_cuda_pointer_is_device(p);
    if ((dev == 1 && !want_device) || (dev == 0 && want_device))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: %p is %s memory; it must be %s memory", name, p,
                        dev ? "CUDA device" : "host", want_device ? "CUDA device" : "host");
    return FM_OK;
}

static fm_status unsupported(fm_context *ctx, const char *op)
{
    return fm_error(ctx, FM_ERR_UNSUPPORTED, "%s: the %s backend does not implement it", op, ctx->be->name);
}

/* ---- router --------------------------------------------------------------- */

static fm_status check_router_cfg(fm_context *ctx, const fm_router_config *in, fm_router_config *cfg,
                                  const fm_tensor *logits)
{
    fm_status st;
    *cfg = in ? *in : (fm_router_config){0};
    if ((st = fm_check_mat(ctx, logits, "logits", FM_CHK_UNSCALED | FM_CHK_ROWWISE, FM_DTYPE_F32, -1, -1)))
        return st;
    int64_t E = logits->shape[1];
    if (E < 1)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "logits: needs at least one expert column, got [%lld, 0]",
                        (long long)logits->shape[0]);
    if (cfg->topk == 0)
        cfg->topk = 1;
    if (cfg->topk < 1 || cfg->topk > E)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->topk: must be in [1, E = %lld] (0 means 1), got %d",
                        (long long)E, cfg->topk);
    if ((unsigned)cfg->score >= FM_ROUTER_SCORE_COUNT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->score: %d is not an fm_router_score", (int)cfg->score);
    if (cfg->bias && (st = check_ptr(ctx, cfg->bias, sizeof(float), "cfg->bias",
                                     logits->device == FM_DEVICE_CUDA)))
        return st;
    return FM_OK;
}

fm_status fm_moe_router(fm_context *ctx, const fm_router_config *cfg_in, const fm_tensor *logits,
                        fm_tensor *expert_ids, fm_tensor *probs, fm_tensor *tokens_per_expert)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_router_config cfg;
    fm_status st;
    if ((st = check_router_cfg(ctx, cfg_in, &cfg, logits)))
        return st;
    int64_t T = logits->shape[0], E = logits->shape[1], k = cfg.topk;
    if ((st = check_index(ctx, expert_ids, "expert_ids", FM_DTYPE_I32, T, k)))
        return st;
    if ((st = check_index(ctx, probs, "probs", FM_DTYPE_F32, T, k)))
        return st;
    if (tokens_per_expert && (st = check_index(ctx, tokens_per_expert, "tokens_per_expert", FM_DTYPE_I64, 1, E)))
        return st;
    fm_tensor *outs[3] = {expert_ids, probs, tokens_per_expert};
    static const char *const on[3] = {"expert_ids", "probs", "tokens_per_expert"};
    const fm_tensor *ins[1] = {logits};
    static const char *const in_[1] = {"logits"};
    if ((st = check_outputs_disjoint(ctx, outs, on, 3, ins, in_, 1)))
        return st;
    for (int i = 0; i < 3; i++)
        if (outs[i] && cfg.bias &&
            (st = fm_check_disjoint(ctx, cfg.bias, E * (int64_t)sizeof(float), "cfg->bias", outs[i]->data,
                                    fm_tensor_nbytes(outs[i]), on[i])))
            return st;
    if (!ctx->be->moe_router)
        return unsupported(ctx, "fm_moe_router");
    if ((st = ctx->be->moe_router(ctx, &cfg, logits, expert_ids, probs, tokens_per_expert)))
        return st;
    count(ctx, FM_OP_MOE_ROUTER, tbytes(logits) + (cfg.bias ? E * 4 : 0),
          tbytes(expert_ids) + tbytes(probs) + tbytes(tokens_per_expert));
    return FM_OK;
}

fm_status fm_moe_router_backward(fm_context *ctx, const fm_router_config *cfg_in, const fm_tensor *logits,
                                 const fm_tensor *expert_ids, const fm_tensor *dprobs, fm_tensor *dlogits)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_router_config cfg;
    fm_status st;
    if ((st = check_router_cfg(ctx, cfg_in, &cfg, logits)))
        return st;
    int64_t T = logits->shape[0], E = logits->shape[1], k = cfg.topk;
    if ((st = check_index(ctx, expert_ids, "expert_ids", FM_DTYPE_I32, T, k)))
        return st;
    if ((st = check_index(ctx, dprobs, "dprobs", FM_DTYPE_F32, T, k)))
        return st;
    if ((st = check_index(ctx, dlogits, "dlogits", FM_DTYPE_F32, T, E)))
        return st;
    fm_tensor *outs[1] = {dlogits};
    static const char *const on[1] = {"dlogits"};
    const fm_tensor *ins[3] = {logits, expert_ids, dprobs};
    static const char *const in_[3] = {"logits", "expert_ids", "dprobs"};
    if ((st = check_outputs_disjoint(ctx, outs, on, 1, ins, in_, 3)))
        return st;
    if (!ctx->be->moe_router_backward)
        return unsupported(ctx, "fm_moe_router_backward");
    if ((st = ctx->be->moe_router_backward(ctx, &cfg, logits, expert_ids, dprobs, dlogits)))
        return st;
    count(ctx, FM_OP_MOE_ROUTER_BACKWARD, tbytes(logits) + tbytes(expert_ids) + tbytes(dprobs), tbytes(dlogits));
    return FM_OK;
}

/* ---- permute / unpermute ----------------------------------------------------- */

fm_status fm_moe_permute(fm_context *ctx, const fm_permute_config *cfg_in, const fm_tensor *x,
                         const fm_tensor *expert_ids, const fm_tensor *probs, fm_tensor *out, fm_tensor *row_map,
                         fm_tensor *slot_rows, fm_tensor *splits, fm_tensor *out_probs, int64_t *host_splits)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_permute_config cfg = cfg_in ? *cfg_in : (fm_permute_config){0};
    fm_status st;
    if (cfg.pad_multiple < 0)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->pad_multiple: must be >= 0 (0 or 1: no padding), got %d",
                        cfg.pad_multiple);
    if ((st = fm_check_rows(ctx, x, "x", -1, -1, 1)))
        return st;
    int64_t T = x->shape[0], H = x->shape[1];
    if ((st = check_index(ctx, expert_ids, "expert_ids", FM_DTYPE_I32, T, -1)))
        return st;
    int64_t k = expert_ids->shape[1];
    if (k < 1)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "expert_ids: needs k >= 1 columns, got [%lld, 0]", (long long)T);
    if ((st = check_index(ctx, splits, "splits", FM_DTYPE_I64, 1, -1)))
        return st;
    int64_t E = splits->shape[1];
    if (E < 1)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "splits: needs E >= 1 columns (one per expert), got [1, 0]");
    if ((st = fm_check_mat(ctx, out, "out", FM_CHK_ROWWISE, x->dtype, -1, H)))
        return st;
    int64_t R = out->shape[0];
    if (out->scale_mode != x->scale_mode || out->scale_layout != x->scale_layout)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "out: must have x's scale mode and layout (%s, %s) because codes and scales are moved, not "
                        "re-encoded; got %s, %s",
                        fm_scale_mode_name(x->scale_mode), fm_scale_layout_name(x->scale_layout),
                        fm_scale_mode_name(out->scale_mode), fm_scale_layout_name(out->scale_layout));
    if ((st = check_index(ctx, row_map, "row_map", FM_DTYPE_I32, R, 1)))
        return st;
    if ((st = check_index(ctx, slot_rows, "slot_rows", FM_DTYPE_I32, T, k)))
        return st;
    if (probs && (st = check_index(ctx, probs, "probs", FM_DTYPE_F32, T, k)))
        return st;
    if (out_probs) {
        if (!probs)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "out_probs: given, so probs [T, k] F32 must be given too");
        if ((st = check_index(ctx, out_probs, "out_probs", FM_DTYPE_F32, R, 1)))
            return st;
    }
    if (R > INT32_MAX || T * k > INT32_MAX)
        return fm_error(ctx, FM_ERR_INVALID_ARG,
                        "out, expert_ids: row indices are I32, so R (%lld) and T * k (%lld) must be < 2^31",
                        (long long)R, (long long)(T * k));
    if (host_splits && (st = check_ptr(ctx, host_splits, sizeof(int64_t), "host_splits", 0)))
        return st;
    fm_tensor *outs[5] = {out, row_map, slot_rows, splits, out_probs};
    static const char *const on[5] = {"out", "row_map", "slot_rows", "splits", "out_probs"};
    const fm_tensor *ins[3] = {x, expert_ids, probs};
    static const char *const in_[3] = {"x", "expert_ids", "probs"};
    if ((st = check_outputs_disjoint(ctx, outs, on, 5, ins, in_, 3)))
        return st;
    if (!ctx->be->moe_permute)
        return unsupported(ctx, "fm_moe_permute");
    if ((st = ctx->be->moe_permute(ctx, &cfg, x, expert_ids, probs, out, row_map, slot_rows, splits, out_probs,
                                   host_splits)))
        return st;
    count(ctx, FM_OP_MOE_PERMUTE, tbytes(x) + tbytes(expert_ids) + tbytes(probs),
          tbytes(out) + tbytes(row_map) + tbytes(slot_rows) + tbytes(splits) + tbytes(out_probs));
    return FM_OK;
}

fm_status fm_moe_unpermute(fm_context *ctx, const fm_tensor *y, const fm_tensor *slot_rows, const fm_tensor *probs,
                           fm_tensor *out)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_status st;
    if ((st = fm_check_rows(ctx, y, "y", -1, -1, 0)))
        return st;
    if ((st = check_index(ctx, slot_rows, "slot_rows", FM_DTYPE_I32, -1, -1)))
        return st;
    int64_t T = slot_rows->shape[0], k = slot_rows->shape[1], H = y->shape[1];
    if (k < 1)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "slot_rows: needs k >= 1 columns, got [%lld, 0]", (long long)T);
    if (probs && (st = check_index(ctx, probs, "probs", FM_DTYPE_F32, T, k)))
        return st;
    if ((st = fm_check_rows(ctx, out, "out", T, H, 0)))
        return st;
    fm_tensor *outs[1] = {out};
    static const char *const on[1] = {"out"};
    const fm_tensor *ins[3] = {y, slot_rows, probs};
    static const char *const in_[3] = {"y", "slot_rows", "probs"};
    if ((st = check_outputs_disjoint(ctx, outs, on, 1, ins, in_, 3)))
        return st;
    if (!ctx->be->moe_unpermute)
        return unsupported(ctx, "fm_moe_unpermute");
    if ((st = ctx->be->moe_unpermute(ctx, y, slot_rows, probs, out)))
        return st;
    /* Rows no slot points at (padding) are not read. */
    int64_t esz = fm_dtype_bits(y->dtype) / 8;
    count(ctx, FM_OP_MOE_UNPERMUTE, T * k * H * esz + tbytes(slot_rows) + tbytes(probs), tbytes(out));
    return FM_OK;
}

fm_status fm_moe_unpermute_backward(fm_context *ctx, const fm_tensor *dout, const fm_tensor *y,
                                    const fm_tensor *row_map, const fm_tensor *slot_rows, const fm_tensor *probs,
                                    fm_tensor *dy, fm_tensor *dprobs)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_status st;
    if ((st = fm_check_rows(ctx, dout, "dout", -1, -1, 0)))
        return st;
    int64_t T = dout->shape[0], H = dout->shape[1];
    if ((st = check_index(ctx, slot_rows, "slot_rows", FM_DTYPE_I32, T, -1)))
        return st;
    int64_t k = slot_rows->shape[1];
    if (k < 1)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "slot_rows: needs k >= 1 columns, got [%lld, 0]", (long long)T);
    if ((st = fm_check_rows(ctx, dy, "dy", -1, H, 0)))
        return st;
    int64_t R = dy->shape[0];
    if ((st = check_index(ctx, row_map, "row_map", FM_DTYPE_I32, R, 1)))
        return st;
    if (probs && (st = check_index(ctx, probs, "probs", FM_DTYPE_F32, T, k)))
        return st;
    if (dprobs) {
        if (!probs)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "dprobs: given, so probs [T, k] F32 (the forward's weights) must be given too");
        if (!y)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "y: dprobs is asked for, so the forward's input y is required");
        if ((st = check_index(ctx, dprobs, "dprobs", FM_DTYPE_F32, T, k)))
            return st;
    }
    if (y && (st = fm_check_rows(ctx, y, "y", R, H, 0)))
        return st;
    fm_tensor *outs[2] = {dy, dprobs};
    static const char *const on[2] = {"dy", "dprobs"};
    const fm_tensor *ins[5] = {dout, y, row_map, slot_rows, probs};
    static const char *const in_[5] = {"dout", "y", "row_map", "slot_rows", "probs"};
    if ((st = check_outputs_disjoint(ctx, outs, on, 2, ins, in_, 5)))
        return st;
    if (!ctx->be->moe_unpermute_backward)
        return unsupported(ctx, "fm_moe_unpermute_backward");
    if ((st = ctx->be->moe_unpermute_backward(ctx, dout, dprobs ? y : NULL, row_map, slot_rows, probs, dy, dprobs)))
        return st;
    int64_t yread = dprobs ? T * k * H * (fm_dtype_bits(y->dtype) / 8) : 0;
    count(ctx, FM_OP_MOE_UNPERMUTE_BACKWARD,
          tbytes(dout) + yread + tbytes(row_map) + tbytes(slot_rows) + tbytes(probs), tbytes(dy) + tbytes(dprobs));
    return FM_OK;
}

/* ---- SwiGLU ---------------------------------------------------------------- */

static fm_status check_quant_cfg(fm_context *ctx, const fm_quant_config *in, fm_quant_config *cfg)
{
    *cfg = in ? *in : (fm_quant_config){0};
    if ((unsigned)cfg->rule >= FM_SCALE_RULE_COUNT)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->rule: %d is not an fm_scale_rule", (int)cfg->rule);
    if (!(cfg->epsilon >= 0.0f) || !fm_f32_is_finite(cfg->epsilon))
        return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->epsilon: must be finite and >= 0, got %g",
                        (double)cfg->epsilon);
    int want_dev = fm_context_device(ctx) == FM_DEVICE_CUDA;
    fm_status st;
    if (cfg->amax && (st = check_ptr(ctx, cfg->amax, sizeof(float), "cfg->amax", want_dev)))
        return st;
    if (cfg->nonfinite_blocks &&
        (st = check_ptr(ctx, cfg->nonfinite_blocks, sizeof(int64_t), "cfg->nonfinite_blocks", want_dev)))
        return st;
    return FM_OK;
}

/* The quantized (or unscaled) outputs of the SwiGLU ops, [M, C] each: what
 * fm_quantize accepts for its outputs, or an unscaled row-wise copy. */
static fm_status check_act_outputs(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *row,
                                   const char *rn, const fm_tensor *col, const char *cn, int64_t M, int64_t C)
{
    fm_status st;
    if (!row)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: the descriptor pointer is NULL", rn);
    int high = row->dtype == FM_DTYPE_F32 || row->dtype == FM_DTYPE_BF16 || row->dtype == FM_DTYPE_F16;
    const fm_tensor *q[2] = {high ? NULL : row, col};
    const char *qn[2] = {rn, cn};
    if (high) {
        if ((st = fm_check_mat(ctx, row, rn, FM_CHK_ROWWISE | FM_CHK_UNSCALED | FM_CHK_HIGH, FM_DTYPE_COUNT, M, C)))
            return st;
        if (col)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "%s: must be NULL when %s is unscaled %s (a column-wise copy is a quantized output)", cn,
                            rn, fm_dtype_name(row->dtype));
        /* Nothing is quantized, so nothing would write them: a caller would read what was there before. */
        if (cfg->amax || cfg->nonfinite_blocks)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "%s: describes the quantized result, but %s is unscaled %s and nothing is quantized; "
                            "leave it NULL",
                            cfg->amax ? "cfg->amax" : "cfg->nonfinite_blocks", rn, fm_dtype_name(row->dtype));
    }
    for (int i = 0; i < 2; i++) {
        if (!q[i])
            continue;
        unsigned lay = i == 0 ? FM_CHK_ROWWISE : FM_CHK_COLWISE;
        if ((st = fm_check_tensor(ctx, q[i], qn[i], FM_CHK_QUANT | lay)))
            return st;
        if (q[i]->ndim != 2 || q[i]->shape[0] != M || q[i]->shape[1] != C)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "%s: logical shape must be 2-D [%lld, %lld], got ndim %d [%lld, %lld]",
                            qn[i], (long long)M, (long long)C, q[i]->ndim, (long long)q[i]->shape[0],
                            (long long)q[i]->shape[1]);
        fm_scale_rule r = fm_effective_rule(cfg->rule, q[i]->scale_mode);
        if (q[i]->scale_mode == FM_SCALE_MX32 && r == FM_SCALE_RULE_EXACT)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "cfg->rule: EXACT scales cannot be stored as E8M0 (%s is MX32); use POW2 or MX_FLOOR",
                            qn[i]);
        if (q[i]->scale_mode != FM_SCALE_MX32 && r == FM_SCALE_RULE_MX_FLOOR)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "cfg->rule: MX_FLOOR applies to MX32 only, %s is %s", qn[i],
                            fm_scale_mode_name(q[i]->scale_mode));
    }
    return FM_OK;
}

/* cfg->amax and cfg->nonfinite_blocks are outputs too. */
static fm_status check_cfg_disjoint(fm_context *ctx, const fm_quant_config *cfg, const fm_tensor *const *ts,
                                    const char *const *tn, int n)
{
    const void *p[2] = {cfg->amax, cfg->nonfinite_blocks};
    int64_t pn[2] = {sizeof(float), sizeof(int64_t)};
    static const char *const pname[2] = {"cfg->amax", "cfg->nonfinite_blocks"};
    fm_status st;
    for (int a = 0; a < 2; a++) {
        if (!p[a])
            continue;
        for (int i = 0; i < n; i++) {
            if (!ts[i])
                continue;
            if ((st = fm_check_disjoint(ctx, p[a], pn[a], pname[a], ts[i]->data, fm_tensor_nbytes(ts[i]), tn[i])))
                return st;
            if (ts[i]->scale_mode && (st = fm_check_disjoint(ctx, p[a], pn[a], pname[a], ts[i]->scale,
                                                             fm_tensor_scale_nbytes(ts[i]), tn[i])))
                return st;
        }
    }
    return fm_check_disjoint(ctx, p[0], pn[0], pname[0], p[1], pn[1], pname[1]);
}

/* What both SwiGLU directions take: the quantize config, in [M, 2I] (BF16,
 * F32 or row-wise quantized) and the optional probs [M, 1] F32. */
static fm_status check_swiglu_in(fm_context *ctx, const fm_quant_config *cfg_in, fm_quant_config *cfg,
                                 const fm_tensor *in, const fm_tensor *probs, int64_t *M, int64_t *I)
{
    fm_status st;
    if ((st = check_quant_cfg(ctx, cfg_in, cfg)))
        return st;
    if ((st = fm_check_rows(ctx, in, "in", -1, -1, 1)))
        return st;
    if (in->shape[1] % 2)
        return fm_error(ctx, FM_ERR_INVALID_ARG, "in: columns must be 2I (gate | up), got an odd %lld",
                        (long long)in->shape[1]);
    *M = in->shape[0];
    *I = in->shape[1] / 2;
    if (probs && (st = check_index(ctx, probs, "probs", FM_DTYPE_F32, *M, 1)))
        return st;
    return FM_OK;
}

fm_status fm_moe_swiglu(fm_context *ctx, const fm_quant_config *cfg_in, const fm_tensor *in, const fm_tensor *probs,
                        fm_tensor *out_row, fm_tensor *out_col, fm_tensor *in_saved)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_quant_config cfg;
    int64_t M, I;
    fm_status st = check_swiglu_in(ctx, cfg_in, &cfg, in, probs, &M, &I);
    if (st)
        return st;
    if ((st = check_act_outputs(ctx, &cfg, out_row, "out_row", out_col, "out_col", M, I)))
        return st;
    if (in_saved) {
        if (in->scale_mode != FM_SCALE_NONE)
            return fm_error(ctx, FM_ERR_INVALID_ARG,
                            "in_saved: only an unscaled in (BF16/F32) is saved in the same pass; in is already %s %s",
                            fm_dtype_name(in->dtype), fm_scale_mode_name(in->scale_mode));
        if (in_saved->dtype == FM_DTYPE_F32 || in_saved->dtype == FM_DTYPE_BF16 || in_saved->dtype == FM_DTYPE_F16)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "in_saved: must be a quantized row-wise copy, got %s",
                            fm_dtype_name(in_saved->dtype));
        if ((st = check_act_outputs(ctx, &cfg, in_saved, "in_saved", NULL, NULL, M, 2 * I)))
            return st;
    }
    fm_tensor *outs[3] = {out_row, out_col, in_saved};
    static const char *const on[3] = {"out_row", "out_col", "in_saved"};
    const fm_tensor *ins[2] = {in, probs};
    static const char *const in_[2] = {"in", "probs"};
    if ((st = check_outputs_disjoint(ctx, outs, on, 3, ins, in_, 2)))
        return st;
    const fm_tensor *all[5] = {in, probs, out_row, out_col, in_saved};
    static const char *const alln[5] = {"in", "probs", "out_row", "out_col", "in_saved"};
    if ((st = check_cfg_disjoint(ctx, &cfg, all, alln, 5)))
        return st;
    if (!ctx->be->moe_swiglu)
        return unsupported(ctx, "fm_moe_swiglu");
    if ((st = ctx->be->moe_swiglu(ctx, &cfg, in, probs, out_row, out_col, in_saved)))
        return st;
    count(ctx, FM_OP_MOE_SWIGLU, tbytes(in) + tbytes(probs), tbytes(out_row) + tbytes(out_col) + tbytes(in_saved));
    return FM_OK;
}

fm_status fm_moe_swiglu_backward(fm_context *ctx, const fm_quant_config *cfg_in, const fm_tensor *dh,
                                 const fm_tensor *in, const fm_tensor *probs, fm_tensor *din_row, fm_tensor *din_col,
                                 fm_tensor *dprobs)
{
    if (!ctx)
        return FM_ERR_INVALID_ARG;
    fm_error_clear(ctx);
    fm_quant_config cfg;
    int64_t M, I;
    fm_status st = check_swiglu_in(ctx, cfg_in, &cfg, in, probs, &M, &I);
    if (st)
        return st;
    if ((st = fm_check_rows(ctx, dh, "dh", M, I, 1)))
        return st;
    if (dprobs) {
        if (!probs)
            return fm_error(ctx, FM_ERR_INVALID_ARG, "dprobs: given, so probs [M, 1] F32 must be given too");
        if ((st = check_index(ctx, dprobs, "dprobs", FM_DTYPE_F32, M, 1)))
            return st;
    }
    if ((st = check_act_outputs(ctx, &cfg, din_row, "din_row", din_col, "din_col", M, 2 * I)))
        return st;
    fm_tensor *outs[3] = {din_row, din_col, dprobs};
    static const char *const on[3] = {"din_row", "din_col", "dprobs"};
    const fm_tensor *ins[3] = {dh, in, probs};
    static const char *const in_[3] = {"dh", "in", "probs"};
    if ((st = check_outputs_disjoint(ctx, outs, on, 3, ins, in_, 3)))
        return st;
    const fm_tensor *all[6] = {dh, in, probs, din_row, din_col, dprobs};
    static const char *const alln[6] = {"dh", "in", "probs", "din_row", "din_col", "dprobs"};
    if ((st = check_cfg_disjoint(ctx, &cfg, all, alln, 6)))
        return st;
    if (!ctx->be->moe_swiglu_backward)
        return unsupported(ctx, "fm_moe_swiglu_backward");
    if ((st = ctx->be->moe_swiglu_backward(ctx, &cfg, dh, in, probs, din_row, din_col, dprobs)))
        return st;
    count(ctx, FM_OP_MOE_SWIGLU_BACKWARD, tbytes(dh) + tbytes(in) + tbytes(probs),
          tbytes(din_row) + tbytes(din_col) + tbytes(dprobs));
    return FM_OK;
}
