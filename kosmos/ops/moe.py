"""MoE ops `kosmos::moe_layer` (router -> top-k -> experts -> fold) and `kosmos::moe_experts` (experts -> fold,
routing given), each with one backward op: schemas, fake impls, reference impls (their math in kosmos.ops.moe_math)
and registered autograd.

Semantics (the MoE pass rewrites HF blocks to exactly this; the fused CUDA kernels must match it):

moe_layer(hidden [T, H], router_weight [E, H], router_bias [E]?, score_correction_bias [E]?,
          gate_up_proj [E, 2I, H], down_proj [E, H, I], top_k, scoring, norm_topk_prob, n_group, topk_group,
          routed_scaling_factor, router_dtype, activation, return_router_logits, ep_group_name, ep_world_size,
          ep_mode="all_to_all", save_up=True, weights_dtype=None)
    -> (out [T, H] in hidden's dtype, router_logits [T, E] (under EP [0, E] unless return_router_logits; without
        EP always: the backward reads them instead of running the router GEMM again),
        tokens_per_expert [E] int32, saved_up [T * k + E, 2I] in gate_up_proj's dtype ([0, 2I] under EP),
        topk_ids [T, k] int32 ([0, k] under EP): the routing this call used, whose pairs saved_up's rows hold)

    router (exactly HF transformers v5):
        rd      = router_dtype or hidden.dtype
        logits  = linear(hidden.to(rd), router_weight.to(rd), router_bias?.to(rd))           # [T, E], dtype rd
        scores  = softmax(logits, -1, dtype=float32)   if scoring == "softmax"   (Qwen3-MoE, Mixtral, ...)
                  sigmoid(logits)                      if scoring == "sigmoid"   (DeepSeek-V3)
        "softmax" with no score_correction_bias and n_group == 1 (Qwen3-MoE):
            weights, ids = topk(scores, top_k)                                     # sorted
            weights /= weights.sum(-1, keepdim=True)                 if norm_topk_prob
        otherwise (DeepSeek-V3 group-limited selection):
            choice  = scores + score_correction_bias (if given)                    # selection only: no grad
            if n_group > 1: keep the topk_group groups (of E / n_group experts) with the largest
                            sum of their 2 best `choice` values; the others get -inf
            ids     = topk(choice, top_k, sorted=False).indices
            weights = scores.gather(-1, ids)
            weights /= weights.sum(-1, keepdim=True) + (1e-20 if scoring == "sigmoid" else 0)  if norm_topk_prob
        weights *= routed_scaling_factor                   (skipped when it is 1.0 and scoring is "softmax")
        weights  = weights.to(weights_dtype or logits.dtype)   (Mixtral keeps its fp32 weights: weights_dtype)
    experts (HF `grouped_mm` experts, no token dropping; every (token, slot) pair is computed):
        for each pair (t, j), e = ids[t, j]:
            gate, up = (hidden[t].to(W) @ gate_up_proj[e].T).chunk(2)             # W = gate_up_proj.dtype
            y[t, j]  = (silu(gate) * up).to(down_proj.dtype) @ down_proj[e].T
        out[t] = sum_j (y[t, j] * weights[t, j]).to(hidden.dtype)  (product in promote(W, logits) dtype,
                 summed over j in that dtype, then cast; the order of the j terms is not part of the contract)
        tokens_per_expert[e] = number of pairs routed to e

moe_experts(hidden [T, H], topk_ids [T, k] int, topk_weights [T, k], gate_up_proj, down_proj, activation,
            ep_group_name, ep_world_size) -> (out [T, H], tokens_per_expert [E] int32)
    the experts part above, with the routing given (the HF experts interface route, kosmos.hf_experts).

saved_up, the activation moe_layer saves for its backward: the up projection of every (token, slot) pair,
[gate | up] = (hidden[t].to(W) @ gate_up_proj[e].T) rounded to W, in padded expert-sorted rows: with count_e the
pairs routed to expert e and start_e = sum of count_e' over e' < e, row start_e + e is a zero pad row, followed by
expert e's pairs in ascending token order. The fused forward writes the same layout. It is what HF's grouped_mm
path keeps of the experts too (the output of the first grouped matmul); Inductor keeps more (tests/
test_moe_saved_activations.py). Under EP the rows an owner computes depend on the routing (no static shape), so
saved_up is empty and the backward recomputes the up projection.

topk_ids, the routing saved_up's rows follow: the backward takes it instead of selecting the top-k again. The fused
forward routes in its own kernel and the reference backward with torch ops: their logits differ in the last bits
(summation order), so a near-tie can pick another expert, and saved_up's rows would then belong to other pairs than
the backward's. With the forward's topk_ids the backward recomputes only the scores (for the router's gradient)
and gathers them at the forward's choices; with the forward's router_logits it takes the scores from them instead
of the router GEMM (DeepSeek-V3's fp32 router at T = 16384: 60 GFLOP, which cuBLAS ran in 1.35 ms in the forward's
profile, benchmarks/RESULTS.md eighth session).

Backward ops (one launch per direction; registered as the ops' autograd, so after AOT autograd the backward
graph holds one call per MoE layer):
    moe_layer_backward(grad_out, grad_router_logits?, <moe_layer's inputs to ep_mode but return_router_logits>,
                       weights_dtype?, grads_needed?, saved_up?, topk_ids?, router_logits?)
        (weights_dtype and grads_needed ahead of saved_up: Inductor's lowering of this mutating op loses a
        non-tensor argument after the mutated one)
        -> (d_hidden, d_router_weight, d_gate_up_proj, d_down_proj, d_router_bias ([0] without router_bias))
        grads_needed (5 flags in the outputs' order, None: all) comes from autograd's needs_input_grad (always a
        list: with None there Inductor's lowering of the mutating op drops the argument, torch 2.13): a frozen
        parameter's output is an empty [0] and its matmuls are not run (frozen experts, as in fine-tuning that
        trains attention only: their two weight-gradient grouped matmuls and the gather of x are about 30% of the
        backward; Inductor skips them too). The reference impl skips them without EP (the EP backward and the
        opt-in fused backward compute every gradient: the fused one is then not taken, with that reason).
        saved_up is overwritten (its storage holds the SwiGLU backward's d_up, then d_hidden): a second backward
        through the same saved tensors never reads it. Eagerly autograd's version check raises; in a compiled graph
        AOT autograd's donated-buffer check raises, or the backward was compiled without donating saved_up and the
        registered autograd hands the op a copy (`_may_overwrite`). Nothing saved: pass an empty [0, 2I] saved_up
        (as the autograd does); with None or left out, torch 2.11's version bump of the mutated argument indexes a
        positional that torch dropped as a default and raises IndexError (torch 2.13 fills the defaults first)
    moe_experts_backward(grad_out, <moe_experts' inputs>, grads_needed?)
        -> [d_hidden, d_topk_weights, d_gate_up_proj, d_down_proj] (grads_needed as moe_layer_backward's, 4 flags)
They save the forward's inputs (moe_layer also saved_up) and recompute the rest: the routing, and without
saved_up rows the up projection (`route_backward`, `experts_backward`: matmuls in the weights' dtype, sums in
fp32). With saved_up nothing of the experts is recomputed: d_topk_weights = <grad_out, y> is taken as
<grad_out @ down_proj[e], act>, from the same grouped matmul that gives d_act. score_correction_bias and topk_ids
get no gradient.

The reference experts (`experts`, `experts_backward`, and the EP ones below) sort the pairs by expert and run every
projection as ONE grouped matmul over the sorted rows (`_grouped_mm`; weight gradients `_grouped_wgrad`):
torch._grouped_mm where it has a kernel for the operands (CUDA bf16 on sm90/sm100, CPU fp32/bf16/fp16), with the
group offsets found on the device, so no host sync and a fixed number of launches whatever E; elsewhere (CUDA
fp16/fp32, other GPUs, strides not 16-byte aligned, operands that torch.autograd records) a loop over the experts,
one host sync per call for the counts. Without EP each expert's rows are led by a zero pad row (`_SortedPairs`):
no expert's group is empty and sentinel pairs read exact zeros, so no output needs masking. On CUDA the rows'
gathers (and the backward's SwiGLU rows and folds) run registered Triton row kernels (kosmos.kernels.moe_rows):
the same bits in fewer passes.

Expert parallelism (EP): with `ep_group_name` (a process group of `ep_world_size` ranks) the expert weights are
this rank's contiguous slice: gate_up_proj [E_loc, 2I, H], down_proj [E_loc, H, I], rank r owning the global
experts [r * E_loc, (r + 1) * E_loc), E = E_loc * ep_world_size. Everything else is per rank: hidden (and grad_out)
are this rank's own T tokens (T may differ between ranks), router_weight [E, H] and the biases are replicated, and
topk_ids hold global expert ids. Each rank routes its own tokens over all E experts; the routed (token, slot) rows
travel to their experts' owners and the expert outputs come back (all-to-all both ways), so `out` is exactly the
unsharded op's output for this rank's tokens. Gradients: d_hidden / d_topk_weights / router grads are this rank's
share (of its own tokens; summing the router grads over the group is the caller's job, e.g. kosmos.parallelize's
gradient hook), d_gate_up_proj / d_down_proj are the full gradients of the local experts (rows from all ranks).
tokens_per_expert is GLOBAL under EP: [E] pairs routed to each expert by all ranks of the group (summed over the
group; DeepSeek-V3's bias update wants the global load); without EP it counts this rank's pairs.

The EP reference impl (`ep_experts`, `ep_experts_backward`) uses functional collectives on the group:
    1. all_to_all_single of the per-expert pair counts [E] (-> [ep, E_loc]: what each source sends to each of my
       experts), then `.tolist()`: ONE HOST SYNC per call (per direction), because all_to_all_single takes its
       split sizes as host ints. Acceptable for the reference path; the fused kernel exchanges counts on device.
    2. dispatch: all_to_all_single of the routed token rows (sorted by expert, hence by owner) to the owners;
       backward also dispatches d_y = grad_out[token] * weight rows.
    3. the owner runs its local experts on the rows grouped by expert (sources in rank order; the grouped
       matmuls take the counts of step 1), then
    4. combine: all_to_all_single of the expert outputs y (backward: y and d_x rows) back to their home ranks,
       where the weighting and the fold over the k slots happen in the same order as without EP.
    5. tokens_per_expert: all_reduce (sum) of the per-rank counts.
No token is dropped; output shapes do not depend on the routing (the fake impls agree).

moe_layer's ep_mode="all_reduce" is the other expert-parallel layout (transformers' AllReduceEP): the tokens are
replicated over the group, each rank routes all of them, computes only the (token, slot) pairs of its own experts
and the group sums the partial outputs (all_reduce of out, in hidden's dtype). Per rank it is exactly what that
traced HF graph computes, whatever the ranks hold: backward sums the experts' d_hidden and d_topk_weights over the
group (one all_reduce of both, fp32) before the router backward, which stays local like HF's router;
tokens_per_expert counts this rank's pairs over all E experts (the same on every rank when the tokens are).
"""
from __future__ import annotations

from typing import Optional

import torch

from kosmos.ops import dispatch, split_mm, version_bump
from kosmos.ops.moe_math import (_SortedPairs, _experts_any, _experts_backward_any, _fold_saved, _grouped_mm,
                                 _replicated_backward, _replicated_forward, _route_forward, _router_d_logits,
                                 _router_param_grads, ep_experts, experts, experts_backward_saved_rows, route,
                                 route_backward)

SCORINGS = ("softmax", "sigmoid")
EP_MODES = ("all_to_all", "all_reduce")
ACTIVATIONS = ("silu",)


# ----------------------------------------------------------------------------------------------- checks


def _check_experts_args(op: str, hidden, gate_up_proj, down_proj, activation, ep_group_name, ep_world_size) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"kosmos::{op}: hidden must be [T, H], got {tuple(hidden.shape)}")
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(
            f"kosmos::{op}: gate_up_proj must be [E, 2I, H] and down_proj [E, H, I], got "
            f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}"
        )
    e, two_i, h = gate_up_proj.shape
    if h != hidden.shape[1] or two_i % 2 != 0 or tuple(down_proj.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"kosmos::{op}: shapes do not fit: hidden {tuple(hidden.shape)}, gate_up_proj {tuple(gate_up_proj.shape)} "
            f"(expected [E, 2I, H={hidden.shape[1]}]), down_proj {tuple(down_proj.shape)} (expected [E, H, I])"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"kosmos::{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if ep_group_name is None and ep_world_size != 1:
        raise ValueError(f"kosmos::{op}: ep_world_size={ep_world_size} needs an ep_group_name "
                         "(None: all experts local)")
    if ep_world_size < 1:
        raise ValueError(f"kosmos::{op}: ep_world_size={ep_world_size} must be >= 1")


def _check_ep_group(op: str, ep_group_name, ep_world_size) -> None:
    """Reference impl only (real process groups): the group exists and has ep_world_size ranks."""
    if ep_group_name is None:
        return
    from torch.distributed.distributed_c10d import _resolve_process_group

    size = _resolve_process_group(ep_group_name).size()
    if size != ep_world_size:
        raise ValueError(f"kosmos::{op}: ep_world_size={ep_world_size} but group {ep_group_name!r} has {size} ranks")


def _check_router_args(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, top_k, scoring,
                       n_group, topk_group, ep_world_size=1) -> None:
    e = gate_up_proj.shape[0] * ep_world_size  # all experts (EP: gate_up_proj holds this rank's E / ep_world_size)
    if router_weight.dim() != 2 or tuple(router_weight.shape) != (e, hidden.shape[1]):
        raise ValueError(
            f"kosmos::moe_layer: router_weight must be [E={e}, H={hidden.shape[1]}], got {tuple(router_weight.shape)}"
        )
    for name, b in (("router_bias", router_bias), ("score_correction_bias", score_correction_bias)):
        if b is not None and tuple(b.shape) != (e,):
            raise ValueError(f"kosmos::moe_layer: {name} must be [E={e}], got {tuple(b.shape)}")
    if scoring not in SCORINGS:
        raise ValueError(f"kosmos::moe_layer: scoring must be one of {SCORINGS}, got {scoring!r}")
    if not 1 <= top_k <= e:
        raise ValueError(f"kosmos::moe_layer: top_k={top_k} must be in [1, E={e}]")
    if n_group < 1 or e % n_group != 0 or not 1 <= topk_group <= n_group:
        raise ValueError(
            f"kosmos::moe_layer: n_group={n_group}, topk_group={topk_group} must satisfy E={e} % n_group == 0 and "
            "1 <= topk_group <= n_group"
        )
    if n_group > 1 and e // n_group < 2:
        raise ValueError(f"kosmos::moe_layer: group-limited routing needs >= 2 experts per group, got {e // n_group}")


def _check_routing(hidden, topk_ids, topk_weights, gate_up_proj) -> None:
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_ids.dtype.is_floating_point:
        raise ValueError(f"kosmos::moe_experts: topk_ids must be integer [T={hidden.shape[0]}, k], "
                         f"got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"kosmos::moe_experts: topk_weights {tuple(topk_weights.shape)} "
                         f"!= topk_ids {tuple(topk_ids.shape)}")



# --------------------------------------------------------------------------------------- moe_layer


@torch.library.custom_op("kosmos::moe_layer", mutates_args=())
def moe_layer(
    hidden: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: Optional[torch.Tensor],
    score_correction_bias: Optional[torch.Tensor],
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k: int,
    scoring: str,
    norm_topk_prob: bool,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    router_dtype: Optional[torch.dtype] = None,
    activation: str = "silu",
    return_router_logits: bool = False,
    ep_group_name: Optional[str] = None,
    ep_world_size: int = 1,
    ep_mode: str = "all_to_all",
    save_up: bool = True,
    weights_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """save_up=False: the saved up rows (output 3) come back empty [0, 2I] and are never written (what
    kosmos.passes.unused_saved_up sets where nothing reads them: graphs without a backward); a backward given them
    recomputes the up projection. weights_dtype: the routing weights' dtype (None: the logits'; Mixtral's router
    leaves them in fp32, so its bf16 products and fold run in fp32)."""
    args = (hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k, scoring,
            norm_topk_prob, n_group, topk_group, routed_scaling_factor, router_dtype, activation,
            return_router_logits, ep_group_name, ep_world_size, ep_mode, save_up, weights_dtype)
    _check_layer_args(*args)
    done, fused_out = dispatch.try_fused("moe_layer", hidden.device, *args)
    if done:
        return fused_out
    logits, ids, weights = route(hidden, router_weight, router_bias, score_correction_bias, top_k, scoring,
                                 norm_topk_prob, n_group, topk_group, routed_scaling_factor, router_dtype,
                                 weights_dtype)
    _check_ep_group("moe_layer", ep_group_name, ep_world_size)
    if ep_group_name is None:
        out, counts, *up = experts(hidden, ids, weights, gate_up_proj, down_proj, activation, return_up=save_up)
        saved_up = up[0] if save_up else no_saved_up(gate_up_proj)
        topk_ids = ids.to(torch.int32)
    else:
        saved_up = no_saved_up(gate_up_proj)
        topk_ids = ids.new_empty(0, top_k, dtype=torch.int32)
        if ep_mode == "all_reduce":
            out, counts = _replicated_forward(hidden, ids, weights, gate_up_proj, down_proj, activation,
                                              ep_group_name)
        else:
            out, counts = ep_experts(hidden, ids, weights, gate_up_proj, down_proj, activation, ep_group_name,
                                     ep_world_size)
    keep_logits = return_router_logits or ep_group_name is None
    return out, (logits if keep_logits else logits.new_empty(0, logits.shape[1])), counts, saved_up, topk_ids


def saved_up_rows(hidden: torch.Tensor, gate_up_proj: torch.Tensor, top_k: int, ep_group_name: Optional[str],
                  save_up: bool = True) -> int:
    """Rows of moe_layer's saved up output: T * k pairs + E pad rows without EP, none with EP (the rows an owner
    receives depend on the routing, so under EP the backward recomputes them) or with save_up=False."""
    return hidden.shape[0] * top_k + gate_up_proj.shape[0] if ep_group_name is None and save_up else 0


def no_saved_up(gate_up_proj: torch.Tensor) -> torch.Tensor:
    """moe_layer's saved up output where it keeps none (under EP, or save_up=False): [0, 2I]."""
    return gate_up_proj.new_empty(0, gate_up_proj.shape[1])


def _check_layer_args(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k,
                      scoring, norm_topk_prob, n_group, topk_group, routed_scaling_factor, router_dtype, activation,
                      return_router_logits, ep_group_name, ep_world_size, ep_mode="all_to_all", save_up=True,
                      weights_dtype=None):
    _check_experts_args("moe_layer", hidden, gate_up_proj, down_proj, activation, ep_group_name, ep_world_size)
    if weights_dtype is not None and not weights_dtype.is_floating_point:
        raise ValueError(f"kosmos::moe_layer: weights_dtype must be a floating dtype or None, got {weights_dtype}")
    if ep_mode not in EP_MODES:
        raise ValueError(f"kosmos::moe_layer: ep_mode must be one of {EP_MODES}, got {ep_mode!r}")
    if ep_mode == "all_reduce" and ep_group_name is None:
        raise ValueError("kosmos::moe_layer: ep_mode='all_reduce' needs an ep_group_name")
    _check_router_args(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, top_k, scoring,
                       n_group, topk_group, ep_world_size)


@moe_layer.register_fake
def _moe_layer_fake(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k,
                    scoring, norm_topk_prob, n_group=1, topk_group=1, routed_scaling_factor=1.0, router_dtype=None,
                    activation="silu", return_router_logits=False, ep_group_name=None, ep_world_size=1,
                    ep_mode="all_to_all", save_up=True, weights_dtype=None):
    _check_layer_args(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k,
                      scoring, norm_topk_prob, n_group, topk_group, routed_scaling_factor, router_dtype, activation,
                      return_router_logits, ep_group_name, ep_world_size, ep_mode, save_up, weights_dtype)
    e = gate_up_proj.shape[0] * ep_world_size
    logits_dtype = router_dtype or hidden.dtype
    rows = hidden.shape[0] if return_router_logits or ep_group_name is None else 0
    return (
        hidden.new_empty(hidden.shape),
        hidden.new_empty(rows, e, dtype=logits_dtype),
        hidden.new_empty(e, dtype=torch.int32),
        gate_up_proj.new_empty(saved_up_rows(hidden, gate_up_proj, top_k, ep_group_name, save_up),
                               gate_up_proj.shape[1]),
        hidden.new_empty(hidden.shape[0] if ep_group_name is None else 0, top_k, dtype=torch.int32),
    )


@torch.library.custom_op("kosmos::moe_layer_backward", mutates_args=("saved_up",))
def moe_layer_backward(
    grad_out: torch.Tensor,
    grad_router_logits: Optional[torch.Tensor],
    hidden: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: Optional[torch.Tensor],
    score_correction_bias: Optional[torch.Tensor],
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k: int,
    scoring: str,
    norm_topk_prob: bool,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    router_dtype: Optional[torch.dtype],
    activation: str,
    ep_group_name: Optional[str],
    ep_world_size: int,
    ep_mode: str = "all_to_all",
    weights_dtype: Optional[torch.dtype] = None,
    grads_needed: Optional[list[bool]] = None,
    saved_up: Optional[torch.Tensor] = None,
    topk_ids: Optional[torch.Tensor] = None,
    router_logits: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (grad_out, grad_router_logits, hidden, router_weight, router_bias, score_correction_bias, gate_up_proj,
            down_proj, top_k, scoring, norm_topk_prob, n_group, topk_group, routed_scaling_factor, router_dtype,
            activation, ep_group_name, ep_world_size, ep_mode, weights_dtype, saved_up, topk_ids, router_logits)
    needed = _grads_needed(grads_needed, router_bias)
    with_saved_up, forward_ids = _check_saved_state(saved_up, topk_ids, hidden, gate_up_proj, top_k, ep_group_name)
    forward_logits = _check_saved_logits(router_logits, forward_ids, hidden, router_weight, router_dtype)
    frozen = [name for name, need in zip(_GRAD_NAMES, needed) if not need]
    refuse = (f"gradients not needed ({', '.join(frozen)}): the reference impl skips their matmuls, the fused "
              "backward computes every gradient") if frozen else None
    done, fused_out = dispatch.try_fused("moe_layer_backward", hidden.device, *args, refuse=refuse)
    if done:
        return _backward_outputs(fused_out, router_weight)
    routed = _route_forward(hidden, router_weight, router_bias, score_correction_bias, top_k, scoring, norm_topk_prob,
                            n_group, topk_group, routed_scaling_factor, router_dtype, ids=forward_ids,
                            logits=forward_logits, weights_dtype=weights_dtype)
    _, ids, weights, route_state = routed
    # the router's cast copy of hidden ([T, H] fp32 for DeepSeek-V3's router) is made again after the experts'
    # backward instead of being kept through it (their peak memory)
    recast = router_dtype is not None and router_dtype != hidden.dtype
    if recast:
        route_state["hidden"] = None
    _check_ep_group("moe_layer_backward", ep_group_name, ep_world_size)
    if with_saved_up:  # the router's d_hidden goes into the experts' fold (no fp32 [T, H] add pass)
        rows = _SortedPairs(ids, gate_up_proj.shape[0])
        d_h, d_weights, d_gate_up, d_down = experts_backward_saved_rows(grad_out, hidden, rows, weights,
                                                                        gate_up_proj, down_proj, saved_up,
                                                                        wgrads=needed[2:4])
        d_logits = _router_d_logits(d_weights, grad_router_logits, routed, scoring, routed_scaling_factor)
        # after d_logits: the router's temporaries stay off the peak
        d_x = _grouped_mm(d_h, gate_up_proj, rows.groups) if needed[0] else None
        del d_h
        d_hidden = None if d_x is None else _fold_saved(d_x, rows.row, hidden.shape[0], top_k, saved_up, d_logits,
                                                        route_state["router_weight"], route_state["weight_exact"],
                                                        hidden.dtype)
        del d_x
        d_router_weight = d_router_bias = None
        if needed[1] or (needed[4] and router_bias is not None):
            if recast:  # bf16 hidden into split_mm as it is (its values are the fp32 copy's): no fp32 copy
                as_is = (router_dtype == torch.float32 and hidden.dtype == torch.bfloat16
                         and router_weight.dtype.itemsize == 2 and split_mm.supported(d_logits, hidden))
                route_state["hidden"] = hidden if as_is else hidden.to(router_dtype)
            d_router_weight, d_router_bias = _router_param_grads(d_logits, route_state["hidden"], router_weight,
                                                                 router_bias, needed[1], needed[4],
                                                                 route_state["hidden_exact"])
    else:
        if ep_mode == "all_reduce":
            d_hidden, d_weights, d_gate_up, d_down = _replicated_backward(
                grad_out, hidden, ids, weights, gate_up_proj, down_proj, activation, ep_group_name)
        else:
            d_hidden, d_weights, d_gate_up, d_down = _experts_backward_any(
                grad_out, hidden, ids, weights, gate_up_proj, down_proj, activation, ep_group_name, ep_world_size,
                wgrads=needed[2:4])
        if recast:
            route_state["hidden"] = hidden.to(router_dtype)
        d_hidden, d_router_weight, d_router_bias = route_backward(
            d_weights, grad_router_logits, routed, router_weight, router_bias, scoring, routed_scaling_factor,
            d_hidden)
    # a copy even in hidden's dtype: d_hidden may live in saved_up's storage, which an output must not alias
    grads = [d_hidden.to(hidden.dtype, copy=True) if needed[0] else None, d_router_weight, d_gate_up, d_down]
    return _backward_outputs(grads + [d_router_bias], router_weight, needed, (hidden, router_weight, gate_up_proj,
                                                                              down_proj, router_bias))


_GRAD_NAMES = ("hidden", "router_weight", "gate_up_proj", "down_proj", "router_bias")
_EXPERTS_GRAD_NAMES = ("hidden", "topk_weights", "gate_up_proj", "down_proj")


def _flags(op: str, grads_needed, names) -> list[bool]:
    """A backward op's grads_needed as one flag per output gradient (named `names`, in the outputs' order; None:
    all); raises for a list of another length."""
    if grads_needed is None:
        return [True] * len(names)
    if len(grads_needed) != len(names):
        raise ValueError(f"kosmos::{op}: grads_needed has {len(grads_needed)} flags, want {len(names)} "
                         f"({', '.join(names)})")
    return [bool(n) for n in grads_needed]


def _grads_needed(grads_needed, router_bias) -> list[bool]:
    """moe_layer_backward's grads_needed as 5 flags in the outputs' order ([d_hidden, d_router_weight,
    d_gate_up_proj, d_down_proj, d_router_bias]; None: all); d_router_bias counts as needed without a router bias
    (its output is empty either way)."""
    needed = _flags("moe_layer_backward", grads_needed, _GRAD_NAMES)
    return needed[:4] + [needed[4] or router_bias is None]


def _backward_outputs(grads, router_weight, needed=None, like=None):
    """The op's 5 outputs from [d_hidden, d_router_weight, d_gate_up_proj, d_down_proj] (+ [d_router_bias]): an
    empty d_router_bias without a router bias, and with `needed` (5 flags) and `like` (the 5 inputs they are
    gradients of) an empty tensor for each gradient not needed. Fixed tensor outputs, not a list: torch
    functionalizes a custom op that mutates an input (saved_up) only when each output is a plain Tensor."""
    grads = list(grads[:4]) + [grads[4] if len(grads) > 4 else None]
    if needed is not None:
        grads = [g if need else None for g, need in zip(grads, needed)]
        grads = [g if g is not None or t is None else t.new_empty(0) for g, t in zip(grads, like)]
    return (*grads[:4], grads[4] if grads[4] is not None else router_weight.new_empty(0))


def _check_saved_state(saved_up, topk_ids, hidden, gate_up_proj, top_k, ep_group_name):
    """What moe_layer saved for the backward -> (saved_up is given, the forward's routing or None); raises for
    shapes that are not moe_layer's outputs, and for saved_up without the routing its rows follow."""
    with_saved_up = saved_up is not None and saved_up.shape[0] > 0
    if with_saved_up:
        want = (saved_up_rows(hidden, gate_up_proj, top_k, ep_group_name), gate_up_proj.shape[1])
        if tuple(saved_up.shape) != want or saved_up.dtype != gate_up_proj.dtype:
            raise ValueError(f"kosmos::moe_layer_backward: saved_up {tuple(saved_up.shape)} {saved_up.dtype} is not "
                             f"moe_layer's saved up output {want} {gate_up_proj.dtype}")
    # under EP moe_layer returns topk_ids [0, k]: the EP backward selects again (as saved_up_rows says for saved_up)
    forward_ids = topk_ids if topk_ids is not None and ep_group_name is None else None
    if forward_ids is not None and (tuple(forward_ids.shape) != (hidden.shape[0], top_k)
                                    or forward_ids.dtype.is_floating_point):
        raise ValueError(f"kosmos::moe_layer_backward: topk_ids {tuple(forward_ids.shape)} {forward_ids.dtype} is not "
                         f"moe_layer's routing output [{hidden.shape[0]}, {top_k}] int32")
    if with_saved_up and forward_ids is None:
        raise ValueError("kosmos::moe_layer_backward: saved_up without topk_ids (saved_up's rows follow the forward's "
                         "routing, which the backward must reuse)")
    return with_saved_up, forward_ids


def _check_saved_logits(router_logits, forward_ids, hidden, router_weight, router_dtype):
    """The forward's router logits if the backward may use them (given with the forward's routing), else None;
    raises for a tensor that is not moe_layer's logits output."""
    if router_logits is None or forward_ids is None:
        return None
    want = (hidden.shape[0], router_weight.shape[0])
    if tuple(router_logits.shape) != want or router_logits.dtype != (router_dtype or hidden.dtype):
        raise ValueError(f"kosmos::moe_layer_backward: router_logits {tuple(router_logits.shape)} "
                         f"{router_logits.dtype} is not moe_layer's logits output {want} "
                         f"{router_dtype or hidden.dtype}")
    return router_logits


@moe_layer_backward.register_fake
def _moe_layer_backward_fake(grad_out, grad_router_logits, hidden, router_weight, router_bias, score_correction_bias,
                             gate_up_proj, down_proj, top_k, scoring, norm_topk_prob, n_group, topk_group,
                             routed_scaling_factor, router_dtype, activation, ep_group_name, ep_world_size,
                             ep_mode="all_to_all", weights_dtype=None, grads_needed=None, *rest):
    like = (hidden, router_weight, gate_up_proj, down_proj, router_bias)
    grads = [torch.empty_like(t) if t is not None else None for t in like]
    return _backward_outputs(grads, router_weight, _grads_needed(grads_needed, router_bias), like)


if version_bump.torch_kernel_walks_schema():
    version_bump.install(torch.ops.kosmos.moe_layer_backward.default, "saved_up")

_LAYER_SCALARS = ("top_k", "scoring", "norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor",
                  "router_dtype", "activation", "return_router_logits", "ep_group_name", "ep_world_size", "ep_mode",
                  "save_up", "weights_dtype")


def _moe_layer_setup_context(ctx, inputs, output):
    hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj = inputs[:6]
    ctx.save_for_backward(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj,
                          output[3], output[4], output[1])
    ctx.scalars = dict(zip(_LAYER_SCALARS, inputs[6:]))
    ctx.mark_non_differentiable(output[2], output[3], output[4])


def _may_overwrite(saved: torch.Tensor) -> bool:
    """Whether the backward may overwrite the saved tensor `saved`: a second backward through the same graph must
    then raise, not compute on the overwritten data. Eagerly autograd's version counter raises; in a graph that
    AOT autograd traces, its donated-buffer check raises on retain_graph=True, but only where donated buffers are
    on (torch._functorch.config.donated_buffer): without them the backward gets a copy."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    if not isinstance(saved, (FakeTensor, FunctionalTensor)):
        return True
    import torch._functorch.config as functorch_config

    return bool(getattr(functorch_config, "donated_buffer", False))


def _moe_layer_autograd(ctx, grad_out, grad_router_logits, _grad_counts, _grad_saved_up, _grad_topk_ids):
    (hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, saved_up, topk_ids,
     router_logits) = ctx.saved_tensors
    if saved_up.shape[0] and not _may_overwrite(saved_up):
        saved_up = saved_up.clone()
    s = ctx.scalars
    if not s["return_router_logits"]:
        grad_router_logits = None
    need = ctx.needs_input_grad  # frozen parameters (fine-tuning) want no gradient: their matmuls are skipped
    grads_needed = [need[0], need[1], need[4], need[5], need[2] or router_bias is None]
    grads = torch.ops.kosmos.moe_layer_backward(
        grad_out, grad_router_logits, hidden, router_weight, router_bias, score_correction_bias, gate_up_proj,
        down_proj, s["top_k"], s["scoring"], s["norm_topk_prob"], s["n_group"], s["topk_group"],
        s["routed_scaling_factor"], s["router_dtype"], s["activation"], s["ep_group_name"], s["ep_world_size"],
        s["ep_mode"], s["weights_dtype"], grads_needed, saved_up, topk_ids,
        router_logits if s["ep_group_name"] is None else None,
    )
    d_hidden, d_router_weight, d_gate_up, d_down = [g if n else None for g, n in zip(grads[:4], grads_needed)]
    d_router_bias = grads[4] if router_bias is not None and grads_needed[4] else None
    return (d_hidden, d_router_weight, d_router_bias, None, d_gate_up, d_down) + (None,) * len(_LAYER_SCALARS)


moe_layer.register_autograd(_moe_layer_autograd, setup_context=_moe_layer_setup_context)


# ------------------------------------------------------------------------------------- moe_experts


@torch.library.custom_op("kosmos::moe_experts", mutates_args=())
def moe_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str = "silu",
    ep_group_name: Optional[str] = None,
    ep_world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation, ep_group_name, ep_world_size)
    _check_experts_args("moe_experts", hidden, gate_up_proj, down_proj, activation, ep_group_name, ep_world_size)
    _check_routing(hidden, topk_ids, topk_weights, gate_up_proj)
    done, fused_out = dispatch.try_fused("moe_experts", hidden.device, *args)
    if done:
        return fused_out
    _check_ep_group("moe_experts", ep_group_name, ep_world_size)
    return _experts_any(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation, ep_group_name,
                        ep_world_size)


@moe_experts.register_fake
def _moe_experts_fake(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation="silu",
                      ep_group_name=None, ep_world_size=1):
    _check_experts_args("moe_experts", hidden, gate_up_proj, down_proj, activation, ep_group_name, ep_world_size)
    _check_routing(hidden, topk_ids, topk_weights, gate_up_proj)
    return hidden.new_empty(hidden.shape), hidden.new_empty(gate_up_proj.shape[0] * ep_world_size, dtype=torch.int32)


@torch.library.custom_op("kosmos::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    grad_out: torch.Tensor,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
    ep_group_name: Optional[str],
    ep_world_size: int,
    grads_needed: Optional[list[bool]] = None,
) -> list[torch.Tensor]:
    args = (grad_out, hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation, ep_group_name,
            ep_world_size)
    needed = _flags("moe_experts_backward", grads_needed, _EXPERTS_GRAD_NAMES)
    done, fused_out = dispatch.try_fused("moe_experts_backward", hidden.device, *args)
    if done:
        return fused_out
    _check_ep_group("moe_experts_backward", ep_group_name, ep_world_size)
    d_hidden, d_weights, d_gate_up, d_down = _experts_backward_any(grad_out, hidden, topk_ids, topk_weights,
                                                                   gate_up_proj, down_proj, activation, ep_group_name,
                                                                   ep_world_size, wgrads=needed[2:4])
    grads = [d_hidden.to(hidden.dtype), d_weights, d_gate_up, d_down]
    like = (hidden, topk_weights, gate_up_proj, down_proj)
    return [g if need else t.new_empty(0) for g, t, need in zip(grads, like, needed)]


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(grad_out, hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation,
                               ep_group_name, ep_world_size, grads_needed=None):
    like = (hidden, topk_weights, gate_up_proj, down_proj)
    return [torch.empty_like(t) if need else t.new_empty(0)
            for t, need in zip(like, _flags("moe_experts_backward", grads_needed, _EXPERTS_GRAD_NAMES))]


def _moe_experts_setup_context(ctx, inputs, output):
    hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation, ep_group_name, ep_world_size = inputs
    ctx.save_for_backward(hidden, topk_ids, topk_weights, gate_up_proj, down_proj)
    ctx.scalars = (activation, ep_group_name, ep_world_size)


def _moe_experts_autograd(ctx, grad_out, _grad_counts):
    hidden, topk_ids, topk_weights, gate_up_proj, down_proj = ctx.saved_tensors
    need = ctx.needs_input_grad
    grads_needed = [need[0], need[2], need[3], need[4]]
    d_hidden, d_weights, d_gate_up, d_down = torch.ops.kosmos.moe_experts_backward(
        grad_out, hidden, topk_ids, topk_weights, gate_up_proj, down_proj, *ctx.scalars, grads_needed,
    )
    grads = [g if n else None for g, n in zip((d_hidden, d_weights, d_gate_up, d_down), grads_needed)]
    return grads[0], None, grads[1], grads[2], grads[3], None, None, None


moe_experts.register_autograd(_moe_experts_autograd, setup_context=_moe_experts_setup_context)
