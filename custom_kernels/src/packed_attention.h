// bertserve.PackedAttention (packed_attention.cc): cuDNN's fused attention over packed sequences.
#pragma once
#include "ort_abi.h"

// The operator, for RegisterCustomOps to add to the bertserve domain (CUDA builds only).
const OrtCustomOp* packed_attention_op(const OrtApi* api);
