"""Fused all-gather + GEMM (`kosmos::ag_gemm`): one self-scheduling persistent launch.

    gathered = cat([a_q for q in ranks], dim=0)          # [W*m, K]
    out_i    = gathered @ w_i (+ b_i)                     # several weights in one launch (QKV, gate+up)

A gather along a dim > 0 (TP+SP with local batch B >= 2: shard [B, s, K], gathered [B, W*s, K]) is the same
kernel on rows with a row remap (REMAP): the shard is m = B*s rows (a view, no copy), and shard row b*s + i of
chunk c is gathered / output row b*W*s + c*s + i (gathered_row). The host picks a tile with s % BLOCK_M == 0
(the config's 128 rows, else 64), so every publish / pull block and every tile lies inside one batch entry
and maps to one contiguous row block; other s take the reference path (fused_ops says why).

Each program claims tasks of its rank's stream (kosmos.kernels.queue.ag_gemm_stream) and plays the task's
role:
- PUBLISH block i (W > 1): copy rows of the local shard into this rank's symmetric staging buffer (peers pull
  from it) and, when the caller wants it (GATHER_LOCAL), into the gathered buffer; release ready[rank][i] at sys
  scope. First it waits until every peer has finished the previous call (so none still reads the staging
  buffer being overwritten).
- LOCAL block i (W = 1, GATHER_LOCAL): copy rows of the shard into the gathered buffer; nothing waits for it.
- PULL (q, i): wait for ready[q][i] in rank q's workspace (acquire, sys), copy that block of q's staging
  into the local gathered buffer ONCE, release the local ready[q][i] (gpu scope).
- TILE (c, mb, wi, nb): output tile of weight wi over chunk c; the local chunk reads the shard itself (no
  wait), other chunks wait for their pulled block, then run the GEMM core's K loop (gemm_tile: TMA
  descriptors, never remote loads) and its epilogue (gemm_epilogue, TMA store; or plain masked stores with
  epilogue="store"). TMA descriptors are built on the device once per program (the rank varies in SimWorld);
  per tile only for several weights, or for the output when m is not a multiple of the tile (clipping at the
  chunk edge).

Kernel inputs only — no process-group logic: rank = rank_base + program_id(1), the workspace table, the task
stream and per-rank tensors as (pointer, rank stride). A real group launches grid (P, 1) with its rank;
SimWorld launches (P, W) with rank_base 0.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from kosmos.kernels import queue, runtime
from kosmos.kernels.gemm import GemmConfig, gemm_epilogue, gemm_tile, select_config
from kosmos.kernels.signals import (CTRL_EPOCH, CTRL_ERR, claim, delay_ns, finish_call, record_status,
                                    signal_flag, wait_flag, wait_peers_finished)

OP_ID = tl.constexpr(1)  # runtime.OP_IDS["ag_gemm"]
MAX_WEIGHTS = 4
COPY_ROWS, COPY_COLS = 32, 512  # block of a publish / pull / local copy step (bf16: 32 KB)

# ----------------------------------------------------------------------------------------------------------
# jit pieces


@triton.jit
def copy_rows(src, src_ld, dst, dst_ld, dst2, dst2_ld, nrows, ncols,
              WRITE2: tl.constexpr, CR: tl.constexpr, CC: tl.constexpr):
    """dst[:nrows, :ncols] = src[:nrows, :ncols] (and dst2 too with WRITE2); row strides in elements."""
    for r0 in range(0, nrows, CR):
        rows = r0 + tl.arange(0, CR)
        rmask = rows < nrows
        roff = rows.to(tl.int64)
        for c0 in range(0, ncols, CC):
            cols = tl.max_contiguous(tl.multiple_of(c0 + tl.arange(0, CC), CC), CC)
            mask = rmask[:, None] & (cols[None, :] < ncols)
            x = tl.load(src + roff[:, None] * src_ld + cols[None, :], mask=mask)
            tl.store(dst + roff[:, None] * dst_ld + cols[None, :], x, mask=mask)
            if WRITE2:
                tl.store(dst2 + roff[:, None] * dst2_ld + cols[None, :], x, mask=mask)


@triton.jit
def gathered_row(c, r0, seg, world):
    """Row of the gathered [B*world*seg] operand that holds row r0 of chunk c's shard [B*seg] (batch-major:
    a gather along a dim > 0 seen as rows): b*world*seg + c*seg + i with b, i = divmod(r0, seg). The
    caller's tile / block of rows never straddles two batch entries (the host makes seg a multiple of
    BLOCK_M), so a whole block maps to one contiguous run of rows. Mirror: kosmos.kernels.queue.gathered_row."""
    b = r0 // seg
    return b * world * seg + c * seg + (r0 - b * seg)


@triton.jit
def pick(wi, v0, v1, v2, v3, NW: tl.constexpr):
    """v_wi for a run-time weight index (NW weights)."""
    r = v0
    if NW > 1:
        if wi == 1:
            r = v1
    if NW > 2:
        if wi == 2:
            r = v2
    if NW > 3:
        if wi == 3:
            r = v3
    return r


@triton.jit
def ws_ptr(base, off_bytes, DTYPE: tl.constexpr):
    """Typed pointer into a workspace buffer whose int64 address is `base`."""
    return tl.multiple_of((base + off_bytes).to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def weight_desc(w_base, w_stride, n, K, B_TRANS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """TMA descriptor of a [K, n] weight: row-major, or (B_TRANS) the [n, K] Linear weight itself."""
    if B_TRANS:
        return tl.make_tensor_descriptor(w_base, shape=[n, K], strides=[w_stride, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        return tl.make_tensor_descriptor(w_base, shape=[K, n], strides=[w_stride, 1], block_shape=[BLOCK_K, BLOCK_N])


@triton.jit
def out_desc(o_base, rows, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr):
    """TMA descriptor of a row-major [rows, n] output with the block gemm_epilogue stores."""
    if EPILOGUE_SUBTILE:
        return tl.make_tensor_descriptor(o_base, shape=[rows, n], strides=[n.to(tl.int64), 1],
                                         block_shape=[BLOCK_M, BLOCK_N // 2])
    else:
        return tl.make_tensor_descriptor(o_base, shape=[rows, n], strides=[n.to(tl.int64), 1],
                                         block_shape=[BLOCK_M, BLOCK_N])


@triton.jit(do_not_specialize=["err_host", "n_tasks", "rank_base", "world", "timeout_ns", "straggle_rank",
                               "straggle_ns", "drop_rank", "drop_task", "has_b0", "has_b1", "has_b2", "has_b3"],
            do_not_specialize_on_alignment=["m", "seg", "n0", "n1", "n2", "n3", "a_rs", "g_rs", "w_rs0", "w_rs1",
                                            "w_rs2", "w_rs3", "b_rs0", "b_rs1", "b_rs2", "b_rs3", "o_rs0", "o_rs1",
                                            "o_rs2", "o_rs3", "flags_off", "data_off"])
def ag_gemm_kernel(stream_ptr, n_tasks, ws_table, err_host, rank_base, world,
                   a_ptr, a_rs, a_ld, m, K, seg,
                   g_ptr, g_rs,
                   w0, w1, w2, w3, w_rs0, w_rs1, w_rs2, w_rs3, w_ld0, w_ld1, w_ld2, w_ld3,
                   n0, n1, n2, n3,
                   b0, b1, b2, b3, b_rs0, b_rs1, b_rs2, b_rs3, has_b0, has_b1, has_b2, has_b3,
                   o0, o1, o2, o3, o_rs0, o_rs1, o_rs2, o_rs3,
                   flags_off, data_off,
                   timeout_ns, straggle_rank, straggle_ns, drop_rank, drop_task,
                   NW: tl.constexpr, B_TRANS: tl.constexpr, C_ONCE: tl.constexpr, EPILOGUE_TMA: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EPILOGUE_SUBTILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   COPY_ROWS: tl.constexpr, COPY_COLS: tl.constexpr, USE_ASM: tl.constexpr,
                   REMAP: tl.constexpr = False, GATHER_LOCAL: tl.constexpr = True):
    """EPILOGUE_TMA: output tiles through the GEMM core's epilogue (TMA store); else plain masked stores.
    C_ONCE: one weight and m % BLOCK_M == 0 (no tile crosses a chunk edge), so the output descriptor is
    built once per program over the whole [W*m, N]; otherwise per tile over the tile's chunk (clipped).
    REMAP (a gather along a dim > 0): the shard's m = B*seg rows are B batch entries of seg rows, and shard
    row r of chunk c is gathered / output row gathered_row(c, r, seg, world) (host: seg % BLOCK_M == 0, so
    every block and tile is whole and maps to one contiguous row block). Without REMAP, seg is unused."""
    ELT: tl.constexpr = a_ptr.dtype.element_ty
    # the host guarantees 16-byte multiples for every row and rank stride (and 16-byte aligned bases);
    # `(x // 8) * 8` tells the compiler so (a hint on an argument is lost), for 16-byte vector accesses
    a_rs = (a_rs // 8) * 8
    a_ld = (a_ld // 8) * 8
    K = (K // 8) * 8
    g_rs = (g_rs // 8) * 8
    n0 = (n0 // 8) * 8
    n1 = (n1 // 8) * 8
    n2 = (n2 // 8) * 8
    n3 = (n3 // 8) * 8
    b_rs0 = (b_rs0 // 8) * 8
    b_rs1 = (b_rs1 // 8) * 8
    b_rs2 = (b_rs2 // 8) * 8
    b_rs3 = (b_rs3 // 8) * 8
    o_rs0 = (o_rs0 // 8) * 8
    o_rs1 = (o_rs1 // 8) * 8
    o_rs2 = (o_rs2 // 8) * 8
    o_rs3 = (o_rs3 // 8) * 8
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
    my_a = a_ptr + rank64 * a_rs
    my_g = g_ptr + rank64 * g_rs
    my_staging = ws_ptr(my_base, data_off, ELT)
    nmb = tl.cdiv(m, BLOCK_M)
    k_tiles = tl.cdiv(K, BLOCK_K)
    m64 = m.to(tl.int64)
    # Descriptors built once per program. The local chunk is read from the shard itself (no wait); other chunks
    # from the gathered buffer as a whole: rows past a chunk's end (next chunk, maybe not pulled yet) only feed
    # output rows past that end, which are never stored.
    a_desc = tl.make_tensor_descriptor(my_a, shape=[m, K], strides=[a_ld.to(tl.int64), 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    g_desc = tl.make_tensor_descriptor(my_g, shape=[world * m, K], strides=[K.to(tl.int64), 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    b_once = weight_desc(w0 + rank64 * w_rs0, w_ld0.to(tl.int64), n0, K, B_TRANS, BLOCK_N, BLOCK_K)
    if C_ONCE and EPILOGUE_TMA:
        c_once = out_desc(o0 + rank64 * o_rs0, world * m, n0, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)

    if rank == straggle_rank:
        delay_ns(straggle_ns, USE_ASM)

    status = 0
    t = claim(ctrl)
    while (t < n_tasks) & (status == 0):
        kind = tl.load(stream + t * 4)
        x = tl.load(stream + t * 4 + 1)
        y = tl.load(stream + t * 4 + 2)
        z = tl.load(stream + t * 4 + 3)
        skip_signal = (rank == drop_rank) & (t == drop_task)
        if kind == 2:
            # ---- TILE (chunk x, m-block y, weight z >> 16, n-block z & 0xffff)
            c = x
            mb = y
            wi = z >> 16
            nb = z & 0xFFFF
            if c != rank:
                status = wait_flag(my_flags + c * nmb + mb, epoch, err, timeout_ns, "gpu", USE_ASM)
            if status == 0:
                n = pick(wi, n0.to(tl.int32), n1.to(tl.int32), n2.to(tl.int32), n3.to(tl.int32), NW)
                if NW == 1:
                    b_desc = b_once
                else:
                    w_base = pick(wi, w0 + rank64 * w_rs0, w1 + rank64 * w_rs1, w2 + rank64 * w_rs2,
                                  w3 + rank64 * w_rs3, NW)
                    w_stride = pick(wi, w_ld0.to(tl.int64), w_ld1.to(tl.int64), w_ld2.to(tl.int64),
                                    w_ld3.to(tl.int64), NW)
                    b_desc = weight_desc(w_base, w_stride, n, K, B_TRANS, BLOCK_N, BLOCK_K)
                if REMAP:
                    grow = gathered_row(c, mb * BLOCK_M, seg, world)  # the tile's first gathered/output row
                else:
                    grow = c * m + mb * BLOCK_M
                if c == rank:
                    src_desc = a_desc
                    src_row = mb * BLOCK_M
                else:
                    src_desc = g_desc
                    src_row = grow
                acc = gemm_tile(src_desc, b_desc, src_row, nb * BLOCK_N, k_tiles,
                                BLOCK_M, BLOCK_N, BLOCK_K, False, B_TRANS, DOT_PRECISION)
                has_b = pick(wi, has_b0, has_b1, has_b2, has_b3, NW)
                if has_b != 0:
                    b_base = pick(wi, b0 + rank64 * b_rs0, b1 + rank64 * b_rs1, b2 + rank64 * b_rs2,
                                  b3 + rank64 * b_rs3, NW)
                    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
                    bias = tl.load(b_base + offs_n, mask=offs_n < n, other=0.0)
                    acc = acc + bias.to(tl.float32)[None, :]
                if not EPILOGUE_TMA:
                    # plain stores: fire and forget (no wait for the TMA engine to drain the store buffer, which a
                    # claim loop cannot overlap with the next tile); rows clipped at the chunk's edge
                    o_base = pick(wi, o0 + rank64 * o_rs0, o1 + rank64 * o_rs1, o2 + rank64 * o_rs2,
                                  o3 + rank64 * o_rs3, NW)
                    if REMAP:  # a whole tile at its remapped rows (int32 offsets inside the tile)
                        o_base = o_base + grow.to(tl.int64) * n
                        orow = tl.arange(0, BLOCK_M)
                    else:
                        o_base = o_base + c.to(tl.int64) * m64 * n
                        orow = mb * BLOCK_M + tl.arange(0, BLOCK_M)
                    ocol = nb * BLOCK_N + tl.arange(0, BLOCK_N)
                    omask = (orow[:, None] < m) & (ocol[None, :] < n)
                    # int32 offsets inside the chunk (the host takes this path only when m * n < 2**31)
                    tl.store(o_base + (orow[:, None] * n + ocol[None, :]), acc.to(o0.dtype.element_ty), mask=omask)
                elif C_ONCE:
                    gemm_epilogue(acc, c_once, my_a, grow, nb * BLOCK_N, n, BLOCK_M, BLOCK_N,
                                  False, EPILOGUE_SUBTILE)
                elif REMAP:
                    o_base = pick(wi, o0 + rank64 * o_rs0, o1 + rank64 * o_rs1, o2 + rank64 * o_rs2,
                                  o3 + rank64 * o_rs3, NW)
                    c_desc = out_desc(o_base, world * m, n, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)
                    gemm_epilogue(acc, c_desc, my_a, grow, nb * BLOCK_N, n, BLOCK_M, BLOCK_N,
                                  False, EPILOGUE_SUBTILE)
                else:
                    o_base = pick(wi, o0 + rank64 * o_rs0, o1 + rank64 * o_rs1, o2 + rank64 * o_rs2,
                                  o3 + rank64 * o_rs3, NW)
                    c_desc = out_desc(o_base + c.to(tl.int64) * m64 * n, m, n, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)
                    gemm_epilogue(acc, c_desc, my_a, mb * BLOCK_M, nb * BLOCK_N, n, BLOCK_M, BLOCK_N,
                                  False, EPILOGUE_SUBTILE)
        elif kind == 1:
            # ---- PULL (source rank x, block y)
            q = x
            blk = y
            peer_base = tl.load(ws_row + q)
            peer_ctrl = peer_base.to(tl.pointer_type(tl.int32))
            status = wait_flag(peer_ctrl + flags_off + q * nmb + blk, epoch, err, timeout_ns, "sys", USE_ASM)
            if status == 0:
                r0 = blk * BLOCK_M
                nrows = tl.minimum(m - r0, BLOCK_M)
                src = ws_ptr(peer_base, data_off, ELT) + r0.to(tl.int64) * K
                if REMAP:
                    dst = my_g + gathered_row(q, r0, seg, world).to(tl.int64) * K
                else:
                    dst = my_g + (q.to(tl.int64) * m64 + r0) * K
                copy_rows(src, K, dst, K, dst, K, nrows, K, False, COPY_ROWS, COPY_COLS)
                if skip_signal == 0:
                    signal_flag(my_flags + q * nmb + blk, epoch, "gpu", USE_ASM)
        else:
            # ---- PUBLISH (kind 0) or LOCAL (kind 4) of block x
            blk = x
            r0 = blk * BLOCK_M
            nrows = tl.minimum(m - r0, BLOCK_M)
            src = my_a + r0.to(tl.int64) * a_ld
            if REMAP:
                dst_g = my_g + gathered_row(rank, r0, seg, world).to(tl.int64) * K
            else:
                dst_g = my_g + (rank64 * m64 + r0) * K
            if kind == 0:
                status = wait_peers_finished(ctrl, err, world, rank, epoch - 1, timeout_ns, USE_ASM)
                if status == 0:
                    dst_s = my_staging + r0.to(tl.int64) * K
                    copy_rows(src, a_ld, dst_s, K, dst_g, K, nrows, K, GATHER_LOCAL, COPY_ROWS, COPY_COLS)
                    if skip_signal == 0:
                        signal_flag(my_flags + rank * nmb + blk, epoch, "sys", USE_ASM)
            else:
                copy_rows(src, a_ld, dst_g, K, dst_g, K, nrows, K, False, COPY_ROWS, COPY_COLS)
        if status != 0:
            record_status(status, ctrl, err_host, ws_row, rank_base, world, OP_ID, rank, t)
        if status == 0:
            t = claim(ctrl)
    finish_call(ctrl, ws_row, rank, world, epoch)


# ----------------------------------------------------------------------------------------------------------
# host side


class _RankTensor:
    """A per-rank tensor as the kernel sees it: base tensor, rank stride (elements), row stride (elements)."""

    __slots__ = ("t", "rs", "ld")

    def __init__(self, t: torch.Tensor, rs: int, ld: int):
        self.t, self.rs, self.ld = t, rs, ld


def _weight_view(w: torch.Tensor) -> tuple[bool, int]:
    """(transposed, leading stride) of a [K, N] weight: row-major -> (False, stride(0)); w.t() of a
    row-major [N, K] -> (True, stride(1))."""
    if w.stride(-1) == 1 and (w.shape[-2] == 1 or w.stride(-2) >= w.shape[-1]):
        return False, w.stride(-2)
    if w.stride(-2) == 1 and (w.shape[-1] == 1 or w.stride(-1) >= w.shape[-2]):
        return True, w.stride(-1)
    raise ValueError(f"weight of shape {tuple(w.shape)} strides {tuple(w.stride())} is neither row-major nor a "
                     "transposed row-major view")


def _check8(name: str, *values: int) -> None:
    bad = [v for v in values if v % 8]
    if bad:
        raise ValueError(f"kosmos fused kernel: {name}: strides/sizes {bad} are not multiples of 8 elements")


def _pad4(items: list, fill):
    return list(items) + [fill] * (MAX_WEIGHTS - len(items))


REMAP_SMALL_BLOCK_M = 64


def remap_config(cfg: GemmConfig, seg: Optional[int], rows: int) -> Optional[GemmConfig]:
    """The tile config for a gather / scatter along a dim > 0 with `seg` rows per batch entry out of `rows`
    rows of a shard (AG) or of an owner's output (RS): the config itself when it needs no remap (seg None or
    seg == rows: one batch entry, the dim-0 layout) or when seg is a multiple of its BLOCK_M; else the same
    tile with BLOCK_M = 64 when seg is a multiple of 64; else None (reference path). The 64-row tile keeps
    the config's warps (sm_90 cubins compiled without a GPU: 8 warps spill no registers, 4 warps spill
    200-470 bytes per thread in both kernels)."""
    if seg is None or seg == rows:
        return cfg
    if seg <= 0 or rows % seg:
        return None
    if seg % cfg.block_m == 0:
        return cfg
    if cfg.block_m > REMAP_SMALL_BLOCK_M and seg % REMAP_SMALL_BLOCK_M == 0:
        return dataclasses.replace(cfg, block_m=REMAP_SMALL_BLOCK_M)
    return None


def ag_config(world: int, m: int, ns: Sequence[int], K: int, dtype, seg: Optional[int] = None) -> Optional[GemmConfig]:
    """The tile config `launch` uses (None: a remapped gather whose rows per batch entry fit no tile)."""
    return remap_config(select_config(world * m, max(ns), K, dtype), seg, m)


def launch(ws: runtime.Workspace, rank_base: int, a: _RankTensor, m: int, K: int, g: _RankTensor,
           weights: Sequence[_RankTensor], b_trans: bool, ns: Sequence[int], biases: Sequence[Optional[_RankTensor]],
           outs: Sequence[_RankTensor], *, programs: Optional[int] = None, lookahead: Optional[int] = None,
           straggler=None, drop_signal=None, epilogue: str = "tma", seg: Optional[int] = None,
           gather_local: bool = True) -> None:
    """Launches the fused kernel for the ranks of `ws` driven here (grid (programs, ws.n_local)).
    seg: rows per batch entry of a gather along a dim > 0 (m = B * seg; None or m: the dim-0 layout); it
    must be a multiple of the tile's BLOCK_M (128, or 64 with the smaller tile), else ValueError.
    gather_local=False: the caller does not want the gathered buffer, so the shard's own rows of it are
    not written (the pulled chunks are: the tiles read them from there)."""
    ws.check()
    device = a.t.device
    world, n_local = ws.world, ws.n_local
    dtype = a.t.dtype
    # the kernel tells the compiler these are multiples of 8 elements (16-byte vector copies)
    _check8("a", a.rs, a.ld, K, g.rs, *ns, *[b.rs for b in biases if b is not None], *[o.rs for o in outs])
    remap = seg is not None and seg != m
    cfg = ag_config(world, m, ns, K, dtype, seg)
    if cfg is None:
        raise ValueError(f"kosmos ag_gemm: rows per batch entry s={seg} (of m={m} shard rows) not a multiple of "
                         f"the tile ({select_config(world * m, max(ns), K, dtype).block_m} or "
                         f"{REMAP_SMALL_BLOCK_M} rows)")
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    nmb = triton.cdiv(m, BM)
    n_blocks = [triton.cdiv(n, BN) for n in ns]
    P = programs or runtime.default_programs(device, n_local)
    la = P if lookahead is None else lookahead
    ranks = [rank_base + i for i in range(n_local)]
    key = ("ag", world, tuple(ranks), nmb, tuple(n_blocks), la, cfg.group_m, gather_local)
    stream = runtime.cached_stream(
        key, lambda: [queue.ag_gemm_stream(r, world, nmb, n_blocks, la, cfg.group_m, gather_local) for r in ranks],
        device)
    n_tasks = stream.shape[1]
    ws.ensure(world * nmb, m * K * a.t.element_size())
    ws.describe("ag_gemm", f"staged local shard m*K*{a.t.element_size()} (m={m} K={K}) = "
                f"{m * K * a.t.element_size()} bytes per rank")
    interp = runtime.interpreting()
    if not interp:
        runtime.ensure_allocator()
    nw = len(weights)
    dummy_w = weights[0]
    w4 = _pad4(list(weights), dummy_w)
    n4 = _pad4(list(ns), ns[0])
    b4 = [b if b is not None else None for b in biases]
    b4 = _pad4(b4, None)
    o4 = _pad4(list(outs), outs[0])
    bias_args = [(b.t if b is not None else a.t) for b in b4]  # dummies share the bias dtype
    bias_rs = [(b.rs if b is not None else 0) for b in b4]
    has_b = [int(b is not None) for b in b4]
    s_rank, s_ns = straggler if straggler is not None else (-1, 0)
    d_rank, d_task = drop_signal if drop_signal is not None else (-1, -1)
    args = (stream, n_tasks, ws.table, ws.err_host.data_ptr(), rank_base, world,
            a.t, a.rs, a.ld, m, K, seg if remap else m,
            g.t, g.rs,
            *[w.t for w in w4], *[w.rs for w in w4], *[w.ld for w in w4],
            *n4,
            *bias_args, *bias_rs, *has_b,
            *[o.t for o in o4], *[o.rs for o in o4],
            runtime.FLAGS_OFF_WORDS, ws.layout.data_off,
            runtime.spin_timeout_ns(), s_rank, int(s_ns), d_rank, d_task)
    if epilogue not in ("tma", "store"):
        raise ValueError(f"epilogue must be 'tma' or 'store', got {epilogue!r}")
    if epilogue == "store" and m * max(ns) >= 2**31:
        epilogue = "tma"  # the plain-store epilogue indexes a chunk with int32 offsets
    meta = dict(NW=nw, B_TRANS=b_trans, C_ONCE=(nw == 1 and m % BM == 0), EPILOGUE_TMA=epilogue == "tma",
                BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, EPILOGUE_SUBTILE=cfg.epilogue_subtile, DOT_PRECISION="tf32",
                COPY_ROWS=COPY_ROWS, COPY_COLS=COPY_COLS, USE_ASM=not interp,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if remap:
        meta["REMAP"] = True  # the dim-0 launch stays exactly as it was (REMAP left at its default)
    if not gather_local:
        meta["GATHER_LOCAL"] = False
    grid = (P, n_local)
    runtime.check_grid_fits(ag_gemm_kernel, ("ag", dtype, outs[0].t.dtype, nw, b_trans, meta["C_ONCE"],
                                              meta["EPILOGUE_TMA"], cfg, remap, gather_local), grid, device, args,
                            meta)
    with ws.lock:
        ag_gemm_kernel[grid](*args, **meta, **runtime.COMPILE_OPTIONS)
    ws.after_launch()


def _check_simworld_inputs(world: int, a: torch.Tensor, weights, biases):
    if a.dim() != 3 or a.shape[0] != world:
        raise ValueError(f"SimWorld.ag_gemm: a must be [W={world}, m, K], got {tuple(a.shape)}")
    if a.stride(-1) != 1:
        raise ValueError("SimWorld.ag_gemm: a must have unit stride in K")
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"SimWorld.ag_gemm: 1..{MAX_WEIGHTS} weights, got {len(weights)}")
    for w in weights:
        if w.dim() != 3 or w.shape[0] != world or w.shape[1] != a.shape[2]:
            raise ValueError(f"SimWorld.ag_gemm: weights must be [W, K, N], got {tuple(w.shape)}")
    if biases is not None and len(biases) != len(weights):
        raise ValueError("SimWorld.ag_gemm: one bias (or None) per weight")


def _rows_of(t: torch.Tensor, rows: int, cols: int, what: str) -> torch.Tensor:
    """t [W, ...] as [W, rows, cols] without a copy (ValueError if its strides do not allow that)."""
    try:
        return t.view(t.shape[0], rows, cols)
    except RuntimeError as e:
        raise ValueError(f"{what} of shape {tuple(t.shape)} strides {tuple(t.stride())} does not view as "
                         f"[W, {rows}, {cols}] rows") from e


def ag_gemm_sim(world_obj, a, weights, biases=None, *, return_gathered=False, out_dtype=None, programs=None,
                straggler=None, drop_signal=None, lookahead=None, outs=None, gathered=None, epilogue="tma",
                gather_dim=0):
    """SimWorld entry: a [W, m, K], weights [W, K, N_i], biases [W, N_i] | None; outs / gathered: optional
    preallocated results (tests poison them).

    gather_dim > 0 (a dim of the per-rank shard): a is [W, *shard] with shard [d0, .., dn-2, K]; the ranks'
    shards are concatenated along that dim: B = prod(d0..dg-1) batch entries of s = prod(dg..dn-2) rows,
    remapped in the kernel (s must be a multiple of the tile, 128 or 64 rows, unless B == 1). Results are
    [W, *gathered shard dims[:-1], N_i]; outs / gathered may be given in that shape or as [W, W*m, N_i]."""
    W = world_obj.world
    if gather_dim == 0:
        return _ag_gemm_sim_rows(world_obj, a, weights, biases, return_gathered, out_dtype, programs, straggler,
                                 drop_signal, lookahead, outs, gathered, epilogue, None)
    if a.dim() < 3 or a.shape[0] != W or not 0 <= gather_dim < a.dim() - 2:
        raise ValueError(f"SimWorld.ag_gemm: gather_dim {gather_dim} must index a non-K dim of the shard "
                         f"{tuple(a.shape[1:])} (a is [W={W}, *shard])")
    lead = list(a.shape[1:-1])
    B, s_rows = queue.split_rows(lead, gather_dim)
    m, K = B * s_rows, a.shape[-1]
    glead = list(lead)
    glead[gather_dim] *= W
    a3 = _rows_of(a, m, K, "SimWorld.ag_gemm: a")
    if outs is not None:
        outs = [_rows_of(o, W * m, o.shape[-1], "SimWorld.ag_gemm: out") for o in outs]
    if gathered is not None:
        gathered = _rows_of(gathered, W * m, K, "SimWorld.ag_gemm: gathered")
    res = _ag_gemm_sim_rows(world_obj, a3, weights, biases, return_gathered, out_dtype, programs, straggler,
                            drop_signal, lookahead, outs, gathered, epilogue, s_rows if B > 1 else None)
    return [r.view(W, *glead, r.shape[-1]) for r in res]


def _ag_gemm_sim_rows(world_obj, a, weights, biases, return_gathered, out_dtype, programs, straggler, drop_signal,
                      lookahead, outs, gathered, epilogue, seg):
    """ag_gemm_sim on rows: a [W, m, K]; seg: rows per batch entry of a gather along a dim > 0 (None: dim 0)."""
    W = world_obj.world
    _check_simworld_inputs(W, a, weights, biases)
    _, m, K = a.shape
    biases = list(biases) if biases is not None else [None] * len(weights)
    trans = {_weight_view(w[0])[0] for w in weights}
    if len(trans) != 1:
        raise ValueError("SimWorld.ag_gemm: all weights must be row-major, or all transposed views")
    b_trans = trans.pop()
    out_dtype = out_dtype or a.dtype
    g = gathered if gathered is not None else torch.empty(W, W * m, K, device=a.device, dtype=a.dtype)
    if outs is None:
        outs = [torch.empty(W, W * m, w.shape[2], device=a.device, dtype=out_dtype) for w in weights]
    for o, w in zip(outs, weights):
        if tuple(o.shape) != (W, W * m, w.shape[2]) or o.stride(-1) != 1 or o.stride(1) != w.shape[2]:
            raise ValueError(f"SimWorld.ag_gemm: out must be contiguous rows [W, W*m, N], got {tuple(o.shape)}")
    if tuple(g.shape) != (W, W * m, K) or not g.is_contiguous():
        raise ValueError("SimWorld.ag_gemm: gathered must be a contiguous [W, W*m, K]")
    gather_local = return_gathered or gathered is not None  # a buffer given by the caller is filled whole
    launch(world_obj.workspace, 0, _RankTensor(a, a.stride(0), a.stride(1)), m, K,
           _RankTensor(g, g.stride(0), K),
           [_RankTensor(w, w.stride(0), _weight_view(w[0])[1]) for w in weights], b_trans,
           [w.shape[2] for w in weights],
           [(_RankTensor(b, b.stride(0), 1) if b is not None else None) for b in biases],
           [_RankTensor(o, o.stride(0), o.stride(1)) for o in outs],
           programs=programs, lookahead=lookahead, straggler=straggler, drop_signal=drop_signal, epilogue=epilogue,
           seg=seg, gather_local=gather_local)
    return outs + ([g] if return_gathered else [])


def ag_gemm_group(a: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
                  world: int, group_name: str, return_gathered: bool, out_dtype, *, ws=None, rank=None,
                  gather_dim: int = 0, programs=None, straggler=None, drop_signal=None):
    """Real process group entry (one rank per process); shapes/strides checked by fused_ops. gather_dim > 0:
    the shard's rows are B batch entries of s rows (queue.split_rows), remapped in the kernel.
    programs / straggler / drop_signal: test hooks, passed to `launch` as they are (the op passes none)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if ws is None:
        ws = runtime.group_workspace(group_name, a.device)
    if rank is None:
        rank = dist.get_rank(_resolve_process_group(group_name))
    K = a.shape[-1]
    lead = list(a.shape[:-1])
    B, s_rows = queue.split_rows(lead, gather_dim)
    a2 = a.reshape(-1, K)  # fused_ops checked that it views as rows (no copy)
    m = a2.shape[0]
    b_trans = _weight_view(weights[0])[0]
    out_dtype = out_dtype or a.dtype
    g = torch.empty(world * m, K, device=a.device, dtype=a.dtype)
    outs = [torch.empty(world * m, w.shape[1], device=a.device, dtype=out_dtype) for w in weights]
    launch(ws, rank, _RankTensor(a2, 0, a2.stride(0)), m, K, _RankTensor(g, 0, K),
           [_RankTensor(w, 0, _weight_view(w)[1]) for w in weights], b_trans, [w.shape[1] for w in weights],
           [(_RankTensor(b, 0, 1) if b is not None else None) for b in biases],
           [_RankTensor(o, 0, o.stride(0)) for o in outs], seg=s_rows if B > 1 else None, programs=programs,
           straggler=straggler, drop_signal=drop_signal, gather_local=return_gathered)
    glead = list(lead)
    glead[gather_dim] *= world
    res = [o.view(*glead, o.shape[-1]) for o in outs]
    if return_gathered:
        res.append(g.view(*glead, K))
    return res
