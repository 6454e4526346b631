"""What a run prints and logs: log.jsonl's events, the step and memory lines, MFU, and when an evaluation is due."""
import json
import os

from trainkit import die, write_failure

SAMPLE_COUNT, SAMPLE_TOKENS, TOP_K = 4, 63, 40  # EOT + 63 = 64 wide: a multiple of 64
PROFILE_STEPS = 3
PEAK_FLOPS = {  # dense tensor-core peak (bf16, tf32) by GPU name, from the vendors' datasheets; the first match counts
    "H100 PCIe": (756e12, 378e12), "H100 NVL": (835e12, 417.5e12), "H100": (989e12, 494.5e12),  # SXM
    "H200 NVL": (835e12, 417.5e12), "H200": (989e12, 494.5e12),
    "A100": (312e12, 156e12), "L40S": (362e12, 183e12), "4090": (165e12, 82.6e12),
}


def model_flops_per_token(cfg, n_params):
    """6N + 12LCT (PaLM appendix B / nanoGPT); N = parameters without wpe."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len


def peak_flops(device_name, dtype):
    """The device's dense peak for this dtype, or None when it is not a GPU we know (MFU then 'n/a')."""
    for key, (bf16, tf32) in PEAK_FLOPS.items():
        if key in device_name:
            return bf16 if dtype == "bf16" else tf32
    return None


def logged_evals(out_dir, step):
    """The evaluations ("val_loss", "hellaswag_acc") that <out_dir>/log.jsonl records at `step`."""
    path, found = os.path.join(out_dir, "log.jsonl"), set()
    if not os.path.isfile(path):
        return found
    with open(path) as f:
        for line in f:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash while it was written
                continue
            if event.get("step") == step:
                found.update(k for k in ("val_loss", "hellaswag_acc") if k in event)
    return found


def format_memory(cfg, held, activations, world, optimizers):
    """The start line's bytes per device: the training state `held`, one micro-batch's activations."""
    return (f"per device: params {held['params'] / 1e6:.1f} MB | grads {held['grads'] / 1e6:.1f} MB | fp32 "
            f"masters {held['masters'] / 1e6:.1f} MB | {optimizers} moments "
            f"{held['moments'] / 1e6:.1f} MB (ZeRO stage {cfg.zero_stage} over {world} devices) | "
            f"activations {activations / 1e6:.1f} MB per micro-batch (--recompute {cfg.recompute})")


def host_memory_available():
    """Bytes this host can give a process without swapping (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def memory_warning(held, activations, world, available):
    """A warning where `world` devices' state and activations exceed the host's `available` bytes, else None."""
    need = (sum(held.values()) + activations) * world  # on the CPU the kernel's kill would say nothing
    if available is None or need <= available:
        return None
    return (f"warning: by the accounting above, {world} device(s) need {need / 1e9:.1f} GB and this host has "
            f"{available / 1e9:.1f} GB available: the kernel may kill the run (try a smaller --batch-size or a "
            "cheaper --recompute)")


def start_event(cfg, step, world, held, activations):
    """log.jsonl's first event of each launch (docs/FORMATS.md)."""
    return dict(event="start", step=step, devices=world, state_bytes=held, activation_bytes=activations,
                config=dict(vars(cfg)))


def due(every, step, steps):
    return every > 0 and (step % every == 0 or step == steps)


def log_event(out_dir, framework, **record):
    """Appends one JSON object to <out_dir>/log.jsonl (docs/FORMATS.md), with the trainer's `framework` name."""
    record["framework"] = framework
    path = os.path.join(out_dir, "log.jsonl")
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:  # a write's error names no file; a half line left is cut off on --resume
        die(write_failure(path, e))


def format_mean(times, first, profiled, cfg, flops):
    """The closing line: mean step time, tokens/s and MFU over the steps after the first that were not profiled."""
    kept = [s for s in times if s > first and s not in profiled]
    note = " after the first" + (", not profiled" if profiled else "")
    if not kept:  # over all of them when no other step ran
        kept, note = list(times), ""
    dt = sum(times[s] for s in kept) / len(kept)
    tokens_per_s = cfg.total_batch_size / dt
    mfu = flops[0] * tokens_per_s / flops[1] if flops[1] else None
    return (f"mean over {len(kept)} step(s){note}: {1000 * dt:.1f} ms, {tokens_per_s:,.0f} tok/s, "
            f"mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}")


def report_step(step, cfg, loss, norm, lr, dt, mem, flops, framework, master, say):
    """Prints step's line and (process 0) logs its event; `flops`: (model FLOPs per token, peak FLOP/s or None)."""
    tokens_per_s = cfg.total_batch_size / dt
    mfu = flops[0] * tokens_per_s / flops[1] if flops[1] else None
    mem_s = "n/a" if mem is None else f"{mem:.1f} GB"
    say(f"step {step:5d}/{cfg.steps} | loss {loss:.6f} | norm {norm:.4f} | lr {lr:.4e} | {1000 * dt:.1f} ms | "
        f"{tokens_per_s:,.0f} tok/s | mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | mem {mem_s}")
    if master:
        log_event(cfg.out_dir, framework, step=step, train_loss=loss, grad_norm=norm, lr=lr, dt_ms=1000 * dt,
                  tokens_per_s=tokens_per_s, mfu=mfu, peak_mem_gb=mem)
