"""The flags every trainer shares: RunConfig (their defaults), RunRecipe (what a trainer asks of a recipe),
parse_args, and the check of a model file's shape against them."""
import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from trainkit import die
from trainkit.gpt2 import MODEL_PRESETS, PADDED_VOCAB_SIZE, VOCAB_SIZE
from trainkit.logs import PROFILE_STEPS


@dataclass(frozen=True)
class RunRecipe:
    """What every trainer asks of a --recipe's row; a trainer's Recipe adds its framework's own fields."""
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


@dataclass
class RunConfig:
    """The flags every trainer shares, with their defaults; a trainer's Config adds its own and out_dir's default."""
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
    shuffle: bool = False  # llm.c's shuffled order (train_gpt2.c/.cu), not train_gpt2.py's in-order one
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
    fp8_head: bool = False  # the speedrun head's training matmuls in FP8 (trainkit.speedrun, docs/FORMATS.md)
    # checkpoints, evaluation, output
    init_from: str = ""
    resume: str = ""
    force: bool = False
    out_dir: str = "out/gpt2"
    ckpt_every: int = 2000
    val_every: int = 250
    val_tokens: int = 10485760  # llm.c's 20 x 64 x 1024 x 8 GPUs, modded-nanogpt's 20 x 524288
    hellaswag_every: int = 1000
    hellaswag_limit: int = 0
    sample_every: int = 1000
    eval_only: bool = False
    profile: bool = False
    zero_stage: int = 0  # 0: every device holds all optimizer state, 1: ZeRO-1, 3: weights and gradients too

# --recompute (docs/FORMATS.md): none keeps what the backward reads; pointwise recomputes the norms' outputs and
# the MLP's activation; block keeps each block's input alone and reruns its forward in the backward
RECOMPUTE_LEVELS = ("none", "pointwise", "block")


def parse_args(argv, config, recipes, zero_stages, doc, framework_flags):
    """(cfg, explicit): `config` with the flags given over its defaults, and the model-shape flags and --seed given,
    which a model file's header and a checkpoint's seed must match (--model gives all three shape flags)."""
    d = config()
    p = argparse.ArgumentParser(description=doc.splitlines()[0], argument_default=argparse.SUPPRESS)
    p.error = die  # a bad flag gets one line naming it, not the whole usage text
    framework_flags(p)
    p.add_argument("--recipe", choices=list(recipes), help="; ".join(f"{name}: {r.help}" for name, r in
                   recipes.items()) + f" (default {d.recipe})")
    p.add_argument("--data", help="train shards: a dir of prepro_fineweb.py's *_train_*.bin (and *_val_*.bin), a "
                   f"shard glob, or 'synthetic' (random tokens from --seed) (default {d.data})")
    p.add_argument("--val-data", help="validation shard glob (default: a --data DIR's *_val_*.bin)")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), help="preset shape, layers/heads/width: "
                   + ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in MODEL_PRESETS.items()) + " (default d12)")
    p.add_argument("--n-layer", type=int, help="transformer blocks (default: --model's)")
    p.add_argument("--n-head", type=int, help="attention heads, dividing --n-embd (default: --model's or --recipe's)")
    p.add_argument("--n-embd", type=int, help="width of the embeddings and residual stream (default: --model's)")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence; from scratch wpe's rows (default {d.seq_len})")
    p.add_argument("--batch-size", type=int, help=f"sequences per micro-batch per device (default {d.batch_size})")
    p.add_argument("--total-batch-size", type=int, help="tokens per optimizer step, a multiple of batch size x seq "
                   f"len x devices: gradients accumulate up to it (default {d.total_batch_size})")
    p.add_argument("--shuffle", action="store_true", help="read the train shards in llm.c's shuffled order, as "
                   "train_gpt2.c/.cu do (its mt19937, seeded 42 + rank); without it, in order (docs/FORMATS.md)")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {d.steps}: 10B tokens at the default batch)")
    p.add_argument("--time-budget", type=float, help="stop after the step at which the summed step time reaches "
                   "this many seconds, as if it were the last; the lr schedule still spans --steps (default 0: never)")
    p.add_argument("--lr", type=float, help=f"peak learning rate after --warmup (default {d.lr}; see --recipe)")
    p.add_argument("--lr-decay-frac", type=float, help=f"the decay ends at lr x this (default {d.lr_decay_frac})")
    p.add_argument("--warmup", type=int, help=f"steps of linear learning-rate warmup (default {d.warmup})")
    p.add_argument("--weight-decay", type=float, help=f"AdamW's decoupled weight decay (default {d.weight_decay}; "
                   "on the matrices and embeddings: see --recipe)")
    p.add_argument("--grad-clip", type=float, help=f"clip gradients to this norm, 0 = never (default {d.grad_clip})")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="compute dtype; masters and AdamW state stay fp32 "
                   "(default bf16 on a GPU, fp32 on a CPU, which only emulates bf16)")
    p.add_argument("--recompute", choices=RECOMPUTE_LEVELS, help="activation memory against compute: none keeps "
                   "what the backward reads, pointwise recomputes the norms and the MLP activation, block reruns "
                   f"each block's forward in the backward (default {d.recompute})")
    p.add_argument("--seed", type=int, help=f"the init, --data synthetic's tokens, the samples (default {d.seed})")
    p.add_argument("--fp8-head", action="store_true", help="speedrun recipe: the head's training matmuls on FP8 "
                   "operands with modded-nanogpt's static scales; evaluation and files unchanged (default off)")
    p.add_argument("--zero-stage", type=int, help=f"ZeRO stage, {' or '.join(map(str, zero_stages))} here: 0 every "
                   "device holds all optimizer state, 1 shards the AdamW moments and the bf16 weights' fp32 masters, "
                   "3 (JAX) the weights and gradients too (default 0)")
    p.add_argument("--init-from", help="a model file of the recipe to start from, giving the model shape: "
                   + ", ".join(f"{r.file_kind} ({name})" for name, r in recipes.items()))
    p.add_argument("--resume", help="a checkpoint dir to continue from, or 'auto': the newest in --out-dir")
    p.add_argument("--force", action="store_true", help="start over in an --out-dir that holds a run (moved aside)")
    p.add_argument("--out-dir", help=f"log.jsonl, checkpoints and profiles (default {d.out_dir})")
    p.add_argument("--ckpt-every", type=int, help=f"steps between checkpoints, 0 = never (default {d.ckpt_every})")
    p.add_argument("--val-every", type=int, help=f"steps between val losses, 0 = never (default {d.val_every})")
    p.add_argument("--val-tokens", type=int, help="tokens per val loss: the val shards' first val-tokens // seq len "
                   f"sequences (default {d.val_tokens})")
    p.add_argument("--val-steps", type=int, help="shorthand for --val-tokens N x batch size x seq len")
    p.add_argument("--hellaswag-every", type=int, help=f"steps between HellaSwag evaluations, 0 = never (default "
                   f"{d.hellaswag_every})")
    p.add_argument("--hellaswag-limit", type=int, help="HellaSwag examples scored, 0 = all (default 0)")
    p.add_argument("--sample-every", type=int, help=f"steps between samples, 0 = never (default {d.sample_every})")
    p.add_argument("--eval-only", action="store_true", help="val loss and HellaSwag of --init-from or --resume")
    p.add_argument("--profile", action="store_true", help=f"profile the {PROFILE_STEPS} steps after the first "
                   "(a trace in OUT_DIR/profile), then train on")
    given = vars(p.parse_args(argv))
    preset = given.pop("model", None)
    val_steps = given.pop("val_steps", None)  # not kept: it only sets val_tokens
    shape = dict(zip(("n_layer", "n_head", "n_embd"), MODEL_PRESETS[preset or "d12"]))
    d = replace(d, **recipes[given.get("recipe", d.recipe)].defaults)
    cfg = replace(d, **{**shape, **given})
    cfg.block_size = cfg.seq_len
    for flag in ("n_layer", "n_head", "n_embd", "seq_len", "batch_size", "total_batch_size", "steps", "val_tokens"):
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
            die(f"--{flag.replace('_', '-')} is empty (an unset shell variable?): give a path, or leave the flag out")
    if cfg.shuffle and cfg.data == "synthetic":
        die("--shuffle with --data synthetic: --shuffle permutes the samples of token shards, and "
            "synthetic tokens are random already")
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
    if cfg.zero_stage not in zero_stages:
        stages = " or ".join(map(str, zero_stages))
        jax = "; 3 (sharded weights) is the JAX trainer's (train_gpt2_jax.py)" if cfg.zero_stage == 3 else ""
        die(f"--zero-stage {cfg.zero_stage}: this trainer takes {stages}{jax}")
    recipes[cfg.recipe].configure(cfg, given, shape)
    if cfg.n_embd % cfg.n_head:
        die(f"--n-embd {cfg.n_embd} is not divisible by --n-head {cfg.n_head}")
    explicit = {k: given[k] for k in (*shape, "seed") if k in given}
    return cfg, ({**shape, **explicit} if preset else explicit)


def default_dtype(cfg, gpu):
    """Sets an unset --dtype once the device is known, bf16 on a GPU, fp32 on a CPU; returns the start line's words."""
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
        die(f"model file has vocab {header['vocab_size']}/{header['padded_vocab_size']}, expected {VOCAB_SIZE}")
    if "block_size" in header:  # gpt2's position table bounds T; the speedrun model's rotary does not
        if cfg.seq_len > header["block_size"]:
            die(f"--seq-len {cfg.seq_len} exceeds the model file's max sequence length {header['block_size']}")
        cfg.block_size = header["block_size"]
    cfg.n_layer, cfg.n_head, cfg.n_embd = header["n_layer"], header["n_head"], header["n_embd"]
    cfg.padded_vocab_size = header["padded_vocab_size"]
