"""An outside reference for `--recipe speedrun`: modded-nanogpt's simplified speedrun baseline
(records/track_3_optimization/train_gpt_simple.py) as its code defines it, rebuilt from stock PyTorch parts
(nn.Linear, nn.Embedding, F.rms_norm, F.scaled_dot_product_attention, F.cross_entropy, autograd,
torch.optim.AdamW) plus a Muon written from the reference's formulas, run in float64 on the CPU.

It shares no code with the trainers: it reads and writes the speedrun model file (.safetensors, fp32, named
as GPT.state_dict() names its tensors) itself, and takes llm.c's token shards and data order from
tests/llmc_reference.py. The trainers, in fp32, must print the same per-step losses.

Conventions the trainers follow:
- the gradient is that of the cross-entropy SUMMED over the step's tokens (all micro-batches), so Adam's eps
  and Muon's 1e-7 act at that scale; the logged loss is the mean over the step's tokens;
- the lr schedule's step counts from 0 for the first update: the update after step s's gradient uses
  lr = base * lr_multiplier(s, steps), where steps is the run's number of steps;
- weight decay is decoupled and scaled by the scheduled lr: p *= 1 - lr*wd, in AdamW and Muon alike.

With fp8_head, the head's matmul in training is that of modded-nanogpt's record train_gpt.py (its mm_t and
mm_t_backward): its operands rounded to float8 here by round_fp8, written from the formats' definitions
(round to nearest even, saturating), not by a library's cast.
"""
import functools
import math
import re

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.numpy import load_file, save_file

from llmc_reference import Loader  # llm.c's shards and data order

V = 50304          # GPT-2's 50,257 tokens padded to a multiple of 128; the loss runs over all columns
HEAD_DIM = 128
SOFTCAP = 15.0
ATTN_SCALE = 0.12  # not 1/sqrt(128)

ADAM_BETAS, ADAM_EPS, ADAM_WD = (0.8, 0.95), 1e-10, 0.001
EMBED_LR, HEAD_LR, VECTOR_LR = 0.7, 0.004, 0.015
MUON_LR, MUON_WD, MUON_MOMENTUM, NS_STEPS = 0.025, 0.05, 0.95, 12
COOLDOWN = 0.7     # the lr falls linearly to 0 over the last 70% of the steps
# the FP8 head's static scales: an operand is multiplied by 1/scale, rounded to fp32, before its cast; the
# gradient's is the reference's grad_scale x 0.75/448 for a gradient of the summed loss (grad_scale 1)
FP8_SCALE = {"x": 100 / 448, "w": 1.6 / 448, "grad": 0.75 / 448}
# (exponent bias, mantissa bits, largest finite value) of float8 e4m3fn (no inf) and e5m2
FP8_FORMAT = {"x": (7, 3, 448.0), "w": (7, 3, 448.0), "grad": (15, 2, 57344.0)}


# -----------------------------------------------------------------------------
# FP8: the casts and the head's product

def round_fp8(t, kind):
    """float64 array t rounded to the float8 format of operand `kind` (FP8_FORMAT), as values: clamped to
    +-max (saturating), then to the nearest multiple of the spacing at its binade (the subnormals' below
    the smallest normal 2^(1-bias)), ties to even (np.round). Every step is exact in float64."""
    bias, mant, top = FP8_FORMAT[kind]
    t = np.clip(t, -top, top)
    exp = np.frexp(np.abs(t))[1] - 1                     # |t| in [2^exp, 2^(exp+1)); 0 gives -1
    spacing = np.exp2(np.maximum(exp, 1 - bias) - mant)
    return np.round(t / spacing) * spacing


def fp8_bits(q, kind):
    """The uint8 encodings of values q on operand kind's float8 grid (round_fp8's output): sign, exponent
    field (0 for subnormals), mantissa field."""
    bias, mant, _ = FP8_FORMAT[kind]
    a = np.abs(q)
    exp = np.where(a >= 2.0 ** (1 - bias), np.frexp(a)[1] - 1, 1 - bias)
    field = np.where(a >= 2.0 ** (1 - bias), exp + bias, 0)
    frac = a / np.exp2(exp) - (a >= 2.0 ** (1 - bias))  # [0, 1): the mantissa bits after the point
    code = (field << mant) + np.round(frac * 2 ** mant).astype(np.int64)
    return (np.signbit(q).astype(np.int64) << 7 | code).astype(np.uint8)


def quantize(t, kind):
    """Operand `kind` of the FP8 head as float8 values in float64: t times 1/scale rounded to fp32 (the
    product rounded to fp32, as the trainers take it), then round_fp8."""
    inverse = np.float64(np.float32(1 / FP8_SCALE[kind]))
    return round_fp8((np.asarray(t, np.float64) * inverse).astype(np.float32).astype(np.float64), kind)


class FP8HeadMatmul(torch.autograd.Function):
    """z = h W^T (h (N,C), W (V,C), float64) on float8 operands: (h_q W_q^T) x_s w_s; the backward rounds
    dz to e5m2: dh = g_q W_q g_s w_s, dW = g_q^T h_q g_s x_s. The products are float64 (exact here: 4-bit
    significands, sums of a few thousand)."""

    @staticmethod
    def forward(ctx, h, w):
        hq, wq = (torch.from_numpy(quantize(t.detach().numpy(), k)) for t, k in ((h, "x"), (w, "w")))
        ctx.save_for_backward(hq, wq)
        return hq @ wq.T * (FP8_SCALE["x"] * FP8_SCALE["w"])

    @staticmethod
    def backward(ctx, dz):
        hq, wq = ctx.saved_tensors
        gq = torch.from_numpy(quantize(dz.numpy(), "grad"))
        return gq @ wq * (FP8_SCALE["grad"] * FP8_SCALE["w"]), gq.T @ hq * (FP8_SCALE["grad"] * FP8_SCALE["x"])


# -----------------------------------------------------------------------------
# The model

def rotary_freq(head_dim=HEAD_DIM):
    """The rotary angular frequencies of a head: (1/1024)**linspace(0, 1, head_dim/4), then as many zeros
    (those dims are not rotated). Computed in fp32, as the reference's buffer is, so that the fp32 model file
    holds these values exactly and a float64 model loaded from it uses the same frequencies as an fp32 one."""
    freq = (1 / 1024) ** torch.linspace(0, 1, head_dim // 4, dtype=torch.float32)
    return torch.cat([freq, torch.zeros(head_dim // 4, dtype=torch.float32)])


def softcap(z):
    """15 z / sqrt(z^2 + 225): smooth, odd, ~z near 0, bounded by (-15, 15)."""
    return SOFTCAP * z / torch.sqrt(z * z + SOFTCAP ** 2)


class RMSNorm(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.gains = nn.Parameter(torch.ones(C))

    def forward(self, x):
        # eps=None is F.rms_norm's default: the machine epsilon of x's dtype (2^-23 in fp32, 2^-52 here)
        return F.rms_norm(x, (x.shape[-1],), weight=self.gains, eps=None)


class Rotary(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        self.register_buffer("angular_freq", rotary_freq(head_dim))  # persistent: it is in the model file

    def forward(self, x):
        """x (B, T, H, D): halves x1, x2 rotated by theta = t * freq: (x1 cos + x2 sin, -x1 sin + x2 cos)."""
        t = torch.arange(x.shape[1], dtype=x.dtype)
        theta = torch.outer(t, self.angular_freq.to(x.dtype))[None, :, None, :]  # (1, T, 1, D/2)
        cos, sin = theta.cos(), theta.sin()
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.H = C // HEAD_DIM
        self.q, self.k, self.v = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)
        self.proj = nn.Linear(C, C)
        self.rotary = Rotary(HEAD_DIM)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (lin(x).view(B, T, self.H, HEAD_DIM) for lin in (self.q, self.k, self.v))
        # q and k RMS-normed over the head dim, without gain, then rotated
        q, k = F.rms_norm(q, (HEAD_DIM,), eps=None), F.rms_norm(k, (HEAD_DIM,), eps=None)
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=ATTN_SCALE)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.fc, self.proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        return self.proj(F.relu(self.fc(x)).square())


class Block(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.attn, self.mlp = Attention(C), MLP(C)
        self.norm1, self.norm2 = RMSNorm(C), RMSNorm(C)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """The speedrun GPT; its state_dict() names and shapes are the model file's. Its weights are torch's
    default init until a state is loaded: the recipe's init is init_state_dict's."""

    def __init__(self, n_layer, n_embd, fp8_head=False):
        super().__init__()
        self.fp8_head = fp8_head  # the head's product in training: FP8HeadMatmul's
        assert n_embd % HEAD_DIM == 0, f"n_embd {n_embd} is not a multiple of the head dim {HEAD_DIM}"
        self.embed = nn.Embedding(V, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd) for _ in range(n_layer))
        self.proj = nn.Linear(n_embd, V)  # the head, untied from embed
        self.norm1, self.norm2 = RMSNorm(n_embd), RMSNorm(n_embd)

    def forward(self, idx):
        """(B, T) token ids -> (B, T, V) soft-capped logits."""
        x = self.norm1(self.embed(idx))  # no position embedding: rotary only
        for block in self.blocks:
            x = block(x)
        h = self.norm2(x)
        if self.fp8_head and self.training:
            z = FP8HeadMatmul.apply(h.flatten(0, 1), self.proj.weight).view(*h.shape[:2], -1) + self.proj.bias
            return softcap(z)
        return softcap(self.proj(h))


@functools.lru_cache
def state_shapes(n_layer, n_embd):
    """((name, shape), ...) of GPT(n_layer, n_embd).state_dict(), in its order (cached)."""
    model = GPT(n_layer, n_embd)
    return tuple((name, tuple(t.shape)) for name, t in model.state_dict().items())


def init_state_dict(n_layer, n_embd, seed):
    """The recipe's init as {name: fp32 array}, drawn from numpy's default_rng(seed) in state_dict order
    (only the random tensors draw): every weight whose name contains "proj" zero (attention and MLP output
    projections, the head), embed N(0, 1), q, k, v, fc weights N(0, std 0.33**0.5 / sqrt(fan_in)), biases 0,
    gains 1, the rotary buffers their frequencies."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in state_shapes(n_layer, n_embd):
        if name.endswith("angular_freq"):
            t = rotary_freq(shape[0] * 2).numpy()
        elif name.endswith("gains"):
            t = np.ones(shape)
        elif name.endswith("bias") or "proj" in name:
            t = np.zeros(shape)
        elif name == "embed.weight":
            t = rng.standard_normal(shape)
        else:  # q, k, v, fc weights (out, in): fan_in is the last dim
            t = rng.standard_normal(shape) * (0.33 ** 0.5 / math.sqrt(shape[-1]))
        out[name] = t.astype(np.float32)
    return out


# -----------------------------------------------------------------------------
# The model file: .safetensors, fp32, GPT.state_dict()'s names and shapes (rotary buffers included)

def write_model_file(path, state):
    """state: {name: array or tensor}, written as fp32."""
    arrays = {k: np.ascontiguousarray(np.asarray(v.detach().cpu() if torch.is_tensor(v) else v,
                                                 dtype=np.float32)) for k, v in state.items()}
    save_file(arrays, str(path))


def read_model_file(path):
    """{name: fp32 array} as stored."""
    return load_file(str(path))


def load_model(path, dtype=torch.float64, fp8_head=False):
    """A GPT in `dtype` from a model file; its size comes from the tensor names and shapes."""
    state = read_model_file(path)
    n_layer = sum(1 for k in state if re.fullmatch(r"blocks\.\d+\.norm1\.gains", k))
    n_embd = state["embed.weight"].shape[1]
    model = GPT(n_layer, n_embd, fp8_head).to(dtype)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    return model


# -----------------------------------------------------------------------------
# The optimizers and schedule

def newton_schulz(G, steps=NS_STEPS):
    """The orthogonalization of Muon, in G's dtype: on the wide orientation (the transpose of a tall G),
    X / (||X||_F + 1e-7), then `steps` iterations of X = 2X + (-1.5 A + 0.5 A A) X with A = X Xᵀ. The
    polynomial 2s - 1.5s^3 + 0.5s^5 maps each singular value s in (0, 1] up toward 1 (s' <= 1.002)."""
    tall = G.shape[-2] > G.shape[-1]
    X = G.mT if tall else G
    X = X / (torch.linalg.matrix_norm(X) + 1e-7)  # Frobenius >= spectral norm: every s <= 1
    for _ in range(steps):
        A = X @ X.mT
        X = 2 * X + (-1.5 * A + 0.5 * (A @ A)) @ X
    return X.mT if tall else X


def muon_update(p, g, buf, lr, wd, momentum=MUON_MOMENTUM):
    """One Muon step of matrix p (out, in) with gradient g, in place on p and its momentum buffer buf:
    buf = lerp(buf, g, 1 - momentum); Nesterov u = lerp(g, buf, momentum); update = NS(u) scaled by
    max(1, out/in)**0.5; p *= 1 - lr*wd; p -= lr*update."""
    with torch.no_grad():
        buf.lerp_(g, 1 - momentum)
        u = torch.lerp(g, buf, momentum)
        update = newton_schulz(u) * max(1.0, p.shape[-2] / p.shape[-1]) ** 0.5
        p.mul_(1 - lr * wd)
        p.sub_(lr * update)


def lr_multiplier(step, steps):
    """The schedule, with step counted from 0 for the first update: 1 for the first 30% of the steps,
    then (1 - step/steps) / 0.7, falling linearly toward 0 (continuous at the switch)."""
    x = step / steps
    return 1.0 if x < 1 - COOLDOWN else (1 - x) / COOLDOWN


def make_optimizers(model):
    """(AdamW over the embedding, the head weight and every vector; [(matrix, momentum buffer)] for Muon:
    the 2-D weights inside the blocks). Each AdamW group keeps its base lr as "base_lr"."""
    named = dict(model.named_parameters())
    vectors = [p for p in named.values() if p.dim() == 1]  # every bias and gain, the head's bias included
    muon = [p for n, p in named.items() if n.startswith("blocks.") and p.dim() == 2]
    groups = [{"params": [named["embed.weight"]], "lr": EMBED_LR},
              {"params": [named["proj.weight"]], "lr": HEAD_LR},
              {"params": vectors, "lr": VECTOR_LR}]
    covered = [p for g in groups for p in g["params"]] + muon
    assert len(covered) == len(named) and len({id(p) for p in covered}) == len(named)
    for g in groups:
        g["base_lr"] = g["lr"]
    adamw = torch.optim.AdamW(groups, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=ADAM_WD, foreach=False)
    return adamw, [(p, torch.zeros_like(p)) for p in muon]


def optimizer_step(adamw, muon, step, steps):
    """Update every parameter from its .grad with the lrs of `step` (0 for the first update). No clipping."""
    eta = lr_multiplier(step, steps)
    for g in adamw.param_groups:
        g["lr"] = g["base_lr"] * eta
    adamw.step()
    for p, buf in muon:
        muon_update(p.data, p.grad, buf, MUON_LR * eta, MUON_WD)


def accumulate(model, loader, accum):
    """Backward of the cross-entropy summed over accum micro-batches' tokens (over all V columns), into
    the parameters' .grad; returns that sum as a float."""
    total = 0.0
    for _ in range(accum):
        x, y = loader.next_batch()
        loss = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="sum")
        loss.backward()
        total += loss.item()
    return total


def train(model_file, train_files, B, T, total_batch, steps, dtype=torch.float64, return_model=False,
          fp8_head=False):
    """Per-step mean train loss of `steps` steps of total_batch tokens (total_batch / (B*T) micro-batches
    of (B, T) from llm.c shards, in llm.c's order), from a speedrun model file. With return_model=True,
    (losses, the trained model); fp8_head: the head's product in training is FP8HeadMatmul's."""
    model = load_model(model_file, dtype, fp8_head)
    adamw, muon = make_optimizers(model)
    assert total_batch % (B * T) == 0
    loader, accum = Loader(train_files, B, T), total_batch // (B * T)
    losses = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        losses.append(accumulate(model, loader, accum) / total_batch)
        optimizer_step(adamw, muon, step, steps)
    return (losses, model) if return_model else losses
