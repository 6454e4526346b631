#!/usr/bin/env bash
# --fp8-head on the GPU, in one call of at most 9 minutes: the speedrun recipe's d12 step in the three
# trainers (backend triton, torchfunc compiled, JAX), each without and then with --fp8-head, bf16, T = 1024,
# 50 steps of 131,072 tokens from one seed (--data synthetic, or DATA_DIR's tokens: bench/english_text.py's,
# whose losses say more than random tokens'); per trainer, bench/h100_table.py's table: tokens/s, MFU and
# peak memory of each run, and the largest relative gap between the two runs' train losses over the 50
# steps. First, backend triton's --test of the speedrun recipe (its FP8 ops compiled: tl.dot on float8).
# The runs share BUDGET seconds (540 by default); a run that would start later is skipped in one line.
#
#     bash bench/h100_fp8.sh LOGDIR [DATA_DIR]
#     DRY=1 bash bench/h100_fp8.sh LOGDIR   # on a CPU: a tiny model, fp32, the Triton trainer's backend
#                                           # torch (the interpreter takes minutes a step at V = 50,304)
set -uo pipefail
LOG=${1:?usage: bash bench/h100_fp8.sh LOGDIR [DATA_DIR]}
DATA=${2:-synthetic}
mkdir -p "$LOG"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING=1
PY=${PYTHON:-python3}
T0=$SECONDS
BUDGET=${BUDGET:-540}
declare -A SCRIPT=([triton]="train_gpt2_triton.py triton" [torchfunc]="train_gpt2_torchfunc.py"
                   [jax]="train_gpt2_jax.py")
if [ -n "${DRY:-}" ]; then  # the same runs at a size a CPU runs in a few minutes
    SHAPE="--n-layer 2 --n-embd 128 --seq-len 64 --total-batch-size 256 --dtype fp32" STEPS=3 PER_RUN=120
    declare -A B=([triton]=2 [torchfunc]=2 [jax]=2)
    SCRIPT[triton]="train_gpt2_triton.py torch"
else
    SHAPE="--model d12 --seq-len 1024 --total-batch-size 131072 --dtype bf16" STEPS=50 PER_RUN=80
    declare -A B=([triton]=16 [torchfunc]=16 [jax]=32)
fi
C="--recipe speedrun --data $DATA --seed 1337 --steps $STEPS --val-every 0 --hellaswag-every 0 --sample-every 0
   --ckpt-every 0"

echo "== versions"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no GPU"
  $PY -c "import torch, triton, jax; print('torch', torch.__version__, 'triton', triton.__version__,
                                        'jax', jax.__version__)"
} 2>&1 | tee "$LOG/versions.txt"

if [ -z "${DRY:-}" ]; then  # the interpreter's --test of the FP8 ops is the suite's (tests/test_fp8_head.py)
    echo "== backend triton --test --recipe speedrun"
    timeout 150 $PY train_gpt2_triton.py triton --recipe speedrun --test > "$LOG/test_speedrun.txt" 2>&1
    grep -E "FAIL|fp8|checks|error" "$LOG/test_speedrun.txt" || tail -3 "$LOG/test_speedrun.txt"
fi

for trainer in triton torchfunc jax; do
    for fp8 in "" --fp8-head; do
        name=speedrun_$trainer${fp8:+_fp8}
        left=$((BUDGET - (SECONDS - T0)))
        if [ "$left" -lt 30 ]; then echo "skipped $name: the call's $BUDGET s are spent"; continue; fi
        limit=$((left < PER_RUN ? left : PER_RUN))
        echo "== $name ($((SECONDS - T0)) s, at most $limit s)"
        timeout "$limit" $PY ${SCRIPT[$trainer]} $C $SHAPE --batch-size ${B[$trainer]} $fp8 \
            --out-dir "$LOG/runs_$trainer/$name" > "$LOG/$name.txt" 2>&1 || echo "$name failed: $?"
        tail -1 "$LOG/$name.txt"
    done
    [ -d "$LOG/runs_$trainer" ] && $PY bench/h100_table.py "$LOG/runs_$trainer" | tee "$LOG/table_$trainer.txt"
done
echo "== done ($((SECONDS - T0)) s)"
