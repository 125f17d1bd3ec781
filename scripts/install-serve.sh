#!/usr/bin/env bash
# Install the serving runtime (this project with its `serve` or `gpu` extra; never torch) into $PYTHON,
# then check that the server imports without torch. The Dockerfile runs exactly this; so does
# tests/test_server_install.py, in a fresh virtual environment.
#
# Usage: scripts/install-serve.sh [cpu|gpu]        (PYTHON defaults to `python`; PIP_* variables apply)
#   cpu: onnxruntime (CPU) - the `serve` extra
#   gpu: onnxruntime-gpu with the CUDA and cuDNN libraries from pip (its `cuda`, `cudnn` extras), which
#        onnxruntime.preload_dlls() finds at startup: only the host's NVIDIA driver is needed.
set -euo pipefail
flavour="${1:-cpu}"
py="${PYTHON:-python}"
src="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "$flavour" in
  cpu) targets=("$src[serve]") ;;
  gpu) targets=("$src[gpu]" "onnxruntime-gpu[cuda,cudnn]") ;;
  *) echo "usage: $0 [cpu|gpu]" >&2; exit 2 ;;
esac
"$py" -m pip install --no-cache-dir --disable-pip-version-check --progress-bar off "${targets[@]}"
# Run from / so that the installed package is imported, not the source folder.
(cd / && "$py" - <<'PY'
import sys
import app.main, app.__main__, onnxruntime
assert "torch" not in sys.modules, "the server imported torch"
print("serving runtime OK: onnxruntime", onnxruntime.__version__, onnxruntime.get_available_providers())
PY
)
