"""train_gpt2_jax.py: GPT-2 in plain JAX (jax.numpy, jax.grad, jax.jit; no flax, no optax).

The model is a pure function of a dict of arrays (llm.c's names, per-layer weights stacked along L), and
a whole optimizer step (every micro-batch's forward and backward, clipping, AdamW) is one jitted function
whose buffers are donated. With several devices it trains data parallel over a Mesh (--zero-stage 1 or
3), on one host or several (jax.distributed). Formats, flags and logs: docs/FORMATS.md.

    python train_gpt2_jax.py --data data/fineweb_edu                         # GPT-2 124M, llm.c recipe
    python train_gpt2_jax.py --recipe speedrun --data data/fineweb_edu       # the speedrun baseline
    python train_gpt2_jax.py --data synthetic --steps 20 --batch-size 32 \\
        --val-every 0 --hellaswag-every 0 --sample-every 0 --ckpt-every 0    # benchmark: tokens/s, MFU
    python train_gpt2_jax.py --init-from gpt2_124M.bin --eval-only --data data/fineweb_edu
    python train_gpt2_jax.py --data data/fineweb_edu --resume auto           # continue the newest ckpt
    python train_gpt2_jax.py --zero-stage 3 --coordinator host0:1234 --num-processes 2 --process-id 0

Map: the file's sections, in order. Delete `Recipe: speedrun` and GPT-2 trains as before.
    GPT-2: config                          Config, the Recipe row type, this trainer's own flags
    GPT-2: model                           shapes, init, the forward and its loss, llm.c's model file
    GPT-2: AdamW and the lr schedule       llm.c's cosine schedule, AdamW
    GPT-2: training step                   the jitted step, GPT-2's row of RECIPES
    Recipe: speedrun                       modded-nanogpt's baseline: model, Muon, model files, its row
    Flags and recipe lookups               parse_args, and what the rest of the file asks of a recipe
    Data                                   llm.c's token shards and the loader
    Checkpoints                            writing, finding and reading checkpoints
    Evaluation and logging                 validation batches, MFU, log.jsonl, the step line
    JAX plumbing: devices, processes, ZeRO state and evaluation   shardings, HellaSwag, samples, processes
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
from functools import partial
from tokenize import TokenError

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import distributed as jax_distributed
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import hellaswag

FRAMEWORK = "jax"  # "torchfunc" | "triton-<backend>" in the siblings

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
    # data parallel: 0 = every device holds all optimizer state, 1 = ZeRO-1 (AdamW state, masters sharded),
    # 3 = the weights and gradients sharded too
    zero_stage: int = 0
    # JAX only
    attn: str = "auto"
    scan_layers: bool = False
    coordinator: str = ""    # several processes: host:port of process 0 (else JAX_COORDINATOR_ADDRESS)
    num_processes: int = 0   # 0: from the environment (JAX_NUM_PROCESSES, srun, mpirun), else 1
    process_id: int = -1     # -1: from the environment (JAX_PROCESS_ID, srun, mpirun)
    coordinator_timeout: int = 300  # seconds the processes wait for each other to join, then stop


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
    # JAX's own
    token_losses: Callable  # (params, x, y, cfg) -> per-token losses (B,T) fp32
    summed: bool            # the step's gradient is of the summed token losses (else of their mean)
    scalars: Callable       # (step, cfg) -> the update's host-computed scalars (n,) fp32
    update: Callable        # (params, grads, m, v, scalars, cfg, layout) -> new (params, m, v)
    embeddings: tuple       # tables kept fp32 (gathered from): no compute-dtype copies
    next_logits: Callable   # (params, tokens (S,T), t, cfg) -> the logits (S,V) of position t's next token
    scan_layers: bool       # whether --scan-layers applies (its layers stacked along an L axis)


ZERO_STAGES = (0, 1, 3)
# --recompute: none keeps what the backward reads; pointwise recomputes the norms' outputs and the MLP's
# activation from the kept matmul and attention outputs; block keeps each block's input alone and reruns
# the block's forward in the backward (docs/FORMATS.md)
RECOMPUTE_LEVELS = ("none", "pointwise", "block")


def framework_flags(p):
    """The flags of this trainer alone; parse_args adds the shared ones."""
    p.add_argument("--attn", choices=["auto", "cudnn", "xla"], help="attention kernel; auto: cuDNN's flash "
                   "attention on an NVIDIA GPU in bf16, else XLA's (default auto)")
    p.add_argument("--scan-layers", action="store_true",
                   help="run the layers as one lax.scan: compile time independent of depth (gpt2 recipe)")
    p.add_argument("--coordinator",
                   help="several processes: HOST:PORT of process 0, an IPv6 host in [brackets] (default: "
                   "$JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int,
                   help="processes in the run (default: $JAX_NUM_PROCESSES, or what srun/mpirun set, else 1)")
    p.add_argument("--process-id", type=int,
                   help="this process's rank, 0 .. processes-1 (default: $JAX_PROCESS_ID, or srun/mpirun's)")
    p.add_argument("--coordinator-timeout", type=int, help="several processes: seconds each waits for all "
                   f"to join at the coordinator before it stops (default {Config.coordinator_timeout})")

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


# The model is a pure function of the parameter dict. LayerNorm, GELU and the cross-entropy have
# hand-written backward passes (custom_vjp) so that the backward keeps what llm.c keeps (the
# compute-dtype inputs plus fp32 mean/rstd/logsumexp) rather than autodiff's fp32 temporaries.

LAYER_NAMES = PARAM_NAMES[2:-2]  # the per-layer tensors, stacked along a leading L axis
GELU_SCALE = math.sqrt(2.0 / math.pi)


def compute_dtype(cfg):
    return jnp.bfloat16 if cfg.dtype == "bf16" else jnp.float32


@jax.custom_vjp
def layernorm(x, w, b):
    """LayerNorm over the last axis (eps 1e-5), statistics in fp32 whatever x's dtype."""
    return _layernorm_fwd(x, w, b)[0]


def _layernorm_fwd(x, w, b):
    xf = x.astype(jnp.float32)                                                     # (..., C)
    # both statistics from one read of x: sums of d and d^2 for d = x - (the row's first element), a
    # shift that keeps E[d^2] - E[d]^2 free of cancellation however far the row sits from zero
    d = xf - xf[..., :1]                                                           # (..., C)
    d_mean = jnp.mean(d, axis=-1, keepdims=True)                                   # (..., 1)
    var = jnp.maximum(jnp.mean(jnp.square(d), axis=-1, keepdims=True) - jnp.square(d_mean), 0.0)  # (..., 1)
    # the barrier makes XLA keep mean and rstd for the backward instead of recomputing them there,
    # which would have it write dy * xhat out in fp32 for the dw reduction to read back
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


def _gelu_tanh(hf):
    return jnp.tanh(GELU_SCALE * (hf + 0.044715 * hf * hf * hf))


@jax.custom_vjp
def gelu(h):
    """GPT-2's tanh-approximate GELU. Written in h's own dtype and in exactly the form XLA's GPU matmul
    rewriter recognizes, so that on a GPU it runs inside the c_fc matmul as cuBLASLt's GELU epilogue
    (computed in fp32 there, pre-activation kept as a second output for the backward) instead of as a
    separate pass over the (N,4C) activations. Elsewhere XLA evaluates it in fp32 (excess precision);
    in bf16 its constants are then bf16-rounded (sqrt(2/pi) 0.13% low)."""
    return h * (0.5 * (1.0 + jnp.tanh(GELU_SCALE * (h + 0.044715 * (h * (h * h))))))  # (..., 4C)


def _gelu_fwd(h):
    return gelu(h), h


def _gelu_bwd(h, dy):
    # the barrier keeps XLA from sharing tanh with the forward, which it would do by writing that fp32
    # (N,4C) tensor out in the forward and reading it back here: recomputing from bf16 h moves less
    hf = jax.lax.optimization_barrier(h).astype(jnp.float32)                       # (..., 4C)
    t = _gelu_tanh(hf)                                                             # (..., 4C)
    slope = 0.5 * (1.0 + t) + 0.5 * hf * (1.0 - t * t) * GELU_SCALE * (1.0 + 3 * 0.044715 * hf * hf)
    return ((dy.astype(jnp.float32) * slope).astype(h.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


def _lse_combine(a, b):
    """Merges two partial logsumexps held as (running max, sum of exp(x - max)): one exp per merge."""
    (ma, sa), (mb, sb) = a, b
    e = jnp.exp(-jnp.abs(ma - mb))  # exp(smaller max - larger max)
    return jnp.maximum(ma, mb), jnp.where(ma >= mb, sa + sb * e, sa * e + sb)


def logsumexp_one_pass(x):
    """fp32 logsumexp over the last axis in ONE read of x (an online softmax as a variadic reduction),
    where max-then-sum would read the (N, V) logits twice."""
    xf = x.astype(jnp.float32)                                                     # (..., V)
    lowest = jnp.finfo(jnp.float32).min  # finite, so merging two empty partials gives no inf - inf
    m, s = jax.lax.reduce((xf, jnp.ones_like(xf)), (jnp.float32(lowest), jnp.float32(0.0)),
                          _lse_combine, (x.ndim - 1,))                             # (...,) each
    return m + jnp.log(s)                                                          # (...,)


@jax.custom_vjp
def cross_entropy(logits, targets):
    """Per-token loss (...,) in fp32 of logits (..., Vp) over the first V columns only. The backward is
    llm.c's fused classifier: dlogits = g * (softmax - onehot), written once in the logits' dtype."""
    return _cross_entropy_fwd(logits, targets)[0]


def _cross_entropy_fwd(logits, targets):
    lse = logsumexp_one_pass(logits[..., :VOCAB_SIZE])                             # (...,)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # (...,)
    return lse - target_logit.astype(jnp.float32), (logits, targets, lse)


def _cross_entropy_bwd(res, g):
    logits, targets, lse = res
    col = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)      # (..., Vp)
    probs = jnp.exp(logits.astype(jnp.float32) - lse[..., None])                  # (..., Vp)
    dlogits = (probs - (col == targets[..., None])) * g[..., None]                 # (..., Vp)
    # the padded columns get no gradient (their probability is zero: they are outside the softmax)
    return jnp.where(col < VOCAB_SIZE, dlogits, 0.0).astype(logits.dtype), None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def linear(x, w, b):
    """x (..., in) @ w (out, in).T + b (out): llm.c's / torch's Linear layout; the output is named
    "matmul" for --recompute pointwise (RECOMPUTE_POLICIES)."""
    return checkpoint_name(x @ w.T + b, "matmul")                                  # (..., out)


def attention(q, k, v, cfg):
    """Causal self-attention of q, k, v (B,T,C) -> (B,T,C); heads are D-wide slices of C. cuDNN's fused
    flash attention on an NVIDIA GPU (--attn cudnn), else XLA's (fp32 softmax either way)."""
    B, T, C = q.shape
    H, D = cfg.n_head, C // cfg.n_head
    q, k, v = (t.reshape(B, T, H, D) for t in (q, k, v))                           # (B,T,H,D) each
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                     implementation="cudnn" if cfg.attn == "cudnn" else "xla")  # (B,T,H,D)
    return checkpoint_name(y.reshape(B, T, C), "attention")                        # (B,T,C)


def block(x, lp, cfg):
    """One pre-LN transformer block; lp holds this layer's weights."""
    C = x.shape[-1]
    h = layernorm(x, lp["ln_1.w"], lp["ln_1.b"])                                  # (B,T,C)
    # q, k, v from c_attn's three row blocks: three contiguous outputs for the attention kernel, where
    # slicing one (B,T,3C) product would cost a copy of each (and a concatenation in the backward). The
    # barrier hides that the three inputs are one tensor: XLA would otherwise merge two of the matmuls
    # into one, then spend a pass over both outputs adding the biases and splitting them apart (and a
    # concatenation of their gradients), where separate matmuls add the bias in cuBLAS's epilogue.
    hs = jax.lax.optimization_barrier((h, h, h))                                   # 3 x (B,T,C)
    q, k, v = (linear(hs[i], lp["c_attn.w"][i * C:(i + 1) * C], lp["c_attn.b"][i * C:(i + 1) * C])
               for i in range(3))                                                  # (B,T,C) each
    x = x + linear(attention(q, k, v, cfg), lp["attn.c_proj.w"], lp["attn.c_proj.b"])  # (B,T,C)
    h = layernorm(x, lp["ln_2.w"], lp["ln_2.b"])                                  # (B,T,C)
    h = gelu(linear(h, lp["c_fc.w"], lp["c_fc.b"]))                               # (B,T,4C)
    return x + linear(h, lp["mlp.c_proj.w"], lp["mlp.c_proj.b"])                  # (B,T,C)


# --recompute as the jax.checkpoint policy around each block (both recipes): what the policy saves is
# kept for the backward, the rest of the block's forward reruns there, one block at a time. none: no
# checkpoint (autodiff keeps what its backward reads); pointwise: the values named "matmul" (linear's
# outputs) and "attention" (the attention's output), so the norms, the rotary and the MLP's activation
# rerun, and so does the attention's softmax (from the kept q and k) where XLA's kernel kept its scores
# (cuDNN's forward reruns for its row logsumexp, which has no name); block: nothing, so only each block's
# input stays (the argument of the checkpoint)
RECOMPUTE_POLICIES = {"none": None,
                      "pointwise": jax.checkpoint_policies.save_only_these_names("matmul", "attention"),
                      "block": jax.checkpoint_policies.nothing_saveable}


def recomputed(block_fn, cfg):
    """block_fn(x, weights) -> x with its backward keeping what cfg.recompute keeps (RECOMPUTE_POLICIES)."""
    policy = RECOMPUTE_POLICIES[cfg.recompute]
    if policy is None:
        return block_fn
    checkpointed = jax.checkpoint(block_fn, policy=policy)

    @jax.custom_vjp
    def layer(x, weights):
        return checkpointed(x, weights)

    def layer_fwd(x, weights):
        return jax.vjp(checkpointed, x, weights)  # the vjp's leaves: what the policy keeps

    def layer_bwd(vjp, dy):
        # the rerun's inputs are made to depend on this block's dy, by adding -0.0 (times one element of
        # dy), which leaves every value as it is: XLA's CPU pipeline drops optimization barriers and
        # would run the rerun as soon as its inputs exist, in the forward, keeping all it makes (as none).
        # The weights too: XLA's CPU backend writes broadcasts of the norms' gains out (B,T,C). With the
        # batch split over devices that element costs one scalar all-reduce per block; a NaN or inf there
        # makes every gradient NaN, where the step's grad norm is non-finite anyway.
        after_dy = -0.0 * jnp.abs(dy.ravel()[0])                                  # ()
        return jax.tree.map(lambda r: r + after_dy.astype(r.dtype), vjp)(dy)

    layer.defvjp(layer_fwd, layer_bwd)
    return layer


def transformer(params, idx, cfg):
    """Token ids idx (B,T) -> hidden states (B,T,C) after ln_f, in the compute dtype. Tensors that are
    not in the compute dtype yet (fp32 masters) are cast here."""
    dt = compute_dtype(cfg)
    T = idx.shape[1]
    # rows gathered from the fp32 tables, so the embeddings' scatter-add gradient is summed in fp32.
    # wpe is gathered by position too, not broadcast over B: adding a broadcast (T,C) table leads XLA's
    # GPU layout assignment to store the whole residual stream batch-minor, (T,C,B) in memory, which
    # then costs a transpose before and after every LayerNorm and matmul.
    pos = jnp.broadcast_to(jnp.arange(T), idx.shape)                                # (B,T)
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


def token_losses(params, x, y, cfg):
    """Per-token cross-entropy (B,T) in fp32 of targets y (B,T) given inputs x (B,T), over the first V
    columns."""
    return cross_entropy(forward(params, x, cfg), y)                               # (B,T)


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


def adam_scalars(step, cfg):
    """[lr, 1 - beta1^t, 1 - beta2^t] for 1-based step t, computed on the host in float64 and passed to
    the compiled step as data, so a new lr never recompiles it."""
    return np.array([cosine_lr(step - 1, cfg), 1.0 - ADAM_BETA1 ** step, 1.0 - ADAM_BETA2 ** step],
                    dtype=np.float32)


def global_norm(grads):
    """torch.nn.utils.clip_grad_norm_'s total norm: the L2 norm of the per-tensor L2 norms, in fp32."""
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
    return jnp.sum(losses) if recipe.summed else jnp.mean(losses)


EMBEDDINGS = ("wte", "wpe")  # the model gathers rows from them in fp32: no compute-dtype copies


def train_step(params, m, v, copies, x, y, scalars, cfg, layout):
    """One optimizer step on x, y (A,B,T) = A micro-batches: the gradient of the mean of the A micro-batch
    losses (each micro-batch's gradient scaled by 1/A and summed in fp32), or of the sum of every token's
    loss (Recipe.summed), clipped to cfg.grad_clip, then the recipe's update. `layout`
    (state_layout) places the state; at stage 0 every constraint below says "replicated" and changes
    nothing. `copies` are stage 1's bf16 weights ({} otherwise). Returns (params, m, v, copies, mean token
    loss, grad_norm before clipping)."""
    A = x.shape[0]
    recipe = RECIPES[cfg.recipe]
    summed = recipe.summed
    scale = 1.0 if summed else 1.0 / A
    constrain = jax.lax.with_sharding_constraint
    # the compute-dtype weights are made once per step, not once per micro-batch; the embedding tables
    # stay fp32 (transformer gathers from them), so only the lm head casts wte in each micro-batch.
    # Stage 3 gathers them whole here, after the cast: the all-gather moves compute-dtype bytes. Stage 1
    # has them already, from the last update.
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
    # each device updates the slice of the masters its moments cover (a local cut of the masters that
    # are whole, no communication); out_shardings gathers those whole again, and stage 1's new bf16
    # copies too (the all-gather moves bf16 bytes), and keeps the split ones split
    params = constrain(params, layout["moments"])
    params, m, v = recipe.update(params, grads, m, v, scalars, cfg, layout)
    loss = jnp.sum(losses) / cfg.total_batch_size if summed else jnp.sum(losses)
    return params, m, v, cast_copies(params, copies, cfg), loss, norm


def attention_bytes(cfg, n_head):
    """Bytes that one block's attention keeps for its backward beyond q, k, v and its output, with nothing
    recomputed: XLA's kernel keeps its (B,H,T,T) scores, cuDNN's (--attn cudnn, or auto in bf16: a GPU's
    choice) only its row logsumexp, which activation_bytes leaves out with the other row statistics."""
    if cfg.attn == "cudnn" or (cfg.attn == "auto" and cfg.dtype == "bf16"):
        return 0
    scores = cfg.batch_size * n_head * cfg.seq_len**2                               # B*H*T*T
    # the causal mask (bool), the masked scores and their exp (fp32), the probabilities (compute dtype)
    return scores * (1 + 4 + 4 + jnp.dtype(compute_dtype(cfg)).itemsize)


def gpt2_activation_bytes(cfg):
    """What one micro-batch's saved activations hold at the backward's start, per device: autodiff's
    residuals (jax.ad_checkpoint.print_saved_residuals lists them) at cfg.recompute, in bytes. Row
    statistics ((B,T) means and rstds, (B,H,T) row sums), under 1% of it, are left out."""
    N, C, d = cfg.batch_size * cfg.seq_len, cfg.n_embd, jnp.dtype(compute_dtype(cfg)).itemsize
    block = {  # per block
        "none": (N * C * d                   # ln_1's input x (B,T,C)
                 + N * C * d                 # ln_1's output (B,T,C), c_attn's input (the barrier's 3 are one)
                 + 3 * N * C * d             # q, k, v (B,T,C)
                 + attention_bytes(cfg, cfg.n_head)
                 + N * C * d                 # the attention's output (B,T,C), attn.c_proj's input
                 + N * C * d                 # ln_2's input (B,T,C)
                 + N * C * d                 # ln_2's output (B,T,C), c_fc's input
                 + N * 4 * C * d             # c_fc's output (B,T,4C), GELU's input
                 + N * 4 * C * d),           # GELU's output (B,T,4C), mlp.c_proj's input
        "pointwise": (N * C * d              # the block's input x (B,T,C)
                      + 3 * N * C * d        # q, k, v (B,T,C)
                      + N * C * d            # the attention's output (B,T,C)
                      + N * C * d            # attn.c_proj's output (B,T,C): with x, ln_2's input
                      + N * 4 * C * d),      # c_fc's output (B,T,4C)
        "block": N * C * d,                  # the block's input x (B,T,C)
    }[cfg.recompute]
    head = (N * C * d                        # ln_f's input (B,T,C)
            + N * C * d                      # ln_f's output (B,T,C), the lm head's input
            + N * cfg.padded_vocab_size * d)  # the logits (B,T,Vp), the cross-entropy's backward's input
    return cfg.n_layer * block + head


RECIPES = {"gpt2": Recipe(
    help="llm.c's GPT-2 and AdamW", defaults={}, configure=lambda cfg, given, shape: None,
    shapes=gpt2_shapes, init=init_gpt2_numpy, lr_at=cosine_lr, muon_names=lambda shapes: [],
    model_file="model.bin", file_kind="an llm.c model file (.bin)", is_file=is_model_file,
    read_file=read_model_file, write_file=write_model_file, model_name="GPT-2", table="wpe",
    optimizers="AdamW", activation_bytes=gpt2_activation_bytes,
    token_losses=token_losses, summed=False, scalars=adam_scalars,
    update=lambda params, grads, m, v, scalars, cfg, layout: adamw_update(params, grads, m, v, scalars, cfg),
    embeddings=EMBEDDINGS, next_logits=next_logits, scan_layers=True)}

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

# The speedrun model, as the reference's GPT computes it: per-layer weights by their state_dict names (cast
# to the compute dtype here, so that evaluation can hand in the fp32 masters), RMSNorm with the compute
# dtype's machine epsilon (what the reference's F.rms_norm uses where the residual stream is bf16), rotary
# positions computed in fp32. Plain autodiff throughout.

ATTN_SCALE = 0.12  # the reference's, in place of 1/sqrt(128)
SOFTCAP = 15.0


def rms_norm(x, w, eps):
    """RMSNorm over the last axis with gain w (None: no gain), statistics in fp32, out in x's dtype."""
    xf = x.astype(jnp.float32)                                                     # (..., C)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)  # (..., C)
    return (y if w is None else y * w.astype(jnp.float32)).astype(x.dtype)         # (..., C)


def rotary(x):
    """The reference's half-truncated rotary embedding of q or k (B,T,H,D), in fp32: the first D/4 pairs
    (x1[i], x2[i]) of the halves turn by the angle t * freq[i], the last D/4 stay as they are."""
    T, D = x.shape[1], x.shape[3]
    freq = (1 / 1024) ** jnp.linspace(0, 1, D // 4, dtype=jnp.float32)           # (D/4,)
    freq = jnp.concatenate([freq, jnp.zeros(D // 4, jnp.float32)])                 # (D/2,)
    t = jnp.arange(T, dtype=jnp.float32)                                           # (T,)
    theta = jnp.outer(t, freq)[None, :, None]                                      # (1,T,1,D/2)
    cos, sin = jnp.cos(theta), jnp.sin(theta)                                      # (1,T,1,D/2) each
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)                          # (B,T,H,D/2) each
    return jnp.concatenate((x1 * cos + x2 * sin, x2 * cos - x1 * sin), -1).astype(x.dtype)  # (B,T,H,D)


def speedrun_block(x, params, layer, cfg):
    """One pre-norm block of the speedrun model, with the weights blocks.<layer>.* of params."""
    B, T, C = x.shape
    H, D = C // HEAD_DIM, HEAD_DIM
    dt = compute_dtype(cfg)
    eps = jnp.finfo(dt).eps
    prefix = f"blocks.{layer}."
    w = {k[len(prefix):]: p.astype(dt) for k, p in params.items() if k.startswith(prefix)}
    h = rms_norm(x, w["norm1.gains"], eps)                                         # (B,T,C)
    q, k, v = (linear(h, w[f"attn.{n}.weight"], w[f"attn.{n}.bias"]).reshape(B, T, H, D)
               for n in "qkv")                                                     # (B,T,H,D) each
    q, k = (rotary(rms_norm(t, None, eps)) for t in (q, k))                        # (B,T,H,D) each
    y = jax.nn.dot_product_attention(q, k, v, scale=ATTN_SCALE, is_causal=True,
                                     implementation="cudnn" if cfg.attn == "cudnn" else "xla")  # (B,T,H,D)
    y = checkpoint_name(y.reshape(B, T, C), "attention")                           # (B,T,C)
    x = x + linear(y, w["attn.proj.weight"], w["attn.proj.bias"])                 # (B,T,C)
    h = rms_norm(x, w["norm2.gains"], eps)                                         # (B,T,C)
    h = jnp.square(jax.nn.relu(linear(h, w["mlp.fc.weight"], w["mlp.fc.bias"])))  # (B,T,4C)
    return x + linear(h, w["mlp.proj.weight"], w["mlp.proj.bias"])                # (B,T,C)


def speedrun_transformer(params, idx, cfg):
    """Token ids idx (B,T) -> hidden states (B,T,C) after the final RMSNorm, in the compute dtype; no
    position embedding: the blocks' rotary gives the positions."""
    dt = compute_dtype(cfg)
    eps = jnp.finfo(dt).eps
    # rows gathered from the fp32 table, so that its scatter-add gradient is summed in fp32
    x = jnp.take(params["embed.weight"], idx, axis=0).astype(dt)                  # (B,T,C)
    x = rms_norm(x, params["norm1.gains"], eps)                                    # (B,T,C)
    for layer in range(cfg.n_layer):  # each block sees its own weights: --recompute checkpoints it alone
        weights = {k: p for k, p in params.items() if k.startswith(f"blocks.{layer}.")}
        x = recomputed(partial(speedrun_block, layer=layer, cfg=cfg), cfg)(x, weights)  # (B,T,C)
    return rms_norm(x, params["norm2.gains"], eps)                                 # (B,T,C)


def speedrun_logits(h, weight, bias):
    """The head's logits z = h W^T + b in fp32, soft-capped to 15 z / sqrt(z^2 + 15^2): (..., rows of W)."""
    z = linear(h, weight.astype(h.dtype), bias.astype(h.dtype)).astype(jnp.float32)  # (..., V)
    return SOFTCAP * z * jax.lax.rsqrt(jnp.square(z) + SOFTCAP**2)                 # (..., V)


def speedrun_forward(params, idx, cfg):
    """Logits (B,T,Vp) of the speedrun model: its own head's, soft-capped, in fp32."""
    h = speedrun_transformer(params, idx, cfg)                                     # (B,T,C)
    return speedrun_logits(h, params["proj.weight"], params["proj.bias"])          # (B,T,Vp)


def speedrun_next_logits(params, tokens, t, cfg):
    """The logits (S,V) of the token after position t (traced) of tokens (S,T), for sampling."""
    h = jax.lax.dynamic_index_in_dim(speedrun_transformer(params, tokens, cfg), t, axis=1,
                                     keepdims=False)                              # (S,C)
    return speedrun_logits(h, params["proj.weight"][:VOCAB_SIZE], params["proj.bias"][:VOCAB_SIZE])  # (S,V)


def speedrun_token_losses(params, x, y, cfg):
    """Per-token cross-entropy (B,T) in fp32, as the reference's: over all Vp columns."""
    logits = speedrun_forward(params, x, cfg)                                      # (B,T,Vp)
    target_logit = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]      # (B,T)
    return jax.nn.logsumexp(logits, axis=-1) - target_logit                        # (B,T)


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


def speedrun_scalars(step, cfg):
    """[lr of each SPEEDRUN_LRS group, 1 - beta1^t, 1 - beta2^t] for 1-based step t (adam_scalars')."""
    return np.array([*speedrun_lrs(step - 1, cfg).values(), 1.0 - SPEEDRUN_BETA1 ** step,
                     1.0 - SPEEDRUN_BETA2 ** step], dtype=np.float32)


def newton_schulz(G, dtype):
    """The reference's orthogonalization of each matrix G (n,r,c) -> (n,r,c) in `dtype`: from X = G/||G||_F
    (spectral norm at most 1), 12 iterations of X <- 2X + (-1.5 A + 0.5 A^2) X with A = X X^T, which drive
    every singular value of X toward 1; on the transposes of tall matrices, so that A is the smaller."""
    tall = G.shape[-2] > G.shape[-1]
    X = G.astype(dtype).mT if tall else G.astype(dtype)                            # (n,r',c')
    norm = jnp.sqrt(jnp.sum(jnp.square(X.astype(jnp.float32)), axis=(-2, -1), keepdims=True))  # (n,1,1)
    X = X / (norm + 1e-7).astype(dtype)                                            # (n,r',c')

    def iteration(_, X):
        A = X @ X.mT                                                               # (n,r',r')
        return 2 * X + (-1.5 * A + 0.5 * (A @ A)) @ X                              # (n,r',c')
    # a loop, not 12 unrolled copies: each shape's update compiles one body (CPU compile time)
    X = jax.lax.fori_loop(0, NEWTON_SCHULZ_STEPS, iteration, X)                    # (n,r',c')
    return X.mT if tall else X                                                     # (n,r,c)


def speedrun_adamw(p, g, m, v, lr, bias1, bias2, weight_decay):
    """AdamW with the speedrun recipe's betas and eps on one tensor, as torch.optim.AdamW computes it: m =
    lerp(m, g, 1-b1), v = b2 v + (1-b2) g^2, p *= 1 - lr*wd, p -= lr mhat/(sqrt(vhat)+eps). Returns the new
    (p, m, v)."""
    m = m + (1.0 - SPEEDRUN_BETA1) * (g - m)
    v = SPEEDRUN_BETA2 * v + (1.0 - SPEEDRUN_BETA2) * g * g
    update = (m / bias1) / (jnp.sqrt(v / bias2) + SPEEDRUN_EPS)
    return p * (1.0 - lr * weight_decay) - lr * update, m, v


def speedrun_muon(names, params, grads, m, lr, dtype, deal):
    """Muon on the matrices `names`, all of one shape (r,c): the momentum buffer m = lerp(m, g, 0.05),
    Nesterov's u = lerp(g, m, 0.95), orthogonalized by newton_schulz in `dtype` (batched over the
    matrices, dealt over the devices by the sharding `deal` when their count divides, else whole on each)
    and scaled by max(1, r/c)^0.5; p *= 1 - lr*wd, p -= lr*update. Returns ({name: new p}, {name: new
    m}) of `names`."""
    g = jnp.stack([grads[k] for k in names])                                       # (n,r,c)
    momentum = jnp.stack([m[k] for k in names])                                    # (n,r,c)
    momentum = momentum + (1.0 - MUON_MOMENTUM) * (g - momentum)                   # (n,r,c)
    # torch.lerp's form for a weight >= 0.5: end - (end - start) * (1 - weight)
    u = momentum - (1.0 - MUON_MOMENTUM) * (momentum - g)                          # (n,r,c)
    r, c = u.shape[1:]
    if deal is None:
        update = newton_schulz(u, dtype)                                           # (n,r,c)
    else:  # pinned on both sides: XLA would otherwise split the iterations like the weights they update
        if len(names) % deal.mesh.size:
            deal = NamedSharding(deal.mesh, PartitionSpec())
        constrain = partial(jax.lax.with_sharding_constraint, shardings=deal)
        update = constrain(newton_schulz(constrain(u), dtype))                     # (n,r,c)
    update = update.astype(jnp.float32) * max(1.0, r / c) ** 0.5                   # (n,r,c)
    p = jnp.stack([params[k] for k in names]) * (1.0 - lr * MUON_WEIGHT_DECAY) - lr * update  # (n,r,c)
    return {k: p[i] for i, k in enumerate(names)}, {k: momentum[i] for i, k in enumerate(names)}


def speedrun_update(params, grads, m, v, scalars, cfg, deal=None):
    """The speedrun recipe's step: AdamW on the tensors v holds (the embedding, the head weight, every
    vector), each group at its lr, and Muon on the rest, the blocks' matrices, whose momentum buffers m
    holds (dealt over the devices by `deal`: speedrun_muon). Returns new (params, m, v)."""
    lr = {group: scalars[i] for i, group in enumerate(SPEEDRUN_LRS)}
    new_params, new_m, new_v = {}, {}, {}
    for k in v:
        new_params[k], new_m[k], new_v[k] = speedrun_adamw(params[k], grads[k], m[k], v[k],
                                                           lr[adamw_group(k)], scalars[4], scalars[5],
                                                           cfg.weight_decay)
    muon = [k for k in grads if k not in v]
    for shape in dict.fromkeys(params[k].shape for k in muon):
        p, momentum = speedrun_muon([k for k in muon if params[k].shape == shape], params, grads, m,
                                    lr["muon"], compute_dtype(cfg), deal)
        new_params.update(p)
        new_m.update(momentum)
    return {k: new_params[k] for k in params}, {k: new_m[k] for k in m}, new_v


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
    """gpt2_activation_bytes' count for the speedrun model: autodiff's residuals at cfg.recompute."""
    N, C, d = cfg.batch_size * cfg.seq_len, cfg.n_embd, jnp.dtype(compute_dtype(cfg)).itemsize
    # an RMSNorm with gains keeps its input in fp32 (an fp32 copy where the compute dtype is bf16), 2x
    # (x^2's derivative) and the normalized x, fp32 (B,T,C) each, and its output (B,T,C), a matmul's input
    norm = N * C * (3 * 4 + d)
    block = {  # per block
        "none": (norm                        # norm1 (its input: the block's input)
                 + 2 * N * C * 2 * 4         # q's and k's RMSNorms: the input in fp32 and 2x (B,T,H,D) each
                 + N * C * d                 # v (B,T,H,D)
                 + 2 * N * C * d             # q and k after the rotary (B,T,H,D), the attention's inputs
                 + attention_bytes(cfg, C // HEAD_DIM)
                 + N * C * d                 # the attention's output (B,T,C), attn.proj's input
                 + norm                      # norm2
                 + N * 4 * C * (1 + 2 * d)),  # ReLU^2: ReLU's mask (bool), 2 ReLU(h) and the output (B,T,4C)
        "pointwise": (N * C * d              # the block's input x (B,T,C)
                      + 3 * N * C * d        # q, k, v (B,T,C)
                      + N * C * d            # the attention's output (B,T,C)
                      + N * C * d            # attn.proj's output (B,T,C): with x, norm2's input
                      + N * 4 * C * d),      # mlp.fc's output (B,T,4C)
        "block": N * C * d,                  # the block's input x (B,T,C)
    }[cfg.recompute]
    head = (N * C * 3 * 4                    # the embedding's RMSNorm, less its output (block 0's input)
            + norm                           # the final RMSNorm
            # the head's logits before the cap, the cap's rsqrt and the softmax's exp (B,T,Vp) fp32 each: what
            # XLA keeps of autodiff's five (the cap's two products are recomputed inside their consumers)
            + 3 * N * cfg.padded_vocab_size * 4)
    return cfg.n_layer * block + head


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
    token_losses=speedrun_token_losses, summed=True, scalars=speedrun_scalars,
    update=lambda params, grads, m, v, scalars, cfg, layout: speedrun_update(params, grads, m, v, scalars,
                                                                             cfg, layout["matrices"]),
    embeddings=("embed.weight",), next_logits=speedrun_next_logits, scan_layers=False)

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
# JAX plumbing: devices, processes, ZeRO state and evaluation

# ZeRO over the mesh's "data" axis, written as shardings only: the state arrays carry a NamedSharding,
# jit's in/out shardings and a few with_sharding_constraint calls say where each value lives, and XLA
# inserts the collectives: the gradients' reduce-scatter (on the CPU an all-reduce and a slice; XLA's GPU
# passes fuse the two) and the weights' all-gather.

def shard_axis(shape, world):
    """The axis along which ZeRO splits a tensor of `shape` over `world` devices: the first whose size
    `world` divides, so that any device count works (12 layers over 8 devices split the next axis
    instead). None when no axis divides: that tensor stays whole on every device (device_state_bytes
    counts it whole)."""
    return next((i for i, n in enumerate(shape) if n % world == 0), None)


def zero_spec(shape, world):
    """PartitionSpec of a tensor split by ZeRO: "data" on its shard_axis, or replicated if it has none."""
    axis = shard_axis(shape, world)
    return PartitionSpec() if axis is None else PartitionSpec(*[None] * axis, "data")


def copied_names(cfg):
    """The tensors that stage 1 keeps bf16 copies of across steps (llm.c's ZeRO-1: the masters split, the
    copies the model computes with whole): all but the embedding tables, and none in fp32, where the
    model computes with the masters themselves."""
    if cfg.zero_stage != 1 or cfg.dtype == "fp32":
        return []
    return [k for k in param_shapes(cfg) if k not in RECIPES[cfg.recipe].embeddings]


def cast_copies(params, names, cfg):
    """{name: params[name] in the compute dtype} for `names`: stage 1's copies, cast at start and by
    every update."""
    return {k: params[k].astype(compute_dtype(cfg)) for k in names}


def state_layout(cfg, mesh):
    """Where each piece of training state lives at cfg.zero_stage: {piece: {name: NamedSharding}} for
    "masters" (fp32 weights), "grads" (a step's fp32 gradient sums), "moments" (m and v), "copies" (stage
    1's bf16 weights, whole) and "weights" (the compute copies inside a step, whole: the devices split the
    batch, not the model); "matrices": how Muon deals each shape's stack of matrices (None at stage 0)."""
    # Stage 1 splits the masters that have copies (fp32 ones are what the model computes with). From stage
    # 1 the gradient sums are split like the moments: XLA sums each micro-batch's gradient over the devices
    # inside the accumulation loop anyway, and a reduce-scatter into a slice moves half the bytes of an
    # all-reduce into a whole copy, so stage 1 also gets ZeRO-2's saving. Muon's matrices are dealt whole,
    # each device orthogonalizing its own, as torchfunc's ZeRO-1 deals them: a matrix split along rows
    # would have XLA sum partial products across devices (in bf16 with --dtype bf16).
    replicated = NamedSharding(mesh, PartitionSpec())
    split = {k: NamedSharding(mesh, zero_spec(s, mesh.size)) for k, s in param_shapes(cfg).items()}
    whole = {k: replicated for k in split}
    copied = copied_names(cfg)
    masters = {k: split[k] if cfg.zero_stage == 3 or k in copied else replicated for k in split}
    return {"masters": masters,
            "grads": split if cfg.zero_stage >= 1 else whole,
            "moments": split if cfg.zero_stage >= 1 else whole,
            "copies": {k: replicated for k in copied},
            "weights": whole,
            "matrices": NamedSharding(mesh, PartitionSpec("data")) if cfg.zero_stage >= 1 else None}


def gather_state(tree):
    """Whole host (numpy) copies of device arrays, whichever way they are split and over however many
    processes, so that a checkpoint never depends on the stage or device count it was saved at. A
    collective: every process must call it, in the same order."""
    return multihost_utils.process_allgather(tree, tiled=True)


def counted_loss_sum(params, x, y, counted, cfg):
    """The sum, over the first `counted` rows of a global batch x, y (B, T), of each row's mean token loss
    (a scalar whole on every device, even when the batch's rows are split over processes)."""
    rows = RECIPES[cfg.recipe].token_losses(params, x, y, cfg).mean(-1)           # (B,)
    return jnp.where(jnp.arange(rows.shape[0]) < counted, rows, 0.0).sum()


def evaluate_val(loss_sum_jit, params, loader, cfg, put):
    """Mean token loss over the first cfg.val_tokens // T sequences of the val shards (the loader restarts
    each time): every process reads its own rows of each global batch; rows of the last batch past those
    sequences count for nothing, so that the same weights give the same loss at any device count."""
    loader.reset()
    total = 0.0
    for counted in val_batches(cfg, loader):
        x, y = loader.next_batch()                                                 # (B,T) each
        total += float(loss_sum_jit(params, put(x), put(y), counted))
    return total / (cfg.val_tokens // cfg.seq_len)


def evaluate_hellaswag(losses_jit, params, cfg):
    """(acc, acc_norm) through hellaswag.evaluate, which every process runs (its computations span all
    devices) and process 0 alone reports. A row longer than the model's context keeps its last
    block_size tokens (the losses of the cropped-off context positions are reported as 0; they are
    never ending tokens unless an ending alone is longer than the context)."""
    def row_losses(tokens):                                                        # (4, n+1) int64
        x, y = tokens[:, :-1], tokens[:, 1:]                                       # (4, n) each
        n = x.shape[1]
        crop = max(0, n - cfg.block_size)
        width = min(cfg.block_size, max(HELLASWAG_MIN_WIDTH, 1 << (n - crop - 1).bit_length()))
        xp = np.zeros((x.shape[0], width), np.int32)                              # (4, width)
        yp = np.zeros((x.shape[0], width), np.int32)                              # (4, width)
        xp[:, :n - crop], yp[:, :n - crop] = x[:, crop:], y[:, crop:]
        losses = np.asarray(losses_jit(params, xp, yp))                           # (4, width)
        out = np.zeros((x.shape[0], n), np.float32)                               # (4, n)
        out[:, crop:] = losses[:, :n - crop]
        return out
    return hellaswag.evaluate(row_losses, limit=cfg.hellaswag_limit, progress=jax.process_index() == 0)


def generate(params, key, cfg):
    """SAMPLE_COUNT continuations of EOT sampled with top-k TOP_K over the first V logits: token ids
    (S, T) int32 with column 0 = EOT. Every position is recomputed each time (no KV cache): the causal
    mask makes the not-yet-sampled zeros to the right irrelevant, and one fixed shape compiles once."""
    T = min(cfg.block_size, SAMPLE_TOKENS + 1)
    tokens = jnp.zeros((SAMPLE_COUNT, T), jnp.int32).at[:, 0].set(EOT)            # (S,T)
    rows = jnp.arange(SAMPLE_COUNT)                                                # (S,)

    def sample_next(t, carry):                                                     # token t+1 from 0..t
        tokens, key = carry
        logits = RECIPES[cfg.recipe].next_logits(params, tokens, t, cfg)          # (S,V)
        top_logits, top_ids = jax.lax.top_k(logits, TOP_K)                        # (S,K) each
        key, sub = jax.random.split(key)
        choice = jax.random.categorical(sub, top_logits, axis=-1)                 # (S,)
        return tokens.at[:, t + 1].set(top_ids[rows, choice]), key

    tokens, _ = jax.lax.fori_loop(0, T - 1, sample_next, (tokens, key))
    return tokens


def device_state_bytes(cfg, shapes, world):
    """Bytes of training state that ONE device holds at cfg.zero_stage over `world` devices, for the
    tensors of `shapes`: {"params": compute-dtype copies kept across steps, "grads": the fp32 gradient
    accumulator of a step, "masters": the fp32 weights, "moments": AdamW's m and v, speedrun's Muon
    momentum}. "params" counts
    stage 1's bf16 copies only: at the other stages (and in fp32) the model's bf16 copies live only inside
    a step. Split as state_layout splits them; a tensor without an axis the device count divides counts
    whole."""
    def held(shape, split, size=4):
        axis = shard_axis(shape, world) if split else None
        return size * math.prod(shape) // (world if axis is not None else 1)
    copied, muon = copied_names(cfg), set(RECIPES[cfg.recipe].muon_names(shapes))
    return {"params": sum(held(shapes[k], False, 2) for k in copied),
            "grads": sum(held(s, cfg.zero_stage >= 1) for s in shapes.values()),
            "masters": sum(held(s, cfg.zero_stage == 3 or k in copied) for k, s in shapes.items()),
            "moments": sum((1 if k in muon else 2) * held(s, cfg.zero_stage >= 1) for k, s in shapes.items())}


def log_event(out_dir, **record):
    """Appends one JSON object to <out_dir>/log.jsonl (the keys of docs/FORMATS.md)."""
    record["framework"] = FRAMEWORK
    path = os.path.join(out_dir, "log.jsonl")
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:  # a half line left is cut off on --resume (drop_partial_log_line)
        die(write_failure(path, e))


def peak_memory_gb(devices):
    """The largest peak of allocated bytes over the devices, in GB; None where the backend keeps no
    statistics (the CPU)."""
    stats = [d.memory_stats() for d in devices]
    if any(s is None or "peak_bytes_in_use" not in s for s in stats):
        return None
    return max(s["peak_bytes_in_use"] for s in stats) / 1e9


def resolve_attention(cfg, platform):
    """--attn auto: cuDNN flash attention when it compiles here (an NVIDIA GPU, bf16), else XLA's."""
    if cfg.attn == "cudnn" and (platform != "gpu" or cfg.dtype != "bf16"):
        die("--attn cudnn needs an NVIDIA GPU and --dtype bf16 (cuDNN's fused attention has no fp32)")
    if cfg.attn != "auto":
        return cfg.attn
    if platform != "gpu" or cfg.dtype != "bf16":
        return "xla"
    q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    probe = partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
    try:
        jax.jit(probe).lower(q, q, q).compile()
    except Exception as e:  # noqa: BLE001  (any failure here means: not available, use XLA's)
        print(f"cuDNN attention unavailable ({str(e).splitlines()[0][:120]}); using XLA's")
        return "xla"
    return "cudnn"


@contextlib.contextmanager
def out_of_memory_is_an_error(cfg):
    """Running out of device memory (at compile or run time) is a bad --batch-size or --recompute: one line,
    no trace."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        cheaper = "" if cfg.recompute == "block" else " or a cheaper --recompute"
        die(f"out of device memory at --batch-size {cfg.batch_size} --recompute {cfg.recompute} (try a "
            f"smaller batch{cheaper}): {str(e).splitlines()[0][:200]}")


CENSUS_SECONDS = 5  # after a failed collective: how long the survivors wait to hear from each other


def lost_processes(rank, world):
    """After a collective failed: the processes that did not answer a roll call in the coordinator's
    key-value store within CENSUS_SECONDS (each survivor writes its mark, then waits for the others'), or
    None when the store is gone. The store is jax.distributed's client, which jax reaches only through
    jax._src (multihost_utils does the same). Process 0 stays a second longer, so that the others read
    the marks before its store closes."""
    client = jax_distributed.global_state.client
    try:
        client.key_value_set(f"census/{rank}", "alive")
        deadline = time.monotonic() + CENSUS_SECONDS
        silent = list(range(world))
        while silent and time.monotonic() < deadline:
            marked = {key.rsplit("/", 1)[-1] for key, _ in client.key_value_dir_get("census/")}
            silent = [r for r in range(world) if str(r) not in marked]
            time.sleep(0.1)
        if rank == 0:
            time.sleep(1)
        return silent
    except jax.errors.JaxRuntimeError:
        return None


@contextlib.contextmanager
def a_lost_process_is_an_error():
    """A process of a multi-process run that dies (killed, out of memory, its machine lost) fails the
    survivors' next collective: each survivor then names the lost process in one line, says how the run
    goes on, and exits at once (jax.distributed's shutdown would wait ~90 s on the dead peer, then abort).
    Other errors, or one after which every process answers, pass through. When process 0, which hosts
    the coordinator, is the one lost, jax's own runtime ends the others at once, with its own message."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        rank, world = jax.process_index(), jax.process_count()
        if world == 1 or not any(s in str(e) for s in ("Gloo", "NCCL", "Connection", "UNAVAILABLE")):
            raise
        silent = lost_processes(rank, world)
        if silent == []:
            raise
        who = ", ".join(map(str, silent)) if silent else "0 (its store is gone)"
        os.write(2, f"error: lost process {who} of {world}: it stopped or was killed, so process {rank} stops "
                    "too; `--resume auto` continues the run from its latest checkpoint\n".encode())
        os._exit(1)


def init_processes(cfg):
    """Joins the other processes of a multi-host run through jax.distributed, before anything touches a
    device. Coordinator, process count and rank come from the flags, else from JAX_COORDINATOR_ADDRESS /
    JAX_NUM_PROCESSES / JAX_PROCESS_ID (jax 0.10 reads only the first itself), else, in a run started by
    srun or mpirun, from their environment, which jax.distributed.initialize() reads on its own. A
    single process (the default) starts nothing. Each process says what it waits for; when they have not
    all joined within --coordinator-timeout seconds, one line says what to check."""
    def env_int(name, default):
        text = os.environ.get(name, "")
        if not text:
            return default
        try:
            return int(text)
        except ValueError:
            die(f"${name} is {text!r}, not an integer")

    def port_of(address, source):
        # checked here because jax takes a malformed address for a crash (IndexError, a segfault on a
        # port that is no number) or a silent hang (a port above 65535)
        host, _, port = address.rpartition(":")
        inner = host[1:-1] if host[:1] == "[" and host[-1:] == "]" else host
        if not inner or (inner == host and ":" in host) or "[" in inner or "]" in inner:
            die(f"{source} {address!r}: expected HOST:PORT (an IPv6 host in [brackets])")
        if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            die(f"{source} {address!r}: the port must be a number in 1-65535")
        return port

    def join(coordinator, n, rank, waiting, check):
        print(waiting, flush=True)

        # jax's own deadline ends in a C++ abort (XLA's default missed-heartbeat callback, which
        # jax.distributed.initialize has no way to replace) while the main thread is blocked in C++, so
        # nothing in Python can catch it. connect() releases the GIL, so a timer thread writes the line and
        # ends the process first; jax's deadline, a minute later, only backstops it
        def give_up():
            os.write(2, f"error: the processes did not all join within {cfg.coordinator_timeout} s "
                        f"(--coordinator-timeout): {check}\n".encode())
            os._exit(1)
        timer = threading.Timer(cfg.coordinator_timeout, give_up)
        timer.start()
        try:
            jax.distributed.initialize(coordinator, n, rank,
                                       initialization_timeout=cfg.coordinator_timeout + 60)
        except jax.errors.JaxRuntimeError as e:  # e.g. process 0's port taken after its check
            die(f"joining the processes failed ({str(e).splitlines()[0][:200]}): {check}")
        finally:
            timer.cancel()

    if cfg.num_processes < 0 or cfg.process_id < -1:
        die("--num-processes must be >= 0 (0: from the environment), --process-id >= 0")
    if cfg.coordinator_timeout <= 0:
        die(f"--coordinator-timeout {cfg.coordinator_timeout}: must be a positive number of seconds")
    n = cfg.num_processes or env_int("JAX_NUM_PROCESSES", 0)
    launched = max(env_int("SLURM_NTASKS", 1), env_int("OMPI_COMM_WORLD_SIZE", 1))
    if n < 0:
        die(f"$JAX_NUM_PROCESSES must be >= 1, got {n}")
    if cfg.process_id >= 0 and n == 0:
        die(f"--process-id {cfg.process_id} needs --num-processes (or $JAX_NUM_PROCESSES), the count it "
            "is a rank of")
    if cfg.process_id >= n:
        source = "--num-processes" if cfg.num_processes else "$JAX_NUM_PROCESSES"
        die(f"--process-id {cfg.process_id} is out of range: {source} {n} needs it in [0, {n})")
    if n == 1 or (n == 0 and launched <= 1):
        return
    if n == 0:  # srun / mpirun: JAX finds the coordinator, count, rank and local devices itself
        if cfg.coordinator:
            port_of(cfg.coordinator, "--coordinator")
        join(cfg.coordinator or None, None, None,
             f"waiting up to {cfg.coordinator_timeout} s for the {launched} processes of this srun/mpirun "
             "launch to join",
             "check that all of them started, that their hosts reach process 0's (firewalls), and that none "
             "got another --coordinator or --num-processes")
        return
    coordinator = cfg.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    rank = cfg.process_id if cfg.process_id >= 0 else env_int("JAX_PROCESS_ID", -1)
    if not coordinator:
        die(f"--num-processes {n} needs --coordinator HOST:PORT (or $JAX_COORDINATOR_ADDRESS)")
    source = "--coordinator" if cfg.coordinator else "$JAX_COORDINATOR_ADDRESS"
    port = port_of(coordinator, source)
    if not 0 <= rank < n:
        die(f"--num-processes {n} needs --process-id (or $JAX_PROCESS_ID) in [0, {n}), got {rank}")
    if rank == 0 and not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        # jax binds all addresses on the port, and on a port already taken it segfaults about every other
        # time instead of raising; binding it here first (SO_REUSEADDR, as gRPC does) tells the two apart
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", int(port)))
            except OSError as e:
                die(f"{source} {coordinator}: process 0 cannot listen on port {port} here ({e.strerror}): "
                    "another run, or an earlier process 0 still running, may hold it; stop that or pick "
                    "another port")
    if rank == 0:
        waiting = f"for processes 1 .. {n - 1} to join the coordinator it starts at {coordinator}"
        check = (f"check that processes 1 .. {n - 1} started with --coordinator {coordinator} and "
                 f"--num-processes {n}, each with its own --process-id, and that their hosts reach port "
                 f"{port} here (firewalls)")
    else:
        waiting = f"for the coordinator at {coordinator} (process 0 must start too)"
        check = (f"check that process 0 runs and listens at {coordinator} (that host, that port), that no "
                 f"firewall blocks port {port} between the hosts, and that every process got --num-processes "
                 f"{n}")
    join(coordinator, n, rank, f"process {rank} of {n}: waiting up to {cfg.coordinator_timeout} s {waiting}",
         check)


def place(tree, shardings):
    """Host arrays that hold the same whole values on every process -> global device arrays laid out as
    `shardings` (a matching tree); each process fills only its own devices' pieces."""
    return jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, lambda index: a[index]),
                        tree, shardings)


def put_rows(sharding, rows):
    """This process's rows of a batch, (..., rows, T) -> the global batch (..., rows x processes, T)
    split over the mesh: process p's rows are rows p*rows .. (p+1)*rows-1, on its own devices."""
    global_shape = rows.shape[:-2] + (rows.shape[-2] * jax.process_count(), rows.shape[-1])
    return jax.make_array_from_process_local_data(sharding, rows, global_shape)


def compile_train_step(cfg, layout, step_batch, replicated, state, grad_accum):
    """train_step jitted with the state's shardings from `layout` (donated: updated in place), batches
    split by `step_batch`, and compiled ahead for `grad_accum` micro-batches of the global batch.
    `state` is (params, m, v, copies), or arrays shaped and placed like them (speedrun: v of the AdamW
    tensors only)."""
    v_shardings = {k: layout["moments"][k] for k in state[2]}
    state_shardings = (layout["masters"], layout["moments"], v_shardings, layout["copies"])
    step_jit = jax.jit(partial(train_step, cfg=cfg, layout=layout), donate_argnums=(0, 1, 2, 3),
                       in_shardings=state_shardings + (step_batch, step_batch, replicated),
                       out_shardings=state_shardings + (replicated, replicated))
    batch = (grad_accum, cfg.batch_size * step_batch.mesh.size, cfg.seq_len)
    batch_spec = jax.ShapeDtypeStruct(batch, jnp.int32, sharding=step_batch)      # (A,B,T)
    scalar_spec = jax.ShapeDtypeStruct(RECIPES[cfg.recipe].scalars(1, cfg).shape, jnp.float32,
                                       sharding=replicated)
    return step_jit.lower(*state, batch_spec, batch_spec, scalar_spec).compile()

# -----------------------------------------------------------------------------
# Main

@stops_on_signals
def main(argv, signals):
    cfg, explicit = parse_args(argv)
    if cfg.scan_layers and not RECIPES[cfg.recipe].scan_layers:
        die(f"--scan-layers: the {cfg.recipe} model's layers are separate tensors (no L axis) to scan over")
    init_processes(cfg)
    # the mesh lists each process's devices together, processes in order: the data axis then gives each
    # process one contiguous block of the global batch's rows, the block llm.c's rank `rank` of `ranks`
    # reads, so P processes read exactly what one process with all the devices reads
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    world, platform = len(devices), devices[0].platform
    dtype = default_dtype(cfg, gpu=platform != "cpu")
    rank, ranks = jax.process_index(), jax.process_count()
    master = signals.master = rank == 0  # the one process that prints, logs and writes checkpoints
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
    cfg.attn = resolve_attention(cfg, platform)

    # data: every micro-batch spans all devices (B x devices rows); each process's loader reads the rows
    # of its own devices, as llm.c's loader of rank `rank` of `ranks` with B x local devices rows
    grad_accum = grad_accum_steps(cfg, world)
    B, T = cfg.batch_size * world, cfg.seq_len
    rows = cfg.batch_size * jax.local_device_count()
    train_files, val_files = find_shards(cfg)
    train_loader = None if cfg.eval_only else DataLoader(train_files, rows, T, rank, ranks, seed=cfg.seed)
    val_loader = DataLoader(val_files, rows, T, rank, ranks) if val_files else None
    check_val_tokens(cfg, val_loader)
    if train_loader is not None:
        n_shards = len(train_files) if train_files else 1
        shard, position = loader_state
        if shard >= n_shards:
            die(f"--resume: the checkpoint is at train shard {shard}, but --data has {n_shards} shards")
        train_loader.set_state(shard, position)
        if position + B * T + 1 > len(train_loader.tokens):
            die(f"--resume: the checkpoint's position {position} leaves less than one batch of {B * T} "
                f"tokens in train shard {shard} (a different --batch-size or --data than the run had?)")
    if val_loader is None and (cfg.eval_only or cfg.val_every > 0):
        say(f"no validation shards in --data {cfg.data} (give --val-data GLOB): val loss skipped")
    encoder = hellaswag.gpt2_encoding() if cfg.sample_every > 0 and not cfg.eval_only else None
    lock = prepare_out_dir(cfg, master, step)  # noqa: F841  held for the run's life: main's return frees it

    # devices: batches split along their B axis; weights and optimizer state as --zero-stage says
    mesh = Mesh(np.array(devices), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    layout = state_layout(cfg, mesh)
    step_batch = NamedSharding(mesh, PartitionSpec(None, "data"))                  # (A,B,T)
    eval_batch = NamedSharding(mesh, PartitionSpec("data"))                        # (B,T)
    params = place(params, layout["masters"])
    m, v = place(m, layout["moments"]), place(v, {k: layout["moments"][k] for k in v})
    # stage 1's bf16 weights, cast on the devices as every update casts them
    copies = jax.jit(partial(cast_copies, names=list(layout["copies"]), cfg=cfg),
                     out_shardings=layout["copies"])(params)
    # the table that only gathers rows (GPT-2's wte is also its head) counts for no flops
    recipe = RECIPES[cfg.recipe]
    model, table = recipe.model_name, recipe.table
    n_params = sum(p.size for k, p in params.items() if k != table)
    say(f"{model} L{cfg.n_layer} H{cfg.n_head} C{cfg.n_embd}, {n_params / 1e6:.2f}M parameters (without "
        f"{table}) | {world} x {devices[0].device_kind} in {ranks} process(es) | {dtype} | "
        f"attention: {cfg.attn}")
    say(f"batch: {cfg.batch_size} x {T} tokens x {world} devices x {grad_accum} micro-batches = "
        f"{cfg.total_batch_size} tokens per step | data: {cfg.data}")
    held, activations = device_state_bytes(cfg, param_shapes(cfg), world), activation_bytes(cfg)
    say(format_memory(cfg, held, activations, world))
    warning = jax.default_backend() == "cpu" and memory_warning(held, activations, world, host_memory_available())
    if warning:  # on a GPU, running out is an error the trainer reports (out_of_memory_is_an_error)
        say(warning)
    if master:
        log_event(cfg.out_dir, **start_event(cfg, step, world, held, activations))

    # fp32 means fp32: XLA would otherwise run fp32 matmuls on a GPU as TF32
    precision = jax.default_matmul_precision("highest") if cfg.dtype == "fp32" else contextlib.nullcontext()
    with precision, out_of_memory_is_an_error(cfg), a_lost_process_is_an_error():
        val_loss_sum = jax.jit(partial(counted_loss_sum, cfg=cfg))
        row_losses = jax.jit(partial(recipe.token_losses, cfg=cfg))
        put_eval = partial(put_rows, eval_batch)

        # every process runs every evaluation (their computations span all devices); one logs it
        def run_evals(params, step, val, swag):
            if val and val_loader is not None:
                val_loss = evaluate_val(val_loss_sum, params, val_loader, cfg, put_eval)
                say(f"step {step:5d} | val loss {val_loss:.6f}")
                if master:
                    log_event(cfg.out_dir, step=step, val_loss=val_loss)
            if swag:
                acc, acc_norm = evaluate_hellaswag(row_losses, params, cfg)
                say(f"step {step:5d} | hellaswag acc {acc:.4f} acc_norm {acc_norm:.4f}")
                if master:
                    log_event(cfg.out_dir, step=step, hellaswag_acc=acc, hellaswag_acc_norm=acc_norm)

        if cfg.eval_only:
            run_evals(params, step, True, True)
            return
        # the checkpoint is written before the step's evaluations: a run killed between the two resumes
        # by running the ones log.jsonl lacks (also where nothing is left to train). Process 0's log
        # decides for all: the others may not see it, and all must run the same evaluations.
        if cfg.resume:
            logged = logged_evals(cfg.out_dir, step) if master else set()
            missing = multihost_utils.broadcast_one_to_all(
                np.array([due(cfg.val_every, step, cfg.steps) and "val_loss" not in logged,
                          due(cfg.hellaswag_every, step, cfg.steps) and "hellaswag_acc" not in logged]))
            run_evals(params, step, bool(missing[0]), bool(missing[1]))
        if step >= cfg.steps:
            say(f"the checkpoint is at step {step} and --steps is {cfg.steps}: nothing to train")
            return

        t0 = time.perf_counter()
        compiled = compile_train_step(cfg, layout, step_batch, replicated, (params, m, v, copies),
                                      grad_accum)
        compile_s = time.perf_counter() - t0
        say(f"compiled train step in {compile_s:.1f} s (counted in the first step's time)")
        generate_jit = jax.jit(partial(generate, cfg=cfg))

        flops_per_token = model_flops_per_token(cfg, n_params)
        peak = peak_flops(devices[0].device_kind, cfg.dtype) if platform == "gpu" else None
        first = step + 1
        profile_steps = range(min(first + 1, cfg.steps), min(first + PROFILE_STEPS, cfg.steps) + 1)
        profile_dir = os.path.join(cfg.out_dir, "profile")
        times, spent = {}, 0.0  # spent: the summed step time, for --time-budget
        signals.training = True  # from here a signal stops the run at the end of a step
        for step in range(first, cfg.steps + 1):
            if cfg.profile and step == profile_steps[0]:
                jax.profiler.start_trace(profile_dir, create_perfetto_trace=True)
            with jax.profiler.StepTraceAnnotation("train_step", step_num=step):
                t0 = time.perf_counter()
                x, y = step_batches(train_loader, grad_accum)               # (A,rows,T) each
                scalars = place(recipe.scalars(step, cfg), replicated)
                params, m, v, copies, loss, norm = compiled(params, m, v, copies,
                                                            put_rows(step_batch, x),
                                                            put_rows(step_batch, y), scalars)
                loss, norm = float(loss), float(norm)  # waits for the device: dt spans the whole step
                # the ahead-of-time compile is the first step's, as torch.compile's is in the torch trainers:
                # --time-budget and the wall time of plot_runs.py then count every trainer's alike
                dt = time.perf_counter() - t0 + (compile_s if step == first else 0.0)
            times[step] = dt
            spent += dt
            if not (math.isfinite(loss) and math.isfinite(norm)):  # the same values in every process
                stop_diverged(step, loss, norm, cfg)
            # --time-budget and signals: all processes must stop at the same step, process 0's clock
            # deciding for all, and a signal to any process stopping all
            budget_spent, signum = bool(cfg.time_budget) and spent >= cfg.time_budget, signals.received
            if jax.process_count() > 1:
                flags = multihost_utils.process_allgather(np.array([budget_spent, signum], np.int32))
                budget_spent, signum = bool(flags[0, 0]), int(flags[:, 1].max())
            last = step if budget_spent or signum else cfg.steps
            if cfg.profile and step == profile_steps[-1]:
                jax.profiler.stop_trace()
                ms = [1000 * times[s] for s in profile_steps]
                say(f"profile: steps {profile_steps[0]}-{profile_steps[-1]} traced into {profile_dir} "
                    f"(Perfetto: the .trace.json.gz; TensorBoard: the .xplane.pb) | step time mean "
                    f"{np.mean(ms):.1f} ms, min {min(ms):.1f} ms, max {max(ms):.1f} ms")
            tokens_per_s = cfg.total_batch_size / dt
            mfu = flops_per_token * tokens_per_s / (peak * world) if peak else None
            lr, mem = lr_at(step - 1, cfg), peak_memory_gb(jax.local_devices())
            say(format_step(step, cfg, loss, norm, lr, 1000 * dt, tokens_per_s, mfu, mem))
            if master:
                log_event(cfg.out_dir, step=step, train_loss=loss, grad_norm=norm, lr=lr,
                          dt_ms=1000 * dt, tokens_per_s=tokens_per_s, mfu=mfu, peak_mem_gb=mem)
            # the checkpoint first: an evaluation that fails (a HellaSwag download, say) loses no training.
            # Every process gathers the whole tensors, one writes, the others wait for it.
            if due(cfg.ckpt_every, step, last):
                whole = gather_state((params, m, v))
                if master:
                    path = save_checkpoint(cfg.out_dir, step, *whole, train_loader.state(), cfg)
                    say(f"saved {path}")
                multihost_utils.sync_global_devices(f"checkpoint {step}")
            if signum:  # the step's evaluations are left to --resume, which runs those log.jsonl lacks
                stopped_by_signal(signum, step, cfg, master)
            run_evals(params, step, due(cfg.val_every, step, last),
                      due(cfg.hellaswag_every, step, last))
            if due(cfg.sample_every, step, last):
                key = jax.random.fold_in(jax.random.key(cfg.seed), step)
                for i, row in enumerate(np.asarray(generate_jit(params, key))):
                    text = encoder.decode([int(t) for t in row[1:]])
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
    # cuBLAS for every GPU matmul (NVIDIA's JAX containers set this too). On the H100 every matmul
    # here ran in cuBLAS anyway, yet with Triton matmuls enabled the biases were added in separate
    # passes; with them disabled XLA folds bias and GELU into cuBLASLt epilogues (seen in the H100
    # HLO compiled offline). Set before JAX starts its backend; an XLA_FLAGS naming it is left alone.
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_triton_gemm" not in xla_flags:
        os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_gpu_enable_triton_gemm=false".strip()
    main()
