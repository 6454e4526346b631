"""train_gpt2_triton.py --recompute: every level gives level none's numbers bit for bit, and block holds less.
In fp32, both recipes: 3 steps of 2 micro-batches give the same train losses and grad norms at none,
pointwise and block (backend torch), one step's 2 micro-batches the same token losses and every gradient
(backend triton, in Triton's interpreter without a GPU); a checkpoint written at none resumes at block
with the uninterrupted run's numbers. Memory, at L4 C256 T512 B8 (activations dominate): pointwise keeps
what none keeps (this trainer's none already recomputes the norms' outputs and the MLP activation), block
keeps strictly less, measured two ways on one forward+backward: the bytes of the distinct storages of the
saved tensors at their peak (the forward's `acts`, and at block each rerun block with them), which
Recipe.activation_bytes must match within 15%, and the real peak of the profiler's memory events (the
running sum of allocation sizes, peak minus the bytes live before), whose drop from none to block must be
the accounting's drop within 15% (the rest of that peak is backend torch's temporaries, equal at every
level)."""
import dataclasses

import numpy as np
import pytest
import torch

import train_gpt2_triton as tg
from conftest import allocated_bytes, speedrun_random_weights, step_events
from train_gpt2_jax import RECOMPUTE_LEVELS

LEVELS = RECOMPUTE_LEVELS
RERUN = {"gpt2": "gpt2_block_rerun", "speedrun": "speedrun_block_rerun"}  # the backward's rerun of a block


def tiny(recipe, level, backend="torch", **kw):
    """(cfg, training state) of a 2-layer fp32 model of `recipe` at --recompute `level` (61-token vocab; the
    speedrun model one 128-wide head wide) from random nonzero weights: unlike the inits (LayerNorm's ones,
    the speedrun's zero projections), every weight differs from every other and gets a gradient at once."""
    shape = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=61, padded_vocab_size=64, seq_len=8,
                 batch_size=2, total_batch_size=32)
    if recipe == "speedrun":
        shape.update(recipe=recipe, n_embd=tg.HEAD_DIM)
    cfg = tg.Config(**{**shape, **kw}, dtype="fp32", recompute=level, backend=backend)
    if recipe == "speedrun":  # its head count follows from the width
        cfg = dataclasses.replace(cfg, n_head=cfg.n_embd // tg.HEAD_DIM)
    params = speedrun_random_weights(tg.param_shapes(cfg), 4)
    muon = tg.muon_names(tg.param_shapes(cfg))
    zeros = {k: np.zeros_like(p) for k, p in params.items()}
    return cfg, tg.make_state(params, zeros, {k: z for k, z in zeros.items() if k not in muon}, cfg,
                              torch.device("cpu"))


def batches(cfg, n, seed=0):
    """n steps' (xs, ys), each (2, B, T): two micro-batches, so that the gradients accumulate."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(cfg.vocab_size, (2, cfg.batch_size, cfg.seq_len), generator=g) for _ in "xy")
            for _ in range(n)]


@pytest.mark.parametrize("recipe", tg.RECIPES)
def test_every_level_trains_as_none(recipe, one_thread):
    """Backend torch, fp32: 3 steps of 2 micro-batches give the same (train loss, grad norm) pairs, bit for
    bit, at every level (the same ops in the same order), and the steps do move the model."""
    got = {}
    for level in LEVELS:
        cfg, state = tiny(recipe, level)
        ops = tg.backend_ops("torch", recipe)
        got[level] = [tg.train_step(state, xs, ys, step, cfg, ops, 1)
                      for step, (xs, ys) in enumerate(batches(cfg, 3), 1)]
    assert got["pointwise"] == got["none"] and got["block"] == got["none"], got
    assert len({loss for loss, _ in got["none"]}) == 3


@pytest.mark.parametrize("recipe", tg.RECIPES)
def test_block_matches_none_in_backend_triton(recipe, one_thread):
    """Backend triton (Triton's interpreter without a GPU), fp32: at block, forward_backward over 2
    micro-batches gives none's token losses and every accumulated gradient bit for bit (pointwise runs
    none's code: backend torch's test covers it)."""
    got = {}
    for level in ("none", "block"):
        cfg, state = tiny(recipe, level, backend="triton")
        ops = tg.backend_ops("triton", recipe)
        (xs, ys), = batches(cfg, 1)
        with torch.no_grad():
            losses = [tg.forward_backward(state["weights"], state["grads"], x, y, cfg, ops, 1.0)
                      for x, y in zip(xs, ys)]
        got[level] = torch.cat(losses), state["grad_buffer"]
    assert torch.equal(got["block"][0], got["none"][0])
    assert torch.equal(got["block"][1], got["none"][1]) and got["none"][1].abs().sum() > 0


def test_a_checkpoint_resumes_at_another_level(tmp_path, one_thread):
    """A run at none saves at step 2; resumed from there at block, steps 3 and 4 log the uninterrupted
    run's train losses, grad norms and lrs bit for bit."""
    flags = ["torch", "--data", "synthetic", "--n-layer", "2", "--n-head", "2", "--n-embd", "32",
             "--seq-len", "16", "--batch-size", "2", "--total-batch-size", "64", "--dtype", "fp32",
             "--steps", "4", "--lr", "3e-3", "--warmup", "1", "--val-every", "0", "--hellaswag-every", "0",
             "--sample-every", "0"]
    tg.main([*flags, "--recompute", "none", "--ckpt-every", "2", "--out-dir", str(tmp_path / "none")])
    tg.main([*flags, "--recompute", "block", "--ckpt-every", "0", "--out-dir", str(tmp_path / "block"),
             "--resume", str(tmp_path / "none" / "ckpt_0000002")])
    keys = ("step", "train_loss", "grad_norm", "lr")
    whole, resumed = step_events(tmp_path / "none"), step_events(tmp_path / "block")
    assert [[e[k] for k in keys] for e in resumed] == [[e[k] for k in keys] for e in whole[2:]]
    assert [e["step"] for e in resumed] == [3, 4]


def memory(recipe, level, monkeypatch):
    """(cfg, saved, peak): bytes of one forward+backward (forward_backward) of the L4 C256 T512 B8 fp32 model:
    saved, the distinct storages of the saved tensors at their peak: the forward's `acts` when it returns,
    and at block `acts` with each block the backward reruns, as the rerun returns it; peak, the profiler's
    running sum of allocation sizes at its highest (0 when it starts)."""
    cfg, state = tiny(recipe, level, n_layer=4, n_head=4, n_embd=256, block_size=512, seq_len=512,
                      batch_size=8, total_batch_size=4096)
    recipe_row, rerun = tg.RECIPES[recipe], getattr(tg, RERUN[recipe])
    seen, saved = [], []

    def forward(w, idx, cfg, ops, acts=None):
        h = recipe_row.forward(w, idx, cfg, ops, acts)
        seen.append(acts)
        saved.append(allocated_bytes(acts))
        return h

    def rerunning(*args):
        block = rerun(*args)
        saved.append(allocated_bytes([seen[0], block]))
        return block
    monkeypatch.setitem(tg.RECIPES, recipe, dataclasses.replace(recipe_row, forward=forward))
    monkeypatch.setattr(tg, RERUN[recipe], rerunning)
    (xs, ys), = batches(cfg, 1)  # (2, B, T) each: its first micro-batch runs
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                 profile_memory=True) as prof:
        tg.forward_backward(state["weights"], state["grads"], xs[0], ys[0], cfg,
                            tg.backend_ops("torch", recipe), 1.0)
    sizes = [e.nbytes() for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
             if e.name() == "[memory]"]
    assert len(saved) == (1 + cfg.n_layer if level == "block" else 1)
    return cfg, max(saved), int(np.max(np.cumsum(sizes)))


@pytest.mark.parametrize("recipe", tg.RECIPES)
def test_block_holds_less_and_the_accounting_is_measured(recipe, monkeypatch, one_thread):
    """At L4 C256 T512 B8 fp32: the saved tensors' storages at their peak are pointwise's = none's > block's,
    and so are the profiler's real peaks; Recipe.activation_bytes is within 15% of the saved storages at
    every level, and its drop from none to block within 15% of the real peak's drop."""
    saved, peak, accounted = {}, {}, {}
    for level in LEVELS:
        cfg, saved[level], peak[level] = memory(recipe, level, monkeypatch)
        accounted[level] = tg.RECIPES[recipe].activation_bytes(cfg)
        monkeypatch.undo()
    assert saved["pointwise"] == saved["none"] > saved["block"], saved
    assert peak["pointwise"] == peak["none"] > peak["block"], peak
    for level in LEVELS:
        assert accounted[level] == pytest.approx(saved[level], rel=0.15), (level, accounted, saved)
    assert accounted["none"] - accounted["block"] == pytest.approx(peak["none"] - peak["block"], rel=0.15), \
        (accounted, peak)
