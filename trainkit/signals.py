"""Stopping a run: SIGINT/SIGTERM at a step boundary with a checkpoint (StopSignals, stops_on_signals,
stop_on_signal), the divergence stop (stop_diverged); and not stopping when stdout or stderr goes away
(OutputThatMayClose)."""
import functools
import glob
import os
import signal
import sys
import threading

from trainkit import die
from trainkit.logs import due

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C; what schedulers (SLURM, Kubernetes) send before a kill


class StopSignals:
    """SIGINT and SIGTERM: during training (`training` set) the first asks the run to stop at the end of the
    step (`received` holds its number; main checks it at each step boundary, writes a checkpoint, exits
    128 + the number as a shell reports it); outside training, or a second one, stops at once. Either way
    one line (process 0's) and no traceback."""

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
    """sys.stdout or sys.stderr that outlives its reader: when the pipe or terminal behind it closes (`| head`,
    a closed ssh session), writing it raises BrokenPipeError; from then on its file descriptor points at
    /dev/null and the run trains on, its steps still in log.jsonl. Everything else is the stream's own."""

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
    """main(argv, signals) run under StopSignals, the handlers before restored when it ends, with stdout and
    stderr that may close (OutputThatMayClose)."""
    @functools.wraps(main)
    def run(argv=None):
        streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = OutputThatMayClose(sys.stdout), OutputThatMayClose(sys.stderr)
        try:
            with StopSignals() as signals:
                return main(argv, signals)
        finally:
            sys.stdout.flush()  # what they still buffer, while a closed reader is caught
            sys.stderr.flush()
            sys.stdout, sys.stderr = streams
    return run


def stop_on_signal(signum, step, cfg, master):
    """Ends a run that a signal `signum` stopped after `step` (its checkpoint written): one line, exit 128 +
    signum; nothing when signum is 0 (no signal came)."""
    if not signum:
        return
    if master:
        saved = "its checkpoint saved" if due(cfg.ckpt_every, step, step) else "no checkpoint (--ckpt-every 0)"
        print(f"{signal.Signals(signum).name}: stopped after step {step} of {cfg.steps}, {saved}; --resume auto "
              "continues", file=sys.stderr)
    raise SystemExit(128 + signum)


def stop_diverged(step, loss, norm, cfg):
    """The one line that stops a run whose step `step` gave a non-finite loss or grad norm, before that
    step is logged or checkpointed (llm.c and modded-nanogpt stop too)."""
    latest = sorted(glob.glob(os.path.join(glob.escape(cfg.out_dir), "ckpt_*[0-9]")))
    kept = f"{latest[-1]} stays the latest checkpoint" if latest else "no checkpoint was written"
    die(f"step {step}: loss {loss}, grad norm {norm}: the run diverged (try a lower --lr or a --grad-clip); "
        f"stopped before logging or saving this step, {kept}")

