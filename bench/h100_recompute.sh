#!/usr/bin/env bash
# --recompute on one GPU, in one call of at most 9 minutes (its memory and speed goals):
#   1. backend triton's d12 step at B = 16 at each level, beside torch.compile's (torchfunc, level none):
#      tokens/s and peak memory, a table last (goal: <= 4.1 GB and >= 1.05x torch.compile's tokens/s);
#   2. d48 (1.5B) at T = 1024, B = 16 for 6 steps in JAX (--scan-layers) and backend triton, each at the cheapest
#      level that fits: none, else pointwise, else block (a level that runs out of memory says so in one
#      line and exits non-zero; the next is tried).
# Full logs go to LOGDIR; each run's log.jsonl under LOGDIR/runs/NAME, its start event holding the
# accounting's activation bytes beside the measured peak.
#
#     bash bench/h100_recompute.sh LOGDIR
#     DRY=1 bash bench/h100_recompute.sh LOGDIR   # on a CPU: tiny models, backend torch, every stage run
# The runs share BUDGET seconds (510 by default): a run is cut at the budget's end, later ones skipped.
set -uo pipefail
LOG=${1:?usage: bash bench/h100_recompute.sh LOGDIR}
mkdir -p "$LOG/runs"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING=1  # a shape's autotuning result is reused by the later processes
PY=${PYTHON:-python3}
T0=$SECONDS
BUDGET=${BUDGET:-510}  # seconds for the runs: a run that would start later is skipped, one running is cut
stage() { echo "== $1 ($((SECONDS - T0)) s)"; }

if [ -n "${DRY:-}" ]; then  # the same stages at a size a CPU runs in seconds
    BACKEND=torch T=64 D12="--n-layer 2 --n-head 4 --n-embd 64" D48="--n-layer 3 --n-head 4 --n-embd 64"
    B12=4 B48=2 DTYPE=fp32 SECS=120
else
    BACKEND=triton T=1024 D12="--model d12" D48="--model d48" B12=16 B48=16 DTYPE=bf16 SECS=150
fi
COMMON="--seq-len $T --data synthetic --dtype $DTYPE --steps 6 --val-every 0 --hellaswag-every 0 --sample-every 0 --ckpt-every 0"

stage "versions"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no GPU"
  $PY -c "import torch, triton, jax; print('torch', torch.__version__, 'triton', triton.__version__,
                                        'jax', jax.__version__)"
} 2>&1 | tee "$LOG/versions.txt"

run() {  # run NAME TRAINER ARGS...: one run, its log.jsonl under LOGDIR/runs/NAME; the exit status kept
    local name=$1; shift
    local left=$((BUDGET - (SECONDS - T0)))
    if [ "$left" -lt 30 ]; then echo "skipped $name: the call's $BUDGET s are spent"; return 2; fi
    stage "run: $name"
    timeout "$((left < SECS ? left : SECS))" $PY "$@" $COMMON --out-dir "$LOG/runs/$name" > "$LOG/$name.txt" 2>&1
    local rc=$?
    tail -2 "$LOG/$name.txt"
    return $rc
}

for level in none pointwise block; do
    run "triton_d12_b${B12}_$level" train_gpt2_triton.py $BACKEND $D12 --batch-size $B12 \
        --total-batch-size $((B12 * T)) --recompute $level || echo "failed: $?"
done
COMPILE=$([ -n "${DRY:-}" ] && echo 0 || echo 1)
run "torchfunc_d12_b${B12}_none" train_gpt2_torchfunc.py --compile $COMPILE $D12 --batch-size $B12 \
    --total-batch-size $((B12 * T)) || echo "failed: $?"

cheapest() {  # cheapest NAME TRAINER ARGS...: the first level that fits, none -> pointwise -> block
    local name=$1; shift
    for level in none pointwise block; do
        if run "${name}_$level" "$@" --recompute $level; then return 0; fi
        grep -q "out of device memory" "$LOG/${name}_$level.txt" || return 1  # another failure: no use going on
    done
}
cheapest jax_d48 train_gpt2_jax.py --scan-layers $D48 --batch-size $B48 --total-batch-size $((B48 * T)) \
    || echo "jax d48: no level ran"
cheapest triton_d48 train_gpt2_triton.py $BACKEND $D48 --batch-size $B48 --total-batch-size $((B48 * T)) \
    || echo "triton d48: no level ran"

stage "done"
grep -o "activations .*" "$LOG"/*_*.txt | sed "s|^$LOG/||"
$PY bench/h100_table.py "$LOG/runs"
