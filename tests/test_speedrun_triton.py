"""--recipe speedrun in train_gpt2_triton.py. Backend torch: each speedrun op's hand-derived backward
against torch.autograd in float64; training held to the float64 outside reference
(tests/speedrun_reference.py) per step, from the recipe's init and from random weights; a torchfunc
speedrun checkpoint resumed here, and one of this trainer resumed by torchfunc; a bf16 step against fp32.
Backend triton (in Triton's interpreter without a GPU, fp32): resuming torchfunc's checkpoint, training held
to the float64 reference and to backend torch per step, its own checkpoint resumed by backend torch,
--bench-ops over its speedrun ops. In tests/test_triton.py: its kernels op by op (--test --recipe
speedrun), and a step of either backend without autograd, of backend triton without torch compute ops. In
tests/test_zero.py: two processes at ZeRO-1 (Newton-Schulz on whole matrices dealt round-robin) against
one, and the state make_state holds at stages 0 and 1. The tolerances and shapes are
tests/test_speedrun_torchfunc.py's, which explains them."""
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import speedrun_reference as ref
import train_gpt2_torchfunc as tf
import train_gpt2_triton as tg
from conftest import (assert_same_step_values, run_script, speedrun_random_weights, step_events,
                      stop_by_signals_and_resume, train_losses)

OPS = tg.TORCH_SPEEDRUN_OPS
F64 = torch.float64
EPS64 = torch.finfo(F64).eps

L, C, T, B, ACCUM, STEPS = 2, 128, 32, 1, 2, 6
FLAGS = ["--recipe", "speedrun", "--n-layer", L, "--n-embd", C, "--seq-len", T, "--batch-size", B,
         "--total-batch-size", ACCUM * B * T, "--steps", STEPS, "--dtype", "fp32", "--val-every", 0,
         "--hellaswag-every", 0, "--sample-every", 0]
# tests/test_speedrun_torchfunc.py's: fp32 against float64 per step (measured here: at most 6.2e-7, in steps
# 4-6 from the recipe's init, the sensitive ones: its comment says why)
REFERENCE_RTOL = 1e-5
OP_RTOL = 1e-10  # float64, hand backward against autograd


# -----------------------------------------------------------------------------
# Each op against autograd, float64

def leaf(*shape, seed, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * scale + shift).requires_grad_(True)


def assert_close(got, want, what):
    err = ((got - want).norm() / want.norm()).item()
    assert err < OP_RTOL, f"{what}: relative error {err:.2e}"


def reference_rotary(x):
    """tests/speedrun_reference.py's Rotary, without the module: x (B, T, H, D)."""
    freq = ref.rotary_freq(x.shape[3]).to(F64)  # (D/2,)
    theta = torch.outer(torch.arange(x.shape[1], dtype=F64), freq)[None, :, None]  # (1, T, 1, D/2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * theta.cos() + x2 * theta.sin(), -x1 * theta.sin() + x2 * theta.cos()], dim=-1)


def test_rmsnorm_against_autograd():
    """RMSNorm with a gain, alone and after a residual add, and its backward with the residual's gradient
    added (dx and dgain)."""
    res, h, w, dy, dres = leaf(6, 24, seed=0), leaf(6, 24, seed=1), leaf(24, seed=2, scale=0.3, shift=1.0), \
        leaf(6, 24, seed=3), leaf(6, 24, seed=4)
    x = res + h
    want = F.rms_norm(x, (24,), w, EPS64)
    want.backward(dy)
    with torch.no_grad():
        xs, y, rstd = OPS.residual_rmsnorm_forward(res, h, w, EPS64)
        assert_close(xs, x, "residual")
        assert_close(y, want, "rmsnorm forward")
        assert_close(OPS.rmsnorm_forward(x, w, EPS64)[0], want, "rmsnorm forward")
        dw = torch.zeros(24, dtype=F64)
        dx = OPS.rmsnorm_backward(dy, x, w, rstd, dw, dres=dres)
    assert_close(dx, res.grad + dres, "rmsnorm dx")
    assert_close(dw, w.grad, "rmsnorm dgain")


def test_qk_norm_rotary_against_autograd():
    """q or k normed over each 128-wide head without gain, then half-truncated rotary, at 40 positions."""
    x, dy = leaf(2, 40, 3, 128, seed=5, scale=2.0), leaf(2, 40, 3, 128, seed=6)
    want = reference_rotary(F.rms_norm(x, (128,), eps=EPS64))
    want.backward(dy)
    with torch.no_grad():
        y, rstd = OPS.qk_norm_rotary_forward(x, EPS64)
        dx = OPS.qk_norm_rotary_backward(dy, x, rstd)
    assert_close(y, want, "qk norm rotary forward")
    assert_close(dx, x.grad, "qk norm rotary dx")


def test_scaled_attention_against_autograd(monkeypatch):
    """Causal attention with scale 0.12 over separate q, k, v (B, T, H, D); with blocks of 16 query rows,
    so that the blockwise forward and backward run over several blocks of a 40-token sequence."""
    monkeypatch.setattr(tg, "ATTN_BLOCK", 16)
    q, k, v, do = (leaf(2, 40, 3, 8, seed=s) for s in (7, 8, 9, 10))
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                          scale=tg.ATTN_SCALE).transpose(1, 2).reshape(2, 40, 24)
    want.backward(do.view(2, 40, 24))
    with torch.no_grad():
        out, lse = OPS.scaled_attention_forward(q, k, v, tg.ATTN_SCALE)
        grads = OPS.scaled_attention_backward(do.view(2, 40, 24), q, k, v, out, lse, tg.ATTN_SCALE)
    assert_close(out, want, "attention forward")
    for name, got, t in zip("qkv", grads, (q, k, v)):
        assert_close(got, t.grad, f"attention d{name}")


def test_relu2_and_embedding_against_autograd():
    """relu(x)^2 and the embedding's gather, with a token repeated (its rows of dx summed)."""
    pre, dy = leaf(5, 12, seed=11), leaf(5, 12, seed=12)
    want = F.relu(pre).square()
    want.backward(dy)
    with torch.no_grad():
        assert_close(OPS.relu2_forward(pre), want, "relu2 forward")
        assert_close(OPS.relu2_backward(dy, pre), pre.grad, "relu2 dx")
    table, dx = leaf(9, 12, seed=13), leaf(2, 4, 12, seed=14)
    idx = torch.tensor([[3, 1, 3, 0], [8, 3, 1, 5]])
    table[idx].backward(dx)
    with torch.no_grad():
        assert_close(OPS.embedding_forward(idx, table), table[idx], "embedding forward")
        dtable = torch.zeros(9, 12, dtype=F64)
        OPS.embedding_backward(dx, idx, dtable)
    assert_close(dtable, table.grad, "embedding dtable")


def test_softcap_crossentropy_against_autograd(monkeypatch):
    """The soft-capped logits' cross-entropy over all columns, dloss times its gradient written over z;
    with blocks of 3 rows, so that the loop over row blocks runs more than once."""
    monkeypatch.setattr(tg, "CE_BLOCK", 3)
    z = leaf(7, 50, seed=15, scale=20.0)  # well into the cap's bend
    targets = torch.tensor([0, 49, 3, 3, 17, 25, 8])
    losses = F.cross_entropy(ref.softcap(z), targets, reduction="none")
    (0.37 * losses.sum()).backward()
    with torch.no_grad():
        dz = z.detach().clone()
        got = OPS.softcap_crossentropy_forward_backward(dz, targets, 0.37)
    assert_close(got, losses, "softcap cross-entropy losses")
    assert_close(dz, z.grad, "softcap cross-entropy dz")


def test_muon_update_is_the_references():
    """muon_update on two tall matrices and (separately) a wide one: the momentum, the update and the
    decayed weights of tests/speedrun_reference.py's Muon, on float64 copies."""
    for shape in ((12, 5), (5, 12)):
        ps = [leaf(*shape, seed=20 + i).detach() for i in range(2)]
        gs = [leaf(*shape, seed=30 + i).detach() for i in range(2)]
        ms = [leaf(*shape, seed=40 + i).detach() for i in range(2)]
        want_p, want_m = [p.clone() for p in ps], [m.clone() for m in ms]
        for p, g, m in zip(want_p, gs, want_m):
            ref.muon_update(p, g, m, 0.02, tg.MUON_WEIGHT_DECAY)
        OPS.muon_update(ps, gs, ms, None, 0.02, tg.MUON_MOMENTUM, tg.MUON_WEIGHT_DECAY, F64)
        for got, want in zip(ps + ms, want_p + want_m):
            assert_close(got, want, f"muon {shape}")


def test_the_speedrun_ops_are_listed_once():
    """Both backends' speedrun tables fill in SPEEDRUN_OP_NAMES exactly; --recipe speedrun's namespace
    holds those and OP_NAMES, each backend's own."""
    assert sorted(vars(OPS)) == sorted(vars(tg.TRITON_SPEEDRUN_OPS)) == sorted(tg.SPEEDRUN_OP_NAMES)
    for backend, table in (("torch", OPS), ("triton", tg.TRITON_SPEEDRUN_OPS)):
        ops = vars(tg.backend_ops(backend, "speedrun"))
        assert sorted(ops) == sorted(tg.OP_NAMES + tg.SPEEDRUN_OP_NAMES)
        assert all(ops[k] is f for k, f in vars(table).items())
        assert ops["matmul_forward"] is vars(tg.backend_ops(backend))["matmul_forward"]


# -----------------------------------------------------------------------------
# Training runs, against the float64 reference and the sibling trainer

def tiny_cfg():
    cfg, _ = tg.parse_args(["torch", "--recipe", "speedrun", "--n-layer", str(L), "--n-embd", str(C),
                            "--seed", "0", "--dtype", "fp32"])
    return cfg



@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory):
    """runs(key) -> (out dir, init file), each run made once, in this process, when first asked for:
    "recipe" (--seed 0, its init also written as a model file, checkpoints every 3 steps) and "random"
    (speedrun_random_weights, checkpoint at step 3) of this trainer, backend torch; "torchfunc"
    train_gpt2_torchfunc.py's run from the "random" init file, its checkpoint at step 5; "triton" backend
    triton resuming the "torchfunc" run's checkpoint of step 5 (step 6 alone: the interpreter takes ~20 s
    a step), its checkpoint at step 6."""
    done = {}

    def get(key):
        if key not in done:
            out = tmp_path_factory.mktemp(key)
            init = out.parent / f"{key}_init.safetensors"
            cfg = tiny_cfg()
            tg.write_speedrun_file(str(init), tg.RECIPES[cfg.recipe].init(cfg) if key == "recipe" else
                                   speedrun_random_weights(tg.param_shapes(cfg), 1), cfg)
            argv = [*map(str, FLAGS), "--data", str(tiny_shards), "--out-dir", str(out), "--ckpt-every", "3"]
            if key == "torchfunc":
                tf.main([*argv, "--ckpt-every", "5", "--init-from", str(init)])
            elif key == "triton":
                tg.main(["triton", *argv, "--resume", str(get("torchfunc")[0] / "ckpt_0000005")])
            else:
                tg.main(["torch", *argv, "--init-from", str(init)])
            done[key] = out, init
        return done[key]
    return get



@pytest.mark.parametrize("key", ["recipe", "random"])
def test_training_matches_the_float64_reference(runs, key, speedrun_reference_losses, one_thread):
    """In fp32, each step's train loss is within 1e-5 of the float64 reference's over 6 steps of two
    micro-batches (the gradient of their summed token loss, Muon and AdamW's three groups, the schedule),
    from random nonzero weights and from the recipe's init."""
    out, init = runs(key)
    expected = speedrun_reference_losses(init)
    got = train_losses(out)
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, expected), 1):
        assert a == pytest.approx(b, rel=REFERENCE_RTOL), f"step {step}: {a} against {b}"
    assert got[-1] < got[0] - 0.5  # it learns


def test_checkpoints_pass_between_the_torch_trainers(runs, tiny_shards, tmp_path, one_thread):
    """From the same random init, in fp32, torchfunc's run has this trainer's losses and grad norms; its
    checkpoint of step 5 (Muon's momentum in m, no v for the matrices) resumes here with the loss of this
    trainer's uninterrupted run, and this trainer's of step 3 resumes in torchfunc with its losses too."""
    out, _ = runs("random")
    theirs, _ = runs("torchfunc")
    assert train_losses(theirs) == pytest.approx(train_losses(out), rel=REFERENCE_RTOL)
    # the gradient of the summed loss, whose norm (unlike the losses: Adam and Newton-Schulz hardly see a
    # gradient's scale) tells it from the mean's
    norms = [[e["grad_norm"] for e in step_events(run)] for run in (out, theirs)]
    assert norms[0] == pytest.approx(norms[1], rel=REFERENCE_RTOL)
    argv = [*map(str, FLAGS), "--data", str(tiny_shards), "--ckpt-every", "0"]
    tg.main(["torch", *argv, "--out-dir", str(tmp_path / "here"), "--resume", str(theirs / "ckpt_0000005")])
    tf.main([*argv, "--out-dir", str(tmp_path / "there"), "--resume", str(out / "ckpt_0000003")])
    for resumed, first in ((tmp_path / "here", 6), (tmp_path / "there", 4)):
        assert [e["step"] for e in step_events(resumed)] == list(range(first, STEPS + 1))
        assert train_losses(resumed) == pytest.approx(train_losses(out)[first - 1:], rel=REFERENCE_RTOL)


@pytest.mark.quick  # the quick tier's --recipe speedrun runs of this trainer: backend torch, backend triton
def test_backend_triton_matches_the_reference_and_backend_torch(runs, speedrun_reference_losses, one_thread):
    """Backend triton, fp32, resuming torchfunc's checkpoint of step 5 (another trainer's, from the random
    init): step 6 has its train loss within 1e-5 of the float64 reference's, and its loss and grad norm
    within 1e-5 of backend torch's uninterrupted run (the same computation, its sums in other orders)."""
    out, _ = runs("triton")
    torch_run, init = runs("random")
    events, theirs = step_events(out), step_events(torch_run)[5:]
    assert [(e["step"], e["framework"]) for e in events] == [(6, "triton-triton")]
    for step, a, b in zip((6,), train_losses(out), speedrun_reference_losses(init)[5:]):
        assert a == pytest.approx(b, rel=REFERENCE_RTOL), f"step {step}: {a} against {b}"
    for key in ("train_loss", "grad_norm"):
        assert [e[key] for e in events] == pytest.approx([e[key] for e in theirs], rel=REFERENCE_RTOL), key


def test_a_triton_checkpoint_resumes_in_backend_torch(runs, tiny_shards, tmp_path, one_thread):
    """Backend triton's checkpoint of step 6 (Muon's momentum, AdamW's moments, the weights it updated)
    resumes in backend torch for a 7th step with the loss that backend torch's own checkpoint of step 6
    gives it."""
    out, _ = runs("triton")
    torch_run, _ = runs("random")
    for name, run in (("from_triton", out), ("from_torch", torch_run)):
        tg.main(["torch", *map(str, FLAGS), "--steps", "7", "--data", str(tiny_shards), "--ckpt-every", "0",
                 "--resume", str(run / "ckpt_0000006"), "--out-dir", str(tmp_path / name)])
        assert [e["step"] for e in step_events(tmp_path / name)] == [7]
    assert train_losses(tmp_path / "from_triton") == pytest.approx(train_losses(tmp_path / "from_torch"),
                                                                   rel=REFERENCE_RTOL)


def test_bench_ops_lists_every_speedrun_kernel(capsys, monkeypatch, one_thread):
    """--bench-ops --recipe speedrun times every speedrun op of backend triton (the attention's backward
    with its forward; Muon once per shape it batches over) against the PyTorch ops it replaces."""
    monkeypatch.setattr(tg, "BENCH_WARMUP", 0)
    monkeypatch.setattr(tg, "BENCH_REPS", 1)
    monkeypatch.setattr(tg, "COPY_BYTES", 1 << 16)
    cfg = replace(tiny_cfg(), backend="triton", n_layer=1, seq_len=16, batch_size=1, vocab_size=61,
                  padded_vocab_size=64)
    tg.bench_ops(cfg, tg.backend_ops("triton", "speedrun"), torch.device("cpu"))
    out = capsys.readouterr().out
    benched = [line.split()[0] for line in out.splitlines() if " | " in line and line.endswith("x")]
    assert set(benched) == (set(tg.SPEEDRUN_OP_NAMES) - {"scaled_attention_backward"}
                            | {"scaled_attention_forward+backward"})
    assert benched.count("muon_update") == 3


def test_a_bf16_step_follows_fp32(one_thread):
    """--dtype bf16, one step of two micro-batches from random weights (one block): the model computes
    with bf16 copies of the fp32 masters (RMSNorm's eps bf16's), its loss is within 1e-2 of fp32's and
    every gradient points fp32's way; the update leaves the masters fp32 and the copies their rounding."""
    cfg = replace(tiny_cfg(), n_layer=1, seq_len=16, batch_size=1, total_batch_size=32)
    weights = speedrun_random_weights(tg.param_shapes(cfg), 2)
    muon = tg.muon_names(tg.param_shapes(cfg))
    tokens = torch.from_numpy(np.random.default_rng(3).integers(0, 50257, (2, 2, 1, 16)))  # (2, A, B, T)
    ops = tg.backend_ops("torch", "speedrun")
    got = {}
    for dtype in ("fp32", "bf16"):
        c = replace(cfg, dtype=dtype)
        m = {k: np.zeros_like(w) for k, w in weights.items()}
        v = {k: w for k, w in m.items() if k not in muon}
        state = tg.make_state(weights, m, v, c, torch.device("cpu"))
        loss, _ = tg.train_step(state, tokens[0], tokens[1], 1, c, ops, 1)
        got[dtype] = loss, state
    (loss32, state32), (loss16, state16) = got["fp32"], got["bf16"]
    assert loss16 == pytest.approx(loss32, rel=1e-2)
    for k, g in state32["grads"].items():
        g16 = state16["grads"][k]
        cosine = float((g * g16).sum() / (g.norm() * g16.norm()))
        assert cosine > 0.99, f"{k}: cosine {cosine:.4f} between the bf16 and fp32 gradients"
        assert state16["params"][k].dtype == torch.float32
        assert torch.equal(state16["weights"][k], state16["params"][k].to(torch.bfloat16)), k


def test_backend_torch_refuses_the_speedrun_self_test():
    """--test --recipe speedrun checks backend triton against backend torch; backend torch's speedrun ops
    are held to autograd here: one line, before anything runs."""
    with pytest.raises(SystemExit) as e:
        tg.main(["torch", "--recipe", "speedrun", "--test"])
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message
    assert "--test --recipe speedrun checks backend triton's kernels" in message


def test_signals_stop_at_a_step_boundary_and_resume_is_exact(runs, tiny_shards, tmp_path):
    """SIGINT, then SIGTERM in the resumed run, each stopping at a step boundary with a checkpoint (as
    test_trainers.py checks the gpt2 recipe), backend torch: --resume auto logs the uninterrupted run's
    values bit for bit (that run also a process of one thread: the thread count moves a grad norm's last
    bits)."""
    argv = ["train_gpt2_triton.py", "torch", *FLAGS, "--data", tiny_shards, "--ckpt-every", 3,
            "--init-from", runs("recipe")[1]]
    env = {"OMP_NUM_THREADS": "1"}
    run_script(*argv, "--out-dir", tmp_path / "whole", env=env)
    out = tmp_path / "out"
    got = stop_by_signals_and_resume([*argv[:-2], "--out-dir", out], argv[-2:], out, env)
    assert_same_step_values(got, step_events(tmp_path / "whole"))
