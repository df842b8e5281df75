"""The tile schedule of grouped_ws_kernel (Gluon, sm_90): the cursor over the row groups, a tile's place in its
group, the tiles a producer takes (its program's, or CLAIM's claims, whose ids it publishes to the consumers), and
SWIGLU's gate / up B blocks. Shared by grouped_ws.py's producer and consumers and grouped_ws_gather.py's producer,
so that every partition walks the same tiles."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from kosmos.kernels.gemm_ws import _tma_load


@gluon.jit
def _next_group(ends_ptr, E, mt, e, start, end, tile0, BLOCK_M: gl.constexpr):
    """Moves the cursor (group e, its rows [start, end), its first m-tile tile0) forward to the group holding m-tile
    mt; e == E once mt is past the last group's tiles."""
    while (e < E) & (tile0 + gl.cdiv(end - start, BLOCK_M) <= mt):
        tile0 += gl.cdiv(end - start, BLOCK_M)
        e += 1
        start = end
        end = gl.load(ends_ptr + gl.minimum(e, E - 1))
    return e, start, end, tile0


@gluon.jit
def _start_cursor(ends_ptr, zero):
    """The cursor at group 0, its first m-tile 0 (zero: a tensor 0, as loop-carried values must start)."""
    return zero, zero, gl.load(ends_ptr), zero


@gluon.jit
def _first_cursor(t, ends_ptr, E, num_pid_n, BLOCK_M: gl.constexpr):
    """The program's first tile t (its id, or its first claim) and the cursor at its group, with the stage counter
    at 0: where the producer and the consumer both start, so they walk the same tiles."""
    zero = t * 0
    e, start, end, tile0 = _start_cursor(ends_ptr, zero)
    e, start, end, tile0 = _next_group(ends_ptr, E, t // num_pid_n, e, start, end, tile0, BLOCK_M)
    return t, e, start, end, tile0, zero


@gluon.jit
def _tile_offsets(t, tile0, start, end, num_pid_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  M_FASTEST: gl.constexpr):
    """(row, column) of tile t in its group (whose tiles start at m-tile tile0 of the list): its m-tiles one after
    another for each column block (M_FASTEST: the programs at work share B's column blocks) or its column blocks one
    after another for each m-tile (they share A's rows)."""
    if M_FASTEST:
        m_tiles = gl.cdiv(end - start, BLOCK_M)
        local = t - tile0 * num_pid_n
        pid_m = local % m_tiles
        pid_n = local // m_tiles
    else:
        pid_m = t // num_pid_n - tile0
        pid_n = t % num_pid_n
    return start + pid_m * BLOCK_M, pid_n * BLOCK_N


@gluon.jit
def _producer_first_tile(claim_ptr, ends_ptr, E, num_pid_n, BLOCK_M: gl.constexpr, CLAIM: gl.constexpr):
    """A producer's first tile (its program id, or CLAIM's first claim) with the cursor at its group and the stage
    counter at 0 (_first_cursor's tuple)."""
    if CLAIM:
        first = gl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu")
    else:
        first = gl.program_id(0)
    return _first_cursor(first, ends_ptr, E, num_pid_n, BLOCK_M)


@gluon.jit
def _producer_next_tile(t, claim_ptr, ends_ptr, E, num_pid_n, e, start, end, tile0, BLOCK_M: gl.constexpr,
                        CLAIM: gl.constexpr):
    """A producer's tile after t (the next claim, or t + the program count) and the cursor moved to its group."""
    if CLAIM:
        t = gl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu")
    else:
        t += gl.num_programs(0)
    e, start, end, tile0 = _next_group(ends_ptr, E, t // num_pid_n, e, start, end, tile0, BLOCK_M)
    return t, e, start, end, tile0


@gluon.jit
def _publish(ids, empty, it, t, STAGES: gl.constexpr, WARPS: gl.constexpr):
    """Writes tile t into the id slot of stage `it`, once the stage is released (its last reader has read the slot
    too): the consumer reads it after the stage's ready barrier, whose arrival releases this store. WARPS: the
    producer's."""
    s = it % STAGES
    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
    ids.index(s).store(gl.full([1], t, gl.int32, layout=gl.BlockedLayout([1], [32], [WARPS], [0])))


@gluon.jit
def _load_swiglu_b_block(b_desc, b_bufs, ready, s, b_base, off_g, I, ki, BLOCK_K: gl.constexpr, HALF: gl.constexpr):
    """K block ki of gate rows [off_g, off_g + HALF) of the group's weight (from row b_base of b_desc) into the first
    half of B stage s, and of the same up rows (I further on) into its second, on its ready barrier."""
    _tma_load(b_desc, [b_base + off_g, ki * BLOCK_K], ready.index(s), b_bufs.index(s).slice(0, HALF))
    _tma_load(b_desc, [b_base + I + off_g, ki * BLOCK_K], ready.index(s), b_bufs.index(s).slice(HALF, HALF))
