#!/usr/bin/env bash
# The one installer of this package's environments, from the committed locks: the Makefile
# (.venv), CI (through `make test`), the conda envs (envs/*.post-deploy.sh) and the container
# recipes (containers/*) all call it.
#
#   envs/install.sh pipeline|pipeline-cpu|summary [--editable|--deps-only]
#
#   pipeline      requirements.lock: the stages, torch's CUDA build from PyPI, the dev tools
#   pipeline-cpu  requirements-cpu.lock: the same pins with torch's CPU build (PyTorch's index)
#   summary       requirements-summary.lock: the comparison rules, no torch
#
# The pipeline families also get hpsv2 (requirements-hpsv2.lock), a test reference that pins
# protobuf<4: it goes in without its dependencies. The package itself goes in last, without
# dependencies (every one is in the lock), editable with --editable; --deps-only leaves it out
# (the images: the workflow puts the checkout it runs from on PYTHONPATH). Installs into $PYTHON's
# environment (default: the python3 on PATH, e.g. an activated venv or conda env).
# Every pinned line carries hashes, so pip refuses any file that differs from the lock's.
set -euo pipefail

usage() {
    echo "usage: $0 pipeline|pipeline-cpu|summary [--editable|--deps-only]" >&2
    exit 2
}

root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
family="${1:-}"
editable=()
package=1
index=()
case "${2:-}" in
    "") ;;
    --editable) editable=(--editable) ;;
    --deps-only) package=0 ;;
    *) usage ;;
esac
case "$family" in
    pipeline) locks=(requirements.lock requirements-hpsv2.lock) ;;
    # The CPU builds (torch==2.14.1+cpu) are on PyTorch's index alone; the hashes still decide.
    pipeline-cpu)
        locks=(requirements-cpu.lock requirements-hpsv2.lock)
        index=(--extra-index-url https://download.pytorch.org/whl/cpu)
        ;;
    summary) locks=(requirements-summary.lock) ;;
    *) usage ;;
esac

for lock in "${locks[@]}"; do
    if [[ ! -f "$root/$lock" ]]; then
        echo "$0: $root/$lock is missing: run \`make lock\` (it writes every requirements*.lock)" >&2
        exit 1
    fi
    # --no-deps: the lock is the whole environment; pip resolves nothing on its own.
    "$python" -m pip install --require-hashes --no-deps "${index[@]}" \
        --requirement "$root/$lock"
done
if [[ $package == 1 ]]; then
    "$python" -m pip install --no-deps "${editable[@]}" "$root"
fi
