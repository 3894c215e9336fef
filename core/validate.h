/* Descriptor validation shared by every public op. Each check records a
 * sentence naming the argument and the rule, and returns the status. */
#ifndef FLOWMOE_VALIDATE_H
#define FLOWMOE_VALIDATE_H

#include "internal.h"

/* What a tensor argument may be. */
enum {
    FM_CHK_UNSCALED = 1 << 0,  /* scale_mode must be NONE */
    FM_CHK_QUANT = 1 << 1,     /* element dtype E4M3/E5M2/E2M1 with a scale mode */
    FM_CHK_HIGH = 1 << 2,      /* dtype F32, BF16 or F16 */
    FM_CHK_ROWWISE = 1 << 3,   /* layout must be row-wise */
    FM_CHK_COLWISE = 1 << 4,   /* layout must be column-wise */
    FM_CHK_SCALES_ONLY = 1 << 5 /* only the scale array is used: data may be NULL */
};

/* The common rules for a tensor argument `name`: non-null, shape, dtype,
 * layout, device of the context, data and scale present and aligned. */
fm_status fm_check_tensor(fm_context *ctx, const fm_tensor *t, const char *name, unsigned flags);
/* Same logical shape (and ndim). */
fm_status fm_check_same_shape(fm_context *ctx, const fm_tensor *a, const char *an, const fm_tensor *b,
                              const char *bn);
/* The byte ranges [p, p + n) of two buffers must not overlap. */
fm_status fm_check_disjoint(fm_context *ctx, const void *p, int64_t pn, const char *pname, const void *q,
                            int64_t qn, const char *qname);
/* Every data and scale buffer of an output against those of another tensor. */
fm_status fm_check_no_alias(fm_context *ctx, const fm_tensor *out, const char *on, const fm_tensor *other,
                            const char *tn);

/* Group sizes along `rows` rows of tensor `rows_name`: groups in 1..2^24
 * (and equal to `groups` with its owner's name, unless groups < 0), host
 * sizes present, each >= 0, adding up to rows; device sizes aligned. `op`
 * names the call in the sentences. */
fm_status fm_check_splits(fm_context *ctx, const fm_splits *splits, int64_t rows, const char *rows_name,
                          int64_t groups, const char *groups_owner, const char *op);

/* A 2-D tensor (the fm_check_tensor rules with `flags`) of `dtype`
 * (FM_DTYPE_COUNT: any that flags admit) and shape [rows, cols] (-1: any). */
fm_status fm_check_mat(fm_context *ctx, const fm_tensor *t, const char *name, unsigned flags, fm_dtype dtype,
                       int64_t rows, int64_t cols);

/* Row-wise data the MoE and EP ops move or decode, [rows, cols] (-1: any):
 * F32/BF16/F16 unscaled, or (allow_quant) quantized with power-of-two row
 * blocks (BLOCK_1x128 or MX32) in the compact scale layout, the layout that
 * travels with the rows. */
fm_status fm_check_rows(fm_context *ctx, const fm_tensor *t, const char *name, int64_t rows, int64_t cols,
                        int allow_quant);

#endif
