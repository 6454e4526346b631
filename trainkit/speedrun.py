"""The speedrun recipe without a framework (docs/FORMATS.md): modded-nanogpt's train_gpt_simple.py's defaults and
flag checks, weights' names, shapes and init, lrs and optimizer constants, and model files (safetensors)."""
import json
import math
import os
from types import SimpleNamespace

import numpy as np
import safetensors
import safetensors.numpy

from trainkit import die
from trainkit.gpt2 import VOCAB_SIZE

# its lrs per parameter group; --lr sets Muon's and scales the others with it
SPEEDRUN_LRS = {"muon": 0.025, "embed": 0.7, "head": 0.004, "vector": 0.015}
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
    """The reference's init in speedrun_shapes' order: *proj* and biases 0, gains 1, embed N(0, 1), N(0, .33/fan_in)."""
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


def adamw_group(name):
    """The SPEEDRUN_LRS group of a tensor that AdamW updates in the speedrun recipe."""
    return {"embed.weight": "embed", "proj.weight": "head"}.get(name, "vector")


def fp8_reciprocal(kind):
    """The fp32 value that --fp8-head multiplies operand `kind` by before its cast: 1/scale rounded to fp32 once."""
    # the same in every framework, as a division's rounding is not (CUDA torch, Triton's approximate division)
    return float(np.float32(1 / FP8_SCALES[kind]))


def read_safetensors(path, check=None):
    """{name: fp32 array} of a safetensors file of finite floats; check({name: (type, shape)}) before any is read."""
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
    if check is not None:
        check(entries)
    with open(path, "rb") as f:
        stored = safetensors.deserialize(f.read())
    tensors = {}
    for k, e in stored:
        t = np.frombuffer(e["data"], SAFETENSORS_TYPES[e["dtype"]])
        t = (t.astype(np.uint32) << 16).view(np.float32) if e["dtype"] == "BF16" else t.astype(np.float32)
        bad = t.size - np.count_nonzero(np.isfinite(t))
        if bad:
            die(f"model file {path}: tensor {k[:100]} holds {bad} non-finite values (NaN or inf): the weights of "
                "a diverged run?")
        tensors[k] = t.reshape(e["shape"])
    return tensors


def is_safetensors_file(head):
    """Whether a file's first 9 bytes are those of a safetensors file (a JSON header after its length)."""
    return head[8:9] == b"{"


def write_speedrun_file(path, params, cfg):
    """A speedrun model file: the reference's GPT.state_dict() in fp32 safetensors, rotary buffers included."""
    tensors = {}
    for k in speedrun_shapes(cfg):
        tensors[k] = np.ascontiguousarray(params[k], np.float32)
        if k.endswith(".attn.proj.bias"):  # where the reference's state_dict puts the attention's buffer
            tensors[k.replace("proj.bias", "rotary.angular_freq")] = rotary_freq_numpy(HEAD_DIM)
    data = safetensors.numpy.save(tensors, metadata={"format": "pt"})
    with open(path + ".tmp", "wb") as f:  # written here, not by the library: a full disk is an OSError with errno
        f.write(data)
    os.replace(path + ".tmp", path)


def read_speedrun_file(path):
    """(header, {name: fp32 array}) of a speedrun model file of any float type, its names and shapes checked first."""
    found = {}

    def check(entries):  # the shape from embed.weight and the blocks' count, bounded by their names
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
