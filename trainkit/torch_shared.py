"""torch only, shared by the two torch trainers: processes, ZeRO-1's flat buffers, host-device copies, the
evaluations, Newton-Schulz, --fp8-head's products, and the one-line failures (a lost process, out of memory)."""
import atexit
import contextlib
import datetime
import math
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist

import hellaswag
from trainkit import die, die_out_of_memory
from trainkit.checkpoints import save_checkpoint
from trainkit.data import val_batches
from trainkit.gpt2 import PARAM_NAMES
from trainkit.logs import due, logged_evals
from trainkit.speedrun import FP8_FORMATS, FP8_MAX, NEWTON_SCHULZ_STEPS, fp8_reciprocal

FLAT_ALIGN = 16  # every tensor starts 64 bytes into a flat buffer, and every shard is a multiple of 16
CENSUS_SECONDS = 5  # after a failed collective: how long the survivors wait to hear from each other
TORCH_FP8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def flat_layout(shapes, groups, world):
    """({name: first element}, [(first, end) of each group]) of the groups' tensors in one flat buffer."""
    # each tensor from a FLAT_ALIGN boundary, each group padded to a multiple of FLAT_ALIGN x world: equal shards
    starts, spans, size = {}, [], 0
    unit = FLAT_ALIGN * world
    for names, _ in groups:
        first = size
        for k in names:
            starts[k] = size
            size += -(-math.prod(shapes[k]) // FLAT_ALIGN) * FLAT_ALIGN
        size = first + -(-(size - first) // unit) * unit
        spans.append((first, size))
    return starts, spans


def flat_views(buffer, starts, shapes, names=PARAM_NAMES, first=0):
    """{name: its tensor, a view into `buffer`}, which may hold only the group that starts at element `first`."""
    return {k: buffer[starts[k] - first:starts[k] - first + math.prod(shapes[k])].view(shapes[k])
            for k in names}


def state_layout(groups, muon_names, shapes, world):
    """(groups, starts, spans): flat_layout's of the compute groups, then Muon's matrices (the last group) whole."""
    muon = set(muon_names)
    split = [g for g in groups if not muon.intersection(g[0])]
    starts, spans = flat_layout(shapes, split, world)
    if len(split) < len(groups):
        # dealt as the reference's Muon deals them (round-robin, largest first), a process's in its ZeRO-1 shard
        names, first = groups[-1][0], spans[-1][1]
        ends, local = [0] * world, {}
        for i, k in enumerate(sorted(names, key=lambda k: shapes[k], reverse=True)):
            local[k] = (i % world, ends[i % world])
            ends[i % world] += -(-math.prod(shapes[k]) // FLAT_ALIGN) * FLAT_ALIGN
        stretch = max(ends)
        starts.update({k: first + local[k][0] * stretch + local[k][1] for k in names})
        spans.append((first, first + world * stretch))
    return groups, starts, spans


def shard_ranges(starts, shapes, span, rank, world):
    """ZeRO-1: {name: (lo, hi)}, the elements of each tensor of the group over `span` in rank's shard of it."""
    n = (span[1] - span[0]) // world
    first, ranges = span[0] + rank * n, {}
    for k in starts:
        if not span[0] <= starts[k] < span[1]:
            continue
        lo, hi = max(starts[k], first), min(starts[k] + math.prod(shapes[k]), first + n)
        if lo < hi:
            ranges[k] = (lo, hi)
    return ranges


def put_batch(x, device):
    """A token batch as an int64 tensor on device, copied from pinned memory without blocking the host."""
    t = torch.from_numpy(np.asarray(x, dtype=np.int64))                           # (..., T)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def to_device(arrays, device):
    """{name: fp32 tensor on device} of numpy arrays: copies, never views, since the optimizer updates them."""
    return {k: torch.tensor(np.asarray(a, np.float32), device=device) for k, a in arrays.items()}


def evaluate_val(row_losses, weights, loader, cfg, device, world):
    """Mean token loss over the val shards' first val_tokens // T sequences, the same at any batch and world size."""
    loader.reset()
    total = torch.zeros((), dtype=torch.float64, device=device)                    # ()
    rows = torch.arange(loader.rank * loader.B, (loader.rank + 1) * loader.B, device=device)  # (B,)
    for counted in val_batches(cfg, loader):
        x, y = loader.next_batch()                                                 # (B,T) each
        losses = row_losses(weights, put_batch(x, device), put_batch(y, device), cfg)  # (B,T)
        total += torch.where(rows < counted, losses.mean(-1).double(), 0.0).sum()
    if world > 1:
        dist.all_reduce(total)
    return total.item() / (cfg.val_tokens // cfg.seq_len)


def setup_device(cfg):
    """(rank, world, device, the run's key-value store or None): a process per GPU (nccl) or CPU share (gloo)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if world > 1:  # processes on one machine split its cores instead of oversubscribing them
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    store = None
    if world > 1:
        port = os.environ.get("MASTER_PORT", "")
        if not (os.environ.get("MASTER_ADDR") and port.isascii() and port.isdigit()
                and 1 <= int(port) <= 65535):
            die(f"$WORLD_SIZE is {world}, but $MASTER_ADDR / $MASTER_PORT ({port!r}: a port in 1-65535) do not "
                "say where process 0 is (launch with torchrun, or set both)")
        # env://'s store, made here to be read after a failure (under torchrun, its agent serves it)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(port), world,
                              is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                              timeout=datetime.timedelta(minutes=30))
        # rank 0 alone evaluates HellaSwag while the others wait in the next all-reduce: allow for it
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world, timeout=datetime.timedelta(hours=1))
        atexit.register(dist.destroy_process_group)
    # the matmul precision cfg.dtype promises: cuBLAS and cuDNN would otherwise run fp32 matmuls as TF32
    tf32 = cfg.dtype == "bf16"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    return rank, world, device, store


@contextlib.contextmanager
def fail_on_out_of_memory(cfg):
    """Running out of device memory (at compile or run time) is one line, no trace."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        die_out_of_memory(cfg, e)


def any_process_failed(world, device):
    """open_run's `any_failed` for a run of `world` processes (None for one): True when any passes True."""
    if world == 1:
        return None

    def any_failed(failed):
        flag = torch.tensor([int(failed)], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
    return any_failed


def agree_to_stop(budget_spent, signum, rank, device):
    """(--time-budget reached by process 0's clock, a signal to any process or 0), the same in every process."""
    flags = torch.tensor([int(budget_spent and rank == 0), signum], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    budget_spent, signum = flags.tolist()
    return bool(budget_spent), signum


@contextlib.contextmanager
def fail_on_lost_peer(store, rank, world):
    """A collective failed by a lost process: each survivor names it in one line and exits at once (not waiting)."""
    try:
        yield
    except RuntimeError as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
        if world == 1 or not where.startswith("torch.distributed"):
            raise
        # a roll call in the run's store: the ranks silent for CENSUS_SECONDS; None once process 0's store is gone
        try:
            socket.create_connection((store.host, store.port), timeout=2).close()  # writing a closed store warns
            store.set(f"census/{rank}", "alive")
            deadline = time.monotonic() + CENSUS_SECONDS
            silent = list(range(world))
            while silent and time.monotonic() < deadline:
                silent = [r for r in range(world) if not store.check([f"census/{r}"])]
                time.sleep(0.1)
            if rank == 0:  # the others read the marks before its store closes
                time.sleep(1)
        except (OSError, RuntimeError, dist.DistError):
            silent = None
        if silent == []:
            raise
        who = ", ".join(map(str, silent)) if silent else "0 (its store is gone)"
        os.write(2, f"error: lost process {who} of {world}: it stopped or was killed, so process {rank} stops "
                    "too; `--resume auto` continues the run from its latest checkpoint\n".encode())
        os._exit(1)


def sharded_state(state, params, m, v, shapes, layout, muon_names, device, rank, world):
    """Stage 1 (ZeRO-1): per group of state_layout's `layout`, a process keeps 1/world of the fp32 masters, m, v and
    the summed gradients, and updates that shard of the weights (`own_weights`); shard_*, m, v: {name: its piece}."""
    groups, starts, spans = layout
    muon = set(muon_names)
    state.update(groups=[], weights={}, shard_params={}, shard_grads={}, shard_copies={}, m={}, v={})
    for (names, dtype), (first, end) in zip(groups, spans):
        n = (end - first) // world
        own = first + rank * n  # this process's shard: elements [own, own + n) of the layout
        group = {"span": (first, end), "weights": torch.zeros(end - first, dtype=dtype, device=device)}
        views = flat_views(group["weights"], starts, shapes, names, first)
        for k in names:
            views[k].copy_(torch.from_numpy(np.asarray(params[k], np.float32)))
        state["weights"].update(views)
        group["own_weights"] = group["weights"][own - first:own - first + n]      # (S,) a view
        # fp32 weights are their own masters; bf16 ones get an fp32 shard
        group["params"] = (group["own_weights"] if dtype == torch.float32 else
                           torch.zeros(n, dtype=torch.float32, device=device))     # (S,)
        # one process alone reduces into its gradient buffer itself
        group["grads"] = (state["grad_buffer"][first:end] if world == 1 else
                          torch.zeros(n, dtype=torch.float32, device=device))      # (S,)
        sources = {"m": m} if muon.intersection(names) else {"m": m, "v": v}  # Muon keeps one buffer
        for name in sources:
            group[name] = torch.zeros(n, dtype=torch.float32, device=device)      # (S,)
        if dtype != torch.float32:  # the fp32 masters that are weights already hold their values
            sources["params"] = params
        ranges = shard_ranges(starts, shapes, (first, end), rank, world)
        for name, source in sources.items():
            for k, (lo, hi) in ranges.items():
                flat = np.asarray(source[k], np.float32).reshape(-1)[lo - starts[k]:hi - starts[k]]
                group[name][lo - own:hi - own] = torch.from_numpy(flat.copy())
        pieces = {"params": "shard_params", "grads": "shard_grads", "m": "m", "v": "v"}
        if dtype != torch.float32:
            pieces["own_weights"] = "shard_copies"
        for k, (lo, hi) in ranges.items():
            for name, into in pieces.items():
                if name in group:
                    piece = group[name][lo - own:hi - own]                         # (hi-lo,)
                    state[into][k] = piece.view(shapes[k]) if k in muon else piece  # Muon's whole, shaped
        state["groups"].append(group)
    state["shard_copies"] = state["shard_copies"] or None
    return state


def evaluate_hellaswag(row_losses_fn, params, cfg, device):
    """(acc, acc_norm) through hellaswag.evaluate, rows fitted to the context by hellaswag.in_context."""
    def padded_losses(x, y):                                                       # (4, width) int64 each
        return row_losses_fn(params, put_batch(x, device), put_batch(y, device), cfg).cpu().numpy()
    return hellaswag.evaluate(hellaswag.in_context(padded_losses, cfg.block_size), limit=cfg.hellaswag_limit)


def peak_memory_gb(device):
    """Peak GB allocated by torch's caching allocator on the GPU; None on the CPU, where torch keeps no count."""
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def newton_schulz(G, dtype):
    """The reference's orthogonalization of each matrix G (n,r,c) -> (n,r,c) in `dtype`."""
    # X = G/||G||_F, then X <- 2X + (-1.5 A + 0.5 A^2) X with A = X X^T, on tall matrices' transposes (A the smaller)
    tall = G.shape[-2] > G.shape[-1]
    X = G.to(dtype).mT if tall else G.to(dtype)                                    # (n,r',c')
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)                            # (n,r',c')
    # the sums inside the matmuls that form the products (baddbmm): three new tensors an iteration, not eight
    for _ in range(NEWTON_SCHULZ_STEPS):
        A = X @ X.mT                                                               # (n,r',r')
        B = torch.baddbmm(A, A, A, beta=-1.5, alpha=0.5)                           # (n,r',r')
        X = torch.baddbmm(X, B, X, beta=2.0)                                       # (n,r',c')
    return X.mT if tall else X                                                     # (n,r,c)


def fp8_quantize(x, kind):
    """--fp8-head's operand `kind` of x: x times fp8_reciprocal(kind) in fp32, saturated, rounded to nearest even."""
    # clamped: torch's e5m2 cast would overflow to inf
    fmt = FP8_FORMATS[kind]
    q = x.float() * fp8_reciprocal(kind)
    return q.clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(TORCH_FP8[fmt])


def fp8_matmul(a, b, scale_a, scale_b, out_dtype, fast_accum=False):
    """(a (M,K) @ b (K,N)) x scale_a x scale_b in out_dtype of fp8 operands; off CUDA, of their exact fp32 values."""
    if a.is_cuda:  # a row-major, b column-major, as it requires; fast_accum: the reference forward's
        sa, sb = (torch.tensor(s, dtype=torch.float32, device=a.device) for s in (scale_a, scale_b))
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=sa, scale_b=sb,
                                out_dtype=out_dtype, use_fast_accum=fast_accum)
    return ((a.float() @ b.float()) * (scale_a * scale_b)).to(out_dtype)


def flat_gradients(shapes, layout, device):
    """The start of the training state: `grads` of every tensor, views of one flat fp32 `grad_buffer`, and `starts`."""
    _, starts, spans = layout
    state = {"grad_buffer": torch.zeros(spans[-1][1], dtype=torch.float32, device=device)}  # (P,) padded
    state["grads"], state["starts"] = flat_views(state["grad_buffer"], starts, shapes, list(shapes)), starts
    return state


def state_bytes(zero_stage, shapes, layout, muon_names, world):
    """Bytes of bf16 `params`, `grads`, fp32 `masters` and `moments` that one process holds (docs/FORMATS.md)."""
    groups, _, spans = layout
    muon = set(muon_names)
    size = spans[-1][1]
    if zero_stage == 0:
        numel = {k: math.prod(s) for k, s in shapes.items()}
        copied = sum(numel[k] for names, dtype in groups if dtype != torch.float32 for k in names)
        return {"params": 2 * copied, "grads": 4 * size, "masters": 4 * sum(numel.values()),
                "moments": sum((4 if k in muon else 8) * n for k, n in numel.items())}
    lengths = [(end - first, dtype, bool(muon.intersection(names)))
               for (names, dtype), (first, end) in zip(groups, spans)]
    return {"params": sum(2 * n for n, dtype, _ in lengths if dtype != torch.float32),
            "grads": 4 * size + (4 * size // world if world > 1 else 0),  # one process reduces in place
            "masters": sum(4 * (n if dtype == torch.float32 else n // world) for n, dtype, _ in lengths),
            "moments": sum((4 if is_muon else 8) * n // world for n, _, is_muon in lengths)}


def evals_left_to_run(cfg, step, master, world):
    """[val due, HellaSwag due] at a resumed `step` that process 0's log.jsonl lacks (a kill after the checkpoint)."""
    logged = logged_evals(cfg.out_dir, step) if master else set()
    missing = [due(cfg.val_every, step, cfg.steps) and "val_loss" not in logged,
               due(cfg.hellaswag_every, step, cfg.steps) and "hellaswag_acc" not in logged]
    if world > 1:  # all must run the same evaluations
        dist.broadcast_object_list(missing, src=0)
    return missing


def checkpoint_if_due(state, step, last, loader, cfg, recipe, world, master, say):
    """Step's checkpoint where --ckpt-every (or the last step, `last`) asks: gathered by all, written by process 0."""
    if not due(cfg.ckpt_every, step, last):
        return
    if cfg.zero_stage == 0:
        full = state["params"], state["m"], state["v"]
    else:  # the shards of the masters and moments, all-gathered group by group
        shapes, full = recipe.shapes(cfg), []
        for name in ("params", "m", "v"):
            buffer, names = torch.empty_like(state["grad_buffer"]), []                # (P,)
            for group in state["groups"]:
                if name not in group:  # Muon's group has no v
                    continue
                first, end = group["span"]
                if world > 1:
                    dist.all_gather_single(buffer[first:end], group[name])
                else:
                    buffer[first:end].copy_(group[name])
                names += [k for k in shapes if first <= state["starts"][k] < end]
            full.append(flat_views(buffer, state["starts"], shapes, names))
    if master:
        full = [{k: t.detach().float().cpu().numpy() for k, t in tensors.items()} for tensors in full]
        say(f"saved {save_checkpoint(cfg.out_dir, step, *full, loader.state(), cfg, recipe)}")
    if world > 1:
        dist.barrier()


def say_samples(sample, cfg, step, last, device, decode, master, say):
    """Prints step's samples where --sample-every (or the last step) asks: sample(generator)'s rows (S, T) after EOT."""
    if not (master and due(cfg.sample_every, step, last)):
        return
    seed = int(np.random.SeedSequence([cfg.seed, step]).generate_state(1)[0])
    generator = torch.Generator(device=device).manual_seed(seed)  # (--seed, step)'s: as an uninterrupted run's
    for i, row in enumerate(sample(generator).tolist()):
        say(f"sample {i}: {decode(row[1:])!r}")
