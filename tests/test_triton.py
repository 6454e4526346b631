"""train_gpt2_triton.py: hand-derived backward, and its Triton kernels (GPT-2's and the speedrun recipe's),
with its --test, --profile and --bench-ops
(backend torch on the CPU, tiny model L2 H4 C64: --test against autograd, no autograd in a step, what the
forward keeps for the backward, --profile, --bench-ops; backend triton in Triton's interpreter without a GPU
(compiled, and bf16 too, with one): every kernel of both recipes against backend torch, and with loops over
several blocks (the embedding backward at 768 rows with a 600-row run, cross-entropy and the multi-tensor
kernels with small blocks), clipping by a NaN or inf norm in both backends, a training run against backend
torch, no torch compute op in a step of either recipe, its --profile tables, clean errors. Backend torch's
training run, exact resume, eval-only, evaluations lost to a kill run on resume and bad input are tested in
tests/test_trainers.py, its runs of two processes (ZeRO-1, both recipes) in tests/test_zero.py)."""
import json
import math
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import train_gpt2_triton as tg
from conftest import assert_clean_error, run_script, speedrun_random_weights, step_events, write_shard
from train_gpt2_jax import DataLoader

ON_GPU = torch.cuda.is_available() and not tg.INTERPRET  # backend triton compiled, bf16 checked too
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where backend triton's tests run

B, T, TOTAL = 2, 32, 128
FLAGS = ["--seq-len", T, "--batch-size", B, "--total-batch-size", TOTAL, "--lr", 3e-3, "--warmup", 2,
         "--lr-decay-frac", 1.0, "--dtype", "fp32", "--val-steps", 2]
TINY = ["--n-layer", 2, "--n-head", 4, "--n-embd", 64]


def small_cfg(**kw):
    """A GPT-2 with a 61-token vocabulary (padded to 64), for in-process steps that cost nothing."""
    return tg.Config(**{**dict(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=61,
                               padded_vocab_size=64, seq_len=8, batch_size=2, total_batch_size=32,
                               dtype="fp32"), **kw})


def small_state(recipe, device, **kw):
    """(cfg, numpy weights, training state) of small_cfg(**kw) for `recipe`: GPT-2 from its init, or the
    speedrun model, one 128-wide head wide and one block deep, from random nonzero weights (its own init
    zeroes the projections, which a first step would leave out of Muon's update)."""
    cfg = small_cfg(**kw)
    if recipe == "speedrun":
        cfg = tg.Config(**{**vars(cfg), "recipe": recipe, "n_layer": 1, "n_head": 1, "n_embd": tg.HEAD_DIM})
        params = speedrun_random_weights(tg.param_shapes(cfg), 4)
    else:
        params = tg.RECIPES[cfg.recipe].init(cfg)
    muon = tg.muon_names(tg.param_shapes(cfg))
    zeros = {k: np.zeros_like(p) for k, p in params.items()}
    return cfg, params, tg.make_state(params, zeros, {k: z for k, z in zeros.items() if k not in muon}, cfg,
                                      device)


def test_self_test_passes(capsys, one_thread):
    """`torch --test`: every op's forward and backward at 4 shapes and the whole model's loss, logits and
    16 gradients match torch.autograd in fp64 (rel 1e-10) and in bf16 (rel 3e-2); a table, no error."""
    tg.main(["torch", "--test"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if " pass " in line or " FAIL " in line]
    assert len(rows) == 2 * (len(tg.OP_CASES) + 2)
    assert all(" pass " in row for row in rows), out
    for name, _ in tg.OP_CASES:
        assert sum(row.startswith(name + " ") for row in rows) == 2, name
    assert f"all {len(rows)} checks passed" in out


def test_self_test_catches_a_wrong_backward(monkeypatch, capsys, one_thread):
    """--test fails, naming the op, when a backward is wrong: a GELU backward that forgets the tanh
    derivative's term fails its own check and the whole-model gradient check, and the run exits non-zero."""
    def gelu_backward_without_tanh_term(dy, pre):
        x = pre.to(tg._acc(pre.dtype))
        t = torch.tanh(tg.GELU_C * (x + 0.044715 * x ** 3))
        return (dy * 0.5 * (1.0 + t)).to(pre.dtype)

    monkeypatch.setattr(tg.TORCH_OPS, "gelu_backward", gelu_backward_without_tanh_term)
    monkeypatch.setattr(tg, "TEST_SHAPES", [(2, 7, 12, 3)])
    monkeypatch.setattr(tg, "OP_CASES", [(n, c) for n, c in tg.OP_CASES
                                         if n in ("gelu fwd+bwd", "layernorm fwd+bwd")])
    with pytest.raises(SystemExit) as e:
        tg.run_self_test(small_cfg())
    assert str(e.value) == "error: --test: 4 of 8 checks failed"
    table = capsys.readouterr().out
    failed = {line[:34].strip() for line in table.splitlines() if " FAIL " in line}
    assert failed == {"gelu fwd+bwd", "model: every parameter gradient"}


@pytest.mark.parametrize("recipe, fp8_head", [("gpt2", False), ("speedrun", False), ("speedrun", True)])
def test_no_autograd_in_a_training_step(monkeypatch, recipe, fp8_head, one_thread):
    """A training step of either recipe (the speedrun's with and without --fp8-head) records nothing for
    autograd: with the master weights made to require grad, every op runs with grad mode off and returns
    tensors without grad_fn, no op saves a tensor for backward (a saved-tensor hook that raises proves it:
    it does raise for a recorded product), autograd's entry points are never called, every op of the recipe
    runs (the FP8 ones with --fp8-head only), yet the step updates every weight tensor."""
    cfg, _, state = small_state(recipe, torch.device("cpu"), fp8_head=fp8_head)
    for t in state["params"].values():
        t.requires_grad_(True)  # so that any op run with grad mode on would record a graph
    before = {k: t.detach().clone() for k, t in state["params"].items()}
    seen = set()

    def guarded(name, fn):
        def call(*args, **kwargs):
            assert not torch.is_grad_enabled(), name
            out = fn(*args, **kwargs)
            for t in out if isinstance(out, tuple) else (out,):
                assert t is None or (t.grad_fn is None and not t.requires_grad), name
            seen.add(name)
            return out
        return call

    def forbidden(*args, **kwargs):
        raise AssertionError("autograd was called")

    def pack(t):
        raise AssertionError("an op saved a tensor for backward")

    for module, name in ((torch.autograd, "grad"), (torch.autograd, "backward"), (torch.Tensor, "backward")):
        monkeypatch.setattr(module, name, forbidden)
    ops = SimpleNamespace(**{k: guarded(k, f) for k, f in vars(tg.backend_ops("torch", recipe)).items()})
    xs = torch.randint(cfg.vocab_size, (2, cfg.batch_size, cfg.seq_len))  # (A, B, T)
    ys = torch.randint(cfg.vocab_size, (2, cfg.batch_size, cfg.seq_len))  # (A, B, T)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with pytest.raises(AssertionError, match="saved a tensor"):
            (state["params"]["norm1.gains" if recipe == "speedrun" else "wte"] ** 2).sum()
        loss, norm = tg.train_step(state, xs, ys, 1, cfg, ops, 1)
    fp8_ops = {name for name in tg.SPEEDRUN_OP_NAMES if name.startswith("fp8_")}
    if recipe == "speedrun":
        expected = set(tg.SPEEDRUN_OP_NAMES) - (set() if fp8_head else fp8_ops)
        assert expected <= seen and (fp8_head or not fp8_ops & seen)
    else:
        assert set(tg.OP_NAMES) <= seen
    assert math.isfinite(loss) and norm > 0
    assert all(not torch.equal(before[k], t) and t.grad is None for k, t in state["params"].items())


def test_forward_keeps_ten_channels_per_layer():
    """What one micro-batch's forward keeps for the backward, traced to the op that made each tensor: per
    layer the input residual, qkv (3C), the attention output (C) and its row logsumexp, the residual after
    the attention (C) and the MLP's pre-activation (4C), plus ln_f's statistics; nothing else."""
    cfg = small_cfg(n_layer=3, n_head=2, n_embd=16, seq_len=8, batch_size=3)
    params = tg.RECIPES[cfg.recipe].init(cfg)
    zeros = {k: np.zeros_like(p) for k, p in params.items()}
    w = tg.make_state(params, zeros, zeros, cfg, torch.device("cpu"))["weights"]
    x = torch.randint(cfg.vocab_size, (cfg.batch_size, cfg.seq_len))  # (B, T)
    N, C, L, f32 = cfg.batch_size * cfg.seq_len, cfg.n_embd, cfg.n_layer, 4
    assert tg.kept_bytes(w, x, cfg, tg.TORCH_OPS) == {
        "encoder_forward": N * C * f32,  # layer 0's input
        "residual_layernorm_forward": (2 * L * C + 2) * N * f32,  # res2, res3 per layer; ln_f's mean, rstd
        "matmul_forward": L * N * 3 * C * f32,  # qkv
        "attention_forward": L * (N * C + N * cfg.n_head) * f32,  # output and lse
        "matmul_gelu_forward": L * N * 4 * C * f32,  # pre-activation
    }


def test_profile_and_bench_ops(tmp_path, capsys, monkeypatch, one_thread):
    """--profile, as in the sibling trainers, profiles the PROFILE_STEPS steps after the first and trains
    on: it prints a row per op over those steps (time, share of the steps, TFLOP/s or GB/s, bytes kept
    for the backward) and their times, writes a Chrome trace with the ops labelled to OUT_DIR/profile,
    and leaves them out of the mean; --bench-ops prints each op against the PyTorch op it replaces."""
    synthetic = ["--data", "synthetic", *TINY, *FLAGS, "--batch-size", 1, "--seq-len", 16,
                 "--total-batch-size", 32, "--out-dir", tmp_path]
    tg.main(["torch", *map(str, synthetic), "--profile", "--steps", "5", "--val-every", "0", "--ckpt-every",
             "0", "--hellaswag-every", "0", "--sample-every", "0"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.split()[:1] and line.split()[0] in vars(tg.TORCH_OPS)}
    assert set(rows) == set(vars(tg.TORCH_OPS))
    assert all(int(r[0]) > 0 and float(r[1]) >= 0 for r in rows.values())
    assert int(rows["adamw_update"][0]) == tg.PROFILE_STEPS  # one update per profiled step
    assert "kept for the backward:" in out and "(outside the ops)" in out
    assert "profile: steps 2-4 traced into" in out
    assert "mean over 1 step(s) after the first, not profiled" in out
    with open(tmp_path / "profile" / "trace_rank0.json") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert set(vars(tg.TORCH_OPS)) <= names
    assert [e["step"] for e in step_events(tmp_path)] == [1, 2, 3, 4, 5]

    monkeypatch.setattr(tg, "BENCH_WARMUP", 1)
    monkeypatch.setattr(tg, "BENCH_REPS", 2)
    monkeypatch.setattr(tg, "COPY_BYTES", 1 << 20)
    tg.main(["torch", *map(str, synthetic), "--bench-ops"])
    out = capsys.readouterr().out
    benched = {line.split()[0] for line in out.splitlines() if " | " in line and line.endswith("x")}
    assert benched == set(vars(tg.TORCH_OPS)) - {"attention_backward"} | {"attention_forward+backward"}
    assert "copy bandwidth" in out


# -----------------------------------------------------------------------------
# Backend triton: without a GPU every kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by
# conftest), in fp32; with one, compiled, in fp32 and bf16.

def small_shard(tmp_path, cfg, n=4096):
    """A train shard of random tokens below the small vocabulary, and a loader over it."""
    path = tmp_path / "small_train_000001.bin"
    write_shard(path, np.random.default_rng(0).integers(0, cfg.vocab_size, n))
    return DataLoader([str(path)], cfg.batch_size, cfg.seq_len)


def test_triton_self_test_covers_every_kernel(capsys, one_thread):
    """`triton --test`, and with --recipe speedrun: every op of backend triton (forward and backward, the
    step's zero/clip/sum/copy, the speedrun recipe's own ops) matches backend torch run in fp64 at 4 shapes
    with odd sizes (fp32 rel 1e-4; bf16 3e-2 on a GPU), and so do each recipe's whole model's loss, logits
    and gradients (the interpreter splits the weight gradient over the rows past 32 rows: the split-K path
    runs); and the two runs launched every Triton kernel that the kernel files launch anywhere."""
    launches = []
    dtypes = 2 if ON_GPU else 1
    for recipe, cases in (("gpt2", tg.OP_CASES), ("speedrun", tg.SPEEDRUN_OP_CASES)):
        with tg.timed_kernels(DEVICE, launches, []):
            tg.main(["triton", "--recipe", recipe, "--test"])
        out = capsys.readouterr().out
        rows = [line for line in out.splitlines() if " pass " in line or " FAIL " in line]
        assert len(rows) == dtypes * (len(cases) + 2) and all(" pass " in row for row in rows), out
        for name, _ in cases:
            assert sum(row.startswith(name + " ") for row in rows) == dtypes, name
    source = open(tg.__file__).read() + open(tg.__file__).read()
    launched_in_file = set(re.findall(r"\b(\w+)\[", source)) & set(tg.launched_kernels())
    assert len(launched_in_file) >= 20 and {launch[1] for launch in launches} == launched_in_file


@pytest.mark.quick  # the quick tier's --recipe gpt2 run of backend triton
def test_triton_training_run_matches_backend_torch(tiny_shards, tiny_model_file, tmp_path, capsys, one_thread):
    """Two fp32 steps from the llm.c model file (its full 50304-row lm head): backend triton's per-step train
    loss and grad norm equal backend torch's (rel 1e-5: only summation orders differ), and log.jsonl says
    triton-triton. (Gradient accumulation: the --test model check and tests/test_cross.py.)"""
    flags = ["--data", str(tiny_shards), "--init-from", str(tiny_model_file), "--steps", "2", "--seq-len", "16",
             "--batch-size", "2", "--total-batch-size", "32", "--lr", "3e-3", "--warmup", "1", "--dtype", "fp32",
             "--ckpt-every", "0", "--val-every", "0", "--hellaswag-every", "0", "--sample-every", "0"]
    events = {}
    for backend in ("torch", "triton"):
        tg.main([backend, *flags, "--out-dir", str(tmp_path / backend)])
        events[backend] = step_events(tmp_path / backend)
    capsys.readouterr()
    assert [e["framework"] for e in events["triton"]] == ["triton-triton"] * 2
    for a, b in zip(events["torch"], events["triton"]):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert events["triton"][1]["train_loss"] != events["triton"][0]["train_loss"]


def test_triton_samples_through_backend_torch(tiny_model_file, capsys, monkeypatch, one_thread):
    """Backend triton samples through backend torch's ops (sampling is no kernel's job; in the interpreter a
    smoke run's samples outlasted its training): with its own ops removed, its samples are backend torch's."""
    ops = tg.backend_ops
    monkeypatch.setattr(tg, "backend_ops", lambda name, recipe="gpt2": ops(name, recipe) if name == "torch" else None)
    texts = []
    for backend in ("torch", "triton"):
        tg.main([backend, "--init-from", str(tiny_model_file), "--sample-only", "--sample-tokens", "8"])
        texts.append([line for line in capsys.readouterr().out.splitlines() if line.startswith("sample ")])
    assert texts[0] == texts[1] and len(texts[0]) == 4


ALLOWED_IN_STEP = {  # allocation, views, and reading the step's loss and norm on the host
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::lift_fresh",
    "aten::detach_", "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::slice", "aten::select",
    "aten::as_strided", "aten::t", "aten::transpose", "aten::unbind", "aten::to", "aten::item",
    "aten::_local_scalar_dense"}


def step_torch_ops(monkeypatch, ops, recipe="gpt2"):
    """{aten op: count} that one training step of small_state's model of `recipe` with `ops` runs, leaving
    out those inside a Triton kernel's launch (the interpreter copies its arguments to the host and back:
    a compiled launch runs no torch op) and inside the multi-tensor kernels' argument table (Python ints:
    sizes, addresses and weight decays, made into a tensor on the host and copied to the device)."""
    from triton.runtime.interpreter import GridExecutor

    def labelled(label, fn):
        def call(*args, **kwargs):
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)
        return call
    monkeypatch.setattr(GridExecutor, "__call__", labelled("excluded", GridExecutor.__call__))
    monkeypatch.setattr(tg, "_tensor_table", labelled("excluded", tg._tensor_table))
    # 40 rows: more than one interpreter block, so dW splits over the rows
    cfg, _, state = small_state(recipe, DEVICE, batch_size=5)
    xs = torch.randint(cfg.vocab_size, (2, cfg.batch_size, cfg.seq_len), device=DEVICE)  # (A, B, T)
    ys = torch.randint(cfg.vocab_size, (2, cfg.batch_size, cfg.seq_len), device=DEVICE)  # (A, B, T)
    if ON_GPU:  # the first call at each shape autotunes: Triton's benchmarking clones and zeroes buffers
        tg.train_step(state, xs, ys, 1, cfg, ops, 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("train_step"):
            loss, norm = tg.train_step(state, xs, ys, 1, cfg, ops, 1)
    assert math.isfinite(loss) and norm > 0
    counts = {}
    for e in prof.events():
        chain, parent = [], e.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        if e.name.startswith("aten::") and "train_step" in chain and "excluded" not in chain:
            counts[e.name] = counts.get(e.name, 0) + 1
    return counts


def test_no_torch_compute_op_in_a_triton_step(monkeypatch, one_thread):
    """Under torch.profiler, a whole training step of backend triton (2 micro-batches,
    zeroing, loss sum, global norm, clipping, AdamW) runs no torch op but allocation, views and reading the
    loss and the norm on the host; the same probe finds backend torch's compute ops (so it can fail)."""
    ops = step_torch_ops(monkeypatch, tg.TRITON_OPS)
    assert ops.get("aten::empty", 0) > 10 and ops.get("aten::item") == 2
    assert set(ops) <= ALLOWED_IN_STEP, sorted(set(ops) - ALLOWED_IN_STEP)
    torch_ops = step_torch_ops(monkeypatch, tg.TORCH_OPS)
    assert {"aten::mm", "aten::addmm", "aten::zero_", "aten::sum"} <= set(torch_ops) - ALLOWED_IN_STEP


def test_no_torch_compute_op_in_a_triton_speedrun_step(monkeypatch, one_thread):
    """The same for a step of the speedrun recipe (its own ops, AdamW's three groups and Muon's
    Newton-Schulz): backend triton runs no torch compute op, backend torch does."""
    ops = step_torch_ops(monkeypatch, tg.backend_ops("triton", "speedrun"), "speedrun")
    assert ops.get("aten::item") == 2
    assert set(ops) <= ALLOWED_IN_STEP, sorted(set(ops) - ALLOWED_IN_STEP)
    torch_ops = step_torch_ops(monkeypatch, tg.backend_ops("torch", "speedrun"), "speedrun")
    computed = set(torch_ops) - ALLOWED_IN_STEP
    assert {"aten::mm", "aten::addmm", "aten::rsqrt", "aten::_foreach_lerp_"} <= computed


def test_triton_profile_tables(tmp_path, capsys, monkeypatch, one_thread):
    """--profile with backend triton: per op and per kernel (under the op that launched it: the matmul's
    forward and backward uses apart) a row with time and share of the step, every kernel the step launched
    in the table, the torch op census (only allocation, views and host reads besides the pointer table's
    aten::cat), and a Chrome trace that labels each kernel launch; --bench-ops times every op of backend
    triton against the torch op it replaces."""
    cfg = small_cfg(out_dir=str(tmp_path), backend="triton", batch_size=1, total_batch_size=16)
    loader = small_shard(tmp_path, cfg)
    params = tg.RECIPES[cfg.recipe].init(cfg)
    zeros = {k: np.zeros_like(p) for k, p in params.items()}
    state = tg.make_state(params, zeros, dict(zeros), cfg, DEVICE)
    x, y = tg.step_batches(loader, 2)
    xs, ys = tg.put_batch(x, DEVICE), tg.put_batch(y, DEVICE)
    tg.train_step(state, xs, ys, 1, cfg, tg.TRITON_OPS, 1)  # on a GPU: compiles and autotunes
    profile = tg.start_profile(tg.TRITON_OPS, DEVICE)
    t0 = time.perf_counter()
    tg.train_step(state, xs, ys, 2, cfg, profile["ops"], 1)
    step_ms = 1000 * (time.perf_counter() - t0)
    tg.finish_profile(profile, [2], [step_ms], state["weights"], xs[0], cfg, tg.TRITON_OPS, DEVICE, 0, True)
    out = capsys.readouterr().out
    kernels = {line.split()[2]: line.split()[0] for line in out.splitlines()
               if " / " in line and not line.startswith("op / kernel")}
    assert {"matmul_kernel", "matmul_dw_kernel", "attn_fwd_kernel", "attn_bwd_dq_kernel", "_adamw_kernel",
            "_crossentropy_kernel", "_zero_fill_kernel", "_clip_by_norm_kernel"} <= set(kernels)
    rows = [line.split() for line in out.splitlines() if line.startswith("matmul_") and " / " in line]
    assert {r[0] for r in rows if r[2] == "matmul_kernel"} >= {"matmul_forward", "matmul_backward"}
    census = next(line for line in out.splitlines() if line.startswith("torch ops in the steps"))
    others = census.split("any other: ")[1]
    # the multi-tensor kernels' pointer table: built on the host (aten::cat), copied to a GPU (aten::_to_copy)
    for entry in [] if others == "none" else others.split(", "):
        name, _, _, op = entry.split()
        assert name in {"aten::cat", "aten::_to_copy", "aten::copy_"} and op in {"adamw_update", "global_norm"}, census
    with open(tmp_path / "profile" / "trace_rank0.json") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {f"kernel {k}" for k in kernels} <= names and "matmul_backward" in names

    monkeypatch.setattr(tg, "BENCH_WARMUP", 1)
    monkeypatch.setattr(tg, "BENCH_REPS", 1)
    monkeypatch.setattr(tg, "COPY_BYTES", 1 << 16)
    tg.bench_ops(cfg, tg.TRITON_OPS, DEVICE)
    out = capsys.readouterr().out
    benched = {line.split()[0] for line in out.splitlines() if " | " in line and line.endswith("x")}
    assert benched == set(vars(tg.TRITON_OPS)) - {"attention_backward"} | {"attention_forward+backward"}


def test_triton_clean_errors(tmp_path, tiny_shards, one_thread):
    """Backend triton without a GPU and without the interpreter, and bf16 in the interpreter, stop with a
    one-line error that says what to do."""
    base = ["triton", "--data", str(tiny_shards), "--out-dir", str(tmp_path / "out"), *map(str, TINY + FLAGS)]
    if torch.cuda.is_available():
        proc = run_script("train_gpt2_triton.py", *base, "--steps", "1", "--sample-every", "0",
                          "--hellaswag-every", "0", "--val-every", "0", env={"TRITON_INTERPRET": "0"})
        assert "step     1/1" in proc.stdout
        return
    proc = run_script("train_gpt2_triton.py", *base, check=False, env={"TRITON_INTERPRET": "0"})
    assert_clean_error(proc, "backend triton needs a CUDA GPU", "TRITON_INTERPRET=1")
    with pytest.raises(SystemExit) as e:
        tg.main(base + ["--dtype", "bf16"])
    assert "runs fp32 only" in str(e.value) and not (tmp_path / "out").exists()


def test_triton_encoder_backward_at_real_sizes(one_thread):
    """Backend triton's embedding backward at N = 768 rows (3 of the sort's 256-row key blocks: its loops
    over the blocks below and above a program's own run) equals backend torch's exactly (torch.equal on
    dwte and dwpe): dx and the gradients it adds into are multiples of 1/16 below 4 in magnitude, so every
    sum is exact in fp32 whatever its order. (a) random tokens from 40, repeated ~19 times each, their runs
    crossing tile boundaries; (b) one token over 600 rows (more than 16 tiles of ENC_SLOTS: the carry loop
    takes 3 steps) whose run starts and ends inside a tile, with other tokens before and after it."""
    gen = torch.Generator().manual_seed(7)
    B, T, C = 4, 192, 8
    N = B * T
    tokens = torch.cat([torch.randint(0, 17, (21,), generator=gen), torch.full((600,), 17),
                        torch.randint(18, 40, (N - 621,), generator=gen)])  # (N,) sorted: 17 from slot 21
    assert 21 % tg.ENC_SLOTS and 621 % tg.ENC_SLOTS and 600 > (tg.ENC_CARRY_TILES + 2) * tg.ENC_SLOTS
    assert N > 2 * tg.ENC_SORT_BLOCK_M
    for idx in (torch.randint(0, 40, (B, T), generator=gen),
                tokens[torch.randperm(N, generator=gen)].view(B, T)):  # (B, T) each
        dx = torch.randint(-64, 64, (B, T, C), generator=gen) / 16.0  # (B, T, C)
        dwte = torch.randint(-64, 64, (48, C), generator=gen) / 16.0  # (Vp, C) a backward adds into it
        dwpe = torch.randint(-64, 64, (T + 3, C), generator=gen) / 16.0  # (maxT, C)
        got = [t.to(DEVICE, copy=True) for t in (dwte, dwpe)]  # the same start, apart
        tg.TORCH_OPS.encoder_backward(dx, idx, dwte, dwpe)
        tg.TRITON_OPS.encoder_backward(dx.to(DEVICE), idx.to(DEVICE), *got)
        assert torch.equal(got[0].cpu(), dwte) and torch.equal(got[1].cpu(), dwpe)


def test_triton_crossentropy_over_several_blocks(one_thread):
    """The cross-entropy kernel with block_v = 128 (the interpreter's default takes a whole row in one
    block): V = 1000 spans 8 blocks, the last one partial, and Vp = 1040 adds a block of padded columns
    only; padded logits (80) above every real one must stay out of the logsumexp. Rows whose max lies in
    the first block, in the last (partial) one, rising block after block (a rescale of the running sum at
    every block), and with a second, larger max in a later block. Losses and dlogits match backend torch
    run in fp64 (max error relative to the largest value: 1e-6 and 1e-5); so do the soft-capped version's
    over V = 1000 columns (8 blocks), the speedrun model's loss."""
    gen = torch.Generator().manual_seed(3)
    N, V, Vp = 6, 1000, 1040
    logits = torch.randn(N, Vp, generator=gen) * 3  # (N, Vp)
    logits[:, V:] = 80.0
    logits[0, 5] += 25.0
    logits[1, 990] += 25.0
    logits[2] += torch.arange(Vp) * 0.05
    logits[3, 130] += 25.0
    logits[3, 700] += 30.0
    targets = torch.randint(V, (N,), generator=gen)  # (N,)
    targets[1], targets[3] = 990, 999
    want_dlogits = logits.double()  # (N, Vp) overwritten with dlogits
    want = tg.TORCH_OPS.crossentropy_forward_backward(want_dlogits, targets, V, 1.0 / N)  # (N,)
    got_dlogits = logits.to(DEVICE, copy=True)  # (N, Vp) overwritten with dlogits
    got = tg.crossentropy_forward_backward(got_dlogits, targets.to(DEVICE), V, 1.0 / N, block_v=128)
    assert tg.compare(got, want)[1] <= 1e-6
    assert tg.compare(got_dlogits, want_dlogits)[1] <= 1e-5
    assert not got_dlogits[:, V:].any()
    # the speedrun model's: soft-capped logits, the loss over all their columns
    z = logits[:, :V] * 3  # (N, V) well into the cap's bend
    want_dz = z.double()  # (N, V) overwritten with dz
    want = tg.TORCH_SPEEDRUN_OPS.softcap_crossentropy_forward_backward(want_dz, targets, 1.0 / N)  # (N,)
    got_dz = z.to(DEVICE, copy=True)  # (N, V) overwritten with dz
    got = tg.softcap_crossentropy_forward_backward(got_dz, targets.to(DEVICE), 1.0 / N, block_v=128)
    assert tg.compare(got, want)[1] <= 1e-6
    assert tg.compare(got_dz, want_dz)[1] <= 1e-5


GUARD = 16  # elements of signaling NaN just past each tensor that the multi-tensor kernels are given
SIGNALING_NAN = {torch.float32: 0x7F800001, torch.bfloat16: 0x7F81}  # arithmetic on one gives a quiet NaN


def guarded(t, dtype=None):
    """t (as `dtype`) on the device, as the first t.numel() elements of a buffer whose last GUARD elements
    hold signaling NaN: a kernel that reads past the tensor's end gets NaN, one that writes there leaves
    a quiet NaN or a number, either of which guard_intact sees."""
    dtype = dtype or t.dtype
    buf = torch.empty(t.numel() + GUARD, dtype=dtype, device=DEVICE)             # (n + GUARD,)
    buf[:t.numel()] = t.to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    buf[t.numel():].view(bits).fill_(SIGNALING_NAN[dtype])
    return buf[:t.numel()]


def guard_intact(t):
    """The GUARD elements past the end of a tensor that `guarded` made hold their signaling NaN still."""
    bits = torch.int32 if t.dtype == torch.float32 else torch.int16
    buf = t._base if t._base is not None else t
    return bool((buf[t.numel():].view(bits) == SIGNALING_NAN[t.dtype]).all())


def test_triton_multi_tensor_kernels_over_several_chunks(one_thread):
    """The global norm and AdamW with chunk = 256 and block = 64 (the interpreter's defaults make every
    test tensor one chunk of one block): tensors of 1000, 37, 2053 and 640 elements span up to 9 chunks of
    4 blocks each, with partial last chunks and blocks, each followed in memory by signaling NaN (`guarded`):
    a mask that reads past a tensor makes the norm NaN, one that writes past it spoils the guard. The norm
    matches backend torch in fp64 (rel 1e-6); two AdamW steps (the second with a gradient scale) match
    backend torch in fp64 (rel 1e-6) on params, m and v, and on a GPU the bf16 copies equal the params
    rounded to bf16."""
    gen = torch.Generator().manual_seed(5)
    sizes = [1000, 37, 2053, 640]

    def rand(scale=1.0):
        return [torch.randn(n, generator=gen) * scale for n in sizes]

    grads = rand()
    want = tg.TORCH_OPS.global_norm([g.double() for g in grads])
    assert tg.compare(tg.global_norm([guarded(g) for g in grads], chunk=256, block=64), want)[1] <= 1e-6
    state = [rand(), rand(0.1), [v.abs() for v in rand(0.1)]]  # params, m, v
    got = [[guarded(t) for t in ts] for ts in state]
    want = [[t.double() for t in ts] for ts in state]
    copies = [guarded(torch.zeros(n), torch.bfloat16) for n in sizes] if ON_GPU else None
    decays = [0.1, 0.0, 0.1, 0.0]
    for step, grad_scale in ((1, 1.0), (2, 0.37)):
        grads = rand()
        tg.adamw_update(got[0], [guarded(g) for g in grads], got[1], got[2], copies, 0.01, tg.BETA1, tg.BETA2,
                        tg.EPS, decays, step, grad_scale, chunk=256, block=64)
        tg.TORCH_OPS.adamw_update(want[0], [g.double() for g in grads], want[1], want[2], None, 0.01, tg.BETA1,
                                  tg.BETA2, tg.EPS, decays, step, grad_scale)
    for g_list, w_list in zip(got, want):
        assert all(tg.compare(g, w)[1] <= 1e-6 for g, w in zip(g_list, w_list))
        assert all(guard_intact(g) for g in g_list)
    if copies is not None:
        assert all(torch.equal(c, p.to(torch.bfloat16)) for c, p in zip(copies, got[0]))
        assert all(guard_intact(c) for c in copies)


def test_triton_muon_update_stays_inside_its_tensors(one_thread):
    """The speedrun's multi-tensor kernels (Muon's momentum, then its update of the masters) with chunk = 256
    and block = 64 over two 23 x 40 matrices (4 chunks each, the last one's last block partial), each followed in memory
    by signaling NaN (`guarded`): the masters and momenta match backend torch's fp32 Muon (rel 1e-5), and
    no guard was written (on a GPU the bf16 copies' neither)."""
    gen = torch.Generator().manual_seed(6)
    params, grads, ms = ([torch.randn(23, 40, generator=gen) * scale for _ in range(2)] for scale in (0.02, 1, 0.1))
    want = [[t.clone() for t in ts] for ts in (params, ms)]
    got = [[guarded(t.flatten()).view(23, 40) for t in ts] for ts in (params, grads, ms)]
    copies = [guarded(torch.zeros(23 * 40), torch.bfloat16).view(23, 40) for _ in range(2)] if ON_GPU else None
    tg.muon_update(got[0], got[1], got[2], copies, 0.02, tg.MUON_MOMENTUM, tg.MUON_WEIGHT_DECAY, torch.float32,
                    chunk=256, block=64)
    tg.TORCH_SPEEDRUN_OPS.muon_update(want[0], grads, want[1], None, 0.02, tg.MUON_MOMENTUM,
                                      tg.MUON_WEIGHT_DECAY, torch.float32)
    for g, w in zip(got[0] + got[2], want[0] + want[1]):
        assert tg.compare(g, w.to(DEVICE))[1] <= 1e-5
    assert all(guard_intact(t.flatten()) for t in got[0] + got[1] + got[2] + (copies or []))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0 in the interpreter
def test_clip_by_norm_passes_nan_and_inf_on(one_thread):
    """A NaN in one gradient makes the global norm NaN, and clipping by it turns every gradient into NaN in
    both backends, as torch.nn.utils.clip_grad_norm_ does (a clip that scales only when the coefficient is
    below 1 would leave them as they are); an inf makes the norm inf and the coefficient 0: finite
    gradients become 0, the inf NaN, in all three."""
    for bad in (float("nan"), float("inf")):
        g = torch.randn(3000, generator=torch.Generator().manual_seed(1))  # (n,) flat gradients
        g[1234] = bad
        p = torch.zeros_like(g, requires_grad=True)
        p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_([p], 1.0)
        assert p.grad.isnan().any()
        for ops, device in ((tg.TORCH_OPS, torch.device("cpu")), (tg.TRITON_OPS, DEVICE)):
            flat = g.clone().to(device)  # (n,)
            ops.clip_by_norm(flat, ops.global_norm([flat]), 1.0)
            torch.testing.assert_close(flat.cpu(), p.grad, rtol=0, atol=0, equal_nan=True)
