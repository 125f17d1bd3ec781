#!/usr/bin/env bash
# Build the custom-operator library with g++ alone: host code that calls cuBLASLt; no nvcc, and no
# ONNX Runtime headers (the wheels ship none: src/ort_abi.h declares the few C API pieces it uses).
#
#   bash custom_kernels/build.sh [OUT_DIR]                   # libbertserve_ops.so for the CUDA provider
#   bash custom_kernels/build.sh --host-reference [OUT_DIR]  # libbertserve_ops_hostref.so: the same op on
#                                                            # the CPU provider, plain loops (tests only)
# OUT_DIR defaults to custom_kernels/build. CUDA headers and libraries: CUDA_INC / CUDA_LIB (folder lists),
# else $CUDA_HOME or /usr/local/cuda plus python3's site-packages/nvidia/*/{include,lib} (the pip CUDA
# wheels). cublasLt.h includes crt/host_defines.h, which only a CUDA toolkit has (a devel image; the pip
# runtime wheels lack it). The result links libcublasLt.so.13 and libcudart.so.13 by soname; the server
# loads them first (onnxruntime.preload_dlls), so the pip wheels onnxruntime-gpu brings are enough to run it.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
host_reference=""
if [ "${1:-}" = "--host-reference" ]; then host_reference=1; shift; fi
out="$(mkdir -p "${1:-$here/build}" && cd "${1:-$here/build}" && pwd)"
CXX=${CXX:-g++}
# Only RegisterCustomOps is exported; -z defs: every symbol resolved at link time (all of ORT comes in
# through the OrtApi table). libstdc++ stays dynamic, so the library runs on any glibc >= 2.14.
exports="$(mktemp)"; trap 'rm -f "$exports"' EXIT
echo '{ global: RegisterCustomOps; local: *; };' > "$exports"
flags=(-std=c++17 -O2 -fPIC -shared -fvisibility=hidden -Wall -Wextra -Werror -Wl,-z,defs
       -Wl,--version-script="$exports")

if [ -n "$host_reference" ]; then
  "$CXX" "${flags[@]}" -DBERTSERVE_HOST_REFERENCE "$here/src/matmul_epilogues.cc" -o "$out/libbertserve_ops_hostref.so"
  echo "built $out/libbertserve_ops_hostref.so"
  exit 0
fi

if [ -z "${CUDA_INC:-}" ] || [ -z "${CUDA_LIB:-}" ]; then
  pip_dirs=$(python3 - 2>/dev/null <<'PY' || printf '\n\n'
import glob, importlib.util, os
spec = importlib.util.find_spec("nvidia")
roots = list(spec.submodule_search_locations) if spec else []
for kind in ("include", "lib"):
    print(" ".join(d for r in roots for d in sorted(glob.glob(os.path.join(r, "*", kind)))))
PY
)
  toolkit=${CUDA_HOME:-/usr/local/cuda}
  CUDA_INC=${CUDA_INC:-"$toolkit/include $(echo "$pip_dirs" | sed -n 1p)"}
  CUDA_LIB=${CUDA_LIB:-"$(echo "$pip_dirs" | sed -n 2p) $toolkit/lib64"}
fi
# cuDNN's frontend (header-only; pip's nvidia-cudnn-frontend puts it in site-packages/include) for
# bertserve.PackedAttention: CUDNN_FRONTEND_INC, else that folder. Without it, or without cudnn.h and
# nvrtc.h (the nvidia-cudnn-cu13 and nvidia-cuda-nvrtc wheels), the library is built without that operator.
if [ -z "${CUDNN_FRONTEND_INC:-}" ]; then
  CUDNN_FRONTEND_INC=$(python3 -c 'import os, sysconfig; print(os.path.join(sysconfig.get_paths()["purelib"], "include"))' 2>/dev/null || true)
fi
inc=() lib=() have_crt="" have_lt="" have_dnn="" have_nvrtc="" have_fe=""
for d in $CUDA_INC; do [ -d "$d" ] || continue; inc+=(-isystem "$d")
  [ -f "$d/crt/host_defines.h" ] && have_crt=1; [ -f "$d/cublasLt.h" ] && have_lt=1
  [ -f "$d/cudnn.h" ] && have_dnn=1; [ -f "$d/nvrtc.h" ] && have_nvrtc=1; done
for d in $CUDA_LIB; do [ -d "$d" ] && lib+=(-L"$d"); done
[ -n "$have_lt" ] || { echo "build.sh: no cublasLt.h in: $CUDA_INC (set CUDA_INC; pip: the nvidia-cublas wheel's nvidia/cu13/include)" >&2; exit 1; }
[ -n "$have_crt" ] || { echo "build.sh: no crt/host_defines.h in: $CUDA_INC (it comes with a CUDA toolkit, e.g. a CUDA devel image; set CUDA_INC)" >&2; exit 1; }
sources=("$here/src/matmul_epilogues.cc")
[ -f "${CUDNN_FRONTEND_INC:-/nonexistent}/cudnn_frontend.h" ] && have_fe=1
if [ -n "$have_fe" ] && [ -n "$have_dnn" ] && [ -n "$have_nvrtc" ]; then
  sources+=("$here/src/packed_attention.cc")
  flags+=(-DBERTSERVE_PACKED_ATTENTION -DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING -isystem "$CUDNN_FRONTEND_INC")
else
  echo "build.sh: building without PackedAttention (cudnn_frontend.h: ${have_fe:-missing}, cudnn.h: ${have_dnn:-missing}, nvrtc.h: ${have_nvrtc:-missing})" >&2
fi
"$CXX" "${flags[@]}" "${inc[@]}" "${sources[@]}" -o "$out/libbertserve_ops.so" "${lib[@]}" \
  -l:libcublasLt.so.13 -l:libcudart.so.13 -ldl
echo "built $out/libbertserve_ops.so (${sources[*]##*/})"
