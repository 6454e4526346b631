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


def differentiated(tensors):
    """Whether autograd records what is computed from tensors (else there is no backward to rerun for)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def linears(pre, x, pre_args, pairs, cfg):
    """[F.linear(pre(x, *pre_args), w, b) for (w, b) in pairs]; at --recompute pointwise by LinearsAfter."""
    tensors = [x, *pre_args, *[t for pair in pairs for t in pair]]
    if cfg.recompute == "pointwise" and differentiated(tensors):
        return LinearsAfter.apply(pre, cfg, len(pre_args), *tensors)
    h = pre(x, *pre_args)                                                          # (B,T,Cin)
    return [F.linear(h, w, b) for w, b in pairs]                                   # (B,T,Cout) each


def recomputed(f, cfg, level, acts, weights=()):
    """f(*acts, *weights); at --recompute `level` by Recomputed."""
    if cfg.recompute == level and differentiated([*acts, *weights]):
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
    T = idx.shape[1]
    # rows gathered from the fp32 tables, so the embeddings' scatter-add gradient is summed in fp32
    x = (params["wte"][idx] + params["wpe"][:T]).to(compute_dtype(cfg))            # (B,T,C)
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
    if cfg.dtype == "fp32":
        return None
    return {k: p.to(torch.bfloat16) for k, p in params.items() if k not in RECIPES[cfg.recipe].embeddings}


def model_weights(params, copies):
    """The tensors the model computes with: the masters, replaced by their copies where there are any."""
    return params if copies is None else {**params, **copies}


def global_norm(grads):
    """The L2 norm (clip_grad_norm_'s) of {name: gradient}, all of them or a ZeRO-1 shard's, in fp64."""
    # fp64: torch's fp32 CPU norms are 1e-5 off at wte's size; in 2 MiB pieces: a cast of wte pages in slowly
    pieces = [p for g in grads.values() for p in g.reshape(-1).split(1 << 18)]
    norms = torch._foreach_norm(pieces, dtype=torch.float64)                       # n x ()
    return torch.linalg.vector_norm(torch.stack(norms)).float()                    # ()


def clip_in_place(grads, coef, cfg):
    """The gradients (a list) times coef, in place, where --grad-clip clips (the same graph every step)."""
    if cfg.grad_clip > 0:
        torch._foreach_mul_(grads, coef)


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
    lr, bias1, bias2 = scalars[0], scalars[1], scalars[2]
    clip_in_place(list(grads.values()), coef, cfg)
    for decays in (True, False):
        names = [k for k in grads if (k in DECAY_NAMES) == decays]
        if names:
            adam_step(*([d[k] for k in names] for d in (params, grads, m, v)), lr, bias1, bias2,
                      (ADAM_BETA1, ADAM_BETA2), ADAM_EPS, cfg.weight_decay if decays else 0.0)
    if copies is not None:
        torch._foreach_copy_(list(copies.values()), [params[k] for k in copies])

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
            first, end = group["span"]
            dist.reduce_scatter_single(group["grads"], state["grad_buffer"][first:end])
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


def rotary(x):
    """The reference's half-truncated rotary embedding of q or k (B,T,H,D): the halves' first D/4 pairs turn."""
    T, D = x.shape[1], x.shape[3]
    freq = (1 / 1024) ** torch.linspace(0, 1, D // 4, dtype=torch.float32, device=x.device)  # (D/4,)
    freq = torch.cat([freq, freq.new_zeros(D // 4)])                                # (D/2,)
    t = torch.arange(T, dtype=torch.float32, device=x.device)                      # (T,)
    theta = torch.outer(t, freq)[None, :, None]                                    # (1,T,1,D/2)
    cos, sin = theta.cos(), theta.sin()                                            # (1,T,1,D/2) each
    x1, x2 = x.float().chunk(2, dim=-1)                                            # (B,T,H,D/2) each
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), -1).type_as(x)   # (B,T,H,D)


def speedrun_attention(q, k, v, cfg):
    """Causal attention (B,T,C) of q, k, v (B,T,H,D), after q's and k's RMSNorm and rotary."""
    B, T, H, D = q.shape
    eps = torch.finfo(compute_dtype(cfg)).eps
    q, k = (rotary(F.rms_norm(t, (D,), eps=eps)) for t in (q, k))                 # (B,T,H,D) each
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       scale=ATTN_SCALE, is_causal=True)           # (B,H,T,D)
    return y.transpose(1, 2).reshape(B, T, H * D)                                  # (B,T,C)


def speedrun_block(x, w, cfg):
    """The reference's pre-norm block, with one layer's weights w (the names after blocks.<layer>.)."""
    B, T, C = x.shape
    H, D = C // HEAD_DIM, HEAD_DIM

    def rms_norm(x, gains):
        return F.rms_norm(x, (C,), gains, torch.finfo(compute_dtype(cfg)).eps)
    q, k, v = (t.view(B, T, H, D) for t in linears(
        rms_norm, x, (w["norm1.gains"],), [(w[f"attn.{n}.weight"], w[f"attn.{n}.bias"]) for n in "qkv"],
        cfg))                                                                      # (B,T,H,D) each
    # at --recompute pointwise the attention reruns too: its backward needs the q/k norms' rerun outputs
    y = recomputed(functools.partial(speedrun_attention, cfg=cfg), cfg, "pointwise", [q, k, v])  # (B,T,C)
    x = x + F.linear(y, w["attn.proj.weight"], w["attn.proj.bias"])                # (B,T,C)
    h, = linears(rms_norm, x, (w["norm2.gains"],), [(w["mlp.fc.weight"], w["mlp.fc.bias"])], cfg)  # (B,T,4C)
    h, = linears(lambda h: F.relu(h).square(), h, (), [(w["mlp.proj.weight"], w["mlp.proj.bias"])],
                 cfg)                                                              # (B,T,C)
    return x + h                                                                   # (B,T,C)


def speedrun_transformer(params, idx, cfg):
    """Token ids idx (B,T) -> hidden states (B,T,C) after the final RMSNorm (call under autocast(cfg))."""
    C, dt = cfg.n_embd, compute_dtype(cfg)
    eps = torch.finfo(dt).eps
    # rows of the fp32 table by F.embedding, whose backward adds into one zeroed table (indexing copies it)
    x = F.rms_norm(F.embedding(idx, params["embed.weight"]).to(dt), (C,), params["norm1.gains"],
                   eps).to(dt)                                                     # (B,T,C)
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
    clip_in_place(list(grads.values()), coef, cfg)
    for group in ("embed", "head", "vector"):
        names = [k for k in grads if k in v and adamw_group(k) == group]
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
    muon_names=muon_names, model_file="model.safetensors",
    file_kind="a safetensors file of the reference's state_dict (.safetensors)", is_file=is_safetensors_file,
    read_file=read_speedrun_file, write_file=write_speedrun_file, model_name="speedrun GPT",
    table="embed.weight", optimizers="AdamW and Muon", activation_bytes=speedrun_activation_bytes,
    token_losses=speedrun_token_losses, summed=True, scalars=speedrun_scalars, update=speedrun_update,
    embeddings=("embed.weight",), next_logits=speedrun_next_logits)


# -----------------------------------------------------------------------------
# Torchfunc plumbing: state, evaluation and profiles

def compute_groups(cfg):
    """[(names, dtype)] of the tensors the model computes with, each group a stretch of the flat buffers."""
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
    """The state on the device: `grads` (views of `grad_buffer`), `weights`, and the `shard_*` train_step updates."""
    shapes = param_shapes(cfg)
    muon = RECIPES[cfg.recipe].muon_names(shapes)
    layout = state_layout(compute_groups(cfg), muon, shapes, world)
    state = flat_gradients(shapes, layout, device)
    if cfg.zero_stage == 0:
        return whole_state(state, params, m, v, cfg, device)
    return sharded_state(state, params, m, v, shapes, layout, muon, device, rank, world)


def whole_state(state, params, m, v, cfg, device):
    """Stage 0: a process's shard is the whole model (masters, bf16 copies, moments)."""
    state.update(params=to_device(params, device), m=to_device(m, device), v=to_device(v, device))
    state["copies"] = compute_copies(state["params"], cfg)  # refreshed by every update from then on
    state["weights"] = model_weights(state["params"], state["copies"])
    state.update(shard_params=state["params"], shard_grads=state["grads"], shard_copies=state["copies"])
    return state


def device_state_bytes(cfg, shapes, world):
    """Bytes of make_state's tensors in one process, by kind (state_bytes of this trainer's layout)."""
    muon = RECIPES[cfg.recipe].muon_names(shapes)
    layout = state_layout(compute_groups(cfg), muon, shapes, world)
    return state_bytes(cfg.zero_stage, shapes, layout, muon, world)


def generate(params, generator, cfg):
    """SAMPLE_COUNT top-k continuations of EOT: token ids (S,T); eager, no KV cache (faster than compiling)."""
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
    """The profiled steps' self time per op and step by phase (forward, backward, optimizer), as text."""
    forward = "forward+backward (compiled)" if compiled else "forward"
    phases = [forward, "backward", "optimizer step"]
    totals = {}  # (phase, op name) -> [calls, microseconds]
    for e in profiler.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue  # a kernel's time counts for the op that launched it
        phase, p = phases[2], e
        while p is not None and phase == phases[2]:  # the innermost mark above the op decides
            if p.name.startswith("autograd::engine::evaluate_function"):
                phase = phases[1]
            elif p.name == GRADIENT:
                phase = forward
            p = p.cpu_parent
        t = totals.setdefault((phase, e.name), [0, 0.0])
        t[0] += 1
        t[1] += e.self_device_time_total if on_gpu else e.self_cpu_time_total
    grand = sum(t for _, t in totals.values()) or 1.0

    def line(phase, name, calls, us):
        return f"{phase:<28} {name[:50]:<50} {calls // steps:>6} {us / 1e3 / steps:>9.3f} {100 * us / grand:>5.1f}%"

    op = f"op (self {'device' if on_gpu else 'CPU'} time)"
    lines = [f"{'phase':<28} {op:<50} {'calls':>6} {'ms/step':>9} {'share':>6}"]
    for phase in phases:
        ops = sorted(((t, c, name) for (ph, name), (c, t) in totals.items() if ph == phase), reverse=True)
        lines.append(line(phase, "all", sum(c for _, c, _ in ops), sum(t for t, _, _ in ops)))
        lines += [line("", name, c, t) for t, c, name in ops[:rows]]
    return "\n".join(lines)


# Inductor's mix-order reduction (on GPUs since torch 2.10) drops the write of a column sum into a slice of
# a concatenated buffer, as our stacked LayerNorm and bias gradients are: uninitialized gradients with it on.
INDUCTOR_OPTIONS = {"triton.mix_order_reduction": False}

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
    step, params, m, v, grad_accum, train_loader, val_loader, encoder, lock = open_run(  # noqa: F841
        cfg, explicit, RECIPES, cfg.batch_size, rank, world, master, say, any_process_failed(world, device))
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

        peak = peak_flops(device_kind, cfg.dtype) if on_gpu else None
        flops = (model_flops_per_token(cfg, n_params), peak * world if peak else None)  # per token; peak per s
        first = step + 1
        profile_steps = range(min(first + 1, cfg.steps), min(first + PROFILE_STEPS, cfg.steps) + 1)
        activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * on_gpu
        profiler = torch.profiler.profile(activities=activities) if cfg.profile else None
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
            dt = time.perf_counter() - t0
            times[step] = dt
            if not (math.isfinite(loss) and math.isfinite(norm)):  # the same values in every process
                stop_diverged(step, loss, norm, cfg)
            # --time-budget and signals: all processes must stop at the same step
            budget_spent, signum = bool(cfg.time_budget) and sum(times.values()) >= cfg.time_budget, signals.received
            if world > 1:
                budget_spent, signum = agree_to_stop(budget_spent, signum, rank, device)
            last = step if budget_spent or signum else cfg.steps
            if cfg.compile and step == first:
                say(f"compiled train step in {dt:.1f} s (compilation and step {step})")
            if cfg.profile and step == profile_steps[-1]:
                profiler.stop()
                os.makedirs(os.path.join(cfg.out_dir, "profile"), exist_ok=True)
                trace = os.path.join(cfg.out_dir, "profile", f"trace_rank{rank}.json")
                profiler.export_chrome_trace(trace)
                ms = [1000 * times[s] for s in profile_steps]
                sort = "self_device_time_total" if on_gpu else "self_cpu_time_total"
                say(profiler.key_averages().table(sort_by=sort, row_limit=25))
                say(phase_table(profiler, len(profile_steps), on_gpu, cfg.compile))
                say(f"profile: steps {profile_steps[0]}-{profile_steps[-1]} traced into {trace} "
                    f"(Perfetto or chrome://tracing) | step time mean {np.mean(ms):.1f} ms, min "
                    f"{min(ms):.1f} ms, max {max(ms):.1f} ms")
            report_step(step, cfg, loss, norm, recipe.lr_at(step - 1, cfg), dt, peak_memory_gb(device), flops,
                        FRAMEWORK, master, say)
            # the checkpoint before a signal's stop and the evaluations (--resume runs those log.jsonl lacks)
            checkpoint_if_due(state, step, last, train_loader, cfg, recipe, world, master, say)
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
