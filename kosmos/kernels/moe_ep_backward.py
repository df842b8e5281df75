"""Fused backward of `kosmos::moe_layer` WITH expert parallelism in ONE persistent, self-scheduling launch per rank
(`moe_ep_backward`): exactly the reference `moe_layer_backward` with an EP group (kosmos.ops.moe: `_route_forward`
recomputed, `ep_experts_backward`, `route_backward`), over the same workspace and protocol as the EP forward
(kosmos.kernels.moe_ep: counts published, rows dispatched into static per-source receive regions, segments j * W + i
of the owner, results pushed back to the source's sorted rows, epoch flags counts / rows / combine).

Task stream of every rank (nb = the owner's real number of row blocks, read after OWNER_SCAN):

    [ROUTE x nt] [SCAN] [DISPATCH x nt] [OWNER_SCAN] [UP x nb*n_iblk] [DY x nb*n_hblk] [DACT x nb*n_iblk]
    [WDOWN x E_loc*n_wd] [DX x nb*n_hblk] [WGU x E_loc*n_wg] [FOLD x nt] [WROUTER x n_rh]

- ROUTE / SCAN: the forward's (logits kept for the router backward), counts published to every rank.
- DISPATCH(tile): each pair's token row (cast to gate_up_proj's dtype), its grad_out row and its weight (fp32) go to
  the owner's receive region of this source (rows / grads / weights at the same receive row).
- OWNER_SCAN: segments as the forward; each source is owed 2 * n_hblk tiles per row block (DY's d_w partials and
  DX's d_x rows).
- UP, DY, DACT, WDOWN, DX, WGU: the non-EP backward's tile code (kosmos.kernels.moe_backward) on the receive rows:
  the received rows are the "tokens" (an identity row map), the segments are the expert row lists (W consecutive
  segments per local expert: weight gradients walk them in order, so they are deterministic). DY's per-row d_w
  partials over its H chunk and DX's d_x rows are stored straight into the SOURCE's combine buffers at its sorted
  rows (a segment's rows are contiguous on both sides: one pointer shift per block); after each, the source's
  counter here (acq_rel, sys) tells the last tile, which raises combine[r] = epoch in the source.
- FOLD(tile) at home: waits combine[o] of every owner; the non-EP router backward + d_hidden fold over the combine
  buffers. WROUTER: the router weight (and bias) gradients of this rank's tokens, as the non-EP kernel.

Outputs per rank: d_hidden of its tokens, d_router_weight / d_router_bias of its tokens (summing them over the group
is the caller's job, as in the reference), d_gate_up_proj / d_down_proj of its local experts (rows of all sources).

Host side: `moe_ep_backward`, driven by SimWorld.moe_layer_backward and, one rank per process on a real group, by
kosmos.kernels.moe_ep_group. No process-group logic.

Workspace data per rank (`ep_backward_layout`): counts slots [W, E] int32 | receive rows [W*T*k, H] (gate_up dtype) |
receive grads [W*T*k, H] (grad_out dtype) | receive weights [W*T*k] fp32 | combine d_x [T*k, H] (gate_up dtype) |
combine d_w partials [T*k, n_hblk] fp32, each rounded up to 512 bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from kosmos.kernels import runtime
from kosmos.kernels.ag_gemm import ws_ptr
from kosmos.kernels.moe import _block_rows, _signal, max_blocks, routing_constexprs
from kosmos.kernels.moe_backward import (MoeBackwardConfig, _dact_tile, _dx_tile, _dy_tile, _fold_tile, _up_tile,
                                         _wgrad_tile, _wrouter_tile, backward_tiles, select_config)
from kosmos.kernels.moe_ep import (L_DISPATCHED, L_FOLDED, L_HEAD, L_OWNER_SCANNED, L_ROUTED, L_SCANNED, L_SENT,
                                   L_UP, _dispatch_tile, _owner_scan, _publish_counts,
                                   _round512, _segment, _wait_all)
from kosmos.kernels.moe_route import route_tile, scan_counts
from kosmos.kernels.signals import (CTRL_EPOCH, CTRL_ERR, claim, count_out, delay_ns, publish_finished,
                                    record_status, signal_flag, wait_flag, wait_peers_finished)


OP_ID = tl.constexpr(4)  # runtime.OP_IDS["moe_layer_backward"]


@triton.jit
def _sent_one(lc, src, seg, E, world, peer, flags_off, rank, epoch, USE_ASM: tl.constexpr):
    """One more tile pushed back to source `src`; the last one it is owed raises combine[rank] = epoch there."""
    tl.debug_barrier()
    old = tl.atomic_add(lc + L_SENT + src, 1, sem="acq_rel", scope="sys")
    owed = tl.load(seg + 3 * E + world + src, cache_modifier=".cg")
    if old + 1 == owed:
        signal_flag(peer.to(tl.pointer_type(tl.int32)) + flags_off + 2 * world + rank, epoch, "sys", USE_ASM)


@triton.jit(do_not_specialize=["err_host", "rank_base", "world", "timeout_ns", "straggle_rank", "straggle_ns",
                               "drop_rank", "drop_task", "T", "n_tiles", "mbo", "src_rows", "n_counters"])
def moe_ep_backward_kernel(ws_table, err_host, rank_base, world, lctl, lctl_rs, n_counters, timeout_ns,
                           straggle_rank, straggle_ns, drop_rank, drop_task,
                           grad_out, go_rs, g_ld, glog, glog_rs, hidden, h_rs, h_ld, rw, rw_ld, rb, cb,
                           gu, gu_rs, down, down_rs,
                           logits, ids_ptr, w_ptr, rank_ptr, counts, meta, tpe, ident, gu_ws, act, d_y, dl_ws,
                           d_hidden, dh_rs, dh_ld, d_rw, d_rb, d_gu, d_down,
                           T, H, I, E, E_loc, rsf, eps, n_tiles, mbo, src_rows, flags_off, data_off,
                           recv_off, recv_g_off, recv_w_off, comb_x_off, comb_dw_off,
                           SIGMOID: tl.constexpr, HAS_CB: tl.constexpr, N_GROUP: tl.constexpr,
                           TOPK_GROUP: tl.constexpr, SD_ROUND: tl.constexpr, CD_ROUND: tl.constexpr,
                           HAS_RB: tl.constexpr, HAS_GLOG: tl.constexpr, NORM: tl.constexpr, SCALED: tl.constexpr,
                           TOP_K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, BT: tl.constexpr,
                           BKR: tl.constexpr, BM: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr,
                           BN: tl.constexpr, BK2: tl.constexpr, BKH: tl.constexpr, BK3: tl.constexpr,
                           BWA: tl.constexpr, BWB: tl.constexpr, BH: tl.constexpr, BHR: tl.constexpr,
                           SCAN_T: tl.constexpr, PD_F32: tl.constexpr, W_ROUND: tl.constexpr,
                           ROUTER_PRECISION: tl.constexpr, UP_PRECISION: tl.constexpr, DOWN_PRECISION: tl.constexpr,
                           USE_ASM: tl.constexpr):
    WD: tl.constexpr = gu.dtype.element_ty
    GD: tl.constexpr = grad_out.dtype.element_ty
    err_host = err_host.to(tl.pointer_type(tl.int32))
    local = tl.program_id(1)
    rank = rank_base + local
    l64 = local.to(tl.int64)
    ws_row = ws_table + local * world
    my_base = tl.load(ws_row + rank)
    ctrl = my_base.to(tl.pointer_type(tl.int32))
    err = ctrl + CTRL_ERR
    f_counts = ctrl + flags_off
    f_rows = f_counts + world
    f_combine = f_counts + 2 * world
    epoch = tl.load(ctrl + CTRL_EPOCH) + 1
    # this rank's tensors
    lc = lctl + l64 * lctl_rs
    up_done = lc + L_UP
    dy_done = up_done + mbo
    dact_done = dy_done + mbo
    pairs = T * TOP_K
    rrows = world * src_rows  # receive rows
    grad_out = grad_out + l64 * go_rs
    glog = glog + l64 * glog_rs
    hidden = hidden + l64 * h_rs
    gu = gu + l64 * gu_rs
    down = down + l64 * down_rs
    logits = logits + l64 * T * E
    dl_ws = dl_ws + l64 * T * E
    ids_ptr = ids_ptr + l64 * pairs
    w_ptr = w_ptr + l64 * pairs
    rank_ptr = rank_ptr + l64 * pairs
    counts = counts + l64 * n_tiles * E
    meta = meta + l64 * (7 * E + 2 * world)
    seg = meta + 4 * E
    tpe = tpe + l64 * E
    gu_ws = gu_ws + l64 * rrows * 2 * I
    act = act + l64 * rrows * I
    d_y = d_y + l64 * rrows * H
    d_hidden = d_hidden + l64 * dh_rs
    d_rw = d_rw + l64 * E * H
    d_rb = d_rb + l64 * E
    d_gu = d_gu + l64 * E_loc * 2 * I * H
    d_down = d_down + l64 * E_loc * H * I
    recv_x = ws_ptr(my_base, recv_off, WD)
    recv_g = ws_ptr(my_base, recv_g_off, GD)
    recv_w = ws_ptr(my_base, recv_w_off, tl.float32)
    n_iblk = tl.cdiv(I, BI)
    n_hblk = tl.cdiv(H, BN)
    n_wd_h = tl.cdiv(H, BWA)
    n_wd_i = tl.cdiv(I, BWB)
    n_wg_r = tl.cdiv(2 * I, BWA)
    n_wg_h = tl.cdiv(H, BWB)
    scan_task = n_tiles
    disp0 = n_tiles + 1
    oscan_task = disp0 + n_tiles
    up0 = oscan_task + 1
    n_wd = E_loc * n_wd_h * n_wd_i
    n_wg = E_loc * n_wg_r * n_wg_h
    n_rh = tl.cdiv(H, BHR)
    n_tasks = up0 + mbo * 2 * (n_iblk + n_hblk) + n_wd + n_wg + n_tiles + n_rh  # bound; layout after OWNER_SCAN

    if rank == straggle_rank:
        delay_ns(straggle_ns, USE_ASM)

    status = 0
    t = claim(ctrl)
    while (t < n_tasks) & (status == 0):
        skip = (rank == drop_rank) & (t == drop_task)
        if t < scan_task:  # ---- ROUTE (logits kept)
            route_tile(t, hidden, h_ld, rw, rw_ld, rb, cb, logits, ids_ptr, w_ptr, rank_ptr, counts, T, H, E, rsf,
                       eps, HAS_RB, True, NORM, SCALED, SIGMOID, HAS_CB, N_GROUP, TOPK_GROUP, SD_ROUND, CD_ROUND,
                       TOP_K, KP, BT, BLOCK_E, BKR, ROUTER_PRECISION)
            if skip == 0:
                _signal(lc + L_ROUTED, USE_ASM)
        elif t == scan_task:  # ---- SCAN + counts to every rank
            status = wait_flag(lc + L_ROUTED, n_tiles, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                scan_counts(counts, meta, meta + 3 * E, n_tiles, E, BM, BLOCK_E, SCAN_T)
                status = wait_peers_finished(ctrl, err, world, rank, epoch - 1, timeout_ns, USE_ASM)
            if status == 0:
                _publish_counts(meta, ws_row, rank, world, E, epoch, data_off, flags_off, skip, BLOCK_E, USE_ASM)
                _signal(lc + L_SCANNED, USE_ASM)
        elif t < oscan_task:  # ---- DISPATCH rows, grads, weights
            status = wait_flag(lc + L_SCANNED, 1, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                _dispatch_tile(t - disp0, hidden, h_ld, ids_ptr, rank_ptr, counts, meta, ws_row, rank, T, H, E, E_loc,
                               src_rows, recv_off, grad_out, g_ld, w_ptr, recv_g_off, recv_w_off, TOP_K, KP, BT, BH,
                               WD, True)
                tl.debug_barrier()
                if skip == 0:
                    old = tl.atomic_add(lc + L_DISPATCHED, 1, sem="acq_rel", scope="sys")
                    if old == n_tiles - 1:
                        for q in range(world):
                            peer_flags = tl.load(ws_row + q).to(tl.pointer_type(tl.int32)) + flags_off
                            signal_flag(peer_flags + world + rank, epoch, "sys", USE_ASM)
        elif t == oscan_task:  # ---- OWNER_SCAN
            status = _wait_all(f_counts, world, epoch, err, timeout_ns, USE_ASM)
            if status == 0:
                _owner_scan(ws_ptr(my_base, data_off, tl.int32), seg, tpe, rank, world, E, E_loc, src_rows,
                            2 * n_hblk, BM, BLOCK_E)
                tl.debug_barrier()
                for q in range(world):
                    owed = tl.load(seg + 3 * E + world + q)
                    if (owed == 0) & (skip == 0):
                        peer_flags = tl.load(ws_row + q).to(tl.pointer_type(tl.int32)) + flags_off
                        signal_flag(peer_flags + 2 * world + rank, epoch, "sys", USE_ASM)
                if skip == 0:
                    _signal(lc + L_OWNER_SCANNED, USE_ASM)
        else:
            status = wait_flag(lc + L_OWNER_SCANNED, 1, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                nb_ = tl.load(seg + 3 * E - 1, cache_modifier=".cg")
                dy0 = up0 + nb_ * n_iblk
                dact0 = dy0 + nb_ * n_hblk
                wd0 = dact0 + nb_ * n_iblk
                dx0 = wd0 + n_wd
                wg0 = dx0 + nb_ * n_hblk
                fold0 = wg0 + n_wg
                wr0 = fold0 + n_tiles
                if t < dy0:  # ---- UP
                    u = t - up0
                    b = u // n_iblk
                    valid, g, row0, row_end = _block_rows(b, seg, E, BM, BLOCK_E)
                    j, src = _segment(g, rank, world)
                    status = wait_flag(f_rows + src, epoch, err, timeout_ns, "sys", USE_ASM)
                    if status == 0:
                        _up_tile(b, u - b * n_iblk, seg, ident, recv_x, H, gu, gu_ws, act, H, I, E, world,
                                 BM, BI, BK, BLOCK_E, UP_PRECISION)
                        if skip == 0:
                            _signal(up_done + b, USE_ASM)
                elif t < dact0:  # ---- DY: d_w partials straight to the source
                    d = t - dy0
                    b = d // n_hblk
                    status = wait_flag(up_done + b, n_iblk, err, timeout_ns, "gpu", USE_ASM)
                    if status == 0:
                        valid, g, row0, row_end = _block_rows(b, seg, E, BM, BLOCK_E)
                        j, src = _segment(g, rank, world)
                        shift = (tl.load(seg + 3 * E + src, cache_modifier=".cg") - src * src_rows).to(tl.int64)
                        peer = tl.load(ws_row + src)
                        dwp = ws_ptr(peer, comb_dw_off, tl.float32) + shift * n_hblk
                        _dy_tile(b, d - b * n_hblk, seg, ident, recv_w, act, down, recv_g, H, d_y, dwp, H, I, E,
                                 world, n_hblk, BM, BN, BK2, BLOCK_E, DOWN_PRECISION, PD_F32)
                        if skip == 0:
                            _signal(dy_done + b, USE_ASM)
                            _sent_one(lc, src, seg, E, world, peer, flags_off, rank, epoch, USE_ASM)
                elif t < wd0:  # ---- DACT
                    d = t - dact0
                    b = d // n_iblk
                    status = wait_flag(dy_done + b, n_hblk, err, timeout_ns, "gpu", USE_ASM)
                    if status == 0:
                        _dact_tile(b, d - b * n_iblk, seg, ident, d_y, down, gu_ws, H, I, E, world, BM, BI, BKH,
                                   BLOCK_E, DOWN_PRECISION, W_ROUND)
                        if skip == 0:
                            _signal(dact_done + b, USE_ASM)
                elif t < dx0:  # ---- WDOWN
                    d = t - wd0
                    per_e = n_wd_h * n_wd_i
                    e = d // per_e
                    r = d - e * per_e
                    th = r // n_wd_i
                    status = _wgrad_tile(e, th, r - th * n_wd_i, dy_done, n_hblk, err, timeout_ns, seg, ident, d_y,
                                         H, act, I, I, d_down, E, world, False, BM, BWA, BWB, DOWN_PRECISION, USE_ASM)
                elif t < wg0:  # ---- DX: d_x rows straight to the source
                    d = t - dx0
                    b = d // n_hblk
                    status = wait_flag(dact_done + b, n_iblk, err, timeout_ns, "gpu", USE_ASM)
                    if status == 0:
                        valid, g, row0, row_end = _block_rows(b, seg, E, BM, BLOCK_E)
                        j, src = _segment(g, rank, world)
                        shift = (tl.load(seg + 3 * E + src, cache_modifier=".cg") - src * src_rows).to(tl.int64)
                        peer = tl.load(ws_row + src)
                        d_x = ws_ptr(peer, comb_x_off, WD) + shift * H
                        _dx_tile(b, d - b * n_hblk, seg, ident, gu_ws, gu, d_x, H, I, E, world, BM, BN, BK3, BLOCK_E,
                                 UP_PRECISION)
                        if skip == 0:
                            _sent_one(lc, src, seg, E, world, peer, flags_off, rank, epoch, USE_ASM)
                elif t < fold0:  # ---- WGU
                    d = t - wg0
                    per_e = n_wg_r * n_wg_h
                    e = d // per_e
                    r = d - e * per_e
                    tr = r // n_wg_h
                    status = _wgrad_tile(e, tr, r - tr * n_wg_h, dact_done, n_iblk, err, timeout_ns, seg, ident,
                                         gu_ws, 2 * I, recv_x, H, H, d_gu, E, world, True, BM, BWA, BWB, UP_PRECISION,
                                         USE_ASM)
                elif t < wr0:  # ---- FOLD at home
                    status = _wait_all(f_combine, world, epoch, err, timeout_ns, USE_ASM)
                    if status == 0:
                        _fold_tile(t - fold0, ids_ptr, rank_ptr, counts, logits,
                                   ws_ptr(my_base, comb_dw_off, tl.float32), ws_ptr(my_base, comb_x_off, WD), glog,
                                   rw, rw_ld, dl_ws, d_hidden, dh_ld, T, H, E, n_hblk, rsf, eps, SIGMOID, SD_ROUND,
                                   NORM, SCALED, HAS_GLOG, TOP_K, KP, BT, BLOCK_E, BH, ROUTER_PRECISION)
                        if skip == 0:
                            _signal(lc + L_FOLDED, USE_ASM)
                elif t < wr0 + n_rh:  # ---- WROUTER
                    status = wait_flag(lc + L_FOLDED, n_tiles, err, timeout_ns, "gpu", USE_ASM)
                    if status == 0:
                        _wrouter_tile(t - wr0, dl_ws, hidden, h_ld, d_rw, d_rb, T, H, E, n_tiles, HAS_RB, BT,
                                      BLOCK_E, BHR, ROUTER_PRECISION)
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


@dataclasses.dataclass(frozen=True)
class EpBackwardLayout:
    """Byte offsets (from the data start) of a rank's EP backward workspace parts; nbytes: what one rank holds."""
    recv: int
    recv_g: int
    recv_w: int
    comb_x: int
    comb_dw: int
    nbytes: int


def ep_backward_layout(world: int, E: int, T: int, top_k: int, H: int, n_hblk: int, w_elt: int,
                       g_elt: int) -> EpBackwardLayout:
    rows = world * T * top_k
    recv = _round512(4 * world * E)
    recv_g = recv + _round512(rows * H * w_elt)
    recv_w = recv_g + _round512(rows * H * g_elt)
    comb_x = recv_w + _round512(rows * 4)
    comb_dw = comb_x + _round512(T * top_k * H * w_elt)
    return EpBackwardLayout(recv, recv_g, recv_w, comb_x, comb_dw, comb_dw + _round512(T * top_k * n_hblk * 4))


_identity: dict = {}
_identity_retired: list = []


def _identity_rows(n: int, device: torch.device) -> torch.Tensor:
    """0..n-1 as int32 (the receive rows' row map), kept and grown, so a captured graph holds no arange launch. A
    replaced map stays allocated (a captured graph may read it; it is 4 bytes a row)."""
    key = (device.type, device.index)
    t = _identity.get(key)
    if t is None or t.numel() < n:
        runtime.refuse_growth_in_capture(device, f"the EP backward's row map ({n} rows)")
        if t is not None:
            _identity_retired.append(t)
        size = max(n, 2 * (t.numel() if t is not None else 0))
        t = _identity[key] = runtime.kept_tensor(device, lambda: torch.arange(size, dtype=torch.int32, device=device))
    return t


def moe_ep_backward(ws: runtime.Workspace, rank_base: int, grad_out: torch.Tensor,
                    grad_router_logits: Optional[torch.Tensor], hidden: torch.Tensor, router_weight: torch.Tensor,
                    router_bias: Optional[torch.Tensor], score_correction_bias: Optional[torch.Tensor],
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, top_k: int, scoring: str = "softmax",
                    norm_topk_prob: bool = True, n_group: int = 1, topk_group: int = 1,
                    routed_scaling_factor: float = 1.0, router_dtype: Optional[torch.dtype] = None,
                    activation: str = "silu", *, programs: Optional[int] = None,
                    config: Optional[MoeBackwardConfig] = None, straggler=None, drop_signal=None):
    """EP backward of the ranks of `ws` driven here (tensors stacked on a leading n_local dim, as moe_ep_forward;
    grad_out [n_local, T, H], grad_router_logits [n_local, T, E] or None) -> [d_hidden [n_local, T, H],
    d_router_weight [n_local, E, H], d_gate_up_proj [n_local, E_loc, 2I, H], d_down_proj [n_local, E_loc, H, I]]
    (+ [d_router_bias [n_local, E]]), each rank's share as in the reference. Raises ValueError for what the kernel
    does not take."""
    from kosmos.kernels.moe_ep import check_ep_args
    from kosmos.kernels.moe_ops import _backward_reason, kernel_reason

    world, n_local = ws.world, ws.n_local
    check_ep_args(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k, scoring,
                  n_group, topk_group, world, n_local)
    if grad_router_logits is not None and (grad_router_logits.dim() != 3 or grad_router_logits.shape[0] != n_local):
        raise ValueError(f"kosmos moe_ep_backward: grad_router_logits must be [n_local, T, E], got "
                         f"{tuple(grad_router_logits.shape)}")
    E = router_weight.shape[0]
    reason = kernel_reason(hidden[0], router_weight, router_bias, score_correction_bias, gate_up_proj[0],
                           down_proj[0], top_k, scoring, n_group, topk_group, router_dtype, activation)
    if reason is None and tuple(grad_out.shape) != tuple(hidden.shape):
        reason = f"grad_out {tuple(grad_out.shape)} is not {tuple(hidden.shape)}"
    if reason is None:
        glog0 = grad_router_logits[0] if grad_router_logits is not None else None
        reason = _backward_reason(grad_out[0], glog0, hidden[0], E)
    if reason is not None:
        raise ValueError(f"kosmos moe_ep_backward: {reason}")
    ws.check()
    device = hidden.device
    _, T, H = hidden.shape
    E_loc, two_i = gate_up_proj.shape[1], gate_up_proj.shape[2]
    I = two_i // 2
    rd = router_dtype or hidden.dtype
    cfg = config or select_config(gate_up_proj[0], num_experts=E)
    n_tiles = triton.cdiv(T, cfg.bt)
    pairs = T * top_k
    src_rows = pairs
    rrows = world * src_rows
    mbo = max_blocks(rrows, E, cfg.bm)
    n_hblk = triton.cdiv(H, cfg.bn)
    if grad_out.stride(2) != 1:
        grad_out = grad_out.contiguous()
    if grad_router_logits is not None:
        grad_router_logits = grad_router_logits.contiguous()
    WT, D = gate_up_proj.dtype, down_proj.dtype
    lay = ep_backward_layout(world, E, T, top_k, H, n_hblk, gate_up_proj.element_size(), grad_out.element_size())
    ws.ensure(3 * world, lay.nbytes)
    ws.describe("moe_layer EP backward", f"counts 4*W*E + receive rows W*T*k*H*{gate_up_proj.element_size()} + "
                f"receive grads W*T*k*H*{grad_out.element_size()} + receive weights W*T*k*4 + combine d_x "
                f"T*k*H*{gate_up_proj.element_size()} + combine d_w T*k*n_hblk*4 (W={world} T={T} k={top_k} H={H} "
                f"E={E} n_hblk={n_hblk}) = {lay.nbytes} bytes per rank")
    lctl = ws.local_counters(L_HEAD + 3 * mbo)
    ident = _identity_rows(rrows, device)
    i32 = dict(dtype=torch.int32, device=device)
    logits = torch.empty(n_local, T, E, dtype=rd, device=device)
    dl_ws = torch.empty(n_local, T, E, dtype=rd, device=device)
    ids = torch.empty(n_local, T, top_k, **i32)
    ranks = torch.empty(n_local, T, top_k, **i32)
    wts = torch.empty(n_local, T, top_k, dtype=torch.float32, device=device)
    counts = torch.empty(n_local, n_tiles, E, **i32)
    meta = torch.empty(n_local, 7 * E + 2 * world, **i32)
    tpe = torch.empty(n_local, E, **i32)
    gu_ws = torch.empty(n_local, rrows, 2 * I, dtype=WT, device=device)
    act = torch.empty(n_local, rrows, I, dtype=D, device=device)
    d_y = torch.empty(n_local, rrows, H, dtype=D, device=device)
    d_hidden = torch.empty(n_local, T, H, dtype=hidden.dtype, device=device)
    d_rw = torch.empty(n_local, E, H, dtype=router_weight.dtype, device=device)
    d_rb = torch.empty(n_local, E, dtype=router_bias.dtype, device=device) if router_bias is not None else None
    d_gu = torch.empty(n_local, E_loc, 2 * I, H, dtype=WT, device=device)
    d_down = torch.empty(n_local, E_loc, H, I, dtype=D, device=device)
    interp = runtime.interpreting()
    n_tasks = (3 * n_tiles + 2 + mbo * 2 * (triton.cdiv(I, cfg.bi) + n_hblk)
               + E_loc * (triton.cdiv(H, cfg.bwa) * triton.cdiv(I, cfg.bwb)
                          + triton.cdiv(2 * I, cfg.bwa) * triton.cdiv(H, cfg.bwb)) + triton.cdiv(H, cfg.bhr))
    P = programs or runtime.default_programs(device, n_local)
    P = max(1, min(P, n_tasks))
    s_rank, s_ns = straggler if straggler is not None else (-1, 0)
    d_rank, d_task = drop_signal if drop_signal is not None else (-1, -1)
    off = ws.layout.data_off
    glog = grad_router_logits if grad_router_logits is not None else grad_out
    args = (ws.table, ws.err_host.data_ptr(), rank_base, world, lctl, lctl.stride(0), L_HEAD + 3 * mbo,
            runtime.spin_timeout_ns(), s_rank, int(s_ns), d_rank, d_task,
            grad_out, grad_out.stride(0), grad_out.stride(1), glog, glog.stride(0) if grad_router_logits is not None
            else 0, hidden, hidden.stride(0), hidden.stride(1), router_weight, router_weight.stride(0),
            router_bias if router_bias is not None else router_weight,
            score_correction_bias if score_correction_bias is not None else router_weight,
            gate_up_proj, gate_up_proj.stride(0), down_proj, down_proj.stride(0),
            logits, ids, wts, ranks, counts, meta, tpe, ident, gu_ws, act, d_y, dl_ws,
            d_hidden, d_hidden.stride(0), d_hidden.stride(1), d_rw, d_rb if d_rb is not None else d_rw, d_gu, d_down,
            T, H, I, E, E_loc, float(routed_scaling_factor), 1e-20, n_tiles, mbo, src_rows, runtime.FLAGS_OFF_WORDS,
            off, off + lay.recv, off + lay.recv_g, off + lay.recv_w, off + lay.comb_x, off + lay.comb_dw)
    meta_kw = dict(**routing_constexprs(scoring, norm_topk_prob, n_group, topk_group, routed_scaling_factor, rd,
                                        router_bias, score_correction_bias, top_k, E, WT, D, hidden.dtype),
                   HAS_GLOG=grad_router_logits is not None, W_ROUND=WT != torch.float32, **backward_tiles(cfg),
                   USE_ASM=not interp, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    grid = (P, n_local)
    runtime.check_grid_fits(moe_ep_backward_kernel, ("moe_ep_bwd", hidden.dtype, WT, D, rd, grad_out.dtype,
                                                     tuple(sorted((k, str(v)) for k, v in meta_kw.items()))),
                            grid, device, args, meta_kw)
    with ws.lock:
        moe_ep_backward_kernel[grid](*args, **meta_kw, **runtime.COMPILE_OPTIONS)
    ws.after_launch()
    return [d_hidden, d_rw, d_gu, d_down] + ([d_rb] if d_rb is not None else [])
