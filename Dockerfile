# The embedding server image. Two flavours, two build targets:
#   docker build -t bertserve .                        # GPU (the last stage, so the default)
#   docker build -t bertserve:cpu --target cpu .       # CPU only (onnxruntime)
#   docker run -p 8000:8000 -v ./artifacts:/model bertserve
# podman / buildah: add `--format docker`; their default, the OCI format, has no HEALTHCHECK and drops it.
# GPU: onnxruntime-gpu, with CUDA and cuDNN as pip packages that match its build, so only the host's NVIDIA
# driver is needed (`docker run --gpus all ...`), one that runs their CUDA 13: the 580 series or newer; it
# also carries our CUDA operator library (custom_kernels/), built against those same pip packages (cuBLAS's
# and the runtime's headers come with them; nvcc and CCCL come from pip too, in the build stage only: no CUDA
# devel image); the server runs an artifact's custom-kernels graph with it.
# The CPU stages come first and never name the CUDA image: the classic builder (DOCKER_BUILDKIT=0) builds
# every stage up to the target, so `--target cpu` stops before the GPU stages; BuildKit and podman build
# only the stages the target uses.
# Settings come from BERTSERVE_* variables (`docker run -e BERTSERVE_MAX_BATCH_TOKENS=32768 ...`).
# On a GPU host add `-e BERTSERVE_WORKERS=12` (about 3/4 of the cores): HTTP worker processes around one
# engine process; one Python process alone cannot keep the GPU busy (README, BENCHMARKS.md). Several GPUs:
# `--gpus all -e BERTSERVE_CUDA_DEVICE_IDS=0,1 -e BERTSERVE_WORKERS=16`, one engine process per GPU (or
# one container per GPU with `--gpus device=N`: both measured 1.97-2.02x one GPU on two H100s).
# `docker stop` waits 10 s by default: enough for the default drain (BERTSERVE_DRAIN_SECONDS=5); give a
# longer drain a longer `--stop-timeout`.
# The install steps are scripts/install-serve.sh, which tests/test_server_install.py also runs;
# tests/test_container.py builds the CPU image and runs it.
ARG PYTHON_IMAGE=python:3.11-slim

# What both flavours share: the user, the environment, the health check, the command.
FROM ${PYTHON_IMAGE} AS runtime
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin bertserve
# ORT_DISABLE_TELEMETRY: ONNX Runtime (1.29 and later) otherwise sends usage events to Microsoft from every
# start on Linux, and warns at each start that it cannot keep a device id under a home it cannot write.
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 ORT_DISABLE_TELEMETRY=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    BERTSERVE_MODEL_DIR=/model BERTSERVE_HOST=0.0.0.0 BERTSERVE_PORT=8000
USER 10001
EXPOSE 8000
# /ready: the model is loaded and a real forward pass succeeded.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('BERTSERVE_PORT', '8000'), timeout=4)"
# The same command the tests start.
CMD ["python", "-m", "app"]

# The serving install goes into /opt/venv in stages of their own; the images copy only /opt/venv, so the
# sources never reach them. The packages it needs come first, from pyproject.toml alone, so that a change to
# the code reinstalls only the project (and rebuilds the GPU operator library only when its sources change).
FROM scratch AS sources
COPY pyproject.toml README.m[d] /src/
COPY artifact/ /src/artifact/
COPY custom_kernels/ /src/custom_kernels/
COPY app/ /src/app/
COPY scripts/install-serve.sh /src/scripts/

FROM ${PYTHON_IMAGE} AS packages-cpu
COPY pyproject.toml /src/
COPY scripts/install-serve.sh /src/scripts/
RUN python -m venv /opt/venv && PYTHON=/opt/venv/bin/python /src/scripts/install-serve.sh cpu --deps-only

FROM packages-cpu AS venv-cpu
COPY --from=sources /src/ /src/
RUN PYTHON=/opt/venv/bin/python /src/scripts/install-serve.sh cpu

FROM runtime AS cpu
COPY --from=venv-cpu /opt/venv/ /opt/venv/

# GPU only from here on (see the top: `--target cpu` never reaches these stages).
FROM ${PYTHON_IMAGE} AS packages-gpu
COPY pyproject.toml /src/
COPY scripts/install-serve.sh /src/scripts/
RUN python -m venv /opt/venv && PYTHON=/opt/venv/bin/python /src/scripts/install-serve.sh gpu --deps-only

FROM packages-gpu AS venv-gpu
COPY --from=sources /src/ /src/
RUN PYTHON=/opt/venv/bin/python /src/scripts/install-serve.sh gpu

# The operator library, built against the CUDA runtime and cuBLAS that the serving install brings, with
# nvcc of the same CUDA version and CCCL of the same major (its wheels number their own releases) added
# here only: the image copies /opt/venv from venv-gpu.
FROM packages-gpu AS kernels
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN cuda="$(/opt/venv/bin/python -c 'import importlib.metadata as m; print(m.version("nvidia-cuda-runtime"))')" \
 && /opt/venv/bin/python -m pip install --no-cache-dir --disable-pip-version-check --progress-bar off \
      "nvidia-cuda-nvcc==${cuda%.*}.*" "nvidia-cuda-cccl~=${cuda%%.*}.0"
COPY custom_kernels/ /src/custom_kernels/
RUN PATH=/opt/venv/bin:$PATH bash /src/custom_kernels/build.sh /out

FROM runtime AS gpu
COPY --from=venv-gpu /opt/venv/ /opt/venv/
COPY --from=kernels /out/ /opt/bertserve/
ENV BERTSERVE_KERNELS_LIBRARY=/opt/bertserve/libbertserve_ops.so
