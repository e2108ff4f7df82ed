#!/usr/bin/env bash
# The GPU check, one script for one GPU machine (about 5 minutes; at most 8):
#   1. the GPU suite (pytest -m gpu): bf16 and fp32 + bf16 mixed-precision rollout, train and
#      evaluate of the tiny Flux / SD3 / QwenImage on CUDA, FSDP2 over NCCL on every visible GPU
#      against one process, velocity reuse on GPU kernels, peak memory per endpoint backward;
#   2. `bench` on cuda (wide-flux and toy-flux, W = 4): speed-ups and peak memory per mode;
#   3. benchmarks/mixed_precision.py on cuda: the on-policy ratio before and after.
# Writes OUT/report.md (the figures) beside the logs; exits non-zero if any part failed.
#   benchmarks/gpu_check.sh [OUT]      (default results/gpu-check; needs `make .venv/.installed`)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/gpu-check}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
report="$out/report.md"
status=0

{
    echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$py" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
} >"$report" 2>&1

step() { # name, seconds, command...: run it, log it, note a failure in the report
    local name=$1 limit=$2
    shift 2
    echo "== $name" | tee -a "$report"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local code=${PIPESTATUS[0]}
    if [ "$code" -ne 0 ]; then
        echo "FAILED ($name: exit $code, see $name.log)" | tee -a "$report"
        status=1
    fi
}

step gpu-suite 300 "$py" -m pytest -m gpu -q -s -p no:cacheprovider --durations=5
grep -E "max \|ratio|reuse deviation|MiB|passed|failed" "$out/gpu-suite.log" >>"$report"
step bench 180 "$py" -m jagg_pipeline bench --device cuda --backbones wide-flux,toy-flux \
    --windows 4 --fracs 1 --repeats 5 --ranks 1 --out "$out/bench"
sed -n '/^device:/,$p' "$out/bench.log" >>"$report"
step mixed-precision 60 "$py" benchmarks/mixed_precision.py --device cuda
cat "$out/mixed-precision.log" >>"$report"
echo "report: $report"
exit $status
