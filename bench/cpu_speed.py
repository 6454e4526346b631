"""The three GPT-2 trainers and the references' own eager PyTorch code, side by side on the CPU: each
recipe's step at one shape, in fp32, timed in interleaved rounds (every contestant once per round, in an
order that turns from round to round, so that a burst of load on a shared machine falls on all of them),
and a table of the median ms per step with its ratio to the reference's.

    python bench/cpu_speed.py                                   # both recipes, L4 C256, B4 T64: minutes
    python bench/cpu_speed.py --recipes speedrun --rounds 5 --steps 6
    python bench/cpu_speed.py --recipes gpt2 --n-layer 12 --n-embd 768 --rounds 2   # GPT-2 124M
    python bench/cpu_speed.py --recipes speedrun --threads 1    # steadier on a machine others load

Each trainer runs as its command line does (`--data synthetic`), in a process of its own per round; its
step times are those its log.jsonl records, the first step (compilation, first touches) left out. The
references are the tests' ports, run in processes of their own with the same step counts: llm.c's
train_gpt2.py recipe (tests/llmc_reference.py: nn.Modules, autograd, torch.optim.AdamW, clipping) and
modded-nanogpt's train_gpt_simple.py (tests/speedrun_reference.py: its classes, torch.optim.AdamW and its
Muon), here in fp32 on random tokens.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a contestant's name: its command line after `python` (the references': this file's own child mode)
TRAINERS = {"train_gpt2_jax.py": ["train_gpt2_jax.py"],
            "train_gpt2_torchfunc.py": ["train_gpt2_torchfunc.py"],
            "train_gpt2_triton.py torch": ["train_gpt2_triton.py", "torch"]}
REFERENCES = {"gpt2": "llm.c's recipe, stock PyTorch eager (tests/llmc_reference.py)",
              "speedrun": "modded-nanogpt's classes and Muon, eager (tests/speedrun_reference.py)"}
HEAD_DIM = {"gpt2": 64, "speedrun": 128}  # the gpt2 runs get --n-embd / 64 heads; the speedrun's are 128 wide


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="gpt2,speedrun", help="comma-separated: gpt2, speedrun (default both)")
    p.add_argument("--n-layer", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--n-embd", type=int, default=256, help="width, a multiple of 128 (default 256)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--steps", type=int, default=4, help="steps per run, the first not timed (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="runs of every contestant (default 3)")
    p.add_argument("--threads", type=int, help="torch's threads in every process (OMP_NUM_THREADS; JAX keeps "
                   "its own pool) (default: torch's choice, one per core)")
    p.add_argument("--reference-child", choices=list(REFERENCES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    recipes = args.recipes.split(",")
    bad = [r for r in recipes if r not in REFERENCES]
    if bad or not recipes:
        p.error(f"--recipes {args.recipes}: each of them gpt2 or speedrun")
    if args.n_embd <= 0 or args.n_embd % 128:
        p.error(f"--n-embd {args.n_embd}: a positive multiple of 128 (the speedrun's heads are 128 wide)")
    for name in ("n_layer", "batch_size", "seq_len", "rounds", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")
    if args.steps < 2:
        p.error(f"--steps {args.steps}: at least 2 (the first step is not timed)")
    args.recipes = recipes
    return args


# -----------------------------------------------------------------------------
# The references' steps (child mode: one process per run, as the trainers get)

def reference_steps(recipe, args):
    """ms of each of args.steps steps of the recipe's reference in fp32 on random tokens from seed 0."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import torch
    import torch.nn.functional as F
    L, C, B, T = args.n_layer, args.n_embd, args.batch_size, args.seq_len
    gen = torch.Generator().manual_seed(0)

    def batch():
        x = torch.randint(0, 50257, (B, T + 1), generator=gen)                    # (B, T+1)
        return x[:, :-1], x[:, 1:]

    if recipe == "speedrun":
        import speedrun_reference as ref
        model = ref.GPT(L, C)  # fp32; its weights as the recipe draws them
        model.load_state_dict({k: torch.from_numpy(a) for k, a in ref.init_state_dict(L, C, 0).items()})
        adamw, muon = ref.make_optimizers(model)

        def step(it):
            model.zero_grad(set_to_none=True)
            x, y = batch()
            loss = F.cross_entropy(model(x).reshape(-1, ref.V), y.reshape(-1), reduction="sum")
            loss.backward()
            ref.optimizer_step(adamw, muon, it, args.steps)
            return loss.item()
    else:
        import llmc_reference as ref
        model = ref.GPT(L, C // HEAD_DIM["gpt2"], C, T)
        params = list(model.parameters())
        opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                 {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                lr=6e-4, betas=(0.9, 0.95), eps=1e-8)

        def step(it):
            opt.zero_grad(set_to_none=True)
            loss = model(*batch())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return loss.item()
    times = []
    for it in range(args.steps):
        t0 = time.perf_counter()
        step(it)
        times.append(1000 * (time.perf_counter() - t0))
    return times


# -----------------------------------------------------------------------------
# The rounds

def trainer_steps(command, recipe, args, out_dir):
    """ms of each step of one run of a trainer's command line, from its log.jsonl."""
    flags = ["--recipe", recipe, "--data", "synthetic", "--n-layer", args.n_layer, "--n-embd", args.n_embd,
             "--batch-size", args.batch_size, "--seq-len", args.seq_len,
             "--total-batch-size", args.batch_size * args.seq_len, "--steps", args.steps, "--dtype", "fp32",
             "--val-every", 0, "--hellaswag-every", 0, "--sample-every", 0, "--ckpt-every", 0,
             "--out-dir", out_dir]
    if recipe == "gpt2":
        flags += ["--n-head", args.n_embd // HEAD_DIM["gpt2"]]
    run([*command, *flags], args.threads)
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        events = [json.loads(line) for line in f]
    return [e["dt_ms"] for e in events if "dt_ms" in e]


def run(args, threads):
    """Runs `python args` from the repository root, with `threads` torch threads (None: torch's choice); its
    output, or a one-line error and exit 1."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        sys.exit(f"error: `python {' '.join(map(str, args))}` exited {proc.returncode}: {tail[0][:300]}")
    return proc.stdout


def child_flags(args):
    return ["--n-layer", args.n_layer, "--n-embd", args.n_embd, "--batch-size", args.batch_size,
            "--seq-len", args.seq_len, "--steps", args.steps]


def main(argv=None):
    args = parse_args(argv)
    if args.reference_child:
        print(json.dumps(reference_steps(args.reference_child, args)))
        return
    contestants = ["reference", *TRAINERS]
    times = {(r, c): [] for r in args.recipes for c in contestants}
    load_before = os.getloadavg()
    t_start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for recipe in args.recipes:
                k = rnd % len(contestants)
                for i, c in enumerate(contestants[k:] + contestants[:k]):  # each round starts one further on
                    if c == "reference":
                        out = run([os.path.abspath(__file__), "--reference-child", recipe, *child_flags(args)],
                                  args.threads)
                        steps = json.loads(out.strip().splitlines()[-1])
                    else:
                        steps = trainer_steps(TRAINERS[c], recipe, args, os.path.join(tmp, f"{recipe}_{rnd}_{i}"))
                    times[recipe, c] += steps[1:]  # the first step compiles and touches memory first
                    print(f"round {rnd + 1}/{args.rounds} {recipe:8s} {c:28s} "
                          + " ".join(f"{t:.0f}" for t in steps[1:]) + " ms", file=sys.stderr, flush=True)
    threads = f"{args.threads} torch thread(s)" if args.threads else "torch's default threads"
    print(f"CPU: {os.cpu_count()} cores, {threads} | load average (1 min) {load_before[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after | {time.time() - t_start:.0f} s in all")
    print(f"L{args.n_layer} C{args.n_embd}, B{args.batch_size} T{args.seq_len}, fp32 | median of "
          f"{args.rounds} rounds x {args.steps - 1} steps (each run's first step left out)")
    for recipe in args.recipes:
        ref = statistics.median(times[recipe, "reference"])
        print(f"\n| {recipe} recipe | ms per step | against the reference |\n|---|---:|---:|")
        for c in contestants:
            ms = statistics.median(times[recipe, c])
            name = REFERENCES[recipe] if c == "reference" else f"`{c}`"
            print(f"| {name} | {ms:,.0f} | {ms / ref:.2f} |")


if __name__ == "__main__":
    main()
