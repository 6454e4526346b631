"""The step table of bench/h100.sh and bench/h100_recompute.sh: for each run under RUNS_DIR (one folder a run, holding its
log.jsonl), tokens/s and MFU over the steps after the first (which compiles and autotunes), and the peak
memory; each run's last val loss, and the largest gap between the runs' val losses at the steps all of
them validated; for the runs of one recipe on the same tokens from the same init (their start events'
config), the largest relative gap between their train losses at each step; then backend triton against
torchfunc.

    python bench/h100_table.py RUNS_DIR
"""
import json
import os
import sys


def summary(log_path):
    events = list(map(json.loads, open(log_path)))
    start = next((e["config"] for e in events if e.get("event") == "start"), None)
    steps = [e for e in events if "train_loss" in e]
    timed = [e for e in steps if e["step"] > 1] or steps  # a run of one step: that step, compile and all
    if not timed:
        return None
    # over the summed step time, as the trainers' own "mean over N steps" line: tokens / seconds
    seconds = sum(e["dt_ms"] for e in timed) / 1000
    tokens = sum(e["tokens_per_s"] * e["dt_ms"] / 1000 for e in timed)
    flops_share = sum((e["mfu"] or 0.0) * e["dt_ms"] / 1000 for e in timed)  # mfu is null on the CPU
    return dict(steps=len(steps), tokens_per_s=tokens / seconds, mfu=flops_share / seconds,
                peak_mem_gb=max(e["peak_mem_gb"] or 0.0 for e in steps), loss=steps[-1]["train_loss"],
                val={e["step"]: e["val_loss"] for e in events if "val_loss" in e},
                train={e["step"]: e["train_loss"] for e in steps}, start=start)


# what makes two runs' train losses comparable step by step: one recipe and model, the same tokens, the
# same init (the data loader and init_params_numpy are the same code in every trainer)
SAME_RUN = ("recipe", "n_layer", "n_head", "n_embd", "seq_len", "total_batch_size", "data", "seed", "init_from",
            "dtype", "steps")


def train_loss_gaps(rows):
    """For each group of two or more runs that SAME_RUN makes comparable: (names, step, largest relative
    train-loss gap at that step, over the steps all of them ran)."""
    groups = {}
    for name, s in rows.items():
        if s["start"] is not None:
            groups.setdefault(tuple(s["start"].get(k) for k in SAME_RUN), []).append(name)
    gaps = []
    for names in groups.values():
        common = set.intersection(*(set(rows[n]["train"]) for n in names))
        if len(names) < 2 or not common:
            continue
        def gap(step):
            losses = [rows[n]["train"][step] for n in names]
            return (max(losses) - min(losses)) / abs(min(losses))
        worst = max(sorted(common), key=gap)
        gaps.append((names, worst, gap(worst), len(common)))
    return gaps


def main():
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: python bench/h100_table.py RUNS_DIR (a folder of run folders, each with its log.jsonl)")
    runs_dir = sys.argv[1]
    rows = {}
    for name in sorted(os.listdir(runs_dir)):
        path = os.path.join(runs_dir, name, "log.jsonl")
        if os.path.exists(path) and (s := summary(path)):
            rows[name] = s
    print(f"{'run':25s} {'steps':>5s} {'tokens/s':>10s} {'MFU':>7s} {'peak GB':>8s} {'last loss':>9s}")
    for name, s in rows.items():
        print(f"{name:25s} {s['steps']:5d} {s['tokens_per_s']:10,.0f} {100 * s['mfu']:6.1f}% "
              f"{s['peak_mem_gb']:8.2f} {s['loss']:9.4f}")
    for name, s in rows.items():
        if s["val"]:
            last = max(s["val"])
            print(f"{name}: val loss {s['val'][last]:.4f} at step {last} ({len(s['val'])} validations)")
    common = set.intersection(*(set(s["val"]) for s in rows.values())) if rows else set()
    if len(rows) > 1 and common:
        gap = max(max(s["val"][k] for s in rows.values()) - min(s["val"][k] for s in rows.values())
                  for k in common)
        print(f"largest val-loss gap between the runs at the {len(common)} steps all validated: {gap:.2e}")
    for names, step, gap, n in train_loss_gaps(rows):
        print(f"{', '.join(names)}: largest relative train-loss gap over the {n} steps all ran: {gap:.2e} "
              f"(step {step})")
    tri = [s for n, s in rows.items() if n.startswith("triton")]
    tf = [s for n, s in rows.items() if n.startswith("torchfunc")]
    if tri and tf:
        best_tri = max(tri, key=lambda s: s["tokens_per_s"])
        best_tf = max(tf, key=lambda s: s["tokens_per_s"])
        print(f"backend triton / torchfunc (best of each): "
              f"{best_tri['tokens_per_s'] / best_tf['tokens_per_s']:.2f}x tokens/s at "
              f"{best_tri['peak_mem_gb'] / max(best_tf['peak_mem_gb'], 1e-9):.2f}x peak memory")


if __name__ == "__main__":
    main()
