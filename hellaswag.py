"""HellaSwag for the GPT-2 trainers: download, render, score, evaluate, and export llm.c's eval file.

Scoring is llm.c's / build-nanogpt's completion style (docs/FORMATS.md, HellaSwag scoring): each of the
4 candidate endings is appended to the context, the model's cross-entropy is summed over the ending tokens
only, and the prediction is the ending with the lowest total loss (acc) or lowest mean per-token loss
(acc_norm). OpenAI GPT-2 124M scores acc_norm 0.2955 on the 10,042 validation examples this way.

    python hellaswag.py download --split val            # into data/hellaswag (or $HELLASWAG_DIR)
    python hellaswag.py show --limit 3                  # the rendered token rows and masks
    python hellaswag.py export --out hellaswag_val.bin  # llm.c's eval file, for its C trainer

A trainer evaluates its own model with `hellaswag.evaluate(loss_fn)`, where loss_fn maps a (4, T) int64
token batch to the (4, T-1) per-token cross-entropy of tokens[:, 1:].
"""
import argparse
import hashlib
import json
import os
import re
import sys
import time

import numpy as np
import requests
import urllib3
from tqdm import tqdm

# -----------------------------------------------------------------------------
# Config

# The dataset's own repository (rowanz/hellaswag) publishes the jsonl files under data/, as llm.c's
# dev/data/hellaswag.py downloads them.
BASE_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data"
SPLITS = ("train", "val", "test")
DEFAULT_CACHE_DIR = os.environ.get("HELLASWAG_DIR", "data/hellaswag")
NUM_ENDINGS = 4
EVAL_MAGIC = 20240522   # llm.c's eval file (dev/data/data_common.py write_evalfile)
EVAL_VERSION = 1
START_EXAMPLE = 65535   # uint16 delimiter that opens every example in the eval file
DOWNLOAD_RETRIES = 5
DOWNLOAD_BACKOFF_S = 1.0
DOWNLOAD_TIMEOUT_S = 60
CHUNK_BYTES = 1 << 20
MIN_WIDTH = 64  # in_context pads rows to a power of two >= this: a handful of compiled shapes


def die(msg):
    """Stops with a one-line error (SystemExit prints it to stderr and exits 1, no traceback)."""
    raise SystemExit(f"error: {msg}")


# GPT-2's encoder.json and vocab.bpe, committed for the tests; tokenizer.py encodes with them exactly as
# tiktoken does, so offline with tiktoken's cache empty they serve instead
COMMITTED_GPT2_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "data", "gpt2")


class EncodingUnavailable(Exception):
    """Neither tiktoken nor the committed files give GPT-2's encoding; the message says why in one line."""


def load_gpt2_encoding(fallback=True, announce=True):
    """tiktoken's GPT-2 encoding. Where tiktoken cannot get its two files (it downloads them once, then
    reads its cache; a failed download raises a requests error, an OSError, a damaged cache file a
    ValueError), with `fallback` tokenizer.py's GPT-2 from tests/data/gpt2, sha256-checked, said in one
    line on stderr where `announce`; EncodingUnavailable where neither loads."""
    import tiktoken
    try:
        return tiktoken.get_encoding("gpt2")
    except (OSError, ValueError) as e:
        kind, reason = type(e).__name__, (str(e).splitlines() or [""])[0][:300]
        problem = (f"tiktoken could not load GPT-2's encoding ({kind}: {reason}); it downloads "
                   f"vocab.bpe and encoder.json from openaipublic.blob.core.windows.net once, then reads them "
                   f"from its cache ($TIKTOKEN_CACHE_DIR, else data-gym-cache in the temp dir)")
    if not fallback:
        raise EncodingUnavailable(problem)
    enc = committed_gpt2()
    if enc is None:
        raise EncodingUnavailable(f"{problem}; and {COMMITTED_GPT2_DIR} is missing or not the published files")
    if announce:
        print(f"tiktoken could not load GPT-2's encoding ({kind}): using tokenizer.py's GPT-2 from "
              f"{COMMITTED_GPT2_DIR} (sha256 checked), which encodes as tiktoken does", file=sys.stderr)
    return enc


def gpt2_encoding():
    """load_gpt2_encoding(), the committed files' without a line (they encode as tiktoken does), or a one-line
    error where neither loads."""
    try:
        return load_gpt2_encoding(announce=False)
    except EncodingUnavailable as e:
        die(str(e))


def committed_gpt2():
    """tokenizer.py's BPETokenizer over tests/data/gpt2 with tiktoken's names for what callers read
    (eot_token, n_vocab), or None where a file is missing or not the published one."""
    import tokenizer  # only here: most runs use tiktoken
    paths = [os.path.join(COMMITTED_GPT2_DIR, name) for name in ("encoder.json", "vocab.bpe")]
    if not all(os.path.isfile(p) and tokenizer.sha256_of(p) == tokenizer.GPT2_SHA256[os.path.basename(p)]
               for p in paths):
        return None
    enc = tokenizer.BPETokenizer.from_gpt2(*paths)
    enc.eot_token, enc.n_vocab = enc.special_tokens[tokenizer.ENDOFTEXT], enc.vocab_size
    return enc


# -----------------------------------------------------------------------------
# Download: streamed to <name>.part, resumed with an HTTP Range request after an interruption, retried
# with exponential backoff, checked against the announced size (and sha256 where the server gives one),
# renamed into place only when complete. prepro_fineweb.py and train_aiayn_jax.py download with it too.

class _Retryable(Exception):
    """A failure worth another attempt: a dropped connection, a 5xx/429 answer, a short body."""


def _announced_sha256(resp):
    """The sha256 the server vouches for: Hugging Face's `X-Linked-Etag` of an LFS file (on the redirect), or None."""
    # a plain ETag is no hash: GitHub's and CDNs' ETags are opaque cache validators
    for r in (*resp.history, resp):
        value = r.headers.get("X-Linked-Etag", "").removeprefix("W/").strip('"').lower()
        if re.fullmatch(r"[0-9a-f]{64}", value):
            return value
    return None


def sha256_of(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def download_file(url, path, retries=DOWNLOAD_RETRIES, backoff=DOWNLOAD_BACKOFF_S, expected_size=None,
                  expected_sha256=None):
    """Downloads `url` to `path` (skipped when `path` exists: only complete files ever get that name).
    expected_size / expected_sha256, when known in advance, are checked as well as what the server says."""
    if os.path.exists(path):
        return path
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        die(f"cannot create {folder} to download {url} into ({e.strerror})")
    part = path + ".part"
    total, sha = expected_size, expected_sha256
    failures = 0
    while True:
        have = os.path.getsize(part) if os.path.exists(part) else 0
        # identity: the bytes on disk must be the bytes the size, the range and the checksum refer to
        headers = {"Accept-Encoding": "identity"}
        if have:
            headers["Range"] = f"bytes={have}-"
        try:
            with requests.get(url, headers=headers, stream=True, timeout=DOWNLOAD_TIMEOUT_S) as resp:
                if resp.status_code == 416 and have:  # asked past the end: the part may hold it all
                    m = re.fullmatch(r"bytes \*/(\d+)", resp.headers.get("Content-Range", ""))
                    if m and int(m.group(1)) == have:
                        total = total or have
                        break
                    os.remove(part)
                    raise _Retryable("server refused to resume; starting over")
                if resp.status_code == 429 or resp.status_code >= 500:
                    raise _Retryable(f"HTTP {resp.status_code}")
                if resp.status_code not in (200, 206):
                    die(f"download of {url} failed: HTTP {resp.status_code}")
                if resp.headers.get("Content-Encoding", "identity") != "identity":
                    die(f"download of {url}: server sent {resp.headers['Content-Encoding']}-encoded data")
                sha = sha or _announced_sha256(resp)
                if resp.status_code == 206:  # where it starts, and the file's size: "bytes start-end/size"
                    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", resp.headers.get("Content-Range", ""))
                    start, announced = (int(m.group(1)), int(m.group(3))) if m else (None, None)
                else:  # a 200: the whole file, its size in Content-Length
                    length = resp.headers.get("Content-Length", "")
                    start, announced = 0, (int(length) if length.isdigit() else None)
                if start is None or start > have:  # a range we did not ask for: start over
                    if os.path.exists(part):
                        os.remove(part)
                    raise _Retryable(f"unexpected Content-Range {resp.headers.get('Content-Range')!r}")
                if announced is not None:
                    if total is not None and announced != total:
                        die(f"download of {url}: server announces {announced} bytes, expected {total}")
                    total = announced
                have = start  # a 200 answers a range request with the whole file
                try:  # a folder we may not write to is no failure a retry could mend
                    f = open(part, "r+b" if have else "wb")
                except OSError as e:
                    die(f"cannot write {part}: {e.strerror}")
                with f, tqdm(total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1024,
                             desc=os.path.basename(path), leave=False) as bar:
                    f.seek(have)
                    f.truncate()
                    for chunk in resp.raw.stream(CHUNK_BYTES, decode_content=False):
                        f.write(chunk)
                        bar.update(len(chunk))
            got = os.path.getsize(part)
            if total is not None and got < total:
                raise _Retryable(f"connection closed after {got} of {total} bytes")
            break
        except (_Retryable, requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
            # no connection at all (refused, no such host, no network, through a proxy or not): offline,
            # which a retry within seconds does not mend
            reason = getattr(e.args[0] if e.args else None, "reason", None)
            reason = getattr(reason, "original_error", reason)
            if isinstance(reason, urllib3.exceptions.NewConnectionError):
                die(f"download of {url} failed, no connection: {reason}")
            failures += 1
            if failures > retries:
                die(f"download of {url} failed after {retries} retries: {e}")
            print(f"download of {url}: {e}; retrying", file=sys.stderr)
            time.sleep(backoff * 2 ** (failures - 1))
    got = os.path.getsize(part)
    if total is not None and got != total:
        os.remove(part)
        die(f"download of {url} is corrupt: {got} bytes, the server announced {total} (removed; run again)")
    if sha is not None:
        digest = sha256_of(part)
        if digest != sha:
            os.remove(part)
            die(f"download of {url} is corrupt: sha256 {digest}, expected {sha} (removed; run again)")
    os.replace(part, path)
    return path


def download(split="val", cache_dir=None, base_url=BASE_URL):
    """Path of hellaswag_<split>.jsonl in the cache dir, downloaded first if it is not there yet."""
    if split not in SPLITS:
        die(f"unknown HellaSwag split {split!r} (choose from {', '.join(SPLITS)})")
    name = f"hellaswag_{split}.jsonl"
    path = os.path.join(cache_dir or DEFAULT_CACHE_DIR, name)
    if not os.path.exists(path):
        print(f"downloading {base_url}/{name} to {path}")
    return download_file(f"{base_url}/{name}", path)


# -----------------------------------------------------------------------------
# Examples and rendering

def iterate_examples(split="val", cache_dir=None):
    """The jsonl rows of a split, in file order, each checked for the fields rendering needs."""
    path = download(split, cache_dir)
    try:
        f = open(path, "rb")
    except OSError as e:  # a folder of that name, say
        die(f"cannot read {path}: {e.strerror}")
    with f:
        for lineno, raw in enumerate(f, 1):
            try:  # line by line: the error names the line, and a damaged file is no traceback
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                die(f"{path}:{lineno}: not UTF-8 text (byte {e.start}); a corrupt file? delete it and "
                    f"download again")
            if not line.strip():
                continue
            try:
                example = json.loads(line)
            except json.JSONDecodeError:
                die(f"{path}:{lineno}: not valid JSON (a truncated or corrupt file? delete it and "
                    f"download again)")
            problem = _example_problem(example)
            if problem:
                die(f"{path}:{lineno}: {problem}")
            yield example


def _example_problem(example):
    """What is wrong with one jsonl row, or None. The test split carries no label."""
    if not isinstance(example, dict):
        return "a row is not a JSON object"
    if not isinstance(example.get("ctx"), str):
        return "missing 'ctx' text"
    endings = example.get("endings")
    if not (isinstance(endings, list) and len(endings) == NUM_ENDINGS
            and all(isinstance(e, str) for e in endings)):
        return f"'endings' must be a list of {NUM_ENDINGS} strings"
    label = example.get("label")
    if label is not None and not (isinstance(label, int) and 0 <= label < NUM_ENDINGS):
        return f"'label' must be an integer in 0..{NUM_ENDINGS - 1}"
    return None


def default_encode():
    """tiktoken's GPT-2 encoder. encode_ordinary equals llm.c's enc.encode on HellaSwag's text (it holds
    no special-token strings) and cannot raise on one."""
    return gpt2_encoding().encode_ordinary


def encode_example(example, encode):
    """(context tokens, [4 ending token lists], label); label -1 where the split has none. Endings get a
    leading space because GPT-2's BPE attaches the space to the word that follows it."""
    ctx_tokens = list(encode(example["ctx"]))
    ending_tokens = [list(encode(" " + ending)) for ending in example["endings"]]
    return ctx_tokens, ending_tokens, example.get("label", -1)


def render_example(example, encode):
    """Row i = context tokens + ending i tokens, zero-padded to the longest row; mask is 1 on the
    ending tokens only. Returns (tokens (4,T) int64, mask (4,T) int64, label int)."""
    ctx_tokens, ending_tokens, label = encode_example(example, encode)
    T = len(ctx_tokens) + max(len(e) for e in ending_tokens)
    tokens = np.zeros((NUM_ENDINGS, T), dtype=np.int64)  # (4, T)
    mask = np.zeros((NUM_ENDINGS, T), dtype=np.int64)    # (4, T)
    for i, end in enumerate(ending_tokens):
        row = ctx_tokens + end
        tokens[i, :len(row)] = row
        mask[i, len(ctx_tokens):len(row)] = 1
    return tokens, mask, label


# -----------------------------------------------------------------------------
# Scoring and evaluation

def score(losses, mask):
    """(pred, pred_norm) from per-token losses (4, T-1), where losses[:, t] is the loss of tokens[:, t+1].
    A loss at column t counts when token t+1 is an ending token, hence the mask shifted by one. Extra
    columns (a trainer that padded T to a fixed length) are ignored, as is anything at masked positions."""
    mask = np.asarray(mask)
    losses = np.asarray(losses, dtype=np.float64)[:, :mask.shape[1] - 1]  # (4, T-1)
    shift_mask = mask[:, 1:] != 0                                           # (4, T-1)
    total = np.where(shift_mask, losses, 0.0).sum(axis=1)                   # (4,)
    mean = total / np.maximum(shift_mask.sum(axis=1), 1)                    # (4,)
    return int(np.argmin(total)), int(np.argmin(mean))


def _labelled_examples(split, limit, cache_dir):
    examples = []
    for example in iterate_examples(split, cache_dir):
        if "label" not in example:
            die(f"HellaSwag {split} split has no labels, so it cannot be scored or exported")
        examples.append(example)
        if limit and len(examples) == limit:
            break
    return examples


def terminal_progress(iterable, total, desc):
    """A tqdm bar on stderr, drawn only when stderr is a terminal: someone watching sees progress, while a
    log that captures stderr stays free of bar redraws."""
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True,
                disable=not sys.stderr.isatty())


def in_context(padded_losses, block_size):
    """evaluate's loss_fn for a model of context block_size, from padded_losses(x, y) -> (4, width)
    per-token losses of rows of inputs and targets x, y (4, width) int64, zero-padded to a power of two
    width (MIN_WIDTH to block_size: few shapes for a compiled model). A row longer than the context keeps
    its last block_size tokens (the cropped-off context positions' losses are reported as 0; they are never
    ending tokens unless an ending alone is longer than the context)."""
    def loss_fn(tokens):                                                           # (4, n+1) int64
        x, y = tokens[:, :-1], tokens[:, 1:]                                       # (4, n) each
        n = x.shape[1]
        crop = max(0, n - block_size)
        width = min(block_size, max(MIN_WIDTH, 1 << (n - crop - 1).bit_length()))
        xp = np.zeros((x.shape[0], width), np.int64)                              # (4, width)
        yp = np.zeros((x.shape[0], width), np.int64)                              # (4, width)
        xp[:, :n - crop], yp[:, :n - crop] = x[:, crop:], y[:, crop:]
        out = np.zeros((x.shape[0], n), np.float32)                               # (4, n)
        out[:, crop:] = np.asarray(padded_losses(xp, yp))[:, :n - crop]
        return out
    return loss_fn


def evaluate(loss_fn, split="val", limit=0, cache_dir=None, encode=None, progress=True):
    """Scores a model on a split: loss_fn(tokens (4,T) int64) -> (4,T-1) per-token losses. limit 0 = every
    example. With progress, prints it about every tenth of the way (and a bar on a terminal's stderr):
    of several processes that all score, one shows it. Returns (acc, acc_norm)."""
    encode = encode or default_encode()
    examples = _labelled_examples(split, limit, cache_dir)
    if not examples:
        die(f"HellaSwag {split} split has no examples")
    every = max(1, len(examples) // 10)
    correct = correct_norm = 0
    bar = terminal_progress(examples, len(examples), f"hellaswag {split}") if progress else examples
    for n, example in enumerate(bar, 1):
        tokens, mask, label = render_example(example, encode)
        losses = np.asarray(loss_fn(tokens))  # (4, T-1)
        if losses.ndim != 2 or losses.shape[0] != NUM_ENDINGS or losses.shape[1] < tokens.shape[1] - 1:
            die(f"hellaswag loss_fn returned shape {losses.shape}, expected (4, {tokens.shape[1] - 1})")
        pred, pred_norm = score(losses, mask)
        correct += pred == label
        correct_norm += pred_norm == label
        if progress and (n % every == 0 or n == len(examples)):
            print(f"hellaswag {n}/{len(examples)}: acc {correct / n:.4f} acc_norm {correct_norm / n:.4f}")
    return correct / len(examples), correct_norm / len(examples)


# -----------------------------------------------------------------------------
# llm.c's eval file: a header of 256 int32 ([0] magic, [1] version, [2] examples, [3] longest example in
# bytes), then per example a uint16 stream: 65535, the example's byte length, its index, its label, the
# number of completions, the context length and tokens, then each completion's length and tokens.

def write_eval_file(path, encoded):
    """Writes [(ctx_tokens, ending_tokens, label), ...] as llm.c's eval file (temporary name, then rename);
    a failed write is one line, leaving no temporary and an earlier file as it was."""
    if len(encoded) >= 1 << 16:
        die(f"{len(encoded)} examples do not fit the eval file's uint16 example index")
    stream, longest = [], 0
    for index, (ctx_tokens, ending_tokens, label) in enumerate(encoded):
        example = [START_EXAMPLE, 0, index, label, len(ending_tokens), len(ctx_tokens), *ctx_tokens]
        for end in ending_tokens:
            example += [len(end), *end]
        if max(example[2:]) >= START_EXAMPLE:
            die(f"example {index}: a token id or length does not fit below the uint16 delimiter")
        nbytes = 2 * len(example)
        if nbytes >= 1 << 16:
            die(f"example {index} takes {nbytes} bytes, more than the eval file's uint16 length field")
        example[1] = nbytes
        longest = max(longest, nbytes)
        stream += example
    header = np.zeros(256, dtype="<i4")
    header[:4] = [EVAL_MAGIC, EVAL_VERSION, len(encoded), longest]
    folder, tmp = os.path.dirname(path), temp_name(path)
    try:
        if folder and not os.path.exists(folder):  # one that is a file: "Not a directory" below
            os.makedirs(folder)
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(np.array(stream, dtype="<u2").tobytes())
        os.replace(tmp, path)
    except OSError as e:
        die(f"cannot write {path}: {e.strerror}")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def temp_name(path, suffix="tmp"):
    """A temporary name beside `path`, to be renamed to it: short enough whatever the length of path's name."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f"{name[:200]}.{os.getpid()}.{suffix}")


# -----------------------------------------------------------------------------
# Command line

class OneLineErrorParser(argparse.ArgumentParser):
    """A parser whose errors are one line, as in the trainers (its subcommands' parsers are of this class)."""

    def error(self, message):
        die(message)


def check_out(path, force):
    """Stops before any work on an --out that names no file, is a folder, or exists (unless force)."""
    if not os.path.basename(path) or os.path.isdir(path):
        die(f"--out {path!r}: give a file's name, not a folder's")
    if os.path.lexists(path) and not force:
        die(f"--out {path} exists: pass --force to replace it")


def parse_args(argv=None):
    parser = OneLineErrorParser(description="HellaSwag: download, show rendered examples, export "
                                            "llm.c's eval file")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("download", "fetch hellaswag_<split>.jsonl into the cache dir"),
                           ("show", "print rendered examples (tokens and masks)"),
                           ("export", "write llm.c's eval file (.bin)")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--split", choices=SPLITS, default="val",
                       help="which split: train, val or test; test has no labels, so export refuses it "
                            "(default: %(default)s)")
        p.add_argument("--cache-dir", default=None,
                       help="folder the jsonl files are downloaded to and read from (default: "
                            "$HELLASWAG_DIR, else data/hellaswag)")
        p.add_argument("--base-url", default=BASE_URL,
                       help="where hellaswag_<split>.jsonl is downloaded from: a mirror, or a test server "
                            "(default: the dataset's own repository, %(default)s)")
        if name == "show":
            p.add_argument("--limit", type=int, default=3,
                           help="number of examples to print, from the first (default: %(default)s)")
        if name == "export":
            p.add_argument("--out", required=True,
                           help="eval file to write, e.g. hellaswag_val.bin (required)")
            p.add_argument("--force", action="store_true", help="replace an existing --out (default: refuse)")
            p.add_argument("--limit", type=int, default=0,
                           help="export the first N examples only (default: 0 = all)")
    args = parser.parse_args(argv)
    if getattr(args, "limit", 0) < 0:
        parser.error("--limit must be >= 0")
    if args.command == "export" and args.split == "test":
        parser.error("HellaSwag test split has no labels, so it cannot be exported")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.command == "export":
        check_out(args.out, args.force)
    path = download(args.split, args.cache_dir, args.base_url)
    if args.command == "download":
        print(f"{path}: {os.path.getsize(path):,} bytes")
        return
    encode = default_encode()
    if args.command == "show":
        decode = gpt2_encoding().decode
        for n, example in enumerate(iterate_examples(args.split, args.cache_dir)):
            if n == args.limit:
                break
            tokens, mask, label = render_example(example, encode)
            ctx_len = len(encode_example(example, encode)[0])
            print(f"example {n} (ind {example.get('ind')}, label {label}): tokens {tokens.shape}")
            for i in range(NUM_ENDINGS):
                ending = tokens[i][mask[i] == 1]
                print(f"  [{i}] {ctx_len} context + {len(ending)} ending tokens: "
                      f"{decode(tokens[i, :ctx_len].tolist())!r} |{decode(ending.tolist())!r}")
                print(f"      tokens {tokens[i].tolist()}")
                print(f"      mask   {mask[i].tolist()}")
        return
    if os.path.exists(args.out) and os.path.samefile(args.out, path):
        die(f"--out {args.out} is the split file export reads: pick another")
    examples = _labelled_examples(args.split, args.limit, args.cache_dir)
    if not examples:
        die(f"{path} holds no examples, nothing to export; a truncated download? delete it and run again")
    write_eval_file(args.out, [encode_example(e, encode) for e in examples])
    print(f"wrote {len(examples):,} examples to {args.out} ({os.path.getsize(args.out):,} bytes)")


if __name__ == "__main__":
    main()
