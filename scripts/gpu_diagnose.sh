#!/usr/bin/env bash
# The next GPU stay's one command for issue 55 (the ladder climbs, the final stage fills the
# GPU): measure where each stage's time goes before changing it. About 12 minutes on an H200;
# each line under its own `timeout -s INT`, so a cut line keeps what it measured. Nothing else
# runs beside a timed line. Dry-run it on the CPU first:
#
#   LABKIT_GIT_COMMIT=$(git rev-parse HEAD) DEVICE=cpu SMALL=1 OUT=/tmp/dry bash scripts/gpu_diagnose.sh
#
# On the GPU (tree copied without .git):
#
#   LABKIT_GIT_COMMIT=<hash> bash scripts/gpu_diagnose.sh      # $OUT is the device tool's
#
# All its lines take longer than one device command may (10 minutes): LINES names the ones a
# command runs, e.g. LINES="scaling env profile-7 profile-8 ladder" then the rest in a second
# command (the same $OUT: the archive holds both):
#
#   LINES="fused whole update obs-float32 obs-uint8 bounded" LABKIT_GIT_COMMIT=<hash> bash ...
#
# What each line settles, most important first (reviews/gpu-gap.md §6 and issue 55 §1):
#   scaling   stages 7 and 8 over N: the data-chosen ladder N (smallest N at which stage 8
#             reaches 90% of its best rate) and where stage 8 tops out today
#   env       ForageTorch alone, eager and compiled, at large N (--torch-only): the env target
#   profile   stage 7 and 8 kernel tables (torch.profiler): where the update's 1.5 ms goes
#   ladder    stages 3-8 at N=1024, 10 interleaved rounds: today's climb, sync counts included
#   fused     stages 5, 6 and 8 at the same N with the whole rollout step compiled
#             (--compile-unit step), 5 rounds: against the ladder line's rows, whether the
#             fused step pays on a GPU (the CPU's A/B is in the README)
#   whole     stage 8 at the same N with its whole update captured as one graph
#             (--capture-unit update: permutations and minibatch gathers inside it), 5 rounds
#   update    bench-update at the 32,768-sample minibatch, with its floor
#   obs       stage 8 at N=16,384 (the update most of an iteration), observations stored
#             float32 then uint8 (--obs-storage, bit-identical results): what a quarter of
#             the observation bytes saves the update
#   bounded   stages 0 and 2 at the ladder's N over whole iterations of at most 8,192 env
#             steps (--loop-steps-bound; T=8 at N=1024), stage 8 beside them in the same run:
#             the final / stage 0 ratio; last, as a cut stay loses least here
# The results and logs are packed into $OUT/gpu-diagnose.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${LABKIT_GIT_COMMIT:?set LABKIT_GIT_COMMIT to the commit this tree is (git rev-parse HEAD)}"
export LABKIT_GIT_COMMIT PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export TORCHINDUCTOR_CACHE_DIR="$PWD/.inductor-cache"  # later lines reuse the compiles
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/labkit-gpu-out}
R="$OUT/diagnose"
mkdir -p "$R"
if [ "${SMALL:-0}" = 1 ]; then  # the dry run: every line at a size a CPU does in seconds
    SWEEP="64 128" ENV_N="256 1024" N=64 T=8 ITERS=2 MB=256 S=120 BIG=128 BOUND=128
else
    SWEEP="1024 4096 16384 65536" ENV_N="65536 262144" N=1024 T=128 ITERS=10 MB=32768 S=150 \
        BIG=16384 BOUND=8192
fi
{ nvidia-smi -L 2>/dev/null; python3 -c "import torch; print('torch', torch.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"; } > "$R/device.txt" 2>&1
cat "$R/device.txt"
status=0
source "$(dirname "$0")/gpu_step.sh"
# each line's results packed as soon as it ends: a stay cut short still returns what finished
step() {
    local name=$1 limit=$2; shift 2
    case " ${LINES:-$name} " in *" $name "*) ;; *) return 0 ;; esac  # not one of LINES
    gpu_step "$R" "$limit" 12 "$name" "$@"
    tar czf "$OUT/gpu-diagnose.tar.gz" -C "$OUT" diagnose
}
L="python3 -m labkit ladder --device $DEVICE --no-progress --n-steps $T"
step scaling $((S + 60)) $L --stages 7,8 --iterations 3 --n-envs "${SWEEP%% *}" \
    --scaling-n-envs $SWEEP --out "$R/scaling"
step env "$S" python3 -m labkit bench-env --device "$DEVICE" --torch-only --compiled \
    --compile-loop 1 --repeats 5 --n-envs $ENV_N --out "$R/env"
step profile-7 90 python3 -m labkit profile --device "$DEVICE" --stage fused_amp \
    --n-envs "$N" --n-steps "$T" --out "$R/profile7"
step profile-8 90 python3 -m labkit profile --device "$DEVICE" --stage cuda_graphs \
    --n-envs "$N" --n-steps "$T" --out "$R/profile8"
step ladder "$S" $L --stages 3,4,5,6,7,8 --no-scaling --iterations "$ITERS" --n-envs "$N" \
    --out "$R/ladder"
step fused "$S" $L --stages 5,6,8 --no-scaling --iterations 5 --n-envs "$N" \
    --compile-unit step --out "$R/ladder-fused"
step whole 120 $L --stages 8 --no-scaling --iterations 5 --n-envs "$N" \
    --capture-unit update --out "$R/ladder-whole"
step update "$S" python3 -m labkit bench-update --device "$DEVICE" --sizes "$MB" --rounds 5 \
    --out "$R/update"
for storage in float32 uint8; do
    step "obs-$storage" 90 $L --stages 8 --no-scaling --iterations 5 --n-envs "$BIG" \
        --obs-storage "$storage" --out "$R/ladder-obs-$storage"
done
step bounded "$S" $L --stages 0,2,8 --no-scaling --iterations 3 --n-envs "$N" \
    --loop-steps-bound "$BOUND" --out "$R/ladder-bounded"
tar czf "$OUT/gpu-diagnose.tar.gz" -C "$OUT" diagnose
exit "$status"
