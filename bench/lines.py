"""What a framework costs in lines: each GPT-2 trainer's parts (its framework's GPT-2, its own plumbing,
the speedrun recipe, the shared plumbing it carries, main; the Triton trainer's kernels and tools) beside
llm.c's train_gpt2.py, counted from the files' banner sections.

    python bench/lines.py            # the table, as README.md holds it
    python bench/lines.py --write    # the table into README.md, between its markers
    python bench/lines.py --check    # exit 1 when README.md's table is not what the files give

Every line counts (comments and blank lines too: a reader reads them); a section runs from its banner to
the next banner, and the module docstring and imports are the first row.
"""
import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["train_gpt2_jax.py", "train_gpt2_torchfunc.py", "train_gpt2_triton.py"]
BANNER = "# " + "-" * 77
PARTS = ["docstring, map, imports", "GPT-2 in the framework", "the framework's plumbing", "recipe: speedrun",
         "shared plumbing", "shared torch plumbing", "main", "Triton kernels and tools", "total"]
# llm.c's train_gpt2.py at f1e2ace651495b74ae22d45d1723443fd00ecd3a (860 lines), by its banners: the
# nn.Modules and the GPT model; its data loader and the .bin writers; its main
LLMC = {"docstring, map, imports": 36, "GPT-2 in the framework": 262, "shared plumbing": 227, "main": 335,
        "total": 860}
START, END = "<!-- lines-table -->", "<!-- /lines-table -->"
DOC = "README.md"


def part_of(title):
    """The row a banner section counts toward."""
    if title.startswith("GPT-2: "):
        return "GPT-2 in the framework"
    if title.startswith("Shared torch plumbing"):
        return "shared torch plumbing"
    if title.startswith("Shared plumbing"):
        return "shared plumbing"
    if " plumbing" in title:
        return "the framework's plumbing"
    if title == "Main":
        return "main"
    if title.startswith("Recipe: ") or title == "Triton kernels: speedrun":
        return "recipe: speedrun"
    return "Triton kernels and tools"


def count(path):
    """{part: lines} of one trainer."""
    with open(os.path.join(REPO, path)) as f:
        lines = f.read().rstrip("\n").split("\n")
    parts, part = dict.fromkeys(PARTS, 0), PARTS[0]
    for i, line in enumerate(lines):
        if line == BANNER and i + 1 < len(lines) and lines[i + 1].startswith("# "):
            part = part_of(lines[i + 1][2:])
        parts[part] += 1
    parts["total"] = len(lines)
    return parts


def table():
    counts = {f: count(f) for f in FILES}
    rows = ["| part | " + " | ".join(f"`{f}`" for f in FILES) + " | llm.c's `train_gpt2.py` |",
            "|---|" + "---:|" * (len(FILES) + 1)]
    for part in PARTS:
        cells = [f"{counts[f][part]:,}" if counts[f][part] else "" for f in FILES]
        rows.append(f"| {part} | " + " | ".join(cells) + f" | {LLMC[part]:,} |" if part in LLMC else
                    f"| {part} | " + " | ".join(cells) + " |  |")
    return "\n".join(rows)


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
    p.add_argument("--write", action="store_true", help=f"write the table into {DOC}, between its markers")
    args = p.parse_args(argv)
    if args.write:
        published_table()  # its markers are there
        with open(os.path.join(REPO, DOC)) as f:
            head, rest = f.read().split(START, 1)
        with open(os.path.join(REPO, DOC), "w") as f:
            f.write(f"{head}{START}\n{table()}\n{END}{rest.split(END, 1)[1]}")
        return 0
    if args.check:
        if published_table() != table():
            print(f"{DOC}'s lines table is stale: run python bench/lines.py and paste it", file=sys.stderr)
            return 1
        print(f"{DOC}'s lines table matches the files")
        return 0
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
