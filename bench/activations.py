"""What --recompute saves: the MB that one micro-batch's activations hold on a device, by level, recipe and
trainer, for d12 at T = 1024, B = 16 in bf16, from each trainer's own accounting (activation_bytes, the
figure its start line prints and its start event logs).

    python bench/activations.py            # the table, as docs/RESULTS.md's "Activation memory by trainer" holds it
    python bench/activations.py --check    # exit 1 when docs/RESULTS.md's table is not what the trainers give

The accounting is checked against measured peaks on the CPU by tests/test_recompute_*.py.
"""
import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

TRAINERS = {"JAX": "train_gpt2_jax", "torchfunc": "train_gpt2_torchfunc", "Triton": "train_gpt2_triton"}
FLAGS = ["--model", "d12", "--seq-len", "1024", "--batch-size", "16", "--dtype", "bf16"]
START, END = "<!-- activations-table -->", "<!-- /activations-table -->"


def table():
    """The markdown table: a row per recipe and level, a column per trainer, MB per micro-batch."""
    import importlib

    modules = {name: importlib.import_module(module) for name, module in TRAINERS.items()}
    levels, recipes = modules["JAX"].RECOMPUTE_LEVELS, list(modules["JAX"].RECIPES)
    rows = ["| recipe | --recompute | " + " | ".join(modules) + " |",
            "|---|---|" + "---:|" * len(modules)]
    for recipe in recipes:
        for level in levels:
            cells = []
            for name, m in modules.items():
                backend = ["torch"] if name == "Triton" else []
                cfg, _ = m.parse_args([*backend, *FLAGS, "--recipe", recipe, "--recompute", level])
                cells.append(f"{m.RECIPES[cfg.recipe].activation_bytes(cfg) / 1e6:,.0f}")
            rows.append(f"| {recipe} | {level} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def published_table():
    """The table between docs/RESULTS.md's markers."""
    with open(os.path.join(REPO, "docs", "RESULTS.md")) as f:
        text = f.read()
    if START not in text or END not in text:
        raise SystemExit(f"error: docs/RESULTS.md has no {START} ... {END} block")
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with docs/RESULTS.md's table; exit 1 if they differ")
    args = p.parse_args(argv)
    if args.check:
        if published_table() != table():
            print("docs/RESULTS.md's activation table is stale: run python bench/activations.py and paste it",
                  file=sys.stderr)
            return 1
        print("docs/RESULTS.md's activation table matches the trainers' accounting")
        return 0
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
