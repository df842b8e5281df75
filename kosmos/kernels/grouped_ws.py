"""Ragged-M grouped GEMM for sm_90 (Gluon), on the warp-specialized GEMM core of gemm_ws.py.

C[rows of group e] = A[rows of group e] @ B[e] for consecutive row groups (group e: rows [ends[e-1], ends[e]),
ends int32 on the device, as torch._grouped_mm's offs): what the MoE backward's d_act / d_x and the reference
forward's expert GEMMs are. No host sync: each partition walks the groups with a cursor that only moves forward
(tiles are taken in increasing order, so a program reads each group's end once), the tile list ending where the
groups do. B is [E, K, N] with N contiguous (B_TRANS False: a weight used as stored, the backward's dgrad) or
[E, N, K] with K contiguous (B_TRANS True: a Linear-style weight, the forward). A group's last tile may run past
its rows into the next group's: its MMAs read those rows but its store is masked to the group (a whole tile goes
out by TMA). Rows past the last group are left unwritten.

Measured on the H200 against torch._grouped_mm (CUTLASS, 128x256x64 tiles as here; benchmarks/grouped_mm.py,
RESULTS.md thirty-first session): the same bits. With M_FASTEST (an expert's m-tiles next to each other, so its
weight, up to 59 MB, is read once for all its rows) DeepSeek-V3's four expert GEMMs at T = 4096 / 8192 / 16384 run
0.96-1.16x as fast as CUTLASS's (the twenty-second session had 0.89-0.99x at 16384). Qwen3-235B's run slower with it
than in the default order: their weights stay in L2 either way. So the MoE reference takes this kernel with
M_FASTEST for experts of moe_ops.WIDE_EXPERT elements or more (KOSMOS_GROUPED_MM). What an own grouped kernel could
add beyond CUTLASS (a gather or an epilogue fused into it) is not built.

CLAIM: programs take tiles from a zeroed int32 counter as their producers get to them, instead of tile t on
program t % programs. The static order lets 132 programs drift apart, so the m-tiles that share a weight's column
block stop running together and its blocks leave L2 between them: DeepSeek-V3's up GEMM at T = 16384 read 36.6 GB
from DRAM for 15 GB of weights (ncu, thirty-third session). Claimed, the tiles at work are always neighbours in the
order: 18.3 GB, and the four expert GEMMs 2.2-9% faster, ahead of CUTLASS's. The producer publishes each claimed
tile's id in a shared-memory slot of the tile's first stage before that stage's ready barrier (whose arrival
releases the store), and -1 with a bare arrival when the counter runs past the tiles.

NUM_CONSUMERS = 2 (config 128x256s): two 4-warp consumers take 64 rows of each tile each, from their own A rings, and
release each stage on their own (the empty barriers count both). With one 8-warp consumer a stage goes back by one
thread after a CTA barrier over both warpgroups, every K step; ncu put 38% of the up GEMM's warp stalls at CTA
barriers (thirty-third session). Split, the barrier spans one warpgroup, and the lower consumer skips its MMAs where
its rows are all past the group's end. With claimed tiles DeepSeek-V3's four expert GEMMs ran 1.9-5.3% faster at
257 and 513 rows per expert; in the static order at 129 rows, 4-26% slower (thirty-sixth session), so the MoE ops
split with claimed tiles only (gemm_ws_host.grouped_config). Half-height last tiles in one consumer (a [4, 2]
warp layout) were no faster with claimed tiles and up to 23% slower static: a tile's loads, not its MMAs, set its
time (results/grouped_half_tail_s36.patch.txt).

SWIGLU (the MoE reference forward's up projection, B = gate_up_proj^T, [E, H, 2I] K contiguous): a tile's BLOCK_N
columns are column block j (BLOCK_N / 2 wide) of the gate rows and the same block of the up rows, loaded into the
halves of each B stage, so one tile holds both factors of act[:, block j]. The epilogue writes both halves to their
places in h = [gate | up] (the backward reads them) and act = silu(gate) * up [S, I], computed from the rounded h
tile in shared memory with moe_rows.swiglu_rows' roundings. Needs I a multiple of BLOCK_N / 2.

GATHER (SWIGLU builds; the op's KOSMOS_GROUPED_GATHER=1): the up projection reads its rows straight from the hidden
states by the sorted pairs' token index, so the gathered copy is never made; its producer is in grouped_ws_gather.py,
with its figures. The tile schedule that every producer and consumer walks (group cursor, tile order, claims) is
grouped_ws_tiles.py.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from kosmos.kernels.gemm_ws import (_load_k_range, _load_split_k_range, _mma_k_range, _store_tile, _tma_load,
                                    _tma_store)
from kosmos.kernels.grouped_ws_gather import _gathered_producer
from kosmos.kernels.grouped_ws_tiles import (_first_cursor, _load_swiglu_b_block, _next_group, _producer_first_tile,
                                             _producer_next_tile, _publish, _start_cursor, _tile_offsets)


@gluon.jit
def _load_swiglu_k_range(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_g, b_base, I, k_tiles, it,
                         NUM_CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """_load_k_range / _load_split_k_range for a SWIGLU tile: each stage's B block is the gate rows [off_g,
    off_g + BLOCK_N / 2) of the group's weight (from row b_base of b_desc, whose blocks are half a stage) in its
    first half and the same up rows (I further on) in its second; returns the stage counter after."""
    ROWS: gl.constexpr = BLOCK_M // NUM_CONSUMERS
    HALF: gl.constexpr = BLOCK_N // 2
    nbytes: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K * a_desc.dtype.primitive_bitwidth // 8
    for ki in range(0, k_tiles):
        s = it % STAGES
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        if NUM_CONSUMERS == 1:
            _tma_load(a_desc, [off_m, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
        else:
            for c in gl.static_range(NUM_CONSUMERS):
                _tma_load(a_desc, [off_m + c * ROWS, ki * BLOCK_K], ready.index(s), a_bufs[c].index(s))
        _load_swiglu_b_block(b_desc, b_bufs, ready, s, b_base, off_g, I, ki, BLOCK_K, HALF)
        it += 1
    return it


@gluon.jit
def _grouped_producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, ids, claim_ptr, ends_ptr, E, N, K,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      B_TRANS: gl.constexpr, M_FASTEST: gl.constexpr, CLAIM: gl.constexpr,
                      NUM_CONSUMERS: gl.constexpr, SWIGLU: gl.constexpr):
    """Loads every K block of the program's tiles into the stage ring: t = pid, pid + nprog, ..., or (CLAIM) the
    tiles it takes from the claim counter, each one's id published with its first block, then an id of -1 with
    no block."""
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    t, e, start, end, tile0, it = _producer_first_tile(claim_ptr, ends_ptr, E, num_pid_n, BLOCK_M, CLAIM)
    while e < E:
        off_m, off_n = _tile_offsets(t, tile0, start, end, num_pid_n, BLOCK_M, BLOCK_N, M_FASTEST)
        b_base = e * (N if B_TRANS else K)
        if CLAIM:
            _publish(ids, empty, it, t, STAGES, 1)
        if SWIGLU:  # N = 2I: column block j of the plain tiles' numbering is gate / up block j
            it = _load_swiglu_k_range(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m,
                                      off_n // BLOCK_N * (BLOCK_N // 2), b_base, N // BLOCK_N * (BLOCK_N // 2),
                                      k_tiles, it, NUM_CONSUMERS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
        elif NUM_CONSUMERS == 1:
            it = _load_k_range(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, 0, k_tiles, it,
                               BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, B_TRANS, b_base)
        else:
            it = _load_split_k_range(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, k_tiles, it,
                                     NUM_CONSUMERS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, B_TRANS, b_base)
        t, e, start, end, tile0 = _producer_next_tile(t, claim_ptr, ends_ptr, E, num_pid_n, e, start, end, tile0,
                                                      BLOCK_M, CLAIM)
    if CLAIM:
        _publish(ids, empty, it, -1, STAGES, 1)
        mbarrier.arrive(ready.index(it % STAGES))


@gluon.jit
def _next_claimed(ids, ready, it, ends_ptr, E, num_pid_n, e, start, end, tile0, CONSUMER_WARPS: gl.constexpr,
                  BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """The tile id t the producer published with stage `it` and the cursor moved forward to it; e == E once t is
    -1 (no more tiles)."""
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    t = gl.max(ids.index(s).load(gl.BlockedLayout([1], [32], [CONSUMER_WARPS], [0])), axis=0)
    e, start, end, tile0 = _next_group(ends_ptr, E, gl.maximum(t, 0) // num_pid_n, e, start, end, tile0, BLOCK_M)
    return t, gl.where(t < 0, E, e), start, end, tile0


@gluon.jit
def _store_rows(acc, c_ptr, ldc, off_m, off_n, end, N, layout: gl.constexpr, ROWS: gl.constexpr,
                BLOCK_N: gl.constexpr):
    """C[off_m:, off_n:] = acc for the rows before `end` and the columns before N, from registers."""
    r = off_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    c = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    mask = (r < end)[:, None] & (c < N)[None, :]
    gl.store(c_ptr + r.to(gl.int64)[:, None] * ldc + c[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _silu_mul(gate, up):
    """silu(gate) * up of 16-bit gate / up, rounded to their dtype after the silu and after the product as
    moe_rows._act rounds it (torch's F.silu and mul on 16-bit tensors); fp32 out."""
    g = gate.to(gl.float32)
    silu = (g / (1.0 + gl.exp(-g))).to(gate.dtype).to(gl.float32)
    return (silu * up.to(gl.float32)).to(gate.dtype).to(gl.float32)


@gluon.jit
def _store_swiglu(acc, c_desc, c_smem, c_ptr, act_ptr, off_m, off_g, end, I, acc_layout: gl.constexpr,
                  ROWS: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr):
    """SWIGLU's epilogue of a tile [gate block | up block] at row off_m, column block off_g: h = C [S, 2I]
    (contiguous) gets the gate half at column off_g and the up half at I + off_g (by TMA where all ROWS rows are the
    group's, else by stores masked to rows before `end`), act [S, I] (contiguous) at off_g gets silu(gate) * up of
    the rounded halves, read back from c_smem 8 columns a thread, masked likewise. off_g and I: multiples of
    BLOCK_N / 2 by construction (what makes the stores 16-byte vectors)."""
    HALF: gl.constexpr = BLOCK_N // 2
    CHUNK: gl.constexpr = 64  # a 128-byte swizzle row of 16-bit elements
    gl.static_assert(HALF % CHUNK == 0, "whole 64-column chunks in each half")
    tma.store_wait(pendings=0)  # the previous tile's stores have read c_smem
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    whole = off_m + ROWS <= end
    if whole:
        _tma_store(c_desc, [off_m, off_g], c_smem.slice(0, HALF, dim=1))
        _tma_store(c_desc, [off_m, I + off_g], c_smem.slice(HALF, HALF, dim=1))
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // CHUNK, CHUNK // 8], [WARPS, 1], [1, 0])
    r = off_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    r64 = r.to(gl.int64)[:, None]
    mask = (r < end)[:, None]
    for c0 in gl.static_range(0, HALF, CHUNK):
        cols = off_g + c0 + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))
        gate = c_smem.slice(c0, CHUNK, dim=1).load(layout)
        up = c_smem.slice(HALF + c0, CHUNK, dim=1).load(layout)
        if not whole:
            gl.store(c_ptr + r64 * (2 * I) + cols[None, :], gate, mask=mask)
            gl.store(c_ptr + r64 * (2 * I) + I + cols[None, :], up, mask=mask)
        act = _silu_mul(gate, up)
        gl.store(act_ptr + r64 * I + cols[None, :], act.to(act_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _tile_rows(a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem, c_ptr, ldc, act_ptr, off_m, off_n, end, N, k_tiles,
               it, acc_layout: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
               B_TRANS: gl.constexpr, SWIGLU: gl.constexpr, WARPS: gl.constexpr):
    """ROWS rows of a tile from the ring's next k_tiles stages, stored: by TMA where they are all the group's, else
    masked to the group's rows (SWIGLU: _store_swiglu); returns the stage counter after."""
    acc, it = _mma_k_range(a_bufs, b_bufs, ready, empty, turn, 0, k_tiles, it, acc_layout, 0, 1, ROWS, ROWS,
                           BLOCK_N, STAGES, B_TRANS)
    if SWIGLU:  # (x // BLOCK_N * HALF, not x // 2: a product of HALF is what triton knows to be its multiple)
        _store_swiglu(acc, c_desc, c_smem, c_ptr, act_ptr, off_m, off_n // BLOCK_N * (BLOCK_N // 2), end,
                      N // BLOCK_N * (BLOCK_N // 2), acc_layout, ROWS, BLOCK_N, WARPS)
    elif off_m + ROWS <= end:
        _store_tile(acc, c_desc, c_smem, c_ptr, off_m, off_n, N, acc_layout, BLOCK_N, False)
    else:
        _store_rows(acc, c_ptr, ldc, off_m, off_n, end, N, acc_layout, ROWS, BLOCK_N)
    return it


@gluon.jit
def _release_k_range(ready, empty, k_tiles, it, STAGES: gl.constexpr):
    """Waits for and releases the next k_tiles stages without reading them (a consumer whose rows of the tile are
    all past its group's end)."""
    for ki in range(0, k_tiles):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        mbarrier.arrive(empty.index(s))
        it += 1
    return it


@gluon.jit
def _grouped_consumer(a_bufs, b_bufs, ready, empty, turn, ids, c_desc, c_smem, c_ptr, ldc, act_ptr, ends_ptr, E, N,
                      K, CONSUMER_WARPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_K: gl.constexpr, STAGES: gl.constexpr, B_TRANS: gl.constexpr, M_FASTEST: gl.constexpr,
                      CLAIM: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr, SWIGLU: gl.constexpr):
    """MMAs and epilogue of rows [ROW0, ROW0 + ROWS) of the program's tiles (all BLOCK_M of them with one consumer;
    a_bufs: its own ring of those rows' stages with several),
    in the producer's order (CLAIM: the ids it publishes): rows inside the group by TMA, a group's last rows by a
    store masked to the group. With several consumers, one whose rows are all past the group's end releases the
    tile's stages without its MMAs."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    if CLAIM:
        it = gl.program_id(0) * 0
        e, start, end, tile0 = _start_cursor(ends_ptr, it)
        t, e, start, end, tile0 = _next_claimed(ids, ready, it, ends_ptr, E, num_pid_n, e, start, end, tile0,
                                                CONSUMER_WARPS, BLOCK_M, STAGES)
    else:
        t, e, start, end, tile0, it = _first_cursor(gl.program_id(0), ends_ptr, E, num_pid_n, BLOCK_M)
    while e < E:
        off_m, off_n = _tile_offsets(t, tile0, start, end, num_pid_n, BLOCK_M, BLOCK_N, M_FASTEST)
        off_m += ROW0
        if ROWS < BLOCK_M:
            if off_m < end:
                it = _tile_rows(a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem, c_ptr, ldc, act_ptr, off_m, off_n,
                                end, N, k_tiles, it, acc_layout, ROWS, BLOCK_N, STAGES, B_TRANS, SWIGLU,
                                CONSUMER_WARPS)
            else:
                it = _release_k_range(ready, empty, k_tiles, it, STAGES)
        else:
            it = _tile_rows(a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem, c_ptr, ldc, act_ptr, off_m, off_n,
                            end, N, k_tiles, it, acc_layout, ROWS, BLOCK_N, STAGES, B_TRANS, SWIGLU, CONSUMER_WARPS)
        if CLAIM:
            t, e, start, end, tile0 = _next_claimed(ids, ready, it, ends_ptr, E, num_pid_n, e, start, end, tile0,
                                                    CONSUMER_WARPS, BLOCK_M, STAGES)
        else:
            t += gl.num_programs(0)
            e, start, end, tile0 = _next_group(ends_ptr, E, t // num_pid_n, e, start, end, tile0, BLOCK_M)
    tma.store_wait(pendings=0)


@gluon.jit
def _warp_specialize_gathered(a_bufs, b_bufs, c_smem, ready, empty, turn, ids, b_desc, c_desc, c_ptr, ldc, ends_ptr,
                              claim_ptr, E, N, K, act_ptr, src_ptr, idx_ptr, T_src, S, ld8, BLOCK_M: gl.constexpr,
                              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                              B_TRANS: gl.constexpr, M_FASTEST: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                              CONSUMER_WARPS: gl.constexpr, CLAIM: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, SWIGLU: gl.constexpr):
    """grouped_ws_kernel's partitions with GATHER: its consumers, and _gathered_producer on four warps."""
    gl.static_assert(SWIGLU, "GATHER: the SWIGLU builds (the forward's up projection) only")
    ROWS: gl.constexpr = BLOCK_M // NUM_CONSUMERS
    if NUM_CONSUMERS == 1:
        gl.warp_specialize([
            (_grouped_consumer, (a_bufs, b_bufs, ready, empty, turn, ids, c_desc, c_smem.index(0), c_ptr, ldc,
                                 act_ptr, ends_ptr, E, N, K, CONSUMER_WARPS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                                 B_TRANS, M_FASTEST, CLAIM, 0, ROWS, SWIGLU)),
            (_gathered_producer, (src_ptr, idx_ptr, T_src, S, ld8, b_desc, a_bufs, b_bufs, ready, empty, ids,
                                  claim_ptr, ends_ptr, E, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, M_FASTEST,
                                  CLAIM, NUM_CONSUMERS, 4)),
        ], [4], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_grouped_consumer, (a_bufs[0], b_bufs, ready, empty, turn, ids, c_desc, c_smem.index(0), c_ptr,
                                 ldc, act_ptr, ends_ptr, E, N, K, CONSUMER_WARPS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                                 B_TRANS, M_FASTEST, CLAIM, 0, ROWS, SWIGLU)),
            (_grouped_consumer, (a_bufs[1], b_bufs, ready, empty, turn, ids, c_desc, c_smem.index(1), c_ptr,
                                 ldc, act_ptr, ends_ptr, E, N, K, CONSUMER_WARPS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                                 B_TRANS, M_FASTEST, CLAIM, ROWS, ROWS, SWIGLU)),
            (_gathered_producer, (src_ptr, idx_ptr, T_src, S, ld8, b_desc, a_bufs, b_bufs, ready, empty, ids,
                                  claim_ptr, ends_ptr, E, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, M_FASTEST,
                                  CLAIM, NUM_CONSUMERS, 4)),
        ], [CONSUMER_WARPS, 4], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def grouped_ws_kernel(a_desc, b_desc, c_desc, c_ptr, ldc, ends_ptr, claim_ptr, E, N, K, act_ptr, src_ptr, idx_ptr,
                      T_src, S, ld8,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      B_TRANS: gl.constexpr, M_FASTEST: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                      CONSUMER_WARPS: gl.constexpr, CLAIM: gl.constexpr = False, NUM_CONSUMERS: gl.constexpr = 1,
                      CONSUMER_REGS: gl.constexpr = 0, SWIGLU: gl.constexpr = False, GATHER: gl.constexpr = False):
    """C = A @ B[group] per row group; grid <= #SMs, num_warps = CONSUMER_WARPS (the first consumer; a one-warp
    producer is a worker). a_desc [S, K] block [BLOCK_M // NUM_CONSUMERS, BLOCK_K]; b_desc over B as 2D, [E * K,
    N] block [BLOCK_K, BLOCK_N] or (B_TRANS) [E * N, K] block [BLOCK_N, BLOCK_K]; c_desc [S, N] block
    [BLOCK_M // NUM_CONSUMERS, BLOCK_N] (c_ptr, ldc: the same C for the masked stores); claim_ptr: CLAIM's counter,
    zero at launch.

    NUM_CONSUMERS = 2: two consumers of CONSUMER_WARPS warps (CONSUMER_REGS registers for the worker among them)
    split each tile's rows and release each stage on their own (the empty barriers count both), so no CTA
    barrier spans two warpgroups in the K loop. (Three such consumers of a 192-row tile would need 13 warps, which
    triton pads to 16: 128 registers a thread, too few for a wgmma of 64 x 256. ptxas builds every partition under
    that launch cap, setmaxnreg.inc notwithstanding: "Insufficient registers (128) ... register target of 154 or
    higher" (built on the CPU, forty-fourth session). Even a perfect split of the 64K registers over 512 threads
    leaves a consumer 160.)

    SWIGLU (B_TRANS, N = 2I, I a multiple of BLOCK_N / 2): C = h = [gate | up] and act [S, I] = silu(gate) * up at
    act_ptr, both contiguous; b_desc blocks of BLOCK_N / 2 rows, c_desc blocks of BLOCK_N / 2 columns. Without it
    act_ptr is unused (any pointer). Always pass SWIGLU and GATHER: a constexpr left out turns into a runtime
    argument.

    GATHER: A's row r is src[idx[r]]: src_ptr [T_src, K] with a row stride of 8 * ld8 elements, in a_desc's dtype
    (a_desc only gives the rows' dtype and shared layout then); idx_ptr int64 [S]; a zero row where r >= S or idx[r]
    is not in [0, T_src). A four-warp producer loads them with cp.async (_gathered_producer), so the gathered rows
    are never written out. Without it src_ptr / idx_ptr / T_src / S / ld8 are unused."""
    dtype: gl.constexpr = a_desc.dtype
    ROWS: gl.constexpr = BLOCK_M // NUM_CONSUMERS
    if NUM_CONSUMERS == 1:
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    else:  # a ring per consumer (a slice of one ring's rows: a shape triton 3.6 refuses with three stages)
        a_bufs = (gl.allocate_shared_memory(dtype, [STAGES, ROWS, BLOCK_K], a_desc.layout),
                  gl.allocate_shared_memory(dtype, [STAGES, ROWS, BLOCK_K], a_desc.layout))
    if SWIGLU:  # b_desc's blocks are half a stage: the gate rows' and the up rows'
        gl.static_assert(B_TRANS, "SWIGLU loads K-contiguous gate / up rows")
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    else:
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, ROWS, BLOCK_N], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # unused: no turns taken
    ids = gl.allocate_shared_memory(gl.int32, [STAGES, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # CLAIM's tile ids
    for i in gl.static_range(STAGES):
        if GATHER:  # B's bytes, and the gathered rows landed
            mbarrier.init(ready.index(i), count=2)
        else:
            mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NUM_CONSUMERS)
    # (the argument tuples stay literal: a tuple assigned to a name turns its constexprs into tensors)
    if GATHER:
        _warp_specialize_gathered(a_bufs, b_bufs, c_smem, ready, empty, turn, ids, b_desc, c_desc, c_ptr, ldc,
                                  ends_ptr, claim_ptr, E, N, K, act_ptr, src_ptr, idx_ptr, T_src, S, ld8, BLOCK_M,
                                  BLOCK_N, BLOCK_K, STAGES, B_TRANS, M_FASTEST, PRODUCER_REGS, CONSUMER_WARPS, CLAIM,
                                  NUM_CONSUMERS, CONSUMER_REGS, SWIGLU)
    elif NUM_CONSUMERS == 1:
        gl.warp_specialize([
            (_grouped_consumer, (a_bufs, b_bufs, ready, empty, turn, ids, c_desc, c_smem.index(0), c_ptr, ldc,
                                 act_ptr, ends_ptr, E, N, K, CONSUMER_WARPS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                                 B_TRANS, M_FASTEST, CLAIM, 0, ROWS, SWIGLU)),
            (_grouped_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, ids, claim_ptr, ends_ptr, E, N, K,
                                 BLOCK_M, BLOCK_N, BLOCK_K, STAGES, B_TRANS, M_FASTEST, CLAIM, NUM_CONSUMERS,
                                 SWIGLU)),
        ], [1], [PRODUCER_REGS])
    else:
        gl.static_assert(NUM_CONSUMERS == 2, "one consumer or two")
        gl.warp_specialize([
            (_grouped_consumer, (a_bufs[0], b_bufs, ready, empty, turn, ids, c_desc, c_smem.index(0), c_ptr,
                                 ldc, act_ptr, ends_ptr, E, N, K, CONSUMER_WARPS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                                 B_TRANS, M_FASTEST, CLAIM, 0, ROWS, SWIGLU)),
            (_grouped_consumer, (a_bufs[1], b_bufs, ready, empty, turn, ids, c_desc, c_smem.index(1), c_ptr,
                                 ldc, act_ptr, ends_ptr, E, N, K, CONSUMER_WARPS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                                 B_TRANS, M_FASTEST, CLAIM, ROWS, ROWS, SWIGLU)),
            (_grouped_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, ids, claim_ptr, ends_ptr, E, N, K,
                                 BLOCK_M, BLOCK_N, BLOCK_K, STAGES, B_TRANS, M_FASTEST, CLAIM, NUM_CONSUMERS,
                                 SWIGLU)),
        ], [CONSUMER_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
