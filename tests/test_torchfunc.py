"""train_gpt2_torchfunc.py: GPT-2 as pure functions in PyTorch
(tiny model L2 H4 C64 T64 on the CPU: model and gradients, the compiled step, a training run, resume,
eval-only, HellaSwag padding, two torchrun processes, evaluations lost to a kill run on resume, bad
input)."""
import glob
import json
import os

import numpy as np
import pytest
import torch

import hellaswag
import llmc_reference
import train_gpt2_torchfunc as tf
from conftest import (STEP_KEYS, assert_clean_error, assert_due_events, assert_eval_only_repeats,
                      assert_same_checkpoint, read_log, run_script, step_events, step_lines, tiny_params,
                      write_bad_shards, write_shard)
from test_parity import has_cuda_gpu
from test_recovery import assert_lost_evaluations_recovered, write_damaged_checkpoints

V = 50257
B, T, TOTAL, STEPS = 4, 64, 512, 6  # two micro-batches per step
FLAGS = ["--seq-len", T, "--batch-size", B, "--total-batch-size", TOTAL, "--lr", 3e-3, "--warmup", 2,
         "--lr-decay-frac", 1.0, "--dtype", "fp32", "--val-steps", 2]
CPU = torch.device("cpu")
# the scripts' runs stay on the CPU even where a GPU is visible: resume must be exact, and CUDA's
# atomic-add embedding backward is not deterministic
ON_CPU = {"CUDA_VISIBLE_DEVICES": ""}
REF_MODULES = {"ln_1": "ln_1", "c_attn": "c_attn", "attn.c_proj": "attn_proj", "ln_2": "ln_2",
               "c_fc": "c_fc", "mlp.c_proj": "mlp_proj"}


def tiny_cfg(dtype="fp32"):
    return tf.Config(n_layer=2, n_head=4, n_embd=64, block_size=64, seq_len=T, batch_size=B, dtype=dtype)


def shard_tokens(path):
    return np.fromfile(path, dtype="<u2", offset=1024).astype(np.int64)


def ref_parts(model, name):
    """The tensors of tests/llmc_reference.py's float64 nn.Module GPT behind one of our stacked names:
    one tensor, or one per layer."""
    if name in ("wte", "wpe"):
        return [getattr(model, name).weight]
    if name.startswith("ln_f"):
        return [model.ln_f.weight if name.endswith(".w") else model.ln_f.bias]
    module, kind = name.rsplit(".", 1)
    return [getattr(getattr(blk, REF_MODULES[module]), "weight" if kind == "w" else "bias")
            for blk in model.h]


def ref_entry(model, name, index):
    """(tensor, index into it) of the reference parameter at our stacked `index`."""
    parts = ref_parts(model, name)
    return (parts[index[0]], index[1:]) if len(parts) > 1 else (parts[0], index)


def test_model_and_gradients(tiny_model_file, tiny_shards):
    """fp32: the model file reads back as written; loss and every gradient tensor equal the float64
    nn.Module reference of tests/llmc_reference.py (loss rel 1e-6, gradients rel 1e-5); the largest
    gradient coordinate of six tensors matches central finite differences of that reference (rel 1e-3);
    padded vocab rows get no gradient; in bf16 (bf16 copies of all weights but the fp32 embedding tables)
    the loss stays within 0.02 of fp32's, each gradient comes back in its weight's dtype, and they point
    the same way (cosine > 0.99)."""
    header, arrays = tf.read_model_file(str(tiny_model_file))
    assert header == dict(block_size=64, vocab_size=V, n_layer=2, n_head=4, n_embd=64,
                          padded_vocab_size=50304)
    for name, expected in zip(tf.PARAM_NAMES, tiny_params(seed=0)):
        np.testing.assert_array_equal(arrays[name], expected, err_msg=name)
    tokens = shard_tokens(tiny_shards / "tiny_train_000001.bin")
    x, y = torch.from_numpy(tokens[:64].reshape(2, 32)), torch.from_numpy(tokens[1:65].reshape(2, 32))
    params = tf.to_device(arrays, CPU)
    grads, loss = tf.grads_and_loss(params, x, y, 1.0, tiny_cfg())
    assert all(params[k].dtype == grads[k].dtype == torch.float32 for k in tf.PARAM_NAMES)
    assert not grads["wte"][V:].any()

    ref = llmc_reference.load_model_file(str(tiny_model_file))
    ref_loss = ref(x, y)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for k in tf.PARAM_NAMES:
        expected = torch.stack([p.grad for p in ref_parts(ref, k)]).reshape(grads[k][:V].shape)
        err = (grads[k][:V].double() - expected).norm() / expected.norm()
        assert err < 1e-5, f"{k}: relative gradient error {err:.2e}"

    eps = 1e-4  # float64 reference: truncation and rounding far below the fp32 gradients' own error
    with torch.no_grad():
        for k in ("wte", "wpe", "ln_1.w", "c_attn.w", "c_fc.b", "mlp.c_proj.w"):
            i = np.unravel_index(int(grads[k].abs().argmax()), grads[k].shape)
            t, j = ref_entry(ref, k, tuple(int(n) for n in i))
            t[j] += eps
            up = ref(x, y).item()
            t[j] -= 2 * eps
            down = ref(x, y).item()
            t[j] += eps
            assert grads[k][i].item() == pytest.approx((up - down) / (2 * eps), rel=1e-3, abs=1e-7), f"{k}{i}"

    cfg16 = tiny_cfg("bf16")
    weights16 = tf.model_weights(params, tf.compute_copies(params, cfg16))
    grads16, loss16 = tf.grads_and_loss(weights16, x, y, 1.0, cfg16)
    assert loss16.dtype == torch.float32 and loss16.item() == pytest.approx(loss.item(), abs=2e-2)
    assert [k for k in tf.PARAM_NAMES if grads16[k].dtype == torch.float32] == ["wte", "wpe"]
    assert all(grads16[k].dtype == weights16[k].dtype for k in tf.PARAM_NAMES)
    flat = lambda g: torch.cat([g[k].float().flatten() for k in tf.PARAM_NAMES])  # noqa: E731
    assert torch.nn.functional.cosine_similarity(flat(grads), flat(grads16), dim=0) > 0.99


def train_steps(cfg, start, device, grad_backend=None, update_backend=None, steps=2, accum=2):
    """`steps` optimizer steps of `accum` micro-batches of cfg.seed's synthetic tokens from the weights
    `start`, with the gradient and the update each eager (None) or torch.compile'd by the backend named,
    any recompilation an error. Returns ([(loss, grad norm)] per step, the first micro-batch's
    gradients, params, m, v, copies)."""
    zeros = {k: np.zeros_like(p) for k, p in start.items()}
    state = tf.make_state(start, zeros, zeros, cfg, device, 0, 1)
    params, copies, m, v = state["params"], state["copies"], state["m"], state["v"]
    grad_fn, update_fn = tf.grads_and_loss, tf.adamw_update
    torch._dynamo.reset()
    options = lambda backend: tf.INDUCTOR_OPTIONS if backend == "inductor" else None  # noqa: E731
    if grad_backend:
        grad_fn = torch.compile(grad_fn, fullgraph=True, backend=grad_backend, options=options(grad_backend))
    if update_backend:
        update_fn = torch.compile(update_fn, fullgraph=True, backend=update_backend,
                                  options=options(update_backend))
    loader = tf.DataLoader(None, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    out, first_grads = [], None
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(1, steps + 1):
            x, y = (tf.put_batch(t, device) for t in tf.step_batches(loader, accum))  # (A,B,T) each
            if first_grads is None:
                first_grads = grad_fn(tf.model_weights(params, copies), x[0], y[0], 1.0 / accum, cfg)[0]
            loss, norm = tf.train_step(state, x, y, tf.adam_scalars(step, cfg, device), cfg, grad_fn,
                                       update_fn, 1)
            out.append((loss.item(), norm.item()))
    return out, first_grads, params, m, v, copies


def assert_gradients_close(grads, reference, rtol):
    """Every gradient tensor within rtol of the reference's (relative L2 error), and no gradient in the
    padded vocabulary rows: a wrong or unwritten tensor, not just a wrong total norm, fails, and the
    message lists every tensor that is off."""
    assert not grads["wte"][V:].any()
    bad = []
    for k in tf.PARAM_NAMES:
        assert grads[k].dtype == reference[k].dtype, k
        a, b = grads[k].double(), reference[k].double()
        err = ((a - b).norm() / b.norm()).item()
        if not err < rtol:  # NaN too
            bad.append(f"{k}: relative error {err:.2e} (norm {a.norm():.4g}, expected {b.norm():.4g})")
    assert not bad, "gradients off: " + "; ".join(bad)


def test_compiled_step_matches_eager():
    """torch.compile traces the gradient (torch.func inside) and the AdamW update as one graph each
    (fullgraph), never recompiles across micro-batches or steps (new lr, new bias corrections), and
    gives the eager step's losses, norms and weights exactly. The backend is aot_eager: the same
    Dynamo/AOTAutograd graphs the GPU runs, without Inductor's C++ compile time on a laptop."""
    cfg = tiny_cfg()
    cfg.seq_len, cfg.batch_size = 32, 2
    start = tf.init_params_numpy(cfg)
    eager, _, *state = train_steps(cfg, start, CPU)
    comp, _, *state_c = train_steps(cfg, start, CPU, "aot_eager", "aot_eager")
    assert comp == eager
    for a, b in zip(state[:3], state_c[:3]):
        for k in tf.PARAM_NAMES:
            assert torch.equal(a[k], b[k]), k


def test_inductor_bf16_gradients_match_eager():
    """bf16 gradients through Inductor's generated kernels on the CPU (with the GPU's padded buffer
    strides): every gradient tensor of a micro-batch within 5% of eager's (relative L2), none in the
    padded vocab rows, the two steps' losses within 2e-3 and grad norms within 1%. (The update is
    eager here; test_compiled_step_matches_eager traces it.)"""
    cfg = tiny_cfg("bf16")
    cfg.seq_len, cfg.batch_size = 32, 2
    start = tf.init_params_numpy(cfg)
    eager, grads, *_ = train_steps(cfg, start, CPU)
    with torch._inductor.config.patch(disable_padding_cpu=False):
        comp, grads_c, *_ = train_steps(cfg, start, CPU, "inductor")
    assert_gradients_close(grads_c, grads, rtol=0.05)
    for (loss, norm), (loss_c, norm_c) in zip(eager, comp):
        assert loss_c == pytest.approx(loss, abs=2e-3) and norm_c == pytest.approx(norm, rel=1e-2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_shards, tiny_model_file, hellaswag_dir):
    """One fp32 run of 6 steps with val (every 3), HellaSwag and samples (step 6), checkpoints at 3 and 6."""
    out = tmp_path_factory.mktemp("torchfunc_run")
    proc = run_script("train_gpt2_torchfunc.py", "--data", tiny_shards, "--init-from", tiny_model_file,
                      "--steps", STEPS, "--out-dir", out, "--ckpt-every", 3, "--val-every", 3,
                      "--hellaswag-every", STEPS, "--sample-every", STEPS, *FLAGS,
                      env={"HELLASWAG_DIR": str(hellaswag_dir), **ON_CPU})
    return out, proc.stdout


def test_training_run(trained, tiny_shards, tiny_model_file):
    """A 6-step run: step 1's loss equals the float64 reference on the first two micro-batches of the
    train shard, the loss falls, val/HellaSwag/samples/checkpoints happen when due, log.jsonl holds only
    documented keys, and each checkpoint's state.npz records the step and the data position."""
    out, stdout = trained
    events = step_events(out)
    assert [e["step"] for e in events] == list(range(1, STEPS + 1))
    assert all(set(e) == STEP_KEYS and e["framework"] == "torchfunc" for e in events)
    assert all(e["mfu"] is None and e["peak_mem_gb"] is None and e["tokens_per_s"] > 0 for e in events)
    assert events[0]["lr"] == pytest.approx(1.5e-3) and events[-1]["lr"] == pytest.approx(3e-3)

    ref = llmc_reference.load_model_file(str(tiny_model_file))
    tokens = torch.from_numpy(shard_tokens(tiny_shards / "tiny_train_000001.bin"))
    with torch.no_grad():
        first = np.mean([ref(tokens[s:s + B * T].view(B, T), tokens[s + 1:s + B * T + 1].view(B, T)).item()
                         for s in (0, B * T)])
    assert events[0]["train_loss"] == pytest.approx(first, rel=1e-6)
    assert events[-1]["train_loss"] < events[0]["train_loss"] - 0.5

    assert_due_events(out, stdout, STEPS)
    swag = next(e for e in read_log(out) if "hellaswag_acc" in e)  # scored on the 10 examples
    assert all(round(10 * swag[k]) == pytest.approx(10 * swag[k]) for k in ("hellaswag_acc",
                                                                          "hellaswag_acc_norm"))
    assert "compile: off" in stdout and "mean over 5 step(s) after the first" in stdout

    for step in (3, STEPS):
        ckpt = out / f"ckpt_{step:07d}"
        assert sorted(os.listdir(ckpt)) == ["model.bin", "state.npz"]
        with np.load(ckpt / "state.npz") as z:
            assert int(z["step"]) == step and int(z["shard"]) == 0
            assert int(z["position"]) == step * TOTAL and int(z["seed"]) == 1337
            assert json.loads(str(z["config"]))["n_layer"] == 2
            assert all(z[f"{p}.{k}"].shape == tf.param_shapes(tiny_cfg())[k] for p in "mv"
                       for k in tf.PARAM_NAMES)
    header, _ = tf.read_model_file(str(out / "ckpt_0000006" / "model.bin"))
    assert header["n_layer"] == 2 and header["block_size"] == 64


def test_exact_resume_and_eval_only(trained, tiny_shards, tmp_path, hellaswag_dir):
    """Resuming the step-3 checkpoint (--resume auto) for steps 4-6 prints the uninterrupted run's losses
    and grad norms digit for digit and ends on byte-identical weights and AdamW state; --eval-only on the
    step-6 checkpoint reproduces that run's val loss and HellaSwag scores and trains nothing."""
    out, stdout = trained
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    os.symlink(out / "ckpt_0000003", resumed / "ckpt_0000003")
    proc = run_script("train_gpt2_torchfunc.py", "--data", tiny_shards, "--resume", "auto",
                      "--steps", STEPS, "--out-dir", resumed, "--ckpt-every", 3, "--val-every", 0,
                      "--hellaswag-every", 0, "--sample-every", 0, *FLAGS, env=ON_CPU)
    assert step_lines(proc.stdout) == step_lines(stdout)[3:]
    assert [e["step"] for e in step_events(resumed)] == [4, 5, 6]
    final = out / "ckpt_0000006"
    assert_same_checkpoint(final, resumed / "ckpt_0000006")

    evaluated = tmp_path / "eval"
    run_script("train_gpt2_torchfunc.py", "--data", tiny_shards, "--resume", final, "--eval-only",
               "--out-dir", evaluated, *FLAGS, env={"HELLASWAG_DIR": str(hellaswag_dir), **ON_CPU})
    assert_eval_only_repeats(out, evaluated, STEPS)


def test_checkpoint_written_before_a_failing_evaluation(tiny_shards, tiny_model_file, tmp_path):
    """At a step where a checkpoint and HellaSwag are both due, the checkpoint is written first: a
    corrupt HellaSwag file ends the run with a one-line error, and that step's checkpoint is on disk."""
    swag = tmp_path / "hellaswag"
    swag.mkdir()
    (swag / "hellaswag_val.jsonl").write_text("{not json\n")
    out = tmp_path / "out"
    proc = run_script("train_gpt2_torchfunc.py", "--data", tiny_shards, "--init-from", tiny_model_file,
                      "--steps", 2, "--out-dir", out, "--ckpt-every", 2, "--val-every", 0,
                      "--hellaswag-every", 2, "--sample-every", 0, *FLAGS, check=False,
                      env={"HELLASWAG_DIR": str(swag), **ON_CPU})
    assert_clean_error(proc, "not valid JSON")
    with np.load(out / "ckpt_0000002" / "state.npz") as z:
        assert int(z["step"]) == 2


def test_hellaswag_rows_padded_and_cropped(tiny_model_file, hellaswag_dir, monkeypatch):
    """evaluate_hellaswag pads each example to a fixed width (one compiled shape) and crops rows longer
    than the context: with the tiny model cut to a 32-token context, on the 10 real examples (5 padded,
    5 cropped) it predicts exactly what scoring the unpadded rows, cropped to their last 33 tokens,
    directly with token_losses predicts."""
    monkeypatch.setattr(hellaswag, "DEFAULT_CACHE_DIR", str(hellaswag_dir))
    encode = hellaswag.default_encode()
    _, arrays = tf.read_model_file(str(tiny_model_file))
    cfg = tiny_cfg()
    cfg.block_size = cfg.seq_len = 32
    params = tf.to_device({**arrays, "wpe": arrays["wpe"][:32]}, CPU)
    correct = correct_norm = n = cropped = 0
    for example in hellaswag.iterate_examples("val"):
        tokens, mask, label = hellaswag.render_example(example, encode)
        keep = tokens[:, -33:]
        x, y = torch.from_numpy(keep[:, :-1]), torch.from_numpy(keep[:, 1:])      # (4, kept-1) each
        with torch.no_grad():
            losses = tf.token_losses(params, x, y, cfg).numpy()                  # (4, kept-1)
        full = np.zeros((4, tokens.shape[1] - 1), np.float32)
        full[:, tokens.shape[1] - keep.shape[1]:] = losses
        pred, pred_norm = hellaswag.score(full, mask)
        correct, correct_norm, n = correct + (pred == label), correct_norm + (pred_norm == label), n + 1
        cropped += keep.shape[1] < tokens.shape[1]
    assert n == 10 and cropped == 5
    assert tf.evaluate_hellaswag(tf.token_losses, params, cfg, CPU) == (correct / n, correct_norm / n)


def test_two_processes_match_one(trained, tiny_shards, tiny_model_file, tmp_path):
    """torchrun with 2 CPU processes (gloo; rank-strided rows, one micro-batch each, the same global
    batch) gives the one-process losses and grad norms (rel 1e-5: only the order of the sums differs);
    only rank 0 writes; --profile writes a Chrome trace and prints the op table, and the ops split into
    forward, backward and optimizer step."""
    out = tmp_path / "two"
    proc = run_script("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                      "train_gpt2_torchfunc.py", "--data", tiny_shards, "--init-from", tiny_model_file,
                      "--steps", 3, "--out-dir", out, "--ckpt-every", 3, "--val-every", 0,
                      "--hellaswag-every", 0, "--sample-every", 0, "--profile", *FLAGS, env=ON_CPU)
    assert "2 x cpu" in proc.stdout and "1 micro-batches" in proc.stdout
    assert "profile: steps 2-3" in proc.stdout and "Self CPU" in proc.stdout
    # the phase table (eager on the CPU): forward, backward and optimizer step, each with its top ops;
    # the backward holds the weight-gradient matmuls; the norm, where it makes a phase's top rows (which
    # ops do depends on timings: a loaded machine shuffles the small ones), is in the optimizer step
    table = proc.stdout[proc.stdout.index("phase "):].splitlines()
    phases = {line.split()[0]: float(line.split()[-1].rstrip("%")) for line in table
              if line.split()[:1] in (["forward"], ["backward"], ["optimizer"]) and " all " in line}
    assert set(phases) == {"forward", "backward", "optimizer"}, table[:5]
    assert sum(phases.values()) == pytest.approx(100, abs=0.5) and min(phases.values()) > 0
    start = {line.split()[0]: i for i, line in enumerate(table) if " all " in line}
    assert any("aten::mm" in line for line in table[start["backward"]:start["optimizer"]])
    assert all(i > start["optimizer"] for i, line in enumerate(table) if "linalg_vector_norm" in line)
    assert glob.glob(str(out / "profile" / "trace_rank*.json"))
    assert proc.stdout.count("step     1/3") == 1
    one = step_events(trained[0])[:3]
    two = step_events(out)
    assert len(two) == 3
    for a, b in zip(one, two):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    with np.load(out / "ckpt_0000003" / "state.npz") as z:
        assert int(z["position"]) == 3 * TOTAL


def test_evaluations_lost_to_a_kill_run_on_resume(trained, tiny_shards, hellaswag_dir, tmp_path):
    """A run killed after a due step's checkpoint but before its evaluations (val loss, HellaSwag) runs the
    ones log.jsonl lacks when resumed, and only those, then trains on: its log ends up equal to the
    uninterrupted run's (test_recovery.assert_lost_evaluations_recovered)."""
    args = ["train_gpt2_torchfunc.py", "--data", tiny_shards, "--steps", STEPS, "--ckpt-every", 3,
            "--val-every", 3, "--hellaswag-every", STEPS, "--sample-every", 0, *FLAGS]
    assert_lost_evaluations_recovered(args, trained[0], ON_CPU, hellaswag_dir, tmp_path)


def test_bad_input(tmp_path, tiny_shards, tiny_model_file, monkeypatch):
    """Bad shards (wrong magic, truncated, a train or val shard with token ids past GPT-2's vocabulary),
    missing data (the default --data too: the error says how to get shards), a damaged checkpoint
    state.npz (text, cut, empty, a failing CRC, a member that does not inflate), a model file that
    contradicts the flags, bad flags and impossible batch settings end with a one-line error naming the
    problem."""
    monkeypatch.chdir(tmp_path)  # where the default --data data/fineweb_edu does not exist
    bad = write_bad_shards(tmp_path / "bad")
    (bad / "model.bin").write_bytes(tiny_model_file.read_bytes()[:-4])
    tokens = np.arange(5000) % V
    tokens[-1] = V  # the first id past the vocabulary, at the shard's end
    write_shard(bad / "vocab_train_000001.bin", tokens)
    tokens[-1] = 65535
    write_shard(bad / "wide_val_000000.bin", tokens)
    damaged = write_damaged_checkpoints(tf, tmp_path / "damaged")
    # a case that does not stop as it should trains one step, not the default 18,865
    base = ["--out-dir", str(tmp_path / "out"), "--seq-len", "64", "--batch-size", "4",
            "--total-batch-size", "512", "--steps", "1", "--ckpt-every", "0", "--val-every", "0",
            "--hellaswag-every", "0", "--sample-every", "0"]
    cases = [
        (["--data", str(bad / "magic_*.bin")], "magic 12345"),
        (["--data", str(bad / "short_*.bin")], "truncated"),
        (["--data", str(bad / "vocab_*.bin")], str(bad / "vocab_train_000001.bin"), "up to 50257",
         "vocabulary of 50257"),
        (["--data", str(tiny_shards), "--val-data", str(bad / "wide_*.bin")],
         str(bad / "wide_val_000000.bin"), "up to 65535"),
        (["--data", str(tiny_shards), "--init-from", str(tiny_model_file), "--n-layer", "3"],
         "--n-layer 3 does not match"),
        (["--data", str(tiny_shards), "--init-from", str(bad / "model.bin")], "its header implies"),
        (["--data", str(tiny_shards), "--dtype", "fp16"], "--dtype"),
        (["--data", str(tiny_shards), "--compile", "2"], "--compile"),
        (["--data", str(tiny_shards), "--total-batch-size", "500"], "not a multiple"),
        (["--data", str(tiny_shards), "--eval-only"], "--eval-only needs"),
        (["--data", str(tiny_shards), "--resume", str(bad)], "not a checkpoint directory"),
        ([], "--data data/fineweb_edu: no such directory", "python prepro_fineweb.py", "--data synthetic"),
        (["--data", str(tmp_path / "nothing")], "no such directory", "python prepro_fineweb.py"),
        (["--data", str(tiny_shards), "--val-data", str(tmp_path / "none_*.bin")], "--val-data"),
        (["--data", str(tiny_shards), "--seed", "-1"], "--seed"),
        (["--data", str(tiny_shards), "--grad-clip", "nan"], "--grad-clip"),
        (["--data", str(tiny_shards), "--lr", "inf"], "--lr"),
        (["--data", str(tiny_shards), "--resume", "auto", "--out-dir", str(damaged["text"].parent)],
         str(damaged["text"] / "state.npz"), "damaged"),
    ]
    cases += [(["--data", str(tiny_shards), "--resume", str(d)], str(d / "state.npz"), "damaged")
              for d in damaged.values()]
    for args, *needles in cases:
        with pytest.raises(SystemExit) as e:
            tf.main(base + ["--n-layer", "2", "--n-head", "4", "--n-embd", "64"] + args)
        assert str(e.value).startswith("error: ") and all(n in str(e.value) for n in needles), \
            (args, str(e.value))
    assert not (tmp_path / "out").exists()
    proc = run_script("train_gpt2_torchfunc.py", "--data", bad / "magic_*.bin", "--model", "d12",
                      "--n-layer", 1, *base, check=False, env=ON_CPU)
    assert_clean_error(proc, "magic")


@pytest.mark.skipif(not has_cuda_gpu(), reason="the Inductor/flash-attention path needs an NVIDIA GPU")
def test_compiled_step_on_gpu():
    """On an NVIDIA GPU, Inductor-compiled steps (the trainer's options) against eager ones at d12's width
    with 8,192 rows per micro-batch (where Inductor's LayerNorm-backward kernels differ from small
    shapes'): in fp32 every gradient tensor within 1e-3 of eager's (relative L2) and the same losses and
    grad norms (rel 1e-5 and 1e-4); in bf16 every gradient tensor within 5%, grad norms within 1%,
    losses within 0.01 and within 0.02 of fp32's, the update's bf16 copies equal to the new masters
    rounded; flash attention runs on our q/k/v layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gpu = torch.device("cuda")
    cfgs = {dtype: tf.Config(n_layer=3, n_head=12, n_embd=768, block_size=1024, seq_len=1024, batch_size=8,
                             dtype=dtype) for dtype in ("fp32", "bf16")}
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # fp32 without TF32; the bf16 matmuls are unaffected
    try:
        runs = {}
        for dtype, cfg in cfgs.items():
            start = tf.init_params_numpy(cfg)
            runs[dtype] = train_steps(cfg, start, gpu)
            runs[dtype, "compiled"] = train_steps(cfg, start, gpu, "inductor", "inductor")
        _, _, params, _, _, copies = runs["bf16", "compiled"]
        assert all(torch.equal(copies[k], params[k].to(torch.bfloat16)) for k in copies)
        x = torch.zeros((2, 64), dtype=torch.int64, device=gpu)                     # (2,64)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            assert torch.isfinite(tf.loss_fn(tf.model_weights(params, copies), x, x, cfgs["bf16"]))
    finally:
        torch.set_float32_matmul_precision(precision)
    assert_gradients_close(runs["fp32", "compiled"][1], runs["fp32"][1], rtol=1e-3)
    for (loss, norm), (loss_c, norm_c) in zip(runs["fp32"][0], runs["fp32", "compiled"][0]):
        assert loss_c == pytest.approx(loss, rel=1e-5) and norm_c == pytest.approx(norm, rel=1e-4)
    assert_gradients_close(runs["bf16", "compiled"][1], runs["bf16"][1], rtol=0.05)
    for (loss, norm), (loss_c, norm_c), (loss32, _) in zip(runs["bf16"][0], runs["bf16", "compiled"][0],
                                                          runs["fp32"][0]):
        assert norm_c == pytest.approx(norm, rel=1e-2)
        assert loss_c == pytest.approx(loss, abs=1e-2) and loss == pytest.approx(loss32, abs=2e-2)
