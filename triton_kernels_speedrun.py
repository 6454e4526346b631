"""triton_kernels_speedrun.py: backend `triton`'s ops of train_gpt2_triton.py's speedrun recipe: those that
triton_kernels.py's kernels serve through a flag, its own kernels (q/k RMSNorm and rotary, Muon, the FP8 head),
TRITON_SPEEDRUN_OPS, and its row of the tools' table. Deleted with the trainer's `Recipe: speedrun` section.

Map:
    Triton kernels: speedrun
"""
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from train_gpt2_triton import (HEAD_ROWS, INTERPRET, SPEEDRUN_OP_NAMES, TORCH_SPEEDRUN_OPS, Config, compute_dtype,
                               op_table)
from trainkit.speedrun import (ATTN_SCALE, FP8_FORMATS, FP8_MAX, FP8_SCALES, HEAD_DIM, MUON_MOMENTUM,
                               MUON_WEIGHT_DECAY, NEWTON_SCHULZ_STEPS, SOFTCAP, fp8_reciprocal)
from triton_kernels import (CE_BLOCK_V, ELEM_BLOCK, ELEM_WARPS, LN_REDUCE_BLOCK_C, LN_REDUCE_BLOCK_P, MT_BLOCK,
                            MT_CHUNK, MT_WARPS, _activation_backward, _activation_forward, _check_tensors,
                            _flash_backward, _flash_forward, _flat_check, _layernorm_forward,
                            _layernorm_param_grad_kernel, _matmul, _matmul_dw, _owner_row, _row_blocks, _tensor_table,
                            crossentropy_forward_backward, embedding_backward, encoder_forward, layernorm_backward)
from triton_tools import TOOLS, RecipeTools, _leaf, _nbytes, op_case


# -----------------------------------------------------------------------------
# Triton kernels: speedrun
#
# First the ops that triton_kernels.py's kernels serve through a flag (the embedding without positions,
# RMSNorm, ReLU^2, the soft-capped cross-entropy, attention with its own scale over separate q, k, v).

def rmsnorm_forward(x, w, eps):
    """x (N,C) dt, w (C) dt -> (y (N,C) dt, rstd (N) fp32): RMSNorm with gain w."""
    _, y, _, rstd = _layernorm_forward(x, None, w, None, eps, rms=True)
    return y, rstd


def residual_rmsnorm_forward(res, h, w, eps):
    """res (N,C), h (N,C) dt -> (x = res + h (N,C) dt, RMSNorm(x) (N,C) dt, rstd (N) fp32)."""
    x, y, _, rstd = _layernorm_forward(res, h, w, None, eps, rms=True)
    return x, y, rstd


def rmsnorm_backward(dy, x, w, rstd, dw, dres=None):
    """dy, x (N,C) dt; w (C); rstd (N) fp32; dw (C) fp32 +=; dres (N,C) or None -> dx (N,C) dt, dres included."""
    return layernorm_backward(dy, x, w, None, rstd, dw, None, dres)


def matmul_relu2_forward(x, w, b):
    """(relu(pre)^2, pre), pre (N,M) = x @ w.T + b: the speedrun MLP's first layer, keeping pre."""
    return _matmul(x, w.t(), b, activation="relu2")


def softcap_crossentropy_forward_backward(z, targets, dloss, block_v=CE_BLOCK_V):
    """z (N,Vp) dt, targets (N) int64 -> losses (N) fp32 of the soft-capped logits over all Vp columns;
    OVERWRITES z with dloss * dlosses/dz."""
    return crossentropy_forward_backward(z, targets, z.shape[-1], dloss, block_v, cap=SOFTCAP)


def _check_heads(name, qkv, rows):
    """The kernels' addressing: q, k, v (B,T,H,D) with one set of strides ending (D, 1); rows of unit stride."""
    D = qkv[0].shape[-1]
    if (len({t.stride() for t in qkv}) > 1 or qkv[0].stride()[2:] != (D, 1)
            or any(t.stride(2) != 1 for t in rows)):
        raise ValueError(f"{name}: expected q, k, v (B, T, H, D) with one set of strides ending (D, 1) and "
                         f"rows of unit stride, got strides {[t.stride() for t in (*qkv, *rows)]}")


def scaled_attention_forward(q, k, v, scale):
    """Causal softmax(scale q k^T) v per head of q, k, v (B,T,H,D): (out (B,T,H*D), lse (B,H,T) fp32)."""
    B, T, H, D = q.shape
    _check_heads("scaled_attention_forward", (q, k, v), ())
    return _flash_forward(q, k, v, B, T, H, D, scale)


def scaled_attention_backward(dout, q, k, v, out, lse, scale):
    """(dq, dk, dv) (B,T,H,D) with q's strides, from dout and out ((B,T,H*D) or (B,T,H,D)), q, k, v, lse."""
    B, T, H, D = q.shape
    dout, out = dout.view(B, T, H * D), out.view(B, T, H * D)  # (B,T,H*D) each
    _check_heads("scaled_attention_backward", (q, k, v), (dout, out))
    # the kernels write all three through q's strides
    dq, dk, dv = (torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device)
                  for _ in range(3))  # (B,T,H,D) each
    _flash_backward(dout, q, k, v, out, lse, dq, dk, dv, B, T, H, D, scale)
    return dq, dk, dv


# --- q and k: RMSNorm over each head, then the half-truncated rotary embedding ---------------------------
# A row is one head, x (B,T,H,D) contiguous: row r sits at position (r // H) % T; element j pairs with D/2 + j,
# so a row loads as two (rows, D/2) halves. The angles are computed in the kernels: a cos/sin table would be
# a torch op in the step.

# whole heads per program: 32 heads at D = 128 with 8 warps; the interpreter takes wide tiles
QK_TILE = 1 << 16 if INTERPRET else 4096
QK_WARPS = 8


@triton.jit
def _rotary_cos_sin_tile(rows, T, H, cols, HEAD_DIM: tl.constexpr):
    """cos and sin (R, BH) fp32 at the positions of flat head indices rows (R,), pairs cols (BH,):
    freq_j = (1/1024)^(j / (D/4 - 1)) over the first D/4 pairs (1 at D = 4, as torch's), 0 over the last D/4."""
    quarter = HEAD_DIM // 4
    t = ((rows // H) % T).to(tl.float32)                                           # (R,) positions
    freq = tl.exp2(cols.to(tl.float32) * (-10.0 / tl.maximum(quarter - 1, 1)))     # (BH,) fp32
    freq = tl.where(cols < quarter, freq, 0.0)                                      # (BH,)
    theta = t[:, None] * freq[None, :]                                              # (R, BH) fp32, as torch's
    # GPU cos and sin may be approximate far from 0: reduce to [-pi, pi], 2 pi split in two (6.28125 has
    # 8 significant bits, so turns * 6.28125 is exact)
    turns = tl.floor(theta * 0.15915494309189535 + 0.5)                             # (R, BH) nearest 2 pi
    r = (theta - turns * 6.28125) - turns * 1.9353071795864769e-3                   # (R, BH) in [-pi, pi]
    return tl.cos(r), tl.sin(r)


@triton.jit
def _head_halves(N, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's heads: flat indices (R,) int64, pairs (BH,), row mask, half mask and offsets (R, BH)."""
    heads = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)   # (R,)
    cols = tl.arange(0, BLOCK_H)                                                    # (BH,)
    row_mask = heads < N                                                            # (R,)
    mask = row_mask[:, None] & (cols[None, :] < HEAD_DIM // 2)                      # (R, BH)
    return heads, cols, row_mask, mask, heads[:, None] * HEAD_DIM + cols[None, :]


@triton.jit
def _qk_norm_rotary_forward_kernel(x_ptr, y_ptr, rstd_ptr, N, T, H, eps, HEAD_DIM: tl.constexpr,
                                   BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    heads, cols, row_mask, mask, offs = _head_halves(N, HEAD_DIM, BLOCK_ROWS, BLOCK_H)
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)                 # (R, BH)
    x2 = tl.load(x_ptr + HEAD_DIM // 2 + offs, mask=mask, other=0.0).to(tl.float32)  # (R, BH)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)  # (R,)
    x1 = x1 * rstd[:, None]                                                         # (R, BH) xhat
    x2 = x2 * rstd[:, None]                                                         # (R, BH)
    cos, sin = _rotary_cos_sin_tile(heads, T, H, cols, HEAD_DIM)                    # (R, BH) each
    y1 = x1 * cos + x2 * sin                                                        # (R, BH)
    y2 = x2 * cos - x1 * sin                                                        # (R, BH)
    tl.store(y_ptr + offs, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + HEAD_DIM // 2 + offs, y2.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + heads, rstd, mask=row_mask)


@triton.jit
def _qk_norm_rotary_backward_kernel(dy_ptr, x_ptr, rstd_ptr, dx_ptr, N, T, H, HEAD_DIM: tl.constexpr,
                                    BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    # the rotation is orthogonal: dxhat = R^T dy; then RMSNorm's backward without gain, xhat recomputed
    heads, cols, row_mask, mask, offs = _head_halves(N, HEAD_DIM, BLOCK_ROWS, BLOCK_H)
    dy1 = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)               # (R, BH)
    dy2 = tl.load(dy_ptr + HEAD_DIM // 2 + offs, mask=mask, other=0.0).to(tl.float32)  # (R, BH)
    rstd = tl.load(rstd_ptr + heads, mask=row_mask, other=0.0)                      # (R,) fp32
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]  # (R, BH) xhat
    x2 = tl.load(x_ptr + HEAD_DIM // 2 + offs, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
    cos, sin = _rotary_cos_sin_tile(heads, T, H, cols, HEAD_DIM)                    # (R, BH) each
    g1 = dy1 * cos - dy2 * sin                                                      # (R, BH) dxhat
    g2 = dy1 * sin + dy2 * cos                                                      # (R, BH)
    mean = (tl.sum(g1 * x1, axis=1) + tl.sum(g2 * x2, axis=1)) / HEAD_DIM           # (R,)
    dx1 = rstd[:, None] * (g1 - x1 * mean[:, None])                                 # (R, BH)
    dx2 = rstd[:, None] * (g2 - x2 * mean[:, None])                                 # (R, BH)
    tl.store(dx_ptr + offs, dx1.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + HEAD_DIM // 2 + offs, dx2.to(dx_ptr.dtype.element_ty), mask=mask)


def qk_norm_rotary_forward(x, eps):
    """q or k (B,T,H,D) contiguous -> (y (B,T,H,D), rstd (B,T,H) fp32): each head RMS-normed, then rotated."""
    _flat_check("qk_norm_rotary_forward", x)
    B, T, H, D = x.shape
    y = torch.empty_like(x)                                                         # (B,T,H,D)
    rstd = torch.empty((B, T, H), dtype=torch.float32, device=x.device)             # (B,T,H) fp32
    block_h, block_rows = _row_blocks(D // 2, QK_TILE // 2)
    _qk_norm_rotary_forward_kernel[(triton.cdiv(B * T * H, block_rows),)](
        x, y, rstd, B * T * H, T, H, eps, HEAD_DIM=D, BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=QK_WARPS)
    return y, rstd


def qk_norm_rotary_backward(dy, x, rstd):
    """dx (B,T,H,D) in x's dtype from dy and the forward's x (B,T,H,D), contiguous, and rstd (B,T,H)."""
    _flat_check("qk_norm_rotary_backward", dy, x, rstd)
    B, T, H, D = x.shape
    dx = torch.empty_like(x)                                                        # (B,T,H,D)
    block_h, block_rows = _row_blocks(D // 2, QK_TILE // 2)
    _qk_norm_rotary_backward_kernel[(triton.cdiv(B * T * H, block_rows),)](
        dy, x, rstd, dx, B * T * H, T, H, HEAD_DIM=D, BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=QK_WARPS)
    return dx


# --- Muon: momentum, Newton-Schulz on the matmul kernels, the update ---------------------------------------
# torch_muon_update over n matrices of one shape (r, c): (1) one launch updates the momenta and writes u into a
# stacked (n, r, c) buffer with each chunk's sum of squares; (2) one launch divides each matrix by its norm;
# (3) Newton-Schulz on _matmul batched over the n matrices; (4) one launch updates the masters and copies.

MUON_BLOCK = 1 << 16 if INTERPRET else 4096  # elementwise kernels: 16 elements per thread with 8 warps
MUON_WARPS = 8
MUON_PARTIALS_BLOCK = 256  # the norm's chunk partials per loop step: a d12 (3072, 768) matrix has 144


@triton.jit
def _lerp(start, end, w):
    # torch's lerp, one fused multiply-add, exact at w = 1 (so fp32 results agree bit for bit)
    small = w < 0.5
    return tl.fma(tl.where(small, w, w - 1.0), end - start, tl.where(small, start, end))


@triton.jit
def _muon_momentum_kernel(table_ptr, n_tensors, u_ptr, sumsq_ptr, w_m, w_u, ALIGNED: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr):
    # table row: numel, first chunk, grad, m pointers; the matrix of first chunk f is u's f / (its chunks)
    row = _owner_row(table_ptr, n_tensors, 4, BLOCK_T)
    numel = tl.load(row)
    first = tl.load(row + 1)
    start = (tl.program_id(0) - first) * CHUNK                                      # int64 scalar
    g_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        numel = tl.multiple_of(numel, 16)
    u_ptr += first // tl.cdiv(numel, CHUNK) * numel
    size = tl.minimum(numel - start, CHUNK)                                         # this chunk's length
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)                                      # (BL,)
    for i0 in range(0, size, BLOCK):
        o = start + i0
        mask = offs < size - i0
        g = tl.load(g_ptr + o + offs, mask=mask, other=0.0)                         # (BL,) fp32
        m = _lerp(tl.load(m_ptr + o + offs, mask=mask, other=0.0), g, w_m)         # (BL,) fp32
        u = _lerp(g, m, w_u).to(u_ptr.dtype.element_ty)                             # (BL,) Nesterov's
        tl.store(m_ptr + o + offs, m, mask=mask)
        tl.store(u_ptr + o + offs, u, mask=mask)
        acc += u.to(tl.float32) * u.to(tl.float32)  # the norm of u as Newton-Schulz reads it (masked: 0)
    tl.store(sumsq_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _muon_normalize_kernel(x_ptr, sumsq_ptr, numel, chunks, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
    # x (n, numel) /= ||x[i]||_F + 1e-7: every program of matrix i sums its partials in one order; the norm
    # and the denominator rounded to x's dtype as torch rounds them
    i = tl.program_id(0).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)                                                  # (BP,)
    acc = tl.zeros((BLOCK_P,), dtype=tl.float32)                                    # (BP,)
    for p0 in range(0, chunks, BLOCK_P):
        acc += tl.load(sumsq_ptr + i * chunks + p0 + offs_p, mask=offs_p < chunks - p0, other=0.0)
    norm = tl.sqrt_rn(tl.sum(acc, axis=0)).to(x_ptr.dtype.element_ty).to(tl.float32)
    denom = (norm + 1e-7).to(x_ptr.dtype.element_ty).to(tl.float32)
    start = tl.program_id(1).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    mask = offs < numel - start
    x = tl.load(x_ptr + i * numel + start + offs, mask=mask, other=0.0).to(tl.float32)  # (BL,)
    tl.store(x_ptr + i * numel + start + offs, tl.div_rn(x, denom).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _axpby_kernel(out_ptr, x_ptr, y_ptr, n, a, b, BLOCK: tl.constexpr):
    # out may be x or y: each element is read before it is written, by the same program
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    mask = offs < n - start
    x = tl.load(x_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)          # (BL,)
    y = tl.load(y_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)          # (BL,)
    tl.store(out_ptr + start + offs, (a * x + b * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _muon_update_kernel(table_ptr, n_tensors, x_ptr, lr, decay, scale, HAS_COPY: tl.constexpr, ALIGNED: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr):
    # table row: numel, first chunk, param, copy pointers; the matrix's update is x's, as for the momentum
    row = _owner_row(table_ptr, n_tensors, 4, BLOCK_T)
    numel = tl.load(row)
    first = tl.load(row + 1)
    start = (tl.program_id(0) - first) * CHUNK                                      # int64 scalar
    p_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        numel = tl.multiple_of(numel, 16)
    if HAS_COPY:
        c_ptr = tl.load(row + 3).to(tl.pointer_type(tl.bfloat16))
        if ALIGNED:
            c_ptr = tl.multiple_of(c_ptr, 16)
    x_ptr += first // tl.cdiv(numel, CHUNK) * numel
    size = tl.minimum(numel - start, CHUNK)                                         # this chunk's length
    offs = tl.arange(0, BLOCK)                                                      # (BL,)
    for i0 in range(0, size, BLOCK):
        o = start + i0
        mask = offs < size - i0
        p = tl.load(p_ptr + o + offs, mask=mask, other=0.0)                         # (BL,) fp32
        update = tl.load(x_ptr + o + offs, mask=mask, other=0.0).to(tl.float32) * scale  # (BL,)
        # torch's order of roundings: p * decay, then minus lr * update
        p = p * decay - update * lr                                                 # (BL,) fp32
        tl.store(p_ptr + o + offs, p, mask=mask)
        if HAS_COPY:
            tl.store(c_ptr + o + offs, p.to(c_ptr.dtype.element_ty), mask=mask)


def axpby(out, a, x, b, y):
    """out = a x + b y elementwise in fp32, rounded once (contiguous, as many elements; out may be x or y)."""
    _flat_check("axpby", out, x, y)
    if not out.numel() == x.numel() == y.numel():
        raise ValueError(f"axpby: {x.numel()} and {y.numel()} elements into {out.numel()}")
    _axpby_kernel[(triton.cdiv(out.numel(), MUON_BLOCK),)](out, x, y, out.numel(), a, b, BLOCK=MUON_BLOCK,
                                                           num_warps=MUON_WARPS)


def add_into(acc, x):
    """acc += x (same shape and dtype, contiguous), rounded once: q's, k's and v's input gradients add up."""
    if acc.shape != x.shape or acc.dtype != x.dtype:
        raise ValueError(f"add_into: {x.dtype} {tuple(x.shape)} into {acc.dtype} {tuple(acc.shape)}")
    axpby(acc, 1.0, acc, 1.0, x)


def muon_update(params, grads, ms, copies, lr, momentum, weight_decay, dtype, chunk=MT_CHUNK, block=MT_BLOCK):
    """Muon in place, as torch_muon_update, over fp32 matrices of one shape: Newton-Schulz in `dtype` (fp32 or
    bf16); `copies` (bf16, or None) get the params rounded. chunk and block as in global_norm."""
    if dtype not in (torch.float32, torch.bfloat16) or params[0].dim() != 2:
        raise ValueError(f"muon_update: fp32 or bf16 Newton-Schulz on matrices, got {dtype} on "
                         f"{tuple(params[0].shape)}")
    _check_tensors("muon_update params/grads/m", [*params, *grads, *ms], (torch.float32,),
                   params[:1] * (3 * len(params)))
    if copies is not None:
        _check_tensors("muon_update copies", copies, (torch.bfloat16,), params)
    n, (r, c) = len(params), params[0].shape
    u = torch.empty((n, r, c), dtype=dtype, device=params[0].device)  # (n, r, c) u, then its update
    table, chunks, aligned = _tensor_table([grads, ms], chunk=chunk)
    sumsq = torch.empty(chunks, dtype=torch.float32, device=u.device)  # (chunks,) fp32 partial sums of u^2
    _muon_momentum_kernel[(chunks,)](table, n, u, sumsq, 1.0 - momentum, momentum, ALIGNED=aligned, CHUNK=chunk,
                                     BLOCK=block, BLOCK_T=triton.next_power_of_2(n), num_warps=MT_WARPS)
    _muon_normalize_kernel[(n, triton.cdiv(r * c, MUON_BLOCK))](u, sumsq, r * c, chunks // n, BLOCK=MUON_BLOCK,
                                                                BLOCK_P=MUON_PARTIALS_BLOCK, num_warps=MUON_WARPS)
    # newton_schulz in place, each product one batched launch; tall matrices without a transpose:
    # X <- 2X + B X on X = u^T is u <- 2u + u B (A = u^T u and B symmetric)
    tall = r > c
    for _ in range(NEWTON_SCHULZ_STEPS):
        ut = u.transpose(1, 2)                                                      # (n, c, r) a view
        A, _ = _matmul(ut, u) if tall else _matmul(u, ut)                           # (n, k, k), k = min(r, c)
        AA, _ = _matmul(A, A)                                                       # (n, k, k)
        axpby(A, -1.5, A, 0.5, AA)                                                  # (n, k, k) B, over A
        Bu, _ = _matmul(u, A) if tall else _matmul(A, u)                           # (n, r, c)
        axpby(u, 2.0, u, 1.0, Bu)                                                   # (n, r, c)
    table, chunks, aligned = _tensor_table([params, copies], chunk=chunk)
    _muon_update_kernel[(chunks,)](table, n, u, lr, 1.0 - lr * weight_decay, max(1.0, r / c) ** 0.5,
                                   HAS_COPY=copies is not None, ALIGNED=aligned, CHUNK=chunk, BLOCK=block,
                                   BLOCK_T=triton.next_power_of_2(n), num_warps=MT_WARPS)


# --- --fp8-head: the casts, and the head's matmuls on FP8 operands (docs/FORMATS.md, FP8 head) -----------
# The interpreter's fp32-to-float8 cast rounds wrongly, so the kernel rounds on the float8 grid itself and
# the cast is then exact; the products are matmul_kernel's on float8 operands, scaled in fp32.
FP8_TYPES = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_BIAS = {"e4m3fn": 7, "e5m2": 15}        # the formats' exponent biases ...
FP8_MANTISSA = {"e4m3fn": 3, "e5m2": 2}     # ... and mantissa bits
COLUMN_SUM_BLOCK = (16, 1 << 16) if INTERPRET else (LN_REDUCE_BLOCK_P, LN_REDUCE_BLOCK_C)  # (rows, columns)


@triton.jit
def _fp8_quantize_kernel(x_ptr, y_ptr, n, inverse, TOP: tl.constexpr, MANTISSA: tl.constexpr,
                         MIN_EXP: tl.constexpr, BLOCK: tl.constexpr):
    """y = x * inverse clamped to +-TOP, rounded to nearest even on the float8 grid, cast to y's type."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inverse  # (BLOCK,)
    v = tl.minimum(tl.maximum(v, -TOP), TOP)
    bits = v.to(tl.uint32, bitcast=True)  # (BLOCK,) sign, exponent, 23 mantissa bits
    DROP: tl.constexpr = 23 - MANTISSA
    # normal: add half an ulp less one plus the kept last bit (ties to even), and cut; carries are right
    normal = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) >> DROP << DROP  # (BLOCK,)
    # subnormal: fp32's own rounding of |v| + 1.5 * 2^23 ulp to the subnormals' fixed spacing, sign kept
    MAGIC: tl.constexpr = 1.5 * 2.0 ** (23 + MIN_EXP - MANTISSA)
    sub = ((tl.abs(v) + MAGIC) - MAGIC).to(tl.uint32, bitcast=True) | (bits >> 31 << 31)  # (BLOCK,)
    q = tl.where(tl.abs(v) < 2.0 ** MIN_EXP, sub, normal).to(tl.float32, bitcast=True)  # (BLOCK,) on the grid
    tl.store(y_ptr + offs, q.to(y_ptr.dtype.element_ty), mask=mask)


def triton_fp8_quantize(x, kind):
    """--fp8-head's operand `kind` of x in its float8 format: x times its scale's reciprocal, saturated and
    rounded to nearest even (the torch backend's bits)."""
    fmt = FP8_FORMATS[kind]
    y = torch.empty(x.shape, dtype=FP8_TYPES[fmt], device=x.device)
    _flat_check("fp8_quantize", x, y)
    n = x.numel()
    _fp8_quantize_kernel[(triton.cdiv(n, ELEM_BLOCK),)](x, y, n, fp8_reciprocal(kind), TOP=FP8_MAX[fmt],
                                                       MANTISSA=FP8_MANTISSA[fmt], MIN_EXP=1 - FP8_BIAS[fmt],
                                                       BLOCK=ELEM_BLOCK, num_warps=ELEM_WARPS)
    return y


def fp8_matmul_forward(x_f8, w_f8, b):
    """z (N,V) = (x_f8 (N,C) @ w_f8 (V,C).T) x_s w_s + b (V), in b's dtype."""
    return _matmul(x_f8, w_f8.t(), b, scale=FP8_SCALES["x"] * FP8_SCALES["w"], out_dtype=b.dtype)[0]


def fp8_matmul_backward(dz, x_f8, w_f8, dw, db):
    """dx (N,C) = g_f8 @ w_f8 (g_f8: dz in e5m2), dw (V,C) += g_f8.T @ x_f8, scaled; db (V) += dz's column sums."""
    g_f8 = triton_fp8_quantize(dz, "grad")  # (N, V)
    dx = _matmul(g_f8, w_f8, scale=FP8_SCALES["grad"] * FP8_SCALES["w"], out_dtype=dz.dtype)[0]  # (N, C)
    _matmul_dw(g_f8, x_f8, dw, None, scale=FP8_SCALES["grad"] * FP8_SCALES["x"])
    rows, cols = COLUMN_SUM_BLOCK
    N, V = dz.shape
    _layernorm_param_grad_kernel[(triton.cdiv(V, cols),)](dz, db, db, N, V, HAS_BIAS=False, BLOCK_P=rows,
                                                          BLOCK_C=cols)
    return dx


TRITON_SPEEDRUN_OPS = op_table("triton", dict(
    embedding_forward=functools.partial(encoder_forward, wpe=None), embedding_backward=embedding_backward,
    rmsnorm_forward=rmsnorm_forward, residual_rmsnorm_forward=residual_rmsnorm_forward,
    rmsnorm_backward=rmsnorm_backward,
    qk_norm_rotary_forward=qk_norm_rotary_forward, qk_norm_rotary_backward=qk_norm_rotary_backward,
    scaled_attention_forward=scaled_attention_forward, scaled_attention_backward=scaled_attention_backward,
    matmul_relu2_forward=matmul_relu2_forward,
    relu2_forward=functools.partial(_activation_forward, activation="relu2"),
    relu2_backward=functools.partial(_activation_backward, activation="relu2"),
    softcap_crossentropy_forward_backward=softcap_crossentropy_forward_backward,
    muon_update=muon_update, add_into=add_into, fp8_quantize=triton_fp8_quantize,
    fp8_matmul_forward=fp8_matmul_forward, fp8_matmul_backward=fp8_matmul_backward,
), SPEEDRUN_OP_NAMES)


# -- tools

# The speedrun recipe's --test and --bench-ops cases and the profiler's work of its ops: TOOLS["speedrun"].

def case_embedding(ops, r, B, T, C, H):
    Vp = B * T + 3
    idx = r.randint(max(2, B * T // 2), B, T)  # (B, T) tokens repeat
    table = r.rand(Vp, C)  # (Vp, C)
    x = ops.embedding_forward(idx, table)  # (B, T, C)
    dtable = r.rand(Vp, C, acc=True)  # (Vp, C) filled: the backward adds into it
    ops.embedding_backward(r.rand(B, T, C), idx, dtable)
    return dict(x=x, dtable=dtable)


def case_rmsnorm(ops, r, B, T, C, H, residual=False):
    eps = torch.finfo(r.rdt).eps  # the model's: the tested dtype's, in the reference too
    x = r.rand(B * T, C, scale=2.0, shift=0.5)  # (N, C)
    h = r.rand(B * T, C) if residual else None  # (N, C) added to x first
    w = r.rand(C, shift=1.0)  # (C,)
    x, y, rstd = ops.residual_rmsnorm_forward(x, h, w, eps) if residual else (x, *ops.rmsnorm_forward(x, w, eps))
    dw = r.rand(C, acc=True)  # (C,)
    dx = ops.rmsnorm_backward(r.rand(B * T, C), x, w, rstd, dw, dres=r.rand(B * T, C) if residual else None)
    return dict(y=y, rstd=rstd, dx=dx, dw=dw, **({"x": x} if residual else {}))


def case_matmul_relu2(ops, r, B, T, C, H):
    x, w, b = r.rand(B * T, C), r.rand(4 * C, C, scale=C ** -0.5), r.rand(4 * C)  # (N, C), (4C, C), (4C,)
    y, pre = ops.matmul_relu2_forward(x, w, b)  # (N, 4C) each
    dpre = ops.relu2_backward(r.rand(B * T, 4 * C), pre)  # (N, 4C)
    return dict(y=y, pre=pre, dpre=dpre)


def case_relu2(ops, r, B, T, C, H):
    pre = r.rand(B * T, 4 * C, scale=3.0)  # (N, 4C)
    y = ops.relu2_forward(pre)  # (N, 4C)
    return dict(y=y, dpre=ops.relu2_backward(r.rand(B * T, 4 * C), pre))


def case_softcap_crossentropy(ops, r, B, T, C, H):
    Vp = 5 * C + 8
    z = r.rand(B * T, Vp, scale=30.0)  # (N, Vp) well into the cap's bend
    targets = r.randint(Vp, B * T)  # (N,)
    losses = ops.softcap_crossentropy_forward_backward(z, targets, 1.0 / (B * T))  # (N,)
    return dict(losses=losses, dz=z)


def case_muon(ops, r, B, T, C, H):
    """Muon on two wide and two tall matrices, one step; small masters (0.02) show an error in the update."""
    out = {}
    c = min(C, 40)  # at most two 32-wide tiles (one partial) in the interpreter
    for name, shape in (("wide", (c, 3 * c + 1)), ("tall", (4 * c, c))):
        params = [r.rand(*shape, scale=0.02, acc=True) for _ in range(2)]  # fp32 masters (fp64 reference)
        ms = [r.rand(*shape, scale=0.1, acc=True) for _ in range(2)]
        copies = [p.to(r.dt) for p in params] if r.dt != params[0].dtype else None
        grads = [r.rand(*shape, acc=True) for _ in range(2)]
        ops.muon_update(params, grads, ms, copies, 0.02, MUON_MOMENTUM, MUON_WEIGHT_DECAY, r.dt)
        for i in range(2):
            out.update({f"{name} p{i}": params[i], f"{name} m{i}": ms[i],
                        f"{name} copy{i}": params[i] if copies is None else copies[i]})
    return out


def case_add_into(ops, r, B, T, C, H):
    """acc += x in the compute dtype, as the speedrun model adds q's, k's and v's input gradients."""
    acc = r.rand(B * T, C)  # (N, C)
    ops.add_into(acc, r.rand(B * T, C))
    return dict(acc=acc)


def case_scaled_attention(ops, r, B, T, C, H):
    """Separate q, k, v of H heads of HEAD_DIM (C unused). At T = 1 dq and dk are zero up to rounding: only dv."""
    q, k, v = (r.rand(B, T, H, HEAD_DIM, scale=1.5) for _ in range(3))  # (B, T, H, D) each
    out, lse = ops.scaled_attention_forward(q, k, v, ATTN_SCALE)  # (B, T, H*D), (B, H, T)
    dq, dk, dv = ops.scaled_attention_backward(r.rand(B, T, H * HEAD_DIM), q, k, v, out, lse,
                                               ATTN_SCALE)  # (B, T, H, D) each
    return dict(out=out, lse=lse, dv=dv, **(dict(dq=dq, dk=dk) if T > 1 else {}))


def case_qk_norm_rotary(ops, r, B, T, C, H):
    """q or k of H heads of HEAD_DIM (C unused), with the model's eps (the tested dtype's)."""
    x = r.rand(B, T, H, HEAD_DIM, scale=2.0, shift=0.5)  # (B, T, H, D)
    y, rstd = ops.qk_norm_rotary_forward(x, torch.finfo(r.rdt).eps)  # (B, T, H, D), (B, T, H)
    dx = ops.qk_norm_rotary_backward(r.rand(B, T, H, HEAD_DIM), x, rstd)  # (B, T, H, D)
    return dict(y=y, rstd=rstd, dx=dx)


def case_fp8_head(ops, r, B, T, C, H):
    N, Vp = B * T, B * T + 5
    x_f8 = ops.fp8_quantize(r.rand(N, C, scale=5.0), "x")  # (N, C) e4m3fn, some saturated
    w_f8 = ops.fp8_quantize(r.rand(Vp, C, scale=0.02), "w")  # (Vp, C) e4m3fn, some subnormal
    z = ops.fp8_matmul_forward(x_f8, w_f8, r.rand(Vp))  # (N, Vp)
    dw, db = r.rand(Vp, C, acc=True), r.rand(Vp, acc=True)  # (Vp, C), (Vp,) filled: the backward adds
    dx = ops.fp8_matmul_backward(r.rand(N, Vp, scale=1e-3), x_f8, w_f8, dw, db)  # (N, C)
    return dict(x_f8=x_f8, w_f8=w_f8, z=z, dx=dx, dw=dw, db=db)


# --test --recipe speedrun: the speedrun recipe's own ops (it shares matmul, AdamW and the step ops above)
SPEEDRUN_OP_CASES = [("embedding fwd+bwd", case_embedding), ("rmsnorm fwd+bwd", case_rmsnorm),
                     ("residual+rmsnorm fwd+bwd", functools.partial(case_rmsnorm, residual=True)),
                     ("qk norm+rotary fwd+bwd", case_qk_norm_rotary),
                     ("scaled attention fwd+bwd", case_scaled_attention),
                     ("matmul+relu2 fwd, relu2 bwd", case_matmul_relu2), ("relu2 fwd+bwd", case_relu2),
                     ("softcap crossentropy fwd+bwd", case_softcap_crossentropy),
                     ("muon_update", case_muon), ("add_into", case_add_into),
                     ("fp8 quantize, head matmul fwd+bwd", case_fp8_head)]


def speedrun_bench_cases(cfg, ops, device):
    """bench_cases of --recipe speedrun: its own ops at its shapes against backend torch's (and SDPA)."""
    dt = compute_dtype(cfg)
    B, T, C, Vp, L = cfg.batch_size, cfg.seq_len, cfg.n_embd, cfg.padded_vocab_size, cfg.n_layer
    H, D = C // HEAD_DIM, HEAD_DIM
    N, R = B * T, min(B * T, HEAD_ROWS)
    eps = torch.finfo(dt).eps

    def rand(*shape, dtype=dt):
        return torch.randn(shape, device=device, dtype=dtype)

    idx = torch.randint(cfg.vocab_size, (B, T), device=device)  # (B, T)
    table, dtable = rand(Vp, C), rand(Vp, C, dtype=torch.float32)  # (Vp, C) each
    x, h, dy, w = rand(N, C), rand(N, C), rand(N, C), rand(C)  # (N, C) x3, (C,)
    dw = rand(C, dtype=torch.float32)  # (C,)
    _, rstd = ops.rmsnorm_forward(x, w, eps)  # (N,)
    q, k, v, dq = rand(B, T, H, D), rand(B, T, H, D), rand(B, T, H, D), rand(B, T, H, D)  # (B, T, H, D) each
    _, qrstd = ops.qk_norm_rotary_forward(q, eps)  # (B, T, H)
    dout = rand(B, T, C)  # (B, T, C)
    xf, wf, bf = rand(N, C), rand(4 * C, C), rand(4 * C)  # (N, C), (4C, C), (4C,)
    pre, dpre = rand(N, 4 * C), rand(N, 4 * C)  # (N, 4C) each
    z, targets = rand(R, Vp), torch.randint(Vp, (R,), device=device)  # (R, Vp), (R,)
    heads = [s.transpose(1, 2) for s in (q, k, v)]  # (B, H, T, D) each
    xq, wq = ops.fp8_quantize(rand(R, C), "x"), ops.fp8_quantize(table, "w")  # (R, C), (Vp, C) e4m3fn
    hb, dhw, dhb = rand(Vp), rand(Vp, C, dtype=torch.float32), rand(Vp, dtype=torch.float32)  # the head's
    scaled_mm = "torch._scaled_mm" if device.type == "cuda" else "backend torch (fp32 matmul)"

    def sdpa_forward_backward():
        with torch.enable_grad():
            leaves = [_leaf(s) for s in heads]
            o = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=ATTN_SCALE)  # (B, H, T, D)
            o.backward(dout.view(B, T, H, D).transpose(1, 2))

    op = functools.partial(op_case, ops, TORCH_SPEEDRUN_OPS)
    cases = [
        op("embedding_forward", f"{B}x{T}x{C}", (idx, table), "F.embedding", lambda: F.embedding(idx, table)),
        op("embedding_backward", f"{B}x{T}x{C}", (dy.view(B, T, C), idx, dtable), "sort + cumsum + index_add_"),
        op("rmsnorm_forward", f"{N}x{C}", (x, w, eps), "backend torch (fp32 rsqrt)"),
        op("residual_rmsnorm_forward", f"{N}x{C}", (x, h, w, eps), "add + backend torch's"),
        op("rmsnorm_backward", f"{N}x{C}", (dy, x, w, rstd, dw, h), "backend torch (fp32)"),
        op("qk_norm_rotary_forward", f"{B}x{T}x{H}x{D}", (q, eps), "backend torch (fp32)"),
        op("qk_norm_rotary_backward", f"{B}x{T}x{H}x{D}", (dq, q, qrstd), "backend torch (fp32)"),
        op("scaled_attention_forward", f"{B}x{H}x{T}x{D}", (q, k, v, ATTN_SCALE), "SDPA causal",
           lambda: F.scaled_dot_product_attention(*heads, is_causal=True, scale=ATTN_SCALE)),
        ("scaled_attention_forward+backward", f"{B}x{H}x{T}x{D}",
         lambda: ops.scaled_attention_backward(dout, q, k, v, *ops.scaled_attention_forward(
             q, k, v, ATTN_SCALE), ATTN_SCALE),
         "SDPA causal fwd+bwd", sdpa_forward_backward, None),
        op("matmul_relu2_forward", f"mlp.fc {N}x{C}x{4 * C}", (xf, wf, bf), "F.linear + relu + square",
           lambda: F.relu(F.linear(xf, wf, bf)).square()),
        op("relu2_forward", f"{N}x{4 * C}", (pre,), "relu + square", lambda: F.relu(pre).square()),
        op("relu2_backward", f"{N}x{4 * C}", (dpre, pre), "backend torch"),
        op("softcap_crossentropy_forward_backward", f"{R}x{Vp}", (z, targets, 1.0), "backend torch (fp32 chunks)"),
        op("add_into", f"{N}x{C}", (x, h), "Tensor.add_", lambda: x.add_(h)),
        op("fp8_quantize", f"{Vp}x{C}", (table, "w"), "mul + clamp + cast"),
        op("fp8_matmul_forward", f"lm head {R}x{C}x{Vp}", (xq, wq, hb), scaled_mm),
        op("fp8_matmul_backward", f"lm head {R}x{C}x{Vp}", (z, xq, wq, dhw, dhb), f"cast + 2 x {scaled_mm} + sum"),
    ]
    for r, c, n in ((C, C, 4 * L), (4 * C, C, L), (C, 4 * C, L)):  # each shape Muon batches over
        ps = [rand(r, c, dtype=torch.float32) for _ in range(n)]
        gs, ms = [torch.randn_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        copies = [p.to(dt) for p in ps] if dt != torch.float32 else None
        args = (ps, gs, ms, copies, 1e-4, MUON_MOMENTUM, MUON_WEIGHT_DECAY, dt)
        cases.append(op("muon_update", f"{n} x {r}x{c}", args, "backend torch (torch.bmm)"))
    return cases


def speedrun_op_work(name, args, kwargs, out):
    """op_work of an op of SPEEDRUN_OP_NAMES: (flops, bytes) one call cannot do without; else None."""
    if name == "matmul_relu2_forward":
        x, w = args[0], args[1]
        return 2 * x.shape[0] * x.shape[1] * w.shape[0], 0
    if name in ("scaled_attention_forward", "scaled_attention_backward"):
        B, T, H, D = args[0 if name == "scaled_attention_forward" else 1].shape
        return (2 if name == "scaled_attention_forward" else 5) * B * T * T * H * D, 0
    if name in ("fp8_matmul_forward", "fp8_matmul_backward"):  # one product, or two
        N, C = args[1].shape
        return (2 if name == "fp8_matmul_forward" else 4) * N * C * args[2].shape[0], 0
    if name == "muon_update":  # Newton-Schulz on each (r', c') matrix, r' <= c': X X^T, A A, B X a step
        n, (r, c) = len(args[0]), sorted(args[0][0].shape)
        return n * NEWTON_SCHULZ_STEPS * (4 * r * r * c + 2 * r ** 3), 0
    if name == "embedding_forward":
        return 0, _nbytes(args[0]) + 2 * _nbytes(out)
    if name == "embedding_backward":  # the table rows it updates, read and written
        dx, idx, dtable = args[:3]
        return 0, _nbytes(dx, idx) + 2 * dx.numel() * dtable.element_size()
    if name == "rmsnorm_backward":  # dw (and dres) are read and written
        return 0, _nbytes(*args[:4], *args[5:], out, *kwargs.values()) + 2 * _nbytes(args[4])
    if name == "add_into":  # acc read and written
        return 0, 3 * _nbytes(args[1])
    if name == "softcap_crossentropy_forward_backward":
        return 0, 2 * _nbytes(args[0]) + _nbytes(args[1], out)
    if name in SPEEDRUN_OP_NAMES:  # the norms, q/k norm+rotary, relu2: inputs read, outputs written
        return 0, _nbytes(*args, *(out if isinstance(out, tuple) else (out,)))
    return None


TOOLS["speedrun"] = RecipeTools(
    test_config=Config(recipe="speedrun", n_layer=2, n_head=1, n_embd=HEAD_DIM, vocab_size=61,
                       padded_vocab_size=64, seq_len=9, batch_size=2),  # one head
    test_cases=lambda: SPEEDRUN_OP_CASES, autograd_test="tests/test_speedrun_triton.py",
    bench_cases=speedrun_bench_cases, op_work=speedrun_op_work)
