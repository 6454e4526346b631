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

Map: the file's sections, in order. Delete `Recipe: speedrun` and GPT-2 trains as before.
    GPT-2: config                          Config, the Recipe row type, this trainer's own flags
    GPT-2: model                           shapes, init, the forward, --recompute's reruns, llm.c's model file
    GPT-2: AdamW and the lr schedule       llm.c's cosine schedule, AdamW, clipping
    GPT-2: training step                   micro-batch gradients, the step, activation bytes, RECIPES' row
    Recipe: speedrun                       modded-nanogpt's baseline: model, Muon, model files, its row
    Flags and recipe lookups               parse_args, and what the rest of the file asks of a recipe
    Data                                   llm.c's token shards and the loader
    Checkpoints                            writing, finding and reading checkpoints
    Evaluation and logging                 validation batches, MFU, log.jsonl, the step line
    Torch: processes, ZeRO-1 and failures  flat buffers, collectives, lost processes, out of memory
    Torchfunc plumbing: state, evaluation and profiles   make_state, HellaSwag, samples, --profile
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
import shutil
import signal
import socket
import sys
import threading
import time
import weakref
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from tokenize import TokenError

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hellaswag

FRAMEWORK = "torchfunc"  # "jax" | "triton-<backend>" in the siblings

# -----------------------------------------------------------------------------
# GPT-2: config

VOCAB_SIZE = 50257         # GPT-2 BPE tokens; EOT is the last one
PADDED_VOCAB_SIZE = 50304  # wte rows: a multiple of 128 for fast matmuls; the extra rows stay zero
EOT = 50256
MODEL_PRESETS = {  # name: (n_layer, n_head, n_embd)
    "d12": (12, 12, 768),
    "d24": (24, 16, 1024),
    "d36": (36, 20, 1280),
    "d48": (48, 25, 1600),
}


@dataclass
class Config:
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
    eval_only: bool = False
    profile: bool = False
    # data parallel: 0 = every process holds all optimizer state, 1 = ZeRO-1 (AdamW state, masters sharded)
    zero_stage: int = 0
    # torch only: 1 = torch.compile (--compile defaults to 1 with CUDA, 0 on the CPU)
    compile: int = 1


def die(msg):
    """Stops the run with a one-line error (SystemExit prints it to stderr and exits 1, no traceback)."""
    raise SystemExit(f"error: {msg}")


@dataclass(frozen=True)
class Recipe:
    """A row of RECIPES: what --recipe NAME trains. The rest of the file looks a recipe up here, never by
    its name; each recipe's section ends by adding its row."""
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
    token_losses: Callable  # (params, x, y, cfg) -> per-token losses (B,T) fp32
    summed: bool            # the step's gradient is of the summed token losses (else of their mean)
    scalars: Callable       # (step, cfg, device) -> the update's host-computed scalars, a device tensor
    update: Callable        # (params, grads, m, v, scalars, coef, copies, cfg), in place
    embeddings: tuple       # tables kept fp32 in bf16 runs (gathered from, their gradients summed in fp32)
    next_logits: Callable   # (params, tokens (S,T), t, cfg) -> the logits (S,V) of position t's next token


ZERO_STAGES = (0, 1)
# --recompute: none keeps what the backward reads; pointwise recomputes the norms' outputs and the MLP's
# activation from the kept matmul and attention outputs; block keeps each block's input alone and reruns
# the block's forward in the backward (docs/FORMATS.md)
RECOMPUTE_LEVELS = ("none", "pointwise", "block")


def framework_flags(p):
    """The flags of this trainer alone; parse_args adds the shared ones."""
    p.add_argument("--compile", type=int, choices=(0, 1), help="1: torch.compile the training step and the "
                   "evaluations (default 1 with CUDA, 0 on the CPU)")
    p.set_defaults(compile=int(torch.cuda.is_available()))

# -----------------------------------------------------------------------------
# GPT-2: model

# llm.c's tensor order; per-layer tensors are stacked along a leading L axis, as in its model file
PARAM_NAMES = ["wte", "wpe", "ln_1.w", "ln_1.b", "c_attn.w", "c_attn.b", "attn.c_proj.w",
               "attn.c_proj.b", "ln_2.w", "ln_2.b", "c_fc.w", "c_fc.b", "mlp.c_proj.w",
               "mlp.c_proj.b", "ln_f.w", "ln_f.b"]
DECAY_NAMES = {"wte", "wpe", "c_attn.w", "attn.c_proj.w", "c_fc.w", "mlp.c_proj.w"}


def gpt2_shapes(cfg):
    """{name: shape} of GPT-2's weights, in the order of llm.c's model file."""
    L, C, Vp, T = cfg.n_layer, cfg.n_embd, cfg.padded_vocab_size, cfg.block_size
    return {
        "wte": (Vp, C), "wpe": (T, C),
        "ln_1.w": (L, C), "ln_1.b": (L, C),
        "c_attn.w": (L, 3 * C, C), "c_attn.b": (L, 3 * C),
        "attn.c_proj.w": (L, C, C), "attn.c_proj.b": (L, C),
        "ln_2.w": (L, C), "ln_2.b": (L, C),
        "c_fc.w": (L, 4 * C, C), "c_fc.b": (L, 4 * C),
        "mlp.c_proj.w": (L, C, 4 * C), "mlp.c_proj.b": (L, C),
        "ln_f.w": (C,), "ln_f.b": (C,),
    }


def init_gpt2_numpy(cfg):
    """GPT-2's init from cfg.seed (docs/FORMATS.md), in numpy so that every trainer starts from the same
    weights."""
    rng = np.random.default_rng(cfg.seed)
    params = {}
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


# The model is a pure function of a dict of weights. With --dtype bf16 those are bf16 copies of the fp32
# masters (made once per step by the optimizer, as train_gpt2_jax.py and llm.c do), except the embedding
# tables, which stay fp32 so that their scatter-add gradients are summed in fp32; the residual stream is
# bf16, and autocast runs LayerNorm in fp32 and casts what enters a matmul or the attention to bf16. The
# loss and its softmax are fp32. Autodiff is torch.func's; torch.compile fuses the rest.

LAYER_NAMES = PARAM_NAMES[2:-2]  # the per-layer tensors, stacked along L


def attention(q, k, v, cfg):
    """Causal self-attention of q, k, v (B,T,C) -> (B,T,C); heads are D-wide slices of C. SDPA picks
    cuDNN's or flash attention on a GPU in bf16."""
    B, T, C = q.shape
    H, D = cfg.n_head, C // cfg.n_head
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))           # (B,H,T,D) each
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)                    # (B,H,T,D)
    return y.transpose(1, 2).reshape(B, T, C)                                      # (B,T,C)


# --recompute. torch.utils.checkpoint (plain or selective) keeps its tensors through saved-tensor hooks,
# which torch.func refuses ("torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks",
# eager and compiled alike), and compiled, the gradient is one graph with no forward/backward split for
# Inductor's activation_memory_budget to cut (it changes nothing). So the two autograd.Functions below
# keep their inputs alone and rerun a piece of the forward in the backward: Recomputed a whole function
# (torch.func.vjp of it: a block at --recompute block), LinearsAfter the pointwise function before matmuls
# (a norm, the MLP's activation), keeping the matmuls' input and weights and differentiating the matmuls
# by hand. Compiled, a recomputation that reads only forward tensors is fused into the forward's kernels
# (Inductor merges it with the original; measured on the CPU at L4 C256 T512 B8 Vp 512, block's peak
# stays none's 299 MB): after() makes it wait for the incoming gradient (124 MB), as jax.checkpoint's
# optimization barrier does.

@torch.library.custom_op("llmc::after", mutates_args=())
def after(xs: list[torch.Tensor], g: torch.Tensor) -> list[torch.Tensor]:
    """Copies of xs that a compiled graph can only compute once g exists (an op opaque to Inductor)."""
    return [x.clone() for x in xs]


after.register_fake(lambda xs, g: [torch.empty_like(x) for x in xs])


class Recomputed(torch.autograd.Function):
    """f(*args) -> one tensor, keeping only args (the first n are activations, the rest weights): the
    backward reruns f under cfg's autocast and differentiates that run (torch.func.vjp)."""

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


class LinearsAfter(torch.autograd.Function):
    """[F.linear(pre(x, *pre_args), w, b) for each (w, b)] of n pre_args then the pairs, keeping x and the
    weights, not pre's output: the backward recomputes pre(x) under cfg's autocast and differentiates the
    matmuls as autograd does (so fp32 gives its bits), then pre (torch.func.vjp)."""

    @staticmethod
    def forward(pre, cfg, n, x, *args):
        h = pre(x, *args[:n])                                                      # (B,T,Cin)
        return tuple(F.linear(h, w, b) for w, b in zip(args[n::2], args[n + 1::2]))  # (B,T,Cout) each

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.pre, ctx.cfg, ctx.n = inputs[:3]
        ctx.save_for_backward(*inputs[3:])

    @staticmethod
    def backward(ctx, *gs):
        x, *args = ctx.saved_tensors
        n, weights = ctx.n, args[ctx.n::2]
        with autocast(ctx.cfg, x.device):
            h, pre_vjp = torch.func.vjp(ctx.pre, *after([x], gs[0]), *args[:n])   # (B,T,Cin)
        h2 = h.flatten(0, -2).to(weights[0].dtype)                                 # (BT,Cin), autocast's cast
        gs2 = [g.flatten(0, -2) for g in gs]                                       # (BT,Cout) each
        grads = [d for g2 in gs2 for d in (g2.t().mm(h2), g2.sum(0))]             # (Cout,Cin), (Cout,) each
        # summed in autograd's order: the last matmul's gradient first
        dh = functools.reduce(torch.add, [g2.mm(w).view(h.shape).to(h.dtype)
                                          for g2, w in zip(gs2[::-1], weights[::-1])])  # (B,T,Cin)
        return None, None, None, *pre_vjp(dh), *grads


def differentiated(tensors):
    """Whether autograd records what is computed from tensors: grad mode on, and one of them requires grad.
    Else no backward comes to rerun anything for (and Dynamo, tracing an autograd.Function whose inputs
    need no gradient, would call its forward with a ctx first)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def linears(pre, x, pre_args, pairs, cfg):
    """[F.linear(pre(x, *pre_args), w, b) for (w, b) in pairs]; at --recompute pointwise the backward
    recomputes pre's output instead of keeping it (LinearsAfter)."""
    tensors = [x, *pre_args, *[t for pair in pairs for t in pair]]
    if cfg.recompute == "pointwise" and differentiated(tensors):
        return LinearsAfter.apply(pre, cfg, len(pre_args), *tensors)
    h = pre(x, *pre_args)                                                          # (B,T,Cin)
    return [F.linear(h, w, b) for w, b in pairs]                                   # (B,T,Cout) each


def recomputed(f, cfg, level, acts, weights=()):
    """f(*acts, *weights); at --recompute `level` it keeps only its arguments, and the backward reruns f
    (Recomputed)."""
    if cfg.recompute == level and differentiated([*acts, *weights]):
        return Recomputed.apply(f, cfg, len(acts), *acts, *weights)
    return f(*acts, *weights)


def layer_norm(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b, 1e-5)


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def block(x, lp, cfg):
    """One pre-LN transformer block; lp holds this layer's slice of the stacked weights."""
    C = cfg.n_embd
    # q, k, v from c_attn's three row blocks: three contiguous outputs whose gradients feed the
    # matmuls as they are, where slicing one (B,T,3C) product would cost a copy of the attention's
    # three gradients into one (B,T,3C) tensor in every layer's backward
    q, k, v = linears(layer_norm, x, (lp["ln_1.w"], lp["ln_1.b"]),
                      [(lp["c_attn.w"][i * C:(i + 1) * C], lp["c_attn.b"][i * C:(i + 1) * C])
                       for i in range(3)], cfg)                                    # (B,T,C) each
    x = x + F.linear(attention(q, k, v, cfg), lp["attn.c_proj.w"], lp["attn.c_proj.b"])  # (B,T,C)
    h, = linears(layer_norm, x, (lp["ln_2.w"], lp["ln_2.b"]), [(lp["c_fc.w"], lp["c_fc.b"])], cfg)  # (B,T,4C)
    h, = linears(gelu_tanh, h, (), [(lp["mlp.c_proj.w"], lp["mlp.c_proj.b"])], cfg)    # (B,T,C)
    return x + h                                                                   # (B,T,C)


def autocast(cfg, device):
    """bf16 autocast for --dtype bf16, a no-op context for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")


def compute_dtype(cfg):
    return torch.bfloat16 if cfg.dtype == "bf16" else torch.float32


def transformer(params, idx, cfg):
    """Token ids idx (B,T) -> hidden states (B,T,C) after ln_f (call under autocast(cfg): fp32 out of
    its LayerNorm). The residual stream is in the compute dtype."""
    T = idx.shape[1]
    # rows gathered from the fp32 tables, so the embeddings' scatter-add gradient is summed in fp32
    x = (params["wte"][idx] + params["wpe"][:T]).to(compute_dtype(cfg))            # (B,T,C)
    # per-layer views by unbind: the gradient of each stacked tensor is then one stack of its L layer
    # gradients, where indexing it L times would sum L zero-padded copies of the whole (L, ...) tensor
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
    """Per-token loss (...,) in fp32 of logits (..., Vp) over the first V columns only, and the
    logsumexp it used. The backward is llm.c's fused classifier: dlogits = g * (softmax - onehot),
    formed in one pass over the logits and written once in their dtype; autodiff of the forward would
    instead scatter the target's gradient into a zero-filled (..., V) fp32 buffer."""

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


def token_losses(params, x, y, cfg):
    """Per-token cross-entropy (B,T) in fp32 of targets y (B,T) given inputs x (B,T), over the first V
    columns."""
    return CrossEntropy.apply(forward(params, x, cfg), y)[0]                      # (B,T)


MODEL_MAGIC = 20240326


def write_model_file(path, params, cfg):
    """An llm.c model file (docs/FORMATS.md) in fp32 (version 3): 256-int32 header, then the tensors in
    PARAM_NAMES order."""
    header = np.zeros(256, dtype="<i4")
    header[:8] = [MODEL_MAGIC, 3, cfg.block_size, cfg.vocab_size,
                  cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.padded_vocab_size]
    shapes = param_shapes(cfg)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        for name in PARAM_NAMES:
            t = np.asarray(params[name], dtype=np.float32)
            assert t.shape == shapes[name], (name, t.shape, shapes[name])
            f.write(t.astype("<f4").tobytes())
    os.replace(tmp, path)


def read_model_file(path):
    """(header dict, {name: fp32 array}) from an llm.c model file (version 3 = fp32, 5 = bf16)."""
    if not os.path.isfile(path):
        die(f"model file {path} does not exist")
    size = os.path.getsize(path)  # the header is checked before the weights are read
    if size < 1024:
        die(f"model file {path} is truncated: {size} bytes")
    h = np.fromfile(path, "<i4", count=256)
    if h[0] != MODEL_MAGIC:
        die(f"model file {path} has magic {h[0]}, expected {MODEL_MAGIC} (not an llm.c model file)")
    if h[1] not in (3, 5):
        die(f"model file {path} has version {h[1]}, expected 3 (fp32) or 5 (bf16)")
    header = dict(block_size=int(h[2]), vocab_size=int(h[3]), n_layer=int(h[4]), n_head=int(h[5]),
                  n_embd=int(h[6]), padded_vocab_size=int(h[7]))
    if min(header.values()) <= 0 or header["n_embd"] % header["n_head"]:
        die(f"model file {path} has an invalid header {header}")
    shapes = param_shapes(Config(**header))
    itemsize = 4 if h[1] == 3 else 2
    expected = 1024 + itemsize * sum(math.prod(s) for s in shapes.values())
    if size != expected:
        die(f"model file {path} has {size} bytes, its header implies {expected}")
    raw, params, offset = np.fromfile(path, np.uint8), {}, 1024
    for name in PARAM_NAMES:
        n = math.prod(shapes[name])
        chunk = raw[offset: offset + n * itemsize]
        if itemsize == 4:
            t = chunk.view("<f4").astype(np.float32)
        else:
            t = (chunk.view("<u2").astype(np.uint32) << 16).view(np.float32)
        bad = t.size - np.count_nonzero(np.isfinite(t))
        if bad:
            die(f"model file {path}: tensor {name} holds {bad} non-finite values (NaN or inf): the weights "
                "of a diverged run?")
        params[name] = t.reshape(shapes[name])
        offset += n * itemsize
    return header, params


def is_model_file(head):
    """Whether a file's first bytes are those of an llm.c model file."""
    return head[:4] == np.array(MODEL_MAGIC, "<i4").tobytes()

# -----------------------------------------------------------------------------
# GPT-2: AdamW and the lr schedule

def cosine_lr(it, cfg):
    """llm.c's lr of 0-based iteration `it`: a linear warmup, then a cosine down to lr*lr_decay_frac."""
    min_lr = cfg.lr * cfg.lr_decay_frac
    if it < cfg.warmup:
        return cfg.lr * (it + 1) / cfg.warmup
    if it > cfg.steps:
        return min_lr
    ratio = (it - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (cfg.lr - min_lr)


ADAM_BETA1, ADAM_BETA2, ADAM_EPS = 0.9, 0.95, 1e-8


def adam_scalars(step, cfg, device):
    """[lr, 1 - beta1^t, 1 - beta2^t] for 1-based step t, computed on the host in float64 and passed to
    the compiled update as a device tensor, so a new lr never recompiles it."""
    return torch.tensor([cosine_lr(step - 1, cfg), 1.0 - ADAM_BETA1 ** step, 1.0 - ADAM_BETA2 ** step],
                        dtype=torch.float32, device=device)


EMBEDDINGS = ("wte", "wpe")  # no compute-dtype copies: gathered from in fp32 (the lm head casts wte)


def compute_copies(params, cfg):
    """{name: bf16 copy} of every master but the embedding tables with --dtype bf16; None in fp32."""
    if cfg.dtype == "fp32":
        return None
    return {k: p.to(torch.bfloat16) for k, p in params.items() if k not in RECIPES[cfg.recipe].embeddings}


def model_weights(params, copies):
    """The tensors the model computes with: the masters, replaced by their copies where there are any."""
    return params if copies is None else {**params, **copies}


def global_norm(grads):
    """torch.nn.utils.clip_grad_norm_'s total norm: the L2 norm of the per-tensor L2 norms, accumulated in
    fp64: torch's fp32 norm kernels on the CPU are off by 1e-5 to 1e-4 relative at wte's 3M elements.
    Called outside torch.compile: one multi-tensor kernel, the same in compiled and eager runs. grads:
    {name: tensor}, all of them or (ZeRO-1) the pieces in this process's shard."""
    norms = torch._foreach_norm(list(grads.values()), dtype=torch.float64)         # n x ()
    return torch.linalg.vector_norm(torch.stack(norms)).float()                    # ()


def clip_coefficient(norm, cfg):
    """min(1, grad_clip / (norm + 1e-6)) as a device tensor (1 when clipping is off): no host sync."""
    if cfg.grad_clip > 0:
        return torch.clamp(cfg.grad_clip / (norm + 1e-6), max=1.0)                 # ()
    return torch.ones_like(norm)                                                   # ()


def adamw_update(params, grads, m, v, scalars, coef, copies, cfg):
    """llm.c's AdamW on every tensor, in place, with multi-tensor ops, on the gradients times coef (the
    clipping); weight decay only on DECAY_NAMES. Refreshes the compute-dtype copies from the new
    masters (compiled, in the same pass over the weights). The gradients are left as they are. The dicts
    hold whole tensors, or (ZeRO-1) the 1-D pieces of them in this process's shard."""
    lr, bias1, bias2 = scalars[0], scalars[1], scalars[2]
    names = list(grads)
    p, g, m, v = ([d[k] for k in names] for d in (params, grads, m, v))
    g = torch._foreach_mul(g, coef)
    torch._foreach_mul_(m, ADAM_BETA1)
    torch._foreach_add_(m, g, alpha=1.0 - ADAM_BETA1)                             # m = b1 m + (1-b1) g
    torch._foreach_mul_(v, ADAM_BETA2)
    torch._foreach_addcmul_(v, g, g, value=1.0 - ADAM_BETA2)                       # v = b2 v + (1-b2) g^2
    denom = torch._foreach_sqrt(torch._foreach_div(v, bias2))
    torch._foreach_add_(denom, ADAM_EPS)
    update = torch._foreach_div(torch._foreach_div(m, bias1), denom)              # mhat/(sqrt(vhat)+eps)
    decay = [i for i, k in enumerate(names) if k in DECAY_NAMES]
    torch._foreach_add_([update[i] for i in decay], [p[i] for i in decay], alpha=cfg.weight_decay)
    torch._foreach_mul_(update, lr)
    torch._foreach_sub_(p, update)                                                 # p -= lr (... + wd p)
    if copies is not None:
        torch._foreach_copy_(list(copies.values()), [params[k] for k in copies])

# -----------------------------------------------------------------------------
# GPT-2: training step

def grad_accum_steps(cfg, world):
    tokens = cfg.batch_size * cfg.seq_len * world
    if cfg.total_batch_size % tokens:
        die(f"--total-batch-size {cfg.total_batch_size} is not a multiple of --batch-size x --seq-len "
            f"x devices = {tokens}")
    return cfg.total_batch_size // tokens


def loss_fn(params, x, y, cfg):
    """The loss one batch contributes, fp32: the recipe's mean token loss, or its sum (Recipe.summed)."""
    recipe = RECIPES[cfg.recipe]
    losses = recipe.token_losses(params, x, y, cfg)                                # (B,T)
    return losses.sum() if recipe.summed else losses.mean()


def scaled_loss(weights, x, y, scale, cfg):
    return loss_fn(weights, x, y, cfg) * scale


def grads_and_loss(weights, x, y, scale, cfg):
    """({name: gradient}, loss) of scale x the loss of one micro-batch (loss_fn's), by reverse mode through
    torch.func: the weights stay plain tensors (no requires_grad, no .grad, no autograd graph kept
    between calls), and each gradient comes back in its weight's dtype."""
    if torch.compiler.is_compiling():  # one graph, whose tensors Inductor frees after their last use
        return torch.func.grad_and_value(scaled_loss)(weights, x, y, scale, cfg)
    # eager, vjp: grad's backward records a graph of itself (for nested transforms), which holds every
    # tensor the forward saved and every backward temporary until it returns (measured, L4 C256 T512 B8
    # Vp 512: a 527 MB peak against 313 MB); this backward frees each as it goes, with the same bits.
    # (Compiled, Dynamo fails on a vjp inside this one's backward, as --recompute's are.)
    loss, loss_vjp = torch.func.vjp(lambda w: scaled_loss(w, x, y, scale, cfg), weights)
    return loss_vjp(torch.ones_like(loss), retain_graph=False, create_graph=False)[0], loss


GRADIENT = "gradient"  # the profiler's name for one grad_fn call


def train_step(state, x, y, scalars, cfg, grad_fn, update_fn, world):
    """One optimizer step on x, y (A,B,T) = A micro-batches: the gradient of the mean of the micro-batch
    losses (each micro-batch's gradient scaled by 1/(A*world) and summed in fp32, then summed over the
    processes by collectives over the flat gradient buffer), or of the sum of every token's loss
    (Recipe.summed), clipped, then the update; grad_fn / update_fn are grads_and_loss / the recipe's update,
    compiled or not; `state` is make_state's, updated in place. Returns (mean token loss, grad norm before
    clipping) as 0-d device tensors: nothing here waits for the device."""
    weights, grads = state["weights"], state["grads"]
    names = list(grads)
    A = x.shape[0]
    summed = RECIPES[cfg.recipe].summed
    scale = 1.0 if summed else 1.0 / (A * world)
    with torch.profiler.record_function(GRADIENT):  # for --profile's split into forward and backward
        micro_grads, loss = grad_fn(weights, x[0], y[0], scale, cfg)
    # fp32 sums in the flat buffer: a copy of each compute-dtype gradient
    torch._foreach_copy_([grads[k] for k in names], [micro_grads[k] for k in names])
    for i in range(1, A):
        with torch.profiler.record_function(GRADIENT):
            micro_grads, micro_loss = grad_fn(weights, x[i], y[i], scale, cfg)
        torch._foreach_add_([grads[k] for k in names], [micro_grads[k] for k in names])
        loss = loss + micro_loss                                                   # ()
    # ZeRO-1 over more than one process, group by group (compute_groups): this process's shard of the
    # summed gradients, the norm from every shard's sum of squares, AdamW on its shard of the masters (and
    # of the compute copies), then every process's updated shard of the weights to every process. Stage 0
    # sums everything with one all-reduce, and a process's shard is the whole model.
    sharded = cfg.zero_stage == 1 and world > 1
    if world > 1:
        dist.all_reduce(loss)
    if world > 1 and not sharded:
        dist.all_reduce(state["grad_buffer"])  # one collective for all 16 gradients
    if sharded:
        for group in state["groups"]:
            first, end = group["span"]
            dist.reduce_scatter_single(group["grads"], state["grad_buffer"][first:end])
    norm = global_norm(state["shard_grads"])                                       # ()
    if sharded:
        squares = norm.double().square()                                           # ()
        dist.all_reduce(squares)
        norm = squares.sqrt().float()                                              # ()
    update_fn(state["shard_params"], state["shard_grads"], state["m"], state["v"], scalars,
              clip_coefficient(norm, cfg), state["shard_copies"], cfg)
    if sharded:
        for group in state["groups"]:
            dist.all_gather_single(group["weights"], group["own_weights"])
    return (loss / cfg.total_batch_size if summed else loss), norm


def gpt2_activation_bytes(cfg):
    """Bytes one micro-batch's activations hold at the peak of its forward+backward at cfg.recompute, as
    this trainer's eager backward keeps and frees them (tests/test_recompute_torchfunc.py measures it):
    what the blocks keep for the backward, and the larger of what the head's backward and a block's add.
    Compiled, Inductor fuses the cross-entropy's backward and a block's backward temporaries."""
    N, C, V, H = cfg.batch_size * cfg.seq_len, cfg.n_embd, cfg.padded_vocab_size, cfg.n_head
    s = compute_dtype(cfg).itemsize  # the activations' bytes; the fp32 ones say 4
    kept = {  # per block, from its forward to its backward
        "none": (C           # x (B,T,C): the block's input, ln_1's
                 + C         # ln_1's output (B,T,C): the q, k, v matmuls' input
                 + 3 * C     # q, k, v (B,T,C) each: the attention's inputs
                 + C         # the attention's output (B,T,C): c_proj's input
                 + C         # x + attention (B,T,C): ln_2's input
                 + C         # ln_2's output (B,T,C): c_fc's input
                 + 4 * C     # c_fc's output (B,T,4C): GELU's input
                 + 4 * C) * s  # GELU's output (B,T,4C): the MLP's c_proj's input
        + (4 + H) * 4,       # fp32: mean and rstd (B,T) of both LayerNorms, the attention's logsumexp (B,H,T)
        "pointwise": (C + 3 * C + C + C + 4 * C) * s  # x, q, k, v, the attention's output, x + attention,
        + H * 4,             # c_fc's output (B,T,4C); the attention's logsumexp (B,H,T) fp32
        "block": C * s,      # x (B,T,C) alone
    }[cfg.recompute]
    head = (2 * C * s        # ln_f's input and output (B,T,C)
            + V * s          # the logits (B,T,Vp)
            + 3 * V * 4 + V)  # the cross-entropy's backward: softmax, softmax minus one-hot and the gradient
    #                          (B,T,Vp) fp32, the target mask (B,T,Vp) bool
    in_block = {  # a block's backward at its peak, in its MLP's: beyond what the blocks keep,
        "none": (C           # the gradient at the block's output (B,T,C)
                 + 4 * C) * s,  # the gradient at GELU's output (B,T,4C)
        "pointwise": (C + 4 * C  # those two
                      + 4 * C    # c_fc's output's copy (after(), B,T,4C)
                      + 4 * C    # GELU's output recomputed (B,T,4C)
                      + 4 * C) * s,  # the gradient at GELU's input (B,T,4C)
        "block": (C + 4 * C + 4 * C  # those three gradients
                  + C        # x's copy (after(), B,T,C)
                  + 15 * C   # the block's rerun: what none keeps beyond x
                  + C) * s,  # the rerun's output (B,T,C)
    }[cfg.recompute]
    return N * (cfg.n_layer * kept + max(head, in_block))


RECIPES = {"gpt2": Recipe(
    help="llm.c's GPT-2 and AdamW", defaults={}, configure=lambda cfg, given, shape: None,
    shapes=gpt2_shapes, init=init_gpt2_numpy, lr_at=cosine_lr, muon_names=lambda shapes: [],
    model_file="model.bin", file_kind="an llm.c model file (.bin)", is_file=is_model_file,
    read_file=read_model_file, write_file=write_model_file, model_name="GPT-2", table="wpe",
    optimizers="AdamW", activation_bytes=gpt2_activation_bytes,
    token_losses=token_losses, summed=False, scalars=adam_scalars, update=adamw_update,
    embeddings=EMBEDDINGS, next_logits=next_logits)}

# -----------------------------------------------------------------------------
# Recipe: speedrun

# -- config

# The speedrun recipe: records/track_3_optimization/train_gpt_simple.py of KellerJordan/modded-nanogpt
# (docs/FORMATS.md, The speedrun recipe). Its lrs per parameter group; --lr sets Muon's and scales the
# others with it.
SPEEDRUN_LRS = {"muon": 0.025, "embed": 0.7, "head": 0.004, "vector": 0.015}
# its defaults over Config's: --weight-decay is the AdamW groups' (Muon's is MUON_WEIGHT_DECAY), no warmup
# and no clipping; what it does not name (batch, T, validation tokens) it shares with llm.c's recipe
SPEEDRUN_DEFAULTS = {"steps": 3250, "lr": SPEEDRUN_LRS["muon"], "warmup": 0, "weight_decay": 0.001,
                     "grad_clip": 0.0, "val_every": 125, "out_dir": f"out/speedrun_{FRAMEWORK}"}
HEAD_DIM = 128  # the speedrun model's head size: its width sets the head count


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
    """{name: shape} of the speedrun model's parameters: the names of the reference's GPT.named_parameters(),
    in its order; the blocks' tensors stay per layer (no L axis), so that Muon sees each matrix whole."""
    C, Vp = cfg.n_embd, cfg.padded_vocab_size
    shapes = {"embed.weight": (Vp, C)}
    for i in range(cfg.n_layer):
        for name in ("attn.q", "attn.k", "attn.v", "attn.proj"):
            shapes[f"blocks.{i}.{name}.weight"], shapes[f"blocks.{i}.{name}.bias"] = (C, C), (C,)
        shapes[f"blocks.{i}.mlp.fc.weight"], shapes[f"blocks.{i}.mlp.fc.bias"] = (4 * C, C), (4 * C,)
        shapes[f"blocks.{i}.mlp.proj.weight"], shapes[f"blocks.{i}.mlp.proj.bias"] = (C, 4 * C), (C,)
        shapes[f"blocks.{i}.norm1.gains"], shapes[f"blocks.{i}.norm2.gains"] = (C,), (C,)
    shapes.update({"proj.weight": (Vp, C), "proj.bias": (Vp,), "norm1.gains": (C,), "norm2.gains": (C,)})
    return shapes


def muon_names(shapes):
    """The weights Muon updates: every matrix inside the blocks."""
    return [k for k, shape in shapes.items() if k.startswith("blocks.") and len(shape) == 2]


def init_speedrun_numpy(cfg):
    """The reference's init: every weight named *proj* (the attention and MLP outputs, the head) zero, the
    embedding N(0, 1), the other matrices N(0, 0.33 / fan_in), biases 0, gains 1; drawn in the order of
    param_shapes, as tests/speedrun_reference.py's init_state_dict draws them."""
    rng = np.random.default_rng(cfg.seed)
    params = {}
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
    """The reference's half-truncated rotary frequencies (head_dim/2,) fp32, its state_dict's buffer (the
    model computes them in torch, as the reference does: within an ulp of these): (1/1024)^linspace(0, 1)
    over the first quarter of the head's dims, zeros over the second (those pairs are not rotated)."""
    freq = np.float32(1 / 1024) ** np.linspace(0, 1, head_dim // 4, dtype=np.float32)
    return np.concatenate([freq, np.zeros(head_dim // 4, np.float32)])


# -- model

# The speedrun model, as the reference's GPT computes it: per-layer weights by their state_dict names, RMSNorm
# with the compute dtype's machine epsilon (F.rms_norm's default there, where the residual stream is bf16),
# rotary positions computed in fp32.

ATTN_SCALE = 0.12  # the reference's, in place of 1/sqrt(128)
SOFTCAP = 15.0


def rotary(x):
    """The reference's half-truncated rotary embedding of q or k (B,T,H,D), in fp32: the first D/4 pairs
    (x1[i], x2[i]) of the halves turn by the angle t * freq[i], the last D/4 stay as they are."""
    T, D = x.shape[1], x.shape[3]
    freq = (1 / 1024) ** torch.linspace(0, 1, D // 4, dtype=torch.float32, device=x.device)  # (D/4,)
    freq = torch.cat([freq, freq.new_zeros(D // 4)])                                # (D/2,)
    t = torch.arange(T, dtype=torch.float32, device=x.device)                      # (T,)
    theta = torch.outer(t, freq)[None, :, None]                                    # (1,T,1,D/2)
    cos, sin = theta.cos(), theta.sin()                                            # (1,T,1,D/2) each
    x1, x2 = x.float().chunk(2, dim=-1)                                            # (B,T,H,D/2) each
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), -1).type_as(x)   # (B,T,H,D)


def speedrun_attention(q, k, v, cfg):
    """Causal attention (B,T,C) of the q, k, v linears' outputs (B,T,H,D), after q's and k's RMSNorm and
    rotary."""
    B, T, H, D = q.shape
    eps = torch.finfo(compute_dtype(cfg)).eps
    q, k = (rotary(F.rms_norm(t, (D,), eps=eps)) for t in (q, k))                 # (B,T,H,D) each
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       scale=ATTN_SCALE, is_causal=True)           # (B,H,T,D)
    return y.transpose(1, 2).reshape(B, T, H * D)                                  # (B,T,C)


def relu_square(x):
    return F.relu(x).square()


def speedrun_block(x, w, cfg):
    """One pre-norm block of the speedrun model, with one layer's weights w (the names after blocks.<layer>.).
    At --recompute pointwise the backward recomputes the norms, the MLP's ReLU^2 and the q/k norms and
    rotary; the last sit between the kept q, k and the attention, whose backward torch offers only through
    autograd, from a forward it saved: so the attention reruns in the backward too (Recomputed)."""
    B, T, C = x.shape
    H, D = C // HEAD_DIM, HEAD_DIM

    def rms_norm(x, gains):
        return F.rms_norm(x, (C,), gains, torch.finfo(compute_dtype(cfg)).eps)
    q, k, v = (t.view(B, T, H, D) for t in linears(
        rms_norm, x, (w["norm1.gains"],), [(w[f"attn.{n}.weight"], w[f"attn.{n}.bias"]) for n in "qkv"],
        cfg))                                                                      # (B,T,H,D) each
    y = recomputed(functools.partial(speedrun_attention, cfg=cfg), cfg, "pointwise", [q, k, v])  # (B,T,C)
    x = x + F.linear(y, w["attn.proj.weight"], w["attn.proj.bias"])                # (B,T,C)
    h, = linears(rms_norm, x, (w["norm2.gains"],), [(w["mlp.fc.weight"], w["mlp.fc.bias"])], cfg)  # (B,T,4C)
    h, = linears(relu_square, h, (), [(w["mlp.proj.weight"], w["mlp.proj.bias"])], cfg)  # (B,T,C)
    return x + h                                                                   # (B,T,C)


def speedrun_transformer(params, idx, cfg):
    """Token ids idx (B,T) -> hidden states (B,T,C) after the final RMSNorm (call under autocast(cfg)); no
    position embedding: the blocks' rotary gives the positions."""
    C, dt = cfg.n_embd, compute_dtype(cfg)
    eps = torch.finfo(dt).eps
    # rows gathered from the fp32 table, so that its scatter-add gradient is summed in fp32
    x = F.rms_norm(params["embed.weight"][idx].to(dt), (C,), params["norm1.gains"], eps).to(dt)  # (B,T,C)
    parts = [k[len("blocks.0."):] for k in params if k.startswith("blocks.0.")]  # a layer's weights' names
    for layer in range(cfg.n_layer):
        x = recomputed(lambda x, *ws: speedrun_block(x, dict(zip(parts, ws)), cfg), cfg, "block", [x],
                       [params[f"blocks.{layer}.{n}"] for n in parts])             # (B,T,C)
    return F.rms_norm(x, (C,), params["norm2.gains"], eps)                         # (B,T,C)


def speedrun_logits(h, weight, bias):
    """The head's logits z = h W^T + b in fp32, soft-capped to 15 z / sqrt(z^2 + 15^2): (..., rows of W)."""
    z = F.linear(h, weight, bias).float()                                          # (..., V)
    return SOFTCAP * z * torch.rsqrt(z.square() + SOFTCAP**2)                      # (..., V)


def speedrun_forward(params, idx, cfg):
    """Logits (B,T,Vp) of the speedrun model: its own head's, soft-capped, in fp32."""
    with autocast(cfg, idx.device):
        h = speedrun_transformer(params, idx, cfg)                                 # (B,T,C)
        return speedrun_logits(h, params["proj.weight"], params["proj.bias"])      # (B,T,Vp)


def speedrun_next_logits(params, tokens, t, cfg):
    """The logits (S,V) of the token after position t of tokens (S,T), for sampling."""
    with autocast(cfg, tokens.device):
        h = speedrun_transformer(params, tokens, cfg)[:, t]                        # (S,C)
        return speedrun_logits(h, params["proj.weight"][:VOCAB_SIZE], params["proj.bias"][:VOCAB_SIZE])


def speedrun_token_losses(params, x, y, cfg):
    """Per-token cross-entropy (B,T) in fp32, as the reference's: over all Vp columns."""
    logits = speedrun_forward(params, x, cfg)                                      # (B,T,Vp)
    # logsumexp, not F.cross_entropy: after the first step the ~50,000 unseen tokens' head rows are one
    # vector, so a row's logits are mostly equal, and the CPU log_softmax adds them in long running sums
    # whose rounding then piles up one way (up to 4e-5 off); torch.logsumexp's blocked sum does not
    target_logit = logits.gather(-1, y[..., None])[..., 0]                         # (B,T)
    return torch.logsumexp(logits, -1) - target_logit                              # (B,T)


# -- optimizer

SPEEDRUN_COOLDOWN = 0.7  # the fraction of the steps over which the speedrun recipe's lr falls


def speedrun_lr(it, cfg):
    """The reference's lr of 0-based iteration `it` (after a warmup, if one is given): lr until 30% of the
    steps, then a linear fall toward lr*lr_decay_frac at step `steps`: eta = (1 - it/steps) / 0.7."""
    min_lr = cfg.lr * cfg.lr_decay_frac
    if it < cfg.warmup:
        return cfg.lr * (it + 1) / cfg.warmup
    eta = min(1.0, max(0.0, 1.0 - it / cfg.steps) / SPEEDRUN_COOLDOWN)
    return min_lr + eta * (cfg.lr - min_lr)


def speedrun_lrs(it, cfg):
    """{group: lr} of 0-based iteration `it` for the speedrun recipe's groups (SPEEDRUN_LRS): Muon's is
    speedrun_lr's, the AdamW groups' keep their ratios to it."""
    scale = speedrun_lr(it, cfg) / SPEEDRUN_LRS["muon"]
    return {group: lr * scale for group, lr in SPEEDRUN_LRS.items()}


def adamw_group(name):
    """The SPEEDRUN_LRS group of a tensor that AdamW updates in the speedrun recipe."""
    return {"embed.weight": "embed", "proj.weight": "head"}.get(name, "vector")


SPEEDRUN_BETA1, SPEEDRUN_BETA2, SPEEDRUN_EPS = 0.8, 0.95, 1e-10
MUON_MOMENTUM, MUON_WEIGHT_DECAY, NEWTON_SCHULZ_STEPS = 0.95, 0.05, 12


def speedrun_scalars(step, cfg, device):
    """[lr of each SPEEDRUN_LRS group, 1 - beta1^t, 1 - beta2^t] for 1-based step t (adam_scalars')."""
    return torch.tensor([*speedrun_lrs(step - 1, cfg).values(), 1.0 - SPEEDRUN_BETA1 ** step,
                         1.0 - SPEEDRUN_BETA2 ** step], dtype=torch.float32, device=device)


def newton_schulz(G, dtype):
    """The reference's orthogonalization of each matrix G (n,r,c) -> (n,r,c) in `dtype`: from X = G/||G||_F
    (spectral norm at most 1), 12 iterations of X <- 2X + (-1.5 A + 0.5 A^2) X with A = X X^T, which drive
    every singular value of X toward 1; on the transposes of tall matrices, so that A is the smaller."""
    tall = G.shape[-2] > G.shape[-1]
    X = G.to(dtype).mT if tall else G.to(dtype)                                    # (n,r',c')
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)                            # (n,r',c')
    for _ in range(NEWTON_SCHULZ_STEPS):
        A = X @ X.mT                                                               # (n,r',r')
        X = 2 * X + (-1.5 * A + 0.5 * (A @ A)) @ X                                 # (n,r',c')
    return X.mT if tall else X                                                     # (n,r,c)


def speedrun_adamw(names, params, grads, m, v, lr, bias1, bias2, coef, weight_decay):
    """AdamW with the speedrun recipe's betas and eps on the tensors `names`, in place, as torch.optim.AdamW
    computes it: m = lerp(m, g, 1-b1), v = b2 v + (1-b2) g^2, p *= 1 - lr*wd, p -= lr mhat/(sqrt(vhat)+eps),
    on the gradients times coef (the clipping)."""
    p, m, v = ([d[k] for k in names] for d in (params, m, v))
    g = torch._foreach_mul([grads[k] for k in names], coef)
    torch._foreach_lerp_(m, g, 1.0 - SPEEDRUN_BETA1)
    torch._foreach_mul_(v, SPEEDRUN_BETA2)
    torch._foreach_addcmul_(v, g, g, value=1.0 - SPEEDRUN_BETA2)
    denom = torch._foreach_sqrt(torch._foreach_div(v, bias2))
    torch._foreach_add_(denom, SPEEDRUN_EPS)
    update = torch._foreach_div(torch._foreach_div(m, bias1), denom)
    torch._foreach_mul_(p, 1.0 - lr * weight_decay)
    torch._foreach_sub_(p, torch._foreach_mul(update, lr))


def speedrun_muon(names, params, grads, m, lr, coef, dtype):
    """Muon on the matrices `names`, all of one shape (r,c), in place, on the gradients times coef: the
    momentum buffer m = lerp(m, g, 0.05), Nesterov's u = lerp(g, m, 0.95), orthogonalized by newton_schulz
    in `dtype` (batched over the matrices) and scaled by max(1, r/c)^0.5; p *= 1 - lr*wd, p -= lr*update."""
    g = torch._foreach_mul([grads[k] for k in names], coef)
    momentum = [m[k] for k in names]
    torch._foreach_lerp_(momentum, g, 1.0 - MUON_MOMENTUM)
    u = torch.stack(torch._foreach_lerp(g, momentum, MUON_MOMENTUM))              # (n,r,c)
    r, c = u.shape[1:]
    update = newton_schulz(u, dtype).float() * max(1.0, r / c) ** 0.5             # (n,r,c)
    p = [params[k] for k in names]
    torch._foreach_mul_(p, 1.0 - lr * MUON_WEIGHT_DECAY)
    torch._foreach_sub_(p, list((update * lr).unbind(0)))


def speedrun_update(params, grads, m, v, scalars, coef, copies, cfg):
    """The speedrun recipe's step, in place, on the gradients times coef (the clipping): AdamW on the tensors
    v holds (the embedding, the head weight, every vector), each group at its lr, and Muon on the rest, the
    blocks' matrices, whose momentum buffers m holds; then the compute-dtype copies are refreshed. The dicts
    hold whole tensors, or (ZeRO-1) 1-D pieces of the AdamW tensors and this process's Muon matrices whole;
    a shard may hold none of a group."""
    lr = dict(zip(SPEEDRUN_LRS, scalars[:4]))
    adam = [k for k in grads if k in v]
    for group in ("embed", "head", "vector"):
        names = [k for k in adam if adamw_group(k) == group]
        if names:
            speedrun_adamw(names, params, grads, m, v, lr[group], scalars[4], scalars[5], coef,
                           cfg.weight_decay)
    muon = [k for k in grads if k not in v]
    for shape in dict.fromkeys(params[k].shape for k in muon):
        speedrun_muon([k for k in muon if params[k].shape == shape], params, grads, m, lr["muon"], coef,
                      compute_dtype(cfg))
    if copies is not None:
        torch._foreach_copy_(list(copies.values()), [params[k] for k in copies])


# -- model files

# safetensors' element types that the trainers read, as numpy types (a bf16 value is read as the top 16
# bits of an fp32 one); they write F32
SAFETENSORS_TYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


def write_safetensors(path, tensors):
    """A safetensors file (8-byte little-endian header length, the JSON header, the data) of the fp32 arrays
    {name: array}, in that order, written to a temporary name, then renamed."""
    header, offset = {}, 0
    for k, t in tensors.items():
        header[k] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + 4 * t.size]}
        offset += 4 * t.size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(np.array(len(text), "<u8").tobytes() + text)
        for t in tensors.values():
            f.write(np.asarray(t, "<f4").tobytes())
    os.replace(tmp, path)


def read_safetensors(path, check=None):
    """{name: fp32 array} of a safetensors file of float tensors (SAFETENSORS_TYPES). Before any tensor is
    read, the header is checked: its size and nesting, its JSON shape and types, and that the tensors' bytes
    tile the data exactly (no overlap, gap or trailing byte); then check({name: (type, shape)}) if given
    (the caller's names and shapes). Every value must be finite."""
    if not os.path.isfile(path):
        die(f"model file {path} does not exist")
    size, limit = os.path.getsize(path), 100_000_000  # safetensors' own limit on the header's length
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if n > limit:
            die(f"model file {path}: its header claims {n} bytes, over the {limit}-byte limit of a "
                "safetensors header")
        if not 0 < n <= size - 8:
            die(f"model file {path} is not a safetensors file, or is truncated: {size} bytes")
        text = f.read(n)
    # the nesting, outside strings, before json recurses into it: a header is {name: {"shape": [..]}}
    outside = b"".join(text.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[::2])
    brackets = np.frombuffer(outside, np.uint8)
    brackets = brackets[np.isin(brackets, list(b"{[]}"))]
    depth = int(np.cumsum(np.where(np.isin(brackets, list(b"{[")), 1, -1)).max(initial=0))
    if depth > 3:
        die(f"model file {path} has a damaged safetensors header: it nests {depth} deep, a header 3 at most")

    def unique(pairs):
        names = [k for k, _ in pairs]
        if len(set(names)) < len(names):
            raise ValueError(f"a name appears twice: {sorted(names, key=names.count)[-1][:80]}")
        return dict(pairs)
    try:
        header = json.loads(text, object_pairs_hook=unique)
    except (ValueError, RecursionError) as e:  # not UTF-8 nor JSON, a name twice
        die(f"model file {path} has a damaged safetensors header ({str(e).splitlines()[0][:120]})")
    if not isinstance(header, dict) or not isinstance(header.pop("__metadata__", {}), dict):
        die(f"model file {path} has a damaged safetensors header (not a JSON object of tensors)")

    def naturals(x):
        return isinstance(x, list) and len(x) <= 32 and all(type(i) is int and 0 <= i < 2**63 for i in x)
    entries = {}
    for k, e in header.items():
        if not k.isprintable():  # a name is printed in one line
            die(f"model file {path} has a tensor name with unprintable characters: {json.dumps(k)[:100]}")
        shown = k if len(k) <= 100 else k[:97] + "..."
        if not (isinstance(e, dict) and isinstance(e.get("dtype"), str) and naturals(e.get("shape"))
                and naturals(e.get("data_offsets")) and len(e["data_offsets"]) == 2):
            die(f"model file {path}: tensor {shown} is not described as {{\"dtype\": a type, \"shape\": up "
                f"to 32 integers in [0, 2**63), \"data_offsets\": [begin, end]}} ({json.dumps(e)[:100]})")
        dtype, shape, (lo, hi) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
        if dtype not in SAFETENSORS_TYPES:
            die(f"model file {path}: tensor {shown} is {json.dumps(dtype)[:40]}, not one of "
                f"{', '.join(SAFETENSORS_TYPES)}")
        if not (lo <= hi <= size - 8 - n and hi - lo == np.dtype(SAFETENSORS_TYPES[dtype]).itemsize
                * math.prod(shape)):
            die(f"model file {path}: tensor {shown} ({dtype} {list(shape)}) does not fit its bytes "
                f"{lo}..{hi} of the file's {size - 8 - n} (truncated?)")
        entries[k] = shown, dtype, shape, lo, hi
    end = 0  # the tensors' bytes, in order, must tile the data: one tensor's end is the next one's begin
    for shown, dtype, shape, lo, hi in sorted(entries.values(), key=lambda e: e[3:]):
        if lo != end:
            die(f"model file {path}: tensor {shown}'s bytes {lo}..{hi} " + (
                "overlap another tensor's" if lo < end else f"leave bytes {end}..{lo} that no tensor holds"))
        end = hi
    if end != size - 8 - n:
        die(f"model file {path} has {size - 8 - n - end} bytes after its last tensor (a damaged file?)")
    if check is not None:
        check({k: e[1:3] for k, e in entries.items()})
    data, tensors = np.fromfile(path, np.uint8, offset=8 + n), {}
    for k, (shown, dtype, shape, lo, hi) in entries.items():
        chunk = data[lo:hi]
        if dtype == "BF16":
            t = (chunk.view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            t = chunk.view(SAFETENSORS_TYPES[dtype]).astype(np.float32)
        bad = t.size - np.count_nonzero(np.isfinite(t))
        if bad:
            die(f"model file {path}: tensor {shown} holds {bad} non-finite values (NaN or inf): the weights "
                "of a diverged run?")
        tensors[k] = t.reshape(shape)
    return tensors


def is_safetensors_file(head):
    """Whether a file's first 9 bytes are those of a safetensors file (a JSON header after its length)."""
    return head[8:9] == b"{"


def write_speedrun_file(path, params, cfg):
    """A speedrun model file: the reference's GPT.state_dict() in fp32 safetensors, the rotary buffers
    included, so that the reference loads it as it is."""
    tensors = {}
    for k in param_shapes(cfg):
        tensors[k] = np.asarray(params[k], np.float32)
        if k.endswith(".attn.proj.bias"):  # where the reference's state_dict puts the attention's buffer
            tensors[k.replace("proj.bias", "rotary.angular_freq")] = rotary_freq_numpy(HEAD_DIM)
    write_safetensors(path, tensors)


def read_speedrun_file(path):
    """(header, {name: fp32 array}) of a speedrun model file (the reference's state_dict as safetensors: fp32,
    or any float type, converted to fp32 with a line); the shape comes from embed.weight and the blocks'
    count, and every tensor of it must be there in its shape, with no other: checked before any is read."""
    found = {}

    def check(entries):  # {name: (type, shape)}: the layer count from names alone, bounded by theirs
        embed = entries.get("embed.weight", (None, ()))[1]
        if len(embed) != 2:
            die(f"model file {path} has no 2-D embed.weight: not a speedrun model")
        blocks = [k for k in entries if k.startswith("blocks.")]
        n_layer = len({k.split(".")[1] for k in blocks})
        indices = set(map(str, range(n_layer)))
        for k in blocks:
            if k.split(".")[1] not in indices:
                die(f"model file {path} holds tensor {k[:100]}: the tensors of {n_layer} blocks must be "
                    f"numbered 0..{n_layer - 1}")
        padded, n_embd = embed
        if n_embd % HEAD_DIM or n_embd == 0 or n_layer == 0:
            die(f"model file {path}: width {n_embd} (embed.weight) is not a multiple of the head size "
                f"{HEAD_DIM}, or it has no blocks")
        header = dict(vocab_size=VOCAB_SIZE, padded_vocab_size=padded, n_layer=n_layer,
                      n_head=n_embd // HEAD_DIM, n_embd=n_embd)
        shapes = speedrun_shapes(Config(**header))
        freqs = {f"blocks.{i}.attn.rotary.angular_freq": (HEAD_DIM // 2,) for i in range(n_layer)}
        expected = {**shapes, **freqs}
        for k, shape in expected.items():
            if k not in entries:
                die(f"model file {path} lacks tensor {k} {list(shape)}")
            if entries[k][1] != shape:
                die(f"model file {path}: tensor {k} has shape {list(entries[k][1])}, expected {list(shape)}")
        extra = [k for k in entries if k not in expected]
        if extra:
            die(f"model file {path} holds tensor {extra[0][:100]}, which the speedrun model does not have")
        found.update(header=header, shapes=shapes, types={k: e[0] for k, e in entries.items()})
    tensors = read_safetensors(path, check)
    header, shapes, types = found["header"], found["shapes"], found["types"]
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


# -- training step

def speedrun_activation_bytes(cfg):
    """gpt2_activation_bytes for the speedrun model: what its blocks keep for the backward, and the larger of
    what the head's backward and a block's add (tests/test_recompute_torchfunc.py measures it)."""
    N, C, V, H = cfg.batch_size * cfg.seq_len, cfg.n_embd, cfg.padded_vocab_size, cfg.n_head
    s = compute_dtype(cfg).itemsize  # the activations' bytes; the fp32 ones say 4
    kept = {  # per block, from its forward to its backward
        "none": (C           # x (B,T,C): the block's input, norm1's
                 + 2 * C     # norm1's normalized x and output (B,T,C): its gains' and q, k, v's input
                 + 3 * C     # q, k, v (B,T,C) each: q's and k's norms' inputs, the attention's
                 + 2 * C     # q and k after their norm and rotary (B,T,C) each: the attention's inputs
                 + C         # the attention's output (B,T,C): proj's input
                 + C         # x + attention (B,T,C): norm2's input
                 + 2 * C     # norm2's normalized x and output (B,T,C): its gains' and fc's input
                 + 4 * C     # ReLU's output (B,T,4C): square's input
                 + 4 * C) * s  # ReLU^2 (B,T,4C): the MLP's proj's input
        + (2 + 3 * H) * 4,   # fp32: rstd (B,T) of norm1 and norm2, (B,T,H) of q's and k's norms, the
        #                      attention's logsumexp (B,H,T)
        "pointwise": (C + 3 * C + C + C + 4 * C) * s,  # x, q, k, v, attention's output, x + attention, fc's
        #                                                output (the attention reruns: no logsumexp kept)
        "block": C * s,      # x (B,T,C) alone
    }[cfg.recompute]
    embed = 2 * C * s        # the embedding's rows and their norm's normalized x (B,T,C)
    head = (3 * C * s        # the last block's output, the final norm's normalized x and output (B,T,C)
            + 4 * V * 4      # the head's output z, 15 z, rsqrt(z^2 + 15^2) and the logits (B,T,Vp) fp32
            + 3 * V * 4)     # logsumexp's backward: logits minus logsumexp, its exp, times the gradient
    in_block = {  # a block's backward at its peak, in square's: beyond what the blocks keep,
        "none": (C           # the gradient at the block's output (B,T,C)
                 + 4 * C     # the gradient at ReLU^2 (B,T,4C)
                 + 3 * 4 * C  # square's backward's three temporaries (B,T,4C each)
                 - 4 * C) * s,  # less ReLU^2, which proj's backward has freed
        "pointwise": (C + 4 * C + 3 * 4 * C  # those gradients and temporaries
                      + 4 * C    # fc's output's copy (after(), B,T,4C)
                      + 2 * 4 * C) * s,  # ReLU's output and ReLU^2 recomputed (B,T,4C each)
        "block": (C + 4 * C + 3 * 4 * C  # those gradients and temporaries
                  + C        # x's copy (after(), B,T,C)
                  + 19 * C   # the block's rerun: what none keeps beyond x
                  + C) * s,  # the rerun's output (B,T,C)
    }[cfg.recompute]
    return N * (cfg.n_layer * kept + embed + max(head, in_block))


RECIPES["speedrun"] = Recipe(
    help="modded-nanogpt's simplified speedrun baseline (RMSNorm, rotary, ReLU^2, an untied soft-capped "
    f"head, AdamW and Muon), {HEAD_DIM}-wide heads (--n-head is --n-embd / {HEAD_DIM}), --lr is Muon's and "
    "scales the AdamW groups' in proportion ("
    + ", ".join(f"{k} {v}" for k, v in SPEEDRUN_LRS.items()) + "), --weight-decay is on every AdamW "
    "tensor, and its defaults: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in SPEEDRUN_DEFAULTS.items()),
    defaults=SPEEDRUN_DEFAULTS, configure=configure_speedrun, shapes=speedrun_shapes,
    init=init_speedrun_numpy, lr_at=speedrun_lr, muon_names=muon_names, model_file="model.safetensors",
    file_kind="a safetensors file of the reference's state_dict (.safetensors)",
    is_file=is_safetensors_file, read_file=read_speedrun_file, write_file=write_speedrun_file,
    model_name="speedrun GPT", table="embed.weight", optimizers="AdamW and Muon",
    activation_bytes=speedrun_activation_bytes,
    token_losses=speedrun_token_losses, summed=True, scalars=speedrun_scalars, update=speedrun_update,
    embeddings=("embed.weight",), next_logits=speedrun_next_logits)

# -----------------------------------------------------------------------------
# Flags and recipe lookups

def param_shapes(cfg):
    """{name: shape} of the recipe's weights, in the order of its model files."""
    return RECIPES[cfg.recipe].shapes(cfg)


def init_params_numpy(cfg):
    """The recipe's init from cfg.seed, in numpy so that every trainer starts from the same weights."""
    return RECIPES[cfg.recipe].init(cfg)


def lr_at(it, cfg):
    """The recipe's lr of 0-based iteration `it` (the one the step line prints)."""
    return RECIPES[cfg.recipe].lr_at(it, cfg)


def activation_bytes(cfg):
    """Bytes that one micro-batch's activations hold on a device at cfg.recompute, by this trainer's own
    accounting of what its backward keeps (the recipe's)."""
    return RECIPES[cfg.recipe].activation_bytes(cfg)


def parse_args(argv=None):
    """(cfg, explicit): Config with the flags given on the command line over its defaults (a flag is
    named only here and as Config's field), and the model-shape flags given, which a model file's header
    must then match (--model gives all three), and --seed, which a checkpoint's must."""
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], argument_default=argparse.SUPPRESS)
    p.error = die  # a bad flag gets one line naming it, not the whole usage text
    framework_flags(p)
    p.add_argument("--recipe", choices=list(RECIPES), help="; ".join(f"{name}: {r.help}" for name, r in
                   RECIPES.items()) + f" (default {d.recipe})")
    p.add_argument("--data", help="train shards: a dir of prepro_fineweb.py's *_train_*.bin (and "
                   "*_val_*.bin), a shard glob, or 'synthetic' (random tokens from --seed) (default "
                   f"{d.data})")
    p.add_argument("--val-data", help="validation shard glob (default: a --data DIR's *_val_*.bin; none "
                   "with a --data glob)")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), help="preset shape, layers/heads/width: "
                   + ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in MODEL_PRESETS.items())
                   + " (default d12)")
    p.add_argument("--n-layer", type=int, help="transformer blocks (default: --model's)")
    p.add_argument("--n-head", type=int, help="attention heads, dividing --n-embd (default: --model's, or "
                   "what --recipe sets)")
    p.add_argument("--n-embd", type=int, help="width of the embeddings and the residual stream (default: "
                   "--model's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence; from scratch also the positions wpe "
                   f"holds (default {d.seq_len})")
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch on each device (default "
                   f"{d.batch_size})")
    p.add_argument("--total-batch-size", type=int, help="tokens per optimizer step over all devices and "
                   "micro-batches, a multiple of batch size x seq len x devices: gradients accumulate up to "
                   f"it (default {d.total_batch_size})")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {d.steps}: 10B tokens at the "
                   "default batch)")
    p.add_argument("--time-budget", type=float, help="stop after the step at which the summed step time "
                   "reaches this many seconds, with that step's checkpoint and evaluations as the last "
                   "step's; the lr schedule still spans --steps (default 0: run every step)")
    p.add_argument("--lr", type=float, help=f"peak learning rate, reached after --warmup (default {d.lr}; "
                   "a recipe with several groups scales them all with it: see --recipe)")
    p.add_argument("--lr-decay-frac", type=float, help="the cosine decay ends at lr x this, in [0, 1] "
                   f"(default {d.lr_decay_frac})")
    p.add_argument("--warmup", type=int, help=f"steps of linear learning-rate warmup (default {d.warmup})")
    p.add_argument("--weight-decay", type=float, help="AdamW's decoupled weight decay, on the matrices and "
                   f"embeddings only (default {d.weight_decay}; see --recipe)")
    p.add_argument("--grad-clip", type=float, help="clip the gradients to this global norm, 0 = never "
                   f"(default {d.grad_clip})")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="compute dtype; the fp32 masters and AdamW "
                   "state stay fp32 (default bf16 on a GPU, fp32 on a CPU, which only emulates bf16)")
    p.add_argument("--recompute", choices=RECOMPUTE_LEVELS, help="activation memory against compute: none "
                   "keeps what the backward reads, pointwise recomputes the norms and the MLP activation, "
                   f"block reruns each block's forward in the backward (default {d.recompute})")
    p.add_argument("--seed", type=int, help="the weights' init, --data synthetic's tokens and the samples "
                   f"(default {d.seed})")
    p.add_argument("--zero-stage", type=int, help=f"ZeRO stage, {' or '.join(map(str, ZERO_STAGES))} here: "
                   "0 every device holds all of the optimizer state, 1 splits the AdamW moments and the fp32 "
                   "masters of bf16 weights over the devices, 3 (JAX) the weights and gradients too "
                   "(default 0)")
    p.add_argument("--init-from", help="a model file of the recipe to start from, which gives the model "
                   "shape: " + ", ".join(f"{r.file_kind} ({name})" for name, r in RECIPES.items()))
    p.add_argument("--resume", help="a checkpoint dir to continue from, or 'auto': the newest in --out-dir")
    p.add_argument("--force", action="store_true", help="start over in an --out-dir that holds a run: its "
                   "log.jsonl and checkpoints are moved into a replaced_<time> folder there first")
    p.add_argument("--out-dir", help=f"log.jsonl, checkpoints and profiles (default {d.out_dir})")
    p.add_argument("--ckpt-every", type=int, help="steps between checkpoints (the last step's too), 0 = "
                   f"never (default {d.ckpt_every})")
    p.add_argument("--val-every", type=int, help="steps between validation losses (the last step's too), "
                   f"0 = never (default {d.val_every})")
    p.add_argument("--val-tokens", type=int, help="tokens per validation loss: the first val-tokens // seq "
                   "len sequences of the val shards, the same at any device count (default "
                   f"{d.val_tokens})")
    p.add_argument("--val-steps", type=int, help="shorthand for --val-tokens N x batch size x seq len")
    p.add_argument("--hellaswag-every", type=int, help="steps between HellaSwag evaluations (the last "
                   f"step's too), 0 = never (default {d.hellaswag_every})")
    p.add_argument("--hellaswag-limit", type=int, help="HellaSwag examples scored, 0 = all (default 0)")
    p.add_argument("--sample-every", type=int, help="steps between printed samples (the last step's too), "
                   f"0 = never (default {d.sample_every})")
    p.add_argument("--eval-only", action="store_true", help="val loss and HellaSwag of --init-from or "
                   "--resume, then exit")
    p.add_argument("--profile", action="store_true", help=f"profile the {PROFILE_STEPS} steps after the "
                   "first (a trace in OUT_DIR/profile, a summary printed), then train on (docs/FORMATS.md)")
    given = vars(p.parse_args(argv))
    preset = given.pop("model", None)
    val_steps = given.pop("val_steps", None)  # not kept: it only sets val_tokens
    shape = dict(zip(("n_layer", "n_head", "n_embd"), MODEL_PRESETS[preset or "d12"]))
    d = replace(d, **RECIPES[given.get("recipe", d.recipe)].defaults)
    cfg = replace(d, **{**shape, **given})
    cfg.block_size = cfg.seq_len
    for flag in ("n_layer", "n_head", "n_embd", "seq_len", "batch_size", "total_batch_size", "steps",
                 "val_tokens"):
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
                 "time_budget"):
        if not getattr(cfg, flag) >= 0:  # NaN fails this too
            die(f"--{flag.replace('_', '-')} must be >= 0")
    for flag in ("data", "val_data", "init_from", "resume", "out_dir"):  # "$UNSET" would mean no flag
        if flag in given and not given[flag]:
            die(f"--{flag.replace('_', '-')} is empty (an unset shell variable?): give a path, or leave the "
                "flag out")
    if cfg.resume and "init_from" in given:  # which --resume would otherwise ignore
        die("--init-from with --resume: a resumed run continues its checkpoint's weights; leave one out")
    if not 0 < cfg.lr < math.inf:
        die("--lr must be positive and finite")
    if not 0 <= cfg.lr_decay_frac <= 1:
        die("--lr-decay-frac must be in [0, 1]")
    if not (0 <= cfg.weight_decay < math.inf and cfg.grad_clip >= 0):  # NaN fails these too
        die("--weight-decay must be finite and >= 0, --grad-clip >= 0")
    if not 0 <= cfg.seed < 2**63:  # numpy's generators take no negative seed; checkpoints keep it as int64
        die("--seed must be in [0, 2**63)")
    if cfg.zero_stage not in ZERO_STAGES:
        stages = " or ".join(map(str, ZERO_STAGES))
        jax = "; 3 (sharded weights) is the JAX trainer's (train_gpt2_jax.py)" if cfg.zero_stage == 3 else ""
        die(f"--zero-stage {cfg.zero_stage}: this trainer takes {stages}{jax}")
    RECIPES[cfg.recipe].configure(cfg, given, shape)
    if cfg.n_embd % cfg.n_head:
        die(f"--n-embd {cfg.n_embd} is not divisible by --n-head {cfg.n_head}")
    explicit = {k: given[k] for k in (*shape, "seed") if k in given}
    return cfg, ({**shape, **explicit} if preset else explicit)


def check_resumed_seed(explicit, seed):
    """A resumed run keeps its checkpoint's seed (its synthetic data, its samples): --seed, if given, must
    be that one."""
    if explicit.get("seed", seed) != seed:
        die(f"--seed {explicit['seed']} with --resume: the checkpoint's seed is {seed}, which a resumed run "
            f"keeps; leave --seed out, or give {seed}")


def default_dtype(cfg, gpu):
    """Sets --dtype where it was not given, once the trainer knows its device: bf16 on a GPU, fp32 on a
    CPU, which only emulates bf16 (2-4x slower; llm.c's train_gpt2.py defaults to fp32 too). Returns
    what the start line says of it."""
    if cfg.dtype:
        return cfg.dtype
    cfg.dtype = "bf16" if gpu else "fp32"
    if gpu:
        return "bf16 (the default on a GPU; --dtype fp32 for full precision)"
    return "fp32 (the default on a CPU, which only emulates bf16; --dtype bf16 for it)"


def apply_model_header(cfg, header, explicit):
    """Takes the model shape from a model file's header; flags given explicitly must match it."""
    for k in ("n_layer", "n_head", "n_embd"):
        if k in explicit and explicit[k] != header[k]:
            die(f"--{k.replace('_', '-')} {explicit[k]} does not match the model file ({header[k]})")
    if header["vocab_size"] != VOCAB_SIZE or header["padded_vocab_size"] < VOCAB_SIZE:
        die(f"model file has vocab {header['vocab_size']}/{header['padded_vocab_size']}, "
            f"expected {VOCAB_SIZE}")
    if "block_size" in header:  # gpt2's position table bounds T; the speedrun model's rotary does not
        if cfg.seq_len > header["block_size"]:
            die(f"--seq-len {cfg.seq_len} exceeds the model file's max sequence length "
                f"{header['block_size']}")
        cfg.block_size = header["block_size"]
    cfg.n_layer, cfg.n_head, cfg.n_embd = header["n_layer"], header["n_head"], header["n_embd"]
    cfg.padded_vocab_size = header["padded_vocab_size"]

# -----------------------------------------------------------------------------
# Data

SHARD_MAGIC = 20240520
SYNTHETIC_TOKENS = 1 << 23  # length of the random "shard" behind --data synthetic
GET_DATA = ("get shards with `python prepro_fineweb.py` (it writes data/fineweb_edu), or use --data "
            "synthetic for a benchmark")


def read_shard(path):
    """An llm.c token shard (docs/FORMATS.md) as a read-only uint16 memmap, after checking its header and
    size."""
    if not os.path.isfile(path):
        die(f"shard {path} does not exist")
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
        die(f"shard {path} is truncated or padded: header says {ntok} tokens, file holds "
            f"{(size - 1024) // 2}")
    return np.memmap(path, dtype=np.uint16, mode="r", offset=256 * 4, shape=(ntok,))


def find_shards(cfg):
    """(train files, val files) for --data DIR | GLOB, and --val-data GLOB (which also overrides a DIR's val
    shards); (None, None) if synthetic. --eval-only needs no train shards."""
    if cfg.data == "synthetic":
        return None, None
    if os.path.isdir(cfg.data):
        train = sorted(glob.glob(os.path.join(cfg.data, "*_train_*.bin")))
        val = sorted(glob.glob(os.path.join(cfg.data, "*_val_*.bin")))
        if not train and not cfg.eval_only:
            die(f"--data {cfg.data}: no *_train_*.bin shards in that directory ({GET_DATA})")
    else:
        train, val = sorted(glob.glob(cfg.data)), []
        if not train and not cfg.eval_only:
            die(f"--data {cfg.data}: no such directory and no file matches that glob ({GET_DATA})")
    if cfg.val_data:
        val = sorted(glob.glob(cfg.val_data))
        if not val:
            die(f"--val-data {cfg.val_data}: no file matches that glob")
    return train, val


class DataLoader:
    """llm.c's DistributedDataLoader: rank r reads B*T+1 tokens at position p + r*B*T of the current shard,
    all ranks advance p by W*B*T, and all move to the next shard (wrapping around) when fewer than W*B*T+1
    tokens remain after p. (llm.c tests each rank's own position p + r*B*T, so near a shard's end its ranks
    part ways; testing p keeps them together: W ranks of B rows read what one rank of W*B rows reads.)
    files=None reads one in-memory shard of random tokens drawn from `seed`."""

    def __init__(self, files, B, T, rank=0, world=1, seed=0):
        self.files, self.B, self.T, self.rank, self.world, self.seed = files, B, T, rank, world, seed
        self.shard, self.tokens = None, None
        for i in range(len(files) if files else 0):  # fail now, not hours into the run
            if len(read_shard(files[i])) < world * B * T + 1:
                die(f"shard {files[i]} holds fewer than {world * B * T + 1} tokens, one batch needs that")
        self.reset()

    def _load(self, shard):
        if self.shard != shard or self.tokens is None:
            if self.files is None:
                n = max(SYNTHETIC_TOKENS, 2 * (self.world * self.B * self.T + 1))
                self.tokens = np.random.default_rng(self.seed).integers(0, VOCAB_SIZE, n, dtype=np.uint16)
            else:
                self.tokens = read_shard(self.files[shard])
                # here and not in read_shard: the max reads the whole shard, so only a shard put to use pays
                top = int(self.tokens.max())
                if top >= VOCAB_SIZE:
                    die(f"shard {self.files[shard]} holds token ids up to {top}, outside GPT-2's vocabulary "
                        f"of {VOCAB_SIZE} tokens (written with another tokenizer?)")
        self.shard = shard

    def reset(self):
        self.set_state(0, 0)

    def set_state(self, shard, position):
        """Puts the loader at p = `position` in `shard` (what state() returned)."""
        self._load(shard)
        self.position = position

    def state(self):
        """(shard, p): where the next step's rank 0 batch starts, for checkpoints."""
        return self.shard, self.position

    def next_batch(self):
        B, T = self.B, self.T
        start = self.position + self.rank * B * T
        buf = np.asarray(self.tokens[start: start + B * T + 1], dtype=np.int32)
        x, y = buf[:-1].reshape(B, T), buf[1:].reshape(B, T)  # (B, T) inputs, (B, T) targets
        self.position += self.world * B * T
        if self.position + self.world * B * T + 1 > len(self.tokens):
            n_shards = len(self.files) if self.files else 1
            self.set_state((self.shard + 1) % n_shards, 0)
        return x, y


def step_batches(loader, grad_accum):
    """The next optimizer step's micro-batches, stacked: x, y (A,B,T) int32."""
    xs, ys = zip(*(loader.next_batch() for _ in range(grad_accum)))
    return np.stack(xs), np.stack(ys)

# -----------------------------------------------------------------------------
# Checkpoints

def read_weights(path, cfg):
    """(header, params) of a model file of cfg.recipe; a file of another recipe gets one line that says
    which it is."""
    if not os.path.isfile(path):
        die(f"model file {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(9)
    recipe = RECIPES[cfg.recipe]
    for name, other in RECIPES.items():
        if other is not recipe and other.is_file(head) and not recipe.is_file(head):
            die(f"{path} is {other.file_kind}, the {name} recipe's (--recipe {name}): --recipe {cfg.recipe} "
                f"takes {recipe.file_kind}")
    return recipe.read_file(path)


def save_checkpoint(out_dir, step, params, m, v, loader_state, cfg):
    """<out_dir>/ckpt_<step>/{the recipe's model file, state.npz} (docs/FORMATS.md), written to a temporary
    name, then renamed. m holds every tensor's first moment (AdamW's, or Muon's momentum), v the AdamW
    tensors' second."""
    final = os.path.join(out_dir, f"ckpt_{step:07d}")
    tmp, old = final + ".tmp", final + ".old"
    for stale in (tmp, old):  # left by a run that died while saving this step
        if os.path.isdir(stale):
            shutil.rmtree(stale)
    names = list(param_shapes(cfg))
    # a diverged run must not leave non-finite values in the latest checkpoint: the earlier ones stay
    for label, tensors in (("weight", params), ("first moment", m), ("second moment", v)):
        bad = next((k for k in names if k in tensors and not np.isfinite(tensors[k]).all()), None)
        if bad is not None:
            die(f"not writing {final}: the {label} {bad} holds non-finite values (the run diverged; try a "
                "lower --lr): the earlier checkpoints are kept")
    state = {f"m.{k}": np.asarray(m[k], np.float32) for k in names}
    state.update({f"v.{k}": np.asarray(v[k], np.float32) for k in names if k in v})
    state.update(step=np.int64(step), shard=np.int64(loader_state[0]),
                 position=np.int64(loader_state[1]), seed=np.int64(cfg.seed),
                 config=np.array(json.dumps(asdict(cfg))))
    try:
        os.makedirs(tmp)
        recipe = RECIPES[cfg.recipe]
        recipe.write_file(os.path.join(tmp, recipe.model_file), params, cfg)
        with open(os.path.join(tmp, "state.npz.tmp"), "wb") as f:
            np.savez(f, **state)
    except OSError as e:  # nothing of this checkpoint is kept; the earlier ones are untouched
        shutil.rmtree(tmp, ignore_errors=True)
        die(write_failure(tmp, e))
    # a second Ctrl-C stops at once: not between the renames, which would leave the step's checkpoint .old
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        os.replace(os.path.join(tmp, "state.npz.tmp"), os.path.join(tmp, "state.npz"))
        if os.path.isdir(final):  # a checkpoint of the same step from an earlier run: replace it whole
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return final


def latest_checkpoint(out_dir):
    """The newest complete checkpoint directory in out_dir, or None; a newer one without its state.npz
    (not written by a trainer: a save renames whole checkpoints into place) is skipped with a line."""
    found = sorted(d for d in glob.glob(os.path.join(out_dir, "ckpt_*")) if os.path.basename(d)[5:].isdigit())
    while found and not os.path.isfile(os.path.join(found[-1], "state.npz")):
        print(f"--resume auto: skipping {found[-1]}, which has no state.npz")
        found.pop()
    return found[-1] if found else None


# what reading a damaged .npz raises: not a zip at all (ValueError: numpy takes it for a pickle), cut short
# (BadZipFile, EOFError), a member that fails its CRC (BadZipFile) or does not inflate (zlib.error), a
# damaged .npy header in a member (ValueError, TokenError), damaged zip headers
# (NotImplementedError, KeyError, OSError)
DAMAGED_NPZ_ERRORS = (ValueError, EOFError, OSError, KeyError, NotImplementedError, zipfile.BadZipFile,
                      zlib.error, TokenError)


def load_checkpoint(path, cfg):
    """(header, params, m, v, state) from a checkpoint dir; `path` may be 'auto' (newest in cfg.out_dir)."""
    if path == "auto":
        path = latest_checkpoint(cfg.out_dir)
        if path is None:
            die(f"--resume auto: no checkpoint in {cfg.out_dir}")
    if not os.path.isfile(os.path.join(path, "state.npz")):
        die(f"--resume {path}: not a checkpoint directory (no state.npz)")
    recipe = RECIPES[cfg.recipe]
    for name, other in RECIPES.items():
        if other.model_file != recipe.model_file and os.path.isfile(os.path.join(path, other.model_file)):
            die(f"--resume {path}: a checkpoint of the {name} recipe ({other.model_file}), not of --recipe "
                f"{cfg.recipe}")
    header, params = read_weights(os.path.join(path, recipe.model_file), cfg)
    muon = recipe.muon_names({k: p.shape for k, p in params.items()})
    adam = [k for k in params if k not in muon]  # v: AdamW's second moments
    state_file = os.path.join(path, "state.npz")
    try:
        with np.load(state_file) as z:
            missing = [k for k in ("step", "shard", "position", "seed") if k not in z.files]
            missing += [f"m.{k}" for k in params if f"m.{k}" not in z.files]
            missing += [f"v.{k}" for k in adam if f"v.{k}" not in z.files]
            if missing:
                die(f"checkpoint {path} is missing {', '.join(missing[:3])} in state.npz")
            m = {k: z[f"m.{k}"] for k in params}
            v = {k: z[f"v.{k}"] for k in adam}
            state = {}
            for k in ("step", "shard", "position", "seed"):
                if z[k].shape != () or z[k].dtype.kind not in "iu":
                    die(f"checkpoint {state_file}: {k} is {z[k].dtype} {z[k].shape}, not an integer")
                state[k] = int(z[k])
    except DAMAGED_NPZ_ERRORS as e:
        detail = (str(e).splitlines() or ["no detail"])[0][:120]
        die(f"checkpoint {state_file} is damaged ({type(e).__name__}: {detail})")
    for k, low in (("step", 1), ("shard", 0), ("position", 0), ("seed", 0)):  # checkpoints start at step 1
        if not low <= state[k] < 2**63:  # int64, as saved; a seed as --seed takes it
            die(f"checkpoint {state_file}: {k} is {state[k]}, out of range (must be in [{low}, 2**63))")
    for k in params:
        moments = [m[k], v[k]] if k in v else [m[k]]
        if any(t.shape != params[k].shape for t in moments):
            die(f"checkpoint {path}: optimizer state for {k} has shape {m[k].shape}, "
                f"the model has {params[k].shape}")
        if any(t.dtype != np.float32 for t in moments):
            die(f"checkpoint {path}: optimizer state for {k} is {'/'.join(str(t.dtype) for t in moments)}, "
                "not float32")
        if not all(np.isfinite(t).all() for t in moments):
            die(f"checkpoint {path}: optimizer state for {k} holds non-finite values (NaN or inf): resume "
                "from an earlier checkpoint")
    return header, params, m, v, state

# -----------------------------------------------------------------------------
# Evaluation and logging

HELLASWAG_MIN_WIDTH = 64  # rows are padded to a power of two >= this: a handful of compiled shapes
SAMPLE_COUNT, SAMPLE_TOKENS, TOP_K = 4, 63, 40  # EOT + 63 = 64 wide: a multiple of 64
VAL_BAR_MIN_STEPS = 20  # a validation of more batches than this shows a progress bar (on a terminal)


def val_batches(cfg, loader):
    """How many rows of each global batch of the validation count: the first cfg.val_tokens // T sequences
    of the val shards, the same ones at any batch size and device count (all of every batch but the
    last). Behind a progress bar on a terminal's stderr when there are many batches (rank 0 draws it)."""
    rows, batch = cfg.val_tokens // cfg.seq_len, loader.B * loader.world
    counted = [min(batch, rows - first) for first in range(0, rows, batch)]
    if len(counted) <= VAL_BAR_MIN_STEPS or loader.rank != 0:
        return counted
    return hellaswag.terminal_progress(counted, len(counted), "val")


def check_val_tokens(cfg, loader):
    """A validation (--eval-only, or --val-every) must find its --val-tokens in the val shards as this run
    reads them, none twice: whole global batches from each shard in turn, moving on where one no longer
    fits. Else one line says what they hold."""
    if loader is None or not (cfg.eval_only or cfg.val_every > 0):
        return
    batch, rows = loader.B * loader.world, cfg.val_tokens // cfg.seq_len
    sizes = [len(read_shard(f)) for f in loader.files]
    held = sum((n - 1) // (batch * cfg.seq_len) for n in sizes) * batch
    if rows > held:
        die(f"--val-tokens {cfg.val_tokens} asks for {rows} sequences of {cfg.seq_len} tokens, but the val "
            f"shards ({len(sizes)} file(s), {sum(sizes)} tokens) hold {held} in this run's batches of "
            f"{batch} sequences: lower --val-tokens (or --val-steps)")


PEAK_FLOPS = {  # dense tensor-core peak (bf16, tf32) by GPU name, from the vendors' datasheets
    "H100 PCIe": (756e12, 378e12),
    "H100 NVL": (835e12, 417.5e12),
    "H100": (989e12, 494.5e12),   # SXM
    "H200 NVL": (835e12, 417.5e12),
    "H200": (989e12, 494.5e12),
    "A100": (312e12, 156e12),
    "L40S": (362e12, 183e12),
    "4090": (165e12, 82.6e12),
}


def model_flops_per_token(cfg, n_params):
    """6N + 12LCT (PaLM appendix B / nanoGPT); N = parameters without wpe."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len


def peak_flops(device_name, dtype):
    """The device's dense peak for this dtype, or None when it is not a GPU we know (MFU then 'n/a')."""
    for key, (bf16, tf32) in PEAK_FLOPS.items():
        if key in device_name:
            return bf16 if dtype == "bf16" else tf32
    return None


def drop_partial_log_line(out_dir):
    """Cuts <out_dir>/log.jsonl back to its last complete line. A process killed while it appended an event
    leaves half a line, which the next event would otherwise be glued to and lost with."""
    path = os.path.join(out_dir, "log.jsonl")
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def write_failure(path, e):
    """The one line that says why writing `path` failed, a full disk said as such."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"cannot write {path}: no space left, the disk is full (free some; --resume auto continues)"
    return f"cannot write {path}: {e.strerror}"


class RunLock:
    """<out_dir>/.lock, flock'ed by process 0 while this object lives (main holds it: one out dir, one live
    run), and naming its holder; the kernel drops a dead process's flock, so a stale file blocks nothing.
    The file goes when the lock is released, with the inode checked on taking it (a run that opened the
    file just before it went would otherwise lock a deleted one)."""
    held = None  # weakref.ref to the lock this process holds

    def __init__(self, out):
        earlier = RunLock.held and RunLock.held()
        if earlier is not None:  # an earlier main() of this process, ended (main runs one run at a time)
            earlier.release()
        self.path, self.fd = os.path.join(out, ".lock"), None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        RunLock.held = weakref.ref(self)

    def release(self):
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.remove(self.path)
            os.close(self.fd)
            self.fd = None

    __del__ = release


def move_aside(out, names, prefix):
    """Moves <out>/<names> into a new <out>/<prefix><time>[_n] folder (unique however fast runs follow
    each other); returns its path."""
    stamp = f"{prefix}{datetime.datetime.now():%Y%m%d_%H%M%S}"
    for n in range(1, 1000):
        aside = os.path.join(out, stamp if n == 1 else f"{stamp}_{n}")
        try:
            os.mkdir(aside)
            break
        except FileExistsError:
            continue
    for name in names:
        os.replace(os.path.join(out, name), os.path.join(aside, name))
    return aside


def abandon_newer(out, step):
    """A resume from step `step`: the out dir's newer checkpoints are of an abandoned branch, and so are
    log.jsonl's lines past that step. Both move into an abandoned_<time> folder, so that --resume auto
    and the log follow the live branch."""
    newer = [os.path.basename(p) for p in sorted(glob.glob(os.path.join(out, "ckpt_*")))
             if os.path.basename(p)[5:].isdigit() and int(os.path.basename(p)[5:]) > step]
    if not newer:
        return
    aside = move_aside(out, newer, "abandoned_")
    log = os.path.join(out, "log.jsonl")
    if os.path.isfile(log):
        kept, cut = [], []
        with open(log, "rb") as f:
            for line in f:
                try:
                    later = json.loads(line).get("step", 0) > step
                except (ValueError, AttributeError, TypeError):
                    later = False
                (cut if later else kept).append(line)
        with open(os.path.join(aside, "log.jsonl"), "wb") as f:
            f.writelines(cut)
        with open(log + ".tmp", "wb") as f:
            f.writelines(kept)
        os.replace(log + ".tmp", log)
    print(f"--resume: step {step} is now the live run: the newer {', '.join(newer)} and log lines past step "
          f"{step} moved to {aside}")


def prepare_out_dir(cfg, master, step):
    """Makes --out-dir, checked writable, and returns process 0's RunLock on it (None elsewhere), which
    the caller holds for the run's life. One that holds a run (log.jsonl, checkpoints) is refused unless
    this run continues it (--resume from `step`: newer checkpoints then go to abandoned_<time>,
    abandon_newer) or starts over (--force: that run's files move into a replaced_<time> folder there, so
    that log.jsonl holds one run). A half line that a kill left at the end of the log is cut off."""
    out = cfg.out_dir

    def held_run():
        run = [os.path.basename(p) for p in sorted(glob.glob(os.path.join(out, "ckpt_*")))]
        return run + [name for name in ("log.jsonl", "profile") if os.path.exists(os.path.join(out, name))]
    if not master:  # process 0 decides: its start event may already be in the log the others would see
        return None
    run = held_run()
    if any(name != "profile" for name in run) and not cfg.resume and not cfg.force:
        listed = ", ".join(run[:3]) + (", ..." if len(run) > 3 else "")
        die(f"--out-dir {out} already holds a run ({listed}): --resume auto continues it, --force starts "
            "over")
    try:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, ".writable.tmp"), "w"):
            pass
        os.remove(os.path.join(out, ".writable.tmp"))
    except OSError as e:
        die(f"--out-dir: {write_failure(out, e)}")
    lock = RunLock(out)  # before anything moves: a live run's files stay where it writes them
    try:
        if cfg.resume and not cfg.eval_only:
            abandon_newer(out, step)
        run = held_run()
        if cfg.force and not cfg.resume and any(name != "profile" for name in run):
            aside = move_aside(out, run, "replaced_")
            print(f"--force: the run in {out} moved to {aside}")
    except OSError as e:
        die(f"--out-dir: {write_failure(getattr(e, 'filename', None) or out, e)}")
    drop_partial_log_line(out)
    return lock


def logged_evals(out_dir, step):
    """The evaluations ("val_loss", "hellaswag_acc") that <out_dir>/log.jsonl records at `step`, by any
    trainer."""
    path = os.path.join(out_dir, "log.jsonl")
    if not os.path.isfile(path):
        return set()
    found = set()
    with open(path) as f:
        for line in f:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash while it was written
                continue
            if event.get("step") == step:
                found.update(k for k in ("val_loss", "hellaswag_acc") if k in event)
    return found


def format_memory(cfg, held, activations, world):
    """The start line's bytes per device: the training state (device_state_bytes) and one micro-batch's
    activations at --recompute (activation_bytes)."""
    return (f"per device: params {held['params'] / 1e6:.1f} MB | grads {held['grads'] / 1e6:.1f} MB | fp32 "
            f"masters {held['masters'] / 1e6:.1f} MB | {RECIPES[cfg.recipe].optimizers} moments "
            f"{held['moments'] / 1e6:.1f} MB (ZeRO stage {cfg.zero_stage} over {world} devices) | "
            f"activations {activations / 1e6:.1f} MB per micro-batch (--recompute {cfg.recompute})")


def host_memory_available():
    """Bytes this host can give a process without swapping (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def memory_warning(held, activations, world, available):
    """On the CPU, running out of memory is the kernel's kill (exit 137, not a word from the trainer): a
    warning line when the accounting's state and one micro-batch's activations on `world` devices exceed
    the host's `available` bytes; None when they fit or `available` is unknown."""
    need = (sum(held.values()) + activations) * world
    if available is None or need <= available:
        return None
    return (f"warning: by the accounting above, {world} device(s) need {need / 1e9:.1f} GB and this host has "
            f"{available / 1e9:.1f} GB available: the kernel may kill the run (try a smaller --batch-size or "
            f"a cheaper --recompute)")


def start_event(cfg, step, world, held, activations):
    """log.jsonl's first event of each launch (docs/FORMATS.md): the step it starts from, the config, the
    device count and the bytes of the start line."""
    return dict(event="start", step=step, devices=world, state_bytes=held, activation_bytes=activations,
                config=dict(vars(cfg)))


def format_step(step, cfg, loss, norm, lr, dt_ms, tokens_per_s, mfu, peak_mem_gb):
    mfu_s = "n/a" if mfu is None else f"{100 * mfu:.1f}%"
    mem_s = "n/a" if peak_mem_gb is None else f"{peak_mem_gb:.1f} GB"
    return (f"step {step:5d}/{cfg.steps} | loss {loss:.6f} | norm {norm:.4f} | lr {lr:.4e} | "
            f"{dt_ms:.1f} ms | {tokens_per_s:,.0f} tok/s | mfu {mfu_s} | mem {mem_s}")


PROFILE_STEPS = 3


def due(every, step, steps):
    return every > 0 and (step % every == 0 or step == steps)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C; what schedulers (SLURM, Kubernetes) send before a kill


class StopSignals:
    """SIGINT and SIGTERM: during training (`training` set) the first asks the run to stop at the end of the
    step (`received` holds its number; main checks it at each step boundary, writes a checkpoint, exits
    128 + the number as a shell reports it); outside training, or a second one, stops at once. Either way
    one line (process 0's) and no traceback."""

    def __init__(self):
        self.received, self.training, self.master, self.previous = 0, False, True, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # the only thread that may set handlers
            self.previous = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.training and not self.received:
            self.received = signum
            self.tell(f"{name}: stopping at the end of this step, with a checkpoint ({name} again stops at once)")
            return
        # before training (startup, --eval-only, --test, --bench-ops) there is nothing of this launch to resume
        hint = "; --resume auto continues from the latest checkpoint" if self.training else ""
        self.tell(f"{name}: stopped at once{hint}")
        raise SystemExit(128 + signum)

    def tell(self, line):  # os.write: print could be inside a print of the interrupted code
        if self.master:
            os.write(2, f"{line}\n".encode())


def stops_on_signals(main):
    """main(argv, signals) run under StopSignals, the handlers before restored when it ends."""
    @functools.wraps(main)
    def run(argv=None):
        with StopSignals() as signals:
            return main(argv, signals)
    return run


def stopped_by_signal(signum, step, cfg, master):
    """Ends a run that a signal stopped after `step` (its checkpoint written): one line, 128 + signum."""
    if master:
        saved = "its checkpoint saved" if due(cfg.ckpt_every, step, step) else "no checkpoint (--ckpt-every 0)"
        print(f"{signal.Signals(signum).name}: stopped after step {step} of {cfg.steps}, {saved}; --resume auto "
              "continues", file=sys.stderr)
    raise SystemExit(128 + signum)


def stop_diverged(step, loss, norm, cfg):
    """The one line that stops a run whose step `step` gave a non-finite loss or grad norm, before that
    step is logged or checkpointed (llm.c and modded-nanogpt stop too)."""
    latest = sorted(glob.glob(os.path.join(cfg.out_dir, "ckpt_*[0-9]")))
    kept = f"{latest[-1]} stays the latest checkpoint" if latest else "no checkpoint was written"
    die(f"step {step}: loss {loss}, grad norm {norm}: the run diverged (try a lower --lr or a --grad-clip); "
        f"stopped before logging or saving this step, {kept}")

# -----------------------------------------------------------------------------
# Torch: processes, ZeRO-1 and failures

FLAT_ALIGN = 16  # every tensor starts 64 bytes into a flat buffer, and every shard is a multiple of 16


def flat_layout(shapes, groups, world):
    """({name: first element}, [(first, end) of each group]) of a flat buffer holding the tensors of
    `shapes` group after group, each from a FLAT_ALIGN boundary; every group is padded to a multiple of
    FLAT_ALIGN x world, so that any number of processes gets equal, aligned shards of it (the padding
    stays zero)."""
    starts, spans, size = {}, [], 0
    unit = FLAT_ALIGN * world
    for names, _ in groups:
        first = size
        for k in names:
            starts[k] = size
            size += -(-math.prod(shapes[k]) // FLAT_ALIGN) * FLAT_ALIGN
        size = first + -(-(size - first) // unit) * unit
        spans.append((first, size))
    return starts, spans


def flat_views(buffer, starts, shapes, names=PARAM_NAMES, first=0):
    """{name: its tensor, a view into the flat buffer}; `buffer` may hold only the group that starts at
    element `first` of the layout."""
    return {k: buffer[starts[k] - first:starts[k] - first + math.prod(shapes[k])].view(shapes[k])
            for k in names}


def whole_matrix_layout(shapes, names, world, first):
    """({name: first element}, (first, end)) of Muon's matrices in the flat buffers from element `first`:
    dealt round-robin to the processes, largest first, as the reference's Muon deals them, each process's
    matrices one after another in the rank-th of `world` equal stretches, so that its ZeRO-1 shard of the
    group (shard_ranges) holds its matrices whole."""
    order = sorted(names, key=lambda k: shapes[k], reverse=True)
    ends, local = [0] * world, {}
    for i, k in enumerate(order):
        local[k] = (i % world, ends[i % world])
        ends[i % world] += -(-math.prod(shapes[k]) // FLAT_ALIGN) * FLAT_ALIGN
    stretch = max(ends)
    return {k: first + local[k][0] * stretch + local[k][1] for k in names}, (first, first + world * stretch)


def state_layout(cfg, shapes, world):
    """(groups, {name: first element}, [(first, end) of each group]): compute_groups' groups in the flat
    buffers, laid out by flat_layout, and Muon's matrices by whole_matrix_layout after them."""
    groups = compute_groups(cfg)
    muon = set(RECIPES[cfg.recipe].muon_names(shapes))
    split = [g for g in groups if not muon.intersection(g[0])]
    starts, spans = flat_layout(shapes, split, world)
    if len(split) < len(groups):
        more, span = whole_matrix_layout(shapes, groups[-1][0], world, spans[-1][1])
        starts.update(more)
        spans.append(span)
    return groups, starts, spans


def shard_ranges(starts, shapes, span, rank, world):
    """ZeRO-1: {name: (lo, hi)}, the elements of each tensor of the group laid out over `span` that lie in
    rank's shard of it (elements [rank S, (rank+1) S) of the group, S = its size / world), as offsets into
    the flat buffer; tensors outside the shard are left out, and a tensor may be split between shards."""
    n = (span[1] - span[0]) // world
    first, ranges = span[0] + rank * n, {}
    for k in starts:
        if not span[0] <= starts[k] < span[1]:
            continue
        lo, hi = max(starts[k], first), min(starts[k] + math.prod(shapes[k]), first + n)
        if lo < hi:
            ranges[k] = (lo, hi)
    return ranges


def gather_state(state, cfg, world):
    """(params, m, v), each {name: whole fp32 tensor on the device}, for a checkpoint, which stays the same
    at any stage and process count. At stage 1 the shards of the masters and moments are all-gathered,
    group by group, into new buffers: collectives, so every process calls this (and rank 0 writes)."""
    if cfg.zero_stage == 0:
        return state["params"], state["m"], state["v"]
    shapes = param_shapes(cfg)
    full = []
    for name in ("params", "m", "v"):
        buffer = torch.empty_like(state["grad_buffer"])                            # (P,)
        names = []
        for group in state["groups"]:
            if name not in group:  # Muon's group has no v
                continue
            first, end = group["span"]
            if world > 1:
                dist.all_gather_single(buffer[first:end], group[name])
            else:
                buffer[first:end].copy_(group[name])
            names += [k for k in shapes if first <= state["starts"][k] < end]
        full.append(flat_views(buffer, state["starts"], shapes, names))
    return tuple(full)


def put_batch(x, device):
    """A token batch as an int64 tensor on device, copied from pinned memory without blocking, so the
    host can queue the step while the GPU is still busy."""
    t = torch.from_numpy(np.asarray(x, dtype=np.int64))                           # (..., T)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def to_numpy(tensors):
    """{name: fp32 numpy array} from a dict of device tensors, for the framework-neutral files."""
    return {k: t.detach().float().cpu().numpy() for k, t in tensors.items()}


def to_device(arrays, device):
    """{name: fp32 tensor on device} from a dict of numpy arrays: copies, never views, since the
    optimizer updates them in place."""
    return {k: torch.tensor(np.asarray(a, np.float32), device=device) for k, a in arrays.items()}


def evaluate_val(row_losses, weights, loader, cfg, device, world):
    """Mean token loss over the first cfg.val_tokens // T sequences of the val shards (the loader restarts
    each time). Each process reads its rank's rows of every global batch, as llm.c's loader does; rows of
    the last batch past those sequences count for nothing, so that the same weights give the same loss at
    any batch size and process count."""
    loader.reset()
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
    """(rank, world, device, store): under torchrun one process per GPU (nccl) or per share of the CPU
    cores (gloo), else one process on the GPU if there is one; store: the run's key-value store at
    $MASTER_ADDR:$MASTER_PORT (None for one process), which lost_processes reads. Sets the matmul
    precision cfg.dtype promises."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if world > 1:  # processes on one machine split its cores instead of oversubscribing them
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    store = None
    if world > 1:
        port = os.environ.get("MASTER_PORT", "")
        if not (os.environ.get("MASTER_ADDR") and port.isascii() and port.isdigit()
                and 1 <= int(port) <= 65535):
            die(f"$WORLD_SIZE is {world}, but $MASTER_ADDR / $MASTER_PORT ({port!r}: a port in 1-65535) do not "
                "say where process 0 is (launch with torchrun, or set both)")
        # the store env:// would make, made here so that it can be read after a failure; under torchrun
        # its agent already serves it
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(port), world,
                              is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                              timeout=datetime.timedelta(minutes=30))
        # rank 0 alone evaluates HellaSwag while the others wait in the next all-reduce: allow for it
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world, timeout=datetime.timedelta(hours=1))
        atexit.register(dist.destroy_process_group)
    # fp32 means fp32: cuBLAS and cuDNN would otherwise run fp32 matmuls on a GPU as TF32
    tf32 = cfg.dtype == "bf16"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    return rank, world, device, store


@contextlib.contextmanager
def out_of_memory_is_an_error(cfg):
    """Running out of device memory (at compile or run time) is a bad --batch-size or --recompute: one line,
    no trace."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        cheaper = "" if cfg.recompute == "block" else " or a cheaper --recompute"
        die(f"out of device memory at --batch-size {cfg.batch_size} --recompute {cfg.recompute} (try a "
            f"smaller batch{cheaper}): {str(e).splitlines()[0][:200]}")


CENSUS_SECONDS = 5  # after a failed collective: how long the survivors wait to hear from each other


def lost_processes(store, rank, world):
    """After a collective failed: the ranks that did not answer a roll call in the run's store within
    CENSUS_SECONDS (each survivor writes its mark, then waits for the others'), or None when the store
    itself is gone (its host, process 0, stopped: checked with a plain connection first, since a write to a
    closed store prints a C++ warning). Process 0 stays a second longer, so that the others read the
    marks before its store closes."""
    try:
        socket.create_connection((store.host, store.port), timeout=2).close()
        store.set(f"census/{rank}", "alive")
        deadline = time.monotonic() + CENSUS_SECONDS
        silent = list(range(world))
        while silent and time.monotonic() < deadline:
            silent = [r for r in range(world) if not store.check([f"census/{r}"])]
            time.sleep(0.1)
        if rank == 0:
            time.sleep(1)
        return silent
    except (OSError, RuntimeError, dist.DistError):
        return None


def agree_to_stop(budget_spent, signum, rank, device):
    """(--time-budget reached, signal number or 0) as every process takes them at a step boundary, so that
    all stop at the same step: process 0's clock decides, and a signal to any process stops all."""
    flags = torch.tensor([int(budget_spent and rank == 0), signum], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    budget_spent, signum = flags.tolist()
    return bool(budget_spent), signum


@contextlib.contextmanager
def a_lost_process_is_an_error(store, rank, world):
    """A process of a multi-process run that dies (killed, out of memory, its machine lost) fails the
    survivors' next collective: each survivor then names the lost process in one line, says how the run
    goes on, and exits at once (a teardown of the process group could wait on the dead peer). An error
    raised outside torch.distributed, or one after which every process answers, passes through."""
    try:
        yield
    except RuntimeError as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
        if world == 1 or not where.startswith("torch.distributed"):
            raise
        silent = lost_processes(store, rank, world)
        if silent == []:
            raise
        who = ", ".join(map(str, silent)) if silent else "0 (its store is gone)"
        os.write(2, f"error: lost process {who} of {world}: it stopped or was killed, so process {rank} stops "
                    "too; `--resume auto` continues the run from its latest checkpoint\n".encode())
        os._exit(1)

# -----------------------------------------------------------------------------
# Torchfunc plumbing: state, evaluation and profiles

def compute_groups(cfg):
    """[(names, dtype)]: the tensors the model computes with in one dtype, each group a stretch of its own
    in the flat buffers (so that at stage 1 one all-gather per group refreshes its weights): with --dtype
    bf16 the fp32 embedding tables, then the bf16 copies of the rest; in fp32 all of them. The speedrun
    recipe's Muon matrices, which a process updates whole, are a last group of their own."""
    recipe, shapes = RECIPES[cfg.recipe], param_shapes(cfg)
    muon = recipe.muon_names(shapes)
    names = [k for k in shapes if k not in muon]
    if cfg.dtype == "fp32":
        groups = [(names, torch.float32)]
    else:
        groups = [([k for k in names if k in recipe.embeddings], torch.float32),
                  ([k for k in names if k not in recipe.embeddings], torch.bfloat16)]
    return groups + ([(muon, compute_dtype(cfg))] if muon else [])


def make_state(params, m, v, cfg, device, rank, world):
    """The training state on the device, from numpy dicts of the fp32 masters and the moments: every
    process holds all of the fp32 gradients `grads` (views of one flat buffer, `grad_buffer`) and all of
    the `weights` the model computes with; what else it holds is its ZeRO stage's (whole_state,
    sharded_state). train_step updates `shard_params` from `shard_grads`, m and v, and refreshes
    `shard_copies`."""
    shapes = param_shapes(cfg)
    groups, starts, spans = state_layout(cfg, shapes, world)
    state = {"grad_buffer": torch.zeros(spans[-1][1], dtype=torch.float32, device=device)}  # (P,) padded
    state["grads"], state["starts"] = flat_views(state["grad_buffer"], starts, shapes, list(shapes)), starts
    if cfg.zero_stage == 0:
        return whole_state(state, params, m, v, cfg, device)
    return sharded_state(state, params, m, v, cfg, device, rank, world)


def whole_state(state, params, m, v, cfg, device):
    """Stage 0: a process's shard is the whole model. It holds all of the fp32 masters `params`, their
    bf16 `copies` and the moments m, v; one all-reduce sums the gradients, and it updates every weight."""
    state.update(params=to_device(params, device), m=to_device(m, device), v=to_device(v, device))
    state["copies"] = compute_copies(state["params"], cfg)  # refreshed by every update from then on
    state["weights"] = model_weights(state["params"], state["copies"])
    state.update(shard_params=state["params"], shard_grads=state["grads"], shard_copies=state["copies"])
    return state


def sharded_state(state, params, m, v, cfg, device, rank, world):
    """Stage 1 (ZeRO-1): per compute group, a process keeps 1/world of the group's stretch of the flat
    layout (state_layout; Muon's holds whole matrices) of the fp32 masters, of m and v, and of the summed
    gradients (reduce-scattered into it). It updates that shard of the masters and of the weights
    (`own_weights`); one all-gather of the group's weights brings every process every update.
    `shard_params`, `shard_grads`, `shard_copies`, m and v are {name: 1-D piece} of the tensors in the
    shard (Muon's matrices whole, in their shapes)."""
    shapes = param_shapes(cfg)
    groups, starts, spans = state_layout(cfg, shapes, world)
    muon = set(RECIPES[cfg.recipe].muon_names(shapes))
    state.update(groups=[], weights={}, shard_params={}, shard_grads={}, shard_copies={}, m={}, v={})
    for (names, dtype), (first, end) in zip(groups, spans):
        n = (end - first) // world
        own = first + rank * n  # this process's shard: elements [own, own + n) of the layout
        group = {"span": (first, end), "weights": torch.zeros(end - first, dtype=dtype, device=device)}
        views = flat_views(group["weights"], starts, shapes, names, first)
        for k in names:
            views[k].copy_(torch.from_numpy(np.asarray(params[k], np.float32)))
        state["weights"].update(views)
        group["own_weights"] = group["weights"][own - first:own - first + n]      # (S,) a view
        # fp32 weights are their own masters; bf16 ones get an fp32 shard
        group["params"] = (group["own_weights"] if dtype == torch.float32 else
                           torch.zeros(n, dtype=torch.float32, device=device))     # (S,)
        # one process alone reduces into its gradient buffer itself
        group["grads"] = (state["grad_buffer"][first:end] if world == 1 else
                          torch.zeros(n, dtype=torch.float32, device=device))      # (S,)
        sources = {"m": m} if muon.intersection(names) else {"m": m, "v": v}  # Muon keeps one buffer
        for name in sources:
            group[name] = torch.zeros(n, dtype=torch.float32, device=device)      # (S,)
        if dtype != torch.float32:  # the fp32 masters that are weights already hold their values
            sources["params"] = params
        ranges = shard_ranges(starts, shapes, (first, end), rank, world)
        for name, source in sources.items():
            for k, (lo, hi) in ranges.items():
                flat = np.asarray(source[k], np.float32).reshape(-1)[lo - starts[k]:hi - starts[k]]
                group[name][lo - own:hi - own] = torch.from_numpy(flat.copy())
        pieces = {"params": "shard_params", "grads": "shard_grads", "m": "m", "v": "v"}
        if dtype != torch.float32:
            pieces["own_weights"] = "shard_copies"
        for k, (lo, hi) in ranges.items():
            for name, into in pieces.items():
                if name in group:
                    piece = group[name][lo - own:hi - own]                         # (hi-lo,)
                    state[into][k] = piece.view(shapes[k]) if k in muon else piece  # Muon's whole, shaped
        state["groups"].append(group)
    state["shard_copies"] = state["shard_copies"] or None
    return state


def device_state_bytes(cfg, shapes, world):
    """Bytes of weights, gradients and optimizer state that one process holds (make_state's tensors; not
    the activations, nor the transient gradients grad_fn returns per micro-batch), by kind."""
    # params: the bf16 compute copies (none in fp32), at either stage all of them; grads: the fp32 flat
    # buffer, plus at stage 1 the reduce-scattered shard; masters: all of the fp32 masters, or at stage 1
    # a shard of those that have bf16 copies (fp32 ones are what the model computes with: whole);
    # moments: AdamW's m and v and Muon's momentum, all or (stage 1) a shard
    groups, _, spans = state_layout(cfg, shapes, world)
    muon = set(RECIPES[cfg.recipe].muon_names(shapes))
    size = spans[-1][1]
    if cfg.zero_stage == 0:
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


def evaluate_hellaswag(row_losses_fn, params, cfg, device):
    """(acc, acc_norm) through hellaswag.evaluate. A row longer than the model's context keeps its last
    block_size tokens (the losses of the cropped-off context positions are reported as 0; they are
    never ending tokens unless an ending alone is longer than the context)."""
    def row_losses(tokens):                                                        # (4, n+1) int64
        x, y = tokens[:, :-1], tokens[:, 1:]                                       # (4, n) each
        n = x.shape[1]
        crop = max(0, n - cfg.block_size)
        width = min(cfg.block_size, max(HELLASWAG_MIN_WIDTH, 1 << (n - crop - 1).bit_length()))
        xp = np.zeros((x.shape[0], width), np.int64)                              # (4, width)
        yp = np.zeros((x.shape[0], width), np.int64)                              # (4, width)
        xp[:, :n - crop], yp[:, :n - crop] = x[:, crop:], y[:, crop:]
        losses = row_losses_fn(params, put_batch(xp, device), put_batch(yp, device), cfg)  # (4, width)
        out = np.zeros((x.shape[0], n), np.float32)                               # (4, n)
        out[:, crop:] = losses[:, :n - crop].cpu().numpy()
        return out
    return hellaswag.evaluate(row_losses, limit=cfg.hellaswag_limit)


def generate(params, generator, cfg):
    """SAMPLE_COUNT continuations of EOT sampled with top-k TOP_K over the first V logits: token ids
    (S, T) int64 with column 0 = EOT. Every position is recomputed each time (no KV cache): the causal
    mask makes the not-yet-sampled zeros to the right irrelevant. Eager: 63 small forwards take less time
    than compiling one."""
    device = next(iter(params.values())).device
    T = min(cfg.block_size, SAMPLE_TOKENS + 1)
    tokens = torch.zeros((SAMPLE_COUNT, T), dtype=torch.int64, device=device)     # (S,T)
    tokens[:, 0] = EOT
    for t in range(T - 1):                                                         # token t+1 from 0..t
        logits = RECIPES[cfg.recipe].next_logits(params, tokens, t, cfg)          # (S,V)
        top_logits, top_ids = torch.topk(logits, TOP_K, dim=-1)                   # (S,K) each
        choice = torch.multinomial(torch.softmax(top_logits, dim=-1), 1, generator=generator)  # (S,1)
        tokens[:, t + 1] = torch.gather(top_ids, -1, choice)[:, 0]
    return tokens


def log_event(out_dir, **record):
    """Appends one JSON object to <out_dir>/log.jsonl (the keys of docs/FORMATS.md)."""
    record["framework"] = FRAMEWORK
    path = os.path.join(out_dir, "log.jsonl")
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:  # a half line left is cut off on --resume (drop_partial_log_line)
        die(write_failure(path, e))


def peak_memory_gb(device):
    """Peak bytes allocated on the GPU by torch's caching allocator, in GB; None on the CPU, where torch
    keeps no statistics."""
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def phase_table(profiler, steps, on_gpu, compiled, rows=8):
    """The profiled steps' op time by phase, as text: ops that the autograd engine runs are the backward,
    the other ops inside a grad_fn call the forward (compiled, forward and backward are one graph: one
    phase), all else (gradient accumulation, all-reduce, norm, AdamW) the optimizer step. Each op's self
    time (on a GPU, of the kernels it launched), summed over its calls, per step; the top `rows` per phase."""
    forward = "forward+backward (compiled)" if compiled else "forward"
    phases = [forward, "backward", "optimizer step"]
    totals = {}  # (phase, op name) -> [calls, microseconds]
    for e in profiler.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue  # a kernel's time counts for the op that launched it
        phase, p = phases[2], e
        while p is not None:  # the innermost mark above the op decides
            if p.name.startswith("autograd::engine::evaluate_function"):
                phase = phases[1]
                break
            if p.name == GRADIENT:
                phase = forward
                break
            p = p.cpu_parent
        t = totals.setdefault((phase, e.name), [0, 0.0])
        t[0] += 1
        t[1] += e.self_device_time_total if on_gpu else e.self_cpu_time_total
    grand = sum(t for _, t in totals.values()) or 1.0

    def line(phase, name, calls, us):
        share = 100 * us / grand
        return f"{phase:<28} {name[:50]:<50} {calls // steps:>6} {us / 1e3 / steps:>9.3f} {share:>5.1f}%"

    clock = "device" if on_gpu else "CPU"
    lines = [f"{'phase':<28} {'op (self ' + clock + ' time)':<50} {'calls':>6} {'ms/step':>9} {'share':>6}"]
    for phase in phases:
        ops = sorted(((t, c, name) for (ph, name), (c, t) in totals.items() if ph == phase), reverse=True)
        lines.append(line(phase, "all", sum(c for _, c, _ in ops), sum(t for t, _, _ in ops)))
        lines += [line("", name, c, t) for t, c, name in ops[:rows]]
    return "\n".join(lines)


# Inductor options for every torch.compile here. Mix-order reduction (on by default on GPUs since torch
# 2.10: a LayerNorm backward's row sums and its weight/bias column sums in one kernel, from 4096 rows up)
# drops the write of a column sum whose output is a slice of a concatenated buffer: the generated code
# rebinds the buffer's name to the reduced workspace instead of copying into the slice (pytorch/pytorch
# issue 193061, pull request 193103; the torch 2.13 source still rebinds). Our per-layer LayerNorm and
# bias gradients are such slices of their (L, ...) stacks: with it on, the fused ones are uninitialized
# memory, as in the wrong, step-to-step drifting grad norms of the compiled d12 runs (H100, torch 2.11).
INDUCTOR_OPTIONS = {"triton.mix_order_reduction": False}

# -----------------------------------------------------------------------------
# Main

@stops_on_signals
def main(argv, signals):
    cfg, explicit = parse_args(argv)
    dtype = default_dtype(cfg, gpu=torch.cuda.is_available())  # the device setup_device picks
    rank, world, device, store = setup_device(cfg)
    master = signals.master = rank == 0
    say = print if master else (lambda *args, **kwargs: None)

    # weights and optimizer state: a checkpoint, an llm.c model file, or GPT-2 init from the seed
    step, loader_state, m, v = 0, (0, 0), None, None
    if cfg.resume:
        header, params, m, v, saved = load_checkpoint(cfg.resume, cfg)
        apply_model_header(cfg, header, explicit)
        check_resumed_seed(explicit, saved["seed"])
        cfg.seed, step, loader_state = saved["seed"], saved["step"], (saved["shard"], saved["position"])
    elif cfg.init_from:
        header, params = read_weights(cfg.init_from, cfg)
        apply_model_header(cfg, header, explicit)
    else:
        params = init_params_numpy(cfg)
    if m is None:  # v: AdamW's second moments, of every tensor but Muon's matrices
        muon = RECIPES[cfg.recipe].muon_names(param_shapes(cfg))
        m = {k: np.zeros_like(p) for k, p in params.items()}
        v = {k: np.zeros_like(p) for k, p in params.items() if k not in muon}
    if cfg.eval_only and not (cfg.resume or cfg.init_from):
        die("--eval-only needs weights: give --init-from or --resume")

    # data: each process reads its own B rows of every micro-batch, as llm.c's per-rank loaders do
    grad_accum = grad_accum_steps(cfg, world)
    B, T = cfg.batch_size, cfg.seq_len
    train_files, val_files = find_shards(cfg)
    train_loader = None if cfg.eval_only else DataLoader(train_files, B, T, rank, world, seed=cfg.seed)
    val_loader = DataLoader(val_files, B, T, rank, world) if val_files else None
    check_val_tokens(cfg, val_loader)
    if train_loader is not None:
        n_shards = len(train_files) if train_files else 1
        shard, position = loader_state
        if shard >= n_shards:
            die(f"--resume: the checkpoint is at train shard {shard}, but --data has {n_shards} shards")
        train_loader.set_state(shard, position)
        if position + world * B * T + 1 > len(train_loader.tokens):
            die(f"--resume: the checkpoint's position {position} is past the end of train shard {shard}")
    if val_loader is None and (cfg.eval_only or cfg.val_every > 0):
        say(f"no validation shards in --data {cfg.data} (give --val-data GLOB): val loss skipped")
    encoder = hellaswag.gpt2_encoding() if cfg.sample_every > 0 and not cfg.eval_only else None
    lock = prepare_out_dir(cfg, master, step)  # noqa: F841  held for the run's life: main's return frees it

    # devices: what each process holds depends on --zero-stage (make_state)
    state = make_state(params, m, v, cfg, device, rank, world)
    weights = state["weights"]  # what evaluation and sampling compute with
    # the table that only gathers rows (GPT-2's wte is also its head) counts for no flops
    recipe = RECIPES[cfg.recipe]
    model, table = recipe.model_name, recipe.table
    n_params = sum(p.numel() for k, p in weights.items() if k != table)
    device_kind = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    say(f"{model} L{cfg.n_layer} H{cfg.n_head} C{cfg.n_embd}, {n_params / 1e6:.2f}M parameters (without "
        f"{table}) | {world} x {device_kind} | {dtype} | compile: {'on' if cfg.compile else 'off'}")
    say(f"batch: {cfg.batch_size} x {T} tokens x {world} devices x {grad_accum} micro-batches = "
        f"{cfg.total_batch_size} tokens per step | data: {cfg.data}")
    held, activations = device_state_bytes(cfg, param_shapes(cfg), world), activation_bytes(cfg)
    say(format_memory(cfg, held, activations, world))
    warning = device.type == "cpu" and memory_warning(held, activations, world, host_memory_available())
    if warning:  # on a GPU, running out is an error the trainer reports (out_of_memory_is_an_error)
        say(warning)
    if master:
        log_event(cfg.out_dir, **start_event(cfg, step, world, held, activations))

    with out_of_memory_is_an_error(cfg), a_lost_process_is_an_error(store, rank, world):
        def compile_(fn, **kwargs):
            return torch.compile(fn, options=INDUCTOR_OPTIONS, **kwargs) if cfg.compile else fn

        row_losses = compile_(recipe.token_losses, dynamic=False)

        def run_evals(step, val, swag):
            if val and val_loader is not None:
                val_loss = evaluate_val(row_losses, weights, val_loader, cfg, device, world)
                say(f"step {step:5d} | val loss {val_loss:.6f}")
                if master:
                    log_event(cfg.out_dir, step=step, val_loss=val_loss)
            if swag and master:
                acc, acc_norm = evaluate_hellaswag(row_losses, weights, cfg, device)
                say(f"step {step:5d} | hellaswag acc {acc:.4f} acc_norm {acc_norm:.4f}")
                log_event(cfg.out_dir, step=step, hellaswag_acc=acc, hellaswag_acc_norm=acc_norm)

        if cfg.eval_only:
            run_evals(step, True, True)
            return
        # the checkpoint is written before the step's evaluations: a run killed between the two resumes
        # by running the ones log.jsonl lacks (also where nothing is left to train). Process 0's log
        # decides for all: the others may not see it, and all must run the same evaluations.
        if cfg.resume:
            logged = logged_evals(cfg.out_dir, step) if master else set()
            missing = [due(cfg.val_every, step, cfg.steps) and "val_loss" not in logged,
                       due(cfg.hellaswag_every, step, cfg.steps) and "hellaswag_acc" not in logged]
            if world > 1:
                dist.broadcast_object_list(missing, src=0)
            run_evals(step, *missing)
        if step >= cfg.steps:
            say(f"the checkpoint is at step {step} and --steps is {cfg.steps}: nothing to train")
            return

        # compiled on the first call, that is inside step 1: its time is reported as compile time
        grad_fn = compile_(grads_and_loss, fullgraph=True)
        update_fn = compile_(recipe.update, fullgraph=True)

        flops_per_token = model_flops_per_token(cfg, n_params)
        peak = peak_flops(device_kind, cfg.dtype) if device.type == "cuda" else None
        first = step + 1
        profile_steps = range(min(first + 1, cfg.steps), min(first + PROFILE_STEPS, cfg.steps) + 1)
        profile_dir = os.path.join(cfg.out_dir, "profile")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities) if cfg.profile else None
        times, spent = {}, 0.0  # spent: the summed step time, for --time-budget
        signals.training = True  # from here a signal stops the run at the end of a step
        for step in range(first, cfg.steps + 1):
            if cfg.profile and step == profile_steps[0]:
                profiler.start()
            t0 = time.perf_counter()
            x, y = step_batches(train_loader, grad_accum)                          # (A,B,T) each
            scalars = recipe.scalars(step, cfg, device)                            # (3,) or (6,)
            loss, norm = train_step(state, put_batch(x, device), put_batch(y, device), scalars, cfg,
                                    grad_fn, update_fn, world)
            loss, norm = loss.item(), norm.item()  # waits for the device: dt spans the whole step
            dt = time.perf_counter() - t0
            times[step] = dt
            spent += dt
            if not (math.isfinite(loss) and math.isfinite(norm)):  # the same values in every process
                stop_diverged(step, loss, norm, cfg)
            # --time-budget and signals: all processes must stop at the same step
            budget_spent, signum = bool(cfg.time_budget) and spent >= cfg.time_budget, signals.received
            if world > 1:
                budget_spent, signum = agree_to_stop(budget_spent, signum, rank, device)
            last = step if budget_spent or signum else cfg.steps
            if cfg.compile and step == first:
                say(f"compiled train step in {dt:.1f} s (compilation and step {step})")
            if cfg.profile and step == profile_steps[-1]:
                profiler.stop()
                os.makedirs(profile_dir, exist_ok=True)
                trace = os.path.join(profile_dir, f"trace_rank{rank}.json")
                profiler.export_chrome_trace(trace)
                ms = [1000 * times[s] for s in profile_steps]
                sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
                say(profiler.key_averages().table(sort_by=sort, row_limit=25))
                say(phase_table(profiler, len(profile_steps), device.type == "cuda", cfg.compile))
                say(f"profile: steps {profile_steps[0]}-{profile_steps[-1]} traced into {trace} "
                    f"(Perfetto or chrome://tracing) | step time mean {np.mean(ms):.1f} ms, min "
                    f"{min(ms):.1f} ms, max {max(ms):.1f} ms")
            tokens_per_s = cfg.total_batch_size / dt
            mfu = flops_per_token * tokens_per_s / (peak * world) if peak else None
            lr, mem = lr_at(step - 1, cfg), peak_memory_gb(device)
            say(format_step(step, cfg, loss, norm, lr, 1000 * dt, tokens_per_s, mfu, mem))
            if master:
                log_event(cfg.out_dir, step=step, train_loss=loss, grad_norm=norm, lr=lr, dt_ms=1000 * dt,
                          tokens_per_s=tokens_per_s, mfu=mfu, peak_mem_gb=mem)
            # the checkpoint first: an evaluation that fails (a HellaSwag download, say) loses nothing
            if due(cfg.ckpt_every, step, last):
                full = gather_state(state, cfg, world)  # every process: a collective at stage 1
                if master:
                    path = save_checkpoint(cfg.out_dir, step, *map(to_numpy, full), train_loader.state(), cfg)
                    say(f"saved {path}")
                if world > 1:  # the others wait while rank 0 writes
                    dist.barrier()
            if signum:  # the step's evaluations are left to --resume, which runs those log.jsonl lacks
                stopped_by_signal(signum, step, cfg, master)
            run_evals(step, due(cfg.val_every, step, last), due(cfg.hellaswag_every, step, last))
            if master and due(cfg.sample_every, step, last):
                seed = int(np.random.SeedSequence([cfg.seed, step]).generate_state(1)[0])
                generator = torch.Generator(device=device).manual_seed(seed)
                for i, row in enumerate(generate(weights, generator, cfg).tolist()):
                    text = encoder.decode(row[1:])
                    say(f"sample {i}: {text!r}")
            if budget_spent:
                say(f"--time-budget {cfg.time_budget:g} s reached: stopped after step {step} of {cfg.steps}")
                break

    # the mean leaves out the first step (compilation, one-off start-up costs) and the profiled ones
    kept = [s for s in times if s > first and not (cfg.profile and s in profile_steps)]
    note = " after the first" + (", not profiled" if cfg.profile else "")
    if not kept:
        kept, note = list(times), ""
    dt = float(np.mean([times[s] for s in kept]))
    tokens_per_s = cfg.total_batch_size / dt
    mfu = flops_per_token * tokens_per_s / (peak * world) if peak else None
    say(f"mean over {len(kept)} step(s){note}: "
        f"{1000 * dt:.1f} ms, {tokens_per_s:,.0f} tok/s, "
        f"mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}")


if __name__ == "__main__":
    main()
