"""Fused backward of `kosmos::moe_layer` without expert parallelism in ONE persistent, self-scheduling launch
(`moe_backward`): exactly the reference `moe_layer_backward` of kosmos.ops.moe (`_route_forward` recomputed,
`experts_backward`, `route_backward`), saving nothing beyond the forward's inputs. Router: softmax or sigmoid
scoring (selection with score_correction_bias / groups as in the forward), renormalisation, routed_scaling_factor,
router_bias, grad_router_logits; the reference's roundings are emulated (matmuls rounded to their operands' dtype,
SwiGLU backward ops rounded to the weight dtype, sigmoid-router ops rounded to the logits dtype).

Task stream (one atomic claim counter; a task's kind follows from its index; every producer precedes its
consumers, so a wait is always on a task some running program has already claimed):

    [ROUTE x n_tiles] [SCAN] [SCATTER x n_tiles] [UP x mb*n_iblk] [DY x mb*n_hblk] [DACT x mb*n_iblk]
    [WDOWN x E*n_wh*n_wi] [DX x mb*n_hblk] [WGU x E*n_wr*n_wh] [FOLD x n_tiles] [WROUTER x n_rh]

- ROUTE / SCAN: the forward's code (kosmos.kernels.moe_route.route_tile with the logits kept in a workspace,
  scan_counts): the same deterministic expert-sorted rows as the forward.
- SCATTER(tile): sorted_token[row] = t and sorted_weight[row] = w[t, j] for the tile's pairs.
- UP(block b, I-chunk): gate / up of the BM rows (rounded to the weight dtype W) into gu_ws [T*k, 2I] and
  act = (silu(gate) * up) into act [T*k, I]. up_done[b] += 1.
- DY(block b, H-chunk): waits up_done[b] == n_iblk. y = act @ down[e].T (rounded to down's dtype D),
  g = grad_out[token] in the product dtype P = promote(D, logits dtype); per row the chunk's partial
  sum_H (g * y) (products rounded to P, fp32 sum) into dwp [T*k, n_hblk]; d_y = (g * w) rounded to P, cast to D,
  into d_y [T*k, H]. dy_done[b] += 1.
- DACT(block b, I-chunk): waits dy_done[b] == n_hblk. d_act = d_y @ down[e][:, chunk] (rounded to W), SwiGLU
  backward (every op rounded to W, as torch does), d_h = [d_gate | d_up] written IN PLACE over the chunk's
  gate / up columns of gu_ws (nothing else reads them). dact_done[b] += 1.
- WDOWN(expert e, H tile, I tile): waits scanned, then loops over e's row blocks IN ORDER, waiting dy_done of
  each: d_down[e] tile = sum over the blocks of d_y[rows]^T @ act[rows] (fp32), rounded to D once. An expert
  without rows gets zeros.
- DX(block b, H-chunk): waits dact_done[b] == n_iblk. d_x = d_h @ gate_up[e] (K = 2I, rounded to W) into
  d_x [T*k, H]. dxed += 1 (also for blocks past the real number).
- WGU(expert e, 2I tile, H tile): as WDOWN over dact_done: d_gate_up[e] tile = sum d_h[rows]^T @ x[rows].
- FOLD(tile): waits dxed == mb*n_hblk (which implies every DY before it). Router backward of the tile: d_w per
  pair = the partials summed over the H chunks in order, rounded to the logits dtype RD; scores recomputed from
  the kept logits; scaling, renormalisation, softmax / sigmoid backward, + grad_router_logits, rounded to RD ->
  d_logits [T, E] (workspace). d_hidden[t] = sum_j d_x[row(t, j)] in j order (fp32) + (d_logits @ router_weight)
  rounded to RD, cast to hidden's dtype. folded += 1.
- WROUTER(H tile): waits folded == n_tiles. d_router_weight[:, tile] = sum over token tiles in order of
  d_logits^T @ hidden (fp32, rounded to RD, cast to router_weight's dtype); the first tile's task also sums
  d_router_bias (fp32, token tiles in order).

Determinism: rows are placed by the scan; every output element is computed by exactly one task with a fixed
reduction order (K loops in order, weight gradients over an expert's row blocks in order, d_w over H chunks in
order, the fold in j order, router weight gradients over token tiles in order); no float atomics. Two runs are
bit-identical whatever the number of programs.

Counters, CUDA graphs and errors: as the forward (kosmos.kernels.moe): a per-device int32 control tensor of its
own (claim, done, routed, scanned, scattered, dxed, folded, the error word, up_done / dy_done / dact_done per row
block), zeroed by the last program to count itself out; no host scalar depends on the routing, so the launch is
capturable. Spins are bounded (runtime.spin_timeout_s) -> runtime.KernelTimeout at the next call.

Loads are pointer loads (gathered token rows, per-expert weight slices with masks); TMA descriptors are a
follow-up.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from kosmos.kernels import runtime
from kosmos.kernels.moe import _Control, _block_rows, _signal, max_blocks, routing_constexprs
from kosmos.kernels.moe import control as _moe_control
from kosmos.kernels.moe_route import (_round, pair_rows, pick, route_tile, router_d_logits, scan_counts, scores_at,
                                      scores_of)
from kosmos.kernels.signals import ERR_TIMEOUT, record_local_error, wait_flag

OP_ID = tl.constexpr(4)
OP_NAME = "moe_layer_backward"

C_CLAIM = tl.constexpr(0)
C_DONE = tl.constexpr(1)
C_ROUTED = tl.constexpr(2)
C_SCANNED = tl.constexpr(3)
C_SCATTERED = tl.constexpr(4)
C_DXED = tl.constexpr(5)
C_FOLDED = tl.constexpr(6)
C_ERR = tl.constexpr(8)  # code, op, task
C_BLOCKS = tl.constexpr(16)  # up_done[mb] | dy_done[mb] | dact_done[mb]
CTRL_HEAD = 16


# ----------------------------------------------------------------------------------------------------------
# jit pieces


@triton.jit
def _scatter_tile(tile, ids_ptr, rank_ptr, w_ptr, counts, sorted_tok, sorted_w, T, E,
                  TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr):
    rows, m2, offs, pos = pair_rows(tile, ids_ptr, rank_ptr, counts, T, E, TOP_K, KP, BT)
    tok = rows[:, None] + tl.zeros((BT, KP), dtype=tl.int32)
    tl.store(sorted_tok + pos, tok, mask=m2)
    w = tl.load(w_ptr + offs, mask=m2, other=0.0, cache_modifier=".cg")
    tl.store(sorted_w + pos, w, mask=m2)


@triton.jit
def _rows_of(b, meta, sorted_tok, E, spe, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """Row block b -> (valid, expert, rows, row mask, token of each row). meta lists E segments of rows, spe
    consecutive segments per expert (1 here; the EP backward's owner has one per source rank)."""
    valid, e, row0, row_end = _block_rows(b, meta, E, BM, BLOCK_E)
    rows = row0 + tl.arange(0, BM)
    rmask = (rows < row_end) & valid
    tok = tl.load(sorted_tok + rows, mask=rmask, other=0, cache_modifier=".cg").to(tl.int64)
    return valid, (e // spe).to(tl.int64), rows.to(tl.int64), rmask, tok


@triton.jit
def _up_tile(b, ib, meta, sorted_tok, hidden, h_ld, gu, gu_ws, act, H, I, E, spe,
             BM: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr):
    W: tl.constexpr = gu.dtype.element_ty
    valid, e, rows, rmask, tok = _rows_of(b, meta, sorted_tok, E, spe, BM, BLOCK_E)
    if valid:
        cols = ib * BI + tl.arange(0, BI)
        cmask = cols < I
        base = gu + e * 2 * I * H
        acc_g = tl.zeros((BM, BI), dtype=tl.float32)
        acc_u = tl.zeros((BM, BI), dtype=tl.float32)
        for k0 in range(0, H, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < H
            x = tl.load(hidden + tok[:, None] * h_ld + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0).to(W)
            wm = kmask[:, None] & cmask[None, :]
            g = tl.load(base + cols[None, :].to(tl.int64) * H + ks[:, None], mask=wm, other=0.0)
            u = tl.load(base + (I + cols)[None, :].to(tl.int64) * H + ks[:, None], mask=wm, other=0.0)
            acc_g = tl.dot(x, g, acc_g, input_precision=PREC)
            acc_u = tl.dot(x, u, acc_u, input_precision=PREC)
        gate = acc_g.to(W)
        up = acc_u.to(W)
        gf = gate.to(tl.float32)
        silu = (gf / (1.0 + tl.exp(-gf))).to(W).to(tl.float32)
        a = (silu * up.to(tl.float32)).to(W).to(act.dtype.element_ty)
        m = rmask[:, None] & cmask[None, :]
        ws = gu_ws + rows[:, None] * (2 * I) + cols[None, :]
        tl.store(ws, gate, mask=m)
        tl.store(ws + I, up, mask=m)
        tl.store(act + rows[:, None] * I + cols[None, :], a, mask=m)


@triton.jit
def _dy_tile(b, nb, meta, sorted_tok, sorted_w, act, down, grad_out, g_ld, d_y, dwp, H, I, E, spe, n_hblk,
             BM: tl.constexpr, BN: tl.constexpr, BK2: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr,
             PD_F32: tl.constexpr):
    D: tl.constexpr = down.dtype.element_ty
    valid, e, rows, rmask, tok = _rows_of(b, meta, sorted_tok, E, spe, BM, BLOCK_E)
    if valid:
        hs = nb * BN + tl.arange(0, BN)
        hmask = hs < H
        base = down + e * H * I
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, BK2):
            ks = k0 + tl.arange(0, BK2)
            kmask = ks < I
            a = tl.load(act + rows[:, None] * I + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0,
                        cache_modifier=".cg")
            dn = tl.load(base + hs[None, :].to(tl.int64) * I + ks[:, None], mask=kmask[:, None] & hmask[None, :],
                         other=0.0)
            acc = tl.dot(a, dn, acc, input_precision=PREC)
        y = acc.to(D).to(tl.float32)
        m = rmask[:, None] & hmask[None, :]
        g = tl.load(grad_out + tok[:, None] * g_ld + hs[None, :], mask=m, other=0.0).to(tl.float32)
        if not PD_F32:  # product dtype P == D: grad_out.to(P), every product rounded to P
            g = g.to(D).to(tl.float32)
        prod = g * y
        if not PD_F32:
            prod = prod.to(D).to(tl.float32)
        part = tl.sum(tl.where(m, prod, 0.0), axis=1)
        tl.store(dwp + rows * n_hblk + nb, part, mask=rmask)
        w = tl.load(sorted_w + rows, mask=rmask, other=0.0, cache_modifier=".cg")
        dy = g * w[:, None]
        if not PD_F32:
            dy = dy.to(D).to(tl.float32)
        tl.store(d_y + rows[:, None] * H + hs[None, :], dy.to(D), mask=m)


@triton.jit
def _dact_tile(b, ib, meta, sorted_tok, d_y, down, gu_ws, H, I, E, spe,
               BM: tl.constexpr, BI: tl.constexpr, BKH: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr,
               W_ROUND: tl.constexpr):
    W: tl.constexpr = gu_ws.dtype.element_ty
    valid, e, rows, rmask, tok = _rows_of(b, meta, sorted_tok, E, spe, BM, BLOCK_E)
    if valid:
        cols = ib * BI + tl.arange(0, BI)
        cmask = cols < I
        base = down + e * H * I
        acc = tl.zeros((BM, BI), dtype=tl.float32)
        for k0 in range(0, H, BKH):
            ks = k0 + tl.arange(0, BKH)
            kmask = ks < H
            dy = tl.load(d_y + rows[:, None] * H + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0,
                         cache_modifier=".cg")
            dn = tl.load(base + ks[:, None].to(tl.int64) * I + cols[None, :], mask=kmask[:, None] & cmask[None, :],
                         other=0.0)
            acc = tl.dot(dy, dn, acc, input_precision=PREC)
        d_act = acc.to(W).to(tl.float32)
        m = rmask[:, None] & cmask[None, :]
        ws = gu_ws + rows[:, None] * (2 * I) + cols[None, :]
        gate = tl.load(ws, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        up = tl.load(ws + I, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        # torch: sig = sigmoid(gate); d_gate = d_act * up * (sig * (1 + gate * (1 - sig))); d_up = d_act * silu
        sig = _round(1.0 / (1.0 + tl.exp(-gate)), W, W_ROUND)
        silu = _round(gate / (1.0 + tl.exp(-gate)), W, W_ROUND)
        dsilu = _round(sig * _round(1.0 + _round(gate * _round(1.0 - sig, W, W_ROUND), W, W_ROUND), W, W_ROUND),
                       W, W_ROUND)
        d_gate = _round(_round(d_act * up, W, W_ROUND) * dsilu, W, W_ROUND)
        d_up = _round(d_act * silu, W, W_ROUND)
        tl.debug_barrier()  # every thread has read its gate / up before the chunk is overwritten
        tl.store(ws, d_gate.to(W), mask=m)
        tl.store(ws + I, d_up.to(W), mask=m)


@triton.jit
def _dx_tile(b, nb, meta, sorted_tok, d_h, gu, d_x, H, I, E, spe,
             BM: tl.constexpr, BN: tl.constexpr, BK3: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr):
    valid, e, rows, rmask, tok = _rows_of(b, meta, sorted_tok, E, spe, BM, BLOCK_E)
    if valid:
        hs = nb * BN + tl.arange(0, BN)
        hmask = hs < H
        base = gu + e * 2 * I * H
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, 2 * I, BK3):
            ks = k0 + tl.arange(0, BK3)
            kmask = ks < 2 * I
            dh = tl.load(d_h + rows[:, None] * (2 * I) + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                         other=0.0, cache_modifier=".cg")
            g = tl.load(base + ks[:, None].to(tl.int64) * H + hs[None, :], mask=kmask[:, None] & hmask[None, :],
                        other=0.0)
            acc = tl.dot(dh, g, acc, input_precision=PREC)
        tl.store(d_x + rows[:, None] * H + hs[None, :], acc.to(d_x.dtype.element_ty),
                 mask=rmask[:, None] & hmask[None, :])


@triton.jit
def _wgrad_tile(e, ta, tb, flags, target, err, timeout_ns, meta, sorted_tok, a_ptr, NA, b_ptr, b_ld, NB, out, E, spe,
                GATHER_B: tl.constexpr, BM: tl.constexpr, BWA: tl.constexpr, BWB: tl.constexpr, PREC: tl.constexpr,
                USE_ASM: tl.constexpr):
    """out[e][ta tile, tb tile] = sum over expert e's row blocks, IN ORDER, of A[rows, ta]^T @ B[rows, tb] (fp32),
    rounded once; waits flags[block] == target before each block. A: [T*k, NA] rows; B: [T*k, NB] rows, or with
    GATHER_B the token rows of `b_ptr` (row stride b_ld) cast to A's dtype. An expert without rows gets zeros.
    The expert's rows are its spe consecutive segments of meta (E segments), walked in order."""
    ra = ta * BWA + tl.arange(0, BWA)
    rb = tb * BWB + tl.arange(0, BWB)
    amask = ra < NA
    bmask = rb < NB
    acc = tl.zeros((BWA, BWB), dtype=tl.float32)
    status = 0
    for sg in range(e * spe, e * spe + spe):
        start = tl.load(meta + sg, cache_modifier=".cg")
        cnt = tl.load(meta + E + sg, cache_modifier=".cg")
        nblk = (cnt + BM - 1) // BM
        first = tl.load(meta + 2 * E + sg, cache_modifier=".cg") - nblk
        for i in range(0, nblk):
            if status == 0:
                status = wait_flag(flags + first + i, target, err, timeout_ns, "gpu", USE_ASM)
                if status == 0:
                    rows = (start + i * BM + tl.arange(0, BM)).to(tl.int64)
                    rmask = rows < start + cnt
                    a = tl.load(a_ptr + rows[:, None] * NA + ra[None, :], mask=rmask[:, None] & amask[None, :],
                                other=0.0, cache_modifier=".cg")
                    if GATHER_B:
                        tok = tl.load(sorted_tok + rows, mask=rmask, other=0, cache_modifier=".cg").to(tl.int64)
                        b = tl.load(b_ptr + tok[:, None] * b_ld + rb[None, :], mask=rmask[:, None] & bmask[None, :],
                                    other=0.0).to(a_ptr.dtype.element_ty)
                    else:
                        b = tl.load(b_ptr + rows[:, None] * b_ld + rb[None, :], mask=rmask[:, None] & bmask[None, :],
                                    other=0.0, cache_modifier=".cg")
                    acc = tl.dot(tl.trans(a), b, acc, input_precision=PREC)
    if status == 0:
        tl.store(out + e.to(tl.int64) * NA * NB + ra[:, None].to(tl.int64) * NB + rb[None, :],
                 acc.to(out.dtype.element_ty), mask=amask[:, None] & bmask[None, :])
    return status


@triton.jit
def _fold_tile(tile, ids_ptr, rank_ptr, counts, logits, dwp, d_x, glog, rw, rw_ld, dl_ws, d_hidden, dh_ld,
               T, H, E, n_hblk, rsf, eps,
               SIGMOID: tl.constexpr, SD_ROUND: tl.constexpr, NORM: tl.constexpr, SCALED: tl.constexpr,
               HAS_GLOG: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
               BLOCK_E: tl.constexpr, BH: tl.constexpr, ROUTER_PRECISION: tl.constexpr):
    """Router backward of a token tile (route_backward) and the tile's d_hidden."""
    RD: tl.constexpr = logits.dtype.element_ty
    rows, m2, offs, pos = pair_rows(tile, ids_ptr, rank_ptr, counts, T, E, TOP_K, KP, BT)
    rows64 = rows.to(tl.int64)
    pos64 = pos.to(tl.int64)
    rmask = rows < T
    cols_e = tl.arange(0, BLOCK_E)
    emask = cols_e < E
    colk = tl.arange(0, KP)
    kmask_j = colk < TOP_K
    ids = tl.load(ids_ptr + offs, mask=m2, other=0, cache_modifier=".cg")
    # d_topk_weights: the DY tasks' partial sums over the H chunks, in chunk order; .to(logits dtype)
    dw = tl.zeros((BT, KP), dtype=tl.float32)
    for nb in range(0, n_hblk):
        dw += tl.load(dwp + pos64 * n_hblk + nb, mask=m2, other=0.0, cache_modifier=".cg")
    dw = dw.to(RD).to(tl.float32)
    # scores recomputed from the kept logits, as the ROUTE task computed them; route_backward in the scores' dtype
    # (fp32 for softmax, the logits dtype for sigmoid: SD_ROUND)
    em2 = rmask[:, None] & emask[None, :]
    lg = tl.load(logits + rows64[:, None] * E + cols_e[None, :], mask=em2, other=0.0, cache_modifier=".cg")
    scores = scores_of(lg, emask, SIGMOID, RD, SD_ROUND)
    vals = scores_at(scores, ids, colk, cols_e, TOP_K, KP)
    dlog = router_d_logits(scores, vals, ids, dw, colk, cols_e, kmask_j, rsf, eps, NORM, SCALED, SIGMOID, RD,
                           SD_ROUND, TOP_K)
    if HAS_GLOG:
        dlog += tl.load(glog + rows64[:, None] * E + cols_e[None, :], mask=em2, other=0.0).to(tl.float32)
    dl = tl.where(em2, dlog, 0.0).to(RD)
    tl.store(dl_ws + rows64[:, None] * E + cols_e[None, :], dl, mask=em2)
    # d_hidden = sum_j d_x[row(t, j)] (fp32, j order) + (d_logits @ router_weight) rounded to RD
    for h0 in range(0, H, BH):
        hs = h0 + tl.arange(0, BH)
        hmask = hs < H
        m = rmask[:, None] & hmask[None, :]
        acc = tl.zeros((BT, BH), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            pj = pick(pos64, colk, j)
            acc += tl.load(d_x + pj[:, None] * H + hs[None, :], mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        w = tl.load(rw + cols_e.to(tl.int64)[:, None] * rw_ld + hs[None, :], mask=emask[:, None] & hmask[None, :],
                    other=0.0).to(RD)
        r = tl.dot(dl, w, input_precision=ROUTER_PRECISION)
        acc += r.to(RD).to(tl.float32)
        tl.store(d_hidden + rows64[:, None] * dh_ld + hs[None, :], acc.to(d_hidden.dtype.element_ty), mask=m)


@triton.jit
def _wrouter_tile(th, dl_ws, hidden, h_ld, d_rw, d_rb, T, H, E, n_tiles,
                  HAS_RB: tl.constexpr, BT: tl.constexpr, BLOCK_E: tl.constexpr, BHR: tl.constexpr,
                  ROUTER_PRECISION: tl.constexpr):
    """d_router_weight[:, th tile] = sum over token tiles, in order, of d_logits^T @ hidden.to(RD); th == 0 also
    d_router_bias = sum over token tiles, in order, of d_logits (fp32)."""
    RD: tl.constexpr = dl_ws.dtype.element_ty
    cols_e = tl.arange(0, BLOCK_E)
    emask = cols_e < E
    hs = th * BHR + tl.arange(0, BHR)
    hmask = hs < H
    acc = tl.zeros((BLOCK_E, BHR), dtype=tl.float32)
    accb = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for tile in range(0, n_tiles):
        rows = (tile * BT + tl.arange(0, BT)).to(tl.int64)
        rmask = rows < T
        dl = tl.load(dl_ws + rows[:, None] * E + cols_e[None, :], mask=rmask[:, None] & emask[None, :], other=0.0,
                     cache_modifier=".cg")
        x = tl.load(hidden + rows[:, None] * h_ld + hs[None, :], mask=rmask[:, None] & hmask[None, :],
                    other=0.0).to(RD)
        acc = tl.dot(tl.trans(dl), x, acc, input_precision=ROUTER_PRECISION)
        if HAS_RB:
            accb += tl.sum(dl.to(tl.float32), axis=0)
    tl.store(d_rw + cols_e.to(tl.int64)[:, None] * H + hs[None, :], acc.to(RD).to(d_rw.dtype.element_ty),
             mask=emask[:, None] & hmask[None, :])
    if HAS_RB:
        if th == 0:
            tl.store(d_rb + cols_e, accb.to(d_rb.dtype.element_ty), mask=emask)


@triton.jit(do_not_specialize=["T", "n_tiles", "mb", "err_host", "timeout_ns"])
def moe_backward_kernel(ctrl, err_host, timeout_ns,
                        grad_out, g_ld, glog, hidden, h_ld, rw, rw_ld, rb, cb, gu, down,
                        logits, ids_ptr, w_ptr, rank_ptr, counts, meta, tpe, sorted_tok, sorted_w,
                        gu_ws, act, d_y, dwp, d_x, dl_ws,
                        d_hidden, dh_ld, d_rw, d_rb, d_gu, d_down,
                        T, H, I, E, rsf, eps, n_tiles, mb,
                        SIGMOID: tl.constexpr, HAS_CB: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                        SD_ROUND: tl.constexpr, CD_ROUND: tl.constexpr, HAS_RB: tl.constexpr, HAS_GLOG: tl.constexpr,
                        NORM: tl.constexpr, SCALED: tl.constexpr,
                        TOP_K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, BT: tl.constexpr,
                        BKR: tl.constexpr, BM: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr,
                        BN: tl.constexpr, BK2: tl.constexpr, BKH: tl.constexpr, BK3: tl.constexpr,
                        BWA: tl.constexpr, BWB: tl.constexpr, BH: tl.constexpr, BHR: tl.constexpr,
                        SCAN_T: tl.constexpr, PD_F32: tl.constexpr, W_ROUND: tl.constexpr,
                        ROUTER_PRECISION: tl.constexpr, UP_PRECISION: tl.constexpr, DOWN_PRECISION: tl.constexpr,
                        USE_ASM: tl.constexpr):
    err_host = err_host.to(tl.pointer_type(tl.int32))  # host-mapped (pinned) mirror
    err = ctrl + C_ERR
    up_done = ctrl + C_BLOCKS
    dy_done = up_done + mb
    dact_done = dy_done + mb
    n_iblk = tl.cdiv(I, BI)
    n_hblk = tl.cdiv(H, BN)
    n_wd_h = tl.cdiv(H, BWA)
    n_wd_i = tl.cdiv(I, BWB)
    n_wg_r = tl.cdiv(2 * I, BWA)
    n_wg_h = tl.cdiv(H, BWB)
    scan_task = n_tiles
    scatter0 = n_tiles + 1
    up0 = scatter0 + n_tiles
    dy0 = up0 + mb * n_iblk
    dact0 = dy0 + mb * n_hblk
    wd0 = dact0 + mb * n_iblk
    dx0 = wd0 + E * n_wd_h * n_wd_i
    wg0 = dx0 + mb * n_hblk
    fold0 = wg0 + E * n_wg_r * n_wg_h
    wr0 = fold0 + n_tiles
    n_tasks = wr0 + tl.cdiv(H, BHR)
    status = 0
    t = tl.atomic_add(ctrl + C_CLAIM, 1, sem="relaxed", scope="gpu")
    while (t < n_tasks) & (status == 0):
        if t < scan_task:  # ---- ROUTE (the forward's code; logits kept for the router backward)
            route_tile(t, hidden, h_ld, rw, rw_ld, rb, cb, logits, ids_ptr, w_ptr, rank_ptr, counts, T, H, E, rsf,
                       eps, HAS_RB, True, NORM, SCALED, SIGMOID, HAS_CB, N_GROUP, TOPK_GROUP, SD_ROUND, CD_ROUND,
                       TOP_K, KP, BT, BLOCK_E, BKR, ROUTER_PRECISION)
            _signal(ctrl + C_ROUTED, USE_ASM)
        elif t == scan_task:  # ---- SCAN
            status = wait_flag(ctrl + C_ROUTED, n_tiles, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                scan_counts(counts, meta, tpe, n_tiles, E, BM, BLOCK_E, SCAN_T)
                _signal(ctrl + C_SCANNED, USE_ASM)
        elif t < up0:  # ---- SCATTER
            status = wait_flag(ctrl + C_SCANNED, 1, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                _scatter_tile(t - scatter0, ids_ptr, rank_ptr, w_ptr, counts, sorted_tok, sorted_w, T, E,
                              TOP_K, KP, BT)
                _signal(ctrl + C_SCATTERED, USE_ASM)
        elif t < dy0:  # ---- UP
            status = wait_flag(ctrl + C_SCATTERED, n_tiles, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                u = t - up0
                b = u // n_iblk
                _up_tile(b, u - b * n_iblk, meta, sorted_tok, hidden, h_ld, gu, gu_ws, act, H, I, E, 1,
                         BM, BI, BK, BLOCK_E, UP_PRECISION)
                _signal(up_done + b, USE_ASM)
        elif t < dact0:  # ---- DY
            d = t - dy0
            b = d // n_hblk
            status = wait_flag(up_done + b, n_iblk, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                _dy_tile(b, d - b * n_hblk, meta, sorted_tok, sorted_w, act, down, grad_out, g_ld, d_y, dwp,
                         H, I, E, 1, n_hblk, BM, BN, BK2, BLOCK_E, DOWN_PRECISION, PD_F32)
                _signal(dy_done + b, USE_ASM)
        elif t < wd0:  # ---- DACT
            d = t - dact0
            b = d // n_iblk
            status = wait_flag(dy_done + b, n_hblk, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                _dact_tile(b, d - b * n_iblk, meta, sorted_tok, d_y, down, gu_ws, H, I, E, 1, BM, BI, BKH, BLOCK_E,
                           DOWN_PRECISION, W_ROUND)
                _signal(dact_done + b, USE_ASM)
        elif t < dx0:  # ---- WDOWN
            status = wait_flag(ctrl + C_SCANNED, 1, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                d = t - wd0
                per_e = n_wd_h * n_wd_i
                e = d // per_e
                r = d - e * per_e
                th = r // n_wd_i
                status = _wgrad_tile(e, th, r - th * n_wd_i, dy_done, n_hblk, err, timeout_ns, meta, sorted_tok,
                                     d_y, H, act, I, I, d_down, E, 1, False, BM, BWA, BWB, DOWN_PRECISION, USE_ASM)
        elif t < wg0:  # ---- DX
            d = t - dx0
            b = d // n_hblk
            status = wait_flag(dact_done + b, n_iblk, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                _dx_tile(b, d - b * n_hblk, meta, sorted_tok, gu_ws, gu, d_x, H, I, E, 1, BM, BN, BK3, BLOCK_E,
                         UP_PRECISION)
                _signal(ctrl + C_DXED, USE_ASM)
        elif t < fold0:  # ---- WGU
            status = wait_flag(ctrl + C_SCANNED, 1, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                d = t - wg0
                per_e = n_wg_r * n_wg_h
                e = d // per_e
                r = d - e * per_e
                tr = r // n_wg_h
                status = _wgrad_tile(e, tr, r - tr * n_wg_h, dact_done, n_iblk, err, timeout_ns, meta, sorted_tok,
                                     gu_ws, 2 * I, hidden, h_ld, H, d_gu, E, 1, True, BM, BWA, BWB, UP_PRECISION,
                                     USE_ASM)
        elif t < wr0:  # ---- FOLD
            status = wait_flag(ctrl + C_DXED, mb * n_hblk, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                _fold_tile(t - fold0, ids_ptr, rank_ptr, counts, logits, dwp, d_x, glog, rw, rw_ld, dl_ws, d_hidden,
                           dh_ld, T, H, E, n_hblk, rsf, eps, SIGMOID, SD_ROUND, NORM, SCALED, HAS_GLOG, TOP_K, KP,
                           BT, BLOCK_E, BH, ROUTER_PRECISION)
                _signal(ctrl + C_FOLDED, USE_ASM)
        else:  # ---- WROUTER
            status = wait_flag(ctrl + C_FOLDED, n_tiles, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                _wrouter_tile(t - wr0, dl_ws, hidden, h_ld, d_rw, d_rb, T, H, E, n_tiles, HAS_RB, BT, BLOCK_E, BHR,
                              ROUTER_PRECISION)
        if status == ERR_TIMEOUT:
            record_local_error(err, err_host, OP_ID, t)
        if status == 0:
            t = tl.atomic_add(ctrl + C_CLAIM, 1, sem="relaxed", scope="gpu")
    # count out; the last program zeroes every counter for the next launch (graph replays included)
    tl.debug_barrier()
    old = tl.atomic_add(ctrl + C_DONE, 1, sem="acq_rel", scope="gpu")
    if old == tl.num_programs(0) - 1:
        z = tl.arange(0, 8)
        tl.store(ctrl + z, tl.zeros((8,), dtype=tl.int32))
        for b0 in range(0, 3 * mb, 128):
            bs = b0 + tl.arange(0, 128)
            tl.store(ctrl + C_BLOCKS + bs, tl.zeros((128,), dtype=tl.int32), mask=bs < 3 * mb)


# ----------------------------------------------------------------------------------------------------------
# host side


@dataclasses.dataclass(frozen=True)
class MoeBackwardConfig:
    """BT tokens per route / fold tile (BKR router K block, BH fold columns, BHR columns of H per router-weight
    task); BM sorted rows per expert block; BI columns of I per UP / DACT tile (BK: UP's K block over H, BKH:
    DACT's K block over H); BN columns of H per DY / DX tile (BK2: DY's K block over I, BK3: DX's K block over
    2I); BWA x BWB the weight-gradient tiles (d_down [H, I], d_gate_up [2I, H]), K = BM rows per step."""
    bt: int = 64
    bkr: int = 64
    bm: int = 64
    bi: int = 64
    bk: int = 64
    bn: int = 128
    bk2: int = 64
    bkh: int = 64
    bk3: int = 64
    bwa: int = 64
    bwb: int = 64
    bh: int = 128
    bhr: int = 64
    scan_t: int = 32
    num_warps: int = 8
    num_stages: int = 2


CONFIGS = {
    "default": MoeBackwardConfig(),
    "fp32": MoeBackwardConfig(bkr=32, bk=32, bk2=32, bkh=32, bk3=32, bn=64),
    "fp32_ieee": MoeBackwardConfig(bt=32, bkr=16, bm=32, bi=32, bk=16, bn=64, bk2=16, bkh=16, bk3=16, bwa=32,
                                   bwb=32, bh=64, bhr=32, num_warps=4),
    "interpret": MoeBackwardConfig(bt=16, bkr=16, bm=16, bi=16, bk=16, bn=32, bk2=16, bkh=16, bk3=16, bwa=16,
                                   bwb=32, bh=32, bhr=32, scan_t=16, num_warps=4, num_stages=1),
}


def select_config(gate_up_proj: torch.Tensor, num_experts: Optional[int] = None) -> MoeBackwardConfig:
    """num_experts: the router's experts (default gate_up_proj's; more under expert parallelism)."""
    from kosmos.kernels.gemm import input_precision

    if runtime.interpreting():
        return CONFIGS["interpret"]
    if gate_up_proj.dtype == torch.float32:
        cfg = CONFIGS["fp32" if input_precision(torch.float32) == "tf32" else "fp32_ieee"]
    else:
        cfg = CONFIGS["default"]
    if (num_experts or gate_up_proj.shape[0]) > 128 and cfg.bt > 32:
        cfg = dataclasses.replace(cfg, bt=32)
    return cfg


def backward_tiles(cfg: MoeBackwardConfig) -> dict:
    """The tile constexprs of a backward config."""
    return dict(BT=cfg.bt, BKR=cfg.bkr, BM=cfg.bm, BI=cfg.bi, BK=cfg.bk, BN=cfg.bn, BK2=cfg.bk2, BKH=cfg.bkh,
                BK3=cfg.bk3, BWA=cfg.bwa, BWB=cfg.bwb, BH=cfg.bh, BHR=cfg.bhr, SCAN_T=cfg.scan_t)


def task_counts(T: int, H: int, I: int, E: int, top_k: int, cfg: MoeBackwardConfig) -> dict:
    """Tasks of each kind (host mirror of the kernel's layout)."""
    n_tiles = triton.cdiv(T, cfg.bt)
    mb = max_blocks(T * top_k, E, cfg.bm)
    n_iblk, n_hblk = triton.cdiv(I, cfg.bi), triton.cdiv(H, cfg.bn)
    return dict(route=n_tiles, scan=1, scatter=n_tiles, up=mb * n_iblk, dy=mb * n_hblk, dact=mb * n_iblk,
                wdown=E * triton.cdiv(H, cfg.bwa) * triton.cdiv(I, cfg.bwb), dx=mb * n_hblk,
                wgu=E * triton.cdiv(2 * I, cfg.bwa) * triton.cdiv(H, cfg.bwb), fold=n_tiles,
                wrouter=triton.cdiv(H, cfg.bhr))


def control(device: torch.device) -> _Control:
    """The backward's own per-device control tensor (separate from the forward's)."""
    return _moe_control(device, OP_NAME)


def backward_reason(grad_out, grad_router_logits, hidden, router_weight, router_bias, gate_up_proj) -> Optional[str]:
    """What the backward kernel refuses beyond kosmos.kernels.moe_ops.kernel_reason (grad_out / grad_router_logits
    shapes and dtypes), or None."""
    from kosmos.kernels.moe_ops import _backward_reason

    return _backward_reason(grad_out, grad_router_logits, hidden, gate_up_proj.shape[0])


def moe_backward(grad_out: torch.Tensor, grad_router_logits: Optional[torch.Tensor], hidden: torch.Tensor,
                 router_weight: torch.Tensor, router_bias: Optional[torch.Tensor],
                 score_correction_bias: Optional[torch.Tensor], gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                 top_k: int, scoring: str = "softmax", norm_topk_prob: bool = True, n_group: int = 1,
                 topk_group: int = 1, routed_scaling_factor: float = 1.0, router_dtype: Optional[torch.dtype] = None,
                 activation: str = "silu", *, programs: Optional[int] = None,
                 config: Optional[MoeBackwardConfig] = None, return_routing: bool = False):
    """kosmos::moe_layer_backward (ep_group_name None) in one launch -> [d_hidden, d_router_weight, d_gate_up_proj,
    d_down_proj] (+ [d_router_bias] when router_bias is given), dtypes of the corresponding inputs. Raises
    ValueError for what the kernel does not support (moe_ops.why_not_moe_layer_backward says it without raising).
    programs: grid size (default one per SM; 1 in the interpreter). return_routing: returns (grads, (topk_ids [T, k]
    int32, topk_weights [T, k] fp32 of the logits-dtype values)) of the recomputed routing (tests)."""
    from kosmos.kernels.moe_ops import kernel_reason

    reason = kernel_reason(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k,
                           scoring, n_group, topk_group, router_dtype, activation)
    reason = reason or backward_reason(grad_out, grad_router_logits, hidden, router_weight, router_bias, gate_up_proj)
    if reason is not None:
        raise ValueError(f"kosmos moe_backward: {reason}")
    device = hidden.device
    T, H = hidden.shape
    E, two_i, _ = gate_up_proj.shape
    I = two_i // 2
    rd = router_dtype or hidden.dtype
    cfg = config or select_config(gate_up_proj)
    n_tiles = triton.cdiv(T, cfg.bt)
    mb = max_blocks(T * top_k, E, cfg.bm)
    n_tasks = sum(task_counts(T, H, I, E, top_k, cfg).values())
    ctl = control(device)
    ctl.check()
    ctl.ensure(3 * mb)
    pairs = T * top_k
    n_hblk = triton.cdiv(H, cfg.bn)
    if grad_out.stride(1) != 1 and H > 1:
        grad_out = grad_out.contiguous()
    if grad_router_logits is not None:
        grad_router_logits = grad_router_logits.contiguous()
    i32 = dict(dtype=torch.int32, device=device)
    W, D = gate_up_proj.dtype, down_proj.dtype
    logits = torch.empty(T, E, dtype=rd, device=device)
    ids = torch.empty(T, top_k, **i32)
    ranks = torch.empty(T, top_k, **i32)
    wts = torch.empty(T, top_k, dtype=torch.float32, device=device)
    counts = torch.empty(n_tiles, E, **i32)
    meta = torch.empty(3 * E, **i32)
    tpe = torch.empty(E, **i32)
    sorted_tok = torch.empty(pairs, **i32)
    sorted_w = torch.empty(pairs, dtype=torch.float32, device=device)
    gu_ws = torch.empty(pairs, 2 * I, dtype=W, device=device)  # gate | up, then d_gate | d_up in place
    act = torch.empty(pairs, I, dtype=D, device=device)
    d_y = torch.empty(pairs, H, dtype=D, device=device)
    dwp = torch.empty(pairs, n_hblk, dtype=torch.float32, device=device)
    d_x = torch.empty(pairs, H, dtype=W, device=device)
    dl_ws = torch.empty(T, E, dtype=rd, device=device)
    d_hidden = torch.empty(T, H, dtype=hidden.dtype, device=device)
    d_rw = torch.empty(E, H, dtype=router_weight.dtype, device=device)
    d_rb = torch.empty(E, dtype=router_bias.dtype, device=device) if router_bias is not None else None
    d_gu = torch.empty_like(gate_up_proj)
    d_down = torch.empty_like(down_proj)
    interp = runtime.interpreting()
    P = programs or (1 if interp or device.type != "cuda" else runtime.num_sms(device))
    P = max(1, min(P, n_tasks))
    args = (ctl.ctrl, ctl.err_host.data_ptr(), runtime.spin_timeout_ns(),
            grad_out, grad_out.stride(0), grad_router_logits if grad_router_logits is not None else grad_out,
            hidden, hidden.stride(0), router_weight, router_weight.stride(0),
            router_bias if router_bias is not None else router_weight,
            score_correction_bias if score_correction_bias is not None else router_weight, gate_up_proj, down_proj,
            logits, ids, wts, ranks, counts, meta, tpe, sorted_tok, sorted_w, gu_ws, act, d_y, dwp, d_x, dl_ws,
            d_hidden, d_hidden.stride(0), d_rw, d_rb if d_rb is not None else d_rw, d_gu, d_down,
            T, H, I, E, float(routed_scaling_factor), 1e-20, n_tiles, mb)
    meta_kw = dict(**routing_constexprs(scoring, norm_topk_prob, n_group, topk_group, routed_scaling_factor, rd,
                                        router_bias, score_correction_bias, top_k, E, W, D, hidden.dtype),
                   HAS_GLOG=grad_router_logits is not None, W_ROUND=W != torch.float32, **backward_tiles(cfg),
                   USE_ASM=not interp, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    grid = (P,)
    runtime.check_grid_fits(moe_backward_kernel, ("moe_bwd", hidden.dtype, W, D, rd, grad_out.dtype,
                                                  tuple(sorted((k, str(v)) for k, v in meta_kw.items()))),
                            grid, device, args, meta_kw)
    ctl.launch(moe_backward_kernel, grid, args, meta_kw)
    grads = [d_hidden, d_rw, d_gu, d_down] + ([d_rb] if d_rb is not None else [])
    return (grads, (ids, wts)) if return_routing else grads
