"""train_gpt2_torchfunc.py: GPT-2 as pure functions in PyTorch (torch.func + torch.compile).

The model is a plain function forward(params, idx) over a dict of fp32 tensors, stacked per layer in
llm.c's order; gradients come from torch.func.grad_and_value, AdamW is written with torch._foreach_* ops,
and torch.compile compiles both (on by default with CUDA). torchrun runs it data parallel.

    python train_gpt2_torchfunc.py                            # GPT-2 124M on data/fineweb_edu, bf16
    python train_gpt2_torchfunc.py --data synthetic --n-layer 2 --n-head 4 --n-embd 64 --seq-len 64 \\
        --batch-size 4 --total-batch-size 1024 --steps 20     # smoke run, any machine, no download
    torchrun --standalone --nproc_per_node=8 train_gpt2_torchfunc.py    # 8 GPUs, data parallel
    python train_gpt2_torchfunc.py --init-from gpt2_124M.bin --eval-only  # val + HellaSwag of a model
"""
import argparse
import glob
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import tiktoken
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hellaswag

FRAMEWORK = "torchfunc"  # "jax" | "triton-<backend>" in the siblings

# -----------------------------------------------------------------------------
# Config

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
    lr: float = 6e-4
    lr_decay_frac: float = 0.0
    warmup: int = 700
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dtype: str = "bf16"
    seed: int = 1337
    # checkpoints, evaluation, output
    init_from: str = ""
    resume: str = ""
    out_dir: str = f"out/gpt2_{FRAMEWORK.split('-')[0]}"
    ckpt_every: int = 2000
    val_every: int = 250
    val_steps: int = 20
    hellaswag_every: int = 1000
    hellaswag_limit: int = 0
    sample_every: int = 1000
    eval_only: bool = False
    profile: bool = False
    compile: bool = True  # torch.compile (--compile defaults to 1 with CUDA, 0 on the CPU)


def die(msg):
    """Stops the run with a one-line error (SystemExit prints it to stderr and exits 1, no traceback)."""
    raise SystemExit(f"error: {msg}")


def parse_args(argv=None):
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.error = die  # a bad flag gets one line naming it, not the whole usage text
    p.add_argument("--data", default=d.data, help="shard dir, shard glob, or 'synthetic'")
    p.add_argument("--val-data", default=d.val_data, help="validation shard glob (with a --data glob)")
    p.add_argument("--model", default=None, choices=sorted(MODEL_PRESETS), help="preset (default d12)")
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--n-head", type=int, default=None)
    p.add_argument("--n-embd", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="micro-batch per device")
    p.add_argument("--total-batch-size", type=int, default=d.total_batch_size, help="tokens per step")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--lr-decay-frac", type=float, default=d.lr_decay_frac)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="0 = no clipping")
    p.add_argument("--dtype", default=d.dtype, choices=["bf16", "fp32"])
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--init-from", default=d.init_from, help="llm.c model file to start from")
    p.add_argument("--resume", default=d.resume, help="checkpoint dir, or 'auto' (newest in --out-dir)")
    p.add_argument("--out-dir", default=d.out_dir)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every)
    p.add_argument("--val-every", type=int, default=d.val_every)
    p.add_argument("--val-steps", type=int, default=d.val_steps)
    p.add_argument("--hellaswag-every", type=int, default=d.hellaswag_every)
    p.add_argument("--hellaswag-limit", type=int, default=d.hellaswag_limit, help="0 = all examples")
    p.add_argument("--sample-every", type=int, default=d.sample_every)
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--compile", type=int, choices=(0, 1), default=int(torch.cuda.is_available()),
                   help="torch.compile the step (default 1 with CUDA, 0 on the CPU)")
    a = p.parse_args(argv)
    for flag in ("seq_len", "batch_size", "total_batch_size", "steps", "val_steps"):
        if getattr(a, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    for flag in ("warmup", "ckpt_every", "val_every", "hellaswag_every", "hellaswag_limit",
                 "sample_every"):
        if getattr(a, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0")
    if not a.lr > 0:
        p.error("--lr must be positive")
    if not 0 <= a.lr_decay_frac <= 1:
        p.error("--lr-decay-frac must be in [0, 1]")
    if a.weight_decay < 0 or a.grad_clip < 0:
        p.error("--weight-decay and --grad-clip must be >= 0")
    n_layer, n_head, n_embd = MODEL_PRESETS[a.model or "d12"]
    explicit = {k: v for k, v in (("n_layer", a.n_layer), ("n_head", a.n_head), ("n_embd", a.n_embd))
                if v is not None}
    for k, v in explicit.items():
        if v <= 0:
            p.error(f"--{k.replace('_', '-')} must be positive")
    cfg = Config(n_layer=explicit.get("n_layer", n_layer), n_head=explicit.get("n_head", n_head),
                 n_embd=explicit.get("n_embd", n_embd), block_size=a.seq_len, data=a.data,
                 val_data=a.val_data, seq_len=a.seq_len, batch_size=a.batch_size,
                 total_batch_size=a.total_batch_size, steps=a.steps, lr=a.lr,
                 lr_decay_frac=a.lr_decay_frac, warmup=a.warmup, weight_decay=a.weight_decay,
                 grad_clip=a.grad_clip, dtype=a.dtype, seed=a.seed, init_from=a.init_from,
                 resume=a.resume, out_dir=a.out_dir, ckpt_every=a.ckpt_every, val_every=a.val_every,
                 val_steps=a.val_steps, hellaswag_every=a.hellaswag_every,
                 hellaswag_limit=a.hellaswag_limit, sample_every=a.sample_every,
                 eval_only=a.eval_only, profile=a.profile, compile=bool(a.compile))
    if cfg.n_embd % cfg.n_head:
        p.error(f"--n-embd {cfg.n_embd} is not divisible by --n-head {cfg.n_head}")
    # flags that were given explicitly must agree with a model file's header (checked on load)
    cfg_explicit = explicit if (a.model is None) else {"n_layer": n_layer, "n_head": n_head,
                                                       "n_embd": n_embd, **explicit}
    return cfg, cfg_explicit


def apply_model_header(cfg, header, explicit):
    """Takes the model shape from a model file's header; flags given explicitly must match it."""
    for k in ("n_layer", "n_head", "n_embd"):
        if k in explicit and explicit[k] != header[k]:
            die(f"--{k.replace('_', '-')} {explicit[k]} does not match the model file ({header[k]})")
    if header["vocab_size"] != VOCAB_SIZE or header["padded_vocab_size"] < VOCAB_SIZE:
        die(f"model file has vocab {header['vocab_size']}/{header['padded_vocab_size']}, "
            f"expected {VOCAB_SIZE}")
    if cfg.seq_len > header["block_size"]:
        die(f"--seq-len {cfg.seq_len} exceeds the model file's max sequence length "
            f"{header['block_size']}")
    cfg.n_layer, cfg.n_head, cfg.n_embd = header["n_layer"], header["n_head"], header["n_embd"]
    cfg.block_size, cfg.padded_vocab_size = header["block_size"], header["padded_vocab_size"]


# -----------------------------------------------------------------------------
# Model

# llm.c's tensor order; per-layer tensors are stacked along a leading L axis, as in its model file
PARAM_NAMES = ["wte", "wpe", "ln_1.w", "ln_1.b", "c_attn.w", "c_attn.b", "attn.c_proj.w",
               "attn.c_proj.b", "ln_2.w", "ln_2.b", "c_fc.w", "c_fc.b", "mlp.c_proj.w",
               "mlp.c_proj.b", "ln_f.w", "ln_f.b"]
DECAY_NAMES = {"wte", "wpe", "c_attn.w", "attn.c_proj.w", "c_fc.w", "mlp.c_proj.w"}


def param_shapes(cfg):
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


def init_params_numpy(cfg):
    """GPT-2 init (SPEC §1) from cfg.seed, in numpy so that every trainer starts from the same weights."""
    rng = np.random.default_rng(cfg.seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith(".b"):
            params[name] = np.zeros(shape, np.float32)
        elif name.startswith("ln"):
            params[name] = np.ones(shape, np.float32)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.w") else 0.02
            params[name] = (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)
    params["wte"][cfg.vocab_size:] = 0.0  # padded rows start at zero and never receive a gradient
    return params


def forward(params, idx, cfg):
    """GPT-2's logits (B, T, Vp) for token ids idx (B, T), a pure function of the parameter dict. With
    --dtype bf16, autocast runs the matmuls and attention in bf16; the residual stream, LayerNorm and
    everything after the logits stay fp32."""
    B, T = idx.shape
    C, H = cfg.n_embd, cfg.n_head
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16"):
        x = params["wte"][idx] + params["wpe"][:T]  # (B, T, C)
        for l in range(cfg.n_layer):
            h = F.layer_norm(x, (C,), params["ln_1.w"][l], params["ln_1.b"][l], 1e-5)  # (B, T, C)
            qkv = F.linear(h, params["c_attn.w"][l], params["c_attn.b"][l])  # (B, T, 3C)
            q, k, v = qkv.view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D) flash on a GPU
            y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C) heads side by side again
            x = x + F.linear(y, params["attn.c_proj.w"][l], params["attn.c_proj.b"][l])  # (B, T, C)
            h = F.layer_norm(x, (C,), params["ln_2.w"][l], params["ln_2.b"][l], 1e-5)  # (B, T, C)
            h = F.linear(h, params["c_fc.w"][l], params["c_fc.b"][l])  # (B, T, 4C)
            h = F.gelu(h, approximate="tanh")  # (B, T, 4C)
            x = x + F.linear(h, params["mlp.c_proj.w"][l], params["mlp.c_proj.b"][l])  # (B, T, C)
        x = F.layer_norm(x, (C,), params["ln_f.w"], params["ln_f.b"], 1e-5)  # (B, T, C)
        return F.linear(x, params["wte"])  # (B, T, Vp) lm head tied to wte


def token_losses(params, x, y, cfg):
    """Per-token cross-entropy (B, T) in fp32 over the first V logits only (the padded rows of wte never
    compete). logsumexp minus the target's logit: compiled, this reads the bf16 logits once and never
    stores an fp32 copy or a log-softmax of them."""
    logits = forward(params, x, cfg)[..., :cfg.vocab_size].float()  # (B, T, V)
    target = torch.gather(logits, -1, y[..., None])[..., 0]  # (B, T)
    return torch.logsumexp(logits, dim=-1) - target  # (B, T)


def loss_fn(params, x, y, cfg):
    """Mean token loss of one micro-batch (fp32 scalar): the function that gets differentiated."""
    return token_losses(params, x, y, cfg).mean()


def grads_and_loss(params, x, y, cfg):
    """({name: gradient}, loss) of one micro-batch; reverse mode through torch.func, so the parameters
    stay plain tensors (no requires_grad, no .grad, no autograd graph kept between calls)."""
    return torch.func.grad_and_value(loss_fn)(params, x, y, cfg)


# -----------------------------------------------------------------------------
# Optimizer

def lr_at(it, cfg):
    """llm.c's schedule for 0-based iteration `it`: linear warmup, then cosine down to lr*lr_decay_frac."""
    min_lr = cfg.lr * cfg.lr_decay_frac
    if it < cfg.warmup:
        return cfg.lr * (it + 1) / cfg.warmup
    if it > cfg.steps:
        return min_lr
    ratio = (it - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (cfg.lr - min_lr)


def grad_accum_steps(cfg, world):
    tokens = cfg.batch_size * cfg.seq_len * world
    if cfg.total_batch_size % tokens:
        die(f"--total-batch-size {cfg.total_batch_size} is not a multiple of --batch-size x --seq-len "
            f"x devices = {tokens}")
    return cfg.total_batch_size // tokens


BETA1, BETA2, EPS = 0.9, 0.95, 1e-8


def global_norm(grads):
    """L2 norm over all gradient tensors (0-d fp32), accumulated in fp64: torch's fp32 norm kernels on the
    CPU are off by ~1e-5 relative on wte's 3M elements, which shows up in the clipping."""
    norms = torch._foreach_norm(grads, dtype=torch.float64)  # len(grads) x ()
    return torch.linalg.vector_norm(torch.stack(norms)).float()  # ()


def adamw_update(params, grads, m, v, lr, bc1, bc2, cfg):
    """llm.c's AdamW, in place on the fp32 tensors of the dicts. lr and the bias corrections
    bc1 = 1-b1^t, bc2 = 1-b2^t are 0-d device tensors, so the compiled update never recompiles."""
    p, g, m, v = ([d[k] for k in PARAM_NAMES] for d in (params, grads, m, v))
    torch._foreach_mul_(m, BETA1)
    torch._foreach_add_(m, g, alpha=1 - BETA1)  # m = b1 m + (1-b1) g
    torch._foreach_mul_(v, BETA2)
    torch._foreach_addcmul_(v, g, g, value=1 - BETA2)  # v = b2 v + (1-b2) g^2
    denom = torch._foreach_sqrt(torch._foreach_div(v, bc2))  # sqrt(vhat)
    torch._foreach_add_(denom, EPS)
    update = torch._foreach_div(torch._foreach_div(m, bc1), denom)  # mhat / (sqrt(vhat) + eps)
    decay = [i for i, k in enumerate(PARAM_NAMES) if k in DECAY_NAMES]
    torch._foreach_add_([update[i] for i in decay], [p[i] for i in decay], alpha=cfg.weight_decay)
    torch._foreach_mul_(update, lr)
    torch._foreach_sub_(p, update)  # p = p - lr (mhat / (sqrt(vhat) + eps) + wd p)


def optimizer_step(params, grads, m, v, lr, bc1, bc2, grad_scale, cfg):
    """Scales the summed gradients by grad_scale (to their mean), clips them by global norm and applies
    AdamW; returns the norm before clipping (0-d tensor). One graph when compiled."""
    g = [grads[k] for k in PARAM_NAMES]
    torch._foreach_mul_(g, grad_scale)
    norm = global_norm(g)  # ()
    if cfg.grad_clip > 0:
        torch._foreach_mul_(g, torch.clamp(cfg.grad_clip / (norm + 1e-6), max=1.0))
    adamw_update(params, grads, m, v, lr, bc1, bc2, cfg)
    return norm


def train_step(params, m, v, xs, ys, step, cfg, grad_fn, update_fn, world):
    """Optimizer step `step` (1-based) on the micro-batches xs, ys (A, B, T): gradients summed over the
    A micro-batches and all-reduced once over the processes, then their mean clipped and applied.
    Returns (train loss, grad norm) as 0-d device tensors: nothing here waits for the device."""
    scalar = lambda s: torch.tensor(s, dtype=torch.float32, device=xs.device)  # noqa: E731
    hyper = [scalar(lr_at(step - 1, cfg)), scalar(1 - BETA1 ** step), scalar(1 - BETA2 ** step),
             scalar(1 / (len(xs) * world))]  # made first: the device is idle between steps
    grads, loss = grad_fn(params, xs[0], ys[0], cfg)
    for x, y in zip(xs[1:], ys[1:]):
        g, micro_loss = grad_fn(params, x, y, cfg)
        torch._foreach_add_([grads[k] for k in PARAM_NAMES], [g[k] for k in PARAM_NAMES])
        loss = loss + micro_loss  # ()
    if world > 1:
        for k in PARAM_NAMES:
            dist.all_reduce(grads[k])
        dist.all_reduce(loss)
    norm = update_fn(params, grads, m, v, *hyper, cfg)  # ()
    return loss * hyper[3], norm


# -----------------------------------------------------------------------------
# Data

SHARD_MAGIC = 20240520
SYNTHETIC_TOKENS = 1 << 23  # length of the random "shard" behind --data synthetic


def read_shard(path):
    """An llm.c token shard (SPEC §2) as a read-only uint16 memmap, after checking its header and size."""
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
    """(train files, val files) for --data DIR | GLOB (with --val-data GLOB); (None, None) if synthetic."""
    if cfg.data == "synthetic":
        return None, None
    if os.path.isdir(cfg.data):
        train = sorted(glob.glob(os.path.join(cfg.data, "*_train_*.bin")))
        val = sorted(glob.glob(os.path.join(cfg.data, "*_val_*.bin")))
        if not train:
            die(f"--data {cfg.data}: no *_train_*.bin shards in that directory "
                "(run prepro_fineweb.py first, or use --data synthetic)")
    else:
        train = sorted(glob.glob(cfg.data))
        val = sorted(glob.glob(cfg.val_data)) if cfg.val_data else []
        if not train:
            die(f"--data {cfg.data}: no such directory and no file matches that glob")
        if cfg.val_data and not val:
            die(f"--val-data {cfg.val_data}: no file matches that glob")
    return train, val


class DataLoader:
    """llm.c's DistributedDataLoader: rank r reads B*T+1 tokens at position p + r*B*T of the current shard,
    all ranks advance p by W*B*T, and the next shard (wrapping around) starts when fewer than W*B*T+1
    tokens remain. files=None reads one in-memory shard of random tokens drawn from `seed`."""

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
        self.shard = shard

    def reset(self):
        self.set_state(0, 0)

    def set_state(self, shard, position):
        """Puts the loader at rank 0's `position` in `shard` (what state() returned)."""
        self._load(shard)
        self.position = position + self.rank * self.B * self.T

    def state(self):
        """(shard, rank 0's position): where the next batch starts, for checkpoints."""
        return self.shard, self.position - self.rank * self.B * self.T

    def next_batch(self):
        B, T = self.B, self.T
        buf = np.asarray(self.tokens[self.position: self.position + B * T + 1], dtype=np.int32)
        x, y = buf[:-1].reshape(B, T), buf[1:].reshape(B, T)  # (B, T) inputs, (B, T) targets
        self.position += self.world * B * T
        if self.position + self.world * B * T + 1 > len(self.tokens):
            n_shards = len(self.files) if self.files else 1
            self.set_state((self.shard + 1) % n_shards, 0)
        return x, y


def device_batches(loader, n, device):
    """The loader's next n micro-batches as int64 tensors xs, ys (n, B, T) on `device`, copied from
    pinned memory without blocking, so the host runs ahead of a GPU that is still busy."""
    xs, ys = zip(*(loader.next_batch() for _ in range(n)))
    out = []
    for arr in (np.stack(xs), np.stack(ys)):  # (n, B, T) each
        t = torch.from_numpy(arr.astype(np.int64))  # (n, B, T)
        if device.type == "cuda":
            t = t.pin_memory()
        out.append(t.to(device, non_blocking=True))  # (n, B, T)
    return out


# -----------------------------------------------------------------------------
# Checkpoints

MODEL_MAGIC = 20240326


def _to_bf16_bits(x):
    """fp32 -> bf16 bit patterns (uint16), rounding to nearest even, as torch does."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_model_file(path, params, cfg, dtype="fp32"):
    """An llm.c model file (SPEC §2): 256-int32 header, then the tensors in PARAM_NAMES order."""
    header = np.zeros(256, dtype="<i4")
    header[:8] = [MODEL_MAGIC, 3 if dtype == "fp32" else 5, cfg.block_size, cfg.vocab_size,
                  cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.padded_vocab_size]
    shapes = param_shapes(cfg)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        for name in PARAM_NAMES:
            t = np.asarray(params[name], dtype=np.float32)
            assert t.shape == shapes[name], (name, t.shape, shapes[name])
            f.write(t.astype("<f4").tobytes() if dtype == "fp32" else _to_bf16_bits(t).tobytes())
    os.replace(tmp, path)


def read_model_file(path):
    """(header dict, {name: fp32 array}) from an llm.c model file (version 3 = fp32, 5 = bf16)."""
    if not os.path.isfile(path):
        die(f"model file {path} does not exist")
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size < 1024:
        die(f"model file {path} is truncated: {raw.size} bytes")
    h = raw[:1024].view("<i4")
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
    if raw.size != expected:
        die(f"model file {path} has {raw.size} bytes, its header implies {expected}")
    params, offset = {}, 1024
    for name in PARAM_NAMES:
        n = math.prod(shapes[name])
        chunk = raw[offset: offset + n * itemsize]
        if itemsize == 4:
            t = chunk.view("<f4").astype(np.float32)
        else:
            t = (chunk.view("<u2").astype(np.uint32) << 16).view(np.float32)
        params[name] = t.reshape(shapes[name])
        offset += n * itemsize
    return header, params


def save_checkpoint(out_dir, step, params, m, v, loader_state, cfg):
    """<out_dir>/ckpt_<step>/{model.bin, state.npz} (SPEC §2), written under a temporary name, then renamed."""
    final = os.path.join(out_dir, f"ckpt_{step:07d}")
    tmp = final + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    write_model_file(os.path.join(tmp, "model.bin"), params, cfg, "fp32")
    state = {f"m.{k}": np.asarray(m[k], np.float32) for k in PARAM_NAMES}
    state.update({f"v.{k}": np.asarray(v[k], np.float32) for k in PARAM_NAMES})
    state.update(step=np.int64(step), shard=np.int64(loader_state[0]),
                 position=np.int64(loader_state[1]), seed=np.int64(cfg.seed),
                 config=np.array(json.dumps(asdict(cfg))))
    with open(os.path.join(tmp, "state.npz.tmp"), "wb") as f:
        np.savez(f, **state)
    os.replace(os.path.join(tmp, "state.npz.tmp"), os.path.join(tmp, "state.npz"))
    if os.path.isdir(final):  # a checkpoint of the same step from an earlier run: replace it whole
        old = final + ".old"
        os.replace(final, old)
        os.replace(tmp, final)
        for name in os.listdir(old):
            os.remove(os.path.join(old, name))
        os.rmdir(old)
    else:
        os.replace(tmp, final)
    return final


def latest_checkpoint(out_dir):
    """The newest complete checkpoint directory in out_dir, or None."""
    found = sorted(d for d in glob.glob(os.path.join(out_dir, "ckpt_*"))
                   if os.path.basename(d)[5:].isdigit() and os.path.isfile(os.path.join(d, "state.npz")))
    return found[-1] if found else None


def load_checkpoint(path, cfg):
    """(header, params, m, v, state) from a checkpoint dir; `path` may be 'auto' (newest in cfg.out_dir)."""
    if path == "auto":
        path = latest_checkpoint(cfg.out_dir)
        if path is None:
            die(f"--resume auto: no checkpoint in {cfg.out_dir}")
    if not os.path.isfile(os.path.join(path, "state.npz")):
        die(f"--resume {path}: not a checkpoint directory (no state.npz)")
    header, params = read_model_file(os.path.join(path, "model.bin"))
    with np.load(os.path.join(path, "state.npz")) as z:
        missing = [k for k in ("step", "shard", "position", "seed") if k not in z.files]
        missing += [f"{p}.{k}" for p in "mv" for k in PARAM_NAMES if f"{p}.{k}" not in z.files]
        if missing:
            die(f"checkpoint {path} is missing {', '.join(missing[:3])} in state.npz")
        m = {k: z[f"m.{k}"] for k in PARAM_NAMES}
        v = {k: z[f"v.{k}"] for k in PARAM_NAMES}
        state = {k: int(z[k]) for k in ("step", "shard", "position", "seed")}
    for k in PARAM_NAMES:
        if m[k].shape != params[k].shape or v[k].shape != params[k].shape:
            die(f"checkpoint {path}: optimizer state for {k} has shape {m[k].shape}, "
                f"the model has {params[k].shape}")
    return header, params, m, v, state


def to_numpy(tensors):
    """{name: fp32 numpy array} from a dict of device tensors, for the framework-neutral files."""
    return {k: t.detach().float().cpu().numpy() for k, t in tensors.items()}


def to_device(arrays, device):
    """{name: fp32 tensor on device} from a dict of numpy arrays."""
    return {k: torch.from_numpy(np.asarray(a, np.float32)).to(device) for k, a in arrays.items()}


# -----------------------------------------------------------------------------
# Evaluation

def evaluate_val(params, loader, cfg, losses_fn, world):
    """Mean loss over the first cfg.val_steps batches of the validation shards (the loader restarts each
    time, as llm.c's does), averaged over the processes, each reading its own rank's batches."""
    loader.reset()
    total = torch.zeros((), device=params["wte"].device)  # ()
    for _ in range(cfg.val_steps):
        xs, ys = device_batches(loader, 1, total.device)  # (1, B, T) each
        total += losses_fn(params, xs[0], ys[0], cfg).mean()
    if world > 1:
        dist.all_reduce(total)
    return total.item() / (cfg.val_steps * world)


def evaluate_hellaswag(params, cfg, losses_fn):
    """(acc, acc_norm) through hellaswag.evaluate. Rows are zero-padded to seq_len so that a compiled
    model sees one shape; a longer row keeps only its last seq_len+1 tokens, cutting the context's start
    (its losses come back as 0 there, where the ending mask ignores them)."""
    device, S = params["wte"].device, cfg.seq_len

    def loss_rows(tokens):  # (4, T) int64 -> (4, T-1) losses of tokens[:, 1:]
        n = tokens.shape[1] - 1
        cut = max(0, n - S)
        x = np.zeros((len(tokens), S), np.int64)  # (4, S)
        y = np.zeros((len(tokens), S), np.int64)  # (4, S)
        x[:, :n - cut], y[:, :n - cut] = tokens[:, cut:-1], tokens[:, cut + 1:]
        with torch.no_grad():
            losses = losses_fn(params, torch.from_numpy(x).to(device), torch.from_numpy(y).to(device),
                               cfg)  # (4, S)
        return np.concatenate([np.zeros((len(tokens), cut), np.float32),
                               losses[:, :n - cut].cpu().numpy()], axis=1)  # (4, T-1)

    return hellaswag.evaluate(loss_rows, limit=cfg.hellaswag_limit)


def generate(params, cfg, step, n_samples=4, n_tokens=32):
    """n_samples continuations of EOT by top-k 40 sampling, decoded with tiktoken's gpt2. The randomness
    comes from (seed, step) only. Eager: a compiled model would recompile for every length."""
    device = params["wte"].device
    seed = int(np.random.SeedSequence([cfg.seed, step]).generate_state(1)[0])
    gen = torch.Generator(device=device).manual_seed(seed)
    idx = torch.full((n_samples, 1), EOT, dtype=torch.int64, device=device)  # (n, 1)
    with torch.no_grad():
        for _ in range(n_tokens):
            logits = forward(params, idx[:, -cfg.block_size:], cfg)  # (n, t, Vp)
            logits = logits[:, -1, :cfg.vocab_size].float()  # (n, V)
            top, top_idx = torch.topk(logits, 40, dim=-1)  # (n, 40), (n, 40)
            pick = torch.multinomial(torch.softmax(top, dim=-1), 1, generator=gen)  # (n, 1)
            idx = torch.cat([idx, torch.gather(top_idx, -1, pick)], dim=1)  # (n, t+1)
    enc = tiktoken.get_encoding("gpt2")
    return [enc.decode(row[1:]) for row in idx.tolist()]


# -----------------------------------------------------------------------------
# Logging

PEAK_FLOPS = {  # dense tensor-core peak (bf16, tf32) by GPU name, from the vendors' datasheets
    "H100 PCIe": (756e12, 378e12),
    "H100": (989e12, 494.5e12),   # SXM
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


def log_event(out_dir, **record):
    """Appends one JSON object to <out_dir>/log.jsonl (SPEC §5 keys)."""
    record["framework"] = FRAMEWORK
    with open(os.path.join(out_dir, "log.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def format_step(step, cfg, loss, norm, lr, dt_ms, tokens_per_s, mfu, peak_mem_gb):
    mfu_s = "n/a" if mfu is None else f"{100 * mfu:.1f}%"
    mem_s = "n/a" if peak_mem_gb is None else f"{peak_mem_gb:.1f} GB"
    return (f"step {step:5d}/{cfg.steps} | loss {loss:.6f} | norm {norm:.4f} | lr {lr:.4e} | "
            f"{dt_ms:.1f} ms | {tokens_per_s:,.0f} tok/s | mfu {mfu_s} | mem {mem_s}")


# -----------------------------------------------------------------------------
# Main

def setup_device(cfg):
    """(rank, world, device): under torchrun one process per GPU (nccl) or per CPU share (gloo), else one
    process on the GPU if there is one. Sets the matmul precision that cfg.dtype promises."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if world > 1:  # processes on one machine share its cores instead of oversubscribing them
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    # fp32 means fp32: TF32 matmuls would break parity with the other trainers
    tf32 = cfg.dtype == "bf16"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    return rank, world, device


def main(argv=None):
    cfg, explicit = parse_args(argv)
    rank, world, device = setup_device(cfg)
    master = rank == 0
    say = print if master else (lambda *args, **kwargs: None)
    train_files, val_files = find_shards(cfg)
    grad_accum = grad_accum_steps(cfg, world)

    # parameters and optimizer state: a checkpoint, an llm.c model file, or GPT-2's init from the seed
    start = 0
    if cfg.resume:
        header, params, m, v, state = load_checkpoint(cfg.resume, cfg)
        apply_model_header(cfg, header, explicit)
        start, cfg.seed = state["step"], state["seed"]
    else:
        if cfg.init_from:
            header, params = read_model_file(cfg.init_from)
            apply_model_header(cfg, header, explicit)
        elif cfg.eval_only:
            die("--eval-only needs --init-from or --resume")
        else:
            params = init_params_numpy(cfg)
        m = {k: np.zeros_like(p) for k, p in params.items()}
        v = {k: np.zeros_like(p) for k, p in params.items()}
    params, m, v = to_device(params, device), to_device(m, device), to_device(v, device)

    train_loader = DataLoader(train_files, cfg.batch_size, cfg.seq_len, rank, world, cfg.seed)
    if cfg.resume:
        n_shards = len(train_files) if train_files else 1
        if state["shard"] >= n_shards:
            die(f"--resume: the checkpoint is at shard {state['shard']}, --data has {n_shards}")
        train_loader.set_state(state["shard"], state["position"])
        if train_loader.position + cfg.batch_size * cfg.seq_len + 1 > len(train_loader.tokens):
            die(f"--resume: the checkpoint's position {state['position']} is past the end of shard "
                f"{state['shard']} (other data than the checkpoint's run?)")
    val_loader = DataLoader(val_files, cfg.batch_size, cfg.seq_len, rank, world) if val_files else None
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    n_params = sum(t.numel() for k, t in params.items() if k != "wpe")
    say(f"{FRAMEWORK}: GPT-2 L{cfg.n_layer} H{cfg.n_head} C{cfg.n_embd}, {n_params / 1e6:.1f}M parameters "
        f"(without wpe) | {device_name} x {world} | {cfg.dtype} | compile {int(cfg.compile)} | "
        f"B {cfg.batch_size} x T {cfg.seq_len} x accum {grad_accum} x {world} = {cfg.total_batch_size} "
        f"tokens/step")
    losses_fn = torch.compile(token_losses, dynamic=False) if cfg.compile else token_losses

    if cfg.eval_only:
        if val_loader:
            val = evaluate_val(params, val_loader, cfg, losses_fn, world)
            say(f"val loss {val:.6f}")
            if master:
                log_event(cfg.out_dir, step=start, val_loss=val)
        acc, acc_norm = evaluate_hellaswag(params, cfg, losses_fn)
        say(f"hellaswag acc {acc:.4f} acc_norm {acc_norm:.4f}")
        if master:
            log_event(cfg.out_dir, step=start, hellaswag_acc=acc, hellaswag_acc_norm=acc_norm)
        if world > 1:
            dist.destroy_process_group()
        return

    grad_fn = torch.compile(grads_and_loss, fullgraph=True) if cfg.compile else grads_and_loss
    update_fn = torch.compile(optimizer_step, fullgraph=True) if cfg.compile else optimizer_step
    flops_per_token = model_flops_per_token(cfg, n_params)
    peak = peak_flops(device_name, cfg.dtype) if device.type == "cuda" else None
    # --profile: the steps after the first (which compiles and warms up), at most three
    profiled = range(min(start + 2, cfg.steps), min(start + 5, cfg.steps + 1)) if cfg.profile else ()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    timed = []
    if start >= cfg.steps:
        say(f"nothing to do: the checkpoint is at step {start}, --steps is {cfg.steps}")
    for step in range(start + 1, cfg.steps + 1):
        if profiled and step == profiled[0]:
            profiler.start()
        t0 = time.perf_counter()
        xs, ys = device_batches(train_loader, grad_accum, device)  # (A, B, T) each
        loss, norm = train_step(params, m, v, xs, ys, step, cfg, grad_fn, update_fn, world)
        loss, norm = loss.item(), norm.item()  # waits for the device, so dt covers the whole step
        dt = time.perf_counter() - t0
        lr = lr_at(step - 1, cfg)
        tokens_per_s = cfg.total_batch_size / dt
        mfu = flops_per_token * tokens_per_s / (peak * world) if peak else None
        mem = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
        say(format_step(step, cfg, loss, norm, lr, 1000 * dt, tokens_per_s, mfu, mem))
        if master:
            log_event(cfg.out_dir, step=step, train_loss=loss, grad_norm=norm, lr=lr, dt_ms=1000 * dt,
                      tokens_per_s=tokens_per_s, mfu=mfu, peak_mem_gb=mem)
        if step == start + 1 and cfg.compile:
            say(f"compiled train step in {dt:.1f} s (step {step}, left out of the average)")
        else:
            timed.append(dt)
        if profiled and step == profiled[-1]:
            profiler.stop()
            if master:
                trace = os.path.join(cfg.out_dir, f"trace_step{profiled[0]}-{step}.json")
                profiler.export_chrome_trace(trace)
                sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
                say(profiler.key_averages().table(sort_by=sort, row_limit=25))
                say(f"profiled steps {profiled[0]}-{step}; Chrome trace (chrome://tracing, Perfetto): "
                    f"{trace}")

        due = lambda every: every > 0 and (step % every == 0 or step == cfg.steps)  # noqa: E731
        if val_loader and due(cfg.val_every):
            val = evaluate_val(params, val_loader, cfg, losses_fn, world)
            say(f"step {step:5d} | val loss {val:.6f}")
            if master:
                log_event(cfg.out_dir, step=step, val_loss=val)
        if due(cfg.hellaswag_every):
            acc, acc_norm = evaluate_hellaswag(params, cfg, losses_fn)
            say(f"step {step:5d} | hellaswag acc {acc:.4f} acc_norm {acc_norm:.4f}")
            if master:
                log_event(cfg.out_dir, step=step, hellaswag_acc=acc, hellaswag_acc_norm=acc_norm)
        if master and due(cfg.sample_every):
            for i, text in enumerate(generate(params, cfg, step)):
                say(f"sample {i}: {text!r}")
        if master and due(cfg.ckpt_every):
            path = save_checkpoint(cfg.out_dir, step, to_numpy(params), to_numpy(m), to_numpy(v),
                                   train_loader.state(), cfg)
            say(f"saved {path}")

    if timed:
        dt = sum(timed) / len(timed)
        mfu = flops_per_token * cfg.total_batch_size / dt / (peak * world) if peak else None
        mem = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
        say(f"average of {len(timed)} steps: {1000 * dt:.1f} ms/step | "
            f"{cfg.total_batch_size / dt:,.0f} tok/s | mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
            f"peak memory {'n/a' if mem is None else f'{mem:.1f} GB'}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
