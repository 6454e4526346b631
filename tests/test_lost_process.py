"""A lost process in a two-process run: when one process is killed mid-run, the survivor (in every GPT-2
trainer: the torch ones over gloo, JAX over jax.distributed on the CPU) exits non-zero within seconds with
one last line that names the lost process and says that `--resume auto` continues the run; before, a gloo
"Connection closed by peer" traceback, or in JAX a JaxRuntimeError, a 90 s wait and a C++ abort."""
import os
import subprocess
import sys

import pytest

from conftest import REPO, assert_clean_error, free_port

TINY = ["--data", "synthetic", "--n-layer", 1, "--n-head", 2, "--n-embd", 32, "--seq-len", 16,
        "--batch-size", 2, "--total-batch-size", 64, "--steps", 100000, "--val-every", 0, "--hellaswag-every", 0,
        "--sample-every", 0, "--ckpt-every", 0]
ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
SURVIVOR_SECONDS = 30  # the census waits 5 s for silent processes; the rest is slack for a loaded CI machine


def launch(trainer, rank, port, out):
    """Process `rank` of 2 of a run that would train for hours, as torchrun (torch) or --coordinator (JAX)
    would start it."""
    env = dict(os.environ, **ENV)
    if trainer[0] == "train_gpt2_jax.py":
        flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", 2, "--process-id", rank]
    else:
        flags = []
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args = [*trainer, *TINY, *flags, "--out-dir", out]
    return subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("trainer, lost", [
    (["train_gpt2_torchfunc.py"], 1), (["train_gpt2_triton.py", "torch"], 0), (["train_gpt2_jax.py"], 1),
], ids=["torchfunc", "triton-loses-process-0", "jax"])
def test_survivor_names_the_lost_process(tmp_path, trainer, lost):
    """Kill one process once both train; the other's last line names it and `--resume auto`, exit 1, within
    SURVIVOR_SECONDS. The triton case kills process 0, which holds the torch run's store: the survivor
    says the store is gone. (JAX's process 0 hosts its coordinator, whose loss jax's runtime handles by
    ending the others itself, so JAX loses process 1.)"""
    port = free_port()
    procs = [launch(trainer, rank, port, tmp_path / f"out{rank}") for rank in range(2)]
    try:
        survivor = procs[1 - lost]
        seen = []
        for line in procs[0].stdout:  # process 0 prints the step lines; step 2 means both are in the loop
            seen.append(line)
            if line.startswith("step     2/"):
                break
        else:
            pytest.fail("".join(seen))
        procs[lost].kill()
        out, _ = survivor.communicate(timeout=SURVIVOR_SECONDS)  # or TimeoutExpired fails the test
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    last = out.strip().splitlines()[-1]
    assert survivor.returncode == 1, out
    assert last.startswith(f"error: lost process {lost}") and "of 2" in last and "--resume auto" in last, out
    assert (lost == 0) == ("store is gone" in last), last


@pytest.mark.parametrize("trainer, port", [(["train_gpt2_torchfunc.py"], None),
                                           (["train_gpt2_triton.py", "torch"], "70000")],
                         ids=["torchfunc-no-address", "triton-port-above-65535"])
def test_torch_launch_without_a_usable_master_address(tmp_path, trainer, port):
    """$WORLD_SIZE > 1 without $MASTER_ADDR / $MASTER_PORT (a torchrun launch done by hand), or with a port
    above 65535, is one line naming them, before anything waits for a peer (before: torch's env://
    ValueError traceback)."""
    env = dict(os.environ, **ENV, RANK="0", WORLD_SIZE="2")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    if port:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    proc = subprocess.run([sys.executable, *map(str, [*trainer, *TINY, "--out-dir", tmp_path / "out"])],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert_clean_error(proc, "$MASTER_ADDR", "torchrun", *([f"'{port}'", "1-65535"] if port else []))
