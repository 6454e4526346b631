"""The three GPT-2 trainers as siblings, and every script's flags: the code the trainers share stays the
same in each (a listed function changed in one trainer only fails here), every difference is a listed,
deliberate one, every flag of every script explains itself, and the Triton trainer reads training-first."""
import ast
import contextlib
import difflib
import importlib
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

# Top-level functions, classes and constants whose source must be the same, character for character, in
# each trainer of the group: config and flags, the model's shapes and init, the lr schedule, the data
# loader, model files and checkpoints, the evaluation log, the printed step line.
IDENTICAL = {
    ("jax", "torchfunc", "triton"): [
        "VOCAB_SIZE", "PADDED_VOCAB_SIZE", "EOT", "MODEL_PRESETS", "die", "parse_args", "apply_model_header",
        "PARAM_NAMES", "DECAY_NAMES", "param_shapes", "init_params_numpy", "lr_at", "grad_accum_steps",
        "SHARD_MAGIC", "SYNTHETIC_TOKENS", "GET_DATA", "read_shard", "find_shards", "DataLoader",
        "step_batches", "MODEL_MAGIC", "write_model_file", "read_model_file", "save_checkpoint",
        "latest_checkpoint", "DAMAGED_NPZ_ERRORS", "load_checkpoint", "HELLASWAG_MIN_WIDTH",
        "VAL_BAR_MIN_STEPS", "val_batches", "PEAK_FLOPS", "model_flops_per_token", "peak_flops",
        "drop_partial_log_line", "write_failure", "prepare_out_dir", "logged_evals", "format_step",
        "PROFILE_STEPS", "due", "CENSUS_SECONDS",
        # the speedrun recipe: its defaults, shapes, init, schedule and model files
        "RECIPES", "SPEEDRUN_LRS", "SPEEDRUN_DEFAULTS", "HEAD_DIM", "speedrun_shapes", "muon_names",
        "init_speedrun_numpy", "rotary_freq_numpy", "SPEEDRUN_COOLDOWN", "speedrun_lrs", "adamw_group",
        "SAFETENSORS_TYPES", "write_safetensors", "read_safetensors", "write_speedrun_file",
        "read_speedrun_file", "MODEL_FILES", "read_weights", "ATTN_SCALE", "SOFTCAP"],
    # the two torch trainers: processes, ZeRO-1's flat buffers, tensors to and from numpy
    ("torchfunc", "triton"): [
        "FLAT_ALIGN", "flat_layout", "flat_views", "shard_ranges", "put_batch", "to_numpy", "to_device",
        "evaluate_val", "setup_device", "out_of_memory_is_an_error", "lost_processes",
        "a_lost_process_is_an_error", "gather_state",
        # the speedrun recipe: Muon's orthogonalization, ZeRO-1's whole matrices
        "newton_schulz", "whole_matrix_layout", "state_layout"],
    # the two that write the model as functions of a weights dict
    ("jax", "torchfunc"): ["EMBEDDINGS", "LAYER_NAMES", "TABLES"],
}
# Names two or more trainers define differently, on purpose.
DIFFERENT = {
    "FRAMEWORK": "each trainer's own name in log.jsonl",
    "Config": "the shared fields, then each trainer's own (JAX: attention, scan, processes; torchfunc: "
              "compile; triton: backend, --test, --bench-ops)",
    "ZERO_STAGES": "JAX also shards the weights (stage 3)",
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


def test_siblings_share_their_common_code():
    """Every IDENTICAL name has the same source in each trainer of its group (the failure shows the
    diff), and every other name that two trainers define is a listed DIFFERENT one: a new shared helper
    must be listed as the one or the other."""
    defs = {name: top_level(path) for name, path in TRAINERS.items()}
    drifted = []
    for group, names in IDENTICAL.items():
        for name in names:
            first = defs[group[0]].get(name)
            assert first is not None, f"{name} is not defined in {TRAINERS[group[0]]}"
            for other in group[1:]:
                source = defs[other].get(name)
                assert source is not None, f"{name} is not defined in {TRAINERS[other]}"
                if source != first:
                    drifted.append("\n".join(difflib.unified_diff(
                        first.splitlines(), source.splitlines(), TRAINERS[group[0]], TRAINERS[other],
                        lineterm="", n=1)))
    assert not drifted, "shared code drifted apart:\n" + "\n".join(drifted)
    covered = {(name, a, b) for group, names in IDENTICAL.items() for name in names
               for a in group for b in group}
    unlisted = sorted({name for a in defs for b in defs if a < b for name in set(defs[a]) & set(defs[b])
                       if (name, a, b) not in covered and name not in DIFFERENT})
    assert not unlisted, f"defined in two trainers but neither IDENTICAL nor DIFFERENT: {unlisted}"
    shared = {name for a in defs for b in defs if a < b for name in set(defs[a]) & set(defs[b])}
    assert set(DIFFERENT) <= shared, f"stale DIFFERENT entries: {sorted(set(DIFFERENT) - shared)}"


def test_the_sibling_check_catches_a_drift(monkeypatch):
    """The check above fails when one trainer alone changes a shared function (here lr_at, in the Triton
    trainer's source as test_siblings reads it)."""
    real = top_level

    def drifted(path):
        defs = real(path)
        if path == TRAINERS["triton"]:
            defs["lr_at"] = defs["lr_at"].replace("min(ratio, 1.0)", "ratio")
        return defs
    monkeypatch.setitem(globals(), "top_level", drifted)
    with pytest.raises(AssertionError, match="lr_at|min\\(ratio"):
        test_siblings_share_their_common_code()


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
    """train_gpt2_triton.py: the training path (config, ops and backend torch, model, backward, optimizer,
    data, checkpoints, evaluation, logging, main) comes before the first Triton kernel, the kernels
    (and backend triton's table) before the self-test and the profiler."""
    with open(os.path.join(REPO, TRAINERS["triton"])) as f:
        lines = f.read().splitlines()
    at = {name: next(i for i, line in enumerate(lines) if line.startswith(prefix)) for name, prefix in (
        ("ops", "# Ops"), ("model", "# Model"), ("optimizer", "# Optimizer"), ("data", "# Data"),
        ("main", "def main("), ("first kernel", "@triton.jit"), ("triton table", "TRITON_OPS = "),
        ("self-test", "# Self-test"), ("profiling", "# Profiling"))}
    assert list(at) == sorted(at, key=at.get), at
