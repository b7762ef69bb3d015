#!/usr/bin/env bash
# Everything to check when a GPU is lent, in one run of about 9 minutes: the CUDA tests (each attention backend
# against transformers, CUDA graphs against eager), then W2 with random-weight Qwen3-0.6B in bfloat16: in-process
# (the Engine without and with overlap), the split at default flags (overlap on, up to 8 decode steps per plan) and
# without overlap; in-process with overlap and the split at one decode step per plan; transformers' own continuous
# batching beside in-process on W2's first 64 requests; last, W5 with every peer (the public API's included) on
# this machine's many cores, which the 2-core development VM cannot show. Its figures are in docs/benchmarks.md;
# the open question on a lent machine is now its host CPU's (bench/host_cpu_check.sh), so run that first.
# Usage: bench/gpu_check.sh [OUT_DIR]  (default ./gpu-check; a log and five JSON files land there).
# Needs a CUDA build of torch (and flash-attn for that backend) in the Python it runs: $PYTHON or python3. The
# random-weight model (1.2 GB) is written once to $MODEL_DIR (default /tmp/nanoserve-qwen3-0.6b-random), outside
# OUT_DIR, so that a folder the device tool sends back holds only the figures. On the lent machine, which has no
# network, the services' packages come as wheels: bench/gpu_wheels.sh, and docs/benchmarks-history.md (W2) for the call.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
py=${PYTHON:-python3}
source bench/lease_steps.sh
step 30 nvidia-smi
step 60 "$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
step 150 "$py" -m pytest -q -rs tests/test_cuda.py
model=${MODEL_DIR:-/tmp/nanoserve-qwen3-0.6b-random}
[ -f "$model/config.json" ] || step 120 "$py" -m bench.random_model "$model"
step 200 "$py" -m bench.throughput --workload w2 --device cuda --dtype bfloat16 --model "$model" \
  --peers inprocess inprocess_overlap split_overlap split --json "$out/w2.json"
step 120 "$py" -m bench.throughput --workload w2 --device cuda --dtype bfloat16 --model "$model" \
  --peers inprocess_overlap split_overlap --num-scheduler-steps 1 --json "$out/w2-n1.json"
# On the whole of W2, transformers' continuous batching had returned 64,639 of the 140,084 tokens after 196 s on the
# H200 (in-process: all of them in 12.6 s), so it runs beside in-process on W2's first 64 requests (116 s in all
# there, 91.7 s of them its generation).
step 200 "$py" -m bench.throughput --workload w2 --device cuda --dtype bfloat16 --model "$model" \
  --peers inprocess hf_cb --num-requests 64 --json "$out/w2-hf64.json"
for ms in 5 2; do
  step 150 "$py" -m bench.overlap --step-ms "$ms" --repeats 1 --json "$out/w5-${ms}ms.json"
done
echo "== $(date +%T) done"
exit $status
