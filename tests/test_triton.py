"""train_gpt2_triton.py: hand-derived backward and Triton kernels
(backend torch on the CPU, tiny model L2 H4 C64: --test against autograd, no autograd in a step, what the
forward keeps for the backward, a training run, exact resume, eval-only, --profile (two processes:
tests/test_zero.py), --bench-ops, evaluations lost to a kill run on resume, bad input; backend triton in
Triton's interpreter without a GPU (compiled, and bf16 too, with one): every kernel against backend
torch, and with loops over
several blocks (the embedding backward at 768 rows with a 600-row run, cross-entropy and the multi-tensor
kernels with small blocks), clipping by a NaN or inf norm in both backends, a training run against backend
torch, no torch compute op in a step, its --profile tables, clean errors)."""
import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import hellaswag
import train_gpt2_triton as tg
from conftest import (STEP_KEYS, assert_clean_error, assert_due_events, assert_eval_only_repeats,
                      assert_same_checkpoint, run_script, step_events, step_lines, write_bad_shards, write_shard)
from test_recovery import assert_lost_evaluations_recovered, write_damaged_checkpoints

ON_GPU = torch.cuda.is_available() and not tg.INTERPRET  # backend triton compiled, bf16 checked too
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where backend triton's tests run

V = 50257
B, T, TOTAL, STEPS = 2, 32, 128, 6  # two micro-batches per step
FLAGS = ["--seq-len", T, "--batch-size", B, "--total-batch-size", TOTAL, "--lr", 3e-3, "--warmup", 2,
         "--lr-decay-frac", 1.0, "--dtype", "fp32", "--val-steps", 2]
TINY = ["--n-layer", 2, "--n-head", 4, "--n-embd", 64]
# these models are too small to gain from intra-op threads, and on a busy 2-core machine the threads of
# concurrent runs slow each other down several times over
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture
def one_thread():
    """The in-process runs of a test use one intra-op thread, as the scripts started with ONE_THREAD do."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_cfg(**kw):
    """A GPT-2 with a 61-token vocabulary (padded to 64), for in-process steps that cost nothing."""
    return tg.Config(**{**dict(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=61,
                               padded_vocab_size=64, seq_len=8, batch_size=2, total_batch_size=32,
                               dtype="fp32"), **kw})


def shard_tokens(path):
    return np.fromfile(path, dtype=np.uint16, offset=1024).astype(np.int64)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_shards, tiny_model_file, hellaswag_dir):
    """One fp32 run of 6 steps with val (every 3), HellaSwag (4 examples) and samples (step 6), checkpoints
    at 3 and 6."""
    out = tmp_path_factory.mktemp("triton_torch_run")
    proc = run_script("train_gpt2_triton.py", "torch", "--data", tiny_shards, "--init-from", tiny_model_file,
                      "--steps", STEPS, "--out-dir", out, "--ckpt-every", 3, "--val-every", 3,
                      "--hellaswag-every", STEPS, "--hellaswag-limit", 4, "--sample-every", STEPS, *FLAGS,
                      env={"HELLASWAG_DIR": str(hellaswag_dir), **ONE_THREAD})
    return out, proc.stdout


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


def test_no_autograd_in_a_training_step(monkeypatch):
    """A training step records nothing for autograd: with the master weights made to require grad, every op
    runs with grad mode off and returns tensors without grad_fn, no op saves a tensor for backward (a
    saved-tensor hook that raises proves it: it does raise for a recorded product), autograd's entry points
    are never called, yet the step updates every weight tensor."""
    cfg = small_cfg()
    params = tg.init_params_numpy(cfg)
    zeros = {k: np.zeros_like(p) for k, p in params.items()}
    state = tg.make_state(params, zeros, zeros, cfg, torch.device("cpu"))
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
    ops = SimpleNamespace(**{k: guarded(k, f) for k, f in vars(tg.TORCH_OPS).items()})
    xs = torch.randint(cfg.vocab_size, (2, cfg.batch_size, cfg.seq_len))  # (A, B, T)
    ys = torch.randint(cfg.vocab_size, (2, cfg.batch_size, cfg.seq_len))  # (A, B, T)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with pytest.raises(AssertionError, match="saved a tensor"):
            (state["params"]["wte"] * state["params"]["wte"]).sum()
        loss, norm = tg.train_step(state, xs, ys, 1, cfg, ops, 1)
    assert seen == set(vars(tg.TORCH_OPS))
    assert math.isfinite(loss) and norm > 0
    assert all(not torch.equal(before[k], t) and t.grad is None for k, t in state["params"].items())


def test_forward_keeps_ten_channels_per_layer():
    """What one micro-batch's forward keeps for the backward, traced to the op that made each tensor: per
    layer the input residual, qkv (3C), the attention output (C) and its row logsumexp, the residual after
    the attention (C) and the MLP's pre-activation (4C), plus ln_f's statistics; nothing else."""
    cfg = small_cfg(n_layer=3, n_head=2, n_embd=16, seq_len=8, batch_size=3)
    params = tg.init_params_numpy(cfg)
    zeros = {k: np.zeros_like(p) for k, p in params.items()}
    w = tg.make_state(params, zeros, zeros, cfg, torch.device("cpu"))["wts"]
    x = torch.randint(cfg.vocab_size, (cfg.batch_size, cfg.seq_len))  # (B, T)
    N, C, L, f32 = cfg.batch_size * cfg.seq_len, cfg.n_embd, cfg.n_layer, 4
    assert tg.kept_bytes(w, x, cfg, tg.TORCH_OPS) == {
        "encoder_forward": N * C * f32,  # layer 0's input
        "residual_layernorm_forward": (2 * L * C + 2) * N * f32,  # res2, res3 per layer; ln_f's mean, rstd
        "matmul_forward": L * N * 3 * C * f32,  # qkv
        "attention_forward": L * (N * C + N * cfg.n_head) * f32,  # output and lse
        "matmul_gelu_forward": L * N * 4 * C * f32,  # pre-activation
    }


def test_training_run(trained, tiny_shards, tiny_model_file):
    """A 6-step run: step 1's loss equals the autograd reference model on the first two micro-batches of
    the train shard, the loss falls, val/HellaSwag/samples/checkpoints happen when due, and log.jsonl
    holds only the documented keys with framework triton-torch."""
    out, stdout = trained
    events = step_events(out)
    assert [e["step"] for e in events] == list(range(1, STEPS + 1))
    assert all(set(e) == STEP_KEYS and e["framework"] == "triton-torch" for e in events)
    on_gpu = torch.cuda.is_available()  # peak memory (and MFU on a known GPU) only there
    assert all((e["peak_mem_gb"] is not None) == on_gpu and e["tokens_per_s"] > 0 for e in events)
    assert on_gpu or all(e["mfu"] is None for e in events)
    assert events[0]["lr"] == pytest.approx(1.5e-3) and events[-1]["lr"] == pytest.approx(3e-3)

    header, params = tg.read_model_file(str(tiny_model_file))
    cfg = tg.Config(**header)
    p = {k: torch.from_numpy(a).double() for k, a in params.items()}
    tokens = torch.from_numpy(shard_tokens(tiny_shards / "tiny_train_000001.bin"))
    losses = []
    for s in (0, B * T):
        x, y = tokens[s:s + B * T].view(B, T), tokens[s + 1:s + B * T + 1].view(B, T)  # (B, T) each
        logits = tg.reference_logits(p, x, cfg)[..., :V]  # (B, T, V)
        losses.append(torch.nn.functional.cross_entropy(logits.reshape(B * T, V), y.reshape(-1)).item())
    assert events[0]["train_loss"] == pytest.approx(np.mean(losses), rel=1e-6)
    assert events[-1]["train_loss"] < events[0]["train_loss"] - 0.5

    assert_due_events(out, stdout, STEPS)

    with np.load(out / "ckpt_0000003" / "state.npz") as z:
        assert int(z["step"]) == 3 and int(z["shard"]) == 0 and int(z["position"]) == 3 * TOTAL
        assert json.loads(str(z["config"]))["backend"] == "torch"


def test_exact_resume_and_eval_only(trained, tiny_shards, tmp_path, hellaswag_dir, capsys, monkeypatch,
                                    one_thread):
    """Resuming the step-3 checkpoint for steps 4-6 prints the uninterrupted run's losses and grad norms
    digit for digit and ends on byte-identical weights and AdamW state; --eval-only on the step-6
    checkpoint reproduces that run's val loss and HellaSwag scores and trains nothing."""
    out, stdout = trained
    resumed = tmp_path / "resumed"
    tg.main(["torch", "--data", str(tiny_shards), "--resume", str(out / "ckpt_0000003"), "--steps",
             str(STEPS), "--out-dir", str(resumed), "--ckpt-every", "3", "--val-every", "0",
             "--hellaswag-every", "0", "--sample-every", "0", *map(str, FLAGS)])
    assert step_lines(capsys.readouterr().out) == step_lines(stdout)[3:]
    final = out / "ckpt_0000006"
    assert_same_checkpoint(final, resumed / "ckpt_0000006")

    evaluated = tmp_path / "eval"
    monkeypatch.setattr(hellaswag, "DEFAULT_CACHE_DIR", str(hellaswag_dir))
    tg.main(["torch", "--data", str(tiny_shards), "--resume", str(final), "--eval-only", "--out-dir",
             str(evaluated), "--hellaswag-limit", "4", *map(str, FLAGS)])
    assert_eval_only_repeats(out, evaluated, STEPS)


def test_profile_and_bench_ops(tmp_path, capsys, monkeypatch, one_thread):
    """--profile prints a row per op (time, share of the step, TFLOP/s or GB/s, bytes kept for the
    backward) and writes a Chrome trace with the ops labelled; --bench-ops prints each op against the
    PyTorch op it replaces."""
    synthetic = ["--data", "synthetic", *TINY, *FLAGS, "--batch-size", 1, "--seq-len", 16,
                 "--total-batch-size", 32, "--out-dir", tmp_path]
    tg.main(["torch", *map(str, synthetic), "--profile"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.split()[:1] and line.split()[0] in vars(tg.TORCH_OPS)}
    assert set(rows) == set(vars(tg.TORCH_OPS))
    assert all(int(r[0]) > 0 and float(r[1]) >= 0 for r in rows.values())
    assert "kept for the backward:" in out and "(outside the ops)" in out
    with open(tmp_path / "trace_triton-torch.json") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert set(vars(tg.TORCH_OPS)) <= names
    assert not (tmp_path / "log.jsonl").exists()

    monkeypatch.setattr(tg, "BENCH_WARMUP", 1)
    monkeypatch.setattr(tg, "BENCH_REPS", 2)
    monkeypatch.setattr(tg, "COPY_BYTES", 1 << 20)
    tg.main(["torch", *map(str, synthetic), "--bench-ops"])
    out = capsys.readouterr().out
    benched = {line.split()[0] for line in out.splitlines() if " | " in line and line.endswith("x")}
    assert benched == set(vars(tg.TORCH_OPS)) - {"attention_backward"} | {"attention_forward+backward"}
    assert "copy bandwidth" in out


def test_evaluations_lost_to_a_kill_run_on_resume(trained, tiny_shards, hellaswag_dir, tmp_path):
    """A run killed after a due step's checkpoint but before its evaluations (val loss, HellaSwag) runs the
    ones log.jsonl lacks when resumed, and only those, then trains on: its log ends up equal to the
    uninterrupted run's (test_recovery.assert_lost_evaluations_recovered)."""
    args = ["train_gpt2_triton.py", "torch", "--data", tiny_shards, "--steps", STEPS, "--ckpt-every", 3,
            "--val-every", 3, "--hellaswag-every", STEPS, "--hellaswag-limit", 4, "--sample-every", 0, *FLAGS]
    assert_lost_evaluations_recovered(args, trained[0], ONE_THREAD, hellaswag_dir, tmp_path)


def test_bad_input(tmp_path, tiny_shards, tiny_model_file, one_thread, monkeypatch):
    """Bad shards (wrong magic, truncated, a train or val shard with token ids past GPT-2's vocabulary),
    missing data (the default --data too: the error says how to get shards), a model file that
    contradicts the flags or is cut short, a directory that is not a checkpoint, a damaged checkpoint
    state.npz (text, cut, empty, a failing CRC, a member that does not inflate), a missing or unknown
    backend, bad flags and impossible batch settings end with a one-line error naming the problem, and
    write nothing."""
    monkeypatch.chdir(tmp_path)  # where the default --data data/fineweb_edu does not exist
    bad = write_bad_shards(tmp_path / "bad")
    (bad / "cut.bin").write_bytes(tiny_model_file.read_bytes()[:5000])
    tokens = np.arange(5000) % V
    tokens[-1] = V  # the first id past the vocabulary, at the shard's end
    write_shard(bad / "vocab_train_000001.bin", tokens)
    tokens[-1] = 65535
    write_shard(bad / "wide_val_000000.bin", tokens)
    damaged = write_damaged_checkpoints(tg, tmp_path / "damaged")
    out = tmp_path / "out"
    # a case that does not stop as it should trains one step, not the default 18,865
    base = ["--out-dir", str(out), *map(str, TINY + FLAGS), "--steps", "1", "--ckpt-every", "0",
            "--val-every", "0", "--hellaswag-every", "0", "--sample-every", "0"]
    cases = [
        (["torch", "--data", str(bad / "magic_*.bin")], "magic 12345"),
        (["torch", "--data", str(bad / "short_*.bin")], "truncated"),
        (["torch", "--data", str(bad / "vocab_*.bin")], str(bad / "vocab_train_000001.bin"), "up to 50257",
         "vocabulary of 50257"),
        (["torch", "--data", str(tiny_shards), "--val-data", str(bad / "wide_*.bin")],
         str(bad / "wide_val_000000.bin"), "up to 65535"),
        (["torch", "--data", str(tiny_shards), "--init-from", str(tiny_model_file), "--n-layer", "3"],
         "--n-layer 3 does not match"),
        (["torch", "--data", str(tiny_shards), "--init-from", str(bad / "cut.bin")], "has 5000 bytes"),
        (["torch", "--data", str(tiny_shards), "--resume", str(bad)], "not a checkpoint"),
        (["torch", "--data", str(tiny_shards), "--dtype", "fp16"], "--dtype"),
        (["torch", "--data", str(tiny_shards), "--total-batch-size", "100"], "not a multiple"),
        (["torch", "--data", str(tiny_shards), "--eval-only"], "--eval-only needs"),
        (["torch"], "--data data/fineweb_edu: no such directory", "python prepro_fineweb.py",
         "--data synthetic"),
        (["torch", "--data", str(tmp_path / "nothing")], "no such directory", "python prepro_fineweb.py"),
        (["torch", "--data", str(tiny_shards), "--val-data", str(tmp_path / "none_*.bin")], "--val-data"),
        (["torch", "--data", str(tiny_shards), "--seed", "-1"], "--seed"),
        (["torch", "--data", str(tiny_shards), "--grad-clip", "nan"], "--grad-clip"),
        (["torch", "--data", str(tiny_shards), "--lr", "inf"], "--lr"),
        (["torch", "--data", str(tiny_shards), "--resume", "auto", "--out-dir", str(damaged["text"].parent)],
         str(damaged["text"] / "state.npz"), "damaged"),
        (["jax", "--data", str(tiny_shards)], "argument backend"),
        (["--data", str(tiny_shards)], "required: backend"),
    ]
    cases += [(["torch", "--data", str(tiny_shards), "--resume", str(d)], str(d / "state.npz"), "damaged")
              for d in damaged.values()]
    for args, *needles in cases:
        with pytest.raises(SystemExit) as e:
            tg.main(base + args)
        assert str(e.value).startswith("error: ") and all(n in str(e.value) for n in needles), \
            (args, str(e.value))
    assert not out.exists()
    proc = run_script("train_gpt2_triton.py", "torch", "--data", bad / "magic_*.bin", *base, check=False,
                      env=ONE_THREAD)
    assert_clean_error(proc, "magic")


# -----------------------------------------------------------------------------
# Backend triton: without a GPU every kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by
# conftest), in fp32; with one, compiled, in fp32 and bf16.

def test_checkpoint_written_before_a_failing_evaluation(tiny_shards, tiny_model_file, tmp_path):
    """At a step where a checkpoint and HellaSwag are both due, the checkpoint is written first: a corrupt
    HellaSwag file ends the run with a one-line error, and that step's checkpoint is on disk."""
    swag = tmp_path / "hellaswag"
    swag.mkdir()
    (swag / "hellaswag_val.jsonl").write_text("{not json\n")
    out = tmp_path / "out"
    proc = run_script("train_gpt2_triton.py", "torch", "--data", tiny_shards, "--init-from", tiny_model_file,
                      "--steps", 2, "--out-dir", out, "--ckpt-every", 2, "--val-every", 0, "--hellaswag-every",
                      2, "--sample-every", 0, "--seq-len", 16, "--batch-size", 2, "--total-batch-size", 32,
                      "--dtype", "fp32", check=False, env={"HELLASWAG_DIR": str(swag), "OMP_NUM_THREADS": "1"})
    assert_clean_error(proc, "not valid JSON")
    with np.load(out / "ckpt_0000002" / "state.npz") as z:
        assert int(z["step"]) == 2


def small_shard(tmp_path, cfg, n=4096):
    """A train shard of random tokens below the small vocabulary, and a loader over it."""
    path = tmp_path / "small_train_000001.bin"
    write_shard(path, np.random.default_rng(0).integers(0, cfg.vocab_size, n))
    return tg.DataLoader([str(path)], cfg.batch_size, cfg.seq_len)


def test_triton_self_test_covers_every_kernel(capsys, one_thread):
    """`triton --test`: every op of backend triton (forward and backward, the step's zero/clip/sum/copy)
    matches backend torch run in fp64 at 4 shapes with odd sizes (fp32 rel 1e-4; bf16 3e-2 on a GPU), and
    so do the whole model's loss, logits and 16 gradients (the interpreter splits the weight gradient
    over the rows past 32 rows: the split-K path runs); and the run launched every Triton kernel that the
    file launches anywhere."""
    launches = []
    with tg.timed_kernels(DEVICE, launches, []):
        tg.main(["triton", "--test"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if " pass " in line or " FAIL " in line]
    dtypes = 2 if ON_GPU else 1
    assert len(rows) == dtypes * (len(tg.OP_CASES) + 2) and all(" pass " in row for row in rows), out
    for name, _ in tg.OP_CASES:
        assert sum(row.startswith(name + " ") for row in rows) == dtypes, name
    source = open(tg.__file__).read()
    launched_in_file = set(re.findall(r"\b(\w+)\[", source)) & set(tg.launched_kernels())
    assert len(launched_in_file) >= 20 and {launch[1] for launch in launches} == launched_in_file


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


ALLOWED_IN_STEP = {  # allocation, views, and reading the step's loss and norm on the host
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::lift_fresh",
    "aten::detach_", "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::slice", "aten::select",
    "aten::as_strided", "aten::t", "aten::transpose", "aten::unbind", "aten::to", "aten::item",
    "aten::_local_scalar_dense"}


def step_torch_ops(monkeypatch, ops):
    """{aten op: count} that one training step of a small model with `ops` runs, leaving out those inside
    a Triton kernel's launch (the interpreter copies its arguments to the host and back: a compiled launch
    runs no torch op) and inside the multi-tensor kernels' argument table (Python ints: sizes, addresses
    and weight decays, made into a tensor on the host and copied to the device)."""
    from triton.runtime.interpreter import GridExecutor

    def labelled(label, fn):
        def call(*args, **kwargs):
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)
        return call
    monkeypatch.setattr(GridExecutor, "__call__", labelled("excluded", GridExecutor.__call__))
    monkeypatch.setattr(tg, "_tensor_table", labelled("excluded", tg._tensor_table))
    cfg = small_cfg(batch_size=5)  # 40 rows: more than one interpreter block, so dW splits over the rows
    params = tg.init_params_numpy(cfg)
    state = tg.make_state(params, {k: np.zeros_like(p) for k, p in params.items()},
                          {k: np.zeros_like(p) for k, p in params.items()}, cfg, DEVICE)
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


def test_triton_profile_tables(tmp_path, capsys, monkeypatch, one_thread):
    """--profile with backend triton: per op and per kernel (under the op that launched it: the matmul's
    forward and backward uses apart) a row with time and share of the step, every kernel the step launched
    in the table, the torch op census (only allocation, views and host reads besides the pointer table's
    aten::cat), and a Chrome trace that labels each kernel launch; --bench-ops times every op of backend
    triton against the torch op it replaces."""
    cfg = small_cfg(out_dir=str(tmp_path), backend="triton", batch_size=1, total_batch_size=16)
    loader = small_shard(tmp_path, cfg)
    params = tg.init_params_numpy(cfg)
    zeros = {k: np.zeros_like(p) for k, p in params.items()}
    state = tg.make_state(params, zeros, dict(zeros), cfg, DEVICE)
    tg.profile_run(state, loader, cfg, tg.TRITON_OPS, 1, DEVICE, 2, "triton-triton", True)
    out = capsys.readouterr().out
    kernels = {line.split()[2]: line.split()[0] for line in out.splitlines()
               if " / " in line and not line.startswith("op / kernel")}
    assert {"matmul_kernel", "matmul_dw_kernel", "attn_fwd_kernel", "attn_bwd_dq_kernel", "_adamw_kernel",
            "_crossentropy_kernel", "_zero_fill_kernel", "_clip_by_norm_kernel"} <= set(kernels)
    rows = [line.split() for line in out.splitlines() if line.startswith("matmul_") and " / " in line]
    assert {r[0] for r in rows if r[2] == "matmul_kernel"} >= {"matmul_forward", "matmul_backward"}
    census = next(line for line in out.splitlines() if line.startswith("torch ops in the step"))
    others = census.split("any other: ")[1]
    # the multi-tensor kernels' pointer table: built on the host (aten::cat), copied to a GPU (aten::_to_copy)
    for entry in [] if others == "none" else others.split(", "):
        name, _, _, op = entry.split()
        assert name in {"aten::cat", "aten::_to_copy", "aten::copy_"} and op in {"adamw_update", "global_norm"}, census
    with open(tmp_path / "trace_triton-triton.json") as f:
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
    run in fp64 (max error relative to the largest value: 1e-6 and 1e-5)."""
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


def test_triton_multi_tensor_kernels_over_several_chunks(one_thread):
    """The global norm and AdamW with chunk = 256 and block = 64 (the interpreter's defaults make every
    test tensor one chunk of one block): tensors of 1000, 37, 2053 and 640 elements span up to 9 chunks of
    4 blocks each, with partial last chunks and blocks. The norm matches backend torch in fp64 (rel 1e-6);
    two AdamW steps (the second with a gradient scale) match backend torch in fp64 (rel 1e-6) on params, m
    and v, and on a GPU the bf16 copies equal the params rounded to bf16."""
    gen = torch.Generator().manual_seed(5)
    sizes = [1000, 37, 2053, 640]

    def rand(scale=1.0):
        return [torch.randn(n, generator=gen) * scale for n in sizes]

    grads = rand()
    want = tg.TORCH_OPS.global_norm([g.double() for g in grads])
    assert tg.compare(tg.global_norm([g.to(DEVICE) for g in grads], chunk=256, block=64), want)[1] <= 1e-6
    state = [rand(), rand(0.1), [v.abs() for v in rand(0.1)]]  # params, m, v
    got = [[t.to(DEVICE) for t in ts] for ts in state]
    want = [[t.double() for t in ts] for ts in state]
    copies = [torch.empty(n, dtype=torch.bfloat16, device=DEVICE) for n in sizes] if ON_GPU else None
    decays = [0.1, 0.0, 0.1, 0.0]
    for step, grad_scale in ((1, 1.0), (2, 0.37)):
        grads = rand()
        tg.adamw_update(got[0], [g.to(DEVICE) for g in grads], got[1], got[2], copies, 0.01, tg.BETA1, tg.BETA2,
                        tg.EPS, decays, step, grad_scale, chunk=256, block=64)
        tg.TORCH_OPS.adamw_update(want[0], [g.double() for g in grads], want[1], want[2], None, 0.01, tg.BETA1,
                                  tg.BETA2, tg.EPS, decays, step, grad_scale)
    for g_list, w_list in zip(got, want):
        assert all(tg.compare(g, w)[1] <= 1e-6 for g, w in zip(g_list, w_list))
    if copies is not None:
        assert all(torch.equal(c, p.to(torch.bfloat16)) for c, p in zip(copies, got[0]))


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
