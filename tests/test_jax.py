"""train_gpt2_jax.py: GPT-2 in plain JAX
(tiny model L2 H4 C64 T64 on the CPU: model and gradients, a training run, resume, eval-only, two
devices, evaluations lost to a kill run on resume, bad input)."""
import glob
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_gpt2_jax as tg
from conftest import (STEP_KEYS, assert_clean_error, assert_due_events, assert_eval_only_repeats,
                      assert_same_checkpoint, read_log, run_script, step_events, step_lines, tiny_params,
                      write_bad_shards, write_shard)
from test_parity import has_cuda_gpu
from test_recovery import assert_lost_evaluations_recovered, write_damaged_checkpoints

V = 50257
B, T, TOTAL, STEPS = 4, 64, 512, 6  # two micro-batches per step
FLAGS = ["--seq-len", T, "--batch-size", B, "--total-batch-size", TOTAL, "--lr", 3e-3, "--warmup", 2,
         "--lr-decay-frac", 1.0, "--dtype", "fp32", "--val-steps", 2]


def tiny_cfg(dtype="fp32"):
    return tg.Config(n_layer=2, n_head=4, n_embd=64, block_size=64, seq_len=T, batch_size=B,
                     dtype=dtype, attn="xla")


def shard_tokens(path):
    return np.fromfile(path, dtype="<u2", offset=1024).astype(np.int32)


def reference_loss(params, x, y, n_head):
    """GPT-2's mean loss written out independently in numpy float64 (explicit softmax attention)."""
    def ln(h, w, b):
        mu = h.mean(-1, keepdims=True)
        return (h - mu) / np.sqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b

    p = {k: np.asarray(t, np.float64) for k, t in params.items()}
    Bx, Tx = x.shape
    h = p["wte"][x] + p["wpe"][:Tx]                                                # (B,T,C)
    C = h.shape[-1]
    D = C // n_head
    causal = np.tril(np.ones((Tx, Tx), bool))
    for l in range(p["ln_1.w"].shape[0]):
        qkv = ln(h, p["ln_1.w"][l], p["ln_1.b"][l]) @ p["c_attn.w"][l].T + p["c_attn.b"][l]  # (B,T,3C)
        q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(Bx, Tx, n_head, D).transpose(0, 2, 1, 3)
                   for i in range(3))                                              # (B,H,T,D) each
        att = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(D), -np.inf)  # (B,H,T,T)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y_att = (att @ v).transpose(0, 2, 1, 3).reshape(Bx, Tx, C)                 # (B,T,C)
        h = h + (y_att @ p["attn.c_proj.w"][l].T + p["attn.c_proj.b"][l])
        f = ln(h, p["ln_2.w"][l], p["ln_2.b"][l]) @ p["c_fc.w"][l].T + p["c_fc.b"][l]  # (B,T,4C)
        f = 0.5 * f * (1 + np.tanh(math.sqrt(2 / math.pi) * (f + 0.044715 * f ** 3)))
        h = h + (f @ p["mlp.c_proj.w"][l].T + p["mlp.c_proj.b"][l])
    logits = ln(h, p["ln_f.w"], p["ln_f.b"]) @ p["wte"][:V].T                      # (B,T,V)
    top = logits.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(logits - top).sum(-1))                       # (B,T)
    return float(np.mean(lse - np.take_along_axis(logits, y[..., None], -1)[..., 0]))


def test_model_and_gradients(tiny_model_file, tiny_shards):
    """fp32: the model file reads back as written; the loss equals an independent float64 numpy GPT-2
    (rel 1e-6); the largest gradient coordinate of six tensors (embeddings, LayerNorm, attention, MLP)
    matches central finite differences of that reference (rel 1e-3); padded vocab rows get no gradient;
    bf16 stays within 0.02 of the fp32 loss and its backward yields fp32 gradients."""
    header, params = tg.read_model_file(str(tiny_model_file))
    assert header == dict(block_size=64, vocab_size=V, n_layer=2, n_head=4, n_embd=64,
                          padded_vocab_size=50304)
    for name, expected in zip(tg.PARAM_NAMES, tiny_params(seed=0)):
        np.testing.assert_array_equal(params[name], expected, err_msg=name)
    tokens = shard_tokens(tiny_shards / "tiny_train_000001.bin")
    x, y = tokens[:32].reshape(2, 16), tokens[1:33].reshape(2, 16)  # small: the float64 reference is slow
    params = {k: jnp.asarray(p) for k, p in params.items()}
    with jax.default_matmul_precision("highest"):
        loss, grads = jax.jit(jax.value_and_grad(lambda p: tg.loss_fn(p, x, y, tiny_cfg())))(params)
    assert float(loss) == pytest.approx(reference_loss(params, x, y, 4), rel=1e-6)
    assert not np.any(np.asarray(grads["wte"][V:]))
    eps = 1e-4  # float64: truncation and rounding errors far below the fp32 gradients' own
    for k in ("wte", "wpe", "ln_1.w", "c_attn.w", "c_fc.b", "mlp.c_proj.w"):
        i = np.unravel_index(int(jnp.argmax(jnp.abs(grads[k]))), grads[k].shape)
        up, down = np.array(params[k], np.float64), np.array(params[k], np.float64)
        up[i] += eps
        down[i] -= eps
        numeric = (reference_loss({**params, k: up}, x, y, 4)
                   - reference_loss({**params, k: down}, x, y, 4)) / (2 * eps)
        assert float(grads[k][i]) == pytest.approx(numeric, rel=1e-3, abs=1e-7), f"{k}{i}"

    # bf16: the same loss within bf16's precision; the backward (traced, not compiled: it only checks
    # dtypes here, the GPU run is where bf16 speed and accuracy are measured) hands back fp32 gradients
    bf16 = tiny_cfg("bf16")
    assert float(jax.jit(lambda p: tg.loss_fn(p, x, y, bf16))(params)) == pytest.approx(float(loss),
                                                                                       abs=2e-2)
    shapes = jax.eval_shape(jax.value_and_grad(lambda p: tg.loss_fn(p, x, y, bf16)), params)
    assert shapes[0].dtype == jnp.float32 and all(shapes[1][k].dtype == jnp.float32 for k in tg.PARAM_NAMES)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Environment for this file's runs: the CPU even where a GPU is visible (resume must be exact and XLA's
    GPU scatter-add is not deterministic), and a persistent compilation cache shared by the runs, so that
    runs with the same shapes (a run and its resumption) compile once."""
    return {"JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_shards, tiny_model_file, hellaswag_dir, cache):
    """One fp32 run of 6 steps with val (every 3), HellaSwag and samples (step 6), checkpoints at 3 and 6."""
    out = tmp_path_factory.mktemp("jax_run")
    proc = run_script("train_gpt2_jax.py", "--data", tiny_shards, "--init-from", tiny_model_file,
                      "--steps", STEPS, "--out-dir", out, "--ckpt-every", 3, "--val-every", 3,
                      "--hellaswag-every", STEPS, "--sample-every", STEPS, *FLAGS,
                      env={"HELLASWAG_DIR": str(hellaswag_dir), **cache})
    return out, proc.stdout


def test_training_run(trained, tiny_shards, tiny_model_file):
    """A 6-step run: step 1's loss equals the model on the first two micro-batches of the train shard, the
    loss falls, val/HellaSwag/samples/checkpoints happen when due, log.jsonl holds only the documented keys,
    compile time is reported, and each checkpoint's state.npz records the step and the data position."""
    out, stdout = trained
    events = step_events(out)
    assert [e["step"] for e in events] == list(range(1, STEPS + 1))
    assert all(set(e) == STEP_KEYS and e["framework"] == "jax" for e in events)
    assert all(e["mfu"] is None and e["peak_mem_gb"] is None and e["tokens_per_s"] > 0 for e in events)
    assert events[0]["lr"] == pytest.approx(1.5e-3) and events[-1]["lr"] == pytest.approx(3e-3)

    _, params = tg.read_model_file(str(tiny_model_file))
    tokens = shard_tokens(tiny_shards / "tiny_train_000001.bin")
    first = np.mean([reference_loss(params, tokens[s:s + B * T].reshape(B, T),
                                    tokens[s + 1:s + B * T + 1].reshape(B, T), 4) for s in (0, B * T)])
    assert events[0]["train_loss"] == pytest.approx(first, rel=1e-5)
    assert events[-1]["train_loss"] < events[0]["train_loss"] - 0.5

    assert_due_events(out, stdout, STEPS)
    swag = next(e for e in read_log(out) if "hellaswag_acc" in e)  # scored on the 10 examples
    assert all(round(10 * swag[k]) == pytest.approx(10 * swag[k]) for k in ("hellaswag_acc",
                                                                          "hellaswag_acc_norm"))
    assert "compiled train step in" in stdout

    for step in (3, STEPS):
        ckpt = out / f"ckpt_{step:07d}"
        assert sorted(os.listdir(ckpt)) == ["model.bin", "state.npz"]
        with np.load(ckpt / "state.npz") as z:
            assert int(z["step"]) == step and int(z["shard"]) == 0
            assert int(z["position"]) == step * TOTAL and int(z["seed"]) == 1337
            assert json.loads(str(z["config"]))["n_layer"] == 2
            assert all(z[f"{p}.{k}"].shape == tg.param_shapes(tiny_cfg())[k] for p in "mv"
                       for k in tg.PARAM_NAMES)
    header, _ = tg.read_model_file(str(out / "ckpt_0000006" / "model.bin"))
    assert header["n_layer"] == 2 and header["block_size"] == 64


def test_exact_resume_and_eval_only(trained, tiny_shards, tmp_path, hellaswag_dir, cache):
    """Resuming the step-3 checkpoint for steps 4-6 prints the uninterrupted run's losses and grad norms
    digit for digit and ends on byte-identical weights and AdamW state; --eval-only on the step-6
    checkpoint reproduces that run's val loss and HellaSwag scores and trains nothing."""
    out, stdout = trained
    resumed = tmp_path / "resumed"
    proc = run_script("train_gpt2_jax.py", "--data", tiny_shards, "--resume", out / "ckpt_0000003",
                      "--steps", STEPS, "--out-dir", resumed, "--ckpt-every", 3, "--val-every", 0,
                      "--hellaswag-every", 0, "--sample-every", 0, *FLAGS, env=cache)
    assert step_lines(proc.stdout) == step_lines(stdout)[3:]
    assert [e["step"] for e in step_events(resumed)] == [4, 5, 6]
    final = out / "ckpt_0000006"
    assert_same_checkpoint(final, resumed / "ckpt_0000006")

    evaluated = tmp_path / "eval"
    run_script("train_gpt2_jax.py", "--data", tiny_shards, "--resume", final, "--eval-only",
               "--out-dir", evaluated, *FLAGS, env={"HELLASWAG_DIR": str(hellaswag_dir), **cache})
    assert_eval_only_repeats(out, evaluated, STEPS)


def test_checkpoint_survives_failed_eval(tiny_shards, tiny_model_file, tmp_path, cache):
    """At a step where a checkpoint and HellaSwag are both due, a HellaSwag that fails (a corrupt cached
    file) ends the run with a one-line error after the step's checkpoint has been written."""
    bad = tmp_path / "hellaswag"
    bad.mkdir()
    (bad / "hellaswag_val.jsonl").write_text("{not json\n")
    out = tmp_path / "run"
    proc = run_script("train_gpt2_jax.py", "--data", tiny_shards, "--init-from", tiny_model_file,
                      "--steps", 2, "--out-dir", out, "--ckpt-every", 2, "--val-every", 0,
                      "--hellaswag-every", 2, "--sample-every", 0, *FLAGS, check=False,
                      env={"HELLASWAG_DIR": str(bad), **cache})
    assert_clean_error(proc, "not valid JSON")
    assert sorted(os.listdir(out / "ckpt_0000002")) == ["model.bin", "state.npz"]


def test_two_devices_match_one(trained, tiny_shards, tiny_model_file, tmp_path, cache):
    """Two CPU devices (batch 2 each, same global batch), with the layers run as a lax.scan, give the
    one-device unrolled run's losses and grad norms (rel 1e-5: the order of the cross-device sums
    differs); --profile writes a trace and prints the traced steps' times."""
    out = tmp_path / "two"
    proc = run_script("train_gpt2_jax.py", "--data", tiny_shards, "--init-from", tiny_model_file,
                      "--steps", 3, "--out-dir", out, "--ckpt-every", 0, "--val-every", 0,
                      "--hellaswag-every", 0, "--sample-every", 0, "--profile", "--scan-layers", *FLAGS,
                      "--batch-size", 2,
                      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", **cache})
    assert "2 x cpu" in proc.stdout and "profile: steps 2-3" in proc.stdout
    assert glob.glob(str(out / "profile" / "**" / "*.trace.json.gz"), recursive=True)
    one = step_events(trained[0])[:3]
    two = step_events(out)
    assert len(two) == 3
    for a, b in zip(one, two):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def test_evaluations_lost_to_a_kill_run_on_resume(trained, tiny_shards, hellaswag_dir, tmp_path, cache):
    """A run killed after a due step's checkpoint but before its evaluations (val loss, HellaSwag) runs the
    ones log.jsonl lacks when resumed, and only those, then trains on: its log ends up equal to the
    uninterrupted run's (test_recovery.assert_lost_evaluations_recovered)."""
    args = ["train_gpt2_jax.py", "--data", tiny_shards, "--steps", STEPS, "--ckpt-every", 3, "--val-every", 3,
            "--hellaswag-every", STEPS, "--sample-every", 0, *FLAGS]
    assert_lost_evaluations_recovered(args, trained[0], cache, hellaswag_dir, tmp_path)


def test_bad_input(tmp_path, tiny_shards, tiny_model_file, cache, monkeypatch):
    """Bad shards (wrong magic, truncated, a train or val shard with token ids past GPT-2's vocabulary),
    missing data (the default --data too: the error says how to get shards), a damaged checkpoint
    state.npz (text, cut, empty, a failing CRC, a member that does not inflate), a model file that
    contradicts the flags, bad flags and impossible batch settings end with a one-line error naming the
    problem."""
    monkeypatch.chdir(tmp_path)  # where the default --data data/fineweb_edu does not exist
    bad = write_bad_shards(tmp_path / "bad")
    tokens = np.arange(5000) % V
    tokens[-1] = V  # the first id past the vocabulary, at the shard's end
    write_shard(bad / "vocab_train_000001.bin", tokens)
    tokens[-1] = 65535
    write_shard(bad / "wide_val_000000.bin", tokens)
    damaged = write_damaged_checkpoints(tg, tmp_path / "damaged")
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
        (["--data", str(tiny_shards), "--dtype", "fp16"], "--dtype"),
        (["--data", str(tiny_shards), "--total-batch-size", "500"], "not a multiple"),
        (["--data", str(tiny_shards), "--eval-only"], "--eval-only needs"),
        (["--data", str(tiny_shards), "--attn", "cudnn", "--dtype", "fp32"], "--attn cudnn needs"),
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
            tg.main(base + ["--n-layer", "2", "--n-head", "4", "--n-embd", "64"] + args)
        assert str(e.value).startswith("error: ") and all(n in str(e.value) for n in needles), \
            (args, str(e.value))
    assert not (tmp_path / "out").exists()
    proc = run_script("train_gpt2_jax.py", "--data", bad / "magic_*.bin", "--model", "d12", "--n-layer", 1,
                      *base, check=False, env=cache)
    assert_clean_error(proc, "magic")


@pytest.mark.skipif(not has_cuda_gpu(), reason="cuDNN attention needs an NVIDIA GPU")
def test_cudnn_attention_matches_xla(tiny_model_file, tiny_shards):
    """On an NVIDIA GPU in bf16: the cuDNN flash attention path gives XLA's attention's loss (within 0.01)
    and the same gradients (cosine > 0.999)."""
    _, params = tg.read_model_file(str(tiny_model_file))
    tokens = shard_tokens(tiny_shards / "tiny_train_000001.bin")
    x, y = tokens[:B * T].reshape(B, T), tokens[1:B * T + 1].reshape(B, T)
    results = {}
    for attn in ("cudnn", "xla"):
        cfg = tiny_cfg("bf16")
        cfg.attn = attn
        results[attn] = jax.jit(jax.value_and_grad(lambda p: tg.loss_fn(p, x, y, cfg)))(params)
    (loss_c, grads_c), (loss_x, grads_x) = results["cudnn"], results["xla"]
    assert float(loss_c) == pytest.approx(float(loss_x), abs=1e-2)
    flat = lambda g: np.concatenate([np.ravel(g[k]) for k in tg.PARAM_NAMES])  # noqa: E731
    a, b = flat(grads_c), flat(grads_x)
    assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) > 0.999
