# The embedding server image. GPU by default (onnxruntime-gpu; CUDA and cuDNN come as pip packages that
# match its build, so only the host's NVIDIA driver is needed: `docker run --gpus all ...`).
#   docker build -t bertserve .                          # GPU image
#   docker build -t bertserve:cpu --build-arg FLAVOUR=cpu .   # CPU-only image (onnxruntime)
#   docker run -p 8000:8000 -v ./artifacts:/model bertserve
# Settings come from BERTSERVE_* variables (`docker run -e BERTSERVE_MAX_BATCH_TOKENS=32768 ...`).
# On a GPU host add `-e BERTSERVE_WORKERS=8` (about half the cores): HTTP worker processes around one
# engine process; one Python process alone cannot keep the GPU busy (README, BENCHMARKS.md).
# The install steps are scripts/install-serve.sh, which tests/test_server_install.py also runs.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}
ARG FLAVOUR=gpu

ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.m[d] ./
COPY artifact/ artifact/
COPY app/ app/
COPY scripts/install-serve.sh scripts/
RUN python -m venv /opt/venv \
    && PYTHON=/opt/venv/bin/python scripts/install-serve.sh "${FLAVOUR}" \
    && rm -rf /src

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
