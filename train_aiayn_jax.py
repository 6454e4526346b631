"""train_aiayn_jax.py: the "Attention Is All You Need" Transformer translator in plain JAX (no flax/optax).

Vaswani et al. (2017): an encoder-decoder of post-LayerNorm blocks with sinusoidal positions, dropout on
the embeddings and on every sub-layer's output, one joint BPE vocabulary whose embedding matrix serves the
source, the target and the pre-softmax projection (embeddings scaled by sqrt(d_model)); label smoothing
0.1, Adam (0.9, 0.98, 1e-9) with the inverse-square-root warmup schedule, batches of about --batch-tokens
source and target tokens built by length bucketing. Decoding: beam search (beam 4, GNMT length penalty
alpha 0.6, at most source length + 50 tokens) or greedy, both one jitted while-loop over fixed shapes; the
final score averages the last --average checkpoints and is sacrebleu's cased BLEU on detokenized output.

    python train_aiayn_jax.py --model small                          # Multi30k En->De (downloads it)
    python train_aiayn_jax.py --model small --src de --tgt en        # Multi30k De->En
    python train_aiayn_jax.py --dataset wmt14 --model base           # the paper's base run, newstest2014
    python train_aiayn_jax.py --eval-only --resume auto --average 5  # BLEU of the last 5 checkpoints
    python train_aiayn_jax.py --translate "A man is riding a bike." --resume out/aiayn_jax/ckpt_0008000

Each bucket shape's step is jitted and compiled ahead of time; log.jsonl: docs/FORMATS.md's GPT-2 keys plus bleu.
"""

import argparse
import contextlib
import datetime
import errno
import fcntl
import functools
import glob
import gzip
import hashlib
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
import urllib3
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from tokenizer import BPETokenizer

import jax
import jax.numpy as jnp
import numpy as np
import requests
import sacrebleu
from tqdm import tqdm

FRAMEWORK = "jax"

# -----------------------------------------------------------------------------
# Config

MODEL_PRESETS = {  # name: (n_layer per stack, n_head, d_model, d_ff, dropout)
    "tiny": (2, 4, 64, 128, 0.1),     # for tests
    "small": (4, 4, 128, 256, 0.3),   # Multi30k: Wu et al. (2021)'s text-only "Transformer-Tiny"
    "base": (6, 8, 512, 2048, 0.1),   # the paper's base model
    "big": (6, 16, 1024, 4096, 0.3),  # the paper's big model (dropout 0.3 for En-De)
}
RECIPES = {  # name: training defaults that go with the model (any flag overrides them)
    "tiny": dict(batch_tokens=1024, warmup=100, lr=2e-3, steps=200, ckpt_every=50, val_every=50),
    # Wu et al.'s fairseq recipe: lr 5e-3, 2000 warmup steps, 8000 updates of 4096 real tokens (5120 padded)
    "small": dict(batch_tokens=5120, warmup=2000, lr=5e-3, steps=8000, ckpt_every=200, val_every=500),
    # the paper: 25,000 source + 25,000 target tokens, 4000 warmup steps, lr from d_model; 100k / 300k steps
    "base": dict(batch_tokens=25000, warmup=4000, lr=0.0, steps=100000, ckpt_every=1000, val_every=1000),
    "big": dict(batch_tokens=25000, warmup=4000, lr=0.0, steps=300000, ckpt_every=1000, val_every=1000),
}
DATASETS = {
    # En-De task 1 of Multi30k, raw (untokenized, cased) files from the dataset's own repository
    "multi30k": dict(
        url="https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw",
        splits={"train": "train", "val": "val", "test": "test_2016_flickr"},
        model="small", bpe_vocab=10000),
    # WMT14 En-De as Hugging Face's wmt/wmt14 keeps it: 4.5M training pairs, newstest2013 (val), 2014 (test)
    "wmt14": dict(
        url="https://huggingface.co/datasets/wmt/wmt14/resolve/main/de-en",
        splits={"train": ["train-00000-of-00003", "train-00001-of-00003", "train-00002-of-00003"],
                "val": ["validation-00000-of-00001"], "test": ["test-00000-of-00001"]},
        model="base", bpe_vocab=37000),
}
LANGS = ("en", "de")
SPECIALS = ("<pad>", "<s>", "</s>")  # the tokenizer appends them last: ids vocab_size-3 .. vocab_size-1
BPE_TRAIN_PAIRS = 1_000_000          # a larger training set learns its BPE from an even sample of pairs
LN_EPS = 1e-6                        # tensor2tensor's LayerNorm epsilon
EXTRA_LEN = 50                       # decoding stops at source length + 50 tokens (the paper)


@dataclass
class Config:
    # model (per-stack sizes: the encoder and the decoder have n_layer layers each)
    model: str = "small"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int = 256
    dropout: float = 0.3
    vocab_size: int = 0  # from the tokenizer: the joint BPE's size, its special tokens last
    pad_id: int = 0
    bos_id: int = 0
    eos_id: int = 0
    # data
    dataset: str = "multi30k"
    src: str = "en"
    tgt: str = "de"
    data_dir: str = ""     # default data/<dataset>
    base_url: str = ""     # default: the dataset's public mirror (DATASETS)
    bpe_vocab: int = 10000
    max_len: int = 256     # training pairs longer than this (BPE tokens + EOS) on either side are skipped
    batch_tokens: int = 5120  # padded source (and target) tokens per optimizer step
    micro_tokens: int = 0     # padded tokens per micro-batch; 0 = batch_tokens (no accumulation)
    # optimization
    steps: int = 8000
    lr: float = 5e-3       # peak learning rate; 0 = the paper's d_model^-0.5 * warmup^-0.5
    warmup: int = 2000
    label_smoothing: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.98
    adam_eps: float = 1e-9
    grad_clip: float = 0.0
    dtype: str = "bf16"
    seed: int = 1337
    # checkpoints, evaluation, output
    resume: str = ""
    out_dir: str = "out/aiayn_jax"
    force: bool = False
    ckpt_every: int = 200
    val_every: int = 500
    average: int = 5       # the final BLEU averages the newest N checkpoints' weights
    bleu_split: str = "test"
    decode: str = "beam"
    beam: int = 4
    alpha: float = 0.6
    decode_batch: int = 128
    eval_only: bool = False
    translate: str = ""


def parse_args(argv=None):
    """(cfg, given): the flags given, over the model's recipe, its preset, the dataset's defaults and Config."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], argument_default=argparse.SUPPRESS)
    p.error = die  # a bad flag gets one line naming it, not the whole usage text
    p.add_argument("--dataset", choices=sorted(DATASETS), help="default multi30k")
    p.add_argument("--src", choices=LANGS, help="source language (default en)")
    p.add_argument("--tgt", choices=LANGS, help="target language (default de)")
    p.add_argument("--data-dir", help="raw files (downloaded there if missing; default data/<dataset>); "
                   "the BPE and the encoded data are cached there too (in --out-dir if it is read-only)")
    p.add_argument("--base-url", help="download mirror (default: the dataset's)")
    p.add_argument("--bpe-vocab", type=int, help="joint BPE size (default 10000 Multi30k, 37000 WMT14)")
    p.add_argument("--model", choices=list(MODEL_PRESETS), help="preset: sizes and training recipe")
    p.add_argument("--n-layer", type=int, help="layers in each of the encoder and decoder stacks (preset)")
    p.add_argument("--n-head", type=int, help="attention heads (preset)")
    p.add_argument("--d-model", type=int, help="model width: embeddings and residual stream (preset)")
    p.add_argument("--d-ff", type=int, help="width of the feed-forward layers' hidden layer (preset)")
    p.add_argument("--dropout", type=float, help="dropout on embeddings and sub-layer outputs (preset)")
    p.add_argument("--max-len", type=int, help=f"longest training pair kept (tokens + EOS) (default {Config.max_len})")
    p.add_argument("--batch-tokens", type=int, help="padded source (and target) tokens per step (the model's recipe)")
    p.add_argument("--micro-tokens", type=int, help="padded tokens per micro-batch (default 0: --batch-tokens)")
    p.add_argument("--steps", type=int, help="optimizer steps (the model's recipe)")
    p.add_argument("--lr", type=float, help="peak lr; 0 = the paper's d_model^-0.5 x warmup^-0.5 (the model's recipe)")
    p.add_argument("--warmup", type=int, help="linear warmup steps before the 1/sqrt(step) decay (the model's recipe)")
    p.add_argument("--label-smoothing", type=float, help=f"default {Config.label_smoothing}")
    p.add_argument("--grad-clip", type=float, help="clip gradients to this global norm (default 0: never)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="compute dtype; weights, Adam state fp32 (default bf16)")
    p.add_argument("--seed", type=int, help=f"weights, dropout and batch order (default {Config.seed})")
    p.add_argument("--resume", help="checkpoint dir, or 'auto' (newest in --out-dir): its settings are "
                   "the defaults, model sizes and vocabulary fixed")
    p.add_argument("--out-dir", help=f"checkpoints, log.jsonl and hypotheses (default {Config.out_dir})")
    p.add_argument("--force", action="store_true", help="start over in an --out-dir that holds a run: its "
                   "log.jsonl, checkpoints and hypotheses are moved into a replaced_<time> folder there first")
    p.add_argument("--ckpt-every", type=int, help="steps between checkpoints, 0 = never (the model's recipe)")
    p.add_argument("--val-every", type=int, help="steps between validation losses, 0 = never (the model's recipe)")
    p.add_argument("--average", type=int, help=f"BLEU averages the newest N checkpoints (default {Config.average})")
    p.add_argument("--bleu-split", choices=["test", "val", "none"], help="split for the final BLEU (default test)")
    p.add_argument("--decode", choices=["beam", "greedy"], help="search for BLEU and --translate (default beam)")
    p.add_argument("--beam", type=int, help=f"beam width (default {Config.beam})")
    p.add_argument("--alpha", type=float, help=f"the beam's GNMT length penalty exponent (default {Config.alpha})")
    p.add_argument("--decode-batch", type=int, help=f"sentences decoded at a time (default {Config.decode_batch})")
    p.add_argument("--eval-only", action="store_true", help="val loss and BLEU of --resume, then exit")
    p.add_argument("--translate", help="print the translation of this text (needs --resume)")
    given = vars(p.parse_args(argv))
    if "translate" in given and not given["translate"].strip():  # an unset shell variable, say
        die("--translate got no text: give the sentence to translate (--translate never trains)")

    dataset = given.get("dataset", Config.dataset)
    model = given.get("model", DATASETS[dataset]["model"])
    preset = dict(zip(("n_layer", "n_head", "d_model", "d_ff", "dropout"), MODEL_PRESETS[model]))
    cfg = Config(model=model, data_dir=f"data/{dataset}", base_url=DATASETS[dataset]["url"],
                 bpe_vocab=DATASETS[dataset]["bpe_vocab"], **preset, **RECIPES[model])
    return check_config(replace(cfg, **given)), given


def check_config(cfg):
    """cfg after checking it (a one-line error naming the flag), with --micro-tokens 0 resolved."""
    for flag in ("n_layer", "n_head", "d_model", "d_ff", "steps", "batch_tokens", "warmup", "beam",
                 "decode_batch", "average"):
        if getattr(cfg, flag) <= 0:
            die(f"--{flag.replace('_', '-')} must be positive")
    for flag in ("micro_tokens", "ckpt_every", "val_every"):
        if getattr(cfg, flag) < 0:
            die(f"--{flag.replace('_', '-')} must be >= 0")
    if cfg.d_model % cfg.n_head or cfg.d_model % 2:
        die(f"--d-model {cfg.d_model} must be even and divisible by --n-head {cfg.n_head}")
    if cfg.src == cfg.tgt:
        die(f"--src and --tgt are both {cfg.src}: choose two different languages")
    if not 0 <= cfg.dropout < 1 or not 0 <= cfg.label_smoothing < 1:
        die("--dropout and --label-smoothing must be in [0, 1)")
    for flag in ("lr", "grad_clip", "alpha"):
        if not 0 <= getattr(cfg, flag) < math.inf:  # NaN fails too
            die(f"--{flag.replace('_', '-')} must be finite and >= 0")
    if not 0 <= cfg.seed < 2**63:  # numpy's generators take no negative seed; checkpoints keep it as int64
        die("--seed must be in [0, 2**63)")
    if cfg.max_len < 2:
        die("--max-len must be at least 2")
    if cfg.bpe_vocab <= 256 + len(SPECIALS):
        die(f"--bpe-vocab must exceed {256 + len(SPECIALS)} (256 byte tokens + {len(SPECIALS)} specials)")
    micro = cfg.micro_tokens or cfg.batch_tokens
    if cfg.batch_tokens % micro:
        die(f"--batch-tokens {cfg.batch_tokens} is not a multiple of --micro-tokens {micro}")
    if micro < bucket_size(cfg.max_len):
        die(f"--micro-tokens {micro} cannot hold one pair of the longest bucket ({bucket_size(cfg.max_len)} "
            f"tokens): raise it or lower --max-len")
    if (cfg.translate or cfg.eval_only) and not cfg.resume:
        die("--translate and --eval-only need a checkpoint: give --resume DIR (or auto)")
    return replace(cfg, micro_tokens=micro)


# -----------------------------------------------------------------------------
# Model

ENC_NAMES = ["attn.qkv.w", "attn.qkv.b", "attn.out.w", "attn.out.b", "ln1.w", "ln1.b",
             "ff1.w", "ff1.b", "ff2.w", "ff2.b", "ln2.w", "ln2.b"]
DEC_NAMES = ["self.qkv.w", "self.qkv.b", "self.out.w", "self.out.b", "ln1.w", "ln1.b",
             "cross.q.w", "cross.q.b", "cross.kv.w", "cross.kv.b", "cross.out.w", "cross.out.b",
             "ln2.w", "ln2.b", "ff1.w", "ff1.b", "ff2.w", "ff2.b", "ln3.w", "ln3.b"]
# one embedding matrix for source, target and output; per-layer tensors stacked along a leading L axis
PARAM_NAMES = ["emb"] + [f"enc.{n}" for n in ENC_NAMES] + [f"dec.{n}" for n in DEC_NAMES]


def param_shapes(cfg):
    L, D, F, V = cfg.n_layer, cfg.d_model, cfg.d_ff, cfg.vocab_size
    linear = {"qkv": (3 * D, D), "out": (D, D), "q": (D, D), "kv": (2 * D, D), "ff1": (F, D), "ff2": (D, F)}
    shapes = {"emb": (V, D)}
    for name in PARAM_NAMES[1:]:
        out_in = linear.get(name.split(".")[-2], (D,))  # of e.g. dec.cross.kv.w; a LayerNorm's (D,)
        shapes[name] = (L, *out_in) if name.endswith(".w") else (L, out_in[0])
    return shapes


def init_params_numpy(cfg):
    """fairseq's init from cfg.seed: emb N(0, d_model^-0.5) (pad row 0), Xavier-uniform (q, k, v apart), b 0, LN 1."""
    rng = np.random.default_rng(cfg.seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name == "emb":
            params[name] = rng.standard_normal(shape, dtype=np.float32) * cfg.d_model ** -0.5
            params[name][cfg.pad_id] = 0.0
        elif name.endswith(".b"):
            params[name] = np.zeros(shape, np.float32)
        elif ".ln" in name:
            params[name] = np.ones(shape, np.float32)
        else:
            fan_out = shape[1] // (3 if ".qkv." in name else 2 if ".kv." in name else 1)
            limit = math.sqrt(6.0 / (fan_out + shape[2]))
            params[name] = rng.uniform(-limit, limit, shape).astype(np.float32)
    return params


def compute_dtype(cfg):
    return jnp.bfloat16 if cfg.dtype == "bf16" else jnp.float32


def cast_params(params, cfg):
    """The compute-dtype copy of the fp32 masters, cast inside the jitted step (gradients reach the masters)."""
    # LayerNorm's weights and the embedding stay fp32: its rows are gathered (and its gradient summed) in fp32
    dt = compute_dtype(cfg)
    return {k: jnp.asarray(p, jnp.float32 if ".ln" in k or k == "emb" else dt) for k, p in params.items()}


def sinusoids(T, D):
    """The paper's positional encodings (T, D): sin at even channels, cos at odd, wavelengths 2pi..1e4*2pi."""
    pos = np.arange(T, dtype=np.float64)[:, None]                                  # (T, 1)
    freq = 10000.0 ** (-np.arange(0, D, 2, dtype=np.float64) / D)                  # (D/2,)
    pe = np.zeros((T, D), np.float32)                                              # (T, D)
    pe[:, 0::2], pe[:, 1::2] = np.sin(pos * freq), np.cos(pos * freq)
    return pe


def layernorm(x, w, b):
    """LayerNorm over the last axis with fp32 statistics, returned in x's dtype."""
    xf = x.astype(jnp.float32)                                                     # (..., D)
    mean = jnp.mean(xf, axis=-1, keepdims=True)                                    # (..., 1)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)                  # (..., 1)
    return ((xf - mean) * jax.lax.rsqrt(var + LN_EPS) * w + b).astype(x.dtype)     # (..., D)


def linear(x, w, b):
    """x (..., in) @ w (out, in).T + b (out): torch's Linear layout, as the GPT-2 trainers."""
    return x @ w.T + b                                                             # (..., out)


def dropout(x, rate, key):
    """Inverted dropout; key None (evaluation) or rate 0 leaves x as it is."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)                          # (...) bool
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)                    # (...)


def attend(q, k, v, mask, n_head):
    """Attention of q (B,Tq,D) over k, v (B,Tk,D) in n_head heads; mask broadcasts to (B,1,Tq,Tk), True where
    a query may look. Scores and softmax in fp32; a query with nothing to look at averages, not NaNs."""
    B, Tq, D = q.shape
    Dh = D // n_head
    q, k, v = (a.reshape(B, a.shape[1], n_head, Dh) for a in (q, k, v))            # (B,T,H,Dh) each
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)    # (B,H,Tq,Tk)
    s = jnp.where(mask, s * (1.0 / math.sqrt(Dh)), -1e9)                           # (B,H,Tq,Tk)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)                                 # (B,H,Tq,Tk)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(B, Tq, D)                   # (B,Tq,D)


def embed(p, ids, pe, cfg, key):
    """Token embeddings of ids (B,T) times sqrt(d_model), plus the positions' sinusoids pe (T,D), dropped out."""
    x = (p["emb"][ids] * math.sqrt(cfg.d_model) + pe).astype(compute_dtype(cfg))  # (B,T,D)
    return dropout(x, cfg.dropout, key)                                            # (B,T,D)


def layer_keys(key, n_layer, n_sub):
    """Dropout keys (L, n_sub) for the scanned layers, or None in evaluation."""
    return None if key is None else jax.random.split(key, n_layer * n_sub).reshape(n_layer, n_sub)  # (L, n_sub)


def encode(p, src, cfg, key):
    """Source ids (B,S) -> encoder output (B,S,D) and the key-padding mask (B,1,1,S)."""
    S = src.shape[1]
    mask = (src != cfg.pad_id)[:, None, None, :]                                   # (B,1,1,S)
    pe = jnp.asarray(sinusoids(S, cfg.d_model))                                    # (S,D)
    x = embed(p, src, pe, cfg, None if key is None else jax.random.fold_in(key, 0))  # (B,S,D)
    keys = layer_keys(None if key is None else jax.random.fold_in(key, 1), cfg.n_layer, 2)

    def layer(x, xs):
        lp, lk = xs
        k0, k1 = (None, None) if lk is None else (lk[0], lk[1])
        qkv = linear(x, lp["attn.qkv.w"], lp["attn.qkv.b"])                       # (B,S,3D)
        q, k, v = jnp.split(qkv, 3, axis=-1)                                       # 3 x (B,S,D)
        h = linear(attend(q, k, v, mask, cfg.n_head), lp["attn.out.w"], lp["attn.out.b"])  # (B,S,D)
        x = layernorm(x + dropout(h, cfg.dropout, k0), lp["ln1.w"], lp["ln1.b"])   # (B,S,D)
        h = jax.nn.relu(linear(x, lp["ff1.w"], lp["ff1.b"]))                       # (B,S,F)
        h = linear(h, lp["ff2.w"], lp["ff2.b"])                                    # (B,S,D)
        return layernorm(x + dropout(h, cfg.dropout, k1), lp["ln2.w"], lp["ln2.b"]), None  # (B,S,D)

    layers = {n: p[f"enc.{n}"] for n in ENC_NAMES}                                 # (L, ...) each
    x, _ = jax.lax.scan(layer, x, (layers, keys))                                  # (B,S,D)
    return x, mask


def cross_kv(p, memory):
    """Every decoder layer's cross-attention keys and values of the encoder output: (L,B,S,D) each."""
    kv = jnp.einsum("bsd,led->lbse", memory, p["dec.cross.kv.w"]) + p["dec.cross.kv.b"][:, None, None, :]  # (L,B,S,2D)
    return jnp.split(kv, 2, axis=-1)                                               # 2 x (L,B,S,D)


def decoder(p, x, mem_k, mem_v, src_mask, self_mask, cfg, key, cache=None, t=None):
    """(hidden states (B,T,D), updated cache) of the decoder on embedded targets x (B,T,D) under self_mask.
    Decoding: x is position t (B,1,D), its keys and values written into cache = (k, v) (L,B,Tmax,D) each."""
    keys = layer_keys(key, cfg.n_layer, 3)

    def layer(x, xs):
        lp, mk, mv, ck, cv, lk = xs
        k0, k1, k2 = (None, None, None) if lk is None else (lk[0], lk[1], lk[2])
        qkv = linear(x, lp["self.qkv.w"], lp["self.qkv.b"])                       # (B,T,3D)
        q, k, v = jnp.split(qkv, 3, axis=-1)                                       # 3 x (B,T,D)
        if ck is not None:  # one step of incremental decoding: this position joins the cache
            k = ck = jax.lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), t, axis=1)  # (B,Tmax,D)
            v = cv = jax.lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), t, axis=1)  # (B,Tmax,D)
        h = linear(attend(q, k, v, self_mask, cfg.n_head), lp["self.out.w"], lp["self.out.b"])  # (B,T,D)
        x = layernorm(x + dropout(h, cfg.dropout, k0), lp["ln1.w"], lp["ln1.b"])   # (B,T,D)
        q = linear(x, lp["cross.q.w"], lp["cross.q.b"])                            # (B,T,D)
        h = linear(attend(q, mk, mv, src_mask, cfg.n_head), lp["cross.out.w"], lp["cross.out.b"])  # (B,T,D)
        x = layernorm(x + dropout(h, cfg.dropout, k1), lp["ln2.w"], lp["ln2.b"])   # (B,T,D)
        h = jax.nn.relu(linear(x, lp["ff1.w"], lp["ff1.b"]))                       # (B,T,F)
        h = linear(h, lp["ff2.w"], lp["ff2.b"])                                    # (B,T,D)
        x = layernorm(x + dropout(h, cfg.dropout, k2), lp["ln3.w"], lp["ln3.b"])   # (B,T,D)
        return x, (ck, cv)

    layers = {n: p[f"dec.{n}"] for n in DEC_NAMES if not n.startswith("cross.kv")}  # (L, ...) each
    ck, cv = cache if cache is not None else (None, None)
    x, new_cache = jax.lax.scan(layer, x, (layers, mem_k, mem_v, ck, cv, keys))   # (B,T,D)
    return x, (new_cache if cache is not None else None)


def output_logits(p, x):
    """Pre-softmax projection tied to the embedding matrix: (B,T,D) -> fp32 logits (B,T,V)."""
    emb = p["emb"].astype(x.dtype)                                                 # (V,D)
    return jnp.einsum("btd,vd->btv", x, emb, preferred_element_type=jnp.float32)   # (B,T,V)


def forward(params, src, tgt_in, cfg, key=None):
    """fp32 logits (B,T,V) of each next token of src (B,S), tgt_in (B,T) = BOS + target; key None: no dropout."""
    p = cast_params(params, cfg)
    memory, src_mask = encode(p, src, cfg, None if key is None else jax.random.fold_in(key, 0))  # (B,S,D)
    mem_k, mem_v = cross_kv(p, memory)                                             # (L,B,S,D) each
    T = tgt_in.shape[1]
    dkey = None if key is None else jax.random.fold_in(key, 1)
    pe = jnp.asarray(sinusoids(T, cfg.d_model))                                    # (T,D)
    x = embed(p, tgt_in, pe, cfg, None if dkey is None else jax.random.fold_in(dkey, 0))  # (B,T,D)
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]                          # (1,1,T,T)
    x, _ = decoder(p, x, mem_k, mem_v, src_mask, causal, cfg,
                   None if dkey is None else jax.random.fold_in(dkey, 1))          # (B,T,D)
    return output_logits(p, x)                                                     # (B,T,V)


def smoothed_loss_sums(logits, targets, pad_id, eps):
    """(label-smoothed loss, plain NLL, token count) summed over the non-padding targets (B,T)."""
    # 1-eps on the right token, eps spread over all V: (1-eps) * NLL + eps * mean -log p (torch's label_smoothing)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)                 # (B,T,V)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]          # (B,T)
    smooth = -jnp.mean(logp, axis=-1)                                              # (B,T)
    mask = (targets != pad_id).astype(jnp.float32)                                 # (B,T)
    loss = (1.0 - eps) * nll + eps * smooth                                        # (B,T)
    return jnp.sum(loss * mask), jnp.sum(nll * mask), jnp.sum(mask)


def loss_sums(params, src, tgt_in, tgt_out, cfg, key=None):
    """smoothed_loss_sums of one batch: src (B,S), tgt_in and tgt_out (B,T)."""
    logits = forward(params, src, tgt_in, cfg, key)                                # (B,T,V)
    return smoothed_loss_sums(logits, tgt_out, cfg.pad_id, cfg.label_smoothing)


# -----------------------------------------------------------------------------
# Optimizer

def lr_at(step, cfg):
    """The paper's schedule for 1-based `step`: peak * min(step/warmup, sqrt(warmup/step)) (--lr 0: its peak)."""
    peak = cfg.lr or cfg.d_model ** -0.5 * cfg.warmup ** -0.5
    return peak * min(step / cfg.warmup, math.sqrt(cfg.warmup / step))


def adam_scalars(step, cfg):
    """[lr, 1 - beta1^t, 1 - beta2^t] of 1-based step t, from the host in float64: a new lr never recompiles."""
    return np.array([lr_at(step, cfg), 1.0 - cfg.beta1 ** step, 1.0 - cfg.beta2 ** step], np.float32)


def train_step(params, m, v, src, tgt_in, tgt_out, step, scalars, cfg):
    """(params, m, v, loss, grad norm before clipping) of one Adam step over micro-batches src, tgt_in, tgt_out
    (A,B,T); the loss per target token of the whole step (as fairseq), the gradient clipped to cfg.grad_clip."""
    base = jax.random.fold_in(jax.random.key(cfg.seed), step)  # dropout from (seed, step, micro-batch)

    def micro_step(acc, xs):
        i, s, ti, to = xs

        def micro_loss(params):
            loss, _, count = loss_sums(params, s, ti, to, cfg, jax.random.fold_in(base, i))
            return loss, count
        (loss, count), grads = jax.value_and_grad(micro_loss, has_aux=True)(params)
        return jax.tree.map(jnp.add, acc, (grads, loss, count)), None

    zeros = {k: jnp.zeros_like(p) for k, p in params.items()}
    (grads, loss, count), _ = jax.lax.scan(
        micro_step, (zeros, jnp.float32(0), jnp.float32(0)), (jnp.arange(src.shape[0]), src, tgt_in, tgt_out))
    count = jnp.maximum(count, 1.0)
    grads = {k: g / count for k, g in grads.items()}                               # fp32 dict
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(grads[k])) for k in PARAM_NAMES))    # torch's total norm, fp32
    if cfg.grad_clip > 0:
        coef = jnp.minimum(cfg.grad_clip / (norm + 1e-6), 1.0)
        grads = {k: g * coef for k, g in grads.items()}
    lr, bias1, bias2 = scalars[0], scalars[1], scalars[2]
    m = {k: cfg.beta1 * m[k] + (1.0 - cfg.beta1) * grads[k] for k in PARAM_NAMES}  # Adam, no weight decay
    v = {k: cfg.beta2 * v[k] + (1.0 - cfg.beta2) * grads[k] * grads[k] for k in PARAM_NAMES}
    params = {k: params[k] - lr * (m[k] / bias1) / (jnp.sqrt(v[k] / bias2) + cfg.adam_eps) for k in PARAM_NAMES}
    return params, m, v, loss / count, norm


# -----------------------------------------------------------------------------
# Data

ENCODE_CHUNK = 100_000  # lines


def read_gz_lines(path):
    """The lines of a gzip'd UTF-8 text file (without their newlines)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8", newline="\n") as f:
            lines = f.read().split("\n")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        die(f"{path} is not a readable gzip'd UTF-8 text file ({e}); delete it to download it again")
    return lines[:-1] if lines[-1] == "" else lines


def read_split(cfg, split):
    """(source sentences, target sentences) of a split as raw text, its files downloaded first if missing:
    a gzip'd text file per language (Multi30k), or parquet shards holding both (WMT14)."""
    names = DATASETS[cfg.dataset]["splits"][split]
    multi30k = cfg.dataset == "multi30k"
    files = [f"{names}.{lang}.gz" for lang in (cfg.src, cfg.tgt)] if multi30k else [f"{n}.parquet" for n in names]
    paths = [os.path.join(cfg.data_dir, f) for f in files]
    for name, path in zip(files, paths):
        if not os.path.exists(path):
            print(f"downloading {cfg.base_url}/{name} to {path}")
            download_file(f"{cfg.base_url}/{name}", path)
    if multi30k:
        src, tgt = read_gz_lines(paths[0]), read_gz_lines(paths[1])
    else:
        import pyarrow.parquet
        src, tgt = [], []
        for path in paths:
            try:
                pairs = pyarrow.parquet.read_table(path, columns=["translation"]).column("translation").combine_chunks()
                src, tgt = src + pairs.field(cfg.src).to_pylist(), tgt + pairs.field(cfg.tgt).to_pylist()
            except (pyarrow.ArrowException, KeyError, OSError) as e:
                die(f"{path} is not a parquet file of {cfg.src}-{cfg.tgt} translation pairs ({e}); delete it to "
                    f"download it again")
    if len(src) != len(tgt):
        die(f"{split} split: {len(src)} {cfg.src} lines but {len(tgt)} {cfg.tgt} lines ({', '.join(paths)})")
    if not src:
        die(f"{split} split is empty ({', '.join(paths)})")
    return src, tgt


def cache_dir(cfg):
    """Where the BPE and the encoded splits are kept: beside the data, or in --out-dir if the data's is read-only."""
    return cfg.data_dir if os.access(cfg.data_dir, os.W_OK) else cfg.out_dir


def build_tokenizer(cfg, train_src, train_tgt):
    """(tokenizer, its file): the joint BPE of the training text (of an even sample past BPE_TRAIN_PAIRS), cached."""
    pair = "-".join(sorted((cfg.src, cfg.tgt)))
    path = os.path.join(cache_dir(cfg), f"joint_{pair}_{cfg.bpe_vocab}.bpe")
    if os.path.exists(path):
        try:
            tok = BPETokenizer.load(path)
        except ValueError as e:
            die(f"{e} (delete it to learn the BPE again)")
    else:
        every = max(1, math.ceil(len(train_src) / BPE_TRAIN_PAIRS))
        t0 = time.perf_counter()
        try:
            tok = BPETokenizer.train("\n".join(train_src[::every] + train_tgt[::every]), cfg.bpe_vocab,
                                     special_tokens=SPECIALS)
        except ValueError as e:
            die(f"--bpe-vocab {cfg.bpe_vocab}: {e}")
        tok.save(path)
        print(f"learned a {cfg.bpe_vocab}-token joint BPE from {len(train_src[::every]):,} pairs in "
              f"{time.perf_counter() - t0:.1f} s -> {path}")
    if tok.vocab_size != cfg.bpe_vocab or set(tok.special_tokens) != set(SPECIALS):
        die(f"{path} holds {tok.vocab_size} tokens with specials {sorted(tok.special_tokens)}, expected "
            f"{cfg.bpe_vocab} with {list(SPECIALS)} (delete it to learn the BPE again)")
    return tok, path


def encode_lines(tok, tok_path, lines, path):
    """The BPE ids of the lines, ragged (flat int32 ids, int64 offsets (n+1,)), cached in an npz at `path`."""
    # keyed by the sha256 of the tokenizer file and of the text: a stale cache is redone
    with open(tok_path, "rb") as f:
        h = hashlib.sha256(f.read())
    h.update("\n".join(lines).encode("utf-8", "surrogatepass"))
    key = h.hexdigest()
    try:
        with np.load(path) as z:
            if str(z["key"]) == key:
                return z["ids"], z["offsets"]
    except (OSError, ValueError, KeyError, EOFError):
        pass  # no cache, or an unreadable one: encode again and (over)write it
    chunks, lens = [], []
    for start in range(0, len(lines), ENCODE_CHUNK):  # a chunk at a time: ids as Python ints are large
        seqs = [tok.encode_ordinary(line) for line in lines[start:start + ENCODE_CHUNK]]
        lens += [len(s) for s in seqs]
        chunks.append(np.fromiter((i for s in seqs for i in s), np.int32, count=sum(map(len, seqs))))
    ids = np.concatenate(chunks) if chunks else np.zeros(0, np.int32)             # (total,)
    offsets = np.cumsum([0] + lens, dtype=np.int64)                                # (n+1,)
    with open(path + ".tmp", "wb") as f:
        np.savez(f, ids=ids, offsets=offsets, key=np.array(key))
    os.replace(path + ".tmp", path)
    return ids, offsets


def encode_split(cfg, tok, tok_path, split, src_lines, tgt_lines):
    """(source ragged ids, target ragged ids) of a split."""
    paths = [os.path.join(cache_dir(cfg), f"{split}.{lang}.bpe{cfg.bpe_vocab}.npz") for lang in (cfg.src, cfg.tgt)]
    return [encode_lines(tok, tok_path, lines, path) for lines, path in zip((src_lines, tgt_lines), paths)]


def bucket_size(n):
    """The padded length for n tokens: the smallest of 16, 24, 32, 48, 64, 96, 128, ... that holds them."""
    size = 16
    while True:
        for s in (size, size * 3 // 2):
            if s >= n:
                return s
        size *= 2


def pad_rows(ragged, idx, T, pad_id, bos_id=None, eos_id=None):
    """Rows idx of a ragged array as a (len(idx), T) int32 matrix: [bos] + ids + [eos], then padding."""
    ids, offsets = ragged
    idx = np.asarray(idx, np.int64)                                                # (n,)
    lens = offsets[idx + 1] - offsets[idx]                                         # (n,)
    out = np.full((len(idx), T), pad_id, np.int32)                                 # (n, T)
    first = 0 if bos_id is None else 1
    if bos_id is not None:
        out[:, 0] = bos_id
    rows = np.repeat(np.arange(len(idx)), lens)                                    # (total,)
    within = np.arange(rows.size) - np.repeat(np.cumsum(lens) - lens, lens)        # (total,)
    out[rows, first + within] = ids[np.repeat(offsets[idx], lens) + within]
    if eos_id is not None:
        out[np.arange(len(idx)), first + lens] = eos_id
    return out


def lengths(ragged):
    return np.diff(ragged[1])                                                      # (n,)


class Batches:
    """The training pairs by length bucket T, cut into steps of A micro-batches of R_T = micro_tokens // T pairs.
    Each epoch shuffles from (seed, epoch), so (epoch, steps done in it) is all a resumed run needs."""

    def __init__(self, src, tgt, cfg, epoch, index):
        self.cfg = cfg
        need = np.maximum(lengths(src), lengths(tgt)) + 1                          # (n,) with EOS / BOS
        keep = np.flatnonzero(need <= cfg.max_len)                                 # (n_kept,)
        self.dropped = len(need) - len(keep)
        sizes = sorted({bucket_size(int(n)) for n in np.unique(need[keep])})
        bucket = np.array([bucket_size(int(n)) for n in range(cfg.max_len + 1)])[need[keep]]  # (n_kept,)
        self.accum = cfg.batch_tokens // cfg.micro_tokens
        self.rows = {T: cfg.micro_tokens // T for T in sizes}
        self.data = {}
        for T in sizes:
            idx = keep[bucket == T]
            self.data[T] = (pad_rows(src, idx, T, cfg.pad_id, eos_id=cfg.eos_id),          # (n_T, T)
                            pad_rows(tgt, idx, T + 1, cfg.pad_id, cfg.bos_id, cfg.eos_id))  # (n_T, T+1)
        if not self.data:
            die(f"no training pair fits --max-len {cfg.max_len}")
        self.set_state(epoch, index)

    def set_state(self, epoch, index):
        """`index` steps into `epoch`, whose steps are (T, indices into bucket T's rows) shuffled from (seed, epoch)."""
        rng = np.random.default_rng([self.cfg.seed, epoch])
        steps = []
        for T, (src, _) in self.data.items():
            order = rng.permutation(len(src))
            per = self.rows[T] * self.accum
            steps += [(T, order[i:i + per]) for i in range(0, len(order), per)]
        self.epoch, self.index, self.steps = epoch, index, [steps[i] for i in rng.permutation(len(steps))]
        if index > len(self.steps):
            die(f"--resume: the checkpoint is {index} steps into epoch {epoch}, which has only "
                f"{len(self.steps)} (different data or --batch-tokens?)")

    def next(self):
        """(T, src = ids + EOS, tgt_in = BOS + ids, tgt_out = ids + EOS) of the next step, int32 (A,R_T,T) each;
        a short step gets rows of padding, which add nothing to the loss."""
        if self.index == len(self.steps):
            self.set_state(self.epoch + 1, 0)
        T, idx = self.steps[self.index]
        self.index += 1
        A, R = self.accum, self.rows[T]
        src = np.full((A * R, T), self.cfg.pad_id, np.int32)                       # (A*R, T)
        tgt = np.full((A * R, T + 1), self.cfg.pad_id, np.int32)                   # (A*R, T+1)
        src[:len(idx)], tgt[:len(idx)] = self.data[T][0][idx], self.data[T][1][idx]
        return T, src.reshape(A, R, T), tgt[:, :-1].reshape(A, R, T), tgt[:, 1:].reshape(A, R, T)


def eval_batches(src, tgt, cfg):
    """A whole split for the loss: (src, tgt_in, tgt_out) batches (R,T) of the one bucket T of its longest pair."""
    T = bucket_size(int(np.max(np.maximum(lengths(src), lengths(tgt)))) + 1)
    R = max(1, cfg.micro_tokens // T)
    n = len(lengths(src))
    s = np.full((n + -n % R, T), cfg.pad_id, np.int32)                             # (n', T) whole batches
    t = np.full((n + -n % R, T + 1), cfg.pad_id, np.int32)                         # (n', T+1)
    s[:n] = pad_rows(src, np.arange(n), T, cfg.pad_id, eos_id=cfg.eos_id)
    t[:n] = pad_rows(tgt, np.arange(n), T + 1, cfg.pad_id, cfg.bos_id, cfg.eos_id)
    return [(s[i:i + R], t[i:i + R, :-1], t[i:i + R, 1:]) for i in range(0, len(s), R)]


# -----------------------------------------------------------------------------
# Checkpoints

TOKENIZER_FILE = "tokenizer.bpe"
CHECKPOINT_FILES = ("params.npz", "state.npz", TOKENIZER_FILE)  # what makes a checkpoint directory complete
RUN_FILES = ("hyp_val.txt", "hyp_test.txt")  # a run's files besides its log and checkpoints


def save_checkpoint(out_dir, step, params, m, v, batches, cfg, tok_path):
    """<out_dir>/ckpt_<step>/: params.npz (fp32), state.npz (Adam moments, step, data position, seed, config), BPE."""
    final = os.path.join(out_dir, f"ckpt_{step:07d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    state = {f"{name}.{k}": np.asarray(a[k], np.float32) for name, a in (("m", m), ("v", v)) for k in PARAM_NAMES}
    state.update(step=np.int64(step), epoch=np.int64(batches.epoch), index=np.int64(batches.index),
                 seed=np.int64(cfg.seed), config=np.array(json.dumps(asdict(cfg))))
    try:
        os.makedirs(tmp)  # written under a temporary name, then renamed into place
        np.savez(os.path.join(tmp, "params.npz"), **{k: np.asarray(params[k], np.float32) for k in PARAM_NAMES})
        np.savez(os.path.join(tmp, "state.npz"), **state)
        shutil.copyfile(tok_path, os.path.join(tmp, TOKENIZER_FILE))
    except OSError as e:  # nothing of this checkpoint is kept; the earlier ones are untouched
        shutil.rmtree(tmp, ignore_errors=True)
        die(write_failure(tmp, e))
    rename_into_place(tmp, final)
    return final


def list_checkpoints(directory):
    """The complete checkpoint directories in `directory`, oldest first."""
    paths = sorted(glob.glob(os.path.join(glob.escape(directory), "ckpt_" + "[0-9]" * 7)))
    return [p for p in paths if all(os.path.isfile(os.path.join(p, f)) for f in CHECKPOINT_FILES)]


def load_npz(path, names):
    """{name: array} of the named arrays of an npz file; a clean error when it is unreadable."""
    try:
        with np.load(path) as z:
            absent = [n for n in names if n not in z.files]
            if absent:
                die(f"{path} is missing {', '.join(absent[:3])}")
            return {n: z[n] for n in names}
    except (OSError, ValueError, EOFError) as e:
        die(f"{path} is not a readable npz file ({e})")


def load_checkpoint(path):
    """(params, m, v, state, saved config) of a checkpoint directory, shapes checked against its config."""
    moment_names = [f"{p}.{k}" for p in "mv" for k in PARAM_NAMES]
    state = load_npz(os.path.join(path, "state.npz"), ["step", "epoch", "index", "seed", "config"] + moment_names)
    try:
        saved = Config(**{k: v for k, v in json.loads(str(state["config"])).items()
                          if k in {f.name for f in fields(Config)}})
    except (ValueError, TypeError) as e:
        die(f"{path}/state.npz: unreadable config ({e})")
    shapes = param_shapes(saved)
    params = load_npz(os.path.join(path, "params.npz"), PARAM_NAMES)
    m, v = ({k: state[f"{x}.{k}"] for k in PARAM_NAMES} for x in "mv")
    for k in PARAM_NAMES:
        for name, a in ((k, params[k]), (f"m.{k}", m[k]), (f"v.{k}", v[k])):
            if a.shape != shapes[k]:
                die(f"checkpoint {path}: {name} has shape {a.shape}, its config implies {shapes[k]}")
    info = {k: int(state[k]) for k in ("step", "epoch", "index", "seed")}
    check_checkpoint_step(path, info["step"])
    return params, m, v, info, saved


def averaged_params(path, n):
    """(weights, checkpoints used): the mean fp32 weights of checkpoint `path` and the n-1 before it in its dir."""
    found = [p for p in list_checkpoints(os.path.dirname(path))
             if os.path.basename(p) <= os.path.basename(path)]
    chosen = found[-n:] if path in found else [path]
    total = {}
    for p in chosen:
        for k, a in load_npz(os.path.join(p, "params.npz"), PARAM_NAMES).items():
            if k in total and a.shape != total[k].shape:
                die(f"--average {n}: {p} has another model shape than {chosen[0]}")
            total[k] = total[k] + a if k in total else a.astype(np.float64)
    return {k: (a / len(chosen)).astype(np.float32) for k, a in total.items()}, chosen


# -----------------------------------------------------------------------------
# Evaluation

def evaluate_loss(eval_fn, params, batches):
    """(label-smoothed loss, NLL) per target token over a split's eval_batches, without dropout."""
    loss = nll = count = 0.0
    for src, tgt_in, tgt_out in batches:
        l, n, c = eval_fn(params, src, tgt_in, tgt_out)
        loss, nll, count = loss + float(l), nll + float(n), count + float(c)
    return loss / count, nll / count


def beam_search(step_fn, state, max_lens, t_max, beam, alpha, bos_id, eos_id):
    """(tokens (n, t_max) int32 ending at their first EOS, scores (n,)): fairseq's beam search (beam 1: greedy).
    step_fn(state, tokens (n*beam,), t) -> (log p (n*beam, V) fp32, state); state holds the hypotheses on axis 1."""
    # Each step keeps the 2*beam best extensions: those of the best `beam` that end in EOS finish (score log p /
    # GNMT's ((5 + length) / 6)^alpha), the best `beam` others live on; only EOS may follow max_lens (n,) tokens
    n, K = max_lens.shape[0], beam
    seqs = jnp.full((n, K, t_max), eos_id, jnp.int32)                              # (n,K,t_max)
    alive = jnp.tile(jnp.array([0.0] + [-jnp.inf] * (K - 1), jnp.float32), (n, 1))  # (n,K) log p
    done_seqs = jnp.full((n, K, t_max), eos_id, jnp.int32)                         # (n,K,t_max)
    done_scores = jnp.full((n, K), -jnp.inf, jnp.float32)                          # (n,K)
    n_done = jnp.zeros((n,), jnp.int32)                                            # (n,)

    def cond(carry):
        t, n_done = carry[0], carry[-1]
        return (t < t_max) & ~jnp.all(n_done >= K)

    def body(carry):
        t, state, seqs, alive, done_seqs, done_scores, n_done = carry
        prev = jnp.where(t == 0, bos_id, seqs[:, :, jnp.maximum(t - 1, 0)])       # (n,K)
        logp, state = step_fn(state, prev.reshape(n * K), t)                       # (n*K,V)
        V = logp.shape[-1]
        only_eos = (t >= max_lens)[:, None, None] & (jnp.arange(V) != eos_id)     # (n,1,V)
        logp = jnp.where(only_eos, -jnp.inf, logp.reshape(n, K, V))                # (n,K,V)
        cand = (alive[:, :, None] + logp).reshape(n, K * V)                        # (n,K*V)
        # (barriers: XLA would fuse top_k into its consumers, on a CPU recomputing it per element: 100x slower)
        top, idx = jax.lax.optimization_barrier(jax.lax.top_k(cand, 2 * K))       # (n,2K) each
        origin, token = idx // V, idx % V                                          # (n,2K) each
        ext = jnp.take_along_axis(seqs, origin[:, :, None], axis=1)                # (n,2K,t_max)
        ext = ext.at[:, :, t].set(token)                                           # (n,2K,t_max)
        is_eos = token == eos_id                                                   # (n,2K)
        # finished: EOS among the K best, filling the sentence's free slots in rank order
        new = is_eos[:, :K] & (top[:, :K] > -jnp.inf) & (n_done < K)[:, None]      # (n,K)
        slot = n_done[:, None] + jnp.cumsum(new, axis=1) - 1                       # (n,K)
        hit = new[:, :, None] & (slot[:, :, None] == jnp.arange(K))                # (n,K cand,K slot)
        filled = jnp.any(hit, axis=1)                                              # (n,K)
        which = jnp.argmax(hit, axis=1)                                            # (n,K)
        score = top[:, :K] / ((5.0 + t + 1.0) / 6.0) ** alpha                      # (n,K)
        done_scores = jnp.where(filled, jnp.take_along_axis(score, which, axis=1), done_scores)  # (n,K)
        done_seqs = jnp.where(filled[:, :, None], jnp.take_along_axis(ext[:, :K], which[:, :, None], axis=1),
                              done_seqs)                                           # (n,K,t_max)
        n_done = jnp.minimum(n_done + jnp.sum(new, axis=1), K)                     # (n,)
        # alive: the K best extensions that did not end
        alive, pick = jax.lax.optimization_barrier(
            jax.lax.top_k(jnp.where(is_eos, -jnp.inf, top), K))                    # (n,K) each
        seqs = jnp.take_along_axis(ext, pick[:, :, None], axis=1)                  # (n,K,t_max)
        beam_of = jnp.take_along_axis(origin, pick, axis=1)                        # (n,K)
        rows = (jnp.arange(n)[:, None] * K + beam_of).reshape(n * K)               # (n*K,)
        state = jax.tree.map(lambda a: jnp.take(a, rows, axis=1), state)           # rows follow their beams
        return t + 1, state, seqs, alive, done_seqs, done_scores, n_done

    carry = (jnp.int32(0), state, seqs, alive, done_seqs, done_scores, n_done)
    _, _, _, _, done_seqs, done_scores, _ = jax.lax.while_loop(cond, body, carry)
    best = jnp.argmax(done_scores, axis=1)                                         # (n,)
    tokens = jnp.take_along_axis(done_seqs, best[:, None, None], axis=1)[:, 0]     # (n,t_max)
    return tokens, jnp.take_along_axis(done_scores, best[:, None], axis=1)[:, 0]


def greedy_search(step_fn, state, max_lens, t_max, bos_id, eos_id):
    """(tokens (n, t_max) int32 ending at their first EOS, summed log p (n,)) of the most probable token each step."""
    n = max_lens.shape[0]
    seqs = jnp.full((n, t_max), eos_id, jnp.int32)                                 # (n,t_max)

    def cond(carry):
        t, done = carry[0], carry[3]
        return (t < t_max) & ~jnp.all(done)

    def body(carry):
        t, state, seqs, done, total = carry
        prev = jnp.where(t == 0, bos_id, seqs[:, jnp.maximum(t - 1, 0)])          # (n,)
        logp, state = step_fn(state, prev, t)                                      # (n,V)
        only_eos = (t >= max_lens)[:, None] & (jnp.arange(logp.shape[-1]) != eos_id)  # (n,V)
        logp = jnp.where(only_eos, -jnp.inf, logp)                                 # (n,V)
        token = jnp.where(done, eos_id, jnp.argmax(logp, axis=-1))                 # (n,)
        total = total + jnp.where(done, 0.0, jnp.take_along_axis(logp, token[:, None], axis=1)[:, 0])
        return t + 1, state, seqs.at[:, t].set(token), done | (token == eos_id), total

    carry = (jnp.int32(0), state, seqs, jnp.zeros((n,), bool), jnp.zeros((n,), jnp.float32))
    _, _, seqs, _, total = jax.lax.while_loop(cond, body, carry)
    return seqs, total


def translate_batch(params, src, max_lens, cfg, greedy):
    """(tokens (n, S+EXTRA_LEN), scores (n,)) of source ids src (n,S) = ids + EOS, padded, by incremental decoding."""
    p = cast_params(params, cfg)
    n, S = src.shape
    K = 1 if greedy else cfg.beam
    t_max = S + EXTRA_LEN
    memory, src_mask = encode(p, src, cfg, None)                                   # (n,S,D), (n,1,1,S)
    mem_k, mem_v = (jnp.repeat(a, K, axis=1) for a in cross_kv(p, memory))         # (L,n*K,S,D) each
    src_mask = jnp.repeat(src_mask, K, axis=0)                                     # (n*K,1,1,S)
    cache = (jnp.zeros((cfg.n_layer, n * K, t_max, cfg.d_model), compute_dtype(cfg)),) * 2  # (L,n*K,t_max,D) x 2
    banned = jnp.zeros((cfg.vocab_size,), bool).at[jnp.array([cfg.pad_id, cfg.bos_id])].set(True)  # (V,)
    table = jnp.asarray(sinusoids(t_max, cfg.d_model))                             # (t_max,D)

    def step(cache, tokens, t):
        x = embed(p, tokens[:, None], table[t][None], cfg, None)                   # (n*K,1,D)
        visible = (jnp.arange(t_max) <= t)[None, None, None, :]                    # (1,1,1,t_max)
        x, cache = decoder(p, x, mem_k, mem_v, src_mask, visible, cfg, None, cache, t)  # (n*K,1,D)
        logp = jax.nn.log_softmax(output_logits(p, x)[:, 0], axis=-1)              # (n*K,V)
        return jnp.where(banned, -jnp.inf, logp), cache

    if greedy:
        return greedy_search(step, cache, max_lens, t_max, cfg.bos_id, cfg.eos_id)
    return beam_search(step, cache, max_lens, t_max, K, cfg.alpha, cfg.bos_id, cfg.eos_id)


def translate_ids(search, params, src, cfg):
    """Token ids (without EOS) of the translations of the ragged source ids src, cfg.decode_batch at a time."""
    # longest first, so a batch's loop ends early; one padded shape (a short last batch gets empty rows)
    lens = lengths(src)                                                            # (n,)
    S = bucket_size(int(lens.max()) + 1)
    B = min(cfg.decode_batch, len(lens))
    order = np.argsort(-lens, kind="stable")                                       # (n,)
    out = [None] * len(lens)
    # a bar only on a terminal: someone watching a long test set sees progress, a log stays clean
    with tqdm(total=len(lens), unit="sent", desc="translating", file=sys.stderr, leave=False,
              disable=not sys.stderr.isatty()) as bar:
        for i in range(0, len(order), B):
            idx = order[i:i + B]
            batch = np.full((B, S), cfg.pad_id, np.int32)                          # (B,S)
            batch[:len(idx)] = pad_rows(src, idx, S, cfg.pad_id, eos_id=cfg.eos_id)
            max_lens = np.zeros(B, np.int32)                                       # (B,) 0: empty row
            max_lens[:len(idx)] = lens[idx] + EXTRA_LEN
            tokens, _ = search(params, batch, max_lens)
            for row, j in zip(np.asarray(tokens).tolist(), idx):
                out[j] = row[:row.index(cfg.eos_id)] if cfg.eos_id in row else row
            bar.update(len(idx))
    return out


def evaluate_bleu(search, params, cfg, tok, split, src, refs):
    """(BLEU, path): sacrebleu (cased, 13a) of the split's detokenized translations, in <out_dir>/hyp_<split>.txt."""
    hyps = [tok.decode(ids).replace("\r", " ").replace("\n", " ")  # one line per sentence, whatever
            for ids in translate_ids(search, params, src, cfg)]      # an undertrained model emits
    bleu = sacrebleu.corpus_bleu(hyps, [refs])
    path = os.path.join(cfg.out_dir, f"hyp_{split}.txt")
    try:
        with open(path + ".tmp", "w", encoding="utf-8", newline="\n") as f:
            f.write("".join(h + "\n" for h in hyps))
    except OSError as e:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        die(write_failure(path, e))
    os.replace(path + ".tmp", path)
    return bleu, path


# -----------------------------------------------------------------------------
# Shared plumbing: flags, shards, checkpoints, out dir, logs, signals (a part)
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


def check_checkpoint_step(path, step):
    """A checkpoint dir named ckpt_<n> must hold step n: --resume auto and the abandoned_ moves go by the names."""
    name = os.path.basename(os.path.normpath(path))
    if re.fullmatch(r"ckpt_\d+", name) and int(name[5:]) != step:
        die(f"checkpoint {path} holds step {step}, not the step {int(name[5:])} its name says (renamed or "
            f"copied by hand?): name it ckpt_{step:07d} elsewhere, or remove it")


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


# hellaswag.py's download (the same code)
DOWNLOAD_RETRIES = 5
DOWNLOAD_BACKOFF_S = 1.0
DOWNLOAD_TIMEOUT_S = 60
CHUNK_BYTES = 1 << 20


class _Retryable(Exception):
    """A failure worth another attempt: a dropped connection, a 5xx/429 answer, a short body."""


def _announced_sha256(resp):
    """The sha256 the server vouches for: Hugging Face's `X-Linked-Etag` of an LFS file (on the redirect), or None."""
    # a plain ETag is no hash: GitHub's and CDNs' ETags are opaque cache validators
    for r in (*resp.history, resp):
        value = r.headers.get("X-Linked-Etag", "").removeprefix("W/").strip('"').lower()
        if re.fullmatch(r"[0-9a-f]{64}", value):
            return value
    return None


def sha256_of(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def download_file(url, path, retries=DOWNLOAD_RETRIES, backoff=DOWNLOAD_BACKOFF_S, expected_size=None,
                  expected_sha256=None):
    """Downloads `url` to `path` (skipped when `path` exists: only complete files ever get that name).
    expected_size / expected_sha256, when known in advance, are checked as well as what the server says."""
    if os.path.exists(path):
        return path
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        die(f"cannot create {folder} to download {url} into ({e.strerror})")
    part = path + ".part"
    total, sha = expected_size, expected_sha256
    failures = 0
    while True:
        have = os.path.getsize(part) if os.path.exists(part) else 0
        # identity: the bytes on disk must be the bytes the size, the range and the checksum refer to
        headers = {"Accept-Encoding": "identity"}
        if have:
            headers["Range"] = f"bytes={have}-"
        try:
            with requests.get(url, headers=headers, stream=True, timeout=DOWNLOAD_TIMEOUT_S) as resp:
                if resp.status_code == 416 and have:  # asked past the end: the part may hold it all
                    m = re.fullmatch(r"bytes \*/(\d+)", resp.headers.get("Content-Range", ""))
                    if m and int(m.group(1)) == have:
                        total = total or have
                        break
                    os.remove(part)
                    raise _Retryable("server refused to resume; starting over")
                if resp.status_code == 429 or resp.status_code >= 500:
                    raise _Retryable(f"HTTP {resp.status_code}")
                if resp.status_code not in (200, 206):
                    die(f"download of {url} failed: HTTP {resp.status_code}")
                if resp.headers.get("Content-Encoding", "identity") != "identity":
                    die(f"download of {url}: server sent {resp.headers['Content-Encoding']}-encoded data")
                sha = sha or _announced_sha256(resp)
                if resp.status_code == 206:  # where it starts, and the file's size: "bytes start-end/size"
                    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", resp.headers.get("Content-Range", ""))
                    start, announced = (int(m.group(1)), int(m.group(3))) if m else (None, None)
                else:  # a 200: the whole file, its size in Content-Length
                    length = resp.headers.get("Content-Length", "")
                    start, announced = 0, (int(length) if length.isdigit() else None)
                if start is None or start > have:  # a range we did not ask for: start over
                    if os.path.exists(part):
                        os.remove(part)
                    raise _Retryable(f"unexpected Content-Range {resp.headers.get('Content-Range')!r}")
                if announced is not None:
                    if total is not None and announced != total:
                        die(f"download of {url}: server announces {announced} bytes, expected {total}")
                    total = announced
                have = start  # a 200 answers a range request with the whole file
                try:  # a folder we may not write to is no failure a retry could mend
                    f = open(part, "r+b" if have else "wb")
                except OSError as e:
                    die(f"cannot write {part}: {e.strerror}")
                with f, tqdm(total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1024,
                             desc=os.path.basename(path), leave=False) as bar:
                    f.seek(have)
                    f.truncate()
                    for chunk in resp.raw.stream(CHUNK_BYTES, decode_content=False):
                        f.write(chunk)
                        bar.update(len(chunk))
            got = os.path.getsize(part)
            if total is not None and got < total:
                raise _Retryable(f"connection closed after {got} of {total} bytes")
            break
        except (_Retryable, requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
            # no connection at all (refused, no such host, no network, through a proxy or not): offline,
            # which a retry within seconds does not mend
            reason = getattr(e.args[0] if e.args else None, "reason", None)
            reason = getattr(reason, "original_error", reason)
            if isinstance(reason, urllib3.exceptions.NewConnectionError):
                die(f"download of {url} failed, no connection: {reason}")
            failures += 1
            if failures > retries:
                die(f"download of {url} failed after {retries} retries: {e}")
            print(f"download of {url}: {e}; retrying", file=sys.stderr)
            time.sleep(backoff * 2 ** (failures - 1))
    got = os.path.getsize(part)
    if total is not None and got != total:
        os.remove(part)
        die(f"download of {url} is corrupt: {got} bytes, the server announced {total} (removed; run again)")
    if sha is not None:
        digest = sha256_of(part)
        if digest != sha:
            os.remove(part)
            die(f"download of {url} is corrupt: sha256 {digest}, expected {sha} (removed; run again)")
    os.replace(part, path)
    return path


# -----------------------------------------------------------------------------
# Main

def load_tokenizer(path):
    try:
        return BPETokenizer.load(path)
    except ValueError as e:
        die(str(e))


@stops_on_signals
def main(argv, signals):
    cfg, given = parse_args(argv)
    device = jax.devices()[0]

    # weights and optimizer state: a checkpoint (with its own tokenizer), or fresh from the seed below (also
    # where --resume auto finds no checkpoint: the run starts at step 0, its earlier files set aside)
    restart = resolve_resume(cfg, not (cfg.eval_only or cfg.translate), CHECKPOINT_FILES)
    info, tok, tok_path = dict(step=0, epoch=0, index=0), None, None
    params = m = v = None
    if cfg.resume:
        params, m, v, info, saved = load_checkpoint(cfg.resume)
        for k in ("n_layer", "n_head", "d_model", "d_ff", "model", "dataset", "src", "tgt", "bpe_vocab"):
            if k in given and given[k] != getattr(saved, k):  # the model, vocabulary and language pair stay
                die(f"--{k.replace('_', '-')} {given[k]} disagrees with the checkpoint ({getattr(saved, k)})")
        # the checkpoint's settings with the flags given over them; what this command does is its own
        this_run = dict(eval_only=False, translate="", force=False)
        cfg = check_config(replace(saved, **{**this_run, **given, "resume": cfg.resume}))
        tok_path = os.path.join(cfg.resume, TOKENIZER_FILE)
        tok = load_tokenizer(tok_path)
        if tok.vocab_size != cfg.vocab_size:
            die(f"{tok_path} holds {tok.vocab_size} tokens, the checkpoint's model {cfg.vocab_size}")

    # fp32 means fp32: XLA would otherwise run fp32 matmuls on a GPU as TF32
    with jax.default_matmul_precision("highest" if cfg.dtype == "fp32" else "default"):
        if cfg.translate:
            search = jax.jit(partial(translate_batch, cfg=cfg, greedy=cfg.decode == "greedy"))
            weights, _ = averaged_params(cfg.resume, cfg.average)
            ids = np.array(tok.encode_ordinary(cfg.translate), np.int32)
            print(tok.decode(translate_ids(search, weights, (ids, np.array([0, len(ids)])), cfg)[0]))
            return
        run(cfg, device, info, tok, tok_path, params, m, v, restart, signals)


def run(cfg, device, info, tok, tok_path, params, m, v, restart, signals):
    """Training (or --eval-only's evaluation) after main restored any checkpoint, the out dir locked meanwhile."""
    lock = prepare_out_dir(cfg, True, info["step"], restart, RUN_FILES)  # noqa: F841
    t0 = time.perf_counter()
    if not cfg.eval_only:
        train_text = read_split(cfg, "train")
    if tok is None:
        tok, tok_path = build_tokenizer(cfg, *train_text)
        pad, bos, eos = (tok.special_tokens[s] for s in SPECIALS)
        cfg = replace(cfg, vocab_size=tok.vocab_size, pad_id=pad, bos_id=bos, eos_id=eos)
    val_text = read_split(cfg, "val")
    val = encode_split(cfg, tok, tok_path, "val", *val_text)
    val_batches = eval_batches(*val, cfg)
    if params is None:
        params = init_params_numpy(cfg)
        m, v = ({k: np.zeros_like(p) for k, p in params.items()} for _ in "mv")
    n_params = sum(p.size for p in params.values())
    print(f"Transformer {cfg.model}: {cfg.n_layer}+{cfg.n_layer} layers, {cfg.n_head} heads, d_model {cfg.d_model}, "
          f"d_ff {cfg.d_ff}, dropout {cfg.dropout}, {n_params / 1e6:.2f}M parameters | {cfg.dataset} "
          f"{cfg.src}->{cfg.tgt}, joint BPE {cfg.vocab_size} | {device.device_kind} | {cfg.dtype}")

    eval_fn = jax.jit(partial(loss_sums, cfg=cfg))
    search = jax.jit(partial(translate_batch, cfg=cfg, greedy=cfg.decode == "greedy"))

    def run_val(step, weights):
        loss, nll = evaluate_loss(eval_fn, weights, val_batches)
        print(f"step {step:5d} | val loss {loss:.6f} | nll {nll:.4f} | ppl {math.exp(nll):.2f}")
        log_event(cfg.out_dir, FRAMEWORK, step=step, val_loss=loss)

    def run_bleu(step, weights, note):
        if cfg.bleu_split == "none":
            return
        src_text, refs = read_split(cfg, "test") if cfg.bleu_split == "test" else val_text
        src = encode_split(cfg, tok, tok_path, cfg.bleu_split, src_text, refs)[0]
        t0 = time.perf_counter()
        bleu, path = evaluate_bleu(search, weights, cfg, tok, cfg.bleu_split, src, refs)
        how = "greedy" if cfg.decode == "greedy" else f"beam {cfg.beam}, alpha {cfg.alpha}"
        print(f"step {step:5d} | {cfg.bleu_split} BLEU {bleu.score:.2f} ({how}, {note}; "
              f"{len(refs)} sentences in {time.perf_counter() - t0:.1f} s) -> {path}")
        print(f"sacrebleu: {bleu}")
        log_event(cfg.out_dir, FRAMEWORK, step=step, bleu=bleu.score)

    def final_weights(step):
        """The weights to score: the newest --average checkpoints up to `step` averaged, when there are."""
        path = cfg.resume if cfg.eval_only else os.path.join(cfg.out_dir, f"ckpt_{step:07d}")
        if not cfg.eval_only and path not in list_checkpoints(cfg.out_dir):
            return params, "no checkpoint to average"
        weights, used = averaged_params(path, cfg.average)
        names = ", ".join(os.path.basename(p)[5:].lstrip("0") or "0" for p in used)
        return weights, (f"{len(used)} checkpoints averaged: steps {names}" if len(used) > 1
                         else f"checkpoint of step {names}")

    if cfg.eval_only:
        weights, note = final_weights(info["step"])
        run_val(info["step"], weights)
        run_bleu(info["step"], weights, note)
        return

    train = encode_split(cfg, tok, tok_path, "train", *train_text)
    batches = Batches(*train, cfg, info["epoch"], info["index"])
    print(f"data: {len(lengths(train[0])):,} training pairs ({batches.dropped} longer than --max-len {cfg.max_len} "
          f"skipped), {len(lengths(val[0])):,} validation pairs, ready in {time.perf_counter() - t0:.1f} s")
    print(f"batches: {cfg.batch_tokens} padded tokens per side per step = {batches.accum} micro-batch(es) of "
          f"{cfg.micro_tokens} | rows per bucket length: " + ", ".join(f"{T}: {r}" for T, r in batches.rows.items()))

    t0 = time.perf_counter()
    step_jit = jax.jit(partial(train_step, cfg=cfg), donate_argnums=(0, 1, 2))
    params, m, v = jax.device_put((params, m, v))
    lowered = {}  # the step of every bucket's shape (A,R_T,T), compiled in threads: XLA compiles outside the GIL
    for T, rows in batches.rows.items():
        batch = jax.ShapeDtypeStruct((batches.accum, rows, T), jnp.int32)
        lowered[T] = step_jit.lower(params, m, v, batch, batch, batch, jax.ShapeDtypeStruct((), jnp.int32),
                                    jax.ShapeDtypeStruct((3,), jnp.float32))
    with ThreadPoolExecutor(max_workers=len(lowered)) as pool:
        compiled = dict(zip(lowered, pool.map(lambda low: low.compile(), lowered.values())))
    print(f"compiled the train step for {len(compiled)} bucket shapes in {time.perf_counter() - t0:.1f} s")

    step, times, counts, loop_start = info["step"], [], [], time.perf_counter()
    signals.training = True  # from here a signal stops the run at the end of a step, with a checkpoint
    for step in range(info["step"] + 1, cfg.steps + 1):
        T, src, tgt_in, tgt_out = batches.next()                                   # (A,R,T) each
        # tokens/s counts the real (non-padding) source and target tokens
        tokens = int(np.count_nonzero(src != cfg.pad_id) + np.count_nonzero(tgt_out != cfg.pad_id))
        t0 = time.perf_counter()
        params, m, v, loss, norm = compiled[T](params, m, v, src, tgt_in, tgt_out, np.int32(step),
                                               adam_scalars(step, cfg))
        loss, norm = float(loss), float(norm)  # waits for the device: dt spans the whole step
        dt = time.perf_counter() - t0
        if not math.isfinite(loss):
            die(f"step {step}: the loss is {loss} (try a lower --lr or --dtype fp32)")
        times.append(dt)
        counts.append(tokens)
        lr, stats = lr_at(step, cfg), device.memory_stats()  # no statistics on a CPU
        mem = stats["peak_bytes_in_use"] / 1e9 if stats and "peak_bytes_in_use" in stats else None
        mem_s = "" if mem is None else f" | mem {mem:.1f} GB"  # only where measured
        print(f"step {step:5d}/{cfg.steps} | loss {loss:.6f} | norm {norm:.4f} | lr {lr:.4e} | {1000 * dt:.1f} ms | "
              f"{tokens / dt:,.0f} tok/s{mem_s}")
        log_event(cfg.out_dir, FRAMEWORK, step=step, train_loss=loss, grad_norm=norm, lr=lr, dt_ms=1000 * dt,
                  tokens_per_s=tokens / dt, peak_mem_gb=mem)
        if due(cfg.val_every, step, cfg.steps):
            run_val(step, params)
        signum = signals.received  # a signal makes this step the last: checkpointed, then the run stops
        if due(cfg.ckpt_every, step, step if signum else cfg.steps):
            print(f"saved {save_checkpoint(cfg.out_dir, step, params, m, v, batches, cfg, tok_path)}")
        stop_on_signal(signum, step, cfg, True)
    signals.training = False  # the checkpoints are written: a signal during the final BLEU stops at once
    if times:  # the first step can carry one-off start-up costs: left out of the means when it can be
        k = 1 if len(times) > 1 else 0
        print(f"trained {len(times)} steps in {time.perf_counter() - loop_start:.1f} s (evaluations and "
              f"checkpoints included) | mean step{' after the first' * k}: "
              f"{1000 * np.mean(times[k:]):.1f} ms, {sum(counts[k:]) / sum(times[k:]):,.0f} tok/s")
    weights, note = final_weights(step)
    run_bleu(step, weights, note)


if __name__ == "__main__":
    main()
