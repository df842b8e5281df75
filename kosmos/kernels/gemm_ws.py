"""Warp-specialized persistent GEMM for sm_90 (Gluon): a TMA producer warp feeding wgmma consumer warps.

Why a second GEMM kernel: Triton's software pipeliner issues the TMA loads, the wgmma waits and the epilogue from
the same warps; here a producer warp fills a ring of shared-memory stages (ready / empty mbarriers) and never
stalls the MMA warps, which only wait on data. The MMA side is one consumer (NUM_CONSUMERS=1: 4 warps for 128x128
tiles, 8 for 128x256) or two 4-warp consumers in ping-pong (NUM_CONSUMERS=2) taking alternate tiles of the
program's static tile list, their K loops in turns so one consumer's epilogue runs beside the other's MMAs.
Measured on the H200 (benchmarks/RESULTS.md, eleventh session) the one-consumer kernels are the faster ones, and
gemm.plain_gemm_config picks between them. ROW_SPLIT (config ws256_2s, opt-in): two 4-warp consumers split every
128x256 tile's rows and release each stage on their own, without the CTA barrier over both warpgroups that the
8-warp consumer takes every K step; in the grouped GEMM (grouped_ws.py) that was 1.9-5.3% faster (thirty-sixth
session), here 1% at the median of one sweep (thirty-seventh).

C = A @ B (+ bias): A [M, K] row-major; B either [N, K] (a Linear weight, B_TRANS) or [K, N]; bf16 / fp16 in,
fp32 accumulate. Whole tiles come first (gemm.plan_gemm's dp_tiles); the ragged last wave (one consumer only) is
either cut in half tiles of BLOCK_M / 2 rows (HALF_TAIL: twice as many programs busy, no partial sums) or, with
STREAM_K, one stream of K blocks cut into equal ranges over every SM, as in gemm.stream_k_tail: fp32 partials,
summed in slot order by whichever contributor arrives last, nobody waits. Every output element's sum order is
fixed by the plan (made for the SM count, not the grid), so results do not depend on the grid. The host side
(descriptors, grid, availability on this triton) is in gemm_ws_host.py.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

# the CTA-wide barrier: gl.thread_barrier on triton 3.6, gl.barrier on 3.8 (torch 2.14's triton, which dropped
# gl.thread_barrier)
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
# the TMA copies: async_copy_global_to_shared / async_copy_shared_to_global up to triton 3.8, async_load / async_store
# from 3.9 (where the old names raise); the same arguments
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


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
def _sk_segment(it, it_end, k_tiles, num_dp_tiles, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """The piece of a stream-K range starting at K block `it` of the stream: (tile within the tail, k0, k1, pid_m,
    pid_n), for the producer and the consumer alike."""
    t = it // k_tiles
    k0 = it - t * k_tiles
    k1 = gl.minimum(k_tiles, k0 + (it_end - it))
    pid_m, pid_n = _tile_of(num_dp_tiles + t, num_pid_m, num_pid_n, GROUP_M)
    return t, k0, k1, pid_m, pid_n


@gluon.jit
def _load_k_range(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, k0, k1, it,
                  ROWS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  STAGES: gl.constexpr, B_TRANS: gl.constexpr, b_base):
    """Loads K blocks [k0, k1) of the ROWS x BLOCK_N tile at (off_m, off_n) into the ring from stage counter `it`
    on (A blocks of ROWS < BLOCK_M rows fill the first rows of a stage); returns the counter after. b_base: the
    first row of B's block in b_desc (a group's weight in grouped_ws.py; 0 here)."""
    nbytes: gl.constexpr = (ROWS + BLOCK_N) * BLOCK_K * a_desc.dtype.primitive_bitwidth // 8
    for ki in range(k0, k1):
        s = it % STAGES
        # a fresh barrier counts as released once: the first lap waits on the parity before phase 0
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        if ROWS == BLOCK_M:
            a_dst = a_bufs.index(s)
        else:
            a_dst = a_bufs.index(s).slice(0, ROWS)
        _tma_load(a_desc, [off_m, ki * BLOCK_K], ready.index(s), a_dst)
        _load_b_block(b_desc, b_bufs, ready, s, b_base, off_n, ki, BLOCK_K, B_TRANS)
        it += 1
    return it


@gluon.jit
def _load_b_block(b_desc, b_bufs, ready, s, b_base, off_n, ki, BLOCK_K: gl.constexpr, B_TRANS: gl.constexpr):
    """B's K block ki at column off_n (rows from b_base on in b_desc) into stage s, on its ready barrier."""
    if B_TRANS:
        _tma_load(b_desc, [b_base + off_n, ki * BLOCK_K], ready.index(s), b_bufs.index(s))
    else:
        _tma_load(b_desc, [b_base + ki * BLOCK_K, off_n], ready.index(s), b_bufs.index(s))


@gluon.jit
def _load_split_k_range(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, k_tiles, it,
                        NUM_CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        BLOCK_K: gl.constexpr, STAGES: gl.constexpr, B_TRANS: gl.constexpr, b_base):
    """_load_k_range for consumers that split the tile's rows (ROW_SPLIT here, grouped_ws's split consumers): K
    blocks [0, k_tiles), consumer c's rows of each into its own ring a_bufs[c] (the B block is shared); returns the
    stage counter after."""
    ROWS: gl.constexpr = BLOCK_M // NUM_CONSUMERS
    nbytes: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K * a_desc.dtype.primitive_bitwidth // 8
    for ki in range(0, k_tiles):
        s = it % STAGES
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        for c in gl.static_range(NUM_CONSUMERS):
            _tma_load(a_desc, [off_m + c * ROWS, ki * BLOCK_K], ready.index(s), a_bufs[c].index(s))
        _load_b_block(b_desc, b_bufs, ready, s, b_base, off_n, ki, BLOCK_K, B_TRANS)
        it += 1
    return it


@gluon.jit
def _producer(a_desc, a_half_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K,
              num_dp_tiles, num_sk_tiles, sk_iters, sk_workers,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, B_TRANS: gl.constexpr, STREAM_K: gl.constexpr, HALF_TAIL: gl.constexpr,
              ROW_SPLIT: gl.constexpr):
    """Loads every K block of this program's work, in the consumers' order, into the stage ring (waits for a
    stage's release): whole tiles, then its half tiles or stream-K ranges. ROW_SPLIT: a_bufs is the two
    consumers' A rings, each fed its half of a tile's rows."""
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    it = 0
    for tile_id in range(gl.program_id(0), num_dp_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M)
        if ROW_SPLIT:
            it = _load_split_k_range(a_desc, b_desc, a_bufs, b_bufs, ready, empty, pid_m * BLOCK_M,
                                     pid_n * BLOCK_N, k_tiles, it, 2, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, B_TRANS, 0)
        else:
            it = _load_k_range(a_desc, b_desc, a_bufs, b_bufs, ready, empty, pid_m * BLOCK_M, pid_n * BLOCK_N, 0,
                               k_tiles, it, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, B_TRANS, 0)
    if HALF_TAIL:
        for u in range(gl.program_id(0), 2 * (num_pid_m * num_pid_n - num_dp_tiles), gl.num_programs(0)):
            pid_m, pid_n = _tile_of(num_dp_tiles + u // 2, num_pid_m, num_pid_n, GROUP_M)
            it = _load_k_range(a_half_desc, b_desc, a_bufs, b_bufs, ready, empty,
                               pid_m * BLOCK_M + (u % 2) * (BLOCK_M // 2), pid_n * BLOCK_N, 0, k_tiles, it,
                               BLOCK_M // 2, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, B_TRANS, 0)
    if STREAM_K:
        total = num_sk_tiles * k_tiles
        for w in range(gl.program_id(0), sk_workers, gl.num_programs(0)):
            pos = w * sk_iters
            pos_end = gl.minimum(pos + sk_iters, total)
            while pos < pos_end:
                t, k0, k1, pid_m, pid_n = _sk_segment(pos, pos_end, k_tiles, num_dp_tiles, num_pid_m, num_pid_n,
                                                      GROUP_M)
                it = _load_k_range(a_desc, b_desc, a_bufs, b_bufs, ready, empty, pid_m * BLOCK_M, pid_n * BLOCK_N,
                                   k0, k1, it, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, B_TRANS, 0)
                pos += k1 - k0


@gluon.jit
def _mma_k_range(a_bufs, b_bufs, ready, empty, turn, k0, k1, it, acc_layout: gl.constexpr,
                 CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr, ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, B_TRANS: gl.constexpr):
    """fp32 sum over K blocks [k0, k1) of one ROWS x BLOCK_N tile, read from the ring from stage counter `it` on;
    every stage it read goes back to the producer. With two consumers the other one's turn starts once the last
    MMA is issued."""
    acc = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    prev = 0
    for ki in range(k0, k1):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        if B_TRANS:
            b = b_bufs.index(s).permute((1, 0))
        else:
            b = b_bufs.index(s)
        if ROWS == BLOCK_M:
            a = a_bufs.index(s)
        else:
            a = a_bufs.index(s).slice(0, ROWS)
        acc = warpgroup_mma(a, b, acc, is_async=True)
        # one MMA stays in flight; the one before it has retired, so its stage goes back to the producer
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index(prev), pred=ki > k0)
        prev = s
        it += 1
    if NUM_CONSUMERS == 2:
        mbarrier.arrive(turn.index(1 - CONSUMER))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index(prev))
    return acc, it


@gluon.jit
def _store_tile(acc, c_desc, c_smem, bias_ptr, off_m, off_n, N, acc_layout: gl.constexpr,
                BLOCK_N: gl.constexpr, HAS_BIAS: gl.constexpr):
    """C[off_m:, off_n:] = acc (+ bias), cast, TMA store through c_smem (TMA clips the ragged edges)."""
    if HAS_BIAS:
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        bias = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(gl.float32)[None, :]
    tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    _tma_store(c_desc, [off_m, off_n], c_smem)


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, turn, c_desc, c_half_desc, c_smems, bias_ptr, ws_ptr, cnt_ptr, M, N, K,
              num_dp_tiles, num_sk_tiles, sk_iters, sk_workers, sk_max_contrib,
              CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CONSUMER_WARPS: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, B_TRANS: gl.constexpr, HAS_BIAS: gl.constexpr, STREAM_K: gl.constexpr,
              HALF_TAIL: gl.constexpr):
    """MMAs and epilogue of the program's local whole tiles CONSUMER, CONSUMER + NUM_CONSUMERS, ..., then (one
    consumer only) its half tiles or stream-K ranges.

    With two consumers their K loops take turns (turn barriers): a consumer starts its K loop only once the other
    has waited on every stage of the tile before, so no consumer ever waits on a ready barrier more than one phase
    ahead of it (a parity wait cannot tell phase p from p + 2), and the tensor cores serve one K loop at a time
    while the other consumer runs its epilogue.

    A stream-K tile covered by several ranges: each contributor stores its fp32 partial in its slot of ws
    (tile * sk_max_contrib + j), and the one whose arrival completes the tile's counter sums the slots in order,
    stores the tile and sets the counter back to zero (the next call, or a graph replay, finds it zero).
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
    for tile_id in range(gl.program_id(0) + CONSUMER * nprog, num_dp_tiles, NUM_CONSUMERS * nprog):
        pid_m, pid_n = _tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M)
        if NUM_CONSUMERS == 2:
            if CONSUMER == 1:
                mbarrier.wait(turn.index(1), j & 1)
            else:
                mbarrier.wait(turn.index(0), (j + 1) & 1, pred=j > 0)
        acc, it = _mma_k_range(a_bufs, b_bufs, ready, empty, turn, 0, k_tiles, local * k_tiles, acc_layout,
                               CONSUMER, NUM_CONSUMERS, BLOCK_M, BLOCK_M, BLOCK_N, STAGES, B_TRANS)
        _store_tile(acc, c_desc, c_smem, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, N, acc_layout, BLOCK_N,
                    HAS_BIAS)
        local += NUM_CONSUMERS
        j += 1
    if HALF_TAIL:
        gl.static_assert(NUM_CONSUMERS == 1, "the half-tile tail runs with one consumer")
        gl.static_assert(BLOCK_M // 2 == 16 * CONSUMER_WARPS, "a half tile is one wgmma row block per warp")
        half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                              instr_shape=[16, BLOCK_N, 16])
        it = local * k_tiles
        for u in range(gl.program_id(0), 2 * (num_pid_m * num_pid_n - num_dp_tiles), nprog):
            pid_m, pid_n = _tile_of(num_dp_tiles + u // 2, num_pid_m, num_pid_n, GROUP_M)
            acc, it = _mma_k_range(a_bufs, b_bufs, ready, empty, turn, 0, k_tiles, it, half_layout,
                                   CONSUMER, NUM_CONSUMERS, BLOCK_M // 2, BLOCK_M, BLOCK_N, STAGES, B_TRANS)
            _store_tile(acc, c_half_desc, c_smem.slice(0, BLOCK_M // 2), bias_ptr,
                        pid_m * BLOCK_M + (u % 2) * (BLOCK_M // 2), pid_n * BLOCK_N, N, half_layout, BLOCK_N,
                        HAS_BIAS)
    if STREAM_K:
        gl.static_assert(NUM_CONSUMERS == 1, "the stream-K tail runs with one consumer")
        tile_elems: gl.constexpr = BLOCK_M * BLOCK_N
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        offs = rows[:, None] * BLOCK_N + cols[None, :]
        it = local * k_tiles
        total = num_sk_tiles * k_tiles
        for w in range(gl.program_id(0), sk_workers, nprog):
            pos = w * sk_iters
            pos_end = gl.minimum(pos + sk_iters, total)
            while pos < pos_end:
                t, k0, k1, pid_m, pid_n = _sk_segment(pos, pos_end, k_tiles, num_dp_tiles, num_pid_m, num_pid_n,
                                                      GROUP_M)
                acc, it = _mma_k_range(a_bufs, b_bufs, ready, empty, turn, k0, k1, it, acc_layout,
                                       CONSUMER, NUM_CONSUMERS, BLOCK_M, BLOCK_M, BLOCK_N, STAGES, B_TRANS)
                first_w = (t * k_tiles) // sk_iters
                n_contrib = ((t + 1) * k_tiles - 1) // sk_iters - first_w + 1
                if n_contrib == 1:
                    _store_tile(acc, c_desc, c_smem, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, N, acc_layout,
                                BLOCK_N, HAS_BIAS)
                else:
                    slot0 = (t * sk_max_contrib).to(gl.int64) * tile_elems
                    gl.store(ws_ptr + slot0 + (w - first_w) * tile_elems + offs, acc)
                    _cta_barrier()  # the consumer's whole partial is written before the one release below
                    arrived = gl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
                    if arrived == n_contrib - 1:
                        _cta_barrier()
                        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
                        for jc in range(n_contrib):
                            acc += gl.load(ws_ptr + slot0 + jc * tile_elems + offs, cache_modifier=".cg")
                        _store_tile(acc, c_desc, c_smem, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, N, acc_layout,
                                    BLOCK_N, HAS_BIAS)
                        gl.store(cnt_ptr + t, 0)  # every contributor has arrived: nobody reads it again this call
                pos += k1 - k0
    tma.store_wait(pendings=0)


@gluon.jit
def _row_consumer(a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem, bias_ptr, M, N, K, num_dp_tiles,
                  ROW0: gl.constexpr, CONSUMER_WARPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_TRANS: gl.constexpr,
                  HAS_BIAS: gl.constexpr):
    """ROW_SPLIT's consumer: rows [ROW0, ROW0 + BLOCK_M / 2) of every whole tile of the program, from its own ring
    a_bufs; it releases each stage itself (the empty barriers count both consumers)."""
    ROWS: gl.constexpr = BLOCK_M // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    it = 0
    for tile_id in range(gl.program_id(0), num_dp_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc, it = _mma_k_range(a_bufs, b_bufs, ready, empty, turn, 0, k_tiles, it, acc_layout, 0, 1, ROWS, ROWS,
                               BLOCK_N, STAGES, B_TRANS)
        _store_tile(acc, c_desc, c_smem, bias_ptr, pid_m * BLOCK_M + ROW0, pid_n * BLOCK_N, N, acc_layout, BLOCK_N,
                    HAS_BIAS)
    tma.store_wait(pendings=0)


@gluon.jit
def gemm_ws_kernel(a_desc, a_half_desc, b_desc, c_desc, c_half_desc, bias_ptr, ws_ptr, cnt_ptr, M, N, K,
                   num_dp_tiles, num_sk_tiles, sk_iters, sk_workers, sk_max_contrib,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr, B_TRANS: gl.constexpr, HAS_BIAS: gl.constexpr, STREAM_K: gl.constexpr,
                   HALF_TAIL: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                   PRODUCER_WARPS: gl.constexpr, CONSUMER_WARPS: gl.constexpr, ROW_SPLIT: gl.constexpr = False):
    """C = A @ B (+ bias); grid <= #SMs, num_warps = 4 (consumer 0; consumer 1 and the producer are workers).

    ROW_SPLIT (two 4-warp consumers, whole tiles only): the consumers take the upper and lower half of every tile's
    rows, each from its own ring of A blocks, and release each stage on their own, so no CTA barrier spans both
    warpgroups in the K loop (grouped_ws's split consumers); a_desc / c_desc blocks of BLOCK_M / 2 rows.

    a_desc block [BLOCK_M, BLOCK_K]; b_desc block [BLOCK_N, BLOCK_K] (B_TRANS) or [BLOCK_K, BLOCK_N]; c_desc block
    [BLOCK_M, BLOCK_N]; a_half_desc / c_half_desc: the same with BLOCK_M / 2 rows (HALF_TAIL). Ragged edges are
    TMA's (zero-filled loads, clipped stores). The schedule (whole tiles [0, num_dp_tiles), then the rest as
    half tiles or the stream-K tail) is gemm.plan_gemm's; ws / cnt: fp32 partial slots and zeroed int32 arrival
    counters of the stream-K tiles (unused without STREAM_K).
    """
    gl.static_assert(not (STREAM_K and HALF_TAIL), "one tail schedule per launch")
    dtype: gl.constexpr = a_desc.dtype
    if ROW_SPLIT:
        gl.static_assert(NUM_CONSUMERS == 2 and not STREAM_K and not HALF_TAIL, "row split: two consumers, no tail")
        a_rings = (gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M // 2, BLOCK_K], a_desc.layout),
                   gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M // 2, BLOCK_K], a_desc.layout))
        b_ring = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        c_halves = gl.allocate_shared_memory(dtype, [2, BLOCK_M // 2, BLOCK_N], c_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(free.index(i), count=2)
        gl.warp_specialize([  # (`full` stands in for the turns' barriers, which the split consumers do not use)
            (_row_consumer, (a_rings[0], b_ring, full, free, full, c_desc, c_halves.index(0), bias_ptr, M, N, K,
                             num_dp_tiles, 0, CONSUMER_WARPS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, B_TRANS,
                             HAS_BIAS)),
            (_row_consumer, (a_rings[1], b_ring, full, free, full, c_desc, c_halves.index(1), bias_ptr, M, N, K,
                             num_dp_tiles, BLOCK_M // 2, CONSUMER_WARPS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                             B_TRANS, HAS_BIAS)),
            (_producer, (a_desc, a_half_desc, b_desc, a_rings, b_ring, full, free, M, N, K, num_dp_tiles,
                         num_sk_tiles, sk_iters, sk_workers, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, B_TRANS,
                         STREAM_K, HALF_TAIL, ROW_SPLIT)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(full.index(i))
            mbarrier.invalidate(free.index(i))
    else:
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
                (_consumer, (a_bufs, b_bufs, ready, empty, turn, c_desc, c_half_desc, c_smems, bias_ptr, ws_ptr,
                              cnt_ptr, M, N, K, num_dp_tiles, num_sk_tiles, sk_iters, sk_workers, sk_max_contrib,
                              0, 2, 4, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, B_TRANS, HAS_BIAS, STREAM_K,
                              HALF_TAIL)),
                (_consumer, (a_bufs, b_bufs, ready, empty, turn, c_desc, c_half_desc, c_smems, bias_ptr, ws_ptr,
                              cnt_ptr, M, N, K, num_dp_tiles, num_sk_tiles, sk_iters, sk_workers, sk_max_contrib,
                              1, 2, 4, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, B_TRANS, HAS_BIAS, STREAM_K,
                              HALF_TAIL)),
                (_producer, (a_desc, a_half_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, num_dp_tiles,
                             num_sk_tiles, sk_iters, sk_workers, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, B_TRANS,
                             STREAM_K, HALF_TAIL, ROW_SPLIT)),
            ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (a_bufs, b_bufs, ready, empty, turn, c_desc, c_half_desc, c_smems, bias_ptr, ws_ptr,
                              cnt_ptr, M, N, K, num_dp_tiles, num_sk_tiles, sk_iters, sk_workers, sk_max_contrib,
                              0, 1, CONSUMER_WARPS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, B_TRANS, HAS_BIAS,
                              STREAM_K, HALF_TAIL)),
                (_producer, (a_desc, a_half_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, num_dp_tiles,
                             num_sk_tiles, sk_iters, sk_workers, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, B_TRANS,
                             STREAM_K, HALF_TAIL, ROW_SPLIT)),
            ], [PRODUCER_WARPS], [PRODUCER_REGS])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
        for i in gl.static_range(2):
            mbarrier.invalidate(turn.index(i))
