r"""tokenizer.py: byte-level BPE, GPT-2-exact.

A byte-pair-encoding tokenizer written from scratch: text is split into pre-tokens with GPT-2's regex, each
pre-token's UTF-8 bytes start as base tokens, and adjacent tokens are merged, lowest rank first, until no
pair of neighbours is itself a token. Loaded from GPT-2's encoder.json + vocab.bpe it gives exactly the
tokens of tiktoken.get_encoding("gpt2"); trained here it learns its own merges.

    python tokenizer.py train --input data.txt --vocab-size 8192 --out my.bpe
    python tokenizer.py encode --tokenizer gpt2 --input data.txt --out data.bin     # llm.c token shard
    python tokenizer.py decode --tokenizer my.bpe --input data.bin --out data.txt
    python tokenizer.py bench                                    # MB/s vs tiktoken, time to train 8,192

Python: tok = BPETokenizer.train(text or [paths], vocab_size), BPETokenizer.from_gpt2(), tok.encode(text),
tok.decode(ids), tok.save(path), BPETokenizer.load(path).

Ranks: a token's id is its rank. Encoding merges, at every step, the leftmost adjacent pair whose
concatenated bytes form the lowest-id token (tiktoken's rule); for GPT-2's files this is the order of
vocab.bpe. A trained vocabulary has ids 0..255 = the bytes, then the merges in the order they were learned,
then the special tokens last (vocab_size counts them). Encoding caches the ids of each pre-token (and of
each word, for text beyond ASCII), so that only new ones are merged; training keeps pair counts up to date
merge by merge instead of recounting.

Saved file (plain text): the header line, "tokens N", "specials K", then one line per id: `262 " the"` (the
token's bytes quoted: printable UTF-8 as is, \xNN for other bytes, \\ and \" escaped), and last
`50256 special "<|endoftext|>"` for each special token.
"""
import argparse
import collections
import gzip
import hashlib
import heapq
import json
import os
import re
import sys
import time
from itertools import repeat

import numpy as np
import regex
import requests

# -----------------------------------------------------------------------------
# Constants

# GPT-2's pre-tokenizer: contractions, letter runs, digit runs, punctuation runs (each optionally after one
# space), then whitespace; `\s+(?!\S)` leaves a run's last space to start the next word.
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENDOFTEXT = "<|endoftext|>"

GPT2_BASE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main"
GPT2_SHA256 = {  # the published files (the hashes tiktoken checks, too)
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}

FILE_HEADER = "tokenizer.py byte-level BPE v1"
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256

CACHE_LIMIT = 1 << 18     # words and pre-tokens remembered (~50 MB); past this the cache starts over
CACHED_CHARS = 64         # words and pre-tokens up to this long are cached (longer ones rarely recur)
CHUNK_CHARS = 1 << 22     # text is pre-tokenized this many characters at a time, cut at safe points
LONG_PIECE = 24           # pre-tokens longer than this (in bytes) are merged with a heap, O(n log n)
NO_MERGE = 1 << 62        # the rank of a pair that is not a token

# Where the pre-tokenizer cannot make a piece that crosses the cut: between a letter and " letter" (the
# letter run ends, " letter" starts a word), or after "\n" between two non-spaces (that "\n" is a piece on
# its own whatever follows). SAFE_CUT_LAST searches right to left: its match is the last such place.
SAFE_CUT = regex.compile(r"(?<=\p{L})(?= \p{L})|(?<=\S\n)(?=\S)")
SAFE_CUT_LAST = regex.compile(r"(?r)" + SAFE_CUT.pattern)
WHITESPACE = regex.compile(r"\s")

# The units encode_ordinary looks up in its cache. An ASCII text is cut straight into its pre-tokens by the
# standard library's re, twice as fast as the regex module: on ASCII, \p{L} is [A-Za-z], \p{N} is [0-9] and
# \s (with re.ASCII) is the same six characters. Other text is cut into words: a whitespace run and the
# non-space run after it. No pre-token holds a non-space followed by whitespace, so none crosses a cut.
PRETOKENS_ASCII = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""",
                             re.ASCII)
WORDS = regex.compile(r"\s*\S+|\s+")


def write_file(path, data):
    """Writes bytes under a temporary name beside path, then renames: path is never left half-written, and a
    failure (an OSError naming path) leaves no temporary."""
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def temp_name(path, suffix="tmp"):
    """A temporary name beside `path`, to be renamed to it: short enough whatever the length of path's name."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f"{name[:200]}.{os.getpid()}.{suffix}")


# -----------------------------------------------------------------------------
# Byte-pair merging of one pre-token (the encoder's inner loop; results are cached per pre-token)

def merge_short(ids, merges):
    """Merges ids (a list of token ids, changed in place) until no neighbours form a token: each step
    takes the leftmost lowest-ranked pair (a C-speed min over the pair ranks) and re-ranks only the two
    pairs next to it. O(n^2), fastest for the short pieces that dominate text."""
    get = merges.get
    ranks = list(map(get, zip(ids, ids[1:]), repeat(NO_MERGE)))  # ranks[i]: rank of (ids[i], ids[i+1])
    while ranks:
        best = min(ranks)
        if best == NO_MERGE:
            break
        i = ranks.index(best)
        ids[i] = best
        del ids[i + 1], ranks[i]
        if i > 0:
            ranks[i - 1] = get((ids[i - 1], best), NO_MERGE)
        if i < len(ranks):
            ranks[i] = get((best, ids[i + 1]), NO_MERGE)
    return ids


def merge_long(ids, merges):
    """The same merges as merge_short for long pieces, in O(n log n): a heap of (rank, position) over a
    linked list of the surviving tokens. Ties go to the smaller position, i.e. the leftmost pair, and an
    entry is stale when its pair no longer has that rank (a token's bytes, hence its rank, pin the span)."""
    n = len(ids)
    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    alive = [True] * n
    get = merges.get
    heap = [(r, i) for i in range(n - 1) if (r := get((ids[i], ids[i + 1]))) is not None]
    heapq.heapify(heap)
    while heap:
        rank, i = heapq.heappop(heap)
        j = nxt[i]
        if not alive[i] or j >= n or get((ids[i], ids[j])) != rank:
            continue
        ids[i] = rank
        alive[j] = False
        nxt[i] = k = nxt[j]
        if k < n:
            prv[k] = i
            r = get((rank, ids[k]))
            if r is not None:
                heapq.heappush(heap, (r, i))
        p = prv[i]
        if p >= 0:
            r = get((ids[p], rank))
            if r is not None:
                heapq.heappush(heap, (r, p))
    return [t for t, keep in zip(ids, alive) if keep]


def merge_table(tokens):
    """{(left id, right id): id} for every way of cutting every token in two tokens, so that a pair merges
    whenever its concatenation is a token, at that token's rank, however the two halves were made (the
    rule tiktoken applies; GPT-2's vocab.bpe lists one cut per token). Also checks the vocabulary."""
    index = {}
    for i, b in enumerate(tokens):
        if not isinstance(b, bytes) or not b:
            raise ValueError(f"token {i} is not a non-empty byte string")
        if b in index:
            raise ValueError(f"tokens {index[b]} and {i} are the same bytes {quote_bytes(b)}")
        index[b] = i
    missing = [x for x in range(256) if bytes([x]) not in index]
    if missing:
        raise ValueError(f"{len(missing)} of the 256 single bytes have no token (byte {missing[0]} first)")
    merges = {}
    for t, b in enumerate(tokens):
        made = len(b) == 1
        for k in range(1, len(b)):
            left, right = index.get(b[:k]), index.get(b[k:])
            if left is not None and right is not None:
                merges[left, right] = t
                made = True
        if not made:
            raise ValueError(f"token {t} {quote_bytes(b)} is not the merge of two other tokens")
    return index, merges


# -----------------------------------------------------------------------------
# Pre-tokenization of large texts in chunks

def cut_chunks(text, chunk_chars=CHUNK_CHARS):
    """Yields text in pieces of at most chunk_chars where a safe place allows (else up to the first one
    after), cut only at SAFE_CUT places, so pre-tokenizing the pieces one by one gives exactly the
    pre-tokens of the whole text."""
    start = 0
    while len(text) - start > chunk_chars:
        m = (SAFE_CUT_LAST.search(text, start + 1, start + chunk_chars)
             or SAFE_CUT.search(text, start + chunk_chars))
        end = m.start() if m else len(text)
        yield text[start:end]
        start = end
    if start < len(text):
        yield text[start:]


def read_chunks(path, chunk_chars=CHUNK_CHARS):
    """A UTF-8 text file (gzip when it ends in .gz) as an iterator of safely cut chunks, without reading
    it whole. A missing or empty file fails here, before anything else is done."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")
    if os.path.getsize(path) == 0:
        raise ValueError(f"file is empty: {path}")
    return file_chunks(path, chunk_chars)


def file_chunks(path, chunk_chars):
    opener = gzip.open if str(path).endswith(".gz") else open
    empty = True
    try:
        with opener(path, "rt", encoding="utf-8", newline="") as f:
            carry = ""
            while True:
                block = f.read(chunk_chars)
                if not block:
                    break
                empty = False
                pieces = list(cut_chunks(carry + block, chunk_chars))
                carry = pieces.pop()  # the tail may continue in the next block
                yield from pieces
            if carry:
                yield carry
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason})") from None
    except (OSError, EOFError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if empty:
        raise ValueError(f"file is empty: {path}")


def source_chunks(text_or_files, chunk_chars=CHUNK_CHARS):
    """The training input as chunks: a str is the text itself, anything else a list of file paths."""
    if isinstance(text_or_files, str):
        if not text_or_files:
            raise ValueError("the training text is empty")
        yield from cut_chunks(text_or_files, chunk_chars)
        return
    paths = [text_or_files] if isinstance(text_or_files, os.PathLike) else list(text_or_files)
    if not paths:
        raise ValueError("no training files given")
    for path in paths:
        yield from read_chunks(path, chunk_chars)


def check_special_tokens(names):
    """Special tokens are distinct non-empty strings without whitespace (so no chunk cut splits one)."""
    for s in names:
        if not isinstance(s, str) or not s or WHITESPACE.search(s):
            raise ValueError(f"special token {s!r} must be a non-empty string without whitespace")
    if len(set(names)) != len(names):
        raise ValueError(f"special tokens repeat: {list(names)}")


def special_splitter(names):
    """A regex matching any of the special tokens, longest first (so one that contains another wins)."""
    return regex.compile("|".join(regex.escape(s) for s in sorted(names, key=len, reverse=True)))


def utf8_safe(text):
    """text with lone surrogates (which UTF-8 cannot encode) replaced by U+FFFD and surrogate pairs
    joined into the character they stand for, as tiktoken does before encoding."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def count_pretokens(chunks, special_tokens):
    """{pre-token bytes: count} over all chunks. Special tokens in the text separate documents and are
    not learned from."""
    findall = regex.compile(GPT2_SPLIT_PATTERN).findall
    split = special_splitter(special_tokens).split if special_tokens else None
    counts = collections.Counter()
    for chunk in chunks:
        for part in (split(chunk) if split else (chunk,)):
            counts.update(findall(utf8_safe(part)))
    return {piece.encode("utf-8"): c for piece, c in counts.items()}


# -----------------------------------------------------------------------------
# Training: merges learned with incremental pair counts

def learn_merges(word_counts, n_tokens):
    """The vocabulary (list of bytes, id = rank) of n_tokens tokens learned from {pre-token bytes: count}:
    ids 0..255 are the bytes, then each merge of the most frequent adjacent pair (ties: the smallest
    (left id, right id)). Pair counts are kept up to date by each merge: only the words holding the pair
    are visited and only the pairs next to each merged occurrence change. A max-heap of (-count, pair)
    is corrected lazily: counts only fall after a pair is pushed, except for pairs containing the new
    token, which are pushed again, so an entry that still matches its pair's count is the true maximum.
    A merge whose bytes already exist as a token (the same string cut another way) reuses that token."""
    tokens = [bytes([b]) for b in range(256)]
    index = {b: i for i, b in enumerate(tokens)}
    words = [list(w) for w in word_counts]             # each pre-token as a list of token ids
    freqs = list(word_counts.values())
    counts = collections.defaultdict(int)              # pair -> count over all words
    where = collections.defaultdict(set)               # pair -> indices of the words that (once) had it
    for wi, (w, f) in enumerate(zip(words, freqs)):
        for pair in zip(w, w[1:]):
            counts[pair] += f
            where[pair].add(wi)
    heap = [(-c, pair) for pair, c in counts.items()]
    heapq.heapify(heap)
    while len(tokens) < n_tokens and heap:
        negc, pair = heapq.heappop(heap)
        c = counts.get(pair, 0)
        if c <= 0:
            continue
        if c != -negc:
            heapq.heappush(heap, (-c, pair))
            continue
        a, b = pair
        merged = tokens[a] + tokens[b]
        new = index.get(merged)
        if new is None:
            new = index[merged] = len(tokens)
            tokens.append(merged)
        grown = set()
        for wi in where.pop(pair):
            w, f, i = words[wi], freqs[wi], 0
            try:
                while True:  # each occurrence of a, left to right (list.index runs at C speed)
                    i = w.index(a, i)
                    if i + 1 < len(w) and w[i + 1] == b:
                        if i:
                            prev = w[i - 1]  # the new token itself when the pair repeats (a b a b)
                            counts[prev, a] -= f
                            counts[prev, new] += f
                            grown.add((prev, new))
                            where[prev, new].add(wi)
                        if i + 2 < len(w):
                            following = w[i + 2]
                            counts[b, following] -= f
                            counts[new, following] += f
                            grown.add((new, following))
                            where[new, following].add(wi)
                        w[i] = new
                        del w[i + 1]
                    i += 1
            except ValueError:  # no more a in this word
                pass
        del counts[pair]
        for q in grown:
            if counts[q] > 0:
                heapq.heappush(heap, (-counts[q], q))
    return tokens


# -----------------------------------------------------------------------------
# GPT-2's files: encoder.json + vocab.bpe (local, or downloaded once and cached)

def gpt2_byte_order():
    """GPT-2's base tokens 0..255 as byte values, and the printable character standing for each byte in
    its files: printable Latin-1 bytes stand for themselves, the others for chr(256 + n) in byte order."""
    printable = [b for b in range(256) if chr(b).isprintable() and b != ord(" ")]
    order = printable + [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable}
    chars.update((b, chr(256 + n)) for n, b in enumerate(order[len(printable):]))
    return order, {c: b for b, c in chars.items()}


def default_gpt2_dir():
    return os.environ.get("GPT2_BPE_DIR", os.path.join("data", "gpt2"))


def sha256_of(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fetch_gpt2_file(name, cache_dir=None, base_url=GPT2_BASE_URL):
    """Path of GPT-2's `name` in cache_dir, downloaded (sha256-checked) unless an intact copy is there."""
    cache_dir = cache_dir or default_gpt2_dir()
    path = os.path.join(cache_dir, name)
    if os.path.isfile(path) and sha256_of(path) == GPT2_SHA256[name]:
        return path
    url = f"{base_url.rstrip('/')}/{name}"
    try:
        r = requests.get(url, timeout=(10, 60))
        r.raise_for_status()
        data = r.content
    except requests.RequestException as e:
        raise OSError(f"download of {url} failed ({' '.join(str(e).split())}); run again to retry") from None
    got = hashlib.sha256(data).hexdigest()
    if got != GPT2_SHA256[name]:
        raise OSError(f"download of {url} is corrupt ({len(data)} bytes, sha256 {got[:12]}... is not the "
                      f"published {GPT2_SHA256[name][:12]}...); run again to retry")
    os.makedirs(cache_dir, exist_ok=True)
    write_file(path, data)
    return path


def read_gpt2_files(encoder_json, vocab_bpe):
    """(tokens, special tokens) from GPT-2's files: vocab.bpe defines the tokens (256 bytes, then one per
    merge line) and encoder.json must give each the same id; its extra entries are the special tokens."""
    order, char_to_byte = gpt2_byte_order()
    alphabet = set(char_to_byte)
    to_latin1 = str.maketrans({c: chr(b) for c, b in char_to_byte.items()})  # then .encode("latin-1")
    try:
        with open(vocab_bpe, encoding="utf-8") as f:
            lines = f.read().split("\n")
        with open(encoder_json, encoding="utf-8") as f:
            encoder = json.load(f)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"no such file: {e.filename}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{encoder_json} or {vocab_bpe} is not a GPT-2 vocabulary file ({e})") from None
    if not lines[0].startswith("#version"):
        raise ValueError(f"{vocab_bpe}: first line is not '#version: ...' (not a GPT-2 vocab.bpe)")
    while lines[-1] == "":
        lines.pop()
    tokens = [bytes([b]) for b in order]
    for n, line in enumerate(lines[1:], start=2):
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts) or not alphabet.issuperset(parts[0] + parts[1]):
            raise ValueError(f"{vocab_bpe} line {n}: expected two tokens of GPT-2's byte alphabet, one space "
                             f"apart, got {line[:40]!r}")
        tokens.append((parts[0] + parts[1]).translate(to_latin1).encode("latin-1"))
    if not isinstance(encoder, dict):
        raise ValueError(f"{encoder_json}: expected a JSON object of token -> integer id")
    specials = {}
    for s, i in encoder.items():
        if not isinstance(i, int) or i < 0:
            raise ValueError(f"{encoder_json}: the id of {s!r} is {i!r}, not a non-negative integer")
        if i >= len(tokens):
            specials[s] = i
        elif not alphabet.issuperset(s) or s.translate(to_latin1).encode("latin-1") != tokens[i]:
            raise ValueError(f"{encoder_json}: id {i} is {s!r} but vocab.bpe makes {quote_bytes(tokens[i])}")
    if len(encoder) - len(specials) != len(tokens):
        raise ValueError(f"{encoder_json} has {len(encoder) - len(specials)} ordinary tokens, vocab.bpe "
                         f"makes {len(tokens)}")
    return tokens, specials


# -----------------------------------------------------------------------------
# The saved file: plain text, one token per line

def quote_bytes(b):
    """A token's bytes as a double-quoted string a person can read: printable UTF-8 as itself, `\\` and
    `"` backslashed, everything else (control characters, invalid UTF-8) as \\xNN per byte."""
    out = []
    for ch in b.decode("utf-8", "surrogateescape"):
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:  # a byte that is not valid UTF-8 here
            out.append(f"\\x{o - 0xDC00:02x}")
        elif ch in '\\"':
            out.append("\\" + ch)
        elif ch == " " or ch.isprintable():
            out.append(ch)
        else:
            out.extend(f"\\x{x:02x}" for x in ch.encode("utf-8"))
    return '"' + "".join(out) + '"'


QUOTED_PART = regex.compile(r'\\x([0-9a-f]{2})|\\(["\\])|([^\\"]+)')


def unquote_bytes(s):
    """Inverse of quote_bytes; ValueError on anything it could not have written."""
    if len(s) < 2 or s[0] != '"' or s[-1] != '"':
        raise ValueError(f"expected a double-quoted token, got {s!r}")
    body, out, pos = s[1:-1], [], 0
    for m in QUOTED_PART.finditer(body):
        if m.start() != pos:
            break
        hexa, escaped, plain = m.groups()
        out.append(bytes([int(hexa, 16)]) if hexa else (escaped or plain).encode("utf-8"))
        pos = m.end()
    if pos != len(body):
        raise ValueError(f"bad escape or stray quote in {s!r}")
    return b"".join(out)


def write_tokenizer_file(path, tokens, special_tokens):
    lines = [FILE_HEADER, f"tokens {len(tokens)}", f"specials {len(special_tokens)}"]
    lines += [f"{i} {quote_bytes(b)}" for i, b in enumerate(tokens)]
    lines += [f"{i} special {quote_bytes(s.encode())}" for s, i in sorted(special_tokens.items(),
                                                                          key=lambda kv: kv[1])]
    write_file(path, ("\n".join(lines) + "\n").encode("utf-8"))


def read_tokenizer_file(path):
    """(tokens, special tokens) from a file written by write_tokenizer_file; ValueError naming the line
    for anything else."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        raise FileNotFoundError(f"no such file: {path}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a tokenizer file (not UTF-8 text)") from None
    if lines[-1] == "":
        lines.pop()
    if not lines or lines[0] != FILE_HEADER:
        raise ValueError(f"{path} is not a tokenizer file (first line is not {FILE_HEADER!r})")
    tokens, specials, n_tokens, n_specials = [], {}, None, None
    for n, line in enumerate(lines[1:], start=2):
        try:
            if n == 2 or n == 3:
                key, _, value = line.partition(" ")
                if key != ("tokens" if n == 2 else "specials"):
                    raise ValueError(f"expected '{'tokens N' if n == 2 else 'specials K'}'")
                n_tokens, n_specials = (int(value), n_specials) if n == 2 else (n_tokens, int(value))
                continue
            head, _, rest = line.partition(" ")
            if head != str(len(tokens) + len(specials)):
                raise ValueError(f"expected id {len(tokens) + len(specials)}, found {head!r}")
            if len(tokens) < n_tokens:
                tokens.append(unquote_bytes(rest))
            elif rest.startswith("special "):
                specials[unquote_bytes(rest[len("special "):]).decode("utf-8")] = int(head)
            else:
                raise ValueError("expected '<id> special \"<name>\"' after the ordinary tokens")
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} line {n} is malformed: {e}") from None
    if n_specials is None or len(tokens) != n_tokens or len(specials) != n_specials:
        raise ValueError(f"{path} is truncated: the header promises {n_tokens} tokens and {n_specials} "
                         f"specials, found {len(tokens)} and {len(specials)}")
    return tokens, specials


# -----------------------------------------------------------------------------
# The tokenizer

class BPETokenizer:
    """A byte-level BPE vocabulary (tokens: list of bytes, id = rank; special tokens after them) and the
    encoder/decoder over it. Build one with train, from_gpt2 or load."""

    def __init__(self, tokens, special_tokens=None):
        special_tokens = dict(special_tokens or {})
        self.index, self.merges = merge_table(tokens)
        self.tokens = list(tokens)
        check_special_tokens(list(special_tokens))
        if sorted(special_tokens.values()) != list(range(len(tokens), len(tokens) + len(special_tokens))):
            raise ValueError(f"special token ids must be {len(tokens)}.. (right after the ordinary tokens)")
        self.special_tokens = special_tokens
        self.vocab_size = len(tokens) + len(special_tokens)
        self.byte_ids = [self.index[bytes([b])] for b in range(256)]
        specials_by_id = sorted(special_tokens, key=special_tokens.get)
        self.id_bytes = self.tokens + [s.encode("utf-8") for s in specials_by_id]  # decode's id -> bytes
        self.pattern = regex.compile(GPT2_SPLIT_PATTERN)
        self.cache = {}  # pre-token or word -> its token ids: text repeats its words, so most lookups hit

    # --- construction ---

    @classmethod
    def train(cls, text_or_files, vocab_size, special_tokens=(ENDOFTEXT,)):
        """Learns vocab_size - 256 - len(special_tokens) merges from a str or a list of text files (.gz
        read as gzip). ValueError when the text is too small to reach vocab_size."""
        special_tokens = list(special_tokens)
        check_special_tokens(special_tokens)
        if vocab_size < 256 + len(special_tokens):
            raise ValueError(f"vocab_size {vocab_size} is below 256 byte tokens + {len(special_tokens)} "
                             f"special tokens = {256 + len(special_tokens)}")
        n_tokens = vocab_size - len(special_tokens)
        tokens = learn_merges(count_pretokens(source_chunks(text_or_files), special_tokens), n_tokens)
        if len(tokens) < n_tokens:
            raise ValueError(f"the training text only allows {len(tokens) - 256} merges, vocab_size "
                             f"{vocab_size} needs {n_tokens - 256}")
        return cls(tokens, {s: n_tokens + k for k, s in enumerate(special_tokens)})

    @classmethod
    def from_gpt2(cls, encoder_json=None, vocab_bpe=None, cache_dir=None, base_url=GPT2_BASE_URL):
        """GPT-2's tokenizer from its encoder.json and vocab.bpe; a file given as None is downloaded from
        OpenAI's public copy into cache_dir (default: $GPT2_BPE_DIR or data/gpt2) once, checked by sha256."""
        encoder_json = encoder_json or fetch_gpt2_file("encoder.json", cache_dir, base_url)
        vocab_bpe = vocab_bpe or fetch_gpt2_file("vocab.bpe", cache_dir, base_url)
        return cls(*read_gpt2_files(encoder_json, vocab_bpe))

    @classmethod
    def load(cls, path):
        return cls(*read_tokenizer_file(path))

    def save(self, path):
        write_tokenizer_file(path, self.tokens, self.special_tokens)

    # --- encoding ---

    def encode_piece(self, piece):
        """Token ids of one pre-token. A pre-token that is itself a token is that token, merge order aside:
        tiktoken looks it up whole before merging, and so must we to match it."""
        b = piece.encode("utf-8")
        whole = self.index.get(b)
        if whole is not None:
            return (whole,)
        if len(b) <= LONG_PIECE:
            return merge_short(list(map(self.byte_ids.__getitem__, b)), self.merges)
        return merge_long(list(map(self.byte_ids.__getitem__, b)), self.merges)

    def encode_units(self, units, encode_unit):
        """Token ids of the units (pre-tokens or words) in order: each looked up in the cache, or encoded
        with encode_unit and cached when it is at most CACHED_CHARS long."""
        cache, out = self.cache, []
        for unit in units:
            ids = cache.get(unit)
            if ids is None:
                ids = encode_unit(unit)
                if len(unit) <= CACHED_CHARS:
                    cache[unit] = ids
            out += ids
        return out

    def encode_word(self, word):
        """Token ids of a word (see WORDS): its pre-tokens', each cached."""
        return self.encode_units(self.pattern.findall(word), self.encode_piece)

    def encode_ordinary(self, text):
        """Token ids of text, special tokens treated as plain text: unit by unit (the pre-tokens of ASCII
        text, the words of other text), so that a unit seen before costs one dictionary lookup. The cache
        starts over when a call finds it full."""
        text = utf8_safe(text)
        if len(self.cache) >= CACHE_LIMIT:
            self.cache.clear()
        if text.isascii():
            return self.encode_units(PRETOKENS_ASCII.findall(text), self.encode_piece)
        return self.encode_units(WORDS.findall(text), self.encode_word)

    def encode(self, text, allowed_special=()):
        """Token ids of text. Special tokens in allowed_special ("all" or a set of names) become their ids;
        any other special token in the text raises ValueError (tiktoken's default)."""
        specials = self.special_tokens
        allowed = set(specials) if allowed_special == "all" else set(allowed_special)
        if not allowed <= specials.keys():
            raise ValueError(f"allowed_special names unknown special tokens: "
                             f"{sorted(allowed - specials.keys())}")
        present = [s for s in specials if s in text]  # a substring test per special: cheap for short texts
        if not present:
            return self.encode_ordinary(text)
        banned = [s for s in present if s not in allowed]
        if banned:
            first = min(banned, key=text.find)
            raise ValueError(f"text contains the special token {first!r}, which is not allowed: pass "
                             f"allowed_special={{{first!r}}} (or 'all') to encode it as a special "
                             f"token, or use encode_ordinary to encode it as text")
        out, start = [], 0
        for m in special_splitter(present).finditer(text):
            out += self.encode_ordinary(text[start:m.start()])
            out.append(specials[m.group()])
            start = m.end()
        out += self.encode_ordinary(text[start:])
        return out

    # --- decoding ---

    def decode_bytes(self, ids):
        ids = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        return b"".join([self.id_bytes[i] for i in ids])

    def decode(self, ids):
        """Text of token ids; bytes that are not valid UTF-8 become U+FFFD (as tiktoken)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


# -----------------------------------------------------------------------------
# Token shards (llm.c format)

def write_shard(path, tokens):
    tokens = np.asarray(tokens)
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")              # (256,)
    header[:3] = [SHARD_MAGIC, SHARD_VERSION, len(tokens)]
    write_file(path, header.tobytes() + tokens.astype("<u2").tobytes())  # tokens (N,) uint16


def read_shard(path):
    """The tokens (N,) uint16 of an llm.c shard; ValueError on a bad header or size."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")
    data = np.fromfile(path, dtype=np.uint8)
    if data.size < 4 * SHARD_HEADER_INTS:
        raise ValueError(f"{path} is not a token shard (shorter than the 1024-byte header)")
    header = data[:4 * SHARD_HEADER_INTS].view("<i4")               # (256,)
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise ValueError(f"{path} is not a token shard (magic {header[0]}, version {header[1]})")
    body = data[4 * SHARD_HEADER_INTS:]
    if body.size != 2 * header[2]:
        raise ValueError(f"{path} is truncated or padded: header says {header[2]} tokens, "
                         f"file holds {body.size / 2:g}")
    return body.view("<u2")                                         # (N,) uint16


# -----------------------------------------------------------------------------
# Command line

def die(msg):
    raise SystemExit(f"error: {msg}")


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


def refuse_input_as_output(args, *inputs):
    """--out may not be one of the files the command reads: the output would destroy its own input."""
    out = getattr(args, "out", None)
    if out and os.path.exists(out) and any(os.path.exists(p) and os.path.samefile(out, p) for p in inputs):
        die(f"--out {out} is a file this command reads: pick another")


def load_tokenizer_arg(name):
    """--tokenizer: 'gpt2' (downloaded/cached, see from_gpt2) or a file written by `train`."""
    return BPETokenizer.from_gpt2() if name == "gpt2" else BPETokenizer.load(name)


def cmd_train(args):
    refuse_input_as_output(args, *args.input)
    check_out(args.out, args.force)
    t0 = time.perf_counter()
    tok = BPETokenizer.train(args.input, args.vocab_size, args.special)
    dt = time.perf_counter() - t0
    tok.save(args.out)
    print(f"trained {tok.vocab_size} tokens ({tok.vocab_size - 256 - len(tok.special_tokens)} merges, "
          f"specials {tok.special_tokens}) in {dt:.2f} s -> {args.out}")


def cmd_encode(args):
    refuse_input_as_output(args, args.input, args.tokenizer)
    check_out(args.out, args.force)
    chunks = read_chunks(args.input)
    tok = load_tokenizer_arg(args.tokenizer)
    if tok.vocab_size > 65536:
        die(f"--tokenizer {args.tokenizer}: {tok.vocab_size} tokens do not fit a uint16 shard")
    t0 = time.perf_counter()
    parts = [np.array([tok.special_tokens[ENDOFTEXT]] if ENDOFTEXT in tok.special_tokens else [], np.uint16)]
    nbytes = 0
    for chunk in chunks:
        nbytes += len(chunk.encode("utf-8"))
        parts.append(np.array(tok.encode(chunk, allowed_special="all"), dtype=np.uint16))  # (n,)
    tokens = np.concatenate(parts)                                                       # (N,)
    write_shard(args.out, tokens)
    dt = time.perf_counter() - t0
    print(f"encoded {nbytes:,} bytes into {len(tokens):,} tokens in {dt:.2f} s -> {args.out}")


def cmd_decode(args):
    refuse_input_as_output(args, args.input, args.tokenizer)
    if args.out is not None:
        check_out(args.out, args.force)
    tokens = read_shard(args.input)
    data = load_tokenizer_arg(args.tokenizer).decode(tokens).encode("utf-8")  # invalid UTF-8 -> U+FFFD
    if args.out:
        write_file(args.out, data)
    else:
        sys.stdout.buffer.write(data)  # UTF-8 whatever the locale


def cmd_bench(args):
    import tiktoken  # the reference, for the comparison only
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str
    from unittest import mock

    if args.repeats < 1:
        die(f"--repeats {args.repeats}: must be at least 1")
    text = "".join(read_chunks(args.input))
    name = os.path.normpath(args.input)
    mb = len(text.encode("utf-8")) / 1e6
    encoder_json, vocab_bpe = (os.path.join(args.gpt2_dir, f) for f in ("encoder.json", "vocab.bpe"))
    tok = BPETokenizer.from_gpt2(encoder_json, vocab_bpe)
    # tiktoken's GPT-2 as get_encoding("gpt2") builds it, from the same two files (hash-checked) read here
    # rather than downloaded: the comparison runs offline. TIKTOKEN_CACHE_DIR "": none of it in tiktoken's cache
    with mock.patch.dict(os.environ, TIKTOKEN_CACHE_DIR=""):
        ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json, GPT2_SHA256["vocab.bpe"],
                                                GPT2_SHA256["encoder.json"])
    enc = tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                            special_tokens={ENDOFTEXT: len(ranks)}, explicit_n_vocab=len(ranks) + 1)

    def cold():
        tok.cache.clear()
        return tok.encode_ordinary(text)

    # the three runs take turns, so that a busy machine slows each alike; the best of each is reported
    runs = {"cold": cold, "warm": lambda: tok.encode_ordinary(text),
            "tiktoken": lambda: enc.encode_ordinary(text)}
    best, ids = dict.fromkeys(runs, float("inf")), {}
    for _ in range(args.repeats):
        for key, fn in runs.items():
            t0 = time.perf_counter()
            ids[key] = fn()
            best[key] = min(best[key], time.perf_counter() - t0)
    same = ids["cold"] == ids["warm"] == ids["tiktoken"]
    print(f"encode {name}: {mb:.2f} MB, {len(ids['tiktoken']):,} GPT-2 tokens, "
          f"identical to tiktoken: {'yes' if same else 'NO'}  (best of {args.repeats})")
    for key, label in (("cold", "ours, empty cache"), ("warm", "ours, warm cache"),
                       ("tiktoken", "tiktoken gpt2, 1 thread")):
        print(f"  {label:<28} {mb / best[key]:7.2f} MB/s  ({best['tiktoken'] / best[key]:.2f}x tiktoken)")
    t0 = time.perf_counter()
    trained = BPETokenizer.train(text, args.vocab_size)
    dt = time.perf_counter() - t0
    print(f"train a {trained.vocab_size:,}-token vocabulary on {name}: {dt:.2f} s")


def main(argv=None):
    # bench's defaults: the copies committed for the tests, so that it runs in any clone, offline
    test_data = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "data")
    p = OneLineErrorParser(description="Byte-level BPE tokenizer, GPT-2-exact.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="learn a vocabulary from text files")
    t.add_argument("--input", nargs="+", required=True,
                   help="UTF-8 text files to learn from, .gz ones read as gzip (required)")
    t.add_argument("--vocab-size", type=int, required=True,
                   help="tokens in all: 256 bytes, the merges, then the specials (required)")
    t.add_argument("--special", nargs="*", default=[ENDOFTEXT],
                   help=f"special tokens, given the ids after the merges; none with a bare --special "
                        f"(default: {ENDOFTEXT})")
    t.add_argument("--out", required=True, help="tokenizer file to write, plain text (required)")
    t.add_argument("--force", action="store_true", help="replace an existing --out (default: refuse)")
    e = sub.add_parser("encode", help="encode a text file into an llm.c token shard")
    e.add_argument("--tokenizer", required=True, help="'gpt2' (GPT-2's files from $GPT2_BPE_DIR or "
                   "data/gpt2, downloaded there once) or a file written by train (required)")
    e.add_argument("--input", required=True, help="UTF-8 text, one document: written as <|endoftext|> "
                   "(when the vocabulary has it) then its tokens; special tokens in the text are encoded "
                   "(required)")
    e.add_argument("--out", required=True, help="llm.c token shard to write, .bin (required)")
    e.add_argument("--force", action="store_true", help="replace an existing --out (default: refuse)")
    d = sub.add_parser("decode", help="decode an llm.c token shard into text")
    d.add_argument("--tokenizer", required=True, help="'gpt2' (GPT-2's files from $GPT2_BPE_DIR or "
                   "data/gpt2, downloaded there once) or a file written by train (required)")
    d.add_argument("--input", required=True, help="llm.c token shard to read, .bin (required)")
    d.add_argument("--out", help="text file to write (default: stdout)")
    d.add_argument("--force", action="store_true", help="replace an existing --out (default: refuse)")
    b = sub.add_parser("bench", help="encode MB/s vs tiktoken, and time to train a vocabulary")
    b.add_argument("--input", default=os.path.join(test_data, "tinyshakespeare", "input.txt"),
                   help="text to encode and train on (default: tinyshakespeare from tests/data)")
    b.add_argument("--gpt2-dir", default=os.path.join(test_data, "gpt2"),
                   help="folder with GPT-2's encoder.json and vocab.bpe (default: tests/data/gpt2)")
    b.add_argument("--vocab-size", type=int, default=8192,
                   help="size of the vocabulary whose training on --input is timed (default: %(default)s)")
    b.add_argument("--repeats", type=int, default=5,
                   help="timed encodes of each kind; the best counts (default: %(default)s)")
    args = p.parse_args(argv)
    commands = {"train": cmd_train, "encode": cmd_encode, "decode": cmd_decode, "bench": cmd_bench}
    try:
        commands[args.command](args)
    except ValueError as e:
        die(str(e))
    except OSError as e:  # the one boundary for the system's errors: a missing file, a folder, a full disk
        die(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))


if __name__ == "__main__":
    main()
