"""An outside reference for the GPT-2 trainers: llm.c's train_gpt2.py recipe rebuilt from stock PyTorch
parts (nn.Linear, nn.LayerNorm, nn.Embedding, F.scaled_dot_product_attention, F.gelu(tanh),
F.cross_entropy, autograd, torch.optim.AdamW, clip_grad_norm_), run in float64 on the CPU.

It shares no code with the trainers: it reads the llm.c model file and token shards itself, and follows
llm.c's data order, lr schedule, weight-decay groups (tensors of 2 or more dims), gradient accumulation
(loss / accum) and clipping. The trainers, in fp32, must print the same losses and grad norms.
"""
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

V = 50257


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C, eps=1e-5), nn.LayerNorm(C, eps=1e-5)
        self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L, H, C, block_size):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(block_size, C)
        self.h = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C, eps=1e-5)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # lm head tied to wte
        return F.cross_entropy(logits.view(-1, V), targets.reshape(-1))


def load_model_file(path):
    """A GPT in float64 from an llm.c model file (version 3 = fp32)."""
    raw = np.fromfile(path, dtype=np.uint8)
    h = raw[:1024].view("<i4")
    assert h[0] == 20240326 and h[1] == 3, "the reference reads fp32 llm.c model files"
    T, L, H, C, Vp = int(h[2]), int(h[4]), int(h[5]), int(h[6]), int(h[7])
    floats = raw[1024:].view("<f4").astype(np.float64)
    sizes = [("wte", (Vp, C)), ("wpe", (T, C)), ("ln_1.w", (L, C)), ("ln_1.b", (L, C)),
             ("c_attn.w", (L, 3 * C, C)), ("c_attn.b", (L, 3 * C)), ("attn.c_proj.w", (L, C, C)),
             ("attn.c_proj.b", (L, C)), ("ln_2.w", (L, C)), ("ln_2.b", (L, C)),
             ("c_fc.w", (L, 4 * C, C)), ("c_fc.b", (L, 4 * C)), ("mlp.c_proj.w", (L, C, 4 * C)),
             ("mlp.c_proj.b", (L, C)), ("ln_f.w", (C,)), ("ln_f.b", (C,))]
    t, off = {}, 0
    for name, shape in sizes:
        n = math.prod(shape)
        t[name] = torch.from_numpy(floats[off: off + n].reshape(shape).copy())
        off += n
    assert off == floats.size
    model = GPT(L, H, C, T).double()
    with torch.no_grad():
        model.wte.weight.copy_(t["wte"][:V])
        model.wpe.weight.copy_(t["wpe"])
        for i, b in enumerate(model.h):
            for mod, w, bias in ((b.ln_1, "ln_1.w", "ln_1.b"), (b.c_attn, "c_attn.w", "c_attn.b"),
                                 (b.attn_proj, "attn.c_proj.w", "attn.c_proj.b"),
                                 (b.ln_2, "ln_2.w", "ln_2.b"), (b.c_fc, "c_fc.w", "c_fc.b"),
                                 (b.mlp_proj, "mlp.c_proj.w", "mlp.c_proj.b")):
                mod.weight.copy_(t[w][i])
                mod.bias.copy_(t[bias][i])
        model.ln_f.weight.copy_(t["ln_f.w"])
        model.ln_f.bias.copy_(t["ln_f.b"])
    return model


def read_tokens(path):
    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[0] == 20240520 and header[1] == 1
    return np.fromfile(path, dtype="<u2", offset=1024)[: header[2]].astype(np.int64)


class Loader:
    """llm.c's DistributedDataLoader for one process."""

    def __init__(self, files, B, T):
        self.files, self.B, self.T = files, B, T
        self.shard, self.tokens, self.pos = 0, read_tokens(files[0]), 0

    def next_batch(self):
        B, T = self.B, self.T
        buf = torch.from_numpy(self.tokens[self.pos: self.pos + B * T + 1])
        self.pos += B * T
        if self.pos + B * T + 1 > len(self.tokens):
            self.shard = (self.shard + 1) % len(self.files)
            self.tokens, self.pos = read_tokens(self.files[self.shard]), 0
        return buf[:-1].view(B, T), buf[1:].view(B, T)


class Mt19937:
    """llm.c's rand.h generator, written out word by word as the Mersenne Twister's paper gives it."""

    def __init__(self, seed):
        self.mt = [seed & 0xFFFFFFFF]
        for i in range(1, 624):
            self.mt.append((1812433253 * (self.mt[-1] ^ (self.mt[-1] >> 30)) + i) & 0xFFFFFFFF)
        self.index = 624

    def next(self):
        if self.index == 624:
            for i in range(624):
                y = (self.mt[i] & 0x80000000) | (self.mt[(i + 1) % 624] & 0x7FFFFFFF)
                self.mt[i] = self.mt[(i + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            self.index = 0
        y = self.mt[self.index]
        self.index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)


def llmc_shuffle(items, rng):
    """rand.h's random_permutation, in place."""
    for i in range(len(items) - 1, 0, -1):
        j = rng.next() % (i + 1)
        items[i], items[j] = items[j], items[i]


class ShuffledLoader:
    """llm.c's dataloader.h with should_shuffle = 1, as rank `rank` of `ranks` runs it (train_gpt2.c: one
    rank): its own generator seeded 42 + rank, the shard order reshuffled at each epoch, the samples of a
    shard shuffled when it is opened, and a shard left only when the next batch is asked for."""

    def __init__(self, files, B, T, rank=0, ranks=1):
        self.files, self.B, self.T, self.rank, self.ranks = files, B, T, rank, ranks
        self.rng, self.shard_indices = Mt19937(42 + rank), list(range(len(files)))
        self.reset()

    def reset(self):
        self.shard, self.sample = 0, 0
        llmc_shuffle(self.shard_indices, self.rng)
        self.open()

    def open(self):
        self.tokens = read_tokens(self.files[self.shard_indices[self.shard]])
        self.samples = list(range((len(self.tokens) - 1) // (self.ranks * self.B * self.T)))
        llmc_shuffle(self.samples, self.rng)

    def next_batch(self):
        B, T = self.B, self.T
        if self.sample >= len(self.samples):
            if self.shard == len(self.files) - 1:
                self.reset()
            else:
                self.shard, self.sample = self.shard + 1, 0
                self.open()
        at = self.samples[self.sample] * self.ranks * B * T + self.rank * B * T
        self.sample += 1
        buf = torch.from_numpy(self.tokens[at: at + B * T + 1])
        return buf[:-1].view(B, T), buf[1:].view(B, T)


def get_lr(it, lr, warmup, steps, decay_frac):
    min_lr = lr * decay_frac
    if it < warmup:
        return lr * (it + 1) / warmup
    if it > steps:
        return min_lr
    ratio = (it - warmup) / (steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def train(model_file, train_files, B, T, total_batch, steps, lr, warmup, decay_frac=0.0,
          weight_decay=0.1, grad_clip=1.0, val_files=None, val_steps=2, shuffle=False):
    """Per step: (train loss, grad norm before clipping, lr, val loss after the step or None); the train
    shards in order (train_gpt2.py), or with `shuffle` in train_gpt2.c's shuffled order."""
    torch.manual_seed(0)
    model = load_model_file(model_file)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    loader, accum = (ShuffledLoader if shuffle else Loader)(train_files, B, T), total_batch // (B * T)
    out = []
    for it in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(accum):
            x, y = loader.next_batch()
            loss = model(x, y) / accum
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip).item()
        step_lr = get_lr(it, lr, warmup, steps, decay_frac)
        for g in opt.param_groups:
            g["lr"] = step_lr
        opt.step()
        val = None
        if val_files:
            vl = Loader(val_files, B, T)
            with torch.no_grad():
                val = sum(model(*vl.next_batch()).item() for _ in range(val_steps)) / val_steps
        out.append((total, norm, step_lr, val))
    return out
