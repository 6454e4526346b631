"""--shuffle: llm.c's shuffled data order (llmc/rand.h's generator, llmc/dataloader.h's permutations), held
to the generator's published outputs, to cases worked by hand from llm.c's code, and to
tests/llmc_reference.py's word-by-word port of llm.c's loader, which shares no code with the trainers."""
import numpy as np
import pytest

import llmc_reference
from conftest import write_shard
from train_gpt2_jax import ShuffledLoader, ShuffledOrder, make_loaders, permutation_picks, permute
from train_gpt2_jax import Config, main

# std::mt19937 seeded 42: its first ten outputs, as widely published (numpy's RandomState(42) gives them
# too, with the same init_genrand seeding)
MT_SEED_42 = [1608637542, 3421126067, 4083286876, 787846414, 3143890026, 3348747335, 2571218620, 2563451924,
              670094950, 1914837113]
# the C++ standard's check of std::mt19937: the 10000th output of the default seed 5489 is 4123659995
MT_DEFAULT_SEED, MT_10000TH = 5489, 4123659995
# llm.c's rand.h, in its opening comment: seed 137's first five outputs, which torch's generator also gives
MT_SEED_137 = [4053805790, 2173880614, 380293709, 1237255315, 2986595568]


class MersenneTwister(np.random.RandomState):
    """The generator the shuffled order draws from (permutation_picks' rng), with its raw outputs."""

    def draws(self, n):
        return self.randint(0, 2**32, n, dtype=np.uint32)


def test_generator_gives_the_published_outputs():
    """The generator's outputs are the standard MT19937's: std::mt19937(42)'s first ten, the 10000th of the
    default seed that the C++ standard requires, rand.h's own example for seed 137; drawn in pieces that
    cross its 624-word twists, as in one go; and equal to numpy's legacy RandomState for other seeds."""
    assert MersenneTwister(42).draws(10).tolist() == MT_SEED_42
    assert MersenneTwister(MT_DEFAULT_SEED).draws(10000)[-1] == MT_10000TH
    assert MersenneTwister(137).draws(5).tolist() == MT_SEED_137
    rng = MersenneTwister(MT_DEFAULT_SEED)
    pieces = [rng.draws(n) for n in (0, 1, 622, 2, 624, 1300, 7451)]
    assert np.concatenate(pieces).tolist() == MersenneTwister(MT_DEFAULT_SEED).draws(10000).tolist()
    for seed in (0, 43, 2**32 - 1):
        expected = np.random.RandomState(seed)._bit_generator.random_raw(1500)
        np.testing.assert_array_equal(MersenneTwister(seed).draws(1500), expected)


def test_permutation_worked_by_hand():
    """rand.h's random_permutation of 0..3 with a generator seeded 42, by hand: for i = 3, 2, 1 it swaps
    item i with item (next output mod i+1): 1608637542 mod 4 = 2 gives [0,1,3,2]; 3421126067 mod 3 = 2
    (digit sum 32) leaves it; 4083286876 mod 2 = 0 swaps items 1 and 0: [1,0,3,2]. One item or none
    draws nothing."""
    rng = MersenneTwister(42)
    items = [0, 1, 2, 3]
    permute(items, permutation_picks(4, rng))
    assert items == [1, 0, 3, 2]
    assert rng.draws(1).tolist() == MT_SEED_42[3:4]  # three outputs used, no more
    assert permutation_picks(1, rng).size == permutation_picks(0, rng).size == 0
    assert rng.draws(1).tolist() == MT_SEED_42[4:5]


def test_shard_and_sample_order_worked_by_hand():
    """dataloader.h's order for one rank (seed 42) over shards of 1, 3 and 2 samples, by hand from seed 42's
    outputs d1..d10 above. Epoch 1 shuffles the shard order [0,1,2]: d1 mod 3 = 0 swaps 2 and 0, d2 mod 2 = 1
    keeps it: [2,1,0]. Shard 2 opens: d3 mod 2 = 0 gives samples [1,0]. Shard 1: d4 mod 3 = 1 swaps items 2
    and 1, d5 mod 2 = 0 items 1 and 0: [2,0,1]. Shard 0: one sample, no draw. Epoch 2 shuffles the last
    order [2,1,0], not 0..2: d6 mod 3 = 2 keeps, d7 mod 2 = 0 swaps: [1,2,0]. Shard 1: d8 mod 3 = 2 keeps,
    d9 mod 2 = 0 swaps: [1,0,2]. Shard 2: d10 mod 2 = 1 keeps [0,1]. state() counts the shards opened
    before the current one, epochs included, and the samples read of it."""
    order = ShuffledOrder([1, 3, 2], seed=42)
    expected = [(2, 1), (2, 0), (1, 2), (1, 0), (1, 1), (0, 0), (1, 1), (1, 0), (1, 2), (2, 0), (2, 1)]
    got, states = [], []
    for _ in expected:
        states.append(order.state())
        got.append(order.next())
    assert got == expected
    assert states == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0), (3, 0), (3, 1), (3, 2), (4, 0), (4, 1)]
    skipped = ShuffledOrder([1, 3, 2], seed=42)
    skipped.skip(7)  # shards passed whole are never permuted, but their draws are made
    assert skipped.state() == (3, 1) and [skipped.next() for _ in range(4)] == expected[7:]


def write_shards(folder, samples, extra, batch):
    """Train shards holding samples[i] global batches of `batch` tokens, their last target and extra[i]
    tokens more, each with its own tokens (shard i's tokens count up from 10000 i)."""
    folder.mkdir()
    files = []
    for i, (n, more) in enumerate(zip(samples, extra)):
        files.append(str(folder / f"s_train_{i + 1:06d}.bin"))
        write_shard(files[-1], (10000 * i + np.arange(n * batch + 1 + more)) % 50257)
    return files


@pytest.mark.parametrize("processes, devices", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_loader_serves_llmc_order_across_shards_and_ranks(tmp_path, processes, devices):
    """Each process of `devices` llm.c ranks serves, batch after batch through three epochs of shards of
    different lengths, the rows that llm.c's own loader (tests/llmc_reference.py) of each of those ranks
    reads, each rank seeded 42 + its rank and stacked in rank order."""
    B, T, world = 2, 8, processes * devices
    files = write_shards(tmp_path / "shards", [3, 1, 2, 4], [5, 0, world * B * T - 1, 10], world * B * T)
    ours = [ShuffledLoader(files, B, T, p * devices, devices, world) for p in range(processes)]
    llmc = [llmc_reference.ShuffledLoader(files, B, T, r, world) for r in range(world)]
    for _ in range(30):
        for p, loader in enumerate(ours):
            x, y = loader.next_batch()                                             # (devices*B, T) each
            assert x.shape == y.shape == (devices * B, T) and x.dtype == y.dtype == np.int32
            rows = [llmc[r].next_batch() for r in range(p * devices, (p + 1) * devices)]
            np.testing.assert_array_equal(x, np.concatenate([r[0].numpy() for r in rows]))
            np.testing.assert_array_equal(y, np.concatenate([r[1].numpy() for r in rows]))


def test_resume_continues_the_order(tmp_path):
    """A loader put at the state() that process 0 had after n batches (what a checkpoint keeps) serves, in
    every process, what the uninterrupted loader serves next: mid-shard, at a shard's end and across an
    epoch. A state past its shard's samples (another --batch-size) is one line."""
    B, T, devices, world = 2, 8, 2, 4
    files = write_shards(tmp_path / "shards", [3, 1, 2], [7, 0, 3], world * B * T)
    for n in (0, 2, 3, 6, 13):
        for p in (0, 1):
            zero, going = (ShuffledLoader(files, B, T, q * devices, devices, world) for q in (0, p))
            for _ in range(n):
                zero.next_batch()
                going.next_batch()
            resumed = ShuffledLoader(files, B, T, p * devices, devices, world)
            resumed.set_state(*zero.state())
            for _ in range(8):
                for a, b in zip(resumed.next_batch(), going.next_batch()):
                    np.testing.assert_array_equal(a, b)
    loader = ShuffledLoader(files, B, T, 0, devices, world)
    with pytest.raises(SystemExit) as e:
        loader.set_state(1, 3)
    assert str(e.value).startswith("error: --resume: the checkpoint is at sample 3 of train shard ")


def test_make_loaders_makes_each_device_an_llmc_rank(tmp_path):
    """make_loaders with --shuffle, for process 1 of 2 holding 2 devices' rows (a JAX process of 2 local
    devices), serves llm.c ranks 2 and 3 of 4, from the start and from a checkpoint's loader state."""
    B, T = 2, 8
    files = write_shards(tmp_path / "shards", [3, 2], [1, 9], 4 * B * T)
    cfg = Config(data=str(tmp_path / "shards" / "*.bin"), seq_len=T, batch_size=B,
                    total_batch_size=4 * B * T, val_every=0, shuffle=True)
    llmc = [llmc_reference.ShuffledLoader(files, B, T, r, 4) for r in (2, 3)]
    _, train, _ = make_loaders(cfg, 2 * B, 1, 2, (0, 0), print)
    for _ in range(4):
        x, _ = train.next_batch()                                                  # (2B, T)
        np.testing.assert_array_equal(x, np.concatenate([r.next_batch()[0].numpy() for r in llmc]))
    _, zero, _ = make_loaders(cfg, 2 * B, 0, 2, (0, 0), print)
    for _ in range(4):
        zero.next_batch()
    _, resumed, _ = make_loaders(cfg, 2 * B, 1, 2, zero.state(), print)
    for _ in range(6):
        x, _ = resumed.next_batch()                                                # (2B, T)
        np.testing.assert_array_equal(x, np.concatenate([r.next_batch()[0].numpy() for r in llmc]))


def test_resume_refuses_another_order(tmp_path):
    """llm.c's shuffled order is that of its W ranks' samples of B x T tokens: a --shuffle run's checkpoint
    keeps its (--batch-size, --seq-len, devices), and a resume with another batch size, sequence length or
    device count (a process of 2 devices here) is refused in one line, the out dir as it was. (The gradient
    accumulation only groups the micro-batches into steps: the order goes on at any --total-batch-size.)"""
    write_shards(tmp_path / "shards", [5, 4], [3, 0], 32)
    out = tmp_path / "run"
    flags = ["--data", str(tmp_path / "shards" / "*.bin"), "--shuffle", "--n-layer", "1", "--n-head", "2",
             "--n-embd", "32", "--seq-len", "16", "--batch-size", "2", "--total-batch-size", "32", "--dtype",
             "fp32", "--val-every", "0", "--hellaswag-every", "0", "--sample-every", "0", "--ckpt-every", "1",
             "--out-dir", str(out)]
    main([*flags, "--steps", "1"])
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    ours = "--resume: the checkpoint's --shuffle order is that of --batch-size, --seq-len and devices (llm.c's ranks)"
    for change, theirs in ((["--batch-size", "1"], (1, 16, 1)), (["--seq-len", "8", "--total-batch-size", "16"],
                                                                  (2, 8, 1))):
        with pytest.raises(SystemExit) as e:
            main([*flags, *change, "--steps", "2", "--resume", "auto"])
        assert str(e.value) == f"error: {ours} (2, 16, 1), not this run's {theirs}: resume with those"
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    with np.load(out / "ckpt_0000001" / "state.npz") as z:
        assert z["shuffle_layout"].tolist() == [2, 16, 1]
    cfg = Config(data=str(tmp_path / "shards" / "*.bin"), seq_len=16, batch_size=2, total_batch_size=64,
                 val_every=0, shuffle=True)
    with pytest.raises(SystemExit) as e:
        make_loaders(cfg, 4, 0, 1, (0, 1, (2, 16, 1)), print)
    assert str(e.value) == f"error: {ours} (2, 16, 1), not this run's (2, 16, 2): resume with those"
