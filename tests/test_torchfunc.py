"""train_gpt2_torchfunc.py: GPT-2 as pure functions in PyTorch
(tiny model L2 H4 C64 T64 on the CPU: model and gradients, the compiled step, HellaSwag padding;
Inductor on a GPU. Its training run, resume, eval-only, two torchrun processes, evaluations lost to a
kill run on resume and bad input are tested in tests/test_trainers.py)."""
import numpy as np
import pytest
import torch

import hellaswag
import llmc_reference
import train_gpt2_torchfunc as tf
from conftest import tiny_params
from test_parity import has_cuda_gpu
from train_gpt2_jax import DataLoader
from train_gpt2_jax import PARAM_NAMES

V = 50257
B, T = 4, 64
CPU = torch.device("cpu")
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
    for name, expected in zip(PARAM_NAMES, tiny_params(seed=0)):
        np.testing.assert_array_equal(arrays[name], expected, err_msg=name)
    tokens = shard_tokens(tiny_shards / "tiny_train_000001.bin")
    x, y = torch.from_numpy(tokens[:64].reshape(2, 32)), torch.from_numpy(tokens[1:65].reshape(2, 32))
    params = tf.to_device(arrays, CPU)
    grads, loss = tf.grads_and_loss(params, x, y, 1.0, tiny_cfg())
    assert all(params[k].dtype == grads[k].dtype == torch.float32 for k in PARAM_NAMES)
    assert not grads["wte"][V:].any()

    ref = llmc_reference.load_model_file(str(tiny_model_file))
    ref_loss = ref(x, y)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for k in PARAM_NAMES:
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
    assert [k for k in PARAM_NAMES if grads16[k].dtype == torch.float32] == ["wte", "wpe"]
    assert all(grads16[k].dtype == weights16[k].dtype for k in PARAM_NAMES)
    flat = lambda g: torch.cat([g[k].float().flatten() for k in PARAM_NAMES])  # noqa: E731
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
    loader = DataLoader(None, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
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
    for k in PARAM_NAMES:
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
    start = tf.RECIPES[cfg.recipe].init(cfg)
    eager, _, *state = train_steps(cfg, start, CPU)
    comp, _, *state_c = train_steps(cfg, start, CPU, "aot_eager", "aot_eager")
    assert comp == eager
    for a, b in zip(state[:3], state_c[:3]):
        for k in PARAM_NAMES:
            assert torch.equal(a[k], b[k]), k


def test_inductor_bf16_gradients_match_eager():
    """bf16 gradients through Inductor's generated kernels on the CPU (with the GPU's padded buffer
    strides): every gradient tensor of a micro-batch within 5% of eager's (relative L2), none in the
    padded vocab rows, the two steps' losses within 2e-3 and grad norms within 1%. (The update is
    eager here; test_compiled_step_matches_eager traces it.)"""
    cfg = tiny_cfg("bf16")
    cfg.seq_len, cfg.batch_size = 32, 2
    start = tf.RECIPES[cfg.recipe].init(cfg)
    eager, grads, *_ = train_steps(cfg, start, CPU)
    with torch._inductor.config.patch(disable_padding_cpu=False):
        comp, grads_c, *_ = train_steps(cfg, start, CPU, "inductor")
    assert_gradients_close(grads_c, grads, rtol=0.05)
    for (loss, norm), (loss_c, norm_c) in zip(eager, comp):
        assert loss_c == pytest.approx(loss, abs=2e-3) and norm_c == pytest.approx(norm, rel=1e-2)


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
            start = tf.RECIPES[cfg.recipe].init(cfg)
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
