"""Fused forward of `kosmos::moe_layer` WITH expert parallelism: router -> top-k -> dispatch -> experts -> combine ->
fold in ONE persistent, self-scheduling launch per rank (`moe_ep_forward`), over a comm-runtime workspace (a real
group's symmetric memory, or SimWorld's W simulated ranks on one GPU: grid = (programs, W), rank = program_id(1)).

Semantics: exactly the reference `route` + `ep_experts` of kosmos.ops.moe. Rank r holds T tokens and the experts
[r * E_loc, (r + 1) * E_loc) of E = W * E_loc; it routes its own tokens over all E experts; the routed (token, slot)
rows go to the experts' owners, the expert outputs come back and are folded at home. tokens_per_expert is global.

Task stream of every rank (one claim counter per rank in its workspace control block; a task's kind follows from
arithmetic on its index; every producer precedes its consumers):

    [ROUTE x nt] [SCAN] [DISPATCH x nt] [OWNER_SCAN] [UP x nb*n_iblk] [DOWN x nb*n_hblk] [FOLD x nt]

nb, the owner's real number of row blocks, is read on the device after OWNER_SCAN (every task past it waits for
OWNER_SCAN anyway), so the claim loop never walks empty blocks: the static bound mbo (every routing of the group's
rows onto this rank) only sizes counters; a program that claims an index past the real end stops.

- ROUTE(tile), SCAN: the non-EP kernel's code (kosmos.kernels.moe_route): this rank's pairs get fixed rows in an
  expert-sorted order (global expert ids ascending, so each owner's pairs are contiguous). SCAN then waits until
  every peer finished the previous call (FINISHED epochs: its buffers are free), and publishes this rank's
  per-expert totals [E] into slot [r] of every rank's workspace; flag counts[r] = epoch there (sys release).
- DISPATCH(tile): pushes each pair's token row (cast to gate_up_proj's dtype) into its owner's receive region of
  this source: owner o, region [r * T*k, (r + 1) * T*k) of o's receive rows, at offset (sorted row - first sorted row
  of o's experts). The region is static: a source sends at most T*k rows to one owner, so every routing fits (all
  tokens on one rank included) with no prefix over sources. The last DISPATCH of this rank (a local counter) raises
  rows[r] = epoch in every owner.
- OWNER_SCAN: waits counts[s] of every source s; lays out this rank's segments g = j * W + i: local expert j, source
  s = (r + i) % W (own rows first within an expert); segment g's rows are region s's rows of expert j (offset: the
  source's counts of experts before j); ceil(count / BM) row blocks per segment, blocks numbered in segment order
  (so an expert's blocks are consecutive: the backward's weight gradients walk them in order). Also: global
  tokens_per_expert (sum of the W slots), each source's first sorted row of this rank's experts (where its results
  go back), and how many DOWN tiles each source is owed; a source owed none gets combine[r] = epoch at once.
- UP(block b, I-chunk): waits rows[s] of the block's source; gate and up GEMMs of the BM received rows against
  gate_up_proj[j] (TMA descriptors over the receive rows and the local experts), SwiGLU with the reference's
  roundings, into act [W*T*k, I] (receive-row order). up_done[b] += 1.
- DOWN(block b, H-chunk): waits up_done[b] == n_iblk; y = act rows @ down_proj[j].T (the GEMM core's gemm_tile),
  cast to down_proj's dtype, pushed into the SOURCE's combine rows [T*k, H] at its sorted rows. The source's DOWN
  counter here (acq_rel, sys) tells the last of its tiles, which raises combine[r] = epoch in the source.
- FOLD(tile): waits combine[o] of every owner o; out[t] = the non-EP fold over the combine rows (j order).
UP and DOWN tasks go block by block, or G blocks at a time chunk by chunk where an expert's weights far exceed the L2
(MoeConfig.group_blocks, the non-EP kernel's rule: moe.group_blocks).

Determinism: positions come from scans of counts, never from atomics; every output element is computed by one task
with a fixed reduction order. Reruns are bit-identical whatever the grid and timing.

Counters: the claim counter, done count and epoch are the workspace control block's (kosmos.kernels.signals);
flags counts / rows / combine [W] each hold epochs (never reset) at fixed words of the workspace flags; the local
counters (routed, scanned, dispatched, owner-scanned, DOWN per source, up_done per block) live in a local int32
tensor per rank (runtime.Workspace.local_counters), zeroed by the rank's last program at the end of the call, so a
captured CUDA graph replays.
Cross-call safety: no rank writes into a peer's workspace before the peer finished the previous call.

Workspace data per rank: counts slots [W, E] int32 | receive rows [W * T*k, H] in gate_up_proj's dtype | combine rows
[T*k, H] in down_proj's dtype: bytes = 4*W*E + (W * T*k * H) * elt(gate_up) + (T*k * H) * elt(down) (each part
rounded up to 512), `ep_workspace_bytes`. The receive region is sized for the worst case (all routed rows of the
group on one rank), as no token is dropped.

Module layout: kernel, then host side (`moe_ep_forward`, driven by SimWorld.moe_layer and, one rank per process on a
real group, by kosmos.kernels.moe_ep_group). No process-group logic.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from kosmos.kernels import runtime
from kosmos.kernels.ag_gemm import ws_ptr
from kosmos.kernels.gemm import gemm_tile
from kosmos.kernels.moe import (MoeConfig, _block_chunk, _block_rows, _fold_tile, _signal, _up_rows, max_blocks,
                                routing_constexprs, select_config, weights_f32, with_grouped_order)
from kosmos.kernels.moe_route import pair_rows, pick, route_tile, scan_counts
from kosmos.kernels.signals import (CTRL_EPOCH, CTRL_ERR, claim, count_out, delay_ns, publish_finished,
                                    record_status, signal_flag, wait_flag, wait_peers_finished)

OP_ID = tl.constexpr(3)  # runtime.OP_IDS["moe_layer"]

# local counters (int32 words of a rank's row of the local counter tensor)
L_ROUTED = tl.constexpr(0)
L_SCANNED = tl.constexpr(1)
L_DISPATCHED = tl.constexpr(2)
L_OWNER_SCANNED = tl.constexpr(3)
L_FOLDED = tl.constexpr(4)  # (backward)
L_SENT = tl.constexpr(8)  # [MAX_WORLD]: tiles pushed back to each source
L_UP = tl.constexpr(8 + runtime.MAX_WORLD)  # [mbo] up_done (backward: | dy_done | dact_done)
L_HEAD = 8 + runtime.MAX_WORLD


@triton.jit
def _wait_all(flags, world, epoch, err, timeout_ns, USE_ASM: tl.constexpr):
    """Waits flags[q] >= epoch for q = 0..world-1 (sys scope); a wait_flag status."""
    status = 0
    for q in range(world):
        if status == 0:
            status = wait_flag(flags + q, epoch, err, timeout_ns, "sys", USE_ASM)
    return status


@triton.jit
def _publish_counts(meta, ws_row, rank, world, E, epoch, data_off, flags_off, skip,
                    BLOCK_E: tl.constexpr, USE_ASM: tl.constexpr):
    """This rank's per-expert totals (scan meta [E:2E]) into slot [rank] of every rank; counts[rank] = epoch there."""
    tl.debug_barrier()  # the scan's stores, by other threads of this program
    cols_e = tl.arange(0, BLOCK_E)
    emask = cols_e < E
    tot = tl.load(meta + E + cols_e, mask=emask, other=0)
    for q in range(world):
        peer = tl.load(ws_row + q)
        slot = ws_ptr(peer, data_off, tl.int32) + rank * E
        tl.store(slot + cols_e, tot, mask=emask)
        if skip == 0:
            signal_flag(peer.to(tl.pointer_type(tl.int32)) + flags_off + rank, epoch, "sys", USE_ASM)


@triton.jit
def _dispatch_tile(tile, hidden, h_ld, ids_ptr, rank_ptr, counts, meta, ws_row, rank, T, H, E, E_loc, src_rows,
                   recv_off, grad_out, g_ld, w_ptr, recv_g_off, recv_w_off,
                   TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                   WD: tl.constexpr, WITH_GRAD: tl.constexpr):
    """Pushes the tile's pair rows (hidden rows cast to WD) into their owners' receive regions of this source; with
    WITH_GRAD (backward) also the grad_out rows (as they are) and the pairs' weights (fp32), at the same rows."""
    GD: tl.constexpr = grad_out.dtype.element_ty
    rows, m2, offs, pos = pair_rows(tile, ids_ptr, rank_ptr, counts, T, E, TOP_K, KP, BT)
    ids = tl.load(ids_ptr + offs, mask=m2, other=0, cache_modifier=".cg")
    colk = tl.arange(0, KP)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    for j in tl.static_range(TOP_K):
        owner = pick(ids, colk, j) // E_loc
        first = tl.load(meta + owner * E_loc, mask=rmask, other=0, cache_modifier=".cg")  # owner's first sorted row
        dst_row = (rank * src_rows + pick(pos, colk, j) - first).to(tl.int64)
        peer = tl.load(ws_row + owner, mask=rmask, other=0)
        dst = (peer + recv_off).to(tl.pointer_type(WD)) + dst_row * H
        for h0 in range(0, H, BH):
            hs = h0 + tl.arange(0, BH)
            m = rmask[:, None] & (hs < H)[None, :]
            x = tl.load(hidden + rows64[:, None] * h_ld + hs[None, :], mask=m, other=0.0)
            tl.store(dst[:, None] + hs[None, :], x.to(WD), mask=m)
        if WITH_GRAD:
            gdst = (peer + recv_g_off).to(tl.pointer_type(GD)) + dst_row * H
            for h0 in range(0, H, BH):
                hs = h0 + tl.arange(0, BH)
                m = rmask[:, None] & (hs < H)[None, :]
                g = tl.load(grad_out + rows64[:, None] * g_ld + hs[None, :], mask=m, other=0.0)
                tl.store(gdst[:, None] + hs[None, :], g, mask=m)
            wj = pick(tl.load(w_ptr + offs, mask=m2, other=0.0, cache_modifier=".cg"), colk, j)
            tl.store((peer + recv_w_off).to(tl.pointer_type(tl.float32)) + dst_row, wj, mask=rmask)


@triton.jit
def _owner_scan(slots, seg, tpe, rank, world, E, E_loc, src_rows, owed_per_block,
                BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """Segments of this owner (module docstring), g = j * W + i -> seg = [row0 | count | block_end] ([E] each), then
    [source base [W] | tiles owed to each source [W]] (owed_per_block per row block); global tokens_per_expert into
    tpe."""
    g = tl.arange(0, BLOCK_E)
    gm = g < E
    j = g // world
    s = (rank + g - j * world) % world
    src_slot = slots + s * E + rank * E_loc
    cnt = tl.load(src_slot + j, mask=gm, other=0, cache_modifier=".cg")
    cstart = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for jj in range(E_loc):
        cstart += tl.load(src_slot + jj, mask=gm & (jj < j), other=0, cache_modifier=".cg")
    nblk = (cnt + BM - 1) // BM
    tl.store(seg + g, s * src_rows + cstart, mask=gm)
    tl.store(seg + E + g, cnt, mask=gm)
    tl.store(seg + 2 * E + g, tl.cumsum(nblk, axis=0), mask=gm)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for q in range(world):
        c = tl.load(slots + q * E + g, mask=gm, other=0, cache_modifier=".cg")
        total += c
        tl.store(seg + 3 * E + q, tl.sum(tl.where(g < rank * E_loc, c, 0), axis=0))
        tl.store(seg + 3 * E + world + q, tl.sum(tl.where(gm & (s == q), nblk, 0), axis=0) * owed_per_block)
    tl.store(tpe + g, total, mask=gm)


@triton.jit
def _segment(g, rank, world):
    """(local expert, source rank) of owner segment g."""
    j = g // world
    return j, (rank + g - j * world) % world


@triton.jit(do_not_specialize=["err_host", "rank_base", "world", "timeout_ns", "straggle_rank", "straggle_ns",
                               "drop_rank", "drop_task", "T", "n_tiles", "mbo", "src_rows"])
def moe_ep_forward_kernel(ws_table, err_host, rank_base, world, lctl, lctl_rs, n_counters, timeout_ns,
                          straggle_rank, straggle_ns, drop_rank, drop_task,
                          hidden, h_rs, h_ld, rw, rw_ld, rb, cb, gu, gu_rs, down, down_rs,
                          logits, lg_rs, ids_ptr, w_ptr, rank_ptr, counts, meta, tpe, act, act_rs, out, out_rs, o_ld,
                          T, H, I, E, E_loc, rsf, eps, n_tiles, mbo, src_rows, flags_off, data_off, recv_off, comb_off,
                          SIGMOID: tl.constexpr, HAS_CB: tl.constexpr, N_GROUP: tl.constexpr,
                          TOPK_GROUP: tl.constexpr, SD_ROUND: tl.constexpr, CD_ROUND: tl.constexpr,
                          HAS_RB: tl.constexpr, RET_LOGITS: tl.constexpr, NORM: tl.constexpr, SCALED: tl.constexpr,
                          TOP_K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, BT: tl.constexpr,
                          BKR: tl.constexpr, BM: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr,
                          BN: tl.constexpr, BK2: tl.constexpr, BH: tl.constexpr, SCAN_T: tl.constexpr,
                          PD_F32: tl.constexpr, ROUTER_PRECISION: tl.constexpr, UP_PRECISION: tl.constexpr,
                          DOWN_PRECISION: tl.constexpr, USE_ASM: tl.constexpr, W_F32: tl.constexpr = False,
                          GROUP_BLOCKS: tl.constexpr = 1):
    WD: tl.constexpr = gu.dtype.element_ty
    DD: tl.constexpr = down.dtype.element_ty
    err_host = err_host.to(tl.pointer_type(tl.int32))
    local = tl.program_id(1)
    rank = rank_base + local
    local64 = local.to(tl.int64)
    ws_row = ws_table + local * world
    my_base = tl.load(ws_row + rank)
    ctrl = my_base.to(tl.pointer_type(tl.int32))
    err = ctrl + CTRL_ERR
    my_flags = ctrl + flags_off
    f_counts = my_flags
    f_rows = my_flags + world
    f_combine = my_flags + 2 * world
    epoch = tl.load(ctrl + CTRL_EPOCH) + 1
    # this rank's tensors
    lc = lctl + local64 * lctl_rs
    pairs = T * TOP_K
    hidden = hidden + local64 * h_rs
    logits = logits + local64 * lg_rs
    ids_ptr = ids_ptr + local64 * pairs
    w_ptr = w_ptr + local64 * pairs
    rank_ptr = rank_ptr + local64 * pairs
    counts = counts + local64 * n_tiles * E
    meta = meta + local64 * (7 * E + 2 * world)  # scan meta [3E] | local totals [E] | segments [3E] | [2W]
    seg = meta + 4 * E
    tpe = tpe + local64 * E
    act = act + local64 * act_rs
    out = out + local64 * out_rs
    gu_base = gu + local64 * gu_rs
    x_desc = tl.make_tensor_descriptor(ws_ptr(my_base, recv_off, WD), shape=[world * src_rows, H],
                                       strides=[H.to(tl.int64), 1], block_shape=[BM, BK])
    gu_desc = tl.make_tensor_descriptor(gu_base, shape=[E_loc * 2 * I, H], strides=[H.to(tl.int64), 1],
                                        block_shape=[BI, BK])
    act_desc = tl.make_tensor_descriptor(act, shape=[world * src_rows, I], strides=[I.to(tl.int64), 1],
                                         block_shape=[BM, BK2])
    down_desc = tl.make_tensor_descriptor(down + local64 * down_rs, shape=[E_loc * H, I], strides=[I.to(tl.int64), 1],
                                          block_shape=[BN, BK2])
    n_iblk = tl.cdiv(I, BI)
    n_hblk = tl.cdiv(H, BN)
    scan_task = n_tiles
    disp0 = n_tiles + 1
    oscan_task = disp0 + n_tiles
    up0 = oscan_task + 1
    n_tasks = up0 + mbo * (n_iblk + n_hblk) + n_tiles  # a bound: the block tasks' layout is known after OWNER_SCAN

    if rank == straggle_rank:
        delay_ns(straggle_ns, USE_ASM)

    status = 0
    t = claim(ctrl)
    while (t < n_tasks) & (status == 0):
        skip = (rank == drop_rank) & (t == drop_task)  # fault injection: this task releases nothing
        if t < scan_task:  # ---- ROUTE
            route_tile(t, hidden, h_ld, rw, rw_ld, rb, cb, logits, ids_ptr, w_ptr, rank_ptr, counts, T, H, E, rsf,
                       eps, HAS_RB, RET_LOGITS, NORM, SCALED, SIGMOID, HAS_CB, N_GROUP, TOPK_GROUP, SD_ROUND,
                       CD_ROUND, TOP_K, KP, BT, BLOCK_E, BKR, ROUTER_PRECISION, W_F32)
            if skip == 0:
                _signal(lc + L_ROUTED, USE_ASM)
        elif t == scan_task:  # ---- SCAN, then publish the counts (peers' buffers free: they finished the last call)
            status = wait_flag(lc + L_ROUTED, n_tiles, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                scan_counts(counts, meta, meta + 3 * E, n_tiles, E, BM, BLOCK_E, SCAN_T)
                status = wait_peers_finished(ctrl, err, world, rank, epoch - 1, timeout_ns, USE_ASM)
            if status == 0:
                _publish_counts(meta, ws_row, rank, world, E, epoch, data_off, flags_off, skip, BLOCK_E, USE_ASM)
                _signal(lc + L_SCANNED, USE_ASM)
        elif t < oscan_task:  # ---- DISPATCH
            status = wait_flag(lc + L_SCANNED, 1, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                _dispatch_tile(t - disp0, hidden, h_ld, ids_ptr, rank_ptr, counts, meta, ws_row, rank, T, H, E, E_loc,
                               src_rows, recv_off, hidden, h_ld, w_ptr, recv_off, recv_off, TOP_K, KP, BT, BH, WD,
                               False)
                tl.debug_barrier()
                if skip == 0:
                    old = tl.atomic_add(lc + L_DISPATCHED, 1, sem="acq_rel", scope="sys")
                    if old == n_tiles - 1:  # the last one: every row of this source is out
                        for q in range(world):
                            peer_flags = tl.load(ws_row + q).to(tl.pointer_type(tl.int32)) + flags_off
                            signal_flag(peer_flags + world + rank, epoch, "sys", USE_ASM)
        elif t == oscan_task:  # ---- OWNER_SCAN
            status = _wait_all(f_counts, world, epoch, err, timeout_ns, USE_ASM)
            if status == 0:
                _owner_scan(ws_ptr(my_base, data_off, tl.int32), seg, tpe, rank, world, E, E_loc, src_rows, n_hblk,
                            BM, BLOCK_E)
                tl.debug_barrier()
                for q in range(world):
                    owed = tl.load(seg + 3 * E + world + q)
                    if (owed == 0) & (skip == 0):
                        peer_flags = tl.load(ws_row + q).to(tl.pointer_type(tl.int32)) + flags_off
                        signal_flag(peer_flags + 2 * world + rank, epoch, "sys", USE_ASM)
                if skip == 0:
                    _signal(lc + L_OWNER_SCANNED, USE_ASM)
        else:  # the owner's block tasks, laid out once OWNER_SCAN knows the real number of row blocks
            status = wait_flag(lc + L_OWNER_SCANNED, 1, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                nblocks = tl.load(seg + 3 * E - 1, cache_modifier=".cg")  # block_end of the last segment
                down0 = up0 + nblocks * n_iblk
                fold0 = down0 + nblocks * n_hblk
                if t < down0:  # ---- UP
                    u = t - up0
                    if GROUP_BLOCKS == 1:
                        b = u // n_iblk
                        ib = u - b * n_iblk
                    else:
                        b, ib = _block_chunk(u, nblocks, n_iblk, GROUP_BLOCKS)
                    valid, g, row0, row_end = _block_rows(b, seg, E, BM, BLOCK_E)
                    j, src = _segment(g, rank, world)
                    status = wait_flag(f_rows + src, epoch, err, timeout_ns, "sys", USE_ASM)
                    if status == 0:
                        # no saved up rows under EP (act stands in for the unused saved_up)
                        _up_rows(row0, row_end, j, ib, x_desc, gu_desc, act, act, H, I, BM, BI, BK,
                                 UP_PRECISION, False)
                        if skip == 0:
                            _signal(lc + L_UP + b, USE_ASM)
                elif t < fold0:  # ---- DOWN, pushed to the source
                    d = t - down0
                    if GROUP_BLOCKS == 1:
                        b = d // n_hblk
                        nb = d - b * n_hblk
                    else:
                        b, nb = _block_chunk(d, nblocks, n_hblk, GROUP_BLOCKS)
                    status = wait_flag(lc + L_UP + b, n_iblk, err, timeout_ns, "gpu", USE_ASM)
                    if status == 0:
                        valid, g, row0, row_end = _block_rows(b, seg, E, BM, BLOCK_E)
                        j, src = _segment(g, rank, world)
                        acc = gemm_tile(act_desc, down_desc, row0, j * H + nb * BN, tl.cdiv(I, BK2), BM, BN, BK2,
                                        False, True, DOWN_PRECISION)
                        rows = row0 + tl.arange(0, BM)
                        cols = nb * BN + tl.arange(0, BN)
                        src_first = tl.load(seg + 3 * E + src, cache_modifier=".cg")
                        dst_rows = (src_first + rows - src * src_rows).to(tl.int64)
                        peer = tl.load(ws_row + src)
                        y = ws_ptr(peer, comb_off, DD)
                        tl.store(y + dst_rows[:, None] * H + cols[None, :], acc.to(DD),
                                 mask=(rows < row_end)[:, None] & (cols < H)[None, :])
                        tl.debug_barrier()
                        if skip == 0:
                            old = tl.atomic_add(lc + L_SENT + src, 1, sem="acq_rel", scope="sys")
                            owed = tl.load(seg + 3 * E + world + src, cache_modifier=".cg")
                            if old + 1 == owed:  # the source's last tile from this rank
                                peer_flags = peer.to(tl.pointer_type(tl.int32)) + flags_off
                                signal_flag(peer_flags + 2 * world + rank, epoch, "sys", USE_ASM)
                elif t < fold0 + n_tiles:  # ---- FOLD
                    status = _wait_all(f_combine, world, epoch, err, timeout_ns, USE_ASM)
                    if status == 0:
                        _fold_tile(t - fold0, 0, H, ids_ptr, rank_ptr, w_ptr, counts,
                                   ws_ptr(my_base, comb_off, DD), out, o_ld, T, H, E, TOP_K, KP, BT, BH, PD_F32)
                else:
                    t = n_tasks  # past this call's real tasks: stop claiming
        if status != 0:
            record_status(status, ctrl, err_host, ws_row, rank_base, world, OP_ID, rank, t)
        if (status == 0) & (t < n_tasks):
            t = claim(ctrl)
    if count_out(ctrl):  # the rank's last program: zero the local counters, then end the call
        for w0 in range(0, n_counters, 128):
            ws_ = w0 + tl.arange(0, 128)
            tl.store(lc + ws_, tl.zeros((128,), dtype=tl.int32), mask=ws_ < n_counters)
        publish_finished(ctrl, ws_row, rank, world, epoch)


# ----------------------------------------------------------------------------------------------------------
# host side


def _round512(n: int) -> int:
    return -(-n // runtime.DATA_ALIGN) * runtime.DATA_ALIGN


@dataclasses.dataclass(frozen=True)
class EpLayout:
    """Byte offsets (from the data start) of a rank's EP workspace parts; `nbytes` is what one rank holds."""
    counts: int
    recv: int
    combine: int
    nbytes: int


def ep_layout(world: int, E: int, T: int, top_k: int, H: int, w_elt: int, d_elt: int) -> EpLayout:
    """counts slots 4*W*E | receive rows W*T*k*H*elt(gate_up) | combine rows T*k*H*elt(down), each rounded to 512."""
    recv = _round512(4 * world * E)
    comb = recv + _round512(world * T * top_k * H * w_elt)
    return EpLayout(0, recv, comb, comb + _round512(T * top_k * H * d_elt))


def ep_workspace_bytes(world: int, E: int, T: int, top_k: int, H: int, w_elt: int, d_elt: int) -> int:
    """Data bytes the EP forward needs in each rank's workspace (the receive rows take the worst case: every routed
    row of the group on one rank)."""
    return ep_layout(world, E, T, top_k, H, w_elt, d_elt).nbytes


def check_ep_args(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k, scoring,
                  n_group, topk_group, world: int, n_local: int) -> None:
    """ValueError unless the per-rank stacks have the EP shapes (hidden [n_local, T, H], gate_up_proj
    [n_local, E_loc, 2I, H], down_proj [n_local, E_loc, H, I]), the router arguments are kosmos::moe_layer's for
    E = E_loc * W experts and E fits the router tile. Every rank holds the same T (the stacks guarantee it; the
    receive regions are sized by it)."""
    from kosmos.kernels.moe_ops import MAX_EXPERTS
    from kosmos.ops.moe import _check_router_args

    if hidden.dim() != 3 or hidden.shape[0] != n_local or gate_up_proj.dim() != 4 or down_proj.dim() != 4:
        raise ValueError(f"kosmos moe_layer (EP): hidden [n_local={n_local}, T, H], gate_up_proj [n_local, E_loc, 2I, "
                         f"H], down_proj [n_local, E_loc, H, I]; got {tuple(hidden.shape)}, "
                         f"{tuple(gate_up_proj.shape)}, {tuple(down_proj.shape)}")
    n, e_loc, two_i, h = gate_up_proj.shape
    if n != n_local or h != hidden.shape[2] or two_i % 2 or tuple(down_proj.shape) != (n_local, e_loc, h, two_i // 2):
        raise ValueError(f"kosmos moe_layer (EP): shapes do not fit: hidden {tuple(hidden.shape)}, gate_up_proj "
                         f"{tuple(gate_up_proj.shape)}, down_proj {tuple(down_proj.shape)}")
    _check_router_args(hidden[0], router_weight, router_bias, score_correction_bias, gate_up_proj[0], top_k, scoring,
                       n_group, topk_group, ep_world_size=world)
    if e_loc * world > MAX_EXPERTS:  # moe_ops.kernel_reason sees one rank's experts only
        raise ValueError(f"kosmos moe_layer (EP): {e_loc * world} experts > {MAX_EXPERTS} (the router tile holds every "
                         "expert's logit in registers)")


def moe_ep_forward(ws: runtime.Workspace, rank_base: int, hidden: torch.Tensor, router_weight: torch.Tensor,
                   router_bias: Optional[torch.Tensor], score_correction_bias: Optional[torch.Tensor],
                   gate_up_proj: torch.Tensor, down_proj: torch.Tensor, top_k: int, scoring: str = "softmax",
                   norm_topk_prob: bool = True, n_group: int = 1, topk_group: int = 1,
                   routed_scaling_factor: float = 1.0, router_dtype: Optional[torch.dtype] = None,
                   activation: str = "silu", return_router_logits: bool = False, *, programs: Optional[int] = None,
                   config: Optional[MoeConfig] = None, straggler=None, drop_signal=None, return_routing: bool = False,
                   weights_dtype: Optional[torch.dtype] = None):
    """EP forward of the ranks of `ws` driven here (n_local of them; their tensors stacked on a leading dim):
    hidden [n_local, T, H], router_weight [E, H] (and the biases) shared, gate_up_proj [n_local, E_loc, 2I, H],
    down_proj [n_local, E_loc, H, I]. Returns (out [n_local, T, H], router_logits [n_local, T or 0, E],
    tokens_per_expert [n_local, E] int32, global) (+ (topk_ids, topk_weights) [n_local, T, k] with return_routing).
    straggler=(rank, ns) delays that rank inside the kernel; drop_signal=(rank, task) makes that task release
    nothing (consumers then time out). weights_dtype: the routing weights' dtype, None (the logits') or float32
    (Mixtral's router, as moe.moe_forward). Raises ValueError for what the kernel does not take."""
    from kosmos.kernels.moe_ops import kernel_reason

    world, n_local = ws.world, ws.n_local
    check_ep_args(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k, scoring,
                  n_group, topk_group, world, n_local)
    if config is not None and (config.fold_groups != 1 or config.router_gemm == 1 or config.joint_gate_up):
        raise ValueError(f"kosmos moe_ep_forward: config fold_groups={config.fold_groups}, router_gemm="
                         f"{config.router_gemm}, joint_gate_up={config.joint_gate_up}: the EP kernel has its own "
                         "task layout (one DOWN / FOLD group, the router GEMM inside the ROUTE tiles, gate and up "
                         "as two dots); it takes fold_groups=1, router_gemm -1 or 0 and joint_gate_up False")
    reason = kernel_reason(hidden[0], router_weight, router_bias, score_correction_bias, gate_up_proj[0], down_proj[0],
                           top_k, scoring, n_group, topk_group, router_dtype, activation)
    if reason is not None:
        raise ValueError(f"kosmos moe_ep_forward: {reason}")
    rd = router_dtype or hidden.dtype
    w_f32 = weights_f32(weights_dtype, rd, "moe_ep_forward")
    ws.check()
    device = hidden.device
    _, T, H = hidden.shape
    E_loc, two_i = gate_up_proj.shape[1], gate_up_proj.shape[2]
    I = two_i // 2
    E = E_loc * world
    cfg = config or select_config(hidden[0], gate_up_proj[0], num_experts=E)
    n_tiles = triton.cdiv(T, cfg.bt)
    pairs = T * top_k
    if config is None:  # the group's pairs over all E experts, as moe.forward_configs
        cfg = with_grouped_order(cfg, world * pairs, E, gate_up_proj[0, 0].nbytes, device)
    src_rows = pairs
    mbo = max_blocks(world * src_rows, E, cfg.bm)
    lay = ep_layout(world, E, T, top_k, H, gate_up_proj.element_size(), down_proj.element_size())
    ws.ensure(3 * world, lay.nbytes)
    ws.describe("moe_layer EP forward", f"counts 4*W*E + receive rows W*T*k*H*{gate_up_proj.element_size()} + "
                f"combine rows T*k*H*{down_proj.element_size()} (W={world} T={T} k={top_k} H={H} E={E}) = "
                f"{lay.nbytes} bytes per rank")
    lctl = ws.local_counters(L_HEAD + mbo)
    i32 = dict(dtype=torch.int32, device=device)
    logits = torch.empty(n_local, T if return_router_logits else 0, E, dtype=rd, device=device)
    logits_arg = logits if return_router_logits else torch.empty(1, dtype=rd, device=device)
    ids = torch.empty(n_local, T, top_k, **i32)
    ranks = torch.empty(n_local, T, top_k, **i32)
    wts = torch.empty(n_local, T, top_k, dtype=torch.float32, device=device)
    counts = torch.empty(n_local, n_tiles, E, **i32)
    meta = torch.empty(n_local, 7 * E + 2 * world, **i32)
    tpe = torch.empty(n_local, E, **i32)
    act = torch.empty(n_local, world * src_rows, I, dtype=down_proj.dtype, device=device)
    out = torch.empty(n_local, T, H, dtype=hidden.dtype, device=device)
    interp = runtime.interpreting()
    if not interp:
        runtime.ensure_allocator()
    n_tasks = 3 * n_tiles + 2 + mbo * (triton.cdiv(I, cfg.bi) + triton.cdiv(H, cfg.bn))
    P = programs or runtime.default_programs(device, n_local)
    P = max(1, min(P, n_tasks))
    s_rank, s_ns = straggler if straggler is not None else (-1, 0)
    d_rank, d_task = drop_signal if drop_signal is not None else (-1, -1)
    data_off = ws.layout.data_off
    args = (ws.table, ws.err_host.data_ptr(), rank_base, world, lctl, lctl.stride(0), L_HEAD + mbo,
            runtime.spin_timeout_ns(),
            s_rank, int(s_ns), d_rank, d_task,
            hidden, hidden.stride(0), hidden.stride(1), router_weight, router_weight.stride(0),
            router_bias if router_bias is not None else router_weight,
            score_correction_bias if score_correction_bias is not None else router_weight,
            gate_up_proj, gate_up_proj.stride(0), down_proj, down_proj.stride(0),
            logits_arg, logits.stride(0) if return_router_logits else 0, ids, wts, ranks, counts, meta, tpe,
            act, act.stride(0), out, out.stride(0), out.stride(1),
            T, H, I, E, E_loc, float(routed_scaling_factor), 1e-20, n_tiles, mbo, src_rows,
            runtime.FLAGS_OFF_WORDS, data_off, data_off + lay.recv, data_off + lay.combine)
    meta_kw = dict(**routing_constexprs(scoring, norm_topk_prob, n_group, topk_group, routed_scaling_factor, rd,
                                        router_bias, score_correction_bias, top_k, E, gate_up_proj.dtype,
                                        down_proj.dtype, hidden.dtype, weights_dtype),
                   RET_LOGITS=bool(return_router_logits), BT=cfg.bt, BKR=cfg.bkr, BM=cfg.bm, BI=cfg.bi, BK=cfg.bk,
                   BN=cfg.bn, BK2=cfg.bk2, BH=cfg.bh, SCAN_T=cfg.scan_t, USE_ASM=not interp,
                   W_F32=w_f32, GROUP_BLOCKS=cfg.group_blocks,
                   num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    grid = (P, n_local)
    runtime.check_grid_fits(moe_ep_forward_kernel, ("moe_ep_fwd", hidden.dtype, gate_up_proj.dtype, rd,
                                                    tuple(sorted((k, str(v)) for k, v in meta_kw.items()))),
                            grid, device, args, meta_kw)
    with ws.lock:
        moe_ep_forward_kernel[grid](*args, **meta_kw, **runtime.COMPILE_OPTIONS)
    ws.after_launch()
    res = (out, logits, tpe)
    if return_routing:
        res = res + (ids, wts)
    return res
