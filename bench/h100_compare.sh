#!/usr/bin/env bash
# Issue 27's figure in one call of about 8 minutes: GPT-2 d12 in each trainer (JAX, torchfunc compiled,
# backend triton) for the same 120 s of step time (--time-budget: the first step's compilation or
# autotuning counts, JAX compiles before its first step), from the same --seed on the same real English
# tokens, in bf16, on the same lr schedule; then plot_runs.py's figure and a table of each run's last val
# loss and the gap between the curves at equal steps.
#
#     python bench/english_text.py data/english            # here, once: the tokens (carried with the call)
#     bash bench/h100_compare.sh data/english LOGDIR        # on the GPU
#     python plot_runs.py LOGDIR/runs/* -o docs/h100_compare.png
#
# EXTRA adds flags to every run (later flags win): e.g. a dry run on the CPU with
#     EXTRA="--n-layer 2 --n-embd 64 --n-head 2 --dtype fp32 --time-budget 10 --val-tokens 16384 --batch-size 4"
set -uo pipefail
DATA=${1:?usage: bash bench/h100_compare.sh DATA_DIR LOGDIR}
LOG=${2:?usage: bash bench/h100_compare.sh DATA_DIR LOGDIR}
mkdir -p "$LOG/runs"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
T0=$SECONDS
# 131,072 tokens a step (~0.25-0.3 s on the H100): ~400-480 steps in 120 s, on a schedule of 600 steps
# (100 of warmup); a validation of 524,288 tokens of the 1M-token val shard every 40 steps
C="--data $DATA --model d12 --seq-len 1024 --dtype bf16 --seed 1337 --total-batch-size 131072 --steps 600
   --warmup 100 --time-budget 120 --val-every 40 --val-tokens 524288 --hellaswag-every 0 --sample-every 0
   --ckpt-every 0"
run() {  # run NAME TRAINER ARGS...
    local name=$1; shift
    echo "== $name ($((SECONDS - T0)) s)"
    timeout 240 $PY "$@" $C ${EXTRA:-} --out-dir "$LOG/runs/$name" > "$LOG/$name.txt" 2>&1 \
        || echo "$name failed: $?"
    tail -2 "$LOG/$name.txt"
}
run jax train_gpt2_jax.py --batch-size 64
run torchfunc train_gpt2_torchfunc.py --batch-size 16
run triton train_gpt2_triton.py triton --batch-size 32
echo "== plot ($((SECONDS - T0)) s)"
$PY plot_runs.py "$LOG"/runs/jax "$LOG"/runs/torchfunc "$LOG"/runs/triton -o "$LOG/h100_compare.png"
$PY bench/h100_table.py "$LOG/runs"
