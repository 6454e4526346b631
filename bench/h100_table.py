"""The step table of bench/h100.sh, bench/h100_recompute.sh and bench/h100_compare.sh: for each run
under RUNS_DIR (one folder a run, holding its log.jsonl), tokens/s and MFU over the steps after the first
(which compiles and autotunes), the peak memory and the last val loss; for the runs of one recipe on the
same tokens from the same init (their start events' config), the largest relative gap between their train
losses and the largest gap between their val losses at the steps all of them have; in each framework that
ran both recipes on the same tokens, the step and the seconds at which speedrun reaches gpt2's final val
loss; then backend triton against torchfunc.

    python bench/h100_table.py RUNS_DIR
"""
import json
import os
import sys


def summary(log_path):
    events = list(map(json.loads, open(log_path)))
    start = next((e for e in events if e.get("event") == "start"), {})
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
                train={e["step"]: e["train_loss"] for e in steps}, start=start.get("config"),
                framework=start.get("framework"), wall=step_time(steps))


def step_time(steps):
    """{step: seconds of step time up to the end of that step}, as plot_runs.py puts validations on its
    wall-time axis (evaluations left out; a step a resumed run logs again counts once, its later line)."""
    dt = {e["step"]: e["dt_ms"] / 1000 for e in steps}
    total, wall = 0.0, {}
    for step in sorted(dt):
        total += dt[step]
        wall[step] = total
    return wall


# what makes two runs' train losses comparable step by step: one recipe and model, the same tokens, the
# same init (every trainer draws it and reads its data through the same shared plumbing: one loader, one init)
SAME_RUN = ("recipe", "n_layer", "n_head", "n_embd", "seq_len", "total_batch_size", "data", "seed", "init_from",
            "dtype", "steps")


def recipe_leads(rows):
    """For each framework with a gpt2 and a speedrun run on the same tokens (the start events' SAME_RUN
    but the recipe and steps): (framework, gpt2's last validation (step, loss, seconds of step time), the
    speedrun run's first validation at or below that loss (step, seconds) or None, its last val step)."""
    leads = []
    for fw in sorted({s["framework"] for s in rows.values() if s["start"] is not None}):
        by_recipe = {s["start"]["recipe"]: s for s in rows.values() if s["framework"] == fw and s["val"]}
        gpt2, speedrun = by_recipe.get("gpt2"), by_recipe.get("speedrun")
        if not (gpt2 and speedrun) or any(gpt2["start"].get(k) != speedrun["start"].get(k)
                                          for k in SAME_RUN if k not in ("recipe", "steps")):
            continue
        last = max(gpt2["val"])
        target = gpt2["val"][last]
        passed = next((k for k in sorted(speedrun["val"]) if speedrun["val"][k] <= target), None)
        leads.append((fw, (last, target, gpt2["wall"][last]),
                      None if passed is None else (passed, speedrun["wall"][passed]), max(speedrun["val"])))
    return leads


def largest_gap(rows, names, key, relative):
    """(step, gap, steps compared): the largest spread of rows[name][key] between the runs `names` at the
    steps all of them have, relative to the lowest where `relative`; None where they share no step."""
    common = sorted(set.intersection(*(set(rows[n][key]) for n in names)))
    if not common:
        return None
    def gap(step):
        values = [rows[n][key][step] for n in names]
        return (max(values) - min(values)) / (abs(min(values)) if relative else 1.0)
    worst = max(common, key=gap)
    return worst, gap(worst), len(common)


def comparable_groups(rows):
    """The groups of two or more runs whose start events agree on SAME_RUN, by name."""
    groups = {}
    for name, s in rows.items():
        if s["start"] is not None:
            groups.setdefault(tuple(s["start"].get(k) for k in SAME_RUN), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


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
    for names in comparable_groups(rows):
        train, val = largest_gap(rows, names, "train", True), largest_gap(rows, names, "val", False)
        said = [f"largest relative train-loss gap {train[1]:.2e} (step {train[0]} of the {train[2]} all ran)"]
        if val:
            said.append(f"largest val-loss gap {val[1]:.2e} (step {val[0]} of the {val[2]} all validated)")
        print(f"{', '.join(names)}: " + "; ".join(said))
    for fw, (last, target, seconds), passed, speedrun_last in recipe_leads(rows):
        gpt2 = f"gpt2's final val loss {target:.4f} (step {last}, {seconds:.1f} s of step time)"
        if passed is None:
            print(f"{fw}: speedrun has not reached {gpt2} by its last validation, step {speedrun_last}")
        else:
            print(f"{fw}: speedrun reaches {gpt2} at step {passed[0]}, {passed[1]:.1f} s: gpt2 took "
                  f"{last / passed[0]:.1f}x the steps and {seconds / passed[1]:.1f}x the time")
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
