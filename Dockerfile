# Images of gspo-lightning, one file for both (build and run: docs/docker.md):
#
#   GPU (the defaults): CUDA 13 Ubuntu base, torch 2.13.0 (PyPI's CUDA 13.0 build), the
#   project with its vllm, deepspeed and math extras.
#       docker build -t gspo-lightning:gpu .
#   CPU: any Debian/Ubuntu base with python3, torch's CPU build, the project alone.
#       podman build --build-arg BASE_IMAGE=debian:bookworm --build-arg TORCH=torch==2.13.0+cpu \
#         --build-arg EXTRAS= --build-arg BUILD_PACKAGES= --build-arg RUNTIME_PACKAGES= \
#         --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu -t gspo-lightning:cpu .
#
# Two stages: `build` installs into the virtualenv /opt/venv with pip and whatever the network
# needs (the PIP_* build arguments, a CA bundle); the image is a fresh base with /opt/venv
# copied in, so neither those arguments nor compilers and headers it does not need end up in it.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04

FROM ${BASE_IMAGE} AS build
# compilers and headers for packages without a wheel (GPU extras); none for the CPU image
ARG BUILD_PACKAGES="python3-dev build-essential git"
# torch first and pinned: vllm 0.32.0 pins torch==2.13.0, whose PyPI Linux wheel is the CUDA 13.0
# build. The CPU image asks for torch==2.13.0+cpu, which only a CPU index or wheel folder has, so a
# build that would fall back to the multi-GB CUDA wheel fails instead.
ARG TORCH="torch==2.13.0"
ARG EXTRAS="vllm,deepspeed,math"
# Corporate networks (pip reads these from the environment; build arguments reach RUN steps of
# this stage only): a package index or mirror, extra indexes, a wheel folder mounted into the
# build, trusted hosts. A CA bundle for pip: `--secret id=pip_ca,src=/path/to/ca.pem`.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG DEBIAN_FRONTEND=noninteractive
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates ${BUILD_PACKAGES} \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# An unset build argument reaches the RUN step as an empty variable, which pip would read as
# an empty value: drop those. The CA bundle is a build secret: mounted for this step only.
RUN --mount=type=secret,id=pip_ca \
    for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST; do \
        [ -n "$(printenv $v)" ] || unset $v; done; \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi; \
    pip install --upgrade pip && pip install "${TORCH}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gspo_lightning ./gspo_lightning
RUN --mount=type=secret,id=pip_ca \
    for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST; do \
        [ -n "$(printenv $v)" ] || unset $v; done; \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi; \
    pip install ".${EXTRAS:+[$EXTRAS]}" \
    && gspo --help > /dev/null

FROM ${BASE_IMAGE}
# the GPU image keeps a compiler and Python's headers: DeepSpeed and FlashInfer compile CUDA
# kernels the first time they are used, Triton compiles small C launchers
ARG RUNTIME_PACKAGES="python3-dev build-essential"
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 ca-certificates ${RUNTIME_PACKAGES} \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
# The shipped configs, so `gspo fit --config configs/quickstart.yaml` runs as in the README.
# /workspace is writable by any user (sticky, as /tmp): run with --user $(id -u):$(id -g) and
# mount an output folder at /workspace/runs; caches (Hugging Face, Triton, matplotlib) go to
# /workspace/.cache through HOME.
COPY configs /workspace/configs
RUN chmod 1777 /workspace
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1 \
    HOME=/workspace \
    HF_HOME=/workspace/.cache/huggingface
WORKDIR /workspace

ENTRYPOINT ["gspo"]
CMD ["--help"]
