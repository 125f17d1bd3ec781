// The LayerNorm of bertserve.MatMulSkipLayerNorm, in place over the rows its product wrote (which
// already hold X·W + bias + skip): one warp a row, the row kept in registers between reading it and
// writing it back, statistics in fp32 in two passes over the registers (mean, then the squared
// deviations). A row is read once and written once: ORT's SkipLayerNormalization reads the product and
// the skip apart, one tensor more per layer norm.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "layer_norm.h"

namespace {

constexpr int kWarps = 4;  // rows a block takes

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// Pieces: 16-byte pieces (8 values) a lane holds; a row has width / 8 of them, lane l takes l, l + 32, ...
template <int Pieces, bool AddSkip>
__global__ void __launch_bounds__(32 * kWarps)
    layer_norm_in_place(__half* __restrict__ y, const __half* __restrict__ skip, const __half* __restrict__ gamma,
                        const __half* __restrict__ beta, int64_t rows, int width, float epsilon) {
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32, pieces = width / 8;
  uint4* const line = reinterpret_cast<uint4*>(y + row * width);
  float x[Pieces][8];
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < Pieces; ++i) {
    const int c = lane + i * 32;
    uint4 raw = c < pieces ? line[c] : make_uint4(0, 0, 0, 0);  // zeros past the row add nothing
    uint4 added = AddSkip && c < pieces ? reinterpret_cast<const uint4*>(skip + row * width)[c] : make_uint4(0, 0, 0, 0);
    const __half2 *h = reinterpret_cast<const __half2*>(&raw), *a = reinterpret_cast<const __half2*>(&added);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float2 f = __half22float2(h[j]);
      if (AddSkip) {
        const float2 g = __half22float2(a[j]);
        f.x += g.x, f.y += g.y;
      }
      x[i][2 * j] = f.x, x[i][2 * j + 1] = f.y;
      sum += f.x + f.y;
    }
  }
  const float mean = warp_sum(sum) / width;
  float squares = 0.0f;
#pragma unroll
  for (int i = 0; i < Pieces; ++i)
    if (lane + i * 32 < pieces)
#pragma unroll
      for (int e = 0; e < 8; ++e) squares += (x[i][e] - mean) * (x[i][e] - mean);
  const float inv_std = rsqrtf(warp_sum(squares) / width + epsilon);
#pragma unroll
  for (int i = 0; i < Pieces; ++i) {
    const int c = lane + i * 32;
    if (c >= pieces) continue;
    const uint4 g = __ldg(reinterpret_cast<const uint4*>(gamma) + c), b = __ldg(reinterpret_cast<const uint4*>(beta) + c);
    const __half2 *gh = reinterpret_cast<const __half2*>(&g), *bh = reinterpret_cast<const __half2*>(&b);
    uint4 out;
    __half2* oh = reinterpret_cast<__half2*>(&out);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 gf = __half22float2(gh[j]), bf = __half22float2(bh[j]);
      oh[j] = __floats2half2_rn((x[i][2 * j] - mean) * inv_std * gf.x + bf.x,
                                (x[i][2 * j + 1] - mean) * inv_std * gf.y + bf.y);
    }
    line[c] = out;
  }
}

template <int Pieces>
cudaError_t launch(__half* y, const __half* skip, const __half* gamma, const __half* beta, int64_t rows, int width,
                   float epsilon, cudaStream_t stream) {
  const dim3 blocks(unsigned((rows + kWarps - 1) / kWarps));
  if (skip)
    layer_norm_in_place<Pieces, true><<<blocks, 32 * kWarps, 0, stream>>>(y, skip, gamma, beta, rows, width, epsilon);
  else
    layer_norm_in_place<Pieces, false><<<blocks, 32 * kWarps, 0, stream>>>(y, skip, gamma, beta, rows, width, epsilon);
  return cudaGetLastError();
}

}  // namespace

bool layer_norm_supports(int64_t width) { return width > 0 && width % 8 == 0 && width <= kLayerNormMaxWidth; }

cudaError_t layer_norm_in_place_launch(void* y, const void* skip, const void* gamma, const void* beta, int64_t rows,
                                       int64_t width, float epsilon, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (!layer_norm_supports(width) || rows > int64_t(kWarps) * 0x7fffffff) return cudaErrorInvalidValue;
  auto* out = static_cast<__half*>(y);
  auto *s = static_cast<const __half*>(skip), *g = static_cast<const __half*>(gamma), *b = static_cast<const __half*>(beta);
  const int w = int(width);
  switch ((w / 8 + 31) / 32) {  // 16-byte pieces a lane holds
    case 1: return launch<1>(out, s, g, b, rows, w, epsilon, stream);
    case 2: return launch<2>(out, s, g, b, rows, w, epsilon, stream);
    case 3: return launch<3>(out, s, g, b, rows, w, epsilon, stream);
    case 4: return launch<4>(out, s, g, b, rows, w, epsilon, stream);
    case 5: return launch<5>(out, s, g, b, rows, w, epsilon, stream);
    case 6: return launch<6>(out, s, g, b, rows, w, epsilon, stream);
    case 7: return launch<7>(out, s, g, b, rows, w, epsilon, stream);
    default: return launch<8>(out, s, g, b, rows, w, epsilon, stream);
  }
}

cudaError_t layer_norm_available() {
  cudaFuncAttributes attributes;  // fails where the library holds no code for this device
  return cudaFuncGetAttributes(&attributes, layer_norm_in_place<3, false>);
}
