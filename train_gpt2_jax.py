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

Map: the file's sections, in order; the plumbing that every trainer shares (flags, llm.c's files, shards,
checkpoints and the out dir, log.jsonl, signals) is imported from trainkit/ (its __init__ lists it).
Delete `Recipe: speedrun` and GPT-2 trains as before.
    GPT-2: config                          Config, the Recipe row type, this trainer's own flags, parse_args
    GPT-2: model                           the forward and its loss
    GPT-2: AdamW and the lr schedule       AdamW (llm.c's cosine schedule: trainkit.gpt2)
    GPT-2: training step                   the jitted step, GPT-2's row of RECIPES
    Recipe: speedrun                       modded-nanogpt's baseline: model, Muon, its row (trainkit.speedrun)
    JAX plumbing: devices, processes, ZeRO state and evaluation   shardings, HellaSwag, samples, processes
    Main                                   the run, top to bottom
"""
import contextlib
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import distributed as jax_distributed
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import hellaswag
import trainkit.flags
# the one-line error
from trainkit import die, die_out_of_memory
# the shared flags and what a recipe gives
from trainkit.flags import default_dtype, RunConfig, RunRecipe
# llm.c's GPT-2 without a framework: names, shapes, init, model files, schedule
from trainkit.gpt2 import (
    DECAY_NAMES, EOT, LAYER_NAMES, PARAM_NAMES, VOCAB_SIZE, configure_gpt2, cosine_lr, gpt2_shapes,
    init_gpt2_numpy, is_model_file, read_model_file, write_model_file)
# llm.c's token shards and loader
from trainkit.data import step_batches, val_batches
# checkpoints and the out dir
from trainkit.checkpoints import open_run, save_checkpoint
# log.jsonl, the step and memory lines, MFU
from trainkit.logs import (
    PROFILE_STEPS, SAMPLE_COUNT, SAMPLE_TOKENS, TOP_K, due, format_mean, format_memory,
    host_memory_available, log_event, logged_evals, memory_warning, model_flops_per_token, peak_flops,
    report_step, start_event)
# signals and the divergence stop
from trainkit.signals import stop_diverged, stop_on_signal, stops_on_signals

FRAMEWORK = "jax"  # "torchfunc" | "triton-<backend>" in the siblings

# -----------------------------------------------------------------------------
# GPT-2: config


@dataclass
class Config(RunConfig):
    """The shared flags (RunConfig) and this trainer's own."""
    out_dir: str = f"out/gpt2_{FRAMEWORK}"
    # JAX only
    attn: str = "auto"
    scan_layers: bool = False
    coordinator: str = ""    # several processes: host:port of process 0 (else JAX_COORDINATOR_ADDRESS)
    num_processes: int = 0   # 0: from the environment (JAX_NUM_PROCESSES, srun, mpirun), else 1
    process_id: int = -1     # -1: from the environment (JAX_PROCESS_ID, srun, mpirun)
    coordinator_timeout: int = 300  # seconds the processes wait for each other to join, then stop


@dataclass(frozen=True)
class Recipe(RunRecipe):
    """A row of RECIPES: what --recipe NAME trains (RunRecipe's fields, then this trainer's). The rest of
    the file looks a recipe up here, never by its name; each recipe's section ends by adding its row."""
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
    p.add_argument("--coordinator",
                   help="several processes: HOST:PORT of process 0, an IPv6 host in [brackets] (default: "
                   "$JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int,
                   help="processes in the run (default: $JAX_NUM_PROCESSES, or what srun/mpirun set, else 1)")
    p.add_argument("--process-id", type=int,
                   help="this process's rank, 0 .. processes-1 (default: $JAX_PROCESS_ID, or srun/mpirun's)")
    p.add_argument("--coordinator-timeout", type=int, help="several processes: seconds each waits for all "
                   f"to join at the coordinator before it stops (default {Config.coordinator_timeout})")


def parse_args(argv=None):
    """(cfg, explicit): trainkit.flags.parse_args over this trainer's Config, RECIPES and flags."""
    return trainkit.flags.parse_args(argv, Config, RECIPES, ZERO_STAGES, __doc__, framework_flags)


def param_shapes(cfg):
    """{name: shape} of the recipe's weights, in the order of its model files."""
    return RECIPES[cfg.recipe].shapes(cfg)


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


def logsumexp_one_pass(x):
    """fp32 logsumexp over the last axis in one read of x (an online softmax as a variadic reduction)."""
    def combine(a, b):  # two partials (running max, sum of exp(x - max)) merged with one exp
        (ma, sa), (mb, sb) = a, b
        e = jnp.exp(-jnp.abs(ma - mb))  # exp(smaller max - larger max)
        return jnp.maximum(ma, mb), jnp.where(ma >= mb, sa + sb * e, sa * e + sb)
    xf = x.astype(jnp.float32)                                                     # (..., V)
    lowest = jnp.finfo(jnp.float32).min  # finite, so merging two empty partials gives no inf - inf
    m, s = jax.lax.reduce((xf, jnp.ones_like(xf)), (jnp.float32(lowest), jnp.float32(0.0)),
                          combine, (x.ndim - 1,))                             # (...,) each
    return m + jnp.log(s)                                                          # (...,)


@jax.custom_vjp
def cross_entropy(logits, targets):
    """Per-token fp32 loss (...,) of logits (..., Vp) over the first V columns; llm.c's fused backward."""
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
    return jnp.where(col < VOCAB_SIZE, dlogits, 0.0).astype(logits.dtype), None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def linear(x, w, b):
    """x (..., in) @ w (out, in).T + b (out), named "matmul" for --recompute pointwise."""
    return checkpoint_name(x @ w.T + b, "matmul")                                  # (..., out)


def attention(q, k, v, cfg):
    """Causal self-attention of q, k, v (B,T,C) -> (B,T,C): cuDNN's flash attention (--attn cudnn) or XLA's."""
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
    # three matmuls give three contiguous q, k, v (slicing one (B,T,3C) product copies); the barrier
    # stops XLA merging them back, which would add the biases in a pass of its own, not in cuBLAS's epilogue
    hs = jax.lax.optimization_barrier((h, h, h))                                   # 3 x (B,T,C)
    q, k, v = (linear(hs[i], lp["c_attn.w"][i * C:(i + 1) * C], lp["c_attn.b"][i * C:(i + 1) * C])
               for i in range(3))                                                  # (B,T,C) each
    x = x + linear(attention(q, k, v, cfg), lp["attn.c_proj.w"], lp["attn.c_proj.b"])  # (B,T,C)
    h = layernorm(x, lp["ln_2.w"], lp["ln_2.b"])                                  # (B,T,C)
    h = gelu(linear(h, lp["c_fc.w"], lp["c_fc.b"]))                               # (B,T,4C)
    return x + linear(h, lp["mlp.c_proj.w"], lp["mlp.c_proj.b"])                  # (B,T,C)


# --recompute as the jax.checkpoint policy around each block: pointwise keeps the matmuls' and the
# attention's outputs (the rest reruns in the backward), block keeps only each block's input
RECOMPUTE_POLICIES = {"none": None,
                      "pointwise": jax.checkpoint_policies.save_only_these_names("matmul", "attention"),
                      "block": jax.checkpoint_policies.nothing_saveable}


def recomputed(block_fn, cfg):
    """block_fn(x, weights) -> x, its backward keeping what cfg.recompute keeps."""
    policy = RECOMPUTE_POLICIES[cfg.recompute]
    if policy is None:
        return block_fn
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

# -----------------------------------------------------------------------------
# GPT-2: training step

def loss_fn(params, x, y, cfg):
    """One batch's fp32 loss: the recipe's mean token loss, or its sum (Recipe.summed)."""
    recipe = RECIPES[cfg.recipe]
    losses = recipe.token_losses(params, x, y, cfg, train=True)                    # (B,T)
    return jnp.sum(losses) if recipe.summed else jnp.mean(losses)


EMBEDDINGS = ("wte", "wpe")  # the model gathers rows from them in fp32: no compute-dtype copies


def train_step(params, m, v, copies, x, y, scalars, cfg, layout):
    """One optimizer step on A micro-batches x, y (A,B,T), state placed by `layout` (copies: stage 1's bf16
    weights, else {}) -> (params, m, v, copies, mean token loss, grad norm before clipping)."""
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
    block = {  # per block
        "none": (2 * N * C * d               # ln_1's input x and output (B,T,C) (the barrier's 3 are one)
                 + 3 * N * C * d             # q, k, v (B,T,C)
                 + attention_bytes(cfg, cfg.n_head)
                 + N * C * d                 # the attention's output (B,T,C), attn.c_proj's input
                 + 2 * N * C * d             # ln_2's input and output (B,T,C)
                 + 2 * N * 4 * C * d),       # c_fc's output and GELU's output (B,T,4C)
        "pointwise": (N * C * d              # the block's input x (B,T,C)
                      + 3 * N * C * d        # q, k, v (B,T,C)
                      + 2 * N * C * d        # the attention's and attn.c_proj's outputs (B,T,C)
                      + N * 4 * C * d),      # c_fc's output (B,T,4C)
        "block": N * C * d,                  # the block's input x (B,T,C)
    }[cfg.recompute]
    head = (2 * N * C * d                    # ln_f's input and output (B,T,C)
            + N * cfg.padded_vocab_size * d)  # the logits (B,T,Vp), the cross-entropy's backward's input
    return cfg.n_layer * block + head


RECIPES = {"gpt2": Recipe(
    help="llm.c's GPT-2 and AdamW", defaults={}, configure=configure_gpt2,
    shapes=gpt2_shapes, init=init_gpt2_numpy, lr_at=cosine_lr, muon_names=lambda shapes: [],
    model_file="model.bin", file_kind="an llm.c model file (.bin)", is_file=is_model_file,
    read_file=read_model_file, write_file=write_model_file, model_name="GPT-2", table="wpe",
    optimizers="AdamW", activation_bytes=gpt2_activation_bytes,
    token_losses=token_losses, summed=False, scalars=adam_scalars,
    update=lambda params, grads, m, v, scalars, cfg, layout: adamw_update(params, grads, m, v, scalars, cfg),
    embeddings=EMBEDDINGS, next_logits=next_logits, scan_layers=True)}

# -----------------------------------------------------------------------------
# Recipe: speedrun

# the speedrun recipe without a framework: its config, shapes, init, lrs and model files
from trainkit.speedrun import (
    ATTN_SCALE, FP8_FORMATS, FP8_MAX, FP8_SCALES, HEAD_DIM, MUON_MOMENTUM, MUON_WEIGHT_DECAY,
    NEWTON_SCHULZ_STEPS, SOFTCAP, SPEEDRUN_BETA1, SPEEDRUN_BETA2, SPEEDRUN_DEFAULTS, SPEEDRUN_EPS,
    SPEEDRUN_HELP, SPEEDRUN_LRS, adamw_group, configure_speedrun, fp8_reciprocal, init_speedrun_numpy,
    is_safetensors_file, muon_names, read_speedrun_file, speedrun_lr, speedrun_lrs, speedrun_shapes,
    write_speedrun_file)

# -- config



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
    y = jax.nn.dot_product_attention(q, k, v, scale=ATTN_SCALE, is_causal=True,
                                     implementation="cudnn" if cfg.attn == "cudnn" else "xla")  # (B,T,H,D)
    y = checkpoint_name(y.reshape(B, T, C), "attention")                           # (B,T,C)
    x = x + linear(y, w["attn.proj.weight"], w["attn.proj.bias"])                 # (B,T,C)
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
    """The reference's orthogonalization of each matrix G (n,r,c) -> (n,r,c) in `dtype`: from X = G/||G||_F,
    X <- 2X + (-1.5 A + 0.5 A^2) X with A = X X^T (on tall matrices' transposes, so that A is the smaller)."""
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
    """Muon on the matrices `names`, all of shape (r,c), orthogonalized in `dtype` and dealt over the
    devices by the sharding `deal` when their count divides -> ({name: new p}, {name: new m})."""
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


def speedrun_update(params, grads, m, v, scalars, cfg, layout):
    """AdamW on the tensors v holds, each group at its lr, Muon on the rest -> new (params, m, v)."""
    lr = {group: scalars[i] for i, group in enumerate(SPEEDRUN_LRS)}
    new_params, new_m, new_v = {}, {}, {}
    for k in v:
        new_params[k], new_m[k], new_v[k] = speedrun_adamw(params[k], grads[k], m[k], v[k], lr[adamw_group(k)],
                                                           scalars[4], scalars[5], cfg.weight_decay)
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
                      + 2 * N * C * d        # the attention's and attn.proj's outputs (B,T,C)
                      + N * 4 * C * d),      # mlp.fc's output (B,T,4C)
        "block": N * C * d,                  # the block's input x (B,T,C)
    }[cfg.recompute]
    head = (N * C * 3 * 4                    # the embedding's RMSNorm, less its output (block 0's input)
            + norm                           # the final RMSNorm
            + 3 * N * cfg.padded_vocab_size * 4)  # the logits before the cap, its rsqrt, the softmax's exp
    return cfg.n_layer * block + head


RECIPES["speedrun"] = Recipe(
    help=SPEEDRUN_HELP,
    defaults={**SPEEDRUN_DEFAULTS, "out_dir": f"out/speedrun_{FRAMEWORK}"}, configure=configure_speedrun,
    shapes=speedrun_shapes, init=init_speedrun_numpy, lr_at=speedrun_lr, muon_names=muon_names,
    model_file="model.safetensors", file_kind="a safetensors file of the reference's state_dict (.safetensors)",
    is_file=is_safetensors_file, read_file=read_speedrun_file, write_file=write_speedrun_file,
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
    if cfg.zero_stage != 1 or cfg.dtype == "fp32":
        return []
    return [k for k in param_shapes(cfg) if k not in RECIPES[cfg.recipe].embeddings]


def cast_copies(params, names, cfg):
    """{name: params[name] in the compute dtype} for `names`: stage 1's copies."""
    return {k: params[k].astype(compute_dtype(cfg)) for k in names}


def state_layout(cfg, mesh):
    """{piece: {name: NamedSharding}} at cfg.zero_stage for "masters", "grads", "moments", "copies" and
    "weights" (a step's compute copies, whole); "matrices": how Muon deals its stacks (None at stage 0)."""
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
    loader.reset()
    total = 0.0
    for counted in val_batches(cfg, loader):
        x, y = loader.next_batch()                                                 # (B,T) each
        total += float(loss_sum_jit(params, put(x), put(y), counted))
    return total / (cfg.val_tokens // cfg.seq_len)


def evaluate_hellaswag(losses_jit, params, cfg):
    """(acc, acc_norm) through hellaswag.evaluate; every process runs it, process 0 alone reports."""
    def padded_losses(x, y):                                                       # (4, width) int64 each
        return np.asarray(losses_jit(params, x.astype(np.int32), y.astype(np.int32)))  # (4, width)
    return hellaswag.evaluate(hellaswag.in_context(padded_losses, cfg.block_size), limit=cfg.hellaswag_limit,
                              progress=jax.process_index() == 0)


def generate(params, key, cfg):
    """SAMPLE_COUNT continuations of EOT with top-k TOP_K: token ids (S,T) int32, column 0 = EOT (no KV cache)."""
    T = min(cfg.block_size, SAMPLE_TOKENS + 1)
    tokens = jnp.zeros((SAMPLE_COUNT, T), jnp.int32).at[:, 0].set(EOT)            # (S,T)

    def sample_next(t, carry):                                                     # token t+1 from 0..t
        tokens, key = carry
        logits = RECIPES[cfg.recipe].next_logits(params, tokens, t, cfg)          # (S,V)
        top_logits, top_ids = jax.lax.top_k(logits, TOP_K)                        # (S,K) each
        key, sub = jax.random.split(key)
        choice = jax.random.categorical(sub, top_logits, axis=-1)                 # (S,)
        return tokens.at[:, t + 1].set(top_ids[jnp.arange(SAMPLE_COUNT), choice]), key

    tokens, _ = jax.lax.fori_loop(0, T - 1, sample_next, (tokens, key))
    return tokens


def device_state_bytes(cfg, shapes, world):
    """Bytes of training state one of `world` devices holds for the tensors of `shapes`, split as
    state_layout splits them: {"params" (stage 1's copies), "grads", "masters", "moments"}."""
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
def fail_on_out_of_memory(cfg):
    """Running out of device memory (at compile or run time): one line, no trace."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        die_out_of_memory(cfg, e)


@contextlib.contextmanager
def fail_on_lost_peer():
    """A collective failed by a lost process: each survivor names it in one line and exits at once
    (jax.distributed's shutdown would wait ~90 s on it, then abort); other errors pass through."""
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
            deadline = time.monotonic() + 5
            silent = list(range(world))
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
    """Joins the processes of a multi-host run (jax.distributed) before anything touches a device; the
    coordinator, count and rank from the flags, else $JAX_*, else srun's or mpirun's environment."""
    def env_int(name, default):
        text = os.environ.get(name, "")
        try:
            return int(text) if text else default
        except ValueError:
            die(f"${name} is {text!r}, not an integer")

    def port_of(address, source):
        # jax takes a malformed address for a crash or a silent hang
        host, _, port = address.rpartition(":")
        inner = host[1:-1] if host[:1] == "[" and host[-1:] == "]" else host
        if not inner or (inner == host and ":" in host) or "[" in inner or "]" in inner:
            die(f"{source} {address!r}: expected HOST:PORT (an IPv6 host in [brackets])")
        if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            die(f"{source} {address!r}: the port must be a number in 1-65535")
        return port

    def join(coordinator, n, rank, waiting, check):
        print(waiting, flush=True)
        # jax's own deadline ends in a C++ abort that Python cannot catch: a timer thread ends the process first
        def give_up():
            os.write(2, f"error: the processes did not all join within {cfg.coordinator_timeout} s "
                        f"(--coordinator-timeout): {check}\n".encode())
            os._exit(1)
        timer = threading.Timer(cfg.coordinator_timeout, give_up)
        timer.start()
        # jax's preemption notifier would swallow SIGTERM: trainkit.signals' handler stops every process instead
        jax.config.update("jax_enable_preemption_service", False)
        try:
            jax.distributed.initialize(coordinator, n, rank, initialization_timeout=cfg.coordinator_timeout + 60)
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
        die(f"--process-id {cfg.process_id} needs --num-processes (or $JAX_NUM_PROCESSES), the count it is a rank of")
    if cfg.process_id >= n:
        source = "--num-processes" if cfg.num_processes else "$JAX_NUM_PROCESSES"
        die(f"--process-id {cfg.process_id} is out of range: {source} {n} needs it in [0, {n})")
    if n == 1 or (n == 0 and launched <= 1):
        return
    if n == 0:  # srun / mpirun: JAX finds the coordinator, count, rank and local devices itself
        if cfg.coordinator:
            port_of(cfg.coordinator, "--coordinator")
        join(cfg.coordinator or None, None, None, f"waiting up to {cfg.coordinator_timeout} s for the {launched} "
             "processes of this srun/mpirun launch to join",
             "check that all of them started, that their hosts reach process 0's (firewalls), and that none got "
             "another --coordinator or --num-processes")
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
        # on a port already taken jax often segfaults instead of raising: bind it here first (as gRPC does)
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", int(port)))
            except OSError as e:
                die(f"{source} {coordinator}: process 0 cannot listen on port {port} here ({e.strerror}): another "
                    "run, or an earlier process 0 still running, may hold it; stop that or pick another port")
    if rank == 0:
        waiting = f"for processes 1 .. {n - 1} to join the coordinator it starts at {coordinator}"
        check = (f"check that processes 1 .. {n - 1} started with --coordinator {coordinator} and "
                 f"--num-processes {n}, each with its own --process-id, and that their hosts reach port "
                 f"{port} here (firewalls)")
    else:
        waiting = f"for the coordinator at {coordinator} (process 0 must start too)"
        check = (f"check that process 0 runs and listens at {coordinator} (that host, that port), that no firewall "
                 f"blocks port {port} between the hosts, and that every process got --num-processes {n}")
    join(coordinator, n, rank, f"process {rank} of {n}: waiting up to {cfg.coordinator_timeout} s {waiting}", check)


def place(tree, shardings):
    """Host arrays whole on every process -> global device arrays laid out as `shardings` (a matching tree)."""
    return jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, lambda index: a[index]),
                        tree, shardings)


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

    def log(**fields):
        if master:
            log_event(cfg.out_dir, FRAMEWORK, **fields)

    cfg.attn = resolve_attention(cfg, platform)

    # the weights and optimizer state, the loaders (of this process's devices' rows), the out dir (locked)
    rows = cfg.batch_size * jax.local_device_count()
    any_failed = None if ranks == 1 else (  # True in every process when any passes True
        lambda failed: bool(multihost_utils.process_allgather(np.array(int(failed), np.int32)).max()))
    step, params, m, v, grad_accum, train_loader, val_loader, encoder, lock = open_run(  # noqa: F841
        cfg, explicit, RECIPES, rows, rank, ranks, master, say, any_failed)

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
    log(**start_event(cfg, step, world, held, activations))

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

        t0 = time.perf_counter()
        compiled = compile_train_step(cfg, layout, step_batch, replicated, (params, m, v, copies), grad_accum)
        compile_s = time.perf_counter() - t0
        say(f"compiled train step in {compile_s:.1f} s (counted in the first step's time)")
        generate_jit = jax.jit(partial(generate, cfg=cfg))

        peak = peak_flops(devices[0].device_kind, cfg.dtype) if platform == "gpu" else None
        flops = (model_flops_per_token(cfg, n_params), peak * world if peak else None)  # per token; peak per s
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
                x, y = step_batches(train_loader, grad_accum)                      # (A,rows,T) each
                scalars = place(recipe.scalars(step, cfg), replicated)
                params, m, v, copies, loss, norm = compiled(params, m, v, copies, put_rows(step_batch, x),
                                                            put_rows(step_batch, y), scalars)
                loss, norm = float(loss), float(norm)  # waits for the device: dt spans the whole step
                # the ahead-of-time compile counts in the first step, as torch.compile's does in the torch trainers
                dt = time.perf_counter() - t0 + (compile_s if step == first else 0.0)
            times[step] = dt
            spent += dt
            if not (math.isfinite(loss) and math.isfinite(norm)):  # the same values in every process
                stop_diverged(step, loss, norm, cfg)
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
                    path = save_checkpoint(cfg.out_dir, step, *whole, train_loader.state(), cfg, recipe)
                    say(f"saved {path}")
                multihost_utils.sync_global_devices(f"checkpoint {step}")
            stop_on_signal(signum, step, cfg, master)  # --resume runs the step's evaluations log.jsonl lacks
            run_evals(params, step, due(cfg.val_every, step, last), due(cfg.hellaswag_every, step, last))
            if due(cfg.sample_every, step, last):
                key = jax.random.fold_in(jax.random.key(cfg.seed), step)
                for i, row in enumerate(np.asarray(generate_jit(params, key))):
                    say(f"sample {i}: {encoder.decode([int(t) for t in row[1:]])!r}")
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
