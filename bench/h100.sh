#!/usr/bin/env bash
# Every H100 figure of docs/RESULTS.md in one call of at most 9 minutes: the matmul kernels against
# cuBLAS, the d12 step of each GPT-2 trainer side by side, --bench-ops, and the kernel self-test on the
# GPU. Full logs go to LOGDIR; a short table is printed last.
#
#     bash bench/h100.sh LOGDIR
#     SKIP="jax_b64 test" bash bench/h100.sh LOGDIR   # leaves out the named runs (and the self-test)
set -uo pipefail
LOG=${1:?usage: bash bench/h100.sh LOGDIR}
mkdir -p "$LOG/runs"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING=1  # a shape's autotuning result is reused by the later processes
PY=${PYTHON:-python3}
T0=$SECONDS
stage() { echo "== $1 ($((SECONDS - T0)) s)"; }

stage "versions"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import torch, triton, jax; print('torch', torch.__version__, 'triton', triton.__version__,
                                        'jax', jax.__version__)"
} 2>&1 | tee "$LOG/versions.txt"

stage "matmul kernels against cuBLAS"
timeout 180 $PY bench/matmul.py --batch-size 16 --configs > "$LOG/matmul.txt" 2>&1 || echo "matmul bench failed: $?"

D="--data synthetic --model d12 --seq-len 1024 --dtype bf16 --total-batch-size 524288 --steps 6
   --val-every 0 --hellaswag-every 0 --sample-every 0 --ckpt-every 0"
run() {  # run NAME TRAINER ARGS...: one d12 run, its log.jsonl under LOGDIR/runs/NAME
    local name=$1; shift
    case " ${SKIP:-} " in *" $name "*) echo "skipped: $name"; return;; esac
    stage "step: $name"
    timeout 170 $PY "$@" $D --out-dir "$LOG/runs/$name" > "$LOG/$name.txt" 2>&1 || echo "$name failed: $?"
    tail -2 "$LOG/$name.txt"
}
run triton_b16 train_gpt2_triton.py triton --batch-size 16
run triton_b32 train_gpt2_triton.py triton --batch-size 32
run torchfunc_b16 train_gpt2_torchfunc.py --batch-size 16
run jax_b64 train_gpt2_jax.py --batch-size 64

stage "ops against PyTorch"
timeout 100 $PY train_gpt2_triton.py triton --model d12 --seq-len 1024 --batch-size 16 --dtype bf16 --bench-ops \
    > "$LOG/bench_ops.txt" 2>&1 || echo "bench-ops failed: $?"

stage "kernel self-test (bf16 and fp32)"
case " ${SKIP:-} " in
    *" test "*) echo "skipped: test";;
    *) timeout 100 $PY train_gpt2_triton.py triton --test > "$LOG/test.txt" 2>&1 || echo "self-test failed: $?"
       tail -3 "$LOG/test.txt";;
esac

stage "done"
tail -30 "$LOG/bench_ops.txt"
sed -n '/^TFLOP/,$p' "$LOG/matmul.txt"
$PY bench/h100_table.py "$LOG/runs"
