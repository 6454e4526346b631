"""Data: prepro_fineweb.py and hellaswag.py (downloads, token shards, HellaSwag rendering, scoring, export).

Everything runs offline: the download tests use the conftest's local HTTP server on 127.0.0.1, the
HellaSwag tests the 10 real validation examples in tests/data, the shard tests a parquet file written here
from tinyshakespeare. Expected values are computed independently with tiktoken and numpy."""
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import hellaswag
import prepro_fineweb
from conftest import (EOT, OFFLINE, REPO, assert_clean_error, assert_refused, data_file, run_script,
                      run_script_on_a_full_disk, run_with_terminal_stderr)


@pytest.fixture(scope="module")
def enc():
    import tiktoken
    return tiktoken.get_encoding("gpt2")


def real_examples():
    with open(data_file("hellaswag/hellaswag_val_first10.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def error_line(main, args, capsys):
    """The one-line error of a script's main() run in-process: die()'s SystemExit message, or argparse's
    last stderr line (exit code 2)."""
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    code = exc.value.code
    assert code not in (0, None)
    return code if isinstance(code, str) else capsys.readouterr().err.strip().splitlines()[-1]


# -----------------------------------------------------------------------------
# HellaSwag

def test_hellaswag_render_real_examples(enc):
    """The 10 real validation examples render as context + " " + ending tokens, zero-padded, mask 1 on
    the ending tokens only (an independent tiktoken rendering)."""
    examples = real_examples()
    assert len(examples) == 10
    for ex in examples:
        tokens, mask, label = hellaswag.render_example(ex, enc.encode_ordinary)
        ctx = enc.encode(ex["ctx"])
        rows = [ctx + enc.encode(" " + end) for end in ex["endings"]]
        T = max(map(len, rows))
        assert tokens.shape == mask.shape == (4, T) and tokens.dtype == mask.dtype == np.int64
        assert label == ex["label"]
        for i, row in enumerate(rows):
            assert tokens[i].tolist() == row + [0] * (T - len(row))
            assert mask[i].tolist() == [0] * len(ctx) + [1] * (len(row) - len(ctx)) + [0] * (T - len(row))


def test_hellaswag_score_known_losses():
    """score() picks the lowest summed loss (acc) and the lowest mean loss (acc_norm), over the ending
    tokens only, also where the two disagree and where padding holds huge or NaN losses."""
    # context of 2 tokens; endings of 1, 4, 2, 3 tokens; T = 6
    mask = np.array([[0, 0, 1, 0, 0, 0],
                     [0, 0, 1, 1, 1, 1],
                     [0, 0, 1, 1, 0, 0],
                     [0, 0, 1, 1, 1, 0]])
    losses = np.full((4, 5), np.nan)  # losses[:, t] scores token t+1
    losses[0, 1:2] = [3.0]                 # sum 3.0, mean 3.0  -> lowest sum
    losses[1, 1:5] = [1.0, 1.0, 1.0, 1.0]  # sum 4.0, mean 1.0  -> lowest mean
    losses[2, 1:3] = [2.0, 2.5]            # sum 4.5, mean 2.25
    losses[3, 1:4] = [1.5, 1.5, 1.5]       # sum 4.5, mean 1.5
    losses[:, 0] = 1e9                     # the context position is never scored
    assert hellaswag.score(losses, mask) == (0, 1)
    losses[1, 1:5] = 0.5                   # sum 2.0 now lowest too
    assert hellaswag.score(losses, mask) == (1, 1)
    padded = np.concatenate([losses, np.full((4, 7), -1e9)], axis=1)  # a trainer that padded T
    assert hellaswag.score(padded, mask) == (1, 1)


def test_hellaswag_evaluate_oracle_and_constant(hellaswag_dir, enc, capsys):
    """evaluate() scores 1.0 with a loss_fn that favours the labelled ending, and with a constant loss
    picks the shortest ending (acc) and the first one (acc_norm), matching an independent count."""
    examples = real_examples()

    def oracle(tokens):
        losses = np.ones((4, tokens.shape[1] - 1))
        for i in range(4):  # the labelled row is the one whose tokens equal the label's rendering
            for ex in examples:
                row = enc.encode(ex["ctx"]) + enc.encode(" " + ex["endings"][ex["label"]])
                if tokens[i, :len(row)].tolist() == row and (len(row) == tokens.shape[1] or
                                                             not tokens[i, len(row):].any()):
                    losses[i] = 0.1
        return losses

    assert hellaswag.evaluate(oracle, cache_dir=hellaswag_dir) == (1.0, 1.0)
    acc, acc_norm = hellaswag.evaluate(lambda t: np.ones((4, t.shape[1] - 1)), cache_dir=hellaswag_dir,
                                       limit=7)
    shortest = [int(np.argmin([len(enc.encode(" " + e)) for e in ex["endings"]])) for ex in examples[:7]]
    assert acc == sum(s == ex["label"] for s, ex in zip(shortest, examples)) / 7
    assert acc_norm == sum(ex["label"] == 0 for ex in examples[:7]) / 7
    assert "hellaswag 7/7" in capsys.readouterr().out


HELLASWAG_CONSTANT_LOSSES = """
import sys
import time
import numpy as np
import hellaswag

def losses(tokens):  # slow enough (50 ms an example) for the bar to redraw on its way
    time.sleep(0.05)
    return np.ones((4, tokens.shape[1] - 1))
print(hellaswag.evaluate(losses, cache_dir=sys.argv[1]))
"""


def test_hellaswag_progress_bar_only_on_a_terminal(hellaswag_dir):
    """hellaswag.evaluate draws a progress bar on stderr when stderr is a terminal, and writes nothing
    there when it is a pipe or a file (a log stays clean); stdout gets the same lines either way."""
    code, stdout, terminal = run_with_terminal_stderr("-c", HELLASWAG_CONSTANT_LOSSES, hellaswag_dir,
                                                      timeout=120)
    assert code == 0 and "hellaswag val:" in terminal, terminal
    assert re.search(r"\b[1-9]/10 \[", terminal), terminal  # the bar moved
    piped = run_script("-c", HELLASWAG_CONSTANT_LOSSES, hellaswag_dir, timeout=120)
    assert piped.stderr == "" and piped.stdout == stdout


@pytest.mark.quick  # the quick tier's run of hellaswag.py
def test_hellaswag_export_parses_back(hellaswag_dir, enc, tmp_path):
    """`hellaswag.py export` writes llm.c's eval file: header magic 20240522, version 1, count, longest
    example; each example's uint16 stream parsed back equals the tiktoken tokens and labels."""
    out = tmp_path / "hellaswag_val.bin"
    run_script("hellaswag.py", "export", "--out", out, "--cache-dir", hellaswag_dir)
    raw = out.read_bytes()
    header = np.frombuffer(raw[:1024], dtype="<i4")
    stream = np.frombuffer(raw[1024:], dtype="<u2").tolist()
    examples = real_examples()
    assert header[:3].tolist() == [20240522, 1, 10]
    pos, sizes = 0, []
    for index, ex in enumerate(examples):
        start = pos
        assert stream[pos] == 65535
        nbytes, idx, label, ncomp = stream[pos + 1:pos + 5]
        assert (idx, label, ncomp) == (index, ex["label"], 4)
        pos += 5
        ctx = stream[pos + 1:pos + 1 + stream[pos]]
        assert ctx == enc.encode(ex["ctx"])
        pos += 1 + len(ctx)
        for end in ex["endings"]:
            got = stream[pos + 1:pos + 1 + stream[pos]]
            assert got == enc.encode(" " + end)
            pos += 1 + len(got)
        assert nbytes == 2 * (pos - start)
        sizes.append(nbytes)
    assert pos == len(stream) and header[3] == max(sizes) and not header[4:].any()


def test_hellaswag_download_resumes(http_server, tmp_path):
    """A download cut off half way resumes with an HTTP Range request and gives the identical file; a
    second call finds it complete and sends no request."""
    data = open(data_file("hellaswag/hellaswag_val_first10.jsonl"), "rb").read()
    (tmp_path / "www" / "hellaswag_val.jsonl").write_bytes(data)
    http_server.cut_once["hellaswag_val.jsonl"] = len(data) // 2
    cache = tmp_path / "cache"
    path = hellaswag.download("val", cache_dir=cache, base_url=http_server.url)
    assert open(path, "rb").read() == data and os.listdir(cache) == ["hellaswag_val.jsonl"]
    ranges = [r for m, n, r in http_server.requests if m == "GET" and r]
    assert len(ranges) == 1 and int(ranges[0].split("=")[1].split("-")[0]) > 0
    n = len(http_server.requests)
    assert hellaswag.download("val", cache_dir=cache, base_url=http_server.url) == path
    assert len(http_server.requests) == n


def test_hellaswag_download_retries_and_checksum(http_server, tmp_path):
    """A 503 is retried; a file whose sha256 differs from the X-Linked-Etag the server announces is
    rejected with a clean error and nothing is left under the final name."""
    data = b'{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 0}\n' * 50
    (tmp_path / "www" / "f.jsonl").write_bytes(data)
    http_server.fail_once["f.jsonl"] = 503
    http_server.headers["f.jsonl"] = {"X-Linked-Etag": '"%s"' % hashlib.sha256(data).hexdigest()}
    path = tmp_path / "got" / "f.jsonl"
    hellaswag.download_file(f"{http_server.url}/f.jsonl", str(path), backoff=0.01)
    assert path.read_bytes() == data
    http_server.headers["f.jsonl"] = {"X-Linked-Etag": '"%s"' % ("0" * 64)}
    bad = tmp_path / "got" / "g.jsonl"
    with pytest.raises(SystemExit, match="sha256"):
        hellaswag.download_file(f"{http_server.url}/f.jsonl", str(bad), backoff=0.01)
    assert os.listdir(tmp_path / "got") == ["f.jsonl"]


def test_hellaswag_bad_input_clean_errors(http_server, tmp_path, capsys):
    """Malformed jsonl, a row without 4 endings, a missing file on the server, a --cache-dir that is a
    file, an unknown split and an export --out that is the split file it reads end with a one-line error
    naming the problem (no traceback from the command line)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    good = open(data_file("hellaswag/hellaswag_val_first10.jsonl")).read()
    (cache / "hellaswag_val.jsonl").write_text(good[:len(good) // 2])
    proc = run_script("hellaswag.py", "show", "--limit", "10", "--cache-dir", cache, check=False)
    assert_clean_error(proc, "hellaswag_val.jsonl:", "not valid JSON")
    (cache / "hellaswag_val.jsonl").write_text('{"ctx": "a", "endings": ["b"], "label": 0}\n')
    line = error_line(hellaswag.main, ["export", "--out", tmp_path / "x.bin", "--cache-dir", cache], capsys)
    assert line.startswith("error: ") and "endings" in line
    assert not (tmp_path / "x.bin").exists()
    line = error_line(hellaswag.main, ["download", "--split", "train", "--cache-dir", cache, "--base-url",
                                       http_server.url], capsys)
    assert line.startswith("error: ") and "HTTP 404" in line
    line = error_line(hellaswag.main, ["download", "--cache-dir", cache / "hellaswag_val.jsonl", "--base-url",
                                       http_server.url], capsys)
    assert line.startswith(f"error: cannot create {cache / 'hellaswag_val.jsonl'} to download")
    assert "--split" in error_line(hellaswag.main, ["show", "--split", "dev"], capsys)
    (cache / "hellaswag_val.jsonl").write_text(good)
    line = error_line(hellaswag.main, ["export", "--out", cache / "hellaswag_val.jsonl", "--cache-dir",
                                       cache, "--force"], capsys)
    assert line.startswith("error: --out ") and "the split file export reads" in line
    assert (cache / "hellaswag_val.jsonl").read_text() == good


def test_hellaswag_bad_outputs_and_flags_are_one_line(hellaswag_dir, http_server, tmp_path, capsys):
    """export refuses an existing --out unless --force, and --out '' or a folder, before any work; one below
    a regular file or where nothing can be created (/proc) is one line naming it, with no temporary left; a
    255-character name is written. A bad flag value and --split test (before any download) are one line;
    a split file that is a folder is one line, in show and in the trainers' evaluate."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "file").write_text("not a folder")
    earlier = out / "earlier.bin"
    earlier.write_bytes(b"an earlier file")
    export = ["export", "--cache-dir", str(hellaswag_dir), "--out"]
    assert_refused(hellaswag.main, [
        (export + [str(earlier)], f"--out {earlier} exists: pass --force to replace it"),
        (export + [""], "--out '': give a file's name"), (export + [str(out)], "not a folder's"),
        (export + [str(out / "file" / "x.bin")], f"cannot write {out / 'file' / 'x.bin'}: Not a directory"),
        (export + ["/proc/x.bin"], "cannot write /proc/x.bin: "),
        (["export", "--split", "test", "--out", "x.bin", "--base-url", http_server.url], "test split has no labels"),
        (["show", "--limit", "x"], "argument --limit: invalid int value: 'x'")])
    assert capsys.readouterr().err == "" and http_server.requests == []
    assert earlier.read_bytes() == b"an earlier file" and sorted(os.listdir(out)) == ["earlier.bin", "file"]
    hellaswag.main(export + [str(earlier), "--force"])
    long_name = out / ("x" * 251 + ".bin")
    hellaswag.main(export + [str(long_name)])
    assert earlier.read_bytes() == long_name.read_bytes() and len(os.listdir(out)) == 3
    (tmp_path / "cache" / "hellaswag_val.jsonl").mkdir(parents=True)
    cache = str(tmp_path / "cache")
    assert_refused(hellaswag.main, [(["show", "--cache-dir", cache], "hellaswag_val.jsonl: Is a directory")])
    with pytest.raises(SystemExit, match="hellaswag_val.jsonl: Is a directory$"):
        hellaswag.evaluate(lambda tokens: np.zeros((4, tokens.shape[1] - 1)), cache_dir=cache)


def test_hellaswag_offline_fails_at_once():
    """Offline (a port nobody listens on, or a proxy nobody listens on) a download is one try and one
    line saying there is no connection, not a minute of retries."""
    url = "http://127.0.0.1:9/hellaswag_val.jsonl"
    t0 = time.time()
    with pytest.raises(SystemExit, match="failed, no connection: .*Connection refused"):
        hellaswag.download_file(url, "never_written.jsonl")
    proc = run_script("hellaswag.py", "show", "--cache-dir", "no_such_cache", env=OFFLINE, check=False)
    assert_clean_error(proc, "no connection")
    assert time.time() - t0 < 10 and proc.stderr.count("retrying") == 0


def test_hellaswag_export_damaged_or_empty_cache_file(tmp_path):
    """`hellaswag.py export` of a cached split file that is not UTF-8, or holds no example, stops with
    one line naming the file (no traceback, no eval file of 0 examples written)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    out = tmp_path / "x.bin"
    good = open(data_file("hellaswag/hellaswag_val_first10.jsonl"), "rb").read()
    for content, needles in ((good[:100] + b"\xff\xfe" + good[100:], ["hellaswag_val.jsonl:1", "not UTF-8"]),
                             (b"", ["hellaswag_val.jsonl", "no examples"]),
                             (b"\n\n", ["hellaswag_val.jsonl", "no examples"])):
        (cache / "hellaswag_val.jsonl").write_bytes(content)
        proc = run_script("hellaswag.py", "export", "--out", out, "--cache-dir", cache, check=False)
        assert_clean_error(proc, *needles)
        assert not out.exists()


def test_gpt2_encoding_offline_falls_back_to_committed_files(tmp_path):
    """With tiktoken's cache empty and no network (a proxy nobody listens on), hellaswag.gpt2_encoding()
    (HellaSwag's, as the trainers and hellaswag.py score it) uses tokenizer.py's GPT-2 from tests/data/gpt2
    without a word, and encodes and decodes as GPT-2 does."""
    code = ("import hellaswag; e = hellaswag.gpt2_encoding(); "
            "print(e.encode_ordinary('Hello world, this is GPT-2!'), e.eot_token, e.n_vocab, "
            "repr(e.decode([15496, 995, 50256])))")
    proc = run_script("-c", code, env={**OFFLINE, "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_cache")})
    assert proc.stdout.strip() == ("[15496, 995, 11, 428, 318, 402, 11571, 12, 17, 0] 50256 50257 "
                                   "'Hello world<|endoftext|>'"), proc.stdout
    assert proc.stderr == "", proc.stderr


# -----------------------------------------------------------------------------
# prepro_fineweb.py

SHARD = 100_000


@pytest.fixture(scope="module")
def shakespeare_parquet(tmp_path_factory):
    """tinyshakespeare as a parquet file: one document per blank-line-separated passage (the documents of
    conftest's shakespeare_tokens), 500 rows per row group, plus an unused column."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    text = open(data_file("tinyshakespeare/input.txt"), encoding="utf-8").read()
    docs = [d for d in text.split("\n\n") if d]
    path = tmp_path_factory.mktemp("parquet") / "shakespeare.parquet"
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=500)
    return path


def read_shards(out_dir, name):
    """{file name: tokens} of the shards in out_dir in shard order, each header checked (docs/FORMATS.md)."""
    files = sorted((f for f in os.listdir(out_dir) if f.startswith(name) and f.endswith(".bin")),
                   key=lambda f: int(f[-10:-4]))
    shards = {}
    for f in files:
        raw = open(os.path.join(out_dir, f), "rb").read()
        header = np.frombuffer(raw[:1024], dtype="<i4")
        tokens = np.frombuffer(raw[1024:], dtype="<u2")
        assert header[:3].tolist() == [20240520, 1, len(tokens)] and not header[3:].any(), f
        shards[f] = tokens
    return shards


def expected_names(name, total):
    n = -(-total // SHARD)
    return [f"{name}_val_000000.bin"] + [f"{name}_train_{i:06d}.bin" for i in range(1, n)]


@pytest.mark.quick  # the quick tier's run of prepro_fineweb.py
def test_prepro_parquet_shards(shakespeare_parquet, shakespeare_tokens, tmp_path):
    """Shards of a parquet input: llm.c headers, shard 0 = val, then train shards of --shard-size tokens;
    their tokens in order equal EOT + tiktoken's tokens of every document. A rerun writes nothing."""
    out = tmp_path / "out"
    proc = run_script("prepro_fineweb.py", "--input", shakespeare_parquet, "--out-dir", out,
                      "--shard-size", SHARD, "--workers", 2)
    assert "tokens/s" in proc.stdout
    shards = read_shards(out, "shakespeare")
    assert list(shards) == expected_names("shakespeare", len(shakespeare_tokens))
    assert all(len(t) == SHARD for t in list(shards.values())[:-1])
    assert np.array_equal(np.concatenate(list(shards.values())), shakespeare_tokens)
    stamps = {f: os.stat(out / f).st_mtime_ns for f in shards}
    proc = run_script("prepro_fineweb.py", "--input", shakespeare_parquet, "--out-dir", out,
                      "--shard-size", SHARD, "--workers", 2)
    assert "nothing to do" in proc.stdout
    assert stamps == {f: os.stat(out / f).st_mtime_ns for f in shards}


def test_prepro_resume_and_max_tokens(shakespeare_parquet, shakespeare_tokens, tmp_path):
    """--max-tokens stops early (val full, train short); a rerun without it continues from the last full
    shard (mid-document), and after a shard is deleted it redoes only that one and what follows: the
    result equals a single uninterrupted run, kept shards untouched."""
    out = tmp_path / "out"
    args = ["prepro_fineweb.py", "--input", shakespeare_parquet, "--out-dir", out, "--shard-size", SHARD,
            "--workers", 1]
    run_script(*args, "--max-tokens", 150_000)
    shards = read_shards(out, "shakespeare")
    assert {f: len(t) for f, t in shards.items()} == {"shakespeare_val_000000.bin": SHARD,
                                                      "shakespeare_train_000001.bin": 50_000}
    assert np.array_equal(np.concatenate(list(shards.values())), shakespeare_tokens[:150_000])
    val_stamp = os.stat(out / "shakespeare_val_000000.bin").st_mtime_ns
    run_script(*args)
    shards = read_shards(out, "shakespeare")
    assert np.array_equal(np.concatenate(list(shards.values())), shakespeare_tokens)
    assert os.stat(out / "shakespeare_val_000000.bin").st_mtime_ns == val_stamp
    os.remove(out / "shakespeare_train_000002.bin")
    kept = os.stat(out / "shakespeare_train_000001.bin").st_mtime_ns
    proc = run_script(*args)
    assert "keeping 2 complete shards" in proc.stdout
    shards = read_shards(out, "shakespeare")
    assert list(shards) == expected_names("shakespeare", len(shakespeare_tokens))
    assert np.array_equal(np.concatenate(list(shards.values())), shakespeare_tokens)
    assert os.stat(out / "shakespeare_train_000001.bin").st_mtime_ns == kept


EARLY_STOPS = """
import sys
import prepro_fineweb
text = open(sys.argv[1], encoding="utf-8").read()
docs = [text[i:i + 5000] for i in range(0, len(text), 5000)] * 3 + [None]
prepro_fineweb.load_tokenizer(None)  # loaded before the workers fork, as prepare() does
for _ in range(int(sys.argv[2])):
    for chunk in prepro_fineweb.tokenized_chunks(prepro_fineweb.iter_chunks(iter(docs)), None, 2):
        break  # as --max-tokens does, with tasks still in flight
"""


def test_prepro_early_stop_never_hangs():
    """Stopping the tokenizer pool with tasks in flight (what --max-tokens does) must let its workers exit:
    Pool.terminate() there hung about once in 100 stops here, and once in CI for 600 s. 150 stops in a
    row must finish well within the time limit (about 10 s)."""
    try:
        run_script("-c", EARLY_STOPS, data_file("tinyshakespeare/input.txt"), 150, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("150 early stops of the tokenizer pool did not finish in 120 s: a pool hangs on exit",
                    pytrace=False)


def test_prepro_download_resumes(http_server, shakespeare_parquet, shakespeare_tokens, tmp_path):
    """The default FineWeb-Edu path against a local server: the first parquet file, cut off half way,
    resumes with a Range request, passes the announced sha256 and size, and is byte-identical; only the
    files needed for --max-tokens are fetched; shards are named edu_fineweb_*."""
    data = open(shakespeare_parquet, "rb").read()
    name = "datasets/HuggingFaceFW/fineweb-edu/resolve/main/sample/10BT/000_00000.parquet"
    os.makedirs(tmp_path / "www" / os.path.dirname(name))
    (tmp_path / "www" / name).write_bytes(data)
    http_server.cut_once[name] = len(data) // 2
    http_server.headers[name] = {"X-Linked-Etag": '"%s"' % hashlib.sha256(data).hexdigest()}
    out = tmp_path / "out"
    run_script("prepro_fineweb.py", "--hf-url", http_server.url, "--out-dir", out, "--shard-size", SHARD,
               "--max-tokens", 250_000, "--workers", 2)
    assert (out / "parquet" / "000_00000.parquet").read_bytes() == data
    assert sorted(os.listdir(out / "parquet")) == ["000_00000.parquet"]
    gets = [(n, r) for m, n, r in http_server.requests if m == "GET"]
    assert [n for n, _ in gets] == [name, name] and gets[0][1] is None
    assert gets[1][1] == f"bytes={len(data) // 2}-"
    shards = read_shards(out, "edu_fineweb")
    assert list(shards) == expected_names("edu_fineweb", 250_000)
    assert np.array_equal(np.concatenate(list(shards.values())), shakespeare_tokens[:250_000])


def test_prepro_hub_listing(http_server, tmp_path):
    """edu-100B's file list comes from the Hub tree API, followed across pages (Link: rel="next"), parquet
    files only, with each LFS file's size and sha256."""
    api = tmp_path / "www" / "api" / "datasets" / "HuggingFaceFW" / "fineweb-edu" / "tree" / "main" / "sample"
    api.mkdir(parents=True)
    def entry(i):
        return {"type": "file", "path": f"sample/100BT/{i:03d}_00000.parquet", "size": 10 + i,
                "lfs": {"oid": f"{i:064x}", "size": 10 + i, "pointerSize": 134}}

    (api / "100BT").write_text(json.dumps([entry(1), {"type": "directory", "path": "sample/100BT/x"}]))
    (tmp_path / "www" / "page2").write_text(json.dumps([entry(0), {"type": "file", "path": "a/README.md",
                                                                    "size": 5}]))
    http_server.headers["api/datasets/HuggingFaceFW/fineweb-edu/tree/main/sample/100BT"] = {
        "Link": f'<{http_server.url}/page2>; rel="next"'}
    files = prepro_fineweb.list_hub_folder(http_server.url, "HuggingFaceFW/fineweb-edu", "sample/100BT")
    assert files == [("000_00000.parquet", 10, f"{0:064x}"), ("001_00000.parquet", 11, f"{1:064x}")]


def test_prepro_corrupt_downloads(http_server, tmp_path):
    """A download whose sha256 or size disagrees with what was announced is removed with a clean error
    (nothing under the final name), and a truncated parquet file is reported, not read."""
    data = bytes(range(256)) * 64
    (tmp_path / "www" / "f.bin").write_bytes(data)
    http_server.headers["f.bin"] = {"X-Linked-Etag": '"%s"' % hashlib.sha256(b"other").hexdigest()}
    with pytest.raises(SystemExit, match="corrupt: sha256"):
        prepro_fineweb.download_file(f"{http_server.url}/f.bin", str(tmp_path / "d" / "f.bin"), backoff=0.01)
    del http_server.headers["f.bin"]
    with pytest.raises(SystemExit, match=f"announces {len(data)} bytes, expected {len(data) + 1}"):
        prepro_fineweb.download_file(f"{http_server.url}/f.bin", str(tmp_path / "d" / "f.bin"), backoff=0.01,
                                     expected_size=len(data) + 1)
    http_server.fail_once["f.bin"] = 404
    with pytest.raises(SystemExit, match="HTTP 404"):
        prepro_fineweb.download_file(f"{http_server.url}/f.bin", str(tmp_path / "d" / "f.bin"), backoff=0.01)
    assert not [f for f in os.listdir(tmp_path / "d") if f == "f.bin"]
    good = tmp_path / "www" / "good.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["some text"] * 2000}), good)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[:-100])
    proc = run_script("prepro_fineweb.py", "--input", truncated, "--out-dir", tmp_path / "o", check=False)
    assert_clean_error(proc, "truncated.parquet", "not a readable parquet file")


def test_prepro_bad_input_clean_errors(enc, tmp_path, capsys):
    """Bad flags and inputs (missing path, wrong file type, malformed jsonl: a value that is no string, a
    latin-1 byte, JSON nested 100,000 deep; a dangling link in an --input folder, zero shard size, a rerun
    with other settings, foreign shards in --out-dir) end with a one-line error naming the problem (no
    traceback from the command line)."""
    out = tmp_path / "out"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n')
    other = tmp_path / "notes.csv"
    other.write_text("a,b\n")
    cases = [(["--input", tmp_path / "missing.txt"], ["missing.txt", "no such file"]),
             (["--input", other], ["notes.csv", "not a .txt, .jsonl or .parquet"]),
             (["--input", bad, "--shard-size", "0"], ["--shard-size"]),
             (["--input", bad, "--workers", "0"], ["--workers"]),
             (["--input", bad, "--tokenizer", tmp_path / "none.tok"], ["--tokenizer", "no such file"]),
             (["--input", bad, "--name", "a/b"], ["--name: 'a/b'", "holds no '/'"])]
    for args, needles in cases:
        line = error_line(prepro_fineweb.main, [*args, "--out-dir", out], capsys)
        assert all(n in line for n in needles), (line, needles)
    assert "--out-dir: give a folder's name" in error_line(prepro_fineweb.main, ["--input", bad, "--out-dir", ""],
                                                           capsys)
    proc = run_script("prepro_fineweb.py", "--input", bad, "--shard-size", "x", check=False)
    assert_clean_error(proc, "argument --shard-size: invalid positive_int value: 'x'")
    assert proc.stderr.count("\n") == 1
    proc = run_script("prepro_fineweb.py", "--input", bad, "--out-dir", out, "--workers", 1, check=False)
    assert_clean_error(proc, "bad.jsonl:2", "no 'text' string")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"text": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    links = tmp_path / "links"
    links.mkdir()
    (links / "a.txt").write_text("fine")
    (links / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    for path, needles in ((latin, ["latin.jsonl:2", "not UTF-8"]), (deep, ["deep.jsonl:2", "not a JSON object"]),
                          (links, ["gone.txt", "not a readable file"])):
        proc = run_script("prepro_fineweb.py", "--input", path, "--out-dir", tmp_path / "out2", "--workers", 1,
                          check=False)
        assert_clean_error(proc, *needles)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("Hello world.")
    run_script("prepro_fineweb.py", "--input", tiny, "--out-dir", out, "--workers", 1)
    line = error_line(prepro_fineweb.main, ["--input", tiny, "--out-dir", out, "--shard-size", 5], capsys)
    assert "other inputs or settings" in line
    os.remove(out / "tiny_prepro.json")
    proc = run_script("prepro_fineweb.py", "--input", tiny, "--out-dir", out, "--workers", 1, check=False)
    assert_clean_error(proc, "no tiny_prepro.json")
    tokens = [EOT] + enc.encode("Hello world.")
    assert [t.tolist() for t in read_shards(out, "tiny").values()] == [tokens[:1], tokens[1:]]


def test_prepro_empty_input_refused(tmp_path):
    """An --input with no document (an empty .jsonl, one of blank lines) stops with one line saying there
    is nothing to tokenize, and leaves no --out-dir or manifest behind."""
    for content in ("", "\n\n"):
        empty = tmp_path / "empty.jsonl"
        empty.write_text(content)
        proc = run_script("prepro_fineweb.py", "--input", empty, "--out-dir", tmp_path / "out", "--workers", 1,
                          check=False)
        assert_clean_error(proc, "empty.jsonl", "nothing to tokenize")
        assert not (tmp_path / "out").exists()


def test_prepro_input_within_one_shard_gets_a_train_shard(shakespeare_parquet, shakespeare_tokens, enc, tmp_path):
    """An input that fits one shard (a small text file; --max-tokens, here exactly one shard) is written as a
    val shard of its first tenth and a train shard of the rest, said in one line; a rerun without
    --max-tokens redoes it as shards of --shard-size: the same as a single run."""
    small = tmp_path / "small.txt"
    small.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    proc = run_script("prepro_fineweb.py", "--input", small, "--out-dir", tmp_path / "small", "--workers", 1)
    tokens = [EOT] + enc.encode_ordinary(small.read_text())
    cut = -(-len(tokens) // 10)
    assert f"the first {cut} make the val shard, the other {len(tokens) - cut} the train shard" in proc.stdout
    assert [t.tolist() for t in read_shards(tmp_path / "small", "small").values()] == [tokens[:cut], tokens[cut:]]
    out = tmp_path / "out"
    args = ["prepro_fineweb.py", "--input", shakespeare_parquet, "--out-dir", out, "--shard-size", SHARD,
            "--workers", 1]
    run_script(*args, "--max-tokens", SHARD)
    shards = read_shards(out, "shakespeare")
    assert [len(t) for t in shards.values()] == [SHARD // 10, SHARD - SHARD // 10]
    assert np.array_equal(np.concatenate(list(shards.values())), shakespeare_tokens[:SHARD])
    run_script(*args)
    shards = read_shards(out, "shakespeare")
    assert list(shards) == expected_names("shakespeare", len(shakespeare_tokens))
    assert np.array_equal(np.concatenate(list(shards.values())), shakespeare_tokens)


@pytest.mark.parametrize("signum, group", [(signal.SIGINT, True), (signal.SIGTERM, True),
                                           (signal.SIGTERM, False)])
def test_prepro_signal_keeps_complete_shards(tmp_path, signum, group):
    """SIGINT (Ctrl-C: the terminal signals the whole process group) and SIGTERM (a scheduler: the group,
    or the main process only) stop `prepro_fineweb.py --workers 2` with one line and exit 128 + signal,
    no traceback: the shards its manifest lists are complete and readable, and no temporary or unlisted
    shard is left."""
    src = tmp_path / "text"
    src.mkdir()
    text = open(data_file("tinyshakespeare/input.txt"), encoding="utf-8").read()
    for i in range(40):  # ~45 MB, ~10 s of tokenizing: the signal comes long before the end
        (src / f"d{i:02d}.txt").write_text(text)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "prepro_fineweb.py", "--input", src, "--out-dir", out,
                             "--workers", "2", "--shard-size", "20000"], cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not (out / "text_train_000002.bin").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    (os.killpg if group else os.kill)(proc.pid, signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"prepro_fineweb: stopped by {signal.Signals(signum).name}")
    listed = [e["file"] for e in json.load(open(out / "text_prepro.json"))["shards"]]
    assert len(listed) >= 3 and sorted(os.listdir(out)) == sorted(listed + ["text_prepro.json"])
    assert [len(t) for t in read_shards(out, "text").values()] == [20000] * len(listed)


def test_prepro_custom_tokenizer(shakespeare_parquet, tmp_path, capsys):
    """--tokenizer uses a tokenizer.py file: shards hold its <|endoftext|> id + its encode_ordinary tokens
    of every document; a damaged tokenizer file is a one-line error."""
    import pyarrow.parquet as pq
    from tokenizer import BPETokenizer
    docs = pq.read_table(shakespeare_parquet, columns=["text"]).column("text").to_pylist()
    tok = BPETokenizer.train("\n\n".join(docs[:300]), 300)
    tok.save(tmp_path / "t300.tok")
    out = tmp_path / "out"
    run_script("prepro_fineweb.py", "--input", shakespeare_parquet, "--out-dir", out, "--workers", 2,
               "--tokenizer", tmp_path / "t300.tok", "--max-tokens", 60_000, "--shard-size", 40_000)
    eot = tok.special_tokens["<|endoftext|>"]
    expected = []
    for doc in docs:
        expected += [eot] + tok.encode_ordinary(doc)
        if len(expected) >= 60_000:
            break
    shards = read_shards(out, "shakespeare")
    assert [len(t) for t in shards.values()] == [40_000, 20_000]
    assert np.concatenate(list(shards.values())).tolist() == expected[:60_000]
    (tmp_path / "bad.tok").write_text("not a tokenizer\n")
    line = error_line(prepro_fineweb.main, ["--input", shakespeare_parquet, "--out-dir", tmp_path / "o",
                                            "--tokenizer", tmp_path / "bad.tok"], capsys)
    assert line.startswith("error: --tokenizer") and "bad.tok" in line
    assert not (tmp_path / "o").exists()


def test_prepro_offline_uses_the_committed_gpt2(shakespeare_parquet, shakespeare_tokens, tmp_path):
    """Offline with tiktoken's cache empty (a proxy nobody listens on), prepro_fineweb.py says in one line
    that it tokenizes with tokenizer.py's GPT-2 from tests/data/gpt2 and writes the shards tiktoken would
    (2 workers); --bench, which times tiktoken itself, refuses instead."""
    offline = {**OFFLINE, "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_cache")}
    out = tmp_path / "out"
    proc = run_script("prepro_fineweb.py", "--input", shakespeare_parquet, "--out-dir", out, "--shard-size",
                      SHARD, "--workers", 2, env=offline)
    said = [line for line in proc.stderr.splitlines() if "tiktoken" in line]
    assert len(said) == 1 and "using tokenizer.py's GPT-2 from" in said[0] and "tests/data/gpt2" in said[0]
    assert np.array_equal(np.concatenate(list(read_shards(out, "shakespeare").values())), shakespeare_tokens)
    proc = run_script("prepro_fineweb.py", "--input", shakespeare_parquet, "--out-dir", tmp_path / "b",
                      "--bench", "--workers", 1, env=offline, check=False)
    assert_clean_error(proc, "tiktoken could not load GPT-2's encoding", "TIKTOKEN_CACHE_DIR")


def test_prepro_without_any_gpt2_leaves_no_out_dir(tmp_path):
    """Where neither tiktoken (empty cache, no network) nor the committed files (prepro_fineweb.py copied
    without the repository's tests/data) give GPT-2's encoding, prepro_fineweb.py stops with one line
    naming both, before it creates --out-dir, so no empty folder is left behind."""
    for script in ("prepro_fineweb.py", "hellaswag.py", "tokenizer.py"):
        shutil.copy(os.path.join(REPO, script), tmp_path / script)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n")
    proc = run_script(tmp_path / "prepro_fineweb.py", "--input", text, "--out-dir", tmp_path / "out" / "shards",
                      "--workers", 1, env={**OFFLINE, "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_cache")},
                      check=False)
    assert_clean_error(proc, "tiktoken could not load GPT-2's encoding", "TIKTOKEN_CACHE_DIR",
                       "tests/data/gpt2 is missing")
    assert not (tmp_path / "out").exists()


def test_prepro_unwritable_out_dir_clean_error(tmp_path, capsys):
    """An --out-dir that cannot be created (below a regular file) or where nothing can be written (/proc)
    is a one-line error naming it, before any document is tokenized."""
    text = tmp_path / "text.txt"
    text.write_text("Hello world.")
    (tmp_path / "file").write_text("not a folder")
    cases = [(tmp_path / "file" / "out", "cannot create it"), ("/proc", "cannot write there")]
    for out_dir, problem in cases:
        args = ["--input", text, "--out-dir", out_dir, "--workers", 1]
        line = error_line(prepro_fineweb.main, args, capsys)
        assert line.startswith(f"error: --out-dir {out_dir}: {problem} ("), line


def test_prepro_full_disk_clean_error(shakespeare_parquet, tmp_path):
    """A disk that fills while a shard is written (an 8 KiB limit on the size of the files the script
    writes: EFBIG, which counts as ENOSPC) is one line that names the shard and says the disk is full; the
    temporary is removed, and what an earlier run wrote (a short val and train shard, which the rerun was
    to redo longer, and the manifest) is left as it was."""
    out = tmp_path / "out"
    args = ["prepro_fineweb.py", "--input", shakespeare_parquet, "--out-dir", out, "--shard-size", SHARD,
            "--workers", 1]
    run_script(*args, "--max-tokens", 1000)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    assert sorted(before) == ["shakespeare_prepro.json", "shakespeare_train_000001.bin", "shakespeare_val_000000.bin"]
    proc = run_script_on_a_full_disk(8192, *args, "--max-tokens", 40_000)
    assert_clean_error(proc)
    assert proc.stderr.splitlines()[-1] == \
        f"error: cannot write {out / 'shakespeare_val_000000.bin'}: no space left, the disk is full"
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


def test_prepro_bench_prints_both(shakespeare_parquet, shakespeare_tokens, tmp_path):
    """--bench prints our tokens/s next to bare tiktoken encode_ordinary_batch on the same documents and
    their ratio, and leaves --out-dir alone."""
    proc = run_script("prepro_fineweb.py", "--input", shakespeare_parquet, "--bench", "--workers", 2,
                      "--out-dir", tmp_path / "out")
    lines = proc.stdout.splitlines()
    ours = [line for line in lines if line.startswith("prepro_fineweb")]
    bare = [line for line in lines if line.startswith("tiktoken encode_ordinary_batch, 2 threads")]
    n = f"{len(shakespeare_tokens):,} tokens in"
    assert len(ours) == len(bare) == 1 and n in ours[0] and n in bare[0]
    assert any(line.startswith("ratio to encode_ordinary_batch: ") for line in lines)
    assert not (tmp_path / "out").exists()
