"""convert_hf.py: GPT-2 to and from Hugging Face transformers
(CPU, offline, tiny models L2 H4 C64: a random transformers GPT-2 through from-hf into every trainer, a
run of a trainer from the converted file, its checkpoint through to-hf into transformers and back bit for
bit, fp32 and bf16 model files, the tokenizer files against tiktoken, other checkpoint layouts and a hub
name, bad input)."""
import errno
import os
import re

# transformers and huggingface_hub read these when imported: nothing in this file may reach the network
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

import json  # noqa: E402
import shutil  # noqa: E402

import huggingface_hub  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tiktoken  # noqa: E402
import torch  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel  # noqa: E402

import convert_hf  # noqa: E402
import speedrun_reference  # noqa: E402
import train_gpt2_jax  # noqa: E402
import train_gpt2_torchfunc  # noqa: E402
import train_gpt2_triton  # noqa: E402
from conftest import (OFFLINE, REPO, assert_clean_error, assert_refused, data_file, run_script,  # noqa: E402
                      run_script_on_a_full_disk, step_events, write_model_file)

V, VP = 50257, 50304
L, H, C, MAX_T = 2, 4, 64, 48  # all different, so that no two header fields can be mixed up unseen
LOGITS_RTOL, LOSS_RTOL = 1e-5, 1e-6  # fp32: the frameworks differ in summation order only
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # tiny models gain nothing from threads on a busy 2-core machine
HF_FILES = {"config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json"}


# -----------------------------------------------------------------------------
# Each trainer's logits and loss, and transformers', on the same tokens

def trainer_logits_and_loss(trainer, path, tokens):
    """(logits (B, T, Vp) as numpy, mean loss) of the model file at `path` in one trainer, in fp32, for
    the inputs tokens[:, :-1] and the targets tokens[:, 1:] of a (B, T+1) token array."""
    x, y = tokens[:, :-1], tokens[:, 1:]
    B, T = x.shape
    if trainer == "jax":
        tg = train_gpt2_jax
        header, arrays = tg.read_model_file(str(path))
        cfg = tg.Config(**header, seq_len=T, batch_size=B, dtype="fp32", attn="xla")
        # one jitted function: run eagerly, every op of the model would be compiled on its own
        run = jax.jit(lambda p, x, y: (tg.forward(p, x, cfg), tg.loss_fn(p, x, y, cfg)))
        with jax.default_matmul_precision("highest"):
            logits, loss = run({k: jnp.asarray(a) for k, a in arrays.items()}, x, y)
        return np.asarray(logits), float(loss)
    tg = train_gpt2_torchfunc if trainer == "torchfunc" else train_gpt2_triton
    header, arrays = tg.read_model_file(str(path))
    extra = {"backend": "torch"} if trainer == "triton-torch" else {}
    cfg = tg.Config(**header, seq_len=T, batch_size=B, dtype="fp32", **extra)
    params = {k: torch.from_numpy(np.array(a)) for k, a in arrays.items()}
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    with torch.no_grad():
        return tg.forward(params, x, cfg).numpy(), float(tg.loss_fn(params, x, y, cfg))


def hf_logits_and_loss(model, tokens):
    """transformers' (logits (B, T, V), mean loss) for the same inputs and targets: it takes the (B, T+1)
    tokens and shifts the labels itself; the last position's logits, which predict nothing, are dropped."""
    with torch.no_grad():
        out = model(torch.from_numpy(tokens), labels=torch.from_numpy(tokens))
    return out.logits[:, :-1].numpy(), float(out.loss)


def assert_same_model(trainer, path, model, tokens):
    """The trainer's logits equal transformers' within LOGITS_RTOL of their largest magnitude (the padded
    columns are exactly zero), and its mean loss equals transformers' within LOSS_RTOL."""
    logits, loss = trainer_logits_and_loss(trainer, path, tokens)
    hf_logits, hf_loss = hf_logits_and_loss(model, tokens)
    assert logits.shape == (*hf_logits.shape[:2], VP)
    err = np.abs(logits[..., :V] - hf_logits).max() / np.abs(hf_logits).max()
    assert err < LOGITS_RTOL, f"{trainer}: logits differ by {err:.2e} of their largest"
    assert not logits[..., V:].any(), f"{trainer}: padded vocabulary columns are not zero"
    assert loss == pytest.approx(hf_loss, rel=LOSS_RTOL), trainer


def shard_tokens(path):
    return np.fromfile(path, dtype="<u2", offset=1024).astype(np.int64)


def read_model_file(path):
    """(header, all tensors as one flat array) of an fp32 llm.c model file; wte is the first Vp x C."""
    return np.fromfile(path, dtype="<i4", count=256), np.fromfile(path, dtype="<f4", offset=1024)


# -----------------------------------------------------------------------------
# Fixtures: a random transformers GPT-2, its conversion, a short run from it, and its checkpoint exported

@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    """(directory, model): a randomly initialised GPT2LMHeadModel (L2 H4 C64, 48 positions, GPT-2's
    vocabulary) saved by transformers, every weight then moved off its init (biases nonzero, LayerNorm
    weights not one), so that a misplaced bias or gain shows."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=L, n_head=H, n_embd=C, n_positions=MAX_T)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("hf_source")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def converted(hf_source, tmp_path_factory):
    """from-hf of hf_source, run as a script."""
    path = tmp_path_factory.mktemp("converted") / "model.bin"
    run_script("convert_hf.py", "from-hf", hf_source[0], "-o", path)
    return path


@pytest.fixture(scope="module")
def trained(converted, tiny_shards, tmp_path_factory):
    """Two fp32 steps of the Triton trainer (backend torch) started with --init-from the converted file,
    a checkpoint at step 2."""
    out = tmp_path_factory.mktemp("trained")
    run_script("train_gpt2_triton.py", "torch", "--data", tiny_shards, "--init-from", converted, "--steps", 2,
               "--seq-len", 32, "--batch-size", 2, "--total-batch-size", 64, "--lr", 1e-3, "--warmup", 1,
               "--dtype", "fp32", "--ckpt-every", 2, "--val-every", 0, "--hellaswag-every", 0,
               "--sample-every", 0, "--out-dir", out, env=ONE_THREAD)
    return out


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """to-hf of the trained checkpoint's model.bin, run as a script."""
    folder = tmp_path_factory.mktemp("exported") / "hf"
    run_script("convert_hf.py", "to-hf", trained / "ckpt_0000002" / "model.bin", "-o", folder,
               "--gpt2-dir", data_file("gpt2"))
    return folder


def to_hf(model_file, folder, *flags):
    convert_hf.main(["to-hf", str(model_file), "-o", str(folder), "--gpt2-dir", data_file("gpt2"), *flags])


def from_hf(source, path, *flags):
    convert_hf.main(["from-hf", str(source), "-o", str(path), *flags])


# -----------------------------------------------------------------------------
# Tests

@pytest.mark.quick  # the quick tier's run of convert_hf.py
def test_from_hf_gives_transformers_logits_in_every_trainer(hf_source, converted, shakespeare_tokens):
    """from-hf of a random transformers GPT-2: an fp32 llm.c file (version 3, max T = n_positions, wte
    padded to 50304 rows with zeros); in each trainer (JAX, torchfunc, Triton's backend torch) it gives
    transformers' logits on 2 x 47 tinyshakespeare tokens within 1e-5 relative and its mean loss within
    1e-6."""
    h, data = read_model_file(converted)
    assert h[:8].tolist() == [20240326, 3, MAX_T, V, L, H, C, VP] and not h[8:].any()
    assert data.size == VP * C + MAX_T * C + L * (12 * C * C + 13 * C) + 2 * C
    assert not data[V * C:VP * C].any()  # wte's padding rows
    tokens = shakespeare_tokens[:2 * MAX_T].astype(np.int64).reshape(2, MAX_T)
    for trainer in ("jax", "torchfunc", "triton-torch"):
        assert_same_model(trainer, converted, hf_source[1], tokens)


def test_a_trainer_trains_from_a_converted_file(trained, hf_source, tiny_shards):
    """The Triton trainer (a subprocess, --init-from the converted file) logs as step 1's train loss
    transformers' mean loss on the same batch (rel 1e-6) and trains on."""
    events = step_events(trained)
    assert [e["step"] for e in events] == [1, 2]
    tokens = shard_tokens(tiny_shards / "tiny_train_000001.bin")
    rows = np.stack([tokens[0:33], tokens[32:65]])  # the step's batch: x = tokens[0:64], y = tokens[1:65]
    _, hf_loss = hf_logits_and_loss(hf_source[1], rows)
    assert events[0]["train_loss"] == pytest.approx(hf_loss, rel=LOSS_RTOL)
    assert events[1]["train_loss"] != events[0]["train_loss"]


def test_to_hf_loads_in_transformers(trained, exported, shakespeare_tokens):
    """to-hf of the trained checkpoint writes config.json, model.safetensors (fp32, Conv1D weights as
    (in, out), wte without padding rows, no lm_head), vocab.json and merges.txt (OpenAI's files byte for
    byte) and tokenizer_config.json; AutoModelForCausalLM loads it with no extra arguments, head tied,
    max length 48, and gives the trainer's logits (rel 1e-5) and loss (rel 1e-6)."""
    assert set(os.listdir(exported)) == HF_FILES
    assert not [p for p in os.listdir(exported.parent) if p != "hf"]  # no temporary left beside it
    for ours, theirs in (("vocab.json", "encoder.json"), ("merges.txt", "vocab.bpe")):
        assert (exported / ours).read_bytes() == open(data_file(f"gpt2/{theirs}"), "rb").read()
    state = load_file(exported / "model.safetensors")
    assert "lm_head.weight" not in state and state["transformer.wte.weight"].shape == (V, C)
    assert state["transformer.h.1.mlp.c_fc.weight"].shape == (C, 4 * C)
    assert all(t.dtype == np.float32 for t in state.values())
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert type(model) is GPT2LMHeadModel and not model.training and model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    cfg = model.config
    assert (cfg.n_positions, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size) == (MAX_T, L, H, C, V)
    assert cfg.activation_function == "gelu_new" and cfg.layer_norm_epsilon == 1e-5
    tokens = shakespeare_tokens[1000:1000 + 2 * MAX_T].astype(np.int64).reshape(2, MAX_T)
    assert_same_model("triton-torch", trained / "ckpt_0000002" / "model.bin", model, tokens)


def test_round_trip_is_exact(trained, exported, tmp_path, shakespeare_tokens, capsys):
    """from-hf of the exported directory gives back the checkpoint's model.bin byte for byte; with nonzero
    padding rows in wte, the same file with those rows zeroed; a bf16 file (version 5) exports to the
    model its trainer reads (transformers' logits, rel 1e-5) and comes back as the fp32 file of the same
    values. An earlier to-hf output is replaced (--force), and no temporary is left."""
    ckpt = trained / "ckpt_0000002" / "model.bin"
    from_hf(exported, tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == ckpt.read_bytes()

    header, data = read_model_file(ckpt)
    T = int(header[2])
    assert not data[V * C:VP * C].any()  # training leaves the padding rows at zero
    padded = data.copy()
    padded[V * C:VP * C] = np.random.default_rng(0).standard_normal((VP - V) * C)
    write_model_file(tmp_path / "padded.bin", [padded], T, L, H, C)
    to_hf(tmp_path / "padded.bin", tmp_path / "hf")
    to_hf(tmp_path / "padded.bin", tmp_path / "hf", "--force")  # replaces the first output
    from_hf(tmp_path / "hf", tmp_path / "padded_back.bin")
    assert (tmp_path / "padded_back.bin").read_bytes() == ckpt.read_bytes()

    bf16 = [(data.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)]
    write_model_file(tmp_path / "bf16.bin", bf16, T, L, H, C, bf16=True)
    write_model_file(tmp_path / "bf16_as_fp32.bin", bf16, T, L, H, C)
    to_hf(tmp_path / "bf16.bin", tmp_path / "hf_bf16")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_bf16")
    tokens = shakespeare_tokens[:2 * T].astype(np.int64).reshape(2, T)
    assert_same_model("triton-torch", tmp_path / "bf16.bin", model, tokens)
    from_hf(tmp_path / "hf_bf16", tmp_path / "bf16_back.bin")
    assert (tmp_path / "bf16_back.bin").read_bytes() == (tmp_path / "bf16_as_fp32.bin").read_bytes()
    assert not [p for p in os.listdir(tmp_path) if p.endswith((".tmp", ".old"))]
    capsys.readouterr()


def test_tokenizer_encodes_like_tiktoken(exported):
    """AutoTokenizer from the exported directory is GPT-2's: 50257 tokens, <|endoftext|> = 50256 as eos,
    and it encodes tinyshakespeare's first 100,000 characters and tricky strings (unicode, emoji, spaces
    and newlines, contractions, digits, <|endoftext|> between documents) to tiktoken's tokens, and
    decodes them back."""
    tok = AutoTokenizer.from_pretrained(exported)
    enc = tiktoken.get_encoding("gpt2")
    assert len(tok) == V and tok.eos_token_id == 50256 and tok.model_max_length == MAX_T
    texts = [
        open(data_file("tinyshakespeare/input.txt"), encoding="utf-8").read()[:100_000],
        "Hello world", " Hello world", "  two spaces,\tone tab\n\nand\r\nnewlines   \n",
        "don't I'LL we've they'd it's 'quoted' O'Neil's",
        "3.14159 12,345,678 1e-5 0x1F 2024-01-01",
        "naïve café déjà vu — «quotes» Ünïcödé ß ﬁ", "日本語のテキスト、中文，한국어", "emoji 🤖🚀👍🏽 ZWJ 👨‍👩‍👧",
        "first document<|endoftext|>second document<|endoftext|>", "\u00a0non-breaking\u2009thin\u200bzero-width",
        "",
    ]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == enc.encode(text, allowed_special="all"), text[:40]
        assert tok.decode(ids) == text


def test_to_hf_offline_uses_the_committed_tokenizer_files(tiny_model_file, tmp_path, monkeypatch):
    """With GPT-2's tokenizer files neither in the cache (--gpt2-dir) nor downloadable (a proxy nobody
    listens on), to-hf writes the copies committed in tests/data/gpt2 once their sha256 is the published
    one; a committed copy that is not the published file is a one-line error and writes nothing."""
    offline = {"https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "no_proxy": "",
               "NO_PROXY": ""}
    cache, out = tmp_path / "no_cache", tmp_path / "hf"
    run_script("convert_hf.py", "to-hf", tiny_model_file, "-o", out, "--gpt2-dir", cache, env=offline)
    for hf_name, name in (("vocab.json", "encoder.json"), ("merges.txt", "vocab.bpe")):
        with open(data_file(f"gpt2/{name}"), "rb") as f:
            assert (out / hf_name).read_bytes() == f.read(), hf_name
    assert sorted(os.listdir(out)) == sorted(HF_FILES) and not cache.exists()
    damaged = tmp_path / "damaged"
    shutil.copytree(data_file("gpt2"), damaged)
    with open(damaged / "vocab.bpe", "ab") as f:
        f.write(b"\n")
    for key, value in offline.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(convert_hf, "COMMITTED_GPT2_DIR", str(damaged))
    with pytest.raises(SystemExit, match=r"^error: GPT-2's tokenizer file vocab.bpe: download of .* "
                                         r"is missing or not the published file$"):
        convert_hf.main(["to-hf", str(tiny_model_file), "-o", str(tmp_path / "hf2"), "--gpt2-dir",
                         str(cache)])
    assert not (tmp_path / "hf2").exists()


def test_a_copy_alone_converts_both_ways(trained, exported, tmp_path):
    """convert_hf.py copied alone into an empty folder, offline, nothing of the checkout importable: from-hf
    of the exported directory, to-hf of that (GPT-2's tokenizer files from $GPT2_BPE_DIR's cache) and
    from-hf again give the checkpoint's model.bin byte for byte; with no cache, one line says what is missing."""
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(os.path.join(REPO, "convert_hf.py"), alone)
    shutil.copytree(data_file("gpt2"), alone / "cache")
    env = {**OFFLINE, "PYTHONPATH": "", "GPT2_BPE_DIR": "cache"}
    for args in (["from-hf", exported, "-o", "back.bin"], ["to-hf", "back.bin", "-o", "hf"],
                 ["from-hf", "hf", "-o", "again.bin"]):
        run_script("convert_hf.py", *args, cwd=alone, env=env)
    ckpt = (trained / "ckpt_0000002" / "model.bin").read_bytes()
    assert (alone / "back.bin").read_bytes() == ckpt and (alone / "again.bin").read_bytes() == ckpt
    assert (alone / "hf" / "merges.txt").read_bytes() == (alone / "cache" / "vocab.bpe").read_bytes()
    missing = run_script("convert_hf.py", "to-hf", "back.bin", "-o", "hf2", "--gpt2-dir", "no_cache", cwd=alone,
                         env=env, check=False)
    assert_clean_error(missing, "encoder.json: download of", "tests/data/gpt2/encoder.json is missing")
    assert not (alone / "hf2").exists() and not (alone / "no_cache").exists()


def test_from_hf_reads_other_layouts(hf_source, converted, tmp_path, monkeypatch, capsys):
    """from-hf gives the same file from a sharded checkpoint (model.safetensors.index.json), from OpenAI's
    layout on the hub (names without 'transformer.', the causal-mask buffers, an lm_head equal to wte),
    and through a hub name (huggingface_hub's snapshot_download, replaced here by the local folder); a
    bf16 checkpoint gives the bf16 values widened to fp32."""
    folder, model = hf_source
    expected = converted.read_bytes()
    model.save_pretrained(tmp_path / "sharded", max_shard_size="300KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    from_hf(tmp_path / "sharded", tmp_path / "sharded.bin")
    assert (tmp_path / "sharded.bin").read_bytes() == expected

    openai = tmp_path / "openai"
    shutil.copytree(folder, openai)
    state = {k.removeprefix("transformer."): v for k, v in load_file(folder / "model.safetensors").items()}
    causal = np.tril(np.ones((1, 1, MAX_T, MAX_T), np.float32))
    for layer in range(L):
        state[f"h.{layer}.attn.bias"] = causal
        state[f"h.{layer}.attn.masked_bias"] = np.array(-1e4, np.float32)
    state["lm_head.weight"] = state["wte.weight"]
    save_file(state, openai / "model.safetensors", metadata={"format": "pt"})
    from_hf(openai, tmp_path / "openai.bin")
    assert (tmp_path / "openai.bin").read_bytes() == expected

    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(folder)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    from_hf("gpt2", tmp_path / "hub.bin")
    assert calls == [("gpt2", {"allow_patterns": convert_hf.HUB_FILES})]
    assert {"config.json", "model.safetensors"} <= set(convert_hf.HUB_FILES)
    assert (tmp_path / "hub.bin").read_bytes() == expected

    GPT2LMHeadModel.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    from_hf(tmp_path / "bf16", tmp_path / "bf16.bin")
    _, got = read_model_file(tmp_path / "bf16.bin")
    _, want = read_model_file(converted)
    rounded = torch.from_numpy(want).bfloat16().float().numpy()  # round to nearest, as .to(bfloat16) does
    np.testing.assert_array_equal(got, rounded)
    capsys.readouterr()


def model_file_variant(converted, folder, name, **fields):
    """A copy of the converted model file with header fields changed (h3=50000: int32 number 3)."""
    data = bytearray(converted.read_bytes())
    for field, value in fields.items():
        index = int(field[1:])
        data[4 * index:4 * index + 4] = np.int32(value).tobytes()
    (folder / name).write_bytes(bytes(data))
    return folder / name


def hf_variant(hf_source, folder, name, config_changes=None, state_changes=None, raw=None):
    """A copy of hf_source's directory with config.json keys changed and tensors replaced (None: removed),
    or with `raw` bytes as its model.safetensors."""
    source = hf_source[0]
    config = json.loads((source / "config.json").read_text())
    (folder / name).mkdir()
    (folder / name / "config.json").write_text(json.dumps({**config, **(config_changes or {})}))
    if raw is None:
        state = {**load_file(source / "model.safetensors"), **(state_changes or {})}
        save_file({k: v for k, v in state.items() if v is not None}, folder / name / "model.safetensors",
                  metadata={"format": "pt"})
    else:
        (folder / name / "model.safetensors").write_bytes(raw)
    return folder / name


def test_bad_input(hf_source, converted, tmp_path):
    """Run as a script, a one-line error, no traceback and nothing written for: to-hf of a file with
    another magic, another version, or cut short; from-hf of another architecture, another vocabulary, a
    missing tensor, or a hub name that cannot be had (offline, an empty cache)."""
    to_hf_cases = [
        (model_file_variant(converted, tmp_path, "magic.bin", h0=12345), "magic"),
        (model_file_variant(converted, tmp_path, "version.bin", h1=4), "version"),
        (model_file_variant(converted, tmp_path, "short.bin", h2=MAX_T + 1), "truncated"),
    ]
    for path, needle in to_hf_cases:
        proc = run_script("convert_hf.py", "to-hf", path, "-o", tmp_path / "out", check=False)
        assert_clean_error(proc, needle, path.name)
    neo = {"model_type": "gpt_neo", "architectures": ["GPTNeoForCausalLM"]}
    from_hf_cases = [
        (hf_variant(hf_source, tmp_path, "neo", neo), "gpt_neo model (GPTNeoForCausalLM), not GPT-2"),
        (hf_variant(hf_source, tmp_path, "vocab", {"vocab_size": 50000}), "vocabulary of 50000"),
        (hf_variant(hf_source, tmp_path, "missing", state_changes={"transformer.h.1.mlp.c_fc.weight": None}),
         "no tensor h.1.mlp.c_fc.weight"),
        ("no-such-org/no-such-gpt2", "hugging face hub"),
    ]
    empty_cache = {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    for source, needle in from_hf_cases:
        proc = run_script("convert_hf.py", "from-hf", source, "-o", tmp_path / "out.bin", check=False,
                          env=empty_cache)
        assert_clean_error(proc, needle)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]


def test_more_bad_input(hf_source, converted, tmp_path):
    """Further bad input, run in-process (a script start each would cost a second), each a one-line error:
    to-hf of a missing file, of one shorter than its header, of a speedrun model file, of another
    vocabulary, or into a directory holding other files; from-hf into a directory, from-hf of a file, a
    directory without config.json or model.safetensors, a config of another activation, LayerNorm eps or
    MLP width or an untied head, an lm_head tensor unlike wte, a tensor of the wrong shape or dtype, an
    extra tensor, a corrupt safetensors file."""
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    header_cut = tmp_path / "header_cut.bin"
    header_cut.write_bytes(converted.read_bytes()[:100])
    speedrun_file = tmp_path / "speedrun.safetensors"  # what --recipe speedrun writes (one layer, width 128)
    speedrun_reference.write_model_file(speedrun_file, speedrun_reference.init_state_dict(1, 128, seed=0))
    variant = lambda name, *args, **kw: str(hf_variant(hf_source, tmp_path, name, *args, **kw))  # noqa: E731
    wte = load_file(hf_source[0] / "model.safetensors")["transformer.wte.weight"]
    cases = [
        (["to-hf", str(tmp_path / "no_such_model.bin")], "no_such_model.bin: No such file or directory"),
        (["to-hf", str(header_cut)], "is truncated: 100 bytes, shorter than its 1024-byte header"),
        (["to-hf", str(speedrun_file)], "is a speedrun model"),
        (["to-hf", str(model_file_variant(converted, tmp_path, "v.bin", h3=50000))], "vocabulary of 50000"),
        (["to-hf", str(converted), "-o", str(tmp_path / "taken")], "exists and is not an earlier to-hf output"),
        (["from-hf", str(converted)], "is a file"),
        (["from-hf", str(hf_source[0]), "-o", str(tmp_path / "taken")], "is a directory"),
        (["from-hf", str(tmp_path / "taken")], "no config.json"),
        (["from-hf", variant("erf", {"activation_function": "gelu"})], "activation_function = 'gelu'"),
        (["from-hf", variant("eps", {"layer_norm_epsilon": 1e-6})], "layer_norm_epsilon"),
        (["from-hf", variant("wide", {"n_inner": 512})], "n_inner"),
        (["from-hf", variant("untie", {"tie_word_embeddings": False})], "tie_word_embeddings"),
        (["from-hf", variant("untied", state_changes={"lm_head.weight": wte + 1})], "lm head"),
        (["from-hf", variant("t", {"n_positions": 32})], f"wpe.weight has shape ({MAX_T}, {C}), expected (32, {C})"),
        (["from-hf", variant("i64", state_changes={"transformer.ln_f.bias": np.zeros(C, np.int64)})],
         "dtype I64"),
        (["from-hf", variant("head", state_changes={"score.weight": np.zeros((2, C), np.float32)})],
         "score.weight"),
        (["from-hf", variant("corrupt", raw=(hf_source[0] / "model.safetensors").read_bytes()[:5000])],
         "not a readable safetensors file"),
    ]
    (tmp_path / "no_weights").mkdir()
    shutil.copy(hf_source[0] / "config.json", tmp_path / "no_weights")
    cases.append((["from-hf", str(tmp_path / "no_weights")], "no model.safetensors"))
    for args, needle in cases:
        with pytest.raises(SystemExit) as e:
            convert_hf.main(args if "-o" in args else [*args, "-o", str(tmp_path / "out")])
        message = str(e.value)
        assert message.startswith("error: ") and "\n" not in message and needle in message, message
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path / "taken") == ["notes.txt"]


def test_a_failed_conversion_leaves_the_old_output(exported, converted, hf_source, tmp_path, monkeypatch):
    """A conversion that fails while writing (a full disk, injected: a one-line error; a failed read of the
    source: its own OSError) leaves the earlier output that --force was to replace as it was and no
    temporary file or directory behind: to-hf over an earlier to-hf directory, from-hf over an existing
    model file."""
    earlier = tmp_path / "hf"
    shutil.copytree(exported, earlier)
    before = {name: (earlier / name).read_bytes() for name in os.listdir(earlier)}

    def failing_write_safetensors(path, tensors, metadata):
        open(path, "wb").write(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(convert_hf, "write_safetensors", failing_write_safetensors)
    with pytest.raises(SystemExit, match=f"^error: cannot write {re.escape(str(earlier))}: no space left, "
                                         f"the disk is full$"):
        to_hf(converted, earlier, "--force")
    assert {name: (earlier / name).read_bytes() for name in os.listdir(earlier)} == before

    shutil.copy(converted, tmp_path / "model.bin")
    loads = []

    def failing_load(entry):
        loads.append(entry)
        if len(loads) == 10:
            raise OSError("input/output error")
        return load(entry)
    load = convert_hf.load_hf_tensor
    monkeypatch.setattr(convert_hf, "load_hf_tensor", failing_load)
    with pytest.raises(OSError, match="input/output"):
        from_hf(hf_source[0], tmp_path / "model.bin", "--force")
    assert (tmp_path / "model.bin").read_bytes() == converted.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["hf", "model.bin"]


def test_no_conversion_replaces_its_input(hf_source, converted, exported, tmp_path, capsys):
    """Nothing destroys an input: from-hf with -o one of the files it reads (its weights, config.json) and
    to-hf with -o its model file or a directory holding it are refused with one line, --force or not, the
    input left as it was. An existing output is replaced only with --force, in both commands: from-hf's
    model file, to-hf's earlier directory (an empty directory is no output and needs none)."""
    source, holder = tmp_path / "source", tmp_path / "holder"
    shutil.copytree(hf_source[0], source)
    holder.mkdir()
    shutil.copy(converted, holder / "model.bin")
    inputs = [source / "model.safetensors", source / "config.json", converted, holder / "model.bin"]
    before = [path.read_bytes() for path in inputs]
    proc = run_script("convert_hf.py", "from-hf", source, "-o", source / "model.safetensors", check=False)
    assert_clean_error(proc, f"-o {source / 'model.safetensors'} exists: pass --force to replace it")
    cases = [("from-hf", source, source / "model.safetensors", source / "model.safetensors"),
             ("from-hf", source, source / "config.json", source / "config.json"),
             ("to-hf", converted, converted, converted),
             ("to-hf", holder / "model.bin", holder, holder / "model.bin")]
    for command, source_arg, out, replaced in cases:
        with pytest.raises(SystemExit) as e:
            convert_hf.main([command, str(source_arg), "-o", str(out), "--force"])
        assert str(e.value) == f"error: -o {out} would replace {replaced}, which {command} reads: pick " \
                               f"another -o", str(e.value)
    assert [path.read_bytes() for path in inputs] == before and os.listdir(holder) == ["model.bin"]

    out = tmp_path / "out.bin"
    out.write_bytes(b"an earlier file")
    with pytest.raises(SystemExit, match="exists: pass --force to replace it$"):
        from_hf(source, out)
    assert out.read_bytes() == b"an earlier file"
    from_hf(source, out, "--force")
    assert out.read_bytes() == converted.read_bytes()
    hf = tmp_path / "hf"
    shutil.copytree(exported, hf)
    earlier = (hf / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit, match="holds an earlier to-hf output: pass --force to replace it$"):
        to_hf(converted, hf)
    assert (hf / "model.safetensors").read_bytes() == earlier
    to_hf(converted, hf, "--force")
    assert (hf / "model.safetensors").read_bytes() != earlier
    (tmp_path / "empty").mkdir()
    to_hf(converted, tmp_path / "empty")
    assert set(os.listdir(tmp_path / "empty")) == HF_FILES
    capsys.readouterr()


def test_an_unwritable_output_is_one_line(hf_source, converted, tmp_path):
    """-o below a regular file, or in a place where nothing can be created (/proc), is one line naming the
    output and why it cannot be written, in from-hf and to-hf; nothing is left behind."""
    (tmp_path / "file").write_text("not a folder")
    for place in (tmp_path / "file", "/proc"):
        for args, out in ((["from-hf", hf_source[0]], os.path.join(place, "model.bin")),
                          (["to-hf", converted, "--gpt2-dir", data_file("gpt2")], os.path.join(place, "hf"))):
            with pytest.raises(SystemExit) as e:
                convert_hf.main([*map(str, args), "-o", out])
            message = str(e.value)
            assert message.startswith(f"error: cannot write {out}: ") and "\n" not in message, message
    assert os.listdir(tmp_path) == ["file"]


def test_an_output_naming_nothing_or_a_long_name(hf_source, converted, tmp_path, monkeypatch):
    """-o '' or a path ending in / (from-hf), '' or '.' (to-hf) is one line asking for a name, nothing
    written; a name of 255 characters, the longest a file may have, is written by both commands."""
    monkeypatch.chdir(tmp_path)
    source, model = str(hf_source[0]), str(converted)
    assert_refused(convert_hf.main, [
        (["from-hf", source, "-o", ""], "-o '': give the name of the model file to write"),
        (["from-hf", source, "-o", "new/"], "-o 'new/': give the name of the model file to write"),
        (["to-hf", model, "-o", ""], "-o '': give the name of the directory to write"),
        (["to-hf", model, "-o", "."], "-o '.': give the name of the directory to write")])
    assert os.listdir(tmp_path) == []
    from_hf(source, "x" * 251 + ".bin")
    to_hf(converted, "y" * 255)
    assert sorted(os.listdir(tmp_path)) == ["x" * 251 + ".bin", "y" * 255]
    assert (tmp_path / ("x" * 251 + ".bin")).read_bytes() == converted.read_bytes()


def test_a_full_disk_is_one_line(exported, converted, hf_source, tmp_path):
    """A disk that fills while the weights are written (a 2 MiB limit on the size of the files the script
    writes: EFBIG, which counts as ENOSPC) stops to-hf and from-hf, run as scripts, with one line that
    names the output and says the disk is full; the temporary is removed, and the earlier output --force
    was to replace is left as it was."""
    hf, model = tmp_path / "hf", tmp_path / "model.bin"
    shutil.copytree(exported, hf)
    shutil.copy(converted, model)
    before = {path.name: path.read_bytes() for path in [*hf.iterdir(), model]}
    for args, out in ((["to-hf", converted, "--gpt2-dir", data_file("gpt2")], hf),
                      (["from-hf", hf_source[0]], model)):
        proc = run_script_on_a_full_disk(2 << 20, "convert_hf.py", *args, "-o", out, "--force")
        assert_clean_error(proc)
        assert proc.stderr.splitlines()[-1] == f"error: cannot write {out}: no space left, the disk is full"
    assert sorted(os.listdir(tmp_path)) == ["hf", "model.bin"]
    assert {path.name: path.read_bytes() for path in [*hf.iterdir(), model]} == before


def test_command_line_mistakes_are_one_line(capsys):
    """A missing or unknown subcommand, a wrong flag, a subcommand's missing argument: one line naming it,
    as the trainers' are, instead of argparse's usage text; run as a script, stderr is that line alone."""
    cases = [([], "the following arguments are required: command"),
             (["convert"], "argument command: invalid choice: 'convert' (choose from 'to-hf', 'from-hf')"),
             (["from-hf", "gpt2", "-o", "x.bin", "--overwrite"], "unrecognized arguments: --overwrite"),
             (["to-hf", "model.bin"], "the following arguments are required: -o/--out")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            convert_hf.main(argv)
        assert str(e.value) == f"error: {message}"
        assert capsys.readouterr().err == ""
    proc = run_script("convert_hf.py", "to-hf", "--force", check=False)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == ["error: the following arguments are required: model, -o/--out"]
