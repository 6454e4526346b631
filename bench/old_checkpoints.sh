#!/usr/bin/env bash
# Checkpoints written by an older commit resume here with the older run's numbers: each trainer and recipe
# trains 3 steps at OLD (a checkpoint every step, a tiny model on tinyshakespeare's shards), then this
# checkout resumes each step-1 checkpoint into a new out dir; steps 2 and 3 (train loss, grad norm, val
# loss) must equal the old run's, digit for digit.
#     bash bench/old_checkpoints.sh OLD_COMMIT WORKDIR      # e.g. 02d12e5 /tmp/old_ckpts (PYTHON: the venv's)
set -euo pipefail
old=$1; work=$2
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python}
mkdir -p "$work"
git -C "$here" worktree add --detach "$work/tree" "$old" >/dev/null
trap 'git -C "$here" worktree remove --force "$work/tree"' EXIT
export TRITON_INTERPRET=1 OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
"$py" "$here/prepro_fineweb.py" --input "$here/tests/data/tinyshakespeare/input.txt" --out-dir "$work/shards" \
    --name s --shard-size 32768 --workers 1 > /dev/null
for trainer in "jax:train_gpt2_jax.py" "torchfunc:train_gpt2_torchfunc.py --compile 0" \
               "triton-torch:train_gpt2_triton.py torch"; do
  name=${trainer%%:*}; cmd=${trainer#*:}
  for recipe in "gpt2:--n-layer 2 --n-head 2 --n-embd 64" "speedrun:--recipe speedrun --n-layer 2 --n-embd 128"; do
    run="$name-${recipe%%:*}"
    flags="${recipe#*:} --data $work/shards --seq-len 32 --batch-size 2 --total-batch-size 64 --steps 3 --dtype fp32
           --val-every 1 --val-tokens 128 --hellaswag-every 0 --sample-every 0"
    (cd "$work/tree" && "$py" $cmd $flags --ckpt-every 1 --out-dir "$work/old/$run" > /dev/null)
    (cd "$here" && "$py" $cmd $flags --ckpt-every 0 --resume "$work/old/$run/ckpt_0000001" \
        --out-dir "$work/new/$run" > /dev/null)
    "$py" - "$work/old/$run/log.jsonl" "$work/new/$run/log.jsonl" "$run" <<'PY'
import json, sys
def steps(path):
    events = [json.loads(line) for line in open(path) if line.strip()]
    return [(e["step"], e.get("train_loss"), e.get("grad_norm"), e.get("val_loss"))
            for e in events if e.get("event") != "start" and e["step"] >= 2]
old, new = steps(sys.argv[1]), steps(sys.argv[2])
print(f"{sys.argv[3]:22} {'same' if old == new else 'DIFFERENT'}: {new}")
sys.exit(old != new)
PY
  done
done
