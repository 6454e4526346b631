"""What the GPT-2 trainers never lose, in all three: a second fresh run into an --out-dir that holds one
is refused (--force moves the old run aside, into a folder of its own however fast --force runs follow
each other), a live run locks its --out-dir against a second one, an unwritable --out-dir and a full
disk during a checkpoint are one line (the partial checkpoint removed, the earlier ones intact, --resume
auto then continues exactly), a crafted state.npz is refused field by field, --resume auto says what it
skips, running out of device memory is one line that names the way out (and a run beyond the host's
memory on the CPU is warned at its start), a signal's line points at --resume only where it can continue,
one that stops at once exits 128 + its number even mid-compile, and the val loss of the same weights is the
same on 1, 2 and 4 devices or processes and in every trainer."""
import datetime
import errno
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

import hellaswag
import train_gpt2_jax as tj
import train_gpt2_torchfunc as tf
import train_gpt2_triton as tg
from conftest import (assert_clean_error, read_log, run_script, run_script_on_a_full_disk, signal_after_line,
                      step_events, write_shard)
from train_gpt2_jax import RunLock, latest_checkpoint, load_checkpoint, read_weights, save_checkpoint
from train_gpt2_jax import find_shards
from train_gpt2_jax import StopSignals, stops_on_signals

MODULES = {"jax": tj, "torchfunc": tf, "triton": tg}
SCRIPTS = {"jax": ["train_gpt2_jax.py"], "torchfunc": ["train_gpt2_torchfunc.py"],
           "triton": ["train_gpt2_triton.py", "torch"]}
ARGV = {"jax": [], "torchfunc": [], "triton": ["torch"]}
ENV = {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
# a micro model on random tokens: one step in a second or two, a checkpoint of 6.5 MB (model.bin) and
# 13 MB (state.npz)
MICRO = ["--data", "synthetic", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "16",
         "--batch-size", "2", "--total-batch-size", "32", "--dtype", "fp32", "--val-every", "0",
         "--hellaswag-every", "0", "--sample-every", "0", "--lr", "1e-3", "--warmup", "1"]


@pytest.mark.parametrize("name", MODULES)
def test_a_run_is_never_overwritten(name, tmp_path, capsys, monkeypatch, hellaswag_dir):
    """A fresh run (no --resume) into an --out-dir that holds a run stops with one line naming --resume
    auto and --force, and leaves the old run as it was; --force moves the old run's log and checkpoints
    into a replaced_<time> folder, so that the new log.jsonl holds one run. An unwritable --out-dir is one
    line. A run without val shards says in one line that it skips the val loss, when training with
    --val-every and with --eval-only (which still scores HellaSwag, and says it writes log.jsonl alone)."""
    mod, out = MODULES[name], tmp_path / "run"
    argv = [*ARGV[name], *MICRO, "--steps", "2", "--ckpt-every", "2", "--out-dir", str(out)]
    mod.main([*argv, "--val-every", "1"])
    said = "no validation shards in --data synthetic (give --val-data GLOB): val loss skipped"
    assert said in capsys.readouterr().out.splitlines()
    before = (out / "log.jsonl").read_text()
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert str(e.value).startswith(f"error: --out-dir {out} already holds a run")
    assert "--resume auto" in str(e.value) and "--force" in str(e.value) and "\n" not in str(e.value)
    assert (out / "log.jsonl").read_text() == before and sorted(os.listdir(out)) == ["ckpt_0000002",
                                                                                     "log.jsonl"]
    mod.main([*argv, "--force", "--steps", "1", "--ckpt-every", "0"])
    assert f"--force: the run in {out} moved to" in capsys.readouterr().out
    assert [e["step"] for e in read_log(out)] == [1]
    aside, = out.glob("replaced_*")
    assert sorted(os.listdir(aside)) == ["ckpt_0000002", "log.jsonl"]
    assert (aside / "log.jsonl").read_text() == before
    monkeypatch.setattr(hellaswag, "DEFAULT_CACHE_DIR", str(hellaswag_dir))
    mod.main([*ARGV[name], *MICRO, "--eval-only", "--hellaswag-every", "1", "--hellaswag-limit", "2",
              "--out-dir", str(tmp_path / "eval"), "--init-from", str(aside / "ckpt_0000002" / "model.bin")])
    printed = capsys.readouterr().out.splitlines()
    assert said in printed and f"out dir {tmp_path / 'eval'}: log.jsonl" in printed  # it writes no checkpoint
    logged = read_log(out) + read_log(aside) + read_log(tmp_path / "eval")
    assert not any("val_loss" in e for e in logged) and any("hellaswag_acc" in e for e in logged)
    with pytest.raises(SystemExit) as e:  # nothing can be created under /proc, root or not
        mod.main([*ARGV[name], *MICRO, "--steps", "1", "--out-dir", "/proc/no_such_run"])
    assert str(e.value) == "error: /proc/no_such_run: No such file or directory"
    assert "\n" not in str(e.value)


def test_a_full_disk_during_a_checkpoint(tmp_path):
    """(The Triton trainer's backend torch: save_checkpoint and write_failure are the same code in all three
    trainers, tests/test_siblings.py.) A checkpoint that meets a full disk (here every file limited to 8
    MB: model.bin fits, state.npz does not) ends the run with one line naming it and saying the disk is
    full; nothing of it is left, the earlier checkpoint is intact, and --resume auto then continues from
    it: step 2 is logged again with the same numbers (the later of the two counts, as plot_runs.py reads a
    log)."""
    name, out = "triton", tmp_path / "run"
    MODULES[name].main([*ARGV[name], *MICRO, "--ckpt-every", "1", "--steps", "1", "--out-dir", str(out)])
    first = {p.name: p.read_bytes() for p in (out / "ckpt_0000001").iterdir()}
    args = [*SCRIPTS[name], *MICRO, "--ckpt-every", "1", "--steps", "2", "--out-dir", out, "--resume", "auto"]
    proc = run_script_on_a_full_disk(8 << 20, *args, env=ENV)
    assert_clean_error(proc, f"cannot write {out / 'ckpt_0000002.tmp'}", "no space left, the disk is full")
    assert sorted(os.listdir(out)) == ["ckpt_0000001", "log.jsonl"]
    assert {p.name: p.read_bytes() for p in (out / "ckpt_0000001").iterdir()} == first
    run_script(*args, env=ENV)
    timing = {"dt_ms", "tokens_per_s", "mfu", "peak_mem_gb"}
    events = [{k: v for k, v in e.items() if k not in timing} for e in step_events(out)]
    assert [e["step"] for e in events] == [1, 2, 2] and events[1] == events[2]
    assert os.path.isfile(out / "ckpt_0000002" / "state.npz")


def test_a_full_disk_during_a_log_append(tmp_path):
    """(log_event is the same code in all three trainers.) The log meeting a full disk (every file limited
    to 2 KB: the start event and about four step events) ends the run with one line naming log.jsonl and
    saying the disk is full; the lines before the failed append are whole events (the half line it left
    is what check_log cuts off when the run resumes)."""
    out = tmp_path / "run"
    args = [*SCRIPTS["triton"], *MICRO, "--ckpt-every", "0", "--steps", "20", "--out-dir", out]
    proc = run_script_on_a_full_disk(2048, *args, env=ENV)
    assert_clean_error(proc, f"cannot write {out / 'log.jsonl'}", "no space left, the disk is full")
    data = (out / "log.jsonl").read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    assert len(data) == 2048 and not data.endswith(b"\n")  # the failed append's half line
    steps = [json.loads(line)["step"] for line in complete.splitlines()][1:]  # after the start event
    assert steps == list(range(1, len(steps) + 1)) and steps


@pytest.mark.parametrize("name", MODULES)
def test_out_of_device_memory_is_one_line(name):
    """Device memory running out (XLA's RESOURCE_EXHAUSTED, torch's OutOfMemoryError) is one line naming the
    micro-batch and the level, with the cheaper levels as a way out while one is left; another runtime
    error passes through."""
    mod = MODULES[name]
    oom = (jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 2147483648 bytes.\nmore")
           if name == "jax" else torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"))
    first = str(oom).splitlines()[0]
    for level, hint in [("none", " or a cheaper --recompute"), ("pointwise", " or a cheaper --recompute"),
                        ("block", "")]:
        cfg = mod.Config(batch_size=16, recompute=level)
        with pytest.raises(SystemExit) as e, mod.fail_on_out_of_memory(cfg):
            raise oom
        assert str(e.value) == (f"error: out of device memory at --batch-size 16 --recompute {level} (try a "
                                f"smaller batch{hint}): {first}")
    other = jax.errors.JaxRuntimeError("INTERNAL: something else") if name == "jax" else RuntimeError("else")
    with pytest.raises(type(other)), mod.fail_on_out_of_memory(mod.Config()):
        raise other


@pytest.mark.parametrize("name", MODULES)
def test_a_run_beyond_the_hosts_memory_is_warned(name, tmp_path, capsys, monkeypatch):
    """On the CPU, where running out of memory is the kernel's silent kill, a run whose accounted state and
    activations on all its devices exceed the host's available memory says so in one line at the start;
    one that fits, or where the host's memory is unknown, says nothing."""
    mod = MODULES[name]
    held = {"params": 1e9, "grads": 2e9, "masters": 2e9, "moments": 4e9}
    assert mod.memory_warning(held, 3e9, 2, 24e9) is None and mod.memory_warning(held, 3e9, 2, None) is None
    assert mod.memory_warning(held, 3e9, 2, 23.9e9) == (
        "warning: by the accounting above, 2 device(s) need 24.0 GB and this host has 23.9 GB available: the "
        "kernel may kill the run (try a smaller --batch-size or a cheaper --recompute)")
    if os.path.exists("/proc/meminfo"):  # Linux: the host's figure is read
        assert 0 < mod.host_memory_available() < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    argv = [*ARGV[name], *MICRO, "--steps", "1", "--ckpt-every", "0"]
    mod.main([*argv, "--out-dir", str(tmp_path / "fits")])
    assert "warning: by the accounting" not in capsys.readouterr().out
    monkeypatch.setattr(mod, "host_memory_available", lambda: 1000)
    mod.main([*argv, "--out-dir", str(tmp_path / "short")])
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: by the")]
    assert len(warned) == 1 and warned[0].endswith("this host has 0.0 GB available: the kernel may kill the "
                                                   "run (try a smaller --batch-size or a cheaper --recompute)")


def test_a_signal_says_what_resume_can_do(capfd, monkeypatch):
    """A signal before training (startup, --eval-only, --test, --bench-ops) stops at once without pointing
    at --resume, which has nothing of the launch to continue; during training the first asks for the end
    of the step and the second stops at once, pointing at --resume auto. Exit 128 + the signal's number."""
    monkeypatch.setattr(os, "_exit", lambda code: sys.exit(code))  # the handler's exit, here an exception
    signals = StopSignals()
    with pytest.raises(SystemExit) as e:
        signals.handle(signal.SIGTERM, None)
    assert e.value.code == 143 and capfd.readouterr().err == "SIGTERM: stopped at once\n"
    signals.training = True
    signals.handle(signal.SIGINT, None)
    assert signals.received == signal.SIGINT
    with pytest.raises(SystemExit) as e:
        signals.handle(signal.SIGINT, None)
    assert e.value.code == 130 and capfd.readouterr().err.splitlines() == [
        "SIGINT: stopping at the end of this step, with a checkpoint (SIGINT again stops at once)",
        "SIGINT: stopped at once; --resume auto continues from the latest checkpoint"]


@pytest.mark.parametrize("signum, delay", [(signal.SIGTERM, 0.2), (signal.SIGINT, 1.0)])
def test_a_signal_while_the_train_step_compiles_exits_128_plus_its_number(tmp_path, signum, delay):
    """SIGINT or SIGTERM while XLA compiles the JAX trainer's train step (seconds for 2 layers on a CPU)
    stops it at once with exit 128 + the signal's number, not a segfault (139) of the interpreter's
    teardown under the compile the signal cut short."""
    args = [*SCRIPTS["jax"], *MICRO, "--n-layer", "2", "--steps", "3", "--out-dir", tmp_path / "out"]
    env = {**ENV, "JAX_LOG_COMPILES": "1"}  # its lines say when the XLA compile starts
    code, output = signal_after_line(args, "to MLIR module conversion jit(train_step)", delay, signum, env=env)
    assert code == 128 + signum and output.strip().splitlines()[-1] == f"{signum.name}: stopped at once", output


def test_a_stop_at_once_in_a_gc_callback_is_not_lost(capfd, monkeypatch):
    """A signal handled while a gc callback runs (JAX has one) still stops the run at once: an exception
    raised there would be swallowed, and the run would go on."""
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)

    def stop(phase, info):  # at the collection's start (and not again at its stop)
        if phase == "start":
            StopSignals().handle(signal.SIGTERM, None)
    gc.callbacks.append(stop)  # the list the collector holds: a new one would not be called
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(stop)
    assert exits == [143] and capfd.readouterr().err == "SIGTERM: stopped at once\n"


def test_checkpoint_fields_are_checked(tmp_path, capsys):
    """A state.npz whose step, shard, position or seed is out of range (a negative step would train with
    a negative learning rate) or not an integer scalar, whose time_spent is not seconds (a float in
    [0, inf)), or whose config is not a JSON object, is refused with one line naming the field; one
    written before time_spent was kept has spent none; --resume auto says in one line that it skips a
    newer checkpoint that lacks its state.npz."""
    mod = tj  # its Config and RECIPES; the checks are the shared plumbing's
    cfg = mod.Config(n_layer=1, n_head=1, n_embd=4, block_size=4, vocab_size=8, padded_vocab_size=8)
    zeros = {k: np.zeros(shape, np.float32) for k, shape in mod.param_shapes(cfg).items()}
    good = Path(save_checkpoint(str(tmp_path / "good"), 3, zeros, zeros, zeros, (0, 0), cfg))
    with np.load(good / "state.npz") as z:
        fields = dict(z)
    cases = {"step": np.int64(-4), "shard": np.int64(-1), "position": np.int64(-1), "seed": np.int64(-7)}
    cases = [(k, v, "out of range") for k, v in cases.items()]
    cases += [("step", np.float64(3.0), "not an integer"), ("position", np.arange(2), "not an integer"),
              ("time_spent", np.float64(np.nan), "not seconds in [0, inf)"), ("time_spent", np.int64(3), "int64 3")]
    for field, value, needle in cases:
        bad = tmp_path / f"{field}_{needle.split()[0]}" / "ckpt_0000003"
        bad.mkdir(parents=True)
        (bad / "model.bin").write_bytes((good / "model.bin").read_bytes())
        np.savez(bad / "state.npz", **{**fields, field: value})
        with pytest.raises(SystemExit) as e:
            load_checkpoint(str(bad), cfg)
        message = str(e.value)
        assert message.startswith(f"error: checkpoint {bad / 'state.npz'}: {field} ") and needle in message
    for config in ("[1, 2]", "3"):  # JSON, but not the object of flags a run writes
        bad = tmp_path / f"config_{config[0]}" / "ckpt_0000003"
        bad.mkdir(parents=True)
        (bad / "model.bin").write_bytes((good / "model.bin").read_bytes())
        np.savez(bad / "state.npz", **{**fields, "config": np.array(config)})
        with pytest.raises(SystemExit, match=r"^error: checkpoint .*state\.npz is damaged \(AttributeError"):
            load_checkpoint(str(bad), cfg)
    old = tmp_path / "old" / "ckpt_0000003"  # written before time_spent was kept: no time spent
    old.mkdir(parents=True)
    (old / "model.bin").write_bytes((good / "model.bin").read_bytes())
    np.savez(old / "state.npz", **{k: v for k, v in fields.items() if k != "time_spent"})
    assert fields["time_spent"] == 0 and load_checkpoint(str(old), cfg)[4]["time_spent"] == 0
    (tmp_path / "good" / "ckpt_0000004").mkdir()
    assert latest_checkpoint(str(tmp_path / "good")) == str(good)
    said = capsys.readouterr().out.splitlines()
    assert said == [f"--resume auto: skipping {tmp_path / 'good' / 'ckpt_0000004'}, which has no state.npz"]


def test_val_loss_is_the_same_on_any_device_count(tiny_shards, tiny_model_file, hellaswag_dir, tmp_path,
                                                  monkeypatch):
    """The same weights give the same val loss (the first --val-tokens // T sequences of the val shard:
    here 25 rows of 32 tokens, which no global batch below divides) on 1, 2 and 4 JAX devices, in 1 and
    2 torch processes, at several batch sizes, and in every trainer: to float rounding (1e-6). The
    one-device runs run here, the others as scripts; the two torch trainers' evaluate_val is one code
    (tests/test_siblings.py), so torchfunc's two processes stand for both."""
    common = ["--data", tiny_shards, "--init-from", tiny_model_file, "--eval-only", "--seq-len", 32,
              "--total-batch-size", 128, "--val-tokens", 800, "--hellaswag-limit", 1, "--dtype", "fp32"]
    monkeypatch.setattr(hellaswag, "DEFAULT_CACHE_DIR", str(hellaswag_dir))
    devices = "--xla_force_host_platform_device_count="
    launch2 = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    runs = {("jax", 1): (None, 4, {}), ("jax", 2): ([], 2, {"XLA_FLAGS": devices + "2"}),
            ("jax", 4): ([], 1, {"XLA_FLAGS": devices + "4"}), ("torchfunc", 1): (None, 2, {}),
            ("torchfunc", 2): (launch2, 1, {}), ("triton", 1): (None, 4, {})}
    losses = {}
    for (name, count), (launch, batch, extra) in runs.items():
        out = tmp_path / f"{name}_{count}"
        args = [*common, "--batch-size", batch, "--out-dir", out]
        if launch is None:
            MODULES[name].main([*ARGV[name], *map(str, args)])
        else:
            env = {**ENV, "HELLASWAG_DIR": str(hellaswag_dir), **extra}
            run_script(*launch, *SCRIPTS[name], *args, env=env)
        losses[name, count], = (e["val_loss"] for e in read_log(out) if "val_loss" in e)
    first = losses["jax", 1]
    assert all(v == pytest.approx(first, rel=1e-6) for v in losses.values()), losses


def test_force_at_the_edges(tmp_path, capsys, monkeypatch):
    """(prepare_out_dir is the same code in all three trainers.) --force never collides with an earlier
    replaced_<time> folder (two --force runs in one second), and a --force whose move fails (here a full
    disk) is one line."""
    mod, out = tf, tmp_path / "run"
    argv = [*MICRO, "--steps", "1", "--ckpt-every", "0", "--out-dir", str(out), "--force"]
    mod.main(argv)
    now = datetime.datetime.now()
    for s in range(4):  # the names of this second's and the next ones' --force runs are taken
        (out / f"replaced_{now + datetime.timedelta(seconds=s):%Y%m%d_%H%M%S}").mkdir()
    mod.main(argv)
    assert f"--force: the run in {out} moved to {out}/replaced_" in capsys.readouterr().out
    assert len(list(out.glob("replaced_*"))) == 5 and [e["step"] for e in read_log(out)] == [1]
    mkdir = os.mkdir

    def full(path, *args, **kwargs):
        if "replaced_" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return mkdir(path, *args, **kwargs)
    monkeypatch.setattr(os, "mkdir", full)
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert str(e.value).startswith("error: cannot write ") and "the disk is full" in str(e.value)
    assert "\n" not in str(e.value) and [e["step"] for e in read_log(out)] == [1]


def test_one_live_run_per_out_dir(tmp_path):
    """A run holds its --out-dir for its life (flock on <out_dir>/.lock, naming its pid and host): a second
    run there, even with --force, is refused in one line naming the holder and moves nothing; once the
    holder is killed, its .lock blocks nothing (the kernel dropped the flock); a run that ends removes its
    .lock."""
    out = tmp_path / "run"
    args = [*SCRIPTS["torchfunc"], *MICRO, "--steps", "100000", "--ckpt-every", "0", "--out-dir", out]
    holder = subprocess.Popen([sys.executable, *map(str, args)], cwd=Path(tf.__file__).parent,
                              env={**os.environ, **ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not (out / "log.jsonl").exists():
            assert holder.poll() is None and time.time() < deadline, holder.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        with pytest.raises(SystemExit) as e:
            tf.main([*MICRO, "--steps", "2", "--out-dir", str(out), "--force"])
        message = str(e.value)
        assert message.startswith(f"error: --out-dir {out} is in use by another run (pid {holder.pid} on "
                                  f"{socket.gethostname()})") and "\n" not in message
        assert not list(out.glob("replaced_*")) and (out / "log.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert (out / ".lock").exists()  # a SIGKILL leaves the file, not the flock
    tf.main([*MICRO, "--steps", "1", "--ckpt-every", "0", "--out-dir", str(out), "--force"])
    assert [e["step"] for e in read_log(out)] == [1] and not (out / ".lock").exists()


def test_a_lock_that_is_not_a_file_is_one_line(tmp_path):
    """An out dir whose .lock is a directory, a FIFO, a dangling symbolic link or a link to another file is
    refused in one line naming it, and the file a link points to is left as it was (it once received the
    holder's pid); a lock that cannot be written (a read-only .lock, full disk) is one line too."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    makers = {"directory": lambda p: p.mkdir(), "FIFO": lambda p: os.mkfifo(p),
              "dangling": lambda p: p.symlink_to(tmp_path / "nowhere"), "link": lambda p: p.symlink_to(target)}
    loop = ": Too many levels of symbolic links"  # O_NOFOLLOW's word for a link
    reasons = {"directory": ": Is a directory", "FIFO": " is not a regular file, not the run lock that a trainer "
               "writes: remove it", "dangling": loop, "link": loop}
    for name, make in makers.items():
        out = tmp_path / name
        out.mkdir()
        make(out / ".lock")
        with pytest.raises(SystemExit) as e:  # through the trainers' boundary for the operating system's errors
            stops_on_signals(lambda argv, signals: RunLock(str(out)))()
        message = str(e.value)
        assert message == f"error: {out / '.lock'}{reasons[name]}", (name, message)
    assert target.read_text() == "keep me\n"
    proc = run_script(*SCRIPTS["jax"], *MICRO, "--steps", "1", "--out-dir", tmp_path / "link", env=ENV,
                      check=False)
    assert_clean_error(proc, ".lock: Too many levels of symbolic links")
    assert target.read_text() == "keep me\n"


def test_paths_with_glob_characters(tmp_path):
    """An out dir or a --data directory whose name holds glob characters ([, ], *, ?) is a name, not a
    pattern: --resume auto finds its checkpoints, --force moves all of the old run aside, the data
    directory's shards are found."""
    out = tmp_path / "run[a]*?"
    args = [*SCRIPTS["jax"], *MICRO, "--ckpt-every", "1", "--out-dir", out]
    run_script(*args, "--steps", "1", env=ENV)
    assert latest_checkpoint(str(out)) == str(out / "ckpt_0000001")
    run_script(*args, "--steps", "2", "--resume", "auto", env=ENV)
    assert latest_checkpoint(str(out)) == str(out / "ckpt_0000002")
    run_script(*args, "--steps", "1", "--force", env=ENV)
    aside = [p for p in out.iterdir() if p.name.startswith("replaced_")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == [
        "ckpt_0000001", "ckpt_0000002", "log.jsonl"]
    shards = tmp_path / "shards[1]"
    shards.mkdir()
    for split in ("train", "val"):
        write_shard(shards / f"t_{split}_000000.bin", np.arange(4096) % 50257)
    cfg = tj.Config(data=str(shards))
    train, val = find_shards(cfg)
    assert train == [str(shards / "t_train_000000.bin")] and val == [str(shards / "t_val_000000.bin")]


def test_val_shards_are_read_only_where_the_val_loss_is_taken(tmp_path):
    """(make_loaders is the same code in all three trainers.) A val shard shorter than one batch is refused
    in one line where the val loss is taken (--val-every, --eval-only), and with --val-every 0, which never
    validates (nor at the run's end), it is left unread."""
    write_shard(tmp_path / "t_train_000001.bin", np.arange(5000) % 50257)
    write_shard(tmp_path / "t_val_000000.bin", np.arange(100) % 50257)
    cfg, _ = tj.parse_args(["--data", str(tmp_path), "--seq-len", "64", "--batch-size", "4", "--total-batch-size",
                            "256", "--val-every", "0"])
    _, train, val = tj.make_loaders(cfg, 4, 0, 1, (0, 0), print)
    assert train.files == [str(tmp_path / "t_train_000001.bin")] and val is None
    assert not tj.due(cfg.val_every, cfg.steps, cfg.steps)
    for taken in ({"val_every": 1}, {"eval_only": True}):
        with pytest.raises(SystemExit, match="t_val_000000.bin holds fewer than 257 tokens, one batch needs that"):
            tj.make_loaders(replace(cfg, **taken), 4, 0, 1, (0, 0), print)


def test_a_model_path_that_is_no_file_says_what_it_is(tmp_path):
    """--init-from (and convert_hf.py to-hf) given a checkpoint directory points at its model file; a plain
    directory, a FIFO, a device, a symbolic link loop and a missing path each get a line saying which."""
    cfg = tj.Config(n_layer=1, n_head=1, n_embd=4, block_size=4, vocab_size=8, padded_vocab_size=8)
    zeros = {k: np.zeros(shape, np.float32) for k, shape in tj.param_shapes(cfg).items()}
    ckpt = save_checkpoint(str(tmp_path), 1, zeros, zeros, zeros, (0, 0), cfg)
    (tmp_path / "plain").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    cases = {ckpt: f"is not a regular file: a checkpoint directory; give its {ckpt}/model.bin, or "
                   f"--resume {ckpt}",
             str(tmp_path / "plain"): "is not a regular file",
             str(tmp_path / "fifo"): "is not a regular file",
             "/dev/zero": "is not a regular file",
             str(tmp_path / "loop"): ": Too many levels of symbolic links",
             str(tmp_path / "missing.bin"): ": No such file or directory"}
    for path, needle in cases.items():
        with pytest.raises(SystemExit) as e:
            read_weights(path, cfg)
        assert str(e.value) == f"error: model file {path}{'' if needle[0] == ':' else ' '}{needle}", str(e.value)
    proc = run_script(*SCRIPTS["jax"], *MICRO, "--init-from", ckpt, "--out-dir", tmp_path / "out", env=ENV,
                      check=False)
    assert_clean_error(proc, "a checkpoint directory; give its")
    proc = run_script("convert_hf.py", "to-hf", ckpt, "-o", tmp_path / "hf", env=ENV, check=False)
    assert_clean_error(proc, "a checkpoint directory; give its")


def out_dir_state(out):
    """{path under out: file bytes, or None for a folder}: what a refused run must leave as it was."""
    return {str(p.relative_to(out)): None if p.is_dir() else p.read_bytes() for p in sorted(out.rglob("*"))}


def test_resume_branches_never_splice_logs(tmp_path, capsys):
    """(resolve_resume and prepare_out_dir are the same code in all three trainers.) --resume auto in an out
    dir with a log but no checkpoint (a run killed before its first, which a scheduler requeues) starts at
    step 0, moving that log into replaced_<time>, in one line. A resume that trains nothing moves nothing; one
    that trains on from an earlier checkpoint moves the newer ones and their log lines into abandoned_<time>.
    Refused in one line, moving nothing: a checkpoint whose name disagrees with its step (even the newest,
    for --resume auto), one of a branch set aside there, one of another out dir into an out dir holding a
    run; the set-aside branch resumes into a new out dir. Each log holds one branch."""
    mod, out, other = tg, tmp_path / "run", tmp_path / "other"
    argv = [*ARGV["triton"], *MICRO, "--ckpt-every", "2"]
    out.mkdir()
    killed = '{"step": 1, "train_loss": 10.9}\n{"step": 2, "train_lo'
    (out / "log.jsonl").write_text(killed)
    mod.main([*argv, "--steps", "4", "--out-dir", str(out), "--resume", "auto"])
    aside, = out.glob("replaced_*")
    said = (f"--resume auto: no checkpoint in {out}, starting at step 0; the run there, stopped before its "
            f"first checkpoint, moved to {aside}")
    assert said in capsys.readouterr().out.splitlines()
    assert os.listdir(aside) == ["log.jsonl"] and (aside / "log.jsonl").read_text() == killed
    assert [e["step"] for e in step_events(out)] == [1, 2, 3, 4] and read_log(out, starts=True)[0]["step"] == 0

    before, logged = out_dir_state(out), read_log(out)
    mod.main([*argv, "--steps", "2", "--out-dir", str(out), "--resume", str(out / "ckpt_0000002")])
    assert "nothing to train" in capsys.readouterr().out and read_log(out) == logged  # a start event added
    before.pop("log.jsonl")
    assert {k: v for k, v in out_dir_state(out).items() if k != "log.jsonl"} == before
    before = out_dir_state(out)
    os.rename(out / "ckpt_0000004", out / "ckpt_0000008")
    os.symlink(out / "ckpt_0000002", out / "ckpt_0000006")
    for resume, step, name in (("auto", 4, 8), (str(out / "ckpt_0000006"), 2, 6)):
        with pytest.raises(SystemExit) as e:
            mod.main([*argv, "--steps", "9", "--out-dir", str(out), "--resume", resume])
        assert str(e.value) == (f"error: checkpoint {out / f'ckpt_{name:07d}'} holds step {step}, not the step "
                                f"{name} its name says (renamed or copied by hand?): name it "
                                f"ckpt_{step:07d} elsewhere, or remove it")
    os.remove(out / "ckpt_0000006")
    os.rename(out / "ckpt_0000008", out / "ckpt_0000004")
    assert out_dir_state(out) == before

    mod.main([*argv, "--steps", "3", "--out-dir", str(out), "--resume", str(out / "ckpt_0000002")])
    branch, = out.glob("abandoned_*")
    assert sorted(os.listdir(branch)) == ["ckpt_0000004", "log.jsonl"]
    assert [e["step"] for e in step_events(branch)] == [3, 4] and [e["step"] for e in step_events(out)] == [1, 2, 3]
    mod.main([*argv, "--steps", "5", "--out-dir", str(other), "--resume", str(branch / "ckpt_0000004")])
    assert [e["step"] for e in step_events(other)] == [5]
    before = out_dir_state(out)
    for ckpt, whose in ((branch / "ckpt_0000004", f"a branch set aside in {branch}"),
                        (other / "ckpt_0000005", "another out dir")):
        with pytest.raises(SystemExit) as e:
            mod.main([*argv, "--steps", "6", "--out-dir", str(out), "--resume", str(ckpt)])
        assert str(e.value) == (f"error: --resume {ckpt}: a checkpoint of {whose}, and --out-dir {out} holds "
                                "another run (ckpt_0000002, ckpt_0000003, log.jsonl), whose log.jsonl would then "
                                "hold both: resume it into a new --out-dir")
    assert out_dir_state(out) == before


def test_checkpoints_that_cannot_resume_are_no_absent_run(tmp_path, capsys):
    """--resume auto where no checkpoint can resume, yet some are there (each pruned of its state.npz to save
    space; the translator pointed at a GPT-2 out dir) says in one line what the newest holds and moves
    nothing: only an out dir without checkpoints starts over. (latest_checkpoint is the same code in every
    trainer.)"""
    import train_aiayn_jax as aiayn
    out = tmp_path / "run"
    cfg = tj.Config(n_layer=1, n_head=1, n_embd=4, block_size=4, vocab_size=8, padded_vocab_size=8)
    zeros = {k: np.zeros(shape, np.float32) for k, shape in tj.param_shapes(cfg).items()}
    for step in (1, 2, 3):
        save_checkpoint(str(out), step, zeros, zeros, zeros, (0, 0), cfg)
    (out / "log.jsonl").write_text('{"step": 1, "train_loss": 5.0}\n')
    before = out_dir_state(out)
    with pytest.raises(SystemExit) as e:
        aiayn.main(["--resume", "auto", "--out-dir", str(out)])
    assert str(e.value) == (f"error: --resume auto: no checkpoint in {out} holds params.npz, state.npz, "
                            f"tokenizer.bpe (pruned? another trainer's?): its newest, {out / 'ckpt_0000003'}, "
                            "holds model.bin, state.npz; --force alone starts over")
    assert out_dir_state(out) == before
    for step in (1, 2, 3):
        os.remove(out / f"ckpt_{step:07d}" / "state.npz")
    before = out_dir_state(out)
    with pytest.raises(SystemExit) as e:
        tj.main([*MICRO, "--steps", "4", "--out-dir", str(out), "--resume", "auto"])
    assert str(e.value).startswith(f"error: --resume auto: no checkpoint in {out} holds state.npz (pruned? "
                                   f"another trainer's?): its newest, {out / 'ckpt_0000003'}, holds model.bin;")
    assert out_dir_state(out) == before and "moved" not in capsys.readouterr().out


def test_a_damaged_log_stops_a_resume_before_anything_moves(tmp_path):
    """(check_log and prepare_out_dir are the same code in every trainer.) A resume over a log.jsonl with a
    line that is no JSON object (here not UTF-8) stops in one line naming the file and the line, before it
    moves a newer checkpoint aside or logs its start: the out dir stays as it was."""
    out = tmp_path / "run"
    argv = [*MICRO, "--ckpt-every", "1", "--out-dir", str(out)]
    tj.main([*argv, "--steps", "2"])
    lines = (out / "log.jsonl").read_bytes().splitlines(keepends=True)
    (out / "log.jsonl").write_bytes(b"".join(lines[:2]) + b"\xff\xfe\n" + b"".join(lines[2:]))
    before = out_dir_state(out)
    with pytest.raises(SystemExit) as e:
        tj.main([*argv, "--steps", "3", "--resume", str(out / "ckpt_0000001")])
    assert str(e.value).startswith(f"error: {out / 'log.jsonl'} line 3: not a JSON object (b'\\xff\\xfe'")
    del e  # its traceback holds the refused run's lock, released here as the run's process would as it ends
    assert out_dir_state(out) == before
