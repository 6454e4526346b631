"""Resuming after a crash, in every GPT-2 trainer: on --resume, the evaluations due at the checkpoint's
step that log.jsonl lacks (a kill between the checkpoint and its evaluations) are run; a damaged
checkpoint is a one-line error. The log reader is tested here; tests/test_trainers.py kills a real run of
each trainer with assert_lost_evaluations_recovered and resumes the checkpoints of
write_damaged_checkpoints."""
import importlib
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, read_log, run_script
from train_gpt2_jax import check_log, load_checkpoint, save_checkpoint
from train_gpt2_jax import logged_evals

MODULES = ["train_gpt2_jax", "train_gpt2_torchfunc", "train_gpt2_triton"]
TIMING_KEYS = {"dt_ms", "tokens_per_s", "mfu", "peak_mem_gb"}  # the only keys that differ between runs


def test_logged_evals_reads_the_log(tmp_path):
    """logged_evals names the evaluations log.jsonl records at a step, whatever trainer wrote them; a
    missing log records none, and a line cut short by a crash, one not UTF-8 or JSON that is no object is no
    event (a resume's check_log has stopped at such a line before)."""
    assert logged_evals(str(tmp_path), 3) == set()
    events = [{"step": 3, "train_loss": 5.0, "framework": "jax"},
              {"step": 3, "val_loss": 4.9, "framework": "torchfunc"},
              {"step": 6, "hellaswag_acc": 0.3, "hellaswag_acc_norm": 0.2, "framework": "jax"}]
    lines = [json.dumps(e) + "\n" for e in events]
    (tmp_path / "log.jsonl").write_bytes(("".join(lines) + '[3]\n3\n').encode() + b'\xff\n{"step": 9, "val_lo')
    assert logged_evals(str(tmp_path), 3) == {"val_loss"}
    assert logged_evals(str(tmp_path), 6) == {"hellaswag_acc"}
    assert logged_evals(str(tmp_path), 9) == set()


def test_check_log(tmp_path):
    """check_log, as a resume starts, cuts log.jsonl back to its last complete line (a kill while appending
    leaves half a line, which the next event would be glued to); a last event whose newline was lost (an
    editor saved it without) gets it back; a complete log, an empty one or none is left as it is. A damaged
    line before the last (not UTF-8, JSON that is no object, a line cut short) is one line naming the file
    and line number, the log left as it was; a blank line is no damage."""
    check_log(str(tmp_path))
    assert not (tmp_path / "log.jsonl").exists()
    complete = '{"step": 1, "train_loss": 5.0}\n\n{"step": 1, "val_loss": 4.9}\n'
    for text, kept in ((complete + '{"step": 2, "tra', complete), (complete, complete), ("", ""),
                       ('{"step": 1, "tra', ""), (complete[:-1], complete), (complete + "[2]", complete)):
        (tmp_path / "log.jsonl").write_text(text)
        check_log(str(tmp_path))
        assert (tmp_path / "log.jsonl").read_text() == kept
    for bad in (b"\xff\xfe not UTF-8", b"[1]", b"3", b'{"step": 3, "val_lo'):
        damaged = complete.encode() + bad + b"\n" + complete.encode()
        (tmp_path / "log.jsonl").write_bytes(damaged)
        with pytest.raises(SystemExit) as e:
            check_log(str(tmp_path))
        assert str(e.value).startswith(f"error: {tmp_path / 'log.jsonl'} line 4: not a JSON object (")
        assert "\n" not in str(e.value) and (tmp_path / "log.jsonl").read_bytes() == damaged


def logged_at(out, step, key):
    """Whether <out>/log.jsonl holds an event with `key` at `step`; read while a run appends to it, so a
    line not finished yet is left out."""
    path = out / "log.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    events = [json.loads(line) for line in lines if line.endswith("\n")]
    return any(e["step"] == step and key in e for e in events)


def kill_during_hellaswag(args, out, step, env, tmp_path, timeout=300):
    """Runs `python args` with HELLASWAG_DIR at a directory whose hellaswag_val.jsonl is a named pipe
    that nobody writes, so the HellaSwag evaluation blocks opening it. Once step `step`'s checkpoint and
    val event are on disk (the run is then in that evaluation, or on its way there), sends SIGKILL."""
    swag = tmp_path / "hellaswag_pipe"
    swag.mkdir()
    os.mkfifo(swag / "hellaswag_val.jsonl")
    output = tmp_path / "killed_run.txt"
    with open(output, "w") as f:
        proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, stdout=f,
                                stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **env, HELLASWAG_DIR=str(swag)))
    try:
        deadline = time.monotonic() + timeout
        while not ((out / f"ckpt_{step:07d}").is_dir() and logged_at(out, step, "val_loss")):
            if proc.poll() is not None:
                pytest.fail(f"the run exited {proc.returncode} before step {step}'s checkpoint and val "
                            f"loss\n{output.read_text()[-3000:]}", pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(f"no checkpoint and val loss of step {step} after {timeout} s\n"
                            f"{output.read_text()[-3000:]}", pytrace=False)
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def assert_lost_evaluations_recovered(args, uninterrupted, env, hellaswag_dir, tmp_path):
    """`uninterrupted` is a 6-step run (checkpoints and val every 3 steps, HellaSwag at step 6); `args`
    runs the same trainer with its flags but --out-dir and --resume. A new out dir gets its step-3
    checkpoint and the log as a crash right after that checkpoint left it (no step-3 val loss; half of its
    line, as if killed while appending it); resuming (--resume auto) drops the half line, runs the missing
    val loss and trains on, and is killed during step 6's HellaSwag
    (checkpoint and val loss written). Resuming again with a real HellaSwag file runs that evaluation
    alone, and the log then equals the uninterrupted run's: the same losses, scores, steps, each event
    once."""
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(uninterrupted / "ckpt_0000003", out / "ckpt_0000003")
    lines = (uninterrupted / "log.jsonl").read_text().splitlines(keepends=True)
    val3 = next(i for i, line in enumerate(lines) if "val_loss" in json.loads(line))  # the first val loss
    (out / "log.jsonl").write_text("".join(lines[:val3]) + lines[val3][:len(lines[val3]) // 2])
    resume = [*args, "--out-dir", out, "--resume", "auto"]
    kill_during_hellaswag(resume, out, 6, env, tmp_path)
    assert not any("hellaswag_acc" in e for e in read_log(out)), "the kill came too late"
    run_script(*resume, env={**env, "HELLASWAG_DIR": str(hellaswag_dir)})
    untimed = lambda log: [{k: v for k, v in e.items() if k not in TIMING_KEYS} for e in log]  # noqa: E731
    assert untimed(read_log(out)) == untimed(read_log(uninterrupted))


def member_data(archive, name):
    """(offset, size) of member `name`'s stored or compressed bytes in the zip archive `archive` (bytes)."""
    info = zipfile.ZipFile(io.BytesIO(archive)).getinfo(name)
    name_len, extra_len = struct.unpack("<HH", archive[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len, info.compress_size


def write_damaged_checkpoints(mod, folder):
    """Checkpoint dirs <folder>/<case>/ckpt_0000003 holding a good model.bin (of a micro model, written by
    the trainer module `mod`) and a damaged state.npz; returns {case: dir}. The cases: a line of text,
    the archive cut in half, an empty file, a flipped byte in a member's data (its CRC fails), and the
    state saved compressed with a member whose bytes do not inflate."""
    cfg = mod.Config(n_layer=1, n_head=1, n_embd=4, block_size=4, vocab_size=8, padded_vocab_size=8)
    zeros = {k: np.zeros(shape, np.float32) for k, shape in mod.param_shapes(cfg).items()}
    good = Path(save_checkpoint(str(folder), 3, zeros, zeros, zeros, (0, 0), cfg))
    state = (good / "state.npz").read_bytes()
    crc = bytearray(state)
    start, size = member_data(state, "m.wte.npy")
    crc[start + size - 1] ^= 0xFF  # the last byte of the array data
    with np.load(io.BytesIO(state)) as z:
        deflated = io.BytesIO()
        np.savez_compressed(deflated, **z)
    deflated = bytearray(deflated.getvalue())
    start, _ = member_data(bytes(deflated), "m.wte.npy")
    deflated[start] = 0xFF  # a deflate block of the reserved type 3
    cases = {"text": b"not a checkpoint\n", "cut": state[:len(state) // 2], "empty": b"", "crc": crc,
             "deflate": deflated}
    dirs = {}
    for case, data in cases.items():
        d = dirs[case] = folder / case / "ckpt_0000003"
        d.mkdir(parents=True)
        shutil.copy(good / "model.bin", d)
        (d / "state.npz").write_bytes(data)
    return dirs


def test_non_finite_or_out_of_range_checkpoints_are_refused(tmp_path):
    """A checkpoint is refused with one line that names the problem when its model.bin holds a NaN or an
    inf (an llm.c model file given to --init-from is read by the same reader, in fp32 and in bf16), its
    optimizer state holds a NaN or an inf (a first moment: AdamW's, or Muon's momentum in the speedrun
    recipe; an AdamW second moment), or its seed is out of the range that --seed takes."""
    mod = importlib.import_module("train_gpt2_jax")  # its Config and RECIPES; the checks are the shared plumbing's
    cfg = mod.Config(n_layer=1, n_head=1, n_embd=4, block_size=4, vocab_size=8, padded_vocab_size=8,
                     out_dir=str(tmp_path))
    zeros = {k: np.zeros(shape, np.float32) for k, shape in mod.param_shapes(cfg).items()}
    good = Path(save_checkpoint(str(tmp_path / "good"), 3, zeros, zeros, zeros, (0, 0), cfg))
    with np.load(good / "state.npz") as z:
        state = dict(z)
    model = (good / "model.bin").read_bytes()
    nan_fp32 = bytearray(model)
    nan_fp32[-4:] = np.float32(np.nan).tobytes()
    header = np.frombuffer(model[:1024], "<i4").copy()
    header[1] = 5
    inf_bf16 = bytearray(header.tobytes() + bytes((len(model) - 1024) // 2))
    inf_bf16[1030:1032] = np.uint16(0xFF80).tobytes()  # -inf, in wte
    cases = {
        "nan_weights": ({}, bytes(nan_fp32), "tensor ln_f.b holds 1 non-finite"),
        "inf_bf16_weights": ({}, bytes(inf_bf16), "tensor wte holds 1 non-finite"),
        "nan_m": ({"m.wte": np.full_like(state["m.wte"], np.nan)}, model, "optimizer state for wte"),
        "inf_v": ({"v.ln_f.b": np.full_like(state["v.ln_f.b"], np.inf)}, model, "optimizer state for ln_f.b"),
        "seed_uint64": ({"seed": np.uint64(2**64 - 1)}, model, "seed is 18446744073709551615, out of range"),
    }
    for name, (changes, weights, needle) in cases.items():
        d = tmp_path / name / "ckpt_0000003"
        d.mkdir(parents=True)
        (d / "model.bin").write_bytes(weights)
        np.savez(d / "state.npz", **{**state, **changes})
        with pytest.raises(SystemExit) as e:
            load_checkpoint(str(d), cfg)
        message = str(e.value)
        assert message.startswith("error: ") and "\n" not in message and needle in message, (name, message)
        if name.endswith("weights"):
            with pytest.raises(SystemExit) as e:
                mod.read_model_file(str(d / "model.bin"))
            assert needle in str(e.value)
