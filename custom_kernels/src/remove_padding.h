// bertserve.RemovePadding: the operator (remove_padding.cc) and its GPU kernels (remove_padding_kernel.cu,
// built by nvcc where build.sh finds one).
#pragma once
#include "ort_abi.h"

#ifndef BERTSERVE_HOST_REFERENCE
#include <cuda_runtime_api.h>

#include <cstdint>

// From each row's real-token count (device, [batch], int32): cumulative [batch + 1] (cumulative[batch] is
// the real tokens in all), token_offset [batch, length] (the real tokens' padded positions in order, then
// the padding's) and longest [1], all on the device.
cudaError_t token_offsets_launch(const int* counts, int batch, int length, int* token_offset, int* cumulative,
                                 int* longest, cudaStream_t stream);
// out [tokens, width] <- the rows of in [batch · length, width] that token_offset lists first; element_bytes
// 2 or 4, width · element_bytes a multiple of 4.
cudaError_t gather_rows_launch(void* out, const void* in, const int* token_offset, int64_t tokens, int64_t row_bytes,
                               cudaStream_t stream);
cudaError_t remove_padding_available();
#endif

// The operator (one per element type it takes), for RegisterCustomOps to add to the bertserve domain.
#include <vector>
std::vector<const OrtCustomOp*> remove_padding_ops(const OrtApi* api);
