"""What each framework costs in code: lines per part of the three GPT-2 trainers, for the gpt2 recipe and
what the speedrun recipe adds, counted from the files' banner sections (and the `# -- part` sub-banners
inside a recipe's section).

    python bench/lines.py            # the table, as docs/RESULTS.md's "Code: lines per part" holds it
    python bench/lines.py --check    # exit 1 when docs/RESULTS.md's table is not what the files give

Every line counts (comments and blank lines too: they are part of what a reader reads); a section's lines
run from its banner to the next banner. The module docstring and imports count as "docstring, map and
imports".
"""
import argparse
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = {"JAX": "train_gpt2_jax.py", "torchfunc": "train_gpt2_torchfunc.py",
            "Triton": "train_gpt2_triton.py"}
BANNER = "# " + "-" * 77
SUB_BANNER = re.compile(r"^# -- (.+)$")
RECIPE_SECTIONS = ("Recipe: speedrun", "Triton kernels: speedrun")
PARTS = ["docstring, map and imports", "config", "ops", "model", "backward", "optimizer", "training step",
         "model files", "shared plumbing", "own plumbing", "main", "kernels", "tools"]
SHARED = ("Flags and recipe lookups", "Data", "Checkpoints", "Evaluation and logging",
          "Torch: processes, ZeRO-1 and failures")
START, END = "<!-- lines-table -->", "<!-- /lines-table -->"


def part_of(title):
    """The part a (non-recipe) banner section counts toward."""
    if title in SHARED:
        return "shared plumbing"
    if title.startswith("GPT-2: "):
        rest = title[len("GPT-2: "):]
        return {"AdamW and the lr schedule": "optimizer"}.get(rest, rest)
    if " plumbing" in title:
        return "own plumbing"
    if title == "Main":
        return "main"
    if title.startswith(("Triton kernels", "Backend triton")):
        return "kernels"
    if title.startswith(("Self-test", "Profiling")):
        return "tools"
    raise SystemExit(f"error: no part for the section {title!r}")


def count(path):
    """({part: lines} of the gpt2 recipe and everything shared, {part: lines} the speedrun recipe adds)."""
    with open(os.path.join(REPO, path)) as f:
        lines = f.read().rstrip("\n").split("\n")
    base, extra = dict.fromkeys(PARTS, 0), dict.fromkeys(PARTS, 0)
    where, part = base, "docstring, map and imports"
    for i, line in enumerate(lines):
        if line == BANNER and i + 1 < len(lines) and lines[i + 1].startswith("# "):
            title = lines[i + 1][2:]
            if title in RECIPE_SECTIONS:
                where, part = extra, "kernels" if title.startswith("Triton") else "config"
            else:
                where, part = base, part_of(title)
        elif where is extra and SUB_BANNER.match(line):
            part = SUB_BANNER.match(line).group(1)
            if part not in PARTS:
                raise SystemExit(f"error: {path}:{i + 1}: unknown part {part!r} (parts: {', '.join(PARTS)})")
        where[part] += 1
    return base, extra


def table():
    """The markdown table: a row per part, two columns per trainer."""
    counts = {name: count(path) for name, path in TRAINERS.items()}
    head = "| part | " + " | ".join(f"{n}: gpt2 | + speedrun" for n in counts) + " |"
    rows = [head, "|---|" + "---:|" * (2 * len(counts))]
    for part in PARTS + ["total"]:
        cells = []
        for base, extra in counts.values():
            b, e = (sum(base.values()), sum(extra.values())) if part == "total" else (base[part], extra[part])
            cells += [str(b) if b else "", f"+{e}" if e else ""]
        if any(cells):
            rows.append(f"| {part} | " + " | ".join(cells) + " |")
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
