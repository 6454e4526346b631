"""Stopping a run: SIGINT/SIGTERM at a step boundary with a checkpoint, the divergence stop, one line for an
OSError, and no stop when stdout or stderr goes away."""
import functools
import glob
import os
import signal
import sys
import threading

from trainkit import DISK_FULL, die, write_failure
from trainkit.logs import due

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C; what schedulers (SLURM, Kubernetes) send before a kill


class StopSignals:
    """While training, the first SIGINT/SIGTERM stops the run at the step's end (`received`); else one stops at once."""

    def __init__(self):
        self.received, self.training, self.master, self.previous = 0, False, True, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # the only thread that may set handlers
            self.previous = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.training and not self.received:
            self.received = signum
            self.tell(f"{name}: stopping at the end of this step, with a checkpoint ({name} again stops at once)")
            return
        # before training (startup, --eval-only, --test, --bench-ops) there is nothing of this launch to resume
        hint = "; --resume auto continues from the latest checkpoint" if self.training else ""
        self.tell(f"{name}: stopped at once{hint}")
        raise SystemExit(128 + signum)

    def tell(self, line):  # os.write: print could be inside a print of the interrupted code
        if self.master:
            try:
                os.write(2, f"{line}\n".encode())
            except OSError:  # stderr's reader is gone: the stop goes on without its line
                pass


class OutputThatMayClose:
    """sys.stdout or sys.stderr whose writes go to /dev/null once its reader is gone (`| head`, a closed ssh)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self.discard()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except BrokenPipeError:
            self.discard()

    def discard(self):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self.stream.fileno())  # what the stream still buffers goes there at its next flush
        os.close(null)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def stops_on_signals(main):
    """main(argv, signals) under StopSignals, with outputs that may close and one line for any OSError."""
    @functools.wraps(main)
    def run(argv=None):
        streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = OutputThatMayClose(sys.stdout), OutputThatMayClose(sys.stderr)
        try:
            with StopSignals() as signals:
                return main(argv, signals)
        except OSError as e:  # the one boundary for the operating system's errors: the file and the reason
            if e.errno in DISK_FULL:
                die(write_failure(e.filename, e))
            die(f"{e.filename}: {e.strerror}" if e.filename else str(e))
        finally:
            sys.stdout.flush()  # what they still buffer, while a closed reader is caught
            sys.stderr.flush()
            sys.stdout, sys.stderr = streams
    return run


def stop_on_signal(signum, step, cfg, master):
    """Ends a run that signal `signum` stopped after `step` (its checkpoint written); nothing when signum is 0."""
    if not signum:
        return
    if master:
        saved = "its checkpoint saved" if due(cfg.ckpt_every, step, step) else "no checkpoint (--ckpt-every 0)"
        print(f"{signal.Signals(signum).name}: stopped after step {step} of {cfg.steps}, {saved}; --resume auto "
              "continues", file=sys.stderr)
    raise SystemExit(128 + signum)


def stop_diverged(step, loss, norm, cfg):
    """Stops a run whose step gave a non-finite loss or grad norm, before that step is logged or saved."""
    latest = sorted(glob.glob(os.path.join(glob.escape(cfg.out_dir), "ckpt_*[0-9]")))
    kept = f"{latest[-1]} stays the latest checkpoint" if latest else "no checkpoint was written"
    die(f"step {step}: loss {loss}, grad norm {norm}: the run diverged (try a lower --lr or a --grad-clip); "
        f"stopped before logging or saving this step, {kept}")
