"""ZeRO-1 in the torch trainers, train_gpt2_torchfunc.py and train_gpt2_triton.py with backend torch
(--zero-stage 1, CPU, gloo). The gpt2 recipe: two processes at stage 1 against two at stage 0 and against
one process, in bf16 (where stage 1 shards the fp32 masters too); a stage-1 checkpoint resumed by one
process of the other torch trainer; the evaluations a resume runs, decided by process 0; the per-device
bytes line, the flat layout and what make_state allocates; --zero-stage 3 refused. The speedrun recipe
(Muon's matrices whole on the process they are dealt to): two processes at stage 1 resuming one process's
checkpoint against that process, in fp32; torchfunc's whole-matrix layout, and the Triton trainer's state
at stages 0 and 1. (The JAX trainer's stages 1 and 3: tests/test_jax_sharded.py, and for its speedrun
recipe tests/test_speedrun_jax.py.)"""
import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import train_gpt2_torchfunc as tf
import train_gpt2_triton as tg
from conftest import (REPO, allocated_bytes, assert_clean_error, free_port, read_log, run_script, step_events,
                      step_lines, train_losses)
from train_gpt2_torchfunc import flat_layout, shard_ranges
from train_gpt2_jax import PARAM_NAMES

TRAINERS = {"torchfunc": ["train_gpt2_torchfunc.py"], "triton": ["train_gpt2_triton.py", "torch"]}
OTHER = {"torchfunc": "triton", "triton": "torchfunc"}
# one process: two micro-batches of 2 rows; two processes: one micro-batch of 2 rows each, the same rows
B, T, TOTAL, STEPS = 2, 32, 128, 3
FLAGS = ["--seq-len", T, "--batch-size", B, "--total-batch-size", TOTAL, "--lr", 3e-3, "--warmup", 2,
         "--dtype", "bf16", "--steps", STEPS, "--val-every", 0, "--hellaswag-every", 0, "--sample-every", 0]
# the tiny models gain nothing from intra-op threads, and two processes share the 2 cores
ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
# bf16 compute, fp32 masters, moments and gradient sums. 2 processes at stage 0 and 1 process add the same
# two micro-batch gradients (commutative: the same sums), and agree exactly. Stage 1 sums a step's grad norm
# in another order (shard by shard), which can round it apart by fp32 ulps (SAME_PROCESSES_RTOL), and
# through the clipping coefficient its first update's masters and moments (CHECKPOINT_RTOL). A master
# within those ulps of a bf16 rounding midpoint then has bf16 copies one bf16 ulp (2^-8 of the weight)
# apart, and which ones do depends on the machine's kernels: from step 2 on the runs agree to what bf16
# resolves, BF16_RTOL = 2^-8 of the loss and the norm (a step moves the norm by 11% and 28% here).
# Measured on a Xeon with AMX-BF16 (2026-12-07), torchfunc: norms 1.1e-7 apart at step 1, 2.1e-5 at step
# 2 and 5.2e-5 at step 3, losses 5e-6 at step 3; the Triton trainer's runs equal. A resume in the other
# trainer: the checkpoint round-trips fp32 exactly, and the two trainers' bf16 forwards differ (torchfunc
# keeps the embeddings and the residual stream in fp32). Measured, each trainer's checkpoint in the other:
# losses up to 2e-5 and norms up to 5e-4 apart; with the moments zeroed in the checkpoint, step 3 is off by
# 4.3e-3 in the loss and 7.9e-2 in the norm.
SAME_PROCESSES_RTOL, BF16_RTOL, ONE_PROCESS_RTOL, CHECKPOINT_RTOL = 1e-5, 2 ** -8, 1e-5, 1e-6
OTHER_TRAINER_LOSS_RTOL, OTHER_TRAINER_NORM_RTOL = 1e-4, 3e-3


def train(name, out, tiny_shards, tiny_model_file, procs, *extra):
    """Runs trainer `name` with `procs` processes (torchrun-style, gloo, for 2); returns its stdout."""
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] if procs > 1 else []
    proc = run_script(*launch, *TRAINERS[name], "--data", tiny_shards, "--out-dir", out, *FLAGS, *extra,
                      env=ENV)
    return proc.stdout


# the runs the tests share: (processes, flags); the two-process runs checkpoint every step
RUNS = {"one": (1, ["--ckpt-every", 0]), "zero0": (2, ["--ckpt-every", 1]),
        "zero1": (2, ["--ckpt-every", 1, "--zero-stage", 1])}


@pytest.fixture(scope="module")
def runs(tiny_shards, tiny_model_file, tmp_path_factory):
    """runs(trainer, key) -> (out dir, stdout) of the RUNS[key] run from tiny_model_file, each run once per
    module, when a test first asks for it (so that -k torchfunc runs only the torchfunc ones)."""
    done = {}

    def get(name, key):
        if (name, key) not in done:
            procs, extra = RUNS[key]
            out = tmp_path_factory.mktemp(f"{name}_{key}")
            done[name, key] = out, train(name, out, tiny_shards, tiny_model_file, procs, "--init-from",
                                         tiny_model_file, *extra)
        return done[name, key]
    return get


def assert_same_steps(a, b, rtol, first=1, norm_rtol=None, last=STEPS):
    """Two runs' step events, steps first..last, have the same losses and grad norms (within rtol, or
    norm_rtol for the norms)."""
    assert [e["step"] for e in a] == [e["step"] for e in b] == list(range(first, last + 1))
    for x, y in zip(a, b):
        assert y["train_loss"] == pytest.approx(x["train_loss"], rel=rtol)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=norm_rtol or rtol)


def assert_close_to_scale(actual, expected, name):
    """Equal within CHECKPOINT_RTOL of the largest magnitude in `expected`: a few ulps of the tensor's
    scale, also for its elements near zero."""
    np.testing.assert_allclose(actual, expected, rtol=0, atol=CHECKPOINT_RTOL * np.abs(expected).max(),
                               err_msg=name)


def printed_bytes(stdout):
    """The per-device line's four figures, in MB, and its stage and device count."""
    lines = [line for line in stdout.splitlines() if line.startswith("per device: ")]
    assert len(lines) == 1
    figures, where = lines[0][len("per device: "):].split(" | activations ")[0].split(" (")
    return (dict(zip(("params", "grads", "masters", "moments"),
                     (float(part.split()[-2]) for part in figures.split(" | ")))), where)


@pytest.mark.parametrize("name", TRAINERS)
def test_stage1_matches_stage0_and_one_process(runs, name):
    """2 processes at stage 1 (reduce-scatter, sharded fp32 masters and AdamW moments, all-gather of the
    bf16 weights) give the losses and grad norms of 2 processes at stage 0 (one all-reduce of the flat
    gradient buffer, rank-strided rows, one micro-batch each) and of 1 process (two micro-batches), as
    stage 0 does (from step 2 on within bf16's resolution), and write the same first checkpoint; each
    prints what one device holds, as device_state_bytes counts it; only rank 0 prints the steps."""
    one, zero0, zero1 = (runs(name, k) for k in ("one", "zero0", "zero1"))
    assert_same_steps(step_events(one[0]), step_events(zero0[0]), ONE_PROCESS_RTOL)
    for before in (zero0, one):  # stage 1: its first step at fp32's resolution, the next ones at bf16's
        a, b = step_events(before[0]), step_events(zero1[0])
        assert_same_steps(a, b, BF16_RTOL)
        assert_same_steps(a[:1], b[:1], SAME_PROCESSES_RTOL, last=1)
    assert len(step_lines(zero1[1])) == STEPS
    a, b = (d / "ckpt_0000001" for d in (zero0[0], zero1[0]))
    mod = tf if name == "torchfunc" else tg
    _, weights0 = mod.read_model_file(str(a / "model.bin"))
    _, weights1 = mod.read_model_file(str(b / "model.bin"))
    with np.load(a / "state.npz") as x, np.load(b / "state.npz") as y:
        assert x.files == y.files and int(y["step"]) == 1
        for key in x.files:
            if key.startswith(("m.", "v.")):
                assert_close_to_scale(y[key], x[key], key)
    for k in PARAM_NAMES:
        assert_close_to_scale(weights1[k], weights0[k], k)
    cfg, _ = mod.parse_args([*TRAINERS[name][1:], *map(str, FLAGS), "--n-layer", "2", "--n-head", "4",
                             "--n-embd", "64", "--zero-stage", "1"])
    for stage, (_, stdout) in ((0, zero0), (1, zero1)):
        held, where = printed_bytes(stdout)
        assert where == f"ZeRO stage {stage} over 2 devices)"
        expected = mod.device_state_bytes(mod.Config(**{**vars(cfg), "zero_stage": stage}),
                                          mod.param_shapes(cfg), 2)
        assert held == {k: round(n / 1e6, 1) for k, n in expected.items()}


@pytest.mark.parametrize("name", TRAINERS)
def test_stage1_checkpoint_resumes_in_the_other_trainer(runs, name, tiny_shards, tiny_model_file,
                                                        tmp_path):
    """A checkpoint of 2 processes at stage 1 (masters and moments all-gathered, rank 0 writes) resumes in
    1 process of the other torch trainer at stage 0, which then prints the uninterrupted run's losses, up
    to the two trainers' bf16 difference (two steps: the moments first show in the loss and norm of the
    step after the resumed one)."""
    other = OTHER[name]
    stdout = train(other, tmp_path, tiny_shards, tiny_model_file, 1, "--ckpt-every", 0, "--resume",
                   runs(name, "zero1")[0] / "ckpt_0000001")
    printed = [line[0].split()[1] for line in step_lines(stdout)]
    assert printed == [f"{s}/{STEPS}" for s in range(2, STEPS + 1)]
    assert_same_steps(step_events(runs(name, "zero1")[0])[1:], step_events(tmp_path),
                      OTHER_TRAINER_LOSS_RTOL, first=2, norm_rtol=OTHER_TRAINER_NORM_RTOL)



@pytest.mark.parametrize("mod", [tf, tg], ids=TRAINERS)
def test_zero_stage_flag(mod, tmp_path):
    """--zero-stage 3 is refused with one line saying it is the JAX trainer's, as is anything but 0 and 1;
    the flat layout pads each compute group so that any number of processes gets equal shards holding
    every element once; device_state_bytes at stage 1 splits the moments, and the masters where the
    model computes with bf16 copies, and grows the gradients by a shard; and it counts the bytes of the
    tensors make_state really allocates, at each stage, dtype and process count."""
    argv = ["torch"] if mod is tg else []
    for stage, needle in ((3, "JAX trainer"), (2, "takes 0 or 1")):
        with pytest.raises(SystemExit) as e:
            mod.parse_args([*argv, "--zero-stage", str(stage)])
        assert needle in str(e.value) and "\n" not in str(e.value)
    for dtype in ("fp32", "bf16"):
        cfg, _ = mod.parse_args([*argv, "--zero-stage", "1", "--dtype", dtype, "--n-layer", "2", "--n-head",
                                 "4", "--n-embd", "64", "--seq-len", "64"])
        shapes = mod.param_shapes(cfg)
        n = sum(math.prod(s) for s in shapes.values())
        groups = mod.compute_groups(cfg)
        assert sorted(k for names, _ in groups for k in names) == sorted(PARAM_NAMES)
        for world in (1, 2, 3, 7, 8):  # the tiny model's 3.3M elements: 7 divides no tensor's size
            starts, spans = flat_layout(shapes, groups, world)
            assert all((end - first) % (16 * world) == 0 for first, end in spans)
            assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            size = spans[-1][1]
            pieces = [shard_ranges(starts, shapes, span, r, world)
                      for span in spans for r in range(world)]
            assert sum(hi - lo for p in pieces for lo, hi in p.values()) == n  # every element in one shard
            held = mod.device_state_bytes(cfg, shapes, world)
            assert held["moments"] == 8 * size // world
            assert held["grads"] == 4 * size + (4 * size // world if world > 1 else 0)
            lengths = {dtype: end - first for (_, dtype), (first, end) in zip(groups, spans)}
            assert held["params"] == 2 * lengths.get(torch.bfloat16, 0)
            assert held["masters"] == 4 * lengths.get(torch.float32, 0) + 4 * lengths.get(torch.bfloat16,
                                                                                        0) // world
            for stage in (0, 1) if world <= 3 else ():  # 7 and 8 add no case the allocation can miss
                staged = mod.Config(**{**vars(cfg), "zero_stage": stage})
                params, m, v = ({k: np.zeros(s, np.float32) for k, s in shapes.items()} for _ in range(3))
                state = mod.make_state(params, m, v, staged, torch.device("cpu"), world - 1, world)
                assert allocated_bytes(state) == sum(mod.device_state_bytes(staged, shapes, world).values())
        assert [dtype for _, dtype in groups] == ([torch.float32] if dtype == "fp32" else
                                                  [torch.float32, torch.bfloat16] if mod is tf else
                                                  [torch.bfloat16])
    proc = run_script(*TRAINERS["triton" if mod is tg else "torchfunc"], "--zero-stage", 3,
                      "--out-dir", tmp_path, env=ENV, check=False)
    assert_clean_error(proc, "--zero-stage 3", "JAX")


@pytest.mark.parametrize("name", TRAINERS)
def test_rank0_decides_the_evaluations_a_resume_runs(runs, name, tiny_shards, tmp_path):
    """On --resume, the evaluations the log lacks at the checkpoint's step are process 0's decision, sent
    to every process: two processes whose --out-dir (no shared filesystem, say) hold different log.jsonl,
    rank 1's with the step's val loss and rank 0's without, both run it (a rank that skipped it would
    leave the other's all-reduce waiting) and train on."""
    ckpt = runs(name, "zero0")[0] / "ckpt_0000001"
    outs = [tmp_path / "rank0", tmp_path / "rank1"]
    outs[1].mkdir()
    (outs[1] / "log.jsonl").write_text(json.dumps({"step": 1, "val_loss": 1.0}) + "\n")
    port = free_port()
    procs = []
    for rank, out in enumerate(outs):
        env = dict(os.environ, **ENV, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        args = [*TRAINERS[name], "--data", tiny_shards, "--out-dir", out, *FLAGS, "--resume", ckpt,
                "--steps", 2, "--val-every", 1, "--val-steps", 2, "--ckpt-every", 0]
        procs.append(subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], results
    events = [(e["step"], "val_loss" in e) for e in read_log(outs[0])]
    assert events == [(1, True), (2, False), (2, True)]


# -----------------------------------------------------------------------------
# The speedrun recipe: Muon's matrices are dealt whole, round-robin, to the processes

SPEEDRUN_L, SPEEDRUN_C = 2, 128
SPEEDRUN_MODEL = ["--recipe", "speedrun", "--n-layer", SPEEDRUN_L, "--n-embd", SPEEDRUN_C, "--seed", 0,
                  "--dtype", "fp32"]
# tests/test_speedrun_torchfunc.py's runs: 6 steps of two micro-batches of 1 x 32 tokens (one process), or
# of one micro-batch each (two processes), from the recipe's init; checkpoints at steps 3 and 6
SPEEDRUN_FLAGS = [*SPEEDRUN_MODEL, "--seq-len", 32, "--batch-size", 1, "--total-batch-size", 64, "--steps", 6,
                  "--ckpt-every", 3, "--val-every", 0, "--hellaswag-every", 0, "--sample-every", 0]
# Two processes at stage 1 against one, fp32, add the two micro-batches' gradients in the same fp32
# additions (measured: the same losses and checkpoints to the last digit); the checkpoints are held to
# 1e-6 of each tensor's largest magnitude
SPEEDRUN_ZERO1_RTOL = 1e-6


def speedrun_cfg(mod, **kw):
    """The Config of SPEEDRUN_MODEL in trainer module `mod` (the Triton trainer's with backend torch), with
    the fields of kw replaced."""
    cfg, _ = mod.parse_args([*(["torch"] if mod is tg else []), *map(str, SPEEDRUN_MODEL)])
    return replace(cfg, **kw)


@pytest.fixture(scope="module")
def speedrun_runs(tiny_shards, tmp_path_factory):
    """speedrun_runs(trainer, key) -> out dir of a run of SPEEDRUN_FLAGS on tiny_shards, each made once, when
    a test first asks for it: "one" one process, in this process (under the test's one_thread); "zero1" that
    run's checkpoint of step 3 resumed by two processes at stage 1, each one micro-batch of its two."""
    done = {}

    def get(name, key):
        if (name, key) not in done:
            out = tmp_path_factory.mktemp(f"speedrun_{name}_{key}")
            argv = [*TRAINERS[name], *SPEEDRUN_FLAGS, "--data", tiny_shards, "--out-dir", out]
            if key == "zero1":
                run_script("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *argv,
                           "--zero-stage", 1, "--resume", get(name, "one") / "ckpt_0000003", env=ENV)
            else:
                (tf if name == "torchfunc" else tg).main([*map(str, argv[1:])])
            done[name, key] = out
        return done[name, key]
    return get


@pytest.mark.parametrize("name", TRAINERS)
def test_speedrun_stage1_resumes_as_one_process(speedrun_runs, name, one_thread):
    """--recipe speedrun, fp32: two processes at stage 1 (Newton-Schulz on whole matrices dealt round-robin,
    the updated weights all-gathered; AdamW's state split) resume one process's checkpoint of step 3, print
    its losses of steps 4-6 and gather the same checkpoint at step 6 (the weights, m of every tensor, v of
    the AdamW ones only), to the order of the gradients' sums."""
    mod = tf if name == "torchfunc" else tg
    one, zero1 = speedrun_runs(name, "one"), speedrun_runs(name, "zero1")
    assert [e["step"] for e in step_events(zero1)] == [4, 5, 6]
    assert train_losses(zero1) == pytest.approx(train_losses(one)[3:], rel=SPEEDRUN_ZERO1_RTOL)
    a, b = one / "ckpt_0000006", zero1 / "ckpt_0000006"
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert list(wa) == list(wb)
    for k in wa:
        np.testing.assert_allclose(wb[k], wa[k], rtol=0, atol=1e-6 * np.abs(wa[k]).max() + 1e-30, err_msg=k)
    shapes = mod.param_shapes(speedrun_cfg(mod))
    muon = mod.muon_names(shapes)
    with np.load(a / "state.npz") as x, np.load(b / "state.npz") as y:
        assert x.files == y.files
        assert {k for k in x.files if k.startswith("v.")} == {f"v.{k}" for k in shapes if k not in muon}
        assert {k for k in x.files if k.startswith("m.")} == {f"m.{k}" for k in shapes}
        for k in x.files:
            if k not in ("config", "time_spent"):  # time_spent: measured
                np.testing.assert_allclose(y[k], x[k], rtol=0, atol=1e-6 * np.abs(x[k]).max(), err_msg=k)


def test_torchfunc_speedrun_zero1_layout():
    """torchfunc's ZeRO-1 flat layout of the speedrun recipe, for 1, 2, 3 and 5 processes: Muon's matrices
    are dealt round-robin, largest first (as the reference's Muon deals them), so that each process's shard
    holds its matrices whole, and every element of every tensor lies in exactly one shard; make_state
    allocates what device_state_bytes counts (Muon keeps one buffer, AdamW two), and hands the update its
    Muon matrices in their shapes."""
    for dtype in ("fp32", "bf16"):
        cfg = speedrun_cfg(tf, dtype=dtype, zero_stage=1)
        shapes = tf.param_shapes(cfg)
        muon = tf.muon_names(shapes)
        assert len(muon) == 6 * SPEEDRUN_L and all(k.startswith("blocks.") for k in muon)
        order = sorted(muon, key=lambda k: shapes[k], reverse=True)
        for world in (1, 2, 3, 5):
            muon = tf.RECIPES[cfg.recipe].muon_names(shapes)
            groups, starts, spans = tf.state_layout(tf.compute_groups(cfg), muon, shapes, world)
            assert groups[-1][0] == muon and spans[0][0] == 0
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            pieces = [shard_ranges(starts, shapes, span, rank, world)
                      for span in spans for rank in range(world)]
            n = sum(map(math.prod, shapes.values()))
            assert sum(hi - lo for p in pieces for lo, hi in p.values()) == n
            for rank in range(world):
                mine = shard_ranges(starts, shapes, spans[-1], rank, world)
                assert list(mine) == [k for k in muon if order.index(k) % world == rank]
                assert all(hi - lo == math.prod(shapes[k]) for k, (lo, hi) in mine.items())
            for stage in (0, 1) if world <= 2 else ():
                staged = tf.Config(**{**vars(cfg), "zero_stage": stage})
                params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
                v = {k: p for k, p in params.items() if k not in muon}
                state = tf.make_state(params, params, v, staged, torch.device("cpu"), world - 1, world)
                assert allocated_bytes(state) == sum(tf.device_state_bytes(staged, shapes, world).values())
                assert all(state["shard_params"][k].shape == shapes[k] for k in muon if k in state["m"])
                assert set(state["v"]).isdisjoint(muon)


def test_triton_speedrun_state_is_what_device_state_bytes_counts():
    """The Triton trainer's make_state for the speedrun recipe, fp32 and bf16, alone at stage 0 and as
    process 1 of 2 at stage 1: it allocates what device_state_bytes counts (Muon keeps one buffer, AdamW
    two), keeps v of the AdamW tensors only, and hands the update its Muon matrices whole, in their shapes
    (at stage 1 those dealt to it)."""
    for dtype in ("fp32", "bf16"):
        for stage in (0, 1):
            cfg = speedrun_cfg(tg, dtype=dtype, zero_stage=stage)
            shapes = tg.param_shapes(cfg)
            muon = tg.muon_names(shapes)
            params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
            world = 1 + stage
            v = {k: p for k, p in params.items() if k not in muon}
            state = tg.make_state(params, params, v, cfg, torch.device("cpu"), world - 1, world)
            assert allocated_bytes(state) == sum(tg.device_state_bytes(cfg, shapes, world).values())
            assert set(state["v"]).isdisjoint(muon)
            mine = [k for k in muon if k in state["m"]]
            assert len(mine) == len(muon) // world
            assert all(state["shard_params"][k].shape == shapes[k] for k in mine)
