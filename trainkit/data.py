"""llm.c's token shards (docs/FORMATS.md) and its data loader: read_shard, find_shards, DataLoader,
step_batches; and which rows of the val shards a validation counts (val_batches, check_val_tokens)."""
import glob
import os

import numpy as np

import hellaswag
from trainkit import die
from trainkit.gpt2 import VOCAB_SIZE

SHARD_MAGIC = 20240520


SYNTHETIC_TOKENS = 1 << 23  # length of the random "shard" behind --data synthetic


GET_DATA = ("get shards with `python prepro_fineweb.py` (it writes data/fineweb_edu), or use --data "
            "synthetic for a benchmark")


def read_shard(path):
    """An llm.c token shard (docs/FORMATS.md) as a read-only uint16 memmap, after checking its header and
    size."""
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
    """(train files, val files) for --data DIR | GLOB, and --val-data GLOB (which also overrides a DIR's val
    shards); (None, None) if synthetic. --eval-only needs no train shards."""
    if cfg.data == "synthetic":
        return None, None
    if os.path.isdir(cfg.data):
        folder = glob.escape(cfg.data)  # a directory's name is no pattern, brackets and all
        train = sorted(glob.glob(os.path.join(folder, "*_train_*.bin")))
        val = sorted(glob.glob(os.path.join(folder, "*_val_*.bin")))
        if not train and not cfg.eval_only:
            die(f"--data {cfg.data}: no *_train_*.bin shards in that directory ({GET_DATA})")
    else:
        train, val = sorted(glob.glob(cfg.data)), []
        if not train and not cfg.eval_only:
            die(f"--data {cfg.data}: no such directory and no file matches that glob ({GET_DATA})")
    if cfg.val_data:
        val = sorted(glob.glob(cfg.val_data))
        if not val:
            die(f"--val-data {cfg.val_data}: no file matches that glob")
    return train, val


class DataLoader:
    """llm.c's DistributedDataLoader: rank r reads B*T+1 tokens at position p + r*B*T of the current shard,
    all ranks advance p by W*B*T, and all move to the next shard (wrapping around) when fewer than W*B*T+1
    tokens remain after p. (llm.c tests each rank's own position p + r*B*T, so near a shard's end its ranks
    part ways; testing p keeps them together: W ranks of B rows read what one rank of W*B rows reads.)
    files=None reads one in-memory shard of random tokens drawn from `seed`."""

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
                # here and not in read_shard: the max reads the whole shard, so only a shard put to use pays
                top = int(self.tokens.max())
                if top >= VOCAB_SIZE:
                    die(f"shard {self.files[shard]} holds token ids up to {top}, outside GPT-2's vocabulary "
                        f"of {VOCAB_SIZE} tokens (written with another tokenizer?)")
        self.shard = shard

    def reset(self):
        self.set_state(0, 0)

    def set_state(self, shard, position):
        """Puts the loader at p = `position` in `shard` (what state() returned)."""
        self._load(shard)
        self.position = position

    def state(self):
        """(shard, p): where the next step's rank 0 batch starts, for checkpoints."""
        return self.shard, self.position

    def next_batch(self):
        B, T = self.B, self.T
        start = self.position + self.rank * B * T
        buf = np.asarray(self.tokens[start: start + B * T + 1], dtype=np.int32)
        x, y = buf[:-1].reshape(B, T), buf[1:].reshape(B, T)  # (B, T) inputs, (B, T) targets
        self.position += self.world * B * T
        if self.position + self.world * B * T + 1 > len(self.tokens):
            n_shards = len(self.files) if self.files else 1
            self.set_state((self.shard + 1) % n_shards, 0)
        return x, y


def step_batches(loader, grad_accum):
    """The next optimizer step's micro-batches, stacked: x, y (A,B,T) int32."""
    xs, ys = zip(*(loader.next_batch() for _ in range(grad_accum)))
    return np.stack(xs), np.stack(ys)


VAL_BAR_MIN_STEPS = 20  # a validation of more batches than this shows a progress bar (on a terminal)


def val_batches(cfg, loader):
    """How many rows of each global batch of the validation count: the first cfg.val_tokens // T sequences
    of the val shards, the same ones at any batch size and device count (all of every batch but the
    last). Behind a progress bar on a terminal's stderr when there are many batches (rank 0 draws it)."""
    rows, batch = cfg.val_tokens // cfg.seq_len, loader.B * loader.world
    counted = [min(batch, rows - first) for first in range(0, rows, batch)]
    if len(counted) <= VAL_BAR_MIN_STEPS or loader.rank != 0:
        return counted
    return hellaswag.terminal_progress(counted, len(counted), "val")


def check_val_tokens(cfg, loader):
    """A validation (--eval-only, or --val-every) must find its --val-tokens in the val shards as this run
    reads them, none twice: whole global batches from each shard in turn, moving on where one no longer
    fits. Else one line says what they hold."""
    if loader is None or not (cfg.eval_only or cfg.val_every > 0):
        return
    batch, rows = loader.B * loader.world, cfg.val_tokens // cfg.seq_len
    sizes = [len(read_shard(f)) for f in loader.files]
    held = sum((n - 1) // (batch * cfg.seq_len) for n in sizes) * batch
    if rows > held:
        die(f"--val-tokens {cfg.val_tokens} asks for {rows} sequences of {cfg.seq_len} tokens, but the val "
            f"shards ({len(sizes)} file(s), {sum(sizes)} tokens) hold {held} in this run's batches of "
            f"{batch} sequences: lower --val-tokens (or --val-steps)")



def make_loaders(cfg, rows, rank, ranks, loader_state, say):
    """(micro-batches per step, train loader, val loader) of this process: `rows` rows of each global
    batch, as llm.c's loader of rank `rank` of `ranks` reads them; the train loader (None with --eval-only)
    at `loader_state`, the val loader None without val shards (said with `say` where a validation was
    asked for)."""
    T = cfg.seq_len
    grad_accum = grad_accum_steps(cfg, rows * ranks // cfg.batch_size)
    train_files, val_files = find_shards(cfg)
    train = None if cfg.eval_only else DataLoader(train_files, rows, T, rank, ranks, seed=cfg.seed)
    val = DataLoader(val_files, rows, T, rank, ranks) if val_files else None
    check_val_tokens(cfg, val)
    if train is not None:
        n_shards = len(train_files) if train_files else 1
        shard, position = loader_state
        if shard >= n_shards:
            die(f"--resume: the checkpoint is at train shard {shard}, but --data has {n_shards} shards")
        train.set_state(shard, position)
        batch = rows * ranks * T
        if position + batch + 1 > len(train.tokens):
            die(f"--resume: the checkpoint's position {position} leaves less than one batch of {batch} "
                f"tokens in train shard {shard} (a different --batch-size or --data than the run had?)")
    if val is None and (cfg.eval_only or cfg.val_every > 0):
        say(f"no validation shards in --data {cfg.data} (give --val-data GLOB): val loss skipped")
    return grad_accum, train, val


def grad_accum_steps(cfg, world):
    """Micro-batches per optimizer step: --total-batch-size over the tokens that one micro-batch on every
    device holds, which must divide it."""
    tokens = cfg.batch_size * cfg.seq_len * world
    if cfg.total_batch_size % tokens:
        die(f"--total-batch-size {cfg.total_batch_size} is not a multiple of --batch-size x --seq-len "
            f"x devices = {tokens}")
    return cfg.total_batch_size // tokens
