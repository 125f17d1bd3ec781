#!/usr/bin/env bash
# Build the custom-operator library: host code that calls cuBLASLt (g++), and where nvcc is found the
# attention and padding-removal kernels too (bertserve.PackedAttention, bertserve.RemovePadding); no ONNX
# Runtime headers (the wheels ship none: src/ort_abi.h declares the few C API pieces it uses).
#
#   bash custom_kernels/build.sh [OUT_DIR]                   # libbertserve_ops.so for the CUDA provider
#   bash custom_kernels/build.sh --host-reference [OUT_DIR]  # libbertserve_ops_hostref.so: the same op on
#                                                            # the CPU provider, plain loops (tests only)
# OUT_DIR defaults to custom_kernels/build. CUDA headers and libraries: CUDA_INC / CUDA_LIB (folder lists),
# else $CUDA_HOME or /usr/local/cuda plus python3's site-packages/nvidia/*/{include,lib} (the pip CUDA
# wheels). cublasLt.h includes crt/host_defines.h, which a CUDA toolkit has (a devel image) and so does the
# nvidia-cuda-nvcc wheel: with it, nvidia-cuda-cccl, nvidia-cuda-runtime and nvidia-cublas installed in
# python3's environment, the library builds without a toolkit, on a machine without a GPU too. The result links libcublasLt.so.13 and libcudart.so.13 by soname; the server
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
  "$CXX" "${flags[@]}" -DBERTSERVE_HOST_REFERENCE "$here/src/matmul_epilogues.cc" "$here/src/packed_attention.cc" \
    "$here/src/remove_padding.cc" -o "$out/libbertserve_ops_hostref.so"
  echo "built $out/libbertserve_ops_hostref.so"
  exit 0
fi

if [ -z "${CUDA_INC:-}" ] || [ -z "${CUDA_LIB:-}" ]; then
  pip_dirs=$(python3 - 2>/dev/null <<'PY' || printf '\n\n'
import glob, importlib.util, os
spec = importlib.util.find_spec("nvidia")
roots = list(spec.submodule_search_locations) if spec else []
for kind in ("include", "lib", os.path.join("bin", "nvcc")):
    print(" ".join(d for r in roots for d in sorted(glob.glob(os.path.join(r, "*", kind)))))
PY
)
  toolkit=${CUDA_HOME:-/usr/local/cuda}
  CUDA_INC=${CUDA_INC:-"$toolkit/include $(echo "$pip_dirs" | sed -n 1p)"}
  CUDA_LIB=${CUDA_LIB:-"$(echo "$pip_dirs" | sed -n 2p) $toolkit/lib64"}
fi
inc=() lib=() have_crt="" have_lt=""
for d in $CUDA_INC; do [ -d "$d" ] || continue; inc+=(-I"$d")
  [ -f "$d/crt/host_defines.h" ] && have_crt=1; [ -f "$d/cublasLt.h" ] && have_lt=1; done
for d in $CUDA_LIB; do [ -d "$d" ] && lib+=(-L"$d"); done
[ -n "$have_lt" ] || { echo "build.sh: no cublasLt.h in: $CUDA_INC (set CUDA_INC; pip: the nvidia-cublas wheel's nvidia/cu13/include)" >&2; exit 1; }
[ -n "$have_crt" ] || { echo "build.sh: no crt/host_defines.h in: $CUDA_INC (it comes with a CUDA toolkit, e.g. a CUDA devel image, or pip's nvidia-cuda-nvcc; set CUDA_INC)" >&2; exit 1; }
# The attention and padding-removal kernels need nvcc (NVCC, else $CUDA_HOME/bin, PATH or pip's nvidia-cuda-nvcc).
# Without it the library has no PackedAttention and no RemovePadding, and export keeps ORT's
# PackedMultiHeadAttention and RemovePadding in the graph it writes.
NVCC=${NVCC:-$(command -v "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" || command -v nvcc ||
                echo "${pip_dirs:-}" | sed -n 3p | cut -d' ' -f1)}
sources=("$here/src/matmul_epilogues.cc") built_from=(matmul_epilogues.cc)
if [ -n "$NVCC" ]; then
  kernel_objs="$(mktemp -d)"; trap 'rm -rf "$exports" "$kernel_objs"' EXIT
  # SASS for Ampere (8.0, 8.6), Ada (8.9) and Hopper (9.0), and PTX that later cards compile at load.
  compile() {
    "$NVCC" -std=c++17 -O3 -Xcompiler -fPIC,-fvisibility=hidden "${inc[@]}" -c "$here/src/$1.cu" -o "$kernel_objs/$1.o" \
      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_86,code=sm_86 \
      -gencode arch=compute_89,code=sm_89 -gencode arch=compute_90,code=[sm_90,compute_90]
  }
  if compile packed_attention_kernel && compile remove_padding_kernel; then
    sources+=("$here/src/packed_attention.cc" "$here/src/remove_padding.cc" "$kernel_objs/packed_attention_kernel.o"
              "$kernel_objs/remove_padding_kernel.o")
    built_from=(matmul_epilogues.cc packed_attention.cc remove_padding.cc packed_attention_kernel.cu remove_padding_kernel.cu)
    flags+=(-DBERTSERVE_PACKED_ATTENTION -DBERTSERVE_REMOVE_PADDING)
  else  # an nvcc too old for these targets, say: the products' operators are still worth having
    echo "build.sh: $NVCC could not compile the kernels (above): building without PackedAttention and RemovePadding" >&2
  fi
else
  echo "build.sh: no nvcc (set NVCC or CUDA_HOME): building without PackedAttention and RemovePadding" >&2
fi
"$CXX" "${flags[@]}" "${inc[@]}" "${sources[@]}" -o "$out/libbertserve_ops.so" "${lib[@]}" \
  -l:libcublasLt.so.13 -l:libcudart.so.13
echo "built $out/libbertserve_ops.so (${built_from[*]})"
