# GPU image of gspo-lightning: torch 2.13.0 (the CUDA 13.0 build from PyPI), vLLM 0.32.0,
# DeepSpeed and math-verify. Build and run: docs/docker.md. This file was written on a
# machine without a Docker engine and has not been built there.
#
# The devel image brings nvcc and a compiler: DeepSpeed and FlashInfer compile some CUDA
# kernels the first time they are used, and Triton compiles small C launchers. A runtime
# image (BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04) is smaller if you use neither.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Ubuntu 24.04's python is 3.12 and refuses system-wide pip installs: use a virtualenv.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && pip install --upgrade pip

# torch first and pinned: vllm 0.32.0 pins torch==2.13.0, whose PyPI Linux wheel is the
# CUDA 13.0 build (it brings its CUDA libraries as pip packages; the host needs a driver >= 580).
RUN pip install torch==2.13.0

WORKDIR /opt/gspo-lightning
COPY . .
RUN pip install ".[vllm,deepspeed,math]" \
    && gspo --help > /dev/null

# HF_HOME under /workspace: mount it to keep downloaded models between runs.
ENV HF_HOME=/workspace/.cache/huggingface
WORKDIR /workspace
VOLUME ["/workspace/runs"]

ENTRYPOINT ["gspo"]
CMD ["--help"]
