"""A trainer copied alone into an empty folder, as the card's reader forks one file: it trains,
checkpoints, resumes and evaluates val loss in both recipes with the checkout's numbers; HellaSwag asked
for without hellaswag.py beside it is one line, and samples without a tokenizer are said once (in the
checkout, offline with tiktoken's cache empty, the committed GPT-2 files serve without a word)."""
import shutil

import pytest

from conftest import OFFLINE, REPO, assert_clean_error, read_log, run_script

# (script, its argv before the flags): backend triton runs its kernels in the interpreter without a GPU
CASES = {
    "jax": ("train_gpt2_jax.py", []),
    "torchfunc": ("train_gpt2_torchfunc.py", ["--compile", "0"]),
    "triton-torch": ("train_gpt2_triton.py", ["torch"]),
    "triton-triton": ("train_gpt2_triton.py", ["triton"]),
}
SHAPE = {"gpt2": ["--n-layer", "1", "--n-head", "2", "--n-embd", "32"],
         "speedrun": ["--recipe", "speedrun", "--n-layer", "1", "--n-embd", "128"]}
# no tokenizer: tiktoken's cache empty, no network, and no hellaswag.py beside the copy
NO_TOKENIZER = {**OFFLINE, "TIKTOKEN_CACHE_DIR": ""}


def numbers(out):
    """(step, train loss, val loss) of each logged event, as floats logged to the last digit."""
    return [(e["step"], e.get("train_loss"), e.get("val_loss")) for e in read_log(out)]


# backend triton's speedrun kernels run in the interpreter elsewhere: its gpt2 run shows the copy works
RUNS = [(c, r) for c in CASES for r in SHAPE if (c, r) != ("triton-triton", "speedrun")]


@pytest.mark.parametrize("case,recipe", RUNS)
def test_a_trainer_copied_alone_trains_and_resumes(case, recipe, tmp_path, tiny_shards):
    """The copy's two steps (a checkpoint after each, val loss after each) log the checkout's numbers, and
    its resume from step 1's checkpoint logs step 2's again; without a tokenizer it says once that it
    samples nothing, and HellaSwag asked of it is refused in one line naming hellaswag.py."""
    script, argv = CASES[case]
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(f"{REPO}/{script}", alone)
    flags = [*argv, *SHAPE[recipe], "--data", str(tiny_shards), "--seq-len", "16", "--batch-size", "2",
             "--total-batch-size", "32", "--steps", "2", "--dtype", "fp32", "--ckpt-every", "1",
             "--val-every", "1", "--val-tokens", "64", "--hellaswag-every", "0", "--sample-every", "2"]
    env = {**NO_TOKENIZER, "PYTHONPATH": ""}
    copy = run_script(script, *flags, "--out-dir", alone / "out", cwd=alone, env=env)
    assert copy.stdout.count("no samples: GPT-2's tokenizer did not load") == 1, copy.stdout
    if case == "jax":  # the file's bytes are the checkout's: one trainer shows the numbers are too
        # and in the checkout, tests/data/gpt2 serves for tiktoken's files without a word
        checkout = run_script(script, *flags, "--out-dir", tmp_path / "checkout", env=NO_TOKENIZER)
        assert numbers(alone / "out") == numbers(tmp_path / "checkout")
        assert "tiktoken" not in checkout.stdout + checkout.stderr and checkout.stdout.count("sample 0: ") == 1
    assert len(numbers(alone / "out")) == 4
    run_script(script, *flags, "--sample-every", "0", "--resume", alone / "out" / "ckpt_0000001", "--out-dir",
               alone / "resumed", cwd=alone, env=env)
    assert numbers(alone / "resumed") == [n for n in numbers(alone / "out") if n[0] == 2 or n[1] is None]
    if recipe == "gpt2" and case == "jax":
        refused = run_script(script, *flags, "--hellaswag-every", "1", "--out-dir", alone / "hs", cwd=alone,
                             env=env, check=False)
        assert_clean_error(refused, "hellaswag.py")
