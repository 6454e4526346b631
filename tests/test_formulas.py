"""Formulas that a whole run can get wrong and still pass its end-to-end comparisons, each checked directly
in every GPT-2 trainer on small tensors: GPT-2's init and the speedrun's, clipping, the tensors weight decay
reaches, the speedrun head's soft cap and its per-head QK norm, and the Triton trainer's hand-derived GELU
backward. "triton-torch" and "triton-triton" are the Triton trainer's two backends (Triton's interpreter
without a GPU)."""
import math
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import Mesh

import speedrun_reference as ref
import train_gpt2_jax as tj
import train_gpt2_torchfunc as tf
import train_gpt2_triton as tg
from conftest import speedrun_random_weights

MODULES = {"jax": tj, "torchfunc": tf, "triton": tg}
STEPPERS = ["jax", "torchfunc", "triton-torch", "triton-triton"]  # a trainer, and the Triton one's backend
CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where backend triton runs


def small_cfg(module, recipe="gpt2", **kw):
    """A trainer's Config of a tiny model with a 61-token vocabulary (padded to 64), fp32; the speedrun's one
    128-wide head and one block."""
    shape = dict(n_layer=2, n_head=2, n_embd=16) if recipe == "gpt2" else dict(n_layer=1, n_head=1, n_embd=128)
    return module.Config(**{**dict(recipe=recipe, block_size=8, vocab_size=61, padded_vocab_size=64, seq_len=8,
                                   batch_size=2, total_batch_size=32, dtype="fp32", **shape), **kw})


def assert_drawn(p, std, what):
    """p's values look drawn from N(0, std): its std and mean within 5 standard errors of the formula's."""
    n = p.size
    assert abs(p.std() / std - 1) < 5 / math.sqrt(2 * n), f"{what}: std {p.std():.5g}, expected {std:.5g}"
    assert abs(p.mean()) < 5 * std / math.sqrt(n), f"{what}: mean {p.mean():.3g}, expected 0"


# -----------------------------------------------------------------------------
# Init

@pytest.mark.parametrize("name", MODULES)
def test_gpt2_init_follows_its_formula(name):
    """GPT-2's init as each trainer's recipe draws it (what its main calls): biases 0, LayerNorm gains 1,
    wte's padded rows 0, the residual projections attn.c_proj.w and mlp.c_proj.w N(0, 0.02 / sqrt(2 n_layer)),
    every other weight N(0, 0.02)."""
    m = MODULES[name]
    cfg = m.Config(n_layer=4, n_head=4, n_embd=64, block_size=64, seed=0)
    params = m.RECIPES["gpt2"].init(cfg)
    assert list(params) == list(m.gpt2_shapes(cfg))
    for k, p in params.items():
        assert p.dtype == np.float32 and p.shape == m.gpt2_shapes(cfg)[k], k
        if k.endswith(".b"):
            assert not p.any(), k
        elif k.startswith("ln"):
            assert (p == 1).all(), k
        else:
            if k == "wte":
                assert not p[cfg.vocab_size:].any(), "wte's padded rows"
                p = p[:cfg.vocab_size]
            assert_drawn(p, 0.02 / math.sqrt(2 * cfg.n_layer) if k.endswith("c_proj.w") else 0.02, k)


@pytest.mark.parametrize("name", MODULES)
def test_speedrun_init_is_the_references(name):
    """The speedrun recipe's init as each trainer draws it from --seed is, tensor for tensor, the outside
    reference's init_state_dict of that seed, and follows modded-nanogpt's formulas: every *proj* weight and
    every bias 0, gains 1, embed N(0, 1), the q, k, v and fc weights N(0, 0.33 / fan_in)."""
    m = MODULES[name]
    cfg = small_cfg(m, "speedrun", n_layer=2, vocab_size=50257, padded_vocab_size=50304, seed=3)
    params = m.RECIPES["speedrun"].init(cfg)
    want = ref.init_state_dict(cfg.n_layer, cfg.n_embd, 3)
    assert set(params) == {k for k in want if not k.endswith("angular_freq")}
    for k, p in params.items():
        np.testing.assert_array_equal(p, want[k], err_msg=k)
        if k.endswith(".gains"):
            assert (p == 1).all(), k
        elif "proj" in k or k.endswith(".bias"):
            assert not p.any(), k
        else:
            assert_drawn(p, 1.0 if k == "embed.weight" else math.sqrt(0.33 / p.shape[1]), k)


# -----------------------------------------------------------------------------
# An optimizer step: clipping, and which tensors weight decay reaches

def first_moments(stepper, cfg, params, x, y):
    """(grad norm, {name: AdamW's first moment}) after one training step of `stepper` from params and zero
    moments on micro-batches x, y (A,B,T): the moment is (1 - beta1) times the clipped gradient."""
    zeros = {k: np.zeros_like(p) for k, p in params.items()}
    if stepper == "torchfunc":
        state = tf.make_state(params, zeros, zeros, cfg, CPU, 0, 1)
        _, norm = tf.train_step(state, torch.from_numpy(x), torch.from_numpy(y), tf.adam_scalars(1, cfg, CPU),
                                cfg, tf.grads_and_loss, tf.adamw_update, 1)
        return norm.item(), {k: t.numpy() for k, t in state["m"].items()}
    state = tg.make_state(params, zeros, zeros, cfg, CPU)
    _, norm = tg.train_step(state, torch.from_numpy(x), torch.from_numpy(y), 1, cfg, tg.TORCH_OPS, 1)
    return norm, {k: t.numpy() for k, t in state["m"].items()}


@pytest.mark.parametrize("stepper", ["torchfunc", "triton-torch"])
def test_clipping_scales_only_a_norm_above_the_limit(stepper, one_thread):
    """--grad-clip scales the gradients by min(1, clip / (norm + 1e-6)): with the norm below the limit the
    step's gradients are the unclipped ones exactly, above it they are scaled by that coefficient (seen in
    AdamW's first moment after one step, (1 - beta1) g: Adam's own step hardly depends on g's scale)."""
    m = MODULES[stepper.split("-")[0]]
    cfg = small_cfg(m, grad_clip=0.0)
    params = m.RECIPES["gpt2"].init(cfg)
    x, y = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 1, 2, 8))  # (A,B,T) each
    norm, unclipped = first_moments(stepper, cfg, params, x, y)
    _, below = first_moments(stepper, small_cfg(m, grad_clip=2 * norm), params, x, y)
    for k in unclipped:
        np.testing.assert_array_equal(below[k], unclipped[k], err_msg=f"{k}, the norm below the limit")
    _, above = first_moments(stepper, small_cfg(m, grad_clip=norm / 4), params, x, y)
    coef = (norm / 4) / (norm + 1e-6)
    for k in unclipped:
        np.testing.assert_allclose(above[k], unclipped[k] * coef, rtol=1e-6, err_msg=f"{k}, the norm above it")


def test_clipping_scales_only_a_norm_above_the_limit_jax(monkeypatch):
    """test_clipping_scales_only_a_norm_above_the_limit in the JAX trainer, whose step compiles anew for each
    --grad-clip: one compiled step, of a toy loss 1e-3 x token id x the sum of all weights, whose gradient
    1e-3 a at every weight the tokens (all a) set: a = 1 puts the norm below --grad-clip 1, a = 50 above."""
    monkeypatch.setitem(tj.RECIPES, "gpt2", replace(
        tj.RECIPES["gpt2"], token_losses=lambda p, x, y, cfg, train=False: 1e-3 * x * sum(map(jnp.sum, p.values()))))
    cfg = small_cfg(tj, grad_clip=1.0)
    params = tj.RECIPES["gpt2"].init(cfg)
    zeros = {k: np.zeros_like(p) for k, p in params.items()}
    layout = tj.state_layout(cfg, Mesh(np.array(jax.devices()[:1]), ("data",)))
    step = jax.jit(partial(tj.train_step, cfg=cfg, layout=layout))
    for a in (1, 50):
        x = np.full((2, 1, 2, 8), a, np.int32)                                     # (A,B,T)
        _, m, _, _, _, norm = step(params, zeros, zeros, {}, x, x, tj.adam_scalars(1, cfg))
        g = 1e-3 * a * min(1.0, 1.0 / (float(norm) + 1e-6))  # the clipped gradient at every weight
        assert (float(norm) < 1) == (a == 1)
        for k, t in m.items():
            np.testing.assert_allclose(t, np.full(t.shape, 0.1 * g), rtol=1e-5, err_msg=f"{k}, token {a}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_triton_clip_by_norm_scales_only_a_norm_above_the_limit(backend):
    """The Triton trainer's clip_by_norm op in each backend, on flat gradients: a norm below the limit leaves
    them as they are, one above scales them by clip / (norm + 1e-6)."""
    ops, device = tg.backend_ops(backend), DEVICE if backend == "triton" else CPU
    g = torch.randn(3000, generator=torch.Generator().manual_seed(2)).to(device)  # (n,) norm about 55
    for norm, coef in ((50.0, 1.0), (60.0, 55 / (60 + 1e-6))):
        flat = g.clone()
        ops.clip_by_norm(flat, torch.tensor(norm, device=device), 55.0)
        torch.testing.assert_close(flat, g * coef, rtol=0 if coef == 1 else 1e-6, atol=0, msg=f"norm {norm}")


def decayed(stepper, cfg, params):
    """params after one update of `stepper` at step 1 with zero gradients (Adam's and Muon's steps are 0)."""
    module = MODULES[stepper.split("-")[0]]
    recipe, zeros = module.RECIPES[cfg.recipe], {k: np.zeros_like(p) for k, p in params.items()}
    adam = {k: z for k, z in zeros.items() if k not in recipe.muon_names(module.param_shapes(cfg))}
    if stepper == "jax":  # compiled: op by op, each op compiles
        update = jax.jit(partial(recipe.update, cfg=cfg, layout={"matrices": None}))
        return {k: np.asarray(t) for k, t in update(params, zeros, zeros, adam, recipe.scalars(1, cfg))[0].items()}
    if stepper == "torchfunc":
        p = tf.to_device(params, CPU)
        recipe.update(p, tf.to_device(zeros, CPU), tf.to_device(zeros, CPU), tf.to_device(adam, CPU),
                      recipe.scalars(1, cfg, CPU), torch.tensor(1.0), None, cfg)
        return {k: t.numpy() for k, t in p.items()}
    state = tg.make_state(params, zeros, adam, cfg, DEVICE if stepper == "triton-triton" else CPU)
    recipe.update(state, 1, cfg, tg.backend_ops(stepper.removeprefix("triton-"), cfg.recipe))
    return {k: t.cpu().numpy() for k, t in state["params"].items()}


# backend triton's speedrun step in the interpreter takes 25 s (Newton-Schulz): its AdamW kernel applies the
# weight decays speedrun_update lists (backend torch's here), and --test holds it to backend torch's
@pytest.mark.parametrize("stepper, recipe", [(s, r) for r in ("gpt2", "speedrun") for s in STEPPERS
                                             if (s, r) != ("triton-triton", "speedrun")])
def test_weight_decay_reaches_only_its_tensors(stepper, recipe, one_thread):
    """One update with zero gradients multiplies each tensor by 1 - lr x weight decay of its group and
    nothing else: GPT-2's AdamW (llm.c's) decays the embeddings and the matmuls' weights, never a bias or a
    LayerNorm gain; the speedrun's (torch.optim.AdamW over its three groups, as the reference) decays every
    tensor it updates, gains and biases too, by --weight-decay at its group's lr, and Muon its matrices by
    0.05 at its own."""
    m = MODULES[stepper.split("-")[0]]
    cfg = small_cfg(m, recipe, weight_decay=0.5, warmup=0, lr=0.01 if recipe == "gpt2" else ref.MUON_LR)
    params = speedrun_random_weights(m.param_shapes(cfg), 5)  # nonzero everywhere
    got = decayed(stepper, cfg, params)
    for k, p in params.items():
        if recipe == "gpt2":  # llm.c decays its tensors of 2 or more dims (here those of each layer, stacked)
            matrix = k in ("wte", "wpe") or k.endswith(".w") and not k.startswith("ln")
            lr, wd = cfg.lr, cfg.weight_decay if matrix else 0.0
        elif k.startswith("blocks.") and p.ndim == 2:
            lr, wd = ref.MUON_LR, ref.MUON_WD
        else:
            lr, wd = {"embed.weight": ref.EMBED_LR, "proj.weight": ref.HEAD_LR}.get(k, ref.VECTOR_LR), cfg.weight_decay
        np.testing.assert_allclose(got[k], p * (1 - lr * wd), rtol=1e-6, atol=0, err_msg=f"{k}: lr {lr}, wd {wd}")


# -----------------------------------------------------------------------------
# The speedrun's head and attention

def soft_capped(name, z):
    """The soft cap each trainer's evaluation and sampling apply to the head's output z (N,) fp32."""
    if name == "jax":
        return np.asarray(tj.speedrun_logits(jnp.asarray(z[:, None]), jnp.ones((1, 1)), jnp.zeros(1)))[:, 0]
    if name == "torchfunc":
        return tf.speedrun_logits(torch.from_numpy(z[:, None]), torch.ones(1, 1), torch.zeros(1))[:, 0].numpy()
    return tg.RECIPES["speedrun"].logits(torch.from_numpy(z)).numpy()


@pytest.mark.parametrize("name", MODULES)
def test_speedrun_soft_cap_is_the_references(name):
    """The head's soft cap in evaluation and sampling (in the Triton trainer, speedrun_logits, which both
    backends' forward share, so that its self-test cannot see it) is the reference's 15 z / sqrt(z^2 + 15^2):
    within fp32 rounding of the float64 formula, near 0, through the bend and far out where it nears +-15."""
    z = np.concatenate([np.linspace(-400, 400, 801), [1e-4, -1e-4, 15, -15]]).astype(np.float32)
    want = ref.softcap(torch.from_numpy(z).double()).numpy()
    np.testing.assert_allclose(soft_capped(name, z), want, rtol=1e-6, atol=0)


def speedrun_logits(stepper, cfg, params, idx):
    """The soft-capped logits (B,T,Vp) of each trainer's speedrun forward (the Triton one's in a backend)."""
    if stepper == "jax":  # compiled (op by op, each op compiles), fp32 without TF32 on a GPU
        with jax.default_matmul_precision("highest"):
            return np.asarray(jax.jit(partial(tj.speedrun_forward, cfg=cfg))(params, jnp.asarray(idx)))
    if stepper == "torchfunc":
        w = tf.to_device(params, CPU)
        with tf.autocast(cfg, CPU):
            h = tf.speedrun_transformer(w, torch.from_numpy(idx), cfg)             # (B,T,C)
            return tf.speedrun_logits(h, w["proj.weight"], w["proj.bias"]).numpy()
    return tg.forward(tg.to_device(params, CPU), torch.from_numpy(idx), replace(cfg, backend="torch")).numpy()


# backend triton's kernels of q's and k's norm, with several heads, are held to backend torch's by --test
@pytest.mark.parametrize("stepper", ["jax", "torchfunc", "triton-torch"])
def test_speedrun_logits_with_two_heads_are_the_references(stepper, one_thread):
    """Two 128-wide heads (the reference runs have one, where a norm over all heads is the same as one per
    head), random nonzero weights: the logits in fp32 within 1e-5 of the float64 reference module's, relative
    to their largest, so that q and k are RMS-normed per head."""
    m = MODULES[stepper.split("-")[0]]
    cfg = small_cfg(m, "speedrun", n_embd=256, n_head=2, vocab_size=50257, padded_vocab_size=50304)
    params = speedrun_random_weights(m.param_shapes(cfg), 6)
    idx = np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 12))           # (B,T)
    module = ref.GPT(1, 256).double()
    freqs = {"blocks.0.attn.rotary.angular_freq": module.blocks[0].attn.rotary.angular_freq}
    module.load_state_dict({**{k: torch.from_numpy(w).double() for k, w in params.items()}, **freqs})
    with torch.no_grad():
        want = module(torch.from_numpy(idx)).numpy()                               # (B,T,Vp)
    err = np.abs(speedrun_logits(stepper, cfg, params, idx) - want).max() / np.abs(want).max()
    assert err < 1e-5, f"relative error {err:.2e}"


# -----------------------------------------------------------------------------
# The Triton trainer's hand-derived GELU backward

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_triton_gelu_backward_is_the_derivative_of_tanh_gelu(backend, one_thread):
    """gelu_backward(dy, x) is dy times the derivative of the tanh-GELU 0.5 x (1 + tanh(sqrt(2/pi) (x +
    0.044715 x^3))), as autograd takes it in float64: backend torch in float64 within 1e-12, both backends in
    fp32 within 1e-6 (a few fp32 roundings of values up to 1.13), over x in [-8, 8]."""
    ops = tg.backend_ops(backend)
    # fp32 values, so that the fp32 runs see the very x of the float64 derivative
    x = torch.linspace(-8, 8, 3201).double().requires_grad_(True)
    F.gelu(x, approximate="tanh").backward(torch.ones_like(x))
    want = x.grad
    dtypes = [torch.float64, torch.float32] if backend == "torch" else [torch.float32]
    for dt, tol in ((dt, 1e-12 if dt == torch.float64 else 1e-6) for dt in dtypes):
        device = DEVICE if backend == "triton" else CPU
        got = ops.gelu_backward(torch.ones(x.shape, dtype=dt, device=device), x.detach().to(dt).to(device))
        err = (got.cpu().double() - want).abs().max().item()
        assert err < tol, f"{dt}: max error {err:.2e}"
