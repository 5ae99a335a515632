#!/usr/bin/env bash
# One command of a short stay on a GPU machine: torch, triton, numpy, matplotlib, pytest,
# pytest-xdist, tqdm, psutil and tensorboard installed, no Jupyter stack, and this tree copied
# there without .git and without installing labkit. README, "Recording on a GPU", lists the
# commands of a session, part by part.
#
#   LABKIT_GIT_COMMIT=<hash> bash scripts/gpu_session.sh [--tests] [--notebooks]
#                                                        [--part P,Q,...] [--run ID]
#
#   --cases      every step of the rehearsal's case sets judged by a real CUDA-graph capture
#                (python -m tests.rehearsal_cases.real), its lines in $OUT/real_capture.jsonl
#   --tests      the whole test suite, CUDA tests included (pytest -n 8)
#   --notebooks  pytest --nbval on the notebooks as stored: compared outputs are the same on a GPU
#   --part ...   python -m labkit record --device cuda --part ... (the parts: record --plan)
#   --run ID     the run the parts belong to: the same ID in every command of one session
#
# Wheels in .whl/ (Jupyter's kernel stack, nbval, ipywidgets, Gymnasium) are installed into
# /tmp/site once. Each step runs under `timeout -s INT` (LABKIT_STEP_S seconds, default 540):
# a step cut short keeps what it finished. Logs, results/ and the notebooks are packed into
# $OUT/gpu-results.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${LABKIT_GIT_COMMIT:?set LABKIT_GIT_COMMIT to the commit this tree is (git rev-parse HEAD)}"
export LABKIT_GIT_COMMIT
cases=0 tests=0 notebooks=0 parts="" run=""
while [ $# -gt 0 ]; do
    case "$1" in
        --cases) cases=1 ;;
        --tests) tests=1 ;;
        --notebooks) notebooks=1 ;;
        --part) parts=${2:?--part needs a value}; shift ;;
        --run) run=${2:?--run needs a value}; shift ;;
        *) echo "error: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

STEP_S=${LABKIT_STEP_S:-540}
OUT=${OUT:-/tmp/labkit-gpu-out}
mkdir -p "$OUT"
site=/tmp/site
if [ ! -d "$site" ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site" .whl/*.whl
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="$PWD/.inductor-cache"  # later commands reuse compiled kernels
export MPLBACKEND=Agg

status=0
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"; } \
    > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
source "$(dirname "$0")/gpu_step.sh"
step() { gpu_step "$OUT" "$STEP_S" 25 "$@"; }  # step NAME COMMAND...
if [ "$cases" = 1 ]; then
    step real-capture python3 -m tests.rehearsal_cases.real --out "$OUT/real_capture.jsonl"
fi
if [ "$tests" = 1 ]; then
    step tests python3 -m pytest -q -n 8 -p no:cacheprovider tests
fi
if [ "$notebooks" = 1 ]; then
    step nbval python3 -m pytest -q -n 4 -p no:cacheprovider --nbval --nbval-current-env \
        --nbval-sanitize-with tests/nbval_sanitize.cfg notebooks
fi
if [ -n "$parts" ]; then
    step "record-$(date +%H%M%S)" python3 -m labkit record --device cuda --part "$parts" \
        ${run:+--run "$run"}
fi
tar czf "$OUT/gpu-results.tar.gz" results notebooks/*.ipynb
exit "$status"
