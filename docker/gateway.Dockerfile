# The Shepherd Model Gateway (smg: a Rust binary in its PyPI wheel) for deploy/kubernetes/overlays/smg.
# Build from the repository root: docker build -f docker/gateway.Dockerfile -t nanoserve-gateway:latest .
ARG PYTHON_IMAGE=python:3.12-slim
FROM ${PYTHON_IMAGE}
ARG SMG_VERSION=1.13.0

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install "smg==${SMG_VERSION}"

# The OpenAI-compatible API, and the gateway's Prometheus metrics.
EXPOSE 30000 29000
ENTRYPOINT ["smg"]
