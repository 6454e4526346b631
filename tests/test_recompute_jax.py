"""--recompute in train_gpt2_jax.py: every level trains as level none does, a checkpoint moves between levels,
and each level keeps less activation memory than the one before, as activation_bytes accounts for it (both
recipes, fp32, on the CPU).

What is bit for bit (fp32, CPU): the forward at every level, so each run's first loss, asserted equal. The
gradients need not be: a checkpointed block's backward is another program for XLA, its sums rounded in
another order (a policy that saves everything, recomputing nothing, differs as well), by up to 4.3e-7 of a
tensor's largest gradient measured. In the runs here gpt2's three steps come out bit for bit
at both levels, unrolled and scanned, and the speedrun recipe's first two (its third within 9e-8); the test
holds the later losses and every grad norm to 1e-6 relative."""
from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest

import train_gpt2_jax as tg
from conftest import speedrun_random_weights, step_events
from train_gpt2_jax import RECOMPUTE_LEVELS

RTOL = 1e-6
# tiny models, 3 steps of 2 micro-batches of 2 x 32 tokens: one block (each run's time is its compilation),
# two where they are scanned (XLA unrolls a loop of one); the speedrun model from random weights (its init's
# zero projections would leave the block without a gradient at the first step)
FLAGS = ["--seq-len", "32", "--batch-size", "2", "--total-batch-size", "64", "--steps", "3",
         "--dtype", "fp32", "--val-every", "0", "--hellaswag-every", "0", "--sample-every", "0"]
CASES = {"gpt2": ["--n-layer", "1", "--n-head", "4", "--n-embd", "64"],
         "gpt2 --scan-layers": ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--scan-layers"],
         "speedrun": ["--recipe", "speedrun", "--n-layer", "1", "--n-embd", "128"]}


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory):
    """runs(case, level) -> the out dir of CASES[case] trained at --recompute level in this process, each run
    once, when first asked for; level none's runs checkpoint step 2."""
    folder = tmp_path_factory.mktemp("recompute")
    done = {}

    def get(case, level):
        if (case, level) not in done:
            argv = [*FLAGS, *CASES[case], "--data", str(tiny_shards),
                    "--ckpt-every", "2" if level == "none" else "0"]
            if "speedrun" in CASES[case]:
                init = folder / "speedrun_init.safetensors"
                if not init.exists():
                    cfg, _ = tg.parse_args(argv)
                    tg.write_speedrun_file(str(init), speedrun_random_weights(tg.param_shapes(cfg), 3), cfg)
                argv += ["--init-from", str(init)]
            out = folder / f"{case}_{level}".replace(" ", "")
            tg.main([*argv, "--recompute", level, "--out-dir", str(out)])
            done[case, level] = out
        return done[case, level]
    return get


def assert_same_steps(got, expected):
    """Step by step: the same lr, the first train loss bit for bit, the others and the grad norms within
    RTOL."""
    assert [e["step"] for e in got] == [e["step"] for e in expected]
    assert [e["lr"] for e in got] == [e["lr"] for e in expected]
    assert got[0]["train_loss"] == expected[0]["train_loss"]
    for key in ("train_loss", "grad_norm"):
        assert [e[key] for e in got] == pytest.approx([e[key] for e in expected], rel=RTOL, abs=0), key


@pytest.mark.parametrize("case", CASES)
def test_every_level_trains_as_none_does(runs, case):
    """3 steps at pointwise and at block log level none's train losses and grad norms (see the module's
    docstring for the tolerance), the layers unrolled or scanned (gpt2) and in the speedrun recipe."""
    expected = step_events(runs(case, "none"))
    assert len(expected) == 3
    for level in ("pointwise", "block"):
        assert_same_steps(step_events(runs(case, level)), expected)


def test_a_checkpoint_resumes_at_another_level(runs, tiny_shards, tmp_path):
    """gpt2's step-2 checkpoint of level none, resumed at block, logs none's step 3."""
    argv = [*FLAGS, *CASES["gpt2"], "--data", str(tiny_shards), "--ckpt-every", "0"]
    tg.main([*argv, "--recompute", "block", "--resume", str(runs("gpt2", "none") / "ckpt_0000002"),
             "--out-dir", str(tmp_path / "resumed")])
    assert_same_steps(step_events(tmp_path / "resumed"), step_events(runs("gpt2", "none"))[2:])


def temp_bytes(cfg):
    """XLA's temp allocation (memory_analysis) for one micro-batch's forward+backward on the CPU, as
    train_step's micro_step runs it: the loss's gradient added into fp32 sums that live through it (donated,
    as train_step's scan carries them), so that no activation can sit in a gradient's not yet written
    output buffer. Compiled at LLVM's optimization level 0, which halves the time and leaves XLA's buffer
    assignment as it is."""
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    weights = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=cpu) for k, s in tg.param_shapes(cfg).items()}
    tokens = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32, sharding=cpu)

    def micro_step(weights, sums, x, y):
        loss, grads = jax.value_and_grad(lambda w: tg.loss_fn(w, x, y, cfg))(weights)
        return loss, {k: sums[k] + grads[k] for k in sums}
    lowered = jax.jit(micro_step, donate_argnums=1).lower(weights, weights, tokens, tokens)
    compiled = lowered.compile(compiler_options={"xla_backend_optimization_level": 0})
    return compiled.memory_analysis().temp_size_in_bytes


def memory_flags(recipe):
    """L4 C256 T512 B8 fp32: gpt2 with 4 heads, the speedrun model with 2 of 128."""
    return ["--recipe", recipe, "--n-layer", "4", "--n-embd", "256", "--seq-len", "512", "--batch-size", "8",
            "--dtype", "fp32", *(["--n-head", "4"] if recipe == "gpt2" else [])]


@pytest.mark.parametrize("recipe", ["gpt2", "speedrun"])
def test_each_level_keeps_less_as_accounted(recipe):
    """memory_flags, one micro-batch, the layers unrolled: what the four blocks add to XLA's temp bytes
    (temp_bytes less that of the same model without blocks, whose head's share no level changes) falls
    strictly from none to pointwise to block, and activation_bytes' blocks (its count less that of no
    blocks) are within 15% of it at each level."""
    flags = memory_flags(recipe)
    head_temp = temp_bytes(replace(tg.parse_args(flags)[0], n_layer=0))
    count = tg.RECIPES[recipe].activation_bytes
    measured, accounted = {}, {}
    for level in RECOMPUTE_LEVELS:
        cfg, _ = tg.parse_args([*flags, "--recompute", level])
        measured[level] = temp_bytes(cfg) - head_temp
        accounted[level] = count(cfg) - count(replace(cfg, n_layer=0))
    assert measured["none"] > measured["pointwise"] > measured["block"] > 0, measured
    for level in RECOMPUTE_LEVELS:
        assert accounted[level] == pytest.approx(measured[level], rel=0.15), (level, measured, accounted)


def test_scanned_layers_keep_less_too():
    """gpt2's memory_flags with --scan-layers: XLA's temp bytes fall strictly from level to level too. (Not
    held to activation_bytes: XLA keeps the scan's per-layer stacks its own way, 14% below the count at
    none, and has the backward loop's (L, ...) weight gradients allocated at the peak.)"""
    temps = [temp_bytes(tg.parse_args([*memory_flags("gpt2"), "--scan-layers", "--recompute", level])[0])
             for level in RECOMPUTE_LEVELS]
    assert temps == sorted(temps, reverse=True) and len(set(temps)) == len(temps), temps
