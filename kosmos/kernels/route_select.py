"""The reference forward's routing selection in one launch: the fused forward's ROUTE selection
(moe_route.select_stored_tile) on the logits of the router GEMM.

torch's ops (kosmos.ops.moe_math.route) take the scores, DeepSeek-V3's group-limited masks, torch.topk, the gather
and the renormalisation in about ten launches, torch.topk's gatherTopK the longest of them: 0.57 ms of
DeepSeek-V3's T = 16384 forward on the H200 (benchmarks/RESULTS.md, fortieth session). The selection is the fused
forward's, so both forwards route alike: scores, choice values and weights rounded as the torch ops round them,
ties to the lowest expert id, each row's ids in descending order of their choice values. Registered as the row
kernel "moe_route_select" (through kosmos.kernels.moe_ops, which records the run)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kosmos.kernels import runtime
from kosmos.kernels.moe_route import select_stored_tile

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NUM_WARPS = 4


def tile_rows(block_e: int) -> int:
    """Token rows per program for block_e expert columns: 4 for Qwen3-MoE's 128 and DeepSeek-V3's 256 experts, the
    fastest of six (rows, warps) choices on the H200 (benchmarks/route_select.py, RESULTS.md fortieth session:
    0.126 ms at DeepSeek-V3's T = 16384 where [16, 256] tiles on 8 warps took 0.167, 0.028 ms at Qwen3's where
    [32, 128] took 0.040); [rows, block_e] tiles of at most 512 values otherwise."""
    return max(4, min(64, 512 // block_e))


@triton.jit
def _select_kernel(logits, cb, ids, w, ranks, counts, T, E, rsf, eps, NORM: tl.constexpr, SCALED: tl.constexpr,
                   SIGMOID: tl.constexpr, HAS_CB: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   SD_ROUND: tl.constexpr, CD_ROUND: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                   BT: tl.constexpr, BLOCK_E: tl.constexpr, W_F32: tl.constexpr):
    select_stored_tile(tl.program_id(0), cb, logits, ids, w, ranks, counts, T, E, rsf, eps, NORM, SCALED, SIGMOID,
                       HAS_CB, N_GROUP, TOPK_GROUP, SD_ROUND, CD_ROUND, TOP_K, KP, BT, BLOCK_E, W_F32)


def unsupported(logits: torch.Tensor, score_correction_bias: Optional[torch.Tensor], top_k: int, scoring: str,
                n_group: int, topk_group: int, weights_dtype: Optional[torch.dtype]) -> Optional[str]:
    """Why select cannot route on these logits [T, E], or None."""
    from kosmos.kernels.moe_ops import MAX_EXPERTS, MAX_TOP_K

    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        return f"logits {tuple(logits.shape)} {logits.dtype} (a [T, E] of a float dtype)"
    E = logits.shape[1]
    if scoring not in ("softmax", "sigmoid"):
        return f"scoring {scoring!r}"
    if E > MAX_EXPERTS or not 0 < top_k <= min(E, MAX_TOP_K):
        return f"top-{top_k} of {E} experts (at most {MAX_TOP_K} of at most {MAX_EXPERTS})"
    if n_group < 1 or n_group & (n_group - 1) or E % n_group or not 0 < topk_group <= n_group:
        return f"{n_group} expert groups, {topk_group} kept, of {E} experts (groups a power of two dividing E)"
    if top_k > topk_group * (E // n_group):
        return f"top-{top_k} from {topk_group} groups of {E // n_group} experts"
    if score_correction_bias is not None and (score_correction_bias.dtype not in _DTYPES
                                              or score_correction_bias.shape != (E,)
                                              or score_correction_bias.device != logits.device):
        return f"score_correction_bias {tuple(score_correction_bias.shape)} {score_correction_bias.dtype}"
    if weights_dtype not in (None, torch.float32, logits.dtype):
        return f"weights dtype {weights_dtype} (the logits' or float32)"
    if logits.device.type != "cuda" and not runtime.interpreting():
        return f"logits on {logits.device} (a CUDA kernel)"
    return None


# the routing constexprs (moe.routing_constexprs) that _select_kernel takes
ROUTING_KEYS = ("NORM", "SCALED", "SIGMOID", "HAS_CB", "N_GROUP", "TOPK_GROUP", "SD_ROUND", "CD_ROUND", "TOP_K", "KP",
                "BLOCK_E")


def kernel_constexprs(routing: dict, tile: Optional[int] = None, w_f32: bool = False) -> dict:
    """_select_kernel's constexprs from moe.routing_constexprs' dict: its routing keys, the tile's token rows
    (default tile_rows) and W_F32 (fp32 weights on logits of another dtype)."""
    return dict(**{key: routing[key] for key in ROUTING_KEYS}, BT=tile or tile_rows(routing["BLOCK_E"]), W_F32=w_f32)


def select(logits: torch.Tensor, score_correction_bias: Optional[torch.Tensor], top_k: int, scoring: str,
           norm_topk_prob: bool, n_group: int, topk_group: int, routed_scaling_factor: float, eps: float,
           weights_dtype: Optional[torch.dtype] = None, tile: Optional[int] = None,
           num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k] int64, topk_weights [T, k] in weights_dtype, default the logits') of the router on logits
    [T, E]: the reference router's arguments (kosmos.ops.moe_math.route); eps is added to the weights' sum for
    sigmoid scoring. tile / num_warps: token rows per program (default tile_rows) and warps (benchmarks/
    route_select.py sweeps them). Raises ValueError where `unsupported` says why."""
    reason = unsupported(logits, score_correction_bias, top_k, scoring, n_group, topk_group, weights_dtype)
    if reason is not None:
        raise ValueError(f"kosmos route_select: {reason}")
    return launch_select(logits, score_correction_bias, top_k, scoring, norm_topk_prob, n_group, topk_group,
                         routed_scaling_factor, eps, weights_dtype, tile, num_warps)


def launch_select(logits: torch.Tensor, score_correction_bias: Optional[torch.Tensor], top_k: int, scoring: str,
                  norm_topk_prob: bool, n_group: int, topk_group: int, routed_scaling_factor: float, eps: float,
                  weights_dtype: Optional[torch.dtype] = None, tile: Optional[int] = None,
                  num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """select for arguments `unsupported` has already accepted: the buffers, the constexprs, the launch."""
    from kosmos.kernels.moe import routing_constexprs

    T, E = logits.shape
    device = logits.device
    ids = torch.empty(T, top_k, dtype=torch.int64, device=device)
    weights = torch.empty(T, top_k, dtype=weights_dtype or logits.dtype, device=device)
    if T == 0:
        return ids, weights
    routing = routing_constexprs(scoring, norm_topk_prob, n_group, topk_group, routed_scaling_factor, logits.dtype,
                                 None, score_correction_bias, top_k, E, logits.dtype, logits.dtype, None,
                                 weights_dtype)
    consts = kernel_constexprs(routing, tile, weights.dtype != logits.dtype)
    tiles = triton.cdiv(T, consts["BT"])
    # the fused forward's per-tile expert counts and per-pair ranks: written, not needed here
    ranks = torch.empty(T, top_k, dtype=torch.int32, device=device)
    counts = torch.empty(tiles, E, dtype=torch.int32, device=device)
    logits = logits.contiguous()
    cb = score_correction_bias.contiguous() if score_correction_bias is not None else logits
    _select_kernel[(tiles,)](logits, cb, ids, weights, ranks, counts, T, E, float(routed_scaling_factor), float(eps),
                             num_warps=num_warps, **consts, **runtime.COMPILE_OPTIONS)
    return ids, weights
