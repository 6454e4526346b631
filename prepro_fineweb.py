"""FineWeb(-Edu) to llm.c token shards: download the parquet files, tokenize in a process pool, write shards.

Output (docs/FORMATS.md, Token shards): `<name>_val_000000.bin`, `<name>_train_000001.bin`, ... in
--out-dir; each a header of 256 int32 (20240520, 1, token count) then uint16 GPT-2 tokens, every document
preceded by EOT (50256).
Shard 0 is validation. Documents run on across shard boundaries, as in llm.c's dev/data/fineweb.py.

    python prepro_fineweb.py                                   # FineWeb-Edu sample-10BT, 100M-token shards
    python prepro_fineweb.py --dataset 10B --max-tokens 200000000 --workers 16
    python prepro_fineweb.py --input notes.jsonl books/ --shard-size 1000000 --out-dir data/mine
    python prepro_fineweb.py --input docs.parquet --bench --workers 2   # our tokens/s vs bare tiktoken

Downloads use plain HTTPS (requests): streamed to `<file>.part`, resumed with a Range request after an
interruption, retried with backoff, checked against the announced size and sha256, then renamed. Parquet
is read one row group at a time. A rerun continues after the last complete shard (recorded in
`<name>_prepro.json` next to the shards) instead of starting over. Ctrl-C (SIGINT) or SIGTERM stops the
workers and the run with one line, exit 130 or 143, the complete shards kept for that rerun.
"""
import argparse
import contextlib
import errno
import itertools
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from functools import lru_cache

import numpy as np
import requests
from tqdm import tqdm

# one copy of the resumable, checked download, and of GPT-2's encoding with its offline fallback
from hellaswag import EncodingUnavailable, download_file, load_gpt2_encoding, sha256_of, temp_name

# -----------------------------------------------------------------------------
# Config

HF_URL = "https://huggingface.co"
# The sample folders of the two Hugging Face datasets. File lists, from the datasets' commit pages:
# FineWeb-Edu sample/10BT is the 14 files 000_00000 ... 013_00000.parquet (commit 84e8104e "DataTrove
# upload (14 files)", huggingface.co/datasets/HuggingFaceFW/fineweb-edu); classic FineWeb sample/10BT is
# the 15 files 000_00000 ... 014_00000.parquet (014 is the short last one), as scripts that fetch them
# name them. FineWeb-Edu sample/100BT came in many 14-file commits (000_0000k ... 013_0000k), so it is
# listed through the Hub's tree API (/api/datasets/<repo>/tree/main/<folder>), which also gives each
# file's size and sha256.
DATASETS = {
    "edu-10B": dict(repo="HuggingFaceFW/fineweb-edu", folder="sample/10BT", name="edu_fineweb",
                    out_dir="data/fineweb_edu", files=[f"{i:03d}_00000.parquet" for i in range(14)]),
    "edu-100B": dict(repo="HuggingFaceFW/fineweb-edu", folder="sample/100BT", name="edu_fineweb",
                     out_dir="data/fineweb_edu100B", files=None),
    "10B": dict(repo="HuggingFaceFW/fineweb", folder="sample/10BT", name="fineweb",
                out_dir="data/fineweb10B", files=[f"{i:03d}_00000.parquet" for i in range(15)]),
}
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
GPT2_EOT = 50256
CHUNK_CHARS = 1 << 17   # text per tokenizer task: small enough to spread a small input over the workers
DOWNLOAD_TIMEOUT_S = 60
# a write that fails for want of room: a full disk, a full quota, a file-size limit reached
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def die(msg):
    """Stops with a one-line error (SystemExit prints it to stderr and exits 1, no traceback)."""
    raise SystemExit(f"error: {msg}")


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the main process (a BaseException, as KeyboardInterrupt: no handler of
    Exception swallows it)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


# The signal handlers' state: a signal that arrives while a shard and the manifest are being written is
# held until both are, so that the manifest always lists exactly the complete shards
_signals = dict(critical=0, pending=None, received=0)


def _on_signal(signum, frame):
    _signals["received"] += 1
    if _signals["received"] > 1:  # a second signal while the first unwinds: stop at once
        print(f"prepro_fineweb: {signal.Signals(signum).name} again, stopping now; the complete shards are "
              f"kept", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    if _signals["critical"]:
        _signals["pending"] = signum
    else:
        raise Interrupted(signum)


class _uninterrupted:
    """Holds SIGINT and SIGTERM back for the duration of a with-block, then raises the one that came."""

    def __enter__(self):
        _signals["critical"] += 1

    def __init__(self, defer_raise=False):
        self.defer_raise = defer_raise  # True: the caller raises it, through _raise_pending()

    def __exit__(self, *exc):
        _signals["critical"] -= 1
        if exc[0] is None and not self.defer_raise:
            _raise_pending()


def _raise_pending():
    if not _signals["critical"] and _signals["pending"] is not None:
        signum, _signals["pending"] = _signals["pending"], None
        raise Interrupted(signum)


def _worker_init():
    """The workers leave both signals to the main process, which stops them through the pool (a worker
    killed by a terminal's SIGINT or a process group's SIGTERM would leave its task unanswered)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="FineWeb(-Edu) or local text to llm.c GPT-2 token shards")
    parser.error = die  # a bad flag gets one line naming it, as in the trainers
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="edu-10B",
                        help="Hugging Face sample to download: edu-10B or edu-100B (FineWeb-Edu's "
                             "sample-10BT or sample-100BT), 10B (FineWeb's sample-10BT); ignored with "
                             "--input (default: %(default)s)")
    parser.add_argument("--input", nargs="+", metavar="PATH",
                        help=".txt (one document per file), .jsonl (a 'text' field per line) or .parquet "
                             "(a 'text' column) files or folders of them, instead of the download (default: "
                             "none, download --dataset)")
    parser.add_argument("--out-dir", help="where the shards go, created once the tokenizer loads (default: "
                                          "data/fineweb_edu for edu-10B, data/fineweb_edu100B for edu-100B, "
                                          "data/fineweb10B for 10B, data/<shard prefix> with --input)")
    parser.add_argument("--download-dir", help="where the parquet files of --dataset go (default: "
                                               "<out-dir>/parquet)")
    parser.add_argument("--name", help="shard file prefix (default: edu_fineweb, fineweb, or the first "
                                       "--input's file name)")
    parser.add_argument("--shard-size", type=positive_int, default=10**8,
                        help="tokens per shard, the validation shard 0 included (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="stop after this many tokens (default: 0 = all)")
    parser.add_argument("--workers", type=positive_int, default=max(1, os.cpu_count() or 1),
                        help="tokenizer processes (default: one per CPU, here %(default)s)")
    parser.add_argument("--tokenizer", help="a tokenizer file saved by tokenizer.py (default: tiktoken "
                                            "GPT-2)")
    parser.add_argument("--hf-url", default=HF_URL,
                        help="Hugging Face endpoint: a mirror, or a test server (default: %(default)s)")
    parser.add_argument("--bench", action="store_true",
                        help="tokenize into a scratch dir, then time bare tiktoken encode_ordinary_batch "
                             "on the same documents with --workers threads, and print both (default: off)")
    args = parser.parse_args(argv)
    if args.max_tokens < 0:
        parser.error("argument --max-tokens: must be >= 0")
    if args.bench and args.tokenizer:
        parser.error("argument --bench: compares against tiktoken's GPT-2 encoder; drop --tokenizer")
    if args.out_dir == "":
        parser.error("argument --out-dir: give a folder's name")
    if "/" in (args.name or ""):
        parser.error(f"argument --name: {args.name!r} is a file name prefix, which holds no '/'")
    return args


# -----------------------------------------------------------------------------
# Download: hellaswag.py's download_file (imported above) streams to <name>.part, resumes with an HTTP
# Range request after an interruption, retries with backoff, checks the announced size and sha256, and
# renames into place only when complete. Here: the Hub's file listing, and which files a dataset reads.

def list_hub_folder(hf_url, repo, folder):
    """[(file name, size, sha256)] of the parquet files in a dataset folder, through the Hub's tree API;
    it pages its answer with a Link: <next>; rel="next" header."""
    url, files = f"{hf_url}/api/datasets/{repo}/tree/main/{folder}", []
    while url:
        try:
            resp = requests.get(url, timeout=DOWNLOAD_TIMEOUT_S)
            resp.raise_for_status()
            entries = resp.json()
        except (requests.RequestException, ValueError) as e:
            die(f"cannot list {repo}/{folder} through {url}: {e}")
        for entry in entries:
            path = entry.get("path", "")
            if entry.get("type") == "file" and path.endswith(".parquet"):
                lfs = entry.get("lfs") or {}
                files.append((path.rsplit("/", 1)[-1], lfs.get("size", entry.get("size")), lfs.get("oid")))
        url = resp.links.get("next", {}).get("url")
    if not files:
        die(f"{repo}/{folder} lists no parquet files")
    return sorted(files)


def dataset_sources(args, download_dir):
    """The parquet files of --dataset, as dicts {path, url, size, sha256}, downloaded when first read."""
    spec = DATASETS[args.dataset]
    base = f"{args.hf_url}/datasets/{spec['repo']}/resolve/main/{spec['folder']}"
    if spec["files"] is not None:
        listed = [(name, None, None) for name in spec["files"]]
    else:
        listed = list_hub_folder(args.hf_url, spec["repo"], spec["folder"])
    return [dict(path=os.path.join(download_dir, name), url=f"{base}/{name}", size=size, sha256=sha,
                 identity=f"{spec['repo']}/{spec['folder']}/{name}") for name, size, sha in listed]


def local_sources(paths):
    """--input paths (files, or folders searched recursively) as dicts {path, identity}, in sorted order."""
    found = []
    for path in paths:
        if os.path.isdir(path):
            inside = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                            if f.endswith((".txt", ".jsonl", ".parquet")))
            if not inside:
                die(f"--input {path}: no .txt, .jsonl or .parquet files in this folder")
            broken = next((p for p in inside if not os.path.isfile(p)), None)
            if broken is not None:  # a dangling symbolic link, say
                die(f"--input {path}: {broken} is not a readable file (a broken link?)")
            found += inside
        elif os.path.isfile(path):
            if not path.endswith((".txt", ".jsonl", ".parquet")):
                die(f"--input {path}: not a .txt, .jsonl or .parquet file")
            found.append(path)
        else:
            die(f"--input {path}: no such file or folder")
    return [dict(path=p, url=None, identity=f"{os.path.abspath(p)} ({os.path.getsize(p)} bytes)")
            for p in found]


# -----------------------------------------------------------------------------
# Documents: read in order, one parquet row group / jsonl line / txt file at a time

def _parquet_file(path):
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... on a damaged file
        die(f"{path}: not a readable parquet file ({e}); a truncated download? delete it and run again")
    if "text" not in pf.schema_arrow.names:
        die(f"{path}: parquet file has no 'text' column")
    return pf


def jsonl_texts(path, skip_docs):
    """Yields the 'text' of each line of a .jsonl file after the first `skip_docs` (blank lines aside), and
    returns how many of those remain to skip in the next file; a line that is not UTF-8, not a JSON object
    (or one nested past json's recursion) or has no 'text' string is one line naming it."""
    with open(path, "rb") as f:  # bytes, decoded line by line: an error names its line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                die(f"{path}:{lineno}: not UTF-8 text")
            if not line.strip():
                continue
            if skip_docs:
                skip_docs -= 1
                continue
            try:
                text = json.loads(line).get("text")
            except (json.JSONDecodeError, AttributeError, RecursionError):
                die(f"{path}:{lineno}: not a JSON object")
            if not isinstance(text, str):
                die(f"{path}:{lineno}: no 'text' string")
            yield text
    return skip_docs


def iter_documents(sources, skip_docs, timer):
    """Yields the documents' text in order, after skipping the first `skip_docs` of them (cheaply, from
    parquet metadata, where it can), and None after each source. Downloads a source just before reading
    it; timer["download"] collects the seconds spent downloading."""
    for src in sources:
        path = src["path"]
        if src.get("url"):
            t0 = time.time()
            download_file(src["url"], path, expected_size=src.get("size"), expected_sha256=src.get("sha256"))
            timer["download"] += time.time() - t0
        if path.endswith(".parquet"):
            pf = _parquet_file(path)
            for i in range(pf.num_row_groups):
                rows = pf.metadata.row_group(i).num_rows
                if skip_docs >= rows:
                    skip_docs -= rows
                    continue
                try:
                    texts = pf.read_row_group(i, columns=["text"]).column("text").to_pylist()
                except Exception as e:
                    die(f"{path}: row group {i} is unreadable ({e}); delete the file and run again")
                for text in texts[skip_docs:]:
                    if not isinstance(text, str):
                        die(f"{path}: row group {i} holds a 'text' value that is not a string")
                    yield text
                skip_docs = 0
        elif path.endswith(".jsonl"):
            skip_docs = yield from jsonl_texts(path, skip_docs)
        elif skip_docs:  # a .txt file is one document
            skip_docs -= 1
        else:
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except UnicodeDecodeError:
                die(f"{path}: not UTF-8 text")
            yield text
        yield None


def iter_chunks(docs):
    """Groups documents into lists of about CHUNK_CHARS characters (one tokenizer task each); passes on
    the None that ends a source."""
    chunk, chars = [], 0
    for doc in docs:
        if doc is not None:
            chunk.append(doc)
            chars += len(doc)
        if chunk and (doc is None or chars >= CHUNK_CHARS):
            yield chunk
            chunk, chars = [], 0
        if doc is None:
            yield None


# -----------------------------------------------------------------------------
# Tokenization (runs in the worker processes)

class TokenizerError(Exception):
    """A --tokenizer file that cannot be used (raised in a worker too, where SystemExit would hang it)."""


def gpt2_encoding(fallback=True):
    """hellaswag.load_gpt2_encoding: tiktoken's GPT-2 encoding, or with `fallback` the committed files'
    where tiktoken cannot load (said by the main process alone); TokenizerError where none loads."""
    try:
        return load_gpt2_encoding(fallback, announce=mp.parent_process() is None)
    except EncodingUnavailable as e:
        raise TokenizerError(str(e)) from None


@lru_cache(maxsize=None)
def load_tokenizer(path):
    """(encode_batch(list of str) -> list of token lists, EOT id, vocab size) for tiktoken's GPT-2
    encoding (path None) or a tokenizer.py file. Cached: each worker process loads it once."""
    if path is None:
        enc = gpt2_encoding()
        # a plain loop: encode_ordinary_batch(num_threads=1) is 2x slower here, from its thread pool
        return (lambda docs: [enc.encode_ordinary(d) for d in docs]), enc.eot_token, enc.n_vocab
    try:
        from tokenizer import BPETokenizer
    except ImportError as e:
        raise TokenizerError(f"--tokenizer needs tokenizer.py next to this script ({e})") from None
    try:
        tok = BPETokenizer.load(path)
    except Exception as e:  # whatever a damaged file makes the loader raise
        raise TokenizerError(f"--tokenizer {path}: cannot load ({type(e).__name__}: {e})") from None
    if "<|endoftext|>" not in tok.special_tokens:
        raise TokenizerError(f"--tokenizer {path}: has no <|endoftext|> token to separate documents")
    return (lambda docs: [tok.encode_ordinary(d) for d in docs]), tok.special_tokens["<|endoftext|>"], \
        tok.vocab_size


def tokenize_chunk(task):
    """(tokenizer path, documents) -> (tokens uint16: EOT + tokens of each document, per-document lengths
    including the EOT). uint16 halves what travels back to the main process."""
    path, docs = task
    encode_batch, eot, _ = load_tokenizer(path)
    ids = encode_batch(docs)
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))  # (D,)
    stream = itertools.chain.from_iterable(itertools.chain((eot,), x) for x in ids)
    tokens = np.fromiter(stream, dtype=np.uint16, count=int(lengths.sum()))             # (sum lengths,)
    return tokens, lengths


def tokenized_chunks(chunks, tokenizer_path, workers):
    """Tokenizes chunks in order in a process pool, with at most 2 tasks per worker in flight (Pool.imap
    would read the whole dataset ahead into memory). At the end of a source (None) it hands over every
    result before reading on, so a run that stops there never downloads the next file.
    Yields (number of documents, tokens, lengths)."""
    # workers that ignore SIGTERM must be joined below, never left to Pool's finalizer (it would wait on
    # them forever): a signal during the start is raised only once inside the try
    with _uninterrupted(defer_raise=True):
        pool = mp.Pool(workers, initializer=_worker_init)
    pending = deque()
    try:
        _raise_pending()
        for chunk in chunks:
            if chunk is None:
                while pending:
                    yield _result(*pending.popleft())
                continue
            pending.append((len(chunk), pool.apply_async(tokenize_chunk, ((tokenizer_path, chunk),))))
            if len(pending) >= 2 * workers:
                yield _result(*pending.popleft())
        while pending:
            yield _result(*pending.popleft())
    except BaseException:
        # A caller that stopped early (--max-tokens), a failed task or a signal (Interrupted) leaves tasks
        # in flight, and Pool.terminate() can then hang for good (its task handler stays blocked on the
        # workers' queue lock; seen here in a loop of early stops), so let them finish (a chunk takes a
        # fraction of a second) and the workers exit as usual.
        for _, async_result in pending:
            async_result.wait()
        raise
    finally:
        pool.close()
        pool.join()


def _result(ndocs, async_result):
    try:
        tokens, lengths = async_result.get()
    except Exception as e:  # a worker's failure, re-raised here: report it in one line
        die(f"tokenizing failed: {type(e).__name__}: {e}")
    return ndocs, tokens, lengths


# -----------------------------------------------------------------------------
# Shards and the progress manifest

def shard_name(name, index):
    return f"{name}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


def write_file(path, *chunks):
    """Writes the bytes-like chunks, one after the other, to a temporary name beside `path`, renamed when
    complete: a failed write (a one-line error, a full disk said as such) removes the temporary and leaves
    an earlier `path` as it was."""
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except OSError as e:
        die(f"cannot write {path}: " + ("no space left, the disk is full" if e.errno in NO_SPACE
                                         else e.strerror or str(e)))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_shard(path, tokens):
    """llm.c token shard (docs/FORMATS.md, Token shards)."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = [SHARD_MAGIC, SHARD_VERSION, len(tokens)]
    write_file(path, header.tobytes(), np.asarray(tokens, dtype="<u2").data)


def shard_is_complete(path, ntokens):
    """True when the file holds a valid header for exactly `ntokens` tokens and all of them."""
    if not os.path.isfile(path) or os.path.getsize(path) != 4 * HEADER_INTS + 2 * ntokens:
        return False
    header = np.fromfile(path, dtype="<i4", count=3)
    return header.tolist() == [SHARD_MAGIC, SHARD_VERSION, ntokens]


def doc_position(ends, used):
    """(documents finished, tokens into the next one) at token `used` of documents ending at offsets `ends`."""
    done = int(np.searchsorted(ends, used, side="right"))
    return done, used - (int(ends[done - 1]) if done else 0)


def save_manifest(path, manifest):
    write_file(path, json.dumps(manifest, indent=1).encode())


def resume_point(out_dir, name, manifest_path, settings, max_tokens):
    """Reads the manifest of an earlier run: (manifest, complete full shards to keep, finished?).
    Each shard entry records where the next shard starts: document index and token offset in it."""
    if not os.path.exists(manifest_path):
        pattern = rf"{re.escape(name)}_(val|train)_\d{{6}}\.bin"
        strays = [f for f in os.listdir(out_dir) if re.fullmatch(pattern, f)]
        if strays:
            die(f"{out_dir} holds {name} shards but no {os.path.basename(manifest_path)}; choose another "
                f"--out-dir or --name, or delete them")
        return dict(settings=settings, shards=[], finished=None), 0, False
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        shards = manifest["shards"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        die(f"{manifest_path} is damaged ({e}); delete it and the shards next to it, then run again")
    if manifest.get("settings") != settings:
        die(f"{out_dir} holds shards made from other inputs or settings (see {manifest_path}); choose "
            f"another --out-dir or delete them")
    intact = 0
    for entry in shards:
        if not shard_is_complete(os.path.join(out_dir, entry["file"]), entry["tokens"]):
            break
        intact += 1
    total = sum(e["tokens"] for e in shards)
    finished = manifest.get("finished")
    if intact == len(shards) and finished and (finished["exhausted"] or total == max_tokens):
        return manifest, intact, True
    full = 0  # resume after the last full shard: a short last one is redone
    while full < intact and shards[full]["tokens"] == settings["shard_size"]:
        full += 1
    if max_tokens and full * settings["shard_size"] > max_tokens:
        die(f"{out_dir} already holds {full * settings['shard_size']:,} tokens, more than --max-tokens "
            f"{max_tokens:,}; choose another --out-dir")
    manifest["shards"], manifest["finished"] = shards[:full], None
    return manifest, full, False


def prepare(sources, out_dir, name, shard_size, max_tokens, workers, tokenizer_path):
    """Tokenizes the sources into shards in out_dir. Returns (tokens written this run, documents read
    this run, seconds spent, seconds of that downloading)."""
    try:
        vocab = load_tokenizer(tokenizer_path)[2]
    except TokenizerError as e:
        die(str(e))
    if vocab > 1 << 16:
        die(f"tokenizer has {vocab:,} tokens; llm.c shards store uint16 ids (at most 65,536)")
    created = not os.path.isdir(out_dir)
    try:  # only now: a run that cannot tokenize leaves no empty --out-dir behind
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        die(f"--out-dir {out_dir}: cannot create it ({e.strerror})")
    try:  # a folder where nothing can be written fails now, not once the first shard is tokenized
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as e:
        die(f"--out-dir {out_dir}: cannot write there ({e.strerror})")
    tok_id = "tiktoken gpt2" if tokenizer_path is None else \
        f"{os.path.abspath(tokenizer_path)} (sha256 {sha256_of(tokenizer_path)})"
    settings = dict(sources=[s["identity"] for s in sources], shard_size=shard_size, tokenizer=tok_id)
    manifest_path = os.path.join(out_dir, f"{name}_prepro.json")
    manifest, index, done = resume_point(out_dir, name, manifest_path, settings, max_tokens)
    if done:
        print(f"{out_dir}: all {len(manifest['shards'])} shards already complete, nothing to do")
        return 0, 0, 0.0, 0.0
    if index:
        print(f"{out_dir}: keeping {index} complete shards, continuing after them")
    next_doc, skip_tokens = (manifest["shards"][-1]["next_doc"], manifest["shards"][-1]["next_offset"]) \
        if index else (0, 0)
    budget = max_tokens - index * shard_size if max_tokens else None
    timer = dict(download=0.0)
    t0 = time.time()
    buf = np.empty(shard_size, dtype=np.uint16)  # (shard_size,) the shard being filled
    fill, written, docs_read = 0, 0, 0
    doc_lengths = []  # while shard 0 fills: each document's tokens, for where a split of it falls

    def flush(tokens, next_pos):
        """Writes the next shard; records where the one after it starts (document, token offset)."""
        nonlocal index
        fname = shard_name(name, index)
        with _uninterrupted():  # a shard counts once the manifest lists it
            write_shard(os.path.join(out_dir, fname), tokens)
            manifest["shards"].append(dict(file=fname, tokens=len(tokens), next_doc=next_pos[0],
                                           next_offset=next_pos[1]))
            save_manifest(manifest_path, manifest)
            index += 1

    first_doc, exhausted = next_doc, budget != 0
    docs = iter_documents(sources, next_doc, timer) if budget != 0 else iter(())
    results = tokenized_chunks(iter_chunks(docs), tokenizer_path, workers)
    with tqdm(total=max_tokens or None, initial=index * shard_size, unit="tok", unit_scale=True,
              desc=name) as bar, contextlib.closing(results):  # closed: the pool joined, on any exit
        for ndocs, tokens, lengths in results:
            if index == 0:
                doc_lengths.append(lengths)
            ends = np.cumsum(lengths)  # (D,) token offset where each document of the chunk ends
            used = skip_tokens         # the resumed document's tokens already in the kept shards
            skip_tokens = 0
            while used < len(tokens) and written != budget:
                take = min(shard_size - fill, len(tokens) - used)
                if budget is not None:
                    take = min(take, budget - written)
                buf[fill:fill + take] = tokens[used:used + take]
                fill, used, written = fill + take, used + take, written + take
                bar.update(take)
                if fill == shard_size or written == budget:
                    done_docs, offset = doc_position(ends, used)
                    flush(buf[:fill], (first_doc + done_docs, offset))
                    fill = 0
            first_doc += ndocs
            docs_read += ndocs
            if written == budget:
                exhausted = False
                break
    if index + bool(fill) == 1 and written > 1:
        # all of it fits shard 0: a tenth becomes the val shard and the rest a train shard, as a trainer
        # needs both
        end = manifest["shards"].pop() if index else dict(next_doc=first_doc, next_offset=0)
        index, fill, cut = 0, 0, -(-written // 10)
        print(f"{out_dir}: the {written:,} tokens fit one shard (--shard-size {shard_size:,}): the first "
              f"{cut:,} make the val shard, the other {written - cut:,} the train shard")
        flush(buf[:cut], doc_position(np.cumsum(np.concatenate(doc_lengths)), cut))
        flush(buf[cut:written], (end["next_doc"], end["next_offset"]))
    if fill:
        flush(buf[:fill], (first_doc, 0))
    if not manifest["shards"]:  # no document at all: nothing written, and no manifest of nothing
        if created:
            os.rmdir(out_dir)
        die(f"--input {' '.join(s['path'] for s in sources)}: no documents in it, nothing to tokenize")
    manifest["finished"] = dict(exhausted=exhausted)
    save_manifest(manifest_path, manifest)
    return written, docs_read, time.time() - t0, timer["download"]


# -----------------------------------------------------------------------------
# Benchmark: the same documents through bare tiktoken, on the same number of threads

def bench_bare_tiktoken(sources, ndocs, workers):
    """Tokens/s of tiktoken alone over the first `ndocs` documents, read into memory first so only the
    encoding is timed: encode_ordinary_batch on `workers` threads, and encode_ordinary in a loop on one.
    Each returns (tokens, seconds); tokens count one EOT per document, as the shards do."""
    try:
        enc = gpt2_encoding(fallback=False)  # tiktoken itself, or its timing would be ours
    except TokenizerError as e:
        die(str(e))
    texts = (d for d in iter_documents(sources, 0, dict(download=0.0)) if d is not None)
    docs = list(itertools.islice(texts, ndocs))
    t0 = time.time()
    batch = enc.encode_ordinary_batch(docs, num_threads=workers)
    t1 = time.time()
    loop = [enc.encode_ordinary(d) for d in docs]
    t2 = time.time()
    return ((sum(map(len, batch)) + len(docs), t1 - t0), (sum(map(len, loop)) + len(docs), t2 - t1))


# -----------------------------------------------------------------------------
# Main

def main(argv=None):
    """Runs the command line; SIGINT and SIGTERM stop it with one line and exit 128 + the signal's number
    (130, 143), the complete shards kept for a rerun to continue after."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers need the main thread
        return _main(argv)
    handlers = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    _signals.update(critical=0, pending=None, received=0)
    try:
        return _main(argv)
    except Interrupted as e:
        print(f"prepro_fineweb: stopped by {signal.Signals(e.signum).name}; the complete shards and their "
              f"manifest are kept, run the same command again to continue", file=sys.stderr, flush=True)
        sys.exit(128 + e.signum)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def _main(argv=None):
    args = parse_args(argv)
    if args.input:
        sources = local_sources(args.input)
        name = args.name or re.sub(r"\W", "_", os.path.splitext(os.path.basename(
            os.path.normpath(args.input[0])))[0])
        out_dir = args.out_dir or os.path.join("data", name)
    else:
        spec = DATASETS[args.dataset]
        name = args.name or spec["name"]
        out_dir = args.out_dir or spec["out_dir"]
        sources = dataset_sources(args, args.download_dir or os.path.join(out_dir, "parquet"))
    if args.tokenizer and not os.path.isfile(args.tokenizer):
        die(f"--tokenizer {args.tokenizer}: no such file")
    if args.bench:
        with tempfile.TemporaryDirectory(prefix="prepro_bench_") as scratch:
            written, ndocs, dt, dl = prepare(sources, scratch, name, args.shard_size, args.max_tokens,
                                             args.workers, None)
        (bare_tokens, bare_dt), (loop_tokens, loop_dt) = bench_bare_tiktoken(sources, ndocs, args.workers)
        ours, bare = written / (dt - dl), bare_tokens / bare_dt
        print(f"prepro_fineweb (read, tokenize, write shards): {written:,} tokens in {dt - dl:.2f} s = "
              f"{ours:,.0f} tokens/s with {args.workers} workers")
        print(f"tiktoken encode_ordinary_batch, {args.workers} threads:    {bare_tokens:,} tokens in "
              f"{bare_dt:.2f} s = {bare:,.0f} tokens/s")
        print(f"tiktoken encode_ordinary loop, 1 thread:       {loop_tokens:,} tokens in {loop_dt:.2f} s = "
              f"{loop_tokens / loop_dt:,.0f} tokens/s")
        print(f"ratio to encode_ordinary_batch: {ours / bare:.2f}x")
        return
    written, ndocs, dt, dl = prepare(sources, out_dir, name, args.shard_size, args.max_tokens, args.workers,
                                     args.tokenizer)
    if written:
        print(f"wrote {written:,} tokens from {ndocs:,} documents to {out_dir} in {dt:.1f} s "
              f"({dl:.1f} s downloading): {written / max(dt - dl, 1e-9):,.0f} tokens/s with "
              f"{args.workers} workers")


if __name__ == "__main__":
    main()
