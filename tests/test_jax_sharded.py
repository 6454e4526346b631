"""train_gpt2_jax.py sharded: ZeRO stages 1 (bf16) and 3 (fp32) over 4 CPU devices,
checkpoints moved between stages and device counts, two processes joined by jax.distributed (tiny model L2
H4 C64 T64)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import hellaswag
import train_gpt2_jax as tg
from conftest import REPO, free_port, read_log, run_script, step_events, step_lines

STEPS = 3
# 256 tokens per step: one micro-batch of one row per device on 4 devices, of 4 rows on one device
FLAGS = ["--seq-len", 64, "--total-batch-size", 256, "--lr", 3e-3, "--warmup", 2, "--lr-decay-frac", 1.0,
         "--dtype", "fp32", "--steps", STEPS, "--val-every", 0, "--hellaswag-every", 0, "--sample-every", 0]
FOUR = "--xla_force_host_platform_device_count=4"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The CPU, and one persistent compilation cache for the module: a resumed run, the in-process check
    and a run it mirrors compile the same programs, so each is compiled once."""
    return {"JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


# Runs the trainer's main() in a process whose XLA_FLAGS set the device count, recording what the trainer
# hands gather_state at its first checkpoint (its live params, m, v: the shapes of each device's piece)
# and how many all-gathers its compiled step holds; printed as the last stdout line, after main's output.
SPY = textwrap.dedent("""
    import json, sys
    import train_gpt2_jax as tg
    seen = {}

    def pieces(a):
        return [list(s.data.shape) for s in sorted(a.addressable_shards, key=lambda s: s.device.id)]

    def gather_state(state, gather=tg.gather_state):
        if "masters" not in seen:
            seen.update(zip(("masters", "m", "v"), ({k: pieces(a) for k, a in t.items()} for t in state)))
        return gather(state)

    def compile_train_step(*args, compile=tg.compile_train_step):
        step = compile(*args)
        seen["all-gathers"] = step.as_text().count("all-gather(")
        return step

    tg.gather_state, tg.compile_train_step = gather_state, compile_train_step
    tg.main(sys.argv[1:])
    print("SPY " + json.dumps(seen))
""")


def spied(stdout):
    return json.loads(stdout.strip().splitlines()[-1].removeprefix("SPY "))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_shards, tiny_model_file, cache):
    """run(name) -> (out dir, stdout) of the named training run (under SPY), started on first use and kept
    for the module. "s0", "s3": stages 0 and 3 on 4 devices; "s0b", "s1b": stages 0 and 1 on 4 devices in
    bf16 (where stage 1 splits the masters of the bf16 weights; in fp32 it splits only what it splits here
    too); "one": stage 0 on 1 device; "s3>one":
    s3's step-2 checkpoint resumed at stage 0 on 1 device; "one>s3": one's step-2 checkpoint resumed at
    stage 3 on 4 devices. All save checkpoints at step 2 and the last."""
    done = {}
    plans = {"s0": (4, ["--zero-stage", 0]), "s3": (4, ["--zero-stage", 3]),
             "s0b": (4, ["--zero-stage", 0, "--dtype", "bf16"]),
             "s1b": (4, ["--zero-stage", 1, "--dtype", "bf16"]),
             "one": (1, ["--zero-stage", 0]),
             "s3>one": (1, ["--zero-stage", 0, "--resume", ("s3", "ckpt_0000002")]),
             "one>s3": (4, ["--zero-stage", 3, "--resume", ("one", "ckpt_0000002")])}

    def run(name):
        if name not in done:
            devices, args = plans[name]
            args = [run(a[0])[0] / a[1] if isinstance(a, tuple) else a for a in args]
            out = tmp_path_factory.mktemp(name.replace(">", "_to_"))
            start = [] if "--resume" in args else ["--init-from", tiny_model_file]
            proc = run_script("-c", SPY, "--data", tiny_shards, *start, "--out-dir", out,
                              "--ckpt-every", 2, "--batch-size", 4 // devices, *FLAGS, *args,
                              env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
                                   "PYTHONPATH": REPO, **cache})
            done[name] = out, proc.stdout
        return done[name]
    return run


def assert_same_steps(a, b, rel):
    assert [e["step"] for e in a] == [e["step"] for e in b]
    for x, y in zip(a, b):
        assert y["train_loss"] == pytest.approx(x["train_loss"], rel=rel), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=rel), (x, y)


def state_line(stdout):
    """The start line's training-state bytes (without the activations', which the run's B and T set)."""
    line = next(line for line in stdout.splitlines() if line.startswith("per device:"))
    return line.split(" | activations ")[0]


def state_part(cfg, held, world):
    return tg.format_memory(cfg, held, 0, world, tg.RECIPES[cfg.recipe].optimizers).split(" | activations ")[0]


def test_zero_stages_match_stage_0(runs):
    """On 4 devices, --zero-stage 3 prints stage 0's losses and grad norms (rel 1e-6) at every step in
    fp32, and --zero-stage 1 (with its bf16 copies kept across steps) in bf16 (rel 1e-5 at the first step,
    then within a bf16 ulp, 2^-8, as tests/test_zero.py explains); each prints what one
    device holds: the moments and gradients (stage 1; as in fp32) and also the masters (stage 3; at stage
    1 those of the bf16 weights) a quarter of stage 0's, as device_state_bytes computes them."""
    s0 = step_events(runs("s0")[0])
    assert len(s0) == STEPS
    assert_same_steps(s0, step_events(runs("s3")[0]), rel=1e-6)
    s0b, s1b = step_events(runs("s0b")[0]), step_events(runs("s1b")[0])
    assert_same_steps(s0b[:1], s1b[:1], rel=1e-5)  # the norm summed in another order (tests/test_zero.py)
    assert_same_steps(s0b, s1b, rel=2 ** -8)  # the bf16 copies of masters clipped an ulp apart (the same)
    bf16 = tg.Config(zero_stage=1, dtype="bf16", n_layer=2, n_head=4, n_embd=64, block_size=64)
    held = tg.device_state_bytes(bf16, tg.param_shapes(bf16), 4)
    embeddings = sum(4 * np.prod(s) for k, s in tg.param_shapes(bf16).items() if k in tg.EMBEDDINGS)
    rest = sum(np.prod(s) for k, s in tg.param_shapes(bf16).items() if k not in tg.EMBEDDINGS)
    assert held["params"] == 2 * rest and held["masters"] == embeddings + 4 * rest // 4  # a quarter
    assert state_line(runs("s1b")[1]) == state_part(bf16, held, 4)
    shapes = tg.param_shapes(tg.Config(n_layer=2, n_head=4, n_embd=64, block_size=64))
    whole = tg.device_state_bytes(tg.Config(zero_stage=0), shapes, 4)
    assert whole["masters"] == 4 * sum(np.prod(s) for s in shapes.values()) and whole["params"] == 0
    for stage in (0, 1, 3):
        cfg = tg.Config(zero_stage=stage, dtype="fp32")
        held = tg.device_state_bytes(cfg, shapes, 4)
        assert held["moments"] == (2 * whole["masters"] if stage == 0 else whole["masters"] // 2)
        assert held["masters"] == (whole["masters"] // 4 if stage == 3 else whole["masters"])
        assert held["grads"] == (whole["grads"] if stage == 0 else whole["grads"] // 4)
        if stage != 1:
            assert state_line(runs(f"s{stage}")[1]) == state_part(cfg, held, 4)


def split_shape(shape, axis):
    return [n // 4 if i == axis else n for i, n in enumerate(shape)]


def test_state_is_sharded(runs):
    """The trainer's own arrays at its first checkpoint, on 4 devices: at stage 1 (bf16) each device holds
    a quarter of every AdamW moment (split along the first axis that 4 divides: not the 2 stacked layers,
    so c_attn.w (2,192,64) is held as (2,48,64) pieces) and of the masters that have bf16 copies, and the
    embedding tables' masters whole; at stage 3 a quarter of every master too; at stage 0 everything
    whole. Stages 1 and 3 compile all-gathers of weights (stage 1: the updated masters and bf16 copies;
    stage 3: the weights, for the forward), stage 0 none."""
    shapes = tg.param_shapes(tg.Config(n_layer=2, n_head=4, n_embd=64, block_size=64))
    assert tg.shard_axis(shapes["c_attn.w"], 4) == 1 and tg.shard_axis(shapes["wte"], 4) == 0
    assert tg.shard_axis((3, 5), 4) is None and tg.zero_spec((3, 5), 4) == tg.PartitionSpec()
    for run in ("s0", "s3", "s1b"):
        got, stage = spied(runs(run)[1]), int(run[1])
        for k, shape in shapes.items():
            whole, quarter = [list(shape)] * 4, [split_shape(shape, tg.shard_axis(shape, 4))] * 4
            split_master = stage == 3 or (run == "s1b" and k not in tg.EMBEDDINGS)
            assert got["m"][k] == got["v"][k] == (whole if stage == 0 else quarter), (run, k)
            assert got["masters"][k] == (quarter if split_master else whole), (run, k)
        assert (got["all-gathers"] > 0) == (stage > 0)


def test_resume_across_stages_and_device_counts(runs):
    """A stage-3 run on 4 devices saved at step 2 and resumed at stage 0 on one device prints the one-device
    run's losses for steps 3-4, and a one-device checkpoint resumed at stage 3 on 4 devices the stage-3
    run's (rel 1e-5: the device count changes the order of sums); the checkpoints hold whole tensors,
    and the resumed runs end on the uninterrupted runs' data position and weights."""
    for resumed, uninterrupted in (("s3>one", "one"), ("one>s3", "s3")):
        out, stdout = runs(resumed)
        assert [e["step"] for e in step_events(out)] == [3]
        assert_same_steps(step_events(runs(uninterrupted)[0])[2:], step_events(out), rel=1e-5)
        assert len(step_lines(stdout)) == 1
        assert_close_checkpoints(runs(uninterrupted)[0] / "ckpt_0000003", out / "ckpt_0000003")


def assert_close_checkpoints(a, b):
    """Whole tensors in both, the same data position, weights within 3e-5 (a hundredth of a step at lr
    3e-3: AdamW's 1/sqrt(v) turns 1e-7 differences in tiny gradients into larger ones in their
    coordinates' updates, so weights of runs that sum in another order are not closer than that; on some
    CPUs 2 of wte's 3.2M coordinates land 1.3e-5 apart)."""
    _, wa = tg.read_model_file(str(a / "model.bin"))
    _, wb = tg.read_model_file(str(b / "model.bin"))
    with np.load(a / "state.npz") as x, np.load(b / "state.npz") as y:
        assert int(y["position"]) == int(x["position"]) == STEPS * 256
        for k in tg.PARAM_NAMES:
            np.testing.assert_allclose(wb[k], wa[k], rtol=0, atol=3e-5, err_msg=k)
            assert y[f"m.{k}"].shape == y[f"v.{k}"].shape == wa[k].shape


def test_two_processes_match_one(runs, tiny_shards, tiny_model_file, tmp_path, cache):
    """2 processes x 2 CPU devices joined by jax.distributed (coordinator on 127.0.0.1), at stage 3, with
    SIGTERM (what SLURM and Kubernetes send before a kill) to process 0 just after step 1 is logged: both
    stop after step 2 with its checkpoint, exit 143, one line; launched again without --resume, process 0
    refuses the out dir and process 1 stops with it; --resume auto in both then prints the losses
    and grad norms of 1 process x 4 devices (rel 1e-6), each process reading only its own rows; only
    process 0 prints step lines and writes the log and the checkpoints, which hold the whole tensors of the
    4-device run."""
    out = tmp_path / "mp"
    port = free_port()
    args = ["train_gpt2_jax.py", "--data", str(tiny_shards), "--out-dir", str(out), "--ckpt-every", 2,
            "--batch-size", 1, *FLAGS, "--zero-stage", 3,
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", 2]
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               **cache)

    def launch(first, extra, codes):
        procs = [subprocess.Popen([sys.executable, *first, *map(str, args), *extra, "--process-id", str(i)],
                                  cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for i in (0, 1)]
        try:
            outputs = [p.communicate(timeout=300) for p in procs]
        finally:
            for p in procs:
                p.kill()
        for p, code, (stdout, stderr) in zip(procs, codes, outputs):
            assert p.returncode == code and "Traceback" not in stderr, f"{stdout[-2000:]}\n{stderr[-3000:]}"
        return outputs

    # the signal reaches process 0 only (it alone logs); the step's all-gather stops process 1 too
    stopped = launch(["tests/signal_at_step.py", "1", "SIGTERM"], ["--init-from", tiny_model_file], (143, 143))
    assert stopped[0][1].strip().splitlines()[-1].startswith("SIGTERM: stopped after step 2 of 3")
    assert [e["step"] for e in step_events(out)] == [1, 2]
    # the same launch without --resume: process 0 refuses the out dir, and process 1 stops with it
    refused = launch([], [], (1, 1))
    assert "already holds a run" in refused[0][1]
    assert "process 1 of 2 stops: another process of the run refused to start" in refused[1][1]
    outputs = launch([], ["--resume", "auto"], (0, 0))
    assert "4 x cpu in 2 process(es)" in outputs[0][0]
    assert len(step_lines(stopped[0][0] + outputs[0][0])) == STEPS and step_lines(outputs[1][0]) == []
    assert_same_steps(step_events(runs("s3")[0]), step_events(out), rel=1e-6)
    assert len(read_log(out)) == STEPS and sorted(os.listdir(out)) == ["ckpt_0000002", "ckpt_0000003",
                                                                        "log.jsonl"]
    assert_close_checkpoints(runs("s3")[0] / "ckpt_0000003", out / "ckpt_0000003")


def test_bad_sharding_flags(monkeypatch):
    """A stage ZeRO does not have here, or several processes without a coordinator, a valid rank or a
    numeric $JAX_NUM_PROCESSES, end with a one-line error naming the problem before any device is used
    (checked in this process: parse_args and init_processes stop before jax.distributed starts)."""
    with pytest.raises(SystemExit, match="--zero-stage"):
        tg.parse_args(["--zero-stage", "2"])
    cases = [(["--num-processes", "2"], {}, "needs --coordinator"),
             (["--num-processes", "2", "--coordinator", "127.0.0.1:1", "--process-id", "2"], {},
              r"in \[0, 2\)"),
             ([], {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES is 'two'")]
    for args, env, needle in cases:
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            with pytest.raises(SystemExit, match=needle) as stop:
                tg.init_processes(tg.parse_args(args)[0])
            assert "\n" not in str(stop.value)


def test_hellaswag_progress_from_process_0_only(monkeypatch, hellaswag_dir, capsys):
    """Every process of a multi-host run scores HellaSwag (its computations span all devices), and only
    process 0 prints the progress lines: the others score the same and print nothing."""
    monkeypatch.setattr(hellaswag, "DEFAULT_CACHE_DIR", str(hellaswag_dir))
    cfg = tg.Config(block_size=64, hellaswag_limit=4)
    rows = lambda params, x, y: np.ones(x.shape, np.float32)  # noqa: E731  every ending equally likely
    scores = {}
    for index in (0, 1):
        monkeypatch.setattr(tg.jax, "process_index", lambda index=index: index)
        scores[index] = tg.evaluate_hellaswag(rows, None, cfg)
        printed = capsys.readouterr().out
        assert ("hellaswag 4/4" in printed) == (index == 0), printed
    assert scores[0] == scores[1]
