"""train_gpt2_jax.py: GPT-2 in plain JAX
(tiny model L2 H4 C64 T64 on the CPU: model and gradients; cuDNN attention on a GPU. Its training run,
resume, eval-only, two devices, evaluations lost to a kill run on resume and bad input are tested in
tests/test_trainers.py)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_gpt2_jax as tg
from conftest import tiny_params
from test_parity import has_cuda_gpu

V = 50257
B, T = 4, 64


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
