#!/usr/bin/env bash
# The GPU's first call, at most 9 minutes, in the order that a cut-off costs least:
#   0. every kernel and config of both recipes' d12 step compiled for sm_90 without a launch (--compile-for):
#      a compile error, or a config too big for the shared memory, named before anything runs;
#   1. correctness: backend triton's --test of both recipes, compiled, fp32 then bf16, each row written as
#      it is checked (the two recipes at once: compiling kernels is CPU work, and the card has 16 cores);
#   2. the d12 step of both recipes in the three trainers (bf16, T = 1024, 4 steps of 524,288 tokens of
#      --data synthetic from one seed): tokens/s, MFU and peak memory, and the trainers' train losses at
#      each step compared within each recipe (bench/h100_table.py);
#   3. while time is left: the matmul kernels against cuBLAS with each configuration's autotuner timing
#      beside the product timed alone (bench/matmul.py --configs), then --bench-ops of both recipes.
# Full logs go to LOGDIR as they are written, the tables last. The stages share BUDGET seconds (540 by
# default): a stage that would start later is skipped in one line, one running is cut at the budget's end.
#
#     bash bench/h100.sh LOGDIR
#     SKIP="gpt2_jax_b64 matmul" bash bench/h100.sh LOGDIR   # leaves out the named stages
#     DRY=1 bash bench/h100.sh LOGDIR   # on a CPU: tiny models, kernels in Triton's interpreter, fp32
set -uo pipefail
LOG=${1:?usage: bash bench/h100.sh LOGDIR}
mkdir -p "$LOG/runs"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING=1  # a shape's autotuning result is reused by the later processes
PY=${PYTHON:-python3}
T0=$SECONDS
BUDGET=${BUDGET:-540}
if [ -n "${DRY:-}" ]; then  # the same stages at a size a CPU runs in a few minutes
    export TRITON_INTERPRET=1
    SHAPE="--n-layer 2 --n-head 1 --n-embd 128 --seq-len 64 --total-batch-size 512 --dtype fp32" BIG=4 SMALL=2
else
    SHAPE="--model d12 --seq-len 1024 --total-batch-size 524288 --dtype bf16" BIG=64 SMALL=16
fi
D="--data synthetic --seed 1337 --steps 4 --val-every 0 --hellaswag-every 0 --sample-every 0 --ckpt-every 0"

stage() {  # stage NAME SECONDS: 0 with the seconds it may take (LIMIT) if it runs, 1 if skipped
    case " ${SKIP:-} " in *" $1 "*) echo "skipped $1: SKIP"; return 1;; esac
    local left=$((BUDGET - (SECONDS - T0)))
    if [ "$left" -lt 20 ]; then echo "skipped $1: the call's $BUDGET s are spent"; return 1; fi
    LIMIT=$((left < $2 ? left : $2))
    echo "== $1 ($((SECONDS - T0)) s, at most $LIMIT s)"
}

echo "== versions"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || echo "no GPU"
  $PY -c "import torch, triton, jax; print('torch', torch.__version__, 'triton', triton.__version__,
                                        'jax', jax.__version__)"
} 2>&1 | tee "$LOG/versions.txt"

# 0. the kernels compiled for sm_90 (not interpreted, even in DRY), the two recipes at once
if stage compile 150; then
    for recipe in gpt2 speedrun; do
        TRITON_INTERPRET=0 timeout "$LIMIT" $PY train_gpt2_triton.py triton --recipe "$recipe" --model d12 \
            --dtype bf16 --compile-for sm_90 > "$LOG/compile_$recipe.txt" 2>&1 &
    done
    wait
    for recipe in gpt2 speedrun; do
        echo "-- --compile-for sm_90 --recipe $recipe"
        grep -E "FAILED|compiled" "$LOG/compile_$recipe.txt" || tail -3 "$LOG/compile_$recipe.txt"
    done
fi

# 1. correctness
if stage test 200; then
    for recipe in gpt2 speedrun; do
        timeout "$LIMIT" $PY train_gpt2_triton.py triton --recipe "$recipe" --test > "$LOG/test_$recipe.txt" 2>&1 &
    done
    wait
    for recipe in gpt2 speedrun; do
        echo "-- --test --recipe $recipe"
        grep -E "FAIL|checks|error" "$LOG/test_$recipe.txt" || { echo "cut short:"; tail -3 "$LOG/test_$recipe.txt"; }
    done
fi

# 2. the d12 steps
run() {  # run NAME TRAINER ARGS...: one d12 run, its log.jsonl under LOGDIR/runs/NAME
    local name=$1; shift
    stage "$name" 90 || return
    timeout "$LIMIT" $PY "$@" $SHAPE $D --out-dir "$LOG/runs/$name" > "$LOG/$name.txt" 2>&1 || echo "$name failed: $?"
    tail -2 "$LOG/$name.txt"
}
run gpt2_triton_b$SMALL train_gpt2_triton.py triton --batch-size $SMALL
run speedrun_triton_b$SMALL train_gpt2_triton.py triton --recipe speedrun --batch-size $SMALL
run gpt2_jax_b$BIG train_gpt2_jax.py --batch-size $BIG
run speedrun_jax_b$((BIG / 2)) train_gpt2_jax.py --recipe speedrun --batch-size $((BIG / 2))
run gpt2_torchfunc_b$SMALL train_gpt2_torchfunc.py --batch-size $SMALL
run speedrun_torchfunc_b$SMALL train_gpt2_torchfunc.py --recipe speedrun --batch-size $SMALL
echo "== the d12 steps ($((SECONDS - T0)) s)"
$PY bench/h100_table.py "$LOG/runs" | tee "$LOG/table.txt"

# 3. while time is left
if stage matmul 150; then
    timeout "$LIMIT" $PY bench/matmul.py --batch-size 16 --configs > "$LOG/matmul.txt" 2>&1 || echo "matmul failed: $?"
    sed -n '/^TFLOP/,$p' "$LOG/matmul.txt"
fi
for recipe in gpt2 speedrun; do
    if stage "bench_ops_$recipe" 60; then
        timeout "$LIMIT" $PY train_gpt2_triton.py triton --recipe "$recipe" $SHAPE --batch-size $SMALL --bench-ops \
            > "$LOG/bench_ops_$recipe.txt" 2>&1 || echo "bench-ops $recipe failed: $?"
        tail -25 "$LOG/bench_ops_$recipe.txt"
    fi
done
echo "== done ($((SECONDS - T0)) s)"
