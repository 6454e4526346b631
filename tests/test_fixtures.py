"""Test infrastructure: the committed test data (tests/data), tiktoken built from it, the shared fixtures."""
import hashlib
import os
import re

import numpy as np
import requests

from conftest import DATA, data_file
from test_parity import TIKTOKEN_GPT2_FILES


def listed_files():
    """{relative path: (bytes, sha256)} from the table in tests/data/README.md."""
    with open(data_file("README.md"), encoding="utf-8") as f:
        rows = re.findall(r"^\| `([^`]+)` \| (\d+) \| `([0-9a-f]{64})` \|", f.read(), re.M)
    return {rel: (int(size), digest) for rel, size, digest in rows}


def test_data_files_listed_and_intact():
    """Every file under tests/data is in its README's table with the size and sha256 it has (a damaged
    fixture fails here by name), the table names nothing else, and all of it stays within 4 MiB."""
    listed = listed_files()
    present = {os.path.relpath(os.path.join(root, name), DATA)
               for root, _, names in os.walk(DATA) for name in names} - {"README.md"}
    assert present == set(listed), f"unlisted: {present - set(listed)}, missing: {set(listed) - present}"
    for rel, (size, digest) in listed.items():
        data = open(data_file(rel), "rb").read()
        assert len(data) == size, f"{rel}: {len(data)} bytes, the table says {size}"
        assert hashlib.sha256(data).hexdigest() == digest, f"{rel}: sha256 differs from the table's"
    assert sum(size for size, _ in listed.values()) <= 4 << 20


def test_gpt2_files_are_the_ones_tiktoken_pins():
    """encoder.json and vocab.bpe hash to what tiktoken's own source pins for its "gpt2" encoding, at the
    URLs the test cache files them under; the cache in use is the one built from tests/data."""
    import tiktoken_ext.openai_public as openai_public
    source = open(openai_public.__file__, encoding="utf-8").read()
    body = source[source.index("def gpt2("):]
    body = body[:body.index("\ndef ")]
    pinned = dict(re.findall(r'(vocab_bpe|encoder_json)_file="([^"]+)"', body))
    hashes = dict(re.findall(r'(vocab_bpe|encoder_json)_hash="([0-9a-f]{64})"', body))
    assert set(pinned) == set(hashes) == {"vocab_bpe", "encoder_json"}
    assert {pinned[k]: hashes[k] for k in pinned} == {
        url: hashlib.sha256(open(data_file(rel), "rb").read()).hexdigest()
        for url, rel in TIKTOKEN_GPT2_FILES.items()}
    cache = os.environ["TIKTOKEN_CACHE_DIR"]
    assert sorted(os.listdir(cache)) == sorted(hashlib.sha1(u.encode()).hexdigest() for u in pinned.values())


def test_project_stands_alone():
    """No file of the project points outside the clone: no path to a folder beside the checkout, no
    reference to a design document it does not carry (the project's own is docs/FORMATS.md)."""
    from conftest import REPO
    banned = ["../" + "shared", "SPEC" + " §", "SHARED" + "_DIR"]
    found = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in (".git", ".venv", "__pycache__", "data", "out", "wip")]
        for name in names:
            if name.endswith((".py", ".md", ".txt", ".toml", ".cfg")) or name == "run":
                path = os.path.join(root, name)
                text = open(path, encoding="utf-8", errors="replace").read()
                found += [f"{os.path.relpath(path, REPO)}: {b}" for b in banned if b in text]
    assert found == []


def test_shakespeare_tokens(shakespeare_tokens):
    """tiktoken (from the committed files) gives tinyshakespeare's 338,025 GPT-2 tokens, plus one EOT per
    document in the fixture's shards."""
    import tiktoken
    text = open(data_file("tinyshakespeare/input.txt"), encoding="utf-8").read()
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
