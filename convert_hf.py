"""convert_hf.py: GPT-2 between llm.c model files and Hugging Face transformers.

    python convert_hf.py to-hf out/gpt2_jax/ckpt_0018865/model.bin -o gpt2_hf   # a transformers directory
    python convert_hf.py from-hf gpt2_hf -o model.bin           # a local transformers GPT-2 directory
    python convert_hf.py from-hf gpt2 -o gpt2_124M.bin          # a hub name: gpt2, gpt2-medium, gpt2-xl, ...

to-hf reads an llm.c model file (fp32 or bf16, docs/FORMATS.md) and writes a directory that transformers'
AutoModelForCausalLM and AutoTokenizer load as they are: config.json, model.safetensors (fp32), GPT-2's
vocab.json and merges.txt (OpenAI's encoder.json and vocab.bpe) and tokenizer_config.json. from-hf reads a
transformers GPT-2 (a directory, or a hub name) and writes an llm.c model file (version 3, fp32) for
--init-from. The layouts differ: Conv1D weights are (in, out), ours (out, in); its wte has 50257 rows, ours
50304 (padding: dropped / added as zeros); it keeps one tensor per layer, we stack the L layers; both tie
the lm head to wte. Anything else (another architecture, vocabulary, activation, eps, an untied head) is a
one-line error. Outputs are written under a temporary name and renamed when complete, so a failed run
leaves an earlier output as it was; one is replaced only with --force, never one the conversion reads.
"""

import argparse
import errno
import hashlib
import json
import math
import os
import shutil
import stat
from types import SimpleNamespace

import numpy as np
import requests
from safetensors import SafetensorError, safe_open

# -----------------------------------------------------------------------------
# Constants

LN_EPS = 1e-5
# the tanh approximation of GELU, which the trainers compute, under transformers' two names for it
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")

# transformers' name inside block h.<l> of each of LAYER_NAMES; its Conv1D stores the 2-D ones transposed
HF_LAYER_NAMES = {
    "ln_1.w": "ln_1.weight", "ln_1.b": "ln_1.bias",
    "c_attn.w": "attn.c_attn.weight", "c_attn.b": "attn.c_attn.bias",
    "attn.c_proj.w": "attn.c_proj.weight", "attn.c_proj.b": "attn.c_proj.bias",
    "ln_2.w": "ln_2.weight", "ln_2.b": "ln_2.bias",
    "c_fc.w": "mlp.c_fc.weight", "c_fc.b": "mlp.c_fc.bias",
    "mlp.c_proj.w": "mlp.c_proj.weight", "mlp.c_proj.b": "mlp.c_proj.bias",
}

# What to-hf writes into its directory; an existing directory holding nothing else may be replaced
HF_FILES = ("config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json")
# the causal-mask buffers an old checkpoint's blocks carry besides the weights
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
HUB_FILES = ["config.json", "model.safetensors", "model.safetensors.index.json", "model-*.safetensors"]
FLOAT_DTYPES = ("F32", "F16", "F64", "BF16")
# to-hf's GPT-2 tokenizer files offline with no cache: the checkout's copies (tests/data/README.md)
COMMITTED_GPT2_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "data", "gpt2")
# a write that fails for want of room: a full disk, a full quota, a file-size limit reached
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def die_writing(path, e):
    """Stops with the one-line error of the OSError `e` met writing the output `path`."""
    if e.errno in NO_SPACE:
        die(f"cannot write {path}: no space left, the disk is full")
    die(f"cannot write {path}: " + (f"{e.filename}: " if e.filename else "") + (e.strerror or str(e)))


def temp_name(path, suffix="tmp"):
    """A temporary name beside `path`, to be renamed to it: short enough whatever the length of path's name."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f"{name[:200]}.{os.getpid()}.{suffix}")


def refuse_replacing_inputs(out, inputs, command):
    """Refuses an output `out` that is, or is a directory holding, a file the command reads (links followed)."""
    target = os.path.realpath(out)
    for path in inputs:
        if os.path.commonpath([os.path.realpath(path), target]) == target:
            die(f"-o {out} would replace {path}, which {command} reads: pick another -o")


# -----------------------------------------------------------------------------
# llm.c's GPT-2: names, shapes and model file header (the trainers' copies: tests/sync_copies.py)

def die(msg):
    """Stops the run with a one-line error (SystemExit prints it to stderr and exits 1, no traceback)."""
    raise SystemExit(f"error: {msg}")


def require_file(path, what):
    """Stops in one line unless `path` is a regular file (reading a FIFO would wait forever)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:  # absent, a link loop: convert_hf.py has no OSError boundary of its own
        die(f"{what} {path}: {e.strerror}")
    if not stat.S_ISREG(mode):
        found = next((os.path.join(path, f) for f in ("model.bin", "model.safetensors")
                      if os.path.isfile(os.path.join(path, f))), None)
        hint = f": a checkpoint directory; give its {found}, or --resume {path}" if found else ""
        die(f"{what} {path} is not a regular file{hint}")

VOCAB_SIZE = 50257         # GPT-2 BPE tokens; EOT is the last one
PADDED_VOCAB_SIZE = 50304  # wte rows: a multiple of 128 for fast matmuls; the extra rows stay zero
EOT = 50256
# llm.c's tensor order, as in its model file
PARAM_NAMES = ["wte", "wpe", "ln_1.w", "ln_1.b", "c_attn.w", "c_attn.b", "attn.c_proj.w",
               "attn.c_proj.b", "ln_2.w", "ln_2.b", "c_fc.w", "c_fc.b", "mlp.c_proj.w",
               "mlp.c_proj.b", "ln_f.w", "ln_f.b"]
LAYER_NAMES = PARAM_NAMES[2:-2]  # the per-layer tensors, stacked along a leading L axis
MODEL_MAGIC = 20240326


def gpt2_shapes(cfg):
    """{name: shape} of GPT-2's weights, in the order of llm.c's model file."""
    L, C, Vp, T = cfg.n_layer, cfg.n_embd, cfg.padded_vocab_size, cfg.block_size
    return {"wte": (Vp, C), "wpe": (T, C), "ln_1.w": (L, C), "ln_1.b": (L, C),
            "c_attn.w": (L, 3 * C, C), "c_attn.b": (L, 3 * C), "attn.c_proj.w": (L, C, C), "attn.c_proj.b": (L, C),
            "ln_2.w": (L, C), "ln_2.b": (L, C), "c_fc.w": (L, 4 * C, C), "c_fc.b": (L, 4 * C),
            "mlp.c_proj.w": (L, C, 4 * C), "mlp.c_proj.b": (L, C), "ln_f.w": (C,), "ln_f.b": (C,)}


def model_file_header(cfg):
    """The 256-int32 header of an fp32 (version 3) llm.c model file of cfg's shape."""
    header = np.zeros(256, dtype="<i4")
    header[:8] = [MODEL_MAGIC, 3, cfg.block_size, cfg.vocab_size,
                  cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.padded_vocab_size]
    return header


def read_model_header(path):
    """(header dict, version: 3 = fp32, 5 = bf16) of an llm.c model file, its header and size checked."""
    size = os.path.getsize(path)
    if size < 1024:
        die(f"model file {path} is truncated: {size} bytes, shorter than its 1024-byte header")
    h = np.fromfile(path, "<i4", count=256)
    if h[0] != MODEL_MAGIC:
        die(f"model file {path} has magic {h[0]}, expected {MODEL_MAGIC} (not an llm.c model file)")
    if h[1] not in (3, 5):
        die(f"model file {path} has version {h[1]}, expected 3 (fp32) or 5 (bf16)")
    header = dict(block_size=int(h[2]), vocab_size=int(h[3]), n_layer=int(h[4]), n_head=int(h[5]),
                  n_embd=int(h[6]), padded_vocab_size=int(h[7]))
    if min(header.values()) <= 0 or header["n_embd"] % header["n_head"]:
        die(f"model file {path} has an invalid header {header}")
    shapes = gpt2_shapes(SimpleNamespace(**header))
    expected = 1024 + (4 if h[1] == 3 else 2) * sum(math.prod(s) for s in shapes.values())
    if size != expected:
        cut = " (truncated)" if size < expected else ""
        die(f"model file {path} has {size} bytes, its header implies {expected}{cut}")
    return header, int(h[1])


# -----------------------------------------------------------------------------
# llm.c model files: 256 int32 of header, then the tensors in PARAM_NAMES order, fp32 or bf16

def is_speedrun_file(path):
    """True for a safetensors file of the speedrun model's tensors (embed.weight, blocks.*)."""
    try:
        with safe_open(path, "np") as f:
            names = set(f.keys())
    except (SafetensorError, OSError, ValueError):
        return False
    return "embed.weight" in names and any(k.startswith("blocks.") for k in names)


def map_model_file(path):
    """(header dict, version, {name: fp32 array}) of an llm.c model file of GPT-2's vocabulary."""
    require_file(path, "model file")
    if is_speedrun_file(path):
        die(f"model file {path} is a speedrun model (the trainers' --recipe speedrun): transformers has no "
            "such model (RMSNorm, rotary, ReLU^2, an untied soft-capped head), so to-hf converts GPT-2 only")
    header, version = read_model_header(path)
    if header["vocab_size"] != VOCAB_SIZE or header["padded_vocab_size"] < VOCAB_SIZE:
        die(f"model file {path} has a vocabulary of {header['vocab_size']} tokens padded to "
            f"{header['padded_vocab_size']}; GPT-2's is {VOCAB_SIZE}")
    shapes = gpt2_shapes(SimpleNamespace(**header))
    # fp32 tensors are read-only views of a memory map: a 1.5B model is not copied into memory at once
    data = np.memmap(path, dtype="<f4" if version == 3 else "<u2", mode="r", offset=1024)
    params, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        t = data[offset:offset + n]
        if version == 5:  # a bf16 value is the top half of the fp32 one
            t = (t.astype(np.uint32) << 16).view(np.float32)
        params[name] = t.reshape(shape)
        offset += n
    return header, version, params


def write_model_file_in_parts(path, cfg, tensors):
    """Writes an fp32 llm.c model file from (name, parts) in PARAM_NAMES order, under a temporary name."""
    # parts concatenated row-major make the tensor: a stacked tensor comes as its L layers, never copied whole
    assert [name for name, _ in tensors] == PARAM_NAMES
    tmp = temp_name(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        f = open(tmp, "wb")
    except OSError as e:
        die_writing(path, e)
    try:
        with f:
            f.write(model_file_header(cfg).tobytes())
            for _, parts in tensors:
                for part in parts:
                    # file.write, not ndarray.tofile: tofile's OSError on a full disk carries no errno
                    f.write(np.ascontiguousarray(part, dtype="<f4").data)
        os.replace(tmp, path)
    except OSError as e:
        if e.errno not in NO_SPACE:
            raise  # reading the source (from-hf reads a layer at a time) failed: not the output's error
        die_writing(path, e)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# -----------------------------------------------------------------------------
# Hugging Face directories: config.json and safetensors files

def read_hf_config(folder, source):
    """The shape (model file header keys) of the GPT-2 in `folder`, its config checked against the trainers'."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        die(f"{source} has no config.json (not a transformers model directory)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        die(f"{path} is not valid JSON ({e})")
    if not isinstance(config, dict):
        die(f"{path} is not a JSON object")
    if config.get("model_type") != "gpt2":
        die(f"{source} is a {config.get('model_type', 'model without model_type')} model "
            f"({', '.join(config.get('architectures') or ['no architectures'])}), not GPT-2")
    # a key an older config leaves out takes transformers' GPT-2 default
    V, T, L, H, C = (config.get(k, d) for k, d in (("vocab_size", VOCAB_SIZE), ("n_positions", 1024),
                                                   ("n_layer", 12), ("n_head", 12), ("n_embd", 768)))
    if V != VOCAB_SIZE:
        die(f"{source} has a vocabulary of {V} tokens; llm.c model files hold GPT-2's {VOCAB_SIZE}")
    if not all(isinstance(x, int) and x > 0 for x in (T, L, H, C)) or C % H:
        die(f"{source} has an invalid shape: n_positions {T}, n_layer {L}, n_head {H}, n_embd {C}")
    # what the trainers' GPT-2 fixes: the values that match it, the first transformers' default
    fixed = {"n_inner": (None, 4 * C), "activation_function": TANH_GELUS, "layer_norm_epsilon": (LN_EPS,),
             "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
             "add_cross_attention": (False,), "tie_word_embeddings": (True,)}
    for key, allowed in fixed.items():
        value = config.get(key, allowed[0])
        if value not in allowed:
            die(f"{source} is not GPT-2 as the trainers build it: config.json has {key} = {value!r}, "
                f"expected {' or '.join(map(repr, allowed))}")
    return SimpleNamespace(block_size=T, vocab_size=VOCAB_SIZE, n_layer=L, n_head=H, n_embd=C,
                           padded_vocab_size=PADDED_VOCAB_SIZE)


def hf_tensor_index(folder, source):
    """{name: (safetensors file, key, dtype, shape)} of the folder's tensors, in one file or in shards."""
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted({os.path.join(folder, v) for v in json.load(f)["weight_map"].values()})
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            die(f"{index} is not a safetensors index ({type(e).__name__}: {e})")
    else:
        die(f"{source} has no model.safetensors (a model saved only as pytorch_model.bin: load it with "
            f"transformers and save_pretrained it again)")
    entries = {}
    for path in files:
        try:
            with safe_open(path, framework="numpy") as f:
                for key in f.keys():
                    s = f.get_slice(key)
                    name = key.removeprefix("transformer.")  # a saved GPT2LMHeadModel's; OpenAI's lack it
                    if name in entries:
                        die(f"{source} holds tensor {name} twice")
                    entries[name] = (path, key, s.get_dtype(), tuple(s.get_shape()))
        except (SafetensorError, OSError) as e:
            die(f"{path} is not a readable safetensors file ({' '.join(str(e).split())})")
    return entries


def load_hf_tensor(entry):
    """One tensor of hf_tensor_index as an fp32 array; numpy has no bfloat16, so BF16 goes through torch."""
    path, key, dtype, _ = entry
    if dtype not in FLOAT_DTYPES:
        die(f"{path}: tensor {key} has dtype {dtype}, not a floating-point type")
    with safe_open(path, framework="pt" if dtype == "BF16" else "numpy") as f:
        t = f.get_tensor(key)
    return t.float().numpy() if dtype == "BF16" else t.astype(np.float32, copy=False)


def check_hf_tensors(entries, source, cfg):
    """Refuses tensors that are not exactly GPT-2's of cfg's shape: one missing, misshapen or extra."""
    T, C = cfg.block_size, cfg.n_embd
    expected = {"wte.weight": (VOCAB_SIZE, C), "wpe.weight": (T, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    shapes = gpt2_shapes(cfg)
    for ours in LAYER_NAMES:
        shape = shapes[ours][1:]
        for layer in range(cfg.n_layer):
            expected[f"h.{layer}.{HF_LAYER_NAMES[ours]}"] = shape[::-1]  # Conv1D: (in, out); 1-D unchanged
    for name, shape in expected.items():
        if name not in entries:
            die(f"{source} has no tensor {name} (not a complete GPT-2 of {cfg.n_layer} layers)")
        if entries[name][3] != shape:
            die(f"{source}: tensor {name} has shape {entries[name][3]}, expected {shape}")
    for name in entries:
        is_buffer = name.startswith("h.") and name.endswith(BUFFER_SUFFIXES)
        if name not in expected and not is_buffer and name != "lm_head.weight":
            die(f"{source} holds a tensor GPT-2 does not have: {name}")


# -----------------------------------------------------------------------------
# GPT-2's tokenizer files, cached or downloaded (tokenizer.py's copies, held equal by tests/test_copies.py)

GPT2_BASE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main"
GPT2_SHA256 = {  # the published files (the hashes tiktoken checks, too)
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


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


def gpt2_tokenizer_files(cache_dir):
    """{name transformers reads: path} of GPT-2's tokenizer files: cached, downloaded, else the checkout's."""
    files = {}
    for hf_name, name in (("vocab.json", "encoder.json"), ("merges.txt", "vocab.bpe")):
        try:
            files[hf_name] = fetch_gpt2_file(name, cache_dir)
        except OSError as e:
            committed = os.path.join(COMMITTED_GPT2_DIR, name)
            if not os.path.isfile(committed) or sha256_of(committed) != GPT2_SHA256[name]:
                die(f"GPT-2's tokenizer file {name}: {e}; and {committed} is missing or not the published file")
            print(f"GPT-2's {name} is neither cached nor downloadable: using {committed} (sha256 checked)")
            files[hf_name] = committed
    return files


# -----------------------------------------------------------------------------
# to-hf: llm.c model file -> transformers directory

def hf_config(header):
    """config.json of transformers' GPT2LMHeadModel for a model file's header."""
    # dropouts 0: the model was trained without, and fine-tuning in transformers would otherwise add 0.1
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": VOCAB_SIZE, "n_positions": header["block_size"], "n_embd": header["n_embd"],
        "n_layer": header["n_layer"], "n_head": header["n_head"], "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": LN_EPS,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": EOT, "eos_token_id": EOT, "dtype": "float32",
    }


def hf_state_dict(params, header):
    """{transformers name: fp32 array}: wte unpadded, one tensor per layer, Conv1D transposed, no lm_head."""
    out = {"transformer.wte.weight": params["wte"][:VOCAB_SIZE], "transformer.wpe.weight": params["wpe"],
           "transformer.ln_f.weight": params["ln_f.w"], "transformer.ln_f.bias": params["ln_f.b"]}
    for ours in LAYER_NAMES:
        for layer in range(header["n_layer"]):
            out[f"transformer.h.{layer}.{HF_LAYER_NAMES[ours]}"] = params[ours][layer].T  # 1-D: .T is itself
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def write_safetensors(path, tensors, metadata):
    """A safetensors file of fp32 arrays, laid out byte for byte as safetensors' save_file lays it out."""
    # not save_file, whose full disk is a SafetensorError with the errno only in its text, nor numpy.save,
    # whose bytes would be a second copy of the weights
    header, offset = {"__metadata__": metadata}, 0
    for name in sorted(tensors):
        t = tensors[name]
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name], dtype="<f4").data)


def output_dir_replaceable(out):
    """True where `out` is absent, empty, or holds only what to-hf writes (an earlier conversion)."""
    return not os.path.exists(out) or (os.path.isdir(out) and set(os.listdir(out)) <= set(HF_FILES))


def cmd_to_hf(args):
    out = os.path.normpath(args.out)  # "dir/" too: the temporary names below go beside it, not into it
    if os.path.basename(out) in ("", ".", ".."):
        die(f"-o {args.out!r}: give the name of the directory to write")
    refuse_replacing_inputs(out, [args.model], "to-hf")
    if not output_dir_replaceable(out):
        die(f"-o {args.out} exists and is not an earlier to-hf output: remove it or pick another")
    if os.path.exists(out) and os.listdir(out) and not args.force:
        die(f"-o {args.out} holds an earlier to-hf output: pass --force to replace it")
    header, version, params = map_model_file(args.model)
    tokenizer_files = gpt2_tokenizer_files(args.gpt2_dir)
    state = hf_state_dict(params, header)
    # GPT2Tokenizer's defaults are GPT-2's; the model's length makes transformers warn of longer inputs
    tokenizer_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": header["block_size"]}
    # assembled beside its final name, then renamed into place; an earlier output is moved aside, then removed
    tmp, old = temp_name(out), temp_name(out, "old")
    try:
        os.makedirs(tmp)
        for name, config in (("config.json", hf_config(header)), ("tokenizer_config.json", tokenizer_config)):
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2)
        for name, src in tokenizer_files.items():
            shutil.copyfile(src, os.path.join(tmp, name))
        # "format": "pt" is the metadata transformers expects of a PyTorch checkpoint
        write_safetensors(os.path.join(tmp, "model.safetensors"), state, {"format": "pt"})
        if os.path.exists(out):
            os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        die_writing(out, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = sum(t.size for t in state.values())
    print(f"wrote {out}: GPT-2 L{header['n_layer']} H{header['n_head']} C{header['n_embd']}, max T "
          f"{header['block_size']}, {n:,} parameters (fp32), from {args.model} (version {version})")


# -----------------------------------------------------------------------------
# from-hf: transformers directory or hub name -> llm.c model file

def resolve_source(source):
    """A local directory as it is; else a hub name, its config and weights downloaded (or in the cache)."""
    if os.path.isdir(source):
        return source
    if os.path.exists(source):
        die(f"{source} is a file; from-hf takes a transformers model directory or a hub name")
    import huggingface_hub  # only here: local conversions do without it

    try:
        return huggingface_hub.snapshot_download(source, allow_patterns=HUB_FILES)
    except (OSError, ValueError) as e:  # hub HTTP errors and a missing cache entry are OSErrors
        die(f"{source} is not a local directory, and the Hugging Face hub did not provide it: "
            f"{type(e).__name__}: {' '.join(str(e).split())}")


def cmd_from_hf(args):
    if not os.path.basename(args.out):
        die(f"-o {args.out!r}: give the name of the model file to write")
    if os.path.isdir(args.out):
        die(f"-o {args.out} is a directory; from-hf writes a model file")
    if os.path.exists(args.out) and not args.force:
        die(f"-o {args.out} exists: pass --force to replace it")
    folder = resolve_source(args.source)
    cfg = read_hf_config(folder, args.source)
    entries = hf_tensor_index(folder, args.source)
    read = [os.path.join(folder, name) for name in ("config.json", "model.safetensors.index.json")]
    read = [p for p in read if os.path.exists(p)] + [entry[0] for entry in entries.values()]
    refuse_replacing_inputs(args.out, read, "from-hf")
    check_hf_tensors(entries, args.source, cfg)
    load = lambda name: load_hf_tensor(entries[name])  # noqa: E731

    def layers(hf):  # one layer at a time, read while the file is written (a 1.5B model is 6 GB)
        for layer in range(cfg.n_layer):
            yield load(f"h.{layer}.{hf}").T

    wte = load("wte.weight")
    if "lm_head.weight" in entries and not np.array_equal(load("lm_head.weight"), wte):
        die(f"{args.source} has an lm head that differs from wte; llm.c models tie the two")
    pad = np.zeros((PADDED_VOCAB_SIZE - VOCAB_SIZE, cfg.n_embd), np.float32)
    tensors = [("wte", [wte, pad]), ("wpe", [load("wpe.weight")])]
    tensors += [(ours, layers(HF_LAYER_NAMES[ours])) for ours in LAYER_NAMES]
    tensors += [("ln_f.w", [load("ln_f.weight")]), ("ln_f.b", [load("ln_f.bias")])]
    write_model_file_in_parts(args.out, cfg, tensors)
    n = sum(int(np.prod(shape)) for shape in gpt2_shapes(cfg).values())
    print(f"wrote {args.out}: GPT-2 L{cfg.n_layer} H{cfg.n_head} C{cfg.n_embd}, max T {cfg.block_size}, "
          f"{n:,} parameters with the padded vocabulary (fp32, version 3), from {args.source}")


# -----------------------------------------------------------------------------
# Command line

class OneLineErrorParser(argparse.ArgumentParser):
    """A parser whose errors are one line, as in the trainers (its subcommands' parsers are of this class)."""

    def error(self, message):
        die(message)


def parse_args(argv=None):
    p = OneLineErrorParser(description="Convert GPT-2 between llm.c model files and Hugging Face transformers.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("to-hf", help="llm.c model file -> transformers directory (config, weights, tokenizer)")
    t.add_argument("model", help="llm.c model file (version 3 fp32 or 5 bf16), e.g. a checkpoint's model.bin")
    t.add_argument("-o", "--out", required=True, help="directory to write (an earlier to-hf output there is "
                   "replaced with --force; one holding anything else is refused)")
    t.add_argument("--force", action="store_true", help="replace -o where it holds an earlier to-hf output "
                   "(default: refuse; never a directory holding other files or the model file read)")
    t.add_argument("--gpt2-dir", help="folder of GPT-2's encoder.json and vocab.bpe, downloaded there if missing, "
                   "offline the checkout's tests/data/gpt2 (default: $GPT2_BPE_DIR or data/gpt2)")
    f = sub.add_parser("from-hf", help="transformers GPT-2 (directory or hub name) -> llm.c model file")
    f.add_argument("source", help="local transformers directory, or a hub name such as gpt2, gpt2-medium, "
                   "gpt2-large, gpt2-xl (downloaded with huggingface_hub)")
    f.add_argument("-o", "--out", required=True, help="llm.c model file to write (version 3, fp32)")
    f.add_argument("--force", action="store_true", help="replace an existing -o (default: refuse; never a "
                   "file the conversion reads)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    {"to-hf": cmd_to_hf, "from-hf": cmd_from_hf}[args.command](args)


if __name__ == "__main__":
    main()
