"""--fp8-head: the speedrun head's training matmuls on float8 operands (docs/FORMATS.md, FP8 head), held to
tests/speedrun_reference.py's float64 FP8 head: its casts against torch's bit for bit, each trainer's
quantized operands against its casts bit for bit, each trainer's loss over 3 steps against its run; the
FP8 run apart from the unquantized one by more than that tolerance; the gpt2 recipe refusing the flag."""
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch

import speedrun_reference as sr
import train_gpt2_jax as tj
import train_gpt2_torchfunc as tf
import train_gpt2_triton as tg
from conftest import FP8_REFERENCE_RTOL, FP8_RUN, assert_refused, fp8_flags, train_losses

TORCH_TYPES = {"x": torch.float8_e4m3fn, "w": torch.float8_e4m3fn, "grad": torch.float8_e5m2}
pytestmark = pytest.mark.usefixtures("one_thread")


def operands(seed, shape):
    """fp32 values (shape) over the whole range a cast meets: from below the smallest subnormal to past the
    largest finite value after scaling, both signs, zeros and exact rounding midpoints among them."""
    rng = np.random.default_rng(seed)
    t = rng.standard_normal(shape) * np.exp2(rng.uniform(-24, 18, shape))
    t.flat[:4] = [0.0, -0.0, 1e30, -1e30]
    return t.astype(np.float32)


def reference_bits(t, kind):
    return sr.fp8_bits(sr.quantize(t, kind), kind)


def torch_bits(t):
    return t.view(torch.uint8).numpy()


def test_the_reference_casts_are_torchs():
    """round_fp8 (written from the formats' definitions) gives torch's casts of the clamped values bit for
    bit on 10^6 values of every magnitude, and every finite code of both formats round-trips. torch's own
    e4m3fn cast saturates (1e30 gives 448), its e5m2 cast does not (1e30 gives inf): hence the clamp."""
    t = operands(0, 1 << 20).astype(np.float64)
    for kind, top in (("x", 448.0), ("grad", 57344.0)):
        cast = torch.from_numpy(np.clip(t, -top, top)).to(TORCH_TYPES[kind])
        q = sr.round_fp8(t, kind)
        np.testing.assert_array_equal(q, cast.double().numpy())
        np.testing.assert_array_equal(sr.fp8_bits(q, kind), torch_bits(cast))
        codes = torch.arange(256, dtype=torch.uint8).view(TORCH_TYPES[kind]).double().numpy()
        finite = np.isfinite(codes)
        np.testing.assert_array_equal(sr.fp8_bits(codes[finite], kind), np.arange(256)[finite])
    assert torch.tensor([1e30]).to(torch.float8_e4m3fn).item() == 448.0
    assert torch.tensor([1e30]).to(torch.float8_e5m2).item() == float("inf")


def test_the_fp8_reference_differs_from_the_unquantized(fp8_reference, tiny_shards):
    """The float64 reference's FP8 run and the unquantized one differ at step 1 (before any update, so a
    1-step run gives it) by far more than the tolerance the trainers are held to: a trainer whose flag
    quantized nothing would fail test_*_trains_held_to_the_reference there."""
    init, fp8 = fp8_reference
    run = FP8_RUN
    plain = sr.train(init, [tiny_shards / "tiny_train_000001.bin"], run["batch_size"], run["seq_len"],
                     run["total_batch_size"], 1)
    assert abs(fp8[0] / plain[0] - 1) > 100 * FP8_REFERENCE_RTOL, (fp8, plain)


def assert_held_to_the_reference(got, fp8_reference):
    """3 steps' losses within FP8_REFERENCE_RTOL of the FP8 reference's."""
    expected = fp8_reference[1]
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected), 1):
        assert a == pytest.approx(b, rel=FP8_REFERENCE_RTOL), f"step {step}: {a} against {b}"


# -----------------------------------------------------------------------------
# torchfunc, and the torch helpers both torch trainers share

def test_torchfunc_trains_held_to_the_reference(fp8_reference, tiny_shards, tmp_path):
    tf.main(fp8_flags(tiny_shards, tmp_path, fp8_reference[0]))
    assert_held_to_the_reference(train_losses(tmp_path), fp8_reference)


def test_torchfunc_operands_are_the_references(one_thread):
    """FP8HeadMatmul's h_f8 and W_f8, and the e5m2 cast its backward uses, equal the reference's bit for
    bit; its products are the reference's products of those operands (fp32 sums of exact products)."""
    h, w, g = (operands(seed, shape) for seed, shape in ((1, (64, 128)), (2, (256, 128)), (3, (64, 256))))
    h, w = h / 1e3, w / 1e3  # the products of saturated operands would overflow fp32
    z, h_f8, w_f8 = tf.FP8HeadMatmul.apply(torch.from_numpy(h), torch.from_numpy(w))
    np.testing.assert_array_equal(torch_bits(h_f8), reference_bits(h, "x"))
    np.testing.assert_array_equal(torch_bits(w_f8), reference_bits(w, "w"))
    np.testing.assert_array_equal(torch_bits(tf.fp8_quantize(torch.from_numpy(g), "grad")),
                                  reference_bits(g, "grad"))
    hd, wd = (torch.from_numpy(t).double().requires_grad_() for t in (h, w))
    zd = sr.FP8HeadMatmul.apply(hd, wd)
    gd = torch.from_numpy(g / 1e3).double()
    zd.backward(gd)
    torch.testing.assert_close(z.double(), zd.detach(), rtol=1e-6, atol=1e-6 * zd.abs().max().item())
    dz = torch.func.vjp(lambda h, w: tf.FP8HeadMatmul.apply(h, w)[0], torch.from_numpy(h),
                        torch.from_numpy(w))[1](gd.float())
    for got, want in zip(dz, (hd.grad, wd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def test_evaluation_uses_the_plain_head(one_thread):
    """In torchfunc and JAX (jitted, as its evaluation is), the token losses that evaluation asks for
    (train=False) are the unquantized head's with --fp8-head too; the training step's (train=True) differ.
    (The Triton trainer's: test_triton_head_trains_on_fp8_and_evaluates_plain.)"""
    import jax
    import jax.numpy as jnp
    from conftest import speedrun_random_weights
    argv = ["--recipe", "speedrun", "--n-layer", "1", "--n-embd", "128", "--dtype", "fp32"]
    x, y = np.random.default_rng(6).integers(0, 256, (2, 1, 16))  # (1, 16) each, of a 256-row head
    for module, put in ((tf, torch.from_numpy), (tj, jnp.asarray)):
        fp8, plain = (replace(module.parse_args(flags)[0], padded_vocab_size=256)
                      for flags in ([*argv, "--fp8-head"], argv))
        params = {k: put(w) for k, w in speedrun_random_weights(module.param_shapes(fp8), 2).items()}
        evaluated, trained, unquantized = (
            np.asarray(jax.jit(partial(tj.speedrun_token_losses, cfg=cfg, train=train))(params, x, y)
                       if module is tj else tf.speedrun_token_losses(params, put(x), put(y), cfg, train))
            for cfg, train in ((fp8, False), (fp8, True), (plain, True)))
        np.testing.assert_array_equal(evaluated, unquantized)
        assert np.abs(trained - unquantized).max() > 1e-4, module.__name__


def test_gpt2_refuses_fp8_head():
    for main in (tf.main, tj.main, lambda argv: tg.main(["torch", *argv])):
        assert_refused(main, [(["--fp8-head"], "--fp8-head: the gpt2 recipe's lm head is its embedding wte")])


# -----------------------------------------------------------------------------
# JAX

def test_jax_trains_held_to_the_reference(fp8_reference, tiny_shards, tmp_path):
    tj.main(fp8_flags(tiny_shards, tmp_path, fp8_reference[0]))
    assert_held_to_the_reference(train_losses(tmp_path), fp8_reference)


def test_jax_operands_are_the_references():
    """fp8_quantize (what fp8_head_matmul casts with) equals the reference's casts bit for bit; the custom
    VJP's products are the reference's products of those operands (fp32 sums of exact products)."""
    import jax
    import jax.numpy as jnp
    h, w, g = (operands(seed, shape) for seed, shape in ((1, (64, 128)), (2, (256, 128)), (3, (64, 256))))
    for t, kind in ((h, "x"), (w, "w"), (g, "grad")):
        bits = jax.lax.bitcast_convert_type(tj.fp8_quantize(jnp.asarray(t), kind), jnp.uint8)
        np.testing.assert_array_equal(np.asarray(bits), reference_bits(t, kind))
    h, w, g = h / 1e3, w / 1e3, g / 1e3  # the products of saturated operands would overflow fp32
    z, vjp = jax.vjp(tj.fp8_head_matmul, jnp.asarray(h), jnp.asarray(w))
    dh, dw = vjp(jnp.asarray(g))
    hd, wd = (torch.from_numpy(t).double().requires_grad_() for t in (h, w))
    zd = sr.FP8HeadMatmul.apply(hd, wd)
    zd.backward(torch.from_numpy(g).double())
    for got, want in ((z, zd.detach()), (dh, hd.grad), (dw, wd.grad)):
        assert got.dtype == jnp.float32
        torch.testing.assert_close(torch.from_numpy(np.asarray(got, np.float64)), want, rtol=1e-6,
                                   atol=1e-6 * want.abs().max().item())


# -----------------------------------------------------------------------------
# the Triton trainer: backend torch, and backend triton in Triton's interpreter

def test_triton_torch_trains_held_to_the_reference(fp8_reference, tiny_shards, tmp_path):
    """(Backend triton's run takes ~4 minutes in the interpreter, and passed when measured; the suite checks
    its head, below.)"""
    tg.main(["torch", *fp8_flags(tiny_shards, tmp_path, fp8_reference[0])])
    assert_held_to_the_reference(train_losses(tmp_path), fp8_reference)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_triton_head_trains_on_fp8_and_evaluates_plain(backend, one_thread):
    """head_forward_backward at --fp8-head (Vp 256, chunks of 32 rows, the weight quantized once): training's
    token losses, dh and the head's gradients are the float64 reference head's (FP8HeadMatmul, soft cap,
    cross-entropy over all columns) within 1e-5; evaluation's losses (grads None) are the plain head's, which
    differ from training's by far more."""
    cfg, _ = tg.parse_args([backend, "--recipe", "speedrun", "--n-layer", "1", "--n-embd", "128", "--fp8-head",
                            "--dtype", "fp32"])
    ops = tg.backend_ops(backend, "speedrun")
    rng = np.random.default_rng(5)
    h = torch.from_numpy(rng.standard_normal((64, 128)).astype(np.float32))  # (N, C): RMSNorm's scale
    w = {"proj.weight": torch.from_numpy((rng.standard_normal((256, 128)) * 0.1).astype(np.float32)),
         "proj.bias": torch.from_numpy((rng.standard_normal(256) * 0.1).astype(np.float32))}
    targets = torch.from_numpy(rng.integers(0, 256, 64))
    grads = {k: torch.zeros_like(t) for k, t in w.items()}
    losses, dh = tg.head_forward_backward(h, targets, w, grads, cfg, ops, 1.0, rows=32)
    plain, _ = tg.head_forward_backward(h, targets, w, None, cfg, ops, 0.0, rows=32)
    hd, wd, bd = (t.double().requires_grad_() for t in (h, w["proj.weight"], w["proj.bias"]))
    expect = torch.nn.functional.cross_entropy(sr.softcap(sr.FP8HeadMatmul.apply(hd, wd) + bd), targets,
                                               reduction="none")
    expect.sum().backward()
    for got, want in ((losses, expect.detach()), (dh, hd.grad), (grads["proj.weight"], wd.grad),
                      (grads["proj.bias"], bd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    unquantized = torch.nn.functional.cross_entropy(sr.softcap(hd @ wd.T + bd), targets, reduction="none")
    torch.testing.assert_close(plain.double(), unquantized.detach(), rtol=1e-5, atol=0)
    assert (plain - losses).abs().max() > 1e-3 * losses.abs().max()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_triton_operands_are_the_references(backend, one_thread):
    """Each backend's fp8_quantize equals the reference's casts bit for bit; fp8_matmul_forward and
    fp8_matmul_backward give the reference's products of those operands (fp32 sums of exact products),
    the bias and its gradient unquantized."""
    ops = tg.backend_ops(backend, "speedrun")
    h, w, g = (operands(seed, shape) for seed, shape in ((1, (64, 128)), (2, (256, 128)), (3, (64, 256))))
    for t, kind in ((h, "x"), (w, "w"), (g, "grad")):
        np.testing.assert_array_equal(torch_bits(ops.fp8_quantize(torch.from_numpy(t), kind)),
                                      reference_bits(t, kind))
    h, w, g = h / 1e3, w / 1e3, g / 1e3  # the products of saturated operands would overflow fp32
    b = torch.from_numpy(operands(4, (256,)) / 1e6)
    h_f8, w_f8 = ops.fp8_quantize(torch.from_numpy(h), "x"), ops.fp8_quantize(torch.from_numpy(w), "w")
    z = ops.fp8_matmul_forward(h_f8, w_f8, b)
    dw, db = torch.zeros(256, 128), torch.zeros(256)
    dh = ops.fp8_matmul_backward(torch.from_numpy(g), h_f8, w_f8, dw, db)
    hd, wd = (torch.from_numpy(t).double().requires_grad_() for t in (h, w))
    zd = sr.FP8HeadMatmul.apply(hd, wd) + b.double()
    zd.backward(torch.from_numpy(g).double())
    for got, want in ((z, zd.detach()), (dh, hd.grad), (dw, wd.grad), (db, torch.from_numpy(g).double().sum(0))):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
