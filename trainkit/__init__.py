"""trainkit: what every trainer of this repository needs alike, framework-free, as llm.c's trainers
include llmc/. Each module opens with what it defines:

    trainkit.flags        the shared flags: RunConfig, RunRecipe, parse_args, model-shape checks
    trainkit.gpt2         llm.c's GPT-2 without a framework: vocabulary, shapes, init, model files, schedule
    trainkit.speedrun     the speedrun recipe without a framework: config, shapes, init, lrs, model files
    trainkit.data         llm.c's token shards, its loaders (in order, --shuffle's), the validation's batches
    trainkit.checkpoints  checkpoints, and the out dir: its lock, replaced_ and abandoned_ folders
    trainkit.logs         log.jsonl's start event, the step and memory lines, MFU
    trainkit.signals      SIGINT/SIGTERM at step boundaries, and the divergence stop
    trainkit.torch_shared   torch only: processes, ZeRO-1's flat layout, a lost process, out of memory
"""
import errno
import os
import stat


def die(msg):
    """Stops the run with a one-line error (SystemExit prints it to stderr and exits 1, no traceback)."""
    raise SystemExit(f"error: {msg}")


def die_out_of_memory(cfg, e):
    """The one line that ends a run out of device memory (exception `e`): a bad --batch-size or --recompute."""
    cheaper = "" if cfg.recompute == "block" else " or a cheaper --recompute"
    die(f"out of device memory at --batch-size {cfg.batch_size} --recompute {cfg.recompute} (try a smaller "
        f"batch{cheaper}): {str(e).splitlines()[0][:200]}")


def write_failure(path, e):
    """The one line that says why writing `path` failed, a full disk said as such."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"cannot write {path}: no space left, the disk is full (free some; --resume auto continues)"
    return f"cannot write {path}: {e.strerror}"


def require_file(path, what):
    """Stops in one line unless `path` is a regular file (symbolic links followed), saying what it is
    instead: absent, a link loop, a folder (a checkpoint's, whose model file it names), a FIFO or device."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        die(f"{what} {path} does not exist")
    except OSError as e:  # a link loop (ELOOP), a folder we may not enter, a name too long
        die(f"{what} {path} cannot be read: {e.strerror}")
    if stat.S_ISDIR(mode):
        inside = [f for f in ("model.bin", "model.safetensors") if os.path.isfile(os.path.join(path, f))]
        hint = (f": a checkpoint directory; give its {os.path.join(path, inside[0])}, or --resume {path}"
                if inside else "")
        die(f"{what} {path} is a directory, not a file{hint}")
    if not stat.S_ISREG(mode):
        die(f"{what} {path} is not a regular file (a FIFO or a device)")
