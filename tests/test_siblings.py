"""The three GPT-2 trainers as siblings, and every script's flags: the code the trainers share stays the
same in each (a listed function changed in one trainer only fails here), every difference is a listed,
deliberate one, every flag of every script explains itself, and the Triton trainer reads training-first."""
import ast
import contextlib
import difflib
import importlib
import importlib.util
import io
import os
import re

import pytest

import train_gpt2_jax as tj
import train_gpt2_torchfunc as tf
import train_gpt2_triton as tg
from conftest import REPO

TRAINERS = {"jax": "train_gpt2_jax.py", "torchfunc": "train_gpt2_torchfunc.py",
            "triton": "train_gpt2_triton.py"}
MODULES = {"jax": tj, "torchfunc": tf, "triton": tg}
ARGV = {"jax": [], "torchfunc": [], "triton": ["torch"]}

# The shared plumbing: banner sections that are the same, character for character, from their banner to
# the next, in each trainer of the group (one paste per section carries a change to all of them).
SHARED_SECTIONS = {
    ("jax", "torchfunc", "triton"): ["Flags and recipe lookups", "Data", "Checkpoints",
                                     "Evaluation and logging"],
    ("torchfunc", "triton"): ["Torch: processes, ZeRO-1 and failures"],
}
# Top-level names outside those sections whose source must be the same in each trainer of the group:
# GPT-2's constants, shapes, init and model files, and the speedrun recipe's shared parts.
IDENTICAL = {
    ("jax", "torchfunc", "triton"): [
        "VOCAB_SIZE", "PADDED_VOCAB_SIZE", "EOT", "MODEL_PRESETS", "die", "PARAM_NAMES", "DECAY_NAMES",
        "gpt2_shapes", "init_gpt2_numpy", "MODEL_MAGIC", "write_model_file", "read_model_file",
        "is_model_file", "cosine_lr", "grad_accum_steps", "CENSUS_SECONDS", "RECOMPUTE_LEVELS",
        # the speedrun recipe: its defaults, shapes, init, schedule and model files
        "SPEEDRUN_LRS", "SPEEDRUN_DEFAULTS", "HEAD_DIM", "configure_speedrun", "speedrun_shapes",
        "muon_names", "init_speedrun_numpy", "rotary_freq_numpy", "SPEEDRUN_COOLDOWN", "speedrun_lr",
        "speedrun_lrs", "adamw_group", "SAFETENSORS_TYPES", "write_safetensors", "read_safetensors",
        "is_safetensors_file", "write_speedrun_file", "read_speedrun_file", "ATTN_SCALE", "SOFTCAP"],
    # the two torch trainers: Muon's orthogonalization
    ("torchfunc", "triton"): ["newton_schulz"],
    # the two that write the model as functions of a weights dict
    ("jax", "torchfunc"): ["EMBEDDINGS", "LAYER_NAMES"],
}
# Names two or more trainers define differently, on purpose.
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
    "main": "the same steps in the same order, in each framework's terms",
    "forward": "the model in each framework", "token_losses": "the model in each framework",
    "loss_fn": "the model in each framework", "compute_dtype": "the model in each framework",
    "attention": "the model in each framework", "block": "the model in each framework",
    "transformer": "the model in each framework", "_gelu_tanh": "a JAX function / a Triton jit helper",
    "global_norm": "a framework's function / the Triton multi-tensor kernel's wrapper",
    "adamw_update": "a framework's function / the Triton multi-tensor kernel's wrapper",
    "adam_scalars": "a jitted step's inputs: host arrays in JAX, device tensors in torchfunc",
    "train_step": "each framework's step", "make_state": "each torch trainer's flat layout",
    "whole_state": "each torch trainer's flat layout", "sharded_state": "each torch trainer's flat layout",
    "compute_groups": "torchfunc keeps its embeddings fp32",
    "state_layout": "JAX's shardings of the state / the torch trainers' flat buffers, Muon's matrices whole",
    "gather_state": "each framework's collectives",
    "device_state_bytes": "each trainer's layout of the state",
    "evaluate_val": "JAX places batches on its mesh; the torch trainers all-reduce",
    "evaluate_hellaswag": "each framework's compiled row losses", "generate": "each framework's sampler",
    "out_of_memory_is_an_error": "each framework's out-of-memory exception",
    "lost_processes": "the roll call in each framework's store: torch's TCPStore, jax.distributed's client",
    "a_lost_process_is_an_error": "each framework's failed-collective exception",
    "peak_memory_gb": "JAX reads its devices' memory statistics, torch its allocator's",
    "log_event": "the Triton trainer logs triton-<backend>",
    # the speedrun recipe's model and optimizers (JAX and torchfunc)
    "rotary": "the speedrun model in each framework",
    "speedrun_block": "the speedrun model in each framework",
    "speedrun_transformer": "the speedrun model in each framework",
    "speedrun_logits": "the speedrun model in each framework (the Triton trainer's: the soft cap alone, "
                       "after the op interface's matmul)",
    "newton_schulz": "jnp with a fori_loop / torch",
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


def section_names(text):
    """The top-level names a section's text defines."""
    names = set()
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            names.add(node.targets[0].id)
    return names


def test_siblings_share_their_common_code():
    """Each SHARED_SECTIONS section is the same text in each trainer of its group, and each IDENTICAL
    name has the same source there (the failure shows the diff); every other name that two trainers define
    is a listed DIFFERENT one: a new shared helper must go into a shared section or one of the lists."""
    defs = {name: top_level(path) for name, path in TRAINERS.items()}
    found = {name: dict(sections(path)) for name, path in TRAINERS.items()}
    drifted = []

    def compare(group, label, get):
        first = get(group[0])
        assert first is not None, f"{label} is not in {TRAINERS[group[0]]}"
        for other in group[1:]:
            text = get(other)
            assert text is not None, f"{label} is not in {TRAINERS[other]}"
            if text != first:
                drifted.append("\n".join(difflib.unified_diff(
                    first.splitlines(), text.splitlines(), TRAINERS[group[0]], TRAINERS[other],
                    lineterm="", n=1)))
    for group, titles in SHARED_SECTIONS.items():
        for title in titles:
            compare(group, f"section {title!r}", lambda t: found[t].get(title))
    for group, names in IDENTICAL.items():
        for name in names:
            compare(group, name, lambda t: defs[t].get(name))
    assert not drifted, "shared code drifted apart:\n" + "\n".join(drifted)
    shared = {group: set(names) for group, names in IDENTICAL.items()}
    for group, titles in SHARED_SECTIONS.items():
        shared[group] |= {n for title in titles for n in section_names(found[group[0]][title])}
    covered = {(name, a, b) for group, names in shared.items() for name in names for a in group for b in group}
    unlisted = sorted({name for a in defs for b in defs if a < b for name in set(defs[a]) & set(defs[b])
                       if (name, a, b) not in covered and name not in DIFFERENT})
    assert not unlisted, f"defined in two trainers but in no shared section, IDENTICAL or DIFFERENT: {unlisted}"
    everywhere = {name for a in defs for b in defs if a < b for name in set(defs[a]) & set(defs[b])}
    assert set(DIFFERENT) <= everywhere, f"stale DIFFERENT entries: {sorted(set(DIFFERENT) - everywhere)}"


def test_the_sibling_check_catches_a_drift(monkeypatch):
    """The check above fails when one trainer alone changes a shared section (here lr_at's, in the Triton
    trainer's source as test_siblings reads it) or an IDENTICAL function (cosine_lr)."""
    real_sections, real_top_level = sections, top_level

    def drifted_sections(path):
        found = real_sections(path)
        if path == TRAINERS["triton"]:
            found = [(t, text.replace("RECIPES[cfg.recipe].lr_at(it, cfg)", "cosine_lr(it, cfg)"))
                     for t, text in found]
        return found

    def drifted_top_level(path):
        defs = real_top_level(path)
        if path == TRAINERS["triton"]:
            defs["cosine_lr"] = defs["cosine_lr"].replace("min(ratio, 1.0)", "ratio")
        return defs
    monkeypatch.setitem(globals(), "sections", drifted_sections)
    with pytest.raises(AssertionError, match="cosine_lr\\(it, cfg\\)"):
        test_siblings_share_their_common_code()
    monkeypatch.setitem(globals(), "sections", real_sections)
    monkeypatch.setitem(globals(), "top_level", drifted_top_level)
    with pytest.raises(AssertionError, match="min\\(ratio"):
        test_siblings_share_their_common_code()


def docstring_map(path):
    """The section titles that a trainer's module docstring lists under `Map:`, in order."""
    module = importlib.import_module(path[:-3])
    block = module.__doc__.split("\nMap:", 1)[1].split("\n")[1:]
    return [re.split(r"\s{2,}", line.strip())[0] for line in block if line.startswith("    ")]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_the_map_lists_the_sections(trainer):
    """A trainer's docstring map names its banner sections, all of them, in file order."""
    assert docstring_map(TRAINERS[trainer]) == [title for title, _ in sections(TRAINERS[trainer])]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_one_story(trainer):
    """GPT-2 first (config, model, AdamW and the lr schedule, training step), then the speedrun recipe's one
    section, then the shared plumbing in SHARED_SECTIONS' order, then main; and no code outside a recipe's
    section tests a recipe's name."""
    titles = [title for title, _ in sections(TRAINERS[trainer])]
    gpt2 = ["GPT-2: config", "GPT-2: model", "GPT-2: AdamW and the lr schedule", "GPT-2: training step"]
    assert [t for t in titles if t in gpt2] == gpt2 and titles[:1] == gpt2[:1]
    speedrun = titles.index("Recipe: speedrun")
    assert all(titles.index(t) < speedrun for t in gpt2)
    plumbing = [t for group, ts in SHARED_SECTIONS.items() if trainer in group for t in ts]
    at = [titles.index(t) for t in plumbing]
    assert at == sorted(at) and at[0] > speedrun and titles.index("Main") > at[-1], titles
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


def test_triton_trainer_reads_training_first():
    """train_gpt2_triton.py: the training path (GPT-2's ops, model, backward and step, the speedrun recipe,
    the plumbing, main) comes before the first Triton kernel, the kernels (and backend triton's table)
    before the self-test and the profiler."""
    with open(os.path.join(REPO, TRAINERS["triton"])) as f:
        lines = f.read().splitlines()
    at = {name: next(i for i, line in enumerate(lines) if line.startswith(prefix)) for name, prefix in (
        ("ops", "# GPT-2: ops"), ("model", "# GPT-2: model"), ("backward", "# GPT-2: backward"),
        ("step", "# GPT-2: training step"), ("speedrun", "# Recipe: speedrun"), ("data", "# Data"),
        ("main", "def main("), ("first kernel", "@triton.jit"), ("triton table", "TRITON_OPS = "),
        ("self-test", "# Self-test"), ("profiling", "# Profiling"))}
    assert list(at) == sorted(at, key=at.get), at


def test_the_lines_table_is_the_files():
    """docs/RESULTS.md's lines-per-part table is what bench/lines.py counts in the trainers now: a section
    that grows, shrinks or moves without the table regenerated fails here."""
    spec = importlib.util.spec_from_file_location("bench_lines", os.path.join(REPO, "bench", "lines.py"))
    lines = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lines)
    assert lines.published_table() == lines.table(), "docs/RESULTS.md's table is stale: run python bench/lines.py"


def test_the_activation_table_is_the_accounting():
    """README's activation table is what each trainer's activation_bytes gives now (bench/activations.py),
    and in each trainer and recipe no level holds more than the one before it."""
    spec = importlib.util.spec_from_file_location("bench_activations",
                                                  os.path.join(REPO, "bench", "activations.py"))
    activations = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(activations)
    table = activations.table()
    assert activations.readme_table() == table, "README.md's table is stale: run python bench/activations.py"
    rows = [[float(c.replace(",", "")) for c in line.strip("|").split("|")[2:]] for line in table.splitlines()[2:]]
    for recipe in range(0, len(rows), 3):
        none, pointwise, block = rows[recipe:recipe + 3]
        assert all(a >= b >= c for a, b, c in zip(none, pointwise, block)) and all(a > c for a, c in zip(none, block))
