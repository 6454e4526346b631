"""Real English text for the H100 comparison run (bench/h100_compare.sh), which cannot reach FineWeb-Edu:
three Debian packages' English prose, shuffled by document and tokenized by prepro_fineweb.py --input into
llm.c shards of 1M tokens, the first (val) kept aside as the validation set.

    python bench/english_text.py data/english        # 80 MB of text -> 25M tokens: ~40 s on 2 cores

The text, fetched with `apt-get download` (Debian 12 package names):
- dict-gcide: the GNU Collaborative International Dictionary of English (Webster's 1913 and additions),
  cut into documents of about 200 lines at entry boundaries;
- linux-doc-6.1: the Linux kernel's documentation (its reStructuredText sources), one document per file;
- python3.11-doc: the Python 3.11 documentation (its reStructuredText sources), one document per file.
"""
import argparse
import glob
import gzip
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("dict-gcide", "linux-doc-6.1", "python3.11-doc")
GCIDE_LINES = 200  # lines per dictionary document, cut at the blank line before an entry
VAL_TOKENS = 1_000_000
MAX_TOKENS = 25_000_000  # 28.2M in all; 25M (50 MB of shards) leave room in the device call's 64 MiB


def documents(root):
    """The packages' English documents (str), unpacked under root, in a fixed order."""
    with gzip.open(os.path.join(root, "usr/share/dictd/gcide.dict.dz"), "rt", encoding="utf-8",
                   errors="replace") as f:  # dictzip is gzip with an index: gzip reads it whole
        lines = f.read().splitlines()
    doc = []
    for line in lines:
        doc.append(line)
        if len(doc) >= GCIDE_LINES and not line.strip():
            yield "\n".join(doc)
            doc = []
    if doc:
        yield "\n".join(doc)
    for path in sorted(glob.glob(os.path.join(root, "usr/share/doc/linux-doc-6.1/Documentation/**/*.rst.gz"),
                                 recursive=True)):
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            yield f.read()
    for path in sorted(glob.glob(os.path.join(root, "usr/share/doc/python3.11/html/_sources/**/*.rst.txt"),
                                 recursive=True)):
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="where the shards go (english_val_000000.bin, english_train_*.bin)")
    p.add_argument("--seed", type=int, default=0, help="the document shuffle's seed (default 0)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        got = subprocess.run(["apt-get", "download", *PACKAGES], cwd=work, capture_output=True, text=True)
        debs = sorted(glob.glob(os.path.join(work, "*.deb")))
        if got.returncode != 0 or len(debs) != len(PACKAGES):
            sys.exit(f"error: apt-get download {' '.join(PACKAGES)} failed: "
                     f"{(got.stderr.strip().splitlines() or ['no output'])[-1]}")
        for deb in debs:
            subprocess.run(["dpkg", "-x", deb, os.path.join(work, "pkg")], check=True)
        docs = [d for d in documents(os.path.join(work, "pkg")) if d.strip()]
        order = np.random.default_rng(args.seed).permutation(len(docs))
        jsonl = os.path.join(work, "english.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            for i in order:
                f.write(json.dumps({"text": docs[i]}) + "\n")
        print(f"{len(docs)} documents, {os.path.getsize(jsonl) / 1e6:.1f} MB of JSON lines", flush=True)
        done = subprocess.run([sys.executable, os.path.join(REPO, "prepro_fineweb.py"), "--input", jsonl,
                               "--out-dir", args.out_dir, "--name", "english", "--shard-size", str(VAL_TOKENS),
                               "--max-tokens", str(MAX_TOKENS)])
        sys.exit(done.returncode)  # prepro_fineweb.py says in one line what failed


if __name__ == "__main__":
    main()
