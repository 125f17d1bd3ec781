// The GPU kernel of bertserve.PackedAttention and PackedQKVAttention (packed_attention.cc):
// softmax(Q·Kᵀ·scale)·V per sequence and head over packed rows, FlashAttention-2's scheme written for an
// encoder's short sequences. Q, K and V are fp16 rows of H·D (token t of sequence b at row cu[b] + t,
// heads side by side), read where the products wrote them: three tensors [T, H·D], or the thirds of one
// product's rows [T, 3·H·D] (a row stride of 3·H·D). O is [T, H·D].
//
// A block of 4 warps takes 64 query rows of one (sequence, head), 16 rows a warp. Keys and values come
// 128 rows a round, in four copy groups that the block waits for in the order it uses them, and are
// walked 64 keys a step with an online softmax, so any length works. Products on tensor cores
// (mma.sync m16n8k16, fp32 accumulation, sm_80 and later); scores never leave registers; P is rounded
// to fp16 for P·V as FlashAttention does. Rows past a sequence's end are loaded as zeros and its keys
// masked, so no row of another sequence reaches a result. ORT's PackedMultiHeadAttention runs an
// Ampere FlashAttention with 128-row tiles, which wastes most of a tile on short texts.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "packed_attention.h"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 16 * kWarps;  // query rows a block takes
constexpr int kKeys = 64;           // keys one online-softmax step takes
constexpr int kStageKeys = 128;     // keys (and values) one round of copies brings

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without registers; `valid` false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

__device__ __forceinline__ void ldmatrix4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// c (16x8 fp32) += a (16x16 fp16, row-major) · b (16x8 fp16, column-major)
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x in one MUFU instruction (-inf gives 0); the scores' exponents need no more precision than fp16 keeps.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Dynamic shared memory of one block: its queries, then a stage of keys, then a stage of values
// (46 KB at D = 64: four blocks of 128 threads and 128 registers fill an SM).
template <int D>
constexpr int smem_bytes() {
  return (kRows + 2 * kStageKeys) * (D + 8) * int(sizeof(__half));
}

template <int D>
__global__ void __launch_bounds__(kThreads, 4)
    packed_attention(const __half* __restrict__ q, const __half* __restrict__ k, const __half* __restrict__ v,
                     __half* __restrict__ o, const int* __restrict__ cu_seqlens, int width, int out_width,
                     float scale_log2) {
  // Rows padded by 16 bytes: the 8 rows an ldmatrix reads then start in 8 different bank groups.
  constexpr int kStride = D + 8;
  constexpr int kChunks = D / 8;  // 16-byte pieces of a row of one head
  extern __shared__ __align__(16) unsigned char smem[];
  __half* const sq = reinterpret_cast<__half*>(smem);
  __half* const sk = sq + kRows * kStride;
  __half* const sv = sk + kStageKeys * kStride;

  const int b = blockIdx.z, start = cu_seqlens[b], len = cu_seqlens[b + 1] - start;
  // Unsigned, so that dividing by powers of two is a shift.
  const unsigned tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int stages = (len + kStageKeys - 1) / kStageKeys;

  // Each thread copies one 16-byte piece of every (kThreads / kChunks)-th row, always the same piece:
  // its offsets are worked out once, and a row costs one multiply-add.
  constexpr int kRowsPerPass = kThreads / kChunks;
  const unsigned piece = tid % kChunks, first_row = tid / kChunks;
  // width: elements from one row of Q, K and V to the next (out_width: of O, used only at the end)
  const size_t offset = size_t(start) * width + size_t(blockIdx.y) * D + piece * 8;
  const __half *const q_at = q + offset, *const k_at = k + offset, *const v_at = v + offset;
  // Rows first .. first + Rows - 1 of the sequence (zeros past its end) into dst.
  auto load = [&](__half* dst, const __half* src, int first, auto rows) {
#pragma unroll
    for (int i = 0; i < decltype(rows)::value / kRowsPerPass; ++i) {
      const int r = first_row + i * kRowsPerPass;
      const bool valid = first + r < len;
      copy16(dst + r * kStride + piece * 8, src + size_t(valid ? first + r : 0) * width, valid);
    }
  };
  const std::integral_constant<int, kRows> query_rows;
  const std::integral_constant<int, kKeys> key_rows;

  // Grid-stride over query tiles: correct whatever grid the host chose for this batch's lengths.
  for (int m0 = blockIdx.x * kRows; m0 < len; m0 += gridDim.x * kRows) {
    // A warp whose rows are all past the end loads and waits with the others but computes nothing.
    const bool active = m0 + int(warp) * 16 < len;
    float acc[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    // Each thread holds two rows of its warp's 16: lane / 4 and lane / 4 + 8 (the mma accumulator layout).
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
    // One online-softmax step over keys first .. first + 63, half `half` of the copy round in sk / sv,
    // after waiting for all but `scores_wait` copy groups (keys) and then all but `values_wait` (values).
    // (Steps of 128 keys need more than the 128 registers four blocks an SM leave a thread, and spill.)
    auto step = [&](int half, int first, auto scores_wait, auto values_wait) {
      const __half* keys = sk + half * kKeys * kStride;
      const __half* values = sv + half * kKeys * kStride;
      wait_copies<decltype(scores_wait)::value>();
      __syncthreads();
      float s[kKeys / 8][4];
      if (active) {
#pragma unroll
        for (int i = 0; i < kKeys / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t a[4];
          ldmatrix4(a, sq + (warp * 16 + lane % 16) * kStride + kk * 16 + (lane / 16) * 8);
#pragma unroll
          for (int np = 0; np < kKeys / 16; ++np) {
            uint32_t r[4];
            ldmatrix4(r, keys + (np * 16 + lane % 8 + (lane / 16) * 8) * kStride + kk * 16 + ((lane / 8) % 2) * 8);
            mma(s[2 * np], a, r[0], r[1]);
            mma(s[2 * np + 1], a, r[2], r[3]);
          }
        }

        // Keys past the end at -inf (only in a sequence's last step); the maxima kept in log2 units
        // (scale_log2 > 0, so the raw scores' maximum is the scaled one's).
        if (first + kKeys > len) {
          const int key0 = first + (lane % 4) * 2;
#pragma unroll
          for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (key0 + nt * 8 + (e & 1) >= len) s[nt][e] = -INFINITY;
        }
        // Maxima and sums as trees, not chains: short dependency chains keep the warp issuing.
        float part[2][kKeys / 8];
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt) {
          part[0][nt] = fmaxf(s[nt][0], s[nt][1]);
          part[1][nt] = fmaxf(s[nt][2], s[nt][3]);
        }
        float step_max[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int w = kKeys / 16; w >= 1; w /= 2)
#pragma unroll
            for (int i = 0; i < w; ++i) part[r][i] = fmaxf(part[r][i], part[r][i + w]);
          // the four lanes of a row hold its keys between them
          step_max[r] = fmaxf(part[r][0], __shfl_xor_sync(0xffffffffu, part[r][0], 1));
          step_max[r] = fmaxf(step_max[r], __shfl_xor_sync(0xffffffffu, step_max[r], 2));
          // The step's first key is inside the sequence, so the maximum is finite: no inf - inf below.
          step_max[r] = fmaxf(row_max[r], step_max[r] * scale_log2);
        }
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2, -step_max[e / 2]));
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt) {
          part[0][nt] = s[nt][0] + s[nt][1];
          part[1][nt] = s[nt][2] + s[nt][3];
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int w = kKeys / 16; w >= 1; w /= 2)
#pragma unroll
            for (int i = 0; i < w; ++i) part[r][i] += part[r][i + w];
        }
        if (first == 0) {  // the first step: nothing to correct
          row_sum[0] = part[0][0], row_sum[1] = part[1][0];
        } else {
          const float rescale[2] = {fast_exp2(row_max[0] - step_max[0]), fast_exp2(row_max[1] - step_max[1])};
          // each lane's share; the row's total is summed at the end
          row_sum[0] = row_sum[0] * rescale[0] + part[0][0], row_sum[1] = row_sum[1] * rescale[1] + part[1][0];
#pragma unroll
          for (int dt = 0; dt < D / 8; ++dt) {
            acc[dt][0] *= rescale[0], acc[dt][1] *= rescale[0];
            acc[dt][2] *= rescale[1], acc[dt][3] *= rescale[1];
          }
        }
        row_max[0] = step_max[0], row_max[1] = step_max[1];
      }

      wait_copies<decltype(values_wait)::value>();
      __syncthreads();
      if (active) {
#pragma unroll
        for (int j = 0; j < kKeys / 16; ++j) {
          // The scores' accumulator layout is the A operand's: P·V needs no shuffle.
          const uint32_t p[4] = {pack_half2(s[2 * j][0], s[2 * j][1]), pack_half2(s[2 * j][2], s[2 * j][3]),
                                 pack_half2(s[2 * j + 1][0], s[2 * j + 1][1]),
                                 pack_half2(s[2 * j + 1][2], s[2 * j + 1][3])};
#pragma unroll
          for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t r[4];
            ldmatrix4_trans(r, values + (j * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kStride + dp * 16 + (lane / 16) * 8);
            mma(acc[2 * dp], p, r[0], r[1]);
            mma(acc[2 * dp + 1], p, r[2], r[3]);
          }
        }
      }
    };

    for (int stage = 0; stage < stages; ++stage) {
      const int key_base = stage * kStageKeys;
      if (stage > 0) __syncthreads();  // every warp is done with the previous stage's keys and values
      // Four copy groups, waited for in the order they are used: keys 0-63 (with the queries), their
      // values, keys 64-127, their values. A group past the end is empty but still counts.
      if (stage == 0) load(sq, q_at, m0, query_rows);
#pragma unroll
      for (int half_stage = 0; half_stage < 2; ++half_stage) {
        const int first = key_base + half_stage * kKeys;
        if (first < len) load(sk + half_stage * kKeys * kStride, k_at, first, key_rows);
        commit();
        if (first < len) load(sv + half_stage * kKeys * kStride, v_at, first, key_rows);
        commit();
      }

      step(0, key_base, std::integral_constant<int, 3>(), std::integral_constant<int, 2>());
      if (len - key_base > kKeys)
        step(1, key_base + kKeys, std::integral_constant<int, 1>(), std::integral_constant<int, 0>());
    }

    if (active) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
      }
      const float inv[2] = {1.0f / row_sum[0], 1.0f / row_sum[1]};
      // Through the warp's own rows of sq (only this warp reads them) so that rows go out 16 bytes a store.
      __half* staged = sq + warp * 16 * kStride;
      const int g = lane / 4, t = lane % 4;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        *reinterpret_cast<uint32_t*>(staged + g * kStride + dt * 8 + 2 * t) =
            pack_half2(acc[dt][0] * inv[0], acc[dt][1] * inv[0]);
        *reinterpret_cast<uint32_t*>(staged + (g + 8) * kStride + dt * 8 + 2 * t) =
            pack_half2(acc[dt][2] * inv[1], acc[dt][3] * inv[1]);
      }
      __syncwarp();
      // worked out here, not kept from the start: no register is held for it through the loop above
      __half* const o_at = o + size_t(cu_seqlens[b]) * out_width + size_t(blockIdx.y) * D + piece * 8;
      // Lane l writes its piece (l % kChunks: as it copies) of rows l / kChunks, + 32 / kChunks, ... of the warp's 16.
#pragma unroll
      for (int i = 0; i < 16 * kChunks / 32; ++i) {
        const unsigned r = lane / kChunks + i * (32 / kChunks);
        const int row = m0 + int(warp * 16 + r);
        if (row < len)
          *reinterpret_cast<uint4*>(o_at + size_t(row) * out_width) =
              *reinterpret_cast<const uint4*>(staged + r * kStride + piece * 8);
      }
    }
    __syncthreads();  // sq, sk and sv are free for the next tile
  }
}

template <int D>
cudaError_t launch(const PackedAttentionArgs& a, cudaStream_t stream) {
  static_assert(smem_bytes<D>() <= 48 * 1024, "above 48 KB a kernel must ask for its shared memory");
  const dim3 grid((a.max_len + kRows - 1) / kRows, a.heads, a.batch);
  packed_attention<D><<<grid, kThreads, smem_bytes<D>(), stream>>>(
      static_cast<const __half*>(a.q), static_cast<const __half*>(a.k), static_cast<const __half*>(a.v),
      static_cast<__half*>(a.o), a.cu_seqlens, a.in_stride, a.heads * D, a.scale * 1.4426950408889634f);
  return cudaGetLastError();
}

}  // namespace

bool packed_attention_supports(int head_size) { return head_size == 32 || head_size == 64; }

cudaError_t packed_attention_launch(const PackedAttentionArgs& a, cudaStream_t stream) {
  if (a.batch == 0 || a.max_len == 0) return cudaSuccess;
  switch (a.head_size) {
    case 32: return launch<32>(a, stream);
    case 64: return launch<64>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t packed_attention_available() {
  cudaFuncAttributes attributes;  // fails where the library holds no code for this device (before sm_80)
  return cudaFuncGetAttributes(&attributes, packed_attention<64>);
}
