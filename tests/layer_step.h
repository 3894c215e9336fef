/* One MoE layer step, shared by the CPU and the GPU tests: create, refresh,
 * forward, backward, synchronize (a no-op on the CPU), destroy; *info (if
 * given) gets the layer's facts after the step. */
#ifndef FM_TEST_LAYER_STEP_H
#define FM_TEST_LAYER_STEP_H

#include "flowmoe/flowmoe.h"

static inline fm_status layer_step(fm_context *ctx, const fm_moe_layer_config *cfg, const fm_moe_weights *w,
                                   const fm_tensor *x, fm_tensor *y, const fm_tensor *dy, fm_tensor *dx,
                                   fm_moe_layer_info *info)
{
    fm_moe_layer *L = NULL;
    fm_status st = fm_moe_layer_create(ctx, cfg, &L);
    if (!st)
        st = fm_moe_layer_refresh_weights(L, w);
    if (!st)
        st = fm_moe_layer_forward(L, w, x, y);
    if (!st)
        st = fm_moe_layer_backward(L, w, x, dy, dx);
    if (!st)
        st = fm_context_synchronize(ctx);
    if (!st && info)
        st = fm_moe_layer_get_info(L, info);
    fm_moe_layer_destroy(L);
    return st;
}

#endif
