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

Map: the file's sections, in order; the plumbing that every trainer shares (flags, llm.c's files, shards,
checkpoints and the out dir, log.jsonl, signals) is imported from trainkit/ (its __init__ lists it).
Delete `Recipe: speedrun` and GPT-2 trains as before.
    GPT-2: config                          Config, the Recipe row type, this trainer's own flags, parse_args
    GPT-2: model                           the forward, --recompute's reruns
    GPT-2: AdamW and the lr schedule       AdamW, clipping (llm.c's cosine schedule: trainkit.gpt2)
    GPT-2: training step                   micro-batch gradients, the step, activation bytes, RECIPES' row
    Recipe: speedrun                       modded-nanogpt's baseline: model, Muon, its row (trainkit.speedrun)
    Torchfunc plumbing: state, evaluation and profiles   make_state, HellaSwag, samples, --profile
    Main                                   the run, top to bottom
"""
import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import trainkit.flags
# the shared flags and what a recipe gives
from trainkit.flags import default_dtype, RunConfig, RunRecipe
# llm.c's GPT-2 without a framework: names, shapes, init, model files, schedule
from trainkit.gpt2 import (
    DECAY_NAMES, EOT, LAYER_NAMES, VOCAB_SIZE, configure_gpt2, cosine_lr, gpt2_shapes, init_gpt2_numpy,
    is_model_file, read_model_file, write_model_file)
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

FRAMEWORK = "torchfunc"  # "jax" | "triton-<backend>" in the siblings

# -----------------------------------------------------------------------------
# GPT-2: config


@dataclass
class Config(RunConfig):
    """The shared flags (RunConfig) and this trainer's own."""
    out_dir: str = f"out/gpt2_{FRAMEWORK}"
    # torch only: 1 = torch.compile (--compile defaults to 1 with CUDA, 0 on the CPU)
    compile: int = 1


@dataclass(frozen=True)
class Recipe(RunRecipe):
    """A row of RECIPES: what --recipe NAME trains (RunRecipe's fields, then this trainer's). The rest of
    the file looks a recipe up here, never by its name; each recipe's section ends by adding its row."""
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


def parse_args(argv=None):
    """(cfg, explicit): trainkit.flags.parse_args over this trainer's Config, RECIPES and flags."""
    return trainkit.flags.parse_args(argv, Config, RECIPES, ZERO_STAGES, __doc__, framework_flags)


def param_shapes(cfg):
    """{name: shape} of the recipe's weights, in the order of its model files."""
    return RECIPES[cfg.recipe].shapes(cfg)


# -----------------------------------------------------------------------------
# GPT-2: model


# The model is a pure function of a dict of weights. With --dtype bf16 those are bf16 copies of the fp32
# masters (made once per step by the optimizer, as train_gpt2_jax.py and llm.c do), except the embedding
# tables, which stay fp32 so that their scatter-add gradients are summed in fp32; the residual stream is
# bf16, and autocast runs LayerNorm in fp32 and casts what enters a matmul or the attention to bf16. The
# loss and its softmax are fp32. Autodiff is torch.func's; torch.compile fuses the rest.


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


def token_losses(params, x, y, cfg, train=False):
    """Per-token cross-entropy (B,T) in fp32 of targets y (B,T) given inputs x (B,T), over the first V
    columns (train: the training step's, the same here)."""
    return CrossEntropy.apply(forward(params, x, cfg), y)[0]                      # (B,T)


# -----------------------------------------------------------------------------
# GPT-2: AdamW and the lr schedule


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


NORM_PIECE = 1 << 18  # elements per piece of global_norm: 2 MiB fp64 temporaries, not a copy of wte


def global_norm(grads):
    """torch.nn.utils.clip_grad_norm_'s total norm: the L2 norm of the per-tensor L2 norms, accumulated in
    fp64: torch's fp32 norm kernels on the CPU are off by 1e-5 to 1e-4 relative at wte's 3M elements.
    Called outside torch.compile: one multi-tensor kernel, the same in compiled and eager runs. grads:
    {name: tensor}, all of them or (ZeRO-1) the pieces in this process's shard."""
    # a piece at a time: fp64 norms cast their input, and on the CPU a cast of a whole gradient is a new
    # tensor whose pages fault in, which takes longer than the sums
    pieces = [p for g in grads.values() for p in g.reshape(-1).split(NORM_PIECE)]
    norms = torch._foreach_norm(pieces, dtype=torch.float64)                       # n x ()
    return torch.linalg.vector_norm(torch.stack(norms)).float()                    # ()


def clip_coefficient(norm, cfg):
    """min(1, grad_clip / (norm + 1e-6)) as a device tensor (1 when clipping is off): no host sync."""
    if cfg.grad_clip > 0:
        return torch.clamp(cfg.grad_clip / (norm + 1e-6), max=1.0)                 # ()
    return torch.ones_like(norm)                                                   # ()


def clip_in_place(grads, coef, cfg):
    """The gradients (a list) times coef, in place, where --grad-clip clips (a static test: the same graph
    every step)."""
    if cfg.grad_clip > 0:
        torch._foreach_mul_(grads, coef)


def adam_step(p, g, m, v, lr, bias1, bias2, betas, eps, decay):
    """Adam's moments and step on lists of tensors, in place, as torch.optim.AdamW computes them: m =
    lerp(m, g, 1-b1), v = b2 v + (1-b2) g^2, p *= 1 - lr decay, p -= lr mhat / (sqrt(vhat) + eps) with
    mhat = m / bias1, vhat = v / bias2. Every op but the one that starts the denominator runs in place: on
    the CPU a new tensor costs a page fault per 4 KiB, which takes longer than the pass over it."""
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
    """llm.c's AdamW on every tensor, in place, with multi-tensor ops, on the gradients times coef (the
    clipping, which scales the gradients in place); weight decay only on DECAY_NAMES. Refreshes the
    compute-dtype copies from the new masters (compiled, in the same pass over the weights). The dicts
    hold whole tensors, or (ZeRO-1) the 1-D pieces of them in this process's shard."""
    lr, bias1, bias2 = scalars[0], scalars[1], scalars[2]
    clip_in_place(list(grads.values()), coef, cfg)
    betas = (ADAM_BETA1, ADAM_BETA2)
    for decays in (True, False):
        names = [k for k in grads if (k in DECAY_NAMES) == decays]
        if names:
            adam_step(*([d[k] for k in names] for d in (params, grads, m, v)), lr, bias1, bias2, betas,
                      ADAM_EPS, cfg.weight_decay if decays else 0.0)
    if copies is not None:
        torch._foreach_copy_(list(copies.values()), [params[k] for k in copies])

# -----------------------------------------------------------------------------
# GPT-2: training step


def loss_fn(params, x, y, cfg):
    """The loss one batch contributes, fp32: the recipe's mean token loss, or its sum (Recipe.summed)."""
    recipe = RECIPES[cfg.recipe]
    losses = recipe.token_losses(params, x, y, cfg, train=True)                    # (B,T)
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
    help="llm.c's GPT-2 and AdamW", defaults={}, configure=configure_gpt2,
    shapes=gpt2_shapes, init=init_gpt2_numpy, lr_at=cosine_lr, muon_names=lambda shapes: [],
    model_file="model.bin", file_kind="an llm.c model file (.bin)", is_file=is_model_file,
    read_file=read_model_file, write_file=write_model_file, model_name="GPT-2", table="wpe",
    optimizers="AdamW", activation_bytes=gpt2_activation_bytes,
    token_losses=token_losses, summed=False, scalars=adam_scalars, update=adamw_update,
    embeddings=EMBEDDINGS, next_logits=next_logits)}

# -----------------------------------------------------------------------------
# Recipe: speedrun

# the speedrun recipe without a framework: its config, shapes, init, lrs and model files
from trainkit.speedrun import (
    ATTN_SCALE, FP8_SCALES, HEAD_DIM, MUON_MOMENTUM, MUON_WEIGHT_DECAY, SOFTCAP, SPEEDRUN_BETA1,
    SPEEDRUN_BETA2, SPEEDRUN_DEFAULTS, SPEEDRUN_EPS, SPEEDRUN_HELP, SPEEDRUN_LRS, adamw_group,
    configure_speedrun, init_speedrun_numpy, is_safetensors_file, muon_names, read_speedrun_file, speedrun_lr,
    speedrun_lrs, speedrun_shapes, write_speedrun_file)
# --fp8-head's casts and FP8 products in torch
from trainkit.torch_shared import fp8_matmul, fp8_quantize

# -- config



# -- model

# The speedrun model, as the reference's GPT computes it: per-layer weights by their state_dict names, RMSNorm
# with the compute dtype's machine epsilon (F.rms_norm's default there, where the residual stream is bf16),
# rotary positions computed in fp32.


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
    # rows gathered from the fp32 table, so that its scatter-add gradient is summed in fp32; by F.embedding,
    # whose backward adds into one zeroed table (indexing's copies that table once more)
    x = F.rms_norm(F.embedding(idx, params["embed.weight"]).to(dt), (C,), params["norm1.gains"],
                   eps).to(dt)                                                     # (B,T,C)
    parts = [k[len("blocks.0."):] for k in params if k.startswith("blocks.0.")]  # a layer's weights' names
    for layer in range(cfg.n_layer):
        x = recomputed(lambda x, *ws: speedrun_block(x, dict(zip(parts, ws)), cfg), cfg, "block", [x],
                       [params[f"blocks.{layer}.{n}"] for n in parts])             # (B,T,C)
    return F.rms_norm(x, (C,), params["norm2.gains"], eps)                         # (B,T,C)


class FP8HeadMatmul(torch.autograd.Function):
    """(z, h_f8, W_f8): z (N,V) = h (N,C) W^T (W (V,C)) on --fp8-head's FP8 operands, in h's dtype
    (docs/FORMATS.md, FP8 head). The backward quantizes dz to e5m2: dh = dz_f8 W_f8 in h's dtype, dW =
    dz_f8^T h_f8 in fp32 (which autograd hands back in W's dtype, as every gradient here)."""

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
    """15 z / sqrt(z^2 + 15^2) in fp32 of the head's output z (..., V), in two new tensors, not five."""
    z = z.float()                                                                  # (..., V)
    r = z.square().add_(SOFTCAP**2).rsqrt_()                                       # (..., V)
    return torch.mul(z, SOFTCAP).mul_(r), r                                        # (..., V) each


def speedrun_logits(h, weight, bias):
    """The head's logits z = h W^T + b in fp32, soft-capped to 15 z / sqrt(z^2 + 15^2): (..., rows of W)."""
    return softcap(F.linear(h, weight, bias))[0]                                   # (..., V)


class SoftcapCrossEntropy(torch.autograd.Function):
    """Per-token loss (...,) in fp32 of the head's output z (..., Vp), soft-capped (softcap), over all Vp
    columns, and the logsumexp it used. The backward is dz = g (softmax(c) - onehot) dc/dz with dc/dz =
    15^3 / (z^2 + 15^2)^(3/2), formed in place in the two tensors of a softcap rerun; autodiff of the
    forward would make a new (..., Vp) fp32 tensor in each of its dozen ops (on the CPU a page fault per 4
    KiB of each). Keeps z alone."""

    @staticmethod
    def forward(z, targets):
        c = softcap(z)[0]                                                          # (..., Vp)
        # logsumexp, not F.cross_entropy: after the first step the ~50,000 unseen tokens' head rows are one
        # vector, so a row's logits are mostly equal, and the CPU log_softmax adds them in long running sums
        # whose rounding then piles up one way (up to 4e-5 off); torch.logsumexp's blocked sum does not
        lse = torch.logsumexp(c, -1)                                               # (...,)
        return lse - c.gather(-1, targets[..., None])[..., 0], lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[1], output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, g, _):
        z, targets, lse = ctx.saved_tensors
        dz, r = softcap(z)                                                         # (..., Vp) each
        dz.sub_(lse[..., None]).exp_()                                             # softmax (..., Vp)
        dz.scatter_add_(-1, targets[..., None], torch.full_like(lse[..., None], -1.0))  # minus the one-hot
        dz.mul_(g[..., None]).mul_(r.pow_(3).mul_(SOFTCAP**3))                     # (..., Vp)
        return dz.to(z.dtype), None


def speedrun_next_logits(params, tokens, t, cfg):
    """The logits (S,V) of the token after position t of tokens (S,T), for sampling."""
    with autocast(cfg, tokens.device):
        h = speedrun_transformer(params, tokens, cfg)[:, t]                        # (S,C)
        return speedrun_logits(h, params["proj.weight"][:VOCAB_SIZE], params["proj.bias"][:VOCAB_SIZE])


def speedrun_token_losses(params, x, y, cfg, train=False):
    """Per-token cross-entropy (B,T) in fp32, as the reference's: over all Vp columns (train: the training
    step's, whose head matmul is FP8HeadMatmul's with --fp8-head)."""
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
    """Muon on the matrices `names`, all of one shape (r,c), in place: the momentum buffer m = lerp(m, g,
    0.05), Nesterov's u = lerp(g, m, 0.95), orthogonalized by newton_schulz in `dtype` (batched over the
    matrices) and scaled by max(1, r/c)^0.5; p *= 1 - lr*wd, p -= lr*update."""
    g = [grads[k] for k in names]
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
    clip_in_place(list(grads.values()), coef, cfg)
    adam = [k for k in grads if k in v]
    for group in ("embed", "head", "vector"):
        names = [k for k in adam if adamw_group(k) == group]
        if names:
            speedrun_adamw(names, params, grads, m, v, lr[group], scalars[4], scalars[5], cfg.weight_decay)
    muon = [k for k in grads if k not in v]
    for shape in dict.fromkeys(params[k].shape for k in muon):
        speedrun_muon([k for k in muon if params[k].shape == shape], params, grads, m, lr["muon"],
                      compute_dtype(cfg))
    if copies is not None:
        torch._foreach_copy_(list(copies.values()), [params[k] for k in copies])


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
            + V * s          # the head's output z (B,T,Vp), which the loss keeps
            + 2 * V * 4)     # the loss's two fp32 temporaries (B,T,Vp): the logits and logsumexp's, or in
    #                          the backward 1/sqrt(z^2 + 15^2) and the logits turned into the gradient
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
    help=SPEEDRUN_HELP,
    defaults={**SPEEDRUN_DEFAULTS, "out_dir": f"out/speedrun_{FRAMEWORK}"}, configure=configure_speedrun,
    shapes=speedrun_shapes, init=init_speedrun_numpy, lr_at=speedrun_lr, muon_names=muon_names,
    model_file="model.safetensors",
    file_kind="a safetensors file of the reference's state_dict (.safetensors)",
    is_file=is_safetensors_file, read_file=read_speedrun_file, write_file=write_speedrun_file,
    model_name="speedrun GPT", table="embed.weight", optimizers="AdamW and Muon",
    activation_bytes=speedrun_activation_bytes,
    token_losses=speedrun_token_losses, summed=True, scalars=speedrun_scalars, update=speedrun_update,
    embeddings=("embed.weight",), next_logits=speedrun_next_logits)

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
    muon = RECIPES[cfg.recipe].muon_names(shapes)
    layout = state_layout(compute_groups(cfg), muon, shapes, world)
    state = flat_gradients(shapes, layout, device)
    if cfg.zero_stage == 0:
        return whole_state(state, params, m, v, cfg, device)
    return sharded_state(state, params, m, v, shapes, layout, muon, device, rank, world)


def whole_state(state, params, m, v, cfg, device):
    """Stage 0: a process's shard is the whole model. It holds all of the fp32 masters `params`, their
    bf16 `copies` and the moments m, v; one all-reduce sums the gradients, and it updates every weight."""
    state.update(params=to_device(params, device), m=to_device(m, device), v=to_device(v, device))
    state["copies"] = compute_copies(state["params"], cfg)  # refreshed by every update from then on
    state["weights"] = model_weights(state["params"], state["copies"])
    state.update(shard_params=state["params"], shard_grads=state["grads"], shard_copies=state["copies"])
    return state


def device_state_bytes(cfg, shapes, world):
    """Bytes of weights, gradients and optimizer state that one process holds (make_state's tensors, not
    the activations), by kind: state_bytes of this trainer's layout."""
    muon = RECIPES[cfg.recipe].muon_names(shapes)
    layout = state_layout(compute_groups(cfg), muon, shapes, world)
    return state_bytes(cfg.zero_stage, shapes, layout, muon, world)


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

    # weights, optimizer state, data (each process reads B rows of a micro-batch) and the locked out dir
    step, params, m, v, grad_accum, train_loader, val_loader, encoder, lock = open_run(  # noqa: F841
        cfg, explicit, RECIPES, cfg.batch_size, rank, world, master, say, any_process_failed(world, device))

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
    say(f"batch: {cfg.batch_size} x {cfg.seq_len} tokens x {world} devices x {grad_accum} micro-batches = "
        f"{cfg.total_batch_size} tokens per step | data: {cfg.data}")
    held = device_state_bytes(cfg, param_shapes(cfg), world)
    activations = RECIPES[cfg.recipe].activation_bytes(cfg)
    say(format_memory(cfg, held, activations, world, RECIPES[cfg.recipe].optimizers))
    warning = device.type == "cpu" and memory_warning(held, activations, world, host_memory_available())
    if warning:  # on a GPU, running out is an error the trainer reports (fail_on_out_of_memory)
        say(warning)
    if master:
        log_event(cfg.out_dir, FRAMEWORK, **start_event(cfg, step, world, held, activations))

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
        if cfg.resume:  # the evaluations of its step that log.jsonl lacks (evals_left_to_run)
            run_evals(step, *evals_left_to_run(cfg, step, master, world))
        if step >= cfg.steps:
            say(f"the checkpoint is at step {step} and --steps is {cfg.steps}: nothing to train")
            return

        # compiled on the first call, that is inside step 1: its time is reported as compile time
        grad_fn = compile_(grads_and_loss, fullgraph=True)
        update_fn = compile_(recipe.update, fullgraph=True)

        flops_per_token = model_flops_per_token(cfg, n_params)
        peak = peak_flops(device_kind, cfg.dtype) if device.type == "cuda" else None
        flops = (flops_per_token, peak * world if peak else None)  # per token; the devices' peak per s
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
            report_step(step, cfg, loss, norm, RECIPES[cfg.recipe].lr_at(step - 1, cfg), dt, peak_memory_gb(device), flops,
                        FRAMEWORK, master, say)
            # the checkpoint before a signal's stop and the evaluations (--resume runs those log.jsonl lacks)
            checkpoint_if_due(state, step, last, train_loader, cfg, RECIPES[cfg.recipe], world, master, say)
            stop_on_signal(signum, step, cfg, master)
            run_evals(step, due(cfg.val_every, step, last), due(cfg.hellaswag_every, step, last))
            say_samples(lambda g: generate(weights, g, cfg), cfg, step, last, device, encoder and encoder.decode,
                        master, say)
            if budget_spent:
                say(f"--time-budget {cfg.time_budget:g} s reached: stopped after step {step} of {cfg.steps}")
                break

    say(format_mean(times, first, profile_steps if cfg.profile else (), cfg, flops))


if __name__ == "__main__":
    main()
