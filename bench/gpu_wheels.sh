#!/usr/bin/env bash
# The wheels bench/gpu_check.sh needs on the lent GPU machine, which has no network: its image holds torch,
# transformers, tokenizers, numpy and the like, but not the services' gRPC, structured-output, HTTP and ZMQ packages
# (smg-grpc-proto's stubs among them), nor gguf (which bench.throughput's llama.cpp peer imports) or the openai SDK
# (bench.serving's load). Downloads them (no dependencies: the image has the rest) for that machine's CPython 3.12
# into DIR (default .whl, ignored by git), each at the version installed in this checkout's .venv, so that the
# generated protos meet the protobuf runtime they were made for. docs/benchmarks-history.md (W2) gives the device
# call that installs them there and runs bench/gpu_check.sh or bench/gpu_serving.sh.
# Usage: bench/gpu_wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=.venv/bin/python
[ -x "$py" ] || { echo "no .venv here: run 'make venv' first" >&2; exit 1; }
packages=(grpcio grpcio-health-checking grpcio-reflection protobuf llguidance fastapi starlette uvicorn pydantic
  pydantic-core typing-inspection annotated-types annotated-doc opentelemetry-api typing-extensions gguf httpx httpcore
  h11 pyzmq smg-grpc-proto openai httpx2 httpcore2 jiter sniffio truststore)
pins=()
for name in "${packages[@]}"; do
  version=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") || {
    echo "$name is not installed in .venv" >&2; exit 1; }
  pins+=("$name==$version")
done
# pip matches a manylinux tag exactly; the machine's glibc (Ubuntu 24.04's 2.39) runs any of these.
platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for glibc in 17 24 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${glibc}_x86_64"); done
mkdir -p "$dir"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$dir" "${pins[@]}"
du -sh "$dir"
