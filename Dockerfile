# The embedding server image. GPU by default (onnxruntime-gpu; CUDA and cuDNN come as pip packages that
# match its build, so only the host's NVIDIA driver is needed: `docker run --gpus all ...`).
#   docker build -t bertserve .                          # GPU image
#   docker build -t bertserve:cpu --build-arg FLAVOUR=cpu .   # CPU-only image (onnxruntime)
#   docker run -p 8000:8000 -v ./artifacts:/model bertserve
# Settings come from BERTSERVE_* variables (`docker run -e BERTSERVE_MAX_BATCH_TOKENS=32768 ...`).
# On a GPU host add `-e BERTSERVE_WORKERS=8` (about half the cores): HTTP worker processes around one
# engine process; one Python process alone cannot keep the GPU busy (README, BENCHMARKS.md).
# The install steps are scripts/install-serve.sh, which tests/test_server_install.py also runs.
# The GPU image also carries our CUDA operator library (custom_kernels/), built in a CUDA devel image
# because it needs cuBLAS's headers; the server runs an artifact's custom-kernels graph with it.
ARG PYTHON_IMAGE=python:3.11-slim
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04
ARG FLAVOUR=gpu

FROM ${CUDA_DEVEL_IMAGE} AS kernels-gpu
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
COPY custom_kernels/ /src/custom_kernels/
RUN CUDA_INC=/usr/local/cuda/include CUDA_LIB=/usr/local/cuda/lib64 bash /src/custom_kernels/build.sh /out

FROM ${PYTHON_IMAGE} AS kernels-cpu
RUN mkdir /out

# Only the stage this flavour names is built.
FROM kernels-${FLAVOUR} AS kernels

FROM ${PYTHON_IMAGE}
ARG FLAVOUR

ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.m[d] ./
COPY artifact/ artifact/
COPY custom_kernels/ custom_kernels/
COPY app/ app/
COPY scripts/install-serve.sh scripts/
RUN python -m venv /opt/venv \
    && PYTHON=/opt/venv/bin/python scripts/install-serve.sh "${FLAVOUR}" \
    && rm -rf /src

# Empty in the CPU image, where the server never looks for it (our operators run on CUDA only).
COPY --from=kernels /out/ /opt/bertserve/
ENV BERTSERVE_KERNELS_LIBRARY=/opt/bertserve/libbertserve_ops.so

RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin bertserve
USER 10001
WORKDIR /

ENV BERTSERVE_MODEL_DIR=/model BERTSERVE_HOST=0.0.0.0 BERTSERVE_PORT=8000
EXPOSE 8000
# /ready: the model is loaded and a real forward pass succeeded.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('BERTSERVE_PORT', '8000'), timeout=4)"
# The same command the tests start.
CMD ["python", "-m", "app"]
