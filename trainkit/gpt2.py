"""llm.c's GPT-2 without a framework: the vocabulary, the model presets, the weights' names and shapes, the init
every trainer draws from --seed, llm.c's model files (docs/FORMATS.md) and its cosine lr schedule."""
import math
import os
from types import SimpleNamespace

import numpy as np

from trainkit import die

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


def model_file_header(cfg):
    """The 256-int32 header of an fp32 (version 3) llm.c model file of cfg's shape."""
    header = np.zeros(256, dtype="<i4")
    header[:8] = [MODEL_MAGIC, 3, cfg.block_size, cfg.vocab_size,
                  cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.padded_vocab_size]
    return header


def write_model_file(path, params, cfg):
    """An fp32 llm.c model file: the 256-int32 header, then the tensors in PARAM_NAMES order."""
    shapes = gpt2_shapes(cfg)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(model_file_header(cfg).tobytes())
        for name in PARAM_NAMES:
            t = np.asarray(params[name], dtype=np.float32)
            assert t.shape == shapes[name], (name, t.shape, shapes[name])
            f.write(t.astype("<f4").tobytes())
    os.replace(tmp, path)


def read_model_header(path):
    """(header dict, version: 3 = fp32, 5 = bf16) of an llm.c model file, its header and size checked."""
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
    shapes = gpt2_shapes(SimpleNamespace(**header))
    expected = 1024 + (4 if h[1] == 3 else 2) * sum(math.prod(s) for s in shapes.values())
    if size != expected:
        cut = " (truncated)" if size < expected else ""
        die(f"model file {path} has {size} bytes, its header implies {expected}{cut}")
    return header, int(h[1])


def read_model_file(path):
    """(header dict, {name: fp32 array}) from an llm.c model file (version 3 = fp32, 5 = bf16)."""
    header, version = read_model_header(path)  # the header is checked before the weights are read
    shapes = gpt2_shapes(SimpleNamespace(**header))
    itemsize = 4 if version == 3 else 2
    raw, params, offset = np.fromfile(path, np.uint8), {}, 1024
    for name in PARAM_NAMES:
        chunk = raw[offset: offset + math.prod(shapes[name]) * itemsize]
        if itemsize == 4:
            t = chunk.view("<f4").astype(np.float32)
        else:
            t = (chunk.view("<u2").astype(np.uint32) << 16).view(np.float32)
        bad = t.size - np.count_nonzero(np.isfinite(t))
        if bad:
            die(f"model file {path}: tensor {name} holds {bad} non-finite values (NaN or inf): the weights "
                "of a diverged run?")
        params[name] = t.reshape(shapes[name])
        offset += chunk.size
    return header, params


def is_model_file(head):
    """Whether a file's first bytes are those of an llm.c model file."""
    return head[:4] == np.array(MODEL_MAGIC, "<i4").tobytes()


def cosine_lr(it, cfg):
    """llm.c's lr of 0-based iteration `it`: a linear warmup, then a cosine down to lr*lr_decay_frac."""
    min_lr = cfg.lr * cfg.lr_decay_frac
    if it < cfg.warmup:
        return cfg.lr * (it + 1) / cfg.warmup
    if it > cfg.steps:
        return min_lr
    ratio = (it - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (cfg.lr - min_lr)
