// bertserve.PackedAttention: the operator (packed_attention.cc) and its GPU kernel
// (packed_attention_kernel.cu, built by nvcc where build.sh finds one).
#pragma once
#include "ort_abi.h"

#ifndef BERTSERVE_HOST_REFERENCE
#include <cuda_runtime_api.h>

struct PackedAttentionArgs {
  const void *q, *k, *v;  // rows of heads · head_size fp16, in_stride elements apart
  void* o;                // [T, heads · head_size] fp16
  const int* cu_seqlens;  // [batch + 1] on the device: sequence b is rows cu[b] .. cu[b + 1] - 1
  int batch, max_len, heads, head_size;
  float scale;
  int in_stride;  // heads · head_size for three tensors, 3 · heads · head_size for one Q|K|V product
};

bool packed_attention_supports(int head_size);
cudaError_t packed_attention_launch(const PackedAttentionArgs& args, cudaStream_t stream);
// cudaSuccess where this device can run the kernel (compute capability 8.0 and later).
cudaError_t packed_attention_available();
#endif

// The operator (one per element type it takes), for RegisterCustomOps to add to the bertserve domain.
#include <vector>
std::vector<const OrtCustomOp*> packed_attention_ops(const OrtApi* api);
