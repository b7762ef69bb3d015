# Sourced by the scripts a lent machine runs (gpu_check.sh, gpu_serving.sh, host_cpu_check.sh): their log and their
# steps. Set before sourcing: out, the folder that receives log.txt and the figures; step_wrap (optional), a command
# every step runs under (the host check's taskset).
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
export PYTHONUNBUFFERED=1
status=0
# step SECONDS COMMAND...: each step has its own time limit, so that one that hangs leaves the lease's minutes to
# the steps after it (the device call's own limit would end them all); a failed step is logged and sets status.
step() {
  local limit=$1
  shift
  echo "== $(date +%T) $*"
  timeout --kill-after=10 "$limit" "${step_wrap[@]}" "$@" || { echo "== FAILED ($?): $*"; status=1; }
}
