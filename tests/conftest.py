"""Fixtures shared by every test file: paths to the committed test data (tests/data), a runner for the
scripts, tiny llm.c shards and model files built independently of the trainers, a local HTTP server
for download tests, and the `quick` marker of the tests in the quick tier (test_parity.py --quick)."""
import http.server
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from test_parity import DATA, configure_environment  # noqa: E402  (sets TRITON_INTERPRET first)

configure_environment()

EOT = 50256


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: in the quick tier (python test_parity.py --quick), which runs "
                            "every script once: each GPT-2 trainer with each recipe (Triton's with both "
                            "backends), and every other script")


# the files with the most seconds of tests (on 2 cores, 2026-12-07), run first: test_parity.py's two workers,
# each taking a file at a time, then end together, where a long file taken last would run on alone
LONGEST_FIRST = ("test_trainers.py", "test_standalone.py", "test_cross.py", "test_zero.py", "test_runs_are_safe.py",
                 "test_readme.py", "test_aiayn.py", "test_triton.py", "test_jax_sharded.py", "test_compile_for.py",
                 "test_speedrun_jax.py", "test_speedrun_triton.py", "test_recompute_jax.py")


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: a file's own order kept


# no network for a script: a proxy nobody listens on (tiktoken downloads through requests)
OFFLINE = {"https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "http_proxy":
           "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "no_proxy": "", "NO_PROXY": ""}


def data_file(rel):
    """Path of `rel` under tests/data (e.g. "tinyshakespeare/input.txt"); a missing one fails the test with
    a message naming it, never skips it."""
    path = os.path.join(DATA, rel)
    if not os.path.exists(path):
        pytest.fail(f"test data missing: {path} (tests/data/README.md lists the committed files)",
                    pytrace=False)
    return path


def run_script(*args, cwd=None, env=None, timeout=600, check=True):
    """Runs `python <args>` from the repository root; on an unexpected exit code, fails with its output."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"`python {' '.join(map(str, args))}` exited {proc.returncode}\n"
                    f"--- stdout (tail) ---\n{proc.stdout[-3000:]}\n--- stderr (tail) ---\n"
                    f"{proc.stderr[-3000:]}", pytrace=False)
    return proc


def signal_after_line(args, line, delay, signum, env=None, timeout=300):
    """(exit code, stdout and stderr) of `python <args>` sent `signum` `delay` s after it prints a line (to
    either) holding `line`."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        before = next((x for x in proc.stdout if line in x), "")
        time.sleep(delay)
        proc.send_signal(signum)
        output = proc.communicate(timeout=timeout)[0]
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, before + output


def run_with_terminal_stderr(*args, env=None, timeout=600):
    """Runs `python <args>` from the repository root with stderr on a pseudo-terminal, as in an interactive
    shell, and stdout on a pipe; returns (exit code, stdout, everything the terminal received)."""
    import fcntl
    import pty
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 24 x 120, as a window
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    received = []

    def drain():  # the terminal's buffer is small: read it while the script runs, until it closes (EIO)
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            received.append(chunk)
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
        reader.join(timeout=10)
        os.close(master)
    return proc.returncode, stdout, b"".join(received).decode("utf-8", errors="replace")


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now: for the multi-process runs' coordinator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_clean_error(proc, *needles):
    """A bad-input run: non-zero exit, one-line error naming the problem, no traceback."""
    assert proc.returncode != 0, f"expected a failure, got exit 0\n{proc.stdout[-2000:]}"
    err = proc.stderr.strip()
    assert "Traceback" not in err, f"traceback instead of a clean error:\n{err[-3000:]}"
    last = err.splitlines()[-1] if err else ""
    for needle in needles:
        assert needle.lower() in last.lower(), f"error line {last!r} does not mention {needle!r}"


def assert_refused(main, cases):
    """In-process bad input: each (argv, *needles) of cases makes main(argv) stop with one line, "error: ",
    that names every needle."""
    for argv, *needles in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        message = str(e.value)
        assert message.startswith("error: ") and "\n" not in message, (argv, message)
        assert all(n in message for n in needles), (message, needles)


def read_log(out_dir, starts=False):
    """The events of <out_dir>/log.jsonl, in order: its steps and evaluations, and with `starts` also the
    start event that each launch logs first."""
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        events = [json.loads(line) for line in f if line.strip()]
    return [e for e in events if starts or e.get("event") != "start"]


def step_events(out_dir):
    return [e for e in read_log(out_dir) if "train_loss" in e]


def train_losses(out_dir):
    """The train loss of each step a run logged, in order."""
    return [e["train_loss"] for e in step_events(out_dir)]


def stop_by_signals_and_resume(argv, first, out, env):
    """Runs a trainer (`argv`: the script, then its flags with `--out-dir out`; `first`: the flags of the
    first launch only, its init) as a user's interrupted run goes: SIGINT just after step 2 is logged, then
    --resume auto with SIGTERM just after step 4, then --resume auto to the end (tests/signal_at_step.py
    delivers them). Each stop is checked: the step the signal landed in finishes, its checkpoint is written
    and said, one line names the signal, exit 128 + its number, no traceback. Returns the run's step events,
    for the caller to compare with an uninterrupted run's."""
    import signal
    stops = [(2, "SIGINT", [*first]), (4, "SIGTERM", ["--resume", "auto"])]
    for at, name, extra in stops:
        proc = run_script("tests/signal_at_step.py", at, name, *argv, *extra, env=env, check=False)
        assert proc.returncode == 128 + getattr(signal, name), proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(f"{name}: stopped after step {at + 1} of "), \
            proc.stderr[-3000:]
        assert f"saved {out / f'ckpt_{at + 1:07d}'}" in proc.stdout
    run_script(*argv, "--resume", "auto", env=env)
    return step_events(out)


def assert_same_step_values(got, expected):
    """The logged train losses, grad norms and lrs of two runs' steps, bit for bit."""
    keys = ("step", "train_loss", "grad_norm", "lr")
    assert [[e[k] for k in keys] for e in got] == [[e[k] for k in keys] for e in expected]


def allocated_bytes(tree):
    """Bytes of the distinct storages behind the torch tensors anywhere in a nest of dicts, lists and tuples
    (what a trainer's make_state allocates, against its device_state_bytes)."""
    import torch
    storages = {}

    def walk(x):
        if isinstance(x, torch.Tensor):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            for item in x.values():
                walk(item)
        elif isinstance(x, (list, tuple)):
            for item in x:
                walk(item)
    walk(tree)
    return sum(storages.values())


def speedrun_random_weights(shapes, seed):
    """{name: fp32 array} of the speedrun model's shapes with every tensor random and nonzero, at about the
    scale training gives them: unlike the recipe's init (the head and projections zero), every weight gets
    a gradient at the first step."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, shape in shapes.items():
        std = 1.0 if k == "embed.weight" else 0.1 if len(shape) == 1 else 0.5 / math.sqrt(shape[-1])
        out[k] = (rng.standard_normal(shape) * std + (1.0 if k.endswith("gains") else 0.0)).astype(np.float32)
    return out


# the keys of a step's log.jsonl event (evaluations add val_loss, hellaswag_acc, hellaswag_acc_norm), as
# docs/FORMATS.md ("What a run prints and logs") gives them
STEP_KEYS = {"step", "train_loss", "grad_norm", "lr", "dt_ms", "tokens_per_s", "mfu", "peak_mem_gb",
             "framework"}
EVAL_KEYS = {"val_loss", "hellaswag_acc", "hellaswag_acc_norm"}


def assert_due_events(out, stdout, steps):
    """A run of `steps` steps with --val-every 3, --ckpt-every 3 and HellaSwag and sampling at the end:
    validation at step 3 and the last, its loss falling; one HellaSwag; 4 samples printed; log.jsonl with
    the documented keys only; the two checkpoints and the log in the out dir, nothing else."""
    log = read_log(out)
    vals = [e for e in log if "val_loss" in e]
    swag = [e for e in log if "hellaswag_acc" in e]
    assert [e["step"] for e in vals] == [3, steps] and vals[1]["val_loss"] < vals[0]["val_loss"]
    assert len(swag) == 1 and swag[0]["step"] == steps
    assert all(set(e) <= STEP_KEYS | EVAL_KEYS for e in log)
    assert sum(line.startswith("sample ") for line in stdout.splitlines()) == 4
    assert sorted(os.listdir(out)) == ["ckpt_0000003", f"ckpt_{steps:07d}", "log.jsonl"]


def step_lines(stdout):
    """The per-step lines a trainer printed ("step N/STEPS | ..."), as their step, loss, grad norm and lr
    fields."""
    return [line.split(" | ")[:4] for line in stdout.splitlines()
            if re.match(r"step +\d+/", line)]


def assert_same_checkpoint(a, b):
    """Two checkpoint dirs hold byte-identical weights and the same AdamW moments, step, data position
    and RNG state (everything in state.npz but the config, which names the run's own paths, and the
    time_spent that was measured)."""
    assert (a / "model.bin").read_bytes() == (b / "model.bin").read_bytes()
    with np.load(a / "state.npz") as x, np.load(b / "state.npz") as y:
        assert x.files == y.files
        for key in x.files:
            if key not in ("config", "time_spent"):
                np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def assert_eval_only_repeats(run_dir, eval_dir, step):
    """An --eval-only run logged, at the checkpoint's step and nothing else, the val loss and HellaSwag
    scores that the training run logged there."""
    log = read_log(eval_dir)
    original = {k: e[k] for e in read_log(run_dir) if e["step"] == step for k in EVAL_KEYS if k in e}
    assert len(original) == 3, original
    assert len(log) == 2 and all(e["step"] == step for e in log)
    assert {k: e[k] for e in log for k in original if k in e} == original


# -----------------------------------------------------------------------------
# Token shards and model files, written here with plain numpy (independently of the trainers' code)

def write_shard(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240520, 1, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


def write_bad_shards(folder):
    """Creates folder with magic_train_000001.bin (magic 12345) and short_train_000001.bin (a good header
    that promises 5,000 tokens, cut at 3,000 bytes) beside the good x_train_000001.bin; returns folder."""
    folder.mkdir()
    write_shard(folder / "x_train_000001.bin", np.arange(5000) % 50257)
    good = (folder / "x_train_000001.bin").read_bytes()
    (folder / "magic_train_000001.bin").write_bytes(np.int32(12345).tobytes() + good[4:])
    (folder / "short_train_000001.bin").write_bytes(good[:3000])
    return folder


def write_model_file(path, params, block_size, n_layer, n_head, n_embd, vocab=50257, padded=50304,
                     bf16=False):
    """fp32 (version 3), or with bf16=True version 5: each fp32 value's top 16 bits (exact for values that
    are bf16 numbers already)."""
    header = np.zeros(256, dtype="<i4")
    header[:8] = [20240326, 5 if bf16 else 3, block_size, vocab, n_layer, n_head, n_embd, padded]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for t in params:
            t = np.asarray(t, dtype="<f4")
            f.write((t.view("<u4") >> 16).astype("<u2").tobytes() if bf16 else t.tobytes())


def tiny_params(seed, block_size=64, n_layer=2, n_head=4, n_embd=64, padded=50304, vocab=50257):
    """GPT-2 init (docs/FORMATS.md, The model) of a tiny model, as the list of tensors in llm.c file order."""
    rng = np.random.default_rng(seed)
    L, C = n_layer, n_embd
    normal = lambda shape, std: (rng.standard_normal(shape) * std).astype(np.float32)  # noqa: E731
    resid = 0.02 / math.sqrt(2 * L)
    wte = normal((padded, C), 0.02)
    wte[vocab:] = 0.0
    return [wte, normal((block_size, C), 0.02),
            np.ones((L, C), np.float32), np.zeros((L, C), np.float32),
            normal((L, 3 * C, C), 0.02), np.zeros((L, 3 * C), np.float32),
            normal((L, C, C), resid), np.zeros((L, C), np.float32),
            np.ones((L, C), np.float32), np.zeros((L, C), np.float32),
            normal((L, 4 * C, C), 0.02), np.zeros((L, 4 * C), np.float32),
            normal((L, C, 4 * C), resid), np.zeros((L, C), np.float32),
            np.ones(C, np.float32), np.zeros(C, np.float32)]


@pytest.fixture
def one_thread():
    """The in-process runs of a test use one torch intra-op thread, as the scripts the tests start with
    OMP_NUM_THREADS=1 do: the tiny models gain nothing from more, and on a busy 2-core machine the threads
    of concurrent runs slow each other down several times over."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def shakespeare_tokens():
    """tinyshakespeare as GPT-2 tokens, one document per blank-line-separated passage, EOT before each."""
    import tiktoken
    text = open(data_file("tinyshakespeare/input.txt"), encoding="utf-8").read()
    enc = tiktoken.get_encoding("gpt2")
    docs = [d for d in text.split("\n\n") if d]
    out = []
    for ids in enc.encode_ordinary_batch(docs):
        out.append(EOT)
        out.extend(ids)
    return np.array(out, dtype=np.uint16)


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory, shakespeare_tokens):
    """A data dir with tiny_val_000000.bin (first 32,768 tokens) and tiny_train_000001.bin (the rest)."""
    d = tmp_path_factory.mktemp("shards")
    write_shard(d / "tiny_val_000000.bin", shakespeare_tokens[:32768])
    write_shard(d / "tiny_train_000001.bin", shakespeare_tokens[32768:])
    return d


@pytest.fixture(scope="session")
def tiny_model_file(tmp_path_factory):
    """An fp32 llm.c model file of a tiny GPT-2 (L2 H4 C64, max T 64), random GPT-2 init."""
    path = tmp_path_factory.mktemp("model") / "tiny_l2h4c64.bin"
    write_model_file(path, tiny_params(seed=0), block_size=64, n_layer=2, n_head=4, n_embd=64)
    return path


@pytest.fixture(scope="session")
def speedrun_reference_losses(tiny_shards):
    """losses(model_file) -> the per-step mean losses of tests/speedrun_reference.py's float64 run that the
    speedrun tests hold each trainer to (6 steps of 2 micro-batches of 1 x 32 tokens of tiny_shards' train
    shard) from that speedrun model file: run once per test process for each distinct set of weights (the
    trainers' tests start from the same inits), a few seconds each."""
    import hashlib
    import speedrun_reference
    from safetensors.numpy import load_file
    done = {}

    def losses(path):
        tensors = load_file(str(path))
        key = hashlib.sha256(b"".join(k.encode() + np.asarray(tensors[k], np.float32).tobytes()
                                      for k in sorted(tensors))).hexdigest()
        if key not in done:
            done[key] = speedrun_reference.train(path, [tiny_shards / "tiny_train_000001.bin"], 1, 32, 64, 6)
        return done[key]
    return losses


# --fp8-head's runs: 3 steps of 1 x 32 tokens of tiny_shards from speedrun_random_weights (seed 1), L2 C128,
# fp32, whose every tensor moves from the first step (from the recipe's init, the zero head quantizes to
# zeros and the first step is the unquantized one's).
FP8_RUN = dict(n_layer=2, n_embd=128, seq_len=32, batch_size=1, total_batch_size=32, steps=3)
# The trainers' fp32 losses against the float64 reference with the same FP8 head, per step, relative. The
# casts are deterministic, but an operand that fp32 and float64 compute a rounding apart can land on either
# side of a float8 rounding midpoint, a step of 1/16 (e4m3) or 1/8 (e5m2) of its value; measured: at most
# 2.3e-7 (torchfunc at step 3; JAX and the Triton trainer 8.3e-8). The FP8 head moves the reference's own
# loss by 3.9e-4, 3.0e-4 and 5.0e-4 at steps 1-3: 300x this tolerance or more.
FP8_REFERENCE_RTOL = 1e-6


def fp8_flags(shards, out, init):
    """The flags of an FP8_RUN of a trainer from model file init, on shards, into out (after the backend)."""
    flags = ["--recipe", "speedrun", "--fp8-head", "--dtype", "fp32", "--val-every", "0", "--hellaswag-every",
             "0", "--sample-every", "0", "--ckpt-every", "0", "--data", str(shards), "--out-dir", str(out),
             "--init-from", str(init)]
    return flags + [a for k, v in FP8_RUN.items() for a in ("--" + k.replace("_", "-"), str(v))]


@pytest.fixture(scope="session")
def fp8_reference(tiny_shards, tmp_path_factory):
    """(init model file, per-step losses) of tests/speedrun_reference.py's float64 FP8_RUN with the FP8 head
    (~2 s of CPU), from speedrun_random_weights (seed 1), written as the trainers write it."""
    import speedrun_reference
    from train_gpt2_jax import speedrun_shapes, write_speedrun_file
    from types import SimpleNamespace
    cfg = SimpleNamespace(n_layer=FP8_RUN["n_layer"], n_embd=FP8_RUN["n_embd"], padded_vocab_size=50304)
    init = tmp_path_factory.mktemp("fp8") / "random_init.safetensors"
    write_speedrun_file(str(init), speedrun_random_weights(speedrun_shapes(cfg), 1), cfg)
    run = FP8_RUN
    losses = speedrun_reference.train(init, [tiny_shards / "tiny_train_000001.bin"], run["batch_size"],
                                      run["seq_len"], run["total_batch_size"], run["steps"], fp8_head=True)
    return init, losses


@pytest.fixture(scope="session")
def hellaswag_dir(tmp_path_factory):
    """A HellaSwag cache dir holding the 10 real validation examples as hellaswag_val.jsonl."""
    d = tmp_path_factory.mktemp("hellaswag")
    shutil.copy(data_file("hellaswag/hellaswag_val_first10.jsonl"), d / "hellaswag_val.jsonl")
    return d


# -----------------------------------------------------------------------------
# A local HTTP server (127.0.0.1 only) with byte ranges and injected faults, for download tests

class LocalServer:
    """Serves `root` on 127.0.0.1. `cut_once[name] = n` makes the next GET of `name` send only n bytes of
    its body and drop the connection; `fail_once[name] = code` answers the next GET with that status;
    `headers[name] = {...}` adds headers to every response for `name` (an ETag with a checksum, say);
    `requests` records (method, path, Range header) of every request."""

    def __init__(self, root):
        self.root, self.cut_once, self.fail_once, self.requests = str(root), {}, {}, []
        self.headers = {}
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _serve(self, body):
                name = self.path.split("?")[0].lstrip("/")
                rng = self.headers.get("Range")
                server.requests.append((self.command, name, rng))
                path = os.path.join(server.root, name)
                if body and name in server.fail_once:
                    code = server.fail_once.pop(name)
                    self.send_response(code)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if not os.path.isfile(path):
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = open(path, "rb").read()
                start = 0
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.send_header("Accept-Ranges", "bytes")
                for key, value in server.headers.get(name, {}).items():
                    self.send_header(key, value)
                self.end_headers()
                if not body:
                    return
                payload = data[start:]
                cut = server.cut_once.pop(name, None) if body else None
                if cut is not None:
                    self.wfile.write(payload[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(payload)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def http_server(tmp_path):
    """A LocalServer over a fresh directory (tmp_path/'www'); files put there are served at server.url."""
    root = tmp_path / "www"
    root.mkdir()
    server = LocalServer(root)
    yield server
    server.close()


def run_script_on_a_full_disk(limit, *args, env=None, timeout=600):
    """Runs `python <args>` as run_script(check=False) does, with every file the script writes limited to
    `limit` bytes (RLIMIT_FSIZE): a write past it fails with EFBIG, as one to a full disk fails with ENOSPC
    (Python ignores the SIGXFSZ that would otherwise kill it), reliably and on any file system."""
    import resource
    import warnings
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    # JAX warns of any fork in its multithreaded process; between this fork and the exec the child only
    # calls setrlimit, which takes no lock another thread could hold
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
        return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=full_env, capture_output=True,
                              text=True, timeout=timeout,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
