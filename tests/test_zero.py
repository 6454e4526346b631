"""ZeRO-1 in the torch trainers (--zero-stage 1, CPU, gloo): two processes at stage 1 against two at stage 0
and against one process; a stage-1 checkpoint resumed by one process of the other torch trainer; the
per-device bytes line; --zero-stage 3 refused."""
import math

import pytest

import train_gpt2_torchfunc as tf
import train_gpt2_triton as tg
from conftest import assert_clean_error, run_script, step_events, step_lines

TRAINERS = {"torchfunc": ["train_gpt2_torchfunc.py"], "triton": ["train_gpt2_triton.py", "torch"]}
OTHER = {"torchfunc": "triton", "triton": "torchfunc"}
# one process: two micro-batches of 2 rows; two processes: one micro-batch of 2 rows each, the same rows
B, T, TOTAL, STEPS = 2, 64, 256, 3
FLAGS = ["--seq-len", T, "--batch-size", B, "--total-batch-size", TOTAL, "--lr", 3e-3, "--warmup", 2,
         "--dtype", "fp32", "--steps", STEPS, "--val-every", 0, "--hellaswag-every", 0, "--sample-every", 0]
# the tiny models gain nothing from intra-op threads, and two processes share the 2 cores
ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
# fp32 throughout. Stage 1 against stage 0 over the same 2 processes: the gradients are summed by the same
# two-operand additions, so only the grad norm's order of summation differs (shard norms squared and
# summed against per-tensor norms), and through the clipping coefficient the weights, by a few ulps
# (measured: losses bit-equal, grad norms 7e-8 apart). Against one process, the micro-batch gradients are
# added in another order too: the rel 1e-5 of tests/test_torchfunc.py::test_two_processes_match_one
# (measured: 7e-8). A resume in the other trainer: the checkpoint round-trips fp32 exactly, and two
# trainers agree within 1e-5 (tests/test_cross.py; measured here: 1e-6 on the grad norm).
SAME_PROCESSES_RTOL, ONE_PROCESS_RTOL, OTHER_TRAINER_RTOL = 1e-6, 1e-5, 1e-5


def train(name, out, tiny_shards, tiny_model_file, procs, *extra):
    """Runs trainer `name` with `procs` processes (torchrun-style, gloo, for 2); returns its stdout."""
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] if procs > 1 else []
    proc = run_script(*launch, *TRAINERS[name], "--data", tiny_shards, "--out-dir", out, *FLAGS, *extra,
                      env=ENV)
    return proc.stdout


# the runs the tests share: (processes, flags); the stage-1 run checkpoints every step
RUNS = {"one": (1, ["--ckpt-every", 0]), "zero0": (2, ["--ckpt-every", 0]),
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


def assert_same_steps(a, b, rtol, first=1):
    """Two runs' step events, steps first..STEPS, have the same losses and grad norms (within rtol)."""
    assert [e["step"] for e in a] == [e["step"] for e in b] == list(range(first, STEPS + 1))
    for x, y in zip(a, b):
        assert y["train_loss"] == pytest.approx(x["train_loss"], rel=rtol)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=rtol)


@pytest.mark.parametrize("name", TRAINERS)
def test_stage1_matches_stage0_and_one_process(runs, name):
    """2 processes at stage 1 (reduce-scatter, sharded AdamW, all-gather) give the losses and grad norms of
    2 processes at stage 0 (one all-reduce of the flat gradient buffer) and of 1 process; each prints what
    one device holds, the stage-1 moments half of stage 0's; only rank 0 prints the steps."""
    one, zero0, zero1 = (runs(name, k) for k in ("one", "zero0", "zero1"))
    assert_same_steps(step_events(zero0[0]), step_events(zero1[0]), SAME_PROCESSES_RTOL)
    assert_same_steps(step_events(one[0]), step_events(zero1[0]), ONE_PROCESS_RTOL)
    assert len(step_lines(zero1[1])) == STEPS
    held = {}
    for key, (_, stdout) in (("zero0", zero0), ("zero1", zero1)):
        lines = [line for line in stdout.splitlines() if line.startswith("per device: ")]
        assert len(lines) == 1 and lines[0].endswith(f"(ZeRO stage {key[-1]} over 2 devices)")
        held[key] = dict(zip(("params", "grads", "masters", "moments"),
                             (float(part.split()[-2]) for part in lines[0][12:].split(" (")[0].split(" | "))))
    assert held["zero1"]["moments"] == pytest.approx(held["zero0"]["moments"] / 2, rel=1e-3)
    assert held["zero1"]["masters"] == pytest.approx(held["zero0"]["masters"], rel=1e-3)


@pytest.mark.parametrize("name", TRAINERS)
def test_stage1_checkpoint_resumes_in_the_other_trainer(runs, name, tiny_shards, tiny_model_file,
                                                        tmp_path):
    """A checkpoint of 2 processes at stage 1 (moments all-gathered, rank 0 writes) resumes in 1 process
    of the other torch trainer at stage 0, which then prints the uninterrupted run's losses (two steps: the
    moments first show in the loss and norm of the step after the resumed one)."""
    other = OTHER[name]
    stdout = train(other, tmp_path, tiny_shards, tiny_model_file, 1, "--ckpt-every", 0, "--resume",
                   runs(name, "zero1")[0] / "ckpt_0000001")
    printed = [line[0].split()[1] for line in step_lines(stdout)]
    assert printed == [f"{s}/{STEPS}" for s in range(2, STEPS + 1)]
    assert_same_steps(step_events(runs(name, "zero1")[0])[1:], step_events(tmp_path), OTHER_TRAINER_RTOL,
                      first=2)


@pytest.mark.parametrize("mod", [tf, tg], ids=TRAINERS)
def test_zero_stage_flag(mod, tmp_path):
    """--zero-stage 3 is refused with one line saying it is the JAX trainer's, as is anything but 0 and 1;
    device_state_bytes splits the moments and grows the gradients by a shard at stage 1, and pads the flat
    buffer so that any number of processes gets equal shards."""
    argv = ["torch"] if mod is tg else []
    for stage, needle in ((3, "JAX trainer"), (2, "must be 0 or 1")):
        with pytest.raises(SystemExit) as e:
            mod.parse_args([*argv, "--zero-stage", str(stage)])
        assert needle in str(e.value) and "\n" not in str(e.value)
    cfg, _ = mod.parse_args([*argv, "--zero-stage", "1", "--dtype", "fp32", "--n-layer", "2", "--n-head",
                             "4", "--n-embd", "64", "--seq-len", "64"])
    shapes = mod.param_shapes(cfg)
    n = sum(math.prod(s) for s in shapes.values())
    for world in (1, 2, 3, 7, 8):  # the tiny model's 3.3M elements: 7 divides no tensor's size
        starts, size = mod.flat_layout(shapes, world)
        assert size % (16 * world) == 0 and size >= n
        pieces = [mod.shard_ranges(starts, shapes, size, r, world) for r in range(world)]
        assert sum(hi - lo for p in pieces for lo, hi in p.values()) == n  # every element in one shard
        held = mod.device_state_bytes(cfg, shapes, world)
        assert held["moments"] == 8 * size // world and held["params"] == 0
        assert held["grads"] == 4 * size + (4 * size // world if world > 1 else 0)
    proc = run_script(*TRAINERS["triton" if mod is tg else "torchfunc"], "--zero-stage", 3,
                      "--out-dir", tmp_path, env=ENV, check=False)
    assert_clean_error(proc, "--zero-stage 3", "JAX")
