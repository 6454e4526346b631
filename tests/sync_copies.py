"""The copies the scripts carry on purpose (each trainer stands alone): the GPT-2 trainers' shared sections
are the same text, and a top-level function, class or constant that two of FILES define is the same text
in both, unless DIFFERENT (the GPT-2 trainers' framework parts) or OWN (another script's own version)
names it.

    python tests/sync_copies.py FILE       # carry FILE's version of every name it shares to every copy
    python tests/sync_copies.py --check    # the names whose copies differ, with a diff; exit 1 if any
"""
import ast
import difflib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["train_gpt2_jax.py", "train_gpt2_torchfunc.py", "train_gpt2_triton.py", "train_aiayn_jax.py",
         "convert_hf.py", "hellaswag.py", "tokenizer.py"]
MODEL = "the model in each framework"
# Names that the GPT-2 trainers define each in their framework's terms: they keep the same names, so that a
# diff of two trainers lines them up
DIFFERENT = {
    "FRAMEWORK": "each trainer's own name in log.jsonl",
    "Config": "the shared flags, then each trainer's own (JAX: attention, scan, processes; torchfunc: compile; "
              "triton: backend, --test, --bench-ops)",
    "Recipe": "the shared fields, then each trainer's own (its model and update functions)",
    "RECIPES": "each trainer's rows: its own model and update functions",
    "ZERO_STAGES": "JAX also shards the weights (stage 3)",
    "framework_flags": "each trainer's own flags",
    "main": "the same steps in the same order, in each framework's terms",
    "gpt2_activation_bytes": "what each framework's backward keeps at each --recompute level",
    "speedrun_activation_bytes": "what each framework's backward keeps at each --recompute level",
    "recomputed": "--recompute in each framework's terms (jax.checkpoint policies; autograd.Functions)",
    "EMBEDDINGS": "the tables JAX and torchfunc keep fp32 in bf16 runs",
    "forward": MODEL, "token_losses": MODEL, "loss_fn": MODEL, "compute_dtype": MODEL, "attention": MODEL,
    "block": MODEL, "transformer": MODEL, "next_logits": MODEL,
    "global_norm": "each framework's function", "adamw_update": "each framework's function",
    "adam_scalars": "a jitted step's inputs: host arrays in JAX, device tensors in torchfunc",
    "train_step": "each framework's step", "make_state": "each torch trainer's flat layout",
    "compute_groups": "torchfunc keeps its embeddings fp32",
    "device_state_bytes": "each trainer's layout of the state", "generate": "each framework's sampler",
    "rotary": "the speedrun model in each framework", "speedrun_block": "the speedrun model in each framework",
    "speedrun_transformer": "the speedrun model in each framework",
    "speedrun_logits": "the speedrun model in each framework (the Triton trainer's: the soft cap alone)",
    "speedrun_adamw": "JAX returns one tensor's new state / torchfunc's multi-tensor ops in place",
    "speedrun_muon": "JAX returns the new weights and buffers / torchfunc updates them in place",
    "speedrun_forward": "the speedrun model in each framework",
    "speedrun_next_logits": "the speedrun model in each framework",
    "speedrun_token_losses": "the speedrun model in each framework",
    "speedrun_scalars": "host arrays in JAX, device tensors in torchfunc",
    "speedrun_update": "JAX returns the new state / torchfunc updates it in place / the Triton trainer through "
                       "its op interface",
}
# The other scripts' own versions of names that the trainers also define: compared with no other file's
OWN = {
    # JAX's own of what the two torch trainers share (their copies are held equal): jnp, shardings, its
    # jitted evaluation, its device stats, errors and processes
    "train_gpt2_jax.py": {"newton_schulz", "fp8_quantize", "state_layout", "evaluate_val", "evaluate_hellaswag",
                          "peak_memory_gb", "fail_on_out_of_memory", "fail_on_lost_peer", "say_samples"},
    "train_aiayn_jax.py": {"Config", "FRAMEWORK", "LN_EPS", "MODEL_PRESETS", "PARAM_NAMES", "RECIPES",
                           "adam_scalars", "forward", "layernorm", "linear", "load_checkpoint", "main",
                           "param_shapes", "parse_args", "save_checkpoint", "train_step"},  # another model
    "convert_hf.py": {"main", "parse_args"},
    "hellaswag.py": {"die", "main", "parse_args"},  # die: says the same, without the shared block
    "tokenizer.py": {"die", "main", "read_shard"},  # read_shard: raises ValueError for its callers
}


# Sections the GPT-2 trainers carry whole (the torch one, the two torch trainers): the same text, comments too
SHARED_SECTIONS = ("Shared plumbing", "Shared torch plumbing")
TRAINERS = FILES[:3]
BANNER = "# " + "-" * 77 + "\n# "


def section(text, title):
    """(start, end) of the banner section whose title starts with `title`, else None."""
    start = text.find(BANNER + title)
    if start < 0:
        return None
    end = text.find("\n" + BANNER, start + 1)
    return start, (len(text) if end < 0 else end + 1)


def compared(name, a, b):
    """Whether the copies of `name` in files a and b must be the same text."""
    return name not in DIFFERENT and name not in OWN.get(a, ()) and name not in OWN.get(b, ())


def read(path):
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def top_level(text):
    """{name: (first line, last line)} (0-based, inclusive) of a file's top-level functions, classes
    (decorators included) and single-name assignments."""
    defs = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defs[node.name] = (min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1, node.end_lineno - 1)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            defs[node.targets[0].id] = (node.lineno - 1, node.end_lineno - 1)
    return defs


def source(text, span):
    return "\n".join(text.split("\n")[span[0]:span[1] + 1])


def drifted(texts):
    """[(name, file a, file b, unified diff)] of each shared name whose copies differ (DIFFERENT and OWN aside)."""
    defs = {f: top_level(t) for f, t in texts.items()}
    out = []
    for i, a in enumerate(TRAINERS):
        for b in TRAINERS[i + 1:]:
            for title in SHARED_SECTIONS:
                sa, sb = section(texts[a], title), section(texts[b], title)
                if sa and sb and texts[a][slice(*sa)] != texts[b][slice(*sb)]:
                    diff = "\n".join(difflib.unified_diff(texts[a][slice(*sa)].split("\n"),
                                                           texts[b][slice(*sb)].split("\n"), a, b, lineterm=""))
                    out.append((f"section {title}", a, b, diff))
    for i, a in enumerate(FILES):
        for b in FILES[i + 1:]:
            for name in sorted(n for n in set(defs[a]) & set(defs[b]) if compared(n, a, b)):
                sa, sb = source(texts[a], defs[a][name]), source(texts[b], defs[b][name])
                if sa != sb:
                    diff = "\n".join(difflib.unified_diff(sa.split("\n"), sb.split("\n"), a, b, lineterm=""))
                    out.append((name, a, b, diff))
    return out


def sync(origin, texts):
    """texts with origin's shared sections in the other GPT-2 trainers, and every name that `origin` shares with
    another file (DIFFERENT and OWN aside) replaced by origin's."""
    out = dict(texts)
    for f in TRAINERS:  # the shared sections whole, then the names one by one
        for title in SHARED_SECTIONS:
            theirs, ours = section(out[f], title), section(texts[origin], title)
            if f != origin and origin in TRAINERS and theirs and ours:
                out[f] = out[f][:theirs[0]] + texts[origin][slice(*ours)] + out[f][theirs[1]:]
    mine = top_level(texts[origin])
    for f in FILES:
        if f == origin:
            continue
        lines = out[f].split("\n")
        theirs = top_level(out[f])
        for name, span in sorted(theirs.items(), key=lambda kv: -kv[1][0]):  # bottom up: spans stay valid
            if name in mine and compared(name, origin, f):
                lines[span[0]:span[1] + 1] = source(texts[origin], mine[name]).split("\n")
        out[f] = "\n".join(lines)
    return out


def main(argv):
    texts = {f: read(f) for f in FILES}
    if argv == ["--check"]:
        found = drifted(texts)
        for name, a, b, diff in found:
            print(f"{name}: {a} and {b} differ\n{diff}\n")
        return 1 if found else 0
    if len(argv) != 1 or argv[0] not in FILES:
        raise SystemExit(f"error: give one of {', '.join(FILES)}, or --check")
    for f, text in sync(argv[0], texts).items():
        if text != texts[f]:
            with open(os.path.join(REPO, f), "w") as out:
                out.write(text)
            print(f"{f}: updated from {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
