"""The three GPT-2 trainers' common behaviour, each test written once for all of them
(tiny model L2 H4 C64 on the CPU, the Triton trainer with backend torch: a training run, exact resume,
eval-only, evaluations lost to a kill run on resume, a checkpoint written before a failing evaluation, bad
input; TRAINERS says how the trainers' runs differ and holds each one's own bad-input cases), and against
that training run the JAX trainer on two devices and the torchfunc trainer in two torchrun processes."""
import glob
import importlib
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import pytest
import safetensors.numpy
import torch

import llmc_reference
from conftest import (REPO, STEP_KEYS, assert_clean_error, assert_due_events, assert_eval_only_repeats,
                      assert_refused, assert_same_checkpoint, assert_same_step_values, read_log, run_script,
                      step_events, step_lines, stop_by_signals_and_resume, tiny_params, write_bad_shards,
                      write_model_file, write_shard)
from test_recovery import assert_lost_evaluations_recovered, write_damaged_checkpoints
from train_gpt2_jax import latest_checkpoint, save_checkpoint
from train_gpt2_jax import PARAM_NAMES
from train_gpt2_jax import format_memory

V = 50257
STEPS = 6
TINY = ["--n-layer", 2, "--n-head", 4, "--n-embd", 64]  # the model of tiny_model_file (max T 64)
COMMON = ["--lr", 3e-3, "--warmup", 2, "--lr-decay-frac", 1.0, "--dtype", "fp32", "--val-steps", 2]


@dataclass(frozen=True)
class Trainer:
    """How one trainer's runs here differ from the others'."""
    argv: list  # the command line after `python`: the script, and the Triton trainer's backend
    batch: tuple  # B, T, total batch size: two micro-batches per step
    env: dict  # the environment of its runs
    compile_cache: bool = False  # its runs share a persistent JAX compilation cache (the `env` fixture)
    hellaswag_limit: int = 0  # --hellaswag-limit of its runs (0: all 10 examples)
    resume_auto: bool = False  # the exact-resume test resumes with --resume auto instead of the path
    gpu: bool = False  # its runs use a GPU where one is visible (peak memory and MFU are then logged)
    stdout: tuple = ()  # what its training run prints besides what every trainer's does
    ckpt_config: dict = field(default_factory=dict)  # what its checkpoints' config records besides n_layer
    # its own bad-input cases, given the tiny shards' dir: (argv after the script, what the error says...)
    bad_inputs: Callable = lambda shards: []

    @property
    def module(self):
        return self.argv[0].removesuffix(".py")

    @property
    def flags(self):
        B, T, total = self.batch
        limit = ["--hellaswag-limit", self.hellaswag_limit] if self.hellaswag_limit else []
        return ["--seq-len", T, "--batch-size", B, "--total-batch-size", total, *COMMON, *limit]


# keyed by log.jsonl's framework name
TRAINERS = {
    # the CPU even where a GPU is visible: resume must be exact and XLA's GPU scatter-add is not
    # deterministic
    "jax": Trainer(
        argv=["train_gpt2_jax.py"], batch=(4, 64, 512), env={"JAX_PLATFORMS": "cpu"}, compile_cache=True,
        stdout=("compiled train step in",),
        bad_inputs=lambda shards: [
            (["--data", shards, "--attn", "cudnn", "--dtype", "fp32"], "--attn cudnn needs")]),
    # the CPU even where a GPU is visible: resume must be exact, and CUDA's atomic-add embedding backward
    # is not deterministic
    "torchfunc": Trainer(
        argv=["train_gpt2_torchfunc.py"], batch=(4, 64, 512), env={"CUDA_VISIBLE_DEVICES": ""},
        resume_auto=True, stdout=("compile: off",),
        bad_inputs=lambda shards: [(["--data", shards, "--compile", "2"], "--compile")]),
    # these models are too small to gain from intra-op threads, and on a busy 2-core machine the threads
    # of concurrent runs slow each other down several times over
    "triton-torch": Trainer(
        argv=["train_gpt2_triton.py", "torch"], batch=(2, 32, 128), env={"OMP_NUM_THREADS": "1"},
        hellaswag_limit=4, gpu=True, ckpt_config={"backend": "torch"},
        bad_inputs=lambda shards: [(["jax", "--data", shards], "argument backend"),
                                   (["--data", shards], "required: backend")]),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """env(name) -> the environment of trainer `name`'s runs: TRAINERS' env, and for the JAX trainer a
    persistent compilation cache shared by this file's runs, so that runs with the same shapes (a run and
    its resumption) compile once."""
    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    return lambda name: {**TRAINERS[name].env, **(cache if TRAINERS[name].compile_cache else {})}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_shards, tiny_model_file, hellaswag_dir, env):
    """trained(name) -> (out dir, stdout) of trainer `name`'s fp32 run of 6 steps with val (every 3),
    HellaSwag and samples (step 6), checkpoints at 3 and 6; each run once per module, when a test first
    asks for it (so that -k jax runs only JAX's)."""
    done = {}

    def get(name):
        if name not in done:
            out = tmp_path_factory.mktemp(f"{name}_run")
            proc = run_script(*TRAINERS[name].argv, "--data", tiny_shards, "--init-from", tiny_model_file,
                              "--steps", STEPS, "--out-dir", out, "--ckpt-every", 3, "--val-every", 3,
                              "--hellaswag-every", STEPS, "--sample-every", STEPS, *TRAINERS[name].flags,
                              env={"HELLASWAG_DIR": str(hellaswag_dir), **env(name)})
            done[name] = out, proc.stdout
        return done[name]
    return get


@pytest.mark.quick  # the quick tier's --recipe gpt2 run of each trainer (Triton's with backend torch)
@pytest.mark.parametrize("name", TRAINERS)
def test_training_run(name, trained, tiny_shards, tiny_model_file):
    """A 6-step run: step 1's loss equals the float64 reference of tests/llmc_reference.py on the first two
    micro-batches of the train shard (rel 1e-6), the loss falls, val/HellaSwag/samples/checkpoints happen
    when due, log.jsonl holds only the documented keys (peak memory and MFU only from a run on a GPU), the
    run prints what TRAINERS says, and each checkpoint holds the model file and a state.npz that records
    the step, the data position, the seed, the config and AdamW moments of the weights' shapes; the log
    starts with the start event, whose bytes are those the start line prints; JAX's first step's time
    holds its ahead-of-time compile, as the torch trainers' holds torch.compile's."""
    t = TRAINERS[name]
    mod = importlib.import_module(t.module)
    B, T, total = t.batch
    out, stdout = trained(name)
    events = step_events(out)
    assert [e["step"] for e in events] == list(range(1, STEPS + 1))
    assert all(set(e) == STEP_KEYS and e["framework"] == name for e in events)
    on_gpu = t.gpu and torch.cuda.is_available()  # peak memory (and MFU on a known GPU) only there
    assert all((e["peak_mem_gb"] is not None) == on_gpu and e["tokens_per_s"] > 0 for e in events)
    assert on_gpu or all(e["mfu"] is None for e in events)
    assert events[0]["lr"] == pytest.approx(1.5e-3) and events[-1]["lr"] == pytest.approx(3e-3)

    ref = llmc_reference.load_model_file(str(tiny_model_file))
    tokens = torch.from_numpy(np.fromfile(tiny_shards / "tiny_train_000001.bin", dtype="<u2",
                                          offset=1024).astype(np.int64))
    with torch.no_grad():
        first = np.mean([ref(tokens[s:s + B * T].view(B, T), tokens[s + 1:s + B * T + 1].view(B, T)).item()
                         for s in (0, B * T)])
    assert events[0]["train_loss"] == pytest.approx(first, rel=1e-6)
    assert events[-1]["train_loss"] < events[0]["train_loss"] - 0.5

    start = read_log(out, starts=True)[0]  # the launch's start event: the config, devices and bytes of the start line
    cfg = mod.Config(**start["config"])
    assert start["event"] == "start" and start["step"] == 0 and start["devices"] == 1
    assert (cfg.batch_size, cfg.seq_len, cfg.n_layer, cfg.recompute) == (B, T, 2, "none")
    recipe = mod.RECIPES[cfg.recipe]
    assert start["framework"] == name and start["activation_bytes"] == recipe.activation_bytes(cfg) > 0
    assert start["state_bytes"] == mod.device_state_bytes(cfg, mod.param_shapes(cfg), 1)
    assert format_memory(cfg, start["state_bytes"], start["activation_bytes"], 1, recipe.optimizers) in stdout
    weights = 4 * sum(math.prod(s) for s in mod.param_shapes(cfg).values())  # fp32: the masters are the params
    assert f"per device: fp32 params {weights / 1e6:.1f} MB | grads " in stdout
    assert f"out dir {out}: log.jsonl, checkpoints ckpt_*" in stdout.splitlines()
    # the step lines hold what is measured: on the CPU no mfu or memory, which a start line says once
    assert on_gpu or ("step lines without mfu (no peak FLOP/s known for cpu) and mem (no memory statistics)"
                      in stdout.splitlines() and not any(s in stdout for s in ("n/a", "| mfu", "| mem")))

    assert_due_events(out, stdout, STEPS)
    swag = next(e for e in read_log(out) if "hellaswag_acc" in e)  # a share of the examples scored
    n = t.hellaswag_limit or 10
    assert all(round(n * swag[k]) == pytest.approx(n * swag[k]) for k in ("hellaswag_acc",
                                                                        "hellaswag_acc_norm"))
    for needle in (*t.stdout, "mean over 5 step(s) after the first"):
        assert needle in stdout, needle
    if name == "jax":  # its ahead-of-time compile counts in the first step, as torch.compile's does
        compile_s = float(re.search(r"compiled train step in ([0-9.]+) s", stdout).group(1))
        assert step_events(out)[0]["dt_ms"] >= 1000 * compile_s - 50

    shapes = mod.param_shapes(mod.Config(n_layer=2, n_head=4, n_embd=64, block_size=64))
    for step in (3, STEPS):
        ckpt = out / f"ckpt_{step:07d}"
        assert sorted(os.listdir(ckpt)) == ["model.bin", "state.npz"]
        with np.load(ckpt / "state.npz") as z:
            assert int(z["step"]) == step and int(z["shard"]) == 0
            assert int(z["position"]) == step * total and int(z["seed"]) == 1337
            config = json.loads(str(z["config"]))
            assert {k: config.get(k) for k in ("n_layer", *t.ckpt_config)} == {"n_layer": 2, **t.ckpt_config}
            assert all(z[f"{p}.{k}"].shape == shapes[k] for p in "mv" for k in PARAM_NAMES)
        header, _ = mod.read_model_file(str(ckpt / "model.bin"))
        assert header["n_layer"] == 2 and header["block_size"] == 64


@pytest.mark.parametrize("name", TRAINERS)
def test_exact_resume_and_eval_only(name, trained, tiny_shards, tmp_path, hellaswag_dir, env):
    """Resuming the step-3 checkpoint for steps 4-6 (by its path, or with --resume auto where TRAINERS
    says so) prints the uninterrupted run's losses and grad norms digit for digit, logs steps 4-6 and ends
    on byte-identical weights and AdamW state; the step-3 checkpoint resumed there again is refused (it is
    another out dir's, and that out dir now holds a run); --eval-only on the step-6 checkpoint reproduces
    that run's val loss and HellaSwag scores and trains nothing."""
    t = TRAINERS[name]
    out, stdout = trained(name)
    resumed = tmp_path / "resumed"
    if t.resume_auto:
        resumed.mkdir()
        os.symlink(out / "ckpt_0000003", resumed / "ckpt_0000003")
    proc = run_script(*t.argv, "--data", tiny_shards,
                      "--resume", "auto" if t.resume_auto else out / "ckpt_0000003",
                      "--steps", STEPS, "--out-dir", resumed, "--ckpt-every", 3, "--val-every", 0,
                      "--hellaswag-every", 0, "--sample-every", 0, *t.flags, env=env(name))
    assert step_lines(proc.stdout) == step_lines(stdout)[3:]
    assert [e["step"] for e in step_events(resumed)] == [4, 5, 6]
    final = out / "ckpt_0000006"
    assert_same_checkpoint(final, resumed / "ckpt_0000006")

    # the step-3 checkpoint is out's: resumed into that out dir, which now holds a run, it would splice two
    # runs in one log, and is refused, moving nothing (the branches of one out dir: test_runs_are_safe.py)
    mod = importlib.import_module(t.module)
    with pytest.raises(SystemExit) as refused:
        mod.main([*map(str, t.argv[1:]), "--data", str(tiny_shards), "--resume", str(out / "ckpt_0000003"),
                  "--steps", "3", "--out-dir", str(resumed), "--ckpt-every", "3", "--val-every", "0",
                  "--hellaswag-every", "0", "--sample-every", "0", *map(str, t.flags)])
    assert str(refused.value).startswith(f"error: --resume {out / 'ckpt_0000003'}: a checkpoint of another out "
                                         "dir")
    assert [e["step"] for e in step_events(resumed)] == [4, 5, 6] and not list(resumed.glob("abandoned_*"))
    assert latest_checkpoint(str(resumed)) == str(resumed / "ckpt_0000006")

    evaluated = tmp_path / "eval"
    run_script(*t.argv, "--data", tiny_shards, "--resume", final, "--eval-only", "--out-dir", evaluated,
               *t.flags, env={"HELLASWAG_DIR": str(hellaswag_dir), **env(name)})
    assert_eval_only_repeats(out, evaluated, STEPS)
    # --hellaswag-every 0 leaves HellaSwag out of --eval-only too: no HellaSwag file is needed
    val_only = tmp_path / "val_only"
    run_script(*t.argv, "--data", tiny_shards, "--resume", final, "--eval-only", "--hellaswag-every", 0,
               "--out-dir", val_only, *t.flags, env={"HELLASWAG_DIR": str(tmp_path / "none"), **env(name)})
    logged = [sorted(k for k in e if k in ("val_loss", "hellaswag_acc")) for e in read_log(val_only)]
    assert logged == [["val_loss"]]


def sample_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("sample ")]


@pytest.mark.parametrize("name", TRAINERS)
def test_sample_only(name, trained, tiny_model_file, tmp_path, env, one_thread, capsys, monkeypatch):
    """--sample-only on the step-6 checkpoint, with no data, prints the samples the run printed at step 6 and
    writes nothing; from a model file each sample is the --prompt and --sample-tokens more tokens, the same
    --seed gives the same text, another seed another. Without a tokenizer, with a prompt that fills the model's
    context, with --eval-only or without weights it is refused in one line."""
    t = TRAINERS[name]
    out, stdout = trained(name)
    nowhere = tmp_path / "none"
    proc = run_script(*t.argv, "--resume", out / "ckpt_0000006", "--sample-only", "--out-dir", nowhere, env=env(name))
    assert sample_lines(proc.stdout) == sample_lines(stdout) and len(sample_lines(stdout)) == 4
    assert not nowhere.exists()

    mod, backend = importlib.import_module(t.module), [*map(str, t.argv[1:])]
    flags = [*backend, "--init-from", str(tiny_model_file), "--sample-only", "--prompt", "To be, or",
             "--sample-tokens", "5", "--out-dir", str(nowhere)]
    texts = []
    for seed in (1, 1, 2):
        mod.main([*flags, "--seed", str(seed)])
        texts.append(sample_lines(capsys.readouterr().out))
    assert texts[0] == texts[1] != texts[2] and len(texts[0]) == 4
    assert all(re.fullmatch(r"sample \d: 'To be, or.+'", line) for line in texts[0])

    def no_gpt2(name):
        raise ValueError("no GPT-2 here")
    monkeypatch.setitem(sys.modules, "hellaswag", None)  # no hellaswag.py, and tiktoken's GPT-2 fails
    monkeypatch.setattr("tiktoken.get_encoding", no_gpt2)
    assert_refused(mod.main, [(flags, "no samples: GPT-2's tokenizer did not load (no GPT-2 here)")])
    monkeypatch.undo()
    assert_refused(mod.main, [([*flags, "--prompt", "a" + " a" * 62], "--prompt is 63 tokens", "context of 64"),
                              ([*flags, "--eval-only"], "--eval-only: not allowed with argument --sample-only"),
                              ([*backend, "--sample-only", "--out-dir", str(nowhere)], "--sample-only needs weights")])
    assert not nowhere.exists()


def test_greedy_samples_agree_across_trainers(tmp_path, one_thread, capsys):
    """--top-k 1 (greedy) continues a --prompt with the same text in the three trainers from one model file,
    whose weights are GPT-2's init ten times over, so that the greedy tokens vary."""
    params = [p if i in (2, 8, 14) else 10 * p for i, p in enumerate(tiny_params(seed=0))]  # ln gains stay 1
    write_model_file(tmp_path / "model.bin", params, block_size=64, n_layer=2, n_head=4, n_embd=64)
    texts = {}
    for name, t in TRAINERS.items():
        importlib.import_module(t.module).main([*map(str, t.argv[1:]), "--init-from", str(tmp_path / "model.bin"),
                                                "--sample-only", "--prompt", "To be, or not to be", "--top-k", "1",
                                                "--sample-tokens", "12", "--dtype", "fp32"])
        texts[name] = sample_lines(capsys.readouterr().out)
    assert len(set(texts["jax"][0].split("not to be")[1].split())) > 3  # not one token over and over
    assert texts["jax"] == texts["torchfunc"] == texts["triton-torch"]


@pytest.mark.parametrize("name", TRAINERS)
def test_time_budget_stops_early_on_the_same_schedule(name, trained, tiny_shards, tiny_model_file, tmp_path,
                                                      env):
    """--time-budget (here far below one step) stops the run after the step that reaches it, with that
    step's checkpoint and val loss as a last step's; the step is the 6-step run's own, digit for digit (the
    lr schedule still spans --steps). The budget is the run's: resumed, it trains nothing. Without --dtype,
    the start line says which dtype the device's default is: on a CPU fp32 (the same digits as the run's
    --dtype fp32)."""
    out = tmp_path / "out"
    t = TRAINERS[name]
    flags = t.flags
    if not (t.gpu and torch.cuda.is_available()):  # --dtype's default on a CPU is fp32: the same digits
        at = flags.index("--dtype")
        flags = flags[:at] + flags[at + 2:]
    proc = run_script(*t.argv, "--data", tiny_shards, "--init-from", tiny_model_file,
                      "--steps", STEPS, "--time-budget", 1e-9, "--out-dir", out, "--ckpt-every", 3,
                      "--val-every", 3, "--hellaswag-every", 0, "--sample-every", 0, *flags, env=env(name))
    assert flags != t.flags or "| bf16 (the default on a GPU" in proc.stdout
    assert flags == t.flags or "| fp32 (the default on a CPU, which only emulates bf16" in proc.stdout
    assert step_lines(proc.stdout) == step_lines(trained(name)[1])[:1]
    assert f"--time-budget 1e-09 s reached: stopped after step 1 of {STEPS}" in proc.stdout
    assert [(e["step"], "val_loss" in e) for e in read_log(out)] == [(1, False), (1, True)]
    assert sorted(os.listdir(out)) == ["ckpt_0000001", "log.jsonl"]
    proc = run_script(*t.argv, "--data", tiny_shards, "--steps", STEPS, "--time-budget", 1e-9, "--out-dir", out,
                      "--resume", "auto", "--ckpt-every", 3, "--val-every", 3, "--hellaswag-every", 0,
                      "--sample-every", 0, *flags, env=env(name))
    assert re.search(r"the run's steps took \d+\.\d s of --time-budget 1e-09 s: nothing to train", proc.stdout)
    assert [(e["step"], "val_loss" in e) for e in read_log(out)] == [(1, False), (1, True)]


@pytest.mark.parametrize("name", TRAINERS)
def test_evaluations_lost_to_a_kill_run_on_resume(name, trained, tiny_shards, hellaswag_dir, tmp_path, env):
    """A run killed after a due step's checkpoint but before its evaluations (val loss, HellaSwag) runs the
    ones log.jsonl lacks when resumed, and only those, then trains on: its log ends up equal to the
    uninterrupted run's (test_recovery.assert_lost_evaluations_recovered)."""
    args = [*TRAINERS[name].argv, "--data", tiny_shards, "--steps", STEPS, "--ckpt-every", 3,
            "--val-every", 3, "--hellaswag-every", STEPS, "--sample-every", 0, *TRAINERS[name].flags]
    assert_lost_evaluations_recovered(args, trained(name)[0], env(name), hellaswag_dir, tmp_path)


@pytest.mark.parametrize("name", TRAINERS)
def test_checkpoint_written_before_a_failing_evaluation(name, tiny_shards, tiny_model_file, tmp_path, env):
    """At a step where a checkpoint and HellaSwag are both due, the checkpoint is written first: a corrupt
    HellaSwag file ends the run with a one-line error, and that step's whole checkpoint is on disk."""
    swag = tmp_path / "hellaswag"
    swag.mkdir()
    (swag / "hellaswag_val.jsonl").write_text("{not json\n")
    out = tmp_path / "out"
    proc = run_script(*TRAINERS[name].argv, "--data", tiny_shards, "--init-from", tiny_model_file,
                      "--steps", 2, "--out-dir", out, "--ckpt-every", 2, "--val-every", 0,
                      "--hellaswag-every", 2, "--sample-every", 0, *TRAINERS[name].flags, check=False,
                      env={"HELLASWAG_DIR": str(swag), **env(name)})
    assert_clean_error(proc, "not valid JSON")
    assert sorted(os.listdir(out / "ckpt_0000002")) == ["model.bin", "state.npz"]
    with np.load(out / "ckpt_0000002" / "state.npz") as z:
        assert int(z["step"]) == 2


@pytest.mark.parametrize("name", TRAINERS)
def test_bad_input(name, tmp_path, tiny_shards, tiny_model_file, env, one_thread, monkeypatch):
    """Bad shards (wrong magic, truncated, a train or val shard with token ids past GPT-2's vocabulary, a
    glob matching a folder, a FIFO or a broken symlink, each said as such), missing data (the default
    --data too: the error says how to get shards), a model file that contradicts the flags or is cut
    short, a transformers GPT-2 (either recipe: the line names convert_hf.py's from-hf), --eval-only
    without weights (refused while parsing) or with nothing to evaluate (no val shards, HellaSwag off), a
    directory that is not a checkpoint, a damaged checkpoint
    state.npz (text, cut, empty, a failing CRC, a member that does not inflate), bad flags (NaN, an empty
    path as an unset shell variable gives, --init-from or another --seed or --shuffle than the
    checkpoint's with --resume, a shuffled checkpoint's sample past its shard, --shuffle on synthetic
    tokens, --val-tokens past the val shard), impossible batch settings and the trainer's own cases in
    TRAINERS (a flag's bad value, a missing or unknown backend) end with a one-line error naming the
    problem, and write nothing; so does a run of the script on bad shards, without a traceback."""
    t = TRAINERS[name]
    mod = importlib.import_module(t.module)
    monkeypatch.chdir(tmp_path)  # where the default --data data/fineweb_edu does not exist
    bad = write_bad_shards(tmp_path / "bad")
    (bad / "model.bin").write_bytes(tiny_model_file.read_bytes()[:-4])
    (bad / "cut.bin").write_bytes(tiny_model_file.read_bytes()[:5000])
    (bad / "hf").mkdir()  # transformers' GPT-2 names (convert_hf.py's from-hf reads its folder)
    safetensors.numpy.save_file({"h.0.attn.c_attn.weight": np.zeros((64, 192), np.float32)},
                                bad / "hf" / "model.safetensors", metadata={"format": "pt"})
    (bad / "folder_train_000001.bin").mkdir()  # --data globs matching what is no shard file
    os.mkfifo(bad / "fifo_train_000001.bin")
    (bad / "dangling_train_000001.bin").symlink_to(bad / "gone.bin")
    tokens = np.arange(5000) % V
    tokens[-1] = V  # the first id past the vocabulary, at the shard's end
    write_shard(bad / "vocab_train_000001.bin", tokens)
    tokens[-1] = 65535
    write_shard(bad / "wide_val_000000.bin", tokens)
    damaged = write_damaged_checkpoints(mod, tmp_path / "damaged")
    cfg = mod.Config(n_layer=2, n_head=4, n_embd=64, block_size=64)  # seed 1337
    zeros = {k: np.zeros(shape, np.float32) for k, shape in mod.param_shapes(cfg).items()}
    good = save_checkpoint(str(tmp_path / "good"), 1, zeros, zeros, zeros, (0, 0), cfg)
    # a --shuffle run's checkpoint, at a sample past its shard's (of another --batch-size)
    shuffled = save_checkpoint(str(tmp_path / "shuffled"), 1, zeros, zeros, zeros, (0, 10**6),
                               replace(cfg, shuffle=True))
    out = tmp_path / "out"
    # a case that does not stop as it should trains one step, not the default 18,865
    base = ["--out-dir", str(out), *map(str, TINY + t.flags), "--steps", "1", "--ckpt-every", "0",
            "--val-every", "0", "--hellaswag-every", "0", "--sample-every", "0"]
    shards = str(tiny_shards)
    cases = [
        (["--data", str(bad / "magic_*.bin")], "magic 12345"),
        (["--data", str(bad / "short_*.bin")], "truncated"),
        (["--data", str(bad / "vocab_*.bin")], str(bad / "vocab_train_000001.bin"), "up to 50257",
         "vocabulary of 50257"),
        (["--data", shards, "--val-data", str(bad / "wide_*.bin"), "--val-every", "1"],
         str(bad / "wide_val_000000.bin"), "up to 65535"),
        (["--data", shards, "--init-from", str(tiny_model_file), "--n-layer", "3"],
         "--n-layer 3 does not match"),
        (["--data", shards, "--init-from", str(bad / "model.bin")], "its header implies"),
        (["--data", shards, "--init-from", str(bad / "cut.bin")], "has 5000 bytes", "its header implies"),
        (["--data", shards, "--resume", str(bad)], "not a checkpoint directory"),
        (["--data", shards, "--dtype", "fp16"], "--dtype"),
        (["--data", shards, "--total-batch-size", "500"], "not a multiple"),
        (["--data", shards, "--eval-only"], "--eval-only needs"),
        (["--data", "synthetic", "--eval-only", "--init-from", str(tiny_model_file)], "nothing to evaluate"),
        (["--data", f"{shards}/*_train_*.bin", "--eval-only", "--init-from", str(tiny_model_file)],
         "--eval-only with --hellaswag-every 0 and no val shards", "nothing to evaluate"),
        (["--data", shards, "--init-from", str(bad / "hf" / "model.safetensors")], "a Hugging Face transformers",
         f"python convert_hf.py from-hf {bad / 'hf'} -o model.bin"),
        (["--data", shards, "--recipe", "speedrun", "--n-embd", "128", "--n-head", "1", "--init-from",
          str(bad / "hf" / "model.safetensors")], "a Hugging Face transformers", "convert_hf.py from-hf"),
        (["--data", str(bad / "folder_*.bin")], f"shard {bad / 'folder_train_000001.bin'} is a folder"),
        (["--data", str(bad / "fifo_*.bin")], "fifo_train_000001.bin is not a regular file"),
        (["--data", str(bad / "dangling_*.bin")], "dangling_train_000001.bin is a broken symlink"),
        ([], "--data data/fineweb_edu: no such directory", "python prepro_fineweb.py", "--data synthetic"),
        (["--data", str(tmp_path / "nothing")], "no such directory", "python prepro_fineweb.py"),
        (["--data", shards, "--val-data", str(tmp_path / "none_*.bin")], "--val-data"),
        (["--data", shards, "--seed", "-1"], "--seed"),
        (["--data", shards, "--grad-clip", "nan"], "--grad-clip"),
        (["--data", shards, "--lr", "inf"], "--lr"),
        (["--data", shards, "--time-budget", "nan"], "--time-budget must be >= 0"),
        (["--data", shards, "--init-from", ""], "--init-from is empty"),  # an unset shell variable
        (["--data", shards, "--resume", ""], "--resume is empty"),
        (["--data", shards, "--force", "--out-dir", ""], "--out-dir is empty"),
        (["--data", shards, "--resume", good, "--seed", "5"], "--seed 5 with --resume", "seed is 1337"),
        (["--data", shards, "--resume", good, "--shuffle"], "read its train shards in order",
         "leave --shuffle out"),
        (["--data", shards, "--resume", shuffled], "shuffled (--shuffle): give --shuffle"),
        (["--data", shards, "--resume", shuffled, "--shuffle"], "at sample 1000000 of train shard"),
        (["--data", "synthetic", "--shuffle"], "--shuffle with --data synthetic"),
        (["--data", shards, "--resume", "auto", "--init-from", str(tiny_model_file)],
         "--init-from with --resume"),
        (["--data", shards, "--val-every", "1", "--val-steps", "1000"], "--val-tokens ",
         "val shards (1 file(s), 32768 tokens)"),
        (["--data", shards, "--resume", "auto", "--out-dir", str(damaged["text"].parent)],
         str(damaged["text"] / "state.npz"), "damaged"),
    ]
    cases += [(["--data", shards, "--resume", str(d)], str(d / "state.npz"), "damaged")
              for d in damaged.values()]
    cases = [(t.argv[1:] + args, *needles) for args, *needles in cases] + t.bad_inputs(shards)
    for args, *needles in cases:
        with pytest.raises(SystemExit) as e:
            mod.main(base + args)
        assert str(e.value).startswith("error: ") and all(n in str(e.value) for n in needles), \
            (args, str(e.value))
    assert not out.exists()
    with pytest.raises(SystemExit, match="--eval-only needs"):  # refused before any weights are made
        mod.parse_args([*t.argv[1:], "--eval-only"])
    proc = run_script(*t.argv, "--data", bad / "magic_*.bin", "--model", "d12", *base, check=False,
                      env=env(name))
    assert_clean_error(proc, "magic")


def assert_same_steps(one, two, rel=1e-5):
    """A run's steps against another's: the same losses and grad norms within rel (the order of the
    cross-device sums differs)."""
    assert len(two) == len(one)
    for a, b in zip(one, two):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=rel)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel)


def test_jax_two_devices_match_one(trained, tiny_shards, tiny_model_file, tmp_path, env):
    """Two CPU devices (batch 2 each, same global batch), with the layers run as a lax.scan, give the
    one-device unrolled run's losses and grad norms (rel 1e-5: the order of the cross-device sums
    differs); --profile writes a trace and prints the traced steps' times."""
    out = tmp_path / "two"
    proc = run_script(*TRAINERS["jax"].argv, "--data", tiny_shards, "--init-from", tiny_model_file,
                      "--steps", 3, "--out-dir", out, "--ckpt-every", 0, "--val-every", 0,
                      "--hellaswag-every", 0, "--sample-every", 0, "--profile", "--scan-layers",
                      *TRAINERS["jax"].flags, "--batch-size", 2,
                      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", **env("jax")})
    assert "2 x cpu" in proc.stdout and "profile: steps 2-3" in proc.stdout
    assert glob.glob(str(out / "profile" / "**" / "*.trace.json.gz"), recursive=True)
    one = step_events(trained("jax")[0])[:3]
    assert_same_steps(one, step_events(out))


def test_torchfunc_two_processes_match_one(trained, tiny_shards, tiny_model_file, tmp_path, env):
    """torchrun with 2 CPU processes (gloo; rank-strided rows, one micro-batch each, the same global
    batch) gives the one-process losses and grad norms (rel 1e-5: only the order of the sums differs);
    only rank 0 writes; --profile writes a Chrome trace and prints the op table, and the ops split into
    forward, backward and optimizer step."""
    out = tmp_path / "two"
    proc = run_script("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                      *TRAINERS["torchfunc"].argv, "--data", tiny_shards, "--init-from", tiny_model_file,
                      "--steps", 3, "--out-dir", out, "--ckpt-every", 3, "--val-every", 0,
                      "--hellaswag-every", 0, "--sample-every", 0, "--profile", *TRAINERS["torchfunc"].flags,
                      env=env("torchfunc"))
    assert "2 x cpu" in proc.stdout and "1 micro-batches" in proc.stdout
    assert "profile: steps 2-3" in proc.stdout and "Self CPU" in proc.stdout
    # the phase table (eager on the CPU): forward, backward and optimizer step, each with its top ops;
    # the backward holds the weight-gradient matmuls; the norm, where it makes a phase's top rows (which
    # ops do depends on timings: a loaded machine shuffles the small ones), is in the optimizer step
    table = proc.stdout[proc.stdout.index("phase "):].splitlines()
    phases = {line.split()[0]: float(line.split()[-1].rstrip("%")) for line in table
              if line.split()[:1] in (["forward"], ["backward"], ["optimizer"]) and " all " in line}
    assert set(phases) == {"forward", "backward", "optimizer"}, table[:5]
    assert sum(phases.values()) == pytest.approx(100, abs=0.5) and min(phases.values()) > 0
    start = {line.split()[0]: i for i, line in enumerate(table) if " all " in line}
    assert any("aten::mm" in line for line in table[start["backward"]:start["optimizer"]])
    assert all(i > start["optimizer"] for i, line in enumerate(table) if "linalg_vector_norm" in line)
    assert glob.glob(str(out / "profile" / "trace_rank*.json"))
    assert proc.stdout.count("step     1/3") == 1
    one = step_events(trained("torchfunc")[0])[:3]
    assert_same_steps(one, step_events(out))
    with np.load(out / "ckpt_0000003" / "state.npz") as z:
        assert int(z["position"]) == 3 * TRAINERS["torchfunc"].batch[2]


def test_a_signal_to_one_process_stops_all_at_one_step(trained, tiny_shards, tiny_model_file, tmp_path, env):
    """torchrun, 2 CPU processes: SIGTERM to process 0 alone (as a scheduler may deliver it) stops both at
    the end of the same step, with the checkpoint of that step; the same launch without --resume is refused
    by process 0, and process 1 says so rather than calling process 0 lost; --resume auto by two processes
    then gives the one-process run's values (rel 1e-5, as above)."""
    out, t = tmp_path / "two", TRAINERS["torchfunc"]
    run = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    argv = [*t.argv, "--data", tiny_shards, "--steps", STEPS, "--out-dir", out, "--ckpt-every", 4,
            "--val-every", 0, "--hellaswag-every", 0, "--sample-every", 0, *t.flags]
    proc = run_script(*run, "tests/signal_at_step.py", 2, "SIGTERM", *argv, "--init-from", tiny_model_file,
                      env=env("torchfunc"), check=False)
    # torchrun reports its children's exit 143 with a traceback of its own; each child's is one line
    assert proc.returncode != 0 and proc.stderr.count("SIGTERM: stopped after step 3 of 6, its checkpoint") == 1
    assert "exitcode  : 143" in proc.stderr  # the first to end; torchrun may then end the other
    assert [e["step"] for e in step_events(out)] == [1, 2, 3]
    assert glob.glob(str(out / "ckpt_*")) == [str(out / "ckpt_0000003")]
    # launched again without --resume: process 0 refuses the out dir, process 1 says that it stops for that
    proc = run_script(*run, *argv, env=env("torchfunc"), check=False)
    assert proc.returncode != 0 and "already holds a run" in proc.stderr and "lost process" not in proc.stderr
    assert "error: process 1 of 2 stops: another process of the run refused to start" in proc.stderr
    run_script(*run, *argv, "--resume", "auto", env=env("torchfunc"))
    assert [e["step"] for e in step_events(out)] == list(range(1, STEPS + 1))
    assert_same_steps(step_events(trained("torchfunc")[0]), step_events(out))


@pytest.mark.parametrize("name", TRAINERS)
def test_divergence_stops_before_its_checkpoint(name, tiny_shards, tiny_model_file, tmp_path, env):
    """A run that diverges (--lr 1e8, no clipping: a non-finite loss or grad norm within 3 steps) stops with
    one line naming the step, exit non-zero, no traceback; the step is neither logged nor saved, so the
    latest checkpoint is the last finite one and holds finite values only."""
    out = tmp_path / "out"
    proc = run_script(*TRAINERS[name].argv, "--data", tiny_shards, "--init-from", tiny_model_file,
                      "--steps", 4, "--out-dir", out, "--ckpt-every", 1, "--val-every", 0,
                      "--hellaswag-every", 0, "--sample-every", 0, *TRAINERS[name].flags, "--lr", 1e8,
                      "--warmup", 0, "--grad-clip", 0, check=False, env=env(name))
    assert_clean_error(proc, "the run diverged")
    step = int(proc.stderr.strip().splitlines()[-1].split("step ")[1].split(":")[0])
    assert 2 <= step <= 3
    assert [e["step"] for e in step_events(out)] == list(range(1, step))
    latest = sorted(glob.glob(str(out / "ckpt_*")))[-1]
    assert latest.endswith(f"ckpt_{step - 1:07d}") and f"{latest} stays the latest" in proc.stderr
    with np.load(os.path.join(latest, "state.npz")) as z:
        assert all(np.isfinite(z[k]).all() for k in z.files if k[:2] in ("m.", "v."))


@pytest.mark.parametrize("name", TRAINERS)
def test_a_non_finite_grad_norm_alone_stops_the_run(name, tiny_shards, tmp_path, env):
    """A finite loss with a non-finite grad norm: one MLP unit of block 0 biased to 1e20. GELU passes it on
    as 1e20 (its tanh saturates at 1), block 1's and the final layer norms scale it back, so the loss stays
    finite; but GELU's derivative there is 0 x inf (1 - tanh^2 is 0, 1 + 3 * 0.044715 x^2 overflows), so the
    gradients behind it are NaN. The run stops at step 1 with one line that gives both, logging nothing."""
    params = tiny_params(seed=0)
    params[PARAM_NAMES.index("c_fc.b")][0, 0] = 1e20
    model = tmp_path / "huge_unit.bin"
    write_model_file(model, params, block_size=64, n_layer=2, n_head=4, n_embd=64)
    out = tmp_path / "out"
    proc = run_script(*TRAINERS[name].argv, "--data", tiny_shards, "--init-from", model, "--steps", 2,
                      "--out-dir", out, "--ckpt-every", 1, "--val-every", 0, "--hellaswag-every", 0,
                      "--sample-every", 0, *TRAINERS[name].flags, check=False, env=env(name))
    assert_clean_error(proc, "step 1: loss", "the run diverged")
    loss, norm = re.match(r"error: step 1: loss (\S+), grad norm (\S+):", proc.stderr.strip().splitlines()[-1]).groups()
    assert math.isfinite(float(loss)) and not math.isfinite(float(norm))
    assert step_events(out) == [] and not glob.glob(str(out / "ckpt_*"))


@pytest.mark.parametrize("name", TRAINERS)
def test_signals_stop_at_a_step_boundary_and_resume_is_exact(name, trained, tiny_shards, tiny_model_file,
                                                             tmp_path, env):
    """SIGINT, then SIGTERM in the resumed run: each stops the run at the end of the step it landed in,
    with a checkpoint, one line and exit 128 + its number; --resume auto then logs the uninterrupted 6-step
    run's train losses, grad norms and lrs bit for bit. (The speedrun recipe: tests/test_speedrun_*.py.)"""
    t, out = TRAINERS[name], tmp_path / "out"
    argv = [*t.argv, "--data", tiny_shards, "--steps", STEPS, "--out-dir", out, "--ckpt-every", 3,
            "--val-every", 0, "--hellaswag-every", 0, "--sample-every", 0, *t.flags]
    got = stop_by_signals_and_resume(argv, ["--init-from", tiny_model_file], out, env(name))
    assert_same_step_values(got, step_events(trained(name)[0]))


def test_a_second_signal_stops_at_once(trained, tiny_shards, tiny_model_file, tmp_path, env):
    """Two Ctrl-Cs just after step 2 is logged: the second stops the run at once, before step 2's
    checkpoint, still with one line and no traceback; --resume auto then continues from step 1's and logs
    the uninterrupted run's values (step 2 twice: the later line counts, docs/FORMATS.md). The handlers
    are in the section the trainers share."""
    name, out = "triton-torch", tmp_path / "out"
    t = TRAINERS[name]
    argv = [*t.argv, "--data", tiny_shards, "--steps", STEPS, "--out-dir", out, "--ckpt-every", 1,
            "--val-every", 0, "--hellaswag-every", 0, "--sample-every", 0, *t.flags]
    proc = run_script("tests/signal_at_step.py", 2, "SIGINT,SIGINT", *argv, "--init-from", tiny_model_file,
                      env=env(name), check=False)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = "SIGINT: stopped at once; --resume auto continues from the latest checkpoint"
    assert proc.stderr.strip().splitlines()[-1] == said
    assert sorted(os.listdir(out / "ckpt_0000001")) and not (out / "ckpt_0000002").exists()
    run_script(*argv, "--resume", "auto", env=env(name))
    got = step_events(out)
    assert [e["step"] for e in got] == [1, 2, 2, 3, 4, 5, 6]
    assert_same_step_values(got[:1] + got[2:], step_events(trained(name)[0]))


def test_a_closed_stdout_does_not_stop_the_run(trained, tiny_shards, tiny_model_file, tmp_path, env):
    """`trainer ... | head -1`: stdout's reader goes away after the first line; the run trains on to its
    end (exit 0, no traceback) and log.jsonl holds the uninterrupted run's steps bit for bit. The streams
    are wrapped in the section the trainers share."""
    name, out = "triton-torch", tmp_path / "out"
    t = TRAINERS[name]
    argv = [*t.argv, "--data", tiny_shards, "--init-from", tiny_model_file, "--steps", STEPS, "--out-dir", out,
            "--ckpt-every", 3, "--val-every", 0, "--hellaswag-every", 0, "--sample-every", 0, *t.flags]
    proc = subprocess.Popen([sys.executable, *map(str, argv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **env(name)), cwd=REPO)
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=600) == 0 and "Traceback" not in err and "Broken" not in err, err[-3000:]
    assert_same_step_values(step_events(out), step_events(trained(name)[0]))
