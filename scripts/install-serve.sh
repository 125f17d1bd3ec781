#!/usr/bin/env bash
# Install the serving runtime (this project with its `serve` or `gpu` extra; never torch) into $PYTHON,
# then check that the server imports without torch. The Dockerfile runs exactly this; so does
# tests/test_server_install.py, in a fresh virtual environment.
#
# Usage: scripts/install-serve.sh [cpu|gpu] [--deps-only]  (PYTHON defaults to `python`; PIP_* variables apply)
#   cpu: onnxruntime (CPU) - the `serve` extra
#   gpu: onnxruntime-gpu with the CUDA and cuDNN libraries from pip (its `cuda`, `cudnn` extras), which
#        onnxruntime.preload_dlls() finds at startup: only the host's NVIDIA driver is needed.
#   --deps-only: only what those need, read from pyproject.toml alone (Python 3.11+): the Dockerfile installs
#        them in a layer before the code's, so that a change to the code does not download them again.
set -euo pipefail
flavour="${1:-cpu}"
deps_only="${2:-}"
py="${PYTHON:-python}"
src="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "$flavour" in
  cpu) extra=serve; targets=("$src[serve]") ;;
  gpu) extra=gpu; targets=("$src[gpu]" "onnxruntime-gpu[cuda,cudnn]") ;;
  *) echo "usage: $0 [cpu|gpu] [--deps-only]" >&2; exit 2 ;;
esac
case "$deps_only" in
  "") ;;
  --deps-only)
    # The extra's requirements, its references to this project's other extras followed.
    mapfile -t requirements < <("$py" - "$src/pyproject.toml" "$extra" <<'PY'
import re
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
extras, found, seen = project["optional-dependencies"], list(project["dependencies"]), set()


def add(extra: str) -> None:
    if extra not in seen:
        seen.add(extra)
        for requirement in extras[extra]:
            own = re.fullmatch(re.escape(project["name"]) + r"\[(.+)\]", requirement.strip())
            if own:
                for name in own.group(1).split(","):
                    add(name.strip())
            else:
                found.append(requirement)


add(sys.argv[2])
print("\n".join(found))
PY
    )
    [ "${#requirements[@]}" -gt 0 ] || { echo "$0: could not read $src/pyproject.toml (--deps-only needs Python 3.11+)" >&2; exit 2; }
    targets=("${requirements[@]}" "${targets[@]:1}") ;;
  *) echo "usage: $0 [cpu|gpu] [--deps-only]" >&2; exit 2 ;;
esac
"$py" -m pip install --no-cache-dir --disable-pip-version-check --progress-bar off "${targets[@]}"
[ -z "$deps_only" ] || exit 0
# Run from / so that the installed package is imported, not the source folder.
(cd / && "$py" - <<'PY'
import sys
import app.main, app.__main__, onnxruntime
assert "torch" not in sys.modules, "the server imported torch"
print("serving runtime OK: onnxruntime", onnxruntime.__version__, onnxruntime.get_available_providers())
PY
)
