"""train_aiayn_jax.py: the Attention Is All You Need translator

A tiny model trained on the first 6,000 Multi30k pairs (the offline copy); its decoding (beam search,
greedy, the incremental decoder), BLEU, checkpoints, downloads and bad input."""
import gzip
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import sacrebleu

from conftest import (REPO, assert_clean_error, read_log, run_script, run_script_on_a_full_disk, data_file,
                      signal_after_line, step_events)
from train_aiayn_jax import latest_checkpoint

import train_aiayn_jax as aiayn  # noqa: E402  (conftest puts the repository on sys.path)

SCRIPT = "train_aiayn_jax.py"
SUBSET = {"train": 6000, "val": 100, "test_2016_flickr": 60}
# one bucket (16 tokens) of short pairs, a 2,500-token BPE that learns in a second, fp32 (fast on a CPU)
TINY = ["--model", "tiny", "--bpe-vocab", "2500", "--max-len", "16", "--batch-tokens", "512",
        "--warmup", "10", "--lr", "3e-3", "--dtype", "fp32", "--decode-batch", "30"]
STEPS, CKPT_EVERY = 40, 20
LAST = f"ckpt_{STEPS:07d}"


def first_lines(path, n):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().split("\n")[:n]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The first lines of each Multi30k En-De split, gzip'd under the dataset's file names."""
    d = tmp_path_factory.mktemp("multi30k")
    for split, n in SUBSET.items():
        for lang in ("en", "de"):
            lines = first_lines(data_file(f"multi30k/{split}.{lang}.gz"), n)
            with gzip.open(d / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    return d


@pytest.fixture(autouse=True)
def on_cpu():
    """Every test here runs JAX on the CPU, GPU or not: the checks compare runs bit for bit, and GPU
    reductions (the embedding gradient's scatter-add) need not repeat exactly."""
    import jax
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(scope="module")
def jax_env(tmp_path_factory):
    """The scripts' environment: the CPU (as on_cpu), and a persistent XLA compilation cache shared by
    this module's runs (the resumed run compiles the same train step as the first one)."""
    return {"JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


@pytest.fixture(scope="module")
def trained(data_dir, jax_env, tmp_path_factory):
    """(out dir, stdout) of a tiny model trained for 40 steps, checkpointed every 20, its last weights
    scored on 60 test sentences. Greedy: this undertrained a model's beam search prefers the empty
    translation (EOS is its likeliest first token among the best 4), which would make a weak test."""
    out = tmp_path_factory.mktemp("run")
    proc = run_script(SCRIPT, *TINY, "--data-dir", data_dir, "--out-dir", out, "--steps", STEPS,
                      "--ckpt-every", CKPT_EVERY, "--val-every", CKPT_EVERY, "--average", "1",
                      "--decode", "greedy", env=jax_env)
    return out, proc.stdout


@pytest.mark.quick  # the quick tier's run of train_aiayn_jax.py
def test_training_loss_falls_and_logs(trained):
    """40 steps of the tiny model cut the training and validation loss; log.jsonl logs every step; a step
    line prints memory only where it is measured (not on the CPU)."""
    out, stdout = trained
    assert "n/a" not in stdout and " | mem " not in stdout, stdout[:2000]
    steps = step_events(out)
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    for e in steps:
        assert set(e) == {"step", "train_loss", "grad_norm", "lr", "dt_ms", "tokens_per_s", "peak_mem_gb",
                          "framework"} and e["framework"] == "jax"
    losses = [e["train_loss"] for e in steps]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses
    val = [e["val_loss"] for e in read_log(out) if "val_loss" in e]
    assert len(val) == 2 and val[1] < val[0]
    assert steps[9]["lr"] == pytest.approx(3e-3)  # the peak, after 10 warmup steps, then 1/sqrt(step)
    assert steps[-1]["lr"] == pytest.approx(3e-3 * math.sqrt(10 / STEPS))
    assert sorted(os.listdir(out)) == ["ckpt_0000020", LAST, "hyp_test.txt", "log.jsonl"]


def test_printed_bleu_is_sacrebleu_of_the_written_hypotheses(trained, data_dir):
    """The BLEU printed and logged is sacrebleu's of hyp_test.txt against the raw references."""
    out, stdout = trained
    with open(out / "hyp_test.txt", encoding="utf-8") as f:
        hyps = f.read().split("\n")
    assert hyps.pop() == ""
    refs = first_lines(data_dir / "test_2016_flickr.de.gz", SUBSET["test_2016_flickr"])
    assert len(hyps) == len(refs) and sum(len(h) > 0 for h in hyps) > len(hyps) // 2
    score = sacrebleu.corpus_bleu(hyps, [refs]).score
    printed = float(re.search(r"test BLEU (\d+\.\d\d)", stdout).group(1))
    assert printed == round(score, 2)
    logged = [e["bleu"] for e in read_log(out) if "bleu" in e]
    assert logged == [pytest.approx(score, abs=1e-9)]


def test_resume_repeats_the_run_exactly(trained, data_dir, jax_env, tmp_path):
    """Resumed from its step-20 checkpoint (settings inherited), the run repeats steps 21-40 bit for bit."""
    out, _ = trained
    run_script(SCRIPT, "--resume", out / "ckpt_0000020", "--out-dir", tmp_path, "--ckpt-every", "0",
               "--val-every", "0", "--bleu-split", "none", env=jax_env)
    original = {e["step"]: e["train_loss"] for e in step_events(out)}
    resumed = {e["step"]: e["train_loss"] for e in step_events(tmp_path)}
    assert sorted(resumed) == list(range(CKPT_EVERY + 1, STEPS + 1))
    assert all(resumed[s] == original[s] for s in resumed), (resumed, original)


def test_translate_prints_the_translation(trained, data_dir, jax_env):
    """--translate prints the translation of a test sentence that the BLEU run wrote for it."""
    out, _ = trained
    _, cfg, tok = load_trained(out)
    sources = first_lines(data_dir / "test_2016_flickr.en.gz", SUBSET["test_2016_flickr"])
    # the longest sentence: alone it is padded to the length its batch had in the BLEU run
    longest = max(range(len(sources)), key=lambda i: len(tok.encode_ordinary(sources[i])))
    proc = run_script(SCRIPT, "--translate", sources[longest], "--resume", out / LAST, env=jax_env)
    with open(out / "hyp_test.txt", encoding="utf-8") as f:
        assert proc.stdout == f.read().split("\n")[longest] + "\n"


def test_eval_only_repeats_the_final_evaluation(trained, jax_env, tmp_path):
    """--eval-only on the last checkpoint prints the val loss and BLEU that the training run logged."""
    out, _ = trained
    run_script(SCRIPT, "--eval-only", "--resume", out / LAST, "--out-dir", tmp_path, env=jax_env)
    logged = [e for e in read_log(out) if e["step"] == STEPS and ("val_loss" in e or "bleu" in e)]
    again = read_log(tmp_path)
    assert again == logged and len(again) == 2
    assert (tmp_path / "hyp_test.txt").read_text() == (out / "hyp_test.txt").read_text()


def load_trained(out):
    """(params, cfg, tokenizer) of the trained run's last checkpoint."""
    params, _, _, _, cfg = aiayn.load_checkpoint(str(out / LAST))
    return params, cfg, aiayn.load_tokenizer(str(out / LAST / aiayn.TOKENIZER_FILE))


@pytest.mark.parametrize("signum, delay", [(signal.SIGINT, 0.8), (signal.SIGTERM, 1.5)])
def test_a_signal_during_eval_only_exits_128_plus_its_number(trained, data_dir, tmp_path, signum, delay):
    """SIGINT or SIGTERM while --eval-only compiles its BLEU search stops it at once with exit 128 + the
    signal's number: not a segfault (139) of the interpreter's teardown under the compile the signal cut
    short. No compilation cache: the search (beam, seconds on a CPU) compiles."""
    args = [SCRIPT, "--eval-only", "--bleu-split", "val", "--decode", "beam", "--resume", trained[0] / LAST,
            "--data-dir", data_dir, "--out-dir", tmp_path]
    code, output = signal_after_line(args, "val loss", delay, signum, env={"JAX_PLATFORMS": "cpu"})
    assert code == 128 + signum and output.strip().splitlines()[-1] == f"{signum.name}: stopped at once", output


def test_average_is_the_mean_of_the_newest_checkpoints(trained):
    """--average 2 on the last checkpoint is the mean of its weights and the previous checkpoint's."""
    out, _ = trained
    weights, used = aiayn.averaged_params(str(out / LAST), 2)
    assert used == [str(out / "ckpt_0000020"), str(out / LAST)]
    first, last = (aiayn.load_checkpoint(p)[0] for p in used)
    for k in aiayn.PARAM_NAMES:
        np.testing.assert_allclose(weights[k], (first[k].astype(np.float64) + last[k]) / 2, rtol=1e-6)
    assert aiayn.averaged_params(str(out / LAST), 5)[1] == used


def test_beam_search_on_the_model(trained, data_dir):
    """On the model: beam 1 is greedy, and the cached decoder's scores are the full forward's (beam 4 too)."""
    # greedy's summed log-probabilities, from the one-token-at-a-time decoder with its key/value cache,
    # equal the full forward's of the same tokens; beam 4's scores equal the full forward's log-probability
    # of the hypotheses it returns over their length penalty, so the cache follows the reordered beams
    import jax
    out, _ = trained
    params, cfg, tok = load_trained(out)
    lines = first_lines(data_dir / "val.en.gz", 12)
    ids = [tok.encode_ordinary(s) for s in lines]
    S = aiayn.bucket_size(max(map(len, ids)) + 1)
    src = np.full((len(ids), S), cfg.pad_id, np.int32)
    for r, s in enumerate(ids):
        src[r, :len(s) + 1] = s + [cfg.eos_id]
    max_lens = np.array([len(s) + aiayn.EXTRA_LEN for s in ids], np.int32)
    # this undertrained a model ends almost at once; a rare token as the search's end token makes every
    # hypothesis run to its length limit, through ~60 steps of cache updates and beam reorderings
    long = replace(cfg, eos_id=cfg.pad_id - 1)
    forward = jax.jit(lambda src, tgt_in: jax.nn.log_softmax(aiayn.forward(params, src, tgt_in, cfg)))

    def full_logp(rows):
        """Summed full-forward log-probabilities of each row's tokens up to its end token, and its length."""
        ends = np.array([list(r).index(long.eos_id) + 1 for r in rows])
        tgt_in = np.concatenate([np.full((len(rows), 1), cfg.bos_id), rows[:, :-1]], axis=1)
        logp = np.asarray(forward(src, tgt_in.astype(np.int32)))
        sums = [logp[r, np.arange(ends[r]), rows[r, :ends[r]]].sum() for r in range(len(rows))]
        return np.array(sums), ends

    greedy, greedy_logp = aiayn.translate_batch(params, src, max_lens, replace(long, beam=1), greedy=True)
    beam1, _ = aiayn.translate_batch(params, src, max_lens, replace(long, beam=1), greedy=False)
    np.testing.assert_array_equal(np.asarray(beam1), np.asarray(greedy))
    logp, ends = full_logp(np.asarray(greedy))
    assert np.mean(ends) > 20
    np.testing.assert_allclose(np.asarray(greedy_logp), logp, rtol=1e-4)

    beam4, score = aiayn.translate_batch(params, src, max_lens, replace(long, beam=4), greedy=False)
    logp, ends = full_logp(np.asarray(beam4))
    assert np.mean(ends) > 20
    np.testing.assert_allclose(np.asarray(score), logp / ((5 + ends) / 6) ** cfg.alpha, rtol=1e-4)


def markov_step(table):
    """A toy model for the search functions: next-token log-probabilities depend on the last token."""
    import jax.numpy as jnp
    logp = jnp.log(jnp.asarray(table / table.sum(axis=1, keepdims=True), jnp.float32))
    return lambda state, tokens, t: (logp[tokens], state)


def test_beam_search_finds_the_best_hypothesis():
    """Hand-checked: beam search finds what greedy misses, and the length penalty favours the longer one."""
    import jax.numpy as jnp
    BOS, EOS, A, B, C = range(5)
    t = np.full((5, 5), 1e-12)
    t[BOS, [A, B]] = [0.55, 0.45]        # A first is likelier ...
    t[A, [EOS, C]] = [0.4, 0.6]          # ... but A ends with 0.55*0.4 = 0.22
    t[B, [EOS, C]] = [0.9, 0.1]          # B ends with 0.45*0.9 = 0.405
    t[C, EOS] = 1.0                      # A C EOS = 0.33, B C EOS = 0.045
    step = markov_step(t)
    max_lens = jnp.array([5])
    greedy, _ = aiayn.greedy_search(step, {}, max_lens, 8, BOS, EOS)
    assert list(np.asarray(greedy)[0, :3]) == [A, C, EOS]
    for alpha, best, p in ((0.0, [B, EOS], 0.405), (3.0, [A, C, EOS], 0.33)):
        # alpha 3: B EOS scores log(0.405)/(7/6)^3 = -0.571, A C EOS log(0.33)/(8/6)^3 = -0.468
        tokens, score = aiayn.beam_search(step, {}, max_lens, 8, 2, alpha, BOS, EOS)
        assert list(np.asarray(tokens)[0, :len(best)]) == best
        assert float(score[0]) == pytest.approx(math.log(p) / ((5 + len(best)) / 6) ** alpha, rel=1e-5)
    # only EOS may follow max_lens tokens: with a limit of 1, A C EOS is out of reach
    tokens, _ = aiayn.beam_search(step, {}, jnp.array([1]), 8, 2, 3.0, BOS, EOS)
    assert list(np.asarray(tokens)[0, :2]) == [B, EOS]


def test_accumulated_micro_batches_give_the_whole_batch_step():
    """A step over 2 micro-batches of 8 pairs each equals one over all 16 in one micro-batch."""
    import jax
    # Adam's eps at 1: the first update is about lr * gradient, not lr * sign(gradient), so it compares
    cfg = replace(aiayn.parse_args(["--model", "tiny", "--n-layer", "1", "--dtype", "fp32"])[0],
                  vocab_size=50, pad_id=47, bos_id=48, eos_id=49, dropout=0.0, adam_eps=1.0)
    params = aiayn.init_params_numpy(cfg)
    zeros = {k: np.zeros_like(p) for k, p in params.items()}
    rng = np.random.default_rng(0)
    batch = [rng.integers(0, 47, (16, 8)).astype(np.int32) for _ in range(3)]  # src, tgt_in, tgt_out
    batch[2][:5, 6:] = cfg.pad_id  # micro-batches with different token counts

    def micro_batches(rows_0, rows_1):
        """(2, 16, 8) arrays: the given rows in each micro-batch, the rest padding (one shape, one compile)."""
        out = np.full((3, 2, 16, 8), cfg.pad_id, np.int32)
        for a, rows in enumerate((rows_0, rows_1)):
            out[:, a, :len(rows)] = [x[rows] for x in batch]
        return out

    step = jax.jit(partial(aiayn.train_step, step=1, scalars=aiayn.adam_scalars(1, cfg), cfg=cfg))
    whole = step(params, zeros, zeros, *micro_batches(np.arange(16), []))
    split = step(params, zeros, zeros, *micro_batches(np.arange(8), np.arange(8, 16)))
    assert float(split[3]) == pytest.approx(float(whole[3]), rel=1e-6)  # loss
    assert float(split[4]) == pytest.approx(float(whole[4]), rel=1e-5)  # gradient norm
    for k in aiayn.PARAM_NAMES:
        np.testing.assert_allclose(split[0][k] - params[k], whole[0][k] - params[k], rtol=1e-4, atol=1e-12)


def test_label_smoothed_loss_matches_a_direct_computation():
    """The label-smoothed loss is -sum_v q_v log p_v, q = 0.9 one-hot + 0.1/V, over non-padding targets."""
    rng = np.random.default_rng(0)
    B, T, V, pad, eps = 3, 5, 11, 10, 0.1
    logits = rng.standard_normal((B, T, V)).astype(np.float32) * 3
    targets = rng.integers(0, V - 1, (B, T))
    targets[0, 3:] = targets[2, 1:] = pad
    loss, nll, count = aiayn.smoothed_loss_sums(logits, targets, pad, eps)
    logp = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    want_loss = want_nll = 0.0
    for b in range(B):
        for t in range(T):
            if targets[b, t] == pad:
                continue
            q = np.full(V, eps / V)
            q[targets[b, t]] += 1 - eps
            want_loss -= (q * logp[b, t]).sum()
            want_nll -= logp[b, t, targets[b, t]]
    assert float(count) == 9
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    assert float(nll) == pytest.approx(want_nll, rel=1e-5)


def test_bf16_loss_matches_fp32(trained, data_dir):
    """bf16 compute (fp32 masters, softmax, LayerNorm statistics) gives the fp32 run's val loss within 1%."""
    import jax
    out, _ = trained
    params, cfg, tok = load_trained(out)

    def ragged(lines):
        ids = [tok.encode_ordinary(s) for s in lines]
        return np.array([i for s in ids for i in s], np.int32), np.cumsum([0] + [len(s) for s in ids])

    val = [ragged(first_lines(data_dir / f"val.{lang}.gz", SUBSET["val"])) for lang in ("en", "de")]
    bf16 = replace(cfg, dtype="bf16")
    eval_fn = jax.jit(lambda p, s, ti, to: aiayn.loss_sums(p, s, ti, to, bf16))
    loss, _ = aiayn.evaluate_loss(eval_fn, params, aiayn.eval_batches(*val, bf16))
    logged = [e["val_loss"] for e in read_log(out) if "val_loss" in e and e["step"] == STEPS]
    assert loss == pytest.approx(logged[0], rel=1e-2) and loss != logged[0]


def test_download_resumes_and_retries(http_server, tmp_path, monkeypatch):
    """Downloads resume after a dropped connection, retry a 503, arrive byte for byte; a 404 is an error."""
    monkeypatch.setattr(aiayn.time, "sleep", lambda s: None)
    root = tmp_path / "www"
    for lang in ("en", "de"):
        shutil.copy(data_file(f"multi30k/train.{lang}.gz"), root / f"train.{lang}.gz")
    http_server.cut_once["train.en.gz"] = 300_000
    http_server.fail_once["train.de.gz"] = 503
    cfg = aiayn.Config(data_dir=str(tmp_path / "data"), base_url=http_server.url)
    src, tgt = aiayn.read_split(cfg, "train")
    assert len(src) == len(tgt) == 29000
    for lang in ("en", "de"):
        got = (tmp_path / "data" / f"train.{lang}.gz").read_bytes()
        assert got == (root / f"train.{lang}.gz").read_bytes()
    en = [r for r in http_server.requests if r[1] == "train.en.gz"]
    assert len(en) == 2 and en[0][2] is None
    assert 0 < int(re.fullmatch(r"bytes=(\d+)-", en[1][2]).group(1)) <= 300_000  # resumed, not restarted
    assert [r for r in http_server.requests if r[1] == "train.de.gz"] == [("GET", "train.de.gz", None)] * 2
    assert sorted(os.listdir(tmp_path / "data")) == ["train.de.gz", "train.en.gz"]
    with pytest.raises(SystemExit, match="HTTP 404"):
        aiayn.read_split(cfg, "test")


def test_download_retries_an_oserror_and_refuses_encoded_data(http_server, tmp_path, monkeypatch):
    """A failure that reaches the download as a plain OSError (a reset connection or a failed write that
    no requests exception wraps) is retried like any other; a server that answers the identity request
    with gzip Content-Encoding gets a one-line error at once: the bytes it sends are not the file whose
    size and ranges it announces, and decoding them would store a .gz file unzipped."""
    import requests
    monkeypatch.setattr(aiayn.time, "sleep", lambda s: None)
    for split in ("val", "test_2016_flickr"):
        for lang in ("en", "de"):
            shutil.copy(data_file(f"multi30k/{split}.{lang}.gz"), tmp_path / "www" / f"{split}.{lang}.gz")
    real_get, resets = requests.get, []

    def get(url, **kwargs):  # the first request for val.en.gz fails before it reaches the server
        if url.endswith("/val.en.gz") and not resets:
            resets.append(url)
            raise ConnectionResetError(104, "Connection reset by peer")
        return real_get(url, **kwargs)
    monkeypatch.setattr(requests, "get", get)
    cfg = aiayn.Config(data_dir=str(tmp_path / "data"), base_url=http_server.url)
    assert [len(side) for side in aiayn.read_split(cfg, "val")] == [1014, 1014]
    assert resets == [f"{http_server.url}/val.en.gz"]
    for lang in ("en", "de"):
        got = (tmp_path / "data" / f"val.{lang}.gz").read_bytes()
        assert got == (tmp_path / "www" / f"val.{lang}.gz").read_bytes()
    http_server.headers["test_2016_flickr.en.gz"] = {"Content-Encoding": "gzip"}
    with pytest.raises(SystemExit, match="server sent gzip-encoded data"):
        aiayn.read_split(cfg, "test")
    assert [r[1] for r in http_server.requests].count("test_2016_flickr.en.gz") == 1
    assert sorted(os.listdir(tmp_path / "data")) == ["val.de.gz", "val.en.gz"]


def test_wmt14_parquet_split(http_server, tmp_path):
    """--dataset wmt14 reads the pairs of Hugging Face's parquet files; a corrupt file is a clean error."""
    import pyarrow
    import pyarrow.parquet
    pairs = [{"de": "Guten Morgen.", "en": "Good morning."}, {"de": "Danke!", "en": "Thanks!"}]
    pyarrow.parquet.write_table(pyarrow.table({"translation": pairs}),
                                tmp_path / "www" / "test-00000-of-00001.parquet")
    cfg = aiayn.Config(dataset="wmt14", src="de", tgt="en", data_dir=str(tmp_path / "wmt14"),
                       base_url=http_server.url)
    assert aiayn.read_split(cfg, "test") == (["Guten Morgen.", "Danke!"], ["Good morning.", "Thanks!"])
    (tmp_path / "wmt14" / "validation-00000-of-00001.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(SystemExit, match="not a parquet file of de-en translation pairs"):
        aiayn.read_split(cfg, "val")


def test_bad_input_gets_a_one_line_error(data_dir, jax_env, tmp_path):
    """A bad flag, a corrupt data file, a non-checkpoint --resume: a one-line error each, no traceback."""
    assert_clean_error(run_script(SCRIPT, "--beam", "0", check=False, env=jax_env), "--beam")
    broken = tmp_path / "broken"
    shutil.copytree(data_dir, broken)
    raw = (broken / "val.de.gz").read_bytes()
    (broken / "val.de.gz").write_bytes(raw[:len(raw) // 2])
    proc = run_script(SCRIPT, *TINY, "--data-dir", broken, "--out-dir", tmp_path / "out", check=False,
                      env=jax_env)
    assert_clean_error(proc, "val.de.gz", "gzip")
    with pytest.raises(SystemExit, match="not a checkpoint directory"):
        aiayn.main(["--translate", "Hello.", "--resume", str(tmp_path)])
    with pytest.raises(SystemExit, match="--micro-tokens 1000 cannot hold one pair of the longest bucket"):
        aiayn.parse_args(["--batch-tokens", "2000", "--micro-tokens", "1000", "--max-len", "1000"])


@pytest.mark.parametrize("flag", ["--lr", "--grad-clip", "--alpha"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_non_finite_or_negative_rates_are_refused(flag, value):
    """--lr, --grad-clip and --alpha nan, inf or negative are a one-line error naming the flag, as in the
    GPT-2 trainers; 0 stays allowed (--lr 0: the paper's peak, --grad-clip 0: never clip)."""
    with pytest.raises(SystemExit, match=re.escape(f"{flag} must be finite and >= 0")):
        aiayn.parse_args([flag, value])
    assert getattr(aiayn.parse_args([flag, "0"])[0], flag[2:].replace("-", "_")) == 0


def test_seed_out_of_range_and_empty_translate_are_refused(trained, jax_env):
    """--seed -1 or 2**63 is a one-line error, as in the GPT-2 trainers; --translate '' (an unset shell
    variable) with --resume is refused in one line and never trains: the run's out dir stays as it was."""
    for seed in ("-1", str(2**63)):
        with pytest.raises(SystemExit, match=re.escape("--seed must be in [0, 2**63)")):
            aiayn.parse_args(["--seed", seed])
    out, _ = trained
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    for text in ("", "  "):
        proc = run_script(SCRIPT, "--translate", text, "--resume", out / LAST, env=jax_env, check=False,
                          timeout=120)
        assert_clean_error(proc, "--translate got no text")
        assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before


def test_an_out_dir_holding_a_run_is_not_overwritten(trained, data_dir, jax_env, tmp_path):
    """A fresh run into an --out-dir that holds a run stops with one line naming --resume auto and
    --force, touching nothing; with --force the old run's files move into a replaced_<time> folder and
    the new log holds the new run alone."""
    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with pytest.raises(SystemExit) as e:
        aiayn.main([*TINY, "--data-dir", str(data_dir), "--out-dir", str(out)])
    assert "--resume auto" in str(e.value) and "--force" in str(e.value) and "\n" not in str(e.value)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    run_script(SCRIPT, *TINY, "--data-dir", data_dir, "--out-dir", out, "--force", "--steps", 2, "--ckpt-every",
               0, "--val-every", 0, "--bleu-split", "none", env=jax_env)
    aside = [p for p in out.iterdir() if p.name.startswith("replaced_")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == sorted(before)
    assert [e["step"] for e in step_events(out)] == [1, 2]


def test_force_twice_in_a_second_keeps_both_runs(tmp_path, capsys):
    """Two --force starts in quick succession (the same second, as a script's retries may be) each move
    the run they replace, its hypotheses with it, into a replaced_ folder of its own, so that neither run
    is lost (the translator's out dir is kept by the GPT-2 trainers' shared plumbing)."""
    out = tmp_path / "run"
    out.mkdir()
    cfg = replace(aiayn.Config(), out_dir=str(out), force=True)
    for text in ("first run\n", "second run\n"):
        (out / "log.jsonl").write_text(text)
        (out / "hyp_test.txt").write_text(text)
        aiayn.prepare_out_dir(cfg, True, 0, extras=aiayn.RUN_FILES)
    aside = sorted(p for p in out.iterdir() if p.name.startswith("replaced_"))  # names sort by time
    assert [(p / "log.jsonl").read_text() for p in aside] == ["first run\n", "second run\n"]
    assert [(p / "hyp_test.txt").read_text() for p in aside] == ["first run\n", "second run\n"]
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in aside)
    assert capsys.readouterr().out.count("--force: the run in") == 2


def logged_step(out):
    """The newest step <out>/log.jsonl logs a train loss for (0 while none), read as a run appends to it."""
    path = out / "log.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    return max((e["step"] for e in map(json.loads, (x for x in lines if x.endswith("\n"))) if "train_loss" in e),
               default=0)


def test_a_requeued_run_is_locked_and_stops_at_a_checkpoint_on_ctrl_c(data_dir, jax_env, tmp_path):
    """As the GPT-2 trainers do (the shared plumbing's out dir and signals): --resume auto in an out dir whose run was
    killed before its first checkpoint starts at step 0, its log set aside in replaced_<time>; the same
    launch again while it runs (a requeued job) is refused in one line naming it; Ctrl-C then stops it at
    the end of a step, with that step's checkpoint, one line, exit 130, no traceback and no ckpt_*.tmp. The
    log holds each step once."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.jsonl").write_text('{"step": 1, "train_loss": 7.9}\n')
    args = [SCRIPT, *TINY, "--data-dir", data_dir, "--out-dir", out, "--steps", 100000, "--ckpt-every", 1000,
            "--val-every", 0, "--bleu-split", "none", "--resume", "auto"]
    first = subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, **jax_env})
    try:
        deadline = time.monotonic() + 300
        while logged_step(out) < 2:
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        second = run_script(*args, env=jax_env, check=False, timeout=240)  # not refused: it would train on
        assert_clean_error(second, f"--out-dir {out} is in use by another run (pid {first.pid} on")
        first.send_signal(signal.SIGINT)
        stdout, stderr = first.communicate(timeout=300)
    finally:
        first.kill()
        first.wait()
    aside, = out.glob("replaced_*")
    said = (f"--resume auto: no checkpoint in {out}, starting at step 0; the run there, stopped before its "
            f"first checkpoint, moved to {aside}")
    assert said in stdout.splitlines() and os.listdir(aside) == ["log.jsonl"]
    last = step_events(out)[-1]["step"]
    assert first.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (f"SIGINT: stopped after step {last} of 100000, its checkpoint "
                                               "saved; --resume auto continues")
    assert sorted(p.name for p in out.glob("ckpt_*")) == [f"ckpt_{last:07d}"]
    assert [e["step"] for e in step_events(out)] == list(range(1, last + 1))


def test_a_resume_of_an_earlier_step_abandons_the_newer_branch(trained, data_dir, jax_env, tmp_path):
    """--resume of an earlier checkpoint that trains on moves the newer checkpoints and their log lines into
    abandoned_<time>, so that --resume auto and the log follow the live branch; a checkpoint whose name
    disagrees with its step, and another out dir's checkpoint resumed into this one, are refused in one
    line, moving nothing."""
    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    run_script(SCRIPT, "--resume", out / "ckpt_0000020", "--data-dir", data_dir, "--out-dir", out,
               "--steps", CKPT_EVERY + 1, "--ckpt-every", 0, "--val-every", 0, "--bleu-split", "none", env=jax_env)
    branch, = out.glob("abandoned_*")
    assert sorted(os.listdir(branch)) == [LAST, "log.jsonl"]
    assert [e["step"] for e in step_events(branch)] == list(range(CKPT_EVERY + 1, STEPS + 1))
    assert [e["step"] for e in step_events(out)] == list(range(1, CKPT_EVERY + 2))
    assert latest_checkpoint(str(out), aiayn.CHECKPOINT_FILES) == str(out / "ckpt_0000020")
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    with pytest.raises(SystemExit) as e:
        aiayn.main(["--resume", str(trained[0] / LAST), "--out-dir", str(out)])
    assert str(e.value).startswith(f"error: --resume {trained[0] / LAST}: a checkpoint of another out dir")
    shutil.copytree(out / "ckpt_0000020", tmp_path / "ckpt_0000030")
    with pytest.raises(SystemExit) as e:
        aiayn.main(["--resume", str(tmp_path / "ckpt_0000030"), "--out-dir", str(tmp_path / "new")])
    assert str(e.value).startswith(f"error: checkpoint {tmp_path / 'ckpt_0000030'} holds step 20, not the "
                                   "step 30 its name says")
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before


def test_a_full_disk_during_a_checkpoint(trained, data_dir, jax_env, tmp_path):
    """A checkpoint that meets a full disk (every file limited to the size of params.npz: state.npz, with
    both Adam moments, does not fit) ends the run with one line naming it and saying the disk is full;
    nothing of it is left and the checkpoint resumed from is intact."""
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(trained[0] / "ckpt_0000020", out / "ckpt_0000020")
    first = {p.name: p.read_bytes() for p in (out / "ckpt_0000020").iterdir()}
    limit = os.path.getsize(out / "ckpt_0000020" / "params.npz") + 4096
    proc = run_script_on_a_full_disk(limit, SCRIPT, "--resume", "auto", "--data-dir", data_dir, "--out-dir", out,
                                     "--steps", 21, "--ckpt-every", 1, "--val-every", 0, "--bleu-split", "none",
                                     env=jax_env)
    assert_clean_error(proc, f"cannot write {out / 'ckpt_0000021.tmp'}", "no space left, the disk is full")
    assert sorted(os.listdir(out)) == ["ckpt_0000020", "log.jsonl"]
    assert {p.name: p.read_bytes() for p in (out / "ckpt_0000020").iterdir()} == first


def test_every_flag_has_a_help_line(monkeypatch):
    """`--help` explains every flag: the parser that parse_args builds has a help text on each option."""
    import argparse
    parsers = []

    def capture(parser, args=None, namespace=None):
        parsers.append(parser)
        raise SystemExit(0)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        aiayn.parse_args([])
    options = [a for a in parsers[0]._actions if a.option_strings]
    assert len(options) > 30
    assert [a.option_strings[0] for a in options if not (a.help or "").strip()] == []


class Terminal(io.StringIO):
    """A stand-in for a terminal's stderr: collects what is written, and says it is a tty."""

    def isatty(self):
        return True


def test_translation_progress_bar_only_on_a_terminal(monkeypatch):
    """Decoding a test set draws a bar of translated sentences on stderr when it is a terminal, and
    writes nothing there otherwise; the translations are the same either way."""
    cfg = replace(aiayn.Config(), pad_id=0, bos_id=1, eos_id=2, decode_batch=4)
    ids = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15], [16, 17], [18], [19, 20, 21], [22, 23]]
    src = (np.concatenate(ids).astype(np.int32), np.cumsum([0] + [len(r) for r in ids]))

    def copy_search(params, batch, max_lens):  # "translates" a sentence into itself, slowly enough
        time.sleep(0.15)                        # for the bar to redraw on its way
        return np.where(batch == cfg.pad_id, cfg.eos_id, batch), None
    for stream, bar_expected in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        assert aiayn.translate_ids(copy_search, None, src, cfg) == ids
        text = stream.getvalue()
        assert bool("translating" in text and re.search(r"\b[1-9]/9 \[", text)) == bar_expected, text
        assert bar_expected or text == ""
