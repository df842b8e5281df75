"""Ragged-K grouped GEMM for sm_90 (Gluon) with B's block held in shared memory: the MoE weight gradients
out[e] = A_e^T @ B_e for groups of at most KMAX_BLOCKS K blocks.

grouped_wgrad_ws streams both operands for every output tile: 128 x 256 tiles of a few K blocks each pull
(128 + 256) * BLOCK_K elements a block from L2 for 2 * 128 * 256 * BLOCK_K FLOP, and at DeepSeek-V3's 129-257 rows
per expert that traffic, not the MMAs, sets the pace. Here a program takes a work item (group e, column block
off_n), loads B_e's whole [rows, BLOCK_N] block once (the group's rows are few: KMAX_BLOCKS * BLOCK_K at most),
and then runs every m-tile of out[e][:, off_n:] against it, so only A's [BLOCK_K, BLOCK_M] blocks stream through
the ring: per FLOP a 64 x 256 tile pulls a third of what a 128 x 256 tile of grouped_wgrad_ws pulls, a 128 x 128
tile two thirds. Groups with more K blocks are left to grouped_wgrad_ws (its skip_blocks), launched after this kernel.

The sums are those of grouped_wgrad_ws: each tile adds its group's K blocks in order, one wgmma chain, so the bits
are the same. A group's last K block reads into the next group's rows; the consumer zeroes those rows of A's block
each time and of B's resident block once (at the first m-tile), so nothing of the next group reaches the sum.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from kosmos.kernels.gemm_ws import _cta_barrier, _tma_load, _tma_store
from kosmos.kernels.grouped_wgrad_ws import _zero_rows_from


@gluon.jit
def _work_item(w, ends_ptr, num_pid_n, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """Work item w (group-major, then column blocks) -> (group, off_n, its rows [start, end), its K blocks)."""
    e = w // num_pid_n
    start = gl.load(ends_ptr + gl.maximum(e - 1, 0)) * (e > 0).to(gl.int32)
    end = gl.load(ends_ptr + e)
    return e, (w % num_pid_n) * BLOCK_N, start, end, gl.cdiv(gl.maximum(end - start, 0), BLOCK_K)


@gluon.jit
def _resident_producer(a_desc, b_desc, a_bufs, b_res, ready, empty, b_ready, b_empty, ends_ptr, E, M, N,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                       KMAX_BLOCKS: gl.constexpr):
    a_bytes: gl.constexpr = BLOCK_K * BLOCK_M * a_desc.dtype.primitive_bitwidth // 8
    b_bytes: gl.constexpr = BLOCK_K * BLOCK_N * b_desc.dtype.primitive_bitwidth // 8
    num_pid_n = gl.cdiv(N, BLOCK_N)
    it = 0
    item = 0  # the program's work items held so far: the parity of the resident block's barriers
    for w in range(gl.program_id(0), E * num_pid_n, gl.num_programs(0)):
        e, off_n, start, end, nk = _work_item(w, ends_ptr, num_pid_n, BLOCK_N, BLOCK_K)
        if nk <= KMAX_BLOCKS:
            mbarrier.wait(b_empty, (item & 1) ^ 1)  # the last item's MMAs are done with the resident block
            # every block's barrier completes once an item (a bare arrival past the group's blocks): expect takes
            # its byte count as a constant, and one phase for all keeps the consumer's parity the item's
            for blk in gl.static_range(KMAX_BLOCKS):
                mbarrier.expect(b_ready.index(blk), b_bytes, pred=blk < nk)
                _tma_load(b_desc, [start + blk * BLOCK_K, off_n], b_ready.index(blk), b_res.index(blk),
                          pred=blk < nk)
                mbarrier.arrive(b_ready.index(blk), pred=blk >= nk)
            for off_m in range(0, M, BLOCK_M):
                for kb in range(nk):
                    s = it % STAGES
                    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                    mbarrier.expect(ready.index(s), a_bytes)
                    _tma_load(a_desc, [start + kb * BLOCK_K, off_m], ready.index(s), a_bufs.index(s))
                    it += 1
            item += 1


@gluon.jit
def _resident_consumer(a_bufs, b_res, ready, empty, b_ready, b_empty, c_desc, c_smem, ends_ptr, E, M, N,
                       CONSUMER_WARPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       BLOCK_K: gl.constexpr, STAGES: gl.constexpr, KMAX_BLOCKS: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [CONSUMER_WARPS, 1], [1, 0])
    num_pid_n = gl.cdiv(N, BLOCK_N)
    it = 0
    item = 0
    for w in range(gl.program_id(0), E * num_pid_n, gl.num_programs(0)):
        e, off_n, start, end, nk = _work_item(w, ends_ptr, num_pid_n, BLOCK_N, BLOCK_K)
        if nk <= KMAX_BLOCKS:
            for blk in gl.static_range(KMAX_BLOCKS):
                mbarrier.wait(b_ready.index(blk), item & 1)
            for off_m in range(0, M, BLOCK_M):
                acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
                prev = 0
                for kb in range(nk):
                    k = start + kb * BLOCK_K
                    s = it % STAGES
                    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                    if k + BLOCK_K > end:  # rows [end, k + BLOCK_K) are the next group's (or TMA's zeros past S)
                        _zero_rows_from(a_bufs.index(s), end - k, rows_layout, BLOCK_K)
                        if off_m == 0:  # the resident block stays zeroed for the item's other m-tiles
                            _zero_rows_from(b_res.index(kb), end - k, rows_layout, BLOCK_K)
                        fence_async_shared()
                        _cta_barrier()  # every warp's zeros are in before the MMA reads them
                    acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_res.index(kb), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    mbarrier.arrive(empty.index(prev), pred=kb > 0)
                    prev = s
                    it += 1
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(prev), pred=nk > 0)
                tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
                c_smem.store(acc.to(c_desc.dtype))
                fence_async_shared()
                _tma_store(c_desc, [e * M + off_m, off_n], c_smem)
            mbarrier.arrive(b_empty)
            item += 1
    tma.store_wait(pendings=0)


@gluon.jit
def grouped_wgrad_resident_kernel(a_desc, b_desc, c_desc, ends_ptr, E, M, N,
                                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                                  STAGES: gl.constexpr, KMAX_BLOCKS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                  CONSUMER_WARPS: gl.constexpr):
    """out[e] = A_e^T @ B_e for every group of at most KMAX_BLOCKS K blocks (zeros for a group without rows; the
    others' tiles are not written); grid <= #SMs, num_warps = CONSUMER_WARPS (the consumer is the default
    partition, a one-warp producer the worker). Descriptors as grouped_wgrad_kernel's: a_desc over A [S, M] block
    [BLOCK_K, BLOCK_M], b_desc over B [S, N] block [BLOCK_K, BLOCK_N], c_desc over out as [E * M, N] block
    [BLOCK_M, BLOCK_N]; M a multiple of BLOCK_M."""
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_M], a_desc.layout)
    b_res = gl.allocate_shared_memory(dtype, [KMAX_BLOCKS, BLOCK_K, BLOCK_N], b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [KMAX_BLOCKS, 1], mbarrier.MBarrierLayout())
    b_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(KMAX_BLOCKS):
        mbarrier.init(b_ready.index(i), count=1)
    mbarrier.init(b_empty, count=1)
    gl.warp_specialize([
        (_resident_consumer, (a_bufs, b_res, ready, empty, b_ready, b_empty, c_desc, c_smem, ends_ptr, E, M, N,
                              CONSUMER_WARPS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, KMAX_BLOCKS)),
        (_resident_producer, (a_desc, b_desc, a_bufs, b_res, ready, empty, b_ready, b_empty, ends_ptr, E, M, N,
                              BLOCK_M, BLOCK_N, BLOCK_K, STAGES, KMAX_BLOCKS)),
    ], [1], [PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    for i in gl.static_range(KMAX_BLOCKS):
        mbarrier.invalidate(b_ready.index(i))
    mbarrier.invalidate(b_empty)
