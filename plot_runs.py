"""Overlays training runs of the GPT-2 trainers in one figure, from the log.jsonl in each run's out dir.

    python plot_runs.py out/gpt2_jax out/gpt2_torchfunc out/gpt2_triton -o compare.png
    python plot_runs.py out/gpt2_jax --smooth 20        # train loss also as a 20-step moving average

Every trainer logs the same events (docs/FORMATS.md, What a run prints and logs), so any number of runs,
of any framework, overlay. Each run is labelled with its `framework` and its out dir as given. Panels, each
drawn only when some run has data for it (a panel without data is left out, not drawn empty):

- train loss against step (with --smooth N, a trailing N-step moving average over the raw curve);
- val loss against step;
- val loss against wall time: the cumulative step time, the sum of dt_ms of the step events up to the
  validation's step, so the pauses for evaluations, checkpoints, samples and start-up do not count;
- tokens/s against step;
- peak memory per run (its largest peak_mem_gb), as bars; the trainers log null on the CPU;
- HellaSwag acc_norm against step.

Resumed runs. A run killed after logging step k but before its checkpoint, then resumed from the
checkpoint at step c < k, appends steps c+1, c+2, ... again. The later event for a step wins: a step event
for step s that comes after events at steps >= s starts a new branch, and every earlier event at a step
>= s is dropped (step, validation and HellaSwag events alike: they describe weights that the resumed run
threw away). The wall-time axis sums dt_ms over the kept step events, one per step: it is the time the
surviving trajectory took, as if the run had never been interrupted. The time lost on the abandoned steps
and on the restart is not counted, so that a resumed run lines up with an uninterrupted one and the axis
compares the frameworks' speed rather than the runs' luck. A log that starts after step 1 (a run resumed
into a fresh out dir) counts from its first logged step.
"""
import argparse
import errno
import json
import math
import os
import sys
from dataclasses import dataclass, field

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

# -----------------------------------------------------------------------------
# Config

LOG_NAME = "log.jsonl"
# the numbers each kind of event must carry to be plotted (docs/FORMATS.md, What a run prints and logs);
# an event is of the kind whose first key it holds, and events of no kind here are skipped (the
# translator's bleu, say, or keys a later version adds)
EVENT_KEYS = {
    "step": ("train_loss", "dt_ms", "tokens_per_s"),
    "val": ("val_loss",),
    "hellaswag": ("hellaswag_acc_norm",),
}
PANEL_W, PANEL_H = 5.0, 3.4    # inches per panel
MAX_COLS = 3
DPI = 100
# overlapping curves are the point of most of these plots (the trainers agree to ~1e-5), so each run
# gets a thinner line and another dash than the one before: the curves drawn first stay visible around
# the later ones instead of being hidden under them
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P")
# a write that fails for want of room: a full disk, a full quota, a file-size limit reached
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def die(msg):
    """Stops with a one-line error (SystemExit prints it to stderr and exits 1, no traceback)."""
    raise SystemExit(f"error: {msg}")


# -----------------------------------------------------------------------------
# Reading runs

@dataclass
class Run:
    """One run's kept events as arrays, in step order."""
    out_dir: str
    frameworks: list                                    # in order of first appearance
    steps: np.ndarray                                   # (S,) kept training steps
    train_loss: np.ndarray                              # (S,)
    tokens_per_s: np.ndarray                            # (S,)
    wall_s: np.ndarray                                  # (S,) cumulative step time through each step
    peak_mem_gb: float = None                           # largest logged value; None where never measured
    val_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, int))
    val_loss: np.ndarray = field(default_factory=lambda: np.zeros(0))
    val_wall_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    swag_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, int))
    swag_acc_norm: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def label(self):
        # a run resumed by another trainer (checkpoints are framework-free) shows both: "jax+torchfunc"
        return f"{'+'.join(self.frameworks)} ({os.path.normpath(self.out_dir)})"


def is_number(value):
    # bool is an int to Python, not a loss; NaN and inf are numbers (a diverged run is still plotted)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def event_kind(event):
    for kind, keys in EVENT_KEYS.items():
        if keys[0] in event:
            return kind
    return None


def read_events(path):
    """The events of a log.jsonl as (kind, event) in file order, each checked to carry what is plotted.
    Blank lines are skipped, and so is a last line without its newline that is not JSON: half an event,
    from a run killed while it wrote it (docs/FORMATS.md; the trainers cut it off), said in one line.
    Anything else that is not such an event stops with its line number."""
    events = []
    try:
        with open(path, "rb") as f:
            lines = f.readlines()
    except OSError as e:
        die(f"cannot read {path}: {e.strerror or e}")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError on bytes that aren't text
            if lineno == len(lines) and not line.endswith(b"\n"):
                print(f"{path} line {lineno}: skipped, an event cut short (a run killed while it wrote it)",
                      file=sys.stderr)
                continue
            die(f"{path} line {lineno}: not valid JSON ({getattr(e, 'msg', e)})")
        if not isinstance(event, dict) or not isinstance(event.get("step"), int) \
                or isinstance(event["step"], bool):
            die(f"{path} line {lineno}: not a log event (a JSON object with an integer 'step')")
        if not 0 <= event["step"] < 2**63:  # what a trainer writes: an int64 step count
            die(f"{path} line {lineno}: step {event['step']} is outside [0, 2**63)")
        kind = event_kind(event)
        if kind is None:
            continue
        for key in EVENT_KEYS[kind]:
            if not is_number(event.get(key)):
                die(f"{path} line {lineno}: a {kind} event whose {key} is {event.get(key)!r}, not a number")
        mem = event.get("peak_mem_gb")
        if kind == "step" and mem is not None and not is_number(mem):
            die(f"{path} line {lineno}: peak_mem_gb is {mem!r}, neither a number nor null")
        events.append((kind, event))
    return events


def current_branch(events):
    """The events that survive resumptions: a step event at step s after events at steps >= s drops those
    earlier events (see the module docstring). Two evaluations at one step without a new step between
    (an --eval-only run into the same out dir, say) are resolved later by the later one winning."""
    kept, top = [], 0   # top: the largest step among kept events
    for kind, event in events:
        step = event["step"]
        if kind == "step" and step <= top:
            kept = [(k, e) for k, e in kept if e["step"] < step]
            top = max((e["step"] for _, e in kept), default=0)
        kept.append((kind, event))
        top = max(top, step)
    return kept


def last_per_step(events, kind):
    """{step: event} of one kind, the later event winning; in step order."""
    by_step = {}
    for k, event in events:
        if k == kind:
            by_step[event["step"]] = event
    return dict(sorted(by_step.items()))


def load_run(out_dir):
    """Reads <out_dir>/log.jsonl into a Run; a bad dir or log stops with a one-line error."""
    if os.path.isfile(out_dir):
        die(f"{out_dir} is a file: give the run's --out-dir, the folder of its {LOG_NAME}")
    if not os.path.isdir(out_dir):
        die(f"{out_dir}: no such directory")
    path = os.path.join(out_dir, LOG_NAME)
    if not os.path.isfile(path):
        die(f"{out_dir} has no {LOG_NAME} (is it a trainer's --out-dir?)")
    events = current_branch(read_events(path))
    steps = last_per_step(events, "step")
    if not steps:
        die(f"{path} has no training step events (no event with train_loss)")
    vals = last_per_step(events, "val")
    swag = last_per_step(events, "hellaswag")

    frameworks = []
    for event in steps.values():
        name = str(event.get("framework", "?"))
        if name not in frameworks:
            frameworks.append(name)
    step_ids = np.array(list(steps), dtype=int)
    wall_s = np.cumsum([e["dt_ms"] for e in steps.values()]) / 1000.0
    mems = [e["peak_mem_gb"] for e in steps.values() if e.get("peak_mem_gb") is not None]
    val_steps = np.array(list(vals), dtype=int)
    # the time at a validation is that of the last kept step at or before it (0 before the first step)
    at = np.searchsorted(step_ids, val_steps, side="right")
    return Run(out_dir=out_dir, frameworks=frameworks, steps=step_ids,
               train_loss=np.array([e["train_loss"] for e in steps.values()], dtype=float),
               tokens_per_s=np.array([e["tokens_per_s"] for e in steps.values()], dtype=float),
               wall_s=wall_s, peak_mem_gb=max(mems) if mems else None,
               val_steps=val_steps, val_loss=np.array([e["val_loss"] for e in vals.values()], dtype=float),
               val_wall_s=np.concatenate([[0.0], wall_s])[at],
               swag_steps=np.array(list(swag), dtype=int),
               swag_acc_norm=np.array([e["hellaswag_acc_norm"] for e in swag.values()], dtype=float))


# -----------------------------------------------------------------------------
# The figure

def moving_average(x, n):
    """Trailing mean over the last n points; the first n-1 points average what there is, so the curve
    starts at step 1 and is not shifted."""
    c = np.concatenate([[0.0], np.cumsum(x)])
    i = np.arange(1, len(x) + 1)
    lo = np.maximum(i - n, 0)
    return (c[i] - c[lo]) / (i - lo)


def time_unit(seconds):
    """(divisor, name) that keeps the wall-time axis' numbers short."""
    if seconds < 120:
        return 1.0, "s"
    if seconds < 2 * 3600:
        return 60.0, "min"
    return 3600.0, "h"


def line_style(i):
    return dict(color=f"C{i % 10}", linestyle=LINE_STYLES[i % len(LINE_STYLES)],
                linewidth=max(0.8, 2.6 - 0.6 * i))


def point_style(i):
    # hollow markers, each smaller than the one before: points that coincide stay distinguishable
    return dict(marker=MARKERS[i % len(MARKERS)], markersize=max(3.0, 8.0 - 1.5 * i),
                markerfacecolor="none", markeredgewidth=1.2)


def draw_train_loss(ax, runs, smooth):
    for i, run in enumerate(runs):
        if smooth > 1:
            # the raw curve faint behind the average: the noise the smoothing hides stays in view
            ax.plot(run.steps, run.train_loss, color=f"C{i % 10}", alpha=0.25, linewidth=0.8)
            ax.plot(run.steps, moving_average(run.train_loss, smooth), label=run.label, **line_style(i))
        else:
            ax.plot(run.steps, run.train_loss, label=run.label, **line_style(i))
    ax.set(xlabel="step", ylabel="train loss")


def draw_val_loss(ax, runs):
    for i, run in enumerate(runs):
        if len(run.val_steps):
            ax.plot(run.val_steps, run.val_loss, label=run.label, **line_style(i), **point_style(i))
    ax.set(xlabel="step", ylabel="val loss")


def draw_val_loss_time(ax, runs):
    div, unit = time_unit(max(run.val_wall_s.max() for run in runs if len(run.val_steps)))
    for i, run in enumerate(runs):
        if len(run.val_steps):
            ax.plot(run.val_wall_s / div, run.val_loss, label=run.label, **line_style(i), **point_style(i))
    ax.set(xlabel=f"wall time ({unit}, summed step times)", ylabel="val loss")


def draw_tokens_per_s(ax, runs):
    for i, run in enumerate(runs):
        ax.plot(run.steps, run.tokens_per_s, label=run.label, **line_style(i))
    ax.set(xlabel="step", ylabel="tokens/s")


def draw_peak_memory(ax, runs):
    x = np.arange(len(runs))
    for i, run in enumerate(runs):
        # a run that could not measure it (the CPU) says so, rather than showing as 0 GB
        value = run.peak_mem_gb
        if value is not None:
            ax.bar(i, value, color=f"C{i % 10}", label=run.label)
        ax.annotate("n/a" if value is None else f"{value:.1f}", (i, value or 0), xytext=(0, 2),
                    textcoords="offset points", ha="center", va="bottom")
    ax.set_xticks(x, ["+".join(run.frameworks) for run in runs])
    ax.set_xlim(-0.6, len(runs) - 0.4)   # the n/a slots too: text does not widen the limits
    ax.set(ylabel="peak memory (GB)")


def draw_hellaswag(ax, runs):
    for i, run in enumerate(runs):
        if len(run.swag_steps):
            ax.plot(run.swag_steps, run.swag_acc_norm, label=run.label, **line_style(i), **point_style(i))
    ax.set(xlabel="step", ylabel="acc_norm")


def panels_for(runs, smooth=0):
    """[(title, draw(ax))] of the panels that have data in these runs, in the figure's order."""
    any_val = any(len(run.val_steps) for run in runs)
    panels = [("train loss" + (f" ({smooth}-step mean)" if smooth > 1 else ""),
               lambda ax: draw_train_loss(ax, runs, smooth))]
    if any_val:
        panels.append(("val loss", lambda ax: draw_val_loss(ax, runs)))
        panels.append(("val loss vs wall time", lambda ax: draw_val_loss_time(ax, runs)))
    panels.append(("tokens/s", lambda ax: draw_tokens_per_s(ax, runs)))
    if any(run.peak_mem_gb is not None for run in runs):
        panels.append(("peak memory", lambda ax: draw_peak_memory(ax, runs)))
    if any(len(run.swag_steps) for run in runs):
        panels.append(("HellaSwag acc_norm", lambda ax: draw_hellaswag(ax, runs)))
    return panels


def build_figure(runs, smooth=0):
    """The figure of these runs: one axes per panel that has data (fig.axes, titled), a legend below."""
    panels = panels_for(runs, smooth)
    # the fewest rows of at most MAX_COLS, then the fewest columns that fill them: 4 panels are 2x2, not
    # 3 + 1 with two blank slots
    rows = math.ceil(len(panels) / MAX_COLS)
    cols = math.ceil(len(panels) / rows)
    # a Figure with its own Agg canvas rather than pyplot: no GUI backend, no global state, nothing to close
    fig = Figure(figsize=(PANEL_W * cols, PANEL_H * rows + 0.4), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    for n, (title, draw) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, n + 1)
        draw(ax)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    renderer = fig.canvas.get_renderer()
    for ncols in range(min(len(runs), 3), 0, -1):  # as many columns as the labels' width lets fit
        legend = fig.legend(handles, labels, loc="outside lower center", ncols=ncols, frameon=False)
        if ncols == 1 or legend.get_window_extent(renderer).width <= fig.bbox.width:
            break
        legend.remove()
    return fig


def save_figure(fig, path):
    """Writes the figure to `path` in the format its extension names (PNG where it has none), under a
    temporary name beside it that is renamed when complete: a failed write leaves no partial figure and an
    earlier one as it was. A failed write is a one-line error."""
    fmt = os.path.splitext(path)[1][1:].lower() or "png"
    tmp = temp_name(path)
    try:
        fig.savefig(tmp, format=fmt)  # format= and not the name's extension: the temporary name has none
        os.replace(tmp, path)
    except (ValueError, RuntimeError) as e:  # an extension that is no format matplotlib writes; .pgf's LaTeX
        die(f"cannot write {path}: {str(e).splitlines()[0]}")
    except OSError as e:
        die(f"cannot write {path}: " + ("no space left, the disk is full" if e.errno in NO_SPACE
                                         else e.strerror or str(e)))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def temp_name(path, suffix="tmp"):
    """A temporary name beside `path`, to be renamed to it: short enough whatever the length of path's name."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f"{name[:200]}.{os.getpid()}.{suffix}")


def describe(run):
    """One line per run for stdout: what was plotted, and the numbers one would read off the curves."""
    val = f", val loss {run.val_loss[-1]:.4f} at step {run.val_steps[-1]}" if len(run.val_steps) else ""
    return (f"{run.label}: steps {run.steps[0]}-{run.steps[-1]} ({len(run.steps)} kept), "
            f"train loss {run.train_loss[-1]:.4f}{val}, {run.wall_s[-1]:.1f} s of steps, "
            f"median {np.median(run.tokens_per_s):,.0f} tok/s")


# -----------------------------------------------------------------------------
# Command line

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.error = die  # a bad flag gets one line naming it, as in the trainers
    p.add_argument("runs", nargs="+", metavar="OUT_DIR",
                   help="a trainer's --out-dir (holding its log.jsonl); give several to overlay them")
    p.add_argument("-o", "--out", default="compare.png",
                   help="figure to write; the extension picks the format (.png, .pdf, .svg; none: PNG, "
                        "under the name as given) (default: %(default)s)")
    p.add_argument("--smooth", type=int, default=0, metavar="N",
                   help="also draw train loss as a trailing moving average over N steps (default: 0 = "
                        "off; 1 is off too)")
    args = p.parse_args(argv)
    if args.smooth < 0:
        die(f"--smooth must be >= 0, got {args.smooth}")
    if not os.path.basename(args.out):
        die(f"-o {args.out!r}: give a file's name")
    # a run's log.jsonl given for its out dir
    args.runs = [(os.path.dirname(d) or ".") if os.path.basename(d) == LOG_NAME and os.path.isfile(d) else d
                 for d in args.runs]
    return args


def main(argv=None):
    args = parse_args(argv)
    logs = [os.path.join(d, LOG_NAME) for d in args.runs]
    if os.path.exists(args.out) and any(os.path.exists(p) and os.path.samefile(args.out, p) for p in logs):
        die(f"-o {args.out} is a log this plot reads: pick another name")
    runs = [load_run(d) for d in args.runs]
    fig = build_figure(runs, args.smooth)
    save_figure(fig, args.out)
    for run in runs:
        print(describe(run))
    print(f"wrote {args.out} ({len(fig.axes)} panels, {len(runs)} run(s))")


if __name__ == "__main__":
    main()
