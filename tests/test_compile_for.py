"""--compile-for: backend triton's kernels compiled for a GPU that is not there. The interpreter runs programs
that the compiler rejects, and knows nothing of shared memory: a step's kernels compiled for the H100 catch both."""
import train_gpt2_triton as tg
from conftest import assert_refused, run_script

SMALL = ["--n-layer", "1", "--n-head", "1", "--n-embd", "64", "--seq-len", "64", "--batch-size", "2",
         "--total-batch-size", "128"]


def test_a_gpt2_step_compiles_for_the_h100():
    """Every kernel and config that a small GPT-2 step and an evaluation launch compiles for sm_90 in bf16
    (TRITON_INTERPRET off: compiled, not interpreted), each within the H100's shared memory."""
    proc = run_script("train_gpt2_triton.py", "triton", "--compile-for", "sm_90", "--dtype", "bf16", *SMALL,
                      env={"TRITON_INTERPRET": "0"})
    rows = [line.split() for line in proc.stdout.splitlines()[2:-1]]
    assert {"matmul_kernel", "matmul_dw_kernel", "attn_fwd_kernel", "attn_bwd_dq_kernel", "_crossentropy_kernel",
            "_encoder_wte_backward_kernel", "_adamw_kernel"} <= {row[0] for row in rows}, proc.stdout
    assert any("TMA=1" in row for row in rows), "sm_90's matmul configs include the descriptor (TMA) path"
    assert proc.stdout.splitlines()[-1].startswith("--compile-for sm_90: compiled "), proc.stdout[-2000:]


def test_compile_for_refuses_the_interpreter_and_backend_torch():
    """--compile-for compiles backend triton's kernels: under TRITON_INTERPRET=1 (as here) or with backend torch it
    stops with one line."""
    assert_refused(tg.main, [(["triton", "--compile-for", "sm_90"], "TRITON_INTERPRET"),
                             (["torch", "--compile-for", "sm_86"], "backend triton")])
