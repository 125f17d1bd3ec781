// op_common.h: what every operator of this library does alike (matmul_epilogues.cc, packed_attention.cc,
// remove_padding.cc): reading an input's element type and shape, naming a shape in a message, and the
// OrtCustomOp fields they set the same way.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ort_abi.h"

#ifndef BERTSERVE_HOST_REFERENCE
#include <cuda_runtime_api.h>
#endif

#define RETURN_IF_ERROR(expr)                          \
  do {                                                 \
    if (OrtStatusPtr status_ = (expr)) return status_; \
  } while (0)

namespace op_common {

constexpr uint32_t kOpVersion = 16;  // OrtCustomOp layout and OrtApi version asked for (ORT >= 1.16)

#ifndef BERTSERVE_HOST_REFERENCE
// "<what> failed: CUDA failure <code>: <message> (<name>)": ONNX Runtime's own wording of a CUDA error,
// which the server reads to tell a sticky error, after which the engine is lost, from one batch's
// failure (app/engine.py).
inline std::string cuda_error(const char* what, cudaError_t e) {
  return std::string(what) + " failed: CUDA failure " + std::to_string(int(e)) + ": " + cudaGetErrorString(e) + " (" +
         cudaGetErrorName(e) + ")";
}
#endif

inline std::string dims_str(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

inline OrtStatusPtr type_and_shape(const OrtApi* api, const OrtValue* v, ONNXTensorElementDataType* type,
                                   std::vector<int64_t>* dims) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  RETURN_IF_ERROR(api->GetTensorTypeAndShape(v, &info));
  size_t n = 0;
  OrtStatusPtr s = api->GetTensorElementType(info, type);
  if (!s) s = api->GetDimensionsCount(info, &n);
  if (!s) {
    dims->resize(n);
    s = api->GetDimensions(info, dims->data(), n);
  }
  api->ReleaseTensorTypeAndShapeInfo(info);
  return s;
}

// Input i of an operator's call, with its element type and shape; `op` names the operator in the error.
inline OrtStatusPtr read_input(const OrtApi* api, OrtKernelContext* ctx, size_t i, const char* op, const OrtValue** value,
                               ONNXTensorElementDataType* type, std::vector<int64_t>* dims) {
  RETURN_IF_ERROR(api->KernelContext_GetInput(ctx, i, value));
  if (!*value)
    return api->CreateStatus(ORT_INVALID_ARGUMENT, (std::string(op) + ": input " + std::to_string(i) + " is missing").c_str());
  return type_and_shape(api, *value, type, dims);
}

// The CUDA stream a call runs on (*stream), or null on the CPU provider (the host-reference build).
inline OrtStatusPtr compute_stream(const OrtApi* api, OrtKernelContext* ctx, const char* provider, const char* op,
                                   void** stream) {
  *stream = nullptr;
  if (std::strcmp(provider, "CUDAExecutionProvider") != 0) return nullptr;
  RETURN_IF_ERROR(api->KernelContext_GetGPUComputeStream(ctx, stream));
  return *stream ? nullptr
                 : api->CreateStatus(ORT_EP_FAIL, (std::string(op) + ": ORT gave no CUDA compute stream").c_str());
}

// What an operator file hands RegisterCustomOps: pointers to its operator definitions, which live as long
// as the process (`ops` is a function's static).
template <typename Def>
std::vector<const OrtCustomOp*> pointers_to(std::vector<Def>& ops) {
  std::vector<const OrtCustomOp*> out;
  for (auto& op : ops) out.push_back(&op);
  return out;
}

// Every input and output required, in the provider's default memory, one output, no variadic ones.
inline void set_common_fields(OrtCustomOp& op) {
  op.version = kOpVersion;
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
}

// The fields that every operator sets alike from its own types: Def, its definition (an OrtCustomOp with
// a `provider`), and Kernel, what `create` makes for each node and `compute` runs.
template <typename Def, typename Kernel>
void set_kernel_fields(Def& op, decltype(OrtCustomOp::CreateKernelV2) create,
                       decltype(OrtCustomOp::KernelComputeV2) compute) {
  op.GetExecutionProviderType = [](const OrtCustomOp* o) { return static_cast<const Def*>(o)->provider; };
  op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
}

}  // namespace op_common
