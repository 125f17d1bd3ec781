// The LayerNorm that bertserve.MatMulSkipLayerNorm (matmul_epilogues.cc) runs after its product, in
// place (layer_norm_kernel.cu, built by nvcc where build.sh finds one).
#pragma once

#ifndef BERTSERVE_HOST_REFERENCE
#include <cuda_runtime_api.h>

#include <cstdint>

// Widths the kernel takes: a multiple of 8 (16-byte pieces) up to kLayerNormMaxWidth.
constexpr int kLayerNormMaxWidth = 2048;
bool layer_norm_supports(int64_t width);
// y [rows, width] fp16 <- LayerNorm(y + skip) · gamma + beta, row by row (fp32 statistics); skip may be
// null (y already holds the sum) or [rows, width] fp16.
cudaError_t layer_norm_in_place_launch(void* y, const void* skip, const void* gamma, const void* beta, int64_t rows,
                                       int64_t width, float epsilon, cudaStream_t stream);
// cudaSuccess where this device can run the kernel (the library holds code for compute capability 8.0 on).
cudaError_t layer_norm_available();
#endif
