"""Checkpoints (docs/FORMATS.md) and the out dir that holds them: its lock, the replaced_ and abandoned_ folders,
which checkpoint --resume continues, and a run's start (open_run)."""
import contextlib
import datetime
import fcntl
import glob
import json
import os
import re
import shutil
import signal
import socket
import stat
import weakref
import zipfile
import zlib
from dataclasses import asdict
from tokenize import TokenError

import numpy as np

import hellaswag
from trainkit import die, require_file, write_failure
from trainkit.data import make_loaders
from trainkit.flags import apply_model_header
from trainkit.signals import STOP_SIGNALS


def read_weights(path, cfg, recipes):
    """(header, params) of a model file of cfg.recipe, a row of `recipes`; another recipe's file is refused."""
    require_file(path, "model file")
    with open(path, "rb") as f:
        head = f.read(9)
    recipe = recipes[cfg.recipe]
    for name, other in recipes.items():
        if other is not recipe and other.is_file(head) and not recipe.is_file(head):
            die(f"{path} is {other.file_kind}, the {name} recipe's (--recipe {name}): --recipe {cfg.recipe} "
                f"takes {recipe.file_kind}")
    return recipe.read_file(path)


def save_checkpoint(out_dir, step, params, m, v, loader_state, cfg, recipe):
    """<out_dir>/ckpt_<step>/{the recipe's model file, state.npz}, written to a temporary name, then renamed."""
    final = os.path.join(out_dir, f"ckpt_{step:07d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while saving this step
    names = list(recipe.shapes(cfg))  # m: every tensor's first moment (AdamW's, Muon's momentum), v: AdamW's second
    state = {f"m.{k}": np.asarray(m[k], np.float32) for k in names}
    state.update({f"v.{k}": np.asarray(v[k], np.float32) for k in names if k in v})
    state.update(step=np.int64(step), shard=np.int64(loader_state[0]),
                 position=np.int64(loader_state[1]), seed=np.int64(cfg.seed),
                 config=np.array(json.dumps(asdict(cfg))))
    try:
        os.makedirs(tmp)
        recipe.write_file(os.path.join(tmp, recipe.model_file), params, cfg)
        with open(os.path.join(tmp, "state.npz.tmp"), "wb") as f:
            np.savez(f, **state)
    except OSError as e:  # nothing of this checkpoint is kept; the earlier ones are untouched
        shutil.rmtree(tmp, ignore_errors=True)
        die(write_failure(tmp, e))
    os.replace(os.path.join(tmp, "state.npz.tmp"), os.path.join(tmp, "state.npz"))
    rename_into_place(tmp, final)
    return final


def rename_into_place(tmp, final):
    """Makes the complete checkpoint dir `tmp` the checkpoint `final`, replacing one of the same step whole."""
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)  # left by a save that died between the renames
    # a second Ctrl-C stops at once: not between the renames, which would leave the step's checkpoint .old
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        if os.path.isdir(final):
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def latest_checkpoint(out_dir, needed=("state.npz",)):
    """The newest checkpoint dir in out_dir holding the files `needed`, or None; a newer one is skipped with a line."""
    found = sorted(d for d in glob.glob(os.path.join(glob.escape(out_dir), "ckpt_*"))
                   if os.path.basename(d)[5:].isdigit())
    while found and not all(os.path.isfile(os.path.join(found[-1], f)) for f in needed):
        missing = next(f for f in needed if not os.path.isfile(os.path.join(found[-1], f)))
        print(f"--resume auto: skipping {found[-1]}, which has no {missing}")
        found.pop()
    return found[-1] if found else None


def resolve_resume(cfg, trains, needed=("state.npz",)):
    """Makes cfg.resume the checkpoint dir holding `needed` to resume; True where --resume auto found none to resume."""
    # then a run that `trains` starts at step 0 (cfg.resume ""), and prepare_out_dir sets the old files aside
    if cfg.resume == "auto":
        found = latest_checkpoint(cfg.out_dir, needed)
        if found is None and not trains:
            die(f"--resume auto: no checkpoint in {cfg.out_dir}")
        cfg.resume = found or ""
        return found is None
    if cfg.resume:
        cfg.resume = os.path.normpath(cfg.resume)  # its folder is os.path.dirname's, even given with a "/"
        missing = [f for f in needed if not os.path.isfile(os.path.join(cfg.resume, f))]
        if missing:
            die(f"--resume {cfg.resume}: not a checkpoint directory (no {', '.join(missing)})")
    return False


def check_checkpoint_step(path, step):
    """A checkpoint dir named ckpt_<n> must hold step n: --resume auto and the abandoned_ moves go by the names."""
    name = os.path.basename(os.path.normpath(path))
    if re.fullmatch(r"ckpt_\d+", name) and int(name[5:]) != step:
        die(f"checkpoint {path} holds step {step}, not the step {int(name[5:])} its name says (renamed or "
            f"copied by hand?): name it ckpt_{step:07d} elsewhere, or remove it")


def load_checkpoint(path, cfg, recipes):
    """(header, params, m, v, state) from a checkpoint dir of cfg.recipe, a row of `recipes`."""
    recipe = recipes[cfg.recipe]
    for name, other in recipes.items():
        if other.model_file != recipe.model_file and os.path.isfile(os.path.join(path, other.model_file)):
            die(f"--resume {path}: a checkpoint of the {name} recipe ({other.model_file}), not of --recipe "
                f"{cfg.recipe}")
    header, params = read_weights(os.path.join(path, recipe.model_file), cfg, recipes)
    muon = recipe.muon_names({k: p.shape for k, p in params.items()})
    adam = [k for k in params if k not in muon]  # v: AdamW's second moments
    state_file, fields = os.path.join(path, "state.npz"), ("step", "shard", "position", "seed")
    try:
        with np.load(state_file) as z:
            missing = [k for k in (*fields, *(f"m.{k}" for k in params), *(f"v.{k}" for k in adam))
                       if k not in z.files]
            if missing:
                die(f"checkpoint {path} is missing {', '.join(missing[:3])} in state.npz")
            m = {k: z[f"m.{k}"] for k in params}
            v = {k: z[f"v.{k}"] for k in adam}
            state = {}
            for k in fields:
                if z[k].shape != () or z[k].dtype.kind not in "iu":
                    die(f"checkpoint {state_file}: {k} is {z[k].dtype} {z[k].shape}, not an integer")
                state[k] = int(z[k])
            # the run's --shuffle, from its config (a checkpoint written before the flag read in order)
            state["shuffle"] = "config" in z.files and bool(json.loads(str(z["config"])).get("shuffle"))
    # a damaged .npz: not a zip (numpy takes it for a pickle), cut short, a failed CRC or inflate, damaged headers
    except (ValueError, EOFError, OSError, KeyError, NotImplementedError, zipfile.BadZipFile, zlib.error,
            TokenError) as e:
        detail = (str(e).splitlines() or ["no detail"])[0][:120]
        die(f"checkpoint {state_file} is damaged ({type(e).__name__}: {detail})")
    for k, low in (("step", 1), ("shard", 0), ("position", 0), ("seed", 0)):  # checkpoints start at step 1
        if not low <= state[k] < 2**63:  # int64, as saved; a seed as --seed takes it
            die(f"checkpoint {state_file}: {k} is {state[k]}, out of range (must be in [{low}, 2**63))")
    check_checkpoint_step(path, state["step"])
    for k in params:
        moments = [m[k], v[k]] if k in v else [m[k]]
        if any(t.shape != params[k].shape or t.dtype != np.float32 for t in moments):
            die(f"checkpoint {path}: optimizer state for {k} is {'/'.join(f'{t.dtype} {t.shape}' for t in moments)}, "
                f"the model's float32 {params[k].shape}")
        if not all(np.isfinite(t).all() for t in moments):
            die(f"checkpoint {path}: optimizer state for {k} holds non-finite values (NaN or inf): resume "
                "from an earlier checkpoint")
    return header, params, m, v, state


class RunLock:
    """<out_dir>/.lock, flock'ed by process 0 while this object lives and naming its holder; removed on release."""
    held = None  # weakref.ref to the lock this process holds

    def __init__(self, out):
        earlier = RunLock.held and RunLock.held()
        if earlier is not None:  # an earlier main() of this process, ended (main runs one run at a time)
            earlier.release()
        self.path, self.fd = os.path.join(out, ".lock"), None
        while True:
            # O_NOFOLLOW: a symbolic link is refused, not written through; a dead holder's flock is the kernel's to drop
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                die(f"{self.path} is not a regular file, not the run lock that a trainer writes: remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "a process"
                os.close(fd)
                die(f"--out-dir {out} is in use by another run ({holder}): wait for it to end, stop it, or "
                    "give another --out-dir")
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)  # its holder removed it as we opened it: take the new one
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        except OSError as e:
            self.release()
            die(f"--out-dir: {write_failure(self.path, e)}")
        RunLock.held = weakref.ref(self)

    def release(self):
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.remove(self.path)
            os.close(self.fd)
            self.fd = None

    __del__ = release


def move_aside(out, names, prefix):
    """Moves <out>/<names> into a new folder <out>/<prefix><time>[_n], which it returns."""
    stamp = f"{prefix}{datetime.datetime.now():%Y%m%d_%H%M%S}"
    for n in range(1, 1000):  # unique however fast runs follow each other
        aside = os.path.join(out, stamp if n == 1 else f"{stamp}_{n}")
        try:
            os.mkdir(aside)
            break
        except FileExistsError:
            continue
    for name in names:
        os.replace(os.path.join(out, name), os.path.join(aside, name))
    return aside


def abandon_newer(out, step):
    """Moves the checkpoints past `step` and log.jsonl's lines past it into an abandoned_<time> folder."""
    newer = [os.path.basename(p) for p in sorted(glob.glob(os.path.join(glob.escape(out), "ckpt_*")))
             if os.path.basename(p)[5:].isdigit() and int(os.path.basename(p)[5:]) > step]
    if not newer:
        return
    aside = move_aside(out, newer, "abandoned_")
    log = os.path.join(out, "log.jsonl")
    if os.path.isfile(log):
        kept, cut = [], []
        with open(log, "rb") as f:
            for line in f:
                try:
                    later = json.loads(line).get("step", 0) > step
                except (ValueError, AttributeError, TypeError):
                    later = False
                (cut if later else kept).append(line)
        for path, lines in ((os.path.join(aside, "log.jsonl"), cut), (log + ".tmp", kept)):
            with open(path, "wb") as f:
                f.writelines(lines)
        os.replace(log + ".tmp", log)
    print(f"--resume: step {step} is now the live run: the newer {', '.join(newer)} and log lines past step "
          f"{step} moved to {aside}")


def prepare_out_dir(cfg, master, step, restart=False, extras=("profile",)):
    """Makes --out-dir, returning process 0's RunLock on it; a run held there (`extras`: its other files) is refused
    unless continued (--resume at `step`) or moved to replaced_<time> (--force, or `restart`: resolve_resume's)."""
    out = cfg.out_dir

    def held_run():
        run = [os.path.basename(p) for p in sorted(glob.glob(os.path.join(glob.escape(out), "ckpt_*")))]
        return run + [name for name in ("log.jsonl", *extras) if os.path.exists(os.path.join(out, name))]
    if not master:  # process 0 decides: its start event may already be in the log the others would see
        return None
    run = held_run()
    listed = ", ".join(run[:3]) + (", ..." if len(run) > 3 else "")
    if any(name not in extras for name in run):
        if not (cfg.resume or cfg.force or restart):
            die(f"--out-dir {out} already holds a run ({listed}): --resume auto continues it, --force starts over")
        # a checkpoint from elsewhere, or of a branch set aside here, would splice two runs in one log.jsonl
        home = os.path.realpath(os.path.dirname(os.path.abspath(cfg.resume)))
        if cfg.resume and home != os.path.realpath(out):
            aside = os.path.dirname(home) == os.path.realpath(out) and os.path.basename(home).startswith(
                ("abandoned_", "replaced_"))
            whose = (f"a branch set aside in {os.path.dirname(os.path.normpath(cfg.resume))}" if aside else
                     "another out dir")
            die(f"--resume {cfg.resume}: a checkpoint of {whose}, and --out-dir {out} holds another run ({listed}), "
                "whose log.jsonl would then hold both: resume it into a new --out-dir")
    os.makedirs(out, exist_ok=True)
    lock = RunLock(out)  # before anything moves: a live run's files stay where it writes them
    if cfg.resume and not cfg.eval_only and step < cfg.steps:  # a run that trains nothing moves nothing
        abandon_newer(out, step)
    run = held_run()
    moved = (cfg.force or restart) and not cfg.resume and any(name not in extras for name in run)
    aside = move_aside(out, run, "replaced_") if moved else None
    if restart:
        moved_to = f"; the run there, stopped before its first checkpoint, moved to {aside}" if moved else ""
        print(f"--resume auto: no checkpoint in {out}, starting at step 0{moved_to}")
    elif moved:
        print(f"--force: the run in {out} moved to {aside}")
    drop_partial_log_line(out)
    return lock


def drop_partial_log_line(out_dir):
    """Cuts <out_dir>/log.jsonl back to its last complete line (a kill while appending leaves half of one)."""
    path = os.path.join(out_dir, "log.jsonl")
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def open_run(cfg, explicit, recipes, rows, rank, ranks, master, say, any_failed=None):
    """A run's start, weights and data checked before the out dir changes: (step, params, m, v, micro-batches per
    step, train loader, val loader, the samples' encoder or None, the out dir's lock)."""
    try:
        restart = resolve_resume(cfg, not cfg.eval_only)
        recipe, step, loader_state, m, v = recipes[cfg.recipe], 0, (0, 0), None, None
        if cfg.resume:
            header, params, m, v, saved = load_checkpoint(cfg.resume, cfg, recipes)
            apply_model_header(cfg, header, explicit)
            if explicit.get("seed", saved["seed"]) != saved["seed"]:  # its synthetic data, its samples
                die(f"--seed {explicit['seed']} with --resume: the checkpoint's seed is {saved['seed']}, which a "
                    f"resumed run keeps; leave --seed out, or give {saved['seed']}")
            if cfg.shuffle != saved["shuffle"] and not cfg.eval_only:
                said = "shuffled (--shuffle): give --shuffle" if saved["shuffle"] else "in order: leave --shuffle out"
                die(f"--resume {cfg.resume}: the checkpoint's run read its train shards {said}")
            cfg.seed, step, loader_state = saved["seed"], saved["step"], (saved["shard"], saved["position"])
        elif cfg.init_from:
            header, params = read_weights(cfg.init_from, cfg, recipes)
            apply_model_header(cfg, header, explicit)
        else:
            params = recipe.init(cfg)
        if m is None:  # v: AdamW's second moments, of every tensor but Muon's matrices
            muon = recipe.muon_names(recipe.shapes(cfg))
            m = {k: np.zeros_like(p) for k, p in params.items()}
            v = {k: np.zeros_like(p) for k, p in params.items() if k not in muon}
        if cfg.eval_only and not (cfg.resume or cfg.init_from):
            die("--eval-only needs weights: give --init-from or --resume")
        grad_accum, train, val = make_loaders(cfg, rows, rank, ranks, loader_state, say)
        encoder = hellaswag.gpt2_encoding() if cfg.sample_every > 0 and not cfg.eval_only else None
        lock = prepare_out_dir(cfg, master, step, restart)
    except (SystemExit, OSError):  # any_failed, a collective of several processes, stops them together
        if any_failed is not None:
            any_failed(True)
        raise
    if any_failed is not None and any_failed(False):
        die(f"process {rank} of {ranks} stops: another process of the run refused to start (process 0's line says why)")
    return step, params, m, v, grad_accum, train, val, encoder, lock
