// bertserve.PackedAttention: self-attention over packed sequences (padding removed), in place of
// com.microsoft.PackedMultiHeadAttention once the Q, K and V products have added their bias.
//
//   inputs   query, key, value [T, H·D] fp16 (token t of sequence b at row cu[b] + t, heads side by side)
//            token_offset [B, S] int32 (only its shape is read: S bounds every sequence's length)
//            cumulative_sequence_length [B + 1] int32 (cu; on the device with the CUDA provider)
//   attrs    num_heads, scale
//   output   [T, H·D], laid out like query
//
// The inputs are PackedMultiHeadAttention's without its bias (custom_kernels/fusion.py rewrites the
// node), so the graph around it is unchanged. The CUDA kernel is packed_attention_kernel.cu, for
// D = 32 and 64 on compute capability 8.0 and later; a session on another device does not open (the
// server then runs the plain graph). Built with -DBERTSERVE_HOST_REFERENCE the operator runs on the
// CPU provider in plain loops (fp16 and fp32), for the tests of machines without a GPU.
#include "packed_attention.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "op_common.h"

namespace {

#ifndef BERTSERVE_HOST_REFERENCE
using op_common::cuda_error;
#endif
using op_common::dims_str;
using op_common::read_input;

const OrtApi* api = nullptr;
constexpr const char* kName = "PackedAttention";
constexpr int kInputs = 5;

OrtStatusPtr fail(OrtErrorCode code, const std::string& msg) {
  return api->CreateStatus(code, (std::string(kName) + ": " + msg).c_str());
}

struct OpDef : OrtCustomOp {
  ONNXTensorElementDataType type;  // of query, key, value and the output
  const char* provider;
};

struct Kernel {
  const OpDef* def = nullptr;
  int64_t num_heads = 0, head_size = 0;
  float scale = 0.0f;
};

#ifdef BERTSERVE_HOST_REFERENCE

template <typename T>
OrtStatusPtr host_attention(const T* q, const T* k, const T* v, T* o, const int32_t* cu, int64_t t, int64_t b,
                            int64_t heads, int64_t d, float scale) {
  const int64_t width = heads * d;
  std::vector<float> scores;
  for (int64_t s = 0; s < b; ++s) {
    const int64_t start = cu[s], len = cu[s + 1] - cu[s];
    if (start < 0 || len < 0 || start + len > t)
      return fail(ORT_INVALID_ARGUMENT, "cumulative_sequence_length runs past the " + std::to_string(t) + " rows");
    scores.resize(size_t(len));
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < len; ++i) {
        const T* qi = q + (start + i) * width + h * d;
        float top = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < len; ++j) {
          const T* kj = k + (start + j) * width + h * d;
          float dot = 0.0f;
          for (int64_t c = 0; c < d; ++c) dot += float(qi[c]) * float(kj[c]);
          scores[j] = dot * scale;
          top = std::fmax(top, scores[j]);
        }
        for (int64_t j = 0; j < len; ++j) sum += scores[j] = std::exp(scores[j] - top);
        for (int64_t c = 0; c < d; ++c) {
          float acc = 0.0f;
          for (int64_t j = 0; j < len; ++j) acc += scores[j] * float(v[(start + j) * width + h * d + c]);
          o[(start + i) * width + h * d + c] = T(acc / sum);
        }
      }
  }
  return nullptr;
}

OrtStatusPtr run(const Kernel& k, int64_t t, int64_t b, int64_t, int64_t, void* const* ptr,
                 void* /*stream: none on the CPU provider*/) {
  const int64_t d = k.head_size;
  const auto* cu = static_cast<const int32_t*>(ptr[3]);
  if (k.def->type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
    return host_attention(static_cast<const _Float16*>(ptr[0]), static_cast<const _Float16*>(ptr[1]),
                          static_cast<const _Float16*>(ptr[2]), static_cast<_Float16*>(ptr[4]), cu, t, b,
                          k.num_heads, d, k.scale);
  return host_attention(static_cast<const float*>(ptr[0]), static_cast<const float*>(ptr[1]),
                        static_cast<const float*>(ptr[2]), static_cast<float*>(ptr[4]), cu, t, b, k.num_heads, d,
                        k.scale);
}

OrtStatusPtr check_device(int64_t) { return nullptr; }

const ONNXTensorElementDataType kTypes[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
const char* const kProvider = "CPUExecutionProvider";

#else  // CUDA

OrtStatusPtr run(const Kernel& k, int64_t, int64_t b, int64_t s, int64_t, void* const* ptr, void* stream) {
  const PackedAttentionArgs args{ptr[0], ptr[1], ptr[2], ptr[4], static_cast<const int*>(ptr[3]), int(b), int(s),
                                 int(k.num_heads), int(k.head_size), k.scale};
  cudaError_t e = packed_attention_launch(args, static_cast<cudaStream_t>(stream));
  return e == cudaSuccess ? nullptr : fail(ORT_EP_FAIL, cuda_error("the attention kernel's launch", e));
}

// At session start, so that a device the kernel cannot run on keeps the plain graph (artifact/session.py).
OrtStatusPtr check_device(int64_t head_size) {
  if (!packed_attention_supports(int(head_size)))
    return fail(ORT_EP_FAIL, "head size " + std::to_string(head_size) + " is not one the kernel was built for");
  cudaError_t e = packed_attention_available();
  return e == cudaSuccess ? nullptr
                          : fail(ORT_EP_FAIL, cuda_error("this GPU cannot run the kernel (it needs compute capability "
                                                         "8.0 or later); looking it up", e));
}

const ONNXTensorElementDataType kTypes[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16};
const char* const kProvider = "CUDAExecutionProvider";

#endif  // BERTSERVE_HOST_REFERENCE

OrtStatusPtr compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel& k = *static_cast<const Kernel*>(kernel);
  const OrtValue* in[kInputs];
  ONNXTensorElementDataType type[kInputs];
  std::vector<int64_t> dims[kInputs];
  for (int i = 0; i < kInputs; ++i) {
    RETURN_IF_ERROR(read_input(api, ctx, i, kName, &in[i], &type[i], &dims[i]));
    if (type[i] != (i < 3 ? k.def->type : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32))
      return fail(ORT_INVALID_ARGUMENT, "input " + std::to_string(i) + " has an unexpected element type");
  }
  const auto& qd = dims[0];
  if (qd.size() != 2 || dims[1] != qd || dims[2] != qd || dims[3].size() != 2 || dims[4].size() != 1 ||
      dims[4][0] != dims[3][0] + 1 || qd[1] != k.num_heads * k.head_size)
    return fail(ORT_INVALID_ARGUMENT, "shapes query " + dims_str(qd) + ", key " + dims_str(dims[1]) + ", value " +
                                          dims_str(dims[2]) + ", token_offset " + dims_str(dims[3]) +
                                          ", cumulative_sequence_length " + dims_str(dims[4]) +
                                          " do not fit [T, " + std::to_string(k.num_heads * k.head_size) +
                                          "] three times, [B, S], [B + 1]");
  OrtValue* out = nullptr;
  RETURN_IF_ERROR(api->KernelContext_GetOutput(ctx, 0, qd.data(), qd.size(), &out));
  if (qd[0] == 0 || dims[3][0] == 0) return nullptr;
  void* ptr[kInputs];  // query, key, value, cumulative_sequence_length, output
  for (int i = 0, j = 0; i < kInputs; ++i)
    if (i != 3) RETURN_IF_ERROR(api->GetTensorMutableData(const_cast<OrtValue*>(in[i]), &ptr[j++]));
  RETURN_IF_ERROR(api->GetTensorMutableData(out, &ptr[4]));
  void* stream = nullptr;
  RETURN_IF_ERROR(op_common::compute_stream(api, ctx, k.def->provider, kName, &stream));
  return run(k, qd[0], dims[3][0], dims[3][1], qd[1], ptr, stream);
}

OrtStatusPtr create_kernel(const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info, void** out) {
  auto k = std::make_unique<Kernel>();
  k->def = static_cast<const OpDef*>(op);
  RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "num_heads", &k->num_heads));
  RETURN_IF_ERROR(api->KernelInfoGetAttribute_float(info, "scale", &k->scale));
  if (k->num_heads <= 0 || !(k->scale > 0.0f)) return fail(ORT_INVALID_ARGUMENT, "num_heads and scale must be positive");
  // head_size is in the node so that a session this kernel cannot serve fails as it opens, not at its first run
  RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "head_size", &k->head_size));
  if (k->head_size <= 0) return fail(ORT_INVALID_ARGUMENT, "head_size must be positive");
  RETURN_IF_ERROR(check_device(k->head_size));
  *out = k.release();
  return nullptr;
}

OpDef make_op(ONNXTensorElementDataType type, const char* provider) {
  OpDef op;
  std::memset(static_cast<void*>(&op), 0, sizeof(op));
  op_common::set_common_fields(op);
  op.type = type;
  op.provider = provider;
  op.GetName = [](const OrtCustomOp*) { return kName; };
  op.GetExecutionProviderType = [](const OrtCustomOp* o) { return static_cast<const OpDef*>(o)->provider; };
  op.GetInputType = [](const OrtCustomOp* o, size_t i) {
    return i < 3 ? static_cast<const OpDef*>(o)->type : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return kInputs; };
  op.GetOutputType = [](const OrtCustomOp* o, size_t) { return static_cast<const OpDef*>(o)->type; };
  op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  return op;
}

}  // namespace

std::vector<const OrtCustomOp*> packed_attention_ops(const OrtApi* ort) {
  api = ort;
  static std::vector<OpDef> ops = [] {
    std::vector<OpDef> v;
    for (auto t : kTypes) v.push_back(make_op(t, kProvider));
    return v;
  }();
  return op_common::pointers_to(ops);
}
