"""Cross-framework: every GPT-2 trainer against llm.c's recipe and against each other."""
import pytest

import llmc_reference
from conftest import run_script, read_log, step_events

# log.jsonl's framework name: the command line that runs it. Backend triton is held to backend torch
# in tests/test_triton.py (same shards, same model file, fp32): on the CPU its kernels run in Triton's
# interpreter, where these six steps with the 50304-wide lm head would take over five minutes.
TRAINERS = {
    "jax": ["train_gpt2_jax.py"],
    "torchfunc": ["train_gpt2_torchfunc.py"],
    "triton-torch": ["train_gpt2_triton.py", "torch"],
}
B, T, TOTAL, STEPS, LR, WARMUP = 4, 32, 256, 6, 1e-3, 2  # two micro-batches per step
FLAGS = ["--seq-len", T, "--batch-size", B, "--total-batch-size", TOTAL, "--lr", LR, "--warmup", WARMUP,
         "--dtype", "fp32", "--val-steps", 2, "--hellaswag-every", 0, "--sample-every", 0]
# fp32 trainers against the float64 reference: summation order and fp32 rounding only
LOSS_RTOL, NORM_RTOL = 2e-5, 2e-4


@pytest.fixture(scope="module")
def reference(tiny_shards, tiny_model_file):
    """llm.c's recipe in float64 (tests/llmc_reference.py) for the schedules the tests below use."""
    files = lambda kind: sorted(str(p) for p in tiny_shards.glob(f"*_{kind}_*.bin"))  # noqa: E731
    run = lambda decay: llmc_reference.train(  # noqa: E731
        tiny_model_file, files("train"), B, T, TOTAL, STEPS, LR, WARMUP, decay_frac=decay,
        val_files=files("val"), val_steps=2)
    return {"cosine": run(0.0), "constant": run(1.0)}


def check_against(reference, events, vals, first_step):
    for e in events:
        loss, norm, lr, _ = reference[e["step"] - 1]
        assert e["train_loss"] == pytest.approx(loss, rel=LOSS_RTOL), f"step {e['step']} loss"
        assert e["grad_norm"] == pytest.approx(norm, rel=NORM_RTOL), f"step {e['step']} grad norm"
        assert e["lr"] == pytest.approx(lr, rel=1e-9), f"step {e['step']} lr"
    for e in vals:
        assert e["val_loss"] == pytest.approx(reference[e["step"] - 1][3], rel=LOSS_RTOL), \
            f"step {e['step']} val loss"
    assert [e["step"] for e in events] == list(range(first_step, first_step + len(events)))


@pytest.mark.parametrize("framework", TRAINERS)
def test_trainer_matches_llmc_recipe(framework, reference, tiny_shards, tiny_model_file, tmp_path):
    """In fp32, from the same llm.c model file and shards, the trainer's per-step train loss, grad norm,
    lr and val loss equal llm.c's recipe run in float64 by stock PyTorch (loss rel 2e-5, norm 2e-4)."""
    out = tmp_path / framework
    run_script(*TRAINERS[framework], "--data", tiny_shards, "--init-from", tiny_model_file,
               "--steps", STEPS, "--out-dir", out, "--val-every", 1, "--ckpt-every", 0, *FLAGS)
    events = step_events(out)
    assert len(events) == STEPS and all(e["framework"] == framework for e in events)
    check_against(reference["cosine"], events, [e for e in read_log(out) if "val_loss" in e], 1)


def test_checkpoint_passes_between_frameworks(reference, tiny_shards, tiny_model_file, tmp_path):
    """One run handed on through checkpoints: JAX trains steps 1-2, torchfunc resumes for 3-4, the
    Triton trainer (torch backend) for 5-6; every step equals the uninterrupted reference run."""
    chain = [("jax", 2), ("torchfunc", 4), ("triton-torch", 6)]
    ckpt = None
    for framework, until in chain:
        out = tmp_path / framework
        start = ["--resume", ckpt] if ckpt else ["--init-from", tiny_model_file]
        run_script(*TRAINERS[framework], "--data", tiny_shards, *start, "--steps", until,
                   "--lr-decay-frac", 1.0, "--out-dir", out, "--val-every", 0, "--ckpt-every", until,
                   *FLAGS)
        events = step_events(out)
        check_against(reference["constant"], events, [], until - 1 if ckpt else 1)
        ckpt = out / f"ckpt_{until:07d}"
