/* flowmoe — low-precision MoE training primitives. One include for all. */
#ifndef FLOWMOE_H
#define FLOWMOE_H

#include "flowmoe/types.h"
#include "flowmoe/tensor.h"
#include "flowmoe/context.h"
#include "flowmoe/format.h"
#include "flowmoe/mathfn.h"
#include "flowmoe/quant.h"
#include "flowmoe/transpose.h"
#include "flowmoe/gemm.h"
#include "flowmoe/moe.h"
#include "flowmoe/comm.h"
#include "flowmoe/layer.h"

#define FLOWMOE_VERSION_MAJOR 0
#define FLOWMOE_VERSION_MINOR 1
#define FLOWMOE_VERSION_PATCH 0

#endif
