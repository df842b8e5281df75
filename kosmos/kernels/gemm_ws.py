"""Warp-specialized persistent GEMM for sm_90 (Gluon): a TMA producer warp feeding wgmma consumer warps.

Why a second GEMM kernel: Triton's software pipeliner issues the TMA loads, the wgmma waits and the epilogue from
the same warps; here a producer warp fills a ring of shared-memory stages (ready / empty mbarriers) and never
stalls the MMA warps, which only wait on data. The MMA side is one consumer (NUM_CONSUMERS=1: 4 warps for 128x128
tiles, 8 for 128x256) or two 4-warp consumers in ping-pong (NUM_CONSUMERS=2) taking alternate tiles of the
program's static tile list, their K loops in turns so one consumer's epilogue runs beside the other's MMAs.
Measured on the H200 (benchmarks/RESULTS.md, eleventh session) the one-consumer kernels are the faster ones, and
gemm.plain_gemm_config picks between them.

C = A @ B (+ bias): A [M, K] row-major; B either [N, K] (a Linear weight, B_TRANS) or [K, N]; bf16 / fp16 in,
fp32 accumulate. Each output tile is computed by one consumer in a fixed K order, so results do not depend on the
grid. The host side (descriptors, grid, availability on this triton) is in gemm_ws_host.py.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """Tile index -> (pid_m, pid_n) in the grouped order of gemm.tile_coords (GROUP_M rows of tiles share A in L2).
    A copy, not a call: a Gluon kernel cannot call a @triton.jit function."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = gl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, B_TRANS: gl.constexpr):
    """Loads every K block of this program's tiles, in order, into the stage ring (waits for a stage's release)."""
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    nbytes: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K * a_desc.dtype.primitive_bitwidth // 8
    it = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M)
        for ki in range(k_tiles):
            s = it % STAGES
            # a fresh barrier counts as released once: the first lap waits on the parity before phase 0
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [pid_m * BLOCK_M, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
            if B_TRANS:
                tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, ki * BLOCK_K], ready.index(s),
                                                b_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(b_desc, [ki * BLOCK_K, pid_n * BLOCK_N], ready.index(s),
                                                b_bufs.index(s))
            it += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, turn, c_desc, c_smems, bias_ptr, M, N, K,
              CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CONSUMER_WARPS: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, B_TRANS: gl.constexpr, HAS_BIAS: gl.constexpr):
    """MMAs and epilogue of the program's local tiles CONSUMER, CONSUMER + NUM_CONSUMERS, ...

    With two consumers their K loops take turns (turn barriers): a consumer starts its K loop only once the other
    has waited on every stage of the tile before, so no consumer ever waits on a ready barrier more than one phase
    ahead of it (a parity wait cannot tell phase p from p + 2), and the tensor cores serve one K loop at a time
    while the other consumer runs its epilogue.
    """
    c_smem = c_smems.index(CONSUMER)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    nprog = gl.num_programs(0)
    local = CONSUMER
    j = 0
    for tile_id in range(gl.program_id(0) + CONSUMER * nprog, num_pid_m * num_pid_n, NUM_CONSUMERS * nprog):
        pid_m, pid_n = _tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M)
        if NUM_CONSUMERS == 2:
            if CONSUMER == 1:
                mbarrier.wait(turn.index(1), j & 1)
            else:
                mbarrier.wait(turn.index(0), (j + 1) & 1, pred=j > 0)
        it = local * k_tiles
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        prev = 0
        for ki in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            if B_TRANS:
                b = b_bufs.index(s).permute((1, 0))
            else:
                b = b_bufs.index(s)
            acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
            # one MMA stays in flight; the one before it has retired, so its stage goes back to the producer
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index(prev), pred=ki > 0)
            prev = s
            it += 1
        if NUM_CONSUMERS == 2:
            mbarrier.arrive(turn.index(1 - CONSUMER))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(prev))
        if HAS_BIAS:
            offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            bias = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc = acc + bias.to(gl.float32)[None, :]
        tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], c_smem)
        local += NUM_CONSUMERS
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def gemm_ws_kernel(a_desc, b_desc, c_desc, bias_ptr, M, N, K,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr, B_TRANS: gl.constexpr, HAS_BIAS: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                   PRODUCER_WARPS: gl.constexpr, CONSUMER_WARPS: gl.constexpr):
    """C = A @ B (+ bias); grid <= #SMs, num_warps = 4 (consumer 0; consumer 1 and the producer are workers).

    a_desc block [BLOCK_M, BLOCK_K]; b_desc block [BLOCK_N, BLOCK_K] (B_TRANS) or [BLOCK_K, BLOCK_N]; c_desc block
    [BLOCK_M, BLOCK_N]. Ragged edges are TMA's (zero-filled loads, clipped stores).
    """
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smems = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_M, BLOCK_N], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    # (the argument tuples stay literal: a tuple assigned to a name turns its constexprs into tensors)
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, turn, c_desc, c_smems, bias_ptr, M, N, K, 0, 2, 4,
                          BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, B_TRANS, HAS_BIAS)),
            (_consumer, (a_bufs, b_bufs, ready, empty, turn, c_desc, c_smems, bias_ptr, M, N, K, 1, 2, 4,
                          BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, B_TRANS, HAS_BIAS)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                         STAGES, B_TRANS)),
        ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, turn, c_desc, c_smems, bias_ptr, M, N, K, 0, 1, CONSUMER_WARPS,
                          BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, B_TRANS, HAS_BIAS)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                         STAGES, B_TRANS)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))
