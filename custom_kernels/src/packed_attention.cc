// bertserve.PackedAttention and bertserve.PackedQKVAttention: self-attention over packed sequences
// (padding removed), in place of com.microsoft.PackedMultiHeadAttention once the Q, K and V products
// have added their bias.
//
//   PackedAttention     inputs query, key, value [T, H·D], token_offset, cumulative_sequence_length
//   PackedQKVAttention  inputs qkv [T, 3·H·D] (each row Q | K | V), token_offset, cumulative_sequence_length
//     query, key, value, qkv fp16 (token t of sequence b at row cu[b] + t, heads side by side)
//     token_offset [B, S] int32 (only its shape is read: S bounds every sequence's length)
//     cumulative_sequence_length [B + 1] int32 (cu; on the device with the CUDA provider)
//   attrs    num_heads, head_size, scale
//   output   [T, H·D]
//
// PackedAttention takes PackedMultiHeadAttention's inputs without its bias (custom_kernels/fusion.py
// rewrites the node), so the graph around it is unchanged; PackedQKVAttention takes the three products
// made as one (fusion.py again), which the kernel reads in place, a row stride of 3·H·D. The CUDA kernel
// is packed_attention_kernel.cu, for D = 32 and 64 on compute capability 8.0 and later; a session on
// another device does not open (the server then runs the plain graph). Built with
// -DBERTSERVE_HOST_REFERENCE the operators run on the CPU provider in plain loops (fp16 and fp32), for
// the tests of machines without a GPU.
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

struct OpDef : OrtCustomOp {
  const char* name;
  bool packed_qkv;                 // one [T, 3·H·D] input in place of three [T, H·D]
  ONNXTensorElementDataType type;  // of query, key, value (or qkv) and the output
  const char* provider;
  size_t tensors() const { return packed_qkv ? 1 : 3; }  // inputs before token_offset
};

OrtStatusPtr fail(const OpDef* def, OrtErrorCode code, const std::string& msg) {
  return api->CreateStatus(code, (std::string(def->name) + ": " + msg).c_str());
}

struct Kernel {
  const OpDef* def = nullptr;
  int64_t num_heads = 0, head_size = 0;
  float scale = 0.0f;
};

// Where a call's tensors are: Q, K and V rows `stride` elements apart, O rows H·D apart.
struct Tensors {
  const void *q, *k, *v;
  void* o;
  const int32_t* cu;
  int64_t stride;
};

#ifdef BERTSERVE_HOST_REFERENCE

template <typename T>
OrtStatusPtr host_attention(const Kernel& kn, const Tensors& x, int64_t t, int64_t b) {
  const int64_t heads = kn.num_heads, d = kn.head_size, width = heads * d, stride = x.stride;
  const T *q = static_cast<const T*>(x.q), *k = static_cast<const T*>(x.k), *v = static_cast<const T*>(x.v);
  T* o = static_cast<T*>(x.o);
  std::vector<float> scores;
  for (int64_t s = 0; s < b; ++s) {
    const int64_t start = x.cu[s], len = x.cu[s + 1] - x.cu[s];
    if (start < 0 || len < 0 || start + len > t)
      return fail(kn.def, ORT_INVALID_ARGUMENT, "cumulative_sequence_length runs past the " + std::to_string(t) + " rows");
    scores.resize(size_t(len));
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < len; ++i) {
        const T* qi = q + (start + i) * stride + h * d;
        float top = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < len; ++j) {
          const T* kj = k + (start + j) * stride + h * d;
          float dot = 0.0f;
          for (int64_t c = 0; c < d; ++c) dot += float(qi[c]) * float(kj[c]);
          scores[j] = dot * kn.scale;
          top = std::fmax(top, scores[j]);
        }
        for (int64_t j = 0; j < len; ++j) sum += scores[j] = std::exp(scores[j] - top);
        for (int64_t c = 0; c < d; ++c) {
          float acc = 0.0f;
          for (int64_t j = 0; j < len; ++j) acc += scores[j] * float(v[(start + j) * stride + h * d + c]);
          o[(start + i) * width + h * d + c] = T(acc / sum);
        }
      }
  }
  return nullptr;
}

OrtStatusPtr run(const Kernel& k, const Tensors& x, int64_t t, int64_t b, int64_t, void* /*stream: none on the CPU*/) {
  if (k.def->type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) return host_attention<_Float16>(k, x, t, b);
  return host_attention<float>(k, x, t, b);
}

OrtStatusPtr check_device(const OpDef*, int64_t) { return nullptr; }

const ONNXTensorElementDataType kTypes[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
const char* const kProvider = "CPUExecutionProvider";

#else  // CUDA

OrtStatusPtr run(const Kernel& k, const Tensors& x, int64_t, int64_t b, int64_t s, void* stream) {
  const PackedAttentionArgs args{x.q, x.k, x.v, x.o, x.cu, int(b), int(s), int(k.num_heads), int(k.head_size),
                                 k.scale, int(x.stride)};
  cudaError_t e = packed_attention_launch(args, static_cast<cudaStream_t>(stream));
  return e == cudaSuccess ? nullptr : fail(k.def, ORT_EP_FAIL, cuda_error("the attention kernel's launch", e));
}

// At session start, so that a device the kernel cannot run on keeps the plain graph (artifact/session.py).
OrtStatusPtr check_device(const OpDef* def, int64_t head_size) {
  if (!packed_attention_supports(int(head_size)))
    return fail(def, ORT_EP_FAIL, "head size " + std::to_string(head_size) + " is not one the kernel was built for");
  cudaError_t e = packed_attention_available();
  return e == cudaSuccess ? nullptr
                          : fail(def, ORT_EP_FAIL, cuda_error("this GPU cannot run the kernel (it needs compute "
                                                              "capability 8.0 or later); looking it up", e));
}

const ONNXTensorElementDataType kTypes[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16};
const char* const kProvider = "CUDAExecutionProvider";

#endif  // BERTSERVE_HOST_REFERENCE

OrtStatusPtr compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel& k = *static_cast<const Kernel*>(kernel);
  const OpDef* def = k.def;
  const size_t tensors = def->tensors(), inputs = tensors + 2;
  const OrtValue* in[5];
  ONNXTensorElementDataType type[5];
  std::vector<int64_t> dims[5];
  for (size_t i = 0; i < inputs; ++i) {
    RETURN_IF_ERROR(read_input(api, ctx, i, def->name, &in[i], &type[i], &dims[i]));
    if (type[i] != (i < tensors ? def->type : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32))
      return fail(def, ORT_INVALID_ARGUMENT, "input " + std::to_string(i) + " has an unexpected element type");
  }
  const int64_t width = k.num_heads * k.head_size;
  const auto &qd = dims[0], &offsets = dims[tensors], &cu = dims[tensors + 1];
  bool fits = qd.size() == 2 && qd[1] == int64_t(tensors == 1 ? 3 : 1) * width && offsets.size() == 2 &&
              cu.size() == 1 && cu[0] == offsets[0] + 1;
  for (size_t i = 1; i < tensors; ++i) fits = fits && dims[i] == qd;
  if (!fits) {
    std::string shapes;
    for (size_t i = 0; i < inputs; ++i) shapes += (i ? ", " : "") + dims_str(dims[i]);
    return fail(def, ORT_INVALID_ARGUMENT,
                "shapes " + shapes + " do not fit " +
                    (tensors == 1 ? "[T, " + std::to_string(3 * width) + "]"
                                  : "[T, " + std::to_string(width) + "] three times") + ", [B, S], [B + 1]");
  }
  const int64_t out_dims[2] = {qd[0], width};
  OrtValue* out = nullptr;
  RETURN_IF_ERROR(api->KernelContext_GetOutput(ctx, 0, out_dims, 2, &out));
  if (qd[0] == 0 || offsets[0] == 0) return nullptr;
  void* ptr[3];
  for (size_t i = 0; i < tensors; ++i) RETURN_IF_ERROR(api->GetTensorMutableData(const_cast<OrtValue*>(in[i]), &ptr[i]));
  void *cu_data = nullptr, *o = nullptr;
  RETURN_IF_ERROR(api->GetTensorMutableData(const_cast<OrtValue*>(in[tensors + 1]), &cu_data));
  RETURN_IF_ERROR(api->GetTensorMutableData(out, &o));
  Tensors x{ptr[0], nullptr, nullptr, o, static_cast<const int32_t*>(cu_data), width};
  if (tensors == 3) {
    x.k = ptr[1], x.v = ptr[2];
  } else {  // each row Q | K | V: the same rows, offset by a third
    const size_t element = def->type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? 2 : 4;
    x.k = static_cast<const char*>(ptr[0]) + width * element;
    x.v = static_cast<const char*>(ptr[0]) + 2 * width * element;
    x.stride = 3 * width;
  }
  void* stream = nullptr;
  RETURN_IF_ERROR(op_common::compute_stream(api, ctx, def->provider, def->name, &stream));
  return run(k, x, qd[0], offsets[0], offsets[1], stream);
}

OrtStatusPtr create_kernel(const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info, void** out) {
  auto k = std::make_unique<Kernel>();
  k->def = static_cast<const OpDef*>(op);
  RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "num_heads", &k->num_heads));
  RETURN_IF_ERROR(api->KernelInfoGetAttribute_float(info, "scale", &k->scale));
  if (k->num_heads <= 0 || !(k->scale > 0.0f))
    return fail(k->def, ORT_INVALID_ARGUMENT, "num_heads and scale must be positive");
  // head_size is in the node so that a session this kernel cannot serve fails as it opens, not at its first run
  RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "head_size", &k->head_size));
  if (k->head_size <= 0) return fail(k->def, ORT_INVALID_ARGUMENT, "head_size must be positive");
  RETURN_IF_ERROR(check_device(k->def, k->head_size));
  *out = k.release();
  return nullptr;
}

OpDef make_op(const char* name, bool packed_qkv, ONNXTensorElementDataType type, const char* provider) {
  OpDef op;
  std::memset(static_cast<void*>(&op), 0, sizeof(op));
  op_common::set_common_fields(op);
  op.name = name;
  op.packed_qkv = packed_qkv;
  op.type = type;
  op.provider = provider;
  op.GetName = [](const OrtCustomOp* o) { return static_cast<const OpDef*>(o)->name; };
  op_common::set_kernel_fields<OpDef, Kernel>(op, create_kernel, compute);
  op.GetInputType = [](const OrtCustomOp* o, size_t i) {
    const auto* def = static_cast<const OpDef*>(o);
    return i < def->tensors() ? def->type : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  };
  op.GetInputTypeCount = [](const OrtCustomOp* o) { return static_cast<const OpDef*>(o)->tensors() + 2; };
  op.GetOutputType = [](const OrtCustomOp* o, size_t) { return static_cast<const OpDef*>(o)->type; };
  return op;
}

}  // namespace

std::vector<const OrtCustomOp*> packed_attention_ops(const OrtApi* ort) {
  api = ort;
  static std::vector<OpDef> ops = [] {
    std::vector<OpDef> v;
    for (auto t : kTypes) {
      v.push_back(make_op("PackedAttention", false, t, kProvider));
      v.push_back(make_op("PackedQKVAttention", true, t, kProvider));
    }
    return v;
  }();
  return op_common::pointers_to(ops);
}
