"""Ragged-K grouped GEMM for sm_90 (Gluon): the MoE experts' weight gradients out[e] = A_e^T @ B_e.

A [S, M] and B [S, N] are row-major; group e is rows [ends[e-1], ends[e]) of both (ends int32 on the device, as
torch._grouped_mm's offs), out is [E, M, N]. Each output tile sums its group's rows in BLOCK_K blocks, in order,
so every run gives the same bits; a group without rows gets a zero tile. Rows are few per group (128 per expert for
DeepSeek-V3 at 4096 tokens) and the output large (its whole weight gradient), so a tile is a couple of MMAs
and one big store: the kernel is built to keep the stores going. A one-warp TMA producer runs ahead through the
ring of stages, across tile boundaries, while the consumer warps MMA one tile and TMA-store the one before.
A group's last block usually runs past its rows into the next group's: the consumer zeroes those rows of both
blocks in shared memory before its MMA, so nothing of the next group's rows (not even an inf) reaches the sum.

Measured on the H200 against torch._grouped_mm (CUTLASS), RESULTS.md thirtieth session: the same bits; on
DeepSeek-V3's gradients at 4096 / 8192 / 16384 tokens 6.21 / 9.29 / 14.53 ms against 6.50 / 9.26 / 14.52 (gate_up)
and 3.23 / 4.85 / 7.16 against 3.42 / 4.56 / 7.56 (down), where writing the gradients alone takes 4.44 and 2.26 ms.
With NUM_CONSUMERS = 2 (thirty-second session), two consumers take alternate tiles and their k-loops take turns,
so one's store runs under the other's MMAs: at 4096 / 8192 tokens (129 / 257 rows per expert) 6.53 / 9.59 ms
against 6.76 / 9.83 for the one-consumer 128x256 (gate_up), at 16384 slower (15.47 against 14.97).

The zeroing costs: without it (a probe, wrong where the next group's rows are not finite) DeepSeek-V3's gradients at
8192 tokens ran 6-10% faster on an H100, while dropping the stores changed nothing there (fifty-first session).
TAIL_BY_TMA (one consumer; gemm_ws_host.wgrad_tail: up to TAIL_TMA_MAX_ROWS rows per group, KOSMOS_WGRAD_TAIL):
the producer loads a tile's last K block through descriptors over the rows up to the group's end, built on the
device when the group changes, so TMA fills the rows past it with zeros and nothing is zeroed in shared memory; the
same bits. DeepSeek-V3's layer at 8192 tokens 4% faster fwd+bwd, at 16384 2.4% slower; Qwen3-235B's gate_up alone
slower (why is not measured; each use of a device-built descriptor starts with a proxy fence, and each change of
group builds two).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from kosmos.kernels.gemm_ws import _cta_barrier, _tma_load, _tma_store


@gluon.jit
def _tile_rows(t, ends_ptr, num_pid_n, per_group, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile t of the list (group-major, then m-tiles, then column blocks) -> (group, off_m, off_n, its rows
    [start, end))."""
    e = t // per_group
    local = t - e * per_group
    start = gl.load(ends_ptr + gl.maximum(e - 1, 0)) * (e > 0).to(gl.int32)
    end = gl.load(ends_ptr + e)
    return e, (local // num_pid_n) * BLOCK_M, (local % num_pid_n) * BLOCK_N, start, end


@gluon.jit
def _zero_rows_from(buf, first, layout: gl.constexpr, BLOCK_K: gl.constexpr):
    """Rows [first, BLOCK_K) of a [BLOCK_K, cols] shared-memory block set to zero (through registers)."""
    blk = buf.load(layout)
    rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    buf.store(gl.where((rows < first)[:, None], blk, gl.zeros_like(blk)))


@gluon.jit
def _wait_load_landed(ready, j, it, STAGES: gl.constexpr):
    """Waits until load j of the ring has landed, where it may not have: it is among the last STAGES of the `it`
    issued (an older one's stage has been refilled, so it landed; and its barrier's parity would be ambiguous)."""
    mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1, pred=(j >= 0) & (it - j <= STAGES))


@gluon.jit
def _group_descriptors(a_desc, b_desc, a_ptr, b_ptr, end, M, N, lda, ldb):
    """Device-built descriptors over A's and B's rows [0, end) with a_desc's / b_desc's blocks and layouts: TMA
    fills a block's rows past `end` (the group's) with zeros."""
    a_g = tma.make_tensor_descriptor(a_ptr, [end, M], [lda, 1], a_desc.block_type.shape, a_desc.layout)
    b_g = tma.make_tensor_descriptor(b_ptr, [end, N], [ldb, 1], b_desc.block_type.shape, b_desc.layout)
    return a_g, b_g


@gluon.jit
def _wgrad_producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, ends_ptr, E, M, N, a_ptr, b_ptr, lda, ldb,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                    TAIL_BY_TMA: gl.constexpr):
    """TAIL_BY_TMA: a tile's last K block is loaded through descriptors over the rows up to the group's end, built
    on the device at each change of group, so TMA fills the rows past it with zeros and the consumer zeroes
    nothing. Two pairs of descriptors take turns by group, and a pair is rebuilt only after the last load through it
    has landed, which is usually long before: the ring does not drain at a change of group."""
    nbytes: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K * a_desc.dtype.primitive_bitwidth // 8
    num_pid_n = gl.cdiv(N, BLOCK_N)
    per_group = (M // BLOCK_M) * num_pid_n
    it = 0
    group = -1
    slot = 1
    last0 = -1  # the ring index of the last load through each pair
    last1 = -1
    a_g0 = a_desc
    b_g0 = b_desc
    a_g1 = a_desc
    b_g1 = b_desc
    for t in range(gl.program_id(0), E * per_group, gl.num_programs(0)):
        e, off_m, off_n, start, end = _tile_rows(t, ends_ptr, num_pid_n, per_group, BLOCK_M, BLOCK_N)
        if TAIL_BY_TMA:
            if e != group and end > start:  # (a group without rows loads nothing)
                slot = 1 - slot
                # two call sites, so two scratch slots: a descriptor cannot be picked by a runtime index
                if slot == 0:
                    _wait_load_landed(ready, last0, it, STAGES)
                    a_g0, b_g0 = _group_descriptors(a_desc, b_desc, a_ptr, b_ptr, end, M, N, lda, ldb)
                else:
                    _wait_load_landed(ready, last1, it, STAGES)
                    a_g1, b_g1 = _group_descriptors(a_desc, b_desc, a_ptr, b_ptr, end, M, N, lda, ldb)
                group = e
        for k in range(start, end, BLOCK_K):
            s = it % STAGES
            # a fresh barrier counts as released once: the first lap waits on the parity before phase 0
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            if TAIL_BY_TMA and k + BLOCK_K > end:  # only the last block goes through the group's descriptors (each
                if slot == 0:                      # use of a device-built one starts with a proxy fence)
                    _tma_load(a_g0, [k, off_m], ready.index(s), a_bufs.index(s))
                    _tma_load(b_g0, [k, off_n], ready.index(s), b_bufs.index(s))
                    last0 = it
                else:
                    _tma_load(a_g1, [k, off_m], ready.index(s), a_bufs.index(s))
                    _tma_load(b_g1, [k, off_n], ready.index(s), b_bufs.index(s))
                    last1 = it
            else:
                _tma_load(a_desc, [k, off_m], ready.index(s), a_bufs.index(s))
                _tma_load(b_desc, [k, off_n], ready.index(s), b_bufs.index(s))
            it += 1


@gluon.jit
def _wgrad_consumer(a_bufs, b_bufs, ready, empty, turns, c_desc, c_smem, ends_ptr, E, M, N,
                    CONSUMER_WARPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    BLOCK_K: gl.constexpr, STAGES: gl.constexpr, CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                    TAIL_BY_TMA: gl.constexpr):
    """MMAs and stores every NUM_CONSUMERS-th tile of the program's list, from its CONSUMER-th; the ring's stages of
    the other consumer's tiles are counted past (the producer fills the ring in list order). With two consumers
    their k-loops take turns (turns: one mbarrier each, arrived on by the other when its k-loop is done), so one's
    epilogue runs under the other's MMAs. The turns are also what makes the ring's parity waits sound: a consumer
    that skipped ahead could otherwise wait on a stage two fills early and pass on the older phase."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [CONSUMER_WARPS, 1], [1, 0])
    num_pid_n = gl.cdiv(N, BLOCK_N)
    per_group = (M // BLOCK_M) * num_pid_n
    it = 0
    j = 0  # the tile's place in the program's list
    for t in range(gl.program_id(0), E * per_group, gl.num_programs(0)):
        e, off_m, off_n, start, end = _tile_rows(t, ends_ptr, num_pid_n, per_group, BLOCK_M, BLOCK_N)
        if j % NUM_CONSUMERS == CONSUMER:
            if NUM_CONSUMERS > 1:  # the other consumer's k-loop of tile j - 1 is done: the (j - 1)-th turn
                mbarrier.wait(turns.index(CONSUMER), ((j - 1) // 2) & 1, pred=j > 0)
            acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            prev = 0
            for k in range(start, end, BLOCK_K):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                # rows [end, k + BLOCK_K) are the next group's (or TMA's zeros past S)
                if not TAIL_BY_TMA and k + BLOCK_K > end:
                    # zeroed in both blocks: a zero row of one times an inf of the other would be a nan
                    _zero_rows_from(a_bufs.index(s), end - k, rows_layout, BLOCK_K)
                    _zero_rows_from(b_bufs.index(s), end - k, rows_layout, BLOCK_K)
                    fence_async_shared()
                    _cta_barrier()  # every warp's zeros are in before either warpgroup's MMA reads them
                acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, is_async=True)
                # one MMA stays in flight; the one before it has retired, so its stage goes back to the producer
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index(prev), pred=k > start)
                prev = s
                it += 1
            if NUM_CONSUMERS > 1:
                mbarrier.arrive(turns.index(1 - CONSUMER))
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(prev), pred=end > start)
            tma.store_wait(pendings=0)  # this consumer's previous store has read c_smem
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            _tma_store(c_desc, [e * M + off_m, off_n], c_smem)
        else:
            it += gl.cdiv(gl.maximum(end - start, 0), BLOCK_K)
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def grouped_wgrad_kernel(a_desc, b_desc, c_desc, ends_ptr, E, M, N, a_ptr, b_ptr, lda, ldb,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                         PRODUCER_REGS: gl.constexpr, CONSUMER_WARPS: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, TAIL_BY_TMA: gl.constexpr):
    """out[e] = A_e^T @ B_e for every group; grid <= #SMs, num_warps = CONSUMER_WARPS (the first consumer is the
    default partition; a one-warp producer and, with NUM_CONSUMERS = 2, a second consumer of CONSUMER_REGS registers
    a thread are the workers: the two take turns by tile, so one's epilogue runs under the other's MMAs). a_desc over
    A [S, M] block [BLOCK_K, BLOCK_M]; b_desc over B [S, N] block [BLOCK_K, BLOCK_N]; c_desc over out as [E * M, N]
    block [BLOCK_M, BLOCK_N]; M a multiple of BLOCK_M (a tile never reaches the next group's rows of out)."""
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_M], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
    c_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_M, BLOCK_N], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    # the partitions as literals: the jit cannot bind a tuple holding a function to a name
    if NUM_CONSUMERS == 1:
        gl.warp_specialize([  # (`ready` stands in for the turns' barriers, which one consumer does not use)
            (_wgrad_consumer, (a_bufs, b_bufs, ready, empty, ready, c_desc, c_bufs.index(0), ends_ptr, E, M, N,
                               CONSUMER_WARPS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 0, NUM_CONSUMERS, TAIL_BY_TMA)),
            (_wgrad_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, ends_ptr, E, M, N, a_ptr, b_ptr, lda,
                               ldb, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, TAIL_BY_TMA)),
        ], [1], [PRODUCER_REGS])
    else:
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(turns.index(0), count=1)
        mbarrier.init(turns.index(1), count=1)
        gl.warp_specialize([
            (_wgrad_consumer, (a_bufs, b_bufs, ready, empty, turns, c_desc, c_bufs.index(0), ends_ptr, E, M, N,
                               CONSUMER_WARPS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 0, NUM_CONSUMERS, TAIL_BY_TMA)),
            (_wgrad_consumer, (a_bufs, b_bufs, ready, empty, turns, c_desc, c_bufs.index(1), ends_ptr, E, M, N,
                               CONSUMER_WARPS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 1, NUM_CONSUMERS, TAIL_BY_TMA)),
            (_wgrad_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, ends_ptr, E, M, N, a_ptr, b_ptr, lda,
                               ldb, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, TAIL_BY_TMA)),
        ], [CONSUMER_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])
        mbarrier.invalidate(turns.index(0))
        mbarrier.invalidate(turns.index(1))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
