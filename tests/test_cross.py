"""Cross-framework: every GPT-2 trainer against llm.c's recipe and against each other."""
import importlib
import io
import math
import re
import sys

import numpy as np
import pytest

import llmc_reference
from conftest import (assert_clean_error, read_log, run_script, run_with_terminal_stderr, step_events,
                      tiny_params, write_model_file, write_shard)
from train_gpt2_jax import latest_checkpoint, load_checkpoint, save_checkpoint
from train_gpt2_jax import DataLoader, val_batches
from train_gpt2_jax import PARAM_NAMES

# log.jsonl's framework name: the command line that runs it. Backend triton is held to backend torch
# in tests/test_triton.py (same shards, same model file, fp32): on the CPU its kernels run in Triton's
# interpreter, where these six steps with the 50304-wide lm head would take over five minutes.
TRAINERS = {
    "jax": ["train_gpt2_jax.py"],
    "torchfunc": ["train_gpt2_torchfunc.py"],
    "triton-torch": ["train_gpt2_triton.py", "torch"],
}
B, T, TOTAL, STEPS, LR, WARMUP = 4, 32, 256, 6, 1e-3, 2  # two micro-batches per step
FLAGS = ["--seq-len", T, "--batch-size", B, "--total-batch-size", TOTAL, "--lr", LR, "--warmup", WARMUP,
         "--dtype", "fp32", "--val-steps", 2, "--hellaswag-every", 0, "--sample-every", 0]
# fp32 trainers against the float64 reference: summation order and fp32 rounding only (measured on the CPU:
# at most 1.2e-7 for losses and grad norms alike). Each trainer within 5e-6 of it puts any two trainers
# within 1e-5 of each other.
LOSS_RTOL, NORM_RTOL = 5e-6, 5e-6


@pytest.fixture(scope="module")
def split_shards(tmp_path_factory, shakespeare_tokens):
    """tiny_shards' val shard, and train shards of 3, 4 and 2 micro-batches of B x T tokens (and their last
    target, and 20, 0 and 100 tokens more): a run of STEPS steps (12 micro-batches), in order or with
    --shuffle, crosses each shard's end and wraps back to the first (a second epoch)."""
    d = tmp_path_factory.mktemp("split_shards")
    write_shard(d / "tiny_val_000000.bin", shakespeare_tokens[:32768])
    start = 32768
    for i, (batches, more) in enumerate(((3, 20), (4, 0), (2, 100))):
        n = batches * B * T + 1 + more
        write_shard(d / f"tiny_train_{i + 1:06d}.bin", shakespeare_tokens[start: start + n])
        start += n
    return d


@pytest.fixture(scope="module")
def reference(split_shards, tiny_model_file):
    """llm.c's recipe in float64 (tests/llmc_reference.py) for the schedules and data orders the tests below
    use on split_shards: in order (train_gpt2.py's), and shuffled (train_gpt2.c's)."""
    files = lambda d, kind: sorted(str(p) for p in d.glob(f"*_{kind}_*.bin"))  # noqa: E731
    run = lambda d, decay, shuffle: llmc_reference.train(  # noqa: E731
        tiny_model_file, files(d, "train"), B, T, TOTAL, STEPS, LR, WARMUP, decay_frac=decay,
        val_files=files(d, "val"), val_steps=2, shuffle=shuffle)
    return {"cosine": run(split_shards, 0.0, False), "shuffled": run(split_shards, 1.0, True)}


def check_against(reference, events, vals, first_step):
    for e in events:
        loss, norm, lr, _ = reference[e["step"] - 1]
        assert e["train_loss"] == pytest.approx(loss, rel=LOSS_RTOL), f"step {e['step']} loss"
        assert e["grad_norm"] == pytest.approx(norm, rel=NORM_RTOL), f"step {e['step']} grad norm"
        assert e["lr"] == pytest.approx(lr, rel=1e-9), f"step {e['step']} lr"
    for e in vals:
        assert e["val_loss"] == pytest.approx(reference[e["step"] - 1][3], rel=LOSS_RTOL), \
            f"step {e['step']} val loss"
    assert [e["step"] for e in events] == list(range(first_step, first_step + len(events)))


@pytest.mark.parametrize("framework", TRAINERS)
def test_trainer_matches_llmc_recipe(framework, reference, split_shards, tiny_model_file, tmp_path):
    """In fp32, from the same llm.c model file and shards (three small train shards, each read to its end
    and wrapped around), the trainer's per-step train loss, grad norm, lr and val loss equal llm.c's recipe
    run in float64 by stock PyTorch (rel 5e-6), so the trainers agree with each other within 1e-5."""
    out = tmp_path / framework
    run_script(*TRAINERS[framework], "--data", split_shards, "--init-from", tiny_model_file,
               "--steps", STEPS, "--out-dir", out, "--val-every", 1, "--ckpt-every", 0, *FLAGS)
    events = step_events(out)
    assert len(events) == STEPS and all(e["framework"] == framework for e in events)
    check_against(reference["cosine"], events, [e for e in read_log(out) if "val_loss" in e], 1)


def test_checkpoint_passes_between_frameworks_in_llmc_shuffled_order(reference, split_shards,
                                                                      tiny_model_file, tmp_path):
    """One --shuffle run handed on through checkpoints: JAX trains steps 1-2, torchfunc resumes for 3-4,
    the Triton trainer (torch backend) for 5-6, across shards and into a second epoch; every step equals
    the uninterrupted reference run in train_gpt2.c's shuffled order (llm.c's dataloader.h)."""
    chain = [("jax", 2), ("torchfunc", 4), ("triton-torch", 6)]
    ckpt = None
    for framework, until in chain:
        out = tmp_path / framework
        start = ["--resume", ckpt] if ckpt else ["--init-from", tiny_model_file]
        run_script(*TRAINERS[framework], "--data", split_shards, "--shuffle", *start, "--steps", until,
                   "--lr-decay-frac", 1.0, "--out-dir", out, "--val-every", 0, "--ckpt-every", until,
                   *FLAGS)
        events = step_events(out)
        check_against(reference["shuffled"], events, [], until - 1 if ckpt else 1)
        ckpt = out / f"ckpt_{until:07d}"


MODULES = ["train_gpt2_jax", "train_gpt2_torchfunc", "train_gpt2_triton"]


def three_shards(folder):
    """Three train shards of 134, 101 and 77 tokens, shard i holding 1000 i, 1000 i + 1, ...: with batches of
    32 tokens, 4, 3 and 2 batches and 6, 5 and 13 tokens left over."""
    files = []
    for i, n in enumerate((134, 101, 77)):
        files.append(str(folder / f"t_train_{i + 1:06d}.bin"))
        write_shard(files[-1], (np.arange(n) + 1000 * i) % 50257)
    return files


def test_the_loader_reads_each_shard_from_its_start(tmp_path):
    """Across shard ends and the wrap back to the first, each batch holds the 33 tokens that follow its
    start (x the first 32, y the last 32), the starts worked out by hand from llm.c's rule: each shard from
    token 0 in steps of 32 while start + 33 fits in it, the rest of it skipped. With 2 ranks of half the
    rows, rank r's 17 tokens start r * 16 further on."""
    files = three_shards(tmp_path)
    starts = [(0, 0), (0, 32), (0, 64), (0, 96), (1, 0), (1, 32), (1, 64), (2, 0), (2, 32), (0, 0), (0, 32)]
    for world in (1, 2):
        B, T = 4 // world, 8
        loaders = [DataLoader(files, B, T, rank, world) for rank in range(world)]
        for shard, start in starts:
            for rank, loader in enumerate(loaders):
                x, y = loader.next_batch()                                                    # (B, T) each
                tokens = 1000 * shard + start + rank * B * T + np.arange(B * T + 1)
                np.testing.assert_array_equal(x.ravel(), tokens[:-1], err_msg=f"{world} {shard} {start}")
                np.testing.assert_array_equal(y.ravel(), tokens[1:], err_msg=f"{world} {shard} {start}")


def test_ranks_read_what_one_reader_reads(tmp_path):
    """Two ranks of B rows read, step after step and across shard ends (wrapping around), exactly the rows
    that one loader of 2B rows reads, and both report its position. The shard lengths leave rank 1 (whose
    rows start B*T further on) too little room for a next step while rank 0 still has it: llm.c's test
    of each rank's own position moves rank 1 to the next shard a step early there."""
    B, T = 2, 8
    files = three_shards(tmp_path)
    one = DataLoader(files, 2 * B, T)
    ranks = [DataLoader(files, B, T, rank, 2) for rank in range(2)]
    for _ in range(20):
        x, y = one.next_batch()                                                    # (2B, T) each
        parts = [loader.next_batch() for loader in ranks]
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)
        assert all(loader.state() == one.state() for loader in ranks)


def test_bf16_model_file_loads_everywhere(tmp_path):
    """An llm.c model file in bf16 (version 5, as llm.c's train_gpt2.py also writes) loads in every
    trainer to exactly its values."""
    params = [(t.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32) for t in tiny_params(seed=3)]
    path = tmp_path / "tiny_bf16.bin"
    write_model_file(path, params, block_size=64, n_layer=2, n_head=4, n_embd=64, bf16=True)
    assert path.stat().st_size == 1024 + 2 * sum(t.size for t in params)
    for module in MODULES:
        mod = importlib.import_module(module)
        header, loaded = mod.read_model_file(str(path))
        assert (header["n_layer"], header["n_head"], header["n_embd"]) == (2, 4, 64), module
        for name, t in zip(PARAM_NAMES, params):
            np.testing.assert_array_equal(loaded[name], t, err_msg=f"{module} {name}")


SCRATCH = ["--data", "synthetic", "--n-layer", 2, "--n-head", 4, "--n-embd", 64, "--seq-len", 32,
           "--batch-size", 2, "--total-batch-size", 128, "--steps", 2, "--seed", 7, "--lr", 1e-3,
           "--warmup", 1, "--val-every", 0, "--hellaswag-every", 0, "--sample-every", 0, "--ckpt-every", 0]


def test_from_scratch_on_synthetic_tokens(tmp_path):
    """From --seed alone (no model file) on --data synthetic, in fp32 every trainer draws the same init
    and the same tokens: equal losses and grad norms (rel 1e-5); step 1's loss is that of near-uniform
    logits (ln 50257, within 0.05). In bf16 each trainer stays within 0.005 of its fp32 losses."""
    runs = {}
    for framework, script in TRAINERS.items():
        for dtype in ("fp32", "bf16"):
            out = tmp_path / f"{framework}_{dtype}"
            run_script(*script, *SCRATCH, "--dtype", dtype, "--out-dir", out)
            runs[framework, dtype] = [(e["train_loss"], e["grad_norm"]) for e in step_events(out)]
    first = runs["jax", "fp32"]
    assert len(first) == 2 and first[0][0] == pytest.approx(math.log(50257), abs=0.05)
    for framework in TRAINERS:
        for (loss, norm), (loss0, norm0) in zip(runs[framework, "fp32"], first, strict=True):
            assert loss == pytest.approx(loss0, rel=1e-5) and norm == pytest.approx(norm0, rel=1e-5)
        for (loss, _), (loss32, _) in zip(runs[framework, "bf16"], runs[framework, "fp32"], strict=True):
            assert loss == pytest.approx(loss32, abs=5e-3), framework


def test_checkpoint_save_clears_a_crashed_save(tmp_path):
    """A save finds what a run that died while saving the same step left behind (a half-written .tmp dir, an
    .old dir from a replacement cut short) and still writes a complete checkpoint; saving the step again
    replaces it whole; a resume reads back the weights, moments and data position."""
    mod = importlib.import_module("train_gpt2_jax")  # its Config and RECIPES; the checkpoints are the shared plumbing's
    cfg = mod.Config(n_layer=2, n_head=4, n_embd=64, block_size=64, seq_len=32)
    shapes = mod.param_shapes(cfg)
    rng = np.random.default_rng(0)
    params, m, v = ({k: rng.standard_normal(shapes[k]).astype(np.float32) for k in PARAM_NAMES}
                    for _ in range(3))
    final = tmp_path / "ckpt_0000002"
    for stale in ("ckpt_0000002.tmp", "ckpt_0000002.old"):
        (tmp_path / stale).mkdir()
        (tmp_path / stale / "model.bin").write_bytes(b"half")
    assert save_checkpoint(str(tmp_path), 2, params, m, v, (0, 64), cfg) == str(final)
    params["wte"][0, 0] = 7.0
    save_checkpoint(str(tmp_path), 2, params, m, v, (0, 96), cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_0000002"]
    assert latest_checkpoint(str(tmp_path)) == str(final)
    _, loaded, m2, v2, state = load_checkpoint(str(final), cfg)
    assert state["step"] == 2 and (state["shard"], state["position"]) == (0, 96)
    for k in PARAM_NAMES:
        np.testing.assert_array_equal(loaded[k], params[k])
        np.testing.assert_array_equal(m2[k], m[k])
        np.testing.assert_array_equal(v2[k], v[k])


class Terminal(io.StringIO):
    """A stand-in for a terminal's stderr: collects what is written, and says it is a tty."""

    def isatty(self):
        return True


@pytest.mark.parametrize("framework", TRAINERS)
def test_eval_only_shows_progress_on_a_terminal(framework, tiny_shards, tiny_model_file, hellaswag_dir,
                                                 tmp_path, monkeypatch):
    """--eval-only with stderr on a terminal draws a bar for a long validation (over 20 batches) and one
    for HellaSwag. A validation of 20 batches or fewer, or another process than rank 0, draws none (the
    bars stay off a stderr that is not a terminal: tests/test_data.py); the last batch may count fewer
    rows than it holds (val_batches: --val-tokens)."""
    code, _, terminal = run_with_terminal_stderr(
        *TRAINERS[framework], "--data", tiny_shards, "--init-from", tiny_model_file, "--eval-only",
        "--seq-len", T, "--batch-size", B, "--dtype", "fp32", "--val-steps", 21, "--out-dir", tmp_path,
        env={"HELLASWAG_DIR": str(hellaswag_dir), "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""},
        timeout=300)
    assert code == 0, terminal[-3000:]
    assert re.search(r"\bval: .*/21 \[", terminal) and "hellaswag val:" in terminal, terminal[-3000:]
    mod = importlib.import_module(TRAINERS[framework][0][:-3])
    monkeypatch.setattr(sys, "stderr", Terminal())
    # global batches of 2 rows of 8 tokens: 40 rows fill 20, 41 rows take a 21st with one row counted
    for rows, counted, rank, bar in ((40, [2] * 20, 0, False), (41, [2] * 20 + [1], 1, False),
                                     (41, [2] * 20 + [1], 0, True)):
        loader = DataLoader(None, 1, 8, rank=rank, world=2)
        batches = val_batches(mod.Config(val_tokens=8 * rows, seq_len=8), loader)
        assert list(batches) == counted and isinstance(batches, list) != bar


# tiktoken with neither its files cached nor the network: an empty cache and a proxy nobody listens on
NO_TIKTOKEN = {"https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "no_proxy": "",
               "NO_PROXY": "", "CUDA_VISIBLE_DEVICES": ""}


def test_tiktoken_unavailable_is_a_clean_error(tmp_path):
    """Where tiktoken can neither read GPT-2's files from its cache nor download them (a first run
    offline), prepro_fineweb.py --bench, which times tiktoken itself, stops with one line that names
    tiktoken and its cache, no traceback. (The trainers' sampler, hellaswag.py and prepro_fineweb.py's
    tokenizing fall back to the committed GPT-2 files: test_data's test_gpt2_encoding_offline_* and
    test_prepro_offline_*; tokenizer.py bench builds tiktoken's GPT-2 from them: test_cli_bench_offline.)"""
    env = {**NO_TIKTOKEN, "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_cache")}
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n" * 50)
    proc = run_script("prepro_fineweb.py", "--input", text, "--out-dir", tmp_path / "shards", "--workers", 1,
                      "--bench", env=env, check=False)
    assert_clean_error(proc, "tiktoken could not load GPT-2's encoding", "TIKTOKEN_CACHE_DIR")
