"""Test infrastructure: the offline data of SPEC §7 and the shared fixtures."""
import os

import numpy as np
import requests

from conftest import shared_file


def test_offline_data_present():
    """Every file of SPEC §7 is in ../shared, with the sizes SPEC §7 gives."""
    assert os.path.getsize(shared_file("data/tinyshakespeare/input.txt")) == 1115394
    for rel in ("data/gpt2/encoder.json", "data/gpt2/vocab.bpe", "cache/tiktoken",
                "data/hellaswag/hellaswag_val_first10.jsonl"):
        shared_file(rel)
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("en", "de"):
            shared_file(f"data/multi30k/{split}.{lang}.gz")


def test_shakespeare_tokens(shakespeare_tokens):
    """tiktoken (offline cache) gives SPEC §7's 338,025 GPT-2 tokens for tinyshakespeare, plus one EOT per
    document in the fixture's shards."""
    import tiktoken
    text = open(shared_file("data/tinyshakespeare/input.txt"), encoding="utf-8").read()
    assert len(tiktoken.get_encoding("gpt2").encode_ordinary(text)) == 338025
    assert shakespeare_tokens[0] == 50256 and shakespeare_tokens.dtype == np.uint16


def test_local_server_ranges_and_faults(http_server):
    """The local HTTP server serves byte ranges, cuts a body short once, and fails a request once."""
    data = bytes(range(256)) * 40
    with open(os.path.join(http_server.root, "f.bin"), "wb") as f:
        f.write(data)
    assert requests.get(f"{http_server.url}/f.bin", timeout=5).content == data
    r = requests.get(f"{http_server.url}/f.bin", headers={"Range": "bytes=100-"}, timeout=5)
    assert r.status_code == 206 and r.content == data[100:]
    http_server.cut_once["f.bin"] = 1000
    got, broke = b"", False
    try:
        with requests.get(f"{http_server.url}/f.bin", stream=True, timeout=5) as r:
            for chunk in r.iter_content(100):
                got += chunk
    except requests.exceptions.RequestException:
        broke = True
    assert broke and len(got) <= 1000 and data.startswith(got)
    http_server.fail_once["f.bin"] = 503
    assert requests.get(f"{http_server.url}/f.bin", timeout=5).status_code == 503
    assert requests.get(f"{http_server.url}/f.bin", timeout=5).content == data
