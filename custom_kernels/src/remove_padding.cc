// bertserve.RemovePadding: com.microsoft.RemovePadding's contract on a parallel kernel.
//
//   inputs   input [B, S, H] (fp16; fp32 too in the host reference), sequence_token_count [B] int32
//   outputs  output [T, H]: the rows' real tokens one after another (T = their count)
//            token_offset [B, S] int32: their padded positions in that order, then the padding's
//            cumulative_sequence_length [B + 1] int32, max_token_count [1] int32
//
// The same inputs and outputs as ORT's node (custom_kernels/fusion.py swaps one for the other), so
// RestorePadding, the attention and the host-packed export read them as before. ORT's operator builds
// token_offset in a single GPU thread (remove_padding_kernel.cu says what that costs); this one scans in
// one block and writes in parallel. Like ORT's it waits for the count of real tokens (one int copied to the
// host) to size its first output. max_token_count stays on the device, where ORT keeps it on the host:
// nothing in the graphs export writes reads it.
#include "remove_padding.h"

#include <algorithm>
#include <cstdint>
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
constexpr const char* kName = "RemovePadding";

OrtStatusPtr fail(OrtErrorCode code, const std::string& msg) {
  return api->CreateStatus(code, (std::string(kName) + ": " + msg).c_str());
}

struct OpDef : OrtCustomOp {
  ONNXTensorElementDataType type;  // of input and output
  const char* provider;
};

struct Kernel {
  const OpDef* def = nullptr;
};

#ifdef BERTSERVE_HOST_REFERENCE

OrtStatusPtr offsets(const Kernel&, const int32_t* counts, int64_t b, int64_t s, int32_t* token_offset,
                     int32_t* cumulative, int32_t* longest, int64_t* total, void*) {
  int64_t index = 0;
  cumulative[0] = 0;
  longest[0] = 0;
  for (int64_t r = 0; r < b; ++r) {
    const int64_t count = std::min<int64_t>(std::max<int32_t>(counts[r], 0), s);
    cumulative[r + 1] = int32_t(cumulative[r] + count);
    longest[0] = std::max<int32_t>(longest[0], int32_t(count));
    for (int64_t p = 0; p < count; ++p) token_offset[index++] = int32_t(r * s + p);
  }
  *total = index;
  for (int64_t r = 0; r < b; ++r)
    for (int64_t p = cumulative[r + 1] - cumulative[r]; p < s; ++p) token_offset[index++] = int32_t(r * s + p);
  return nullptr;
}

OrtStatusPtr gather(const Kernel&, void* out, const void* in, const int32_t* token_offset, int64_t tokens,
                    int64_t row_bytes, void*) {
  for (int64_t t = 0; t < tokens; ++t)
    std::memcpy(static_cast<char*>(out) + t * row_bytes, static_cast<const char*>(in) + token_offset[t] * row_bytes,
                size_t(row_bytes));
  return nullptr;
}

OrtStatusPtr check_device() { return nullptr; }

const ONNXTensorElementDataType kTypes[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
const char* const kProvider = "CPUExecutionProvider";

#else  // CUDA

OrtStatusPtr offsets(const Kernel&, const int32_t* counts, int64_t b, int64_t s, int32_t* token_offset,
                     int32_t* cumulative, int32_t* longest, int64_t* total, void* stream) {
  const auto st = static_cast<cudaStream_t>(stream);
  cudaError_t e = token_offsets_launch(counts, int(b), int(s), token_offset, cumulative, longest, st);
  if (e != cudaSuccess) return fail(ORT_EP_FAIL, cuda_error("the token offsets kernel's launch", e));
  // The real tokens in all size the output: one int to the host, through pinned memory this thread keeps
  // (concurrent Run()s each have their own thread).
  thread_local int32_t* pinned = nullptr;
  if (!pinned && (e = cudaMallocHost(reinterpret_cast<void**>(&pinned), sizeof(int32_t))) != cudaSuccess) {
    pinned = nullptr;
    return fail(ORT_EP_FAIL, cuda_error("cudaMallocHost", e));
  }
  e = cudaMemcpyAsync(pinned, cumulative + b, sizeof(int32_t), cudaMemcpyDeviceToHost, st);
  if (e == cudaSuccess) e = cudaStreamSynchronize(st);
  if (e != cudaSuccess) return fail(ORT_EP_FAIL, cuda_error("copying the token count to the host", e));
  *total = *pinned;
  return nullptr;
}

OrtStatusPtr gather(const Kernel&, void* out, const void* in, const int32_t* token_offset, int64_t tokens,
                    int64_t row_bytes, void* stream) {
  cudaError_t e = gather_rows_launch(out, in, token_offset, tokens, row_bytes, static_cast<cudaStream_t>(stream));
  return e == cudaSuccess ? nullptr : fail(ORT_EP_FAIL, cuda_error("the gather kernel's launch", e));
}

// At session start, so that a device the kernels cannot run on keeps the plain graph (artifact/session.py).
OrtStatusPtr check_device() {
  cudaError_t e = remove_padding_available();
  return e == cudaSuccess ? nullptr
                          : fail(ORT_EP_FAIL, cuda_error("this GPU cannot run the kernels (the library holds code "
                                                         "for compute capability 8.0 and later); looking it up", e));
}

const ONNXTensorElementDataType kTypes[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16};
const char* const kProvider = "CUDAExecutionProvider";

#endif  // BERTSERVE_HOST_REFERENCE

OrtStatusPtr compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel& k = *static_cast<const Kernel*>(kernel);
  const OrtValue* in[2];
  ONNXTensorElementDataType type[2];
  std::vector<int64_t> dims[2];
  for (int i = 0; i < 2; ++i) RETURN_IF_ERROR(read_input(api, ctx, i, kName, &in[i], &type[i], &dims[i]));
  if (type[0] != k.def->type || type[1] != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32)
    return fail(ORT_INVALID_ARGUMENT, "unexpected element types (input as the node's type, sequence_token_count int32)");
  const auto& xd = dims[0];
  if (xd.size() != 3 || dims[1].size() != 1 || dims[1][0] != xd[0] || xd[0] * xd[1] > INT32_MAX)
    return fail(ORT_INVALID_ARGUMENT, "shapes input " + dims_str(xd) + ", sequence_token_count " + dims_str(dims[1]) +
                                          " do not fit [B, S, H] and [B] (B · S below 2^31)");
  const int64_t b = xd[0], s = xd[1], h = xd[2];
  const int64_t offset_dims[2] = {b, s}, cumulative_dims[1] = {b + 1}, one[1] = {1};
  OrtValue *token_offset = nullptr, *cumulative = nullptr, *longest = nullptr, *out = nullptr;
  RETURN_IF_ERROR(api->KernelContext_GetOutput(ctx, 1, offset_dims, 2, &token_offset));
  RETURN_IF_ERROR(api->KernelContext_GetOutput(ctx, 2, cumulative_dims, 1, &cumulative));
  RETURN_IF_ERROR(api->KernelContext_GetOutput(ctx, 3, one, 1, &longest));
  void *x = nullptr, *counts = nullptr, *offset_data = nullptr, *cumulative_data = nullptr, *longest_data = nullptr;
  RETURN_IF_ERROR(api->GetTensorMutableData(const_cast<OrtValue*>(in[0]), &x));
  RETURN_IF_ERROR(api->GetTensorMutableData(const_cast<OrtValue*>(in[1]), &counts));
  RETURN_IF_ERROR(api->GetTensorMutableData(token_offset, &offset_data));
  RETURN_IF_ERROR(api->GetTensorMutableData(cumulative, &cumulative_data));
  RETURN_IF_ERROR(api->GetTensorMutableData(longest, &longest_data));
  void* stream = nullptr;
  RETURN_IF_ERROR(op_common::compute_stream(api, ctx, k.def->provider, kName, &stream));
  int64_t total = 0;
  RETURN_IF_ERROR(offsets(k, static_cast<const int32_t*>(counts), b, s, static_cast<int32_t*>(offset_data),
                          static_cast<int32_t*>(cumulative_data), static_cast<int32_t*>(longest_data), &total, stream));
  const int64_t out_dims[2] = {total, h};
  RETURN_IF_ERROR(api->KernelContext_GetOutput(ctx, 0, out_dims, 2, &out));
  if (total == 0 || h == 0) return nullptr;
  void* out_data = nullptr;
  RETURN_IF_ERROR(api->GetTensorMutableData(out, &out_data));
  const int64_t element = k.def->type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? 2 : 4;
  if ((h * element) % 4) return fail(ORT_INVALID_ARGUMENT, "the hidden size must be even");
  return gather(k, out_data, x, static_cast<const int32_t*>(offset_data), total, h * element, stream);
}

OrtStatusPtr create_kernel(const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo*, void** out) {
  RETURN_IF_ERROR(check_device());
  *out = new Kernel{static_cast<const OpDef*>(op)};
  return nullptr;
}

OpDef make_op(ONNXTensorElementDataType type, const char* provider) {
  OpDef op;
  std::memset(static_cast<void*>(&op), 0, sizeof(op));
  op_common::set_common_fields(op);
  op.type = type;
  op.provider = provider;
  op.GetName = [](const OrtCustomOp*) { return kName; };
  op_common::set_kernel_fields<OpDef, Kernel>(op, create_kernel, compute);
  op.GetInputType = [](const OrtCustomOp* o, size_t i) {
    return i == 0 ? static_cast<const OpDef*>(o)->type : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 2; };
  op.GetOutputType = [](const OrtCustomOp* o, size_t i) {
    return i == 0 ? static_cast<const OpDef*>(o)->type : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 4; };
  return op;
}

}  // namespace

std::vector<const OrtCustomOp*> remove_padding_ops(const OrtApi* ort) {
  api = ort;
  static std::vector<OpDef> ops = [] {
    std::vector<OpDef> v;
    for (auto t : kTypes) v.push_back(make_op(t, kProvider));
    return v;
  }();
  return op_common::pointers_to(ops);
}
