// bertserve.PackedAttention: self-attention over packed sequences (padding removed) on cuDNN's fused
// flash attention, the kernel ORT's padded Attention uses on Hopper, with ragged offsets.
//
//   inputs   query, key, value [T, H·D] fp16 (token t of sequence b at row cu[b] + t, heads side by side)
//            token_offset [B, S] int32 (only its shape is read: S, the longest sequence)
//            sequence_lengths [B] int32, ragged_offsets [B + 1] int32 (cu · H·D: where each sequence's
//            first element is), both on the device (custom_kernels/fusion.py computes them once per graph)
//   attrs    num_heads, scale
//   output   [T, H·D] fp16, laid out like query
//
// It stands in for com.microsoft.PackedMultiHeadAttention, whose kernel on Hopper is an Ampere
// FlashAttention (1.26 ms a BERT-base batch of 256 x 128 on an H200 against 0.82 ms for cuDNN's).
// A cuDNN graph is built per (B, S bucket, H, D, scale) the first time it is met and kept for the
// process; with dynamic shapes and a shared kernel cache that takes milliseconds. S is rounded up to a
// bucket (the padding mask cuts each sequence at its own length, so a longer S only adds blocks that
// exit at once).
#include "packed_attention.h"

#include <cuda_runtime_api.h>
#include <cudnn.h>
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

namespace fe = cudnn_frontend;

const OrtApi* api = nullptr;
constexpr const char* kName = "PackedAttention";
constexpr int kInputs = 6;

OrtStatusPtr fail(OrtErrorCode code, const std::string& msg) {
  return api->CreateStatus(code, (std::string(kName) + ": " + msg).c_str());
}

#define RETURN_IF_ERROR(expr)                          \
  do {                                                 \
    if (OrtStatusPtr status_ = (expr)) return status_; \
  } while (0)

enum Uid : int64_t { kQ = 1, kK, kV, kO, kSeqQ, kSeqKV, kRagQ, kRagK, kRagV, kRagO };

int64_t s_bucket(int64_t s) {  // 16, 32, 64, 128, 256, 512, ... : few graphs for any batch
  int64_t b = 16;
  while (b < s) b <<= 1;
  return b;
}

// device, B, S, H, D, scale, ragged (else every sequence has S tokens: a dense [B, S, H, D] batch)
using GraphKey = std::tuple<int, int64_t, int64_t, int64_t, int64_t, float, bool>;

// Everything the nodes of one process share: cuDNN's handle per device, the built graphs (the twelve
// layers of an encoder use the same ones), and one workspace. cuDNN's plans are not documented as
// safe to run from two threads at once, so one lock covers building and launching; a launch takes
// microseconds.
struct Shared {
  std::mutex mu;
  std::map<int, cudnnHandle_t> handles;
  std::map<GraphKey, std::shared_ptr<fe::graph::Graph>> graphs;
  std::map<std::pair<int, bool>, std::shared_ptr<fe::KernelCache>> kernel_caches;  // (device, ragged)
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // A launch on another stream than the last waits for the last one's (they share the workspace).
  cudaEvent_t done = nullptr;
  cudaStream_t last = nullptr;
  bool log = [] {  // BERTSERVE_KERNELS_AUTOTUNE_LOG=1: each new graph and its plan on stderr
    const char* v = std::getenv("BERTSERVE_KERNELS_AUTOTUNE_LOG");
    return v && std::strcmp(v, "1") == 0;
  }();
};
Shared& shared() {
  static Shared* s = new Shared;  // never destroyed: kernels may outlive static destruction
  return *s;
}

struct Kernel {
  int64_t num_heads = 0;
  float scale = 0.0f;
};

std::string fe_error(const char* what, fe::error_t e) { return std::string(what) + ": " + e.get_message(); }

// Built for dynamic shapes with a kernel cache shared by every graph of its kind: a graph of another batch
// shape reuses the kernels compiled for the first (7-11 ms a shape on an H100 with cuDNN 9.19, against
// 130-230 ms for a graph compiled on its own).
fe::error_t build_graph(cudnnHandle_t handle, int64_t b, int64_t s, int64_t h, int64_t d, float scale, bool ragged,
                        const std::shared_ptr<fe::KernelCache>& kernels, std::shared_ptr<fe::graph::Graph>* out) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_dynamic_shape_enabled(true).set_kernel_cache(kernels);
  g->set_io_data_type(fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  // Logical [B, H, S, D] over rows of H·D: a token's heads side by side, its sequence's tokens in a
  // row; the ragged offsets place each sequence, so the batch stride is never used.
  const std::vector<int64_t> dim{b, h, s, d}, stride{s * h * d, d, h * d, 1};
  auto index = [&](Uid uid, const char* name, int64_t n) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_uid(uid)
                         .set_dim({n, 1, 1, 1})
                         .set_stride({1, 1, 1, 1})
                         .set_data_type(fe::DataType_t::INT32));
  };
  auto matrix = [&](Uid uid, const char* name, Uid offsets) {
    auto t = g->tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(stride));
    if (ragged) t->set_ragged_offset(index(offsets, name, b + 1));
    return t;
  };
  auto q = matrix(kQ, "Q", kRagQ), k = matrix(kK, "K", kRagK), v = matrix(kV, "V", kRagV);
  auto options = fe::graph::SDPA_attributes().set_name("packed_attention").set_generate_stats(false).set_attn_scale(scale);
  if (ragged)
    options.set_padding_mask(true)
        .set_seq_len_q(index(kSeqQ, "seq_len_q", b))
        .set_seq_len_kv(index(kSeqKV, "seq_len_kv", b));
  auto [o, stats] = g->sdpa(q, k, v, options);
  (void)stats;
  o->set_output(true).set_uid(kO).set_dim(dim).set_stride(stride);
  if (ragged) o->set_ragged_offset(index(kRagO, "O", b + 1));
  fe::error_t e = g->validate();
  if (e.is_good()) e = g->build_operation_graph(handle);
  if (e.is_good()) e = g->create_execution_plans({fe::HeurMode_t::A});
  if (e.is_good()) e = g->check_support(handle);
  if (e.is_good()) e = g->build_plans(handle, fe::BuildPlanPolicy_t::ALL);
  if (e.is_good()) *out = std::move(g);
  return e;
}

std::string cuda_error(const char* what, cudaError_t e) {
  return std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

// t tokens in b sequences of at most s; hd = H·D.
OrtStatusPtr run(const Kernel& kernel, int64_t t, int64_t b, int64_t s, int64_t hd, void* const* ptr, cudaStream_t stream) {
  const int64_t h = kernel.num_heads, d = hd / h;
  Shared& sh = shared();
  std::lock_guard<std::mutex> lock(sh.mu);
  int device = 0;
  cudaError_t ce = cudaGetDevice(&device);
  if (ce != cudaSuccess) return fail(ORT_EP_FAIL, cuda_error("cudaGetDevice", ce));
  if (!fe::cudnn_dlhandle && !(fe::cudnn_dlhandle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL)))
    return fail(ORT_EP_FAIL, std::string("cuDNN 9 could not be loaded (") + dlerror() +
                                 "); onnxruntime.preload_dlls() loads pip's nvidia-cudnn-cu13");
  cudnnHandle_t& handle = sh.handles[device];
  if (!handle && fe::detail::create_handle(&handle) != CUDNN_STATUS_SUCCESS) {
    handle = nullptr;
    return fail(ORT_EP_FAIL, "cudnnCreate failed");
  }
  if (!sh.done && (ce = cudaEventCreateWithFlags(&sh.done, cudaEventDisableTiming)) != cudaSuccess)
    return fail(ORT_EP_FAIL, cuda_error("cudaEventCreate", ce));
  if (fe::detail::set_stream(handle, stream) != CUDNN_STATUS_SUCCESS) return fail(ORT_EP_FAIL, "cudnnSetStream failed");
  // Every sequence of full length (t = b·s): the packed rows are a dense batch, and cuDNN's kernel
  // without ragged offsets or a padding mask is a third faster. Only at a bucket's length (texts cut at
  // the served maximum, say): a dense graph is built per exact shape.
  const bool ragged = t != b * s || s != s_bucket(s);
  const GraphKey key{device, b, ragged ? s_bucket(s) : s, h, d, kernel.scale, ragged};
  auto it = sh.graphs.find(key);
  bool fresh = false;
  double build_ms = 0, tune_ms = 0;
  if (it == sh.graphs.end()) {
    if (sh.graphs.size() >= 512) sh.graphs.clear();  // many distinct batch sizes: start over
    std::shared_ptr<fe::graph::Graph> g;
    const auto started = std::chrono::steady_clock::now();
    auto& kernels = sh.kernel_caches[{device, ragged}];
    if (!kernels) kernels = std::make_shared<fe::KernelCache>();
    // Only with dynamic shapes: a graph compiled per batch shape (130-230 ms each) would stall a server
    // at every new batch size. Without them the operator fails, and the server runs the same graph on
    // ORT's PackedMultiHeadAttention instead (app/engine.py).
    fe::error_t e = build_graph(handle, b, std::get<2>(key), h, d, kernel.scale, ragged, kernels, &g);
    if (!e.is_good())
      return fail(ORT_EP_FAIL, fe_error(("cuDNN " + std::to_string(fe::detail::get_backend_version()) +
                                         " builds no " + (ragged ? "ragged" : "dense") +
                                         " attention with dynamic shapes for B=" + std::to_string(b) + " S=" +
                                         std::to_string(std::get<2>(key)) + " H=" + std::to_string(h) + " D=" +
                                         std::to_string(d) + " (cuDNN 9.19 does, 9.14 does not)").c_str(),
                                        e));
    build_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
    it = sh.graphs.emplace(key, std::move(g)).first;
    fresh = true;
  }
  fe::graph::Graph& g = *it->second;
  if (sh.last && sh.last != stream && (ce = cudaStreamWaitEvent(stream, sh.done, 0)) != cudaSuccess)
    return fail(ORT_EP_FAIL, cuda_error("cudaStreamWaitEvent", ce));
  const size_t need = size_t(fresh ? g.get_autotune_workspace_size() : g.get_workspace_size());
  if (need > sh.workspace_bytes) {
    if (sh.workspace) {
      if ((ce = cudaStreamSynchronize(stream)) != cudaSuccess) return fail(ORT_EP_FAIL, cuda_error("cudaStreamSynchronize", ce));
      cudaFree(sh.workspace);
      sh.workspace = nullptr, sh.workspace_bytes = 0;
    }
    if ((ce = cudaMalloc(&sh.workspace, need)) != cudaSuccess) return fail(ORT_EP_FAIL, cuda_error("cudaMalloc(workspace)", ce));
    sh.workspace_bytes = need;
  }
  // ptr: query, key, value, sequence_lengths, ragged_offsets, output
  std::unordered_map<int64_t, void*> pack{{kQ, ptr[0]},    {kK, ptr[1]},    {kV, ptr[2]},    {kO, ptr[5]},
                                          {kSeqQ, ptr[3]}, {kSeqKV, ptr[3]}, {kRagQ, ptr[4]}, {kRagK, ptr[4]},
                                          {kRagV, ptr[4]}, {kRagO, ptr[4]}};
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (fresh && g.get_execution_plan_count() > 1 && cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
      capture == cudaStreamCaptureStatusNone) {
    // Several engines fit: time each on these very inputs and keep the fastest (the frontend's autotune).
    const auto started = std::chrono::steady_clock::now();
    fe::error_t tuned = g.autotune(handle, pack, sh.workspace);
    tune_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
    if (!tuned.is_good()) return fail(ORT_EP_FAIL, fe_error("timing cuDNN's attention plans failed", tuned));
  }
  if (fresh && sh.log) {
    std::string plan;
    if (!g.get_plan_name(plan).is_good()) plan = "plan name unknown";
    std::fprintf(stderr, "bertserve PackedAttention B=%lld S=%lld %s: %lld plans, %s; built in %.1f ms, timed in %.1f ms\n",
                 (long long)b, (long long)std::get<2>(key), ragged ? "ragged" : "dense",
                 (long long)g.get_execution_plan_count(), plan.c_str(), build_ms, tune_ms);
  }
  fe::error_t e = g.execute(handle, pack, sh.workspace);
  if (!e.is_good()) return fail(ORT_EP_FAIL, fe_error("cuDNN attention failed", e));
  if ((ce = cudaEventRecord(sh.done, stream)) != cudaSuccess) return fail(ORT_EP_FAIL, cuda_error("cudaEventRecord", ce));
  sh.last = stream;
  return nullptr;
}

OrtStatusPtr shape_of(const OrtValue* v, ONNXTensorElementDataType* type, std::vector<int64_t>* dims) {
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

std::string dims_str(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

OrtStatusPtr compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel& k = *static_cast<const Kernel*>(kernel);
  const OrtValue* in[kInputs];
  ONNXTensorElementDataType type[kInputs];
  std::vector<int64_t> dims[kInputs];
  for (int i = 0; i < kInputs; ++i) {
    RETURN_IF_ERROR(api->KernelContext_GetInput(ctx, i, &in[i]));
    if (!in[i]) return fail(ORT_INVALID_ARGUMENT, "input " + std::to_string(i) + " is missing");
    RETURN_IF_ERROR(shape_of(in[i], &type[i], &dims[i]));
  }
  const auto& qd = dims[0];
  if (qd.size() != 2 || dims[1] != qd || dims[2] != qd || dims[3].size() != 2 || dims[4].size() != 1 ||
      dims[5].size() != 1 || dims[4][0] != dims[3][0] || dims[5][0] != dims[3][0] + 1 || qd[1] % k.num_heads)
    return fail(ORT_INVALID_ARGUMENT, "shapes query " + dims_str(qd) + ", key " + dims_str(dims[1]) + ", value " +
                                          dims_str(dims[2]) + ", token_offset " + dims_str(dims[3]) +
                                          ", sequence_lengths " + dims_str(dims[4]) + ", ragged_offsets " +
                                          dims_str(dims[5]) + " do not fit [T, H·D] x3, [B, S], [B], [B + 1]");
  for (int i = 0; i < 3; ++i)
    if (type[i] != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) return fail(ORT_INVALID_ARGUMENT, "query, key and value must be fp16");
  OrtValue* out = nullptr;
  RETURN_IF_ERROR(api->KernelContext_GetOutput(ctx, 0, qd.data(), qd.size(), &out));
  if (qd[0] == 0 || dims[3][0] == 0) return nullptr;
  void* ptr[6];
  for (int i = 0, j = 0; i < kInputs; ++i)
    if (i != 3) RETURN_IF_ERROR(api->GetTensorMutableData(const_cast<OrtValue*>(in[i]), &ptr[j++]));
  RETURN_IF_ERROR(api->GetTensorMutableData(out, &ptr[5]));
  void* stream = nullptr;
  RETURN_IF_ERROR(api->KernelContext_GetGPUComputeStream(ctx, &stream));
  if (!stream) return fail(ORT_EP_FAIL, "ORT gave no CUDA compute stream (is the node on CUDAExecutionProvider?)");
  try {  // the frontend throws when it cannot load a library; no exception may cross into ORT
    return run(k, qd[0], dims[3][0], dims[3][1], qd[1], ptr, static_cast<cudaStream_t>(stream));
  } catch (const std::exception& e) {
    return fail(ORT_EP_FAIL, e.what());
  }
}

OrtStatusPtr create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** out) {
  auto k = std::make_unique<Kernel>();
  RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "num_heads", &k->num_heads));
  RETURN_IF_ERROR(api->KernelInfoGetAttribute_float(info, "scale", &k->scale));
  if (k->num_heads <= 0) return fail(ORT_INVALID_ARGUMENT, "num_heads must be positive");
  *out = k.release();
  return nullptr;
}

ONNXTensorElementDataType input_type(const OrtCustomOp*, size_t i) {
  return i < 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
}

OrtCustomOp make_op() {
  OrtCustomOp op;
  std::memset(static_cast<void*>(&op), 0, sizeof(op));
  op.version = 16;
  op.GetName = [](const OrtCustomOp*) { return kName; };
  op.GetExecutionProviderType = [](const OrtCustomOp*) { return "CUDAExecutionProvider"; };
  op.GetInputType = input_type;
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return kInputs; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  return op;
}

}  // namespace

// Built with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING: the frontend reaches cuDNN through this handle,
// so the library links no cuDNN and loads without one until an attention runs.
void* cudnn_frontend::cudnn_dlhandle = nullptr;

const OrtCustomOp* packed_attention_op(const OrtApi* ort) {
  api = ort;
  static OrtCustomOp op = make_op();
  return &op;
}
