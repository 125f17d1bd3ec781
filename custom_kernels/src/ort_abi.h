// ort_abi.h: the few pieces of ONNX Runtime's C ABI that our operators use, declared by hand
// (the onnxruntime wheels ship no C headers). Written against the layout of
// include/onnxruntime/core/session/onnxruntime_c_api.h at ORT_API_VERSION 30 (1.30). OrtApi only
// ever grows at the end, so a slot's index is the same in every release from the one that added it
// on. Each used slot has a static_assert on its offset. Unused slots are padding.
#pragma once
#include <cstddef>
#include <cstdint>

extern "C" {

struct OrtStatus;
struct OrtValue;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtTensorTypeAndShapeInfo;

enum ONNXTensorElementDataType : int {  // = TensorProto.DataType
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED = 0,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 = 6,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 = 10,
};
enum OrtErrorCode : int { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2, ORT_RUNTIME_EXCEPTION = 6, ORT_EP_FAIL = 11 };
enum OrtMemType : int { OrtMemTypeCPUInput = -2, OrtMemTypeCPUOutput = -1, OrtMemTypeDefault = 0 };
enum OrtCustomOpInputOutputCharacteristic : int { INPUT_OUTPUT_REQUIRED = 0, INPUT_OUTPUT_OPTIONAL = 1, INPUT_OUTPUT_VARIADIC = 2 };

typedef OrtStatus* OrtStatusPtr;  // nullptr = success

struct OrtApi {
  OrtStatusPtr (*CreateStatus)(OrtErrorCode code, const char* msg);                                  //   0
  void* pad_1_25[25];                                                                                //   1..25
  OrtStatusPtr (*CreateCustomOpDomain)(const char* domain, OrtCustomOpDomain** out);                 //  26
  OrtStatusPtr (*CustomOpDomain_Add)(OrtCustomOpDomain* domain, const struct OrtCustomOp* op);       //  27
  OrtStatusPtr (*AddCustomOpDomain)(OrtSessionOptions* options, OrtCustomOpDomain* domain);          //  28
  void* pad_29_50[22];                                                                               //  29..50
  OrtStatusPtr (*GetTensorMutableData)(OrtValue* value, void** out);                                 //  51
  void* pad_52_59[8];                                                                                //  52..59
  OrtStatusPtr (*GetTensorElementType)(const OrtTensorTypeAndShapeInfo* info,                        //  60
                                       ONNXTensorElementDataType* out);
  OrtStatusPtr (*GetDimensionsCount)(const OrtTensorTypeAndShapeInfo* info, size_t* out);            //  61
  OrtStatusPtr (*GetDimensions)(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t n);     //  62
  void* pad_63_64[2];                                                                                //  63..64
  OrtStatusPtr (*GetTensorTypeAndShape)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out);     //  65
  void* pad_66_84[19];                                                                               //  66..84
  OrtStatusPtr (*KernelInfoGetAttribute_float)(const OrtKernelInfo* info, const char* name, float* out);    //  85
  OrtStatusPtr (*KernelInfoGetAttribute_int64)(const OrtKernelInfo* info, const char* name, int64_t* out);  //  86
  void* pad_87_89[3];                                                                                //  87..89
  OrtStatusPtr (*KernelContext_GetInput)(const OrtKernelContext* ctx, size_t index,                  //  90
                                         const OrtValue** out);
  OrtStatusPtr (*KernelContext_GetOutput)(OrtKernelContext* ctx, size_t index,                      //  91
                                          const int64_t* dims, size_t n, OrtValue** out);
  void* pad_92_98[7];                                                                                //  92..98
  void (*ReleaseTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo* info);                            //  99
  void* pad_100[1];                                                                                  // 100
  void (*ReleaseCustomOpDomain)(OrtCustomOpDomain* domain);                                          // 101
  void* pad_102_192[91];                                                                             // 102..192
  OrtStatusPtr (*KernelContext_GetGPUComputeStream)(const OrtKernelContext* ctx, void** stream);     // 193
  // ... more slots follow in the real table; never touched here.
};

#define ORT_ABI_SLOT(field, index) static_assert(offsetof(OrtApi, field) == (index) * sizeof(void*), #field)
ORT_ABI_SLOT(CreateStatus, 0);
ORT_ABI_SLOT(CreateCustomOpDomain, 26);
ORT_ABI_SLOT(CustomOpDomain_Add, 27);
ORT_ABI_SLOT(AddCustomOpDomain, 28);
ORT_ABI_SLOT(GetTensorMutableData, 51);
ORT_ABI_SLOT(GetTensorElementType, 60);
ORT_ABI_SLOT(GetDimensionsCount, 61);
ORT_ABI_SLOT(GetDimensions, 62);
ORT_ABI_SLOT(GetTensorTypeAndShape, 65);
ORT_ABI_SLOT(KernelInfoGetAttribute_float, 85);
ORT_ABI_SLOT(KernelInfoGetAttribute_int64, 86);
ORT_ABI_SLOT(KernelContext_GetInput, 90);
ORT_ABI_SLOT(KernelContext_GetOutput, 91);
ORT_ABI_SLOT(ReleaseTensorTypeAndShapeInfo, 99);
ORT_ABI_SLOT(ReleaseCustomOpDomain, 101);
ORT_ABI_SLOT(KernelContext_GetGPUComputeStream, 193);
#undef ORT_ABI_SLOT

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);  // nullptr when this runtime is older than `version`
  const char* (*GetVersionString)();
};

// The custom-op description, as laid out for version 16 (the first with CreateKernelV2 /
// KernelComputeV2, which return a status instead of throwing). ORT reads a field only when
// `version` says the op knows it.
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);  // v1; unused with V2
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);
  ONNXTensorElementDataType (*GetInputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  ONNXTensorElementDataType (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* ctx);  // v1; unused with V2
  void (*KernelDestroy)(void* kernel);
  OrtCustomOpInputOutputCharacteristic (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);   // v8
  OrtCustomOpInputOutputCharacteristic (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);  // v8
  OrtMemType (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);                                 // v13
  int (*GetVariadicInputMinArity)(const OrtCustomOp* op);                                                // v14
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  OrtStatusPtr (*CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel);  // v16
  OrtStatusPtr (*KernelComputeV2)(void* kernel, OrtKernelContext* ctx);                              // v16
  // Fields of later versions (InferOutputShapeFn, Get{Start,End}Version, {Get,Release}MayInplace,
  // {Get,Release}AliasMap): not read for version 16, kept null all the same.
  void* later_versions[7];
};
static_assert(offsetof(OrtCustomOp, CreateKernelV2) == 17 * sizeof(void*), "OrtCustomOp layout");

}  // extern "C"
