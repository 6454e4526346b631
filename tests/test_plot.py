"""plot_runs.py: overlaying runs from their log.jsonl
(logs of real tiny JAX and torchfunc runs; synthetic logs for peak memory, HellaSwag and resumed runs; bad
input); and bench/h100_table.py's step-by-step comparison of the trainers' train losses."""
import json
import os
import shutil
import struct

import numpy as np
import pytest

import plot_runs as pr
from conftest import EVAL_KEYS, STEP_KEYS, assert_clean_error, read_log, run_script, run_script_on_a_full_disk

FLAGS = ["--seq-len", 64, "--batch-size", 4, "--total-batch-size", 256, "--steps", 4, "--lr", 3e-3,
         "--warmup", 2, "--dtype", "fp32", "--val-steps", 1, "--ckpt-every", 0, "--sample-every", 0]
LINE_PANELS = ["train loss", "val loss", "val loss vs wall time", "tokens/s"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_shards, tiny_model_file):
    """Two 4-step runs from the same model file: JAX with validation every 2 steps, torchfunc without.
    Both on the CPU (the trainers log null peak memory there) and without HellaSwag, whose evaluation
    would add seconds: its panel is tested on synthetic logs, its key against conftest's."""
    out = tmp_path_factory.mktemp("plot_runs")
    jax_dir, torch_dir = out / "jax", out / "torchfunc"
    run_script("train_gpt2_jax.py", "--data", tiny_shards, "--init-from", tiny_model_file, *FLAGS,
               "--out-dir", jax_dir, "--val-every", 2, "--hellaswag-every", 0, env={"JAX_PLATFORMS": "cpu"})
    run_script("train_gpt2_torchfunc.py", "--data", tiny_shards, "--init-from", tiny_model_file, *FLAGS,
               "--out-dir", torch_dir, "--val-every", 0, "--hellaswag-every", 0,
               env={"CUDA_VISIBLE_DEVICES": ""})
    return jax_dir, torch_dir


def titles(fig):
    return [ax.get_title() for ax in fig.axes]


def png_size(path):
    """(width, height) from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def step_event(step, loss, dt_ms, framework="jax", mem=None):
    return dict(step=step, train_loss=loss, grad_norm=1.0, lr=1e-3, dt_ms=dt_ms,
                tokens_per_s=1e6 / dt_ms, mfu=None, peak_mem_gb=mem, framework=framework)


def write_log(folder, events):
    folder.mkdir()
    (folder / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return folder


def test_real_runs(runs, tmp_path):
    """The command line overlays the two runs into a PNG of the figure's size (1000x720 for 2x2 panels)
    and 10-200 KB; panels follow the data: with JAX's val events, train loss, val loss against step and
    wall time, tokens/s (no peak memory on the CPU); torchfunc alone (no validation), train and tokens/s.
    The keys read are those the trainers log (real logs here, conftest's list for HellaSwag)."""
    jax_dir, torch_dir = runs
    png = tmp_path / "compare.png"
    proc = run_script("plot_runs.py", jax_dir, torch_dir, "-o", png)
    assert f"wrote {png} (4 panels, 2 run(s))" in proc.stdout
    assert png_size(png) == (2 * pr.PANEL_W * pr.DPI, (2 * pr.PANEL_H + 0.4) * pr.DPI)
    assert 10_000 < png.stat().st_size < 200_000

    both = [pr.load_run(str(jax_dir)), pr.load_run(str(torch_dir))]
    assert [run.label for run in both] == [f"jax ({jax_dir})", f"torchfunc ({torch_dir})"]
    assert titles(pr.build_figure(both)) == LINE_PANELS
    assert titles(pr.build_figure(both[1:])) == ["train loss", "tokens/s"]
    assert titles(pr.build_figure(both[:1], smooth=2)) == ["train loss (2-step mean)", *LINE_PANELS[1:]]
    jax_run = both[0]
    assert list(jax_run.steps) == [1, 2, 3, 4] and list(jax_run.val_steps) == [2, 4]
    assert len(jax_run.swag_steps) == 0 and jax_run.peak_mem_gb is None
    start = read_log(jax_dir, starts=True)[0]
    assert start["event"] == "start" and pr.event_kind(start) is None  # a launch's start: not plotted
    log = read_log(jax_dir)
    for kind in ("step", "val"):
        assert set(pr.EVENT_KEYS[kind]) <= next(set(e) for e in log if pr.event_kind(e) == kind)
    assert set(pr.EVENT_KEYS["step"]) | {"peak_mem_gb"} <= STEP_KEYS
    assert set(pr.EVENT_KEYS["val"] + pr.EVENT_KEYS["hellaswag"]) <= EVAL_KEYS
    # the wall time at a validation is the sum of the step times up to it, evaluations left out
    dt_ms = [e["dt_ms"] for e in log if "train_loss" in e]
    assert jax_run.val_wall_s == pytest.approx(np.cumsum(dt_ms)[[1, 3]] / 1000)


def test_the_gpu_table_compares_the_trainers_step_by_step(runs, tmp_path):
    """bench/h100_table.py: runs whose start events hold the same recipe, shape, tokens, init, dtype and
    steps (here JAX and torchfunc from one model file) get their largest relative train-loss gap, at the
    step where it is, and their largest val-loss gap where both validated; a run of another seed is left
    out of their comparison. Where one framework ran both recipes on the same tokens, the step and the
    step time at which speedrun reaches gpt2's final val loss."""
    jax_dir, torch_dir = runs
    runs_dir = tmp_path / "runs"
    for d in runs:
        shutil.copytree(d, runs_dir / d.name)
    events = read_log(jax_dir, starts=True)
    events[0]["config"]["seed"] += 1
    write_log(runs_dir / "other_seed", events)
    twin = [dict(e, val_loss=e["val_loss"] + 0.25) if "val_loss" in e else e for e in events]
    twin[0]["config"]["seed"] = events[0]["config"]["seed"]
    write_log(runs_dir / "other_seed_twin", twin)
    out = run_script("bench/h100_table.py", runs_dir).stdout.splitlines()
    losses = [[e["train_loss"] for e in read_log(d) if "train_loss" in e] for d in runs]
    gaps = [abs(a - b) / min(a, b) for a, b in zip(*losses)]
    said = [line for line in out if "gap" in line]
    assert said == [f"jax, torchfunc: largest relative train-loss gap {max(gaps):.2e} (step "
                    f"{1 + gaps.index(max(gaps))} of the 4 all ran)",
                    "other_seed, other_seed_twin: largest relative train-loss gap 0.00e+00 (step 1 of the 4 "
                    "all ran); largest val-loss gap 2.50e-01 (step 2 of the 2 all validated)"]
    start = dict(event="start", framework="jax", config=dict(recipe="gpt2", data="d", seed=1, steps=9))
    dt = [500.0, 250.0, 250.0, 250.0]  # step 1 compiles
    gpt2 = [start] + [step_event(k, 6.0 - k / 4, dt[k - 1]) for k in range(1, 5)] + [
        dict(step=2, val_loss=5.6), dict(step=4, val_loss=5.1)]
    speedrun = [dict(start, config=dict(start["config"], recipe="speedrun", steps=7))] + [
        step_event(k, 5.0, dt[k - 1]) for k in range(1, 5)] + [dict(step=2, val_loss=5.3), dict(step=3, val_loss=5.0)]
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    write_log(recipes / "gpt2_jax", gpt2), write_log(recipes / "speedrun_jax", speedrun)
    out = run_script("bench/h100_table.py", recipes).stdout.splitlines()
    assert ("jax: speedrun reaches gpt2's final val loss 5.1000 (step 4, 1.2 s of step time) at step 3, 1.0 s: "
            "gpt2 took 1.3x the steps and 1.2x the time") in out


def test_synthetic_logs(tmp_path):
    """A log with peak memory adds the memory panel (a bar per run that measured it, n/a for one that did
    not), one with HellaSwag scores the HellaSwag panel; --smooth N draws the raw curve and a trailing
    N-step mean that starts at step 1; the figure's axes count the panels, no empty axes in the grid."""
    gpu = write_log(tmp_path / "gpu", [step_event(s, 10.0 - s, 50, "triton-triton", mem=1.0 + s)
                                       for s in range(1, 7)]
                    + [dict(step=6, hellaswag_acc=0.3, hellaswag_acc_norm=0.4, framework="triton-triton")])
    cpu = write_log(tmp_path / "cpu", [step_event(s, 10.0 - s, 100) for s in range(1, 7)])
    runs = [pr.load_run(str(gpu)), pr.load_run(str(cpu))]
    assert runs[0].peak_mem_gb == 7.0 and runs[1].peak_mem_gb is None
    assert list(runs[0].swag_steps) == [6] and list(runs[0].swag_acc_norm) == [0.4]
    fig = pr.build_figure(runs)
    assert titles(fig) == ["train loss", "tokens/s", "peak memory", "HellaSwag acc_norm"]
    bars = fig.axes[2].patches
    assert len(bars) == 1 and bars[0].get_height() == 7.0
    assert "n/a" in [t.get_text() for t in fig.axes[2].texts]

    fig = pr.build_figure(runs[1:], smooth=3)
    raw, mean = fig.axes[0].get_lines()
    np.testing.assert_allclose(raw.get_ydata(), [9, 8, 7, 6, 5, 4])
    np.testing.assert_allclose(mean.get_ydata(), [9, 8.5, 8, 7, 6, 5])
    assert len(pr.build_figure(runs[1:], smooth=1).axes[0].get_lines()) == 1   # 1 = off


def test_the_legend_fits_the_figure(tmp_path):
    """Long out dirs (a GPU call's LOGDIR/runs/NAME) make long labels: the legend takes fewer columns,
    so that every label lies inside the figure."""
    deep = tmp_path / "h100_call" / "runs"
    deep.mkdir(parents=True)
    runs = [pr.load_run(str(write_log(deep / f"speedrun_{name}", [step_event(s, 9.0 - s, 50, name)
                                                                  for s in range(1, 4)])))
            for name in ("jax", "torchfunc", "triton-triton", "triton-torch")]
    fig = pr.build_figure(runs)
    fig.canvas.draw()
    box, legend = fig.bbox, fig.legends[0].get_window_extent()
    assert box.x0 <= legend.x0 and legend.x1 <= box.x1 and box.y0 <= legend.y0
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [run.label for run in runs]


def test_resumed_run(tmp_path):
    """A run killed after step 5 and resumed from its step-2 checkpoint by another trainer: the later events
    of steps 3-5 win, the val and HellaSwag events of the abandoned steps are dropped (the one at the
    checkpoint's step stays), of two evaluations at one step the later wins, the label names both
    frameworks, and wall time sums one dt per kept step, the abandoned steps' time left out."""
    events = [step_event(s, 10.0 - s, 100) for s in range(1, 6)]
    events[2:2] = [dict(step=2, val_loss=9.5, framework="jax")]
    events += [dict(step=4, val_loss=8.0, framework="jax"),
               dict(step=4, hellaswag_acc=0.2, hellaswag_acc_norm=0.3, framework="jax")]
    events += [step_event(s, 20.0 - s, 300, "torchfunc") for s in range(3, 7)]
    events += [dict(step=6, val_loss=7.0, framework="torchfunc")]
    events += [dict(step=6, val_loss=6.5, framework="torchfunc")]   # an --eval-only run into the same dir
    run = pr.load_run(str(write_log(tmp_path / "resumed", events)))
    assert run.label == f"jax+torchfunc ({tmp_path / 'resumed'})"
    assert list(run.steps) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(run.train_loss, [9, 8, 17, 16, 15, 14])
    np.testing.assert_allclose(run.wall_s, [0.1, 0.2, 0.5, 0.8, 1.1, 1.4])
    assert list(run.val_steps) == [2, 6] and list(run.val_loss) == [9.5, 6.5]
    np.testing.assert_allclose(run.val_wall_s, [0.2, 1.4])
    assert len(run.swag_steps) == 0
    assert titles(pr.build_figure([run])) == LINE_PANELS


def test_bad_input(tmp_path):
    """A missing dir, a dir without log.jsonl, a corrupt line (the error names the file and line), an event
    without its numbers, a step past int64 (numpy's arrays would overflow), a log without step events, a
    negative --smooth and an -o that cannot be written
    (a missing folder, below a regular file, an extension that is no format) or that is a log it reads
    each stop with a one-line error; the command line exits non-zero without a traceback and writes no
    figure."""
    good = write_log(tmp_path / "good", [step_event(1, 9.0, 100)])
    (tmp_path / "empty").mkdir()
    corrupt = write_log(tmp_path / "corrupt", [step_event(1, 9.0, 100), step_event(2, 8.0, 100)])
    with open(corrupt / "log.jsonl", "a") as f:
        f.write('{"step": 3, "train_loss": 7.0, "dt_\n')          # a damaged line, events after it
        f.write(json.dumps(step_event(4, 7.0, 100)) + "\n")
    no_dt = write_log(tmp_path / "no_dt", [{"step": 1, "train_loss": 9.0, "framework": "jax"}])
    only_val = write_log(tmp_path / "only_val", [dict(step=5, val_loss=3.0, framework="jax")])
    huge = write_log(tmp_path / "huge", [step_event(1, 9.0, 100), step_event(10**20, 8.0, 100)])
    (tmp_path / "file").write_text("not a folder")
    out = str(tmp_path / "fig.png")
    cases = [
        ([str(tmp_path / "nothing")], "no such directory"),
        ([str(tmp_path / "empty")], "has no log.jsonl"),
        ([str(good), str(corrupt)], f"{corrupt / 'log.jsonl'} line 3: not valid JSON"),
        ([str(no_dt)], "line 1: a step event whose dt_ms is None"),
        ([str(only_val)], "no training step events"),
        ([str(huge)], "line 2: step 100000000000000000000 is outside [0, 2**63)"),
        ([str(good), "--smooth", "-2"], "--smooth"),
        ([str(good), "-o", str(tmp_path / "no_dir" / "fig.png")], "cannot write"),
        ([str(good), "-o", str(tmp_path / "file" / "fig.png")], f"cannot write {tmp_path}/file/fig.png: "),
        ([str(good), "-o", str(tmp_path / "fig.xyz")], "Format 'xyz' is not supported"),
        ([str(good), "-o", str(good / "log.jsonl")], "is a log this plot reads"),
    ]
    for args, needle in cases:
        with pytest.raises(SystemExit) as e:
            pr.main(["-o", out] + args)
        assert str(e.value).startswith("error: ") and needle in str(e.value), (args, str(e.value))
    assert not (tmp_path / "fig.png").exists() and read_log(good)[0]["train_loss"] == 9.0
    proc = run_script("plot_runs.py", good, corrupt, "-o", out, check=False)
    assert_clean_error(proc, "line 3")
    assert proc.stdout == "" and not (tmp_path / "fig.png").exists()


def test_a_last_line_cut_by_a_crash_is_skipped(tmp_path):
    """A run killed while it appended an event leaves half a line, without its newline, at the end of
    log.jsonl (docs/FORMATS.md): plot_runs.py skips it, as the trainers do, says so in one line, and
    plots the rest."""
    run = write_log(tmp_path / "killed", [step_event(1, 9.0, 100), step_event(2, 8.0, 100)])
    with open(run / "log.jsonl", "a") as f:
        f.write('{"step": 3, "train_loss": 7.0, "dt_')
    proc = run_script("plot_runs.py", run, "-o", tmp_path / "fig.png")
    assert "Traceback" not in proc.stderr and "line 3: skipped" in proc.stderr, proc.stderr
    assert (tmp_path / "fig.png").stat().st_size > 0
    assert list(pr.load_run(str(run)).steps) == [1, 2]


@pytest.mark.quick  # the quick tier's run of plot_runs.py
def test_output_is_the_name_reported(tmp_path, capsys):
    """-o NAME without an extension writes a PNG under exactly that name, the one the script reports (not
    NAME.png), replacing an earlier file there through a temporary name that is gone afterwards."""
    good = write_log(tmp_path / "good", [step_event(1, 9.0, 100), step_event(2, 8.0, 100)])
    out = tmp_path / "figure"
    out.write_bytes(b"an earlier figure")
    pr.main([str(good), "-o", str(out)])
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out} (2 panels, 1 run(s))"
    assert png_size(out) == (2 * pr.PANEL_W * pr.DPI, (pr.PANEL_H + 0.4) * pr.DPI)
    assert sorted(os.listdir(tmp_path)) == ["figure", "good"]


def test_a_full_disk_is_one_line(tmp_path, capsys):
    """A disk that fills while the figure is written (a 4 KiB limit on the size of the files the script
    writes: EFBIG, which counts as ENOSPC) is one line that names the figure and says the disk is full;
    the temporary is removed and the earlier figure left as it was, in PNG (whose writer, Pillow, removes
    the file it failed to write itself) and in SVG (matplotlib's own writer, which does not)."""
    good = write_log(tmp_path / "good", [step_event(1, 9.0, 100), step_event(2, 8.0, 100)])
    figures = [tmp_path / "fig.png", tmp_path / "fig.svg"]
    for out in figures:
        pr.main([str(good), "-o", str(out)])
    capsys.readouterr()
    before = [out.read_bytes() for out in figures]
    for out in figures:
        proc = run_script_on_a_full_disk(4096, "plot_runs.py", good, "-o", out)
        assert_clean_error(proc)
        assert proc.stderr.splitlines()[-1] == f"error: cannot write {out}: no space left, the disk is full"
    assert [out.read_bytes() for out in figures] == before
    assert sorted(os.listdir(tmp_path)) == ["fig.png", "fig.svg", "good"]


def test_a_log_for_its_run_and_outputs_said_in_one_line(tmp_path, monkeypatch, capsys):
    """A run's log.jsonl stands for its out dir (here too: no folder before it); another file given as a
    run, -o '' and a .pgf figure without LaTeX on the PATH are each one line, nothing written; a
    255-character -o is written, its temporary name within the limit too."""
    good = write_log(tmp_path / "good", [step_event(1, 9.0, 100), step_event(2, 8.0, 100)])
    shutil.copy(good / "log.jsonl", good / "copy.jsonl")
    monkeypatch.chdir(good)
    pr.main(["log.jsonl", str(good / "log.jsonl"), "-o", str(tmp_path / ("x" * 251 + ".png"))])
    assert capsys.readouterr().out.startswith("jax (.): steps 1-2")
    monkeypatch.setenv("PATH", str(tmp_path / "no_tex"))
    cases = [(["log.jsonl", "-o", "log.jsonl"], "is a log this plot reads"),
             (["copy.jsonl", "-o", "fig.png"], "copy.jsonl is a file: give the run's --out-dir"),
             (["log.jsonl", "-o", ""], "-o '': give a file's name"),
             (["log.jsonl", "-o", "fig.pgf"], "cannot write fig.pgf: 'xelatex' not found")]
    for args, needle in cases:
        with pytest.raises(SystemExit) as e:
            pr.main(args)
        assert str(e.value).startswith("error: ") and needle in str(e.value) and "\n" not in str(e.value), args
    assert sorted(os.listdir(good)) == ["copy.jsonl", "log.jsonl"]
    assert sorted(os.listdir(tmp_path)) == ["good", "x" * 251 + ".png"]
