"""train_gpt2_torchfunc.py --recompute: each level trains as none does, and holds less than the one before.
In fp32, both recipes: 3 steps of 2 micro-batches give level none's train losses, grad norms and gradients
at pointwise and block, bit for bit except the speedrun recipe's pointwise (within 1e-6: its RMSNorm is a
composite of ops, whose gradient at x + attention autograd sums in another order than LinearsAfter's
backward returns it); compiled (Dynamo's and AOTAutograd's graph, run op by op), each level's gradients
are its eager ones bit for bit, and each rerun waits on after() there; a checkpoint written at block
resumes at none with the uninterrupted run's numbers. Memory, at L4 C256 T512 B8 fp32 with a 64-token
vocabulary (so that the blocks' activations, not the head's, dominate): the real peak of one eager
forward+backward (the profiler's running sum of allocation sizes, peak minus the bytes live before) falls
strictly from none to pointwise to block, and Recipe.activation_bytes is within 15% of it at every level,
and so is what each level saves on the one before."""
import dataclasses

import numpy as np
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import train_gpt2_torchfunc as tf
from conftest import speedrun_random_weights, step_events
from train_gpt2_jax import RECOMPUTE_LEVELS

CPU = torch.device("cpu")
LEVELS = RECOMPUTE_LEVELS


def tiny(recipe, level, **kw):
    """(cfg, training state) of a 2-layer fp32 model of `recipe` at --recompute `level` (61-token vocab; the
    speedrun model one 128-wide head) from random nonzero weights: unlike the inits (LayerNorm's ones, the
    speedrun's zero projections), every weight gets a gradient at once."""
    shape = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=61, padded_vocab_size=64,
                 seq_len=16, batch_size=2, total_batch_size=64)
    if recipe == "speedrun":
        shape.update(recipe=recipe, n_embd=tf.HEAD_DIM, n_head=1)
    cfg = tf.Config(**{**shape, **kw}, dtype="fp32", recompute=level, compile=0)
    params = speedrun_random_weights(tf.param_shapes(cfg), 4)
    zeros = {k: np.zeros_like(p) for k, p in params.items()}
    return cfg, tf.make_state(params, zeros, zeros, cfg, CPU, 0, 1)


def batches(cfg, n):
    """n steps' (xs, ys), each (2, B, T): two micro-batches, so that the gradients accumulate."""
    g = torch.Generator().manual_seed(0)
    shape = (2, cfg.batch_size, cfg.seq_len)
    return [tuple(torch.randint(cfg.vocab_size, shape, generator=g) for _ in "xy") for _ in range(n)]


@pytest.mark.parametrize("recipe", tf.RECIPES)
def test_every_level_trains_as_none(recipe, one_thread):
    """Eager, fp32: 3 steps of 2 micro-batches give none's (train loss, grad norm) pairs and summed gradients
    at every level: bit for bit, but the speedrun's pointwise within 1e-6; and the steps move the model."""
    got, grads = {}, {}
    for level in LEVELS:
        cfg, state = tiny(recipe, level)
        row = tf.RECIPES[recipe]
        got[level], grads[level] = [], []
        for step, (xs, ys) in enumerate(batches(cfg, 3), 1):
            loss, norm = tf.train_step(state, xs, ys, row.scalars(step, cfg, CPU), cfg, tf.grads_and_loss,
                                       row.update, 1)
            got[level].append((loss.item(), norm.item()))
            grads[level].append(state["grad_buffer"].clone())                   # (P,) every gradient
    assert got["block"] == got["none"], got
    assert all(torch.equal(a, b) for a, b in zip(grads["block"], grads["none"]))
    if recipe == "speedrun":
        assert np.asarray(got["pointwise"]) == pytest.approx(np.asarray(got["none"]), rel=1e-6), got
        assert all((a - b).norm() < 1e-6 * b.norm() for a, b in zip(grads["pointwise"], grads["none"]))
    else:
        assert got["pointwise"] == got["none"], got
        assert all(torch.equal(a, b) for a, b in zip(grads["pointwise"], grads["none"]))
    assert len({loss for loss, _ in got["none"]}) == 3


# the reruns per block that wait for their gradient through after(): pointwise's LinearsAfter (3) and the
# speedrun's attention (1), block's one Recomputed
AFTERS = {"gpt2": {"pointwise": 3, "block": 1}, "speedrun": {"pointwise": 4, "block": 1}}


@pytest.mark.parametrize("recipe", tf.RECIPES)
def test_compiled_levels_give_eager_gradients(recipe, one_thread):
    """torch.compile (fullgraph; AOTAutograd's graph run op by op, as backend aot_eager does) traces
    pointwise's and block's autograd.Functions, their torch.func reruns and after(): one micro-batch's loss
    and every gradient equal the eager ones at that level bit for bit, and the graph that Inductor would
    get holds each rerun's after(), which keeps Inductor from fusing the rerun into the forward's kernels.
    The evaluations' compiled token losses (no gradient: no rerun) are none's."""
    cfg, state = tiny(recipe, "none")
    (xs, ys), = batches(cfg, 1)
    row = tf.RECIPES[recipe]
    losses = row.token_losses(state["weights"], xs[0], ys[0], cfg)                  # (B,T)
    for level in LEVELS[1:]:
        at = dataclasses.replace(cfg, recompute=level)
        grads, loss = tf.grads_and_loss(state["weights"], xs[0], ys[0], 1.0, at)
        graphs = []

        def keep(gm, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)
        torch._dynamo.reset()
        grad_fn = torch.compile(tf.grads_and_loss, fullgraph=True, backend=aot_autograd(fw_compiler=keep))
        got, got_loss = grad_fn(state["weights"], xs[0], ys[0], 1.0, at)
        assert torch.equal(got_loss, loss), level
        assert all(torch.equal(got[k], grads[k]) for k in grads), level
        (graph,) = graphs
        afters = [n for n in graph.graph.nodes if n.target is torch.ops.llmc.after.default]
        assert len(afters) == AFTERS[recipe][level] * cfg.n_layer, (level, len(afters))
        torch._dynamo.reset()
        row_losses = torch.compile(row.token_losses, fullgraph=True, backend="aot_eager")
        assert torch.equal(row_losses(state["weights"], xs[0], ys[0], at), losses), level


def test_a_checkpoint_resumes_at_another_level(tmp_path, one_thread):
    """A run at block saves at step 2; resumed from there at none, steps 3 and 4 log the uninterrupted run's
    train losses, grad norms and lrs bit for bit."""
    flags = ["--data", "synthetic", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "16",
             "--batch-size", "2", "--total-batch-size", "64", "--dtype", "fp32", "--compile", "0",
             "--steps", "4", "--lr", "3e-3", "--warmup", "1", "--val-every", "0", "--hellaswag-every", "0",
             "--sample-every", "0"]
    tf.main([*flags, "--recompute", "block", "--ckpt-every", "2", "--out-dir", str(tmp_path / "block")])
    tf.main([*flags, "--recompute", "none", "--ckpt-every", "0", "--out-dir", str(tmp_path / "none"),
             "--resume", str(tmp_path / "block" / "ckpt_0000002")])
    keys = ("step", "train_loss", "grad_norm", "lr")
    whole, resumed = step_events(tmp_path / "block"), step_events(tmp_path / "none")
    assert [e["step"] for e in resumed] == [3, 4]
    assert [[e[k] for k in keys] for e in resumed] == [[e[k] for k in keys] for e in whole[2:]]


def peak_bytes(recipe, level):
    """(cfg, bytes): the profiler's running sum of allocation sizes at its highest over one eager
    forward+backward (grads_and_loss) of the L4 C256 T512 B8 fp32 model, 64-token vocabulary, at `level`."""
    cfg, state = tiny(recipe, level, n_layer=4, n_head=4, n_embd=256, block_size=512, seq_len=512,
                      batch_size=8, total_batch_size=4096)
    if recipe == "speedrun":
        cfg = dataclasses.replace(cfg, n_head=cfg.n_embd // tf.HEAD_DIM)
    (xs, ys), = batches(cfg, 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        tf.grads_and_loss(state["weights"], xs[0], ys[0], 1.0, cfg)
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    sizes = [e.nbytes() for e in events if e.name() == "[memory]"]  # + allocated, - freed
    return cfg, int(np.max(np.cumsum(sizes)))


@pytest.mark.parametrize("recipe", tf.RECIPES)
def test_each_level_holds_less_and_the_accounting_is_measured(recipe, one_thread):
    """At L4 C256 T512 B8 fp32 (64-token vocabulary): the real peak of one forward+backward falls strictly
    from none to pointwise to block; Recipe.activation_bytes is within 15% of it at every level, and so is
    what each level saves on the one before."""
    peak, accounted = {}, {}
    for level in LEVELS:
        cfg, peak[level] = peak_bytes(recipe, level)
        accounted[level] = tf.RECIPES[recipe].activation_bytes(cfg)
    assert peak["none"] > peak["pointwise"] > peak["block"], peak
    for level in LEVELS:
        assert accounted[level] == pytest.approx(peak[level], rel=0.15), (level, accounted, peak)
    for before, level in zip(LEVELS, LEVELS[1:]):
        assert accounted[before] - accounted[level] == pytest.approx(peak[before] - peak[level], rel=0.15), \
            (level, accounted, peak)
