"""trainkit: what every trainer of this repository needs alike, framework-free, as llm.c's trainers include llmc/;
this module holds the one-line errors."""
import errno
import os
import stat

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a full quota, a file-size limit reached


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
    if e.errno in DISK_FULL:
        return f"cannot write {path}: no space left, the disk is full (free some; --resume auto continues)"
    return f"cannot write {path}: {e.strerror}"


def require_file(path, what):
    """Stops in one line unless `path` is a regular file (reading a FIFO would wait forever)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:  # absent, a link loop: convert_hf.py has no OSError boundary of its own
        die(f"{what} {path}: {e.strerror}")
    if not stat.S_ISREG(mode):
        found = next((os.path.join(path, f) for f in ("model.bin", "model.safetensors")
                      if os.path.isfile(os.path.join(path, f))), None)
        hint = f": a checkpoint directory; give its {found}, or --resume {path}" if found else ""
        die(f"{what} {path} is not a regular file{hint}")
