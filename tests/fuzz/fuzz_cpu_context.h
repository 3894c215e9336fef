/* The context of the harnesses that run library ops: the CPU backend with
 * one worker thread, so that an execution is cheap and its outcome does not
 * depend on scheduling. */
#ifndef FM_FUZZ_CPU_CONTEXT_H
#define FM_FUZZ_CPU_CONTEXT_H

#include <stdlib.h>

#include "flowmoe/flowmoe.h"

static inline fm_context *fz_cpu_context(void)
{
    fm_context_config cfg = {.backend = FM_BACKEND_CPU, .cpu_threads = 1};
    fm_context *ctx = NULL;
    if (fm_context_create(&cfg, &ctx) != FM_OK)
        abort();
    return ctx;
}

#endif
