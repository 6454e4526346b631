"""--recipe speedrun in train_gpt2_torchfunc.py: modded-nanogpt's simplified speedrun baseline, held to
tests/speedrun_reference.py (a float64 rebuild of it from stock PyTorch: nn.Module with the reference's
parameter names, autograd, torch.optim.AdamW, Muon as its formulas read); the model files' names against
that module's state_dict, through the safetensors package; exact resume, and bad input. Its ZeRO-1 tests
(two processes against one, the whole-matrix layout) are in tests/test_zero.py."""
import json
import math
import shutil
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import speedrun_reference as sr
import train_gpt2_torchfunc as tf
from conftest import (assert_clean_error, assert_refused, assert_same_step_values, run_script,
                      speedrun_random_weights, step_events, stop_by_signals_and_resume, train_losses)
from train_gpt2_jax import read_safetensors
from train_gpt2_jax import read_weights

V, VP = 50257, 50304


# -----------------------------------------------------------------------------
# Runs of the trainer that the tests share

L, C, T, B, ACCUM, STEPS = 2, 128, 32, 1, 2, 6
# From the recipe's init (head and projections zero: the first step moves only the head) or from one in
# which every tensor is random and nonzero; one process of two micro-batches
FLAGS = ["--recipe", "speedrun", "--n-layer", L, "--n-embd", C, "--seq-len", T, "--batch-size", B,
         "--total-batch-size", ACCUM * B * T, "--steps", STEPS, "--dtype", "fp32", "--val-every", 0,
         "--hellaswag-every", 0, "--sample-every", 0]
ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
# fp32 against float64, per step, from either init (measured: at most 1.3e-7 from random weights, 6.2e-7
# from the recipe's init; 1.7e-6 at width 256). From the recipe's init the comparison is sensitive: after one
# step only the head has moved, its ~50,000 rows of unseen tokens one and the same vector, so the second
# step's gradients of the blocks' projections are numerically of low rank, and Newton-Schulz, which
# multiplies a small singular value by up to 2^12, magnifies their fp32 error. The loss through
# F.cross_entropy was 7.7e-7 off here and 6.3e-5 at width 256 (see
# test_token_losses_when_the_head_rows_are_one_vector).
REFERENCE_RTOL = 1e-5


def tiny_cfg(**kw):
    cfg, _ = tf.parse_args(["--recipe", "speedrun", "--n-layer", str(L), "--n-embd", str(C), "--seed", "0",
                            "--dtype", "fp32"])
    return tf.Config(**{**vars(cfg), **kw})



@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory):
    """runs(key) -> (out dir, init file) of a run of FLAGS on tiny_shards in this process (under the test's
    one_thread), each made once, when first asked for: "recipe" from --seed 0 (its init also written as a
    model file for the reference), checkpoints at steps 3 and 6; "random" from speedrun_random_weights."""
    done = {}

    def get(key):
        if key not in done:
            out = tmp_path_factory.mktemp(key)
            init = out.parent / f"{key}_init.safetensors"
            cfg = tiny_cfg()
            shapes = tf.param_shapes(cfg)
            weights = (speedrun_random_weights(shapes, 1) if key == "random" else
                       tf.RECIPES[cfg.recipe].init(cfg))
            tf.write_speedrun_file(str(init), weights, cfg)
            argv = [*map(str, FLAGS), "--data", str(tiny_shards), "--out-dir", str(out)]
            argv += ["--init-from", str(init)] if key == "random" else ["--seed", "0"]
            tf.main([*argv, "--ckpt-every", "3" if key == "recipe" else "0"])
            done[key] = out, init
        return done[key]
    return get



# [recipe] is the quick tier's --recipe speedrun run of this trainer
@pytest.mark.parametrize("key", [pytest.param("recipe", marks=pytest.mark.quick), "random"])
def test_training_matches_the_float64_reference(runs, key, speedrun_reference_losses, one_thread):
    """In fp32, each step's train loss is within 1e-5 of the float64 reference's, over 6 steps of two
    micro-batches (the gradient of their summed token loss; Muon on the blocks' matrices, AdamW's three
    groups, the stable-then-decay schedule), from random nonzero weights and from the recipe's init."""
    out, init = runs(key)
    expected = speedrun_reference_losses(init)
    got = train_losses(out)
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, expected), 1):
        assert a == pytest.approx(b, rel=REFERENCE_RTOL), f"step {step}: {a} against {b}"
    assert got[-1] < got[0] - 0.5  # it learns


def test_resume(runs, tiny_shards, tmp_path, one_thread):
    """A resume of the step-3 checkpoint prints the uninterrupted run's steps 4-6 exactly (fp32, one
    process). (Resumed by two processes at ZeRO-1: tests/test_zero.py.)"""
    out, _ = runs("recipe")
    tf.main([*map(str, FLAGS), "--data", str(tiny_shards), "--out-dir", str(tmp_path), "--resume",
             str(out / "ckpt_0000003"), "--ckpt-every", "0"])
    assert [e["step"] for e in step_events(tmp_path)] == [4, 5, 6]
    assert train_losses(tmp_path) == train_losses(out)[3:]


def test_signals_stop_at_a_step_boundary_and_resume_is_exact(runs, tiny_shards, tmp_path):
    """SIGINT, then SIGTERM in the resumed run, each stopping at a step boundary with a checkpoint (as
    test_trainers.py checks the gpt2 recipe): --resume auto logs the "recipe" run's values bit for bit."""
    out = tmp_path / "out"
    argv = ["train_gpt2_torchfunc.py", *FLAGS, "--data", tiny_shards, "--out-dir", out, "--ckpt-every", 3]
    got = stop_by_signals_and_resume(argv, ["--seed", 0], out, ENV)
    assert_same_step_values(got, step_events(runs("recipe")[0]))


def test_model_file_is_the_references_state_dict(runs, one_thread):
    """A speedrun model file holds the reference's GPT.state_dict() names and shapes, the rotary buffers
    included: the safetensors package reads a checkpoint's, and the module loads it strictly; the module's
    own state_dict (its embedding in bf16, as the reference keeps it), saved by the package, reads back
    here as it is (bf16 to fp32 exactly)."""
    out, _ = runs("recipe")
    module = sr.GPT(L, C)
    expected = {k: tuple(t.shape) for k, t in module.state_dict().items()}
    state = load_file(str(out / "ckpt_0000003" / "model.safetensors"))
    assert {k: tuple(t.shape) for k, t in state.items()} == expected
    assert all(t.dtype == torch.float32 for t in state.values())
    module.load_state_dict(state, strict=True)
    assert list(tf.param_shapes(tiny_cfg())) == [k for k, _ in module.named_parameters()]

    module.embed.bfloat16()
    path = out.parent / "from_the_module.safetensors"
    save_file({k: t.contiguous() for k, t in module.state_dict().items()}, str(path))
    header, params = read_weights(str(path), tiny_cfg())
    assert header == dict(vocab_size=V, padded_vocab_size=VP, n_layer=L, n_head=C // 128, n_embd=C)
    for k, p in module.named_parameters():
        np.testing.assert_array_equal(params[k], p.detach().float().numpy(), err_msg=k)


def test_forward_and_gradients(one_thread):
    """Two heads (width 256), random nonzero weights: the summed token loss and every gradient in fp32
    within 1e-6 and 1e-5 (relative) of the float64 module's autograd; in bf16 (bf16 copies of all but the
    fp32 embedding) the mean loss within 0.05 and the gradients pointing the same way."""
    cfg = tiny_cfg(n_embd=256, n_head=2, n_layer=1)
    weights = speedrun_random_weights(tf.param_shapes(cfg), 2)
    x, y = (torch.from_numpy(np.random.default_rng(3).integers(0, V, (2, 2, 16)))[i] for i in range(2))
    params = tf.to_device(weights, torch.device("cpu"))
    grads, loss = tf.grads_and_loss(params, x, y, 1.0, cfg)
    module = sr.GPT(1, 256).double()
    freqs = {"blocks.0.attn.rotary.angular_freq": module.blocks[0].attn.rotary.angular_freq}
    module.load_state_dict({**{k: torch.from_numpy(w).double() for k, w in weights.items()}, **freqs})
    ref = F.cross_entropy(module(x).view(-1, VP), y.reshape(-1), reduction="sum")
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    for k, p in module.named_parameters():
        err = ((grads[k].double() - p.grad).norm() / p.grad.norm()).item()
        assert err < 1e-5, f"{k}: relative gradient error {err:.2e}"
    cfg16 = tf.Config(**{**vars(cfg), "dtype": "bf16"})
    grads16, loss16 = tf.grads_and_loss(tf.model_weights(params, tf.compute_copies(params, cfg16)), x, y, 1.0,
                                        cfg16)
    assert loss16.item() / y.numel() == pytest.approx(loss.item() / y.numel(), abs=0.05)
    flat = lambda g: torch.cat([g[k].float().flatten() for k in grads])  # noqa: E731
    assert F.cosine_similarity(flat(grads), flat(grads16), dim=0) > 0.99


def test_token_losses_when_the_head_rows_are_one_vector(one_thread):
    """As after the first step from the recipe's init, where AdamW has moved the head's rows of the ~50,000
    unseen tokens by one and the same vector, so that each row of logits is mostly one value: every token's
    loss in fp32 within 5e-7 (relative) of the float64 module's (measured: 1.4e-7; through F.cross_entropy,
    whose CPU log_softmax sums a row's exponentials in long running sums, 3.8e-6)."""
    cfg = tiny_cfg(n_layer=1)
    weights = tf.RECIPES[cfg.recipe].init(cfg)
    rng = np.random.default_rng(4)
    head = np.repeat(np.sign(rng.standard_normal((1, C))) * 0.004, VP, 0)  # (Vp,C) one row, repeated
    head[:64] += rng.standard_normal((64, C)) * 0.004                         # and the seen tokens' own
    weights.update({"proj.weight": head.astype(np.float32), "proj.bias": np.full(VP, -0.004, np.float32)})
    x, y = (torch.from_numpy(rng.integers(0, 64, (4, T))) for _ in range(2))
    got = tf.speedrun_token_losses(tf.to_device(weights, torch.device("cpu")), x, y, cfg)
    module = sr.GPT(1, C).double()
    freqs = {"blocks.0.attn.rotary.angular_freq": module.blocks[0].attn.rotary.angular_freq}
    module.load_state_dict({**{k: torch.from_numpy(w).double() for k, w in weights.items()}, **freqs})
    with torch.no_grad():
        ref = F.cross_entropy(module(x).view(-1, VP), y.reshape(-1), reduction="none").view(y.shape)
    err = ((got.double() - ref).abs() / ref).max().item()
    assert err < 5e-7, f"relative error {err:.2e}"


@pytest.mark.parametrize("shape", [(128, 128), (128, 512), (512, 128)], ids=["square", "wide", "tall"])
def test_muon_matches_float64(shape, one_thread):
    """Muon alone on a square, a wide and a tall matrix, fp32 against the float64 formulas: the momentum
    buffer within 1e-6 and the step (Newton-Schulz on the transpose of the tall one, scaled by
    max(1, rows/cols)^0.5, after the weight decay) within 1e-5 (measured: at most 2.1e-6)."""
    gen = torch.Generator().manual_seed(0)
    p, g, momentum = (torch.randn(shape, generator=gen) * s for s in (0.05, 1.0, 0.3))
    params, grads, m = {"w": p.clone()}, {"w": g.clone()}, {"w": momentum.clone()}
    tf.speedrun_muon(["w"], params, grads, m, torch.tensor(0.025), torch.float32)
    ref, ref_momentum = p.double(), momentum.double()
    sr.muon_update(ref, g.double(), ref_momentum, 0.025, sr.MUON_WD)
    step, ref_step = params["w"].double() - p.double(), ref - p.double()
    assert ((step - ref_step).norm() / ref_step.norm()).item() < 1e-5
    assert ((m["w"].double() - ref_momentum).norm() / ref_momentum.norm()).item() < 1e-6


def test_flags_init_and_schedule():
    """--recipe speedrun takes the recipe's defaults (6 heads of 128 at d12, 3,250 steps, Muon's lr, no
    warmup or clipping) and leaves gpt2's as they were; its init from --seed is the reference's (the
    *proj* weights zero, the embedding N(0, 1), q/k/v/fc N(0, 0.33/fan_in), biases 0, gains 1), the same
    for the same seed; every lr holds for the first 30% of the steps, then falls linearly toward 0, each
    AdamW group's in its ratio to Muon's."""
    cfg, explicit = tf.parse_args(["--recipe", "speedrun"])
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, explicit) == (12, 6, 768, {})
    assert (cfg.steps, cfg.lr, cfg.warmup, cfg.grad_clip, cfg.weight_decay, cfg.val_every) == (
        3250, 0.025, 0, 0.0, 0.001, 125)
    assert cfg.val_tokens == 20 * 524288 and cfg.total_batch_size == 524288 and cfg.seq_len == 1024
    assert tf.parse_args(["--recipe", "speedrun", "--model", "d24"])[0].n_head == 8
    assert tf.parse_args([])[0] == tf.Config(compile=tf.Config().compile if torch.cuda.is_available() else 0)

    cfg = tiny_cfg()
    params = tf.RECIPES[cfg.recipe].init(cfg)
    assert all(np.array_equal(params[k], p) for k, p in tf.RECIPES[cfg.recipe].init(cfg).items())
    for k, p in params.items():
        if "proj" in k or k.endswith(".bias"):
            assert not p.any(), k
        elif k.endswith(".gains"):
            assert (p == 1).all(), k
        else:
            std = 1.0 if k == "embed.weight" else math.sqrt(0.33 / p.shape[1])
            assert p.std() == pytest.approx(std, rel=0.05) and abs(p.mean()) < 0.05 * std, k

    cfg.steps = 100
    eta = [tf.RECIPES[cfg.recipe].lr_at(it, cfg) / cfg.lr for it in range(100)]
    assert eta[:31] == [1.0] * 31  # 30/100 and before: (1 - 0.3) / 0.7 = 1
    assert eta[31:] == pytest.approx([(1 - it / 100) / 0.7 for it in range(31, 100)], rel=1e-12)
    assert tf.speedrun_lrs(0, cfg) == tf.SPEEDRUN_LRS
    assert tf.speedrun_lrs(99, cfg) == pytest.approx({g: lr * eta[99] for g, lr in tf.SPEEDRUN_LRS.items()})


def test_bad_input(runs, tiny_shards, tiny_model_file, tmp_path, capsys, one_thread):
    """One line and a non-zero exit, before any training: an llm.c model file given to --recipe speedrun
    (also as a script, without a traceback) and a speedrun file to --recipe gpt2; a speedrun file that
    lacks a tensor, holds one misshapen or one too many (each named); a checkpoint of the other recipe to
    --resume, or one whose Muon momentum holds a NaN; --n-head other than width/128, and a width that 128
    does not divide."""
    out, init = runs("random")
    state = load_file(str(init))
    files = {}
    for name, change in (("missing", lambda s: s.pop("blocks.1.mlp.fc.bias")),
                         ("misshapen", lambda s: s.update({"proj.bias": s["proj.bias"][:-1]})),
                         ("extra", lambda s: s.update({"lm_head.weight": s["proj.weight"].clone()}))):
        edited = dict(state)
        change(edited)
        files[name] = tmp_path / f"{name}.safetensors"
        save_file(edited, str(files[name]))
    nan_ckpt = tmp_path / "nan_ckpt"  # a Muon momentum gone NaN
    shutil.copytree(runs("recipe")[0] / "ckpt_0000003", nan_ckpt)
    with np.load(nan_ckpt / "state.npz") as z:
        saved = dict(z)
    saved["m.blocks.1.attn.q.weight"][0, 0] = np.nan
    np.savez(nan_ckpt / "state.npz", **saved)
    gpt2_ckpt = tmp_path / "gpt2_ckpt"
    gpt2_ckpt.mkdir()
    (gpt2_ckpt / "model.bin").write_bytes(tiny_model_file.read_bytes())
    (gpt2_ckpt / "state.npz").write_bytes(b"")
    base = ["--data", str(tiny_shards), "--out-dir", str(tmp_path / "out"), "--steps", "1", "--seq-len", "32"]
    speedrun = [*base, "--recipe", "speedrun"]
    cases = [
        ([*speedrun, "--init-from", str(tiny_model_file)], "llm.c model file", "--recipe speedrun takes"),
        ([*base, "--init-from", str(init)], "is a safetensors file", "--recipe speedrun"),
        ([*speedrun, "--init-from", str(files["missing"])], "lacks tensor blocks.1.mlp.fc.bias"),
        ([*speedrun, "--init-from", str(files["misshapen"])], "proj.bias has shape [50303]", "[50304]"),
        ([*speedrun, "--init-from", str(files["extra"])], "lm_head.weight"),
        ([*base, "--resume", str(runs("recipe")[0] / "ckpt_0000003")], "checkpoint of the speedrun recipe"),
        ([*speedrun, "--resume", str(gpt2_ckpt)], "checkpoint of the gpt2 recipe"),
        ([*speedrun, "--resume", str(nan_ckpt)], "optimizer state for blocks.1.attn.q.weight",
         "non-finite"),
        ([*speedrun, "--n-embd", "256", "--n-head", "4"], "--n-head 4", "has 2 of them"),
        ([*speedrun, "--n-embd", "200"], "--n-embd 200", "multiple of 128"),
    ]
    assert_refused(tf.main, cases)
    assert not (tmp_path / "out").exists()
    proc = run_script("train_gpt2_torchfunc.py", *cases[0][0], env=ENV, check=False)
    assert_clean_error(proc, "llm.c model file")


def write_raw_safetensors(path, header, data=b""):
    """A safetensors file of `header` (a dict, written as JSON, or bytes as they are) and data bytes."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return str(path)


def test_crafted_safetensors_files(tmp_path):
    """A crafted or damaged safetensors file is refused with one line that names it, before its tensors are
    read: what the safetensors library refuses (a header over its length limit, one nested past its JSON
    recursion limit, data_offsets of three numbers or past any integer, a dtype that is a list, a shape that
    is not a list of non-negative integers, tensors whose bytes overlap, leave a gap or are followed by
    junk), and what the trainers add (a name that would break the error's line, an integer type, weights
    that are NaN or inf)."""
    a = np.arange(6, dtype="<f4").reshape(2, 3)
    data = a.tobytes() + np.ones(4, "<f4").tobytes()

    def entry(shape=(2, 3), offsets=(0, 24), dtype="F32"):
        return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}
    good = {"a": entry(), "b": entry((4,), (24, 40))}
    good_file = write_raw_safetensors(tmp_path / "good.safetensors", good, data)
    assert read_safetensors(good_file)[0]["a"].tolist() == a.tolist()
    deep = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nan = np.array([0, np.nan, 0, 0], "<f4").tobytes()
    invalid = "is not a valid safetensors file"
    cases = {
        "limit": (b"{" + b" " * 99, b"", "header too large"),  # length field patched below
        "deep": (deep, b"", "recursion limit"),
        "three_offsets": ({**good, "a": entry(offsets=(0, 24, 24))}, data, invalid),
        "1e400": (json.dumps(good).replace("40]", "1e400]").encode(), data, invalid),
        "dtype_list": ({**good, "a": entry(dtype=["F32"])}, data, invalid),
        "shape_text": ({**good, "a": {**entry(), "shape": "23"}}, data, invalid),
        "shape_bool": ({**good, "a": entry(shape=(True, 6))}, data, invalid),
        "shape_negative": ({**good, "a": entry(shape=(-2, -3))}, data, invalid),
        # (which of two clashing tensors the library names follows its hash map's order: either)
        "overlap": ({"a": entry(), "b": entry((4,), (16, 32))}, data[:32], "invalid offset for tensor"),
        "same": ({**good, "c": entry((4,), (24, 40))}, data, "invalid offset for tensor"),
        "gap": ({"a": entry(), "b": entry((4,), (28, 44))}, data + bytes(4), "invalid offset for tensor"),
        "junk": (good, data + b"junk", "not fully covered"),
        "int": ({**good, "a": entry(dtype="I32")}, data, "tensor a is I32, not one of"),
        "nan": (good, a.tobytes() + nan, "tensor b holds 1 non-finite"),
        "unprintable": ({"a\nb": entry(), "b": entry((4,), (24, 40))}, data,
                        'unprintable characters: "a\\nb"'),
        "inf": ({"a": entry(dtype="BF16", offsets=(0, 12)), "b": entry((4,), (12, 28))},
                np.full(6, 0x7F80, "<u2").tobytes() + data[24:], "tensor a holds 6 non-finite"),
    }
    for name, (header, body, needle) in cases.items():
        path = write_raw_safetensors(tmp_path / f"{name}.safetensors", header, body)
        if name == "limit":
            with open(path, "r+b") as f:
                f.write((200_000_000).to_bytes(8, "little"))
        with pytest.raises(SystemExit) as e:
            read_safetensors(path)
        message = str(e.value)
        assert message.startswith(f"error: model file {path}") and "\n" not in message and needle in message, \
            (name, message)


def test_crafted_speedrun_files(tmp_path, capsys, one_thread):
    """A speedrun file whose names say more blocks than its tensors hold (an index of 10**12: the reader
    once allocated a model of that many blocks) is refused at once, by its names; so are NaN weights. The
    reference's whole state_dict in bf16, its rotary buffers too (as a bf16 run of it holds them), loads,
    converted to fp32 with a line that says so; a crafted file given to the script is one line, no
    traceback."""
    cfg = tiny_cfg(n_layer=1, padded_vocab_size=8)
    state = tf.RECIPES[cfg.recipe].init(cfg)
    tf.write_speedrun_file(str(tmp_path / "tiny.safetensors"), state, cfg)
    tensors = load_file(str(tmp_path / "tiny.safetensors"))
    huge = "blocks.1000000000000.attn.q.weight"
    nan = {k: t.clone() for k, t in tensors.items()}
    nan["blocks.0.mlp.fc.weight"][3, 5] = float("nan")
    cases = [({**tensors, huge: tensors["blocks.0.attn.q.weight"].clone()}, f"holds tensor {huge}",
              "numbered 0..1"),
             ({k.replace("blocks.0.", "blocks.1000000000000."): t for k, t in tensors.items()},
              "holds tensor blocks.1000000000000.", "numbered 0..0"),
             (nan, "tensor blocks.0.mlp.fc.weight holds 1 non-finite")]
    for i, (edited, *needles) in enumerate(cases):
        path = str(tmp_path / f"case{i}.safetensors")
        save_file(edited, path)
        start = time.monotonic()
        with pytest.raises(SystemExit) as e:
            tf.read_speedrun_file(path)
        assert time.monotonic() - start < 2
        assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)

    module = sr.GPT(L, C).bfloat16()
    assert all(t.dtype == torch.bfloat16 for t in module.state_dict().values())
    path = tmp_path / "bf16.safetensors"
    save_file({k: t.contiguous() for k, t in module.state_dict().items()}, str(path))
    capsys.readouterr()
    header, params = read_weights(str(path), tiny_cfg())
    assert capsys.readouterr().out == (f"model file {path}: its BF16 tensors are converted to fp32, the "
                                       "type the trainer keeps its weights in\n")
    assert header["n_layer"] == L
    for k, p in module.named_parameters():
        np.testing.assert_array_equal(params[k], p.detach().float().numpy(), err_msg=k)

    deep = write_raw_safetensors(tmp_path / "deep.safetensors",
                                 b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    proc = run_script("train_gpt2_torchfunc.py", "--recipe", "speedrun", "--init-from", deep, "--data",
                      "synthetic", "--out-dir", tmp_path / "out", env=ENV, check=False)
    assert_clean_error(proc, "deep.safetensors", "recursion limit")
    assert not (tmp_path / "out").exists()
