"""train_gpt2_jax.py: GPT-2 in plain JAX (jax.numpy, jax.grad, jax.jit; no flax, no optax).

The model is a pure function of a dict of arrays (llm.c's names, per-layer weights stacked along L), and
a whole optimizer step (every micro-batch's forward and backward, clipping, AdamW) is one jitted function
whose buffers are donated. With several devices it trains data parallel over a Mesh (--zero-stage 1 or
3), on one host or several (jax.distributed). Formats, flags and logs: docs/FORMATS.md.

    python train_gpt2_jax.py --data data/fineweb_edu                         # GPT-2 124M, llm.c recipe
    python train_gpt2_jax.py --recipe speedrun --data data/fineweb_edu       # the speedrun baseline
    python train_gpt2_jax.py --init-from gpt2_124M.bin --eval-only --data data/fineweb_edu
    python train_gpt2_jax.py --zero-stage 3 --coordinator host0:1234 --num-processes 2 --process-id 0

Map: the file's sections, in order (delete `Recipe: speedrun` and GPT-2 trains as before).
    GPT-2: config                          vocabulary, names, Config, Recipe, flags, shapes, init, model files
    GPT-2: model                           the forward and its loss
    GPT-2: AdamW and the lr schedule       AdamW, llm.c's cosine schedule
    GPT-2: training step                   the jitted step, GPT-2's row of RECIPES
    Recipe: speedrun                       modded-nanogpt's baseline: config, model, Muon, model files, its row
    JAX plumbing: devices, processes, ZeRO state and evaluation   shardings, HellaSwag, samples, processes
    Shared plumbing: flags, shards, checkpoints, out dir, logs, signals   the same in every trainer
    Main                                   the run, top to bottom
"""

import argparse
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
from functools import partial
from tokenize import TokenError
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
from jax._src import distributed as jax_distributed
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

FRAMEWORK = "jax"  # "torchfunc" | "triton-<backend>" in the siblings

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
    # JAX only
    attn: str = "auto"
    scan_layers: bool = False
    coordinator: str = ""    # several processes: host:port of process 0 (else JAX_COORDINATOR_ADDRESS)
    num_processes: int = 0   # 0: from the environment (JAX_NUM_PROCESSES, srun, mpirun), else 1
    process_id: int = -1     # -1: from the environment (JAX_PROCESS_ID, srun, mpirun)
    coordinator_timeout: int = 300  # seconds the processes wait for each other to join, then stop

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
    # JAX's own
    token_losses: Callable  # (params, x, y, cfg, train) -> per-token losses (B,T) fp32; train: the step's
    summed: bool            # the step's gradient is of the summed token losses (else of their mean)
    scalars: Callable       # (step, cfg) -> the update's host-computed scalars (n,) fp32
    update: Callable        # (params, grads, m, v, scalars, cfg, layout) -> new (params, m, v)
    embeddings: tuple       # tables kept fp32 (gathered from): no compute-dtype copies
    next_logits: Callable   # (params, tokens (S,T), t, cfg) -> the logits (S,V) of position t's next token
    scan_layers: bool       # whether --scan-layers applies (its layers stacked along an L axis)


ZERO_STAGES = (0, 1, 3)


def framework_flags(p):
    """The flags of this trainer alone; parse_args adds the shared ones."""
    p.add_argument("--attn", choices=["auto", "cudnn", "xla"], help="attention kernel; auto: cuDNN's flash "
                   "attention on an NVIDIA GPU in bf16, else XLA's (default auto)")
    p.add_argument("--scan-layers", action="store_true",
                   help="run the layers as one lax.scan: compile time independent of depth (gpt2 recipe)")
    p.add_argument("--coordinator", help="several processes: HOST:PORT of process 0, an IPv6 host in [brackets] "
                   "(default: $JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, help="processes in the run (default: $JAX_NUM_PROCESSES, or what "
                   "srun/mpirun set, else 1)")
    p.add_argument("--process-id", type=int, help="this process's rank, 0 .. processes-1 (default: $JAX_PROCESS_ID, "
                   "or srun/mpirun's)")
    p.add_argument("--coordinator-timeout", type=int, help="several processes: seconds each waits for all "
                   f"to join at the coordinator before it stops (default {Config.coordinator_timeout})")


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

# LayerNorm, GELU and the cross-entropy have hand-written backwards (custom_vjp) that keep what llm.c
# keeps (the compute-dtype inputs, fp32 mean/rstd/logsumexp), not autodiff's fp32 temporaries.

GELU_SCALE = math.sqrt(2.0 / math.pi)


def compute_dtype(cfg):
    return jnp.bfloat16 if cfg.dtype == "bf16" else jnp.float32


@jax.custom_vjp
def layernorm(x, w, b):
    """LayerNorm over the last axis (eps 1e-5), statistics in fp32 whatever x's dtype."""
    return _layernorm_fwd(x, w, b)[0]


def _layernorm_fwd(x, w, b):
    xf = x.astype(jnp.float32)                                                     # (..., C)
    # both statistics in one read of x; the shift by the row's first element keeps E[d^2] - E[d]^2 exact
    d = xf - xf[..., :1]                                                           # (..., C)
    d_mean = jnp.mean(d, axis=-1, keepdims=True)                                   # (..., 1)
    var = jnp.maximum(jnp.mean(jnp.square(d), axis=-1, keepdims=True) - jnp.square(d_mean), 0.0)  # (..., 1)
    # the barrier keeps mean and rstd for the backward: recomputed there, dy * xhat goes out to memory in fp32
    mean, rstd = jax.lax.optimization_barrier(
        (xf[..., :1] + d_mean, jax.lax.rsqrt(var + 1e-5)))                         # (..., 1) each
    y = (xf - mean) * rstd * w.astype(jnp.float32) + b.astype(jnp.float32)         # (..., C)
    return y.astype(x.dtype), (x, w, mean, rstd)


def _layernorm_bwd(res, dy):
    x, w, mean, rstd = res
    xhat = (x.astype(jnp.float32) - mean) * rstd                                   # (..., C)
    dy = dy.astype(jnp.float32)                                                    # (..., C)
    wdy = dy * w.astype(jnp.float32)                                               # (..., C)
    dx = rstd * (wdy - jnp.mean(wdy, axis=-1, keepdims=True)
                 - xhat * jnp.mean(wdy * xhat, axis=-1, keepdims=True))            # (..., C)
    rows = tuple(range(x.ndim - 1))
    dw = jnp.sum(dy * xhat, axis=rows)                                             # (C,)
    db = jnp.sum(dy, axis=rows)                                                    # (C,)
    return dx.astype(x.dtype), dw.astype(w.dtype), db.astype(w.dtype)


layernorm.defvjp(_layernorm_fwd, _layernorm_bwd)


@jax.custom_vjp
def gelu(h):
    """GPT-2's tanh-approximate GELU in h's dtype."""
    # in the exact form XLA's GPU matmul rewriter fuses into c_fc's matmul as cuBLASLt's GELU epilogue
    return h * (0.5 * (1.0 + jnp.tanh(GELU_SCALE * (h + 0.044715 * (h * (h * h))))))  # (..., 4C)


def _gelu_bwd(h, dy):
    # the barrier stops XLA sharing the forward's tanh (an fp32 (N,4C) write and read): rerunning it moves less
    hf = jax.lax.optimization_barrier(h).astype(jnp.float32)                       # (..., 4C)
    t = jnp.tanh(GELU_SCALE * (hf + 0.044715 * hf * hf * hf))                      # (..., 4C)
    slope = 0.5 * (1.0 + t) + 0.5 * hf * (1.0 - t * t) * GELU_SCALE * (1.0 + 3 * 0.044715 * hf * hf)
    return ((dy.astype(jnp.float32) * slope).astype(h.dtype),)


gelu.defvjp(lambda h: (gelu(h), h), _gelu_bwd)  # the backward reruns from h


@jax.custom_vjp
def cross_entropy(logits, targets):
    """Per-token fp32 loss (...,) of logits (..., Vp) over the first V columns; llm.c's fused backward."""
    return _cross_entropy_fwd(logits, targets)[0]


def _cross_entropy_fwd(logits, targets):
    # the fp32 logsumexp of the first V columns in one read of the logits: an online softmax as a variadic
    # reduction, whose partials (running max, sum of exp(x - max)) merge with one exp
    def combine(a, b):
        (ma, sa), (mb, sb) = a, b
        e = jnp.exp(-jnp.abs(ma - mb))  # exp(smaller max - larger max)
        return jnp.maximum(ma, mb), jnp.where(ma >= mb, sa + sb * e, sa * e + sb)
    xf = logits[..., :VOCAB_SIZE].astype(jnp.float32)                              # (..., V)
    lowest = jnp.finfo(jnp.float32).min  # finite, so merging two empty partials gives no inf - inf
    m, s = jax.lax.reduce((xf, jnp.ones_like(xf)), (jnp.float32(lowest), jnp.float32(0.0)),
                          combine, (xf.ndim - 1,))                                 # (...,) each
    lse = m + jnp.log(s)                                                           # (...,)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # (...,)
    return lse - target_logit.astype(jnp.float32), (logits, targets, lse)


def _cross_entropy_bwd(res, g):
    logits, targets, lse = res
    col = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)      # (..., Vp)
    probs = jnp.exp(logits.astype(jnp.float32) - lse[..., None])                  # (..., Vp)
    dlogits = (probs - (col == targets[..., None])) * g[..., None]                 # (..., Vp)
    return jnp.where(col < VOCAB_SIZE, dlogits, 0.0).astype(logits.dtype), None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def linear(x, w, b):
    """x (..., in) @ w (out, in).T + b (out), named "matmul" for --recompute pointwise."""
    return checkpoint_name(x @ w.T + b, "matmul")                                  # (..., out)


def attention(q, k, v, cfg, scale=None):
    """Causal self-attention of q, k, v (B,T,H,D) -> (B,T,C): cuDNN's flash attention (--attn cudnn) or XLA's."""
    B, T, H, D = q.shape
    y = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                     implementation="cudnn" if cfg.attn == "cudnn" else "xla")  # (B,T,H,D)
    return checkpoint_name(y.reshape(B, T, H * D), "attention")                    # (B,T,C)


def block(x, lp, cfg):
    """One pre-LN transformer block; lp holds this layer's weights."""
    B, T, C = x.shape
    h = layernorm(x, lp["ln_1.w"], lp["ln_1.b"])                                  # (B,T,C)
    # three matmuls give three contiguous q, k, v (slicing one (B,T,3C) product copies); the barrier
    # stops XLA merging them back, which would add the biases in a pass of its own, not in cuBLAS's epilogue
    hs = jax.lax.optimization_barrier((h, h, h))                                   # 3 x (B,T,C)
    q, k, v = (linear(hs[i], lp["c_attn.w"][i * C:(i + 1) * C], lp["c_attn.b"][i * C:(i + 1) * C])
               .reshape(B, T, cfg.n_head, C // cfg.n_head) for i in range(3))      # (B,T,H,D) each
    x = x + linear(attention(q, k, v, cfg), lp["attn.c_proj.w"], lp["attn.c_proj.b"])  # (B,T,C)
    h = layernorm(x, lp["ln_2.w"], lp["ln_2.b"])                                  # (B,T,C)
    h = gelu(linear(h, lp["c_fc.w"], lp["c_fc.b"]))                               # (B,T,4C)
    return x + linear(h, lp["mlp.c_proj.w"], lp["mlp.c_proj.b"])                  # (B,T,C)


def recomputed(block_fn, cfg):
    """block_fn(x, weights) -> x, its backward keeping what cfg.recompute keeps."""
    if cfg.recompute == "none":
        return block_fn
    # the jax.checkpoint policy: pointwise keeps the matmuls' and the attention's outputs (the rest reruns in
    # the backward), block keeps only each block's input
    policy = {"pointwise": jax.checkpoint_policies.save_only_these_names("matmul", "attention"),
              "block": jax.checkpoint_policies.nothing_saveable}[cfg.recompute]
    checkpointed = jax.checkpoint(block_fn, policy=policy)
    layer = jax.custom_vjp(checkpointed)

    def layer_bwd(vjp, dy):
        # adding -0.0 * |dy[0]| makes the rerun wait for this block's dy: XLA's CPU pipeline drops
        # barriers and would run it in the forward, keeping everything (as none)
        after_dy = -0.0 * jnp.abs(dy.ravel()[0])                                  # ()
        return jax.tree.map(lambda r: r + after_dy.astype(r.dtype), vjp)(dy)

    layer.defvjp(lambda x, weights: jax.vjp(checkpointed, x, weights), layer_bwd)  # the vjp keeps what the policy keeps
    return layer


def transformer(params, idx, cfg):
    """Token ids idx (B,T) -> hidden states (B,T,C) after ln_f, in the compute dtype (fp32 masters cast here)."""
    dt = compute_dtype(cfg)
    # rows gathered from the fp32 tables (the scatter-add gradient sums in fp32); wpe by position too: a
    # broadcast (T,C) table has XLA's GPU layout store the residual stream batch-minor, transposed at each op
    pos = jnp.broadcast_to(jnp.arange(idx.shape[1]), idx.shape)                    # (B,T)
    x = (jnp.take(params["wte"], idx, axis=0) + jnp.take(params["wpe"], pos, axis=0)).astype(dt)  # (B,T,C)
    layers = {k: params[k].astype(dt) for k in LAYER_NAMES}                       # (L, ...) each
    layer = recomputed(lambda x, lp: block(x, lp, cfg), cfg)
    if cfg.scan_layers:  # one compiled block whatever the depth; activations pass through (L, ...) stacks
        x, _ = jax.lax.scan(lambda x, lp: (layer(x, lp), None), x, layers)       # (B,T,C)
    else:  # unrolled: XLA sees every layer's activations as plain buffers
        for l in range(cfg.n_layer):
            x = layer(x, {k: w[l] for k, w in layers.items()})                    # (B,T,C)
    return layernorm(x, params["ln_f.w"].astype(dt), params["ln_f.b"].astype(dt))  # (B,T,C)


def forward(params, idx, cfg):
    """Logits (B,T,Vp) of the lm head tied to wte; columns V..Vp-1 come from wte's padding rows."""
    h = transformer(params, idx, cfg)                                              # (B,T,C)
    return h @ params["wte"].astype(h.dtype).T                                     # (B,T,Vp)


def next_logits(params, tokens, t, cfg):
    """The logits (S,V) of the token after position t (traced) of tokens (S,T), for sampling."""
    h = jax.lax.dynamic_index_in_dim(transformer(params, tokens, cfg), t, axis=1, keepdims=False)  # (S,C)
    return (h @ params["wte"][:VOCAB_SIZE].astype(h.dtype).T).astype(jnp.float32)  # (S,V)


def token_losses(params, x, y, cfg, train=False):
    """Per-token fp32 cross-entropy (B,T) of targets y given inputs x (B,T) (train: the step's, the same)."""
    return cross_entropy(forward(params, x, cfg), y)                               # (B,T)


# -----------------------------------------------------------------------------
# GPT-2: AdamW and the lr schedule

ADAM_BETA1, ADAM_BETA2, ADAM_EPS = 0.9, 0.95, 1e-8


def adam_scalars(step, cfg):
    """[lr, 1 - beta1^t, 1 - beta2^t] for 1-based step t: host data to the compiled step (no recompiles)."""
    return np.array([cosine_lr(step - 1, cfg), 1.0 - ADAM_BETA1 ** step, 1.0 - ADAM_BETA2 ** step], dtype=np.float32)


def global_norm(grads):
    """torch's clip_grad_norm_ total norm: the L2 norm of the per-tensor L2 norms, in fp32."""
    norms = jnp.stack([jnp.sqrt(jnp.sum(jnp.square(g))) for g in grads.values()])  # (n,)
    return jnp.sqrt(jnp.sum(jnp.square(norms)))


def adamw_update(params, grads, m, v, scalars, cfg):
    """llm.c's AdamW on every tensor; weight decay only on DECAY_NAMES. Returns new (params, m, v)."""
    lr, bias1, bias2 = scalars[0], scalars[1], scalars[2]
    new_params, new_m, new_v = {}, {}, {}
    for k in PARAM_NAMES:
        g = grads[k]
        new_m[k] = ADAM_BETA1 * m[k] + (1.0 - ADAM_BETA1) * g
        new_v[k] = ADAM_BETA2 * v[k] + (1.0 - ADAM_BETA2) * g * g
        update = (new_m[k] / bias1) / (jnp.sqrt(new_v[k] / bias2) + ADAM_EPS)
        decay = cfg.weight_decay if k in DECAY_NAMES else 0.0
        new_params[k] = params[k] - lr * (update + decay * params[k])
    return new_params, new_m, new_v


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
    """One batch's fp32 loss: the recipe's mean token loss, or its sum (Recipe.summed)."""
    recipe = RECIPES[cfg.recipe]
    losses = recipe.token_losses(params, x, y, cfg, train=True)                    # (B,T)
    return jnp.sum(losses) if recipe.summed else jnp.mean(losses)


EMBEDDINGS = ("wte", "wpe")  # the model gathers rows from them in fp32: no compute-dtype copies


def train_step(params, m, v, copies, x, y, scalars, cfg, layout):
    """One optimizer step on micro-batches x, y (A,B,T) -> (params, m, v, copies, mean loss, unclipped grad norm)."""
    recipe = RECIPES[cfg.recipe]
    scale = 1.0 if recipe.summed else 1.0 / x.shape[0]  # the mean over the A micro-batches
    constrain = jax.lax.with_sharding_constraint
    # the compute-dtype weights, cast once per step (the embedding tables stay fp32); stage 3 gathers them
    # after the cast (the all-gather moves compute-dtype bytes), stage 1 has them from the last update
    dt = compute_dtype(cfg)
    weights = constrain({k: copies[k] if k in copies else p if k in recipe.embeddings else p.astype(dt)
                         for k, p in params.items()}, layout["weights"])

    def micro_step(acc, batch):
        loss, grads = jax.value_and_grad(lambda w: loss_fn(w, batch[0], batch[1], cfg) * scale)(weights)
        grads = constrain({k: g.astype(jnp.float32) for k, g in grads.items()}, layout["grads"])
        return {k: acc[k] + grads[k] for k in acc}, loss

    zeros = constrain({k: jnp.zeros_like(p) for k, p in params.items()}, layout["grads"])
    grads, losses = jax.lax.scan(micro_step, zeros, (x, y))                       # fp32 dict, (A,)
    norm = global_norm(grads)
    if cfg.grad_clip > 0:
        coef = jnp.minimum(cfg.grad_clip / (norm + 1e-6), 1.0)
        grads = {k: g * coef for k, g in grads.items()}
    # each device updates the slice of the masters its moments cover; out_shardings gathers them again
    params = constrain(params, layout["moments"])
    params, m, v = recipe.update(params, grads, m, v, scalars, cfg, layout)
    loss = jnp.sum(losses) / cfg.total_batch_size if recipe.summed else jnp.sum(losses)
    return params, m, v, cast_copies(params, copies, cfg), loss, norm


def attention_bytes(cfg, n_head):
    """Bytes one block's attention keeps beyond q, k, v and its output: XLA's (B,H,T,T) scores (cuDNN: none)."""
    if cfg.attn == "cudnn" or (cfg.attn == "auto" and cfg.dtype == "bf16"):
        return 0
    scores = cfg.batch_size * n_head * cfg.seq_len**2                               # B*H*T*T
    return scores * (1 + 4 + 4 + jnp.dtype(compute_dtype(cfg)).itemsize)  # mask, scores, exp, probabilities


def gpt2_activation_bytes(cfg):
    """Bytes of one micro-batch's saved activations per device at cfg.recompute, row statistics (<1%) left out."""
    N, C, d = cfg.batch_size * cfg.seq_len, cfg.n_embd, jnp.dtype(compute_dtype(cfg)).itemsize
    block = {  # per block, in (B,T,C) tensors: 4C wide counts 4
        # ln_1's input and output (the barrier's 3 are one), q, k, v, the attention's output, ln_2's input
        # and output; c_fc's and GELU's outputs (B,T,4C)
        "none": N * C * d * (2 + 3 + 1 + 2 + 2 * 4) + attention_bytes(cfg, cfg.n_head),
        # the block's input x, q, k, v, the attention's and attn.c_proj's outputs; c_fc's output (B,T,4C)
        "pointwise": N * C * d * (1 + 3 + 2 + 4),
        "block": N * C * d,  # the block's input x
    }[cfg.recompute]
    # ln_f's input and output (B,T,C); the logits (B,T,Vp), the cross-entropy's backward's input
    head = 2 * N * C * d + N * cfg.padded_vocab_size * d
    return cfg.n_layer * block + head


RECIPES = {"gpt2": Recipe(
    help="llm.c's GPT-2 and AdamW", defaults={}, configure=configure_gpt2,
    shapes=gpt2_shapes, init=init_gpt2_numpy, lr_at=cosine_lr, muon_names=lambda shapes: [],
    model_file="model.bin", file_kind="an llm.c model file (.bin)", read_file=read_model_file,
    is_file=lambda head: head[:4] == MODEL_MAGIC.to_bytes(4, "little"), write_file=write_model_file,
    model_name="GPT-2", table="wpe", optimizers="AdamW", activation_bytes=gpt2_activation_bytes,
    token_losses=token_losses, summed=False, scalars=adam_scalars,
    update=lambda params, grads, m, v, scalars, cfg, layout: adamw_update(params, grads, m, v, scalars, cfg),
    embeddings=EMBEDDINGS, next_logits=next_logits, scan_layers=True)}


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


# -- model

# The reference's GPT: weights by their state_dict names (cast here: evaluation hands in fp32 masters),
# RMSNorm with the compute dtype's machine epsilon (as F.rms_norm), fp32 rotary; plain autodiff.

def rms_norm(x, w, eps):
    """RMSNorm over the last axis with gain w (None: no gain), statistics in fp32, out in x's dtype."""
    xf = x.astype(jnp.float32)                                                     # (..., C)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)  # (..., C)
    return (y if w is None else y * w.astype(jnp.float32)).astype(x.dtype)         # (..., C)


def rotary(x):
    """The reference's half-truncated rotary embedding of q or k (B,T,H,D) in fp32: D/4 pairs turn, D/4 stay."""
    T, D = x.shape[1], x.shape[3]
    freq = (1 / 1024) ** jnp.linspace(0, 1, D // 4, dtype=jnp.float32)           # (D/4,)
    freq = jnp.concatenate([freq, jnp.zeros(D // 4, jnp.float32)])                 # (D/2,)
    theta = jnp.outer(jnp.arange(T, dtype=jnp.float32), freq)[None, :, None]       # (1,T,1,D/2)
    cos, sin = jnp.cos(theta), jnp.sin(theta)                                      # (1,T,1,D/2) each
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)                          # (B,T,H,D/2) each
    return jnp.concatenate((x1 * cos + x2 * sin, x2 * cos - x1 * sin), -1).astype(x.dtype)  # (B,T,H,D)


def speedrun_block(x, params, layer, cfg):
    """One pre-norm block of the speedrun model; params: its weights blocks.<layer>.*."""
    B, T, C = x.shape
    H, D = C // HEAD_DIM, HEAD_DIM
    dt = compute_dtype(cfg)
    eps = jnp.finfo(dt).eps
    w = {k.removeprefix(f"blocks.{layer}."): p.astype(dt) for k, p in params.items()}
    h = rms_norm(x, w["norm1.gains"], eps)                                         # (B,T,C)
    q, k, v = (linear(h, w[f"attn.{n}.weight"], w[f"attn.{n}.bias"]).reshape(B, T, H, D)
               for n in "qkv")                                                     # (B,T,H,D) each
    q, k = (rotary(rms_norm(t, None, eps)) for t in (q, k))                        # (B,T,H,D) each
    x = x + linear(attention(q, k, v, cfg, ATTN_SCALE), w["attn.proj.weight"], w["attn.proj.bias"])  # (B,T,C)
    h = rms_norm(x, w["norm2.gains"], eps)                                         # (B,T,C)
    h = jnp.square(jax.nn.relu(linear(h, w["mlp.fc.weight"], w["mlp.fc.bias"])))  # (B,T,4C)
    return x + linear(h, w["mlp.proj.weight"], w["mlp.proj.bias"])                # (B,T,C)


def speedrun_transformer(params, idx, cfg):
    """Token ids idx (B,T) -> hidden states (B,T,C) after the final RMSNorm, in the compute dtype."""
    dt = compute_dtype(cfg)
    eps = jnp.finfo(dt).eps
    x = jnp.take(params["embed.weight"], idx, axis=0).astype(dt)                  # (B,T,C)
    x = rms_norm(x, params["norm1.gains"], eps)                                    # (B,T,C)
    for layer in range(cfg.n_layer):  # each block sees its own weights: --recompute checkpoints it alone
        weights = {k: p for k, p in params.items() if k.startswith(f"blocks.{layer}.")}
        x = recomputed(partial(speedrun_block, layer=layer, cfg=cfg), cfg)(x, weights)  # (B,T,C)
    return rms_norm(x, params["norm2.gains"], eps)                                 # (B,T,C)


def fp8_quantize(x, kind):
    """--fp8-head's operand `kind` of x: x / scale in fp32, clamped to the format's finite range, cast (RNE)."""
    fmt = FP8_FORMATS[kind]
    q = x.astype(jnp.float32) * np.float32(fp8_reciprocal(kind))
    return jnp.clip(q, -FP8_MAX[fmt], FP8_MAX[fmt]).astype(f"float8_{fmt}")  # unclamped: NaN or inf past it


def fp8_dot(a, b, contract, scale, dtype):
    """(a . b over the axes `contract`) x scale in dtype, of float8 operands with fp32 accumulation."""
    # a CPU widens to fp32; on Hopper XLA should make it a cuBLASLt FP8 GEMM (not yet checked on a GPU)
    out = jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)
    return (out * np.float32(scale)).astype(dtype)


@jax.custom_vjp
def fp8_head_matmul(h, w):
    """z (N,V) = h (N,C) W^T in h's dtype, of FP8 operands; dz is e5m2 in the backward (docs/FORMATS.md)."""
    return fp8_head_forward(h, w)[0]


def fp8_head_forward(h, w):
    h_f8, w_f8 = fp8_quantize(h, "x"), fp8_quantize(w, "w")                       # (N,C), (V,C) e4m3fn
    z = fp8_dot(h_f8, w_f8, ((1,), (1,)), FP8_SCALES["x"] * FP8_SCALES["w"], h.dtype)  # (N,V)
    return z, (h_f8, w_f8, jnp.zeros((0,), w.dtype))  # the last, empty: W's dtype, its gradient's


def fp8_head_backward(saved, dz):
    h_f8, w_f8, w_dtype = saved
    g_f8 = fp8_quantize(dz, "grad")                                               # (N,V) e5m2
    dh = fp8_dot(g_f8, w_f8, ((1,), (0,)), FP8_SCALES["grad"] * FP8_SCALES["w"], dz.dtype)  # (N,C)
    dw = fp8_dot(g_f8, h_f8, ((0,), (0,)), FP8_SCALES["grad"] * FP8_SCALES["x"], jnp.float32)  # (V,C)
    return dh, dw.astype(w_dtype.dtype)


fp8_head_matmul.defvjp(fp8_head_forward, fp8_head_backward)


def speedrun_logits(h, weight, bias, fp8=False):
    """The head's fp32 logits (..., rows of W) z = h W^T + b soft-capped to 15 z / sqrt(z^2 + 15^2); fp8: FP8 h W^T."""
    if fp8:
        z = fp8_head_matmul(h.reshape(-1, h.shape[-1]), weight.astype(h.dtype))   # (N,V)
        z = (z.reshape(*h.shape[:-1], -1) + bias.astype(h.dtype)).astype(jnp.float32)  # (..., V)
    else:
        z = linear(h, weight.astype(h.dtype), bias.astype(h.dtype)).astype(jnp.float32)  # (..., V)
    return SOFTCAP * z * jax.lax.rsqrt(jnp.square(z) + SOFTCAP**2)                 # (..., V)


def speedrun_forward(params, idx, cfg, train=False):
    """Soft-capped fp32 logits (B,T,Vp) of the speedrun model; train: the step's (FP8 head with --fp8-head)."""
    h = speedrun_transformer(params, idx, cfg)                                     # (B,T,C)
    return speedrun_logits(h, params["proj.weight"], params["proj.bias"], fp8=train and cfg.fp8_head)  # (B,T,Vp)


def speedrun_next_logits(params, tokens, t, cfg):
    """The logits (S,V) of the token after position t (traced) of tokens (S,T), for sampling."""
    h = jax.lax.dynamic_index_in_dim(speedrun_transformer(params, tokens, cfg), t, axis=1, keepdims=False)  # (S,C)
    return speedrun_logits(h, params["proj.weight"][:VOCAB_SIZE], params["proj.bias"][:VOCAB_SIZE])  # (S,V)


def speedrun_token_losses(params, x, y, cfg, train=False):
    """Per-token fp32 cross-entropy (B,T), as the reference's over all Vp columns (train: the step's)."""
    logits = speedrun_forward(params, x, cfg, train)                               # (B,T,Vp)
    target_logit = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]      # (B,T)
    return jax.nn.logsumexp(logits, axis=-1) - target_logit                        # (B,T)


# -- optimizer

def speedrun_scalars(step, cfg):
    """[lr of each SPEEDRUN_LRS group, 1 - beta1^t, 1 - beta2^t] for 1-based step t (adam_scalars')."""
    return np.array([*speedrun_lrs(step - 1, cfg).values(), 1.0 - SPEEDRUN_BETA1 ** step,
                     1.0 - SPEEDRUN_BETA2 ** step], dtype=np.float32)


def newton_schulz(G, dtype):
    """The reference's orthogonalization of each matrix G (n,r,c) -> (n,r,c) in `dtype`."""
    # X = G/||G||_F, then X <- 2X + (-1.5 A + 0.5 A^2) X with A = X X^T, on tall matrices' transposes (A the smaller)
    tall = G.shape[-2] > G.shape[-1]
    X = G.astype(dtype).mT if tall else G.astype(dtype)                            # (n,r',c')
    norm = jnp.sqrt(jnp.sum(jnp.square(X.astype(jnp.float32)), axis=(-2, -1), keepdims=True))  # (n,1,1)
    X = X / (norm + 1e-7).astype(dtype)                                            # (n,r',c')

    def iteration(_, X):
        A = X @ X.mT                                                               # (n,r',r')
        return 2 * X + (-1.5 * A + 0.5 * (A @ A)) @ X                              # (n,r',c')
    X = jax.lax.fori_loop(0, NEWTON_SCHULZ_STEPS, iteration, X)  # (n,r',c'); a loop compiles one body
    return X.mT if tall else X                                                     # (n,r,c)


def speedrun_adamw(p, g, m, v, lr, bias1, bias2, weight_decay):
    """torch.optim.AdamW on one tensor with the speedrun recipe's betas and eps -> new (p, m, v)."""
    m = m + (1.0 - SPEEDRUN_BETA1) * (g - m)
    v = SPEEDRUN_BETA2 * v + (1.0 - SPEEDRUN_BETA2) * g * g
    update = (m / bias1) / (jnp.sqrt(v / bias2) + SPEEDRUN_EPS)
    return p * (1.0 - lr * weight_decay) - lr * update, m, v


def speedrun_muon(names, params, grads, m, lr, dtype, deal):
    """Muon on the same-shape matrices `names`, orthogonalized in `dtype`, dealt by `deal` -> (new params, new m)."""
    g = jnp.stack([grads[k] for k in names])                                       # (n,r,c)
    momentum = jnp.stack([m[k] for k in names])                                    # (n,r,c)
    momentum = momentum + (1.0 - MUON_MOMENTUM) * (g - momentum)                   # (n,r,c)
    # torch.lerp's form for a weight >= 0.5: end - (end - start) * (1 - weight)
    u = momentum - (1.0 - MUON_MOMENTUM) * (momentum - g)                          # (n,r,c)
    r, c = u.shape[1:]
    if deal is not None and len(names) % deal.mesh.size:
        deal = NamedSharding(deal.mesh, PartitionSpec())
    # pinned on both sides: XLA would otherwise split the iterations like the weights they update
    constrain = (lambda a: a) if deal is None else partial(jax.lax.with_sharding_constraint, shardings=deal)
    update = constrain(newton_schulz(constrain(u), dtype))                         # (n,r,c)
    update = update.astype(jnp.float32) * max(1.0, r / c) ** 0.5                   # (n,r,c)
    p = jnp.stack([params[k] for k in names]) * (1.0 - lr * MUON_WEIGHT_DECAY) - lr * update  # (n,r,c)
    return {k: p[i] for i, k in enumerate(names)}, {k: momentum[i] for i, k in enumerate(names)}


def speedrun_update(params, grads, m, v, scalars, cfg, layout):
    """AdamW on the tensors v holds, each group at its lr, Muon on the rest -> new (params, m, v)."""
    lr = {group: scalars[i] for i, group in enumerate(SPEEDRUN_LRS)}
    new_params, new_m, new_v = {}, {}, {}
    for k in v:
        new_params[k], new_m[k], new_v[k] = speedrun_adamw(params[k], grads[k], m[k], v[k],
                                                           lr[ADAMW_GROUPS.get(k, "vector")], scalars[4], scalars[5],
                                                           cfg.weight_decay)
    muon = [k for k in grads if k not in v]
    for shape in dict.fromkeys(params[k].shape for k in muon):
        p, momentum = speedrun_muon([k for k in muon if params[k].shape == shape], params, grads, m,
                                    lr["muon"], compute_dtype(cfg), layout["matrices"])
        new_params.update(p)
        new_m.update(momentum)
    return {k: new_params[k] for k in params}, {k: new_m[k] for k in m}, new_v


# -- training step

def speedrun_activation_bytes(cfg):
    """gpt2_activation_bytes' count for the speedrun model: autodiff's residuals at cfg.recompute."""
    N, C, d = cfg.batch_size * cfg.seq_len, cfg.n_embd, jnp.dtype(compute_dtype(cfg)).itemsize
    # an RMSNorm with gains keeps its input in fp32, 2x and the normalized x (fp32 each) and its output (B,T,C)
    norm = N * C * (3 * 4 + d)
    block = {  # per block
        # norm1 and norm2; q's and k's RMSNorms (the input in fp32 and 2x, (B,T,H,D) each); v, q and k after
        # the rotary (the attention's inputs) and the attention's output; ReLU^2: ReLU's mask (bool),
        # 2 ReLU(h) and the output (B,T,4C)
        "none": (2 * norm + 2 * N * C * 2 * 4 + 4 * N * C * d + attention_bytes(cfg, C // HEAD_DIM)
                 + N * 4 * C * (1 + 2 * d)),
        # the block's input x, q, k, v, the attention's and attn.proj's outputs (B,T,C); mlp.fc's output (B,T,4C)
        "pointwise": N * C * d * (1 + 3 + 2 + 4),
        "block": N * C * d,  # the block's input x (B,T,C)
    }[cfg.recompute]
    # the embedding's RMSNorm less its output (block 0's input), the final RMSNorm, and the logits before the
    # cap, its rsqrt and the softmax's exp (B,T,Vp) in fp32
    return cfg.n_layer * block + N * C * 3 * 4 + norm + 3 * N * cfg.padded_vocab_size * 4


RECIPES["speedrun"] = Recipe(
    help=SPEEDRUN_HELP,
    defaults={**SPEEDRUN_DEFAULTS, "out_dir": f"out/speedrun_{FRAMEWORK}"}, configure=configure_speedrun,
    shapes=speedrun_shapes, init=init_speedrun_numpy, lr_at=speedrun_lr, muon_names=muon_names,
    model_file="model.safetensors", file_kind="a safetensors file of the reference's state_dict (.safetensors)",
    is_file=lambda head: head[8:9] == b"{", read_file=read_speedrun_file, write_file=write_speedrun_file,
    model_name="speedrun GPT", table="embed.weight", optimizers="AdamW and Muon",
    activation_bytes=speedrun_activation_bytes,
    token_losses=speedrun_token_losses, summed=True, scalars=speedrun_scalars, update=speedrun_update,
    embeddings=("embed.weight",), next_logits=speedrun_next_logits, scan_layers=False)


# -----------------------------------------------------------------------------
# JAX plumbing: devices, processes, ZeRO state and evaluation

# ZeRO over the mesh's "data" axis as shardings only: XLA inserts the collectives (the gradients'
# reduce-scatter, the weights' all-gather).

def shard_axis(shape, world):
    """The first axis of `shape` that `world` divides, along which ZeRO splits it; None: it stays whole."""
    return next((i for i, n in enumerate(shape) if n % world == 0), None)


def zero_spec(shape, world):
    """PartitionSpec of a tensor split by ZeRO: "data" on its shard_axis, or replicated if it has none."""
    axis = shard_axis(shape, world)
    return PartitionSpec() if axis is None else PartitionSpec(*[None] * axis, "data")


def copied_names(cfg):
    """The tensors stage 1 keeps whole bf16 copies of across steps (all but the embeddings; none in fp32)."""
    kept = cfg.zero_stage == 1 and cfg.dtype != "fp32"
    return [k for k in param_shapes(cfg) if kept and k not in RECIPES[cfg.recipe].embeddings]


def cast_copies(params, names, cfg):
    """{name: params[name] in the compute dtype} for `names`: stage 1's copies."""
    return {k: params[k].astype(compute_dtype(cfg)) for k in names}


def state_layout(cfg, mesh):
    """{piece: {name: NamedSharding}} of "masters", "grads", "moments", "copies", "weights" (whole); "matrices"."""
    # "weights": a step's compute copies; "matrices": how Muon deals its stacks (None at stage 0)
    replicated = NamedSharding(mesh, PartitionSpec())
    split = {k: NamedSharding(mesh, zero_spec(s, mesh.size)) for k, s in param_shapes(cfg).items()}
    whole = {k: replicated for k in split}
    sharded = split if cfg.zero_stage >= 1 else whole  # grads at stage 1 too: a reduce-scatter moves half the bytes
    copied = copied_names(cfg)
    # Muon's matrices are dealt whole: split rows would have XLA sum partial products across devices
    return {"masters": {k: split[k] if cfg.zero_stage == 3 or k in copied else replicated for k in split},
            "grads": sharded, "moments": sharded, "copies": {k: replicated for k in copied}, "weights": whole,
            "matrices": NamedSharding(mesh, PartitionSpec("data")) if cfg.zero_stage >= 1 else None}


def gather_state(tree):
    """Whole host (numpy) copies of device arrays however they are split; a collective every process calls."""
    return multihost_utils.process_allgather(tree, tiled=True)


def counted_loss_sum(params, x, y, counted, cfg):
    """The sum of each row's mean token loss over the first `counted` rows of a global batch x, y (B,T)."""
    rows = RECIPES[cfg.recipe].token_losses(params, x, y, cfg).mean(-1)           # (B,)
    return jnp.where(jnp.arange(rows.shape[0]) < counted, rows, 0.0).sum()


def evaluate_val(loss_sum_jit, params, loader, cfg, put):
    """Mean token loss over the first cfg.val_tokens // T sequences of the val shards, at any device count."""
    loader.set_state(0, 0)
    total = 0.0
    for counted in val_batches(cfg, loader):
        x, y = loader.next_batch()                                                 # (B,T) each
        total += float(loss_sum_jit(params, put(x), put(y), counted))
    return total / (cfg.val_tokens // cfg.seq_len)


def evaluate_hellaswag(losses_jit, params, cfg):
    """(acc, acc_norm) through hellaswag.evaluate; every process runs it, process 0 alone reports."""
    def padded_losses(x, y):                                                       # (4, width) int64 each
        return np.asarray(losses_jit(params, x.astype(np.int32), y.astype(np.int32)))  # (4, width)
    hellaswag = hellaswag_module()
    return hellaswag.evaluate(hellaswag.in_context(padded_losses, cfg.block_size), limit=cfg.hellaswag_limit,
                              progress=jax.process_index() == 0)


def generate(params, key, cfg, prompt):
    """SAMPLE_COUNT top-k continuations of the tokens prompt (P,): token ids (S,T) int32, prompt first (no KV cache)."""
    T = min(cfg.block_size, len(prompt) + cfg.sample_tokens)
    tokens = jnp.zeros((SAMPLE_COUNT, T), jnp.int32).at[:, :len(prompt)].set(prompt)  # (S,T)

    def sample_next(t, carry):                                                     # token t+1 from 0..t
        tokens, key = carry
        logits = RECIPES[cfg.recipe].next_logits(params, tokens, t, cfg)          # (S,V)
        top_logits, top_ids = jax.lax.top_k(logits, min(cfg.top_k or VOCAB_SIZE, VOCAB_SIZE))  # (S,K) each
        key, sub = jax.random.split(key)
        choice = jax.random.categorical(sub, top_logits, axis=-1)                 # (S,)
        return tokens.at[:, t + 1].set(top_ids[jnp.arange(SAMPLE_COUNT), choice]), key

    tokens, _ = jax.lax.fori_loop(len(prompt) - 1, T - 1, sample_next, (tokens, key))
    return tokens


def say_samples(generate_jit, params, step, cfg, sampler, say):
    """Prints generate's rows after EOT (the prompt, then the model's tokens), drawn with (--seed, step)'s key."""
    key = jax.random.fold_in(jax.random.key(cfg.seed), step)
    for i, row in enumerate(np.asarray(generate_jit(params, key, prompt=jnp.array(sampler[1]))).tolist()):
        say(f"sample {i}: {sampler[0](row[1:])!r}")


def device_state_bytes(cfg, shapes, world):
    """{"params" (stage 1's copies), "grads", "masters", "moments"}: bytes one device holds, split as state_layout."""
    def held(shape, split, size=4):
        axis = shard_axis(shape, world) if split else None
        return size * math.prod(shape) // (world if axis is not None else 1)
    copied, muon = copied_names(cfg), set(RECIPES[cfg.recipe].muon_names(shapes))
    return {"params": sum(held(shapes[k], False, 2) for k in copied),
            "grads": sum(held(s, cfg.zero_stage >= 1) for s in shapes.values()),
            "masters": sum(held(s, cfg.zero_stage == 3 or k in copied) for k, s in shapes.items()),
            "moments": sum((1 if k in muon else 2) * held(s, cfg.zero_stage >= 1) for k, s in shapes.items())}


def peak_memory_gb(devices):
    """The largest peak of allocated bytes over the devices, in GB; None without statistics (the CPU)."""
    stats = [d.memory_stats() for d in devices]
    if any(s is None or "peak_bytes_in_use" not in s for s in stats):
        return None
    return max(s["peak_bytes_in_use"] for s in stats) / 1e9


def resolve_attention(cfg, platform):
    """--attn auto: cuDNN flash attention when it compiles here (an NVIDIA GPU, bf16), else XLA's."""
    if cfg.attn == "cudnn" and (platform != "gpu" or cfg.dtype != "bf16"):
        die("--attn cudnn needs an NVIDIA GPU and --dtype bf16 (cuDNN's fused attention has no fp32)")
    if cfg.attn != "auto" or platform != "gpu" or cfg.dtype != "bf16":
        return "xla" if cfg.attn == "auto" else cfg.attn
    q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    try:
        jax.jit(partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")).lower(q, q, q).compile()
    except Exception as e:  # noqa: BLE001  (any failure here means: not available, use XLA's)
        print(f"cuDNN attention unavailable ({str(e).splitlines()[0][:120]}); using XLA's")
        return "xla"
    return "cudnn"


@contextlib.contextmanager
def fail_on_out_of_memory(cfg):
    """Running out of device memory (at compile or run time): one line, no trace."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        cheaper = "" if cfg.recompute == "block" else " or a cheaper --recompute"
        die(f"out of device memory at --batch-size {cfg.batch_size} --recompute {cfg.recompute} (try a smaller "
            f"batch{cheaper}): {str(e).splitlines()[0][:200]}")


@contextlib.contextmanager
def fail_on_lost_peer():
    """A collective failed by a lost process: each survivor names it in one line and exits at once (not waiting)."""
    # jax.distributed's shutdown would wait ~90 s on the lost process, then abort; other errors pass through
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        rank, world = jax.process_index(), jax.process_count()
        if world == 1 or not any(s in str(e) for s in ("Gloo", "NCCL", "Connection", "UNAVAILABLE")):
            raise
        # a roll call in the coordinator's key-value store: who has not marked itself within 5 s (None: the
        # store is gone); process 0 stays a second longer, so the others read the marks
        client = jax_distributed.global_state.client
        try:
            client.key_value_set(f"census/{rank}", "alive")
            silent, deadline = list(range(world)), time.monotonic() + 5
            while silent and time.monotonic() < deadline:
                marked = {key.rsplit("/", 1)[-1] for key, _ in client.key_value_dir_get("census/")}
                silent = [r for r in range(world) if str(r) not in marked]
                time.sleep(0.1)
            if rank == 0:
                time.sleep(1)
        except jax.errors.JaxRuntimeError:
            silent = None
        if silent == []:
            raise
        who = ", ".join(map(str, silent)) if silent else "0 (its store is gone)"
        os.write(2, f"error: lost process {who} of {world}: it stopped or was killed, so process {rank} stops "
                    "too; `--resume auto` continues the run from its latest checkpoint\n".encode())
        os._exit(1)


def init_processes(cfg):
    """Joins a multi-host run's processes (jax.distributed) before anything touches a device."""
    # the coordinator, count and rank from the flags, else $JAX_*, else srun's or mpirun's environment
    def env_int(name, default):
        text = os.environ.get(name, "")
        try:
            return int(text) if text else default
        except ValueError:
            die(f"${name} is {text!r}, not an integer")

    def port_of(address, source):
        # jax takes a malformed address for a crash or a silent hang
        found = re.fullmatch(r"(\[[^][]+\]|[^][:]+):([^:]*)", address)
        if not found:
            die(f"{source} {address!r}: expected HOST:PORT (an IPv6 host in [brackets])")
        port = found[2]
        if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            die(f"{source} {address!r}: the port must be a number in 1-65535")
        return port

    if cfg.coordinator_timeout <= 0:
        die(f"--coordinator-timeout {cfg.coordinator_timeout}: must be a positive number of seconds")
    n = cfg.num_processes or env_int("JAX_NUM_PROCESSES", 0)
    count = "--num-processes" if cfg.num_processes else "$JAX_NUM_PROCESSES"
    launched = max(env_int("SLURM_NTASKS", 1), env_int("OMPI_COMM_WORLD_SIZE", 1))
    if n < 0 or cfg.process_id < -1:
        die(f"{count} must be >= 0 (0: from the environment) and --process-id >= 0, got {n} and {cfg.process_id}")
    if cfg.process_id >= 0 and n == 0:
        die(f"--process-id {cfg.process_id} needs --num-processes (or $JAX_NUM_PROCESSES), the count it is a rank of")
    if cfg.process_id >= n:
        die(f"--process-id {cfg.process_id} is out of range: {count} {n} needs it in [0, {n})")
    if n == 1 or (n == 0 and launched <= 1):
        return
    if n == 0:  # srun / mpirun: JAX finds the coordinator, count, rank and local devices itself
        if cfg.coordinator:
            port_of(cfg.coordinator, "--coordinator")
        coordinator, n, rank = cfg.coordinator or None, None, None
        waiting = (f"waiting up to {cfg.coordinator_timeout} s for the {launched} processes of this srun/mpirun "
                   "launch to join")
        check = ("check that all of them started, that their hosts reach process 0's (firewalls), and that none got "
                 "another --coordinator or --num-processes")
    else:
        coordinator = cfg.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
        rank = cfg.process_id if cfg.process_id >= 0 else env_int("JAX_PROCESS_ID", -1)
        if not coordinator:
            die(f"--num-processes {n} needs --coordinator HOST:PORT (or $JAX_COORDINATOR_ADDRESS)")
        source = "--coordinator" if cfg.coordinator else "$JAX_COORDINATOR_ADDRESS"
        port = port_of(coordinator, source)
        if not 0 <= rank < n:
            die(f"--num-processes {n} needs --process-id (or $JAX_PROCESS_ID) in [0, {n}), got {rank}")
        if rank == 0 and not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
            # on a port already taken jax often segfaults instead of raising: bind it here first (as gRPC does)
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(("", int(port)))
                except OSError as e:
                    die(f"{source} {coordinator}: process 0 cannot listen on port {port} here ({e.strerror}): "
                        "another run, or an earlier process 0 still running, may hold it; stop that or pick "
                        "another port")
        waiting = f"process {rank} of {n}: waiting up to {cfg.coordinator_timeout} s "
        if rank == 0:
            waiting += f"for processes 1 .. {n - 1} to join the coordinator it starts at {coordinator}"
            check = (f"check that processes 1 .. {n - 1} started with --coordinator {coordinator} and "
                     f"--num-processes {n}, each with its own --process-id, and that their hosts reach port "
                     f"{port} here (firewalls)")
        else:
            waiting += f"for the coordinator at {coordinator} (process 0 must start too)"
            check = (f"check that process 0 runs and listens at {coordinator} (that host, that port), that no "
                     f"firewall blocks port {port} between the hosts, and that every process got --num-processes {n}")
    print(waiting, flush=True)
    # jax's own deadline ends in a C++ abort that Python cannot catch: a timer thread ends the process first
    def give_up():
        os.write(2, f"error: the processes did not all join within {cfg.coordinator_timeout} s "
                    f"(--coordinator-timeout): {check}\n".encode())
        os._exit(1)
    timer = threading.Timer(cfg.coordinator_timeout, give_up)
    timer.start()
    # jax's preemption notifier would swallow SIGTERM: StopSignals' handler stops every process instead
    jax.config.update("jax_enable_preemption_service", False)
    try:
        jax.distributed.initialize(coordinator, n, rank, initialization_timeout=cfg.coordinator_timeout + 60)
    except jax.errors.JaxRuntimeError as e:  # e.g. process 0's port taken after its check
        die(f"joining the processes failed ({str(e).splitlines()[0][:200]}): {check}")
    finally:
        timer.cancel()


def place(tree, shardings):
    """Host arrays whole on every process -> global device arrays laid out as `shardings` (a matching tree)."""
    return jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, lambda index: a[index]), tree, shardings)


def put_rows(sharding, rows):
    """This process's rows (..., rows, T) -> the global batch (..., rows x processes, T) split over the mesh."""
    global_shape = rows.shape[:-2] + (rows.shape[-2] * jax.process_count(), rows.shape[-1])
    return jax.make_array_from_process_local_data(sharding, rows, global_shape)


def compile_train_step(cfg, layout, step_batch, replicated, state, grad_accum):
    """train_step jitted on `layout`'s shardings (the state donated), compiled ahead for `grad_accum` micro-batches."""
    v_shardings = {k: layout["moments"][k] for k in state[2]}
    state_shardings = (layout["masters"], layout["moments"], v_shardings, layout["copies"])
    step_jit = jax.jit(partial(train_step, cfg=cfg, layout=layout), donate_argnums=(0, 1, 2, 3),
                       in_shardings=state_shardings + (step_batch, step_batch, replicated),
                       out_shardings=state_shardings + (replicated, replicated))
    batch = (grad_accum, cfg.batch_size * step_batch.mesh.size, cfg.seq_len)
    batch_spec = jax.ShapeDtypeStruct(batch, jnp.int32, sharding=step_batch)      # (A,B,T)
    scalar_spec = jax.ShapeDtypeStruct(RECIPES[cfg.recipe].scalars(1, cfg).shape, jnp.float32, sharding=replicated)
    return step_jit.lower(*state, batch_spec, batch_spec, scalar_spec).compile()


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
# Main

@stops_on_signals
def main(argv, signals):
    cfg, explicit = parse_args(argv)
    recipe = RECIPES[cfg.recipe]
    if cfg.scan_layers and not recipe.scan_layers:
        die(f"--scan-layers: the {cfg.recipe} model's layers are separate tensors (no L axis) to scan over")
    init_processes(cfg)
    # devices in process order: each process holds the contiguous block of rows llm.c's rank `rank` reads
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    world, platform = len(devices), devices[0].platform
    dtype = default_dtype(cfg, gpu=platform != "cpu")
    rank, ranks = jax.process_index(), jax.process_count()
    master = signals.master = rank == 0  # the one process that prints, logs and writes checkpoints
    say = print if master else (lambda *args, **kwargs: None)

    log = partial(log_event, cfg.out_dir, FRAMEWORK) if master else (lambda **fields: None)
    cfg.attn = resolve_attention(cfg, platform)

    # the weights and optimizer state, the loaders (of this process's devices' rows), the out dir (locked)
    rows = cfg.batch_size * jax.local_device_count()
    any_failed = None if ranks == 1 else (  # True in every process when any passes True
        lambda failed: bool(multihost_utils.process_allgather(np.array(int(failed), np.int32)).max()))
    step, spent, params, m, v, grad_accum, train_loader, val_loader, sampler, lock = open_run(  # noqa: F841
        cfg, explicit, rows, rank, ranks, master, say, any_failed)
    generate_jit = jax.jit(partial(generate, cfg=cfg))
    if cfg.sample_only:  # the weights as read: no optimizer state on the devices
        return say_samples(generate_jit, params, step, cfg, sampler, say)

    mesh = Mesh(np.array(devices), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    layout = state_layout(cfg, mesh)
    step_batch = NamedSharding(mesh, PartitionSpec(None, "data"))                  # (A,B,T)
    eval_batch = NamedSharding(mesh, PartitionSpec("data"))                        # (B,T)
    params = place(params, layout["masters"])
    m, v = place(m, layout["moments"]), place(v, {k: layout["moments"][k] for k in v})
    copies = jax.jit(partial(cast_copies, names=list(layout["copies"]), cfg=cfg),
                     out_shardings=layout["copies"])(params)
    # the table that only gathers rows (GPT-2's wte is also its head) counts for no flops
    n_params = sum(p.size for k, p in params.items() if k != recipe.table)
    say(f"{recipe.model_name} L{cfg.n_layer} H{cfg.n_head} C{cfg.n_embd}, {n_params / 1e6:.2f}M parameters "
        f"(without {recipe.table}) | {world} x {devices[0].device_kind} in {ranks} process(es) | {dtype} | "
        f"attention: {cfg.attn}")
    say(f"batch: {cfg.batch_size} x {cfg.seq_len} tokens x {world} devices x {grad_accum} micro-batches = "
        f"{cfg.total_batch_size} tokens per step | data: {cfg.data}")
    held = device_state_bytes(cfg, param_shapes(cfg), world)
    activations = recipe.activation_bytes(cfg)
    say(format_memory(cfg, held, activations, world, recipe.optimizers))
    warning = jax.default_backend() == "cpu" and memory_warning(held, activations, world, host_memory_available())
    if warning:  # on a GPU, running out is an error the trainer reports (fail_on_out_of_memory)
        say(warning)
    log(event="start", step=step, devices=world, state_bytes=held, activation_bytes=activations,
        config=dict(vars(cfg)))  # log.jsonl's first event of each launch (docs/FORMATS.md)

    # fp32 means fp32: XLA would otherwise run fp32 matmuls on a GPU as TF32
    precision = jax.default_matmul_precision("highest") if cfg.dtype == "fp32" else contextlib.nullcontext()
    with precision, fail_on_out_of_memory(cfg), fail_on_lost_peer():
        val_loss_sum = jax.jit(partial(counted_loss_sum, cfg=cfg))
        row_losses = jax.jit(partial(recipe.token_losses, cfg=cfg))

        # every process runs every evaluation (their computations span all devices); one logs it
        def run_evals(params, step, val, swag):
            if val and val_loader is not None:
                val_loss = evaluate_val(val_loss_sum, params, val_loader, cfg, partial(put_rows, eval_batch))
                say(f"step {step:5d} | val loss {val_loss:.6f}")
                log(step=step, val_loss=val_loss)
            if swag:
                acc, acc_norm = evaluate_hellaswag(row_losses, params, cfg)
                say(f"step {step:5d} | hellaswag acc {acc:.4f} acc_norm {acc_norm:.4f}")
                log(step=step, hellaswag_acc=acc, hellaswag_acc_norm=acc_norm)

        if cfg.eval_only:
            run_evals(params, step, True, cfg.hellaswag_every > 0)
            return
        # a run killed between a checkpoint and its evaluations runs those log.jsonl lacks (process 0's decides)
        if cfg.resume:
            logged = logged_evals(cfg.out_dir, step) if master else set()
            missing = multihost_utils.broadcast_one_to_all(
                np.array([due(cfg.val_every, step, cfg.steps) and "val_loss" not in logged,
                          due(cfg.hellaswag_every, step, cfg.steps) and "hellaswag_acc" not in logged]))
            run_evals(params, step, bool(missing[0]), bool(missing[1]))
        if step >= cfg.steps:
            say(f"the checkpoint is at step {step} and --steps is {cfg.steps}: nothing to train")
            return
        if 0 < cfg.time_budget <= spent:  # the budget is the run's, as its steps are: earlier launches spent it
            say(f"the run's steps took {spent:.1f} s of --time-budget {cfg.time_budget:g} s: nothing to train")
            return

        t0 = time.perf_counter()
        compiled = compile_train_step(cfg, layout, step_batch, replicated, (params, m, v, copies), grad_accum)
        compile_s = time.perf_counter() - t0
        say(f"compiled train step in {compile_s:.1f} s (counted in the first step's time)")

        flops = step_flops(cfg, n_params, devices[0].device_kind if platform == "gpu" else "", world)
        absent = ([f"mfu (no peak FLOP/s known for {devices[0].device_kind})"] * (flops[1] is None)
                  + ["mem (no memory statistics)"] * (peak_memory_gb(jax.local_devices()) is None))
        if absent:
            say(f"step lines without {' and '.join(absent)}")
        first = step + 1
        profile_steps = range(min(first + 1, cfg.steps), min(first + PROFILE_STEPS, cfg.steps) + 1)
        profile_dir = os.path.join(cfg.out_dir, "profile")
        times = {}  # step -> seconds
        signals.training = True  # from here a signal stops the run at the end of a step
        for step in range(first, cfg.steps + 1):
            if cfg.profile and step == profile_steps[0]:
                jax.profiler.start_trace(profile_dir, create_perfetto_trace=True)
            with jax.profiler.StepTraceAnnotation("train_step", step_num=step):
                t0 = time.perf_counter()
                x, y = step_batches(train_loader, grad_accum)                      # (A,rows,T) each
                scalars = place(recipe.scalars(step, cfg), replicated)
                params, m, v, copies, loss, norm = compiled(params, m, v, copies, put_rows(step_batch, x),
                                                            put_rows(step_batch, y), scalars)
                loss, norm = float(loss), float(norm)  # waits for the device: dt spans the whole step
                # the ahead-of-time compile counts in the first step, as torch.compile's does in the torch trainers
                times[step] = dt = time.perf_counter() - t0 + (compile_s if step == first else 0.0)
                spent += dt  # the run's step time, its earlier launches' too: what --time-budget counts
            if not (math.isfinite(loss) and math.isfinite(norm)):  # the same in every process: stopped before the log
                latest = sorted(glob.glob(os.path.join(glob.escape(cfg.out_dir), "ckpt_*[0-9]")))
                kept = f"{latest[-1]} stays the latest checkpoint" if latest else "no checkpoint was written"
                die(f"step {step}: loss {loss}, grad norm {norm}: the run diverged (try a lower --lr or a "
                    f"--grad-clip); stopped before logging or saving this step, {kept}")
            # every process stops at the same step: process 0's clock decides, a signal to any stops all
            budget_spent, signum = bool(cfg.time_budget) and spent >= cfg.time_budget, signals.received
            if ranks > 1:
                flags = multihost_utils.process_allgather(np.array([budget_spent, signum], np.int32))
                budget_spent, signum = bool(flags[0, 0]), int(flags[:, 1].max())
            last = step if budget_spent or signum else cfg.steps
            if cfg.profile and step == profile_steps[-1]:
                jax.profiler.stop_trace()
                ms = [1000 * times[s] for s in profile_steps]
                say(f"profile: steps {profile_steps[0]}-{profile_steps[-1]} traced into {profile_dir} "
                    f"(Perfetto: the .trace.json.gz; TensorBoard: the .xplane.pb) | step time mean "
                    f"{np.mean(ms):.1f} ms, min {min(ms):.1f} ms, max {max(ms):.1f} ms")
            report_step(step, cfg, loss, norm, recipe.lr_at(step - 1, cfg), dt, peak_memory_gb(jax.local_devices()),
                        flops, FRAMEWORK, master, say)
            # the checkpoint before the evaluations (one that fails loses no training): all gather, one writes
            if due(cfg.ckpt_every, step, last):
                whole = gather_state((params, m, v))
                if master:
                    path = save_checkpoint(cfg.out_dir, step, *whole, train_loader.state(), cfg, spent)
                    say(f"saved {path}")
                multihost_utils.sync_global_devices(f"checkpoint {step}")
            stop_on_signal(signum, step, cfg, master)  # --resume runs the step's evaluations log.jsonl lacks
            run_evals(params, step, due(cfg.val_every, step, last), due(cfg.hellaswag_every, step, last))
            if sampler and due(cfg.sample_every, step, last):
                say_samples(generate_jit, params, step, cfg, sampler, say)
            if budget_spent:
                say(f"--time-budget {cfg.time_budget:g} s reached: stopped after step {step} of {cfg.steps}")
                break

    say(format_mean(times, first, profile_steps if cfg.profile else (), cfg, flops))


if __name__ == "__main__":
    # cuBLAS for every GPU matmul, as NVIDIA's JAX containers set: with Triton matmuls enabled the H100 added
    # the biases in passes of their own, not in cuBLASLt's epilogues. An XLA_FLAGS naming it is left alone.
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_triton_gemm" not in xla_flags:
        os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_gpu_enable_triton_gemm=false".strip()
    main()
