"""Producers of grouped_ws_kernel's GATHER builds (Gluon, sm_90): A's rows copied from the source rows by index
inside the launch (the MoE forward's up projection reads the hidden states by the sorted pairs' token index), so the
gathered [S, H] copy is never written.

A four-warp producer copies the rows with cp.async (zero rows for the pad rows); what it saves is
moe_rows.gather_rows' pass (0.348 ms of Qwen3-235B's T = 16384 forward, 0.608 of DeepSeek-V3's, fortieth session).
The same bits on the H200, but slower (forty-fourth session, T = 16384, up GEMM alone): 5.956 ms against 5.757 for
the gather kernel then the GEMM on the copy (Qwen3-235B), 14.670 against 13.689 (DeepSeek-V3); the cp.async rows cost
the GEMM more than the gather. So it is opt-in (KOSMOS_GROUPED_GATHER=1).

Not latency: an L2 prefetch of the rows 2-16 K blocks ahead of the copies kept the bits and made the up GEMM 2-9%
slower (H100, forty-ninth session; results/gather_prefetch_s49.patch.txt, whose variant that also prefetched the
next tile's first blocks was timed with a bug: it prefetched a wrong line every step).

One TMA copy of box [1, BLOCK_K] a row instead (two one-warp producers, each row through an 8-row view of the
swizzled stage) gave the right bits but ran the up GEMM at 239 TF/s instead of 633 (Qwen3-235B): an SM issues a
stage's 128 one-row copies in 1.4 us at best, against 0.19 us for one tile copy and ~0.85 us of GEMM per stage
(forty-eighth session, RESULTS.md; the code is in 2a21858's tree). Hopper's TMA has no multi-row gather.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier

from kosmos.kernels.gemm_ws import _cta_barrier
from kosmos.kernels.grouped_ws_tiles import (_load_swiglu_b_block, _producer_first_tile, _producer_next_tile, _publish,
                                             _tile_offsets)

# cp.async: async_copy_global_to_shared on triton 3.6 and 3.7, async_load from 3.8 (3.9 removed the old name); the same
# arguments
_cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.jit
def _gather_rows(idx_ptr, off_m, S, T_src, ld8, ROWS: gl.constexpr, layout: gl.constexpr):
    """(element offset of each row's source row in src, whether it has one) for rows [off_m, off_m + ROWS) of A:
    row r is src[idx[r]]; rows past S and indices that are not a row of src (the pad rows' sentinel T_src) have
    none (zero rows, as moe_rows.gather_rows has them). ld8: src's row stride in 16-byte units (written as a product
    of 8, so the copies' alignment is known)."""
    r = off_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    src_row = gl.load(idx_ptr + r, mask=r < S, other=T_src)
    return src_row.to(gl.int64) * ld8 * 8, (r < S) & (src_row >= 0) & (src_row < T_src)


@gluon.jit
def _gather_block(src_ptr, row_off, has_row, dst, ki, BLOCK_K: gl.constexpr, layout: gl.constexpr):
    """Starts the copies of K block ki of the gathered rows into dst (cp.async, 16 bytes a thread; rows without a
    source are zero-filled). K is a multiple of BLOCK_K (the launcher's check): no column mask."""
    cols = ki * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    mask = has_row[:, None] & (cols >= 0)[None, :]
    _cp_async_load(dst, src_ptr + row_off[:, None] + cols[None, :], mask=mask)


@gluon.jit
def _gathered_arrive(ready, it, pending: gl.constexpr, STAGES: gl.constexpr):
    """Once at most `pending` groups of this thread's copies are still in flight, makes the landed rows visible to
    the MMAs (proxy fence, then every producer thread past a barrier) and arrives on the ready barrier of stage
    it - pending (none where that is before stage 0)."""
    async_copy.wait_group(pending)
    fence_async_shared()
    _cta_barrier()
    mbarrier.arrive(ready.index((it - pending + STAGES) % STAGES), pred=it >= pending)


@gluon.jit
def _gathered_producer(src_ptr, idx_ptr, T_src, S, ld8, b_desc, a_bufs, b_bufs, ready, empty, ids, claim_ptr,
                       ends_ptr, E, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                       STAGES: gl.constexpr, M_FASTEST: gl.constexpr, CLAIM: gl.constexpr,
                       NUM_CONSUMERS: gl.constexpr, WARPS: gl.constexpr):
    """_grouped_producer of a SWIGLU build for A rows gathered from src by idx (GATHER): B's gate / up blocks by TMA
    as there, A by cp.async, so the gathered copy of the rows is never written. A stage's ready barrier counts two
    arrivals: B's expected bytes, and its A rows landed, which the partition reports one stage later, after issuing
    the next stage's copies (cp.async writes through the generic proxy: each thread waits for its own copies, fences
    them for the async proxy the wgmma reads through, and one thread arrives past a barrier of all). One stage, not
    more: the report of stage s comes after the wait for stage s + LAG's slot, which a consumer frees only once it
    has issued its MMAs on stage s + LAG + 1 - STAGES, so LAG <= STAGES - 2 or it waits on itself."""
    gl.static_assert(STAGES >= 3, "a stage being filled, one landing, one read")
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    ROWS: gl.constexpr = BLOCK_M // NUM_CONSUMERS
    HALF: gl.constexpr = BLOCK_N // 2
    LAG: gl.constexpr = 1
    b_bytes: gl.constexpr = BLOCK_N * BLOCK_K * b_desc.dtype.primitive_bitwidth // 8
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    t, e, start, end, tile0, it = _producer_first_tile(claim_ptr, ends_ptr, E, num_pid_n, BLOCK_M, CLAIM)
    while e < E:
        off_m, off_n = _tile_offsets(t, tile0, start, end, num_pid_n, BLOCK_M, BLOCK_N, M_FASTEST)
        b_base = e * N
        off_g = off_n // BLOCK_N * HALF
        if CLAIM:
            _publish(ids, empty, it, t, STAGES, WARPS)
        off0, has0 = _gather_rows(idx_ptr, off_m, S, T_src, ld8, ROWS, layout)
        if NUM_CONSUMERS == 2:
            off1, has1 = _gather_rows(idx_ptr, off_m + ROWS, S, T_src, ld8, ROWS, layout)
        for ki in range(0, k_tiles):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), b_bytes)
            _load_swiglu_b_block(b_desc, b_bufs, ready, s, b_base, off_g, N // BLOCK_N * HALF, ki, BLOCK_K, HALF)
            if NUM_CONSUMERS == 1:
                _gather_block(src_ptr, off0, has0, a_bufs.index(s), ki, BLOCK_K, layout)
            else:
                _gather_block(src_ptr, off0, has0, a_bufs[0].index(s), ki, BLOCK_K, layout)
                _gather_block(src_ptr, off1, has1, a_bufs[1].index(s), ki, BLOCK_K, layout)
            async_copy.commit_group()
            _gathered_arrive(ready, it, LAG, STAGES)
            it += 1
        t, e, start, end, tile0 = _producer_next_tile(t, claim_ptr, ends_ptr, E, num_pid_n, e, start, end, tile0,
                                                      BLOCK_M, CLAIM)
    _gathered_arrive(ready, it - 1, 0, STAGES)  # the last stage's rows
    if CLAIM:
        _publish(ids, empty, it, -1, STAGES, WARPS)
        mbarrier.arrive(ready.index(it % STAGES), count=2)
