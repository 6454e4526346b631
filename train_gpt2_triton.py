"""train_gpt2_triton.py: GPT-2 with a hand-derived backward, on plain torch ops or on our Triton kernels.

Every op of the model is a forward that returns what its backward needs and a backward derived by hand;
the model's backward chains them in reverse under torch.no_grad(): no autograd. BACKEND picks who
implements the ops, behind one interface: `torch` (plain torch ops, the reference) or `triton` (our
kernels; without a GPU, TRITON_INTERPRET=1 runs them in Triton's interpreter: slow, fp32 only). Data,
checkpoints and logs are trainkit's, as in the sibling trainers. Formats, flags and logs: docs/FORMATS.md.
Backend triton's kernels and the code of --test, --profile and --bench-ops live in files beside this one
(the map's end), each imported when first needed: each imports this file.

    python train_gpt2_triton.py torch --test               # every op and the whole model against autograd
    python train_gpt2_triton.py triton --test              # every kernel against backend torch
    python train_gpt2_triton.py torch --data synthetic --n-layer 2 --n-head 4 --n-embd 64 --seq-len 64 \\
        --batch-size 4 --total-batch-size 1024 --steps 20  # smoke run, any machine, no download
    python train_gpt2_triton.py triton --batch-size 16     # GPT-2 124M on data/fineweb_edu, bf16
    python train_gpt2_triton.py triton --recipe speedrun   # the speedrun baseline on our kernels
    python train_gpt2_triton.py triton --data synthetic --batch-size 16 --total-batch-size 65536 --steps 5 \\
        --profile                                          # tables of steps 2-4, per op and per kernel
    torchrun --standalone --nproc_per_node=8 train_gpt2_triton.py triton   # 8 GPUs, data parallel

Map: the file's sections, in order; the plumbing that every trainer shares (flags, llm.c's files, shards,
checkpoints and the out dir, log.jsonl, signals) is imported from trainkit/ (its __init__ lists it).
Delete `Recipe: speedrun` (and the file triton_kernels_speedrun.py) and GPT-2 trains as before.
    GPT-2: config                          Config, the Recipe row type, this trainer's own flags, parse_args
    GPT-2: ops                             the op interface, backend torch's ops (the reference)
    GPT-2: model                           the forward on the ops
    GPT-2: backward                        the lm head and the loss, the forward in reverse
    GPT-2: AdamW and the lr schedule       AdamW (llm.c's cosine schedule: trainkit.gpt2)
    GPT-2: training step                   the step, GPT-2's row of RECIPES
    Recipe: speedrun                       modded-nanogpt's baseline: its ops, model, Muon, files, its row
    Triton plumbing: devices, state and evaluation   make_state, HellaSwag, samples
    Main                                   the run, top to bottom
Beside it: triton_kernels.py (backend triton's kernels: memory-bound ops, shared helpers, matmul, flash
attention, the step's own; TRITON_OPS), triton_kernels_speedrun.py (the speedrun recipe's kernels,
TRITON_SPEEDRUN_OPS, its tools' cases), triton_tools.py (--test, --profile, --bench-ops; each recipe's tools).
"""
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

import trainkit.flags
# the one-line error
from trainkit import die
# the shared flags and what a recipe gives
from trainkit.flags import default_dtype, RunConfig, RunRecipe
# llm.c's GPT-2 without a framework: names, shapes, init, model files, schedule
from trainkit.gpt2 import (
    DECAY_NAMES, EOT, VOCAB_SIZE, configure_gpt2, cosine_lr, gpt2_shapes, init_gpt2_numpy, is_model_file,
    read_model_file, write_model_file)
# llm.c's token shards and loader
from trainkit.data import step_batches
# checkpoints and the out dir
from trainkit.checkpoints import open_run
# log.jsonl, the step and memory lines, MFU
from trainkit.logs import (
    PROFILE_STEPS, SAMPLE_COUNT, SAMPLE_TOKENS, TOP_K, due, format_mean, format_memory,
    host_memory_available, log_event, memory_warning, model_flops_per_token, peak_flops, report_step,
    start_event)
# signals and the divergence stop
from trainkit.signals import stop_diverged, stop_on_signal, stops_on_signals
# torch's processes, ZeRO-1's flat buffers, failures
from trainkit.torch_shared import (
    agree_to_stop, any_process_failed, checkpoint_if_due, evals_left_to_run, evaluate_hellaswag, evaluate_val,
    fail_on_lost_peer, fail_on_out_of_memory, flat_gradients, newton_schulz, peak_memory_gb, put_batch,
    say_samples, setup_device, sharded_state, state_bytes, state_layout, to_device)

FRAMEWORK = "triton"  # logged as f"triton-{backend}": "triton-torch" | "triton-triton"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter runs the kernels

# -----------------------------------------------------------------------------
# GPT-2: config


@dataclass
class Config(RunConfig):
    """The shared flags (RunConfig) and this trainer's own."""
    out_dir: str = f"out/gpt2_{FRAMEWORK}"
    # this trainer only: which ops implement the model, and its self-test and op benchmark
    backend: str = "torch"
    test: bool = False
    bench_ops: bool = False


@dataclass(frozen=True)
class Recipe(RunRecipe):
    """A row of RECIPES: what --recipe NAME trains (RunRecipe's fields, then this trainer's). The rest of
    the file looks a recipe up here, never by its name; each recipe's section ends by adding its row."""
    # the Triton trainer's own
    ops: Callable         # backend name -> its op namespace: OP_NAMES' ops and the recipe's own
    forward: Callable     # (w, idx, cfg, ops, acts=None) -> the head's input (B*T, C), acts what backward needs
    backward: Callable    # (dh, idx, w, grads, acts, cfg, ops): the forward in reverse, adding into grads
    head: tuple           # (weight, bias or None): the lm head's tensors
    loss: Callable        # (ops, logits, targets, cfg, dloss) -> token losses (N,) fp32, logits -> dlogits
    logits: Callable      # the head's output z -> the logits that evaluation and sampling see
    summed: bool          # the step's gradient is of the summed token losses (else of their mean)
    update: Callable      # (state, step, cfg, ops): the optimizer's step on this process's shard, in place


ZERO_STAGES = (0, 1)


def framework_flags(p):
    """The flags of this trainer alone; parse_args adds the shared ones."""
    p.add_argument("backend", choices=["torch", "triton"],
                   help="who implements the ops: plain torch ops (the reference), or our Triton kernels")
    p.add_argument("--test", action="store_true", help="check every op and the whole model (backend torch "
                   "against autograd, backend triton against backend torch), then exit")
    p.add_argument("--bench-ops", action="store_true",
                   help="time every op against the PyTorch op it replaces at the model's shapes, then exit")


def parse_args(argv=None):
    """(cfg, explicit): trainkit.flags.parse_args over this trainer's Config, RECIPES and flags."""
    return trainkit.flags.parse_args(argv, Config, RECIPES, ZERO_STAGES, __doc__, framework_flags)


def param_shapes(cfg):
    """{name: shape} of the recipe's weights, in the order of its model files."""
    return RECIPES[cfg.recipe].shapes(cfg)


# -----------------------------------------------------------------------------
# GPT-2: ops
#
# A training step computes only the ops of OP_NAMES (the step's small ones too: backend triton's step runs no
# torch compute op): backend torch's here, triton's in triton_kernels.py. Each forward returns what its backward
# needs; N = B*T rows. Weight gradients are fp32 buffers that backwards add into (+=): micro-batches accumulate,
# the tied wte gets both uses. Statistics, softmax and losses are fp32 (fp64 in an fp64 --test).

OP_NAMES = ("encoder_forward", "encoder_backward", "layernorm_forward", "residual_layernorm_forward",
            "layernorm_backward", "matmul_forward", "matmul_gelu_forward", "matmul_backward", "gelu_forward",
            "gelu_backward", "attention_forward", "attention_backward", "crossentropy_forward_backward",
            "global_norm", "adamw_update", "zero_fill", "clip_by_norm", "sum_into", "copy_into")
LN_EPS = 1e-5
GELU_C = math.sqrt(2.0 / math.pi)
ATTN_BLOCK = 128  # query rows per step of the attention: bounds its (B, H, rows, T) fp32 scores
CE_BLOCK = 1024   # rows per step of the cross-entropy: bounds its fp32 copies of the logits
HEAD_ROWS = 4096  # rows per lm-head chunk: only (HEAD_ROWS, Vp) logits ever exist


def _acc(dtype):
    """The dtype of statistics and accumulations for compute dtype `dtype`: fp32, or fp64 for fp64."""
    # a plain comparison: torch.promote_types would be a dispatched op inside the training step
    return torch.float64 if dtype == torch.float64 else torch.float32


def torch_encoder_forward(idx, wte, wpe):
    """x[b, t] = wte[idx[b, t]] + wpe[t]."""
    return wte[idx] + wpe[:idx.shape[1]]  # (B, T, C)


def torch_encoder_backward(dx, idx, dwte, dwpe):
    """wte's gradient as torch_embedding_backward adds it; wpe's is dx summed over the batch."""
    torch_embedding_backward(dx, idx, dwte)
    dwpe[:dx.shape[1]] += dx.sum(0, dtype=dwpe.dtype)  # (T, C)


def torch_embedding_backward(dx, idx, dtable):
    """dtable[token] += the sum of dx's rows of that token, deterministically."""
    # not index_add_ of all N rows (a GPU's atomic adds reorder a repeated token's sum every run): each
    # token's sorted rows are summed as a difference of fp64 prefix sums, and each table row added to once
    B, T, C = dx.shape
    tokens, order = idx.reshape(-1).sort(stable=True)  # (N,) each
    last = torch.ones_like(tokens, dtype=torch.bool)  # (N,) the last row of each token's run
    last[:-1] = tokens[1:] != tokens[:-1]
    ends = dx.reshape(B * T, C)[order].double().cumsum(0)[last]  # (U, C) prefix sums at the runs' ends
    sums = torch.diff(ends, dim=0, prepend=torch.zeros_like(ends[:1]))  # (U, C) one sum per token
    dtable.index_add_(0, tokens[last], sums.to(dtable.dtype))  # (Vp, C) += U distinct rows


def torch_layernorm_forward(x, w, b):
    """y = (x - mean) * rstd * w + b over the channels; returns (y, mean, rstd), the statistics in fp32."""
    xf = x.to(_acc(x.dtype))  # (N, C)
    mean = xf.mean(-1)  # (N,)
    xc = xf - mean[:, None]  # (N, C)
    rstd = torch.rsqrt((xc * xc).mean(-1) + LN_EPS)  # (N,)
    y = xc * rstd[:, None] * w.to(xf.dtype) + b.to(xf.dtype)  # (N, C)
    return y.to(x.dtype), mean, rstd


def torch_residual_layernorm_forward(res, h, w, b):
    """x = res + h (the residual stream, kept in the compute dtype as llm.c does), then LayerNorm of x."""
    x = res + h  # (N, C)
    y, mean, rstd = torch_layernorm_forward(x, w, b)  # (N, C), (N,), (N,)
    return x, y, mean, rstd


def torch_layernorm_backward(dy, x, w, mean, rstd, dw, db, dres=None):
    """dx = rstd (g - mean(g) - xhat mean(g xhat)) + dres with g = dy w; dw += sum dy xhat, db += sum dy."""
    acc = mean.dtype
    dyf = dy.to(acc)  # (N, C)
    xhat = (x.to(acc) - mean[:, None]) * rstd[:, None]  # (N, C)
    dw += (dyf * xhat).sum(0).to(dw.dtype)  # (C,)
    db += dyf.sum(0).to(db.dtype)  # (C,)
    g = dyf * w.to(acc)  # (N, C)
    dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))  # (N, C)
    if dres is not None:
        dx += dres.to(acc)
    return dx.to(x.dtype)


def torch_matmul_forward(x, w, b):
    """y = x w^T + b, w in Linear layout (out, in)."""
    if b is None:
        return x @ w.t()  # (N, M)
    return torch.addmm(b, x, w.t())  # (N, M)


def torch_gelu_forward(pre):
    """tanh-GELU: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), in fp32."""
    x = pre.to(_acc(pre.dtype))  # (N, M)
    return (0.5 * x * (1.0 + torch.tanh(GELU_C * (x + 0.044715 * x * x * x)))).to(pre.dtype)  # (N, M)


def torch_matmul_gelu_forward(x, w, b):
    """(gelu(pre), pre) with pre = x w^T + b: the MLP's first layer; pre is what both backwards need."""
    pre = torch.addmm(b, x, w.t())  # (N, M)
    return torch_gelu_forward(pre), pre


def torch_matmul_backward(dy, x, w, dw, db):
    """y = x w^T + b  =>  dx = dy w, dw += dy^T x, db += dy summed over the rows."""
    if dw.dtype == dy.dtype:  # added in the product: no (M, K) temporary, whose pages the CPU faults in
        dw.addmm_(dy.t(), x)  # (M, K)
    else:
        dw += (dy.t() @ x).to(dw.dtype)  # (M, K)
    if db is not None:
        db += dy.sum(0, dtype=db.dtype)  # (M,)
    return dy @ w  # (N, K)


def torch_gelu_backward(dy, pre):
    """gelu'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) du/dx, du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)."""
    x = pre.to(_acc(pre.dtype))  # (N, M)
    t = torch.tanh(GELU_C * (x + 0.044715 * x * x * x))  # (N, M)
    dgelu = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * x * x)  # (N, M)
    return (dy.to(x.dtype) * dgelu).to(pre.dtype)  # (N, M)


def _heads(qkv, n_head):
    """q, k, v as (B, H, T, D) views of the fused (B, T, 3C) projection (head h: columns h*D.. of each third)."""
    B, T, C3 = qkv.shape
    return qkv.view(B, T, 3, n_head, C3 // (3 * n_head)).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, D)


def _causal_scores(q, k, i0, scale):
    """fp32 scores scale q k^T (B, H, n, i0+n) of query rows i0.. against keys 0..i0+n-1, -inf after the query."""
    n = q.shape[2]
    i1 = i0 + n
    s = (q @ k[:, :, :i1].transpose(-1, -2)).to(_acc(q.dtype)) * scale  # (B, H, n, i1)
    rows = torch.arange(i0, i1, device=q.device)  # (n,)
    later = torch.arange(i1, device=q.device)[None, :] > rows[:, None]  # (n, i1)
    return s.masked_fill_(later, float("-inf"))


def _attention_forward(q, k, v, scale):
    """Causal softmax(scale q k^T) v of q, k, v (B, H, T, D), ATTN_BLOCK query rows at a time: (out, lse)."""
    B, H, T, D = q.shape
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)  # (B, T, H, D)
    lse = torch.empty(B, H, T, dtype=_acc(q.dtype), device=q.device)  # (B, H, T)
    for i0 in range(0, T, ATTN_BLOCK):
        i1 = min(i0 + ATTN_BLOCK, T)
        s = _causal_scores(q[:, :, i0:i1], k, i0, scale)  # (B, H, n, i1)
        lse[:, :, i0:i1] = torch.logsumexp(s, -1)  # (B, H, n)
        p = torch.exp(s - lse[:, :, i0:i1, None])  # (B, H, n, i1)
        out[:, i0:i1] = (p.to(q.dtype) @ v[:, :, :i1]).transpose(1, 2)  # (B, n, H, D)
    return out, lse


def _attention_backward(do, q, k, v, out, lse, scale, dq, dk_out, dv_out):
    """_attention_forward's gradients into dq, dk_out, dv_out (B, T, H, D), P recomputed per block from lse."""
    # dv = P^T do, dS = P (do v^T - rowsum(do out)), dq = scale dS k, dk = scale dS^T q
    B, H, T, D = q.shape
    acc = lse.dtype
    delta = (do.to(acc) * out.to(acc)).sum(-1)  # (B, H, T)
    dk = torch.zeros(B, H, T, D, dtype=acc, device=q.device)  # (B, H, T, D)
    dv = torch.zeros(B, H, T, D, dtype=acc, device=q.device)  # (B, H, T, D)
    for i0 in range(0, T, ATTN_BLOCK):
        i1 = min(i0 + ATTN_BLOCK, T)
        p = torch.exp(_causal_scores(q[:, :, i0:i1], k, i0, scale) - lse[:, :, i0:i1, None])  # (B, H, n, i1)
        do_blk = do[:, :, i0:i1]  # (B, H, n, D)
        dv[:, :, :i1] += (p.to(q.dtype).transpose(-1, -2) @ do_blk).to(acc)  # (B, H, i1, D)
        dp = (do_blk @ v[:, :, :i1].transpose(-1, -2)).to(acc)  # (B, H, n, i1)
        ds = (p * (dp - delta[:, :, i0:i1, None]) * scale).to(q.dtype)  # (B, H, n, i1)
        dq[:, i0:i1] = (ds @ k[:, :, :i1]).transpose(1, 2)  # (B, n, H, D)
        dk[:, :, :i1] += (ds.transpose(-1, -2) @ q[:, :, i0:i1]).to(acc)  # (B, H, i1, D)
    dk_out.copy_(dk.transpose(1, 2))  # (B, T, H, D)
    dv_out.copy_(dv.transpose(1, 2))  # (B, T, H, D)


def torch_attention_forward(qkv, n_head):
    """Causal softmax(q k^T / sqrt(D)) v per head of qkv (B, T, 3C): (out (B, T, C), lse (B, H, T))."""
    B, T, C3 = qkv.shape
    q, k, v = _heads(qkv, n_head)  # (B, H, T, D) each
    out, lse = _attention_forward(q, k, v, 1.0 / math.sqrt(q.shape[-1]))  # (B, T, H, D), (B, H, T)
    return out.view(B, T, C3 // 3), lse


def torch_attention_backward(dout, qkv, out, lse, n_head):
    """_attention_backward with scale 1/sqrt(D), the gradients written into the thirds of dqkv (B, T, 3C)."""
    B, T, C = dout.shape
    D = C // n_head
    dqkv = torch.empty_like(qkv)  # (B, T, 3C)
    dq, dk, dv = dqkv.view(B, T, 3, n_head, D).unbind(2)  # (B, T, H, D) views each
    _attention_backward(dout.view(B, T, n_head, D).transpose(1, 2), *_heads(qkv, n_head),
                        out.view(B, T, n_head, D).transpose(1, 2), lse, 1.0 / math.sqrt(D), dq, dk, dv)
    return dqkv


def torch_crossentropy_forward_backward(logits, targets, V, dloss):
    """Losses (N,) fp32 over the first V columns; logits become dloss * (softmax - onehot), 0 in the padding."""
    N = logits.shape[0]
    losses = torch.empty(N, dtype=_acc(logits.dtype), device=logits.device)  # (N,)
    for r0 in range(0, N, CE_BLOCK):
        r1 = min(r0 + CE_BLOCK, N)
        z = logits[r0:r1, :V].to(losses.dtype)  # (n, V)
        t = targets[r0:r1, None]  # (n, 1)
        lse = torch.logsumexp(z, -1, keepdim=True)  # (n, 1)
        losses[r0:r1] = (lse - z.gather(1, t))[:, 0]  # (n,)
        dz = (z - lse).exp_()  # (n, V) softmax (in place: one fp32 temporary, not three)
        dz.scatter_add_(1, t, torch.full_like(dz[:, :1], -1.0))  # (n, V) minus the one-hot target
        logits[r0:r1, :V] = dz.mul_(dloss)  # (n, V)
        logits[r0:r1, V:] = 0
    return losses


def torch_copy_into(dst, src):
    """dst = src (as many elements, both contiguous)."""
    dst.view(-1).copy_(src.view(-1))  # (n,)


def torch_global_norm(grads):
    """L2 norm over all gradient tensors (0-d fp32)."""
    # not torch.linalg.vector_norm: on the CPU it sums fp32 sequentially (1.7e-4 off for wte), sum() pairwise
    return torch.stack([g.square().sum() for g in grads]).sum().sqrt()  # ()


def torch_zero_fill(x):
    x.zero_()


def torch_clip_by_norm(g, norm, max_norm):
    """g *= min(1, max_norm / (norm + 1e-6)) on the device, as clip_grad_norm_ (a NaN norm makes g NaN)."""
    g.mul_((max_norm / (norm + 1e-6)).clamp_(max=1.0))  # all gradients, flat


def torch_sum_into(acc, x, scale):
    """acc += scale * sum(x)."""
    acc += x.sum() * scale


def torch_adamw_update(params, grads, ms, vs, copies, lr, beta1, beta2, eps, weight_decays, step, grad_scale):
    """llm.c's AdamW in place on lists of fp32 tensors (g scaled by grad_scale); refreshes copies (None: fp32)."""
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    for i, (p, g, m, v, wd) in enumerate(zip(params, grads, ms, vs, weight_decays)):
        if grad_scale != 1.0:
            g = g * grad_scale  # same shape as p
        # in place but for the denominator: on the CPU a new tensor's page faults outlast the pass over it
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = torch.div(v, bc2).sqrt_().add_(eps)  # sqrt(vhat) + eps, like p
        if wd:
            p.mul_(1 - lr * wd)  # p - lr wd p, before the Adam step
        p.addcdiv_(m, denom, value=-lr / bc1)  # p -= lr mhat / (sqrt(vhat) + eps)
        if copies is not None:
            copies[i].copy_(p)


def op_table(backend, ops, names=OP_NAMES):
    """A backend's op namespace from {op name: function}, which must fill in `names` exactly."""
    missing, unknown = sorted(set(names) - set(ops)), sorted(set(ops) - set(names))
    if missing or unknown:
        raise TypeError(f"backend {backend}: ops missing {missing}, ops not in the interface {unknown}")
    return SimpleNamespace(**ops)


TORCH_OPS = op_table("torch", {name: globals()[f"torch_{name}"] for name in OP_NAMES})  # op X is torch_X


def gpt2_ops(backend):
    """GPT-2's op namespace of `backend`: TORCH_OPS, or TRITON_OPS (imported here: it imports this file)."""
    if backend == "torch":
        return TORCH_OPS
    import triton_kernels
    return triton_kernels.TRITON_OPS


def backend_ops(name, recipe=Config.recipe):
    """The op namespace of backend `name` for `recipe` (its Recipe.ops)."""
    if name == "triton" and not INTERPRET and not torch.cuda.is_available():
        die("backend triton needs a CUDA GPU; without one, run its kernels in Triton's CPU interpreter with "
            "TRITON_INTERPRET=1 (slow, fp32 only)")
    return RECIPES[recipe].ops(name)


# -----------------------------------------------------------------------------
# GPT-2: model

def compute_dtype(cfg):
    return torch.bfloat16 if cfg.dtype == "bf16" else torch.float32


# What the forward keeps for the backward, and a d12 step's memory: docs/FORMATS.md, Activation memory.

def kept_for_backward(saved, cfg):
    """What a block keeps of its forward's `saved` for its backward: all, or res and lse at --recompute block."""
    # lse is H fp32 per token beside res's C: kept, and read rather than the rerun's equal copy
    return {k: saved[k] for k in ("res", "lse")} if cfg.recompute == "block" else saved


def gpt2_block_forward(w, l, res, h, shape, cfg, ops):
    """Layer l from res (N, C) and ln_1's output h to its MLP's activation: ({what backward reads}, gelu(fch))."""
    B, T = shape
    C = cfg.n_embd
    qkv = ops.matmul_forward(h, w["c_attn.w"][l], w["c_attn.b"][l])  # (N, 3C)
    atty, lse = ops.attention_forward(qkv.view(B, T, 3 * C), cfg.n_head)  # (B, T, C), (B, H, T) fp32
    h = ops.matmul_forward(atty.view(B * T, C), w["attn.c_proj.w"][l], w["attn.c_proj.b"][l])  # (N, C)
    res2, h, _, _ = ops.residual_layernorm_forward(res, h, w["ln_2.w"][l], w["ln_2.b"][l])  # (N, C) x2
    h, fch = ops.matmul_gelu_forward(h, w["c_fc.w"][l], w["c_fc.b"][l])  # (N, 4C) x2
    return dict(res=res, qkv=qkv, atty=atty, lse=lse, res2=res2, fch=fch), h


def gpt2_block_rerun(w, l, kept, shape, cfg, ops):
    """--recompute block: gpt2_block_forward's dict again from what layer l kept, bit for bit (the same ops)."""
    h, _, _ = ops.layernorm_forward(kept["res"], w["ln_1.w"][l], w["ln_1.b"][l])  # (N, C)
    saved, _ = gpt2_block_forward(w, l, kept["res"], h, shape, cfg, ops)  # {name: tensor}
    return {**saved, "lse": kept["lse"]}


def gpt2_forward(w, idx, cfg, ops, acts=None):
    """ln_f's output (B*T, C) for token ids idx (B, T); appends what the backward needs to a list `acts`."""
    B, T = idx.shape
    C, L = cfg.n_embd, cfg.n_layer
    res = ops.encoder_forward(idx, w["wte"], w["wpe"]).view(B * T, C)  # (N, C) residual stream
    h, _, _ = ops.layernorm_forward(res, w["ln_1.w"][0], w["ln_1.b"][0])  # (N, C)
    for l in range(L):
        saved, h = gpt2_block_forward(w, l, res, h, (B, T), cfg, ops)  # {name: tensor}, (N, 4C)
        h = ops.matmul_forward(h, w["mlp.c_proj.w"][l], w["mlp.c_proj.b"][l])  # (N, C)
        # the residual add closing this layer is fused with the LayerNorm opening the next (or ln_f)
        ln_w, ln_b = (w["ln_1.w"][l + 1], w["ln_1.b"][l + 1]) if l + 1 < L else (w["ln_f.w"], w["ln_f.b"])
        res, h, mean, rstd = ops.residual_layernorm_forward(saved["res2"], h, ln_w, ln_b)  # (N, C) x2, (N,) x2
        if acts is not None:
            acts.append(kept_for_backward(saved, cfg))
        del saved  # at --recompute block all but res and lse, freed before the next layer allocates its own
    if acts is not None:
        acts.append(dict(res=res, mean=mean, rstd=rstd))
    return h  # (N, C) ln_f's output


def head_logits(h, w, cfg, ops):
    """z = h W^T (+ b) (N, Vp) of the recipe's lm head (Recipe.head)."""
    weight, bias = RECIPES[cfg.recipe].head
    return ops.matmul_forward(h, w[weight], w[bias] if bias else None)


@torch.no_grad()
def forward(params, idx, cfg):
    """The logits (B, T, Vp) (Recipe.logits of the head's output) for token ids idx (B, T)."""
    B, T = idx.shape
    recipe, ops = RECIPES[cfg.recipe], backend_ops(cfg.backend, cfg.recipe)
    h = recipe.forward(params, idx, cfg, ops)  # (N, C)
    return recipe.logits(head_logits(h, params, cfg, ops)).view(B, T, -1)  # (B, T, Vp)


@torch.no_grad()
def token_losses(params, x, y, cfg):
    """Per-token losses (B, T) in fp32 (Recipe.loss), HEAD_ROWS rows of logits at a time."""
    ops = backend_ops(cfg.backend, cfg.recipe)
    h = RECIPES[cfg.recipe].forward(params, x, cfg, ops)  # (N, C)
    losses, _ = head_forward_backward(h, y.reshape(-1), params, None, cfg, ops, 0.0)  # (N,)
    return losses.view(x.shape)  # (B, T)


# -----------------------------------------------------------------------------
# GPT-2: backward

def gpt2_loss(ops, logits, targets, cfg, dloss):
    """GPT-2's token losses (n,) fp32 over the first V columns; the logits become dloss times their gradient."""
    return ops.crossentropy_forward_backward(logits, targets, cfg.vocab_size, dloss)


def head_forward_backward(h, targets, w, grads, cfg, ops, dloss, rows=HEAD_ROWS):
    """The lm head and the loss, forward and backward, `rows` rows at a time: (losses (N,) fp32, dh (N, C))."""
    # grads None: evaluation, the losses alone; --fp8-head's FP8 matmuls are training's only
    N = h.shape[0]
    recipe = RECIPES[cfg.recipe]
    weight, bias = recipe.head
    losses = torch.empty(N, dtype=_acc(h.dtype), device=h.device)  # (N,)
    dh = torch.empty_like(h) if grads is not None else None  # (N, C)
    head, forward, backward, inputs = w[weight], ops.matmul_forward, ops.matmul_backward, lambda hc: hc
    if cfg.fp8_head and grads is not None:
        head = ops.fp8_quantize(head, "w")  # (Vp, C) e4m3fn, once a micro-batch
        forward, backward = ops.fp8_matmul_forward, ops.fp8_matmul_backward
        inputs = lambda hc: ops.fp8_quantize(hc, "x")  # noqa: E731  (n, C) e4m3fn, what the backward reads
    for r0 in range(0, N, rows):
        hc, t = inputs(h[r0:r0 + rows]), targets[r0:r0 + rows]  # (n, C), (n,)
        logits = forward(hc, head, w[bias] if bias else None)  # (n, Vp)
        ops.copy_into(losses[r0:r0 + rows], recipe.loss(ops, logits, t, cfg, dloss))  # (n,)
        if grads is not None:
            dbias = grads[bias] if bias else None
            ops.copy_into(dh[r0:r0 + rows], backward(logits, hc, head, grads[weight], dbias))  # (n, C)
        del logits  # freed before the next chunk allocates its own
    return losses, dh


def gpt2_backward(dh, idx, w, grads, acts, cfg, ops):
    """gpt2_forward in reverse from dh (N, C), popping each layer's `acts` (freed as it goes) into grads."""
    B, T = idx.shape
    C, H = cfg.n_embd, cfg.n_head
    g = grads
    a = acts.pop()
    dres = ops.layernorm_backward(dh, a["res"], w["ln_f.w"], a["mean"], a["rstd"], g["ln_f.w"],
                                  g["ln_f.b"])  # (N, C) gradient of the residual stream
    for l in reversed(range(cfg.n_layer)):
        a = acts.pop()
        if cfg.recompute == "block":
            a = gpt2_block_rerun(w, l, a, (B, T), cfg, ops)
        # MLP: res3 = res2 + c_proj(gelu(c_fc(ln_2(res2))))
        ln, mean, rstd = ops.layernorm_forward(a["res2"], w["ln_2.w"][l], w["ln_2.b"][l])  # (N, C)
        dgelu = ops.matmul_backward(dres, ops.gelu_forward(a["fch"]), w["mlp.c_proj.w"][l],
                                    g["mlp.c_proj.w"][l], g["mlp.c_proj.b"][l])  # (N, 4C)
        dfch = ops.gelu_backward(dgelu, a["fch"])  # (N, 4C)
        dln = ops.matmul_backward(dfch, ln, w["c_fc.w"][l], g["c_fc.w"][l], g["c_fc.b"][l])  # (N, C)
        dres = ops.layernorm_backward(dln, a["res2"], w["ln_2.w"][l], mean, rstd, g["ln_2.w"][l],
                                      g["ln_2.b"][l], dres=dres)  # (N, C) reaches res2 both ways
        # attention: res2 = res + c_proj(attention(c_attn(ln_1(res))))
        datty = ops.matmul_backward(dres, a["atty"].view(B * T, C), w["attn.c_proj.w"][l],
                                    g["attn.c_proj.w"][l], g["attn.c_proj.b"][l])  # (N, C)
        dqkv = ops.attention_backward(datty.view(B, T, C), a["qkv"].view(B, T, 3 * C), a["atty"],
                                      a["lse"], H)  # (B, T, 3C)
        ln, mean, rstd = ops.layernorm_forward(a["res"], w["ln_1.w"][l], w["ln_1.b"][l])  # (N, C)
        dln = ops.matmul_backward(dqkv.view(B * T, 3 * C), ln, w["c_attn.w"][l], g["c_attn.w"][l],
                                  g["c_attn.b"][l])  # (N, C)
        dres = ops.layernorm_backward(dln, a["res"], w["ln_1.w"][l], mean, rstd, g["ln_1.w"][l],
                                      g["ln_1.b"][l], dres=dres)  # (N, C)
        # the layer's saved tensors and its gradients (14 C per token), freed before the next layer's rerun
        del a, ln, mean, rstd, dgelu, dfch, dln, datty, dqkv
    ops.encoder_backward(dres.view(B, T, C), idx, g["wte"], g["wpe"])


def forward_backward(w, grads, x, y, cfg, ops, dloss, head_rows=HEAD_ROWS):
    """Adds the gradient of dloss * (summed token losses) of x, y (B, T) into grads; returns the losses (N,)."""
    recipe = RECIPES[cfg.recipe]
    acts = []
    h = recipe.forward(w, x, cfg, ops, acts)  # (N, C)
    losses, dh = head_forward_backward(h, y.reshape(-1), w, grads, cfg, ops, dloss, head_rows)  # (N,), (N, C)
    del h
    recipe.backward(dh, x, w, grads, acts, cfg, ops)
    return losses


# -----------------------------------------------------------------------------
# GPT-2: AdamW and the lr schedule

BETA1, BETA2, EPS = 0.9, 0.95, 1e-8


def gpt2_update(state, step, cfg, ops):
    """llm.c's AdamW of step `step` (1-based) on this process's shard, weight decay on DECAY_NAMES only."""
    names = list(state["shard_grads"])
    copies = [state["shard_copies"][k] for k in names] if state["shard_copies"] else None
    ops.adamw_update([state["shard_params"][k] for k in names], [state["shard_grads"][k] for k in names],
                     [state["m"][k] for k in names], [state["v"][k] for k in names], copies,
                     cosine_lr(step - 1, cfg), BETA1, BETA2, EPS,
                     [cfg.weight_decay if k in DECAY_NAMES else 0.0 for k in names], step, 1.0)


# -----------------------------------------------------------------------------
# GPT-2: training step

@torch.no_grad()
def train_step(state, xs, ys, step, cfg, ops, world):
    """Optimizer step `step` (1-based) on micro-batches xs, ys (A, B, T): (loss, grad norm before clipping)."""
    # all but the collectives runs through `ops`: the host waits once, at the end, for the loss and norm
    w, grads, flat = state["weights"], state["grads"], state["grad_buffer"]
    ops.zero_fill(flat)
    share = 1.0 / (xs[0].numel() * len(xs) * world)  # each token's share of the mean loss
    # a recipe whose optimizers take the gradient of the summed loss (Recipe.summed: the speedrun's, so that
    # Adam's eps and Newton-Schulz's 1e-7 act at its scale, as the reference's do) gets it unscaled
    recipe = RECIPES[cfg.recipe]
    dloss = 1.0 if recipe.summed else share
    loss = torch.empty((), dtype=torch.float32, device=xs.device)  # () the mean token loss
    ops.zero_fill(loss)
    for x, y in zip(xs, ys):
        ops.sum_into(loss, forward_backward(w, grads, x, y, cfg, ops, dloss), share)
    # ZeRO-1 over processes: reduce-scatter per group (compute_groups), update the shard, all-gather the
    # weights; stage 0: one all-reduce, and a process's shard is the whole model
    sharded = cfg.zero_stage == 1 and world > 1
    if world > 1:
        dist.all_reduce(loss)
    if sharded:
        for group in state["groups"]:
            dist.reduce_scatter_single(group["grads"], flat[slice(*group["span"])])
    elif world > 1:
        dist.all_reduce(flat)  # one collective for all the gradients
    norm = ops.global_norm(list(state["shard_grads"].values()))  # ()
    if sharded:
        squares = norm.double().square()  # ()
        dist.all_reduce(squares)
        norm = squares.sqrt().float()  # ()
    if cfg.grad_clip > 0:
        for group in state["groups"]:
            ops.clip_by_norm(group["grads"], norm, cfg.grad_clip)
    recipe.update(state, step, cfg, ops)
    if sharded:
        for group in state["groups"]:
            dist.all_gather_single(group["weights"], group["own_weights"])
    return loss.item(), norm.item()  # the step's one wait for the device


def gpt2_activation_bytes(cfg):
    """Peak bytes of one micro-batch's saved tensors: at the forward's end, or (block) at the first rerun."""
    C, H, L, x = cfg.n_embd, cfg.n_head, cfg.n_layer, compute_dtype(cfg).itemsize
    kept = (C * x    # res (N, C): the layer's input
            + 4 * H)  # lse (B, H, T) fp32: the attention's row logsumexp
    rest = (3 * C * x  # qkv (N, 3C): the attention's input projection
            + C * x    # atty (N, C): the attention's output
            + C * x    # res2 (N, C): the residual stream after the attention
            + 4 * C * x)  # fch (N, 4C): the MLP's pre-activation
    if cfg.recompute == "block":
        per_token = L * kept + rest  # every layer's res and lse, one layer's rest
    else:
        per_token = (L * (kept + rest)
                     + C * x + 8)  # the final residual (N, C), ln_f's mean and rstd (N,) fp32
    return cfg.batch_size * cfg.seq_len * per_token


RECIPES = {"gpt2": Recipe(
    help="llm.c's GPT-2 and AdamW", defaults={}, configure=configure_gpt2,
    shapes=gpt2_shapes, init=init_gpt2_numpy, lr_at=cosine_lr, muon_names=lambda shapes: [],
    model_file="model.bin", file_kind="an llm.c model file (.bin)", is_file=is_model_file,
    read_file=read_model_file, write_file=write_model_file, model_name="GPT-2", table="wpe",
    optimizers="AdamW", activation_bytes=gpt2_activation_bytes,
    ops=gpt2_ops, forward=gpt2_forward, backward=gpt2_backward, head=("wte", None), loss=gpt2_loss,
    logits=lambda z: z, summed=False, update=gpt2_update)}


# -----------------------------------------------------------------------------
# Recipe: speedrun

# the speedrun recipe without a framework: its config, shapes, init, lrs and model files
from trainkit.speedrun import (
    ATTN_SCALE, FP8_SCALES, HEAD_DIM, MUON_MOMENTUM, MUON_WEIGHT_DECAY, SOFTCAP, SPEEDRUN_BETA1,
    SPEEDRUN_BETA2, SPEEDRUN_DEFAULTS, SPEEDRUN_EPS, SPEEDRUN_HELP, adamw_group, configure_speedrun,
    init_speedrun_numpy, is_safetensors_file, muon_names, read_speedrun_file, speedrun_lr, speedrun_lrs,
    speedrun_shapes, write_speedrun_file)
# --fp8-head's casts and FP8 products in torch
from trainkit.torch_shared import fp8_matmul, fp8_quantize

# -- config



# -- ops

# The speedrun recipe's own ops, beside GPT-2's that it shares (matmul, the optimizer's and the step's)
SPEEDRUN_OP_NAMES = ("embedding_forward", "embedding_backward", "rmsnorm_forward", "residual_rmsnorm_forward",
                     "rmsnorm_backward", "qk_norm_rotary_forward", "qk_norm_rotary_backward",
                     "scaled_attention_forward", "scaled_attention_backward", "matmul_relu2_forward",
                     "relu2_forward", "relu2_backward", "softcap_crossentropy_forward_backward",
                     "muon_update", "add_into", "fp8_quantize", "fp8_matmul_forward", "fp8_matmul_backward")


def torch_embedding_forward(idx, table):
    """x[b, t] = table[idx[b, t]] (the speedrun model's embedding: no positions)."""
    return table[idx]  # (B, T, C)


def torch_rmsnorm_forward(x, w, eps):
    """(y = x rstd w (w None: no gain), rstd = 1 / sqrt(mean(x^2) + eps) (...,) fp32) over the last dim."""
    xf = x.to(_acc(x.dtype))  # (..., C)
    rstd = torch.rsqrt((xf * xf).mean(-1) + eps)  # (...,)
    y = xf * rstd[..., None]  # (..., C)
    return (y if w is None else y * w.to(xf.dtype)).to(x.dtype), rstd


def torch_residual_rmsnorm_forward(res, h, w, eps):
    """x = res + h (the residual stream, in the compute dtype), then RMSNorm of x: (x, y, rstd)."""
    x = res + h  # (N, C)
    y, rstd = torch_rmsnorm_forward(x, w, eps)  # (N, C), (N,)
    return x, y, rstd


def torch_rmsnorm_backward(dy, x, w, rstd, dw, dres=None):
    """dx = rstd (g - xhat mean(g xhat)) + dres with g = dy w (dy without gain); dw += sum dy xhat."""
    acc = rstd.dtype
    dyf = dy.to(acc)  # (..., C)
    xhat = x.to(acc) * rstd[..., None]  # (..., C)
    g = dyf
    if w is not None:
        dw += (dyf * xhat).reshape(-1, x.shape[-1]).sum(0).to(dw.dtype)  # (C,)
        g = dyf * w.to(acc)  # (..., C)
    dx = rstd[..., None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))  # (..., C)
    if dres is not None:
        dx += dres.to(acc)
    return dx.to(x.dtype)


def _rotary_cos_sin(T, D, dtype, device):
    """cos and sin (T, D/2) of t freq, freq = (1/1024)^linspace(0, 1) (fp32) over D/4 pairs, then D/4 zeros."""
    freq = (1 / 1024) ** torch.linspace(0, 1, D // 4, dtype=torch.float32, device=device)  # (D/4,)
    freq = torch.cat([freq, freq.new_zeros(D // 4)]).to(dtype)  # (D/2,)
    theta = torch.outer(torch.arange(T, dtype=dtype, device=device), freq)  # (T, D/2)
    return theta.cos(), theta.sin()  # (T, D/2) each


def torch_qk_norm_rotary_forward(x, eps):
    """q or k (B, T, H, D) RMS-normed per head without gain, then rotated: (y (B, T, H, D), rstd (B, T, H))."""
    B, T, H, D = x.shape
    xhat, rstd = torch_rmsnorm_forward(x.to(_acc(x.dtype)), None, eps)  # (B, T, H, D), (B, T, H)
    cos, sin = (t[:, None] for t in _rotary_cos_sin(T, D, xhat.dtype, x.device))  # (T, 1, D/2) each
    x1, x2 = xhat.chunk(2, dim=-1)  # (B, T, H, D/2) each
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), -1).to(x.dtype), rstd  # (B, T, H, D)


def torch_qk_norm_rotary_backward(dy, x, rstd):
    """dx of torch_qk_norm_rotary_forward: the rotation's transpose, then the RMSNorm backward without gain."""
    B, T, H, D = x.shape
    cos, sin = (t[:, None] for t in _rotary_cos_sin(T, D, rstd.dtype, x.device))  # (T, 1, D/2) each
    dy1, dy2 = dy.to(rstd.dtype).chunk(2, dim=-1)  # (B, T, H, D/2) each
    dxhat = torch.cat((dy1 * cos - dy2 * sin, dy1 * sin + dy2 * cos), -1)  # (B, T, H, D)
    return torch_rmsnorm_backward(dxhat, x, None, rstd, None)  # (B, T, H, D)


def torch_scaled_attention_forward(q, k, v, scale):
    """Causal softmax(scale q k^T) v per head of q, k, v (B, T, H, D): (out (B, T, H*D), lse (B, H, T))."""
    B, T, H, D = q.shape
    out, lse = _attention_forward(*(t.transpose(1, 2) for t in (q, k, v)), scale)  # (B, T, H, D), (B, H, T)
    return out.view(B, T, H * D), lse


def torch_scaled_attention_backward(dout, q, k, v, out, lse, scale):
    """_attention_backward of torch_scaled_attention_forward: (dq, dk, dv), (B, T, H, D) each."""
    B, T, H, D = q.shape
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))  # (B, T, H, D) each
    heads = (t.view(B, T, H, D).transpose(1, 2) for t in (dout, q, k, v, out))  # (B, H, T, D) each
    _attention_backward(*heads, lse, scale, dq, dk, dv)
    return dq, dk, dv


def torch_relu2_forward(pre):
    """relu(x)^2, the speedrun MLP's activation."""
    r = pre.relu()  # (N, M)
    return r * r  # (N, M)


def torch_matmul_relu2_forward(x, w, b):
    """(relu(pre)^2, pre) with pre = x @ w.T + b: the speedrun MLP's fc and its activation."""
    pre = torch.addmm(b, x, w.t())  # (N, M)
    return torch_relu2_forward(pre), pre


def torch_relu2_backward(dy, pre):
    """d relu(x)^2 / dx = 2 relu(x)."""
    return dy * 2 * pre.relu()  # (N, M)


def torch_softcap_crossentropy_forward_backward(z, targets, dloss):
    """Losses (N,) fp32 of c = SOFTCAP z / sqrt(z^2 + SOFTCAP^2) over all Vp columns; z becomes their gradient."""
    # dz = dloss (softmax(c) - onehot) dc/dz, dc/dz = SOFTCAP^3 / (z^2 + SOFTCAP^2)^(3/2)
    N = z.shape[0]
    losses = torch.empty(N, dtype=_acc(z.dtype), device=z.device)  # (N,)
    for r0 in range(0, N, CE_BLOCK):
        r1 = min(r0 + CE_BLOCK, N)
        zf = z[r0:r1].to(losses.dtype)  # (n, Vp)
        rs = zf.square().add_(SOFTCAP**2).rsqrt_()  # (n, Vp)
        c = torch.mul(zf, SOFTCAP).mul_(rs)  # (n, Vp)
        t = targets[r0:r1, None]  # (n, 1)
        lse = torch.logsumexp(c, -1, keepdim=True)  # (n, 1)
        losses[r0:r1] = (lse - c.gather(1, t))[:, 0]  # (n,)
        dc = c.sub_(lse).exp_()  # (n, Vp) softmax (in place: fp32 temporaries reused)
        dc.scatter_add_(1, t, torch.full_like(dc[:, :1], -1.0))  # (n, Vp) minus the one-hot target
        z[r0:r1] = dc.mul_(rs.pow_(3).mul_(dloss * SOFTCAP**3))  # (n, Vp)
    return losses


def torch_muon_update(params, grads, ms, copies, lr, momentum, weight_decay, dtype):
    """Muon in place on lists of fp32 matrices of one shape (Newton-Schulz in `dtype`); refreshes copies."""
    torch._foreach_lerp_(ms, grads, 1.0 - momentum)
    u = torch.stack(torch._foreach_lerp(grads, ms, momentum))  # (n, r, c)
    r, c = u.shape[1:]
    update = newton_schulz(u, dtype).to(u.dtype) * max(1.0, r / c) ** 0.5  # (n, r, c)
    torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_sub_(params, list((update * lr).unbind(0)))
    if copies is not None:
        torch._foreach_copy_(copies, params)


def torch_add_into(acc, x):
    """acc += x (same shape and dtype): h feeds q, k and v, so their input gradients add up."""
    acc += x


def torch_fp8_matmul_forward(x_f8, w_f8, b):
    """z = (x_f8 w_f8^T) x_s w_s + b in b's dtype, of --fp8-head's e4m3fn x_f8 (N, C) and w_f8 (V, C)."""
    z = fp8_matmul(x_f8, w_f8.t(), FP8_SCALES["x"], FP8_SCALES["w"], b.dtype, fast_accum=True)  # (N, V)
    return z.add_(b)


def torch_fp8_matmul_backward(dz, x_f8, w_f8, dw, db):
    """torch_fp8_matmul_forward's backward through dz cast to e5m2: dx; dw, db (of dz unquantized) += fp32."""
    g_f8 = fp8_quantize(dz, "grad")  # (N, V)
    dw += fp8_matmul(g_f8.t(), x_f8, FP8_SCALES["grad"], FP8_SCALES["x"], torch.float32)  # (V, C)
    db += dz.sum(0, dtype=db.dtype)  # (V,)
    return fp8_matmul(g_f8, w_f8, FP8_SCALES["grad"], FP8_SCALES["w"], dz.dtype)  # (N, C)


torch_fp8_quantize = fp8_quantize  # trainkit's casts
TORCH_SPEEDRUN_OPS = op_table("torch", {name: globals()[f"torch_{name}"] for name in SPEEDRUN_OP_NAMES},
                              SPEEDRUN_OP_NAMES)


def speedrun_ops(backend):
    """The speedrun recipe's op namespace of `backend`: GPT-2's and its own (SPEEDRUN_OP_NAMES)."""
    if backend == "torch":
        own = TORCH_SPEEDRUN_OPS
    else:
        import triton_kernels_speedrun
        own = triton_kernels_speedrun.TRITON_SPEEDRUN_OPS
    return SimpleNamespace(**vars(gpt2_ops(backend)), **vars(own))


# -- model

# The speedrun model, as tests/speedrun_reference.py computes it; what it keeps: as GPT-2's (docs/FORMATS.md)

def speedrun_block_forward(w, l, res, h, shape, cfg, ops):
    """Block l from res (N, C) and norm1's output h to its MLP's activation: ({what backward reads}, relu(pre)^2)."""
    B, T = shape
    C, H, D = cfg.n_embd, cfg.n_embd // HEAD_DIM, HEAD_DIM
    eps = torch.finfo(res.dtype).eps
    b = {k[len(f"blocks.{l}."):]: t for k, t in w.items() if k.startswith(f"blocks.{l}.")}
    q, k, v = (ops.matmul_forward(h, b[f"attn.{n}.weight"], b[f"attn.{n}.bias"]) for n in "qkv")  # (N, C) each
    qr, _ = ops.qk_norm_rotary_forward(q.view(B, T, H, D), eps)  # (B, T, H, D)
    kr, _ = ops.qk_norm_rotary_forward(k.view(B, T, H, D), eps)  # (B, T, H, D)
    y, lse = ops.scaled_attention_forward(qr, kr, v.view(B, T, H, D), ATTN_SCALE)  # (B, T, C), (B, H, T)
    del qr, kr  # freed before the MLP allocates: the backward recomputes them
    h = ops.matmul_forward(y.view(B * T, C), b["attn.proj.weight"], b["attn.proj.bias"])  # (N, C)
    res2, h, _ = ops.residual_rmsnorm_forward(res, h, b["norm2.gains"], eps)  # (N, C) x2
    h, pre = ops.matmul_relu2_forward(h, b["mlp.fc.weight"], b["mlp.fc.bias"])  # (N, 4C) x2
    return dict(res=res, q=q, k=k, v=v, y=y, lse=lse, res2=res2, pre=pre), h


def speedrun_block_rerun(w, l, kept, shape, cfg, ops):
    """--recompute block: speedrun_block_forward's dict again from what block l kept, bit for bit."""
    h, _ = ops.rmsnorm_forward(kept["res"], w[f"blocks.{l}.norm1.gains"], torch.finfo(kept["res"].dtype).eps)
    saved, _ = speedrun_block_forward(w, l, kept["res"], h, shape, cfg, ops)  # {name: tensor}
    return {**saved, "lse": kept["lse"]}


def speedrun_forward(w, idx, cfg, ops, acts=None):
    """The final norm's output (B*T, C) for token ids idx (B, T); appends what the backward needs to `acts`."""
    B, T = idx.shape
    C, L = cfg.n_embd, cfg.n_layer
    emb = ops.embedding_forward(idx, w["embed.weight"]).view(B * T, C)  # (N, C)
    eps = torch.finfo(emb.dtype).eps  # F.rms_norm's default, as the reference's
    res, rstd = ops.rmsnorm_forward(emb, w["norm1.gains"], eps)  # (N, C) residual stream, (N,)
    if acts is not None:
        acts.append(dict(emb=emb, rstd=rstd))
    h, _ = ops.rmsnorm_forward(res, w["blocks.0.norm1.gains"], eps)  # (N, C)
    for l in range(L):
        saved, h = speedrun_block_forward(w, l, res, h, (B, T), cfg, ops)  # {name: tensor}, (N, 4C)
        h = ops.matmul_forward(h, w[f"blocks.{l}.mlp.proj.weight"], w[f"blocks.{l}.mlp.proj.bias"])  # (N, C)
        # the residual add closing this block is fused with the norm opening the next (or the final one)
        gains = w[f"blocks.{l + 1}.norm1.gains"] if l + 1 < L else w["norm2.gains"]
        res, h, rstd = ops.residual_rmsnorm_forward(saved["res2"], h, gains, eps)  # (N, C) x2, (N,)
        if acts is not None:
            acts.append(kept_for_backward(saved, cfg))
        del saved  # at --recompute block all but res and lse, freed before the next block allocates its own
    if acts is not None:
        acts.append(dict(res=res, rstd=rstd))
    return h  # (N, C) the final norm's output


def speedrun_logits(z):
    """The head's soft cap, SOFTCAP z / sqrt(z^2 + SOFTCAP^2), in fp32 (evaluation and sampling)."""
    z = z.float()  # (..., V)
    return SOFTCAP * z * torch.rsqrt(z.square() + SOFTCAP**2)  # (..., V)


# -- backward

def speedrun_loss(ops, logits, targets, cfg, dloss):
    """The soft-capped token losses (n,) fp32 over all Vp columns; the logits become dloss times their gradient."""
    return ops.softcap_crossentropy_forward_backward(logits, targets, dloss)


def speedrun_backward(dh, idx, w, grads, acts, cfg, ops):
    """speedrun_forward in reverse from dh (N, C), popping each block's `acts` (freed as it goes) into grads."""
    B, T = idx.shape
    C, H, D = cfg.n_embd, cfg.n_embd // HEAD_DIM, HEAD_DIM
    a = acts.pop()
    eps = torch.finfo(a["res"].dtype).eps
    dres = ops.rmsnorm_backward(dh, a["res"], w["norm2.gains"], a["rstd"], grads["norm2.gains"])  # (N, C)
    for l in reversed(range(cfg.n_layer)):
        a = acts.pop()
        if cfg.recompute == "block":
            a = speedrun_block_rerun(w, l, a, (B, T), cfg, ops)
        b, g = ({k[len(f"blocks.{l}."):]: t for k, t in d.items() if k.startswith(f"blocks.{l}.")}
                for d in (w, grads))
        # MLP: res3 = res2 + proj(relu(fc(norm2(res2)))^2)
        h, rstd = ops.rmsnorm_forward(a["res2"], b["norm2.gains"], eps)  # (N, C), (N,)
        dr = ops.matmul_backward(dres, ops.relu2_forward(a["pre"]), b["mlp.proj.weight"],
                                 g["mlp.proj.weight"], g["mlp.proj.bias"])  # (N, 4C)
        dpre = ops.relu2_backward(dr, a["pre"])  # (N, 4C)
        dh = ops.matmul_backward(dpre, h, b["mlp.fc.weight"], g["mlp.fc.weight"], g["mlp.fc.bias"])  # (N, C)
        dres = ops.rmsnorm_backward(dh, a["res2"], b["norm2.gains"], rstd, g["norm2.gains"],
                                    dres=dres)  # (N, C) reaches res2 both ways
        # attention: res2 = res + proj(attention(rotary(norm(q)), rotary(norm(k)), v)), q k v of norm1(res)
        dy = ops.matmul_backward(dres, a["y"].view(B * T, C), b["attn.proj.weight"], g["attn.proj.weight"],
                                 g["attn.proj.bias"])  # (N, C)
        q, k = a["q"].view(B, T, H, D), a["k"].view(B, T, H, D)  # (B, T, H, D) each
        (qr, rq), (kr, rk) = (ops.qk_norm_rotary_forward(t, eps) for t in (q, k))  # (B, T, H, D), (B, T, H)
        dq, dk, dv = ops.scaled_attention_backward(dy.view(B, T, H, D), qr, kr, a["v"].view(B, T, H, D),
                                                   a["y"], a["lse"], ATTN_SCALE)  # (B, T, H, D) x3
        dq = ops.qk_norm_rotary_backward(dq, q, rq)  # (B, T, H, D)
        dk = ops.qk_norm_rotary_backward(dk, k, rk)  # (B, T, H, D)
        h, rstd = ops.rmsnorm_forward(a["res"], b["norm1.gains"], eps)  # (N, C), (N,)
        dh = ops.matmul_backward(dq.view(B * T, C), h, b["attn.q.weight"], g["attn.q.weight"],
                                 g["attn.q.bias"])  # (N, C)
        for n, d in (("k", dk), ("v", dv)):  # h feeds all three projections: their gradients add up
            ops.add_into(dh, ops.matmul_backward(d.view(B * T, C), h, b[f"attn.{n}.weight"],
                                                 g[f"attn.{n}.weight"], g[f"attn.{n}.bias"]))  # (N, C)
        dres = ops.rmsnorm_backward(dh, a["res"], b["norm1.gains"], rstd, g["norm1.gains"],
                                    dres=dres)  # (N, C)
        # the block's saved tensors and its gradients (16 C per token), freed before the next block's rerun
        del a, h, rstd, dr, dpre, dh, dy, q, k, qr, rq, kr, rk, dq, dk, dv, d
    a = acts.pop()
    demb = ops.rmsnorm_backward(dres, a["emb"], w["norm1.gains"], a["rstd"], grads["norm1.gains"])  # (N, C)
    ops.embedding_backward(demb.view(B, T, C), idx, grads["embed.weight"])


# -- optimizer

def speedrun_update(state, step, cfg, ops):
    """Step `step` (1-based) on this process's shard: AdamW per lr group on what v holds, Muon by shape on the rest."""
    # ZeRO-1 shards hold 1-D pieces of the AdamW tensors and whole Muon matrices, maybe none of a group
    lrs = speedrun_lrs(step - 1, cfg)
    p, g, m, v, copies = (state[k] for k in ("shard_params", "shard_grads", "m", "v", "shard_copies"))

    def lists(names):  # the ops' lists of the params, grads, m and compute-dtype copies (or None) of names
        return ([p[k] for k in names], [g[k] for k in names], [m[k] for k in names],
                [copies[k] for k in names] if copies else None)

    adam = [k for k in g if k in v]
    for group in ("embed", "head", "vector"):
        names = [k for k in adam if adamw_group(k) == group]
        if names:
            params, grads, ms, copied = lists(names)
            ops.adamw_update(params, grads, ms, [v[k] for k in names], copied, lrs[group], SPEEDRUN_BETA1,
                             SPEEDRUN_BETA2, SPEEDRUN_EPS, [cfg.weight_decay] * len(names), step, 1.0)
    muon = [k for k in g if k not in v]
    for shape in dict.fromkeys(p[k].shape for k in muon):
        ops.muon_update(*lists([k for k in muon if p[k].shape == shape]), lrs["muon"], MUON_MOMENTUM,
                        MUON_WEIGHT_DECAY, compute_dtype(cfg))


# -- training step

def speedrun_activation_bytes(cfg):
    """Peak bytes of one micro-batch's saved tensors: at the forward's end, or (block) at the first rerun."""
    C, H, L, x = cfg.n_embd, cfg.n_embd // HEAD_DIM, cfg.n_layer, compute_dtype(cfg).itemsize
    kept = (C * x    # res (N, C): the block's input
            + 4 * H)  # lse (B, H, T) fp32: the attention's row logsumexp
    rest = (3 * C * x  # q, k, v (N, C) each: the projections, before q's and k's norm and rotary
            + C * x    # y (N, C): the attention's output
            + C * x    # res2 (N, C): the residual stream after the attention
            + 4 * C * x)  # pre (N, 4C): the MLP's pre-activation
    embedding = C * x + 4  # emb (N, C): the embedding's rows, and its norm's rstd (N,) fp32
    if cfg.recompute == "block":
        per_token = embedding + L * kept + rest  # every block's res and lse, one block's rest
    else:
        per_token = (embedding + L * (kept + rest)
                     + C * x + 4)  # the final residual (N, C) and its norm's rstd (N,) fp32
    return cfg.batch_size * cfg.seq_len * per_token


RECIPES["speedrun"] = Recipe(
    help=SPEEDRUN_HELP,
    defaults={**SPEEDRUN_DEFAULTS, "out_dir": f"out/speedrun_{FRAMEWORK}"}, configure=configure_speedrun,
    shapes=speedrun_shapes, init=init_speedrun_numpy, lr_at=speedrun_lr, muon_names=muon_names,
    model_file="model.safetensors",
    file_kind="a safetensors file of the reference's state_dict (.safetensors)",
    is_file=is_safetensors_file, read_file=read_speedrun_file, write_file=write_speedrun_file,
    model_name="speedrun GPT", table="embed.weight", optimizers="AdamW and Muon",
    activation_bytes=speedrun_activation_bytes,
    ops=speedrun_ops, forward=speedrun_forward, backward=speedrun_backward, head=("proj.weight", "proj.bias"),
    loss=speedrun_loss, logits=speedrun_logits, summed=True, update=speedrun_update)


# -----------------------------------------------------------------------------
# Triton plumbing: devices, state and evaluation

def compute_groups(cfg):
    """[(names, dtype)] of the flat buffers' stretches, one all-gather each at stage 1: Muon's matrices last."""
    shapes = param_shapes(cfg)
    muon = RECIPES[cfg.recipe].muon_names(shapes)
    dtype = compute_dtype(cfg)
    return [([k for k in shapes if k not in muon], dtype)] + ([(muon, dtype)] if muon else [])


def make_state(params, m, v, cfg, device, rank=0, world=1):
    """The training state on the device from numpy dicts: all `grads` (views of `grad_buffer`) and `weights`,
    and its ZeRO stage's `shard_*` tensors, m and v (v of the AdamW tensors only)."""
    shapes = param_shapes(cfg)
    muon = RECIPES[cfg.recipe].muon_names(shapes)
    layout = state_layout(compute_groups(cfg), muon, shapes, world)
    state = flat_gradients(shapes, layout, device)
    if cfg.zero_stage == 0:
        return whole_state(state, params, m, v, cfg, device)
    return sharded_state(state, params, m, v, shapes, layout, muon, device, rank, world)


def whole_state(state, params, m, v, cfg, device):
    """Stage 0: a process's shard is the whole model (shard_copies: the bf16 `weights`, None in fp32)."""
    state.update({name: to_device(d, device) for name, d in (("params", params), ("m", m), ("v", v))})
    state["weights"] = ({k: t.to(torch.bfloat16) for k, t in state["params"].items()}
                        if cfg.dtype == "bf16" else state["params"])
    state.update(shard_params=state["params"], shard_grads=state["grads"],
                 shard_copies=state["weights"] if cfg.dtype == "bf16" else None,
                 groups=[{"span": (0, state["grad_buffer"].numel()), "grads": state["grad_buffer"]}])
    return state


def device_state_bytes(cfg, shapes, world):
    """Bytes of make_state's tensors in one process, by kind (state_bytes of this trainer's layout)."""
    muon = RECIPES[cfg.recipe].muon_names(shapes)
    layout = state_layout(compute_groups(cfg), muon, shapes, world)
    return state_bytes(cfg.zero_stage, shapes, layout, muon, world)


@torch.no_grad()
def generate(params, generator, cfg):
    """SAMPLE_COUNT top-TOP_K continuations of EOT (S, T) int64, every position recomputed (no KV cache)."""
    recipe, ops = RECIPES[cfg.recipe], backend_ops(cfg.backend, cfg.recipe)
    device = next(iter(params.values())).device
    T = min(cfg.block_size, SAMPLE_TOKENS + 1)
    tokens = torch.zeros((SAMPLE_COUNT, T), dtype=torch.int64, device=device)  # (S, T)
    tokens[:, 0] = EOT
    for t in range(T - 1):  # token t+1 from 0..t
        h = recipe.forward(params, tokens, cfg, ops)  # (S*T, C)
        h = h.view(SAMPLE_COUNT, T, -1)[:, t].contiguous()  # (S, C)
        logits = recipe.logits(head_logits(h, params, cfg, ops))[:, :VOCAB_SIZE].float()  # (S, V)
        top_logits, top_ids = torch.topk(logits, TOP_K, dim=-1)  # (S, K) each
        choice = torch.multinomial(torch.softmax(top_logits, dim=-1), 1, generator=generator)  # (S, 1)
        tokens[:, t + 1] = torch.gather(top_ids, -1, choice)[:, 0]
    return tokens


# -----------------------------------------------------------------------------
# Main

@stops_on_signals
def main(argv, signals):
    cfg, explicit = parse_args(argv)
    dtype = default_dtype(cfg, gpu=torch.cuda.is_available())  # the device setup_device picks
    recipe = RECIPES[cfg.recipe]
    if cfg.test or cfg.profile or cfg.bench_ops:
        import triton_tools as tools  # their code, which imports this file: loaded only when asked for
    if cfg.test:
        tools.run_self_test(cfg)
        return
    ops = backend_ops(cfg.backend, cfg.recipe)
    if cfg.backend == "triton" and INTERPRET and cfg.dtype == "bf16":
        die("backend triton under TRITON_INTERPRET=1 runs fp32 only (the interpreter's bf16 dots are wrong): "
            "add --dtype fp32, or run on a GPU")
    framework = f"{FRAMEWORK}-{cfg.backend}"
    rank, world, device, store = setup_device(cfg)
    if cfg.bench_ops:
        tools.bench_ops(cfg, ops, device)
        return
    master = signals.master = rank == 0
    say = print if master else (lambda *args, **kwargs: None)

    # weights, optimizer state, data (each process reads B rows of a micro-batch) and the locked out dir
    step, params, m, v, grad_accum, train_loader, val_loader, encoder, lock = open_run(  # noqa: F841
        cfg, explicit, RECIPES, cfg.batch_size, rank, world, master, say, any_process_failed(world, device))

    # devices: what each process holds depends on --zero-stage (make_state)
    state = make_state(params, m, v, cfg, device, rank, world)
    weights = state["weights"]  # what evaluation and sampling compute with
    # the table that only gathers rows (GPT-2's wte is also its head) counts for no flops
    n_params = sum(p.numel() for k, p in weights.items() if k != recipe.table)
    device_kind = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    say(f"{recipe.model_name} L{cfg.n_layer} H{cfg.n_head} C{cfg.n_embd}, {n_params / 1e6:.2f}M parameters "
        f"(without {recipe.table}) | {world} x {device_kind} | {dtype} | backend: {cfg.backend}")
    say(f"batch: {cfg.batch_size} x {cfg.seq_len} tokens x {world} devices x {grad_accum} micro-batches = "
        f"{cfg.total_batch_size} tokens per step | data: {cfg.data}")
    held = device_state_bytes(cfg, param_shapes(cfg), world)
    activations = recipe.activation_bytes(cfg)
    say(format_memory(cfg, held, activations, world, recipe.optimizers))
    warning = device.type == "cpu" and memory_warning(held, activations, world, host_memory_available())
    if warning:  # on a GPU, running out is an error the trainer reports (fail_on_out_of_memory)
        say(warning)
    if master:
        log_event(cfg.out_dir, framework, **start_event(cfg, step, world, held, activations))

    with fail_on_out_of_memory(cfg), fail_on_lost_peer(store, rank, world):
        def run_evals(step, val, swag):
            if val and val_loader is not None:
                val_loss = evaluate_val(token_losses, weights, val_loader, cfg, device, world)
                say(f"step {step:5d} | val loss {val_loss:.6f}")
                if master:
                    log_event(cfg.out_dir, framework, step=step, val_loss=val_loss)
            if swag and master:
                acc, acc_norm = evaluate_hellaswag(token_losses, weights, cfg, device)
                say(f"step {step:5d} | hellaswag acc {acc:.4f} acc_norm {acc_norm:.4f}")
                log_event(cfg.out_dir, framework, step=step, hellaswag_acc=acc, hellaswag_acc_norm=acc_norm)

        if cfg.eval_only:
            run_evals(step, True, cfg.hellaswag_every > 0)
            return
        if cfg.resume:  # the evaluations of its step that log.jsonl lacks (evals_left_to_run)
            run_evals(step, *evals_left_to_run(cfg, step, master, world))
        if step >= cfg.steps:
            say(f"the checkpoint is at step {step} and --steps is {cfg.steps}: nothing to train")
            return

        peak = peak_flops(device_kind, cfg.dtype) if device.type == "cuda" else None
        flops = (model_flops_per_token(cfg, n_params), peak * world if peak else None)  # per token; peak per s
        first = step + 1
        profile_steps = range(min(first + 1, cfg.steps), min(first + PROFILE_STEPS, cfg.steps) + 1)
        profile = None
        times = {}  # step -> its time; their sum is what --time-budget counts
        signals.training = True  # from here a signal stops the run at the end of a step
        for step in range(first, cfg.steps + 1):
            if cfg.profile and step == profile_steps[0]:
                profile = tools.start_profile(ops, device)
            t0 = time.perf_counter()
            x, y = step_batches(train_loader, grad_accum)  # (A, B, T) each
            xs, ys = put_batch(x, device), put_batch(y, device)
            loss, norm = train_step(state, xs, ys, step, cfg, profile["ops"] if profile else ops, world)
            times[step] = dt = time.perf_counter() - t0  # train_step waited for the device: the whole step
            if not (math.isfinite(loss) and math.isfinite(norm)):  # the same values in every process
                stop_diverged(step, loss, norm, cfg)
            # --time-budget and signals: all processes must stop at the same step
            budget_spent = bool(cfg.time_budget) and sum(times.values()) >= cfg.time_budget
            signum = signals.received
            if world > 1:
                budget_spent, signum = agree_to_stop(budget_spent, signum, rank, device)
            last = step if budget_spent or signum else cfg.steps
            if step == first:  # its peak memory holds the autotuner's copies of the buffers it tunes
                costs = "kernel compilation and autotuning" if cfg.backend == "triton" else "start-up"
                say(f"step {first} holds one-off costs ({costs}): the final mean leaves it out, and peak memory "
                    "counts from the next step")
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
            if profile and step == profile_steps[-1]:
                tools.finish_profile(profile, profile_steps, [1000 * times[s] for s in profile_steps], weights,
                                     xs[0], cfg, ops, device, rank, master)
                profile = None
            report_step(step, cfg, loss, norm, recipe.lr_at(step - 1, cfg), dt, peak_memory_gb(device), flops,
                        framework, master, say)
            # the checkpoint before a signal's stop and the evaluations (--resume runs those log.jsonl lacks)
            checkpoint_if_due(state, step, last, train_loader, cfg, recipe, world, master, say)
            stop_on_signal(signum, step, cfg, master)
            run_evals(step, due(cfg.val_every, step, last), due(cfg.hellaswag_every, step, last))
            say_samples(lambda g: generate(weights, g, cfg), cfg, step, last, device, encoder and encoder.decode,
                        master, say)
            if budget_spent:
                say(f"--time-budget {cfg.time_budget:g} s reached: stopped after step {step} of {cfg.steps}")
                break

    mem = peak_memory_gb(device)
    say(format_mean(times, first, profile_steps if cfg.profile else (), cfg, flops)
        + f" | peak memory {'n/a' if mem is None else f'{mem:.2f} GB'}"
        + (' (steady state)' if len(times) > 1 else ''))


if __name__ == "__main__":
    # one module, not two: triton_kernels.py and triton_tools.py import this file by its name
    sys.modules.setdefault("train_gpt2_triton", sys.modules[__name__])
    main()
