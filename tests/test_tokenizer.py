"""tokenizer.py: byte-level BPE, GPT-2-exact.

GPT-2's vocabulary loaded by tokenizer.py must give tiktoken's tokens exactly; training must equal a
slow full-recount reference; files, downloads and the command line must fail cleanly on bad input."""
import collections
import gzip
import os
import random
import shutil

import numpy as np
import pytest
import regex

from conftest import EOT, OFFLINE, assert_clean_error, data_file, run_script
import tokenizer
from tokenizer import BPETokenizer

TRICKY = [
    "", " ", "a", "Hello, world!", "héllo wörld café naïve Ærøskøbing", "Ça va? Où êtes-vous?",
    "你好，世界。日本語のテキスト、한국어 텍스트",
    "emoji 🤖🚀👨‍👩‍👧‍👦 flags 🇩🇪🇬🇧 skin 👍🏽",
    "tabs\tand\t\ttabs\t", "runs of spaces     here   and there  ", "\n\n\nnewlines\n\n \n\t\n",
    "trailing spaces   ", "   leading spaces", "\r\nwindows\r\nline ends\r\n",
    "digits 0123456789 3.14159 1,000,000 2024-05-20 x86_64", "he's she'll they're we've I'm you'd it'd 't",
    "HE'S SHE'LL THEY'RE I'M", "don’t won’t it’s (curly apostrophes)", "''' 's's ''s 'll'll",
    "a\u0301 e\u0300 combining marks, \u200bzero\u200dwidth\ufeffBOM", "\x00\x01\x1b[31mred\x1b[0m\x7f",
    "\x1c\x1d\x1e\x1f separators \x85 next-line \u2028 \u2029 \u00a0nbsp \u3000ideographic",
    "Straße ǅ ǈ ﬁ ligature ℌ 𝕏 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 Ω ≈ ∑ √",
    "<|endoftext|> looks special but is text here",
    "<|endoftext <|endoftext|| |endoftext|>", "a" * 3000, " " * 5000 + "x", "ab" * 700 + " " + "7" * 999,
    "!?" * 400, "добрый день, Ελλάδα", "مرحبا שלום नमस्ते สวัส",
]


@pytest.fixture(scope="session")
def enc():
    import tiktoken
    return tiktoken.get_encoding("gpt2")


@pytest.fixture(scope="session")
def gpt2():
    return BPETokenizer.from_gpt2(data_file("gpt2/encoder.json"), data_file("gpt2/vocab.bpe"))


@pytest.fixture(scope="session")
def shakespeare():
    with open(data_file("tinyshakespeare/input.txt"), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="session")
def trained(shakespeare):
    return BPETokenizer.train(shakespeare, 4096)


def random_strings(seed, n):
    """Random byte strings decoded as UTF-8 with replacement, and random code points from every plane."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        out.append(raw.decode("utf-8", errors="replace"))
        cps = [rng.choice([rng.randrange(0x80), rng.randrange(0x800), rng.randrange(0x10000),
                           rng.randrange(0x110000)]) for _ in range(rng.randrange(1, 80))]
        out.append("".join(chr(c) for c in cps if not 0xD800 <= c <= 0xDFFF))
    return out


# -----------------------------------------------------------------------------
# GPT-2's vocabulary: token for token against tiktoken

def test_gpt2_shakespeare_exact(gpt2, enc, shakespeare):
    """All of tinyshakespeare encodes to tiktoken's 338,025 tokens and decodes back to the same text."""
    ids = gpt2.encode(shakespeare)
    assert ids == enc.encode(shakespeare) and len(ids) == 338025
    assert gpt2.decode(ids) == shakespeare


def test_gpt2_multi30k_exact(gpt2, enc):
    """Multi30k English and German (whole files, and val/test line by line) encode exactly as tiktoken."""
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("en", "de"):
            with gzip.open(data_file(f"multi30k/{split}.{lang}.gz"), "rt", encoding="utf-8") as f:
                text = f.read()
            ids = gpt2.encode(text)
            assert ids == enc.encode(text), f"{split}.{lang}"
            assert gpt2.decode(ids) == text
            if split != "train":
                for line in text.splitlines():
                    assert gpt2.encode(line) == enc.encode(line), line


def test_gpt2_tricky_text_exact(gpt2, enc):
    """Emoji, CJK, accents, tabs, space runs, digits, contractions, long pieces: tiktoken's tokens."""
    for text in TRICKY:
        ids = gpt2.encode_ordinary(text)
        assert ids == enc.encode_ordinary(text), text[:80]
        assert gpt2.decode(ids) == text
    joined = "\n".join(TRICKY)
    assert gpt2.encode_ordinary(joined) == enc.encode_ordinary(joined)
    lone = "pair \ud83d\ude00 lone \ud800 end \udfff"  # tiktoken replaces lone surrogates by U+FFFD
    assert gpt2.encode(lone) == enc.encode(lone)


def test_gpt2_random_text_exact(gpt2, enc):
    """Random byte strings decoded with replacement and random code points: tiktoken's tokens, round trip."""
    for text in random_strings(seed=1, n=300):
        ids = gpt2.encode_ordinary(text)
        assert ids == enc.encode_ordinary(text), repr(text[:80])
        assert gpt2.decode(ids) == text


def test_gpt2_every_code_point_sample(gpt2, enc):
    """Every 23rd code point, after a letter/digit/symbol/space/tab/newline, encodes as tiktoken."""
    chars = [chr(c) for c in range(0, 0x110000, 23) if not 0xD800 <= c <= 0xDFFF]
    text = "".join(f"a{c}1{c}!{c} {c}\t{c}\n" for c in chars)
    assert gpt2.encode_ordinary(text) == enc.encode_ordinary(text)


def test_units_keep_the_pre_tokens():
    """encode_ordinary's cache units: re's ASCII pattern gives exactly the GPT-2 pre-tokens of any ASCII
    text (all 128 characters, heavy on whitespace, digits and contractions), and WORDS cuts any text only
    where no pre-token crosses (random mixes of every kind of whitespace, letters, digits, apostrophes)."""
    split = regex.compile(tokenizer.GPT2_SPLIT_PATTERN).findall
    rng = random.Random(0)
    ascii_alphabet = [chr(c) for c in range(128)] + [" ", " ", "\n", "\t", "'", "s", "ll", "7", "a", "Z"] * 8
    for _ in range(3000):
        text = "".join(rng.choice(ascii_alphabet) for _ in range(rng.randrange(1, 40)))
        assert tokenizer.PRETOKENS_ASCII.findall(text) == split(text), repr(text)
    alphabet = [" ", " ", " ", "\n", "\n", "\t", "\r", "\x0b", "\x1c", "\x85", "\xa0", "\u3000", "a", "Z",
                "é", "字", "7", "٣", "²", "'", "s", "ll", ",", "!", "🤖"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        words = tokenizer.WORDS.findall(text)
        assert "".join(words) == text
        assert [p for w in words for p in split(w)] == split(text), repr(text)
    assert tokenizer.WORDS.findall("First Citizen:\nBefore we proceed,\n\nAll  hear\n me\n") == \
        ["First", " Citizen:", "\nBefore", " we", " proceed,", "\n\nAll", "  hear", "\n me", "\n"]


def test_special_tokens_like_tiktoken(gpt2, enc):
    """<|endoftext|> raises unless allowed, is 50256 when allowed, is text to encode_ordinary."""
    text = "one<|endoftext|>two <|endoftext|><|endoftext|>"
    with pytest.raises(ValueError, match="special token"):
        gpt2.encode(text)
    with pytest.raises(ValueError):
        enc.encode(text)
    assert gpt2.encode(text, allowed_special="all") == enc.encode(text, allowed_special="all")
    assert gpt2.encode(text, allowed_special={"<|endoftext|>"}).count(EOT) == 3
    assert gpt2.encode_ordinary(text) == enc.encode_ordinary(text) and EOT not in gpt2.encode_ordinary(text)
    assert gpt2.decode([EOT]) == "<|endoftext|>" and gpt2.special_tokens == {"<|endoftext|>": EOT}
    with pytest.raises(ValueError, match="unknown special"):
        gpt2.encode("x", allowed_special={"<|fim|>"})


def test_decode_partial_utf8_and_bad_ids(gpt2, enc):
    """Ids splitting a UTF-8 character decode to U+FFFD as tiktoken; unknown ids raise."""
    ids = gpt2.encode("🤖 中")
    for k in range(len(ids) + 1):
        assert gpt2.decode(ids[:k]) == enc.decode(ids[:k])
    assert gpt2.decode(np.array(ids, dtype=np.uint16)) == "🤖 中"
    for bad in ([50257], [-1], [5, 60000]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            gpt2.decode(bad)


def test_long_piece_merge_equals_short(gpt2, trained):
    """The heap merge for long pre-tokens equals the pair-scan merge at every length to 200."""
    rng = random.Random(2)
    for tok in (gpt2, trained):
        for n in range(1, 200):
            piece = "".join(rng.choice("aeiou rstln'é中") for _ in range(n)).encode("utf-8")
            ids = [tok.byte_ids[x] for x in piece]
            assert tokenizer.merge_long(list(ids), tok.merges) == tokenizer.merge_short(list(ids), tok.merges)


# -----------------------------------------------------------------------------
# Training

def naive_train(word_counts, n_tokens):
    """The reference: recount every pair over every word before each merge; the most frequent pair wins,
    ties to the smallest (left id, right id); a merge whose bytes already exist reuses that token."""
    words = [(list(w), c) for w, c in word_counts.items()]
    tokens = [bytes([b]) for b in range(256)]
    index = {b: i for i, b in enumerate(tokens)}
    while len(tokens) < n_tokens:
        counts = collections.Counter()
        for w, c in words:
            for pair in zip(w, w[1:]):
                counts[pair] += c
        if not counts:
            break
        a, b = min(counts, key=lambda p: (-counts[p], p))
        new = index.setdefault(tokens[a] + tokens[b], len(tokens))
        if new == len(tokens):
            tokens.append(tokens[a] + tokens[b])
        merged_words = []
        for w, c in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged_words.append((out, c))
        words = merged_words
    return tokens


def test_training_equals_full_recount(shakespeare):
    """Incremental pair counts learn the merges of a full recount per merge (text, 'aaaa', random)."""
    text = shakespeare[:10000] + " aaaa aaaaa abab ababab aabaab aaab bbbb " * 7
    counts = tokenizer.count_pretokens([text], [])
    assert tokenizer.learn_merges(counts, 256 + 200) == naive_train(counts, 256 + 200)
    rng = random.Random(3)
    for _ in range(200):
        counts = {}
        for _ in range(rng.randrange(2, 8)):
            w = bytes(rng.choice(b"ab") for _ in range(rng.randrange(2, 9)))
            counts[w] = counts.get(w, 0) + rng.randrange(1, 6)
        assert tokenizer.learn_merges(counts, 10 ** 6) == naive_train(counts, 10 ** 6), counts


def test_trained_shakespeare_round_trip(trained, shakespeare):
    """A 4,096-token BPE of tinyshakespeare has 4,096 ids, compresses, round-trips any string."""
    assert trained.vocab_size == 4096 and trained.special_tokens == {"<|endoftext|>": 4095}
    assert trained.tokens[:256] == [bytes([b]) for b in range(256)] and len(trained.tokens) == 4095
    ids = trained.encode(shakespeare)
    assert max(ids) < 4095 and len(ids) < len(shakespeare) / 3  # GPT-2 (50,257 ids): 3.3 bytes/token
    assert trained.decode(ids) == shakespeare
    for text in TRICKY + random_strings(seed=4, n=100):
        assert trained.decode(trained.encode_ordinary(text)) == text
    assert trained.encode("a<|endoftext|>b", allowed_special="all")[1] == 4095


def test_trained_vocab_encodes_as_tiktoken(trained, shakespeare):
    """A trained vocabulary handed to tiktoken's engine encodes as ours: text, random strings, specials."""
    import tiktoken
    ref = tiktoken.Encoding(name="trained", pat_str=tokenizer.GPT2_SPLIT_PATTERN,
                            mergeable_ranks={b: i for i, b in enumerate(trained.tokens)},
                            special_tokens=trained.special_tokens)
    for text in [shakespeare[:200000]] + TRICKY + random_strings(seed=5, n=100):
        assert trained.encode_ordinary(text) == ref.encode_ordinary(text), repr(text[:80])
    multi = BPETokenizer.train(shakespeare[:50000], 600, special_tokens=("<pad>", "<s>", "</s>"))
    ref = tiktoken.Encoding(name="multi", pat_str=tokenizer.GPT2_SPLIT_PATTERN,
                            mergeable_ranks={b: i for i, b in enumerate(multi.tokens)},
                            special_tokens=multi.special_tokens)
    text = "<s>Hello there</s><pad><pad> <s>again</s>"
    assert multi.encode(text, allowed_special="all") == ref.encode(text, allowed_special="all")
    assert multi.encode(text, allowed_special={"<s>", "</s>", "<pad>"})[-1] == multi.special_tokens["</s>"]
    with pytest.raises(ValueError, match="'</s>'"):
        multi.encode(text, allowed_special={"<s>", "<pad>"})


def test_training_inputs_and_chunking(tmp_path, shakespeare):
    """Chunk cuts keep pre-tokens; files (plain, .gz) train as their text; specials not learned."""
    text = "\n".join(TRICKY) + shakespeare[:3000] + "\n\n  x\n\ty  \n z" * 20
    whole = regex.findall(tokenizer.GPT2_SPLIT_PATTERN, text)
    for size in (1, 2, 3, 5, 8, 13, 40, 200):
        chunks = list(tokenizer.cut_chunks(text, size))
        assert "".join(chunks) == text and len(chunks) > 1
        assert [p for c in chunks for p in regex.findall(tokenizer.GPT2_SPLIT_PATTERN, c)] == whole
    cut = tokenizer.SAFE_CUT.search(shakespeare, 50000).start()
    first, second = shakespeare[:cut], shakespeare[cut:100000]
    (tmp_path / "a.txt").write_text(first, encoding="utf-8")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write(second)
    from_files = BPETokenizer.train([tmp_path / "a.txt", tmp_path / "b.txt.gz"], 600)
    assert from_files.tokens == BPETokenizer.train(first + second, 600).tokens
    assert tokenizer.count_pretokens(tokenizer.read_chunks(tmp_path / "a.txt", 1000), []) == \
        tokenizer.count_pretokens([first], [])
    marked = BPETokenizer.train("<|endoftext|>".join([first] * 3), 400)
    assert not any(b"<|" in t or b"|>" in t for t in marked.tokens)
    lone = BPETokenizer.train("ab\ud800cd \ud83d\ude00 " * 50, 266)  # every merge the text allows
    assert " 😀".encode() in lone.tokens and "\ufffd".encode() in lone.tokens
    assert not any(b"\xed" in t for t in lone.tokens[256:])  # no UTF-8-encoded surrogate halves


def test_training_bad_arguments(tmp_path):
    """Training rejects vocab_size < 256 + specials, empty/missing input, text too small."""
    with pytest.raises(ValueError, match="below 256"):
        BPETokenizer.train("some text", 256)
    with pytest.raises(ValueError, match="below 256"):
        BPETokenizer.train("some text", 257, special_tokens=("<a>", "<b>"))
    with pytest.raises(ValueError, match="empty"):
        BPETokenizer.train("", 300)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        BPETokenizer.train([tmp_path / "empty.txt"], 300)
    with pytest.raises(FileNotFoundError, match="no such file"):
        BPETokenizer.train([tmp_path / "missing.txt"], 300)
    with pytest.raises(ValueError, match="only allows 3 merges"):
        BPETokenizer.train("abcd", 300)
    assert BPETokenizer.train("abcd", 256 + 3 + 1).vocab_size == 260


# -----------------------------------------------------------------------------
# Files: the plain-text tokenizer file, GPT-2's files, the download

def test_save_load_plain_text(tmp_path, trained, gpt2, shakespeare):
    """save() writes readable text (one quoted token per line) that load() restores exactly."""
    for name, tok in (("trained.bpe", trained), ("gpt2.bpe", gpt2)):
        path = tmp_path / name
        tok.save(path)
        back = BPETokenizer.load(path)
        assert back.tokens == tok.tokens and back.special_tokens == tok.special_tokens
        assert back.encode(shakespeare[:20000]) == tok.encode(shakespeare[:20000])
    lines = (tmp_path / "gpt2.bpe").read_text(encoding="utf-8").splitlines()
    assert lines[:3] == [tokenizer.FILE_HEADER, "tokens 50256", "specials 1"]
    assert '262 " the"' in lines and '50256 special "<|endoftext|>"' in lines
    assert lines[3 + 198] == '198 "\\x0a"'  # GPT-2's id 198 is "\n"


@pytest.mark.parametrize("edit, needle", [
    (lambda ls: ["not a tokenizer"] + ls[1:], "not a tokenizer file"),
    (lambda ls: ls[:-40], "truncated"),
    (lambda ls: ls[:300] + ['297 "\\q"'] + ls[301:], "bad escape"),
    (lambda ls: ls[:300] + ['297 "ab'] + ls[301:], "double-quoted"),
    (lambda ls: ls[:300] + ['301 "ab"'] + ls[301:], "expected id 297"),
    (lambda ls: ls[:300] + ['297 "a"'] + ls[301:], "same bytes"),
    (lambda ls: ls[:300] + ['297 "qqq"'] + ls[301:], "not the merge of two other tokens"),
    (lambda ls: ls[:1] + ["tokens many"] + ls[2:], "line 2"),
], ids=["header", "truncated", "escape", "quote", "id-gap", "duplicate", "unmergeable", "count"])
def test_malformed_tokenizer_file(tmp_path, trained, edit, needle):
    """A tokenizer file with a bad header, lost line, bad escape or bad token: ValueError."""
    path = tmp_path / "t.bpe"
    trained.save(path)
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]
    path.write_text("\n".join(edit(lines)) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=needle):
        BPETokenizer.load(path)


def test_malformed_gpt2_files(tmp_path):
    """encoder.json not JSON or disagreeing with vocab.bpe, no '#version' line: ValueError."""
    enc_path, bpe_path = data_file("gpt2/encoder.json"), data_file("gpt2/vocab.bpe")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a GPT-2 vocabulary"):
        BPETokenizer.from_gpt2(tmp_path / "bad.json", bpe_path)
    lines = open(bpe_path, encoding="utf-8").read().split("\n")
    swapped = lines[:1] + [lines[2], lines[1]] + lines[3:]  # the first two merges in the wrong order
    (tmp_path / "swapped.bpe").write_text("\n".join(swapped), encoding="utf-8")
    with pytest.raises(ValueError, match="id 256"):
        BPETokenizer.from_gpt2(enc_path, tmp_path / "swapped.bpe")
    (tmp_path / "noversion.bpe").write_text("\n".join(lines[1:]), encoding="utf-8")
    with pytest.raises(ValueError, match="version"):
        BPETokenizer.from_gpt2(enc_path, tmp_path / "noversion.bpe")


def test_gpt2_download_and_cache(http_server, tmp_path, gpt2):
    """from_gpt2() downloads once (sha256-checked) then caches; broken downloads leave nothing."""
    for name in ("encoder.json", "vocab.bpe"):
        shutil.copy(data_file(f"gpt2/{name}"), os.path.join(http_server.root, name))
    cache = tmp_path / "cache"
    http_server.cut_once["vocab.bpe"] = 100000
    with pytest.raises(OSError, match="vocab.bpe"):
        BPETokenizer.from_gpt2(cache_dir=cache, base_url=http_server.url)
    assert sorted(os.listdir(cache)) == ["encoder.json"]  # the complete file is kept, the cut one is not
    http_server.fail_once["vocab.bpe"] = 503
    with pytest.raises(OSError, match="503"):
        BPETokenizer.from_gpt2(cache_dir=cache, base_url=http_server.url)
    tok = BPETokenizer.from_gpt2(cache_dir=cache, base_url=http_server.url)
    assert tok.tokens == gpt2.tokens and tok.special_tokens == gpt2.special_tokens
    n = len(http_server.requests)
    for name in ("encoder.json", "vocab.bpe"):
        assert tokenizer.fetch_gpt2_file(name, cache, http_server.url) == os.path.join(cache, name)
    assert len(http_server.requests) == n  # served from the cache
    with open(cache / "vocab.bpe", "r+b") as f:  # a damaged cached copy is fetched again
        f.write(b"#garbage")
    tokenizer.fetch_gpt2_file("vocab.bpe", cache, http_server.url)
    assert len(http_server.requests) == n + 1
    assert tokenizer.sha256_of(cache / "vocab.bpe") == tokenizer.GPT2_SHA256["vocab.bpe"]
    with open(os.path.join(http_server.root, "encoder.json"), "ab") as f:  # not the published file
        f.write(b" ")
    with pytest.raises(OSError, match="corrupt"):
        BPETokenizer.from_gpt2(cache_dir=tmp_path / "fresh", base_url=http_server.url)
    assert not (tmp_path / "fresh").exists()


# -----------------------------------------------------------------------------
# Command line

def read_shard_tokens(path):
    data = np.fromfile(path, dtype=np.uint8)
    header = data[:1024].view("<i4")
    assert list(header[:3]) == [20240520, 1, (data.size - 1024) // 2]
    return data[1024:].view("<u2").tolist()


def cli(*args):
    """tokenizer.py's command line run in this process (the subprocess tests below cover the real exit)."""
    tokenizer.main([str(a) for a in args])


def cli_error(*args):
    """The error a bad command line exits with, checked to be one line starting with "error:"."""
    with pytest.raises(SystemExit) as e:
        cli(*args)
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


@pytest.mark.quick  # the quick tier's run of tokenizer.py
def test_cli_train_encode_decode(tmp_path, capsys, enc, shakespeare):
    """CLI train writes a tokenizer, encode an llm.c shard (tiktoken's for gpt2), decode the text."""
    src = data_file("tinyshakespeare/input.txt")
    gpt2_dir = os.path.dirname(data_file("gpt2/vocab.bpe"))
    run_script("tokenizer.py", "encode", "--tokenizer", "gpt2", "--input", src, "--out", tmp_path / "g.bin",
               env={"GPT2_BPE_DIR": gpt2_dir})
    assert read_shard_tokens(tmp_path / "g.bin") == [EOT] + enc.encode_ordinary(shakespeare)
    small = tmp_path / "small.txt"
    small.write_text(shakespeare[:30000], encoding="utf-8")
    cli("train", "--input", small, "--vocab-size", "512", "--out", tmp_path / "s.bpe")
    assert "512 tokens" in capsys.readouterr().out
    tok = BPETokenizer.load(tmp_path / "s.bpe")
    cli("encode", "--tokenizer", tmp_path / "s.bpe", "--input", small, "--out", tmp_path / "s.bin")
    assert read_shard_tokens(tmp_path / "s.bin") == [511] + tok.encode(shakespeare[:30000])
    capsys.readouterr()
    cli("decode", "--tokenizer", tmp_path / "s.bpe", "--input", tmp_path / "s.bin")
    assert capsys.readouterr().out == "<|endoftext|>" + shakespeare[:30000]
    cli("decode", "--tokenizer", tmp_path / "s.bpe", "--input", tmp_path / "s.bin",
        "--out", tmp_path / "s.txt")
    assert (tmp_path / "s.txt").read_text(encoding="utf-8") == "<|endoftext|>" + shakespeare[:30000]


def test_cli_bench(tmp_path, capsys, monkeypatch, shakespeare):
    """`bench` prints our encode MB/s next to tiktoken's (tokens identical) and the training time; its
    default GPT-2 files are the ones in a clone (tests/data/gpt2), whatever the working directory."""
    small = tmp_path / "small.txt"
    small.write_text(shakespeare[:20000], encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    cli("bench", "--input", small, "--vocab-size", "300", "--repeats", "1")
    out = capsys.readouterr().out
    assert "identical to tiktoken: yes" in out and out.count("MB/s") == 3
    assert "train a 300-token vocabulary" in out


def test_cli_bad_input(tmp_path, monkeypatch):
    """Bad CLI input (missing/empty file, small vocab, bad file or shard, an --out that is one of the
    inputs): one-line error, exit 1, and no input replaced."""
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 50)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.bpe").write_text(tokenizer.FILE_HEADER + "\ntokens 3\nspecials 0\n0 \"a\"\n")
    shard = tmp_path / "s.bin"
    np.concatenate([np.array([20240520, 1, 10] + [0] * 253, "<i4").view(np.uint8),
                    np.zeros(6, np.uint8)]).tofile(shard)
    gpt2_dir = os.path.dirname(data_file("gpt2/vocab.bpe"))
    proc = run_script("tokenizer.py", "train", "--input", tmp_path / "missing.txt", "--vocab-size", "300",
                      "--out", tmp_path / "o", check=False)
    assert_clean_error(proc, "no such file", "missing.txt")
    proc = run_script("tokenizer.py", "decode", "--tokenizer", "gpt2", "--input", shard, check=False,
                      env={"GPT2_BPE_DIR": gpt2_dir})
    assert_clean_error(proc, "truncated", "s.bin")
    monkeypatch.setenv("GPT2_BPE_DIR", gpt2_dir)
    train = ["train", "--out", tmp_path / "o", "--input"]
    encode = ["encode", "--out", tmp_path / "o.bin", "--input"]
    cases = [
        (train + [tmp_path / "empty.txt", "--vocab-size", "300"], "empty"),
        (train + [text, "--vocab-size", "100"], "vocab_size 100"),
        (train + [text, "--vocab-size", "257", "--special", "<a>", "<b>"], "2 special tokens"),
        (train + [text, "--vocab-size", "5000"], "only allows"),
        (encode + [text, "--tokenizer", tmp_path / "bad.bpe"], "truncated"),
        (encode + [text, "--tokenizer", tmp_path / "missing.bpe"], "missing.bpe"),
        (encode + [tmp_path / "empty.txt", "--tokenizer", "gpt2"], "empty"),
        (["decode", "--tokenizer", "gpt2", "--input", text], "not a token shard"),
        (["decode", "--tokenizer", "gpt2", "--input", tmp_path / "missing.bin"], "missing.bin"),
        (["bench", "--input", text, "--repeats", "0"], "--repeats 0"),
        (["train", "--out", text, "--input", text, "--vocab-size", "300"], "a file this command reads"),
        (["encode", "--out", text, "--input", text, "--tokenizer", "gpt2"], "a file this command reads"),
        (["decode", "--out", shard, "--input", shard, "--tokenizer", "gpt2"], "a file this command reads"),
    ]
    kept = text.read_bytes(), shard.read_bytes()
    for args, needle in cases:
        assert needle in cli_error(*args)
    assert not os.path.exists(tmp_path / "o") and not os.path.exists(tmp_path / "o.bin")
    assert (text.read_bytes(), shard.read_bytes()) == kept  # an output never replaces an input


def test_cli_outputs_and_flags(tmp_path, capsys):
    """train, encode and decode refuse an existing --out unless --force, and --out '' or a folder, before
    any work; an --out below a regular file or where nothing can be created (/proc) is one line naming it,
    with no temporary left; a 255-character name is written. A bad flag value is one line."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, " * 50)
    BPETokenizer.train(str(text.read_text()), 260).save(tmp_path / "t.bpe")
    out = tmp_path / "out"
    out.mkdir()
    (out / "file").write_text("not a folder")
    earlier = out / "earlier"
    earlier.write_bytes(b"an earlier file")
    commands = [["train", "--input", text, "--vocab-size", "260", "--out"],
                ["encode", "--tokenizer", tmp_path / "t.bpe", "--input", text, "--out"]]
    cli(*commands[1], out / "s.bin")
    commands.append(["decode", "--tokenizer", tmp_path / "t.bpe", "--input", out / "s.bin", "--out"])
    for command in commands:
        for bad, needle in ((earlier, f"--out {earlier} exists: pass --force to replace it"),
                            ("", "--out '': give a file's name"), (out, "not a folder's"),
                            (out / "file" / "x", f"{out / 'file' / 'x'}: Not a directory"),
                            ("/proc/x", "/proc/x: ")):
            assert needle in cli_error(*command, bad)
        assert earlier.read_bytes() == b"an earlier file" and sorted(os.listdir(out)) == ["earlier", "file", "s.bin"]
        cli(*command, earlier, "--force")
        assert earlier.read_bytes() != b"an earlier file"
        earlier.write_bytes(b"an earlier file")
    long_name = out / ("x" * 251 + ".bin")
    cli(*commands[1], long_name)
    assert long_name.read_bytes() == (out / "s.bin").read_bytes() and len(os.listdir(out)) == 4
    capsys.readouterr()
    assert "argument --vocab-size: invalid int value: 'many'" in cli_error(*commands[0][:-2], "many", "--out", "x")
    assert capsys.readouterr().err == ""


def test_cli_bench_offline(tmp_path, shakespeare):
    """`bench` compares with tiktoken built from the committed GPT-2 files: offline, with tiktoken's cache
    empty, it still runs, and writes nothing into that cache."""
    small = tmp_path / "small.txt"
    small.write_text(shakespeare[:5000], encoding="utf-8")
    (tmp_path / "empty_cache").mkdir()
    proc = run_script("tokenizer.py", "bench", "--input", small, "--vocab-size", "260", "--repeats", "1",
                      env={**OFFLINE, "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_cache")})
    assert "identical to tiktoken: yes" in proc.stdout
    assert not os.listdir(tmp_path / "empty_cache"), "bench leaves tiktoken's cache as it found it"
