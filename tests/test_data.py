"""Data: prepro_fineweb.py and hellaswag.py (downloads, token shards, HellaSwag rendering, scoring, export).

Everything runs offline: the download tests use the conftest's local HTTP server on 127.0.0.1, the
HellaSwag tests the 10 real validation examples in ../shared, the shard tests a parquet file written here
from tinyshakespeare. Expected values are computed independently with tiktoken and numpy."""
import hashlib
import json
import os

import numpy as np
import pytest

import hellaswag
from conftest import EOT, assert_clean_error, run_script, shared_file


@pytest.fixture(scope="module")
def enc():
    import tiktoken
    return tiktoken.get_encoding("gpt2")


def real_examples():
    with open(shared_file("data/hellaswag/hellaswag_val_first10.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


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
    data = open(shared_file("data/hellaswag/hellaswag_val_first10.jsonl"), "rb").read()
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


def test_hellaswag_bad_input_clean_errors(http_server, tmp_path):
    """Malformed jsonl, a row without 4 endings, a missing file on the server and an unknown split end
    with a one-line error and no traceback."""
    cache = tmp_path / "cache"
    cache.mkdir()
    good = open(shared_file("data/hellaswag/hellaswag_val_first10.jsonl")).read()
    (cache / "hellaswag_val.jsonl").write_text(good[:len(good) // 2])
    proc = run_script("hellaswag.py", "show", "--limit", "10", "--cache-dir", cache, check=False)
    assert_clean_error(proc, "hellaswag_val.jsonl:", "not valid JSON")
    (cache / "hellaswag_val.jsonl").write_text('{"ctx": "a", "endings": ["b"], "label": 0}\n')
    proc = run_script("hellaswag.py", "export", "--out", tmp_path / "x.bin", "--cache-dir", cache,
                      check=False)
    assert_clean_error(proc, "endings")
    assert not (tmp_path / "x.bin").exists()
    proc = run_script("hellaswag.py", "download", "--split", "train", "--cache-dir", cache,
                      "--base-url", http_server.url, check=False)
    assert_clean_error(proc, "HTTP 404")
    proc = run_script("hellaswag.py", "show", "--split", "dev", check=False)
    assert_clean_error(proc, "--split")
