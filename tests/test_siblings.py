"""The three GPT-2 trainers as siblings, and every script's flags: the trainers tell one story in the same
section order (what they share is a copy: tests/test_copies.py), every flag of every script explains
itself, and the Triton trainer reads training-first."""
import ast
import contextlib
import importlib
import importlib.util
import io
import os
import re
import subprocess
import sys

import pytest

import train_gpt2_jax as tj
import train_gpt2_torchfunc as tf
import train_gpt2_triton as tg
from conftest import REPO

TRAINERS = {"jax": "train_gpt2_jax.py", "torchfunc": "train_gpt2_torchfunc.py",
            "triton": "train_gpt2_triton.py"}
MODULES = {"jax": tj, "torchfunc": tf, "triton": tg}
ARGV = {"jax": [], "torchfunc": [], "triton": ["torch"]}

BANNER = "# " + "-" * 77


def sections(path):
    """[(title, text)] of a file's banner sections in order: a banner line, then `# Title`; the text runs
    from the banner to the next one."""
    with open(os.path.join(REPO, path)) as f:
        lines = f.read().split("\n")
    starts = [i for i, line in enumerate(lines) if line == BANNER and lines[i + 1].startswith("# ")]
    return [(lines[i + 1][2:], "\n".join(lines[i:j]).rstrip("\n"))
            for i, j in zip(starts, starts[1:] + [len(lines)])]


def test_the_jax_trainer_loads_no_torch():
    """Importing the JAX trainer loads neither torch nor triton."""
    code = "import sys, train_gpt2_jax; sys.exit(sorted({'torch', 'triton'} & set(sys.modules)) or 0)"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def docstring_map(path):
    """The section titles that a trainer's module docstring lists under `Map:`, in order."""
    module = importlib.import_module(path[:-3])
    block = module.__doc__.split("\nMap:", 1)[1].split("\n")[1:]
    return [re.split(r"\s{2,}", line.strip())[0] for line in block if line.startswith("    ")]


@pytest.mark.parametrize("path", list(TRAINERS.values()))
def test_the_map_lists_the_sections(path):
    """A trainer's docstring map names its banner sections, all of them, in file order."""
    assert docstring_map(path) == [title for title, _ in sections(path)]


def story(trainer):
    """A trainer's section titles up to Main, with those of its own framework's extra parts left out (the
    Triton trainer's ops and hand-derived backward), and its plumbing sections' titles cut to `plumbing`,
    `shared` and `shared torch`."""
    titles = [title for title, _ in sections(TRAINERS[trainer])]
    titles = [t for t in titles[:titles.index("Main") + 1] if t not in ("GPT-2: ops", "GPT-2: backward")]
    return [t.split(":")[0].lower().replace(" plumbing", "") if "plumbing" in t else t for t in titles]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_one_story(trainer):
    """GPT-2 first (config, model, AdamW and the lr schedule, training step), then the speedrun recipe's one
    section, then the framework's own plumbing, the shared plumbing (the torch trainers' second block),
    then main; the Triton trainer's kernels and tools follow main. No code outside a recipe's sections
    tests a recipe's name."""
    own = {"jax": "jax", "torchfunc": "torchfunc", "triton": "triton"}[trainer]
    assert story(trainer) == ["GPT-2: config", "GPT-2: model", "GPT-2: AdamW and the lr schedule",
                              "GPT-2: training step", "Recipe: speedrun", own, "shared",
                              *(["shared torch"] if trainer != "jax" else []), "Main"]
    for title, text in sections(TRAINERS[trainer]):
        if not title.startswith(("Recipe: ", "Triton kernels: speedrun")):
            named = re.findall(r"""(?:recipe\s*[!=]=\s*|==\s*)["'](?:gpt2|speedrun)["']""", text)
            assert not named, f"{TRAINERS[trainer]}, section {title!r}: tests a recipe's name: {named}"


SCRIPTS = ["train_gpt2_jax.py", "train_gpt2_torchfunc.py", "train_gpt2_triton.py", "train_aiayn_jax.py",
           "tokenizer.py", "prepro_fineweb.py", "hellaswag.py", "plot_runs.py", "convert_hf.py"]


def add_argument_calls(path):
    """(line, flags, help) of every add_argument call in a script; help None when it has none."""
    with open(os.path.join(REPO, path)) as f:
        tree = ast.parse(f.read())
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags = [a.value for a in node.args if isinstance(a, ast.Constant)]
            text = next((k.value for k in node.keywords if k.arg == "help"), None)
            calls.append((node.lineno, flags, text))
    return calls


def printed_help(module, argv):
    """What main(argv + ["--help"]) prints; it must exit 0."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        module.main([*argv, "--help"])
    assert e.value.code == 0, (argv, e.value)
    return out.getvalue()


@pytest.mark.parametrize("path", SCRIPTS)
def test_every_flag_explains_itself(path):
    """Every add_argument of the script has a help text, and --help (of each subcommand too) prints
    every flag with it."""
    calls = add_argument_calls(path)
    assert calls, f"{path}: no add_argument found"
    missing = [(line, flags) for line, flags, text in calls
               if text is None or (isinstance(text, ast.Constant) and not str(text.value).strip())]
    assert not missing, f"{path}: add_argument without help at {missing}"
    module = importlib.import_module(path[:-3])
    printed = printed_help(module, [])
    usage = printed.split("\n\n")[0]  # a subcommand (or positional) choice: its own --help too
    for choices in re.findall(r"(?<!\w )\{([\w,-]+)\}", usage):  # not a flag's choices
        printed += "".join(printed_help(module, [choice]) for choice in choices.split(","))
    for _, flags, _ in calls:
        for flag in flags:
            if flag.startswith("--"):
                assert flag in printed, f"{path}: {flag} missing from --help"


def test_the_suite_explains_its_own_options_first():
    """python test_parity.py --help prints its own options (--quick, --list, -k), not pytest's hundreds of
    lines, and exits 0."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "test_parity.py"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert all(opt in proc.stdout for opt in ("--quick", "--list", "-k")), proc.stdout
    assert len(proc.stdout.splitlines()) < 20, proc.stdout[:2000]


def test_ops_are_listed_once():
    """The op interface is OP_NAMES; each backend's table (torch, triton, and the self-test's autograd
    reference) fills it in exactly, and op_table refuses a table with an op missing or one too many."""
    for table in (tg.TORCH_OPS, tg.TRITON_OPS, tg.AUTOGRAD_OPS):
        assert sorted(vars(table)) == sorted(tg.OP_NAMES)
    ops = dict(vars(tg.TORCH_OPS))
    del ops["gelu_backward"]
    with pytest.raises(TypeError, match="gelu_backward"):
        tg.op_table("broken", ops)
    with pytest.raises(TypeError, match="gelu_backwards"):
        tg.op_table("broken", dict(vars(tg.TORCH_OPS), gelu_backwards=None))


def first_lines(path, prefixes):
    """{name: index of the first line of path that starts with prefix} for (name, prefix) in prefixes."""
    with open(os.path.join(REPO, path)) as f:
        lines = f.read().splitlines()
    return {name: next(i for i, line in enumerate(lines) if line.startswith(prefix)) for name, prefix in prefixes}


def top_level_imports(path):
    """The top-level modules that path imports at its own import."""
    with open(os.path.join(REPO, path)) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module.split(".")[0])
    return found


def test_triton_trainer_reads_training_first():
    """train_gpt2_triton.py holds the training path first (GPT-2's ops, model, backward and step, the
    speedrun recipe, the plumbing, main), then backend triton's kernels (their op table after them), the
    tools (--test, --profile, --bench-ops), and last the speedrun recipe's kernels: no kernel before main."""
    at = first_lines(TRAINERS["triton"], (
        ("ops", "# GPT-2: ops"), ("model", "# GPT-2: model"), ("backward", "# GPT-2: backward"),
        ("step", "# GPT-2: training step"), ("speedrun", "# Recipe: speedrun"),
        ("plumbing", "# Triton plumbing"), ("main", "def main("), ("first kernel", "@triton.jit"),
        ("triton table", "TRITON_OPS = "), ("self-test", "# Self-test"), ("profiling", "# Profiling"),
        ("tools", "TOOLS = "), ("speedrun kernels", "# Triton kernels: speedrun")))
    assert list(at) == sorted(at, key=at.get), at


def test_the_lines_table_is_the_files():
    """README.md's lines table is what bench/lines.py counts in the trainers now: a section that grows,
    shrinks or moves without the table regenerated fails here."""
    spec = importlib.util.spec_from_file_location("bench_lines", os.path.join(REPO, "bench", "lines.py"))
    lines = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lines)
    assert lines.published_table() == lines.table(), "README.md's lines table is stale: run python bench/lines.py"


def test_the_activation_table_is_the_accounting():
    """docs/RESULTS.md's activation table is what each trainer's activation_bytes gives now (bench/activations.py),
    and in each trainer and recipe no level holds more than the one before it."""
    spec = importlib.util.spec_from_file_location("bench_activations",
                                                  os.path.join(REPO, "bench", "activations.py"))
    activations = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(activations)
    table = activations.table()
    assert activations.published_table() == table, \
        "docs/RESULTS.md's activation table is stale: run python bench/activations.py"
    rows = [[float(c.replace(",", "")) for c in line.strip("|").split("|")[2:]] for line in table.splitlines()[2:]]
    for recipe in range(0, len(rows), 3):
        none, pointwise, block = rows[recipe:recipe + 3]
        assert all(a >= b >= c for a, b, c in zip(none, pointwise, block)) and all(a > c for a, c in zip(none, block))
