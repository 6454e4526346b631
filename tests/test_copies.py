"""One file per trainer: the copies they carry on purpose are equal (tests/sync_copies.py), the sync
command repairs a planted drift, and no trainer (nor convert_hf.py, nor plot_runs.py) imports a module of
the repository."""
import ast
import glob
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
import sync_copies

TRAINERS = ["train_gpt2_jax.py", "train_gpt2_torchfunc.py", "train_gpt2_triton.py", "train_aiayn_jax.py"]
TOOLS = ["convert_hf.py", "plot_runs.py"]  # stand alone too, with no exception
# a trainer may import these modules of the repository only where it says (hellaswag.py inside a
# function: HellaSwag and the samples' tokenizer; the translator's BPE, the card's tokenizer.py)
ALLOWED = {"hellaswag": "in a function", "tokenizer": "train_aiayn_jax.py"}


def test_the_copies_are_equal():
    """A name that two of the files define is the same text in both, unless DIFFERENT says why not."""
    found = sync_copies.drifted({f: sync_copies.read(f) for f in sync_copies.FILES})
    assert not found, ("copies differ: edit one, then run python tests/sync_copies.py FILE\n"
                       + "\n\n".join(diff for *_, diff in found))


def test_every_listed_name_is_defined_twice():
    """No stale entry in DIFFERENT (two GPT-2 trainers define it) or OWN (its file and another define it)."""
    defs = {f: set(sync_copies.top_level(sync_copies.read(f))) for f in sync_copies.FILES}
    trainers = [defs[f] for f in sync_copies.FILES[:3]]
    twice = {n for i, a in enumerate(trainers) for b in trainers[i + 1:] for n in a & b}
    assert set(sync_copies.DIFFERENT) <= twice, sorted(set(sync_copies.DIFFERENT) - twice)
    for f, names in sync_copies.OWN.items():
        elsewhere = set().union(*(d for g, d in defs.items() if g != f))
        assert names <= defs[f] & elsewhere, (f, sorted(names - (defs[f] & elsewhere)))


def test_a_planted_drift_fails_and_the_sync_repairs_it(tmp_path):
    """An edit made to one copy of a shared function (here `due`, in torchfunc's block and the translator's
    part), or a comment line added between the Triton trainer's shared definitions, fails --check, naming it;
    `sync_copies.py FILE` carries FILE's version back to every copy."""
    (tmp_path / "tests").mkdir()
    shutil.copy(os.path.join(REPO, "tests", "sync_copies.py"), tmp_path / "tests")
    for f in sync_copies.FILES:
        shutil.copy(os.path.join(REPO, f), tmp_path / f)
    originals = {f: (tmp_path / f).read_text() for f in sync_copies.FILES}
    for f in ("train_gpt2_torchfunc.py", "train_aiayn_jax.py"):
        text = originals[f]
        assert "\ndef due(" in text
        (tmp_path / f).write_text(text.replace("\ndef due(", "\ndef due(  # drifted\n", 1))
    # a line between definitions, which no name covers: the shared section is compared whole
    text = (tmp_path / "train_gpt2_triton.py").read_text()
    text = text.replace("\n\ndef log_event(", "\n# drifted\n\ndef log_event(", 1)
    (tmp_path / "train_gpt2_triton.py").write_text(text)
    tool = [sys.executable, str(tmp_path / "tests" / "sync_copies.py")]
    check = subprocess.run([*tool, "--check"], capture_output=True, text=True)
    assert check.returncode == 1 and "due: train_gpt2_jax.py and train_gpt2_torchfunc.py differ" in check.stdout
    assert "+def due(  # drifted" in check.stdout
    assert "section Shared plumbing: train_gpt2_jax.py and train_gpt2_triton.py differ" in check.stdout
    assert "+# drifted" in check.stdout
    subprocess.run([*tool, "train_gpt2_jax.py"], check=True, capture_output=True)
    assert subprocess.run([*tool, "--check"], capture_output=True).returncode == 0
    assert {f: (tmp_path / f).read_text() for f in sync_copies.FILES} == originals


def repository_modules():
    return {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "*.py"))} | {
        os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(REPO, "*", "__init__.py"))}


def test_a_trainer_imports_nothing_of_the_repository():
    """Each trainer and tool imports the standard library, numpy, its framework and requirements.txt's
    packages; of the repository only a trainer hellaswag.py inside a function, and the translator tokenizer.py."""
    mine = repository_modules()
    for path in TRAINERS + TOOLS:
        tree = ast.parse(sync_copies.read(path))
        top = set(tree.body)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for m in (n.split(".")[0] for n in names):
                if m in mine and m != path[:-3]:
                    allowed = ALLOWED.get(m) if path in TRAINERS else None
                    ok = allowed == path or (allowed == "in a function" and node not in top)
                    assert ok, f"{path}:{node.lineno} imports the repository's {m}"


# (file, its text's anchor, the same with a repository import planted there, the module planted)
PLANTED = [("train_gpt2_jax.py", "\nimport jax\n", "\nimport jax\nimport hellaswag\n", "hellaswag"),
           ("convert_hf.py", "\n    files = {}\n", "\n    import tokenizer\n    files = {}\n", "tokenizer")]


@pytest.mark.parametrize("path,anchor,planted,module", PLANTED)
def test_the_import_check_catches_a_repository_import(path, anchor, planted, module, tmp_path, monkeypatch):
    """The check above fails on a trainer that imports a module of the repository at its top, and on
    convert_hf.py importing tokenizer.py even inside a function."""
    text = sync_copies.read(path)
    assert text.count(anchor) == 1
    (tmp_path / path).write_text(text.replace(anchor, planted))
    monkeypatch.setattr(sync_copies, "read", lambda p: (tmp_path / p).read_text() if p == path
                        else open(os.path.join(REPO, p)).read())
    try:
        test_a_trainer_imports_nothing_of_the_repository()
    except AssertionError as e:
        assert f"{path}:" in str(e) and f"imports the repository's {module}" in str(e)
    else:
        raise AssertionError(f"the import check passed {path} importing {module}")
