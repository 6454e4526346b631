#!/usr/bin/env bash
# The d12 step of the speedrun recipe in each trainer (the Triton trainer's on backend triton) beside the
# gpt2 recipe's, on one GPU, in one call of at most 10 minutes: bf16, T = 1024, 524,288 tokens a step,
# synthetic tokens; tokens/s, MFU and peak memory in the table printed last (bench/h100_table.py), full
# logs in LOGDIR; then backend triton's --bench-ops of the speedrun ops (each kernel against the PyTorch
# op it replaces) into LOGDIR/bench_ops_speedrun.txt.
#
#     bash bench/h100_speedrun.sh LOGDIR
#     SKIP="gpt2_jax_b64" bash bench/h100_speedrun.sh LOGDIR   # leaves out the named runs
# EXTRA adds flags to every run (later flags win): e.g. a dry run on the CPU with
#     EXTRA="--n-layer 2 --n-embd 128 --n-head 1 --dtype fp32 --batch-size 2 \
#            --total-batch-size 2048 --steps 2"
set -uo pipefail
LOG=${1:?usage: bash bench/h100_speedrun.sh LOGDIR}
mkdir -p "$LOG/runs"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
T0=$SECONDS
D="--data synthetic --model d12 --seq-len 1024 --dtype bf16 --total-batch-size 524288 --steps 6
   --val-every 0 --hellaswag-every 0 --sample-every 0 --ckpt-every 0"
run() {  # run NAME TRAINER ARGS...: one d12 run, its log.jsonl under LOGDIR/runs/NAME
    local name=$1; shift
    case " ${SKIP:-} " in *" $name "*) echo "skipped: $name"; return;; esac
    echo "== $name ($((SECONDS - T0)) s)"
    timeout 90 $PY "$@" $D ${EXTRA:-} --out-dir "$LOG/runs/$name" > "$LOG/$name.txt" 2>&1 \
        || echo "$name failed: $?"
    tail -2 "$LOG/$name.txt"
}
run speedrun_jax_b32 train_gpt2_jax.py --recipe speedrun --batch-size 32
run gpt2_jax_b32 train_gpt2_jax.py --batch-size 32
run speedrun_torchfunc_b16 train_gpt2_torchfunc.py --recipe speedrun --batch-size 16
run gpt2_torchfunc_b16 train_gpt2_torchfunc.py --batch-size 16
run speedrun_triton_b16 train_gpt2_triton.py triton --recipe speedrun --batch-size 16
run gpt2_triton_b16 train_gpt2_triton.py triton --batch-size 16
$PY bench/h100_table.py "$LOG/runs"
timeout 90 $PY train_gpt2_triton.py triton --recipe speedrun --model d12 --seq-len 1024 --batch-size 16 \
    --bench-ops ${EXTRA:-} > "$LOG/bench_ops_speedrun.txt" 2>&1 || echo "bench-ops failed: $?"
cat "$LOG/bench_ops_speedrun.txt"
