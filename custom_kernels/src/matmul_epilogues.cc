// ONNX Runtime custom-op library: matrix products with their epilogue fused, on the CUDA provider.
//
//   bertserve.MatMulBiasGelu  Y = gelu(X·W + bias)
//   bertserve.MatMulBias      Y = X·W + bias
//   X [..., K] fp16, W [K, N] fp16, bias [N] fp16  ->  Y [..., N] fp16
//
// One cublasLtMatmul with the CUBLASLT_EPILOGUE_GELU_BIAS / _BIAS epilogue, fp32 accumulation. Row-major
// tensors are handed to column-major cuBLASLt as their transposes: Yᵀ[N×M] = Wᵀ[N×K] · Xᵀ[K×M], bias
// one value per row of Yᵀ. Load with SessionOptions.register_custom_ops_library(path).
//
// MatMulBiasGelu replaces ORT's MatMul + com.microsoft.BiasGelu pair of every feed-forward block
// (custom_kernels/fusion.py rewrites the graph): the GEMM writes gelu(x) directly instead of x for a
// second kernel to read back, which saved about 1.4 ms of 14.4 per BERT-base batch of 256 x 128 on an
// H100. MatMulBias gives PackedMultiHeadAttention its Q, K and V with their biases added, so that the
// attention reads them where they are instead of adding the bias into a copy first.
//
// The packed graph's M is the batch's real token count, so a server meets a new M in most batches. An
// algorithm is chosen once per operator, K, N, alignment and power-of-two bucket of M, for the process,
// and a new M in a known bucket reuses it (a query of cuBLASLt's heuristic costs far more than the
// product of a small batch); should cuBLASLt refuse it for that M, that M gets its own query. The
// heuristic ranks algorithms by a model of the card, and for the large products of a big batch its
// first choice is not always the fastest: the first product of at least kTuneMinRows rows in a bucket
// times the top candidates on the node's own stream and keeps the fastest. BERTSERVE_KERNELS_AUTOTUNE=0
// keeps the heuristic's first choice; BERTSERVE_KERNELS_AUTOTUNE_LOG=1 prints each choice and its timings
// to stderr. Nothing is timed while a stream is being captured into a CUDA graph.
//
// Built with -DBERTSERVE_HOST_REFERENCE (build.sh --host-reference) the library has no CUDA at all:
// the same ops run on the CPU provider (fp16 and fp32, plain loops, exact-erf GELU), so the hand-made
// ABI (ort_abi.h) and the graph rewrites are tested on machines without a GPU (tests/test_custom_kernels.py).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "op_common.h"
#include "ort_abi.h"
#include "packed_attention.h"
#include "remove_padding.h"

#ifndef BERTSERVE_HOST_REFERENCE
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#endif

namespace {

#ifndef BERTSERVE_HOST_REFERENCE
using op_common::cuda_error;
#endif
using op_common::dims_str;
using op_common::kOpVersion;
using op_common::read_input;

constexpr const char* kDomain = "bertserve";

const OrtApi* api = nullptr;  // set by RegisterCustomOps

// `op`: the operator's name, which starts every message.
OrtStatusPtr fail(const char* op, OrtErrorCode code, const std::string& msg) {
  return api->CreateStatus(code, (std::string(op) + ": " + msg).c_str());
}

// One registered operator: its name and epilogue, element type and execution provider.
struct OpDef : OrtCustomOp {
  const char* name;
  bool gelu;  // GELU after the bias, or the bias alone
  ONNXTensorElementDataType type;
  const char* provider;
};

#ifdef BERTSERVE_HOST_REFERENCE

struct Kernel {
  const OpDef* def;
};

template <typename T>
void host_matmul(const T* x, const T* w, const T* b, T* y, int64_t M, int64_t K, int64_t N, bool gelu) {
  std::vector<float> wf(w, w + K * N), acc(N);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) acc[n] = float(b[n]);
    for (int64_t k = 0; k < K; ++k) {
      const float xv = float(x[m * K + k]);
      for (int64_t n = 0; n < N; ++n) acc[n] += xv * wf[k * N + n];
    }
    for (int64_t n = 0; n < N; ++n)
      y[m * N + n] = T(gelu ? 0.5f * acc[n] * (1.0f + std::erf(acc[n] * 0.70710678f)) : acc[n]);
  }
}

OrtStatusPtr create_kernel(const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo*, void** out) {
  *out = new Kernel{static_cast<const OpDef*>(op)};
  return nullptr;
}

OrtStatusPtr run(Kernel& k, int64_t M, int64_t K, int64_t N, const void* x, const void* w, const void* b,
                 void* y, void* /*stream: none on the CPU provider*/) {
  if (k.def->type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
    host_matmul(static_cast<const _Float16*>(x), static_cast<const _Float16*>(w), static_cast<const _Float16*>(b),
                static_cast<_Float16*>(y), M, K, N, k.def->gelu);
  else
    host_matmul(static_cast<const float*>(x), static_cast<const float*>(w), static_cast<const float*>(b),
                static_cast<float*>(y), M, K, N, k.def->gelu);
  return nullptr;
}

const ONNXTensorElementDataType kTypes[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
const char* const kProvider = "CPUExecutionProvider";

#else  // CUDA

std::string lt_error(const char* what, cublasStatus_t s) {
  const std::string msg =
      std::string(what) + " failed: " + cublasLtGetStatusString(s) + " (" + std::to_string(int(s)) + ")";
  // A sticky CUDA error (an illegal address earlier in the graph, say) reaches cuBLASLt only as a failed
  // call: name CUDA's own error too, so that the server tells the engine is lost (app/engine.py)
  const cudaError_t e = cudaPeekAtLastError();
  return e == cudaSuccess ? msg : msg + "; " + cuda_error("the CUDA context", e);
}
#define LT_CHECK(op, call)                                                               \
  do {                                                                                   \
    cublasStatus_t st_ = (call);                                                         \
    if (st_ != CUBLAS_STATUS_SUCCESS) return fail(op, ORT_EP_FAIL, lt_error(#call, st_)); \
  } while (0)

constexpr int64_t kTuneMinRows = 4096;  // smaller products take a few microseconds whatever the algorithm
constexpr int kTuneCandidates = 8;
constexpr int kTuneRuns = 5;  // timed calls of a candidate per pass
constexpr int kTunePasses = 4;  // over all candidates, alternately in order and in reverse

// The algorithm chosen for each (operator, K, N, alignment, log2 M), shared by every node of every
// session in the process: the twelve layers of an encoder choose (and tune) each shape once.
using BucketKey = std::tuple<const char*, int64_t, int64_t, int, int>;
struct ChosenAlgos {
  std::mutex mu;
  std::map<BucketKey, cublasLtMatmulAlgo_t> best;
};
ChosenAlgos& chosen_algos() {
  static ChosenAlgos* t = new ChosenAlgos;  // never destroyed: kernels may outlive static destruction
  return *t;
}

int log2_floor(int64_t v) {
  int b = 0;
  while (v >>= 1) ++b;
  return b;
}

// Descriptors and the chosen algorithm for one problem size (they hold no device memory).
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, y = nullptr;
  cublasLtMatmulAlgo_t algo{};
  void release() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (w) cublasLtMatrixLayoutDestroy(w);
    if (x) cublasLtMatrixLayoutDestroy(x);
    if (y) cublasLtMatrixLayoutDestroy(y);
  }
};

// One per node of the graph. Handle, workspace and event are made here, once: Compute never
// allocates, so it may run inside ORT's CUDA-graph capture.
struct Kernel {
  const OpDef* def = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // Concurrent Run()s may bring different streams; they share the workspace, so a call on another
  // stream than the last one waits for the last one's GEMM (`done`). One stream: no wait, no cost.
  cudaEvent_t done = nullptr;
  cudaStream_t last = nullptr;
  bool autotune = true;
  bool tune_log = false;  // BERTSERVE_KERNELS_AUTOTUNE_LOG=1: each decision and its timings on stderr
  cudaEvent_t tune_start = nullptr, tune_stop = nullptr;  // timing events, for autotuning only
  std::mutex mu;  // guards plans, last, and the bias pointer written into a plan's descriptor
  std::map<std::tuple<int64_t, int64_t, int64_t, int>, Plan> plans;  // (M, K, N, pointer alignment)
  ~Kernel() {
    for (auto& kv : plans) kv.second.release();
    if (done) cudaEventDestroy(done);
    if (tune_start) cudaEventDestroy(tune_start);
    if (tune_stop) cudaEventDestroy(tune_stop);
    if (workspace) cudaFree(workspace);
    if (lt) cublasLtDestroy(lt);
  }
};

OrtStatusPtr create_kernel(const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo*, void** out) {
  auto k = std::make_unique<Kernel>();
  k->def = static_cast<const OpDef*>(op);
  const char* name = k->def->name;
  int device = -1;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return fail(name, ORT_EP_FAIL, cuda_error("cudaGetDevice", e));
  LT_CHECK(name, cublasLtCreate(&k->lt));
  e = cudaEventCreateWithFlags(&k->done, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventCreate(&k->tune_start);
  if (e == cudaSuccess) e = cudaEventCreate(&k->tune_stop);
  if (e != cudaSuccess) return fail(name, ORT_EP_FAIL, cuda_error("cudaEventCreate", e));
  const char* tune = std::getenv("BERTSERVE_KERNELS_AUTOTUNE");
  k->autotune = !(tune && std::strcmp(tune, "0") == 0);
  const char* log = std::getenv("BERTSERVE_KERNELS_AUTOTUNE_LOG");
  k->tune_log = log && std::strcmp(log, "1") == 0;
  const char* mb = std::getenv("BERTSERVE_KERNELS_WORKSPACE_MB");
  k->workspace_bytes = size_t(mb ? std::atol(mb) : 32) << 20;
  if (k->workspace_bytes) {
    e = cudaMalloc(&k->workspace, k->workspace_bytes);
    if (e != cudaSuccess) return fail(name, ORT_EP_FAIL, cuda_error("cudaMalloc(cuBLASLt workspace)", e));
  }
  *out = k.release();
  return nullptr;
}

// The descriptors of a plan for this M (no algorithm yet).
OrtStatusPtr make_descriptors(Kernel& k, int64_t M, int64_t K, int64_t N, Plan* p) {
  const char* name = k.def->name;
  LT_CHECK(name, cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t no = CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue = k.def->gelu ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_BIAS;
  const cudaDataType_t bias_type = CUDA_R_16F;
  LT_CHECK(name, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &no, sizeof(no)));
  LT_CHECK(name, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &no, sizeof(no)));
  LT_CHECK(name, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  LT_CHECK(name, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                sizeof(bias_type)));
  // Column-major views of the row-major tensors: Wᵀ is N×K (ld N), Xᵀ is K×M (ld K), Yᵀ is N×M (ld N).
  LT_CHECK(name, cublasLtMatrixLayoutCreate(&p->w, CUDA_R_16F, N, K, N));
  LT_CHECK(name, cublasLtMatrixLayoutCreate(&p->x, CUDA_R_16F, K, M, K));
  LT_CHECK(name, cublasLtMatrixLayoutCreate(&p->y, CUDA_R_16F, N, M, N));
  return nullptr;
}

// `candidates`: cuBLASLt's heuristic choices for the plan's problem, best first (p->algo is the first).
OrtStatusPtr query_heuristic(Kernel& k, int64_t M, int64_t K, int64_t N, int align, Plan* p,
                             std::vector<cublasLtMatmulHeuristicResult_t>* candidates) {
  const char* name = k.def->name;
  cublasLtMatmulPreference_t pref = nullptr;
  LT_CHECK(name, cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t max_ws = k.workspace_bytes;
  const uint32_t a = uint32_t(align);
  cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulPreferenceSetAttribute(pref, attr, &a, sizeof(a));
  candidates->assign(kTuneCandidates, cublasLtMatmulHeuristicResult_t{});
  int found = 0;
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulAlgoGetHeuristic(k.lt, p->op, p->w, p->x, p->y, p->y, pref, kTuneCandidates,
                                       candidates->data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS) return fail(name, ORT_EP_FAIL, lt_error("cublasLtMatmulAlgoGetHeuristic", s));
  candidates->resize(found);
  if (found == 0 || (*candidates)[0].state != CUBLAS_STATUS_SUCCESS)
    return fail(name, ORT_EP_FAIL, std::string("cuBLASLt has no algorithm with the ") +
                                       (k.def->gelu ? "GELU_BIAS" : "BIAS") + " epilogue for M=" + std::to_string(M) +
                                 " K=" + std::to_string(K) + " N=" + std::to_string(N) + " (alignment " +
                                 std::to_string(align) + " B, workspace " + std::to_string(max_ws) + " B)");
  p->algo = (*candidates)[0].algo;
  return nullptr;
}

// Y = X·W with the plan's epilogue (the bias pointer is set on the plan).
cublasStatus_t matmul(Kernel& k, Plan& p, const cublasLtMatmulAlgo_t& algo, const void* x, const void* w, void* y,
                      cudaStream_t s) {
  const float alpha = 1.0f, beta = 0.0f;
  return cublasLtMatmul(k.lt, p.op, &alpha, w, p.w, x, p.x, &beta, y, p.y, y, p.y, &algo, k.workspace,
                        k.workspace_bytes, s);
}

// Milliseconds a call of `algo` takes on stream s (the mean of kTuneRuns after one warm-up), or a
// negative value when cuBLASLt refuses it. Writes y, which the real call overwrites afterwards.
float time_algo(Kernel& k, Plan& p, const cublasLtMatmulAlgo_t& algo, const void* x, const void* w, void* y,
                cudaStream_t s) {
  auto call = [&] { return matmul(k, p, algo, x, w, y, s); };
  if (call() != CUBLAS_STATUS_SUCCESS) return -1.0f;
  if (cudaEventRecord(k.tune_start, s) != cudaSuccess) return -1.0f;
  for (int i = 0; i < kTuneRuns; ++i)
    if (call() != CUBLAS_STATUS_SUCCESS) return -1.0f;
  float ms = -1.0f;
  if (cudaEventRecord(k.tune_stop, s) != cudaSuccess || cudaEventSynchronize(k.tune_stop) != cudaSuccess ||
      cudaEventElapsedTime(&ms, k.tune_start, k.tune_stop) != cudaSuccess)
    return -1.0f;
  return ms / kTuneRuns;
}

// Whether stream s is being captured into a CUDA graph (or cannot say): nothing may be timed on it then.
bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(s, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone;
}

// Sets p.algo to the fastest of `candidates` on this product (each timed on stream s).
void tune_algo(Kernel& k, Plan& p, const std::vector<cublasLtMatmulHeuristicResult_t>& candidates, int64_t M,
               int64_t K, int64_t N, int align, const void* x, const void* w, void* y, cudaStream_t s) {
  // Each candidate's best pass: the GPU's clock climbs while an idle card starts work, which would favour
  // whichever candidate comes last; alternating the order gives every one a turn at the end.
  const size_t n = candidates.size();
  std::vector<float> fastest(n, -1.0f);
  for (int pass = 0; pass < kTunePasses; ++pass)
    for (size_t j = 0; j < n; ++j) {
      const size_t i = pass % 2 ? n - 1 - j : j;
      if (candidates[i].state != CUBLAS_STATUS_SUCCESS) continue;
      const float ms = time_algo(k, p, candidates[i].algo, x, w, y, s);
      if (ms >= 0.0f && (fastest[i] < 0.0f || ms < fastest[i])) fastest[i] = ms;
    }
  size_t chosen = 0;  // the heuristic's first when none could be timed
  for (size_t i = 0; i < n; ++i)
    if (fastest[i] >= 0.0f && (fastest[chosen] < 0.0f || fastest[i] < fastest[chosen])) chosen = i;
  p.algo = candidates[chosen].algo;
  if (k.tune_log) {
    std::string line = std::string("bertserve autotune ") + k.def->name + " M=" + std::to_string(M) + " K=" +
                       std::to_string(K) + " N=" + std::to_string(N) + " align=" + std::to_string(align) + " ms:";
    for (size_t i = 0; i < n; ++i) line += " " + std::to_string(fastest[i]).substr(0, 6);
    std::fprintf(stderr, "%s -> #%zu\n", line.c_str(), chosen);
  }
}

// A new plan's algorithm: its bucket's when the process has chosen one (*from_bucket), else cuBLASLt's
// heuristic's first, or the fastest of its candidates for a large product, which then becomes the
// bucket's. A first choice made during a CUDA-graph capture, where nothing is timed, is not kept for a
// bucket that would have been tuned.
OrtStatusPtr choose_algo(Kernel& k, Plan& p, int64_t M, int64_t K, int64_t N, int align, const void* x,
                         const void* w, void* y, cudaStream_t s, bool* from_bucket) {
  ChosenAlgos& chosen = chosen_algos();
  const BucketKey key = std::make_tuple(k.def->name, K, N, align, log2_floor(M));
  {
    std::lock_guard<std::mutex> lock(chosen.mu);
    auto known = chosen.best.find(key);
    *from_bucket = known != chosen.best.end();
    if (*from_bucket) {
      p.algo = known->second;
      return nullptr;
    }
  }
  std::vector<cublasLtMatmulHeuristicResult_t> candidates;
  if (OrtStatusPtr st = query_heuristic(k, M, K, N, align, &p, &candidates)) return st;
  // A large product's first time: its candidates are timed (large products only, outside a capture).
  if (k.autotune && M >= kTuneMinRows && candidates.size() >= 2) {
    if (capturing(s)) return nullptr;  // the heuristic's first for now; the bucket is tuned outside a capture
    tune_algo(k, p, candidates, M, K, N, align, x, w, y, s);
  }
  std::lock_guard<std::mutex> lock(chosen.mu);
  chosen.best.emplace(key, p.algo);
  return nullptr;
}

OrtStatusPtr run(Kernel& k, int64_t M, int64_t K, int64_t N, const void* x, const void* w, const void* b,
                 void* y, void* stream) {
  const char* name = k.def->name;
  if (!stream) return fail(name, ORT_EP_FAIL, "ORT gave no CUDA compute stream (is the node on CUDAExecutionProvider?)");
  const uintptr_t bits = uintptr_t(x) | uintptr_t(w) | uintptr_t(y);
  int align = 256;
  while (align > 2 && (bits & uintptr_t(align - 1))) align >>= 1;

  std::lock_guard<std::mutex> lock(k.mu);
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t e = k.last && k.last != s ? cudaStreamWaitEvent(s, k.done, 0) : cudaSuccess;
  if (e != cudaSuccess) return fail(name, ORT_EP_FAIL, cuda_error("cudaStreamWaitEvent", e));
  auto key = std::make_tuple(M, K, N, align);
  auto it = k.plans.find(key);
  bool new_plan = it == k.plans.end(), from_bucket = false;
  if (new_plan) {
    if (k.plans.size() >= 256) {  // many distinct token counts (dynamic batches): start over
      for (auto& kv : k.plans) kv.second.release();
      k.plans.clear();
    }
    Plan p;
    if (OrtStatusPtr st = make_descriptors(k, M, K, N, &p)) {
      p.release();
      return st;
    }
    it = k.plans.emplace(key, p).first;
  }
  Plan& p = it->second;
  LT_CHECK(name, cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b, sizeof(b)));
  if (new_plan) {
    if (OrtStatusPtr st = choose_algo(k, p, M, K, N, align, x, w, y, s, &from_bucket)) {
      p.release();
      k.plans.erase(it);
      return st;
    }
  }
  cublasStatus_t st = matmul(k, p, p.algo, x, w, y, s);
  if (st != CUBLAS_STATUS_SUCCESS && from_bucket) {  // the bucket's algorithm does not fit this M: its own
    std::vector<cublasLtMatmulHeuristicResult_t> candidates;
    if (OrtStatusPtr q = query_heuristic(k, M, K, N, align, &p, &candidates)) return q;
    st = matmul(k, p, p.algo, x, w, y, s);
  }
  if (st != CUBLAS_STATUS_SUCCESS) return fail(name, ORT_EP_FAIL, lt_error("cublasLtMatmul", st));
  e = cudaEventRecord(k.done, s);
  if (e != cudaSuccess) return fail(name, ORT_EP_FAIL, cuda_error("cudaEventRecord", e));
  k.last = s;
  return nullptr;
}

const ONNXTensorElementDataType kTypes[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16};
const char* const kProvider = "CUDAExecutionProvider";

#endif  // BERTSERVE_HOST_REFERENCE

OrtStatusPtr compute(void* kernel, OrtKernelContext* ctx) {
  Kernel& k = *static_cast<Kernel*>(kernel);
  const char* name = k.def->name;
  const OrtValue* in[3];
  ONNXTensorElementDataType type[3];
  std::vector<int64_t> dims[3];
  for (size_t i = 0; i < 3; ++i) {
    RETURN_IF_ERROR(read_input(api, ctx, i, name, &in[i], &type[i], &dims[i]));
    if (type[i] != k.def->type)
      return fail(name, ORT_INVALID_ARGUMENT, "input " + std::to_string(i) + " has an unexpected element type");
  }
  const auto &xd = dims[0], &wd = dims[1], &bd = dims[2];
  if (xd.size() < 2 || wd.size() != 2 || bd.size() != 1 || xd.back() != wd[0] || bd[0] != wd[1] || wd[0] <= 0)
    return fail(name, ORT_INVALID_ARGUMENT, "shapes X " + dims_str(xd) + ", W " + dims_str(wd) + ", bias " +
                                                dims_str(bd) + " do not fit X [..., K], W [K, N], bias [N]");
  const int64_t K = wd[0], N = wd[1];
  int64_t M = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) M *= xd[i];
  std::vector<int64_t> yd(xd);
  yd.back() = N;
  OrtValue* out = nullptr;
  RETURN_IF_ERROR(api->KernelContext_GetOutput(ctx, 0, yd.data(), yd.size(), &out));
  if (M == 0 || N == 0) return nullptr;

  void* ptr[4];
  for (int i = 0; i < 3; ++i) RETURN_IF_ERROR(api->GetTensorMutableData(const_cast<OrtValue*>(in[i]), &ptr[i]));
  RETURN_IF_ERROR(api->GetTensorMutableData(out, &ptr[3]));
  void* stream = nullptr;
  RETURN_IF_ERROR(api->KernelContext_GetGPUComputeStream(ctx, &stream));
  return run(k, M, K, N, ptr[0], ptr[1], ptr[2], ptr[3], stream);
}

OpDef make_op(const char* name, bool gelu, ONNXTensorElementDataType type, const char* provider) {
  OpDef op;
  std::memset(static_cast<void*>(&op), 0, sizeof(op));
  op_common::set_common_fields(op);
  op.name = name;
  op.gelu = gelu;
  op.type = type;
  op.provider = provider;
  op.GetName = [](const OrtCustomOp* o) { return static_cast<const OpDef*>(o)->name; };
  op_common::set_kernel_fields<OpDef, Kernel>(op, create_kernel, compute);
  op.GetInputType = [](const OrtCustomOp* o, size_t) { return static_cast<const OpDef*>(o)->type; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 3; };
  op.GetOutputType = [](const OrtCustomOp* o, size_t) { return static_cast<const OpDef*>(o)->type; };
  return op;
}

}  // namespace

// Called by ORT for SessionOptions.register_custom_ops_library(path). ORT keeps pointers to the
// OpDefs and the domain for the sessions' lifetime: the OpDefs are static, the domain is never freed.
extern "C" __attribute__((visibility("default"))) OrtStatusPtr RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* base) {
  api = base->GetApi(kOpVersion);
  if (!api) {
    const OrtApi* v1 = base->GetApi(1);  // slot 0 (CreateStatus) exists in every version
    std::string msg = std::string("libbertserve_ops needs ONNX Runtime >= 1.16 (C API version 16); this is ") +
                      base->GetVersionString();
    return v1 ? v1->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  static std::vector<OpDef> ops = [] {
    std::vector<OpDef> v;
    for (auto t : kTypes) {
      v.push_back(make_op("MatMulBiasGelu", true, t, kProvider));
      v.push_back(make_op("MatMulBias", false, t, kProvider));
    }
    return v;
  }();
  OrtCustomOpDomain* domain = nullptr;
  RETURN_IF_ERROR(api->CreateCustomOpDomain(kDomain, &domain));
  OrtStatusPtr s = nullptr;
  for (auto& op : ops)
    if (!s) s = api->CustomOpDomain_Add(domain, &op);
#if defined(BERTSERVE_HOST_REFERENCE) || defined(BERTSERVE_PACKED_ATTENTION)
  for (const OrtCustomOp* op : packed_attention_ops(api))
    if (!s) s = api->CustomOpDomain_Add(domain, op);
#endif
#if defined(BERTSERVE_HOST_REFERENCE) || defined(BERTSERVE_REMOVE_PADDING)
  for (const OrtCustomOp* op : remove_padding_ops(api))
    if (!s) s = api->CustomOpDomain_Add(domain, op);
#endif
  if (!s) s = api->AddCustomOpDomain(options, domain);
  if (s) api->ReleaseCustomOpDomain(domain);
  return s;
}
