"""train_gpt2_torchfunc.py: GPT-2 as pure functions in PyTorch (torch.func + torch.compile).

The model is a pure function of a dict of tensors (llm.c's names, per-layer weights stacked along L, no
nn.Module); gradients come from torch.func, AdamW from multi-tensor torch._foreach_* ops, and
torch.compile compiles the gradient and the update (on by default with CUDA). Under torchrun it trains
data parallel, ZeRO-1 with --zero-stage 1. Formats, flags and logs: docs/FORMATS.md.

    python train_gpt2_torchfunc.py --data data/fineweb_edu                   # GPT-2 124M, llm.c recipe
    python train_gpt2_torchfunc.py --recipe speedrun --data data/fineweb_edu # the speedrun baseline
    python train_gpt2_torchfunc.py --data synthetic --steps 20 --batch-size 32 \\
        --val-every 0 --hellaswag-every 0 --sample-every 0 --ckpt-every 0    # benchmark: tokens/s, MFU
    torchrun --standalone --nproc_per_node=8 train_gpt2_torchfunc.py --data data/fineweb_edu
    python train_gpt2_torchfunc.py --init-from gpt2_124M.bin --eval-only --data data/fineweb_edu

Map: the file's sections, in order; the shared plumbing is a copy, held equal in every trainer by
tests/test_copies.py. Delete `Recipe: speedrun` and GPT-2 trains as before.
    GPT-2: config                          vocabulary, names, Config, Recipe, flags, shapes, init, model files
    GPT-2: model                           the forward, --recompute's reruns
    GPT-2: AdamW and the lr schedule       AdamW, clipping, llm.c's cosine schedule
    GPT-2: training step                   micro-batch gradients, the step, activation bytes, RECIPES' row
    Recipe: speedrun                       modded-nanogpt's baseline: config, model, Muon, model files, its row
    Torchfunc plumbing: state, evaluation and profiles   make_state, HellaSwag, samples, --profile
    Shared plumbing: flags, shards, checkpoints, out dir, logs, signals   the same in every trainer
    Shared torch plumbing: processes, ZeRO-1, evaluation   the same in both torch trainers
    Main                                   the run, top to bottom
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
import sys
import threading
import time
import weakref
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from tokenize import TokenError
from types import SimpleNamespace

import numpy as np
import safetensors
import safetensors.numpy
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

FRAMEWORK = "torchfunc"  # "jax" | "triton-<backend>" in the siblings

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
    # torch only: 1 = torch.compile (--compile defaults to 1 with CUDA, 0 on the CPU)
    compile: int = 1

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
    # torchfunc's own
    token_losses: Callable  # (params, x, y, cfg, train) -> per-token losses (B,T) fp32; train: the step's
    summed: bool            # the step's gradient is of the summed token losses (else of their mean)
    scalars: Callable       # (step, cfg, device) -> the update's host-computed scalars, a device tensor
    update: Callable        # (params, grads, m, v, scalars, coef, copies, cfg), in place
    embeddings: tuple       # tables kept fp32 in bf16 runs (gathered from, their gradients summed in fp32)
    next_logits: Callable   # (params, tokens (S,T), t, cfg) -> the logits (S,V) of position t's next token


ZERO_STAGES = (0, 1)


def framework_flags(p):
    """The flags of this trainer alone; parse_args adds the shared ones."""
    p.add_argument("--compile", type=int, choices=(0, 1), help="1: torch.compile the training step and the "
                   "evaluations (default 1 with CUDA, 0 on the CPU)")
    p.set_defaults(compile=int(torch.cuda.is_available()))


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
# GPT-2: model

def attention(q, k, v, cfg):
    """Causal self-attention of q, k, v (B,T,C) -> (B,T,C); heads are D-wide slices of C."""
    B, T, C = q.shape
    H, D = cfg.n_head, C // cfg.n_head
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))           # (B,H,T,D) each
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)                    # (B,H,T,D)
    return y.transpose(1, 2).reshape(B, T, C)                                      # (B,T,C)


# --recompute: torch.func refuses torch.utils.checkpoint's saved-tensor hooks, so autograd.Functions rerun
# the forward in the backward; after() keeps Inductor from fusing a rerun into the forward's kernels.
@torch.library.custom_op("llmc::after", mutates_args=())
def after(xs: list[torch.Tensor], g: torch.Tensor) -> list[torch.Tensor]:
    """Copies of xs that a compiled graph can only compute once g exists (an op opaque to Inductor)."""
    return [x.clone() for x in xs]


after.register_fake(lambda xs, g: [torch.empty_like(x) for x in xs])


class Recomputed(torch.autograd.Function):
    """f(*args) -> one tensor, keeping only args (n activations, then weights); the backward reruns f."""

    @staticmethod
    def forward(f, cfg, n, *args):
        return f(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.f, ctx.cfg, ctx.n = inputs[:3]
        ctx.save_for_backward(*inputs[3:])

    @staticmethod
    def backward(ctx, g):
        args = ctx.saved_tensors
        with autocast(ctx.cfg, g.device):
            f_vjp = torch.func.vjp(ctx.f, *after(args[:ctx.n], g), *args[ctx.n:])[1]  # f's output unkept
        return None, None, None, *f_vjp(g)


class LinearsAfter(Recomputed):
    """[F.linear(pre(x, *pre_args), w, b) for each (w, b)], keeping x and the weights; the backward reruns pre."""

    @staticmethod
    def forward(pre, cfg, n, x, *args):
        h = pre(x, *args[:n])                                                      # (B,T,Cin)
        return tuple(F.linear(h, w, b) for w, b in zip(args[n::2], args[n + 1::2]))  # (B,T,Cout) each

    @staticmethod
    def backward(ctx, *gs):
        x, *args = ctx.saved_tensors
        n, weights = ctx.n, args[ctx.n::2]
        with autocast(ctx.cfg, x.device):
            h, pre_vjp = torch.func.vjp(ctx.f, *after([x], gs[0]), *args[:n])     # (B,T,Cin)
        h2 = h.flatten(0, -2).to(weights[0].dtype)                                 # (BT,Cin), autocast's cast
        gs2 = [g.flatten(0, -2) for g in gs]                                       # (BT,Cout) each
        # the matmuls' gradients as autograd forms them (fp32 gives its bits): dh summed last matmul first
        grads = [d for g2 in gs2 for d in (g2.t().mm(h2), g2.sum(0))]             # (Cout,Cin), (Cout,) each
        dh = functools.reduce(torch.add, [g2.mm(w).view(h.shape).to(h.dtype)
                                          for g2, w in zip(gs2[::-1], weights[::-1])])  # (B,T,Cin)
        return None, None, None, *pre_vjp(dh), *grads


def linears(pre, x, pre_args, pairs, cfg):
    """[F.linear(pre(x, *pre_args), w, b) for (w, b) in pairs]; at --recompute pointwise by LinearsAfter."""
    tensors = [x, *pre_args, *[t for pair in pairs for t in pair]]
    if cfg.recompute == "pointwise" and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return LinearsAfter.apply(pre, cfg, len(pre_args), *tensors)
    h = pre(x, *pre_args)                                                          # (B,T,Cin)
    return [F.linear(h, w, b) for w, b in pairs]                                   # (B,T,Cout) each


def recomputed(f, cfg, level, acts, weights=()):
    """f(*acts, *weights); at --recompute `level` by Recomputed where autograd records it (else no rerun)."""
    if cfg.recompute == level and torch.is_grad_enabled() and any(t.requires_grad for t in [*acts, *weights]):
        return Recomputed.apply(f, cfg, len(acts), *acts, *weights)
    return f(*acts, *weights)


def layer_norm(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b, 1e-5)


def block(x, lp, cfg):
    """One pre-LN transformer block; lp holds this layer's slice of the stacked weights."""
    C = cfg.n_embd
    # q, k, v from c_attn's three row blocks: their gradients feed the matmuls as they are, where slicing
    # one (B,T,3C) product would copy the three into one (B,T,3C) tensor in every layer's backward
    q, k, v = linears(layer_norm, x, (lp["ln_1.w"], lp["ln_1.b"]),
                      [(lp["c_attn.w"][i * C:(i + 1) * C], lp["c_attn.b"][i * C:(i + 1) * C])
                       for i in range(3)], cfg)                                    # (B,T,C) each
    x = x + F.linear(attention(q, k, v, cfg), lp["attn.c_proj.w"], lp["attn.c_proj.b"])  # (B,T,C)
    h, = linears(layer_norm, x, (lp["ln_2.w"], lp["ln_2.b"]), [(lp["c_fc.w"], lp["c_fc.b"])], cfg)  # (B,T,4C)
    gelu = functools.partial(F.gelu, approximate="tanh")
    h, = linears(gelu, h, (), [(lp["mlp.c_proj.w"], lp["mlp.c_proj.b"])], cfg)         # (B,T,C)
    return x + h                                                                   # (B,T,C)


def autocast(cfg, device):
    """bf16 autocast for --dtype bf16, a no-op context for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")


def compute_dtype(cfg):
    return torch.bfloat16 if cfg.dtype == "bf16" else torch.float32


def transformer(params, idx, cfg):
    """Token ids idx (B,T) -> hidden states (B,T,C) after ln_f, in fp32 (call under autocast(cfg))."""
    # rows gathered from the fp32 tables, so the embeddings' scatter-add gradient is summed in fp32
    x = (params["wte"][idx] + params["wpe"][:idx.shape[1]]).to(compute_dtype(cfg))  # (B,T,C)
    # unbind: each stacked tensor's gradient is one stack, not a sum of L zero-padded (L, ...) copies
    layers = {k: params[k].unbind(0) for k in LAYER_NAMES}                        # L x (...) each
    for layer in range(cfg.n_layer):
        x = recomputed(lambda x, *ws: block(x, dict(zip(LAYER_NAMES, ws)), cfg), cfg, "block", [x],
                       [layers[k][layer] for k in LAYER_NAMES])                    # (B,T,C)
    return F.layer_norm(x, (cfg.n_embd,), params["ln_f.w"], params["ln_f.b"], 1e-5)  # (B,T,C)


def forward(params, idx, cfg):
    """Logits (B,T,Vp) of the lm head tied to wte; columns V..Vp-1 come from wte's padding rows."""
    with autocast(cfg, idx.device):
        return F.linear(transformer(params, idx, cfg), params["wte"])              # (B,T,Vp)


def next_logits(params, tokens, t, cfg):
    """The logits (S,V) of the token after position t of tokens (S,T), for sampling."""
    with autocast(cfg, tokens.device):
        h = transformer(params, tokens, cfg)[:, t]                                 # (S,C)
        return F.linear(h, params["wte"][:VOCAB_SIZE]).float()                     # (S,V)


class CrossEntropy(torch.autograd.Function):
    """(per-token loss (...,) fp32, logsumexp) of logits (..., Vp) over the first V columns; llm.c's backward."""

    @staticmethod
    def forward(logits, targets):
        xf = logits[..., :VOCAB_SIZE].float()                                     # (..., V)
        # max, then sum of exp(x - max): on a GPU Inductor merges the two into one online pass
        m = xf.amax(dim=-1, keepdim=True)                                         # (..., 1)
        lse = (m + (xf - m).exp().sum(dim=-1, keepdim=True).log())[..., 0]       # (...,)
        target_logit = logits.gather(-1, targets[..., None])[..., 0].float()     # (...,)
        return lse - target_logit, lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[1], output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, g, _):
        logits, targets, lse = ctx.saved_tensors
        col = torch.arange(logits.shape[-1], device=logits.device)                # (Vp,)
        probs = (logits.float() - lse[..., None]).exp()                           # (..., Vp)
        dlogits = torch.where(col == targets[..., None], probs - 1.0, probs) * g[..., None]  # (..., Vp)
        # the padded columns get no gradient (their probability is zero: they are outside the softmax)
        return torch.where(col < VOCAB_SIZE, dlogits, 0.0).to(logits.dtype), None


def token_losses(params, x, y, cfg, train=False):
    """Per-token cross-entropy (B,T) in fp32 of targets y (B,T) given inputs x (B,T) (train: the same)."""
    return CrossEntropy.apply(forward(params, x, cfg), y)[0]                      # (B,T)


# -----------------------------------------------------------------------------
# GPT-2: AdamW and the lr schedule

ADAM_BETA1, ADAM_BETA2, ADAM_EPS = 0.9, 0.95, 1e-8


def adam_scalars(step, cfg, device):
    """[lr, 1 - beta1^t, 1 - beta2^t] of 1-based step t as a device tensor: a new lr never recompiles."""
    return torch.tensor([cosine_lr(step - 1, cfg), 1.0 - ADAM_BETA1 ** step, 1.0 - ADAM_BETA2 ** step],
                        dtype=torch.float32, device=device)


EMBEDDINGS = ("wte", "wpe")  # no compute-dtype copies: gathered from in fp32 (the lm head casts wte)


def compute_copies(params, cfg):
    """{name: bf16 copy} of every master but the embedding tables with --dtype bf16; None in fp32."""
    embeddings = RECIPES[cfg.recipe].embeddings
    return None if cfg.dtype == "fp32" else {k: p.to(torch.bfloat16) for k, p in params.items() if k not in embeddings}


def model_weights(params, copies):
    """The tensors the model computes with: the masters, replaced by their copies where there are any."""
    return params if copies is None else {**params, **copies}


def global_norm(grads):
    """The L2 norm (clip_grad_norm_'s) of {name: gradient}, all of them or a ZeRO-1 shard's, in fp64."""
    # fp64: torch's fp32 CPU norms are 1e-5 off at wte's size; in 2 MiB pieces: a cast of wte pages in slowly
    pieces = [p for g in grads.values() for p in g.reshape(-1).split(1 << 18)]
    norms = torch._foreach_norm(pieces, dtype=torch.float64)                       # n x ()
    return torch.linalg.vector_norm(torch.stack(norms)).float()                    # ()


def adam_step(p, g, m, v, lr, bias1, bias2, betas, eps, decay):
    """torch.optim.AdamW's step on lists of tensors, in place (bias1, bias2: 1 - beta^t)."""
    # all in place but the denominator's first op: on the CPU a new tensor costs a page fault per 4 KiB
    torch._foreach_lerp_(m, g, 1.0 - betas[0])                                     # m = b1 m + (1-b1) g
    torch._foreach_mul_(v, betas[1])
    torch._foreach_addcmul_(v, g, g, value=1.0 - betas[1])                         # v = b2 v + (1-b2) g^2
    denom = torch._foreach_div(v, bias2)                                           # vhat
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    # p + m / (denom x -bias1/lr) = p - lr mhat / (sqrt(vhat) + eps)
    torch._foreach_mul_(denom, -bias1 / lr)
    if decay:
        torch._foreach_mul_(p, 1.0 - lr * decay)
    torch._foreach_addcdiv_(p, m, denom)


def adamw_update(params, grads, m, v, scalars, coef, copies, cfg):
    """llm.c's AdamW in place on the gradients times coef, then the copies refreshed (ZeRO-1: 1-D pieces)."""
    if cfg.grad_clip > 0:  # times coef, 1 unless the norm is over: the same graph every step
        torch._foreach_mul_(list(grads.values()), coef)
    for decays in (True, False):
        names = [k for k in grads if (k in DECAY_NAMES) == decays]
        if names:
            adam_step(*([d[k] for k in names] for d in (params, grads, m, v)), scalars[0], scalars[1], scalars[2],
                      (ADAM_BETA1, ADAM_BETA2), ADAM_EPS, cfg.weight_decay if decays else 0.0)
    if copies is not None:
        torch._foreach_copy_(list(copies.values()), [params[k] for k in copies])


def cosine_lr(it, cfg):
    """llm.c's lr of 0-based iteration `it`: a linear warmup, then a cosine down to lr*lr_decay_frac."""
    min_lr = cfg.lr * cfg.lr_decay_frac
    if it < cfg.warmup:
        return cfg.lr * (it + 1) / cfg.warmup
    ratio = (it - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (cfg.lr - min_lr)


# -----------------------------------------------------------------------------
# GPT-2: training step

def loss_fn(params, x, y, cfg):
    """The loss one batch contributes, fp32: the recipe's mean token loss, or its sum (Recipe.summed)."""
    recipe = RECIPES[cfg.recipe]
    losses = recipe.token_losses(params, x, y, cfg, train=True)                    # (B,T)
    return losses.sum() if recipe.summed else losses.mean()


def grads_and_loss(weights, x, y, scale, cfg):
    """({name: gradient in its weight's dtype}, loss) of scale x loss_fn on one micro-batch, by torch.func."""
    def scaled_loss(weights):
        return loss_fn(weights, x, y, cfg) * scale
    if torch.compiler.is_compiling():  # not vjp: Dynamo fails on a vjp in its backward, as --recompute's are
        return torch.func.grad_and_value(scaled_loss)(weights)
    # eager, vjp: grad's backward keeps a graph of itself, every saved tensor to the end (527 MB against 313)
    loss, loss_vjp = torch.func.vjp(scaled_loss, weights)
    return loss_vjp(torch.ones_like(loss), retain_graph=False, create_graph=False)[0], loss


GRADIENT = "gradient"  # the profiler's name for one grad_fn call


def train_step(state, x, y, scalars, cfg, grad_fn, update_fn, world):
    """One step on micro-batches x, y (A,B,T), in place: (mean token loss, norm before clipping), 0-d, unsynced."""
    weights, grads = state["weights"], state["grads"]
    summed = RECIPES[cfg.recipe].summed
    scale = 1.0 if summed else 1.0 / (len(x) * world)
    for i in range(len(x)):
        with torch.profiler.record_function(GRADIENT):  # for --profile's split into forward and backward
            micro_grads, micro_loss = grad_fn(weights, x[i], y[i], scale, cfg)
        # fp32 sums in the flat buffer: the first micro-batch's copied in, the rest added
        accumulate = torch._foreach_add_ if i else torch._foreach_copy_
        accumulate(list(grads.values()), [micro_grads[k] for k in grads])
        loss = loss + micro_loss if i else micro_loss                              # ()
    # ZeRO-1: reduce-scatter the gradients, update this process's shard, all-gather; else one all-reduce
    sharded = cfg.zero_stage == 1 and world > 1
    if world > 1:
        dist.all_reduce(loss)
    if sharded:
        for group in state["groups"]:
            dist.reduce_scatter_single(group["grads"], state["grad_buffer"][slice(*group["span"])])
    elif world > 1:
        dist.all_reduce(state["grad_buffer"])
    norm = global_norm(state["shard_grads"])                                       # ()
    if sharded:
        squares = norm.double().square()                                           # ()
        dist.all_reduce(squares)
        norm = squares.sqrt().float()                                              # ()
    coef = torch.clamp(cfg.grad_clip / (norm + 1e-6), max=1.0)  # (); applied only where --grad-clip clips
    update_fn(state["shard_params"], state["shard_grads"], state["m"], state["v"], scalars, coef,
              state["shard_copies"], cfg)
    if sharded:
        for group in state["groups"]:
            dist.all_gather_single(group["weights"], group["own_weights"])
    return (loss / cfg.total_batch_size if summed else loss), norm


def gpt2_activation_bytes(cfg):
    """Bytes of one micro-batch's activations at the peak of its eager forward+backward at cfg.recompute."""
    N, C, V, H = cfg.batch_size * cfg.seq_len, cfg.n_embd, cfg.padded_vocab_size, cfg.n_head
    s = compute_dtype(cfg).itemsize  # the activations' bytes; the fp32 ones say 4
    kept = {  # per block, from its forward to its backward: (B,T,C) each unless said
        # x, ln_1's output, q, k, v, the attention's output, x + attention, ln_2's output, c_fc's and GELU's
        # outputs (B,T,4C); fp32: mean and rstd (B,T) of both LayerNorms, the attention's logsumexp (B,H,T)
        "none": (C + C + 3 * C + C + C + C + 4 * C + 4 * C) * s + (4 + H) * 4,
        # x, q, k, v, the attention's output, x + attention, c_fc's output (B,T,4C); the logsumexp
        "pointwise": (C + 3 * C + C + C + 4 * C) * s + H * 4,
        "block": C * s,  # x alone
    }[cfg.recompute]
    # ln_f's input and output (B,T,C), the logits (B,T,Vp); the cross-entropy's backward: softmax, softmax
    # minus one-hot and the gradient (B,T,Vp) fp32, the target mask (B,T,Vp) bool
    head = 2 * C * s + V * s + 3 * V * 4 + V
    in_block = {  # a block's backward at its peak, in its MLP's, beyond what the blocks keep:
        "none": (C + 4 * C) * s,  # the gradients at the block's output (B,T,C) and at GELU's output (B,T,4C)
        # those two, c_fc's output's copy (after()), GELU's output rerun, the gradient at GELU's input (B,T,4C)
        "pointwise": (C + 4 * C + 4 * C + 4 * C + 4 * C) * s,
        # those two and GELU's input's gradient, x's copy (after()), the rerun (none's beyond x), its output
        "block": (C + 4 * C + 4 * C + C + 15 * C + C) * s,
    }[cfg.recompute]
    return N * (cfg.n_layer * kept + max(head, in_block))


RECIPES = {"gpt2": Recipe(
    help="llm.c's GPT-2 and AdamW", defaults={}, configure=configure_gpt2, shapes=gpt2_shapes, init=init_gpt2_numpy,
    lr_at=cosine_lr, muon_names=lambda shapes: [], model_file="model.bin", file_kind="an llm.c model file (.bin)",
    is_file=lambda head: head[:4] == MODEL_MAGIC.to_bytes(4, "little"), read_file=read_model_file,
    write_file=write_model_file, model_name="GPT-2", table="wpe", optimizers="AdamW", scalars=adam_scalars,
    activation_bytes=gpt2_activation_bytes, token_losses=token_losses, summed=False, update=adamw_update,
    embeddings=EMBEDDINGS, next_logits=next_logits)}


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


# -- model


def rotary(x):
    """The reference's half-truncated rotary embedding of q or k (B,T,H,D): the halves' first D/4 pairs turn."""
    T, D = x.shape[1], x.shape[3]
    freq = (1 / 1024) ** torch.linspace(0, 1, D // 4, dtype=torch.float32, device=x.device)  # (D/4,)
    freq = torch.cat([freq, freq.new_zeros(D // 4)])                                # (D/2,)
    theta = torch.outer(torch.arange(T, dtype=torch.float32, device=x.device), freq)[None, :, None]  # (1,T,1,D/2)
    cos, sin = theta.cos(), theta.sin()                                            # (1,T,1,D/2) each
    x1, x2 = x.float().chunk(2, dim=-1)                                            # (B,T,H,D/2) each
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), -1).type_as(x)   # (B,T,H,D)


def speedrun_attention(q, k, v, cfg):
    """Causal attention (B,T,C) of q, k, v (B,T,H,D), after q's and k's RMSNorm and rotary."""
    B, T, H, D = q.shape
    q, k = (rotary(F.rms_norm(t, (D,), eps=torch.finfo(compute_dtype(cfg)).eps)) for t in (q, k))  # (B,T,H,D) each
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       scale=ATTN_SCALE, is_causal=True)           # (B,H,T,D)
    return y.transpose(1, 2).reshape(B, T, H * D)                                  # (B,T,C)


def speedrun_block(x, w, cfg):
    """The reference's pre-norm block, with one layer's weights w (the names after blocks.<layer>.)."""
    B, T, C = x.shape
    H, D = C // HEAD_DIM, HEAD_DIM

    def rms_norm(x, gains):
        return F.rms_norm(x, (C,), gains, torch.finfo(compute_dtype(cfg)).eps)
    pairs = [(w[f"attn.{n}.weight"], w[f"attn.{n}.bias"]) for n in "qkv"]
    q, k, v = (t.view(B, T, H, D) for t in linears(rms_norm, x, (w["norm1.gains"],), pairs, cfg))  # (B,T,H,D) each
    # at --recompute pointwise the attention reruns too: its backward needs the q/k norms' rerun outputs
    y = recomputed(functools.partial(speedrun_attention, cfg=cfg), cfg, "pointwise", [q, k, v])  # (B,T,C)
    x = x + F.linear(y, w["attn.proj.weight"], w["attn.proj.bias"])                # (B,T,C)
    h, = linears(rms_norm, x, (w["norm2.gains"],), [(w["mlp.fc.weight"], w["mlp.fc.bias"])], cfg)  # (B,T,4C)
    h, = linears(lambda h: F.relu(h).square(), h, (), [(w["mlp.proj.weight"], w["mlp.proj.bias"])], cfg)  # (B,T,C)
    return x + h                                                                   # (B,T,C)


def speedrun_transformer(params, idx, cfg):
    """Token ids idx (B,T) -> hidden states (B,T,C) after the final RMSNorm (call under autocast(cfg))."""
    C, dt = cfg.n_embd, compute_dtype(cfg)
    eps = torch.finfo(dt).eps
    # rows of the fp32 table by F.embedding, whose backward adds into one zeroed table (indexing copies it)
    x = F.rms_norm(F.embedding(idx, params["embed.weight"]).to(dt), (C,), params["norm1.gains"], eps).to(dt)  # (B,T,C)
    parts = [k[len("blocks.0."):] for k in params if k.startswith("blocks.0.")]  # a layer's weights' names
    for layer in range(cfg.n_layer):
        x = recomputed(lambda x, *ws: speedrun_block(x, dict(zip(parts, ws)), cfg), cfg, "block", [x],
                       [params[f"blocks.{layer}.{n}"] for n in parts])             # (B,T,C)
    return F.rms_norm(x, (C,), params["norm2.gains"], eps)                         # (B,T,C)


class FP8HeadMatmul(torch.autograd.Function):
    """(z, h_f8, W_f8): z (N,V) = h (N,C) W^T on --fp8-head's FP8 operands (docs/FORMATS.md), dz in e5m2."""

    @staticmethod
    def forward(h, w):
        h_f8, w_f8 = fp8_quantize(h, "x"), fp8_quantize(w, "w")                   # (N,C), (V,C) e4m3fn
        z = fp8_matmul(h_f8, w_f8.t(), FP8_SCALES["x"], FP8_SCALES["w"], h.dtype, fast_accum=True)  # (N,V)
        return z, h_f8, w_f8

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*output[1:])
        ctx.mark_non_differentiable(*output[1:])
        ctx.h_dtype = inputs[0].dtype

    @staticmethod
    def backward(ctx, dz, *_):
        h_f8, w_f8 = ctx.saved_tensors
        g_f8 = fp8_quantize(dz, "grad")                                           # (N,V) e5m2
        dh = fp8_matmul(g_f8, w_f8, FP8_SCALES["grad"], FP8_SCALES["w"], ctx.h_dtype)  # (N,C)
        dw = fp8_matmul(g_f8.t(), h_f8, FP8_SCALES["grad"], FP8_SCALES["x"], torch.float32)  # (V,C)
        return dh, dw


def softcap(z):
    """(15 z / sqrt(z^2 + 15^2), 1 / sqrt(z^2 + 15^2)) in fp32 of the head's output z (..., V)."""
    z = z.float()                                                                  # (..., V)
    r = z.square().add_(SOFTCAP**2).rsqrt_()                                       # (..., V)
    return torch.mul(z, SOFTCAP).mul_(r), r                                        # (..., V) each


def speedrun_logits(h, weight, bias):
    """The head's logits z = h W^T + b in fp32, soft-capped (softcap): (..., rows of W)."""
    return softcap(F.linear(h, weight, bias))[0]                                   # (..., V)


class SoftcapCrossEntropy(CrossEntropy):
    """CrossEntropy of the head's output z (..., Vp) soft-capped, over all Vp columns; dz formed in place."""

    @staticmethod
    def forward(z, targets):
        c = softcap(z)[0]                                                          # (..., Vp)
        # not F.cross_entropy: on the CPU its sums over mostly equal logits round one way, up to 4e-5 off
        lse = torch.logsumexp(c, -1)                                               # (...,)
        return lse - c.gather(-1, targets[..., None])[..., 0], lse

    @staticmethod
    def backward(ctx, g, _):
        z, targets, lse = ctx.saved_tensors
        dz, r = softcap(z)                                                         # (..., Vp) each
        dz.sub_(lse[..., None]).exp_()                                             # softmax (..., Vp)
        dz.scatter_add_(-1, targets[..., None], torch.full_like(lse[..., None], -1.0))  # minus the one-hot
        dz.mul_(g[..., None]).mul_(r.pow_(3).mul_(SOFTCAP**3))                     # times dc/dz (..., Vp)
        return dz.to(z.dtype), None


def speedrun_next_logits(params, tokens, t, cfg):
    """The logits (S,V) of the token after position t of tokens (S,T), for sampling."""
    with autocast(cfg, tokens.device):
        h = speedrun_transformer(params, tokens, cfg)[:, t]                        # (S,C)
        return speedrun_logits(h, params["proj.weight"][:VOCAB_SIZE], params["proj.bias"][:VOCAB_SIZE])


def speedrun_token_losses(params, x, y, cfg, train=False):
    """Per-token cross-entropy (B,T) in fp32 over all Vp columns (train: with --fp8-head's matmul)."""
    with autocast(cfg, x.device):
        h = speedrun_transformer(params, x, cfg)                                   # (B,T,C)
        if train and cfg.fp8_head:
            z = FP8HeadMatmul.apply(h.flatten(0, 1), params["proj.weight"])[0]     # (B*T,Vp)
            z = z.view(*h.shape[:2], -1) + params["proj.bias"]                     # (B,T,Vp)
        else:
            z = F.linear(h, params["proj.weight"], params["proj.bias"])            # (B,T,Vp)
    return SoftcapCrossEntropy.apply(z, y)[0]                                      # (B,T)


# -- optimizer

def speedrun_scalars(step, cfg, device):
    """[lr of each SPEEDRUN_LRS group, 1 - beta1^t, 1 - beta2^t] for 1-based step t (adam_scalars')."""
    return torch.tensor([*speedrun_lrs(step - 1, cfg).values(), 1.0 - SPEEDRUN_BETA1 ** step,
                         1.0 - SPEEDRUN_BETA2 ** step], dtype=torch.float32, device=device)


def speedrun_adamw(names, params, grads, m, v, lr, bias1, bias2, weight_decay):
    """AdamW with the speedrun recipe's betas and eps on the tensors `names`, in place (adam_step)."""
    adam_step(*([d[k] for k in names] for d in (params, grads, m, v)), lr, bias1, bias2,
              (SPEEDRUN_BETA1, SPEEDRUN_BETA2), SPEEDRUN_EPS, weight_decay)


def speedrun_muon(names, params, grads, m, lr, dtype):
    """Muon on the matrices `names`, all of one shape (r,c), in place, newton_schulz batched over them."""
    g, momentum, p = ([d[k] for k in names] for d in (grads, m, params))
    torch._foreach_lerp_(momentum, g, 1.0 - MUON_MOMENTUM)
    u = torch.stack(torch._foreach_lerp(g, momentum, MUON_MOMENTUM))              # (n,r,c) Nesterov
    r, c = u.shape[1:]
    update = newton_schulz(u, dtype).float() * max(1.0, r / c) ** 0.5             # (n,r,c)
    torch._foreach_mul_(p, 1.0 - lr * MUON_WEIGHT_DECAY)
    torch._foreach_sub_(p, list((update * lr).unbind(0)))


def speedrun_update(params, grads, m, v, scalars, coef, copies, cfg):
    """The speedrun step in place on the gradients times coef: AdamW on v's tensors by group, Muon on the rest."""
    lr = dict(zip(SPEEDRUN_LRS, scalars[:4]))
    if cfg.grad_clip > 0:  # times coef, 1 unless the norm is over: the same graph every step
        torch._foreach_mul_(list(grads.values()), coef)
    for group in ("embed", "head", "vector"):
        names = [k for k in grads if k in v and ADAMW_GROUPS.get(k, "vector") == group]
        if names:
            speedrun_adamw(names, params, grads, m, v, lr[group], scalars[4], scalars[5], cfg.weight_decay)
    muon = [k for k in grads if k not in v]
    for shape in dict.fromkeys(params[k].shape for k in muon):
        speedrun_muon([k for k in muon if params[k].shape == shape], params, grads, m, lr["muon"], compute_dtype(cfg))
    if copies is not None:
        torch._foreach_copy_(list(copies.values()), [params[k] for k in copies])


# -- training step

def speedrun_activation_bytes(cfg):
    """gpt2_activation_bytes for the speedrun model."""
    N, C, V, H = cfg.batch_size * cfg.seq_len, cfg.n_embd, cfg.padded_vocab_size, cfg.n_head
    s = compute_dtype(cfg).itemsize  # the activations' bytes; the fp32 ones say 4
    kept = {  # per block, from its forward to its backward: (B,T,C) each unless said
        # x, norm1's normalized x and output, q, k, v, q and k after their norm and rotary, the attention's
        # output, x + attention, norm2's normalized x and output, ReLU's output and ReLU^2 (B,T,4C); fp32: rstd
        # (B,T) of norm1 and norm2, (B,T,H) of q's and k's norms, the attention's logsumexp (B,H,T)
        "none": (C + 2 * C + 3 * C + 2 * C + C + C + 2 * C + 4 * C + 4 * C) * s + (2 + 3 * H) * 4,
        # x, q, k, v, the attention's output, x + attention, fc's output (B,T,4C); the attention reruns
        "pointwise": (C + 3 * C + C + C + 4 * C) * s,
        "block": C * s,  # x alone
    }[cfg.recompute]
    embed = 2 * C * s  # the embedding's rows and their norm's normalized x (B,T,C)
    # the last block's output, the final norm's normalized x and output (B,T,C), the head's output z (B,T,Vp)
    # that the loss keeps, the loss's two fp32 (B,T,Vp) temporaries
    head = 3 * C * s + V * s + 2 * V * 4
    in_block = {  # a block's backward at its peak, in square's, beyond what the blocks keep: (B,T,4C) unless said
        # the gradients at the block's output (B,T,C) and at ReLU^2, square's three temporaries, less ReLU^2
        "none": (C + 4 * C + 3 * 4 * C - 4 * C) * s,
        # those gradients and temporaries, fc's output's copy (after()), ReLU's output and ReLU^2 rerun
        "pointwise": (C + 4 * C + 3 * 4 * C + 4 * C + 2 * 4 * C) * s,
        # those, x's copy (after(), B,T,C), the rerun (what none keeps beyond x) and its output (B,T,C)
        "block": (C + 4 * C + 3 * 4 * C + C + 19 * C + C) * s,
    }[cfg.recompute]
    return N * (cfg.n_layer * kept + embed + max(head, in_block))


RECIPES["speedrun"] = Recipe(
    help=SPEEDRUN_HELP, defaults={**SPEEDRUN_DEFAULTS, "out_dir": f"out/speedrun_{FRAMEWORK}"},
    configure=configure_speedrun, shapes=speedrun_shapes, init=init_speedrun_numpy, lr_at=speedrun_lr,
    muon_names=muon_names, model_file="model.safetensors", is_file=lambda head: head[8:9] == b"{",
    file_kind="a safetensors file of the reference's state_dict (.safetensors)", read_file=read_speedrun_file,
    write_file=write_speedrun_file, model_name="speedrun GPT", table="embed.weight", optimizers="AdamW and Muon",
    activation_bytes=speedrun_activation_bytes, token_losses=speedrun_token_losses, summed=True,
    scalars=speedrun_scalars, update=speedrun_update, embeddings=("embed.weight",), next_logits=speedrun_next_logits)


# -----------------------------------------------------------------------------
# Torchfunc plumbing: state, evaluation and profiles

def compute_groups(cfg):
    """[(names, dtype)] of the tensors the model computes with, each group a stretch of the flat buffers."""
    recipe, shapes = RECIPES[cfg.recipe], param_shapes(cfg)
    muon = recipe.muon_names(shapes)
    names = [k for k in shapes if k not in muon]
    groups = [(names, torch.float32)] if cfg.dtype == "fp32" else [
        ([k for k in names if k in recipe.embeddings], torch.float32),
        ([k for k in names if k not in recipe.embeddings], torch.bfloat16)]
    return groups + ([(muon, compute_dtype(cfg))] if muon else [])


def make_state(params, m, v, cfg, device, rank, world):
    """The state on the device: `grads` (views of `grad_buffer`), `weights`, and the `shard_*` train_step updates."""
    shapes = param_shapes(cfg)
    muon = RECIPES[cfg.recipe].muon_names(shapes)
    layout = state_layout(compute_groups(cfg), muon, shapes, world)
    _, starts, spans = layout
    buffer = torch.zeros(spans[-1][1], dtype=torch.float32, device=device)         # (P,) padded
    state = {"grad_buffer": buffer, "grads": flat_views(buffer, starts, shapes, list(shapes)), "starts": starts}
    if cfg.zero_stage == 0:  # a process's shard is the whole model (masters, bf16 copies, moments)
        state.update(params=to_device(params, device), m=to_device(m, device), v=to_device(v, device))
        state["copies"] = compute_copies(state["params"], cfg)  # refreshed by every update from then on
        state["weights"] = model_weights(state["params"], state["copies"])
        state.update(shard_params=state["params"], shard_grads=state["grads"], shard_copies=state["copies"])
        return state
    return sharded_state(state, params, m, v, shapes, layout, muon, device, rank, world)


def device_state_bytes(cfg, shapes, world):
    """Bytes of make_state's tensors in one process, by kind (state_bytes of this trainer's layout)."""
    muon = RECIPES[cfg.recipe].muon_names(shapes)
    layout = state_layout(compute_groups(cfg), muon, shapes, world)
    return state_bytes(cfg.zero_stage, shapes, layout, muon, world)


def generate(params, generator, cfg, prompt):
    """SAMPLE_COUNT top-k continuations of the tokens prompt: token ids (S,T), prompt first; eager, no KV cache."""
    T = min(cfg.block_size, len(prompt) + cfg.sample_tokens)
    tokens = torch.tensor(prompt + [EOT] * (T - len(prompt)), device=next(iter(params.values())).device)
    tokens = tokens.repeat(SAMPLE_COUNT, 1)                                        # (S,T)
    for t in range(len(prompt) - 1, T - 1):                                        # token t+1 from 0..t
        logits = RECIPES[cfg.recipe].next_logits(params, tokens, t, cfg)          # (S,V)
        top_logits, top_ids = torch.topk(logits, min(cfg.top_k or VOCAB_SIZE, VOCAB_SIZE), dim=-1)  # (S,K) each
        choice = torch.multinomial(torch.softmax(top_logits, dim=-1), 1, generator=generator)  # (S,1)
        tokens[:, t + 1] = torch.gather(top_ids, -1, choice)[:, 0]
    return tokens


def say_profile(profiler, steps, ms, cfg, on_gpu, rank, say, rows=8):
    """--profile's end: `steps`' trace written, torch's op table, self time per op by phase, their times `ms`."""
    profiler.stop()
    trace = os.path.join(cfg.out_dir, "profile", f"trace_rank{rank}.json")
    os.makedirs(os.path.dirname(trace), exist_ok=True)
    profiler.export_chrome_trace(trace)
    say(profiler.key_averages().table(sort_by=f"self_{'device' if on_gpu else 'cpu'}_time_total", row_limit=25))
    phases = ["forward+backward (compiled)" if cfg.compile else "forward", "backward", "optimizer step"]
    totals = {}  # (phase, op name) -> (calls, microseconds)
    for e in profiler.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue  # a kernel's time counts for the op that launched it
        phase, p = phases[2], e
        while p is not None and phase == phases[2]:  # the innermost mark above the op decides
            if p.name.startswith("autograd::engine::evaluate_function"):
                phase = phases[1]
            elif p.name == GRADIENT:
                phase = phases[0]
            p = p.cpu_parent
        calls, us = totals.get((phase, e.name), (0, 0.0))
        totals[phase, e.name] = calls + 1, us + (e.self_device_time_total if on_gpu else e.self_cpu_time_total)
    grand = sum(t for _, t in totals.values()) or 1.0

    def line(phase, name, calls, us):
        n = len(steps)
        return f"{phase:<28} {name[:50]:<50} {calls // n:>6} {us / 1e3 / n:>9.3f} {100 * us / grand:>5.1f}%"

    op = f"op (self {'device' if on_gpu else 'CPU'} time)"
    lines = [f"{'phase':<28} {op:<50} {'calls':>6} {'ms/step':>9} {'share':>6}"]
    for phase in phases:
        ops = sorted(((t, c, name) for (ph, name), (c, t) in totals.items() if ph == phase), reverse=True)
        lines.append(line(phase, "all", sum(c for _, c, _ in ops), sum(t for t, _, _ in ops)))
        lines += [line("", name, c, t) for t, c, name in ops[:rows]]
    say("\n".join(lines))
    say(f"profile: steps {steps[0]}-{steps[-1]} traced into {trace} (Perfetto or chrome://tracing) | step time "
        f"mean {np.mean(ms):.1f} ms, min {min(ms):.1f} ms, max {max(ms):.1f} ms")


# Inductor's mix-order reduction (on GPUs since torch 2.10) drops the write of a column sum into a slice of
# a concatenated buffer, as our stacked LayerNorm and bias gradients are: uninitialized gradients with it on.
INDUCTOR_OPTIONS = {"triton.mix_order_reduction": False}


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
    dtype = default_dtype(cfg, gpu=torch.cuda.is_available())  # the device setup_device picks
    rank, world, device, store = setup_device(cfg)
    on_gpu = device.type == "cuda"
    master = signals.master = rank == 0
    say = print if master else (lambda *args, **kwargs: None)

    # weights, optimizer state, data (each process reads B rows of a micro-batch) and the locked out dir
    def any_failed(failed):  # True in every process when any passes True
        flag = torch.tensor([int(failed)], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
    step, spent, params, m, v, grad_accum, train_loader, val_loader, sampler, lock = open_run(  # noqa: F841
        cfg, explicit, cfg.batch_size, rank, world, master, say, any_failed if world > 1 else None)
    if cfg.sample_only:  # the weights as the run computes with them: no optimizer state
        masters = to_device(params, device)
        return say_samples(model_weights(masters, compute_copies(masters, cfg)), step, cfg, device, sampler, say)
    state = make_state(params, m, v, cfg, device, rank, world)
    weights = state["weights"]  # what evaluation and sampling compute with
    recipe = RECIPES[cfg.recipe]
    # the table that only gathers rows (GPT-2's wte is also its head) counts for no flops
    n_params = sum(p.numel() for k, p in weights.items() if k != recipe.table)
    device_kind = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    say(f"{recipe.model_name} L{cfg.n_layer} H{cfg.n_head} C{cfg.n_embd}, {n_params / 1e6:.2f}M parameters "
        f"(without {recipe.table}) | {world} x {device_kind} | {dtype} | compile: {'on' if cfg.compile else 'off'}")
    say(f"batch: {cfg.batch_size} x {cfg.seq_len} tokens x {world} devices x {grad_accum} micro-batches = "
        f"{cfg.total_batch_size} tokens per step | data: {cfg.data}")
    held = device_state_bytes(cfg, param_shapes(cfg), world)
    activations = recipe.activation_bytes(cfg)
    say(format_memory(cfg, held, activations, world, recipe.optimizers))
    warning = not on_gpu and memory_warning(held, activations, world, host_memory_available())
    if warning:  # on a GPU, running out is an error the trainer reports (fail_on_out_of_memory)
        say(warning)
    if master:
        log_event(cfg.out_dir, FRAMEWORK, event="start", step=step, devices=world, state_bytes=held,  # docs/FORMATS.md
                  activation_bytes=activations, config=dict(vars(cfg)))

    with fail_on_out_of_memory(cfg), fail_on_lost_peer(store, rank, world):
        def compile_(fn, **kwargs):
            return torch.compile(fn, options=INDUCTOR_OPTIONS, **kwargs) if cfg.compile else fn

        row_losses = compile_(recipe.token_losses, dynamic=False)

        def run_evals(step, val, swag):
            if val and val_loader is not None:
                val_loss = evaluate_val(row_losses, weights, val_loader, cfg, device, world)
                say(f"step {step:5d} | val loss {val_loss:.6f}")
                if master:
                    log_event(cfg.out_dir, FRAMEWORK, step=step, val_loss=val_loss)
            if swag and master:
                acc, acc_norm = evaluate_hellaswag(row_losses, weights, cfg, device)
                say(f"step {step:5d} | hellaswag acc {acc:.4f} acc_norm {acc_norm:.4f}")
                log_event(cfg.out_dir, FRAMEWORK, step=step, hellaswag_acc=acc, hellaswag_acc_norm=acc_norm)

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

        # compiled on the first call, that is inside step 1: its time is reported as compile time
        grad_fn = compile_(grads_and_loss, fullgraph=True)
        update_fn = compile_(recipe.update, fullgraph=True)

        flops = step_flops(cfg, n_params, device_kind if on_gpu else "", world)
        absent = ([f"mfu (no peak FLOP/s known for {device_kind})"] * (flops[1] is None)
                  + ["mem (no memory statistics)"] * (peak_memory_gb(device) is None))
        if absent:
            say(f"step lines without {' and '.join(absent)}")
        first = step + 1
        profile_steps = range(min(first + 1, cfg.steps), min(first + PROFILE_STEPS, cfg.steps) + 1)
        profiler = torch.profiler.profile() if cfg.profile else None  # the CPU's ops, and CUDA's on a GPU
        times = {}  # step -> seconds
        signals.training = True  # from here a signal stops the run at the end of a step
        for step in range(first, cfg.steps + 1):
            if cfg.profile and step == profile_steps[0]:
                profiler.start()
            t0 = time.perf_counter()
            x, y = (put_batch(b, device) for b in step_batches(train_loader, grad_accum))  # (A,B,T) each
            scalars = recipe.scalars(step, cfg, device)                            # (3,) or (6,)
            loss, norm = train_step(state, x, y, scalars, cfg, grad_fn, update_fn, world)
            loss, norm = loss.item(), norm.item()  # waits for the device: dt spans the whole step
            times[step] = dt = time.perf_counter() - t0
            spent += dt  # the run's step time, its earlier launches' too: what --time-budget counts
            if not (math.isfinite(loss) and math.isfinite(norm)):  # the same in every process: stopped before the log
                latest = sorted(glob.glob(os.path.join(glob.escape(cfg.out_dir), "ckpt_*[0-9]")))
                kept = f"{latest[-1]} stays the latest checkpoint" if latest else "no checkpoint was written"
                die(f"step {step}: loss {loss}, grad norm {norm}: the run diverged (try a lower --lr or a "
                    f"--grad-clip); stopped before logging or saving this step, {kept}")
            # --time-budget and signals: all processes must stop at the same step
            budget_spent, signum = bool(cfg.time_budget) and spent >= cfg.time_budget, signals.received
            if world > 1:
                flags = torch.tensor([int(budget_spent and rank == 0), signum], dtype=torch.int64, device=device)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # process 0's clock, a signal to any process
                budget_spent, signum = flags.tolist()
            last = step if budget_spent or signum else cfg.steps
            if cfg.compile and step == first:
                say(f"compiled train step in {dt:.1f} s (compilation and step {step})")
            if cfg.profile and step == profile_steps[-1]:
                say_profile(profiler, profile_steps, [1000 * times[s] for s in profile_steps], cfg, on_gpu, rank, say)
            report_step(step, cfg, loss, norm, recipe.lr_at(step - 1, cfg), dt, peak_memory_gb(device), flops,
                        FRAMEWORK, master, say)
            # the checkpoint before a signal's stop and the evaluations (--resume runs those log.jsonl lacks)
            checkpoint_if_due(state, step, last, train_loader, cfg, recipe, world, master, say, spent)
            stop_on_signal(signum, step, cfg, master)
            run_evals(step, due(cfg.val_every, step, last), due(cfg.hellaswag_every, step, last))
            if sampler and master and due(cfg.sample_every, step, last):
                say_samples(weights, step, cfg, device, sampler, say)
            if budget_spent:
                say(f"--time-budget {cfg.time_budget:g} s reached: stopped after step {step} of {cfg.steps}")
                break

    say(format_mean(times, first, profile_steps if cfg.profile else (), cfg, flops))


if __name__ == "__main__":
    main()
