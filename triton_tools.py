"""triton_tools.py: train_gpt2_triton.py's --test, --profile and --bench-ops (its main imports this file for them).

    python train_gpt2_triton.py torch --test               # every op and the whole model against autograd
    python train_gpt2_triton.py triton --test              # every kernel against backend torch
    python train_gpt2_triton.py triton --data synthetic --batch-size 16 --total-batch-size 65536 --steps 5 \\
        --profile                                          # tables of steps 2-4, per op and per kernel
    python train_gpt2_triton.py triton --bench-ops         # every op against the PyTorch op it replaces

Map:
    Self-test (--test)
    Profiling (--profile, --bench-ops)
    The tools of each recipe
"""
import contextlib
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
import triton

import triton_kernels
from train_gpt2_triton import (BETA1, BETA2, EPS, HEAD_ROWS, INTERPRET, LN_EPS, RECIPES, TORCH_OPS, Config, _acc,
                               backend_ops, compute_dtype, forward, forward_backward, op_table, param_shapes)
from trainkit import die
from trainkit.gpt2 import PARAM_NAMES
from trainkit.torch_shared import peak_memory_gb


# -----------------------------------------------------------------------------
# Self-test (--test)
#
# Each op on random inputs of several shapes, then the whole model's loss, logits and gradients over two
# micro-batches, against a reference (autograd for backend torch, backend torch for backend triton) run in
# fp64 on the very values the tested run sees (its inputs rounded to the dtype under test first).

# (B, T, C, H); the interpreter is slow: there a smaller batch, and T past its 32-row blocks twice, not 4 times
TEST_SHAPES = ([(1, 1, 8, 1), (2, 7, 12, 3), (2, 33, 40, 5), (1, 67, 64, 1)] if INTERPRET else
               [(1, 1, 8, 1), (2, 7, 12, 3), (3, 33, 40, 5), (1, 130, 64, 1)])
TEST_TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}  # max relative error
TEST_SEED = 1234


def _leaf(t):
    """A copy of t that autograd differentiates against."""
    return t.detach().clone().requires_grad_(True)


def _vjp(fn, inputs, dy):
    """The gradients of fn's output against dy with respect to inputs (each made a fresh leaf)."""
    leaves = [_leaf(t) for t in inputs]
    with torch.enable_grad():
        y = fn(*leaves)
    return torch.autograd.grad(y, leaves, dy)


def autograd_encoder_forward(idx, wte, wpe):
    return F.embedding(idx, wte) + wpe[:idx.shape[1]]  # (B, T, C)


def autograd_encoder_backward(dx, idx, dwte, dwpe):
    gwte, gwpe = _vjp(lambda wte, wpe: autograd_encoder_forward(idx, wte, wpe),  # linear: at zeros
                      (torch.zeros_like(dwte), torch.zeros_like(dwpe)), dx.to(dwte.dtype))
    dwte += gwte
    dwpe += gwpe


def autograd_layernorm_forward(x, w, b):
    y, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), w, b, LN_EPS)  # (N, C), (N, 1), (N, 1)
    return y, mean[:, 0], rstd[:, 0]


def autograd_residual_layernorm_forward(res, h, w, b):
    x = res + h  # (N, C)
    return (x, *autograd_layernorm_forward(x, w, b))


def autograd_layernorm_backward(dy, x, w, mean, rstd, dw, db, dres=None):
    dx, gw, gb = _vjp(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, LN_EPS), (x, w, torch.zeros_like(w)), dy)
    dw += gw
    db += gb
    return dx if dres is None else dx + dres


def autograd_matmul_gelu_forward(x, w, b):
    pre = F.linear(x, w, b)  # (N, M)
    return F.gelu(pre, approximate="tanh"), pre


def autograd_matmul_backward(dy, x, w, dw, db):
    b = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)  # (M,)
    grads = _vjp(F.linear, (x, w) if db is None else (x, w, b), dy)
    dw += grads[1]
    if db is not None:
        db += grads[2]
    return grads[0]


def autograd_gelu_backward(dy, pre):
    return _vjp(lambda pre: F.gelu(pre, approximate="tanh"), (pre,), dy)[0]


def autograd_attention_forward(qkv, n_head):
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in qkv.split(C, -1))  # (B, H, T, D)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
    s = q @ k.transpose(-1, -2) / math.sqrt(C // n_head)  # (B, H, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=qkv.device).tril()  # (T, T)
    lse = torch.logsumexp(s.masked_fill(~causal, float("-inf")), -1)  # (B, H, T)
    return out.transpose(1, 2).reshape(B, T, C), lse


def autograd_attention_backward(dout, qkv, out, lse, n_head):
    return _vjp(lambda qkv: autograd_attention_forward(qkv, n_head)[0], (qkv,), dout)[0]


def autograd_crossentropy_forward_backward(logits, targets, V, dloss):
    z = _leaf(logits)
    with torch.enable_grad():
        losses = F.cross_entropy(z[:, :V], targets, reduction="none")  # (N,)
    logits.copy_(torch.autograd.grad(losses, z, torch.full_like(losses, dloss))[0])
    return losses.detach()


def autograd_adamw_update(params, grads, ms, vs, copies, lr, beta1, beta2, eps, weight_decays, step,
                          grad_scale):
    """torch.optim.AdamW with its state set to the given moments and step (the same update in another form)."""
    opt = torch.optim.AdamW([{"params": [p], "weight_decay": wd} for p, wd in zip(params, weight_decays)],
                            lr=lr, betas=(beta1, beta2), eps=eps, foreach=False)
    for p, g, m, v in zip(params, grads, ms, vs):
        p.grad = g * grad_scale
        opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m, "exp_avg_sq": v}
    opt.step()
    for i, p in enumerate(params):
        p.grad = None
        if copies is not None:
            copies[i].copy_(p)


def autograd_clip_by_norm(g, norm, max_norm):
    """torch.nn.utils.clip_grads_with_norm_, on a parameter whose .grad is g."""
    p = _leaf(torch.zeros_like(g))
    p.grad = g
    torch.nn.utils.clip_grads_with_norm_([p], max_norm, norm, foreach=False)


AUTOGRAD_OPS = op_table("autograd", dict(
    encoder_forward=autograd_encoder_forward, encoder_backward=autograd_encoder_backward,
    layernorm_forward=autograd_layernorm_forward,
    residual_layernorm_forward=autograd_residual_layernorm_forward,
    layernorm_backward=autograd_layernorm_backward,
    matmul_forward=F.linear, matmul_gelu_forward=autograd_matmul_gelu_forward,
    matmul_backward=autograd_matmul_backward,
    gelu_forward=lambda pre: F.gelu(pre, approximate="tanh"), gelu_backward=autograd_gelu_backward,
    attention_forward=autograd_attention_forward, attention_backward=autograd_attention_backward,
    crossentropy_forward_backward=autograd_crossentropy_forward_backward,
    global_norm=lambda grads: torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])),
    adamw_update=autograd_adamw_update,
    zero_fill=lambda x: x.copy_(torch.zeros_like(x)), clip_by_norm=autograd_clip_by_norm,
    sum_into=lambda acc, x, scale: acc.copy_(acc + torch.sum(x) * scale),
    copy_into=lambda dst, src: dst.copy_(src.reshape(dst.shape)),
))


def op_inputs(dt, rdt, device):
    """Random test tensors in dt, each first rounded to rdt (the dtype under test): an fp64 reference run
    draws exactly the values the tested run (dt = rdt) draws."""
    gen = torch.Generator().manual_seed(TEST_SEED)

    def rand(*shape, scale=1.0, shift=0.0, acc=False, positive=False):
        """Normal(shift, scale) values in dt, or in the accumulation dtype with acc (gradient buffers)."""
        t = torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift  # shape
        t = t.abs() if positive else t
        return t.to(_acc(rdt) if acc else rdt).to(_acc(dt) if acc else dt).to(device)

    def randint(high, *shape):
        return torch.randint(high, shape, generator=gen).to(device)  # shape, int64

    return SimpleNamespace(rand=rand, randint=randint, dt=dt, rdt=rdt, device=device)


def case_encoder(ops, r, B, T, C, H):
    Vp = B * T + 3
    idx = r.randint(max(2, B * T // 2), B, T)  # (B, T) tokens repeat
    wte, wpe = r.rand(Vp, C), r.rand(T + 2, C)  # (Vp, C), (T+2, C)
    x = ops.encoder_forward(idx, wte, wpe)  # (B, T, C)
    dwte, dwpe = r.rand(Vp, C, acc=True), r.rand(T + 2, C, acc=True)  # filled: backwards add into them
    ops.encoder_backward(r.rand(B, T, C), idx, dwte, dwpe)
    return dict(x=x, dwte=dwte, dwpe=dwpe)


def case_layernorm(ops, r, B, T, C, H, residual=False):
    x = r.rand(B * T, C, scale=2.0, shift=0.5)  # (N, C)
    h = r.rand(B * T, C) if residual else None  # (N, C) added to x first
    w, b = r.rand(C, shift=1.0), r.rand(C)  # (C,) each
    x, y, mean, rstd = (ops.residual_layernorm_forward(x, h, w, b) if residual else
                        (x, *ops.layernorm_forward(x, w, b)))  # (N, C) x2, (N,) x2
    dw, db = r.rand(C, acc=True), r.rand(C, acc=True)  # (C,) each
    dx = ops.layernorm_backward(r.rand(B * T, C), x, w, mean, rstd, dw, db,
                                dres=r.rand(B * T, C) if residual else None)  # (N, C)
    return dict(y=y, mean=mean, rstd=rstd, dx=dx, dw=dw, db=db, **({"x": x} if residual else {}))


def case_matmul(ops, r, B, T, C, H, bias=True):
    M = 3 * C if bias else 5 * C + 3  # without bias like the lm head: a wide output
    x, w = r.rand(B * T, C), r.rand(M, C, scale=C ** -0.5)  # (N, C), (M, C)
    b = r.rand(M) if bias else None  # (M,)
    y = ops.matmul_forward(x, w, b)  # (N, M)
    dw, db = r.rand(M, C, acc=True), r.rand(M, acc=True) if bias else None  # (M, C), (M,)
    dx = ops.matmul_backward(r.rand(B * T, M), x, w, dw, db)  # (N, C)
    return dict(y=y, dx=dx, dw=dw, **({"db": db} if bias else {}))


def case_matmul_gelu(ops, r, B, T, C, H):
    x, w, b = r.rand(B * T, C), r.rand(4 * C, C, scale=C ** -0.5), r.rand(4 * C)  # (N, C), (4C, C), (4C,)
    y, pre = ops.matmul_gelu_forward(x, w, b)  # (N, 4C) each
    dpre = ops.gelu_backward(r.rand(B * T, 4 * C), pre)  # (N, 4C)
    dw, db = r.rand(4 * C, C, acc=True), r.rand(4 * C, acc=True)  # (4C, C), (4C,)
    dx = ops.matmul_backward(dpre, x, w, dw, db)  # (N, C)
    return dict(y=y, pre=pre, dpre=dpre, dx=dx, dw=dw, db=db)


def case_gelu(ops, r, B, T, C, H):
    pre = r.rand(B * T, 4 * C, scale=3.0)  # (N, 4C)
    y = ops.gelu_forward(pre)  # (N, 4C)
    return dict(y=y, dpre=ops.gelu_backward(r.rand(B * T, 4 * C), pre))


def case_attention(ops, r, B, T, C, H):
    qkv = r.rand(B, T, 3 * C, scale=1.5)  # (B, T, 3C)
    out, lse = ops.attention_forward(qkv, H)  # (B, T, C), (B, H, T)
    dqkv = ops.attention_backward(r.rand(B, T, C), qkv, out, lse, H)  # (B, T, 3C)
    return dict(out=out, lse=lse, dqkv=dqkv)


def case_crossentropy(ops, r, B, T, C, H):
    V = 5 * C + 1
    logits = r.rand(B * T, V + 7, scale=3.0)  # (N, Vp) padded columns too
    targets = r.randint(V, B * T)  # (N,)
    losses = ops.crossentropy_forward_backward(logits, targets, V, 1.0 / (B * T))  # (N,)
    return dict(losses=losses, dlogits=logits)


def case_global_norm(ops, r, B, T, C, H):
    grads = [r.rand(C, 3, acc=True), r.rand(T, acc=True), r.rand(B, C, H, acc=True)]
    return dict(norm=ops.global_norm(grads))


def case_adamw(ops, r, B, T, C, H):
    shapes = [(C, 3), (T,), (B, C, H)]
    params = [r.rand(*s, acc=True) for s in shapes]  # fp32 masters (fp64 in the reference)
    ms = [r.rand(*s, scale=0.1, acc=True) for s in shapes]
    vs = [r.rand(*s, scale=0.1, acc=True, positive=True) for s in shapes]
    copies = [p.to(r.dt) for p in params] if r.dt != params[0].dtype else None
    for step, grad_scale in ((1, 1.0), (2, 0.37), (7, 1.0)):
        grads = [r.rand(*s, acc=True) for s in shapes]
        ops.adamw_update(params, grads, ms, vs, copies, 0.01, BETA1, BETA2, EPS, [0.1, 0.0, 0.1], step,
                         grad_scale)
    out = {}
    for i in range(len(shapes)):
        out.update({f"p{i}": params[i], f"m{i}": ms[i], f"v{i}": vs[i],
                    f"copy{i}": params[i] if copies is None else copies[i]})
    return out


def case_step_ops(ops, r, B, T, C, H):
    """Zeroing, clipping (by a norm above the limit, and one below: no change), the loss sum, a row copy."""
    zeroed = r.rand(B, T, C)  # (B, T, C)
    ops.zero_fill(zeroed)
    clipped, kept = r.rand(B * T * C + 5, acc=True), r.rand(B * T * C + 5, acc=True)  # flat gradients
    ops.clip_by_norm(clipped, r.rand(positive=True, shift=3.0, acc=True), 1.0)
    ops.clip_by_norm(kept, r.rand(positive=True, acc=True), 50.0)
    acc = r.rand(acc=True)  # () a running loss
    ops.sum_into(acc, r.rand(B * T, positive=True, acc=True), 1.0 / (B * T))
    ops.sum_into(acc, r.rand(B * T, positive=True, acc=True), 0.5)
    copied = r.rand(B * T + 2, C)  # (N+2, C) an lm-head chunk's rows copied into its middle
    ops.copy_into(copied[1:B * T + 1], r.rand(B * T, C))
    return dict(zeroed=zeroed, clipped=clipped, kept=kept, acc=acc, copied=copied)


OP_CASES = [("encoder fwd+bwd", case_encoder), ("layernorm fwd+bwd", case_layernorm),
            ("residual+layernorm fwd+bwd", functools.partial(case_layernorm, residual=True)),
            ("matmul fwd+bwd", case_matmul), ("matmul no bias fwd+bwd", functools.partial(case_matmul, bias=False)),
            ("matmul+gelu fwd+bwd", case_matmul_gelu), ("gelu fwd+bwd", case_gelu),
            ("attention fwd+bwd", case_attention),
            ("crossentropy fwd+bwd", case_crossentropy), ("global_norm", case_global_norm),
            ("adamw_update x3", case_adamw), ("step ops: zero, clip, sum, copy", case_step_ops)]


def self_test_model_data(r, cfg):
    """Random weights (scaled so every path carries signal) and two micro-batches of tokens."""
    w = {}
    for name, shape in param_shapes(cfg).items():
        if name.startswith("ln") or name.endswith("gains"):
            w[name] = r.rand(*shape, scale=0.2, shift=1.0 if name.endswith((".w", "gains")) else 0.0)
        elif name.endswith((".b", ".bias")):
            w[name] = r.rand(*shape, scale=0.1)
        else:
            w[name] = r.rand(*shape, scale=0.5 if name in ("wte", "wpe", "embed.weight") else
                             shape[-1] ** -0.5)
    batches = [(r.randint(cfg.vocab_size, cfg.batch_size, cfg.seq_len),
                r.randint(cfg.vocab_size, cfg.batch_size, cfg.seq_len)) for _ in range(2)]
    return w, batches


def case_model(backend, r, cfg):
    """The first micro-batch's logits, the mean loss and all gradients over both, through the trainer's model
    on `backend` (the lm head in chunks of 5 rows: chunks end inside a sequence)."""
    ops = backend_ops(backend, cfg.recipe)
    w, batches = self_test_model_data(r, cfg)
    grads = {k: torch.zeros(t.shape, dtype=_acc(r.dt), device=r.device) for k, t in w.items()}
    x0 = batches[0][0]
    logits = forward(w, x0, replace(cfg, backend=backend)).view(x0.numel(), -1)  # (N, Vp)
    dloss = 1.0 / (x0.numel() * len(batches))
    loss = sum(forward_backward(w, grads, x, y, cfg, ops, dloss, head_rows=5).sum() for x, y in batches)
    return dict(logits=logits, loss=loss * dloss, **{f"grad {k}": g for k, g in grads.items()})


def reference_logits(p, x, cfg):
    """GPT-2 written with PyTorch's functional ops, for autograd: logits (B, T, Vp)."""
    B, T = x.shape
    C, H = cfg.n_embd, cfg.n_head
    h = F.embedding(x, p["wte"]) + p["wpe"][:T]  # (B, T, C)
    for l in range(cfg.n_layer):
        a = F.layer_norm(h, (C,), p["ln_1.w"][l], p["ln_1.b"][l], LN_EPS)  # (B, T, C)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2)
                   for t in F.linear(a, p["c_attn.w"][l], p["c_attn.b"][l]).split(C, -1))  # (B, H, T, D)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        h = h + F.linear(a, p["attn.c_proj.w"][l], p["attn.c_proj.b"][l])  # (B, T, C)
        a = F.layer_norm(h, (C,), p["ln_2.w"][l], p["ln_2.b"][l], LN_EPS)  # (B, T, C)
        a = F.gelu(F.linear(a, p["c_fc.w"][l], p["c_fc.b"][l]), approximate="tanh")  # (B, T, 4C)
        h = h + F.linear(a, p["mlp.c_proj.w"][l], p["mlp.c_proj.b"][l])  # (B, T, C)
    h = F.layer_norm(h, (C,), p["ln_f.w"], p["ln_f.b"], LN_EPS)  # (B, T, C)
    return F.linear(h, p["wte"])  # (B, T, Vp)


def reference_case_model(r, cfg):
    """What case_model computes, by autograd through reference_logits."""
    w, batches = self_test_model_data(r, cfg)
    names = list(w)
    leaves = [_leaf(w[k]) for k in names]
    p = dict(zip(names, leaves))
    with torch.enable_grad():
        losses = [F.cross_entropy(reference_logits(p, x, cfg)[..., :cfg.vocab_size].reshape(x.numel(), -1),
                                  y.reshape(-1)) for x, y in batches]
        loss = sum(losses) / len(losses)
    grads = torch.autograd.grad(loss, leaves)
    logits = reference_logits(w, batches[0][0], cfg).reshape(batches[0][0].numel(), -1)  # (N, Vp)
    return dict(logits=logits, loss=loss.detach(), **{f"grad {k}": g for k, g in zip(names, grads)})


def compare(got, want):
    """(max abs error, max error relative to want's largest magnitude); inf for a wrong shape or non-finite."""
    g = got.detach().to("cpu", torch.float64)
    w = want.detach().to("cpu", torch.float64)
    if g.shape != w.shape or not torch.isfinite(g).all():
        return math.inf, math.inf
    err = (g - w).abs().max().item() if g.numel() else 0.0
    scale = w.abs().max().item() if w.numel() else 0.0
    return err, (err / scale if scale > 0 else err)


@contextlib.contextmanager
def first_configs(active=True):
    """Inside (when active), every autotuned kernel runs the first config its pruning keeps, untimed."""
    tuners = [k for k in launched_kernels().values() if isinstance(k, triton.runtime.Autotuner)] if active else []
    prunes = [k.early_config_prune for k in tuners]
    for k, prune in zip(tuners, prunes):
        k.early_config_prune = lambda configs, named_args, prune=prune, **kwargs: (
            prune(configs, named_args, **kwargs) if prune else configs)[:1]
    try:
        yield
    finally:
        for k, prune in zip(tuners, prunes):
            k.early_config_prune = prune


def run_self_test(cfg):
    """--test: a table row by row as the checks run; exits non-zero if any fails. TF32 is off meanwhile (fp32
    references must be fp32), the caller's settings restored after."""
    tools = recipe_tools(cfg.recipe)
    if cfg.backend == "torch" and tools.autograd_test:
        die(f"--test --recipe {cfg.recipe} checks backend triton's kernels against backend torch (backend "
            f"torch's {cfg.recipe} ops are held to autograd by {tools.autograd_test})")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ops = backend_ops(cfg.backend, cfg.recipe)
    if cfg.backend == "torch":
        ref_ops, ref_model, dtypes = AUTOGRAD_OPS, reference_case_model, [torch.float64, torch.bfloat16]
    else:
        ref_ops, ref_model = backend_ops("torch", cfg.recipe), lambda r, c: case_model("torch", r, c)
        # bf16 on a GPU only: the interpreter multiplies bf16 wrongly
        dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" and not INTERPRET else [])
    ref_name = "torch.autograd" if cfg.backend == "torch" else "backend torch"
    # compiled kernels would autotune (compile and time every configuration) at each test shape: minutes
    pinned = cfg.backend == "triton" and not INTERPRET
    print(f"--test: backend {cfg.backend}, the {cfg.recipe} recipe's ops, against {ref_name} (run in fp64) "
          f"on {device}"
          + (", each autotuned kernel in the first configuration it would try" if pinned else ""))
    names = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16"}
    print(f"{'check':<34} {'dtype':<5} {'max abs err':>11} {'max rel err':>11} {'tolerance':>9}  result  "
          f"worst")

    def report(name, dt, results):  # a row as soon as it is known: a run cut short keeps what it checked
        abs_err = max(r[0] for r in results)
        _, rel_err, worst = max(results, key=lambda r: r[1])
        ok = rel_err <= TEST_TOLERANCES[dt]
        print(f"{name:<34} {names[dt]:<5} {abs_err:11.2e} {rel_err:11.2e} {TEST_TOLERANCES[dt]:9.0e}  "
              f"{'pass' if ok else 'FAIL':<6}  {worst}", flush=True)
        return ok

    f64 = torch.float64
    passed = []
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad(), first_configs(pinned):
            for dt in dtypes:
                for name, case in tools.test_cases():
                    results = []
                    for shape in TEST_SHAPES:
                        got = case(ops, op_inputs(dt, dt, device), *shape)
                        want = case(ref_ops, op_inputs(f64, dt, device), *shape)
                        results += [(*compare(got[k], want[k]), f"{k} @ {shape}") for k in want]
                    passed.append(report(name, dt, results))
                got = case_model(cfg.backend, op_inputs(dt, dt, device), tools.test_config)
                want = ref_model(op_inputs(f64, dt, device), tools.test_config)
                passed.append(report("model loss and logits", dt,
                                     [(*compare(got[k], want[k]), k) for k in ("loss", "logits")]))
                passed.append(report("model: every parameter gradient", dt,
                                     [(*compare(got[k], want[k]), k) for k in want if k.startswith("grad")]))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    if not all(passed):
        die(f"--test: {passed.count(False)} of {len(passed)} checks failed")
    print(f"--test: all {len(passed)} checks passed")


# -----------------------------------------------------------------------------
# Profiling (--profile, --bench-ops)

BENCH_WARMUP, BENCH_REPS = 3, 20


def _nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def op_work(name, args, kwargs, out):
    """(flops, bytes) that one call of op `name` cannot do without: the matmuls' and the causal attention's
    flops, else the bytes read and written; a recipe's own ops: its RecipeTools.op_work."""
    for recipe in RECIPES:
        work = recipe_tools(recipe).op_work(name, args, kwargs, out)
        if work is not None:
            return work
    outs = out if isinstance(out, tuple) else (out,)
    if name in ("matmul_forward", "matmul_gelu_forward"):
        x, w = args[0], args[1]
        return 2 * x.shape[0] * x.shape[1] * w.shape[0], 0
    if name == "matmul_backward":
        dy, x = args[0], args[1]
        return 4 * x.shape[0] * x.shape[1] * dy.shape[1], 0
    if name in ("attention_forward", "attention_backward"):
        B, T, C3 = args[0 if name == "attention_forward" else 1].shape
        return (2 if name == "attention_forward" else 5) * B * T * T * (C3 // 3), 0
    if name == "encoder_forward":
        idx, x = args[0], outs[0]
        return 0, _nbytes(idx) + 2 * _nbytes(x) + _nbytes(args[2][:idx.shape[1]])
    if name == "encoder_backward":
        dx, idx, dwte, dwpe = args[:4]
        rows = dx.numel() * dwte.element_size()  # the wte rows it updates, read and written
        return 0, _nbytes(dx, idx) + 2 * rows + 2 * dx[0].numel() * dwpe.element_size()
    if name == "layernorm_backward":  # dw, db (and dres) are read and written
        return 0, _nbytes(*args[:5], *args[7:], out, *kwargs.values()) + 2 * _nbytes(*args[5:7])
    if name == "crossentropy_forward_backward":
        return 0, 2 * _nbytes(args[0]) + _nbytes(args[1], out)
    if name == "global_norm":
        return 0, _nbytes(*args[0])
    if name == "adamw_update":  # p, m, v read and written; g read; the copies written
        params, grads, ms, vs, copies = args[:5]
        return 0, 2 * _nbytes(*params, *ms, *vs) + _nbytes(*grads, *(copies or ()))
    if name == "zero_fill":
        return 0, _nbytes(args[0])
    if name in ("clip_by_norm", "copy_into"):  # read and written (clip_by_norm: when it clips)
        return 0, 2 * _nbytes(args[0 if name == "clip_by_norm" else 1])
    if name == "sum_into":
        return 0, _nbytes(args[1])
    return 0, _nbytes(*args, *outs)  # layernorm, residual + layernorm and gelu: inputs read, outputs written


def _clock(device):
    """A point in time: a recorded CUDA event on the GPU (read after a synchronize), else the wall clock."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed_ms(t0, t1):
    return t0.elapsed_time(t1) if isinstance(t0, torch.cuda.Event) else 1000 * (t1 - t0)


def timed_ops(ops, device, calls, active=None):
    """ops, each call timed, labelled in the profiler's trace and appended to `calls` as [name, start, end,
    flops, bytes]; while it runs, `active` (a list) ends with (name, its index in calls)."""
    def wrap(name, fn):
        def call(*args, **kwargs):
            record = [name, None, None, 0, 0]
            calls.append(record)
            if active is not None:
                active.append((name, len(calls) - 1))
            with torch.profiler.record_function(name):
                record[1] = _clock(device)
                out = fn(*args, **kwargs)
                record[2] = _clock(device)
            if active is not None:
                active.pop()
            record[3:] = op_work(name, args, kwargs, out)
            return out
        return call
    return SimpleNamespace(**{name: wrap(name, fn) for name, fn in vars(ops).items()})


def kernel_work(name, a):
    """(flops, bytes) of one kernel launch with bound arguments `a`: our tl.dot kernels' FLOPs, else every
    distinct tensor passed, once (the embedding backward: the dwte rows it updates)."""
    if name in ("matmul_kernel", "matmul_dw_kernel"):
        batch = a["a_ptr"].shape[0] if a["a_ptr"].dim() == 3 else 1  # Newton-Schulz's batched products
        return 2 * a["M"] * a["N"] * a["K"] * batch, 0
    # the causal attention's (B, H, T, T) half matrices: 2 dots forward, 4 in dK/dV and 3 in dQ (recomputing)
    dots = {"attn_fwd_kernel": 2, "attn_bwd_dkdv_kernel": 4, "attn_bwd_dq_kernel": 3}.get(name)
    if dots is not None:
        q = a["q_ptr"]  # (B, T, C) view of qkv, or (B, T, H, D)
        return dots * q.shape[1] * q.numel(), 0
    tensors = {t.data_ptr(): t for t in a.values() if isinstance(t, torch.Tensor)}
    if name == "_encoder_wte_backward_kernel":
        dwte = tensors.pop(a["dwte_ptr"].data_ptr())
        return 0, _nbytes(*tensors.values()) + 2 * a["dx_ptr"].numel() * dwte.element_size()
    return 0, _nbytes(*tensors.values())


def launched_kernels():
    """{name: kernel} of every Triton jit, autotune or heuristics object of the kernel files loaded
    (triton_kernels, and a recipe's triton_kernels_<recipe>), jit helpers included."""
    modules = [triton_kernels] + [module for name, module in list(sys.modules.items())
                                  if name.startswith("triton_kernels_")]
    return {name: k for module in modules for name, k in vars(module).items()
            if isinstance(k, triton.runtime.KernelInterface)}


@contextlib.contextmanager
def timed_kernels(device, launches, active):
    """Inside, every launch of our kernels is timed and labelled `kernel <name>` in the trace, appended to
    `launches` as [op index (the innermost op running, see timed_ops, or None), kernel, start, end, flops, bytes]."""
    kernels = launched_kernels()

    def wrap(name, kernel, run):
        def timed_run(*args, **kwargs):
            with torch.profiler.record_function(f"kernel {name}"):
                t0 = _clock(device)
                out = run(*args, **kwargs)
                t1 = _clock(device)
            work = kernel_work(name, dict(zip(kernel.arg_names, args), **kwargs))
            launches.append([active[-1][1] if active else None, name, t0, t1, *work])
            return out
        return timed_run
    for name, kernel in kernels.items():
        kernel.run = wrap(name, kernel, kernel.run)  # an instance attribute over the class's method
    try:
        yield
    finally:
        for kernel in kernels.values():
            del kernel.run


ALLOCATION_OPS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                  "aten::lift_fresh", "aten::detach_", "aten::detach"}
VIEW_OPS = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::slice",
            "aten::select", "aten::as_strided", "aten::t", "aten::transpose", "aten::permute", "aten::unbind",
            "aten::narrow", "aten::split", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::alias",
            "aten::to"}  # aten::to is a view when nothing changes; a real conversion calls aten::_to_copy
HOST_READ_OPS = {"aten::item", "aten::_local_scalar_dense"}


def kept_bytes(w, x, cfg, ops):
    """{op name: bytes} that one micro-batch's forward keeps for its backward, traced to the op that made each
    saved tensor by its storage address."""
    maker = {}

    def wrap(name, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            for t in out if isinstance(out, tuple) else (out,):
                maker[t.data_ptr()] = name
            return out
        return call
    acts = []
    RECIPES[cfg.recipe].forward(w, x, cfg, SimpleNamespace(**{k: wrap(k, f) for k, f in vars(ops).items()}), acts)
    saved = {t.data_ptr(): t for a in acts for t in a.values()}  # distinct tensors
    kept = {}
    for ptr, t in saved.items():
        kept[maker[ptr]] = kept.get(maker[ptr], 0) + _nbytes(t)
    return kept


def _rate(flops, nbytes, ms):
    """Achieved TFLOP/s or GB/s, in the two columns of the profile's tables."""
    if flops:
        return f"{flops / ms / 1e9:8.2f} {'':>8}"
    return f"{'':>8} {nbytes / ms / 1e6:8.1f}" if nbytes else f"{'':>8} {'':>8}"


def start_profile(ops, device):
    """--profile, before its first step: torch.profiler records, and every op and kernel launch is timed and
    labelled; the profiled steps run the returned profile's "ops"; finish_profile ends it."""
    calls, launches, active = [], [], []
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    recording = contextlib.ExitStack()  # open across the profiled steps, closed by finish_profile
    prof = recording.enter_context(torch.profiler.profile(activities=activities))
    recording.enter_context(timed_kernels(device, launches, active))
    return dict(recording=recording, prof=prof, calls=calls, launches=launches,
                ops=timed_ops(ops, device, calls, active))


@torch.no_grad()
def finish_profile(profile, steps, steps_ms, weights, x, cfg, ops, device, rank, master):
    """--profile, after its last step: writes this process's Chrome trace to OUT_DIR/profile; rank 0 prints the
    per-op and per-kernel tables, the other torch ops and GPU work, what the forward keeps, the peak memory."""
    profile["recording"].close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prof, calls, launches = profile["prof"], profile["calls"], profile["launches"]
    trace = os.path.join(cfg.out_dir, "profile", f"trace_rank{rank}.json")
    os.makedirs(os.path.dirname(trace), exist_ok=True)
    prof.export_chrome_trace(trace)
    if not master:
        return
    mem = peak_memory_gb(device)  # before kept_bytes's forward
    kept = kept_bytes(weights, x, cfg, ops)
    step_ms = sum(steps_ms)
    table = {}
    for name, t0, t1, flops, nbytes in calls:
        row = table.setdefault(name, [0, 0.0, 0, 0])  # calls, ms, flops, bytes
        row[:] = row[0] + 1, row[1] + _elapsed_ms(t0, t1), row[2] + flops, row[3] + nbytes
    print(f"profile of steps {steps[0]}-{steps[-1]}: backend {cfg.backend}, {cfg.dtype}, micro-batches of "
          f"{cfg.batch_size} x {cfg.seq_len}, {cfg.total_batch_size} tokens per step, L{cfg.n_layer} "
          f"H{cfg.n_head} C{cfg.n_embd}")
    print(f"{'op':<37} {'calls':>5} {'ms':>9} {'% steps':>7} {'TFLOP/s':>8} {'GB/s':>8} {'kept MB':>8}")
    for name, (n, ms, flops, nbytes) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        mb = f"{kept[name] / 1e6:8.2f}" if name in kept else f"{'':>8}"
        print(f"{name:<37} {n:5d} {ms:9.3f} {100 * ms / step_ms:7.1f} {_rate(flops, nbytes, ms)} {mb}")
    in_ops = sum(row[1] for row in table.values())
    print(f"{'(outside the ops)':<30} {'':>5} {step_ms - in_ops:9.3f} {100 * (1 - in_ops / step_ms):7.1f}")
    print(f"{'steps':<30} {'':>5} {step_ms:9.3f} {100.0:7.1f}")
    # each kernel under the op that launched it; a memory-bound kernel that is all of its op, or the global
    # norm's (it reads through a pointer table), is credited with the op's bytes
    per_call, kernels = {}, {}
    for launch in launches:
        per_call.setdefault(launch[0], []).append(launch)
    for i, group in per_call.items():
        op = calls[i][0] if i is not None else "(step)"
        for _, name, t0, t1, flops, nbytes in group:
            if i is not None and not flops and calls[i][4] and (
                    len(group) == 1 or name == "_global_norm_partial_kernel"):
                nbytes = calls[i][4]
            row = kernels.setdefault((op, name), [0, 0.0, 0, 0])  # launches, ms, flops, bytes
            row[:] = row[0] + 1, row[1] + _elapsed_ms(t0, t1), row[2] + flops, row[3] + nbytes
    if kernels:
        print(f"\nper kernel, under the op that launched it ({len(launches)} launches):")
        print(f"{'op / kernel':<62} {'calls':>5} {'ms':>9} {'% steps':>7} {'TFLOP/s':>8} {'GB/s':>8}")
        for (op, name), (n, ms, flops, nbytes) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
            print(f"{op + ' / ' + name:<62} {n:5d} {ms:9.3f} {100 * ms / step_ms:7.1f} "
                  f"{_rate(flops, nbytes, ms)}")
        in_kernels = sum(row[1] for row in kernels.values())
        print(f"{'(outside the kernels: launches, Python, allocation)':<62} {'':>5} {step_ms - in_kernels:9.3f} "
              f"{100 * (1 - in_kernels / step_ms):7.1f}")
    # {(aten op, the op it ran in, or "(step)"): count} outside our kernels' launches (the interpreter copies
    # arguments inside them), nested aten ops included
    census, op_names = {}, set(vars(ops))
    for e in prof.events():
        if not e.name.startswith("aten::") or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        parent, op, inside = e.cpu_parent, "(step)", False
        while parent is not None and not inside:
            inside = parent.name.startswith("kernel ")
            op = parent.name if op == "(step)" and parent.name in op_names else op
            parent = parent.cpu_parent
        if not inside:
            census[e.name, op] = census.get((e.name, op), 0) + 1
    count = lambda names: sum(n for (aten, _), n in census.items() if aten in names)  # noqa: E731
    others = sorted((op, aten, n) for (aten, op), n in census.items()
                    if aten not in ALLOCATION_OPS | VIEW_OPS | HOST_READ_OPS)
    print(f"torch ops in the steps outside our kernels: {count(ALLOCATION_OPS)} allocating, {count(VIEW_OPS)} "
          f"making views, {count({'aten::item'})} reading a result on the host (aten::item); any other: "
          + (", ".join(f"{aten} x{n} in {op}" for op, aten, n in others) if others else "none"))
    if device.type == "cuda":
        ours = tuple(launched_kernels())
        foreign = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(ours):
                row = foreign.setdefault(e.name, [0, 0.0])
                row[:] = row[0] + 1, row[1] + (e.time_range.end - e.time_range.start) / 1000
        print("GPU work in the steps besides our kernels: " + (", ".join(
            f"{name} x{n} {ms:.3f} ms" for name, (n, ms) in foreign.items()) if foreign else "none"))
    print(f"kept for the backward: {sum(kept.values()) / 1e6:.2f} MB per micro-batch of {cfg.batch_size} "
          f"sequences | peak memory {'n/a' if mem is None else f'{mem:.2f} GB (steady state)'}")
    print(f"profile: steps {steps[0]}-{steps[-1]} traced into {trace} (Perfetto or chrome://tracing) | step "
          f"time mean {np.mean(steps_ms):.1f} ms, min {min(steps_ms):.1f} ms, max {max(steps_ms):.1f} ms")


def time_ms(fn, device):
    """Median ms of fn(): on a GPU by triton.testing.do_bench, else over BENCH_REPS calls after BENCH_WARMUP."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    for _ in range(BENCH_WARMUP):
        fn()
    times = []
    for _ in range(BENCH_REPS):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return float(np.median(times))


def op_case(ops, torch_ops, name, shape, args, torch_label, theirs=None):
    """A --bench-ops case: (name, shape, op `name` of ops called on args, torch_label, theirs (by default
    torch_ops' op `name` on args), args)."""
    theirs = theirs or (lambda: getattr(torch_ops, name)(*args))
    return name, shape, lambda: getattr(ops, name)(*args), torch_label, theirs, args


def bench_cases(cfg, ops, device):
    """[(op name, shape, our call, the PyTorch op it replaces, its call, args for op_work)] at the model's
    shapes (HEAD_ROWS rows for the lm head and the loss, as the step runs them)."""
    dt = compute_dtype(cfg)
    B, T, C, H, V, Vp = (cfg.batch_size, cfg.seq_len, cfg.n_embd, cfg.n_head, cfg.vocab_size,
                         cfg.padded_vocab_size)
    N, R = B * T, min(B * T, HEAD_ROWS)
    op = functools.partial(op_case, ops, TORCH_OPS)

    def rand(*shape, dtype=dt):
        return torch.randn(shape, device=device, dtype=dtype)

    idx = torch.randint(V, (B, T), device=device)  # (B, T)
    wte, wpe = rand(Vp, C), rand(T, C)  # (Vp, C), (T, C)
    dwte, dwpe = rand(Vp, C, dtype=torch.float32), rand(T, C, dtype=torch.float32)  # (Vp, C), (T, C)
    x, h, dy, w, b = rand(N, C), rand(N, C), rand(N, C), rand(C), rand(C)  # (N, C) x3, (C,) x2
    dw, db = rand(C, dtype=torch.float32), rand(C, dtype=torch.float32)  # (C,) each
    y, mean, rstd = ops.layernorm_forward(x, w, b)  # (N, C), (N,), (N,)
    cases = [
        op("encoder_forward", f"{B}x{T}x{C}", (idx, wte, wpe), "F.embedding + add",
           lambda: F.embedding(idx, wte) + wpe[:T]),
        op("encoder_backward", f"{B}x{T}x{C}", (dy.view(B, T, C), idx, dwte, dwpe), "sort + cumsum + index_add_"),
        op("layernorm_forward", f"{N}x{C}", (x, w, b), "torch.native_layer_norm",
           lambda: torch.native_layer_norm(x, (C,), w, b, LN_EPS)),
        op("residual_layernorm_forward", f"{N}x{C}", (x, h, w, b), "add + native_layer_norm",
           lambda: torch.native_layer_norm(x + h, (C,), w, b, LN_EPS)),
        op("layernorm_backward", f"{N}x{C}", (dy, x, w, mean, rstd, dw, db, h), "native_layer_norm_backward",
           lambda: torch.ops.aten.native_layer_norm_backward(dy, x, [C], mean[:, None], rstd[:, None], w, b,
                                                             [True, True, True])[0] + h),
    ]
    for label, K, M, bias in (("c_attn", C, 3 * C, True), ("attn.c_proj", C, C, True),
                              ("mlp.c_proj", 4 * C, C, True), ("lm head", C, Vp, False)):
        rows = R if label == "lm head" else N
        xm, wm, bm, dym = rand(rows, K), rand(M, K), rand(M) if bias else None, rand(rows, M)
        dwm, dbm = rand(M, K, dtype=torch.float32), rand(M, dtype=torch.float32) if bias else None
        cases += [op("matmul_forward", f"{label} {rows}x{K}x{M}", (xm, wm, bm), "F.linear",
                     lambda xm=xm, wm=wm, bm=bm: F.linear(xm, wm, bm)),
                  op("matmul_backward", f"{label} {rows}x{K}x{M}", (dym, xm, wm, dwm, dbm), "2 x torch.mm (+ sum)",
                     lambda dym=dym, xm=xm, wm=wm, bias=bias: (dym @ wm, dym.t() @ xm, dym.sum(0) if bias else None))]
    xf, wf, bf = rand(N, C), rand(4 * C, C), rand(4 * C)  # (N, C), (4C, C), (4C,)
    pre, dpre = rand(N, 4 * C), rand(N, 4 * C)  # (N, 4C) each
    qkv, dout = rand(B, T, 3 * C), rand(B, T, C)  # (B, T, 3C), (B, T, C)
    q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in qkv.split(C, -1))  # (B, H, T, D) each
    out, lse = ops.attention_forward(qkv, H)  # (B, T, C), (B, H, T)
    logits, targets = rand(R, Vp), torch.randint(V, (R,), device=device)  # (R, Vp), (R,)
    shapes = param_shapes(cfg)
    params = [rand(*shapes[k], dtype=torch.float32) for k in PARAM_NAMES]
    grads, ms = [torch.randn_like(p) for p in params], [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    copies = [p.to(dt) for p in params] if dt != torch.float32 else None
    adamw = torch.optim.AdamW([{"params": [p], "weight_decay": 0.1} for p in params], lr=1e-4,
                              betas=(BETA1, BETA2), eps=EPS, fused=device.type == "cuda")
    for p, g in zip(params, grads):
        p.grad = g
    adamw_args = (params, grads, ms, vs, copies, 1e-4, BETA1, BETA2, EPS, [0.1] * len(params), 1, 1.0)

    def sdpa_forward_backward():
        with torch.enable_grad():
            qkv_leaf = _leaf(qkv)
            qs, ks, vs_ = (t.view(B, T, H, C // H).transpose(1, 2) for t in qkv_leaf.split(C, -1))
            o = F.scaled_dot_product_attention(qs, ks, vs_, is_causal=True)  # (B, H, T, D)
            o.backward(dout.view(B, T, H, C // H).transpose(1, 2))

    def torch_cross_entropy():
        with torch.enable_grad():
            z = _leaf(logits)  # (R, Vp)
            F.cross_entropy(z[:, :V].float(), targets).backward()

    cases += [
        op("matmul_gelu_forward", f"c_fc {N}x{C}x{4 * C}", (xf, wf, bf), "F.linear + F.gelu",
           lambda: F.gelu(F.linear(xf, wf, bf), approximate="tanh")),
        op("gelu_forward", f"{N}x{4 * C}", (pre,), "F.gelu(tanh)", lambda: F.gelu(pre, approximate="tanh")),
        op("gelu_backward", f"{N}x{4 * C}", (dpre, pre), "aten.gelu_backward",
           lambda: torch.ops.aten.gelu_backward(dpre, pre, approximate="tanh")),
        op("attention_forward", f"{B}x{H}x{T}x{C // H}", (qkv, H), "SDPA causal",
           lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("attention_forward+backward", f"{B}x{H}x{T}x{C // H}",
         lambda: ops.attention_backward(dout, qkv, *ops.attention_forward(qkv, H), H),
         "SDPA causal fwd+bwd", sdpa_forward_backward, None),
        op("crossentropy_forward_backward", f"{R}x{Vp}", (logits, targets, V, 1.0 / R), "F.cross_entropy fwd+bwd",
           torch_cross_entropy),
        op("global_norm", f"{len(params)} tensors", (grads,), "torch._foreach_norm",
           lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))),
        op("adamw_update", f"{len(params)} tensors", adamw_args,
           f"torch AdamW ({'fused' if device.type == 'cuda' else 'for-loop'})", adamw.step),
    ]
    flat = rand(sum(p.numel() for p in params), dtype=torch.float32)  # (P,) all gradients
    norm = torch.full((), 1.001, device=device)  # () clips by 0.999: the values barely move over the reps
    losses, loss = rand(R, dtype=torch.float32), torch.zeros((), device=device)  # (R,), ()
    rows, chunk = rand(N, C), rand(R, C)  # (N, C), (R, C) an lm-head chunk's dh into its rows
    cases += [
        op("zero_fill", f"{flat.numel()} grads", (flat,), "Tensor.zero_", flat.zero_),
        op("clip_by_norm", f"{flat.numel()} grads", (flat, norm, 1.0), "mul_ by the clamped coefficient"),
        op("sum_into", f"{R} losses", (loss, losses, 1.0 / R), "Tensor.sum + add_"),
        op("copy_into", f"{R}x{C} rows", (rows[:R], chunk), "Tensor.copy_", lambda: rows[:R].copy_(chunk)),
    ]
    return cases


COPY_BYTES = 1 << 30  # the copy that measures memory bandwidth: 1 GiB, far beyond any cache


def copy_bandwidth_gbs(device):
    """The device memory's bandwidth as a COPY_BYTES copy achieves it (bytes read + written per second)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)  # (COPY_BYTES,)
    dst = torch.empty_like(src)  # (COPY_BYTES,)
    return 2 * src.numel() / time_ms(lambda: dst.copy_(src), device) / 1e6


@torch.no_grad()
def bench_ops(cfg, ops, device):
    """--bench-ops: each op against the PyTorch op it replaces, at the model's shapes: ms, TFLOP/s or GB/s (also
    as a share of the copy bandwidth, a memory-bound op's ceiling) and the speed-up."""
    copy_gbs = copy_bandwidth_gbs(device)
    print(f"--bench-ops: backend {cfg.backend}, {cfg.dtype}, B {cfg.batch_size} T {cfg.seq_len} "
          f"L{cfg.n_layer} H{cfg.n_head} C{cfg.n_embd} on {device} | copy bandwidth {copy_gbs:,.0f} GB/s")
    print(f"{'op':<37} {'shape':<26} {'ms':>8} {'rate':>12} {'% copy':>6} | {'PyTorch op':<28} {'ms':>8} "
          f"{'rate':>12} {'speed-up':>8}")
    cases = recipe_tools(cfg.recipe).bench_cases(cfg, ops, device)
    for name, shape, ours, torch_label, theirs, args in cases:
        ours_ms, theirs_ms = time_ms(ours, device), time_ms(theirs, device)
        if args is None:  # attention forward + backward
            B, T, C = cfg.batch_size, cfg.seq_len, cfg.n_embd
            flops, nbytes = 7 * B * T * T * C, 0
        else:
            flops, nbytes = op_work(name, args, {}, ours())

        def unit(ms):
            return f"{flops / ms / 1e9:7.2f} TF/s" if flops else f"{nbytes / ms / 1e6:7.0f} GB/s"
        share = "" if flops else f"{100 * nbytes / ours_ms / 1e6 / copy_gbs:5.0f}%"
        print(f"{name:<37} {shape:<26} {ours_ms:8.3f} {unit(ours_ms):>12} {share:>6} | {torch_label:<28} "
              f"{theirs_ms:8.3f} {unit(theirs_ms):>12} {theirs_ms / ours_ms:7.2f}x")


# -----------------------------------------------------------------------------
# The tools of each recipe
#
# What the tools ask of a recipe beside its RECIPES row: gpt2's row here; a recipe's own kernels file adds its
# row (TOOLS["speedrun"] = ...), so that deleting the speedrun recipe's parts leaves gpt2's tools working.

@dataclass(frozen=True)
class RecipeTools:
    """A row of TOOLS: what --test, --profile and --bench-ops need of a recipe."""
    test_config: Config   # --test's tiny model for the whole-model check
    test_cases: Callable  # () -> --test's [(check, case)] of its ops
    autograd_test: str    # "": --test holds backend torch to autograd; else what does (--test refuses)
    bench_cases: Callable  # (cfg, ops, device) -> --bench-ops' cases of its ops
    op_work: Callable     # (name, args, kwargs, out) -> (flops, bytes) of one of its own ops, else None


TOOLS = {"gpt2": RecipeTools(
    test_config=Config(n_layer=2, n_head=3, n_embd=24, block_size=11, vocab_size=61, padded_vocab_size=64,
                       seq_len=9, batch_size=2),
    test_cases=lambda: OP_CASES, autograd_test="", bench_cases=bench_cases,
    op_work=lambda name, args, kwargs, out: None)}


def recipe_tools(recipe):
    """TOOLS' row of `recipe`; a recipe's own row comes with its kernels file, which its triton ops load."""
    if recipe not in TOOLS:
        RECIPES[recipe].ops("triton")
    if recipe not in TOOLS:
        die(f"--recipe {recipe} has no row in triton_tools.TOOLS: no --test, --profile or --bench-ops for it")
    return TOOLS[recipe]
