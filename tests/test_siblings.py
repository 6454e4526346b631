"""The three GPT-2 trainers as siblings, and every script's flags: the trainers tell one story in the same
section order, the parts that differ by framework keep the same names, no two scripts repeat each other's
code (what they share is trainkit's), every flag of every script explains itself, and the Triton trainer
reads training-first."""
import ast
import contextlib
import glob
import importlib
import importlib.util
import io
import itertools
import os
import re
import subprocess
import sys

import pytest

import train_gpt2_jax as tj
import train_gpt2_torchfunc as tf
import train_gpt2_triton as tg
import triton_kernels as tk
import triton_tools as tools
from conftest import REPO

TRAINERS = {"jax": "train_gpt2_jax.py", "torchfunc": "train_gpt2_torchfunc.py",
            "triton": "train_gpt2_triton.py"}
MODULES = {"jax": tj, "torchfunc": tf, "triton": tg}
ARGV = {"jax": [], "torchfunc": [], "triton": ["torch"]}

# The files that must not repeat each other: what two of them would share belongs in trainkit/
# the scripts and the package they share; tests and bench/ may restate what they check
NO_REPEATS = ["train_gpt2_jax.py", "train_gpt2_torchfunc.py", "train_gpt2_triton.py", "convert_hf.py",
              "train_aiayn_jax.py", "hellaswag.py", "prepro_fineweb.py", "plot_runs.py", "tokenizer.py",
              "triton_kernels.py", "triton_kernels_speedrun.py", "triton_tools.py", "trainkit/*.py"]
REPEAT_LINES = 10  # a run of this many identical lines (blank lines and imports aside) is a copy
# Names that two or more trainers define, each in its framework's terms: the parts that differ by
# framework keep the same names, so that a diff of two trainers lines them up.
DIFFERENT = {
    "FRAMEWORK": "each trainer's own name in log.jsonl",
    "Recipe": "the shared fields, then each trainer's own (its model and update functions)",
    "RECIPES": "each trainer's rows: the shared fields, then its own model and update functions",
    "Config": "the shared fields, then each trainer's own (JAX: attention, scan, processes; torchfunc: "
              "compile; triton: backend, --test, --bench-ops)",
    "ZERO_STAGES": "JAX also shards the weights (stage 3)",
    "gpt2_activation_bytes": "what each framework's backward keeps at each --recompute level",
    "speedrun_activation_bytes": "what each framework's backward keeps at each --recompute level",
    "recomputed": "--recompute in each framework's terms (jax.checkpoint policies; autograd.Functions)",
    "framework_flags": "each trainer's own flags",
    "parse_args": "trainkit.flags.parse_args over each trainer's own Config, RECIPES and flags",
    "param_shapes": "a lookup in each trainer's own RECIPES",
    "EMBEDDINGS": "the tables JAX and torchfunc keep fp32 in bf16 runs (the Triton trainer keeps none)",
    "main": "the same steps in the same order, in each framework's terms",
    "forward": "the model in each framework", "token_losses": "the model in each framework",
    "loss_fn": "the model in each framework", "compute_dtype": "the model in each framework",
    "attention": "the model in each framework", "block": "the model in each framework",
    "transformer": "the model in each framework",
    "global_norm": "each framework's function", "adamw_update": "each framework's function",
    "adam_scalars": "a jitted step's inputs: host arrays in JAX, device tensors in torchfunc",
    "train_step": "each framework's step", "make_state": "each torch trainer's flat layout",
    "whole_state": "each torch trainer's flat layout",
    "compute_groups": "torchfunc keeps its embeddings fp32",
    "device_state_bytes": "each trainer's layout of the state", "generate": "each framework's sampler",
    # the speedrun recipe's model and optimizers (JAX and torchfunc)
    "rotary": "the speedrun model in each framework",
    "speedrun_block": "the speedrun model in each framework",
    "speedrun_transformer": "the speedrun model in each framework",
    "speedrun_logits": "the speedrun model in each framework (the Triton trainer's: the soft cap alone, "
                       "after the op interface's matmul)",
    "speedrun_adamw": "JAX returns one tensor's new state / torchfunc's multi-tensor ops in place",
    "speedrun_muon": "JAX returns the new weights and buffers / torchfunc updates them in place",
    "next_logits": "the model in each framework", "speedrun_forward": "the speedrun model in each framework",
    "speedrun_next_logits": "the speedrun model in each framework",
    "speedrun_token_losses": "the speedrun model in each framework",
    "speedrun_scalars": "host arrays in JAX, device tensors in torchfunc",
    "speedrun_update": "JAX returns the new state / torchfunc updates it in place (and its compute copies) / "
                       "the Triton trainer through the op interface's adamw_update and muon_update",
}


def top_level(path):
    """{name: source} of a file's top-level functions, classes (decorators included) and assignments."""
    with open(os.path.join(REPO, path)) as f:
        src = f.read()
    lines = src.splitlines()
    defs = {}
    for node in ast.parse(src).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            defs[node.name] = "\n".join(lines[first - 1:node.end_lineno])
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name)):
            defs[node.targets[0].id] = ast.get_source_segment(src, node)
    return defs


BANNER = "# " + "-" * 77


def sections(path):
    """[(title, text)] of a file's banner sections in order: a banner line, then `# Title`; the text runs
    from the banner to the next one."""
    with open(os.path.join(REPO, path)) as f:
        lines = f.read().split("\n")
    starts = [i for i, line in enumerate(lines) if line == BANNER and lines[i + 1].startswith("# ")]
    return [(lines[i + 1][2:], "\n".join(lines[i:j]).rstrip("\n"))
            for i, j in zip(starts, starts[1:] + [len(lines)])]


def test_only_the_framework_parts_share_names():
    """Every DIFFERENT name is defined in at least two trainers; a name that two trainers define and
    DIFFERENT does not list is framework-free code twice, which belongs in trainkit/."""
    defs = {name: top_level(path) for name, path in TRAINERS.items()}
    pairs = {name for a in defs for b in defs if a < b for name in set(defs[a]) & set(defs[b])}
    unlisted = sorted(pairs - set(DIFFERENT))
    assert not unlisted, f"defined in two trainers but not in DIFFERENT (move it to trainkit/?): {unlisted}"
    assert set(DIFFERENT) <= pairs, f"stale DIFFERENT entries: {sorted(set(DIFFERENT) - pairs)}"


def code_lines(text):
    """[(line number, text with its white space folded)] of a file's lines, blank lines and import
    statements left out: what two files must not share REPEAT_LINES of in a row."""
    skip = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            skip.update(range(node.lineno, node.end_lineno + 1))
    return [(i, " ".join(line.split())) for i, line in enumerate(text.splitlines(), 1)
            if line.strip() and i not in skip]


def repeated_runs(texts, length=REPEAT_LINES):
    """[(run length, 'a.py:first-last', 'b.py:first-last')] of the runs of `length` or more identical
    lines (code_lines) that two of the {name: text} share, longest first."""
    lines = {name: code_lines(text) for name, text in texts.items()}
    runs = []
    for a, b in itertools.combinations(lines, 2):
        at = {}
        for j, (_, line) in enumerate(lines[b]):
            at.setdefault(line, []).append(j)
        ending = {}  # j -> length of the common run that ends at line i of a and line j of b
        for i, (_, line) in enumerate(lines[a] + [(0, None)]):
            now = {j: ending.get(j - 1, 0) + 1 for j in at.get(line, ())}
            for j, n in ending.items():
                if j + 1 not in now and n >= length:
                    runs.append((n, f"{a}:{lines[a][i - n][0]}-{lines[a][i - 1][0]}",
                                 f"{b}:{lines[b][j - n + 1][0]}-{lines[b][j][0]}"))
            ending = now
    return sorted(runs, reverse=True)


def test_no_file_repeats_another():
    """No two of the scripts and trainkit/'s modules share a run of REPEAT_LINES identical lines: the
    plumbing they have in common lives once, in trainkit/ (or in the script that owns it)."""
    texts = {}
    for pattern in NO_REPEATS:
        for path in sorted(glob.glob(os.path.join(REPO, pattern))):
            with open(path) as f:
                texts[os.path.relpath(path, REPO)] = f.read()
    assert len(texts) > len(NO_REPEATS)
    runs = repeated_runs(texts)
    assert not runs, "repeated code (move it to trainkit/):\n" + "\n".join(map(str, runs))


def test_the_repeat_check_finds_a_copy():
    """repeated_runs finds a function of REPEAT_LINES lines that two files hold (indented otherwise, amid
    other code, an import between its lines), and not one line shorter."""
    def planted(lines):
        body = [f"    x{i} = x{i - 1} + {i}" for i in range(1, lines)]
        return ["def planted(x0):", *body[:3], "    import math", *body[3:]]
    for lines, found in ((REPEAT_LINES, [REPEAT_LINES]), (REPEAT_LINES - 1, [])):
        a = "\n".join(["y = 1", *planted(lines), "z = 2"])
        b = "\n".join(["class C:", *("    " + line for line in planted(lines)), "    w = 3"])
        assert [n for n, _, _ in repeated_runs({"a.py": a, "b.py": b})] == found, lines


def test_the_jax_trainer_loads_no_torch():
    """Importing the JAX trainer (and with it trainkit) loads neither torch nor triton."""
    code = "import sys, train_gpt2_jax; sys.exit(sorted({'torch', 'triton'} & set(sys.modules)) or 0)"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def docstring_map(path):
    """The section titles that a trainer's module docstring lists under `Map:`, in order."""
    module = importlib.import_module(path[:-3])
    block = module.__doc__.split("\nMap:", 1)[1].split("\n")[1:]
    return [re.split(r"\s{2,}", line.strip())[0] for line in block if line.startswith("    ")]


# the Triton trainer's files beside it: its kernels, the speedrun recipe's, and its tools
TRITON_FILES = ["triton_kernels.py", "triton_kernels_speedrun.py", "triton_tools.py"]


@pytest.mark.parametrize("path", list(TRAINERS.values()) + TRITON_FILES)
def test_the_map_lists_the_sections(path):
    """A trainer's (or a Triton file's) docstring map names its banner sections, all of them, in file
    order."""
    assert docstring_map(path) == [title for title, _ in sections(path)]


def story(trainer):
    """A trainer's section titles with those of its own framework's extra parts left out (the Triton
    trainer's ops and hand-derived backward) and its plumbing section's title cut to `plumbing`."""
    titles = [title for title, _ in sections(TRAINERS[trainer])]
    titles = [t for t in titles if t not in ("GPT-2: ops", "GPT-2: backward")]
    return ["plumbing" if t.split(":")[0].endswith(" plumbing") else t for t in titles]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_one_story(trainer):
    """GPT-2 first (config, model, AdamW and the lr schedule, training step), then the speedrun recipe's one
    section, then the framework's own plumbing, then main, and nothing else: the shared plumbing is
    trainkit's. No code outside the recipe's section (nor in the Triton trainer's files beside it) tests a
    recipe's name."""
    assert story(trainer) == ["GPT-2: config", "GPT-2: model", "GPT-2: AdamW and the lr schedule",
                              "GPT-2: training step", "Recipe: speedrun", "plumbing", "Main"]
    for path in [TRAINERS[trainer]] + (TRITON_FILES if trainer == "triton" else []):
        for title, text in sections(path):
            if not title.startswith(("Recipe: ", "Triton kernels: speedrun")):
                named = re.findall(r"""(?:recipe\s*[!=]=\s*|==\s*)["'](?:gpt2|speedrun)["']""", text)
                assert not named, f"{path}, section {title!r}: tests a recipe's name: {named}"


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


def test_ops_are_listed_once():
    """The op interface is OP_NAMES; each backend's table (torch, triton, and the self-test's autograd
    reference) fills it in exactly, and op_table refuses a table with an op missing or one too many."""
    for table in (tg.TORCH_OPS, tk.TRITON_OPS, tools.AUTOGRAD_OPS):
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
    """train_gpt2_triton.py is the training path alone (GPT-2's ops, model, backward and step, the speedrun
    recipe, the plumbing, main), without a kernel and without importing triton; its kernels are in
    triton_kernels.py (backend triton's table after them) and triton_kernels_speedrun.py, the self-test
    and the profiler in triton_tools.py, and the trainer imports those only inside the functions that
    need them (each imports the trainer)."""
    at = first_lines(TRAINERS["triton"], (
        ("ops", "# GPT-2: ops"), ("model", "# GPT-2: model"), ("backward", "# GPT-2: backward"),
        ("step", "# GPT-2: training step"), ("speedrun", "# Recipe: speedrun"),
        ("plumbing", "# Triton plumbing"),
        ("main", "def main(")))
    assert list(at) == sorted(at, key=at.get), at
    with open(os.path.join(REPO, TRAINERS["triton"])) as f:
        assert "@triton.jit" not in f.read()
    assert not top_level_imports(TRAINERS["triton"]) & {"triton", *(path[:-3] for path in TRITON_FILES)}
    at = first_lines("triton_kernels.py", (("first kernel", "@triton.jit"), ("triton table", "TRITON_OPS = ")))
    assert list(at) == sorted(at, key=at.get), at
    at = first_lines("triton_tools.py", (("self-test", "# Self-test"), ("profiling", "# Profiling"),
                                         ("tools", "TOOLS = ")))
    assert list(at) == sorted(at, key=at.get), at
    for path in TRITON_FILES:
        assert "train_gpt2_triton" in top_level_imports(path), path


def test_the_lines_table_is_the_files():
    """docs/RESULTS.md's lines-per-part table is what bench/lines.py counts in the trainers now: a section
    that grows, shrinks or moves without the table regenerated fails here."""
    spec = importlib.util.spec_from_file_location("bench_lines", os.path.join(REPO, "bench", "lines.py"))
    lines = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lines)
    assert lines.published_table() == lines.table(), "docs/RESULTS.md's table is stale: run python bench/lines.py"


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
