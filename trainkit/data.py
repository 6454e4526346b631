"""llm.c's token shards (docs/FORMATS.md) and its data loaders, in order and shuffled (--shuffle), and which
rows of the val shards a validation counts."""
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
    """An llm.c token shard as a read-only uint16 memmap, its header and size checked."""
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
        die(f"shard {path} is truncated or padded: header says {ntok} tokens, file holds {(size - 1024) // 2}")
    return np.memmap(path, dtype=np.uint16, mode="r", offset=256 * 4, shape=(ntok,))


def find_shards(cfg):
    """(train files, val files) of --data DIR | GLOB and --val-data GLOB; (None, None) for synthetic."""
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


def shard_lengths(files, batch):
    """Tokens in each shard of `files`, each checked to hold a global batch of `batch` tokens and its last target."""
    lengths = [len(read_shard(f)) for f in files]
    for f, n in zip(files, lengths):
        if n < batch + 1:
            die(f"shard {f} holds fewer than {batch + 1} tokens, one batch needs that")
    return lengths


def read_vocab_shard(path):
    """read_shard's tokens checked to be GPT-2's: as a loader opens the shard, since the max reads all of it."""
    tokens = read_shard(path)
    top = int(tokens.max())
    if top >= VOCAB_SIZE:
        die(f"shard {path} holds token ids up to {top}, outside GPT-2's vocabulary of {VOCAB_SIZE} tokens "
            "(written with another tokenizer?)")
    return tokens


class DataLoader:
    """llm.c's DistributedDataLoader: rank r reads B*T+1 tokens at p + r*B*T; files=None: random tokens from `seed`."""
    # all ranks change shards by p (llm.c: each by its own), so W ranks of B rows read what one of W*B rows reads

    def __init__(self, files, B, T, rank=0, world=1, seed=0):
        self.files, self.B, self.T, self.rank, self.world, self.seed = files, B, T, rank, world, seed
        self.shard, self.tokens = None, None
        shard_lengths(files or [], world * B * T)
        self.reset()

    def reset(self):
        self.set_state(0, 0)

    def set_state(self, shard, position):
        """Puts the loader at p = `position` in `shard`, as state() returned them."""
        if self.shard != shard or self.tokens is None:
            if self.files is None:
                n = max(SYNTHETIC_TOKENS, 2 * (self.world * self.B * self.T + 1))
                self.tokens = np.random.default_rng(self.seed).integers(0, VOCAB_SIZE, n, dtype=np.uint16)
            else:
                self.tokens = read_vocab_shard(self.files[shard])
        self.shard, self.position = shard, position

    def state(self):
        """(shard, p): where the next step's rank 0 batch starts, for checkpoints."""
        return self.shard, self.position

    def next_batch(self):
        B, T = self.B, self.T
        start = self.position + self.rank * B * T
        buf = np.asarray(self.tokens[start: start + B * T + 1], dtype=np.int32)
        x, y = buf[:-1].reshape(B, T), buf[1:].reshape(B, T)  # (B, T) inputs, (B, T) targets
        self.position += self.world * B * T
        if self.position + self.world * B * T + 1 > len(self.tokens):  # the next shard, wrapping around
            self.set_state((self.shard + 1) % (len(self.files) if self.files else 1), 0)
        return x, y


# --shuffle: llm.c's own Mersenne Twister (llmc/rand.h) and shuffled order (llmc/dataloader.h)

SHUFFLE_SEED = 42  # llm.c seeds rank r's shuffle with 42 + r, whatever seeds the rest of the run


class MersenneTwister:
    """MT19937 as llm.c's rand.h runs it, seeded as init_genrand: numpy's legacy RandomState(seed) is that one."""

    def __init__(self, seed):
        self.rng = np.random.RandomState(seed)

    def draws(self, n):
        """The next n 32-bit outputs (a full-range randint is the raw output)."""
        return self.rng.randint(0, 2**32, n, dtype=np.uint32)


def permutation_picks(n, rng):
    """llm.c's random_permutation of n items: for i = n-1 down to 1, the j (a draw mod i+1) that item i swaps with."""
    return rng.draws(max(n - 1, 0)) % np.arange(n, 1, -1, dtype=np.uint32)


def permute(items, picks):
    """Shuffles the list `items` in place by permutation_picks' swaps."""
    for i, j in zip(range(len(items) - 1, 0, -1), picks.tolist()):
        items[i], items[j] = items[j], items[i]


class ShuffledOrder:
    """The (shard, sample) that llm.c's shuffling loader of one rank reads in turn (llmc/dataloader.h)."""
    # an epoch shuffles the last epoch's shard order, then each shard it opens its samples; one generator draws both

    def __init__(self, counts, seed):
        self.counts, self.rng = counts, MersenneTwister(seed)
        self.order = list(range(len(counts)))
        self.opened = -1  # shards opened since the run began, before the current one
        self._new_epoch()

    def _new_epoch(self):
        permute(self.order, permutation_picks(len(self.order), self.rng))
        self._open(0)

    def _open(self, k):
        """Opens the epoch's k-th shard: its permutation is drawn now, and built once a sample is read."""
        self.k, self.sample, self.opened = k, 0, self.opened + 1
        self.picks, self.samples = permutation_picks(self.counts[self.order[k]], self.rng), None

    def _move_on(self):
        """To the next shard, or a new epoch after the last."""
        self._new_epoch() if self.k == len(self.order) - 1 else self._open(self.k + 1)

    def shard(self):
        return self.order[self.k]

    def next(self):
        """(shard, sample) to read now; then moves on."""
        if self.samples is None:
            self.samples = list(range(self.counts[self.shard()]))
            permute(self.samples, self.picks)
        here = self.shard(), self.samples[self.sample]
        self.sample += 1
        if self.sample == len(self.samples):
            self._move_on()
        return here

    def skip(self, n):
        """Moves on n samples, as n next() calls do, building no permutation of the shards it passes."""
        while n >= self.counts[self.shard()] - self.sample:
            n -= self.counts[self.shard()] - self.sample
            self._move_on()
        self.sample += n

    def state(self):
        """(shards opened before the current one since the run began, samples read of it)."""
        return self.opened, self.sample


class ShuffledLoader:
    """llm.c's loader with should_shuffle, as its ranks first..first+k-1 of `world` read, their rows stacked."""
    # rank g's order seeded 42 + g reads B*T+1 tokens at sample*W*B*T + g*B*T of its shard

    def __init__(self, files, B, T, first, k, world):
        self.files, self.B, self.T, self.first, self.k, self.world = files, B, T, first, k, world
        # samples per shard: llm.c's (tokens - 1) // (W*B*T), the last token only ever a target
        self.counts = [(n - 1) // (world * B * T) for n in shard_lengths(files, world * B * T)]
        self.set_state(0, 0)

    def set_state(self, opened, sample):
        """Puts every rank where rank 0's state() was `(opened, sample)`: each replays as many samples."""
        first, served = ShuffledOrder(self.counts, SHUFFLE_SEED), 0
        while first.opened < opened:  # a whole shard at a time
            served += self.counts[first.shard()]
            first.skip(self.counts[first.shard()])
        if sample >= self.counts[first.shard()]:
            die(f"--resume: the checkpoint is at sample {sample} of train shard {self.files[first.shard()]}, "
                f"which holds {self.counts[first.shard()]} (a different --batch-size or --data than the run had?)")
        self.orders = [ShuffledOrder(self.counts, SHUFFLE_SEED + g) for g in range(self.first, self.first + self.k)]
        for order in self.orders:
            order.skip(served + sample)
        self.tokens = {}  # the shards the ranks read now: file index -> tokens

    def state(self):
        """The first rank's ShuffledOrder.state(): in process 0, llm.c rank 0's, which checkpoints keep."""
        return self.orders[0].state()

    def next_batch(self):
        B, T, rows = self.B, self.T, []
        for g, order in enumerate(self.orders, self.first):
            shard, sample = order.next()
            if shard not in self.tokens:
                self.tokens[shard] = read_vocab_shard(self.files[shard])
            start = (sample * self.world + g) * B * T
            rows.append(self.tokens[shard][start: start + B * T + 1])
        self.tokens = {s: t for s, t in self.tokens.items() if s in {o.shard() for o in self.orders}}
        buf = np.stack(rows).astype(np.int32)                                       # (k, B*T+1)
        x = buf[:, :-1].reshape(self.k * B, T)                                      # (k*B, T) inputs
        y = buf[:, 1:].reshape(self.k * B, T)                                       # (k*B, T) targets
        return x, y


def step_batches(loader, grad_accum):
    """The next optimizer step's micro-batches, stacked: x, y (A,B,T) int32."""
    xs, ys = zip(*(loader.next_batch() for _ in range(grad_accum)))
    return np.stack(xs), np.stack(ys)


VAL_BAR_MIN_STEPS = 20  # a validation of more batches than this shows a progress bar (on a terminal)


def val_batches(cfg, loader):
    """Rows counted of each global val batch: the first val_tokens // T sequences, the same at any batch size."""
    rows, batch = cfg.val_tokens // cfg.seq_len, loader.B * loader.world
    counted = [min(batch, rows - first) for first in range(0, rows, batch)]
    if len(counted) <= VAL_BAR_MIN_STEPS or loader.rank != 0:
        return counted
    return hellaswag.terminal_progress(counted, len(counted), "val")


def make_loaders(cfg, rows, rank, ranks, loader_state, say):
    """(micro-batches per step, train loader at `loader_state`, val loader) of rank `rank` of `ranks`, `rows` rows."""
    T = cfg.seq_len
    tokens = cfg.batch_size * T * (rows * ranks // cfg.batch_size)  # one micro-batch on every device
    if cfg.total_batch_size % tokens:
        die(f"--total-batch-size {cfg.total_batch_size} is not a multiple of --batch-size x --seq-len "
            f"x devices = {tokens}")
    train_files, val_files = find_shards(cfg)
    if cfg.eval_only:
        train = None
    elif cfg.shuffle:  # each device of this process is an llm.c rank of --batch-size rows
        per = rows // cfg.batch_size
        train = ShuffledLoader(train_files, cfg.batch_size, T, rank * per, per, ranks * per)
        train.set_state(*loader_state)
    else:
        train = DataLoader(train_files, rows, T, rank, ranks, seed=cfg.seed)
    val = DataLoader(val_files, rows, T, rank, ranks) if val_files else None
    if val is not None and (cfg.eval_only or cfg.val_every > 0):  # its --val-tokens in whole batches, none twice
        batch, wanted = val.B * val.world, cfg.val_tokens // T
        sizes = [len(read_shard(f)) for f in val.files]
        held = sum((n - 1) // (batch * T) for n in sizes) * batch
        if wanted > held:
            die(f"--val-tokens {cfg.val_tokens} asks for {wanted} sequences of {T} tokens, but the val shards "
                f"({len(sizes)} file(s), {sum(sizes)} tokens) hold {held} in this run's batches of {batch} "
                "sequences: lower --val-tokens (or --val-steps)")
    if isinstance(train, DataLoader):
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
    return cfg.total_batch_size // tokens, train, val
