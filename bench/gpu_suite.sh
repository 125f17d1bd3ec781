#!/usr/bin/env bash
# Every GPU check and benchmark of the project, for one lent H100/H200 (see ../shared/GPU.md for
# bringing onnxruntime-gpu there). Results and logs go under $OUT.
#   bench/gpu_suite.sh tests     GPU tests (fp16 export + parity gate, server on CUDA)
#   bench/gpu_suite.sh serving   base artifact -> raw engine vs HTTP (bench/http_load.py serving;
#                                WORKERS=8 FORMAT=base64 to choose)
#   bench/gpu_suite.sh engine    fp16 artifact vs PyTorch fp16 SDPA (bench/engine_throughput.py)
#   bench/gpu_suite.sh train     pre-training step, ours vs transformers compiled (bench/train_throughput.py)
#   bench/gpu_suite.sh trainprofile  where a compiled step of ours spends GPU time (bench/train_step_profile.py)
#   bench/gpu_suite.sh ortsettings  ORT CUDA attention kernels / GEMM options on the padded fp16 graph
#   bench/gpu_suite.sh kernels   GPU kernel time by kind at batch 256, PyTorch vs ORT (bench/engine_kernel_profile.py)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=python3
quiet() { grep -v -E "W:onnxruntime|VerifyEachNodeIsAssignedToAnEp" || true; }
for part in "$@"; do
  case "$part" in
    tests)
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
      timeout 300 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_export_gpu.py tests/test_app.py 2>&1 | quiet | tee "$OUT/gpu_tests.log" | tail -5 ;;
    serving)
      [ -f /tmp/g/art/manifest.json ] || { timeout 120 $PY bench/make_base_model.py /tmp/g \
        && timeout 240 $PY -m export --model /tmp/g/model --out /tmp/g/art --device cuda 2>&1 | quiet | tail -3; }
      timeout 480 $PY bench/http_load.py serving --artifact /tmp/g/art --device cuda --precision fp16 \
        --workers "${WORKERS:-1,4,8,12}" --processes 6 --connections 16 --duration 10 --latency-requests 1000 \
        --encoding-format "${FORMAT:-float}" \
        2>&1 | quiet | tee "$OUT/http_serving.log" | tail -30 ;;
    engine)
      timeout 420 $PY bench/engine_throughput.py --device cuda --preset base 2>&1 | quiet | tee "$OUT/engine.log" | tail -32 ;;
    train)
      timeout 560 $PY bench/train_throughput.py --preset base --batch-size 256 --seq-len 128 2>&1 | quiet | tee "$OUT/train.log" | tail -12 ;;
    trainprofile)
      timeout 400 $PY bench/train_step_profile.py 2>&1 | quiet | tee "$OUT/train_profile.txt" | head -60 ;;
    ortsettings)
      { timeout 240 $PY bench/ort_cuda_settings.py build
        for g in attention rawmask mha nomask; do $PY bench/ort_cuda_settings.py run $g; done
        $PY bench/ort_cuda_settings.py profile attention
        for v in ORT_DISABLE_FLASH_ATTENTION ORT_DISABLE_TRT_FLASH_ATTENTION ORT_DISABLE_FUSED_ATTENTION \
                 ORT_DISABLE_MEMORY_EFFICIENT_ATTENTION ORT_ENABLE_CUDNN_FLASH_ATTENTION; do
          env $v=1 $PY bench/ort_cuda_settings.py run attention; env $v=1 $PY bench/ort_cuda_settings.py run mha; done
        ORT_CUDA_GEMM_OPTIONS=1 $PY bench/ort_cuda_settings.py run attention
        $PY bench/ort_cuda_settings.py run attention '{"tunable_op_enable": "1", "tunable_op_tuning_enable": "1"}'
      } 2>&1 | quiet | tee "$OUT/ort_settings.log" ;;
    kernels)
      timeout 400 $PY bench/engine_kernel_profile.py 256 2>&1 | quiet | tee "$OUT/kernel_profile.txt" | tail -60 ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
