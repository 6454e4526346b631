"""A forker's cut: each GPT-2 trainer with its speedrun sections deleted by their banners (as an outside
tool would: from the banner to the next one; the Triton trainer's speedrun kernels too) still imports,
trains the gpt2 recipe with the whole file's losses, and refuses --recipe speedrun in one line. The cut
copies run in this process, loaded from a temporary folder."""
import functools
import importlib.util
import os

import pytest

from conftest import REPO, assert_refused, step_events
from test_siblings import sections

CUT = ("Recipe: speedrun", "Triton kernels: speedrun")
# the command line after the script, and the steps of its runs: backend triton's cut copy runs one step, in
# the interpreter without a GPU, and is held to the whole file by its kernels (the whole file's run would
# double the minute that step takes there)
CASES = {
    "jax": ("train_gpt2_jax.py", [], 2),
    "torchfunc": ("train_gpt2_torchfunc.py", ["--compile", "0"], 2),
    "triton-torch": ("train_gpt2_triton.py", ["torch"], 2),
    "triton-triton": ("train_gpt2_triton.py", ["triton"], 1),
}


def code_of(op):
    """An op's compiled code; a partial's, with the arguments it binds."""
    if isinstance(op, functools.partial):
        return code_of(op.func), op.args, sorted(op.keywords.items())
    return op.__code__.co_code


def cut_copy(script, folder):
    """Writes `script` without its CUT sections into folder; returns the copy loaded as a module."""
    with open(os.path.join(REPO, script)) as f:
        head = f.read().split("\n# " + "-" * 77 + "\n", 1)[0]
    kept = [text for title, text in sections(script) if title not in CUT]
    assert len(kept) < len(sections(script)), f"{script}: no section to cut"
    path = os.path.join(folder, script)
    with open(path, "w") as f:
        f.write("\n\n".join([head.rstrip("\n"), *kept]) + "\n")
    spec = importlib.util.spec_from_file_location(f"cut_{script[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", CASES)
def test_the_speedrun_recipe_cuts_out(case, tmp_path, tiny_shards):
    """The cut copy's gpt2 run logs the whole file's losses, grad norms and lrs (same code, same bits; for
    backend triton: it runs one step, its kernel wrappers the whole file's code), and --recipe speedrun is
    then no choice: one line."""
    script, argv, steps = CASES[case]
    whole = importlib.import_module(script[:-3])
    cut = cut_copy(script, tmp_path)
    assert "speedrun" not in cut.RECIPES and set(whole.RECIPES) == {"gpt2", "speedrun"}
    run = [*argv, "--data", str(tiny_shards), "--n-layer", "2", "--n-head", "4", "--n-embd", "64",
           "--seq-len", "32", "--batch-size", "2", "--total-batch-size", "128", "--steps", str(steps),
           "--dtype", "fp32", "--val-every", "0", "--hellaswag-every", "0", "--sample-every", "0",
           "--ckpt-every", "0"]
    logs = {}
    for name, module in (("whole", whole), ("cut", cut)):
        if case == "triton-triton" and name == "whole":
            code = {name: [code_of(vars(ns)[k]) for k in sorted(vars(ns))]
                    for name, ns in (("cut", cut.backend_ops("triton")), ("whole", whole.backend_ops("triton")))}
            assert code["cut"] == code["whole"]
            continue
        out = tmp_path / name
        module.main([*run, "--out-dir", str(out)])
        logs[name] = [(e["train_loss"], e["grad_norm"], e["lr"]) for e in step_events(out)]
    assert len(logs["cut"]) == steps and logs["cut"] == logs.get("whole", logs["cut"]), logs
    assert_refused(cut.main, [([*argv, "--recipe", "speedrun"], "--recipe", "invalid choice")])
