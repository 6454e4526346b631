"""triton_kernels.py: backend `triton` of train_gpt2_triton.py: GPT-2's ops on our own Triton kernels, each
beside the Python wrapper that launches it, block sizes named. The memory-bound ops, then the matmul and the
flash attention, then the step's own kernels: no torch op computes on the device in backend triton's step.
Without a GPU, TRITON_INTERPRET=1 runs every kernel in Triton's interpreter (slow, fp32 only); its cost is
per program and loop step, so a few block sizes take a wide value there (`... if INTERPRET else ...`).

Map:
    Triton kernels: memory-bound ops
    Triton kernels: matmul with fused epilogues, and dW
    Triton kernels: causal flash attention
    Triton kernels: the training step's own
    Backend triton: the op interface filled in by the kernels above
"""
import functools
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from train_gpt2_triton import INTERPRET, LN_EPS, op_table


# -----------------------------------------------------------------------------
# Triton kernels: memory-bound ops
#
# N = B*T rows, C channels, `dt` the compute dtype (bf16 or fp32). Loads in the input's dtype, arithmetic in
# fp32, each result rounded once when stored; every load and store masked. Row offsets are int64 (N*Vp passes
# 2**31 at B*T = 43k). Deterministic: no floating-point atomics, and every reduction's partition depends on
# the shapes and the block sizes only (none of these kernels is autotuned). Memory-bound loops are pipelined
# (tl.range num_stages). Block sizes were reasoned for the H100 (132 SMs, 64k registers, 228 KB shared
# memory); `--bench-ops` and `--profile` time them, to retune.

ROW_TILE = 4096         # elements per program in the row kernels: 4 rows of a 1024-wide block at C=768,
ROW_WARPS = 8           # ... 16 per thread, two 16-byte bf16 vectors per tensor per thread
LN_BWD_PROGRAMS = 256   # LayerNorm backward: 256 programs (~2 per SM), each looping over N/256 rows,
LN_BWD_TILE = 2048      # ... 2 rows of a 1024-wide block per step: 16 elements per thread with 4 warps,
LN_BWD_WARPS = 4        # ... 126 registers (up to 4 programs per SM: all 256 are resident at once) ...
LN_BWD_STAGES = 3       # ... and 2 steps (2 x 12 KB of dy, x, dres) loading while one is computed
LN_REDUCE_BLOCK_P = 256  # the dgamma/dbeta reduce: all (<= 256) partials of 16 channels at once, 48
LN_REDUCE_BLOCK_C = 16   # ... programs at C = 768 reading the 1.5 MB of partials from L2
ELEM_BLOCK = 4096       # activations: 16 elements per thread with 8 warps, 12k programs at 16k x 3072
ELEM_WARPS = 8


# cross-entropy: a row of 50304 logits in 13 steps, 16 per thread with 8 warps; the interpreter: one step
CE_BLOCK_V = 1 << 16 if INTERPRET else 4096
CE_WARPS = 8
ENC_SORT_BLOCK_N = 16   # embedding sort: (16 rows, 256 rows) compare tiles, 512 programs at N = 8k, 32
ENC_SORT_BLOCK_M = 256  # ... counts per thread with 4 warps (a multiple of ENC_SORT_BLOCK_N)
ENC_SORT_STAGES = 3
ENC_SLOTS = 16          # embedding wte reduce: 16 sorted rows per program (tl.dot needs >= 16) ...
ENC_BLOCK_C = 256       # ... over 256 channels, 1536 programs at N = 8k, C = 768, 8 warps: 74
ENC_WARPS = 8           # ... registers (152 with 4 warps)
ENC_CARRY_TILES = 16    # runs longer than a tile: the partial sums of 16 following tiles per step
ENC_WPE_BLOCK_T = 8     # wpe reduce: (8 positions, 256 channels) per program, pipelined over the batch
ENC_WPE_STAGES = 3


# multi-tensor kernels: elements per program (8 blocks of MT_BLOCK); the interpreter: one wide block
MT_CHUNK = 1 << 16 if INTERPRET else 16384
MT_BLOCK = 1 << 16 if INTERPRET else 2048
MT_WARPS = 8
NORM_STAGES = 3         # global norm: 2 blocks (16 KB) in flight per program
NORM_FINISH_BLOCK = 8192  # the norm's partials in one step (7.6k chunks at d12)
NORM_FINISH_WARPS = 8


def _row_blocks(C, tile=ROW_TILE):
    """(BLOCK_C, BLOCK_ROWS) for a kernel that keeps whole rows of C channels in a tile of `tile` elements."""
    block_c = triton.next_power_of_2(C)
    return block_c, max(1, tile // block_c)


# --- Embedding: x[b, t] = wte[idx[b, t]] + wpe[t] (the speedrun model's: table[idx[b, t]], no positions) ---

@triton.jit
def _encoder_forward_kernel(idx_ptr, wte_ptr, wpe_ptr, out_ptr, N, T, C, HAS_WPE: tl.constexpr,
                            BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_ROWS
    rows = tl.arange(0, BLOCK_ROWS)                                                 # (R,) local rows
    cols = tl.arange(0, BLOCK_C)                                                    # (BC,)
    row_mask = rows < N - row0
    mask = row_mask[:, None] & (cols < C)[None, :]                                  # (R, BC)
    tok = tl.load(idx_ptr + row0 + rows, mask=row_mask, other=0)                    # (R,) int64
    x = tl.load(wte_ptr + tok[:, None] * C + cols[None, :], mask=mask, other=0.0)   # (R, BC) dt
    if HAS_WPE:
        pos = (row0 + rows) % T                                                     # (R,) int64
        p = tl.load(wpe_ptr + pos[:, None] * C + cols[None, :], mask=mask, other=0.0)  # (R, BC) dt
        x = x.to(tl.float32) + p.to(tl.float32)                                     # (R, BC) fp32
    tl.store(out_ptr + row0 * C + rows[:, None] * C + cols[None, :], x.to(out_ptr.dtype.element_ty),
             mask=mask)


def encoder_forward(idx, wte, wpe):
    """idx (B,T) int64, wte (Vp,C) dt, wpe (maxT,C) dt or None -> x (B,T,C) dt."""
    B, T = idx.shape
    C = wte.shape[1]
    x = torch.empty((B, T, C), dtype=wte.dtype, device=wte.device)                  # (B, T, C) dt
    block_c, block_rows = _row_blocks(C)
    grid = (triton.cdiv(B * T, block_rows),)
    _encoder_forward_kernel[grid](idx, wte, wte if wpe is None else wpe, x, B * T, T, C, HAS_WPE=wpe is not None,
                                  BLOCK_ROWS=block_rows, BLOCK_C=block_c, num_warps=ROW_WARPS)
    return x


# dwte[v] += the rows of dx whose token is v, in the same order every run and without atomics, in three
# steps: (1) a stable rank sort of the rows by token (N^2 integer compares: ~8 us at N = 8k); (2) each tile of
# ENC_SLOTS sorted slots sums the pieces of the token runs inside it as one product same (S, S) @ dx (S, BC)
# and adds a run that lies inside the tile to its wte row, a piece of a run crossing the tile's edge to a
# carry buffer; (3) the tile where a crossing run starts adds the carried pieces in tile order.

@triton.jit
def _encoder_sort_kernel(idx_ptr, order_ptr, sorted_tok_ptr, N, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                         STAGES: tl.constexpr):
    # slot[n] = #{m: token_m < token_n} + #{m < n: token_m == token_n}: m-blocks below ours count <=, those
    # above <, our own block compares positions (BLOCK_M is a multiple of BLOCK_N)
    n0 = tl.program_id(0) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)                                                  # (BN,) our rows
    n_mask = n < N
    # masked lanes hold 2**31 - 1, above every token, so they never sort before a real row
    tok_n = tl.load(idx_ptr + n, mask=n_mask, other=2147483647).to(tl.int32)         # (BN,)
    tok_nc = tok_n[:, None]                                                         # (BN, 1)
    m = tl.arange(0, BLOCK_M)                                                       # (BM,)
    count = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)                            # (BN, BM)
    m_own = (n0 // BLOCK_M) * BLOCK_M
    for m0 in tl.range(0, m_own, BLOCK_M, num_stages=STAGES):
        tok_m = tl.load(idx_ptr + m0 + m).to(tl.int32)                              # (BM,) a full block
        count += (tok_m[None, :] <= tok_nc).to(tl.int32)
    tok_m = tl.load(idx_ptr + m_own + m, mask=m < N - m_own, other=2147483647).to(tl.int32)  # (BM,)
    tie_before = (tok_m[None, :] == tok_nc) & ((m_own + m)[None, :] < n[:, None])   # (BN, BM)
    count += ((tok_m[None, :] < tok_nc) | tie_before).to(tl.int32)
    for m0 in tl.range(m_own + BLOCK_M, N, BLOCK_M, num_stages=STAGES):
        tok_m = tl.load(idx_ptr + m0 + m, mask=m < N - m0, other=2147483647).to(tl.int32)  # (BM,)
        count += (tok_m[None, :] < tok_nc).to(tl.int32)
    slot = tl.sum(count, axis=1)                                                    # (BN,) int32
    tl.store(order_ptr + slot, n, mask=n_mask)
    tl.store(sorted_tok_ptr + slot, tok_n, mask=n_mask)


@triton.jit
def _encoder_wte_backward_kernel(dx_ptr, order_ptr, sorted_tok_ptr, dwte_ptr, carry_ptr, N, C,
                                 SLOTS: tl.constexpr, BLOCK_C: tl.constexpr):
    # program (tile, c-block): sorted slots s0 .. s0+SLOTS-1, channels of one c-block
    tile = tl.program_id(0)
    s0 = tile * SLOTS
    i = tl.arange(0, SLOTS)                                                         # (S,)
    valid = i < N - s0
    # tokens of the tile and of its neighbours; -1 past either end matches no token
    tok = tl.load(sorted_tok_ptr + s0 + i, mask=valid, other=-1)                    # (S,) int32
    prev = tl.load(sorted_tok_ptr + s0 + i - 1, mask=valid & (s0 + i > 0), other=-1)  # (S,) int32
    before = tl.load(sorted_tok_ptr + s0 - 1, mask=s0 > 0, other=-1)                # scalar: slot s0-1
    after = tl.load(sorted_tok_ptr + s0 + SLOTS, mask=s0 + SLOTS < N, other=-1)     # scalar: slot s0+S
    rows = tl.load(order_ptr + s0 + i, mask=valid, other=0).to(tl.int64)            # (S,) source rows
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)                       # (BC,)
    col_mask = cols < C
    g = tl.load(dx_ptr + rows[:, None] * C + cols[None, :], mask=valid[:, None] & col_mask[None, :],
                other=0.0).to(tl.float32)                                           # (S, BC)
    first = valid & ((tok != prev) | (i == 0))          # the first slot of each piece in the tile
    inside = first & (tok != before) & (tok != after)   # ... of a run that lies inside the tile
    dst = dwte_ptr + tok.to(tl.int64)[:, None] * C + cols[None, :]                  # (S, BC) fp32 rows
    dst_mask = inside[:, None] & col_mask[None, :]
    old = tl.load(dst, mask=dst_mask, other=0.0)                                    # (S, BC) fp32
    same = (tok[:, None] == tok[None, :]).to(tl.float32)                            # (S, S) 0/1
    piece = tl.dot(same, g, input_precision="ieee")     # (S, BC): every slot gets its piece's sum
    tl.store(dst, old + piece, mask=dst_mask)
    # carries: row 0 takes the first piece when it continues a run from the tile before, row 1 the last
    # piece when it starts a run that goes on into the next tile (a run spanning the tile is a row-0 piece)
    head = first & (tok == before)
    tail = first & (tok == after) & (tok != before)
    carry = carry_ptr + (tile.to(tl.int64) * 2 + tail.to(tl.int64))[:, None] * C + cols[None, :]  # (S, BC)
    tl.store(carry, piece, mask=(head | tail)[:, None] & col_mask[None, :])


@triton.jit
def _encoder_carry_kernel(carry_ptr, sorted_tok_ptr, dwte_ptr, N, C, SLOTS: tl.constexpr,
                          TILES: tl.constexpr, BLOCK_C: tl.constexpr):
    # program (tile, c-block): if a run starts in this tile and goes on into the next, add its piece
    # (carry row 1) and the row-0 pieces of the tiles it covers, in tile order, to the token's wte row
    tile = tl.program_id(0)
    s0 = tile * SLOTS
    last_slot = tl.minimum(s0 + SLOTS, N) - 1
    tok = tl.load(sorted_tok_ptr + last_slot)                                       # scalar int32
    first_tok = tl.load(sorted_tok_ptr + s0)
    before = tl.load(sorted_tok_ptr + s0 - 1, mask=s0 > 0, other=-1)
    after = tl.load(sorted_tok_ptr + s0 + SLOTS, mask=s0 + SLOTS < N, other=-1)
    # the last piece goes on past the tile and does not itself continue a run from before the tile
    if (tok == after) & ((first_tok != tok) | (before != tok)):
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)                   # (BC,)
        col_mask = cols < C
        acc = tl.load(carry_ptr + (tile.to(tl.int64) * 2 + 1) * C + cols, mask=col_mask, other=0.0)  # (BC,)
        k = tl.arange(0, TILES)                                                     # (TB,)
        t0 = tile + 1
        more = t0 * SLOTS < N                                                       # true, as a tensor
        while more:
            t = t0 + k                                                              # (TB,) later tiles
            # a later tile continues the run when its first slot holds the token (a prefix of k: sorted)
            cont = tl.load(sorted_tok_ptr + t * SLOTS, mask=t * SLOTS < N, other=-1) == tok
            part = tl.load(carry_ptr + (t.to(tl.int64) * 2)[:, None] * C + cols[None, :],
                           mask=cont[:, None] & col_mask[None, :], other=0.0)      # (TB, BC) fp32
            acc += tl.sum(part, axis=0)
            more = (tl.sum(cont.to(tl.int32), axis=0) == TILES) & ((t0 + TILES) * SLOTS < N)
            t0 += TILES
        dst = dwte_ptr + tok.to(tl.int64) * C + cols                                # (BC,) fp32 row
        tl.store(dst, tl.load(dst, mask=col_mask, other=0.0) + acc, mask=col_mask)


@triton.jit
def _encoder_wpe_backward_kernel(dx_ptr, dwpe_ptr, B, T, C, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                                 STAGES: tl.constexpr):
    # dwpe[t] += sum over b of dx[b, t], the batch summed in order by the one program owning (t, c)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)                          # (BT,)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)                       # (BC,)
    mask = (t < T)[:, None] & (cols < C)[None, :]                                   # (BT, BC)
    offs = t[:, None] * C + cols[None, :]                                           # (BT, BC) int32
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for _ in tl.range(0, B, num_stages=STAGES):
        acc += tl.load(dx_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dx_ptr += T * C
    tl.store(dwpe_ptr + offs, tl.load(dwpe_ptr + offs, mask=mask, other=0.0) + acc, mask=mask)


def embedding_backward(dx, idx, dtable):
    """dx (B,T,C) dt, idx (B,T) int64; dtable (Vp,C) fp32 += each token's rows of dx."""
    B, T, C = dx.shape
    N = B * T
    order = torch.empty(N, dtype=torch.int32, device=dx.device)       # (N,) rows sorted by (token, row)
    sorted_tok = torch.empty(N, dtype=torch.int32, device=dx.device)  # (N,) their tokens
    tiles = triton.cdiv(N, ENC_SLOTS)
    carry = torch.empty((tiles, 2, C), dtype=torch.float32, device=dx.device)  # (tiles, 2, C) run pieces
    _encoder_sort_kernel[(triton.cdiv(N, ENC_SORT_BLOCK_N),)](
        idx, order, sorted_tok, N, BLOCK_N=ENC_SORT_BLOCK_N, BLOCK_M=ENC_SORT_BLOCK_M, STAGES=ENC_SORT_STAGES)
    n_cblocks = triton.cdiv(C, ENC_BLOCK_C)
    _encoder_wte_backward_kernel[(tiles, n_cblocks)](dx, order, sorted_tok, dtable, carry, N, C, SLOTS=ENC_SLOTS,
                                                     BLOCK_C=ENC_BLOCK_C, num_warps=ENC_WARPS)
    _encoder_carry_kernel[(tiles, n_cblocks)](carry, sorted_tok, dtable, N, C, SLOTS=ENC_SLOTS,
                                              TILES=ENC_CARRY_TILES, BLOCK_C=ENC_BLOCK_C)


def encoder_backward(dx, idx, dwte, dwpe):
    """dx (B,T,C) dt, idx (B,T) int64; dwte (Vp,C) fp32 += token gradients, dwpe (maxT,C) fp32 +=."""
    B, T, C = dx.shape
    embedding_backward(dx, idx, dwte)
    _encoder_wpe_backward_kernel[(triton.cdiv(T, ENC_WPE_BLOCK_T), triton.cdiv(C, ENC_BLOCK_C))](
        dx, dwpe, B, T, C, BLOCK_T=ENC_WPE_BLOCK_T, BLOCK_C=ENC_BLOCK_C, STAGES=ENC_WPE_STAGES)


# --- LayerNorm, and (RMS) the speedrun model's RMSNorm, optionally fused with the residual add before it ---
# RMSNorm: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), no mean, no bias (RMS a constexpr)

@triton.jit
def _layernorm_forward_kernel(x_ptr, h_ptr, w_ptr, b_ptr, xsum_ptr, y_ptr, mean_ptr, rstd_ptr, N, C, eps,
                              HAS_RESIDUAL: tl.constexpr, RMS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                              BLOCK_C: tl.constexpr):
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_ROWS
    rows = tl.arange(0, BLOCK_ROWS)                                                 # (R,) local rows
    cols = tl.arange(0, BLOCK_C)                                                    # (BC,)
    row_mask = rows < N - row0
    col_mask = cols < C
    mask = row_mask[:, None] & col_mask[None, :]                                    # (R, BC)
    base = row0 * C                                                                 # int64 scalar
    offs = rows[:, None] * C + cols[None, :]                                        # (R, BC) int32
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0)                          # (R, BC) dt
    if HAS_RESIDUAL:
        # the sum is rounded to dt before the statistics: the backward recomputes from the stored x
        h = tl.load(h_ptr + base + offs, mask=mask, other=0.0)                      # (R, BC) dt
        x = (x.to(tl.float32) + h.to(tl.float32)).to(xsum_ptr.dtype.element_ty)
        tl.store(xsum_ptr + base + offs, x, mask=mask)
    x = x.to(tl.float32)
    if RMS:
        xc = x                                                                      # (R, BC) masked 0
    else:
        mean = tl.sum(x, axis=1) / C                                                # (R,) fp32
        # padded lanes are zeroed so that they stay out of the variance (C = 768 in a 1024-wide block)
        xc = tl.where(mask, x - mean[:, None], 0.0)                                 # (R, BC)
        tl.store(mean_ptr + row0 + rows, mean, mask=row_mask)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / C + eps)                              # (R,) fp32
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)              # (BC,)
    y = xc * rstd[:, None] * w[None, :]                                             # (R, BC) fp32
    if not RMS:
        y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + base + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row0 + rows, rstd, mask=row_mask)


def _layernorm_forward(x, h, w, b, eps=LN_EPS, rms=False):
    """LayerNorm (RMSNorm with rms) over the last axis of x, or of x + h: (x + h or None, y, mean, rstd)."""
    C = x.shape[-1]
    N = x.numel() // C
    xsum = torch.empty_like(x) if h is not None else None                           # (..., C) dt
    y = torch.empty_like(x)                                                         # (..., C) dt
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)          # (...,) fp32
    mean = None if rms else torch.empty_like(rstd)                                  # (...,) fp32
    block_c, block_rows = _row_blocks(C)
    # unused pointers (no residual, RMS's mean and bias) get ones the flags compile out
    _layernorm_forward_kernel[(triton.cdiv(N, block_rows),)](
        x, h if h is not None else x, w, w if rms else b, xsum if h is not None else y, y, rstd if rms else mean, rstd,
        N, C, eps, HAS_RESIDUAL=h is not None, RMS=rms, BLOCK_ROWS=block_rows, BLOCK_C=block_c, num_warps=ROW_WARPS)
    return xsum, y, mean, rstd


def layernorm_forward(x, w, b):
    """x (N,C) dt, w (C) dt, b (C) dt -> (y (N,C) dt, mean (N) fp32, rstd (N) fp32)."""
    _, y, mean, rstd = _layernorm_forward(x, None, w, b)
    return y, mean, rstd


@triton.jit
def _layernorm_backward_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dres_ptr, dx_ptr, partial_ptr,
                               N, C, rows_per_program, HAS_DRES: tl.constexpr, RMS: tl.constexpr,
                               BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr):
    # dx for a contiguous range of rows, and the range's partial dgamma/dbeta (partial[0, pid], partial[1, pid])
    # that _layernorm_param_grad_kernel sums: no atomics on the weights
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_ROWS)                                                 # (R,)
    cols = tl.arange(0, BLOCK_C)                                                    # (BC,)
    col_mask = cols < C
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)              # (BC,)
    dw_acc = tl.zeros((BLOCK_ROWS, BLOCK_C), dtype=tl.float32)                      # (R, BC)
    db_acc = tl.zeros((BLOCK_ROWS, BLOCK_C), dtype=tl.float32)                      # (R, BC)
    first = pid.to(tl.int64) * rows_per_program
    for r0 in tl.range(0, rows_per_program, BLOCK_ROWS, num_stages=STAGES):
        row0 = first + r0
        row_mask = rows < N - row0
        mask = row_mask[:, None] & col_mask[None, :]                                # (R, BC)
        base = row0 * C                                                             # int64 scalar
        offs = rows[:, None] * C + cols[None, :]                                    # (R, BC) int32
        dy = tl.load(dy_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)    # (R, BC)
        x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)      # (R, BC)
        rstd = tl.load(rstd_ptr + row0 + rows, mask=row_mask, other=0.0)            # (R,)
        # padded lanes load dy = w = 0, so g, g * xhat and dy * xhat are 0 there whatever xhat holds
        if RMS:
            xhat = x * rstd[:, None]                                                # (R, BC)
        else:
            mean = tl.load(mean_ptr + row0 + rows, mask=row_mask, other=0.0)        # (R,)
            xhat = (x - mean[:, None]) * rstd[:, None]                              # (R, BC)
        g = dy * w[None, :]                                                         # (R, BC) dL/dxhat
        # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) = g * rstd - (xhat * c1 + c2): two fused
        # multiply-adds an element (RMSNorm: c2 = 0)
        c1 = tl.sum(g * xhat, axis=1) / C * rstd                                    # (R,) rstd mean(g xhat)
        if RMS:
            dx = g * rstd[:, None] - xhat * c1[:, None]                             # (R, BC)
        else:
            c2 = tl.sum(g, axis=1) / C * rstd                                       # (R,) rstd mean(g)
            dx = g * rstd[:, None] - (xhat * c1[:, None] + c2[:, None])             # (R, BC)
        if HAS_DRES:
            dx += tl.load(dres_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + base + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        db_acc += dy
    P = tl.num_programs(0)
    tl.store(partial_ptr + pid * C + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if not RMS:
        tl.store(partial_ptr + (P + pid) * C + cols, tl.sum(db_acc, axis=0), mask=col_mask)


@triton.jit
def _layernorm_param_grad_kernel(partial_ptr, dw_ptr, db_ptr, P, C, HAS_BIAS: tl.constexpr,
                                 BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # dw[c] += sum over programs of partial[0, :, c] (db from partial[1]), in a fixed order
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)                       # (BC,)
    col_mask = cols < C
    parts = tl.arange(0, BLOCK_P)                                                   # (BP,)
    dw_acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)                         # (BP, BC)
    db_acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)                         # (BP, BC)
    for p0 in range(0, P, BLOCK_P):
        mask = (parts < P - p0)[:, None] & col_mask[None, :]                        # (BP, BC)
        offs = (p0 + parts)[:, None] * C + cols[None, :]                            # (BP, BC)
        dw_acc += tl.load(partial_ptr + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            db_acc += tl.load(partial_ptr + P * C + offs, mask=mask, other=0.0)
    dw = tl.load(dw_ptr + cols, mask=col_mask, other=0.0) + tl.sum(dw_acc, axis=0)  # (BC,)
    tl.store(dw_ptr + cols, dw, mask=col_mask)
    if HAS_BIAS:
        db = tl.load(db_ptr + cols, mask=col_mask, other=0.0) + tl.sum(db_acc, axis=0)  # (BC,)
        tl.store(db_ptr + cols, db, mask=col_mask)


def layernorm_backward(dy, x, w, mean, rstd, dw, db, dres=None):
    """dy, x (N,C) dt; w (C); mean, rstd (N) fp32; dw, db (C) fp32 +=; dres (N,C) or None -> dx (N,C) dt,
    dres included. With mean and db None, RMSNorm's backward."""
    C = x.shape[-1]
    N = x.numel() // C
    dx = torch.empty_like(x)                                                        # (..., C) dt
    block_c, block_rows = _row_blocks(C, LN_BWD_TILE)
    # whole row tiles per program; their count P <= LN_BWD_PROGRAMS, and the summation order, depend on N only
    rows_per_program = block_rows * triton.cdiv(N, block_rows * LN_BWD_PROGRAMS)
    P = triton.cdiv(N, rows_per_program)
    rms = mean is None
    partial = torch.empty((1 if rms else 2, P, C), dtype=torch.float32, device=x.device)  # (2 or 1, P, C)
    _layernorm_backward_kernel[(P,)](dy, x, w, rstd if rms else mean, rstd, dres if dres is not None else dy,
                                     dx, partial, N, C, rows_per_program, HAS_DRES=dres is not None, RMS=rms,
                                     BLOCK_ROWS=block_rows, BLOCK_C=block_c, STAGES=LN_BWD_STAGES,
                                     num_warps=LN_BWD_WARPS)
    _layernorm_param_grad_kernel[(triton.cdiv(C, LN_REDUCE_BLOCK_C),)](
        partial, dw, dw if rms else db, P, C, HAS_BIAS=not rms, BLOCK_P=LN_REDUCE_BLOCK_P, BLOCK_C=LN_REDUCE_BLOCK_C)
    return dx


# --- Activations: tanh-GELU (GPT-2's) and relu(x)^2 (the speedrun's); the forward is fused into the matmul ---

ACTIVATIONS = {None: 0, "gelu": 1, "relu2": 2}  # the ACT codes of the kernels below and of matmul_kernel


@triton.jit
def _gelu_parts(x):
    # (1 + tanh(u), 1 - tanh(u)^2) at u = sqrt(2/pi) (x + 0.044715 x^3), from e = exp(-2|u|): no overflow, and
    # no cancellation where tanh is near -1 or 1
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)                             # sqrt(2/pi) = 0.797...
    e = tl.exp(-2.0 * tl.abs(u))
    r = 1.0 / (1.0 + e)
    return tl.where(u >= 0.0, 2.0 * r, 2.0 * e * r), 4.0 * e * r * r


@triton.jit
def _activation_forward_kernel(x_ptr, y_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    mask = offs < n - start
    x = tl.load(x_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)          # (BL,)
    if ACT == 1:
        one_plus_tanh, _ = _gelu_parts(x)
        y = 0.5 * x * one_plus_tanh                                                 # (BL,)
    else:
        r = tl.maximum(x, 0.0)                                                      # (BL,)
        y = r * r
    tl.store(y_ptr + start + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _activation_backward_kernel(dy_ptr, x_ptr, dx_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    mask = offs < n - start
    x = tl.load(x_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)          # (BL,)
    dy = tl.load(dy_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)        # (BL,)
    if ACT == 1:
        one_plus_tanh, sech2 = _gelu_parts(x)
        # d/dx: (1 + tanh)/2 + x/2 * (1 - tanh^2) * du/dx, du/dx = sqrt(2/pi) * (1 + 3 * 0.044715 x^2)
        du = 0.7978845608028654 * (1.0 + 0.134145 * x * x)
        grad = 0.5 * one_plus_tanh + 0.5 * x * sech2 * du                           # (BL,)
    else:
        grad = 2.0 * tl.maximum(x, 0.0)                                             # (BL,) d relu(x)^2 / dx
    tl.store(dx_ptr + start + offs, (dy * grad).to(dx_ptr.dtype.element_ty), mask=mask)


def _activation_forward(pre, activation):
    """pre (N,M) dt -> activation(pre) (N,M) dt: "gelu" (tanh approximation) or "relu2"."""
    y = torch.empty_like(pre)                                                       # (N, M) dt
    n = pre.numel()
    _activation_forward_kernel[(triton.cdiv(n, ELEM_BLOCK),)](pre, y, n, ACT=ACTIVATIONS[activation],
                                                              BLOCK=ELEM_BLOCK, num_warps=ELEM_WARPS)
    return y


def _activation_backward(dy, pre, activation):
    """dy, pre (N,M) dt -> dpre (N,M) dt."""
    dpre = torch.empty_like(pre)                                                    # (N, M) dt
    n = pre.numel()
    _activation_backward_kernel[(triton.cdiv(n, ELEM_BLOCK),)](dy, pre, dpre, n, ACT=ACTIVATIONS[activation],
                                                               BLOCK=ELEM_BLOCK, num_warps=ELEM_WARPS)
    return dpre


# --- Cross-entropy over the padded vocabulary, loss and dlogits in one kernel ------------------------------
# CAP > 0: of the soft-capped logits c = CAP z / sqrt(z^2 + CAP^2) (the speedrun's head)

@triton.jit
def _softcap(z, CAP: tl.constexpr):
    # (c, dc/dz) of fp32 z
    rs = tl.rsqrt(z * z + CAP * CAP)
    return CAP * z * rs, CAP * CAP * CAP * rs * rs * rs


@triton.jit
def _crossentropy_kernel(logits_ptr, targets_ptr, losses_ptr, V, Vp, dloss, CAP: tl.constexpr,
                         BLOCK_V: tl.constexpr):
    # one row: pass 1 an online logsumexp over the V real logits, pass 2 overwrites the row with
    # dloss * (softmax - onehot), 0 in the padded columns
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * Vp
    cols = tl.arange(0, BLOCK_V)                                                    # (BV,)
    target = tl.load(targets_ptr + row)                                             # scalar int64
    target_logit = tl.load(logits_ptr + target).to(tl.float32)                      # read before pass 2
    if CAP > 0:
        target_logit, _ = _softcap(target_logit, CAP)
    run_max = tl.full((), float("-inf"), tl.float32)                                # scalar fp32
    run_sum = tl.full((), 0.0, tl.float32)                                          # scalar fp32
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols                                                               # (BV,)
        x = tl.load(logits_ptr + c, mask=c < Vp, other=0.0).to(tl.float32)         # (BV,)
        if CAP > 0:
            x, _ = _softcap(x, CAP)
        x = tl.where(c < V, x, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(x, axis=0))   # finite: every block holds a real logit
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        run_max = new_max
    lse = run_max + tl.log(run_sum)                                                 # scalar fp32
    for v0 in range(0, Vp, BLOCK_V):
        c = v0 + cols                                                               # (BV,)
        x = tl.load(logits_ptr + c, mask=c < Vp, other=0.0).to(tl.float32)          # (BV,)
        if CAP > 0:
            x, dc = _softcap(x, CAP)
            grad = (tl.exp(x - lse) - (c == target).to(tl.float32)) * dc            # (BV,)
        else:
            grad = tl.exp(x - lse) - (c == target).to(tl.float32)                   # (BV,)
        grad = tl.where(c < V, grad * dloss, 0.0)
        tl.store(logits_ptr + c, grad.to(logits_ptr.dtype.element_ty), mask=c < Vp)
    tl.store(losses_ptr + row, lse - target_logit)


def crossentropy_forward_backward(logits, targets, V, dloss, block_v=CE_BLOCK_V, cap=0.0):
    """logits (N,Vp) dt, targets (N) int64 in [0, V) -> losses (N) fp32 (soft-capped logits' with cap > 0);
    OVERWRITES logits with dloss * dlosses/dlogits, 0 in the padded columns. block_v: logits per loop step."""
    Vp = logits.shape[-1]
    N = logits.numel() // Vp
    losses = torch.empty(N, dtype=torch.float32, device=logits.device)              # (N,) fp32
    _crossentropy_kernel[(N,)](logits, targets, losses, V, Vp, dloss, CAP=cap, BLOCK_V=block_v, num_warps=CE_WARPS)
    return losses


# --- Global gradient norm and AdamW over all parameters: multi-tensor kernels ----------------------------
# One launch for every tensor: program i finds the tensor that owns chunk i in a small int64 table (element
# count, first chunk, pointers, weight decay); ALIGNED restates the alignment the wrapper checked.


def _tensor_table(pointer_lists, floats=(), chunk=MT_CHUNK):
    """(table (n_tensors, 2 + pointer lists + floats) int64 on the device, chunks, aligned): the first list sets
    the element counts; None gives a null pointer; floats are stored as float64 bits; chunk: elements a program."""
    lead = pointer_lists[0]
    rows, first, aligned = [], 0, True
    for i, t in enumerate(lead):
        ptrs = [0 if lst is None or lst[i] is None else lst[i].data_ptr() for lst in pointer_lists]
        aligned = aligned and t.numel() % 16 == 0 and all(p % 16 == 0 for p in ptrs)
        rows.append([t.numel(), first] + ptrs)
        first += triton.cdiv(t.numel(), chunk)
    table = torch.tensor(rows, dtype=torch.int64).reshape(len(lead), 2 + len(pointer_lists))
    if floats:
        bits = torch.tensor(list(zip(*floats)), dtype=torch.float64).reshape(len(lead), len(floats))
        table = torch.cat([table, bits.view(torch.int64)], dim=1)
    return table.to(lead[0].device), first, aligned


def _check_tensors(name, tensors, dtypes, like):
    """The kernels reach these tensors through raw pointers, so shapes and dtypes are checked here."""
    for t, ref in zip(tensors, like):
        if t.dtype not in dtypes or not t.is_contiguous() or t.shape != ref.shape or t.device != ref.device:
            raise ValueError(f"{name}: expected contiguous {dtypes} tensors shaped like the parameters, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")


@triton.jit
def _owner_row(table_ptr, n_tensors, NCOL: tl.constexpr, BLOCK_T: tl.constexpr):
    # the table row of the tensor that owns this program's chunk (hints on values a jit function returns
    # are dropped: the caller loads sizes and offsets)
    t = tl.arange(0, BLOCK_T)                                                       # (BT,)
    firsts = tl.load(table_ptr + t * NCOL + 1, mask=t < n_tensors, other=2147483647)  # (BT,) int64
    owner = tl.sum((firsts <= tl.program_id(0)).to(tl.int32), axis=0) - 1
    return table_ptr + owner * NCOL


@triton.jit
def _global_norm_partial_kernel(table_ptr, n_tensors, partial_ptr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr,
                                BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, STAGES: tl.constexpr):
    row = _owner_row(table_ptr, n_tensors, 3, BLOCK_T)  # numel, first chunk, grad pointer
    numel = tl.load(row)
    start = (tl.program_id(0) - tl.load(row + 1)) * CHUNK                           # int64 scalar
    g_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        g_ptr = tl.multiple_of(g_ptr, 16)
        numel = tl.multiple_of(numel, 16)
    g_ptr += start
    size = tl.minimum(numel - start, CHUNK)                                         # this chunk's length
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)                                      # (BL,)
    for i0 in tl.range(0, size, BLOCK, num_stages=STAGES):
        g = tl.load(g_ptr + i0 + offs, mask=offs < size - i0, other=0.0)           # (BL,) fp32
        acc += g * g
    tl.store(partial_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _global_norm_finish_kernel(partial_ptr, n, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)                                      # (BL,)
    for i0 in range(0, n, BLOCK):
        acc += tl.load(partial_ptr + i0 + offs, mask=offs < n - i0, other=0.0)
    tl.store(out_ptr, tl.sqrt_rn(tl.sum(acc, axis=0)))


def global_norm(grads, chunk=MT_CHUNK, block=MT_BLOCK):
    """grads: fp32 tensors -> () fp32, their L2 norm; chunk, block: elements per program and loop step."""
    _check_tensors("global_norm grads", grads, (torch.float32,), grads)
    table, chunks, aligned = _tensor_table([grads], chunk=chunk)
    partial = torch.empty(chunks, dtype=torch.float32, device=grads[0].device)      # (chunks,) fp32
    out = torch.empty((), dtype=torch.float32, device=grads[0].device)              # () fp32
    _global_norm_partial_kernel[(chunks,)](table, len(grads), partial, ALIGNED=aligned, CHUNK=chunk,
                                           BLOCK=block, BLOCK_T=triton.next_power_of_2(len(grads)),
                                           STAGES=NORM_STAGES, num_warps=MT_WARPS)
    _global_norm_finish_kernel[(1,)](partial, chunks, out, BLOCK=NORM_FINISH_BLOCK,
                                     num_warps=NORM_FINISH_WARPS)
    return out


@triton.jit
def _adamw_kernel(table_ptr, n_tensors, lr, beta1, beta2, eps, bias1, bias2, grad_scale, HAS_COPY: tl.constexpr,
                  ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr):
    # table row: numel, first chunk, param, grad, m, v, copy pointers, weight decay (float64 bits)
    row = _owner_row(table_ptr, n_tensors, 8, BLOCK_T)
    numel = tl.load(row)
    start = (tl.program_id(0) - tl.load(row + 1)) * CHUNK                           # int64 scalar
    p_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    wd = tl.load(row + 7).to(tl.float64, bitcast=True).to(tl.float32)
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        numel = tl.multiple_of(numel, 16)
    if HAS_COPY:
        c_ptr = tl.load(row + 6).to(tl.pointer_type(tl.bfloat16))
        if ALIGNED:
            c_ptr = tl.multiple_of(c_ptr, 16)
    size = tl.minimum(numel - start, CHUNK)                                         # this chunk's length
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    for i0 in range(0, size, BLOCK):
        o = start + i0
        mask = offs < size - i0
        p = tl.load(p_ptr + o + offs, mask=mask, other=0.0)                         # (BL,) fp32
        g = tl.load(g_ptr + o + offs, mask=mask, other=0.0) * grad_scale            # (BL,) fp32
        m = beta1 * tl.load(m_ptr + o + offs, mask=mask, other=0.0) + (1.0 - beta1) * g
        v = beta2 * tl.load(v_ptr + o + offs, mask=mask, other=0.0) + (1.0 - beta2) * g * g
        # llm.c's update with IEEE sqrt and division, as backend torch's
        mhat = tl.div_rn(m, bias1)
        vhat = tl.div_rn(v, bias2)
        p = p - lr * (tl.div_rn(mhat, tl.sqrt_rn(vhat) + eps) + wd * p)
        tl.store(m_ptr + o + offs, m, mask=mask)
        tl.store(v_ptr + o + offs, v, mask=mask)
        tl.store(p_ptr + o + offs, p, mask=mask)
        if HAS_COPY:
            tl.store(c_ptr + o + offs, p.to(c_ptr.dtype.element_ty), mask=mask)


def adamw_update(params, grads, ms, vs, copies, lr, beta1, beta2, eps, weight_decays, step, grad_scale,
                 chunk=MT_CHUNK, block=MT_BLOCK):
    """One AdamW step (llm.c's, as torch_adamw_update) over lists of fp32 params, grads (scaled by grad_scale),
    m, v; `copies` (bf16, or None) get the params rounded. chunk and block as in global_norm."""
    _check_tensors("adamw_update params/grads/m/v", [*params, *grads, *ms, *vs], (torch.float32,),
                   params * 4)
    if copies is not None:
        _check_tensors("adamw_update copies", copies, (torch.bfloat16,), params)
    table, chunks, aligned = _tensor_table([params, grads, ms, vs, copies], floats=[weight_decays],
                                           chunk=chunk)
    _adamw_kernel[(chunks,)](table, len(params), lr, beta1, beta2, eps, 1.0 - beta1 ** step, 1.0 - beta2 ** step,
                             grad_scale, HAS_COPY=copies is not None, ALIGNED=aligned, CHUNK=chunk, BLOCK=block,
                             BLOCK_T=triton.next_power_of_2(len(params)), num_warps=MT_WARPS)


# -----------------------------------------------------------------------------
# Triton kernels: matmul with fused epilogues, and dW
#
# Kernels spell constants out (log2(e), ln(2), sqrt(2/pi)): compiled Triton reads no Python global. Every
# tl.dot says input_precision="ieee": fp32 stays true fp32 (no TF32); 16-bit operands use the tensor cores.
# A fixed config gives the same bits every run; on a GPU the autotuner's timed choice may differ between
# processes (dW's SPLIT_K, attention's streamed block), so a resumed run matches to rounding. The
# interpreter has one config per shape: there the bits repeat. H100: a 128x256 tile is the largest whose fp32
# accumulator fits 8 warps' registers; 128x128 with 3 stages leaves room for two programs an SM, one's
# epilogue under the other's main loop (bench/NOTES.md).


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The (row, column) tile of program `pid`: GROUP_M row tiles sweep the columns together, sharing L2."""
    num_m = (M + BLOCK_M - 1) // BLOCK_M  # (not tl.cdiv: each jit call costs ~1 ms in the interpreter)
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)  # the last group may be short
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


def _num_sms(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


INTERPRETER_BLOCKS = (32, 64, 128, 256, 512)  # the interpreter's block sides (BLOCK_K up to 256)
INTERPRETER_WIDE = 128  # the interpreter's dimensions of at least this size take one wide block


def _matmul_configs(kernel, interpret=INTERPRET):
    """Kernel "mm"'s (forward and dX) or "dw"'s configs: the H100's (dW split 1..8 ways, mm also on the TMA
    path; BLOCK_K 64 for 16-bit inputs, 32 for fp32), or the interpreter's blocks of 32 to 512 a side."""
    if interpret:
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 4,
                               **({"SPLIT_K": s} if kernel == "dw" else {"TMA": tma, "PER_SM": 1})},
                              pre_hook=None if kernel == "dw" else _tma_block_shapes)
                for bm in INTERPRETER_BLOCKS for bn in INTERPRETER_BLOCKS for bk in INTERPRETER_BLOCKS[:-1]
                for s in ((1, 2) if kernel == "dw" else (1,)) for tma in ((False,) if kernel == "dw" else
                                                                          (False, True))]
    cfg = lambda bm, bn, bk, stages, warps, maxnreg=None, **kw: triton.Config(  # noqa: E731
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, **kw}, num_stages=stages, num_warps=warps,
        maxnreg=maxnreg, pre_hook=None if kernel == "dw" else _tma_block_shapes)
    if kernel == "dw":
        return [cfg(bm, bn, bk, stages, warps, SPLIT_K=s) for bm, bn, bk, stages, warps in
                ((128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 32, 3, 8),
                 (64, 128, 32, 3, 4)) for s in range(1, 9)]
    # (128 registers a thread: what two 8-warp programs on an SM may use; Triton 3.9 needs 109-126 here)
    pointer = [cfg(*c, TMA=False, PER_SM=1) for c in (
        (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 3, 8, 128), (128, 128, 64, 3, 4),
        (128, 128, 32, 3, 8), (64, 128, 32, 3, 4), (64, 64, 32, 3, 4))]
    tma = [cfg(*c, TMA=True, PER_SM=per_sm) for *c, per_sm in (
        (128, 256, 64, 3, 8, None, 1), (256, 128, 64, 3, 8, None, 1), (128, 128, 64, 4, 8, None, 1),
        (128, 128, 64, 3, 8, 128, 2), (128, 128, 32, 3, 8, None, 1), (64, 128, 32, 3, 4, None, 2))]
    return pointer + tma


def _tma_block_shapes(nargs):
    """Every mm config's pre-hook: sets the descriptors' block shapes (built before the autotuner picks) to the
    config's tiles; the pointer path needs it too (its launch encodes them, and the driver refuses [1, 1])."""
    if nargs["a_desc"] is None:
        return
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_TRANS"] else [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn]
    nargs["pre_desc"].block_shape = [bm, bn]


def _prune_matmul_configs(configs, named_args, **kwargs):
    """BLOCK_K 64 configs for 16-bit inputs, 32 for fp32; the TMA ones only where the descriptors exist."""
    block_k = 32 if named_args["a_ptr"].element_size() == 4 else 64
    tma = bool(named_args.get("tma_ok"))
    return [c for c in configs if c.kwargs["BLOCK_K"] == block_k and (tma or not c.kwargs.get("TMA"))] or configs


def _interpreter_config(configs, named_args, **kwargs):
    """The interpreter's one config for a shape (run untimed): a dimension of INTERPRETER_WIDE or more in one
    block (up to 512, 256 along K), smaller ones in blocks of 32 (the tests still run several tiles)."""
    dims = {"BLOCK_M": named_args["M"], "BLOCK_N": named_args["N"], "BLOCK_K": named_args["K"]}
    want = {k: min(INTERPRETER_BLOCKS[-2 if k == "BLOCK_K" else -1], triton.next_power_of_2(d))
            if d >= INTERPRETER_WIDE else 32 for k, d in dims.items()}
    tma = bool(named_args.get("tma_ok"))  # the matmul's descriptor path wherever it can run
    return [c for c in configs
            if all(c.kwargs[k] == v for k, v in want.items()) and c.kwargs.get("TMA", False) == tma]


DW_WORKSPACE_BYTES = 64 << 20  # split-K partial sums: at most 64 MiB (qkv's 7 splits at B*T = 16k take 50)


def _dw_workspace(M, N, cfg):
    """(elements of dw's and db's fp32 partial sums, tiles) of one dW config."""
    bm, bn, split = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.kwargs["SPLIT_K"]
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    return tiles * split * bm * bn, tiles * split * bm, tiles


def _dw_cost(M, N, K, sms, cfg):
    """Modelled time of dW under one config in 128x256x64 main-loop steps (waves of programs times a chunk's
    steps, plus the split partial sums' round trip): it ranks split counts, the autotuner measures."""
    bm, bn, bk, split = (cfg.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K"))
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    steps = triton.cdiv(triton.cdiv(K, split), bk)
    area = bm * bn / (128 * 256)
    return area * (math.ceil(tiles * split / sms) * steps * bk / 64 + (split > 1) * 1.5 * (split + 1))


def _prune_dw_configs(configs, named_args, **kwargs):
    """Per tile shape, the two split counts _dw_cost ranks best whose partial sums fit DW_WORKSPACE_BYTES."""
    M, N, K = named_args["M"], named_args["N"], named_args["K"]
    sms = _num_sms(named_args["a_ptr"].device)
    width = [c for c in _prune_matmul_configs(configs, named_args) if c.kwargs["SPLIT_K"] == 1
             or _dw_workspace(M, N, c)[0] * 4 <= DW_WORKSPACE_BYTES]
    kept = []
    for tile in dict.fromkeys((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) for c in width):
        same = [c for c in width if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) == tile]
        kept += sorted(same, key=lambda c: _dw_cost(M, N, K, sms, c))[:2]
    return kept


def _interpreter_dw_config(configs, named_args, **kwargs):
    """_interpreter_config's blocks, split in 2 once K passes one block (the tests run the split path)."""
    blocks = _interpreter_config(configs, named_args)
    split = 2 if named_args["K"] > blocks[0].kwargs["BLOCK_K"] else 1
    return [c for c in blocks if c.kwargs["SPLIT_K"] == split]


def _autotune_bench(kernel_call, quantiles):
    """The autotuner's timing of one config: ~25 ms of runs (Triton's default spends ~125 ms)."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


MATMUL_PRUNE = {"early_config_prune": _interpreter_config if INTERPRET else _prune_matmul_configs}
DW_PRUNE = {"early_config_prune": _interpreter_dw_config if INTERPRET else _prune_dw_configs}


@triton.jit
def _gelu_tanh(x, FAST_TANH: tl.constexpr):
    """tanh-GELU of fp32 x. FAST_TANH (GPU, 16-bit output): the SFU's tanh.approx (error ~2^-11, under a bf16
    rounding); else exact to fp32 as x sigmoid(2u), no NaN at either tail."""
    u = 0.7978845608028654 * x * (1.0 + 0.044715 * x * x)
    if FAST_TANH:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True,
                                      pack=1)
        y = 0.5 * x * (1.0 + t)
    else:
        y = x / (1.0 + tl.exp2(-2.8853900817779268 * u))
    return y


@triton.jit
def _activation(x, ACT: tl.constexpr, FAST_TANH: tl.constexpr):
    """The matmul epilogue's activation of fp32 x: tanh-GELU (ACT 1) or relu(x)^2 (ACT 2)."""
    if ACT == 1:
        y = _gelu_tanh(x, FAST_TANH)
    else:
        r = tl.maximum(x, 0.0)
        y = r * r
    return y


@triton.jit
def _matmul_tile(a_ptr, b_ptr, c_ptr, bias_ptr, pre_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                 stride_cm, stride_cn, scale, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                 FAST_TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """matmul_kernel's pointer path: this program's output tile, the operands read through any strides."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) output rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) output columns
    offs_k = tl.arange(0, BLOCK_K)  # (BK,)
    if HAS_BIAS:  # loaded before the loop, whose time then hides its latency (after it, it stalls the epilogue)
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)  # (BN,)
    # rows/columns past the edge wrap around to valid ones, so the loads in the loop need no M/N mask;
    # the wrapped results are dropped by the masked store
    rows = (offs_m % M).to(tl.int64)  # (BM,) int64: N*Vp logits pass 2**31 elements at batch 48
    cols = (offs_n % N).to(tl.int64)  # (BN,)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BM, BK)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn  # (BK, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (BM, BN)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)  # (BM, BK)
            b = tl.load(b_ptrs)  # (BK, BN)
        else:  # zeros past K add nothing to the dot
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k, other=0.0)  # (BM, BK)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k, other=0.0)  # (BK, BN)
        acc = tl.dot(a, b, acc, input_precision="ieee")  # (BM, BN) fp32
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if SCALED:  # FP8 operands' scales
        acc *= scale
    if HAS_BIAS:
        acc += bias[None, :]  # (BM, BN)
    c_offs = offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn  # (BM, BN)
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)  # (BM, BN)
    if ACT != 0:
        # both outputs rounded first, so the fp32 accumulator is dead before the stores' layout changes
        pre = acc.to(pre_ptr.dtype.element_ty)  # (BM, BN)
        y = _activation(acc, ACT, FAST_TANH).to(c_ptr.dtype.element_ty)  # (BM, BN)
        tl.store(pre_ptr + c_offs, pre, mask=c_mask)
        tl.store(c_ptr + c_offs, y, mask=c_mask)
    else:
        tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _matmul_tma_tiles(a_desc, b_desc, c_desc, pre_desc, bias_ptr, M, N, K, B_TRANS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, ACT: tl.constexpr, FAST_TANH: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """matmul_kernel's descriptor path (Hopper's TMA; b_desc holds w (N,K) when B_TRANS), persistent: each
    program walks the tiles num_programs apart, loading the next tile's K blocks during this one's epilogue."""
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    k_steps = (K + BLOCK_K - 1) // BLOCK_K
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (BM, BN)
        for ki in range(k_steps):
            a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])  # (BM, BK)
            if B_TRANS:
                b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K]).T  # (BK, BN)
            else:
                b = b_desc.load([ki * BLOCK_K, pid_n * BLOCK_N])  # (BK, BN)
            acc = tl.dot(a, b, acc, input_precision="ieee")  # (BM, BN) fp32
        if HAS_BIAS:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]  # (BM, BN)
        if ACT != 0:
            pre_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(pre_desc.dtype))
            acc = _activation(acc, ACT, FAST_TANH)  # (BM, BN)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


@triton.autotune(configs=_matmul_configs("mm"), prune_configs_by=MATMUL_PRUNE, do_bench=_autotune_bench,
                 key=["M", "N", "K", "stride_ak", "stride_bk", "tma_ok", "HAS_BIAS", "ACT", "SCALED"])
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, pre_ptr, a_desc, b_desc, c_desc, pre_desc, M, N, K, stride_ab,
                  stride_bb, stride_cb, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, tma_ok, scale,
                  SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, FAST_TANH: tl.constexpr,
                  B_TRANS: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PER_SM: tl.constexpr, EVEN_K: tl.constexpr):
    """c (M,N) = a (M,K) @ b (K,N) [x scale] [+ bias (N)] [then activation ACT, pre (M,N) kept], on the pointer
    path or the TMA path (where tma_ok), timed against each other as configs; a batch on grid axis 1."""
    if TMA:
        _matmul_tma_tiles(a_desc, b_desc, c_desc, pre_desc, bias_ptr, M, N, K, B_TRANS, HAS_BIAS, ACT,
                          FAST_TANH, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:
        batch = tl.program_id(1).to(tl.int64)
        _matmul_tile(a_ptr + batch * stride_ab, b_ptr + batch * stride_bb, c_ptr + batch * stride_cb, bias_ptr,
                     pre_ptr + batch * stride_cb, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                     stride_cn, scale, SCALED, HAS_BIAS, ACT, FAST_TANH, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K)


@triton.jit
def _dw_partial(a_ptr, b_ptr, M, N, K, k_lo, k_hi, pid_m, pid_n, stride_am, stride_ak, stride_bk, stride_bn,
                WITH_DB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr):
    """One program's share of dW: acc (BM,BN) = a[rows, k_lo:k_hi] @ b[k_lo:k_hi, cols] in fp32, and with
    WITH_DB the row sums of a (BM,) by the tensor cores as a @ e0 (e0 (BK,16): ones in column 0)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) output features
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) input features
    offs_k = k_lo + tl.arange(0, BLOCK_K)  # (BK,) rows of dy and x
    rows = (offs_m % M).to(tl.int64)  # (BM,) wrapped as in matmul_kernel
    cols = (offs_n % N).to(tl.int64)  # (BN,)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :].to(tl.int64) * stride_ak  # (BM, BK)
    b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + cols[None, :] * stride_bn  # (BK, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (BM, BN)
    db_acc = tl.zeros((BLOCK_M, 16), dtype=tl.float32)  # (BM, 16) only column 0 is ever nonzero
    if WITH_DB:  # (never with FP8 operands)
        e0 = (tl.arange(0, BLOCK_K)[:, None] >= 0) & (tl.arange(0, 16)[None, :] == 0)  # (BK, 16) column 0 true
        e0 = e0.to(a_ptr.dtype.element_ty)  # (BK, 16) ones in column 0
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)  # (BM, BK)
            b = tl.load(b_ptrs)  # (BK, BN)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - (k - k_lo), other=0.0)  # (BM, BK)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - (k - k_lo), other=0.0)  # (BK, BN)
        acc = tl.dot(a, b, acc, input_precision="ieee")  # (BM, BN) fp32
        if WITH_DB:
            db_acc = tl.dot(a, e0, db_acc, input_precision="ieee")  # (BM, 16)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc, tl.sum(db_acc, axis=1)


@triton.jit
def _dw_accumulate(dw_ptr, db_ptr, acc, db, M, N, pid_m, pid_n, scale, SCALED: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dw[tile] += acc (x scale), and db[rows] += db from the programs of tile column 0."""
    if SCALED:
        acc *= scale
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    dw_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]  # (BM, BN)
    dw_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)  # (BM, BN)
    tl.store(dw_ptr + dw_offs, acc + tl.load(dw_ptr + dw_offs, mask=dw_mask, other=0.0), mask=dw_mask)
    if HAS_BIAS:
        if pid_n == 0:
            tl.store(db_ptr + offs_m, db + tl.load(db_ptr + offs_m, mask=offs_m < M, other=0.0), mask=offs_m < M)


@triton.autotune(configs=_matmul_configs("dw"), key=["M", "N", "K", "HAS_BIAS", "SCALED"], reset_to_zero=["count_ptr"],
                 restore_value=["dw_ptr", "db_ptr"], prune_configs_by=DW_PRUNE, do_bench=_autotune_bench)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def matmul_dw_kernel(a_ptr, b_ptr, dw_ptr, db_ptr, ws_ptr, ws_db_ptr, count_ptr, M, N, K,
                     stride_am, stride_ak, stride_bk, stride_bn, SPLIT_K, scale, SCALED: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """dw (M,N) += dy.T (M,K) @ x (K,N) [x scale], db (M) += dy's column sums. Split-K: a tile's programs sum
    chunks of rows into ws; the last to arrive (an atomic counter) adds them into dw in chunk order."""
    tile = tl.program_id(0) // SPLIT_K
    split = tl.program_id(0) % SPLIT_K
    pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    chunk = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K  # whole K blocks: only K's edge
    # is ever masked
    k_lo = split * chunk
    k_hi = tl.minimum(k_lo + chunk, K)
    if HAS_BIAS:
        if pid_n == 0:  # one tile column is enough: db depends on the output feature only
            acc, db = _dw_partial(a_ptr, b_ptr, M, N, K, k_lo, k_hi, pid_m, pid_n, stride_am, stride_ak,
                                  stride_bk, stride_bn, True, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        else:
            acc, db = _dw_partial(a_ptr, b_ptr, M, N, K, k_lo, k_hi, pid_m, pid_n, stride_am, stride_ak,
                                  stride_bk, stride_bn, False, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    else:
        acc, db = _dw_partial(a_ptr, b_ptr, M, N, K, k_lo, k_hi, pid_m, pid_n, stride_am, stride_ak, stride_bk,
                              stride_bn, False, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    if SPLIT_K == 1:
        _dw_accumulate(dw_ptr, db_ptr, acc, db, M, N, pid_m, pid_n, scale, SCALED, HAS_BIAS, BLOCK_M,
                           BLOCK_N)
    else:
        # whole (BM, BN) partial tiles, contiguous: unmasked full-width stores and loads
        part = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # (BM, BN)
        ws_tile = ws_ptr + tile.to(tl.int64) * SPLIT_K * BLOCK_M * BLOCK_N
        ws_db_tile = ws_db_ptr + tile.to(tl.int64) * SPLIT_K * BLOCK_M
        tl.store(ws_tile + split * BLOCK_M * BLOCK_N + part, acc)
        if HAS_BIAS:
            tl.store(ws_db_tile + split * BLOCK_M + tl.arange(0, BLOCK_M), db)
        # every thread's stores precede the counter's release; the last arriver reads past L1 (.cg)
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + tile, 1) == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (BM, BN)
            db = tl.zeros((BLOCK_M,), dtype=tl.float32)  # (BM,)
            for s in range(0, SPLIT_K):
                acc += tl.load(ws_tile + s * BLOCK_M * BLOCK_N + part, cache_modifier=".cg")
                if HAS_BIAS:
                    db += tl.load(ws_db_tile + s * BLOCK_M + tl.arange(0, BLOCK_M), cache_modifier=".cg")
            _dw_accumulate(dw_ptr, db_ptr, acc, db, M, N, pid_m, pid_n, scale, SCALED, HAS_BIAS, BLOCK_M,
                           BLOCK_N)


def _tma_ready(*tensors):
    """The descriptors' rules: Hopper or later (or the interpreter), 2-D, 16-byte aligned rows, contiguous."""
    device = tensors[0].device
    if not INTERPRET and (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9):
        return False
    return all(t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
               and t.stride(0) * t.element_size() % 16 == 0 for t in tensors)


def _matmul(a, b, bias=None, activation=None, scale=None, out_dtype=None):
    """c (M,N) = a (M,K) @ b (K,N) [x scale] [+ bias] [activation "gelu" or "relu2"] in out_dtype (default
    a's): (c, pre or None). Or a batch a (n,M,K) @ b (n,K,N), no bias or activation."""
    M, K = a.shape[-2:]
    N = b.shape[-1]
    batch = a.shape[0] if a.dim() == 3 else 1
    c = torch.empty((*a.shape[:-1], N), dtype=out_dtype or a.dtype, device=a.device)  # (M,N) or (n,M,N)
    pre = torch.empty((M, N), dtype=a.dtype, device=a.device) if activation else None  # (M,N)
    b_trans = b.stride(-2) == 1 and b.stride(-1) != 1  # the forward's w.T: its descriptor reads w (N,K)
    b_rows = b.transpose(-2, -1) if b_trans else b  # row-major: what the descriptor reads
    descs = [None] * 4
    if a.element_size() > 1 and _tma_ready(a, b_rows, c):
        # block shapes [1, 1] until the chosen config's pre-hook sets its own
        descs = [TensorDescriptor.from_tensor(t, [1, 1]) for t in (a, b_rows, c, c if pre is None else pre)]
    sms = _num_sms(a.device)

    def grid(meta):  # the pointer path: a program a tile; the descriptor path: PER_SM programs an SM at most
        tiles = triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])
        return (min(tiles, sms * meta["PER_SM"]), 1) if meta["TMA"] else (tiles, batch)
    # unused pointers (no bias, no activation) get c: never read nor written, since the flags compile them out
    batch_strides = (a.stride(0), b.stride(0), c.stride(0)) if a.dim() == 3 else (0, 0, 0)
    matmul_kernel[grid](a, b, c, c if bias is None else bias, c if pre is None else pre, *descs, M, N, K,
                        *batch_strides, a.stride(-2), a.stride(-1), b.stride(-2), b.stride(-1), c.stride(-2),
                        c.stride(-1), int(descs[0] is not None), scale or 1.0, SCALED=scale is not None,
                        HAS_BIAS=bias is not None, ACT=ACTIVATIONS[activation],
                        FAST_TANH=activation == "gelu" and not INTERPRET and a.dtype != torch.float32, B_TRANS=b_trans)
    return c, pre


@functools.lru_cache(maxsize=None)
def _dw_workspace_sizes(M, N, K, dtype, device):
    """Elements of the split-K buffers (partial dw, partial db, tile counters) for whichever config the
    autotuner keeps at this shape; () when none splits. Cached: pruning costs ~0.5 ms of Python a call."""
    configs = matmul_dw_kernel.configs
    if len(configs) > 1:
        configs = DW_PRUNE["early_config_prune"](
            configs, {"a_ptr": torch.empty(0, dtype=dtype, device=device), "M": M, "N": N, "K": K})
    if not any(c.kwargs["SPLIT_K"] > 1 for c in configs):
        return ()
    sizes = [_dw_workspace(M, N, c) for c in configs]
    return tuple(max(s[i] for s in sizes) for i in range(3))


def _matmul_dw(dy, x, dw, db, scale=None):
    """dw (M,N) += dy.T @ x [x scale: FP8, db None] and db (M) += dy.sum(0), fp32; dy (K,M), x (K,N)."""
    K, M = dy.shape
    N = x.shape[1]
    grid = lambda meta: (  # noqa: E731
        triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]) * meta["SPLIT_K"],)
    # a missing db, and the split-K buffers when none splits, get a 1-element stand-in never touched (a None
    # would not survive the autotuner's restore_value copies on older Triton)
    stand_in = dw.new_empty(1)  # (1,)
    ws = ws_db = count = stand_in
    sizes = _dw_workspace_sizes(M, N, K, dy.dtype, dy.device)
    if sizes:
        ws = dw.new_empty(sizes[0])  # (tiles, SPLIT_K, BM, BN) partial dw
        ws_db = dw.new_empty(sizes[1])  # (tiles, SPLIT_K, BM) partial db
        count = torch.empty(sizes[2], dtype=torch.int32, device=dw.device)  # (tiles,) arrivals
        zero_fill(count)  # our Triton kernel (below), not torch.zeros: no torch op computes in the step
    matmul_dw_kernel[grid](dy, x, dw, stand_in if db is None else db, ws, ws_db, count, M, N, K,
                           dy.stride(1), dy.stride(0), x.stride(0), x.stride(1), scale=scale or 1.0,
                           SCALED=scale is not None, HAS_BIAS=db is not None)


def matmul_forward(x, w, b):
    """y (N,M) = x (N,K) @ w (M,K).T + b (M) (b may be None: the tied lm head)."""
    return _matmul(x, w.t(), b)[0]


def matmul_gelu_forward(x, w, b):
    """(gelu_tanh(pre), pre), pre (N,M) = x @ w.T + b: the MLP's first layer, keeping pre for backward."""
    return _matmul(x, w.t(), b, activation="gelu")


def matmul_backward(dy, x, w, dw, db):
    """dx (N,K) = dy (N,M) @ w (M,K); dw (M,K) += dy.T @ x and db (M) += dy.sum(0), both fp32."""
    dx = _matmul(dy, w)[0]  # (N,K)
    _matmul_dw(dy, x, dw, db)
    return dx


# -----------------------------------------------------------------------------
# Triton kernels: causal flash attention

# q, k, v: three base pointers sharing strides, head h at h*D of a row (qkv's thirds (B,T,3C), or separate
# (B,T,H,D) tensors). Softmax in base 2, qk_scale = scale * log2(e); lse saved in natural log.

def _attention_configs(kernel, interpret=INTERPRET):
    """(BLOCK_M queries, BLOCK_N keys, warps) for kernel "fwd", "dkdv" or "dq": 16-bit 3-stage (tensor cores),
    fp32 2-stage smaller tiles; the owned block a multiple of the streamed one."""
    if interpret:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32} if kernel == "dkdv"
                              else {"BLOCK_M": 32, "BLOCK_N": 16})]
    sizes16 = {"fwd": [(128, 64, 4), (128, 64, 8), (128, 128, 8), (128, 32, 4), (64, 64, 4), (64, 32, 4)],
               "dkdv": [(64, 128, 8), (32, 128, 8), (64, 64, 4), (32, 64, 4)],
               "dq": [(128, 64, 8), (128, 128, 8), (128, 32, 4), (64, 64, 4), (64, 32, 4)]}[kernel]
    sizes32 = {"fwd": [(64, 32, 8), (32, 32, 4), (64, 16, 4)], "dkdv": [(16, 32, 4)],
               "dq": [(64, 32, 8), (32, 32, 4), (64, 16, 4)]}[kernel]
    return ([triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_stages=3, num_warps=w)
             for bm, bn, w in sizes16]
            + [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_stages=2, num_warps=w)
               for bm, bn, w in sizes32])


def _prune_attention_configs(configs, named_args, **kwargs):
    """16-bit inputs get the 3-stage (tensor core) configs, fp32 inputs the 2-stage (FMA) ones."""
    stages = 2 if named_args["q_ptr"].element_size() == 4 else 3
    return [c for c in configs if c.num_stages == stages] or configs


ATTENTION_PRUNE = {"early_config_prune": _prune_attention_configs}


@triton.jit
def _load_rows(base, offs_t, stride_t, T, D: tl.constexpr, BLOCK_D: tl.constexpr,
               CHECK_T: tl.constexpr):
    """Rows offs_t of one head (len(offs_t), BLOCK_D); rows >= T (when CHECK_T) and padded columns read 0."""
    offs_d = tl.arange(0, BLOCK_D)  # (BD,)
    ptrs = base + offs_t[:, None] * stride_t + offs_d[None, :]  # (R, BD)
    if CHECK_T:
        x = tl.load(ptrs, mask=(offs_t[:, None] < T) & (offs_d[None, :] < D), other=0.0)
    elif BLOCK_D == D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
    return x


@triton.jit
def _store_rows(base, x, offs_t, stride_t, T, D: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)  # (BD,)
    ptrs = base + offs_t[:, None] * stride_t + offs_d[None, :]  # (R, BD)
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=(offs_t[:, None] < T) & (offs_d[None, :] < D))


@triton.jit
def _attn_fwd_keys(acc, l_i, m_i, q, k_base, v_base, offs_m, lo, hi, T, stride_t, qk_scale, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr):
    """Online softmax over the key blocks [lo, hi), rescaling acc (BM,BD), l_i and m_i (BM,) as the max grows;
    DIAGONAL blocks mask keys after the query and check rows against T."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BN,) key positions
        k = _load_rows(k_base, offs_n, stride_t, T, D, BLOCK_D, DIAGONAL)  # (BN, BD)
        v = _load_rows(v_base, offs_n, stride_t, T, D, BLOCK_D, DIAGONAL)  # (BN, BD)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # (BM, BN) fp32 unscaled scores
        if DIAGONAL:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))  # (BM, BN)
        # the scale goes onto the row max and into one fused multiply-add per score
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # (BM,) log2 units
        p = tl.exp2(s * qk_scale - m_new[:, None])  # (BM, BN)
        alpha = tl.exp2(m_i - m_new)  # (BM,)
        l_i = l_i * alpha + tl.sum(p, axis=1)  # (BM,)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")  # (BM, BD) fp32
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_attention_configs("fwd"), key=["T", "D"], prune_configs_by=ATTENTION_PRUNE)
@triton.jit
def attn_fwd_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, T, H, qk_scale, stride_b, stride_t, stride_out_b,
                    stride_out_t, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """BLOCK_M queries of one (batch, head), the diagonal masked, later keys skipped; longest blocks first."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_bh = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    b = pid_bh // H
    h = pid_bh % H
    head = b.to(tl.int64) * stride_b + h * D  # int64 offset of the head's row 0 in q, k and v
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BM,) query positions
    q = _load_rows(q_ptr + head, offs_m, stride_t, T, D, BLOCK_D, True)  # (BM, BD)
    # a finite start: a row whose first keys are all masked keeps m = -1e30 and p = exp2(-inf) = 0, no NaN
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # (BM,) running max (log2 units)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # (BM,) running sum of exp2(s - m)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)  # (BM, BD) running p @ v
    acc, l_i, m_i = _attn_fwd_keys(acc, l_i, m_i, q, k_ptr + head, v_ptr + head, offs_m, 0, start_m, T,
                                   stride_t, qk_scale, D, BLOCK_D, BLOCK_M, BLOCK_N, False)
    acc, l_i, m_i = _attn_fwd_keys(acc, l_i, m_i, q, k_ptr + head, v_ptr + head, offs_m, start_m,
                                   tl.minimum(start_m + BLOCK_M, T), T, stride_t, qk_scale, D,
                                   BLOCK_D, BLOCK_M, BLOCK_N, True)
    out_base = out_ptr + b.to(tl.int64) * stride_out_b + h * D
    _store_rows(out_base, acc / l_i[:, None], offs_m, stride_out_t, T, D, BLOCK_D)
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # (BM,) natural-log logsumexp of the scaled scores
    tl.store(lse_ptr + pid_bh * T + offs_m, lse, mask=offs_m < T)


@triton.jit
def attn_bwd_delta_kernel(out_ptr, dout_ptr, delta_ptr, T, H, stride_out_b, stride_out_t, stride_dout_b, stride_dout_t,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta (B,H,T) = rowsum(dout * out) per head, the softmax backward's sum_j p_j dp_j, computed once."""
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    o = _load_rows(out_ptr + b.to(tl.int64) * stride_out_b + h * D, offs_m, stride_out_t, T,
                   D, BLOCK_D, True)  # (BM, BD)
    do = _load_rows(dout_ptr + b.to(tl.int64) * stride_dout_b + h * D, offs_m, stride_dout_t, T,
                    D, BLOCK_D, True)  # (BM, BD)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # (BM,)
    tl.store(delta_ptr + pid_bh * T + offs_m, delta, mask=offs_m < T)


@triton.jit
def _attn_bwd_queries(dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, offs_n, lo, hi, T, stride_t,
                      stride_do_t, qk_scale, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr):
    """dK, dV of one key block over the query blocks [lo, hi), transposed (keys x queries) so the sums over
    queries are dots. Queries past T read 0 and add exactly 0."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)  # (BM,) query positions
        q = _load_rows(q_base, offs_m, stride_t, T, D, BLOCK_D, True)  # (BM, BD)
        do = _load_rows(do_base, offs_m, stride_do_t, T, D, BLOCK_D, True)  # (BM, BD)
        lse2 = tl.load(lse_ptr + offs_m, mask=offs_m < T, other=0.0) * 1.4426950408889634  # (BM,) log2 units
        delta = tl.load(delta_ptr + offs_m, mask=offs_m < T, other=0.0)  # (BM,)
        zeros = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        s_t = tl.dot(k, tl.trans(q), zeros, input_precision="ieee") * qk_scale  # (BN, BM)
        p_t = tl.exp2(s_t - lse2[None, :])  # (BN, BM) the forward's probabilities
        if DIAGONAL:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)  # (BN, BM)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision="ieee")  # (BN, BD)
        dp_t = tl.dot(v, tl.trans(do), zeros, input_precision="ieee")  # (BN, BM)
        ds_t = p_t * (dp_t - delta[None, :])  # (BN, BM)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision="ieee")  # (BN, BD) scaled once at the end
    return dk, dv


@triton.autotune(configs=_attention_configs("dkdv"), key=["T", "D"], prune_configs_by=ATTENTION_PRUNE)
@triton.jit
def attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, T, H, sm_scale,
                         qk_scale, stride_b, stride_t, stride_dout_b, stride_dout_t, D: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """BLOCK_N keys of one (batch, head), dK and dV written once (no atomics), the diagonal queries masked."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0)
    pid_bh = tl.program_id(0)
    start_n = tl.program_id(1) * BLOCK_N
    b = pid_bh // H
    h = pid_bh % H
    head = b.to(tl.int64) * stride_b + h * D  # int64 offset of the head's row 0 in q, k, v and grads
    do_base = dout_ptr + b.to(tl.int64) * stride_dout_b + h * D
    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BN,) key positions
    k = _load_rows(k_ptr + head, offs_n, stride_t, T, D, BLOCK_D, True)  # (BN, BD)
    v = _load_rows(v_ptr + head, offs_n, stride_t, T, D, BLOCK_D, True)  # (BN, BD)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)  # (BN, BD)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)  # (BN, BD)
    lse_row = lse_ptr + pid_bh * T
    delta_row = delta_ptr + pid_bh * T
    diag_hi = tl.minimum(start_n + BLOCK_N, T)
    dk, dv = _attn_bwd_queries(dk, dv, k, v, q_ptr + head, do_base, lse_row, delta_row, offs_n, start_n, diag_hi, T,
                               stride_t, stride_dout_t, qk_scale, D, BLOCK_D, BLOCK_M, BLOCK_N, True)
    dk, dv = _attn_bwd_queries(dk, dv, k, v, q_ptr + head, do_base, lse_row, delta_row, offs_n, diag_hi, T, T, stride_t,
                               stride_dout_t, qk_scale, D, BLOCK_D, BLOCK_M, BLOCK_N, False)
    _store_rows(dk_ptr + head, dk * sm_scale, offs_n, stride_t, T, D, BLOCK_D)
    _store_rows(dv_ptr + head, dv, offs_n, stride_t, T, D, BLOCK_D)


@triton.jit
def _attn_bwd_keys(dq, q, do, lse2, delta, k_base, v_base, offs_m, lo, hi, T, stride_t, qk_scale, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr):
    """dQ of one query block over the key blocks [lo, hi): dS = P * (dP - delta), dQ += dS K."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BN,) key positions
        k = _load_rows(k_base, offs_n, stride_t, T, D, BLOCK_D, DIAGONAL)  # (BN, BD)
        v = _load_rows(v_base, offs_n, stride_t, T, D, BLOCK_D, DIAGONAL)  # (BN, BD)
        zeros = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        s = tl.dot(q, tl.trans(k), zeros, input_precision="ieee") * qk_scale  # (BM, BN) log2 units
        p = tl.exp2(s - lse2[:, None])  # (BM, BN)
        if DIAGONAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)  # (BM, BN)
        dp = tl.dot(do, tl.trans(v), zeros, input_precision="ieee")  # (BM, BN)
        ds = p * (dp - delta[:, None])  # (BM, BN)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")  # (BM, BD)
    return dq


@triton.autotune(configs=_attention_configs("dq"), key=["T", "D"], prune_configs_by=ATTENTION_PRUNE)
@triton.jit
def attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, T, H, sm_scale, qk_scale,
                       stride_b, stride_t, stride_dout_b, stride_dout_t, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """BLOCK_M queries of one (batch, head), dQ written once (P recomputed, no atomics: deterministic)."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_bh = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    b = pid_bh // H
    h = pid_bh % H
    head = b.to(tl.int64) * stride_b + h * D  # int64 offset of the head's row 0 in q, k, v and dq
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BM,) query positions
    q = _load_rows(q_ptr + head, offs_m, stride_t, T, D, BLOCK_D, True)  # (BM, BD)
    do = _load_rows(dout_ptr + b.to(tl.int64) * stride_dout_b + h * D, offs_m, stride_dout_t, T,
                    D, BLOCK_D, True)  # (BM, BD)
    lse2 = tl.load(lse_ptr + pid_bh * T + offs_m, mask=offs_m < T, other=0.0) * 1.4426950408889634  # (BM,)
    delta = tl.load(delta_ptr + pid_bh * T + offs_m, mask=offs_m < T, other=0.0)  # (BM,)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)  # (BM, BD)
    dq = _attn_bwd_keys(dq, q, do, lse2, delta, k_ptr + head, v_ptr + head, offs_m, 0, start_m, T,
                        stride_t, qk_scale, D, BLOCK_D, BLOCK_M, BLOCK_N, False)
    dq = _attn_bwd_keys(dq, q, do, lse2, delta, k_ptr + head, v_ptr + head, offs_m, start_m,
                        tl.minimum(start_m + BLOCK_M, T), T, stride_t, qk_scale, D, BLOCK_D, BLOCK_M, BLOCK_N, True)
    _store_rows(dq_ptr + head, dq * sm_scale, offs_m, stride_t, T, D, BLOCK_D)


ATTN_DELTA_BLOCK = 64  # rows a program in attn_bwd_delta_kernel: memory-bound, no tuning needed


def _head_block(D):
    return max(16, triton.next_power_of_2(D))  # tl.dot needs power-of-2 sides of at least 16


def _flash_forward(q, k, v, B, T, H, D, scale):
    """attn_fwd_kernel: out (B,T,H*D) in q's dtype and lse (B,H,T) fp32."""
    out = torch.empty((B, T, H * D), dtype=q.dtype, device=q.device)  # (B,T,H*D)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)  # (B,H,T)
    grid = lambda meta: (B * H, triton.cdiv(T, meta["BLOCK_M"]))  # noqa: E731
    attn_fwd_kernel[grid](q, k, v, out, lse, T, H, math.log2(math.e) * scale, q.stride(0), q.stride(1),
                          out.stride(0), out.stride(1), D=D, BLOCK_D=_head_block(D))
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, dq, dk, dv, B, T, H, D, scale):
    """dq, dk, dv (like q, k, v) from dout, out (B,T,H*D) and lse (B,H,T): delta, dK/dV, dQ kernels."""
    BD = _head_block(D)
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)  # (B,H,T)
    attn_bwd_delta_kernel[(B * H, triton.cdiv(T, ATTN_DELTA_BLOCK))](
        out, dout, delta, T, H, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), D=D, BLOCK_D=BD,
        BLOCK_M=ATTN_DELTA_BLOCK)
    rest = (T, H, scale, math.log2(math.e) * scale, q.stride(0), q.stride(1), dout.stride(0), dout.stride(1))
    attn_bwd_dkdv_kernel[lambda meta: (B * H, triton.cdiv(T, meta["BLOCK_N"]))](
        q, k, v, dout, lse, delta, dk, dv, *rest, D=D, BLOCK_D=BD)
    attn_bwd_dq_kernel[lambda meta: (B * H, triton.cdiv(T, meta["BLOCK_M"]))](
        q, k, v, dout, lse, delta, dq, *rest, D=D, BLOCK_D=BD)


def _thirds(qkv):
    """The q, k, v (B,T,C) views of the fused projection's rows (B,T,3C), or of its gradient's."""
    C = qkv.shape[-1] // 3
    return qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]


def attention_forward(qkv, n_head):
    """Causal self-attention of qkv (B,T,3C): out (B,T,C) and the row logsumexp lse (B,H,T) fp32."""
    B, T, C3 = qkv.shape
    D = C3 // (3 * n_head)
    return _flash_forward(*_thirds(qkv), B, T, n_head, D, 1.0 / math.sqrt(D))


def attention_backward(dout, qkv, out, lse, n_head):
    """dqkv (B,T,3C) from dout (B,T,C), the forward's qkv, out and lse (B,H,T)."""
    B, T, C3 = qkv.shape
    D = C3 // (3 * n_head)
    dqkv = torch.empty_like(qkv)  # (B,T,3C) qkv's layout: its thirds share the strides of qkv's
    _flash_backward(dout, *_thirds(qkv), out, lse, *_thirds(dqkv), B, T, n_head, D, 1.0 / math.sqrt(D))
    return dqkv


# -----------------------------------------------------------------------------
# Triton kernels: the training step's own

# With these, torch only allocates and makes views in backend triton's step (the gradients are views of one
# flat fp32 buffer: one launch zeroes or clips them all). The interpreter takes wide blocks.
STEP_BLOCK = 1 << 16 if INTERPRET else 4096
STEP_WARPS = 8
SUM_BLOCK = 1024   # the loss sum: one program adds a micro-batch's token losses in a fixed order


@triton.jit
def _zero_fill_kernel(x_ptr, n, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    tl.store(x_ptr + start + offs, tl.zeros((BLOCK,), dtype=x_ptr.dtype.element_ty), mask=offs < n - start)


@triton.jit
def _clip_by_norm_kernel(g_ptr, norm_ptr, n, max_norm, BLOCK: tl.constexpr):
    # torch.nn.utils.clip_grad_norm_'s rule, the norm read on the device: scale when max_norm / (norm + 1e-6)
    # is below 1 or NaN (a NaN norm makes every gradient NaN, as torch's clamp does)
    coef = tl.div_rn(max_norm, tl.load(norm_ptr) + 1e-6)                            # scalar fp32
    if (coef < 1.0) | (coef != coef):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offs = tl.arange(0, BLOCK)                                                  # (BL,)
        mask = offs < n - start
        g = tl.load(g_ptr + start + offs, mask=mask, other=0.0)                     # (BL,) fp32
        tl.store(g_ptr + start + offs, g * coef, mask=mask)


@triton.jit
def _sum_into_kernel(x_ptr, n, acc_ptr, scale, BLOCK: tl.constexpr):
    # acc += scale * sum(x), one program, blocks in order: the same bits on every run
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    total = tl.zeros((BLOCK,), dtype=tl.float32)                                    # (BL,)
    for i0 in range(0, n, BLOCK):
        total += tl.load(x_ptr + i0 + offs, mask=offs < n - i0, other=0.0).to(tl.float32)
    tl.store(acc_ptr, tl.load(acc_ptr) + scale * tl.sum(total, axis=0))


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    mask = offs < n - start
    x = tl.load(src_ptr + start + offs, mask=mask)                                  # (BL,)
    tl.store(dst_ptr + start + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


def _flat_check(name, *tensors):
    """The step kernels index raw memory: contiguous tensors on one device only."""
    for t in tensors:
        if not t.is_contiguous() or t.device != tensors[0].device:
            raise ValueError(f"{name}: expected contiguous tensors on one device, got {tuple(t.shape)} with "
                             f"strides {t.stride()} on {t.device}")


def zero_fill(x):
    """x (any shape, contiguous) = 0."""
    _flat_check("zero_fill", x)
    _zero_fill_kernel[(triton.cdiv(x.numel(), STEP_BLOCK),)](x, x.numel(), BLOCK=STEP_BLOCK,
                                                             num_warps=STEP_WARPS)


def clip_by_norm(g, norm, max_norm):
    """g (fp32, contiguous: all gradients) *= max_norm / (norm + 1e-6) if below 1 or NaN; norm () fp32."""
    _flat_check("clip_by_norm", g, norm)
    _clip_by_norm_kernel[(triton.cdiv(g.numel(), STEP_BLOCK),)](g, norm, g.numel(), max_norm, BLOCK=STEP_BLOCK,
                                                                num_warps=STEP_WARPS)


def sum_into(acc, x, scale):
    """acc () fp32 += scale * sum(x), x (n) fp32."""
    _flat_check("sum_into", acc, x)
    _sum_into_kernel[(1,)](x, x.numel(), acc, scale, BLOCK=SUM_BLOCK, num_warps=STEP_WARPS)


def copy_into(dst, src):
    """dst = src, both contiguous with as many elements (src's values rounded to dst's dtype)."""
    _flat_check("copy_into", dst, src)
    if dst.numel() != src.numel():
        raise ValueError(f"copy_into: {src.numel()} elements into {dst.numel()}")
    _copy_kernel[(triton.cdiv(src.numel(), STEP_BLOCK),)](src, dst, src.numel(), BLOCK=STEP_BLOCK,
                                                          num_warps=STEP_WARPS)


# -----------------------------------------------------------------------------
# Backend triton: the op interface filled in by the kernels above

TRITON_OPS = op_table("triton", dict(
    encoder_forward=encoder_forward, encoder_backward=encoder_backward,
    layernorm_forward=layernorm_forward, residual_layernorm_forward=_layernorm_forward,  # (x + h, y, mean, rstd)
    layernorm_backward=layernorm_backward,
    matmul_forward=matmul_forward, matmul_gelu_forward=matmul_gelu_forward, matmul_backward=matmul_backward,
    gelu_forward=functools.partial(_activation_forward, activation="gelu"),
    gelu_backward=functools.partial(_activation_backward, activation="gelu"),
    attention_forward=attention_forward, attention_backward=attention_backward,
    crossentropy_forward_backward=crossentropy_forward_backward,
    global_norm=global_norm, adamw_update=adamw_update,
    zero_fill=zero_fill, clip_by_norm=clip_by_norm, sum_into=sum_into, copy_into=copy_into,
))
