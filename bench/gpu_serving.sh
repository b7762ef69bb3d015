#!/usr/bin/env bash
# The online-serving check for a lent GPU, in one run of about 6 minutes: the CUDA tests (the mixed policy's greedy
# parity with transformers and CUDA graphs against eager among them); then, on random-weight Qwen3-0.6B in bfloat16,
# W2 through the split at default flags under each scheduling policy (nano-vllm, the default, then mixed), and W3
# on the GPU: W2's first 128 requests with Poisson arrivals at 8, 16 and 32 req/s, streamed over gRPC from the pair
# as docker-compose.yml runs it, once at each policy (bench.serving --device cuda). bench/gpu_check.sh holds the
# GPU's other checks; both need the wheels of bench/gpu_wheels.sh (docs/benchmarks-history.md, W2, gives the call).
# Usage: bench/gpu_serving.sh [OUT_DIR]  (default ./gpu-serving; a log and three JSON files land there).
# MODEL_DIR (default /tmp/nanoserve-qwen3-0.6b-random) holds the model, written once, outside OUT_DIR so that the
# folder the device tool sends back holds only the figures. DEVICE=cpu with a small MODEL_DIR rehearses the steps
# on the CPU (its W3 then runs make run's stack, so this checkout must be installed in the Python it runs).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-serving}
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
model=${MODEL_DIR:-/tmp/nanoserve-qwen3-0.6b-random}
source bench/lease_steps.sh
if [ "$device" = cuda ]; then
  step 20 nvidia-smi
  step 120 "$py" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py
fi
step 60 "$py" -c "import torch; print('torch', torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
[ -f "$model/config.json" ] || step 120 "$py" -m bench.random_model "$model"
for policy in nano-vllm mixed; do
  step 120 "$py" -m bench.throughput --workload w2 --device "$device" --dtype bfloat16 --model "$model" \
    --peers split_overlap --scheduling-policy "$policy" --json "$out/w2-$policy.json"
done
step 300 "$py" -m bench.serving --device "$device" --dtype bfloat16 --model "$model" --workload w2 --num-prompts 128 \
  --peers nanoserve nanoserve_mixed --request-rate 8 16 32 --json "$out/w3.json"
if [ $status -ne 0 ]; then
  # The services' own logs of a failed step, which the device tool would not send back.
  for log in /tmp/nanoserve-w1-*/*.log /tmp/nanoserve-w3-*/*.log; do
    [ -f "$log" ] && { echo "== tail of $log"; tail -n 25 "$log"; }
  done
fi
echo "== $(date +%T) done"
exit $status
