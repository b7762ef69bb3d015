# The scheduler: CPU only and torch-free, so a slim python image with the base dependencies.
# Build from the repository root: docker build -f docker/scheduler.Dockerfile .
ARG PYTHON_IMAGE=python:3.12-slim
FROM ${PYTHON_IMAGE}

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    NANOSERVE_HOST=0.0.0.0

WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos protos
COPY common common
COPY scheduler_svc scheduler_svc
COPY client client
RUN pip install .

# gRPC, and the OpenAI-compatible HTTP API.
EXPOSE 50051 8000
CMD ["nanoserve-scheduler"]
