"""--recipe speedrun in train_gpt2_jax.py: per-step losses against the float64 outside reference
(tests/speedrun_reference.py) from the recipe's init and from random weights, ZeRO stages 1 and 3 against
stage 0 on two host devices (bf16), checkpoints that move between torchfunc and JAX, and bad input. The JAX
runs go through main() in subprocesses that share a persistent compilation cache (the runs of one device
count and dtype compile one program), as tests/test_jax_sharded.py runs them."""
import json
import math
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file

import speedrun_reference as ref
import train_gpt2_jax as tj
import train_gpt2_torchfunc as tf
from conftest import (REPO, assert_clean_error, assert_refused, assert_same_step_values, run_script,
                      step_events, step_lines, stop_by_signals_and_resume, train_losses)
from train_gpt2_jax import load_checkpoint

L, C, T, B, ACCUM, STEPS = 2, 128, 32, 1, 2, 6  # test_speedrun_torchfunc.py's shapes: 64 tokens a step
FLAGS = ["--recipe", "speedrun", "--n-layer", L, "--n-embd", C, "--seq-len", T, "--batch-size", B,
         "--total-batch-size", ACCUM * B * T, "--steps", STEPS, "--val-every", 0, "--hellaswag-every", 0,
         "--sample-every", 0]
# fp32 against float64 per step, as tests/test_speedrun_torchfunc.py holds torchfunc (its comment says why
# steps 4-6 from the recipe's init are the sensitive ones). Measured here: from the recipe's init at most
# 4.1e-8 in steps 1-3 and 1.5e-6 in steps 4-6, from random weights at most 4.1e-8.
REFERENCE_RTOL = 1e-5
# the same program in two frameworks, fp32, from random weights: the per-step losses (measured: the same
# float32 values), and each tensor of the checkpoints after step 6, by the norm of its difference relative to
# its own (measured: at most 9.5e-6): not element by element, since AdamW's eps of 1e-10 lets a coordinate
# of the head whose gradients are fp32 noise move by up to its lr each step, one way or the other
CROSS_RTOL, CROSS_NORM_RTOL = 1e-6, 1e-4
# stages 1 and 3 against stage 0, as tests/test_jax_sharded.py holds GPT-2's (measured: the same losses, and
# grad norms within 7.2e-8: the order of their fp32 sums)
STAGE_RTOL = 1e-6
STAGE_STEPS = 3
RUNNER = textwrap.dedent("""
    import json, sys
    import train_gpt2_jax as tj
    for argv in json.loads(sys.argv[1]):
        print("RUN", flush=True)
        tj.main(argv)
""")


def random_state(n_layer, seed):
    """The reference's state_dict (rotary buffers included) with every parameter random and nonzero, at
    about the scale training gives them."""
    state = ref.init_state_dict(n_layer, C, 0)
    rng = np.random.default_rng(seed)
    for k, t in state.items():
        if not k.endswith("angular_freq"):
            std = 1.0 if k == "embed.weight" else 0.1 if t.ndim == 1 else 0.5 / math.sqrt(t.shape[-1])
            state[k] = (rng.standard_normal(t.shape) * std + k.endswith("gains")).astype(np.float32)
    return state


@pytest.fixture(scope="module")
def inits(tmp_path_factory):
    """Model files written by the reference: "recipe" its init from seed 0 (what --seed 0 draws), "random"
    random weights, "random1" random weights of one layer (the stage runs)."""
    folder = tmp_path_factory.mktemp("inits")
    states = {"recipe": ref.init_state_dict(L, C, 0), "random": random_state(L, 1),
              "random1": random_state(1, 2)}
    for name, state in states.items():
        ref.write_model_file(folder / f"{name}.safetensors", state)
    return {name: folder / f"{name}.safetensors" for name in states}


def run_jax(runs, devices, cache, out):
    """Runs main() once per argv of `runs` in one process of `devices` host devices; returns each run's
    stdout."""
    proc = run_script("-c", RUNNER, json.dumps([[*map(str, argv), "--out-dir", str(out / name)]
                                                for name, argv in runs.items()]),
                      env={"JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO,
                           "JAX_COMPILATION_CACHE_DIR": str(cache),
                           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
                           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"})
    return dict(zip(runs, proc.stdout.split("RUN\n")[1:]))


@pytest.fixture(scope="module")
def runs(inits, tiny_shards, tmp_path_factory):
    """runs(name) -> (out dir, stdout), each made once, when first asked for. fp32 on one device, 6 steps:
    "recipe" from --seed 0; "random" from inits' random weights (checkpoints at steps 3 and 6); "tf" the
    same in train_gpt2_torchfunc.py (in this process, one thread); "tf>jax": tf's step-3 checkpoint resumed
    in JAX (checkpoint at step 6). Two devices, bf16, one layer, STAGE_STEPS steps: "s0", "s1", "s3" at ZeRO
    stages 0, 1, 3."""
    out, cache = tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("jax_cache")
    base = [*FLAGS, "--data", tiny_shards, "--dtype", "fp32"]
    done = {}

    def get(name):
        if name in done:
            return done[name]
        if name == "tf":
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                tf.main([*map(str, base), "--init-from", str(inits["random"]), "--ckpt-every", "3",
                         "--out-dir", str(out / "tf")])
            finally:
                torch.set_num_threads(threads)
            done["tf"] = out / "tf", None
        elif name in ("recipe", "random", "tf>jax"):
            one = {"recipe": [*base, "--seed", 0, "--ckpt-every", 0],
                   "random": [*base, "--init-from", inits["random"], "--ckpt-every", 3],
                   "tf>jax": [*base, "--resume", get("tf")[0] / "ckpt_0000003", "--ckpt-every", 3]}
            done.update({k: (out / k, stdout) for k, stdout in run_jax(one, 1, cache, out).items()})
        else:
            stage = [*FLAGS, "--n-layer", 1, "--steps", STAGE_STEPS, "--data", tiny_shards, "--dtype", "bf16",
                     "--init-from", inits["random1"], "--ckpt-every", 0]
            two = {f"s{n}": [*stage, "--zero-stage", n] for n in (0, 1, 3)}
            done.update({k: (out / k, stdout) for k, stdout in run_jax(two, 2, cache, out).items()})
        return done[name]
    return get



# [recipe] is the quick tier's --recipe speedrun run of this trainer
@pytest.mark.parametrize("key", [pytest.param("recipe", marks=pytest.mark.quick), "random"])
def test_training_matches_the_float64_reference(runs, inits, key, speedrun_reference_losses, one_thread):
    """In fp32, each step's train loss is within 1e-5 of the float64 reference's over 6 steps of two
    micro-batches (the summed token loss's gradient, Muon on the blocks' matrices, AdamW's three groups,
    the stable-then-decay schedule): from random nonzero weights, and from the recipe's init by --seed
    (the reference's init_state_dict of the same seed)."""
    expected = speedrun_reference_losses(inits[key])
    got = train_losses(runs(key)[0])
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, expected), 1):
        assert a == pytest.approx(b, rel=REFERENCE_RTOL), f"step {step}: {a} against {b}"
    assert got[-1] < got[0] - 0.5  # it learns
    assert runs(key)[1].splitlines()[1].startswith(f"speedrun GPT L{L} H1 C{C}, ")  # after the out dir line


def test_zero_stages_match_stage_0(runs, inits, tiny_shards):
    """On 2 devices in bf16 (one layer: Muon's stack of four CxC matrices is dealt two to a device, its one
    4CxC and one Cx4C matrix orthogonalized whole on both), stages 1 and 3 print stage 0's losses and grad
    norms, and each run prints what one device holds (AdamW's two moments, Muon's one). bf16 trains: the
    first step's loss is within 1e-2 of the float64 reference's forward, and the loss falls."""
    s0 = step_events(runs("s0")[0])
    assert len(s0) == STAGE_STEPS
    for stage in ("s1", "s3"):
        got = step_events(runs(stage)[0])
        assert [e["step"] for e in got] == [e["step"] for e in s0]
        for a, b in zip(s0, got):
            assert b["train_loss"] == pytest.approx(a["train_loss"], rel=STAGE_RTOL), (stage, a, b)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=STAGE_RTOL), (stage, a, b)
    for stage in (0, 1, 3):
        cfg = tj.Config(recipe="speedrun", n_layer=1, n_head=1, n_embd=C, dtype="bf16", zero_stage=stage)
        shapes = tj.param_shapes(cfg)
        held = tj.device_state_bytes(cfg, shapes, 2)
        muon = tj.muon_names(shapes)
        whole = sum(4 * math.prod(s) * (1 if k in muon else 2) for k, s in shapes.items())
        assert held["moments"] == (whole if stage == 0 else whole // 2)
        line = next(x for x in runs(f"s{stage}")[1].splitlines() if x.startswith("per device:"))
        expected = tj.format_memory(cfg, held, 0, 2, tj.RECIPES[cfg.recipe].optimizers).split(" | activations ")[0]
        assert line.split(" | activations ")[0] == expected and "AdamW and Muon moments" in line

    model = ref.load_model(inits["random1"])
    tokens = np.fromfile(tiny_shards / "tiny_train_000001.bin", dtype="<u2", offset=1024).astype(np.int64)
    x, y = (torch.from_numpy(tokens[i:i + 2 * T].reshape(2, T)) for i in (0, 1))
    with torch.no_grad():
        first = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    assert s0[0]["train_loss"] == pytest.approx(first, rel=1e-2)
    assert s0[-1]["train_loss"] < s0[0]["train_loss"] - 0.1


def assert_close_checkpoints(a, b):
    """Two speedrun checkpoints: the same tensor names in the same order, in model.safetensors and in
    state.npz (m.* of every tensor, v.* of the AdamW ones only), the same data position, each tensor within
    CROSS_NORM_RTOL (the norm of the difference relative to the tensor's)."""
    def assert_close(x, y, name):
        assert np.linalg.norm(y - x) <= CROSS_NORM_RTOL * np.linalg.norm(x), name

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert list(wa) == list(wb)
    for k in wa:
        assert_close(wa[k], wb[k], k)
    with np.load(a / "state.npz") as x, np.load(b / "state.npz") as y:
        assert x.files == y.files
        shapes = tj.param_shapes(tj.Config(recipe="speedrun", n_layer=L, n_head=1, n_embd=C))
        muon = tj.muon_names(shapes)
        assert {k for k in x.files if k.startswith("m.")} == {f"m.{k}" for k in shapes}
        assert {k for k in x.files if k.startswith("v.")} == {f"v.{k}" for k in shapes if k not in muon}
        assert int(x["position"]) == int(y["position"]) == STEPS * ACCUM * B * T
        for k in x.files:
            if k.startswith(("m.", "v.")):
                assert_close(x[k], y[k], k)


def test_checkpoints_move_between_torchfunc_and_jax(runs, tiny_shards, tmp_path, one_thread):
    """torchfunc's step-3 checkpoint, resumed in JAX, prints and logs torchfunc's uninterrupted steps 4-6
    (fp32, to 1e-6) and saves at step 6 the checkpoint torchfunc saved; JAX's uninterrupted run saves it
    too, and torchfunc resumes JAX's step-3 checkpoint: its steps 4-6 are JAX's. With
    tests/test_speedrun_triton.py's checkpoints between torchfunc and the Triton trainer, a speedrun run
    passes between any two of the three trainers."""
    tf_out, _ = runs("tf")
    out, stdout = runs("tf>jax")
    assert [e["step"] for e in step_events(out)] == [4, 5, 6]
    assert train_losses(out) == pytest.approx(train_losses(tf_out)[3:], rel=CROSS_RTOL)
    printed = [float(line[1].split()[1]) for line in step_lines(stdout)]
    assert printed == pytest.approx(train_losses(tf_out)[3:], rel=CROSS_RTOL)
    assert_close_checkpoints(tf_out / "ckpt_0000006", out / "ckpt_0000006")

    jax_out, _ = runs("random")
    assert train_losses(jax_out) == pytest.approx(train_losses(tf_out), rel=CROSS_RTOL)
    assert_close_checkpoints(tf_out / "ckpt_0000006", jax_out / "ckpt_0000006")
    cfg, _ = tf.parse_args(list(map(str, FLAGS)))
    header, params, m, v, state = load_checkpoint(str(jax_out / "ckpt_0000003"), cfg)
    assert (header["n_layer"], state["step"], state["position"]) == (L, 3, 3 * ACCUM * B * T)
    assert list(params) == list(tf.param_shapes(cfg)) and set(v) == set(params) - set(
        tf.muon_names({k: p.shape for k, p in params.items()}))
    tf.main([*map(str, FLAGS), "--data", str(tiny_shards), "--dtype", "fp32", "--resume",
             str(jax_out / "ckpt_0000003"), "--ckpt-every", "0", "--out-dir", str(tmp_path / "jax>tf")])
    assert [e["step"] for e in step_events(tmp_path / "jax>tf")] == [4, 5, 6]
    assert train_losses(tmp_path / "jax>tf") == pytest.approx(train_losses(jax_out)[3:], rel=CROSS_RTOL)

def test_bad_input(tiny_shards, tiny_model_file, tmp_path):
    """One line and a non-zero exit, before any training: an llm.c model file given to --recipe speedrun
    (also as a script, without a traceback), --n-head other than width/128, and --scan-layers (the speedrun
    model's layers are separate tensors)."""
    # a tiny run without evaluations, so that a check that lets one through fails in seconds
    speedrun = ["--data", str(tiny_shards), "--out-dir", str(tmp_path / "out"), "--recipe", "speedrun",
                *map(str, FLAGS), "--n-layer", "1", "--steps", "1", "--ckpt-every", "0"]
    cases = [([*speedrun, "--init-from", str(tiny_model_file)], "llm.c model file",
              "--recipe speedrun takes"),
             ([*speedrun, "--n-embd", "256", "--n-head", "4"], "--n-head 4", "has 2 of them"),
             ([*speedrun, "--scan-layers"], "--scan-layers", "no L axis")]
    assert_refused(tj.main, cases)
    assert not (tmp_path / "out").exists()
    proc = run_script("train_gpt2_jax.py", *cases[0][0], env={"JAX_PLATFORMS": "cpu"}, check=False)
    assert_clean_error(proc, "llm.c model file")


def test_signals_stop_at_a_step_boundary_and_resume_is_exact(runs, tiny_shards, tmp_path):
    """SIGINT, then SIGTERM in the resumed run, each stopping at a step boundary with a checkpoint (as
    test_trainers.py checks the gpt2 recipe): --resume auto logs the "recipe" run's values bit for bit."""
    out = tmp_path / "out"
    argv = ["train_gpt2_jax.py", *FLAGS, "--data", tiny_shards, "--dtype", "fp32", "--out-dir", out,
            "--ckpt-every", 3]
    env = {"JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    got = stop_by_signals_and_resume(argv, ["--seed", 0], out, env)
    assert_same_step_values(got, step_events(runs("recipe")[0]))
