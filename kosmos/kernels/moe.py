"""Fused forward of `kosmos::moe_layer` without expert parallelism: router -> top-k -> experts -> fold in ONE
persistent, self-scheduling launch (`moe_forward`). Semantics: exactly the reference `route` + `experts` of
kosmos.ops.moe: softmax or sigmoid scoring, optional router_bias and score_correction_bias, group-limited top-k
(n_group a power of two / topk_group), renormalisation (+1e-20 for sigmoid), routed_scaling_factor, router_dtype,
weights rounded to the logits dtype (or kept in fp32: weights_dtype, Mixtral's router), with the reference's
intermediate roundings emulated (sigmoid scores and their sums in the logits dtype).
kosmos.kernels.moe_ops.why_not_moe_layer refuses the rest with a reason.

Task stream (programs claim task indices from ONE atomic counter in device memory; a task's kind follows from
arithmetic on its index; every producer precedes its consumers, so a wait is always on a task some running
program has already claimed):

    ([RGEMM x n_rg]) [ROUTE x n_tiles] [SCAN] [SCATTER x n_tiles] [UP x max_blocks*n_iblk] [DOWN/FOLD of G groups]

    DOWN/FOLD (TaskLayout; G = MoeConfig.fold_groups): the H columns split into G groups of hb_per
    column chunks of BN; group g's DOWN tasks (max_blocks*hb_per) and FOLD tasks (n_tiles) are laid out as
    [D0] [D1] [F0] [D2] [F1] ... [D(G-1)] [F(G-2)] [F(G-1)]: the fold of group g is claimed while group g+1's
    DOWN tiles run, so its memory traffic overlaps tensor-core work (with G = 1: [D0] [F0]).

Each kind waits for EVERY task of the kind before it (one phase counter per kind: rgemmed, routed, scanned,
scattered, upped; downed per column group, and FOLD of group g waits for group g's DOWN tasks only). A program checks
a phase counter once, before its first task of the next kind (its later tasks of that kind skip the wait), and adds
its finished tasks to a counter in one release add when it claims a task of another kind or runs out of tasks (so
it never waits holding unpublished work). Measured on the H200 (benchmarks/moe_trace.py, RESULTS.md eighth session):
with a wait and a release per task (DOWN waited for its block's UP tiles only), the waits took 4-7% of the SM-time
of the UP and DOWN phases (about 1.5 us a task), more than the phase barrier costs at the UP -> DOWN transition (SMs
done early idle for part of an UP tile).

- RGEMM(block of RBM tokens x RBN experts; MoeConfig.router_gemm, by default where the router is an fp32 GEMM on bf16
  hidden states: DeepSeek-V3's): the router logits of the block into the logits buffer (moe_route.router_gemm_tile:
  three bf16 dots per K block of the weight pre-split into bf16 parts, split_router_weight, through TMA). ROUTE
  then waits for every RGEMM task and selects from the stored logits instead of running the router GEMM itself.
- ROUTE(tile of BT tokens): router GEMM (moe_route.router_logits: tl.dot over H, logits rounded to router_dtype, +
  router_bias; an fp32 router on 16-bit hidden states as two TF32 dots of the weight's split), softmax
  in fp32 or sigmoid, selection values (+ correction bias, group mask), top-k by repeated max (lowest expert id
  wins a tie), renorm / scaling, weights rounded to the logits dtype (not with W_F32); stores ids, weights and
  each pair's rank among the tile's pairs of the same expert (token order), and the tile's per-expert pair counts
  as one row of the count matrix [n_tiles, E] (computed in registers from the selection mask, plain stores: no
  atomics, nothing to zero).
- SCAN (one task): waits routed == n_tiles; per-expert totals (tokens_per_expert), the expert-major start of
  each expert's rows, each expert's first row block, and, overwriting the count matrix in place, the base row
  of every (tile, expert): expert_start[e] + pairs of e in earlier tiles. So pair (t, j) with expert e of tile
  i has the FIXED row base[i, e] + rank(t, j) in the expert-sorted order (experts ascending, tokens ascending
  inside an expert) whatever the grid and timing.
- SCATTER(tile): waits scanned; copies each pair's token row, cast to gate_up_proj's dtype W, to its sorted row
  of x_sorted [T*k, H] (so an expert's rows are contiguous: the UP tiles read them through TMA); with save_up also
  zeroes the pad rows of saved_up of the experts e = tile (mod n_tiles) (every expert's, empty ones included).
  (The publishing add's proxy fence makes x_sorted visible to the TMA reads.) With MoeConfig.gather_up it writes
  only perm[sorted row] = token (T*k int32 instead of T*k*H elements; no x_sorted at all), and the UP tiles load
  their rows from hidden through perm (cp.async), casting to W there.
- UP(block b, I-chunk ib): waits scattered == n_tiles; block b is the b-th BM-row block of the expert-sorted rows
  (blocks never straddle experts: expert e owns ceil(count_e / BM) blocks); blocks past the real number exit.
  Gate and up GEMMs of x_sorted rows row0 .. row0+BM-1 against gate_up_proj[e] (TMA descriptors over x_sorted and
  gate_up_proj viewed [E*2I, H]; rows from the expert's end on belong to the next expert or read as zeros past
  T*k, and are never stored), SwiGLU with the reference's roundings (gate/up rounded to W, silu rounded, product
  rounded, cast to down_proj's dtype), masked store into act [T*k, I] (sorted rows); with save_up, gate / up
  rounded to W into saved_up row (sorted row + e + 1).
- DOWN(block b, H-chunk nb of group g): waits upped == max_blocks*n_iblk (chunks past n_hblk: no-ops); y rows = act
  rows @ down_proj[e].T (the GEMM core's gemm_tile: TMA descriptors over act [T*k, I] and down_proj viewed [E*H, I],
  fp32 accumulation over I), cast to down_proj's dtype, masked store into y [T*k, H]. (Tasks of blocks past the real
  number count as done too.)
- FOLD(tile, group g): waits downed[g] == max_blocks*hb_per; for g's columns, out[t] = sum over j = 0..k-1 IN ORDER of
  (y[row(t, j)] * w[t, j]) rounded to promote(down dtype, logits dtype), summed in fp32, rounded to that dtype,
  cast to hidden's dtype.

max_blocks = (T*k + min(E, T*k) * (BM - 1)) // BM bounds sum_e ceil(count_e / BM) for ANY routing, so the task
count (and every host scalar) depends only on shapes: no host sync, no .tolist(); the launch is capturable in a
CUDA graph.

Determinism: rows are placed by the scan, never by an atomic; every output element is computed by exactly one
task with a fixed reduction order (K loops in order, the fold in j order). Which program runs a task does not
change any arithmetic, so two runs are bit-identical whatever the number of programs.

Counters and CUDA graphs: the claim counter, the phase counters (routed, scanned, scattered, upped; downed per
column group, after the head) and an error word live in one per-device int32 control tensor (`_Control`), zeroed
when it is allocated. We chose "zero at the end of the launch by the last program" over epochs: the counters'
targets change with the shape, which would break epoch arithmetic on a shared workspace. Every program counts itself
out (acq_rel atomic) after its last access; the one that arrives last zeroes all counters, so the next launch on the
stream (or the next replay of a captured graph) starts from zero, with no reset kernel and no per-call host scalar.
The control tensor only grows (a new, zeroed tensor) outside graph capture. Launches that share the control tensor
must be stream-ordered (one stream per device).

Spins (kosmos.kernels.signals.wait_flag) are bounded in wall time (runtime.spin_timeout_s); past the bound a
program records an error word (code, op, task) in the control tensor and in a host-mapped mirror and stops
claiming; every other waiting program sees the error word and gives up. The host raises runtime.KernelTimeout at
the next call (at once with KOSMOS_DEBUG_SYNC=1), and the control tensor is then unusable (WorkspaceBroken).

Module layout: routing pieces (ROUTE, SCAN, pair rows) in kosmos.kernels.moe_route; the gate (why_not / run /
register; env KOSMOS_FUSED_MOE picks the fused directions) in kosmos.kernels.moe_ops.

Workspaces per call (torch allocator, so a captured graph gets fixed addresses): with RGEMM tasks the logits [T, E]
(when they are not returned) and the router weight's bf16 parts [3, E, H]; ids / weights / ranks [T, k],
counts [n_tiles, E], meta [3E], x_sorted [T*k, H] in gate_up_proj's dtype (the gathered token rows: what HF's
grouped_mm path materialises too; 1 GiB at T=16384, k=8, H=4096 in bf16), act [T*k, I] and y [T*k, H] in
down_proj's dtype. With save_up the output saved_up [T*k + E, 2I] in gate_up_proj's dtype (moe_forward).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kosmos.kernels import launch_plan, moe_ops, runtime
from kosmos.kernels.gemm import gemm_tile, input_precision
from kosmos.kernels.moe_route import (pair_rows, pick, route_tile, router_gemm_tile, router_gemm_tile_tma,
                                      scan_counts, select_stored_tile)
from kosmos.kernels.signals import ERR_TIMEOUT, now_ns, proxy_fence, record_local_error, wait_flag

OP_ID = tl.constexpr(3)  # runtime.OP_IDS gets "moe_layer": 3

# int32 words of the control tensor
C_CLAIM = tl.constexpr(0)
C_DONE = tl.constexpr(1)
C_ROUTED = tl.constexpr(2)
C_SCANNED = tl.constexpr(3)
C_SCATTERED = tl.constexpr(4)
C_RGEMMED = tl.constexpr(5)
C_UPPED = tl.constexpr(6)
C_ERR = tl.constexpr(8)  # code, op, task
CTRL_HEAD = 16
C_DOWNED0 = tl.constexpr(CTRL_HEAD)  # the DOWN tasks' counters, one per column group, follow the head
MAX_FOLD_GROUPS = tl.constexpr(16)


# ----------------------------------------------------------------------------------------------------------
# jit pieces


@triton.jit
def _publish(ptr, count, USE_ASM: tl.constexpr):
    """Adds `count` finished tasks to a phase counter, publishing this program's prior writes (generic and, for
    TMA readers, async proxy): one release add."""
    proxy_fence(USE_ASM)
    tl.debug_barrier()
    tl.atomic_add(ptr, count, sem="release", scope="gpu")


@triton.jit
def _signal(ptr, USE_ASM: tl.constexpr):
    """_publish of one task."""
    _publish(ptr, 1, USE_ASM)


@triton.jit
def _task_kind(t, scan_task, scatter0, up0, down0, n_down, n_tiles, G: tl.constexpr):
    """-> (kind: 0 ROUTE, 1 SCAN, 2 SCATTER, 3 UP, 4 DOWN, 5 FOLD; column group; index among the group's tasks of
    that kind). TaskLayout.kind_of is the same arithmetic on the host."""
    early = (t >= scan_task).to(tl.int32) + (t >= scatter0).to(tl.int32) + (t >= up0).to(tl.int32)
    # past D0: pairs [D(q+1)] [F(q)] for q < G - 1, then the last group's folds
    r = tl.maximum(t - down0 - n_down, 0)
    q = tl.minimum(r // (n_down + n_tiles), G - 1)
    rem = r - q * (n_down + n_tiles)
    in_d0 = t < down0 + n_down
    fold = (q == G - 1) | (rem >= n_down)
    kind = tl.where(t < down0, early, tl.where(in_d0 | ~fold, 4, 5))
    grp = tl.where(in_d0, 0, tl.where(fold, q, q + 1))
    idx = tl.where(t < up0, t - tl.where(t < scan_task, 0, tl.where(t < scatter0, scan_task, scatter0)),
                   tl.where(t < down0, t - up0, tl.where(in_d0, t - down0,
                                                    tl.where(fold & (q < G - 1), rem - n_down, rem))))
    return kind, grp, idx


@triton.jit
def _block_chunk(idx, n_blocks, n_chunks, G: tl.constexpr):
    """UP / DOWN task idx of a phase over n_blocks row blocks x n_chunks weight chunks, G blocks at a time and chunk
    by chunk inside (MoeConfig.group_blocks > 1) -> (block, chunk). (The G = 1 order, block by block, is written
    inline in the kernel.)"""
    first = idx // (G * n_chunks) * G
    rows = tl.minimum(n_blocks - first, G)  # the last group may be short
    local = idx - first * n_chunks
    c = local // rows
    return first + local - c * rows, c


@triton.jit
def _phase_counter(kind, grp):
    """The control word counting finished tasks of `kind` (ROUTE .. DOWN, RGEMM) and column group (DOWN); -1 for
    FOLD."""
    return tl.where(kind == 0, C_ROUTED, tl.where(kind == 1, C_SCANNED, tl.where(
        kind == 2, C_SCATTERED, tl.where(kind == 3, C_UPPED, tl.where(kind == 4, C_DOWNED0 + grp,
                                                                       tl.where(kind == 6, C_RGEMMED, -1))))))


@triton.jit
def _phase_tasks(kind, n_tiles, n_up):
    """How many tasks of `kind` (ROUTE .. UP) the stream has."""
    return tl.where((kind == 0) | (kind == 2), n_tiles, tl.where(kind == 1, 1, n_up))


@triton.jit
def _block_rows(b, meta, E, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """Row block b of the expert-sorted rows -> (valid, expert, first row, end row of the expert)."""
    cols_e = tl.arange(0, BLOCK_E)
    emask = cols_e < E
    bend = tl.load(meta + 2 * E + cols_e, mask=emask, other=0, cache_modifier=".cg")
    nblocks = tl.max(bend, axis=0)
    valid = b < nblocks
    e = tl.sum(tl.where(emask & (bend <= b), 1, 0), axis=0)
    e = tl.minimum(e, E - 1)
    start = tl.load(meta + e, cache_modifier=".cg")
    cnt = tl.load(meta + E + e, cache_modifier=".cg")
    e_bend = tl.load(meta + 2 * E + e, cache_modifier=".cg")
    first_block = e_bend - (cnt + BM - 1) // BM
    row0 = start + (b - first_block) * BM
    return valid, e, row0, start + cnt


@triton.jit
def _gather_rows(rows, pos, hidden, h_ld, x_sorted, T, H, TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
                 BH: tl.constexpr):
    """x_sorted[row(t, j)] = hidden[t] cast to x_sorted's dtype, for every pair of a token tile: the UP tiles' A
    operand, contiguous per expert so that they load it through TMA."""
    XD: tl.constexpr = x_sorted.dtype.element_ty
    colk = tl.arange(0, KP)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    for h0 in range(0, H, BH):
        hs = h0 + tl.arange(0, BH)
        m = rmask[:, None] & (hs < H)[None, :]
        x = tl.load(hidden + rows64[:, None] * h_ld + hs[None, :], mask=m, other=0.0).to(XD)
        for j in tl.static_range(TOP_K):
            pj = pick(pos, colk, j).to(tl.int64)
            tl.store(x_sorted + pj[:, None] * H + hs[None, :], x, mask=m)


@triton.jit
def _zero_pad_rows(tile, n_tiles, meta, saved_up, E, I, BH: tl.constexpr):
    """Zeroes the pad rows of saved_up (row expert_start[e] + e leads expert e's group) of the experts
    e = tile (mod n_tiles): the SCATTER tasks share the E pad rows, empty experts' included."""
    zeros = tl.zeros((BH,), dtype=saved_up.dtype.element_ty)
    for e0 in range(0, E, n_tiles):
        e = e0 + tile
        if e < E:
            row = (tl.load(meta + e, cache_modifier=".cg") + e).to(tl.int64)
            for c0 in range(0, 2 * I, BH):
                cs = c0 + tl.arange(0, BH)
                tl.store(saved_up + row * (2 * I) + cs, zeros, mask=cs < 2 * I)


@triton.jit
def _scatter_tile(tile, n_tiles, ids_ptr, rank_ptr, counts, meta, hidden, h_ld, x_sorted, saved_up, perm, T, H, I, E,
                  TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, SAVE_UP: tl.constexpr,
                  GATHER_UP: tl.constexpr):
    """x_sorted's rows of the tile's pairs, or with GATHER_UP (MoeConfig.gather_up) only perm[row] = token."""
    rows, m2, offs, pos = pair_rows(tile, ids_ptr, rank_ptr, counts, T, E, TOP_K, KP, BT)
    if GATHER_UP:
        tl.store(perm + pos, rows[:, None] + 0 * pos, mask=m2)
    else:
        _gather_rows(rows, pos, hidden, h_ld, x_sorted, T, H, TOP_K, KP, BT, BH)
    if SAVE_UP:
        _zero_pad_rows(tile, n_tiles, meta, saved_up, E, I, BH)


@triton.jit
def _up_epilogue(acc_g, acc_u, row0, row_end, e, ib, act, saved_up, I, W: tl.constexpr, BM: tl.constexpr,
                 BI: tl.constexpr, SAVE_UP: tl.constexpr):
    """SwiGLU of one UP tile's accumulators (rows row0 .. row0+BM-1, those from row_end on not stored) with the
    reference's roundings into act, and with SAVE_UP gate / up into saved_up."""
    gate_w = acc_g.to(W)
    up_w = acc_u.to(W)
    rows = row0 + tl.arange(0, BM)
    cols = ib * BI + tl.arange(0, BI)
    m = (rows < row_end)[:, None] & (cols < I)[None, :]
    if SAVE_UP:  # expert e's rows sit past the pad rows of experts 0..e
        saved = saved_up + (rows + e + 1).to(tl.int64)[:, None] * (2 * I) + cols[None, :]
        tl.store(saved, gate_w, mask=m)
        tl.store(saved + I, up_w, mask=m)
    gate = gate_w.to(tl.float32)
    up = up_w.to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(W).to(tl.float32)
    a = (silu * up).to(W).to(act.dtype.element_ty)
    tl.store(act + rows.to(tl.int64)[:, None] * I + cols[None, :], a, mask=m)


@triton.jit
def _x_gathered(a_rows, k0, H, BK: tl.constexpr, XD: tl.constexpr):
    """The UP tile's [BM, BK] block of x at K offset k0 with GATHER_UP: loaded from the token rows a_rows ([BM, 1]
    pointers into hidden) and cast to XD (gate_up_proj's dtype, as the SCATTER tasks cast x_sorted). (The TMA load
    of the default stays inline in _up_rows: behind a helper's constexpr branch ptxas spilled more.)"""
    ks = k0 + tl.arange(0, BK)
    return tl.load(a_rows + ks[None, :], mask=(ks < H)[None, :], other=0.0).to(XD)


@triton.jit
def _up_rows(row0, row_end, e, ib, x_desc, gu_desc, act, saved_up, H, I,
             BM: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, UP_PRECISION: tl.constexpr,
             SAVE_UP: tl.constexpr, JOINT_GU: tl.constexpr = False, hidden=None, h_ld=0, perm=None, n_rows=0,
             GATHER_UP: tl.constexpr = False):
    """Gate and up GEMMs of BM sorted rows from row0 against expert e's I chunk ib, then _up_epilogue. Rows from
    row_end on (the next expert's, or past the end: zeros) are computed and never stored. gu_desc: blocks [BI, BK]
    over gate_up_proj viewed [E*2I, H]; with JOINT_GU (MoeConfig.joint_gate_up) blocks [1, 2, BI, BK] over it viewed
    [E, 2, I, H]: the gate and up blocks in one [2*BI, BK] operand, so ONE dot of width 2*BI computes both (wgmma
    64x256 instead of two 64x128 that each read the x block from shared memory). GATHER_UP: the x rows come from
    hidden through perm (sorted row -> token; n_rows = T*k rows, those past it read token 0), not from x_sorted."""
    XD: tl.constexpr = gu_desc.dtype
    a_rows = hidden
    if GATHER_UP:
        rows = row0 + tl.arange(0, BM)
        tok = tl.load(perm + rows, mask=rows < n_rows, other=0)
        a_rows = hidden + tok.to(tl.int64)[:, None] * h_ld
    if JOINT_GU:
        acc = tl.zeros((BM, 2 * BI), dtype=tl.float32)
        for k0 in range(0, H, BK):
            if GATHER_UP:
                x = _x_gathered(a_rows, k0, H, BK, XD)
            else:
                x = x_desc.load([row0, k0])
            w = tl.reshape(gu_desc.load([e, 0, ib * BI, k0]), (2 * BI, BK))
            acc = tl.dot(x, w.T, acc, input_precision=UP_PRECISION)
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BI)), (0, 2, 1)))
    else:
        g_row = e * 2 * I + ib * BI
        u_row = g_row + I
        acc_g = tl.zeros((BM, BI), dtype=tl.float32)
        acc_u = tl.zeros((BM, BI), dtype=tl.float32)
        for k0 in range(0, H, BK):
            if GATHER_UP:
                x = _x_gathered(a_rows, k0, H, BK, XD)
            else:
                x = x_desc.load([row0, k0])
            g = gu_desc.load([g_row, k0])
            u = gu_desc.load([u_row, k0])
            acc_g = tl.dot(x, g.T, acc_g, input_precision=UP_PRECISION)
            acc_u = tl.dot(x, u.T, acc_u, input_precision=UP_PRECISION)
    _up_epilogue(acc_g, acc_u, row0, row_end, e, ib, act, saved_up, I, gu_desc.dtype, BM, BI, SAVE_UP)


@triton.jit
def _up_tile(b, ib, meta, x_desc, gu_desc, act, saved_up, hidden, h_ld, perm, n_rows, H, I, E,
             BM: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
             UP_PRECISION: tl.constexpr, SAVE_UP: tl.constexpr, JOINT_GU: tl.constexpr, GATHER_UP: tl.constexpr):
    """UP task of row block b and I chunk ib."""
    valid, e, row0, row_end = _block_rows(b, meta, E, BM, BLOCK_E)
    if valid:
        _up_rows(row0, row_end, e, ib, x_desc, gu_desc, act, saved_up, H, I, BM, BI, BK, UP_PRECISION, SAVE_UP,
                 JOINT_GU, hidden, h_ld, perm, n_rows, GATHER_UP)


@triton.jit
def _down_store(acc, row0, row_end, nb, y, H, BM: tl.constexpr, BN: tl.constexpr):
    rows = row0 + tl.arange(0, BM)
    cols = nb * BN + tl.arange(0, BN)
    tl.store(y + rows.to(tl.int64)[:, None] * H + cols[None, :], acc.to(y.dtype.element_ty),
             mask=(rows < row_end)[:, None] & (cols < H)[None, :])


@triton.jit
def _down_tile(b, nb, meta, act_desc, down_desc, y, H, I, E,
               BM: tl.constexpr, BN: tl.constexpr, BK2: tl.constexpr, BLOCK_E: tl.constexpr,
               DOWN_PRECISION: tl.constexpr):
    """DOWN task of row block b and H chunk nb."""
    valid, e, row0, row_end = _block_rows(b, meta, E, BM, BLOCK_E)
    if valid & (nb * BN < H):
        acc = gemm_tile(act_desc, down_desc, row0, e * H + nb * BN, tl.cdiv(I, BK2), BM, BN, BK2,
                        False, True, DOWN_PRECISION)
        _down_store(acc, row0, row_end, nb, y, H, BM, BN)


@triton.jit
def _fold_tile(tile, col0, col_end, ids_ptr, rank_ptr, w_ptr, base, y, out, o_ld, T, H, E,
               TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, PD_F32: tl.constexpr):
    """out[t, col0:col_end] of the token tile's rows."""
    rows, m2, offs, pos = pair_rows(tile, ids_ptr, rank_ptr, base, T, E, TOP_K, KP, BT)
    w = tl.load(w_ptr + offs, mask=m2, other=0.0, cache_modifier=".cg")
    colk = tl.arange(0, KP)
    rmask = rows < T
    YD: tl.constexpr = y.dtype.element_ty
    for h0 in range(col0, col_end, BH):
        hs = h0 + tl.arange(0, BH)
        m = rmask[:, None] & (hs < col_end)[None, :]
        acc = tl.zeros((BT, BH), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            pj = pick(pos, colk, j).to(tl.int64)
            wj = pick(w, colk, j)
            yv = tl.load(y + pj[:, None] * H + hs[None, :], mask=m, other=0.0, cache_modifier=".cg")
            prod = yv.to(tl.float32) * wj[:, None]
            if not PD_F32:
                prod = prod.to(YD).to(tl.float32)
            acc += prod
        if not PD_F32:
            acc = acc.to(YD).to(tl.float32)
        tl.store(out + rows.to(tl.int64)[:, None] * o_ld + hs[None, :], acc.to(out.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T", "n_tiles", "max_blocks", "err_host", "timeout_ns"])
def moe_forward_kernel(ctrl, err_host, timeout_ns,
                       hidden, h_ld, rw, rw_ld, rb, cb, x_desc, gu_desc, down_desc, act_desc, xr_desc, wr_desc,
                       logits, ids_ptr, w_ptr, rank_ptr, counts, meta, tpe, x_sorted, perm, act, saved_up, y, out, o_ld,
                       trace, T, H, I, E, rsf, eps, n_tiles, max_blocks, hb_per,
                       SIGMOID: tl.constexpr, HAS_CB: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                       SD_ROUND: tl.constexpr, CD_ROUND: tl.constexpr,
                       HAS_RB: tl.constexpr, RET_LOGITS: tl.constexpr, NORM: tl.constexpr, SCALED: tl.constexpr,
                       TOP_K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, BT: tl.constexpr,
                       BKR: tl.constexpr, BM: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr,
                       BN: tl.constexpr, BK2: tl.constexpr, BH: tl.constexpr, SCAN_T: tl.constexpr,
                       PD_F32: tl.constexpr, ROUTER_PRECISION: tl.constexpr, UP_PRECISION: tl.constexpr,
                       DOWN_PRECISION: tl.constexpr, SAVE_UP: tl.constexpr, USE_ASM: tl.constexpr,
                       FOLD_GROUPS: tl.constexpr, ROUTER_GEMM: tl.constexpr, RGEMM_TMA: tl.constexpr,
                       RBM: tl.constexpr, RBN: tl.constexpr, BKG: tl.constexpr, JOINT_GU: tl.constexpr,
                       GATHER_UP: tl.constexpr = False, TRACE: tl.constexpr = False, W_F32: tl.constexpr = False,
                       GROUP_BLOCKS: tl.constexpr = 1):
    err_host = err_host.to(tl.pointer_type(tl.int32))  # host-mapped (pinned) mirror
    err = ctrl + C_ERR
    n_iblk = tl.cdiv(I, BI)
    scan_task = n_tiles
    scatter0 = n_tiles + 1
    up0 = scatter0 + n_tiles
    down0 = up0 + max_blocks * n_iblk
    n_down = max_blocks * hb_per  # DOWN tasks of one column group
    n_rg = 0  # RGEMM tasks ahead of the rest (TaskLayout.n_rgemm)
    if ROUTER_GEMM:
        n_rg = tl.cdiv(T, RBM) * tl.cdiv(E, RBN)
    n_tasks = n_rg + down0 + FOLD_GROUPS * (n_down + n_tiles)
    status = 0
    pend = 0  # this program's finished tasks not yet added to their counter, pend_word
    pend_word = -1
    ready = 0  # the last kind (ROUTE .. DOWN) whose inputs this program has seen complete (a wait per phase)
    folds_ready = 0  # column groups whose DOWN tasks this program has seen complete
    logits_ready = 0  # the RGEMM tasks seen complete (ROUTE waits for them with ROUTER_GEMM)
    t = tl.atomic_add(ctrl + C_CLAIM, 1, sem="relaxed", scope="gpu")
    while (t < n_tasks) & (status == 0):
        u = t - n_rg
        kind, grp, idx = _task_kind(tl.maximum(u, 0), scan_task, scatter0, up0, down0, n_down, n_tiles, FOLD_GROUPS)
        kind = tl.where(u < 0, 6, kind)
        idx = tl.where(u < 0, t, idx)
        word = _phase_counter(kind, grp)
        if (pend > 0) & (word != pend_word):
            _publish(ctrl + pend_word, pend, USE_ASM)
            pend = 0
        if TRACE:  # claimed at t0, its wait over at t1 (t0 for tasks that do not wait), done at t2
            t0 = now_ns(USE_ASM)
        if kind == 5:  # a program claims the groups' folds in group order
            if grp >= folds_ready:
                status = wait_flag(ctrl + C_DOWNED0 + grp, n_down, err, timeout_ns, "gpu", USE_ASM)
                folds_ready = grp + 1
        elif kind == 6:  # RGEMM: inputs only
            pass
        elif kind == 0:
            if ROUTER_GEMM and logits_ready == 0:
                status = wait_flag(ctrl + C_RGEMMED, n_rg, err, timeout_ns, "gpu", USE_ASM)
                logits_ready = 1
        elif kind > ready:  # inputs: every task of the kind before (which waited for the kinds before it)
            status = wait_flag(ctrl + _phase_counter(kind - 1, 0), _phase_tasks(kind - 1, n_tiles, max_blocks * n_iblk),
                               err, timeout_ns, "gpu", USE_ASM)
            ready = kind
        if TRACE:
            t1 = now_ns(USE_ASM)
        if status == 0:
            if kind == 6:  # ---- RGEMM
                if RGEMM_TMA:
                    router_gemm_tile_tma(idx, xr_desc, wr_desc, rb, logits, T, H, E, HAS_RB, RBM, RBN, BKG)
                else:
                    router_gemm_tile(idx, hidden, h_ld, rw, rw_ld, rb, logits, T, H, E, HAS_RB, RBM, RBN, BKG,
                                     ROUTER_PRECISION)
            elif kind == 0:  # ---- ROUTE
                if ROUTER_GEMM:
                    select_stored_tile(idx, cb, logits, ids_ptr, w_ptr, rank_ptr, counts, T, E, rsf, eps, NORM, SCALED,
                                       SIGMOID, HAS_CB, N_GROUP, TOPK_GROUP, SD_ROUND, CD_ROUND, TOP_K, KP, BT,
                                       BLOCK_E, W_F32)
                else:
                    route_tile(idx, hidden, h_ld, rw, rw_ld, rb, cb, logits, ids_ptr, w_ptr, rank_ptr, counts, T, H,
                               E, rsf, eps, HAS_RB, RET_LOGITS, NORM, SCALED, SIGMOID, HAS_CB, N_GROUP, TOPK_GROUP,
                               SD_ROUND, CD_ROUND, TOP_K, KP, BT, BLOCK_E, BKR, ROUTER_PRECISION, W_F32)
            elif kind == 1:  # ---- SCAN
                scan_counts(counts, meta, tpe, n_tiles, E, BM, BLOCK_E, SCAN_T)
            elif kind == 2:  # ---- SCATTER
                _scatter_tile(idx, n_tiles, ids_ptr, rank_ptr, counts, meta, hidden, h_ld, x_sorted,
                              saved_up, perm, T, H, I, E, TOP_K, KP, BT, BH, SAVE_UP, GATHER_UP)
            elif kind == 3:  # ---- UP
                if GROUP_BLOCKS == 1:
                    b = idx // n_iblk
                    ib = idx - b * n_iblk
                else:
                    b, ib = _block_chunk(idx, max_blocks, n_iblk, GROUP_BLOCKS)
                _up_tile(b, ib, meta, x_desc, gu_desc, act, saved_up, hidden, h_ld, perm,
                         T * TOP_K, H, I, E, BM, BI, BK, BLOCK_E, UP_PRECISION, SAVE_UP, JOINT_GU, GATHER_UP)
            elif kind == 4:  # ---- DOWN
                if GROUP_BLOCKS == 1:
                    b = idx // hb_per
                    nb = grp * hb_per + idx - b * hb_per
                else:
                    b, nb = _block_chunk(idx, max_blocks, hb_per, GROUP_BLOCKS)
                    nb += grp * hb_per
                _down_tile(b, nb, meta, act_desc, down_desc, y, H, I, E, BM, BN, BK2, BLOCK_E, DOWN_PRECISION)
            else:  # ---- FOLD
                _fold_tile(idx, grp * hb_per * BN, tl.minimum((grp + 1) * hb_per * BN, H), ids_ptr, rank_ptr, w_ptr,
                           counts, y, out, o_ld, T, H, E, TOP_K, KP, BT, BH, PD_F32)
            if word >= 0:  # FOLD tasks feed nothing
                pend_word = word
                pend += 1
        if TRACE:
            tl.debug_barrier()
            trace_row = trace + t.to(tl.int64) * 4
            tl.store(trace_row, t0)
            tl.store(trace_row + 1, t1)
            tl.store(trace_row + 2, now_ns(USE_ASM))
            tl.store(trace_row + 3, tl.program_id(0).to(tl.int64))
        if status == ERR_TIMEOUT:
            record_local_error(err, err_host, OP_ID, t)
        if status == 0:
            t = tl.atomic_add(ctrl + C_CLAIM, 1, sem="relaxed", scope="gpu")
    if (status == 0) & (pend > 0):
        _publish(ctrl + pend_word, pend, USE_ASM)
    # count out; the last program zeroes every counter for the next launch (graph replays included)
    tl.debug_barrier()
    old = tl.atomic_add(ctrl + C_DONE, 1, sem="acq_rel", scope="gpu")
    if old == tl.num_programs(0) - 1:
        z = tl.arange(0, 8)
        tl.store(ctrl + z, tl.zeros((8,), dtype=tl.int32))
        zg = tl.arange(0, MAX_FOLD_GROUPS)
        tl.store(ctrl + C_DOWNED0 + zg, tl.zeros((MAX_FOLD_GROUPS,), dtype=tl.int32), mask=zg < FOLD_GROUPS)


# ----------------------------------------------------------------------------------------------------------
# host side


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Tiles: BT tokens per route / scatter / fold tile (BKR: router K block, BH: columns per step of the scatter's
    row copies and of the fold), BM sorted rows per expert block, BI columns of I per up tile (two accumulators,
    gate and up), BK its K block over H, BN columns of H per down tile, BK2 its K block over I. fold_groups: column
    groups of the DOWN / FOLD tasks (TaskLayout), at most MAX_FOLD_GROUPS. router_gemm: the router GEMM as RGEMM
    tasks of RBM tokens x RBN experts (K block BKG) ahead of the ROUTE tasks, which then select from the stored
    logits (1), or inside each ROUTE tile (0); -1: resolve_router_gemm's rule (on for an fp32 router on bf16 hidden
    states, whose weight then goes in as three bf16 parts: split_router_weight). joint_gate_up: the UP tile's gate
    and up blocks loaded as one [2*BI, BK] operand (a 4-D descriptor over gate_up_proj viewed [E, 2, I, H]) and
    multiplied by ONE dot of width 2*BI instead of two of width BI (each output element the same K sum, so the same
    bits are expected: test_joint_gate_up_bit_identical checks it on the GPU); on in WIDE_FORWARD. gather_up: no
    x_sorted copy; the UP tiles load their x rows from hidden through the sorted row -> token map the SCATTER tasks
    write (the same values into the same dots: the same bits); saves the copy's T*k*H writes and memory (Qwen3-235B
    T = 16384: 1 GiB); opt-in: not faster on an H200 (RESULTS.md, twenty-first session). (Claiming the next task
    when a task starts, to overlap the claim's atomic round trip, was within 0.4% of this and was removed: Triton
    hands the atomic's result to every thread behind a bar.sync where it is issued; RESULTS.md, twenty-first and
    sixty-third sessions.) group_blocks: the order of the UP and DOWN tasks: block by block, every weight chunk of
    a block before the next block (1); or G blocks at a time, chunk by chunk, so that G blocks read one chunk of an
    expert's weight while it is in L2 (forward_configs: for experts whose weights far exceed the L2, as Mixtral's:
    group_blocks())."""
    bt: int = 64
    bkr: int = 64
    bm: int = 128
    bi: int = 64
    bk: int = 64
    bn: int = 128
    bk2: int = 64
    bh: int = 128
    scan_t: int = 32
    num_warps: int = 8
    num_stages: int = 3
    fold_groups: int = 1
    router_gemm: int = -1
    rbm: int = 128
    rbn: int = 128
    bkg: int = 32
    joint_gate_up: bool = False
    gather_up: bool = False
    group_blocks: int = 1

    def __post_init__(self):
        if not 1 <= self.group_blocks <= 64:
            raise ValueError(f"kosmos MoeConfig: group_blocks {self.group_blocks} not in 1..64")


# fp32 (4-byte elements) halves the K blocks; the interpreter wants tiny tiles (every op is numpy)
CONFIGS = {
    "default": MoeConfig(),
    "fp32": MoeConfig(bkr=32, bk=32, bk2=32),
    # exact fp32 (FMA, no tensor cores): small tiles, as the GEMM core's "fp32_ieee"
    "fp32_ieee": MoeConfig(bt=32, bkr=16, bm=64, bi=32, bk=16, bn=64, bk2=16, bh=64, num_warps=4),
    "interpret": MoeConfig(bt=16, bkr=16, bm=16, bi=16, bk=16, bn=32, bk2=16, bh=32, scan_t=16, num_warps=4,
                           num_stages=1, rbm=16, rbn=16, bkg=16),
}


def select_config(hidden: torch.Tensor, gate_up_proj: torch.Tensor, num_experts: Optional[int] = None) -> MoeConfig:
    """num_experts: the router's experts (default gate_up_proj's; more under expert parallelism)."""
    if runtime.interpreting():
        return CONFIGS["interpret"]
    if gate_up_proj.dtype == torch.float32:
        cfg = CONFIGS["fp32" if input_precision(torch.float32) == "tf32" else "fp32_ieee"]
    else:
        cfg = CONFIGS["default"]
    if (num_experts or gate_up_proj.shape[0]) > 128 and cfg.bt > 32:
        cfg = dataclasses.replace(cfg, bt=32)  # [BT, E] router tiles of 256 experts: keep them small
    return cfg


# The non-EP forward's wider expert tiles for 16-bit weights: UP BM x 2*128 (gate and up), DOWN BM x 256. Same
# bits as the default tiles (the K blocks are unchanged); on the H200 at Qwen3-235B dims (T=16384) 9.73 ms vs
# 12.73 (benchmarks/moe_configs.py, RESULTS.md). Tried first; a build that does not fit falls back to the default.
# The joint gate/up operand: Qwen3-235B 9.77-9.94 ms vs 9.93-10.29 without, DeepSeek-V3 the same within noise
# (RESULTS.md twentieth session). 32-token ROUTE / SCATTER / FOLD tiles: twice the tasks in the phases before the
# first UP tile and after the last DOWN tile, where 64-token tiles left half the SMs idle at T = 4096.
WIDE_FORWARD = dict(bi=128, bn=256, joint_gate_up=True, bt=32)
# Four stages instead of three for layers of at most this many experts. On an H100 (benchmarks/moe_kernel_time.py
# --save-up, RESULTS.md fifty-seventh session), with the 32-token tiles: Qwen3-30B-A3B T = 4096 0.97-1.00 ms vs
# 1.07-1.09 with neither and 1.02-1.03 with the tiles alone, T = 8192 1.67-1.70 vs 1.72-1.73, T = 16384 and
# Mixtral-8x7B the same within their spread; DeepSeek-V3's (256 experts) T = 16384 27.4-28.8 vs 25.3-26.0 with three.
FOUR_STAGES_MAX_EXPERTS = 128


def wide_forward(num_experts: int) -> dict:
    """The MoeConfig fields of the wide forward config for a layer of num_experts experts."""
    return dict(WIDE_FORWARD, num_stages=4 if num_experts <= FOUR_STAGES_MAX_EXPERTS else 3)


# Columns of H per DOWN / FOLD group in the default configs. Measured on the H200 at T=16384 (benchmarks/
# moe_kernel_time.py, RESULTS.md tenth session, four interleaved rounds): DeepSeek-V3 (H 7168) 25.1 ms with 2 or 4
# groups vs 25.8 with one; Qwen3-235B (H 4096) 10.07 ms with 2 or 4 vs 9.94 with one.
FOLD_GROUP_COLUMNS = 3072


# The grouped UP / DOWN task order (MoeConfig.group_blocks) where one expert's gate_up weight exceeds
# GROUPED_ORDER_L2S times the L2, G = the expected row blocks per expert, at most GROUP_BLOCKS_MAX. Measured on the
# H200 (50 MB L2; benchmarks/moe_kernel_time.py --save-up, RESULTS.md twenty-fourth session): Mixtral-8x7B (235 MB
# per expert) T = 16384: 23.5-23.9 ms block by block, 19.5-19.6 with G = 4, 19.0-19.3 with 8, 18.9-19.0 with 16;
# T = 4096: 6.10-6.22, 5.04-5.05 with 8, 5.15-5.21 with 16. No gain at Qwen3-235B (25 MB) or DeepSeek-V3 (59 MB,
# ~4.5 blocks per expert) dims with G = 4 or 8 (eighteenth session).
GROUPED_ORDER_L2S = 2
GROUP_BLOCKS_MAX = 16


def group_blocks(num_pairs: int, num_experts: int, expert_bytes: int, bm: int, l2_bytes: int) -> int:
    """MoeConfig.group_blocks for num_pairs (token, expert) pairs over num_experts experts of expert_bytes of
    gate_up weight each, on a GPU of l2_bytes of L2 (1: block by block)."""
    if expert_bytes <= GROUPED_ORDER_L2S * l2_bytes:
        return 1
    per_expert = num_pairs // (num_experts * bm)
    return 1 << max(0, min(per_expert, GROUP_BLOCKS_MAX).bit_length() - 1)  # a power of two <= per_expert


def with_grouped_order(cfg: MoeConfig, num_pairs: int, num_experts: int, expert_bytes: int,
                       device: torch.device) -> MoeConfig:
    """cfg with group_blocks by group_blocks()'s rule on this GPU's L2 (unchanged off CUDA and in the
    interpreter)."""
    if device.type != "cuda" or runtime.interpreting():
        return cfg
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return dataclasses.replace(cfg, group_blocks=group_blocks(num_pairs, num_experts, expert_bytes, cfg.bm, l2))


def weights_f32(weights_dtype: Optional[torch.dtype], logits_dtype: torch.dtype, where: str) -> bool:
    """The forward kernels' W_F32: fp32 routing weights on logits of another dtype (Mixtral's router). ValueError
    for weights that are neither float32 nor of the logits' dtype."""
    if weights_dtype not in (None, torch.float32, logits_dtype):
        raise ValueError(f"kosmos {where}: weights_dtype {weights_dtype} is neither float32 nor the logits' dtype "
                         f"{logits_dtype}")
    return weights_dtype not in (None, logits_dtype)


def forward_configs(hidden: torch.Tensor, gate_up_proj: torch.Tensor, top_k: int = 1) -> list:
    """The configs moe_forward tries in order when none is given (top_k: the router's)."""
    cfg = select_config(hidden, gate_up_proj)
    groups = min(hidden.shape[1] // FOLD_GROUP_COLUMNS, MAX_FOLD_GROUPS.value)
    cfg = with_grouped_order(dataclasses.replace(cfg, fold_groups=max(1, groups)), hidden.shape[0] * top_k,
                             gate_up_proj.shape[0], gate_up_proj[0].nbytes, gate_up_proj.device)
    if runtime.interpreting() or gate_up_proj.dtype == torch.float32:
        return [cfg]
    return [dataclasses.replace(cfg, **wide_forward(gate_up_proj.shape[0])), cfg]


def resolve_router_gemm(cfg: MoeConfig, router_dtype: torch.dtype, hidden_dtype: torch.dtype) -> MoeConfig:
    """cfg with router_gemm 0 or 1: -1 becomes 1 where the router is an fp32 GEMM on bf16 hidden states
    (moe_ops.router_split: DeepSeek-V3's). Its ROUTE tiles of 32 tokens each read the whole fp32 weight (7.3 MB, 3.7
    GB per call at T = 16384 from L2): 378 of the kernel's SM-ms on the H200 (eighth session); as three bf16 dots
    in the same tiles (1.5x the bytes) the kernel ran 0.2-0.5 ms slower, as RGEMM tasks 1.1 ms faster (24.4-24.8 vs
    25.5-25.9 ms, RESULTS.md sixteenth session)."""
    if cfg.router_gemm >= 0:
        return cfg
    return dataclasses.replace(cfg, router_gemm=int(moe_ops.router_split(router_dtype, hidden_dtype)))


def split_router_weight(w: torch.Tensor) -> torch.Tensor:
    """fp32 [E, H] -> bf16 [3, E, H] parts p0 + p1 + p2 of w: each part the bf16 rounding of what the parts before
    it leave, so |w - p0 - p1 - p2| <= 2**-24 |w| (each rounding keeps 8 more significant bits; bf16 has fp32's
    exponent range). A bf16 value times a part is exact in fp32: the router's three bf16 dots sum to x @ w^T as
    finely as an fp32 GEMM rounds it."""
    p0 = w.to(torch.bfloat16)
    rest = w - p0.float()
    p1 = rest.to(torch.bfloat16)
    return torch.stack([p0, p1, (rest - p1.float()).to(torch.bfloat16)])


def max_blocks(num_pairs: int, num_experts: int, bm: int) -> int:
    """Upper bound of sum_e ceil(count_e / bm) over every routing of num_pairs pairs onto num_experts experts."""
    return (num_pairs + min(num_experts, num_pairs) * (bm - 1)) // bm


@dataclasses.dataclass(frozen=True)
class TaskLayout:
    """The forward's task stream for one shape and config (the module docstring): `n_rgemm` RGEMM tasks first (0
    without router_gemm), then, counted from their end, the first index of each of the ROUTE, SCAN, SCATTER, UP,
    DOWN/FOLD parts, `groups` column groups of `hb_per` BN-column chunks of H, `n_down` DOWN tasks per group."""
    n_tiles: int
    max_blocks: int
    n_iblk: int
    groups: int
    hb_per: int
    n_rgemm: int = 0

    @classmethod
    def of(cls, T: int, H: int, I: int, E: int, top_k: int, cfg: MoeConfig) -> "TaskLayout":
        if not 1 <= cfg.fold_groups <= MAX_FOLD_GROUPS.value:
            raise ValueError(f"kosmos moe_forward: fold_groups {cfg.fold_groups} not in 1..{MAX_FOLD_GROUPS.value}")
        n_hblk = triton.cdiv(H, cfg.bn)
        hb_per = triton.cdiv(n_hblk, min(cfg.fold_groups, n_hblk))
        n_rgemm = triton.cdiv(T, cfg.rbm) * triton.cdiv(E, cfg.rbn) if cfg.router_gemm == 1 else 0
        return cls(triton.cdiv(T, cfg.bt), max_blocks(T * top_k, E, cfg.bm), triton.cdiv(I, cfg.bi),
                   triton.cdiv(n_hblk, hb_per), hb_per, n_rgemm)

    @property
    def up0(self) -> int:
        return 2 * self.n_tiles + 1

    @property
    def down0(self) -> int:
        return self.up0 + self.max_blocks * self.n_iblk

    @property
    def n_down(self) -> int:
        return self.max_blocks * self.hb_per

    @property
    def num_tasks(self) -> int:
        return self.n_rgemm + self.down0 + self.groups * (self.n_down + self.n_tiles)

    def kind_of(self, t: int) -> tuple:
        """(kind 0..6 as KINDS, column group, index in the group's tasks of that kind): the kernel's _task_kind
        after the RGEMM tasks."""
        if t < self.n_rgemm:
            return 6, 0, t
        t -= self.n_rgemm
        if t < self.down0:
            if t < self.n_tiles:
                return 0, 0, t
            if t == self.n_tiles:
                return 1, 0, 0
            return (2, 0, t - self.n_tiles - 1) if t < self.up0 else (3, 0, t - self.up0)
        r = t - self.down0
        if r < self.n_down:
            return 4, 0, r
        q, rem = divmod(r - self.n_down, self.n_down + self.n_tiles)
        if q >= self.groups - 1:
            return 5, self.groups - 1, r - self.n_down - (self.groups - 1) * (self.n_down + self.n_tiles)
        return (4, q + 1, rem) if rem < self.n_down else (5, q, rem - self.n_down)


KINDS = ("ROUTE", "SCAN", "SCATTER", "UP", "DOWN", "FOLD", "RGEMM")


def num_tasks(T: int, H: int, I: int, E: int, top_k: int, cfg: MoeConfig) -> int:
    return TaskLayout.of(T, H, I, E, top_k, cfg).num_tasks


class _Control:
    """Per-device control tensor of one op's kernel (counters, error word) and its host-mapped error mirror."""

    def __init__(self, device: torch.device, op: str):
        self.device, self.op = device, op
        self.ctrl = runtime.kept_tensor(device, lambda: torch.zeros(CTRL_HEAD + 128, dtype=torch.int32,
                                                                    device=device))
        self.err_host = torch.zeros(4, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.bad: Optional[str] = None
        self.lock = threading.Lock()
        self.captured = False  # a launch was captured in a CUDA graph: a replaced tensor stays allocated for it
        self._retired: list = []

    def ensure(self, words: int) -> None:
        """Room for `words` per-block counters after the head (a new, zeroed tensor when it grows). Called before
        every launch: it also notes a launch under CUDA graph capture."""
        self.captured = self.captured or runtime.capturing(self.device)
        if CTRL_HEAD + words <= self.ctrl.numel():
            return
        runtime.refuse_growth_in_capture(self.device, f"the {self.op} control tensor ({words} words)")
        if self.captured:
            self._retired.append(self.ctrl)
        size = CTRL_HEAD + max(words, 2 * (self.ctrl.numel() - CTRL_HEAD))
        self.ctrl = runtime.kept_tensor(self.device, lambda: torch.zeros(size, dtype=torch.int32, device=self.device))

    def check(self) -> None:
        if self.bad is not None:
            raise runtime.WorkspaceBroken(f"kosmos {self.op}: control tensor unusable: {self.bad}")
        if int(self.err_host[0]) != 0:
            if self.device.type == "cuda" and not runtime.capturing(self.device):
                torch.cuda.synchronize(self.device)
            exc = runtime.KernelTimeout(self.op, 0, int(self.err_host[3]))
            self.bad = str(exc)
            raise exc

    def after_launch(self) -> None:
        runtime.check_after_launch(self.device, self.check)

    def launch(self, kernel, grid, args, meta: dict) -> None:
        """kernel[grid](*args, **meta) under the lock, then after_launch. Under the interpreter an exception can stop
        the programs midway, leaving their claims in the counters (every later launch would spin to the bound), so
        the counters are zeroed before it propagates; on a GPU a launch that raises has not started."""
        with self.lock:
            try:
                kernel[grid](*args, **meta, **runtime.COMPILE_OPTIONS)
            except Exception:
                if runtime.interpreting():
                    self.ctrl.zero_()
                raise
        self.after_launch()

    def launch_direct(self, launch: launch_plan.DirectLaunch, args: tuple) -> None:
        """launch(args) (a plan's compiled kernel, on a GPU) under the lock, then after_launch."""
        with self.lock:
            launch(args)
        self.after_launch()


_controls: dict = {}
_controls_lock = threading.Lock()


def control(device: torch.device, op: str = "moe_layer") -> _Control:
    """The per-device control tensor of `op`'s kernel (the forward's and the backward's are separate)."""
    key = (op, device.type, device.index if device.index is not None else
           (torch.cuda.current_device() if device.type == "cuda" else 0))
    with _controls_lock:
        c = _controls.get(key)
        if c is None:
            c = _controls[key] = _Control(device, op)
        return c


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def moe_forward(hidden: torch.Tensor, router_weight: torch.Tensor, router_bias: Optional[torch.Tensor],
                score_correction_bias: Optional[torch.Tensor], gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                top_k: int, scoring: str = "softmax", norm_topk_prob: bool = True, n_group: int = 1,
                topk_group: int = 1, routed_scaling_factor: float = 1.0, router_dtype: Optional[torch.dtype] = None,
                activation: str = "silu", return_router_logits: bool = False, *, programs: Optional[int] = None,
                config: Optional[MoeConfig] = None, return_routing: bool = False, save_up: bool = False,
                trace: Optional[torch.Tensor] = None, weights_dtype: Optional[torch.dtype] = None):
    """kosmos::moe_layer's forward (ep_group_name None) in one launch -> (out [T, H], router_logits [T, E] or
    [0, E], tokens_per_expert [E] int32) (+ (saved_up,) with save_up) (+ (topk_ids [T, k] int32, topk_weights
    [T, k] fp32 of the weights_dtype values) with return_routing). Raises ValueError for what the kernel does not
    support (moe_ops.why_not_moe_layer says the same without raising). programs: grid size (default one per SM; 1
    in the interpreter). weights_dtype: the routing weights' dtype, None (the logits') or float32 (Mixtral's router:
    its softmax values are never rounded to the logits' dtype; the fold's products are then fp32). A call whose
    arguments' signature was seen before takes its checks, config and compiled kernel from that call's plan
    (_ForwardPlan, kosmos.kernels.launch_plan; not with trace).

    saved_up [T*k + E, 2I] in gate_up_proj's dtype: the up projection [gate | up] of every pair, rounded to that
    dtype (what the backward reads instead of recomputing it), in the reference's padded expert-major layout
    (kosmos.ops.moe_math._SortedPairs): expert e's group is rows [start_e + e, start_e + e + 1 + count_e), an all-zero
    pad row, then e's pairs in ascending token order (start_e: pairs of the experts before e).

    trace (a profiling hook, benchmarks/moe_trace.py): int64 [num_tasks(...), 4] on the device; every task's row
    gets (claimed, wait over, done) in %globaltimer ns and the program that ran it (a separate kernel build)."""
    args = (hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k, scoring,
            norm_topk_prob, n_group, topk_group, routed_scaling_factor, router_dtype, return_router_logits, programs,
            weights_dtype, save_up)
    key, timeout_ns = None, runtime.spin_timeout_ns()
    if trace is None:
        key = (launch_plan.tensor_key(hidden), launch_plan.device_key(hidden.device),
               launch_plan.tensor_key(router_weight), launch_plan.tensor_key(router_bias),
               launch_plan.tensor_key(score_correction_bias), launch_plan.tensor_key(gate_up_proj),
               launch_plan.tensor_key(down_proj), top_k, scoring, norm_topk_prob, n_group, topk_group,
               routed_scaling_factor, router_dtype, activation, return_router_logits, programs, config, save_up,
               weights_dtype, torch.backends.cuda.matmul.allow_tf32, runtime.interpreting(), timeout_ns)
        plan = _plans.get(key)
        if plan is not None:
            return _moe_forward(plan, key, *args, trace, return_routing, timeout_ns)
    from kosmos.kernels.moe_ops import kernel_reason

    reason = kernel_reason(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k,
                           scoring, n_group, topk_group, router_dtype, activation)
    if reason is not None:
        raise ValueError(f"kosmos moe_forward: {reason}")
    candidates = [config] if config is not None else forward_configs(hidden, gate_up_proj, top_k)
    for i, cfg in enumerate(candidates):
        try:
            return _moe_forward(_plan_forward(*args, trace, cfg), key, *args, trace, return_routing, timeout_ns)
        except runtime.KernelDoesNotFit as e:
            if i == len(candidates) - 1:
                raise
            runtime.log.info("kosmos moe_forward: tiles %s do not fit (%s); trying the next config", cfg, e)


@dataclasses.dataclass(frozen=True)
class _ForwardPlan:
    """What moe_forward derives from one signature of its arguments (kosmos.kernels.launch_plan): the config (its
    router_gemm resolved), the task layout, the constexprs and grid, whether the router weight goes in as
    split_router_weight's bf16 parts (and its RGEMM tiles load through TMA); once the grid check passed (`checked`),
    the compiled kernel's direct launch (None: through Triton's JIT, as in the interpreter)."""
    cfg: MoeConfig
    layout: TaskLayout
    meta: dict
    grid: tuple
    split_router: bool
    rgemm_tma: bool
    checked: bool = False
    launch: Optional[launch_plan.DirectLaunch] = None


_plans = launch_plan.PlanCache()


def _plan_forward(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k, scoring,
                  norm_topk_prob, n_group, topk_group, routed_scaling_factor, router_dtype, return_router_logits,
                  programs, weights_dtype, save_up, trace, cfg) -> _ForwardPlan:
    device = hidden.device
    T, H = hidden.shape
    E, two_i, _ = gate_up_proj.shape
    rd = router_dtype or hidden.dtype
    cfg = resolve_router_gemm(cfg, rd, hidden.dtype)
    layout = TaskLayout.of(T, H, two_i // 2, E, top_k, cfg)
    w_f32 = weights_f32(weights_dtype, rd, "moe_forward")
    wd = weights_dtype or rd
    product = torch.promote_types(down_proj.dtype, wd)
    if product not in (torch.float32, down_proj.dtype):
        raise ValueError(f"kosmos moe_forward: product dtype {product} of down_proj {down_proj.dtype} and weights {wd}")
    interp = runtime.interpreting()
    P = programs or (1 if interp or device.type != "cuda" else runtime.num_sms(device))
    P = max(1, min(P, layout.num_tasks))
    consts = routing_constexprs(scoring, norm_topk_prob, n_group, topk_group, routed_scaling_factor, rd, router_bias,
                                score_correction_bias, top_k, E, gate_up_proj.dtype, down_proj.dtype, hidden.dtype,
                                weights_dtype)
    split = bool(cfg.router_gemm) and moe_ops.router_split(rd, hidden.dtype) and router_weight.numel() < 2**31
    rgemm_tma = False
    if split:
        consts["ROUTER_PRECISION"] = "bf16x3"
        rgemm_tma = (hidden.stride(0) * hidden.element_size()) % 16 == 0 and hidden.data_ptr() % 16 == 0
    meta = dict(**consts, RET_LOGITS=bool(return_router_logits), BT=cfg.bt, BKR=cfg.bkr, BM=cfg.bm, BI=cfg.bi,
                BK=cfg.bk, BN=cfg.bn, BK2=cfg.bk2, BH=cfg.bh, SCAN_T=cfg.scan_t, SAVE_UP=bool(save_up),
                USE_ASM=not interp, FOLD_GROUPS=layout.groups, ROUTER_GEMM=bool(cfg.router_gemm),
                RGEMM_TMA=rgemm_tma, RBM=cfg.rbm, RBN=cfg.rbn, BKG=cfg.bkg, JOINT_GU=bool(cfg.joint_gate_up),
                GATHER_UP=bool(cfg.gather_up), TRACE=trace is not None,
                W_F32=w_f32, GROUP_BLOCKS=cfg.group_blocks,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _ForwardPlan(cfg, layout, meta, (P,), split, rgemm_tma)


def _moe_forward(plan: _ForwardPlan, key, hidden, router_weight, router_bias, score_correction_bias, gate_up_proj,
                 down_proj, top_k, scoring, norm_topk_prob, n_group, topk_group, routed_scaling_factor, router_dtype,
                 return_router_logits, programs, weights_dtype, save_up, trace, return_routing, timeout_ns):
    """One launch on plan's config: the buffers, descriptors and arguments of this call. The first launch of a plan
    checks the grid and builds its direct launch, then keeps it under key (None: not kept, a traced call)."""
    device = hidden.device
    cfg, layout = plan.cfg, plan.layout
    T, H = hidden.shape
    E, two_i, _ = gate_up_proj.shape
    I = two_i // 2
    rd = router_dtype or hidden.dtype
    n_tiles = layout.n_tiles
    if trace is not None and (trace.dtype != torch.int64 or tuple(trace.shape) != (layout.num_tasks, 4)
                              or trace.device != device):
        raise ValueError(f"kosmos moe_forward: trace must be int64 [{layout.num_tasks}, 4] on {device}")
    ctl = control(device)
    ctl.check()
    ctl.ensure(layout.groups)
    pairs = T * top_k
    i32 = dict(dtype=torch.int32, device=device)
    logits = torch.empty(T if return_router_logits else 0, E, dtype=rd, device=device)
    logits_arg = logits  # with router_gemm the RGEMM tasks store every call's logits (a workspace if not returned)
    if not return_router_logits:
        logits_arg = torch.empty((T, E) if cfg.router_gemm else (1,), dtype=rd, device=device)
    ids = torch.empty(T, top_k, **i32)
    ranks = torch.empty(T, top_k, **i32)
    wts = torch.empty(T, top_k, dtype=torch.float32, device=device)
    counts = torch.empty(n_tiles, E, **i32)
    meta = torch.empty(3 * E, **i32)
    tpe = torch.empty(E, **i32)
    # gather_up: the UP tiles load their rows from hidden through perm (sorted row -> token), no x_sorted
    x_sorted = torch.empty(1 if cfg.gather_up else pairs, H, dtype=gate_up_proj.dtype, device=device)
    perm = torch.empty(max(pairs, 1) if cfg.gather_up else 1, **i32)
    act = torch.empty(pairs, I, dtype=down_proj.dtype, device=device)
    saved_up = torch.empty(pairs + E if save_up else 1, two_i, dtype=gate_up_proj.dtype, device=device)
    y = torch.empty(pairs, H, dtype=down_proj.dtype, device=device)
    out = torch.empty(T, H, dtype=hidden.dtype, device=device)
    x_desc = TensorDescriptor(x_sorted, [x_sorted.shape[0], H], [H, 1], [cfg.bm, cfg.bk])
    if cfg.joint_gate_up:
        gu_desc = TensorDescriptor(gate_up_proj.view(E, 2, I, H), [E, 2, I, H], [two_i * H, I * H, H, 1],
                                   [1, 2, cfg.bi, cfg.bk])
    else:
        gu_desc = TensorDescriptor(gate_up_proj.view(E * two_i, H), [E * two_i, H], [H, 1], [cfg.bi, cfg.bk])
    down_desc = TensorDescriptor(down_proj.view(E * H, I), [E * H, I], [I, 1], [cfg.bn, cfg.bk2])
    act_desc = TensorDescriptor(act, [pairs, I], [I, 1], [cfg.bm, cfg.bk2])
    rw_arg, xr_desc, wr_desc = router_weight, x_desc, x_desc  # (unused descriptors without RGEMM_TMA)
    if plan.split_router:
        rw_arg = split_router_weight(router_weight)
        if plan.rgemm_tma:
            xr_desc = TensorDescriptor(hidden, [T, H], [hidden.stride(0), 1], [cfg.rbm, cfg.bkg])
            wr_desc = TensorDescriptor(rw_arg.view(3 * E, H), [3 * E, H], [H, 1], [cfg.rbn, cfg.bkg])
    args = (ctl.ctrl, ctl.err_host.data_ptr(), timeout_ns,
            hidden, hidden.stride(0), rw_arg, rw_arg.stride(-2),
            router_bias if router_bias is not None else router_weight,
            score_correction_bias if score_correction_bias is not None else router_weight, x_desc, gu_desc, down_desc,
            act_desc, xr_desc, wr_desc, logits_arg, ids, wts, ranks, counts, meta, tpe, x_sorted, perm, act, saved_up,
            y, out, out.stride(0),
            trace if trace is not None else ids, T, H, I, E, float(routed_scaling_factor), 1e-20, n_tiles,
            layout.max_blocks, layout.hb_per)
    if not plan.checked:
        meta_kw = plan.meta
        runtime.check_grid_fits(moe_forward_kernel, ("moe_fwd", hidden.dtype, gate_up_proj.dtype, down_proj.dtype,
                                                     rd, tuple(sorted((k, str(v)) for k, v in meta_kw.items()))),
                                plan.grid, device, args, meta_kw)
        direct = None
        if device.type == "cuda" and key is not None:
            direct = launch_plan.direct_launch(
                moe_forward_kernel, launch_plan.compiled_build(moe_forward_kernel, plan.grid, args, meta_kw),
                plan.grid, len(args), meta_kw)
            if direct is None:
                runtime.log.info("kosmos moe_forward: this triton's compiled kernel has no direct launch; each call "
                                 "binds its arguments through the JIT (the same kernel)")
        plan = dataclasses.replace(plan, checked=True, launch=direct)
        if key is not None:
            _plans.put(key, plan)
    if plan.launch is not None:
        ctl.launch_direct(plan.launch, args)
    else:
        ctl.launch(moe_forward_kernel, plan.grid, args, plan.meta)
    res = (out, logits, tpe)
    if save_up:
        res = res + (saved_up,)
    if return_routing:
        res = res + (ids, wts)
    return res


def _precision(dtype: torch.dtype) -> str:
    p = input_precision(dtype)
    return "ieee" if p == "ieee" else "tf32"


def routing_constexprs(scoring: str, norm_topk_prob: bool, n_group: int, topk_group: int,
                       routed_scaling_factor: float, rd: torch.dtype, router_bias, score_correction_bias, top_k: int,
                       num_experts: int, gate_up_dtype: torch.dtype, down_dtype: torch.dtype,
                       hidden_dtype: Optional[torch.dtype] = None,
                       weights_dtype: Optional[torch.dtype] = None) -> dict:
    """The constexprs every MoE kernel (forward / backward, with or without EP) derives from the router's
    arguments and the dtypes: scoring, selection, roundings (the reference's rules), tile widths of k and E, dot
    precisions (moe_ops.router_precision). weights_dtype: the routing weights' (None: the logits' dtype rd)."""
    sigmoid = scoring == "sigmoid"
    score_dtype = torch.float32 if not sigmoid else rd
    choice_dtype = score_dtype if score_correction_bias is None else torch.promote_types(score_dtype,
                                                                                         score_correction_bias.dtype)
    return dict(SIGMOID=sigmoid, HAS_CB=score_correction_bias is not None, N_GROUP=n_group, TOPK_GROUP=topk_group,
                SD_ROUND=score_dtype != torch.float32, CD_ROUND=choice_dtype != torch.float32,
                HAS_RB=router_bias is not None, NORM=bool(norm_topk_prob),
                SCALED=sigmoid or routed_scaling_factor != 1.0,  # the reference's rule
                TOP_K=top_k, KP=max(2, _next_pow2(top_k)), BLOCK_E=max(16, _next_pow2(num_experts)),
                PD_F32=torch.promote_types(down_dtype, weights_dtype or rd) == torch.float32,
                ROUTER_PRECISION=moe_ops.router_precision(rd, hidden_dtype), UP_PRECISION=_precision(gate_up_dtype),
                DOWN_PRECISION=_precision(down_dtype))
