"""README.md's commands as a reader runs them, taken from its code blocks: the laptop quick start (the
committed tinyshakespeare to shards, a run of each recipe that learns and samples, the plot; then the same
model in the other two trainers, the three compared) and the smoke runs on synthetic data, each from a
folder laid out as a fresh clone is."""
import math
import os
import re
import shlex

import pytest

from conftest import OFFLINE, REPO, run_script, step_events

# the quick start's trainer runs here: as written, with `--steps QUICK_STEPS[recipe]` appended (argparse
# keeps a flag's last value), so that each takes seconds; their losses still fall by more than FALL
QUICK_STEPS = {"gpt2": 30, "speedrun": 12}
# the other two trainers' runs of the gpt2 model: their first steps, still in its warmup (whose lr does not
# depend on --steps), against the JAX run's
COMPARE_STEPS = 8
FALL = 2.0


def readme_commands(marker):
    """The commands of README.md's one code block that contains `marker`: continued lines joined, comments
    dropped, each split as a shell splits it."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    blocks = [b for b in re.findall(r"^```\n(.*?)^```", text, re.S | re.M) if marker in b]
    assert len(blocks) == 1, f"README.md has {len(blocks)} code blocks with {marker!r}, expected one"
    lines = blocks[0].replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if shlex.split(line, comments=True)]


def clone_like(folder):
    """`folder` laid out as a fresh clone: links to the repository's files and folders (tests/data
    included), none of its runs' output (data/, out/)."""
    for name in os.listdir(REPO):
        if name not in (".git", "data", "out") and not name.startswith("."):
            os.symlink(os.path.join(REPO, name), folder / name)
    return folder


def recipe(cmd):
    return cmd[cmd.index("--recipe") + 1] if "--recipe" in cmd else "gpt2"


def test_the_laptop_quick_start_learns(tmp_path):
    """README's quick start on a laptop, its two blocks in order: prepro_fineweb.py turns the committed
    tinyshakespeare into shards, each recipe trains on them (QUICK_STEPS steps here) from ln(50257) = 10.8,
    a uniform guess, to a loss more than FALL below it, and samples at its end; the other two trainers
    train the gpt2 model to the same losses (COMPARE_STEPS steps here); plot_runs.py draws the runs."""
    commands = readme_commands("out/quick_speedrun") + readme_commands("out/quick_gpt2_triton")
    folder = clone_like(tmp_path)
    trained, gpt2_losses = set(), {}
    for cmd in commands:
        assert cmd[0] == "python", cmd
        if not cmd[1].startswith("train_gpt2_"):
            run_script(*cmd[1:], cwd=folder)
            continue
        compared = recipe(cmd) == "gpt2" and cmd[1] != "train_gpt2_jax.py"
        steps = COMPARE_STEPS if compared else QUICK_STEPS[recipe(cmd)]
        proc = run_script(*cmd[1:], "--steps", steps, cwd=folder,
                          env={"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"})
        losses = [e["train_loss"] for e in step_events(folder / cmd[cmd.index("--out-dir") + 1])]
        assert len(losses) == steps and abs(losses[0] - math.log(50257)) < 0.1, (cmd, losses[:3])
        assert compared or max(losses[-3:]) < losses[0] - FALL, (cmd, losses)
        assert re.search(r"^sample 0: ['\"]", proc.stdout, re.M), proc.stdout[-2000:]
        trained.add(recipe(cmd))
        if recipe(cmd) == "gpt2":
            gpt2_losses[cmd[1]] = losses
    assert trained == set(QUICK_STEPS), "the quick start trains each recipe"
    assert len(gpt2_losses) == 3, "the gpt2 model in each trainer"
    jax_losses = gpt2_losses["train_gpt2_jax.py"]
    for name, losses in gpt2_losses.items():
        assert losses == pytest.approx(jax_losses[:len(losses)], rel=1e-5), name
    plots = [cmd[cmd.index("-o") + 1] for cmd in commands if cmd[1] == "plot_runs.py"]
    assert plots and all((folder / p).stat().st_size > 0 for p in plots)


def test_the_smoke_runs_run(tmp_path):
    """README's smoke runs on --data synthetic, one per recipe, as written and offline with tiktoken's cache
    empty: each completes, logs every step and prints its samples through the committed GPT-2 files, which
    serve without a word."""
    commands = readme_commands("--data synthetic")
    assert {recipe(cmd) for cmd in commands} == set(QUICK_STEPS), "a smoke run of each recipe"
    folder = clone_like(tmp_path)
    offline = {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu", "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty"),
               **OFFLINE}
    for cmd in commands:
        proc = run_script(*cmd[1:], cwd=folder, env=offline)
        if "--sample-only" in cmd:  # the first run's last checkpoint continues the prompt
            prompt = cmd[cmd.index("--prompt") + 1]
            assert re.search(rf"^sample 3: ['\"]{re.escape(prompt)}", proc.stdout, re.M), proc.stdout[-2000:]
            continue
        steps = int(cmd[cmd.index("--steps") + 1])
        out = cmd[cmd.index("--out-dir") + 1]
        assert [e["step"] for e in step_events(out if os.path.isabs(out) else folder / out)] == \
            list(range(1, steps + 1))
        assert "tiktoken" not in proc.stderr + proc.stdout
        assert re.search(r"^sample 0: ['\"]", proc.stdout, re.M), proc.stdout[-2000:]
