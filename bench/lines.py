"""What each framework costs in code: lines per file and part of the three GPT-2 trainers (the Triton
trainer with its kernels and tools files), for the gpt2 recipe and what the speedrun recipe adds, counted
from the files' banner sections (and the `# -- part` sub-banners inside a recipe's section); then the
shared package trainkit/, module by module.

    python bench/lines.py            # the table, as docs/RESULTS.md's "Code: lines per part" holds it
    python bench/lines.py --check    # exit 1 when docs/RESULTS.md's table is not what the files give

Every line counts (comments and blank lines too: they are part of what a reader reads); a section's lines
run from its banner to the next banner. A trainer's module docstring and imports count as "docstring, map
and imports"; those of a file beside it, toward the part of its first section.
"""
import argparse
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# each trainer's files: the trainer first, then the files it imports for its kernels and tools
TRAINERS = {"JAX": ["train_gpt2_jax.py"], "torchfunc": ["train_gpt2_torchfunc.py"],
            "Triton": ["train_gpt2_triton.py", "triton_kernels.py", "triton_kernels_speedrun.py",
                       "triton_tools.py"]}
BANNER = "# " + "-" * 77
SUB_BANNER = re.compile(r"^# -- (.+)$")
RECIPE_SECTIONS = ("Recipe: speedrun", "Triton kernels: speedrun")
PARTS = ["docstring, map and imports", "config", "ops", "model", "backward", "optimizer", "training step",
         "own plumbing", "main", "kernels", "tools"]
# the shared package, which every trainer imports: each module, and what it holds
SHARED_MODULES = {
    "trainkit/__init__.py": "the one-line errors", "trainkit/flags.py": "the shared flags",
    "trainkit/gpt2.py": "llm.c's GPT-2 without a framework", "trainkit/data.py": "shards and the loader",
    "trainkit/checkpoints.py": "checkpoints and the out dir", "trainkit/logs.py": "log.jsonl and the lines",
    "trainkit/signals.py": "signals and divergence", "trainkit/torch_shared.py": "torch only, both torch trainers",
    "trainkit/speedrun.py": "the speedrun recipe without a framework"}
SPEEDRUN_MODULE = "trainkit/speedrun.py"
START, END = "<!-- lines-table -->", "<!-- /lines-table -->"


def part_of(title):
    """The part a (non-recipe) banner section counts toward."""
    if title.startswith("GPT-2: "):
        rest = title[len("GPT-2: "):]
        return {"AdamW and the lr schedule": "optimizer"}.get(rest, rest)
    if " plumbing" in title:
        return "own plumbing"
    if title == "Main":
        return "main"
    if title.startswith(("Triton kernels", "Backend triton")):
        return "kernels"
    if title.startswith(("Self-test", "Profiling", "The tools of each recipe")):
        return "tools"
    raise SystemExit(f"error: no part for the section {title!r}")


def count(path, beside):
    """({part: lines} of the gpt2 recipe and everything shared, {part: lines} the speedrun recipe adds) in
    one file; `beside`: a file beside its trainer, whose docstring and imports count toward its first
    section."""
    base, extra = dict.fromkeys(PARTS, 0), dict.fromkeys(PARTS, 0)
    with open(os.path.join(REPO, path)) as f:
        lines = f.read().rstrip("\n").split("\n")
    where, part, head = base, "docstring, map and imports", 0
    for i, line in enumerate(lines):
        if line == BANNER and i + 1 < len(lines) and lines[i + 1].startswith("# "):
            title = lines[i + 1][2:]
            if title in RECIPE_SECTIONS:
                where, part = extra, "kernels" if title.startswith("Triton") else "config"
            else:
                where, part = base, part_of(title)
            if head:
                where[part], head = where[part] + head, 0
        elif where is extra and SUB_BANNER.match(line):
            part = SUB_BANNER.match(line).group(1)
            if part not in PARTS:
                raise SystemExit(f"error: {path}:{i + 1}: unknown part {part!r} (parts: {', '.join(PARTS)})")
        if beside and part == "docstring, map and imports":
            head += 1
        else:
            where[part] += 1
    return base, extra


def module_lines(path):
    """The lines of a trainkit module, all of them."""
    with open(os.path.join(REPO, path)) as f:
        return len(f.read().rstrip("\n").split("\n"))


def table():
    """The markdown table: a row per file and part, the gpt2 recipe's lines (with everything shared) and
    what the speedrun recipe adds; then trainkit's modules, which every trainer imports."""
    rows = ["| file | part | gpt2 | + speedrun |", "|---|---|---:|---:|"]
    for paths in TRAINERS.values():
        for n, path in enumerate(paths):
            base, extra = count(path, beside=n > 0)
            for part in PARTS:
                if base[part] or extra[part]:
                    rows.append(f"| {path} | {part} | {base[part] or ''} | {f'+{extra[part]}' if extra[part] else ''} |")
            rows.append(f"| {path} | total | {sum(base.values())} | +{sum(extra.values())} |")
    for path in SHARED_MODULES:
        lines = module_lines(path)
        gpt2, speedrun = ("", f"+{lines}") if path == SPEEDRUN_MODULE else (lines, "")
        rows.append(f"| {path} | {SHARED_MODULES[path]} | {gpt2} | {speedrun} |")
    return "\n".join(rows)


DOC = os.path.join("docs", "RESULTS.md")  # where the table is published


def published_table():
    """The table between DOC's markers."""
    with open(os.path.join(REPO, DOC)) as f:
        text = f.read()
    if START not in text or END not in text:
        raise SystemExit(f"error: {DOC} has no {START} ... {END} block")
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help=f"compare with {DOC}'s table; exit 1 if they differ")
    args = p.parse_args(argv)
    if args.check:
        if published_table() != table():
            print(f"{DOC}'s lines-per-part table is stale: run python bench/lines.py and paste it",
                  file=sys.stderr)
            return 1
        print(f"{DOC}'s lines-per-part table matches the files")
        return 0
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
