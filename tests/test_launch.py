"""train_gpt2_jax.py's launch of several processes: the coordinator, process count and rank are checked
before jax.distributed starts, and a coordinator that does not answer ends, after --coordinator-timeout,
in one line saying what to check instead of a silent wait and a C++ abort."""
import socket
import time

import pytest

import train_gpt2_jax as tj
from conftest import assert_clean_error, free_port, run_script

TINY = ["--data", "synthetic", "--n-layer", 1, "--n-head", 2, "--n-embd", 32, "--seq-len", 16,
        "--batch-size", 2, "--total-batch-size", 32, "--steps", 1, "--val-every", 0, "--hellaswag-every", 0,
        "--sample-every", 0, "--ckpt-every", 0]
CPU = {"JAX_PLATFORMS": "cpu"}
WAITING = "waiting up to"


def run_trainer(tmp_path, *flags, timeout):
    return run_script("train_gpt2_jax.py", *TINY, "--out-dir", tmp_path / "out", *flags, env=CPU,
                      timeout=timeout, check=False)


@pytest.mark.parametrize("flags, needles", [
    (["--coordinator", "localhost", "--num-processes", 2, "--process-id", 1],
     ["--coordinator 'localhost'", "HOST:PORT"]),
    (["--coordinator", "::1:1234", "--num-processes", 2, "--process-id", 1],
     ["--coordinator '::1:1234'", "[brackets]"]),
    (["--coordinator", "localhost:abc", "--num-processes", 2, "--process-id", 1],
     ["--coordinator 'localhost:abc'", "1-65535"]),
    (["--coordinator", "localhost:99999", "--num-processes", 2, "--process-id", 1],
     ["--coordinator 'localhost:99999'", "1-65535"]),
    (["--process-id", 1], ["--process-id 1", "needs --num-processes"]),
    (["--num-processes", 2, "--process-id", 2, "--coordinator", "localhost:1234"],
     ["--process-id 2", "[0, 2)"]),
    (["--coordinator-timeout", 0], ["--coordinator-timeout 0", "positive"]),
], ids=["no-port", "ipv6-unbracketed", "port-not-a-number", "port-above-65535", "rank-without-count",
        "rank-out-of-range", "timeout-zero"])
def test_bad_launch_flags_stop_before_joining(tmp_path, flags, needles, capsys):
    """Each bad flag ends in one line naming the flag and its value, before the process waits for anyone
    (today: an IndexError traceback, a segfault, a silent hang, or a run that ignores the rank). Run here:
    nothing reaches jax.distributed."""
    with pytest.raises(SystemExit) as e:
        tj.main([*map(str, TINY), "--out-dir", str(tmp_path / "out"), *map(str, flags)])
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message
    assert all(needle in message for needle in needles), message
    assert WAITING not in capsys.readouterr().out and not (tmp_path / "out").exists()


def test_coordinator_that_never_answers(tmp_path):
    """Process 1 of 2 with nobody listening at the coordinator's port says what it waits for, then after
    --coordinator-timeout ends with one line that names the address and what to check, not jax's C++ abort
    after its own 300 s."""
    address = f"localhost:{free_port()}"
    start = time.monotonic()
    proc = run_trainer(tmp_path, "--coordinator", address, "--num-processes", 2, "--process-id", 1,
                       "--coordinator-timeout", 5, timeout=60)
    elapsed = time.monotonic() - start
    waiting = [line for line in proc.stdout.splitlines() if WAITING in line]
    assert waiting == [f"process 1 of 2: {WAITING} 5 s for the coordinator at {address} (process 0 must "
                       "start too)"], proc.stdout
    assert_clean_error(proc, "did not all join within 5 s", "--coordinator-timeout", address, "firewall",
                       "--num-processes 2")
    assert proc.returncode == 1 and "Check failure" not in proc.stderr, proc.stderr[-2000:]
    assert 5 <= elapsed < 60


def test_process_0_port_taken(tmp_path):
    """Process 0 whose coordinator port another program listens on stops at once with one line naming the
    port (today jax either raises, a traceback, or segfaults)."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = run_trainer(tmp_path, "--coordinator", f"127.0.0.1:{port}", "--num-processes", 2,
                           "--process-id", 0, "--coordinator-timeout", 30, timeout=45)
    assert_clean_error(proc, f"--coordinator 127.0.0.1:{port}", f"cannot listen on port {port}")
    assert WAITING not in proc.stdout
