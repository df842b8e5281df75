"""Can TMA feed a grouped GEMM's A tiles gathered row by row (sm_90, Gluon)? A probe of the row copies that
grouped_ws_gather.py's GATHER == 2 producers make (_row_copies itself), without the GEMM around them.

Why: the reference forward's up projection reads rows gathered from the hidden states by the sorted pairs' token
index. Today a gather kernel writes them out first (0.348 ms of Qwen3-235B's T = 16384 forward, fortieth session),
or (KOSMOS_GROUPED_GATHER=1) the GEMM's producer copies them with cp.async, which cost the GEMM more than the gather
kernel (forty-fourth session). A third way: one TMA copy of box [1, BLOCK_K] per row, into the row's 128 bytes of the
swizzled stage. Gluon (triton 3.6) refuses a one-row slice of a 128B-swizzled buffer ("We don't support splitting
along the swizzling pattern"), so the row's view is reinterpreted through a flat one; the copy is right only if
TMA swizzles by the absolute shared-memory address (its 1024-byte pattern), which this probe checks: the stages go
back out through TMA stores and must equal src[idx]. TMA copies are issued by one elected thread per partition, and
a stage of 128 rows is 128 copies where the GEMM's K step has ~1000 cycles, so the rows are split over 1, 2 or 4
one-warp producer partitions (the GEMM has 2), each filling a ring of its own. Triton 3.6 only (the GPU machine's;
3.7 on refuse a box smaller than its destination).

Timed by measure.bench_calls (at least --reps calls, L2 flushed before each): the loads alone (the consumer only
releases each stage), for every (m-tile, n-tile) pair as the up GEMM walks them (n-tiles of an m-tile on
neighbouring programs, so the rows come from L2 after the first), against the same walk over contiguous rows with
one [BLOCK_M, BLOCK_K] TMA copy a stage (what the GEMM loads today). If the row copies take well under the GEMM's
time per stage (~0.85 us at Qwen3-235B's T = 16384: its up GEMM's ~5.4 ms over its stages), the GEMM built with
them (grouped_ws_gather.py, GATHER == 2; grouped_mm.py --swiglu's swiglu_gathered_tma) is worth timing.

    PYTHONPATH=.:benchmarks python3 benchmarks/tma_row_gather.py --layer qwen3_235b --T 16384
"""
from __future__ import annotations

import argparse
import json

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from kosmos.kernels.gemm_ws import _tma_load, _tma_store
from kosmos.kernels.grouped_ws_gather import _row_copies, _rows_view
from measure import bench_calls

BLOCK_M = 128
BLOCK_K = 64
STAGES = 4
LAYERS = {"qwen3_235b": (4096, 1536, 128), "deepseek_v3": (7168, 2048, 256), "qwen3_30b": (2048, 768, 128)}


@gluon.jit
def _row_producer(src_desc, idx_ptr, ring, ready, empty, n_work, NT, k_tiles, S, T_src, FIRST: gl.constexpr,
                  ROWS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """Rows [FIRST, FIRST + ROWS) of every stage into this producer's ring, by the kernel's own row copies
    (grouped_ws_gather._row_copies: rows past S get zeros)."""
    rows_view = _rows_view(ring, STAGES, ROWS, BLOCK_K)
    it = 0
    for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
        for ki in range(0, k_tiles):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), ROWS * BLOCK_K * src_desc.dtype.primitive_bitwidth // 8)
            _row_copies(src_desc, idx_ptr, rows_view, ready, s, (w // NT) * BLOCK_M + FIRST, S, T_src, ki, ROWS,
                        BLOCK_K)
            it += 1


@gluon.jit
def _tile_producer(a_desc, rings, ready, empty, n_work, NT, k_tiles, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                   STAGES: gl.constexpr):
    """The baseline: contiguous rows, one [BLOCK_M, BLOCK_K] TMA copy a stage."""
    it = 0
    for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
        for ki in range(0, k_tiles):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), BLOCK_M * BLOCK_K * a_desc.dtype.primitive_bitwidth // 8)
            _tma_load(a_desc, [(w // NT) * BLOCK_M, ki * BLOCK_K], ready.index(s), rings[0].index(s))
            it += 1


@gluon.jit
def _consumer(rings, ready, empty, out_desc, n_work, NT, k_tiles, COPY_OUT: gl.constexpr, PRODUCERS: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """Waits for each stage and gives it back; COPY_OUT: n-tile 0's stages go out through TMA first, a ring's rows
    at a time."""
    ROWS: gl.constexpr = BLOCK_M // PRODUCERS
    it = 0
    for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
        for ki in range(0, k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            if COPY_OUT:
                if w % NT == 0:
                    for p in gl.static_range(PRODUCERS):
                        _tma_store(out_desc, [(w // NT) * BLOCK_M + p * ROWS, ki * BLOCK_K], rings[p].index(s))
                    tma.store_wait(pendings=0)
            mbarrier.arrive(empty.index(s))
            it += 1


@gluon.jit
def row_gather_probe_kernel(src_desc, a_desc, out_desc, idx_ptr, S, T_src, n_work, NT, k_tiles,
                            PRODUCERS: gl.constexpr, COPY_OUT: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """PRODUCERS 0: the contiguous baseline (a_desc, one ring of whole stages); 1, 2, 4: that many one-warp
    partitions, each filling its own ring with its share of a stage's rows (out_desc's block: that share)."""
    dtype: gl.constexpr = out_desc.dtype
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        if PRODUCERS == 0:
            mbarrier.init(ready.index(i), count=1)
        else:
            mbarrier.init(ready.index(i), count=PRODUCERS)
        mbarrier.init(empty.index(i), count=1)
    # (the argument tuples stay literal: a tuple assigned to a name turns its constexprs into tensors)
    if PRODUCERS == 0:
        rings = (gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout), )
        gl.warp_specialize([
            (_consumer, (rings, ready, empty, out_desc, n_work, NT, k_tiles, False, 1, BLOCK_M, BLOCK_K, STAGES)),
            (_tile_producer, (a_desc, rings, ready, empty, n_work, NT, k_tiles, BLOCK_M, BLOCK_K, STAGES)),
        ], [1], [40])
    elif PRODUCERS == 1:
        rings = (gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], out_desc.layout), )
        gl.warp_specialize([
            (_consumer, (rings, ready, empty, out_desc, n_work, NT, k_tiles, COPY_OUT, 1, BLOCK_M, BLOCK_K, STAGES)),
            (_row_producer, (src_desc, idx_ptr, rings[0], ready, empty, n_work, NT, k_tiles, S, T_src, 0, BLOCK_M,
                             BLOCK_M, BLOCK_K, STAGES)),
        ], [1], [40])
    elif PRODUCERS == 2:
        rings = (gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M // 2, BLOCK_K], out_desc.layout),
                 gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M // 2, BLOCK_K], out_desc.layout))
        gl.warp_specialize([
            (_consumer, (rings, ready, empty, out_desc, n_work, NT, k_tiles, COPY_OUT, 2, BLOCK_M, BLOCK_K, STAGES)),
            (_row_producer, (src_desc, idx_ptr, rings[0], ready, empty, n_work, NT, k_tiles, S, T_src, 0,
                             BLOCK_M // 2, BLOCK_M, BLOCK_K, STAGES)),
            (_row_producer, (src_desc, idx_ptr, rings[1], ready, empty, n_work, NT, k_tiles, S, T_src, BLOCK_M // 2,
                             BLOCK_M // 2, BLOCK_M, BLOCK_K, STAGES)),
        ], [1, 1], [40, 40])
    else:
        gl.static_assert(PRODUCERS == 4, "0, 1, 2 or 4 producers")
        rings = (gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M // 4, BLOCK_K], out_desc.layout),
                 gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M // 4, BLOCK_K], out_desc.layout),
                 gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M // 4, BLOCK_K], out_desc.layout),
                 gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M // 4, BLOCK_K], out_desc.layout))
        gl.warp_specialize([
            (_consumer, (rings, ready, empty, out_desc, n_work, NT, k_tiles, COPY_OUT, 4, BLOCK_M, BLOCK_K, STAGES)),
            (_row_producer, (src_desc, idx_ptr, rings[0], ready, empty, n_work, NT, k_tiles, S, T_src, 0,
                             BLOCK_M // 4, BLOCK_M, BLOCK_K, STAGES)),
            (_row_producer, (src_desc, idx_ptr, rings[1], ready, empty, n_work, NT, k_tiles, S, T_src, BLOCK_M // 4,
                             BLOCK_M // 4, BLOCK_M, BLOCK_K, STAGES)),
            (_row_producer, (src_desc, idx_ptr, rings[2], ready, empty, n_work, NT, k_tiles, S, T_src, BLOCK_M // 2,
                             BLOCK_M // 4, BLOCK_M, BLOCK_K, STAGES)),
            (_row_producer, (src_desc, idx_ptr, rings[3], ready, empty, n_work, NT, k_tiles, S, T_src,
                             3 * BLOCK_M // 4, BLOCK_M // 4, BLOCK_M, BLOCK_K, STAGES)),
        ], [1, 1, 1, 1], [40, 40, 40, 40])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def probe(src: torch.Tensor, idx: torch.Tensor, nt: int, producers: int, copy_out: bool, a: torch.Tensor = None):
    """One launch over every (m-tile, n-tile) pair; returns the gathered tiles (copy_out) or None. idx: int32 row
    indices into src (the kernel gives rows past them zeros)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    S, K = idx.numel(), src.shape[1]
    m_tiles = -(-S // BLOCK_M)
    rows = BLOCK_M // max(producers, 1)  # a ring's share of a stage
    layout = gl.NVMMASharedLayout.get_default_for([rows, BLOCK_K], gl.bfloat16)
    src_desc = TensorDescriptor.from_tensor(src, [1, BLOCK_K], layout)
    out = torch.zeros(m_tiles * BLOCK_M, K, dtype=src.dtype, device=src.device) if copy_out else src
    out_desc = TensorDescriptor.from_tensor(out, [rows, BLOCK_K], layout)
    a_desc = TensorDescriptor.from_tensor(a if a is not None else src, [BLOCK_M, BLOCK_K], layout)
    sms = torch.cuda.get_device_properties(src.device).multi_processor_count
    row_gather_probe_kernel[(sms,)](src_desc, a_desc, out_desc, idx, S, src.shape[0], m_tiles * nt, nt, K // BLOCK_K,
                                    PRODUCERS=producers, COPY_OUT=copy_out, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
                                    STAGES=STAGES, num_warps=4)
    return out if copy_out else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layer", default="qwen3_235b", choices=sorted(LAYERS))
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--reps", type=int, default=20, help="at least this many timed calls (measure.bench_calls)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    H, I, E = LAYERS[args.layer]
    S = args.T * args.top_k
    nt = 2 * I // 256  # the up GEMM's n-tiles (BLOCK_N 256 over gate | up)
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(args.T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    # sorted pairs' token ids: each expert's tokens in increasing order, as the reference forward's sort leaves them
    ids = torch.rand(args.T, E, device="cuda", generator=g).topk(args.top_k, dim=1).indices.flatten()
    idx = torch.argsort(ids, stable=True).div(args.top_k, rounding_mode="floor").to(torch.int32)
    want = src[idx.long()]
    copy = want.contiguous()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stages = -(-S // BLOCK_M) * nt * (H // BLOCK_K)
    print(f"{args.layer} T={args.T}: {S} rows x {H}, {nt} n-tiles a row block, stages of {BLOCK_M}x{BLOCK_K}")
    rows = {}
    # the baseline first: a row copy that faults (e.g. a destination TMA will not take) ends the process's CUDA context
    for producers in (0, 1, 2, 4):
        if producers == 0:
            same = True
            ms = bench_calls(lambda: probe(src, idx, nt, 0, False, a=copy), 25, 100, args.reps)
        else:
            out = probe(src, idx[:1000], 1, producers, True)  # a ragged last tile: its pad rows must come back zero
            same = torch.equal(out[:1000], want[:1000]) and not out[1000:].any()
            out = probe(src, idx, 1, producers, True)
            same = same and torch.equal(out[:S], want)
            ms = bench_calls(lambda: probe(src, idx, nt, producers, False), 25, 100, args.reps)
        us = ms * 1e3 * sms / stages
        rows[producers] = dict(same_bits=same, ms=ms, us_per_stage_per_sm=us)
        name = "contiguous, one copy a stage" if producers == 0 else f"row copies, {producers} producer warp(s)"
        print(f"  {name:34s} {ms:8.3f} ms  {us:6.3f} us a stage per SM  same bits: {same}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(layer=args.layer, T=args.T, rows={str(k): v for k, v in rows.items()}), f, indent=1)


if __name__ == "__main__":
    main()
