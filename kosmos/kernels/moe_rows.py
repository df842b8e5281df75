"""Row-wise Triton kernels of the MoE reference impl (kosmos.ops.moe_math): the SwiGLU pieces between its grouped
matmuls, forward and backward on saved up rows, one pass over the rows each instead of eager's two (forward) or ten
(backward); the row gathers and the fold. Registered with kosmos.ops.dispatch as row kernels; the ops keep the torch
math for other devices.

    swiglu_rows(h, dtype) -> act [S, I] in dtype: silu(gate) * up of h = [gate | up], rounded as the ops round it

    swiglu_rows_backward(h, d_au, w, in_place=False, act_w=None) -> (d_h [S, 2I] in h's dtype, d_w [S] fp32);
        in_place: d_h over h; act_w: act * w written there too (d_au allowed; act = silu(gate) * up of
        h = [gate | up], in d_au's dtype)
        d_au = grad_out rows @ down_proj[e] (unweighted): d_act = d_au * w, d_h = d SwiGLU, d_w = <d_au, act>
    gather_rows(src, index, dtype) -> [len(index), ...]: src[index[r]] cast to dtype, zero where index[r] is out
        of src's rows (the pad rows' sentinel): index_select + index_fill_ + cast in one pass
    fold(rows, row, weights=None, out=None, add=None, dtype=None) -> [T, H]: sum over slots j (in order, fp32) of
        rows[row[t, j]] (* weights[t, j], each product rounded to P = promote(rows, weights)), + add; fp32 out, or
        with weights P (then cast to dtype if given)

Every launch goes through launch_plan.launch (the compiled kernel kept per argument signature: in a backward that
waits on the host's launches, Triton's per-call binding is time the device idles).

act is rounded as the ops round it (silu and the product in h's dtype, then `dtype`); the backward's arithmetic
runs in fp32 and is rounded once at the end (eager rounds after every op: differences are at that dtype's
rounding level)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from kosmos.kernels import launch_plan

BR = 16  # rows per program
BC = 256  # columns per step
# fold's (tokens, columns, warps) per program: of ten tiles, the fastest forward and backward folds on an H200
# (benchmarks/RESULTS.md, forty-first session; benchmarks/moe_gather_rows.py --fold sweeps them)
FOLD_TILE = (8, 256, 4)


@triton.jit
def _act(gate, up, W: tl.constexpr):
    """silu(gate) * up with the ops' roundings to W; fp32 out."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(W).to(tl.float32)
    return (silu * up.to(tl.float32)).to(W).to(tl.float32)


@triton.jit
def _swiglu_rows_kernel(h, act, S, I, BR: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (rows < S)[:, None] & (cols < I)[None, :]
    at = rows.to(tl.int64)[:, None] * (2 * I) + cols[None, :]
    gate = tl.load(h + at, mask=m, other=0.0)
    up = tl.load(h + at + I, mask=m, other=0.0)
    a = _act(gate, up, h.dtype.element_ty)
    tl.store(act + rows.to(tl.int64)[:, None] * I + cols[None, :], a.to(act.dtype.element_ty), mask=m)


def swiglu_rows(h: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """act [S, I] in `dtype` (default h's) = silu(gate) * up of h = [gate | up] [S, 2I], silu and the product
    rounded to h's dtype as the torch ops round them (kosmos.ops.moe_math._swiglu): one pass over h where torch's
    silu and mul make two (the reference forward's up rows; 1.1 ms of Qwen3-235B's T = 16384 forward)."""
    if not (h.is_cuda and h.is_contiguous() and h.dim() == 2 and h.shape[1] % 2 == 0):
        raise ValueError(f"kosmos moe_rows.swiglu_rows: a contiguous CUDA [S, 2I] tensor expected, got "
                         f"{tuple(h.shape)} on {h.device}")
    S, I = h.shape[0], h.shape[1] // 2
    act = torch.empty(S, I, dtype=dtype or h.dtype, device=h.device)
    if act.numel():
        launch_plan.launch(_swiglu_rows_kernel, (triton.cdiv(S, 64), triton.cdiv(I, 256)), (h, act, S, I), BR=64,
                           BC=256, num_warps=4)
    return act


@triton.jit
def _row_block(w, S, BR: tl.constexpr):
    """This program's BR rows: (mask, int64 indices, their weights in fp32)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < S
    return rmask, rows.to(tl.int64), tl.load(w + rows, mask=rmask, other=0.0).to(tl.float32)


@triton.jit
def _swiglu_rows_backward_kernel(h, d_au, w, d_h, d_w, act_w, S, I, IN_PLACE: tl.constexpr, ACT_W: tl.constexpr,
                                 BR: tl.constexpr, BC: tl.constexpr):
    rmask, r64, wr = _row_block(w, S, BR)
    W: tl.constexpr = h.dtype.element_ty
    D: tl.constexpr = d_au.dtype.element_ty
    dot = tl.zeros((BR,), dtype=tl.float32)
    for c0 in range(0, I, BC):
        cols = c0 + tl.arange(0, BC)
        m = rmask[:, None] & (cols < I)[None, :]
        gate = tl.load(h + r64[:, None] * (2 * I) + cols[None, :], mask=m, other=0.0).to(tl.float32)
        up = tl.load(h + r64[:, None] * (2 * I) + I + cols[None, :], mask=m, other=0.0).to(tl.float32)
        da = tl.load(d_au + r64[:, None] * I + cols[None, :], mask=m, other=0.0).to(tl.float32)
        a = _act(gate, up, W).to(D).to(tl.float32)
        dot += tl.sum(da * a, axis=1)
        d_act = da * wr[:, None]
        sig = 1.0 / (1.0 + tl.exp(-gate))
        d_gate = d_act * up * (sig * (1.0 + gate * (1.0 - sig)))
        d_up = d_act * (gate * sig).to(W).to(tl.float32)
        if IN_PLACE or ACT_W:  # d_h is h, act_w may be d_au: every load of this block precedes any store
            tl.debug_barrier()
        tl.store(d_h + r64[:, None] * (2 * I) + cols[None, :], d_gate.to(W), mask=m)
        tl.store(d_h + r64[:, None] * (2 * I) + I + cols[None, :], d_up.to(W), mask=m)
        if ACT_W:  # the torch math's act * w (kosmos.ops.moe_math._swiglu_rows_backward_)
            tl.store(act_w + r64[:, None] * I + cols[None, :], (a * wr[:, None]).to(D), mask=m)
    tl.store(d_w + r64, dot, mask=rmask)


def _check(h: torch.Tensor, w: torch.Tensor, *more: torch.Tensor) -> None:
    if not (h.is_cuda and h.is_contiguous() and w.is_contiguous() and all(t.is_contiguous() for t in more)):
        raise ValueError("kosmos moe_rows: contiguous CUDA tensors expected")
    if w.shape != (h.shape[0],) or any(t.shape[0] != h.shape[0] for t in more):
        raise ValueError(f"kosmos moe_rows: row counts differ: h {tuple(h.shape)}, w {tuple(w.shape)}")


def swiglu_rows_backward(h: torch.Tensor, d_au: torch.Tensor, w: torch.Tensor, in_place: bool = False,
                         act_w: Optional[torch.Tensor] = None):
    """(d_h [S, 2I] in h's dtype, d_w [S] fp32) from h [S, 2I], d_au [S, I] and w [S]; with in_place, d_h is
    written over h (and returned). act_w given ([S, I] in d_au's dtype, d_au itself allowed): act * w (act =
    silu(gate) * up, rounded as the ops round it) is written there too, from the same loads (the d_down_proj that
    follows needs it once h holds d_h)."""
    _check(h, w, d_au, *([act_w] if act_w is not None else []))
    S, I = h.shape[0], h.shape[1] // 2
    if act_w is not None and (act_w.shape != d_au.shape or act_w.dtype != d_au.dtype):
        raise ValueError(f"kosmos moe_rows: act_w {tuple(act_w.shape)} {act_w.dtype} is not d_au's "
                         f"{tuple(d_au.shape)} {d_au.dtype}")
    d_h = h if in_place else torch.empty_like(h)
    d_w = torch.empty(S, dtype=torch.float32, device=h.device)
    if S:
        launch_plan.launch(_swiglu_rows_backward_kernel, (triton.cdiv(S, BR),),
                           (h, d_au, w, d_h, d_w, d_au if act_w is None else act_w, S, I), IN_PLACE=in_place,
                           ACT_W=act_w is not None, BR=BR, BC=BC, num_warps=4)
    return d_h, d_w


@triton.jit
def _fold_kernel(rows, row, w, add, out, T, H, TOP_K: tl.constexpr, HAS_W: tl.constexpr, ROUND_P: tl.constexpr,
                 HAS_ADD: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    ts = tl.program_id(0) * BT + tl.arange(0, BT)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    tmask = ts < T
    m = tmask[:, None] & (hs < H)[None, :]
    # ROUND_P: the products' dtype P = promote(rows, weights) is 16-bit, so it is rows' (and weights') dtype
    P: tl.constexpr = rows.dtype.element_ty
    acc = tl.zeros((BT, BH), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        r = tl.load(row + ts.to(tl.int64) * TOP_K + j, mask=tmask, other=0).to(tl.int64)
        v = tl.load(rows + r[:, None] * H + hs[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w + ts.to(tl.int64) * TOP_K + j, mask=tmask, other=0.0).to(tl.float32)[:, None]
            if ROUND_P:
                v = v.to(P).to(tl.float32)
        acc += v
    at = ts.to(tl.int64)[:, None] * H + hs[None, :]
    if HAS_ADD:
        acc += tl.load(add + at, mask=m, other=0.0).to(tl.float32)
    if ROUND_P:  # the sum is P's before any cast to out's dtype
        acc = acc.to(P).to(tl.float32)
    tl.store(out + at, acc.to(out.dtype.element_ty), mask=m)


def fold(rows: torch.Tensor, row: torch.Tensor, weights=None, out=None, add=None,
         dtype: Optional[torch.dtype] = None, tile: tuple = FOLD_TILE) -> torch.Tensor:
    """[T, H] from rows [S, H] and row [T, k] (indices into rows), optionally weighted by weights [T, k], plus
    add [T, H] (contiguous, any float dtype; added in fp32 to the sum) if given; written into `out` if given
    (contiguous, not overlapping rows or add). dtype (with weights): the result cast to it from the sum's dtype P
    as `.to(dtype)` casts it, in the same pass (DeepSeek-V3's fp32 routing weights make P fp32 for a bf16 model).
    tile: (tokens, columns, warps) of a program."""
    T, k = row.shape
    if not (rows.is_cuda and rows.is_contiguous() and row.is_contiguous()):
        raise ValueError("kosmos moe_rows.fold: contiguous CUDA tensors expected")
    if weights is not None and (weights.shape != row.shape or not weights.is_contiguous()):
        raise ValueError(f"kosmos moe_rows.fold: weights {tuple(weights.shape)} vs row {tuple(row.shape)}")
    if add is not None and (add.shape != (T, rows.shape[1]) or not add.is_contiguous()):
        raise ValueError(f"kosmos moe_rows.fold: add {tuple(add.shape)} is not a contiguous [{T}, {rows.shape[1]}]")
    P = torch.float32 if weights is None else torch.promote_types(rows.dtype, weights.dtype)
    if dtype is not None and weights is None:
        raise ValueError("kosmos moe_rows.fold: dtype is for weighted folds (an unweighted one is fp32)")
    D = dtype or P
    if out is None:
        out = torch.empty(T, rows.shape[1], dtype=D, device=rows.device)
    elif out.shape != (T, rows.shape[1]) or out.dtype != D or not out.is_contiguous():
        raise ValueError(f"kosmos moe_rows.fold: out {tuple(out.shape)} {out.dtype} is not a contiguous "
                         f"[{T}, {rows.shape[1]}] {D}")
    if T:
        launch_fold(rows, row, weights, add, out, tile)
    return out


def launch_fold(rows, row, weights, add, out, tile: tuple = FOLD_TILE) -> None:
    """fold's launch for arguments it has checked (the interpreter test calls it on CPU tensors)."""
    (T, k), H = row.shape, rows.shape[1]
    round_p = weights is not None and torch.promote_types(rows.dtype, weights.dtype) != torch.float32
    bt, bh, warps = tile
    launch_plan.launch(_fold_kernel, (triton.cdiv(T, bt), triton.cdiv(H, bh)),
                       (rows, row, weights if weights is not None else rows, add if add is not None else rows, out, T,
                        H), TOP_K=k, HAS_W=weights is not None, ROUND_P=round_p, HAS_ADD=add is not None, BT=bt,
                       BH=bh, num_warps=warps)


@triton.jit
def _gather_rows_kernel(src, index, out, S, N, C, BR: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    rmask = rows < S
    src_row = tl.load(index + rows, mask=rmask, other=N).to(tl.int64)
    inside = rmask & (src_row < N) & (src_row >= 0)
    cmask = cols < C
    v = tl.load(src + src_row[:, None] * C + cols[None, :], mask=inside[:, None] & cmask[None, :], other=0.0)
    tl.store(out + rows.to(tl.int64)[:, None] * C + cols[None, :], v.to(out.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


def gather_rows(src: torch.Tensor, index: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """[len(index), *src.shape[1:]] in `dtype` (default src's): row r is src[index[r]] cast, or zeros where
    index[r] is not a row of src (negative or >= len(src): the sorted pairs' pad rows carry len(src))."""
    if not (src.is_cuda and src.is_contiguous() and index.is_cuda and index.dim() == 1):
        raise ValueError("kosmos moe_rows.gather_rows: a contiguous CUDA source and a 1-d CUDA index expected")
    out = torch.empty(index.shape[0], *src.shape[1:], dtype=dtype or src.dtype, device=src.device)
    if out.numel():
        launch_gather(src, index, out)
    return out


def launch_gather(src, index, out) -> None:
    """gather_rows' launch for arguments it has checked (the interpreter test calls it on CPU tensors)."""
    C = math.prod(src.shape[1:])  # elements per row
    # 64 x 256: the fastest of seven tiles on an H200 (benchmarks/RESULTS.md, fifteenth session); rows of fewer
    # elements (per-pair weights: one) take narrower, taller tiles of the same size or smaller
    bc = max(16, triton.next_power_of_2(min(C, 256)))
    br = min(256, 64 * 256 // bc)
    grid = (triton.cdiv(index.shape[0], br), triton.cdiv(C, bc))
    launch_plan.launch(_gather_rows_kernel, grid, (src, index, out, index.shape[0], src.shape[0], C), BR=br, BC=bc,
                       num_warps=4)
