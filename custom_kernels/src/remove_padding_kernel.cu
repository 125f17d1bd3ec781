// The GPU kernels of bertserve.RemovePadding (remove_padding.cc). ONNX Runtime's RemovePadding works out
// the token offsets in one GPU thread, a loop over every padded position (0.22 ms a batch of 256 x 128
// on an H200, more than the whole batch's copy in and out); here one block of 1024 threads scans the
// rows' counts and then writes the positions in parallel.
#include <cuda_runtime.h>

#include <cstdint>

#include "remove_padding.h"

namespace {

constexpr int kThreads = 1024;

// One block. Rows are scanned a tile of kThreads at a time (Hillis-Steele in shared memory), carrying the
// running total between tiles; then every padded position is written from its row's start.
__global__ void __launch_bounds__(kThreads)
    token_offsets(const int* __restrict__ counts, int batch, int length, int* __restrict__ token_offset,
                  int* __restrict__ cumulative, int* __restrict__ longest) {
  __shared__ int scan[kThreads];
  __shared__ int carry, top;
  const int tid = threadIdx.x;
  if (tid == 0) carry = 0, top = 0, cumulative[0] = 0;
  __syncthreads();
  for (int base = 0; base < batch; base += kThreads) {
    const int row = base + tid;
    // a count outside 0..length would send writes past the row: clamp, as the mask cannot say more
    const int count = row < batch ? min(max(counts[row], 0), length) : 0;
    scan[tid] = count;
    __syncthreads();
    for (int step = 1; step < kThreads; step *= 2) {
      const int add = tid >= step ? scan[tid - step] : 0;
      __syncthreads();
      scan[tid] += add;
      __syncthreads();
    }
    if (row < batch) cumulative[row + 1] = carry + scan[tid];
    atomicMax(&top, count);
    __syncthreads();
    if (tid == kThreads - 1) carry += scan[tid];
    __syncthreads();
  }
  if (tid == 0) longest[0] = top;
  const int total = carry;
  // cumulative[] was written by this block above; __syncthreads made it visible to every thread
  for (int i = tid; i < batch * length; i += kThreads) {
    const int row = i / length, position = i - row * length;
    const int start = cumulative[row], count = cumulative[row + 1] - start;
    // real tokens in order first, then each row's padding in order: ORT's layout, which RestorePadding reads
    token_offset[position < count ? start + position : total + row * length - start + position - count] = i;
  }
}

// One block a token: its row, 16 (or 4) bytes a thread.
template <typename V>
__global__ void gather_rows(V* __restrict__ out, const V* __restrict__ in, const int* __restrict__ token_offset,
                            int per_row) {
  const int64_t token = blockIdx.x;
  const V* src = in + int64_t(token_offset[token]) * per_row;
  V* dst = out + token * per_row;
  for (int i = threadIdx.x; i < per_row; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

cudaError_t token_offsets_launch(const int* counts, int batch, int length, int* token_offset, int* cumulative,
                                 int* longest, cudaStream_t stream) {
  token_offsets<<<1, kThreads, 0, stream>>>(counts, batch, length, token_offset, cumulative, longest);
  return cudaGetLastError();
}

cudaError_t gather_rows_launch(void* out, const void* in, const int* token_offset, int64_t tokens, int64_t row_bytes,
                               cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  const bool wide = row_bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(in)) % 16 == 0;
  if (wide)
    gather_rows<uint4><<<unsigned(tokens), 128, 0, stream>>>(static_cast<uint4*>(out), static_cast<const uint4*>(in),
                                                              token_offset, int(row_bytes / 16));
  else
    gather_rows<uint32_t><<<unsigned(tokens), 128, 0, stream>>>(
        static_cast<uint32_t*>(out), static_cast<const uint32_t*>(in), token_offset, int(row_bytes / 4));
  return cudaGetLastError();
}

cudaError_t remove_padding_available() {
  cudaFuncAttributes attributes;  // fails where the library holds no code for this device
  return cudaFuncGetAttributes(&attributes, token_offsets);
}
