"""Routing pieces of the fused MoE forward (kosmos.kernels.moe): the ROUTE task's router GEMM + softmax + top-k of
one token tile (or, after RGEMM tasks computed a block of tokens x experts of the logits each, its top-k from the
stored logits), the SCAN of the per-tile expert counts into fixed row bases, and the sorted row of each pair. The
scores, the routing weights and the router's logits gradient are helpers of their own, which the fused backward
(kosmos.kernels.moe_backward) and the reference's row kernels (route_select, route_backward) call too.

Positions are deterministic: a ROUTE tile stores its per-expert pair counts (from the selection mask, in registers,
plain stores) and each pair's rank among the tile's pairs of the same expert (token order); the scan turns the
[n_tiles, E] count matrix, in place, into base rows expert_start[e] + pairs of e in earlier tiles; pair (t, j) of
tile i with expert e then has row base[i, e] + rank(t, j), whatever the grid and timing.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pick(mat, colk, j):
    """Column j of a [BT, KP] matrix as a [BT] vector."""
    return tl.sum(tl.where(colk[None, :] == j, mat, tl.zeros_like(mat)), axis=1)


@triton.jit
def _round(x, DT: tl.constexpr, ON: tl.constexpr):
    """x rounded to DT and back to fp32 when ON (a torch op in a narrower dtype), else x."""
    if ON:
        return x.to(DT).to(tl.float32)
    else:
        return x


@triton.jit
def _tf32_round(x):
    """x (fp32) rounded to the nearest TF32 value (ties away from zero, as cvt.rna.tf32.f32): the low 13 mantissa
    bits cleared after adding half of their range to the magnitude."""
    b = x.to(tl.uint32, bitcast=True)
    return ((b + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def scores_of(lg, emask, SIGMOID: tl.constexpr, RD: tl.constexpr, SD_ROUND: tl.constexpr):
    """The router's scores (fp32 [BT, BLOCK_E]) of logits lg (values of RD; the columns past E masked by emask):
    the sigmoid, rounded to RD under SD_ROUND, or the softmax over the E columns in fp32."""
    lf = tl.where(emask[None, :], lg.to(tl.float32), float("-inf"))
    if SIGMOID:
        scores = _round(1.0 / (1.0 + tl.exp(-lf)), RD, SD_ROUND)
    else:
        mx = tl.max(lf, axis=1)
        p = tl.exp(lf - mx[:, None])
        p = tl.where(emask[None, :], p, 0.0)
        scores = p / tl.sum(p, axis=1)[:, None]
    return scores


@triton.jit
def scores_at(scores, ids, colk, cols_e, TOP_K: tl.constexpr, KP: tl.constexpr):
    """scores [BT, BLOCK_E] at each row's top-k ids [BT, KP] -> [BT, KP] (0 past TOP_K)."""
    vals = tl.zeros(ids.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        idj = pick(ids, colk, j)
        vj = tl.sum(tl.where(cols_e[None, :] == idj[:, None], scores, 0.0), axis=1)
        vals = tl.where(colk[None, :] == j, vj[:, None], vals)
    return vals


@triton.jit
def _norm_denominator(vals, kmask_j, eps, SIGMOID: tl.constexpr, RD: tl.constexpr, SD_ROUND: tl.constexpr):
    """The renormalisation's denominator [BT] of the chosen experts' scores vals: their sum over the TOP_K columns
    (kmask_j), + eps for sigmoid scoring, each op rounded to RD under SD_ROUND."""
    denom = _round(tl.sum(tl.where(kmask_j[None, :], vals, 0.0), axis=1), RD, SD_ROUND)
    if SIGMOID:
        denom = _round(denom + eps, RD, SD_ROUND)
    return denom


@triton.jit
def routing_weights(vals, kmask_j, rsf, eps, NORM: tl.constexpr, SCALED: tl.constexpr, SIGMOID: tl.constexpr,
                    RD: tl.constexpr, SD_ROUND: tl.constexpr):
    """The routing weights (fp32 [BT, KP]) of the chosen experts' scores vals: renormalised over the TOP_K columns
    (kmask_j; + eps for sigmoid scoring) under NORM, then times rsf under SCALED, each op rounded to RD under
    SD_ROUND (the reference's scores dtype)."""
    wts = vals
    if NORM:
        wts = _round(wts / _norm_denominator(vals, kmask_j, eps, SIGMOID, RD, SD_ROUND)[:, None], RD, SD_ROUND)
    if SCALED:
        wts = _round(wts * rsf, RD, SD_ROUND)
    return wts


@triton.jit
def router_d_logits(scores, vals, ids, dw, colk, cols_e, kmask_j, rsf, eps, NORM: tl.constexpr, SCALED: tl.constexpr,
                    SIGMOID: tl.constexpr, RD: tl.constexpr, SD_ROUND: tl.constexpr, TOP_K: tl.constexpr):
    """route_backward's logits gradient (fp32 [BT, BLOCK_E], before any grad_router_logits is added) from the
    scores, the chosen experts' scores vals and ids [BT, KP], and the weights' gradient dw [BT, KP] (fp32 of the
    values the reference's scores dtype holds), every op in the scores' dtype (rounded to RD under SD_ROUND)."""
    d = dw
    if SCALED:
        d = _round(d * rsf, RD, SD_ROUND)
    if NORM:
        denom = _norm_denominator(vals, kmask_j, eps, SIGMOID, RD, SD_ROUND)
        normed = _round(vals / denom[:, None], RD, SD_ROUND)
        s = _round(tl.sum(tl.where(kmask_j[None, :], _round(d * normed, RD, SD_ROUND), 0.0), axis=1), RD, SD_ROUND)
        d = _round(_round(d - s[:, None], RD, SD_ROUND) / denom[:, None], RD, SD_ROUND)
    d_scores = tl.zeros(scores.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        idj = pick(ids, colk, j)
        dj = pick(d, colk, j)
        d_scores = tl.where(cols_e[None, :] == idj[:, None], dj[:, None], d_scores)
    if SIGMOID:
        dlog = _round(_round(d_scores * scores, RD, SD_ROUND) * _round(1.0 - scores, RD, SD_ROUND), RD, SD_ROUND)
    else:
        dlog = scores * (d_scores - tl.sum(d_scores * scores, axis=1)[:, None])
    return dlog


@triton.jit
def _finish_logits(acc, cols_e, rb, E, RD: tl.constexpr, HAS_RB: tl.constexpr):
    """Router GEMM sums (fp32) -> logits: + router_bias (rounded to RD), rounded to RD."""
    if HAS_RB:
        acc += tl.load(rb + cols_e, mask=cols_e < E, other=0.0).to(RD).to(tl.float32)[None, :]
    return acc.to(RD)


@triton.jit
def _store_logits(lg, rows, cols_e, logits, T, E):
    """The logits of `rows` x `cols_e` into logits [T, E] (rows past T and experts past E left out)."""
    tl.store(logits + rows.to(tl.int64)[:, None] * E + cols_e[None, :], lg,
             mask=(rows < T)[:, None] & (cols_e < E)[None, :])


@triton.jit
def _rgemm_origin(idx, E, RBM: tl.constexpr, RBN: tl.constexpr):
    """(first token row, first expert) of RGEMM task idx: experts' blocks innermost."""
    n_rn = tl.cdiv(E, RBN)
    rm = idx // n_rn
    return rm * RBM, (idx - rm * n_rn) * RBN


@triton.jit
def router_block(rows, cols_e, hidden, h_ld, rw, rw_ld, rb, T, H, E, RD: tl.constexpr, HAS_RB: tl.constexpr,
                 BT: tl.constexpr, BE: tl.constexpr, BKR: tl.constexpr, ROUTER_PRECISION: tl.constexpr):
    """Router logits of the token rows `rows` [BT] and experts `cols_e` [BE] as fp32 values of dtype RD (x @ W^T +
    bias, rounded to RD; rows past T and experts past E read zeros).

    "tf32x3" on 16-bit hidden states (moe_ops.router_precision): the hidden value is exact in TF32, so of the three
    products of the 3xTF32 split only two are not zero: x @ hi(W) + x @ lo(W), with hi = W rounded to TF32 and lo =
    the rest rounded to TF32 (|W - hi - lo| <= 2**-22 |W|): two tensor-core dots instead of tl.dot's three.

    "bf16x3" (bf16 hidden states, an fp32 router): rw is the weight pre-split into three bf16 parts [3, E, H]
    (moe.split_router_weight: |W - p0 - p1 - p2| <= 2**-24 |W|, as fine as fp32's own rounding); the bf16 hidden
    value times a bf16 part is exact in fp32, so x @ W^T is three bf16 dots, again summed per K block and added to
    the fp32 accumulator: no TF32 conversion or split in the loop."""
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    emask = cols_e < E
    SPLIT_W: tl.constexpr = ROUTER_PRECISION == "tf32x3"
    PARTS3: tl.constexpr = ROUTER_PRECISION == "bf16x3"
    X16: tl.constexpr = hidden.dtype.element_ty != tl.float32
    part_ld = rw_ld * E  # elements between the parts of a pre-split weight (PARTS3; E * H < 2**31, host-checked)
    acc = tl.zeros((BT, BE), dtype=tl.float32)
    for k0 in range(0, H, BKR):
        ks = k0 + tl.arange(0, BKR)
        kmask = ks < H
        x = tl.load(hidden + rows64[:, None] * h_ld + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w_offs = cols_e.to(tl.int64)[:, None] * rw_ld + ks[None, :]
        wmask = emask[:, None] & kmask[None, :]
        w = tl.load(rw + w_offs, mask=wmask, other=0.0)
        if PARTS3:
            w1 = tl.load(rw + part_ld + w_offs, mask=wmask, other=0.0)
            w2 = tl.load(rw + 2 * part_ld + w_offs, mask=wmask, other=0.0)
            part = tl.dot(x, tl.trans(w2))
            part = tl.dot(x, tl.trans(w1), part)
            acc += tl.dot(x, tl.trans(w), part)
        elif SPLIT_W and X16:
            w32 = w.to(tl.float32)
            w_hi = _tf32_round(w32)
            w_lo = _tf32_round(w32 - w_hi)
            # each K block's two products are summed on the tensor cores and added to acc in fp32, as tl.dot's
            # tf32x3 does: one tensor-core accumulator carried over all of H drifted to 85x cuBLAS fp32's error vs
            # fp64 (H200, DeepSeek-V3's router)
            x32 = x.to(tl.float32)
            part = tl.dot(x32, tl.trans(w_lo), input_precision="tf32")
            acc += tl.dot(x32, tl.trans(w_hi), part, input_precision="tf32")
        else:
            acc = tl.dot(x.to(RD), tl.trans(w.to(RD)), acc, input_precision=ROUTER_PRECISION)
    return _finish_logits(acc, cols_e, rb, E, RD, HAS_RB)


@triton.jit
def router_logits(tile, hidden, h_ld, rw, rw_ld, rb, T, H, E, RD: tl.constexpr, HAS_RB: tl.constexpr,
                  BT: tl.constexpr, BLOCK_E: tl.constexpr, BKR: tl.constexpr, ROUTER_PRECISION: tl.constexpr):
    """Router logits of token tile `tile`, all experts: router_block's [BT, BLOCK_E]."""
    return router_block(tile * BT + tl.arange(0, BT), tl.arange(0, BLOCK_E), hidden, h_ld, rw, rw_ld, rb, T, H, E,
                        RD, HAS_RB, BT, BLOCK_E, BKR, ROUTER_PRECISION)


@triton.jit
def router_gemm_tile(idx, hidden, h_ld, rw, rw_ld, rb, logits, T, H, E, HAS_RB: tl.constexpr, RBM: tl.constexpr,
                     RBN: tl.constexpr, BKG: tl.constexpr, ROUTER_PRECISION: tl.constexpr):
    """RGEMM task `idx`: the router logits of RBM tokens x RBN experts into logits [T, E] (experts' blocks
    innermost: the blocks of one token block run side by side and share its hidden rows in L2). A 32-token ROUTE
    tile reads the whole router weight (7.3 MB at DeepSeek-V3's [256, 7168] fp32) for 32 tokens; a 128-token
    block reads its experts' part once per 128."""
    row0, col0 = _rgemm_origin(idx, E, RBM, RBN)
    rows = row0 + tl.arange(0, RBM)
    cols_e = col0 + tl.arange(0, RBN)
    lg = router_block(rows, cols_e, hidden, h_ld, rw, rw_ld, rb, T, H, E, logits.dtype.element_ty, HAS_RB, RBM, RBN,
                      BKG, ROUTER_PRECISION)
    _store_logits(lg, rows, cols_e, logits, T, E)


@triton.jit
def router_gemm_tile_tma(idx, xr_desc, wr_desc, rb, logits, T, H, E, HAS_RB: tl.constexpr, RBM: tl.constexpr,
                         RBN: tl.constexpr, BKG: tl.constexpr):
    """router_gemm_tile for the "bf16x3" router through TMA: xr_desc over hidden [T, H] (block [RBM, BKG]), wr_desc
    over the three bf16 parts [3E, H] (block [RBN, BKG]; a block past E reads the next part's rows or zeros, into
    columns that are never stored). The K loop pipelines like the expert tiles'."""
    row0, col0 = _rgemm_origin(idx, E, RBM, RBN)
    acc = tl.zeros((RBM, RBN), dtype=tl.float32)
    for k0 in range(0, H, BKG):
        x = xr_desc.load([row0, k0])
        w0 = wr_desc.load([col0, k0])
        w1 = wr_desc.load([E + col0, k0])
        w2 = wr_desc.load([2 * E + col0, k0])
        part = tl.dot(x, w2.T)  # each K block's parts summed on the tensor cores, then added in fp32 (router_block)
        part = tl.dot(x, w1.T, part)
        acc += tl.dot(x, w0.T, part)
    cols_e = col0 + tl.arange(0, RBN)
    lg = _finish_logits(acc, cols_e, rb, E, logits.dtype.element_ty, HAS_RB)
    _store_logits(lg, row0 + tl.arange(0, RBM), cols_e, logits, T, E)


@triton.jit
def select_stored_tile(tile, cb, logits, ids_ptr, w_ptr, rank_ptr, counts, T, E, rsf, eps,
                       NORM: tl.constexpr, SCALED: tl.constexpr, SIGMOID: tl.constexpr, HAS_CB: tl.constexpr,
                       N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, SD_ROUND: tl.constexpr,
                       CD_ROUND: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
                       BLOCK_E: tl.constexpr, W_F32: tl.constexpr = False):
    """ROUTE task of token tile `tile` when RGEMM tasks computed the logits: select_tile on the stored logits."""
    RD: tl.constexpr = logits.dtype.element_ty
    rows = tile * BT + tl.arange(0, BT)
    cols_e = tl.arange(0, BLOCK_E)
    lg = tl.load(logits + rows.to(tl.int64)[:, None] * E + cols_e[None, :],
                 mask=(rows < T)[:, None] & (cols_e < E)[None, :], other=0.0, cache_modifier=".cg")
    select_tile(tile, lg, cb, ids_ptr, w_ptr, rank_ptr, counts, T, E, rsf, eps, NORM, SCALED, SIGMOID, HAS_CB, N_GROUP,
                TOPK_GROUP, SD_ROUND, CD_ROUND, TOP_K, KP, BT, BLOCK_E, RD, W_F32)


@triton.jit
def route_tile(tile, hidden, h_ld, rw, rw_ld, rb, cb, logits, ids_ptr, w_ptr, rank_ptr, counts, T, H, E, rsf, eps,
               HAS_RB: tl.constexpr, RET_LOGITS: tl.constexpr, NORM: tl.constexpr, SCALED: tl.constexpr,
               SIGMOID: tl.constexpr, HAS_CB: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
               SD_ROUND: tl.constexpr, CD_ROUND: tl.constexpr,
               TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BLOCK_E: tl.constexpr,
               BKR: tl.constexpr, ROUTER_PRECISION: tl.constexpr, W_F32: tl.constexpr = False):
    """ROUTE task of token tile `tile`: router logits (stored with RET_LOGITS), then the selection (select_tile).

    (DeepSeek-V3's fp32 router runs in RGEMM tasks instead, router_gemm_tile_tma: 1.1 ms faster per call on the
    H200, RESULTS.md sixteenth session. The ninth session's try, one router GEMM for 4 tiles inside a ROUTE task,
    spilled in its K loop and was not faster.)"""
    RD: tl.constexpr = logits.dtype.element_ty
    lg = router_logits(tile, hidden, h_ld, rw, rw_ld, rb, T, H, E, RD, HAS_RB, BT, BLOCK_E, BKR, ROUTER_PRECISION)
    if RET_LOGITS:
        _store_logits(lg, tile * BT + tl.arange(0, BT), tl.arange(0, BLOCK_E), logits, T, E)
    select_tile(tile, lg, cb, ids_ptr, w_ptr, rank_ptr, counts, T, E, rsf, eps, NORM, SCALED, SIGMOID, HAS_CB, N_GROUP,
                TOPK_GROUP, SD_ROUND, CD_ROUND, TOP_K, KP, BT, BLOCK_E, RD, W_F32)


@triton.jit
def select_tile(tile, lg, cb, ids_ptr, w_ptr, rank_ptr, counts, T, E, rsf, eps,
                NORM: tl.constexpr, SCALED: tl.constexpr, SIGMOID: tl.constexpr, HAS_CB: tl.constexpr,
                N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, SD_ROUND: tl.constexpr, CD_ROUND: tl.constexpr,
                TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BLOCK_E: tl.constexpr, RD: tl.constexpr,
                W_F32: tl.constexpr = False):
    """Scores, top-k, weights and per-expert ranks of token tile `tile` from its logits lg [BT, BLOCK_E] (values of
    RD). SD_ROUND: the scores' dtype is the logits dtype RD (sigmoid of non-fp32 logits), so every op on them rounds
    to RD; CD_ROUND: the same for the selection values scores + score_correction_bias. The weights are rounded to RD
    unless W_F32 (Mixtral's router keeps its fp32 softmax values as the weights)."""
    rows = tile * BT + tl.arange(0, BT)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    cols_e = tl.arange(0, BLOCK_E)
    emask = cols_e < E
    colk = tl.arange(0, KP)
    scores = scores_of(lg, emask, SIGMOID, RD, SD_ROUND)
    # selection values (the plain softmax router selects on the scores themselves)
    choice = scores
    if HAS_CB:
        choice = _round(scores + tl.load(cb + cols_e, mask=emask, other=0.0).to(tl.float32)[None, :], RD, CD_ROUND)
    choice = tl.where(emask[None, :], choice, float("-inf"))
    if N_GROUP > 1:  # keep the TOPK_GROUP groups with the largest sum of their 2 best choice values
        gsize = E // N_GROUP
        grp = cols_e // gsize
        colg = tl.arange(0, N_GROUP)
        gsc = tl.zeros((BT, N_GROUP), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            cg = tl.where((grp == g)[None, :], choice, float("-inf"))
            m1 = tl.max(cg, axis=1)
            i1 = tl.min(tl.where(cg == m1[:, None], cols_e[None, :], BLOCK_E), axis=1)
            m2 = tl.max(tl.where(cols_e[None, :] == i1[:, None], float("-inf"), cg), axis=1)
            gsc = tl.where(colg[None, :] == g, _round(m1 + m2, RD, CD_ROUND)[:, None], gsc)
        keep_g = tl.zeros((BT, N_GROUP), dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            gm = tl.max(gsc, axis=1)
            gi = tl.min(tl.where(gsc == gm[:, None], colg[None, :], N_GROUP), axis=1)
            keep_g = tl.where(colg[None, :] == gi[:, None], 1, keep_g)
            gsc = tl.where(colg[None, :] == gi[:, None], float("-inf"), gsc)
        keep = tl.zeros((BT, BLOCK_E), dtype=tl.int32)
        for g in tl.static_range(N_GROUP):
            kg = tl.sum(tl.where(colg[None, :] == g, keep_g, 0), axis=1)
            keep = tl.where((grp == g)[None, :], kg[:, None] + tl.zeros((BT, BLOCK_E), dtype=tl.int32), keep)
        choice = tl.where(keep != 0, choice, float("-inf"))
    # top-k by repeated max: descending values (torch.topk's sorted order), lowest id first on ties; taken
    # experts leave the race through `taken` (the values may be -inf already)
    work = choice
    taken = tl.zeros((BT, BLOCK_E), dtype=tl.int32)
    sel = tl.zeros((BT, BLOCK_E), dtype=tl.int32)
    ids = tl.zeros((BT, KP), dtype=tl.int32)
    vals = tl.zeros((BT, KP), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        free = (taken == 0) & emask[None, :]
        mv = tl.max(tl.where(free, work, float("-inf")), axis=1)
        idx = tl.min(tl.where(free & (work == mv[:, None]), cols_e[None, :], BLOCK_E), axis=1)
        idx = tl.where(idx == BLOCK_E, tl.min(tl.where(free, cols_e[None, :], BLOCK_E), axis=1), idx)
        hit = cols_e[None, :] == idx[:, None]
        sel = tl.where(hit, 1, sel)
        taken = tl.where(hit, 1, taken)
        ids = tl.where(colk[None, :] == j, idx[:, None], ids)
        vj = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # the score (not the choice value) of the expert
        vals = tl.where(colk[None, :] == j, vj[:, None], vals)
    sel = tl.where(rmask[:, None], sel, 0)
    tl.store(counts + tile * E + cols_e, tl.sum(sel, axis=0), mask=emask)
    before = tl.cumsum(sel, axis=0) - sel  # pairs of each expert in earlier tokens of this tile
    ranks = tl.zeros((BT, KP), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        idj = pick(ids, colk, j)
        rj = tl.sum(tl.where(cols_e[None, :] == idj[:, None], before, 0), axis=1)
        ranks = tl.where(colk[None, :] == j, rj[:, None], ranks)
    kmask_j = colk < TOP_K
    wts = routing_weights(vals, kmask_j, rsf, eps, NORM, SCALED, SIGMOID, RD, SD_ROUND)
    if not W_F32:
        wts = wts.to(RD).to(tl.float32)
    offs = rows64[:, None] * TOP_K + colk[None, :]
    m2 = rmask[:, None] & kmask_j[None, :]
    tl.store(ids_ptr + offs, ids, mask=m2)
    tl.store(w_ptr + offs, wts, mask=m2)
    tl.store(rank_ptr + offs, ranks, mask=m2)


@triton.jit
def scan_counts(counts, meta, tpe, n_tiles, E, BM: tl.constexpr, BLOCK_E: tl.constexpr, SCAN_T: tl.constexpr):
    """counts [n_tiles, E] -> base rows in place; meta = [expert_start | totals | block_end] ([E] each)."""
    cols_e = tl.arange(0, BLOCK_E)
    emask = cols_e < E
    trow = tl.arange(0, SCAN_T)
    totals = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for t0 in range(0, n_tiles, SCAN_T):
        r = t0 + trow
        m = (r < n_tiles)[:, None] & emask[None, :]
        c = tl.load(counts + r[:, None] * E + cols_e[None, :], mask=m, other=0, cache_modifier=".cg")
        totals += tl.sum(c, axis=0)
    start = tl.cumsum(totals, axis=0) - totals
    nblk = (totals + BM - 1) // BM
    block_end = tl.cumsum(nblk, axis=0)
    tl.store(meta + cols_e, start, mask=emask)
    tl.store(meta + E + cols_e, totals, mask=emask)
    tl.store(meta + 2 * E + cols_e, block_end, mask=emask)
    tl.store(tpe + cols_e, totals, mask=emask)
    running = start
    for t0 in range(0, n_tiles, SCAN_T):
        r = t0 + trow
        m = (r < n_tiles)[:, None] & emask[None, :]
        c = tl.load(counts + r[:, None] * E + cols_e[None, :], mask=m, other=0, cache_modifier=".cg")
        base = running[None, :] + tl.cumsum(c, axis=0) - c
        tl.store(counts + r[:, None] * E + cols_e[None, :], base, mask=m)
        running += tl.sum(c, axis=0)


@triton.jit
def pair_rows(tile, ids_ptr, rank_ptr, base, T, E, TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr):
    """(token rows [BT], mask [BT, KP], sorted row of each pair [BT, KP]) of a token tile (after the scan)."""
    rows = tile * BT + tl.arange(0, BT)
    colk = tl.arange(0, KP)
    m2 = (rows < T)[:, None] & (colk < TOP_K)[None, :]
    offs = rows.to(tl.int64)[:, None] * TOP_K + colk[None, :]
    ids = tl.load(ids_ptr + offs, mask=m2, other=0, cache_modifier=".cg")
    rk = tl.load(rank_ptr + offs, mask=m2, other=0, cache_modifier=".cg")
    pos = tl.load(base + tile * E + ids, mask=m2, other=0, cache_modifier=".cg") + rk
    return rows, m2, offs, pos
