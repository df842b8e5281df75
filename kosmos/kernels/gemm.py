"""Persistent GEMM core on TMA tensor descriptors: C = A @ B (+ bias), the tile loop every fused kernel reuses.

Pieces, in the order a kernel uses them:

- ``tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M) -> (pid_m, pid_n)``: grouped (L2-friendly) tile order.
- ``gemm_tile(a_desc, b_desc, off_m, off_n, k_tiles, ...) -> acc``: the K loop of one output tile, fp32 acc
  (``gemm_tile_k_range`` for a slice of K). It knows nothing of which tile it computes: the plain GEMM walks
  tiles in grouped order, a fused kernel passes the tile it claimed from its task queue.
- ``gemm_epilogue(acc, c_desc, bias_ptr, off_m, off_n, N, ...)``: + bias[N] (fp32), cast, TMA store.
- ``stream_k_tail``: the ragged last wave of tiles spread over every SM as equal K ranges (fp32 partials,
  summed in fixed order by whichever contributor arrives last; nobody waits).
- ``gemm_persistent_kernel``: one program per SM (or fewer), whole tiles strided over programs, then the tail.
- ``gemm(a, b, bias=None)``: host launcher: boundary checks, config from a fixed table (default_config /
  plain_gemm_config: on sm_90 with bf16 / fp16 the warp-specialized Gluon kernel of gemm_ws.py, else
  select_config), schedule (plan_gemm), host-side descriptors (make_descriptors).

Layouts (no copies): A is [M, K] row-major or a transposed view of a row-major [K, M];
B is [K, N] row-major or, the usual case, a transposed view of a Linear weight [N, K] (``w.t()``).
TMA needs a 16-byte aligned base and 16-byte aligned non-unit strides; anything else raises
``GemmUnsupported`` (a ValueError) so the caller can take a reference path.

Arithmetic per output element depends only on the config and the plan (made for the device's SM count, not
the grid), never on which program computes what, so reruns are bit-identical whatever the grid size.
Measured on the H200 against cuBLAS: benchmarks/RESULTS.md.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kosmos.kernels import gemm_ws_host, runtime
from kosmos.kernels.gemm_ws_host import unsupported as ws_unsupported

log = logging.getLogger("kosmos")

__all__ = [
    # jit
    "tile_coords",
    "gemm_tile",
    "gemm_tile_k_range",
    "gemm_epilogue",
    "stream_k_tail",
    "gemm_persistent_kernel",
    # host
    "CONFIGS",
    "GemmConfig",
    "GemmLayout",
    "GemmPlan",
    "GemmUnsupported",
    "check_operands",
    "default_config",
    "gemm",
    "input_precision",
    "make_descriptors",
    "num_sms",
    "plain_gemm_config",
    "plan_gemm",
    "select_config",
    "why_unsupported",
]


# ----------------------------------------------------------------------------------------------------------
# jit pieces


@triton.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile index -> (pid_m, pid_n), walking GROUP_M rows of tiles column by column (A rows reused in L2)."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def gemm_tile(a_desc, b_desc, off_m, off_n, k_tiles,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              A_TRANS: tl.constexpr, B_TRANS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] = A[off_m:+BM, :k_tiles*BK] @ B[:k_tiles*BK, off_n:+BN].

    a_desc: block [BLOCK_M, BLOCK_K] over A [M, K] (A_TRANS=False) or block [BLOCK_K, BLOCK_M] over A^T [K, M].
    b_desc: block [BLOCK_K, BLOCK_N] over B [K, N] (B_TRANS=False) or block [BLOCK_N, BLOCK_K] over B^T [N, K]
            (the Linear weight itself). Out-of-bounds rows/cols/K read as zeros (TMA), so ragged edges need
            no masks. Offsets are in elements; off_m, off_n are tile origins (pid * BLOCK).
    """
    return gemm_tile_k_range(a_desc, b_desc, off_m, off_n, 0, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K,
                             A_TRANS, B_TRANS, DOT_PRECISION)


@triton.jit
def gemm_tile_k_range(a_desc, b_desc, off_m, off_n, k_first, k_last,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      A_TRANS: tl.constexpr, B_TRANS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """gemm_tile over K blocks [k_first, k_last) only (a partial sum: stream-K, split-K)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_first, k_last):
        off_k = ki * BLOCK_K
        if A_TRANS:
            a = a_desc.load([off_k, off_m]).T
        else:
            a = a_desc.load([off_m, off_k])
        if B_TRANS:
            b = b_desc.load([off_n, off_k]).T
        else:
            b = b_desc.load([off_k, off_n])
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def gemm_epilogue(acc, c_desc, bias_ptr, off_m, off_n, N,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_BIAS: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr):
    """C[off_m:+BM, off_n:+BN] = (acc + bias[off_n:+BN]).to(C dtype), stored through c_desc (TMA clips the edges).

    c_desc: block [BLOCK_M, BLOCK_N], or [BLOCK_M, BLOCK_N // 2] with EPILOGUE_SUBTILE (two half stores,
    half the shared memory for the store buffer).
    """
    if HAS_BIAS:
        offs_n = off_n + tl.arange(0, BLOCK_N)
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    if EPILOGUE_SUBTILE:
        acc3 = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        acc0, acc1 = tl.split(acc3)
        c_desc.store([off_m, off_n], acc0.to(c_desc.dtype))
        c_desc.store([off_m, off_n + BLOCK_N // 2], acc1.to(c_desc.dtype))
    else:
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


@triton.jit
def stream_k_tail(a_desc, b_desc, c_desc, bias_ptr, ws_ptr, cnt_ptr, N, num_pid_m, num_pid_n, k_tiles,
                  first_tile, num_sk_tiles, iters_per_worker, num_workers, max_contrib,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  A_TRANS: tl.constexpr, B_TRANS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  EPILOGUE_SUBTILE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Tiles [first_tile, first_tile + num_sk_tiles) as one stream of K blocks cut into num_workers equal
    ranges of iters_per_worker (the last wave of a persistent GEMM, spread over every SM).

    Worker w (a virtual program, fixed by the host whatever the grid) computes its range; a tile covered by
    several workers gets fp32 partials in ws (slot tile * max_contrib + j), and whichever contributor arrives
    last (counter in cnt) sums the partials in slot order, stores the tile and sets the counter back to zero
    (so the counters need no per-call reset, and a CUDA graph replays). Nobody waits on anybody, and the sum
    order is fixed, so the result does not depend on the grid or timing.
    """
    total = num_sk_tiles * k_tiles
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    for w in range(tl.program_id(0), num_workers, tl.num_programs(0)):
        it = w * iters_per_worker
        it_end = tl.minimum(it + iters_per_worker, total)
        while it < it_end:
            t = it // k_tiles
            k0 = it - t * k_tiles
            k1 = tl.minimum(k_tiles, k0 + (it_end - it))
            pid_m, pid_n = tile_coords(first_tile + t, num_pid_m, num_pid_n, GROUP_M)
            acc = gemm_tile_k_range(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k0, k1,
                                    BLOCK_M, BLOCK_N, BLOCK_K, A_TRANS, B_TRANS, DOT_PRECISION)
            first_w = (t * k_tiles) // iters_per_worker
            n_contrib = ((t + 1) * k_tiles - 1) // iters_per_worker - first_w + 1
            if n_contrib == 1:
                gemm_epilogue(acc, c_desc, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, N,
                              BLOCK_M, BLOCK_N, HAS_BIAS, EPILOGUE_SUBTILE)
            else:
                slot0 = (t * max_contrib).to(tl.int64) * (BLOCK_M * BLOCK_N)
                tl.store(ws_ptr + slot0 + (w - first_w) * (BLOCK_M * BLOCK_N) + offs, acc)
                tl.debug_barrier()  # the whole tile is written before the one release below
                arrived = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
                if arrived == n_contrib - 1:
                    tl.debug_barrier()
                    total_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for j in range(n_contrib):
                        total_acc += tl.load(ws_ptr + slot0 + j * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
                    gemm_epilogue(total_acc, c_desc, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, N,
                                  BLOCK_M, BLOCK_N, HAS_BIAS, EPILOGUE_SUBTILE)
                    tl.store(cnt_ptr + t, 0)  # every contributor has arrived: nobody reads it again this call
            it += k1 - k0


@triton.jit
def gemm_persistent_kernel(a_desc, b_desc, c_desc, bias_ptr, ws_ptr, cnt_ptr, M, N, K,
                           num_dp_tiles, num_sk_tiles, sk_iters_per_worker, sk_workers, sk_max_contrib,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, A_TRANS: tl.constexpr, B_TRANS: tl.constexpr,
                           HAS_BIAS: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
                           STREAM_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """C = A @ B (+ bias) with host-side TMA descriptors (make_descriptors); grid <= #SMs.

    Tiles [0, num_dp_tiles) in grouped order, strided over programs (FLATTEN lets the compiler fuse the tile
    and K loops into one pipelined loop, so the next tile's loads overlap this tile's epilogue); with
    STREAM_K the remaining tiles go through stream_k_tail.
    """
    start = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # The epilogue recomputes its tile from its own counter: a value used both before and after the
    # (flattened, pipelined) K loop trips the pipeliner, as in Triton's persistent-matmul tutorial.
    tile_id_c = start - num_programs
    for tile_id in tl.range(start, num_dp_tiles, num_programs, flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = gemm_tile(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k_tiles,
                        BLOCK_M, BLOCK_N, BLOCK_K, A_TRANS, B_TRANS, DOT_PRECISION)
        tile_id_c += num_programs
        pid_m_c, pid_n_c = tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        gemm_epilogue(acc, c_desc, bias_ptr, pid_m_c * BLOCK_M, pid_n_c * BLOCK_N, N,
                      BLOCK_M, BLOCK_N, HAS_BIAS, EPILOGUE_SUBTILE)
    if STREAM_K:
        stream_k_tail(a_desc, b_desc, c_desc, bias_ptr, ws_ptr, cnt_ptr, N, num_pid_m, num_pid_n, k_tiles,
                      num_dp_tiles, num_sk_tiles, sk_iters_per_worker, sk_workers, sk_max_contrib,
                      BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, A_TRANS, B_TRANS, HAS_BIAS, EPILOGUE_SUBTILE,
                      DOT_PRECISION)


# ----------------------------------------------------------------------------------------------------------
# configs


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    group_m: int = 8
    epilogue_subtile: bool = True
    flatten: bool = True
    stream_k: bool = True  # spread a ragged last wave over all SMs (stream_k_tail) when the plan says it pays
    sk_max_split: int = 4  # at most this many workers (+1) share one stream-K tile
    half_tail: bool = False  # "ws", one consumer: the ragged last wave as tiles of block_m / 2 rows (plan_gemm)
    kernel: str = "pipelined"  # "pipelined": gemm_persistent_kernel; "ws": gemm_ws.gemm_ws_kernel (sm_90, 2-byte)
    ws_consumers: int = 2  # "ws": MMA partitions taking alternate tiles (2: ping-pong, 1: num_warps warps)
    ws_split: bool = False  # "ws", two consumers: they split every tile's rows instead of taking alternate tiles

    @property
    def name(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}_s{self.num_stages}w{self.num_warps}"
                f"g{self.group_m}{'_sub' if self.epilogue_subtile else ''}{'_flat' if self.flatten else ''}"
                f"{'_sk' if self.stream_k else ''}{'_ht' if self.half_tail else ''}"
                f"{f'_ws{self.ws_consumers}' if self.kernel == 'ws' else ''}{'_split' if self.ws_split else ''}")


# Candidates timed on the H200 (benchmarks/gemm.py --sweep, 2026-11-29): 128x256x64 s3 w8 subtiled flattened
# ("bn256") was best or within noise of the best on the whole bf16 grid; the 128x128 family was 9-10% slower.
# Fused kernels use "bn128" where they hold two accumulators.
CONFIGS: dict[str, GemmConfig] = {
    "bn256": GemmConfig(128, 256, 64, num_stages=3, num_warps=8),
    "bn256_s4": GemmConfig(128, 256, 64, num_stages=4, num_warps=8),
    "bn256_nosub": GemmConfig(128, 256, 64, num_stages=3, num_warps=8, epilogue_subtile=False),
    "bn256_nested": GemmConfig(128, 256, 64, num_stages=3, num_warps=8, flatten=False),
    "bn256_g16": GemmConfig(128, 256, 64, num_stages=3, num_warps=8, group_m=16),
    "bm256": GemmConfig(256, 128, 64, num_stages=3, num_warps=8),
    "bn128": GemmConfig(128, 128, 64, num_stages=4, num_warps=8, epilogue_subtile=False),
    "bn128_s5": GemmConfig(128, 128, 64, num_stages=5, num_warps=8, epilogue_subtile=False),
    "bn128_w4": GemmConfig(128, 128, 64, num_stages=4, num_warps=4, epilogue_subtile=False),
    "bn128_k128": GemmConfig(128, 128, 128, num_stages=3, num_warps=8),
    "bn128_nested": GemmConfig(128, 128, 64, num_stages=4, num_warps=8, epilogue_subtile=False, flatten=False),
    # Warp-specialized (gemm_ws.py). H200 sweep 2026-11-30 (whole tiles only; ratio to cuBLAS over the grid,
    # median / min): ws256_1c 1.013 / 0.64 (best on every shape with full waves), ws128_1c 0.969 / 0.81 (best
    # where 128x256 tiles leave the last wave mostly empty), ws128 ping-pong 0.949 / 0.75, ws64_1c 0.82 on
    # the QKV / gate+up shapes: plain_gemm_config picks between ws256_1c and ws128_1c_ht (below).
    "ws128": GemmConfig(128, 128, 64, num_stages=4, num_warps=4, epilogue_subtile=False, flatten=False,
                        stream_k=False, kernel="ws"),
    "ws128_1c": GemmConfig(128, 128, 64, num_stages=5, num_warps=4, epilogue_subtile=False, flatten=False,
                           stream_k=False, kernel="ws", ws_consumers=1),
    # ws128_1c with the stream-K tail (one consumer only: gemm_ws's partial store spills with 128x256 tiles):
    # slower than the half-tile tail on every ragged shape of the H200 sweep (2026-11-30), kept as the tested
    # alternative. ws128_1c_ht: the ragged last wave as 64-row half tiles, six stages (their short MMAs need
    # more loads in flight: 0.94 vs 0.88 of cuBLAS with five on M=4096, N=1280, K=8192).
    "ws128_1c_sk": GemmConfig(128, 128, 64, num_stages=5, num_warps=4, epilogue_subtile=False, flatten=False,
                              stream_k=True, kernel="ws", ws_consumers=1),
    "ws128_1c_ht": GemmConfig(128, 128, 64, num_stages=6, num_warps=4, epilogue_subtile=False, flatten=False,
                              stream_k=False, half_tail=True, kernel="ws", ws_consumers=1),
    "ws64_1c": GemmConfig(64, 128, 64, num_stages=6, num_warps=4, epilogue_subtile=False, flatten=False,
                          stream_k=False, kernel="ws", ws_consumers=1),
    "ws256_1c": GemmConfig(128, 256, 64, num_stages=3, num_warps=8, epilogue_subtile=False, flatten=False,
                           stream_k=False, kernel="ws", ws_consumers=1),
    # ws256_1c's tiles with their rows split between two 4-warp consumers that release each stage on their own
    # (no CTA barrier over both warpgroups per K step): 1.9-5.3% faster in the grouped GEMM (grouped_ws, claimed
    # tiles, thirty-sixth session). Here (benchmarks/gemm.py --sweep, one round, thirty-seventh session) 1.022x
    # cuBLAS at the median against ws256_1c's 1.011x: opt-in until more rounds say which shapes it should take.
    "ws256_2s": GemmConfig(128, 256, 64, num_stages=3, num_warps=4, epilogue_subtile=False, flatten=False,
                           stream_k=False, kernel="ws", ws_consumers=2, ws_split=True),
    # fp32 operands, TF32 tensor cores: 4-byte elements, so smaller K blocks fit the shared memory.
    "fp32": GemmConfig(128, 128, 32, num_stages=3, num_warps=8),
    # fp32 exact (no tensor cores, FMA): larger tiles spill registers (sm_90 compile: 64x64x16 w4 has none).
    "fp32_ieee": GemmConfig(64, 64, 16, num_stages=3, num_warps=4),
}


def select_config(M: int, N: int, K: int, dtype: torch.dtype) -> GemmConfig:
    """The config for a shape class (fixed table, no run-time tuning)."""
    if dtype == torch.float32:
        return CONFIGS["fp32" if input_precision(dtype) == "tf32" else "fp32_ieee"]
    return CONFIGS["bn256"]


# Time of a warp-specialized 128x256 tile, and of a 64x128 half tile, in 128x128 tile times (H200 sweeps of
# 2026-11-30: the 128x256 kernel is ~4-7% faster per FLOP where both fill their waves; 64x128 tiles run at
# about 0.82x the FLOP rate of 128x128 ones).
WS_WIDE_TILE_COST = 2 * 0.93
WS_HALF_TILE_COST = 0.62


def _ws_estimate(M: int, N: int, K: int, cfg: GemmConfig, workers: int) -> float:
    """Estimated time of the warp-specialized kernel with cfg, in 128x128 tile times (whole waves + tail)."""
    plan = plan_gemm(M, N, K, cfg, workers)
    tile_cost = WS_WIDE_TILE_COST if cfg.block_n == 256 else 1.0
    return math.ceil(plan.dp_tiles / workers) * tile_cost + (WS_HALF_TILE_COST if plan.half_tiles else 0.0)


def plain_gemm_config(M: int, N: int, K: int, dtype: torch.dtype, workers: int = 132,
                      ws_unavailable: Optional[str] = None) -> GemmConfig:
    """The config gemm() takes for a call without one: the warp-specialized kernel (128x256 tiles, or 128x128
    with a half-tile tail where that is estimated faster: ragged last waves) for bf16 / fp16, else select_config
    (also when ws_unavailable gives the reason the warp-specialized kernel cannot run). Fused kernels keep
    select_config: they reuse the Triton tile loop."""
    if ws_unavailable is not None or dtype not in (torch.bfloat16, torch.float16):
        return select_config(M, N, K, dtype)
    wide, narrow = CONFIGS["ws256_1c"], CONFIGS["ws128_1c_ht"]
    if _ws_estimate(M, N, K, narrow, workers) < _ws_estimate(M, N, K, wide, workers):
        return narrow
    return wide


_WS_SKIPS_LOGGED: set = set()


def default_config(a: torch.Tensor, lay: GemmLayout) -> GemmConfig:
    """The config gemm() takes for these operands (lay = check_operands(a, b, ...)) when it is given none: the
    warp-specialized kernel where it can run, else the Triton table; why it cannot run is logged once."""
    ws_reason = ws_unsupported(a, lay)
    if ws_reason is not None and a.dtype in (torch.bfloat16, torch.float16) and ws_reason not in _WS_SKIPS_LOGGED:
        _WS_SKIPS_LOGGED.add(ws_reason)
        log.info("kosmos gemm: the warp-specialized kernel cannot run (%s); the pipelined kernel runs", ws_reason)
    return plain_gemm_config(lay.M, lay.N, lay.K, a.dtype, num_sms(a.device), ws_reason)


@dataclass(frozen=True)
class GemmPlan:
    """How the tiles of one GEMM are spread: tiles [0, dp_tiles) whole, one per program in turn; the last
    sk_tiles as one stream of K blocks cut into sk_workers ranges of sk_iters (stream_k_tail), or the last
    half_tiles each as two tiles of block_m / 2 rows (the warp-specialized kernel's half_tail)."""
    tiles: int
    k_tiles: int
    dp_tiles: int
    sk_tiles: int = 0
    sk_workers: int = 0
    sk_iters: int = 0
    sk_max_contrib: int = 0
    half_tiles: int = 0

    @property
    def work_units(self) -> int:
        return self.dp_tiles + self.sk_workers + 2 * self.half_tiles


# Stream-K cost model: each extra partial of a tile (fp32 store, reload, sum) costs about as much as this many
# K blocks of the tile's loop (fitted to H200 timings of 2026-11-29: 9-15; see benchmarks/RESULTS.md).
SK_PARTIAL_COST_K_BLOCKS = 12.0
SK_MIN_GAIN = 0.05


def plan_gemm(M: int, N: int, K: int, cfg: GemmConfig, workers: int, force_stream_k: Optional[bool] = None
              ) -> GemmPlan:
    """Tile schedule for `workers` programs (the SM count, never the actual grid, so results do not depend on
    the grid). Stream-K covers the ragged last wave when the estimated time drops by SK_MIN_GAIN or more; a
    half_tail config cuts it in half tiles when they fit in one wave (force_stream_k=True: whenever it is
    ragged; False: never)."""
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    k_tiles = triton.cdiv(K, cfg.block_k)
    plain = GemmPlan(tiles, k_tiles, tiles)
    if cfg.half_tail:
        rest = tiles % workers if workers > 0 else 0
        if force_stream_k is False or rest == 0 or (not force_stream_k and 2 * rest > workers):
            return plain
        return GemmPlan(tiles, k_tiles, tiles - rest, half_tiles=rest)
    if not cfg.stream_k or force_stream_k is False or workers < 2 or tiles == 0 or k_tiles < 2:
        return plain
    waves, rest = divmod(tiles, workers)
    if rest == 0:
        return plain
    sk_tiles = rest
    iters = max(triton.cdiv(sk_tiles * k_tiles, workers), triton.cdiv(k_tiles, cfg.sk_max_split))
    max_contrib = triton.cdiv(k_tiles, iters) + 1
    sk_workers = triton.cdiv(sk_tiles * k_tiles, iters)
    t_plain = waves + 1.0
    t_sk = waves + (iters + (max_contrib - 1) * SK_PARTIAL_COST_K_BLOCKS) / k_tiles
    if not force_stream_k and t_sk > (1.0 - SK_MIN_GAIN) * t_plain:
        return plain
    return GemmPlan(tiles, k_tiles, tiles - sk_tiles, sk_tiles, sk_workers, iters, max_contrib)


# ----------------------------------------------------------------------------------------------------------
# host side

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class GemmUnsupported(ValueError):
    """The persistent GEMM cannot take these operands (dtype, layout, alignment, device); use a reference path."""


def input_precision(dtype: torch.dtype) -> str:
    """What the tensor cores multiply for this input dtype: 'bf16', 'fp16', or for fp32 'tf32' when
    torch.backends.cuda.matmul.allow_tf32 is set, else 'ieee' (exact fp32)."""
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    raise GemmUnsupported(f"gemm: unsupported dtype {dtype}")


def _operand_layout(name: str, t: torch.Tensor) -> tuple[bool, int]:
    """(transposed, leading stride in elements) of a 2-D operand: row-major -> (False, stride(0)); a transposed
    view of a row-major tensor -> (True, stride(1)). A single row/column takes any stride; it gets the
    smallest 16-byte aligned one (TMA never steps over it)."""
    rows, cols = t.shape
    s0, s1 = t.stride()
    size = t.element_size()

    def pad(n: int) -> int:
        return -(-n * size // 16) * 16 // size

    if rows == 1 and (s1 == 1 or cols == 1):
        return False, pad(cols)
    if cols == 1 and (s0 == 1 or rows == 1):
        return True, pad(rows)
    if s1 == 1:
        return False, s0
    if s0 == 1:
        return True, s1
    raise GemmUnsupported(f"gemm: {name} of shape {tuple(t.shape)} and strides {tuple(t.stride())} has no unit "
                          "stride (needs row-major or a transposed view of a row-major tensor)")


def _check_tma(name: str, t: torch.Tensor, lead: int) -> None:
    size = t.element_size()
    if t.data_ptr() % 16:
        raise GemmUnsupported(f"gemm: {name} data pointer is not 16-byte aligned (TMA needs it)")
    if (lead * size) % 16:
        raise GemmUnsupported(f"gemm: {name} leading stride {lead} x {size} bytes is not a multiple of 16 "
                              f"(TMA needs 16-byte aligned strides)")


@dataclass(frozen=True)
class GemmLayout:
    """Shapes and TMA layouts of one call: *_trans = operand is a transposed view, *_lead = its leading stride."""
    M: int
    N: int
    K: int
    a_trans: bool = False
    a_lead: int = 0
    b_trans: bool = False
    b_lead: int = 0


def why_unsupported(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    out: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why gemm(a, b, bias, out=out) would raise GemmUnsupported, or None when it runs."""
    try:
        check_operands(a, b, bias, out)
    except GemmUnsupported as e:
        return str(e)
    return None


def check_operands(a, b, bias=None, out=None) -> GemmLayout:
    """Checks what the TMA path needs; raises GemmUnsupported with the reason otherwise."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise GemmUnsupported(f"gemm: {name} is not a tensor")
        if t.dim() != 2:
            raise GemmUnsupported(f"gemm: {name} must be 2-D, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise GemmUnsupported(f"gemm: {name} has dtype {t.dtype}; supported: bfloat16, float16, float32")
    if a.dtype != b.dtype:
        raise GemmUnsupported(f"gemm: dtype mismatch, a {a.dtype} vs b {b.dtype}")
    if a.shape[1] != b.shape[0]:
        raise GemmUnsupported(f"gemm: K mismatch, a {tuple(a.shape)} @ b {tuple(b.shape)}")
    if a.device != b.device:
        raise GemmUnsupported(f"gemm: a on {a.device}, b on {b.device}")
    M, K = a.shape
    N = b.shape[1]
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != N:
            raise GemmUnsupported(f"gemm: bias must be a 1-D tensor of {N} elements")
        if bias.dtype != a.dtype or bias.device != a.device:
            raise GemmUnsupported(f"gemm: bias must be {a.dtype} on {a.device}, got {bias.dtype} on {bias.device}")
        if N > 1 and bias.stride(0) != 1:
            raise GemmUnsupported("gemm: bias must be contiguous")
    if out is not None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (M, N) or out.dtype != a.dtype \
                or out.device != a.device:
            raise GemmUnsupported(f"gemm: out must be {a.dtype} [{M}, {N}] on {a.device}")
        if out.numel() and _operand_layout("out", out)[0]:
            raise GemmUnsupported("gemm: out must be row-major")
    if a.device.type != "cuda" and not runtime.interpreting():
        raise GemmUnsupported(f"gemm: {a.device.type} tensors (the persistent GEMM needs CUDA)")
    if a.device.type == "cuda" and torch.cuda.get_device_capability(a.device)[0] < 9:
        raise GemmUnsupported("gemm: TMA descriptors need compute capability >= 9.0")
    if M == 0 or N == 0 or K == 0:
        return GemmLayout(M, N, K)
    a_trans, a_lead = _operand_layout("a", a)
    b_trans, b_lead = _operand_layout("b", b)
    _check_tma("a", a, a_lead)
    _check_tma("b", b, b_lead)
    if out is not None:
        _check_tma("out", out, _operand_layout("out", out)[1])
    elif (N * a.element_size()) % 16:
        raise GemmUnsupported(f"gemm: N={N} {a.dtype} elements per output row are not a multiple of 16 bytes "
                              "(TMA store)")
    return GemmLayout(M, N, K, a_trans, a_lead, b_trans, b_lead)


def make_descriptors(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, cfg: GemmConfig, lay: GemmLayout):
    """Host-side TMA descriptors (a_desc, b_desc, c_desc) with the block shapes gemm_tile/gemm_epilogue expect."""
    M, N, K = lay.M, lay.N, lay.K
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    if lay.a_trans:
        a_desc = TensorDescriptor(a, [K, M], [lay.a_lead, 1], [BK, BM])
    else:
        a_desc = TensorDescriptor(a, [M, K], [lay.a_lead, 1], [BM, BK])
    if lay.b_trans:
        b_desc = TensorDescriptor(b, [N, K], [lay.b_lead, 1], [BN, BK])
    else:
        b_desc = TensorDescriptor(b, [K, N], [lay.b_lead, 1], [BK, BN])
    c_desc = TensorDescriptor(c, [M, N], [_operand_layout("c", c)[1], 1],
                              [BM, BN // 2 if cfg.epilogue_subtile else BN])
    return a_desc, b_desc, c_desc


_SM_COUNT: dict[int, int] = {}
_SK_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def stream_k_counters(device: torch.device, n: int) -> torch.Tensor:
    """n zeroed int32 arrival counters for stream-K tiles, one buffer per (device, stream), grown when needed.
    The kernel leaves them zero (the last contributor of a tile resets its counter), so no call zeroes them;
    calls on one stream run in order, so they never share a counter at the same time."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, device=device, dtype=torch.int32)  # the graph's own (its replays keep it zero)
    key = (device.index if device.index is not None else torch.cuda.current_device(),
           torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else (-1, 0)
    buf = _SK_COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        size = max(n, 256)
        buf = _SK_COUNTERS[key] = runtime.kept_tensor(device, lambda: torch.zeros(size, device=device,
                                                                                 dtype=torch.int32))
    return buf


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few programs, so the persistent loop runs several tiles each
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
         out: Optional[torch.Tensor] = None, config: Optional[GemmConfig] = None,
         num_programs: Optional[int] = None, stream_k: Optional[bool] = None) -> torch.Tensor:
    """C = a @ b (+ bias), a [M, K], b [K, N] (row-major, or w.t() of a row-major [N, K] weight), bias [N].

    bf16/fp16/fp32 in, fp32 accumulate, output in the input dtype. fp32 uses TF32 only when
    torch.backends.cuda.matmul.allow_tf32 is set (input_precision(dtype) says which ran). Raises
    GemmUnsupported (a ValueError) for operands the TMA path cannot take. config overrides the table;
    num_programs caps the grid (default: one program per SM; results are bit-identical for any value);
    stream_k forces the stream-K tail on or off (default: plan_gemm decides).
    """
    lay = check_operands(a, b, bias, out)
    M, N, K = lay.M, lay.N, lay.K
    if num_programs is not None and num_programs < 1:
        raise ValueError(f"gemm: num_programs must be >= 1, got {num_programs}")
    c = out if out is not None else torch.empty((M, N), device=a.device, dtype=a.dtype)
    if M == 0 or N == 0:
        return c
    if K == 0:
        c.zero_()
        if bias is not None:
            c += bias
        return c
    if config is None:
        cfg = default_config(a, lay)  # takes the warp-specialized kernel only where it can run
    else:
        cfg = config
        reason = ws_unsupported(a, lay) if cfg.kernel == "ws" else None
        if reason is not None:
            raise GemmUnsupported(f"gemm: config {cfg.name} (warp-specialized): {reason}")
    precision = input_precision(a.dtype)
    sms = num_sms(a.device)
    plan = plan_gemm(M, N, K, cfg, sms, force_stream_k=stream_k)
    programs = min(plan.work_units, num_programs or sms)
    if plan.sk_tiles:
        ws = torch.empty(plan.sk_tiles * plan.sk_max_contrib * cfg.block_m * cfg.block_n, device=a.device,
                         dtype=torch.float32)
        cnt = stream_k_counters(a.device, plan.sk_tiles)
    else:
        ws, cnt = c, c  # never touched without STREAM_K
    if cfg.kernel == "ws":
        gemm_ws_host.launch(a, b, bias, c, cfg, lay, plan, ws, cnt, programs)
        return c
    a_desc, b_desc, c_desc = make_descriptors(a, b, c, cfg, lay)
    gemm_persistent_kernel[(programs,)](
        a_desc, b_desc, c_desc, bias if bias is not None else c, ws, cnt, M, N, K,
        plan.dp_tiles, plan.sk_tiles, plan.sk_iters, plan.sk_workers, plan.sk_max_contrib,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        A_TRANS=lay.a_trans, B_TRANS=lay.b_trans, HAS_BIAS=bias is not None,
        EPILOGUE_SUBTILE=cfg.epilogue_subtile, FLATTEN=cfg.flatten, STREAM_K=plan.sk_tiles > 0,
        DOT_PRECISION="ieee" if precision == "ieee" else "tf32",
        num_stages=cfg.num_stages, num_warps=cfg.num_warps, **runtime.COMPILE_OPTIONS)
    return c
