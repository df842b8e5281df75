"""Fused GEMM + reduce-scatter (`kosmos::gemm_rs`): one self-scheduling persistent launch.

    full_q = sum_i x_i[q] @ w_i[q]  (+ bias)            # rank q's partial product, [M, N]
    out_r  = reduce_op over q of full_q[r*M/W : (r+1)*M/W]

A scatter along a dim > 0 (inputs [B, S, K], out [B, S/W, N]) is the same kernel with a row remap (REMAP):
owner o's output row b*s_out + i (s_out = S/W) is input row b*S + o*s_out + i (ag_gemm.gathered_row). Tiles,
slots, flags and the output stay in owner-row space; only the rows a tile reads move. The host picks a tile
with s_out % BLOCK_M == 0 (the config's, else 64 rows), so a tile never straddles two batch entries.

Each program claims tasks of its rank's stream (kosmos.kernels.queue.gemm_rs_stream):
- TILE (owner o, mb, nb): waits until owner o finished the previous call (its partial slots are free),
  computes the tile with the GEMM core's K loop (several (input, weight) pairs summed in fp32, + this rank's
  bias), rounds it to the input dtype and pushes it into slot [rank] of owner o's workspace, then releases
  flag partial[rank][tile] in o's workspace (sys scope). Owners in the order they need data: r+1, ..., r.
- REDUCE (rank, mb, nb): the own tile, computed and stored to the own slot like a TILE, and right behind it,
  in the same program (so it never waits on its own partial), the fold: wait for partial[q][tile] of every
  other rank q, sum the W slots in FIXED rank order 0..W-1 in fp32 (bitwise deterministic whichever program
  runs it and whatever the grid), scale (avg: 1/W), store the output tile.

Descriptors (TMA) are built once per program: every input as a whole [M, K_i] (a tile past its owner chunk's
last row computes rows that are masked at the store) and every weight.

Kernel inputs only — no process-group logic (see ag_gemm.py).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from kosmos.kernels import queue, runtime
from kosmos.kernels.ag_gemm import (REMAP_SMALL_BLOCK_M, _check8, _RankTensor, _rows_of, _weight_view,
                                    gathered_row, remap_config, weight_desc, ws_ptr)
from kosmos.kernels.gemm import CONFIGS, gemm_tile, select_config
from kosmos.kernels.signals import (CTRL_EPOCH, CTRL_ERR, CTRL_FINISHED, claim, delay_ns, finish_call,
                                    record_status, signal_flag, wait_flag)

OP_ID = tl.constexpr(2)  # runtime.OP_IDS["gemm_rs"]
MAX_PAIRS = 4


@triton.jit
def pair_descs(x_ptr, x_rs, x_ld, k, w_ptr, w_rs, w_ld, rank64, M, N,
               B_TRANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """TMA descriptors of one (input, weight) pair of rank `rank64`: x [M, k] as a whole (a tile past its owner
    chunk's last row computes rows that are never stored), w [k, N] or its [N, k] Linear weight."""
    x_desc = tl.make_tensor_descriptor(x_ptr + rank64 * x_rs, shape=[M, k], strides=[x_ld.to(tl.int64), 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    w_desc = weight_desc(w_ptr + rank64 * w_rs, w_ld.to(tl.int64), N, k, B_TRANS, BLOCK_N, BLOCK_K)
    return x_desc, w_desc


@triton.jit(do_not_specialize=["err_host", "n_tasks", "rank_base", "world", "timeout_ns", "straggle_rank",
                               "straggle_ns", "drop_rank", "drop_task", "has_bias"],
            do_not_specialize_on_alignment=["mo", "seg", "N", "x_rs0", "x_rs1", "x_rs2", "x_rs3", "w_rs0", "w_rs1",
                                            "w_rs2", "w_rs3", "bias_rs", "out_rs", "flags_off", "data_off"])
def gemm_rs_kernel(stream_ptr, n_tasks, ws_table, err_host, rank_base, world,
                   x0, x1, x2, x3, x_rs0, x_rs1, x_rs2, x_rs3, x_ld0, x_ld1, x_ld2, x_ld3, k0, k1, k2, k3,
                   w0, w1, w2, w3, w_rs0, w_rs1, w_rs2, w_rs3, w_ld0, w_ld1, w_ld2, w_ld3,
                   bias_ptr, bias_rs, has_bias,
                   out_ptr, out_rs, out_ld,
                   mo, N, scale, seg,
                   flags_off, data_off,
                   timeout_ns, straggle_rank, straggle_ns, drop_rank, drop_task,
                   NP: tl.constexpr, B_TRANS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, RED_N: tl.constexpr, USE_ASM: tl.constexpr,
                   REMAP: tl.constexpr = False):
    """REMAP (a scatter along a dim > 0): owner o's output rows mo = B*seg are B batch entries of seg rows;
    owner row r is input row gathered_row(o, r, seg, world) (host: seg % BLOCK_M == 0). Without REMAP, seg
    is unused."""
    ELT: tl.constexpr = x0.dtype.element_ty
    # the host guarantees 16-byte multiples for every row and rank stride (and 16-byte aligned bases);
    # `(x // 8) * 8` tells the compiler so (a hint on an argument is lost), for 16-byte vector accesses
    N = (N // 8) * 8
    out_rs = (out_rs // 8) * 8
    out_ld = (out_ld // 8) * 8
    bias_rs = (bias_rs // 8) * 8
    err_host = err_host.to(tl.pointer_type(tl.int32))  # host-mapped (pinned) mirror: same address on the GPU
    local = tl.program_id(1)
    rank = rank_base + local
    rank64 = rank.to(tl.int64)
    ws_row = ws_table + local * world
    my_base = tl.load(ws_row + rank)
    ctrl = my_base.to(tl.pointer_type(tl.int32))
    err = ctrl + CTRL_ERR
    my_flags = ctrl + flags_off
    epoch = tl.load(ctrl + CTRL_EPOCH) + 1
    stream = stream_ptr + local.to(tl.int64) * n_tasks * 4
    my_slots = ws_ptr(my_base, data_off, ELT)
    my_out = out_ptr + rank64 * out_rs
    nmb = tl.cdiv(mo, BLOCK_M)
    nnb = tl.cdiv(N, BLOCK_N)
    tiles = nmb * nnb
    mo64 = mo.to(tl.int64)
    N64 = N.to(tl.int64)
    M = world * mo
    xd0, wd0 = pair_descs(x0, x_rs0, x_ld0, k0, w0, w_rs0, w_ld0, rank64, M, N, B_TRANS, BLOCK_M, BLOCK_N, BLOCK_K)
    if NP > 1:
        xd1, wd1 = pair_descs(x1, x_rs1, x_ld1, k1, w1, w_rs1, w_ld1, rank64, M, N, B_TRANS, BLOCK_M, BLOCK_N,
                              BLOCK_K)
    if NP > 2:
        xd2, wd2 = pair_descs(x2, x_rs2, x_ld2, k2, w2, w_rs2, w_ld2, rank64, M, N, B_TRANS, BLOCK_M, BLOCK_N,
                              BLOCK_K)
    if NP > 3:
        xd3, wd3 = pair_descs(x3, x_rs3, x_ld3, k3, w3, w_rs3, w_ld3, rank64, M, N, B_TRANS, BLOCK_M, BLOCK_N,
                              BLOCK_K)

    if rank == straggle_rank:
        delay_ns(straggle_ns, USE_ASM)

    status = 0
    t = claim(ctrl)
    while (t < n_tasks) & (status == 0):
        kind = tl.load(stream + t * 4)
        o = tl.load(stream + t * 4 + 1)
        mb = tl.load(stream + t * 4 + 2)
        nb = tl.load(stream + t * 4 + 3)
        skip_signal = (rank == drop_rank) & (t == drop_task)
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        # ---- TILE for owner o (o == rank for REDUCE): the slot [rank] of o must be free (o finished the
        # previous call), then this rank's partial (+ its bias), rounded to the input dtype, goes there
        status = wait_flag(ctrl + CTRL_FINISHED + o, epoch - 1, err, timeout_ns, "sys", USE_ASM)
        if status == 0:
            if REMAP:
                off_m = gathered_row(o, mb * BLOCK_M, seg, world)  # the tile's first input row
            else:
                off_m = o * mo + mb * BLOCK_M
            acc = gemm_tile(xd0, wd0, off_m, nb * BLOCK_N, tl.cdiv(k0, BLOCK_K), BLOCK_M, BLOCK_N, BLOCK_K,
                            False, B_TRANS, DOT_PRECISION)
            if NP > 1:
                acc += gemm_tile(xd1, wd1, off_m, nb * BLOCK_N, tl.cdiv(k1, BLOCK_K), BLOCK_M, BLOCK_N, BLOCK_K,
                                 False, B_TRANS, DOT_PRECISION)
            if NP > 2:
                acc += gemm_tile(xd2, wd2, off_m, nb * BLOCK_N, tl.cdiv(k2, BLOCK_K), BLOCK_M, BLOCK_N, BLOCK_K,
                                 False, B_TRANS, DOT_PRECISION)
            if NP > 3:
                acc += gemm_tile(xd3, wd3, off_m, nb * BLOCK_N, tl.cdiv(k3, BLOCK_K), BLOCK_M, BLOCK_N, BLOCK_K,
                                 False, B_TRANS, DOT_PRECISION)
            cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            if has_bias != 0:
                bias = tl.load(bias_ptr + rank64 * bias_rs + cols, mask=cols < N, other=0.0)
                acc += bias.to(tl.float32)[None, :]
            mask = (rows[:, None] < mo) & (cols[None, :] < N)
            part = acc.to(ELT)
            peer_base = tl.load(ws_row + o)
            if world == 1:
                # nothing to fold: the own partial, rounded as any pushed one, is the output (the same bits as
                # the slot round trip below)
                tl.store(my_out + rows[:, None].to(tl.int64) * out_ld + cols[None, :],
                         (part.to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=mask)
            else:
                slot = ws_ptr(peer_base, data_off, ELT) + rank64 * mo64 * N64
                tl.store(slot + rows[:, None].to(tl.int64) * N64 + cols[None, :], part, mask=mask)
                if kind == 2:
                    if skip_signal == 0:
                        peer_flags = peer_base.to(tl.pointer_type(tl.int32)) + flags_off
                        signal_flag(peer_flags + rank * tiles + mb * nnb + nb, epoch, "sys", USE_ASM)
                else:
                    # ---- REDUCE: right behind its own tile, same program: fold the W partials of this tile
                    # in rank order 0..W-1 (the own one was just stored: CTA barrier), scale, store
                    tl.debug_barrier()
                    tile = mb * nnb + nb
                    for q in range(world):
                        if status == 0:
                            if q != rank:
                                status = wait_flag(my_flags + q * tiles + tile, epoch, err, timeout_ns, "sys",
                                                   USE_ASM)
                    if status == 0:
                        for cb in tl.static_range(BLOCK_N // RED_N):
                            rcols = nb * BLOCK_N + cb * RED_N + tl.arange(0, RED_N)
                            rmask = (rows[:, None] < mo) & (rcols[None, :] < N)
                            offs = rows[:, None].to(tl.int64) * N64 + rcols[None, :]
                            total = tl.zeros((BLOCK_M, RED_N), dtype=tl.float32)
                            # two slots per step (more loads in flight), still added in rank order
                            for q in range(0, world, 2):
                                p0 = tl.load(my_slots + q * mo64 * N64 + offs, mask=rmask, other=0.0)
                                # the slot test as a tensor: triton 3.9's interpreter refuses mask & scalar
                                has_p1 = (rcols[None, :] * 0 + q + 1) < world
                                p1 = tl.load(my_slots + (q + 1) * mo64 * N64 + offs, mask=rmask & has_p1, other=0.0)
                                total += p0.to(tl.float32)
                                total += p1.to(tl.float32)
                            total = total * scale
                            tl.store(my_out + rows[:, None].to(tl.int64) * out_ld + rcols[None, :],
                                     total.to(out_ptr.dtype.element_ty), mask=rmask)
        if status != 0:
            record_status(status, ctrl, err_host, ws_row, rank_base, world, OP_ID, rank, t)
        if status == 0:
            t = claim(ctrl)
    finish_call(ctrl, ws_row, rank, world, epoch)


# ----------------------------------------------------------------------------------------------------------
# host side


def _pad4(items: list, fill):
    return list(items) + [fill] * (MAX_PAIRS - len(items))


def rs_config(M: int, N: int, ks: Sequence[int], dtype, world: int, seg: Optional[int] = None):
    """The tile config `launch` uses (None: a remapped scatter whose rows per batch entry fit no tile)."""
    cfg = select_config(M, N, max(ks), dtype)
    if len(ks) > 1:
        cfg = CONFIGS["bn128"]  # two fp32 accumulators live at once: keep the tile at 128x128
    return remap_config(cfg, seg, M // world)


def launch(ws: runtime.Workspace, rank_base: int, xs: Sequence[_RankTensor], ks: Sequence[int],
           ws_: Sequence[_RankTensor], b_trans: bool, bias: Optional[_RankTensor], out: _RankTensor,
           M: int, N: int, reduce_op: str, *, programs: Optional[int] = None, straggler=None,
           drop_signal=None, seg: Optional[int] = None) -> None:
    """Launches the fused kernel for the ranks of `ws` driven here (grid (programs, ws.n_local)).
    seg: output rows per batch entry of a scatter along a dim > 0 (M/W = B * seg; None or M/W: the dim-0
    layout); it must be a multiple of the tile's BLOCK_M (the config's, or 64), else ValueError."""
    ws.check()
    device = xs[0].t.device
    world, n_local = ws.world, ws.n_local
    dtype = xs[0].t.dtype
    mo = M // world
    _check8("gemm_rs", N, out.rs, out.ld, bias.rs if bias is not None else 0)
    remap = seg is not None and seg != mo
    cfg = rs_config(M, N, ks, dtype, world, seg)
    if cfg is None:
        raise ValueError(f"kosmos gemm_rs: output rows per batch entry s={seg} (of {mo} rows per rank) not a "
                         f"multiple of the tile ({rs_config(M, N, ks, dtype, world).block_m} or "
                         f"{REMAP_SMALL_BLOCK_M} rows)")
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    nmb, nnb = triton.cdiv(mo, BM), triton.cdiv(N, BN)
    P = programs or runtime.default_programs(device, n_local)
    ranks = [rank_base + i for i in range(n_local)]
    key = ("rs", world, tuple(ranks), nmb, nnb, cfg.group_m)
    stream = runtime.cached_stream(
        key, lambda: [queue.gemm_rs_stream(r, world, nmb, nnb, cfg.group_m) for r in ranks], device)
    n_tasks = stream.shape[1]
    ws.ensure(world * nmb * nnb, world * mo * N * xs[0].t.element_size())
    ws.describe("gemm_rs", f"partial slots W*(M/W)*N*{xs[0].t.element_size()} (W={world} M/W={mo} N={N}) = "
                f"{world * mo * N * xs[0].t.element_size()} bytes per rank")
    interp = runtime.interpreting()
    if not interp:
        runtime.ensure_allocator()
    np_ = len(xs)
    x4 = _pad4(list(xs), xs[0])
    k4 = _pad4(list(ks), ks[0])
    w4 = _pad4(list(ws_), ws_[0])
    s_rank, s_ns = straggler if straggler is not None else (-1, 0)
    d_rank, d_task = drop_signal if drop_signal is not None else (-1, -1)
    scale = 1.0 / world if reduce_op == "avg" else 1.0
    args = (stream, n_tasks, ws.table, ws.err_host.data_ptr(), rank_base, world,
            *[x.t for x in x4], *[x.rs for x in x4], *[x.ld for x in x4], *k4,
            *[w.t for w in w4], *[w.rs for w in w4], *[w.ld for w in w4],
            bias.t if bias is not None else xs[0].t, bias.rs if bias is not None else 0, int(bias is not None),
            out.t, out.rs, out.ld,
            mo, N, scale, seg if remap else mo,
            runtime.FLAGS_OFF_WORDS, ws.layout.data_off,
            runtime.spin_timeout_ns(), s_rank, int(s_ns), d_rank, d_task)
    meta = dict(NP=np_, B_TRANS=b_trans, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, DOT_PRECISION="tf32",
                RED_N=min(128, BN), USE_ASM=not interp, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if remap:
        meta["REMAP"] = True  # the dim-0 launch stays exactly as it was (REMAP left at its default)
    grid = (P, n_local)
    runtime.check_grid_fits(gemm_rs_kernel, ("rs", dtype, out.t.dtype, np_, b_trans, cfg, remap), grid, device,
                            args, meta)
    with ws.lock:
        gemm_rs_kernel[grid](*args, **meta, **runtime.COMPILE_OPTIONS)
    ws.after_launch()


def gemm_rs_sim(world_obj, inputs, weights, bias=None, reduce_op="sum", *, out_dtype=None, programs=None,
                straggler=None, drop_signal=None, out=None, scatter_dim=0):
    """SimWorld entry: inputs list of [W, M, K_i], weights list of [W, K_i, N], bias [W, N] | None.

    scatter_dim > 0 (a dim of the per-rank input): inputs are [W, *lead, K_i]; rank r gets chunk r along
    that dim of the reduced [*lead, N]: B = prod(lead[:dim]) batch entries of S = prod(lead[dim:]) rows,
    s_out = S / W of them per rank, remapped in the kernel (s_out must be a multiple of the tile, 128 or 64
    rows, unless B == 1). Returns [W, *lead with lead[dim] / W, N]; out may be given in that shape or as
    [W, M/W, N]."""
    W = world_obj.world
    if scatter_dim == 0:
        return _gemm_rs_sim_rows(world_obj, inputs, weights, bias, reduce_op, out_dtype, programs, straggler,
                                 drop_signal, out, None)
    x0 = inputs[0]
    if x0.dim() < 3 or x0.shape[0] != W or not 0 <= scatter_dim < x0.dim() - 2:
        raise ValueError(f"SimWorld.gemm_rs: scatter_dim {scatter_dim} must index a non-K dim of the input "
                         f"{tuple(x0.shape[1:])} (inputs are [W={W}, *lead, K])")
    lead = list(x0.shape[1:-1])
    if lead[scatter_dim] % W:
        raise ValueError(f"SimWorld.gemm_rs: dim {scatter_dim} of size {lead[scatter_dim]} not divisible by W={W}")
    B, S = queue.split_rows(lead, scatter_dim)
    M = B * S
    olead = list(lead)
    olead[scatter_dim] //= W
    for x in inputs:
        if list(x.shape[1:-1]) != lead:
            raise ValueError(f"SimWorld.gemm_rs: inputs' leading dims differ: {tuple(x.shape)} vs {tuple(x0.shape)}")
    xs = [_rows_of(x, M, x.shape[-1], "SimWorld.gemm_rs: input") for x in inputs]
    if out is not None:
        out = _rows_of(out, M // W, out.shape[-1], "SimWorld.gemm_rs: out")
    res = _gemm_rs_sim_rows(world_obj, xs, weights, bias, reduce_op, out_dtype, programs, straggler, drop_signal,
                            out, S // W if B > 1 else None)
    return res.view(W, *olead, res.shape[-1])


def _gemm_rs_sim_rows(world_obj, inputs, weights, bias, reduce_op, out_dtype, programs, straggler, drop_signal,
                      out, seg):
    """gemm_rs_sim on rows: inputs [W, M, K_i]; seg: output rows per batch entry of a scatter along a dim > 0."""
    W = world_obj.world
    if not 1 <= len(inputs) <= MAX_PAIRS or len(inputs) != len(weights):
        raise ValueError(f"SimWorld.gemm_rs: 1..{MAX_PAIRS} (input, weight) pairs")
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    M = inputs[0].shape[1]
    N = weights[0].shape[2]
    if M % W:
        raise ValueError(f"SimWorld.gemm_rs: M={M} not divisible by W={W}")
    for x, w in zip(inputs, weights):
        if x.dim() != 3 or x.shape[0] != W or x.shape[1] != M or x.stride(-1) != 1:
            raise ValueError(f"SimWorld.gemm_rs: inputs must be [W, M, K] with unit K stride, got {tuple(x.shape)}")
        if w.dim() != 3 or w.shape[0] != W or w.shape[1] != x.shape[2] or w.shape[2] != N:
            raise ValueError(f"SimWorld.gemm_rs: weights must be [W, K, N], got {tuple(w.shape)}")
    trans = {_weight_view(w[0])[0] for w in weights}
    if len(trans) != 1:
        raise ValueError("SimWorld.gemm_rs: all weights must be row-major, or all transposed views")
    out_dtype = out_dtype or inputs[0].dtype
    if out is None:
        out = torch.empty(W, M // W, N, device=inputs[0].device, dtype=out_dtype)
    if tuple(out.shape) != (W, M // W, N) or out.stride(-1) != 1:
        raise ValueError(f"SimWorld.gemm_rs: out must be [W, M/W, N] with unit stride, got {tuple(out.shape)}")
    launch(world_obj.workspace, 0, [_RankTensor(x, x.stride(0), x.stride(1)) for x in inputs],
           [x.shape[2] for x in inputs], [_RankTensor(w, w.stride(0), _weight_view(w[0])[1]) for w in weights],
           trans.pop(), _RankTensor(bias, bias.stride(0), 1) if bias is not None else None,
           _RankTensor(out, out.stride(0), out.stride(1)), M, N, reduce_op, programs=programs,
           straggler=straggler, drop_signal=drop_signal, seg=seg)
    return out


def gemm_rs_group(inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], bias: Optional[torch.Tensor],
                  reduce_op: str, world: int, group_name: str, out_dtype, *, ws=None, rank=None,
                  scatter_dim: int = 0, programs=None, straggler=None, drop_signal=None):
    """Real process group entry (one rank per process); checked by fused_ops. scatter_dim > 0: the output's
    rows are B batch entries of S/W rows (queue.split_rows), remapped in the kernel.
    programs / straggler / drop_signal: test hooks, passed to `launch` as they are (the op passes none)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if ws is None:
        ws = runtime.group_workspace(group_name, inputs[0].device)
    if rank is None:
        rank = dist.get_rank(_resolve_process_group(group_name))
    lead = list(inputs[0].shape[:-1])
    B, S = queue.split_rows(lead, scatter_dim)
    xs = [x.reshape(-1, x.shape[-1]) for x in inputs]
    M = xs[0].shape[0]
    N = weights[0].shape[1]
    out_dtype = out_dtype or inputs[0].dtype
    out = torch.empty(M // world, N, device=xs[0].device, dtype=out_dtype)
    launch(ws, rank, [_RankTensor(x, 0, x.stride(0)) for x in xs], [x.shape[1] for x in xs],
           [_RankTensor(w, 0, _weight_view(w)[1]) for w in weights], _weight_view(weights[0])[0],
           _RankTensor(bias, 0, 1) if bias is not None else None, _RankTensor(out, 0, N), M, N, reduce_op,
           seg=S // world if B > 1 else None, programs=programs, straggler=straggler, drop_signal=drop_signal)
    lead[scatter_dim] //= world
    return out.view(*lead, N)
