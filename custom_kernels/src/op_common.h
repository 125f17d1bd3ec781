// op_common.h: what every operator of this library does alike (matmul_epilogues.cc, packed_attention.cc):
// reading an input's element type and shape, naming a shape in a message, and the OrtCustomOp fields
// they set the same way.
#pragma once
#include <cstdint>
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

}  // namespace op_common
