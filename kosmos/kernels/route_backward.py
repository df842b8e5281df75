"""The reference backward's router on the forward's kept choices, one launch per step: the routing weights of the
kept top-k ids, and the logits' gradient from the weights' gradient.

torch's ops (kosmos.ops.moe_math `_route_forward` with the ids given, `_router_d_logits`) take about eighteen
launches for the two: softmax, gather, the renormalisation, then the scatter of d into the scores and the softmax
or sigmoid backward, each a pass over [T, E] or [T, k] and a host dispatch (about 0.3 ms of host time per
Qwen3-30B-A3B step, RESULTS.md fifty-eighth session). The math is the fused backward's FOLD task's
(moe_route.scores_of / routing_weights / router_d_logits): scores as the fused forward computes them, every op in
the reference's dtype. Registered as the row kernels "moe_route_weights" and "moe_router_d_logits" (through
kosmos.kernels.moe_ops, which records the runs)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kosmos.kernels import launch_plan, runtime
from kosmos.kernels.moe_route import router_d_logits, routing_weights, scores_at, scores_of

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NUM_WARPS = 4


@triton.jit
def _tile_scores(logits, ids_ptr, T, E, SIGMOID: tl.constexpr, SD_ROUND: tl.constexpr, TOP_K: tl.constexpr,
                 KP: tl.constexpr, BT: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's token rows: their scores [BT, BLOCK_E], kept ids and the scores there [BT, KP], and the
    offsets / masks of both tiles."""
    RD: tl.constexpr = logits.dtype.element_ty
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rows64 = rows.to(tl.int64)
    rmask = rows < T
    cols_e = tl.arange(0, BLOCK_E)
    emask = cols_e < E
    colk = tl.arange(0, KP)
    em2 = rmask[:, None] & emask[None, :]
    e_offs = rows64[:, None] * E + cols_e[None, :]
    k_offs = rows64[:, None] * TOP_K + colk[None, :]
    m2 = rmask[:, None] & (colk < TOP_K)[None, :]
    scores = scores_of(tl.load(logits + e_offs, mask=em2, other=0.0), emask, SIGMOID, RD, SD_ROUND)
    ids = tl.load(ids_ptr + k_offs, mask=m2, other=0).to(tl.int32)
    vals = scores_at(scores, ids, colk, cols_e, TOP_K, KP)
    return scores, ids, vals, colk, cols_e, e_offs, em2, k_offs, m2


@triton.jit
def _weights_kernel(logits, ids_ptr, w_ptr, T, E, rsf, eps, NORM: tl.constexpr, SCALED: tl.constexpr,
                    SIGMOID: tl.constexpr, SD_ROUND: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                    BT: tl.constexpr, BLOCK_E: tl.constexpr):
    RD: tl.constexpr = logits.dtype.element_ty
    scores, ids, vals, colk, cols_e, e_offs, em2, k_offs, m2 = _tile_scores(logits, ids_ptr, T, E, SIGMOID, SD_ROUND,
                                                                            TOP_K, KP, BT, BLOCK_E)
    wts = routing_weights(vals, colk < TOP_K, rsf, eps, NORM, SCALED, SIGMOID, RD, SD_ROUND)
    tl.store(w_ptr + k_offs, wts.to(w_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _d_logits_kernel(logits, ids_ptr, dw_ptr, glog, dl, T, E, rsf, eps, NORM: tl.constexpr, SCALED: tl.constexpr,
                     SIGMOID: tl.constexpr, SD_ROUND: tl.constexpr, HAS_GLOG: tl.constexpr, TOP_K: tl.constexpr,
                     KP: tl.constexpr, BT: tl.constexpr, BLOCK_E: tl.constexpr):
    RD: tl.constexpr = logits.dtype.element_ty
    scores, ids, vals, colk, cols_e, e_offs, em2, k_offs, m2 = _tile_scores(logits, ids_ptr, T, E, SIGMOID, SD_ROUND,
                                                                            TOP_K, KP, BT, BLOCK_E)
    # the reference takes d_weights into the scores' dtype first
    dw = tl.load(dw_ptr + k_offs, mask=m2, other=0.0).to(tl.float32)
    if SD_ROUND:
        dw = dw.to(RD).to(tl.float32)
    dlog = router_d_logits(scores, vals, ids, dw, colk, cols_e, colk < TOP_K, rsf, eps, NORM, SCALED, SIGMOID, RD,
                           SD_ROUND, TOP_K)
    if HAS_GLOG:
        dlog += tl.load(glog + e_offs, mask=em2, other=0.0).to(tl.float32)
    tl.store(dl + e_offs, dlog.to(RD), mask=em2)


def tile_rows(block_e: int) -> int:
    """Token rows per program: [rows, block_e] tiles of at most 512 values (route_select's rule), 4 at Qwen3-MoE's
    128 experts."""
    return max(4, min(64, 512 // block_e))


def unsupported(logits: torch.Tensor, ids: torch.Tensor, scoring: str, weights_dtype: Optional[torch.dtype],
                *grads: Optional[torch.Tensor]) -> Optional[str]:
    """Why these kernels cannot take the router's logits [T, E] with the kept ids [T, k] (and the gradients
    `grads`: the weights' [T, k], the logits' [T, E] or None), or None."""
    from kosmos.kernels.moe_ops import MAX_EXPERTS, MAX_TOP_K

    if logits.dim() != 2 or logits.dtype not in _DTYPES or not logits.is_contiguous():
        return f"logits {tuple(logits.shape)} {logits.dtype} (a contiguous [T, E] of a float dtype)"
    T, E = logits.shape
    if ids.dim() != 2 or ids.shape[0] != T or ids.dtype.is_floating_point or not ids.is_contiguous():
        return f"ids {tuple(ids.shape)} {ids.dtype} (contiguous integer [{T}, k])"
    if scoring not in ("softmax", "sigmoid"):
        return f"scoring {scoring!r}"
    top_k = ids.shape[1]
    if E > MAX_EXPERTS or not 0 < top_k <= min(E, MAX_TOP_K):
        return f"top-{top_k} of {E} experts (at most {MAX_TOP_K} of at most {MAX_EXPERTS})"
    if weights_dtype not in (None, torch.float32, logits.dtype):
        return f"weights dtype {weights_dtype} (the logits' or float32)"
    for g, shape in zip(grads, ((T, top_k), (T, E))):
        if g is not None and (tuple(g.shape) != shape or g.dtype not in _DTYPES or not g.is_contiguous()
                              or g.device != logits.device):
            return f"gradient {tuple(g.shape)} {g.dtype} (a contiguous {shape} of a float dtype)"
    if logits.device.type != "cuda" and not runtime.interpreting():
        return f"logits on {logits.device} (a CUDA kernel)"
    if ids.device != logits.device:
        return f"ids on {ids.device}, logits on {logits.device}"
    return None


def _constexprs(logits: torch.Tensor, top_k: int, scoring: str, norm_topk_prob: bool,
                routed_scaling_factor: float) -> dict:
    from kosmos.kernels.moe import routing_constexprs

    E = logits.shape[1]
    routing = routing_constexprs(scoring, norm_topk_prob, 1, 1, routed_scaling_factor, logits.dtype, None, None, top_k,
                                 E, logits.dtype, logits.dtype)
    consts = {key: routing[key] for key in ("NORM", "SCALED", "SIGMOID", "SD_ROUND", "TOP_K", "KP", "BLOCK_E")}
    return dict(consts, BT=tile_rows(consts["BLOCK_E"]))


# key -> the launch kept for it, or the reason the kernels refuse such arguments (kosmos.kernels.launch_plan)
_plans = launch_plan.PlanCache()


def _launch(kernel, args: tuple, logits, ids, scoring, norm_topk_prob, routed_scaling_factor, weights_dtype,
            grads=(), meta=None) -> Optional[str]:
    """kernel over args through the launch kept for this signature (logits, ids and gradients as tensor keys, the
    router's flags), checked and built on its first call; -> the reason it refuses them (nothing launched), or None.
    The outputs in args are fresh allocations (the caching allocator's blocks are 512-byte aligned): not keyed."""
    key = (kernel, launch_plan.device_key(logits.device), launch_plan.tensor_key(logits), launch_plan.tensor_key(ids),
           scoring, bool(norm_topk_prob), float(routed_scaling_factor), weights_dtype,
           *(launch_plan.tensor_key(g) for g in grads))
    plan = _plans.get(key)
    if plan is None:
        plan = unsupported(logits, ids, scoring, weights_dtype, *grads)
        if plan is None:
            consts = dict(_constexprs(logits, ids.shape[1], scoring, norm_topk_prob, routed_scaling_factor),
                          **(meta or {}))
            grid = (triton.cdiv(ids.shape[0], consts["BT"]),)
            plan = launch_plan.kept_launch(kernel, grid, args, dict(consts, num_warps=NUM_WARPS))
        _plans.put(key, plan)
    if isinstance(plan, str):
        return plan
    if ids.shape[0]:
        plan(args)
    return None


def weights_or_reason(logits: torch.Tensor, ids: torch.Tensor, scoring: str, norm_topk_prob: bool,
                      routed_scaling_factor: float, eps: float, weights_dtype: Optional[torch.dtype] = None):
    """topk_weights [T, k] (in weights_dtype, default the logits') of the router on logits [T, E] at the kept
    ids [T, k]: the reference's `_route_forward(..., ids=ids)` weights; or the reason the kernel refuses them."""
    weights = torch.empty(ids.shape, dtype=weights_dtype or logits.dtype, device=logits.device)
    reason = _launch(_weights_kernel, (logits, ids, weights, ids.shape[0], logits.shape[1],
                                       float(routed_scaling_factor), float(eps)),
                     logits, ids, scoring, norm_topk_prob, routed_scaling_factor, weights_dtype)
    return weights if reason is None else reason


def d_logits_or_reason(logits: torch.Tensor, ids: torch.Tensor, d_weights: torch.Tensor,
                       grad_logits: Optional[torch.Tensor], scoring: str, norm_topk_prob: bool,
                       routed_scaling_factor: float, eps: float):
    """The router's logits gradient [T, E] in the logits' dtype from the weights' gradient d_weights [T, k] (plus
    grad_logits [T, E], the gradient of the logits output, if given): the reference's `_router_d_logits`; or the
    reason the kernel refuses them."""
    d_logits = torch.empty_like(logits)
    has_glog = grad_logits is not None
    reason = _launch(_d_logits_kernel, (logits, ids, d_weights, grad_logits if has_glog else logits, d_logits,
                                        ids.shape[0], logits.shape[1], float(routed_scaling_factor), float(eps)),
                     logits, ids, scoring, norm_topk_prob, routed_scaling_factor, None, (d_weights, grad_logits),
                     dict(HAS_GLOG=has_glog))
    return d_logits if reason is None else reason


def routing_weights_of(*args, **kwargs) -> torch.Tensor:
    """weights_or_reason, raising ValueError with the reason where the kernel refuses the arguments."""
    return _or_raise(weights_or_reason(*args, **kwargs))


def d_logits_of(*args, **kwargs) -> torch.Tensor:
    """d_logits_or_reason, raising ValueError with the reason where the kernel refuses the arguments."""
    return _or_raise(d_logits_or_reason(*args, **kwargs))


def _or_raise(got):
    if isinstance(got, str):
        raise ValueError(f"kosmos route_backward: {got}")
    return got
