#!/usr/bin/env bash
# The equal-time figures of both recipes in one call of at most 9 minutes, on real English text
# (bench/english_text.py):
#   1. the gpt2 recipe in JAX, torchfunc compiled and backend triton, each for the same SECS of step time
#      (--time-budget: the first step's time counts each trainer's compilation or autotuning), from the
#      same --seed on the same tokens, in bf16, on one lr schedule of 600 steps;
#   2. the speedrun recipe in the trainer that was fastest in 1 (its tokens/s), for the same time; then in
#      the other two while the call's BUDGET lasts;
#   3. plot_runs.py's two figures, LOGDIR/gpu_compare.png (the gpt2 runs) and LOGDIR/gpu_recipes.png (the
#      fastest trainer's gpt2 run against every speedrun run), and bench/h100_table.py's table: the
#      largest val-loss gap at equal steps, and the step and time at which speedrun reaches gpt2's final
#      val loss.
#
#     python bench/english_text.py data/english            # here, once: the tokens (carried with the call)
#     bash bench/h100_compare.sh data/english LOGDIR        # on the GPU; then copy the PNGs into docs/
#     DRY=1 bash bench/h100_compare.sh DATA_DIR LOGDIR      # on a CPU: a tiny model, kernels interpreted
set -uo pipefail
DATA=${1:?usage: bash bench/h100_compare.sh DATA_DIR LOGDIR}
LOG=${2:?usage: bash bench/h100_compare.sh DATA_DIR LOGDIR}
mkdir -p "$LOG/runs"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING=1
PY=${PYTHON:-python3}
T0=$SECONDS
BUDGET=${BUDGET:-540}
if [ -n "${DRY:-}" ]; then
    export TRITON_INTERPRET=1
    SECS=${SECS:-8}
    SHAPE="--n-layer 2 --n-head 1 --n-embd 128 --seq-len 64 --dtype fp32 --total-batch-size 512 --val-tokens 4096
           --val-every 2"
    declare -A B=([jax]=4 [torchfunc]=2 [triton]=2) BS=([jax]=2 [torchfunc]=2 [triton]=2)
else
    # 131,072 tokens a step (~0.25-0.3 s on the H100): 110 s, of which the compile takes 30-55, leave
    # ~200-300 steps; 524,288 of the 1M val tokens every 25 steps: 8 or more validations a run
    SECS=${SECS:-110}
    SHAPE="--model d12 --seq-len 1024 --dtype bf16 --total-batch-size 131072 --val-tokens 524288 --val-every 25"
    declare -A B=([jax]=64 [torchfunc]=16 [triton]=32) BS=([jax]=32 [torchfunc]=16 [triton]=16)
fi
C="--data $DATA --seed 1337 --steps 600 --time-budget $SECS --hellaswag-every 0 --sample-every 0 --ckpt-every 0"
declare -A SCRIPT=([jax]="train_gpt2_jax.py" [torchfunc]="train_gpt2_torchfunc.py"
                   [triton]="train_gpt2_triton.py triton")

run() {  # run RECIPE TRAINER: one run for SECS of step time, its log.jsonl under LOGDIR/runs/RECIPE_TRAINER
    local name=${1}_$2 left=$((BUDGET - (SECONDS - T0)))
    if [ "$left" -lt $((SECS + 30)) ]; then echo "skipped $name: the call's $BUDGET s are spent"; return 1; fi
    echo "== $name ($((SECONDS - T0)) s)"
    local flags="--batch-size ${B[$2]} --warmup 100"  # the gpt2 recipe's warmup, scaled to 600 steps
    [ "$1" = speedrun ] && flags="--recipe speedrun --batch-size ${BS[$2]}"  # its own schedule: no warmup
    timeout "$left" $PY ${SCRIPT[$2]} $flags $SHAPE $C --out-dir "$LOG/runs/$name" > "$LOG/$name.txt" 2>&1 \
        || echo "$name failed: $?"
    tail -2 "$LOG/$name.txt"
}

for trainer in jax torchfunc triton; do run gpt2 $trainer; done
FASTEST=$($PY - "$LOG/runs" <<'EOF'
import os, sys
sys.path.insert(0, "bench")
from h100_table import summary
speeds = {}
for t in ("jax", "torchfunc", "triton"):
    path = os.path.join(sys.argv[1], f"gpt2_{t}", "log.jsonl")
    if os.path.exists(path) and (s := summary(path)):
        speeds[t] = s["tokens_per_s"]
print(max(speeds, key=speeds.get) if speeds else "jax")
EOF
)
echo "== fastest gpt2 run: $FASTEST"
run speedrun "$FASTEST"
for trainer in jax torchfunc triton; do
    [ "$trainer" = "$FASTEST" ] || run speedrun $trainer
done

echo "== figures ($((SECONDS - T0)) s)"
$PY plot_runs.py "$LOG"/runs/gpt2_* -o "$LOG/gpu_compare.png"
$PY plot_runs.py "$LOG/runs/gpt2_$FASTEST" "$LOG"/runs/speedrun_* -o "$LOG/gpu_recipes.png"
$PY bench/h100_table.py "$LOG/runs" | tee "$LOG/table.txt"
echo "== done ($((SECONDS - T0)) s)"
