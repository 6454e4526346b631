"""train_gpt2_triton.py: GPT-2 with a hand-derived backward, on plain torch ops or on our Triton kernels.

Every op of the model is a forward that returns what its backward needs and a backward derived by hand;
the model's backward chains them in reverse under torch.no_grad(): no autograd. BACKEND picks who
implements the ops, behind one interface: `torch` (plain torch ops, the reference) or `triton` (our
kernels; without a GPU, TRITON_INTERPRET=1 runs them in Triton's interpreter: slow, fp32 only). Backend
triton's kernels and the code of --test, --profile and --bench-ops follow main. Formats, flags and logs:
docs/FORMATS.md.

    python train_gpt2_triton.py torch --test               # every op and the whole model against autograd
    python train_gpt2_triton.py triton --test              # every kernel against backend torch
    python train_gpt2_triton.py torch --data synthetic --n-layer 2 --n-head 4 --n-embd 64 --seq-len 64 \\
        --batch-size 4 --total-batch-size 1024 --steps 20  # smoke run, any machine, no download
    python train_gpt2_triton.py triton --batch-size 16     # GPT-2 124M on data/fineweb_edu, bf16
    python train_gpt2_triton.py triton --recipe speedrun   # the speedrun baseline on our kernels
    python train_gpt2_triton.py triton --data synthetic --batch-size 16 --total-batch-size 65536 --steps 5 \\
        --profile                                          # tables of steps 2-4, per op and per kernel
    torchrun --standalone --nproc_per_node=8 train_gpt2_triton.py triton   # 8 GPUs, data parallel

Map: the file's sections, in order. The shared plumbing is the same in every trainer, a copy held equal by
tests/test_copies.py (`python tests/sync_copies.py FILE` carries an edit to every copy). Delete
`Recipe: speedrun` and `Triton kernels: speedrun` and GPT-2 trains as before.
    GPT-2: config                          vocabulary, names, Config, Recipe, flags, shapes, init, model files
    GPT-2: ops                             the op interface, backend torch's ops (the reference)
    GPT-2: model                           the forward on the ops
    GPT-2: backward                        the lm head and the loss, the forward in reverse
    GPT-2: AdamW and the lr schedule       AdamW, llm.c's cosine schedule
    GPT-2: training step                   the step, GPT-2's row of RECIPES
    Recipe: speedrun                       modded-nanogpt's baseline: config, model, Muon, model files, its row
    Triton plumbing: devices, state and evaluation   make_state, HellaSwag, samples
    Shared plumbing: flags, shards, checkpoints, out dir, logs, signals   the same in every trainer
    Shared torch plumbing: processes, ZeRO-1, evaluation   the same in both torch trainers
    Main                                   the run, top to bottom
    Triton kernels: memory-bound ops       embedding, LayerNorm, GELU, cross-entropy, global norm, AdamW
    Triton kernels: matmul with fused epilogues, and dW   forward and dX, the weight and bias gradients
    Triton kernels: causal flash attention   forward, dK/dV and dQ
    Triton kernels: the training step's own   zeroing, clipping, the loss sum, copies
    Backend triton: the op interface filled in by the kernels above   TRITON_OPS
    Self-test (--test)                     each op and the whole model against a reference
    Profiling (--profile, --bench-ops)     per op and per kernel: time, FLOP/s or GB/s, against PyTorch's
    Compiling for a GPU (--compile-for)    every kernel of a step compiled for a GPU that is not there
    The tools of each recipe               RecipeTools, TOOLS: gpt2's row (the speedrun's: its kernels' section)
    Triton kernels: speedrun               its ops on our kernels, q/k rotary, Muon, its tools' cases
"""

import argparse
import atexit
import contextlib
import datetime
import errno
import fcntl
import functools
import glob
import json
import math
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from tokenize import TokenError
from types import SimpleNamespace
from unittest import mock

import numpy as np
import safetensors
import safetensors.numpy
import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton
import triton.language as tl
from tqdm import tqdm
from triton.tools.tensor_descriptor import TensorDescriptor

FRAMEWORK = "triton"  # logged as f"triton-{backend}": "triton-torch" | "triton-triton"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter runs the kernels

# -----------------------------------------------------------------------------
# GPT-2: config
VOCAB_SIZE = 50257         # GPT-2 BPE tokens; EOT is the last one
PADDED_VOCAB_SIZE = 50304  # wte rows: a multiple of 128 for fast matmuls; the extra rows stay zero
EOT = 50256
# name: (n_layer, n_head, n_embd)
MODEL_PRESETS = {"d12": (12, 12, 768), "d24": (24, 16, 1024), "d36": (36, 20, 1280), "d48": (48, 25, 1600)}
# llm.c's tensor order, as in its model file
PARAM_NAMES = ["wte", "wpe", "ln_1.w", "ln_1.b", "c_attn.w", "c_attn.b", "attn.c_proj.w",
               "attn.c_proj.b", "ln_2.w", "ln_2.b", "c_fc.w", "c_fc.b", "mlp.c_proj.w",
               "mlp.c_proj.b", "ln_f.w", "ln_f.b"]
LAYER_NAMES = PARAM_NAMES[2:-2]  # the per-layer tensors, stacked along a leading L axis
DECAY_NAMES = {"wte", "wpe", "c_attn.w", "attn.c_proj.w", "c_fc.w", "mlp.c_proj.w"}
MODEL_MAGIC = 20240326


@dataclass
class Config:
    """The flags with their defaults (each also named in parse_args): the shared ones, then this trainer's own."""
    # gpt2: llm.c's model and AdamW; speedrun: modded-nanogpt's simplified baseline, its model and Muon
    recipe: str = "gpt2"
    # model (block_size = rows of wpe: seq_len from scratch, the file's max T with --init-from)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = VOCAB_SIZE
    padded_vocab_size: int = PADDED_VOCAB_SIZE
    # data
    data: str = "data/fineweb_edu"
    val_data: str = ""
    seq_len: int = 1024
    batch_size: int = 32
    total_batch_size: int = 524288
    shuffle: bool = False  # llm.c's shuffled order (train_gpt2.c/.cu), not train_gpt2.py's in-order one
    # optimization
    steps: int = 18865
    time_budget: float = 0.0  # seconds of step time after which the run stops early; 0 = never
    lr: float = 6e-4
    lr_decay_frac: float = 0.0
    warmup: int = 700
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dtype: str = ""  # "": the device's default (default_dtype): bf16 on a GPU, fp32 on a CPU
    recompute: str = "none"  # what the backward recomputes instead of keeping: RECOMPUTE_LEVELS
    seed: int = 1337
    fp8_head: bool = False  # the speedrun head's training matmuls in FP8 (docs/FORMATS.md)
    # checkpoints, evaluation, output
    init_from: str = ""
    resume: str = ""
    force: bool = False
    out_dir: str = f"out/gpt2_{FRAMEWORK}"
    ckpt_every: int = 2000
    val_every: int = 250
    val_tokens: int = 10485760  # llm.c's 20 x 64 x 1024 x 8 GPUs, modded-nanogpt's 20 x 524288
    hellaswag_every: int = 1000
    hellaswag_limit: int = 0
    sample_every: int = 1000
    sample_tokens: int = 63  # tokens each sample adds: EOT + 63 = 64 wide, a multiple of 64
    top_k: int = 40
    prompt: str = ""  # the text each sample continues, after EOT
    eval_only: bool = False
    sample_only: bool = False
    profile: bool = False
    zero_stage: int = 0  # 0: every device holds all optimizer state, 1: ZeRO-1, 3: weights and gradients too
    # this trainer only: which ops implement the model, and its self-test and op benchmark
    backend: str = "torch"
    test: bool = False
    bench_ops: bool = False
    compile_for: str = ""  # a GPU_TARGETS key: compile the step's kernels for that GPU, run nothing

@dataclass(frozen=True)
class Recipe:
    """A row of RECIPES, added where its recipe's section ends: the code asks this row, never the recipe's name."""
    help: str             # --recipe's help text for it
    defaults: dict        # its defaults over Config's
    configure: Callable   # (cfg, given, shape): checks and derives the flags after parsing
    shapes: Callable      # cfg -> {name: shape}, in the order of its model files
    init: Callable        # cfg -> {name: fp32 numpy array}, from cfg.seed
    lr_at: Callable       # (it, cfg) -> the lr of 0-based iteration it
    muon_names: Callable  # shapes -> the names Muon updates (whole matrices); [] without Muon
    model_file: str       # its weights' file in a checkpoint dir
    file_kind: str        # what a message calls its model files
    is_file: Callable     # the first 9 bytes of a file -> whether it is one of its model files
    read_file: Callable   # path -> (header, {name: fp32 array})
    write_file: Callable  # (path, params, cfg)
    model_name: str       # the start line's name of the model
    table: str            # the embedding that only gathers rows: no flops counted for it
    optimizers: str       # the start line's name of the optimizers
    activation_bytes: Callable  # cfg -> bytes one micro-batch's activations hold per device at cfg.recompute
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
    p.add_argument("--compile-for", choices=sorted(GPU_TARGETS), help="compile every kernel that a step at these "
                   "flags launches for this GPU (no GPU needed): a row per kernel and config, then exit")


def param_shapes(cfg):
    """{name: shape} of the recipe's weights, in the order of its model files."""
    return RECIPES[cfg.recipe].shapes(cfg)


def configure_gpt2(cfg, given, shape):
    """GPT-2's flag checks: its lm head is wte (tied), so --fp8-head has no head of its own to quantize."""
    if cfg.fp8_head:
        die("--fp8-head: the gpt2 recipe's lm head is its embedding wte (tied); FP8 is for the speedrun "
            "recipe's untied head (--recipe speedrun)")


def gpt2_shapes(cfg):
    """{name: shape} of GPT-2's weights, in the order of llm.c's model file."""
    L, C, Vp, T = cfg.n_layer, cfg.n_embd, cfg.padded_vocab_size, cfg.block_size
    return {"wte": (Vp, C), "wpe": (T, C), "ln_1.w": (L, C), "ln_1.b": (L, C),
            "c_attn.w": (L, 3 * C, C), "c_attn.b": (L, 3 * C), "attn.c_proj.w": (L, C, C), "attn.c_proj.b": (L, C),
            "ln_2.w": (L, C), "ln_2.b": (L, C), "c_fc.w": (L, 4 * C, C), "c_fc.b": (L, 4 * C),
            "mlp.c_proj.w": (L, C, 4 * C), "mlp.c_proj.b": (L, C), "ln_f.w": (C,), "ln_f.b": (C,)}


def init_gpt2_numpy(cfg):
    """GPT-2's init from cfg.seed (docs/FORMATS.md), in numpy so that every trainer starts from the same weights."""
    rng, params = np.random.default_rng(cfg.seed), {}
    for name, shape in gpt2_shapes(cfg).items():
        if name.endswith(".b"):
            params[name] = np.zeros(shape, np.float32)
        elif name.startswith("ln"):
            params[name] = np.ones(shape, np.float32)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.w") else 0.02
            params[name] = (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)
    params["wte"][cfg.vocab_size:] = 0.0  # padded rows start at zero and never receive a gradient
    return params


def write_model_file(path, params, cfg):
    """An fp32 (version 3) llm.c model file: the 256-int32 header, then the tensors in PARAM_NAMES order."""
    shapes, header = gpt2_shapes(cfg), np.zeros(256, dtype="<i4")
    header[:8] = [MODEL_MAGIC, 3, cfg.block_size, cfg.vocab_size,
                  cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.padded_vocab_size]
    with open(path, "wb") as f:  # into a checkpoint's temporary dir, which save_checkpoint renames when complete
        f.write(header.tobytes())
        for name in PARAM_NAMES:
            t = np.asarray(params[name], dtype=np.float32)
            assert t.shape == shapes[name], (name, t.shape, shapes[name])
            f.write(t.astype("<f4").tobytes())


def read_model_file(path):
    """(header dict, {name: fp32 array}) of an llm.c model file (version 3: fp32, 5: bf16), its header checked first."""
    size = os.path.getsize(path)
    if size < 1024:
        die(f"model file {path} is truncated: {size} bytes, shorter than its 1024-byte header")
    h = np.fromfile(path, "<i4", count=256)
    if h[0] != MODEL_MAGIC:
        die(f"model file {path} has magic {h[0]}, expected {MODEL_MAGIC} (not an llm.c model file)")
    if h[1] not in (3, 5):
        die(f"model file {path} has version {h[1]}, expected 3 (fp32) or 5 (bf16)")
    header = dict(block_size=int(h[2]), vocab_size=int(h[3]), n_layer=int(h[4]), n_head=int(h[5]),
                  n_embd=int(h[6]), padded_vocab_size=int(h[7]))
    if min(header.values()) <= 0 or header["n_embd"] % header["n_head"]:
        die(f"model file {path} has an invalid header {header}")
    shapes, itemsize = gpt2_shapes(SimpleNamespace(**header)), 4 if h[1] == 3 else 2
    expected = 1024 + itemsize * sum(math.prod(s) for s in shapes.values())
    if size != expected:
        cut = " (truncated)" if size < expected else ""
        die(f"model file {path} has {size} bytes, its header implies {expected}{cut}")
    raw, params, offset = np.fromfile(path, np.uint8), {}, 1024
    for name in PARAM_NAMES:
        chunk = raw[offset: offset + math.prod(shapes[name]) * itemsize]
        t = (chunk.view("<f4").astype(np.float32) if itemsize == 4 else
             (chunk.view("<u2").astype(np.uint32) << 16).view(np.float32))  # bf16: an fp32's top 16 bits
        bad = t.size - np.count_nonzero(np.isfinite(t))
        if bad:
            die(f"model file {path}: tensor {name} holds {bad} non-finite values (NaN or inf): the weights "
                "of a diverged run?")
        params[name] = t.reshape(shapes[name])
        offset += chunk.size
    return header, params


# -----------------------------------------------------------------------------
# GPT-2: ops
#
# A training step computes only the ops of OP_NAMES (backend torch's here, triton's after main). Each forward
# returns what its backward needs; N = B*T rows. Weight gradients are fp32 buffers that backwards add into (+=):
# micro-batches accumulate, the tied wte gets both uses. Statistics, softmax and losses are fp32 (fp64 in --test).

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
    return (x, *torch_layernorm_forward(x, w, b))  # (N, C) x2, (N,) x2


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
    """GPT-2's op namespace of `backend`: TORCH_OPS, or TRITON_OPS (defined after main)."""
    return TORCH_OPS if backend == "torch" else TRITON_OPS


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


def loss_fn(params, x, y, cfg):
    """Mean token loss of one micro-batch (fp32 scalar)."""
    return token_losses(params, x, y, cfg).mean()


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


def cosine_lr(it, cfg):
    """llm.c's lr of 0-based iteration `it`: a linear warmup, then a cosine down to lr*lr_decay_frac."""
    min_lr = cfg.lr * cfg.lr_decay_frac
    if it < cfg.warmup:
        return cfg.lr * (it + 1) / cfg.warmup
    ratio = (it - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (cfg.lr - min_lr)


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
    model_file="model.bin", file_kind="an llm.c model file (.bin)", read_file=read_model_file,
    is_file=lambda head: head[:4] == MODEL_MAGIC.to_bytes(4, "little"), write_file=write_model_file,
    model_name="GPT-2", table="wpe", optimizers="AdamW", activation_bytes=gpt2_activation_bytes,
    ops=gpt2_ops, forward=gpt2_forward, backward=gpt2_backward, head=("wte", None), loss=gpt2_loss,
    logits=lambda z: z, summed=False, update=gpt2_update)}


# -----------------------------------------------------------------------------
# Recipe: speedrun
#
# modded-nanogpt's records/track_3_optimization/train_gpt_simple.py (docs/FORMATS.md, The speedrun recipe)

# its lrs per parameter group; --lr sets Muon's and scales the others with it
SPEEDRUN_LRS = {"muon": 0.025, "embed": 0.7, "head": 0.004, "vector": 0.015}
ADAMW_GROUPS = {"embed.weight": "embed", "proj.weight": "head"}  # the AdamW tensors' groups; the rest "vector"
# its defaults over Config's (--weight-decay is AdamW's, Muon's MUON_WEIGHT_DECAY); the rest are llm.c's recipe's
SPEEDRUN_DEFAULTS = {"steps": 3250, "lr": SPEEDRUN_LRS["muon"], "warmup": 0, "weight_decay": 0.001,
                     "grad_clip": 0.0, "val_every": 125}
HEAD_DIM = 128  # the speedrun model's head size: its width sets the head count
ATTN_SCALE = 0.12  # the reference's attention scale, in place of 1/sqrt(128)
SOFTCAP = 15.0  # the reference's soft cap of the head: logits = 15 z / sqrt(z^2 + 15^2)
SPEEDRUN_COOLDOWN = 0.7  # the fraction of the steps over which the speedrun recipe's lr falls
SPEEDRUN_BETA1, SPEEDRUN_BETA2, SPEEDRUN_EPS = 0.8, 0.95, 1e-10
MUON_MOMENTUM, MUON_WEIGHT_DECAY, NEWTON_SCHULZ_STEPS = 0.95, 0.05, 12
SPEEDRUN_HELP = (
    "modded-nanogpt's simplified speedrun baseline (RMSNorm, rotary, ReLU^2, an untied soft-capped head, "
    f"AdamW and Muon), {HEAD_DIM}-wide heads (--n-head is --n-embd / {HEAD_DIM}), --lr is Muon's and scales "
    "the AdamW groups' in proportion (" + ", ".join(f"{k} {v}" for k, v in SPEEDRUN_LRS.items())
    + "), --weight-decay is on every AdamW tensor, and its defaults: "
    + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in SPEEDRUN_DEFAULTS.items()))
# --fp8-head (docs/FORMATS.md, FP8 head): the static scales of modded-nanogpt's train_gpt.py (whose grad_s also
# holds the grad_scale its gradient carries, and our gradient of the summed loss does not)
FP8_SCALES = {"x": 100 / 448, "w": 1.6 / 448, "grad": 0.75 / 448}
FP8_FORMATS = {"x": "e4m3fn", "w": "e4m3fn", "grad": "e5m2"}
FP8_MAX = {"e4m3fn": 448.0, "e5m2": 57344.0}
# the safetensors types the trainers read, as numpy's (a bf16 value as an fp32's top 16 bits); they write F32
SAFETENSORS_TYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


def configure_speedrun(cfg, given, shape):
    """The speedrun model's heads are HEAD_DIM wide: its width sets their count."""
    if cfg.n_embd % HEAD_DIM:
        die(f"--n-embd {cfg.n_embd}: the speedrun recipe's heads are {HEAD_DIM} wide, so its width must "
            f"be a multiple of {HEAD_DIM}")
    if given.get("n_head", cfg.n_embd // HEAD_DIM) != cfg.n_embd // HEAD_DIM:
        die(f"--n-head {cfg.n_head}: the speedrun recipe's heads are {HEAD_DIM} wide, so --n-embd "
            f"{cfg.n_embd} has {cfg.n_embd // HEAD_DIM} of them (leave --n-head out)")
    cfg.n_head = shape["n_head"] = cfg.n_embd // HEAD_DIM


def speedrun_shapes(cfg):
    """{name: shape} of the reference's GPT.named_parameters(), in its order; per layer, so Muon sees each matrix."""
    C, Vp = cfg.n_embd, cfg.padded_vocab_size
    shapes = {"embed.weight": (Vp, C)}
    for i in range(cfg.n_layer):
        for name, rows, cols in (("attn.q", C, C), ("attn.k", C, C), ("attn.v", C, C), ("attn.proj", C, C),
                                 ("mlp.fc", 4 * C, C), ("mlp.proj", C, 4 * C)):
            shapes[f"blocks.{i}.{name}.weight"], shapes[f"blocks.{i}.{name}.bias"] = (rows, cols), (rows,)
        shapes[f"blocks.{i}.norm1.gains"], shapes[f"blocks.{i}.norm2.gains"] = (C,), (C,)
    shapes.update({"proj.weight": (Vp, C), "proj.bias": (Vp,), "norm1.gains": (C,), "norm2.gains": (C,)})
    return shapes


def muon_names(shapes):
    """The weights Muon updates: every matrix inside the blocks."""
    return [k for k, shape in shapes.items() if k.startswith("blocks.") and len(shape) == 2]


def init_speedrun_numpy(cfg):
    """The reference's init in speedrun_shapes' order: *proj* and biases 0, gains 1, embed N(0, 1), N(0, .33/fan_in)."""
    rng, params = np.random.default_rng(cfg.seed), {}
    for name, shape in speedrun_shapes(cfg).items():
        if name.endswith(".gains"):
            params[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias") or "proj" in name:
            params[name] = np.zeros(shape, np.float32)
        else:
            std = 1.0 if name == "embed.weight" else 0.33**0.5 / math.sqrt(shape[-1])
            params[name] = (rng.standard_normal(shape) * std).astype(np.float32)  # float64 draws, rounded
    return params


def rotary_freq_numpy(head_dim):
    """The reference's rotary frequencies (head_dim/2,) fp32, its state_dict's buffer; the last half zeros."""
    freq = np.float32(1 / 1024) ** np.linspace(0, 1, head_dim // 4, dtype=np.float32)
    return np.concatenate([freq, np.zeros(head_dim // 4, np.float32)])


def speedrun_lr(it, cfg):
    """The reference's lr of 0-based iteration `it`: lr until 30% of the steps, then linear to lr*lr_decay_frac."""
    min_lr = cfg.lr * cfg.lr_decay_frac
    if it < cfg.warmup:
        return cfg.lr * (it + 1) / cfg.warmup
    eta = min(1.0, max(0.0, 1.0 - it / cfg.steps) / SPEEDRUN_COOLDOWN)
    return min_lr + eta * (cfg.lr - min_lr)


def speedrun_lrs(it, cfg):
    """{group: lr} of 0-based iteration `it`: Muon's is speedrun_lr's, the AdamW groups' keep their ratios to it."""
    scale = speedrun_lr(it, cfg) / SPEEDRUN_LRS["muon"]
    return {group: lr * scale for group, lr in SPEEDRUN_LRS.items()}


def fp8_reciprocal(kind):
    """The fp32 value that --fp8-head multiplies operand `kind` by before its cast: 1/scale rounded to fp32 once."""
    # the same in every framework, as a division's rounding is not (CUDA torch, Triton's approximate division)
    return float(np.float32(1 / FP8_SCALES[kind]))


def read_safetensors(path, check=None):
    """({name: fp32 array}, check({name: (type, shape)})) of a safetensors file of finite floats; check runs first."""
    try:
        with safetensors.safe_open(path, framework="numpy") as f:
            entries = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except (safetensors.SafetensorError, OSError) as e:
        die(f"model file {path} is not a valid safetensors file ({str(e).splitlines()[0][:160]})")
    for k, (dtype, shape) in entries.items():
        if not k.isprintable():
            die(f"model file {path} has a tensor name with unprintable characters: {json.dumps(k)[:100]}")
        if dtype not in SAFETENSORS_TYPES:
            die(f"model file {path}: tensor {k[:100]} is {dtype}, not one of {', '.join(SAFETENSORS_TYPES)}")
    checked = check(entries) if check else None
    with open(path, "rb") as f:
        stored, tensors = safetensors.deserialize(f.read()), {}
    for k, e in stored:
        t = np.frombuffer(e["data"], SAFETENSORS_TYPES[e["dtype"]])
        t = (t.astype(np.uint32) << 16).view(np.float32) if e["dtype"] == "BF16" else t.astype(np.float32)
        bad = t.size - np.count_nonzero(np.isfinite(t))
        if bad:
            die(f"model file {path}: tensor {k[:100]} holds {bad} non-finite values (NaN or inf): the weights of "
                "a diverged run?")
        tensors[k] = t.reshape(e["shape"])
    return tensors, checked


def write_speedrun_file(path, params, cfg):
    """A speedrun model file: the reference's GPT.state_dict() in fp32 safetensors, rotary buffers included."""
    tensors = {}
    for k in speedrun_shapes(cfg):
        tensors[k] = np.ascontiguousarray(params[k], np.float32)
        if k.endswith(".attn.proj.bias"):  # where the reference's state_dict puts the attention's buffer
            tensors[k.replace("proj.bias", "rotary.angular_freq")] = rotary_freq_numpy(HEAD_DIM)
    with open(path, "wb") as f:  # written here, not by the library: a full disk is an OSError with errno
        f.write(safetensors.numpy.save(tensors, metadata={"format": "pt"}))


def read_speedrun_file(path):
    """(header, {name: fp32 array}) of a speedrun model file of any float type, its names and shapes checked first."""
    def check(entries):  # the shape from embed.weight and the blocks' count, bounded by their names
        embed = entries.get("embed.weight", (None, ()))[1]
        if len(embed) != 2:
            die(f"model file {path} has no 2-D embed.weight: not a speedrun model")
        blocks = [k for k in entries if k.startswith("blocks.")]
        n_layer = len({k.split(".")[1] for k in blocks})
        for k in blocks:
            if k.split(".")[1] not in {str(i) for i in range(n_layer)}:
                die(f"model file {path} holds tensor {k[:100]}: the tensors of {n_layer} blocks must be "
                    f"numbered 0..{n_layer - 1}")
        padded, n_embd = embed
        if n_embd % HEAD_DIM or n_embd == 0 or n_layer == 0:
            die(f"model file {path}: width {n_embd} (embed.weight) is not a multiple of the head size "
                f"{HEAD_DIM}, or it has no blocks")
        header = dict(vocab_size=VOCAB_SIZE, padded_vocab_size=padded, n_layer=n_layer,
                      n_head=n_embd // HEAD_DIM, n_embd=n_embd)
        shapes = speedrun_shapes(SimpleNamespace(**header))
        freqs = {f"blocks.{i}.attn.rotary.angular_freq": (HEAD_DIM // 2,) for i in range(n_layer)}
        for k, shape in {**shapes, **freqs}.items():
            if k not in entries:
                die(f"model file {path} lacks tensor {k} {list(shape)}")
            if entries[k][1] != shape:
                die(f"model file {path}: tensor {k} has shape {list(entries[k][1])}, expected {list(shape)}")
        extra = [k for k in entries if k not in shapes and k not in freqs]
        if extra:
            die(f"model file {path} holds tensor {extra[0][:100]}, which the speedrun model does not have")
        return header, shapes, {k: e[0] for k, e in entries.items()}
    tensors, (header, shapes, types) = read_safetensors(path, check)
    for i in range(header["n_layer"]):  # as the file's type rounds them (the reference's bf16 state_dict)
        k = f"blocks.{i}.attn.rotary.angular_freq"
        if not np.allclose(tensors[k], rotary_freq_numpy(HEAD_DIM), atol=0,
                           rtol={"BF16": 2**-7, "F16": 2**-10}.get(types[k], 1e-6)):
            die(f"model file {path}: {k} are not the recipe's frequencies")
    converted = sorted({t for t in types.values() if t != "F32"})
    if converted:
        print(f"model file {path}: its {'/'.join(converted)} tensors are converted to fp32, the type the "
              "trainer keeps its weights in")
    return header, {k: tensors[k] for k in shapes}


def newton_schulz(G, dtype):
    """The reference's orthogonalization of each matrix G (n,r,c) -> (n,r,c) in `dtype`."""
    # X = G/||G||_F, then X <- 2X + (-1.5 A + 0.5 A^2) X with A = X X^T, on tall matrices' transposes (A the smaller)
    tall = G.shape[-2] > G.shape[-1]
    X = G.to(dtype).mT if tall else G.to(dtype)                                    # (n,r',c')
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)                            # (n,r',c')
    # the sums inside the matmuls that form the products (baddbmm): three new tensors an iteration, not eight
    for _ in range(NEWTON_SCHULZ_STEPS):
        A = X @ X.mT                                                               # (n,r',r')
        B = torch.baddbmm(A, A, A, beta=-1.5, alpha=0.5)                           # (n,r',r')
        X = torch.baddbmm(X, B, X, beta=2.0)                                       # (n,r',c')
    return X.mT if tall else X                                                     # (n,r,c)


def fp8_quantize(x, kind):
    """--fp8-head's operand `kind` of x: x times fp8_reciprocal(kind) in fp32, saturated, rounded to nearest even."""
    fmt = FP8_FORMATS[kind]  # clamped: torch's e5m2 cast would overflow to inf
    return (x.float() * fp8_reciprocal(kind)).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(TORCH_FP8[fmt])


def fp8_matmul(a, b, scale_a, scale_b, out_dtype, fast_accum=False):
    """(a (M,K) @ b (K,N)) x scale_a x scale_b in out_dtype of fp8 operands; off CUDA, of their exact fp32 values."""
    if a.is_cuda:  # a row-major, b column-major, as it requires; fast_accum: the reference forward's
        sa, sb = (torch.tensor(s, dtype=torch.float32, device=a.device) for s in (scale_a, scale_b))
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=sa, scale_b=sb,
                                out_dtype=out_dtype, use_fast_accum=fast_accum)
    return ((a.float() @ b.float()) * (scale_a * scale_b)).to(out_dtype)


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
    return (x, *torch_rmsnorm_forward(x, w, eps))  # (N, C) x2, (N,)


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


torch_fp8_quantize = fp8_quantize  # the torch trainers' shared casts
TORCH_SPEEDRUN_OPS = op_table("torch", {name: globals()[f"torch_{name}"] for name in SPEEDRUN_OP_NAMES},
                              SPEEDRUN_OP_NAMES)


def speedrun_ops(backend):
    """The speedrun recipe's op namespace of `backend`: GPT-2's and its own (SPEEDRUN_OP_NAMES)."""
    own = TORCH_SPEEDRUN_OPS if backend == "torch" else TRITON_SPEEDRUN_OPS
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
        b, g = ({k[len(f"blocks.{l}."):]: t for k, t in d.items() if k.startswith(f"blocks.{l}.")} for d in (w, grads))
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
        dres = ops.rmsnorm_backward(dh, a["res"], b["norm1.gains"], rstd, g["norm1.gains"], dres=dres)  # (N, C)
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
        names = [k for k in adam if ADAMW_GROUPS.get(k, "vector") == group]
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
    is_file=lambda head: head[8:9] == b"{", read_file=read_speedrun_file, write_file=write_speedrun_file,
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
    """The device state from numpy dicts: `grads` (views of `grad_buffer`), `weights`, its ZeRO stage's `shard_*`."""
    shapes = param_shapes(cfg)
    muon = RECIPES[cfg.recipe].muon_names(shapes)
    layout = state_layout(compute_groups(cfg), muon, shapes, world)
    _, starts, spans = layout
    buffer = torch.zeros(spans[-1][1], dtype=torch.float32, device=device)         # (P,) padded
    state = {"grad_buffer": buffer, "grads": flat_views(buffer, starts, shapes, list(shapes)), "starts": starts}
    if cfg.zero_stage == 0:  # a process's shard is the whole model (shard_copies: the bf16 `weights`, None in fp32)
        state.update({name: to_device(d, device) for name, d in (("params", params), ("m", m), ("v", v))})
        state["weights"] = ({k: t.to(torch.bfloat16) for k, t in state["params"].items()}
                            if cfg.dtype == "bf16" else state["params"])
        state.update(shard_params=state["params"], shard_grads=state["grads"],
                     shard_copies=state["weights"] if cfg.dtype == "bf16" else None,
                     groups=[{"span": (0, state["grad_buffer"].numel()), "grads": state["grad_buffer"]}])
        return state
    return sharded_state(state, params, m, v, shapes, layout, muon, device, rank, world)


def device_state_bytes(cfg, shapes, world):
    """Bytes of make_state's tensors in one process, by kind (state_bytes of this trainer's layout)."""
    muon = RECIPES[cfg.recipe].muon_names(shapes)
    layout = state_layout(compute_groups(cfg), muon, shapes, world)
    return state_bytes(cfg.zero_stage, shapes, layout, muon, world)


@torch.no_grad()
def generate(params, generator, cfg, prompt):
    """SAMPLE_COUNT top-k continuations of the tokens prompt (S, T) int64, prompt first, every position recomputed."""
    # backend torch's ops whatever the backend, so both sample alike: a token's forward through the interpreted
    # kernels took seconds, and a smoke run's samples outlasted its training
    recipe, ops = RECIPES[cfg.recipe], backend_ops("torch", cfg.recipe)
    device = next(iter(params.values())).device
    T = min(cfg.block_size, len(prompt) + cfg.sample_tokens)
    tokens = torch.tensor(prompt + [EOT] * (T - len(prompt)), device=device).repeat(SAMPLE_COUNT, 1)  # (S, T)
    for t in range(len(prompt) - 1, T - 1):  # token t+1 from 0..t
        h = recipe.forward(params, tokens, cfg, ops)  # (S*T, C)
        h = h.view(SAMPLE_COUNT, T, -1)[:, t].contiguous()  # (S, C)
        logits = recipe.logits(head_logits(h, params, cfg, ops))[:, :VOCAB_SIZE].float()  # (S, V)
        top_logits, top_ids = torch.topk(logits, min(cfg.top_k or VOCAB_SIZE, VOCAB_SIZE), dim=-1)  # (S, K) each
        choice = torch.multinomial(torch.softmax(top_logits, dim=-1), 1, generator=generator)  # (S, 1)
        tokens[:, t + 1] = torch.gather(top_ids, -1, choice)[:, 0]
    return tokens


# -----------------------------------------------------------------------------
# Shared plumbing: flags, shards, checkpoints, out dir, logs, signals
# (the same in every trainer: python tests/sync_copies.py FILE carries an edit made in FILE to every copy)

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a full quota, a file-size limit reached


def die(msg):
    """Stops the run with a one-line error (SystemExit prints it to stderr and exits 1, no traceback)."""
    raise SystemExit(f"error: {msg}")


def write_failure(path, e):
    """The one line that says why writing `path` failed, a full disk said as such."""
    if e.errno in DISK_FULL:
        return f"cannot write {path}: no space left, the disk is full (free some; --resume auto continues)"
    return f"cannot write {path}: {e.strerror}"

# --recompute (docs/FORMATS.md): none keeps what the backward reads; pointwise recomputes the norms' outputs and
# the MLP's activation; block keeps each block's input alone and reruns its forward in the backward
RECOMPUTE_LEVELS = ("none", "pointwise", "block")


def parse_args(argv=None):
    """(cfg, explicit): the flags over Config's defaults; the shape flags and --seed given, which files must match."""
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], argument_default=argparse.SUPPRESS)
    p.error = die  # a bad flag gets one line naming it, not the whole usage text
    framework_flags(p)
    p.add_argument("--recipe", choices=list(RECIPES), help="; ".join(f"{name}: {r.help}" for name, r in
                   RECIPES.items()) + f" (default {d.recipe})")
    p.add_argument("--data", help=f"a dir of *_train_*.bin shards, a shard glob, or 'synthetic' (default {d.data})")
    p.add_argument("--val-data", help="validation shard glob (default: a --data DIR's *_val_*.bin)")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), help="preset layers/heads/width: " + ", ".join(
                   f"{k} {'/'.join(map(str, v))}" for k, v in MODEL_PRESETS.items()) + " (default d12)")
    p.add_argument("--n-layer", type=int, help="transformer blocks (default: --model's)")
    p.add_argument("--n-head", type=int, help="attention heads, dividing --n-embd (default: --model's or --recipe's)")
    p.add_argument("--n-embd", type=int, help="width of the residual stream (default: --model's)")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {d.seq_len})")
    p.add_argument("--batch-size", type=int, help=f"sequences per micro-batch per device (default {d.batch_size})")
    p.add_argument("--total-batch-size", type=int, help=f"tokens per optimizer step (default {d.total_batch_size})")
    p.add_argument("--shuffle", action="store_true", help="read the train shards in llm.c's shuffled order")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--time-budget", type=float, help="stop once the steps took this many seconds (default 0: never)")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {d.lr}; see --recipe)")
    p.add_argument("--lr-decay-frac", type=float, help=f"the decay ends at lr x this (default {d.lr_decay_frac})")
    p.add_argument("--warmup", type=int, help=f"steps of linear warmup (default {d.warmup})")
    p.add_argument("--weight-decay", type=float, help=f"AdamW's weight decay (default {d.weight_decay}; see --recipe)")
    p.add_argument("--grad-clip", type=float, help=f"clip gradients to this norm, 0 = never (default {d.grad_clip})")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="compute dtype (default bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--recompute", choices=RECOMPUTE_LEVELS, help=f"what the backward reruns (default {d.recompute})")
    p.add_argument("--seed", type=int, help=f"the init, --data synthetic's tokens, the samples (default {d.seed})")
    p.add_argument("--fp8-head", action="store_true", help="speedrun recipe: the head's training matmuls in FP8")
    p.add_argument("--zero-stage", type=int, help=f"ZeRO stage, {' or '.join(map(str, ZERO_STAGES))} (default 0)")
    p.add_argument("--init-from", help="a model file of the recipe to start from: "
                   + ", ".join(f"{r.file_kind} ({name})" for name, r in RECIPES.items()))
    p.add_argument("--resume", help="a checkpoint dir to continue from, or 'auto': the newest in --out-dir")
    p.add_argument("--force", action="store_true", help="start over in an --out-dir that holds a run (moved aside)")
    p.add_argument("--out-dir", help=f"log.jsonl, checkpoints and profiles (default {d.out_dir})")
    p.add_argument("--ckpt-every", type=int, help=f"steps between checkpoints, 0 = never (default {d.ckpt_every})")
    p.add_argument("--val-every", type=int, help=f"steps between val losses, 0 = never (default {d.val_every})")
    p.add_argument("--val-tokens", type=int, help=f"tokens per val loss (default {d.val_tokens})")
    p.add_argument("--val-steps", type=int, help="shorthand for --val-tokens N x batch size x seq len")
    p.add_argument("--hellaswag-every", type=int, help=f"steps between HellaSwag evals (default {d.hellaswag_every})")
    p.add_argument("--hellaswag-limit", type=int, help="HellaSwag examples scored, 0 = all (default 0)")
    p.add_argument("--sample-every", type=int, help=f"steps between samples, 0 = never (default {d.sample_every})")
    p.add_argument("--sample-tokens", type=int, help=f"tokens each sample adds (default {d.sample_tokens})")
    p.add_argument("--top-k", type=int, help=f"draw from the k likeliest tokens; 1: greedy, 0: all (default {d.top_k})")
    p.add_argument("--prompt", help="the text each sample continues (default: none, a new document)")
    only = p.add_mutually_exclusive_group()  # one line where both are given (p.error)
    only.add_argument("--eval-only", action="store_true", help="val loss and HellaSwag of --init-from or --resume")
    only.add_argument("--sample-only", action="store_true", help="samples of --init-from or --resume; no training")
    p.add_argument("--profile", action="store_true", help=f"profile the {PROFILE_STEPS} steps after the first")
    given = vars(p.parse_args(argv))
    preset = given.pop("model", None)
    val_steps = given.pop("val_steps", None)  # not kept: it only sets val_tokens
    shape = dict(zip(("n_layer", "n_head", "n_embd"), MODEL_PRESETS[preset or "d12"]))
    d = replace(d, **RECIPES[given.get("recipe", d.recipe)].defaults)
    cfg = replace(d, **{**shape, **given})
    cfg.block_size = cfg.seq_len
    for flag in ("n_layer", "n_head", "n_embd", "seq_len", "batch_size", "total_batch_size", "steps", "val_tokens"):
        if getattr(cfg, flag) <= 0:
            die(f"--{flag.replace('_', '-')} must be positive")
    if val_steps is not None:
        if "val_tokens" in given or val_steps <= 0:
            die("--val-steps N, a shorthand for --val-tokens N x batch size x seq len, must be positive and "
                "given without --val-tokens")
        cfg.val_tokens = val_steps * cfg.batch_size * cfg.seq_len
    if cfg.val_tokens < cfg.seq_len:
        die(f"--val-tokens {cfg.val_tokens} is less than one sequence of --seq-len {cfg.seq_len}")
    for flag in ("warmup", "ckpt_every", "val_every", "hellaswag_every", "hellaswag_limit", "sample_every",
                 "time_budget", "sample_tokens", "top_k"):
        if not getattr(cfg, flag) >= 0:  # NaN fails this too
            die(f"--{flag.replace('_', '-')} must be >= 0")
    for flag in ("data", "val_data", "init_from", "resume", "out_dir"):  # "$UNSET" would mean no flag
        if flag in given and not given[flag]:
            die(f"--{flag.replace('_', '-')} is empty (an unset shell variable?): give a path, or leave the flag out")
    if cfg.shuffle and cfg.data == "synthetic":
        die("--shuffle with --data synthetic: --shuffle permutes the samples of token shards, and "
            "synthetic tokens are random already")
    if cfg.resume and "init_from" in given:  # which --resume would otherwise ignore
        die("--init-from with --resume: a resumed run continues its checkpoint's weights; leave one out")
    if (cfg.eval_only or cfg.sample_only) and not (cfg.resume or cfg.init_from):  # before any weights are made
        die(f"--{'eval' if cfg.eval_only else 'sample'}-only needs weights: give --init-from or --resume")
    if not 0 < cfg.lr < math.inf:
        die("--lr must be positive and finite")
    if not 0 <= cfg.lr_decay_frac <= 1:
        die("--lr-decay-frac must be in [0, 1]")
    if not (0 <= cfg.weight_decay < math.inf and cfg.grad_clip >= 0):  # NaN fails these too
        die("--weight-decay must be finite and >= 0, --grad-clip >= 0")
    if not 0 <= cfg.seed < 2**63:  # numpy's generators take no negative seed; checkpoints keep it as int64
        die("--seed must be in [0, 2**63)")
    if cfg.zero_stage not in ZERO_STAGES:
        jax = "; 3 (sharded weights) is the JAX trainer's (train_gpt2_jax.py)" if cfg.zero_stage == 3 else ""
        die(f"--zero-stage {cfg.zero_stage}: this trainer takes {' or '.join(map(str, ZERO_STAGES))}{jax}")
    RECIPES[cfg.recipe].configure(cfg, given, shape)
    if cfg.n_embd % cfg.n_head:
        die(f"--n-embd {cfg.n_embd} is not divisible by --n-head {cfg.n_head}")
    explicit = {k: given[k] for k in (*shape, "seed") if k in given}
    return cfg, ({**shape, **explicit} if preset else explicit)


def default_dtype(cfg, gpu):
    """Sets an unset --dtype once the device is known, bf16 on a GPU, fp32 on a CPU; returns the start line's words."""
    if cfg.dtype:
        return cfg.dtype
    cfg.dtype = "bf16" if gpu else "fp32"
    return ("bf16 (the default on a GPU; --dtype fp32 for full precision)" if gpu else
            "fp32 (the default on a CPU, which only emulates bf16; --dtype bf16 for it)")


def apply_model_header(cfg, header, explicit):
    """Takes the model shape from a model file's header; flags given explicitly must match it."""
    for k in ("n_layer", "n_head", "n_embd"):
        if k in explicit and explicit[k] != header[k]:
            die(f"--{k.replace('_', '-')} {explicit[k]} does not match the model file ({header[k]})")
        setattr(cfg, k, header[k])
    if header["vocab_size"] != VOCAB_SIZE or header["padded_vocab_size"] < VOCAB_SIZE:
        die(f"model file has vocab {header['vocab_size']}/{header['padded_vocab_size']}, expected {VOCAB_SIZE}")
    if "block_size" in header:  # gpt2's position table bounds T; the speedrun model's rotary does not
        if cfg.seq_len > header["block_size"] and not cfg.sample_only:  # sampling reads no sequences
            die(f"--seq-len {cfg.seq_len} exceeds the model file's max sequence length {header['block_size']}")
        cfg.block_size = header["block_size"]
    cfg.padded_vocab_size = header["padded_vocab_size"]

SHARD_MAGIC = 20240520
SYNTHETIC_TOKENS = 1 << 23  # length of the random "shard" behind --data synthetic


def read_shard(path):
    """An llm.c token shard as a read-only uint16 memmap, its header and size checked."""
    if not os.path.isfile(path):  # a FIFO's read would wait forever
        kind = "a broken symlink" if os.path.islink(path) and not os.path.exists(path) else "not a regular file"
        die(f"shard {path} is {'a folder' if os.path.isdir(path) else kind}, not an llm.c token shard")
    size = os.path.getsize(path)
    if size < 256 * 4:
        die(f"shard {path} is truncated: {size} bytes, shorter than its 1024-byte header")
    header = np.fromfile(path, dtype="<i4", count=256)
    if header[0] != SHARD_MAGIC:
        die(f"shard {path} has magic {header[0]}, expected {SHARD_MAGIC} (not an llm.c token shard)")
    if header[1] != 1:
        die(f"shard {path} has version {header[1]}, expected 1")
    ntok = int(header[2])
    if size != 256 * 4 + 2 * ntok:
        die(f"shard {path} is truncated or padded: header says {ntok} tokens, file holds {(size - 1024) // 2}")
    return np.memmap(path, dtype=np.uint16, mode="r", offset=256 * 4, shape=(ntok,))


def find_shards(cfg):
    """(train files, val files) of --data DIR | GLOB and --val-data GLOB; (None, None) for synthetic."""
    if cfg.data == "synthetic":
        return None, None
    if os.path.isdir(cfg.data):
        folder = glob.escape(cfg.data)  # a directory's name is no pattern, brackets and all
        train, val = (sorted(glob.glob(os.path.join(folder, f"*_{split}_*.bin"))) for split in ("train", "val"))
        missing = "no *_train_*.bin shards in that directory"
    else:
        train, val, missing = sorted(glob.glob(cfg.data)), [], "no such directory and no file matches that glob"
    if not train and not cfg.eval_only:
        die(f"--data {cfg.data}: {missing} (get shards with `python prepro_fineweb.py` (it writes "
            "data/fineweb_edu), or use --data synthetic for a benchmark)")
    if cfg.val_data:
        val = sorted(glob.glob(cfg.val_data))
        if not val:
            die(f"--val-data {cfg.val_data}: no file matches that glob")
    return train, val


def shard_lengths(files, batch):
    """Tokens in each shard of `files`, each checked to hold a global batch of `batch` tokens and its last target."""
    lengths = [len(read_shard(f)) for f in files]
    for f, n in zip(files, lengths):
        if n < batch + 1:
            die(f"shard {f} holds fewer than {batch + 1} tokens, one batch needs that")
    return lengths


def read_vocab_shard(path):
    """read_shard's tokens checked to be GPT-2's: as a loader opens the shard, since the max reads all of it."""
    tokens = read_shard(path)
    top = int(tokens.max())
    if top >= VOCAB_SIZE:
        die(f"shard {path} holds token ids up to {top}, outside GPT-2's vocabulary of {VOCAB_SIZE} tokens "
            "(written with another tokenizer?)")
    return tokens


class DataLoader:
    """llm.c's DistributedDataLoader: rank r reads B*T+1 tokens at p + r*B*T; files=None: random tokens from `seed`."""
    # all ranks change shards by p (llm.c: each by its own), so W ranks of B rows read what one of W*B rows reads

    def __init__(self, files, B, T, rank=0, world=1, seed=0):
        self.files, self.B, self.T, self.rank, self.world, self.seed, self.shard = files, B, T, rank, world, seed, None
        shard_lengths(files or [], world * B * T)
        self.set_state(0, 0)

    def set_state(self, shard, position):
        """Puts the loader at p = `position` in `shard`, as state() returned them."""
        if self.shard != shard:
            if self.files is None:
                n = max(SYNTHETIC_TOKENS, 2 * (self.world * self.B * self.T + 1))
                self.tokens = np.random.default_rng(self.seed).integers(0, VOCAB_SIZE, n, dtype=np.uint16)
            else:
                self.tokens = read_vocab_shard(self.files[shard])
        self.shard, self.position = shard, position

    def state(self):
        """(shard, p): where the next step's rank 0 batch starts, for checkpoints."""
        return self.shard, self.position

    def next_batch(self):
        B, T = self.B, self.T
        start = self.position + self.rank * B * T
        buf = np.asarray(self.tokens[start: start + B * T + 1], dtype=np.int32)
        x, y = buf[:-1].reshape(B, T), buf[1:].reshape(B, T)  # (B, T) inputs, (B, T) targets
        self.position += self.world * B * T
        if self.position + self.world * B * T + 1 > len(self.tokens):  # the next shard, wrapping around
            self.set_state((self.shard + 1) % (len(self.files) if self.files else 1), 0)
        return x, y


# --shuffle: llm.c's own Mersenne Twister (llmc/rand.h) and shuffled order (llmc/dataloader.h)

SHUFFLE_SEED = 42  # llm.c seeds rank r's shuffle with 42 + r, whatever seeds the rest of the run


def permutation_picks(n, rng):
    """llm.c's random_permutation of n items: for i = n-1 down to 1, the j (a draw mod i+1) that item i swaps with."""
    # rng: numpy's legacy RandomState(seed) is llm.c's MT19937 seeded as init_genrand; a full-range randint its output
    return rng.randint(0, 2**32, max(n - 1, 0), dtype=np.uint32) % np.arange(n, 1, -1, dtype=np.uint32)


def permute(items, picks):
    """Shuffles the list `items` in place by permutation_picks' swaps."""
    for i, j in zip(range(len(items) - 1, 0, -1), picks.tolist()):
        items[i], items[j] = items[j], items[i]


class ShuffledOrder:
    """The (shard, sample) that llm.c's shuffling loader of one rank reads in turn (llmc/dataloader.h)."""
    # an epoch shuffles the last epoch's shard order, then each shard it opens its samples; one generator draws both

    def __init__(self, counts, seed):
        self.counts, self.rng = counts, np.random.RandomState(seed)
        self.order, self.k, self.opened = list(range(len(counts))), len(counts) - 1, -1
        self._move_on()

    def _move_on(self):
        """Opens the next shard, after the last a new epoch's first: its samples' permutation is drawn now."""
        if self.k == len(self.order) - 1:
            permute(self.order, permutation_picks(len(self.order), self.rng))
            self.k = -1
        self.k, self.sample, self.opened = self.k + 1, 0, self.opened + 1
        self.picks, self.samples = permutation_picks(self.counts[self.shard()], self.rng), None

    def shard(self):
        return self.order[self.k]

    def next(self):
        """(shard, sample) to read now; then moves on."""
        if self.samples is None:  # built once a sample is read: skip() passes whole shards without
            self.samples = list(range(self.counts[self.shard()]))
            permute(self.samples, self.picks)
        here = self.shard(), self.samples[self.sample]
        self.skip(1)
        return here

    def skip(self, n):
        """Moves on n samples, as n next() calls do."""
        while n >= self.counts[self.shard()] - self.sample:
            n -= self.counts[self.shard()] - self.sample
            self._move_on()
        self.sample += n

    def state(self):
        """(shards opened before the current one since the run began, samples read of it)."""
        return self.opened, self.sample


class ShuffledLoader:
    """llm.c's loader with should_shuffle, as its ranks first..first+k-1 of `world` read, their rows stacked."""
    # rank g's order seeded 42 + g reads B*T+1 tokens at sample*W*B*T + g*B*T of its shard

    def __init__(self, files, B, T, first, k, world):
        self.files, self.B, self.T, self.first, self.k, self.world = files, B, T, first, k, world
        # samples per shard: llm.c's (tokens - 1) // (W*B*T), the last token only ever a target
        self.counts = [(n - 1) // (world * B * T) for n in shard_lengths(files, world * B * T)]
        self.set_state(0, 0)

    def set_state(self, opened, sample, layout=None):
        """Puts every rank where rank 0's state() was `(opened, sample, layout)`: each replays as many samples."""
        if layout is not None and tuple(layout) != (self.B, self.T, self.world):  # the order is another's
            die(f"--resume: the checkpoint's --shuffle order is that of --batch-size, --seq-len and devices (llm.c's "
                f"ranks) {tuple(layout)}, not this run's {(self.B, self.T, self.world)}: resume with those")
        first, served = ShuffledOrder(self.counts, SHUFFLE_SEED), 0
        while first.opened < opened:  # a whole shard at a time
            served += self.counts[first.shard()]
            first.skip(self.counts[first.shard()])
        if sample >= self.counts[first.shard()]:
            die(f"--resume: the checkpoint is at sample {sample} of train shard {self.files[first.shard()]}, "
                f"which holds {self.counts[first.shard()]} (a different --batch-size or --data than the run had?)")
        self.orders = [ShuffledOrder(self.counts, SHUFFLE_SEED + g) for g in range(self.first, self.first + self.k)]
        for order in self.orders:
            order.skip(served + sample)
        self.tokens = {}  # the shards the ranks read now: file index -> tokens

    def state(self):
        """The first rank's ShuffledOrder.state() and the (B, T, W) of the order: process 0's, what checkpoints keep."""
        return *self.orders[0].state(), (self.B, self.T, self.world)

    def next_batch(self):
        B, T, rows = self.B, self.T, []
        for g, order in enumerate(self.orders, self.first):
            shard, sample = order.next()
            if shard not in self.tokens:
                self.tokens[shard] = read_vocab_shard(self.files[shard])
            start = (sample * self.world + g) * B * T
            rows.append(self.tokens[shard][start: start + B * T + 1])
        self.tokens = {s: t for s, t in self.tokens.items() if s in {o.shard() for o in self.orders}}
        buf = np.stack(rows).astype(np.int32)                                       # (k, B*T+1)
        x = buf[:, :-1].reshape(self.k * B, T)                                      # (k*B, T) inputs
        y = buf[:, 1:].reshape(self.k * B, T)                                       # (k*B, T) targets
        return x, y


def step_batches(loader, grad_accum):
    """The next optimizer step's micro-batches, stacked: x, y (A,B,T) int32."""
    xs, ys = zip(*(loader.next_batch() for _ in range(grad_accum)))
    return np.stack(xs), np.stack(ys)


VAL_BAR_MIN_STEPS = 20  # a validation of more batches than this shows a progress bar (on a terminal)


def val_batches(cfg, loader):
    """Rows counted of each global val batch: the first val_tokens // T sequences, the same at any batch size."""
    rows, batch = cfg.val_tokens // cfg.seq_len, loader.B * loader.world
    counted = [min(batch, rows - first) for first in range(0, rows, batch)]
    if len(counted) <= VAL_BAR_MIN_STEPS or loader.rank != 0:
        return counted
    return tqdm(counted, desc="val", file=sys.stderr, leave=False, dynamic_ncols=True, disable=not sys.stderr.isatty())


def make_loaders(cfg, rows, rank, ranks, loader_state, say):
    """(micro-batches per step, train loader at `loader_state`, val loader) of rank `rank` of `ranks`, `rows` rows."""
    T, (shard, position, *layout) = cfg.seq_len, loader_state
    tokens = cfg.batch_size * T * (rows * ranks // cfg.batch_size)  # one micro-batch on every device
    if cfg.total_batch_size % tokens:
        die(f"--total-batch-size {cfg.total_batch_size} is not a multiple of --batch-size x --seq-len "
            f"x devices = {tokens}")
    train_files, val_files = find_shards(cfg)
    if cfg.eval_only:
        train = None
    elif cfg.shuffle:  # each device of this process is an llm.c rank of --batch-size rows
        per = rows // cfg.batch_size
        train = ShuffledLoader(train_files, cfg.batch_size, T, rank * per, per, ranks * per)
        train.set_state(shard, position, *layout)
    else:
        train, n_shards = DataLoader(train_files, rows, T, rank, ranks, seed=cfg.seed), len(train_files or [None])
        if shard >= n_shards:
            die(f"--resume: the checkpoint is at train shard {shard}, but --data has {n_shards} shards")
        train.set_state(shard, position)
        if position + rows * ranks * T + 1 > len(train.tokens):
            die(f"--resume: the checkpoint's position {position} leaves less than one batch of {rows * ranks * T} "
                f"tokens in train shard {shard} (a different --batch-size or --data than the run had?)")
    validates = cfg.eval_only or cfg.val_every > 0  # else no val loader, and its shards go unchecked
    val = DataLoader(val_files, rows, T, rank, ranks) if val_files and validates else None
    if validates and not val_files:
        if cfg.eval_only and not cfg.hellaswag_every:
            die(f"--eval-only with --hellaswag-every 0 and no val shards in --data {cfg.data}: nothing to evaluate")
        say(f"no validation shards in --data {cfg.data} (give --val-data GLOB): val loss skipped")
    elif validates:  # its --val-tokens in whole batches, none twice
        batch, wanted, sizes = rows * ranks, cfg.val_tokens // T, [len(read_shard(f)) for f in val_files]
        held = sum((n - 1) // (batch * T) for n in sizes) * batch
        if wanted > held:
            die(f"--val-tokens {cfg.val_tokens} asks for {wanted} sequences of {T} tokens, but the val shards "
                f"({len(sizes)} file(s), {sum(sizes)} tokens) hold {held} in this run's batches of {batch} "
                "sequences: lower --val-tokens (or --val-steps)")
    return cfg.total_batch_size // tokens, train, val


def read_weights(path, cfg):
    """(header, params) of a model file of cfg.recipe; another recipe's file, or no regular file, is refused."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:  # absent, a link loop: the path named as a model file
        die(f"model file {path}: {e.strerror}")
    if not stat.S_ISREG(mode):  # reading a FIFO would wait forever
        found = next((os.path.join(path, f) for f in ("model.bin", "model.safetensors")
                      if os.path.isfile(os.path.join(path, f))), None)
        hint = f": a checkpoint directory; give its {found}, or --resume {path}" if found else ""
        die(f"model file {path} is not a regular file{hint}")
    with open(path, "rb") as f:
        head = f.read(9)
        # a safetensors header (its length, then JSON) naming transformers' GPT-2 blocks: h.<i>.attn.c_attn.*
        if head[8:9] == b"{" and b".attn.c_attn." in f.read(min(int.from_bytes(head[:8], "little"), 1 << 24)):
            die(f"{path} is a Hugging Face transformers GPT-2: convert its folder with `python convert_hf.py "
                f"from-hf {os.path.dirname(path) or '.'} -o model.bin`, then --init-from model.bin")
    recipe = RECIPES[cfg.recipe]
    for name, other in RECIPES.items():
        if other is not recipe and other.is_file(head) and not recipe.is_file(head):
            die(f"{path} is {other.file_kind}, the {name} recipe's (--recipe {name}): --recipe {cfg.recipe} "
                f"takes {recipe.file_kind}")
    return recipe.read_file(path)


def save_checkpoint(out_dir, step, params, m, v, loader_state, cfg, spent=0.0):
    """<out_dir>/ckpt_<step>/{the recipe's model file, state.npz}, written to a temporary name, then renamed."""
    final, recipe = os.path.join(out_dir, f"ckpt_{step:07d}"), RECIPES[cfg.recipe]
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while saving this step
    names = list(recipe.shapes(cfg))  # m: every tensor's first moment (AdamW's, Muon's momentum), v: AdamW's second
    state = {f"m.{k}": np.asarray(m[k], np.float32) for k in names}
    state.update({f"v.{k}": np.asarray(v[k], np.float32) for k in names if k in v})
    state.update(zip(("shard", "position", "shuffle_layout"), map(np.int64, loader_state)), step=np.int64(step),
                 seed=np.int64(cfg.seed), time_spent=np.float64(spent), config=np.array(json.dumps(asdict(cfg))))
    try:
        os.makedirs(tmp)
        recipe.write_file(os.path.join(tmp, recipe.model_file), params, cfg)
        with open(os.path.join(tmp, "state.npz"), "wb") as f:
            np.savez(f, **state)
    except OSError as e:  # nothing of this checkpoint is kept; the earlier ones are untouched
        shutil.rmtree(tmp, ignore_errors=True)
        die(write_failure(tmp, e))
    rename_into_place(tmp, final)
    return final


def rename_into_place(tmp, final):
    """Makes the complete checkpoint dir `tmp` the checkpoint `final`, replacing one of the same step whole."""
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)  # left by a save that died between the renames
    # a second Ctrl-C stops at once: not between the renames, which would leave the step's checkpoint .old
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        if os.path.isdir(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def latest_checkpoint(out_dir, needed=("state.npz",)):
    """The newest ckpt_<n> dir in out_dir that holds the files `needed` (newer ones skipped, said), None if none is."""
    found = sorted(d for d in glob.glob(os.path.join(glob.escape(out_dir), "ckpt_*"))
                   if os.path.basename(d)[5:].isdigit())
    newest = found[-1] if found else None
    while found and (missing := [f for f in needed if not os.path.isfile(os.path.join(found[-1], f))]):
        print(f"--resume auto: skipping {found[-1]}, which has no {missing[0]}")
        found.pop()
    if newest and not found:  # pruned, or another trainer's: a run all the same, never one to replace
        die(f"--resume auto: no checkpoint in {out_dir} holds {', '.join(needed)} (pruned? another trainer's?): its "
            f"newest, {newest}, holds {', '.join(sorted(os.listdir(newest))) or 'nothing'}; --force alone starts over")
    return found[-1] if found else None


def resolve_resume(cfg, trains, needed=("state.npz",)):
    """Makes cfg.resume the checkpoint dir holding `needed` to resume; True where --resume auto found none to resume."""
    # then a run that `trains` starts at step 0 (cfg.resume ""), and prepare_out_dir sets the old files aside
    if cfg.resume == "auto":
        found = latest_checkpoint(cfg.out_dir, needed)
        if found is None and not trains:
            die(f"--resume auto: no checkpoint in {cfg.out_dir}")
        cfg.resume = found or ""
        return found is None
    if cfg.resume:
        cfg.resume = os.path.normpath(cfg.resume)  # its folder is os.path.dirname's, even given with a "/"
        missing = [f for f in needed if not os.path.isfile(os.path.join(cfg.resume, f))]
        if missing:
            die(f"--resume {cfg.resume}: not a checkpoint directory (no {', '.join(missing)})")
    return False


def load_checkpoint(path, cfg):
    """(header, params, m, v, state) from a checkpoint dir of cfg.recipe."""
    recipe = RECIPES[cfg.recipe]
    for name, other in RECIPES.items():
        if other.model_file != recipe.model_file and os.path.isfile(os.path.join(path, other.model_file)):
            die(f"--resume {path}: a checkpoint of the {name} recipe ({other.model_file}), not of --recipe "
                f"{cfg.recipe}")
    header, params = read_weights(os.path.join(path, recipe.model_file), cfg)
    muon = recipe.muon_names({k: p.shape for k, p in params.items()})
    adam = [k for k in params if k not in muon]  # v: AdamW's second moments
    state_file, lows = os.path.join(path, "state.npz"), {"step": 1, "shard": 0, "position": 0, "seed": 0}
    try:
        with np.load(state_file) as z:
            missing = [k for k in (*lows, *(f"m.{k}" for k in params), *(f"v.{k}" for k in adam)) if k not in z.files]
            if missing:
                die(f"checkpoint {path} is missing {', '.join(missing[:3])} in state.npz")
            m, v, state = {k: z[f"m.{k}"] for k in params}, {k: z[f"v.{k}"] for k in adam}, {}
            for k, low in lows.items():  # int64, as saved (a seed as --seed takes it); checkpoints start at step 1
                if z[k].shape != () or z[k].dtype.kind not in "iu":
                    die(f"checkpoint {state_file}: {k} is {z[k].dtype} {z[k].shape}, not an integer")
                state[k] = int(z[k])
                if not low <= state[k] < 2**63:
                    die(f"checkpoint {state_file}: {k} is {state[k]}, out of range (must be in [{low}, 2**63))")
            # the run's --shuffle from its config (one written before the flag read in order), its order's (B, T, W)
            state["shuffle"] = "config" in z.files and bool(json.loads(str(z["config"])).get("shuffle"))
            state["layout"] = tuple(z["shuffle_layout"].ravel().tolist()) if "shuffle_layout" in z.files else None
            spent = z["time_spent"] if "time_spent" in z.files else np.float64(0)  # 0: written before it was kept
            if spent.shape != () or spent.dtype.kind != "f" or not 0 <= spent < math.inf:
                die(f"checkpoint {state_file}: time_spent is {spent.dtype} {spent}, not seconds in [0, inf)")
            state["time_spent"] = float(spent)
    # a damaged .npz: not a zip (numpy takes it for a pickle), cut short, a failed CRC or inflate, damaged headers
    except (ValueError, EOFError, OSError, KeyError, NotImplementedError, zipfile.BadZipFile, zlib.error,
            TokenError, AttributeError, TypeError) as e:  # the last two: a config that is JSON but not an object
        detail = (str(e).splitlines() or ["no detail"])[0][:120]
        die(f"checkpoint {state_file} is damaged ({type(e).__name__}: {detail})")
    # a dir named ckpt_<n> must hold step n: --resume auto and the abandoned_ moves go by the names
    name = os.path.basename(os.path.normpath(path))
    if re.fullmatch(r"ckpt_\d+", name) and int(name[5:]) != state["step"]:
        die(f"checkpoint {path} holds step {state['step']}, not the step {int(name[5:])} its name says (renamed or "
            f"copied by hand?): name it ckpt_{state['step']:07d} elsewhere, or remove it")
    for k in params:
        moments = [m[k], v[k]] if k in v else [m[k]]
        if any(t.shape != params[k].shape or t.dtype != np.float32 for t in moments):
            die(f"checkpoint {path}: optimizer state for {k} is {'/'.join(f'{t.dtype} {t.shape}' for t in moments)}, "
                f"the model's float32 {params[k].shape}")
        if not all(np.isfinite(t).all() for t in moments):
            die(f"checkpoint {path}: optimizer state for {k} holds non-finite values (NaN or inf): resume "
                "from an earlier checkpoint")
    return header, params, m, v, state


class RunLock:
    """<out_dir>/.lock, flock'ed by process 0 while this object lives and naming its holder; removed on release."""
    held = None  # weakref.ref to the lock this process holds

    def __init__(self, out):
        earlier = RunLock.held and RunLock.held()
        if earlier is not None:  # an earlier main() of this process, ended (main runs one run at a time)
            earlier.release()
        self.path, self.fd = os.path.join(out, ".lock"), None
        while True:
            # O_NOFOLLOW: a symbolic link is refused, not written through; a dead holder's flock is the kernel's to drop
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                die(f"{self.path} is not a regular file, not the run lock that a trainer writes: remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "a process"
                os.close(fd)
                die(f"--out-dir {out} is in use by another run ({holder}): wait for it to end, stop it, or "
                    "give another --out-dir")
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)  # its holder removed it as we opened it: take the new one
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        except OSError as e:
            self.release()
            die(f"--out-dir: {write_failure(self.path, e)}")
        RunLock.held = weakref.ref(self)

    def release(self):
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.remove(self.path)
            os.close(self.fd)
            self.fd = None

    __del__ = release


def move_aside(out, names, prefix):
    """Moves <out>/<names> into a new folder <out>/<prefix><time>[_n], which it returns."""
    stamp = os.path.join(out, f"{prefix}{datetime.datetime.now():%Y%m%d_%H%M%S}")
    # unique however fast runs follow each other (process 0 holds the out dir's lock)
    aside = next(p for p in (stamp, *(f"{stamp}_{n}" for n in range(2, 1000))) if not os.path.lexists(p))
    os.mkdir(aside)
    for name in names:
        os.replace(os.path.join(out, name), os.path.join(aside, name))
    return aside


def prepare_out_dir(cfg, master, step, restart=False, extras=("profile",)):
    """Makes --out-dir, returning process 0's RunLock; a run there is refused unless resumed or moved (--force)."""
    out = cfg.out_dir

    def held_run():
        run = [os.path.basename(p) for p in sorted(glob.glob(os.path.join(glob.escape(out), "ckpt_*")))]
        return run + [name for name in ("log.jsonl", *extras) if os.path.exists(os.path.join(out, name))]
    if not master:  # process 0 decides: its start event may already be in the log the others would see
        return None
    run = held_run()
    listed = ", ".join(run[:3]) + (", ..." if len(run) > 3 else "")
    if any(name not in extras for name in run):
        if not (cfg.resume or cfg.force or restart):
            die(f"--out-dir {out} already holds a run ({listed}): --resume auto continues it, --force starts over")
        # a checkpoint from elsewhere, or of a branch set aside here, would splice two runs in one log.jsonl
        home = os.path.realpath(os.path.dirname(os.path.abspath(cfg.resume)))
        if cfg.resume and home != os.path.realpath(out):
            aside = os.path.dirname(home) == os.path.realpath(out) and os.path.basename(home).startswith(
                ("abandoned_", "replaced_"))
            whose = (f"a branch set aside in {os.path.dirname(os.path.normpath(cfg.resume))}" if aside else
                     "another out dir")
            die(f"--resume {cfg.resume}: a checkpoint of {whose}, and --out-dir {out} holds another run ({listed}), "
                "whose log.jsonl would then hold both: resume it into a new --out-dir")
    os.makedirs(out, exist_ok=True)
    lock = RunLock(out)  # before anything moves: a live run's files stay where it writes them
    if cfg.resume:  # the log it appends to, before anything moves (--force and a restart move it aside as it is)
        check_log(out)
    # resumed, the checkpoints past its step and their log lines go to abandoned_<time> (unless it trains nothing)
    newer = [n for n in held_run() if n.startswith("ckpt_") and n[5:].isdigit() and int(n[5:]) > step]
    if cfg.resume and not cfg.eval_only and step < cfg.steps and newer:
        aside, log = move_aside(out, newer, "abandoned_"), os.path.join(out, "log.jsonl")
        if os.path.isfile(log):
            kept, cut = [], []
            with open(log, "rb") as f:
                for line in f:  # a line that is no event stays in the live log
                    at = (log_line_event(line) or {}).get("step")
                    (cut if isinstance(at, int) and at > step else kept).append(line)
            for path, lines in ((os.path.join(aside, "log.jsonl"), cut), (log + ".tmp", kept)):
                with open(path, "wb") as f:
                    f.writelines(lines)
            os.replace(log + ".tmp", log)
        print(f"--resume: step {step} is now the live run: the newer {', '.join(newer)} and log lines past step "
              f"{step} moved to {aside}")
    run = held_run()
    moved = (cfg.force or restart) and not cfg.resume and any(name not in extras for name in run)
    aside = move_aside(out, run, "replaced_") if moved else None
    if restart:
        moved_to = f"; the run there, stopped before its first checkpoint, moved to {aside}" if moved else ""
        print(f"--resume auto: no checkpoint in {out}, starting at step 0{moved_to}")
    elif moved:
        print(f"--force: the run in {out} moved to {aside}")
    return lock


def log_line_event(line):
    """The JSON object that a line of log.jsonl (bytes) holds, else None: cut short, damaged, not an object."""
    with contextlib.suppress(ValueError):  # not JSON, or not UTF-8: None
        event = json.loads(line)
        return event if isinstance(event, dict) else None


def check_log(out_dir):
    """Stops the run at a line of <out_dir>/log.jsonl that is no event, naming it; else makes its last line whole."""
    path = os.path.join(out_dir, "log.jsonl")
    with contextlib.suppress(FileNotFoundError), open(path, "rb+") as f:
        *lines, last = f.read().split(b"\n")
        for number, line in enumerate(lines, 1):
            if line.strip() and log_line_event(line) is None:
                die(f"{path} line {number}: not a JSON object ({line[:60]!r}); mend or remove that line")
        if log_line_event(last) is not None:  # a last event whose newline an editor dropped: whole again
            f.write(b"\n")
        else:  # half a line that a kill while appending left, or nothing
            f.truncate(f.tell() - len(last))


def hellaswag_module():
    """hellaswag.py (HellaSwag's data and scoring), which must lie beside the trainer: one line where it does not."""
    try:
        import hellaswag
    except ModuleNotFoundError as e:
        if e.name != "hellaswag":
            raise
        die("HellaSwag needs hellaswag.py beside the trainer (it is in the repository), or --hellaswag-every 0")
    return hellaswag


def sample_encoder(cfg, say):
    """(decode, EOT and --prompt's tokens) of GPT-2's tokenizer: hellaswag.py's, else tiktoken's; else None, said."""
    try:
        import hellaswag
    except ModuleNotFoundError:
        hellaswag = None
    import tiktoken
    try:
        encoder = hellaswag.load_gpt2_encoding(announce=False) if hellaswag else tiktoken.get_encoding("gpt2")
    except (OSError, ValueError, getattr(hellaswag, "EncodingUnavailable", OSError)) as e:
        (die if cfg.sample_only else say)(f"no samples: GPT-2's tokenizer did not load ({str(e).splitlines()[0]})")
        return None
    prompt = [EOT, *encoder.encode_ordinary(cfg.prompt)]
    if len(prompt) >= cfg.block_size:  # no room left for a sampled token
        die(f"--prompt is {len(prompt) - 1} tokens; the model's context of {cfg.block_size} takes {cfg.block_size - 2}")
    return encoder.decode, prompt


def open_run(cfg, explicit, rows, rank, ranks, master, say, any_failed=None):
    """(step, time_spent, params, m, v, grad_accum, train, val, sampler, lock), checked before the out dir changes."""
    try:
        trains = not (cfg.eval_only or cfg.sample_only)
        restart = resolve_resume(cfg, trains)
        recipe, step, loader_state, spent = RECIPES[cfg.recipe], 0, (0, 0), 0.0
        if cfg.resume:
            header, params, m, v, saved = load_checkpoint(cfg.resume, cfg)
            apply_model_header(cfg, header, explicit)
            if explicit.get("seed", saved["seed"]) != saved["seed"]:  # its synthetic data, its samples
                die(f"--seed {explicit['seed']} with --resume: the checkpoint's seed is {saved['seed']}, which a "
                    f"resumed run keeps; leave --seed out, or give {saved['seed']}")
            if cfg.shuffle != saved["shuffle"] and trains:
                said = "shuffled (--shuffle): give --shuffle" if saved["shuffle"] else "in order: leave --shuffle out"
                die(f"--resume {cfg.resume}: the checkpoint's run read its train shards {said}")
            cfg.seed, step, spent = saved["seed"], saved["step"], saved["time_spent"]
            loader_state = saved["shard"], saved["position"], saved["layout"]
        elif cfg.init_from:
            header, params = read_weights(cfg.init_from, cfg)
            apply_model_header(cfg, header, explicit)
        else:
            params = recipe.init(cfg)
        sampler = (cfg.sample_only or cfg.sample_every > 0 and trains) and sample_encoder(cfg, say)
        if cfg.sample_only:  # the weights and the prompt alone: no optimizer state, data or out dir
            return step, spent, params, None, None, 0, None, None, sampler, None
        if not cfg.resume:  # v: AdamW's second moments, of every tensor but Muon's matrices
            muon = recipe.muon_names(recipe.shapes(cfg))
            m = {k: np.zeros_like(p) for k, p in params.items()}
            v = {k: np.zeros_like(p) for k, p in params.items() if k not in muon}
        if cfg.hellaswag_every > 0:
            hellaswag_module()
        grad_accum, train, val = make_loaders(cfg, rows, rank, ranks, loader_state, say)
        lock = prepare_out_dir(cfg, master, step, restart)
        say(f"out dir {cfg.out_dir}: log.jsonl" + ", checkpoints ckpt_*" * bool(cfg.ckpt_every and not cfg.eval_only))
    except (SystemExit, OSError):  # any_failed, a collective of several processes, stops them together
        if any_failed is not None:
            any_failed(True)
        raise
    if any_failed is not None and any_failed(False):
        die(f"process {rank} of {ranks} stops: another process of the run refused to start (process 0's line says why)")
    return step, spent, params, m, v, grad_accum, train, val, sampler, lock

SAMPLE_COUNT = 4
PROFILE_STEPS = 3
PEAK_FLOPS = {  # dense tensor-core peak (bf16, tf32) by GPU name, from the vendors' datasheets; the first match counts
    "H100 PCIe": (756e12, 378e12), "H100 NVL": (835e12, 417.5e12), "H100": (989e12, 494.5e12),  # SXM
    "H200 NVL": (835e12, 417.5e12), "H200": (989e12, 494.5e12),
    "A100": (312e12, 156e12), "L40S": (362e12, 183e12), "4090": (165e12, 82.6e12),
}


def step_flops(cfg, n_params, gpu_name, world):
    """(model FLOPs per token, the dense peak FLOP/s of `world` GPUs named gpu_name or None: no GPU we know)."""
    peaks = [bf16 if cfg.dtype == "bf16" else tf32 for key, (bf16, tf32) in PEAK_FLOPS.items() if key in gpu_name]
    # 6N + 12LCT (PaLM appendix B / nanoGPT); N = parameters without wpe
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len, peaks[0] * world if peaks else None


def logged_evals(out_dir, step):
    """The evaluations ("val_loss", "hellaswag_acc") that <out_dir>/log.jsonl records at `step`."""
    found = set()
    with contextlib.suppress(FileNotFoundError), open(os.path.join(out_dir, "log.jsonl"), "rb") as f:
        for event in filter(None, map(log_line_event, f)):  # check_log stopped a resume at a damaged line
            if event.get("step") == step:
                found.update(k for k in ("val_loss", "hellaswag_acc") if k in event)
    return found


def format_memory(cfg, held, activations, world, optimizers):
    """The start line's bytes per device: the training state `held`, one micro-batch's activations."""
    mb = {k: f"{n / 1e6:.1f} MB" for k, n in held.items()}  # "params": kept bf16 copies; none: the masters serve
    weights = (f"{cfg.dtype} copies {mb['params']} | grads {mb['grads']} | fp32 masters {mb['masters']}"
               if held["params"] else f"fp32 params {mb['masters']} | grads {mb['grads']}")
    return (f"per device: {weights} | {optimizers} moments {mb['moments']} (ZeRO stage {cfg.zero_stage} over "
            f"{world} devices) | activations {activations / 1e6:.1f} MB per micro-batch (--recompute {cfg.recompute})")


def host_memory_available():
    """Bytes this host can give a process without swapping (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def memory_warning(held, activations, world, available):
    """A warning where `world` devices' state and activations exceed the host's `available` bytes, else None."""
    need = (sum(held.values()) + activations) * world  # on the CPU the kernel's kill would say nothing
    if available is None or need <= available:
        return None
    return (f"warning: by the accounting above, {world} device(s) need {need / 1e9:.1f} GB and this host has "
            f"{available / 1e9:.1f} GB available: the kernel may kill the run (try a smaller --batch-size or a "
            "cheaper --recompute)")


def due(every, step, steps):
    return every > 0 and (step % every == 0 or step == steps)


def log_event(out_dir, framework, **record):
    """Appends one JSON object to <out_dir>/log.jsonl (docs/FORMATS.md), with the trainer's `framework` name."""
    path = os.path.join(out_dir, "log.jsonl")
    try:
        with open(path, "a") as f:
            f.write(json.dumps({**record, "framework": framework}) + "\n")
    except OSError as e:  # a write's error names no file; a half line left is cut off on --resume
        die(write_failure(path, e))


def format_mean(times, first, profiled, cfg, flops):
    """The closing line: mean step time, tokens/s and MFU over the steps after the first that were not profiled."""
    kept = [s for s in times if s > first and s not in profiled]
    note = " after the first" + (", not profiled" if profiled else "")
    if not kept:  # over all of them when no other step ran
        kept, note = list(times), ""
    dt = sum(times[s] for s in kept) / len(kept)
    tokens_per_s = cfg.total_batch_size / dt
    mfu = f", mfu {100 * flops[0] * tokens_per_s / flops[1]:.1f}%" if flops[1] else ""
    return f"mean over {len(kept)} step(s){note}: {1000 * dt:.1f} ms, {tokens_per_s:,.0f} tok/s{mfu}"


def report_step(step, cfg, loss, norm, lr, dt, mem, flops, framework, master, say):
    """Prints step's line and (process 0) logs its event; `flops`: (model FLOPs per token, peak FLOP/s or None)."""
    tokens_per_s = cfg.total_batch_size / dt
    mfu = flops[0] * tokens_per_s / flops[1] if flops[1] else None
    measured = ("" if mfu is None else f" | mfu {100 * mfu:.1f}%") + ("" if mem is None else f" | mem {mem:.1f} GB")
    say(f"step {step:5d}/{cfg.steps} | loss {loss:.6f} | norm {norm:.4f} | lr {lr:.4e} | {1000 * dt:.1f} ms | "
        f"{tokens_per_s:,.0f} tok/s{measured}")
    if master:
        log_event(cfg.out_dir, framework, step=step, train_loss=loss, grad_norm=norm, lr=lr, dt_ms=1000 * dt,
                  tokens_per_s=tokens_per_s, mfu=mfu, peak_mem_gb=mem)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C; what schedulers (SLURM, Kubernetes) send before a kill


class StopSignals:
    """While training, the first SIGINT/SIGTERM stops the run at the step's end (`received`); else one stops at once."""

    def __init__(self):
        self.received, self.training, self.master = 0, False, True

    def handle(self, signum, frame):
        name, later = signal.Signals(signum).name, self.training and not self.received
        # before training (startup, --eval-only, --test, --bench-ops) there is nothing of this launch to resume
        hint = "; --resume auto continues from the latest checkpoint" if self.training else ""
        line = (f"{name}: stopping at the end of this step, with a checkpoint ({name} again stops at once)" if later
                else f"{name}: stopped at once{hint}")
        if self.master:  # os.write: print could be inside a print of the interrupted code
            with contextlib.suppress(OSError):  # stderr's reader is gone: the stop goes on without its line
                os.write(2, f"{line}\n".encode())
        if not later:  # exits as a kill does: a SystemExit is lost in a gc callback, teardown segfaults mid-compile
            with contextlib.suppress(RuntimeError, OSError):  # the signal landed inside a print; a full disk
                sys.stdout.flush()
            os._exit(128 + signum)
        self.received = signum


class OutputThatMayClose:
    """sys.stdout or sys.stderr whose writes go to /dev/null once its reader is gone (`| head`, a closed ssh)."""

    def __init__(self, stream):
        self.stream = stream

    def guarded(self, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())  # what the stream still buffers goes there at its next flush
            os.close(null)

    def __getattr__(self, name):  # write and flush guarded, the rest the stream's own
        attr = getattr(self.stream, name)
        return functools.partial(self.guarded, attr) if name in ("write", "flush") else attr


def stops_on_signals(main):
    """main(argv, signals) with StopSignals' handlers, outputs that may close and one line for any OSError."""
    @functools.wraps(main)
    def run(argv=None):
        streams, signals = (sys.stdout, sys.stderr), StopSignals()
        sys.stdout, sys.stderr = OutputThatMayClose(sys.stdout), OutputThatMayClose(sys.stderr)
        on_main = threading.current_thread() is threading.main_thread()  # the only thread that may set handlers
        previous = {s: signal.signal(s, signals.handle) for s in STOP_SIGNALS} if on_main else {}
        try:
            return main(argv, signals)
        except OSError as e:  # the one boundary for the operating system's errors: the file and the reason
            if e.errno in DISK_FULL:
                die(write_failure(e.filename, e))
            die(f"{e.filename}: {e.strerror}" if e.filename else str(e))
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            sys.stdout.flush()  # what they still buffer, while a closed reader is caught
            sys.stderr.flush()
            sys.stdout, sys.stderr = streams
    return run


def stop_on_signal(signum, step, cfg, master):
    """Ends a run that signal `signum` stopped after `step` (its checkpoint written); nothing when signum is 0."""
    if not signum:
        return
    if master:
        saved = "its checkpoint saved" if due(cfg.ckpt_every, step, step) else "no checkpoint (--ckpt-every 0)"
        print(f"{signal.Signals(signum).name}: stopped after step {step} of {cfg.steps}, {saved}; --resume auto "
              "continues", file=sys.stderr)
    raise SystemExit(128 + signum)


# -----------------------------------------------------------------------------
# Shared torch plumbing: processes, ZeRO-1, evaluation
#
# The same in both torch trainers (python tests/sync_copies.py FILE carries an edit made in FILE to both).

FLAT_ALIGN = 16  # every tensor starts 64 bytes into a flat buffer, and every shard is a multiple of 16
CENSUS_SECONDS = 5  # after a failed collective: how long the survivors wait to hear from each other
TORCH_FP8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def flat_layout(shapes, groups, world):
    """({name: first element}, [(first, end) of each group]) of the groups' tensors in one flat buffer."""
    # each tensor from a FLAT_ALIGN boundary, each group padded to a multiple of FLAT_ALIGN x world: equal shards
    starts, spans, size = {}, [], 0
    for names, _ in groups:
        first = size
        for k in names:
            starts[k] = size
            size += -(-math.prod(shapes[k]) // FLAT_ALIGN) * FLAT_ALIGN
        size = -(-size // (FLAT_ALIGN * world)) * FLAT_ALIGN * world
        spans.append((first, size))
    return starts, spans


def flat_views(buffer, starts, shapes, names=PARAM_NAMES, first=0):
    """{name: its tensor, a view into `buffer`}, which may hold only the group that starts at element `first`."""
    return {k: buffer[starts[k] - first:starts[k] - first + math.prod(shapes[k])].view(shapes[k]) for k in names}


def state_layout(groups, muon_names, shapes, world):
    """(groups, starts, spans): flat_layout's of the compute groups, then Muon's matrices (the last group) whole."""
    starts, spans = flat_layout(shapes, groups[:-1] if muon_names else groups, world)
    if muon_names:
        # dealt as the reference's Muon deals them (round-robin, largest first), a process's in its ZeRO-1 shard
        names, first = groups[-1][0], spans[-1][1]
        ends, local = [0] * world, {}
        for i, k in enumerate(sorted(names, key=lambda k: shapes[k], reverse=True)):
            local[k] = (i % world, ends[i % world])
            ends[i % world] += -(-math.prod(shapes[k]) // FLAT_ALIGN) * FLAT_ALIGN
        stretch = max(ends)
        starts.update({k: first + local[k][0] * stretch + local[k][1] for k in names})
        spans.append((first, first + world * stretch))
    return groups, starts, spans


def shard_ranges(starts, shapes, span, rank, world):
    """ZeRO-1: {name: (lo, hi)}, the elements of each tensor of the group over `span` in rank's shard of it."""
    n = (span[1] - span[0]) // world
    first, ranges = span[0] + rank * n, {}
    for k in starts:  # another group's tensors lie outside the span, so outside the shard
        lo, hi = max(starts[k], first), min(starts[k] + math.prod(shapes[k]), first + n)
        if lo < hi:
            ranges[k] = (lo, hi)
    return ranges


def put_batch(x, device):
    """A token batch as an int64 tensor on device, copied from pinned memory without blocking the host."""
    t = torch.from_numpy(np.asarray(x, dtype=np.int64))                           # (..., T)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def to_device(arrays, device):
    """{name: fp32 tensor on device} of numpy arrays: copies, never views, since the optimizer updates them."""
    return {k: torch.tensor(np.asarray(a, np.float32), device=device) for k, a in arrays.items()}


def evaluate_val(row_losses, weights, loader, cfg, device, world):
    """Mean token loss over the val shards' first val_tokens // T sequences, the same at any batch and world size."""
    loader.set_state(0, 0)
    total = torch.zeros((), dtype=torch.float64, device=device)                    # ()
    rows = torch.arange(loader.rank * loader.B, (loader.rank + 1) * loader.B, device=device)  # (B,)
    for counted in val_batches(cfg, loader):
        x, y = loader.next_batch()                                                 # (B,T) each
        losses = row_losses(weights, put_batch(x, device), put_batch(y, device), cfg)  # (B,T)
        total += torch.where(rows < counted, losses.mean(-1).double(), 0.0).sum()
    if world > 1:
        dist.all_reduce(total)
    return total.item() / (cfg.val_tokens // cfg.seq_len)


def setup_device(cfg):
    """(rank, world, device, the run's key-value store or None): a process per GPU (nccl) or CPU share (gloo)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if world > 1:  # processes on one machine split its cores instead of oversubscribing them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    store = None
    if world > 1:
        port = os.environ.get("MASTER_PORT", "")
        if not (os.environ.get("MASTER_ADDR") and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            die(f"$WORLD_SIZE is {world}, but $MASTER_ADDR / $MASTER_PORT ({port!r}: a port in 1-65535) do not "
                "say where process 0 is (launch with torchrun, or set both)")
        # env://'s store, made here to be read after a failure (under torchrun, its agent serves it)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(port), world,
                              is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                              timeout=datetime.timedelta(minutes=30))
        # rank 0 alone evaluates HellaSwag while the others wait in the next all-reduce: allow for it
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world, timeout=datetime.timedelta(hours=1))
        atexit.register(dist.destroy_process_group)
    # the matmul precision cfg.dtype promises: cuBLAS and cuDNN would otherwise run fp32 matmuls as TF32
    tf32 = cfg.dtype == "bf16"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    return rank, world, device, store


@contextlib.contextmanager
def fail_on_out_of_memory(cfg):
    """Running out of device memory (at compile or run time) is one line, no trace."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        cheaper = "" if cfg.recompute == "block" else " or a cheaper --recompute"
        die(f"out of device memory at --batch-size {cfg.batch_size} --recompute {cfg.recompute} (try a smaller "
            f"batch{cheaper}): {str(e).splitlines()[0][:200]}")


@contextlib.contextmanager
def fail_on_lost_peer(store, rank, world):
    """A collective failed by a lost process: each survivor names it in one line and exits at once (not waiting)."""
    try:
        yield
    except RuntimeError as e:
        tb = e.__traceback__
        while tb.tb_next is not None:  # where it was raised
            tb = tb.tb_next
        if world == 1 or not tb.tb_frame.f_globals.get("__name__", "").startswith("torch.distributed"):
            raise
        # a roll call in the run's store: the ranks silent for CENSUS_SECONDS; None once process 0's store is gone
        try:
            socket.create_connection((store.host, store.port), timeout=2).close()  # writing a closed store warns
            store.set(f"census/{rank}", "alive")
            silent, deadline = list(range(world)), time.monotonic() + CENSUS_SECONDS
            while silent and time.monotonic() < deadline:
                silent = [r for r in range(world) if not store.check([f"census/{r}"])]
                time.sleep(0.1)
            if rank == 0:  # the others read the marks before its store closes
                time.sleep(1)
        except (OSError, RuntimeError, dist.DistError):
            silent = None
        if silent == []:
            raise
        who = ", ".join(map(str, silent)) if silent else "0 (its store is gone)"
        os.write(2, f"error: lost process {who} of {world}: it stopped or was killed, so process {rank} stops "
                    "too; `--resume auto` continues the run from its latest checkpoint\n".encode())
        os._exit(1)


def sharded_state(state, params, m, v, shapes, layout, muon_names, device, rank, world):
    """ZeRO-1: per group of `layout`, a process keeps 1/world of the fp32 masters, m, v and summed gradients."""
    groups, starts, spans = layout
    muon = set(muon_names)
    state.update(groups=[], weights={}, shard_params={}, shard_grads={}, shard_copies={}, m={}, v={})
    for (names, dtype), (first, end) in zip(groups, spans):
        n = (end - first) // world
        own = first + rank * n  # this process's shard: elements [own, own + n) of the layout
        weights = torch.zeros(end - first, dtype=dtype, device=device)             # (N,)
        state["weights"].update(flat_views(weights, starts, shapes, names, first))
        for k in names:
            state["weights"][k].copy_(torch.from_numpy(np.asarray(params[k], np.float32)))
        zeros = functools.partial(torch.zeros, n, dtype=torch.float32, device=device)
        group = {"span": (first, end), "names": names, "weights": weights, "m": zeros(),
                 "own_weights": weights[own - first:own - first + n]}              # (S,) a view
        # fp32 weights are their own masters; one process alone reduces into its gradient buffer itself
        group["params"] = group["own_weights"] if dtype == torch.float32 else zeros()  # (S,)
        group["grads"] = state["grad_buffer"][first:end] if world == 1 else zeros()    # (S,)
        if not muon.intersection(names):  # Muon keeps one buffer
            group["v"] = zeros()                                                   # (S,)
        # each tensor's piece of the shard goes into the state's dict `into`, filled from `sources`' arrays
        into, sources = {"params": "shard_params", "grads": "shard_grads", "m": "m", "v": "v"}, {"m": m, "v": v}
        if dtype != torch.float32:  # a bf16 group's masters start from params; its update refreshes its copies
            into["own_weights"], sources["params"] = "shard_copies", params
        for k, (lo, hi) in shard_ranges(starts, shapes, (first, end), rank, world).items():
            for name in into.keys() & group.keys():
                piece = group[name][lo - own:hi - own]                             # (hi-lo,)
                if name in sources:
                    flat = np.asarray(sources[name][k], np.float32).reshape(-1)
                    piece.copy_(torch.from_numpy(flat[lo - starts[k]:hi - starts[k]].copy()))
                state[into[name]][k] = piece.view(shapes[k]) if k in muon else piece  # Muon's whole, shaped
        state["groups"].append(group)
    state["shard_copies"] = state["shard_copies"] or None
    return state


def evaluate_hellaswag(row_losses_fn, params, cfg, device):
    """(acc, acc_norm) through hellaswag.evaluate, rows fitted to the context by hellaswag.in_context."""
    def padded_losses(x, y):                                                       # (4, width) int64 each
        return row_losses_fn(params, put_batch(x, device), put_batch(y, device), cfg).cpu().numpy()
    hellaswag = hellaswag_module()
    return hellaswag.evaluate(hellaswag.in_context(padded_losses, cfg.block_size), limit=cfg.hellaswag_limit)


def peak_memory_gb(device):
    """Peak GB allocated by torch's caching allocator on the GPU; None on the CPU, where torch keeps no count."""
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def state_bytes(zero_stage, shapes, layout, muon_names, world):
    """Bytes of bf16 `params`, `grads`, fp32 `masters` and `moments` that one process holds (docs/FORMATS.md)."""
    groups, _, spans = layout
    muon = set(muon_names)
    size = spans[-1][1]
    if zero_stage == 0:
        numel = {k: math.prod(s) for k, s in shapes.items()}
        copied = sum(numel[k] for names, dtype in groups if dtype != torch.float32 for k in names)
        return {"params": 2 * copied, "grads": 4 * size, "masters": 4 * sum(numel.values()),
                "moments": sum((4 if k in muon else 8) * n for k, n in numel.items())}
    lengths = [(end - first, dtype, bool(muon.intersection(names)))
               for (names, dtype), (first, end) in zip(groups, spans)]
    return {"params": sum(2 * n for n, dtype, _ in lengths if dtype != torch.float32),
            "grads": 4 * size + (4 * size // world if world > 1 else 0),  # one process reduces in place
            "masters": sum(4 * (n if dtype == torch.float32 else n // world) for n, dtype, _ in lengths),
            "moments": sum((4 if is_muon else 8) * n // world for n, _, is_muon in lengths)}


def checkpoint_if_due(state, step, last, loader, cfg, recipe, world, master, say, spent):
    """Step's checkpoint where --ckpt-every (or the last step, `last`) asks: gathered by all, written by process 0."""
    if not due(cfg.ckpt_every, step, last):
        return
    if cfg.zero_stage == 0:
        full = state["params"], state["m"], state["v"]
    else:  # the shards of the masters and moments, all-gathered group by group (Muon's has no v)
        full = []
        for name in ("params", "m", "v"):
            buffer, groups = torch.empty_like(state["grad_buffer"]), [g for g in state["groups"] if name in g]
            for group in groups:
                if world > 1:
                    dist.all_gather_single(buffer[slice(*group["span"])], group[name])
                else:
                    buffer[slice(*group["span"])].copy_(group[name])
            names = [k for group in groups for k in group["names"]]
            full.append(flat_views(buffer, state["starts"], recipe.shapes(cfg), names))
    if master:
        full = [{k: t.detach().float().cpu().numpy() for k, t in tensors.items()} for tensors in full]
        say(f"saved {save_checkpoint(cfg.out_dir, step, *full, loader.state(), cfg, spent)}")
    if world > 1:
        dist.barrier()


def say_samples(weights, step, cfg, device, sampler, say):
    """Prints generate's rows after EOT (the prompt, then the model's tokens), drawn with (--seed, step)'s generator."""
    seed = int(np.random.SeedSequence([cfg.seed, step]).generate_state(1)[0])
    generator = torch.Generator(device=device).manual_seed(seed)  # (--seed, step)'s: as an uninterrupted run's
    for i, row in enumerate(generate(weights, generator, cfg, sampler[1]).tolist()):
        say(f"sample {i}: {sampler[0](row[1:])!r}")


# -----------------------------------------------------------------------------
# Main

@stops_on_signals
def main(argv, signals):
    cfg, explicit = parse_args(argv)
    dtype = default_dtype(cfg, gpu=torch.cuda.is_available() or bool(cfg.compile_for))  # or --compile-for's GPU
    recipe = RECIPES[cfg.recipe]
    if cfg.test:
        run_self_test(cfg)
        return
    if cfg.compile_for:
        compile_for(cfg)
        return
    ops = backend_ops(cfg.backend, cfg.recipe)
    if cfg.backend == "triton" and INTERPRET and cfg.dtype == "bf16":
        die("backend triton under TRITON_INTERPRET=1 runs fp32 only (the interpreter's bf16 dots are wrong): "
            "add --dtype fp32, or run on a GPU")
    framework = f"{FRAMEWORK}-{cfg.backend}"
    rank, world, device, store = setup_device(cfg)
    if cfg.bench_ops:
        bench_ops(cfg, ops, device)
        return
    master = signals.master = rank == 0
    say = print if master else (lambda *args, **kwargs: None)

    # weights, optimizer state, data (each process reads B rows of a micro-batch) and the locked out dir
    def any_failed(failed):  # True in every process when any passes True
        flag = torch.tensor([int(failed)], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
    step, spent, params, m, v, grad_accum, train_loader, val_loader, sampler, lock = open_run(  # noqa: F841
        cfg, explicit, cfg.batch_size, rank, world, master, say, any_failed if world > 1 else None)

    # devices: what each process holds depends on --zero-stage (make_state)
    if cfg.sample_only:  # the weights as the run computes with them: no optimizer state
        weights = {k: t.to(compute_dtype(cfg)) for k, t in to_device(params, device).items()}
        return say_samples(weights, step, cfg, device, sampler, say)
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
        log_event(cfg.out_dir, framework, event="start", step=step, devices=world, state_bytes=held,  # docs/FORMATS.md
                  activation_bytes=activations, config=dict(vars(cfg)))

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
        if cfg.resume:  # a run killed between a checkpoint and its evaluations runs those log.jsonl lacks
            logged = logged_evals(cfg.out_dir, step) if master else set()
            missing = [due(cfg.val_every, step, cfg.steps) and "val_loss" not in logged,
                       due(cfg.hellaswag_every, step, cfg.steps) and "hellaswag_acc" not in logged]
            if world > 1:  # process 0's log decides: all run the same evaluations
                dist.broadcast_object_list(missing, src=0)
            run_evals(step, *missing)
        if step >= cfg.steps:
            say(f"the checkpoint is at step {step} and --steps is {cfg.steps}: nothing to train")
            return
        if 0 < cfg.time_budget <= spent:  # the budget is the run's, as its steps are: earlier launches spent it
            say(f"the run's steps took {spent:.1f} s of --time-budget {cfg.time_budget:g} s: nothing to train")
            return

        flops = step_flops(cfg, n_params, device_kind if device.type == "cuda" else "", world)
        absent = ([f"mfu (no peak FLOP/s known for {device_kind})"] * (flops[1] is None)
                  + ["mem (no memory statistics)"] * (peak_memory_gb(device) is None))
        if absent:
            say(f"step lines without {' and '.join(absent)}")
        first = step + 1
        profile_steps = range(min(first + 1, cfg.steps), min(first + PROFILE_STEPS, cfg.steps) + 1)
        profile = None
        times = {}  # step -> seconds
        signals.training = True  # from here a signal stops the run at the end of a step
        for step in range(first, cfg.steps + 1):
            if cfg.profile and step == profile_steps[0]:
                profile = start_profile(ops, device)
            t0 = time.perf_counter()
            x, y = step_batches(train_loader, grad_accum)  # (A, B, T) each
            xs, ys = put_batch(x, device), put_batch(y, device)
            loss, norm = train_step(state, xs, ys, step, cfg, profile["ops"] if profile else ops, world)
            times[step] = dt = time.perf_counter() - t0  # train_step waited for the device: the whole step
            spent += dt  # the run's step time, its earlier launches' too: what --time-budget counts
            if not (math.isfinite(loss) and math.isfinite(norm)):  # the same in every process: stopped before the log
                latest = sorted(glob.glob(os.path.join(glob.escape(cfg.out_dir), "ckpt_*[0-9]")))
                kept = f"{latest[-1]} stays the latest checkpoint" if latest else "no checkpoint was written"
                die(f"step {step}: loss {loss}, grad norm {norm}: the run diverged (try a lower --lr or a "
                    f"--grad-clip); stopped before logging or saving this step, {kept}")
            # --time-budget and signals: all processes must stop at the same step
            budget_spent = bool(cfg.time_budget) and spent >= cfg.time_budget
            signum = signals.received
            if world > 1:
                flags = torch.tensor([int(budget_spent and rank == 0), signum], dtype=torch.int64, device=device)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # process 0's clock, a signal to any process
                budget_spent, signum = flags.tolist()
            last = step if budget_spent or signum else cfg.steps
            if step == first:  # its peak memory holds the autotuner's copies of the buffers it tunes
                costs = "kernel compilation and autotuning" if cfg.backend == "triton" else "start-up"
                memory = ", and peak memory counts from the next step" if device.type == "cuda" else ""
                say(f"step {first} holds one-off costs ({costs}): the final mean leaves it out{memory}")
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
            if profile and step == profile_steps[-1]:
                finish_profile(profile, profile_steps, [1000 * times[s] for s in profile_steps], weights,
                                     xs[0], cfg, ops, device, rank, master)
                profile = None
            report_step(step, cfg, loss, norm, recipe.lr_at(step - 1, cfg), dt, peak_memory_gb(device), flops,
                        framework, master, say)
            # the checkpoint before a signal's stop and the evaluations (--resume runs those log.jsonl lacks)
            checkpoint_if_due(state, step, last, train_loader, cfg, recipe, world, master, say, spent)
            stop_on_signal(signum, step, cfg, master)
            run_evals(step, due(cfg.val_every, step, last), due(cfg.hellaswag_every, step, last))
            if sampler and master and due(cfg.sample_every, step, last):
                say_samples(weights, step, cfg, device, sampler, say)
            if budget_spent:
                say(f"--time-budget {cfg.time_budget:g} s reached: stopped after step {step} of {cfg.steps}")
                break

    mem = peak_memory_gb(device)
    steady = " (steady state)" if len(times) > 1 else ""
    say(format_mean(times, first, profile_steps if cfg.profile else (), cfg, flops)
        + ("" if mem is None else f" | peak memory {mem:.2f} GB{steady}"))


# -----------------------------------------------------------------------------
# Triton kernels: memory-bound ops
#
# N = B*T rows, C channels, `dt` the compute dtype. Arithmetic in fp32, each result rounded once when stored;
# every load and store masked; row offsets int64 (N*Vp passes 2**31). Deterministic: no floating-point atomics,
# and each reduction partitioned by the shapes and block sizes alone (sized for the H100; --bench-ops times them).

ROW_TILE = 4096         # elements per program in the row kernels: 4 rows of a 1024-wide block at C=768,
ROW_WARPS = 8           # ... 16 per thread, two 16-byte bf16 vectors per tensor per thread
LN_BWD_PROGRAMS = 256   # LayerNorm backward: 256 programs (~2 per SM), each looping over N/256 rows,
LN_BWD_TILE = 2048      # ... 2 rows of a 1024-wide block per step: 16 elements per thread with 4 warps,
LN_BWD_WARPS = 4        # ... 126 registers (up to 4 programs per SM: all 256 are resident at once) ...
LN_BWD_STAGES = 3       # ... and 2 steps (2 x 12 KB of dy, x, dres) loading while one is computed
LN_REDUCE_BLOCK_P = 256  # the dgamma/dbeta reduce: all (<= 256) partials of 16 channels at once, 48
LN_REDUCE_BLOCK_C = 16   # ... programs at C = 768 reading the 1.5 MB of partials from L2
ELEM_BLOCK = 4096       # activations: 16 elements per thread with 8 warps, 12k programs at 16k x 3072
ELEM_WARPS = 8

# cross-entropy: a row of 50304 logits in 13 steps, 16 per thread with 8 warps; the interpreter: one step
CE_BLOCK_V = 1 << 16 if INTERPRET else 4096
CE_WARPS = 8
ENC_SORT_BLOCK_N = 16   # embedding sort: (16 rows, 256 rows) compare tiles, 512 programs at N = 8k, 32
ENC_SORT_BLOCK_M = 256  # ... counts per thread with 4 warps (a multiple of ENC_SORT_BLOCK_N)
ENC_SORT_STAGES = 3
ENC_SLOTS = 16          # embedding wte reduce: 16 sorted rows per program (tl.dot needs >= 16) ...
ENC_BLOCK_C = 256       # ... over 256 channels, 1536 programs at N = 8k, C = 768, 8 warps: 74
ENC_WARPS = 8           # ... registers (152 with 4 warps)
ENC_CARRY_TILES = 16    # runs longer than a tile: the partial sums of 16 following tiles per step
ENC_WPE_BLOCK_T = 8     # wpe reduce: (8 positions, 256 channels) per program, pipelined over the batch
ENC_WPE_STAGES = 3

# multi-tensor kernels: elements per program (8 blocks of MT_BLOCK); the interpreter: one wide block
MT_CHUNK = 1 << 16 if INTERPRET else 16384
MT_BLOCK = 1 << 16 if INTERPRET else 2048
MT_WARPS = 8
NORM_STAGES = 3         # global norm: 2 blocks (16 KB) in flight per program
NORM_FINISH_BLOCK = 8192  # the norm's partials in one step (7.6k chunks at d12)
NORM_FINISH_WARPS = 8


def _row_blocks(C, tile=ROW_TILE):
    """(BLOCK_C, BLOCK_ROWS) for a kernel that keeps whole rows of C channels in a tile of `tile` elements."""
    block_c = triton.next_power_of_2(C)
    return block_c, max(1, tile // block_c)


# --- Embedding: x[b, t] = wte[idx[b, t]] + wpe[t] (the speedrun model's: table[idx[b, t]], no positions) ---

@triton.jit
def _encoder_forward_kernel(idx_ptr, wte_ptr, wpe_ptr, out_ptr, N, T, C, HAS_WPE: tl.constexpr,
                            BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_ROWS
    rows = tl.arange(0, BLOCK_ROWS)                                                 # (R,) local rows
    cols = tl.arange(0, BLOCK_C)                                                    # (BC,)
    row_mask = rows < N - row0
    mask = row_mask[:, None] & (cols < C)[None, :]                                  # (R, BC)
    tok = tl.load(idx_ptr + row0 + rows, mask=row_mask, other=0)                    # (R,) int64
    x = tl.load(wte_ptr + tok[:, None] * C + cols[None, :], mask=mask, other=0.0)   # (R, BC) dt
    if HAS_WPE:
        pos = (row0 + rows) % T                                                     # (R,) int64
        p = tl.load(wpe_ptr + pos[:, None] * C + cols[None, :], mask=mask, other=0.0)  # (R, BC) dt
        x = x.to(tl.float32) + p.to(tl.float32)                                     # (R, BC) fp32
    tl.store(out_ptr + row0 * C + rows[:, None] * C + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=mask)


def encoder_forward(idx, wte, wpe):
    """idx (B,T) int64, wte (Vp,C) dt, wpe (maxT,C) dt or None -> x (B,T,C) dt."""
    B, T = idx.shape
    C = wte.shape[1]
    x = torch.empty((B, T, C), dtype=wte.dtype, device=wte.device)                  # (B, T, C) dt
    block_c, block_rows = _row_blocks(C)
    grid = (triton.cdiv(B * T, block_rows),)
    _encoder_forward_kernel[grid](idx, wte, wte if wpe is None else wpe, x, B * T, T, C, HAS_WPE=wpe is not None,
                                  BLOCK_ROWS=block_rows, BLOCK_C=block_c, num_warps=ROW_WARPS)
    return x


# dwte[v] += the rows of dx whose token is v, in the same order every run and without atomics, in three
# steps: (1) a stable rank sort of the rows by token (N^2 integer compares: ~8 us at N = 8k); (2) each tile of
# ENC_SLOTS sorted slots sums the pieces of the token runs inside it as one product same (S, S) @ dx (S, BC)
# and adds a run that lies inside the tile to its wte row, a piece of a run crossing the tile's edge to a
# carry buffer; (3) the tile where a crossing run starts adds the carried pieces in tile order.

@triton.jit
def _encoder_sort_kernel(idx_ptr, order_ptr, sorted_tok_ptr, N, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                         STAGES: tl.constexpr):
    # slot[n] = #{m: token_m < token_n} + #{m < n: token_m == token_n}: m-blocks below ours count <=, those
    # above <, our own block compares positions (BLOCK_M is a multiple of BLOCK_N)
    n0 = tl.program_id(0) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)                                                  # (BN,) our rows
    n_mask = n < N
    # masked lanes hold 2**31 - 1, above every token, so they never sort before a real row
    tok_n = tl.load(idx_ptr + n, mask=n_mask, other=2147483647).to(tl.int32)         # (BN,)
    tok_nc = tok_n[:, None]                                                         # (BN, 1)
    m = tl.arange(0, BLOCK_M)                                                       # (BM,)
    count = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)                            # (BN, BM)
    m_own = (n0 // BLOCK_M) * BLOCK_M
    for m0 in tl.range(0, m_own, BLOCK_M, num_stages=STAGES):
        tok_m = tl.load(idx_ptr + m0 + m).to(tl.int32)                              # (BM,) a full block
        count += (tok_m[None, :] <= tok_nc).to(tl.int32)
    tok_m = tl.load(idx_ptr + m_own + m, mask=m < N - m_own, other=2147483647).to(tl.int32)  # (BM,)
    tie_before = (tok_m[None, :] == tok_nc) & ((m_own + m)[None, :] < n[:, None])   # (BN, BM)
    count += ((tok_m[None, :] < tok_nc) | tie_before).to(tl.int32)
    for m0 in tl.range(m_own + BLOCK_M, N, BLOCK_M, num_stages=STAGES):
        tok_m = tl.load(idx_ptr + m0 + m, mask=m < N - m0, other=2147483647).to(tl.int32)  # (BM,)
        count += (tok_m[None, :] < tok_nc).to(tl.int32)
    slot = tl.sum(count, axis=1)                                                    # (BN,) int32
    tl.store(order_ptr + slot, n, mask=n_mask)
    tl.store(sorted_tok_ptr + slot, tok_n, mask=n_mask)


@triton.jit
def _encoder_wte_backward_kernel(dx_ptr, order_ptr, sorted_tok_ptr, dwte_ptr, carry_ptr, N, C,
                                 SLOTS: tl.constexpr, BLOCK_C: tl.constexpr):
    # program (tile, c-block): sorted slots s0 .. s0+SLOTS-1, channels of one c-block
    tile = tl.program_id(0)
    s0 = tile * SLOTS
    i = tl.arange(0, SLOTS)                                                         # (S,)
    valid = i < N - s0
    # tokens of the tile and of its neighbours; -1 past either end matches no token
    tok = tl.load(sorted_tok_ptr + s0 + i, mask=valid, other=-1)                    # (S,) int32
    prev = tl.load(sorted_tok_ptr + s0 + i - 1, mask=valid & (s0 + i > 0), other=-1)  # (S,) int32
    before = tl.load(sorted_tok_ptr + s0 - 1, mask=s0 > 0, other=-1)                # scalar: slot s0-1
    after = tl.load(sorted_tok_ptr + s0 + SLOTS, mask=s0 + SLOTS < N, other=-1)     # scalar: slot s0+S
    rows = tl.load(order_ptr + s0 + i, mask=valid, other=0).to(tl.int64)            # (S,) source rows
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)                       # (BC,)
    col_mask = cols < C
    g = tl.load(dx_ptr + rows[:, None] * C + cols[None, :], mask=valid[:, None] & col_mask[None, :],
                other=0.0).to(tl.float32)                                           # (S, BC)
    first = valid & ((tok != prev) | (i == 0))          # the first slot of each piece in the tile
    inside = first & (tok != before) & (tok != after)   # ... of a run that lies inside the tile
    dst = dwte_ptr + tok.to(tl.int64)[:, None] * C + cols[None, :]                  # (S, BC) fp32 rows
    dst_mask = inside[:, None] & col_mask[None, :]
    old = tl.load(dst, mask=dst_mask, other=0.0)                                    # (S, BC) fp32
    same = (tok[:, None] == tok[None, :]).to(tl.float32)                            # (S, S) 0/1
    piece = tl.dot(same, g, input_precision="ieee")     # (S, BC): every slot gets its piece's sum
    tl.store(dst, old + piece, mask=dst_mask)
    # carries: row 0 takes the first piece when it continues a run from the tile before, row 1 the last
    # piece when it starts a run that goes on into the next tile (a run spanning the tile is a row-0 piece)
    head = first & (tok == before)
    tail = first & (tok == after) & (tok != before)
    carry = carry_ptr + (tile.to(tl.int64) * 2 + tail.to(tl.int64))[:, None] * C + cols[None, :]  # (S, BC)
    tl.store(carry, piece, mask=(head | tail)[:, None] & col_mask[None, :])


@triton.jit
def _encoder_carry_kernel(carry_ptr, sorted_tok_ptr, dwte_ptr, N, C, SLOTS: tl.constexpr,
                          TILES: tl.constexpr, BLOCK_C: tl.constexpr):
    # program (tile, c-block): if a run starts in this tile and goes on into the next, add its piece
    # (carry row 1) and the row-0 pieces of the tiles it covers, in tile order, to the token's wte row
    tile = tl.program_id(0)
    s0 = tile * SLOTS
    last_slot = tl.minimum(s0 + SLOTS, N) - 1
    tok = tl.load(sorted_tok_ptr + last_slot)                                       # scalar int32
    first_tok = tl.load(sorted_tok_ptr + s0)
    before = tl.load(sorted_tok_ptr + s0 - 1, mask=s0 > 0, other=-1)
    after = tl.load(sorted_tok_ptr + s0 + SLOTS, mask=s0 + SLOTS < N, other=-1)
    # the last piece goes on past the tile and does not itself continue a run from before the tile
    if (tok == after) & ((first_tok != tok) | (before != tok)):
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)                   # (BC,)
        col_mask = cols < C
        acc = tl.load(carry_ptr + (tile.to(tl.int64) * 2 + 1) * C + cols, mask=col_mask, other=0.0)  # (BC,)
        k = tl.arange(0, TILES)                                                     # (TB,)
        t0 = tile + 1
        more = t0 * SLOTS < N                                                       # true, as a tensor
        while more:
            t = t0 + k                                                              # (TB,) later tiles
            # a later tile continues the run when its first slot holds the token (a prefix of k: sorted)
            cont = tl.load(sorted_tok_ptr + t * SLOTS, mask=t * SLOTS < N, other=-1) == tok
            part = tl.load(carry_ptr + (t.to(tl.int64) * 2)[:, None] * C + cols[None, :],
                           mask=cont[:, None] & col_mask[None, :], other=0.0)      # (TB, BC) fp32
            acc += tl.sum(part, axis=0)
            more = (tl.sum(cont.to(tl.int32), axis=0) == TILES) & ((t0 + TILES) * SLOTS < N)
            t0 += TILES
        dst = dwte_ptr + tok.to(tl.int64) * C + cols                                # (BC,) fp32 row
        tl.store(dst, tl.load(dst, mask=col_mask, other=0.0) + acc, mask=col_mask)


@triton.jit
def _encoder_wpe_backward_kernel(dx_ptr, dwpe_ptr, B, T, C, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                                 STAGES: tl.constexpr):
    # dwpe[t] += sum over b of dx[b, t], the batch summed in order by the one program owning (t, c)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)                          # (BT,)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)                       # (BC,)
    mask = (t < T)[:, None] & (cols < C)[None, :]                                   # (BT, BC)
    offs = t[:, None] * C + cols[None, :]                                           # (BT, BC) int32
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for _ in tl.range(0, B, num_stages=STAGES):
        acc += tl.load(dx_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dx_ptr += T * C
    tl.store(dwpe_ptr + offs, tl.load(dwpe_ptr + offs, mask=mask, other=0.0) + acc, mask=mask)


def embedding_backward(dx, idx, dtable):
    """dx (B,T,C) dt, idx (B,T) int64; dtable (Vp,C) fp32 += each token's rows of dx."""
    B, T, C = dx.shape
    N = B * T
    order = torch.empty(N, dtype=torch.int32, device=dx.device)       # (N,) rows sorted by (token, row)
    sorted_tok = torch.empty(N, dtype=torch.int32, device=dx.device)  # (N,) their tokens
    tiles = triton.cdiv(N, ENC_SLOTS)
    carry = torch.empty((tiles, 2, C), dtype=torch.float32, device=dx.device)  # (tiles, 2, C) run pieces
    _encoder_sort_kernel[(triton.cdiv(N, ENC_SORT_BLOCK_N),)](
        idx, order, sorted_tok, N, BLOCK_N=ENC_SORT_BLOCK_N, BLOCK_M=ENC_SORT_BLOCK_M, STAGES=ENC_SORT_STAGES)
    n_cblocks = triton.cdiv(C, ENC_BLOCK_C)
    _encoder_wte_backward_kernel[(tiles, n_cblocks)](dx, order, sorted_tok, dtable, carry, N, C, SLOTS=ENC_SLOTS,
                                                     BLOCK_C=ENC_BLOCK_C, num_warps=ENC_WARPS)
    _encoder_carry_kernel[(tiles, n_cblocks)](carry, sorted_tok, dtable, N, C, SLOTS=ENC_SLOTS,
                                              TILES=ENC_CARRY_TILES, BLOCK_C=ENC_BLOCK_C)


def encoder_backward(dx, idx, dwte, dwpe):
    """dx (B,T,C) dt, idx (B,T) int64; dwte (Vp,C) fp32 += token gradients, dwpe (maxT,C) fp32 +=."""
    B, T, C = dx.shape
    embedding_backward(dx, idx, dwte)
    _encoder_wpe_backward_kernel[(triton.cdiv(T, ENC_WPE_BLOCK_T), triton.cdiv(C, ENC_BLOCK_C))](
        dx, dwpe, B, T, C, BLOCK_T=ENC_WPE_BLOCK_T, BLOCK_C=ENC_BLOCK_C, STAGES=ENC_WPE_STAGES)


# --- LayerNorm, and (RMS) the speedrun model's RMSNorm, optionally fused with the residual add before it ---
# RMSNorm: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), no mean, no bias (RMS a constexpr)

@triton.jit
def _layernorm_forward_kernel(x_ptr, h_ptr, w_ptr, b_ptr, xsum_ptr, y_ptr, mean_ptr, rstd_ptr, N, C, eps,
                              HAS_RESIDUAL: tl.constexpr, RMS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                              BLOCK_C: tl.constexpr):
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_ROWS
    rows = tl.arange(0, BLOCK_ROWS)                                                 # (R,) local rows
    cols = tl.arange(0, BLOCK_C)                                                    # (BC,)
    row_mask = rows < N - row0
    col_mask = cols < C
    mask = row_mask[:, None] & col_mask[None, :]                                    # (R, BC)
    base = row0 * C                                                                 # int64 scalar
    offs = rows[:, None] * C + cols[None, :]                                        # (R, BC) int32
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0)                          # (R, BC) dt
    if HAS_RESIDUAL:
        # the sum is rounded to dt before the statistics: the backward recomputes from the stored x
        h = tl.load(h_ptr + base + offs, mask=mask, other=0.0)                      # (R, BC) dt
        x = (x.to(tl.float32) + h.to(tl.float32)).to(xsum_ptr.dtype.element_ty)
        tl.store(xsum_ptr + base + offs, x, mask=mask)
    x = x.to(tl.float32)
    if RMS:
        xc = x                                                                      # (R, BC) masked 0
    else:
        mean = tl.sum(x, axis=1) / C                                                # (R,) fp32
        # padded lanes are zeroed so that they stay out of the variance (C = 768 in a 1024-wide block)
        xc = tl.where(mask, x - mean[:, None], 0.0)                                 # (R, BC)
        tl.store(mean_ptr + row0 + rows, mean, mask=row_mask)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / C + eps)                              # (R,) fp32
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)              # (BC,)
    y = xc * rstd[:, None] * w[None, :]                                             # (R, BC) fp32
    if not RMS:
        y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + base + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row0 + rows, rstd, mask=row_mask)


def _layernorm_forward(x, h, w, b, eps=LN_EPS, rms=False):
    """LayerNorm over the last axis of x, or of x + h: (x + h or None, y, mean, rstd); RMSNorm (rms): no mean."""
    C = x.shape[-1]
    N = x.numel() // C
    xsum = torch.empty_like(x) if h is not None else None                           # (..., C) dt
    y = torch.empty_like(x)                                                         # (..., C) dt
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)          # (...,) fp32
    mean = None if rms else torch.empty_like(rstd)                                  # (...,) fp32
    block_c, block_rows = _row_blocks(C)
    # unused pointers (no residual, RMS's mean and bias) get ones the flags compile out
    _layernorm_forward_kernel[(triton.cdiv(N, block_rows),)](
        x, h if h is not None else x, w, w if rms else b, xsum if h is not None else y, y, rstd if rms else mean, rstd,
        N, C, eps, HAS_RESIDUAL=h is not None, RMS=rms, BLOCK_ROWS=block_rows, BLOCK_C=block_c, num_warps=ROW_WARPS)
    return (xsum, y, rstd) if rms else (xsum, y, mean, rstd)


@triton.jit
def _layernorm_backward_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dres_ptr, dx_ptr, partial_ptr,
                               N, C, rows_per_program, HAS_DRES: tl.constexpr, RMS: tl.constexpr,
                               BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr):
    # dx for a contiguous range of rows, and the range's partial dgamma/dbeta (partial[0, pid], partial[1, pid])
    # that _layernorm_param_grad_kernel sums: no atomics on the weights
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_ROWS)                                                 # (R,)
    cols = tl.arange(0, BLOCK_C)                                                    # (BC,)
    col_mask = cols < C
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)              # (BC,)
    dw_acc = tl.zeros((BLOCK_ROWS, BLOCK_C), dtype=tl.float32)                      # (R, BC)
    db_acc = tl.zeros((BLOCK_ROWS, BLOCK_C), dtype=tl.float32)                      # (R, BC)
    first = pid.to(tl.int64) * rows_per_program
    for r0 in tl.range(0, rows_per_program, BLOCK_ROWS, num_stages=STAGES):
        row0 = first + r0
        row_mask = rows < N - row0
        mask = row_mask[:, None] & col_mask[None, :]                                # (R, BC)
        base = row0 * C                                                             # int64 scalar
        offs = rows[:, None] * C + cols[None, :]                                    # (R, BC) int32
        dy = tl.load(dy_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)    # (R, BC)
        x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)      # (R, BC)
        rstd = tl.load(rstd_ptr + row0 + rows, mask=row_mask, other=0.0)            # (R,)
        # padded lanes load dy = w = 0, so g, g * xhat and dy * xhat are 0 there whatever xhat holds
        if RMS:
            xhat = x * rstd[:, None]                                                # (R, BC)
        else:
            mean = tl.load(mean_ptr + row0 + rows, mask=row_mask, other=0.0)        # (R,)
            xhat = (x - mean[:, None]) * rstd[:, None]                              # (R, BC)
        g = dy * w[None, :]                                                         # (R, BC) dL/dxhat
        # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) = g * rstd - (xhat * c1 + c2): two fused
        # multiply-adds an element (RMSNorm: c2 = 0)
        c1 = tl.sum(g * xhat, axis=1) / C * rstd                                    # (R,) rstd mean(g xhat)
        if RMS:
            dx = g * rstd[:, None] - xhat * c1[:, None]                             # (R, BC)
        else:
            c2 = tl.sum(g, axis=1) / C * rstd                                       # (R,) rstd mean(g)
            dx = g * rstd[:, None] - (xhat * c1[:, None] + c2[:, None])             # (R, BC)
        if HAS_DRES:
            dx += tl.load(dres_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + base + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        db_acc += dy
    P = tl.num_programs(0)
    tl.store(partial_ptr + pid * C + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if not RMS:
        tl.store(partial_ptr + (P + pid) * C + cols, tl.sum(db_acc, axis=0), mask=col_mask)


@triton.jit
def _layernorm_param_grad_kernel(partial_ptr, dw_ptr, db_ptr, P, C, HAS_BIAS: tl.constexpr,
                                 BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # dw[c] += sum over programs of partial[0, :, c] (db from partial[1]), in a fixed order
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)                       # (BC,)
    col_mask = cols < C
    parts = tl.arange(0, BLOCK_P)                                                   # (BP,)
    dw_acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)                         # (BP, BC)
    db_acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)                         # (BP, BC)
    for p0 in range(0, P, BLOCK_P):
        mask = (parts < P - p0)[:, None] & col_mask[None, :]                        # (BP, BC)
        offs = (p0 + parts)[:, None] * C + cols[None, :]                            # (BP, BC)
        dw_acc += tl.load(partial_ptr + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            db_acc += tl.load(partial_ptr + P * C + offs, mask=mask, other=0.0)
    dw = tl.load(dw_ptr + cols, mask=col_mask, other=0.0) + tl.sum(dw_acc, axis=0)  # (BC,)
    tl.store(dw_ptr + cols, dw, mask=col_mask)
    if HAS_BIAS:
        db = tl.load(db_ptr + cols, mask=col_mask, other=0.0) + tl.sum(db_acc, axis=0)  # (BC,)
        tl.store(db_ptr + cols, db, mask=col_mask)


def layernorm_backward(dy, x, w, mean, rstd, dw, db, dres=None):
    """dy, x (N,C) dt; mean, rstd (N) fp32; dw, db (C) fp32 +=; dres -> dx (N,C) dt + dres; no mean, db: RMSNorm."""
    C = x.shape[-1]
    N = x.numel() // C
    dx = torch.empty_like(x)                                                        # (..., C) dt
    block_c, block_rows = _row_blocks(C, LN_BWD_TILE)
    # whole row tiles per program; their count P <= LN_BWD_PROGRAMS, and the summation order, depend on N only
    rows_per_program = block_rows * triton.cdiv(N, block_rows * LN_BWD_PROGRAMS)
    P = triton.cdiv(N, rows_per_program)
    rms = mean is None
    partial = torch.empty((1 if rms else 2, P, C), dtype=torch.float32, device=x.device)  # (2 or 1, P, C)
    _layernorm_backward_kernel[(P,)](dy, x, w, rstd if rms else mean, rstd, dres if dres is not None else dy,
                                     dx, partial, N, C, rows_per_program, HAS_DRES=dres is not None, RMS=rms,
                                     BLOCK_ROWS=block_rows, BLOCK_C=block_c, STAGES=LN_BWD_STAGES,
                                     num_warps=LN_BWD_WARPS)
    _layernorm_param_grad_kernel[(triton.cdiv(C, LN_REDUCE_BLOCK_C),)](
        partial, dw, dw if rms else db, P, C, HAS_BIAS=not rms, BLOCK_P=LN_REDUCE_BLOCK_P, BLOCK_C=LN_REDUCE_BLOCK_C)
    return dx


# --- Activations: tanh-GELU (GPT-2's) and relu(x)^2 (the speedrun's); the forward is fused into the matmul ---

ACTIVATIONS = {None: 0, "gelu": 1, "relu2": 2}  # the ACT codes of the kernels below and of matmul_kernel


@triton.jit
def _activation_kernel(x_ptr, dy_ptr, y_ptr, n, ACT: tl.constexpr, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    # y = act(x), or (BACKWARD) dy * act'(x)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    mask = offs < n - start
    x = tl.load(x_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)          # (BL,)
    if ACT == 1:
        # 1 + tanh(u) and 1 - tanh(u)^2 at u = sqrt(2/pi) (x + 0.044715 x^3), from e = exp(-2|u|): no overflow,
        # and no cancellation where tanh is near -1 or 1
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)                         # (BL,) sqrt(2/pi) = 0.797...
        e = tl.exp(-2.0 * tl.abs(u))                                                # (BL,)
        r = 1.0 / (1.0 + e)                                                         # (BL,)
        one_plus_tanh = tl.where(u >= 0.0, 2.0 * r, 2.0 * e * r)                    # (BL,)
        sech2 = 4.0 * e * r * r                                                     # (BL,)
    if BACKWARD and ACT == 1:
        # d/dx: (1 + tanh)/2 + x/2 * (1 - tanh^2) * du/dx, du/dx = sqrt(2/pi) * (1 + 3 * 0.044715 x^2)
        du = 0.7978845608028654 * (1.0 + 0.134145 * x * x)
        y = 0.5 * one_plus_tanh + 0.5 * x * sech2 * du                              # (BL,)
    elif BACKWARD:
        y = 2.0 * tl.maximum(x, 0.0)                                                # (BL,) d relu(x)^2 / dx
    elif ACT == 1:
        y = 0.5 * x * one_plus_tanh                                                 # (BL,)
    else:
        y = tl.maximum(x, 0.0) * tl.maximum(x, 0.0)                                 # (BL,)
    if BACKWARD:
        y = tl.load(dy_ptr + start + offs, mask=mask, other=0.0).to(tl.float32) * y
    tl.store(y_ptr + start + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _activation_op(pre, activation, dy=None):
    """activation(pre), or with dy its backward dpre, (N,M) dt of pre (and dy) (N,M) dt: "gelu" (tanh) or "relu2"."""
    y = torch.empty_like(pre)                                                       # (N, M) dt
    _activation_kernel[(triton.cdiv(pre.numel(), ELEM_BLOCK),)](pre, pre if dy is None else dy, y, pre.numel(),
                                                                ACT=ACTIVATIONS[activation], BACKWARD=dy is not None,
                                                                BLOCK=ELEM_BLOCK, num_warps=ELEM_WARPS)
    return y


# --- Cross-entropy over the padded vocabulary, loss and dlogits in one kernel ------------------------------
# CAP > 0: of the soft-capped logits c = CAP z / sqrt(z^2 + CAP^2) (the speedrun's head)

@triton.jit
def _softcap(z, CAP: tl.constexpr):
    # (c, dc/dz) of fp32 z
    rs = tl.rsqrt(z * z + CAP * CAP)
    return CAP * z * rs, CAP * CAP * CAP * rs * rs * rs


@triton.jit
def _crossentropy_kernel(logits_ptr, targets_ptr, losses_ptr, V, Vp, dloss, CAP: tl.constexpr, BLOCK_V: tl.constexpr):
    # one row: pass 1 an online logsumexp over the V real logits, pass 2 overwrites the row with
    # dloss * (softmax - onehot), 0 in the padded columns
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * Vp
    cols = tl.arange(0, BLOCK_V)                                                    # (BV,)
    target = tl.load(targets_ptr + row)                                             # scalar int64
    target_logit = tl.load(logits_ptr + target).to(tl.float32)                      # read before pass 2
    if CAP > 0:
        target_logit = _softcap(target_logit, CAP)[0]  # not `_`: a scalar here, a block in the loop won't compile
    run_max = tl.full((), float("-inf"), tl.float32)                                # scalar fp32
    run_sum = tl.full((), 0.0, tl.float32)                                          # scalar fp32
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols                                                               # (BV,)
        x = tl.load(logits_ptr + c, mask=c < Vp, other=0.0).to(tl.float32)         # (BV,)
        if CAP > 0:
            x = _softcap(x, CAP)[0]
        x = tl.where(c < V, x, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(x, axis=0))   # finite: every block holds a real logit
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        run_max = new_max
    lse = run_max + tl.log(run_sum)                                                 # scalar fp32
    for v0 in range(0, Vp, BLOCK_V):
        c = v0 + cols                                                               # (BV,)
        x = tl.load(logits_ptr + c, mask=c < Vp, other=0.0).to(tl.float32)          # (BV,)
        if CAP > 0:
            x, dc = _softcap(x, CAP)
            grad = (tl.exp(x - lse) - (c == target).to(tl.float32)) * dc            # (BV,)
        else:
            grad = tl.exp(x - lse) - (c == target).to(tl.float32)                   # (BV,)
        grad = tl.where(c < V, grad * dloss, 0.0)
        tl.store(logits_ptr + c, grad.to(logits_ptr.dtype.element_ty), mask=c < Vp)
    tl.store(losses_ptr + row, lse - target_logit)


def crossentropy_forward_backward(logits, targets, V, dloss, block_v=CE_BLOCK_V, cap=0.0):
    """losses (N) fp32 of logits (N,Vp) dt (soft-capped: cap > 0); OVERWRITES logits with dloss * their gradient."""
    Vp = logits.shape[-1]
    N = logits.numel() // Vp
    losses = torch.empty(N, dtype=torch.float32, device=logits.device)              # (N,) fp32
    _crossentropy_kernel[(N,)](logits, targets, losses, V, Vp, dloss, CAP=cap, BLOCK_V=block_v, num_warps=CE_WARPS)
    return losses


# --- Global gradient norm and AdamW over all parameters: multi-tensor kernels ----------------------------
# One launch for every tensor: program i finds the tensor that owns chunk i in a small int64 table (element
# count, first chunk, pointers, weight decay); ALIGNED restates the alignment the wrapper checked.


def _tensor_table(pointer_lists, floats=(), chunk=MT_CHUNK):
    """(the table above on the device, chunks, aligned): the first list sets the sizes; None is a null pointer."""
    lead = pointer_lists[0]
    rows, first, aligned = [], 0, True
    for i, t in enumerate(lead):
        ptrs = [0 if lst is None or lst[i] is None else lst[i].data_ptr() for lst in pointer_lists]
        aligned = aligned and t.numel() % 16 == 0 and all(p % 16 == 0 for p in ptrs)
        rows.append([t.numel(), first] + ptrs)
        first += triton.cdiv(t.numel(), chunk)
    table = torch.tensor(rows, dtype=torch.int64).reshape(len(lead), 2 + len(pointer_lists))
    if floats:
        bits = torch.tensor(list(zip(*floats)), dtype=torch.float64).reshape(len(lead), len(floats))
        table = torch.cat([table, bits.view(torch.int64)], dim=1)
    return table.to(lead[0].device), first, aligned


def _check_tensors(name, tensors, dtypes, like):
    """The kernels reach these tensors through raw pointers, so shapes and dtypes are checked here."""
    for t, ref in zip(tensors, like):
        if t.dtype not in dtypes or not t.is_contiguous() or t.shape != ref.shape or t.device != ref.device:
            raise ValueError(f"{name}: expected contiguous {dtypes} tensors shaped like the parameters, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")


@triton.jit
def _owner_row(table_ptr, n_tensors, NCOL: tl.constexpr, BLOCK_T: tl.constexpr):
    # the table row of the tensor that owns this program's chunk (hints on values a jit function returns
    # are dropped: the caller loads sizes and offsets)
    t = tl.arange(0, BLOCK_T)                                                       # (BT,)
    firsts = tl.load(table_ptr + t * NCOL + 1, mask=t < n_tensors, other=2147483647)  # (BT,) int64
    owner = tl.sum((firsts <= tl.program_id(0)).to(tl.int32), axis=0) - 1
    return table_ptr + owner * NCOL


@triton.jit
def _global_norm_partial_kernel(table_ptr, n_tensors, partial_ptr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr,
                                BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, STAGES: tl.constexpr):
    row = _owner_row(table_ptr, n_tensors, 3, BLOCK_T)  # numel, first chunk, grad pointer
    numel = tl.load(row)
    start = (tl.program_id(0) - tl.load(row + 1)) * CHUNK                           # int64 scalar
    g_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        g_ptr = tl.multiple_of(g_ptr, 16)
        numel = tl.multiple_of(numel, 16)
    g_ptr += start
    size = tl.minimum(numel - start, CHUNK)                                         # this chunk's length
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)                                      # (BL,)
    for i0 in tl.range(0, size, BLOCK, num_stages=STAGES):
        g = tl.load(g_ptr + i0 + offs, mask=offs < size - i0, other=0.0)           # (BL,) fp32
        acc += g * g
    tl.store(partial_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _global_norm_finish_kernel(partial_ptr, n, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)                                      # (BL,)
    for i0 in range(0, n, BLOCK):
        acc += tl.load(partial_ptr + i0 + offs, mask=offs < n - i0, other=0.0)
    tl.store(out_ptr, tl.sqrt_rn(tl.sum(acc, axis=0)))


def global_norm(grads, chunk=MT_CHUNK, block=MT_BLOCK):
    """grads: fp32 tensors -> () fp32, their L2 norm; chunk, block: elements per program and loop step."""
    _check_tensors("global_norm grads", grads, (torch.float32,), grads)
    table, chunks, aligned = _tensor_table([grads], chunk=chunk)
    partial = torch.empty(chunks, dtype=torch.float32, device=grads[0].device)      # (chunks,) fp32
    out = torch.empty((), dtype=torch.float32, device=grads[0].device)              # () fp32
    _global_norm_partial_kernel[(chunks,)](table, len(grads), partial, ALIGNED=aligned, CHUNK=chunk,
                                           BLOCK=block, BLOCK_T=triton.next_power_of_2(len(grads)),
                                           STAGES=NORM_STAGES, num_warps=MT_WARPS)
    _global_norm_finish_kernel[(1,)](partial, chunks, out, BLOCK=NORM_FINISH_BLOCK, num_warps=NORM_FINISH_WARPS)
    return out


@triton.jit
def _adamw_kernel(table_ptr, n_tensors, lr, beta1, beta2, eps, bias1, bias2, grad_scale, HAS_COPY: tl.constexpr,
                  ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr):
    # table row: numel, first chunk, param, grad, m, v, copy pointers, weight decay (float64 bits)
    row = _owner_row(table_ptr, n_tensors, 8, BLOCK_T)
    numel = tl.load(row)
    start = (tl.program_id(0) - tl.load(row + 1)) * CHUNK                           # int64 scalar
    p_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    wd = tl.load(row + 7).to(tl.float64, bitcast=True).to(tl.float32)
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        numel = tl.multiple_of(numel, 16)
    if HAS_COPY:
        c_ptr = tl.load(row + 6).to(tl.pointer_type(tl.bfloat16))
        if ALIGNED:
            c_ptr = tl.multiple_of(c_ptr, 16)
    size = tl.minimum(numel - start, CHUNK)                                         # this chunk's length
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    for i0 in range(0, size, BLOCK):
        o = start + i0
        mask = offs < size - i0
        p = tl.load(p_ptr + o + offs, mask=mask, other=0.0)                         # (BL,) fp32
        g = tl.load(g_ptr + o + offs, mask=mask, other=0.0) * grad_scale            # (BL,) fp32
        m = beta1 * tl.load(m_ptr + o + offs, mask=mask, other=0.0) + (1.0 - beta1) * g
        v = beta2 * tl.load(v_ptr + o + offs, mask=mask, other=0.0) + (1.0 - beta2) * g * g
        # llm.c's update with IEEE sqrt and division, as backend torch's
        mhat = tl.div_rn(m, bias1)
        vhat = tl.div_rn(v, bias2)
        p = p - lr * (tl.div_rn(mhat, tl.sqrt_rn(vhat) + eps) + wd * p)
        tl.store(m_ptr + o + offs, m, mask=mask)
        tl.store(v_ptr + o + offs, v, mask=mask)
        tl.store(p_ptr + o + offs, p, mask=mask)
        if HAS_COPY:
            tl.store(c_ptr + o + offs, p.to(c_ptr.dtype.element_ty), mask=mask)


def adamw_update(params, grads, ms, vs, copies, lr, beta1, beta2, eps, weight_decays, step, grad_scale,
                 chunk=MT_CHUNK, block=MT_BLOCK):
    """torch_adamw_update's step (llm.c's) in one launch; `copies` (bf16, or None) get the params rounded."""
    _check_tensors("adamw_update params/grads/m/v", [*params, *grads, *ms, *vs], (torch.float32,), params * 4)
    if copies is not None:
        _check_tensors("adamw_update copies", copies, (torch.bfloat16,), params)
    table, chunks, aligned = _tensor_table([params, grads, ms, vs, copies], floats=[weight_decays], chunk=chunk)
    _adamw_kernel[(chunks,)](table, len(params), lr, beta1, beta2, eps, 1.0 - beta1 ** step, 1.0 - beta2 ** step,
                             grad_scale, HAS_COPY=copies is not None, ALIGNED=aligned, CHUNK=chunk, BLOCK=block,
                             BLOCK_T=triton.next_power_of_2(len(params)), num_warps=MT_WARPS)


# -----------------------------------------------------------------------------
# Triton kernels: matmul with fused epilogues, and dW
#
# Constants are spelled out (compiled Triton reads no Python global); every tl.dot says input_precision="ieee"
# (fp32 stays fp32, no TF32). On a GPU the autotuner's timed choice may differ between processes (dW's SPLIT_K,
# attention's streamed block): a resumed run matches to rounding. The H100's tiles: bench/NOTES.md.


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The (row, column) tile of program `pid`: GROUP_M row tiles sweep the columns together, sharing L2."""
    num_m = (M + BLOCK_M - 1) // BLOCK_M  # (not tl.cdiv: each jit call costs ~1 ms in the interpreter)
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)  # the last group may be short
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


def _num_sms():
    if INTERPRET:
        return 1
    driver = triton.runtime.driver.active  # --compile-for's describes its target
    return driver.utils.get_device_properties(driver.get_current_device())["multiprocessor_count"]


INTERPRETER_BLOCKS = (32, 64, 128, 256, 512)  # the interpreter's block sides (BLOCK_K up to 256)
INTERPRETER_WIDE = 128  # the interpreter's dimensions of at least this size take one wide block


def _matmul_configs(kernel, interpret=INTERPRET):
    """Kernel "mm"'s (forward, dX) or "dw"'s configs: the H100's (dW split 1..8 ways, mm's TMA too) or interpreter's."""
    if interpret:
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 4,
                               **({"SPLIT_K": s} if kernel == "dw" else {"TMA": tma, "PER_SM": 1})},
                              pre_hook=None if kernel == "dw" else _tma_block_shapes)
                for bm in INTERPRETER_BLOCKS for bn in INTERPRETER_BLOCKS for bk in INTERPRETER_BLOCKS[:-1]
                for s in ((1, 2) if kernel == "dw" else (1,)) for tma in ((False,) if kernel == "dw" else
                                                                          (False, True))]
    cfg = lambda bm, bn, bk, stages, warps, maxnreg=None, **kw: triton.Config(  # noqa: E731
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, **kw}, num_stages=stages, num_warps=warps,
        maxnreg=maxnreg, pre_hook=None if kernel == "dw" else _tma_block_shapes)
    if kernel == "dw":
        return [cfg(bm, bn, bk, stages, warps, SPLIT_K=s) for bm, bn, bk, stages, warps in
                ((128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 32, 3, 8),
                 (64, 128, 32, 3, 4)) for s in range(1, 9)]
    # (128 registers a thread: what two 8-warp programs on an SM may use; Triton 3.9 needs 109-126 here)
    pointer = [cfg(*c, TMA=False, PER_SM=1) for c in (
        (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 3, 8, 128), (128, 128, 64, 3, 4),
        (128, 128, 32, 3, 8), (64, 128, 32, 3, 4), (64, 64, 32, 3, 4))]
    tma = [cfg(*c, TMA=True, PER_SM=per_sm) for *c, per_sm in (
        (128, 256, 64, 3, 8, None, 1), (256, 128, 64, 3, 8, None, 1), (128, 128, 64, 4, 8, None, 1),
        (128, 128, 64, 3, 8, 128, 2), (128, 128, 32, 3, 8, None, 1), (64, 128, 32, 3, 4, None, 2))]
    return pointer + tma


def _tma_block_shapes(nargs):
    """Every mm config's pre-hook, the pointer path's too: the descriptors' block shapes (were [1, 1]) to its tiles."""
    if nargs["a_desc"] is None:
        return
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_TRANS"] else [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn]
    nargs["pre_desc"].block_shape = [bm, bn]


def _prune_matmul_configs(configs, named_args, **kwargs):
    """BLOCK_K 64 configs for 16-bit inputs, 32 for fp32; the TMA ones only where the descriptors exist."""
    block_k = 32 if named_args["a_ptr"].element_size() == 4 else 64
    tma = bool(named_args.get("tma_ok"))
    return [c for c in configs if c.kwargs["BLOCK_K"] == block_k and (tma or not c.kwargs.get("TMA"))] or configs


def _interpreter_config(configs, named_args, **kwargs):
    """The interpreter's one config: a dimension of INTERPRETER_WIDE or more in one block (<= 512), smaller in 32s."""
    dims = {"BLOCK_M": named_args["M"], "BLOCK_N": named_args["N"], "BLOCK_K": named_args["K"]}
    want = {k: min(INTERPRETER_BLOCKS[-2 if k == "BLOCK_K" else -1], triton.next_power_of_2(d))
            if d >= INTERPRETER_WIDE else 32 for k, d in dims.items()}
    tma = bool(named_args.get("tma_ok"))  # the matmul's descriptor path wherever it can run
    return [c for c in configs if all(c.kwargs[k] == v for k, v in want.items()) and c.kwargs.get("TMA", False) == tma]


DW_WORKSPACE_BYTES = 64 << 20  # split-K partial sums: at most 64 MiB (qkv's 7 splits at B*T = 16k take 50)


def _dw_workspace(M, N, cfg):
    """(elements of dw's and db's fp32 partial sums, tiles) of one dW config."""
    bm, bn, split = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.kwargs["SPLIT_K"]
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    return tiles * split * bm * bn, tiles * split * bm, tiles


def _dw_cost(M, N, K, sms, cfg):
    """dW's modelled time under cfg in 128x256x64 steps (waves x a chunk's steps + the split sums' round trip)."""
    bm, bn, bk, split = (cfg.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K"))
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    steps = triton.cdiv(triton.cdiv(K, split), bk)
    area = bm * bn / (128 * 256)
    return area * (math.ceil(tiles * split / sms) * steps * bk / 64 + (split > 1) * 1.5 * (split + 1))


def _prune_dw_configs(configs, named_args, **kwargs):
    """Per tile shape, the two split counts _dw_cost ranks best whose partial sums fit DW_WORKSPACE_BYTES."""
    M, N, K = named_args["M"], named_args["N"], named_args["K"]
    sms = _num_sms()
    width = [c for c in _prune_matmul_configs(configs, named_args) if c.kwargs["SPLIT_K"] == 1
             or _dw_workspace(M, N, c)[0] * 4 <= DW_WORKSPACE_BYTES]
    kept = []
    for tile in dict.fromkeys((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) for c in width):
        same = [c for c in width if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) == tile]
        kept += sorted(same, key=lambda c: _dw_cost(M, N, K, sms, c))[:2]
    return kept


def _interpreter_dw_config(configs, named_args, **kwargs):
    """_interpreter_config's blocks, split in 2 once K passes one block (the tests run the split path)."""
    blocks = _interpreter_config(configs, named_args)
    split = 2 if named_args["K"] > blocks[0].kwargs["BLOCK_K"] else 1
    return [c for c in blocks if c.kwargs["SPLIT_K"] == split]


def _autotune_bench(kernel_call, quantiles):
    """The autotuner's timing of one config: ~25 ms of runs (Triton's default spends ~125 ms)."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


MATMUL_PRUNE = {"early_config_prune": _interpreter_config if INTERPRET else _prune_matmul_configs}
DW_PRUNE = {"early_config_prune": _interpreter_dw_config if INTERPRET else _prune_dw_configs}


@triton.jit
def _activation(x, ACT: tl.constexpr, FAST_TANH: tl.constexpr):
    """The matmul epilogue's activation of fp32 x: tanh-GELU (ACT 1) or relu(x)^2 (ACT 2)."""
    if ACT == 1:
        u = 0.7978845608028654 * x * (1.0 + 0.044715 * x * x)
        if FAST_TANH:  # the SFU's tanh.approx (error ~2^-11, under bf16's)
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True,
                                          pack=1)
            y = 0.5 * x * (1.0 + t)
        else:  # x sigmoid(2u)
            y = x / (1.0 + tl.exp2(-2.8853900817779268 * u))
    else:
        r = tl.maximum(x, 0.0)
        y = r * r
    return y


@triton.jit
def _matmul_tile(a_ptr, b_ptr, c_ptr, bias_ptr, pre_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                 stride_cm, stride_cn, scale, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                 FAST_TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """matmul_kernel's pointer path: this program's output tile, the operands read through any strides."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) output rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) output columns
    offs_k = tl.arange(0, BLOCK_K)  # (BK,)
    if HAS_BIAS:  # loaded before the loop, whose time then hides its latency (after it, it stalls the epilogue)
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)  # (BN,)
    # rows/columns past the edge wrap around to valid ones, so the loads in the loop need no M/N mask;
    # the wrapped results are dropped by the masked store
    rows = (offs_m % M).to(tl.int64)  # (BM,) int64: N*Vp logits pass 2**31 elements at batch 48
    cols = (offs_n % N).to(tl.int64)  # (BN,)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BM, BK)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn  # (BK, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (BM, BN)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)  # (BM, BK)
            b = tl.load(b_ptrs)  # (BK, BN)
        else:  # zeros past K add nothing to the dot
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k, other=0.0)  # (BM, BK)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k, other=0.0)  # (BK, BN)
        acc = tl.dot(a, b, acc, input_precision="ieee")  # (BM, BN) fp32
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if SCALED:  # FP8 operands' scales
        acc *= scale
    if HAS_BIAS:
        acc += bias[None, :]  # (BM, BN)
    c_offs = offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn  # (BM, BN)
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)  # (BM, BN)
    if ACT != 0:
        # both outputs rounded first, so the fp32 accumulator is dead before the stores' layout changes
        pre = acc.to(pre_ptr.dtype.element_ty)  # (BM, BN)
        y = _activation(acc, ACT, FAST_TANH).to(c_ptr.dtype.element_ty)  # (BM, BN)
        tl.store(pre_ptr + c_offs, pre, mask=c_mask)
        tl.store(c_ptr + c_offs, y, mask=c_mask)
    else:
        tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _matmul_tma_tiles(a_desc, b_desc, c_desc, pre_desc, bias_ptr, M, N, K, B_TRANS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, ACT: tl.constexpr, FAST_TANH: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """matmul_kernel's TMA path (b_desc: w (N,K) when B_TRANS), persistent: a program walks tiles num_programs apart."""
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    k_steps = (K + BLOCK_K - 1) // BLOCK_K
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (BM, BN)
        for ki in range(k_steps):
            a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])  # (BM, BK)
            if B_TRANS:
                b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K]).T  # (BK, BN)
            else:
                b = b_desc.load([ki * BLOCK_K, pid_n * BLOCK_N])  # (BK, BN)
            acc = tl.dot(a, b, acc, input_precision="ieee")  # (BM, BN) fp32
        if HAS_BIAS:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]  # (BM, BN)
        if ACT != 0:
            pre_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(pre_desc.dtype))
            acc = _activation(acc, ACT, FAST_TANH)  # (BM, BN)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


@triton.autotune(configs=_matmul_configs("mm"), prune_configs_by=MATMUL_PRUNE, do_bench=_autotune_bench,
                 key=["M", "N", "K", "stride_ak", "stride_bk", "tma_ok", "HAS_BIAS", "ACT", "SCALED"])
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, pre_ptr, a_desc, b_desc, c_desc, pre_desc, M, N, K, stride_ab,
                  stride_bb, stride_cb, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, tma_ok, scale,
                  SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, FAST_TANH: tl.constexpr,
                  B_TRANS: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PER_SM: tl.constexpr, EVEN_K: tl.constexpr):
    """c (M,N) = act(a (M,K) @ b (K,N) [x scale] [+ bias]), pre kept; TMA or pointer path by config; batch: axis 1."""
    if TMA:
        _matmul_tma_tiles(a_desc, b_desc, c_desc, pre_desc, bias_ptr, M, N, K, B_TRANS, HAS_BIAS, ACT,
                          FAST_TANH, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:
        batch = tl.program_id(1).to(tl.int64)
        _matmul_tile(a_ptr + batch * stride_ab, b_ptr + batch * stride_bb, c_ptr + batch * stride_cb, bias_ptr,
                     pre_ptr + batch * stride_cb, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                     stride_cn, scale, SCALED, HAS_BIAS, ACT, FAST_TANH, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K)


@triton.jit
def _dw_partial(a_ptr, b_ptr, M, N, K, k_lo, k_hi, pid_m, pid_n, stride_am, stride_ak, stride_bk, stride_bn,
                WITH_DB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr):
    """acc (BM,BN) = a[rows, k_lo:k_hi] @ b[k_lo:k_hi, cols] in fp32; WITH_DB: a's row sums (BM,) as a @ e0."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) output features
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) input features
    offs_k = k_lo + tl.arange(0, BLOCK_K)  # (BK,) rows of dy and x
    rows = (offs_m % M).to(tl.int64)  # (BM,) wrapped as in matmul_kernel
    cols = (offs_n % N).to(tl.int64)  # (BN,)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :].to(tl.int64) * stride_ak  # (BM, BK)
    b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + cols[None, :] * stride_bn  # (BK, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (BM, BN)
    db_acc = tl.zeros((BLOCK_M, 16), dtype=tl.float32)  # (BM, 16) only column 0 is ever nonzero
    if WITH_DB:  # (never with FP8 operands)
        e0 = (tl.arange(0, BLOCK_K)[:, None] >= 0) & (tl.arange(0, 16)[None, :] == 0)  # (BK, 16) column 0 true
        e0 = e0.to(a_ptr.dtype.element_ty)  # (BK, 16) ones in column 0
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)  # (BM, BK)
            b = tl.load(b_ptrs)  # (BK, BN)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - (k - k_lo), other=0.0)  # (BM, BK)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - (k - k_lo), other=0.0)  # (BK, BN)
        acc = tl.dot(a, b, acc, input_precision="ieee")  # (BM, BN) fp32
        if WITH_DB:
            db_acc = tl.dot(a, e0, db_acc, input_precision="ieee")  # (BM, 16)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc, tl.sum(db_acc, axis=1)


@triton.jit
def _dw_accumulate(dw_ptr, db_ptr, acc, db, M, N, pid_m, pid_n, scale, SCALED: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dw[tile] += acc (x scale), and db[rows] += db from the programs of tile column 0."""
    if SCALED:
        acc *= scale
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    dw_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]  # (BM, BN)
    dw_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)  # (BM, BN)
    tl.store(dw_ptr + dw_offs, acc + tl.load(dw_ptr + dw_offs, mask=dw_mask, other=0.0), mask=dw_mask)
    if HAS_BIAS:
        if pid_n == 0:
            tl.store(db_ptr + offs_m, db + tl.load(db_ptr + offs_m, mask=offs_m < M, other=0.0), mask=offs_m < M)


@triton.autotune(configs=_matmul_configs("dw"), key=["M", "N", "K", "HAS_BIAS", "SCALED"], reset_to_zero=["count_ptr"],
                 restore_value=["dw_ptr", "db_ptr"], prune_configs_by=DW_PRUNE, do_bench=_autotune_bench)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def matmul_dw_kernel(a_ptr, b_ptr, dw_ptr, db_ptr, ws_ptr, ws_db_ptr, count_ptr, M, N, K,
                     stride_am, stride_ak, stride_bk, stride_bn, SPLIT_K, scale, SCALED: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """dw (M,N) += dy.T (M,K) @ x (K,N) [x scale], db (M) += dy's column sums; split-K's last arrival sums in order."""
    tile = tl.program_id(0) // SPLIT_K
    split = tl.program_id(0) % SPLIT_K
    pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    chunk = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K  # whole K blocks: K's edge masked
    k_lo = split * chunk
    k_hi = tl.minimum(k_lo + chunk, K)
    if HAS_BIAS:
        if pid_n == 0:  # one tile column is enough: db depends on the output feature only
            acc, db = _dw_partial(a_ptr, b_ptr, M, N, K, k_lo, k_hi, pid_m, pid_n, stride_am, stride_ak,
                                  stride_bk, stride_bn, True, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        else:
            acc, db = _dw_partial(a_ptr, b_ptr, M, N, K, k_lo, k_hi, pid_m, pid_n, stride_am, stride_ak,
                                  stride_bk, stride_bn, False, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    else:
        acc, db = _dw_partial(a_ptr, b_ptr, M, N, K, k_lo, k_hi, pid_m, pid_n, stride_am, stride_ak, stride_bk,
                              stride_bn, False, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    if SPLIT_K == 1:
        _dw_accumulate(dw_ptr, db_ptr, acc, db, M, N, pid_m, pid_n, scale, SCALED, HAS_BIAS, BLOCK_M, BLOCK_N)
    else:
        # whole (BM, BN) partial tiles, contiguous: unmasked full-width stores and loads
        part = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # (BM, BN)
        ws_tile = ws_ptr + tile.to(tl.int64) * SPLIT_K * BLOCK_M * BLOCK_N
        ws_db_tile = ws_db_ptr + tile.to(tl.int64) * SPLIT_K * BLOCK_M
        tl.store(ws_tile + split * BLOCK_M * BLOCK_N + part, acc)
        if HAS_BIAS:
            tl.store(ws_db_tile + split * BLOCK_M + tl.arange(0, BLOCK_M), db)
        # every thread's stores precede the counter's release; the last arriver reads past L1 (.cg)
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + tile, 1) == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (BM, BN)
            db = tl.zeros((BLOCK_M,), dtype=tl.float32)  # (BM,)
            for s in range(0, SPLIT_K):
                acc += tl.load(ws_tile + s * BLOCK_M * BLOCK_N + part, cache_modifier=".cg")
                if HAS_BIAS:
                    db += tl.load(ws_db_tile + s * BLOCK_M + tl.arange(0, BLOCK_M), cache_modifier=".cg")
            _dw_accumulate(dw_ptr, db_ptr, acc, db, M, N, pid_m, pid_n, scale, SCALED, HAS_BIAS, BLOCK_M, BLOCK_N)


def _tma_ready(*tensors):
    """The descriptors' rules: Hopper or later (or the interpreter), 2-D, 16-byte aligned rows, contiguous."""
    hopper = INTERPRET or triton.runtime.driver.active.get_current_target().arch >= 90  # --compile-for's: its target
    return hopper and all(t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
                          and t.stride(0) * t.element_size() % 16 == 0 for t in tensors)


def _matmul(a, b, bias=None, activation=None, scale=None, out_dtype=None):
    """(c (M,N) = act(a (M,K) @ b (K,N) [x scale] [+ bias]) in out_dtype, pre or None), or a batch (n,M,K) @ (n,K,N)."""
    M, K = a.shape[-2:]
    N = b.shape[-1]
    batch = a.shape[0] if a.dim() == 3 else 1
    c = torch.empty((*a.shape[:-1], N), dtype=out_dtype or a.dtype, device=a.device)  # (M,N) or (n,M,N)
    pre = torch.empty((M, N), dtype=a.dtype, device=a.device) if activation else None  # (M,N)
    b_trans = b.stride(-2) == 1 and b.stride(-1) != 1  # the forward's w.T: its descriptor reads w (N,K)
    b_rows = b.transpose(-2, -1) if b_trans else b  # row-major: what the descriptor reads
    descs = [None] * 4
    if a.element_size() > 1 and _tma_ready(a, b_rows, c):
        # block shapes [1, 1] until the chosen config's pre-hook sets its own
        descs = [TensorDescriptor.from_tensor(t, [1, 1]) for t in (a, b_rows, c, c if pre is None else pre)]
    sms = _num_sms()

    def grid(meta):  # the pointer path: a program a tile; the descriptor path: PER_SM programs an SM at most
        tiles = triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])
        return (min(tiles, sms * meta["PER_SM"]), 1) if meta["TMA"] else (tiles, batch)
    # unused pointers (no bias, no activation) get c: never read nor written, since the flags compile them out
    batch_strides = (a.stride(0), b.stride(0), c.stride(0)) if a.dim() == 3 else (0, 0, 0)
    matmul_kernel[grid](a, b, c, c if bias is None else bias, c if pre is None else pre, *descs, M, N, K,
                        *batch_strides, a.stride(-2), a.stride(-1), b.stride(-2), b.stride(-1), c.stride(-2),
                        c.stride(-1), int(descs[0] is not None), scale or 1.0, SCALED=scale is not None,
                        HAS_BIAS=bias is not None, ACT=ACTIVATIONS[activation],
                        FAST_TANH=activation == "gelu" and not INTERPRET and a.dtype != torch.float32, B_TRANS=b_trans)
    return c, pre


@functools.lru_cache(maxsize=None)
def _dw_workspace_sizes(M, N, K, dtype, device):
    """Elements of the split-K buffers (dw, db, counters) for any config kept at this shape; () if none splits."""
    configs = matmul_dw_kernel.configs
    if len(configs) > 1:
        configs = DW_PRUNE["early_config_prune"](
            configs, {"a_ptr": torch.empty(0, dtype=dtype, device=device), "M": M, "N": N, "K": K})
    if not any(c.kwargs["SPLIT_K"] > 1 for c in configs):
        return ()
    sizes = [_dw_workspace(M, N, c) for c in configs]
    return tuple(max(s[i] for s in sizes) for i in range(3))


def _matmul_dw(dy, x, dw, db, scale=None):
    """dw (M,N) += dy.T @ x [x scale: FP8, db None] and db (M) += dy.sum(0), fp32; dy (K,M), x (K,N)."""
    K, M = dy.shape
    N = x.shape[1]
    grid = lambda meta: (  # noqa: E731
        triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]) * meta["SPLIT_K"],)
    # a missing db, and the split-K buffers when none splits, get a 1-element stand-in never touched (a None
    # would not survive the autotuner's restore_value copies on older Triton)
    stand_in = dw.new_empty(1)  # (1,)
    ws = ws_db = count = stand_in
    sizes = _dw_workspace_sizes(M, N, K, dy.dtype, dy.device)
    if sizes:
        ws = dw.new_empty(sizes[0])  # (tiles, SPLIT_K, BM, BN) partial dw
        ws_db = dw.new_empty(sizes[1])  # (tiles, SPLIT_K, BM) partial db
        count = torch.empty(sizes[2], dtype=torch.int32, device=dw.device)  # (tiles,) arrivals
        zero_fill(count)  # our Triton kernel (below), not torch.zeros: no torch op computes in the step
    matmul_dw_kernel[grid](dy, x, dw, stand_in if db is None else db, ws, ws_db, count, M, N, K,
                           dy.stride(1), dy.stride(0), x.stride(0), x.stride(1), scale=scale or 1.0,
                           SCALED=scale is not None, HAS_BIAS=db is not None)


def matmul_forward(x, w, b):
    """y (N,M) = x (N,K) @ w (M,K).T + b (M) (b may be None: the tied lm head)."""
    return _matmul(x, w.t(), b)[0]


def matmul_gelu_forward(x, w, b):
    """(gelu_tanh(pre), pre), pre (N,M) = x @ w.T + b: the MLP's first layer, keeping pre for backward."""
    return _matmul(x, w.t(), b, activation="gelu")


def matmul_backward(dy, x, w, dw, db):
    """dx (N,K) = dy (N,M) @ w (M,K); dw (M,K) += dy.T @ x and db (M) += dy.sum(0), both fp32."""
    dx = _matmul(dy, w)[0]  # (N,K)
    _matmul_dw(dy, x, dw, db)
    return dx


# -----------------------------------------------------------------------------
# Triton kernels: causal flash attention

# q, k, v: three base pointers sharing strides, head h at h*D of a row (qkv's thirds (B,T,3C), or separate
# (B,T,H,D) tensors). Softmax in base 2, qk_scale = scale * log2(e); lse saved in natural log.

def _attention_configs(kernel, interpret=INTERPRET):
    """(BLOCK_M queries, BLOCK_N keys) of kernel "fwd", "dkdv" or "dq": 3 stages for 16-bit inputs, 2 for fp32."""
    if interpret:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32} if kernel == "dkdv" else {"BLOCK_M": 32, "BLOCK_N": 16})]
    sizes16 = {"fwd": [(128, 64, 4), (128, 64, 8), (128, 128, 8), (128, 32, 4), (64, 64, 4), (64, 32, 4)],
               "dkdv": [(64, 128, 8), (32, 128, 8), (64, 64, 4), (32, 64, 4)],
               "dq": [(128, 64, 8), (128, 128, 8), (128, 32, 4), (64, 64, 4), (64, 32, 4)]}[kernel]
    sizes32 = {"fwd": [(64, 32, 8), (32, 32, 4), (64, 16, 4)], "dkdv": [(16, 32, 4)],
               "dq": [(64, 32, 8), (32, 32, 4), (64, 16, 4)]}[kernel]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_stages=stages, num_warps=w)
            for stages, sizes in ((3, sizes16), (2, sizes32)) for bm, bn, w in sizes]


def _prune_attention_configs(configs, named_args, **kwargs):
    """16-bit inputs get the 3-stage (tensor core) configs, fp32 inputs the 2-stage (FMA) ones."""
    stages = 2 if named_args["q_ptr"].element_size() == 4 else 3
    return [c for c in configs if c.num_stages == stages] or configs


ATTENTION_PRUNE = {"early_config_prune": _prune_attention_configs}


@triton.jit
def _load_rows(base, offs_t, stride_t, T, D: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_T: tl.constexpr):
    """Rows offs_t of one head (len(offs_t), BLOCK_D); rows >= T (when CHECK_T) and padded columns read 0."""
    offs_d = tl.arange(0, BLOCK_D)  # (BD,)
    ptrs = base + offs_t[:, None] * stride_t + offs_d[None, :]  # (R, BD)
    if CHECK_T:
        x = tl.load(ptrs, mask=(offs_t[:, None] < T) & (offs_d[None, :] < D), other=0.0)
    elif BLOCK_D == D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
    return x


@triton.jit
def _store_rows(base, x, offs_t, stride_t, T, D: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)  # (BD,)
    ptrs = base + offs_t[:, None] * stride_t + offs_d[None, :]  # (R, BD)
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=(offs_t[:, None] < T) & (offs_d[None, :] < D))


@triton.jit
def _attn_fwd_keys(acc, l_i, m_i, q, k_base, v_base, offs_m, lo, hi, T, stride_t, qk_scale, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr):
    """Online softmax over key blocks [lo, hi) into acc (BM,BD), l_i, m_i (BM,); DIAGONAL masks later keys and T."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BN,) key positions
        k = _load_rows(k_base, offs_n, stride_t, T, D, BLOCK_D, DIAGONAL)  # (BN, BD)
        v = _load_rows(v_base, offs_n, stride_t, T, D, BLOCK_D, DIAGONAL)  # (BN, BD)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # (BM, BN) fp32 unscaled scores
        if DIAGONAL:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))  # (BM, BN)
        # the scale goes onto the row max and into one fused multiply-add per score
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # (BM,) log2 units
        p = tl.exp2(s * qk_scale - m_new[:, None])  # (BM, BN)
        alpha = tl.exp2(m_i - m_new)  # (BM,)
        l_i = l_i * alpha + tl.sum(p, axis=1)  # (BM,)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")  # (BM, BD) fp32
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_attention_configs("fwd"), key=["T", "D"], prune_configs_by=ATTENTION_PRUNE)
@triton.jit
def attn_fwd_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, T, H, qk_scale, stride_b, stride_t, stride_out_b,
                    stride_out_t, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """BLOCK_M queries of one (batch, head), the diagonal masked, later keys skipped; longest blocks first."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_bh = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    b = pid_bh // H
    h = pid_bh % H
    head = b.to(tl.int64) * stride_b + h * D  # int64 offset of the head's row 0 in q, k and v
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BM,) query positions
    q = _load_rows(q_ptr + head, offs_m, stride_t, T, D, BLOCK_D, True)  # (BM, BD)
    # a finite start: a row whose first keys are all masked keeps m = -1e30 and p = exp2(-inf) = 0, no NaN
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # (BM,) running max (log2 units)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # (BM,) running sum of exp2(s - m)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)  # (BM, BD) running p @ v
    acc, l_i, m_i = _attn_fwd_keys(acc, l_i, m_i, q, k_ptr + head, v_ptr + head, offs_m, 0, start_m, T,
                                   stride_t, qk_scale, D, BLOCK_D, BLOCK_M, BLOCK_N, False)
    acc, l_i, m_i = _attn_fwd_keys(acc, l_i, m_i, q, k_ptr + head, v_ptr + head, offs_m, start_m,
                                   tl.minimum(start_m + BLOCK_M, T), T, stride_t, qk_scale, D,
                                   BLOCK_D, BLOCK_M, BLOCK_N, True)
    out_base = out_ptr + b.to(tl.int64) * stride_out_b + h * D
    _store_rows(out_base, acc / l_i[:, None], offs_m, stride_out_t, T, D, BLOCK_D)
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # (BM,) natural-log logsumexp of the scaled scores
    tl.store(lse_ptr + pid_bh * T + offs_m, lse, mask=offs_m < T)


@triton.jit
def attn_bwd_delta_kernel(out_ptr, dout_ptr, delta_ptr, T, H, stride_out_b, stride_out_t, stride_dout_b, stride_dout_t,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta (B,H,T) = rowsum(dout * out) per head, the softmax backward's sum_j p_j dp_j, computed once."""
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    o = _load_rows(out_ptr + b.to(tl.int64) * stride_out_b + h * D, offs_m, stride_out_t, T,
                   D, BLOCK_D, True)  # (BM, BD)
    do = _load_rows(dout_ptr + b.to(tl.int64) * stride_dout_b + h * D, offs_m, stride_dout_t, T,
                    D, BLOCK_D, True)  # (BM, BD)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # (BM,)
    tl.store(delta_ptr + pid_bh * T + offs_m, delta, mask=offs_m < T)


@triton.jit
def _attn_bwd_queries(dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, offs_n, lo, hi, T, stride_t,
                      stride_do_t, qk_scale, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr):
    """dK, dV of one key block over query blocks [lo, hi), transposed (keys x queries): the sums are dots."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)  # (BM,) query positions
        q = _load_rows(q_base, offs_m, stride_t, T, D, BLOCK_D, True)  # (BM, BD)
        do = _load_rows(do_base, offs_m, stride_do_t, T, D, BLOCK_D, True)  # (BM, BD)
        lse2 = tl.load(lse_ptr + offs_m, mask=offs_m < T, other=0.0) * 1.4426950408889634  # (BM,) log2 units
        delta = tl.load(delta_ptr + offs_m, mask=offs_m < T, other=0.0)  # (BM,)
        zeros = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        s_t = tl.dot(k, tl.trans(q), zeros, input_precision="ieee") * qk_scale  # (BN, BM)
        p_t = tl.exp2(s_t - lse2[None, :])  # (BN, BM) the forward's probabilities
        if DIAGONAL:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)  # (BN, BM)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision="ieee")  # (BN, BD)
        dp_t = tl.dot(v, tl.trans(do), zeros, input_precision="ieee")  # (BN, BM)
        ds_t = p_t * (dp_t - delta[None, :])  # (BN, BM)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision="ieee")  # (BN, BD) scaled once at the end
    return dk, dv


@triton.autotune(configs=_attention_configs("dkdv"), key=["T", "D"], prune_configs_by=ATTENTION_PRUNE)
@triton.jit
def attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, T, H, sm_scale,
                         qk_scale, stride_b, stride_t, stride_dout_b, stride_dout_t, D: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """BLOCK_N keys of one (batch, head), dK and dV written once (no atomics), the diagonal queries masked."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0)
    pid_bh = tl.program_id(0)
    start_n = tl.program_id(1) * BLOCK_N
    b = pid_bh // H
    h = pid_bh % H
    head = b.to(tl.int64) * stride_b + h * D  # int64 offset of the head's row 0 in q, k, v and grads
    do_base = dout_ptr + b.to(tl.int64) * stride_dout_b + h * D
    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BN,) key positions
    k = _load_rows(k_ptr + head, offs_n, stride_t, T, D, BLOCK_D, True)  # (BN, BD)
    v = _load_rows(v_ptr + head, offs_n, stride_t, T, D, BLOCK_D, True)  # (BN, BD)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)  # (BN, BD)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)  # (BN, BD)
    lse_row = lse_ptr + pid_bh * T
    delta_row = delta_ptr + pid_bh * T
    diag_hi = tl.minimum(start_n + BLOCK_N, T)
    dk, dv = _attn_bwd_queries(dk, dv, k, v, q_ptr + head, do_base, lse_row, delta_row, offs_n, start_n, diag_hi, T,
                               stride_t, stride_dout_t, qk_scale, D, BLOCK_D, BLOCK_M, BLOCK_N, True)
    dk, dv = _attn_bwd_queries(dk, dv, k, v, q_ptr + head, do_base, lse_row, delta_row, offs_n, diag_hi, T, T, stride_t,
                               stride_dout_t, qk_scale, D, BLOCK_D, BLOCK_M, BLOCK_N, False)
    _store_rows(dk_ptr + head, dk * sm_scale, offs_n, stride_t, T, D, BLOCK_D)
    _store_rows(dv_ptr + head, dv, offs_n, stride_t, T, D, BLOCK_D)


@triton.jit
def _attn_bwd_keys(dq, q, do, lse2, delta, k_base, v_base, offs_m, lo, hi, T, stride_t, qk_scale, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr):
    """dQ of one query block over the key blocks [lo, hi): dS = P * (dP - delta), dQ += dS K."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BN,) key positions
        k = _load_rows(k_base, offs_n, stride_t, T, D, BLOCK_D, DIAGONAL)  # (BN, BD)
        v = _load_rows(v_base, offs_n, stride_t, T, D, BLOCK_D, DIAGONAL)  # (BN, BD)
        zeros = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        s = tl.dot(q, tl.trans(k), zeros, input_precision="ieee") * qk_scale  # (BM, BN) log2 units
        p = tl.exp2(s - lse2[:, None])  # (BM, BN)
        if DIAGONAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)  # (BM, BN)
        dp = tl.dot(do, tl.trans(v), zeros, input_precision="ieee")  # (BM, BN)
        ds = p * (dp - delta[:, None])  # (BM, BN)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")  # (BM, BD)
    return dq


@triton.autotune(configs=_attention_configs("dq"), key=["T", "D"], prune_configs_by=ATTENTION_PRUNE)
@triton.jit
def attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, T, H, sm_scale, qk_scale,
                       stride_b, stride_t, stride_dout_b, stride_dout_t, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """BLOCK_M queries of one (batch, head), dQ written once (P recomputed, no atomics: deterministic)."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_bh = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    b = pid_bh // H
    h = pid_bh % H
    head = b.to(tl.int64) * stride_b + h * D  # int64 offset of the head's row 0 in q, k, v and dq
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BM,) query positions
    q = _load_rows(q_ptr + head, offs_m, stride_t, T, D, BLOCK_D, True)  # (BM, BD)
    do = _load_rows(dout_ptr + b.to(tl.int64) * stride_dout_b + h * D, offs_m, stride_dout_t, T,
                    D, BLOCK_D, True)  # (BM, BD)
    lse2 = tl.load(lse_ptr + pid_bh * T + offs_m, mask=offs_m < T, other=0.0) * 1.4426950408889634  # (BM,)
    delta = tl.load(delta_ptr + pid_bh * T + offs_m, mask=offs_m < T, other=0.0)  # (BM,)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)  # (BM, BD)
    dq = _attn_bwd_keys(dq, q, do, lse2, delta, k_ptr + head, v_ptr + head, offs_m, 0, start_m, T,
                        stride_t, qk_scale, D, BLOCK_D, BLOCK_M, BLOCK_N, False)
    dq = _attn_bwd_keys(dq, q, do, lse2, delta, k_ptr + head, v_ptr + head, offs_m, start_m,
                        tl.minimum(start_m + BLOCK_M, T), T, stride_t, qk_scale, D, BLOCK_D, BLOCK_M, BLOCK_N, True)
    _store_rows(dq_ptr + head, dq * sm_scale, offs_m, stride_t, T, D, BLOCK_D)


ATTN_DELTA_BLOCK = 64  # rows a program in attn_bwd_delta_kernel: memory-bound, no tuning needed


def _head_block(D):
    return max(16, triton.next_power_of_2(D))  # tl.dot needs power-of-2 sides of at least 16


def _flash_forward(q, k, v, B, T, H, D, scale):
    """attn_fwd_kernel: out (B,T,H*D) in q's dtype and lse (B,H,T) fp32."""
    out = torch.empty((B, T, H * D), dtype=q.dtype, device=q.device)  # (B,T,H*D)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)  # (B,H,T)
    grid = lambda meta: (B * H, triton.cdiv(T, meta["BLOCK_M"]))  # noqa: E731
    attn_fwd_kernel[grid](q, k, v, out, lse, T, H, math.log2(math.e) * scale, q.stride(0), q.stride(1),
                          out.stride(0), out.stride(1), D=D, BLOCK_D=_head_block(D))
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, dq, dk, dv, B, T, H, D, scale):
    """dq, dk, dv (like q, k, v) from dout, out (B,T,H*D) and lse (B,H,T): delta, dK/dV, dQ kernels."""
    BD = _head_block(D)
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)  # (B,H,T)
    attn_bwd_delta_kernel[(B * H, triton.cdiv(T, ATTN_DELTA_BLOCK))](
        out, dout, delta, T, H, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), D=D, BLOCK_D=BD,
        BLOCK_M=ATTN_DELTA_BLOCK)
    rest = (T, H, scale, math.log2(math.e) * scale, q.stride(0), q.stride(1), dout.stride(0), dout.stride(1))
    attn_bwd_dkdv_kernel[lambda meta: (B * H, triton.cdiv(T, meta["BLOCK_N"]))](
        q, k, v, dout, lse, delta, dk, dv, *rest, D=D, BLOCK_D=BD)
    attn_bwd_dq_kernel[lambda meta: (B * H, triton.cdiv(T, meta["BLOCK_M"]))](
        q, k, v, dout, lse, delta, dq, *rest, D=D, BLOCK_D=BD)


def _thirds(qkv):
    """The q, k, v (B,T,C) views of the fused projection's rows (B,T,3C), or of its gradient's."""
    C = qkv.shape[-1] // 3
    return qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]


def attention_forward(qkv, n_head):
    """Causal self-attention of qkv (B,T,3C): out (B,T,C) and the row logsumexp lse (B,H,T) fp32."""
    B, T, C3 = qkv.shape
    D = C3 // (3 * n_head)
    return _flash_forward(*_thirds(qkv), B, T, n_head, D, 1.0 / math.sqrt(D))


def attention_backward(dout, qkv, out, lse, n_head):
    """dqkv (B,T,3C) from dout (B,T,C), the forward's qkv, out and lse (B,H,T)."""
    B, T, C3 = qkv.shape
    D = C3 // (3 * n_head)
    dqkv = torch.empty_like(qkv)  # (B,T,3C) qkv's layout: its thirds share the strides of qkv's
    _flash_backward(dout, *_thirds(qkv), out, lse, *_thirds(dqkv), B, T, n_head, D, 1.0 / math.sqrt(D))
    return dqkv


# -----------------------------------------------------------------------------
# Triton kernels: the training step's own

# With these, torch only allocates and makes views in backend triton's step.
STEP_BLOCK = 1 << 16 if INTERPRET else 4096
STEP_WARPS = 8
SUM_BLOCK = 1024   # the loss sum: one program adds a micro-batch's token losses in a fixed order


@triton.jit
def _zero_fill_kernel(x_ptr, n, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    tl.store(x_ptr + start + offs, tl.zeros((BLOCK,), dtype=x_ptr.dtype.element_ty), mask=offs < n - start)


@triton.jit
def _clip_by_norm_kernel(g_ptr, norm_ptr, n, max_norm, BLOCK: tl.constexpr):
    # torch.nn.utils.clip_grad_norm_'s rule, the norm read on the device: scale when max_norm / (norm + 1e-6)
    # is below 1 or NaN (a NaN norm makes every gradient NaN, as torch's clamp does)
    coef = tl.div_rn(max_norm, tl.load(norm_ptr) + 1e-6)                            # scalar fp32
    if (coef < 1.0) | (coef != coef):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offs = tl.arange(0, BLOCK)                                                  # (BL,)
        mask = offs < n - start
        g = tl.load(g_ptr + start + offs, mask=mask, other=0.0)                     # (BL,) fp32
        tl.store(g_ptr + start + offs, g * coef, mask=mask)


@triton.jit
def _sum_into_kernel(x_ptr, n, acc_ptr, scale, BLOCK: tl.constexpr):
    # acc += scale * sum(x), one program, blocks in order: the same bits on every run
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    total = tl.zeros((BLOCK,), dtype=tl.float32)                                    # (BL,)
    for i0 in range(0, n, BLOCK):
        total += tl.load(x_ptr + i0 + offs, mask=offs < n - i0, other=0.0).to(tl.float32)
    tl.store(acc_ptr, tl.load(acc_ptr) + scale * tl.sum(total, axis=0))


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    mask = offs < n - start
    x = tl.load(src_ptr + start + offs, mask=mask)                                  # (BL,)
    tl.store(dst_ptr + start + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


def _flat_check(name, *tensors):
    """The step kernels index raw memory: contiguous tensors on one device only."""
    for t in tensors:
        if not t.is_contiguous() or t.device != tensors[0].device:
            raise ValueError(f"{name}: expected contiguous tensors on one device, got {tuple(t.shape)} with "
                             f"strides {t.stride()} on {t.device}")


def zero_fill(x):
    """x (any shape, contiguous) = 0."""
    _flat_check("zero_fill", x)
    _zero_fill_kernel[(triton.cdiv(x.numel(), STEP_BLOCK),)](x, x.numel(), BLOCK=STEP_BLOCK, num_warps=STEP_WARPS)


def clip_by_norm(g, norm, max_norm):
    """g (fp32, contiguous: all gradients) *= max_norm / (norm + 1e-6) if below 1 or NaN; norm () fp32."""
    _flat_check("clip_by_norm", g, norm)
    _clip_by_norm_kernel[(triton.cdiv(g.numel(), STEP_BLOCK),)](g, norm, g.numel(), max_norm, BLOCK=STEP_BLOCK,
                                                                num_warps=STEP_WARPS)


def sum_into(acc, x, scale):
    """acc () fp32 += scale * sum(x), x (n) fp32."""
    _flat_check("sum_into", acc, x)
    _sum_into_kernel[(1,)](x, x.numel(), acc, scale, BLOCK=SUM_BLOCK, num_warps=STEP_WARPS)


def copy_into(dst, src):
    """dst = src, both contiguous with as many elements (src's values rounded to dst's dtype)."""
    _flat_check("copy_into", dst, src)
    if dst.numel() != src.numel():
        raise ValueError(f"copy_into: {src.numel()} elements into {dst.numel()}")
    _copy_kernel[(triton.cdiv(src.numel(), STEP_BLOCK),)](src, dst, src.numel(), BLOCK=STEP_BLOCK, num_warps=STEP_WARPS)


# -----------------------------------------------------------------------------
# Backend triton: the op interface filled in by the kernels above

TRITON_OPS = op_table("triton", dict(
    encoder_forward=encoder_forward, encoder_backward=encoder_backward,
    layernorm_forward=lambda x, w, b: _layernorm_forward(x, None, w, b)[1:],  # (y, mean, rstd)
    residual_layernorm_forward=_layernorm_forward,  # (x + h, y, mean, rstd)
    layernorm_backward=layernorm_backward,
    matmul_forward=matmul_forward, matmul_gelu_forward=matmul_gelu_forward, matmul_backward=matmul_backward,
    gelu_forward=functools.partial(_activation_op, activation="gelu"),
    gelu_backward=lambda dy, pre: _activation_op(pre, "gelu", dy),
    attention_forward=attention_forward, attention_backward=attention_backward,
    crossentropy_forward_backward=crossentropy_forward_backward, global_norm=global_norm, adamw_update=adamw_update,
    zero_fill=zero_fill, clip_by_norm=clip_by_norm, sum_into=sum_into, copy_into=copy_into,
))


# -----------------------------------------------------------------------------
# Self-test (--test)
#
# Each op at several shapes, then the whole model's loss, logits and gradients, against a reference run in fp64
# on the tested values (autograd for backend torch, backend torch for backend triton).

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


def autograd_layernorm_backward(dy, x, w, mean, rstd, dw, db, dres=None):
    dx, gw, gb = _vjp(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, LN_EPS), (x, w, torch.zeros_like(w)), dy)
    dw += gw
    db += gb
    return dx if dres is None else dx + dres


def autograd_matmul_backward(dy, x, w, dw, db):
    b = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)  # (M,)
    grads = _vjp(F.linear, (x, w) if db is None else (x, w, b), dy)
    dw += grads[1]
    if db is not None:
        db += grads[2]
    return grads[0]


def autograd_attention_forward(qkv, n_head):
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in qkv.split(C, -1))  # (B, H, T, D)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
    s = q @ k.transpose(-1, -2) / math.sqrt(C // n_head)  # (B, H, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=qkv.device).tril()  # (T, T)
    lse = torch.logsumexp(s.masked_fill(~causal, float("-inf")), -1)  # (B, H, T)
    return out.transpose(1, 2).reshape(B, T, C), lse


def autograd_crossentropy_forward_backward(logits, targets, V, dloss):
    z = _leaf(logits)
    with torch.enable_grad():
        losses = F.cross_entropy(z[:, :V], targets, reduction="none")  # (N,)
    logits.copy_(torch.autograd.grad(losses, z, torch.full_like(losses, dloss))[0])
    return losses.detach()


def autograd_adamw_update(params, grads, ms, vs, copies, lr, beta1, beta2, eps, weight_decays, step, grad_scale):
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
    residual_layernorm_forward=lambda res, h, w, b: (res + h, *autograd_layernorm_forward(res + h, w, b)),
    layernorm_backward=autograd_layernorm_backward,
    matmul_forward=F.linear, matmul_backward=autograd_matmul_backward,
    matmul_gelu_forward=lambda x, w, b: (F.gelu(F.linear(x, w, b), approximate="tanh"), F.linear(x, w, b)),
    gelu_forward=lambda pre: F.gelu(pre, approximate="tanh"),
    gelu_backward=lambda dy, pre: _vjp(lambda x: F.gelu(x, approximate="tanh"), (pre,), dy)[0],
    attention_forward=autograd_attention_forward, attention_backward=lambda dout, qkv, out, lse, n_head: _vjp(
        lambda qkv: autograd_attention_forward(qkv, n_head)[0], (qkv,), dout)[0],
    crossentropy_forward_backward=autograd_crossentropy_forward_backward,
    global_norm=lambda grads: torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])),
    adamw_update=autograd_adamw_update,
    zero_fill=lambda x: x.copy_(torch.zeros_like(x)), clip_by_norm=autograd_clip_by_norm,
    sum_into=lambda acc, x, scale: acc.copy_(acc + torch.sum(x) * scale),
    copy_into=lambda dst, src: dst.copy_(src.reshape(dst.shape)),
))


def op_inputs(dt, rdt, device):
    """Random test tensors in dt, first rounded to rdt (the tested dtype): an fp64 reference sees the same values."""
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


def case_activation(ops, r, B, T, C, H, act="gelu"):
    pre = r.rand(B * T, 4 * C, scale=3.0)  # (N, 4C)
    y = getattr(ops, f"{act}_forward")(pre)  # (N, 4C)
    return dict(y=y, dpre=getattr(ops, f"{act}_backward")(r.rand(B * T, 4 * C), pre))


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
        ops.adamw_update(params, grads, ms, vs, copies, 0.01, BETA1, BETA2, EPS, [0.1, 0.0, 0.1], step, grad_scale)
    kept = (("p", params), ("m", ms), ("v", vs), ("copy", copies or params))
    return {f"{k}{i}": ts[i] for i in range(len(shapes)) for k, ts in kept}


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
            ("matmul+gelu fwd+bwd", case_matmul_gelu), ("gelu fwd+bwd", case_activation),
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
            w[name] = r.rand(*shape, scale=0.5 if name in ("wte", "wpe", "embed.weight") else shape[-1] ** -0.5)
    batches = [(r.randint(cfg.vocab_size, cfg.batch_size, cfg.seq_len),
                r.randint(cfg.vocab_size, cfg.batch_size, cfg.seq_len)) for _ in range(2)]
    return w, batches


def case_model(backend, r, cfg):
    """Micro-batch 1's logits, the mean loss and gradients over both on `backend` (the head in chunks of 5 rows)."""
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
    p = {k: _leaf(t) for k, t in w.items()}
    with torch.enable_grad():
        losses = [F.cross_entropy(reference_logits(p, x, cfg)[..., :cfg.vocab_size].reshape(x.numel(), -1),
                                  y.reshape(-1)) for x, y in batches]
        loss = sum(losses) / len(losses)
    grads = torch.autograd.grad(loss, list(p.values()))
    logits = reference_logits(w, batches[0][0], cfg).reshape(batches[0][0].numel(), -1)  # (N, Vp)
    return dict(logits=logits, loss=loss.detach(), **{f"grad {k}": g for k, g in zip(p, grads)})


def compare(got, want):
    """(max abs error, max error relative to want's largest magnitude); inf for a wrong shape or non-finite."""
    g = got.detach().to("cpu", torch.float64)
    w = want.detach().to("cpu", torch.float64)
    if g.shape != w.shape or not torch.isfinite(g).all():
        return math.inf, math.inf
    err = (g - w).abs().max().item() if g.numel() else 0.0
    scale = w.abs().max().item() if w.numel() else 0.0
    return err, (err / scale if scale > 0 else err)


def first_configs(active=True):
    """Inside (when active), every autotuned kernel runs the first config its pruning keeps, untimed."""
    tuners = [k for k in launched_kernels().values() if isinstance(k, triton.runtime.Autotuner)] if active else []
    return patched([(k, "early_config_prune", lambda configs, named_args, prune=k.early_config_prune, **kwargs:
                     (prune(configs, named_args, **kwargs) if prune else configs)[:1]) for k in tuners])


def run_self_test(cfg):
    """--test: a row per check as it runs; exits non-zero if any fails. TF32 off meanwhile (fp32 means fp32)."""
    tools = TOOLS[cfg.recipe]
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
          f"on {device}" + (", each autotuned kernel in the first configuration it would try" if pinned else ""))
    names = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16"}
    print(f"{'check':<34} {'dtype':<5} {'max abs err':>11} {'max rel err':>11} {'tolerance':>9}  result  worst")

    def report(name, dt, results):  # a row as soon as it is known: a run cut short keeps what it checked
        abs_err = max(r[0] for r in results)
        _, rel_err, worst = max(results, key=lambda r: r[1])
        ok = rel_err <= TEST_TOLERANCES[dt]
        print(f"{name:<34} {names[dt]:<5} {abs_err:11.2e} {rel_err:11.2e} {TEST_TOLERANCES[dt]:9.0e}  "
              f"{'pass' if ok else 'FAIL':<6}  {worst}", flush=True)
        return ok

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
                        want = case(ref_ops, op_inputs(torch.float64, dt, device), *shape)
                        results += [(*compare(got[k], want[k]), f"{k} @ {shape}") for k in want]
                    passed.append(report(name, dt, results))
                got = case_model(cfg.backend, op_inputs(dt, dt, device), tools.test_config)
                want = ref_model(op_inputs(torch.float64, dt, device), tools.test_config)
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
    """(flops, bytes) one call of op `name` cannot do without: the products' flops, else bytes read and written."""
    outs = out if isinstance(out, tuple) else (out,)
    if name in ("matmul_forward", "matmul_gelu_forward", "matmul_relu2_forward"):  # x (N, K), w (M, K)
        return 2 * args[0].numel() * args[1].shape[0], 0
    if name == "matmul_backward":  # dy (N, M), x (N, K)
        return 4 * args[1].numel() * args[0].shape[1], 0
    if name in ("attention_forward", "attention_backward"):
        B, T, C3 = args[0 if name == "attention_forward" else 1].shape
        return (2 if name == "attention_forward" else 5) * B * T * T * (C3 // 3), 0
    if name in ("scaled_attention_forward", "scaled_attention_backward"):
        B, T, H, D = args[0 if name == "scaled_attention_forward" else 1].shape
        return (2 if name == "scaled_attention_forward" else 5) * B * T * T * H * D, 0
    if name in ("fp8_matmul_forward", "fp8_matmul_backward"):  # one product, or two
        N, C = args[1].shape
        return (2 if name == "fp8_matmul_forward" else 4) * N * C * args[2].shape[0], 0
    if name == "muon_update":  # Newton-Schulz on each (r', c') matrix, r' <= c': X X^T, A A, B X a step
        n, (r, c) = len(args[0]), sorted(args[0][0].shape)
        return n * NEWTON_SCHULZ_STEPS * (4 * r * r * c + 2 * r ** 3), 0
    if name == "encoder_forward":
        idx, x = args[0], outs[0]
        return 0, _nbytes(idx) + 2 * _nbytes(x) + _nbytes(args[2][:idx.shape[1]])
    if name == "embedding_forward":
        return 0, _nbytes(args[0]) + 2 * _nbytes(out)
    if name == "encoder_backward":
        dx, idx, dwte, dwpe = args[:4]
        rows = dx.numel() * dwte.element_size()  # the wte rows it updates, read and written
        return 0, _nbytes(dx, idx) + 2 * rows + 2 * dx[0].numel() * dwpe.element_size()
    if name == "embedding_backward":  # the table rows it updates, read and written
        dx, idx, dtable = args[:3]
        return 0, _nbytes(dx, idx) + 2 * dx.numel() * dtable.element_size()
    if name == "layernorm_backward":  # dw, db (and dres) are read and written
        return 0, _nbytes(*args[:5], *args[7:], out, *kwargs.values()) + 2 * _nbytes(*args[5:7])
    if name == "rmsnorm_backward":  # dw (and dres) are read and written
        return 0, _nbytes(*args[:4], *args[5:], out, *kwargs.values()) + 2 * _nbytes(args[4])
    if name in ("crossentropy_forward_backward", "softcap_crossentropy_forward_backward"):
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
    if name == "add_into":  # acc read and written
        return 0, 3 * _nbytes(args[1])
    return 0, _nbytes(*args, *outs)  # the norms, gelu, relu2, q/k norm+rotary: inputs read, outputs written


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
    """ops, each call traced and kept in `calls` as [name, start, end, flops, bytes], on `active` as it runs."""
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
    """(flops, bytes) of one launch with arguments `a`: the products' flops, else each distinct tensor's bytes."""
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
    """{name: kernel} of every Triton jit, autotune or heuristics object of this file, jit helpers included."""
    return {name: k for name, k in globals().items() if isinstance(k, triton.runtime.KernelInterface)}


@contextlib.contextmanager
def patched(patches):
    """Inside, each (object, attribute, value) of `patches` set by mock.patch.object (an instance's over its class)."""
    with contextlib.ExitStack() as stack:
        for obj, attr, value in patches:
            stack.enter_context(mock.patch.object(obj, attr, value))
        yield


def timed_kernels(device, launches, active):
    """Inside, our launches are traced (`kernel NAME`), kept as [innermost op's index, name, start, end, work]."""
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
    return patched([(kernel, "run", wrap(name, kernel, kernel.run)) for name, kernel in launched_kernels().items()])


ALLOCATION_OPS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                  "aten::lift_fresh", "aten::detach_", "aten::detach"}
VIEW_OPS = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::slice",
            "aten::select", "aten::as_strided", "aten::t", "aten::transpose", "aten::permute", "aten::unbind",
            "aten::narrow", "aten::split", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::alias",
            "aten::to"}  # aten::to is a view when nothing changes; a real conversion calls aten::_to_copy
HOST_READ_OPS = {"aten::item", "aten::_local_scalar_dense"}


def kept_bytes(w, x, cfg, ops):
    """{op name: bytes} that one micro-batch's forward keeps for its backward, by the op that made each tensor."""
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
    """--profile's start: torch.profiler records, ops and launches are timed; the steps run the returned "ops"."""
    calls, launches, active = [], [], []
    kinds = torch.profiler.ProfilerActivity
    activities = [kinds.CPU, kinds.CUDA] if device.type == "cuda" else [kinds.CPU]
    recording = contextlib.ExitStack()  # open across the profiled steps, closed by finish_profile
    prof = recording.enter_context(torch.profiler.profile(activities=activities))
    recording.enter_context(timed_kernels(device, launches, active))
    return dict(recording=recording, prof=prof, calls=calls, launches=launches,
                ops=timed_ops(ops, device, calls, active))


@torch.no_grad()
def finish_profile(profile, steps, steps_ms, weights, x, cfg, ops, device, rank, master):
    """--profile's end: this process's Chrome trace into OUT_DIR/profile; rank 0 prints the tables."""
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
            print(f"{op + ' / ' + name:<62} {n:5d} {ms:9.3f} {100 * ms / step_ms:7.1f} {_rate(flops, nbytes, ms)}")
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
    """A --bench-ops case: (name, shape, ours, torch_label, theirs (by default torch_ops' op), args)."""
    theirs = theirs or (lambda: getattr(torch_ops, name)(*args))
    return name, shape, lambda: getattr(ops, name)(*args), torch_label, theirs, args


def bench_cases(cfg, ops, device):
    """op_case rows at the model's shapes (HEAD_ROWS rows for the lm head and the loss, as the step runs them)."""
    dt = compute_dtype(cfg)
    B, T, C, H, V, Vp = (cfg.batch_size, cfg.seq_len, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.padded_vocab_size)
    N, R = B * T, min(B * T, HEAD_ROWS)
    op = functools.partial(op_case, ops, TORCH_OPS)

    rand = functools.partial(torch.randn, device=device, dtype=dt)  # rand(*shape, dtype=dt)
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


@torch.no_grad()
def bench_ops(cfg, ops, device):
    """--bench-ops: each op against the PyTorch op it replaces: ms, TFLOP/s or GB/s (% of a copy's) and speed-up."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)  # (COPY_BYTES,)
    dst = torch.empty_like(src)  # (COPY_BYTES,)
    copy_gbs = 2 * src.numel() / time_ms(functools.partial(dst.copy_, src), device) / 1e6  # bytes read + written
    del src, dst
    print(f"--bench-ops: backend {cfg.backend}, {cfg.dtype}, B {cfg.batch_size} T {cfg.seq_len} "
          f"L{cfg.n_layer} H{cfg.n_head} C{cfg.n_embd} on {device} | copy bandwidth {copy_gbs:,.0f} GB/s")
    print(f"{'op':<37} {'shape':<26} {'ms':>8} {'rate':>12} {'% copy':>6} | {'PyTorch op':<28} {'ms':>8} "
          f"{'rate':>12} {'speed-up':>8}")
    for name, shape, ours, torch_label, theirs, args in TOOLS[cfg.recipe].bench_cases(cfg, ops, device):
        ours_ms, theirs_ms = time_ms(ours, device), time_ms(theirs, device)
        if args is None:  # attention forward + backward
            flops, nbytes = 7 * cfg.batch_size * cfg.seq_len ** 2 * cfg.n_embd, 0
        else:
            flops, nbytes = op_work(name, args, {}, ours())

        def unit(ms):
            return f"{flops / ms / 1e9:7.2f} TF/s" if flops else f"{nbytes / ms / 1e6:7.0f} GB/s"
        share = "" if flops else f"{100 * nbytes / ours_ms / 1e6 / copy_gbs:5.0f}%"
        print(f"{name:<37} {shape:<26} {ours_ms:8.3f} {unit(ours_ms):>12} {share:>6} | {torch_label:<28} "
              f"{theirs_ms:8.3f} {unit(theirs_ms):>12} {theirs_ms / ours_ms:7.2f}x")


# -----------------------------------------------------------------------------
# Compiling for a GPU (--compile-for)
#
# Triton compiles with no GPU: a step and an evaluation run at the flags on meta tensors (shapes, no data),
# Triton's driver describing the target, and each launch compiles every config it could pick there (an
# autotuned kernel's pruned list) with its own arguments, and runs nothing.

GPU_TARGETS = {"sm_90": (132, 227), "sm_86": (80, 99), "sm_80": (108, 163)}  # SMs, KB of shared memory a block


def kernel_resources(compiled):
    """(registers, spilled bytes) of a thread of a compiled kernel: cuobjdump's REG and LOCAL of its cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True,
                               text=True).stdout
    found = re.search(r"REG:(\d+) .*LOCAL:(\d+)", usage)
    return found.groups() if found else ("n/a", "n/a")


def compile_for(cfg):
    """--compile-for: a row per kernel and config of a step and an evaluation at the flags, compiled for the
    target; exits non-zero naming each that fails to compile or needs more shared memory than the target has."""
    if cfg.backend != "triton" or INTERPRET:
        die("--compile-for compiles backend triton's kernels for a GPU: give backend triton, TRITON_INTERPRET unset")
    (sms, shared_kb), arch = GPU_TARGETS[cfg.compile_for], int(cfg.compile_for[3:])
    print(f"--compile-for {cfg.compile_for} ({shared_kb} KB of shared memory a block): {cfg.recipe} L{cfg.n_layer} "
          f"H{cfg.n_head} C{cfg.n_embd}, B {cfg.batch_size} T {cfg.seq_len}, {cfg.dtype}: a step and an evaluation"
          + "; matmul's TMA configs skipped (sm_90 and later)" * (arch < 90)  # as _tma_ready skips them there
          + "; --fp8-head's FP8 kernels skipped (sm_89 and later)" * (cfg.fp8_head and arch < 89))
    cfg.fp8_head = cfg.fp8_head and arch >= 89
    print(f"{'kernel':<28} {'shape':<30} {'warps':>5} {'stages':>6} {'shared KB':>9} {'regs':>4} {'spill':>5}  "
          "meta-parameters")
    seen, over, failed, t0 = {}, set(), [], time.perf_counter()  # {launch: compiled hash}, hashes too big

    def compile_launch(name, kernel, run):
        def compile_run(*args, grid, warmup, **kwargs):
            nargs, configs, keys = dict(zip(kernel.arg_names, args)), [None], []
            if isinstance(kernel, triton.runtime.Autotuner):
                kernel.nargs = nargs  # what its pruning reads
                configs = kernel.prune_configs(kwargs)
            for config in configs:
                meta = {**kwargs, **(config.all_kwargs() if config else {})}
                if config and config.pre_hook:  # matmul's: the descriptors' block shapes
                    config.pre_hook({**nargs, **meta})
                keys.append(repr((name, meta, [str(a.dtype) if isinstance(a, torch.Tensor) else a if type(a) is int
                                               else type(a) for a in args])))
                if keys[-1] in seen:
                    continue
                seen[keys[-1]] = None
                dtype = [str(a.dtype)[6:] for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
                shape = " ".join(dtype[:1] + [f"{k}={v}" for k, v in nargs.items() if k[0].isupper()
                                              and type(v) is int])
                params = " ".join(f"{k}={int(v) if type(v) is bool else v}" for k, v in meta.items() if k[0].isupper())
                try:
                    compiled = (kernel.fn.run if config else run)(*args, grid=grid, warmup=True, **meta)
                except Exception as e:  # named in its row, and the run exits non-zero
                    failed.append(name)
                    print(f"{name:<28} {shape:<30} FAILED: {str(e).strip().splitlines()[-1]} ({params})", flush=True)
                    continue
                m = compiled.metadata
                if compiled.hash not in seen.values():  # else another launch's specialization, printed already
                    # the autotuner skips a config that needs more shared memory than the GPU has
                    print(f"{name:<28} {shape:<30} {m.num_warps:5d} {m.num_stages:6d} {m.shared / 1024:9.1f} "
                          f"{'{:>4} {:>5}'.format(*kernel_resources(compiled))}  {params}"
                          + " (too big: the autotuner skips it)" * (m.shared > shared_kb << 10 and len(configs) > 1))
                seen[keys[-1]] = compiled.hash
                if m.shared > shared_kb << 10:
                    over.add(compiled.hash)
            if all(seen[k] in over for k in keys):
                failed.append(name)
                print(f"{name:<28} FAILED: needs more than {shared_kb} KB of shared memory (every config)")
        return compile_run

    shapes = param_shapes(cfg)
    zeros = {k: np.broadcast_to(np.float32(0), s) for k, s in shapes.items()}  # 0-stride views: no memory
    muon = RECIPES[cfg.recipe].muon_names(shapes)
    state = make_state(zeros, zeros, {k: z for k, z in zeros.items() if k not in muon}, cfg, torch.device("meta"))
    x = torch.zeros((1, cfg.batch_size, cfg.seq_len), dtype=torch.int64, device="meta")  # (1, B, T)
    driver = SimpleNamespace(get_current_target=lambda: triton.backends.compiler.GPUTarget("cuda", arch, 32),
                             get_current_device=lambda: 0, get_current_stream=lambda device=None: 0,
                             utils=SimpleNamespace(get_device_properties=lambda device: {"multiprocessor_count": sms}))
    # backend_ops asks for a GPU; a meta tensor has no value for the host to read
    patches = [(triton.runtime.driver, "_active", driver), (torch.cuda, "is_available", lambda: True),
               (torch.Tensor, "item", lambda self: 0.0)]
    with patched(patches + [(k, "run", compile_launch(name, k, k.run)) for name, k in launched_kernels().items()]):
        train_step(state, x, x, 1, cfg, backend_ops("triton", cfg.recipe), 1)
        token_losses(state["weights"], x[0], x[0], cfg)
    done = f"{len(set(seen.values()) - {None})} kernels and configs in {time.perf_counter() - t0:.0f} s"
    if failed:
        die(f"--compile-for {cfg.compile_for}: {', '.join(dict.fromkeys(failed))} failed ({done} compiled)")
    print(f"--compile-for {cfg.compile_for}: compiled {done}, each launch with a config that fits")


# -----------------------------------------------------------------------------
# The tools of each recipe
#
# What the tools ask of a recipe beside its RECIPES row: gpt2's row here, the speedrun's in its own section.

@dataclass(frozen=True)
class RecipeTools:
    """A row of TOOLS: what --test and --bench-ops need of a recipe."""
    test_config: Config   # --test's tiny model for the whole-model check
    test_cases: Callable  # () -> --test's [(check, case)] of its ops
    autograd_test: str    # "": --test holds backend torch to autograd; else what does (--test refuses)
    bench_cases: Callable  # (cfg, ops, device) -> --bench-ops' cases of its ops


TOOLS = {"gpt2": RecipeTools(
    test_config=Config(n_layer=2, n_head=3, n_embd=24, block_size=11, vocab_size=61, padded_vocab_size=64,
                       seq_len=9, batch_size=2),
    test_cases=lambda: OP_CASES, autograd_test="", bench_cases=bench_cases)}


# -----------------------------------------------------------------------------
# Triton kernels: speedrun
#
# First the ops the kernels above serve through a flag (RMSNorm, ReLU^2, the soft cap, separate q, k, v).

def softcap_crossentropy_forward_backward(z, targets, dloss, block_v=CE_BLOCK_V):
    """losses (N) fp32 of the soft-capped z (N,Vp) dt over all Vp columns; OVERWRITES z with dloss * dlosses/dz."""
    return crossentropy_forward_backward(z, targets, z.shape[-1], dloss, block_v, cap=SOFTCAP)


def _check_heads(name, qkv, rows):
    """The kernels' addressing: q, k, v (B,T,H,D) with one set of strides ending (D, 1); rows of unit stride."""
    D = qkv[0].shape[-1]
    if (len({t.stride() for t in qkv}) > 1 or qkv[0].stride()[2:] != (D, 1)
            or any(t.stride(2) != 1 for t in rows)):
        raise ValueError(f"{name}: expected q, k, v (B, T, H, D) with one set of strides ending (D, 1) and "
                         f"rows of unit stride, got strides {[t.stride() for t in (*qkv, *rows)]}")


def scaled_attention_forward(q, k, v, scale):
    """Causal softmax(scale q k^T) v per head of q, k, v (B,T,H,D): (out (B,T,H*D), lse (B,H,T) fp32)."""
    _check_heads("scaled_attention_forward", (q, k, v), ())
    return _flash_forward(q, k, v, *q.shape, scale)


def scaled_attention_backward(dout, q, k, v, out, lse, scale):
    """(dq, dk, dv) (B,T,H,D) with q's strides, from dout and out ((B,T,H*D) or (B,T,H,D)), q, k, v, lse."""
    B, T, H, D = q.shape
    dout, out = dout.view(B, T, H * D), out.view(B, T, H * D)  # (B,T,H*D) each
    _check_heads("scaled_attention_backward", (q, k, v), (dout, out))
    # the kernels write all three through q's strides
    dq, dk, dv = (torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device)
                  for _ in range(3))  # (B,T,H,D) each
    _flash_backward(dout, q, k, v, out, lse, dq, dk, dv, B, T, H, D, scale)
    return dq, dk, dv


# --- q and k: RMSNorm over each head, then the half-truncated rotary embedding ---------------------------
# A row r is one head of x (B,T,H,D) contiguous, at position (r // H) % T, loaded as two (rows, D/2) halves (j
# pairs with D/2 + j). The angles are computed in the kernels: a cos/sin table would be a torch op in the step.

# whole heads per program: 32 heads at D = 128 with 8 warps; the interpreter takes wide tiles
QK_TILE = 1 << 16 if INTERPRET else 4096
QK_WARPS = 8


@triton.jit
def _rotary_cos_sin_tile(rows, T, H, cols, HEAD_DIM: tl.constexpr):
    """cos, sin (R, BH) fp32 of heads rows (R,), pairs cols (BH,): freq_j = (1/1024)^(j/(D/4-1)), 0 past D/4."""
    quarter = HEAD_DIM // 4
    t = ((rows // H) % T).to(tl.float32)                                           # (R,) positions
    freq = tl.exp2(cols.to(tl.float32) * (-10.0 / tl.maximum(quarter - 1, 1)))     # (BH,) fp32
    freq = tl.where(cols < quarter, freq, 0.0)                                      # (BH,)
    theta = t[:, None] * freq[None, :]                                              # (R, BH) fp32, as torch's
    # GPU cos and sin may be approximate far from 0: reduce to [-pi, pi], 2 pi split in two (6.28125 has
    # 8 significant bits, so turns * 6.28125 is exact)
    turns = tl.floor(theta * 0.15915494309189535 + 0.5)                             # (R, BH) nearest 2 pi
    r = (theta - turns * 6.28125) - turns * 1.9353071795864769e-3                   # (R, BH) in [-pi, pi]
    return tl.cos(r), tl.sin(r)


@triton.jit
def _head_halves(N, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's heads: flat indices (R,) int64, pairs (BH,), row mask, half mask and offsets (R, BH)."""
    heads = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)   # (R,)
    cols = tl.arange(0, BLOCK_H)                                                    # (BH,)
    row_mask = heads < N                                                            # (R,)
    mask = row_mask[:, None] & (cols[None, :] < HEAD_DIM // 2)                      # (R, BH)
    return heads, cols, row_mask, mask, heads[:, None] * HEAD_DIM + cols[None, :]


@triton.jit
def _qk_norm_rotary_forward_kernel(x_ptr, y_ptr, rstd_ptr, N, T, H, eps, HEAD_DIM: tl.constexpr,
                                   BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    heads, cols, row_mask, mask, offs = _head_halves(N, HEAD_DIM, BLOCK_ROWS, BLOCK_H)
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)                 # (R, BH)
    x2 = tl.load(x_ptr + HEAD_DIM // 2 + offs, mask=mask, other=0.0).to(tl.float32)  # (R, BH)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)  # (R,)
    x1 = x1 * rstd[:, None]                                                         # (R, BH) xhat
    x2 = x2 * rstd[:, None]                                                         # (R, BH)
    cos, sin = _rotary_cos_sin_tile(heads, T, H, cols, HEAD_DIM)                    # (R, BH) each
    y1 = x1 * cos + x2 * sin                                                        # (R, BH)
    y2 = x2 * cos - x1 * sin                                                        # (R, BH)
    tl.store(y_ptr + offs, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + HEAD_DIM // 2 + offs, y2.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + heads, rstd, mask=row_mask)


@triton.jit
def _qk_norm_rotary_backward_kernel(dy_ptr, x_ptr, rstd_ptr, dx_ptr, N, T, H, HEAD_DIM: tl.constexpr,
                                    BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    # the rotation is orthogonal: dxhat = R^T dy; then RMSNorm's backward without gain, xhat recomputed
    heads, cols, row_mask, mask, offs = _head_halves(N, HEAD_DIM, BLOCK_ROWS, BLOCK_H)
    dy1 = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)               # (R, BH)
    dy2 = tl.load(dy_ptr + HEAD_DIM // 2 + offs, mask=mask, other=0.0).to(tl.float32)  # (R, BH)
    rstd = tl.load(rstd_ptr + heads, mask=row_mask, other=0.0)                      # (R,) fp32
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]  # (R, BH) xhat
    x2 = tl.load(x_ptr + HEAD_DIM // 2 + offs, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
    cos, sin = _rotary_cos_sin_tile(heads, T, H, cols, HEAD_DIM)                    # (R, BH) each
    g1 = dy1 * cos - dy2 * sin                                                      # (R, BH) dxhat
    g2 = dy1 * sin + dy2 * cos                                                      # (R, BH)
    mean = (tl.sum(g1 * x1, axis=1) + tl.sum(g2 * x2, axis=1)) / HEAD_DIM           # (R,)
    dx1 = rstd[:, None] * (g1 - x1 * mean[:, None])                                 # (R, BH)
    dx2 = rstd[:, None] * (g2 - x2 * mean[:, None])                                 # (R, BH)
    tl.store(dx_ptr + offs, dx1.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + HEAD_DIM // 2 + offs, dx2.to(dx_ptr.dtype.element_ty), mask=mask)


def qk_norm_rotary_forward(x, eps):
    """q or k (B,T,H,D) contiguous -> (y (B,T,H,D), rstd (B,T,H) fp32): each head RMS-normed, then rotated."""
    _flat_check("qk_norm_rotary_forward", x)
    B, T, H, D = x.shape
    y = torch.empty_like(x)                                                         # (B,T,H,D)
    rstd = torch.empty((B, T, H), dtype=torch.float32, device=x.device)             # (B,T,H) fp32
    block_h, block_rows = _row_blocks(D // 2, QK_TILE // 2)
    _qk_norm_rotary_forward_kernel[(triton.cdiv(B * T * H, block_rows),)](
        x, y, rstd, B * T * H, T, H, eps, HEAD_DIM=D, BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=QK_WARPS)
    return y, rstd


def qk_norm_rotary_backward(dy, x, rstd):
    """dx (B,T,H,D) in x's dtype from dy and the forward's x (B,T,H,D), contiguous, and rstd (B,T,H)."""
    _flat_check("qk_norm_rotary_backward", dy, x, rstd)
    B, T, H, D = x.shape
    dx = torch.empty_like(x)                                                        # (B,T,H,D)
    block_h, block_rows = _row_blocks(D // 2, QK_TILE // 2)
    _qk_norm_rotary_backward_kernel[(triton.cdiv(B * T * H, block_rows),)](
        dy, x, rstd, dx, B * T * H, T, H, HEAD_DIM=D, BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=QK_WARPS)
    return dx


# --- Muon: momentum, Newton-Schulz on the matmul kernels, the update ---------------------------------------
# torch_muon_update over n matrices (r, c): one launch updates the momenta into a stacked u (n, r, c) with its
# chunks' sums of squares, one normalizes, Newton-Schulz on batched _matmul, one updates masters and copies.

MUON_BLOCK = 1 << 16 if INTERPRET else 4096  # elementwise kernels: 16 elements per thread with 8 warps
MUON_WARPS = 8
MUON_PARTIALS_BLOCK = 256  # the norm's chunk partials per loop step: a d12 (3072, 768) matrix has 144


@triton.jit
def _lerp(start, end, w):
    # torch's lerp, one fused multiply-add, exact at w = 1 (so fp32 results agree bit for bit)
    small = w < 0.5
    return tl.fma(tl.where(small, w, w - 1.0), end - start, tl.where(small, start, end))


@triton.jit
def _muon_momentum_kernel(table_ptr, n_tensors, u_ptr, sumsq_ptr, w_m, w_u, ALIGNED: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr):
    # table row: numel, first chunk, grad, m pointers; the matrix of first chunk f is u's f / (its chunks)
    row = _owner_row(table_ptr, n_tensors, 4, BLOCK_T)
    numel = tl.load(row)
    first = tl.load(row + 1)
    start = (tl.program_id(0) - first) * CHUNK                                      # int64 scalar
    g_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        numel = tl.multiple_of(numel, 16)
    u_ptr += first // tl.cdiv(numel, CHUNK) * numel
    size = tl.minimum(numel - start, CHUNK)                                         # this chunk's length
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)                                      # (BL,)
    for i0 in range(0, size, BLOCK):
        o = start + i0
        mask = offs < size - i0
        g = tl.load(g_ptr + o + offs, mask=mask, other=0.0)                         # (BL,) fp32
        m = _lerp(tl.load(m_ptr + o + offs, mask=mask, other=0.0), g, w_m)         # (BL,) fp32
        u = _lerp(g, m, w_u).to(u_ptr.dtype.element_ty)                             # (BL,) Nesterov's
        tl.store(m_ptr + o + offs, m, mask=mask)
        tl.store(u_ptr + o + offs, u, mask=mask)
        acc += u.to(tl.float32) * u.to(tl.float32)  # the norm of u as Newton-Schulz reads it (masked: 0)
    tl.store(sumsq_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _muon_normalize_kernel(x_ptr, sumsq_ptr, numel, chunks, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
    # x (n, numel) /= ||x[i]||_F + 1e-7: every program of matrix i sums its partials in one order; the norm
    # and the denominator rounded to x's dtype as torch rounds them
    i = tl.program_id(0).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)                                                  # (BP,)
    acc = tl.zeros((BLOCK_P,), dtype=tl.float32)                                    # (BP,)
    for p0 in range(0, chunks, BLOCK_P):
        acc += tl.load(sumsq_ptr + i * chunks + p0 + offs_p, mask=offs_p < chunks - p0, other=0.0)
    norm = tl.sqrt_rn(tl.sum(acc, axis=0)).to(x_ptr.dtype.element_ty).to(tl.float32)
    denom = (norm + 1e-7).to(x_ptr.dtype.element_ty).to(tl.float32)
    start = tl.program_id(1).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    mask = offs < numel - start
    x = tl.load(x_ptr + i * numel + start + offs, mask=mask, other=0.0).to(tl.float32)  # (BL,)
    tl.store(x_ptr + i * numel + start + offs, tl.div_rn(x, denom).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _axpby_kernel(out_ptr, x_ptr, y_ptr, n, a, b, BLOCK: tl.constexpr):
    # out may be x or y: each element is read before it is written, by the same program
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    mask = offs < n - start
    x = tl.load(x_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)          # (BL,)
    y = tl.load(y_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)          # (BL,)
    tl.store(out_ptr + start + offs, (a * x + b * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _muon_update_kernel(table_ptr, n_tensors, x_ptr, lr, decay, scale, HAS_COPY: tl.constexpr, ALIGNED: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr):
    # table row: numel, first chunk, param, copy pointers; the matrix's update is x's, as for the momentum
    row = _owner_row(table_ptr, n_tensors, 4, BLOCK_T)
    numel = tl.load(row)
    first = tl.load(row + 1)
    start = (tl.program_id(0) - first) * CHUNK                                      # int64 scalar
    p_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        numel = tl.multiple_of(numel, 16)
    if HAS_COPY:
        c_ptr = tl.load(row + 3).to(tl.pointer_type(tl.bfloat16))
        if ALIGNED:
            c_ptr = tl.multiple_of(c_ptr, 16)
    x_ptr += first // tl.cdiv(numel, CHUNK) * numel
    size = tl.minimum(numel - start, CHUNK)                                         # this chunk's length
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    for i0 in range(0, size, BLOCK):
        o = start + i0
        mask = offs < size - i0
        p = tl.load(p_ptr + o + offs, mask=mask, other=0.0)                         # (BL,) fp32
        update = tl.load(x_ptr + o + offs, mask=mask, other=0.0).to(tl.float32) * scale  # (BL,)
        # torch's order of roundings: p * decay, then minus lr * update
        p = p * decay - update * lr                                                 # (BL,) fp32
        tl.store(p_ptr + o + offs, p, mask=mask)
        if HAS_COPY:
            tl.store(c_ptr + o + offs, p.to(c_ptr.dtype.element_ty), mask=mask)


def axpby(out, a, x, b, y):
    """out = a x + b y elementwise in fp32, rounded once (contiguous, as many elements; out may be x or y)."""
    _flat_check("axpby", out, x, y)
    if not out.numel() == x.numel() == y.numel():
        raise ValueError(f"axpby: {x.numel()} and {y.numel()} elements into {out.numel()}")
    _axpby_kernel[(triton.cdiv(out.numel(), MUON_BLOCK),)](out, x, y, out.numel(), a, b, BLOCK=MUON_BLOCK,
                                                           num_warps=MUON_WARPS)


def add_into(acc, x):
    """acc += x (same shape and dtype, contiguous), rounded once: q's, k's and v's input gradients add up."""
    if acc.shape != x.shape or acc.dtype != x.dtype:
        raise ValueError(f"add_into: {x.dtype} {tuple(x.shape)} into {acc.dtype} {tuple(acc.shape)}")
    axpby(acc, 1.0, acc, 1.0, x)


def muon_update(params, grads, ms, copies, lr, momentum, weight_decay, dtype, chunk=MT_CHUNK, block=MT_BLOCK):
    """torch_muon_update's Muon in place on fp32 matrices of one shape; `copies` (bf16, or None) get them rounded."""
    if dtype not in (torch.float32, torch.bfloat16) or params[0].dim() != 2:
        raise ValueError(f"muon_update: fp32 or bf16 Newton-Schulz on matrices, got {dtype} on "
                         f"{tuple(params[0].shape)}")
    _check_tensors("muon_update params/grads/m", [*params, *grads, *ms], (torch.float32,),
                   params[:1] * (3 * len(params)))
    if copies is not None:
        _check_tensors("muon_update copies", copies, (torch.bfloat16,), params)
    n, (r, c) = len(params), params[0].shape
    u = torch.empty((n, r, c), dtype=dtype, device=params[0].device)  # (n, r, c) u, then its update
    table, chunks, aligned = _tensor_table([grads, ms], chunk=chunk)
    sumsq = torch.empty(chunks, dtype=torch.float32, device=u.device)  # (chunks,) fp32 partial sums of u^2
    _muon_momentum_kernel[(chunks,)](table, n, u, sumsq, 1.0 - momentum, momentum, ALIGNED=aligned, CHUNK=chunk,
                                     BLOCK=block, BLOCK_T=triton.next_power_of_2(n), num_warps=MT_WARPS)
    _muon_normalize_kernel[(n, triton.cdiv(r * c, MUON_BLOCK))](u, sumsq, r * c, chunks // n, BLOCK=MUON_BLOCK,
                                                                BLOCK_P=MUON_PARTIALS_BLOCK, num_warps=MUON_WARPS)
    # newton_schulz in place, each product one batched launch; tall matrices without a transpose:
    # X <- 2X + B X on X = u^T is u <- 2u + u B (A = u^T u and B symmetric)
    tall = r > c
    for _ in range(NEWTON_SCHULZ_STEPS):
        ut = u.transpose(1, 2)                                                      # (n, c, r) a view
        A, _ = _matmul(ut, u) if tall else _matmul(u, ut)                           # (n, k, k), k = min(r, c)
        AA, _ = _matmul(A, A)                                                       # (n, k, k)
        axpby(A, -1.5, A, 0.5, AA)                                                  # (n, k, k) B, over A
        Bu, _ = _matmul(u, A) if tall else _matmul(A, u)                           # (n, r, c)
        axpby(u, 2.0, u, 1.0, Bu)                                                   # (n, r, c)
    table, chunks, aligned = _tensor_table([params, copies], chunk=chunk)
    _muon_update_kernel[(chunks,)](table, n, u, lr, 1.0 - lr * weight_decay, max(1.0, r / c) ** 0.5,
                                   HAS_COPY=copies is not None, ALIGNED=aligned, CHUNK=chunk, BLOCK=block,
                                   BLOCK_T=triton.next_power_of_2(n), num_warps=MT_WARPS)


# --- --fp8-head: the casts, and the head's matmuls on FP8 operands (docs/FORMATS.md, FP8 head) -----------
# The interpreter's fp32-to-float8 cast rounds wrongly, so the kernel rounds on the float8 grid itself and
# the cast is then exact; the products are matmul_kernel's on float8 operands, scaled in fp32.
FP8_TYPES = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_BIAS = {"e4m3fn": 7, "e5m2": 15}        # the formats' exponent biases ...
FP8_MANTISSA = {"e4m3fn": 3, "e5m2": 2}     # ... and mantissa bits
COLUMN_SUM_BLOCK = (16, 1 << 16) if INTERPRET else (LN_REDUCE_BLOCK_P, LN_REDUCE_BLOCK_C)  # (rows, columns)


@triton.jit
def _fp8_quantize_kernel(x_ptr, y_ptr, n, inverse, TOP: tl.constexpr, MANTISSA: tl.constexpr,
                         MIN_EXP: tl.constexpr, BLOCK: tl.constexpr):
    """y = x * inverse clamped to +-TOP, rounded to nearest even on the float8 grid, cast to y's type."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inverse  # (BLOCK,)
    v = tl.minimum(tl.maximum(v, -TOP), TOP)
    bits = v.to(tl.uint32, bitcast=True)  # (BLOCK,) sign, exponent, 23 mantissa bits
    DROP: tl.constexpr = 23 - MANTISSA
    # normal: add half an ulp less one plus the kept last bit (ties to even), and cut; carries are right
    normal = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) >> DROP << DROP  # (BLOCK,)
    # subnormal: fp32's own rounding of |v| + 1.5 * 2^23 ulp to the subnormals' fixed spacing, sign kept
    MAGIC: tl.constexpr = 1.5 * 2.0 ** (23 + MIN_EXP - MANTISSA)
    sub = ((tl.abs(v) + MAGIC) - MAGIC).to(tl.uint32, bitcast=True) | (bits >> 31 << 31)  # (BLOCK,)
    q = tl.where(tl.abs(v) < 2.0 ** MIN_EXP, sub, normal).to(tl.float32, bitcast=True)  # (BLOCK,) on the grid
    tl.store(y_ptr + offs, q.to(y_ptr.dtype.element_ty), mask=mask)


def triton_fp8_quantize(x, kind):
    """fp8_quantize's bits: x times fp8_reciprocal(kind), saturated, rounded to nearest even in kind's float8."""
    fmt = FP8_FORMATS[kind]
    y = torch.empty(x.shape, dtype=FP8_TYPES[fmt], device=x.device)
    _flat_check("fp8_quantize", x, y)
    n = x.numel()
    _fp8_quantize_kernel[(triton.cdiv(n, ELEM_BLOCK),)](x, y, n, fp8_reciprocal(kind), TOP=FP8_MAX[fmt],
                                                       MANTISSA=FP8_MANTISSA[fmt], MIN_EXP=1 - FP8_BIAS[fmt],
                                                       BLOCK=ELEM_BLOCK, num_warps=ELEM_WARPS)
    return y


def fp8_matmul_forward(x_f8, w_f8, b):
    """z (N,V) = (x_f8 (N,C) @ w_f8 (V,C).T) x_s w_s + b (V), in b's dtype."""
    return _matmul(x_f8, w_f8.t(), b, scale=FP8_SCALES["x"] * FP8_SCALES["w"], out_dtype=b.dtype)[0]


def fp8_matmul_backward(dz, x_f8, w_f8, dw, db):
    """dx (N,C) = g_f8 @ w_f8 (g_f8: dz in e5m2), dw (V,C) += g_f8.T @ x_f8, scaled; db (V) += dz's column sums."""
    g_f8 = triton_fp8_quantize(dz, "grad")  # (N, V)
    dx = _matmul(g_f8, w_f8, scale=FP8_SCALES["grad"] * FP8_SCALES["w"], out_dtype=dz.dtype)[0]  # (N, C)
    _matmul_dw(g_f8, x_f8, dw, None, scale=FP8_SCALES["grad"] * FP8_SCALES["x"])
    rows, cols = COLUMN_SUM_BLOCK
    N, V = dz.shape
    _layernorm_param_grad_kernel[(triton.cdiv(V, cols),)](dz, db, db, N, V, HAS_BIAS=False, BLOCK_P=rows, BLOCK_C=cols)
    return dx


TRITON_SPEEDRUN_OPS = op_table("triton", dict(
    embedding_forward=functools.partial(encoder_forward, wpe=None), embedding_backward=embedding_backward,
    rmsnorm_forward=lambda x, w, eps: _layernorm_forward(x, None, w, None, eps, rms=True)[1:],  # (y, rstd)
    residual_rmsnorm_forward=lambda res, h, w, eps: _layernorm_forward(res, h, w, None, eps, rms=True),  # (x, y, rstd)
    rmsnorm_backward=lambda dy, x, w, rstd, dw, dres=None: layernorm_backward(dy, x, w, None, rstd, dw, None, dres),
    qk_norm_rotary_forward=qk_norm_rotary_forward, qk_norm_rotary_backward=qk_norm_rotary_backward,
    scaled_attention_forward=scaled_attention_forward, scaled_attention_backward=scaled_attention_backward,
    matmul_relu2_forward=lambda x, w, b: _matmul(x, w.t(), b, activation="relu2"),  # (relu(pre)^2, pre)
    relu2_forward=functools.partial(_activation_op, activation="relu2"),
    relu2_backward=lambda dy, pre: _activation_op(pre, "relu2", dy),
    softcap_crossentropy_forward_backward=softcap_crossentropy_forward_backward,
    muon_update=muon_update, add_into=add_into, fp8_quantize=triton_fp8_quantize,
    fp8_matmul_forward=fp8_matmul_forward, fp8_matmul_backward=fp8_matmul_backward,
), SPEEDRUN_OP_NAMES)


# -- tools: the speedrun recipe's --test and --bench-ops cases (TOOLS["speedrun"])

def case_embedding(ops, r, B, T, C, H):
    Vp = B * T + 3
    idx = r.randint(max(2, B * T // 2), B, T)  # (B, T) tokens repeat
    table = r.rand(Vp, C)  # (Vp, C)
    x = ops.embedding_forward(idx, table)  # (B, T, C)
    dtable = r.rand(Vp, C, acc=True)  # (Vp, C) filled: the backward adds into it
    ops.embedding_backward(r.rand(B, T, C), idx, dtable)
    return dict(x=x, dtable=dtable)


def case_rmsnorm(ops, r, B, T, C, H, residual=False):
    eps = torch.finfo(r.rdt).eps  # the model's: the tested dtype's, in the reference too
    x = r.rand(B * T, C, scale=2.0, shift=0.5)  # (N, C)
    h = r.rand(B * T, C) if residual else None  # (N, C) added to x first
    w = r.rand(C, shift=1.0)  # (C,)
    x, y, rstd = ops.residual_rmsnorm_forward(x, h, w, eps) if residual else (x, *ops.rmsnorm_forward(x, w, eps))
    dw = r.rand(C, acc=True)  # (C,)
    dx = ops.rmsnorm_backward(r.rand(B * T, C), x, w, rstd, dw, dres=r.rand(B * T, C) if residual else None)
    return dict(y=y, rstd=rstd, dx=dx, dw=dw, **({"x": x} if residual else {}))


def case_matmul_relu2(ops, r, B, T, C, H):
    x, w, b = r.rand(B * T, C), r.rand(4 * C, C, scale=C ** -0.5), r.rand(4 * C)  # (N, C), (4C, C), (4C,)
    y, pre = ops.matmul_relu2_forward(x, w, b)  # (N, 4C) each
    dpre = ops.relu2_backward(r.rand(B * T, 4 * C), pre)  # (N, 4C)
    return dict(y=y, pre=pre, dpre=dpre)


def case_softcap_crossentropy(ops, r, B, T, C, H):
    Vp = 5 * C + 8
    z = r.rand(B * T, Vp, scale=30.0)  # (N, Vp) well into the cap's bend
    targets = r.randint(Vp, B * T)  # (N,)
    losses = ops.softcap_crossentropy_forward_backward(z, targets, 1.0 / (B * T))  # (N,)
    return dict(losses=losses, dz=z)


def case_muon(ops, r, B, T, C, H):
    """Muon on two wide and two tall matrices, one step; small masters (0.02) show an error in the update."""
    out = {}
    c = min(C, 40)  # at most two 32-wide tiles (one partial) in the interpreter
    for name, shape in (("wide", (c, 3 * c + 1)), ("tall", (4 * c, c))):
        params = [r.rand(*shape, scale=0.02, acc=True) for _ in range(2)]  # fp32 masters (fp64 reference)
        ms = [r.rand(*shape, scale=0.1, acc=True) for _ in range(2)]
        copies = [p.to(r.dt) for p in params] if r.dt != params[0].dtype else None
        grads = [r.rand(*shape, acc=True) for _ in range(2)]
        ops.muon_update(params, grads, ms, copies, 0.02, MUON_MOMENTUM, MUON_WEIGHT_DECAY, r.dt)
        kept = (("p", params), ("m", ms), ("copy", copies or params))
        out.update({f"{name} {k}{i}": ts[i] for i in range(2) for k, ts in kept})
    return out


def case_add_into(ops, r, B, T, C, H):
    """acc += x in the compute dtype, as the speedrun model adds q's, k's and v's input gradients."""
    acc = r.rand(B * T, C)  # (N, C)
    ops.add_into(acc, r.rand(B * T, C))
    return dict(acc=acc)


def case_scaled_attention(ops, r, B, T, C, H):
    """Separate q, k, v of H heads of HEAD_DIM (C unused). At T = 1 dq and dk are zero up to rounding: only dv."""
    q, k, v = (r.rand(B, T, H, HEAD_DIM, scale=1.5) for _ in range(3))  # (B, T, H, D) each
    out, lse = ops.scaled_attention_forward(q, k, v, ATTN_SCALE)  # (B, T, H*D), (B, H, T)
    dq, dk, dv = ops.scaled_attention_backward(r.rand(B, T, H * HEAD_DIM), q, k, v, out, lse,
                                               ATTN_SCALE)  # (B, T, H, D) each
    return dict(out=out, lse=lse, dv=dv, **(dict(dq=dq, dk=dk) if T > 1 else {}))


def case_qk_norm_rotary(ops, r, B, T, C, H):
    """q or k of H heads of HEAD_DIM (C unused), with the model's eps (the tested dtype's)."""
    x = r.rand(B, T, H, HEAD_DIM, scale=2.0, shift=0.5)  # (B, T, H, D)
    y, rstd = ops.qk_norm_rotary_forward(x, torch.finfo(r.rdt).eps)  # (B, T, H, D), (B, T, H)
    dx = ops.qk_norm_rotary_backward(r.rand(B, T, H, HEAD_DIM), x, rstd)  # (B, T, H, D)
    return dict(y=y, rstd=rstd, dx=dx)


def case_fp8_head(ops, r, B, T, C, H):
    N, Vp = B * T, B * T + 5
    x_f8 = ops.fp8_quantize(r.rand(N, C, scale=5.0), "x")  # (N, C) e4m3fn, some saturated
    w_f8 = ops.fp8_quantize(r.rand(Vp, C, scale=0.02), "w")  # (Vp, C) e4m3fn, some subnormal
    z = ops.fp8_matmul_forward(x_f8, w_f8, r.rand(Vp))  # (N, Vp)
    dw, db = r.rand(Vp, C, acc=True), r.rand(Vp, acc=True)  # (Vp, C), (Vp,) filled: the backward adds
    dx = ops.fp8_matmul_backward(r.rand(N, Vp, scale=1e-3), x_f8, w_f8, dw, db)  # (N, C)
    return dict(x_f8=x_f8, w_f8=w_f8, z=z, dx=dx, dw=dw, db=db)


# --test --recipe speedrun: the speedrun recipe's own ops (it shares matmul, AdamW and the step ops above)
SPEEDRUN_OP_CASES = [("embedding fwd+bwd", case_embedding), ("rmsnorm fwd+bwd", case_rmsnorm),
                     ("residual+rmsnorm fwd+bwd", functools.partial(case_rmsnorm, residual=True)),
                     ("qk norm+rotary fwd+bwd", case_qk_norm_rotary),
                     ("scaled attention fwd+bwd", case_scaled_attention),
                     ("matmul+relu2 fwd, relu2 bwd", case_matmul_relu2),
                     ("relu2 fwd+bwd", functools.partial(case_activation, act="relu2")),
                     ("softcap crossentropy fwd+bwd", case_softcap_crossentropy), ("muon_update", case_muon),
                     ("add_into", case_add_into), ("fp8 quantize, head matmul fwd+bwd", case_fp8_head)]


def speedrun_bench_cases(cfg, ops, device):
    """bench_cases of --recipe speedrun: its own ops at its shapes against backend torch's (and SDPA)."""
    dt = compute_dtype(cfg)
    B, T, C, Vp, L = cfg.batch_size, cfg.seq_len, cfg.n_embd, cfg.padded_vocab_size, cfg.n_layer
    H, D = C // HEAD_DIM, HEAD_DIM
    N, R = B * T, min(B * T, HEAD_ROWS)
    eps = torch.finfo(dt).eps

    rand = functools.partial(torch.randn, device=device, dtype=dt)  # rand(*shape, dtype=dt)
    idx = torch.randint(cfg.vocab_size, (B, T), device=device)  # (B, T)
    table, dtable = rand(Vp, C), rand(Vp, C, dtype=torch.float32)  # (Vp, C) each
    x, h, dy, w = rand(N, C), rand(N, C), rand(N, C), rand(C)  # (N, C) x3, (C,)
    dw = rand(C, dtype=torch.float32)  # (C,)
    _, rstd = ops.rmsnorm_forward(x, w, eps)  # (N,)
    q, k, v, dq = rand(B, T, H, D), rand(B, T, H, D), rand(B, T, H, D), rand(B, T, H, D)  # (B, T, H, D) each
    _, qrstd = ops.qk_norm_rotary_forward(q, eps)  # (B, T, H)
    dout = rand(B, T, C)  # (B, T, C)
    xf, wf, bf = rand(N, C), rand(4 * C, C), rand(4 * C)  # (N, C), (4C, C), (4C,)
    pre, dpre = rand(N, 4 * C), rand(N, 4 * C)  # (N, 4C) each
    z, targets = rand(R, Vp), torch.randint(Vp, (R,), device=device)  # (R, Vp), (R,)
    heads = [s.transpose(1, 2) for s in (q, k, v)]  # (B, H, T, D) each
    xq, wq = ops.fp8_quantize(rand(R, C), "x"), ops.fp8_quantize(table, "w")  # (R, C), (Vp, C) e4m3fn
    hb, dhw, dhb = rand(Vp), rand(Vp, C, dtype=torch.float32), rand(Vp, dtype=torch.float32)  # the head's
    scaled_mm = "torch._scaled_mm" if device.type == "cuda" else "backend torch (fp32 matmul)"

    def sdpa_forward_backward():
        with torch.enable_grad():
            leaves = [_leaf(s) for s in heads]
            o = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=ATTN_SCALE)  # (B, H, T, D)
            o.backward(dout.view(B, T, H, D).transpose(1, 2))

    op = functools.partial(op_case, ops, TORCH_SPEEDRUN_OPS)
    cases = [
        op("embedding_forward", f"{B}x{T}x{C}", (idx, table), "F.embedding", lambda: F.embedding(idx, table)),
        op("embedding_backward", f"{B}x{T}x{C}", (dy.view(B, T, C), idx, dtable), "sort + cumsum + index_add_"),
        op("rmsnorm_forward", f"{N}x{C}", (x, w, eps), "backend torch (fp32 rsqrt)"),
        op("residual_rmsnorm_forward", f"{N}x{C}", (x, h, w, eps), "add + backend torch's"),
        op("rmsnorm_backward", f"{N}x{C}", (dy, x, w, rstd, dw, h), "backend torch (fp32)"),
        op("qk_norm_rotary_forward", f"{B}x{T}x{H}x{D}", (q, eps), "backend torch (fp32)"),
        op("qk_norm_rotary_backward", f"{B}x{T}x{H}x{D}", (dq, q, qrstd), "backend torch (fp32)"),
        op("scaled_attention_forward", f"{B}x{H}x{T}x{D}", (q, k, v, ATTN_SCALE), "SDPA causal",
           lambda: F.scaled_dot_product_attention(*heads, is_causal=True, scale=ATTN_SCALE)),
        ("scaled_attention_forward+backward", f"{B}x{H}x{T}x{D}",
         lambda: ops.scaled_attention_backward(dout, q, k, v, *ops.scaled_attention_forward(
             q, k, v, ATTN_SCALE), ATTN_SCALE),
         "SDPA causal fwd+bwd", sdpa_forward_backward, None),
        op("matmul_relu2_forward", f"mlp.fc {N}x{C}x{4 * C}", (xf, wf, bf), "F.linear + relu + square",
           lambda: F.relu(F.linear(xf, wf, bf)).square()),
        op("relu2_forward", f"{N}x{4 * C}", (pre,), "relu + square", lambda: F.relu(pre).square()),
        op("relu2_backward", f"{N}x{4 * C}", (dpre, pre), "backend torch"),
        op("softcap_crossentropy_forward_backward", f"{R}x{Vp}", (z, targets, 1.0), "backend torch (fp32 chunks)"),
        op("add_into", f"{N}x{C}", (x, h), "Tensor.add_", lambda: x.add_(h)),
        op("fp8_quantize", f"{Vp}x{C}", (table, "w"), "mul + clamp + cast"),
        op("fp8_matmul_forward", f"lm head {R}x{C}x{Vp}", (xq, wq, hb), scaled_mm),
        op("fp8_matmul_backward", f"lm head {R}x{C}x{Vp}", (z, xq, wq, dhw, dhb), f"cast + 2 x {scaled_mm} + sum"),
    ]
    for r, c, n in ((C, C, 4 * L), (4 * C, C, L), (C, 4 * C, L)):  # each shape Muon batches over
        ps = [rand(r, c, dtype=torch.float32) for _ in range(n)]
        gs, ms = [torch.randn_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        copies = [p.to(dt) for p in ps] if dt != torch.float32 else None
        args = (ps, gs, ms, copies, 1e-4, MUON_MOMENTUM, MUON_WEIGHT_DECAY, dt)
        cases.append(op("muon_update", f"{n} x {r}x{c}", args, "backend torch (torch.bmm)"))
    return cases


TOOLS["speedrun"] = RecipeTools(
    test_config=Config(recipe="speedrun", n_layer=2, n_head=1, n_embd=HEAD_DIM, vocab_size=61,
                       padded_vocab_size=64, seq_len=9, batch_size=2),  # one head
    test_cases=lambda: SPEEDRUN_OP_CASES, autograd_test="tests/test_speedrun_triton.py",
    bench_cases=speedrun_bench_cases)


if __name__ == "__main__":
    main()
